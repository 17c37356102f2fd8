"""infmoe::QMatMul (the onnxruntime target's quantized attention and LM head) beside onnxruntime's
own MatMulNBits on the same storage, and onnxruntime's fp32 MatMul on the same matrix, in one run.

GPT-2-Small's matrices (K 768: the LM head N 50257, qkv N 2304), int4 and int8, block 32, at 1
and 2 intra-op threads. Decode (one token): the runners take turns call by call (in a shuffled
order every round), each cycling over sessions holding copies of its weight as constants (so
that onnxruntime prepacks MatMulNBits' as in a model, and each call reads from memory: at least
48 MB a runner), with an Identity node on the same input to subtract what a call costs
onnxruntime and the Python binding. Reported: net µs, GB/s (the bytes the matrix
holds at that precision, scales included; fp32 for the MatMul) and, per round, QMatMul's speed
over MatMulNBits' with float activations (accuracy level 1, what QMatMul's function runs without
our kernel), QMatMul's on int8 activations (infmoe.activations = int8) over MatMulNBits' on them
(level 4; both off the level-1 reference), and QMatMul's GB/s over the fp32 MatMul's
(onnxruntime's best GEMV: the roofline). Prefill (512 tokens, qkv):
QMatMul's time over MatMulNBits' (level 1) and over the fp32 MatMul's.

    .venv/bin/python -m benchmarks.qmatmul [--rounds 100] [--json benchmarks/results/qmatmul.json]

No session spins between calls (each session has its own pool, whose spinning threads would
steal the two cores from the next session's call).
"""

import argparse
import pathlib
import statistics

import numpy as np
import onnxruntime as ort
import torch
from onnx import TensorProto, helper, numpy_helper

from infmoe_export.export.function import qmatmul_model
from infmoe_export.quant import pack_blocks, quantize
from infmoe_export.report.timing import cycling, paired_ratio, rounds

from . import arguments, record
from .sessions import op_session as session
from .shapes import BLOCK, PREFILL, SMALL

K = SMALL.d_model
MATRICES = {"lm_head": SMALL.vocab_size, "qkv": 3 * SMALL.d_model}
COPY_BYTES = 48 << 20  # each runner cycles over at least this many bytes of weights (L3: 32 MB)


def model(op_type: str, n: int, bits: int, weights: dict, accuracy_level: int = 0):
    """One node on A [tokens, K] and constant weights (onnxruntime prepacks those of MatMulNBits):
    QMatMul, MatMulNBits (QMatMul's function) or the float MatMul."""
    if op_type == "QMatMul":
        proto = qmatmul_model(K, n, bits, BLOCK)
        del proto.graph.input[1:]
    else:
        if op_type == "MatMul":
            node = helper.make_node("MatMul", ["A", "W"], ["Y"])
        else:
            node = helper.make_node("MatMulNBits", ["A", "B", "scales"], ["Y"], domain="com.microsoft", K=K, N=n,
                                    bits=bits, block_size=BLOCK, accuracy_level=accuracy_level)
        graph = helper.make_graph([node], op_type, [helper.make_tensor_value_info("A", TensorProto.FLOAT, None)],
                                  [helper.make_tensor_value_info("Y", TensorProto.FLOAT, None)])
        proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("com.microsoft", 1)],
                                  ir_version=10)
    proto.graph.initializer.extend(numpy_helper.from_array(v, name) for name, v in weights.items())
    return proto


def identity_model():
    graph = helper.make_graph([helper.make_node("Identity", ["A"], ["Y"])], "identity",
                              [helper.make_tensor_value_info("A", TensorProto.FLOAT, None)],
                              [helper.make_tensor_value_info("Y", TensorProto.FLOAT, None)])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)


