"""The conventional MoE's ONNX export (export/moe.py): onnxruntime's com.microsoft MoE / QMoE per
layer with a standard-op fallback function, against the PyTorch reference (level 1 at int8 /
int4: the reference on the dequantized weights), in onnxruntime's kernel and on the function;
ties of the router (lowest index, spec §7) through the reversed experts; batch rows, the KV cache,
validation, parity, the clients' folder, and the refusals.

Tiny random checkpoints of odd shapes (d_model 15, E = 3 experts of 37 units: QMoE pads both to
its block size), each with two router rows made equal in layer 0, so that ties decide experts."""

import copy
import dataclasses
import json
import shutil

import numpy as np
import onnx
import pytest
import torch

from infmoe_export.checkpoint import load_checkpoint, require_arch, save_checkpoint
from infmoe_export.contract import ExportedModel
from infmoe_export.errors import InfMoEError
from infmoe_export.export import export_onnx
from infmoe_export.export.function import moe_op_model
from infmoe_export.export.inspection import inspect_model
from infmoe_export.model import InfMoEConfig
from infmoe_export.quant import QuantizedWeight
from infmoe_export.runtimes.generate import generate
from infmoe_export.runtimes.ort import OrtRunner, create_session
from infmoe_export.runtimes.ort_moe import fallback_copy
from infmoe_export.runtimes.torch_runner import TorchRunner
from infmoe_export.verify.validate import validate_onnx

from conftest import TINY, genai_generate, random_model
from test_moe_model import moe_config

# case: (config overrides, dtype, target, with_starts). Together: top_k 1 and 2, both routing
# weights of MoE, QMoE's with its "all" scaled in the graph, int8 and int4, both targets
# (onnxruntime's attention needs head_dim a multiple of 8: d_model 24 there, and vocab 256 for
# onnxruntime-genai). Four exports: each takes seconds.
CASES = {
    "fp32-top2-selected": (dict(top_k=2, router_softmax="selected"), "fp32", "portable", True),
    "int4-top2-all": (dict(top_k=2, router_softmax="all"), "int4", "portable", False),
    "ort-fp32-top1-all": (dict(top_k=1, router_softmax="all", d_model=24, vocab_size=256), "fp32", "onnxruntime",
                          False),
    "ort-int8-top1-selected": (dict(top_k=1, router_softmax="selected", d_model=24, vocab_size=256), "int8",
                               "onnxruntime", False),
}
TIED = {1: (0, 2), 2: (1, 2)}  # layer 0's router rows made equal, per top_k


def tied_model(overrides, seed=0):
    """Layer 0's router rows: the tied two equal, the third their negative, so that for about
    half the tokens exactly one of the tied two is among the top_k (the tie decides which)."""
    model = random_model(moe_config(**overrides), seed=seed)
    low, high = TIED[model.config.top_k]
    router = model.h[0].moe.router.weight
    with torch.no_grad():
        router[high] = router[low]
        router[3 - low - high] = -router[low]
    return model


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    """case -> (the float model, its ExportedModel), each exported once."""
    folder = tmp_path_factory.mktemp("moe")
    out = {}
    for seed, (case, (overrides, dtype, target, starts)) in enumerate(CASES.items()):
        model = tied_model(overrides, seed)
        out[case] = model, export_onnx(model, folder / f"{case}.onnx", dtype=dtype, target=target, with_starts=starts,
                                       quantize_other=dtype if dtype != "fp32" else "none")
    return out


def left_padded(exported, lengths=(9, 4, 7), seed=0):
    """A left-padded batch of random rows (pad id 5), prefill: (feed, real-token mask [B, T])."""
    rng = np.random.default_rng(seed)
    T = max(lengths)
    ids = np.full((len(lengths), T), 5, np.int64)
    mask = np.zeros((len(lengths), T), np.int64)
    for b, n in enumerate(lengths):
        ids[b, T - n:] = rng.integers(0, 256, n)
        mask[b, T - n:] = 1
    return exported.io.feed(ids, mask), mask.astype(bool)


