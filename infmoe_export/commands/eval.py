"""`infmoe-export eval`: perplexity of a checkpoint per expert budget K, beside baseline
checkpoints (the bundled baselines when present: dense, conventional MoE) on the same text; with
--chart, each also exported and timed in onnxruntime, and the trade-off chart drawn."""

import json
import math
import tempfile
from pathlib import Path

import click

from ..checkpoint import DEFAULT_CHECKPOINT, load_checkpoint
from ..data import corpus_bytes, read_texts, windows
from ..errors import InfMoEError
from ..evaluate import window_nll
from ..export import export_onnx
from ..files import atomic_write, output_file
from ..model import NOISE_MODES, MoEConfig
from ..options import SEED, check_forward_memory, choices_from_flags, expert_budgets, export_choice_options, set_threads
from ..report.baselines import baseline_fact, baseline_paths, measured_model
from ..report.bench import Baseline, deployed_backend, run_bench
from ..report.tradeoff import baseline_rows, plot_tradeoff, tradeoff_rows

# The chart's timing: batch-1 decode on a cache of DECODE_PAST tokens and a prefill of PREFILL
# tokens (or as long as the model allows), each for at most BUDGET_S seconds of interleaved rounds.
DECODE_PAST, PREFILL, BUDGET_S = 128, 128, 1.5


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
                   "(default: the bundled baselines that are present: dense, conventional MoE).")
@click.option("--no-baselines", is_flag=True, help="No baselines, not even the bundled ones.")
@export_choice_options(deployments=("onnxruntime", "portable"))
@click.option("--chart", type=click.Path(), default=None,
              help="Also export every model and baseline as --for / --dtype say, time its batch-1 decode step and "
                   "prefill in onnxruntime, and draw the trade-off chart (perplexity against both) as a PNG here.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON: one record per K and baseline.")
def eval_command(checkpoint, texts, ks, noise, seed, batch_size, baselines, no_baselines, deploy, dtype,
                 quantize_other, block_size, activations, kv_cache, chart, as_json):
    """Perplexity of a checkpoint per expert budget K, and of the baselines, with the weights the
    chosen precision stores (--dtype; default fp32); --chart adds their latency and the trade-off
    chart."""
    set_threads()
    if chart:
        output_file(chart, inputs=[checkpoint or DEFAULT_CHECKPOINT, *texts, *baselines])
    data = read_texts(texts) if texts else corpus_bytes("validation")
    model = load_checkpoint(checkpoint)
    choice, = choices_from_flags(model.config, deploy, dtype, quantize_other, block_size, activations=activations,
                                 kv_cache=kv_cache)
    runs = [(None, model, expert_budgets(ks, model.config))]
    paths = {}  # baseline name -> checkpoint
    for path in baseline_paths(baselines, bundled=not no_baselines):
        baseline = load_checkpoint(path)
        paths[path.resolve().name] = path
        runs.append((path.resolve().name, baseline, [baseline.config.default_k]))
    records = []
    for name, scored, run_ks in runs:
        chunks = windows(data, scored.config.n_positions)
        check_forward_memory(scored.config, min(batch_size, len(chunks)), scored.config.n_positions, max(run_ks))
        weights = measured_model(scored, choice)
        # A conventional MoE baseline's router is deterministic: no noise to sample.
        scored_noise = "quantile" if name is not None and isinstance(scored.config, MoEConfig) else noise
        for k in run_ks:
            total, count = window_nll(weights, chunks, k, scored_noise, seed, batch_size)
            if count == 0:
                raise InfMoEError("text too short: need at least 2 bytes to predict one")
            records.append({"baseline": name, "model_type": scored.config.model_type,
                            "ffn_hidden": scored.config.ffn_hidden, "k": k, "noise": scored_noise, "dtype": choice.dtype,
                            "seed": seed if scored_noise == "sampled" else None, "nll_per_byte": total / count,
                            "perplexity": math.exp(total / count), "bits_per_byte": total / count / math.log(2),
                            "predicted_bytes": count, "decode_ms": None, "prefill_tokens_per_s": None})
    if chart:
        draw_chart(Path(chart), runs, paths, records, choice, noise)
    if as_json:
        click.echo(json.dumps(records, indent=2, allow_nan=False))
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"perplexity ({noise} noise, {choice.precision}, {len(data)} bytes)")
    table.add_column("model")
    columns = ["FFN hidden", "K", "perplexity", "NLL/byte (nats)", "bits/byte"]
    columns += ["decode ms", "prefill tok/s"] if chart else []
    for column in columns:
        table.add_column(column, justify="right")
    for r in records:
        cells = [str(r["ffn_hidden"]), str(r["k"]), f"{r['perplexity']:.4f}", f"{r['nll_per_byte']:.4f}",
                 f"{r['bits_per_byte']:.4f}"]
        if chart:
            cells += [f"{r['decode_ms']['median']:.3f}" if r["decode_ms"] else "—",
                      f"{r['prefill_tokens_per_s']:.0f}" if r["prefill_tokens_per_s"] else "—"]
        table.add_row(r["baseline"] or "this checkpoint", *cells)
    Console().print(table)
    if chart:
        click.echo(f"chart: {chart}", err=True)


def draw_chart(path: Path, runs, paths, records, choice, noise: str):
    """Export every run's model per K (the checkpoint) or at its K (a baseline) as choice says,
    time them together on the deployed backend (batch-1 decode and prefill), fill the records'
    latency and write the trade-off chart (report.tradeoff.plot_tradeoff) to path."""
    (_, model, ks), *baselines = runs
    backend = deployed_backend(activations=choice.activations)
    noise = noise if model.config.model_type == "infmoe-gpt2" else "quantile"  # a conventional MoE has none
    with tempfile.TemporaryDirectory(prefix="infmoe-eval-") as scratch:
        folder = Path(scratch)
        models = [export_onnx(model, folder / f"k{k}.onnx", k=k, noise=noise, **choice.options()) for k in ks]
        timed = [Baseline(name, export_onnx(scored, folder / f"{name}.onnx", noise="quantile", **choice.options()),
                          scored) for name, scored, _ in baselines]
        n = model.config.n_positions
        bench = run_bench(model, models, backends=[backend], batches=(1,), seqs=(1, min(PREFILL, n)),
                          past=min(DECODE_PAST, n - 1), warmup=2, budget_s=BUDGET_S, baselines=timed,
                          baseline_backend=backend)
    perplexities = {(r["baseline"], r["k"]): r["perplexity"] for r in records}
    rows = [{**row, "perplexity": perplexities[(None, row["k"])]} for row in tradeoff_rows(None, bench)]
    facts = [baseline_fact(paths[name], scored, choice.dtype, perplexities[(name, k)]) for name, scored, (k,) in baselines]
    points = baseline_rows(bench, facts)
    for record in records:
        row = next(r for r in rows if r["k"] == record["k"]) if record["baseline"] is None else \
            next(p for p in points if p["name"] == record["baseline"])
        record.update(decode_ms=row["decode_ms"], prefill_tokens_per_s=row["prefill_tokens_per_s"])
    atomic_write(path, plot_tradeoff(rows, points))
