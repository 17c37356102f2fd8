"""The backends a report measures, each behind Polygraphy's runner interface, and the ONNX
models they run.

    torch         the PyTorch reference (runtimes.torch_runner.TorchRunner)
    ort           onnxruntime with the compiled ContinuousSliceFFN kernel
    ort-fallback  onnxruntime running the model's ONNX fallback function (standard ops only)
    trt           a TensorRT engine per K with the Triton-based plugin (runtimes.tensorrt)
"""

from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Sequence

import numpy as np

from ..errors import InfMoEError
from ..export.io import DecoderIO, model_io

BACKENDS = ("torch", "ort", "ort-fallback", "trt")

__all__ = ["BACKENDS", "OnnxModel", "check_models", "find_models", "make_runner", "parse_backends",
           "unavailable"]


def parse_backends(text: str, allow_torch: bool = True) -> List[str]:
    allowed = BACKENDS if allow_torch else BACKENDS[1:]
    names = [part.strip() for part in text.split(",") if part.strip()]
    for name in names:
        if name not in allowed:
            raise InfMoEError(f"unknown backend {name!r}: choose from {', '.join(allowed)}")
    if not names:
        raise InfMoEError("no backend given")
    return list(dict.fromkeys(names))


@dataclass(frozen=True)
class OnnxModel:
    """An exported model file and the DecoderIO (names, K, noise, config) its metadata records."""
    path: Path
    io: DecoderIO

    @property
    def k(self) -> int:
        return self.io.k

    @property
    def noise(self) -> str:
        return self.io.noise

    def feed(self, input_ids: np.ndarray, *, past: Optional[dict] = None, expert_noise=None,
             seed: int = 0) -> OrderedDict:
        """A feed of input_ids [B, T] with an all-ones attention mask, the given cache (a dict of
        present.{i}.* arrays) or an empty one, and expert noise for a sampled-noise model
        (seeded N(0, 1) unless given)."""
        B, T = input_ids.shape
        past_len = 0 if past is None else past["present.0.key"].shape[2]
        cache = None if past is None else [past[n.replace("past_key_values", "present")] for n in self.io.past_names]
        if self.noise == "sampled" and expert_noise is None:
            expert_noise = np.random.default_rng(seed).standard_normal((B, T, self.k))
        return self.io.feed(input_ids, np.ones((B, past_len + T), dtype=np.int64), cache, expert_noise)


def read_model(path) -> OnnxModel:
    return OnnxModel(Path(path), model_io(path))


def find_models(paths: Sequence, ks: Optional[Sequence[int]] = None) -> List[OnnxModel]:
    """The models of the given files and directories (every *.onnx in a directory), sorted by
    noise mode and K; only the K in ks when given. Two models of the same K and noise is an error."""
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
    for model in map(read_model, files):
        key = (model.noise, model.k)
        if key in models:
            raise InfMoEError(f"two models for K={model.k} ({model.noise} noise): {models[key].path} and {model.path}")
        models[key] = model
    chosen = [models[key] for key in sorted(models) if ks is None or key[1] in ks]
    if ks is not None:
        missing = sorted(set(ks) - {m.k for m in chosen})
        if missing:
            raise InfMoEError(f"no model for K={missing[0]} among {', '.join(str(f) for f in files)}")
    return chosen


def check_models(models: Sequence[OnnxModel], config) -> None:
    """Every model must come from the checkpoint being compared against (same config)."""
    expected = config.to_dict()
    for model in models:
        found = model.io.config.to_dict()
        diff = [key for key in expected if found[key] != expected[key]]
        if diff:
            raise InfMoEError(f"{model.path} was exported from a different checkpoint ({diff[0]}: "
                              f"{found[diff[0]]!r} vs {expected[diff[0]]!r})")


def unavailable(backend: str, model: OnnxModel, engines: Optional[Path] = None) -> Optional[str]:
    """Why a backend cannot run this model here, or None."""
    if backend == "ort":
        from ..runtimes.ort_kernel import custom_op_library

        if custom_op_library() is None:
            return "the compiled kernel is not built (plugins/onnxruntime/build.sh)"
    if backend == "trt":
        from ..runtimes.tensorrt import tensorrt_available

        if not tensorrt_available():
            return "TensorRT is not installed"
        if engines is None:
            return "no TensorRT engines given (--engines DIR from `infmoe-export trt`)"
        if model.noise != "quantile":
            return "TensorRT engines are built for quantile noise only"
    return None


def make_runner(backend: str, model: OnnxModel, torch_model, engines: Optional[Path] = None,
                threads: Optional[int] = None):
    """A Polygraphy runner named after the backend, with the model's input and output names;
    threads: onnxruntime's intra-op threads (None: its default, one per physical core)."""
    if backend == "torch":
        from ..runtimes.torch_runner import TorchRunner

        return TorchRunner(torch_model, k=model.k, noise=model.noise, past=model.io.past,
                           with_starts=model.io.with_starts, name=backend)
    if backend in ("ort", "ort-fallback"):
        from ..runtimes.onnxruntime import OrtRunner

        return OrtRunner(model.path, kernel=backend == "ort", intra_op_threads=threads, name=backend)
    if backend == "trt":
        from ..runtimes.tensorrt import TrtRunner

        return TrtRunner(engines, k=model.k, name=backend)
    raise InfMoEError(f"unknown backend {backend!r}")
