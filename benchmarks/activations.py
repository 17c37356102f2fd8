"""The level-2 paths' quality on the bundled model: perplexity on held-out text of the same
all-int8 and all-int4 onnxruntime-target exports run with the kernel's float and int8 activations
(session option infmoe.activations), side by side, and of the same export with a float16 KV cache
(--kv-cache float16) on int8 activations.

    .venv/bin/python -m benchmarks.activations [--k 1,2,8] [--windows 32] [--json benchmarks/results/activations.json]

The goal: int8 activations cost at most +0.5 % perplexity over float activations, and the float16
cache at most +0.5 % more over the float32 one (the same budget, read for the cache).
"""

import argparse
import tempfile

from infmoe_export.checkpoint import load_checkpoint
from infmoe_export.contract import KV_CACHES
from infmoe_export.export import export_onnx
from infmoe_export.runtimes import ort_kernel
from infmoe_export.verify.quality import quality_vs_float

from . import arguments, record

PRECISIONS = ("int8", "int4")  # all weights: experts, attention and the LM head
GOAL_PCT = 0.5


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--k", type=arguments.ks, default="1,2,8")
    parser.add_argument("--windows", type=arguments.count(1, 4096), default=32, help="256-byte windows scored")
    parser.add_argument("--json", default=record.default_path("activations"), help="write the results here")
    args = parser.parse_args(argv)
    if ort_kernel.custom_op_library() is None:
        raise SystemExit("activations: the kernel library is not built; int8 activations are the kernel's")
    model = load_checkpoint()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for k in args.k:
            for precision in PRECISIONS:
                exports = {kv: export_onnx(model, f"{tmp}/k{k}-{precision}-{kv}.onnx", k=k, dtype=precision,
                                           quantize_other=precision, target="onnxruntime", kv_cache=kv)
                           for kv in KV_CACHES}
                scores = {a: quality_vs_float(model, exports["float32"], max_windows=args.windows, activations=a)
                          for a in ort_kernel.ACTIVATION_KINDS}
                kv16 = quality_vs_float(model, exports["float16"], max_windows=args.windows, activations="int8")
                row = {"k": k, "precision": precision, "perplexity_fp32_model": scores["float"]["perplexity_float"],
                       **{f"perplexity_{a}_activations": s["perplexity"] for a, s in scores.items()},
                       "perplexity_int8_activations_kv16": kv16["perplexity"]}
                row["int8_over_float_pct"] = 100 * (row["perplexity_int8_activations"] /
                                                    row["perplexity_float_activations"] - 1)
                row["kv16_over_float32_pct"] = 100 * (row["perplexity_int8_activations_kv16"] /
                                                      row["perplexity_int8_activations"] - 1)
                rows.append(row)
                print(f"K {k} all-{precision}: perplexity {row['perplexity_float_activations']:.4f} (float activations), "
                      f"{row['perplexity_int8_activations']:.4f} (int8): {row['int8_over_float_pct']:+.3f}%; "
                      f"float16 cache {row['perplexity_int8_activations_kv16']:.4f}: "
                      f"{row['kv16_over_float32_pct']:+.3f}% (goal ≤ +{GOAL_PCT}% each)")
    for key, what in (("int8_over_float_pct", "int8 activations"), ("kv16_over_float32_pct", "float16 cache")):
        worst = max(r[key] for r in rows)
        print(f"{what}, worst: {worst:+.3f}% — goal {'met' if worst <= GOAL_PCT else 'missed'}")
    record.save(args.json, "activations", {"windows": args.windows, "goal_pct": GOAL_PCT, "rows": rows})


if __name__ == "__main__":
    main()
