"""Issue 4's model-level benchmark: is the compiled kernel worth it on a whole model?

    .venv/bin/python benchmarks/bench_ort.py [--k 1,2,4,8] [--json runs/bench_ort.json]

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
import math
import sys
import tempfile
from pathlib import Path

import torch

import arguments
from infmoe_export.export import export_onnx
from infmoe_export.files import write_json
from infmoe_export.model import InfMoEConfig, InfMoEGPT, coverage
from infmoe_export.quant import BITS
from infmoe_export.report.bench import measure, text_tokens
from infmoe_export.report.timing import environment, memory_bandwidth
from infmoe_export.runtimes.registry import make_runner, unavailable

SMALL = InfMoEConfig(vocab_size=50257, n_positions=1024, d_model=768, n_layer=12, n_head=12, ffn_hidden=6144,
                     slice_width=1536, num_samples=2)
MEDIUM_DENSE = InfMoEConfig(vocab_size=50257, n_positions=1024, d_model=1024, n_layer=24, n_head=16,
                            ffn_hidden=4096, slice_width=4096, num_samples=1)
PAST, PREFILL, BLOCK = 128, 512, 32  # BLOCK: the quantized exports' block size
TARGETS = {"decode_vs_fallback": 1.4, "decode_vs_eager": 1.5, "decode_vs_dense_medium": 2.5,
           "decode_over_roofline": 1.25, "prefill_vs_fallback": 1.0}


def stored_bytes(numel: int, rows: int, bits: int) -> int:
    """Bytes of numel weights in `rows` rows at `bits` (SPEC §6: float32 scales per block of BLOCK)."""
    if bits == 32:
        return 4 * numel
    return numel * bits // 8 + rows * math.ceil(numel // rows / BLOCK) * 4


def decode_bytes(model: InfMoEGPT, k: int, past: int = PAST, dtype: str = "fp32", quantize_other: str = "none") -> int:
    """Bytes a batch-1 decode step at `past` must read at this precision: every weight except the
    unused rows of w_in / w_out and all but two embedding rows, the tied LM head (all of wte), the
    KV cache; quantized matrices at their bits plus their scales. The union of the windows is the
    one the reference picks for the timed token (the benchmark's text)."""
    c = model.config
    expert_bits, other_bits = BITS.get(dtype, 32), BITS.get(quantize_other, 32)
    ids = torch.from_numpy(text_tokens(past + 1)).view(1, -1)
    with torch.no_grad():
        starts = model(ids, k=k, return_starts=True).starts
    total = 0
    for name, p in model.named_parameters():
        if name.endswith(("moe.w_in", "moe.w_out")):
            continue
        if name == "wte.weight":
            total += 2 * stored_bytes(c.d_model, 1, other_bits) + stored_bytes(p.numel(), c.vocab_size, other_bits)
        elif name == "wpe.weight":
            total += 2 * 4 * c.d_model
        elif name.endswith(("attn.qkv.weight", "attn.proj.weight")):
            total += stored_bytes(p.numel(), p.shape[0], other_bits)
        else:
            total += 4 * p.numel()
    for s in starts:
        union = int((coverage(s[0, -1], c.ffn_hidden, c.slice_width) > 0).sum())
        total += 2 * stored_bytes(union * c.d_model, union, expert_bits)
    return total + 4 * c.n_layer * 2 * past * c.d_model


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
    parser.add_argument("--json", default="runs/bench_ort.json", help="where to write the results")
    args = parser.parse_args()
    ks = args.k
    torch.manual_seed(0)
    if unavailable("ort", None):
        sys.exit("bench_ort: the compiled kernel is not installed (docs/onnxruntime-kernel.md)")

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
    result = {"environment": environment(), "bandwidth": bandwidth, "targets": TARGETS,
              "config": {"small": SMALL.to_dict(), "medium_dense": MEDIUM_DENSE.to_dict(), "past": PAST,
                         "prefill": PREFILL, "warmup": args.warmup, "iters": args.iters}, "results": rows}
    write_json(path, result)


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
