"""`infmoe-export trt`: one TensorRT engine per expert budget K, with the ContinuousSliceFFN plugin."""

from pathlib import Path

import click

from ..checkpoint import DEFAULT_CHECKPOINT, load_checkpoint
from ..errors import InfMoEError
from ..export import export_many
from ..files import locked, output_dir
from ..options import positive_ints
from ..runtimes.tensorrt import build_engines, plan_models, require_tensorrt
from ..runtimes.tensorrt.build import check_precision

DEFAULT_KS = (1, 2, 4, 8)


@click.command("trt")
@click.option("--model", "models", multiple=True, type=click.Path(dir_okay=False),
              help="Exported ONNX model (one fixed K each; repeatable). Default: export from --checkpoint.")
@click.option("--checkpoint", type=click.Path(file_okay=False), default=None,
              help="Checkpoint to export per K when no --model is given (default: the bundled model).")
@click.option("--k", "ks", default=None, help="Expert budgets, e.g. 1,2,4,8 (default: 1,2,4,8, or the models' K).")
@click.option("--out", required=True, type=click.Path(file_okay=False), help="Folder for engines and manifest.json.")
@click.option("--fp16", is_flag=True,
              help="Float16 engines: export the FFN as float16 (given models must be float16 exports).")
@click.option("--timing-cache", type=click.Path(dir_okay=False), default=None,
              help="Timing cache shared by all builds (default: OUT/timing.cache).")
@click.option("--max-batch", default=1, show_default=True, type=int, help="Largest batch the engines accept.")
@click.option("--max-seq", default=None, type=int, help="Longest sequence (default: the model's n_positions).")
@click.option("--with-starts", is_flag=True, help="Export models that also output every layer's window starts.")
@click.option("--jit", is_flag=True, help="Use the plugin's Python (JIT) implementation, for debugging.")
def trt_command(models, checkpoint, ks, out, fp16, timing_cache, max_batch, max_seq, with_starts, jit):
    """Build one TensorRT engine per expert budget K, with the ContinuousSliceFFN plugin."""
    ks = None if ks is None else positive_ints(ks, "--k")
    if max_batch < 1 or (max_seq is not None and max_seq < 1):
        raise InfMoEError("--max-batch and --max-seq must be at least 1")
    if models and checkpoint:
        raise InfMoEError("give either --model or --checkpoint, not both")
    if models and with_starts:
        raise InfMoEError("--with-starts chooses what to export; it cannot be combined with --model")
    planned = plan_models(models, ks) if models else None
    if planned:
        check_precision(planned, fp16)
    require_tensorrt()  # before anything is written
    out = output_dir(out, inputs=[checkpoint or DEFAULT_CHECKPOINT, *models])
    with locked(out):
        if planned is None:
            # The parser must map each node to the plugin, so these models carry no fallback function.
            exported = export_many(load_checkpoint(checkpoint), out / "onnx", ks or list(DEFAULT_KS),
                                   dtype="fp16" if fp16 else "fp32", function=False, with_starts=with_starts)
            planned = {model.k: model for model in exported}
        cache = Path(timing_cache) if timing_cache else out / "timing.cache"
        manifest = build_engines(planned, out, fp16, cache, max_batch, max_seq, jit,
                                 progress=lambda step: click.echo(f"trt: building the engine for {step}", err=True))
    click.echo(f"trt: manifest {manifest}", err=True)
