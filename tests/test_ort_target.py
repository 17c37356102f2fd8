"""Export targets (docs/guide/export.md, The export choice): each target's export against the
PyTorch reference (validate_onnx: a left-padded batch-2 prefill, then a decode step), the
onnxruntime target's graph, the shared-buffer runner against the plain one, and the clients on the
onnxruntime target (Optimum, onnxruntime-genai with past_present_share_buffer, Polygraphy)."""

import collections
import json
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import onnx
import onnxruntime
import pytest

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

from infmoe_export.checkpoint import save_checkpoint  # noqa: E402
from infmoe_export.contract import TARGETS, ExportedModel  # noqa: E402
from infmoe_export.errors import InfMoEError  # noqa: E402
from infmoe_export.export import export_onnx  # noqa: E402
from infmoe_export.export.hf_folder import write_hf_folder  # noqa: E402
from infmoe_export.model import InfMoEConfig  # noqa: E402
from infmoe_export.options import export_choices  # noqa: E402
from infmoe_export.runtimes.generate import generate  # noqa: E402
from infmoe_export.runtimes.ort import OrtRunner, SharedCache  # noqa: E402
from infmoe_export.runtimes import ort_kernel  # noqa: E402
from infmoe_export.runtimes.ort_kernel import custom_op_library, register  # noqa: E402
from infmoe_export.verify.validate import validate_onnx  # noqa: E402

from conftest import TINY, genai_generate, random_model  # noqa: E402

# head_dim 8: GroupQueryAttention's smallest; V 256 for the clients' byte tokenizer.
CONFIG = InfMoEConfig(**{**TINY, "d_model": 16, "n_head": 2, "vocab_size": 256, "n_positions": 32})
PROMPTS = [b"def f(x):", b"import"]
NEW = 10


@pytest.fixture(scope="module")
def model():
    return random_model(CONFIG, seed=5)


@pytest.fixture(scope="module")
def exports(model, tmp_path_factory):
    """One model per target (quantile noise, K 2, with past), each in an exported folder."""
    out = {}
    for target in TARGETS:
        folder = tmp_path_factory.mktemp(target)
        out[target] = export_onnx(model, folder / "model.onnx", k=2, target=target)
        write_hf_folder(folder, out[target])
    return out


def _ops(path):
    graph = onnx.load(str(path)).graph
    return collections.Counter((node.domain or "", node.op_type) for node in graph.node)


@pytest.mark.parametrize("target", TARGETS)
def test_each_target_matches_the_reference(model, exports, target):
    exported = exports[target]
    assert exported.io.target == target and exported.metadata["infmoe.target"] == target
    assert ExportedModel.read(exported.path).io == exported.io
    report = validate_onnx(model, exported, kernel=False)  # raises on failure
    assert report.start_agreement > 0.9
    ops = _ops(exported.path)
    if target == "onnxruntime":
        assert ops[("infmoe", "DecoderAttention")] == CONFIG.n_layer
        assert _without_constant_transpose(ops) == _ort_target_ops(CONFIG.n_layer)
    else:  # standard ops and the expert op only: today's graph
        assert {domain for domain, _ in ops} == {"", "infmoe"}
        assert ops[("", "Concat")] >= 2 * CONFIG.n_layer  # the cache, concatenated each step


# The onnxruntime target's nodes (docs/guide/export.md, The export choice): every node costs a decode step
# ~0.3-0.7 µs in onnxruntime, so the graph must not grow back.
PER_LAYER = {("", "MatMul"): 2, ("infmoe", "DecoderAttention"): 1,
             ("infmoe", "SkipLayerNorm"): 2, ("infmoe", "WindowStarts"): 1,
             ("infmoe", "ContinuousSliceFFN"): 1}
ONCE = {("infmoe", "StepInputs"): 1, ("", "Gather"): 2, ("infmoe", "SkipLayerNorm"): 1, ("", "MatMul"): 1,
        ("", "Max"): 1, ("", "Neg"): 1, ("", "Reshape"): 1, ("", "Slice"): 1}  # the last four: logits_to_keep


def _ort_target_ops(n_layer):
    return collections.Counter({op: n * n_layer for op, n in PER_LAYER.items()}) + collections.Counter(ONCE)


