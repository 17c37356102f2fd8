"""The onnxruntime target (`infmoe-export onnx --target onnxruntime`): the same model traced
through onnxruntime's fused contrib ops instead of standard ones (docs/guide/export.md, The export choice).

A traced variant, not a rewrite of the portable graph: `OrtDecoder` runs the reference model's
own modules (embeddings, LayerNorm weights, the Linear layers, the routers and the exporter's
expert op, `window_starts` included) but writes each layer as

    qkv      = MatMul                                                 (one per layer)
    attn, present.i.key, present.i.value =
               infmoe::DecoderAttention(qkv packed, past.i.key, past.i.value,
                                        seqlens_k, total_sequence_length, attention_bias, qkv.bias)
               (the bias added inside: one node fewer a layer; an Add and com.microsoft
               GroupQueryAttention as its fallback function: the nodes onnxruntime runs without
               our kernel library; docs/design/kernel.md)
    ln_2, h  = com.microsoft SkipLayerNormalization(attn @ proj, x, ln_2, bias = proj.bias)
    starts   = infmoe::WindowStarts(ln_2, the router's mu and sigma as one [D, 2] matrix
               h.{i}.moe.router.weight, its [2] bias, eps): the router and SPEC §3's starts in one
               node; its fallback function is the ten standard ops (MatMul, Add, Split, Softplus,
               Mul, Add, Sigmoid, Mul, Clip, Cast)
    expert   = infmoe::ContinuousSliceFFN
    ln_1', x = SkipLayerNormalization(expert, h, next layer's ln_1 (ln_f after the last))

(a conventional MoE: its router's MatMul and one com.microsoft MoE / QMoE node, export/moe.py,
in place of WindowStarts and the expert op)

The attention appends the new keys and values to the cache itself: with past and present
bound to one buffer of n_positions (runtimes/ort.py `SharedCache`, onnxruntime-genai's
`past_present_share_buffer`) it writes them in place, and nothing is copied; with a past of
exactly past_sequence positions it returns a new present of past + sequence, like the portable
graph (Optimum, validation). Its causal mask is its own; left padding is an additive
attention_bias from attention_mask, and seqlens_k (= total - 1 for every row: the pads hold
positions in the cache) and total_sequence_length are computed in the graph from
attention_mask's length, as onnxruntime-genai's builder does, so a client feeds Optimum's
inputs only: all three, and the position ids, by one infmoe::StepInputs node per step (its
fallback function: the thirteen standard ops the target wrote before). The cache is float32, or
float16 with `--kv-cache float16` (DecoderIO.kv_cache): past and present are then float16, which
the attention reads as float32, and everything else stays float32.
"""

import numpy as np
import onnx_ir as ir
import torch
import torch.nn.functional as F
from torch import nn

from ..contract import DOMAIN, SEQLENS_K, TOTAL_SEQUENCE_LENGTH, DecoderIO
from ..errors import InfMoEError
from .function import ATTENTION_OP_TYPE, NORM_OP_TYPE, ROUTER_OP_TYPE, STEP_OP_TYPE

# onnxruntime's GroupQueryAttention kernels (the attention's fallback) refuse other head sizes at run time.
HEAD_DIM_MULTIPLE = 8


def fits_onnxruntime(config) -> bool:
    """Whether the onnxruntime target can be exported for this config."""
    return config.head_dim % HEAD_DIM_MULTIPLE == 0


def _skip_layer_norm(x, skip, norm: nn.LayerNorm, bias=None):
    """(LayerNorm(x + skip + bias), x + skip + bias): one infmoe::SkipLayerNorm node (its fallback
    function is onnxruntime's SkipLayerNormalization)."""
    inputs = (x, skip, norm.weight, norm.bias) + ((bias,) if bias is not None else ())
    out, total = torch.onnx.ops.symbolic_multi_out(
        f"{DOMAIN}::{NORM_OP_TYPE}", inputs, dict(epsilon=float(norm.eps)), dtypes=(x.dtype,) * 2,
        shapes=(x.shape, x.shape), version=1)
    return out, total


