"""Issue 16's benchmark: a decode step against its roofline, per export target.

    .venv/bin/python benchmarks/bench_decode.py [--k 1,2,8] [--threads 2,1] [--json runs/bench_decode.json]

GPT-2-Small-size ∞-MoE (bench_ort.SMALL, random weights), onnxruntime + the compiled kernel,
batch 1, for the portable graph (standard ops, present = Concat(past, new): what Optimum runs)
and the onnxruntime target (DecoderAttention on a cache of n_positions shared in place,
runtimes/ort.py SharedCache, what `run` uses), and beside them the same onnxruntime target with
its DecoderAttention and WindowStarts nodes inlined as their fallback functions
(`onnxruntime-fallback`: GroupQueryAttention and the router's ten standard ops, what the target
ran before it had these two ops, and what runs without our library).
Per K and thread count:

- decode ms/token at past 128 and 512 (and 1, 1000 for K 2: decode vs past length), each timed
  step a token at exactly that past (the shared cache's length is set back before each step);
- the roofline: bytes the step must read (bench_ort.decode_bytes: weights it touches, the union
  of the windows, the KV cache) over the read bandwidth of onnxruntime's own MatMul (batch 1) on
  256 MiB weights taken in turn, enough of them to read twice the last-level cache between two
  reads of one (a single weight, read again and again, came partly from a 480 MiB L3: MatMul
  over 151 MB read 33.7 GB/s, over 604 MB or 1.8 GB 28.1, 2 threads), measured with the same
  threads, interleaved with the decode samples (one bandwidth sample before each decode
  sample). Two ratios: median decode over the roofline at the median bandwidth, and the best
  decode sample over the roofline at the best bandwidth sample (on a busy machine both sides' best are the closest to
  an idle one's);
- the fixed cost of a step: the same graph (12 layers, 12 heads) with tiny weights, at past 128
  (issue 16's figure) and at past 1 (the same without attention over a cache);
- node counts of both targets, as exported and after onnxruntime's optimizations (the saved
  optimized model), with what remains.

The machine is shared: every figure is a median over rounds that interleave what is compared,
each sample after a 50 ms pause (`settle`) in which the previous session's pool threads stop
spinning; within a sample the steps run back to back, as in a generation.
Last, each of issue 16's targets for the onnxruntime target, met or not (also in the JSON,
`goals_met`, which is rewritten atomically after each configuration).
"""

import argparse
import collections
import dataclasses
import sys
import tempfile
import time
from pathlib import Path
from statistics import median

import numpy as np
import onnx
import onnx.inliner
import onnxruntime as ort
import torch
from onnx import TensorProto, helper, numpy_helper

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_ort beside this file, however it is loaded
import arguments  # noqa: E402
from bench_ort import SMALL, decode_bytes  # noqa: E402
from infmoe_export.contract import DOMAIN  # noqa: E402
from infmoe_export.export import export_onnx  # noqa: E402
from infmoe_export.export.function import ATTENTION_OP_TYPE, ROUTER_OP_TYPE, STEP_OP_TYPE  # noqa: E402
from infmoe_export.files import write_json  # noqa: E402
from infmoe_export.model import InfMoEConfig, InfMoEGPT  # noqa: E402
from infmoe_export.report.bench import text_tokens  # noqa: E402
from infmoe_export.report.timing import environment, last_level_cache_bytes, time_calls  # noqa: E402
from infmoe_export.runtimes.ort import SharedCache, create_session  # noqa: E402
from infmoe_export.runtimes.ort_kernel import custom_op_library, register  # noqa: E402

# The fixed cost of a step: SMALL's 12 layers and 12 heads (head_dim 8) with tiny weights.
TINY_WEIGHTS = InfMoEConfig(vocab_size=256, n_positions=1024, d_model=96, n_layer=12, n_head=12, ffn_hidden=96,
                            slice_width=24, num_samples=2)
PASTS, SWEEP, SWEEP_K = (128, 512), (1, 128, 512, 1000), 2
FIXED_PASTS = (1, 128)  # issue 16's fixed cost is the last
TARGETS = ("portable", "onnxruntime")
FALLBACK = "onnxruntime-fallback"
VARIANTS = TARGETS + (FALLBACK,)
GOALS = {"over_roofline_past128_2threads": 1.10, "over_roofline_past512_2threads": 1.15,
         "over_roofline_1thread": 1.25, "fixed_cost_ms": 0.3}
BANDWIDTH_ROWS, BANDWIDTH_COLS = 4096, 16384  # 256 MiB float32 weights
# After a run, onnxruntime's pool threads spin a while before they sleep (allow_spinning, on by
# default, as deployed): a session sampled right after another shares the two cores with them
# (measured: the 2-thread MatMul read 18.6 GB/s median right after decode steps, 23.2 at 1 thread).
SETTLE_S = 0.05