def run(session, feed):
    return dict(zip([o.name for o in session.get_outputs()], session.run(None, dict(feed))))


def reference(model, exported, feed, quantized=True):
    """The level-1 reference (the dequantized model at int8 / int4) or the float one."""
    io = exported.io if quantized else dataclasses.replace(exported.io, dtype="fp32", quantize_other="none", activations="float")
    with TorchRunner(io, model) as runner:
        return runner.infer(feed, check_inputs=False)


@pytest.mark.parametrize("case", CASES)
def test_logits_match_the_reference_in_the_kernel_and_on_the_function(exports, case):
    model, exported = exports[case]
    feed, real = left_padded(exported)
    want = reference(model, exported, feed)
    kernel = run(create_session(exported), feed)
    fallback = run(create_session(exported, kernel=False), feed)
    for got in (kernel, fallback):
        assert np.abs(got["logits"] - want["logits"])[real].max() < 2e-5
    if exported.io.with_starts:  # the graph's experts: the reference's, ties included
        for layer in range(2):
            assert np.array_equal(kernel[f"expert_starts.{layer}"][real], want[f"expert_starts.{layer}"][real])
    if exported.io.quantized:  # level 1 is not level 2: the float model is far from both
        float_logits = reference(model, exported, feed, quantized=False)["logits"]
        assert np.abs(kernel["logits"] - float_logits)[real].max() > 1e-2


@pytest.mark.parametrize("case", CASES)
def test_ties_go_to_the_lowest_index(exports, case):
    """Layer 0's tied router rows leave the choice between the two experts to the tie rule for
    many tokens: the reference picks the lower index, and so must the graph, whose experts are
    stored reversed because onnxruntime's kernel gives ties to the highest. The other rule (the
    two experts' weights swapped) gives other logits on those tokens, so the graph's are the
    reference's only under the right rule."""
    model, exported = exports[case]
    feed, real = left_padded(exported, seed=1)
    low, high = TIED[model.config.top_k]
    with TorchRunner(dataclasses.replace(exported.io, with_starts=True), model) as runner:
        want = runner.infer(feed, check_inputs=False)
    experts = want["expert_starts.0"][real]
    decided = (experts == low).any(axis=-1) != (experts == high).any(axis=-1)
    assert decided.sum() >= 3 and (experts[decided] == low).any(axis=-1).all()
    swapped = copy.deepcopy(model)
    with torch.no_grad():
        for name in ("w_in", "b_in", "w_out", "b_out"):
            weights = getattr(swapped.h[0].moe, name)
            weights[[low, high]] = weights[[high, low]].clone()
    with TorchRunner(exported.io, swapped) as runner:
        other = runner.infer(feed, check_inputs=False)["logits"][real]
    got = run(create_session(exported), feed)["logits"][real]
    assert np.abs(got - want["logits"][real]).max() < 2e-5
    assert np.abs(got - other)[decided].max(axis=-1).min() > 1e-3


def test_the_function_follows_the_kernel_on_ties_and_routing_weights():
    """One node of onnxruntime's MoE / QMoE against its fallback function (inlined), on router
    logits full of ties, at both normalize_routing_weights, top 1 and 2 of 4 experts."""
    rng = np.random.default_rng(4)
    E, I, D, N = 4, 32, 16, 60
    logits = rng.integers(0, 3, (N, E)).astype(np.float32)
    x = rng.standard_normal((N, D)).astype(np.float32)
    w1, w2 = rng.standard_normal((E, I, D)).astype(np.float32), rng.standard_normal((E, D, I)).astype(np.float32)
    b1, b2 = rng.standard_normal((E, I)).astype(np.float32), rng.standard_normal((E, D)).astype(np.float32)
    q1, q2 = (QuantizedWeight.of(torch.from_numpy(w.reshape(-1, w.shape[-1])), 4, 16) for w in (w1, w2))
    for k in (1, 2):
        for normalize in (0, 1):
            for bits in (None, 4):
                feed = {"input": x, "router_probs": logits, "fc1_experts_bias": b1, "fc2_experts_bias": b2}
                if bits:
                    feed.update(fc1_experts_weights=q1.packed.numpy().reshape(E, I, -1),
                                fc1_scales=q1.scale.numpy().reshape(E, I, -1),
                                fc2_experts_weights=q2.packed.numpy().reshape(E, D, -1),
                                fc2_scales=q2.scale.numpy().reshape(E, D, -1))
                else:
                    feed.update(fc1_experts_weights=w1, fc2_experts_weights=w2)
                model = moe_op_model(k, normalize, bits, 16, with_function=True)
                inlined = onnx.inliner.inline_local_functions(model)
                assert not any(n.domain == "com.microsoft" for n in inlined.graph.node)
                y = [ort_run(m, feed) for m in (model, inlined)]
                assert np.abs(y[0] - y[1]).max() < 1e-4 * np.abs(y[0]).max(), (k, normalize, bits)


