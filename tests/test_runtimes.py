"""The PyTorch and onnxruntime runners behind one Polygraphy interface, the compiled kernel's
precedence over the fallback function, generation, and `infmoe-export run`."""

import json
import re

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from polygraphy.comparator import Comparator, SimpleCompareFunc

from infmoe_export.checkpoint import load_checkpoint
from infmoe_export.errors import InfMoEError
from infmoe_export.contract import DecoderIO, ExportedModel
from infmoe_export.export import export_onnx
from infmoe_export.model import InfMoEConfig
from infmoe_export.runtimes.generate import generate
from infmoe_export.runtimes.ort import OrtRunner, create_session, default_providers
from infmoe_export.runtimes.ort_kernel import custom_op_library
from infmoe_export.runtimes.torch_runner import TorchRunner

from conftest import TINY, random_model

needs_kernel = pytest.mark.skipif(custom_op_library() is None,
                                  reason="the onnxruntime kernel is not built (plugins/onnxruntime/tools/build.sh)")


@pytest.fixture(scope="module")
def tiny_model():
    return random_model(InfMoEConfig(**TINY), seed=21)


@pytest.fixture(scope="module")
def sampled_k2(tiny_model, tmp_path_factory):
    """Sampled noise, K = 2, with past and starts: every optional input and output at once."""
    return export_onnx(tiny_model, tmp_path_factory.mktemp("runtimes") / "sampled_k2.onnx", k=2, noise="sampled",
                       with_starts=True).path


def test_runners_share_io_and_agree_in_polygraphy(tiny_model, sampled_k2):
    decoder_io = ExportedModel.read(sampled_k2).io
    torch_runner = TorchRunner(decoder_io, tiny_model)
    ort_runner = OrtRunner(decoder_io, sampled_k2, kernel=False)
    with torch_runner, ort_runner:
        torch_meta = torch_runner.get_input_metadata(use_numpy_dtypes=False)
        ort_meta = ort_runner.get_input_metadata(use_numpy_dtypes=False)
        assert list(torch_meta) == list(ort_meta) == decoder_io.input_names
        for name in decoder_io.input_names:
            assert torch_meta[name].dtype == ort_meta[name].dtype
            assert list(torch_meta[name].shape) == list(ort_meta[name].shape)
    feeds = [decoder_io.dummy_inputs(batch=2, sequence=9, past_sequence=0, left_pad=3, seed=1),
             decoder_io.dummy_inputs(batch=1, sequence=1, past_sequence=6, left_pad=0, seed=2)]
    results = Comparator.run([torch_runner, ort_runner], data_loader=feeds)
    for outputs in results.values():
        for output in outputs:
            assert list(output) == decoder_io.output_names
    accuracy = Comparator.compare_accuracy(results, compare_func=SimpleCompareFunc(atol=1e-4, rtol=0))
    assert bool(accuracy)


def test_runners_taking_turns_do_not_spin_past_a_run(sampled_k2):
    """bench's runners take turns on the same cores: their pools sleep once a run returns;
    every other runner keeps onnxruntime's default."""
    from infmoe_export.runtimes import registry
    from infmoe_export.runtimes.ort import FORCE_SPINNING_STOP

    model = ExportedModel.read(sampled_k2)
    for taking_turns, expected in ((True, "1"), (False, None)):
        with registry.make_runner("ort-fallback", model, None, taking_turns=taking_turns) as runner:
            options = runner.sess.get_session_options()
            try:
                value = options.get_session_config_entry(FORCE_SPINNING_STOP)
            except RuntimeError:  # not set
                value = None
            assert value == expected


def test_default_providers():
    providers = default_providers()
    assert providers[-1] == "CPUExecutionProvider"
    assert set(providers) <= set(ort.get_available_providers())


@needs_kernel
def test_registered_kernel_takes_precedence_over_the_function(sampled_k2, tmp_path):
    """Profiling shows which implementation ran: the kernel's single ContinuousSliceFFN node,
    or the function's inlined body (ReduceMean, Tanh, ... appear only there)."""
    decoder_io = ExportedModel.read(sampled_k2).io
    feed = dict(decoder_io.dummy_inputs(batch=2, sequence=8, past_sequence=0, seed=3))
    logits, ran = {}, {}
    for kernel in (True, False):
        options = ort.SessionOptions()
        options.enable_profiling = True
        options.profile_file_prefix = str(tmp_path / f"profile_{kernel}")
        session = create_session(sampled_k2, kernel=kernel, options=options)
        logits[kernel] = session.run(["logits"], feed)[0]
        with open(session.end_profiling()) as f:
            ran[kernel] = {e["args"].get("op_name") for e in json.load(f) if e.get("cat") == "Node"}
    assert "ContinuousSliceFFN" in ran[True] and not {"ReduceMean", "Tanh"} & ran[True]
    assert "ContinuousSliceFFN" not in ran[False] and {"ReduceMean", "Tanh"} <= ran[False]
    assert np.abs(logits[True] - logits[False]).max() <= 1e-4


