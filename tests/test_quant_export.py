"""int8 / int4 exports (SPEC §6, docs/guide/quantization.md): the QContinuousSliceFFN fallback function
against the op's reference on odd shapes, whole exports in stock onnxruntime (no kernel) against
the level-1 reference, a planted nibble swap, metadata, the CLI's refusals, other tools, and
the level-2 quality figures."""

import dataclasses
import json
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

import infmoe_export
from infmoe_export import quant
from infmoe_export.contract import DecoderIO, ExportedModel
from infmoe_export.export import export_many, export_onnx
from infmoe_export.export.function import op_model
from infmoe_export.quant import QuantizedWeight, q_continuous_slice_ffn
from infmoe_export.runtimes.ort import OrtRunner
from infmoe_export.runtimes.torch_runner import TorchRunner
from infmoe_export.verify.quality import quality_vs_float
from infmoe_export.verify.validate import validate_onnx

INPUTS = ["X", "starts", "w_in_q", "w_in_scale", "b_in", "w_out_q", "w_out_scale", "b_out"]


def fallback(r, bits, block, feed):
    """Stock onnxruntime running the quantized op's standard-op function."""
    model = op_model(r, with_function=True, bits=bits, block_size=block)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, {name: np.asarray(value) for name, value in feed.items()})[0]


def op_inputs(h, d, r, k, bits, block, starts=None, seed=0):
    generator = torch.Generator().manual_seed(seed)
    w_in, w_out = (torch.randn(h, d, generator=generator) * torch.rand(h, 1, generator=generator) for _ in range(2))
    q_in, q_out = QuantizedWeight.of(w_in, bits, block), QuantizedWeight.of(w_out, bits, block)
    if starts is None:
        starts = torch.randint(0, h - r + 1, (2, 3, k), generator=generator)
        starts[0, 0, 0], starts[-1, -1, -1] = 0, h - r  # both ends of the range
    return dict(X=torch.randn(2, 3, d, generator=generator), starts=starts, w_in_q=q_in.packed,
                w_in_scale=q_in.scale, b_in=torch.randn(h, generator=generator), w_out_q=q_out.packed,
                w_out_scale=q_out.scale, b_out=torch.randn(d, generator=generator))


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("h,d,r,k,block", [
    (41, 37, 7, 3, 16),    # D not a multiple of B, odd D (a pad nibble at int4), K > 1
    (23, 19, 23, 1, 32),   # r = H (every start 0), K = 1, D < B: one partial block
    (50, 33, 1, 4, 16),    # r = 1
    (29, 64, 5, 2, 64),    # D = B: one full block
])
def test_fallback_function_matches_the_reference(bits, h, d, r, k, block):
    feed = op_inputs(h, d, r, k, bits, block, seed=h + d + bits)
    expected = q_continuous_slice_ffn(*feed.values(), r, bits, block)
    np.testing.assert_allclose(fallback(r, bits, block, feed), expected.numpy(), rtol=1e-5, atol=2e-5)


@pytest.mark.parametrize("bits", [8, 4])
def test_fallback_function_with_float16_activations(bits):
    """SPEC §6 allows float16 X (and scales of X's type); the function computes in X's type."""
    feed = op_inputs(41, 37, 7, 3, bits, 16, seed=bits)
    feed = {name: value.half() if value.dtype == torch.float32 else value for name, value in feed.items()}
    expected = q_continuous_slice_ffn(*feed.values(), 7, bits, 16).float().numpy()
    model = op_model(7, "float16", with_function=True, bits=bits, block_size=16)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    out = session.run(None, {name: value.numpy() for name, value in feed.items()})[0]
    assert out.dtype == np.float16
    np.testing.assert_allclose(out.astype(np.float32), expected, atol=2e-2 * np.abs(expected).max())


@pytest.mark.parametrize("bits", [8, 4])
def test_overlapping_and_disjoint_windows(bits):
    h, d, r = 40, 21, 9
    starts = torch.tensor([[[3, 5, 5], [0, 15, 31]]])  # overlapping (one twice), then disjoint
    feed = op_inputs(h, d, r, 3, bits, 16, starts=starts, seed=bits)
    feed["X"] = feed["X"][:1, :2]
    expected = q_continuous_slice_ffn(*feed.values(), r, bits, 16)
    np.testing.assert_allclose(fallback(r, bits, 16, feed), expected.numpy(), rtol=1e-5, atol=2e-5)


