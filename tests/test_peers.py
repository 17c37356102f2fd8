"""The side-by-side benchmark's own code, without running it at size: the GGUF writer (read back
with gguf's reader), the goals and table made from results, argument and memory checks; llama.cpp
itself on a tiny GGUF model where llama_cpp imports."""

import json
from pathlib import Path

import numpy as np
import pytest

from benchmarks import gguf_model, peers, table
from benchmarks.llama import available
from infmoe_export.errors import InfMoEError
from infmoe_export.model import InfMoEConfig

# Dense (H = r), rows a multiple of 32 (Q4_0 / Q8_0 blocks), byte vocabulary + 8 merges + <|endoftext|>.
TINY_GPT2 = InfMoEConfig(vocab_size=265, n_positions=64, d_model=32, n_layer=2, n_head=2, ffn_hidden=128,
                         slice_width=128, num_samples=1)


def test_byte_vocab_is_gpt2_shaped():
    tokens, merges = gguf_model.byte_vocab(265)
    assert len(tokens) == 265 == len(set(tokens)) and tokens[-1] == "<|endoftext|>"
    assert tokens[ord("a")] == "a" and tokens[ord(" ")] == "Ġ" and tokens[ord("\n")] == "Ċ"
    assert len(merges) == 8 and all(" ".join(m.split(" ")) == m and "".join(m.split(" ")) in tokens for m in merges)
    assert len(gguf_model.byte_vocab(50257)[1]) == 50000  # GPT-2's own count
    with pytest.raises(InfMoEError, match="257 to"):
        gguf_model.byte_vocab(100)


@pytest.mark.parametrize("file_type, element_bytes", [("F16", 2), ("Q8_0", 34 / 32), ("Q4_0", 18 / 32)])
def test_gguf_writer_round_trip(tmp_path, file_type, element_bytes):
    gguf = pytest.importorskip("gguf", reason="the gguf package is not installed (pip install gguf)")
    path = gguf_model.write_gpt2(tmp_path / "tiny.gguf", TINY_GPT2, file_type)
    assert [p.name for p in tmp_path.iterdir()] == ["tiny.gguf"]  # no temporary file left
    reader = gguf.GGUFReader(path)

    def field(name):
        f = reader.fields[name]
        return f.contents() if hasattr(f, "contents") else f.parts[f.data[0]].tolist()

    assert field("general.architecture") == "gpt2"
    assert field("gpt2.embedding_length") == 32 and field("gpt2.block_count") == 2
    assert field("gpt2.feed_forward_length") == 128 and field("gpt2.attention.head_count") == 2
    assert field("gpt2.context_length") == 64 and field("tokenizer.ggml.model") == "gpt2"
    assert len(reader.fields["tokenizer.ggml.tokens"].data) == 265
    assert len(reader.fields["tokenizer.ggml.merges"].data) == 8
    tensors = {t.name: t for t in reader.tensors}
    assert len(tensors) == 2 + 12 * 2 + 2 and "output.weight" not in tensors  # the LM head is the tied embedding
    qkv, down, norm = tensors["blk.0.attn_qkv.weight"], tensors["blk.1.ffn_down.weight"], tensors["output_norm.bias"]
    assert list(qkv.shape) == [32, 96] and list(down.shape) == [128, 32]  # GGUF order: columns first
    assert qkv.tensor_type.name == file_type and tensors["token_embd.weight"].tensor_type.name == file_type
    assert norm.tensor_type.name == "F32" and tensors["position_embd.weight"].tensor_type.name == "F32"
    assert qkv.n_bytes == int(32 * 96 * element_bytes)
    # What was written is the random matrix at that precision.
    expected = dict(gguf_model.gpt2_tensors(TINY_GPT2))["blk.0.attn_qkv.weight"]
    stored = gguf.quants.dequantize(qkv.data, qkv.tensor_type).reshape(96, 32)
    assert np.abs(stored - expected).max() <= 0.2 * np.abs(expected).max()


