"""The whole-model quantization benchmark: is a quantized ∞-MoE faster by the bytes it saves?

    .venv/bin/python -m benchmarks.quant_model [--k 1,2,8] [--memory] [--json benchmarks/results/quant_model.json]

GPT-2-Small-size ∞-MoE (shapes.SMALL, random weights), onnxruntime + the compiled kernel,
`--target onnxruntime` exports (block 32), batch 1, at fp32, int8 and int4 experts, all-int8 and
all-int4 (`--quantize-other int8 / int4`: attention and the LM head through infmoe::QMatMul).
Per K, measured side by side in one run:

- decode ms/token at past 128 (sessions.Decoder: each timed step a token at exactly that
  past), interleaved round by round across the precisions and the peer, one sample of onnxruntime's
  own MatMul read bandwidth (timing.MatMulBandwidth, weights in turn) before each decode sample;
- each precision's roofline: the bytes that precision must read (roofline.decode_bytes) over the
  median bandwidth; ratios decode / roofline, and fp32 / precision;
- the peer: a dense GPT-2-Medium-size model (shapes.MEDIUM_DENSE, sessions.dense_matmulnbits) exported at fp32 with the
  onnxruntime target, the LM head's Transpose of the tied wte made a constant, then every MatMul
  with a constant weight (attention, FFN, the LM head) quantized by onnxruntime's own
  MatMulNBitsQuantizer (int4, symmetric, block 32, float activations). Not our dense int4 path:
  its FFN w_out is QDQ blocked along the output dimension, which onnxruntime does not fuse into
  MatMulNBits (a DequantizeLinear per step);
- all-int4 with onnxruntime's own MatMulNBits in place of QMatMul (what QMatMul's function runs
  without our kernel, `through_matmulnbits`), with float activations and with int8 activations
  (accuracy level 4): what our kernel buys, and what onnxruntime's int8-activation path buys,
  with its max logit error against all-int4 (judged at level 2, never level 1);
- what `infmoe-export onnx --dtype int8|int4` writes by default (all-int8 / all-int4 on int8
  activations with a float16 KV cache: options.export_choices) against the default fp32 export;
- prefill tokens/s at 512 tokens, interleaved the same way;
- with --memory, at the first K: file size and the peak RSS of a fresh process that loads and
  decodes (report.memory), per precision, for both export targets.

The machine may be shared: every figure is a median over interleaved rounds, each sample after
a pause (timing.settle).
"""

import argparse
import sys
import tempfile
from pathlib import Path
from statistics import median

import numpy as np
import torch

from infmoe_export.contract import ExportedModel
from infmoe_export.export import export_onnx
from infmoe_export.model import InfMoEGPT
from infmoe_export.options import export_choices
from infmoe_export.report.memory import files_of, measure_child
from infmoe_export.report.timing import MatMulBandwidth, median_ms, sampled_rounds
from infmoe_export.runtimes.ort_kernel import custom_op_library

from . import arguments, record
from .roofline import decode_bytes
from .sessions import Decoder, dense_matmulnbits, int8_activations, through_matmulnbits
from .shapes import BLOCK, MEDIUM_DENSE, PAST, PREFILL, SMALL

PRECISIONS = {"fp32": {}, "int8": {"dtype": "int8"}, "int4": {"dtype": "int4"},
              "all-int8": {"dtype": "int8", "quantize_other": "int8"},
              "all-int4": {"dtype": "int4", "quantize_other": "int4"}}
GOALS = {"int8_speedup": 2.5, "int4_speedup": 4.0, "over_roofline": 1.3, "vs_dense_medium_int4": 2.5,
         "prefill_vs_fp32": 1.0, "file_ratio_all_int4": 0.2, "peak_rss_ratio_all_int4": 0.35}
# Not precisions of their own (their roofline is all-int4's): all-int4 through onnxruntime's MatMulNBits.
NBITS, A8 = "all-int4, MatMulNBits", "all-int4, MatMulNBits int8 activations"
# What the first command a user types writes (`infmoe-export onnx --dtype int8|int4`, options.export_choices):
# all-int8 / all-int4 on the activations options.QUANTIZED_ACTIVATIONS names. Their rooflines are all-int8's and
# all-int4's.
FIRST = {f"onnx --dtype {dtype}": dtype for dtype in ("int8", "int4")}
AT_MOST = {"over_roofline", "file_ratio_all_int4", "peak_rss_ratio_all_int4"}


def interleaved_rounds(steps: dict, bandwidth: MatMulBandwidth, rounds: int, calls: int):
    """Per round, per entry: one bandwidth sample, then the median ms of `calls` calls."""
    samples, gbs = sampled_rounds({name: (lambda step=step: median_ms(step, calls)) for name, step in steps.items()},
                                  rounds, bandwidth.sample)
    return {name: median(values) for name, values in samples.items()}, gbs


