"""Side by side with the peers, in one run: our exports, llama.cpp and onnxruntime's own MatMulNBits.

    .venv/bin/python -m benchmarks.peers [--quick] [--rounds 5] [--threads 2] [--skip-llama]
                                         [--json benchmarks/results/peers.json]

What runs, each on the CPU with the same intra-op threads:

- ours: the GPT-2-Small-size ∞-MoE (shapes.SMALL, random weights) exported by infmoe_export with
  `--target onnxruntime` (block 32) at fp32, all-int8 and all-int4 (`dtype` and `quantize_other`),
  the quantized ones on float and (`-a8`, their default) int8 activations, K = 1, 2, 8, run by
  onnxruntime with the compiled kernel;
- llama.cpp (llama-cpp-python) running dense GPT-2 Small and Medium with random weights, written
  as GGUF (llama.cpp's `gpt2` architecture) by the gguf package at F16, Q8_0 and Q4_0
  (benchmarks.gguf_model); skipped, with the reason, where llama_cpp does not import;
- onnxruntime's own int4 MatMulNBits on the dense GPT-2-Medium-size model
  (sessions.dense_matmulnbits).

What is measured, every contender of a measurement timed in the same rounds (a shuffled order
each round, each sample after a pause that lets the previous runtime's threads sleep; a sample is
the median of a few back-to-back steps):

- batch-1 decode ms/token at past 128 and 512 (every step at exactly that past);
- batched decode: one step for B sequences (each its own copy of a past of 128), tokens/s at
  B = 1, 2, 4, 8, 16, 32; ours at K = 2 only (our KV cache holds n_positions per sequence: at
  B = 32 it is 2.4 GB per model), and not the MatMulNBits model;
- prefill of 128 and 512 tokens, tokens/s (each returns the logits of the last token, what a
  generation's next token needs: ours through the onnxruntime target's logits_to_keep);
- peak RSS of a fresh process that loads the model, prefills 128 tokens and decodes a few steps
  (infmoe_export.report.memory for onnxruntime, benchmarks.llama for llama.cpp), and the model's
  share of it (peak minus the process before loading).

Then the goals that this run can judge (PEER_GOALS: ours against llama.cpp, each speed-up the
median over rounds of the two's times in the same round; and the batched curve, which must never
fall as B grows and must reach B16_OVER_B1 times B = 1's tokens/s at B = 16, B = 1's steps timed in
B = 16's rounds for that ratio). Results: benchmarks/results/peers.json; the README's
table comes from it (python -m benchmarks.table).
"""

import argparse
import dataclasses
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from statistics import median
from typing import Callable, Dict, List, Optional

from . import arguments, record

PRECISIONS = {"fp32": {}, "all-int8": {"dtype": "int8", "quantize_other": "int8"},
              "all-int4": {"dtype": "int4", "quantize_other": "int4"},
              # -a8: on the kernel's int8 activations (infmoe.activations) with a float16 KV cache
              "all-int8-a8": {"dtype": "int8", "quantize_other": "int8", "activations": "int8", "kv_cache": "float16"},
              "all-int4-a8": {"dtype": "int4", "quantize_other": "int4", "activations": "int8", "kv_cache": "float16"}}
# all-int8-a8 and all-int4-a8 are what `infmoe-export onnx --dtype int8|int4` write: measured by default.
DEFAULT_PRECISIONS = ("fp32", "all-int8", "all-int8-a8", "all-int4", "all-int4-a8")


def precision_options(precision: str) -> tuple:
    """(export_onnx's keyword arguments, the kernel's activations) of one of PRECISIONS."""
    options = dict(PRECISIONS[precision])
    return options, options.pop("activations", "float")
KS = (1, 2, 8)
BATCHED_K = 2
LLAMA_SIZES = ("Small", "Medium")
LLAMA_TYPES = ("F16", "Q8_0", "Q4_0")


