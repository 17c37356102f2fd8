"""Parsing and settings shared by the commands, and what a command exports (export_choices):
the flags resolved and checked against the runtimes here, before any work."""

import math
import os
from typing import List, Optional, Sequence

import click

from .contract import (ACTIVATION_KINDS, DEFAULT_DEPLOYMENT, DEPLOYMENTS, KV_CACHES, QUANTIZE_OTHER, TARGETS,
                       ExportChoice)
from .errors import InfMoEError
from .limits import check_fits, forward_bytes
from .quant import BITS, DEFAULT_BLOCK_SIZE, PRECISIONS, check_block_size

# Seeds feed torch and numpy generators, which take 64-bit values.
# Evaluation windows of the text: more than the text has are simply all of them; the bound keeps
# a huge count from reaching the sampling arithmetic.
WINDOWS = click.IntRange(min=1, max=10**6)
SEED = click.IntRange(0, 2**63 - 1)
# Intra-op threads: more than any machine has cores is a mistake, and overflows the runtimes' int.
THREADS = click.IntRange(1, 1024)


class FiniteFloat(click.FloatRange):
    """A float range that also refuses nan and inf (click's range lets nan through)."""
    name = "finite float"

    def convert(self, value, param, ctx):
        number = super().convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value!r} is not a finite number", param, ctx)
        return number


# Counts (K, batch, sequence) beyond this are never meaningful and would overflow int32 shapes.
MAX_COUNT = 2**31 - 1


def positive_ints(text: str, option: str = "--k") -> List[int]:
    """'1,2,4,8' -> [1, 2, 4, 8], sorted and unique; anything else is a one-line error naming the option."""
    try:
        values = sorted({int(part) for part in text.split(",") if part.strip()})
    except ValueError:
        values = []
    if not values or values[0] < 1 or values[-1] > MAX_COUNT:
        raise InfMoEError(f"{option} must be a comma-separated list of positive integers up to {MAX_COUNT}, "
                          f"got {text!r}")
    return values


# The expert budgets an ∞-MoE is measured at by default (eval, bench, pipeline).
DEFAULT_KS = (1, 2, 4, 8)


def expert_budgets(text: Optional[str], config, option: str = "--k") -> List[int]:
    """--k's budgets (positive_ints), else the checkpoint's own: DEFAULT_KS for an ∞-MoE, the
    top_k of a conventional MoE (its only one)."""
    if text is not None:
        return positive_ints(text, option)
    return list(DEFAULT_KS) if config.model_type == "infmoe-gpt2" else [config.default_k]


def check_forward_memory(config, batch: int, seq: int, k: int) -> None:
    """Refuse a batch, sequence and expert budget whose forward pass would not fit in memory."""
    check_fits(forward_bytes(config, batch, seq, k), f"a forward pass at batch {batch}, sequence {seq}, K={k}")


def set_threads(threads: Optional[int] = None) -> int:
    """Torch intra-op threads: as asked, else as OMP_NUM_THREADS says, else at most 4 (small
    models gain little beyond that, and on a shared machine more threads only fight)."""
    import torch

    if threads is None and os.environ.get("OMP_NUM_THREADS"):
        return torch.get_num_threads()
    threads = threads or min(4, os.cpu_count() or 1)
    torch.set_num_threads(threads)
    return threads


def precision_list(text: str) -> List[str]:
    """'fp32,int4' -> ['fp32', 'int4'] in PRECISIONS order; anything else is a one-line error."""
    names = {part.strip() for part in text.split(",") if part.strip()}
    if not names or names - set(PRECISIONS):
        raise InfMoEError(f"--dtype must be a comma-separated list of {', '.join(PRECISIONS)}, got {text!r}")
    return [name for name in PRECISIONS if name in names]


# ---------------------------------------------------------------------------------------------
# What a command exports: one flag per intent. `--for` names the runtime, `--dtype` the weights;
# together they give the fastest artifact for that runtime. The finer flags (`--quantize-other`,
# `--target`) stay for experts-only or mixed precision and for graphs written for elsewhere.

# What the onnxruntime target's int8 / int4 matrices multiply by default (docs/design/kernel.md):
# int8 activations decode one sequence faster than float ones on int4 weights and about as fast on
# int8 weights, and batch and prefill both faster (benchmarks/results/peers.json: the -a8 rows).
QUANTIZED_ACTIVATIONS = "int8"


