"""The benchmarks import as a package against the package as it is, refuse bad arguments in one
line (they run for minutes, so the suite only loads them and checks their arguments), and write
their results whole."""

import importlib
import json
import runpy

import pytest

from benchmarks import record
from infmoe_export.report import timing
from infmoe_export.report.timing import cycling, paired_ratio, rounds, sampled_rounds

SCRIPTS = ["ort", "op", "qop", "decode", "k_latency", "quant_model", "qmatmul", "quant_quality", "peers", "table", "llama",
           "moe_quality", "skip_layer_norm"]


@pytest.mark.parametrize("name", SCRIPTS)
def test_benchmark_imports(name):
    assert callable(importlib.import_module(f"benchmarks.{name}").main)  # top-level code only: main() is behind __main__


# (benchmark, arguments, the flag its error names): each a one-line argparse error, exit 2, before
# anything is measured or allocated.
BAD_ARGUMENTS = [
    ("qop", ["--prefill-rounds", "-1"], "--prefill-rounds"),
    ("qop", ["--k", "1,,8"], "--k"),
    ("qop", ["--threads", "100000"], "--threads"),
    ("qop", ["--rounds", "0"], "--rounds"),
    ("decode", ["--k", "0"], "--k"),
    ("decode", ["--steps", "ten"], "--steps"),
    ("ort", ["--k", "99999999"], "--k"),
    ("ort", ["--warmup", "-2"], "--warmup"),
    ("op", ["--threads", "0"], "--threads"),
    ("op", ["--prefill-tokens", "1e9"], "--prefill-tokens"),
    ("qmatmul", ["--threads", ""], "--threads"),
    ("quant_model", ["--rounds", "0"], "--rounds"),
    ("k_latency", ["--iters", "-5"], "--iters"),
    ("quant_quality", ["--windows", "0"], "--windows"),
    ("skip_layer_norm", ["--rounds", "0"], "--rounds"),
]


@pytest.mark.parametrize("name, argv, flag", BAD_ARGUMENTS)
def test_bad_arguments_are_one_line_errors(name, argv, flag, monkeypatch, capsys):
    monkeypatch.setattr("sys.argv", [f"benchmarks.{name}", *argv])
    with pytest.raises(SystemExit) as exit_info:
        importlib.import_module(f"benchmarks.{name}").main()
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flag}" in err.strip().splitlines()[-1] and "Traceback" not in err, err


def test_triton_kernel_refuses_a_bad_block_size(monkeypatch):
    monkeypatch.setattr("sys.argv", ["benchmarks.triton_kernel", "--interpret", "--tiny", "--block-size", "24"])
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_module("benchmarks.triton_kernel", run_name="__main__")  # a script: it runs as it loads
    assert "--block-size: block size must be a power of two" in str(exit_info.value.code)


def test_results_carry_the_machine_and_are_written_whole(tmp_path):
    path = record.save(tmp_path / "results" / "x.json", "x", {"rows": [1, 2], "machine": "a child's"}, threads=2)
    saved = json.loads(path.read_text())
    machine = saved["machine"]
    assert saved["benchmark"] == "x" and saved["rows"] == [1, 2]
    assert machine["cpu"] and machine["cores"] >= 1 and machine["ort_intra_op_threads"] == 2
    assert set(machine["cpu_features"]) <= set(timing.KERNEL_FEATURES)
    assert machine["date"][:2] == "20" and machine["versions"]["onnxruntime"] and machine["python"]
    assert len(machine["load_average"]) == 3
    assert [p.name for p in path.parent.iterdir()] == ["x.json"]  # no temporary file left behind


def test_rounds_interleave_and_cycle():
    calls = []
    samples = rounds({"a": cycling(lambda i: calls.append(("a", i)), 3), "b": lambda: calls.append(("b", 0))}, 5,
                     warmup=2)
    assert {name: len(s) for name, s in samples.items()} == {"a": 5, "b": 5}
    assert [i for name, i in calls if name == "a"] == [0, 1, 2, 0, 1, 2, 0]  # warm-up, then the rounds
    # Every round holds one call of each: the pairs of one round are next to each other.
    timed = calls[4:]
    assert all({timed[2 * r][0], timed[2 * r + 1][0]} == {"a", "b"} for r in range(5))
    assert paired_ratio([2.0, 4.0, 9.0], [1.0, 1.0, 3.0]) == 3.0


def test_sampled_rounds_probe_before_every_sample(monkeypatch):
    monkeypatch.setattr("infmoe_export.report.timing.SETTLE_S", 0.0)
    events = []
    samples, probed = sampled_rounds({"x": lambda: events.append("x") or 1.0, "y": lambda: events.append("y") or 2.0},
                                     3, probe=lambda: events.append("probe") or 9.0)
    assert samples == {"x": [1.0] * 3, "y": [2.0] * 3} and probed == [9.0] * 6
    assert events[::2] == ["probe"] * 6


def test_moe_quality_groups_seeds_into_mean_and_spread():
    from benchmarks import moe_quality

    records = [{"model": "∞-MoE", "k": 2, "seed": s, "perplexity": p} for s, p in ((0, 4.0), (1, 5.0), (2, 6.0))]
    records.append({"model": "moe top-2", "k": 2, "seed": 0, "perplexity": 4.5})
    rows = moe_quality.summary(records)
    assert [(r["model"], r["k"]) for r in rows] == [("∞-MoE", 2), ("moe top-2", 2)]
    assert rows[0]["seeds"] == [0, 1, 2] and rows[0]["mean"] == pytest.approx(5.0) and rows[0]["spread"] == pytest.approx(1.0)
    assert rows[1]["spread"] is None  # one seed: no spread, not a zero