@dataclasses.dataclass(frozen=True)
class Plan:
    """What one run measures."""
    precisions: tuple = DEFAULT_PRECISIONS
    ks: tuple = KS
    llama_sizes: tuple = LLAMA_SIZES
    llama_types: tuple = LLAMA_TYPES
    matmulnbits: bool = True
    pasts: tuple = (128, 512)
    batches: tuple = (1, 2, 4, 8, 16, 32)
    batched_past: int = 128
    prefills: tuple = (128, 512)
    steps: int = 5  # decode steps per sample


QUICK = Plan(precisions=("all-int4",), ks=(BATCHED_K,), llama_sizes=("Small",), llama_types=("Q4_0",),
             pasts=(128,), batches=(1, 4), prefills=(128,), steps=3)


def ours_name(precision: str, k: int) -> str:
    return f"ours {precision} K={k}"


def llama_name(size: str, file_type: str) -> str:
    return f"llama.cpp {size} {file_type}"


NBITS_NAME = "onnxruntime MatMulNBits Medium int4"

# The goals against the peers, each (what, ours, peer, measurement, at least ours / peer):
# measurement is ("decode", past), ("batched", B) or ("prefill", tokens), compared in tokens/s.
# Judged for both paths of all-int4: float activations (SPEC §6 level 1) and int8 ones (the
# integer dot products, judged at level 2, as llama.cpp's Q4_0 multiplies its Q8_0 activations).
SMALL_Q4, MEDIUM_Q4 = llama_name("Small", "Q4_0"), llama_name("Medium", "Q4_0")
PEER_GOALS = [goal for precision in ("all-int4", "all-int4-a8") for goal in (
    (f"batch-1 decode, past 128: ours K=2 {precision} vs llama.cpp Small Q4_0", ours_name(precision, 2), SMALL_Q4,
     ("decode", 128), 1.3),
    (f"batched decode B=16: ours K=2 {precision} vs llama.cpp Small Q4_0", ours_name(precision, 2), SMALL_Q4,
     ("batched", 16), 2.0),
    (f"prefill 512: ours K=2 {precision} vs llama.cpp Small Q4_0", ours_name(precision, 2), SMALL_Q4,
     ("prefill", 512), 1.2),
    (f"prefill 512: ours K=8 {precision} vs llama.cpp Medium Q4_0", ours_name(precision, 8), MEDIUM_Q4,
     ("prefill", 512), 2.5))]
NO_CLIFF = 0.95   # each B's tokens/s at least this much of the best smaller B's
CURVE_TOP, B16_OVER_B1 = 16, 3.0  # B = CURVE_TOP's tokens/s at least B16_OVER_B1 times B = 1's


@dataclasses.dataclass
class Contender:
    """One model in one runtime: step factories for each measurement, and its peak RSS."""
    name: str
    runtime: str
    model: str
    precision: str
    k: Optional[int]
    path: Path
    decode: Callable[[int], Callable]            # past -> step
    batched: Optional[Callable[[int, int], Callable]]  # (past, B) -> step; None: not measured
    prefill: Callable[[int], Callable]           # tokens -> step
    rss: Callable[[], dict]
    close: Callable[[], None] = lambda: None
    kv_cache: Optional[str] = None               # ours: the exported KV cache's type

    def describe(self) -> dict:
        return {"name": self.name, "runtime": self.runtime, "model": self.model, "precision": self.precision,
                "k": self.k, "file_bytes": file_bytes(self.path),
                **({"kv_cache": self.kv_cache} if self.kv_cache else {})}


def file_bytes(path: Path) -> int:
    """The model's bytes on disk: the file and, for ONNX, its external data beside it."""
    if path.suffix == ".onnx":
        from infmoe_export.report.memory import files_of

        return sum(f.stat().st_size for f in files_of(path))
    return path.stat().st_size


