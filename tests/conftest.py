"""Shared fixtures: a tiny odd-shaped config, random (never zero) models and checkpoints of it,
and the CLI run in-process exactly as the console script runs it."""

import os

# Triton kernels run in Triton's CPU interpreter in this test session. The mode is fixed when
# triton is first imported (its own builtins are decorated then), so it is set here, before any
# test module can import it; GPU checks that need compiled kernels run in a subprocess without it.
os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402
from onnx import helper  # noqa: E402

from infmoe_export.checkpoint import save_checkpoint  # noqa: E402
from infmoe_export.cli import main  # noqa: E402
from infmoe_export.model import InfMoEConfig, InfMoEGPT, model_for  # noqa: E402

# Tests use tiny models, and the test machine is shared: one intra-op thread avoids the
# oversubscription that made a 30-step tiny training run 15x slower with two.
torch.set_num_threads(1)

# Odd on purpose: H a prime, r not dividing it, V > 256, head_dim 5.
TINY = dict(vocab_size=259, n_positions=23, d_model=15, n_layer=2, n_head=3, ffn_hidden=37,
            slice_width=11, num_samples=3)



def left_padded(lengths, generator):
    """Rows of random bytes of these lengths as one left-padded batch: (rows, ids, mask, T). The
    pad id (7) is a real byte, so a padded position that leaked into a row would change it."""
    T = max(lengths)
    rows = [torch.randint(0, 259, (n,), generator=generator) for n in lengths]
    ids = torch.full((len(rows), T), 7, dtype=torch.long)
    mask = torch.zeros(len(rows), T, dtype=torch.long)
    for b, row in enumerate(rows):
        ids[b, T - len(row):] = row
        mask[b, T - len(row):] = 1
    return rows, ids, mask, T

@pytest.fixture
def tiny_config():
    return InfMoEConfig(**TINY)


def random_model(config, seed: int = 0) -> InfMoEGPT:
    """A model of config's architecture with every parameter random, biases and LayerNorms
    included, so no term of the forward can hide behind a zero; router weights large enough that
    windows (or tokens' experts) spread over all of H."""
    model = model_for(config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=generator)
            if name.endswith(("ln_1.weight", "ln_2.weight", "ln_f.weight")):
                p.copy_(1 + 0.1 * noise)
            elif ".router." in name:
                p.copy_(noise)
            else:
                p.copy_(0.3 * noise)
    return model.eval()


@pytest.fixture
def make_model():
    """make_model(config=TINY, seed=0, **overrides) -> a random InfMoEGPT in eval mode."""
    def make(config=None, seed=0, **overrides):
        config = config or InfMoEConfig(**{**TINY, **overrides})
        return random_model(config, seed)
    return make


@pytest.fixture
def make_checkpoint(tmp_path, make_model):
    """make_checkpoint(name="ckpt", seed=0, **config overrides) -> directory of a random checkpoint."""
    def make(name="ckpt", seed=0, **overrides):
        return save_checkpoint(make_model(seed=seed, **overrides), tmp_path / name)
    return make


@pytest.fixture
def run_cli(capsys, monkeypatch):
    """run_cli(*args) -> (exit code, stdout, stderr) of `infmoe-export args...`, in-process.

    Any exception other than SystemExit escapes and fails the test: from the console script
    it would be a traceback."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # commands then keep the one thread set above

    def run(*args):
        try:
            main([str(a) for a in args])
            code = 0
        except SystemExit as exit:
            code = exit.code if isinstance(exit.code, int) else (0 if exit.code is None else 1)
        out, err = capsys.readouterr()
        return code, out, err
    return run


@pytest.fixture(scope="module")
def library():
    """The installed onnxruntime kernel library, or a skip that says how to get it."""
    from infmoe_export.runtimes import ort_kernel

    path = ort_kernel.custom_op_library()
    if path is None:
        pytest.skip("the onnxruntime kernel library is not installed (the package build found no C++ "
                    "compiler); reinstall with one: pip install -e .")
    return path


def rerun_forcing_path(test_file: str, path: str, seed: int, select: str = "not each_path") -> None:
    """Run test_file's tests that `select` names (a pytest -k expression; by default all but the
    one calling this) again in a child with INFMOE_PATH=path (the kernel reads the path once per
    process), the same seed; fails with the child's output."""
    import subprocess
    import sys

    if "INFMOE_PATH" in os.environ:
        pytest.skip("already running one path")
    env = dict(os.environ, INFMOE_PATH=path, INFMOE_TEST_SEED=str(seed))
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", test_file,
                           "-k", select], env=env, capture_output=True, text=True)
    assert done.returncode == 0, f"{path}, seed {seed}:\n{done.stdout[-3000:]}{done.stderr[-2000:]}"


def with_attributes(proto, attributes):
    """A one-node model with its node's attributes overridden (None drops one): the kernels'
    bad-attribute tests."""
    node = proto.graph.node[0]
    for name, value in (attributes or {}).items():
        kept = [a for a in node.attribute if a.name != name]
        del node.attribute[:]
        node.attribute.extend(kept + ([] if value is None else [helper.make_attribute(name, value)]))
    return proto


def genai_generate(folder, prompts, new: int, pad: int = 0):
    """onnxruntime-genai's greedy `new` tokens after each prompt of a batch, left-padded with `pad`
    to the longest (genai feeds the pads as tokens: test_interop.py)."""
    import numpy as np
    import onnxruntime_genai as og

    model = og.Model(str(folder))
    params = og.GeneratorParams(model)
    width = max(len(p) for p in prompts)
    params.set_search_options(max_length=width + new, do_sample=False, batch_size=len(prompts))
    generator = og.Generator(model, params)
    generator.append_tokens(np.array([[pad] * (width - len(p)) + list(p) for p in prompts], dtype=np.int32))
    while not generator.is_done():
        generator.generate_next_token()
    return [[int(t) for t in generator.get_sequence(i)][width:] for i in range(len(prompts))]
