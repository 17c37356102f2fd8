"""The quality and size figures for docs/guide/quantization.md, on the bundled model.

    .venv/bin/python -m benchmarks.quant_quality [--k 1,2,4,8] [--windows 64] [--json benchmarks/results/quant_quality.json]

Level 2 (SPEC §6) of each precision against the float32 reference, per K and noise mode, with
verify/quality.py on full 256-byte windows of the stdlib validation split. The quantized side
is the PyTorch level-1 reference (the model on w'), which every export matches within the float
tolerances (validate.py checks each one); the file sizes are real exports.
"""

import argparse
import sys
import tempfile
from pathlib import Path

from infmoe_export.checkpoint import load_checkpoint
from infmoe_export.contract import DecoderIO
from infmoe_export.export import export_onnx
from infmoe_export.runtimes.torch_runner import TorchRunner
from infmoe_export.verify.quality import quality_vs_float

from . import arguments, record

# (experts, other matrices): every precision the docs report.
SETTINGS = [("int8", "none"), ("int4", "none"), ("int4", "int4")]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--k", type=arguments.ks, default="1,2,4,8")
    parser.add_argument("--windows", type=arguments.count(), default=64)
    parser.add_argument("--json", type=Path, default=record.default_path("quant_quality"))
    args = parser.parse_args(argv)
    model = load_checkpoint(None)
    rows = []
    for noise in ("quantile", "sampled"):
        for k in args.k:
            for dtype, other in SETTINGS:
                io = DecoderIO(model.config, k, noise, with_starts=True, dtype=dtype, quantize_other=other)
                row = quality_vs_float(model, TorchRunner(io, model), max_windows=args.windows)
                rows.append(row)
                print(f"| {noise} | {k} | {dtype} | {other} | {row['perplexity_float']:.4f} | {row['perplexity']:.4f} | "
                      f"{row['perplexity_increase_pct']:+.2f}% | {100 * row['top1_agreement']:.1f}% | "
                      f"{100 * row['start_agreement']:.1f}% | {row['logit_error']['p50']:.3f} | "
                      f"{row['logit_error']['p99']:.3f} |", flush=True)
    sizes = {}
    with tempfile.TemporaryDirectory() as scratch:
        for dtype, other in [("fp32", "none"), ("fp16", "none"), *SETTINGS]:
            path = export_onnx(model, Path(scratch) / f"{dtype}_{other}.onnx", dtype=dtype, quantize_other=other).path
            sizes[f"{dtype}/{other}"] = path.stat().st_size
    for name, size in sizes.items():
        print(f"| {name} | {size / 1e6:.2f} MB | {size / sizes['fp32/none']:.3f}x |")
    record.save(args.json, "quant_quality", {"quality": rows, "sizes": sizes})
    return 0


if __name__ == "__main__":
    sys.exit(main())
