"""Perplexity per expert budget K, and how widely the router spreads its windows over H.

Perplexity = exp(mean negative log-likelihood per predicted byte). The text is cut into
non-overlapping windows of n_positions bytes (the last one shorter); each window predicts its
2nd..last byte from the bytes before it in that window, so every window starts from no context.
"""

import math
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

from .errors import InfMoEError
from .model import NOISE_MODES, InfMoEGPT


def sampled_noise(windows: Sequence[torch.Tensor], k: int, seed: int) -> List[torch.Tensor]:
    """eps ~ N(0, 1) of shape [len(window), K] for each window, drawn in window order from one
    seeded generator, so the noise of a window does not depend on how windows are batched."""
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(len(w), k, generator=generator) for w in windows]


def batches(windows: Sequence[torch.Tensor], batch_size: int):
    """Indices of windows in runs of equal length (only the last window is shorter), at most
    batch_size each, so a batch needs no padding."""
    run: List[int] = []
    for i, window in enumerate(windows):
        if run and (len(run) == batch_size or len(windows[run[0]]) != len(window)):
            yield run
            run = []
        run.append(i)
    if run:
        yield run


def next_token_nll(logits, ids) -> Tuple[float, int]:
    """(sum of next-token NLL in nats, predicted tokens) of logits [B, T, V] for ids [B, T]:
    each row predicts its 2nd..last token. Computed in float64, numpy or torch input alike."""
    logits, ids = torch.as_tensor(logits).double(), torch.as_tensor(ids)
    total = F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten(), reduction="sum").item()
    return total, ids[:, 1:].numel()


def perplexity_of_logits(logits: Sequence, ids: Sequence) -> float:
    """exp(mean next-token NLL) over batches of logits from any backend (parity reports)."""
    total, count = map(sum, zip(*(next_token_nll(lg, t) for lg, t in zip(logits, ids))))
    return math.exp(total / count)


@torch.no_grad()
def window_nll(model: InfMoEGPT, windows: Sequence[torch.Tensor], k: int, noise: str = "quantile",
               seed: int = 0, batch_size: int = 16):
    """(sum of next-byte NLL in nats, number of predicted bytes) over the windows."""
    if noise not in NOISE_MODES:
        raise InfMoEError(f"noise mode must be one of {NOISE_MODES}, got {noise!r}")
    if not isinstance(k, int) or k < 1:
        raise InfMoEError(f"expert budget K must be a positive integer, got {k!r}")
    was_training = model.training
    model.eval()
    eps = sampled_noise(windows, k, seed) if noise == "sampled" else None
    total, count = 0.0, 0
    for run in batches(windows, batch_size):
        ids = torch.stack([windows[i] for i in run])
        if ids.shape[1] < 2:
            continue  # a one-byte window predicts nothing
        expert_noise = torch.stack([eps[i] for i in run]) if eps is not None else None
        logits = model(ids, k=k, noise=noise, expert_noise=expert_noise).logits
        nll, predicted = next_token_nll(logits, ids)
        total, count = total + nll, count + predicted
    model.train(was_training)
    return total, count


def perplexity(model: InfMoEGPT, windows: Sequence[torch.Tensor], k: int, noise: str = "quantile",
               seed: int = 0, batch_size: int = 16) -> float:
    total, count = window_nll(model, windows, k, noise, seed, batch_size)
    if count == 0:
        raise InfMoEError("text too short: need at least 2 bytes to predict one")
    return math.exp(total / count)


@torch.no_grad()
def window_union(starts: torch.Tensor, slice_width: int) -> torch.Tensor:
    """Hidden units in each token's union of windows [s, s + r), for starts [..., K]: r plus
    each gap between sorted starts, capped at r."""
    ordered = starts.sort(dim=-1).values
    return slice_width + ordered.diff(dim=-1).clamp(max=slice_width).sum(-1)


def router_spread(model: InfMoEGPT, windows: Sequence[torch.Tensor], k: Optional[int] = None,
                  batch_size: int = 16) -> List[Dict]:
    """Per layer, over all tokens (quantile noise): the share of H covered by the union of all
    windows, the share of the start range [0, H - r] used, the std of starts as a share of
    H - r (a uniform spread gives ~0.29), the most common start's share of all starts, and the
    mean size of one token's union of K windows in units of r (1 when all K coincide, K when
    they are disjoint): how much K can change a token's output."""
    c = model.config
    k = c.num_samples if k is None else k
    was_training = model.training
    model.eval()
    per_layer = [[] for _ in range(c.n_layer)]
    for run in batches(windows, batch_size):
        starts = model(torch.stack([windows[i] for i in run]), k=k, return_starts=True).starts
        for layer, s in enumerate(starts):
            per_layer[layer].append(s.reshape(-1, k))
    model.train(was_training)
    positions = c.ffn_hidden - c.slice_width + 1
    stats = []
    for layer, chunks in enumerate(per_layer):
        per_token = torch.cat(chunks)
        s = per_token.flatten()
        counts = torch.bincount(s, minlength=positions)
        covered = torch.zeros(c.ffn_hidden + 1)
        used = (counts > 0).nonzero().flatten()
        covered.index_add_(0, used, torch.ones(len(used)))
        covered.index_add_(0, used + c.slice_width, -torch.ones(len(used)))
        stats.append({
            "layer": layer,
            "union_coverage": (covered.cumsum(0)[:-1] > 0).float().mean().item(),
            "starts_used": (counts > 0).float().mean().item(),
            "start_std": (s.float().std().item() / max(positions - 1, 1)) if s.numel() > 1 else 0.0,
            "top_start_share": (counts.max() / s.numel()).item(),
            "token_union": (window_union(per_token, c.slice_width).float().mean() / c.slice_width).item(),
        })
    return stats


def expert_load(model: InfMoEGPT, windows: Sequence[torch.Tensor], batch_size: int = 16) -> List[Dict]:
    """Per layer of a conventional MoE, over all tokens: each expert's share of the tokens' top_k
    choices (1 / E each when balanced), and the largest share."""
    c = model.config
    was_training = model.training
    model.eval()
    counts = torch.zeros(c.n_layer, c.num_experts)
    with torch.no_grad():
        for run in batches(windows, batch_size):
            experts = model(torch.stack([windows[i] for i in run]), return_starts=True).starts
            for layer, chosen in enumerate(experts):
                counts[layer] += torch.bincount(chosen.flatten(), minlength=c.num_experts).float()
    model.train(was_training)
    shares = counts / counts.sum(-1, keepdim=True).clamp(min=1)
    return [{"layer": layer, "expert_share": row.tolist(), "top_expert_share": row.max().item()}
            for layer, row in enumerate(shares)]