class _FusedRouter(nn.Module):
    """The router (model.Router) with mu and sigma in one [2, D] weight, written with its window
    starts as one infmoe::WindowStarts node (its fallback function computes ONNX's Softplus, which
    onnxruntime computes stably, x + log1p(exp(-x)) for x > 0: equal to torch's in float32)."""

    def __init__(self, router: nn.Module):
        super().__init__()
        self.weight = nn.Parameter(torch.cat([router.mu.weight, router.sigma.weight]).detach())
        self.bias = nn.Parameter(torch.cat([router.mu.bias, router.sigma.bias]).detach())

    def window_starts(self, x, eps, ffn_hidden: int, slice_width: int):
        shape = [*x.shape[:-1], eps.shape[-1]]
        return torch.onnx.ops.symbolic(f"{DOMAIN}::{ROUTER_OP_TYPE}", (x, self.weight.T, self.bias, eps),
                                       dict(ffn_hidden=ffn_hidden, slice_width=slice_width), dtype=torch.int64,
                                       shape=shape, version=1)


class OrtDecoder(nn.Module):
    """The exporter's module (its model with the expert op, DecoderIO and quantile noise) with
    the forward of the onnxruntime target; same inputs and outputs."""

    def __init__(self, export_module: nn.Module):
        super().__init__()
        self.io: DecoderIO = export_module.io
        if not fits_onnxruntime(self.io.config):
            raise InfMoEError(f"the onnxruntime target needs head_dim (d_model / n_head) a multiple of "
                              f"{HEAD_DIM_MULTIPLE} for GroupQueryAttention, got {self.io.config.head_dim}: "
                              "export with --target portable")
        self.model = export_module.model
        for block in self.model.h if not self.io.is_moe else ():  # the exporter's copy of the model
            moe = block.moe.moe
            moe.router = _FusedRouter(moe.router)
        if hasattr(export_module, "quantile_eps"):
            self.register_buffer("quantile_eps", export_module.quantile_eps, persistent=False)

    def forward(self, *inputs):
        io, model = self.io, self.model
        c = model.config
        named = dict(zip(io.input_names, inputs))
        input_ids, mask = named["input_ids"], named["attention_mask"]
        batch, sequence = input_ids.shape
        total = mask.shape[1]
        eps = named.get("expert_noise")
        if eps is None:  # [K], broadcast by the router (a conventional MoE has none)
            eps = getattr(self, "quantile_eps", None)

        # The once-per-step inputs in one node (every node adds onnxruntime's per-node overhead
        # to a decode step): positions (real tokens only, model.py) and the attention's
        # seqlens_k, total_sequence_length and attention_bias, from attention_mask.
        positions, seqlens_k, total_length, attention_bias = torch.onnx.ops.symbolic_multi_out(
            f"{DOMAIN}::{STEP_OP_TYPE}", (input_ids, mask), {},
            dtypes=(torch.int64, torch.int32, torch.int32, torch.float32),
            shapes=([batch, sequence], [batch], [1], [batch, 1, sequence, total]), version=1)

        a, x = _skip_layer_norm(model.wte(input_ids), model.wpe(positions), model.h[0].ln_1)
        presents, all_starts = [], []
        past_names = io.past_names
        for i, block in enumerate(model.h):
            attn = block.attn
            qkv = F.linear(a, attn.qkv.weight)
            past = [named[name] for name in past_names[2 * i:2 * i + 2]] if io.past else [None, None]
            past_length = past[0].shape[2] if io.past else 0
            kv_shape = [batch, c.n_head, past_length + sequence, c.head_dim]
            kv_dtype = past[0].dtype if io.past else qkv.dtype  # the presents are the past's type (io.kv_cache)
            y, key, value = torch.onnx.ops.symbolic_multi_out(
                f"{DOMAIN}::{ATTENTION_OP_TYPE}",
                (qkv, past[0], past[1], seqlens_k, total_length, attention_bias, attn.qkv.bias),
                dict(num_heads=c.n_head),
                dtypes=(qkv.dtype, kv_dtype, kv_dtype), shapes=([batch, sequence, c.d_model], kv_shape, kv_shape),
                version=1)
            presents += [key, value]
            ln_2, h = _skip_layer_norm(F.linear(y, attn.proj.weight), x, block.ln_2, attn.proj.bias)
            out, starts = block.moe(ln_2, eps)
            all_starts.append(starts)
            norm = model.h[i + 1].ln_1 if i + 1 < len(model.h) else model.ln_f
            a, x = _skip_layer_norm(out, h, norm)
        outputs = [F.linear(a, model.wte.weight)]  # tied embeddings
        if io.past:
            outputs += presents
        if io.with_starts:
            outputs += all_starts
        return tuple(outputs)


