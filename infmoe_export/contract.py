"""The contract every layer shares: the op's identity, the exported decoder's inputs and outputs
(named in one place, like Optimum's OnnxConfig), and the metadata an exported file carries.

Names follow Optimum's text-generation-with-past decoders, so one graph serves prefill
(past_sequence = 0) and decode:

    inputs   input_ids [batch, sequence] int64
             attention_mask [batch, past_sequence + sequence] int64  (1 = token, 0 = left padding)
             past_key_values.{i}.key / .value [batch, n_head, past_sequence, head_dim]   (past only)
             expert_noise [batch, sequence, K] float32                                   (sampled noise only)
    outputs  logits [batch, sequence, vocab]
             present.{i}.key / .value [batch, n_head, past_sequence + sequence, head_dim] (past only)
             expert_starts.{i} [batch, sequence, K] int64                                (with starts only)

The exporter, the validator, every runner and generation use DecoderIO, so the names cannot
drift apart; ExportedModel is what the exporter returns and what runners and reports take.
"""

import json
import os
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Union

import numpy as np
import onnx

from .errors import InfMoEError
from .model import NOISE_MODES, InfMoEConfig, MoEConfig, Output, config_from_dict
from .quant import BITS, DEFAULT_BLOCK_SIZE, PRECISIONS, Q_OP_TYPE, check_block_size

# The custom op (SPEC §4): TensorRT finds its plugin by these, onnxruntime its kernel.
DOMAIN, OP_TYPE, OP_VERSION = "infmoe", "ContinuousSliceFFN", 1
# onnxruntime's contrib domain, and its expert ops a conventional-MoE export writes (export/moe.py),
# each with a standard-op fallback function like ours.
MS_DOMAIN = "com.microsoft"
MOE_OP_TYPES = ("MoE", "QMoE")
# What a conventional MoE's export (model_type moe-gpt2) supports: its experts are onnxruntime's
# MoE / QMoE, which have no TensorRT plugin, and its float16 form is not exported.
MOE_DTYPES, MOE_TARGETS = ("fp32", "int8", "int4"), ("portable", "onnxruntime")

# Far beyond any useful budget (K = H - r + 1 quantile samples already place a window at every
# start); the bound keeps a mistyped K from allocating gigabytes of noise and starts.
MAX_K = 65536

BATCH, SEQUENCE, PAST, TOTAL = "batch", "sequence", "past_sequence", "past_sequence + sequence"
# The onnxruntime target's optional input (an overridable initializer, default 0: every
# position): n > 0 gives the logits of the last n positions only, as transformers'
# logits_to_keep; a prefill for generation needs one. Its logits are [batch, LOGITS_SEQUENCE, vocab].
LOGITS_TO_KEEP, LOGITS_SEQUENCE = "logits_to_keep", "logits_sequence"
# The precision of the expert part (the FFN weights and the op); see exporter.py. int8 and int4
# store the expert weights for `infmoe::QContinuousSliceFFN` (SPEC §6, docs/guide/quantization.md).
DTYPES = PRECISIONS
# The other matrices (attention, the tied embedding / LM head): kept float32 or ONNX QDQ.
QUANTIZE_OTHER = ("none", "int8", "int4")
# What the graph is written for (docs/guide/export.md, The export choice): standard ops only (portable, tensorrt:
# TensorRT fuses attention itself), or onnxruntime's fused contrib ops with a KV cache that past
# and present may share in place. Files from before targets are portable.
TARGETS, DEFAULT_TARGET = ("portable", "onnxruntime", "tensorrt"), "portable"
# What an artifact is for (`--for`, options.export_choices): the runtime, whose fastest graph is
# written (tensorrt: the standard-op graph `infmoe-export trt` builds engines from; portable:
# standard ops and the expert op, for any runtime or tool).
DEPLOYMENTS, DEFAULT_DEPLOYMENT = ("onnxruntime", "tensorrt", "portable"), "onnxruntime"
# The onnxruntime target's GroupQueryAttention reads these two; the graph computes them from
# attention_mask (as onnxruntime-genai's builder does), so clients feed Optimum's inputs only.
SEQLENS_K, TOTAL_SEQUENCE_LENGTH = "seqlens_k", "total_sequence_length"