def ort_run(model, feed):
    import onnxruntime as ort

    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, feed)[0]


def test_the_fallback_session_runs_no_moe_kernel(exports):
    _, exported = exports["int4-top2-all"]
    copy = fallback_copy(exported.path)
    try:
        nodes = onnx.load(str(copy)).graph.node
        assert not any(n.domain == "com.microsoft" for n in nodes) and not list(onnx.load(str(copy)).functions)
    finally:
        copy.unlink()
    assert sorted(p.name for p in exported.path.parent.iterdir() if exported.path.stem in p.name) == \
        [exported.path.name]


@pytest.mark.parametrize("case", ["int4-top2-all", "ort-int8-top1-selected"])
def test_batch_rows_equal_rows_alone(exports, case):
    _, exported = exports[case]
    lengths = (9, 4, 7)
    feed, real = left_padded(exported, lengths, seed=2)
    session = create_session(exported)
    batch = run(session, feed)["logits"]
    T = max(lengths)
    for b, n in enumerate(lengths):
        alone = run(session, exported.io.feed(feed["input_ids"][b:b + 1, T - n:], np.ones((1, n), np.int64)))
        assert np.abs(batch[b, T - n:] - alone["logits"][0]).max() < 1e-5


@pytest.mark.parametrize("case", ["int4-top2-all", "ort-fp32-top1-all"])
def test_kv_cache_decode_equals_the_full_forward(exports, case):
    _, exported = exports[case]
    ids = np.random.default_rng(3).integers(0, 256, (1, 11))
    session = create_session(exported)
    full = run(session, exported.feed(ids))["logits"]
    out = run(session, exported.feed(ids[:, :6]))
    steps = [out["logits"]]
    for t in range(6, 11):
        past = {n: v for n, v in out.items() if n.startswith("present.")}
        out = run(session, exported.feed(ids[:, t:t + 1], past=past))
        steps.append(out["logits"])
    assert np.abs(np.concatenate(steps, axis=1) - full).max() < 1e-5


def test_validation_covers_every_case(exports):
    for case, (model, exported) in exports.items():
        report = validate_onnx(model, exported)
        assert report.passed and report.start_agreement == 1.0, case
        if exported.io.quantized:
            assert report.level2["top1_agreement"] < 1 or report.level2["logit_error"]["max"] > 1e-3


def test_parity_levels_1_and_2_in_the_kernel_and_on_the_function(exports, tmp_path, run_cli):
    model, exported = exports["int4-top2-all"]
    checkpoint = save_checkpoint(model, tmp_path / "ckpt")
    text = tmp_path / "text.txt"
    text.write_text("def f(x):\n    return x * 2 + 1\n" * 8)
    code, out, err = run_cli("parity", "--checkpoint", checkpoint, "--model", exported.path, "--out", tmp_path / "p",
                             "--text", text, "--max-windows", 2, "--backends", "ort,ort-fallback",
                             "--max-ppl-increase", 50, "--min-top1", 0.5)
    assert code == 0, err
    report = json.loads((tmp_path / "p" / "report.json").read_text())
    rows = {r["backend"]: r for r in report["parity"]["results"]}
    passed = [v["text"] for v in report["verdicts"] if v["status"] == "passed"]
    assert len(passed) == 2 and all(text.startswith("top-2; max |Δlogit| ") for text in passed)  # no K, no noise
    for backend in ("ort", "ort-fallback"):
        assert rows[backend]["level1"] == "pass" and rows[backend]["level2"] == "pass"
        assert rows[backend]["error_all"]["max"] < 1e-4 and rows[backend]["perplexity_increase"] != 0