def memory_rows(model: InfMoEGPT, scratch: Path, k: int, threads: int, exported: dict) -> list:
    """File bytes and peak RSS per precision and target, each in a fresh process; the onnxruntime
    target's models are the decode ones, the portable ones are exported here."""
    rows = []
    for target in ("onnxruntime", "portable"):
        for precision, options in PRECISIONS.items():
            if target == "onnxruntime":
                path = exported[precision]
            else:
                path = export_onnx(model, scratch / f"portable_{precision}.onnx", k=k, block_size=BLOCK,
                                   **options).path
            measured = measure_child("ort", ExportedModel.read(path), None, PAST, threads, None)
            if "error" in measured:
                sys.exit(f"benchmarks.quant_model: memory of {precision} ({target}): {measured['error']}")
            rows.append({"target": target, "precision": precision,
                         "file_bytes": sum(f.stat().st_size for f in files_of(path)), **measured})
            print(f"memory {target} {precision}: file {rows[-1]['file_bytes'] / 2**20:.0f} MiB, peak RSS "
                  f"{measured['peak_rss_bytes'] / 2**20:.0f} MiB (before load "
                  f"{measured['rss_before_load_bytes'] / 2**20:.0f})", flush=True)
            if target == "portable":
                path.unlink()
    for row in rows:
        fp32 = next(r for r in rows if r["target"] == row["target"] and r["precision"] == "fp32")
        row["file_ratio"] = row["file_bytes"] / fp32["file_bytes"]
        row["peak_rss_ratio"] = row["peak_rss_bytes"] / fp32["peak_rss_bytes"]
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--k", type=arguments.ks, default="1,2,8", help="expert budgets, comma-separated")
    parser.add_argument("--threads", type=arguments.thread_count, default=2, help="onnxruntime intra-op threads")
    parser.add_argument("--rounds", type=arguments.count(), default=5, help="interleaved decode rounds per K")
    parser.add_argument("--steps", type=arguments.count(), default=5, help="decode steps per sample (their median)")
    parser.add_argument("--prefill-rounds", type=arguments.count(), default=2, help="interleaved prefill rounds per K")
    parser.add_argument("--memory", action="store_true",
                        help="also file size and peak RSS per precision and target, at the first K")
    parser.add_argument("--json", default=record.default_path("quant_model"), help="where to write the results")
    args = parser.parse_args()
    ks = args.k
    if custom_op_library() is None:
        sys.exit("benchmarks.quant_model: the compiled kernel is not installed (docs/guide/onnxruntime.md)")
    torch.manual_seed(0)
    bandwidth = MatMulBandwidth(args.threads)
    result = {"goals": GOALS,
              "config": {"small": SMALL.to_dict(), "medium_dense": MEDIUM_DENSE.to_dict(), "past": PAST,
                         "prefill": PREFILL, "block_size": BLOCK, "threads": args.threads, "rounds": args.rounds,
                         "steps": args.steps, "prefill_rounds": args.prefill_rounds},
              "results": [], "memory": None}
    with tempfile.TemporaryDirectory(prefix="bench-quant-") as scratch:
        scratch = Path(scratch)
        peer = Decoder(dense_matmulnbits(scratch), args.threads)
        peer.prepare(PAST)
        small = InfMoEGPT(SMALL).eval()
        for k in ks:
            paths = {p: export_onnx(small, scratch / f"small_{p}.onnx", k=k, block_size=BLOCK, target="onnxruntime",
                                    **options).path for p, options in PRECISIONS.items()}
            paths.update({name: export_onnx(small, scratch / f"small_{dtype}_default.onnx", k=k,
                                            **export_choices(SMALL, [dtype])[0].options()).path
                          for name, dtype in FIRST.items()})
            decoders = {p: Decoder(ExportedModel.read(path), args.threads) for p, path in paths.items()}
            nbits = Decoder(ExportedModel.read(through_matmulnbits(paths["all-int4"], 1)), args.threads)
            a8 = Decoder(ExportedModel.read(through_matmulnbits(paths["all-int4"], 4)), args.threads, int8_activations())
            for decoder in [*decoders.values(), nbits, a8]:
                decoder.prepare(PAST)
            a8_error = float(np.abs(a8.steps[PAST]()["logits"] - decoders["all-int4"].steps[PAST]()["logits"]).max())
            decode, gbs = interleaved_rounds({**{p: d.steps[PAST] for p, d in decoders.items()},
                                              NBITS: nbits.steps[PAST], A8: a8.steps[PAST],
                                              "dense-medium-int4": peer.steps[PAST]},
                                             bandwidth, args.rounds, args.steps)
            prefill, _ = interleaved_rounds({p: d.prefill_at(PREFILL) for p, d in decoders.items()}, bandwidth,
                                            args.prefill_rounds, 1)
            del decoders, nbits, a8
            row = summarise(small, k, decode, prefill, median(gbs))
            row["a8_max_logit_error"] = a8_error
            result["results"].append(row)
            print_row(row)
            if args.memory and k == ks[0]:
                result["memory"] = memory_rows(small, scratch, k, args.threads, paths)
            for path in paths.values():
                path.unlink()
            record.save(args.json, "quant_model", result, args.threads)  # after every K, so a long run keeps what it measured
    print_summary(result)
    print(f"results: {args.json}")


