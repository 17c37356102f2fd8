"""`infmoe-export parity`: SPEC §5 parity of every backend against the PyTorch reference, on two
levels for a quantized model (SPEC §6): level 1 against PyTorch with the dequantized weights w',
under the float tolerances; level 2 against the float model, under the user's budget
(perplexity increase, top-1 agreement).

Polygraphy runs the backends on the same feed dicts (Comparator.run) and judges the logits
with its own per-output tolerance semantics (Comparator.compare_accuracy + SimpleCompareFunc,
element-wise: an element passes when within atol OR within rtol of the reference). What
Polygraphy cannot know is ours: which tokens' window starts agree (the verdict is given over
the tokens whose computation is the same in both backends, see compare_backend), the error
statistics per token, top-1 agreement, and perplexity.
"""

from collections import OrderedDict
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import numpy as np

from ..data import corpus_bytes, read_texts, windows
from ..errors import InfMoEError
from ..evaluate import perplexity_of_logits, sampled_noise
from ..contract import ExportedModel
from ..runtimes import registry

DEFAULT_ATOL = 1e-3
DEFAULT_RTOL = 1e-3
DEFAULT_MIN_START_AGREEMENT = 0.99
DEFAULT_MAX_WINDOWS = 8
DEFAULT_MAX_PPL_INCREASE = 0.03   # level 2: int4 with block 32 is expected within 3% (issue 10)
DEFAULT_MIN_TOP1 = 0.90
BATCH_SIZE = 4


# ---------------------------------------------------------------------------------------------
# Text and feeds


def text_windows(texts: Sequence[str], n_positions: int, max_windows: int):
    """Full-length windows of n_positions tokens (so batches need no padding) of the given text
    files, or of the stdlib validation split; at most max_windows of them."""
    data = read_texts(texts) if texts else corpus_bytes("validation")
    chunks = [w for w in windows(data, n_positions) if len(w) == n_positions][:max_windows]
    if not chunks:
        raise InfMoEError(f"text too short: parity needs at least {n_positions} tokens (one full window)")
    label = ", ".join(str(t) for t in texts) if texts else "the stdlib validation split"
    return chunks, label


def feeds_for(model_info: ExportedModel, chunks, seed: int) -> List[OrderedDict]:
    """Feed dicts of BATCH_SIZE windows each, prefill from an empty cache; sampled-noise models
    get the eval command's seeded noise (evaluate.sampled_noise), so perplexities match it."""
    noise = sampled_noise(chunks, model_info.k, seed) if model_info.noise == "sampled" else None
    feeds = []
    for start in range(0, len(chunks), BATCH_SIZE):
        ids = np.stack([c.numpy() for c in chunks[start:start + BATCH_SIZE]])
        eps = np.stack([n.numpy() for n in noise[start:start + BATCH_SIZE]]) if noise is not None else None
        feeds.append(model_info.feed(ids, expert_noise=eps))
    return feeds


# ---------------------------------------------------------------------------------------------
# Statistics Polygraphy does not compute


def starts_of(outputs: Dict[str, np.ndarray]) -> Optional[np.ndarray]:
    """[B, T, layers, K] start indices from the expert_starts.{i} outputs, None when absent."""
    names = sorted((n for n in outputs if n.startswith("expert_starts.")), key=lambda n: int(n.split(".")[1]))
    return np.stack([outputs[n] for n in names], axis=2) if names else None


def error_stats(reference: np.ndarray, test: np.ndarray) -> dict:
    """reference/test [N, V]: statistics over the N tokens of each token's max |difference|."""
    if reference.shape[0] == 0:
        return {"tokens": 0, "max": None, "mean": None, "p50": None, "p90": None, "p99": None, "max_rel": None}
    diff = np.abs(test.astype(np.float64) - reference)
    per_token = diff.max(axis=-1)
    rel = diff / np.maximum(np.abs(reference), np.finfo(np.float32).tiny)
    return {"tokens": int(per_token.size), "max": float(per_token.max()), "mean": float(per_token.mean()),
            **{f"p{p}": float(np.percentile(per_token, p)) for p in (50, 90, 99)},
            "max_rel": float(rel.max())}


def polygraphy_passes(reference: np.ndarray, test: np.ndarray, name: str, atol: float, rtol: float) -> bool:
    """Polygraphy's verdict on the logits of the compared tokens ([N, V] each)."""
    from polygraphy.comparator import Comparator, RunResults
    from polygraphy.comparator.compare import SimpleCompareFunc
    from polygraphy.logger import G_LOGGER

    results = RunResults()
    results.add([{"logits": reference}], runner_name="torch")
    results.add([{"logits": test}], runner_name=name)
    with G_LOGGER.verbosity(G_LOGGER.CRITICAL):
        verdict = Comparator.compare_accuracy(
            results, compare_func=SimpleCompareFunc(atol={"logits": atol}, rtol={"logits": rtol},
                                                    check_error_stat="elemwise"))
    return bool(verdict)