def test_gguf_writer_refuses_what_llama_cpp_cannot_run(tmp_path):
    pytest.importorskip("gguf", reason="the gguf package is not installed (pip install gguf)")
    with pytest.raises(InfMoEError, match="file type"):
        gguf_model.write_gpt2(tmp_path / "x.gguf", TINY_GPT2, "Q2_K")
    moe = InfMoEConfig(**{**TINY_GPT2.to_dict(), "slice_width": 32, "num_samples": 2})
    with pytest.raises(InfMoEError, match="dense"):
        gguf_model.write_gpt2(tmp_path / "x.gguf", moe, "F16")
    assert not list(tmp_path.iterdir())


def with_samples(row, count=None):
    """A result row with samples_ms: three rounds at its figures, the second one 5 times slower
    for every contender (a machine slowed down for a round)."""
    ms = row.get("ms") or {name: count / rate * 1e3 for name, rate in row["tokens_per_s"].items()}
    return {**row, "samples_ms": {name: [v, 5 * v, v] for name, v in ms.items()}}


def fake_result(quick=False, skipped=None):
    """A peers.json as benchmarks.peers writes it, with round numbers."""
    names = [peers.ours_name("all-int4", 2), peers.ours_name("all-int4", 8), peers.SMALL_Q4, peers.MEDIUM_Q4]
    curve = {1: 200.0, 2: 380.0, 4: 90.0, 16: 700.0}  # a cliff at B = 4
    return {
        "benchmark": "peers",
        "machine": {"cpu": "Test CPU 9000", "cores": 2, "date": "2030-01-02T03:04:05+00:00", "python": "3.11.7",
                    "load_average": [0.5, 0.25, 0.1],
                    "versions": {"infmoe-export": "0.1.0", "onnxruntime": "1.32.0", "llama-cpp-python": "0.3.36",
                                 "torch": "2.13.0"}},
        "plan": {"ks": [2, 8]}, "options": {"threads": 2, "quick": quick},
        "skipped": skipped or {},
        "contenders": [{"name": n} for n in names],
        "decode": [with_samples({"past": 128, "ms": {names[0]: 3.5, names[1]: 4.0, names[2]: 5.0, names[3]: 14.0}})],
        "batched": [with_samples({"batch": b, "tokens_per_s": {names[0]: rate, names[2]: 250.0}}, b)
                    for b, rate in curve.items()],
        "prefill": [with_samples({"tokens": 512, "tokens_per_s": {names[0]: 600.0, names[1]: 550.0, names[2]: 1000.0,
                                                                  names[3]: 200.0}}, 512)],
        "memory": {names[0]: {"model_rss_bytes": 150 * 2**20}, names[2]: {"error": "child failed"}},
    }


def test_goals_are_ratios_to_the_peers_and_find_the_cliff():
    result = fake_result()
    goals = {g["what"]: g for g in peers.goals(result)}
    decode = goals["batch-1 decode, past 128: ours K=2 all-int4 vs llama.cpp Small Q4_0"]
    assert decode["value"] == pytest.approx(5.0 / 3.5) and decode["met"]
    assert goals["batched decode B=16: ours K=2 all-int4 vs llama.cpp Small Q4_0"]["value"] == pytest.approx(2.8)
    assert goals["prefill 512: ours K=2 all-int4 vs llama.cpp Small Q4_0"]["value"] == pytest.approx(0.6)
    assert goals["prefill 512: ours K=8 all-int4 vs llama.cpp Medium Q4_0"]["value"] == pytest.approx(2.75)
    cliff = goals["batched decode never falls as B grows: ours all-int4 K=2, worst B over the best smaller B"]
    assert cliff["value"] == pytest.approx(90 / 380) and not cliff["met"]
    assert goals["batched decode B=16 over B=1: ours all-int4 K=2"]["value"] == pytest.approx(3.5)
    # Speed-ups pair the rounds: a round slow for the peer alone does not count as ours being fast.
    small = result["decode"][0]["samples_ms"]
    small[peers.ours_name("all-int4", 2)], small[peers.SMALL_Q4] = [20.0, 4.0, 4.0], [25.0, 25.0, 5.0]
    assert {g["what"]: g for g in peers.goals(result)}[decode["what"]]["value"] == pytest.approx(1.25)
    # With B = 1 timed in B = 16's rounds, the curve's goal pairs them: the median of per-round ratios.
    ours = peers.ours_name("all-int4", 2)
    top = next(row for row in result["batched"] if row["batch"] == 16)
    top["samples_ms"][ours], top["b1_samples_ms"] = [40.0, 10.0, 30.0], {ours: [4.0, 5.0, 1.0]}
    gain = {g["what"]: g for g in peers.goals(result)}["batched decode B=16 over B=1: ours all-int4 K=2"]
    assert gain["value"] == pytest.approx(16 * 4.0 / 40.0) and not gain["met"]  # medians' ratio: 16 * 4 / 30
    # A measurement a run did not make gives no goal (not a zero, not a failure).
    del result["prefill"][0]["samples_ms"][peers.MEDIUM_Q4]
    assert "prefill 512: ours K=8 all-int4 vs llama.cpp Medium Q4_0" not in {g["what"] for g in peers.goals(result)}


