"""The one timing harness of the project: `infmoe-export bench` and benchmarks/ both use it.

Latency is the wall time of one call (time.perf_counter) after untimed warm-up calls. Peak
memory is the rise of the process's peak resident set over its resident set just before the
calls: the kernel's high-water mark (VmHWM) is reset through /proc/self/clear_refs, so the
figure is the working memory of inference (activations, arena growth), not the loaded weights.
"""

import os
import platform
import time
from importlib import metadata
from typing import Callable, Dict, List, Optional

import numpy as np

from ..errors import InfMoEError

PERCENTILES = (50, 90, 99)


MIN_ITERS = 5


def time_calls(fn: Callable[[], object], warmup: int, iters: int, budget_s: Optional[float] = None) -> List[float]:
    """Seconds per call of fn over `iters` timed calls, after `warmup` untimed ones; with a
    budget, the timed calls stop once they have taken budget_s seconds (but not before
    MIN_ITERS calls), so a slow configuration cannot hold up a whole run."""
    if warmup < 0 or iters < 1:
        raise InfMoEError(f"need warmup >= 0 and iters >= 1, got warmup {warmup}, iters {iters}")
    for _ in range(warmup):
        fn()
    seconds = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        seconds.append(time.perf_counter() - start)
        if budget_s is not None and len(seconds) >= MIN_ITERS and sum(seconds) >= budget_s:
            break
    return seconds


def latency_summary(seconds: List[float]) -> Dict[str, float]:
    """p50/p90/p99/mean/min in milliseconds."""
    ms = np.asarray(seconds, dtype=np.float64) * 1e3
    summary = {f"p{p}": float(np.percentile(ms, p)) for p in PERCENTILES}
    summary.update(mean=float(ms.mean()), min=float(ms.min()))
    return summary


def _status_kib(field: str) -> Optional[int]:
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


class PeakMemory:
    """`with PeakMemory() as peak: ...` then peak.delta_mib (None where Linux's /proc is missing)."""

    def __enter__(self):
        self.delta_mib = None
        self.base_kib = _status_kib("VmRSS")
        try:
            with open("/proc/self/clear_refs", "w") as clear:
                clear.write("5")  # "5" resets VmHWM to the current RSS
        except OSError:
            self.base_kib = None
        return self

    def __exit__(self, *exc):
        peak = _status_kib("VmHWM")
        if self.base_kib is not None and peak is not None:
            self.delta_mib = max(0, peak - self.base_kib) / 1024
        return False


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


def environment(intra_op_threads: Optional[int] = None) -> dict:
    """Where the numbers were measured: CPU, cores, threads, library versions, kernel library."""
    import torch

    from ..runtimes.ort_kernel import custom_op_library

    library = custom_op_library()
    return {
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "usable_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
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
