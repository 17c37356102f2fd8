"""The report files: report.json (validated against schema.json), report.md, and report.html,
one self-contained page with the chart embedded as a base64 PNG; and the terminal summary.

Every rendering follows the same order, built from the same sections (`sections`): the verdict
per backend and precision, the recommendation, the Pareto chart, the compact trade-off, memory
and baseline tables; then folded details (parity and latency per noise mode and precision, the
run). So the Markdown, the page and the terminal always show the same numbers.
"""

import base64
import datetime
import html
import json
import math
import string
from importlib import resources
from pathlib import Path
from typing import List, NamedTuple, Optional, Sequence, Tuple

from .. import __version__
from ..errors import InfMoEError
from ..files import atomic_write, output_dir
from ..quant import PRECISIONS
from ..runtimes.registry import BACKENDS
from ..verify.parity import failures, label
from .small_model import shown_note
from .timing import within_noise
from .tradeoff import (DEFAULT_QUALITY_BUDGET, baseline_kind, baseline_rows, plot_tradeoff, recommendation,
                       tradeoff_rows)

SCHEMA_VERSION = 4
TEXT_COLUMNS = {"note", "versions", "kernel library", "CPU", "checkpoint", "reason"}
PLOT_FILE = "tradeoff.png"
PLOT_ALT = ("Pareto chart: perplexity against decode latency and prefill per backend, precision and K, beside "
            "the baselines")


class Table(NamedTuple):
    title: str
    headers: List[str]
    rows: List[List[str]]
    bad: List[bool]           # rows drawn as failures
    note: Optional[str] = None


class Section(NamedTuple):
    title: str                 # shown as a heading, or as the summary of a folded section ("": none)
    tables: List[Table]
    folded: bool
    lines: Sequence[str] = ()  # one-line remarks above the tables (skipped backends)


# ---------------------------------------------------------------------------------------------
# The report dict


def load_schema() -> dict:
    return json.loads(resources.files(__package__).joinpath("schema.json").read_text())


def validate_report(report: dict) -> None:
    try:
        import jsonschema
    except ImportError:
        raise InfMoEError("writing a report needs jsonschema, a dependency of infmoe-export: reinstall the package") from None
    try:
        jsonschema.validate(report, load_schema(), format_checker=jsonschema.FormatChecker())
    except jsonschema.ValidationError as error:
        where = "/".join(str(p) for p in error.absolute_path) or "(top level)"
        raise InfMoEError(f"report does not match its schema at {where}: {error.message}") from None


def export_labels(models) -> dict:
    """What each precision's models were exported as, as the report names it: {"int4":
    "onnxruntime all-int4"} (DecoderIO.label: the export choice's target and precision)."""
    labels = {}
    for model in models:
        named = labels.setdefault(model.io.dtype, [])
        if model.io.label not in named:
            named.append(model.io.label)
    return {dtype: " / ".join(named) for dtype, named in labels.items()}


OVER_BUDGET = "over_budget"


def level2_as_advice(parity: dict) -> dict:
    """The pipeline's reading of parity: a row that failed level 2 alone (the backend computes
    what the spec says, but its precision costs more accuracy against the float model than the
    budget allows) is over the accuracy budget, not a failure. The run passes, the headline names
    the precision and the recommendation leaves it out. `parity` keeps level 2 a failure: budgets
    given there are the user's."""
    return {**parity, "results": [{**r, "status": OVER_BUDGET} if r["status"] == "fail" and r["level1"] in ("pass", "n/a")
                                  else r for r in parity["results"]]}


def over_budget(parity: Optional[dict]) -> List[dict]:
    return [r for r in (parity or {}).get("results", []) if r["status"] == OVER_BUDGET]


def accuracy_cost(rows: List[dict], settings: dict) -> str:
    """The figures that put rows over the accuracy budget, at their worst:
    "perplexity +7.91% vs float (budget +3.00%) at worst"."""
    worst, most = max(r["perplexity_increase"] for r in rows), settings["max_perplexity_increase"]
    lowest, least = min(r["float_top1_agreement"] for r in rows), settings["min_float_top1_agreement"]
    figures = []
    if worst > most:
        figures.append(f"perplexity {signed_pct(worst)} vs float (budget {signed_pct(most)})")
    if lowest < least:
        figures.append(f"top-1 agreeing with float {pct(lowest)} (budget {pct(least)})")
    return ", ".join(figures) + " at worst"


