"""`infmoe-export pipeline`, the main job: checkpoint → one ONNX model per precision, K and noise
mode, exported as the deployment choice says (the graph `run` executes) → validation (with the
installed kernel, else the fallback function) → TensorRT engines (when TensorRT is installed) →
baselines → parity → latency → memory → reports.

By default a quick tour, a first verdict within two minutes on a small CPU: the deployed artifact
at fp32 and int4, K = 1, 2, 8, quantile noise (the deployment mode), parity and latency on the
deployed backend alone, on half the parity text. `--full` runs the whole matrix: every precision,
K 1, 2, 4, 8, both noise modes, every backend, TensorRT, the baselines and memory. Explicit lists
override either.

Every model is exported with its expert_starts outputs (SPEC §5's start agreement needs them).
Latency is measured on the quantile models at every batch and sequence length, and on the
sampled ones at batch-1 decode only: the two graphs differ by one input, so that is enough to
show it costs nothing and keeps the job short. The baselines are timed with the quantile models,
in the same interleaved loop.

The verdict and the exit status are level 1's: whether each backend computes what the spec says.
A precision whose only shortfall is level 2 (it costs more accuracy against the float model than
--max-ppl-increase / --min-top1 allow) is a trade-off, not a fault: the report names it over the
accuracy budget and the recommendation leaves it out, but the run passes.
"""

import contextlib
import os
import sys
import time
from pathlib import Path
from typing import NamedTuple, Sequence

import click

import torch
from rich.console import Console

from ..checkpoint import DEFAULT_CHECKPOINT, load_checkpoint, read_config
from ..errors import InfMoEError, raise_if_interrupted
from ..export import export_many
from ..files import check_replaceable_dir, locked, staged_dir
from ..model import NOISE_MODES
from ..options import (WINDOWS, THREADS, FiniteFloat, check_forward_memory, choices_from_flags, export_choice_options,
                       export_choices, positive_ints)
from ..report.baselines import baseline_paths, prepare_baselines
from ..report.bench import DEFAULT_PAST, checked_backends, run_agreement, run_bench
from ..report.memory import run_memory
from ..report.render import build_report, export_labels, level2_as_advice, print_summary, write_report
from ..report.small_model import small_model_speed
from ..report.timing import REL_CI, environment
from ..report.tradeoff import DEFAULT_QUALITY_BUDGET
from ..runtimes import ort_kernel
from ..runtimes.registry import BACKENDS
from ..runtimes.tensorrt import build_engines, tensorrt_problem
from ..verify.parity import DEFAULT_MAX_PPL_INCREASE, DEFAULT_MIN_TOP1, failure_line, run_parity
from ..verify.validate import validate_onnx

DEFAULT_OUT = Path("runs") / "pipeline"
PREFILL = 128
BUDGET_S = 1.5  # seconds of interleaved rounds per latency figure at most, so the whole job stays short


@contextlib.contextmanager
def staged_output(out, *, inputs=()):
    """A staging folder beside out, published over it when the block succeeds (files.staged_dir).
    out is only checked first (absent, empty, or made by infmoe-export), never created early, so a
    run that fails or is interrupted leaves no output folder, or the previous one whole; an
    existing out is locked for the run."""
    out = check_replaceable_dir(out, inputs=inputs)
    with locked(out) if out.exists() else contextlib.nullcontext(), staged_dir(out) as work:
        yield work


class Matrix(NamedTuple):
    """What a run covers: the lists, the backends, and which optional stages run."""
    ks: str
    noises: str
    dtypes: str
    batches: Sequence[int]
    max_windows: int  # of parity text
    full: bool  # every backend, TensorRT, the bundled baselines, memory


TOUR = Matrix("1,2,8", "quantile", "fp32,int4", (1,), 4, full=False)
FULL = Matrix("1,2,4,8", ",".join(NOISE_MODES), "fp32,int8,int4", (1, 4), 8, full=True)

# What one item of each stage costs, roughly, in seconds on a small CPU with the bundled model:
# the progress bar advances by these, so that rich's estimate of the time left (its measured
# speed over the remaining total) holds across stages of very different cost.
COST = {"export": 8.0, "validate": 2.0, "tensorrt": 60.0, "baselines": 10.0, "parity": 6.0, "memory": 5.0}


