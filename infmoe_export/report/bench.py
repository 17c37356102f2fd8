"""`infmoe-export bench`: latency (median with its confidence interval) and tokens/s per backend ×
precision × K × batch × sequence length, on real text (the stdlib validation split).

seq 1 is one decode step with a KV cache of --past tokens (the cache comes from a prefill of
real text, outside the timed calls); seq > 1 is a prefill from an empty cache. Each timed call
is the call `run` makes (timed_call): a step of the runner's shared KV cache where it has one,
else one runner.infer (Polygraphy, input checks off). Every runner of one (batch, seq) shape is
timed in the same interleaved loop (timing.interleaved), so their figures are comparable.
"""

import contextlib
import math
from pathlib import Path
from typing import List, NamedTuple, Optional, Sequence

import numpy as np

from ..errors import InfMoEError
from ..contract import ExportedModel
from ..runtimes import registry
from .timing import REL_CI, busy_settle, interleaved, latency_summary, stable

DEFAULT_PAST = 128
LATENCY_NOTE = ("Latency: wall time of one call as `run` makes it (time.perf_counter): on a model with a shared "
                "KV cache (the onnxruntime target, on the CPU) one step of that cache in place, a prefill's LM head "
                "on its last position; else one runner.infer call. A decode step is timed right after an untimed "
                "one of the same model, as a generation's steps follow each other. Median with its 95% distribution-free interval, "
                "every configuration of a shape timed in one interleaved loop. "
                "≈: within noise of the previous K (the intervals overlap).")
NO_PAST = "the model has no KV-cache inputs (exported with --no-past)"
FLOAT_TORCH = ("fp32", "fp16")  # PyTorch runs float weights: a quantized model's reference is no deployment


class Baseline(NamedTuple):
    """A baseline checkpoint (dense, a conventional MoE) exported for the trade-off: timed beside
    the models under test (baselines.py)."""
    name: str
    model: ExportedModel
    torch_model: object


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


def timed_feed(runner, model: ExportedModel, batch: int, seq: int, past: int):
    """The feed of one timed call: a decode step after a prefill of `past` tokens of real text
    (run here, untimed) when seq is 1, else a prefill of seq tokens."""
    if seq > 1:
        return model.feed(text_tokens(batch * seq).reshape(batch, seq))
    ids = text_tokens(batch * (past + 1)).reshape(batch, past + 1)
    cache = runner.infer(model.feed(ids[:, :past]), check_inputs=False)
    cache = {name: np.array(value) for name, value in cache.items() if name.startswith("present.")}
    return model.feed(ids[:, past:], past=cache)


def timed_call(runner, model: ExportedModel, batch: int, seq: int, past: int):
    """One timed call, as `run` makes it (runtimes/generate.py): with the runner's shared KV cache
    where it offers one, a decode step after `past` cached tokens of real text (prefilled here,
    untimed) or a prefill of seq tokens from an empty cache, its LM head on the last position;
    else runner.infer on timed_feed's feed."""
    shared = getattr(runner, "shared_cache", None)
    cache = shared(batch) if shared is not None else None
    if cache is None:
        feed = timed_feed(runner, model, batch, seq, past)
        return lambda: runner.infer(feed, check_inputs=False)
    start = past if seq == 1 else 0
    ids = text_tokens(batch * (start + seq)).reshape(batch, start + seq)
    if start:
        cache.step(ids[:, :start], last_only=True)

    def call():
        cache.length = start
        return cache.step(ids[:, start:], last_only=True)
    return call


def blank_row(backend: str, model: ExportedModel, batch: int, seq: int, past: int, baseline=None) -> dict:
    return {"backend": backend, "k": model.k, "noise": model.noise, "dtype": model.io.dtype, "baseline": baseline,
            "batch": batch, "seq": seq, "past": past if seq == 1 else 0, "phase": "decode" if seq == 1 else "prefill",
            "status": "skipped", "reason": None, "iters": None, "stable": None, "latency_ms": None,
            "tokens_per_s": None}


