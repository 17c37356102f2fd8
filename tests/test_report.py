"""Parity, bench, memory and the report files, on a small random odd-shaped checkpoint exported
twice (K = 1 quantile noise, K = 3 sampled noise) and once with int4 expert weights (K = 1), with its
expert_starts outputs; the timing
statistics on synthetic timings; the page in a real headless Chromium."""

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
from infmoe_export.report import timing
from infmoe_export.report.timing import within_noise
from infmoe_export.options import export_choices, precision_list
from infmoe_export.report.bench import run_bench
from infmoe_export.report.memory import run_memory
from infmoe_export.report.render import PLOT_ALT, build_report, load_schema, validate_report, write_report
from infmoe_export.report.timing import environment, latency_summary, median_ci, memory_bandwidth
from infmoe_export.report.tradeoff import plot_tradeoff
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
    export_onnx(model, root / "models" / "model_k1_quantile_int4.onnx", k=1, dtype="int4", block_size=16,
                with_starts=True)
    models = find_models([root / "models"])
    parity = parity_lib.run_parity(model, models, backends=BACKENDS, max_windows=5)
    bench = run_bench(model, models, backends=["torch", "ort", "ort-fallback", "trt"], batches=(1, 2),
                      seqs=(1, 16), past=8, warmup=1, iters=12, budget_s=0.2, threads=1)
    memory = run_memory(model, models, backends=["torch", "ort-fallback", "trt"], checkpoint=str(root / "checkpoint"),
                        past=8, threads=1)
    report = build_report("pipeline", "test", str(root / "checkpoint"), CONFIG.to_dict(), environment(1),
                          parity=parity, bench=bench, memory=memory)
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


def test_level2_budget_names_each_figure():
    problems = parity_lib.budget_problems({"perplexity_increase": 0.05, "float_top1_agreement": 0.8}, 0.03, 0.9)
    assert problems == ["level 2: perplexity +5.00% over float (budget 3%)",
                        "level 2: top-1 agrees with float on 80.00% (< 90%)"]
    assert parity_lib.budget_problems({"perplexity_increase": 0.01, "float_top1_agreement": 0.95}, 0.03, 0.9) == []


def test_quantized_model_is_judged_on_two_levels(setup):
    """int4: level 1 against PyTorch on the dequantized weights, level 2 against the float model
    (verify.quality.quality_vs_float), both shown; the reference row carries quantization's own cost."""
    rows = {r["backend"]: r for r in setup["report"]["parity"]["results"] if r["dtype"] == "int4"}
    reference = rows["torch"]
    float_ppl = next(r["perplexity"] for r in setup["report"]["parity"]["results"]
                     if (r["backend"], r["dtype"], r["k"], r["noise"]) == ("torch", "fp32", 1, "quantile"))
    assert reference["float_perplexity"] == pytest.approx(float_ppl, rel=1e-5)
    assert reference["perplexity_increase"] == pytest.approx(reference["perplexity"] / float_ppl - 1, abs=1e-6)
    fallback = rows["ort-fallback"]
    assert fallback["status"] == "pass" and fallback["level1"] == "pass" and fallback["level2"] == "pass"
    assert fallback["perplexity"] == pytest.approx(reference["perplexity"], rel=1e-4)  # level 1: same math
    assert 0.9 <= fallback["float_top1_agreement"] <= 1
    verdict = next(v for v in setup["report"]["verdicts"] if (v["backend"], v["dtypes"]) == ("ort-fallback", ["int4"]))
    assert verdict["status"] == "passed" and "vs float" in verdict["text"]


def test_a_verdict_line_without_clean_tokens(setup):
    """A row with no clean token (every window moved a start early, as int8 activations can on
    the bundled model) has no level-1 error to show: its verdict line names the rest."""
    from infmoe_export.report.render import verdicts

    parity = setup["report"]["parity"]
    none = {"tokens": 0, "max": None, "mean": None, "p50": None, "p90": None, "p99": None, "max_rel": None}
    rows = [{**r, "error_clean": none, "clean_token_share": 0.0} if r["backend"] == "ort-fallback" else r
            for r in parity["results"]]
    line = next(v for v in verdicts({**parity, "results": rows}, None)
                if (v["backend"], v["dtypes"]) == ("ort-fallback", ["int4"]))
    assert line["status"] == "passed" and "Δlogit" not in line["text"] and "vs float" in line["text"]


def test_level2_budget_fails_a_backend_naming_the_figure(setup):
    strict = parity_lib.run_parity(setup["model"], [m for m in setup["models"] if m.io.dtype == "int4"],
                                   backends=["ort-fallback"], max_windows=2, max_ppl_increase=0.0, min_top1=1.0)
    row = next(r for r in strict["results"] if r["backend"] == "ort-fallback")
    assert row["status"] == "fail" and row["level1"] == "pass" and row["level2"] == "fail"
    assert "level 2: perplexity" in row["reason"] or "level 2: top-1" in row["reason"]
    assert parity_lib.failures(strict)[0].startswith("ort-fallback int4 K=1 quantile: level 2: ")