# The quantized ops' activations (docs/guide/quantization.md#int8-activations): float32, SPEC §6's
# (level 1), or int8 per row and group of 32 columns with integer dot products (judged at level 2).
# A model carries the kind it is deployed with (infmoe.activations); a session may ask for the other.
ACTIVATION_KINDS = ("float", "int8")
# The KV cache's element type (past_key_values.* and present.*): float32, or float16 on the
# onnxruntime target, whose attention reads it converted to float32 (half the bytes a decode step
# reads of it; its keys and values rounded to 11 bits, as the PyTorch reference then rounds them
# too: InfMoEGPT's cache_dtype). Older files: float32.
KV_CACHES = ("float32", "float16")


def precision_name(dtype: str, quantize_other: str = "none") -> str:
    """fp32, fp16; all-int8 / all-int4 (every matrix SPEC §6 lets be quantized: the experts,
    attention, the tied embedding / LM head); "int4 experts" (the experts alone); "int4 experts,
    int8 other" (mixed)."""
    if quantize_other == "none":
        return f"{dtype} experts" if dtype in BITS else dtype
    return f"all-{dtype}" if dtype == quantize_other else f"{dtype} experts, {quantize_other} other"


def export_label(target: str, precision: str, kv_cache: str = "float32") -> str:
    """What was exported, as commands and reports name it: 'onnxruntime all-int4', with ' kv16'
    for a float16 KV cache."""
    return f"{target} {precision}" + (" kv16" if kv_cache == "float16" else "")


