"""The report files: report.json (validated against schema.json), report.md, and report.html,
one self-contained page with the plot embedded as a base64 PNG.

Both renderings are built from the same list of tables, so they always show the same numbers.
"""

import base64
import datetime
import html
import json
import string
from importlib import resources
from pathlib import Path
from typing import List, NamedTuple, Optional

from .. import __version__
from ..errors import InfMoEError
from ..files import atomic_write, output_dir
from ..verify.parity import failures
from .tradeoff import plot_tradeoff, tradeoff_rows

SCHEMA_VERSION = 1
TEXT_COLUMNS = {"note", "versions", "kernel library", "CPU", "checkpoint"}


class Table(NamedTuple):
    title: str
    headers: List[str]
    rows: List[List[str]]
    bad: List[bool]           # rows drawn as failures
    note: Optional[str] = None


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


def build_report(kind: str, command: str, checkpoint: str, config: dict, environment: dict, *,
                 parity: Optional[dict] = None, bench: Optional[dict] = None,
                 stages: Optional[list] = None, notes: Optional[list] = None) -> dict:
    """The report dict of schema.json; passed is False when any parity row failed."""
    failed = failures(parity)
    return {
        "schema_version": SCHEMA_VERSION,
        "kind": kind,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "tool_version": __version__,
        "command": command,
        "model": {"checkpoint": checkpoint, "config": config},
        "environment": environment,
        "passed": not failed,
        "failures": failed,
        "stages": stages or [],
        "parity": parity,
        "bench": bench,
        "tradeoff": tradeoff_rows(parity, bench) if (parity or bench) else None,
        "notes": notes or [],
    }


def fmt(value, digits: int = 4) -> str:
    if value is None:
        return "—"
    if isinstance(value, float):
        return f"{value:.{digits}g}"
    return str(value)


def pct(share) -> str:
    return "—" if share is None else f"{100 * share:.2f}%"


def tables(report: dict) -> List[Table]:
    out = []
    c = report["model"]["config"]
    out.append(Table("Model", ["checkpoint", "D", "L", "heads", "H", "r", "trained K", "V", "positions"],
                     [[report["model"]["checkpoint"], *(fmt(c.get(key)) for key in (
                         "d_model", "n_layer", "n_head", "ffn_hidden", "slice_width", "num_samples",
                         "vocab_size", "n_positions"))]], [False]))
    if report["stages"]:
        out.append(Table("Stages", ["stage", "status", "seconds", "note"],
                         [[s["name"], s["status"], f"{s['seconds']:.1f}", s["note"] or ""] for s in report["stages"]],
                         [s["status"] == "failed" for s in report["stages"]]))
    parity = report["parity"]
    if parity:
        s = parity["settings"]
        rows = [[r["backend"], str(r["k"]), r["noise"], r["status"], pct(r["start_agreement"]),
                 pct(r["agreeing_token_share"]), pct(r["clean_token_share"]), pct(r["top1_agreement"]),
                 *(fmt((r[field] or {}).get(stat)) for field in ("error_all", "error_agreeing", "error_clean")
                   for stat in ("max", "p99")),
                 fmt(r["perplexity"]), r["reason"] or ""] for r in parity["results"]]
        out.append(Table(
            "Parity against the PyTorch reference (SPEC §5)",
            ["backend", "K", "noise", "status", "starts agree", "tokens agreeing", "tokens clean", "top-1 agree",
             "max |Δlogit| all", "p99 all", "max agreeing", "p99 agreeing", "max clean", "p99 clean",
             "perplexity", "note"],
            rows, [r["status"] == "fail" for r in parity["results"]],
            f"{s['windows']} windows, {s['tokens']} tokens of {s['text']}. Agreeing: the token's starts (every "
            "layer and sample) agree with the reference's; clean: so do those of every earlier token of its window. "
            f"A backend passes when its logits on clean tokens are within atol {s['atol']:g} or rtol {s['rtol']:g} "
            f"element-wise (Polygraphy) and at least {pct(s['min_start_agreement'])} of its starts agree. Errors "
            "are per token the largest |Δlogit| over the vocabulary."))
    bench = report["bench"]
    if bench:
        rows = [[r["backend"], str(r["k"]), r["noise"], r["phase"], str(r["batch"]), str(r["seq"]), str(r["past"]),
                 fmt(r["iters"]), *(fmt((r["latency_ms"] or {}).get(p)) for p in ("p50", "p90", "p99")),
                 fmt(r["tokens_per_s"]), fmt(r["peak_rss_delta_mib"], 3), r["reason"] or ""]
                for r in bench["results"]]
        s = bench["settings"]
        out.append(Table("Latency", ["backend", "K", "noise", "phase", "batch", "seq", "past", "calls", "p50 ms", "p90 ms",
                                     "p99 ms", "tokens/s", "peak MiB", "note"],
                         rows, [False] * len(rows),
                         f"{s['warmup']} warm-up then up to {s['iters']} timed calls"
                         + (f" or {s['budget_s']:g} s, whichever comes first (at least 5)" if s["budget_s"] else "")
                         + f". {s['latency']} {s['memory']}"))
    if report["tradeoff"]:
        out.append(Table("Trade-off: accuracy and cost over K",
                         ["backend", "noise", "K", "perplexity", "decode p50 ms", "prefill tokens/s"],
                         [[r["backend"], r["noise"], str(r["k"]), fmt(r["perplexity"]), fmt(r["decode_ms_p50"]),
                           fmt(r["prefill_tokens_per_s"])] for r in report["tradeoff"]],
                         [False] * len(report["tradeoff"])))
    e = report["environment"]
    versions = ", ".join(f"{name} {v}" for name, v in e["versions"].items() if v)
    out.append(Table("Environment", ["CPU", "cores (usable)", "torch threads", "ort intra-op threads",
                                     "kernel library", "versions"],
                     [[e["cpu"], f"{e['cores']} ({e['usable_cores']})", str(e["torch_threads"]),
                       fmt(e["ort_intra_op_threads"]), e["kernel_library"] or "not built (fallback function)",
                       versions]], [False]))
    return out