@pytest.mark.parametrize("change", ["bits 3", "block 24", "block 8", "short scales", "wide storage", "start"])
def test_fallback_function_gives_nan_on_invalid_input(change):
    """A graph cannot raise: a broken rule makes the output NaN (every row, or a token's)."""
    bits, block, r = 4, 16, 5
    feed = op_inputs(30, 35, r, 2, bits, block)
    if change == "bits 3":
        bits = 3
    elif change.startswith("block"):
        block = int(change.split()[1])
    elif change == "short scales":
        feed["w_in_scale"], feed["w_out_scale"] = feed["w_in_scale"][:, :-1], feed["w_out_scale"][:, :-1]
    elif change == "wide storage":
        feed["w_in_q"], feed["w_out_q"] = (torch.cat([q, q[:, :1]], dim=1) for q in (feed["w_in_q"], feed["w_out_q"]))
    else:
        feed["starts"][1, 2, 0] = 30 - r + 1
    out = fallback(r, bits, block, feed)
    if change == "start":
        assert np.isnan(out[1, 2]).all() and np.isfinite(out[0]).all()
    else:
        assert np.isnan(out).all()


def test_fallback_function_fails_on_storage_shapes_no_op_can_join():
    """w_in's and w_out's storage are dequantized as one tensor: disagreeing widths are an
    onnxruntime error (a status, as for the float function's unbroadcastable shapes)."""
    feed = op_inputs(30, 35, 5, 2, 4, 16)
    feed["w_in_scale"] = feed["w_in_scale"][:, :-1]
    with pytest.raises(Exception, match="Concat"):
        fallback(5, 4, 16, feed)


def swapped_nibbles(packed):
    return (packed >> 4) | ((packed & 0x0F) << 4)


def swap_nibbles(pack):
    """pack, with the nibble order of int4 storage reversed (the planted bug)."""
    return lambda q, bits: swapped_nibbles(pack(q, bits)) if bits == 4 else pack(q, bits)


def test_the_function_reads_the_even_column_from_the_low_nibble():
    """Fed storage in the other nibble order (a function that read it so), the output moves."""
    feed = op_inputs(41, 37, 7, 3, 4, 16)
    expected = q_continuous_slice_ffn(*feed.values(), 7, 4, 16).numpy()
    swapped = {**feed, "w_in_q": swapped_nibbles(feed["w_in_q"]), "w_out_q": swapped_nibbles(feed["w_out_q"])}
    assert np.abs(fallback(7, 4, 16, swapped) - expected).max() > 1e-2


# ---------------------------------------------------------------------------------------------
# Whole exports: the tiny odd model (D 15, head_dim 5, H 37, r 11), int4 at block 16 gives one
# partial block and a pad nibble per row.


@pytest.mark.parametrize("dtype,other,noise", [("int4", "none", "quantile"), ("int8", "int4", "sampled"),
                                               ("int4", "int8", "quantile")])
def test_export_runs_in_stock_onnxruntime_at_level_1(make_model, tmp_path, dtype, other, noise):
    model = make_model()
    exported = export_onnx(model, tmp_path / "m.onnx", k=2, noise=noise, dtype=dtype, block_size=16,
                           quantize_other=other)
    graph = onnx.load(str(exported.path))
    ops = [n.op_type for n in graph.graph.node]
    assert ops.count("QContinuousSliceFFN") == 2 and "ContinuousSliceFFN" not in ops
    dequantized = {n.output[0] for n in graph.graph.node if n.op_type == "DequantizeLinear"}
    matrices = {"wte.weight"} | {f"h.{i}.attn.{m}.weight.T" for i in range(2) for m in ("qkv", "proj")}
    # torch.onnx keeps the LM head's wte.weight.T as a second initializer for some shapes
    assert dequantized - {"wte.weight.T"} == (set() if other == "none" else matrices)
    node = next(n for n in graph.graph.node if n.op_type == "QContinuousSliceFFN")
    attributes = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    assert attributes["bits"] == quant.BITS[dtype] and attributes["block_size"] == 16
    weights = {t.name: t for t in graph.graph.initializer}
    assert weights["h.0.moe.w_in_q"].data_type == onnx.TensorProto.UINT8
    assert weights["h.0.moe.w_in_scale"].data_type == onnx.TensorProto.FLOAT
    assert "h.0.moe.w_in" not in weights and weights["h.0.moe.b_in"].data_type == onnx.TensorProto.FLOAT
    # batch 2 left-padded prefill, then a decode step, against TorchRunner on w' (validate.py)
    report = validate_onnx(model, exported, kernel=False)
    assert report.passed and report.start_agreement == 1.0
    assert report.level2 is not None and report.level2["logit_error"]["max"] > 0


