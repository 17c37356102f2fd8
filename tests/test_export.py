"""ONNX export: whole exported models in onnxruntime (fallback function, no kernel) against the
reference model, the graph's structure, and the CLI's handling of bad input. The fallback
function alone, against every other implementation of the op, is a row of
tests/test_op_conformance.py. Exports are slow (torch.export), so each is made once
per module and checked for several things."""

import json

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper

from infmoe_export.errors import InfMoEError
from infmoe_export.contract import DecoderIO, ExportedModel
from infmoe_export.export import export_onnx, exporter
from infmoe_export.verify.validate import validate_onnx
from infmoe_export.model import InfMoEConfig
from infmoe_export.runtimes.ort import create_session

from conftest import TINY, random_model


# ---------------------------------------------------------------------------------------------
# Whole models


@pytest.fixture(scope="module")
def tiny_model():
    return random_model(InfMoEConfig(**TINY), seed=11)


@pytest.fixture(scope="module")
def onnx_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("export")


@pytest.fixture(scope="module")
def quantile_k3(tiny_model, onnx_dir):
    """K = 3, quantile noise, with past: the default kind of export."""
    return export_onnx(tiny_model, onnx_dir / "quantile_k3.onnx", k=3).path


@pytest.fixture(scope="module")
def sampled_k1_nopast(tiny_model, onnx_dir):
    return export_onnx(tiny_model, onnx_dir / "sampled_k1.onnx", k=1, noise="sampled", past=False, with_starts=True).path


def _left_padded_feed(decoder_io, batch=2, sequence=None, seed=0):
    sequence = sequence or decoder_io.config.n_positions  # the longest sequence the model takes
    return decoder_io.dummy_inputs(batch=batch, sequence=sequence, past_sequence=0, left_pad=5, seed=seed)


def _reference(model, decoder_io, feed):
    noise = torch.from_numpy(feed["expert_noise"]) if "expert_noise" in feed else None
    with torch.no_grad():
        out = model(torch.from_numpy(feed["input_ids"]), torch.from_numpy(feed["attention_mask"]), k=decoder_io.k,
                    noise=decoder_io.noise, expert_noise=noise, return_starts=True)
    return out


@pytest.mark.parametrize("which", ["quantile_k3", "sampled_k1_nopast"])
def test_fallback_matches_reference(request, tiny_model, which):
    """Left-padded batch 2 at full length: logits within 1e-4 over tokens whose starts agree,
    >= 99.9% of starts equal; then validate_onnx (prefill + decode) passes."""
    path = request.getfixturevalue(which)
    decoder_io = ExportedModel.read(path).io
    onnx.checker.check_model(onnx.load(str(path)), full_check=True)
    session = create_session(path, kernel=False)
    # A copy with every layer's starts as outputs (the quantile model does not have them).
    report = validate_onnx(tiny_model, path, kernel=False, sequence=TINY["n_positions"] - 1)
    assert report.passed and report.start_agreement >= 0.999
    assert all(row.max_abs_agreeing <= 1e-4 for row in report.outputs)

    feed = _left_padded_feed(decoder_io)
    logits = dict(zip([o.name for o in session.get_outputs()], session.run(None, dict(feed))))["logits"]
    expected = _reference(tiny_model, decoder_io, feed)
    if decoder_io.with_starts:
        actual_starts = session.run([f"expert_starts.{i}" for i in range(decoder_io.config.n_layer)], dict(feed))
        agree = np.stack([a == s.numpy() for a, s in zip(actual_starts, expected.starts)]).all(axis=(0, -1))
        assert agree.mean() >= 0.999
    else:
        agree = np.ones(logits.shape[:2], bool)
    assert np.abs(logits - expected.logits.numpy())[agree].max() <= 1e-4
    assert np.unique(np.concatenate([s.numpy().ravel() for s in expected.starts])).size > 2  # starts spread


