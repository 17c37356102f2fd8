"""Fuzz infmoe::ContinuousSliceFFN, infmoe::QContinuousSliceFFN, infmoe::QMatMul,
infmoe::DecoderAttention, infmoe::WindowStarts, infmoe::StepInputs and infmoe::SkipLayerNorm
through onnxruntime, meant for the AddressSanitizer + UBSan build.

Random shapes (zero-size and prefill-size token counts included), dtypes, thread counts and
windows: 30% of the cases for each expert op, 15% for QMatMul and 13% for DecoderAttention (half
of the quantized ops' cases with int8 activations; a quarter of the quantized expert op's D whole
32-column groups, its integer path) (caches
of up to 300 positions, rows of different lengths, past absent; invalid: a dimension changed,
seqlens_k out of range, total_sequence_length 0, a wrong element type), 4% WindowStarts (eps
shared or per token; invalid: a dimension changed, slice_width outside [1, H], a wrong element
type), 4% StepInputs (masks of any int64 values; invalid: ranks, batches, a sequence longer than
the mask), 4% SkipLayerNorm (with and without bias; invalid: a dimension changed, D = 0, a
negative epsilon, a wrong element type); about a third are invalid (starts
out of range, a mismatched or missing dimension, slice_width > H; for the quantized ops also bits
and block sizes outside SPEC §6, and packed weights, scales or biases of the wrong element type;
for QMatMul a K or N attribute that disagrees with the tensors). A valid case must match the
PyTorch reference (for the quantized ops the level-1 reference, random packed bytes included),
an invalid one must raise an onnxruntime error; anything else, or any sanitizer report, is a
finding.

    plugins/onnxruntime/tools/build.sh --asan
    LD_PRELOAD="$(c++ -print-file-name=libasan.so) $(c++ -print-file-name=libstdc++.so)" \\
      ASAN_OPTIONS=detect_leaks=0 INFMOE_ORT_LIBRARY=plugins/onnxruntime/build-asan/libinfmoe_ort.so \\
      .venv/bin/python plugins/onnxruntime/tools/fuzz.py --cases 20000

(docs/design/kernel.md says why libstdc++ is preloaded too.)
"""

import argparse
import sys

import numpy as np
import onnxruntime as ort
import torch
from onnx import helper

from infmoe_export.model import continuous_slice_ffn
from infmoe_export.export.function import (attention_model, op_model, qmatmul_model, skip_layer_norm_model,
                                          step_inputs_model, window_starts_model)
from infmoe_export.export.ort_target import (decoder_attention, skip_layer_norm_reference, step_inputs_reference,
                                             window_starts_reference)
from infmoe_export.quant import int8_activations, n_blocks, packed_columns, q_continuous_slice_ffn, q_matmul
from infmoe_export.runtimes import ort_kernel

NAMES = ("X", "starts", "w_in", "b_in", "w_out", "b_out")
Q_NAMES = ("X", "starts", "w_in_q", "w_in_scale", "b_in", "w_out_q", "w_out_scale", "b_out")
SLICE_WIDTHS = (1, 2, 3, 5, 8, 13, 31, 64, 100, 257)
BLOCK_SIZES = (16, 32, 64, 128, 256)
BAD_BITS, BAD_BLOCK_SIZES = (3, 0, 5, 16, -8), (24, 8, 0, -16, 48, 1)


def common_problem(feeds, r, w_in, expected_w_in, matrices):
    """The rules both ops share: X, starts and the biases against H and D, slice_width, starts."""
    x, starts = feeds["X"].shape, feeds["starts"].shape
    if not x or len(starts) != len(x) or starts[:-1] != x[:-1] or starts[-1] < 1:
        return "shape"
    h = w_in[0] if len(w_in) == 2 else -1
    if w_in != expected_w_in(h, x[-1]) or feeds["b_in"].shape != (h,) or feeds["b_out"].shape != x[-1:] \
            or any(feeds[name].shape != shape(h, x[-1]) for name, shape in matrices):
        return "shape"
    if r > h:
        return "slice_width"
    if feeds["starts"].size and (feeds["starts"].min() < 0 or feeds["starts"].max() > h - r):
        return "start"
    return None