def test_a_nibble_swap_in_the_export_fails_validation(make_model, tmp_path, monkeypatch):
    model = make_model()
    monkeypatch.setattr(quant, "pack", swap_nibbles(quant.pack))
    exported = export_onnx(model, tmp_path / "m.onnx", dtype="int4", block_size=16)
    monkeypatch.undo()
    report = validate_onnx(model, exported, kernel=False, raise_on_failure=False)
    assert not report.passed


def test_dense_model_quantizes_its_experts_with_dequantize_linear(make_model, tmp_path):
    model = make_model(slice_width=37)
    exported = export_onnx(model, tmp_path / "m.onnx", k=1, dtype="int4", block_size=16)
    graph = onnx.load(str(exported.path))
    ops = [n.op_type for n in graph.graph.node]
    assert ops.count("DequantizeLinear") == 4 and "QContinuousSliceFFN" not in ops
    assert exported.metadata["infmoe.opset"] == "21" and not exported.has_function
    assert validate_onnx(model, exported, kernel=False).passed


@pytest.mark.parametrize("bits, other", [(4, "int4"), (8, "none")])
@pytest.mark.parametrize("k", [1, 3])
def test_dense_model_on_the_onnxruntime_target_reads_both_ffn_matrices_packed(make_model, tmp_path, bits, other, k):
    """K windows of r = H (GPT-2's MLP) at int8 / int4 on the onnxruntime target: both FFN matrices
    go to QContinuousSliceFFN, stored packed once (no float copy, no DequantizeLinear, no FFN
    MatMul), and the file matches the level-1 reference on fresh random inputs, with the kernel
    and on the functions."""
    model = make_model(d_model=16, n_head=2, slice_width=37)  # head_dim 8: the onnxruntime target
    dtype = f"int{bits}"
    exported = export_onnx(model, tmp_path / "m.onnx", k=k, dtype=dtype, block_size=16, quantize_other=other,
                           target="onnxruntime")
    graph = onnx.load(str(exported.path)).graph
    ops = [n.op_type for n in graph.node]
    layers = model.config.n_layer
    assert ops.count("QContinuousSliceFFN") == layers and "DequantizeLinear" not in ops and "Gelu" not in ops
    assert ops.count("MatMul") == (0 if other != "none" else 2 * layers + 1)  # attention and the LM head only
    stored = {t.name for t in graph.initializer}
    for i in range(layers):
        assert {f"h.{i}.moe.w_in", f"h.{i}.moe.w_out"}.isdisjoint(stored)
        assert {f"h.{i}.moe.w_in_q", f"h.{i}.moe.w_out_q", f"h.{i}.moe.w_in_scale"} <= stored
    assert exported.io.experts_in_op and exported.has_function
    rng = np.random.default_rng(100 + k + bits)
    # A prefill after a cache and a batched decode step (GroupQueryAttention, the attention's
    # fallback, takes a past only at batch 1 or sequence 1); row 0's left pad lies in the cache.
    shapes = [(1, 4, 0), (1, 4, 3), (3, 1, 5)]
    for kernel in (True, False):
        with OrtRunner(exported.io, exported, kernel=kernel) as runner, TorchRunner(exported.io, model) as reference:
            for batch, sequence, past in shapes:
                feed = exported.io.dummy_inputs(batch, sequence, past, left_pad=int(past > 0),
                                                seed=int(rng.integers(1 << 30)))
                actual, expected = runner.infer(feed, check_inputs=False), reference.infer(feed)
                for name, value in expected.items():
                    np.testing.assert_allclose(actual[name], value, rtol=1e-4, atol=1e-4,
                                               err_msg=f"{name}, kernel {kernel}, {batch}x{sequence} after {past}")


