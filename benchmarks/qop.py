"""The expert op's streaming speed, float and quantized, beside onnxruntime's own MatMul, in one run
(the op-alone figures of the kernel and of quantization), on the op benchmark's GPT-2-Small-size
layer (D 768, H 6144, r 1536, 12 weight copies cycled so that weights come from memory).

Decode (one token), K = 1, 2, 8, at 1 and 2 intra-op threads: the fp32, int8 and int4 op and a
MatMul [1, 768] x [768, 12288] cycling over 12 weights (453 MB, each reused as seldom as the op's
weights: fewer would be served partly from a large L3), taking turns call by call (in a shuffled
order every round) with an Identity node fed the op's six inputs: what a call costs onnxruntime
and the Python binding, not the op. The op alone is
each call minus that round's Identity call. Reported: raw medians, the op's net time and GB/s (the
bytes it must read: the union rows of w_in and w_out with their scales, and b_in) and the ratios
of net times in one round (op GB/s over MatMul GB/s, int4 speed over fp32 speed; raw speed ratios
beside them), medians over the rounds, so a change in the shared machine's load hits both sides
of a ratio alike. Fixed cost per
node: a tiny op (H 16, r 1) against an Identity node fed the same six inputs, in a tight loop of
their own, paired the same way. Prefill: 512 tokens, each quantized kernel's time over the fp32
kernel's, paired the same way.

    .venv/bin/python -m benchmarks.qop [--rounds 200] [--pool shared|session] [--json benchmarks/results/qop.json]

Thread pools (--pool): `shared` (default) runs every session of a thread count on one process-wide
pool (onnxruntime's global intra-op pool; one child process per thread count), whose threads spin
between calls as onnxruntime's do by default: what each node of a model sees, its nodes running
back to back on one session's pool. `session`: a pool per session that never spins
(session.intra_op.allow_spinning = 0; spinning pools would steal the two cores from the next
session's call), so every 2-thread call pays the wake-up of its second thread (tens of us).
"""

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile

import numpy as np
import onnxruntime as ort
import torch
from onnx import TensorProto, helper

from infmoe_export.export.function import op_model
from infmoe_export.quant import QuantizedWeight, n_blocks, packed_columns
from infmoe_export.report.timing import cycling, paired_ratio, rounds

from . import arguments, record
from .sessions import op_session as session, use_shared_pool
from .shapes import BLOCK, D, H, LAYERS, R, layer_starts, union_rows

MATMUL_N, MATMUL_COPIES = 12288, LAYERS  # the same reuse distance as the op's weights
PRECISIONS = ("fp32", "int8", "int4")
BITS = {"int8": 8, "int4": 4}


def row_bytes(precision: str) -> int:
    """Bytes the op reads per covered hidden unit: its w_in and w_out rows (with scales) and b_in."""
    if precision == "fp32":
        return 2 * D * 4 + 4
    return 2 * (packed_columns(D, BITS[precision]) + n_blocks(D, BLOCK) * 4) + 4


def matmul_model():
    graph = helper.make_graph([helper.make_node("MatMul", ["X", "W"], ["Y"])], "matmul",
                              [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("X", "W")],
                              [helper.make_tensor_value_info("Y", TensorProto.FLOAT, None)])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)


def layers(rng, h: int, copies: int):
    """Per copy, each precision's feeds (OrtValues) but X and starts."""
    out = []
    for _ in range(copies):
        w = {n: torch.from_numpy((rng.standard_normal(shape) * 0.02).astype(np.float32))
             for n, shape in (("w_in", (h, D)), ("b_in", (h,)), ("w_out", (h, D)), ("b_out", (D,)))}
        feeds = {"fp32": dict(w)}
        for precision, bits in BITS.items():
            q_in, q_out = QuantizedWeight.of(w["w_in"], bits, BLOCK), QuantizedWeight.of(w["w_out"], bits, BLOCK)
            feeds[precision] = dict(w_in_q=q_in.packed, w_in_scale=q_in.scale, b_in=w["b_in"], w_out_q=q_out.packed,
                                    w_out_scale=q_out.scale, b_out=w["b_out"])
        out.append({p: {n: ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(v.numpy())) for n, v in f.items()}
                    for p, f in feeds.items()})
    return out


def print_targets(results):
    """Each target (int4 op >= 5x the fp32 op at decode, int8 >= 2.5x; fp32 op
    GB/s >= 0.95x onnxruntime's MatMul, fixed cost per node < 5 us) beside the range measured."""
    print("\ntargets (decode ratios: the range over K; met when the worst K meets it)")
    for threads in sorted({row["threads"] for row in results["decode"]}):
        rows = [row for row in results["decode"] if row["threads"] == threads]
        for name, values, target in (
                ("int4 speed / fp32, net", [row["speed_vs_fp32"]["int4"] for row in rows], 5.0),
                ("int8 speed / fp32, net", [row["speed_vs_fp32"]["int8"] for row in rows], 2.5),
                ("fp32 GB/s / MatMul GB/s", [row["vs_matmul"]["fp32"] for row in rows], 0.95)):
            verdict = "met" if min(values) >= target else "NOT met"
            print(f"  {threads} thread(s) {name:<24} {min(values):5.2f} .. {max(values):5.2f}  target >= {target:4.2f}  {verdict}")
        fixed = [f["per_node_us"] for f in results.get("fixed", []) if f["threads"] == threads]
        if fixed:
            verdict = "met" if fixed[0] < 5.0 else "NOT met"
            print(f"  {threads} thread(s) {'fixed cost per node us':<24} {fixed[0]:5.2f}          target <  5.00  {verdict}")