def onnxruntime_contender(name, runtime, model, precision, k, exported, threads, batched: bool,
                          activations: str = "float") -> Contender:
    import onnxruntime as ort

    from infmoe_export.report.memory import measure_child
    from infmoe_export.runtimes.ort_kernel import ACTIVATIONS

    from .sessions import Decoder
    from .shapes import PAST

    options = ort.SessionOptions()
    options.add_session_config_entry(ACTIVATIONS, activations)
    decoder = Decoder(exported, threads, options=options)
    return Contender(name, runtime, model, precision, k, exported.path, decode=decoder.step_at,
                     batched=(lambda past, b: decoder.step_at(past, b)) if batched else None,
                     prefill=decoder.prefill_at,
                     rss=lambda: measure_child("ort", exported, None, PAST, threads, None),
                     kv_cache=exported.io.kv_cache)


def llama_contender(size: str, file_type: str, path: Path, threads: int) -> Contender:
    from infmoe_export.report.bench import text_tokens

    from .llama import LlamaModel
    from .shapes import PAST

    model = LlamaModel(path, threads)
    return Contender(llama_name(size, file_type), "llama.cpp", f"GPT-2 {size} (dense)", file_type, None, path,
                     decode=lambda past: model.step_at(text_tokens(past + 1), past),
                     batched=lambda past, b: model.step_at(text_tokens(past + 1), past, b),
                     prefill=lambda n: model.prefill_at(text_tokens(n)),
                     rss=lambda: llama_rss(path, threads, PAST), close=model.close)