def test_validation_fails_on_a_wrong_model(quantile_k3, tiny_model):
    """The check can fail: other weights (same config) give other logits and windows that no
    rounding explains; the file is kept and named. A tolerance below float32 noise fails too."""
    other = random_model(tiny_model.config, seed=12)
    report = validate_onnx(other, quantile_k3, kernel=False, raise_on_failure=False)
    assert not report.passed
    assert any("present.0.key differs" in p for p in report.problems)  # layer 0 depends on no starts
    assert any("differ by more than rounding" in p for p in report.problems)
    with pytest.raises(InfMoEError, match="file kept"):
        validate_onnx(other, quantile_k3, kernel=False)
    assert quantile_k3.is_file()
    strict = validate_onnx(tiny_model, quantile_k3, kernel=False, atol=1e-12, raise_on_failure=False)
    assert not strict.passed and "atol 1e-12" in strict.problems[0]


def test_graph_structure(quantile_k3, tiny_model):
    model = onnx.load(str(quantile_k3))
    c = tiny_model.config
    nodes = [n for n in model.graph.node if n.domain == "infmoe"]
    assert len(nodes) == c.n_layer and {n.op_type for n in nodes} == {"ContinuousSliceFFN"}
    producers = {out: n for n in model.graph.node for out in n.output}
    initializers = {t.name: t for t in model.graph.initializer}
    for node in nodes:
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        assert attrs == {"slice_width": c.slice_width, "activation": b"gelu_tanh", "plugin_namespace": b"infmoe",
                         "plugin_version": b"1"}
        assert len(node.input) == 6 and len(node.output) == 1
        shapes = [list(initializers[name].dims) for name in node.input[2:]]
        assert shapes == [[c.ffn_hidden, c.d_model], [c.ffn_hidden], [c.ffn_hidden, c.d_model], [c.d_model]]
        # starts = Cast(Clip(Floor(Mul(Sigmoid(z), H - r + 1)), max=H - r)): window_starts' op order.
        chain, name = [], node.input[1]
        for _ in range(5):
            producer = producers[name]
            chain.append(producer.op_type)
            name = producer.input[0]
        assert chain == ["Cast", "Clip", "Floor", "Mul", "Sigmoid"]
    assert [f.name for f in model.functions] == ["ContinuousSliceFFN"] and model.functions[0].domain == "infmoe"
    assert {o.domain: o.version for o in model.opset_import} == {"": 18, "infmoe": 1}
    dims = {v.name: [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim]
            for v in list(model.graph.input) + list(model.graph.output)}
    assert dims["input_ids"] == ["batch", "sequence"]
    assert dims["attention_mask"] == ["batch", "past_sequence + sequence"]
    assert dims["past_key_values.1.value"] == ["batch", c.n_head, "past_sequence", c.head_dim]
    assert dims["present.0.key"] == ["batch", c.n_head, "past_sequence + sequence", c.head_dim]
    assert dims["logits"] == ["batch", "sequence", c.vocab_size]
    assert list(dims) == DecoderIO(c, 3).input_names + DecoderIO(c, 3).output_names

    meta = {p.key: p.value for p in model.metadata_props}
    assert json.loads(meta["infmoe.config"]) == c.to_dict()
    assert (meta["infmoe.k"], meta["infmoe.noise"], meta["infmoe.dtype"], meta["infmoe.opset"],
            meta["infmoe.has_function"], meta["infmoe.past"]) == ("3", "quantile", "fp32", "18", "1", "1")
    assert meta["infmoe.exporter_version"]


def test_graph_hygiene(quantile_k3, sampled_k1_nopast, tiny_model):
    """What tools beyond onnxruntime need (issue 11): weights named after the checkpoint's
    tensors, no per-node metadata or paths of the exporting machine, graph outputs nobody else
    reads, and dims that onnxruntime's symbolic shape inference resolves without auto_merge."""
    from onnxruntime.tools.symbolic_shape_infer import SymbolicShapeInference

    params = {name: p.detach().numpy() for name, p in tiny_model.state_dict().items()}
    for path in (quantile_k3, sampled_k1_nopast):
        model = onnx.load(str(path))
        graph = model.graph
        for tensor in graph.initializer:
            array = onnx.numpy_helper.to_array(tensor)
            if array.size <= 3:  # shapes, axes, scalars and the quantile noise are not parameters
                continue
            name = tensor.name[:-2] if tensor.name.endswith(".T") else tensor.name
            assert name in params, f"initializer {tensor.name} is not named after a checkpoint tensor"
            expected = params[name].T if tensor.name.endswith(".T") else params[name]
            np.testing.assert_array_equal(array, expected)
        assert "h.0.attn.qkv.weight.T" in {t.name for t in graph.initializer}
        assert not [n.name for n in graph.node if n.metadata_props]
        assert not [v.name for v in graph.value_info if v.metadata_props]
        raw = path.read_bytes()
        for leak in (b"stack_trace", b"site-packages", b"/work/", b"/home/", b"/tmp/", b"pkg.torch"):
            assert leak not in raw, leak
        names = [n.name for n in graph.node]
        assert len(set(names)) == len(names) and "/h.0/attn/qkv/MatMul" in names
        outputs = {o.name for o in graph.output}
        assert not [i for n in graph.node for i in n.input if i in outputs], "a graph output is consumed"
        inferred = SymbolicShapeInference.infer_shapes(model, auto_merge=False)  # raises when incomplete
        dims = {v.name: [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim] for v in inferred.graph.output}
        assert dims["logits"] == ["batch", "sequence", tiny_model.config.vocab_size]
    # the rewritten position slice ([:, -sequence:]) still matches the reference on a left-padded
    # decode step with a non-empty cache: covered by test_decode_with_past_equals_full_forward