def test_model_without_function_needs_the_kernel(sampled_k2, tmp_path):
    model = onnx.load(str(sampled_k2))
    del model.functions[:]
    for prop in model.metadata_props:
        if prop.key == "infmoe.has_function":
            prop.value = "0"
    path = tmp_path / "no_function.onnx"
    onnx.save(model, str(path))
    with pytest.raises(InfMoEError, match="--no-function"):
        create_session(path, kernel=False)


def test_dense_models_need_the_kernel_only_where_they_hold_infmoe_ops(make_model, tmp_path):
    """A dense model's portable graph is standard ops; on the onnxruntime target it holds infmoe
    ops (attention, at int4 the expert op too), which without functions need the kernel."""
    dense = make_model(d_model=16, n_head=2, slice_width=TINY["ffn_hidden"])
    portable = export_onnx(dense, tmp_path / "portable.onnx", k=1, dtype="int4", block_size=16, function=False)
    assert not portable.io.custom_ops
    create_session(portable, kernel=False)
    for dtype in ("fp32", "int4"):
        exported = export_onnx(dense, tmp_path / f"{dtype}.onnx", k=1, dtype=dtype, block_size=16, function=False,
                               target="onnxruntime")
        assert exported.io.custom_ops and exported.io.experts_in_op == (dtype == "int4")
        with pytest.raises(InfMoEError, match="--no-function"):
            create_session(exported, kernel=False)


@pytest.mark.parametrize("greedy", [True, False])
def test_generation_is_the_same_in_torch_and_onnxruntime(tiny_model, sampled_k2, greedy):
    """Same seed, same expert noise and sampling draws: the same tokens, prefill + cache."""
    prompt = "αβ x".encode("utf-8")
    kwargs = dict(greedy=greedy, temperature=0.9, top_k=40, seed=5)
    new = TINY["n_positions"] - len(prompt)  # up to the longest sequence the model takes
    decoder_io = ExportedModel.read(sampled_k2).io
    expected = generate(TorchRunner(decoder_io, tiny_model), prompt, new + 3, **kwargs)
    actual = generate(OrtRunner(decoder_io, sampled_k2, kernel=False), prompt, new + 3, **kwargs)
    assert len(expected) == new and actual == expected
    assert len(set(expected)) > 1  # not a degenerate constant stream


def test_generate_bad_input(sampled_k2):
    runner = OrtRunner(ExportedModel.read(sampled_k2).io, sampled_k2, kernel=False)
    with pytest.raises(InfMoEError, match="prompt is empty"):
        generate(runner, b"", 3)
    with pytest.raises(InfMoEError, match="no room for new ones"):
        generate(runner, b"x" * (TINY["n_positions"] + 1), 3)
    with pytest.raises(InfMoEError, match="temperature must be positive"):
        generate(runner, b"x", 3, greedy=False, temperature=0)


def test_run_streams_text(sampled_k2, run_cli, tiny_model):
    code, out, err = run_cli("run", "--model", sampled_k2, "--prompt", "héllo", "--max-new-tokens", 6, "--seed", 2,
                             "--no-kernel")
    assert code == 0, err
    tokens = generate(TorchRunner(DecoderIO(tiny_model.config, 2, "sampled"), tiny_model), "héllo".encode(), 6, seed=2)
    assert out == "héllo" + bytes(tokens).decode("utf-8", errors="replace") + "\n"


def test_run_exports_the_checkpoint_once_into_the_cache(tmp_path, run_cli, monkeypatch, make_checkpoint):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    ckpt = make_checkpoint(seed=8)
    code, out, err = run_cli("run", "--checkpoint", ckpt, "--prompt", "ab", "--max-new-tokens", 4, "--greedy",
                             "--no-kernel")
    assert code == 0, err
    assert "exporting" in err and out.startswith("ab")
    cached = list((tmp_path / "cache" / "infmoe-export").glob("*/model.onnx"))
    assert len(cached) == 1 and ExportedModel.read(cached[0]).io.k == TINY["num_samples"]
    # The second run finds it; a different checkpoint gets a different entry (not run here).
    code, again, err = run_cli("run", "--checkpoint", ckpt, "--prompt", "ab", "--max-new-tokens", 4, "--no-kernel")
    assert code == 0 and "exporting" not in err and again == out
    model = load_checkpoint(ckpt)
    expected = generate(TorchRunner(DecoderIO(model.config, model.config.num_samples), model), b"ab", 4)
    assert out == "ab" + bytes(expected).decode("utf-8", errors="replace") + "\n"


