"""Baseline checkpoints as reference points of the trade-off (`--baseline CKPT`, by default the
bundled baselines that are present: dense-256 and dense-1024, the conventional MoEs moe-4x256-top1
and moe-4x256-top2). Each is compared the way the models under test are, at the same runtime and
precision: exported with the same export choice (target, precision, block size) at its own K (a
dense model's is irrelevant, a conventional MoE's is its top_k), its perplexity measured on the
parity text with the weights that precision stores (the level-1 reference, which the runtime
computes within rounding), and its decode step and prefill timed on the same backend, in the same
interleaved loop (bench.run_bench's baselines)."""

from pathlib import Path
from typing import List, Sequence, Tuple

from ..checkpoint import bundled_baselines, load_checkpoint, read_config
from ..contract import ExportChoice
from ..errors import InfMoEError
from ..evaluate import perplexity
from ..export import export_onnx
from ..quant import BITS, dequantized_model
from ..verify.parity import text_windows
from .bench import Baseline


def baseline_paths(given: Sequence[str], bundled: bool = True) -> List[Path]:
    """The --baseline checkpoints, or the bundled ones that are present when none is given (and
    bundled is True); each one's config is read here, so a bad path fails before any work."""
    paths = [Path(p) for p in given] if given else (bundled_baselines() if bundled else [])
    for path in paths:
        read_config(path)
    names = [p.resolve().name for p in paths]
    duplicate = next((n for n in names if names.count(n) > 1), None)
    if duplicate:
        raise InfMoEError(f"two baselines named {duplicate!r}: baselines are named after their folders")
    return paths


def active_units(config) -> int:
    """FFN hidden units one token runs: a conventional MoE's top_k experts, an ∞-MoE's window
    (at most K windows: the union; a dense model's whole FFN)."""
    if config.model_type == "moe-gpt2":
        return config.top_k * config.expert_hidden
    return config.slice_width


def measured_model(model, choice: ExportChoice):
    """The weights an export with this choice stores (SPEC §6's w' where quantized): the model
    whose perplexity is the export's, within rounding."""
    if choice.dtype not in BITS:
        return model
    return dequantized_model(model, BITS[choice.dtype], choice.block_size, BITS.get(choice.quantize_other))


def prepare_baselines(paths: Sequence[Path], folder: Path, choices: Sequence[ExportChoice], texts: Sequence[str] = (),
                      max_windows: int = 8) -> Tuple[List[Baseline], List[dict]]:
    """(what run_bench times, the facts the report shows: name, architecture, precision, FFN
    sizes, parameters, perplexity), one of each per baseline and export choice."""
    timed, facts = [], []
    for path in paths:
        model = load_checkpoint(path)
        name = path.resolve().name
        chunks, _ = text_windows(texts, model.config.n_positions, max_windows)
        for choice in choices:
            exported = export_onnx(model, Path(folder) / choice.dtype / f"{name}.onnx", **choice.options())
            timed.append(Baseline(name, exported, model))
            facts.append(baseline_fact(path, model, choice.dtype,
                                       perplexity(measured_model(model, choice), chunks, exported.k, "quantile")))
    return timed, facts


def baseline_fact(path: Path, model, dtype: str, perplexity_: float) -> dict:
    """What the report and the chart show of a baseline at a precision (before its timing,
    tradeoff.baseline_rows)."""
    c = model.config
    return {"name": Path(path).resolve().name, "checkpoint": str(path), "model_type": c.model_type, "dtype": dtype,
            "k": c.default_k, "ffn_hidden": c.ffn_hidden, "active_units": active_units(c),
            "parameters": sum(p.numel() for p in model.parameters()), "perplexity": perplexity_}