def test_measure_times_b1_in_the_top_batch_rounds(monkeypatch):
    """The B = 16 rounds also time our batched contenders' B = 1 step (the curve's paired goal),
    recorded apart from the B = 16 samples; the other rows carry no such samples, and a peer's
    B = 1 is not paired (a llama.cpp model keeps one batch size's context at a time)."""
    calls = []
    ours, peer = peers.ours_name("all-int4", peers.BATCHED_K), peers.SMALL_Q4

    def step_factory(name):
        return lambda past, b: (lambda: calls.append((name, b)))

    contenders = [peers.Contender(name, "rt", "m", "p", 2, Path("x"), decode=lambda past: (lambda: None),
                                  batched=step_factory(name) if name != "nbits" else None,
                                  prefill=lambda n: (lambda: None), rss=dict) for name in (ours, peer, "nbits")]
    monkeypatch.setattr(peers, "timed", lambda cs, make, rounds, steps: {
        c.name: [float(len(c.name))] * rounds for c in cs if make(c) and not make(c)()})
    plan = peers.Plan(pasts=(), batches=(1, 4, 16), prefills=())
    result = peers.measure(contenders, plan, rounds=2, log=lambda _: None)
    rows = {row["batch"]: row for row in result["batched"]}
    assert rows[16]["b1_samples_ms"] == {ours: [float(len(peers.at_b1(ours)))] * 2}
    assert set(rows[16]["samples_ms"]) == {ours, peer} and "b1_samples_ms" not in rows[4]
    # B = 16's rounds: each contender at B = 16, then ours at B = 1
    assert calls == [(name, b) for b in (1, 4, 16) for name in (ours, peer)] + [(ours, 1)]


def write_results(folder, result):
    folder.mkdir()
    (folder / "peers.json").write_text(json.dumps({**result, "goals": peers.goals(result)}))
    return folder


def test_table_rewrites_only_the_block(tmp_path):
    result = fake_result(skipped={"llama.cpp Medium": "not built"})
    result["contenders"] += [{"name": peers.ours_name("fp32", 1)}, {"name": peers.llama_name("Small", "F16")}]
    results = write_results(tmp_path / "results", result)
    readme = tmp_path / "README.md"
    readme.write_text(f"# Title\n\nbefore\n{table.BEGIN}\nold table\n{table.END}\nafter\n")
    table.main(["--results", str(results), "--readme", str(readme)])
    text = readme.read_text()
    assert text.startswith("# Title\n\nbefore\n" + table.BEGIN + "\n") and text.endswith(table.END + "\nafter\n")
    assert "old table" not in text
    block = text[text.index(table.BEGIN):text.index(table.END)]
    rows = [line for line in block.splitlines() if line.startswith("| ours") or line.startswith("| llama")]
    assert rows[0] == "| ours all-int4 K=2 | 3.50 | 200 | 700 | 600 | 150 |"
    assert rows[2] == "| llama.cpp Small Q4_0 | 5.00 | 250 | 250 | 1000 | – |"  # its RSS child failed
    assert "| 2 threads | decode, past 128: ms/token | batched B = 1: tokens/s | batched B = 16: tokens/s |" in block
    assert "Test CPU 9000, 2 cores (load average 0.2 over the last 5 minutes), 2 threads; Python 3.11.7, infmoe-export 0.1.0, onnxruntime 1.32.0, " \
           "llama-cpp-python 0.3.36, torch 2.13.0." in block
    assert "Not measured: llama.cpp Medium (not built)." in block
    assert "ours fp32 K=1" not in block and "Small F16" not in block  # the README's rows: K = 2, Q4_0 (and K = 8 int4)
    assert "Shown: 4 of its 6 contenders" in block
    assert "- batch-1 decode, past 128: ours K=2 all-int4 vs llama.cpp Small Q4_0: 1.43 (met: at least 1.3)" in block
    assert sorted(p.name for p in tmp_path.iterdir()) == ["README.md", "results"]  # no temporary file left
    table.main(["--results", str(results), "--readme", str(readme)])
    assert readme.read_text() == text  # the same results, the same README


