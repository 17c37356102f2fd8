"""Memory per backend and precision: the model's file and weight bytes, and the peak resident set
of a fresh child process that loads the model and decodes (so nothing another configuration
allocated in the parent counts), with the allocator's own peak where the runtime exposes it.

The child is `python -m infmoe_export.report.memory JSON`; it prints one JSON line. Its resident
set before loading (the interpreter with torch and onnxruntime imported) is reported too, so the
model's own share is peak - before.
"""

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import List, Optional, Sequence

import onnx

from ..contract import ExportedModel, load_graph
from ..errors import InfMoEError
from .bench import why_not
from .timing import status_kib

DECODE_STEPS = 8
CHILD_TIMEOUT_S = 600
_NO_ARENA = "onnxruntime's Python API does not expose its arena's statistics"
NO_ALLOCATOR = {"torch": "PyTorch exposes its allocator's peak on CUDA only", "ort": _NO_ARENA, "ort-a8": _NO_ARENA,
                "ort-fallback": _NO_ARENA, "trt": "TensorRT's allocator peak is not exposed"}


def files_of(path: Path) -> List[Path]:
    """The model file and its external-data files."""
    graph = load_graph(path)
    data = {entry.value for t in graph.graph.initializer for entry in t.external_data if entry.key == "location"}
    return [path] + [path.parent / name for name in sorted(data)]


def weight_bytes(path: Path) -> int:
    """Bytes of the model's initializers as stored (packed int4/int8, scales, float weights)."""
    total = 0
    for tensor in load_graph(path).graph.initializer:
        count = 1
        for dim in tensor.dims:
            count *= dim
        bits = 4 if tensor.data_type in (onnx.TensorProto.INT4, onnx.TensorProto.UINT4) else \
            8 * onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type).itemsize
        total += (count * bits + 7) // 8
    return total


def torch_weight_bytes(torch_model) -> int:
    return sum(p.numel() * p.element_size() for p in torch_model.parameters())


def measure_child(backend: str, model: ExportedModel, checkpoint: Optional[str], past: int,
                  threads: Optional[int], engines: Optional[Path]) -> dict:
    """Run the child for one backend and model; its JSON, or {"error": last stderr line}."""
    request = {"backend": backend, "model": str(model.path), "checkpoint": checkpoint, "past": past,
               "threads": threads, "engines": str(engines) if engines else None}
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)} if threads else None
    try:
        done = subprocess.run([sys.executable, "-m", __name__, json.dumps(request)], capture_output=True, text=True,
                              timeout=CHILD_TIMEOUT_S, env=env)
    except subprocess.TimeoutExpired:
        return {"error": f"the measuring process took over {CHILD_TIMEOUT_S} s"}
    if done.returncode != 0:
        lines = done.stderr.strip().splitlines() or [f"exit status {done.returncode}"]
        return {"error": lines[-1]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def run_memory(torch_model, models: Sequence[ExportedModel], *, backends: Sequence[str], checkpoint: Optional[str],
               past: int, threads: Optional[int] = None, engines: Optional[Path] = None, progress=None) -> dict:
    """The report's memory section: per backend and precision, on the model of the largest K of
    that precision (quantile noise when there is one)."""
    chosen = {}
    for model in sorted(models, key=lambda m: (m.noise != "quantile", -m.k)):
        chosen.setdefault(model.io.dtype, model)
    results = []
    for dtype, model in chosen.items():
        files = files_of(model.path)
        for backend in backends:
            if progress:
                progress(f"{backend} {dtype}")
            row = {"backend": backend, "dtype": dtype, "k": model.k, "noise": model.noise, "status": "skipped",
                   "reason": why_not(backend, model, engines),
                   "file_bytes": sum(f.stat().st_size for f in files if f.is_file()),
                   "weight_bytes": torch_weight_bytes(torch_model) if backend == "torch" else weight_bytes(model.path),
                   "rss_before_load_bytes": None, "peak_rss_bytes": None, "allocator_peak_bytes": None,
                   "allocator_note": NO_ALLOCATOR.get(backend)}
            if backend == "torch":
                row["file_bytes"] = None  # PyTorch loads the checkpoint, not this file
            if row["reason"] is None:
                measured = measure_child(backend, model, checkpoint, past, threads, engines)
                if "error" in measured:
                    row.update(status="failed", reason=measured["error"])
                else:
                    row.update(status="ok", **measured)
                    if row["allocator_peak_bytes"] is not None:
                        row["allocator_note"] = None
            results.append(row)
    return {"settings": {"decode_steps": DECODE_STEPS, "past": past, "threads": threads}, "results": results}


def child(request: dict) -> dict:
    """In the fresh process: load, prefill `past` tokens, decode DECODE_STEPS steps; peak figures."""
    import torch

    from ..checkpoint import load_checkpoint
    from ..runtimes import registry
    from .bench import timed_feed

    before = status_kib("VmRSS")
    if request["threads"]:
        torch.set_num_threads(request["threads"])
    model = ExportedModel.read(request["model"])
    torch_model = load_checkpoint(request["checkpoint"]) if request["backend"] == "torch" else None
    engines = Path(request["engines"]) if request["engines"] else None
    with registry.make_runner(request["backend"], model, torch_model, engines, request["threads"]) as runner:
        feed = timed_feed(runner, model, 1, 1, request["past"])
        for _ in range(DECODE_STEPS):
            runner.infer(feed, check_inputs=False)
    peak = status_kib("VmHWM")
    allocator = None
    if request["backend"] == "torch" and torch.cuda.is_available() and torch.cuda.max_memory_allocated():
        allocator = torch.cuda.max_memory_allocated()
    return {"rss_before_load_bytes": before * 1024 if before is not None else None,
            "peak_rss_bytes": peak * 1024 if peak is not None else None, "allocator_peak_bytes": allocator}


if __name__ == "__main__":
    try:
        print(json.dumps(child(json.loads(sys.argv[1]))))
    except InfMoEError as error:
        sys.exit(f"error: {error}")
