"""`infmoe-export triton-repo`: a Triton model repository for one checkpoint.

    OUT/infmoe/config.pbtxt, 1/model.py           the decoding front model (Python backend): a step a request
    OUT/infmoe_generate/config.pbtxt, 1/model.py  the same file as the generate model: a generation a request,
                                                    its tokens streamed back (decoupled)
    OUT/infmoe_k{K}_{precision}/config.pbtxt       one onnxruntime-backend model per (K, precision): the
        1/model.onnx, libinfmoe_ort.so              export choice of that precision (contract.ExportChoice,
                                                    as `run` exports it), the kernel library beside it
    OUT/infmoe_k{K}_{precision}_trt/1/model.plan   one TensorRT-backend model per engine (--engines)

Every config.pbtxt is parsed with Triton's schema before it is written; the repository is
staged beside OUT and published whole (files.staged_dir)."""

import json
import shutil
from importlib import resources
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

from ..contract import DecoderIO, ExportChoice
from ..errors import InfMoEError
from ..export import export_onnx
from ..files import atomic_write, check_replaceable_dir, staged_dir
from ..runtimes.ort_kernel import custom_op_library
from ..verify.validate import validate_onnx
from . import batching
from . import config as cfg

EXECUTORS = ("local", "bls")
LIBRARY = "libinfmoe_ort.so"


def _write_config(folder: Path, text: str) -> Path:
    cfg.validate(text, str(folder / "config.pbtxt"))
    folder.mkdir(parents=True, exist_ok=True)
    return atomic_write(folder / "config.pbtxt", text)


