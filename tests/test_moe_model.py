"""The conventional top-k MoE (model_type moe-gpt2): its layer against a per-token loop written from
the spec, ties, the decoder's cache and padding, training with the balance loss, its config and
checkpoint checks (its export: tests/test_moe_export.py)."""

import json
import math
import re

import pytest
import torch
from safetensors.torch import load_file, save_file

from infmoe_export import data
from infmoe_export.checkpoint import WEIGHTS_FILE, load_checkpoint, save_checkpoint
from infmoe_export.errors import InfMoEError
from infmoe_export.model import (InfMoEConfig, InfMoEGPT, MoEConfig, MoEGPT, TopKMoE, config_from_dict, model_for,
                                 top_k_experts)
from infmoe_export.train import balance_loss, optimizer_for, train_model
from conftest import left_padded, random_model

# Odd on purpose: d_model not a power of 2, head_dim 5, E = 3 experts of 37 units, V > 256.
SHAPE = dict(vocab_size=259, n_positions=23, d_model=15, n_layer=2, n_head=3, ffn_hidden=3 * 37, num_experts=3)


def moe_config(top_k=2, router_softmax="selected", **overrides) -> MoEConfig:
    return MoEConfig(**{**SHAPE, "top_k": top_k, "router_softmax": router_softmax, **overrides})


def gelu_tanh_formula(a):
    return 0.5 * a * (1 + torch.tanh(math.sqrt(2 / math.pi) * (a + 0.044715 * a ** 3)))


def naive_layer(layer: TopKMoE, x: torch.Tensor, top_k: int, router_softmax: str):
    """The spec's layer, one token and one expert at a time, in float64: (y, experts)."""
    W = {name: p.detach().double() for name, p in layer.named_parameters()}
    flat = x.double().reshape(-1, x.shape[-1])
    ys, chosen = [], []
    for token in flat:
        logits = W["router.weight"] @ token
        order = sorted(range(len(logits)), key=lambda e: (-logits[e].item(), e))[:top_k]
        if router_softmax == "selected":
            weights = torch.softmax(logits[order], 0)
        else:
            weights = torch.softmax(logits, 0)[order]
        y = torch.zeros_like(token)
        for weight, e in zip(weights, order):
            hidden = gelu_tanh_formula(W["w_in"][e] @ token + W["b_in"][e])
            y = y + weight * (W["w_out"][e] @ hidden + W["b_out"][e])
        ys.append(y)
        chosen.append(order)
    return (torch.stack(ys).reshape(x.shape).float(),
            torch.tensor(chosen, dtype=torch.int64).reshape(*x.shape[:-1], top_k))


@pytest.mark.parametrize("router_softmax", ["selected", "all"])
@pytest.mark.parametrize("top_k", [1, 2, 3])
def test_layer_equals_a_per_token_loop(top_k, router_softmax):
    model = random_model(moe_config(top_k, router_softmax), seed=top_k)
    layer = model.h[1].moe
    x = torch.randn(3, 7, 15, generator=torch.Generator().manual_seed(5))
    y, experts = layer(x)
    want_y, want_experts = naive_layer(layer, x, top_k, router_softmax)
    assert torch.equal(experts, want_experts)
    torch.testing.assert_close(y, want_y, rtol=1e-5, atol=1e-5)
    if top_k < 3:  # every expert is used by some token, and not every token picks the same
        assert set(experts.flatten().tolist()) == {0, 1, 2}
        assert len({tuple(row) for row in experts.reshape(-1, top_k).tolist()}) > 1


