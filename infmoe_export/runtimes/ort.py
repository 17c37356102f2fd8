"""onnxruntime sessions for exported ∞-MoE models, and a Polygraphy runner on top.

The compiled ContinuousSliceFFN kernel (plugins/onnxruntime) is registered when it is built.
A registered kernel takes precedence over the model's local function: onnxruntime inlines a
local function only for a node that no registered kernel claims (tests/test_runtimes.py checks
this by profiling). Without the kernel, or with kernel=False, the node runs as the fallback
function made of standard ops.

A model exported for the onnxruntime target (DecoderIO.shares_cache) runs generation on a
SharedCache: one past/present buffer of n_positions per layer, bound with IOBinding as both the
past input and the present output, which GroupQueryAttention appends to in place, so a decode
step neither allocates nor copies the cache (docs/design/design.md, Layout).
"""

import os
from typing import Dict, Optional, Sequence, Union

import numpy as np
import onnxruntime as ort
from polygraphy.backend.onnxrt import OnnxrtRunner

from ..contract import LOGITS_TO_KEEP, DecoderIO, ExportedModel
from ..errors import InfMoEError
from . import ort_kernel
from .ort_moe import fallback_copy, qmoe_activations

# Preferred first; onnxruntime falls back down the list node by node.
PROVIDER_ORDER = ("TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider")


def default_providers() -> list:
    available = ort.get_available_providers()
    return [p for p in PROVIDER_ORDER if p in available] or ["CPUExecutionProvider"]


# onnxruntime fuses DequantizeLinear + MatMul (an export's --quantize-other) into MatMulNBits and
# by default rounds that MatMul's activations to int8 (accuracy level 4): ~1e-3 off the level-1
# reference (SPEC §6, docs/guide/quantization.md). Level 1 keeps them float32; weights stay 4 / 8 bit.
MATMULNBITS_ACCURACY = "session.qdq_matmulnbits_accuracy_level"


def _matmulnbits_accuracy(options: ort.SessionOptions, activations: str):
    """Fused MatMulNBits (and QMatMul's fallback) with the kernel's kind of activations: float32
    (level 1) or int8 (level 4), unless the caller's options chose a level."""
    try:
        options.get_session_config_entry(MATMULNBITS_ACCURACY)
    except RuntimeError:  # not set
        options.add_session_config_entry(MATMULNBITS_ACCURACY, "4" if activations == "int8" else "1")


# After a run, onnxruntime's pool threads spin a while (tens of ms here) before they sleep: right
# for one session stepping back to back, wrong for sessions taking turns on the same cores, where
# each run would share them with the previous session's spinning threads (measured: onnxruntime's
# MatMul read 16 GB/s right after another session's decode steps, 22-26 once those slept).
FORCE_SPINNING_STOP = "session.force_spinning_stop"
DEFAULT_LOG_SEVERITY = ort.SessionOptions().log_severity_level  # unset: the default logger's level