def test_bundled_dense_baseline_at_int4_reads_no_float_ffn(tmp_path):
    """The bundled dense baseline (K 8 windows of all of H) at all-int4 for onnxruntime: no FFN
    weight is dequantized per step, and it validates."""
    from infmoe_export.checkpoint import load_checkpoint

    path = Path(infmoe_export.__file__).parent / "baselines" / "dense-256"
    if not path.is_dir():
        pytest.skip("the bundled dense baselines are not in this checkout")
    model = load_checkpoint(path)
    exported = export_onnx(model, tmp_path / "m.onnx", dtype="int4", quantize_other="int4", target="onnxruntime")
    ops = [n.op_type for n in onnx.load(str(exported.path)).graph.node]
    assert ops.count("QContinuousSliceFFN") == model.config.n_layer
    assert not {"DequantizeLinear", "MatMul", "MatMulNBits"} & set(ops)
    assert validate_onnx(model, exported).passed


@pytest.mark.parametrize("other", ["int4", "int8"])
def test_onnxruntime_target_reads_quantized_matrices_packed(make_model, tmp_path, other, library):
    """GatherBlockQuantized and QMatMul on one packed wte, QMatMul for attention (D 24 at block 16:
    a padded block); level 1 with our kernel and through QMatMul's function (MatMulNBits)."""
    model = make_model(d_model=24)  # head_dim 8, as GroupQueryAttention (DecoderAttention's fallback) needs
    exported = export_onnx(model, tmp_path / "m.onnx", dtype="int4", block_size=16, quantize_other=other,
                           target="onnxruntime")
    graph = onnx.load(str(exported.path))
    ops = [n.op_type for n in graph.graph.node]
    layers = model.config.n_layer
    assert ops.count("GatherBlockQuantized") == 1 and ops.count("QMatMul") == 2 * layers + 1
    assert "DequantizeLinear" not in ops and "MatMulNBits" not in ops
    assert not {"wte.weight", "wte.weight.T"} & {t.name for t in graph.graph.initializer}
    assert {f.name for f in graph.functions} == {"ContinuousSliceFFN", "QContinuousSliceFFN", "QMatMul",
                                                 "DecoderAttention", "WindowStarts", "StepInputs", "SkipLayerNorm"}
    assert exported.has_function
    assert validate_onnx(model, exported, kernel=True).passed
    assert validate_onnx(model, exported, kernel=False).passed


def test_metadata_round_trip(make_model, tmp_path):
    exported = export_onnx(make_model(), tmp_path / "m.onnx", dtype="int8", block_size=64, quantize_other="int4")
    read = ExportedModel.read(exported.path)
    assert read.io == exported.io and read.io.bits == 8 and read.io.other_bits == 4
    assert {k: read.metadata[k] for k in ("infmoe.dtype", "infmoe.bits", "infmoe.block_size",
                                          "infmoe.quantize_other", "infmoe.quantized", "infmoe.opset")} == {
        "infmoe.dtype": "int8", "infmoe.bits": "8", "infmoe.block_size": "64", "infmoe.quantize_other": "int4",
        "infmoe.quantized": "experts,attention,embedding", "infmoe.opset": "21"}
    old = {k: v for k, v in exported.metadata.items() if k not in ("infmoe.block_size", "infmoe.quantize_other")}
    old["infmoe.dtype"] = "fp32"  # a file from before quantization
    assert DecoderIO.from_metadata(old) == DecoderIO(exported.io.config, exported.io.k, target=exported.io.target)