class Stages:
    """One rich progress display for the whole run, with the time left; and the report's record of
    each stage (status, seconds, note)."""

    def __init__(self, console, plan):
        """plan: [(stage name, items, cost of one item)], every stage the run will go through."""
        from rich.progress import (BarColumn, Progress, TaskProgressColumn, TextColumn, TimeElapsedColumn,
                                   TimeRemainingColumn)

        self.plan = {name: (items, cost) for name, items, cost in plan}
        self.progress = Progress(TextColumn("{task.fields[stage]:<9}"), BarColumn(bar_width=24), TaskProgressColumn(),
                                 TimeElapsedColumn(), TextColumn("left ~"), TimeRemainingColumn(),
                                 TextColumn("{task.description}", markup=False), console=console)
        self.task = self.progress.add_task("", total=sum(items * cost for items, cost in self.plan.values()),
                                           stage="")
        self.done = 0.0  # the bar's position at the end of the stages finished so far
        self.records = []

    def add(self, name: str, items: int, cost: float):
        """A stage the plan did not foresee (deploy's next candidate precision)."""
        self.plan[name] = (items, cost)
        self.progress.update(self.task, total=self.progress.tasks[0].total + items * cost)

    def __enter__(self):
        self.progress.start()
        return self

    def __exit__(self, *exc):
        self.progress.stop()
        return False

    def run(self, name: str, work):
        """Run work(advance), where advance(description) is called before each item of the stage."""
        items, cost = self.plan[name]
        started, start, count = time.perf_counter(), self.done, 0
        self.progress.update(self.task, completed=start, stage=name, description="")

        def advance(description: str = ""):
            nonlocal count
            raise_if_interrupted()
            self.progress.update(self.task, completed=start + min(count, items) * cost, description=description)
            count += 1

        try:
            status, note = work(advance)
        except InfMoEError as error:
            self.records.append({"name": name, "status": "failed", "seconds": time.perf_counter() - started,
                                 "note": str(error)})
            raise
        self.done += items * cost
        self.progress.update(self.task, completed=self.done, description="")
        self.records.append({"name": name, "status": status, "seconds": time.perf_counter() - started, "note": note})
        if note:
            self.progress.console.print(f"{name}: {note}", markup=False, highlight=False)


@click.command("pipeline")
@click.option("--checkpoint", type=click.Path(), default=None, help="Checkpoint directory (default: the bundled model).")
@click.option("--out", type=click.Path(), default=str(DEFAULT_OUT), show_default=True,
              help="Directory for the models, engines and report.html / report.md / report.json.")
@click.option("--full", is_flag=True,
              help=f"The whole matrix: --dtype {FULL.dtypes}, --k {FULL.ks}, --noise {FULL.noises}, batch 1 and 4, "
                   "every backend (torch, ort, ort-fallback, trt), TensorRT engines, the bundled baselines and "
                   f"memory. Without it, a quick tour: --dtype {TOUR.dtypes}, --k {TOUR.ks}, --noise {TOUR.noises}, "
                   "the deployed backend.")
@click.option("--k", "ks", default=None, help=f"Expert budgets K, comma-separated (default {TOUR.ks}; --full "
                                               f"{FULL.ks}; a conventional MoE: its top_k).")
@click.option("--noise", "noise_list", default=None,
              help=f"Noise modes, comma-separated (default {TOUR.noises}; --full {FULL.noises}).")
@export_choice_options(many=True, deployments=("onnxruntime", "portable"))
@click.option("--max-windows", type=WINDOWS, default=None,
              help=f"Windows of n_positions tokens of validation text for parity (default {TOUR.max_windows}; "
                   f"--full {FULL.max_windows}).")
@click.option("--baseline", "baselines", type=click.Path(), multiple=True,
              help="Baseline checkpoint(s) drawn as reference points, at the same runtime and precision (--full: "
                   "the bundled baselines that are present: dense, conventional MoE).")
@click.option("--no-baselines", is_flag=True, help="No baselines, not even the bundled ones.")
@click.option("--quality-budget", type=FiniteFloat(min=0), default=100 * DEFAULT_QUALITY_BUDGET, show_default=True,
              help="The recommendation: the fastest configuration whose perplexity is within this many percent of "
                   "the best the run measured.")
@click.option("--max-ppl-increase", type=FiniteFloat(min=0), default=100 * DEFAULT_MAX_PPL_INCREASE, show_default=True,
              help="Accuracy (level-2) budget: perplexity increase over the float model, in percent. A precision "
                   "over it is reported and left out of the recommendation; it does not fail the run.")
@click.option("--min-top1", type=FiniteFloat(0, 1), default=DEFAULT_MIN_TOP1, show_default=True,
              help="Accuracy (level-2) budget: least share of tokens whose top-1 agrees with the float model's.")
@click.option("--iters", type=click.IntRange(min=1), default=200, show_default=True,
              help="Timed calls per latency figure at most.")
@click.option("--warmup", type=click.IntRange(min=0), default=2, show_default=True)
@click.option("--budget", "budget_s", type=FiniteFloat(min=0.01), default=BUDGET_S, show_default=True,
              help="Seconds of interleaved timing per latency figure at most.")
