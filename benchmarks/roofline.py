"""The bytes a decode step must read: the numerator of every roofline (bytes over the machine's
read bandwidth, measured in the same run with infmoe_export.report.timing)."""

import math

import torch

from infmoe_export.model import InfMoEGPT, coverage
from infmoe_export.quant import BITS
from infmoe_export.report.bench import text_tokens

from .shapes import BLOCK, PAST


def stored_bytes(numel: int, rows: int, bits: int) -> int:
    """Bytes of numel weights in `rows` rows at `bits` (SPEC §6: float32 scales per block of BLOCK)."""
    if bits == 32:
        return 4 * numel
    return numel * bits // 8 + rows * math.ceil(numel // rows / BLOCK) * 4


def decode_bytes(model: InfMoEGPT, k: int, past: int = PAST, dtype: str = "fp32", quantize_other: str = "none") -> int:
    """Bytes a batch-1 decode step at `past` must read at this precision: every weight except the
    unused rows of w_in / w_out and all but two embedding rows, the tied LM head (all of wte), the
    KV cache; quantized matrices at their bits plus their scales. The union of the windows is the
    one the reference picks for the timed token (the benchmark's text)."""
    c = model.config
    expert_bits, other_bits = BITS.get(dtype, 32), BITS.get(quantize_other, 32)
    ids = torch.from_numpy(text_tokens(past + 1)).view(1, -1)
    with torch.no_grad():
        starts = model(ids, k=k, return_starts=True).starts
    total = 0
    for name, p in model.named_parameters():
        if name.endswith(("moe.w_in", "moe.w_out")):
            continue
        if name == "wte.weight":
            total += 2 * stored_bytes(c.d_model, 1, other_bits) + stored_bytes(p.numel(), c.vocab_size, other_bits)
        elif name == "wpe.weight":
            total += 2 * 4 * c.d_model
        elif name.endswith(("attn.qkv.weight", "attn.proj.weight")):
            total += stored_bytes(p.numel(), p.shape[0], other_bits)
        else:
            total += 4 * p.numel()
    for s in starts:
        union = int((coverage(s[0, -1], c.ffn_hidden, c.slice_width) > 0).sum())
        total += 2 * stored_bytes(union * c.d_model, union, expert_bits)
    return total + 4 * c.n_layer * 2 * past * c.d_model