def _without_constant_transpose(ops):
    """Some exports transpose the tied embedding for the LM head in the graph: a constant
    that onnxruntime folds."""
    assert ops[("", "Transpose")] <= 1
    return ops - collections.Counter({("", "Transpose"): ops[("", "Transpose")]})


def test_the_onnxruntime_target_keeps_its_node_count(exports, tmp_path):
    """7 nodes a layer (the qkv bias inside the attention) and 9 once (StepInputs, the
    embeddings, their SkipLayerNorm, the LM head, and the four that slice its input for
    logits_to_keep), as exported and after onnxruntime's optimizations (with the kernel, which
    keeps the expert op one node)."""
    assert sum(_ort_target_ops(CONFIG.n_layer).values()) == 7 * CONFIG.n_layer + 9
    assert _without_constant_transpose(_ops(exports["onnxruntime"].path)) == _ort_target_ops(CONFIG.n_layer)
    if custom_op_library() is None:
        pytest.skip("the compiled kernel is not installed")
    options = onnxruntime.SessionOptions()
    options.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    register(options)
    onnxruntime.InferenceSession(str(exports["onnxruntime"].path), options, providers=["CPUExecutionProvider"])
    assert _ops(tmp_path / "optimized.onnx") == _ort_target_ops(CONFIG.n_layer)


def test_a_cuda_session_leaves_the_cpu_only_ops_to_their_functions(exports, tmp_path, library):
    """Registered for a session with CUDA's provider, the library leaves out the ops that have a
    CPU kernel only, so their nodes run their functions (on the GPU there) instead of being pulled
    onto the CPU; the expert op keeps its kernel. Checked on the CPU: the same options, the
    optimized graph."""
    options = onnxruntime.SessionOptions()
    options.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    assert register(options, ["CUDAExecutionProvider", "CPUExecutionProvider"])
    onnxruntime.InferenceSession(str(exports["onnxruntime"].path), options, providers=["CPUExecutionProvider"])
    ops = _ops(tmp_path / "optimized.onnx")
    assert ops[("com.microsoft", "GroupQueryAttention")] == CONFIG.n_layer and ops[("", "Softplus")] == CONFIG.n_layer
    assert ops[("com.microsoft", "SkipLayerNormalization")] == 2 * CONFIG.n_layer + 1
    assert not ops[("infmoe", "DecoderAttention")] and not ops[("infmoe", "WindowStarts")]
    assert not ops[("infmoe", "SkipLayerNorm")]
    assert ops[("infmoe", "ContinuousSliceFFN")] == CONFIG.n_layer


@pytest.mark.parametrize("keep", [0, 1, 3, 7, 50, -2])
def test_logits_to_keep_gives_the_last_positions(exports, keep):
    """The onnxruntime target's optional logits_to_keep: not a required input (clients feed
    Optimum's), 0 by default (every position); n > 0 the last min(n, sequence) rows of the full
    logits, bit for bit (the same rows through the same head); n <= 0 every row."""
    exported = exports["onnxruntime"]
    with OrtRunner(exported.io, exported) as runner:
        session = runner.sess
        assert "logits_to_keep" not in {i.name for i in session.get_inputs()}
        assert "logits_to_keep" in {i.name for i in session.get_overridable_initializers()}
        assert session.get_outputs()[0].shape[1] == "logits_sequence"
        feed = exported.io.dummy_inputs(batch=2, sequence=7, past_sequence=3, left_pad=1, seed=keep + 10)
        full = session.run(["logits"], feed)[0]
        kept = session.run(["logits"], {**feed, "logits_to_keep": np.array(keep, np.int64)})[0]
    np.testing.assert_array_equal(kept, full[:, -keep:] if 0 < keep < 7 else full)


@pytest.mark.parametrize("cached", [0, 4])
def test_a_last_only_step_of_the_shared_cache(exports, cached):
    """SharedCache.step(last_only=True), as `run` prefills a prompt: logits [batch, 1, vocab]
    equal to the last row of the full step's, the cache written in place as by a full step (the
    next step's logits equal), from an empty cache and after cached tokens."""
    exported = exports["onnxruntime"]
    rng = np.random.default_rng(cached)
    ids = rng.integers(0, 256, (2, 7))
    with OrtRunner(exported.io, exported) as runner:
        results = []
        for last_only in (False, True):
            cache = runner.shared_cache(2)
            if cached:
                cache.step(ids[:, :cached])
            logits = cache.step(ids[:, cached:], last_only=last_only)["logits"].copy()
            results.append((logits, cache.step(ids[:, :1])["logits"].copy(), cache.length))
    (full, after_full, length_full), (last, after_last, length_last) = results
    assert last.shape == (2, 1, CONFIG.vocab_size) and full.shape == (2, 7 - cached, CONFIG.vocab_size)
    np.testing.assert_array_equal(last, full[:, -1:])
    np.testing.assert_array_equal(after_last, after_full)
    assert length_last == length_full == 8


