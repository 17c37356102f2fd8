"""The exported folder in the ecosystem's own clients (docs/guide/interop.md): Hugging Face Optimum's
ORTModelForCausalLM.generate(), transformers' text-generation pipeline on it, onnxruntime-genai's
generator, greedy tokens identical to `infmoe-export run` (its generate() over OrtRunner), batch
1 and a left-padded batch of 2; the post-processing recipes; inspect and repair.

Nothing here reaches the network: HF_HUB_OFFLINE=1, every file comes from the export. The
models are tiny random ones with a 256-byte vocabulary, exported once per module."""

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import onnx
import onnxruntime as ort
import pytest

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

from infmoe_export.cli import main  # noqa: E402
from infmoe_export.checkpoint import save_checkpoint  # noqa: E402
from infmoe_export.contract import ExportedModel  # noqa: E402
from infmoe_export.export.inspection import inspect_model, repair_model  # noqa: E402
from infmoe_export.model import InfMoEConfig  # noqa: E402
from infmoe_export.runtimes import ort_kernel  # noqa: E402
from infmoe_export.runtimes.generate import generate  # noqa: E402
from infmoe_export.runtimes.ort import OrtRunner  # noqa: E402

from conftest import TINY, genai_generate, random_model  # noqa: E402

optimum_ort = pytest.importorskip("optimum.onnxruntime")
transformers = pytest.importorskip("transformers")
og = pytest.importorskip("onnxruntime_genai")

CONFIG = InfMoEConfig(**{**TINY, "vocab_size": 256, "n_positions": 32})
PROMPTS = [b"def f(x):", b"import"]   # the second is left-padded in a batch of 2
NEW = 12


def _cli(*args):
    try:
        main([str(a) for a in args])
    except SystemExit as exit:
        assert not exit.code, f"infmoe-export {' '.join(map(str, args))} exited {exit.code}"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_checkpoint(random_model(CONFIG, seed=3), tmp_path_factory.mktemp("ckpt") / "ckpt")


@pytest.fixture(scope="module")
def folder(checkpoint, tmp_path_factory):
    """`infmoe-export onnx --out DIR`, exactly as a user runs it (validation included)."""
    out = tmp_path_factory.mktemp("exports") / "tiny-k2"
    _cli("onnx", "--checkpoint", checkpoint, "--out", out, "--k", "2")
    return out


@pytest.fixture(scope="module")
def reference_tokens(folder):
    """What `infmoe-export run --model DIR/model.onnx` generates for each prompt alone (greedy)."""
    exported = ExportedModel.read(folder / "model.onnx")
    with OrtRunner(exported.io, exported, kernel=False) as runner:
        return [generate(runner, list(p), NEW) for p in PROMPTS]


def _kernel_options():
    library = ort_kernel.custom_op_library()
    if library is None or not library.is_file():
        pytest.skip("the onnxruntime kernel library is not built here")
    options = ort.SessionOptions()
    options.register_custom_ops_library(str(library))
    return options


# ---------------------------------------------------------------------------------------------
# The folder


def test_folder_layout(folder):
    names = sorted(p.name for p in folder.iterdir() if not p.name.startswith("."))
    assert names == sorted(["model.onnx", "config.json", "generation_config.json", "tokenizer.json",
                            "tokenizer_config.json", "special_tokens_map.json", "genai_config.json"])
    assert oct(folder.stat().st_mode & 0o777) == oct(0o755)
    config = json.loads((folder / "config.json").read_text())
    exported = ExportedModel.read(folder / "model.onnx")
    assert config["model_type"] == "gpt2" and config["n_head"] == CONFIG.n_head and config["n_layer"] == CONFIG.n_layer
    assert config["n_embd"] == CONFIG.d_model and config["vocab_size"] == CONFIG.vocab_size
    assert config["infmoe"]["metadata"] == exported.metadata      # ours, verbatim
    assert config["infmoe"]["config"] == CONFIG.to_dict()
    genai = json.loads((folder / "genai_config.json").read_text())["model"]
    assert genai["type"] == "decoder" and "custom_ops_library" not in genai["decoder"]["session_options"]
    assert genai["decoder"]["head_size"] == CONFIG.head_dim and genai["decoder"]["num_hidden_layers"] == CONFIG.n_layer
    assert genai["decoder"]["inputs"]["past_key_names"] % 1 == exported.io.past_names[2]