def test_table_prints_and_refuses_what_it_cannot_use(tmp_path, capsys):
    results = write_results(tmp_path / "results", fake_result(quick=True))
    readme = tmp_path / "README.md"
    readme.write_text("# no markers here\n")
    table.main(["--results", str(results), "--readme", str(readme), "--print"])
    out = capsys.readouterr().out
    assert out.startswith("| 2 threads |") and "A `--quick` run" in out
    for argv, message in [
            (["--results", str(results), "--readme", str(readme)], "README has no results markers"),
            (["--results", str(tmp_path / "none"), "--print"], "peers.json: run `python -m benchmarks.peers` first"),
    ]:
        with pytest.raises(SystemExit) as exit_info:
            table.main(argv)
        assert message in str(exit_info.value.code) and "\n" not in str(exit_info.value.code)
    assert readme.read_text() == "# no markers here\n"
    (results / "peers.json").write_text("{\"benchmark\": \"peers\"")
    with pytest.raises(SystemExit) as exit_info:
        table.main(["--results", str(results), "--print"])
    assert "is not readable JSON" in str(exit_info.value.code)
    (results / "peers.json").write_text("{\"benchmark\": \"quant_model\"}")
    with pytest.raises(SystemExit) as exit_info:
        table.main(["--results", str(results), "--print"])
    assert "not a results file of benchmarks.peers" in str(exit_info.value.code)


@pytest.mark.parametrize("argv, flag", [(["--rounds", "0"], "--rounds"), (["--threads", "0"], "--threads"),
                                        (["--threads", "two"], "--threads"), (["--quick", "--rounds", "1e3"], "--rounds")])
def test_peers_bad_arguments_are_one_line_errors(argv, flag, capsys):
    with pytest.raises(SystemExit) as exit_info:
        peers.main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flag}" in err.strip().splitlines()[-1] and "Traceback" not in err


def test_peers_refuses_a_plan_that_does_not_fit_before_allocating(monkeypatch):
    from benchmarks.shapes import SMALL

    monkeypatch.setattr(peers, "available_memory_bytes", lambda: 4 * 2**30)
    with pytest.raises(SystemExit) as exit_info:
        peers.check_memory(peers.Plan(), SMALL)  # B = 32: a 2.4 GB cache per precision
    assert "GiB (B = 32), 4.0 GiB is available: use --quick" in str(exit_info.value.code)
    peers.check_memory(peers.QUICK, SMALL)
    assert peers.kv_cache_bytes(SMALL, 32) == 2 * 12 * 32 * 1024 * 768 * 4


def test_peers_table_lists_every_contender():
    result = fake_result()
    header, rows = peers.table_header(result), peers.table_rows(result)
    assert header[0] == "contender" and header[-1] == "RSS MiB" and len(rows) == 4
    assert all(len(row) == len(header) for row in rows)
    assert rows[1][0] == "ours all-int4 K=8" and rows[1][-1] == "–"


needs_llama = pytest.mark.skipif(bool(available()), reason=available() or "llama_cpp imports")


