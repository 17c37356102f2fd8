"""`infmoe-export train`: train an ∞-MoE model from scratch and write a checkpoint with its log."""

import json
import shlex
import sys
import time

import click

from ..checkpoint import save_checkpoint
from ..data import corpus_bytes, encode, windows
from ..evaluate import router_spread
from ..files import check_replaceable_dir
from ..limits import check_fits, forward_bytes
from ..model import InfMoEConfig
from ..options import FiniteFloat, SEED, THREADS, set_threads
from ..train import EVAL_WINDOWS, TRAIN_LOG, TRAINING_NOISE, train_model


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
@click.option("--lr", type=FiniteFloat(min=0, min_open=True, max=10), default=3e-3, show_default=True)
@click.option("--seed", type=SEED, default=0, show_default=True)
@click.option("--spread-weight", type=FiniteFloat(min=0, max=100), default=0.0, show_default=True,
              help="Weight of the training-only term that keeps each token's windows apart (docs/guide/model.md).")
@click.option("--training-noise", type=click.Choice(TRAINING_NOISE), default="sampled", show_default=True,
              help="How the K training samples are drawn (docs/guide/model.md).")
@click.option("--eval-every", type=click.IntRange(min=1), default=100, show_default=True)
@click.option("--threads", type=THREADS, default=None, help="Torch threads (default: $OMP_NUM_THREADS, else min(4, CPUs)).")
def train_command(corpus, out, d_model, n_layer, n_head, ffn_hidden, slice_width, num_samples,
                  n_positions, steps, batch_size, lr, seed, spread_weight, training_noise, eval_every, threads):
    """Train an ∞-MoE model from scratch on a byte corpus."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn


    out = check_replaceable_dir(out, inputs=[corpus])
    config = InfMoEConfig(vocab_size=256, n_positions=n_positions, d_model=d_model, n_layer=n_layer,
                          n_head=n_head, ffn_hidden=ffn_hidden, slice_width=slice_width,
                          num_samples=num_samples)
    # Weights, gradients and AdamW's two moments, and activations kept for the backward pass.
    check_fits(16 * config.parameter_count() + 4 * forward_bytes(config, batch_size, n_positions, num_samples),
               f"training this model at batch size {batch_size}")
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
                                 lr=lr, seed=seed, eval_every=eval_every, spread_weight=spread_weight,
                                 noise=training_noise, on_step=on_step)
    summary = {
        "command": shlex.join(["infmoe-export", *sys.argv[1:]]),
        "corpus": str(corpus) if corpus is not None else "stdlib",
        "steps": steps, "batch_size": batch_size, "lr": lr, "seed": seed, "threads": threads,
        "spread_weight": spread_weight, "training_noise": training_noise,
        "train_bytes": len(train_ids), "validation_bytes": sum(len(w) for w in val_windows),
        "final_val_loss": log[-1]["val_loss"], "wall_s": round(time.time() - started, 1),
    }
    spread = router_spread(model, val_windows[::max(1, len(val_windows) // EVAL_WINDOWS)])
    log_text = json.dumps({**summary, "router_spread": spread, "log": log}, indent=1, allow_nan=False) + "\n"
    save_checkpoint(model, out, metadata=summary, extra_files={TRAIN_LOG: log_text})
    click.echo(f"wrote {out} (validation loss {summary['final_val_loss']:.4f} nats/byte, "
               f"{summary['wall_s']} s)")
