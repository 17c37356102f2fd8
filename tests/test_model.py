"""The PyTorch reference against SPEC §3 written out as plain per-token, per-sample loops."""

import math
from statistics import NormalDist

import pytest
import torch
import torch.nn.functional as F

from infmoe_export.errors import InfMoEError
from infmoe_export.model import (StraightThroughWindow, continuous_slice_ffn, coverage,
                                 quantile_noise, window_starts)
from conftest import left_padded


def act(a):
    return 0.5 * a * (1 + torch.tanh(math.sqrt(2 / math.pi) * (a + 0.044715 * a ** 3)))


def loop_ffn(x, starts, w_in, b_in, w_out, b_out, r):
    """SPEC §3: y = b_out + (1/K) sum_k sum_{i=s_k}^{s_k+r-1} act(x . w_in[i] + b_in[i]) w_out[i]."""
    D, K = x.shape[-1], starts.shape[-1]
    xs, ss = x.reshape(-1, D), starts.reshape(-1, K)
    ys = []
    for token, token_starts in zip(xs, ss):
        y = b_out.clone()
        for s in token_starts.tolist():
            for i in range(s, s + r):
                y = y + act(token @ w_in[i] + b_in[i]) * w_out[i] / K
        ys.append(y)
    return torch.stack(ys).reshape(x.shape)


def ffn_weights(H, D, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g, dtype=torch.float64) for shape in ([H, D], [H], [H, D], [D])]


def make_starts(lead, K, H, r, kind, seed):
    """Random starts that include 0 and H - r, clustered (overlapping) or spread (disjoint when they fit)."""
    g = torch.Generator().manual_seed(seed)
    last = H - r
    if kind == "overlapping":
        base = torch.randint(0, last + 1, (*lead, 1), generator=g)
        starts = (base + torch.randint(-2, 3, (*lead, K), generator=g)).clamp(0, last)
    else:  # disjoint where K windows fit side by side, else random
        if K * r <= H:
            offsets = torch.arange(K) * r + torch.randint(0, H - K * r + 1, (*lead, 1), generator=g)
            starts = offsets.expand(*lead, K).clone()
        else:
            starts = torch.randint(0, last + 1, (*lead, K), generator=g)
    flat = starts.reshape(-1, K)
    flat[0, 0], flat[-1, -1] = 0, last
    return starts


CASES = [  # (H, r, K, lead)
    (37, 1, 1, (2, 3)),
    (37, 11, 1, (5,)),
    (37, 11, 3, (2, 3)),
    (41, 7, 4, (3, 2)),
    (37, 37, 2, (4,)),   # r = H: every start is 0
    (29, 1, 5, (1, 3)),
]


