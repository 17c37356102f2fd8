"""The decoding front model of the repository: a Triton Python-backend model (copied to
REPO/infmoe/1/model.py). It imports no infmoe_export module, only numpy, onnxruntime (the
"local" executor) and Triton's triton_python_backend_utils, so the repository runs on a stock
Triton container.

One request is one step of one sequence (Triton's sequence batcher: a correlation id, START on
the first step, END on the last): INPUT_IDS are the new tokens (the prompt on the first step,
then the token just generated), and the reply is the greedy next byte and, when the request asks
for it, the last position's logits. The expert budget is the request parameter `k` (and
`precision`, default: the repository's first, model parameter `default_precision`), fixed at START.

The KV cache of every live sequence stays here, in place (`Pool`, one per K and precision): rows
of preallocated buffers that onnxruntime reads as the past and writes the new keys and values
into (the onnxruntime target's shared past/present buffer), so a step copies no cache. Each
execute answers the requests Triton hands over with one call per kind of step:

- decode: one call over every row of the pool, one new token each. A row whose sequence sent no
  request in this execute runs ahead on the token it was last given when its client has so far
  sent back the token it was given (greedy): its next request is then answered from that result
  without a call. So streams whose requests reach Triton out of step still share one call.
- prefill: the new sequences of this execute in one call, their prompts right-aligned to the
  pool's current length (the columns before them masked);
- more than one token on a live sequence: a call of that row alone.

The same file is the repository's **generate model** (model parameter `mode` = "generate", a
decoupled model): one request is a whole generation (the prompt in INPUT_IDS, request
parameters `k`, `precision` and `max_tokens`), its greedy tokens streamed back one response
each, the last with Triton's final flag (`Generator`). One thread steps every live generation
of a route in one decode call and sends each its token: no request, and no hand-over between
Triton and this process, per token.

Executors (model parameter `executor`): "local" runs each per-K ONNX model of the repository in
onnxruntime in this process with the kernel library beside it (a portable graph, which returns a
new present, through CopyRunner: the past columns copied out of the pool, the new ones back);
"bls" sends each call to the per-K onnxruntime-backend (or TensorRT-backend) model through
Triton's BLS API, with the same copies.
"""

import json
import os
import queue
import threading
import time

import numpy as np

try:
    import triton_python_backend_utils as pb_utils
except ImportError:  # imported outside Triton (tests of the helpers below)
    pb_utils = None

BYTE_VOCAB = 256
LIBRARY = "libinfmoe_ort.so"
# onnxruntime's pool threads spin a while after a call returns; in a server the cores then go to
# the requests and replies in flight, so they stop at once (one wake-up per call, ~25 us).
FORCE_SPINNING_STOP = "session.force_spinning_stop"
ACTIVATIONS = "infmoe.activations"  # runtimes/ort_kernel.py: this file imports nothing of the package


class RequestError(Exception):
    """A bad request: answered with INVALID_ARG (HTTP 400), the server keeps serving."""


def request_parameters(text):
    """A request's JSON parameters as a dict; RequestError when they are not JSON."""
    try:
        return json.loads(text or "{}")
    except ValueError:
        raise RequestError("request parameters are not JSON") from None


def integer_parameter(params, name):
    """An integer request parameter (an int, or a string of digits), None when absent."""
    value = params.get(name)
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
        raise RequestError(f"parameter {name} must be an integer, got {value!r}")
    return value


def parse_parameters(params, routes, default_precision="fp32"):
    """(k, precision) from a request's parameters (request_parameters); RequestError when unknown."""
    k = integer_parameter(params, "k")
    precision = params.get("precision", default_precision)
    if k is None:
        return None, precision
    if f"{k}/{precision}" not in routes:
        served = ", ".join(sorted(routes, key=lambda r: (int(r.split('/')[0]), r)))
        raise RequestError(f"no model for k={k} precision={precision}: this server has {served} (K/precision)")
    return k, precision


class Sequence:
    """One live sequence. length: the tokens its client has sent, all in the cache; last_token:
    the token it was last answered; follows: whether its client's last step sent that token
    back (then it is run ahead); ahead: (result token, logits or None) of a step run ahead on
    last_token, whose key and value are the row's last valid column."""
    __slots__ = ("route", "row", "length", "used", "last_token", "follows", "ahead", "wants_logits")

    def __init__(self, route):
        self.route, self.row, self.length, self.used = route, None, 0, time.monotonic()
        self.last_token, self.follows, self.ahead, self.wants_logits = None, False, None, False


