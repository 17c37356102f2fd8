"""The GPT-2-Small-size speed table beside the bundled model's chart: on the bundled model every
step is mostly fixed cost, so its chart cannot show what ∞-MoE's fewer bytes buy; at GPT-2
Small's size the weights set the speed. The figures are the benchmarks' side-by-side run with
the peers (`python -m benchmarks.peers`: our exports, llama.cpp, onnxruntime's MatMulNBits;
benchmarks/results/peers.json in a source checkout, the README's table too), never this run's,
and the report labels them so."""

from pathlib import Path
from typing import Optional, Tuple

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"
SOURCE = "peers.json"
BATCH = 16  # batched decode shown at this B (the largest measured below it where it was not)


POSITIVE = {"type": "object", "additionalProperties": {"type": "number", "exclusiveMinimum": 0}}


def _rows(key: str, figures: str) -> dict:
    """A list of measurements, each at an integer key (past, batch, tokens) with a figure per contender."""
    return {"type": "array", "items": {"type": "object", "required": [key, figures],
                                       "properties": {key: {"type": "integer"}, figures: POSITIVE}}}


# What this table reads of the file; anything else in it is left alone.
SCHEMA = {
    "type": "object",
    "required": ["benchmark", "machine", "options", "contenders", "decode", "batched", "prefill"],
    "properties": {
        "benchmark": {"const": "peers"},
        "machine": {"type": "object", "required": ["cpu", "date"],
                    "properties": {"cpu": {"type": "string"}, "date": {"type": "string"}}},
        "options": {"type": "object", "required": ["threads"], "properties": {"threads": {"type": "integer"}}},
        "contenders": {"type": "array", "minItems": 1, "items": {
            "type": "object", "required": ["name"], "properties": {"name": {"type": "string"}}}},
        "decode": _rows("past", "ms"),
        "batched": _rows("batch", "tokens_per_s"),
        "prefill": _rows("tokens", "tokens_per_s"),
        "skipped": {"type": "object", "additionalProperties": {"type": "string"}},
    },
}


def in_summary(name: str) -> bool:
    """The contenders of the peers run a summary shows (the README's table, a report's): ours at
    K = 2 in every precision and int4 at K = 8 (against the Medium model), onnxruntime's
    MatMulNBits model, and llama.cpp at Q4_0 (the goals' peers). The JSON holds every one."""
    words = name.split()
    if words[0] == "ours":
        return words[-1] == "K=2" or (len(words) > 1 and words[1].startswith("all-int4") and words[-1] == "K=8")
    if words[0] == "llama.cpp":
        return words[-1] == "Q4_0"
    return True


def shown_note(shown: int, contenders: int) -> str:
    """The sentence a summary adds when it shows fewer than all of the file's contenders."""
    if shown == contenders:
        return ""
    return f" Shown: {shown} of its {contenders} contenders (ours at K = 2, and int4 at K = 8; llama.cpp at Q4_0)."


def small_model_speed(results: Path = RESULTS) -> Tuple[Optional[dict], Optional[str]]:
    """(the report's small_model section, or None when the results file is absent or unreadable;
    a one-line warning when it is present but unreadable)."""
    import json

    import jsonschema

    path = Path(results) / SOURCE
    if not path.is_file():
        return None, None
    try:
        data = json.loads(path.read_text())
        jsonschema.validate(data, SCHEMA)
    except (OSError, UnicodeDecodeError, ValueError) as error:
        return None, f"{path}: not readable as JSON ({error}); the GPT-2-Small-size table is left out"
    except jsonschema.ValidationError as error:
        where = "/".join(str(p) for p in error.absolute_path) or "(top level)"
        return None, (f"{path}: not the peers benchmark's results (at {where}: {error.message[:200]}); "
                      "the GPT-2-Small-size table is left out")
    batched = [row for row in sorted(data["batched"], key=lambda r: r["batch"]) if row["batch"] <= BATCH][-1:]
    columns = ([(f"decode, past {r['past']}: ms/token", r["ms"]) for r in data["decode"]] +
               [(f"{r['batch']} sequences: tokens/s", r["tokens_per_s"]) for r in batched] +
               [(f"prefill {r['tokens']}: tokens/s", r["tokens_per_s"]) for r in data["prefill"]])
    names = [c["name"] for c in data["contenders"] if in_summary(c["name"])]
    return {"source": str(path), "cpu": data["machine"]["cpu"], "date": data["machine"]["date"],
            "contenders": len(data["contenders"]),
            "threads": data["options"]["threads"], "columns": [title for title, _ in columns],
            "rows": [{"contender": name, "values": [figures.get(name) for _, figures in columns]} for name in names],
            "skipped": [f"{what} ({why})" for what, why in data.get("skipped", {}).items()]}, None
