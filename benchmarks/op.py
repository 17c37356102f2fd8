"""The op alone, side by side in one run: compiled kernel vs the standard-op fallback function
vs the PyTorch reference, on a GPT-2-Small-size ∞-MoE layer (D 768, H 6144, r 1536).

Decode (one token) is memory bound, so it is judged in GB/s of active bytes (the union rows of
w_in and w_out, plus b_in) against the memory bandwidth measured in this run; prefill (512
tokens) in tokens/s. Windows come from the quantile noise (SPEC §3) around a random mu per token.
Each decode call uses a different layer's weights (12 copies, like a 12-layer model), so no
weights are served from cache.

    .venv/bin/python -m benchmarks.op [--threads 2] [--json benchmarks/results/op.json]
"""

import os

# The runners take turns in one process: threads that spin after their call (OpenMP's default
# in torch, onnxruntime's pool) would steal the cores the next runner needs, so none spins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import pathlib
import statistics

import numpy as np
import onnxruntime as ort
import torch

from infmoe_export.export.function import op_model
from infmoe_export.model import continuous_slice_ffn
from infmoe_export.report.timing import cycling, memory_bandwidth, rounds
from infmoe_export.runtimes import ort_kernel

from . import arguments, record
from .shapes import D, H, LAYERS, R, layer_starts, union_rows


def measure_bandwidth(threads: int) -> float:
    """GB/s of a large copy (bytes read + bytes written) with `threads` threads."""
    return memory_bandwidth(threads=threads)["copy_gbs"]