def verdicts(parity: Optional[dict], bench: Optional[dict], moe: bool = False) -> List[dict]:
    """One line per (backend, precision): passed (with the figures that matter), failed (naming
    the failing figures), over the accuracy budget (level 1 passed; naming the level-2 figures),
    or, merged over the precisions of a backend that share it, skipped (with its reason, once) or
    the reference. moe: the models are a conventional MoE's (top_k and experts, no noise)."""
    rows = (parity or bench or {}).get("results", [])
    if not parity:  # a latency report: which backends were timed
        rows = [{**r, "status": "timed" if r["status"] == "ok" else "skipped"} for r in rows if not r["baseline"]]
    lines = []
    for backend, dtype in sorted({(r["backend"], r["dtype"]) for r in rows},
                                 key=lambda key: (BACKENDS.index(key[0]), PRECISIONS.index(key[1]))):
        mine = [r for r in rows if (r["backend"], r["dtype"]) == (backend, dtype)]
        ran = [r for r in mine if r["status"] != "skipped"]
        where = f"top-{ran[0]['k']}" if moe and ran else \
            f"K {', '.join(str(k) for k in sorted({r['k'] for r in ran}))}; " \
            f"{', '.join(sorted({r['noise'] for r in ran}))} noise"
        failed = [r for r in mine if r["status"] == "fail"]
        over = [r for r in mine if r["status"] == OVER_BUDGET]
        if not ran:
            status, text = "skipped", mine[0]["reason"]
        elif failed:
            status = "failed"
            text = "; ".join(f"{f'top-{k}' if moe else f'K={k} {noise}'}: {reason}"
                             for k, noise, reason in ((r["k"], r["noise"], r["reason"]) for r in failed[:3]))
            text += f"; and {len(failed) - 3} more" if len(failed) > 3 else ""
        elif ran[0]["status"] == "reference":
            status, text = "reference", "PyTorch, the level-1 reference (int8 / int4: on the dequantized weights)"
        elif ran[0]["status"] == "timed":
            status, text = "timed", where
        else:  # level 1 passed at every K
            status = OVER_BUDGET if over else "passed"
            starts = [r["start_agreement"] for r in ran if r["start_agreement"] is not None]
            # a level-2-only backend (int8 activations) has no level-1 error on clean tokens
            errors = [e for e in ((r["error_clean"] or r["error_all"])["max"] for r in ran) if e is not None]
            text = (f"{where}; {'experts' if moe else 'starts'} agree ≥ {pct(min(starts))}, " if starts
                    else f"{where}; ") + (f"max |Δlogit| {sci(max(errors))}; " if errors else "")
            if over:
                text += f"over the accuracy budget at K {', '.join(str(r['k']) for r in over)}: " + \
                    accuracy_cost(over, parity["settings"])
            else:
                text += f"perplexity {signed_pct(max(r['perplexity_increase'] for r in ran))} vs float at worst"
        same = next((line for line in lines if status in ("skipped", "reference")
                     and (line["backend"], line["status"], line["text"]) == (backend, status, text)), None)
        if same:
            same["dtypes"].append(dtype)
        else:
            lines.append({"backend": backend, "dtypes": [dtype], "status": status, "text": text})
    return lines


def build_report(kind: str, command: str, checkpoint: str, config: dict, environment: dict, *,
                 parity: Optional[dict] = None, bench: Optional[dict] = None, memory: Optional[dict] = None,
                 baselines: Optional[List[dict]] = None, stages: Optional[list] = None,
                 notes: Optional[list] = None, quality_budget: float = DEFAULT_QUALITY_BUDGET,
                 small_model: Optional[dict] = None, export: Optional[dict] = None) -> dict:
    """The report dict of schema.json; passed is False when any parity row failed (a row over the
    accuracy budget, level2_as_advice, does not fail; over_budget names it). baselines:
    baselines.prepare_baselines' facts, completed here with their timed latency; quality_budget:
    the recommendation's (tradeoff.recommendation); small_model: small_model.small_model_speed's
    section (the benchmarks' figures, not this run's); export: export_labels of the models."""
    failed = failures(parity)
    tradeoff = tradeoff_rows(parity, bench) if (parity or bench) else None
    best = recommendation(tradeoff or [], quality_budget)
    return {
        "schema_version": SCHEMA_VERSION,
        "kind": kind,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "tool_version": __version__,
        "command": command,
        "model": {"checkpoint": checkpoint, "config": config},
        "export": export,
        "environment": environment,
        "passed": not failed,
        "failures": failed,
        "over_budget": [f"{label(r)}: {r['reason']}" for r in over_budget(parity)],
        "verdicts": verdicts(parity, bench, moe=config.get("model_type") == "moe-gpt2"),
        "recommendation": None if best is None else {
            **{key: best["best"][key] for key in ("backend", "dtype", "noise", "k", "perplexity",
                                                   "perplexity_increase", "decode_ms")},
            "within_noise": [label(r) for r in best["within_noise"]],
            "quality_budget": quality_budget, "best_perplexity": best["best_perplexity"],
            "perplexity_bound": best["perplexity_bound"],
            "front": [{"label": label(r), "perplexity": r["perplexity"], "decode_ms": r["decode_ms"]}
                      for r in best["front"]]},
        "stages": stages or [],
        "parity": parity,
        "bench": bench,
        "memory": memory,
        "tradeoff": tradeoff,
        "baselines": baseline_rows(bench, baselines) if baselines else [],
        "small_model": small_model,
        "notes": notes or [],
    }