def llama_rss(path: Path, threads: int, past: int) -> dict:
    """benchmarks.llama's child: its JSON, or {"error": its last line}."""
    done = subprocess.run([sys.executable, "-m", "benchmarks.llama", str(path), "--threads", str(threads),
                           "--past", str(past)], capture_output=True, text=True,
                          cwd=Path(__file__).resolve().parent.parent)
    if done.returncode != 0:
        return {"error": (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def kv_cache_bytes(config, batch: int) -> int:
    """Our shared KV cache of `batch` sequences (runtimes.ort.SharedCache): n_positions each."""
    return 2 * config.n_layer * batch * config.n_positions * config.d_model * 4


def available_memory_bytes() -> Optional[int]:
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def check_memory(plan: Plan, config) -> None:
    """Refuse a plan whose batched decode would not fit, before anything is allocated: at the
    largest B, one KV cache per precision of ours at once (the weights of every export besides)."""
    params = sum(config.n_layer * n for n in (4 * config.d_model ** 2, 2 * config.ffn_hidden * config.d_model)) + \
        config.vocab_size * config.d_model
    bits = {"fp32": 32, "int8": 8, "int4": 4}
    weights = sum(params * bits[PRECISIONS[p].get("dtype", "fp32")] // 8 for p in plan.precisions) * len(plan.ks)
    caches = len(plan.precisions) * kv_cache_bytes(config, max(plan.batches))
    available = available_memory_bytes()
    if available is not None and weights + caches > available:
        raise SystemExit(f"benchmarks.peers: this plan needs about {(weights + caches) / 2**30:.1f} GiB "
                         f"(B = {max(plan.batches)}), {available / 2**30:.1f} GiB is available: use --quick")


def timed(contenders: List[Contender], make_step: Callable[[Contender], Optional[Callable]], rounds: int,
          steps: int) -> Dict[str, List[float]]:
    """ms samples per contender: every contender's step in the same rounds (timing.sampled_rounds),
    each sample the median of `steps` steps."""
    from infmoe_export.report.timing import median_ms, sampled_rounds

    prepared = {c.name: make_step(c) for c in contenders}
    samplers = {name: (lambda step=step: median_ms(step, steps)) for name, step in prepared.items() if step}
    samples, _ = sampled_rounds(samplers, rounds)
    return samples


def measure(contenders: List[Contender], plan: Plan, rounds: int, log) -> dict:
    """Every measurement of the plan on every contender that takes it."""
    result = {"decode": [], "batched": [], "prefill": []}
    for past in plan.pasts:
        log(f"batch-1 decode, past {past}")
        samples = timed(contenders, lambda c: c.decode(past), rounds, plan.steps)
        result["decode"].append({"past": past, "ms": {n: median(s) for n, s in samples.items()}, "samples_ms": samples})
    for batch in plan.batches:
        log(f"batched decode, B = {batch}, past {plan.batched_past}")
        # At CURVE_TOP our contenders' B = 1 steps run in the same rounds too (as "name at B=1"), so
        # that the curve's goal is a ratio within rounds, not of two measurements minutes apart
        # (ours only: the goal is ours, and a llama.cpp model holds one batch size's context at a time).
        paired = [dataclasses.replace(c, name=at_b1(c.name)) for c in contenders
                  if c.name in CURVE_NAMES and batch == CURVE_TOP and 1 in plan.batches]
        b1_names = {c.name for c in paired}
        samples = timed(contenders + paired, lambda c: c.batched(plan.batched_past, 1 if c.name in b1_names else batch)
                        if c.batched else None, rounds, plan.steps)
        b1_samples = {n: samples.pop(at_b1(n)) for n in list(samples) if at_b1(n) in samples}
        ms = {n: median(s) for n, s in samples.items()}
        result["batched"].append({"batch": batch, "past": plan.batched_past, "ms_per_step": ms,
                                  "tokens_per_s": {n: batch / (v / 1e3) for n, v in ms.items()},
                                  "samples_ms": samples, **({"b1_samples_ms": b1_samples} if b1_samples else {})})
    for tokens in plan.prefills:
        log(f"prefill, {tokens} tokens")
        samples = timed(contenders, lambda c: c.prefill(tokens), rounds, 1)
        ms = {n: median(s) for n, s in samples.items()}
        result["prefill"].append({"tokens": tokens, "ms": ms,
                                  "tokens_per_s": {n: tokens / (v / 1e3) for n, v in ms.items()},
                                  "samples_ms": samples})
    return result


def memory(contenders: List[Contender], log) -> dict:
    """Peak RSS of each contender in a fresh process."""
    rows = {}
    for c in contenders:
        log(f"peak RSS, {c.name}")
        measured = c.rss()
        if "error" not in measured:
            measured["model_rss_bytes"] = measured["peak_rss_bytes"] - measured["rss_before_load_bytes"]
        rows[c.name] = measured
    return rows


def row_of(result: dict, measurement: tuple) -> Optional[dict]:
    """The result's row of one measurement: ("decode", past), ("batched", B) or ("prefill", tokens)."""
    kind, at = measurement
    key = {"decode": "past", "batched": "batch", "prefill": "tokens"}[kind]
    return next((r for r in result[kind] if r[key] == at), None)


def speedup(result: dict, measurement: tuple, ours: str, peer: str) -> Optional[float]:
    """How many times faster ours ran than the peer: the median over rounds of the peer's time over
    ours in the same round (a round that the machine slowed falls on both sides of its ratio);
    None when either was not measured."""
    from infmoe_export.report.timing import paired_ratio

    row = row_of(result, measurement) or {}
    samples = row.get("samples_ms", {})
    if ours not in samples or peer not in samples:
        return None
    return paired_ratio(samples[peer], samples[ours])


CURVE_NAMES = {ours_name(precision, BATCHED_K) for precision in PRECISIONS}  # whose batched curve has goals


def at_b1(name: str) -> str:
    return f"{name} at B=1"


def curve_gain(result: dict, name: str) -> Optional[float]:
    """B = CURVE_TOP's tokens/s over B = 1's: the median over rounds of the two steps' ratio in the
    same round (CURVE_TOP's row's b1_samples_ms), else (a run without them) of the two rows' medians;
    None when either was not measured."""
    from infmoe_export.report.timing import paired_ratio

    top, one = row_of(result, ("batched", CURVE_TOP)) or {}, row_of(result, ("batched", 1)) or {}
    if name in top.get("b1_samples_ms", {}):
        return CURVE_TOP * paired_ratio(top["b1_samples_ms"][name], top["samples_ms"][name])
    if name in top.get("tokens_per_s", {}) and name in one.get("tokens_per_s", {}):
        return top["tokens_per_s"][name] / one["tokens_per_s"][name]
    return None


def goals(result: dict) -> List[dict]:
    """The goals that this run measured: ratios of ours to a peer, and the batched curve."""
    out = []
    for what, ours, peer, measurement, least in PEER_GOALS:
        value = speedup(result, measurement, ours, peer)
        if value is not None:
            out.append({"what": what, "value": value, "goal": least, "met": value >= least})
    for precision in PRECISIONS:
        name = ours_name(precision, BATCHED_K)
        curve = [(row["batch"], row["tokens_per_s"][name]) for row in result["batched"] if name in row["tokens_per_s"]]
        if len(curve) < 2:
            continue
        worst = min(rate / max(r for _, r in curve[:i]) for i, (_, rate) in enumerate(curve) if i)
        out.append({"what": f"batched decode never falls as B grows: {name}, worst B over the best smaller B",
                    "value": worst, "goal": NO_CLIFF, "met": worst >= NO_CLIFF})
        value = curve_gain(result, name)
        if value is not None:
            out.append({"what": f"batched decode B={CURVE_TOP} over B=1: {name}", "value": value,
                        "goal": B16_OVER_B1, "met": value >= B16_OVER_B1})
    return out


def table_rows(result: dict) -> List[List[str]]:
    """One row per contender: decode ms/token, batched tokens/s, prefill tokens/s, RSS."""
    rows = []
    for c in result["contenders"]:
        name = c["name"]
        row = [name]
        row += [fmt(r["ms"].get(name), ".2f") for r in result["decode"]]
        row += [fmt(r["tokens_per_s"].get(name), ".0f") for r in result["batched"]]
        row += [fmt(r["tokens_per_s"].get(name), ".0f") for r in result["prefill"]]
        mem = (result.get("memory") or {}).get(name, {})
        row.append(fmt(mem["model_rss_bytes"] / 2**20, ".0f") if "model_rss_bytes" in mem else "–")
        rows.append(row)
    return rows


def table_header(result: dict) -> List[str]:
    return (["contender"] + [f"decode p{r['past']} ms" for r in result["decode"]] +
            [f"B={r['batch']} tok/s" for r in result["batched"]] +
            [f"prefill {r['tokens']} tok/s" for r in result["prefill"]] + ["RSS MiB"])


def fmt(value: Optional[float], spec: str) -> str:
    return "–" if value is None else format(value, spec)


def print_result(result: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"side by side, {result['options']['threads']} threads (RSS: the model's share of "
                        "a fresh process's peak)")
    for i, column in enumerate(table_header(result)):
        table.add_column(column, justify="left" if i == 0 else "right")
    for row in table_rows(result):
        table.add_row(*row)
    console = Console()
    if not console.is_terminal:  # a log file: rows on one line each
        console.width = 200
    console.print(table)
    for skipped, reason in result["skipped"].items():
        console.print(f"{skipped}: skipped ({reason})")
    for goal in result["goals"]:
        console.print(f"{goal['what']}: {goal['value']:.2f} "
                      f"({'[green]met[/]' if goal['met'] else '[red]MISSED[/]'}: ≥ {goal['goal']})")


def build_contenders(plan: Plan, threads: int, scratch: Path, skip_llama: bool, log) -> tuple:
    """Exports, GGUF files and sessions of the plan; (contenders, skipped: {what: why})."""
    import torch

    from infmoe_export.contract import ExportedModel
    from infmoe_export.export import export_onnx
    from infmoe_export.model import InfMoEGPT

    from .llama import available
    from .sessions import dense_matmulnbits
    from .shapes import BLOCK, MEDIUM_DENSE, SMALL, SMALL_DENSE

    contenders, skipped = [], {}
    torch.manual_seed(0)
    small = InfMoEGPT(SMALL).eval()
    for precision in plan.precisions:
        for k in plan.ks:
            log(f"exporting ours {precision} K={k}")
            options, activations = precision_options(precision)
            exported = export_onnx(small, scratch / f"ours_{precision}_k{k}.onnx", k=k, block_size=BLOCK,
                                   target="onnxruntime", **options)
            contenders.append(onnxruntime_contender(ours_name(precision, k), "onnxruntime + infmoe kernel",
                                                    "∞-MoE, GPT-2 Small size", precision, k, exported, threads,
                                                    batched=k == BATCHED_K, activations=activations))
    del small
    if plan.matmulnbits:
        log("exporting the dense Medium MatMulNBits model")
        exported = dense_matmulnbits(scratch)
        contenders.append(onnxruntime_contender(NBITS_NAME, "onnxruntime", "GPT-2 Medium size (dense)", "int4", None,
                                                ExportedModel.read(exported.path), threads, batched=False))
    reason = "--skip-llama" if skip_llama else available()
    if reason:
        skipped["llama.cpp"] = reason
        return contenders, skipped
    from .gguf_model import write_gpt2

    configs = {"Small": SMALL_DENSE, "Medium": MEDIUM_DENSE}
    for size in plan.llama_sizes:
        for file_type in plan.llama_types:
            log(f"writing GGUF GPT-2 {size} {file_type}")
            path = write_gpt2(scratch / f"gpt2_{size.lower()}_{file_type}.gguf", configs[size], file_type)
            contenders.append(llama_contender(size, file_type, path, threads))
    return contenders, skipped


def parse_args(argv=None):
    parser = argparse.ArgumentParser(prog="python -m benchmarks.peers", description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="few configurations: a smoke run")
    parser.add_argument("--rounds", type=arguments.count(1, 1000), default=5, help="interleaved rounds per measurement")
    parser.add_argument("--threads", type=arguments.thread_count, default=2, help="threads of every runtime")
    parser.add_argument("--skip-llama", action="store_true", help="leave llama.cpp out")
    # Not given: the plan's (the full one's, or --quick's).
    parser.add_argument("--precisions", type=names(PRECISIONS), default=argparse.SUPPRESS,
                        help=f"ours, comma-separated, of {', '.join(PRECISIONS)} (default: {', '.join(DEFAULT_PRECISIONS)})")
    parser.add_argument("--ks", type=arguments.ks, default=argparse.SUPPRESS,
                        help=f"ours' expert budgets (default: {', '.join(map(str, KS))})")
    parser.add_argument("--llama-types", type=names(LLAMA_TYPES), default=argparse.SUPPRESS,
                        help=f"llama.cpp's, of {', '.join(LLAMA_TYPES)} (default: all)")
    parser.add_argument("--json", type=Path, default=record.default_path("peers"), help="where to write the results")
    return parser.parse_args(argv)


def names(known):
    """Comma-separated names, each one of `known`."""
    def parse(text: str) -> tuple:
        chosen = tuple(part.strip() for part in text.split(",") if part.strip())
        unknown = [n for n in chosen if n not in known]
        if unknown or not chosen:
            raise argparse.ArgumentTypeError(f"expected names of {', '.join(known)}, got {text!r}")
        return chosen

    return parse


def main(argv=None):
    args = parse_args(argv)
    plan = QUICK if args.quick else Plan()
    chosen = {field: tuple(getattr(args, field)) for field in ("precisions", "ks", "llama_types") if hasattr(args, field)}
    plan = dataclasses.replace(plan, **chosen)
    from .shapes import SMALL

    check_memory(plan, SMALL)
    from infmoe_export.runtimes.ort_kernel import custom_op_library

    if custom_op_library() is None:
        sys.exit("benchmarks.peers: the compiled kernel is not installed (docs/guide/onnxruntime.md)")
    sys.stdout.reconfigure(line_buffering=True)

    def log(what):
        print(f"[peers] {what}")

    result = {"plan": dataclasses.asdict(plan), "options": {**vars(args), "json": str(args.json)}}
    with tempfile.TemporaryDirectory(prefix="peers-") as scratch:
        contenders, result["skipped"] = build_contenders(plan, args.threads, Path(scratch), args.skip_llama, log)
        result["contenders"] = [c.describe() for c in contenders]
        try:
            result.update(measure(contenders, plan, args.rounds, log))
        finally:
            for c in contenders:
                c.close()
        result["memory"] = memory(contenders, log)
    result["goals"] = goals(result)
    print_result(result)
    print(f"results: {record.save(args.json, 'peers', result, args.threads)}")


if __name__ == "__main__":
    main()