def level2(torch_model, runner, level1: dict, texts: Sequence[str], max_windows: int, seed: int) -> dict:
    """Level 2 of one backend's row: against the float model. A float export's level-1 reference
    is the float model, so its figures are level 1's; a quantized one is scored again by
    verify.quality.quality_vs_float (perplexity increase, top-1 agreement with float)."""
    if not runner.io.quantized:
        return {"float_perplexity": level1["reference_perplexity"],
                "perplexity_increase": level1["perplexity"] / level1["reference_perplexity"] - 1,
                "float_top1_agreement": level1["top1_agreement"]}
    from .quality import quality_vs_float

    figures = quality_vs_float(torch_model, runner, texts, max_windows=max_windows, seed=seed)
    return {"float_perplexity": figures["perplexity_float"], "perplexity_increase": figures["perplexity_increase_pct"] / 100,
            "float_top1_agreement": figures["top1_agreement"]}


def budget_problems(row: dict, max_ppl_increase: float, min_top1: float) -> List[str]:
    problems = []
    if row["perplexity_increase"] > max_ppl_increase:
        problems.append(f"level 2: perplexity {100 * row['perplexity_increase']:+.2f}% over float "
                        f"(budget {100 * max_ppl_increase:g}%)")
    if row["float_top1_agreement"] < min_top1:
        problems.append(f"level 2: top-1 agrees with float on {100 * row['float_top1_agreement']:.2f}% "
                        f"(< {100 * min_top1:g}%)")
    return problems


def compare_backend(name: str, reference: List[dict], test: List[dict], ids: List[np.ndarray],
                    atol: float, rtol: float, min_start_agreement: float) -> dict:
    """SPEC §5's figures of one backend against the reference, over all iterations.

    A token whose own starts agree can still differ by more than rounding when an earlier
    token of its window picked another window (attention carries the difference forward), so
    Polygraphy judges the *clean* tokens: those whose starts, and the starts of every token
    before them in the window, all agree. Without starts outputs it judges every token."""
    ref_logits = np.concatenate([r["logits"].reshape(-1, r["logits"].shape[-1]) for r in reference])
    test_logits = np.concatenate([t["logits"].reshape(-1, t["logits"].shape[-1]) for t in test])
    ref_starts = [starts_of(r) for r in reference]
    test_starts = [starts_of(t) for t in test]
    row = {"perplexity": perplexity_of_logits([t["logits"] for t in test], ids),
           "top1_agreement": float((ref_logits.argmax(-1) == test_logits.argmax(-1)).mean()),
           "error_all": error_stats(ref_logits, test_logits), "start_agreement": None,
           "agreeing_token_share": None, "error_agreeing": None, "clean_token_share": None, "error_clean": None}
    judged = np.ones(len(ref_logits), dtype=bool)
    problems = []
    if all(s is not None for s in ref_starts + test_starts):
        same = [(r == t).reshape(r.shape[0], r.shape[1], -1) for r, t in zip(ref_starts, test_starts)]  # [B, T, L*K]
        agreeing = np.concatenate([s.all(axis=-1).reshape(-1) for s in same])
        judged = np.concatenate([np.logical_and.accumulate(s.all(axis=-1), axis=1).reshape(-1) for s in same])
        row["start_agreement"] = float(np.mean(np.concatenate([s.reshape(-1) for s in same])))
        row["agreeing_token_share"] = float(agreeing.mean())
        row["error_agreeing"] = error_stats(ref_logits[agreeing], test_logits[agreeing])
        row["clean_token_share"] = float(judged.mean())
        row["error_clean"] = error_stats(ref_logits[judged], test_logits[judged])
        if row["start_agreement"] < min_start_agreement:
            problems.append(f"only {100 * row['start_agreement']:.2f}% of starts agree "
                            f"(< {100 * min_start_agreement:g}%)")
    if judged.any() and not polygraphy_passes(ref_logits[judged], test_logits[judged], name, atol, rtol):
        stats = row["error_clean"] or row["error_all"]
        problems.append(f"logits beyond atol {atol:g} / rtol {rtol:g} (max |Δ| {stats['max']:.3g}"
                        f"{' on clean tokens' if row['error_clean'] else ''})")
    row["level1"] = "fail" if problems else "pass"
    row["status"] = row["level1"]
    row["reason"] = "; ".join(problems) or None
    return row


# ---------------------------------------------------------------------------------------------
# Running the backends