# ---------------------------------------------------------------------------------------------
# Numbers: a fixed number of significant digits per kind of figure, units in the headers


def sig(value, digits: int = 3) -> str:
    """Fixed-point with `digits` significant digits (never an exponent): 0.0123, 1.23, 123, 12345."""
    if value is None:
        return "—"
    if value == 0 or not math.isfinite(value):
        return str(value)
    decimals = max(0, digits - 1 - math.floor(math.log10(abs(value))))
    return f"{value:.{decimals}f}"


def sci(value) -> str:
    """Logit errors span many decades: always 3 significant digits in scientific notation."""
    return "—" if value is None else f"{value:.2e}"


def pct(share) -> str:
    return "—" if share is None else f"{100 * share:.2f}%"


def signed_pct(share) -> str:
    return "—" if share is None else f"{round(100 * share, 2) + 0.0:+.2f}%"  # + 0.0: no "-0.00%"


def ppl(value) -> str:
    return "—" if value is None else f"{value:.3f}"


def interval(latency: Optional[dict]) -> str:
    """"1.23 [1.20–1.27]": median and its 95% interval, ms."""
    if not latency:
        return "—"
    return f"{sig(latency['median'])} [{sig(latency['ci_low'])}–{sig(latency['ci_high'])}]"


def mib(value) -> str:
    return "—" if value is None else sig(value / 2**20)


# ---------------------------------------------------------------------------------------------
# Sections


def skipped_lines(rows: List[dict], key) -> List[str]:
    """One line per backend whose every row of a key (backend, or backend and precision) was
    skipped for the same reason, naming the precisions: the reason once."""
    lines = {}
    for r in rows:
        if all(o["status"] == "skipped" for o in rows if key(o) == key(r)):
            dtypes = lines.setdefault((r["backend"], r["reason"]), [])
            if r["dtype"] not in dtypes:
                dtypes.append(r["dtype"])
    return [f"{backend} {', '.join(dtypes)}: skipped, {reason}" for (backend, reason), dtypes in lines.items()]


def exported(report: dict, dtype: str) -> str:
    """A precision as the report names its models: their export choice when known."""
    return (report["export"] or {}).get(dtype, dtype)


def export_line(report: dict) -> Optional[str]:
    if not report["export"]:
        return None
    return (f"Exported as: {', '.join(report['export'].values())} (the export choice: `run`, `bench` and `deploy` "
            "run the same graph with the same --for and --dtype).")


def groups(rows: List[dict]):
    """(noise, precision) groups of rows, in report order."""
    keys = sorted({(r["noise"], r["dtype"]) for r in rows}, key=lambda k: (k[0], PRECISIONS.index(k[1])))
    return [(noise, dtype, [r for r in rows if (r["noise"], r["dtype"]) == (noise, dtype)]) for noise, dtype in keys]