def timed(calls: dict, layers: int, repeats: int) -> dict:
    """Median milliseconds per call of each runner, cycling over the layers' weights. The runners
    take turns call by call, so a change in machine load hits them all alike."""
    samples = rounds({name: cycling(call, layers) for name, call in calls.items()}, repeats, warmup=layers)
    return {name: 1e3 * statistics.median(t) for name, t in samples.items()}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=arguments.thread_count, default=2,
                        help="intra-op threads (onnxruntime and torch)")
    parser.add_argument("--repeats", type=arguments.count(), default=48, help="decode calls per measurement")
    parser.add_argument("--prefill-tokens", type=arguments.count(1, 1 << 16), default=512)
    parser.add_argument("--json", type=pathlib.Path, default=record.default_path("op"), help="write the results here")
    args = parser.parse_args()

    library = ort_kernel.custom_op_library()
    if library is None:
        raise SystemExit("benchmarks.op: the kernel library is not built (plugins/onnxruntime/build.sh)")
    torch.set_num_threads(args.threads)
    rng = np.random.default_rng(0)

    def random(*shape, scale):
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    layers = [dict(w_in=random(H, D, scale=0.02), b_in=random(H, scale=0.02), w_out=random(H, D, scale=0.02),
                   b_out=random(D, scale=0.02)) for _ in range(LAYERS)]
    torch_layers = [{n: torch.from_numpy(v) for n, v in layer.items()} for layer in layers]

    model = op_model(R, with_function=True).SerializeToString()
    sessions = {}
    for name, use_kernel in (("kernel", True), ("fallback", False)):
        options = ort.SessionOptions()
        options.intra_op_num_threads = args.threads
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        if use_kernel:
            ort_kernel.register(options)
        sessions[name] = ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])

    def runners(x, starts):
        ort_x, ort_starts = ort.OrtValue.ortvalue_from_numpy(x), ort.OrtValue.ortvalue_from_numpy(starts)
        ort_layers = [{n: ort.OrtValue.ortvalue_from_numpy(v) for n, v in layer.items()} for layer in layers]
        tx, ts = torch.from_numpy(x), torch.from_numpy(starts)

        def onnxruntime(session):
            return lambda i: session.run_with_ort_values(["Y"], dict(X=ort_x, starts=ort_starts, **ort_layers[i]))

        def reference(i):
            with torch.inference_mode():
                w = torch_layers[i]
                continuous_slice_ffn(tx, ts, w["w_in"], w["b_in"], w["w_out"], w["b_out"], R)

        return {"kernel": onnxruntime(sessions["kernel"]), "fallback": onnxruntime(sessions["fallback"]),
                "torch": reference}

    bandwidth = max(measure_bandwidth(1), measure_bandwidth(args.threads))
    decode = []
    for k in (1, 2, 4, 8):
        starts = layer_starts(1, k, rng).reshape(1, 1, k)
        x = rng.standard_normal((1, 1, D)).astype(np.float32)
        ms = timed(runners(x, starts), LAYERS, args.repeats)
        decode.append((k, union_rows(starts.reshape(1, k)), ms))
    # Measured again after the decode runs; the best is the roofline (load on a shared machine varies).
    bandwidth = max(bandwidth, measure_bandwidth(1), measure_bandwidth(args.threads))
    results = {"layer": dict(d_model=D, ffn_hidden=H, slice_width=R), "threads": args.threads,
               "bandwidth_gb_s": bandwidth, "decode": [], "prefill": []}
    print(f"memory bandwidth (copy, best of 1 and {args.threads} threads, before and after decode): "
          f"{bandwidth:.1f} GB/s")

    print(f"\ndecode, 1 token ({LAYERS} weight copies cycled)")
    print(f"{'K':>2} {'rows':>6} {'MB':>6} {'kernel ms':>10} {'fallback':>9} {'torch':>8} {'GB/s':>6} "
          f"{'roofline':>8} {'x fallback':>10} {'x torch':>8}")
    for k, rows, ms in decode:
        active = rows * (2 * D + 1) * 4
        gb_s = active / (ms["kernel"] / 1e3) / 1e9
        roofline = ms["kernel"] / (active / bandwidth / 1e6)  # measured / ideal time
        row = dict(k=k, union_rows=rows, active_mb=active / 1e6, kernel_ms=ms["kernel"], fallback_ms=ms["fallback"],
                   torch_ms=ms["torch"], kernel_gb_s=gb_s, roofline_ratio=roofline,
                   speedup_vs_fallback=ms["fallback"] / ms["kernel"], speedup_vs_torch=ms["torch"] / ms["kernel"])
        results["decode"].append(row)
        print(f"{k:>2} {rows:>6.0f} {active / 1e6:>6.1f} {ms['kernel']:>10.2f} {ms['fallback']:>9.2f} "
              f"{ms['torch']:>8.2f} {gb_s:>6.1f} {roofline:>8.2f} {row['speedup_vs_fallback']:>10.2f} "
              f"{row['speedup_vs_torch']:>8.2f}")

    n = args.prefill_tokens
    print(f"\nprefill, {n} tokens")
    print(f"{'K':>2} {'mean rows':>9} {'kernel tok/s':>12} {'fallback':>9} {'torch':>8} {'x fallback':>10}")
    for k in (1, 2, 4, 8):
        starts = layer_starts(n, k, rng).reshape(1, n, k)
        x = rng.standard_normal((1, n, D)).astype(np.float32)
        calls = runners(x, starts)
        rate = {name: n / (ms / 1e3) for name, ms in timed(calls, 1, 5).items()}
        row = dict(k=k, tokens=n, mean_union_rows=union_rows(starts.reshape(n, k)),
                   kernel_tokens_s=rate["kernel"], fallback_tokens_s=rate["fallback"], torch_tokens_s=rate["torch"],
                   speedup_vs_fallback=rate["kernel"] / rate["fallback"])
        results["prefill"].append(row)
        print(f"{k:>2} {row['mean_union_rows']:>9.0f} {rate['kernel']:>12.0f} {rate['fallback']:>9.0f} "
              f"{rate['torch']:>8.0f} {row['speedup_vs_fallback']:>10.2f}")

    print(f"\nwrote {record.save(args.json, 'op', results, args.threads)}")


if __name__ == "__main__":
    main()
