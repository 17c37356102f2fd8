"""`infmoe-export bench`: latency, throughput and memory per backend, precision and K."""

import json
import sys
import tempfile
from pathlib import Path

import click
import torch
from rich.console import Console

from ..checkpoint import DEFAULT_CHECKPOINT, load_checkpoint, read_config
from ..errors import InfMoEError
from ..export import export_many
from ..files import atomic_write, output_file
from ..options import (THREADS, FiniteFloat, check_forward_memory, choices_from_flags, expert_budgets,
                       export_choice_options, positive_ints)
from ..report.bench import DEFAULT_PAST, check_shapes, run_bench
from ..report.memory import run_memory
from ..report.render import build_report, export_labels, print_summary, validate_report
from ..report.timing import REL_CI, environment
from ..runtimes import registry


@click.command("bench")
@click.option("--checkpoint", type=click.Path(), default=None, help="Checkpoint directory (default: the bundled model).")
@click.option("--model", "model_paths", type=click.Path(), multiple=True,
              help="ONNX model(s) or a directory of per-K models (default: export the checkpoint per K).")
@click.option("--engines", type=click.Path(), default=None, help="Directory of TensorRT engines (`infmoe-export trt`).")
@click.option("--backends", "backend_list", default="torch,ort,ort-a8,ort-fallback,trt", show_default=True)
@click.option("--k", "ks", default=None,
              help="Expert budgets K, comma-separated (default: 1,2,4,8; a conventional MoE: its top_k).")
@click.option("--noise", type=click.Choice(("quantile", "sampled")), default="quantile", show_default=True,
              help="Noise mode of the models exported when no --model is given.")
@export_choice_options(many=True, deployments=("onnxruntime", "portable"))
@click.option("--batch", "batch_list", default="1,4", show_default=True, help="Batch sizes, comma-separated.")
@click.option("--seq", "seq_list", default="1,128", show_default=True,
              help="Sequence lengths: 1 = one decode step with a KV cache of --past tokens, >1 = prefill.")
@click.option("--past", type=click.IntRange(min=1), default=DEFAULT_PAST, show_default=True)
@click.option("--warmup", type=click.IntRange(min=0), default=5, show_default=True)
@click.option("--iters", type=click.IntRange(min=1), default=200, show_default=True,
              help="Timed calls per configuration at most.")
@click.option("--budget", "budget_s", type=FiniteFloat(min=0.01), default=2.0, show_default=True,
              help="Seconds of interleaved timing per configuration at most.")
@click.option("--rel-ci", type=FiniteFloat(min=0.0001), default=REL_CI, show_default=True,
              help="Stop once every median's 95%% interval is within this fraction of it.")
@click.option("--memory", is_flag=True, help="Also measure memory per backend and precision, each in a fresh process.")
@click.option("--threads", type=THREADS, default=None,
              help="Intra-op threads of torch and onnxruntime (default: their own defaults).")
@click.option("--json", "json_path", type=click.Path(), default=None, help="Write the results (report schema) here.")
def bench_command(checkpoint, model_paths, engines, backend_list, ks, noise, deploy, dtype, quantize_other,
                  block_size, activations, kv_cache,
                  batch_list, seq_list, past, warmup, iters, budget_s, rel_ci, memory, threads, json_path):
    """Latency, throughput and memory per backend, precision and K: of the given models, or of the
    checkpoint exported as --for and --dtype say (default: onnxruntime, fp32; the model `run` runs)."""
    backends = registry.parse_backends(backend_list)
    batches, seqs = positive_ints(batch_list, "--batch"), positive_ints(seq_list, "--seq")
    ks = expert_budgets(ks, read_config(checkpoint or DEFAULT_CHECKPOINT))
    if model_paths and any(value is not None for value in (deploy, dtype, quantize_other, block_size, activations,
                                                           kv_cache)):
        raise InfMoEError("--for, --dtype, --quantize-other, --block-size, --activations and --kv-cache choose what to "
                          "export; they cannot be combined with --model")
    choices = [] if model_paths else choices_from_flags(read_config(checkpoint or DEFAULT_CHECKPOINT), deploy, dtype,
                                                        quantize_other, block_size, activations=activations,
                                                        kv_cache=kv_cache)
    inputs = [checkpoint or DEFAULT_CHECKPOINT, *model_paths, engines]
    if json_path:
        output_file(json_path, inputs=inputs)
    torch_model = load_checkpoint(checkpoint)
    check_shapes(torch_model.config, seqs, past)
    check_forward_memory(torch_model.config, max(batches), max(seqs) + past, max(ks))
    if threads:
        torch.set_num_threads(threads)
    console = Console()
    with tempfile.TemporaryDirectory(prefix="infmoe-bench-") as scratch:
        if model_paths:
            models = registry.find_models(model_paths, ks=ks)
            registry.check_models(models, torch_model.config)
        else:
            models = [m for choice in choices for m in export_many(torch_model, Path(scratch) / choice.dtype, ks,
                                                                   (noise,), **choice.options())]
        console.print(f"models: {', '.join(dict.fromkeys(m.io.label for m in models))}", markup=False)
        for note in dict.fromkeys(c.note for c in choices if c.note):
            console.print(f"note: {note}", markup=False)
        engines = Path(engines) if engines else None
        bench = run_bench(torch_model, models, backends=backends, batches=batches, seqs=seqs, past=past,
                          warmup=warmup, iters=iters, budget_s=budget_s, rel_ci=rel_ci, engines=engines,
                          threads=threads)
        memory = run_memory(torch_model, models, backends=backends, checkpoint=checkpoint, past=past, threads=threads,
                            engines=engines) if memory else None
    report = build_report("bench", "infmoe-export " + " ".join(sys.argv[1:]), str(checkpoint or DEFAULT_CHECKPOINT),
                          torch_model.config.to_dict(), environment(threads), bench=bench, memory=memory,
                          export=export_labels(models))
    validate_report(report)
    print_summary(console, report)
    if json_path:
        atomic_write(output_file(json_path, inputs=inputs), json.dumps(report, indent=2, allow_nan=False) + "\n")
        console.print(f"results: {json_path}", markup=False)