def export_choices(config, dtypes: Optional[Sequence[str]] = None, *, deploy: Optional[str] = None,
                   quantize_other: Optional[str] = None, target: Optional[str] = None,
                   block_size: Optional[int] = None, activations: Optional[str] = None,
                   kv_cache: Optional[str] = None) -> List[ExportChoice]:
    """The flags as one ExportChoice per precision in dtypes (default fp32), checked before any
    export; None is a flag not given. A conflict is a one-line error naming both flags.

    - The target is --target, else --for, else onnxruntime; when neither was given and config's
      head_dim does not fit onnxruntime's attention, the portable graph (with a note). --for is
      checked against its runtime: tensorrt must be installed, onnxruntime must fit (and without
      the kernel library here, a note says the model runs on its functions).
    - int8 / int4 quantize every matrix the runtime reads fast at that precision: onnxruntime
      and portable the experts, attention and the tied embedding / LM head (the router,
      LayerNorms and biases stay float); tensorrt the experts (its plugin). --quantize-other
      overrides that for the int8 / int4 models; fp32 and fp16 models stay float.
    - The onnxruntime target's int8 and int4 models run their quantized ops on int8 activations
      (integer dot products, judged at level 2: the faster path, as onnxruntime-genai's int4 CPU
      models do; QUANTIZED_ACTIVATIONS). --activations chooses either. Other models are float.
    - The KV cache is float32, or float16 (--kv-cache) on the onnxruntime target only: by default
      there for the models on int8 activations, which are judged at level 2 already (a float16
      cache is within the same budget: benchmarks.activations)."""
    dtypes = list(dtypes or ["fp32"])
    quantized = [d for d in dtypes if d in BITS]
    if deploy is not None and target is not None and target != deploy:
        raise InfMoEError(f"--target {target} conflicts with --for {deploy}: give one of them")
    if quantize_other not in (None, "none") and not quantized:
        raise InfMoEError(f"--quantize-other {quantize_other} applies to int8 / int4 models, and --dtype has none")
    if quantize_other is not None and quantize_other not in QUANTIZE_OTHER:
        raise InfMoEError(f"--quantize-other must be one of {', '.join(QUANTIZE_OTHER)}, got {quantize_other!r}")
    if block_size is not None:  # a bad value is an error even where nothing is quantized
        try:
            check_block_size(block_size)
        except InfMoEError as error:
            raise InfMoEError(f"--block-size: {error}") from None
    block_size = DEFAULT_BLOCK_SIZE if block_size is None else block_size
    if activations is not None and activations not in ACTIVATION_KINDS:
        raise InfMoEError(f"--activations must be one of {', '.join(ACTIVATION_KINDS)}, got {activations!r}")
    if kv_cache is not None and kv_cache not in KV_CACHES:
        raise InfMoEError(f"--kv-cache must be one of {', '.join(KV_CACHES)}, got {kv_cache!r}")
    chosen, note = target or deploy or DEFAULT_DEPLOYMENT, None
    if activations == "int8" and not quantized:
        raise InfMoEError("--activations int8 applies to int8 / int4 weights, and --dtype has none")
    if chosen == "onnxruntime":
        from .export.ort_target import HEAD_DIM_MULTIPLE, fits_onnxruntime

        if not fits_onnxruntime(config):
            problem = (f"this checkpoint's head_dim {config.head_dim} is not a multiple of {HEAD_DIM_MULTIPLE}, "
                       "which onnxruntime's attention needs")
            if target or deploy:
                raise InfMoEError(f"--{'target' if target else 'for'} onnxruntime: {problem}: use --for portable")
            chosen, note = "portable", f"the portable graph: {problem}"
        else:
            from .runtimes.ort_kernel import custom_op_library

            if custom_op_library() is None:
                note = ("the onnxruntime kernel library is not installed here: the model's infmoe ops run as "
                        "their fallback functions, slower (docs/guide/onnxruntime.md)")
    why = f"--target {target}" if target else f"--for {deploy}" if deploy else note
    if activations == "int8" and chosen != "onnxruntime":
        raise InfMoEError(f"--activations int8 runs in our kernels on the onnxruntime target, not {why}")
    if kv_cache == "float16" and chosen != "onnxruntime":
        raise InfMoEError(f"--kv-cache float16 applies to the onnxruntime target's attention, not {why}")
    if deploy == "tensorrt":
        from .runtimes.tensorrt import tensorrt_problem

        problem = tensorrt_problem()
        if problem:
            raise InfMoEError(f"--for tensorrt: {problem} (--target tensorrt writes its graph without it)")

    def other(dtype: str) -> str:
        if dtype not in BITS:
            return "none"
        if quantize_other is not None:
            return quantize_other
        return "none" if chosen == "tensorrt" else dtype

    def kind(dtype: str) -> str:
        if dtype not in BITS or chosen != "onnxruntime":
            return "float"
        return activations or QUANTIZED_ACTIVATIONS

    def cache(dtype: str) -> str:
        return kv_cache or ("float16" if kind(dtype) == "int8" else "float32")

    return [ExportChoice(chosen, dtype, other(dtype), block_size if dtype in BITS else DEFAULT_BLOCK_SIZE,
                         kind(dtype), cache(dtype), note) for dtype in dtypes]


DEPLOYMENT_HELP = {"onnxruntime": "onnxruntime (the default: its fused graph, int8 / int4 read by our kernels)",
                   "tensorrt": "tensorrt (the standard-op graph of `infmoe-export trt`; needs TensorRT here)",
                   "portable": "portable (standard ops and the expert op, for any runtime or tool)"}


