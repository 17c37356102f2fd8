"""Building one engine per expert budget K (needs TensorRT and an NVIDIA GPU), and the plan of
which exported model becomes which engine (which does not)."""

from pathlib import Path
from typing import Dict, List, Optional, Sequence

from ...contract import ExportedModel
from ...errors import InfMoEError
from ...files import atomic_write
from .availability import gpu_name, register_plugin, require_cuda_torch, require_tensorrt
from .manifest import engine_entry, write_manifest
from .network import parse_network, plugin_model, profile_shapes


def plan_models(paths: Sequence, ks: Optional[List[int]]) -> Dict[int, ExportedModel]:
    """K -> exported model from the given files (each has one fixed K, read from its metadata)."""
    by_k = {}
    for model in map(ExportedModel.read, paths):
        if model.k in by_k:
            raise InfMoEError(f"two models for K={model.k}: {by_k[model.k].path} and {model.path}")
        by_k[model.k] = model
    if ks is None:
        return dict(sorted(by_k.items()))
    missing = [k for k in ks if k not in by_k]
    if missing:
        raise InfMoEError(f"no model for K={missing[0]}: the given models were exported for K="
                          f"{', '.join(map(str, sorted(by_k)))} (an exported model has one fixed K; "
                          "omit --model to export every K from a checkpoint)")
    return {k: by_k[k] for k in ks}


def check_precision(models: Dict[int, ExportedModel], fp16: bool) -> None:
    """Engines run each tensor in the type the model gives it (strongly typed networks), so the
    precision is chosen at export: fp16 asks for float16 exports, and every model must be one."""
    wanted = "fp16" if fp16 else "fp32"
    for model in models.values():
        if model.io.dtype != wanted:
            fix = "drop --fp16" if model.io.dtype == "fp32" else "add --fp16"
            raise InfMoEError(f"{model.path} was exported as {model.io.dtype}, not {wanted}: {fix}, or export it "
                              f"with `infmoe-export onnx --dtype {wanted} --no-function`")


def builder_config(profiles: List[dict], timing_cache: Path):
    """Polygraphy's CreateConfig for every build: the two optimization profiles, the shared
    timing cache, and TF32 off. TF32 would round the inputs of float32 matrix products to
    10-bit mantissas; the router's product decides where each window starts, so it would move
    windows and break parity with the float32 reference (SPEC §5). No precision flag is set:
    the network is strongly typed."""
    from polygraphy.backend.trt import CreateConfig, Profile

    trt_profiles = []
    for profile in profiles:
        p = Profile()
        for name, r in profile["shapes"].items():
            p.add(name, r["min"], r["opt"], r["max"])
        trt_profiles.append(p)
    return CreateConfig(tf32=False, profiles=trt_profiles,
                        load_timing_cache=str(timing_cache) if timing_cache.is_file() else None)


def build_engine(model: ExportedModel, engine_path: Path, profiles: List[dict], timing_cache: Path,
                 jit: bool) -> Path:
    from polygraphy.backend.trt import EngineBytesFromNetwork

    try:
        serialized = EngineBytesFromNetwork(parse_network(model, jit), config=builder_config(profiles, timing_cache),
                                            save_timing_cache=str(timing_cache))()
    except InfMoEError:
        raise
    except Exception as error:  # TensorRT and Polygraphy raise plain exceptions
        first = next((line for line in str(error).splitlines() if line.strip()), type(error).__name__)
        raise InfMoEError(f"TensorRT could not build an engine from {model.path}: {first}") from error
    return atomic_write(engine_path, bytes(serialized))


def build_engines(models: Dict[int, ExportedModel], out: Path, fp16: bool, timing_cache: Path, max_batch: int,
                  max_seq: Optional[int], jit: bool, progress=None) -> Path:
    """One engine per K into out, then the manifest; returns the manifest's path. Every model is
    checked (precision, plugin nodes, profiles) before the first build."""
    version = require_tensorrt()
    check_precision(models, fp16)
    profiles = {}
    for k, model in models.items():
        plugin_model(model)
        profiles[k] = profile_shapes(model.io, max_batch, model.io.config.n_positions if max_seq is None else max_seq)
    if jit:
        require_cuda_torch()
    register_plugin()
    gpu = gpu_name()
    out = Path(out)
    entries = []
    for k, model in models.items():
        engine_file = f"model_k{k}.engine"
        if progress:
            progress(f"K={k}")
        build_engine(model, out / engine_file, profiles[k], timing_cache, jit)
        entries.append(engine_entry(engine_file, model, "jit" if jit else "aot", profiles[k], version, gpu))
    return write_manifest(out, entries)
