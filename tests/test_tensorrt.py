"""TensorRT engines and plugin: everything that runs without TensorRT, and the rest when it is there.

Without TensorRT (this project's machines): the plugin's functions checked against the rules
TensorRT's plugin validator applies when the plugin module is imported (with stand-ins for the
tensorrt modules), the AOT implementation run end to end into PTX that ptxas assembles, the
string attribute as the ONNX parser delivers it, the supported versions, the network flags and
builder configuration, the model the parser gets (K pinned), profiles, the manifest, the runner's
plugin registration and empty inputs, and the CLI's one-line errors. Building and running an
engine needs TensorRT and a GPU and is skipped otherwise (plugins/tensorrt/gpu_check.sh runs it).
"""

import ast
import inspect
import json
import os
import subprocess
import sys
import tomllib
import typing
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch

from infmoe_export.contract import DecoderIO, ExportedModel
from infmoe_export.errors import InfMoEError
from infmoe_export.export import export_onnx
from infmoe_export.model import InfMoEConfig, InfMoEGPT
from infmoe_export.runtimes.tensorrt import availability, build, manifest, network, runner
from infmoe_export.runtimes.tensorrt.plugin import compile as trt_compile
from infmoe_export.runtimes.tensorrt.plugin import cuda_driver, descriptors

ROOT = Path(__file__).resolve().parents[1]
TINY = InfMoEConfig(vocab_size=256, n_positions=32, d_model=16, n_layer=2, n_head=2, ffn_hidden=37,
                    slice_width=5, num_samples=2)

needs_tensorrt = pytest.mark.skipif(
    not availability.tensorrt_available() or cuda_driver.compute_capability() is None,
    reason="needs TensorRT >=10.9,<12 and an NVIDIA GPU (absent on this machine; plugins/tensorrt/gpu_check.sh)")


@pytest.fixture(scope="module")
def tiny_model():
    torch.manual_seed(0)
    return InfMoEGPT(TINY).eval()


@pytest.fixture(scope="module")
def plugin_export(tiny_model, tmp_path_factory) -> ExportedModel:
    """The tiny model exported for K = 2 the way `infmoe-export trt` exports: no local function."""
    return export_onnx(tiny_model, tmp_path_factory.mktemp("onnx") / "model_k2.onnx", k=2, function=False)


# ---------------------------------------------------------------------------------------------
# Stand-ins for tensorrt and tensorrt.plugin: just the names plugin.py uses, decorators that
# record what they decorate. The subprocess test below embeds this function's source.


def tensorrt_stub():
    import types

    trt = types.ModuleType("tensorrt")
    trtp = types.ModuleType("tensorrt.plugin")
    trt.plugin = trtp
    for name in ("float32", "float16", "int64", "int32", "int8"):
        setattr(trt, name, f"DataType.{name}")

    class TensorDesc:
        def __init__(self, dims=(), dtype=None):
            self.shape_expr, self.dtype = ShapeExprs(dims), dtype

        def like(self):
            return TensorDesc(self.shape_expr, self.dtype)

    class ShapeExpr:
        """A dim: an int known at build time (is_constant) or only at run time (value kept for numel)."""
        def __init__(self, value, constant):
            self.value, self.is_constant, self.is_fake = value, constant, False

        def constant_value(self):
            assert self.is_constant
            return self.value

    class ShapeExprs(list):
        def __init__(self, dims):
            super().__init__(d if isinstance(d, ShapeExpr) else ShapeExpr(abs(d), d >= 0) for d in dims)

        def numel(self):
            total = 1
            for dim in self:
                total *= dim.value
            return total

    class Tensor:
        pass

    class KernelLaunchParams:
        pass

    class SymExprs:
        def __init__(self, length):
            self.length = length

    class SymIntExprs(SymExprs):
        pass

    class AutoTuneCombination:
        def __init__(self, spec=""):
            self.spec = spec

    registered = {}  # plugin id -> {kind: function}

    def decorator(kind):
        def with_id(plugin_id):
            def record(function):
                registered.setdefault(plugin_id, {})[kind] = function
                return function
            return record
        return with_id

    for value in (TensorDesc, Tensor, KernelLaunchParams, SymExprs, SymIntExprs, AutoTuneCombination):
        setattr(trtp, value.__name__, value)
    for kind in ("register", "autotune", "impl", "aot_impl"):
        setattr(trtp, kind, decorator(kind))
    trtp.registered = registered
    return trt, trtp


@pytest.fixture
def stub_plugin(monkeypatch):
    """plugin.register imported against the stand-ins: (tensorrt.plugin stand-in, registered
    functions by plugin id and kind)."""
    trt, trtp = tensorrt_stub()
    monkeypatch.setitem(sys.modules, "tensorrt", trt)
    monkeypatch.setitem(sys.modules, "tensorrt.plugin", trtp)
    monkeypatch.delitem(sys.modules, "infmoe_export.runtimes.tensorrt.plugin.register", raising=False)
    import importlib

    importlib.import_module("infmoe_export.runtimes.tensorrt.plugin.register")
    monkeypatch.delitem(sys.modules, "infmoe_export.runtimes.tensorrt.plugin.register")
    return trtp, trtp.registered


