"""TensorRT: one engine per expert budget K, a JSON manifest, and a Polygraphy runner.

`infmoe-export trt` exports (or takes) one ONNX model per K without the fallback local function,
so the parser maps each ContinuousSliceFFN node to the `infmoe::ContinuousSliceFFN` plugin
(plugins/tensorrt/infmoe_trt), and builds each engine through Polygraphy's loaders with two
optimization profiles (prefill and decode) and one timing cache shared by all builds.

Everything here except building and running engines works without TensorRT: planning which
models to build, the profiles, the manifest and engine selection by K.
"""

import ctypes
import importlib
import json
import sys
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import click
import onnx
from polygraphy.backend.common import BytesFromPath
from polygraphy.backend.trt import EngineFromBytes
from polygraphy.backend.trt import TrtRunner as PolygraphyTrtRunner  # TensorRT itself is imported lazily

from ...contract import BATCH, DOMAIN, OP_TYPE, OP_VERSION, PAST, SEQUENCE, TOTAL, DecoderIO, ExportedModel
from ...errors import InfMoEError
from ...files import atomic_write, sha256
from ...options import positive_ints

SCHEMA_VERSION = 1
MANIFEST_FILE = "manifest.json"
DEFAULT_KS = (1, 2, 4, 8)
INSTALL_HINT = ("install it with `pip install 'infmoe-export[tensorrt]'` on a machine with an NVIDIA GPU "
                "and driver")
# Where the plugin package lives in a source checkout (it is not part of the wheel's infmoe_export).
PLUGIN_DIR = Path(__file__).resolve().parents[2] / "plugins" / "tensorrt"


# ---------------------------------------------------------------------------------------------
# TensorRT and the plugin package


def tensorrt_available() -> Optional[str]:
    """TensorRT's version when its Python package imports, else None (for `doctor`)."""
    try:
        import tensorrt
    except (ImportError, OSError):  # OSError: the wheel is there but its libraries are not
        return None
    return tensorrt.__version__


def require_tensorrt() -> str:
    version = tensorrt_available()
    if version is None:
        raise InfMoEError(f"TensorRT is not installed: {INSTALL_HINT}")
    return version


def import_infmoe_trt(module: str = "kernel"):
    """infmoe_trt.<module> (kernel, descriptors, plugin), from the installed package or the checkout."""
    try:
        return importlib.import_module(f"infmoe_trt.{module}")
    except ModuleNotFoundError as error:
        if error.name != "infmoe_trt":
            raise
    if not (PLUGIN_DIR / "infmoe_trt").is_dir():
        raise InfMoEError(f"the TensorRT plugin package infmoe_trt is missing (expected in {PLUGIN_DIR})")
    sys.path.insert(0, str(PLUGIN_DIR))
    return importlib.import_module(f"infmoe_trt.{module}")


def register_plugin():
    """Register `infmoe::ContinuousSliceFFN` with TensorRT (idempotent: the module imports once)."""
    require_tensorrt()
    return import_infmoe_trt("plugin")


def gpu_name() -> str:
    """Name of CUDA device 0 through the driver API (torch may be a CPU build on a GPU machine)."""
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
        device, name = ctypes.c_int(), ctypes.create_string_buffer(256)
        if cuda.cuInit(0) or cuda.cuDeviceGet(ctypes.byref(device), 0) or cuda.cuDeviceGetName(name, 256, device):
            return "unknown"
        return name.value.decode()
    except OSError:
        return "unknown"


# ---------------------------------------------------------------------------------------------
# The ONNX model the builder parses


def check_plugin_model(path) -> int:
    """Refuse a model the parser would not map to the plugin; returns its number of plugin nodes.

    A local function named like the op makes the parser expand it instead of using the plugin,
    and the node needs the attributes the plugin lookup and the plugin itself read.
    """
    model = onnx.load(str(path), load_external_data=False)
    if any(f.domain == DOMAIN and f.name == OP_TYPE for f in model.functions):
        raise InfMoEError(f"{path} carries the fallback function {DOMAIN}::{OP_TYPE}; TensorRT would expand it "
                          "instead of using the plugin: export it with `infmoe-export onnx --no-function`")
    count = 0
    for node in model.graph.node:
        if node.domain != DOMAIN:
            continue
        if node.op_type != OP_TYPE:
            raise InfMoEError(f"{path}: node {node.name!r} has unknown op {node.domain}::{node.op_type}")
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        wanted = {"plugin_namespace": DOMAIN.encode(), "plugin_version": str(OP_VERSION).encode(),
                  "activation": b"gelu_tanh"}
        for name, value in wanted.items():
            if attrs.get(name) != value:
                raise InfMoEError(f"{path}: node {node.name!r} needs attribute {name}={value.decode()!r}, "
                                  f"got {attrs.get(name)!r}")
        if not isinstance(attrs.get("slice_width"), int):
            raise InfMoEError(f"{path}: node {node.name!r} needs an integer attribute slice_width")
        count += 1
    return count


