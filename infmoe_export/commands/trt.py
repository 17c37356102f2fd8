"""`infmoe-export trt`: one TensorRT engine per expert budget K, with the ContinuousSliceFFN plugin."""

from pathlib import Path

import click

from ..checkpoint import load_checkpoint
from ..errors import InfMoEError
from ..export import export_many
from ..runtimes.tensorrt import DEFAULT_KS, build_engines, parse_ks, plan_models, require_tensorrt


@click.command("trt")
@click.option("--model", "models", multiple=True, type=click.Path(dir_okay=False),
              help="Exported ONNX model (one fixed K each; repeatable). Default: export from --checkpoint.")
@click.option("--checkpoint", type=click.Path(file_okay=False), default=None,
              help="Checkpoint to export per K when no --model is given (default: the bundled model).")
@click.option("--k", "ks", default=None, help="Expert budgets, e.g. 1,2,4,8 (default: 1,2,4,8, or the models' K).")
@click.option("--out", required=True, type=click.Path(file_okay=False), help="Folder for engines and manifest.json.")
@click.option("--fp16", is_flag=True, help="Let TensorRT use float16 (and export float16 models).")
@click.option("--timing-cache", type=click.Path(dir_okay=False), default=None,
              help="Timing cache shared by all builds (default: OUT/timing.cache).")
@click.option("--max-batch", default=1, show_default=True, type=int, help="Largest batch the engines accept.")
@click.option("--max-seq", default=None, type=int, help="Longest sequence (default: the model's n_positions).")
@click.option("--with-starts", is_flag=True, help="Export models that also output every layer's window starts.")
@click.option("--jit", is_flag=True, help="Use the plugin's Python (JIT) implementation, for debugging.")
def trt_command(models, checkpoint, ks, out, fp16, timing_cache, max_batch, max_seq, with_starts, jit):
    """Build one TensorRT engine per expert budget K, with the ContinuousSliceFFN plugin."""
    ks = parse_ks(ks)
    if max_batch < 1 or (max_seq is not None and max_seq < 1):
        raise InfMoEError("--max-batch and --max-seq must be at least 1")
    if models and checkpoint:
        raise InfMoEError("give either --model or --checkpoint, not both")
    planned = plan_models(models, ks) if models else None
    require_tensorrt()
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise InfMoEError(f"--out {out} exists and is not a directory")
    out.mkdir(parents=True, exist_ok=True)
    if planned is None:
        # The parser must map each node to the plugin, so these models carry no fallback function.
        exported = export_many(load_checkpoint(checkpoint), out / "onnx", ks or list(DEFAULT_KS),
                               dtype="fp16" if fp16 else "fp32", function=False, with_starts=with_starts)
        planned = {model.k: model for model in exported}
    cache = Path(timing_cache) if timing_cache else out / "timing.cache"
    manifest = build_engines(planned, out, fp16, cache, max_batch, max_seq, jit)
    click.echo(f"trt: manifest {manifest}", err=True)