@needs_llama
def test_llama_cpp_runs_the_written_gguf(tmp_path):
    """The steps peers times, on a tiny GGUF model: decode at an exact past, B sequences, prefill;
    and the RSS child."""
    from benchmarks.llama import LlamaModel
    from benchmarks.peers import llama_rss

    path = gguf_model.write_gpt2(tmp_path / "tiny.gguf", TINY_GPT2, "Q4_0")
    model = LlamaModel(path, threads=1)
    try:
        tokens = np.arange(40) % 256
        step = model.step_at(tokens, past=16)
        for _ in range(3):  # every call at the same past: the cache does not grow
            step()
        batched = model.step_at(tokens, past=16, batch_size=4)
        batched()
        batched()
        model.prefill_at(tokens[:32])()
        step = model.step_at(tokens, past=30)
        step()
        with pytest.raises(ValueError, match="do not fit the model's 64 positions"):
            model.step_at(np.arange(80) % 256, past=64)  # llama.cpp itself would abort the process
    finally:
        model.close()
    measured = llama_rss(path, 1, past=16)
    assert measured["peak_rss_bytes"] >= measured["rss_before_load_bytes"] > 0, measured
    assert llama_rss(path, 1, past=100) == {"error": "benchmarks.llama: 101 tokens do not fit the model's 64 positions"}


@pytest.mark.parametrize("precision", list(peers.PRECISIONS))
def test_our_contender_times_decode_batches_and_prefill(tmp_path, precision):
    """The steps peers times on our exports, on a tiny one: the same past every call, B
    sequences at once, a prefill (its last logits); timed together with the shared harness."""
    from conftest import TINY, random_model
    from infmoe_export.export import export_onnx
    from infmoe_export.runtimes.ort_kernel import custom_op_library

    if custom_op_library() is None:
        pytest.skip("the compiled kernel is not installed")
    config = InfMoEConfig(**{**TINY, "d_model": 32, "n_head": 2})  # int4 blocks of 32 along D
    options, activations = peers.precision_options(precision)
    exported = export_onnx(random_model(config), tmp_path / "tiny.onnx", k=2, block_size=32, target="onnxruntime",
                           **options)
    contender = peers.onnxruntime_contender("tiny", "onnxruntime", "tiny", precision, 2, exported, 1, batched=True,
                                            activations=activations)
    decode = contender.decode(8)
    first = decode()["logits"].copy()
    np.testing.assert_array_equal(decode()["logits"], first)  # at exactly past 8 again, not 9
    batched = contender.batched(8, 3)()["logits"]
    assert batched.shape == (3, 1, config.vocab_size)
    np.testing.assert_allclose(batched[1], first[0], rtol=1e-4, atol=1e-4)  # a row does not depend on its batch
    # A prefill returns the last position's logits (llama.cpp's pp512 does the same): the row a
    # decode step after 15 cached tokens gives for token 16.
    last = contender.prefill(16)()["logits"].copy()
    assert last.shape == (1, 1, config.vocab_size)
    np.testing.assert_allclose(last[0], contender.decode(15)()["logits"][0], rtol=1e-4, atol=1e-4)
    samples = peers.timed([contender], lambda c: c.batched(8, 2), rounds=2, steps=2)
    assert len(samples["tiny"]) == 2 and all(ms > 0 for ms in samples["tiny"])
    assert contender.describe()["file_bytes"] > 0


def test_table_states_the_quality_comparison_whichever_way_it_falls(tmp_path):
    results = write_results(tmp_path / "results", fake_result())
    rows = [{"model": "∞-MoE", "k": 2, "mean": 4.9, "spread": 0.05, "perplexities": [4.85, 4.9, 4.95]},
            {"model": "moe top-2", "k": 2, "mean": 4.7, "spread": 0.02, "perplexities": [4.68, 4.7, 4.72]},
            {"model": "∞-MoE", "k": 1, "mean": 5.5, "spread": None, "perplexities": [5.5]},
            {"model": "moe top-1", "k": 1, "mean": 4.6, "spread": None, "perplexities": [4.6]}]
    (results / "moe_quality.json").write_text(json.dumps({"rows": rows}))
    table.main(["--results", str(results), "--print"])
    lines = table.quality_lines(results)
    assert "- held-out perplexity, ∞-MoE K=2: 4.900 ± 0.050 (3 seeds); conventional MoE top-2: 4.700 ± 0.020 (3 seeds)" in lines
    assert "- held-out perplexity, ∞-MoE K=1: 5.500 (1 seed); conventional MoE top-1: 4.600 (1 seed)" in lines
    (results / "moe_quality.json").write_text("{}")
    with pytest.raises(SystemExit) as exit_info:
        table.main(["--results", str(results), "--print"])
    assert "not a results file of benchmarks.moe_quality" in str(exit_info.value.code)