def build_repository(model, out, ks: Sequence[int], choices: Sequence[ExportChoice], *,
                     engines: Optional[Path] = None, mount_path: Optional[str] = None, executor: str = "local",
                     kernel: bool = True, inputs: Sequence[Path] = (),
                     preferred_batch_sizes: Optional[Sequence[int]] = None,
                     progress: Optional[Callable[[str], None]] = None) -> Dict[str, List[str]]:
    """Write the repository: per K, one model per export choice (options.export_choices: what `run`
    runs), each served as the precision its --dtype names (the request parameter `precision`; the
    first choice's when a request gives none). The front model's preferred batch sizes are
    preferred_batch_sizes, or (None) those of the batched-decode curve measured now on the first
    choice's models, ms per step summed over K (batching.py).
    {"models": [...], "warnings": [...], "preferred_batch_sizes": [...]}."""
    cfg.require_schema()
    if preferred_batch_sizes is not None and any(not 1 <= b <= cfg.MAX_BATCH for b in preferred_batch_sizes):
        raise InfMoEError(f"preferred batch sizes (--preferred-batch-sizes) must lie in 1..{cfg.MAX_BATCH}, got "
                          f"{', '.join(map(str, preferred_batch_sizes))}")
    out = check_replaceable_dir(Path(out), inputs=inputs)
    if not ks or any(k < 1 for k in ks):
        raise InfMoEError("--k needs positive expert budgets")
    precisions = [choice.dtype for choice in choices]
    if len(set(precisions)) < len(precisions):
        raise InfMoEError(f"one export choice per precision, got {', '.join(c.label for c in choices)}")
    if executor not in EXECUTORS:
        raise InfMoEError(f"executor must be one of {', '.join(EXECUTORS)}, got {executor!r}")
    manifest = None
    if engines is not None:
        from ..runtimes.tensorrt.manifest import read_manifest

        manifest = read_manifest(engines)
    mount = str(mount_path) if mount_path else str(out.resolve())
    library = custom_op_library() if kernel else None
    warnings = []
    if kernel and (library is None or not library.is_file()):
        warnings.append("the kernel library is not installed: the onnxruntime models run on the fallback function")
        library = None
    names, routes, measured = [], {}, []
    with staged_dir(out) as stage:
        for choice in choices:
            precision = choice.dtype
            for k in ks:
                name = cfg.model_name(k, precision)
                folder = stage / name
                if progress:
                    progress(f"export K={k} {choice.label}")
                # Straight into Triton's layout: an external-data file stays beside its graph.
                exported = export_onnx(model, folder / "1" / "model.onnx", k=k, **choice.options())
                if progress:
                    progress(f"validate K={k} {choice.label}")
                validate_onnx(model, exported)
                lib_path = None
                if library is not None:
                    shutil.copy2(library, folder / LIBRARY)
                    lib_path = f"{mount}/{name}/{LIBRARY}"
                _write_config(folder, cfg.onnx_model_config(name, exported.io, lib_path))
                decoder_io = exported.io
                past_shape = [decoder_io.config.n_head, 0, decoder_io.config.head_dim]
                routes[f"{exported.k}/{precision}"] = {"onnx": f"{name}/1/model.onnx", "triton": name,
                                                       "past_shape": json.dumps(past_shape),
                                                       "shared_cache": decoder_io.shares_cache,
                                                       "activations": decoder_io.activations,
                                                       "kv_cache": decoder_io.kv_cache,
                                                       "exported": exported.io.label}
                names.append(name)
                if choice is choices[0]:
                    measured.append(exported)
                front_io = decoder_io
        if manifest is not None:
            from ..runtimes.tensorrt.manifest import select_engine

            for entry in manifest["engines"]:
                entry = select_engine(manifest, entry["k"], entry["precision"])
                decoder_io = DecoderIO.from_metadata(entry["metadata"])
                name = cfg.model_name(entry["k"], entry["precision"], "trt")
                folder = stage / name
                (folder / "1").mkdir(parents=True)
                shutil.copy2(entry["path"], folder / "1" / "model.plan")
                _write_config(folder, cfg.tensorrt_model_config(name, decoder_io))
                names.append(name)
        curve = None
        if preferred_batch_sizes is None:
            if progress:
                progress(f"measure the batched decode of {choices[0].label} (B = "
                         f"{', '.join(map(str, batching.CURVE_BATCHES))})")
            curves = [batching.measure_curve(exported, kernel=library is not None) for exported in measured]
            curve = {b: sum(c[b] for c in curves) for b in batching.CURVE_BATCHES}
            preferred_batch_sizes = batching.preferred_batch_sizes(curve, cfg.MAX_BATCH)
        source = resources.files("infmoe_export.serving").joinpath("tritonserver_model.py").read_text()
        front_models = ((cfg.FRONT_MODEL, cfg.front_model_config), (cfg.GENERATE_MODEL, cfg.generate_model_config))
        for name, config in front_models:
            (stage / name / "1").mkdir(parents=True)
            atomic_write(stage / name / "1" / "model.py", source)
            _write_config(stage / name, config(routes, front_io, executor, default_precision=precisions[0],
                                               preferred_batch_sizes=preferred_batch_sizes))
        names[:0] = [cfg.FRONT_MODEL, cfg.GENERATE_MODEL]
        batch = {"max_batch_size": cfg.MAX_BATCH, "preferred_batch_sizes": sorted(set(preferred_batch_sizes)),
                 "measured": None if curve is None else {
                     "of": f"{choices[0].label}, K = {', '.join(str(e.k) for e in measured)}",
                     "past": batching.CURVE_PAST, "ms_per_step": {str(b): round(ms, 3) for b, ms in curve.items()}}}
        atomic_write(stage / "repository.json", json.dumps(
            {"front_model": cfg.FRONT_MODEL, "generate_model": cfg.GENERATE_MODEL, "routes": routes, "models": names,
             "executor": executor, "mount_path": mount, "kernel_library": library is not None, "batching": batch},
            indent=2) + "\n")
    return {"models": names, "warnings": warnings, "preferred_batch_sizes": batch["preferred_batch_sizes"]}


def read_repository(path) -> dict:
    """repository.json of a repository this command wrote; InfMoEError otherwise."""
    file = Path(path) / "repository.json"
    if not file.is_file():
        raise InfMoEError(f"{path} is not a model repository written by `infmoe-export triton-repo` "
                          "(no repository.json)")
    try:
        data = json.loads(file.read_text())
    except (ValueError, UnicodeDecodeError) as error:
        raise InfMoEError(f"{file} is not valid JSON: {error}") from None
    if not isinstance(data, dict) or not isinstance(data.get("routes"), dict) or not data["routes"]:
        raise InfMoEError(f"{file} has no routes")
    return data
