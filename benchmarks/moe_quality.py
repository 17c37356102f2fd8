"""The paper's comparison at the bundled scale: ∞-MoE against a conventional top-k MoE of the
same total FFN (H = 1024), both trained with the bundled model's command, data and steps, scored
on the same held-out text (the stdlib validation split), over several training seeds.

    .venv/bin/python -m benchmarks.moe_quality --infmoe A B C --moe X Y Z

Each checkpoint's seed comes from its train_log.json; rows group the checkpoints of one
architecture and expert budget (∞-MoE at K = 1, 2, 4, 8; a conventional MoE at its top_k) and
give the mean and the spread (sample standard deviation) of their perplexities. Without
arguments: the bundled model and the bundled conventional-MoE baselines (seed 0 only; the other
seeds' checkpoints are not bundled, so their results live in the results file).
"""

import argparse
import json
import math
import statistics
from pathlib import Path
from typing import List

from infmoe_export.checkpoint import DEFAULT_CHECKPOINT, bundled_baselines, load_checkpoint
from infmoe_export.data import corpus_bytes, windows
from infmoe_export.evaluate import window_nll
from infmoe_export.model import MoEConfig
from infmoe_export.options import set_threads
from infmoe_export.train import TRAIN_LOG

from . import record

INFMOE_KS = (1, 2, 4, 8)


def seed_of(path: Path):
    log = path / TRAIN_LOG
    return json.loads(log.read_text()).get("seed") if log.is_file() else None


def score(paths: List[Path], chunks) -> List[dict]:
    """One record per checkpoint and expert budget."""
    records = []
    for path in paths:
        model = load_checkpoint(path)
        c = model.config
        moe = isinstance(c, MoEConfig)
        for k in ([c.top_k] if moe else INFMOE_KS):
            total, count = window_nll(model, chunks, k)
            records.append({"checkpoint": str(path), "seed": seed_of(path),
                            "model": f"moe top-{k}" if moe else "∞-MoE", "k": k,
                            "perplexity": math.exp(total / count), "predicted_bytes": count})
    return records


def summary(records: List[dict]) -> List[dict]:
    rows = {}
    for r in records:
        rows.setdefault((r["model"], r["k"]), []).append(r)
    out = []
    for (model, k), group in rows.items():
        values = [r["perplexity"] for r in group]
        out.append({"model": model, "k": k, "seeds": sorted(r["seed"] for r in group if r["seed"] is not None),
                    "mean": statistics.fmean(values), "spread": statistics.stdev(values) if len(values) > 1 else None,
                    "perplexities": values})
    return sorted(out, key=lambda row: (row["model"] != "∞-MoE", row["k"]))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--infmoe", nargs="*", default=None, help="∞-MoE checkpoints (default: the bundled model)")
    parser.add_argument("--moe", nargs="*", default=None,
                        help="conventional-MoE checkpoints (default: the bundled moe-* baselines)")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--json", type=Path, default=record.default_path("moe_quality"))
    args = parser.parse_args(argv)
    threads = set_threads(args.threads)
    infmoe = [Path(p) for p in args.infmoe] if args.infmoe is not None else [DEFAULT_CHECKPOINT]
    moe = ([Path(p) for p in args.moe] if args.moe is not None else
           [p for p in bundled_baselines() if p.name.startswith("moe-")])
    text = corpus_bytes("validation")
    records = score(infmoe + moe, windows(text, load_checkpoint(infmoe[0]).config.n_positions))
    rows = summary(records)
    for row in rows:
        spread = "" if row["spread"] is None else f" ± {row['spread']:.4f}"
        print(f"{row['model']:>10}  K {row['k']}  seeds {row['seeds']}: perplexity {row['mean']:.4f}{spread}")
    path = record.save(args.json, "moe_quality", {"text": "stdlib validation split", "text_bytes": len(text),
                                                  "noise": "quantile", "records": records, "rows": rows}, threads)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