def test_ties_go_to_the_lowest_expert_index():
    logits = torch.tensor([[0.5, 1.0, 1.0, 0.2], [2.0, 2.0, 2.0, 2.0], [-1.0, 3.0, -1.0, -1.0],
                           [0.0, -0.0, 0.0, 1.0]])
    assert top_k_experts(logits, 3).tolist() == [[1, 2, 0], [0, 1, 2], [1, 0, 2], [3, 0, 1]]
    # many rows of few distinct values: every tie, at every width the sort may vectorise
    g = torch.Generator().manual_seed(7)
    for E in (3, 8, 37):
        many = torch.randint(0, 3, (200, E), generator=g).float()
        want = [sorted(range(E), key=lambda e, row=row: (-row[e].item(), e))[:3] for row in many]
        assert top_k_experts(many, 3).tolist() == want
    # in the layer: experts 0 and 2 with the same router row always tie; expert 0 wins
    model = random_model(moe_config(top_k=1))
    layer = model.h[0].moe
    with torch.no_grad():
        layer.router.weight[2] = layer.router.weight[0]
    x = torch.randn(40, 15, generator=g)
    _, experts = layer(x)
    assert 0 in experts and 2 not in experts
    assert torch.equal(experts, naive_layer(layer, x, 1, "selected")[1])


def test_batch_rows_equal_rows_alone():
    model = random_model(moe_config(top_k=2), seed=1)
    g = torch.Generator().manual_seed(3)
    rows, ids, mask, T = left_padded([13, 6, 9], g)
    batch = model(ids, attention_mask=mask, return_starts=True)
    for b, row in enumerate(rows):
        alone = model(row[None], return_starts=True)
        torch.testing.assert_close(batch.logits[b, T - len(row):], alone.logits[0], rtol=1e-4, atol=1e-4)
        for layer in range(2):
            assert torch.equal(batch.starts[layer][b, T - len(row):], alone.starts[layer][0])


@pytest.mark.parametrize("top_k", [1, 2])
def test_kv_cache_decoding_equals_full_forward(top_k):
    model = random_model(moe_config(top_k, "all" if top_k == 1 else "selected"), seed=2)
    ids = torch.randint(0, 259, (2, 17), generator=torch.Generator().manual_seed(1))
    full = model(ids, return_starts=True)
    out = model(ids[:, :5], return_starts=True)
    logits, experts, past = [out.logits], [out.starts], out.present
    for t in range(5, 17):
        out = model(ids[:, t:t + 1], past_key_values=past, k=top_k, return_starts=True)
        logits.append(out.logits)
        experts.append(out.starts)
        past = out.present
    torch.testing.assert_close(torch.cat(logits, 1), full.logits, rtol=1e-4, atol=1e-4)
    for layer in range(2):
        assert torch.equal(torch.cat([e[layer] for e in experts], 1), full.starts[layer])


def test_expert_budget_is_top_k_and_there_is_no_noise():
    model = random_model(moe_config(top_k=2))
    ids = torch.randint(0, 259, (1, 5))
    assert torch.equal(model(ids, k=2).logits, model(ids).logits)
    with pytest.raises(InfMoEError, match="K = 3 does not apply .* top_k = 2"):
        model(ids, k=3)
    with pytest.raises(InfMoEError, match="expert_noise does not apply"):
        model(ids, expert_noise=torch.randn(1, 5, 2))


def test_balance_loss_is_switch_formula():
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(2, 9, 5, generator=g)
    for top_k in (1, 2):
        flat = logits.reshape(-1, 5)
        share = torch.zeros(5)
        for row in flat:
            for e in sorted(range(5), key=lambda e, row=row: (-row[e].item(), e))[:top_k]:
                share[e] += 1 / (len(flat) * top_k)
        want = 5 * (share * torch.softmax(flat, -1).mean(0)).sum()
        torch.testing.assert_close(balance_loss(logits, top_k), want)
    # one expert taking every token with all the probability costs E
    dominated = torch.full((6, 4), -30.0)
    dominated[:, 2] = 30.0
    torch.testing.assert_close(balance_loss(dominated, 1), torch.tensor(4.0))
    # its gradient reaches the router's logits
    logits.requires_grad_(True)
    balance_loss(logits, 2).backward()
    assert logits.grad.abs().sum() > 0