def runners(rng, n: int, bits: int, threads: int):
    """Per runner, sessions holding copies of one random weight as constants (cycled, so that each
    call reads from memory), and each runner's bytes per call."""
    w = torch.from_numpy(rng.standard_normal((n, K)).astype(np.float32) * K ** -0.5)
    q, scale = quantize(w, bits, BLOCK)
    quantized = dict(B=pack_blocks(q, bits, BLOCK).numpy(), scales=scale.numpy())
    q_bytes = sum(v.nbytes for v in quantized.values())
    floats = dict(W=np.ascontiguousarray(w.numpy().T))
    # name: (op, weights, MatMulNBits' accuracy level, QMatMul's activations)
    copies = {"qmatmul": ("QMatMul", quantized, 0, "float"), "qmatmul_a8": ("QMatMul", quantized, 0, "int8"),
              "nbits": ("MatMulNBits", quantized, 1, None), "nbits_a8": ("MatMulNBits", quantized, 4, None),
              "fp32": ("MatMul", floats, 0, None)}
    out, size = {}, {}
    for name, (op_type, weights, level, activations) in copies.items():
        size[name] = sum(v.nbytes for v in weights.values())
        proto = model(op_type, n, bits, weights, level)
        out[name] = [session(proto, threads, op_type == "QMatMul", activations)
                     for _ in range(-(-COPY_BYTES // size[name]))]
    out["call"] = [session(identity_model(), threads, False)]
    return out, {**size, "call": q_bytes}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=arguments.count(), default=100,
                        help="decode calls per runner (a fifth for the LM head)")
    parser.add_argument("--prefill-rounds", type=arguments.count(), default=3)
    parser.add_argument("--threads", type=arguments.threads, default="1,2")
    parser.add_argument("--json", type=pathlib.Path, default=record.default_path("qmatmul"), help="write the results here")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    results = {"k": K, "block_size": BLOCK, "decode": [], "prefill": []}
    a = ort.OrtValue.ortvalue_from_numpy(rng.standard_normal((1, K)).astype(np.float32))
    a_prefill = ort.OrtValue.ortvalue_from_numpy(rng.standard_normal((PREFILL, K)).astype(np.float32))
    print("decode, 1 token, net of the call (an Identity's time in the same round); GB/s of the weight as stored")
    print(f"{'matrix':>8} {'bits':>4} {'thr':>3} | {'QMatMul us':>10} {'a8 us':>7} {'NBits us':>9} {'NBits a8':>9} "
          f"{'fp32 MM':>8} | {'QMatMul':>7} {'a8':>6} {'NBits':>6} {'a8':>6} {'fp32':>6} GB/s | {'vs NBits':>8} "
          f"{'a8 vs a8':>8} {'/fp32 GB/s':>10}")
    for name, n in MATRICES.items():
        for bits in (4, 8):
            for threads in args.threads:
                sessions, size = runners(rng, n, bits, threads)

                def call(runner, inputs):
                    return cycling(lambda i: sessions[runner][i].run_with_ort_values(["Y"], dict(A=inputs)),
                                   len(sessions[runner]))

                t = rounds({r: call(r, a) for r in sessions}, args.rounds if n < 10000 else max(args.rounds // 5, 10))
                net = {r: [x - y for x, y in zip(v, t["call"])] for r, v in t.items() if r != "call"}
                gb_s = {r: [size[r] / x / 1e9 for x in v] for r, v in net.items()}
                row = dict(matrix=name, n=n, bits=bits, threads=threads, copies=len(sessions["qmatmul"]),
                           net_us={r: 1e6 * statistics.median(v) for r, v in net.items()},
                           gb_s={r: statistics.median(v) for r, v in gb_s.items()},
                           speed_vs_nbits=paired_ratio(net["nbits"], net["qmatmul"]),
                           a8_speed_vs_nbits_a8=paired_ratio(net["nbits_a8"], net["qmatmul_a8"]),
                           gb_s_vs_fp32=paired_ratio(gb_s["qmatmul"], gb_s["fp32"]))
                results["decode"].append(row)
                us, g = row["net_us"], row["gb_s"]
                print(f"{name:>8} {bits:>4} {threads:>3} | {us['qmatmul']:>10.1f} {us['qmatmul_a8']:>7.1f} {us['nbits']:>9.1f} "
                      f"{us['nbits_a8']:>9.1f} {us['fp32']:>8.1f} | {g['qmatmul']:>7.1f} {g['qmatmul_a8']:>6.1f} "
                      f"{g['nbits']:>6.1f} {g['nbits_a8']:>6.1f} {g['fp32']:>6.1f}      | {row['speed_vs_nbits']:>8.2f} "
                      f"{row['a8_speed_vs_nbits_a8']:>8.2f} {row['gb_s_vs_fp32']:>10.2f}", flush=True)
                if name == "qkv":  # prefill: one matrix is enough to compare the GEMM paths
                    t = rounds({r: lambda r=r: sessions[r][0].run_with_ort_values(["Y"], dict(A=a_prefill))
                                for r in ("qmatmul", "nbits", "fp32")}, args.prefill_rounds)
                    results["prefill"].append(dict(matrix=name, bits=bits, threads=threads, tokens=PREFILL,
                                                   ms={r: 1e3 * statistics.median(v) for r, v in t.items()},
                                                   time_vs_nbits=paired_ratio(t["qmatmul"], t["nbits"]),
                                                   time_vs_fp32=paired_ratio(t["qmatmul"], t["fp32"])))
    print(f"\nprefill, {PREFILL} tokens, qkv: QMatMul time / MatMulNBits time, / fp32 MatMul time")
    for row in results["prefill"]:
        ms = row["ms"]
        print(f"  int{row['bits']} {row['threads']} thread(s): QMatMul {ms['qmatmul']:.2f} ms, MatMulNBits {ms['nbits']:.2f},"
              f" fp32 {ms['fp32']:.2f}: {row['time_vs_nbits']:.2f}, {row['time_vs_fp32']:.2f}")
    print(f"\nwrote {record.save(args.json, 'qmatmul', results)}")


if __name__ == "__main__":
    main()
