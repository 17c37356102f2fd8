"""benchmarks.moe_peer: its graphs of our op and of onnxruntime's com.microsoft MoE / QMoE run in
onnxruntime and compute what a NumPy reference says (softmax over the top-k logits, tanh GELU,
the dequantized weights, int8 activations where QMoE takes them), on tiny odd shapes; the two
sides agree where they compute the same function; a --quick run writes its JSON whole."""

import json
import math
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch
from onnx import TensorProto, helper

from benchmarks import moe_peer
from infmoe_export.model import continuous_slice_ffn
from infmoe_export.quant import dequantize, int8_activations, unpack
from infmoe_export.runtimes.ort_kernel import custom_op_library

ROOT = Path(__file__).resolve().parent.parent

# (precision, D, experts, units a expert, top k, block): the float case odd everywhere; the
# quantized ones with D and I whole blocks (QMoE's rule), two blocks a expert along I.
CASES = [("fp32", 37, 5, 19, 3, 32), ("int4", 96, 5, 64, 3, 32), ("int8", 96, 3, 64, 1, 32),
         ("int4-a8", 96, 5, 64, 3, 32)]
TOKENS, LAYERS = 7, 2


@pytest.fixture(scope="module")
def library():
    if custom_op_library() is None:
        pytest.skip("the compiled kernel is not installed")


def random_layers(rng, d, h):
    """Weights large enough that GELU's curve and every bias matter."""
    return [{name: (rng.standard_normal(shape) * 0.3).astype(np.float32)
             for name, shape in (("w_in", (h, d)), ("b_in", (h,)), ("w_out", (h, d)), ("b_out", (d,)))}
            for _ in range(LAYERS)]


def gelu_tanh(a):
    return 0.5 * a * (1 + np.tanh(math.sqrt(2 / math.pi) * (a + 0.044715 * a ** 3)))


def gelu_erf(a):
    return 0.5 * a * (1 + np.vectorize(math.erf)(a / math.sqrt(2)))


def weights_of(tensors, bits, block):
    """(w_in, w_out, w_out_t) as the sides compute with them: float64, dequantized at bits."""
    if bits is None:
        return [tensors[n].astype(np.float64) for n in ("w_in", "w_out", "w_out_t")]
    out = []
    for name in ("w_in", "w_out", "w_out_t"):
        packed, scale = torch.from_numpy(tensors[f"{name}_q"]), torch.from_numpy(tensors[f"{name}_scale"])
        columns = scale.shape[1] * block  # whole blocks in every case here
        out.append(dequantize(unpack(packed, bits, columns), scale, block, torch.float64).numpy())
    return out


def int8_rows(a):
    return int8_activations(torch.from_numpy(np.ascontiguousarray(a))).double().numpy()


