"""`infmoe-export trt`: one TensorRT engine per expert budget K and precision, with the
ContinuousSliceFFN / QContinuousSliceFFN plugins."""

from pathlib import Path

import click

from ..checkpoint import DEFAULT_CHECKPOINT, load_checkpoint
from ..errors import InfMoEError
from ..export import export_many
from ..files import locked, output_dir
from ..options import positive_ints, precision_list
from ..quant import BITS, DEFAULT_BLOCK_SIZE, check_block_size
from ..runtimes.tensorrt import build_engines, plan_models, require_tensorrt

DEFAULT_KS = (1, 2, 4, 8)


@click.command("trt")
@click.option("--model", "models", multiple=True, type=click.Path(dir_okay=False),
              help="Exported ONNX model (one fixed K and precision each; repeatable). Default: export from --checkpoint.")
@click.option("--checkpoint", type=click.Path(file_okay=False), default=None,
              help="Checkpoint to export per K and precision when no --model is given (default: the bundled model).")
@click.option("--k", "ks", default=None, help="Expert budgets, e.g. 1,2,4,8 (default: 1,2,4,8, or the models' K).")
@click.option("--dtype", "dtypes", default=None,
              help="Precisions of the expert weights, e.g. fp32,int8,int4 (fp32|fp16|int8|int4; default: fp32, "
                   "or the models' precisions). One engine per K and precision.")
@click.option("--block-size", type=int, default=None,
              help=f"Quantization block size of int8 / int4 exports (default {DEFAULT_BLOCK_SIZE}).")
@click.option("--out", required=True, type=click.Path(file_okay=False), help="Folder for engines and manifest.json.")
@click.option("--timing-cache", type=click.Path(dir_okay=False), default=None,
              help="Timing cache shared by all builds (default: OUT/timing.cache).")
@click.option("--max-batch", default=1, show_default=True, type=int, help="Largest batch the engines accept.")
@click.option("--max-seq", default=None, type=int, help="Longest sequence (default: the model's n_positions).")
@click.option("--with-starts", is_flag=True, help="Export models that also output every layer's window starts.")
@click.option("--jit", is_flag=True, help="Use the plugin's Python (JIT) implementation, for debugging.")
def trt_command(models, checkpoint, ks, dtypes, block_size, out, timing_cache, max_batch, max_seq, with_starts, jit):
    """Build one TensorRT engine per expert budget K and precision, with the ContinuousSliceFFN plugins."""
    ks = None if ks is None else positive_ints(ks, "--k")
    dtypes = None if dtypes is None else precision_list(dtypes)
    if max_batch < 1 or (max_seq is not None and max_seq < 1):
        raise InfMoEError("--max-batch and --max-seq must be at least 1")
    if models and checkpoint:
        raise InfMoEError("give either --model or --checkpoint, not both")
    for flag, given in (("--with-starts", with_starts), ("--block-size", block_size is not None)):
        if models and given:
            raise InfMoEError(f"{flag} chooses what to export; it cannot be combined with --model")
    if block_size is not None:
        if not set(dtypes or []) & set(BITS):
            raise InfMoEError("--block-size applies to int8 / int4 exports: add --dtype int8 or int4")
        try:
            check_block_size(block_size)
        except InfMoEError as error:
            raise InfMoEError(f"--block-size: {error}") from None
    planned = plan_models(models, ks, dtypes) if models else None
    require_tensorrt()  # before anything is written
    out = output_dir(out, inputs=[checkpoint or DEFAULT_CHECKPOINT, *models])
    with locked(out):
        if planned is None:
            # The parser must map each node to the plugin, so these models carry no fallback function.
            source, planned = load_checkpoint(checkpoint), {}
            for dtype in dtypes or ["fp32"]:
                exported = export_many(source, out / "onnx" / dtype, ks or list(DEFAULT_KS), dtype=dtype,
                                       block_size=block_size or DEFAULT_BLOCK_SIZE, function=False,
                                       with_starts=with_starts, target="tensorrt")
                planned.update({(model.k, dtype): model for model in exported})
        cache = Path(timing_cache) if timing_cache else out / "timing.cache"
        manifest = build_engines(planned, out, cache, max_batch, max_seq, jit,
                                 progress=lambda step: click.echo(f"trt: building the engine for {step}", err=True))
    click.echo(f"trt: manifest {manifest}", err=True)