@dataclass(frozen=True)
class DecoderIO:
    config: Union[InfMoEConfig, MoEConfig]
    k: int
    noise: str = "quantile"
    past: bool = True
    with_starts: bool = False
    dtype: str = "fp32"
    block_size: int = DEFAULT_BLOCK_SIZE
    quantize_other: str = "none"
    target: str = DEFAULT_TARGET
    activations: str = "float"
    kv_cache: str = "float32"

    def __post_init__(self):
        if not isinstance(self.k, int) or isinstance(self.k, bool) or not 1 <= self.k <= MAX_K:
            raise InfMoEError(f"expert budget K must be an integer in [1, {MAX_K}], got {self.k!r}")
        if self.noise not in NOISE_MODES:
            raise InfMoEError(f"noise mode must be one of {NOISE_MODES}, got {self.noise!r}")
        if self.dtype not in DTYPES:
            raise InfMoEError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.quantize_other not in QUANTIZE_OTHER:
            raise InfMoEError(f"quantize_other must be one of {QUANTIZE_OTHER}, got {self.quantize_other!r}")
        check_block_size(self.block_size)
        if self.target not in TARGETS:
            raise InfMoEError(f"target must be one of {TARGETS}, got {self.target!r}")
        if self.activations not in ACTIVATION_KINDS:
            raise InfMoEError(f"activations must be one of {ACTIVATION_KINDS}, got {self.activations!r}")
        if self.activations == "int8" and not (self.quantized and self.target == "onnxruntime"):
            raise InfMoEError("int8 activations apply to the onnxruntime target's int8 / int4 weights, "
                              f"not to a {self.target} {self.precision} model")
        if self.kv_cache not in KV_CACHES:
            raise InfMoEError(f"kv_cache must be one of {KV_CACHES}, got {self.kv_cache!r}")
        if self.kv_cache == "float16" and self.target != "onnxruntime":
            raise InfMoEError(f"a float16 KV cache applies to the onnxruntime target, not to {self.target}")
        if self.kv_cache == "float16" and not self.past:
            raise InfMoEError("a float16 KV cache applies to a model with a cache, not to one without past")
        if self.is_moe:
            self._check_moe()

    def _check_moe(self):
        """A conventional MoE's budget is its top_k and it has no noise (docs/reference/spec.md §7)."""
        c = self.config
        if self.k != c.top_k:
            raise InfMoEError(f"expert budget K = {self.k} does not apply to a conventional MoE: every token runs "
                              f"its top_k = {c.top_k} experts")
        if self.noise != "quantile":
            raise InfMoEError("sampled noise does not apply to a conventional MoE: its router is deterministic")
        if self.dtype not in MOE_DTYPES:
            raise InfMoEError(f"a conventional MoE is exported at {', '.join(MOE_DTYPES)}, not {self.dtype} "
                              "(onnxruntime's MoE / QMoE experts)")
        if self.target not in MOE_TARGETS:
            raise InfMoEError(f"a conventional MoE is exported for {' or '.join(MOE_TARGETS)}, not {self.target}: "
                              "its experts are onnxruntime's MoE / QMoE, which TensorRT has no plugin for")

    @property
    def is_moe(self) -> bool:
        """A conventional top-k MoE (model_type moe-gpt2), exported with onnxruntime's MoE ops."""
        return self.config.model_type == "moe-gpt2"

    # -- quantization (SPEC §6) -------------------------------------------------------------

    @property
    def bits(self) -> Optional[int]:
        """Bits of the expert weights, None when they are float."""
        return BITS.get(self.dtype)

    @property
    def other_bits(self) -> Optional[int]:
        """Bits of attention and the tied embedding / LM head, None when they are float32."""
        return BITS.get(self.quantize_other)

    @property
    def quantized(self) -> List[str]:
        """What is stored as integers: "experts", "attention", "embedding" (the tied LM head)."""
        return (["experts"] if self.bits else []) + (["attention", "embedding"] if self.other_bits else [])

    @property
    def experts_in_op(self) -> bool:
        """Whether the expert matrices go to the expert op: always in a sparse model; in a dense
        one (slice_width = ffn_hidden: every window is all of H) at int8 / int4 on the onnxruntime
        target, where the quantized op reads both matrices packed (as a standard MLP, its w_out,
        blocked along the output dimension, is dequantized every step). Otherwise a dense model's
        experts are a standard MLP. A conventional MoE's experts are always in onnxruntime's MoE /
        QMoE op."""
        return self.is_moe or not self.config.is_dense or (self.target == "onnxruntime" and self.bits is not None)

    @property
    def custom_ops(self) -> bool:
        """Whether the graph holds infmoe ops, which only the kernel library or their fallback
        functions run: the expert op, or the onnxruntime target's own (a conventional MoE's
        experts are onnxruntime's own ops, which every onnxruntime runs)."""
        return (self.experts_in_op and not self.is_moe) or self.target == "onnxruntime"

    @property
    def precision(self) -> str:
        """The weights' precision in a word or two (precision_name)."""
        return precision_name(self.dtype, self.quantize_other)

    @property
    def label(self) -> str:
        """What was exported, as commands and reports name it (export_label)."""
        return export_label(self.target, self.precision, self.kv_cache)

    @property
    def cache_dtype(self) -> type:
        """The numpy dtype of past_key_values.* and present.*."""
        return np.float16 if self.kv_cache == "float16" else np.float32

    @property
    def shares_cache(self) -> bool:
        """past and present may be one buffer of n_positions written in place (the onnxruntime
        target's GroupQueryAttention); otherwise present is a new past + sequence tensor."""
        return self.past and self.target == "onnxruntime"

    @property
    def keeps_logits(self) -> bool:
        """Whether the graph takes LOGITS_TO_KEEP (the onnxruntime target)."""
        return self.target == "onnxruntime"

    # -- names and shapes --------------------------------------------------------------------

    @property
    def past_names(self) -> List[str]:
        if not self.past:
            return []
        return [f"past_key_values.{i}.{kv}" for i in range(self.config.n_layer) for kv in ("key", "value")]

    @property
    def input_names(self) -> List[str]:
        noise = ["expert_noise"] if self.noise == "sampled" else []
        return ["input_ids", "attention_mask"] + self.past_names + noise

    @property
    def output_names(self) -> List[str]:
        names = ["logits"]
        if self.past:
            names += [f"present.{i}.{kv}" for i in range(self.config.n_layer) for kv in ("key", "value")]
        if self.with_starts:
            names += [f"expert_starts.{i}" for i in range(self.config.n_layer)]
        return names

    def shapes(self) -> Dict[str, list]:
        """Every input and output: its shape, a dim name (str) where dynamic, an int where fixed."""
        c = self.config
        kv = [BATCH, c.n_head, PAST, c.head_dim]
        shapes = {"input_ids": [BATCH, SEQUENCE], "attention_mask": [BATCH, TOTAL if self.past else SEQUENCE],
                  "expert_noise": [BATCH, SEQUENCE, self.k],
                  "logits": [BATCH, LOGITS_SEQUENCE if self.keeps_logits else SEQUENCE, c.vocab_size]}
        for name in self.past_names:
            shapes[name] = kv
            shapes[name.replace("past_key_values", "present")] = [BATCH, c.n_head, TOTAL, c.head_dim]
        for i in range(c.n_layer):
            shapes[f"expert_starts.{i}"] = [BATCH, SEQUENCE, self.k]
        return {name: shapes[name] for name in self.input_names + self.output_names}

    def dtypes(self) -> Dict[str, type]:
        """numpy dtype per input/output: float32 (fp16 is inside the FFN) but the ids, the mask,
        the starts (int64) and the cache (cache_dtype)."""
        types = {name: np.float32 for name in self.input_names + self.output_names}
        types.update({"input_ids": np.int64, "attention_mask": np.int64})
        types.update({name: self.cache_dtype for name in self.input_names + self.output_names
                      if name.startswith(("past_key_values.", "present."))})
        types.update({name: np.int64 for name in self.output_names if name.startswith("expert_starts.")})
        return types

    # -- feeds -------------------------------------------------------------------------------

    def feed(self, input_ids, attention_mask, past: Optional[Sequence] = None, expert_noise=None) -> "OrderedDict":
        """An input feed (numpy, ONNX names) from arrays; past is the flat list of present arrays
        (converted to cache_dtype where they are not: a float32 reference's cache)."""
        step = self.step_inputs(input_ids, attention_mask, expert_noise)
        feed = OrderedDict((name, step.pop(name)) for name in ("input_ids", "attention_mask"))
        if self.past:
            if past is None:  # prefill: an empty cache
                c = self.config
                empty = np.zeros((feed["input_ids"].shape[0], c.n_head, 0, c.head_dim), dtype=self.cache_dtype)
                past = [empty] * len(self.past_names)
            feed.update((name, np.asarray(array, self.cache_dtype)) for name, array in zip(self.past_names, past))
        feed.update(step)
        return feed

    def step_inputs(self, input_ids, attention_mask, expert_noise=None) -> Dict[str, np.ndarray]:
        """The inputs of a step but the cache: what a runner with the cache bound feeds."""
        inputs = {"input_ids": np.asarray(input_ids, dtype=np.int64),
                  "attention_mask": np.asarray(attention_mask, dtype=np.int64)}
        if self.noise == "sampled":
            if expert_noise is None:
                raise InfMoEError("a sampled-noise model needs expert_noise [batch, sequence, K]")
            inputs["expert_noise"] = np.asarray(expert_noise, dtype=np.float32)
        return inputs

    def dummy_inputs(self, batch: int = 2, sequence: int = 5, past_sequence: int = 3, left_pad: int = 1,
                     seed: int = 0) -> "OrderedDict":
        """Random inputs: byte ids, the first row left-padded by left_pad tokens, a random cache
        and noise. Sizes above 1 keep torch.export from specialising a dynamic dim."""
        c = self.config
        rng = np.random.default_rng(seed)
        ids = rng.integers(0, min(256, c.vocab_size), (batch, sequence))
        past_sequence = past_sequence if self.past else 0
        mask = np.ones((batch, past_sequence + sequence), dtype=np.int64)
        mask[0, :left_pad] = 0
        past = [rng.standard_normal((batch, c.n_head, past_sequence, c.head_dim)).astype(self.cache_dtype)
                for _ in self.past_names] if self.past else None
        noise = rng.standard_normal((batch, sequence, self.k)) if self.noise == "sampled" else None
        return self.feed(ids, mask, past, noise)

    def flatten(self, output: Output) -> "OrderedDict":
        """The reference model's Output as {ONNX output name: tensor}."""
        tensors = [output.logits]
        if self.past:
            tensors += [t for kv in output.present for t in kv]
        if self.with_starts:
            tensors += list(output.starts)
        return OrderedDict(zip(self.output_names, tensors))

    # -- metadata ----------------------------------------------------------------------------

    def metadata(self, opset: int, has_function: bool) -> Dict[str, str]:
        """The model's metadata_props: everything a runtime or report needs, no side files."""
        from . import __version__

        return {"infmoe.config": json.dumps(self.config.to_dict(), sort_keys=True), "infmoe.k": str(self.k),
                "infmoe.noise": self.noise, "infmoe.past": str(int(self.past)),
                "infmoe.with_starts": str(int(self.with_starts)), "infmoe.dtype": self.dtype,
                "infmoe.bits": str(self.bits or (16 if self.dtype == "fp16" else 32)),
                "infmoe.block_size": str(self.block_size), "infmoe.quantize_other": self.quantize_other,
                "infmoe.quantized": ",".join(self.quantized),
                "infmoe.target": self.target, "infmoe.activations": self.activations,
                "infmoe.kv_cache": self.kv_cache, "infmoe.opset": str(opset),
                "infmoe.has_function": str(int(has_function)),
                "infmoe.exporter_version": __version__}

    @classmethod
    def from_metadata(cls, props: Dict[str, str]) -> "DecoderIO":
        try:
            config = config_from_dict(json.loads(props["infmoe.config"]))
            # Files from before quantization have no block size or quantize_other: nothing else
            # quantized; from before targets, activations and kv_cache: portable, float, float32.
            return cls(config, int(props["infmoe.k"]), props["infmoe.noise"], props["infmoe.past"] == "1",
                       props["infmoe.with_starts"] == "1", props["infmoe.dtype"],
                       int(props.get("infmoe.block_size", DEFAULT_BLOCK_SIZE)),
                       props.get("infmoe.quantize_other", "none"),
                       target=props.get("infmoe.target", DEFAULT_TARGET),
                       activations=props.get("infmoe.activations", "float"),
                       kv_cache=props.get("infmoe.kv_cache", "float32"))
        except (KeyError, ValueError) as error:
            raise InfMoEError(f"not an infmoe-export model: metadata {error} is missing or invalid") from None


