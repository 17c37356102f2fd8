"""QContinuousSliceFFN (SPEC §6) on the TensorRT path: the Triton kernel in Triton's CPU
interpreter against the level-1 reference (quant.q_continuous_slice_ffn: the float op on the
dequantized weights w'), the plugin's rules, the model the parser gets, engines per (K,
precision), and the AOT PTX for sm_90 through ptxas.

conftest.py sets TRITON_INTERPRET=1 before anything imports triton. Data is fresh every run
(normal weights scaled like a trained layer, never zero); the seed is printed in every failure
and INFMOE_TEST_SEED=<n> replays a run. Shapes are small: the interpreter runs every program in
Python.
"""

import json
import os

import numpy as np
import onnx
import pytest
import torch
# The tiny config, the stand-ins for tensorrt and the fake engine folder of the float tests.
from test_tensorrt import (TINY, check_prefill_and_step, needs_tensorrt, run_aot, stub_plugin,  # noqa: F401
                           write_fake_build)

from infmoe_export.contract import ExportedModel
from infmoe_export.errors import InfMoEError
from infmoe_export.export import export_onnx
from infmoe_export.model import InfMoEGPT
from infmoe_export.quant import QuantizedWeight, dequantized_model, q_continuous_slice_ffn
from infmoe_export.runtimes.tensorrt import build, manifest, network, runner

pytest.importorskip("triton")
from infmoe_export.runtimes.tensorrt.plugin import compile as trt_compile  # noqa: E402
from infmoe_export.runtimes.tensorrt.plugin import descriptors, triton_kernel  # noqa: E402

SEED = int(os.environ.get("INFMOE_TEST_SEED") or int.from_bytes(os.urandom(4), "little"))
# |y - ref| <= tol * max|ref|: float32 as the float kernel (the same products on the same w');
# float16 Y is rounded once from a float32 sum, and the reference's w' is rounded to float16.
TOLERANCE = {torch.float32: 5e-6, torch.float16: 2e-3}


def make_starts(g, lead, H, r, K, windows):
    """starts [*lead, K]: random, or planted windows (first/last start, overlapping, disjoint)."""
    if windows == "random":
        return torch.randint(0, H - r + 1, (*lead, K), generator=g)
    if windows == "edges":  # starts 0 and H - r in every token
        return torch.tensor([0, H - r] * K)[:K].expand(*lead, K).clone()
    if windows == "overlap":  # every window shares rows with the next one
        base = torch.randint(0, H - r + 1 - (K - 1), (*lead, 1), generator=g)
        return base + torch.arange(K)
    assert windows == "disjoint" and K * r <= H
    return (torch.arange(K) * r).expand(*lead, K).clone()


