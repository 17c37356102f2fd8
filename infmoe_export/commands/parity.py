"""`infmoe-export parity`: SPEC §5 parity of exported models in every backend, with reports."""

import sys
from pathlib import Path

import click
from rich.console import Console

from ..checkpoint import DEFAULT_CHECKPOINT, load_checkpoint, read_config
from ..errors import InfMoEError
from ..export import export_many
from ..options import WINDOWS, SEED, FiniteFloat, check_forward_memory, choices_from_flags, export_choice_options, positive_ints
from ..files import locked, output_dir
from ..report.render import build_report, export_labels, print_summary, write_report
from ..report.timing import environment
from ..runtimes import registry
from ..verify.parity import (DEFAULT_ATOL, DEFAULT_MAX_PPL_INCREASE, DEFAULT_MAX_WINDOWS, DEFAULT_MIN_START_AGREEMENT,
                             DEFAULT_MIN_TOP1, DEFAULT_RTOL, BATCH_SIZE, failure_line, run_parity)


@click.command("parity")
@click.option("--checkpoint", type=click.Path(), default=None, help="Checkpoint directory (default: the bundled model).")
@click.option("--model", "model_paths", type=click.Path(), multiple=True,
              help="ONNX model(s) from `infmoe-export onnx`, or a directory of per-K models (repeatable). Default: "
                   "the checkpoint exported as --for and --dtype say, per --k, into OUT/models.")
@export_choice_options(many=True, deployments=("onnxruntime", "portable"))
@click.option("--engines", type=click.Path(), default=None, help="Directory of TensorRT engines (`infmoe-export trt`).")
@click.option("--text", "texts", type=click.Path(), multiple=True,
              help="Text file(s) to run on (default: the stdlib validation split).")
@click.option("--out", type=click.Path(), required=True, help="Directory for report.json / .md / .html.")
@click.option("--k", "ks", default=None,
              help="Only these expert budgets, comma-separated (default: every model given, or the checkpoint's "
                   "num_samples; a conventional MoE's top_k).")
@click.option("--backends", "backend_list", default="ort,ort-a8,ort-fallback,trt", show_default=True,
              help="Backends to compare against the PyTorch reference.")
@click.option("--atol", type=FiniteFloat(min=0), default=DEFAULT_ATOL, show_default=True)
@click.option("--rtol", type=FiniteFloat(min=0), default=DEFAULT_RTOL, show_default=True)
@click.option("--min-start-agreement", type=FiniteFloat(0, 1), default=DEFAULT_MIN_START_AGREEMENT,
              show_default=True, help="Least share of (token, layer, sample) starts that must agree.")
@click.option("--max-ppl-increase", type=FiniteFloat(min=0), default=100 * DEFAULT_MAX_PPL_INCREASE, show_default=True,
              help="Level-2 budget: perplexity increase over the float model, in percent.")
@click.option("--min-top1", type=FiniteFloat(0, 1), default=DEFAULT_MIN_TOP1, show_default=True,
              help="Level-2 budget: least share of tokens whose top-1 agrees with the float model's.")
@click.option("--max-windows", type=WINDOWS, default=DEFAULT_MAX_WINDOWS, show_default=True,
              help="Windows of n_positions tokens to run (kept small: every backend runs every window).")
@click.option("--seed", type=SEED, default=0, show_default=True, help="Seed of the sampled noise.")
def parity_command(checkpoint, model_paths, deploy, dtype, quantize_other, block_size, activations, kv_cache, engines,
                   texts, out, ks,
                   backend_list, atol, rtol, min_start_agreement, max_ppl_increase, min_top1, max_windows, seed):
    """Parity of every backend against the PyTorch reference (SPEC §5; two levels for quantized models, §6):
    of the given models, or of the checkpoint exported as --for and --dtype say (default: onnxruntime,
    fp32; the model `run` runs)."""
    backends = registry.parse_backends(backend_list, allow_torch=False)
    if model_paths and any(value is not None for value in (deploy, dtype, quantize_other, block_size, activations,
                                                           kv_cache)):
        raise InfMoEError("--for, --dtype, --quantize-other, --block-size, --activations and --kv-cache choose what to "
                          "export; they cannot be combined with --model")
    source = checkpoint or DEFAULT_CHECKPOINT
    choices = [] if model_paths else choices_from_flags(read_config(source), deploy, dtype, quantize_other, block_size,
                                                        activations=activations, kv_cache=kv_cache)
    out = output_dir(out, inputs=[source, *model_paths, *texts, engines])
    torch_model = load_checkpoint(checkpoint)
    k_list = positive_ints(ks, "--k") if ks is not None else None
    check_forward_memory(torch_model.config, BATCH_SIZE, torch_model.config.n_positions,
                         max(k_list) if k_list else torch_model.config.default_k)
    console = Console()
    with locked(out):
        if model_paths:
            models = registry.find_models(model_paths, ks=k_list)
            registry.check_models(models, torch_model.config)
        else:  # with their starts: SPEC §5's start agreement needs them
            models = [m for choice in choices
                      for m in export_many(torch_model, out / "models" / choice.dtype,
                                           k_list or [torch_model.config.default_k], with_starts=True,
                                           **choice.options())]
        console.print(f"models: {', '.join(dict.fromkeys(m.io.label for m in models))}", markup=False)
        for note in dict.fromkeys(c.note for c in choices if c.note):
            console.print(f"note: {note}", markup=False)
        parity = run_parity(torch_model, models, backends=backends, engines=Path(engines) if engines else None,
                            texts=texts, max_windows=max_windows, atol=atol, rtol=rtol,
                            min_start_agreement=min_start_agreement, max_ppl_increase=max_ppl_increase / 100,
                            min_top1=min_top1, seed=seed)
        report = build_report("parity", "infmoe-export " + " ".join(sys.argv[1:]), str(source),
                              torch_model.config.to_dict(), environment(), parity=parity,
                              export=export_labels(models))
        paths = write_report(report, out)
    print_summary(console, report)
    console.print(f"report: {paths['html']}", markup=False)
    failure = failure_line(parity)
    if failure:
        raise InfMoEError(failure)
