"""`infmoe-export pipeline`, the main job: checkpoint → one ONNX model per precision, K and noise
mode → validation (with the installed kernel, else the fallback function) → TensorRT engines
(when TensorRT is installed) → baselines → parity → latency → memory → reports.

Every model is exported with its expert_starts outputs (SPEC §5's start agreement needs them),
in both noise modes, so that the trade-off shows perplexity over K for each. Latency is measured
on the quantile models (the deployment mode) at every batch and sequence length, and on the
sampled ones at batch-1 decode only: the two graphs differ by one input, so that is enough to
show it costs nothing and keeps the job short. The baselines are timed with the quantile models,
in the same interleaved loop.
"""

import os
import sys
import time
from pathlib import Path

import click

import torch
from rich.console import Console

from ..checkpoint import DEFAULT_CHECKPOINT, load_checkpoint
from ..errors import InfMoEError
from ..export import export_many
from ..model import NOISE_MODES
from ..files import locked, output_dir, staged_dir
from ..options import QUANTIZE_OTHER_HELP, THREADS, FiniteFloat, check_forward_memory, positive_ints
from ..quant import DEFAULT_BLOCK_SIZE
from ..report.baselines import baseline_paths, prepare_baselines
from ..report.bench import DEFAULT_PAST, check_block_size_option, check_quantize_other, export_options, run_bench
from ..report.memory import run_memory
from ..report.render import build_report, print_summary, write_report
from ..report.timing import REL_CI, environment
from ..runtimes import ort_kernel
from ..runtimes.tensorrt import build_engines, tensorrt_problem
from ..verify.parity import DEFAULT_MAX_PPL_INCREASE, DEFAULT_MIN_TOP1, failure_line, run_parity
from ..verify.validate import validate_onnx
from ..contract import QUANTIZE_OTHER
from .trt import precision_list

DEFAULT_OUT = Path("runs") / "pipeline"
BATCHES, PREFILL = (1, 4), 128
BUDGET_S = 1.5  # seconds of interleaved rounds per latency figure at most, so the whole job stays short
BACKENDS = ["torch", "ort", "ort-fallback", "trt"]
DEFAULT_PRECISIONS = "fp32,int8,int4"  # the edge precisions of SPEC §6; fp16 on request


class Stages:
    """A rich progress bar per stage, and the report's record of each stage."""

    def __init__(self, console):
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self.console = console
        self.progress = Progress(TextColumn("{task.fields[stage]:<9}"), BarColumn(bar_width=24),
                                 MofNCompleteColumn(), TimeElapsedColumn(), TextColumn("{task.description}",
                                                                                       markup=False),
                                 console=console)
        self.records = []

    def __enter__(self):
        self.progress.start()
        return self

    def __exit__(self, *exc):
        self.progress.stop()
        return False

    def run(self, name: str, total: int, work):
        """Run work(advance) where advance(description) moves this stage's bar by one item."""
        task = self.progress.add_task("", total=total, stage=name)
        started = time.perf_counter()
        first = [True]

        def advance(description: str = ""):
            if not first[0]:
                self.progress.advance(task)
            first[0] = False
            self.progress.update(task, description=description)

        try:
            status, note = work(advance)
        except InfMoEError as error:
            self.records.append({"name": name, "status": "failed", "seconds": time.perf_counter() - started,
                                 "note": str(error)})
            raise
        self.progress.update(task, completed=total, description=note or "")
        self.records.append({"name": name, "status": status, "seconds": time.perf_counter() - started, "note": note})
        if note:
            self.progress.console.print(f"{name}: {note}", markup=False, highlight=False)


@click.command("pipeline")
@click.option("--checkpoint", type=click.Path(), default=None, help="Checkpoint directory (default: the bundled model).")
@click.option("--out", type=click.Path(), default=str(DEFAULT_OUT), show_default=True,
              help="Directory for the models, engines and report.html / report.md / report.json.")
@click.option("--k", "ks", default="1,2,4,8", show_default=True, help="Expert budgets K, comma-separated.")
@click.option("--noise", "noise_list", default=",".join(NOISE_MODES), show_default=True,
              help="Noise modes to export and compare, comma-separated.")
@click.option("--max-windows", type=click.IntRange(min=1), default=8, show_default=True,
              help="Windows of n_positions tokens of validation text for parity.")