def test_training_lowers_the_loss_and_logs_the_balance():
    config = MoEConfig(vocab_size=256, n_positions=32, d_model=24, n_layer=2, n_head=2, ffn_hidden=96,
                       num_experts=4, top_k=2, router_softmax="selected")
    blob = (b"def add(a, b):\n    return a + b\n\nclass Point:\n    x: int = 0\n" * 40)
    val = data.windows(blob[-200:], 32)
    model, log = train_model(config, data.encode(blob[:-200]), val, steps=30, batch_size=8, lr=1e-2,
                             seed=0, eval_every=10)
    assert isinstance(model, MoEGPT) and not model.training
    assert log[-1]["val_loss"] < log[9]["val_loss"] < math.log(256)
    assert all(0 < r["balance"] <= 4 and "spread" not in r for r in log)
    # the balance term is in the objective: with another weight the same seed trains differently
    _, other = train_model(config, data.encode(blob[:-200]), val, steps=3, batch_size=8, lr=1e-2, seed=0,
                           eval_every=10, balance_weight=1.0)
    assert other[0]["loss"] == log[0]["loss"] and other[2]["loss"] != log[2]["loss"]
    groups = optimizer_for(model, 1e-3, 0.1).param_groups
    decayed = {id(p) for p in groups[0]["params"]}
    for name, p in model.named_parameters():
        assert (id(p) in decayed) == (name.endswith(("w_in", "w_out", "qkv.weight", "proj.weight"))
                                      or name in ("wte.weight", "wpe.weight")), name


def test_init_zeroes_the_biases_only():
    model = MoEGPT(moe_config())
    model.reset_parameters(seed=1)
    for name, p in model.named_parameters():
        if name.endswith(("bias", "b_in", "b_out")):
            assert not p.any(), name
        elif name.endswith("ln_1.weight") or name.endswith("ln_2.weight") or name == "ln_f.weight":
            assert p.eq(1).all(), name
        else:
            assert p.std() > 0, name


@pytest.mark.parametrize("overrides, field", [
    (dict(top_k=4), "top_k"),
    (dict(top_k=0), "top_k"),
    (dict(num_experts=0), "num_experts"),
    (dict(num_experts=4), "num_experts"),  # 4 does not divide 111
    (dict(num_experts=2.5), "num_experts"),
    (dict(router_softmax="sparsemax"), "router_softmax"),
    (dict(model_type="infmoe-gpt2"), "model_type"),
    (dict(d_model=16), "d_model"),
])
def test_bad_configs_name_the_field(overrides, field):
    with pytest.raises(InfMoEError, match=f"'{field}'") as error:
        moe_config(**overrides)
    assert "\n" not in str(error.value)


def test_config_json_picks_the_architecture():
    moe = moe_config()
    assert config_from_dict(moe.to_dict()) == moe
    infmoe = InfMoEConfig(**{k: v for k, v in SHAPE.items() if k != "num_experts"}, slice_width=11, num_samples=2)
    assert config_from_dict(infmoe.to_dict()) == infmoe
    without_type = {k: v for k, v in infmoe.to_dict().items() if k != "model_type"}
    assert config_from_dict(without_type) == infmoe  # older configs: ∞-MoE
    assert isinstance(model_for(moe), MoEGPT) and type(model_for(infmoe)) is InfMoEGPT
    with pytest.raises(InfMoEError, match="model_type.*'llama'"):
        config_from_dict({**moe.to_dict(), "model_type": "llama"})
    with pytest.raises(InfMoEError, match="unknown key 'slice_width'"):
        config_from_dict({**moe.to_dict(), "slice_width": 11})


def test_checkpoint_round_trip(tmp_path):
    model = random_model(moe_config(top_k=2), seed=3)
    path = save_checkpoint(model, tmp_path / "moe")
    loaded = load_checkpoint(path)
    assert isinstance(loaded, MoEGPT) and loaded.config == model.config and not loaded.training
    for name, tensor in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    ids = torch.randint(0, 259, (2, 9))
    assert torch.equal(loaded(ids).logits, model(ids).logits)