@dataclass(frozen=True)
class ExportChoice:
    """One artifact's export settings: the graph's target and every matrix's precision.
    options() are export_onnx's (and export_many's) keywords; label names it ('onnxruntime
    all-int4', as DecoderIO.label names the exported file); note, when set, says why the target
    differs from the default one."""
    target: str = DEFAULT_DEPLOYMENT
    dtype: str = "fp32"
    quantize_other: str = "none"
    block_size: int = DEFAULT_BLOCK_SIZE
    activations: str = "float"
    kv_cache: str = "float32"
    note: Optional[str] = field(default=None, compare=False)

    @property
    def precision(self) -> str:
        return precision_name(self.dtype, self.quantize_other)

    @property
    def label(self) -> str:
        return export_label(self.target, self.precision, self.kv_cache)

    def options(self) -> dict:
        return {"target": self.target, "dtype": self.dtype, "quantize_other": self.quantize_other,
                "block_size": self.block_size, "activations": self.activations, "kv_cache": self.kv_cache}


# An exported folder (`infmoe-export onnx --out DIR`) keeps the metadata in config.json too,
# under this key, so a model whose metadata a tool dropped is still understood (see read).
FOLDER_CONFIG, FOLDER_KEY = "config.json", "infmoe"


def load_graph(path: Union[str, os.PathLike]) -> "onnx.ModelProto":
    """An ONNX file without its external weights (metadata, nodes, functions), or a one-line error."""
    if not os.path.isfile(path):
        raise InfMoEError(f"ONNX model {path} does not exist or is not a file")
    try:
        return onnx.load(str(path), load_external_data=False)
    except Exception as error:  # protobuf's DecodeError and friends
        raise InfMoEError(f"{path} is not a readable ONNX model ({type(error).__name__})") from None


