"""A decode step against its roofline, per export target.

    .venv/bin/python -m benchmarks.decode [--k 1,2,8] [--threads 2,1] [--json benchmarks/results/decode.json]

GPT-2-Small-size ∞-MoE (shapes.SMALL, random weights), onnxruntime + the compiled kernel,
batch 1, for the portable graph (standard ops, present = Concat(past, new): what Optimum runs)
and the onnxruntime target (DecoderAttention on a cache of n_positions shared in place,
runtimes/ort.py SharedCache, what `run` uses), and beside them the same onnxruntime target with
its DecoderAttention and WindowStarts nodes inlined as their fallback functions
(`onnxruntime-fallback`: GroupQueryAttention and the router's ten standard ops, what the target
ran before it had these two ops, and what runs without our library).
Per K and thread count:

- decode ms/token at past 128 and 512 (and 1, 1000 for K 2: decode vs past length), each timed
  step a token at exactly that past (the shared cache's length is set back before each step);
- the roofline: bytes the step must read (roofline.decode_bytes: weights it touches, the union
  of the windows, the KV cache) over the read bandwidth of onnxruntime's own MatMul (batch 1,
  timing.MatMulBandwidth: weights taken in turn, none from the cache), measured with the same
  threads, interleaved with the decode samples (one bandwidth sample before each decode
  sample). Two ratios: median decode over the roofline at the median bandwidth, and the best
  decode sample over the roofline at the best bandwidth sample (on a busy machine both sides'
  best are the closest to an idle one's);
- the fixed cost of a step: the same graph (12 layers, 12 heads) with tiny weights, at past 128
  (the goal's figure) and at past 1 (the same without attention over a cache);
- node counts of both targets, as exported and after onnxruntime's optimizations (the saved
  optimized model), with what remains.

The machine is shared: every figure is a median over rounds that interleave what is compared,
each sample after a pause (timing.settle) in which the previous session's pool threads stop
spinning; within a sample the steps run back to back, as in a generation.
Last, each of the decode goals (GOALS) for the onnxruntime target, met or not (also in the JSON,
`goals_met`, which is rewritten atomically after each configuration).
"""

import argparse
import collections
import dataclasses
import sys
import tempfile
from pathlib import Path
from statistics import median

import numpy as np
import onnx
import onnx.inliner
import onnxruntime as ort
import torch

from infmoe_export.contract import DOMAIN
from infmoe_export.export import export_onnx
from infmoe_export.export.function import ATTENTION_OP_TYPE, ROUTER_OP_TYPE, STEP_OP_TYPE
from infmoe_export.model import InfMoEConfig, InfMoEGPT
from infmoe_export.report.timing import MatMulBandwidth, sampled_rounds
from infmoe_export.runtimes.ort_kernel import custom_op_library, register

from . import arguments, record
from .roofline import decode_bytes
from .sessions import Decoder
from .shapes import SMALL

# The fixed cost of a step: SMALL's 12 layers and 12 heads (head_dim 8) with tiny weights.
TINY_WEIGHTS = InfMoEConfig(vocab_size=256, n_positions=1024, d_model=96, n_layer=12, n_head=12, ffn_hidden=96,
                            slice_width=24, num_samples=2)
PASTS, SWEEP, SWEEP_K = (128, 512), (1, 128, 512, 1000), 2
FIXED_PASTS = (1, 128)  # the fixed-cost goal is at the last
TARGETS = ("portable", "onnxruntime")
FALLBACK = "onnxruntime-fallback"
VARIANTS = TARGETS + (FALLBACK,)
GOALS = {"over_roofline_past128_2threads": 1.10, "over_roofline_past512_2threads": 1.15,
         "over_roofline_1thread": 1.25, "fixed_cost_ms": 0.3}


def with_fallbacks(exported, path: Path):
    """The onnxruntime target with its DecoderAttention, WindowStarts and StepInputs nodes inlined
    as their fallback functions (docs/reference/ops/)."""
    inlined = [(DOMAIN, op_type) for op_type in (ATTENTION_OP_TYPE, ROUTER_OP_TYPE, STEP_OP_TYPE)]
    model = onnx.inliner.inline_selected_functions(onnx.load(str(exported.path)), inlined)
    onnx.save(model, str(path))
    return dataclasses.replace(exported, path=path)