# ---------------------------------------------------------------------------------------------
# The plugin's functions against TensorRT's rules for Python plugins. The rules, from
# tensorrt.plugin's documentation and its validator (which runs when the plugin module is
# imported, so a broken rule stops every build):
#   register  every argument annotated, none with a default; TensorDescs first, then attributes
#             of serializable types (int, float, bytes, bool, str, numpy arrays), none named
#             outputs/stream/tactic; returns TensorDesc or Tuple[TensorDesc, ...].
#   autotune  the tensors, then registered attributes in registration order, then `outputs`;
#             returns AutoTuneCombination or List[AutoTuneCombination].
#   impl      the tensors, attributes, then `outputs: Tuple[Tensor]`, `stream: int` (and
#             optionally `tactic: int`); returns None.
#   aot_impl  the tensors, attributes, then `outputs: Tuple[TensorDesc]`, `tactic: int`; MUST
#             have a return annotation: a 4-tuple (kernel name: str|bytes, PTX: str|bytes,
#             KernelLaunchParams, a SymExprs). TensorRT calls it with every attribute, in order.
# Annotations must be objects, not strings: the validator compares and subclass-checks them.

SERIALIZABLE = (int, float, bytes, bool, str)


def _str_or_bytes(annotation) -> bool:
    options = typing.get_args(annotation) if typing.get_origin(annotation) is typing.Union else (annotation,)
    return bool(options) and all(option in (str, bytes) for option in options)


def _tuple_of(annotation, cls) -> bool:
    args = [a for a in typing.get_args(annotation) if a is not Ellipsis]
    return typing.get_origin(annotation) is tuple and bool(args) and all(issubclass(a, cls) for a in args)


def _split(function, tensors, attributes, tail):
    """Check function's parameters are tensors + a subsequence of attributes + tail; returns the
    attributes it takes."""
    names = list(inspect.signature(function).parameters)
    assert names[:len(tensors)] == tensors, f"{function.__name__}: tensors first, in order"
    taken = names[len(tensors):len(names) - len(tail)]
    assert names[len(names) - len(tail):] == tail, f"{function.__name__}: must end with {tail}"
    assert taken == [a for a in attributes if a in taken], f"{function.__name__}: attributes in registration order"
    return taken


PLUGINS = {"infmoe::ContinuousSliceFFN": (descriptors.FLOAT_OP, {"slice_width": int, "activation": str}),
           "infmoe::QContinuousSliceFFN": (descriptors.Q_OP, {"slice_width": int, "activation": str, "bits": int,
                                                               "block_size": int})}


def test_both_plugins_are_registered_with_every_function(stub_plugin):
    _, registered = stub_plugin
    assert set(registered) == set(PLUGINS)
    for plugin_id, functions in registered.items():
        assert set(functions) == {"register", "autotune", "impl", "aot_impl"}, plugin_id
        namespace, name = plugin_id.split("::")
        assert namespace not in ("", "trt", "tensorrt", "std") and "." not in namespace + name


@pytest.mark.parametrize("plugin_id", list(PLUGINS))
def test_plugin_functions_follow_tensorrts_signature_rules(stub_plugin, plugin_id):
    trtp, registered = stub_plugin
    op, wanted_attributes = PLUGINS[plugin_id]
    functions = registered[plugin_id]

    register = inspect.signature(functions["register"])
    tensors, attributes = [], {}
    for param_name, param in register.parameters.items():
        assert param.annotation is not inspect.Parameter.empty, f"register: {param_name} needs an annotation"
        assert not isinstance(param.annotation, str), "annotations must be objects (no __future__ annotations)"
        assert param.default is inspect.Parameter.empty, f"register: {param_name} may not have a default"
        assert param.kind in (param.POSITIONAL_OR_KEYWORD, param.KEYWORD_ONLY)
        if inspect.isclass(param.annotation) and issubclass(param.annotation, trtp.TensorDesc):
            assert not attributes, "register: TensorDescs come before attributes"
            tensors.append(param_name)
        else:
            assert param.annotation in SERIALIZABLE and param_name not in ("outputs", "stream", "tactic")
            attributes[param_name] = param.annotation
    assert tensors == list(op.inputs) and attributes == wanted_attributes
    returned = register.return_annotation
    assert (inspect.isclass(returned) and issubclass(returned, trtp.TensorDesc)) or _tuple_of(returned, trtp.TensorDesc)

    def check_attribute_annotations(function, taken):
        for attribute in taken:
            annotation = inspect.signature(function).parameters[attribute].annotation
            assert annotation in (inspect.Parameter.empty, attributes[attribute]), f"{attribute}: registered type"

    autotune = functions["autotune"]
    check_attribute_annotations(autotune, _split(autotune, tensors, list(attributes), ["outputs"]))
    returned = inspect.signature(autotune).return_annotation
    assert typing.get_origin(returned) is list and all(issubclass(a, trtp.AutoTuneCombination)
                                                       for a in typing.get_args(returned))

    impl = functions["impl"]
    check_attribute_annotations(impl, _split(impl, tensors, list(attributes), ["outputs", "stream"]))
    params = inspect.signature(impl).parameters
    assert _tuple_of(params["outputs"].annotation, trtp.Tensor) and params["stream"].annotation is int
    assert all(params[t].annotation in (inspect.Parameter.empty, trtp.Tensor) for t in tensors)
    assert inspect.signature(impl).return_annotation in (None, inspect.Parameter.empty)

    aot = functions["aot_impl"]
    taken = _split(aot, tensors, list(attributes), ["outputs", "tactic"])
    assert taken == list(attributes), "aot_impl: TensorRT passes every attribute"
    check_attribute_annotations(aot, taken)
    params = inspect.signature(aot).parameters
    assert _tuple_of(params["outputs"].annotation, trtp.TensorDesc) and params["tactic"].annotation is int
    returned = inspect.signature(aot).return_annotation
    assert returned is not inspect.Parameter.empty, "aot_impl needs a return annotation"
    parts = typing.get_args(returned)
    assert typing.get_origin(returned) is tuple and len(parts) == 4
    assert _str_or_bytes(parts[0]) and _str_or_bytes(parts[1])
    assert issubclass(parts[2], trtp.KernelLaunchParams) and issubclass(parts[3], trtp.SymExprs)


