"""The trade-off: perplexity (from parity) against batch-1 decode latency and prefill (from bench)
per backend, precision, noise mode and expert budget K, as table rows, the recommendation the data
supports, and one Pareto chart with the baselines (dense, conventional MoE) as reference points."""

import io
from typing import List, Optional

from ..errors import InfMoEError
from ..quant import PRECISIONS
from ..runtimes.registry import BACKENDS
from .timing import within_noise

MARKERS = {"fp32": "o", "fp16": "D", "int8": "s", "int4": "^"}


def order(row: dict) -> tuple:
    return (BACKENDS.index(row["backend"]), PRECISIONS.index(row["dtype"]), row["noise"], row["k"])


def tradeoff_rows(parity: Optional[dict], bench: Optional[dict]) -> List[dict]:
    """One row per (backend, precision, noise, K) seen in either section (None where not measured):
    perplexity and its increase over float (parity), the batch-1 decode latency summary and the
    best batch's prefill tokens/s (bench), the parity status, and whether the decode latency is
    within noise of the previous K of the same series."""
    rows = {}

    def row(r):
        return rows.setdefault((r["backend"], r["dtype"], r["noise"], r["k"]), {
            "backend": r["backend"], "dtype": r["dtype"], "noise": r["noise"], "k": r["k"], "parity": None,
            "perplexity": None, "perplexity_increase": None, "decode_ms": None, "decode_within_noise": None,
            "prefill_tokens_per_s": None})

    for r in (parity or {}).get("results", []):
        target = row(r)
        target.update(parity=r["status"], perplexity=r["perplexity"], perplexity_increase=r["perplexity_increase"])
    for r in (bench or {}).get("results", []):
        if r["baseline"]:
            continue
        target = row(r)
        if r["status"] != "ok":
            continue
        if r["phase"] == "decode" and r["batch"] == 1:
            target["decode_ms"] = {key: r["latency_ms"][key] for key in ("median", "ci_low", "ci_high")}
        elif r["phase"] == "prefill":
            target["prefill_tokens_per_s"] = max(target["prefill_tokens_per_s"] or 0.0, r["tokens_per_s"])
    ordered = sorted(rows.values(), key=order)
    for previous, current in zip(ordered, ordered[1:]):
        if order(previous)[:3] == order(current)[:3] and current["decode_ms"] and previous["decode_ms"]:
            current["decode_within_noise"] = within_noise(previous["decode_ms"], current["decode_ms"])
    return ordered


def baseline_rows(bench: Optional[dict], facts: List[dict]) -> List[dict]:
    """The baselines' facts (baselines.prepare_baselines, one per baseline and precision) with the
    backend they were timed on, their batch-1 decode latency and prefill tokens/s."""
    out = []
    for fact in facts:
        timed = [r for r in (bench or {}).get("results", [])
                 if (r["baseline"], r["dtype"]) == (fact["name"], fact["dtype"]) and r["status"] == "ok"]
        decode = next((r for r in timed if r["phase"] == "decode"), None)
        prefill = [r["tokens_per_s"] for r in timed if r["phase"] == "prefill"]
        out.append({**fact, "backend": timed[0]["backend"] if timed else None,
                    "decode_ms": {key: decode["latency_ms"][key] for key in ("median", "ci_low", "ci_high")}
                    if decode else None,
                    "prefill_tokens_per_s": max(prefill) if prefill else None})
    return out


DEFAULT_QUALITY_BUDGET = 0.02  # a perplexity within 2% of the best the run measured counts as as good


def pareto_front(rows: List[dict]) -> List[dict]:
    """The rows no other row beats on both batch-1 decode latency (median) and perplexity,
    fastest first."""
    def point(r):
        return r["decode_ms"]["median"], r["perplexity"]

    return sorted((r for r in rows if not any(point(o) != point(r) and point(o)[0] <= point(r)[0]
                                              and point(o)[1] <= point(r)[1] for o in rows)), key=point)


def recommendation(rows: List[dict], quality_budget: float = DEFAULT_QUALITY_BUDGET) -> Optional[dict]:
    """Among the charted configurations that passed parity (or are the PyTorch reference): of the
    Pareto front's points within the quality budget (perplexity at most 1 + quality_budget times
    the best measured), the fastest batch-1 decode; of it and those within noise of it, the
    lowest perplexity (a speed the noise cannot tell apart buys nothing). With the front, the
    budget and the bound, so that a report can show why."""
    fit = [r for r in chart_rows(rows) if r["parity"] in ("pass", "reference")]
    if not fit:
        return None
    front = pareto_front(fit)
    best_perplexity = min(r["perplexity"] for r in fit)
    bound = best_perplexity * (1 + quality_budget)
    within = [r for r in front if r["perplexity"] <= bound]
    fastest = within[0]  # the front is sorted fastest first
    tied = [r for r in within if r is fastest or within_noise(r["decode_ms"], fastest["decode_ms"])]
    best = min(tied, key=lambda r: (r["perplexity"], r["decode_ms"]["median"]))
    return {"best": best, "within_noise": [r for r in tied if r is not best], "front": front,
            "quality_budget": quality_budget, "best_perplexity": best_perplexity, "perplexity_bound": bound}


def chart_rows(rows: List[dict]) -> List[dict]:
    """The rows the chart shows: quantile noise (the deployment mode) when there is any."""
    drawable = [r for r in rows if r["perplexity"] is not None and r["decode_ms"]]
    quantile = [r for r in drawable if r["noise"] == "quantile"]
    return quantile or drawable