def test_tokenizer_is_bytes(folder):
    from tokenizers import Tokenizer

    text = "déf main(\x01\x00\n\t ∞)"
    data = text.encode()
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    assert tokenizer.encode(text).ids == list(data)
    assert tokenizer.decode(list(data)) == text
    auto = transformers.AutoTokenizer.from_pretrained(folder)
    assert auto(text)["input_ids"] == list(data) and auto.decode(list(data)) == text
    assert auto.padding_side == "left" and auto.pad_token_id == 0
    genai = og.Tokenizer(og.Model(str(folder)))
    # genai's encode and decode pass C strings: both end at the first NUL (documented; use ids)
    assert genai.decode(np.array(list(data), dtype=np.int32)) == text[:text.index("\x00")]
    assert [int(i) for i in genai.encode(text)] == list(data[:data.index(0)])
    assert [int(i) for i in genai.encode(text.replace("\x00", ""))] == list(text.replace("\x00", "").encode())


# ---------------------------------------------------------------------------------------------
# Optimum and transformers


def _optimum_generate(folder, session_options=None):
    model = optimum_ort.ORTModelForCausalLM.from_pretrained(folder, session_options=session_options)
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    assert model.can_use_cache
    single = [model.generate(**tokenizer(p.decode(), return_tensors="pt"), max_new_tokens=NEW)[0, len(p):].tolist()
              for p in PROMPTS]
    batch = tokenizer([p.decode() for p in PROMPTS], return_tensors="pt", padding=True)
    assert batch["attention_mask"][1].tolist()[:2] == [0, 0]  # really left-padded
    out = model.generate(**batch, max_new_tokens=NEW)[:, batch["input_ids"].shape[1]:].tolist()
    return single, out


def test_optimum_generate_matches_run(folder, reference_tokens):
    single, batch = _optimum_generate(folder)
    assert single == reference_tokens
    assert batch == reference_tokens   # the left-padded row too


def test_optimum_generate_with_kernel(folder, reference_tokens):
    single, batch = _optimum_generate(folder, _kernel_options())
    assert single == reference_tokens and batch == reference_tokens


def test_transformers_pipeline(folder, reference_tokens):
    model = optimum_ort.ORTModelForCausalLM.from_pretrained(folder)
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    pipe = transformers.pipeline("text-generation", model=model, tokenizer=tokenizer)
    results = pipe([p.decode() for p in PROMPTS], max_new_tokens=NEW, do_sample=False, return_full_text=False,
                   batch_size=2)
    texts = [r[0]["generated_text"] for r in results]
    assert texts == [bytes(t).decode("utf-8", errors="replace") for t in reference_tokens]


# ---------------------------------------------------------------------------------------------
# onnxruntime-genai


def _genai(folder, prompts, new=NEW, pad=0):
    return genai_generate(folder, prompts, new, pad)


def test_genai_matches_run(folder, reference_tokens):
    assert [_genai(folder, [p])[0] for p in PROMPTS] == reference_tokens


def test_genai_left_padding_feeds_pad_tokens_as_tokens(folder, reference_tokens):
    """onnxruntime-genai 0.18 feeds attention_mask = 1 for pad tokens (the echo model below, which
    holds none of our code, proves it is the client), so a left-padded row is generated as if its
    pads were NUL bytes of the prompt. The unpadded row is right."""
    rows = _genai(folder, PROMPTS)
    assert rows[0] == reference_tokens[0]
    exported = ExportedModel.read(folder / "model.onnx")
    pad = len(PROMPTS[0]) - len(PROMPTS[1])
    with OrtRunner(exported.io, exported, kernel=False) as runner:
        as_bytes = generate(runner, [0] * pad + list(PROMPTS[1]), NEW)
    assert rows[1] == as_bytes
    assert _echo_mask_counts(folder.parent / "echo") == [[3, 4, 5, 6, 7], [3, 4, 5, 6, 7]]


