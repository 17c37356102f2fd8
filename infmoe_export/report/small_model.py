"""The GPT-2-Small-size speed table beside the bundled model's chart: on the bundled model every
step is mostly fixed cost, so its chart cannot show what the precision buys; on a model of GPT-2
Small's size the weights set the speed. The figures come from the benchmarks' results
(`python -m benchmarks.quant_model`, benchmarks/results/quant_model.json in a source checkout),
never from this run, and the report labels them so."""

from pathlib import Path
from typing import Optional, Tuple

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"
SOURCE = "quant_model.json"
# The precisions shown, in this order (the file may hold more), and the dense peer.
PRECISIONS = ("fp32", "int8", "int4", "all-int8", "all-int4")
PEER = "dense-medium-int4"

_MS = {"type": "number", "exclusiveMinimum": 0}
# What this table reads of the file; anything else in it is left alone.
SCHEMA = {
    "type": "object",
    "required": ["benchmark", "machine", "config", "results"],
    "properties": {
        "benchmark": {"const": "quant_model"},
        "machine": {"type": "object", "required": ["cpu", "date"],
                    "properties": {"cpu": {"type": "string"}, "date": {"type": "string"}}},
        "config": {"type": "object", "required": ["small", "past"],
                   "properties": {"past": {"type": "integer"},
                                  "threads": {"type": "integer"},
                                  "small": {"type": "object", "required": ["d_model", "n_layer", "ffn_hidden",
                                                                           "slice_width", "vocab_size"]}}},
        "results": {"type": "array", "minItems": 1, "items": {
            "type": "object", "required": ["k", "decode_ms"],
            "properties": {"k": {"type": "integer", "minimum": 1},
                           "decode_ms": {"type": "object", "required": ["fp32"], "additionalProperties": _MS}}}},
    },
}


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
        return None, (f"{path}: not the quant_model benchmark's results (at {where}: {error.message[:200]}); "
                      "the GPT-2-Small-size table is left out")
    small = data["config"]["small"]
    return {"source": str(path), "cpu": data["machine"]["cpu"], "date": data["machine"]["date"],
            "threads": data["config"].get("threads"), "past": data["config"]["past"],
            "config": {key: small[key] for key in ("d_model", "n_layer", "ffn_hidden", "slice_width", "vocab_size")},
            "rows": [{"k": r["k"], "decode_ms": {name: r["decode_ms"].get(name) for name in (*PRECISIONS, PEER)}}
                     for r in sorted(data["results"], key=lambda r: r["k"])]}, None