@pytest.mark.parametrize("options", [dict(k=3, noise="sampled", with_starts=True), dict(past=False),
                                     dict(dtype="fp16")], ids=["sampled-starts", "no-past", "fp16"])
def test_export_variants_on_the_onnxruntime_target(model, tmp_path, options):
    exported = export_onnx(model, tmp_path / "m.onnx", target="onnxruntime", **{"k": 2, **options})
    validate_onnx(model, exported, kernel=False)
    names = [n.name for n in onnx.load(str(exported.path)).graph.node if n.op_type == "DecoderAttention"]
    assert names == [f"/h.{i}.attn/DecoderAttention" for i in range(CONFIG.n_layer)]


def test_files_without_a_target_are_portable(exports, tmp_path):
    graph = onnx.load(str(exports["portable"].path))
    kept = [p for p in graph.metadata_props if p.key != "infmoe.target"]
    del graph.metadata_props[:]
    graph.metadata_props.extend(kept)
    onnx.save(graph, str(tmp_path / "old.onnx"))
    assert ExportedModel.read(tmp_path / "old.onnx").io.target == "portable"


def test_bad_targets_are_refused(model, tmp_path, run_cli):
    with pytest.raises(InfMoEError, match="target must be one of"):
        export_onnx(model, tmp_path / "m.onnx", target="tvm")
    odd = random_model(InfMoEConfig(**TINY))  # head_dim 5
    with pytest.raises(InfMoEError, match="head_dim .* multiple of 8.*--target portable"):
        export_onnx(odd, tmp_path / "m.onnx", target="onnxruntime")
    code, _, err = run_cli("onnx", "--out", tmp_path / "x.onnx", "--target", "tvm")
    assert code == 2 and "tvm" in err


def test_cli_exports_the_onnxruntime_target(tmp_path, run_cli):
    code, _, err = run_cli("onnx", "--out", tmp_path / "m.onnx", "--target", "onnxruntime", "--k", "1")
    assert code == 0, err
    assert ExportedModel.read(tmp_path / "m.onnx").io.target == "onnxruntime"


# ---------------------------------------------------------------------------------------------
# The export choice: --for names the runtime, --dtype the weights (options.export_choices)


def _labels(config, *args, **kwargs):
    return [(c.label, c.block_size) for c in export_choices(config, *args, **kwargs)]


def test_export_choices_resolve_the_flags(monkeypatch):
    assert _labels(CONFIG) == [("onnxruntime fp32", 32)]
    assert _labels(CONFIG, ["fp32", "fp16", "int8", "int4"], block_size=64) == [
        ("onnxruntime fp32", 32), ("onnxruntime fp16", 32), ("onnxruntime all-int8 kv16", 64),
        ("onnxruntime all-int4 kv16", 64)]
    # int8 activations (the quantized models' default) bring a float16 KV cache; float activations or the flag keep float32
    assert _labels(CONFIG, ["int8"], activations="float") == [("onnxruntime all-int8", 32)]
    assert _labels(CONFIG, ["int4"], activations="float") == [("onnxruntime all-int4", 32)]
    assert _labels(CONFIG, ["int4"], kv_cache="float32") == [("onnxruntime all-int4", 32)]
    assert _labels(CONFIG, ["fp32"], kv_cache="float16") == [("onnxruntime fp32 kv16", 32)]
    # the finer flags win: experts only, mixed, another target
    assert _labels(CONFIG, ["int4"], quantize_other="none") == [("onnxruntime int4 experts kv16", 32)]
    assert _labels(CONFIG, ["int4"], quantize_other="int8") == [("onnxruntime int4 experts, int8 other kv16", 32)]
    assert _labels(CONFIG, ["int4"], deploy="portable") == [("portable all-int4", 32)]
    assert _labels(CONFIG, ["int4"], target="tensorrt") == [("tensorrt int4 experts", 32)]
    assert _labels(CONFIG, ["int4"], target="tensorrt", quantize_other="int4") == [("tensorrt all-int4", 32)]
    # the default falls back where onnxruntime's attention cannot run; a named runtime is checked
    odd = InfMoEConfig(**TINY)  # head_dim 5
    fallback, = export_choices(odd, ["int8"])
    assert fallback.label == "portable all-int8" and "head_dim 5" in fallback.note
    assert export_choices(odd, ["int8"], deploy="portable")[0].note is None
    monkeypatch.setattr(ort_kernel, "custom_op_library", lambda: None)  # onnxruntime without our kernels
    assert "kernel library is not installed" in export_choices(CONFIG, ["int4"])[0].note


