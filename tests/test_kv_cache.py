"""The onnxruntime target's float16 KV cache (`--kv-cache float16`, docs/guide/export.md): the
file's cache inputs and outputs, its metadata, and its logits against the float32-cache model
on the shared cache and on a fed past, a left-padded batch row by row against each row alone; on
the fallback function and on the kernel; the fallback's float16 body on one node. The conflicting
flags, and a float32-cache export as before.

Against the PyTorch reference rounding its cache alike, the model is held to float32's tolerances
(validation, parity's level 1); against the float32-cache model, within TOLERANCE (rounding the
keys and values moves these logits by a few 1e-3), on a dense model of test_ort_target's config:
a window start cannot flip at a boundary there, which would move a sparse model's later logits
by far more than the rounding. Tokens are fresh every run (the seed comes from os.urandom and is
printed in every failure; INFMOE_TEST_SEED=<n> replays a run)."""

import json
import os
from pathlib import Path

import numpy as np
import onnx
import onnxruntime
import pytest
import torch
from onnx import TensorProto

from infmoe_export.checkpoint import save_checkpoint
from infmoe_export.commands.deploy import export_flags
from infmoe_export.contract import DecoderIO, ExportedModel
from infmoe_export.errors import InfMoEError
from infmoe_export.export import export_onnx
from infmoe_export.export.function import attention_model
from infmoe_export.export.ort_target import decoder_attention
from infmoe_export.model import InfMoEConfig
from infmoe_export.options import export_choices
from infmoe_export.runtimes import ort_kernel, registry
from infmoe_export.runtimes.generate import generate
from infmoe_export.runtimes.ort import OrtRunner, SharedCache, create_session
from infmoe_export.serving import config as cfg
from infmoe_export.serving import tritonserver_model as front
from infmoe_export.verify import validate
from infmoe_export.verify.validate import DEFAULT_ATOL, KV16_ATOL, validate_onnx

from conftest import TINY, genai_generate, random_model
from test_ort_attention import run_in_place

SEED = int(os.environ.get("INFMOE_TEST_SEED") or int.from_bytes(os.urandom(4), "little"))
# test_ort_target's config (head_dim 8, GroupQueryAttention's smallest), dense: slice_width = ffn_hidden.
CONFIG = InfMoEConfig(**{**TINY, "d_model": 16, "n_head": 2, "vocab_size": 256, "n_positions": 32,
                         "slice_width": TINY["ffn_hidden"]})
TOLERANCE = 5e-2
LENGTHS = (9, 4, 1)  # the prompts of the batch of 3, left-padded to the longest
STEPS = 12           # decode steps after the prompts


@pytest.fixture(scope="module")
def model():
    return random_model(CONFIG, seed=5)


@pytest.fixture(scope="module")
def exports(model, tmp_path_factory):
    """The same model with a float32 and a float16 cache."""
    folder = tmp_path_factory.mktemp("kv")
    return {kv: export_onnx(model, folder / f"{kv}.onnx", k=2, target="onnxruntime", kv_cache=kv)
            for kv in ("float32", "float16")}


@pytest.fixture(params=[False, True], ids=["fallback", "kernel"])
def kernel(request):
    """The fallback function (onnxruntime's GroupQueryAttention, the cache cast around it) and our
    kernel, skipped where the library is not installed."""
    if request.param:
        request.getfixturevalue("library")
    return request.param


def _types(path):
    graph = onnx.load(str(path)).graph
    return {v.name: v.type.tensor_type.elem_type for v in [*graph.input, *graph.output]}


def _tokens(lengths, steps):
    """Random byte ids [rows, longest + steps] and the mask of rows left-padded to the longest."""
    rng = np.random.default_rng([SEED, *lengths])
    longest = max(lengths)
    ids = rng.integers(0, 256, (len(lengths), longest + steps))
    mask = np.ones(ids.shape, np.int64)
    for row, length in enumerate(lengths):
        mask[row, :longest - length] = 0
    return ids, mask


def _shared_steps(session, io, ids, mask, prompt):
    """Logits [rows, positions, vocab] of the prompt (its first `prompt` columns) and then one
    token a step, on a SharedCache."""
    cache = SharedCache(session, io, ids.shape[0])
    logits = [cache.step(ids[:, :prompt], attention_mask=mask[:, :prompt])["logits"].copy()]
    for t in range(prompt, ids.shape[1]):
        logits.append(cache.step(ids[:, t:t + 1], attention_mask=mask[:, :t + 1])["logits"].copy())
    return np.concatenate(logits, axis=1)


