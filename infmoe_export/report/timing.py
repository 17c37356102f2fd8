"""The one timing harness of the project: `infmoe-export bench`, `pipeline` and benchmarks/ use it.

Latency is the wall time of one call (time.perf_counter) after untimed warm-up calls.
`interleaved` times several configurations (backends × K × precision) round-robin, in a
shuffled order each round, so drift of a shared machine (other jobs, thermal, frequency) falls
on all of them alike rather than on whichever ran last; it stops when every median's confidence
interval is tight or the time budget is spent (or after a fixed number of rounds). `sampled_rounds`
does the same with samples that are themselves summaries (the median of a few back-to-back
decode steps), each after a bandwidth probe where a roofline needs one. The median's interval is
distribution-free (order statistics of the binomial, `median_ci`); two figures whose intervals
overlap are within noise.

The roofline's denominator is a read bandwidth measured in the same run: `memory_bandwidth`
(torch streaming a buffer far larger than the caches) or `MatMulBandwidth` (onnxruntime's own
MatMul, the GEMV a decode step is made of).
"""

import itertools
import math
import os
import platform
import random
import statistics
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
# After a run, onnxruntime's pool threads (and llama.cpp's) spin a while before they sleep: a
# runtime sampled right after another would share the cores with them, so each sample waits this long.
SETTLE_S = 0.05


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
                rel_ci: Optional[float] = REL_CI, seed: int = 0, primed: bool = False) -> List[List[float]]:
    """Seconds per call of every fn in `calls`, timed one call each per round in a shuffled order:
    rounds go on until every median's interval is within rel_ci of it (after at least MIN_ITERS
    rounds; never with rel_ci None), or a configuration reached max_iters calls, or budget_s
    seconds of rounds are spent. Sample j of every fn comes from the same round.
    primed: each timed call right after an untimed one of the same fn, as a generation's decode
    step follows the previous step: its weights back in the cache that the other fns' calls took."""
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
            samples[i] += time_calls(calls[i], int(primed), 1)
        if time.perf_counter() - started >= budget_s and len(samples[0]) >= min(MIN_ITERS, max_iters):
            break
        if rel_ci is not None and all(stable(s, rel_ci) for s in samples):
            break
    return samples


def rounds(calls: Dict[str, Callable[[], object]], count: int, warmup: int = 1) -> Dict[str, List[float]]:
    """Seconds per call of every runner in `calls` (name: fn) over exactly `count` interleaved
    rounds, after `warmup` untimed calls of each."""
    samples = interleaved(list(calls.values()), warmup=warmup, max_iters=count, budget_s=math.inf, rel_ci=None)
    return dict(zip(calls, samples))


def cycling(call: Callable[[int], object], copies: int) -> Callable[[], object]:
    """A runner that calls call(0), call(1), ..., call(copies - 1), call(0), ...: one that cycles
    over copies of its weights, so that none comes from the cache."""
    index = itertools.cycle(range(copies))
    return lambda: call(next(index))


def paired_ratio(a: Sequence[float], b: Sequence[float]) -> float:
    """The median over rounds of a / b, sample by sample: a change in the machine's load between
    rounds falls on both sides of each ratio alike."""
    return statistics.median(x / y for x, y in zip(a, b))


def settle():
    """Let the previous runtime's spinning threads go to sleep before the next sample."""
    time.sleep(SETTLE_S)


def busy_settle():
    """settle without sleeping: the previous runtime's spinning threads go to sleep while this
    thread keeps its core awake (a core left idle wakes slowly on a virtual machine)."""
    end = time.perf_counter() + SETTLE_S
    while time.perf_counter() < end:
        pass


def sampled_rounds(samplers: Dict[object, Callable[[], float]], count: int,
                   probe: Optional[Callable[[], float]] = None, seed: int = 0):
    """`count` rounds; in each, every sampler once in a shuffled order, each after a settle (and
    after a probe sample, where a probe is given). Returns the samples per sampler and the probe's
    samples."""
    samples = {name: [] for name in samplers}
    probed = []
    order = list(samplers)
    shuffle = random.Random(seed).shuffle
    for _ in range(count):
        shuffle(order)
        for name in order:
            if probe is not None:
                probed.append(probe())
            settle()
            samples[name].append(samplers[name]())
    return samples, probed


def median_ms(fn: Callable[[], object], calls: int) -> float:
    """Median milliseconds of `calls` back-to-back calls of fn, after one untimed call: one sample
    of a step that runs back to back in a generation."""
    return statistics.median(time_calls(fn, 1, calls)) * 1e3


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


# The CPU features that choose the kernel's code (its x86-64 variants, VNNI, aarch64's dot products).
KERNEL_FEATURES = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_vnni", "avx_vnni", "asimddp", "i8mm")


def cpu_features() -> list:
    """Those of KERNEL_FEATURES the CPU reports (Linux /proc/cpuinfo; empty where it says none):
    a CPU's model name alone does not tell a Zen 3 from a Zen 4."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith(("flags", "Features")):
                    reported = set(line.split(":", 1)[1].split())
                    return [feature for feature in KERNEL_FEATURES if feature in reported]
    except OSError:
        pass
    return []


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
        "cpu_features": cpu_features(),
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


def memory_bandwidth(mib: int = 512, repeats: int = 5, threads: Optional[int] = None) -> dict:
    """Streaming bandwidth in GB/s (1e9 bytes/s), best of `repeats`, with torch's intra-op
    threads (`threads` of them for this measurement, where given): `read` sums a buffer far larger
    than the caches (how a decode step streams its weights), `copy` counts the bytes read plus the
    bytes written."""
    import torch

    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        src = torch.ones(mib * 2**20 // 4, dtype=torch.float32)
        dst = torch.empty_like(src)
        nbytes = src.numel() * 4
        read = min(time_calls(lambda: src.sum(), 1, repeats))
        copy = min(time_calls(lambda: dst.copy_(src), 1, repeats))
    finally:
        torch.set_num_threads(before)
    return {"read_gbs": nbytes / read / 1e9, "copy_gbs": 2 * nbytes / copy / 1e9, "buffer_mib": mib}


class MatMulBandwidth:
    """Read GB/s of onnxruntime's MatMul: x [1, rows] @ W [rows, cols] (256 MiB of float32), W an
    initializer, one session per weight, taken in turn: twice the last-level cache's bytes
    between two reads of one weight, so none comes from the cache (a single weight, read again
    and again, comes partly from a large L3)."""

    ROWS, COLS = 4096, 16384

    def __init__(self, threads: int):
        import onnxruntime as ort
        from onnx import TensorProto, helper, numpy_helper

        weight = np.random.default_rng(0).standard_normal((self.ROWS, self.COLS), dtype=np.float32)
        graph = helper.make_graph(
            [helper.make_node("MatMul", ["x", "w"], ["y"])], "bandwidth",
            [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, self.ROWS])],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, self.COLS])],
            [numpy_helper.from_array(weight, "w")])
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        # Each session its own pool: one spinning after its call would take a core from the next;
        # a call of ~10 ms pays its wake-up once.
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]).SerializeToString()
        self.copies = max(1, -(-2 * last_level_cache_bytes() // weight.nbytes))
        self.sessions = [ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])
                         for _ in range(self.copies)]
        self.feed = {"x": np.ones((1, self.ROWS), np.float32)}
        self.bytes = weight.nbytes
        self.calls = 0

    def run(self):
        self.calls += 1
        self.sessions[self.calls % self.copies].run(None, self.feed)

    def sample(self, repeats: int = 3) -> float:
        settle()
        return self.bytes / statistics.median(time_calls(self.run, 1, repeats)) / 1e9