def test_pipeline_reads_level2_as_advice(setup, tmp_path):
    """The pipeline's reading: int4 over a strict accuracy budget with its kernel right is over the
    budget, not failed: the report passes, its headline names the precision and the figure, the
    recommendation leaves it out. A row that also failed level 1 still fails."""
    from infmoe_export.report.render import level2_as_advice

    models = [m for m in setup["models"] if m.noise == "quantile"]  # fp32 and int4, K = 1
    strict = parity_lib.run_parity(setup["model"], models, backends=["ort-fallback"], max_windows=2,
                                   max_ppl_increase=1e-5, min_top1=1.0)
    read = level2_as_advice(strict)
    rows = {r["dtype"]: r for r in read["results"] if r["backend"] == "ort-fallback"}
    assert rows["fp32"]["status"] == "pass"  # the same math as the float reference
    assert rows["int4"]["level1"] == "pass" and rows["int4"]["level2"] == "fail"
    assert rows["int4"]["status"] == "over_budget" and parity_lib.failures(read) == []
    assert parity_lib.failures(strict)  # the `parity` command's reading is unchanged

    report = build_report("pipeline", "test", "ckpt", CONFIG.to_dict(), environment(1), parity=read,
                          bench=setup["report"]["bench"])
    assert report["passed"] and report["failures"] == []
    assert report["over_budget"] == [f"ort-fallback int4 K=1 quantile: {rows['int4']['reason']}"]
    assert report["recommendation"]["dtype"] == "fp32"
    assert {p["label"] for p in report["recommendation"]["front"]}.isdisjoint({"ort-fallback int4 K=1 quantile"})
    verdict = next(v for v in report["verdicts"] if (v["backend"], v["dtypes"]) == ("ort-fallback", ["int4"]))
    assert verdict["status"] == "over_budget" and "over the accuracy budget at K 1: " in verdict["text"]
    paths = write_report(report, tmp_path / "out")
    markdown = paths["markdown"].read_text()
    assert '<span class="verdict pass">PASSED</span> <span class="remark">— int4 over the accuracy budget: ' in \
        paths["html"].read_text()
    first = markdown.splitlines()[0]
    assert first.startswith("# infmoe-export pipeline: PASSED — int4 over the accuracy budget: ")
    assert ("perplexity +" in first) == (rows["int4"]["perplexity_increase"] > 1e-5)
    assert ("top-1 agreeing with float" in first) == (rows["int4"]["float_top1_agreement"] < 1.0)
    assert "- ! ort-fallback int4: over budget — K 1; quantile noise; " in markdown
    assert "| ort-fallback | int4 | quantile | 1 | over budget |" in markdown

    broken = {**strict, "results": [{**r, "level1": "fail"} if r["status"] == "fail" else r
                                    for r in strict["results"]]}
    assert [r["status"] for r in level2_as_advice(broken)["results"]] == [r["status"] for r in broken["results"]]
    assert not build_report("pipeline", "test", "ckpt", CONFIG.to_dict(), environment(1),
                            parity=level2_as_advice(broken))["passed"]


def test_block_size_is_checked_whenever_given():
    """Given with no int8 / int4 model a block size is unused, but a bad one is still a mistake."""
    assert precision_list("int4, fp32") == ["fp32", "int4"]
    export_choices(CONFIG, ["fp32"])  # the default: nothing to check
    for dtypes in (["fp32"], ["fp32", "int4"]):
        with pytest.raises(InfMoEError, match="--block-size: block size must be a power of two >= 16, got 24"):
            export_choices(CONFIG, dtypes, block_size=24)


def test_latency_summary_percentiles():
    summary = latency_summary([0.001 * i for i in range(1, 101)])
    assert summary["min"] == pytest.approx(1.0)
    assert summary["median"] == pytest.approx(50.5)
    assert summary["p90"] == pytest.approx(90.1)
    assert summary["ci_low"] <= summary["median"] <= summary["ci_high"]
    assert summary["median"] <= summary["p90"] <= summary["p99"] <= 100.0


def test_median_interval_is_the_binomial_order_statistics():
    # n = 100: the 95% interval of the median is x_(40) .. x_(61) (1-based), tables of the binomial.
    assert median_ci(list(range(1, 101))) == (40.0, 61.0)
    assert median_ci([3.0, 1.0, 2.0]) == (1.0, 3.0)  # too few samples for 95%: the extremes


