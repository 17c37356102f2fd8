"""Write reference cases for the C++ test driver (driver.cc), computed by the PyTorch reference
op `infmoe_export.model.continuous_slice_ffn`, from fresh random data (a new seed per run unless
--seed is given).

    python plugins/onnxruntime/tests/write_reference.py OUT.bin [--seed N]

Cases: odd shapes, K = 1 and K > 1, overlapping and disjoint windows, starts at 0 and at H - r,
r = 1 and r = H, decode (1-3 tokens) and prefill (several 128-token groups, several 512-unit
blocks), no tokens; and invalid starts (-1, H - r + 1, 2^40, a bad one after good ones) that the
kernel's check must refuse, naming the first bad index.

Format (little-endian): b"INFMOE01", int64 case count; per case: 32-byte name, int64 valid,
bad_index, tokens, d, h, k, r; int64 starts[tokens*k]; float32 x[tokens*d], w_in[h*d], b_in[h],
w_out[h*d], b_out[d]; valid cases then float32 y[tokens*d] (float32 inputs) and
y16[tokens*d] (inputs rounded to float16, computed in float32: what the fp16 path must give
before its final rounding).
"""

import argparse
import pathlib
import struct
import sys

import numpy as np
import torch

from infmoe_export.model import continuous_slice_ffn

MAGIC = b"INFMOE01"


def starts_for(rng, tokens, k, h, r, windows):
    last = h - r
    if windows == "overlapping":  # within r/2 of a common base
        base = rng.integers(0, last + 1, size=(tokens, 1))
        starts = np.clip(base + rng.integers(0, max(1, r // 2), size=(tokens, k)), 0, last)
    elif windows == "disjoint":  # k windows that do not touch, in a random order
        slack = h - k * r
        starts = np.sort(rng.integers(0, slack + 1, size=(tokens, k)), axis=-1) + np.arange(k) * r
        starts = rng.permuted(starts, axis=-1)
    elif windows == "zero":
        starts = np.zeros((tokens, k))
    else:
        starts = rng.integers(0, last + 1, size=(tokens, k))
        if windows == "edges":
            starts[:, 0] = 0
            starts[:, -1] = last
    return starts.astype(np.int64)


# name, tokens, d, h, r, k, windows
VALID = [
    ("k1_start0", 1, 7, 37, 5, 1, "zero"),
    ("k1_last", 2, 5, 41, 9, 1, "edges"),  # k = 1: "edges" puts the only window at H - r
    ("k3_overlap", 1, 13, 50, 9, 3, "overlapping"),
    ("k2_disjoint", 2, 11, 61, 17, 2, "disjoint"),
    ("k4_edges", 3, 9, 77, 12, 4, "edges"),
    ("k8_random", 3, 31, 129, 33, 8, "random"),
    ("r1_k5", 1, 3, 23, 1, 5, "random"),
    ("r_eq_h_k2", 2, 6, 19, 19, 2, "random"),
    ("decode_chunks", 1, 40, 300, 150, 2, "disjoint"),  # several 64-row chunks per window
    ("prefill_overlap", 37, 17, 203, 29, 3, "overlapping"),
    ("prefill_groups", 300, 19, 700, 300, 2, "edges"),  # 3 groups, 2 blocks of 512 units
    ("prefill_disjoint", 131, 23, 611, 101, 5, "disjoint"),
    ("prefill_k1", 140, 10, 257, 256, 1, "random"),
    ("no_tokens", 0, 8, 40, 8, 3, "random"),
]


def invalid_cases(rng):
    """(name, tokens, d, h, r, k, starts, first bad index)."""
    cases = []
    for name, value, where in (("minus_one", -1, 0), ("past_last", None, 3), ("huge", 2**40, 5)):
        tokens, d, h, r, k = 3, 5, 29, 7, 2
        starts = starts_for(rng, tokens, k, h, r, "random")
        starts.flat[where] = h - r + 1 if value is None else value
        cases.append((name, tokens, d, h, r, k, starts, where))
    tokens, d, h, r, k = 150, 4, 33, 33, 1  # prefill size, r = H: only 0 is valid
    starts = np.zeros((tokens, k), np.int64)
    starts[120, 0] = 1
    cases.append(("r_eq_h_start1", tokens, d, h, r, k, starts, 120))
    return cases


def tensors(rng, tokens, d, h):
    def normal(*shape, scale=1.0):
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    return dict(x=normal(tokens, d), w_in=normal(h, d, scale=d ** -0.5), b_in=normal(h, scale=0.5),
                w_out=normal(h, d, scale=h ** -0.5), b_out=normal(d, scale=0.5))


def reference(t, starts, r):
    torch_t = {n: torch.from_numpy(v) for n, v in t.items()}
    with torch.inference_mode():
        return continuous_slice_ffn(torch_t["x"], torch.from_numpy(starts), torch_t["w_in"], torch_t["b_in"],
                                    torch_t["w_out"], torch_t["b_out"], r).numpy()


def write(path: pathlib.Path, seed: int) -> int:
    """Write the cases to path; returns their count."""
    rng = np.random.default_rng(seed)
    records = []
    for name, tokens, d, h, r, k, windows in VALID:
        starts = starts_for(rng, tokens, k, h, r, windows)
        t = tensors(rng, tokens, d, h)
        y = reference(t, starts, r)
        y16 = reference({n: v.astype(np.float16).astype(np.float32) for n, v in t.items()}, starts, r)
        records.append((name, 1, -1, tokens, d, h, k, r, starts, t, [y, y16]))
    for name, tokens, d, h, r, k, starts, bad in invalid_cases(rng):
        records.append((name, 0, bad, tokens, d, h, k, r, starts, tensors(rng, tokens, d, h), []))
    with open(path, "wb") as out:
        out.write(MAGIC + struct.pack("<q", len(records)))
        for name, valid, bad, tokens, d, h, k, r, starts, t, outputs in records:
            out.write(name.encode().ljust(32, b"\0"))
            out.write(struct.pack("<7q", valid, bad, tokens, d, h, k, r))
            out.write(np.ascontiguousarray(starts, "<i8").tobytes())
            for array in [t["x"], t["w_in"], t["b_in"], t["w_out"], t["b_out"], *outputs]:
                out.write(np.ascontiguousarray(array, "<f4").tobytes())
    return len(records)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=pathlib.Path)
    parser.add_argument("--seed", type=int, help="default: a fresh random seed")
    args = parser.parse_args(argv)
    seed = args.seed if args.seed is not None else int(np.random.SeedSequence().entropy % 2**32)
    count = write(args.out, seed)
    print(f"write_reference: {count} cases, seed {seed} -> {args.out}")


if __name__ == "__main__":
    sys.exit(main())
