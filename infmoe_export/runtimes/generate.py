"""Text generation with any runner of the registry (TorchRunner, OrtRunner, TrtRunner): each
has the exported model's DecoderIO as .io.

Prefill runs the prompt once; every next step feeds one token with present -> past, or, when
the runner offers a shared cache (OrtRunner on a model exported for the onnxruntime target),
appends it to that cache in place: no step copies the past, and the prompt's LM head runs on its
last position alone (contract.LOGITS_TO_KEEP). Tokens
are bytes (SPEC §2): only ids 0..255 are sampled, and the text is streamed through an
incremental UTF-8 decoder, so a character split over tokens prints when it is complete.
"""

import contextlib
import time
from typing import Callable, List, Optional, Sequence

import numpy as np
import torch

from ..errors import InfMoEError

BYTE_VOCAB = 256


def generate(runner, prompt_ids: Sequence[int], max_new_tokens: int = 64, *, greedy: bool = True,
             temperature: float = 1.0, top_k: Optional[int] = None, seed: int = 0,
             on_token: Optional[Callable[[int], None]] = None, timings: Optional[List[float]] = None) -> List[int]:
    """New token ids after prompt_ids. runner has .io (a DecoderIO) and Polygraphy's infer();
    the seed drives both sampling and, for sampled-noise models, expert_noise. timings, when
    given, gets the seconds of each model call appended: the prompt's prefill, then one per step."""
    decoder_io = runner.io
    prompt_ids = [int(i) for i in prompt_ids]
    check_request(decoder_io, prompt_ids, max_new_tokens, greedy=greedy, temperature=temperature, top_k=top_k)
    limit = decoder_io.config.n_positions
    generator = torch.Generator().manual_seed(seed)
    ids, new, past, step_ids = list(prompt_ids), [], None, list(prompt_ids)
    present_names = [name.replace("past_key_values", "present") for name in decoder_io.past_names]
    with contextlib.nullcontext() if runner.is_active else runner:
        shared = getattr(runner, "shared_cache", None)
        cache = shared(1) if shared is not None else None
        while len(new) < max_new_tokens and len(ids) < limit:
            noise = None
            if decoder_io.noise == "sampled":
                noise = torch.randn(1, len(step_ids), decoder_io.k, generator=generator).numpy()
            started = time.perf_counter()
            if cache is not None:
                outputs = cache.step(np.array([step_ids]), noise, last_only=True)
            else:
                feed = decoder_io.feed(np.array([step_ids]), np.ones((1, len(ids)), np.int64), past, noise)
                outputs = runner.infer(feed, check_inputs=False)
            if timings is not None:
                timings.append(time.perf_counter() - started)
            token = _pick(outputs["logits"][0, -1, :BYTE_VOCAB], greedy, temperature, top_k, generator)
            ids.append(token)
            new.append(token)
            if on_token is not None:
                on_token(token)
            if decoder_io.past:
                past = None if cache is not None else [outputs[name] for name in present_names]
                step_ids = [token]
            else:  # no cache: run the whole sequence again
                step_ids = list(ids)
    return new


def check_request(decoder_io, prompt_ids: Sequence[int], max_new_tokens: int, *, greedy: bool = True,
                  temperature: float = 1.0, top_k: Optional[int] = None) -> None:
    """Refuse a generation request before any output: an empty prompt or one that leaves no room
    in the context, a negative token count, a non-positive temperature, a top-k below 1."""
    limit = decoder_io.config.n_positions
    if len(prompt_ids) == 0:
        raise InfMoEError("the prompt is empty: give at least one byte")
    if len(prompt_ids) > limit or (max_new_tokens > 0 and len(prompt_ids) == limit):
        raise InfMoEError(f"the prompt has {len(prompt_ids)} tokens: the context (n_positions = {limit}) has no "
                          "room for new ones")
    if max_new_tokens < 0:
        raise InfMoEError(f"the number of new tokens must be >= 0, got {max_new_tokens}")
    if not greedy and not temperature > 0:
        raise InfMoEError(f"temperature must be positive, got {temperature}")
    if top_k is not None and top_k < 1:
        raise InfMoEError(f"top-k must be at least 1, got {top_k}")


def _pick(logits: np.ndarray, greedy: bool, temperature: float, top_k: Optional[int], generator) -> int:
    logits = torch.from_numpy(np.asarray(logits, dtype=np.float64))
    if greedy:
        return int(logits.argmax())
    # Shift before scaling: the best logit becomes 0, so even a temperature of 1e-300 gives
    # finite probabilities (the others go to -inf, i.e. greedy) instead of NaN.
    logits = (logits - logits.max()) / temperature
    if top_k is not None and top_k < logits.numel():
        cutoff = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < cutoff, float("-inf"))
    return int(torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator))