def test_decode_with_past_equals_full_forward(quantile_k3):
    """Prefill 6 tokens, then 4 decode steps feeding present -> past: the logits of every real
    token equal those of one pass over all 10 tokens (a left-padded row included)."""
    decoder_io = ExportedModel.read(quantile_k3).io
    session = create_session(quantile_k3, kernel=False)
    names = [o.name for o in session.get_outputs()]
    full = decoder_io.dummy_inputs(batch=2, sequence=10, past_sequence=0, left_pad=3, seed=5)
    ids, mask = full["input_ids"], full["attention_mask"]
    expected = session.run(["logits"], dict(full))[0]
    out = dict(zip(names, session.run(None, dict(decoder_io.feed(ids[:, :6], mask[:, :6])))))
    steps = [out["logits"]]
    for t in range(6, 10):
        past = [out[n.replace("past_key_values", "present")] for n in decoder_io.past_names]
        out = dict(zip(names, session.run(None, dict(decoder_io.feed(ids[:, t:t + 1], mask[:, :t + 1], past)))))
        steps.append(out["logits"])
    # Padded positions attend to nothing, so their (unused) logits depend on the step; skip them.
    real = mask.astype(bool)
    assert np.abs(np.concatenate(steps, axis=1) - expected)[real].max() <= 1e-4


def test_sampled_noise_is_an_input(sampled_k1_nopast, tiny_model):
    model = onnx.load(str(sampled_k1_nopast))
    inputs = {v.name: [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim] for v in model.graph.input}
    assert inputs == {"input_ids": ["batch", "sequence"], "attention_mask": ["batch", "sequence"],
                      "expert_noise": ["batch", "sequence", 1]}
    outputs = [v.name for v in model.graph.output]
    assert outputs == ["logits"] + [f"expert_starts.{i}" for i in range(tiny_model.config.n_layer)]
    # Different noise, different windows: the input is really used.
    session = create_session(sampled_k1_nopast, kernel=False)
    decoder_io = ExportedModel.read(sampled_k1_nopast).io
    feed = dict(decoder_io.dummy_inputs(sequence=9, past_sequence=0, seed=1))
    first = session.run(["expert_starts.0"], feed)[0]
    feed["expert_noise"] = -feed["expert_noise"]
    assert (session.run(["expert_starts.0"], feed)[0] != first).any()


def test_fp16_export(tiny_model, onnx_dir):
    """fp16 expert part (FFN weights and op), fp32 elsewhere (see docs/guide/export.md). Tolerance:
    5e-2 on logits of order 1-10 over tokens whose windows agree, >= 95% of starts agree."""
    path = export_onnx(tiny_model, onnx_dir / "fp16.onnx", k=3, noise="sampled", dtype="fp16").path
    model = onnx.load(str(path))
    onnx.checker.check_model(model, full_check=True)
    assert {t.data_type for t in model.graph.initializer if t.name.endswith("w_in")} == {TensorProto.FLOAT16}
    report = validate_onnx(tiny_model, path, kernel=False, raise_on_failure=False,
                           sequence=TINY["n_positions"] - 1)
    assert report.passed, report.problems
    assert report.start_agreement >= 0.95
    logits_error = max(r.max_abs_agreeing for r in report.outputs if r.name == "logits")
    assert 0 < logits_error <= 5e-2  # > 0: the graph really computes in fp16


