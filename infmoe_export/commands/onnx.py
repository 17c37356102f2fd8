"""`infmoe-export onnx`: export a checkpoint, then validate it in onnxruntime (on by default)."""

import dataclasses
import time
from pathlib import Path

import click

from ..checkpoint import CONFIG_FILE, DEFAULT_CHECKPOINT, WEIGHTS_FILE, load_checkpoint, read_config
from ..contract import DEFAULT_DEPLOYMENT, DecoderIO
from ..errors import InfMoEError
from ..files import locked, output_dir, output_file, staged_dir
from ..export import DEFAULT_OPSET, QDQ_OPSET, export_onnx
from ..model import NOISE_MODES
from ..options import CHOICES_TABLE, choices_from_flags, export_choice_options
from ..runtimes import ort_kernel
from ..verify.validate import validate_onnx


HELP = f"""Export a checkpoint to ONNX with one ∞-MoE expert op node per layer (a conventional
MoE checkpoint: one onnxruntime MoE / QMoE node per layer), and validate it in onnxruntime against
PyTorch. --for names the runtime and --dtype the weights; the model is the fastest one for that
runtime:

{CHOICES_TABLE}"""


@click.command("onnx", help=HELP)
@click.option("--checkpoint", type=click.Path(path_type=Path), default=None,
              help="Checkpoint directory (default: the bundled model).")
@click.option("--out", type=click.Path(path_type=Path), required=True,
              help="A .onnx file, or a folder (any other name) in Optimum's layout for Hugging Face clients and "
                   "onnxruntime-genai: model.onnx, config.json, tokenizer.json, genai_config.json "
                   "(docs/guide/interop.md).")
@click.option("--k", type=int, default=None,
              help="Expert budget K (default: the checkpoint's num_samples; a conventional MoE has only its top_k).")
@click.option("--noise", type=click.Choice(NOISE_MODES), default="quantile", show_default=True)
@click.option("--no-past", is_flag=True, help="No KV cache: input_ids + attention_mask -> logits.")
@click.option("--opset", type=int, default=None,
              help=f"ONNX opset (default: {DEFAULT_OPSET}; {QDQ_OPSET} where int8 / int4 matrices are "
                   "DequantizeLinear, which needs it).")
@export_choice_options(target=True)
@click.option("--no-function", is_flag=True, help="Leave out the fallback function (TensorRT plugin models).")
@click.option("--with-starts", is_flag=True, help="Add outputs expert_starts.{i} [batch, sequence, K].")
@click.option("--atol", type=float, default=None,
              help="Validation tolerance (default: 1e-4 fp32, int8, int4 (against the dequantized weights), 5e-2 fp16; "
                   "at least 1e-3 with a float16 KV cache).")
@click.option("--no-validate", is_flag=True, help="Skip the onnxruntime-vs-PyTorch check.")
def onnx_command(checkpoint, out, k, noise, no_past, opset, deploy, dtype, quantize_other, block_size, activations,
                 kv_cache, target,
                 no_function, with_starts, atol, no_validate):
    if k is not None and k < 1:
        raise InfMoEError(f"--k must be a positive integer, got {k}")
    source = Path(checkpoint) if checkpoint is not None else DEFAULT_CHECKPOINT
    config = read_config(source)  # its model_type picks the export (export_onnx), checked before any work:
    DecoderIO(config, config.default_k if k is None else k, noise, dtype=dtype or "fp32", target=target or deploy or
              DEFAULT_DEPLOYMENT)
    choice, = choices_from_flags(config, deploy, dtype, quantize_other, block_size, target, activations=activations,
                                 kv_cache=kv_cache)
    if no_past and kv_cache == "float16":
        raise InfMoEError("--kv-cache float16 applies to the KV cache, and --no-past exports none")
    if no_past:
        choice = dataclasses.replace(choice, kv_cache="float32")  # no cache: its default does not apply
    if atol is not None and not atol > 0:
        raise InfMoEError(f"--atol must be positive, got {atol}")
    if no_function and not no_validate:
        # Without the function only the compiled kernel can run the model.
        if ort_kernel.custom_op_library() is None:
            raise InfMoEError("--no-function models run only with the onnxruntime kernel, which is not installed; "
                              "install it (docs/guide/onnxruntime.md) or pass --no-validate")
    if out.suffix.lower() != ".onnx":  # a folder: staged beside it, published when complete
        _export_folder(output_dir(out, inputs=[source]), checkpoint, k, noise, no_past, opset, choice,
                       no_function, with_starts, atol, no_validate)
        return
    output_file(out, inputs=[source / CONFIG_FILE, source / WEIGHTS_FILE])
    model = load_checkpoint(checkpoint)
    start = time.perf_counter()
    exported = export_onnx(model, out, k=k, noise=noise, past=not no_past, opset=opset, **choice.options(),
                           function=not no_function, with_starts=with_starts)
    path = exported.path
    size = sum(p.stat().st_size for p in (path, path.with_name(path.name + ".data")) if p.exists())
    click.echo(f"exported {path} ({choice.label}, {size / 1e6:.1f} MB) in {time.perf_counter() - start:.1f} s",
               err=True)
    _note(choice)
    if no_validate:
        return
    from rich.console import Console

    report = validate_onnx(model, exported, atol=atol, raise_on_failure=False)
    Console(stderr=True, width=120).print(report.table())
    if not report.passed:
        raise InfMoEError(f"validation of {path} failed (file kept): {report.problems[0]}")
    click.echo(f"validated {path}: all outputs within atol {report.atol:g}", err=True)


def _note(choice):
    if choice.note:
        click.echo(f"note: {choice.note}", err=True)


def _export_folder(out, checkpoint, k, noise, no_past, opset, choice, no_function, with_starts, atol,
                   no_validate):
    """`--out DIR`: model.onnx and the clients' files into a staging folder, validated, then
    published to out (published on a failed validation too, like the file: it is complete and
    loadable, and the error names it)."""
    from ..export.hf_folder import MODEL_FILE, client_limitations, write_hf_folder

    model = load_checkpoint(checkpoint)
    start = time.perf_counter()
    report = None
    with locked(out), staged_dir(out) as staging:
        exported = export_onnx(model, staging / MODEL_FILE, k=k, noise=noise, past=not no_past, opset=opset,
                               **choice.options(), function=not no_function, with_starts=with_starts)
        write_hf_folder(staging, exported, kernel_library=ort_kernel.custom_op_library() if no_function else None)
        if not no_validate:
            from rich.console import Console

            report = validate_onnx(model, exported, atol=atol, raise_on_failure=False)
            Console(stderr=True, width=120).print(report.table())
    size = sum(p.stat().st_size for p in out.iterdir() if p.is_file())
    click.echo(f"exported {out}/ ({choice.label}, {size / 1e6:.1f} MB) in {time.perf_counter() - start:.1f} s",
               err=True)
    _note(choice)
    for note in client_limitations(exported):
        click.echo(f"note: {note}", err=True)
    if report is not None:
        if not report.passed:
            raise InfMoEError(f"validation of {out / MODEL_FILE} failed (folder kept): {report.problems[0]}")
        click.echo(f"validated {out / MODEL_FILE}: all outputs within atol {report.atol:g}", err=True)
