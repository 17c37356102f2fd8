"""`infmoe-export train`: train an ∞-MoE model, or the conventional top-k MoE beside it (--arch moe),
from scratch and write a checkpoint with its log."""

import json
import shlex
import sys
import time

import click

from ..checkpoint import save_checkpoint
from ..data import corpus_bytes, encode, windows
from ..evaluate import expert_load, router_spread
from ..errors import InfMoEError, raise_if_interrupted
from ..files import check_replaceable_dir
from ..limits import check_fits, forward_bytes
from ..model import ROUTER_SOFTMAX, InfMoEConfig, MoEConfig
from ..options import FiniteFloat, SEED, THREADS, set_threads
from ..train import EVAL_WINDOWS, TRAIN_LOG, TRAINING_NOISE, train_model


ARCHS = ("infmoe", "moe")
# The options each architecture alone reads: given with the other --arch, they are refused.
ARCH_OPTIONS = {"infmoe": ("slice_width", "num_samples", "spread_weight", "training_noise"),
                "moe": ("experts", "top_k", "balance_weight", "router_softmax")}


def _options_given(ctx) -> set:
    """The parameters given on the command line (or by environment), not left at their default."""
    return {name for name in ctx.params
            if ctx.get_parameter_source(name) not in (click.core.ParameterSource.DEFAULT, None)}


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
@click.option("--arch", type=click.Choice(ARCHS), default="infmoe", show_default=True,
              help="infmoe: ∞-MoE; moe: the conventional top-k MoE (SPEC §7).")
@click.option("--experts", type=int, default=4, show_default=True,
              help="--arch moe: E experts of ffn_hidden / E units each.")
@click.option("--top-k", type=int, default=2, show_default=True, help="--arch moe: experts each token runs.")
@click.option("--balance-weight", type=FiniteFloat(min=0, max=100), default=0.01, show_default=True,
              help="--arch moe: weight of the training-only load-balancing loss.")
@click.option("--router-softmax", type=click.Choice(ROUTER_SOFTMAX), default=None,
              help="--arch moe: softmax over the selected logits (Mixtral) or over all E (Switch) "
                   "(default: all at --top-k 1, where the other is a constant 1, else selected).")
@click.option("--eval-every", type=click.IntRange(min=1), default=100, show_default=True)
@click.option("--threads", type=THREADS, default=None, help="Torch threads (default: $OMP_NUM_THREADS, else min(4, CPUs)).")
def train_command(corpus, out, d_model, n_layer, n_head, ffn_hidden, slice_width, num_samples,
                  n_positions, steps, batch_size, lr, seed, spread_weight, training_noise, arch, experts, top_k,
                  balance_weight, router_softmax, eval_every, threads):
    """Train an ∞-MoE model (or the conventional top-k MoE) from scratch on a byte corpus."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    given = _options_given(click.get_current_context())
    for name in ARCH_OPTIONS[next(other for other in ARCHS if other != arch)]:
        if name in given:
            raise InfMoEError(f"--{name.replace('_', '-')} does not apply to --arch {arch}")
    out = check_replaceable_dir(out, inputs=[corpus])
    shared = dict(vocab_size=256, n_positions=n_positions, d_model=d_model, n_layer=n_layer, n_head=n_head,
                  ffn_hidden=ffn_hidden)
    if arch == "moe":
        router_softmax = router_softmax or ("all" if top_k == 1 else "selected")
        config = MoEConfig(**shared, num_experts=experts, top_k=top_k, router_softmax=router_softmax)
    else:
        config = InfMoEConfig(**shared, slice_width=slice_width, num_samples=num_samples)
    # Weights, gradients and AdamW's two moments, and activations kept for the backward pass.
    check_fits(16 * config.parameter_count() + 4 * forward_bytes(config, batch_size, n_positions, config.default_k),
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
            raise_if_interrupted()
            last_val[0] = val if val is not None else last_val[0]
            status = f"loss {loss:.3f}" + (f"  val {last_val[0]:.3f}" if last_val[0] is not None else "")
            progress.update(task, advance=1, status=status)

        model, log = train_model(config, train_ids, val_windows, steps=steps, batch_size=batch_size,
                                 lr=lr, seed=seed, eval_every=eval_every, spread_weight=spread_weight,
                                 noise=training_noise, balance_weight=balance_weight, on_step=on_step)
    if arch == "moe":
        recipe = {"num_experts": experts, "top_k": top_k, "router_softmax": router_softmax,
                  "balance_weight": balance_weight}
    else:
        recipe = {"spread_weight": spread_weight, "training_noise": training_noise}
    summary = {
        "command": shlex.join(["infmoe-export", *sys.argv[1:]]),
        "corpus": str(corpus) if corpus is not None else "stdlib", "arch": arch,
        "steps": steps, "batch_size": batch_size, "lr": lr, "seed": seed, "threads": threads, **recipe,
        "train_bytes": len(train_ids), "validation_bytes": sum(len(w) for w in val_windows),
        "final_val_loss": log[-1]["val_loss"], "wall_s": round(time.time() - started, 1),
    }
    sample = val_windows[::max(1, len(val_windows) // EVAL_WINDOWS)]
    if arch == "moe":
        routing = {"expert_load": expert_load(model, sample)}
    else:
        routing = {"router_spread": router_spread(model, sample)}
    log_text = json.dumps({**summary, **routing, "log": log}, indent=1, allow_nan=False) + "\n"
    save_checkpoint(model, out, metadata=summary, extra_files={TRAIN_LOG: log_text})
    click.echo(f"wrote {out} (validation loss {summary['final_val_loss']:.4f} nats/byte, "
               f"{summary['wall_s']} s)")