def test_dense_exports_plain_matmuls_with_external_data(make_model, tmp_path, monkeypatch):
    """slice_width == ffn_hidden: no custom op, no function; forced external data still loads."""
    model = make_model(slice_width=TINY["ffn_hidden"], seed=3)
    monkeypatch.setattr(exporter, "EXTERNAL_DATA_BYTES", 0)
    path = export_onnx(model, tmp_path / "dense.onnx", k=2, opset=20).path
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dense.onnx", "dense.onnx.data"]
    proto = onnx.load(str(path), load_external_data=False)
    assert not [n for n in proto.graph.node if n.domain == "infmoe"] and not proto.functions
    assert {p.key: p.value for p in proto.metadata_props}["infmoe.has_function"] == "0"
    assert validate_onnx(model, path, kernel=False).passed


def test_failed_save_leaves_no_file(tmp_path, monkeypatch):
    """A write that dies half-way (disk full) leaves neither the model nor its data file."""
    import onnx_ir as ir

    def broken_save(model, path, external_data=None):
        path.write_bytes(b"partial")
        (path.parent / external_data).write_bytes(b"partial")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(exporter.ir, "save", broken_save)
    monkeypatch.setattr(exporter, "EXTERNAL_DATA_BYTES", -1)  # the external-data path, on an empty graph
    graph = ir.Graph([], [], nodes=[], name="empty")
    with pytest.raises(InfMoEError, match="No space left"):
        exporter.save_model(ir.Model(graph, ir_version=10), tmp_path / "m.onnx")
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------------------------------------
# The command


def test_cli_export_without_function(make_checkpoint, tmp_path, run_cli):
    ckpt = make_checkpoint(seed=4)
    out = tmp_path / "out" / "model.onnx"
    code, _, err = run_cli("onnx", "--checkpoint", ckpt, "--out", out, "--k", 2, "--no-function", "--with-starts",
                           "--opset", 23, "--no-validate")
    assert code == 0, err
    model = onnx.load(str(out))
    assert not model.functions and {o.domain: o.version for o in model.opset_import}[""] == 23
    assert [v.name for v in model.graph.output][-1] == f"expert_starts.{TINY['n_layer'] - 1}"


@pytest.mark.parametrize("args, message", [
    (["--checkpoint", "{tmp}/missing"], "is not a checkpoint"),
    (["--k", "0"], "--k must be a positive integer"),
    (["--out", "{tmp}"], "holds or lies inside this command's input"),  # the folder of the checkpoint
    (["--out", "{tmp}/user"], "infmoe-export did not write"),   # a folder holding the user's files
    (["--out", "{tmp}/file.txt"], "exists and is not a directory"),  # no .onnx suffix: a folder
    (["--out", "{tmp}/file.txt/model.onnx"], "is not a directory"),
    (["--opset", "17"], "opset 17 is not supported"),
    (["--opset", "99"], "opset 99 is not supported"),
    (["--noise", "gaussian"], "Invalid value for '--noise'"),
])
def test_cli_bad_input(make_checkpoint, tmp_path, run_cli, args, message):
    ckpt = make_checkpoint()
    (tmp_path / "file.txt").write_text("not a directory")
    (tmp_path / "user").mkdir()
    (tmp_path / "user" / "notes.txt").write_text("the user's")
    before = sorted(tmp_path.rglob("*"))
    args = [a.format(tmp=tmp_path) for a in args]
    base = ["onnx", "--checkpoint", ckpt, "--out", tmp_path / "model.onnx"]
    code, out, err = run_cli(*base, *args)
    assert code != 0
    assert message in err and "Traceback" not in err
    if "Invalid value" not in message:  # click's own usage errors take two lines
        assert len(err.strip().splitlines()) == 1 and err.startswith("error: ")
    assert sorted(tmp_path.rglob("*")) == before  # nothing written, not even a temporary file


@pytest.mark.skipif(__import__("os").geteuid() == 0, reason="root writes into read-only directories")
def test_cli_unwritable_directory(make_checkpoint, tmp_path, run_cli):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    code, _, err = run_cli("onnx", "--checkpoint", make_checkpoint(), "--out", locked / "m.onnx")
    assert code != 0 and err.startswith("error: cannot write") and not list(locked.iterdir())
