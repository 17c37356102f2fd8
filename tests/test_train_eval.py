"""Corpus and split, training, perplexity, the bundled model and doctor."""

import json
import math
import zlib
from collections import Counter
from pathlib import Path

import pytest
import torch

from infmoe_export import data
from infmoe_export.checkpoint import DEFAULT_CHECKPOINT, load_checkpoint
from infmoe_export.errors import InfMoEError
from infmoe_export.evaluate import perplexity, router_spread, window_nll
from infmoe_export.model import InfMoEConfig
from infmoe_export.train import TRAIN_LOG, train_model

from conftest import TINY


def test_byte_tokenizer():
    text = "déjà vu ∞-MoE\n\t"
    ids = data.encode(text)
    assert ids.dtype == torch.long and ids.tolist() == list(text.encode("utf-8"))
    assert bytes(ids.tolist()).decode("utf-8") == text
    assert data.encode(b"").numel() == 0


def test_windows_are_non_overlapping_and_last_is_shorter():
    blob = bytes(range(256)) * 3 + b"tail"
    chunks = data.windows(blob, 100)
    assert [len(c) for c in chunks] == [100] * 7 + [72]
    assert bytes(torch.cat(chunks).tolist()) == blob


def test_split_rule_is_fixed_and_by_file(tmp_path):
    assert data.split_of("json/decoder.py") == ("validation" if zlib.crc32(b"json/decoder.py") % 50 == 0 else "train")
    names = [f"pkg/f{i}.txt" for i in range(300)]  # f230 and f271 go to validation
    for name in names:
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text(name)
    (tmp_path / "pkg" / "empty.txt").write_text("")
    (tmp_path / ".hidden").write_text("never read")
    train, val = data.corpus_files("train", tmp_path), data.corpus_files("validation", tmp_path)
    rel = lambda paths: [p.relative_to(tmp_path).as_posix() for p in paths]
    assert rel(val) == sorted(n for n in names if zlib.crc32(n.encode()) % 50 == 0)
    assert sorted(rel(train) + rel(val)) == sorted(names) and rel(train) == sorted(rel(train))


def test_stdlib_corpus_has_both_splits_and_no_tests():
    val = data.corpus_files("validation")
    assert val and all(p.suffix == ".py" and "site-packages" not in p.parts and "test" not in p.parts for p in val)


def test_read_texts_errors(tmp_path):
    (tmp_path / "empty.txt").write_bytes(b"")
    with pytest.raises(InfMoEError, match="empty"):
        data.read_texts([tmp_path / "empty.txt"])
    with pytest.raises(InfMoEError, match="does not exist"):
        data.read_texts([tmp_path / "nope.txt"])
    with pytest.raises(InfMoEError, match="has no validation files"):
        (tmp_path / "only").mkdir()
        (tmp_path / "only" / "a.txt").write_text("x")  # crc32("a.txt") % 50 != 0
        data.corpus_files("validation", tmp_path / "only")


def manual_nll(model, chunks, k):
    """Mean NLL per predicted byte, window by window, without the batching of evaluate."""
    total, count = 0.0, 0
    for w in chunks:
        if len(w) < 2:
            continue
        logp = torch.log_softmax(model(w[None], k=k).logits[0, :-1], -1)
        total -= logp.gather(1, w[1:, None]).sum().item()
        count += len(w) - 1
    return total / count


def test_perplexity_definition_and_batching(make_model):
    model = make_model()
    blob = bytes(torch.randint(0, 256, (23 * 4 + 9,), generator=torch.Generator().manual_seed(0)).tolist())
    chunks = data.windows(blob, 23)
    for k in (1, 3):
        assert perplexity(model, chunks, k, batch_size=2) == pytest.approx(math.exp(manual_nll(model, chunks, k)), rel=1e-5)
    # sampled noise: reproducible from the seed, independent of batching, different from quantile
    a = perplexity(model, chunks, 2, "sampled", seed=1, batch_size=1)
    assert a == pytest.approx(perplexity(model, chunks, 2, "sampled", seed=1, batch_size=4), rel=1e-6)
    assert a != perplexity(model, chunks, 2, "sampled", seed=2)
    assert window_nll(model, data.windows(b"x", 23), 1) == (0.0, 0)


def tiny_corpus():
    """Repetitive text a tiny model learns in a few steps."""
    return ("def add(a, b):\n    return a + b\n\n" * 40).encode()