@pytest.mark.parametrize("name, shape", [("h.1.moe.router.weight", [4, 15]), ("h.0.moe.router.weight", [3, 14]),
                                         ("h.0.moe.w_in", [3, 15, 37]), ("h.1.moe.b_out", [15])])
def test_wrong_tensor_shapes_name_the_tensor(tmp_path, name, shape):
    path = save_checkpoint(random_model(moe_config()), tmp_path / "moe")
    tensors = load_file(str(path / WEIGHTS_FILE))
    tensors[name] = torch.randn(shape)
    save_file(tensors, str(path / WEIGHTS_FILE))
    with pytest.raises(InfMoEError, match=re.escape(f"tensor '{name}' has shape {shape}, expected")):
        load_checkpoint(path)


def test_bad_config_json_is_refused_at_load(tmp_path):
    path = save_checkpoint(random_model(moe_config()), tmp_path / "moe")
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "top_k": 5}))
    with pytest.raises(InfMoEError, match="'top_k' \\(5\\) must be at most 'num_experts' \\(3\\)"):
        load_checkpoint(path)


def test_train_and_eval_commands(tmp_path, run_cli):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("import os\nprint(os.getcwd())\n" * 400)
    out = tmp_path / "moe"
    code, _, err = run_cli("train", "--corpus", corpus, "--out", out, "--steps", 3, "--batch-size", 2,
                           "--d-model", 24, "--n-layer", 1, "--n-head", 2, "--ffn-hidden", 96, "--n-positions", 32,
                           "--eval-every", 2, "--threads", 1, "--arch", "moe", "--experts", 4, "--top-k", 1)
    assert code == 0, err
    config = json.loads((out / "config.json").read_text())
    assert (config["model_type"], config["num_experts"], config["top_k"], config["router_softmax"]) == \
        ("moe-gpt2", 4, 1, "all")  # Switch's softmax at top-1 unless asked
    log = json.loads((out / "train_log.json").read_text())
    assert log["arch"] == "moe" and log["balance_weight"] == 0.01 and "spread_weight" not in log
    assert all("balance" in r for r in log["log"])
    assert math.isclose(sum(log["expert_load"][0]["expert_share"]), 1, rel_tol=1e-5)
    code, stdout, err = run_cli("eval", "--checkpoint", out, "--text", corpus, "--no-baselines", "--json")
    assert code == 0, err
    records = json.loads(stdout)
    assert [(r["model_type"], r["k"]) for r in records] == [("moe-gpt2", 1)]
    code, _, err = run_cli("eval", "--checkpoint", out, "--text", corpus, "--no-baselines", "--k", "1,2")
    assert code == 1 and "K = 2 does not apply" in err


@pytest.mark.parametrize("args, problem", [
    (["--arch", "moe", "--slice-width", "64"], "--slice-width does not apply to --arch moe"),
    (["--arch", "moe", "--num-samples", "2"], "--num-samples does not apply to --arch moe"),
    (["--arch", "moe", "--spread-weight", "0.1"], "--spread-weight does not apply to --arch moe"),
    (["--arch", "moe", "--training-noise", "stratified"], "--training-noise does not apply to --arch moe"),
    (["--top-k", "1"], "--top-k does not apply to --arch infmoe"),
    (["--balance-weight", "0.1"], "--balance-weight does not apply to --arch infmoe"),
    (["--arch", "moe", "--top-k", "5"], "'top_k' (5) must be at most 'num_experts' (4)"),
    (["--arch", "moe", "--experts", "3"], "'num_experts' (3) must divide 'ffn_hidden' (1024)"),
])
def test_train_refuses_options_of_the_other_arch(tmp_path, run_cli, args, problem):
    code, _, err = run_cli("train", "--out", tmp_path / "out", *args)
    assert code == 1 and err.count("\n") == 1 and problem in err
    assert not (tmp_path / "out").exists()