def test_median_interval_covers_a_known_median():
    """Synthetic timings with a known spread: lognormal(0, 0.3), median exactly 1 ms."""
    rng = np.random.default_rng(5)
    trials = [median_ci(rng.lognormal(0.0, 0.3, 40)) for _ in range(2000)]
    coverage = np.mean([low <= 1.0 <= high for low, high in trials])
    assert 0.94 <= coverage <= 0.985  # at least the nominal 95% (order statistics are conservative)
    widths = np.mean([high - low for low, high in trials])
    assert 0.12 < widths < 0.35  # about 2 × 1.96 × 1.2533 × 0.3 / sqrt(40) for this spread


@pytest.fixture
def fake_clock(monkeypatch):
    """timing's clock, advanced only by the calls under test: the scheduler's jitter cannot enter."""
    from types import SimpleNamespace

    now = [0.0]
    monkeypatch.setattr(timing, "time", SimpleNamespace(perf_counter=lambda: now[0]))

    def spend(seconds):
        now[0] += seconds
    return spend


def test_interleaved_stops_when_stable_and_respects_the_budget(fake_clock):
    rng = np.random.default_rng(0)
    steady = timing.interleaved([lambda: fake_clock(rng.uniform(0.0019, 0.0021))] * 2, warmup=1,
                                max_iters=10_000, budget_s=60.0, rel_ci=0.1)
    assert all(timing.MIN_ITERS <= len(s) < 40 for s in steady)  # stops once stable, long before the budget

    noisy = timing.interleaved([lambda: fake_clock(rng.uniform(0, 0.004))] * 2, warmup=0, max_iters=10_000,
                               budget_s=0.3, rel_ci=1e-6)
    assert len(noisy[0]) == len(noisy[1]) >= timing.MIN_ITERS  # one call of each per round
    assert 0.3 <= sum(map(sum, noisy)) < 0.3 + 2 * 0.004  # stops at the first round past the budget


def test_primed_calls_are_timed_right_after_one_of_their_own(fake_clock):
    """A call is slow when another fn ran last (cold weights): primed rounds time only warm calls."""
    last = [None]

    def call(name):
        def fn():
            fake_clock(4.0 if last[0] != name else 0.5)
            last[0] = name
        return fn

    calls = [call("a"), call("b"), call("c")]
    cold = timing.interleaved(calls, warmup=0, max_iters=10, budget_s=1e9, rel_ci=None)
    warm = timing.interleaved(calls, warmup=0, max_iters=10, budget_s=1e9, rel_ci=None, primed=True)
    assert all(len(s) == 10 for s in cold + warm)
    assert all(x == 0.5 for s in warm for x in s)
    assert all(np.median(s) == 4.0 for s in cold)  # only a round's first call can follow its own fn


def test_within_noise_is_interval_overlap():
    a = {"median": 1.0, "ci_low": 0.9, "ci_high": 1.1}
    assert timing.within_noise(a, {"median": 1.15, "ci_low": 1.05, "ci_high": 1.2})
    assert not timing.within_noise(a, {"median": 1.3, "ci_low": 1.2, "ci_high": 1.4})


def test_memory_bandwidth_is_measured():
    bandwidth = memory_bandwidth(mib=64, repeats=2)
    assert 0.1 < bandwidth["read_gbs"] < 10_000 and 0.1 < bandwidth["copy_gbs"] < 10_000


# ---------------------------------------------------------------------------------------------
# Numbers from real runs make physical sense


def test_parity_numbers_are_sensible(setup):
    results = setup["report"]["parity"]["results"]
    assert {(r["backend"], r["dtype"], r["k"], r["noise"]) for r in results} == {
        (b, d, k, n) for b in ["torch"] + BACKENDS for d, k, n in (("fp32", 1, "quantile"), ("fp32", 3, "sampled"),
                                                                  ("int4", 1, "quantile"))}
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
        assert timing.MIN_ITERS <= r["iters"] <= 12 and r["baseline"] is None
        lat = r["latency_ms"]
        assert 0 < lat["min"] <= lat["ci_low"] <= lat["median"] <= lat["ci_high"]
        assert lat["median"] <= lat["p90"] <= lat["p99"] and lat["min"] <= lat["mean"]
        assert r["tokens_per_s"] == pytest.approx(r["batch"] * r["seq"] / lat["median"] * 1e3)
    # One shape's configurations are timed in the same rounds: the same number of calls each.
    decode = [r for r in ok if r["phase"] == "decode" and r["batch"] == 1 and r["noise"] == "quantile"]
    assert len({r["iters"] for r in decode}) == 1 and {r["dtype"] for r in decode} == {"fp32", "int4"}
    torch_int4 = [r for r in rows if r["backend"] == "torch" and r["dtype"] == "int4"]
    assert torch_int4 and all(r["status"] == "skipped" and "float weights" in r["reason"] for r in torch_int4)
    for r in rows:
        if r["status"] == "skipped":
            assert r["reason"] and r["latency_ms"] is None