def test_a_few_training_steps_lower_the_loss():
    config = InfMoEConfig(**TINY)
    blob = tiny_corpus()
    val = data.windows(blob[-200:], config.n_positions)
    model, log = train_model(config, data.encode(blob[:-200]), val, steps=30, batch_size=8, lr=1e-2,
                             seed=0, eval_every=10)
    assert [r["step"] for r in log if "val_loss" in r] == [10, 20, 30]
    from infmoe_export.model import InfMoEGPT
    untrained = InfMoEGPT(config)
    untrained.reset_parameters(0)
    before = window_nll(untrained, val, config.num_samples)
    after = window_nll(model, val, config.num_samples)
    assert after[0] / after[1] < 0.7 * before[0] / before[1]
    assert log[-1]["val_loss"] == pytest.approx(after[0] / after[1])
    assert sum(r["loss"] for r in log[-5:]) < sum(r["loss"] for r in log[:5])


def test_train_and_eval_commands(tmp_path, run_cli):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    names = [f"f{i}.txt" for i in range(60)]
    assert any(data.split_of(n) == "validation" for n in names)
    for i, name in enumerate(names):
        (corpus / name).write_text(f"x = {i}\n" + tiny_corpus().decode()[: 50 + i])
    out = tmp_path / "model"
    code, stdout, err = run_cli("train", "--corpus", corpus, "--out", out, "--d-model", 16, "--n-layer", 1,
                                "--n-head", 2, "--ffn-hidden", 29, "--slice-width", 7, "--num-samples", 2,
                                "--n-positions", 32, "--steps", 3, "--batch-size", 2, "--eval-every", 2)
    assert code == 0, err
    model = load_checkpoint(out)
    assert (model.config.ffn_hidden, model.config.slice_width, model.config.num_samples) == (29, 7, 2)
    log = json.loads((out / TRAIN_LOG).read_text())
    assert log["steps"] == 3 and len(log["log"]) == 3 and math.isfinite(log["final_val_loss"])
    assert len(log["router_spread"]) == 1
    text = corpus / names[0]
    code, stdout, err = run_cli("eval", "--checkpoint", out, "--text", text, "--k", "1,4", "--json", "--no-baselines")
    assert code == 0, err
    records = json.loads(stdout)
    chunks = data.windows(text.read_bytes(), 32)
    assert [r["k"] for r in records] == [1, 4]
    for r in records:
        assert r["perplexity"] == pytest.approx(perplexity(model, chunks, r["k"]), rel=1e-6)
    code, stdout, err = run_cli("eval", "--checkpoint", out, "--text", text, "--noise", "sampled", "--k", "2")
    assert code == 0 and "perplexity" in stdout


def test_train_refuses_bad_options(tmp_path, run_cli):
    for args, named in ((["--slice-width", 2000], "slice_width"), (["--n-head", 3], "d_model"),
                        (["--corpus", tmp_path / "missing"], "missing")):
        code, out, err = run_cli("train", "--out", tmp_path / "m", "--steps", 1, *args)
        assert code == 1 and err.startswith("error: ") and err.count("\n") == 1 and named in err, err
    assert not (tmp_path / "m").exists()


def unigram_nll(blob: bytes) -> float:
    counts, n = Counter(blob), len(blob)
    return -sum(c / n * math.log(c / n) for c in counts.values())


def test_bundled_model_beats_unigram_and_spreads_its_windows():
    model = load_checkpoint(None)
    assert Path(DEFAULT_CHECKPOINT).is_dir() and model.config.slice_width < model.config.ffn_hidden
    blob = data.read_texts(data.corpus_files("validation"))[:8 * model.config.n_positions]
    chunks = data.windows(blob, model.config.n_positions)
    nll = math.log(perplexity(model, chunks, model.config.num_samples))
    assert nll < 0.75 * unigram_nll(blob)
    for layer in router_spread(model, chunks):
        assert layer["union_coverage"] > 0.5 and layer["top_start_share"] < 0.5, layer


def test_doctor_json(run_cli):
    code, out, err = run_cli("doctor", "--json")
    assert code == 0, err
    info = json.loads(out)
    import torch as t
    assert info["torch"]["version"] == t.__version__
    library = info["ort_custom_op_library"]
    assert library is None or Path(library).is_file()
    assert {"onnxruntime", "tensorrt", "polygraphy", "nvcc", "triton"} <= set(info)