class Step:
    """One admitted request: its sequence, new token ids [n], and its answer once stepped."""
    __slots__ = ("index", "corrid", "sequence", "ids", "wants_logits", "end", "token", "logits")

    def __init__(self, index, corrid, sequence, ids, wants_logits, end):
        self.index, self.corrid, self.sequence, self.ids = index, corrid, sequence, ids
        self.wants_logits, self.end = wants_logits, end
        self.token, self.logits = None, None


class Pool:
    """The KV cache of one route: per past input, a buffer [rows, heads, positions, head_dim] of
    the model's cache type, cache_dtype (np.zeros: its pages are touched only as they are used),
    and `valid` [rows, positions], 1 where a row holds a token of its sequence. Live sequences
    hold rows 0 .. len(sequences) - 1; every row spans the same columns 0 .. length - 1, its own
    tokens masked in by `valid` (the attention mask), so that one call over rows [first, first + n)
    adds the same columns to each.
    `run(first, ids, mask)` is the executor's call; it writes the new keys and values in place.
    A decode step's rows go in calls of the preferred batch sizes (all of them in one call where
    every size is preferred)."""

    def __init__(self, run, names, rows, heads, positions, head_dim, vocab, preferred=None, cache_dtype=np.float32):
        self.arrays = [np.zeros((rows, heads, positions, head_dim), cache_dtype) for _ in names]
        self.valid = np.zeros((rows, positions), np.int64)
        self.rows, self.positions, self.vocab = rows, positions, vocab
        self.preferred = sorted(set(preferred or range(1, rows + 1)))
        self.length = 0
        self.sequences = []
        self.run = run

    # -- one execute's steps of this route ----------------------------------------------------
    def serve(self, steps):
        """Answer every step (token, and logits where wanted): from a result run ahead, else by
        the decode call, a row's own call, or the prefill call."""
        pending = []
        for step in steps:
            sequence = step.sequence
            if sequence.ahead is not None:
                hit = step.ids.shape[0] == 1 and step.ids[0] == sequence.last_token
                if hit and (sequence.ahead[1] is not None or not step.wants_logits):
                    step.token, step.logits = sequence.ahead
                    sequence.ahead = None
                    self._answered(sequence, step, 1)
                    continue
                self._discard_ahead(sequence)
            pending.append(step)
        new = [s for s in pending if s.sequence.row is None]
        decode = [s for s in pending if s.sequence.row is not None and s.ids.shape[0] == 1]
        extend = [s for s in pending if s.sequence.row is not None and s.ids.shape[0] > 1]
        for step in extend:  # not a greedy client, and not to be run ahead by the decode call
            step.sequence.follows = False
        if decode:
            self._decode(decode)
        for step in extend:
            self._extend(step)
        if new:
            self._prefill(new)

    @staticmethod
    def _answered(sequence, step, n_new):
        sequence.length += n_new
        sequence.last_token = step.token
        sequence.wants_logits = step.wants_logits

    def _decode(self, steps):
        """Every row one column: the requests' tokens, rows run ahead, the others masked; in calls
        of the preferred sizes, none for a run of rows with nothing to do."""
        self._make_room(1)
        rows, column = len(self.sequences), self.length
        requested = {s.sequence.row: s for s in steps}
        ids = np.zeros((rows, 1), np.int64)
        mask = self.valid[:rows, :column + 1].copy()
        ahead = []
        for row, sequence in enumerate(self.sequences):
            step = requested.get(row)
            if step is not None:
                sequence.follows = bool(step.ids[0] == sequence.last_token)
                ids[row, 0] = step.ids[0]
            elif sequence.ahead is None and sequence.follows and sequence.length + 1 < self.positions:
                ids[row, 0] = sequence.last_token
                ahead.append(row)
            else:
                continue
            mask[row, column] = 1
        calls = self._calls(rows)
        if len(calls) == 1:
            logits = self.run(0, ids, mask)[:, 0]
        else:
            logits = np.empty((rows, self.vocab), np.float32)
            for first, last in calls:
                if mask[first:last, column].any():
                    logits[first:last] = self.run(first, ids[first:last], mask[first:last])[:, 0]
        self.valid[:rows, column] = mask[:, column]
        self.length = column + 1
        tokens = np.argmax(logits[:, :BYTE_VOCAB], axis=1)
        for row, step in requested.items():
            step.token = int(tokens[row])
            step.logits = logits[row].copy() if step.wants_logits else None
            self._answered(step.sequence, step, 1)
        for row in ahead:
            sequence = self.sequences[row]
            sequence.ahead = (int(tokens[row]), logits[row].copy() if sequence.wants_logits else None)

    def _calls(self, rows):
        """Rows 0 .. rows - 1 cut into runs of the largest preferred size that fits, in order."""
        calls, first = [], 0
        while first < rows:
            fitting = [b for b in self.preferred if b <= rows - first]
            size = fitting[-1] if fitting else rows - first
            calls.append((first, first + size))
            first += size
        return calls

    def _extend(self, step):
        """Several new tokens on a live sequence: a call of its row alone."""
        n_new = step.ids.shape[0]
        self._make_room(n_new)
        row, column = step.sequence.row, self.length
        if column + n_new > self.positions:  # no room after the longest row: this row's tokens move first
            column = self._left_align(row)
        mask = np.concatenate([self.valid[row, :column], np.ones(n_new, np.int64)])[None]
        logits = self.run(row, step.ids[None], mask)
        self.valid[row, column:column + n_new] = 1
        self.length = max(self.length, column + n_new)
        step.token = int(np.argmax(logits[0, -1, :BYTE_VOCAB]))
        step.logits = logits[0, -1].copy() if step.wants_logits else None
        self._answered(step.sequence, step, n_new)

    def _prefill(self, steps):
        """The new sequences in one call on the next free rows, each prompt right-aligned to the
        pool's length (or to the longest prompt, when longer: the other rows' new columns stay
        masked), left-padded ids masked out."""
        first = len(self.sequences)
        if first + len(steps) > self.rows:
            raise RequestError(f"all {self.rows} sequence rows of this model are in use")
        longest = max(s.ids.shape[0] for s in steps)
        total = max(self.length, longest)
        ids = np.zeros((len(steps), longest), np.int64)
        mask = np.zeros((len(steps), total), np.int64)
        for index, step in enumerate(steps):
            n = step.ids.shape[0]
            ids[index, longest - n:] = step.ids
            mask[index, total - n:] = 1
        logits = self.run(first, ids, mask)
        self.valid[first:first + len(steps), :total] = mask
        self.length = total
        tokens = np.argmax(logits[:, -1, :BYTE_VOCAB], axis=1)
        for index, step in enumerate(steps):
            step.sequence.row = first + index
            self.sequences.append(step.sequence)
            step.token = int(tokens[index])
            step.logits = logits[index, -1].copy() if step.wants_logits else None
            self._answered(step.sequence, step, step.ids.shape[0])

    # -- rows and columns ---------------------------------------------------------------------
    def _make_room(self, n_new):
        """Compact when n_new columns do not fit, or when the columns that no row uses any more
        (left behind by ended sequences and masked steps) outnumber half the longest row: the
        attention reads every column of every row. A row that holds the whole context cannot
        take another token (its next request is refused): it leaves the pool when room runs out."""
        held = self.valid[:len(self.sequences), :self.length].sum(axis=1)
        longest = int(held.max())
        if self.length + n_new <= self.positions and self.length - longest <= max(8, longest // 2):
            return
        if longest + n_new > self.positions:
            for sequence in [s for s, count in zip(self.sequences, held) if count == self.positions]:
                self.release(sequence)
            held = self.valid[:len(self.sequences), :self.length].sum(axis=1)
            longest = int(held.max()) if held.shape[0] else 0
        self._compact(longest)

    def _compact(self, longest):
        """Move each row's tokens to the last `longest` columns, in order: positions come from the
        mask, so a row's tokens need not be contiguous, only in order."""
        for row in range(len(self.sequences)):
            columns = np.flatnonzero(self.valid[row, :self.length])
            start = longest - columns.shape[0]
            if columns.shape[0] and not (columns[0] == start and columns[-1] == longest - 1):
                for array in self.arrays:
                    array[row, :, start:longest] = array[row][:, columns]
            self.valid[row, :self.length] = 0
            self.valid[row, start:longest] = 1
        self.length = longest

    def _left_align(self, row):
        """Move a row's tokens to its first columns; the column after them."""
        columns = np.flatnonzero(self.valid[row, :self.length])
        for array in self.arrays:
            array[row, :, :columns.shape[0]] = array[row][:, columns]
        self.valid[row, :self.length] = 0
        self.valid[row, :columns.shape[0]] = 1
        return columns.shape[0]

    def _discard_ahead(self, sequence):
        """The client sent another token than the one run ahead on: mask that column out."""
        row_valid = self.valid[sequence.row, :self.length]
        row_valid[np.flatnonzero(row_valid)[-1]] = 0
        sequence.ahead = None

    def release(self, sequence):
        """Free a sequence's row: the last row moves into it, so rows 0..n-1 stay the live ones."""
        row, last = sequence.row, len(self.sequences) - 1
        if row is None:
            return
        if row != last:
            moved = self.sequences[last]
            used = np.flatnonzero(self.valid[last, :self.length])
            start = int(used[0]) if used.shape[0] else self.length
            for array in self.arrays:
                array[row, :, start:self.length] = array[last, :, start:self.length]
            self.valid[row, :self.length] = self.valid[last, :self.length]
            moved.row = row
            self.sequences[row] = moved
        self.valid[last, :self.length] = 0
        self.sequences.pop()
        sequence.row, sequence.ahead = None, None
        if not self.sequences:
            self.length = 0


# How often the generate model asks whether its live generations were cancelled: each asks Triton
# (a round trip to the server's process), which every step would pay once per generation.
CANCEL_CHECK_SECONDS = 0.25


class Generation:
    """One request of the generate model: its sequence, prompt ids, the tokens it may still take,
    and how to answer it: send(token, final), fail(message) (the final response either way) and
    cancelled() (the client gave up)."""
    __slots__ = ("sequence", "ids", "left", "send", "fail", "cancelled")

    def __init__(self, sequence, ids, left, send, fail, cancelled=lambda: False):
        self.sequence, self.ids, self.left = sequence, ids, left
        self.send, self.fail, self.cancelled = send, fail, cancelled


class Generator:
    """The generate model's loop, on a thread of its own: each turn takes the generations that
    arrived (`submit`), then per route steps every live one in one decode call and sends each its
    token, then prefills the new ones in one call on the pool's free rows (further ones wait for a
    row); a generation ends, with the final flag on its last token, after max_tokens tokens or
    when the context (n_positions) is full. A failed call ends every generation of its route with
    the error; the server keeps serving."""

    def __init__(self, pools, n_positions):
        self.pools, self.n_positions = pools, n_positions
        self.inbox = queue.Queue()
        self.live = {route: [] for route in pools}
        self.checked = {route: 0.0 for route in pools}  # when its live generations were last asked
        self.waiting = []
        self.thread = threading.Thread(target=self._loop, name="infmoe-generate", daemon=True)

    def start(self):
        self.thread.start()

    def submit(self, generation):
        self.inbox.put(generation)

    def stop(self, timeout=10.0):
        self.inbox.put(None)
        self.thread.join(timeout)

    def _loop(self):
        while self._take(block=not self.waiting and not any(self.live.values())):
            for route, pool in self.pools.items():
                self._turn(route, pool)
        for generation in self.waiting + [g for live in self.live.values() for g in live]:
            generation.fail("the model is stopping")

    def _take(self, block):
        """Move what arrived into `waiting`; False once stop() was called."""
        try:
            item = self.inbox.get(block=block)
            while True:
                if item is None:
                    return False
                self.waiting.append(item)
                item = self.inbox.get_nowait()
        except queue.Empty:
            return True

    def _turn(self, route, pool):
        live = self.live[route]
        if time.monotonic() - self.checked[route] > CANCEL_CHECK_SECONDS:
            self.checked[route] = time.monotonic()
            for generation in [g for g in live if g.cancelled()]:
                generation.fail("cancelled")
                self._end(pool, live, generation)
        new = []
        for generation in [g for g in self.waiting if g.sequence.route == route]:
            if len(live) + len(new) == pool.rows:
                break
            self.waiting.remove(generation)
            if generation.cancelled():
                generation.fail("cancelled")
            else:
                new.append(generation)
        try:
            if live:
                steps = [Step(i, None, g.sequence, np.array([g.sequence.last_token], np.int64), False, False)
                         for i, g in enumerate(live)]
                pool._decode(steps)
                self._deliver(pool, live, list(live), steps)
            if new:
                steps = [Step(i, None, g.sequence, g.ids, False, False) for i, g in enumerate(new)]
                pool._prefill(steps)
                live.extend(new)
                self._deliver(pool, live, new, steps)
        except Exception as error:  # a failed call ends its route's generations, never hangs them
            for generation in live + [g for g in new if g not in live]:
                generation.fail(f"inference failed: {type(error).__name__}: {error}")
                pool.release(generation.sequence)
            live.clear()

    def _deliver(self, pool, live, generations, steps):
        for generation, step in zip(generations, steps):
            generation.left -= 1
            final = generation.left == 0 or generation.sequence.length >= self.n_positions
            generation.send(step.token, final)
            if final:
                self._end(pool, live, generation)

    @staticmethod
    def _end(pool, live, generation):
        live.remove(generation)
        pool.release(generation.sequence)


def local_session(path, threads, activations="float"):
    """An onnxruntime session of a per-K model of the repository, the kernel library beside it,
    its quantized ops on the activations the model was exported for."""
    import onnxruntime

    options = onnxruntime.SessionOptions()
    library = os.path.join(os.path.dirname(os.path.dirname(path)), LIBRARY)
    if os.path.isfile(library):
        options.add_session_config_entry(ACTIVATIONS, activations)  # read when the library is registered
        options.register_custom_ops_library(library)
    if threads:
        options.intra_op_num_threads = threads
    options.add_session_config_entry(FORCE_SPINNING_STOP, "1")
    return onnxruntime.InferenceSession(path, options, providers=["CPUExecutionProvider"])


class SharedRunner:
    """An onnxruntime-target model in this process: rows of the pool bound as its past and present
    alike (IOBinding), so the attention appends to them in place. The decode calls' bindings (one
    new token) are kept, one per run of rows."""

    def __init__(self, session, past_names):
        import onnxruntime

        self.ort, self.session, self.past_names, self.pool = onnxruntime, session, past_names, None
        outputs = [o.name for o in session.get_outputs()]
        self.others = [n for n in outputs if n != "logits" and not n.startswith("present.")]
        self.kept = {}  # (first row, rows) -> (binding, logits [rows, 1, vocab])

    def _binding(self, first, rows, n_new):
        binding = self.session.io_binding()
        for name, array in zip(self.past_names, self.pool.arrays):
            value = self.ort.OrtValue.ortvalue_from_numpy(array[first:first + rows])
            binding.bind_ortvalue_input(name, value)
            binding.bind_ortvalue_output(name.replace("past_key_values", "present"), value)
        logits = np.empty((rows, n_new, self.pool.vocab), np.float32)
        binding.bind_ortvalue_output("logits", self.ort.OrtValue.ortvalue_from_numpy(logits))
        for name in self.others:
            binding.bind_output(name)
        return binding, logits

    def __call__(self, first, ids, mask):
        rows, n_new = ids.shape
        if n_new == 1:
            if (first, rows) not in self.kept:
                self.kept[first, rows] = self._binding(first, rows, 1)
            binding, logits = self.kept[first, rows]
        else:
            binding, logits = self._binding(first, rows, n_new)
        binding.bind_cpu_input("input_ids", ids)
        binding.bind_cpu_input("attention_mask", mask)
        self.session.run_with_iobinding(binding)
        return logits


class CopyRunner:
    """A model whose present is a new tensor of past + new columns (the portable graph, or a model
    called through Triton): the past columns are copied out of the pool, the new ones back.
    infer(feed, output names) -> {name: array}."""

    def __init__(self, infer, past_names):
        self.infer, self.past_names, self.pool = infer, past_names, None
        self.present_names = [n.replace("past_key_values", "present") for n in past_names]

    def __call__(self, first, ids, mask):
        rows, n_new = ids.shape
        total = mask.shape[1]
        past = total - n_new
        feed = {"input_ids": ids, "attention_mask": mask}
        feed.update((name, np.ascontiguousarray(array[first:first + rows, :, :past]))
                    for name, array in zip(self.past_names, self.pool.arrays))
        outputs = self.infer(feed, ["logits"] + self.present_names)
        for name, array in zip(self.present_names, self.pool.arrays):
            array[first:first + rows, :, past:total] = outputs[name][:, :, past:total]
        return outputs["logits"]


def bls_infer(model_name):
    """CopyRunner's infer through Triton's BLS API: the per-K model `model_name`."""
    def infer(feed, names):
        inputs = [pb_utils.Tensor(name, value) for name, value in feed.items()]
        response = pb_utils.InferenceRequest(model_name=model_name, inputs=inputs,
                                             requested_output_names=names).exec()
        if response.has_error():
            raise RuntimeError(response.error().message())
        return {name: pb_utils.get_output_tensor_by_name(response, name).as_numpy() for name in names}
    return infer


def session_infer(session):
    """CopyRunner's infer in this process's onnxruntime."""
    return lambda feed, names: dict(zip(names, session.run(names, feed)))


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        params = {key: value["string_value"] for key, value in config.get("parameters", {}).items()}
        self.routes = json.loads(params["routes"])
        self.executor = params.get("executor", "local")
        self.default_precision = params.get("default_precision", "fp32")
        self.n_positions = int(params["n_positions"])
        self.idle_seconds = float(params.get("idle_seconds", "60"))
        rows = int(params["rows"])
        preferred = json.loads(params["preferred_batch_sizes"])
        vocab = int(params["vocab_size"])
        repository = os.path.dirname(os.path.abspath(args["model_repository"]))
        past_names = [n for n in json.loads(params["input_names"]) if n.startswith("past_key_values.")]
        threads = int(os.environ.get("INFMOE_SERVE_THREADS") or 0)
        self.sequences = {}
        self.pools = {}
        for route, entry in self.routes.items():
            if self.executor != "local":
                runner = CopyRunner(bls_infer(entry["triton"]), past_names)
            elif entry.get("shared_cache"):
                runner = SharedRunner(local_session(os.path.join(repository, entry["onnx"]), threads,
                                                    entry.get("activations", "float")), past_names)
            else:
                runner = CopyRunner(session_infer(local_session(os.path.join(repository, entry["onnx"]), threads,
                                                                entry.get("activations", "float"))), past_names)
            heads, _, head_dim = json.loads(entry["past_shape"])
            runner.pool = Pool(runner, past_names, rows, heads, self.n_positions, head_dim, vocab, preferred,
                               np.dtype(entry.get("kv_cache", "float32")))  # repositories from before it: float32
            self.pools[route] = runner.pool
        self.generator = None
        if params.get("mode") == "generate":
            self.generator = Generator(self.pools, self.n_positions)
            self.generator.start()

    # -- one execute: check every request, then step each route's -----------------------------
    def execute(self, requests):
        if self.generator is not None:
            for request in requests:
                self._submit(request)
            return None
        responses = [None] * len(requests)
        by_route = {}
        now = time.monotonic()
        self._evict_idle(now)
        for index, request in enumerate(requests):
            try:
                step = self._admit(index, request, now)
            except RequestError as error:
                responses[index] = self._error(str(error))
                continue
            by_route.setdefault(step.sequence.route, []).append(step)
        for route, steps in by_route.items():
            message = "inference failed: no result"
            try:
                self.pools[route].serve(steps)
            except RequestError as error:
                message = str(error)
            except Exception as error:  # a failed model call answers its requests, never hangs them
                message = f"inference failed: {type(error).__name__}: {error}"
            for step in steps:
                if step.token is None:  # its sequence's cache is not known good: dropped
                    responses[step.index] = self._error(message, invalid=False)
                    self._drop(step.corrid)
                    continue
                outputs = [pb_utils.Tensor("NEXT_TOKEN", np.array([[step.token]], np.int64))]
                if step.wants_logits:
                    outputs.append(pb_utils.Tensor("LOGITS", step.logits[None, :]))
                responses[step.index] = pb_utils.InferenceResponse(output_tensors=outputs)
                if step.end:
                    self._drop(step.corrid)
        return responses

    def _error(self, message, invalid=True):
        code = pb_utils.TritonError.INVALID_ARG if invalid else pb_utils.TritonError.INTERNAL
        return pb_utils.InferenceResponse(error=pb_utils.TritonError(message, code))

    @staticmethod
    def _flag(request, name):
        tensor = pb_utils.get_input_tensor_by_name(request, name)
        return tensor is not None and bool(tensor.as_numpy().reshape(-1)[0])

    @staticmethod
    def _corrid(request):
        tensor = pb_utils.get_input_tensor_by_name(request, "CORRID")
        return int(tensor.as_numpy().reshape(-1)[0]) if tensor is not None else request.correlation_id()

    def _drop(self, corrid):
        sequence = self.sequences.pop(corrid, None)
        if sequence is not None:
            self.pools[sequence.route].release(sequence)

    @staticmethod
    def _input_ids(request):
        """A request's INPUT_IDS as int64 [n]; RequestError when empty or not bytes."""
        ids = pb_utils.get_input_tensor_by_name(request, "INPUT_IDS").as_numpy().reshape(-1).astype(np.int64)
        if ids.shape[0] == 0:
            raise RequestError("INPUT_IDS is empty: give at least one token")
        if ids.min() < 0 or ids.max() >= BYTE_VOCAB:
            raise RequestError(f"INPUT_IDS must be bytes (0..{BYTE_VOCAB - 1})")
        return ids

    def _submit(self, request):
        """A generate request to the generator, or its error as its final response."""
        sender = request.get_response_sender()
        final = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL

        def send(token, last):
            response = pb_utils.InferenceResponse(output_tensors=[
                pb_utils.Tensor("NEXT_TOKEN", np.array([token], np.int64))])
            sender.send(response, flags=final if last else 0)

        def fail(message, invalid=False):
            sender.send(self._error(message, invalid), flags=final)

        try:
            params = request_parameters(request.parameters())
            k, precision = parse_parameters(params, self.routes, self.default_precision)
            if k is None:
                raise RequestError("a generate request needs the parameter k (the expert budget)")
            left = integer_parameter(params, "max_tokens")
            if left is None or left < 1:
                raise RequestError(f"a generate request needs the parameter max_tokens, at least 1, got {left!r}")
            ids = self._input_ids(request)
            if ids.shape[0] > self.n_positions:
                raise RequestError(f"the prompt holds {ids.shape[0]} tokens: the context (n_positions = "
                                   f"{self.n_positions}) has no room")
        except RequestError as error:
            return fail(str(error), invalid=True)
        cancelled = getattr(request, "is_cancelled", lambda: False)
        self.generator.submit(Generation(Sequence(f"{k}/{precision}"), ids, left, send, fail, cancelled))

    def _admit(self, index, request, now):
        """The Step of a valid request; RequestError otherwise."""
        corrid = self._corrid(request)
        k, precision = parse_parameters(request_parameters(request.parameters()), self.routes, self.default_precision)
        ids = self._input_ids(request)
        if self._flag(request, "START"):
            if k is None:
                raise RequestError("the first request of a sequence needs the parameter k (the expert budget)")
            self._drop(corrid)
            sequence = Sequence(f"{k}/{precision}")
            self.sequences[corrid] = sequence
        else:
            sequence = self.sequences.get(corrid)
            if sequence is None:
                raise RequestError(f"sequence {corrid} has no cache here (not started, ended, idle for over "
                                   f"{self.idle_seconds:g} s, or the model restarted): start it again")
            if k is not None and f"{k}/{precision}" != sequence.route:
                self._drop(corrid)
                raise RequestError(f"sequence {corrid} was started with k={sequence.route.split('/')[0]}; k cannot "
                                   "change within a sequence (sequence dropped)")
        if sequence.length + ids.shape[0] > self.n_positions:
            self._drop(corrid)
            raise RequestError(f"the sequence would hold {sequence.length + ids.shape[0]} tokens: the context "
                               f"(n_positions = {self.n_positions}) has no room (sequence dropped)")
        sequence.used = now
        wants_logits = "LOGITS" in request.requested_output_names()
        return Step(index, corrid, sequence, ids, wants_logits, self._flag(request, "END"))

    def _evict_idle(self, now):
        for corrid in [c for c, s in self.sequences.items() if now - s.used > self.idle_seconds]:
            self._drop(corrid)

    def finalize(self):
        if self.generator is not None:
            self.generator.stop()
        self.sequences.clear()
        self.pools.clear()
