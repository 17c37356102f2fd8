"""`infmoe-export bench`: latency percentiles, tokens/s and peak memory per backend × K × batch ×
sequence length, on real text (the stdlib validation split).

seq 1 is one decode step with a KV cache of --past tokens (the cache comes from a prefill of
real text, outside the timed calls); seq > 1 is a prefill from an empty cache. Each timed call
is one runner.infer (Polygraphy, input checks off); see timing.py for what the memory figure is.
"""

import json
import sys
import tempfile
from pathlib import Path
from typing import List, Optional, Sequence

import click
import numpy as np

from ..errors import InfMoEError
from ..options import positive_ints
from . import backends as backends_lib
from .timing import PeakMemory, latency_summary, time_calls

DEFAULT_PAST = 128
LATENCY_NOTE = "Latency: wall time of one runner.infer call (time.perf_counter)."
MEMORY_NOTE = ("Peak MiB: rise of the process's peak resident set (VmHWM, reset before the timed calls) over its "
               "resident set before them: working memory of inference, not the loaded weights.")


def text_tokens(count: int) -> np.ndarray:
    """The first `count` bytes of the stdlib validation split as token ids."""
    from ..data import corpus_bytes

    data = np.frombuffer(corpus_bytes("validation"), dtype=np.uint8)
    if len(data) < count:
        raise InfMoEError(f"the validation text has {len(data)} bytes, fewer than the {count} the benchmark needs")
    return data[:count].astype(np.int64)


def check_shapes(config, seqs: Sequence[int], past: int) -> None:
    for seq in seqs:
        if seq < 1 or seq > config.n_positions:
            raise InfMoEError(f"--seq {seq} must lie in [1, n_positions = {config.n_positions}]")
    if 1 in seqs and not 1 <= past < config.n_positions:
        raise InfMoEError(f"--past {past} must lie in [1, n_positions - 1 = {config.n_positions - 1}]")


def measure(runner, model: backends_lib.OnnxModel, batch: int, seq: int, past: int, warmup: int, iters: int,
            budget_s: Optional[float] = None) -> dict:
    """Time one (batch, seq) configuration on an active runner."""
    phase = "decode" if seq == 1 else "prefill"
    row = {"batch": batch, "seq": seq, "past": past if phase == "decode" else 0, "phase": phase,
           "status": "ok", "reason": None, "iters": None, "latency_ms": None, "tokens_per_s": None,
           "peak_rss_delta_mib": None}
    if phase == "decode" and not model.io.past:
        return {**row, "status": "skipped", "reason": "the model has no KV-cache inputs (exported with --no-past)"}
    tokens = text_tokens(batch * (past + 1 if phase == "decode" else seq))
    if phase == "decode":
        ids = tokens.reshape(batch, past + 1)
        cache = runner.infer(model.feed(ids[:, :past]), check_inputs=False)
        cache = {name: np.array(value) for name, value in cache.items() if name.startswith("present.")}
        feed = model.feed(ids[:, past:], past=cache)
    else:
        feed = model.feed(tokens.reshape(batch, seq))
    with PeakMemory() as peak:
        seconds = time_calls(lambda: runner.infer(feed, check_inputs=False), warmup, iters, budget_s)
    latency = latency_summary(seconds)
    return {**row, "iters": len(seconds), "latency_ms": latency, "tokens_per_s": batch * seq / (latency["mean"] / 1e3),
            "peak_rss_delta_mib": peak.delta_mib}


def run_bench(torch_model, models: List[backends_lib.OnnxModel], *, backends: Sequence[str],
              batches: Sequence[int] = (1, 4), seqs: Sequence[int] = (1, 128), past: int = DEFAULT_PAST,
              warmup: int = 5, iters: int = 30, budget_s: Optional[float] = None, engines: Optional[Path] = None,
              threads: Optional[int] = None, progress=None) -> dict:
    """The report's bench section. progress(description) is called before each backend and model;
    budget_s caps the timed calls of one configuration (timing.time_calls)."""
    check_shapes(torch_model.config, seqs, past)
    results = []
    for model in models:
        for backend in backends:
            if progress:
                progress(f"{backend} K={model.k} {model.noise}")
            base = {"backend": backend, "k": model.k, "noise": model.noise}
            reason = backends_lib.unavailable(backend, model, engines)
            if reason:
                results += [{**base, "batch": b, "seq": s, "past": past if s == 1 else 0,
                             "phase": "decode" if s == 1 else "prefill", "status": "skipped", "reason": reason,
                             "iters": None, "latency_ms": None, "tokens_per_s": None, "peak_rss_delta_mib": None}
                            for b in batches for s in seqs]
                continue
            with backends_lib.make_runner(backend, model, torch_model, engines, threads) as runner:
                results += [{**base, **measure(runner, model, b, s, past, warmup, iters, budget_s)}
                            for b in batches for s in seqs]
    settings = {"warmup": warmup, "iters": iters, "budget_s": budget_s, "decode_past": past, "latency": LATENCY_NOTE,
                "memory": MEMORY_NOTE}
    return {"settings": settings, "results": results}


