"""The benchmarks import against the package as it is (they run for minutes, so the suite only
loads them and checks the helpers they share with the package)."""

import importlib.util
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


@pytest.mark.parametrize("name", ["bench_ort", "bench_op", "bench_qop", "bench_decode", "bench_k_latency", "bench_quant_model", "bench_qmatmul", "quant_quality"])
def test_benchmark_imports(name, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))  # as when run from benchmarks/: bench_qop imports bench_op
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # top-level code only: main() is behind __main__
    assert callable(module.main)