def summarise(model, k, decode, prefill, read_gbs):
    """One K's figures and ratios."""
    rooflines = {p: decode_bytes(model, k, **options) / (read_gbs * 1e9) * 1e3 for p, options in PRECISIONS.items()}
    fp32 = decode["fp32"]
    return {"k": k, "read_gbs": read_gbs, "decode_ms": decode, "roofline_ms": rooflines,
            "prefill_tokens_per_s": {p: PREFILL / (ms / 1e3) for p, ms in prefill.items()},
            "ratios": {"int8_speedup": fp32 / decode["int8"], "int4_speedup": fp32 / decode["int4"],
                       "all_int8_speedup": fp32 / decode["all-int8"], "all_int4_speedup": fp32 / decode["all-int4"],
                       "all_int4_nbits_speedup": fp32 / decode[NBITS], "all_int4_a8_speedup": fp32 / decode[A8],
                       "first_command_speedup": {name: fp32 / decode[name] for name in FIRST},
                       "roofline_speedup": {p: rooflines["fp32"] / r for p, r in rooflines.items()},
                       "over_roofline": {p: decode[p] / rooflines[p] for p in PRECISIONS},
                       "vs_dense_medium_int4": {p: decode["dense-medium-int4"] / decode[p]
                                                for p in ("int4", "all-int4")},
                       "prefill_vs_fp32": {p: prefill["fp32"] / prefill[p] for p in PRECISIONS if p != "fp32"}}}


def verdict(goal: str, value: float) -> str:
    met = value <= GOALS[goal] if goal in AT_MOST else value >= GOALS[goal]
    return f"{value:.2f} ({'met' if met else 'MISSED'}: {'≤' if goal in AT_MOST else '≥'} {GOALS[goal]})"


def print_row(row):
    d, r = row["decode_ms"], row["roofline_ms"]
    print(f"K={row['k']} (read {row['read_gbs']:.1f} GB/s): decode ms/token " +
          ", ".join(f"{p} {d[p]:.2f} (roofline {r[p]:.2f})" for p in PRECISIONS) +
          "".join(f", {name} {d[name]:.2f}" for name in FIRST) +
          f", {NBITS} {d[NBITS]:.2f}, {A8} {d[A8]:.2f} (max |logit error| vs all-int4 "
          f"{row['a8_max_logit_error']:.3g})"
          f", dense Medium int4 {d['dense-medium-int4']:.2f}; prefill tokens/s " +
          ", ".join(f"{p} {v:.0f}" for p, v in row["prefill_tokens_per_s"].items()), flush=True)


def print_summary(result):
    for row in result["results"]:
        r = row["ratios"]
        print(f"K={row['k']}:")
        print(f"  int8 vs fp32 {verdict('int8_speedup', r['int8_speedup'])}; int4 vs fp32 "
              f"{verdict('int4_speedup', r['int4_speedup'])}; all-int8 vs fp32 "
              f"{verdict('int8_speedup', r['all_int8_speedup'])}; all-int4 vs fp32 "
              f"{verdict('int4_speedup', r['all_int4_speedup'])}; {NBITS} {r['all_int4_nbits_speedup']:.2f}; "
              f"{A8} {r['all_int4_a8_speedup']:.2f} (roofline allows " +
              ", ".join(f"{p} {v:.2f}" for p, v in r["roofline_speedup"].items() if p != "fp32") + ")")
        print("  the first command vs the default fp32 export: " +
              ", ".join(f"{name} {verdict(FIRST[name] + '_speedup', v)}"
                        for name, v in r["first_command_speedup"].items()))
        print("  over roofline: " + ", ".join(f"{p} {verdict('over_roofline', v)}"
                                              for p, v in r["over_roofline"].items()))
        print("  vs dense Medium int4: " + ", ".join(f"{p} {verdict('vs_dense_medium_int4', v)}"
                                                     for p, v in r["vs_dense_medium_int4"].items()))
        print("  prefill vs fp32: " + ", ".join(f"{p} {verdict('prefill_vs_fp32', v)}"
                                                for p, v in r["prefill_vs_fp32"].items()))
    for row in result["memory"] or []:
        if row["precision"] == "all-int4":
            print(f"memory, all-int4 vs fp32 ({row['target']}): file "
                  f"{verdict('file_ratio_all_int4', row['file_ratio'])}, peak RSS "
                  f"{verdict('peak_rss_ratio_all_int4', row['peak_rss_ratio'])}")


if __name__ == "__main__":
    main()