def parity_tables(report: dict) -> List[Section]:
    parity = report["parity"]
    s = parity["settings"]
    out = []
    for noise, dtype, rows in groups(parity["results"]):
        ran = [r for r in rows if r["status"] != "skipped"]
        tables = [Table(
            "Agreement with the level-1 reference",
            ["backend", "K", "status", "starts agree", "tokens clean", "top-1 agree", "max |Δlogit| clean",
             "perplexity", "note"],
            [[r["backend"], str(r["k"]), status_text(r["status"]), pct(r["start_agreement"]),
              pct(r["clean_token_share"]), pct(r["top1_agreement"]), sci((r["error_clean"] or {}).get("max")),
              ppl(r["perplexity"]), r["reason"] or ""] for r in ran], [r["status"] == "fail" for r in ran],
            f"{s['windows']} windows, {s['tokens']} tokens of {s['text']}. Level 1: logits of clean tokens (their "
            f"starts and those of every earlier token of the window agree) within atol {s['atol']:g} or rtol "
            f"{s['rtol']:g} element-wise (Polygraphy), and at least {pct(s['min_start_agreement'])} of starts "
            "agreeing.")]
        tables.append(Table(
            "Logit error per token, largest |Δlogit| over the vocabulary",
            ["backend", "K", "tokens agreeing", "max all", "p99 all", "max agreeing", "p99 agreeing", "max clean",
             "p99 clean"],
            [[r["backend"], str(r["k"]), pct(r["agreeing_token_share"]),
              *(sci((r[field] or {}).get(stat)) for field in ("error_all", "error_agreeing", "error_clean")
                for stat in ("max", "p99"))] for r in ran if r["status"] != "reference"],
            [r["status"] == "fail" for r in ran if r["status"] != "reference"]))
        if dtype != "fp32":
            tables.append(Table(
                "Level 2: against the float model",
                ["backend", "K", "level 1", "level 2", "perplexity", "float perplexity", "increase", "top-1 vs float"],
                [[r["backend"], str(r["k"]), r["level1"] or "—", r["level2"] or "—", ppl(r["perplexity"]),
                  ppl(r["float_perplexity"]), signed_pct(r["perplexity_increase"]), pct(r["float_top1_agreement"])]
                 for r in ran], [r["level2"] == "fail" for r in ran],
                f"Budget: perplexity at most {signed_pct(s['max_perplexity_increase'])} over the float model's, "
                f"top-1 agreeing with it on at least {pct(s['min_float_top1_agreement'])} of tokens. The reference "
                "row is PyTorch with the dequantized weights: the loss quantization itself costs."))
        out.append(Section(f"Parity, {noise} noise, {exported(report, dtype)}", tables, True,
                           skipped_lines(rows, lambda r: (r["backend"],))))
    return out


def latency_tables(report: dict) -> List[Section]:
    bench = report["bench"]
    s = bench["settings"]
    out = []
    for noise, dtype, rows in groups([r for r in bench["results"] if not r["baseline"]]):
        ran = sorted((r for r in rows if r["status"] == "ok"),
                     key=lambda r: (BACKENDS.index(r["backend"]), r["phase"], r["batch"], r["seq"], r["k"]))
        cells = []
        for previous, r in zip([None] + ran, ran):
            same = previous is not None and all(previous[key] == r[key] for key in ("backend", "phase", "batch", "seq"))
            noisy = same and within_noise(previous["latency_ms"], r["latency_ms"])
            cells.append([r["backend"], str(r["k"]), r["phase"], str(r["batch"]), str(r["seq"]),
                          f"{r['iters']}{'' if r['stable'] else ' †'}",
                          ("≈ " if noisy else "") + interval(r["latency_ms"]), sig(r["latency_ms"]["p90"]),
                          sig(r["tokens_per_s"])])
        out.append(Section(f"Latency, {noise} noise, {exported(report, dtype)}", [Table(
            "Latency", ["backend", "K", "phase", "batch", "seq", "calls", "median ms [95% CI]", "p90 ms", "tokens/s"],
            cells, [False] * len(cells),
            f"Decode: one step after a cache of {s['decode_past']} tokens; prefill: seq tokens from an empty cache. "
            f"{s['warmup']} warm-up calls, then rounds until every interval is within ±{100 * s['rel_ci']:g}% of its "
            f"median or {s['budget_s']:g} s per configuration are spent (at most {s['iters']} calls; † = the "
            f"interval is still wider). {s['latency']}")], True,
            skipped_lines(rows, lambda r: (r["backend"],))))
    return out


def agreement_table(report: dict) -> Optional[Table]:
    """`run`'s decode speed beside the latency table's, per model (pipeline)."""
    rows = report["bench"].get("run_agreement") if report["bench"] else None
    if not rows:
        return None
    return Table("Does `run` see this speed?", ["backend", "precision", "K", "table: decode ms [95% CI]",
                                                "the table's way, beside run", "run: decode ms [95% CI]", "steps",
                                                "agrees"],
                 [[r["backend"], exported(report, r["dtype"]), str(r["k"]), interval(r["bench_ms"]),
                   interval(r["table_beside_run_ms"]), interval(r["run_ms"]),
                   f"{r['steps']} from past {r['past_from']}", "yes" if r["agrees"] else "no"]
                  for r in rows], [not r["agrees"] for r in rows],
                 "run: greedy generations as `infmoe-export run` makes them, timed step by step (`run --timings` "
                 "prints the same), in blocks taking turns with blocks of decode steps timed the table's way "
                 "(its sessions taking turns, each step after an untimed one): both in the same seconds, so the "
                 "machine's drift since the table falls on both. agrees: those two intervals of the median "
                 "overlap, so the table's way measures what `run` sees; the table's own row is beside them.")