QUANTIZE_OTHER_HELP = ("Finer: attention and the tied embedding / LM head of the int8 / int4 models (default: as "
                       "--dtype; none: the experts only).")


ACTIVATIONS_HELP = ("Finer: what the onnxruntime target's int8 / int4 matrices multiply: int8 (integer dot products, "
                    "judged by the accuracy budget; the default) or float (SPEC §6's exact float32 path). A session's "
                    "infmoe.activations option overrides it.")


KV_CACHE_HELP = ("Finer: the onnxruntime target's KV cache (past_key_values.*, present.*): float16 (half the bytes "
                 "a decode step reads of it; keys and values rounded, judged by the accuracy budget: the default "
                 "with int8 activations) or float32 (the default otherwise).")


def _weight_bytes(bits: int) -> str:
    """Bytes a weight takes at bits with float32 block scales, over float32's four."""
    return f"{(bits / 8 + 4 / DEFAULT_BLOCK_SIZE) / 4:.2f}x"


# The choices in one table (click prints a paragraph that starts with \b as written).
CHOICES_TABLE = "\n".join([
    "\b",
    "--for        --dtype     what is written                                  bytes a weight",
    "onnxruntime  fp32        fused attention, a KV buffer shared in place     1x (the default)",
    "onnxruntime  fp16        the experts in float16                           0.50x (experts)",
    f"onnxruntime  int8        int8 experts, attention, LM head: our kernels    {_weight_bytes(8)}",
    f"onnxruntime  int4        int4 experts, attention, LM head: our kernels    {_weight_bytes(4)}",
    "tensorrt     any         standard ops for `infmoe-export trt`; int8 / int4: the experts",
    "portable     any         standard ops and the expert op; int8 / int4: DequantizeLinear too",
    "",
    "The router, LayerNorms and biases stay float32 in every precision; --quantize-other none makes",
    "int8 / int4 the experts only. onnxruntime int8 / int4 multiply int8 activations (integer dot",
    "products) and keep a float16 KV cache, half its bytes (--activations float --kv-cache float32:",
    "SPEC §6's float path). Decode is bound by the bytes read; measured speed per choice: python -m",
    "benchmarks.quant_model, its results in benchmarks/results/quant_model.json.",
])


def export_choice_options(*, many: bool = False, deployments: Sequence[str] = DEPLOYMENTS, target: bool = False,
                          dtype_names: Sequence[str] = ("--dtype",)):
    """The flags of export_choices on a command: --for (among deployments), --dtype (a
    comma-separated list where many; dtype_names: its spellings), --quantize-other, --block-size, --activations,
    --kv-cache, and --target where asked.
    Every default is None (a flag not given): export_choices applies the defaults. The choices'
    table is in the help of the command with --target (onnx)."""
    def decorate(command):
        runtimes = " or ".join([", ".join(DEPLOYMENT_HELP[d] for d in deployments[:-1]), DEPLOYMENT_HELP[deployments[-1]]])
        tensorrt = "; --for tensorrt: the experts" if "tensorrt" in deployments else ""
        table = "above" if target else "`infmoe-export onnx --help`"
        options = [
            click.option("--for", "deploy", type=click.Choice(deployments), default=None,
                         help=f"The runtime the model is for: {runtimes}. The table: {table}."),
            click.option(*dtype_names, "dtype", default=None, type=None if many else click.Choice(PRECISIONS),
                         help="Weights: fp32 (the default), fp16 (the experts in float16), int8 / int4 (every matrix "
                              f"but the router, LayerNorms and biases{tensorrt})."
                              + (" Comma-separated: one model each." if many else "")),
            click.option("--quantize-other", type=click.Choice(QUANTIZE_OTHER), default=None,
                         help=QUANTIZE_OTHER_HELP + (" --for tensorrt: none unless given." if tensorrt else "")),
            click.option("--block-size", type=int, default=None,
                         help=f"Weights per int8 / int4 scale, along the input dimension (a power of two >= 16; "
                              f"default {DEFAULT_BLOCK_SIZE})."),
            click.option("--activations", type=click.Choice(ACTIVATION_KINDS), default=None,
                         help=ACTIVATIONS_HELP),
            click.option("--kv-cache", type=click.Choice(KV_CACHES), default=None, help=KV_CACHE_HELP),
        ]
        if target:
            options.append(click.option("--target", type=click.Choice(TARGETS), default=None,
                                        help="Finer: the graph's target whatever the runtime here (--for checks "
                                             "it): standard ops (portable, tensorrt) or onnxruntime's fused graph."))
        for option in reversed(options):
            command = option(command)
        return command
    return decorate


def choices_from_flags(config, deploy, dtype, quantize_other, block_size, target=None,
                       activations=None, kv_cache=None) -> List[ExportChoice]:
    """export_choices of a command's export_choice_options values (dtype a list where many)."""
    dtypes = None if dtype is None else precision_list(dtype)
    return export_choices(config, dtypes, deploy=deploy, quantize_other=quantize_other, target=target,
                          block_size=block_size, activations=activations, kv_cache=kv_cache)
