"""Our expert op beside onnxruntime's own `com.microsoft` MoE (fp32) and QMoE (int8, int4, block
32) on equal active bytes, at the GPT-2-Small-size ∞-MoE layer (D 768, H 6144), in one run.

    .venv/bin/python -m benchmarks.moe_peer [--pairing both|24x256|4x1536] [--precisions fp32,int4,int8,int4-a8]
        [--threads 2] [--rounds 60] [--prefill-rounds 7] [--layers N] [--quick] [--json benchmarks/results/moe_peer.json]

Pairings (the same H = 6144 units in all, the same units active per token):
- 24x256: theirs 24 experts of 256 units, top 6; ours windows of r = 256, K = 6;
- 4x1536: theirs 4 experts of 1536 units, top 1; ours r = 1536, K = 1.
A token's K windows are disjoint, at uniformly random starts, so its active units are exactly
K·r = k·I on both sides; the bytes differ only by the biases (theirs reads an fc2 bias per picked
expert, ours b_out once). Theirs routes by a random router [D, E] per layer applied to the step's
tokens, so different tokens pick different experts. Theirs are our weights cut into experts
(fc1 = rows of w_in, fc2 = w_out's rows transposed, every expert's fc2 bias our b_out), so with
windows on expert boundaries and tied router logits the two compute the same function: checked
before timing (fp32 to float rounding; the quantized ones differ in how fc2 is blocked).

Timed: a call of a chain of layers (each its own weights, as initializers, the way an export
writes them; onnxruntime prepacks QMoE's), as many that a batch-1 call reads twice the last-level
cache (at least 12; prefill, which reads all of a layer's weights, runs the first 12), cycling
over 8 routings, so the weights come from memory, not the cache; reported per layer. Batch-1
decode, batched decode (B = 4, 16: one token a sequence) and prefill (128, 512 tokens) are all T
tokens through each layer. Ours and theirs take turns in every round (shuffled order) on one
shared intra-op pool; the speed ratio (theirs' time over ours': above 1, ours is faster) is the
median over rounds of the ratio within each.

What onnxruntime's CPU MoE and QMoE take (read off their schemas and kernels, checked against
a NumPy reference in tests/test_moe_peer.py), what an export to them writes:
- `input` [T, D] (or [B, S, D]); `router_probs` [T, E] are router logits: the kernel takes the
  softmax over all E, keeps the top `k` (a partial sort: equal logits in no stated order), and
  with `normalize_routing_weights` = 1 divides the k kept by their sum (= the softmax over the k
  picked logits; 0 keeps the full softmax's values). The output is sum_j p_j (expert_j(x)),
  each expert's fc2 bias inside the weighting.
- MoE (float32/16): `fc1_experts_weights` [E, I, D] (row i = hidden unit i, our w_in's rows),
  `fc1_experts_bias` [E, I], `fc2_experts_weights` [E, D, I] (our w_out's rows transposed),
  `fc2_experts_bias` [E, D]. No fc3 on CPU except fused SwiGLU (swiglu_fusion = 1).
- `activation_type`: relu (default), gelu, silu, swiglu, identity. The CPU `gelu` is the tanh
  form, our gelu_tanh exactly (the erf form is 1e-3 away: the test tells them apart).
- QMoE, quant_type "int": `expert_weight_bits` 4 or 8; `block_size` a power of two >= 16 dividing
  D and I (absent: one scale per row). fc1 uint8 [E, I, D·bits/8], fc2 uint8 [E, D, I·bits/8]:
  row-major [N, K] per expert, K packed, even column in the low nibble; w = (stored - zp) ·
  scale with zp = 2^(bits-1) when no zero points are given: our QContinuousSliceFFN storage
  byte for byte, so our w_in_q is fc1 as it is; fc2 is w_out requantized along I (ours blocks
  w_out along D). `fc1_scales` [E, I, D/B], `fc2_scales` [E, D, I/B], float32 (or 16); optional
  `fcN_zero_points` uint8 [E, N, ceil(K/B · bits/8)]. Input order: input, router_probs,
  fc1_experts_weights, fc1_scales, fc1_experts_bias, fc2_experts_weights, fc2_scales,
  fc2_experts_bias.
- `accuracy_level`: 0 keeps float activations for int4 experts; 4 gives int4 experts int8
  activations (per token, groups of B columns, amax / 127: quant.int8_activations' rounding)
  into both products; int8 experts take int8 activations at every level (environment
  ORT_QMOE_CPU_QNBIT_GEMM=fp32 forces their float dequantize path instead).
Precisions here: `fp32`; `int4`, float activations on both sides (level 0); `int8` and
`int4-a8`, int8 activations on both sides (level 4; ours with infmoe.activations = int8, which
quantizes x for the w_in product only: the w_out product stays float).
"""

