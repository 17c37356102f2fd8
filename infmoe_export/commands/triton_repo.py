"""`infmoe-export triton-repo`: a Triton Inference Server model repository (docs/guide/serving.md)."""

from pathlib import Path

import click

from ..checkpoint import DEFAULT_CHECKPOINT, load_checkpoint, read_config
from ..errors import InfMoEError
from ..options import choices_from_flags, export_choice_options, positive_ints
from ..serving.repository import EXECUTORS, build_repository


@click.command("triton-repo")
@click.option("--out", type=click.Path(path_type=Path), required=True, help="The repository folder to write.")
@click.option("--checkpoint", type=click.Path(path_type=Path), default=None,
              help="The checkpoint (default: the bundled model).")
@click.option("--k", "ks", default="1,2,4,8", show_default=True, help="Expert budgets, one model each.")
@export_choice_options(many=True, deployments=("onnxruntime", "portable"), dtype_names=("--dtype", "--precision"))
@click.option("--engines", type=click.Path(path_type=Path), default=None,
              help="A TensorRT engine folder (`infmoe-export trt`): one TensorRT-backend model per engine.")
@click.option("--mount-path", default=None,
              help="Where the server will see the repository (e.g. /models in a container); the kernel "
                   "library's path in model_operations is written under it (default: OUT's absolute path).")
@click.option("--executor", type=click.Choice(EXECUTORS), default="local", show_default=True,
              help="How the front model runs the per-K models: in its own onnxruntime, or through Triton (BLS).")
@click.option("--no-kernel", is_flag=True, help="Leave the kernel library out (the fallback function runs).")
@click.option("--preferred-batch-sizes", "preferred", default="measure", show_default=True,
              help="The front model's preferred batch sizes: 'measure' (from the batched-decode curve of the first "
                   "--dtype's models, measured now: every size whose tokens/s holds up against the smaller ones) "
                   "or comma-separated sizes up to the max batch size, 16.")
def triton_repo_command(out, checkpoint, ks, deploy, dtype, quantize_other, block_size, activations, kv_cache, engines,
                        mount_path, executor,
                        no_kernel, preferred):
    """Write a Triton model repository: per-K onnxruntime (and TensorRT) models, exported as --for and
    --dtype say (default: onnxruntime, fp32; the model `run` runs), and a decoding front model.
    A request picks the precision with the parameter `precision` (default: the first of fp32, fp16,
    int8, int4 that the repository serves)."""
    k_list = positive_ints(ks, "--k")
    sizes = None if preferred == "measure" else positive_ints(preferred, "--preferred-batch-sizes")
    if mount_path is not None and (not mount_path.startswith("/") or "\n" in mount_path or '"' in mount_path):
        raise InfMoEError("--mount-path must be an absolute path without quotes or newlines")
    source = Path(checkpoint) if checkpoint is not None else DEFAULT_CHECKPOINT
    choices = choices_from_flags(read_config(source), deploy, dtype, quantize_other, block_size,
                                 activations=activations, kv_cache=kv_cache)
    model = load_checkpoint(checkpoint)
    inputs = [source] + ([Path(engines)] if engines is not None else [])
    for note in dict.fromkeys(c.note for c in choices if c.note):
        click.echo(f"note: {note}", err=True)
    result = build_repository(model, out, sorted(set(k_list)), choices, engines=engines,
                              mount_path=mount_path, executor=executor, kernel=not no_kernel, inputs=inputs,
                              preferred_batch_sizes=sizes, progress=lambda text: click.echo(text, err=True))
    for warning in result["warnings"]:
        click.echo(f"warning: {warning}", err=True)
    click.echo(f"wrote {out}: {', '.join(result['models'])} ({', '.join(c.label for c in choices)}); preferred "
               f"batch sizes {', '.join(map(str, result['preferred_batch_sizes']))}")
    click.echo(f"serve it: infmoe-export serve --repo {out}")