def custom_op_types(nodes) -> set:
    """The infmoe ops a graph's nodes use."""
    return {n.op_type for n in nodes if n.domain == DOMAIN}


def moe_op_types(nodes) -> set:
    """onnxruntime's MoE / QMoE ops a graph's nodes use (a conventional MoE's experts)."""
    return {n.op_type for n in nodes if n.domain == MS_DOMAIN and n.op_type in MOE_OP_TYPES}


def holds_functions(nodes, functions) -> bool:
    """Whether the graph uses ops that carry a fallback function (the infmoe ops, onnxruntime's
    MoE / QMoE) and holds the function of every one."""
    used = {(DOMAIN, t) for t in custom_op_types(nodes)} | {(MS_DOMAIN, t) for t in moe_op_types(nodes)}
    return bool(used) and used <= {(f.domain, f.name) for f in functions}


def custom_op_type(nodes) -> str:
    """The custom op a graph's nodes use: the quantized one (SPEC §6) when any node is."""
    return Q_OP_TYPE if any(n.domain == DOMAIN and n.op_type == Q_OP_TYPE for n in nodes) else OP_TYPE


def folder_metadata(path: Union[str, os.PathLike]) -> Optional[Dict[str, str]]:
    """The export's metadata kept in config.json beside the model (an exported folder), or None."""
    config = Path(path).parent / FOLDER_CONFIG
    try:
        metadata = json.loads(config.read_text())[FOLDER_KEY]["metadata"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not isinstance(metadata, dict) or "infmoe.config" not in metadata:
        return None
    return {str(k): str(v) for k, v in metadata.items()}


@dataclass(frozen=True)
class ExportedModel:
    """An exported file, the DecoderIO it was made with and its metadata, read once."""
    path: Path
    io: DecoderIO
    metadata: Dict[str, str] = field(repr=False, compare=False)

    @classmethod
    def read(cls, path: Union[str, os.PathLike]) -> "ExportedModel":
        """The model's own metadata; when a tool dropped it (graph surgeon, some converters) and
        the model lies in an exported folder, the copy in its config.json. has_function is then
        what the file holds, not what the copy says."""
        graph = load_graph(path)  # read once: metadata and functions come from the same load
        metadata = {p.key: p.value for p in graph.metadata_props}
        if "infmoe.config" not in metadata:
            metadata = folder_metadata(path) or metadata
        has_function = holds_functions(graph.graph.node, graph.functions)
        if metadata.get("infmoe.has_function") == "1" and not has_function:
            # e.g. saved by an onnxruntime session that had the kernel: the op stayed, the function went
            metadata = {**metadata, "infmoe.has_function": "0", "infmoe.function_dropped": "1"}
        return cls(Path(path), DecoderIO.from_metadata(metadata), metadata)

    @property
    def k(self) -> int:
        return self.io.k

    @property
    def noise(self) -> str:
        return self.io.noise

    @property
    def has_function(self) -> bool:
        return self.metadata.get("infmoe.has_function") == "1"

    def feed(self, input_ids: np.ndarray, *, past: Optional[dict] = None, expert_noise=None,
             seed: int = 0) -> "OrderedDict":
        """A feed of input_ids [B, T] with an all-ones attention mask, the given cache (a dict of
        present.{i}.* arrays) or an empty one, and expert noise for a sampled-noise model
        (seeded N(0, 1) unless given)."""
        B, T = input_ids.shape
        past_len = 0 if past is None else past["present.0.key"].shape[2]
        cache = None if past is None else [past[n.replace("past_key_values", "present")] for n in self.io.past_names]
        if self.noise == "sampled" and expert_noise is None:
            expert_noise = np.random.default_rng(seed).standard_normal((B, T, self.k))
        return self.io.feed(input_ids, np.ones((B, past_len + T), dtype=np.int64), cache, expert_noise)