def problem_of(feeds, r, bits=None, block=None):
    """Why the op must refuse these inputs (SPEC §4, §6), or None when they are valid."""
    if bits is None:
        same = lambda h, d: (h, d)  # noqa: E731
        return common_problem(feeds, r, feeds["w_in"].shape, same, [("w_out", same)])
    if bits not in (4, 8) or block < 16 or block & (block - 1):
        return "attribute"
    if feeds["w_in_q"].dtype != np.uint8 or feeds["w_out_q"].dtype != np.uint8 or any(
            feeds[n].dtype != feeds["X"].dtype for n in ("w_in_scale", "b_in", "w_out_scale", "b_out")):
        return "type"
    packed = lambda h, d: (h, packed_columns(d, bits))  # noqa: E731
    scales = lambda h, d: (h, n_blocks(d, block))  # noqa: E731
    return common_problem(feeds, r, feeds["w_in_q"].shape, packed,
                          [("w_out_q", packed), ("w_in_scale", scales), ("w_out_scale", scales)])


def changed_shape(rng, shape) -> list:
    """shape with one dimension changed, dropped or added: the bad-shape cases."""
    shape = list(shape)
    if shape and rng.random() < 0.7:
        axis = int(rng.integers(len(shape)))
        shape[axis] = max(0, shape[axis] + int(rng.choice([-1, 1, 2])))
        return shape
    return shape[:-1] if shape and rng.random() < 0.5 else shape + [1]