def test_the_folder_runs_in_onnxruntime_genai_and_optimum(exports, tmp_path):
    pytest.importorskip("onnxruntime_genai")
    optimum_ort = pytest.importorskip("optimum.onnxruntime")
    from infmoe_export.export.hf_folder import MODEL_FILE, write_hf_folder

    _, exported = exports["ort-fp32-top1-all"]
    folder = tmp_path / "folder"
    folder.mkdir()
    shutil.copyfile(exported.path, folder / MODEL_FILE)
    write_hf_folder(folder, ExportedModel.read(folder / MODEL_FILE))
    prompt, new = list(b"def f(x):"), 8
    with OrtRunner(exported.io, exported) as runner:
        want = generate(runner, prompt, new)
    assert genai_generate(folder, [prompt], new) == [want]
    optimum = optimum_ort.ORTModelForCausalLM.from_pretrained(folder)
    ids = torch.tensor([prompt])
    assert optimum.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                            do_sample=False)[0, len(prompt):].tolist() == want


def test_inspect_counts_the_moe_nodes(exports):
    _, exported = exports["ort-int8-top1-selected"]
    found = inspect_model(exported.path)
    assert found.op_nodes == 2 and found.has_function and not found.problems


def test_an_odd_model_pads_to_the_block_size_exactly(exports):
    """d_model 15 and 37 units an expert: QMoE's fc1 and fc2 are stored at 32 and 64 columns."""
    _, exported = exports["int4-top2-all"]
    weights = {t.name: list(t.dims) for t in onnx.load(str(exported.path)).graph.initializer}
    assert weights["h.0.moe.fc1_experts_weights"] == [3, 64, 16] and weights["h.0.moe.fc2_experts_weights"] == [3, 32, 32]


# ---------------------------------------------------------------------------------------------
# Refusals: one line, nothing written


@pytest.mark.parametrize("args, problem", [
    (["--k", "3"], "expert budget K = 3 does not apply to a conventional MoE"),
    (["--noise", "sampled"], "sampled noise does not apply to a conventional MoE"),
    (["--dtype", "fp16"], "a conventional MoE is exported at fp32, int8, int4, not fp16"),
    (["--target", "tensorrt"], "a conventional MoE is exported for portable or onnxruntime, not tensorrt"),
])
def test_the_export_refuses_what_a_conventional_moe_has_not(tmp_path, run_cli, args, problem):
    checkpoint = save_checkpoint(random_model(moe_config()), tmp_path / "moe")
    code, _, err = run_cli("onnx", "--checkpoint", checkpoint, "--out", tmp_path / "m.onnx", *args)
    assert code == 1 and err.count("\n") == 1 and problem in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["moe"]


def test_an_export_of_one_architecture_is_refused_with_the_other_checkpoint(exports, tmp_path, run_cli):
    _, exported = exports["ort-int8-top1-selected"]
    infmoe = save_checkpoint(random_model(InfMoEConfig(**TINY)), tmp_path / "infmoe")
    code, _, err = run_cli("parity", "--checkpoint", infmoe, "--model", exported.path, "--out", tmp_path / "p")
    assert code == 1 and err.count("\n") == 1
    assert "needs a conventional top-k MoE checkpoint" in err and "model_type 'infmoe-gpt2'" in err
    with pytest.raises(InfMoEError, match="needs an ∞-MoE checkpoint"):
        require_arch(load_checkpoint(save_checkpoint(random_model(moe_config()), tmp_path / "moe")), "infmoe-gpt2",
                     "the ∞-MoE export")