def agreement_line(report: dict) -> Optional[str]:
    rows = report["bench"].get("run_agreement") if report["bench"] else None
    if not rows:
        return None
    agree = sum(r["agrees"] for r in rows)
    return (f"run's decode speed agrees with the latency table's way of timing it (95% intervals overlap, measured "
            f"side by side) for {agree} of {len(rows)} models")


def run_section(report: dict) -> Section:
    c = report["model"]["config"]
    moe = c.get("model_type") == "moe-gpt2"  # a conventional MoE: experts and top_k in place of r and K
    tables = [Table("Model", ["checkpoint", "D", "L", "heads", "H", "experts" if moe else "r",
                              "top_k" if moe else "trained K", "V", "positions"],
                    [[report["model"]["checkpoint"], *(str(c.get(key)) for key in (
                        "d_model", "n_layer", "n_head", "ffn_hidden", "num_experts" if moe else "slice_width",
                        "top_k" if moe else "num_samples", "vocab_size", "n_positions"))]], [False])]
    if report["stages"]:
        tables.append(Table("Stages", ["stage", "status", "seconds", "note"],
                            [[s["name"], s["status"], f"{s['seconds']:.1f}", s["note"] or ""] for s in report["stages"]],
                            [s["status"] == "failed" for s in report["stages"]]))
    e = report["environment"]
    versions = ", ".join(f"{name} {v}" for name, v in e["versions"].items() if v)
    tables.append(Table("Environment", ["CPU", "cores (usable)", "torch threads", "ort intra-op threads",
                                        "kernel library", "versions"],
                        [[e["cpu"], f"{e['cores']} ({e['usable_cores']})", str(e["torch_threads"]),
                          str(e["ort_intra_op_threads"] or "default"),
                          e["kernel_library"] or "not built (fallback function)", versions]], [False]))
    return Section("The run: model, stages, environment", tables, True)


def tradeoff_table(report: dict) -> Table:
    rows = [r for r in report["tradeoff"] if r["perplexity"] is not None or r["decode_ms"]]
    return Table("Trade-off", ["backend", "precision", "noise", "K", "parity", "perplexity", "vs float",
                               "decode ms [95% CI]", "prefill tok/s"],
                 [[r["backend"], r["dtype"], r["noise"], str(r["k"]), status_text(r["parity"] or "—"),
                   ppl(r["perplexity"]), signed_pct(r["perplexity_increase"]),
                   ("≈ " if r["decode_within_noise"] else "") + interval(r["decode_ms"]),
                   sig(r["prefill_tokens_per_s"])] for r in rows],
                 [r["parity"] == "fail" for r in rows],
                 "Decode: batch 1, median with its 95% interval; ≈: within noise of the previous K (the intervals "
                 "overlap), so the order of the two is not measured.")


def memory_table(report: dict) -> Table:
    rows = [r for r in report["memory"]["results"] if r["status"] != "skipped"]
    s = report["memory"]["settings"]
    return Table("Memory", ["backend", "precision", "K", "file MiB", "weights MiB", "peak RSS MiB",
                            "RSS before load MiB", "allocator peak MiB"],
                 [[r["backend"], r["dtype"], str(r["k"]), mib(r["file_bytes"]), mib(r["weight_bytes"]),
                   mib(r["peak_rss_bytes"]) if r["status"] == "ok" else f"failed: {r['reason']}",
                   mib(r["rss_before_load_bytes"]), mib(r["allocator_peak_bytes"])] for r in rows],
                 [r["status"] == "failed" for r in rows],
                 f"Peak RSS: the peak resident set (VmHWM) of a fresh process that loads the model and decodes "
                 f"{s['decode_steps']} steps after a {s['past']}-token prefill; before load: that process with its "
                 "libraries imported, so the model's share is the difference. Weights: the stored bytes of the "
                 "model's initializers (PyTorch: the checkpoint's parameters). Allocator peak: "
                 + "; ".join(sorted({r["allocator_note"] for r in rows if r["allocator_note"]})) + ".")


