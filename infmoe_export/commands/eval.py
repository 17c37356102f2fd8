"""`infmoe-export eval`: perplexity of a checkpoint per expert budget K, beside baseline
checkpoints (the bundled dense baselines when present) on the same text."""

import json
import math

import click

from ..checkpoint import load_checkpoint
from ..data import corpus_bytes, read_texts, windows
from ..errors import InfMoEError
from ..evaluate import window_nll
from ..model import NOISE_MODES
from ..options import SEED, check_forward_memory, expert_budgets, set_threads
from ..report.baselines import baseline_paths


@click.command("eval")
@click.option("--checkpoint", type=click.Path(), default=None, help="Checkpoint directory (default: the bundled model).")
@click.option("--text", "texts", type=click.Path(), multiple=True,
              help="Text file(s) to score, concatenated (default: the stdlib validation split).")
@click.option("--k", "ks", default=None,
              help="Expert budgets K, comma-separated (default: 1,2,4,8; a conventional MoE: its top_k, the only K "
                   "it has).")
@click.option("--noise", type=click.Choice(NOISE_MODES), default="quantile", show_default=True)
@click.option("--seed", type=SEED, default=0, show_default=True, help="Seed of the sampled noise.")
@click.option("--batch-size", type=click.IntRange(min=1), default=16, show_default=True)
@click.option("--baseline", "baselines", type=click.Path(), multiple=True,
              help="Baseline checkpoint(s) scored on the same text at their own K "
                   "(default: the bundled dense baselines, if present).")
@click.option("--no-baselines", is_flag=True, help="No baselines, not even the bundled ones.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON: one record per K and baseline.")
def eval_command(checkpoint, texts, ks, noise, seed, batch_size, baselines, no_baselines, as_json):
    """Perplexity of a checkpoint per expert budget K, and of the baselines."""
    set_threads()
    data = read_texts(texts) if texts else corpus_bytes("validation")
    model = load_checkpoint(checkpoint)
    runs = [(None, model, expert_budgets(ks, model.config))]
    for path in baseline_paths(baselines, bundled=not no_baselines):
        model = load_checkpoint(path)
        runs.append((path.resolve().name, model, [model.config.default_k]))
    records = []
    for name, model, run_ks in runs:
        chunks = windows(data, model.config.n_positions)
        check_forward_memory(model.config, min(batch_size, len(chunks)), model.config.n_positions, max(run_ks))
        for k in run_ks:
            total, count = window_nll(model, chunks, k, noise, seed, batch_size)
            if count == 0:
                raise InfMoEError("text too short: need at least 2 bytes to predict one")
            records.append({"baseline": name, "model_type": model.config.model_type,
                            "ffn_hidden": model.config.ffn_hidden, "k": k, "noise": noise,
                            "seed": seed if noise == "sampled" else None, "nll_per_byte": total / count,
                            "perplexity": math.exp(total / count), "bits_per_byte": total / count / math.log(2),
                            "predicted_bytes": count})
    if as_json:
        click.echo(json.dumps(records, indent=2, allow_nan=False))
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"perplexity ({noise} noise, {len(data)} bytes)")
    table.add_column("model")
    for column in ("FFN hidden", "K", "perplexity", "NLL/byte (nats)", "bits/byte"):
        table.add_column(column, justify="right")
    for r in records:
        table.add_row(r["baseline"] or "this checkpoint", str(r["ffn_hidden"]), str(r["k"]), f"{r['perplexity']:.4f}",
                      f"{r['nll_per_byte']:.4f}", f"{r['bits_per_byte']:.4f}")
    Console().print(table)
