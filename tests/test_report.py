"""Parity, bench and the report files, on a small random odd-shaped checkpoint exported twice
(K = 1 quantile noise, K = 3 sampled noise) with its expert_starts outputs."""

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest

from infmoe_export.checkpoint import save_checkpoint
from infmoe_export.errors import InfMoEError
from infmoe_export.export import export_onnx
from infmoe_export.model import InfMoEConfig, InfMoEGPT
from infmoe_export.verify import parity as parity_lib
from infmoe_export.contract import ExportedModel
from infmoe_export.evaluate import perplexity_of_logits
from infmoe_export.runtimes.registry import find_models
from infmoe_export.report.bench import run_bench
from infmoe_export.report.render import build_report, load_schema, validate_report, write_report
from infmoe_export.report.timing import environment, latency_summary, memory_bandwidth
from infmoe_export.runtimes.ort_kernel import custom_op_library

CONFIG = InfMoEConfig(vocab_size=256, n_positions=40, d_model=24, n_layer=2, n_head=2, ffn_hidden=37,
                      slice_width=9, num_samples=2)
BACKENDS = ["ort", "ort-fallback", "trt"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    import torch

    root = tmp_path_factory.mktemp("report")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model: one thread is fastest on a shared machine
    model = InfMoEGPT(CONFIG)
    model.reset_parameters(seed=1)
    model.eval()
    save_checkpoint(model, root / "checkpoint")
    (root / "models").mkdir()
    for k, noise in ((1, "quantile"), (3, "sampled")):
        export_onnx(model, root / "models" / f"model_k{k}_{noise}.onnx", k=k, noise=noise, with_starts=True)
    models = find_models([root / "models"])
    parity = parity_lib.run_parity(model, models, backends=BACKENDS, max_windows=5)
    bench = run_bench(model, models, backends=["torch", "ort", "ort-fallback", "trt"], batches=(1, 2),
                      seqs=(1, 16), past=8, warmup=1, iters=4, threads=1)
    report = build_report("pipeline", "test", str(root / "checkpoint"), CONFIG.to_dict(), environment(1),
                          parity=parity, bench=bench)
    torch.set_num_threads(threads)
    return {"root": root, "model": model, "models": models, "report": report}


# ---------------------------------------------------------------------------------------------
# Our own statistics


def test_perplexity_of_uniform_logits_is_vocab_size():
    logits = np.zeros((2, 6, 37), dtype=np.float32)
    ids = np.random.default_rng(0).integers(0, 37, (2, 6))
    assert perplexity_of_logits([logits], [ids]) == pytest.approx(37.0)


def test_perplexity_matches_evaluate(setup):
    from infmoe_export.evaluate import perplexity

    chunks, _ = parity_lib.text_windows((), CONFIG.n_positions, 5)
    ours = next(r for r in setup["report"]["parity"]["results"] if r["backend"] == "torch" and r["k"] == 1)
    assert ours["perplexity"] == pytest.approx(perplexity(setup["model"], chunks, 1, "quantile"), rel=1e-5)


def test_error_stats_are_per_token_max():
    rng = np.random.default_rng(1)
    reference = rng.standard_normal((50, 7))
    test = reference.copy()
    test[3, 2] += 0.5
    test[10, 0] -= 0.25
    stats = parity_lib.error_stats(reference, test)
    assert stats["tokens"] == 50
    assert stats["max"] == pytest.approx(0.5)
    assert stats["mean"] == pytest.approx(0.75 / 50)
    assert stats["p50"] == 0.0
    assert stats["max_rel"] >= 0.5 / np.abs(reference[3, 2]) - 1e-12


def test_polygraphy_verdict_uses_atol_or_rtol():
    reference = np.full((4, 5), 10.0, dtype=np.float32)
    test = reference.copy()
    test[0, 0] += 0.05  # abs 0.05, rel 0.005
    assert parity_lib.polygraphy_passes(reference, test, "x", atol=0.1, rtol=0.0)
    assert parity_lib.polygraphy_passes(reference, test, "x", atol=0.0, rtol=0.01)
    assert not parity_lib.polygraphy_passes(reference, test, "x", atol=0.01, rtol=0.001)


def test_start_disagreement_is_counted_and_excluded():
    rng = np.random.default_rng(2)
    logits = rng.standard_normal((1, 6, 11)).astype(np.float32)
    starts = rng.integers(0, 5, (1, 6, 3))
    moved_logits, moved_starts = logits.copy(), starts.copy()
    moved_starts[0, 4, 1] += 1      # one start of token 4 differs...
    moved_logits[0, 4] += 3.0       # ...and so does its output
    reference = [{"logits": logits, "expert_starts.0": starts, "expert_starts.1": starts}]
    test = [{"logits": moved_logits, "expert_starts.0": moved_starts, "expert_starts.1": starts}]
    ids = [rng.integers(0, 11, (1, 6))]
    row = parity_lib.compare_backend("x", reference, test, ids, 1e-4, 1e-4, min_start_agreement=0.9)
    assert row["start_agreement"] == pytest.approx(1 - 1 / 36)
    assert row["agreeing_token_share"] == pytest.approx(5 / 6)
    assert row["clean_token_share"] == pytest.approx(4 / 6)  # token 5 comes after the disagreement
    assert row["error_agreeing"]["max"] == 0.0 and row["error_all"]["max"] == pytest.approx(3.0)
    assert row["error_clean"]["tokens"] == 4
    assert row["status"] == "pass"
    strict = parity_lib.compare_backend("x", reference, test, ids, 1e-4, 1e-4, min_start_agreement=0.99)
    assert strict["status"] == "fail" and "starts agree" in strict["reason"]


def test_latency_summary_percentiles():
    summary = latency_summary([0.001 * i for i in range(1, 101)])
    assert summary["min"] == pytest.approx(1.0)
    assert summary["p50"] == pytest.approx(50.5)
    assert summary["p90"] == pytest.approx(90.1)
    assert summary["p50"] <= summary["p90"] <= summary["p99"] <= 100.0


def test_memory_bandwidth_is_measured():
    bandwidth = memory_bandwidth(mib=64, repeats=2)
    assert 0.1 < bandwidth["read_gbs"] < 10_000 and 0.1 < bandwidth["copy_gbs"] < 10_000


# ---------------------------------------------------------------------------------------------
# Numbers from real runs make physical sense


def test_parity_numbers_are_sensible(setup):
    results = setup["report"]["parity"]["results"]
    assert {(r["backend"], r["k"], r["noise"]) for r in results} == {
        (b, k, n) for b in ["torch"] + BACKENDS for k, n in ((1, "quantile"), (3, "sampled"))}
    ran = [r for r in results if r["status"] in ("pass", "fail")]
    assert {r["backend"] for r in ran} >= {"ort-fallback"}
    for r in results:
        if r["status"] == "skipped":
            assert r["reason"] and r["perplexity"] is None
            continue
        assert math.isfinite(r["perplexity"]) and r["perplexity"] > 1
        assert r["reference_perplexity"] > 1
        assert 0 <= r["top1_agreement"] <= 1
    for r in ran:
        assert r["status"] == "pass", r["reason"]
        assert 0 <= r["start_agreement"] <= 1
        assert 0 <= r["clean_token_share"] <= r["agreeing_token_share"] <= 1
        assert r["start_agreement"] >= 0.999
        for stats in (r["error_all"], r["error_agreeing"], r["error_clean"]):
            assert 0 <= stats["p50"] <= stats["p90"] <= stats["p99"] <= stats["max"] < 1e-3
            assert stats["mean"] <= stats["max"]
        assert r["perplexity"] == pytest.approx(r["reference_perplexity"], rel=1e-4)


def test_kernel_backend_runs_when_built(setup):
    ort = [r for r in setup["report"]["parity"]["results"] if r["backend"] == "ort"]
    if custom_op_library() is None:
        assert all(r["status"] == "skipped" and "kernel" in r["reason"] for r in ort)
    else:
        assert all(r["status"] == "pass" for r in ort)


def test_bench_numbers_are_sensible(setup):
    rows = setup["report"]["bench"]["results"]
    ok = [r for r in rows if r["status"] == "ok"]
    assert {r["backend"] for r in ok} >= {"torch", "ort-fallback"}
    assert {(r["phase"], r["past"]) for r in ok} == {("decode", 8), ("prefill", 0)}
    for r in ok:
        assert r["iters"] == 4
        lat = r["latency_ms"]
        assert 0 < lat["min"] <= lat["p50"] <= lat["p90"] <= lat["p99"]
        assert lat["min"] <= lat["mean"]
        assert r["tokens_per_s"] == pytest.approx(r["batch"] * r["seq"] / lat["mean"] * 1e3)
        assert r["peak_rss_delta_mib"] is None or r["peak_rss_delta_mib"] >= 0
    for r in rows:
        if r["status"] == "skipped":
            assert r["reason"] and r["latency_ms"] is None


def test_tradeoff_has_every_backend_noise_and_k(setup):
    rows = setup["report"]["tradeoff"]
    torch_rows = {(r["noise"], r["k"]): r for r in rows if r["backend"] == "torch"}
    assert set(torch_rows) == {("quantile", 1), ("sampled", 3)}
    for r in torch_rows.values():
        assert r["perplexity"] > 1 and r["decode_ms_p50"] > 0 and r["prefill_tokens_per_s"] > 0


# ---------------------------------------------------------------------------------------------
# Files: schema, Markdown, HTML in a real browser


def test_report_validates_against_schema_and_schema_rejects_nonsense(setup):
    import jsonschema

    report = json.loads(json.dumps(setup["report"]))
    validate_report(report)
    jsonschema.Draft202012Validator.check_schema(load_schema())
    row = next(r for r in report["parity"]["results"] if r["status"] == "pass")
    row["start_agreement"] = 1.5
    with pytest.raises(InfMoEError, match="start_agreement"):
        validate_report(report)
    report = json.loads(json.dumps(setup["report"]))
    next(r for r in report["bench"]["results"] if r["status"] == "ok")["latency_ms"]["p50"] = 0.0
    with pytest.raises(InfMoEError, match="p50"):
        validate_report(report)
    report = json.loads(json.dumps(setup["report"]))
    report["schema_version"] = 2
    with pytest.raises(InfMoEError, match="schema_version"):
        validate_report(report)


def test_written_files(setup, tmp_path):
    paths = write_report(setup["report"], tmp_path / "out")
    assert json.loads(paths["json"].read_text()) == json.loads(json.dumps(setup["report"]))
    markdown = paths["markdown"].read_text()
    assert "| ort-fallback | 1 | quantile | pass |" in markdown and "(tradeoff.png)" in markdown
    page = paths["html"].read_text()
    assert page.count("data:image/png;base64,") == 1
    assert "src=\"http" not in page and "href=\"http" not in page  # self-contained
    assert paths["plot"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [".infmoe-export", "report.html", "report.json",
                                                                    "report.md", "tradeoff.png"]


def test_html_renders_in_headless_chromium(setup, tmp_path):
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        pytest.skip("chromium is not installed (apt-get install -y chromium)")
    from matplotlib.image import imread

    paths = write_report(setup["report"], tmp_path / "out")
    shot = tmp_path / "shot.png"
    subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                    "--disable-component-update", "--disable-sync", "--no-first-run",
                    f"--user-data-dir={tmp_path / 'profile'}", "--window-size=1200,1600",
                    f"--screenshot={shot}", paths["html"].as_uri()], capture_output=True, timeout=120, check=True)
    pixels = imread(str(shot))[..., :3]
    assert pixels.shape[:2] == (1600, 1200)
    # Not blank: a white page with text, tables, the green verdict and the plot's lines.
    non_white = (pixels < 0.9).any(axis=-1).mean()
    assert 0.02 < non_white < 0.8
    green = (pixels[..., 1] > 0.4) & (pixels[..., 0] < 0.2) & (pixels[..., 2] < 0.35)
    assert green.sum() > 200  # the PASSED badge (#1a7f37)
    assert len(np.unique(pixels.reshape(-1, 3), axis=0)) > 50