def baselines_table(report: dict) -> Table:
    rows = report["baselines"]
    def kind(b):
        return {"dense": "dense", "conventional MoE": f"conventional MoE, top-{b['k']}"}.get(baseline_kind(b),
                                                                                          f"∞-MoE, K={b['k']}")

    return Table("Baselines", ["name", "kind", "FFN units a token / all", "parameters (M)", "precision", "perplexity",
                               "decode ms [95% CI]", "prefill tok/s", "backend"],
                 [[b["name"], kind(b), f"{b['active_units']} / {b['ffn_hidden']}", sig(b["parameters"] / 1e6),
                   b["dtype"], ppl(b["perplexity"]), interval(b["decode_ms"]), sig(b["prefill_tokens_per_s"]),
                   b["backend"] or "—"] for b in rows],
                 [False] * len(rows),
                 "Reference points of the chart, compared at the same runtime and precision: each checkpoint "
                 "exported with the run's export choice at its own K (a conventional MoE: its top_k), its perplexity "
                 "on the same text with the weights that precision stores, its decode step and prefill timed on the "
                 "same backend in the same interleaved loop as the configurations under test.")


def front_table(report: dict) -> Table:
    """Why the recommendation: the Pareto front, each point against the quality budget."""
    best = report["recommendation"]
    chosen = label(best)

    def choice(point):
        if point["label"] == chosen:
            return "recommended"
        if point["label"] in best["within_noise"]:
            return "within noise of the fastest, less accurate"
        return "over the quality budget" if point["perplexity"] > best["perplexity_bound"] else "slower"

    front = best["front"]
    return Table("Why: the Pareto front and the quality budget",
                 ["configuration", "decode ms [95% CI]", "perplexity", "vs best", "choice"],
                 [[p["label"], interval(p["decode_ms"]), ppl(p["perplexity"]),
                   signed_pct(p["perplexity"] / best["best_perplexity"] - 1), choice(p)] for p in front],
                 [False] * len(front),
                 "The front: configurations that passed parity (both levels) and that no other beats on both "
                 f"batch-1 decode latency and perplexity. The quality budget: perplexity at most "
                 f"{ppl(best['perplexity_bound'])}, the best measured ({ppl(best['best_perplexity'])}) "
                 f"+{100 * best['quality_budget']:g}% (--quality-budget). "
                 "Recommended: the fastest point within it; where others within it are within noise of the "
                 "fastest, the most accurate of them.")


def small_model_section(report: dict) -> Section:
    s = report["small_model"]
    note = (f"Not this run: {s['source']} (`python -m benchmarks.peers`), measured on {s['cpu']}, {s['date']}, "
            f"{s['threads']} threads, random weights: speed, not quality. ours: the ∞-MoE of GPT-2 Small's size "
            "exported for onnxruntime, run with the kernel; llama.cpp: dense GPT-2 Small and Medium; MatMulNBits: "
            "onnxruntime's own int4 on a dense GPT-2-Medium-size model. On the bundled model a step is mostly "
            "fixed cost; at this size the bytes read set the speed.")
    note += shown_note(len(s["rows"]), s["contenders"])
    if s["skipped"]:
        note += f" Not measured: {'; '.join(s['skipped'])}."
    table = Table("Speed beside the peers", ["contender", *s["columns"]],
                  [[r["contender"], *map(sig, r["values"])] for r in s["rows"]], [False] * len(s["rows"]), note)
    return Section("GPT-2-Small-size model (benchmark results, not this run)", [table], False)


def sections(report: dict) -> List[Section]:
    """Everything below the verdict, recommendation and chart, in the order every rendering uses."""
    top = []
    if report["recommendation"]:
        top.append(front_table(report))
    if report["tradeoff"]:
        top.append(tradeoff_table(report))
    if report["memory"]:
        top.append(memory_table(report))
    if report["baselines"]:
        top.append(baselines_table(report))
    # Skips the verdict lines already gave are not repeated.
    said = {(v["backend"], d) for v in report["verdicts"] if v["status"] == "skipped" for d in v["dtypes"]}
    memory_skips = skipped_lines([r for r in report["memory"]["results"] if (r["backend"], r["dtype"]) not in said],
                                 lambda r: (r["backend"], r["dtype"])) if report["memory"] else []
    out = [Section("", top, False, memory_skips)]  # the summary, right under the chart
    if report["small_model"]:
        out.append(small_model_section(report))
    if report["parity"]:
        out += parity_tables(report)
    if report["bench"]:
        out += latency_tables(report)
        agreement = agreement_table(report)
        if agreement:
            out.append(Section("`run` beside the latency table", [agreement], False, [agreement_line(report)]))
    out.append(run_section(report))
    return out


