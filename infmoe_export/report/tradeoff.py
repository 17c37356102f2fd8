"""The trade-off: perplexity (from parity) against batch-1 decode latency (from bench) per
backend, precision, noise mode and expert budget K, as table rows, the recommendation the data
supports, and one Pareto chart with the dense baselines as reference points."""

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
    """The baselines' facts (baselines.prepare_baselines) with their batch-1 decode latency."""
    timed = {r["baseline"]: r for r in (bench or {}).get("results", []) if r["baseline"] and r["status"] == "ok"}
    return [{**f, "backend": timed[f["name"]]["backend"] if f["name"] in timed else None,
             "decode_ms": {key: timed[f["name"]]["latency_ms"][key] for key in ("median", "ci_low", "ci_high")}
             if f["name"] in timed else None} for f in facts]


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


def plot_tradeoff(rows: List[dict], baselines: List[dict], recommended: Optional[dict] = None) -> bytes:
    """PNG, the Pareto chart: perplexity over batch-1 decode latency (median, its interval as a
    horizontal bar), a colour per backend, a marker per precision, a line over K per (backend,
    precision) drawn dotted where two neighbouring K are within noise; dense baselines as grey
    stars. With the report's recommendation: its Pareto front ringed, the quality budget's bound
    as a dashed line, and the recommended configuration ringed in red."""
    try:
        import matplotlib
    except ImportError:
        raise InfMoEError("the report plots need matplotlib, a dependency of infmoe-export: reinstall the package") from None
    matplotlib.use("Agg")  # files only, never a display
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    shown = chart_rows(rows)
    figure, axis = plt.subplots(figsize=(7.5, 4.2), dpi=100)
    colours = {b: f"C{i}" for i, b in enumerate(BACKENDS)}
    for key in sorted({order(r)[:3] for r in shown}):
        series = [r for r in shown if order(r)[:3] == key]
        backend, dtype = series[0]["backend"], series[0]["dtype"]
        x = [r["decode_ms"]["median"] for r in series]
        y = [r["perplexity"] for r in series]
        errors = [[m - r["decode_ms"]["ci_low"] for m, r in zip(x, series)],
                  [r["decode_ms"]["ci_high"] - m for m, r in zip(x, series)]]
        axis.errorbar(x, y, xerr=errors, fmt=MARKERS.get(dtype, "o"), color=colours[backend], capsize=2,
                      label=f"{backend} {dtype}")
        for a, b in zip(series, series[1:]):
            axis.plot([a["decode_ms"]["median"], b["decode_ms"]["median"]], [a["perplexity"], b["perplexity"]],
                      color=colours[backend], linestyle=":" if b["decode_within_noise"] else "-", linewidth=1)
        for r, xi, yi in zip(series, x, y):
            axis.annotate(f"K={r['k']}", (xi, yi), textcoords="offset points", xytext=(4, 3), fontsize=7)
    if recommended:
        front = recommended["front"]
        axis.scatter([r["decode_ms"]["median"] for r in front], [r["perplexity"] for r in front], s=160,
                     facecolors="none", edgecolors="black", linewidths=1, label="Pareto front")
        axis.axhline(recommended["perplexity_bound"], color="black", linestyle="--", linewidth=0.8,
                     label=f"quality budget: best +{100 * recommended['quality_budget']:g}%")
        axis.scatter([recommended["decode_ms"]["median"]], [recommended["perplexity"]], s=260, facecolors="none",
                     edgecolors="red", linewidths=2, label="recommended")
    for i, b in enumerate(b for b in baselines if b["decode_ms"]):
        axis.scatter([b["decode_ms"]["median"]], [b["perplexity"]], marker="*", s=140, color="dimgray",
                     label="baseline" if i == 0 else None)
        axis.annotate(b["name"], (b["decode_ms"]["median"], b["perplexity"]), textcoords="offset points",
                      xytext=(5, -10), fontsize=8, color="dimgray")
    axis.set_xscale("log")  # backends differ by orders of magnitude
    axis.xaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))  # 0.3, not 3×10⁻¹
    axis.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    axis.yaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%.3f"))  # as the tables
    axis.set_xlabel("decode step, batch 1: median ms (bar: 95% interval; dotted: K within noise)")
    axis.set_ylabel("perplexity (validation text)")
    axis.set_title("accuracy against cost: lower left is better", fontsize=10)
    axis.grid(True, which="both", alpha=0.3)
    if axis.get_legend_handles_labels()[0]:
        axis.legend(fontsize=7, loc="best")
    figure.tight_layout()
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png")
    plt.close(figure)
    return buffer.getvalue()
