"""The accuracy-vs-K trade-off: perplexity (from parity) and latency (from bench) per backend,
noise mode and expert budget K, as table rows and one PNG plot."""

import io
from typing import List, Optional

from ..errors import InfMoEError
from ..runtimes.registry import BACKENDS


def tradeoff_rows(parity: Optional[dict], bench: Optional[dict]) -> List[dict]:
    """One row per (backend, noise, K) seen in either section (None where not measured). Latency: batch-1 decode p50 and
    the best batch's prefill tokens/s (seq > 1)."""
    rows = {}

    def row(backend, noise, k):
        return rows.setdefault((backend, noise, k), {
            "backend": backend, "noise": noise, "k": k,
            "perplexity": None, "decode_ms_p50": None, "prefill_tokens_per_s": None})

    for r in (parity or {}).get("results", []):
        row(r["backend"], r["noise"], r["k"])["perplexity"] = r["perplexity"]
    for r in (bench or {}).get("results", []):
        target = row(r["backend"], r["noise"], r["k"])
        if r["status"] != "ok":
            continue
        if r["phase"] == "decode" and r["batch"] == 1:
            target["decode_ms_p50"] = r["latency_ms"]["p50"]
        elif r["phase"] == "prefill":
            target["prefill_tokens_per_s"] = max(target["prefill_tokens_per_s"] or 0.0, r["tokens_per_s"])
    return [rows[key] for key in sorted(rows, key=lambda key: (BACKENDS.index(key[0]), key[1], key[2]))]


def plot_tradeoff(rows: List[dict]) -> bytes:
    """PNG: perplexity over K (left) and batch-1 decode latency over K (right), a line per
    backend and noise mode."""
    try:
        import matplotlib
    except ImportError:
        raise InfMoEError("the report plots need matplotlib, a dependency of infmoe-export: reinstall the package") from None
    matplotlib.use("Agg")  # files only, never a display
    import matplotlib.pyplot as plt

    figure, (left, right) = plt.subplots(1, 2, figsize=(10, 4), dpi=100)
    for axis, field, label in ((left, "perplexity", "perplexity (validation text)"),
                               (right, "decode_ms_p50", "decode step, batch 1, p50 (ms)")):
        for backend, noise in sorted({(r["backend"], r["noise"]) for r in rows}):
            points = sorted((r["k"], r[field]) for r in rows
                            if (r["backend"], r["noise"]) == (backend, noise) and r[field] is not None)
            if points:
                ks, values = zip(*points)
                axis.plot(ks, values, marker="o", label=f"{backend} ({noise})")
        axis.set_xscale("log", base=2)
        ks = sorted({r["k"] for r in rows})
        axis.set_xticks(ks, [str(k) for k in ks])
        axis.minorticks_off()
        axis.ticklabel_format(axis="y", useOffset=False)
        axis.set_xlabel("expert budget K")
        axis.set_ylabel(label)
        axis.grid(True, alpha=0.3)
        if axis.get_legend_handles_labels()[0]:
            axis.legend(fontsize=8)
    right.set_yscale("log")  # backends differ by orders of magnitude
    left.set_title("accuracy")
    right.set_title("cost")
    figure.tight_layout()
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png")
    plt.close(figure)
    return buffer.getvalue()