import argparse
import dataclasses
import datetime
import os
import pathlib
import statistics
from typing import Dict, List, Optional

import numpy as np
import onnxruntime as ort
import torch
from onnx import TensorProto, helper, numpy_helper

from infmoe_export.contract import DOMAIN, MS_DOMAIN, OP_TYPE
from infmoe_export.errors import InfMoEError
from infmoe_export.export.moe import FLOAT_INPUTS, QUANTIZED_INPUTS, moe_attributes
from infmoe_export.limits import check_fits
from infmoe_export.quant import Q_OP_TYPE, QuantizedWeight, expert_bytes
from infmoe_export.report.timing import cycling, last_level_cache_bytes, paired_ratio, rounds
from infmoe_export.runtimes.ort_kernel import custom_op_library

from . import arguments, record
from .sessions import op_session, use_shared_pool
from .shapes import BLOCK, D, H, LAYERS

ROUTINGS = 8          # routings cycled per measurement, so no call reads only what the last one did
CACHE_FALLBACK = 32 << 20  # where the kernel reports no cache size
WEIGHT_SCALE = 0.02   # the random weights' spread (as benchmarks.op's)
SAME_FUNCTION_TOL = 1e-4  # fp32 ours vs theirs on aligned windows, relative to theirs' largest |y|
QUICK = dict(layers=2, batches=[1], prefills=[128], rounds=3, prefill_rounds=2)


@dataclasses.dataclass(frozen=True)
class Pairing:
    """Theirs: `experts` experts of `units` hidden units, top `k`; ours: windows of r = units, K = k."""
    name: str
    experts: int
    units: int
    k: int

    @property
    def hidden(self) -> int:
        return self.experts * self.units


PAIRINGS = {p.name: p for p in (Pairing("24x256", 24, 256, 6), Pairing("4x1536", 4, 1536, 1))}


@dataclasses.dataclass(frozen=True)
class Precision:
    name: str
    bits: Optional[int]          # None: float32
    activations: str = "float"   # both sides': "int8" is ours' infmoe.activations, theirs' accuracy level 4

    @property
    def accuracy_level(self) -> int:
        """QMoE's (its int8 experts take int8 activations at any level)."""
        return 4 if self.activations == "int8" else 0


PRECISIONS = {p.name: p for p in (Precision("fp32", None), Precision("int4", 4), Precision("int8", 8, "int8"),
                                  Precision("int4-a8", 4, "int8"))}
# The goals of the issue that asked for this peer: ours / theirs speed at int4, at least.
GOALS = {"decode": 1.5, "batched": 1.0, "prefill": 1.0}

OURS_FLOAT = ("w_in", "b_in", "w_out", "b_out")
OURS_QUANTIZED = ("w_in_q", "w_in_scale", "b_in", "w_out_q", "w_out_scale", "b_out")


def random_layer(rng: np.random.Generator, d: int, h: int) -> Dict[str, np.ndarray]:
    """One expert layer's float32 weights (ours' layout), every one random."""
    return {name: (rng.standard_normal(shape) * WEIGHT_SCALE).astype(np.float32)
            for name, shape in (("w_in", (h, d)), ("b_in", (h,)), ("w_out", (h, d)), ("b_out", (d,)))}


def layer_tensors(layer: Dict[str, np.ndarray], bits: Optional[int], block: int) -> Dict[str, np.ndarray]:
    """A layer at a precision: ours' inputs by name, and w_out_t [D, ...] (w_out transposed, at
    int8/int4 quantized along H), which theirs' fc2 is cut from."""
    if bits is None:
        return {**layer, "w_out_t": np.ascontiguousarray(layer["w_out"].T)}
    q = {n: QuantizedWeight.of(torch.from_numpy(w), bits, block)
         for n, w in (("w_in", layer["w_in"]), ("w_out", layer["w_out"]), ("w_out_t", layer["w_out"].T))}
    out = {"b_in": layer["b_in"], "b_out": layer["b_out"]}
    for name, weight in q.items():
        out[f"{name}_q"], out[f"{name}_scale"] = weight.packed.numpy(), weight.scale.numpy()
    return out