def test_quantized_onnxruntime_models_take_int8_activations_by_default():
    """The faster path by default where it runs (our kernels on the onnxruntime target): int8
    activations for int8 and int4 weights, float ones everywhere else; either where asked for."""
    def kinds(*args, **kwargs):
        return [(c.dtype, c.activations) for c in export_choices(CONFIG, *args, **kwargs)]

    assert kinds(["fp32", "fp16", "int8", "int4"]) == [("fp32", "float"), ("fp16", "float"), ("int8", "int8"),
                                                        ("int4", "int8")]
    assert kinds(["int4"], quantize_other="none") == [("int4", "int8")]  # the experts' w_in product
    assert kinds(["fp32", "int8", "int4"], activations="float") == [("fp32", "float"), ("int8", "float"),
                                                                   ("int4", "float")]
    assert kinds(["int4"], deploy="portable") == kinds(["int4"], target="tensorrt") == [("int4", "float")]
    assert export_choices(CONFIG, ["int4"])[0].options()["activations"] == "int8"


@pytest.mark.parametrize("config, kwargs, message", [
    (CONFIG, dict(dtypes=["fp32"], activations="int8"), "--activations int8 applies to int8 / int4 weights"),
    (CONFIG, dict(dtypes=["int4"], deploy="portable", activations="int8"), "not --for portable"),
    (CONFIG, dict(dtypes=["int4"], target="tensorrt", activations="int8"), "not --target tensorrt"),
    (InfMoEConfig(**TINY), dict(dtypes=["int4"], activations="int8"), "not the portable graph: this checkpoint's"),
    (CONFIG, dict(deploy="onnxruntime", target="portable"), "--target portable conflicts with --for onnxruntime"),
    (CONFIG, dict(dtypes=["fp32", "fp16"], quantize_other="int4"), "--quantize-other int4 applies to int8 / int4"),
    (CONFIG, dict(dtypes=["int4"], block_size=24), "--block-size: block size must be a power of two"),
    (InfMoEConfig(**TINY), dict(deploy="onnxruntime"), "--for onnxruntime: this checkpoint's head_dim 5"),
    (InfMoEConfig(**TINY), dict(target="onnxruntime"), "--target onnxruntime: this checkpoint's head_dim 5"),
])
def test_conflicting_flags_are_refused(config, kwargs, message):
    with pytest.raises(InfMoEError, match=re.escape(message)):
        export_choices(config, **kwargs)


def test_for_tensorrt_needs_tensorrt():
    from infmoe_export.runtimes.tensorrt import tensorrt_problem

    problem = tensorrt_problem()
    if problem is None:
        assert _labels(CONFIG, ["int8"], deploy="tensorrt") == [("tensorrt int8 experts", 32)]
    else:
        with pytest.raises(InfMoEError, match=re.escape(f"--for tensorrt: {problem}")):
            export_choices(CONFIG, deploy="tensorrt")


