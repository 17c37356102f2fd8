"""Write reference cases for the C++ test driver (driver.cc): every CPU computation of the kernel
(src/continuous_slice_ffn.h) on fresh random data (a new seed per run unless --seed is given),
with the expected results from the Python references the Python tests use.

    python plugins/onnxruntime/tests/write_reference.py OUT.bin [--seed N]

Kinds of case (the driver's tolerances are the Python tests'):
  ffn      ContinuousSliceFFN, fp32 and fp16, against the PyTorch op `model.continuous_slice_ffn`:
           odd shapes, K = 1 and K > 1, overlapping and disjoint windows, starts at 0 and at
           H - r, r = 1 and r = H, decode (1-3 tokens) and prefill (several 128-token groups,
           several 512-unit blocks), no tokens (tests/test_ort_kernel.py)
  refuse   invalid starts (-1, H - r + 1, 2^40, a bad one after good ones): CheckStarts must
           refuse them, naming the first bad index
  qffn     QContinuousSliceFFN, int8 and int4 x fp32 and fp16, against the level-1 reference
           `quant.q_continuous_slice_ffn` (the float op on w', from the inputs the kernel sees, in
           float32): odd D, D not a multiple of the block, blocks of 16, 32 and 64, the same
           window and token cases (tests/test_ort_qkernel.py)
  qmatmul  QMatMul, int8 and int4 x fp32 and fp16, against `quant.q_matmul` in float64: odd K and
           N, K below one block and not a multiple of it, decode and prefill
           (tests/test_ort_qmatmul.py)
  attn     DecoderAttention against `ort_target.decoder_attention` (float64): decode with a past,
           prefill without one and with one, batch 2 with different seqlens_k, a bias per row or
           one broadcast, present a separate buffer or past's own (tests/test_ort_attention.py)
  starts   WindowStarts against `ort_target.window_starts_reference` (float64): eps shared and
           per token, K = 1 and K > 1, r = 1 and r = H, decode and prefill; starts whose float64
           value lies within a hair of an integer may differ by one (tests/test_ort_window_starts.py)
  steps    StepInputs against `ort_target.step_inputs_reference`, exact: left-padded masks,
           decode and prefill, masks of other values than 0 and 1 (tests/test_ort_step_inputs.py)
  norm     SkipLayerNorm against `ort_target.skip_layer_norm_reference`: the sum exact, the output
           in float64; with and without bias, D of 1, odd and 768, one row and several work items,
           a row far from zero (tests/test_ort_skip_layer_norm.py)

Format (little-endian): b"INFMOE02", int64 case count; per case: 32-byte name, 8-byte kind, int64
count and the kind's sizes (`SIZES` below), int64 count and the arrays in the order of `ARRAYS`,
each as a 4-byte numpy type string ("<f4", "<f2" (IEEE half), "<f8", "<i8", "<i4", "|u1"), int64
element count and its elements. Expected results come last in each case.
"""

import argparse
import pathlib
import struct
import sys

import numpy as np
import torch

from infmoe_export.export.ort_target import (decoder_attention, skip_layer_norm_reference, step_inputs_reference,
                                             window_starts_reference)
from infmoe_export.model import continuous_slice_ffn
from infmoe_export.quant import QuantizedWeight, pack_blocks, q_continuous_slice_ffn, q_matmul, quantize

MAGIC = b"INFMOE02"
# The driver reads these in this order (documentation; write() takes them as given).
SIZES = {"ffn": "tokens d h k r", "refuse": "tokens d h k r bad_index", "qffn": "bits block tokens d h k r",
         "qmatmul": "bits block tokens k n", "attn": "batch sequence heads head_dim past total bias_rows shared qkv_bias",
         "starts": "tokens d k h r eps_per_token", "steps": "batch sequence total", "norm": "rows d bias"}
ARRAYS = {"ffn": "starts x w_in b_in w_out b_out | y y16 (fp16 inputs, computed in float32)",
          "refuse": "starts",
          "qffn": "starts x w_in_q w_in_scale b_in w_out_q w_out_scale b_out | y",
          "qmatmul": "a b scales | y",
          "attn": "qkv past_key past_value seqlens_k bias qkv_bias | y present_key present_value "
                  "(qkv_bias: read when the size says so; present: what the buffer must hold after the call)",
          "starts": "x weight bias eps | starts near (1: may differ by one)",
          "steps": "attention_mask | position_ids seqlens_k attention_bias",
          "norm": "input skip gamma beta bias (read when the size says so) | output (float64) sum"}