def test_run_exports_the_export_choice(tmp_path, run_cli, monkeypatch, make_checkpoint):
    """--dtype int4 runs the all-int4 onnxruntime model (its own cache entry) and generates what
    the reference on its dequantized weights generates; --for portable runs the portable graph."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    ckpt = make_checkpoint(seed=8, d_model=16, n_head=2)  # head_dim 8: onnxruntime's attention fits
    entries = {}
    for flags in (["--dtype", "int4", "--block-size", "16"], ["--for", "portable"]):
        code, out, err = run_cli("run", "--checkpoint", ckpt, "--prompt", "ab", "--max-new-tokens", 4, *flags)
        assert code == 0, err
        cached = set((tmp_path / "cache" / "infmoe-export").glob("*/model.onnx")) - set(entries.values())
        entry, = cached
        entries[flags[1]] = entry
        io = ExportedModel.read(entry).io
        model = load_checkpoint(ckpt)
        assert f"({io.label})" in err
        expected = generate(TorchRunner(io, model), b"ab", 4)
        assert out == "ab" + bytes(expected).decode("utf-8", errors="replace") + "\n"
    assert ExportedModel.read(entries["int4"]).io.label == "onnxruntime all-int4 kv16"
    assert ExportedModel.read(entries["portable"]).io.label == "portable fp32"


@pytest.mark.parametrize("args, message", [
    (["--model", "{tmp}/missing.onnx"], "does not exist"),
    (["--model", "{tmp}/model.onnx", "--greedy", "--temperature", "0.5"], "cannot be combined"),
    (["--model", "{tmp}/model.onnx", "--k", "2"], "cannot be combined with --model"),
    (["--model", "{tmp}/model.onnx", "--dtype", "int4"], "cannot be combined with --model"),
    (["--for", "tensorrt"], "Invalid value for '--for'"),
    (["--dtype", "fp32", "--quantize-other", "int4"], "--quantize-other int4 applies to int8 / int4 models"),
    (["--checkpoint", "{tmp}/missing"], "is not a checkpoint"),
])
def test_run_bad_input(tmp_path, run_cli, args, message, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    (tmp_path / "model.onnx").write_bytes(b"not onnx")
    code, out, err = run_cli("run", "--prompt", "x", *[a.format(tmp=tmp_path) for a in args])
    assert code != 0 and message in err
    if "Invalid value" not in message:  # click's own usage errors take two lines
        assert err.startswith("error: ") and len(err.strip().splitlines()) == 1


def test_run_timings_line(tmp_path, run_cli, monkeypatch, make_checkpoint):
    """--timings adds one line to stderr: the prefill of the prompt, then as many decode steps as
    tokens after the first, their median inside its 95% interval; stdout is the text alone."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    ckpt = make_checkpoint(seed=9, d_model=16, n_head=2)
    code, plain, _ = run_cli("run", "--checkpoint", ckpt, "--prompt", "abc", "--max-new-tokens", 6)
    code, out, err = run_cli("run", "--checkpoint", ckpt, "--prompt", "abc", "--max-new-tokens", 6, "--timings")
    assert code == 0, err
    assert out == plain
    line = err.strip().splitlines()[-1]
    match = re.fullmatch(r"prefill: 3 tokens in ([\d.]+) ms; decode: 5 steps, median ([\d.]+) ms/token "
                         r"\[([\d.]+), ([\d.]+)\], ([\d.]+) tokens/s", line)
    assert match, line
    prefill, median, low, high, rate = map(float, match.groups())
    assert prefill > 0 and 0 < low <= median <= high and rate == pytest.approx(1e3 / median, rel=1e-2)


def test_generate_times_each_model_call(make_checkpoint):
    """generate's timings: one entry per model call (the prefill, then a step per further token)."""
    ckpt = make_checkpoint(seed=10)
    model = load_checkpoint(ckpt)
    seconds = []
    new = generate(TorchRunner(DecoderIO(model.config, model.config.num_samples), model), b"xyz", 5, timings=seconds)
    assert len(new) == 5 and len(seconds) == 5 and all(s > 0 for s in seconds)
