"""Train an ∞-MoE GPT from scratch on bytes: AdamW, linear warm-up then cosine decay, sampled
expert noise (the paper's Monte-Carlo estimator), periodic validation loss, an atomic checkpoint."""

import json
import math
import os
import shlex
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

import click
import torch
import torch.nn.functional as F

from .errors import InfMoEError
from .model import InfMoEConfig, InfMoEGPT

TRAIN_LOG = "train_log.json"
# Validation during training uses an evenly spaced subset of windows so it stays cheap;
# the final validation loss uses them all.
EVAL_WINDOWS = 64


def set_threads(threads: Optional[int] = None) -> int:
    """Torch intra-op threads: as asked, else as OMP_NUM_THREADS says, else at most 4 (small
    models gain little beyond that, and on a shared machine more threads only fight)."""
    if threads is None and os.environ.get("OMP_NUM_THREADS"):
        return torch.get_num_threads()
    threads = threads or min(4, os.cpu_count() or 1)
    torch.set_num_threads(threads)
    return threads


def lr_at(step: int, steps: int, lr: float, warmup: int) -> float:
    """Linear warm-up to lr, then cosine decay to lr / 10."""
    if step < warmup:
        return lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def optimizer_for(model: InfMoEGPT, lr: float, weight_decay: float) -> torch.optim.Optimizer:
    """Weight decay on matrices only; never on the router, whose decay would pull every mu
    towards 0 and so every window towards the middle of H."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (decay if p.dim() >= 2 and ".router." not in name else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95))


def random_batch(ids: torch.Tensor, batch_size: int, length: int, generator: torch.Generator):
    """batch_size random chunks of length + 1 bytes: inputs and next-byte targets."""
    starts = torch.randint(0, len(ids) - length, (batch_size,), generator=generator)
    chunks = torch.stack([ids[s:s + length + 1] for s in starts.tolist()])
    return chunks[:, :-1], chunks[:, 1:]


def train_model(config: InfMoEConfig, train_ids: torch.Tensor, val_windows: Sequence[torch.Tensor], *,
                steps: int, batch_size: int, lr: float, seed: int, eval_every: int,
                weight_decay: float = 0.1, warmup: Optional[int] = None,
                on_step: Optional[Callable[[int, float, Optional[float]], None]] = None):
    """Returns (model in eval mode, log: a list of {step, lr, loss[, val_loss]} records)."""
    from .evaluate import window_nll

    length = config.n_positions
    if len(train_ids) < length + 1:
        raise InfMoEError(f"the training split has {len(train_ids)} bytes; it needs at least "
                          f"n_positions + 1 = {length + 1}")
    torch.manual_seed(seed)
    model = InfMoEGPT(config)
    model.reset_parameters(seed)
    model.train()
    optimizer = optimizer_for(model, lr, weight_decay)
    warmup = max(1, steps // 20) if warmup is None else warmup
    data_generator = torch.Generator().manual_seed(seed)
    noise_generator = torch.Generator().manual_seed(seed + 1)
    stride = max(1, len(val_windows) // EVAL_WINDOWS)
    eval_windows = list(val_windows[::stride])[:EVAL_WINDOWS]

    def val_loss(windows):
        total, count = window_nll(model, windows, config.num_samples, "quantile")
        return total / max(count, 1)

    log: List[Dict] = []
    for step in range(steps):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, steps, lr, warmup)
        x, y = random_batch(train_ids, batch_size, length, data_generator)
        logits = model(x, noise="sampled", generator=noise_generator).logits
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        record = {"step": step + 1, "lr": optimizer.param_groups[0]["lr"], "loss": loss.item()}
        if (step + 1) % eval_every == 0 or step + 1 == steps:
            record["val_loss"] = val_loss(val_windows if step + 1 == steps else eval_windows)
        log.append(record)
        if on_step is not None:
            on_step(step + 1, record["loss"], record.get("val_loss"))
    return model.eval(), log


def write_json_atomic(path: Path, data) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1)
            f.write("\n")
        os.chmod(tmp, 0o644)  # mkstemp makes it private; it is an ordinary file
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


@click.command("train")
@click.option("--corpus", type=click.Path(), default=None,
              help="A text file or a directory of text files (default: the Python standard library source).")
@click.option("--out", type=click.Path(), required=True, help="Checkpoint directory to write.")
@click.option("--d-model", type=int, default=128, show_default=True)
@click.option("--n-layer", type=int, default=4, show_default=True)
@click.option("--n-head", type=int, default=4, show_default=True)
@click.option("--ffn-hidden", type=int, default=1024, show_default=True, help="H, hidden units of the shared FFN.")
@click.option("--slice-width", type=int, default=256, show_default=True, help="r, hidden units per expert.")
@click.option("--num-samples", type=int, default=2, show_default=True, help="K, sampled experts in training.")
@click.option("--n-positions", type=int, default=256, show_default=True)
@click.option("--steps", type=click.IntRange(min=1), default=1000, show_default=True)
@click.option("--batch-size", type=click.IntRange(min=1), default=16, show_default=True)
@click.option("--lr", type=click.FloatRange(min=0, min_open=True), default=3e-3, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--eval-every", type=click.IntRange(min=1), default=100, show_default=True)
@click.option("--threads", type=click.IntRange(min=1), default=None, help="Torch threads (default: $OMP_NUM_THREADS, else min(4, CPUs)).")
def train_command(corpus, out, d_model, n_layer, n_head, ffn_hidden, slice_width, num_samples,
                  n_positions, steps, batch_size, lr, seed, eval_every, threads):
    """Train an ∞-MoE model from scratch on a byte corpus."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    from .checkpoint import save_checkpoint
    from .data import corpus_bytes, encode, windows
    from .evaluate import router_spread

    out = Path(out)
    if out.exists() and not out.is_dir():
        raise InfMoEError(f"--out {out} exists and is not a directory")
    config = InfMoEConfig(vocab_size=256, n_positions=n_positions, d_model=d_model, n_layer=n_layer,
                          n_head=n_head, ffn_hidden=ffn_hidden, slice_width=slice_width,
                          num_samples=num_samples)
    threads = set_threads(threads)
    train_ids = encode(corpus_bytes("train", corpus))
    val_windows = windows(corpus_bytes("validation", corpus), n_positions)

    started = time.time()
    columns = (TextColumn("train"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[status]}"),
               TimeRemainingColumn())
    with Progress(*columns, transient=False) as progress:
        task = progress.add_task("train", total=steps, status="")
        last_val = [None]

        def on_step(step, loss, val):
            last_val[0] = val if val is not None else last_val[0]
            status = f"loss {loss:.3f}" + (f"  val {last_val[0]:.3f}" if last_val[0] is not None else "")
            progress.update(task, advance=1, status=status)

        model, log = train_model(config, train_ids, val_windows, steps=steps, batch_size=batch_size,
                                 lr=lr, seed=seed, eval_every=eval_every, on_step=on_step)
    summary = {
        "command": shlex.join(["infmoe-export", *sys.argv[1:]]),
        "corpus": str(corpus) if corpus is not None else "stdlib",
        "steps": steps, "batch_size": batch_size, "lr": lr, "seed": seed, "threads": threads,
        "train_bytes": len(train_ids), "validation_bytes": sum(len(w) for w in val_windows),
        "final_val_loss": log[-1]["val_loss"], "wall_s": round(time.time() - started, 1),
    }
    save_checkpoint(model, out, metadata=summary)
    spread = router_spread(model, val_windows[::max(1, len(val_windows) // EVAL_WINDOWS)])
    write_json_atomic(out / TRAIN_LOG, {**summary, "router_spread": spread, "log": log})
    click.echo(f"wrote {out} (validation loss {summary['final_val_loss']:.4f} nats/byte, "
               f"{summary['wall_s']} s)")