def deployed_backend(kernel: Optional[bool] = None, activations: str = "float") -> str:
    """The backend a deployment runs: onnxruntime with our kernel library on the activations the
    model was exported for (ort, or ort-a8 for int8), or on the models' fallback functions
    without it; kernel None: whether the library is installed here."""
    if kernel is None:
        from ..runtimes.ort_kernel import custom_op_library

        kernel = custom_op_library() is not None
    if not kernel:
        return "ort-fallback"
    return "ort-a8" if activations == "int8" else "ort"


def checked_backends(kernel: Optional[bool], activations: Sequence[str]) -> List[str]:
    """The deployed backends of models exported with these activations, and ort beside ort-a8:
    its float activations are the level-1 check of the same kernels (SPEC §6)."""
    deployed = {deployed_backend(kernel, a) for a in activations}
    return [b for b in registry.BACKENDS if b in deployed or b in {level1_backend(d) for d in deployed}]


def level1_backend(backend: str) -> str:
    """The backend that checks a deployed one at level 1: itself, or for ort-a8 (judged at level
    2 only) ort, the same kernels on float activations."""
    return "ort" if backend == "ort-a8" else backend


def why_not(backend: str, model: ExportedModel, engines) -> Optional[str]:
    """Why a backend does not time this model here, or None."""
    if backend == "torch" and model.io.dtype not in FLOAT_TORCH:
        return "PyTorch runs float weights only; its int8 / int4 reference is for parity, not speed"
    return registry.unavailable(backend, model, engines)


def measure(runner, model: ExportedModel, batch: int, seq: int, past: int, warmup: int, iters: int,
            budget_s: Optional[float] = None) -> dict:
    """Time one (batch, seq) configuration on an active runner alone (benchmarks.ort)."""
    row = blank_row(runner.name, model, batch, seq, past)
    if seq == 1 and not model.io.past:
        return {**row, "reason": NO_PAST}
    samples, = interleaved([timed_call(runner, model, batch, seq, past)], warmup=warmup, max_iters=iters,
                           budget_s=budget_s or math.inf)
    return finished(row, samples, REL_CI)


def finished(row: dict, seconds: List[float], rel_ci: float) -> dict:
    latency = latency_summary(seconds)
    return {**row, "status": "ok", "iters": len(seconds), "stable": stable([s * 1e3 for s in seconds], rel_ci),
            "latency_ms": latency, "tokens_per_s": row["batch"] * row["seq"] / (latency["median"] / 1e3)}


def run_bench(torch_model, models: List[ExportedModel], *, backends: Sequence[str],
              batches: Sequence[int] = (1, 4), seqs: Sequence[int] = (1, 128), past: int = DEFAULT_PAST,
              warmup: int = 5, iters: int = 200, budget_s: float = 2.0, rel_ci: float = REL_CI,
              engines: Optional[Path] = None, threads: Optional[int] = None, baselines: Sequence[Baseline] = (),
              baseline_backend: Optional[str] = None, progress=None) -> dict:
    """The report's bench section. Every (backend, model) runner stays loaded; per (batch, seq)
    shape they are timed together, interleaved, for at most budget_s seconds per configuration
    (timing.interleaved). Baselines are timed on baseline_backend (None: each on its export's
    deployed backend, as the models under test) at the batch-1 shapes: decode and prefill.
    progress(description) is called before each shape."""
    check_shapes(torch_model.config, seqs, past)
    shapes = [(b, s) for b in batches for s in seqs]
    results = {}
    with contextlib.ExitStack() as stack:
        runners = []  # (row key, runner, model)
        for model in models:
            for backend in backends:
                for batch, seq in shapes:
                    results[(backend, model.path, batch, seq)] = blank_row(backend, model, batch, seq, past)
                reason = why_not(backend, model, engines)
                if reason:
                    for batch, seq in shapes:
                        results[(backend, model.path, batch, seq)]["reason"] = reason
                    continue
                runners.append((backend, model, None,
                                stack.enter_context(registry.make_runner(backend, model, torch_model, engines,
                                                                         threads, taking_turns=True))))
        for name, model, base_torch in baselines:
            backend = baseline_backend or deployed_backend(None, model.io.activations)
            for batch, seq in shapes:
                if batch == 1:
                    results[(backend, model.path, 1, seq)] = blank_row(backend, model, 1, seq, past, name)
            runners.append((backend, model, name,
                            stack.enter_context(registry.make_runner(backend, model, base_torch, None,
                                                                     threads, taking_turns=True))))
        for batch, seq in shapes:
            if progress:
                progress(f"batch {batch}, {'decode' if seq == 1 else f'prefill {seq}'}")
            keys, calls = [], []
            for backend, model, baseline, runner in runners:
                key = (backend, model.path, batch, seq)
                if key not in results or (baseline and batch != 1):
                    continue
                if seq == 1 and not model.io.past:
                    results[key]["reason"] = NO_PAST
                    continue
                keys.append(key)
                calls.append(timed_call(runner, model, batch, seq, past))
            if calls:
                samples = interleaved(calls, warmup=warmup, max_iters=iters, budget_s=budget_s * len(calls),
                                      rel_ci=rel_ci, primed=seq == 1)
                for key, seconds in zip(keys, samples):
                    results[key] = finished(results[key], seconds, rel_ci)
    settings = {"warmup": warmup, "iters": iters, "budget_s": budget_s, "rel_ci": rel_ci, "decode_past": past,
                "latency": LATENCY_NOTE}
    return {"settings": settings, "results": list(results.values())}


