"""The one timing harness of the project: `infmoe-export bench`, `pipeline` and benchmarks/ use it.

Latency is the wall time of one call (time.perf_counter) after untimed warm-up calls.
`interleaved` times several configurations (backends × K × precision) round-robin, in a
shuffled order each round, so drift of a shared machine (other jobs, thermal, frequency) falls
on all of them alike rather than on whichever ran last; it stops when every median's confidence
interval is tight or the time budget is spent. The median's interval is distribution-free (order
statistics of the binomial, `median_ci`); two figures whose intervals overlap are within noise.
"""

import math
import os
import platform
import random
import time
from importlib import metadata
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

import numpy as np

from ..errors import InfMoEError

PERCENTILES = (90, 99)
CONFIDENCE = 0.95
MIN_ITERS = 8   # the fewest samples whose extremes bound the median at >= 99% (1 - 2 / 2^8)
REL_CI = 0.02   # stop once every interval's half-width is within 2% of its median


def time_calls(fn: Callable[[], object], warmup: int, iters: int) -> List[float]:
    """Seconds per call of fn over `iters` timed calls, after `warmup` untimed ones."""
    if warmup < 0 or iters < 1:
        raise InfMoEError(f"need warmup >= 0 and iters >= 1, got warmup {warmup}, iters {iters}")
    for _ in range(warmup):
        fn()
    seconds = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        seconds.append(time.perf_counter() - start)
    return seconds


def median_ci(samples: Sequence[float], confidence: float = CONFIDENCE):
    """(low, high): the order statistics x_(l) and x_(n+1-l) (1-based) with the largest l such that
    P(Binomial(n, 1/2) < l) <= (1 - confidence) / 2, an interval that holds the true median with at
    least `confidence` whatever the distribution; (min, max) when n is too small for that."""
    x = np.sort(np.asarray(samples, dtype=np.float64))
    n = len(x)
    if n == 0:
        raise InfMoEError("no samples to summarise")
    tail, cdf, level = (1 - confidence) / 2, 0.0, 0
    for i in range(n // 2 + 1):  # cdf = P(B < i + 1); stop before it exceeds the tail
        cdf += math.comb(n, i) / 2.0 ** n
        if cdf > tail:
            break
        level = i + 1
    level = max(level, 1)
    return float(x[level - 1]), float(x[n - level])


def latency_summary(seconds: Sequence[float]) -> Dict[str, float]:
    """Median with its confidence interval, p90/p99, mean, min; milliseconds."""
    ms = np.asarray(seconds, dtype=np.float64) * 1e3
    low, high = median_ci(ms)
    summary = {"median": float(np.median(ms)), "ci_low": low, "ci_high": high}
    summary.update({f"p{p}": float(np.percentile(ms, p)) for p in PERCENTILES})
    summary.update(mean=float(ms.mean()), min=float(ms.min()))
    return summary


def within_noise(a: Optional[dict], b: Optional[dict]) -> bool:
    """Whether two latency summaries' median intervals overlap (their difference is noise)."""
    return a is not None and b is not None and a["ci_low"] <= b["ci_high"] and b["ci_low"] <= a["ci_high"]


def stable(ms: Sequence[float], rel_ci: float) -> bool:
    if len(ms) < MIN_ITERS:
        return False
    low, high = median_ci(ms)
    return (high - low) / 2 <= rel_ci * float(np.median(ms))


def interleaved(calls: Sequence[Callable[[], object]], *, warmup: int, max_iters: int, budget_s: float,
                rel_ci: float = REL_CI, seed: int = 0) -> List[List[float]]:
    """Seconds per call of every fn in `calls`, timed one call each per round in a shuffled order:
    rounds go on until every median's interval is within rel_ci of it (after at least MIN_ITERS
    rounds), or a configuration reached max_iters calls, or budget_s seconds of rounds are spent."""
    if warmup < 0 or max_iters < 1 or budget_s <= 0:
        raise InfMoEError(f"need warmup >= 0, iters >= 1 and a positive budget, got {warmup}, {max_iters}, {budget_s}")
    for fn in calls:
        for _ in range(warmup):
            fn()
    samples = [[] for _ in calls]
    order = list(range(len(calls)))
    shuffle = random.Random(seed).shuffle
    started = time.perf_counter()
    for _ in range(max_iters):
        shuffle(order)
        for i in order:
            samples[i] += time_calls(calls[i], 0, 1)
        if time.perf_counter() - started >= budget_s and len(samples[0]) >= min(MIN_ITERS, max_iters):
            break
        if all(stable(s, rel_ci) for s in samples):
            break
    return samples


def status_kib(field: str) -> Optional[int]:
    """A field of /proc/self/status in KiB (VmRSS, VmHWM), None where Linux's /proc is missing."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def _version(package: str) -> Optional[str]:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def last_level_cache_bytes() -> int:
    """The largest CPU cache the kernel reports (Linux sysfs; 0 where it reports none)."""
    largest, units = 0, {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    for size in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        try:
            text = size.read_text().strip()
        except OSError:
            continue
        if text[:-1].isdigit() and text[-1] in units:
            largest = max(largest, int(text[:-1]) * units[text[-1]])
        elif text.isdigit():
            largest = max(largest, int(text))
    return largest


def environment(intra_op_threads: Optional[int] = None) -> dict:
    """Where the numbers were measured: CPU, cores, threads, library versions, kernel library."""
    import torch

    from ..runtimes.ort_kernel import custom_op_library

    library = custom_op_library()
    return {
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "usable_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "last_level_cache_bytes": last_level_cache_bytes(),
        "torch_threads": torch.get_num_threads(),
        "ort_intra_op_threads": intra_op_threads,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "versions": {name: _version(name) for name in
                     ("infmoe-export", "torch", "onnx", "onnxruntime", "onnxruntime-gpu", "polygraphy",
                      "numpy", "tensorrt")},
        "kernel_library": str(library) if library is not None else None,
    }


def memory_bandwidth(mib: int = 512, repeats: int = 5) -> dict:
    """Streaming bandwidth in GB/s (1e9 bytes/s), best of `repeats`, with torch's intra-op
    threads: `read` sums a buffer far larger than the caches (how a decode step streams its
    weights), `copy` counts the bytes read plus the bytes written."""
    import torch

    src = torch.ones(mib * 2**20 // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    nbytes = src.numel() * 4
    read = min(time_calls(lambda: src.sum(), 1, repeats))
    copy = min(time_calls(lambda: dst.copy_(src), 1, repeats))
    return {"read_gbs": nbytes / read / 1e9, "copy_gbs": 2 * nbytes / copy / 1e9, "buffer_mib": mib}