@click.option("--threads", type=THREADS, default=None,
              help="Intra-op threads of torch and onnxruntime for latency (default: their own defaults).")
def pipeline_command(checkpoint, out, full, ks, noise_list, deploy, dtype, quantize_other, block_size, activations,
                     kv_cache, max_windows,
                     baselines, no_baselines, quality_budget, max_ppl_increase, min_top1, iters, warmup, budget_s,
                     threads):
    """The main job: export, validate, parity, latency (and with --full: TensorRT, baselines,
    memory), reports. By default a quick tour of the deployed artifact. Exits 1 when a backend
    fails parity level 1; a precision over the accuracy budget is reported, not failed."""
    matrix = FULL if full else TOUR
    config = read_config(checkpoint or DEFAULT_CHECKPOINT)
    moe = config.model_type == "moe-gpt2"  # one K, its top_k, and no noise
    ks = positive_ints(ks, "--k") if ks is not None else [config.default_k] if moe else positive_ints(matrix.ks)
    noise_list = noise_list if noise_list is not None else ("quantile" if moe else matrix.noises)
    noises = [n.strip() for n in noise_list.split(",") if n.strip()]
    if not noises or any(n not in NOISE_MODES for n in noises):
        raise InfMoEError(f"--noise must be a comma-separated subset of {', '.join(NOISE_MODES)}, got {noise_list!r}")
    baselines = baseline_paths(baselines, bundled=matrix.full and not no_baselines)
    torch_model = load_checkpoint(checkpoint)
    dtype = matrix.dtypes if dtype is None else dtype
    choices = choices_from_flags(torch_model.config, deploy, dtype, quantize_other, block_size,
                                 activations=activations, kv_cache=kv_cache)
    check_forward_memory(torch_model.config, max(matrix.batches), torch_model.config.n_positions, max(ks))
    if threads:
        torch.set_num_threads(threads)
    console = Console()
    for note in dict.fromkeys(c.note for c in choices if c.note):
        console.print(f"note: {note}", markup=False)
    if not matrix.full:
        console.print(f"quick tour: {', '.join(c.label for c in choices)}, K {', '.join(map(str, ks))}, "
                      f"{', '.join(noises)} noise, on the deployed backend; --full for the whole matrix",
                      markup=False, highlight=False)
    settings = dict(ks=ks, noises=noises, choices=choices, matrix=matrix, baselines=baselines,
                    max_windows=max_windows or matrix.max_windows, quality_budget=quality_budget / 100,
                    max_ppl_increase=max_ppl_increase / 100, min_top1=min_top1, iters=iters, warmup=warmup,
                    budget_s=budget_s, threads=threads)
    # The run is staged beside --out and published over it at the end (also when parity fails:
    # the report says so); a run that stops early leaves the previous one whole, or nothing.
    with staged_output(out, inputs=[checkpoint or DEFAULT_CHECKPOINT, *baselines]) as work:
        paths, failure = run_stages(console, work, torch_model, checkpoint, **settings)
    console.print(f"report: {Path(out) / paths['html'].name} (also {paths['markdown'].name}, {paths['json'].name})",
                  markup=False)
    if failure:
        raise InfMoEError(failure)


