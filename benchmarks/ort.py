"""The model-level benchmark: is the compiled kernel worth it on a whole model?

    .venv/bin/python -m benchmarks.ort [--k 1,2,4,8] [--json benchmarks/results/ort.json]

A GPT-2-Small-size ∞-MoE with random weights (D 768, L 12, 12 heads, H 6144, r 1536, V 50257)
at each K, measured side by side in one run: batch-1 decode ms/token with a KV cache of 128
tokens and prefill tokens/s at 512 tokens, for onnxruntime + kernel, onnxruntime + the fallback
function, the PyTorch eager reference, and a dense GPT-2-Medium-size model (D 1024, L 24,
16 heads, H 4096) in onnxruntime. The roofline of a decode step is the bytes it must read
(every weight it touches — attention, the union of the K windows' rows of w_in and w_out, the
tied LM head — plus the KV cache) over the machine's streaming read bandwidth, measured in the
same run. Timing and feeds are those of `infmoe-export bench` (report/bench.py).
"""

import argparse
import sys
import tempfile
from pathlib import Path

import torch

from infmoe_export.export import export_onnx
from infmoe_export.model import InfMoEGPT
from infmoe_export.report.bench import measure
from infmoe_export.report.timing import memory_bandwidth
from infmoe_export.runtimes.registry import make_runner, unavailable

from . import arguments, record
from .roofline import decode_bytes
from .shapes import MEDIUM_DENSE, PAST, PREFILL, SMALL

TARGETS = {"decode_vs_fallback": 1.4, "decode_vs_eager": 1.5, "decode_vs_dense_medium": 2.5,
           "decode_over_roofline": 1.25, "prefill_vs_fallback": 1.0}


def timings(runner_backend, model, torch_model, warmup, iters):
    """(decode ms/token median, prefill tokens/s) of one backend on one model."""
    with make_runner(runner_backend, model, torch_model) as runner:
        decode = measure(runner, model, 1, 1, PAST, warmup, iters)
        prefill = measure(runner, model, 1, PREFILL, 0, 1, max(3, iters // 4))
    return decode["latency_ms"]["median"], prefill["tokens_per_s"]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--k", type=arguments.ks, default="1,2,4,8", help="expert budgets, comma-separated")
    parser.add_argument("--warmup", type=arguments.count(0), default=3)
    parser.add_argument("--iters", type=arguments.count(), default=10,
                        help="timed decode steps (prefill: a quarter, at least 3)")
    parser.add_argument("--json", default=record.default_path("ort"), help="where to write the results")
    args = parser.parse_args()
    ks = args.k
    torch.manual_seed(0)
    if unavailable("ort", None):
        sys.exit("benchmarks.ort: the compiled kernel is not installed (docs/guide/onnxruntime.md)")

    bandwidth = memory_bandwidth()
    print(f"streaming read bandwidth {bandwidth['read_gbs']:.2f} GB/s, copy {bandwidth['copy_gbs']:.2f} GB/s")
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-ort-") as scratch:
        medium = InfMoEGPT(MEDIUM_DENSE).eval()
        exported = export_onnx(medium, Path(scratch) / "medium.onnx", k=1, noise="quantile")
        medium_decode, medium_prefill = timings("ort", exported, medium, args.warmup, args.iters)
        print(f"dense Medium: decode {medium_decode:.2f} ms/token, prefill {medium_prefill:.1f} tokens/s")
        exported.path.unlink()
        del medium

        small = InfMoEGPT(SMALL).eval()
        for k in ks:
            exported = export_onnx(small, Path(scratch) / f"small_k{k}.onnx", k=k, noise="quantile")
            measured = {backend: timings(backend, exported, small, args.warmup, args.iters)
                        for backend in ("ort", "ort-fallback", "torch")}
            exported.path.unlink()
            active = decode_bytes(small, k)
            roofline_ms = active / (bandwidth["read_gbs"] * 1e9) * 1e3
            kernel_ms, kernel_prefill = measured["ort"]
            row = {"k": k, "decode_ms": {b: m[0] for b, m in measured.items()} | {"dense-medium": medium_decode},
                   "prefill_tokens_per_s": {b: m[1] for b, m in measured.items()} | {"dense-medium": medium_prefill},
                   "active_bytes": active, "roofline_ms": roofline_ms,
                   "ratios": {"decode_vs_fallback": measured["ort-fallback"][0] / kernel_ms,
                              "decode_vs_eager": measured["torch"][0] / kernel_ms,
                              "decode_vs_dense_medium": medium_decode / kernel_ms,
                              "decode_over_roofline": kernel_ms / roofline_ms,
                              "prefill_vs_fallback": kernel_prefill / measured["ort-fallback"][1]}}
            rows.append(row)
            print_row(row)
            write(args.json, bandwidth, args, rows)  # after every K, so a long run keeps what it measured

    print_summary(rows)
    print(f"results: {args.json}")


def write(path, bandwidth, args, rows):
    result = {"bandwidth": bandwidth, "targets": TARGETS,
              "config": {"small": SMALL.to_dict(), "medium_dense": MEDIUM_DENSE.to_dict(), "past": PAST,
                         "prefill": PREFILL, "warmup": args.warmup, "iters": args.iters}, "results": rows}
    record.save(path, "ort", result)


def met(name: str, value: float) -> bool:
    return value <= TARGETS[name] if name == "decode_over_roofline" else value >= TARGETS[name]


def print_row(row):
    d, p = row["decode_ms"], row["prefill_tokens_per_s"]
    print(f"K={row['k']}: decode ms/token kernel {d['ort']:.2f}, fallback {d['ort-fallback']:.2f}, eager "
          f"{d['torch']:.2f}, roofline {row['roofline_ms']:.2f}; prefill tokens/s kernel {p['ort']:.1f}, "
          f"fallback {p['ort-fallback']:.1f}, eager {p['torch']:.1f}")


def print_summary(rows):
    from rich.console import Console
    from rich.table import Table

    table = Table(title="kernel vs the others (ratios; target in brackets)")
    table.add_column("K", justify="right")
    for name, target in TARGETS.items():
        table.add_column(f"{name} [{'≤' if name == 'decode_over_roofline' else '≥'}{target}]", justify="right")
    for row in rows:
        table.add_row(str(row["k"]), *(f"[{'green' if met(n, v) else 'red'}]{v:.2f}[/]"
                                       for n, v in row["ratios"].items()))
    Console().print(table)


if __name__ == "__main__":
    main()