def _rows_per_expert(t: np.ndarray, experts: int) -> np.ndarray:
    """[H, ...] -> [E, H / E, ...]: expert e holds hidden units e·I .. (e + 1)·I - 1."""
    return t.reshape(experts, -1, *t.shape[1:])


def _columns_per_expert(t: np.ndarray, experts: int) -> np.ndarray:
    """[D, c] whose columns run over H -> [E, D, c / E]."""
    return np.ascontiguousarray(t.reshape(t.shape[0], experts, -1).transpose(1, 0, 2))


def theirs_tensors(tensors: Dict[str, np.ndarray], experts: int, bits: Optional[int]) -> Dict[str, np.ndarray]:
    """layer_tensors cut into MoE's (bits None) or QMoE's expert inputs."""
    bias = {"fc1_experts_bias": _rows_per_expert(tensors["b_in"], experts),
            "fc2_experts_bias": np.ascontiguousarray(np.broadcast_to(tensors["b_out"], (experts, tensors["b_out"].size)))}
    if bits is None:
        return {"fc1_experts_weights": _rows_per_expert(tensors["w_in"], experts),
                "fc2_experts_weights": _columns_per_expert(tensors["w_out_t"], experts), **bias}
    return {"fc1_experts_weights": _rows_per_expert(tensors["w_in_q"], experts),
            "fc1_scales": _rows_per_expert(tensors["w_in_scale"], experts),
            "fc2_experts_weights": _columns_per_expert(tensors["w_out_t_q"], experts),
            "fc2_scales": _columns_per_expert(tensors["w_out_t_scale"], experts), **bias}


def _chain(op_type: str, domain: str, route: str, route_type: int, weight_names, layers: List[Dict[str, np.ndarray]],
           attributes: dict):
    """A model of len(layers) nodes, each one layer with its weights as initializers, layer l
    reading layer l - 1's output and its own routing input `{route}_{l}`: X [T, D] -> Y."""
    nodes, initializers, inputs = [], [], [helper.make_tensor_value_info("X", TensorProto.FLOAT, None)]
    for index, tensors in enumerate(layers):
        x_in = "X" if index == 0 else f"X_{index}"
        x_out = "Y" if index == len(layers) - 1 else f"X_{index + 1}"
        names = [f"{n}_{index}" for n in weight_names]
        nodes.append(helper.make_node(op_type, [x_in, f"{route}_{index}", *names], [x_out], domain=domain,
                                      name=f"layer_{index}", **attributes))
        initializers += [numpy_helper.from_array(tensors[n], name) for n, name in zip(weight_names, names)]
        inputs.append(helper.make_tensor_value_info(f"{route}_{index}", route_type, None))
    graph = helper.make_graph(nodes, f"{op_type}_chain", inputs, [helper.make_tensor_value_info("Y", TensorProto.FLOAT, None)],
                              initializers)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid(domain, 1)],
                             ir_version=10)


def ours_model(layers: List[Dict[str, np.ndarray]], pairing: Pairing, bits: Optional[int], block: int = BLOCK):
    """Our op (ContinuousSliceFFN, or QContinuousSliceFFN at bits), r = units, in a chain of the
    layers (layer_tensors); routing inputs starts_l int64 [T, K]."""
    attributes = dict(slice_width=pairing.units, activation="gelu_tanh")
    if bits is None:
        return _chain(OP_TYPE, DOMAIN, "starts", TensorProto.INT64, OURS_FLOAT, layers, attributes)
    return _chain(Q_OP_TYPE, DOMAIN, "starts", TensorProto.INT64, OURS_QUANTIZED, layers,
                  dict(attributes, bits=bits, block_size=block))


