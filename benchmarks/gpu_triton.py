"""The Triton ContinuousSliceFFN kernel on a GPU: correctness, then batch-1 decode bandwidth.

    .venv/bin/python benchmarks/gpu_triton.py            # on a machine with a CUDA GPU
    .venv/bin/python benchmarks/gpu_triton.py --interpret --tiny   # logic smoke test on a CPU

1. Checks the kernel (both modes) against the reference op on the GPU, float32 and float16, and
   that the driver loads the PTX the TensorRT AOT plugin bakes into engines (infmoe_trt.compile:
   this GPU's capability, the PTX ISA version of this driver).
2. Times one decode token (batch 1) of a GPT-2-Small-size layer (D 768, H 6144, r 1536) for
   K = 1, 2, 4, 8: the kernel against the dense-masked PyTorch computation (the reference op,
   all H units). Bandwidth = bytes the op must read (the union of the windows' rows of w_in and
   w_out, plus biases and x) / time, compared with the GPU's copy bandwidth measured in the same
   run (device-to-device copy of 1 GiB). Target: >= 70 % of it. L2 is flushed before every timed
   call (triton.testing.do_bench), so weights come from HBM as in a real decode step.

Prints a table and one JSON line (prefix "JSON "). Exits 2 without a CUDA GPU, 1 if a check fails.
"""

import argparse
import json
import math
import os
import sys
import time


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--interpret", action="store_true", help="run in Triton's CPU interpreter (smoke test)")
    parser.add_argument("--tiny", action="store_true", help="a tiny layer instead of GPT-2 Small")
    parser.add_argument("--ks", default="1,2,4,8")
    return parser.parse_args()


args = parse_args()
if args.interpret:
    os.environ["TRITON_INTERPRET"] = "1"  # before the kernel module is imported

import torch  # noqa: E402

from infmoe_export.model import continuous_slice_ffn, quantile_noise, window_starts  # noqa: E402
from infmoe_trt import kernel  # noqa: E402
device = "cpu" if args.interpret else "cuda"
if not args.interpret and not torch.cuda.is_available():
    print("gpu_triton: no CUDA GPU visible to torch (this benchmark needs one; "
          "use --interpret --tiny for a CPU smoke test of its logic)", file=sys.stderr)
    sys.exit(2)
D, H, R = (24, 96, 24) if args.tiny else (768, 6144, 1536)
KS = [int(k) for k in args.ks.split(",")]


def bench_ms(fn) -> float:
    """Median milliseconds of fn; on a GPU with L2 flushed before every call."""
    if device == "cuda":
        import triton.testing

        return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")
    times = []
    for _ in range(3):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return sorted(times)[1]


