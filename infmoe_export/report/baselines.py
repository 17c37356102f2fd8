"""Baseline checkpoints as reference points of the trade-off (`--baseline CKPT`, by default the
bundled dense baselines when present): each is exported once (float32, quantile noise, its own
K), its perplexity measured on the parity text, and its decode step timed beside the ∞-MoE
configurations (bench.run_bench's baselines)."""

from pathlib import Path
from typing import List, Sequence, Tuple

from ..checkpoint import bundled_baselines, load_checkpoint, read_config
from ..errors import InfMoEError
from ..evaluate import perplexity
from ..export import export_onnx
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


def prepare_baselines(paths: Sequence[Path], folder: Path, texts: Sequence[str] = (),
                      max_windows: int = 8) -> Tuple[List[Baseline], List[dict]]:
    """(what run_bench times, the facts the report shows: name, checkpoint, FFN size,
    parameters, perplexity)."""
    timed, facts = [], []
    for path in paths:
        model = load_checkpoint(path)
        c = model.config
        name = path.resolve().name
        chunks, _ = text_windows(texts, c.n_positions, max_windows)
        exported = export_onnx(model, Path(folder) / f"{name}.onnx", k=c.num_samples, noise="quantile")
        timed.append(Baseline(name, exported, model))
        facts.append({"name": name, "checkpoint": str(path), "ffn_hidden": c.ffn_hidden, "slice_width": c.slice_width,
                      "parameters": sum(p.numel() for p in model.parameters()),
                      "perplexity": perplexity(model, chunks, c.num_samples, "quantile")})
    return timed, facts