def test_register_accepts_the_parsers_nul_terminated_activation(stub_plugin):
    trtp, registered = stub_plugin
    register = registered["infmoe::ContinuousSliceFFN"]["register"]
    f32 = "DataType.float32"
    inputs = [trtp.TensorDesc((-1, -1, 16), f32), trtp.TensorDesc((-1, -1, 2), "DataType.int64"),
              trtp.TensorDesc((37, 16), f32), trtp.TensorDesc((37,), f32), trtp.TensorDesc((37, 16), f32),
              trtp.TensorDesc((16,), f32)]
    # onnx-tensorrt copies a string attribute with its terminating NUL counted in the length,
    # and tensorrt.plugin decodes every byte of the field.
    y = register(*inputs, slice_width=5, activation="gelu_tanh\x00")
    assert y.dtype == f32 and [d.value for d in y.shape_expr] == [1, 1, 16]
    with pytest.raises(InfMoEError, match="unknown activation 'relu'"):
        register(*inputs, slice_width=5, activation="relu\x00")


# The AOT implementation run as TensorRT runs it at build time, in a fresh interpreter without
# TRITON_INTERPRET (the compiler needs real @triton.jit kernels), the GPU (sm_90) and driver
# (CUDA 12.4) given, so no CUDA driver or Triton driver helper is touched; every PTX goes
# through ptxas for its target. CALLS: (key, plugin, [(shape, DataType name)], attributes).
AOT_SCRIPT = """
import json, re, subprocess, sys, tempfile
STUB
trt, trtp = tensorrt_stub()
sys.modules["tensorrt"], sys.modules["tensorrt.plugin"] = trt, trtp
import infmoe_export.runtimes.tensorrt.plugin.cuda_driver as driver
driver.compute_capability = lambda: 90
driver.driver_cuda_version = lambda: (12, 4)
from triton.backends.nvidia.compiler import get_ptxas
import infmoe_export.runtimes.tensorrt.plugin.register
report = {}
for key, plugin, descs, attributes in CALLS:
    aot = trtp.registered[plugin]["aot_impl"]
    inputs = [trtp.TensorDesc(shape, "DataType." + t) for shape, t in descs]
    name, ptx, launch, extra = aot(*inputs, *attributes, (inputs[0].like(),), 0)
    entry = re.search(r"\\.entry\\s+(\\w+)\\(([^)]*)\\)", ptx)
    arch = re.search(r"\\.target\\s+(sm_\\w+)", ptx).group(1)
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ptx)
    ptxas = subprocess.run([get_ptxas(90).path, "-arch=" + arch, f.name, "-o", "/dev/null"],
                           capture_output=True, text=True)
    report[key] = dict(name=name, entry=entry.group(1), params=entry.group(2).count(".param"),
                       version=re.search(r"\\.version\\s+(\\S+)", ptx).group(1), arch=arch,
                       grid=[launch.grid_x, launch.grid_y], block_x=launch.block_x, extra=extra.length,
                       extra_type=type(extra).__name__, ptxas=ptxas.returncode, err=ptxas.stderr[-300:])
print(json.dumps(report))
"""