def export_models(torch_model, ks: Sequence[int], noise: str, out_dir: Path) -> List[backends_lib.OnnxModel]:
    """One ONNX model per K (with past, with the fallback function) for a bench without --model."""
    from ..export import export_onnx

    return [backends_lib.read_model(export_onnx(torch_model, out_dir / f"model_k{k}_{noise}.onnx", k=k, noise=noise))
            for k in ks]


@click.command("bench")
@click.option("--checkpoint", type=click.Path(), default=None, help="Checkpoint directory (default: the bundled model).")
@click.option("--model", "model_paths", type=click.Path(), multiple=True,
              help="ONNX model(s) or a directory of per-K models (default: export the checkpoint per K).")
@click.option("--engines", type=click.Path(), default=None, help="Directory of TensorRT engines (`infmoe-export trt`).")
@click.option("--backends", "backend_list", default="torch,ort,ort-fallback,trt", show_default=True)
@click.option("--k", "ks", default="1,2,4,8", show_default=True, help="Expert budgets K, comma-separated.")
@click.option("--noise", type=click.Choice(("quantile", "sampled")), default="quantile", show_default=True,
              help="Noise mode of the models exported when no --model is given.")
@click.option("--batch", "batch_list", default="1,4", show_default=True, help="Batch sizes, comma-separated.")
@click.option("--seq", "seq_list", default="1,128", show_default=True,
              help="Sequence lengths: 1 = one decode step with a KV cache of --past tokens, >1 = prefill.")
@click.option("--past", type=click.IntRange(min=1), default=DEFAULT_PAST, show_default=True)
@click.option("--warmup", type=click.IntRange(min=0), default=5, show_default=True)
@click.option("--iters", type=click.IntRange(min=1), default=30, show_default=True)
@click.option("--threads", type=click.IntRange(min=1), default=None,
              help="Intra-op threads of torch and onnxruntime (default: their own defaults).")
@click.option("--json", "json_path", type=click.Path(), default=None, help="Write the results (report schema) here.")
def bench_command(checkpoint, model_paths, engines, backend_list, ks, noise, batch_list, seq_list, past, warmup,
                  iters, threads, json_path):
    """Latency, throughput and memory per backend and K."""
    import torch
    from rich.console import Console

    from ..checkpoint import DEFAULT_CHECKPOINT, load_checkpoint
    from .render import atomic_write, build_report, rich_table, tables, validate_report
    from .timing import environment

    backends = backends_lib.parse_backends(backend_list)
    ks, batches, seqs = positive_ints(ks, "--k"), positive_ints(batch_list, "--batch"), positive_ints(seq_list, "--seq")
    if json_path and Path(json_path).is_dir():
        raise InfMoEError(f"--json {json_path} is a directory")
    torch_model = load_checkpoint(checkpoint)
    check_shapes(torch_model.config, seqs, past)
    if threads:
        torch.set_num_threads(threads)
    with tempfile.TemporaryDirectory(prefix="infmoe-bench-") as scratch:
        if model_paths:
            models = backends_lib.find_models(model_paths, ks=ks)
            backends_lib.check_models(models, torch_model.config)
        else:
            models = export_models(torch_model, ks, noise, Path(scratch))
        bench = run_bench(torch_model, models, backends=backends, batches=batches, seqs=seqs, past=past,
                          warmup=warmup, iters=iters, engines=Path(engines) if engines else None, threads=threads)
    report = build_report("bench", "infmoe-export " + " ".join(sys.argv[1:]), str(checkpoint or DEFAULT_CHECKPOINT),
                          torch_model.config.to_dict(), environment(threads), bench=bench)
    validate_report(report)
    console = Console()
    console.print(rich_table(next(t for t in tables(report) if t.title == "Latency")))
    if json_path:
        atomic_write(Path(json_path), json.dumps(report, indent=2) + "\n")
        console.print(f"results: {json_path}", markup=False)