def test_tradeoff_has_every_backend_noise_and_k(setup):
    rows = setup["report"]["tradeoff"]
    torch_rows = {(r["noise"], r["k"]): r for r in rows if r["backend"] == "torch" and r["dtype"] == "fp32"}
    assert set(torch_rows) == {("quantile", 1), ("sampled", 3)}
    for r in torch_rows.values():
        assert r["perplexity"] > 1 and r["decode_ms"]["median"] > 0 and r["prefill_tokens_per_s"] > 0
        assert r["parity"] == "reference" and r["perplexity_increase"] == 0.0 and r["dtype"] == "fp32"
    best = setup["report"]["recommendation"]
    # Among quantile-noise rows (the deployment mode, what the chart shows) that passed: the front,
    # fastest first, each point faster than the next and more accurate than the one before.
    fit = [r for r in rows if r["parity"] in ("pass", "reference") and r["decode_ms"] and r["noise"] == "quantile"]
    front = best["front"]
    assert {p["label"] for p in front} <= {f"{r['backend']} {r['dtype']} K={r['k']} {r['noise']}" for r in fit}
    for a, b in zip(front, front[1:]):
        assert a["decode_ms"]["median"] <= b["decode_ms"]["median"] and a["perplexity"] > b["perplexity"]
    assert best["best_perplexity"] == min(r["perplexity"] for r in fit) == front[-1]["perplexity"]
    assert best["perplexity_bound"] == pytest.approx(best["best_perplexity"] * 1.02)
    assert best["perplexity"] <= best["perplexity_bound"]
    assert not any(r["decode_ms"]["median"] < best["decode_ms"]["median"] and r["perplexity"] <= best["perplexity"]
                   for r in fit)  # nothing beats it on both axes


def front_row(k, ppl, median, low, high, parity="pass"):
    return {"backend": "ort", "dtype": "fp32", "noise": "quantile", "k": k, "perplexity": ppl, "parity": parity,
            "decode_ms": {"median": median, "ci_low": low, "ci_high": high}}


def test_recommendation_is_the_fastest_front_point_within_the_quality_budget():
    from infmoe_export.report.tradeoff import pareto_front, recommendation

    rows = [front_row(1, 6.29, 1.00, 0.90, 1.10), front_row(8, 4.76, 1.05, 0.95, 1.20),
            front_row(2, 5.04, 2.0, 1.9, 2.1), front_row(4, 4.0, 0.5, 0.4, 0.6, parity="fail")]
    assert [r["k"] for r in pareto_front(rows[:3])] == [1, 8]  # K=2 is slower and worse than K=8
    best = recommendation(rows)  # 2%: only K=8 is within the budget; the failed K=4 never counts
    assert best["best"]["k"] == 8 and best["within_noise"] == [] and best["best_perplexity"] == 4.76
    assert [r["k"] for r in best["front"]] == [1, 8]
    # A wider budget takes the faster K=1, unless K=8 is within its noise: then accuracy decides.
    assert recommendation(rows, quality_budget=0.5)["best"]["k"] == 8
    assert [r["k"] for r in recommendation(rows, quality_budget=0.5)["within_noise"]] == [1]
    rows[1]["decode_ms"] = {"median": 1.5, "ci_low": 1.4, "ci_high": 1.6}  # now measurably slower
    assert recommendation(rows, quality_budget=0.5)["best"]["k"] == 1
    assert recommendation(rows)["best"]["k"] == 8  # still the only one within 2%
    assert recommendation([front_row(1, 5.0, 1.0, 0.9, 1.1, parity="fail")]) is None


def test_report_shows_why_it_recommends(setup, tmp_path):
    report = build_report("pipeline", "test", "ckpt", CONFIG.to_dict(), environment(1),
                          parity=setup["report"]["parity"], bench=setup["report"]["bench"], quality_budget=0.5)
    best = report["recommendation"]
    assert best["quality_budget"] == 0.5
    assert best["perplexity_bound"] == pytest.approx(1.5 * best["best_perplexity"])
    markdown = write_report(report, tmp_path / "out")["markdown"].read_text()
    assert "the fastest on the Pareto front within the quality budget" in markdown
    assert "**Why: the Pareto front and the quality budget**" in markdown
    assert f"the best measured ({best['best_perplexity']:.3f}) +50%" in markdown
    assert markdown.count("| recommended |") == 1


def test_verdict_lines_per_backend_and_precision(setup):
    lines = {(v["backend"], tuple(v["dtypes"])): v for v in setup["report"]["verdicts"]}
    assert lines[("torch", ("fp32", "int4"))]["status"] == "reference"  # one line for both precisions
    assert lines[("ort-fallback", ("fp32",))]["status"] == "passed"
    assert "max |Δlogit|" in lines[("ort-fallback", ("fp32",))]["text"]
    if ("trt", ("fp32", "int4")) in lines:
        assert lines[("trt", ("fp32", "int4"))]["status"] == "skipped"  # the reason once, for all of trt