def normal(rng, *shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(np.float32)


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


# ---- ContinuousSliceFFN ----------------------------------------------------------------------

# name, tokens, d, h, r, k, windows
FFN = [
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


def ffn_tensors(rng, tokens, d, h):
    return dict(x=normal(rng, tokens, d), w_in=normal(rng, h, d, scale=d ** -0.5), b_in=normal(rng, h, scale=0.5),
                w_out=normal(rng, h, d, scale=h ** -0.5), b_out=normal(rng, d, scale=0.5))


def ffn_reference(t, starts, r):
    torch_t = {n: torch.from_numpy(v) for n, v in t.items()}
    with torch.inference_mode():
        return continuous_slice_ffn(torch_t["x"], torch.from_numpy(starts), torch_t["w_in"], torch_t["b_in"],
                                    torch_t["w_out"], torch_t["b_out"], r).numpy()


def ffn_cases(rng):
    for name, tokens, d, h, r, k, windows in FFN:
        starts = starts_for(rng, tokens, k, h, r, windows)
        t = ffn_tensors(rng, tokens, d, h)
        y16 = ffn_reference({n: v.astype(np.float16).astype(np.float32) for n, v in t.items()}, starts, r)
        yield name, "ffn", [tokens, d, h, k, r], [starts, *t.values(), ffn_reference(t, starts, r), y16]


def refusal_cases(rng):
    for name, value, where in (("minus_one", -1, 0), ("past_last", None, 3), ("huge", 2**40, 5)):
        tokens, d, h, r, k = 3, 5, 29, 7, 2
        starts = starts_for(rng, tokens, k, h, r, "random")
        starts.flat[where] = h - r + 1 if value is None else value
        yield name, "refuse", [tokens, d, h, k, r, where], [starts]
    tokens, d, h, r, k = 150, 4, 33, 33, 1  # prefill size, r = H: only 0 is valid
    starts = np.zeros((tokens, k), np.int64)
    starts[120, 0] = 1
    yield "r_eq_h_start1", "refuse", [tokens, d, h, k, r, 120], [starts]


# ---- QContinuousSliceFFN ---------------------------------------------------------------------

# name, tokens, d, h, r, k, windows, block: odd D (int4's pad nibble), D below, above and not a
# multiple of the block, r = 1 and r = H, decode (1-3 tokens) and prefill (2-3 groups of 128
# tokens, 2 hidden blocks of 512 units).
QFFN = [
    ("q_k1_last", 1, 13, 37, 5, 1, "edges", 16),
    ("q_r1_disjoint", 2, 29, 101, 1, 2, "disjoint", 16),
    ("q_r_eq_h", 3, 17, 41, 41, 3, "random", 32),
    ("q_start0", 2, 33, 50, 9, 2, "zero", 32),
    ("q_overlap_b64", 1, 70, 97, 11, 4, "overlapping", 64),
    ("q_long_rows", 2, 301, 131, 7, 2, "edges", 64),  # several 64-byte groups, a partial last
    ("q_prefill_r_eq_h", 150, 25, 67, 67, 3, "edges", 16),
    ("q_prefill_disjoint", 300, 37, 613, 100, 3, "disjoint", 32),
    ("q_prefill_k1", 131, 47, 157, 19, 1, "random", 64),
]
# bits x activation type: the name's suffix
QTYPES = [(8, np.float32, "i8_f32"), (4, np.float32, "i4_f32"), (8, np.float16, "i8_f16"), (4, np.float16, "i4_f16")]


def qffn_cases(rng):
    names = ("starts", "x", "w_in_q", "w_in_scale", "b_in", "w_out_q", "w_out_scale", "b_out")
    for name, tokens, d, h, r, k, windows, block in QFFN:
        for bits, dtype, suffix in QTYPES:
            w_in = QuantizedWeight.of(torch.from_numpy(normal(rng, h, d, scale=d ** -0.5)), bits, block)
            w_out = QuantizedWeight.of(torch.from_numpy(normal(rng, h, d, scale=h ** -0.5)), bits, block)
            feeds = dict(starts=starts_for(rng, tokens, k, h, r, windows), x=normal(rng, tokens, d).astype(dtype),
                         w_in_q=w_in.packed.numpy(), w_in_scale=w_in.scale.numpy().astype(dtype),
                         b_in=normal(rng, h, scale=0.5).astype(dtype), w_out_q=w_out.packed.numpy(),
                         w_out_scale=w_out.scale.numpy().astype(dtype), b_out=normal(rng, d, scale=0.1).astype(dtype))
            # Level 1, as tests/test_ort_qkernel.py: the reference on the inputs the kernel sees, in float32.
            t = {n: torch.from_numpy(v).float() if v.dtype.kind == "f" else torch.from_numpy(v) for n, v in feeds.items()}
            with torch.inference_mode():
                y = q_continuous_slice_ffn(t["x"], t["starts"], *(t[n] for n in names[2:]), r, bits, block).numpy()
            yield f"{name}_{suffix}", "qffn", [bits, block, tokens, d, h, k, r], [*(feeds[n] for n in names), y]


# ---- QMatMul ---------------------------------------------------------------------------------

# name, tokens, k, n, block: K odd, below one block, not a multiple of it; decode (1-3 tokens,
# items of rows) and prefill (4 tokens: the smallest; 150; both over several 48-row items).
QMATMUL = [
    ("mm_one_block", 1, 13, 37, 16),
    ("mm_odd", 2, 129, 101, 32),
    ("mm_decode_b64", 3, 300, 21, 64),
    ("mm_long_rows", 1, 601, 31, 16),
    ("mm_prefill4", 4, 37, 113, 16),
    ("mm_prefill", 150, 97, 213, 32),
]


def qmatmul_cases(rng):
    for name, tokens, k, n, block in QMATMUL:
        for bits, dtype, suffix in QTYPES:
            q, scale = quantize(torch.from_numpy(normal(rng, n, k, scale=k ** -0.5)), bits, block)
            a, b, scales = normal(rng, tokens, k).astype(dtype), pack_blocks(q, bits, block).numpy(), scale.numpy().astype(dtype)
            y = q_matmul(torch.from_numpy(a).double(), torch.from_numpy(b), torch.from_numpy(scales).double(), bits, block)
            yield f"{name}_{suffix}", "qmatmul", [bits, block, tokens, k, n], [a, b, scales, y.numpy()]


# ---- DecoderAttention ------------------------------------------------------------------------

MASKED = np.finfo(np.float32).min

# name, batch, sequence, past, heads, head_dim, shorter, bias rows, shared, qkv bias. Row b's cache
# holds P - (shorter if b is odd) positions, then the sequence's: P = past with a separate present;
# with present = past's own buffer (past positions), P = past - sequence - 3, so that every row
# leaves positions the op must not touch.
ATTENTION = [
    ("attn_decode_past", 2, 1, 300, 4, 32, 37, 2, False, True),  # enough work for the thread pool
    ("attn_decode3_odd", 2, 3, 9, 2, 13, 4, 1, False, False),    # head_dim odd, bias broadcast
    ("attn_prefill", 2, 70, 0, 3, 16, 0, 2, False, False),       # no past, two blocks of 64 queries
    ("attn_prefill_past", 2, 65, 40, 2, 8, 15, 2, False, True),
    ("attn_shared_decode", 2, 1, 400, 4, 32, 7, 2, True, False),
    ("attn_shared_prefill", 2, 80, 100, 3, 16, 7, 1, True, True),
    # heads narrower than a register (several keys a register where the variant allows it)
    ("attn_packed8_shared", 2, 1, 150, 12, 8, 21, 2, True, True),
    ("attn_packed4_decode2", 1, 2, 61, 3, 4, 0, 1, False, False),
    ("attn_packed2_decode", 2, 1, 40, 2, 2, 5, 2, False, True),
]


def attention_cases(rng):
    for name, batch, sequence, past, heads, dim, shorter, bias_rows, shared, with_qkv_bias in ATTENTION:
        first = past - sequence - 3 if shared else past
        lengths = np.array([first - (shorter if b % 2 else 0) for b in range(batch)]) + sequence
        total = int(lengths.max()) if shared else past + sequence
        bias = rng.standard_normal((bias_rows, 1, sequence, total)) * 0.5
        bias[rng.random(bias.shape) < 0.1] = MASKED  # about one key in ten masked, as left padding is
        feeds = [normal(rng, batch, sequence, 3 * heads * dim), normal(rng, batch, heads, past, dim),
                 normal(rng, batch, heads, past, dim), (lengths - 1).astype(np.int32), bias.astype(np.float32),
                 normal(rng, 3 * heads * dim)]
        y, key, value = decoder_attention(feeds[0], feeds[1] if past else None, feeds[2], feeds[3],
                                          np.array([total], np.int32), feeds[4], heads,
                                          feeds[5] if with_qkv_bias else None)
        if shared:  # the new positions written; everything after a row's length as it was
            written = np.arange(past)[None, None, :, None] < lengths[:, None, None, None]
            key, value = np.where(written, key, feeds[1]), np.where(written, value, feeds[2])
        yield name, "attn", [batch, sequence, heads, dim, past, total, bias_rows, int(shared), int(with_qkv_bias)], \
            [*feeds, y, key.astype(np.float32), value.astype(np.float32)]


# ---- WindowStarts ----------------------------------------------------------------------------

# name, tokens, d, k, h, r, eps per token: D below 8 and odd, K 1 and many, r = 1 and r = H, one
# token and several work items of 64 tokens.
WINDOW_STARTS = [
    ("ws_k1_r1", 1, 5, 1, 37, 1, False),
    ("ws_k2", 3, 97, 2, 3072, 384, False),
    ("ws_per_token", 6, 97, 8, 200, 13, True),
    ("ws_prefill_r_eq_h", 150, 64, 4, 50, 50, False),
    ("ws_prefill_per_token", 300, 13, 3, 1000, 99, True),
    ("ws_r_h_minus_1", 2, 13, 3, 1000, 999, True),
    ("ws_d1", 4, 1, 5, 9, 2, False),
]


def window_starts_cases(rng):
    for name, tokens, d, k, h, r, per_token in WINDOW_STARTS:
        feeds = [normal(rng, tokens, d), normal(rng, d, 2, scale=3.0 / np.sqrt(d)), normal(rng, 2),
                 normal(rng, *((tokens, k) if per_token else (k,)))]
        starts, value = window_starts_reference(*feeds, h, r)
        # tests/test_ort_window_starts.py's rule: within float32's reach of an integer (z's rounding
        # ~1e-6 times sigmoid's slope <= 1/4 times H - r + 1, with a wide margin), one either way.
        near = np.abs(value - np.round(value)) < 1e-4 + 2e-6 * (h - r + 1)
        yield name, "starts", [tokens, d, k, h, r, int(per_token)], [*feeds, starts, near.astype(np.uint8)]


# ---- StepInputs ------------------------------------------------------------------------------

# name, batch, sequence, total, mask values: left-padded 0 / 1 masks (decode and prefill), and
# masks of other values.
STEP_INPUTS = [
    ("steps_decode", 3, 1, 129, None),
    ("steps_prefill", 2, 37, 37, None),
    ("steps_past", 2, 5, 301, None),
    ("steps_other_values", 2, 3, 40, (0, 1, 2, -3)),
]


def step_inputs_cases(rng):
    for name, batch, sequence, total, values in STEP_INPUTS:
        if values is None:
            pads = rng.integers(0, total - sequence + 1, size=batch)
            mask = (np.arange(total)[None, :] >= pads[:, None]).astype(np.int64)
        else:
            mask = rng.choice(np.array(values, np.int64), size=(batch, total))
        positions, seqlens_k, _, bias = step_inputs_reference(np.zeros((batch, sequence)), mask)
        yield name, "steps", [batch, sequence, total], [mask, positions, seqlens_k, bias]


# ---- SkipLayerNorm ---------------------------------------------------------------------------

EPSILON = 1e-5
# name, rows, d, bias, offset of the input: D of 1, odd and GPT-2's, one row (decode) and several
# work items of 16 rows, a row far from zero.
SKIP_LAYER_NORM = [
    ("norm_decode", 1, 768, True, 0.0),
    ("norm_d1", 3, 1, True, 0.0),
    ("norm_odd_no_bias", 37, 97, False, 0.0),
    ("norm_far_from_zero", 40, 200, True, 1e3),
]


def skip_layer_norm_cases(rng):
    for name, rows, d, bias, offset in SKIP_LAYER_NORM:
        feeds = [normal(rng, rows, d) + np.float32(offset), normal(rng, rows, d), normal(rng, d), normal(rng, d),
                 normal(rng, d) if bias else np.zeros(0, np.float32)]
        output, total = skip_layer_norm_reference(*feeds[:4], feeds[4] if bias else None, epsilon=EPSILON)
        yield name, "norm", [rows, d, int(bias)], [*feeds, output, total]


KINDS = [ffn_cases, refusal_cases, qffn_cases, qmatmul_cases, attention_cases, window_starts_cases, step_inputs_cases,
         skip_layer_norm_cases]


def write(path: pathlib.Path, seed: int) -> int:
    """Write the cases to path; returns their count."""
    rng = np.random.default_rng(seed)
    records = [case for kind in KINDS for case in kind(rng)]
    with open(path, "wb") as out:
        out.write(MAGIC + struct.pack("<q", len(records)))
        for name, kind, sizes, arrays in records:
            assert len(name) < 32 and len(kind) < 8, (name, kind)
            out.write(name.encode().ljust(32, b"\0") + kind.encode().ljust(8, b"\0"))
            out.write(struct.pack(f"<q{len(sizes)}q", len(sizes), *sizes) + struct.pack("<q", len(arrays)))
            for array in arrays:
                array = np.ascontiguousarray(array, np.asarray(array).dtype.newbyteorder("<"))
                out.write(array.dtype.str.encode().ljust(4, b"\0") + struct.pack("<q", array.size) + array.tobytes())
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