def test_onnx_and_onnxruntime_tools_load_it(make_model, tmp_path, run_cli):
    from onnxruntime.quantization.shape_inference import quant_pre_process

    exported = export_onnx(make_model(), tmp_path / "m.onnx", dtype="int4", block_size=16, quantize_other="int4")
    onnx.checker.check_model(onnx.load(str(exported.path)), full_check=True)
    quant_pre_process(str(exported.path), str(tmp_path / "pre.onnx"), skip_optimization=True)
    kept = onnx.load(str(tmp_path / "pre.onnx"))
    assert sum(n.op_type == "QContinuousSliceFFN" for n in kept.graph.node) == 2
    code, out, _ = run_cli("inspect", exported.path)
    assert code == 0 and "no problems found" in out


@pytest.mark.parametrize("args,message", [
    (["--dtype", "int4", "--block-size", "0"], "--block-size"),
    (["--dtype", "int4", "--block-size", "24"], "--block-size"),
    (["--dtype", "int8", "--block-size", "8"], "--block-size"),
    (["--block-size", "-1"], "--block-size"),  # checked at fp32 too, where nothing uses it
    (["--dtype", "int4", "--quantize-other", "int4", "--opset", "18"], "opset 18"),
])
def test_cli_refuses_bad_quantization_in_one_line(make_checkpoint, tmp_path, run_cli, args, message):
    out = tmp_path / "m.onnx"
    code, _, err = run_cli("onnx", "--checkpoint", make_checkpoint(), "--out", out, *args)
    assert code != 0 and err.startswith("error: ") and message in err and len(err.strip().splitlines()) == 1
    assert not out.exists() and list(tmp_path.glob("m.onnx*")) == []


def test_cli_exports_and_validates_all_int4(make_checkpoint, tmp_path, run_cli):
    out = tmp_path / "m.onnx"
    code, _, err = run_cli("onnx", "--checkpoint", make_checkpoint(), "--out", out, "--dtype", "int4",
                           "--block-size", "16", "--quantize-other", "int4", "--k", "2")
    assert code == 0, err
    assert "validated" in err and "level 2" in err
    assert ExportedModel.read(out).io.quantized == ["experts", "attention", "embedding"]


def test_export_many_names_each_precision_apart(make_model, tmp_path):
    """Precisions exported into one folder keep their own files (the name carries the precision)."""
    model = make_model()
    exported = [m for options in ({}, {"dtype": "int4", "block_size": 16},
                                  {"dtype": "int4", "block_size": 16, "quantize_other": "int4"})
                for m in export_many(model, tmp_path, [1, 2], **options)]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(m.path.name for m in exported)
    assert {m.path.name: (m.io.dtype, m.io.quantize_other, m.k) for m in exported} == {
        "model_k1_quantile_fp32.onnx": ("fp32", "none", 1), "model_k2_quantile_fp32.onnx": ("fp32", "none", 2),
        "model_k1_quantile_int4.onnx": ("int4", "none", 1), "model_k2_quantile_int4.onnx": ("int4", "none", 2),
        "model_k1_quantile_int4_other-int4.onnx": ("int4", "int4", 1),
        "model_k2_quantile_int4_other-int4.onnx": ("int4", "int4", 2)}
    assert all(ExportedModel.read(m.path).io == m.io for m in exported)


# ---------------------------------------------------------------------------------------------
# Level 2


def test_quality_vs_float(make_model, tmp_path):
    model = make_model()
    exported = export_onnx(model, tmp_path / "m.onnx", k=2, dtype="int8", block_size=16)
    figures = quality_vs_float(model, exported, max_windows=4, kernel=False)
    assert figures["tokens"] == 4 * model.config.n_positions and figures["precision"] == "int8"
    assert 0.9 <= figures["top1_agreement"] <= 1 and 0 < figures["start_agreement"] <= 1
    assert abs(figures["perplexity_increase_pct"]) < 5
    assert 0 < figures["logit_error"]["p50"] <= figures["logit_error"]["p99"] <= figures["logit_error"]["max"]
    # the same through a runner: the level-1 reference, which the export matches
    io = dataclasses.replace(exported.io, with_starts=True)
    same = quality_vs_float(model, TorchRunner(io, model), max_windows=4)
    assert same["top1_agreement"] == figures["top1_agreement"]
    assert abs(same["perplexity"] - figures["perplexity"]) < 1e-3 * figures["perplexity"]
    json.dumps(figures)  # plain numbers, for reports