def verdict(report: dict) -> str:
    return "PASSED" if report["passed"] else "FAILED: " + "; ".join(report["failures"])


def to_markdown(report: dict, plot_file: Optional[str]) -> str:
    lines = [f"# infmoe-export {report['kind']} report", "",
             f"**{verdict(report)}** · {report['created']} · `{report['command']}`", ""]
    for t in tables(report):
        lines += [f"## {t.title}", "", "| " + " | ".join(t.headers) + " |", "|" + "---|" * len(t.headers)]
        lines += ["| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |" for row in t.rows]
        lines += ["", t.note, ""] if t.note else [""]
        if t.title.startswith("Trade-off") and plot_file:
            lines += [f"![perplexity and latency over K]({plot_file})", ""]
    lines += [f"- {note}" for note in report["notes"]]
    return "\n".join(lines).rstrip() + "\n"


def to_html(report: dict, plot_png: Optional[bytes]) -> str:
    e = html.escape
    cls = "pass" if report["passed"] else "fail"
    parts = [f"<h1>infmoe-export {e(report['kind'])} report</h1>",
             f'<p><span class="verdict {cls}">{e(verdict(report))}</span></p>',
             f"<p class=\"note\">{e(report['created'])} · <code>{e(report['command'])}</code></p>"]
    for t in tables(report):
        parts.append(f"<h2>{e(t.title)}</h2>")
        if t.title.startswith("Trade-off") and plot_png:
            data = base64.b64encode(plot_png).decode("ascii")
            parts.append(f'<p><img alt="perplexity and latency over K" src="data:image/png;base64,{data}"></p>')
        # Free-text columns read left to right; wide tables scroll inside the page.
        text = [h in TEXT_COLUMNS for h in t.headers]
        parts.append('<div class="wide"><table><tr>' + "".join(f"<th>{e(h)}</th>" for h in t.headers) + "</tr>")
        for row, bad in zip(t.rows, t.bad):
            opening = '<tr class="bad">' if bad else "<tr>"
            parts.append(opening + "".join(f'<td class="text">{e(c)}</td>' if is_text else f"<td>{e(c)}</td>"
                                           for c, is_text in zip(row, text)) + "</tr>")
        parts.append("</table></div>")
        if t.note:
            parts.append(f'<p class="note">{e(t.note)}</p>')
    if report["notes"]:
        parts.append("<h2>Notes</h2><ul>" + "".join(f"<li>{e(n)}</li>" for n in report["notes"]) + "</ul>")
    template = string.Template(resources.files(__package__).joinpath("template.html").read_text())
    return template.substitute(title=e(f"infmoe-export {report['kind']} report"), body="\n".join(parts))


def write_report(report: dict, out: Path) -> dict:
    """Validate, then write report.json, report.md, report.html (and tradeoff.png when there is a
    trade-off); returns {kind: path}."""
    validate_report(report)
    out = output_dir(out)
    paths = {}
    plot = None
    if report["tradeoff"]:
        plot = plot_tradeoff(report["tradeoff"])
        paths["plot"] = atomic_write(out / "tradeoff.png", plot)
    paths["json"] = atomic_write(out / "report.json", json.dumps(report, indent=2) + "\n")
    paths["markdown"] = atomic_write(out / "report.md", to_markdown(report, "tradeoff.png" if plot else None))
    paths["html"] = atomic_write(out / "report.html", to_html(report, plot))
    return paths


def summary_table(report: dict):
    """A rich table for the terminal: one row per backend, K and noise mode."""
    from rich.table import Table as RichTable

    table = RichTable(title=f"infmoe-export {report['kind']}: {verdict(report)}")
    for column in ("backend", "K", "noise", "parity", "starts agree", "max |Δlogit| clean", "perplexity",
                   "decode p50 ms", "prefill tok/s"):
        table.add_column(column, justify="left" if column in ("backend", "noise", "parity") else "right")
    parity = {(r["backend"], r["k"], r["noise"]): r for r in (report["parity"] or {}).get("results", [])}
    for t in report["tradeoff"] or []:
        p = parity.get((t["backend"], t["k"], t["noise"]), {})
        status = p.get("status", "—")
        style = {"fail": "bold red", "pass": "green"}.get(status, "")
        table.add_row(t["backend"], str(t["k"]), t["noise"], f"[{style}]{status}[/]" if style else status,
                      pct(p.get("start_agreement")), fmt((p.get("error_clean") or {}).get("max")),
                      fmt(t["perplexity"]), fmt(t["decode_ms_p50"]), fmt(t["prefill_tokens_per_s"]))
    return table


def rich_table(t: Table):
    """One of the report's tables for the terminal."""
    from rich.markup import escape
    from rich.table import Table as RichTable

    table = RichTable(title=escape(t.title), caption=escape(t.note or ""))
    for i, header in enumerate(t.headers):
        table.add_column(escape(header), justify="left" if i == 0 else "right")
    for row, bad in zip(t.rows, t.bad):
        table.add_row(*map(escape, row), style="red" if bad else None)
    return table
