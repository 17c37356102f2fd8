"""The front model's preferred batch sizes, from the batched-decode curve of the model it serves.

Triton's sequence batcher (oldest-first strategy) sends a batch to the front model at once when
the requests waiting make up one of the preferred sizes: the largest that fits, the rest waiting
for the next execute. A batch size worth waiting for or cutting to is one whose throughput is not
below a smaller size's: where the curve falls (a kernel's slower path from some B on), cutting the
batch to the size before the fall is faster than running it whole. So the preferred sizes are
every B (1 .. max batch) whose tokens/s is at least KEEP of the best smaller B's; with a curve that
rises all along, every B (no batch is ever held back or cut). ms per step between measured B are
interpolated linearly."""

from typing import Dict, List, Sequence

import numpy as np

from ..errors import InfMoEError
from ..report.bench import text_tokens
from ..runtimes.ort import SharedCache, create_session

CURVE_BATCHES = (1, 2, 4, 8, 16)
CURVE_PAST = 32     # cached tokens of each sequence at a timed step
CURVE_STEPS = 3     # timed steps per sample (their median), after one untimed
CURVE_ROUNDS = 5    # samples per batch size, interleaved (their median)
# A batch size stays preferred down to this share of the best smaller size's tokens/s: a rising
# curve measured on a busy machine dips by tens of percent without falling; a kernel's slower
# path costs several times.
KEEP = 0.8


def preferred_batch_sizes(ms_per_step: Dict[int, float], max_batch: int) -> List[int]:
    """The preferred batch sizes of a curve {B: ms per step} (B = 1 among them)."""
    if 1 not in ms_per_step or any(b < 1 or not ms > 0 for b, ms in ms_per_step.items()):
        raise InfMoEError(f"a batched-decode curve needs B = 1 and positive ms per step, got {ms_per_step}")
    measured = sorted(ms_per_step)
    batches = np.arange(1, max_batch + 1)
    ms = np.interp(batches, measured, [ms_per_step[b] for b in measured])
    tokens_per_s = batches / ms
    best_before = np.maximum.accumulate(np.concatenate([[0.0], tokens_per_s[:-1]]))
    return [int(b) for b, rate, best in zip(batches, tokens_per_s, best_before) if rate >= KEEP * best]


def measure_curve(exported, batches: Sequence[int] = CURVE_BATCHES, threads=None,
                  kernel: bool = True) -> Dict[int, float]:
    """ms per decode step of an export at each B, every sequence after CURVE_PAST tokens of text:
    on a shared cache, as the front model steps an onnxruntime-target export, else on a past fed
    in and a present returned; with the kernel library or (kernel False) the fallback functions.
    Every B is timed in each of CURVE_ROUNDS rounds, in a shuffled order (a load that drifts falls
    on all alike); the median over rounds is kept."""
    from ..report.timing import median_ms, sampled_rounds

    session = create_session(exported, kernel=kernel, providers=["CPUExecutionProvider"], intra_op_threads=threads)
    samplers = {}
    for batch in batches:
        step = decode_step(session, exported.io, batch)
        samplers[batch] = lambda step=step: median_ms(step, CURVE_STEPS)
    samples, _ = sampled_rounds(samplers, CURVE_ROUNDS)
    return {batch: float(np.median(samples[batch])) for batch in batches}


def decode_step(session, io, batch: int):
    """One decode step of `batch` sequences after CURVE_PAST tokens of text, every call at that past."""
    ids = np.tile(text_tokens(CURVE_PAST + 1)[None], (batch, 1))
    if io.shares_cache:
        cache = SharedCache(session, io, batch)
        cache.step(ids[:, :CURVE_PAST])

        def step():
            cache.length = CURVE_PAST
            cache.step(ids[:, CURVE_PAST:])
        return step
    names = [o.name for o in session.get_outputs()]
    outputs = dict(zip(names, session.run(None, io.feed(ids[:, :CURVE_PAST], np.ones((batch, CURVE_PAST), np.int64)))))
    past = [outputs[n.replace("past_key_values", "present")] for n in io.past_names]
    feed = io.feed(ids[:, CURVE_PAST:], np.ones((batch, CURVE_PAST + 1), np.int64), past)
    return lambda: session.run(None, feed)
