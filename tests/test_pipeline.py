"""`infmoe-export pipeline` end to end on a small random odd-shaped checkpoint: the whole matrix
(`--full`, one K, both noise modes) with a dense and a conventional-MoE baseline through the
installed console script, the quick tour, an interrupted run; and its failure paths in-process;
`eval` with its baselines and its trade-off chart."""

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from infmoe_export.checkpoint import save_checkpoint
from infmoe_export.contract import ExportedModel
from infmoe_export.model import InfMoEConfig, InfMoEGPT, MoEConfig, MoEGPT
from infmoe_export.report.render import validate_report

CONFIG = InfMoEConfig(vocab_size=256, n_positions=33, d_model=20, n_layer=2, n_head=2, ffn_hidden=29,
                      slice_width=7, num_samples=2)
# A conventional MoE of the same attention stack: 4 experts of 7 units, top 2.
MOE_CONFIG = MoEConfig(vocab_size=256, n_positions=33, d_model=20, n_layer=2, n_head=2, ffn_hidden=28, num_experts=4,
                       top_k=2, router_softmax="selected")


def baseline_checkpoints(folder: Path, seed: int):
    """A dense baseline (H = CONFIG's, one window of all of it) and a conventional MoE, random."""
    dense = InfMoEGPT(InfMoEConfig(**{**CONFIG.to_dict(), "slice_width": CONFIG.ffn_hidden, "num_samples": 1}))
    dense.reset_parameters(seed=seed)
    moe = MoEGPT(MOE_CONFIG)
    moe.reset_parameters(seed=seed + 1)
    return save_checkpoint(dense, folder / "dense-H"), save_checkpoint(moe, folder / "moe-4x7-top2")