def test_spread_term_reopens_collapsed_windows():
    """The training-only spread term's gradient reaches sigma and mu: from a collapsed router
    (tiny sigma, mu deep in the sigmoid's tail) a few steps on it alone raise sigma and widen
    the union of a token's windows."""
    from infmoe_export.model import InfMoEGPT
    from infmoe_export.train import router_entropies

    config = InfMoEConfig(vocab_size=256, n_positions=16, d_model=24, n_layer=2, n_head=2, ffn_hidden=97,
                          slice_width=9, num_samples=4)
    model = InfMoEGPT(config)
    model.reset_parameters(seed=int(torch.randint(0, 2**31, ())))
    with torch.no_grad():
        for block in model.h:
            block.moe.router.sigma.bias.fill_(-6.0)  # softplus(-6) ~ 0.0025
            block.moe.router.mu.bias.fill_(4.0)      # sigmoid'(4) ~ 0.018: starts pile up at the top
    x = torch.randint(0, 256, (3, 16))

    def measure():
        model.eval()
        with torch.no_grad():
            starts = model(x, k=8, return_starts=True).starts
            sigma = torch.nn.functional.softplus(model.h[0].moe.router.sigma.bias).item()
        model.train()
        distinct = torch.stack([torch.tensor([len(set(row.tolist())) for row in s.reshape(-1, 8)]) for s in starts])
        return sigma, distinct.float().mean().item()

    sigma_before, distinct_before = measure()
    optimizer = torch.optim.Adam([p for n, p in model.named_parameters() if ".router." in n], lr=0.3)
    for _ in range(20):
        with router_entropies(model) as entropies:
            model(x, noise="sampled")
        loss = -torch.stack([e.mean() for e in entropies]).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    sigma_after, distinct_after = measure()
    assert len(entropies) == config.n_layer
    assert sigma_after > 10 * sigma_before, (sigma_before, sigma_after)
    assert distinct_after > distinct_before + 2, (distinct_before, distinct_after)


def test_window_union_counts_each_hidden_unit_once():
    from infmoe_export.evaluate import window_union

    r, h = 7, 60
    starts = torch.randint(0, h - r + 1, (50, 5))
    starts[0] = torch.tensor([0, 0, 0, 0, 0])           # all coincide: r
    starts[1] = torch.tensor([h - r, 0, 14, 7, 21])     # disjoint, unsorted: K r
    expected = [len({u for s in row.tolist() for u in range(s, s + r)}) for row in starts]
    assert window_union(starts, r).tolist() == expected
    assert expected[0] == r and expected[1] == 5 * r


def test_stratified_training_noise_puts_one_sample_in_each_stratum():
    """Sample k of every token lies in its own 1/K quantile slice of N(0, 1), the K slices are
    all hit, and within a slice the draw is spread over it (not the deployed midpoint)."""
    from infmoe_export.train import training_noise

    k = 5
    generator = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    eps = training_noise("stratified", (3, 400, k), generator)
    levels = torch.special.ndtr(eps.double())
    stratum = torch.floor(levels * k)
    assert torch.equal(stratum, torch.arange(k, dtype=torch.float64).expand_as(stratum))
    within = levels * k - stratum  # U of each draw
    assert within.min() < 0.05 and within.max() > 0.95 and abs(within.mean().item() - 0.5) < 0.05
    sampled = training_noise("sampled", (3, 400, k), generator)
    assert abs(sampled.mean().item()) < 0.1 and not torch.equal(torch.floor(torch.special.ndtr(sampled.double()) * k), stratum)
    with pytest.raises(InfMoEError, match="training noise"):
        training_noise("quantile", (1, 1, 1), generator)


def test_training_takes_gradients_inside_a_caller_without_them():
    """train_model learns even when its caller has gradients off (torch.no_grad around it)."""
    config = InfMoEConfig(**TINY)
    blob = bytes(range(256)) * 8
    val = data.windows(data.encode(blob[-200:]), config.n_positions)
    with torch.no_grad():
        _, log = train_model(config, data.encode(blob[:-200]), val, steps=3, batch_size=2, lr=1e-2, seed=0,
                             eval_every=3)
    assert len(log) == 3 and all(math.isfinite(r["loss"]) for r in log)