def make_q_inputs(lead, H, D, r, K, bits, block_size, dtype=torch.float32, windows="random", seed=0):
    """Random inputs with quantized expert weights (weights never zero)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*lead, D, generator=g)
    w_in = torch.randn(H, D, generator=g) / D ** 0.5
    w_out = torch.randn(H, D, generator=g) / r ** 0.5
    b_in, b_out = torch.randn(H, generator=g) * 0.5, torch.randn(D, generator=g)
    q_in, q_out = (QuantizedWeight.of(w, bits, block_size, scale_dtype=dtype) for w in (w_in, w_out))
    return (x.to(dtype), make_starts(g, lead, H, r, K, windows), q_in.packed, q_in.scale, b_in.to(dtype),
            q_out.packed, q_out.scale, b_out.to(dtype))


def assert_matches_reference(y, inputs, r, bits, block_size, what):
    ref = q_continuous_slice_ffn(*inputs, r, bits, block_size).double()
    error = (y.double() - ref).abs().max().item()
    bound = TOLERANCE[inputs[0].dtype] * ref.abs().max().item()
    assert error <= bound, f"{what}: max |y - ref| {error:.3g} > {bound:.3g} (INFMOE_TEST_SEED={SEED})"


# (lead, H, D, r, K, windows): H a prime, D not a multiple of the block (and odd: int4's pad
# nibble), r = 1 and r = H, K = 1 and K > 1, starts 0 and H - r, overlapping and disjoint windows.
SHAPES = {
    "k1-r1": ((3,), 37, 45, 1, 1, "random"),
    "k3-odd-d": ((2, 2), 37, 45, 7, 3, "random"),
    "r-equals-h": ((2,), 23, 33, 23, 2, "random"),
    "edges": ((2,), 41, 35, 9, 2, "edges"),
    "overlap": ((3,), 41, 35, 6, 4, "overlap"),
    "disjoint": ((2,), 29, 18, 7, 4, "disjoint"),
    "two-blocks-partial": ((1,), 19, 70, 5, 2, "random"),
}


@pytest.mark.parametrize("deterministic", [True, False], ids=["columns", "split"])
@pytest.mark.parametrize("bits, block_size", [(8, 32), (4, 16), (4, 64)], ids=["int8-b32", "int4-b16", "int4-b64"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_kernel_matches_the_level1_reference(shape, bits, block_size, deterministic):
    lead, H, D, r, K, windows = SHAPES[shape]
    seed = SEED + hash((shape, bits, block_size)) % 1000
    inputs = make_q_inputs(lead, H, D, r, K, bits, block_size, windows=windows, seed=seed)
    y = triton_kernel.q_continuous_slice_ffn_triton(*inputs, r, bits, block_size, deterministic=deterministic)
    assert y.shape == inputs[0].shape and y.dtype == torch.float32
    assert_matches_reference(y, inputs, r, bits, block_size, f"{shape} int{bits} B={block_size}")


@pytest.mark.parametrize("bits", [8, 4])
def test_float16_activations(bits):
    inputs = make_q_inputs((2, 3), 37, 45, 7, 3, bits, 32, dtype=torch.float16, seed=SEED + bits)
    y = triton_kernel.q_continuous_slice_ffn_triton(*inputs, 7, bits, 32, deterministic=True)
    assert y.dtype == torch.float16
    assert_matches_reference(y, inputs, 7, bits, 32, f"float16 int{bits}")


def test_swapped_nibbles_are_caught():
    """A planted swap of the nibble order (odd column low) must not pass the reference check."""
    x, starts, w_in_q, w_in_scale, b_in, w_out_q, w_out_scale, b_out = make_q_inputs(
        (2,), 23, 33, 5, 2, 4, 16, seed=SEED)
    swap = lambda packed: (packed >> 4) | (packed << 4)  # noqa: E731 -- uint8 shifts drop the other nibble
    y = triton_kernel.q_continuous_slice_ffn_triton(x, starts, swap(w_in_q), w_in_scale, b_in, swap(w_out_q), w_out_scale,
                                                    b_out, 5, 4, 16, deterministic=True)
    with pytest.raises(AssertionError, match="max \\|y - ref\\|"):
        assert_matches_reference(y, (x, starts, w_in_q, w_in_scale, b_in, w_out_q, w_out_scale, b_out), 5, 4, 16,
                                 "swapped")


@pytest.mark.parametrize("bits", [8, 4])
def test_bytes_read_as_int8_give_the_same_numbers(bits):
    """TensorRT passes the packed weights as int8 (network.plugin_model retypes them): the device
    kernel reads the same bits either way."""
    inputs = list(make_q_inputs((3,), 31, 27, 6, 2, bits, 16, seed=SEED))
    H, D, K = triton_kernel.check_q_inputs(*inputs, 6, bits, 16)
    as_uint8 = triton_kernel._launch(triton_kernel.q_continuous_slice_ffn_kernel, inputs[0], inputs[1], inputs[2:],
                                     H, D, K, 6, True, **triton_kernel.quant_constants(bits, 16))
    inputs[2], inputs[5] = inputs[2].view(torch.int8), inputs[5].view(torch.int8)
    as_int8 = triton_kernel._launch(triton_kernel.q_continuous_slice_ffn_kernel, inputs[0], inputs[1], inputs[2:],
                                    H, D, K, 6, True, **triton_kernel.quant_constants(bits, 16))
    assert torch.equal(as_uint8, as_int8)


def test_columns_mode_is_bitwise_reproducible():
    inputs = make_q_inputs((3,), 41, 23, 7, 3, 4, 16, seed=SEED)
    first = triton_kernel.q_continuous_slice_ffn_triton(*inputs, 7, 4, 16, deterministic=True)
    assert torch.equal(first, triton_kernel.q_continuous_slice_ffn_triton(*inputs, 7, 4, 16, deterministic=True))


@pytest.mark.parametrize("deterministic", [True, False], ids=["columns", "split"])
def test_device_kernel_poisons_only_the_bad_token(deterministic):
    H, r = 29, 6
    x, starts, *rest = make_q_inputs((4,), H, 9, r, 3, 8, 16, seed=SEED)
    starts[2, 1] = H - r + 1
    y = triton_kernel.q_continuous_slice_ffn_triton(x, starts, *rest, r, 8, 16, deterministic=deterministic,
                                                    check_starts=False)
    assert y[2].isnan().all() and not y[[0, 1, 3]].isnan().any()
    good = [0, 1, 3]
    assert_matches_reference(y[good], (x[good], starts[good], *rest), r, 8, 16, "good tokens")


def _bad(index, value):
    def change(inputs):
        inputs = list(inputs)
        inputs[index] = value(inputs[index])
        return inputs
    return change


@pytest.mark.parametrize("change, bits, block_size, message", [
    (None, 3, 32, "bits must be 4 or 8, got 3"),
    (None, 8, 24, "block size must be a power of two >= 16, got 24"),
    (None, 8, 8, "block size must be a power of two >= 16, got 8"),
    (_bad(2, lambda t: t[:, :-1]), 8, 16, "w_in_q must have shape \\[23, 33\\]"),
    (_bad(5, lambda t: t[:, :16]), 4, 16, "w_out_q must have shape \\[23, 17\\]"),
    (_bad(3, lambda t: t[:, :1]), 8, 16, "w_in_scale must have shape \\[23, 3\\]"),
    (_bad(6, lambda t: t.half()), 8, 16, "w_out_scale must have X's dtype torch.float32"),
    (_bad(2, lambda t: t.view(torch.int8)), 8, 16, "w_in_q must be uint8"),
    (_bad(4, lambda t: t[:-1]), 8, 16, "b_in must have shape \\[23\\]"),
    (_bad(1, lambda t: t + 100), 8, 16, "starts must lie in \\[0, 18\\]"),
    (_bad(0, lambda t: t.double()), 8, 16, "must have X's dtype torch.float64"),
])
def test_bad_input_is_one_line_naming_the_problem(change, bits, block_size, message):
    inputs = make_q_inputs((2,), 23, 33, 5, 2, 8 if bits == 3 else bits, 16 if block_size != 32 else 32, seed=SEED)
    if change:
        inputs = change(inputs)
    with pytest.raises(InfMoEError, match=message) as raised:
        triton_kernel.q_continuous_slice_ffn_triton(*inputs, 5, bits, block_size)
    assert "\n" not in str(raised.value)


# ---------------------------------------------------------------------------------------------
# The plugin: attributes, ranks, types, specialisation (plain functions and register)

Q_DTYPES = ["float32", "int64", "int8", "float32", "float32", "int8", "float32", "float32"]
Q_SHAPES = [(None, None, 19), (None, None, 3), (37, 10), (37, 2), (37,), (37, 10), (37, 2), (19,)]  # int4, B 16


def q_descs(trtp, dtype="float32", shapes=Q_SHAPES):
    types = [f"DataType.{dtype if t == 'float32' else t}" for t in Q_DTYPES]
    return [trtp.TensorDesc(tuple(-2 if d is None else d for d in shape), t) for shape, t in zip(shapes, types)]


def test_register_checks_bits_and_block_size(stub_plugin):  # noqa: F811
    trtp, registered = stub_plugin
    register = registered["infmoe::QContinuousSliceFFN"]["register"]
    y = register(*q_descs(trtp), slice_width=5, activation="gelu_tanh\x00", bits=4, block_size=16)
    assert y.dtype == "DataType.float32" and len(y.shape_expr) == 3
    for bits, block_size, message in [(3, 16, "bits must be 4 or 8, got 3"),
                                      (4, 24, "block size must be a power of two >= 16, got 24"),
                                      (8, 8, "block size must be a power of two >= 16, got 8")]:
        with pytest.raises(InfMoEError, match=f"infmoe::QContinuousSliceFFN: {message}") as raised:
            register(*q_descs(trtp), slice_width=5, activation="gelu_tanh", bits=bits, block_size=block_size)
        assert "\n" not in str(raised.value)


@pytest.mark.parametrize("index, dtype, message", [
    (2, "uint8", "w_in_q must be int8 \\(the uint8 storage retyped by `infmoe-export trt`\\), got uint8"),
    (5, "float32", "w_out_q must be int8"),
    (3, "float16", "w_in_scale must have X's dtype float32, got float16"),
    (7, "float16", "b_out must have X's dtype"),
    (1, "int32", "starts must be int64"),
])
def test_q_descriptors_refuse_bad_types(index, dtype, message):
    assert descriptors.output_dtype(Q_DTYPES, descriptors.Q_OP) == "float32"
    dtypes = list(Q_DTYPES)
    dtypes[index] = dtype
    with pytest.raises(InfMoEError, match=f"QContinuousSliceFFN: {message}"):
        descriptors.output_dtype(dtypes, descriptors.Q_OP)


def test_q_descriptors_check_ranks():
    descriptors.check_ranks([3, 3, 2, 2, 1, 2, 2, 1], descriptors.Q_OP)
    with pytest.raises(InfMoEError, match="w_out_scale must have rank 2"):
        descriptors.check_ranks([3, 3, 2, 2, 1, 2, 1, 1], descriptors.Q_OP)
    with pytest.raises(InfMoEError, match="expected 8 inputs"):
        descriptors.check_ranks([3, 3, 2, 1, 2, 1], descriptors.Q_OP)


def test_q_specialisation_takes_d_from_x():
    # int4 with odd D: 10 packed bytes hold 19 or 20 columns; X says which.
    assert descriptors.specialisation(Q_SHAPES, 5, 4, 16) == {"H": 37, "D": 19, "R": 5, "K": 3}
    # int8 stores a byte per weight, so a dynamic X's D is w_in_q's dim 1.
    int8 = [(None, None, None), (None, None, 3), (37, 19), (37, 1), (37,), (37, 19), (37, 1), (19,)]
    assert descriptors.specialisation(int8, 5, 8, 32)["D"] == 19
    with pytest.raises(InfMoEError, match="D \\(X's last dim\\) must be static"):
        descriptors.specialisation([(None, None, None)] + Q_SHAPES[1:], 5, 4, 16)


@pytest.mark.parametrize("index, shape, message", [
    (2, (37, 19), "w_in_q must have shape \\[37, 10\\] for D 19, 4 bits and block size 16, got \\[37, 19\\]"),
    (6, (37, 1), "w_out_scale must have shape \\[37, 2\\]"),
    (4, (36,), "b_in must have shape \\[37\\]"),
    (7, (20,), "b_out must have shape \\[19\\]"),
])
def test_q_specialisation_refuses_mismatched_storage(index, shape, message):
    shapes = list(Q_SHAPES)
    shapes[index] = shape
    with pytest.raises(InfMoEError, match=message):
        descriptors.specialisation(shapes, 5, 4, 16)


def test_compile_ptx_refuses_bad_bits_and_block_size_before_compiling():
    with pytest.raises(InfMoEError, match="QContinuousSliceFFN: bits must be 4 or 8, got 2"):
        trt_compile.compile_ptx("fp32", 37, 19, 5, 3, bits=2, block_size=16, capability=90)
    with pytest.raises(InfMoEError, match="QContinuousSliceFFN: block size must be a power of two >= 16, got 48"):
        trt_compile.compile_ptx("fp32", 37, 19, 5, 3, bits=8, block_size=48, capability=90)


def test_q_aot_impl_gives_ptx_that_ptxas_assembles_for_sm_90():
    """The quantized plugin's AOT implementation as TensorRT runs it at build time (run_aot)."""
    calls = []
    for bits, block, D in ((8, 32, 45), (4, 16, 45), (4, 64, 70)):
        packed, blocks = (D if bits == 8 else (D + 1) // 2), -(-D // block)
        for t in ("float32", "float16"):
            shapes = [(-2, -3, D), (-2, -3, 3), (37, packed), (37, blocks), (37,), (37, packed), (37, blocks), (D,)]
            types = [t, "int64", "int8", t, t, "int8", t, t]
            calls.append((f"int{bits}-b{block}-D{D}-{t}", "infmoe::QContinuousSliceFFN", list(zip(shapes, types)),
                          (5, "gelu_tanh\x00", bits, block)))
    report = run_aot(calls, timeout=600)
    assert len(report) == 6
    for what, r in report.items():
        assert r["entry"] == r["name"] == "q_continuous_slice_ffn_kernel", what
        assert r["params"] == 9, f"{what}: 8 input pointers + Y, no hidden scratch pointers"
        assert r["version"] == "8.4" and r["arch"] in ("sm_90", "sm_90a"), what
        D = int(what.split("-D")[1].split("-")[0])
        assert r["grid"] == [2 * 3, -(-D // 64)] and r["block_x"] == 128 and r["extra"] == 0, what
        assert r["ptxas"] == 0, f"{what}: ptxas rejected the PTX: {r['err']}"


# ---------------------------------------------------------------------------------------------
# The model the parser gets, engines per (K, precision)


@pytest.fixture(scope="module")
def q_model():
    torch.manual_seed(SEED % 2**31)
    return InfMoEGPT(TINY).eval()


@pytest.fixture(scope="module")
def q_exports(q_model, tmp_path_factory):
    """The tiny model exported for K = 2 as trt exports it (no function): int8 and int4, B 16."""
    folder = tmp_path_factory.mktemp("q_onnx")
    return {dtype: export_onnx(q_model, folder / dtype / "model_k2.onnx", k=2, dtype=dtype, block_size=16,
                               function=False) for dtype in ("int8", "int4")}


@pytest.mark.parametrize("dtype", ["int8", "int4"])
def test_parser_model_has_int8_packed_weights_and_pinned_k(q_exports, dtype):
    exported = q_exports[dtype]
    original = onnx.load(str(exported.path))
    packed = {i.name: onnx.numpy_helper.to_array(i) for i in original.graph.initializer
              if i.data_type == onnx.TensorProto.UINT8}
    model = network.plugin_model(exported)
    onnx.checker.check_model(model)
    nodes = network.plugin_nodes(model, exported.path)
    assert [n.op_type for n in nodes] == ["QContinuousSliceFFN"] * TINY.n_layer
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in nodes[0].attribute}
    assert (attrs["bits"], attrs["block_size"]) == (int(dtype[3:]), 16)
    initializers = {i.name: i for i in model.graph.initializer}
    assert not any(i.data_type == onnx.TensorProto.UINT8 for i in model.graph.initializer)  # none left for TensorRT
    for node in nodes:
        for index in network.PACKED_INPUTS:
            retyped = initializers[node.input[index]]
            assert retyped.data_type == onnx.TensorProto.INT8
            source = packed[retyped.name.removesuffix("_int8")]
            assert onnx.numpy_helper.to_array(retyped).view("uint8").tobytes() == source.tobytes()  # same bytes
    pinned = next(i for i in model.graph.initializer if i.name == network.PINNED_K)
    assert onnx.numpy_helper.to_array(pinned).tolist() == [0, 0, 2]


def test_parser_model_refuses_quantized_function_and_bad_attributes(q_exports, tmp_path):
    model = onnx.load(str(q_exports["int4"].path))
    node = next(n for n in model.graph.node if n.op_type == "QContinuousSliceFFN")
    kept = [a for a in node.attribute if a.name != "bits"]
    del node.attribute[:]
    node.attribute.extend(kept)
    onnx.save(model, tmp_path / "no_bits.onnx")
    with pytest.raises(InfMoEError, match="needs an integer attribute bits"):
        network.plugin_model(ExportedModel.read(tmp_path / "no_bits.onnx"))
    model.functions.append(onnx.helper.make_function("infmoe", "QContinuousSliceFFN", ["X"], ["Y"],
                                                     [onnx.helper.make_node("Identity", ["X"], ["Y"])],
                                                     [onnx.helper.make_opsetid("", 18)]))
    onnx.save(model, tmp_path / "with_function.onnx")
    with pytest.raises(InfMoEError, match="fallback function infmoe::QContinuousSliceFFN.*--no-function"):
        network.plugin_model(ExportedModel.read(tmp_path / "with_function.onnx"))


def test_plan_models_by_k_and_precision(q_exports):
    paths = [q_exports["int8"].path, q_exports["int4"].path]
    assert list(build.plan_models(paths, None)) == [(2, "int8"), (2, "int4")]
    assert list(build.plan_models(paths, [2], ["int4"])) == [(2, "int4")]
    with pytest.raises(InfMoEError, match="no fp32 model for K=2: the given models are K=2 int4, K=2 int8"):
        build.plan_models(paths, None, ["fp32", "int8"])


def test_manifest_picks_by_k_and_precision(q_exports, tmp_path):
    write_fake_build(tmp_path, q_exports["int4"], [1, 2], precisions=("int4", "fp32", "int8"))
    read = manifest.read_manifest(tmp_path)
    assert [(e["k"], e["precision"]) for e in read["engines"]] == [
        (1, "fp32"), (1, "int8"), (1, "int4"), (2, "fp32"), (2, "int8"), (2, "int4")]
    chosen = manifest.select_engine(read, 2, "int8")
    assert (chosen["k"], chosen["precision"], chosen["file"]) == (2, "int8", "model_k2_int8.engine")
    assert chosen["path"].endswith("model_k2_int8.engine")
    with pytest.raises(InfMoEError, match="holds engines for K=2 in fp32, int8, int4: choose a precision"):
        manifest.select_engine(read, 2)
    with pytest.raises(InfMoEError, match="no TensorRT engine for K=2 fp16 .*available: K=1 fp32, K=1 int8"):
        manifest.select_engine(read, 2, "fp16")


def test_build_engines_names_and_records_each_precision(q_exports, tmp_path, monkeypatch):
    """build_engines around the TensorRT build itself (stood in for: no TensorRT here)."""
    monkeypatch.setattr(build, "require_tensorrt", lambda: "10.13.0")
    monkeypatch.setattr(build, "register_plugin", lambda: None)
    monkeypatch.setattr(build, "gpu_name", lambda: "NVIDIA H200")
    built = []

    def fake_build(model, engine_path, profiles, timing_cache, jit):
        built.append((model.io.dtype, engine_path.name, [p["name"] for p in profiles]))
        engine_path.write_bytes(b"placeholder")

    monkeypatch.setattr(build, "build_engine", fake_build)
    paths = [q_exports["int4"].path, q_exports["int8"].path]
    path = build.build_engines(build.plan_models(paths, None), tmp_path, tmp_path / "t.cache", 1, 8, jit=False)
    assert built == [("int8", "model_k2_int8.engine", ["prefill", "decode"]),
                     ("int4", "model_k2_int4.engine", ["prefill", "decode"])]
    read = manifest.read_manifest(path)
    assert [(e["k"], e["precision"], e["file"]) for e in read["engines"]] == [
        (2, "int8", "model_k2_int8.engine"), (2, "int4", "model_k2_int4.engine")]
    entry = manifest.select_engine(read, 2, "int4")
    assert entry["metadata"]["infmoe.block_size"] == "16" and entry["metadata"]["infmoe.dtype"] == "int4"


@pytest.mark.parametrize("change, message", [
    (lambda engines: engines[0].update(precision="int3"), "engine 0 has precision 'int3'"),
    (lambda engines: engines.append(dict(engines[0])), "two engines for K=2 int4"),
])
def test_manifest_refuses_bad_precisions(q_exports, tmp_path, change, message):
    path = write_fake_build(tmp_path, q_exports["int4"], [2], precisions=("int4",))
    content = json.loads(path.read_text())
    change(content["engines"])
    path.write_text(json.dumps(content))
    with pytest.raises(InfMoEError, match=message):
        manifest.read_manifest(tmp_path)


def test_trt_refuses_a_precision_the_models_lack(q_exports, tmp_path, run_cli):
    code, _, err = run_cli("trt", "--out", tmp_path / "engines", "--model", q_exports["int4"].path, "--dtype", "fp32")
    assert code == 1 and err.count("\n") == 1 and "no fp32 model for K=2: the given models are K=2 int4" in err
    assert not (tmp_path / "engines").exists()


# ---------------------------------------------------------------------------------------------
# With TensorRT and a GPU (plugins/tensorrt/gpu_check.sh runs this file there)


@needs_tensorrt
@pytest.mark.parametrize("jit", [False, True], ids=["aot", "jit"])
def test_quantized_engines_match_the_level1_reference(q_model, q_exports, tmp_path, jit):
    """int8 and int4 engines (one folder, picked by precision) against PyTorch on the dequantized
    weights w', prefill then one decode step, with the float tolerances (SPEC §6, level 1)."""
    if jit and not torch.cuda.is_available():
        pytest.skip("the JIT plugin needs a CUDA build of torch")
    models = {(2, dtype): exported for dtype, exported in q_exports.items()}
    build.build_engines(models, tmp_path, timing_cache=tmp_path / "t.cache", max_batch=2, max_seq=16, jit=jit)
    for dtype, exported in q_exports.items():
        reference = dequantized_model(q_model, exported.io.bits, exported.io.block_size)
        with runner.TrtRunner.from_engines(tmp_path, 2, dtype) as trt_runner:
            check_prefill_and_step(trt_runner, exported.io, reference)


def test_trt_exports_every_k_and_precision_for_tensorrt(make_checkpoint, tmp_path, monkeypatch, run_cli):
    """`trt --dtype fp32,int4` from a checkpoint, up to the build (stood in for: no TensorRT)."""
    from infmoe_export.commands import trt as trt_command

    planned = {}
    monkeypatch.setattr(trt_command, "require_tensorrt", lambda: "10.13.0")

    def fake_build(models, out, timing_cache, max_batch, max_seq, jit, progress=None):
        planned.update(models)
        return out / "manifest.json"

    monkeypatch.setattr(trt_command, "build_engines", fake_build)
    code, _, err = run_cli("trt", "--checkpoint", make_checkpoint(), "--out", tmp_path / "engines", "--k", "1,2",
                           "--dtype", "int4,fp32", "--block-size", "16")
    assert code == 0, err
    assert list(planned) == [(1, "fp32"), (2, "fp32"), (1, "int4"), (2, "int4")]
    for (k, dtype), model in planned.items():
        assert (model.k, model.io.dtype, model.io.target) == (k, dtype, "tensorrt")
        assert model.path.parent == tmp_path / "engines" / "onnx" / dtype
        assert not onnx.load(str(model.path), load_external_data=False).functions  # the parser must find the plugin
    assert planned[1, "int4"].io.block_size == 16
    network.plugin_model(planned[2, "int4"])  # what the build would hand the parser
