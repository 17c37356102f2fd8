"""The benchmarks import against the package as it is, and refuse bad arguments in one line (they
run for minutes, so the suite only loads them and checks their arguments)."""

import importlib.util
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def load(name):
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("name", ["bench_ort", "bench_op", "bench_qop", "bench_decode", "bench_k_latency", "bench_quant_model", "bench_qmatmul", "quant_quality"])
def test_benchmark_imports(name, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))  # as when run from benchmarks/: bench_qop imports bench_op
    assert callable(load(name).main)  # top-level code only: main() is behind __main__


# (benchmark, arguments, the flag its error names): each a one-line argparse error, exit 2, before
# anything is measured or allocated.
BAD_ARGUMENTS = [
    ("bench_qop", ["--prefill-rounds", "-1"], "--prefill-rounds"),
    ("bench_qop", ["--k", "1,,8"], "--k"),
    ("bench_qop", ["--threads", "100000"], "--threads"),
    ("bench_qop", ["--rounds", "0"], "--rounds"),
    ("bench_decode", ["--k", "0"], "--k"),
    ("bench_decode", ["--steps", "ten"], "--steps"),
    ("bench_ort", ["--k", "99999999"], "--k"),
    ("bench_ort", ["--warmup", "-2"], "--warmup"),
    ("bench_op", ["--threads", "0"], "--threads"),
    ("bench_op", ["--prefill-tokens", "1e9"], "--prefill-tokens"),
    ("bench_qmatmul", ["--threads", ""], "--threads"),
    ("bench_quant_model", ["--rounds", "0"], "--rounds"),
    ("bench_k_latency", ["--iters", "-5"], "--iters"),
    ("quant_quality", ["--windows", "0"], "--windows"),
]


@pytest.mark.parametrize("name, argv, flag", BAD_ARGUMENTS)
def test_bad_arguments_are_one_line_errors(name, argv, flag, monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    monkeypatch.setattr("sys.argv", [f"{name}.py", *argv])
    with pytest.raises(SystemExit) as exit_info:
        load(name).main()
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flag}" in err.strip().splitlines()[-1] and "Traceback" not in err, err


def test_gpu_triton_refuses_a_bad_block_size(monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    monkeypatch.setattr("sys.argv", ["gpu_triton.py", "--interpret", "--tiny", "--block-size", "24"])
    with pytest.raises(SystemExit) as exit_info:
        load("gpu_triton")  # its arguments are read at import
    assert "--block-size: block size must be a power of two" in str(exit_info.value.code)
