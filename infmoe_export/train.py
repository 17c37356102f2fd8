"""Train an ∞-MoE GPT, or the conventional top-k MoE beside it, from scratch on bytes: AdamW,
linear warm-up then cosine decay, periodic validation loss, an atomic checkpoint. ∞-MoE: sampled
expert noise (the paper's Monte-Carlo estimator) and a training-only spread term that keeps each
token's windows apart. Conventional MoE: the Switch load-balancing loss, training-only too."""

import contextlib

import math
from typing import Callable, Dict, List, Optional, Sequence

import torch
import torch.nn.functional as F

from .errors import InfMoEError
from .model import InfMoE, InfMoEConfig, InfMoEGPT, TopKMoE, is_bias, model_for, top_k_experts

TRAIN_LOG = "train_log.json"
# Validation during training uses an evenly spaced subset of windows so it stays cheap;
# the final validation loss uses them all.
EVAL_WINDOWS = 64


def lr_at(step: int, steps: int, lr: float, warmup: int) -> float:
    """Linear warm-up to lr, then cosine decay to lr / 10."""
    if step < warmup:
        return lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def optimizer_for(model: InfMoEGPT, lr: float, weight_decay: float) -> torch.optim.Optimizer:
    """Weight decay on matrices only (not on the conventional MoE's per-expert bias rows); never on
    the router, whose decay would pull every mu towards 0 and so every window towards the middle
    of H (and, in the conventional MoE, every token towards equal expert logits)."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (decay if p.dim() >= 2 and not is_bias(name) and ".router." not in name else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95))


TRAINING_NOISE = ("sampled", "stratified")


def training_noise(mode: str, shape, generator: torch.Generator) -> torch.Tensor:
    """eps [B, T, K] for one training step.

    sampled: eps ~ N(0, 1) per token and sample, the paper's Monte-Carlo estimator.
    stratified: sample k drawn from its own 1/K slice of the Gaussian, Phi^-1((k - 1 + U) / K)
    with U ~ U(0, 1): still an unbiased estimate of the expected layer output, with K windows that
    always span the router's whole spread, as the deployed quantile noise (U = 1/2) does."""
    if mode == "sampled":
        return torch.randn(shape, generator=generator)
    if mode == "stratified":
        k = shape[-1]
        u = torch.rand(shape, generator=generator, dtype=torch.float64).clamp(1e-6, 1 - 1e-6)
        return torch.special.ndtri((torch.arange(k, dtype=torch.float64) + u) / k).float()
    raise InfMoEError(f"training noise must be one of {TRAINING_NOISE}, got {mode!r}")


def random_batch(ids: torch.Tensor, batch_size: int, length: int, generator: torch.Generator):
    """batch_size random chunks of length + 1 bytes: inputs and next-byte targets."""
    starts = torch.randint(0, len(ids) - length, (batch_size,), generator=generator)
    chunks = torch.stack([ids[s:s + length + 1] for s in starts.tolist()])
    return chunks[:, :-1], chunks[:, 1:]


