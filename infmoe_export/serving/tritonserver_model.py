"""The decoding front model of the repository: a Triton Python-backend model (copied to
REPO/infmoe/1/model.py). It imports no infmoe_export module, only numpy, onnxruntime (the
"local" executor) and Triton's triton_python_backend_utils, so the repository runs on a stock
Triton container.

One request is one step of one sequence (Triton's sequence batcher: a correlation id, START on
the first step, END on the last): INPUT_IDS are the new tokens (the prompt on the first step,
then the token just generated), and the reply is the greedy next byte and the last position's
logits. The KV cache of every live sequence stays here, keyed by its correlation id. The
expert budget is the request parameter `k` (and `precision`, default: the repository's first,
model parameter `default_precision`), fixed at START.
Steps of different sequences that arrive together (the batcher's oldest-first strategy hands
them over in one execute) with the same K, precision and new-token count run as one batch:
each cache is left-padded to the longest, the padding masked by attention_mask, which the
exported graph supports (positions come from cumsum(mask) - 1).

Executors (model parameter `executor`): "local" runs each per-K ONNX model of the repository
in onnxruntime in this process with the kernel library beside it; "bls" sends each batch to
the per-K onnxruntime-backend (or TensorRT-backend) model through Triton's BLS API.
"""

import json
import os
import time

import numpy as np

try:
    import triton_python_backend_utils as pb_utils
except ImportError:  # imported outside Triton (tests of the helpers below)
    pb_utils = None

BYTE_VOCAB = 256
LIBRARY = "libinfmoe_ort.so"


class RequestError(Exception):
    """A bad request: answered with INVALID_ARG (HTTP 400), the server keeps serving."""


def parse_parameters(text, routes, default_precision="fp32"):
    """(k, precision) from a request's JSON parameters; RequestError when unknown."""
    try:
        params = json.loads(text or "{}")
    except ValueError:
        raise RequestError("request parameters are not JSON") from None
    k = params.get("k")
    precision = params.get("precision", default_precision)
    if k is None:
        return None, precision
    if isinstance(k, str) and k.strip().isdigit():
        k = int(k)
    if isinstance(k, bool) or not isinstance(k, int):
        raise RequestError(f"parameter k must be an integer, got {k!r}")
    if f"{k}/{precision}" not in routes:
        served = ", ".join(sorted(routes, key=lambda r: (int(r.split('/')[0]), r)))
        raise RequestError(f"no model for k={k} precision={precision}: this server has {served} (K/precision)")
    return k, precision


def pad_batch(caches, lengths, new_ids):
    """Left-pad the caches of one batch to the longest: (past list, attention mask, pad per row).
    caches: per row, a list of [1, heads, P_i, head_dim] arrays (None for an empty cache)."""
    longest = max(lengths)
    batch, n_new = len(lengths), new_ids.shape[1]
    mask = np.zeros((batch, longest + n_new), np.int64)
    pads = [longest - p for p in lengths]
    for row, pad in enumerate(pads):
        mask[row, pad:] = 1
    past = []
    template = next(c for c in caches if c is not None)
    for index in range(len(template)):
        _, heads, _, dim = template[index].shape
        array = np.zeros((batch, heads, longest, dim), template[index].dtype)
        for row, cache in enumerate(caches):
            if cache is not None and lengths[row]:
                array[row, :, pads[row]:] = cache[index][0]
        past.append(array)
    return past, mask, pads