def decoder_attention(qkv, past_key, past_value, seqlens_k, total_sequence_length, attention_bias, num_heads,
                      qkv_bias=None):
    """What infmoe::DecoderAttention computes (docs/reference/ops/DecoderAttention.md), in float64 numpy: the
    reference its kernel and fallback are tested against. qkv_bias (optional) is added to qkv first,
    in float32 as the Add it replaces. Row b's cache holds past_b = seqlens_k[b] + 1 - S positions
    of past (None: no past), then the S new keys and values, zeros after; query i sees keys j <=
    past_b + i, scores q . k / sqrt(head_dim) + attention_bias. A float16 cache (past_key float16):
    the new keys and values rounded to float16 (after the bias) as they are written, and seen so.
    Returns y, present_key, present_value."""
    if qkv_bias is not None:
        qkv = np.asarray(qkv, np.float32) + np.asarray(qkv_bias, np.float32)
    if past_key is not None and past_key.dtype == np.float16:
        qkv = np.array(qkv, np.float32)
        qkv[..., qkv.shape[-1] // 3:] = qkv[..., qkv.shape[-1] // 3:].astype(np.float16)
    qkv, bias = np.asarray(qkv, np.float64), np.asarray(attention_bias, np.float64)
    batch, sequence, width = qkv.shape
    dim = width // (3 * num_heads)
    q, k, v = qkv.reshape(batch, sequence, 3, num_heads, dim).transpose(2, 0, 3, 1, 4)
    past = 0 if past_key is None else past_key.shape[2]
    present = np.zeros((2, batch, num_heads, max(past, int(np.asarray(total_sequence_length).reshape(-1)[0])), dim))
    y = np.zeros((batch, sequence, num_heads * dim))
    for b in range(batch):
        row_past = int(seqlens_k[b]) + 1 - sequence
        if row_past:
            present[0, b, :, :row_past] = past_key[b, :, :row_past]
            present[1, b, :, :row_past] = past_value[b, :, :row_past]
        present[:, b, :, row_past:row_past + sequence] = np.stack([k[b], v[b]])
        for i in range(sequence):
            seen = row_past + i + 1
            scores = np.einsum("hd,hjd->hj", q[b, :, i], present[0, b, :, :seen]) / np.sqrt(dim)
            scores += bias[min(b, bias.shape[0] - 1), 0, i, :seen]
            weights = np.exp(scores - scores.max(-1, keepdims=True))
            weights /= weights.sum(-1, keepdims=True)
            y[b, i] = np.einsum("hj,hjd->hd", weights, present[1, b, :, :seen]).reshape(-1)
    return y, present[0], present[1]


def window_starts_reference(x, weight, bias, eps, ffn_hidden: int, slice_width: int):
    """What infmoe::WindowStarts computes (SPEC §3), in float64 numpy: (starts, the value before
    the floor). float32 sums in another order may land on the other side of an integer where the
    value lies within a hair of it: compare such starts up to one."""
    mu_s = np.asarray(x, np.float64) @ np.asarray(weight, np.float64) + np.asarray(bias, np.float64)
    z = mu_s[..., :1] + np.logaddexp(0.0, mu_s[..., 1:]) * np.asarray(eps, np.float64)
    value = np.minimum(1.0 / (1.0 + np.exp(-z)) * (ffn_hidden - slice_width + 1), ffn_hidden - slice_width)
    return np.floor(value).astype(np.int64), value


def skip_layer_norm_reference(input, skip, gamma, beta, bias=None, epsilon: float = 1e-5):
    """What infmoe::SkipLayerNorm computes (docs/reference/ops/SkipLayerNorm.md), in numpy: (output
    in float64, input_skip_bias_sum in float32). The sum is float32's (input + skip) + bias, as
    the kernel adds them (exactly its bits); the LayerNorm of it over the last axis, with the
    biased variance, in float64."""
    total = np.asarray(input, np.float32) + np.asarray(skip, np.float32)
    if bias is not None:
        total = total + np.asarray(bias, np.float32)
    s = total.astype(np.float64)
    centred = s - s.mean(-1, keepdims=True)
    scale = 1.0 / np.sqrt((centred ** 2).mean(-1, keepdims=True) + epsilon)
    return centred * scale * np.asarray(gamma, np.float64) + np.asarray(beta, np.float64), total


def step_inputs_reference(input_ids, attention_mask):
    """What infmoe::StepInputs computes (docs/reference/ops/StepInputs.md), in numpy: (position_ids,
    seqlens_k, total_sequence_length, attention_bias). counts = the mask's exclusive cumulative sum
    per row; positions its last `sequence` columns, seqlens_k the last index of its largest value,
    the bias 0 where the mask is nonzero and float32's lowest elsewhere, every query row alike."""
    attention_mask = np.asarray(attention_mask, np.int64)
    batch, sequence = np.shape(input_ids)
    total = attention_mask.shape[1]
    counts = np.cumsum(attention_mask, axis=1) - attention_mask
    last_largest = total - 1 - np.argmax(counts[:, ::-1], axis=1)
    bias = np.where(attention_mask != 0, np.float32(0), np.finfo(np.float32).min).astype(np.float32)
    return (counts[:, total - sequence:], last_largest.astype(np.int32), np.array([total], np.int32),
            np.ascontiguousarray(np.broadcast_to(bias[:, None, None, :], (batch, 1, sequence, total))))


def finish_ort_graph(graph: ir.Graph):
    """Name the attention's two length inputs as the contract does (one value each, shared by
    every layer), and the nodes written here after their module, as the exporter names the
    others: '/h.0.attn/DecoderAttention' (the layers in order), '/h.0.ln_2/
    SkipLayerNormalization', '/h.0.attn.proj/MatMul' (from their first weight); the exporter
    names the rest ('/h.0.moe/WindowStarts')."""
    used = {node.name for node in graph}
    layer = 0

    def rename(node, base):
        name, n = base, 0
        while name in used:
            n += 1
            name = f"{base}_{n}"
        used.discard(node.name)
        node.name = name
        used.add(name)

    for node in graph:
        if node.domain == DOMAIN and node.op_type == ATTENTION_OP_TYPE:
            if layer == 0:
                node.inputs[3].name, node.inputs[4].name = SEQLENS_K, TOTAL_SEQUENCE_LENGTH
            rename(node, f"/h.{layer}.attn/{node.op_type}")
            layer += 1
        elif node.name.startswith("/h.") or node.name.startswith("/wte") or node.name.startswith("/wpe"):
            continue
        else:
            weights = [v.name for v in node.inputs if v is not None and v.is_initializer() and "." in v.name]
            if weights:
                module = weights[0].removesuffix(".T").rsplit(".", 1)[0]
                rename(node, f"/{module}/{node.op_type}")