def theirs_model(layers: List[Dict[str, np.ndarray]], pairing: Pairing, bits: Optional[int], block: int = BLOCK,
                 accuracy_level: int = 0):
    """onnxruntime's MoE (or QMoE at bits, block-wise) of the same layers cut into
    pairing.experts experts, top pairing.k, softmax over the picked logits, tanh GELU; routing
    inputs logits_l float [T, E]."""
    layers = [theirs_tensors(t, pairing.experts, bits) for t in layers]
    attributes = moe_attributes(pairing.k, 1, bits, block, accuracy_level)
    if bits is None:
        return _chain("MoE", MS_DOMAIN, "logits", TensorProto.FLOAT, FLOAT_INPUTS, layers, attributes)
    return _chain("QMoE", MS_DOMAIN, "logits", TensorProto.FLOAT, QUANTIZED_INPUTS, layers, attributes)


def disjoint_starts(rng: np.random.Generator, tokens: int, k: int, r: int, h: int) -> np.ndarray:
    """Starts [tokens, k] of k disjoint windows of r units in [0, h) per token, every placement
    equally likely: k distinct positions among h - k·r + k, then spread out by r - 1 each."""
    free = h - k * r
    if free < 0:
        raise InfMoEError(f"{k} disjoint windows of {r} units do not fit in {h}")
    picks = np.sort(np.stack([rng.choice(free + k, k, replace=False) for _ in range(tokens)]), axis=1)
    return (picks + np.arange(k) * (r - 1)).astype(np.int64)


def top_experts(logits: np.ndarray, k: int) -> np.ndarray:
    """The k experts each token's logits pick, [T, k]."""
    return np.argsort(-logits, axis=1, kind="stable")[:, :k]


def union_units(starts: np.ndarray, r: int, h: int) -> int:
    """Hidden units covered by any window of any token: what a call of our op reads."""
    covered = np.zeros(h + 1, np.int64)
    np.add.at(covered, starts.ravel(), 1)
    np.add.at(covered, starts.ravel() + r, -1)
    return int((np.cumsum(covered)[:h] > 0).sum())


def routings(rng, pairing: Pairing, layers: int, tokens: int, count: int = ROUTINGS):
    """`count` routings of `tokens` random tokens through a chain of `layers`: each a pair
    (ours' feeds, theirs' feeds) of OrtValues; and what they touch (mean units a layer reads:
    theirs' experts picked by any token, ours' windows' union). Theirs' logits: a random router
    [D, E] per layer times the tokens."""
    routers = (rng.standard_normal((layers, D, pairing.experts)) / np.sqrt(D)).astype(np.float32)
    out, experts_touched, units_touched = [], [], []
    for _ in range(count):
        x = rng.standard_normal((tokens, D)).astype(np.float32)
        ours, theirs = {"X": x}, {"X": x}
        for layer in range(layers):
            logits = x @ routers[layer]
            starts = disjoint_starts(rng, tokens, pairing.k, pairing.units, pairing.hidden)
            theirs[f"logits_{layer}"], ours[f"starts_{layer}"] = logits, starts
            experts_touched.append(len(np.unique(top_experts(logits, pairing.k))))
            units_touched.append(union_units(starts, pairing.units, pairing.hidden))
        out.append(tuple({n: ort.OrtValue.ortvalue_from_numpy(v) for n, v in feeds.items()} for feeds in (ours, theirs)))
    experts = statistics.mean(experts_touched)
    touched = dict(theirs_experts=experts, theirs_units=experts * pairing.units,
                   ours_units=statistics.mean(units_touched))
    return out, touched


def aligned_routing(rng, pairing: Pairing, layers: int, tokens: int = 3, d: int = D):
    """Feeds under which ours and theirs compute the same function: each token's k experts picked
    at random, theirs' logits tied among them (weights 1/k) and far below elsewhere, ours'
    windows exactly on those experts (coverage 1/K)."""
    x = rng.standard_normal((tokens, d)).astype(np.float32)
    ours, theirs = {"X": x}, {"X": x}
    for layer in range(layers):
        picked = np.stack([rng.choice(pairing.experts, pairing.k, replace=False) for _ in range(tokens)])
        logits = np.full((tokens, pairing.experts), -30.0, np.float32)
        np.put_along_axis(logits, picked, 0.0, axis=1)
        theirs[f"logits_{layer}"], ours[f"starts_{layer}"] = logits, (picked * pairing.units).astype(np.int64)
    return ours, theirs


