"""The registry of backends: each runs an exported model behind Polygraphy's runner interface,
with the same constructor shape (the model's DecoderIO, then what it runs) and the same `.io`,
so generation, parity and bench drive any of them.

    torch         the PyTorch reference (torch_runner.TorchRunner); for an int8 / int4 model the
                  dequantized weights, the level-1 reference (SPEC §6)
    ort           onnxruntime with the compiled ContinuousSliceFFN kernel (ort.OrtRunner)
    ort-a8        the same, its quantized ops on int8 activations (integer dot products; an
                  int8 / int4 model only; judged at level 2, docs/guide/quantization.md)
    ort-fallback  onnxruntime running the model's ONNX fallback function (standard ops only)
    trt           a TensorRT engine per K with the Triton-based plugin (tensorrt.TrtRunner)
"""

from pathlib import Path
from typing import List, Optional, Sequence

from ..contract import ExportedModel
from ..errors import InfMoEError

BACKENDS = ("torch", "ort", "ort-a8", "ort-fallback", "trt")
# The backends whose logits SPEC §6 level 1 does not bind: they are judged at level 2 only.
LEVEL2_ONLY = ("ort-a8",)

__all__ = ["BACKENDS", "LEVEL2_ONLY", "check_models", "find_models", "make_runner", "parse_backends", "unavailable"]


def parse_backends(text: str, allow_torch: bool = True) -> List[str]:
    allowed = BACKENDS if allow_torch else BACKENDS[1:]
    names = [part.strip() for part in text.split(",") if part.strip()]
    for name in names:
        if name not in allowed:
            raise InfMoEError(f"unknown backend {name!r}: choose from {', '.join(allowed)}")
    if not names:
        raise InfMoEError("no backend given")
    return list(dict.fromkeys(names))


def find_models(paths: Sequence, ks: Optional[Sequence[int]] = None) -> List[ExportedModel]:
    """The models of the given files and directories (every *.onnx in a directory), sorted by
    precision, noise mode and K; only the K in ks when given. Two models of the same precision, K
    and noise is an error."""
    files = []
    for path in map(Path, paths):
        if path.is_dir():
            found = sorted(path.glob("*.onnx"))
            if not found:
                raise InfMoEError(f"{path} has no *.onnx models")
            files += found
        elif path.is_file():
            files.append(path)
        else:
            raise InfMoEError(f"model {path} does not exist")
    models = {}
    for model in map(ExportedModel.read, files):
        key = (model.io.dtype, model.noise, model.k)
        if key in models:
            raise InfMoEError(f"two {model.io.dtype} models for K={model.k} ({model.noise} noise): "
                              f"{models[key].path} ({models[key].io.label}) and {model.path} ({model.io.label}); a "
                              "report has one row per precision and K: compare them in separate runs")
        models[key] = model
    chosen = [models[key] for key in sorted(models) if ks is None or key[2] in ks]
    if ks is not None:
        missing = sorted(set(ks) - {m.k for m in chosen})
        if missing:
            raise InfMoEError(f"no model for K={missing[0]} among {', '.join(str(f) for f in files)}")
    return chosen


def check_models(models: Sequence[ExportedModel], config) -> None:
    """Every model must come from the checkpoint being compared against (same config; first of
    all the same architecture, named in one line)."""
    from ..checkpoint import require_arch

    expected = config.to_dict()
    for model in models:
        require_arch(config, model.io.config.model_type, f"{model.path}")
        found = model.io.config.to_dict()
        diff = [key for key in expected if found[key] != expected[key]]
        if diff:
            raise InfMoEError(f"{model.path} was exported from a different checkpoint ({diff[0]}: "
                              f"{found[diff[0]]!r} vs {expected[diff[0]]!r})")


def unavailable(backend: str, model: ExportedModel, engines: Optional[Path] = None) -> Optional[str]:
    """Why a backend cannot run this model here, or None."""
    if backend in ("ort", "ort-a8"):
        from .ort_kernel import custom_op_library

        if custom_op_library() is None:
            return "the compiled kernel is not installed (see docs/guide/onnxruntime.md)"
    if backend == "ort-a8" and not model.io.quantized:
        return f"int8 activations apply to int8 / int4 weights ({model.io.dtype} model: the same as ort)"
    if backend == "trt":
        from .tensorrt import tensorrt_problem

        problem = tensorrt_problem()
        if problem:
            return problem
        if engines is None:
            return "no TensorRT engines given (--engines DIR from `infmoe-export trt`)"
        if model.noise != "quantile":
            return "TensorRT engines are built for quantile noise only"
    return None


def make_runner(backend: str, model: ExportedModel, torch_model, engines: Optional[Path] = None,
                threads: Optional[int] = None, taking_turns: bool = False):
    """A Polygraphy runner named after the backend, with the model's input and output names;
    threads: onnxruntime's intra-op threads (None: its default, one per physical core);
    taking_turns: the runner's calls alternate with other runners' (bench), so onnxruntime's
    threads must not spin past a run (ort.FORCE_SPINNING_STOP)."""
    if backend == "torch":
        from .torch_runner import TorchRunner

        return TorchRunner(model.io, torch_model, name=backend)
    if backend in ("ort", "ort-a8", "ort-fallback"):
        from .ort import OrtRunner

        return OrtRunner(model.io, model, kernel=backend != "ort-fallback", intra_op_threads=threads,
                         stop_spinning=taking_turns, name=backend,
                         activations="int8" if backend == "ort-a8" else "float")
    if backend == "trt":
        from .tensorrt import TrtRunner

        return TrtRunner.from_engines(engines, model.k, model.io.dtype, name=backend)
    raise InfMoEError(f"unknown backend {backend!r}")