def _echo_mask_counts(where):
    """A one-layer 'decoder' in standard ops whose next token is the number of ones in the
    attention_mask genai fed it. Row 0 is [pad, pad, 7]: a client that masks pads gives 1, 2, 3..."""
    from onnx import TensorProto as TP, helper

    where.mkdir(exist_ok=True)
    V = 64
    kv = lambda n, d: helper.make_tensor_value_info(n, TP.FLOAT, ["batch", 1, d, 1])  # noqa: E731
    nodes = [helper.make_node("ReduceSum", ["attention_mask", "axis1"], ["count"], keepdims=1),
             helper.make_node("Shape", ["input_ids"], ["ids_shape"]),
             helper.make_node("Expand", ["count", "ids_shape"], ["count_bt"]),
             helper.make_node("OneHot", ["count_bt", "depth", "onoff"], ["logits"], axis=-1),
             helper.make_node("Shape", ["past_key_values.0.key"], ["bh"], start=0, end=2),
             helper.make_node("Shape", ["input_ids"], ["t"], start=1, end=2),
             helper.make_node("Concat", ["bh", "t", "one"], ["zshape"], axis=0),
             helper.make_node("ConstantOfShape", ["zshape"], ["z"], value=helper.make_tensor("v", TP.FLOAT, [1], [0.0])),
             helper.make_node("Concat", ["past_key_values.0.key", "z"], ["present.0.key"], axis=2),
             helper.make_node("Concat", ["past_key_values.0.value", "z"], ["present.0.value"], axis=2)]
    inits = [helper.make_tensor("axis1", TP.INT64, [1], [1]), helper.make_tensor("depth", TP.INT64, [], [V]),
             helper.make_tensor("onoff", TP.FLOAT, [2], [0.0, 1.0]), helper.make_tensor("one", TP.INT64, [1], [1])]
    graph = helper.make_graph(nodes, "echo_mask", [
        helper.make_tensor_value_info("input_ids", TP.INT64, ["batch", "sequence"]),
        helper.make_tensor_value_info("attention_mask", TP.INT64, ["batch", "total"]),
        kv("past_key_values.0.key", "past"), kv("past_key_values.0.value", "past")],
        [helper.make_tensor_value_info("logits", TP.FLOAT, ["batch", "sequence", V]),
         kv("present.0.key", "total"), kv("present.0.value", "total")], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    onnx.checker.check_model(model, full_check=True)
    onnx.save(model, str(where / "model.onnx"))
    decoder = {"filename": "model.onnx", "session_options": {"log_id": "echo", "provider_options": []},
               "head_size": 1, "hidden_size": 1, "num_attention_heads": 1, "num_key_value_heads": 1,
               "num_hidden_layers": 1,
               "inputs": {"input_ids": "input_ids", "attention_mask": "attention_mask",
                          "past_key_names": "past_key_values.%d.key", "past_value_names": "past_key_values.%d.value"},
               "outputs": {"logits": "logits", "present_key_names": "present.%d.key",
                           "present_value_names": "present.%d.value"}}
    config = {"model": {"type": "decoder", "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 63,
                        "context_length": 32, "vocab_size": V, "decoder": decoder},
              "search": {"do_sample": False, "num_beams": 1, "max_length": 32, "min_length": 0,
                         "past_present_share_buffer": False, "top_k": 1}}
    (where / "genai_config.json").write_text(json.dumps(config))
    return _genai(where, [[63, 63, 7], [5, 6, 7]], new=5, pad=63)


def test_genai_no_function_uses_the_library_in_the_folder(checkpoint, tmp_path, reference_tokens):
    library = ort_kernel.custom_op_library()
    if library is None or not library.is_file():
        pytest.skip("the onnxruntime kernel library is not built here")
    out = tmp_path / "nofn"
    _cli("onnx", "--checkpoint", checkpoint, "--out", out, "--k", "2", "--no-function")
    decoder = json.loads((out / "genai_config.json").read_text())["model"]["decoder"]
    assert decoder["session_options"]["custom_ops_library"] == library.name and (out / library.name).is_file()
    assert [_genai(out, [p])[0] for p in PROMPTS] == reference_tokens


# ---------------------------------------------------------------------------------------------
# Sampled noise: the clients cannot feed expert_noise


def test_sampled_noise_is_refused_by_the_clients(checkpoint, tmp_path, capsys):
    out = tmp_path / "sampled"
    _cli("onnx", "--checkpoint", checkpoint, "--out", out, "--k", "2", "--noise", "sampled", "--no-validate")
    assert "cannot feed" in capsys.readouterr().err
    model = optimum_ort.ORTModelForCausalLM.from_pretrained(out)
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    with pytest.raises(Exception, match="expert_noise"):
        model.generate(**tokenizer("import", return_tensors="pt"), max_new_tokens=2)
    with pytest.raises(Exception, match="expert_noise"):
        _genai(out, [b"import"], new=2)


# ---------------------------------------------------------------------------------------------
# Post-processing recipes (docs/guide/interop.md), each checked against the export's own logits


@pytest.fixture(scope="module")
def feed_and_logits(folder):
    exported = ExportedModel.read(folder / "model.onnx")
    feed = exported.io.dummy_inputs(batch=2, sequence=5, past_sequence=3)
    return feed, _logits(folder / "model.onnx", feed)


def _logits(path, feed, options=None):
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    return session.run(["logits"], dict(feed))[0]


def _ops(path):
    model = onnx.load(str(path), load_external_data=False)
    return (sum(n.op_type == "ContinuousSliceFFN" for n in model.graph.node), len(model.functions),
            "infmoe.config" in {p.key for p in model.metadata_props})


def test_fp16_recipes(folder, feed_and_logits, tmp_path):
    from onnxconverter_common import float16
    from onnxruntime.transformers.float16 import convert_float_to_float16
    from onnxruntime.transformers.onnx_model import OnnxModel

    feed, expected = feed_and_logits
    source = onnx.load(str(folder / "model.onnx"))
    converted = float16.convert_float_to_float16(source, keep_io_types=True)
    onnx.save(converted, str(tmp_path / "occ.onnx"))
    assert _ops(tmp_path / "occ.onnx") == (CONFIG.n_layer, 1, True)
    assert np.abs(_logits(tmp_path / "occ.onnx", feed) - expected).max() < 5e-2
    # onnxruntime.transformers.float16 appends its input Casts at the end of the graph: sort it
    ortx = convert_float_to_float16(onnx.load(str(folder / "model.onnx")), keep_io_types=True)
    with pytest.raises(onnx.checker.ValidationError, match="topologically sorted"):
        onnx.checker.check_model(ortx, full_check=True)
    wrapped = OnnxModel(ortx)
    wrapped.topological_sort()
    onnx.checker.check_model(wrapped.model, full_check=True)
    onnx.save(wrapped.model, str(tmp_path / "ortx.onnx"))
    assert np.abs(_logits(tmp_path / "ortx.onnx", feed) - expected).max() < 5e-2


def test_quant_pre_process_keeps_the_op_only_without_its_session_step(folder, feed_and_logits, tmp_path):
    from onnxruntime.quantization import QuantType, quantize_dynamic
    from onnxruntime.quantization.shape_inference import quant_pre_process

    feed, expected = feed_and_logits
    quant_pre_process(str(folder / "model.onnx"), str(tmp_path / "kept.onnx"), skip_optimization=True)
    assert _ops(tmp_path / "kept.onnx") == (CONFIG.n_layer, 1, True)
    quant_pre_process(str(folder / "model.onnx"), str(tmp_path / "inlined.onnx"))
    assert _ops(tmp_path / "inlined.onnx")[:2] == (0, 0)    # inlined by its onnxruntime session
    assert "inlined" in " ".join(inspect_model(tmp_path / "inlined.onnx").problems)
    np.testing.assert_allclose(_logits(tmp_path / "inlined.onnx", feed), expected, atol=1e-4)
    quantize_dynamic(str(tmp_path / "kept.onnx"), str(tmp_path / "int8.onnx"), weight_type=QuantType.QInt8)
    assert _ops(tmp_path / "int8.onnx") == (CONFIG.n_layer, 1, True)
    assert np.isfinite(_logits(tmp_path / "int8.onnx", feed)).all()


def test_onnxslim_and_ort_format(folder, feed_and_logits, tmp_path):
    feed, expected = feed_and_logits
    subprocess.run([sys.executable, "-m", "onnxslim", str(folder / "model.onnx"), str(tmp_path / "slim.onnx")],
                   check=True, capture_output=True)
    assert _ops(tmp_path / "slim.onnx") == (CONFIG.n_layer, 1, True)
    np.testing.assert_allclose(_logits(tmp_path / "slim.onnx", feed), expected, atol=1e-5)
    shutil.copy(folder / "model.onnx", tmp_path / "m.onnx")
    subprocess.run([sys.executable, "-m", "onnxruntime.tools.convert_onnx_models_to_ort", str(tmp_path / "m.onnx")],
                   check=True, capture_output=True)
    np.testing.assert_allclose(_logits(tmp_path / "m.ort", feed), expected, atol=1e-5)


def test_polygraphy_run_with_the_shapes_inspect_prints(folder, run_cli):
    code, out, _ = run_cli("inspect", folder)
    assert code == 0 and "no problems found" in out
    command = next(line for line in out.splitlines() if line.startswith("polygraphy: ")).split(": ", 1)[1]
    args = command.split()
    assert args[:3] == ["polygraphy", "run", str(folder / "model.onnx")]
    polygraphy = shutil.which("polygraphy", path=os.path.dirname(sys.executable))
    result = subprocess.run([polygraphy, *args[1:]], capture_output=True, text=True)
    assert result.returncode == 0 and "PASSED" in result.stdout, result.stdout[-2000:] + result.stderr[-2000:]


# ---------------------------------------------------------------------------------------------
# Metadata and function that tools drop: inspect reports, run recovers, repair restores


def test_graph_surgeon_round_trip_is_recovered(folder, tmp_path, run_cli, feed_and_logits):
    gs = pytest.importorskip("onnx_graphsurgeon")
    copy = tmp_path / "gs"
    shutil.copytree(folder, copy)
    onnx.save(gs.export_onnx(gs.import_onnx(onnx.load(str(folder / "model.onnx")))), str(copy / "model.onnx"))
    assert _ops(copy / "model.onnx")[2] is False                      # the tool dropped our metadata
    assert ExportedModel.read(copy / "model.onnx").io == ExportedModel.read(folder / "model.onnx").io
    code, out, _ = run_cli("inspect", copy)
    assert code == 0 and "recovered from config.json" in out
    code, _, err = run_cli("inspect", copy, "--repair", tmp_path / "fixed.onnx")
    assert code == 0 and "restored the metadata" in err
    assert _ops(tmp_path / "fixed.onnx") == (CONFIG.n_layer, 1, True)
    code, out, _ = run_cli("run", "--model", copy / "model.onnx", "--prompt", "import", "--max-new-tokens", 3)
    assert code == 0


def test_function_dropped_is_reported_and_repaired(folder, tmp_path, run_cli, feed_and_logits):
    """A model saved by an onnxruntime session that had the kernel keeps the op, loses the
    function, and its metadata still claims it (simulated here by removing the function; with
    the kernel built, the real session-saved file is checked too)."""
    feed, expected = feed_and_logits
    broken = tmp_path / "broken.onnx"
    model = onnx.load(str(folder / "model.onnx"))
    del model.functions[:]
    onnx.save(model, str(broken))
    with pytest.raises(Exception, match="not a registered function/op"):
        _logits(broken, feed)
    found = inspect_model(broken)
    assert found.claims_function and not found.has_function
    assert any("--repair" in p for p in found.problems)
    assert ExportedModel.read(broken).metadata["infmoe.function_dropped"] == "1"
    assert any(step.startswith("added the fallback function") for step in repair_model(broken, tmp_path / "fixed.onnx"))
    np.testing.assert_allclose(_logits(tmp_path / "fixed.onnx", feed), expected, atol=1e-5)
    assert not inspect_model(tmp_path / "fixed.onnx").problems

    options = _kernel_options()
    options.optimized_model_filepath = str(tmp_path / "session.onnx")
    ort.InferenceSession(str(folder / "model.onnx"), options, providers=["CPUExecutionProvider"])
    assert _ops(tmp_path / "session.onnx") == (CONFIG.n_layer, 0, True)
    assert any("--repair" in p for p in inspect_model(tmp_path / "session.onnx").problems)
    repair_model(tmp_path / "session.onnx", tmp_path / "session_fixed.onnx")
    np.testing.assert_allclose(_logits(tmp_path / "session_fixed.onnx", feed), expected, atol=1e-4)


def test_fp16_no_past_export_in_optimum_and_genai(checkpoint, tmp_path):
    """--dtype fp16 (inputs and outputs stay fp32) without a cache: Optimum runs it with
    use_cache=False and gives run's tokens; onnxruntime-genai needs the cache and refuses it."""
    out = tmp_path / "fp16-nopast"
    _cli("onnx", "--checkpoint", checkpoint, "--out", out, "--k", "2", "--dtype", "fp16", "--no-past")
    exported = ExportedModel.read(out / "model.onnx")
    with OrtRunner(exported.io, exported, kernel=False) as runner:
        expected = [generate(runner, list(p), NEW) for p in PROMPTS]
    model = optimum_ort.ORTModelForCausalLM.from_pretrained(out, use_cache=False)
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    assert not model.can_use_cache
    got = [model.generate(**tokenizer(p.decode(), return_tensors="pt"), max_new_tokens=NEW)[0, len(p):].tolist()
           for p in PROMPTS]
    assert got == expected
    assert not (out / "genai_config.json").exists()   # genai feeds only the new token after step 1
    with pytest.raises(Exception, match="genai_config.json"):
        og.Model(str(out))
