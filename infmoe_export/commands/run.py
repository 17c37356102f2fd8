"""`infmoe-export run`: generate text in onnxruntime (or a TensorRT engine, --engines), streaming
it; the bundled model is exported once into a cache."""

import codecs
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Optional

import click

from .. import __version__
from ..checkpoint import CONFIG_FILE, DEFAULT_CHECKPOINT, WEIGHTS_FILE, load_checkpoint, read_config
from ..contract import DecoderIO, ExportChoice, ExportedModel
from ..errors import InfMoEError
from ..options import SEED, choices_from_flags, export_choice_options, export_choices
from ..export import DEFAULT_OPSET, export_onnx
from ..files import sha256
from ..runtimes.generate import check_request, generate
from ..runtimes.ort import OrtRunner
from ..verify.validate import validate_onnx


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "infmoe-export"


def cached_export(checkpoint: Optional[Path] = None, k: Optional[int] = None,
                  choice: Optional[ExportChoice] = None) -> ExportedModel:
    """The checkpoint exported as choice says (default: export_choices' default, fp32 for
    onnxruntime), from the cache or exported and validated now.
    Keyed by a hash of the checkpoint files and the options, so a new checkpoint, choice or
    exporter version gets a new entry. An entry is exported and validated in a staging folder and
    renamed into place only then, so an interrupted or failed run never leaves a model in the cache."""
    checkpoint = Path(checkpoint) if checkpoint is not None else DEFAULT_CHECKPOINT
    model = load_checkpoint(checkpoint)  # validates it, and names the problem if it is not one
    choice = choice or export_choices(model.config)[0]
    options = json.dumps(choice.options(), sort_keys=True)
    key = sha256(checkpoint / CONFIG_FILE, checkpoint / WEIGHTS_FILE,
                 prefix=f"{__version__} k={k} opset={DEFAULT_OPSET} {options}".encode())
    entry = cache_dir() / key[:20]
    if not (entry / "model.onnx").is_file():
        why = f"; {choice.note}" if choice.note else ""
        click.echo(f"exporting {checkpoint} ({choice.label}{why}) into the cache {entry} (once)", err=True)
        entry.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{entry.name}.", dir=entry.parent))
        try:
            validate_onnx(model, export_onnx(model, staging / "model.onnx", k=k, **choice.options()).path)
            os.rename(staging, entry)  # fails if another process published it first: keep theirs
        except OSError:
            pass
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return ExportedModel.read(entry / "model.onnx")


def engine_runner(engines: Path, k: Optional[int]):
    """The TrtRunner of the engine for K in an engine folder; K may be left out when it holds one."""
    from ..runtimes.tensorrt import TrtRunner, read_manifest, require_tensorrt, select_engine

    require_tensorrt()
    manifest = read_manifest(engines)
    if k is None:
        built = [entry["k"] for entry in manifest["engines"]]
        if len(built) > 1:
            raise InfMoEError(f"{engines} holds engines for K={', '.join(map(str, built))}: choose one with --k")
        k = built[0]
    entry = select_engine(manifest, k)
    return TrtRunner(DecoderIO.from_metadata(entry["metadata"]), entry, name="trt")


@click.command("run")
@click.option("--model", "model_path", type=click.Path(path_type=Path), default=None,
              help="An exported .onnx (default: the bundled model, exported once into the cache).")
@click.option("--checkpoint", type=click.Path(path_type=Path), default=None,
              help="Without --model: the checkpoint to export (default: the bundled model).")
@click.option("--k", type=int, default=None,
              help="Without --model: the expert budget to export (with --engines: the engine to run).")
@export_choice_options(deployments=("onnxruntime", "portable"))
@click.option("--prompt", required=True, help="The text to continue.")
@click.option("--max-new-tokens", type=int, default=64, show_default=True)
@click.option("--greedy", is_flag=True, help="Always the most likely byte (the default without --temperature/--top-k).")
@click.option("--temperature", type=float, default=None, help="Sample at this temperature.")
@click.option("--top-k", type=int, default=None, help="Sample among the k most likely bytes.")
@click.option("--seed", type=SEED, default=0, show_default=True, help="Seeds sampling and sampled expert noise.")
@click.option("--no-kernel", is_flag=True, help="Run ContinuousSliceFFN on the fallback function.")
@click.option("--engines", type=click.Path(path_type=Path), default=None,
              help="Run a TensorRT engine from this folder (`infmoe-export trt`) instead; --k picks the engine.")