def test_cli_int4_is_all_int4_for_onnxruntime(model, tmp_path, run_cli):
    """`onnx --dtype int4`, nothing else: every matrix but the router, LayerNorms and biases
    int4, read by QMatMul and the quantized expert op on the onnxruntime target; validated."""
    ckpt = save_checkpoint(model, tmp_path / "ckpt")
    code, _, err = run_cli("onnx", "--checkpoint", ckpt, "--out", tmp_path / "m.onnx", "--k", 2, "--dtype", "int4",
                           "--block-size", 16)
    assert code == 0, err
    assert "(onnxruntime all-int4 kv16," in err and "validated" in err
    exported = ExportedModel.read(tmp_path / "m.onnx")
    assert exported.io.label == "onnxruntime all-int4 kv16" and exported.io.quantized == ["experts", "attention",
                                                                                      "embedding"]
    ops = _ops(exported.path)
    assert ops[("infmoe", "QMatMul")] == 2 * CONFIG.n_layer + 1 and ops[("infmoe", "QContinuousSliceFFN")] == 2
    assert not ops[("", "DequantizeLinear")] and not ops[("", "MatMul")]
    code, _, err = run_cli("onnx", "--checkpoint", ckpt, "--out", tmp_path / "f.onnx", "--no-validate")
    assert code == 0, err
    assert ExportedModel.read(tmp_path / "f.onnx").io.label == "onnxruntime fp32"


@pytest.mark.parametrize("args, message", [
    (["--for", "onnxruntime", "--target", "portable"], "--target portable conflicts with --for onnxruntime"),
    (["--dtype", "fp32", "--quantize-other", "int8"], "--quantize-other int8 applies to int8 / int4 models"),
    (["--for", "onnxruntime", "--odd"], "--for onnxruntime: this checkpoint's head_dim 5"),
])
def test_cli_conflicts_are_one_line_and_write_nothing(model, make_checkpoint, tmp_path, run_cli, args, message):
    odd = "--odd" in args
    ckpt = make_checkpoint() if odd else save_checkpoint(model, tmp_path / "ckpt")
    before = sorted(tmp_path.rglob("*"))
    code, _, err = run_cli("onnx", "--checkpoint", ckpt, "--out", tmp_path / "m.onnx",
                           *[a for a in args if a != "--odd"])
    assert code == 1 and err.startswith("error: ") and message in err and len(err.strip().splitlines()) == 1
    assert sorted(tmp_path.rglob("*")) == before


def test_cli_default_on_an_odd_head_dim_is_portable_with_a_note(make_checkpoint, tmp_path, run_cli):
    code, _, err = run_cli("onnx", "--checkpoint", make_checkpoint(), "--out", tmp_path / "m.onnx", "--no-validate")
    assert code == 0, err
    assert ExportedModel.read(tmp_path / "m.onnx").io.target == "portable"
    assert "note: the portable graph: this checkpoint's head_dim 5" in err


def test_parity_and_bench_measure_the_export_choice(model, tmp_path, run_cli):
    """Without --model, parity and bench export what `run` runs (onnxruntime; int4: all-int4),
    and say so; with --model, the choice flags are refused."""
    ckpt = save_checkpoint(model, tmp_path / "ckpt")
    code, out, err = run_cli("parity", "--checkpoint", ckpt, "--out", tmp_path / "parity", "--dtype", "int4",
                             "--block-size", 16, "--k", 1, "--backends", "ort", "--max-windows", 1,
                             "--max-ppl-increase", 1000, "--min-top1", 0)
    assert code == 0, err
    assert "models: onnxruntime all-int4 kv16" in out
    exported, = (tmp_path / "parity" / "models" / "int4").glob("*.onnx")
    assert ExportedModel.read(exported).io.label == "onnxruntime all-int4 kv16"
    rows = json.loads((tmp_path / "parity" / "report.json").read_text())["parity"]["results"]
    assert {(r["backend"], r["status"]) for r in rows} == {("torch", "reference"), ("ort", "pass")}
    code, out, err = run_cli("bench", "--checkpoint", ckpt, "--k", 1, "--batch", 1, "--seq", 1, "--past", 4,
                             "--backends", "ort", "--warmup", 0, "--iters", 2, "--budget", 0.05)
    assert code == 0, err
    assert "models: onnxruntime fp32" in out
    code, _, err = run_cli("bench", "--checkpoint", ckpt, "--model", exported, "--dtype", "int8")
    assert code == 1 and "cannot be combined with --model" in err


# ---------------------------------------------------------------------------------------------
# The shared buffer