def test_memory_is_measured_in_a_child(setup):
    results = setup["report"]["memory"]["results"]
    int4 = {r["backend"]: r for r in results if r["dtype"] == "int4"}
    rows = {r["backend"]: r for r in results if r["dtype"] == "fp32"}
    assert int4["torch"]["status"] == "skipped"  # PyTorch has no int4 deployment
    assert int4["ort-fallback"]["status"] == "ok"
    assert int4["ort-fallback"]["weight_bytes"] < rows["ort-fallback"]["weight_bytes"]
    for backend in ("torch", "ort-fallback"):
        r = rows[backend]
        assert r["status"] == "ok", r["reason"]
        assert r["peak_rss_bytes"] > r["rss_before_load_bytes"] > 50 * 2**20  # python + torch at least
        assert r["weight_bytes"] > 0 and r["allocator_note"]
    assert rows["ort-fallback"]["file_bytes"] >= rows["ort-fallback"]["weight_bytes"]
    assert rows["trt"]["status"] == "skipped" or rows["trt"]["peak_rss_bytes"]


def test_bigger_model_reports_more_memory(setup, tmp_path):
    """A model with about 19 MB more weights than the tiny one: more weight bytes, a larger file and
    a peak resident set at least 15 MB higher, measured in fresh processes."""
    big = InfMoEGPT(InfMoEConfig(**{**CONFIG.to_dict(), "d_model": 256, "n_head": 4, "ffn_hidden": 4096,
                                    "slice_width": 512}))
    big.reset_parameters(seed=1)
    exported = export_onnx(big.eval(), tmp_path / "big.onnx", k=1)
    measured = run_memory(big, [exported], backends=["ort-fallback"], checkpoint=None, past=8, threads=1)
    large = measured["results"][0]
    small = next(r for r in setup["report"]["memory"]["results"] if (r["backend"], r["dtype"]) == ("ort-fallback", "fp32"))
    assert large["status"] == "ok", large["reason"]
    assert large["weight_bytes"] > small["weight_bytes"] + 15 * 2**20
    assert large["file_bytes"] > small["file_bytes"] + 15 * 2**20
    assert large["peak_rss_bytes"] > small["peak_rss_bytes"] + 15 * 2**20


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
    next(r for r in report["bench"]["results"] if r["status"] == "ok")["latency_ms"]["median"] = 0.0
    with pytest.raises(InfMoEError, match="median"):
        validate_report(report)
    report = json.loads(json.dumps(setup["report"]))
    report["schema_version"] = 1
    with pytest.raises(InfMoEError, match="schema_version"):
        validate_report(report)