@click.option("--dtype", "dtype_list", default=DEFAULT_PRECISIONS, show_default=True,
              help="Precisions of the expert weights, comma-separated (fp32, fp16, int8, int4).")
@click.option("--block-size", type=click.IntRange(min=1), default=DEFAULT_BLOCK_SIZE, show_default=True,
              help="Quantization block size of int8 / int4 (SPEC §6).")
@click.option("--quantize-other", type=click.Choice(QUANTIZE_OTHER), default="none", show_default=True,
              help=QUANTIZE_OTHER_HELP)
@click.option("--baseline", "baselines", type=click.Path(), multiple=True,
              help="Baseline checkpoint(s) drawn as reference points (default: the bundled dense baselines, if present).")
@click.option("--no-baselines", is_flag=True, help="No baselines, not even the bundled ones.")
@click.option("--max-ppl-increase", type=FiniteFloat(min=0), default=100 * DEFAULT_MAX_PPL_INCREASE, show_default=True,
              help="Level-2 budget: perplexity increase over the float model, in percent.")
@click.option("--min-top1", type=click.FloatRange(0, 1), default=DEFAULT_MIN_TOP1, show_default=True,
              help="Level-2 budget: least share of tokens whose top-1 agrees with the float model's.")
@click.option("--iters", type=click.IntRange(min=1), default=200, show_default=True,
              help="Timed calls per latency figure at most.")
@click.option("--warmup", type=click.IntRange(min=0), default=2, show_default=True)
@click.option("--budget", "budget_s", type=FiniteFloat(min=0.01), default=BUDGET_S, show_default=True,
              help="Seconds of interleaved timing per latency figure at most.")
@click.option("--threads", type=THREADS, default=None,
              help="Intra-op threads of torch and onnxruntime for latency (default: their own defaults).")
def pipeline_command(checkpoint, out, ks, noise_list, max_windows, dtype_list, block_size, quantize_other, baselines,
                     no_baselines, max_ppl_increase, min_top1, iters, warmup, budget_s, threads):
    """The main job: export, validate, parity, latency, memory, reports."""
    ks = positive_ints(ks, "--k")
    noises = [n.strip() for n in noise_list.split(",") if n.strip()]
    if not noises or any(n not in NOISE_MODES for n in noises):
        raise InfMoEError(f"--noise must be a comma-separated subset of {', '.join(NOISE_MODES)}, got {noise_list!r}")
    dtypes = precision_list(dtype_list)
    check_block_size_option(dtypes, block_size)
    check_quantize_other(dtypes, quantize_other)
    baselines = baseline_paths(baselines, bundled=not no_baselines)
    torch_model = load_checkpoint(checkpoint)
    check_forward_memory(torch_model.config, max(BATCHES), torch_model.config.n_positions, max(ks))
    out = output_dir(out, inputs=[checkpoint or DEFAULT_CHECKPOINT, *baselines])
    if threads:
        torch.set_num_threads(threads)
    console = Console()
    # The run is staged beside --out and published over it at the end (also when parity fails:
    # the report says so); a run that stops early leaves the previous one whole.
    with locked(out), staged_dir(out) as work:
        settings = dict(ks=ks, noises=noises, dtypes=dtypes, block_size=block_size, quantize_other=quantize_other,
                        baselines=baselines, max_windows=max_windows, max_ppl_increase=max_ppl_increase / 100,
                        min_top1=min_top1, iters=iters, warmup=warmup, budget_s=budget_s, threads=threads)
        paths, failure = run_stages(console, work, torch_model, checkpoint, **settings)
    console.print(f"report: {out / paths['html'].name} (also {paths['markdown'].name}, {paths['json'].name})",
                  markup=False)
    if failure:
        raise InfMoEError(failure)