def _fed_steps(session, io, ids, mask, prompt):
    """The same with the past fed in and the present taken back (DecoderIO.feed)."""
    names, past, logits = [o.name for o in session.get_outputs()], None, []
    for start, end in [(0, prompt), *((t, t + 1) for t in range(prompt, ids.shape[1]))]:
        outputs = dict(zip(names, session.run(None, dict(io.feed(ids[:, start:end], mask[:, :end], past)))))
        past = [outputs[n.replace("past_key_values", "present")] for n in io.past_names]
        assert all(p.dtype == io.cache_dtype for p in past)
        logits.append(outputs["logits"])
    return np.concatenate(logits, axis=1)


@pytest.mark.filterwarnings("ignore:onnxruntime kernel library not found")
def test_cli_exports_a_float16_cache(model, tmp_path, run_cli, monkeypatch, kernel):
    """`onnx --kv-cache float16`: past and present float16, everything else as in a float32-cache
    export; the metadata says so, the command names it and validates it."""
    if not kernel:
        monkeypatch.setattr(ort_kernel, "custom_op_library", lambda: None)  # onnxruntime without our kernels
    ckpt = save_checkpoint(model, tmp_path / "ckpt")
    code, _, err = run_cli("onnx", "--checkpoint", ckpt, "--out", tmp_path / "m.onnx", "--k", 2,
                           "--kv-cache", "float16")
    assert code == 0, err
    assert "(onnxruntime fp32 kv16," in err and "validated" in err and "atol 0.001" in err
    exported = ExportedModel.read(tmp_path / "m.onnx")
    assert exported.io.kv_cache == "float16" and exported.metadata["infmoe.kv_cache"] == "float16"
    types = _types(exported.path)
    cache = [n for n in types if n.startswith(("past_key_values.", "present."))]
    assert len(cache) == 4 * CONFIG.n_layer
    assert {n: types[n] for n in cache} == {n: TensorProto.FLOAT16 for n in cache}
    assert types["logits"] == TensorProto.FLOAT


def test_a_float32_cache_export_is_unchanged(exports):
    """Without the flag: every float input and output float32, the attention's function the Add
    and GroupQueryAttention it was, the metadata float32; the float16 one's function casts."""
    types = _types(exports["float32"].path)
    assert {n for n, t in types.items() if t != TensorProto.FLOAT} == {"input_ids", "attention_mask", "logits_to_keep"}
    assert exports["float32"].metadata["infmoe.kv_cache"] == "float32"

    def body(exported):
        function = next(f for f in onnx.load(str(exported.path)).functions if f.name == "DecoderAttention")
        return [n.op_type for n in function.node]
    assert body(exports["float32"]) == ["Add", "GroupQueryAttention"]
    assert {"Cast", "GroupQueryAttention", "CastLike"} <= set(body(exports["float16"]))


def test_metadata_round_trip_and_older_files():
    io = DecoderIO(CONFIG, 2, target="onnxruntime", kv_cache="float16")
    props = io.metadata(18, True)
    assert DecoderIO.from_metadata(props) == io and io.cache_dtype == np.float16
    assert io.label == "onnxruntime fp32 kv16" and io.dtypes()["present.1.value"] == np.float16
    older = {key: value for key, value in props.items() if key != "infmoe.kv_cache"}
    assert DecoderIO.from_metadata(older).kv_cache == "float32"
    assert DecoderIO.from_metadata(older).label == "onnxruntime fp32"