def active_bytes(pairing: Pairing, bits: Optional[int], block: int = BLOCK) -> dict:
    """Bytes one token reads per layer: the k·I active units' rows of both matrices (with
    scales) and the biases, ours and theirs."""
    units = pairing.k * pairing.units

    def matrix(rows, columns):
        return rows * columns * 4 if bits is None else expert_bytes(rows, columns, bits, block)

    ours = 2 * matrix(units, D) + 4 * units + 4 * D
    theirs = pairing.k * (matrix(pairing.units, D) + matrix(D, pairing.units) + 4 * pairing.units + 4 * D)
    return dict(active_units=units, ours=ours, theirs=theirs, theirs_over_ours=theirs / ours)


def relative_difference(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max() / np.abs(b).max())


def phases(args) -> list:
    """(phase, tokens, rounds) of every measurement."""
    return [("decode" if b == 1 else "batched", b, args.rounds) for b in args.batches] + \
           [("prefill", t, args.prefill_rounds) for t in args.prefills]


def label(phase: str, tokens: int) -> str:
    return {"decode": "decode B=1", "batched": f"batched decode B={tokens}", "prefill": f"prefill T={tokens}"}[phase]


def layer_bytes(bits: Optional[int]) -> int:
    """One whole layer's weights, scales and biases (ours; theirs' are the same but for D biases
    a expert)."""
    matrix = 4 * H * D if bits is None else expert_bytes(H, D, bits, BLOCK)
    return 2 * matrix + 4 * (H + D)


