"""OUT/manifest.json: what each engine was built from and for, and engine selection by (K, precision)."""

import json
from pathlib import Path
from typing import List, Optional

from ...contract import ExportedModel
from ...errors import InfMoEError
from ...files import atomic_write, sha256
from ...quant import PRECISIONS

SCHEMA_VERSION = 1
MANIFEST_FILE = "manifest.json"
PLUGIN_MODES = ("aot", "jit")
REQUIRED = {"k": int, "file": str, "precision": str, "tf32": bool, "plugin": str, "profiles": list,
            "tensorrt_version": str, "gpu": str, "metadata": dict, "onnx": dict, "io": dict}


def engine_file(k: int, precision: str) -> str:
    return f"model_k{k}_{precision}.engine"


def engine_entry(engine_file: str, model: ExportedModel, plugin: str, profiles: List[dict],
                 tensorrt_version: str, gpu: str) -> dict:
    """One engine's entry. precision is the model's expert precision, fp32|fp16|int8|int4
    (strongly typed networks keep its types; the block size is in its metadata); tf32 is
    always False (build.builder_config says why)."""
    io = model.io
    return {"k": model.k, "file": engine_file, "precision": io.dtype, "tf32": False, "plugin": plugin,
            "profiles": profiles, "tensorrt_version": tensorrt_version, "gpu": gpu, "metadata": model.metadata,
            "onnx": {"file": str(model.path), "sha256": sha256(model.path)},
            "io": {"inputs": io.input_names, "outputs": io.output_names, "noise": io.noise, "past": io.past,
                   "with_starts": io.with_starts, "dtype": io.dtype}}


def write_manifest(folder: Path, engines: List[dict]) -> Path:
    manifest = {"schema_version": SCHEMA_VERSION,
                "engines": sorted(engines, key=lambda e: (e["k"], PRECISIONS.index(e["precision"])))}
    return atomic_write(Path(folder) / MANIFEST_FILE, json.dumps(manifest, indent=2) + "\n")


def read_manifest(path) -> dict:
    """The manifest of an engine folder (or the manifest file itself), checked."""
    path = Path(path)
    file = path / MANIFEST_FILE if path.is_dir() else path
    if not file.is_file():
        raise InfMoEError(f"{path} has no TensorRT engine manifest ({MANIFEST_FILE}); build one with "
                          "`infmoe-export trt --out DIR`")
    try:
        manifest = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise InfMoEError(f"{file} is not valid JSON: {error}") from None
    if not isinstance(manifest, dict) or manifest.get("schema_version") != SCHEMA_VERSION:
        raise InfMoEError(f"{file}: unsupported manifest (schema_version must be {SCHEMA_VERSION})")
    engines = manifest.get("engines")
    if not isinstance(engines, list) or not engines:
        raise InfMoEError(f"{file}: 'engines' must be a non-empty list")
    for index, entry in enumerate(engines):
        for key, kind in REQUIRED.items():
            if not isinstance(entry, dict) or not isinstance(entry.get(key), kind):
                raise InfMoEError(f"{file}: engine {index} needs {key!r} of type {kind.__name__}")
        if entry["plugin"] not in PLUGIN_MODES:
            raise InfMoEError(f"{file}: engine {index} has plugin {entry['plugin']!r}, expected one of {PLUGIN_MODES}")
        if entry["precision"] not in PRECISIONS:
            raise InfMoEError(f"{file}: engine {index} has precision {entry['precision']!r}, expected one of "
                              f"{PRECISIONS}")
    keys = [(entry["k"], entry["precision"]) for entry in engines]
    for key in set(keys):
        if keys.count(key) > 1:
            raise InfMoEError(f"{file}: two engines for K={key[0]} {key[1]}")
    manifest["folder"] = str(file.parent)
    return manifest


def select_engine(manifest: dict, k: int, precision: Optional[str] = None) -> dict:
    """The manifest entry for expert budget k and precision, with 'path' resolved against the
    manifest's folder. precision None: the only engine for k (an error naming the choices when
    the folder holds several precisions of k)."""
    for_k = [entry for entry in manifest["engines"] if entry["k"] == k]
    chosen = [entry for entry in for_k if precision in (None, entry["precision"])]
    built = ", ".join(f"K={e['k']} {e['precision']}" for e in manifest["engines"])
    if not chosen:
        wanted = f"K={k}" if precision is None else f"K={k} {precision}"
        raise InfMoEError(f"no TensorRT engine for {wanted} in {manifest['folder']} (available: {built})")
    if len(chosen) > 1:
        raise InfMoEError(f"{manifest['folder']} holds engines for K={k} in "
                          f"{', '.join(e['precision'] for e in chosen)}: choose a precision")
    entry = chosen[0]
    path = Path(manifest["folder"]) / entry["file"]
    if not path.is_file():
        raise InfMoEError(f"engine file {path} for K={k} {entry['precision']} is missing")
    return dict(entry, path=str(path))