@pytest.mark.parametrize("batch, sequence, past", [(1, 1, 30), (1, 20, 10), (2, 1, 17), (2, 6, 0)])
def test_the_attention_function_over_a_float16_cache(batch, sequence, past):
    """The fallback body of a float16 cache (one node, onnxruntime without our kernel): y and
    present as the reference computes them over the past's float16 values and the new keys and
    values rounded to float16; past and present bound to one buffer, as SharedCache binds them, alike."""
    heads, dim = 2, 8
    rng = np.random.default_rng([SEED, batch, sequence, past])
    total = past + sequence
    feeds = {"qkv": rng.standard_normal((batch, sequence, 3 * heads * dim)).astype(np.float32),
             "past_key": rng.standard_normal((batch, heads, past, dim)).astype(np.float16),
             "past_value": rng.standard_normal((batch, heads, past, dim)).astype(np.float16),
             "seqlens_k": np.full(batch, total - 1, np.int32), "total_sequence_length": np.array([total], np.int32),
             "attention_bias": np.zeros((batch, 1, sequence, total), np.float32),
             "qkv_bias": rng.standard_normal(3 * heads * dim).astype(np.float32)}
    y, key, value = decoder_attention(**feeds, num_heads=heads)  # the new keys and values rounded, as written
    proto = attention_model(heads, with_function=True, kv_cache="float16").SerializeToString()
    session = onnxruntime.InferenceSession(proto, providers=["CPUExecutionProvider"])
    outputs = session.run(None, feeds)
    assert [o.dtype for o in outputs] == [np.float32, np.float16, np.float16]
    np.testing.assert_allclose(outputs[0], y, rtol=1e-5, atol=1e-5, err_msg=f"seed {SEED}")
    assert np.array_equal(outputs[1], key.astype(np.float16)) and np.array_equal(outputs[2], value.astype(np.float16))

    buffers = [np.zeros((batch, heads, 32, dim), np.float16) for _ in range(2)]
    for buffer, name in zip(buffers, ("past_key", "past_value")):
        buffer[:, :, :past] = feeds.pop(name)
    np.testing.assert_allclose(run_in_place(session, feeds, buffers), y, rtol=1e-5, atol=1e-5, err_msg=f"seed {SEED}")
    assert np.array_equal(buffers[0][:, :, :total], outputs[1]) and np.array_equal(buffers[1][:, :, :total], outputs[2])


@pytest.mark.parametrize("options, message", [
    (dict(kv_cache="bfloat16"), "kv_cache must be one of"),
    (dict(kv_cache="float16", target="portable"), "applies to the onnxruntime target, not to portable"),
    (dict(kv_cache="float16", target="onnxruntime", past=False), "applies to a model with a cache, not to one "
                                                                 "without past"),
])
def test_bad_cache_types_are_refused(options, message):
    with pytest.raises(InfMoEError, match=message):
        DecoderIO(CONFIG, 2, **options)


def test_validation_of_a_float16_cache(model, exports, kernel):
    """validate_onnx on a float16 cache (prefill and a decode step on the reference's cache), the
    reference rounding its keys and values to float16 as the cache does: held to KV16_ATOL (two
    correct backends' caches may hold neighbouring float16s), on this small model within
    float32's tolerance all the same."""
    report = validate_onnx(model, exports["float16"], kernel=kernel)
    assert report.passed and report.atol == KV16_ATOL > DEFAULT_ATOL["fp32"]
    logits = [o.max_abs_agreeing for o in report.outputs if o.name == "logits"]
    assert len(logits) == 2 and max(logits) <= DEFAULT_ATOL["fp32"]


@pytest.mark.parametrize("kv_cache, passes", [("float32", False), ("float16", True)])
def test_a_float16_cache_widens_the_start_boundary_margin(kv_cache, passes):
    """A window start one off the reference's, the reference's position a few float16 steps
    outside the chosen window (beyond float32's margin, within KV16_BOUNDARY_TOLERANCE's): a
    problem with a float32 cache, a boundary case with a float16 one; one far outside fails both."""
    config = InfMoEConfig(**{**TINY, "ffn_hidden": 96, "slice_width": 16})
    decoder_io = DecoderIO(config, 2, target="onnxruntime", dtype="int4", kv_cache=kv_cache)
    windows = config.ffn_hidden - config.slice_width + 1
    for outside, expected in ((3e-5 * windows, passes), (0.5, False)):
        expected_starts = np.array([[[10, 40]]])
        chosen = np.array([[[11, 40]]])  # the first start one past the reference's
        position = torch.tensor([[[11 - outside, 40.5]]], dtype=torch.float64) / windows
        report = validate.ValidationReport(Path("x.onnx"), 1e-4)
        validate._check_starts(report, "prefill", decoder_io, {"expert_starts.0": expected_starts}, [chosen],
                               {0: torch.logit(position)}, np.ones((1, 1), np.int64))
        assert report.passed == expected and report.boundary_cases == int(expected), (kv_cache, outside)


@pytest.mark.parametrize("lengths", [(7,), LENGTHS], ids=["batch-1", "batch-3"])
@pytest.mark.parametrize("steps", [_shared_steps, _fed_steps], ids=["shared-cache", "fed-past"])
def test_logits_within_the_tolerance_of_a_float32_cache(exports, kernel, lengths, steps):
    """A prompt (rows of different lengths, left-padded) and STEPS tokens: every real position's
    logits within TOLERANCE of the float32-cache model's."""
    ids, mask = _tokens(lengths, STEPS)
    logits = {kv: steps(create_session(e, kernel=kernel), e.io, ids, mask, max(lengths)) for kv, e in exports.items()}
    real = mask.astype(bool)
    error = np.abs(logits["float16"] - logits["float32"])[real].max()
    assert np.isfinite(logits["float16"]).all() and error <= TOLERANCE, f"seed {SEED}: max |Δ| {error}"
    assert error > 0  # the cache is rounded: not the float32 model by accident