def chain_length(args, precision: Precision, cache_bytes: int) -> int:
    """Layers a call chains: --layers, else enough that a batch-1 call reads twice the last-level
    cache (at least LAYERS), so that no call finds much of its weights left there by the calls before."""
    if args.layers:
        return args.layers
    per_layer = min(active_bytes(p, precision.bits)["ours"] for p in PAIRINGS.values())
    return max(LAYERS, -(-2 * cache_bytes // per_layer))


def check_memory(args, counts: Dict[str, int]) -> None:
    """Refuse, before allocating, a run that would not fit: one precision's two chains, each held
    about three times over while its session is made (the proto, its bytes, the session)."""
    largest = max(counts[p.name] * layer_bytes(p.bits) for p in args.precisions)
    try:
        check_fits(2 * 3 * largest, "benchmarks.moe_peer")
    except InfMoEError as error:
        raise SystemExit(f"{error} (give fewer --layers)") from None


def parse(argv=None):
    parser = argparse.ArgumentParser(prog="python -m benchmarks.moe_peer", description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairing", choices=("both", *PAIRINGS), default="both")
    parser.add_argument("--precisions", default="fp32,int4,int8,int4-a8",
                        type=lambda text: _names(text, PRECISIONS), help=f"of {', '.join(PRECISIONS)}")
    parser.add_argument("--threads", type=arguments.thread_count, default=2, help="intra-op threads, one shared pool")
    parser.add_argument("--rounds", type=arguments.count(1, 10_000), default=60, help="rounds per decode measurement")
    parser.add_argument("--prefill-rounds", type=arguments.count(1, 1_000), default=7)
    parser.add_argument("--batches", type=arguments.counts(1, 256), default=[1, 4, 16],
                        help="decode batch sizes (one token a sequence)")
    parser.add_argument("--prefills", type=arguments.counts(1, 4096, empty=True), default=[128, 512],
                        help="prefill lengths ('' for none)")
    parser.add_argument("--layers", type=arguments.count(1, 256), default=None,
                        help="layers chained in a call, each its own weights (default: enough that a batch-1 call "
                             f"reads twice the last-level cache, at least {LAYERS})")
    parser.add_argument("--quick", action="store_true",
                        help=f"a smoke run: {', '.join(f'{k} {v}' for k, v in QUICK.items())} (too few layers to keep "
                             "the weights out of the cache)")
    parser.add_argument("--json", type=pathlib.Path, default=record.default_path("moe_peer"), help="write the results here")
    args = parser.parse_args(argv)
    if args.quick:
        for name, value in QUICK.items():
            setattr(args, name, value)
    return args


def _names(text: str, known: dict) -> list:
    names = [part.strip() for part in text.split(",") if part.strip()]
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"expected names of {', '.join(known)}, got {text!r}")
    return [known[n] for n in names]


def library_modified() -> Optional[str]:
    """When the kernel library this run loads was written (UTC): which build was measured."""
    library = custom_op_library()
    if library is None or not library.is_file():
        return None
    return datetime.datetime.fromtimestamp(library.stat().st_mtime, datetime.timezone.utc).isoformat(timespec="seconds")


def main(argv=None):
    args = parse(argv)
    pairings = list(PAIRINGS.values()) if args.pairing == "both" else [PAIRINGS[args.pairing]]
    cache = last_level_cache_bytes() or CACHE_FALLBACK
    counts = {p.name: chain_length(args, p, cache) for p in args.precisions}
    check_memory(args, counts)
    use_shared_pool(args.threads)
    rng = np.random.default_rng(0)
    results = dict(
        layer=dict(d_model=D, ffn_hidden=H, block_size=BLOCK, routings_cycled=ROUTINGS, last_level_cache_bytes=cache,
                   layers_per_call=counts),
        options=dict(threads=args.threads, rounds=args.rounds, prefill_rounds=args.prefill_rounds, quick=args.quick,
                     pairings=[p.name for p in pairings], precisions=[p.name for p in args.precisions],
                     batches=args.batches, prefills=args.prefills, layers=args.layers),
        load_average_at_start=list(os.getloadavg()), kernel_library_modified=library_modified(),
        pairings=[], unsupported=[], same_function=[], rows=[], goals=[])
    print(f"ours (infmoe op) vs theirs (onnxruntime {ort.__version__} {MS_DOMAIN} MoE / QMoE), D {D}, H {H}, "
          f"{args.threads} threads; speed = theirs' time / ours' (> 1: ours faster)")
    print("layers chained a call (each its own weights): " + ", ".join(f"{n} {c}" for n, c in counts.items()) +
          f"; last-level cache {cache / 2**20:.0f} MiB; load average at start: "
          f"{' '.join(f'{v:.2f}' for v in os.getloadavg())}")
    for pairing in pairings:
        equal = {p.name: active_bytes(pairing, p.bits) for p in args.precisions}
        results["pairings"].append(dict(
            name=pairing.name, theirs=dict(experts=pairing.experts, expert_units=pairing.units, top_k=pairing.k,
                                           normalize_routing_weights=1, activation_type="gelu (tanh form)"),
            ours=dict(slice_width=pairing.units, k=pairing.k, ffn_hidden=pairing.hidden, windows="disjoint, random starts"),
            active_bytes_per_token_layer=equal))
        print(f"\n{pairing.name}: theirs {pairing.experts} experts of {pairing.units} units, top {pairing.k} "
              f"(softmax over the picked logits); ours r {pairing.units}, K {pairing.k} disjoint windows at random "
              f"starts. Equal: {pairing.k * pairing.units} active units a token, H {pairing.hidden} in all. Bytes a "
              "token reads a layer (weights, scales, biases), ours / theirs: " +
              ", ".join(f"{n} {e['ours'] / 1e6:.3f} / {e['theirs'] / 1e6:.3f} MB" for n, e in equal.items()))

    for precision in args.precisions:
        # Each layer drawn and quantized in turn: no precision holds more float weights than one layer's.
        tensors = [layer_tensors(random_layer(rng, D, H), precision.bits, BLOCK) for _ in range(counts[precision.name])]
        for pairing in pairings:
            measure(args, results, precision, pairing, tensors, rng)
        del tensors

    print_goals(results)
    print(f"\nload average at the end: {' '.join(f'{v:.2f}' for v in os.getloadavg())}")
    print(f"wrote {record.save(args.json, 'moe_peer', results, args.threads)}")


def chains(args, tensors, precision: Precision, pairing: Pairing):
    """Sessions of ours' chain and of theirs' over these layers (theirs may be refused)."""
    ours = op_session(ours_model(tensors, pairing, precision.bits), args.threads, activations=precision.activations)
    theirs = lambda: op_session(theirs_model(tensors, pairing, precision.bits, accuracy_level=precision.accuracy_level),
                                args.threads, kernel=False)
    return ours, theirs


def measure(args, results, precision: Precision, pairing: Pairing, tensors, rng):
    """Both sides' chains of one precision and pairing; the same-function check; every phase.
    Prefill reads all of a layer's weights: it runs chains of the first LAYERS layers only."""
    layers = len(tensors)
    ours, make_theirs = chains(args, tensors, precision, pairing)
    ours_feeds, theirs_feeds = aligned_routing(rng, pairing, layers)
    try:  # onnxruntime refuses what it does not support when the session is made or first run
        theirs = make_theirs()
        theirs_y = theirs.run(["Y"], theirs_feeds)[0]
    except Exception as error:  # onnxruntime raises its own exception types
        line = (str(error).strip().splitlines() or [type(error).__name__])[0]
        results["unsupported"].append(dict(pairing=pairing.name, precision=precision.name, error=line))
        print(f"\n{pairing.name} {precision.name}: onnxruntime's op does not run here: {line}")
        return

    difference = relative_difference(ours.run(["Y"], ours_feeds)[0], theirs_y)
    results["same_function"].append(dict(pairing=pairing.name, precision=precision.name,
                                         max_abs_difference_over_max_abs=difference))
    print(f"\n{pairing.name} {precision.name}, {layers} layers a call. Same function (windows on the picked experts, "
          f"tied logits): max |ours - theirs| / max |theirs| = {difference:.2e}")
    if precision.bits is None and not difference <= SAME_FUNCTION_TOL:
        raise SystemExit(f"benchmarks.moe_peer: ours and theirs differ at fp32 ({difference:.2e}): a layout mistake")

    print(f"{'measurement':<22} {'layers':>6} {'ours ms':>8} {'theirs ms':>9} {'speed':>6} | units a layer reads: "
          "theirs (experts), ours")
    sessions = {layers: (ours, theirs)}
    for phase, tokens, count in phases(args):
        n = min(layers, LAYERS) if phase == "prefill" else layers
        if n not in sessions:
            short, make_short = chains(args, tensors[:n], precision, pairing)
            sessions[n] = (short, make_short())
        routed, touched = routings(rng, pairing, n, tokens)
        calls = {side: cycling(lambda i, s=session, j=index: s.run_with_ort_values(["Y"], routed[i][j]), len(routed))
                 for index, (side, session) in enumerate(zip(("ours", "theirs"), sessions[n]))}
        samples = rounds(calls, count, warmup=1 if phase == "prefill" else 2)
        ms = {side: 1e3 * statistics.median(s) / n for side, s in samples.items()}
        speed = paired_ratio(samples["theirs"], samples["ours"])
        results["rows"].append(dict(pairing=pairing.name, precision=precision.name, phase=phase, tokens=tokens,
                                    layers=n, ours_ms_per_layer=ms["ours"], theirs_ms_per_layer=ms["theirs"],
                                    speed=speed, touched_per_layer=touched,
                                    samples_ms_per_call={s: [1e3 * v for v in samples[s]] for s in samples}))
        print(f"{label(phase, tokens):<22} {n:>6} {ms['ours']:>8.3f} {ms['theirs']:>9.3f} {speed:>6.2f} | "
              f"{touched['theirs_units']:>5.0f} ({touched['theirs_experts']:4.1f} of {pairing.experts}), "
              f"{touched['ours_units']:>5.0f}")


def print_goals(results):
    """The int4 goals (ours / theirs speed): every phase's worst measurement against its goal."""
    print("\ngoals at int4 (speed ours / theirs; the worst of a phase's measurements)")
    for row_filter in sorted({(r["pairing"], r["precision"]) for r in results["rows"] if r["precision"].startswith("int4")}):
        for phase, goal in GOALS.items():
            rows = [r for r in results["rows"] if (r["pairing"], r["precision"]) == row_filter and r["phase"] == phase]
            if not rows:
                continue
            value = min(r["speed"] for r in rows)
            what = f"{row_filter[0]} {row_filter[1]} {phase} ({', '.join(str(r['tokens']) for r in rows)} tokens)"
            met = value >= goal
            results["goals"].append(dict(what=what, value=value, goal=goal, met=met))
            print(f"  {what:<48} {value:5.2f}  goal >= {goal:.1f}  {'met' if met else 'NOT met'}")


if __name__ == "__main__":
    main()