def layer(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    w_in = torch.randn(H, D, generator=g) / math.sqrt(D)
    b_in = torch.randn(H, generator=g) * 0.1
    w_out = torch.randn(H, D, generator=g) / math.sqrt(R)
    b_out = torch.randn(D, generator=g) * 0.1
    return [t.to(device=device, dtype=dtype) for t in (w_in, b_in, w_out, b_out)]


def decode_starts(tokens, k, seed=0):
    """Starts as the router makes them with quantile noise: z = mu + sigma * eps_k."""
    g = torch.Generator().manual_seed(seed)
    mu = torch.randn(tokens, 1, generator=g)
    sigma = torch.nn.functional.softplus(torch.randn(tokens, 1, generator=g))
    return window_starts(mu + sigma * quantile_noise(k), H, R).to(device)


# ---------------------------------------------------------------------------------------------
# 1. Correctness on the device

failures = []
for dtype, tol in ((torch.float32, 1e-4), (torch.float16, 1e-2)):
    weights = layer(dtype)
    for tokens in (1, 7) if args.interpret else (1, 64, 333):
        for k in KS:
            x = torch.randn(tokens, D, generator=torch.Generator().manual_seed(k)).to(device=device, dtype=dtype)
            starts = decode_starts(tokens, k, seed=k)
            ref = continuous_slice_ffn(x.float(), starts, *(w.float() for w in weights), R)
            for deterministic in (True, False):
                y = kernel.continuous_slice_ffn_triton(x, starts, *weights, R, deterministic=deterministic)
                err = ((y.float() - ref).abs().max() / ref.abs().max().clamp(min=1)).item()
                ok = err <= tol
                mode = "columns" if deterministic else "split"
                print(f"check {str(dtype)[6:]:8} tokens {tokens:4} K {k} {mode:8} max rel err {err:.2e} "
                      f"{'ok' if ok else 'FAIL'}")
                if not ok:
                    failures.append((str(dtype), tokens, k, mode, err))



def ptx_loads(dtype: str) -> str:
    """Compile the engines' kernel as the AOT plugin does and load it with cuModuleLoadData in
    torch's (current) context: '' when the driver accepts it, else the error."""
    import ctypes

    from infmoe_trt.compile import compile_ptx

    compiled = compile_ptx(dtype, H=H, D=D, R=R, K=2)
    cuda = ctypes.CDLL("libcuda.so.1")
    module = ctypes.c_void_p()
    status = cuda.cuModuleLoadData(ctypes.byref(module), compiled["ptx"].encode() + b"\0")
    if status:
        return f"cuModuleLoadData failed with CUresult {status} (PTX ISA {compiled['ptx_version']})"
    cuda.cuModuleUnload(module)
    return ""


if device == "cuda":
    torch.zeros(1, device=device)  # makes torch's context current for the driver API
    for dtype in ("fp32", "fp16"):
        problem = ptx_loads(dtype)
        print(f"check AOT PTX {dtype} loads in this driver: {'ok' if not problem else 'FAIL ' + problem}")
        if problem:
            failures.append(("ptx", dtype, problem))

# ---------------------------------------------------------------------------------------------
# 2. Batch-1 decode bandwidth

copy_bytes = (1 << 30) if device == "cuda" else (1 << 24)
source = torch.empty(copy_bytes // 4, dtype=torch.float32, device=device)
target = torch.empty_like(source)
copy_gbs = 2 * copy_bytes / bench_ms(lambda: target.copy_(source)) / 1e6  # read + write
del source, target
gpu = torch.cuda.get_device_name() if device == "cuda" else "cpu (interpreter)"
print(f"\n{gpu}: copy bandwidth {copy_gbs:.0f} GB/s; layer D {D}, H {H}, r {R}; batch 1, one token")
print(f"{'dtype':8} {'K':>2} {'union':>6} {'MB read':>8} {'dense ms':>9} {'split ms':>9} {'cols ms':>9} "
      f"{'split GB/s':>10} {'% copy':>7} {'vs dense':>8}")
rows = []
for dtype in (torch.float32, torch.float16):
    weights = layer(dtype)
    size = weights[0].element_size()
    x = torch.randn(1, D, device=device).to(dtype)
    for k in KS:
        starts = decode_starts(1, k, seed=100 + k)
        covered = torch.zeros(H, dtype=torch.bool, device=device)
        for s in starts[0].tolist():
            covered[s:s + R] = True
        union = int(covered.sum())
        # Rows of w_in and w_out, b_in of the union; x, b_out and y once.
        needed = (union * (2 * D + 1) + 3 * D) * size
        dense = bench_ms(lambda: continuous_slice_ffn(x, starts, *weights, R))
        split = bench_ms(lambda: kernel.continuous_slice_ffn_triton(x, starts, *weights, R, deterministic=False))
        cols = bench_ms(lambda: kernel.continuous_slice_ffn_triton(x, starts, *weights, R, deterministic=True))
        gbs = needed / split / 1e6
        row = dict(dtype=str(dtype)[6:], k=k, union=union, bytes=needed, dense_ms=dense, split_ms=split,
                   columns_ms=cols, split_gbs=gbs, columns_gbs=needed / cols / 1e6,
                   fraction_of_copy=gbs / copy_gbs, speedup_vs_dense=dense / split)
        rows.append(row)
        print(f"{row['dtype']:8} {k:>2} {union:>6} {needed / 1e6:>8.2f} {dense:>9.4f} {split:>9.4f} {cols:>9.4f} "
              f"{gbs:>10.0f} {100 * gbs / copy_gbs:>6.1f}% {dense / split:>7.2f}x")

target_met = all(r["fraction_of_copy"] >= 0.70 for r in rows)
print(f"\ntarget >= 70% of copy bandwidth (split mode, every K and dtype): {'met' if target_met else 'NOT met'}")
print("JSON " + json.dumps({"gpu": gpu, "copy_gbs": copy_gbs, "layer": {"D": D, "H": H, "r": R}, "rows": rows,
                            "target_met": target_met, "check_failures": failures}))
sys.exit(1 if failures else 0)