def _plain_steps(runner, ids, mask, steps):
    """Prefill ids [B, T] with mask, then `steps` greedy tokens, present -> past; the logits."""
    io, past, out = runner.io, None, []
    for _ in range(steps + 1):
        outputs = runner.infer(io.feed(ids, mask, past), check_inputs=False)
        out.append(outputs["logits"])
        past = [outputs[n.replace("past_key_values", "present")] for n in io.past_names]
        ids = outputs["logits"][:, -1:, :256].argmax(-1)
        mask = np.concatenate([mask, np.ones((len(ids), 1), np.int64)], axis=1)
    return out


def _shared_steps(cache, ids, mask, steps):
    out = []
    for _ in range(steps + 1):
        logits = cache.step(ids, attention_mask=mask)["logits"].copy()
        out.append(logits)
        ids = logits[:, -1:, :256].argmax(-1)
        mask = np.concatenate([mask, np.ones((len(ids), 1), np.int64)], axis=1)
    return out


def test_shared_buffer_runner_matches_the_plain_one(exports):
    """A left-padded batch of 2 on the shared buffer gives the plain runner's logits (same
    model, past and present as separate arrays), and the cache holds the plain presents."""
    exported = exports["onnxruntime"]
    ids = np.array([[0, 0, 0, *b"def"], list(b"import")])
    mask = (np.arange(6) >= np.array([[3], [0]])).astype(np.int64)
    with OrtRunner(exported.io, exported, kernel=False) as runner:
        plain = _plain_steps(runner, ids, mask, 4)
        cache = runner.shared_cache(batch=2)
        buffer = cache._arrays[0]
        shared = _shared_steps(cache, ids, mask, 4)
        assert cache.length == 6 + 4 and cache._arrays[0] is buffer
        final = runner.infer(exported.io.feed(ids, mask), check_inputs=False)["present.0.key"]
    for a, b in zip(plain, shared):
        real = np.broadcast_to(np.array([[False], [True]]), a.shape[:2]) if a.shape[1] > 1 else np.ones(a.shape[:2], bool)
        np.testing.assert_allclose(a[real], b[real], atol=1e-5)
    np.testing.assert_allclose(buffer[1, :, :6], final[1], atol=1e-6)  # the prompt's keys, in place
    assert not buffer[:, :, 10:].any()  # nothing written past the cached length


def test_generation_on_the_shared_buffer(exports):
    """`run` (generate over OrtRunner) uses the shared buffer on the onnxruntime target and gives
    the tokens of the portable export and of the plain loop."""
    on_ort, portable = exports["onnxruntime"], exports["portable"]
    with OrtRunner(on_ort.io, on_ort, kernel=False) as runner:
        assert isinstance(runner.shared_cache(), SharedCache)
        shared = [generate(runner, list(p), NEW) for p in PROMPTS]
        runner.shared_cache = lambda batch=1: None  # the plain loop, past and present as arrays
        plain = [generate(runner, list(p), NEW) for p in PROMPTS]
    with OrtRunner(portable.io, portable, kernel=False) as runner:
        assert runner.shared_cache() is None
        reference = [generate(runner, list(p), NEW) for p in PROMPTS]
    assert shared == plain == reference


def test_shared_cache_with_sampled_noise_and_starts(model, tmp_path):
    """The extra outputs (expert_starts.{i}) come back beside the logits, step after step."""
    exported = export_onnx(model, tmp_path / "m.onnx", k=3, noise="sampled", with_starts=True, target="onnxruntime")
    io, rng = exported.io, np.random.default_rng(0)
    ids, noise = rng.integers(0, 256, (1, 7)), rng.standard_normal((1, 7, 3))
    with OrtRunner(io, exported, kernel=False) as runner:
        cache = runner.shared_cache()
        past = None
        for start, stop in ((0, 5), (5, 6), (6, 7)):
            shared = cache.step(ids[:, start:stop], noise[:, start:stop])
            plain = runner.infer(io.feed(ids[:, start:stop], np.ones((1, stop), np.int64), past, noise[:, start:stop]),
                                 check_inputs=False)
            past = [plain[n.replace("past_key_values", "present")] for n in io.past_names]
            assert sorted(shared) == sorted(["logits"] + [f"expert_starts.{i}" for i in range(CONFIG.n_layer)])
            for name, value in shared.items():
                np.testing.assert_allclose(value, plain[name], atol=1e-5)
        with pytest.raises(InfMoEError, match="needs expert_noise"):
            cache.step(ids[:, :1])