@pytest.mark.parametrize("kind", ["overlapping", "disjoint"])
@pytest.mark.parametrize("H,r,K,lead", CASES)
def test_reference_op_matches_per_sample_loop(H, r, K, lead, kind):
    D = 13
    w_in, b_in, w_out, b_out = ffn_weights(H, D, seed=H + r + K)
    x = torch.randn(*lead, D, generator=torch.Generator().manual_seed(K), dtype=torch.float64)
    starts = make_starts(lead, K, H, r, kind, seed=r)
    got = continuous_slice_ffn(x, starts, w_in, b_in, w_out, b_out, r)
    torch.testing.assert_close(got, loop_ffn(x, starts, w_in, b_in, w_out, b_out, r), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("H,r,K,lead", CASES)
def test_union_form_equals_average_of_single_windows(H, r, K, lead):
    D = 9
    w_in, b_in, w_out, b_out = ffn_weights(H, D, seed=1)
    x = torch.randn(*lead, D, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    starts = make_starts(lead, K, H, r, "overlapping", seed=3)
    singles = [continuous_slice_ffn(x, starts[..., k:k + 1], w_in, b_in, w_out, b_out, r) for k in range(K)]
    torch.testing.assert_close(continuous_slice_ffn(x, starts, w_in, b_in, w_out, b_out, r),
                               torch.stack(singles).mean(0), rtol=1e-10, atol=1e-10)
    # and the coverage weights are window counts / K
    c = coverage(starts, H, r)
    counts = torch.zeros(*lead, H)
    for index in torch.cartesian_prod(*[torch.arange(n) for n in lead]).reshape(-1, len(lead)):
        for s in starts[tuple(index)].tolist():
            counts[tuple(index)][s:s + r] += 1
    torch.testing.assert_close(c, counts / K)


def test_window_starts_formula_and_edges():
    H, r = 37, 11
    z = torch.cat([torch.randn(500, generator=torch.Generator().manual_seed(0)) * 3,
                   torch.tensor([-80.0, 80.0, 0.0])])
    expected = [min(math.floor(1 / (1 + math.exp(-v)) * (H - r + 1)), H - r) for v in z.tolist()]
    assert window_starts(z, H, r).tolist() == expected
    assert window_starts(torch.tensor([-80.0, 80.0]), H, r).tolist() == [0, H - r]


def test_quantile_noise_is_normal_quantiles():
    for K in (1, 2, 5):
        expected = [NormalDist().inv_cdf((k - 0.5) / K) for k in range(1, K + 1)]
        torch.testing.assert_close(quantile_noise(K), torch.tensor(expected, dtype=torch.float32))
    assert quantile_noise(1).tolist() == [0.0]  # K = 1 gives z = mu


@pytest.mark.parametrize("noise", ["quantile", "sampled"])
def test_layer_matches_spec_formula(make_model, noise):
    """The whole ∞-MoE layer, router included, against SPEC §3 computed token by token."""
    model = make_model()
    layer, c = model.h[1].moe, model.config
    K = 4
    x = torch.randn(2, 5, c.d_model, generator=torch.Generator().manual_seed(7))
    eps = quantile_noise(K) if noise == "quantile" else torch.randn(2, 5, K, generator=torch.Generator().manual_seed(8))
    y, starts = layer(x, eps)
    r, H = c.slice_width, c.ffn_hidden
    for b in range(2):
        for t in range(5):
            token = x[b, t].double()
            mu = token @ layer.router.mu.weight[0].double() + layer.router.mu.bias[0].double()
            sigma = F.softplus(token @ layer.router.sigma.weight[0].double() + layer.router.sigma.bias[0].double())
            e = eps if eps.dim() == 1 else eps[b, t]
            s = [min(math.floor(torch.sigmoid(mu + sigma * e_k).item() * (H - r + 1)), H - r) for e_k in e.double()]
            assert starts[b, t].tolist() == s
    spread = {tuple(row) for row in starts.reshape(-1, K).tolist()}
    assert len(spread) > 1, "the random router should pick different windows for different tokens"
    expected = loop_ffn(x.double(), starts, layer.w_in.double(), layer.b_in.double(),
                        layer.w_out.double(), layer.b_out.double(), r)
    torch.testing.assert_close(y.double(), expected, rtol=1e-4, atol=1e-5)


def test_dense_case_is_plain_gpt2_mlp(make_model):
    model = make_model(slice_width=37)  # r = H
    layer = model.h[0].moe
    x = torch.randn(3, 4, model.config.d_model)
    mlp = F.gelu(x @ layer.w_in.T + layer.b_in, approximate="tanh") @ layer.w_out + layer.b_out
    for k, noise in ((1, "quantile"), (3, "quantile"), (2, "sampled")):
        eps = quantile_noise(k) if noise == "quantile" else torch.randn(3, 4, k)
        y, starts = layer(x, eps)
        assert starts.eq(0).all()
        torch.testing.assert_close(y, mlp, rtol=1e-5, atol=1e-5)
    layer.train()  # the training forward of the dense case is the same MLP
    torch.testing.assert_close(layer(x, quantile_noise(2))[0], mlp, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("noise", ["quantile", "sampled"])
def test_kv_cache_decoding_equals_full_forward(make_model, noise):
    model = make_model()
    ids = torch.randint(0, 259, (2, 17), generator=torch.Generator().manual_seed(1))
    K = 3
    eps = torch.randn(2, 17, K, generator=torch.Generator().manual_seed(2)) if noise == "sampled" else None
    full = model(ids, k=K, expert_noise=eps, return_starts=True)
    # a 5-token prompt, then one token at a time
    out = model(ids[:, :5], k=K, expert_noise=None if eps is None else eps[:, :5], return_starts=True)
    logits, starts, past = [out.logits], [out.starts], out.present
    for t in range(5, 17):
        out = model(ids[:, t:t + 1], past_key_values=past, k=K,
                    expert_noise=None if eps is None else eps[:, t:t + 1], return_starts=True)
        logits.append(out.logits)
        starts.append(out.starts)
        past = out.present
    torch.testing.assert_close(torch.cat(logits, 1), full.logits, rtol=1e-4, atol=1e-4)
    for layer in range(model.config.n_layer):
        assert torch.equal(torch.cat([s[layer] for s in starts], 1), full.starts[layer])


def test_left_padded_rows_equal_rows_alone(make_model):
    model = make_model()
    g = torch.Generator().manual_seed(3)
    rows, ids, mask, T = left_padded([13, 6, 9], g)
    batch = model(ids, attention_mask=mask, k=2, return_starts=True)
    for b, row in enumerate(rows):
        alone = model(row[None], k=2, return_starts=True)
        torch.testing.assert_close(batch.logits[b, T - len(row):], alone.logits[0], rtol=1e-4, atol=1e-4)
        assert torch.equal(batch.starts[0][b, T - len(row):], alone.starts[0][0])
    # and incremental decoding continues a padded batch correctly
    nxt = torch.randint(0, 259, (3, 1), generator=g)
    step = model(nxt, attention_mask=torch.cat([mask, torch.ones(3, 1, dtype=torch.long)], 1),
                 past_key_values=batch.present, k=2)
    for b, row in enumerate(rows):
        alone = model(torch.cat([row, nxt[b]])[None], k=2)
        torch.testing.assert_close(step.logits[b, 0], alone.logits[0, -1], rtol=1e-4, atol=1e-4)


def test_bad_calls_raise_clear_errors(make_model):
    model = make_model()
    ids = torch.randint(0, 259, (1, 5))
    for k in (0, -2):
        with pytest.raises(InfMoEError, match="expert budget K"):
            model(ids, k=k)
    with pytest.raises(InfMoEError, match="n_positions"):
        model(torch.zeros(1, 24, dtype=torch.long))
    with pytest.raises(InfMoEError, match="noise mode"):
        model(ids, noise="gaussian")


def test_router_gets_gradients_in_training(make_model):
    model = make_model().train()
    ids = torch.randint(0, 259, (2, 12), generator=torch.Generator().manual_seed(4))
    logits = model(ids, noise="sampled", generator=torch.Generator().manual_seed(5)).logits
    F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten()).backward()
    for i, block in enumerate(model.h):
        for p in (block.moe.router.mu.weight, block.moe.router.sigma.weight):
            assert p.grad is not None and p.grad.abs().sum() > 0, f"layer {i} router has no gradient"


def test_straight_through_gradient_matches_soft_window():
    """The prefix-sum backward against autograd through an explicit soft window with the same
    linear-ramp edges, on a smooth gradient field (where the two agree up to discretisation)."""
    H, r, K, edge = 97, 20, 3, 4.0
    z = torch.randn(6, K, generator=torch.Generator().manual_seed(0), dtype=torch.float64, requires_grad=True)
    field = torch.randn(6, H, generator=torch.Generator().manual_seed(1), dtype=torch.float64).cumsum(-1)
    t = torch.sigmoid(z) * (H - r + 1)
    c = StraightThroughWindow.apply(t, window_starts(z, H, r), H, r, edge)
    torch.testing.assert_close(c.double(), coverage(window_starts(z, H, r), H, r).double())  # hard forward
    (c * field).sum().backward()
    straight = z.grad.clone()
    z.grad = None
    t = (torch.sigmoid(z) * (H - r + 1)).unsqueeze(-1)
    units = torch.arange(H, dtype=torch.float64) + 0.5
    soft = ((units - t) / edge + 0.5).clamp(0, 1) * ((t + r - units) / edge + 0.5).clamp(0, 1)
    (soft.mean(-2) * field).sum().backward()
    assert F.cosine_similarity(straight.flatten(), z.grad.flatten(), dim=0) > 0.95