def run_parity(torch_model, models: List[ExportedModel], *, backends: Sequence[str],
               engines: Optional[Path] = None, texts: Sequence[str] = (), max_windows: int = DEFAULT_MAX_WINDOWS,
               atol: float = DEFAULT_ATOL, rtol: float = DEFAULT_RTOL,
               min_start_agreement: float = DEFAULT_MIN_START_AGREEMENT,
               max_ppl_increase: float = DEFAULT_MAX_PPL_INCREASE, min_top1: float = DEFAULT_MIN_TOP1, seed: int = 0,
               progress=None) -> dict:
    """The report's parity section: one reference row and one row per backend for every model.
    A backend passes level 1 (against the reference of the model's precision, see
    compare_backend) and level 2 (against the float model, within the budget); one on int8
    activations (registry.LEVEL2_ONLY) level 2 alone, its level-1 figures shown as measured.
    progress(description) is called before each model (the pipeline's progress bar)."""
    from polygraphy.comparator import Comparator
    from polygraphy.logger import G_LOGGER

    chunks, text = text_windows(texts, torch_model.config.n_positions, max_windows)
    results = []
    for info in models:
        if progress:
            progress(f"{info.io.dtype} K={info.k} {info.noise}")
        feeds = feeds_for(info, chunks, seed)
        ids = [feed["input_ids"] for feed in feeds]
        runners, rows = [], {}
        for backend in backends:
            reason = registry.unavailable(backend, info, engines)
            if reason:
                rows[backend] = skipped_row(backend, info, reason)
            else:
                runners.append(registry.make_runner(backend, info, torch_model, engines))
        # The level-1 reference: PyTorch on the precision's dequantized weights (TorchRunner).
        reference = registry.make_runner("torch", info, torch_model, engines)
        with G_LOGGER.verbosity(G_LOGGER.ERROR):
            run = Comparator.run([reference] + runners, data_loader=feeds)
        outputs = {name: [dict(iteration.items()) for iteration in iterations] for name, iterations in run.items()}
        seconds = {name: sum(iteration.runtime or 0.0 for iteration in iterations) for name, iterations in run.items()}
        ref_ppl = perplexity_of_logits([o["logits"] for o in outputs[reference.name]], ids)
        row = {**blank_row("torch", info), "status": "reference", "perplexity": ref_ppl,
               "reference_perplexity": ref_ppl, "top1_agreement": 1.0, "seconds": seconds[reference.name]}
        results.append({**row, **level2(torch_model, reference, row, texts, max_windows, seed)})
        for runner in runners:
            row = {**blank_row(runner.name, info), "seconds": seconds[runner.name], "reference_perplexity": ref_ppl,
                   **compare_backend(runner.name, outputs[reference.name], outputs[runner.name], ids, atol, rtol,
                                     min_start_agreement)}
            if runner.name in registry.LEVEL2_ONLY:  # its figures against w' shown, not judged
                row.update(level1="n/a", status="pass", reason=None)
            row.update(level2(torch_model, runner, row, texts, max_windows, seed))
            problems = budget_problems(row, max_ppl_increase, min_top1)
            row["level2"] = "fail" if problems else "pass"
            if problems:
                row["status"] = "fail"
                row["reason"] = "; ".join(([f"level 1: {row['reason']}"] if row["reason"] else []) + problems)
            rows[runner.name] = row
        results += [{**rows[backend], "reference_perplexity": ref_ppl} for backend in backends]
    settings = {"atol": atol, "rtol": rtol, "min_start_agreement": min_start_agreement,
                "max_perplexity_increase": max_ppl_increase, "min_float_top1_agreement": min_top1,
                "windows": len(chunks), "tokens": len(chunks) * len(chunks[0]), "text": text, "seed": seed}
    return {"settings": settings, "results": results}


def blank_row(backend: str, info) -> dict:
    return {"backend": backend, "k": info.k, "noise": info.noise, "dtype": info.io.dtype, "model": str(info.path),
            "status": None, "reason": None, "level1": None, "level2": None, "perplexity": None,
            "reference_perplexity": None, "top1_agreement": None, "float_perplexity": None,
            "perplexity_increase": None, "float_top1_agreement": None, "start_agreement": None,
            "agreeing_token_share": None, "clean_token_share": None, "error_all": None, "error_agreeing": None,
            "error_clean": None, "seconds": None}


def skipped_row(backend: str, info, reason: str) -> dict:
    return {**blank_row(backend, info), "status": "skipped", "reason": reason}


def label(row: dict) -> str:
    """How reports name one backend's model: "ort int8 K=2 quantile"."""
    return f"{row['backend']} {row['dtype']} K={row['k']} {row['noise']}"


def failures(parity: Optional[dict]) -> List[str]:
    """One entry per backend and model out of tolerance, naming the failing figure."""
    return [f"{label(r)}: {r['reason']}"
            for r in (parity or {}).get("results", []) if r["status"] == "fail"]


def failure_line(parity: Optional[dict]) -> Optional[str]:
    """One line naming every backend out of tolerance, None when all passed."""
    failed = failures(parity)
    return ("parity failed for " + "; ".join(failed)) if failed else None