def headline_parts(report: dict) -> Tuple[str, Optional[str]]:
    """(PASSED or FAILED: level 1, and level 2 where it is not advice; the precisions over the
    accuracy budget, or None): ("PASSED", "onnxruntime all-int4 over the accuracy budget:
    perplexity +7.91% vs float (budget +3.00%) at worst")."""
    verdict = "PASSED" if report["passed"] else \
        f"FAILED: {len(report['failures'])} backend configuration(s) out of budget"
    over = over_budget(report["parity"])
    if not over:
        return verdict, None
    dtypes = sorted({r["dtype"] for r in over}, key=PRECISIONS.index)
    return verdict, (f"{', '.join(exported(report, d) for d in dtypes)} over the accuracy budget: "
                     f"{accuracy_cost(over, report['parity']['settings'])}")


def headline(report: dict) -> str:
    verdict, remark = headline_parts(report)
    return f"{verdict} — {remark}" if remark else verdict


def recommendation_line(report: dict) -> Optional[str]:
    best = report["recommendation"]
    if best is None:
        return None
    text = (f"Recommended: {label(best)}, {interval(best['decode_ms'])} ms per decode step, perplexity "
            f"{ppl(best['perplexity'])} ({signed_pct(best['perplexity_increase'])} vs float): the fastest on the "
            f"Pareto front within the quality budget, perplexity ≤ {ppl(best['perplexity_bound'])} (the best "
            f"measured +{100 * best['quality_budget']:g}%).")
    others = best["within_noise"]
    if others:
        more = f" and {len(others) - 3} more" if len(others) > 3 else ""
        text += f" Within noise of it, less accurate: {', '.join(others[:3])}{more}."
    return text


SYMBOLS = {"passed": "✓", "failed": "✗", OVER_BUDGET: "!", "skipped": "–", "reference": "•", "timed": "•"}


def status_text(status: str) -> str:
    """A status as the tables and lines show it: "over budget", not "over_budget"."""
    return status.replace("_", " ")


def verdict_text(line: dict) -> str:
    return (f"{SYMBOLS[line['status']]} {line['backend']} {', '.join(line['dtypes'])}: {status_text(line['status'])} "
            f"— {line['text']}")


# ---------------------------------------------------------------------------------------------
# Markdown, HTML, terminal


def markdown_table(t: Table) -> List[str]:
    lines = [f"**{t.title}**", "", "| " + " | ".join(t.headers) + " |", "|" + "---|" * len(t.headers)]
    lines += ["| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |" for row in t.rows]
    return lines + (["", t.note, ""] if t.note else [""])


def to_markdown(report: dict, plot_file: Optional[str]) -> str:
    lines = [f"# infmoe-export {report['kind']}: {headline(report)}", ""]
    lines += [f"- {verdict_text(v)}" for v in report["verdicts"]] + [""]
    lines += [export_line(report), ""] if report["export"] else []
    best = recommendation_line(report)
    lines += [f"**{best}**", ""] if best else []
    if plot_file:
        lines += [f"![{PLOT_ALT}]({plot_file})", ""]
    for section in sections(report):
        if section.folded:
            lines += ["<details>", f"<summary>{html.escape(section.title)}</summary>", ""]
        elif section.title:
            lines += [f"## {section.title}", ""]
        lines += [f"- {line}" for line in section.lines] + ([""] if section.lines else [])
        for t in section.tables:
            lines += markdown_table(t)
        if section.folded:
            lines += ["</details>", ""]
    lines += [f"- {note}" for note in report["notes"]]
    lines += ["", f"<sub>{report['created']} · `{report['command']}`</sub>"]
    return "\n".join(lines).rstrip() + "\n"


def html_table(t: Table) -> str:
    e = html.escape
    text = [h in TEXT_COLUMNS for h in t.headers]
    parts = [f"<h3>{e(t.title)}</h3>", "<table><tr>" + "".join(f"<th>{e(h)}</th>" for h in t.headers) + "</tr>"]
    for row, bad in zip(t.rows, t.bad):
        opening = '<tr class="bad">' if bad else "<tr>"
        parts.append(opening + "".join(f'<td class="text">{e(c)}</td>' if is_text else f"<td>{e(c)}</td>"
                                       for c, is_text in zip(row, text)) + "</tr>")
    parts.append("</table>")
    if t.note:
        parts.append(f'<p class="note">{e(t.note)}</p>')
    return "\n".join(parts)


