"""`infmoe-export triton-repo`: a Triton Inference Server model repository (docs/serving.md)."""

from pathlib import Path

import click

from ..checkpoint import DEFAULT_CHECKPOINT, load_checkpoint
from ..errors import InfMoEError
from ..options import positive_ints
from ..serving.repository import EXECUTORS, build_repository


@click.command("triton-repo")
@click.option("--out", type=click.Path(path_type=Path), required=True, help="The repository folder to write.")
@click.option("--checkpoint", type=click.Path(path_type=Path), default=None,
              help="The checkpoint (default: the bundled model).")
@click.option("--k", "ks", default="1,2,4,8", show_default=True, help="Expert budgets, one model each.")
@click.option("--precision", "precisions", default="fp32", show_default=True,
              help="fp32, fp16 (expert part in float16) or both: fp32,fp16.")
@click.option("--engines", type=click.Path(path_type=Path), default=None,
              help="A TensorRT engine folder (`infmoe-export trt`): one TensorRT-backend model per engine.")
@click.option("--mount-path", default=None,
              help="Where the server will see the repository (e.g. /models in a container); the kernel "
                   "library's path in model_operations is written under it (default: OUT's absolute path).")
@click.option("--executor", type=click.Choice(EXECUTORS), default="local", show_default=True,
              help="How the front model runs the per-K models: in its own onnxruntime, or through Triton (BLS).")
@click.option("--no-kernel", is_flag=True, help="Leave the kernel library out (the fallback function runs).")
def triton_repo_command(out, checkpoint, ks, precisions, engines, mount_path, executor, no_kernel):
    """Write a Triton model repository: per-K onnxruntime (and TensorRT) models and a decoding front model."""
    k_list = positive_ints(ks, "--k")
    precision_list = [p.strip() for p in precisions.split(",") if p.strip()]
    if not precision_list:
        raise InfMoEError("--precision needs at least one of fp32, fp16")
    if mount_path is not None and (not mount_path.startswith("/") or "\n" in mount_path or '"' in mount_path):
        raise InfMoEError("--mount-path must be an absolute path without quotes or newlines")
    source = Path(checkpoint) if checkpoint is not None else DEFAULT_CHECKPOINT
    model = load_checkpoint(checkpoint)
    inputs = [source] + ([Path(engines)] if engines is not None else [])
    result = build_repository(model, out, sorted(set(k_list)), list(dict.fromkeys(precision_list)), engines=engines,
                              mount_path=mount_path, executor=executor, kernel=not no_kernel, inputs=inputs,
                              progress=lambda text: click.echo(text, err=True))
    for warning in result["warnings"]:
        click.echo(f"warning: {warning}", err=True)
    click.echo(f"wrote {out}: {', '.join(result['models'])}")
    click.echo(f"serve it: infmoe-export serve --repo {out}")