def export_variants(model, scratch: Path, name: str, k: int) -> dict:
    """The model for each of VARIANTS."""
    exported = {t: export_onnx(model, scratch / f"{name}_{t}.onnx", k=k, target=t) for t in TARGETS}
    exported[FALLBACK] = with_fallbacks(exported["onnxruntime"], scratch / f"{name}_fallback.onnx")
    return exported


def node_counts(path: Path) -> dict:
    """Nodes as exported and after onnxruntime's optimizations (ORT_ENABLE_ALL, kernel registered)."""
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.optimized_model_filepath = str(path.with_suffix(".optimized.onnx"))
    register(options)
    ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    exported = onnx.load(str(path), load_external_data=False).graph.node
    optimized = onnx.load(options.optimized_model_filepath, load_external_data=False).graph.node
    return {"exported": len(exported), "optimized": len(optimized),
            "optimized_ops": dict(collections.Counter(n.op_type for n in optimized).most_common())}


def run_rounds(decoders, bandwidth, pasts, rounds, steps):
    """Interleaved: per round, per (target, past), one bandwidth sample then one decode sample.
    Returns the decode samples per (target, past) and the bandwidth samples."""
    samplers = {(target, past): (lambda d=decoder, p=past: d.sample(p, steps))
                for target, decoder in decoders.items() for past in pasts}
    return sampled_rounds(samplers, rounds, bandwidth.sample)


def fixed_cost(scratch: Path, threads_list, rounds: int, steps: int) -> dict:
    """The tiny-weights graph at past 128 (the fixed-cost goal's) and at past 1 (without the
    attention over a cache): per thread count, past and target, the median, quartiles and best
    of the samples, each the median of `steps` steps."""
    model = InfMoEGPT(TINY_WEIGHTS).eval()
    exported = export_variants(model, scratch, "tiny", 2)
    result = {"nodes": {t: node_counts(e.path) for t, e in exported.items()}, "ms": []}
    for threads in threads_list:
        decoders = {t: Decoder(e, threads) for t, e in exported.items()}
        for decoder in decoders.values():
            for past in FIXED_PASTS:
                decoder.prepare(past)
        samples, _ = sampled_rounds({(target, past): (lambda d=decoder, p=past: d.sample(p, steps))
                                     for target, decoder in decoders.items() for past in FIXED_PASTS}, rounds)
        for (target, past), values in samples.items():
            q1, q2, q3 = (float(q) for q in np.percentile(values, (25, 50, 75)))
            result["ms"].append({"threads": threads, "past": past, "target": target, "median": q2, "q1": q1,
                                 "q3": q3, "best": min(values)})
    return result