def to_html(report: dict, plot_png: Optional[bytes]) -> str:
    e = html.escape
    cls = "pass" if report["passed"] else "fail"
    verdict_items = "".join(f'<li class="{v["status"]}">{e(verdict_text(v))}</li>' for v in report["verdicts"])
    best = recommendation_line(report)
    verdict, remark = headline_parts(report)
    remark = f' <span class="remark">— {e(remark)}</span>' if remark else ""
    left = [f'<h1>infmoe-export {e(report["kind"])} <span class="verdict {cls}">{e(verdict)}</span>{remark}</h1>',
            f'<ul class="verdicts">{verdict_items}</ul>']
    if report["export"]:
        left.append(f'<p class="note">{e(export_line(report))}</p>')
    if best:
        left.append(f'<p class="recommendation">{e(best)}</p>')
    left.append(f'<p class="note">{e(report["created"])} · <code>{e(report["command"])}</code></p>')
    chart = ""
    if plot_png:
        data = base64.b64encode(plot_png).decode("ascii")
        chart = f'<figure class="chart"><img alt="{e(PLOT_ALT)}" src="data:image/png;base64,{data}"></figure>'
    parts = [f'<header class="top"><div>{"".join(left)}</div>{chart}</header>']
    for section in sections(report):
        inner = "".join(f'<p class="skipped">{e(line)}</p>' for line in section.lines)
        inner += "\n".join(html_table(t) for t in section.tables)
        if section.folded:
            parts.append(f"<details><summary>{e(section.title)}</summary>{inner}</details>")
        elif inner:
            heading = f"<h2>{e(section.title)}</h2>" if section.title else ""
            parts.append(f"<section>{heading}{inner}</section>")
    if report["notes"]:
        parts.append("<h2>Notes</h2><ul>" + "".join(f"<li>{e(n)}</li>" for n in report["notes"]) + "</ul>")
    template = string.Template(resources.files(__package__).joinpath("template.html").read_text())
    return template.substitute(title=e(f"infmoe-export {report['kind']} report"), body="\n".join(parts))


def write_report(report: dict, out: Path) -> dict:
    """Validate, then write report.json, report.md, report.html (and tradeoff.png when there is
    something to draw); returns {kind: path}."""
    validate_report(report)
    out = output_dir(out)
    paths = {}
    plot = None
    if report["tradeoff"] and any(r["perplexity"] is not None and r["decode_ms"] for r in report["tradeoff"]):
        plot = plot_tradeoff(report["tradeoff"], report["baselines"], report["recommendation"])
        paths["plot"] = atomic_write(out / PLOT_FILE, plot)
    paths["json"] = atomic_write(out / "report.json", json.dumps(report, indent=2, allow_nan=False) + "\n")
    paths["markdown"] = atomic_write(out / "report.md", to_markdown(report, PLOT_FILE if plot else None))
    paths["html"] = atomic_write(out / "report.html", to_html(report, plot))
    return paths


def print_summary(console, report: dict) -> None:
    """The terminal in the report's order: headline and verdict lines, the recommendation and why,
    then the compact trade-off and memory tables, and the GPT-2-Small-size table."""
    from rich.markup import escape

    styles = {"passed": "green", "failed": "bold red", OVER_BUDGET: "yellow", "skipped": "dim"}
    console.print(f"[bold]infmoe-export {report['kind']}: {escape(headline(report))}[/]")
    for v in report["verdicts"]:
        style = styles.get(v["status"], "")
        console.print(f"[{style}]{escape(verdict_text(v))}[/]" if style else escape(verdict_text(v)))
    if report["export"]:
        console.print(escape(export_line(report)))
    best = recommendation_line(report)
    if best:
        console.print(escape(best), style="bold")
        console.print(rich_table(front_table(report)))
    if report["tradeoff"]:
        console.print(rich_table(tradeoff_table(report)))
    if report["memory"]:
        console.print(rich_table(memory_table(report)))
    agreement = agreement_line(report)
    if agreement:
        console.print(escape(agreement))
    if report["small_model"]:
        section = small_model_section(report)
        console.print(rich_table(section.tables[0]._replace(title=f"{section.title}: {section.tables[0].title}")))


def rich_table(t: Table):
    """One of the report's tables for the terminal."""
    from rich.markup import escape
    from rich.table import Table as RichTable

    table = RichTable(title=escape(t.title), caption=escape(t.note or ""))
    for i, header in enumerate(t.headers):
        table.add_column(escape(header), justify="left" if i == 0 or header in TEXT_COLUMNS else "right")
    for row, bad in zip(t.rows, t.bad):
        table.add_row(*map(escape, row), style="red" if bad else None)
    return table