RUN_STEPS = 32  # decode steps of the generations each latency row is checked against
RUN_ROUNDS = 4  # blocks of them, each beside as many calls timed as the table times them


def run_agreement(torch_model, models: List[ExportedModel], bench: dict, *, kernel: bool,
                  threads: Optional[int] = None, steps: int = RUN_STEPS, rounds: int = RUN_ROUNDS) -> List[dict]:
    """Whether `run` sees the speed the latency table shows, per model on its deployed backend:
    `rounds` rounds, each a generation as `run` makes it (runtimes/generate.py, greedy, its own
    session, threads spinning) of steps // rounds tokens after a prompt of real text, its pasts
    centred on the table's decode past, and as many batch-1 decode steps timed as the table
    times them (run_bench: its own session taking turns, each step primed), every block after a
    settle. Both are measured in the same seconds, so a machine that drifts between the table
    and this check moves both alike: agreeing (the two 95% intervals of the median overlap) says
    the table's method measures `run`'s speed. The table's own row is kept beside them."""
    from ..runtimes.generate import generate
    from .timing import within_noise

    past = bench["settings"]["decode_past"]
    rows = {(r["backend"], r["k"], r["noise"], r["dtype"]): r for r in bench["results"]
            if r["status"] == "ok" and not r["baseline"] and r["phase"] == "decode" and r["batch"] == 1}
    block = max(1, steps // rounds)
    out = []
    for model in models:
        backend = deployed_backend(kernel, model.io.activations)
        row = rows.get((backend, model.k, model.noise, model.io.dtype))
        if row is None or not model.io.past:
            continue
        prompt = text_tokens(max(past - block // 2, 1))
        steps_run = min(block, model.io.config.n_positions - len(prompt))
        run_seconds, table_seconds = [], []
        with registry.make_runner(backend, model, torch_model, None, threads) as runner, \
                registry.make_runner(backend, model, torch_model, None, threads, taking_turns=True) as table:
            call = timed_call(table, model, 1, 1, past)
            for _ in range(rounds):
                busy_settle()
                seconds = []
                generate(runner, prompt, steps_run + 1, timings=seconds)
                run_seconds += seconds[1:]
                busy_settle()
                table_seconds += interleaved([call], warmup=0, max_iters=len(seconds) - 1, budget_s=math.inf,
                                             rel_ci=None, primed=True)[0]
        measured, retimed = latency_summary(run_seconds), latency_summary(table_seconds)
        out.append({"backend": backend, "k": model.k, "noise": model.noise, "dtype": model.io.dtype,
                    "steps": len(run_seconds), "past_from": len(prompt), "bench_ms": row["latency_ms"],
                    "table_beside_run_ms": retimed, "run_ms": measured, "agrees": within_noise(retimed, measured)})
    return out
