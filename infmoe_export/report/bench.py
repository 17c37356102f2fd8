"""`infmoe-export bench`: latency percentiles, tokens/s and peak memory per backend × K × batch ×
sequence length, on real text (the stdlib validation split).

seq 1 is one decode step with a KV cache of --past tokens (the cache comes from a prefill of
real text, outside the timed calls); seq > 1 is a prefill from an empty cache. Each timed call
is one runner.infer (Polygraphy, input checks off); see timing.py for what the memory figure is.
"""

from pathlib import Path
from typing import List, Optional, Sequence

import numpy as np

from ..errors import InfMoEError
from ..contract import ExportedModel
from ..runtimes import registry
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


def measure(runner, model: ExportedModel, batch: int, seq: int, past: int, warmup: int, iters: int,
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


def run_bench(torch_model, models: List[ExportedModel], *, backends: Sequence[str],
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
            reason = registry.unavailable(backend, model, engines)
            if reason:
                results += [{**base, "batch": b, "seq": s, "past": past if s == 1 else 0,
                             "phase": "decode" if s == 1 else "prefill", "status": "skipped", "reason": reason,
                             "iters": None, "latency_ms": None, "tokens_per_s": None, "peak_rss_delta_mib": None}
                            for b in batches for s in seqs]
                continue
            with registry.make_runner(backend, model, torch_model, engines, threads) as runner:
                results += [{**base, **measure(runner, model, b, s, past, warmup, iters, budget_s)}
                            for b in batches for s in seqs]
    settings = {"warmup": warmup, "iters": iters, "budget_s": budget_s, "decode_past": past, "latency": LATENCY_NOTE,
                "memory": MEMORY_NOTE}
    return {"settings": settings, "results": results}