@pytest.mark.parametrize("steps", [_shared_steps, _fed_steps], ids=["shared-cache", "fed-past"])
def test_each_row_of_a_batch_is_the_row_alone(exports, kernel, steps):
    exported = exports["float16"]
    session = create_session(exported, kernel=kernel)
    ids, mask = _tokens(LENGTHS, STEPS)
    batch = steps(session, exported.io, ids, mask, max(LENGTHS))
    for row, length in enumerate(LENGTHS):
        pads = max(LENGTHS) - length
        alone = steps(session, exported.io, ids[row:row + 1, pads:], mask[row:row + 1, pads:], length)
        error = np.abs(batch[row, pads:] - alone[0]).max()
        assert error <= TOLERANCE, f"seed {SEED}: row {row} differs by {error}"


def test_generation_on_a_float16_cache(exports, kernel):
    """`run`'s generate(): on the shared cache (the prompt's LM head on its last position) and on
    the fed past, the same tokens."""
    exported = exports["float16"]
    prompt = [int(i) for i in _tokens((6,), 0)[0][0]]
    with OrtRunner(exported.io, exported, kernel=kernel) as runner:
        assert isinstance(runner.shared_cache(), SharedCache)
        shared = generate(runner, prompt, 10)
        runner.shared_cache = lambda batch=1: None  # the plain loop, past and present as arrays
        plain = generate(runner, prompt, 10)
    assert shared == plain and len(shared) == 10, f"seed {SEED}"


def test_the_serving_pool_holds_a_float16_cache(exports):
    """The Triton front model's pool in the model's cache type (the route's kv_cache), stepped as
    the server steps it, gives the SharedCache's logits; the per-K model's config says TYPE_FP16."""
    exported = exports["float16"]
    io, c = exported.io, exported.io.config
    session = create_session(exported, kernel=False)
    runner = front.SharedRunner(session, io.past_names)
    runner.pool = front.Pool(runner, io.past_names, 2, c.n_head, c.n_positions, c.head_dim, c.vocab_size,
                             cache_dtype=io.cache_dtype)
    assert all(array.dtype == np.float16 for array in runner.pool.arrays)
    ids, _ = _tokens((5,), 3)
    sequence = front.Sequence("2/fp32")
    served = []
    for start, end in [(0, 5), (5, 6), (6, 7), (7, 8)]:
        step = front.Step(0, 1, sequence, ids[0, start:end], True, False)
        runner.pool.serve([step])
        served.append(step.logits)
    expected = _shared_steps(session, io, ids, np.ones_like(ids), 5)[0, 4:]
    np.testing.assert_allclose(np.stack(served), expected, atol=1e-5, err_msg=f"seed {SEED}")
    text = cfg.onnx_model_config("infmoe_k2_fp32", io, None)
    assert 'name: "past_key_values.0.key" data_type: TYPE_FP16' in text
    assert 'name: "present.1.value" data_type: TYPE_FP16' in text and 'name: "logits" data_type: TYPE_FP32' in text


ELSEWHERE = "--kv-cache float16 applies to the onnxruntime target's attention, not "


@pytest.mark.parametrize("args, message", [
    (["--for", "portable"], ELSEWHERE + "--for portable"),
    (["--target", "portable"], ELSEWHERE + "--target portable"),
    (["--for", "tensorrt"], ELSEWHERE + "--for tensorrt"),
    (["--target", "tensorrt"], ELSEWHERE + "--target tensorrt"),
    (["--no-past"], "--kv-cache float16 applies to the KV cache, and --no-past exports none"),
])
def test_conflicting_flags_are_one_line_and_write_nothing(model, tmp_path, run_cli, args, message):
    ckpt = save_checkpoint(model, tmp_path / "ckpt")
    before = sorted(tmp_path.rglob("*"))
    code, _, err = run_cli("onnx", "--checkpoint", ckpt, "--out", tmp_path / "m.onnx", "--kv-cache", "float16", *args)
    assert code == 1 and err.startswith("error: ") and message in err and len(err.strip().splitlines()) == 1
    assert "Traceback" not in err and sorted(tmp_path.rglob("*")) == before