# ---------------------------------------------------------------------------------------------
# The commands


def perturb(path, out):
    """Copy of an exported model with one weight changed: wte[' ', 0] += 1."""
    model = onnx.load(str(path))
    tensor = next(t for t in model.graph.initializer if t.name.endswith("wte.weight"))
    values = onnx.numpy_helper.to_array(tensor).copy()
    values[ord(" "), 0] += 1.0
    tensor.CopyFrom(onnx.numpy_helper.from_array(values, tensor.name))
    onnx.save(model, str(out))
    return out


def test_parity_command_passes_and_writes_report(setup, tmp_path, run_cli):
    status, out, err = run_cli("parity", "--checkpoint", str(setup["root"] / "checkpoint"),
                           "--model", str(setup["root"] / "models"), "--out", str(tmp_path / "out"), "--k", "1",
                           "--max-windows", "2")
    assert status == 0, err
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    validate_report(report)
    assert report["passed"] and {r["k"] for r in report["parity"]["results"]} == {1}
    assert "report.html" in out


def test_parity_fails_on_perturbed_weight_naming_the_backend(setup, tmp_path):
    """Through the installed console script: the real exit status and stderr."""
    bad = perturb(setup["models"][0].path, tmp_path / "perturbed.onnx")
    result = subprocess.run([str(Path(sys.executable).parent / "infmoe-export"), "parity",
                             "--checkpoint", str(setup["root"] / "checkpoint"), "--model", str(bad),
                             "--out", str(tmp_path / "out"), "--backends", "ort-fallback", "--max-windows", "2"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    line = result.stderr.strip().splitlines()[-1]
    assert line.startswith("error: parity failed for ort-fallback K=1 quantile: ")
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert not report["passed"] and report["failures"]


@pytest.mark.parametrize("args, message", [
    (["--model", "missing.onnx"], "does not exist"),
    (["--backends", "cuda"], "unknown backend 'cuda'"),
    (["--k", "5"], "no model for K=5"),
    (["--k", "0"], "positive integer"),
])
def test_parity_bad_input_is_one_line(setup, tmp_path, run_cli, args, message):
    base = {"--model": str(setup["root"] / "models")}
    for flag, value in zip(args[::2], args[1::2]):
        base[flag] = value
    argv = ["parity", "--checkpoint", str(setup["root"] / "checkpoint"), "--out", str(tmp_path / "out")]
    for flag, value in base.items():
        argv += [flag, value]
    status, _, err = run_cli(*argv)
    assert status == 1 and message in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "out" / "report.json").exists()


def test_parity_rejects_model_of_another_checkpoint(setup, tmp_path, run_cli):
    other = InfMoEGPT(InfMoEConfig(**{**CONFIG.to_dict(), "ffn_hidden": 41}))
    save_checkpoint(other, tmp_path / "other")
    status, _, err = run_cli("parity", "--checkpoint", str(tmp_path / "other"), "--model",
                         str(setup["models"][0].path), "--out", str(tmp_path / "out"))
    assert status == 1 and "different checkpoint (ffn_hidden: 37 vs 41)" in err


def test_bench_command_writes_valid_json(setup, tmp_path, run_cli):
    import torch

    out = tmp_path / "bench.json"
    threads = torch.get_num_threads()
    status, _, err = run_cli("bench", "--checkpoint", str(setup["root"] / "checkpoint"), "--model",
                         str(setup["models"][0].path), "--backends", "torch,ort-fallback", "--k", "1",
                         "--batch", "1", "--seq", "1,8", "--past", "4", "--warmup", "1", "--iters", "3",
                         "--threads", "1", "--json", str(out))
    torch.set_num_threads(threads)
    assert status == 0, err
    report = json.loads(out.read_text())
    validate_report(report)
    assert report["environment"]["torch_threads"] == 1 and report["environment"]["ort_intra_op_threads"] == 1
    assert {(r["backend"], r["phase"]) for r in report["bench"]["results"]} == {
        (b, p) for b in ("torch", "ort-fallback") for p in ("decode", "prefill")}


def test_bench_rejects_sequence_longer_than_model(setup, run_cli):
    status, _, err = run_cli("bench", "--checkpoint", str(setup["root"] / "checkpoint"), "--model",
                         str(setup["models"][0].path), "--seq", "41", "--k", "1")
    assert status == 1 and "--seq 41 must lie in [1, n_positions = 40]" in err


def test_read_model_refuses_non_onnx(tmp_path):
    junk = tmp_path / "junk.onnx"
    junk.write_bytes(b"not a model")
    with pytest.raises(InfMoEError, match="not a readable ONNX model"):
        ExportedModel.read(junk)
