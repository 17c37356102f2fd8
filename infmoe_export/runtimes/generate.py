"""Text generation with any runner that speaks the exported I/O (TorchRunner, OrtRunner, ...),
and `infmoe-export run`.

Prefill runs the prompt once; every next step feeds one token with present -> past. Tokens
are bytes (SPEC §2): only ids 0..255 are sampled, and the text is streamed through an
incremental UTF-8 decoder, so a character split over tokens prints when it is complete.
"""

import codecs
import contextlib
import hashlib
import os
import sys
from pathlib import Path
from typing import Callable, List, Optional, Sequence

import click
import numpy as np
import torch

from ..errors import InfMoEError

BYTE_VOCAB = 256


def generate(runner, prompt_ids: Sequence[int], max_new_tokens: int = 64, *, greedy: bool = True,
             temperature: float = 1.0, top_k: Optional[int] = None, seed: int = 0,
             on_token: Optional[Callable[[int], None]] = None) -> List[int]:
    """New token ids after prompt_ids. runner has .io (a DecoderIO) and Polygraphy's infer();
    the seed drives both sampling and, for sampled-noise models, expert_noise."""
    io = runner.io
    prompt_ids = [int(i) for i in prompt_ids]
    if not prompt_ids:
        raise InfMoEError("the prompt is empty: give at least one byte")
    limit = io.config.n_positions
    if len(prompt_ids) > limit:
        raise InfMoEError(f"the prompt has {len(prompt_ids)} tokens, more than n_positions ({limit})")
    if not greedy and not temperature > 0:
        raise InfMoEError(f"temperature must be positive, got {temperature}")
    if top_k is not None and top_k < 1:
        raise InfMoEError(f"top-k must be at least 1, got {top_k}")
    generator = torch.Generator().manual_seed(seed)
    ids, new, past, step_ids = list(prompt_ids), [], None, list(prompt_ids)
    present_names = [name.replace("past_key_values", "present") for name in io.past_names]
    with contextlib.nullcontext() if runner.is_active else runner:
        while len(new) < max_new_tokens and len(ids) < limit:
            noise = None
            if io.noise == "sampled":
                noise = torch.randn(1, len(step_ids), io.k, generator=generator).numpy()
            feed = io.feed(np.array([step_ids]), np.ones((1, len(ids)), np.int64), past, noise)
            outputs = runner.infer(feed, check_inputs=False)
            token = _pick(outputs["logits"][0, -1, :BYTE_VOCAB], greedy, temperature, top_k, generator)
            ids.append(token)
            new.append(token)
            if on_token is not None:
                on_token(token)
            if io.past:
                past, step_ids = [outputs[name] for name in present_names], [token]
            else:  # no cache: run the whole sequence again
                step_ids = list(ids)
    return new


def _pick(logits: np.ndarray, greedy: bool, temperature: float, top_k: Optional[int], generator) -> int:
    logits = torch.from_numpy(np.asarray(logits, dtype=np.float32))
    if greedy:
        return int(logits.argmax())
    logits = logits / temperature
    if top_k is not None and top_k < logits.numel():
        cutoff = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < cutoff, float("-inf"))
    return int(torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator))


# ---------------------------------------------------------------------------------------------
# The bundled model, exported once into a cache


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "infmoe-export"


def cached_export(checkpoint: Optional[Path] = None, k: Optional[int] = None) -> Path:
    """The checkpoint exported with default options, from the cache or exported (and validated)
    now. Keyed by a hash of the checkpoint files and the options, so a new checkpoint or
    exporter version gets a new file; export_onnx writes atomically."""
    from .. import __version__
    from ..checkpoint import CONFIG_FILE, DEFAULT_CHECKPOINT, WEIGHTS_FILE, load_checkpoint
    from ..export import DEFAULT_OPSET, export_onnx, validate_onnx

    checkpoint = Path(checkpoint) if checkpoint is not None else DEFAULT_CHECKPOINT
    model = load_checkpoint(checkpoint)  # validates it, and names the problem if it is not one
    digest = hashlib.sha256(f"{__version__} k={k} opset={DEFAULT_OPSET}".encode())
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        with open(checkpoint / name, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                digest.update(chunk)
    path = cache_dir() / digest.hexdigest()[:20] / "model.onnx"
    if not path.is_file():
        click.echo(f"exporting {checkpoint} to {path} (once)", err=True)
        export_onnx(model, path, k=k)
        try:
            validate_onnx(model, path)
        except InfMoEError:
            path.unlink()  # never leave a model that failed validation in the cache
            raise
    return path


@click.command("run")
@click.option("--model", "model_path", type=click.Path(path_type=Path), default=None,
              help="An exported .onnx (default: the bundled model, exported once into the cache).")
@click.option("--checkpoint", type=click.Path(path_type=Path), default=None,
              help="Without --model: the checkpoint to export (default: the bundled model).")
@click.option("--k", type=int, default=None, help="Without --model: the expert budget to export.")
@click.option("--prompt", required=True, help="The text to continue.")
@click.option("--max-new-tokens", type=int, default=64, show_default=True)
@click.option("--greedy", is_flag=True, help="Always the most likely byte (the default without --temperature/--top-k).")
@click.option("--temperature", type=float, default=None, help="Sample at this temperature.")
@click.option("--top-k", type=int, default=None, help="Sample among the k most likely bytes.")
@click.option("--seed", type=int, default=0, show_default=True, help="Seeds sampling and sampled expert noise.")
@click.option("--no-kernel", is_flag=True, help="Run ContinuousSliceFFN on the fallback function.")
def run_command(model_path, checkpoint, k, prompt, max_new_tokens, greedy, temperature, top_k, seed, no_kernel):
    """Generate text from an ONNX model in onnxruntime, streaming it as it comes."""
    from .onnxruntime import OrtRunner

    if greedy and (temperature is not None or top_k is not None):
        raise InfMoEError("--greedy cannot be combined with --temperature or --top-k")
    if max_new_tokens < 0:
        raise InfMoEError(f"--max-new-tokens must be >= 0, got {max_new_tokens}")
    if k is not None and k < 1:
        raise InfMoEError(f"--k must be a positive integer, got {k}")
    if model_path is not None and (checkpoint is not None or k is not None):
        raise InfMoEError("--checkpoint and --k choose what to export; they cannot be combined with --model")
    sampling = temperature is not None or top_k is not None
    path = model_path if model_path is not None else cached_export(checkpoint, k)
    runner = OrtRunner(path, kernel=not no_kernel)
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    out = sys.stdout

    def emit(token: int):
        out.write(decoder.decode(bytes([token])))
        out.flush()

    out.write(prompt)
    generate(runner, prompt.encode("utf-8"), max_new_tokens, greedy=not sampling,
             temperature=1.0 if temperature is None else temperature, top_k=top_k, seed=seed, on_token=emit)
    out.write(decoder.decode(b"", final=True) + "\n")
    out.flush()