def run_stages(console, work: Path, torch_model, checkpoint, *, ks, noises, dtypes, block_size, quantize_other,
               baselines, max_windows, max_ppl_increase, min_top1, iters, warmup, budget_s, threads):
    """Every stage into the folder work; returns the report's paths and the parity failure line."""
    models_dir = work / "models"
    models = []
    engines = None
    kernel = ort_kernel.custom_op_library() is not None
    n = torch_model.config.n_positions
    past = min(DEFAULT_PAST, n - 1)  # a cache of 128 and a prefill of 128, or as long as the model allows

    with Stages(console) as stages:
        def export(advance):
            for dtype in dtypes:  # one folder per precision: models/fp32/model_k1_quantile_fp32.onnx
                models.extend(export_many(torch_model, models_dir / dtype, ks, noises, with_starts=True,
                                          progress=lambda d: advance(f"{dtype} {d}"),
                                          **export_options(dtype, block_size, quantize_other)))
            return "ok", f"{len(models)} models in {models_dir}"

        def validate(advance):
            for model in models:
                advance(f"{model.io.dtype}/{model.path.name}")
                validate_onnx(torch_model, model, kernel=kernel)
            if kernel:
                return "ok", None
            return "ok", ("the onnxruntime kernel is not installed: validated on the fallback function, "
                          "the ort backend is skipped (docs/onnxruntime-kernel.md)")

        def tensorrt(advance):
            nonlocal engines
            advance("")
            problem = tensorrt_problem()
            if problem:
                return "skipped", f"{problem}; no engines built"
            advance("exporting without the fallback function")
            folder = work / "engines"
            planned = {(m.k, dtype): m for dtype in dtypes
                       for m in export_many(torch_model, folder / "onnx" / dtype, ks, function=False, with_starts=True,
                                            target="tensorrt",
                                            **export_options(dtype, block_size, quantize_other))}
            advance("building engines")
            engines = build_engines(planned, folder, folder / "timing.cache", max(BATCHES), None, False)
            return "ok", f"engines in {engines}"

        def baseline(advance):
            nonlocal timed_baselines, baseline_facts
            if not baselines:
                return "skipped", "no baseline checkpoints (--baseline CKPT; none bundled)"
            advance(", ".join(p.name for p in baselines))
            timed_baselines, baseline_facts = prepare_baselines(baselines, work / "baselines", max_windows=max_windows)
            return "ok", None

        def parity(advance):
            nonlocal parity_section
            parity_section = run_parity(torch_model, models, backends=["ort", "ort-fallback", "trt"],
                                        engines=engines, max_windows=max_windows, max_ppl_increase=max_ppl_increase,
                                        min_top1=min_top1, progress=advance)
            return ("failed" if failure_line(parity_section) else "ok"), None

        def latency(advance):
            nonlocal bench_section
            common = dict(backends=BACKENDS, warmup=warmup, iters=iters, budget_s=budget_s, rel_ci=REL_CI, past=past,
                          engines=engines, threads=threads, progress=advance)
            quantile = run_bench(torch_model, [m for m in models if m.noise == "quantile"], batches=BATCHES,
                                 seqs=(1, min(PREFILL, n)), baselines=timed_baselines, **common)
            sampled = run_bench(torch_model, [m for m in models if m.noise == "sampled"], batches=(1,), seqs=(1,),
                                **common)
            bench_section = {**quantile, "results": quantile["results"] + sampled["results"]}
            return "ok", None

        def memory(advance):
            nonlocal memory_section
            memory_section = run_memory(torch_model, models, backends=BACKENDS, checkpoint=checkpoint, past=past,
                                        threads=threads, engines=engines, progress=advance)
            return "ok", None

        parity_section = bench_section = memory_section = None
        timed_baselines, baseline_facts = [], []
        n_models = len(dtypes) * len(ks) * len(noises)
        stages.run("export", n_models, export)
        stages.run("validate", n_models, validate)
        stages.run("tensorrt", 2, tensorrt)
        stages.run("baselines", 1, baseline)
        stages.run("parity", n_models, parity)
        stages.run("latency", len(BATCHES) * 2 + 1, latency)
        stages.run("memory", len(dtypes) * len(BACKENDS), memory)

    notes = [r["note"] for r in stages.records if r["status"] == "skipped"]
    for row in parity_section["results"]:  # paths inside the published folder, not the staging one
        row["model"] = os.path.relpath(row["model"], work)
    report = build_report("pipeline", "infmoe-export " + " ".join(sys.argv[1:]), str(checkpoint or DEFAULT_CHECKPOINT),
                          torch_model.config.to_dict(), environment(threads), parity=parity_section, bench=bench_section,
                          memory=memory_section, baselines=baseline_facts, stages=stages.records, notes=notes)
    paths = write_report(report, work)
    print_summary(console, report)
    return paths, failure_line(parity_section)