def run_stages(console, work: Path, torch_model, checkpoint, *, ks, noises, choices, matrix: Matrix, baselines,
               max_windows, quality_budget, max_ppl_increase, min_top1, iters, warmup, budget_s, threads):
    """Every stage into the folder work; returns the report's paths and the parity (level-1) failure line."""
    models_dir = work / "models"
    models = []
    engines = None
    kernel = ort_kernel.custom_op_library() is not None
    backends = list(BACKENDS) if matrix.full else checked_backends(kernel, [c.activations for c in choices])
    n = torch_model.config.n_positions
    past = min(DEFAULT_PAST, n - 1)  # a cache of 128 and a prefill of 128, or as long as the model allows
    dtypes = [c.dtype for c in choices]

    def export(advance):
        for choice in choices:  # one folder per precision: models/int4/model_k1_quantile_int4_other-int4.onnx
            models.extend(export_many(torch_model, models_dir / choice.dtype, ks, noises, with_starts=True,
                                      progress=lambda d: advance(f"{choice.label} {d}"), **choice.options()))
        return "ok", f"{len(models)} models ({', '.join(c.label for c in choices)}) in models/"

    def validate(advance):
        for model in models:
            advance(f"{model.io.dtype}/{model.path.name}")
            validate_onnx(torch_model, model, kernel=kernel)
        if kernel:
            return "ok", None
        return "ok", ("the onnxruntime kernel is not installed: validated on the fallback function, "
                      "the ort backend is skipped (docs/guide/onnxruntime.md)")

    def tensorrt(advance):
        nonlocal engines
        advance("")
        problem = tensorrt_problem()
        if problem:
            return "skipped", f"{problem}; no engines built"
        advance("exporting without the fallback function")
        folder = work / "engines"
        planned = {(m.k, choice.dtype): m
                   for choice in export_choices(torch_model.config, dtypes, target="tensorrt",
                                                block_size=choices[0].block_size)
                   for m in export_many(torch_model, folder / "onnx" / choice.dtype, ks, function=False,
                                        with_starts=True, **choice.options())}
        advance("building engines")
        engines = build_engines(planned, folder, folder / "timing.cache", max(matrix.batches), None, False)
        return "ok", f"engines in {engines}"

    def baseline(advance):
        nonlocal timed_baselines, baseline_facts
        if not baselines:
            return "skipped", "no baseline checkpoints (--baseline CKPT; none bundled)"
        advance(", ".join(p.name for p in baselines))
        timed_baselines, baseline_facts = prepare_baselines(baselines, work / "baselines", choices,
                                                            max_windows=max_windows)
        return "ok", None

    def parity(advance):
        nonlocal parity_section
        parity_section = level2_as_advice(run_parity(
            torch_model, models, backends=[b for b in backends if b != "torch"], engines=engines,
            max_windows=max_windows, max_ppl_increase=max_ppl_increase, min_top1=min_top1, progress=advance))
        return ("failed" if failure_line(parity_section) else "ok"), None

    def latency(advance):
        nonlocal bench_section
        common = dict(backends=backends, warmup=warmup, iters=iters, budget_s=budget_s, rel_ci=REL_CI, past=past,
                      engines=engines, threads=threads, progress=advance)
        quantile = run_bench(torch_model, [m for m in models if m.noise == "quantile"], batches=matrix.batches,
                             seqs=(1, min(PREFILL, n)), baselines=timed_baselines,
                             **common)
        sampled = run_bench(torch_model, [m for m in models if m.noise == "sampled"], batches=(1,), seqs=(1,),
                            **common)
        bench_section = {**quantile, "results": quantile["results"] + sampled["results"]}
        advance("run's speed beside the table")
        bench_section["run_agreement"] = run_agreement(
            torch_model, [m for m in models if m.noise == "quantile"], bench_section, kernel=kernel,
            threads=threads)
        return "ok", None

    def memory(advance):
        nonlocal memory_section
        memory_section = run_memory(torch_model, models, backends=backends, checkpoint=checkpoint, past=past,
                                    threads=threads, engines=engines, progress=advance)
        return "ok", None

    parity_section = bench_section = memory_section = None
    timed_baselines, baseline_facts = [], []
    n_models = len(choices) * len(ks) * len(noises)
    quantile_configs = (len(backends) * len(ks) * ("quantile" in noises) + len(baselines)) * len(choices)
    shapes = len(matrix.batches) * 2 + ("sampled" in noises)  # decode and prefill per batch; sampled decode
    plan = [("export", n_models, COST["export"]), ("validate", n_models, COST["validate"])]
    plan += [("tensorrt", 2, COST["tensorrt"] / 2)] if matrix.full else []
    plan += [("baselines", 1, COST["baselines"] * len(baselines) * len(choices))] if matrix.full or baselines else []
    plan += [("parity", n_models, COST["parity"]), ("latency", shapes, budget_s * max(quantile_configs, 1))]
    plan += [("memory", len(dtypes) * len(backends), COST["memory"])] if matrix.full else []
    stage_work = {"export": export, "validate": validate, "tensorrt": tensorrt, "baselines": baseline,
                  "parity": parity, "latency": latency, "memory": memory}
    with Stages(console, plan) as stages:
        for name, _, _ in plan:
            stages.run(name, stage_work[name])

    notes = [r["note"] for r in stages.records if r["status"] == "skipped"]
    small_model, warning = small_model_speed()
    if warning:
        console.print(f"warning: {warning}", markup=False, highlight=False)
        notes.append(warning)
    for row in parity_section["results"]:  # paths inside the published folder, not the staging one
        row["model"] = os.path.relpath(row["model"], work)
    report = build_report("pipeline", "infmoe-export " + " ".join(sys.argv[1:]), str(checkpoint or DEFAULT_CHECKPOINT),
                          torch_model.config.to_dict(), environment(threads), parity=parity_section, bench=bench_section,
                          memory=memory_section, baselines=baseline_facts, stages=stages.records, notes=notes,
                          quality_budget=quality_budget, small_model=small_model, export=export_labels(models))
    paths = write_report(report, work)
    print_summary(console, report)
    return paths, failure_line(parity_section)
