"""The README's results table, generated from benchmarks/results/peers.json (and, below it, the
bundled-scale quality comparison of benchmarks/results/moe_quality.json when present).

The side-by-side run as one Markdown table, with the machine and the versions that measured it (the
date stays in the JSON), and the goals it judged.

    .venv/bin/python -m benchmarks.table            # rewrite the README between the markers
    .venv/bin/python -m benchmarks.table --print    # the block on stdout, the README untouched

The README holds the block between `<!-- results:begin -->` and `<!-- results:end -->`; nothing
outside them changes.
"""

import argparse
import json
import sys
from pathlib import Path
from typing import List, Optional

from infmoe_export.files import atomic_write
from infmoe_export.report.small_model import in_summary, shown_note

from . import record

BEGIN, END = "<!-- results:begin -->", "<!-- results:end -->"
README = Path(__file__).resolve().parent.parent / "README.md"
SOURCE = "peers"
BATCH_COLUMNS = (1, 16)  # batched decode shown at these B (the largest measured up to 16 where 16 was not)
VERSIONS = ("infmoe-export", "onnxruntime", "llama-cpp-python", "torch")


class TableError(Exception):
    """A results file or README the table cannot be made from (a one-line message)."""


def load(results: Path, name: str) -> dict:
    path = results / f"{name}.json"
    if not path.is_file():
        raise TableError(f"no {path}: run `python -m benchmarks.{name}` first")
    try:
        result = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise TableError(f"{path} is not readable JSON: {error}") from None
    missing = {"machine", "contenders", "decode", "batched", "prefill"} - set(result)
    if missing:
        raise TableError(f"{path} lacks {', '.join(sorted(missing))}: not a results file of benchmarks.{name}")
    return result


def fmt(value: Optional[float], digits: int) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


def batch_columns(result: dict) -> List[int]:
    measured = sorted(row["batch"] for row in result["batched"])
    shown = []
    for wanted in BATCH_COLUMNS:
        below = [b for b in measured if b <= wanted]
        if below and below[-1] not in shown:
            shown.append(below[-1])
    return shown


def markdown(result: dict, source: str) -> str:
    """The block between the markers."""
    threads = result["options"]["threads"]
    batches = batch_columns(result)
    batched = {row["batch"]: row for row in result["batched"]}
    header = ([f"{threads} threads"] + [f"decode, past {r['past']}: ms/token" for r in result["decode"]] +
              [f"batched B = {b}: tokens/s" for b in batches] +
              [f"prefill {r['tokens']}: tokens/s" for r in result["prefill"]] + ["peak RSS: MiB"])
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    shown = [c["name"] for c in result["contenders"] if in_summary(c["name"])]
    for name in shown:
        memory = (result.get("memory") or {}).get(name, {})
        cells = ([name] + [fmt(r["ms"].get(name), 2) for r in result["decode"]] +
                 [fmt(batched[b]["tokens_per_s"].get(name), 0) for b in batches] +
                 [fmt(r["tokens_per_s"].get(name), 0) for r in result["prefill"]] +
                 [fmt(memory["model_rss_bytes"] / 2**20 if "model_rss_bytes" in memory else None, 0)])
        lines.append("| " + " | ".join(cells) + " |")
    machine = result["machine"]
    versions = ", ".join(f"{p} {machine['versions'][p]}" for p in VERSIONS if machine["versions"].get(p))
    load = machine.get("load_average")
    quiet = f" (load average {load[1]:.1f} over the last 5 minutes)" if load else ""
    features = f" ({', '.join(machine['cpu_features'])})" if machine.get("cpu_features") else ""
    lines += ["", f"{machine['cpu']}{features}, {machine['cores']} cores{quiet}, {threads} threads; "
                  f"Python {machine['python']}, {versions}. From `{source}`; `python -m benchmarks.table` "
                  "rewrites this table. Random weights: speed, not quality. Peak RSS is the model's share of "
                  "a fresh process." + shown_note(len(shown), len(result["contenders"]))]
    a8 = [c for c in result["contenders"] if c["name"].startswith("ours") and c["name"].split()[1].endswith("-a8")]
    if a8:
        half = a8[0].get("kv_cache") == "float16"
        weights = "|".join(sorted({c["precision"].split("-")[1] for c in a8}))  # all-int4-a8: int4
        lines.append("`-a8`: run with the kernel's int8 activations (session option `infmoe.activations = "
                     f"int8`){' and a float16 KV cache' if half else ''}, what `infmoe-export onnx --dtype {weights}` "
                     "writes by default; without `-a8`: float activations "
                     f"(`--activations float{' --kv-cache float32' if half else ''}`).")
    if result["options"].get("quick"):
        lines.append("A `--quick` run: few configurations.")
    if result["skipped"]:
        lines.append("Not measured: " + "; ".join(f"{what} ({why})" for what, why in result["skipped"].items()) + ".")
    if result["goals"]:
        lines += [""] + [f"- {g['what']}: {g['value']:.2f} ({'met' if g['met'] else 'missed'}: at least {g['goal']})"
                         for g in result["goals"]]
    return "\n".join(lines)


def quality_lines(results: Path) -> List[str]:
    """∞-MoE against the conventional MoE on held-out text (benchmarks.moe_quality), one line per
    pairing the issue of the paper's comparison names: K = 2 against top-2, K = 1 against top-1."""
    path = results / "moe_quality.json"
    if not path.is_file():
        return []
    try:
        rows = {(r["model"], r["k"]): r for r in json.loads(path.read_text())["rows"]}
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise TableError(f"{path} is not a results file of benchmarks.moe_quality: {error}") from None

    def cell(row):
        spread = "" if row["spread"] is None else f" ± {row['spread']:.3f}"
        seeds = len(row["perplexities"])
        return f"{row['mean']:.3f}{spread} ({seeds} seed{'s' * (seeds > 1)})"

    lines = []
    for k in (2, 1):
        ours, theirs = rows.get(("∞-MoE", k)), rows.get((f"moe top-{k}", k))
        if ours and theirs:
            lines.append(f"- held-out perplexity, ∞-MoE K={k}: {cell(ours)}; conventional MoE top-{k}: {cell(theirs)}")
    if lines:
        lines = ["", "Quality at the bundled scale (H 1024, same training command; from "
                 "`benchmarks/results/moe_quality.json`, lower is better):", ""] + lines
    return lines


def replace_block(readme: str, block: str) -> str:
    begin, end = readme.find(BEGIN), readme.find(END)
    if begin < 0 or end < 0 or end < begin:
        raise TableError(f"README has no results markers ({BEGIN} … {END})")
    return readme[:begin + len(BEGIN)] + "\n" + block + "\n" + readme[end:]


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m benchmarks.table", description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--results", type=Path, default=record.RESULTS, help="the results folder")
    parser.add_argument("--readme", type=Path, default=README, help="the README to rewrite")
    parser.add_argument("--print", action="store_true", help="print the block instead of rewriting the README")
    args = parser.parse_args(argv)
    try:
        block = "\n".join([markdown(load(args.results, SOURCE), f"benchmarks/results/{SOURCE}.json"),
                           *quality_lines(args.results)])
        if args.print:
            print(block)
            return
        try:
            readme = args.readme.read_text()
        except OSError as error:
            raise TableError(f"cannot read {args.readme}: {error.strerror}") from None
        atomic_write(args.readme, replace_block(readme, block))
    except TableError as error:
        sys.exit(f"benchmarks.table: {error}")
    print(f"rewrote the results table in {args.readme}")


if __name__ == "__main__":
    main()
