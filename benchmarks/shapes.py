"""The shapes every benchmark measures: GPT-2 Small's size as an ∞-MoE, the dense GPT-2 Small and
Medium it is compared with, and the decode and prefill lengths."""

import numpy as np
import torch

from infmoe_export.model import InfMoEConfig, quantile_noise, window_starts

# The ∞-MoE of GPT-2 Small's size: D 768, L 12, 12 heads, H 6144 hidden units, windows of r 1536.
SMALL = InfMoEConfig(vocab_size=50257, n_positions=1024, d_model=768, n_layer=12, n_head=12, ffn_hidden=6144,
                     slice_width=1536, num_samples=2)
# Dense GPT-2 Medium's size (H = r, K = 1): the model the ∞-MoE is said to match.
MEDIUM_DENSE = InfMoEConfig(vocab_size=50257, n_positions=1024, d_model=1024, n_layer=24, n_head=16,
                            ffn_hidden=4096, slice_width=4096, num_samples=1)
# Dense GPT-2 Small's size.
SMALL_DENSE = InfMoEConfig(vocab_size=50257, n_positions=1024, d_model=768, n_layer=12, n_head=12,
                           ffn_hidden=3072, slice_width=3072, num_samples=1)

# One expert layer of SMALL, for the op-alone benchmarks: 12 copies of its weights are cycled, as
# a 12-layer model reads them, so none comes from the cache.
D, H, R, LAYERS = SMALL.d_model, SMALL.ffn_hidden, SMALL.slice_width, SMALL.n_layer

PAST = 128      # KV-cache length of a timed decode step
PREFILL = 512   # tokens of a timed prefill
BLOCK = 32      # the quantized exports' block size (SPEC §6)


def layer_starts(tokens: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """Window starts [tokens, k] on the op layer: quantile noise (SPEC §3) around a random mu per
    token, sigma 1."""
    mu = torch.from_numpy(rng.standard_normal((tokens, 1)).astype(np.float32))
    return window_starts(mu + quantile_noise(k), H, R).numpy()


def union_rows(starts: np.ndarray) -> float:
    """Mean number of the op layer's hidden units covered by a token's windows (starts [tokens, k])."""
    covered = np.zeros((starts.shape[0], H + 1), np.int32)
    for j in range(starts.shape[1]):
        np.add.at(covered, (np.arange(starts.shape[0]), starts[:, j]), 1)
        np.add.at(covered, (np.arange(starts.shape[0]), starts[:, j] + R), -1)
    return float((np.cumsum(covered, axis=1)[:, :H] > 0).sum(axis=1).mean())