class Sequence:
    __slots__ = ("k", "precision", "cache", "length", "used")

    def __init__(self, k, precision):
        self.k, self.precision, self.cache, self.length, self.used = k, precision, None, 0, time.monotonic()


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        params = {key: value["string_value"] for key, value in config.get("parameters", {}).items()}
        self.routes = json.loads(params["routes"])
        self.executor = params.get("executor", "local")
        self.default_precision = params.get("default_precision", "fp32")
        self.n_positions = int(params["n_positions"])
        self.idle_seconds = float(params.get("idle_seconds", "60"))
        self.repository = os.path.dirname(os.path.abspath(args["model_repository"]))
        self.sequences = {}
        self.sessions = {}
        self.names = None
        if self.executor == "local":
            for route, entry in self.routes.items():
                self.sessions[route] = self._session(os.path.join(self.repository, entry["onnx"]))
            first = next(iter(self.sessions.values()))
            self.input_names = [i.name for i in first.get_inputs()]
            self.output_names = [o.name for o in first.get_outputs()]
        else:
            self.input_names = json.loads(params["input_names"])
            self.output_names = json.loads(params["output_names"])
        self.past_names = [n for n in self.input_names if n.startswith("past_key_values.")]
        self.present_names = [n.replace("past_key_values", "present") for n in self.past_names]

    def _session(self, path):
        import onnxruntime

        options = onnxruntime.SessionOptions()
        library = os.path.join(os.path.dirname(os.path.dirname(path)), LIBRARY)
        if os.path.isfile(library):
            options.register_custom_ops_library(library)
        threads = os.environ.get("INFMOE_SERVE_THREADS")
        if threads:
            options.intra_op_num_threads = int(threads)
        return onnxruntime.InferenceSession(path, options, providers=["CPUExecutionProvider"])

    # -- one execute: check every request, then batch the valid ones -------------------------
    def execute(self, requests):
        responses = [None] * len(requests)
        groups = {}
        now = time.monotonic()
        self._evict_idle(now)
        for index, request in enumerate(requests):
            try:
                key, sequence, ids = self._admit(request, now)
            except RequestError as error:
                responses[index] = self._error(str(error))
                continue
            groups.setdefault(key, []).append((index, sequence, ids))
        for (route, n_new), members in groups.items():
            try:
                results = self._step(route, members)
            except Exception as error:  # a failed model call answers its requests, never hangs them
                for index, _, _ in members:
                    responses[index] = self._error(f"inference failed: {type(error).__name__}: {error}",
                                                   invalid=False)
                continue
            for (index, _, _), (token, logits) in zip(members, results):
                responses[index] = pb_utils.InferenceResponse(output_tensors=[
                    pb_utils.Tensor("NEXT_TOKEN", np.array([[token]], np.int64)),
                    pb_utils.Tensor("LOGITS", logits[None, :].astype(np.float32))])
        for index, request in enumerate(requests):
            if self._flag(request, "END"):
                self.sequences.pop(self._corrid(request), None)
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

    def _admit(self, request, now):
        """((route, n_new), Sequence, ids [1, n]) for a valid request; RequestError otherwise."""
        corrid = self._corrid(request)
        k, precision = parse_parameters(request.parameters(), self.routes, self.default_precision)
        ids = pb_utils.get_input_tensor_by_name(request, "INPUT_IDS").as_numpy().reshape(1, -1).astype(np.int64)
        if ids.shape[1] == 0:
            raise RequestError("INPUT_IDS is empty: give at least one token")
        if ids.min() < 0 or ids.max() >= BYTE_VOCAB:
            raise RequestError(f"INPUT_IDS must be bytes (0..{BYTE_VOCAB - 1})")
        if self._flag(request, "START"):
            if k is None:
                raise RequestError("the first request of a sequence needs the parameter k (the expert budget)")
            sequence = Sequence(k, precision)
            self.sequences[corrid] = sequence
        else:
            sequence = self.sequences.get(corrid)
            if sequence is None:
                raise RequestError(f"sequence {corrid} has no cache here (not started, ended, idle for over "
                                   f"{self.idle_seconds:g} s, or the model restarted): start it again")
            if k is not None and (k, precision) != (sequence.k, sequence.precision):
                self.sequences.pop(corrid, None)
                raise RequestError(f"sequence {corrid} was started with k={sequence.k}; k cannot change "
                                   "within a sequence (sequence dropped)")
        if sequence.length + ids.shape[1] > self.n_positions:
            self.sequences.pop(corrid, None)
            raise RequestError(f"the sequence would hold {sequence.length + ids.shape[1]} tokens: the context "
                               f"(n_positions = {self.n_positions}) has no room (sequence dropped)")
        sequence.used = now
        return (f"{sequence.k}/{sequence.precision}", ids.shape[1]), sequence, ids

    def _evict_idle(self, now):
        for corrid in [c for c, s in self.sequences.items() if now - s.used > self.idle_seconds]:
            del self.sequences[corrid]

    def _step(self, route, members):
        """Run one batch; update each sequence's cache; (greedy token, last logits) per member."""
        sequences = [m[1] for m in members]
        new_ids = np.concatenate([m[2] for m in members], axis=0)
        lengths = [s.length for s in sequences]
        if any(s.cache is not None for s in sequences):
            past, mask, pads = pad_batch([s.cache for s in sequences], lengths, new_ids)
        else:
            past, mask, pads = None, np.ones(new_ids.shape, np.int64), [0] * len(sequences)
        feed = {"input_ids": new_ids, "attention_mask": mask}
        for index, name in enumerate(self.past_names):
            if past is None:
                shape = self._empty_past_shape(route, name)
                feed[name] = np.zeros((len(sequences),) + shape, np.float32)
            else:
                feed[name] = past[index]
        outputs = self._run(route, feed)
        results = []
        for row, sequence in enumerate(sequences):
            sequence.cache = [np.ascontiguousarray(outputs[name][row:row + 1, :, pads[row]:])
                              for name in self.present_names]
            sequence.length += new_ids.shape[1]
            logits = outputs["logits"][row, -1]
            results.append((int(np.argmax(logits[:BYTE_VOCAB])), logits))
        return results

    def _empty_past_shape(self, route, name):
        if self.executor == "local":
            shape = next(i.shape for i in self.sessions[route].get_inputs() if i.name == name)
            return (shape[1], 0, shape[3])
        return tuple(json.loads(self.routes[route]["past_shape"]))

    def _run(self, route, feed):
        if self.executor == "local":
            values = self.sessions[route].run(self.output_names, feed)
            return dict(zip(self.output_names, values))
        inputs = [pb_utils.Tensor(name, value) for name, value in feed.items()]
        request = pb_utils.InferenceRequest(model_name=self.routes[route]["triton"], inputs=inputs,
                                            requested_output_names=["logits"] + self.present_names)
        response = request.exec()
        if response.has_error():
            raise RuntimeError(response.error().message())
        return {name: pb_utils.get_output_tensor_by_name(response, name).as_numpy()
                for name in ["logits"] + self.present_names}

    def finalize(self):
        self.sequences.clear()
        self.sessions.clear()