def random_case(rng, quantized):
    """(feeds, r, dtype, bits, block, problem); bits and block are None for the float op."""
    lead = tuple(int(n) for n in rng.integers(0, 5, size=rng.integers(0, 3)))
    if rng.random() < 0.1:
        lead = (int(rng.integers(100, 300)),)  # the prefill path, several groups
    # A few slice widths, so that sessions (one per width) are reused; sometimes r = H.
    r = int(rng.choice(SLICE_WIDTHS))
    # Mostly short rows; a fifth up to 400 columns: several 64-byte groups of a quantized row
    # (the AVX-512 int4 decode reads rows in groups of 128 columns).
    d = int(rng.integers(1, 80)) if rng.random() < 0.8 else int(rng.integers(80, 400))
    if quantized and rng.random() < 0.25:
        d = 32 * max(1, d // 32)
    h = r if rng.random() < 0.15 else r + int(rng.integers(0, 200))
    k = int(rng.integers(1, 10))
    dtype = np.float16 if rng.random() < 0.2 else np.float32
    feeds = {
        "X": rng.standard_normal(lead + (d,)).astype(dtype),
        "starts": rng.integers(0, h - r + 1, size=lead + (k,)).astype(np.int64),
        "b_in": rng.standard_normal(h).astype(dtype),
        "b_out": rng.standard_normal(d).astype(dtype),
    }
    bits = block = None
    if quantized:
        bits, block = int(rng.choice([4, 8])), int(rng.choice(BLOCK_SIZES))
        for name, rows in (("w_in", d), ("w_out", h)):
            # Any byte is a valid weight (the pad nibble of an odd D included: it must not matter).
            feeds[name + "_q"] = rng.integers(0, 256, size=(h, packed_columns(d, bits)), dtype=np.uint8)
            feeds[name + "_scale"] = (rng.random((h, n_blocks(d, block))) * 0.02 / np.sqrt(rows)).astype(dtype)
    else:
        feeds["w_in"] = (rng.standard_normal((h, d)) / np.sqrt(d)).astype(dtype)
        feeds["w_out"] = (rng.standard_normal((h, d)) / np.sqrt(h)).astype(dtype)
    names = Q_NAMES if quantized else NAMES
    feeds = {n: feeds[n] for n in names}
    roll = rng.random()
    if roll < 0.10 and feeds["starts"].size:
        bad = rng.choice([-1, h - r + 1, int(rng.integers(-2 ** 62, 2 ** 62))])
        feeds["starts"].reshape(-1)[rng.integers(feeds["starts"].size)] = bad
    elif roll < 0.25:  # one input gets a dimension changed, dropped or added
        name = names[rng.integers(len(names))]
        shape = changed_shape(rng, feeds[name].shape)
        kind = feeds[name].dtype
        feeds[name] = np.full(shape, 0 if kind == np.int64 else 128, kind) if kind.kind in "iu" \
            else rng.standard_normal(shape).astype(kind)
    elif roll < 0.28:
        r = h + int(rng.integers(1, 4))
    elif quantized and roll < 0.31:
        bits = int(rng.choice(BAD_BITS))
    elif quantized and roll < 0.34:
        block = int(rng.choice(BAD_BLOCK_SIZES))
    elif quantized and roll < 0.37:  # a scale or bias of the other float type, or signed packed weights
        name = str(rng.choice(["w_in_scale", "w_out_scale", "b_in", "b_out", "w_in_q", "w_out_q"]))
        other = np.int8 if name.endswith("_q") else np.float32 if dtype == np.float16 else np.float16
        feeds[name] = feeds[name].astype(other)
    return feeds, r, dtype, bits, block, problem_of(feeds, r, bits, block)


def random_matmul_case(rng):
    """(feeds, attributes K, N, bits, block_size, dtype, problem) of QMatMul: MatMulNBits'
    storage [N, ceil(K / B), B bits / 8] of random bytes (the pad values of a partial block too)."""
    lead = tuple(int(n) for n in rng.integers(0, 4, size=rng.integers(1, 3)))
    if rng.random() < 0.1:
        lead = (int(rng.integers(4, 200)),)  # the prefill path
    k = int(rng.integers(1, 80)) if rng.random() < 0.7 else int(rng.integers(80, 400))
    n = int(rng.integers(1, 300))
    bits, block = int(rng.choice([4, 8])), int(rng.choice(BLOCK_SIZES))
    dtype = np.float16 if rng.random() < 0.2 else np.float32
    feeds = {"A": rng.standard_normal(lead + (k,)).astype(dtype),
             "B": rng.integers(0, 256, size=(n, n_blocks(k, block), block * bits // 8), dtype=np.uint8),
             "scales": (rng.random((n, n_blocks(k, block))) * 0.02 / np.sqrt(k)).astype(dtype)}
    attributes = dict(K=k, N=n, bits=bits, block_size=block)
    roll = rng.random()
    if roll < 0.15:  # one input gets a dimension changed, dropped or added
        name = str(rng.choice(list(feeds)))
        shape = changed_shape(rng, feeds[name].shape)
        kind = feeds[name].dtype
        feeds[name] = np.full(shape, 136, kind) if kind == np.uint8 else rng.standard_normal(shape).astype(kind)
    elif roll < 0.2:
        attributes[str(rng.choice(["K", "N"]))] += int(rng.choice([-1, 1, 64]))
    elif roll < 0.25:
        attributes["bits"] = int(rng.choice(BAD_BITS))
    elif roll < 0.3:
        attributes["block_size"] = int(rng.choice(BAD_BLOCK_SIZES))
    elif roll < 0.33:
        feeds["scales"] = feeds["scales"].astype(np.float32 if dtype == np.float16 else np.float16)
    elif roll < 0.35:
        feeds["B"] = feeds["B"].astype(np.int8)
    return feeds, attributes, dtype, matmul_problem(feeds, **attributes)


def matmul_problem(feeds, K, N, bits, block_size):
    """Why QMatMul must refuse these inputs, or None."""
    if bits not in (4, 8) or block_size < 16 or block_size & (block_size - 1) or K < 1 or N < 1:
        return "attribute"
    if feeds["B"].dtype != np.uint8 or feeds["scales"].dtype != feeds["A"].dtype:
        return "type"
    blocks = n_blocks(K, block_size)
    if not feeds["A"].shape or feeds["A"].shape[-1] != K or feeds["B"].shape != (N, blocks, block_size * bits // 8) \
            or feeds["scales"].shape != (N, blocks):
        return "shape"
    return None


def random_attention_case(rng):
    """(feeds, num_heads, problem) of DecoderAttention; feeds without past_* when there is none,
    the cache in float16 a third of the time there is one, with qkv_bias half the time."""
    batch, heads, dim = int(rng.integers(0, 4)), int(rng.integers(1, 7)), int(rng.integers(1, 41))
    sequence = int(rng.integers(0, 5)) if rng.random() < 0.8 else int(rng.integers(5, 150))
    past = int(rng.integers(0, 300)) if rng.random() < 0.8 else 0
    lengths = rng.integers(0, past + 1, size=batch) + sequence
    total = max(min(int(max(lengths, default=0) + rng.integers(0, 3)), past + sequence), 1)
    bias = rng.standard_normal((int(rng.choice([1, batch])) if batch else 1, 1, sequence, total))
    bias[rng.random(bias.shape) < 0.1] = np.finfo(np.float32).min
    feeds = {"qkv": rng.standard_normal((batch, sequence, 3 * heads * dim)).astype(np.float32),
             "past_key": rng.standard_normal((batch, heads, past, dim)).astype(np.float32),
             "past_value": rng.standard_normal((batch, heads, past, dim)).astype(np.float32),
             "seqlens_k": (lengths - 1).astype(np.int32),
             "total_sequence_length": np.array([total], np.int32),
             "attention_bias": bias.astype(np.float32)}
    if past == 0 and rng.random() < 0.5:
        del feeds["past_key"], feeds["past_value"]
    elif rng.random() < 1 / 3:
        feeds["past_key"], feeds["past_value"] = (feeds[n].astype(np.float16) for n in ("past_key", "past_value"))
    if rng.random() < 0.5:
        feeds["qkv_bias"] = rng.standard_normal(3 * heads * dim).astype(np.float32)
    roll = rng.random()
    if roll < 0.15:  # one input gets a dimension changed, dropped or added
        name = str(rng.choice(list(feeds)))
        shape = changed_shape(rng, feeds[name].shape)
        feeds[name] = (rng.integers(0, total + 1, size=shape) if name in ("seqlens_k", "total_sequence_length")
                       else rng.standard_normal(shape)).astype(feeds[name].dtype)
    elif roll < 0.22 and batch:
        feeds["seqlens_k"][int(rng.integers(batch))] += int(rng.choice([-sequence - 1, past + 1, 1000, -(2 ** 31) + 1]))
    elif roll < 0.25:
        feeds["total_sequence_length"][0] = int(rng.choice([0, -5, past + sequence + 1, 2 ** 31 - 1]))
    elif roll < 0.28:
        name = str(rng.choice(list(feeds)))
        feeds[name] = feeds[name].astype(np.int64 if feeds[name].dtype == np.int32 else np.float64)
    return feeds, heads, attention_problem(feeds, heads)


def attention_problem(feeds, heads):
    """Why DecoderAttention must refuse these inputs, or None."""
    cache = feeds["past_key"].dtype if "past_key" in feeds else np.float32  # float32 or float16, past and present
    expected = {"seqlens_k": np.int32, "total_sequence_length": np.int32, "past_key": cache, "past_value": cache}
    if cache not in (np.float32, np.float16) or any(v.dtype != expected.get(n, np.float32) for n, v in feeds.items()):
        return "type"
    qkv, total = feeds["qkv"].shape, feeds["total_sequence_length"]
    if len(qkv) != 3 or qkv[2] == 0 or qkv[2] % (3 * heads) or total.shape not in ((), (1,)) or total.size != 1:
        return "shape"
    batch, sequence, dim = qkv[0], qkv[1], qkv[2] // (3 * heads)
    past = feeds["past_key"].shape[2] if "past_key" in feeds and feeds["past_key"].ndim == 4 else 0
    if "past_key" in feeds and (feeds["past_key"].shape != (batch, heads, past, dim)
                                or feeds["past_value"].shape != (batch, heads, past, dim)):
        return "shape"
    if feeds["seqlens_k"].shape != (batch,) or feeds.get("qkv_bias", np.zeros(qkv[2])).shape != (qkv[2],):
        return "shape"
    total = int(total.reshape(-1)[0])
    if not 1 <= total <= past + sequence:
        return "total"
    bias = feeds["attention_bias"].shape
    if len(bias) != 4 or bias[0] not in (1, batch) or bias[1:] != (1, sequence, total):
        return "shape"
    lengths = feeds["seqlens_k"].astype(np.int64) + 1
    if ((lengths - sequence < 0) | (lengths - sequence > past) | (lengths > total)).any():
        return "seqlens"
    return None


def random_router_case(rng):
    """(feeds, H, r, problem) of WindowStarts."""
    lead = tuple(int(n) for n in rng.integers(0, 4, size=rng.integers(1, 3)))
    if rng.random() < 0.1:
        lead = (int(rng.integers(4, 200)),)
    d, k = int(rng.integers(1, 300)), int(rng.integers(1, 9))
    h = int(rng.integers(1, 4000))
    r = int(rng.integers(1, h + 1))
    feeds = {"X": rng.standard_normal(lead + (d,)).astype(np.float32),
             "weight": (rng.standard_normal((d, 2)) * 3 / np.sqrt(d)).astype(np.float32),
             "bias": rng.standard_normal(2).astype(np.float32),
             "eps": rng.standard_normal(lead + (k,) if rng.random() < 0.5 else (k,)).astype(np.float32)}
    roll = rng.random()
    if roll < 0.15:  # one input gets a dimension changed, dropped or added
        name = str(rng.choice(list(feeds)))
        feeds[name] = rng.standard_normal(changed_shape(rng, feeds[name].shape)).astype(np.float32)
    elif roll < 0.2:
        r = int(rng.choice([0, -3, h + 1]))
    elif roll < 0.23:
        name = str(rng.choice(["weight", "bias", "eps"]))
        feeds[name] = feeds[name].astype(np.float64)
    return feeds, h, r, router_problem(feeds, h, r)


def router_problem(feeds, h, r):
    """Why WindowStarts must refuse these inputs, or None."""
    if not 1 <= r <= h:
        return "attribute"
    if any(v.dtype != np.float32 for v in feeds.values()):
        return "type"
    x, eps = feeds["X"].shape, feeds["eps"].shape
    if not x or feeds["weight"].shape != (x[-1], 2) or feeds["bias"].shape != (2,):
        return "shape"
    if not (len(eps) == 1 or (eps and eps[:-1] == x[:-1])) or eps[-1] < 1:
        return "shape"
    return None


def random_step_case(rng):
    """(feeds, problem) of StepInputs."""
    batch, total = int(rng.integers(0, 4)), int(rng.integers(0, 400))
    sequence = int(rng.integers(0, total + 1)) if rng.random() < 0.9 else total + int(rng.integers(1, 4))
    mask = rng.integers(0, 2, size=(batch, total)) if rng.random() < 0.7 else rng.integers(-2 ** 62, 2 ** 62, size=(batch, total))
    feeds = {"input_ids": rng.integers(0, 256, size=(batch, sequence)), "attention_mask": mask.astype(np.int64)}
    if rng.random() < 0.1:  # one input gets a dimension changed, dropped or added
        name = str(rng.choice(list(feeds)))
        feeds[name] = rng.integers(0, 2, size=changed_shape(rng, feeds[name].shape)).astype(np.int64)
    ids, mask = feeds["input_ids"].shape, feeds["attention_mask"].shape
    ok = len(ids) == 2 and len(mask) == 2 and mask[0] == ids[0] and mask[1] >= max(ids[1], 1)
    return feeds, None if ok else "shape"


def random_norm_case(rng):
    """(feeds, epsilon, problem) of SkipLayerNorm."""
    lead = tuple(int(n) for n in rng.integers(0, 4, size=rng.integers(0, 3)))
    if rng.random() < 0.1:
        lead = (1, int(rng.integers(4, 600)))
    d = int(rng.integers(1, 1000))
    feeds = {name: rng.standard_normal(lead + (d,)).astype(np.float32) for name in ("input", "skip")}
    feeds.update({name: rng.standard_normal(d).astype(np.float32) for name in ("gamma", "beta", "bias")})
    if rng.random() < 0.3:
        del feeds["bias"]
    epsilon = 1e-5
    roll = rng.random()
    if roll < 0.15:  # one input gets a dimension changed, dropped or added
        name = str(rng.choice(list(feeds)))
        feeds[name] = rng.standard_normal(changed_shape(rng, feeds[name].shape)).astype(np.float32)
    elif roll < 0.2:
        epsilon = -float(rng.random())
    elif roll < 0.23:
        name = str(rng.choice(list(feeds)[1:]))
        feeds[name] = feeds[name].astype(np.float64)
    x = feeds["input"].shape
    if epsilon < 0:
        problem = "attribute"
    elif any(v.dtype != np.float32 for v in feeds.values()):
        problem = "type"
    elif not x or x[-1] < 1 or feeds["skip"].shape != x or any(
            feeds[n].shape != (x[-1],) for n in ("gamma", "beta", "bias") if n in feeds):
        problem = "shape"
    else:
        problem = None
    return feeds, epsilon, problem


def reference(feeds, r, bits, block, activations="float"):
    tensors = [torch.from_numpy(v) for v in feeds.values()]
    tensors = [t.float() if t.is_floating_point() else t for t in tensors]
    if activations == "int8" and block % 32 == 0:  # 16-column blocks: float
        tensors[0] = int8_activations(tensors[0])
    if bits is None:
        return continuous_slice_ffn(*tensors, r).numpy()
    return q_continuous_slice_ffn(*tensors, r, bits, block).numpy()


def main():
    parser = argparse.ArgumentParser(description="Fuzz the ContinuousSliceFFN, QContinuousSliceFFN, QMatMul, "
                                                 "DecoderAttention, WindowStarts, StepInputs and SkipLayerNorm kernels.")
    parser.add_argument("--cases", type=int, default=20000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(f"fuzz: library {ort_kernel.custom_op_library()}")

    sessions = {}

    def session(feeds, key, make_model, threads, activations="float"):
        """The session of the model make_model() builds, cached by key (its attributes), the
        feeds' types, the thread count and the quantized ops' activations."""
        key = (*key, tuple(str(v.dtype) for v in feeds.values()), threads, activations)
        if key not in sessions:
            options = ort.SessionOptions()
            options.intra_op_num_threads = threads
            options.log_severity_level = 4  # the refused cases would each log an error line
            if not ort_kernel.register(options, activations=activations):
                sys.exit("fuzz: the kernel library is not built")
            model = make_model()
            for value_info in model.graph.input:  # the wrong-type cases declare their types
                value_info.type.tensor_type.elem_type = helper.np_dtype_to_tensor_dtype(feeds[value_info.name].dtype)
            # Bad attributes fail here, at kernel creation: nothing is cached then.
            sessions[key] = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
        return sessions[key]

    rng = np.random.default_rng(args.seed)
    findings, counts = [], {}
    for case in range(args.cases):
        roll = rng.random()
        kind = ("float" if roll < 0.3 else "quantized" if roll < 0.6 else "matmul" if roll < 0.75 else
                "attention" if roll < 0.88 else "router" if roll < 0.92 else "steps" if roll < 0.96 else "norm")
        if kind == "norm":
            feeds, epsilon, problem = random_norm_case(rng)
            dtype, key = np.float32, ("norm", epsilon, "bias" in feeds)
            make_model = lambda: skip_layer_norm_model(epsilon, bias="bias" in feeds)  # noqa: E731
        elif kind == "steps":
            feeds, problem = random_step_case(rng)
            dtype, key = np.int64, ("steps",)
            make_model = step_inputs_model
        elif kind == "router":
            feeds, h, r, problem = random_router_case(rng)
            dtype, key = np.float32, ("router", h, r)
            make_model = lambda: window_starts_model(h, r)  # noqa: E731
        elif kind == "attention":
            feeds, heads, problem = random_attention_case(rng)
            cache = "float16" if "past_key" in feeds and feeds["past_key"].dtype == np.float16 else "float32"
            dtype, key = np.float32, ("attention", heads, "past_key" in feeds, "qkv_bias" in feeds, cache)
            make_model = lambda: attention_model(heads, past="past_key" in feeds, qkv_bias="qkv_bias" in feeds,  # noqa: E731
                                                 kv_cache=cache)
        elif kind == "matmul":
            feeds, attributes, dtype, problem = random_matmul_case(rng)
            key = tuple(attributes.values())
            make_model = lambda: qmatmul_model(*key, dtype="float16" if dtype == np.float16 else "float32")  # noqa: E731
        else:
            feeds, r, dtype, bits, block, problem = random_case(rng, kind == "quantized")
            key = (r, str(np.dtype(dtype)), bits, block)
            make_model = lambda: op_model(r, "float16" if dtype == np.float16 else "float32", bits=bits,  # noqa: E731
                                          **({} if block is None else dict(block_size=block)))
        threads = int(rng.integers(1, 3))
        activations = "int8" if kind in ("matmul", "quantized") and rng.random() < 0.5 else "float"
        try:
            outputs = session(feeds, key, make_model, threads, activations).run(None, feeds)
            y, error = outputs[0], None
        except Exception as exc:  # onnxruntime's error types
            y, error = None, str(exc).splitlines()[0]
        label = f"{kind}{' int8' if activations == 'int8' else ''} {problem or 'valid'}"
        counts[label] = counts.get(label, 0) + 1
        if problem is not None:
            if error is None:
                findings.append(f"case {case}: invalid ({label}) but no error")
            continue
        if error is not None:
            findings.append(f"case {case}: valid ({label}) but raised: {error}")
            continue
        if kind == "norm":
            expected, total = skip_layer_norm_reference(*feeds.values(), epsilon=epsilon)
            scale = float(np.abs(feeds["gamma"]).max() + np.abs(feeds["beta"]).max())
            if y.shape != expected.shape or not np.array_equal(outputs[1], total) or (
                    y.size and np.abs(y - expected).max() > 2e-5 * scale):  # as tests/test_ort_skip_layer_norm.py
                findings.append(f"case {case}: wrong norm ({label}, shape {y.shape} vs {expected.shape})")
            continue
        if kind == "steps":
            if any(not np.array_equal(o, e) for o, e in zip(outputs, step_inputs_reference(**feeds))):
                findings.append(f"case {case}: wrong step inputs ({label})")
            continue
        if kind == "router":
            expected, value = window_starts_reference(*feeds.values(), h, r)
            near = np.abs(value - np.round(value)) < 1e-4 + 2e-6 * (h - r + 1)  # as tests/test_ort_window_starts.py
            if y.shape != expected.shape or (np.abs(y - expected) > near).any():
                findings.append(f"case {case}: wrong starts ({label}, shape {y.shape} vs {expected.shape})")
            continue
        if kind == "attention":
            expected = decoder_attention(*(feeds.get(n) for n in ("qkv", "past_key", "past_value", "seqlens_k",
                                                                   "total_sequence_length", "attention_bias")), heads,
                                         feeds.get("qkv_bias"))
            y, ref = np.concatenate([o.reshape(-1) for o in outputs]), np.concatenate([e.reshape(-1) for e in expected])
        elif kind == "matmul":
            tensors = {name: torch.from_numpy(value) for name, value in feeds.items()}
            a = tensors["A"].double()
            if activations == "int8" and attributes["block_size"] % 32 == 0:  # 16-column blocks: float
                a = int8_activations(a).double()
            ref = q_matmul(a, tensors["B"], tensors["scales"].double(), attributes["bits"], attributes["block_size"]).numpy()
        else:
            ref = reference(feeds, r, bits, block, activations)
        scale = max(float(np.abs(ref).max()), 1.0) if ref.size else 1.0
        tolerance = 2e-3 if dtype == np.float16 else 1e-5
        if y.shape != ref.shape or (ref.size and np.abs(y.astype(np.float64) - ref).max() > tolerance * scale):
            findings.append(f"case {case}: wrong result ({label}, shape {y.shape} vs {ref.shape})")
    print(f"fuzz: {args.cases} cases ({dict(sorted(counts.items()))}), {len(sessions)} sessions, "
          f"{len(findings)} findings")
    for line in findings[:20]:
        print("  " + line)
    sys.exit(1 if findings else 0)


if __name__ == "__main__":
    main()