def settle():
    """Let the previous session's spinning threads go to sleep before the next sample."""
    time.sleep(SETTLE_S)


class MatMulBandwidth:
    """Read GB/s of onnxruntime's MatMul: x [1, rows] @ W [rows, cols], W an initializer, one
    session per weight, taken in turn: twice the last-level cache's bytes between two reads of
    one weight, so none comes from the cache."""

    def __init__(self, threads: int):
        weight = np.random.default_rng(0).standard_normal((BANDWIDTH_ROWS, BANDWIDTH_COLS), dtype=np.float32)
        graph = helper.make_graph(
            [helper.make_node("MatMul", ["x", "w"], ["y"])], "bandwidth",
            [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, BANDWIDTH_ROWS])],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, BANDWIDTH_COLS])],
            [numpy_helper.from_array(weight, "w")])
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        # Each session its own pool: one spinning after its call would take a core from the next
        # (2 threads read 11.5 GB/s instead of 28 so); a call of ~10 ms pays its wake-up once.
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]).SerializeToString()
        self.copies = max(1, -(-2 * last_level_cache_bytes() // weight.nbytes))
        self.sessions = [ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])
                         for _ in range(self.copies)]
        self.feed = {"x": np.ones((1, BANDWIDTH_ROWS), np.float32)}
        self.bytes = weight.nbytes
        self.calls = 0

    def run(self):
        self.calls += 1
        self.sessions[self.calls % self.copies].run(None, self.feed)

    def sample(self, repeats: int = 3) -> float:
        settle()
        seconds = time_calls(self.run, 1, repeats)
        return self.bytes / median(seconds) / 1e9


class Decoder:
    """One exported model in one session: step(past)() times one decode token at that past."""

    def __init__(self, exported, threads: int, options: ort.SessionOptions = None):
        self.io = exported.io
        self.session = create_session(exported, kernel=True, providers=["CPUExecutionProvider"],
                                      intra_op_threads=threads, options=options)
        self.steps = {}

    def prepare(self, past: int):
        tokens = text_tokens(past + 1)[None]
        if self.io.shares_cache:
            cache = SharedCache(self.session, self.io)
            cache.step(tokens[:, :past])

            def step():
                cache.length = past  # the same position each time: a step at exactly `past`
                return cache.step(tokens[:, past:])
        else:
            present = self.session.run(None, self.io.feed(tokens[:, :past], np.ones((1, past), np.int64)))
            cache = dict(zip([o.name for o in self.session.get_outputs()], present))
            feed = self.io.feed(tokens[:, past:], np.ones((1, past + 1), np.int64),
                                [cache[n.replace("past_key_values", "present")] for n in self.io.past_names])

            def step():
                self.session.run(None, feed)
        self.steps[past] = step

    def sample(self, past: int, steps: int) -> float:
        """Median ms of `steps` decode steps (after one untimed)."""
        settle()
        return median(time_calls(self.steps[past], 1, steps)) * 1e3


def with_fallbacks(exported, path: Path):
    """The onnxruntime target with its DecoderAttention, WindowStarts and StepInputs nodes inlined
    as their fallback functions (docs/onnxruntime-kernel.md)."""
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
    samples = collections.defaultdict(list)
    gbs = []
    for _ in range(rounds):
        for target, decoder in decoders.items():
            for past in pasts:
                gbs.append(bandwidth.sample())
                samples[(target, past)].append(decoder.sample(past, steps))
    return samples, gbs


def fixed_cost(scratch: Path, threads_list, rounds: int, steps: int) -> dict:
    """The tiny-weights graph at past 128 (issue 16's fixed cost) and at past 1 (without the
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
        samples = collections.defaultdict(list)
        for _ in range(rounds):
            for target, decoder in decoders.items():
                for past in FIXED_PASTS:
                    samples[(target, past)].append(decoder.sample(past, steps))
        for (target, past), values in samples.items():
            q1, q2, q3 = (float(q) for q in np.percentile(values, (25, 50, 75)))
            result["ms"].append({"threads": threads, "past": past, "target": target, "median": q2, "q1": q1,
                                 "q3": q3, "best": min(values)})
    return result


def verdicts(result) -> list:
    """Issue 16's targets against what was measured: met when the median and the best sample
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
    parser.add_argument("--json", default="runs/bench_decode.json", help="where to write the results")
    args = parser.parse_args()
    sys.stdout.reconfigure(line_buffering=True)  # each row as it is measured, into a pipe or file too
    ks, threads_list = args.k, args.threads
    if custom_op_library() is None:
        sys.exit("bench_decode: the compiled kernel is not installed (docs/onnxruntime-kernel.md)")
    torch.manual_seed(0)
    result = {"environment": environment(), "goals": GOALS, "config": SMALL.to_dict(),
              "options": vars(args), "decode": []}

    def write():
        write_json(args.json, result)

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
    print("issue 16, onnxruntime target (median; best sample):")
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