def create_session(model: Union[ExportedModel, str, os.PathLike], kernel: bool = True,
                   providers: Optional[Sequence] = None, intra_op_threads: Optional[int] = None,
                   options: Optional[ort.SessionOptions] = None, stop_spinning: bool = False,
                   activations: Optional[str] = None) -> ort.InferenceSession:
    """An InferenceSession for an exported model: the kernel when asked for and installed, the
    fallback function otherwise; providers default to the best installed ones. A conventional
    MoE's experts are onnxruntime's own MoE / QMoE ops, which every onnxruntime has: kernel=False
    runs their fallback functions instead, on a copy of the model with the functions inlined
    (ort_moe.fallback_copy). activations:
    the quantized ops' ("float", SPEC §6 level 1, or "int8": integer dot products, judged at
    level 2; docs/guide/quantization.md; None: as options say, else as the model was exported
    for (its infmoe.activations metadata); QMoE's too, ort_moe.qmoe_activations). stop_spinning:
    the pool's threads sleep as soon as a run returns (FORCE_SPINNING_STOP), for sessions that
    take turns (bench); a run then pays one wake-up (~25 us)."""
    if not isinstance(model, ExportedModel):
        model = ExportedModel.read(model)
    options = options or ort.SessionOptions()
    if model.io.keeps_logits and options.log_severity_level == DEFAULT_LOG_SEVERITY:
        # onnxruntime warns at every load that the overridable logits_to_keep is not folded as a
        # constant: it is an input by design (contract.LOGITS_TO_KEEP). Errors still show; a level
        # the caller chose is kept.
        options.log_severity_level = 3
    activations = activations or ort_kernel.activations_of(options, default=model.io.activations)
    _matmulnbits_accuracy(options, activations)
    if stop_spinning:
        options.add_session_config_entry(FORCE_SPINNING_STOP, "1")
    if intra_op_threads is not None:
        options.intra_op_num_threads = intra_op_threads
    providers = list(providers) if providers else default_providers()
    registered = kernel and ort_kernel.register(options, providers, activations)
    if not registered and not model.has_function and model.io.custom_ops:
        raise InfMoEError(f"{model.path} was exported with --no-function and the onnxruntime kernel is not "
                          "available: install it (docs/guide/onnxruntime.md) or re-export with the fallback function")
    fallback = None if kernel or not model.io.is_moe else fallback_copy(model.path)
    try:
        with qmoe_activations(activations):
            return ort.InferenceSession(str(fallback or model.path), sess_options=options, providers=providers)
    except Exception as error:  # onnxruntime raises its own exception types
        raise InfMoEError(f"onnxruntime cannot load {model.path}: {str(error).strip().splitlines()[0]}") from None
    finally:
        if fallback is not None:
            fallback.unlink()


class OrtRunner(OnnxrtRunner):
    """Polygraphy's onnxruntime runner over create_session, with the model's DecoderIO;
    activations None: the quantized ops' kind the model was exported for."""

    def __init__(self, decoder_io: DecoderIO, model: Union[ExportedModel, str, os.PathLike], *, kernel: bool = True,
                 providers: Optional[Sequence] = None, intra_op_threads: Optional[int] = None,
                 stop_spinning: bool = False, name: Optional[str] = None, activations: Optional[str] = None):
        if not isinstance(model, ExportedModel):
            model = ExportedModel.read(model)
        if model.io != decoder_io:
            raise InfMoEError(f"{model.path} was exported with other inputs and outputs than the ones given")
        super().__init__(lambda: create_session(model, kernel, providers, intra_op_threads,
                                                stop_spinning=stop_spinning, activations=activations), name=name)
        self.path = model.path
        self.io = decoder_io
        self.activations = activations or model.io.activations

    def shared_cache(self, batch: int = 1) -> Optional["SharedCache"]:
        """A SharedCache for a generation on the active session, or None when the model cannot
        share its cache (portable graphs) or the session does not run on the CPU."""
        if not self.io.shares_cache or self.sess.get_providers()[0] != "CPUExecutionProvider":
            return None
        return SharedCache(self.sess, self.io, batch)


