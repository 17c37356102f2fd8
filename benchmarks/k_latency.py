"""The latency figure of K on the GPT-2-Small-size model: what K = 1 → 8 costs a batch-1 decode step.

    .venv/bin/python -m benchmarks.k_latency [--runs 3] [--iters 100] [--budget 15] [--json benchmarks/results/k_latency.json]

shapes.SMALL with random weights, exported once per K (float32, quantile noise), run by
onnxruntime + the compiled kernel through the pipeline's own timing (report.bench.run_bench: the
two models interleaved, median with its order-statistic interval) `--runs` times; prints each run's
K = 1 and K = 8 medians with intervals, whether they separate, and the mean change.
"""

import argparse
import tempfile
import time
from pathlib import Path

from infmoe_export.export import export_onnx
from infmoe_export.model import InfMoEGPT
from infmoe_export.report.bench import run_bench
from infmoe_export.report.timing import within_noise

from . import arguments, record
from .shapes import SMALL

KS = (1, 8)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=arguments.count(), default=3)
    parser.add_argument("--iters", type=arguments.count(), default=100, help="most rounds per run")
    parser.add_argument("--budget", type=float, default=15.0, help="seconds of rounds per run and configuration")
    parser.add_argument("--json", type=Path, default=record.default_path("k_latency"), help="where to write the results")
    args = parser.parse_args()
    model = InfMoEGPT(SMALL)
    model.reset_parameters(0)
    model.eval()
    with tempfile.TemporaryDirectory() as folder:
        started = time.time()
        models = [export_onnx(model, Path(folder) / f"k{k}.onnx", k=k, noise="quantile") for k in KS]
        print(f"exported K = {', '.join(map(str, KS))} in {time.time() - started:.0f} s", flush=True)
        changes, runs = [], []
        for run in range(args.runs):
            bench = run_bench(model, models, backends=("ort",), batches=(1,), seqs=(1,), warmup=3,
                              iters=args.iters, budget_s=args.budget)
            ms = {r["k"]: r["latency_ms"] for r in bench["results"] if r["status"] == "ok"}
            one, eight = ms[KS[0]], ms[KS[-1]]
            changes.append(eight["median"] - one["median"])
            runs.append({"latency_ms": {KS[0]: one, KS[-1]: eight}, "change_ms": changes[-1],
                         "within_noise": within_noise(one, eight)})
            verdict = "within noise" if within_noise(one, eight) else "separated"
            print(f"run {run + 1}: K {KS[0]} {one['median']:.2f} [{one['ci_low']:.2f}–{one['ci_high']:.2f}] ms, "
                  f"K {KS[-1]} {eight['median']:.2f} [{eight['ci_low']:.2f}–{eight['ci_high']:.2f}] ms, "
                  f"change {changes[-1]:+.2f} ms ({verdict})", flush=True)
    print(f"mean K {KS[0]} → {KS[-1]} change over {len(changes)} runs: {sum(changes) / len(changes):+.2f} ms")
    result = {"config": SMALL.to_dict(), "ks": KS, "options": {**vars(args), "json": str(args.json)}, "runs": runs,
              "mean_change_ms": sum(changes) / len(changes)}
    print(f"results: {record.save(args.json, 'k_latency', result)}")


if __name__ == "__main__":
    main()