def moe_reference(x, logits, w_in, b_in, w_out_t, b_out, experts, k, gelu, int8=False):
    """One com.microsoft MoE layer: softmax over all E, the top k, their weights over their sum;
    each expert's FFN (fc2 bias inside the weighting), int8 activations into both products."""
    units = w_in.shape[0] // experts
    p = np.exp(logits - logits.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    y = np.zeros((x.shape[0], w_out_t.shape[0]))
    for t in range(x.shape[0]):
        top = np.argsort(-p[t], kind="stable")[:k]
        for e, weight in zip(top, p[t, top] / p[t, top].sum()):
            rows = slice(e * units, (e + 1) * units)
            a = int8_rows(x[t:t + 1]) if int8 else x[t:t + 1]
            h = gelu(a @ w_in[rows].T + b_in[rows])
            h = int8_rows(h) if int8 else h
            y[t] += weight * (h @ w_out_t[:, rows].T + b_out)[0]
    return y


def layer_outputs(model, activations, x, routes, route):
    """Each layer's output, the chain's own float32 values (each layer checked on the input it
    got: a rounding of int8 activations that flips on another input changes every later one).
    activations: ours' ("float" or "int8"), or None for theirs (no kernel library)."""
    names = [f"X_{i}" for i in range(1, len(routes))] + ["Y"]
    model.graph.output.extend(helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in names[:-1])
    session = moe_peer.op_session(model, 1, kernel=activations is not None, activations=activations)
    return session.run(names, {"X": x, **{f"{route}_{i}": r for i, r in enumerate(routes)}})


@pytest.mark.parametrize("name, d, experts, units, k, block", CASES)
def test_theirs_is_a_softmax_top_k_moe(library, name, d, experts, units, k, block):
    precision = moe_peer.PRECISIONS[name]
    pairing = moe_peer.Pairing("tiny", experts, units, k)
    rng = np.random.default_rng(1)
    tensors = [moe_peer.layer_tensors(layer, precision.bits, block) for layer in random_layers(rng, d, pairing.hidden)]
    model = moe_peer.theirs_model(tensors, pairing, precision.bits, block, precision.accuracy_level)
    x = rng.standard_normal((TOKENS, d)).astype(np.float32)
    logits = [(2 * rng.standard_normal((TOKENS, experts))).astype(np.float32) for _ in range(LAYERS)]
    outputs = layer_outputs(model, None, x, logits, "logits")
    # int8 experts take int8 activations at every accuracy level, int4 ones at level 4.
    int8 = precision.bits == 8 or precision.accuracy_level == 4
    assert int8 == (precision.activations == "int8")
    for layer, route, a, y in zip(tensors, logits, [x, *outputs], outputs):
        w_in, _, w_out_t = weights_of(layer, precision.bits, block)
        expected = moe_reference(a.astype(np.float64), route, w_in, layer["b_in"], w_out_t, layer["b_out"], experts, k,
                                 gelu_tanh, int8)
        np.testing.assert_allclose(y, expected, rtol=1e-4, atol=1e-4 * np.abs(expected).max())
        if precision.bits is None:  # the CPU kernel's "gelu" is the tanh form, and the test can tell
            erf = moe_reference(a.astype(np.float64), route, w_in, layer["b_in"], w_out_t, layer["b_out"], experts, k,
                                gelu_erf)
            assert np.abs(y - erf).max() > 10 * np.abs(y - expected).max()


@pytest.mark.parametrize("name, d, experts, units, k, block", CASES)
def test_ours_is_the_coverage_form_on_disjoint_windows(library, name, d, experts, units, k, block):
    precision = moe_peer.PRECISIONS[name]
    pairing = moe_peer.Pairing("tiny", experts, units, k)
    rng = np.random.default_rng(2)
    tensors = [moe_peer.layer_tensors(layer, precision.bits, block) for layer in random_layers(rng, d, pairing.hidden)]
    x = rng.standard_normal((TOKENS, d)).astype(np.float32)
    starts = [moe_peer.disjoint_starts(rng, TOKENS, k, units, pairing.hidden) for _ in range(LAYERS)]
    outputs = layer_outputs(moe_peer.ours_model(tensors, pairing, precision.bits, block), precision.activations, x,
                            starts, "starts")
    for layer, s, a, y in zip(tensors, starts, [x, *outputs], outputs):
        w_in, w_out, _ = weights_of(layer, precision.bits, block)
        a = int8_rows(a) if precision.activations == "int8" else a  # x enters through w_in alone
        expected = continuous_slice_ffn(torch.from_numpy(a).double(), torch.from_numpy(s), torch.from_numpy(w_in),
                                        torch.from_numpy(layer["b_in"]).double(), torch.from_numpy(w_out),
                                        torch.from_numpy(layer["b_out"]).double(), units).numpy()
        np.testing.assert_allclose(y, expected, rtol=1e-4, atol=1e-4 * np.abs(expected).max())


def test_the_sides_agree_on_windows_over_the_picked_experts(library):
    """Theirs are our weights cut into experts: with tied logits over the picked experts and our
    windows on them, one function (float32 rounding apart)."""
    pairing = moe_peer.Pairing("tiny", 7, 13, 3)
    d = 29
    rng = np.random.default_rng(3)
    tensors = [moe_peer.layer_tensors(layer, None, 32) for layer in random_layers(rng, d, pairing.hidden)]
    ours = moe_peer.op_session(moe_peer.ours_model(tensors, pairing, None), 1)
    theirs = moe_peer.op_session(moe_peer.theirs_model(tensors, pairing, None), 1, kernel=False)
    ours_feeds, theirs_feeds = moe_peer.aligned_routing(rng, pairing, LAYERS, tokens=5, d=d)
    y_ours, y_theirs = ours.run(["Y"], ours_feeds)[0], theirs.run(["Y"], theirs_feeds)[0]
    assert moe_peer.relative_difference(y_ours, y_theirs) < moe_peer.SAME_FUNCTION_TOL
    # Elsewhere they differ: theirs weights by the softmax, ours by the windows' coverage.
    random_logits = {n: (rng.standard_normal(v.shape)).astype(np.float32) if n.startswith("logits") else v
                     for n, v in theirs_feeds.items()}
    assert moe_peer.relative_difference(y_ours, theirs.run(["Y"], random_logits)[0]) > 1e-2


def test_disjoint_starts_cover_exactly_k_windows():
    rng = np.random.default_rng(4)
    h, r, k = 101, 9, 7
    starts = moe_peer.disjoint_starts(rng, 400, k, r, h)
    assert starts.shape == (400, k) and starts.min() >= 0 and starts.max() <= h - r
    assert all(moe_peer.union_units(row[None], r, h) == k * r for row in starts)
    assert starts.min() == 0 and starts.max() == h - r  # the edges are reachable
    assert moe_peer.union_units(starts, r, h) == h  # 400 tokens cover all of H
    with pytest.raises(moe_peer.InfMoEError, match="4 disjoint windows of 30 units do not fit in 100"):
        moe_peer.disjoint_starts(rng, 1, 4, 30, 100)


@pytest.mark.parametrize("name", list(moe_peer.PRECISIONS))
@pytest.mark.parametrize("pairing", list(moe_peer.PAIRINGS.values()), ids=list(moe_peer.PAIRINGS))
def test_active_bytes_differ_only_by_the_fc2_biases(name, pairing):
    """Equal active units at the benchmark's shape; theirs reads a bias of D per picked expert,
    ours one b_out."""
    assert pairing.hidden == moe_peer.H
    equal = moe_peer.active_bytes(pairing, moe_peer.PRECISIONS[name].bits)
    assert equal["active_units"] == pairing.k * pairing.units == 1536
    assert equal["theirs"] - equal["ours"] == (pairing.k - 1) * 4 * moe_peer.D


def test_a_call_reads_twice_the_cache_unless_told_its_layers():
    args = types.SimpleNamespace(layers=None)
    cache = 32 << 20
    for precision in moe_peer.PRECISIONS.values():
        layers = moe_peer.chain_length(args, precision, cache)
        one = moe_peer.active_bytes(moe_peer.PAIRINGS["4x1536"], precision.bits)["ours"]
        assert layers >= moe_peer.LAYERS and (layers - 1) * one < max(2 * cache, moe_peer.LAYERS * one) <= layers * one
    assert moe_peer.chain_length(args, moe_peer.PRECISIONS["int4"], cache) > 40  # 1.5 MB a layer at int4
    assert moe_peer.chain_length(types.SimpleNamespace(layers=3), moe_peer.PRECISIONS["int4"], cache) == 3


def test_prefill_runs_the_first_layers_of_a_long_chain(library):
    pairing = moe_peer.Pairing("3x64", 3, 64, 2)
    rng = np.random.default_rng(6)
    layers = moe_peer.LAYERS + 1
    tensors = [moe_peer.layer_tensors(moe_peer.random_layer(rng, moe_peer.D, pairing.hidden), 4, 32) for _ in range(layers)]
    results = {"unsupported": [], "same_function": [], "rows": []}
    args = types.SimpleNamespace(threads=1, rounds=2, prefill_rounds=1, batches=[1, 3], prefills=[5])
    moe_peer.measure(args, results, moe_peer.PRECISIONS["int4"], pairing, tensors, rng)
    assert [(r["phase"], r["tokens"], r["layers"]) for r in results["rows"]] == \
        [("decode", 1, layers), ("batched", 3, layers), ("prefill", 5, moe_peer.LAYERS)]
    assert all(r["speed"] > 0 and len(r["samples_ms_per_call"]["theirs"]) == (1 if r["phase"] == "prefill" else 2)
               for r in results["rows"])
    (check,) = results["same_function"]
    assert 0 < check["max_abs_difference_over_max_abs"] < 0.5  # int4 both, fc2 blocked along another axis


def test_an_unsupported_variant_is_recorded_in_one_line(library, monkeypatch, capsys):
    """onnxruntime refusing theirs (here an activation its CPU kernel lacks) is a line in the
    results, and the run goes on."""
    real = moe_peer.theirs_model

    def geglu(*args, **kwargs):
        model = real(*args, **kwargs)
        for node in model.graph.node:
            next(a for a in node.attribute if a.name == "activation_type").s = b"geglu"
        return model

    monkeypatch.setattr(moe_peer, "theirs_model", geglu)
    pairing = moe_peer.Pairing("3x64", 3, 64, 2)
    rng = np.random.default_rng(5)
    tensors = [moe_peer.layer_tensors(moe_peer.random_layer(rng, moe_peer.D, pairing.hidden), 4, 32)]
    results = {"unsupported": [], "same_function": [], "rows": []}
    args = types.SimpleNamespace(threads=1)
    moe_peer.measure(args, results, moe_peer.PRECISIONS["int4"], pairing, tensors, rng)
    (entry,) = results["unsupported"]
    assert entry["pairing"] == "3x64" and entry["precision"] == "int4"
    assert "geglu" in entry["error"] and "\n" not in entry["error"]
    assert not results["rows"] and "onnxruntime's op does not run here" in capsys.readouterr().out


@pytest.mark.parametrize("argv, flag", [(["--precisions", "int4,int3"], "--precisions"), (["--rounds", "0"], "--rounds"),
                                        (["--layers", "0"], "--layers"), (["--pairing", "8x768"], "--pairing"),
                                        (["--batches", "1,,4"], "--batches")])
def test_bad_arguments_are_one_line_errors(argv, flag, capsys):
    with pytest.raises(SystemExit) as exit_info:
        moe_peer.parse(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flag}" in err.strip().splitlines()[-1] and "Traceback" not in err, err


def test_quick_run_writes_its_results(library, tmp_path):
    path = tmp_path / "results" / "moe_peer.json"
    done = subprocess.run([sys.executable, "-m", "benchmarks.moe_peer", "--quick", "--precisions", "fp32,int4",
                           "--json", str(path)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    saved = json.loads(path.read_text())
    assert [p.name for p in path.parent.iterdir()] == ["moe_peer.json"]  # no temporary file left
    assert saved["benchmark"] == "moe_peer" and len(saved["machine"]["load_average"]) == 3
    assert len(saved["load_average_at_start"]) == 3 and saved["options"]["quick"]
    assert saved["unsupported"] == []
    measured = {(r["pairing"], r["precision"], r["phase"], r["tokens"]) for r in saved["rows"]}
    assert measured == {(p, q, phase, t) for p in moe_peer.PAIRINGS for q in ("fp32", "int4")
                        for phase, t in (("decode", 1), ("prefill", 128))}
    for row in saved["rows"]:
        assert row["speed"] > 0 and row["ours_ms_per_layer"] > 0 and row["theirs_ms_per_layer"] > 0
        assert len(row["samples_ms_per_call"]["ours"]) == moe_peer.QUICK["rounds" if row["tokens"] == 1 else "prefill_rounds"]
    checks = {(c["pairing"], c["precision"]): c["max_abs_difference_over_max_abs"] for c in saved["same_function"]}
    assert all(checks[(p, "fp32")] < moe_peer.SAME_FUNCTION_TOL for p in moe_peer.PAIRINGS)
    for row in saved["rows"]:
        pairing = moe_peer.PAIRINGS[row["pairing"]]
        touched, layers = row["touched_per_layer"], saved["layer"]["layers_per_call"][row["precision"]]
        assert row["layers"] == min(layers, moe_peer.LAYERS) if row["phase"] == "prefill" else layers
        assert layers == moe_peer.QUICK["layers"]
        if row["tokens"] == 1:  # one token reads its k experts, and its K windows: as many units
            assert touched["theirs_experts"] == pairing.k and touched["ours_units"] == pairing.k * pairing.units
        else:
            assert pairing.k * pairing.units < touched["ours_units"] <= moe_peer.H
    assert "goals" in saved and "at int4" in done.stdout