FAST = ["--max-windows", "2", "--iters", "10", "--budget", "0.1", "--warmup", "1", "--threads", "1", "--dtype", "fp32"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    model = InfMoEGPT(CONFIG)
    model.reset_parameters(seed=3)
    return save_checkpoint(model, tmp_path_factory.mktemp("pipeline") / "checkpoint")


@pytest.fixture(scope="module")
def run(checkpoint):
    dense, moe = baseline_checkpoints(checkpoint.parent, seed=4)
    out = checkpoint.parent / "out"
    result = subprocess.run([str(Path(sys.executable).parent / "infmoe-export"), "pipeline", "--checkpoint",
                             str(checkpoint), "--out", str(out), "--full", "--k", "2", "--baseline", str(dense),
                             "--baseline", str(moe), *FAST], capture_output=True, text=True, timeout=900)
    return result, out


def test_pipeline_succeeds_and_writes_reports(run):
    result, out = run
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    assert f"report: {out / 'report.html'}" in result.stdout
    # The terminal in the report's order: headline, verdict lines, recommendation, table.
    lines = result.stdout.splitlines()
    headline = lines.index("infmoe-export pipeline: PASSED")
    verdict = next(i for i, line in enumerate(lines) if line.startswith("✓ ort-fallback fp32: passed"))
    best = next(i for i, line in enumerate(lines) if line.startswith("Recommended: "))
    table = next(i for i, line in enumerate(lines) if "Trade-off" in line)
    assert headline < verdict < best < table
    assert sorted(p.name for p in out.iterdir()) == [".infmoe-export", "baselines", "models", "report.html",
                                                     "report.json", "report.md", "tradeoff.png"]
    assert not [p for p in out.parent.iterdir() if ".staging." in p.name]  # the staging folder was published
    assert sorted(p.name for p in (out / "models" / "fp32").iterdir()) == ["model_k2_quantile_fp32.onnx",
                                                                          "model_k2_sampled_fp32.onnx"]


def test_pipeline_report_content(run):
    _, out = run
    report = json.loads((out / "report.json").read_text())
    validate_report(report)
    assert report["kind"] == "pipeline" and report["passed"] and report["failures"] == []
    assert [s["name"] for s in report["stages"]] == ["export", "validate", "tensorrt", "baselines", "parity", "latency",
                                                     "memory"]
    assert all(s["status"] in ("ok", "skipped") and s["seconds"] >= 0 for s in report["stages"])
    parity = [r for r in report["parity"]["results"] if r["status"] not in ("reference", "skipped")]
    assert {(r["backend"], r["noise"]) for r in parity} >= {("ort-fallback", "quantile"), ("ort-fallback", "sampled")}
    assert all(r["status"] == "pass" and r["start_agreement"] >= 0.999 for r in parity)
    tradeoff = {(r["backend"], r["noise"]): r for r in report["tradeoff"]}
    for noise in ("quantile", "sampled"):
        row = tradeoff[("ort-fallback", noise)]
        assert row["k"] == 2 and row["perplexity"] > 1 and row["decode_ms"]["median"] > 0 and row["dtype"] == "fp32"
    assert tradeoff[("ort-fallback", "quantile")]["prefill_tokens_per_s"] > 0
    dense, moe = report["baselines"]  # at the run's precision, timed where the models under test are
    assert (dense["name"], dense["model_type"], dense["k"]) == ("dense-H", "infmoe-gpt2", 1)
    assert dense["ffn_hidden"] == dense["active_units"] == CONFIG.ffn_hidden
    assert (moe["name"], moe["model_type"], moe["k"], moe["active_units"]) == ("moe-4x7-top2", "moe-gpt2", 2, 14)
    deployed = {r["backend"] for r in report["tradeoff"] if r["backend"] != "torch" and r["decode_ms"]}
    for baseline in (dense, moe):
        assert baseline["dtype"] == "fp32" and baseline["backend"] in deployed and baseline["perplexity"] > 1
        assert baseline["decode_ms"]["median"] > 0 and baseline["prefill_tokens_per_s"] > 0
    memory = {r["backend"]: r for r in report["memory"]["results"]}
    assert memory["ort-fallback"]["status"] == "ok" and memory["ort-fallback"]["peak_rss_bytes"] > 0
    assert "**Baselines**" in (out / "report.md").read_text()


def test_pipeline_says_once_when_tensorrt_is_absent(run):
    result, out = run
    report = json.loads((out / "report.json").read_text())
    stage = next(s for s in report["stages"] if s["name"] == "tensorrt")
    from infmoe_export.runtimes.tensorrt import tensorrt_available

    if tensorrt_available():
        assert stage["status"] == "ok"
    else:
        assert stage["status"] == "skipped" and "TensorRT is not installed" in stage["note"]
        assert result.stdout.count("tensorrt: TensorRT is not installed") == 1
        assert all(r["status"] == "skipped" for r in report["parity"]["results"] if r["backend"] == "trt")


def test_pipeline_quick_tour_by_default(checkpoint, tmp_path, run_cli):
    """No lists, no --full: fp32 and int4 (all-int4) at K 1, 2, 8, quantile noise, on the deployed
    backend alone; no TensorRT, baselines or memory; the report names the export choice and the
    quality budget given. An accuracy budget int4 cannot meet (no perplexity increase, every top-1
    the float model's) does not fail the run: int4 is over the budget, named in the headline, and
    the recommendation is fp32."""
    import torch

    from infmoe_export.runtimes.ort_kernel import custom_op_library

    threads = torch.get_num_threads()
    out = tmp_path / "out"
    status, stdout, err = run_cli("pipeline", "--checkpoint", str(checkpoint), "--out", str(out), "--max-windows", "2",
                                  "--iters", "10", "--budget", "0.05", "--warmup", "1", "--threads", "1",
                                  "--max-ppl-increase", "0.001", "--min-top1", "1", "--quality-budget", "5")
    torch.set_num_threads(threads)
    assert status == 0, err
    assert "infmoe-export pipeline: PASSED — portable all-int4 over the accuracy budget: " in stdout
    assert "quick tour: portable fp32, portable all-int4, K 1, 2, 8, quantile noise" in stdout
    report = json.loads((out / "report.json").read_text())
    assert [s["name"] for s in report["stages"]] == ["export", "validate", "parity", "latency"]
    deployed = "ort" if custom_op_library() else "ort-fallback"
    assert {r["backend"] for r in report["bench"]["results"]} == {deployed}
    assert {r["backend"] for r in report["parity"]["results"]} == {"torch", deployed}
    assert {(r["dtype"], r["k"], r["noise"]) for r in report["parity"]["results"] if r["backend"] == deployed} == {
        (d, k, "quantile") for d in ("fp32", "int4") for k in (1, 2, 8)}
    assert report["export"] == {"fp32": "portable fp32", "int4": "portable all-int4"}
    assert sorted(p.name for p in (out / "models" / "int4").iterdir()) == [
        f"model_k{k}_quantile_int4_other-int4.onnx" for k in (1, 2, 8)]
    assert report["passed"] and report["failures"] == [] and report["over_budget"]
    over = [r for r in report["parity"]["results"] if r["status"] == "over_budget"]
    assert over and all(r["dtype"] == "int4" and r["level1"] == "pass" and r["level2"] == "fail" for r in over)
    assert report["recommendation"]["dtype"] == "fp32"
    assert report["recommendation"]["quality_budget"] == 0.05 and report["memory"] is None
    markdown = (out / "report.md").read_text()
    assert "Exported as: portable fp32, portable all-int4" in markdown
    assert "<summary>Latency, quantile noise, portable all-int4</summary>" in markdown
    # Each decode row beside a generation as `run` makes it, on the same backend.
    agreement = report["bench"]["run_agreement"]
    assert {(r["backend"], r["dtype"], r["k"]) for r in agreement} == {
        (deployed, d, k) for d in ("fp32", "int4") for k in (1, 2, 8)}
    assert all(r["steps"] >= 1 and r["run_ms"]["median"] > 0 for r in agreement)
    assert "## `run` beside the latency table" in markdown and "run's decode speed agrees" in stdout


def test_interrupted_pipeline_leaves_no_output(checkpoint, tmp_path):
    """SIGINT in the middle of a run (once its staging folder exists): no --out folder, no
    staging folder, exit status 130."""
    out = tmp_path / "out"
    child = subprocess.Popen([str(Path(sys.executable).parent / "infmoe-export"), "pipeline", "--checkpoint",
                              str(checkpoint), "--out", str(out), *FAST], stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not list(tmp_path.glob(".out.staging.*")) and time.monotonic() < deadline and child.poll() is None:
        time.sleep(0.05)
    assert child.poll() is None, "the run ended before it could be interrupted"
    child.send_signal(signal.SIGINT)
    _, err = child.communicate(timeout=120)
    assert child.returncode == 130 and err.strip().splitlines()[-1] in ("aborted", "interrupted"), err
    assert "Traceback" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_one_progress_display_ends_full_with_a_record_per_stage():
    from rich.console import Console

    from infmoe_export.commands.pipeline import Stages

    def work(advance):
        for item in range(3):
            advance(f"item {item}")
        return "ok", None

    with Stages(Console(quiet=True), [("export", 3, 2.0), ("parity", 3, 1.0)]) as stages:
        stages.run("export", work)
        task = stages.progress.tasks[0]
        assert (task.completed, task.total) == (6.0, 9.0)
        stages.add("more", 1, 1.0)
        stages.run("parity", work)
        stages.run("more", lambda advance: ("skipped", "nothing to do"))
        assert stages.progress.tasks[0].completed == stages.progress.tasks[0].total == 10.0
    assert len(stages.progress.tasks) == 1
    assert [(r["name"], r["status"]) for r in stages.records] == [("export", "ok"), ("parity", "ok"),
                                                                  ("more", "skipped")]


def test_pipeline_exits_nonzero_when_parity_fails(checkpoint, tmp_path, run_cli, monkeypatch):
    """Polygraphy's verdict forced to "out of tolerance" (level 1: the backend does not compute
    what the spec says): the report is still written, the command fails naming the backends."""
    import torch

    from infmoe_export.verify import parity

    monkeypatch.setattr(parity, "polygraphy_passes", lambda *args: False)
    threads = torch.get_num_threads()
    status, _, err = run_cli("pipeline", "--checkpoint", str(checkpoint), "--out", str(tmp_path / "out"), "--full",
                             "--k", "1", "--noise", "quantile", "--no-baselines", *FAST)
    torch.set_num_threads(threads)
    assert status == 1
    assert err.strip().splitlines()[-1].startswith("error: parity failed for ")
    assert "ort-fallback fp32 K=1 quantile: logits beyond atol" in err
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert not report["passed"] and next(s for s in report["stages"] if s["name"] == "parity")["status"] == "failed"


@pytest.mark.parametrize("args, message", [
    (["--k", "0"], "--k must be a comma-separated list of positive integers"),
    (["--noise", "gaussian"], "--noise must be a comma-separated subset of quantile, sampled"),
    (["--checkpoint", "/nonexistent"], "is not a checkpoint"),
    (["--dtype", "fp64"], "--dtype must be a comma-separated list of fp32, fp16, int8, int4"),
    (["--dtype", "int4", "--block-size", "24"], "--block-size: block size must be a power of two >= 16"),
    (["--baseline", "/nonexistent"], "is not a checkpoint"),
    (["--dtype", "fp32,fp16", "--quantize-other", "int4"], "--quantize-other int4 applies to int8 / int4 models"),
    # An empty value given is a mistake, not a request for the default.
    (["--k", ""], "--k must be a comma-separated list of positive integers"),
    (["--noise", ""], "--noise must be a comma-separated subset of quantile, sampled"),
    (["--dtype", ""], "--dtype must be a comma-separated list of fp32, fp16, int8, int4"),
    # A block size is checked even where nothing is quantized.
    (["--dtype", "fp32", "--block-size", "-1"], "--block-size: block size must be a power of two >= 16"),
])
def test_pipeline_bad_input_is_one_line(tmp_path, run_cli, args, message):
    status, _, err = run_cli("pipeline", "--out", str(tmp_path / "out"), *args)
    assert status == 1 and message in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("command", ["pipeline", "deploy", "parity"])
def test_quality_thresholds_refuse_nan(tmp_path, run_cli, command):
    """A NaN threshold would pass or fail every comparison silently: click's usage error instead."""
    status, _, err = run_cli(command, "--out", str(tmp_path / "out"), "--min-top1", "nan")
    assert status == 2 and "Invalid value for '--min-top1': 'nan' is not a finite number" in err
    assert not (tmp_path / "out").exists()


def test_pipeline_quantize_other(checkpoint, tmp_path, run_cli):
    """--quantize-other reaches the int4 models, the fp32 reference stays float, and parity runs
    each at its own level 1."""
    import torch

    threads = torch.get_num_threads()
    status, _, err = run_cli("pipeline", "--checkpoint", str(checkpoint), "--out", str(tmp_path / "out"), "--full",
                             "--k", "1", "--noise", "quantile", "--no-baselines", *FAST, "--dtype", "fp32,int4",
                             "--block-size", "16", "--quantize-other", "int4", "--max-ppl-increase", "1000",
                             "--min-top1", "0")
    torch.set_num_threads(threads)
    assert status == 0, err
    models = tmp_path / "out" / "models"
    assert [p.name for p in (models / "int4").iterdir()] == ["model_k1_quantile_int4_other-int4.onnx"]
    assert [p.name for p in (models / "fp32").iterdir()] == ["model_k1_quantile_fp32.onnx"]
    read = ExportedModel.read(models / "int4" / "model_k1_quantile_int4_other-int4.onnx")
    assert read.io.quantized == ["experts", "attention", "embedding"]
    assert ExportedModel.read(models / "fp32" / "model_k1_quantile_fp32.onnx").io.quantized == []
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    level1 = {(r["backend"], r["dtype"]): r["status"] for r in report["parity"]["results"]}
    assert level1[("ort-fallback", "int4")] == level1[("ort-fallback", "fp32")] == "pass"


def test_pipeline_refuses_a_file_as_out(tmp_path, run_cli):
    target = tmp_path / "file"
    target.write_text("x")
    status, _, err = run_cli("pipeline", "--out", str(target))
    assert status == 1 and "exists and is not a directory" in err
    assert target.read_text() == "x"


def test_eval_scores_baselines_beside_the_checkpoint(checkpoint, tmp_path, run_cli):
    dense = InfMoEGPT(InfMoEConfig(**{**CONFIG.to_dict(), "slice_width": CONFIG.ffn_hidden, "num_samples": 1}))
    dense.reset_parameters(seed=5)
    baseline = save_checkpoint(dense, tmp_path / "dense-H")
    status, out, err = run_cli("eval", "--checkpoint", str(checkpoint), "--k", "1,2", "--baseline", str(baseline),
                               "--json")
    assert status == 0, err
    records = json.loads(out)
    assert [(r["baseline"], r["k"], r["ffn_hidden"]) for r in records] == [
        (None, 1, CONFIG.ffn_hidden), (None, 2, CONFIG.ffn_hidden), ("dense-H", 1, CONFIG.ffn_hidden)]
    assert all(r["perplexity"] > 1 for r in records)
    status, _, err = run_cli("eval", "--checkpoint", str(checkpoint), "--baseline", str(tmp_path / "missing"))
    assert status == 1 and "is not a checkpoint" in err and len(err.strip().splitlines()) == 1


def test_eval_chart_times_the_checkpoint_and_its_baselines_at_one_precision(checkpoint, tmp_path, run_cli):
    """--dtype int4 --chart: every perplexity on the int4 weights, every model and baseline exported
    as all-int4 and timed in onnxruntime (decode and prefill), and the chart with both kinds of
    baseline on it."""
    from matplotlib.image import imread

    dense, moe = baseline_checkpoints(tmp_path, seed=6)
    chart = tmp_path / "chart.png"
    args = ["eval", "--checkpoint", str(checkpoint), "--k", "1,2", "--baseline", str(dense), "--baseline", str(moe),
            "--for", "portable", "--json"]
    status, out, err = run_cli(*args, "--dtype", "int4", "--chart", str(chart))
    assert status == 0, err
    records = json.loads(out)
    assert [(r["baseline"], r["k"], r["dtype"]) for r in records] == [
        (None, 1, "int4"), (None, 2, "int4"), ("dense-H", 1, "int4"), ("moe-4x7-top2", 2, "int4")]
    assert all(r["decode_ms"]["median"] > 0 and r["prefill_tokens_per_s"] > 0 for r in records)
    status, out, _ = run_cli(*args)  # fp32, no chart: other perplexities, no latency
    float_records = json.loads(out)
    assert all(r["decode_ms"] is None for r in float_records)
    assert all(abs(f["perplexity"] - q["perplexity"]) > 1e-6 for f, q in zip(float_records, records))
    pixels = imread(str(chart))[..., :3]
    for rgb in ((0.41, 0.41, 0.41), (0.545, 0.271, 0.075)):  # the dense and the conventional-MoE baseline
        assert (np.abs(pixels - np.array(rgb)).max(axis=-1) < 0.03).sum() > 50