def test_shared_cache_bad_input(exports):
    with OrtRunner(exports["onnxruntime"].io, exports["onnxruntime"], kernel=False) as runner:
        cache = runner.shared_cache()
        with pytest.raises(InfMoEError, match="batch of 1"):
            cache.step(np.zeros((2, 3), np.int64))
        with pytest.raises(InfMoEError, match="do not fit the cache of n_positions = 32"):
            cache.step(np.zeros((1, 33), np.int64))
        with pytest.raises(InfMoEError, match=r"attention_mask must be \[batch, cached \+ new tokens\] = \[1, 3\], got \[1, 4\]"):
            cache.step(np.zeros((1, 3), np.int64), attention_mask=np.ones((1, 4), np.int64))
    with OrtRunner(exports["portable"].io, exports["portable"], kernel=False) as runner:
        with pytest.raises(InfMoEError, match="--target onnxruntime"):
            SharedCache(runner.sess, runner.io)


# ---------------------------------------------------------------------------------------------
# Clients on the onnxruntime target


@pytest.fixture(scope="module")
def reference_tokens(exports):
    exported = exports["portable"]
    with OrtRunner(exported.io, exported, kernel=False) as runner:
        return [generate(runner, list(p), NEW) for p in PROMPTS]


def _genai_tokens(folder):
    """onnxruntime-genai's greedy tokens for each prompt alone."""
    return [genai_generate(folder, [prompt], NEW)[0] for prompt in PROMPTS]


def test_genai_with_the_shared_buffer(exports, reference_tokens):
    pytest.importorskip("onnxruntime_genai")
    folder = exports["onnxruntime"].path.parent
    search = json.loads((folder / "genai_config.json").read_text())["search"]
    assert search["past_present_share_buffer"] is True
    portable = json.loads((exports["portable"].path.parent / "genai_config.json").read_text())["search"]
    assert portable["past_present_share_buffer"] is False
    assert _genai_tokens(folder) == reference_tokens


def test_genai_runs_the_all_int4_onnxruntime_target(model, tmp_path):
    """QMatMul's function (MatMulNBits) lets onnxruntime-genai run the int4 attention and LM head
    without our library, on the shared buffer: the tokens of our runner without the kernel."""
    pytest.importorskip("onnxruntime_genai")
    exported = export_onnx(model, tmp_path / "model.onnx", k=2, dtype="int4", quantize_other="int4", block_size=16,
                           target="onnxruntime")
    write_hf_folder(tmp_path, exported)
    assert _ops(exported.path)[("infmoe", "QMatMul")] == 2 * CONFIG.n_layer + 1
    with OrtRunner(exported.io, exported, kernel=False) as runner:
        expected = [generate(runner, list(p), NEW) for p in PROMPTS]
    assert _genai_tokens(tmp_path) == expected


def test_optimum_on_the_onnxruntime_target(exports, reference_tokens):
    optimum_ort = pytest.importorskip("optimum.onnxruntime")
    transformers = pytest.importorskip("transformers")
    folder = exports["onnxruntime"].path.parent
    model = optimum_ort.ORTModelForCausalLM.from_pretrained(folder)
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    single = [model.generate(**tokenizer(p.decode(), return_tensors="pt"), max_new_tokens=NEW)[0, len(p):].tolist()
              for p in PROMPTS]
    batch = tokenizer([p.decode() for p in PROMPTS], return_tensors="pt", padding=True)
    assert batch["attention_mask"][1].tolist()[:3] == [0, 0, 0]  # really left-padded
    padded = model.generate(**batch, max_new_tokens=NEW)[:, batch["input_ids"].shape[1]:].tolist()
    assert single == reference_tokens and padded == reference_tokens


def test_polygraphy_on_the_onnxruntime_target(exports, run_cli):
    folder = exports["onnxruntime"].path.parent
    code, out, _ = run_cli("inspect", folder)
    assert code == 0, out
    command = next(line for line in out.splitlines() if line.startswith("polygraphy: ")).split(": ", 1)[1]
    polygraphy = shutil.which("polygraphy", path=os.path.dirname(sys.executable))
    result = subprocess.run([polygraphy, *command.split()[1:]], capture_output=True, text=True)
    assert result.returncode == 0 and "PASSED" in result.stdout, result.stdout[-2000:] + result.stderr[-2000:]