@click.option("--timings", is_flag=True,
              help="Print the prefill's time and the decode steps' median ms/token (95% interval) to stderr.")
def run_command(model_path, checkpoint, k, deploy, dtype, quantize_other, block_size, activations, kv_cache, prompt,
                max_new_tokens, greedy,
                temperature, top_k, seed, no_kernel, engines, timings):
    """Generate text from an ONNX model in onnxruntime (or a TensorRT engine), streaming it as it comes.
    Without --model, the checkpoint exported as --for and --dtype say (default: onnxruntime, fp32),
    once, into a cache."""
    chosen = any(value is not None for value in (deploy, dtype, quantize_other, block_size, activations, kv_cache))
    if greedy and (temperature is not None or top_k is not None):
        raise InfMoEError("--greedy cannot be combined with --temperature or --top-k")
    if k is not None and k < 1:
        raise InfMoEError(f"--k must be a positive integer, got {k}")
    if model_path is not None and (checkpoint is not None or k is not None or chosen):
        raise InfMoEError("--checkpoint, --k, --for, --dtype, --quantize-other, --block-size, --activations and "
                          "--kv-cache choose what to export; they cannot be combined with --model")
    if engines is not None and (model_path is not None or checkpoint is not None or no_kernel or chosen):
        raise InfMoEError("--engines runs a TensorRT engine; it cannot be combined with --model, --checkpoint, "
                          "--no-kernel or the export choice (--for, --dtype, --quantize-other, --block-size, "
                          "--activations, --kv-cache)")
    sampling = temperature is not None or top_k is not None
    temperature = 1.0 if temperature is None else temperature
    # The prompt's own bytes: a byte-level model takes any, UTF-8 or not (click hands over
    # undecodable argument bytes as surrogate escapes; fsencode gives them back).
    prompt_ids = os.fsencode(prompt)
    if engines is not None:
        runner = engine_runner(engines, k)
    elif model_path is not None:
        model = ExportedModel.read(model_path)
    else:
        config = read_config(checkpoint if checkpoint is not None else DEFAULT_CHECKPOINT)
        choice, = choices_from_flags(config, deploy, dtype, quantize_other, block_size, activations=activations,
                                     kv_cache=kv_cache)
        model = cached_export(checkpoint, k, choice)
    if engines is None:
        runner = OrtRunner(model.io, model, kernel=not no_kernel)
    check_request(runner.io, prompt_ids, max_new_tokens, greedy=not sampling, temperature=temperature, top_k=top_k)
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    out = sys.stdout

    def emit(token: int):
        out.write(decoder.decode(bytes([token])))
        out.flush()

    out.write(decoder.decode(prompt_ids))
    seconds = [] if timings else None
    generate(runner, prompt_ids, max_new_tokens, greedy=not sampling, temperature=temperature, top_k=top_k,
             seed=seed, on_token=emit, timings=seconds)
    out.write(decoder.decode(b"", final=True) + "\n")
    out.flush()
    if timings:
        click.echo(timing_line(len(prompt_ids), seconds), err=True)


def timing_line(prompt_tokens: int, seconds: list) -> str:
    """What --timings prints: the prefill of the prompt, then the decode steps' median and its 95%
    interval (report.timing.latency_summary, as `bench` reports a decode step)."""
    from ..report.timing import latency_summary

    line = f"prefill: {prompt_tokens} tokens in {seconds[0] * 1e3:.2f} ms"
    if len(seconds) < 2:
        return line + "; decode: no step"
    decode = latency_summary(seconds[1:])
    return (line + f"; decode: {len(seconds) - 1} steps, median {decode['median']:.3f} ms/token "
            f"[{decode['ci_low']:.3f}, {decode['ci_high']:.3f}], {1e3 / decode['median']:.1f} tokens/s")