def test_other_commands_pass_the_flag_and_refuse_it_beside_a_model(exports, tmp_path, run_cli):
    choice, = export_choices(CONFIG, ["int4"], kv_cache="float16")
    assert choice.label == "onnxruntime all-int4 kv16" and choice.options()["kv_cache"] == "float16"
    assert export_flags(choice.options()) == "--for onnxruntime --dtype int4 --kv-cache float16"  # deploy's README
    code, _, err = run_cli("parity", "--out", tmp_path / "parity", "--for", "portable", "--kv-cache", "float16")
    assert code == 1 and "not --for portable" in err and not (tmp_path / "parity").exists()
    code, _, err = run_cli("bench", "--model", exports["float16"].path, "--kv-cache", "float16")
    assert code == 1 and "cannot be combined with --model" in err


def test_a_folder_with_both_caches_of_one_precision_is_refused_naming_them(exports, tmp_path):
    """`--model FOLDER` (parity, bench): a report has one row per precision and K, so a float32-
    and a float16-cache model of one precision and K are refused in one line naming both."""
    folder = tmp_path / "models"
    folder.mkdir()
    for kv, exported in exports.items():
        (folder / f"{kv}.onnx").write_bytes(exported.path.read_bytes())
    with pytest.raises(InfMoEError, match=r"two fp32 models for K=2 \(quantile noise\): .*float16.onnx "
                                          r"\(onnxruntime fp32 kv16\) and .*float32.onnx \(onnxruntime fp32\); a "
                                          r"report has one row per precision and K: compare them in separate runs"):
        registry.find_models([folder])
    assert [m.io.label for m in registry.find_models([folder / "float16.onnx"])] == ["onnxruntime fp32 kv16"]


def test_parity_judges_a_float16_cache_at_both_levels(model, tmp_path, run_cli):
    """parity --kv-cache float16: the model is named kv16, and its backend is judged against the
    reference rounding its cache alike (level 1) and against the float model (level 2)."""
    ckpt = save_checkpoint(model, tmp_path / "ckpt")
    code, out, err = run_cli("parity", "--checkpoint", ckpt, "--out", tmp_path / "parity", "--kv-cache", "float16",
                             "--k", 2, "--backends", "ort-fallback", "--max-windows", 1)
    assert code == 0, err
    assert "models: onnxruntime fp32 kv16" in out
    exported, = (tmp_path / "parity" / "models" / "fp32").glob("*.onnx")
    assert exported.name == "model_k2_quantile_fp32_kv16.onnx"
    rows = json.loads((tmp_path / "parity" / "report.json").read_text())["parity"]["results"]
    row = next(r for r in rows if r["backend"] == "ort-fallback")
    assert (row["level1"], row["level2"], row["status"]) == ("pass", "pass", "pass")
    assert row["error_all"]["max"] is not None


def test_the_clients_generate_from_a_float16_cache_folder(model, tmp_path, run_cli):
    """A folder exported with a float16 cache (Optimum's layout): Optimum's generate, with and
    without the kernel, and onnxruntime-genai generate what `run` does, greedy; genai's
    config takes the cache's type from the model's inputs."""
    optimum_ort = pytest.importorskip("optimum.onnxruntime")
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("onnxruntime_genai")
    ckpt = save_checkpoint(model, tmp_path / "ckpt")
    folder = tmp_path / "kv16"
    code, _, err = run_cli("onnx", "--checkpoint", ckpt, "--out", folder, "--k", 2, "--kv-cache", "float16")
    assert code == 0, err
    exported = ExportedModel.read(folder / "model.onnx")
    prompt = [int(t) for t in np.random.default_rng([SEED, 7]).integers(1, 128, 6)]  # ASCII: a token a byte
    with OrtRunner(exported.io, exported, kernel=False) as runner:
        expected = generate(runner, prompt, STEPS)
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    ids = tokenizer(bytes(prompt).decode("ascii"), return_tensors="pt")["input_ids"]
    assert ids[0].tolist() == prompt  # byte ids: the prompt as given
    options = [None]
    if ort_kernel.custom_op_library() is not None:
        options.append(onnxruntime.SessionOptions())
        options[-1].register_custom_ops_library(str(ort_kernel.custom_op_library()))
    for session_options in options:
        client = optimum_ort.ORTModelForCausalLM.from_pretrained(folder, session_options=session_options)
        out = client.generate(input_ids=ids, attention_mask=ids * 0 + 1, max_new_tokens=STEPS, do_sample=False)
        assert out[0, len(prompt):].tolist() == expected, f"seed {SEED}"
    assert genai_generate(folder, [prompt], STEPS) == [expected], f"seed {SEED}"