def run_aot(calls, timeout=300) -> dict:
    """The AOT_SCRIPT report for calls, from its own interpreter."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = AOT_SCRIPT.replace("STUB", inspect.getsource(tensorrt_stub)).replace("CALLS", repr(calls))
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=timeout)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_aot_impl_returns_ptx_with_tensorrts_arguments_for_the_drivers_ptx_version():
    calls = [(t, "infmoe::ContinuousSliceFFN",
              [((-2, -3, 19), t), ((-2, -3, 3), "int64"), ((37, 19), t), ((37,), t), ((37, 19), t), ((19,), t)],
              (5, "gelu_tanh\x00")) for t in ("float32", "float16")]
    report = run_aot(calls)
    for dtype, r in report.items():
        assert r["entry"] == r["name"] == "continuous_slice_ffn_kernel"
        assert r["params"] == 7, f"{dtype}: 6 input pointers + Y, no hidden scratch pointers"
        assert r["version"] == "8.4", f"{dtype}: PTX ISA of a CUDA 12.4 driver, not Triton's own"
        assert r["arch"] in ("sm_90", "sm_90a")  # the device's capability, not a guessed one
        assert r["grid"] == [2 * 3, 1] and r["block_x"] == 128  # a program row per token; D = 19: one block
        assert (r["extra"], r["extra_type"]) == (0, "SymIntExprs")
        assert r["ptxas"] == 0, f"{dtype}: ptxas rejected the PTX: {r['err']}"


def test_compile_ptx_moved_out_of_the_kernel_module():
    source = ast.parse((ROOT / "infmoe_export/runtimes/tensorrt/plugin/triton_kernel.py").read_text())
    defined = {node.name for node in ast.walk(source) if isinstance(node, ast.FunctionDef)}
    assert not defined & {"compile_ptx", "strip_scratch_params"}
    assert callable(trt_compile.compile_ptx) and callable(trt_compile.strip_scratch_params)


# ---------------------------------------------------------------------------------------------
# Compilation target and PTX version (from the CUDA driver, never from Triton's driver helper)


@pytest.mark.parametrize("cuda, isa", [((11, 8), 78), ((12, 0), 80), ((12, 4), 84), ((12, 6), 85), ((12, 7), 86),
                                       ((12, 8), 87), ((12, 9), 88), ((13, 0), 90), ((13, 4), 94)])
def test_ptx_isa_of_each_cuda_release(cuda, isa):
    assert trt_compile.ptx_isa_for_cuda(cuda) == isa


def test_ptx_version_is_the_drivers_capped_at_tritons_ptxas():
    from triton.backends.nvidia.compiler import get_ptxas

    assert trt_compile.ptx_version(90, driver=(12, 4)) == 84
    for capability in (80, 90, 100):  # each capped at the ptxas Triton assembles that target with
        bundled = get_ptxas(capability).version
        newest = trt_compile.ptx_isa_for_cuda(tuple(int(part) for part in bundled.split(".")[:2]))
        assert trt_compile.ptx_version(capability, driver=(19, 0)) == newest
    with pytest.raises(InfMoEError, match="update the NVIDIA driver"):
        trt_compile.ptx_isa_for_cuda((10, 2))


def test_target_comes_from_the_device_capability(monkeypatch):
    assert (trt_compile.gpu_target(89).arch, trt_compile.gpu_target(89).warp_size) == (89, 32)
    monkeypatch.setattr(cuda_driver, "compute_capability", lambda: None)
    with pytest.raises(InfMoEError, match="no NVIDIA GPU is visible"):
        trt_compile.compile_ptx("fp32", H=37, D=19, R=5, K=3)


def test_strip_scratch_params_checks_what_it_removes():
    strip = trt_compile.strip_scratch_params
    ptx = ("//\n.visible .entry k(\n\t.param .u64 .ptr .global .align 1 k_param_0,\n"
           "\t.param .u32 k_param_1,\n\t.param .u64 .ptr .global .align 1 k_param_2,\n"
           "\t.param .u64 .ptr .global .align 1 k_param_3\n)\n{\n\tld.param.b64 %rd1, [k_param_0];\n}\n")
    stripped = strip(ptx, "k", n_params=2)
    assert "k_param_1\n)" in stripped and "k_param_2" not in stripped and "k_param_3" not in stripped
    with pytest.raises(InfMoEError, match="reads hidden parameter 2"):
        strip(ptx.replace("[k_param_0]", "[k_param_2]"), "k", n_params=2)
    with pytest.raises(InfMoEError, match="needs Triton scratch memory"):
        strip(ptx, "k", n_params=2, scratch=(64, 0))
    with pytest.raises(InfMoEError, match="unexpected PTX entry"):
        strip(ptx, "k", n_params=1)


# ---------------------------------------------------------------------------------------------
# Shape, type and attribute rules (plain functions)

RANKS = [3, 3, 2, 1, 2, 1]
DTYPES = ["float32", "int64", "float32", "float32", "float32", "float32"]


def test_descriptors_accept_the_op_signature():
    assert descriptors.check_attributes(5, "gelu_tanh") == "gelu_tanh"
    assert descriptors.check_attributes(5, "gelu_tanh\x00") == "gelu_tanh"  # as the ONNX parser passes it
    descriptors.check_ranks(RANKS)
    descriptors.check_ranks([1, 1, 2, 1, 2, 1])  # a single token, X [D]
    assert descriptors.output_dtype(DTYPES) == "float32"
    assert descriptors.output_dtype([d.replace("float32", "float16") for d in DTYPES]) == "float16"


@pytest.mark.parametrize("ranks, message", [
    ([3, 2, 2, 1, 2, 1], "starts must have X's rank"),
    ([0, 0, 2, 1, 2, 1], "X must have shape"),
    ([3, 3, 3, 1, 2, 1], "w_in must have rank 2"),
    ([3, 3, 2, 2, 2, 1], "b_in must have rank 1"),
    ([3, 3, 2, 1, 1, 1], "w_out must have rank 2"),
    ([3, 3, 2, 1, 2, 2], "b_out must have rank 1"),
    ([3, 3, 2, 1, 2], "expected 6 inputs"),
])
def test_descriptors_refuse_bad_ranks(ranks, message):
    with pytest.raises(InfMoEError, match=message):
        descriptors.check_ranks(ranks)


@pytest.mark.parametrize("index, dtype, message", [
    (0, "int32", "X must be float32 or float16"),
    (1, "int32", "starts must be int64"),
    (2, "float16", "w_in must have X's dtype"),
    (5, "float16", "b_out must have X's dtype"),
])
def test_descriptors_refuse_bad_types(index, dtype, message):
    dtypes = list(DTYPES)
    dtypes[index] = dtype
    with pytest.raises(InfMoEError, match=message):
        descriptors.output_dtype(dtypes)


@pytest.mark.parametrize("width, activation, message", [
    (0, "gelu_tanh", "slice_width must be a positive integer"),
    (True, "gelu_tanh", "slice_width must be a positive integer"),
    (5, "relu", "unknown activation 'relu'"),
    (5, "gelu_tanh\x00x", "unknown activation"),  # only trailing NULs are the parser's
])
def test_descriptors_refuse_bad_attributes(width, activation, message):
    with pytest.raises(InfMoEError, match=message):
        descriptors.check_attributes(width, activation)


def test_specialisation_reads_h_d_k_from_static_dims():
    shapes = [(None, None, 19), (None, None, 3), (37, 19), (37,), (37, 19), (19,)]
    assert descriptors.specialisation(shapes, 5) == {"H": 37, "D": 19, "R": 5, "K": 3}


@pytest.mark.parametrize("shapes, width, message", [
    ([(None, 19), (None, 3), (None, 19), (37,), (37, 19), (19,)], 5, "H .* must be static"),
    ([(None, 19), (None, None), (37, 19), (37,), (37, 19), (19,)], 5, "K .* must be static.*infmoe-export trt"),
    ([(None, 19), (None, 3), (37, 19), (36,), (37, 19), (19,)], 5, "b_in must have shape"),
    ([(None, 18), (None, 3), (37, 19), (37,), (37, 19), (19,)], 5, "X's last dim must be D"),
    ([(None, 19), (None, 3), (37, 19), (37,), (37, 19), (19,)], 38, "slice_width must be in"),
])
def test_specialisation_refuses_what_it_cannot_compile(shapes, width, message):
    with pytest.raises(InfMoEError, match=message):
        descriptors.specialisation(shapes, width)


# ---------------------------------------------------------------------------------------------
# Supported TensorRT versions


@pytest.mark.parametrize("version, supported", [("10.7.0.23", False), ("10.8.0", False), ("10.9.0.34", True),
                                                ("10.13.3.9", True), ("11.1.0", True), ("12.0.0", False),
                                                ("nightly", False)])
def test_supported_tensorrt_versions(version, supported):
    problem = availability.version_problem(version)
    assert (problem is None) == supported
    if not supported:
        assert f"TensorRT {version} is installed but infmoe-export needs tensorrt>=10.9,<12" in problem


def test_the_tensorrt_extra_states_the_supported_range():
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["tensorrt"]
    assert availability.REQUIREMENT in extra
    assert "polygraphy>=0.49.9" in extra  # host buffers for empty inputs are never null from 0.49.9 on


# ---------------------------------------------------------------------------------------------
# Network flags, builder configuration, precision


class _Flags:
    PREFER_JIT_PYTHON_PLUGINS, PREFER_AOT_PYTHON_PLUGINS, STRONGLY_TYPED = 2, 3, 1  # TensorRT 10.x values


class _Flags11:
    PREFER_JIT_PYTHON_PLUGINS, PREFER_AOT_PYTHON_PLUGINS = 1, 2


@pytest.mark.parametrize("jit", [False, True], ids=["aot", "jit"])
def test_networks_are_strongly_typed_and_pick_the_plugin_implementation(jit):
    trt10 = type("trt", (), {"NetworkDefinitionCreationFlag": _Flags})
    preferred = _Flags.PREFER_JIT_PYTHON_PLUGINS if jit else _Flags.PREFER_AOT_PYTHON_PLUGINS
    assert network.creation_flags(trt10, jit) == (1 << _Flags.STRONGLY_TYPED) | (1 << preferred)
    trt11 = type("trt", (), {"NetworkDefinitionCreationFlag": _Flags11})  # strongly typed always
    preferred = _Flags11.PREFER_JIT_PYTHON_PLUGINS if jit else _Flags11.PREFER_AOT_PYTHON_PLUGINS
    assert network.creation_flags(trt11, jit) == 1 << preferred


def test_builds_are_strongly_typed_without_precision_flags(plugin_export, tmp_path):
    """Every build, whatever its precision, is strongly typed: an fp16 export runs its FFN in
    float16 and the router, LayerNorms and attention in float32 as exported. The FP16 builder
    flag (deprecated in 10.12, gone in 11) would let TensorRT run any layer in float16. TF32
    stays off."""
    profiles = network.profile_shapes(plugin_export.io, 1, 8)
    config = build.builder_config(profiles, tmp_path / "timing.cache")
    assert config.fp16 is False and config.tf32 is False and len(config.profiles) == 2
    assert config.timing_cache_path is None  # no cache yet


# ---------------------------------------------------------------------------------------------
# The ONNX model the parser gets


def test_exported_model_maps_every_layer_to_the_plugin(plugin_export):
    model = onnx.load(str(plugin_export.path))
    assert not model.functions  # a local function would be expanded instead of using the plugin
    nodes = network.plugin_nodes(model, plugin_export.path)
    assert [n.op_type for n in nodes] == ["ContinuousSliceFFN"] * TINY.n_layer
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in nodes[0].attribute}
    assert attrs == {"slice_width": 5, "activation": b"gelu_tanh", "plugin_namespace": b"infmoe",
                     "plugin_version": b"1"}
    assert len(nodes[0].input) == 6


def test_k_is_pinned_to_a_build_time_constant(plugin_export, tmp_path):
    model = network.plugin_model(plugin_export)
    onnx.checker.check_model(model)
    nodes = network.plugin_nodes(model, plugin_export.path)
    producers = {out: node for node in model.graph.node for out in node.output}
    pinned = [producers[node.input[1]] for node in nodes]
    assert [p.op_type for p in pinned] == ["Reshape"] * TINY.n_layer
    shape = next(i for i in model.graph.initializer if i.name == network.PINNED_K)
    assert onnx.numpy_helper.to_array(shape).tolist() == [0, 0, 2]  # batch, sequence kept; K = 2
    inferred = onnx.shape_inference.infer_shapes(model)
    dims = {v.name: v.type.tensor_type.shape.dim for v in inferred.graph.value_info}
    assert all(dims[node.input[1]][-1].dim_value == 2 for node in nodes)

    # The same numbers with and without the Reshape, where the onnxruntime kernel is installed.
    from infmoe_export.runtimes import ort_kernel
    from infmoe_export.runtimes.ort import create_session

    if ort_kernel.custom_op_library() is None:
        pytest.skip("the onnxruntime kernel is not installed: the pinned model was checked, not run")
    onnx.save(model, tmp_path / "pinned.onnx")
    feed = plugin_export.io.dummy_inputs()
    original = create_session(plugin_export).run(["logits"], dict(feed))[0]
    pinned_logits = create_session(ExportedModel.read(tmp_path / "pinned.onnx")).run(["logits"], dict(feed))[0]
    np.testing.assert_array_equal(pinned_logits, original)


def test_model_with_the_fallback_function_is_refused(plugin_export, tmp_path):
    model = onnx.load(str(plugin_export.path))
    model.functions.append(onnx.helper.make_function("infmoe", "ContinuousSliceFFN", ["X"], ["Y"],
                                                     [onnx.helper.make_node("Identity", ["X"], ["Y"])],
                                                     [onnx.helper.make_opsetid("", 18)]))
    onnx.save(model, tmp_path / "with_function.onnx")
    with pytest.raises(InfMoEError, match="--no-function"):
        network.plugin_model(ExportedModel.read(tmp_path / "with_function.onnx"))


def test_node_without_plugin_attributes_is_refused(plugin_export, tmp_path):
    model = onnx.load(str(plugin_export.path))
    node = next(n for n in model.graph.node if n.domain == "infmoe")
    kept = [a for a in node.attribute if a.name != "plugin_namespace"]
    del node.attribute[:]
    node.attribute.extend(kept)
    onnx.save(model, tmp_path / "no_namespace.onnx")
    with pytest.raises(InfMoEError, match="plugin_namespace='infmoe'"):
        network.plugin_model(ExportedModel.read(tmp_path / "no_namespace.onnx"))


def test_onnxruntime_target_is_refused(plugin_export):
    import dataclasses

    ort_target = ExportedModel(plugin_export.path, dataclasses.replace(plugin_export.io, target="onnxruntime"),
                               plugin_export.metadata)
    with pytest.raises(InfMoEError, match="exported for onnxruntime .*--target tensorrt --no-function"):
        network.plugin_model(ort_target)


def test_plan_models_takes_each_models_fixed_k_and_precision(plugin_export):
    path = plugin_export.path
    assert {key: m.path for key, m in build.plan_models([path], None).items()} == {(2, "fp32"): path}
    assert list(build.plan_models([path], [2], ["fp32"])) == [(2, "fp32")]
    with pytest.raises(InfMoEError, match="no fp32 model for K=4: the given models are K=2 fp32"):
        build.plan_models([path], [2, 4])
    with pytest.raises(InfMoEError, match="no int8 model for K=2"):
        build.plan_models([path], None, ["fp32", "int8"])
    with pytest.raises(InfMoEError, match="two fp32 models for K=2"):
        build.plan_models([path, path], None)


# ---------------------------------------------------------------------------------------------
# Optimization profiles


def test_profiles_cover_prefill_and_decode(plugin_export):
    io = plugin_export.io
    prefill, decode = network.profile_shapes(io, max_batch=3, max_seq=16)
    assert (prefill["name"], decode["name"]) == ("prefill", "decode")
    assert prefill["shapes"]["input_ids"] == {"min": [1, 1], "opt": [1, 8], "max": [3, 16]}
    assert prefill["shapes"]["past_key_values.0.key"] == {"min": [1, 2, 0, 8], "opt": [1, 2, 0, 8],
                                                         "max": [3, 2, 0, 8]}
    assert decode["shapes"]["input_ids"] == {"min": [1, 1], "opt": [1, 1], "max": [3, 1]}
    assert decode["shapes"]["past_key_values.1.value"]["max"] == [3, 2, 15, 8]
    assert decode["shapes"]["attention_mask"] == {"min": [1, 1], "opt": [1, 8], "max": [3, 16]}
    assert set(prefill["shapes"]) == set(io.input_names)

    profiles = [prefill, decode]
    feed = io.dummy_inputs(batch=2, sequence=5, past_sequence=0)
    assert network.pick_profile(profiles, {n: a.shape for n, a in feed.items()}) == 0
    feed = io.dummy_inputs(batch=1, sequence=1, past_sequence=9, left_pad=0)
    assert network.pick_profile(profiles, {n: a.shape for n, a in feed.items()}) == 1
    feed = io.dummy_inputs(batch=1, sequence=2, past_sequence=3, left_pad=0)  # chunked prefill: not built
    with pytest.raises(InfMoEError, match="fit no optimization profile"):
        network.pick_profile(profiles, {n: a.shape for n, a in feed.items()})
    with pytest.raises(InfMoEError, match="the engine's inputs are"):
        network.pick_profile(profiles, {"input_ids": (1, 1)})


def test_profiles_refuse_impossible_limits(plugin_export):
    with pytest.raises(InfMoEError, match="--max-seq must be in \\[1, 32\\]"):
        network.profile_shapes(plugin_export.io, max_batch=1, max_seq=33)
    with pytest.raises(InfMoEError, match="--max-batch must be at least 1"):
        network.profile_shapes(plugin_export.io, max_batch=0, max_seq=8)


# ---------------------------------------------------------------------------------------------
# Manifest and engine selection


def write_fake_build(folder: Path, model: ExportedModel, ks, plugin="aot", precisions=("fp32",)):
    """A manifest as build_engines writes it, with placeholder engine files (no TensorRT here)."""
    profiles = network.profile_shapes(model.io, 1, 8)
    entries = []
    for k in ks:
        for precision in precisions:
            file = manifest.engine_file(k, precision)
            (folder / file).write_bytes(b"placeholder engine for K=%d" % k)
            entry = manifest.engine_entry(file, model, plugin, profiles, "10.13.0", "NVIDIA H200")
            entries.append(dict(entry, k=k, precision=precision))
    return manifest.write_manifest(folder, entries)


def test_manifest_round_trip_and_selection_by_k(plugin_export, tmp_path):
    path = write_fake_build(tmp_path, plugin_export, [4, 1, 2])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["manifest.json", "model_k1_fp32.engine",
                                                          "model_k2_fp32.engine", "model_k4_fp32.engine"]  # no temp
    written = json.loads(path.read_text())
    assert written["schema_version"] == 1
    assert [e["k"] for e in written["engines"]] == [1, 2, 4]
    entry = written["engines"][1]
    assert len(entry["onnx"]["sha256"]) == 64
    assert (entry["precision"], entry["tf32"], entry["plugin"]) == ("fp32", False, "aot")
    assert (entry["tensorrt_version"], entry["gpu"]) == ("10.13.0", "NVIDIA H200")
    assert [p["name"] for p in entry["profiles"]] == ["prefill", "decode"]
    assert entry["io"]["inputs"] == plugin_export.io.input_names
    assert DecoderIO.from_metadata(entry["metadata"]) == plugin_export.io

    read = manifest.read_manifest(tmp_path)
    chosen = manifest.select_engine(read, 2)
    assert chosen["k"] == 2 and Path(chosen["path"]) == tmp_path / "model_k2_fp32.engine"
    assert manifest.select_engine(manifest.read_manifest(path), 4)["file"] == "model_k4_fp32.engine"
    with pytest.raises(InfMoEError, match=r"no TensorRT engine for K=8 .*available: K=1 fp32, K=2 fp32, K=4 fp32"):
        manifest.select_engine(read, 8)
    (tmp_path / "model_k1_fp32.engine").unlink()
    with pytest.raises(InfMoEError, match="engine file .*model_k1_fp32.engine for K=1 fp32 is missing"):
        manifest.select_engine(read, 1)


@pytest.mark.parametrize("content, message", [
    ("{not json", "is not valid JSON"),
    ('{"schema_version": 2, "engines": []}', "schema_version must be 1"),
    ('{"schema_version": 1, "engines": []}', "'engines' must be a non-empty list"),
    ('{"schema_version": 1, "engines": [{"k": "2"}]}', "engine 0 needs 'k' of type int"),
])
def test_bad_manifests_are_refused(tmp_path, content, message):
    (tmp_path / "manifest.json").write_text(content)
    with pytest.raises(InfMoEError, match=message):
        manifest.read_manifest(tmp_path)


def test_unknown_plugin_mode_is_refused(plugin_export, tmp_path):
    write_fake_build(tmp_path, plugin_export, [2], plugin="python")
    with pytest.raises(InfMoEError, match="plugin 'python', expected one of"):
        manifest.read_manifest(tmp_path)


def test_missing_manifest_says_how_to_build_one(tmp_path):
    with pytest.raises(InfMoEError, match="infmoe-export trt --out DIR"):
        manifest.read_manifest(tmp_path)


# ---------------------------------------------------------------------------------------------
# The runner without an engine: plugin registration and empty inputs


@pytest.mark.parametrize("plugin, registers", [("aot", False), ("jit", True)])
def test_runner_registers_the_python_plugin_only_for_jit_engines(plugin_export, tmp_path, monkeypatch,
                                                                 plugin, registers):
    calls = []
    monkeypatch.setattr(runner, "require_tensorrt", lambda: "10.13.0")
    monkeypatch.setattr(runner, "register_plugin", lambda: calls.append("register"))
    monkeypatch.setattr(runner, "require_cuda_torch", lambda: calls.append("cuda torch"))
    write_fake_build(tmp_path, plugin_export, [2], plugin=plugin)
    trt_runner = runner.TrtRunner.from_engines(tmp_path, 2, name="trt")  # the engine is loaded on activation
    assert trt_runner.io == plugin_export.io and trt_runner.name == "trt"
    assert calls == (["cuda torch", "register"] if registers else [])


def test_empty_device_inputs_are_fed_from_the_host():
    empty_device = torch.empty(1, 2, 0, 8, dtype=torch.float16)  # stands in for a CUDA tensor (address 0)
    host = np.zeros((1, 2, 0, 8), np.float32)
    full = torch.ones(1, 1)
    fed = runner.host_feed({"past": empty_device, "host": host, "ids": full})
    assert isinstance(fed["past"], np.ndarray) and fed["past"].shape == (1, 2, 0, 8)
    assert fed["past"].dtype == np.float16
    assert fed["host"] is host and fed["ids"] is full


# ---------------------------------------------------------------------------------------------
# The commands


@pytest.mark.skipif(availability.tensorrt_available(), reason="TensorRT is installed here")
def test_trt_without_tensorrt_is_one_line_with_the_fix(tmp_path, run_cli):
    code, _, err = run_cli("trt", "--out", tmp_path / "engines", "--k", "1,2")
    assert code == 1
    assert err.count("\n") == 1 and err.startswith("error: TensorRT is not installed")
    assert "pip install 'infmoe-export[tensorrt]'" in err and "NVIDIA GPU" in err
    assert not (tmp_path / "engines").exists()  # nothing written before the check


@pytest.mark.skipif(availability.tensorrt_available(), reason="TensorRT is installed here")
def test_run_with_engines_without_tensorrt_is_one_line(plugin_export, tmp_path, run_cli):
    write_fake_build(tmp_path, plugin_export, [2])
    code, out, err = run_cli("run", "--engines", tmp_path, "--prompt", "hi")
    assert code == 1 and out == ""
    assert err.count("\n") == 1 and err.startswith("error: TensorRT is not installed")


@pytest.mark.parametrize("args, message", [
    (["--k", "0"], "--k must be"),
    (["--model", "{onnx}", "--k", "4"], "no fp32 model for K=4"),
    (["--model", "{onnx}", "--dtype", "int4"], "no int4 model for K=2: the given models are K=2 fp32"),
    (["--dtype", "int3"], "--dtype must be a comma-separated list of fp32, fp16, int8, int4"),
    (["--dtype", "int8", "--block-size", "24"], "--block-size: block size must be a power of two >= 16"),
    (["--block-size", "64"], "--block-size applies to int8 / int4 exports"),
    (["--model", "{onnx}", "--block-size", "64"], "--block-size chooses what to export"),
    (["--model", "{onnx}", "--checkpoint", "{folder}"], "either --model or --checkpoint"),
    (["--model", "{onnx}", "--with-starts"], "--with-starts chooses what to export"),
    (["--model", "{folder}/missing.onnx"], "does not exist"),
])
def test_trt_refuses_bad_options_in_one_line(args, message, plugin_export, tmp_path, run_cli):
    args = [a.format(onnx=plugin_export.path, folder=tmp_path) for a in args]
    code, _, err = run_cli("trt", "--out", tmp_path / "engines", *args)
    assert code == 1 and err.count("\n") == 1 and message in err


@pytest.mark.parametrize("args, message", [
    (["--engines", "{folder}", "--model", "{onnx}"], "--engines runs a TensorRT engine"),
    (["--engines", "{folder}", "--no-kernel"], "--engines runs a TensorRT engine"),
])
def test_run_refuses_engines_with_onnx_options(args, message, plugin_export, tmp_path, run_cli):
    args = [a.format(onnx=plugin_export.path, folder=tmp_path) for a in args]
    code, _, err = run_cli("run", "--prompt", "hi", *args)
    assert code == 1 and err.count("\n") == 1 and message in err


# ---------------------------------------------------------------------------------------------
# With TensorRT and a GPU


@needs_tensorrt
@pytest.mark.parametrize("jit", [False, True], ids=["aot", "jit"])
def test_engine_matches_the_reference(tiny_model, plugin_export, tmp_path, jit):
    if jit and not torch.cuda.is_available():
        pytest.skip("the JIT plugin needs a CUDA build of torch")
    path = build.build_engines({(2, "fp32"): plugin_export}, tmp_path, timing_cache=tmp_path / "t.cache",
                               max_batch=2, max_seq=16, jit=jit)
    assert manifest.read_manifest(path)["engines"][0]["plugin"] == ("jit" if jit else "aot")
    with runner.TrtRunner.from_engines(tmp_path, 2) as trt_runner:
        check_prefill_and_step(trt_runner, plugin_export.io, tiny_model)


def check_prefill_and_step(trt_runner, io, reference):
    """An engine's prefill of a batch of 2, then one decode step on its decode profile from the
    prefill's cache, against the PyTorch reference at K = 2 within 1e-3."""
    feed = io.dummy_inputs(batch=2, sequence=6, past_sequence=0)
    outputs = trt_runner.infer(feed)
    with torch.no_grad():
        ref = reference(torch.from_numpy(feed["input_ids"]), torch.from_numpy(feed["attention_mask"]), k=2)
    keep = feed["attention_mask"].astype(bool)  # padded positions are garbage by construction
    np.testing.assert_allclose(outputs["logits"][keep], ref.logits.numpy()[keep], rtol=1e-3, atol=1e-3)
    past = [outputs[name.replace("past_key_values", "present")] for name in io.past_names]
    mask = np.concatenate([feed["attention_mask"], np.ones((2, 1), dtype=np.int64)], axis=1)
    step = trt_runner.infer(io.feed(feed["input_ids"][:, -1:], mask, past))
    with torch.no_grad():
        ref_step = reference(torch.from_numpy(feed["input_ids"][:, -1:]), torch.from_numpy(mask), ref.present, k=2)
    np.testing.assert_allclose(step["logits"], ref_step.logits.numpy(), rtol=1e-3, atol=1e-3)