class SharedCache:
    """The KV cache of one generation, preallocated once: per layer a key and a value buffer of
    [batch, n_head, n_positions, head_dim] of the model's cache type (DecoderIO.cache_dtype),
    bound as past_key_values.{i}.* and present.{i}.* alike, so the session writes each step's
    keys and values into it and copies nothing. The logits of each step land in a buffer bound
    once per shape. CPU sessions only (the buffers live in host memory)."""

    def __init__(self, session: ort.InferenceSession, decoder_io: DecoderIO, batch: int = 1):
        if not decoder_io.shares_cache:
            raise InfMoEError("a shared KV cache needs a model exported with --target onnxruntime (and a cache)")
        c = decoder_io.config
        self.io, self.batch, self.length = decoder_io, batch, 0
        shape = (batch, c.n_head, c.n_positions, c.head_dim)
        # Zeroed, not left uninitialised: the positions past the current length are never read,
        # but a buffer that could hold NaN would make any mistake there silent.
        self._arrays = [np.zeros(shape, decoder_io.cache_dtype) for _ in decoder_io.past_names]
        self._past = [ort.OrtValue.ortvalue_from_numpy(a) for a in self._arrays]
        self._binding = session.io_binding()
        self._session = session
        for past, value in zip(decoder_io.past_names, self._past):  # bound once, for every step
            self._binding.bind_ortvalue_input(past, value)
            self._binding.bind_ortvalue_output(past.replace("past_key_values", "present"), value)
        self._logits: Dict[tuple, tuple] = {}  # shape -> (array, its OrtValue)
        self._bound_shape = None
        self._others = [n for n in decoder_io.output_names if n != "logits" and not n.startswith("present.")]
        # The LM head on the last position alone, where the file has the input (exports before it
        # had none) and the step has no other outputs to fetch.
        self._last_only = not self._others and LOGITS_TO_KEEP in {
            i.name for i in session.get_overridable_initializers()}

    def step(self, input_ids, expert_noise=None, attention_mask=None, last_only: bool = False) -> Dict[str, np.ndarray]:
        """Run input_ids [batch, sequence] after the cached tokens; attention_mask covers cached +
        new tokens (default: all ones). Returns logits (a buffer reused by the next step of the
        same shape: copy what must outlive it) and any expert_starts.{i}. last_only: the logits of
        the last position alone, [batch, 1, vocab] (a prompt's prefill: the LM head runs on one
        row, contract.LOGITS_TO_KEEP), where the model can; else every position's."""
        input_ids = np.asarray(input_ids, dtype=np.int64)
        batch, sequence = input_ids.shape
        total = self.length + sequence
        if batch != self.batch:
            raise InfMoEError(f"this cache holds a batch of {self.batch}, got input_ids of batch {batch}")
        if total > self.io.config.n_positions:
            raise InfMoEError(f"{total} tokens do not fit the cache of n_positions = {self.io.config.n_positions}")
        if attention_mask is None:
            attention_mask = np.ones((batch, total), np.int64)
        elif np.shape(attention_mask) != (batch, total):
            raise InfMoEError(f"attention_mask must be [batch, cached + new tokens] = [{batch}, {total}], "
                              f"got {list(np.shape(attention_mask))}")
        feeds = self.io.step_inputs(input_ids, attention_mask, expert_noise)
        if last_only and self._last_only and sequence > 1:
            logits = self._run_last_only(feeds, batch)
            self.length = total
            return {"logits": logits}
        for name, value in feeds.items():
            self._binding.bind_cpu_input(name, value)  # the cache is bound already
        shape = (batch, sequence, self.io.config.vocab_size)
        if shape != self._bound_shape:
            self._binding.bind_ortvalue_output("logits", self._logits_buffer(shape)[1])
            self._bound_shape = shape
        for name in self._others:
            self._binding.bind_output(name)
        self._session.run_with_iobinding(self._binding)
        self.length = total
        outputs = {"logits": self._logits[shape][0]}
        if self._others:
            bound = self._binding.get_outputs()
            outputs.update(zip(self._others, (v.numpy() for v in bound[len(bound) - len(self._others):])))
        return outputs

    def _logits_buffer(self, shape: tuple) -> tuple:
        """(array, its OrtValue) of this logits shape, made once."""
        if shape not in self._logits:
            array = np.empty(shape, np.float32)
            self._logits[shape] = array, ort.OrtValue.ortvalue_from_numpy(array)
        return self._logits[shape]

    def _run_last_only(self, feeds: Dict[str, np.ndarray], batch: int) -> np.ndarray:
        """One step with logits_to_keep = 1. IOBinding cannot bind an overridable initializer,
        so it runs through run_with_ortvaluevector, which takes it as a feed and still writes
        into given outputs: the cache's buffers (in place, as bound) and a logits buffer."""
        from onnxruntime.capi import _pybind_state as capi

        array, logits = self._logits_buffer((batch, 1, self.io.config.vocab_size))
        names = [*feeds, *self.io.past_names, LOGITS_TO_KEEP]
        values = [ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(v)) for v in feeds.values()]
        values += [*self._past, ort.OrtValue.ortvalue_from_numpy(np.array(1, np.int64))]
        outputs = [logits, *self._past]
        feed_vector, fetch_vector = capi.OrtValueVector(), capi.OrtValueVector()
        for value in values:
            feed_vector.push_back(value._ortvalue)
        for value in outputs:
            fetch_vector.push_back(value._ortvalue)
        cpu = capi.OrtDevice(capi.OrtDevice.cpu(), capi.OrtDevice.default_memory(), 0)
        self._session.run_with_ortvaluevector(
            ort.RunOptions(), names, feed_vector,
            ["logits", *(n.replace("past_key_values", "present") for n in self.io.past_names)], fetch_vector,
            [cpu] * len(outputs))
        return array
