"""Building one engine per expert budget K and precision (needs TensorRT and an NVIDIA GPU), and
the plan of which exported model becomes which engine (which does not)."""

from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from ...contract import ExportedModel
from ...errors import InfMoEError
from ...files import atomic_write
from ...quant import PRECISIONS
from .availability import gpu_name, register_plugin, require_cuda_torch, require_tensorrt
from .manifest import engine_entry, engine_file, write_manifest
from .network import parse_network, plugin_model, profile_shapes


def plan_models(paths: Sequence, ks: Optional[List[int]],
                precisions: Optional[List[str]] = None) -> Dict[Tuple[int, str], ExportedModel]:
    """(K, precision) -> exported model from the given files; each has one fixed K and precision,
    read from its metadata. ks / precisions None: whatever the files hold; given, every
    combination must be among the files (an engine keeps its model's types: strongly typed)."""
    planned = {}
    for model in map(ExportedModel.read, paths):
        key = (model.k, model.io.dtype)
        if key in planned:
            raise InfMoEError(f"two {key[1]} models for K={key[0]}: {planned[key].path} and {model.path}")
        planned[key] = model
    wanted = [(k, p) for k in (ks or sorted({k for k, _ in planned}))
              for p in (precisions or sorted({p for _, p in planned}, key=PRECISIONS.index))]
    given = ", ".join(f"K={k} {p}" for k, p in sorted(planned))
    missing = [key for key in wanted if key not in planned]
    if missing:
        raise InfMoEError(f"no {missing[0][1]} model for K={missing[0][0]}: the given models are {given} (an exported "
                          "model has one fixed K and precision; omit --model to export them from a checkpoint)")
    return {key: planned[key] for key in sorted(wanted, key=lambda key: (key[0], PRECISIONS.index(key[1])))}


def builder_config(profiles: List[dict], timing_cache: Path):
    """Polygraphy's CreateConfig for every build: the two optimization profiles, the shared
    timing cache, and TF32 off. TF32 would round the inputs of float32 matrix products to
    10-bit mantissas; the router's product decides where each window starts, so it would move
    windows and break parity with the float32 reference (SPEC §5). No precision flag is set:
    the network is strongly typed, each engine in its model's precision."""
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


def build_engines(models: Dict[object, ExportedModel], out: Path, timing_cache: Path, max_batch: int,
                  max_seq: Optional[int], jit: bool, progress=None) -> Path:
    """One engine per model into out, model_k{K}_{precision}.engine with the model's K and
    precision (the keys are the caller's, e.g. plan_models'), then the manifest; returns the
    manifest's path. Every model is checked (plugin nodes, profiles) before the first build."""
    version = require_tensorrt()
    profiles = []
    for model in models.values():
        plugin_model(model)
        profiles.append(profile_shapes(model.io, max_batch,
                                       model.io.config.n_positions if max_seq is None else max_seq))
    if jit:
        require_cuda_torch()
    register_plugin()
    gpu = gpu_name()
    out = Path(out)
    entries = []
    for model, model_profiles in zip(models.values(), profiles):
        file = engine_file(model.k, model.io.dtype)
        if progress:
            progress(f"K={model.k} {model.io.dtype}")
        build_engine(model, out / file, model_profiles, timing_cache, jit)
        entries.append(engine_entry(file, model, "jit" if jit else "aot", model_profiles, version, gpu))
    return write_manifest(out, entries)
