"""Checkpoint round trips, and every kind of bad checkpoint or input refused in one line."""

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from infmoe_export.checkpoint import CONFIG_FILE, WEIGHTS_FILE, load_checkpoint, save_checkpoint
from infmoe_export.errors import InfMoEError


def test_round_trip(make_model, tmp_path):
    model = make_model(seed=3)
    path = save_checkpoint(model, tmp_path / "ckpt", metadata={"steps": 5})
    loaded = load_checkpoint(path)
    assert loaded.config == model.config and not loaded.training
    for name, tensor in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    ids = torch.randint(0, 259, (2, 9))
    assert torch.equal(loaded(ids, k=2).logits, model(ids, k=2).logits)
    umask = os.umask(0)
    os.umask(umask)
    assert (path / WEIGHTS_FILE).stat().st_mode & 0o777 == 0o666 & ~umask  # not left private
    # saving again over it replaces it and leaves nothing else in the parent directory
    save_checkpoint(make_model(seed=4), path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    assert not torch.equal(load_checkpoint(path).wte.weight, model.wte.weight)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_files_are_upcast(make_checkpoint, dtype):
    path = make_checkpoint()
    tensors = load_file(str(path / WEIGHTS_FILE))
    save_file({name: t.to(dtype) for name, t in tensors.items()}, str(path / WEIGHTS_FILE))
    model = load_checkpoint(path)
    for name, tensor in model.state_dict().items():
        assert tensor.dtype == torch.float32
        assert torch.equal(tensor, tensors[name].to(dtype).float()), name


def rewrite_weights(path, change):
    tensors = load_file(str(path / WEIGHTS_FILE))
    change(tensors)
    save_file(tensors, str(path / WEIGHTS_FILE))


def rewrite_config(path, change):
    config = json.loads((path / CONFIG_FILE).read_text())
    change(config)
    (path / CONFIG_FILE).write_text(json.dumps(config))


BAD_CHECKPOINTS = {
    "missing tensor": (lambda p: rewrite_weights(p, lambda t: t.pop("h.1.moe.w_out")), "h.1.moe.w_out"),
    "extra tensor": (lambda p: rewrite_weights(p, lambda t: t.update(lm_head=torch.ones(2))), "lm_head"),
    "wrong shape": (lambda p: rewrite_weights(p, lambda t: t.update({"h.0.moe.w_in": torch.ones(36, 15)})),
                    "h.0.moe.w_in"),
    "integer tensor": (lambda p: rewrite_weights(p, lambda t: t.update({"ln_f.bias": torch.ones(15, dtype=torch.int32)})),
                       "ln_f.bias"),
    "slice_width > ffn_hidden": (lambda p: rewrite_config(p, lambda c: c.update(slice_width=38)), "slice_width"),
    "d_model % n_head": (lambda p: rewrite_config(p, lambda c: c.update(n_head=4)), "n_head"),
    "zero num_samples": (lambda p: rewrite_config(p, lambda c: c.update(num_samples=0)), "num_samples"),
    "missing key": (lambda p: rewrite_config(p, lambda c: c.pop("ffn_hidden")), "ffn_hidden"),
    "unknown key": (lambda p: rewrite_config(p, lambda c: c.update(n_experts=8)), "n_experts"),
    "wrong model_type": (lambda p: rewrite_config(p, lambda c: c.update(model_type="gpt2")), "model_type"),
    "config not JSON": (lambda p: (p / CONFIG_FILE).write_text("{not json"), CONFIG_FILE),
    "truncated safetensors": (lambda p: (p / WEIGHTS_FILE).write_bytes((p / WEIGHTS_FILE).read_bytes()[:1000]),
                              WEIGHTS_FILE),
    "missing safetensors": (lambda p: (p / WEIGHTS_FILE).unlink(), WEIGHTS_FILE),
}


@pytest.mark.parametrize("case", sorted(BAD_CHECKPOINTS))
def test_bad_checkpoint_is_refused_in_one_line(case, make_checkpoint, run_cli, tmp_path):
    break_it, named = BAD_CHECKPOINTS[case]
    path = make_checkpoint()
    break_it(path)
    with pytest.raises(InfMoEError, match=named.replace(".", r"\.")):
        load_checkpoint(path)
    text = tmp_path / "text.txt"
    text.write_text("some text to score")
    code, out, err = run_cli("eval", "--checkpoint", path, "--text", text, "--k", "1")
    assert code == 1 and out == ""
    assert err.startswith("error: ") and err.count("\n") == 1 and named in err, err
    assert "Traceback" not in err


def test_not_a_checkpoint(tmp_path, run_cli):
    a_file = tmp_path / "weights.bin"
    a_file.write_bytes(b"\x00" * 10)
    for path in (a_file, tmp_path, tmp_path / "nowhere"):
        code, out, err = run_cli("eval", "--checkpoint", path, "--k", "1")
        assert code == 1 and err.startswith("error: ") and err.count("\n") == 1
        assert "is not a checkpoint" in err and "Traceback" not in err


@pytest.mark.parametrize("ks,named", [("0", "positive integers"), ("2,-1", "positive integers"),
                                      ("two", "--k"), ("", "--k")])
def test_bad_expert_budget(make_checkpoint, run_cli, tmp_path, ks, named):
    text = tmp_path / "text.txt"
    text.write_text("some text")
    code, out, err = run_cli("eval", "--checkpoint", make_checkpoint(), "--text", text, "--k", ks)
    assert code == 1 and err.startswith("error: ") and err.count("\n") == 1 and named in err, err


def test_empty_or_missing_text_file(make_checkpoint, run_cli, tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_bytes(b"")
    one_byte = tmp_path / "one.txt"
    one_byte.write_bytes(b"x")
    for path, named in ((empty, "is empty"), (tmp_path / "missing.txt", "does not exist"), (one_byte, "too short")):
        code, out, err = run_cli("eval", "--checkpoint", make_checkpoint(), "--text", path)
        assert code == 1 and err.startswith("error: ") and err.count("\n") == 1 and named in err, err
        assert "Traceback" not in err
