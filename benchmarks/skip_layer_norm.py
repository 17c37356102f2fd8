"""The onnxruntime target's residual add and LayerNorm, side by side in one run: infmoe::SkipLayerNorm
(the kernel) against onnxruntime's own com.microsoft SkipLayerNormalization (its fallback
function, the node the target wrote before), at D 768 (GPT-2 Small) for a decode step's rows (1,
and a batch of 16) and a prefill's (128, 512), gamma, beta and bias as initializers, as in the
export. The two sessions take turns call by call; each row also shows the time of the call's
memory traffic (input and skip read, output and sum written) at the copy bandwidth measured in
the same run.

    .venv/bin/python -m benchmarks.skip_layer_norm [--threads 2] [--rounds 200]
"""

import os

# The two sessions take turns in one process: a pool that spins after its call would steal the
# cores the other's call needs, so neither spins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import pathlib
import statistics

import numpy as np
import onnx
import onnxruntime as ort
from onnx import numpy_helper

from infmoe_export.export.function import skip_layer_norm_model
from infmoe_export.report.timing import memory_bandwidth, paired_ratio, rounds
from infmoe_export.runtimes import ort_kernel

from . import arguments, record
from .shapes import D

ROWS = (1, 16, 128, 512)
EPSILON = 1e-5


def with_constants(model: onnx.ModelProto, constants: dict) -> bytes:
    """The one-node model with gamma, beta and bias as initializers (the export's)."""
    inputs = [v for v in model.graph.input if v.name not in constants]
    del model.graph.input[:]
    model.graph.input.extend(inputs)
    model.graph.initializer.extend(numpy_helper.from_array(v, name) for name, v in constants.items())
    return model.SerializeToString()


def session(model: bytes, threads: int, kernel: bool) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    if kernel and not ort_kernel.register(options):
        raise SystemExit("benchmarks.skip_layer_norm: the kernel library is not built")
    return ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=arguments.thread_count, default=2, help="intra-op threads")
    parser.add_argument("--rounds", type=arguments.count(), default=200, help="interleaved calls per row count")
    parser.add_argument("--json", type=pathlib.Path, default=record.default_path("skip_layer_norm"),
                        help="write the results here")
    args = parser.parse_args()
    if ort_kernel.custom_op_library() is None:
        raise SystemExit("benchmarks.skip_layer_norm: the kernel library is not built")

    rng = np.random.default_rng(0)
    constants = {name: rng.standard_normal(D).astype(np.float32) for name in ("gamma", "beta", "bias")}
    kernel = session(with_constants(skip_layer_norm_model(EPSILON), constants), args.threads, kernel=True)
    onnxruntime = session(with_constants(skip_layer_norm_model(EPSILON, with_function=True), constants), args.threads,
                          kernel=False)
    bandwidth = memory_bandwidth(threads=args.threads)["copy_gbs"]
    results = {"d_model": D, "threads": args.threads, "bandwidth_gb_s": bandwidth, "rows": []}
    print(f"copy bandwidth: {bandwidth:.1f} GB/s")
    print(f"{'rows':>5} {'kernel us':>10} {'onnxruntime':>12} {'x onnxruntime':>14} {'traffic us':>11}")
    for rows in ROWS:
        feeds = {"input": rng.standard_normal((1, rows, D)).astype(np.float32),
                 "skip": rng.standard_normal((1, rows, D)).astype(np.float32)}
        samples = rounds({"kernel": lambda: kernel.run(None, feeds), "onnxruntime": lambda: onnxruntime.run(None, feeds)},
                         args.rounds, warmup=10)
        us = {name: 1e6 * statistics.median(s) for name, s in samples.items()}
        traffic_us = 4 * rows * D * 4 / (bandwidth * 1e9) * 1e6
        row = dict(rows=rows, kernel_us=us["kernel"], onnxruntime_us=us["onnxruntime"], traffic_us=traffic_us,
                   speedup=paired_ratio(samples["onnxruntime"], samples["kernel"]))
        results["rows"].append(row)
        print(f"{rows:>5} {us['kernel']:>10.1f} {us['onnxruntime']:>12.1f} {row['speedup']:>14.2f} {traffic_us:>11.1f}")
    print("(a call's time includes onnxruntime's run() from Python, a few microseconds, in both columns)")
    print(f"\nwrote {record.save(args.json, 'skip_layer_norm', results, args.threads)}")


if __name__ == "__main__":
    main()