def start_entropy(mu: torch.Tensor, sigma: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """Per token, the differential entropy of the continuous start t = sigmoid(z)(H - r + 1),
    z ~ N(mu, sigma^2), up to constants: log sigma + E[log sigmoid'(z)], the expectation over the
    token's own samples z. It acts on where the windows land in hidden units, not on sigma alone:
    a large |mu| saturates the sigmoid and collapses the windows whatever sigma is
    (../shared/notes/tradeoff-experiments.md), and this term sees that through sigmoid'(z).
    Bounded above (t uniform over the start range), so it cannot grow without limit."""
    log_sigmoid_slope = -F.softplus(z) - F.softplus(-z)  # log(sigmoid(z) * sigmoid(-z))
    return torch.log(sigma).squeeze(-1) + log_sigmoid_slope.mean(-1)


@contextlib.contextmanager
def router_entropies(model: InfMoEGPT):
    """Collects start_entropy of every layer's router during the forwards in this block."""
    collected: List[torch.Tensor] = []

    def hook(router, inputs, z):
        x = inputs[0]
        collected.append(start_entropy(router.mu(x), F.softplus(router.sigma(x)), z))

    handles = [block.moe.router.register_forward_hook(hook) for block in model.h
               if isinstance(block.moe, InfMoE)
               and block.moe.slice_width < block.moe.ffn_hidden]  # a dense layer has no windows
    try:
        yield collected
    finally:
        for handle in handles:
            handle.remove()


def balance_loss(logits: torch.Tensor, top_k: int) -> torch.Tensor:
    """Switch's load-balancing loss of one layer's router logits [..., E]: E * sum_e f_e * P_e,
    f_e the share of the tokens' top_k choices that went to expert e (no gradient), P_e the mean
    router probability of e (softmax over all E). 1 when both are uniform, E when one expert
    takes every token."""
    E = logits.shape[-1]
    flat = logits.reshape(-1, E)
    chosen = top_k_experts(flat, top_k).flatten()
    share = torch.bincount(chosen, minlength=E).to(flat.dtype) / chosen.numel()
    return E * (share * torch.softmax(flat, dim=-1).mean(0)).sum()


@contextlib.contextmanager
def router_balance(model: InfMoEGPT):
    """Collects balance_loss of every conventional-MoE layer during the forwards in this block."""
    collected: List[torch.Tensor] = []
    handles = []
    for block in model.h:
        if isinstance(block.moe, TopKMoE):
            top_k = block.moe.top_k
            handles.append(block.moe.router.register_forward_hook(
                lambda router, inputs, logits, top_k=top_k: collected.append(balance_loss(logits, top_k))))
    try:
        yield collected
    finally:
        for handle in handles:
            handle.remove()


def train_model(config: InfMoEConfig, train_ids: torch.Tensor, val_windows: Sequence[torch.Tensor], *,
                steps: int, batch_size: int, lr: float, seed: int, eval_every: int,
                weight_decay: float = 0.1, warmup: Optional[int] = None, spread_weight: float = 0.0,
                noise: str = "sampled", balance_weight: float = 0.01,
                on_step: Optional[Callable[[int, float, Optional[float]], None]] = None):
    """Returns (model in eval mode, log: a list of {step, lr, loss[, spread][, balance][, val_loss]}
    records), for config of either architecture.

    The loss minimised is cross-entropy - spread_weight * mean start entropy (∞-MoE, over tokens
    and layers) + balance_weight * mean balance_loss (conventional MoE, over layers); the logged
    `loss` is the cross-entropy alone, comparable across weights and architectures. noise and
    spread_weight apply to ∞-MoE only, balance_weight to the conventional MoE only."""
    from .evaluate import window_nll

    length = config.n_positions
    if len(train_ids) < length + 1:
        raise InfMoEError(f"the training split has {len(train_ids)} bytes; it needs at least "
                          f"n_positions + 1 = {length + 1}")
    torch.manual_seed(seed)
    model = model_for(config)
    model.reset_parameters(seed)
    infmoe = isinstance(config, InfMoEConfig)
    model.train()
    optimizer = optimizer_for(model, lr, weight_decay)
    warmup = max(1, steps // 20) if warmup is None else warmup
    data_generator = torch.Generator().manual_seed(seed)
    noise_generator = torch.Generator().manual_seed(seed + 1)
    stride = max(1, len(val_windows) // EVAL_WINDOWS)
    eval_windows = list(val_windows[::stride])[:EVAL_WINDOWS]

    def val_loss(windows):
        total, count = window_nll(model, windows, config.default_k, "quantile")
        return total / max(count, 1)

    log: List[Dict] = []
    for step in range(steps):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, steps, lr, warmup)
        x, y = random_batch(train_ids, batch_size, length, data_generator)
        # Gradients whatever the caller's mode (a caller inside torch.no_grad, say).
        with torch.enable_grad(), router_entropies(model) as entropies, router_balance(model) as balances:
            eps = training_noise(noise, (*x.shape, config.num_samples), noise_generator) if infmoe else None
            logits = model(x, expert_noise=eps).logits
            loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
            spread = torch.stack([e.mean() for e in entropies]).mean() if entropies else None
            balance = torch.stack(balances).mean() if balances else None
            objective = loss - spread_weight * spread if spread is not None and spread_weight else loss
            if balance is not None and balance_weight:
                objective = objective + balance_weight * balance
        optimizer.zero_grad(set_to_none=True)
        objective.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        record = {"step": step + 1, "lr": optimizer.param_groups[0]["lr"], "loss": loss.item()}
        if spread is not None:
            record["spread"] = spread.item()
        if balance is not None:
            record["balance"] = balance.item()
        if (step + 1) % eval_every == 0 or step + 1 == steps:
            record["val_loss"] = val_loss(val_windows if step + 1 == steps else eval_windows)
        log.append(record)
        if on_step is not None:
            on_step(step + 1, record["loss"], record.get("val_loss"))
    return model.eval(), log