def verdicts(result) -> list:
    """The goals against what was measured: met when the median and the best sample
    both are within the goal."""
    lines = []
    for row in result["fixed_cost"]["ms"]:
        if row["target"] == "onnxruntime" and row["past"] == FIXED_PASTS[-1]:
            lines.append((f"fixed cost, {row['threads']} thread(s)", row["median"], row["best"], GOALS["fixed_cost_ms"]))
    for row in result["decode"]:
        goal = (GOALS["over_roofline_1thread"] if row["threads"] == 1 else
                GOALS.get(f"over_roofline_past{row['past']}_{row['threads']}threads"))
        if goal is not None and row["past"] in PASTS:
            lines.append((f"K={row['k']} threads={row['threads']} past={row['past']} over roofline",
                          row["over_roofline"]["onnxruntime"], row["best_over_roofline"]["onnxruntime"], goal))
    # On a busy machine the median and the best sample can fall on either side of a goal: then
    # neither is claimed.
    return [{"what": what, "median": value, "best": best, "goal": goal,
             "met": "met" if max(value, best) <= goal else "NOT met" if min(value, best) > goal else "unclear"}
            for what, value, best, goal in lines]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--k", type=arguments.counts(1, arguments.MAX_K, empty=True), default="1,2,8",
                        help="expert budgets, comma-separated ('' for the fixed cost only)")
    parser.add_argument("--threads", type=arguments.threads, default="2,1", help="intra-op thread counts, comma-separated")
    parser.add_argument("--rounds", type=arguments.count(), default=5, help="interleaved rounds per configuration")
    parser.add_argument("--steps", type=arguments.count(), default=10, help="decode steps per sample")
    parser.add_argument("--json", default=record.default_path("decode"), help="where to write the results")
    args = parser.parse_args()
    sys.stdout.reconfigure(line_buffering=True)  # each row as it is measured, into a pipe or file too
    ks, threads_list = args.k, args.threads
    if custom_op_library() is None:
        sys.exit("benchmarks.decode: the compiled kernel is not installed (docs/guide/onnxruntime.md)")
    torch.manual_seed(0)
    result = {"goals": GOALS, "config": SMALL.to_dict(), "options": {**vars(args), "json": str(args.json)},
              "decode": []}

    def write():
        record.save(args.json, "decode", result)

    with tempfile.TemporaryDirectory(prefix="bench-decode-") as scratch:
        scratch = Path(scratch)
        result["fixed_cost"] = fixed_cost(scratch, threads_list, args.rounds, 3 * args.steps)
        print_fixed_cost(result["fixed_cost"])
        write()
        small = InfMoEGPT(SMALL).eval()
        for k in ks:
            pasts = SWEEP if k == SWEEP_K else PASTS
            exported = export_variants(small, scratch, "small", k)
            active = {past: decode_bytes(small, k, past) for past in pasts}
            for threads in threads_list:
                bandwidth = MatMulBandwidth(threads)
                result["bandwidth_weights"] = bandwidth.copies
                decoders = {t: Decoder(e, threads) for t, e in exported.items()}
                for decoder in decoders.values():
                    for past in pasts:
                        decoder.prepare(past)
                samples, gbs = run_rounds(decoders, bandwidth, pasts, args.rounds, args.steps)
                del decoders, bandwidth
                for past in pasts:
                    roofline = active[past] / (median(gbs) * 1e9) * 1e3
                    best_roofline = active[past] / (max(gbs) * 1e9) * 1e3
                    row = {"k": k, "threads": threads, "past": past, "read_gbs": median(gbs),
                           "best_read_gbs": max(gbs), "bytes": active[past], "roofline_ms": roofline,
                           "decode_ms": {t: median(samples[(t, past)]) for t in VARIANTS},
                           "best_decode_ms": {t: min(samples[(t, past)]) for t in VARIANTS},
                           "over_roofline": {t: median(samples[(t, past)]) / roofline for t in VARIANTS},
                           "best_over_roofline": {t: min(samples[(t, past)]) / best_roofline for t in VARIANTS}}
                    result["decode"].append(row)
                    print_row(row)
                write()
            for e in exported.values():
                e.path.unlink()
    result["goals_met"] = verdicts(result)
    write()
    print("goals, onnxruntime target (median; best sample):")
    for line in result["goals_met"]:
        print(f"  {line['what']}: {line['median']:.3f} ({line['best']:.3f}) against {line['goal']}: {line['met']}")
    print(f"results: {args.json}")


def print_fixed_cost(fixed):
    for target, counts in fixed["nodes"].items():
        print(f"{target}: {counts['exported']} nodes exported, {counts['optimized']} after optimization: "
              f"{counts['optimized_ops']}")
    for row in fixed["ms"]:
        print(f"tiny weights, {row['threads']} thread(s), past {row['past']}, {row['target']}: {row['median']:.3f} ms "
              f"(quartiles {row['q1']:.3f}-{row['q3']:.3f}, best {row['best']:.3f})")


def print_row(row):
    d, r, b = row["decode_ms"], row["over_roofline"], row["best_over_roofline"]
    print(f"K={row['k']} threads={row['threads']} past={row['past']}: roofline {row['roofline_ms']:.2f} ms "
          f"({row['bytes'] / 1e6:.0f} MB at {row['read_gbs']:.1f} GB/s, best {row['best_read_gbs']:.1f}); " +
          ", ".join(f"{t} {d[t]:.2f} ms ({r[t]:.3f}x, best {b[t]:.3f}x)" for t in VARIANTS))


if __name__ == "__main__":
    main()