# The baselines' look, per kind: a dense model, a conventional MoE, another ∞-MoE.
BASELINE_STYLE = {"dense": ("*", "dimgray"), "conventional MoE": ("P", "saddlebrown"), "∞-MoE": ("X", "purple")}


def baseline_kind(fact: dict) -> str:
    if fact["model_type"] == "moe-gpt2":
        return "conventional MoE"
    return "dense" if fact["active_units"] == fact["ffn_hidden"] else "∞-MoE"


def prefill_ms_per_token(row: dict) -> Optional[float]:
    """The prefill figure the chart draws: ms per token at the best batch (1 / tokens/s)."""
    return 1e3 / row["prefill_tokens_per_s"] if row.get("prefill_tokens_per_s") else None


def plot_tradeoff(rows: List[dict], baselines: List[dict], recommended: Optional[dict] = None) -> bytes:
    """PNG, the Pareto chart in two panels sharing the perplexity axis: against the batch-1 decode
    step (median, its interval as a horizontal bar) and against prefill (ms per token at the best
    batch). A colour per backend, a marker per precision, a line over K per (backend, precision)
    drawn dotted where two neighbouring K are within noise (decode); the baselines as labelled
    reference points (dense: grey stars, conventional MoE: brown crosses), each at the precision
    and on the backend it was measured with. With the report's recommendation (decode panel): its
    Pareto front ringed, the quality budget's bound as a dashed line, the recommended
    configuration ringed in red."""
    try:
        import matplotlib
    except ImportError:
        raise InfMoEError("the report plots need matplotlib, a dependency of infmoe-export: reinstall the package") from None
    matplotlib.use("Agg")  # files only, never a display
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    shown = chart_rows(rows)
    figure, (decode, prefill) = plt.subplots(1, 2, figsize=(11, 4.4), dpi=100, sharey=True)
    colours = {b: f"C{i}" for i, b in enumerate(BACKENDS)}
    for key in sorted({order(r)[:3] for r in shown}):
        series = [r for r in shown if order(r)[:3] == key]
        backend, dtype = series[0]["backend"], series[0]["dtype"]
        x = [r["decode_ms"]["median"] for r in series]
        y = [r["perplexity"] for r in series]
        errors = [[m - r["decode_ms"]["ci_low"] for m, r in zip(x, series)],
                  [r["decode_ms"]["ci_high"] - m for m, r in zip(x, series)]]
        decode.errorbar(x, y, xerr=errors, fmt=MARKERS.get(dtype, "o"), color=colours[backend], capsize=2,
                        label=f"{backend} {dtype}")
        for a, b in zip(series, series[1:]):
            decode.plot([a["decode_ms"]["median"], b["decode_ms"]["median"]], [a["perplexity"], b["perplexity"]],
                        color=colours[backend], linestyle=":" if b["decode_within_noise"] else "-", linewidth=1)
        prefilled = [r for r in series if prefill_ms_per_token(r)]
        prefill.plot([prefill_ms_per_token(r) for r in prefilled], [r["perplexity"] for r in prefilled],
                     marker=MARKERS.get(dtype, "o"), color=colours[backend], linewidth=1)
        for r in series:
            for axis, xi in ((decode, r["decode_ms"]["median"]), (prefill, prefill_ms_per_token(r))):
                if xi:
                    axis.annotate(f"K={r['k']}", (xi, r["perplexity"]), textcoords="offset points", xytext=(4, 3),
                                  fontsize=7)
    if recommended:
        front = recommended["front"]
        decode.scatter([r["decode_ms"]["median"] for r in front], [r["perplexity"] for r in front], s=160,
                       facecolors="none", edgecolors="black", linewidths=1, label="Pareto front")
        decode.axhline(recommended["perplexity_bound"], color="black", linestyle="--", linewidth=0.8,
                       label=f"quality budget: best +{100 * recommended['quality_budget']:g}%")
        decode.scatter([recommended["decode_ms"]["median"]], [recommended["perplexity"]], s=260, facecolors="none",
                       edgecolors="red", linewidths=2, label="recommended")
    labelled = set()
    several = len({b["dtype"] for b in baselines}) > 1
    for b in baselines:
        kind = baseline_kind(b)
        marker, colour = BASELINE_STYLE[kind]
        name = f"{b['name']} {b['dtype']}" if several else b["name"]
        for axis, xi in ((decode, b["decode_ms"]["median"] if b["decode_ms"] else None),
                         (prefill, prefill_ms_per_token(b))):
            if xi:
                axis.scatter([xi], [b["perplexity"]], marker=marker, s=140, color=colour,
                             label=kind if axis is decode and kind not in labelled else None)
                axis.annotate(name, (xi, b["perplexity"]), textcoords="offset points", xytext=(5, -10), fontsize=8,
                              color=colour)
        labelled.add(kind)
    for axis, what in ((decode, "decode step, batch 1: median ms (bar: 95% interval; dotted: K within noise)"),
                       (prefill, "prefill: ms per token (best batch)")):
        axis.set_xscale("log")  # backends differ by orders of magnitude
        axis.xaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))  # 0.3, not 3×10⁻¹
        axis.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        axis.set_xlabel(what, fontsize=8)
        axis.grid(True, which="both", alpha=0.3)
    decode.yaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%.3f"))  # as the tables
    decode.set_ylabel("perplexity (validation text)")
    figure.suptitle("accuracy against cost: lower left is better", fontsize=10)
    if decode.get_legend_handles_labels()[0]:
        decode.legend(fontsize=7, loc="best")
    figure.tight_layout()
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png")
    plt.close(figure)
    return buffer.getvalue()
