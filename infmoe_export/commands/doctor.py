"""`infmoe-export doctor`: what this machine can run, so a user knows which backends to expect."""

import importlib
import json
import os
import shutil
import subprocess
from typing import Optional

import click

from ..runtimes.ort_kernel import custom_op_library


def _version(module_name: str) -> Optional[str]:
    """The module's version, or None when it is not installed or fails to import."""
    try:
        module = importlib.import_module(module_name)
    except Exception:  # a broken optional install reads as "absent", never a crash
        return None
    return str(getattr(module, "__version__", "unknown"))


def _nvcc() -> Optional[dict]:
    path = shutil.which("nvcc")
    if path is None:
        return None
    try:
        text = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.TimeoutExpired):
        text = ""
    release = next((line.strip() for line in text.splitlines() if "release" in line), None)
    return {"path": path, "version": release}


def report() -> dict:
    """Everything doctor prints, as plain JSON-ready data."""
    import torch

    info = {"torch": {"version": torch.__version__, "threads": torch.get_num_threads(),
                      "cuda_available": torch.cuda.is_available(), "cuda_build": torch.version.cuda}}
    if torch.cuda.is_available():
        info["torch"]["cuda_devices"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    try:
        import onnxruntime

        info["onnxruntime"] = {"version": onnxruntime.__version__,
                               "providers": onnxruntime.get_available_providers()}
    except Exception:
        info["onnxruntime"] = None
    library = custom_op_library()
    info["ort_custom_op_library"] = str(library) if library is not None else None
    info["tensorrt"] = _version("tensorrt")
    info["polygraphy"] = _version("polygraphy")
    info["nvcc"] = _nvcc()
    info["triton"] = {"version": _version("triton"),
                      "interpret": os.environ.get("TRITON_INTERPRET") == "1"}
    return info


def _absent(value) -> str:
    return "absent" if value is None else str(value)


@click.command("doctor")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def doctor_command(as_json):
    """What this machine can run: torch, onnxruntime, kernels, TensorRT."""
    info = report()
    if as_json:
        click.echo(json.dumps(info, indent=2))
        return
    from rich.console import Console
    from rich.table import Table

    t, ort, nvcc, triton = info["torch"], info["onnxruntime"], info["nvcc"], info["triton"]
    cuda = "available: " + ", ".join(t["cuda_devices"]) if t["cuda_available"] else \
        f"not available (torch CUDA build: {_absent(t['cuda_build'])})"
    rows = [
        ("torch", f"{t['version']}, {t['threads']} threads"),
        ("CUDA (torch)", cuda),
        ("nvcc", f"{nvcc['path']} ({nvcc['version']})" if nvcc else "absent"),
        ("onnxruntime", f"{ort['version']}, providers: {', '.join(ort['providers'])}" if ort else "absent"),
        ("onnxruntime kernel", info["ort_custom_op_library"] or "not built (the ONNX fallback function is used)"),
        ("TensorRT", _absent(info["tensorrt"])),
        ("polygraphy", _absent(info["polygraphy"])),
        ("Triton", _absent(triton["version"]) + (" (TRITON_INTERPRET=1: interpreter on CPU)"
                                                 if triton["interpret"] else "")),
    ]
    table = Table(title="infmoe-export doctor", show_header=False)
    table.add_column(style="bold")
    table.add_column()
    for name, value in rows:
        table.add_row(name, value)
    Console().print(table)