def per_thread_count(args, thread_counts):
    """Each thread count in a child process of its own (one global pool per process), merged."""
    merged = None
    with tempfile.TemporaryDirectory() as tmp:
        for threads in thread_counts:
            out = pathlib.Path(tmp) / f"{threads}.json"
            subprocess.run([sys.executable, "-m", __spec__.name, "--rounds", str(args.rounds), "--prefill-rounds",
                            str(args.prefill_rounds), "--prefill-tokens", str(args.prefill_tokens), "--k", ",".join(map(str, args.k)),
                            "--threads", str(threads), "--json", str(out), "--child"], check=True,
                           cwd=pathlib.Path(__file__).resolve().parent.parent)
            results = json.loads(out.read_text())
            if merged is None:
                merged = results
            else:
                for key in ("decode", "prefill", "fixed"):
                    merged[key] += results[key]
    return merged


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=arguments.count(), default=200, help="decode calls per runner")
    parser.add_argument("--prefill-rounds", type=arguments.count(0), default=5, help="0: no prefill")
    parser.add_argument("--prefill-tokens", type=arguments.count(1, 1 << 16), default=512)
    parser.add_argument("--threads", type=arguments.threads, default="1,2")
    parser.add_argument("--k", type=arguments.ks, default="1,2,8")
    parser.add_argument("--pool", choices=("shared", "session"), default="shared")
    parser.add_argument("--json", type=pathlib.Path, default=record.default_path("qop"), help="write the results here")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)  # per_thread_count's run
    args = parser.parse_args()
    thread_counts = args.threads
    if args.pool == "shared" and len(thread_counts) > 1:
        results = per_thread_count(args, thread_counts)
        print_targets(results)
        print(f"\nwrote {record.save(args.json, 'qop', results)}")
        return
    if args.pool == "shared":
        use_shared_pool(thread_counts[0])
    rng = np.random.default_rng(0)
    weights = layers(rng, H, LAYERS)
    tiny = layers(rng, 16, 1)[0]["fp32"]
    matmul_w = [ort.OrtValue.ortvalue_from_numpy((rng.standard_normal((D, MATMUL_N)) * 0.02).astype(np.float32))
                for _ in range(MATMUL_COPIES)]
    matmul_x = ort.OrtValue.ortvalue_from_numpy(rng.standard_normal((1, D)).astype(np.float32))
    models = {"fp32": op_model(R), **{p: op_model(R, bits=b, block_size=BLOCK) for p, b in BITS.items()}}
    results = {"layer": dict(d_model=D, ffn_hidden=H, slice_width=R, block_size=BLOCK, layers=LAYERS),
               "cpu_variant_env": os.environ.get("INFMOE_CPU_VARIANT"), "pool": args.pool, "decode": [], "prefill": []}

    for threads in thread_counts:
        ops = {p: session(m, threads) for p, m in models.items()}
        tiny_op = session(op_model(1), threads)
        matmul = session(matmul_model(), threads, False)
        # The same six inputs into an Identity: what a node costs onnxruntime and the Python binding.
        identity_model = op_model(1)
        identity_model.graph.node[0].CopyFrom(helper.make_node("Identity", ["X"], ["Y"]))
        identity = session(identity_model, threads, False)
        print(f"\n{threads} thread(s): decode, 1 token, median of {args.rounds} calls each; net of the call "
              "(the Identity's time in the same round); ratios within a round")
        print(f"{'K':>2} {'rows':>5} | {'fp32 us':>8} {'int8 us':>8} {'int4 us':>8} {'MatMul us':>9} {'call us':>7} | "
              f"{'fp32 GB/s':>9} {'int8':>6} {'int4':>6} {'MatMul':>6} | {'fp32/MM':>7} {'int8/MM':>7} "
              f"{'int4/MM':>7} | {'int4 x':>6} {'int8 x':>6} | {'raw int4 x':>6} {'int8 x':>6}")
        for k in args.k:
            starts = layer_starts(1, k, rng).reshape(1, 1, k)
            rows = union_rows(starts.reshape(1, k))
            x, s = (ort.OrtValue.ortvalue_from_numpy(v) for v in (rng.standard_normal((1, 1, D)).astype(np.float32), starts))

            def op(precision):
                return cycling(lambda i: ops[precision].run_with_ort_values(
                    ["Y"], dict(X=x, starts=s, **weights[i][precision])), LAYERS)

            calls = {p: op(p) for p in PRECISIONS}
            calls["matmul"] = cycling(lambda i: matmul.run_with_ort_values(["Y"], dict(X=matmul_x, W=matmul_w[i])),
                                      MATMUL_COPIES)
            calls["call"] = cycling(lambda i: identity.run_with_ort_values(["Y"], dict(X=x, starts=s, **weights[i]["fp32"])),
                                    LAYERS)
            t = rounds(calls, args.rounds)
            net = {n: [a - b for a, b in zip(v, t["call"])] for n, v in t.items() if n != "call"}
            mm_bytes = D * MATMUL_N * 4
            gb_s = {p: [rows * row_bytes(p) / v / 1e9 for v in net[p]] for p in PRECISIONS}
            gb_s["matmul"] = [mm_bytes / v / 1e9 for v in net["matmul"]]
            row = dict(threads=threads, k=k, union_rows=rows,
                       us={n: 1e6 * statistics.median(v) for n, v in t.items()},
                       net_us={n: 1e6 * statistics.median(v) for n, v in net.items()},
                       gb_s={n: statistics.median(v) for n, v in gb_s.items()},
                       vs_matmul={p: paired_ratio(gb_s[p], gb_s["matmul"]) for p in PRECISIONS},
                       speed_vs_fp32={p: paired_ratio(net["fp32"], net[p]) for p in BITS},
                       raw_speed_vs_fp32={p: paired_ratio(t["fp32"], t[p]) for p in BITS})
            results["decode"].append(row)
            us, g, v, x32, raw = row["net_us"], row["gb_s"], row["vs_matmul"], row["speed_vs_fp32"], row["raw_speed_vs_fp32"]
            print(f"{k:>2} {rows:>5.0f} | {us['fp32']:>8.1f} {us['int8']:>8.1f} {us['int4']:>8.1f} {us['matmul']:>9.1f} "
                  f"{row['us']['call']:>7.1f} | {g['fp32']:>9.1f} {g['int8']:>6.1f} {g['int4']:>6.1f} {g['matmul']:>6.1f} | "
                  f"{v['fp32']:>7.2f} {v['int8']:>7.2f} {v['int4']:>7.2f} | {x32['int4']:>6.2f} {x32['int8']:>6.2f} | "
                  f"{raw['int4']:>6.2f} {raw['int8']:>6.2f}")

        # Fixed cost: a tight loop of the tiny op and the Identity taking turns, paired differences.
        x = ort.OrtValue.ortvalue_from_numpy(rng.standard_normal((1, 1, D)).astype(np.float32))
        feeds = dict(X=x, starts=ort.OrtValue.ortvalue_from_numpy(np.zeros((1, 1, 1), np.int64)), **tiny)
        t = rounds({"tiny": lambda: tiny_op.run_with_ort_values(["Y"], feeds),
                    "identity": lambda: identity.run_with_ort_values(["Y"], feeds)}, 20 * args.rounds)
        fixed = dict(threads=threads, tiny_us=1e6 * statistics.median(t["tiny"]),
                     identity_us=1e6 * statistics.median(t["identity"]),
                     per_node_us=1e6 * statistics.median(a - b for a, b in zip(t["tiny"], t["identity"])))
        results.setdefault("fixed", []).append(fixed)
        print(f"fixed cost per node: tiny op {fixed['tiny_us']:.1f} us, Identity with the same inputs "
              f"{fixed['identity_us']:.1f} us, paired difference {fixed['per_node_us']:.1f} us")

        if not args.prefill_rounds:
            continue
        n = args.prefill_tokens
        print(f"\n{threads} thread(s): prefill, {n} tokens, median of {args.prefill_rounds}; quantized time / fp32 time")
        print(f"{'K':>2} | {'fp32 ms':>8} {'int8 ms':>8} {'int4 ms':>8} | {'int8/fp32':>9} {'int4/fp32':>9}")
        for k in args.k:
            x = ort.OrtValue.ortvalue_from_numpy(rng.standard_normal((1, n, D)).astype(np.float32))
            s = ort.OrtValue.ortvalue_from_numpy(layer_starts(n, k, rng).reshape(1, n, k))

            def prefill(precision):
                return lambda: ops[precision].run_with_ort_values(["Y"], dict(X=x, starts=s, **weights[0][precision]))

            t = rounds({p: prefill(p) for p in PRECISIONS}, args.prefill_rounds)
            row = dict(threads=threads, k=k, tokens=n, ms={p: 1e3 * statistics.median(v) for p, v in t.items()},
                       time_vs_fp32={p: paired_ratio(t[p], t["fp32"]) for p in BITS})
            results["prefill"].append(row)
            ms, r32 = row["ms"], row["time_vs_fp32"]
            print(f"{k:>2} | {ms['fp32']:>8.1f} {ms['int8']:>8.1f} {ms['int4']:>8.1f} | {r32['int8']:>9.2f} {r32['int4']:>9.2f}")

    if not args.child:
        print_targets(results)
    print(f"\nwrote {record.save(args.json, 'qop', results)}")


if __name__ == "__main__":
    main()