def parse_ks(text: Optional[str]) -> Optional[List[int]]:
    """'1,2,4,8' -> [1, 2, 4, 8] (sorted, unique); None (every K the models have) stays None."""
    return None if text is None else positive_ints(text, "--k")


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


# ---------------------------------------------------------------------------------------------
# Optimization profiles


def profile_shapes(io: DecoderIO, max_batch: int, max_seq: int) -> List[dict]:
    """The prefill and decode profiles: {name, shapes: {input: {min, opt, max}}}.

    prefill: sequence 1..max_seq with an empty cache; decode: one new token after a cache of
    0..max_seq - 1 tokens (so past + new <= max_seq). Batch 1..max_batch; opt is batch 1, the
    latency case, and half the longest sequence.
    """
    if max_batch < 1:
        raise InfMoEError(f"--max-batch must be at least 1, got {max_batch}")
    if not 1 <= max_seq <= io.config.n_positions:
        raise InfMoEError(f"--max-seq must be in [1, {io.config.n_positions}] (the model's n_positions), "
                          f"got {max_seq}")
    half = max(1, max_seq // 2)
    ranges = {"prefill": {BATCH: (1, 1, max_batch), SEQUENCE: (1, half, max_seq), PAST: (0, 0, 0),
                          TOTAL: (1, half, max_seq)},
              "decode": {BATCH: (1, 1, max_batch), SEQUENCE: (1, 1, 1), PAST: (0, half - 1, max_seq - 1),
                         TOTAL: (1, half, max_seq)}}
    if not io.past:  # no cache inputs: one profile, attention_mask spans the sequence only
        ranges = {"prefill": ranges["prefill"]}
    shapes = io.shapes()
    profiles = []
    for name, dims in ranges.items():
        inputs = {}
        for tensor in io.input_names:
            bounds = [dims[d] if isinstance(d, str) else (d, d, d) for d in shapes[tensor]]
            inputs[tensor] = {key: [b[i] for b in bounds] for i, key in enumerate(("min", "opt", "max"))}
        profiles.append({"name": name, "shapes": inputs})
    return profiles


def pick_profile(profiles: List[dict], shapes: Dict[str, Sequence[int]]) -> int:
    """Index of the first profile whose ranges hold every input shape."""
    names = set(profiles[0]["shapes"])
    if set(shapes) != names:
        raise InfMoEError(f"the engine's inputs are {sorted(names)}, got {sorted(shapes)}")
    for index, profile in enumerate(profiles):
        if all(all(lo <= s <= hi for lo, s, hi in zip(r["min"], shapes[name], r["max"]))
               and len(shapes[name]) == len(r["min"]) for name, r in profile["shapes"].items()):
            return index
    ranges = "; ".join(f"{p['name']}: " + ", ".join(f"{n} {r['min']}..{r['max']}" for n, r in p["shapes"].items())
                       for p in profiles)
    given = ", ".join(f"{n} {list(s)}" for n, s in shapes.items())
    raise InfMoEError(f"input shapes ({given}) fit no optimization profile of the engine ({ranges})")


# ---------------------------------------------------------------------------------------------
# Manifest


def engine_entry(engine_file: str, model: ExportedModel, precision: str, plugin: str, profiles: List[dict],
                 tensorrt_version: str, gpu: str) -> dict:
    io = model.io
    return {"k": model.k, "file": engine_file, "precision": precision, "plugin": plugin, "profiles": profiles,
            "tensorrt_version": tensorrt_version, "gpu": gpu, "metadata": model.metadata,
            "onnx": {"file": str(model.path), "sha256": sha256(model.path)},
            "io": {"inputs": io.input_names, "outputs": io.output_names, "noise": io.noise, "past": io.past,
                   "with_starts": io.with_starts, "dtype": io.dtype}}


def write_manifest(folder: Path, engines: List[dict]) -> Path:
    manifest = {"schema_version": SCHEMA_VERSION, "engines": sorted(engines, key=lambda e: e["k"])}
    return atomic_write(Path(folder) / MANIFEST_FILE, (json.dumps(manifest, indent=2) + "\n").encode())


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
    required = {"k": int, "file": str, "precision": str, "plugin": str, "profiles": list, "tensorrt_version": str,
                "gpu": str, "metadata": dict, "onnx": dict, "io": dict}
    for index, entry in enumerate(engines):
        for key, kind in required.items():
            if not isinstance(entry, dict) or not isinstance(entry.get(key), kind):
                raise InfMoEError(f"{file}: engine {index} needs {key!r} of type {kind.__name__}")
    manifest["folder"] = str(file.parent)
    return manifest


def select_engine(manifest: dict, k: int) -> dict:
    """The manifest entry for expert budget k, with 'path' resolved against the manifest's folder."""
    for entry in manifest["engines"]:
        if entry["k"] == k:
            path = Path(manifest["folder"]) / entry["file"]
            if not path.is_file():
                raise InfMoEError(f"engine file {path} for K={k} is missing")
            return dict(entry, path=str(path))
    available = ", ".join(str(e["k"]) for e in manifest["engines"])
    raise InfMoEError(f"no TensorRT engine for K={k} in {manifest['folder']} (available: K={available})")


# ---------------------------------------------------------------------------------------------
# Building (needs TensorRT and a GPU)


def _parse_network(path: Path, jit: bool):
    """Builder, network and parser for path; the network flag picks the plugin's AOT or JIT
    implementation (Polygraphy's NetworkFromOnnxPath cannot set it, so the network is ours)."""
    import tensorrt as trt
    from polygraphy.backend.trt import util as trt_util

    flag = (trt.NetworkDefinitionCreationFlag.PREFER_JIT_PYTHON_PLUGINS if jit
            else trt.NetworkDefinitionCreationFlag.PREFER_AOT_PYTHON_PLUGINS)
    builder = trt.Builder(trt_util.get_trt_logger())
    network = builder.create_network(1 << int(flag))
    parser = trt.OnnxParser(network, trt_util.get_trt_logger())
    if not parser.parse_from_file(str(path)):
        errors = [str(parser.get_error(i)) for i in range(parser.num_errors)]
        raise InfMoEError(f"TensorRT could not parse {path}: {errors[0] if errors else 'unknown error'}")
    return builder, network, parser


def build_engine(onnx_path: Path, engine_path: Path, profiles: List[dict], fp16: bool, timing_cache: Path,
                 jit: bool) -> Path:
    from polygraphy.backend.trt import CreateConfig, EngineBytesFromNetwork, Profile

    trt_profiles = []
    for profile in profiles:
        p = Profile()
        for name, r in profile["shapes"].items():
            p.add(name, r["min"], r["opt"], r["max"])
        trt_profiles.append(p)
    config = CreateConfig(fp16=fp16, profiles=trt_profiles,
                          load_timing_cache=str(timing_cache) if timing_cache.is_file() else None)
    try:
        serialized = EngineBytesFromNetwork(_parse_network(onnx_path, jit), config=config,
                                            save_timing_cache=str(timing_cache))()
    except InfMoEError:
        raise
    except Exception as error:  # TensorRT and Polygraphy raise plain exceptions
        first = next((line for line in str(error).splitlines() if line.strip()), type(error).__name__)
        raise InfMoEError(f"TensorRT could not build an engine from {onnx_path}: {first}") from error
    return atomic_write(engine_path, bytes(serialized))


def build_engines(models: Dict[int, ExportedModel], out: Path, fp16: bool, timing_cache: Path, max_batch: int,
                  max_seq: Optional[int], jit: bool) -> Path:
    """One engine per K into out, then the manifest; returns the manifest's path."""
    version = require_tensorrt()
    register_plugin()
    gpu = gpu_name()
    entries = []
    for k, model in models.items():
        onnx_path, io = model.path, model.io
        check_plugin_model(onnx_path)
        profiles = profile_shapes(io, max_batch, io.config.n_positions if max_seq is None else max_seq)
        engine_file = f"model_k{k}.engine"
        build_engine(onnx_path, out / engine_file, profiles, fp16, timing_cache, jit)
        entries.append(engine_entry(engine_file, model, "fp16" if fp16 else io.dtype,
                                    "jit" if jit else "aot", profiles, version, gpu))
        click.echo(f"trt: K={k}: {out / engine_file}", err=True)
    return write_manifest(out, entries)


# ---------------------------------------------------------------------------------------------
# Running


class TrtRunner(PolygraphyTrtRunner):
    """Polygraphy's TrtRunner on one engine, with the exported model's DecoderIO.

    Feeds and outputs use the ONNX model's names, like every other runner; the optimization
    profile (prefill or decode) is picked from each feed's shapes.
    """

    def __init__(self, io: DecoderIO, entry: dict, *, name: Optional[str] = None):
        """entry: the engine's manifest entry (select_engine), which records its profiles."""
        require_tensorrt()
        if DecoderIO.from_metadata(entry["metadata"]) != io:
            raise InfMoEError(f"engine {entry['path']} was built for other inputs and outputs than the ones given")
        self.io, self.manifest_entry = io, entry
        register_plugin()  # a JIT engine calls back into the Python plugin; an AOT one needs nothing
        super().__init__(EngineFromBytes(BytesFromPath(entry["path"])), name=name or f"tensorrt-k{io.k}")

    @classmethod
    def from_engines(cls, engines, k: int, *, name: Optional[str] = None) -> "TrtRunner":
        """The runner of the engine for expert budget k in an engine folder (or its manifest)."""
        entry = select_engine(read_manifest(engines), k)
        return cls(DecoderIO.from_metadata(entry["metadata"]), entry, name=name)

    def infer_impl(self, feed_dict, *args, **kwargs):
        index = pick_profile(self.manifest_entry["profiles"], {n: a.shape for n, a in feed_dict.items()})
        if index != self.context.active_optimization_profile:
            self.set_profile(index)
        return super().infer_impl(feed_dict, *args, **kwargs)