def test_written_files(setup, tmp_path):
    paths = write_report(setup["report"], tmp_path / "out")
    assert json.loads(paths["json"].read_text()) == json.loads(json.dumps(setup["report"]))
    page = paths["html"].read_text()
    assert page.count("data:image/png;base64,") == 1
    assert "src=\"http" not in page and "href=\"http" not in page  # self-contained
    assert paths["plot"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [".infmoe-export", "report.html", "report.json",
                                                                    "report.md", "tradeoff.png"]


def test_markdown_is_verdict_first_with_narrow_tables(setup, tmp_path):
    markdown = write_report(setup["report"], tmp_path / "out")["markdown"].read_text()
    lines = markdown.splitlines()
    assert lines[0] == "# infmoe-export pipeline: PASSED"
    first_table = next(i for i, line in enumerate(lines) if line.startswith("|"))
    verdict = next(i for i, line in enumerate(lines) if line.startswith("- ✓ ort-fallback fp32: passed"))
    chart = lines.index(f"![{PLOT_ALT}](tradeoff.png)")
    assert verdict < chart < first_table
    assert "| ort-fallback | fp32 | quantile | 1 | pass |" in markdown
    widths = [line.count(" | ") + 1 for line in lines if line.startswith("| ")]
    assert widths and max(widths) < 10
    # Details are folded; skipped backends are one line, not a row per K.
    assert markdown.count("<details>") == markdown.count("</details>") >= 4
    assert not any(line.startswith("| trt |") for line in lines)
    for row in ("e-0", "%"):  # errors in scientific notation, shares as percentages
        assert row in markdown


def test_chart_renders_with_baselines(setup, tmp_path):
    """A dense and a conventional-MoE baseline, each timed at decode and prefill on the backend and
    precision of the models under test: in the report's table and on both panels of the chart."""
    from matplotlib.image import imread

    facts = [{"name": "dense-small", "checkpoint": "x", "model_type": "infmoe-gpt2", "dtype": "fp32", "k": 1,
              "ffn_hidden": 9, "active_units": 9, "parameters": 1000, "perplexity": 250.0},
             {"name": "moe-2x9-top1", "checkpoint": "y", "model_type": "moe-gpt2", "dtype": "fp32", "k": 1,
              "ffn_hidden": 18, "active_units": 9, "parameters": 3000, "perplexity": 240.0}]
    bench = json.loads(json.dumps(setup["report"]["bench"]))
    for phase in ("decode", "prefill"):
        template = next(r for r in bench["results"] if r["status"] == "ok" and r["phase"] == phase)
        for i, fact in enumerate(facts):
            bench["results"].append({**template, "backend": "ort-fallback", "baseline": fact["name"],
                                     "tokens_per_s": 1000.0 * (i + 1),
                                     "latency_ms": {**template["latency_ms"], "median": 0.5 + i, "ci_low": 0.4 + i,
                                                    "ci_high": 0.6 + i}})
    report = build_report("pipeline", "test", "ckpt", CONFIG.to_dict(), environment(1),
                          parity=setup["report"]["parity"], bench=bench, baselines=facts)
    assert [(b["name"], b["decode_ms"]["median"], b["prefill_tokens_per_s"], b["backend"])
            for b in report["baselines"]] == [("dense-small", 0.5, 1000.0, "ort-fallback"),
                                              ("moe-2x9-top1", 1.5, 2000.0, "ort-fallback")]
    paths = write_report(report, tmp_path / "out")
    markdown = paths["markdown"].read_text()
    assert "**Baselines**" in markdown and "conventional MoE" in markdown and "9 / 18" in markdown
    pixels = imread(str(paths["plot"]))[..., :3]
    width = pixels.shape[1]

    def coloured(image, rgb):
        return np.abs(image - np.array(rgb)).max(axis=-1) < 0.03

    grey, brown = (0.41, 0.41, 0.41), (0.545, 0.271, 0.075)  # dimgray stars, saddlebrown crosses
    for rgb in (grey, brown):  # on both panels
        assert coloured(pixels[:, :width // 2], rgb).sum() > 50 and coloured(pixels[:, width // 2:], rgb).sum() > 50
    without = imread(__import__("io").BytesIO(plot_tradeoff(report["tradeoff"], [])))[..., :3]
    assert coloured(without, brown).sum() < coloured(pixels, brown).sum()


CHROMEDRIVER = shutil.which("chromedriver")


def test_html_in_headless_chromium_at_1280x800(setup, tmp_path):
    """The page as a new user sees it: the verdict and the chart in the first screen, nothing
    wider than the page, every image loaded, every folded section opens. Screenshots in tmp_path."""
    if CHROMEDRIVER is None or not (shutil.which("chromium") or shutil.which("chromium-browser")):
        pytest.skip("chromium and chromium-driver are not installed (apt-get install -y chromium chromium-driver)")
    webdriver = pytest.importorskip("selenium.webdriver")

    paths = write_report(setup["report"], tmp_path / "out")
    options = webdriver.ChromeOptions()
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                 "--disable-background-networking", "--disable-component-update", "--no-first-run",
                 f"--user-data-dir={tmp_path / 'profile'}"):
        options.add_argument(flag)
    driver = webdriver.Chrome(options=options, service=webdriver.ChromeService(executable_path=CHROMEDRIVER))
    try:
        driver.execute_cdp_cmd("Emulation.setDeviceMetricsOverride",
                               {"width": 1280, "height": 800, "deviceScaleFactor": 1, "mobile": False})
        driver.get(paths["html"].as_uri())
        assert driver.execute_script("return [innerWidth, innerHeight]") == [1280, 800]
        driver.save_screenshot(str(tmp_path / "first-screen.png"))

        def box(selector):
            return driver.execute_script(
                "const r = document.querySelector(arguments[0]).getBoundingClientRect();"
                "return [r.left, r.top, r.right, r.bottom, r.width, r.height]", selector)

        for selector in (".verdict", "ul.verdicts", ".recommendation", ".chart img"):
            left, top, right, bottom, width, height = box(selector)
            assert width > 0 and height > 0 and 0 <= top and bottom <= 800 and 0 <= left and right <= 1280, selector
        assert box(".chart img")[4] > 400  # the chart is readable, not a thumbnail
        assert driver.execute_script("return [...document.images].every(i => i.complete && i.naturalWidth > 0)")
        overflow = ("return [...document.querySelectorAll('body *')].filter(e => e.getBoundingClientRect().right > "
                    "document.documentElement.clientWidth + 0.5).map(e => e.tagName + '.' + e.className)")
        assert driver.execute_script(overflow) == []
        sections = driver.find_elements("css selector", "details")
        assert len(sections) >= 4 and not any(d.get_attribute("open") for d in sections)
        for summary in driver.find_elements("css selector", "details > summary"):
            driver.execute_script("arguments[0].scrollIntoView()", summary)
            summary.click()
        assert all(d.get_attribute("open") is not None for d in sections)
        assert all(d.find_element("css selector", "table").size["height"] > 0 for d in sections)
        assert driver.execute_script(overflow) == []
        assert driver.execute_script("return document.documentElement.scrollWidth <= "
                                     "document.documentElement.clientWidth")
        driver.execute_script("window.scrollTo(0, 0)")
        height = driver.execute_script("return document.documentElement.scrollHeight")
        driver.execute_cdp_cmd("Emulation.setDeviceMetricsOverride",
                               {"width": 1280, "height": min(height, 16000), "deviceScaleFactor": 1, "mobile": False})
        driver.save_screenshot(str(tmp_path / "opened.png"))
    finally:
        driver.quit()
    assert (tmp_path / "first-screen.png").stat().st_size > 10_000


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
    assert report["export"] == {"fp32": "portable fp32", "int4": "portable int4 experts"}  # the models given
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
    assert line.startswith("error: parity failed for ort-fallback fp32 K=1 quantile: ")
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert not report["passed"] and report["failures"]


@pytest.mark.parametrize("args, message", [
    (["--model", "missing.onnx"], "does not exist"),
    (["--backends", "cuda"], "unknown backend 'cuda'"),
    (["--k", "5"], "no model for K=5"),
    (["--k", "0"], "positive integer"),
    (["--k", ""], "positive integer"),  # an empty value given is a mistake, not the default
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


def test_bench_exports_with_quantize_other(setup, tmp_path, run_cli, monkeypatch):
    """--quantize-other reaches the int8 / int4 exports of bench, not the fp32 one."""
    import torch

    from infmoe_export.commands import bench

    exported, export_many = [], bench.export_many

    def recording(*args, **kwargs):
        models = export_many(*args, **kwargs)
        exported.extend(models)
        return models

    monkeypatch.setattr(bench, "export_many", recording)
    threads = torch.get_num_threads()
    status, _, err = run_cli("bench", "--checkpoint", str(setup["root"] / "checkpoint"), "--dtype", "fp32,int4",
                             "--block-size", "16", "--quantize-other", "int4", "--backends", "ort-fallback",
                             "--k", "1", "--batch", "1", "--seq", "1", "--past", "4", "--warmup", "1", "--iters", "3",
                             "--threads", "1", "--json", str(tmp_path / "bench.json"))
    torch.set_num_threads(threads)
    assert status == 0, err
    assert [(m.path.name, m.io.quantized) for m in exported] == [
        ("model_k1_quantile_fp32.onnx", []),
        ("model_k1_quantile_int4_other-int4.onnx", ["experts", "attention", "embedding"])]
    report = json.loads((tmp_path / "bench.json").read_text())
    assert sorted(r["dtype"] for r in report["bench"]["results"]) == ["fp32", "int4"]
    target = exported[0].io.target
    assert report["export"] == {"fp32": f"{target} fp32", "int4": f"{target} all-int4"}
    status, _, err = run_cli("bench", "--checkpoint", str(setup["root"] / "checkpoint"), "--quantize-other", "int8")
    assert status == 1 and "--quantize-other int8 applies to int8 / int4 models" in err
    assert len(err.strip().splitlines()) == 1


def test_bench_rejects_sequence_longer_than_model(setup, run_cli):
    status, _, err = run_cli("bench", "--checkpoint", str(setup["root"] / "checkpoint"), "--model",
                         str(setup["models"][0].path), "--seq", "41", "--k", "1")
    assert status == 1 and "--seq 41 must lie in [1, n_positions = 40]" in err


def test_read_model_refuses_non_onnx(tmp_path):
    junk = tmp_path / "junk.onnx"
    junk.write_bytes(b"not a model")
    with pytest.raises(InfMoEError, match="not a readable ONNX model"):
        ExportedModel.read(junk)


# ---------------------------------------------------------------------------------------------
# The GPT-2-Small-size table from the benchmarks' results


def peers_results() -> dict:
    """A file in the layout `python -m benchmarks.peers` writes (only what the table reads, and
    some it does not)."""
    names = ["ours all-int4 K=2", "llama.cpp Medium Q4_0", "llama.cpp Medium F16"]
    return {"benchmark": "peers", "machine": {"cpu": "Test CPU", "date": "2030-01-01T00:00:00+00:00", "cores": 2},
            "options": {"threads": 2, "quick": False}, "plan": {},
            "contenders": [{"name": name, "runtime": "x"} for name in names],
            "decode": [{"past": 128, "ms": {names[0]: 4.0, names[1]: 14.0}, "samples_ms": {}}],
            "batched": [{"batch": b, "past": 128, "tokens_per_s": {names[0]: 100.0 * b}} for b in (1, 8, 32)],
            "prefill": [{"tokens": 512, "tokens_per_s": {names[0]: 900.0, names[1]: 300.0}}],
            "skipped": {"llama.cpp Small F16": "no llama_cpp"}, "goals": []}


def test_small_model_table_is_read_and_labelled(setup, tmp_path):
    from infmoe_export.report.small_model import small_model_speed

    (tmp_path / "peers.json").write_text(json.dumps(peers_results()))
    section, warning = small_model_speed(tmp_path)
    assert warning is None
    assert section["columns"] == ["decode, past 128: ms/token", "8 sequences: tokens/s", "prefill 512: tokens/s"]
    assert section["rows"][1] == {"contender": "llama.cpp Medium Q4_0", "values": [14.0, None, 300.0]}
    report = build_report("pipeline", "test", "ckpt", CONFIG.to_dict(), environment(1),
                          parity=setup["report"]["parity"], bench=setup["report"]["bench"], small_model=section)
    markdown = write_report(report, tmp_path / "out")["markdown"].read_text()
    assert "## GPT-2-Small-size model (benchmark results, not this run)" in markdown
    assert f"Not this run: {tmp_path / 'peers.json'}" in markdown and "Test CPU" in markdown
    assert "| ours all-int4 K=2 | 4.00 | 800 | 900 |" in markdown
    assert "| llama.cpp Medium Q4_0 | 14.0 | — | 300 |" in markdown
    assert "Not measured: llama.cpp Small F16 (no llama_cpp)." in markdown
    assert "Medium F16" not in markdown  # a row a summary leaves out
    assert "Shown: 2 of its 3 contenders" in markdown and section["contenders"] == 3


@pytest.mark.parametrize("content, message", [
    ("{not json", "not readable as JSON"),
    (json.dumps({**peers_results(), "benchmark": "decode"}), "not the peers benchmark's results (at benchmark"),
    (json.dumps({**peers_results(), "decode": [{"past": 128, "ms": {"ours": "fast"}}]}), "at decode/0/ms/ours"),
])
def test_small_model_table_malformed_is_a_warning(tmp_path, content, message):
    from infmoe_export.report.small_model import small_model_speed

    (tmp_path / "peers.json").write_text(content)
    section, warning = small_model_speed(tmp_path)
    assert section is None and message in warning and "\n" not in warning
    assert small_model_speed(tmp_path / "absent") == (None, None)


def test_timed_decode_is_a_shared_cache_step_as_run_makes_it(tmp_path):
    """On a model with a shared KV cache the timed decode call is a step of that cache at exactly
    the bench's past, every call: its logits are the last row of a full recompute of the same
    tokens, call after call."""
    from infmoe_export.report.bench import text_tokens, timed_call
    from infmoe_export.runtimes.ort import OrtRunner

    model = InfMoEGPT(InfMoEConfig(vocab_size=256, n_positions=40, d_model=16, n_layer=2, n_head=2, ffn_hidden=37,
                                   slice_width=9, num_samples=2))  # head_dim 8: onnxruntime's attention fits
    model.reset_parameters(seed=2)
    exported = export_onnx(model.eval(), tmp_path / "ort.onnx", k=1, target="onnxruntime")
    runner = OrtRunner(exported.io, exported, kernel=False)
    with runner:
        call = timed_call(runner, exported, 1, 1, 8)
        first = np.array(call()["logits"])
        again = np.array(call()["logits"])
        full = runner.infer(exported.feed(text_tokens(9)[None]), check_inputs=False)["logits"]
    np.testing.assert_array_equal(first, again)
    np.testing.assert_allclose(first[0, -1], full[0, -1], rtol=1e-4, atol=1e-5)


def test_run_agreement_puts_a_generation_beside_each_decode_row(setup):
    """Per quantile model timed at batch-1 decode on its deployed backend: generations of the
    steps asked for in blocks (their prompt starting at the table's past less half a block),
    beside as many steps timed the table's way; `agrees` is the overlap of those two intervals,
    the table's own row is kept, and the rows validate in the report's schema."""
    from infmoe_export.report.bench import run_agreement

    report = setup["report"]
    bench = report["bench"]
    rows = run_agreement(setup["model"], setup["models"], bench, kernel=False, threads=1, steps=8, rounds=2)
    timed = {(r["k"], r["noise"], r["dtype"]): r for r in bench["results"]
             if r["backend"] == "ort-fallback" and r["status"] == "ok" and r["phase"] == "decode" and r["batch"] == 1}
    assert {(r["k"], r["noise"], r["dtype"]) for r in rows} == set(timed) and rows
    for r in rows:
        assert r["steps"] == 8 and r["past_from"] == bench["settings"]["decode_past"] - 2
        assert r["bench_ms"] == timed[r["k"], r["noise"], r["dtype"]]["latency_ms"]
        for figures in (r["run_ms"], r["table_beside_run_ms"]):
            assert 0 < figures["ci_low"] <= figures["median"] <= figures["ci_high"]
        assert r["agrees"] == within_noise(r["table_beside_run_ms"], r["run_ms"])
    validate_report({**report, "bench": {**bench, "run_agreement": rows}})
    assert run_agreement(setup["model"], setup["models"], {**bench, "results": []}, kernel=False, steps=6) == []
