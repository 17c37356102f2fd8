"""The ∞-MoE GPT-2 reference model (SPEC §2–3): every backend is judged against this file.

A pre-LayerNorm GPT-2 decoder whose FFN is one large shared FFN of H hidden units. A router
predicts a Gaussian over a 1-D expert index; K draws of it each select a contiguous window
of r hidden units, and the layer output is the average of the K windows.
"""

import dataclasses
import math
from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import nn

from .errors import InfMoEError
from .limits import check_fits

NOISE_MODES = ("quantile", "sampled")
ACTIVATIONS = ("gelu_tanh",)


# ---------------------------------------------------------------------------------------------
# Config


@dataclass(frozen=True)
class _DecoderConfig:
    """What both architectures' configs share: the decoder's keys (first in config.json), their
    checks, JSON. Each architecture adds its FFN's keys, then activation, layer_norm_eps,
    tokenizer and model_type (keys with defaults come last)."""
    vocab_size: int
    n_positions: int
    d_model: int
    n_layer: int
    n_head: int
    ffn_hidden: int

    def _check(self, ffn_int_keys, model_type: str, ffn_checks) -> None:
        """The checks in the order a user meets them; ffn_checks(self) checks the FFN's own keys."""
        for key in ("vocab_size", "n_positions", "d_model", "n_layer", "n_head", "ffn_hidden", *ffn_int_keys):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise InfMoEError(f"config key {key!r} must be a positive integer, got {value!r}")
        if self.model_type != model_type:
            raise InfMoEError(f"config key 'model_type' must be {model_type!r}, got {self.model_type!r}")
        if self.d_model % self.n_head:
            raise InfMoEError(f"config key 'd_model' ({self.d_model}) must be divisible by "
                              f"'n_head' ({self.n_head})")
        ffn_checks()
        if self.activation not in ACTIVATIONS:
            raise InfMoEError(f"config key 'activation' must be one of {ACTIVATIONS}, got {self.activation!r}")
        if self.tokenizer != "bytes":
            raise InfMoEError(f"config key 'tokenizer' must be 'bytes', got {self.tokenizer!r}")
        if self.vocab_size < 256:
            raise InfMoEError(f"config key 'vocab_size' must be >= 256 for the byte tokenizer, "
                              f"got {self.vocab_size}")
        eps = self.layer_norm_eps
        if not isinstance(eps, (int, float)) or isinstance(eps, bool) or not 0 < eps < 1:
            raise InfMoEError(f"config key 'layer_norm_eps' must be a float in (0, 1), got {eps!r}")
        check_fits(4 * self.parameter_count(), f"a model of this config ({self.parameter_count():,} parameters)")

    def _shared_parameter_count(self, ffn_per_layer: int) -> int:
        """Embeddings, final LayerNorm, and per layer two LayerNorms, attention and the FFN's own."""
        V, P, D, L = self.vocab_size, self.n_positions, self.d_model, self.n_layer
        per_layer = 4 * D + (3 * D * D + 3 * D) + (D * D + D) + ffn_per_layer
        return V * D + P * D + 2 * D + L * per_layer

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict):
        if not isinstance(data, dict):
            raise InfMoEError("config.json must hold a JSON object")
        fields = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - set(fields))
        if unknown:
            raise InfMoEError(f"config.json has unknown key {unknown[0]!r}")
        for name, field in fields.items():
            if name not in data and field.default is dataclasses.MISSING:
                raise InfMoEError(f"config.json is missing required key {name!r}")
        return cls(**data)


@dataclass(frozen=True)
class InfMoEConfig(_DecoderConfig):
    slice_width: int
    num_samples: int
    activation: str = "gelu_tanh"
    layer_norm_eps: float = 1e-5
    tokenizer: str = "bytes"
    model_type: str = "infmoe-gpt2"

    def __post_init__(self):
        def ffn_checks():
            if self.slice_width > self.ffn_hidden:
                raise InfMoEError(f"config key 'slice_width' ({self.slice_width}) must be at most "
                                  f"'ffn_hidden' ({self.ffn_hidden})")

        self._check(("slice_width", "num_samples"), "infmoe-gpt2", ffn_checks)

    def parameter_count(self) -> int:
        """Parameters of the model, from the config alone (SPEC §2's tensor table)."""
        D, H = self.d_model, self.ffn_hidden
        return self._shared_parameter_count(2 * (D + 1) + 2 * H * D + H + D)

    @property
    def default_k(self) -> int:
        """The expert budget K a forward uses when none is given."""
        return self.num_samples

    @property
    def is_dense(self) -> bool:
        """slice_width == ffn_hidden: every window is the whole FFN, an ordinary GPT-2 MLP."""
        return self.slice_width == self.ffn_hidden


ROUTER_SOFTMAX = ("selected", "all")


@dataclass(frozen=True)
class MoEConfig(_DecoderConfig):
    """The conventional top-k MoE decoder (docs/reference/spec.md, "Conventional MoE"): the same
    attention stack, and per layer E experts, each a GPT-2 FFN of ffn_hidden / E units."""
    num_experts: int
    top_k: int
    router_softmax: str
    activation: str = "gelu_tanh"
    layer_norm_eps: float = 1e-5
    tokenizer: str = "bytes"
    model_type: str = "moe-gpt2"

    def __post_init__(self):
        def ffn_checks():
            if self.top_k > self.num_experts:
                raise InfMoEError(f"config key 'top_k' ({self.top_k}) must be at most "
                                  f"'num_experts' ({self.num_experts})")
            if self.ffn_hidden % self.num_experts:
                raise InfMoEError(f"config key 'num_experts' ({self.num_experts}) must divide "
                                  f"'ffn_hidden' ({self.ffn_hidden})")
            if self.router_softmax not in ROUTER_SOFTMAX:
                raise InfMoEError(f"config key 'router_softmax' must be one of {ROUTER_SOFTMAX}, "
                                  f"got {self.router_softmax!r}")

        self._check(("num_experts", "top_k"), "moe-gpt2", ffn_checks)

    def parameter_count(self) -> int:
        D, H, E = self.d_model, self.ffn_hidden, self.num_experts
        return self._shared_parameter_count(E * D + 2 * H * D + H + E * D)

    @property
    def expert_hidden(self) -> int:
        """Hidden units of one expert, ffn_hidden / num_experts."""
        return self.ffn_hidden // self.num_experts

    @property
    def default_k(self) -> int:
        """The expert budget: every token runs its top_k experts, always."""
        return self.top_k


CONFIGS = {"infmoe-gpt2": InfMoEConfig, "moe-gpt2": MoEConfig}


def config_from_dict(data: dict):
    """The config of either architecture, by its 'model_type' (absent: ∞-MoE, as before there
    were two)."""
    if not isinstance(data, dict):
        raise InfMoEError("config.json must hold a JSON object")
    model_type = data.get("model_type", "infmoe-gpt2")
    if model_type not in CONFIGS:
        raise InfMoEError(f"config key 'model_type' must be one of {', '.join(map(repr, CONFIGS))}, "
                          f"got {model_type!r}")
    return CONFIGS[model_type].from_dict(data)


# ---------------------------------------------------------------------------------------------
# The ∞-MoE layer


# GPT-2's tanh GELU, act(a) = 0.5 a (1 + tanh(GELU_TANH_C (a + GELU_TANH_CUBIC a^3))). The one
# definition of its constants in Python: the fallback ONNX function and the Triton kernel import
# them; the C++ and CUDA kernels carry the same literals (docs/reference/spec.md §6.5).
GELU_TANH_C = math.sqrt(2.0 / math.pi)  # 0.7978845608028654
GELU_TANH_CUBIC = 0.044715


def gelu_tanh(a: torch.Tensor) -> torch.Tensor:
    """act(a) above. torch's approximate="tanh" kernel evaluates exactly this formula with these
    two constants (kBeta = sqrt(2) * 2/sqrt(pi) * 0.5, kKappa = 0.044715); tests/test_model.py
    checks it against the formula written out."""
    return F.gelu(a, approximate="tanh")


def quantile_noise(k: int, device=None) -> torch.Tensor:
    """eps_k = Phi^-1((k - 0.5) / K), k = 1..K: the deterministic 'quantile' noise, shape [K]."""
    levels = (torch.arange(k, dtype=torch.float64, device=device) + 0.5) / k
    return torch.special.ndtri(levels).float()


def window_starts(z: torch.Tensor, ffn_hidden: int, slice_width: int) -> torch.Tensor:
    """s = min(floor(sigmoid(z) * (H - r + 1)), H - r) as int64 (SPEC §3)."""
    positions = ffn_hidden - slice_width + 1
    start = torch.floor(torch.sigmoid(z) * float(positions))
    return torch.clamp(start, max=float(positions - 1)).to(torch.int64)


def coverage(starts: torch.Tensor, ffn_hidden: int, slice_width: int, dtype=torch.float32) -> torch.Tensor:
    """c_i = n_i / K with n_i = #{k : s_k <= i < s_k + r}, the windows covering unit i; [..., H].

    Form (docs/reference/spec.md §6.3): a difference array. Each window adds +1 at its start and
    -1 one past its end; the running sum over units is n_i (exact: small integers in float),
    in O(H + K) per token instead of O(K H). Divided by K once, as the definition says."""
    ones = torch.ones(starts.shape, dtype=dtype, device=starts.device)
    edges = torch.zeros(*starts.shape[:-1], ffn_hidden + 1, dtype=dtype, device=starts.device)
    edges.scatter_add_(-1, starts, ones).scatter_add_(-1, starts + slice_width, -ones)
    return edges.cumsum(-1)[..., :ffn_hidden] / starts.shape[-1]


class StraightThroughWindow(torch.autograd.Function):
    """Forward: the hard coverage of the windows starting at floor(t). Backward: the gradient of
    windows whose edges are linear ramps `edge` units wide, so the loss reaches the continuous
    start t (SPEC §3, Training). Moving a window right gains the units at its upper edge and
    loses those at its lower edge; with prefix sums of the coverage gradient that costs O(H)
    per token instead of materialising a [..., K, H] soft window."""

    @staticmethod
    def forward(ctx, t, starts, ffn_hidden: int, slice_width: int, edge: float):
        ctx.save_for_backward(t)
        ctx.slice_width, ctx.edge = slice_width, edge
        return coverage(starts, ffn_hidden, slice_width, t.dtype)

    @staticmethod
    def backward(ctx, grad_coverage):
        (t,) = ctx.saved_tensors
        r, edge = ctx.slice_width, ctx.edge
        H = grad_coverage.shape[-1]
        prefix = F.pad(grad_coverage.cumsum(-1), (1, 0))  # prefix[j] = sum of grad over units < j

        def ramp_sum(at):
            """Sum of the gradient over the units (centres i + 0.5) within edge / 2 of `at`."""
            lo = torch.ceil(at - edge / 2 - 0.5).clamp(0, H).long()
            hi = torch.ceil(at + edge / 2 - 0.5).clamp(0, H).long()
            return prefix.gather(-1, hi) - prefix.gather(-1, lo)

        grad_t = (ramp_sum(t + r) - ramp_sum(t)) / (edge * t.shape[-1])
        return grad_t, None, None, None, None


def _shape(tensor) -> list:
    return list(tensor.shape)


def check_op_inputs(x, starts, w_in, b_in, w_out, b_out, slice_width, activation="gelu_tanh"):
    """The op's validation rules (docs/reference/spec.md §6.1), in their order; returns (H, D, K).

    The one Python copy: the reference below and the Triton launcher both call it. Raises
    InfMoEError with one line naming the first rule broken."""
    def refuse(message):
        raise InfMoEError(f"ContinuousSliceFFN: {message}")

    # 1. shapes
    if x.dim() < 1:
        refuse(f"X must have shape [..., D], got {_shape(x)}")
    D = x.shape[-1]
    if w_in.dim() != 2 or w_in.shape[1] != D:
        refuse(f"w_in must have shape [H, {D}], got {_shape(w_in)}")
    H = w_in.shape[0]
    for name, tensor, shape in (("b_in", b_in, [H]), ("w_out", w_out, [H, D]), ("b_out", b_out, [D])):
        if _shape(tensor) != shape:
            refuse(f"{name} must have shape {shape}, got {_shape(tensor)}")
    if starts.dim() != x.dim() or starts.shape[:-1] != x.shape[:-1]:
        refuse(f"starts must have shape {_shape(x)[:-1]} + [K], got {_shape(starts)}")
    # 2. activation, 3. slice_width, 4. K
    if activation not in ACTIVATIONS:
        refuse(f"unknown activation {activation!r} (known: {', '.join(ACTIVATIONS)})")
    if isinstance(slice_width, bool) or not isinstance(slice_width, int) or not 1 <= slice_width <= H:
        refuse(f"slice_width must be an integer in [1, {H}], got {slice_width!r}")
    K = starts.shape[-1]
    if K < 1:
        refuse(f"starts must hold K >= 1 windows per token, got shape {_shape(starts)}")
    # 5. every start in [0, H - r] (both ends in one transfer: one wait for a GPU, not two)
    if starts.numel():
        low, high = torch.stack((starts.min(), starts.max())).tolist()  # NaN passes: rule 6 refuses its dtype
        if low < 0 or high > H - slice_width:
            refuse(f"starts must lie in [0, {H - slice_width}], got values in [{low}, {high}]")
    # 6. dtypes
    if starts.dtype != torch.int64:
        refuse(f"starts must be int64, got {starts.dtype}")
    if not x.dtype.is_floating_point:
        refuse(f"X must be a floating-point tensor, got {x.dtype}")
    for name, tensor in (("w_in", w_in), ("b_in", b_in), ("w_out", w_out), ("b_out", b_out)):
        if tensor.dtype != x.dtype:
            refuse(f"{name} must have X's dtype {x.dtype}, got {tensor.dtype}")
    return H, D, K


def continuous_slice_ffn(x, starts, w_in, b_in, w_out, b_out, slice_width: int,
                         activation: str = "gelu_tanh") -> torch.Tensor:
    """The expert part of the ∞-MoE layer, op `infmoe::ContinuousSliceFFN` (docs/reference/spec.md).

    Computed in the union/coverage form: every unit's pre-activation is shared by all
    windows that cover it, so y = b_out + sum_i c_i * act(x . w_in[i] + b_in[i]) * w_out[i].
    This reference evaluates all H units (dense-masked: c_i = 0 outside the union) in x's
    dtype; the kernels touch only the union. Invalid input is refused (check_op_inputs).
    """
    H, _, _ = check_op_inputs(x, starts, w_in, b_in, w_out, b_out, slice_width, activation)
    hidden = gelu_tanh(F.linear(x, w_in, b_in)) * coverage(starts, H, slice_width, x.dtype)
    return hidden @ w_out + b_out


class Router(nn.Module):
    """Predicts the Gaussian N(mu(x), sigma(x)^2) over the expert index z."""

    def __init__(self, d_model: int):
        super().__init__()
        self.mu = nn.Linear(d_model, 1)
        self.sigma = nn.Linear(d_model, 1)

    def forward(self, x: torch.Tensor, eps: torch.Tensor) -> torch.Tensor:
        """z_k = mu + sigma * eps_k for eps of shape [K] or [..., K]; returns [..., K]."""
        return self.mu(x) + F.softplus(self.sigma(x)) * eps

    def window_starts(self, x: torch.Tensor, eps: torch.Tensor, ffn_hidden: int, slice_width: int) -> torch.Tensor:
        """The windows this router picks: starts [..., K] int64 (SPEC §3)."""
        return window_starts(self(x, eps), ffn_hidden, slice_width)


class InfMoE(nn.Module):
    def __init__(self, config: InfMoEConfig):
        super().__init__()
        H, D = config.ffn_hidden, config.d_model
        self.ffn_hidden, self.slice_width = H, config.slice_width
        self.router = Router(D)
        self.w_in = nn.Parameter(torch.empty(H, D))
        self.b_in = nn.Parameter(torch.zeros(H))
        self.w_out = nn.Parameter(torch.empty(H, D))
        self.b_out = nn.Parameter(torch.zeros(D))
        # Soft window edge (in hidden units) for the training relaxation.
        self.edge_width = max(1.0, config.slice_width / 16)

    def forward(self, x: torch.Tensor, eps: torch.Tensor):
        """Returns (y, starts [..., K] int64)."""
        z = self.router(x, eps)
        starts = window_starts(z, self.ffn_hidden, self.slice_width)
        if self.training and self.slice_width < self.ffn_hidden:
            return self._train_forward(x, z, starts), starts
        y = continuous_slice_ffn(x, starts, self.w_in, self.b_in, self.w_out, self.b_out, self.slice_width)
        return y, starts

    def _train_forward(self, x, z, starts):
        """The hard window forward with a straight-through gradient for the router."""
        H, r = self.ffn_hidden, self.slice_width
        t = torch.sigmoid(z) * (H - r + 1)  # continuous start, [..., K]
        weights = StraightThroughWindow.apply(t, starts, H, r, self.edge_width)
        return (gelu_tanh(F.linear(x, self.w_in, self.b_in)) * weights) @ self.w_out + self.b_out


# ---------------------------------------------------------------------------------------------
# The conventional top-k MoE layer


def top_k_experts(logits: torch.Tensor, top_k: int) -> torch.Tensor:
    """The top_k experts of each token, [..., top_k] int64, best first: logits sorted by
    (-logit, expert index), so of equal logits the lowest expert index wins. A stable
    descending sort keeps equal logits in index order; torch.topk promises no order for ties."""
    return torch.sort(logits, dim=-1, descending=True, stable=True).indices[..., :top_k]


def routing_weights(logits: torch.Tensor, experts: torch.Tensor, router_softmax: str) -> torch.Tensor:
    """The weight of each selected expert, [..., top_k]. 'selected': softmax over the selected
    logits (Mixtral; they sum to 1). 'all': softmax over all E logits, the selected
    probabilities as they are (Switch; at top_k = 1 the weight still carries the router's
    gradient, where the softmax over one logit is a constant 1)."""
    if router_softmax == "selected":
        return torch.softmax(logits.gather(-1, experts), dim=-1)
    if router_softmax == "all":
        return torch.softmax(logits, dim=-1).gather(-1, experts)
    raise InfMoEError(f"router_softmax must be one of {ROUTER_SOFTMAX}, got {router_softmax!r}")


class TopKMoE(nn.Module):
    """E experts, each a GPT-2 FFN of ffn_hidden / E units, and a linear router without bias.

    Weights are stored per expert in the layout of onnxruntime's com.microsoft MoE op:
    w_in [E, h, D] (fc1_experts_weights), b_in [E, h], w_out [E, D, h] (fc2_experts_weights),
    b_out [E, D]; each expert's matrices are those of an nn.Linear."""

    def __init__(self, config: MoEConfig):
        super().__init__()
        E, h, D = config.num_experts, config.expert_hidden, config.d_model
        self.top_k, self.router_softmax = config.top_k, config.router_softmax
        self.router = nn.Linear(D, E, bias=False)
        self.w_in = nn.Parameter(torch.empty(E, h, D))
        self.b_in = nn.Parameter(torch.zeros(E, h))
        self.w_out = nn.Parameter(torch.empty(E, D, h))
        self.b_out = nn.Parameter(torch.zeros(E, D))

    def forward(self, x: torch.Tensor, eps=None):
        """Returns (y, experts [..., top_k] int64); eps is the ∞-MoE layer's and unused here.

        Each expert runs on the tokens that selected it only; y = sum_k w_k expert_k(x)."""
        logits = self.router(x)
        experts = top_k_experts(logits, self.top_k)
        weights = routing_weights(logits, experts, self.router_softmax)
        flat_x, flat_experts = x.reshape(-1, x.shape[-1]), experts.reshape(-1, self.top_k)
        flat_weights = weights.reshape(-1, self.top_k)
        y = torch.zeros_like(flat_x)
        for e in range(self.w_in.shape[0]):
            token, slot = (flat_experts == e).nonzero(as_tuple=True)
            if token.numel():
                hidden = gelu_tanh(F.linear(flat_x[token], self.w_in[e], self.b_in[e]))
                out = F.linear(hidden, self.w_out[e], self.b_out[e])
                y = y.index_add(0, token, out * flat_weights[token, slot].unsqueeze(-1))
        return y.reshape(x.shape), experts


FFN_OF = {"infmoe-gpt2": InfMoE, "moe-gpt2": TopKMoE}


# ---------------------------------------------------------------------------------------------
# Attention and the decoder


class CausalSelfAttention(nn.Module):
    def __init__(self, config: InfMoEConfig):
        super().__init__()
        self.n_head, self.head_dim = config.n_head, config.head_dim
        self.qkv = nn.Linear(config.d_model, 3 * config.d_model)
        self.proj = nn.Linear(config.d_model, config.d_model)

    def forward(self, x, allowed, past: Optional[tuple], cache_dtype: Optional[torch.dtype] = None):
        """x [B, T, D]; allowed [B, 1, T, past + T] bool; past (key, value) [B, h, past, hd];
        cache_dtype: the type a deployed cache stores keys and values in (None: x's), the new
        ones rounded to it before they are attended over, as they are stored."""
        B, T, D = x.shape
        q, k, v = self.qkv(x).split(D, dim=-1)
        q, k, v = (t.view(B, T, self.n_head, self.head_dim).transpose(1, 2) for t in (q, k, v))
        if cache_dtype is not None:
            k, v = k.to(cache_dtype).to(q.dtype), v.to(cache_dtype).to(q.dtype)
        if past is not None:
            k = torch.cat([past[0], k], dim=2)
            v = torch.cat([past[1], v], dim=2)
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(self.head_dim)
        # A finite minimum, not -inf: a padded query whose keys are all masked stays finite.
        scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
        y = torch.softmax(scores, dim=-1) @ v
        return self.proj(y.transpose(1, 2).reshape(B, T, D)), (k, v)


class Block(nn.Module):
    def __init__(self, config: InfMoEConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.d_model, eps=config.layer_norm_eps)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.d_model, eps=config.layer_norm_eps)
        self.moe = FFN_OF[config.model_type](config)

    def forward(self, x, allowed, eps, past, cache_dtype=None):
        a, present = self.attn(self.ln_1(x), allowed, past, cache_dtype)
        h = x + a
        y, starts = self.moe(self.ln_2(h), eps)
        return h + y, present, starts


class Output(NamedTuple):
    logits: torch.Tensor                 # [B, T, V]
    present: tuple                       # per layer (key, value), each [B, n_head, past + T, head_dim]
    starts: Optional[tuple]              # per layer [B, T, K] int64, when asked for (MoE: the experts)


class InfMoEGPT(nn.Module):
    def __init__(self, config: InfMoEConfig):
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.d_model)
        self.wpe = nn.Embedding(config.n_positions, config.d_model)
        self.h = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.d_model, eps=config.layer_norm_eps)
        self.reset_parameters()

    def reset_parameters(self, seed: Optional[int] = None):
        """GPT-2 initialisation; the router's mu starts spread (std 1 over tokens) so that
        windows cover all of H from the first step instead of piling up in the middle."""
        generator = torch.Generator().manual_seed(seed) if seed is not None else None
        c = self.config
        for name, p in self.named_parameters():
            if name.endswith("router.mu.weight"):
                std = 1.0 / math.sqrt(c.d_model)
            elif name.endswith(("proj.weight", "moe.w_out")):
                std = 0.02 / math.sqrt(2 * c.n_layer)
            else:
                std = 0.02
            with torch.no_grad():
                if name.endswith("ln_1.weight") or name.endswith("ln_2.weight") or name == "ln_f.weight":
                    p.fill_(1.0)
                elif p.dim() >= 2 and not is_bias(name):
                    p.copy_(torch.randn(p.shape, generator=generator) * std)
                else:
                    p.zero_()

    def noise(self, batch: int, seq: int, k: int, mode: str, generator: Optional[torch.Generator]):
        """eps for every token: [K] (quantile, the same for all tokens) or [B, T, K] (sampled).

        Sampled noise is drawn once per (token, sample) and shared by every layer, exactly
        like the exported graph's single `expert_noise` input."""
        if mode == "quantile":
            return quantile_noise(k, device=self.wte.weight.device)
        if mode == "sampled":
            return torch.randn(batch, seq, k, generator=generator).to(self.wte.weight.device)
        raise InfMoEError(f"noise mode must be one of {NOISE_MODES}, got {mode!r}")

    def expert_inputs(self, batch: int, seq: int, k: Optional[int], noise: str,
                      expert_noise: Optional[torch.Tensor], generator: Optional[torch.Generator]):
        """eps for every layer's router: expert_noise if given, else drawn in the noise mode."""
        k = self.config.num_samples if k is None else k
        if not isinstance(k, int) or k < 1:
            raise InfMoEError(f"expert budget K must be a positive integer, got {k!r}")
        if expert_noise is None:
            return self.noise(batch, seq, k, noise, generator)
        if expert_noise.shape != (batch, seq, k):
            raise InfMoEError(f"expert_noise must have shape [{batch}, {seq}, {k}], got {list(expert_noise.shape)}")
        return expert_noise

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: Optional[torch.Tensor] = None,
        past_key_values: Optional[tuple] = None,
        *,
        k: Optional[int] = None,
        noise: str = "quantile",
        expert_noise: Optional[torch.Tensor] = None,
        generator: Optional[torch.Generator] = None,
        return_starts: bool = False,
        cache_dtype: Optional[torch.dtype] = None,
    ) -> Output:
        """input_ids [B, T]; attention_mask [B, past + T] (1 = token, 0 = left padding);
        past_key_values per layer (key, value); k the expert budget (default num_samples);
        expert_noise [B, T, K] overrides the noise mode (the exported graph's input); cache_dtype
        the type a deployed KV cache stores (torch.float16: `--kv-cache float16`), None: float."""
        B, T = input_ids.shape
        eps = self.expert_inputs(B, T, k, noise, expert_noise, generator)
        past_len = 0 if past_key_values is None else past_key_values[0][0].shape[2]
        total = past_len + T
        if total > self.config.n_positions:
            raise InfMoEError(f"sequence of {total} tokens is longer than n_positions "
                              f"({self.config.n_positions})")
        if attention_mask is None:
            attention_mask = torch.ones(B, total, dtype=torch.int64, device=input_ids.device)
        if attention_mask.shape != (B, total):
            raise InfMoEError(f"attention_mask must have shape [{B}, {total}], got {list(attention_mask.shape)}")

        # Positions count real tokens only, so a left-padded row matches the row run alone.
        keep = attention_mask.to(torch.bool)
        position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)[:, past_len:]
        causal = torch.ones(T, total, dtype=torch.bool, device=input_ids.device).tril(diagonal=past_len)
        allowed = (causal.unsqueeze(0) & keep.unsqueeze(1)).unsqueeze(1)  # [B, 1, T, total]

        x = self.wte(input_ids) + self.wpe(position_ids)
        presents, all_starts = [], []
        for i, block in enumerate(self.h):
            x, present, starts = block(x, allowed, eps, None if past_key_values is None else past_key_values[i],
                                       cache_dtype)
            presents.append(present)
            all_starts.append(starts)
        logits = F.linear(self.ln_f(x), self.wte.weight)  # tied embeddings
        return Output(logits, tuple(presents), tuple(all_starts) if return_starts else None)


class MoEGPT(InfMoEGPT):
    """The conventional top-k MoE decoder: InfMoEGPT's embeddings, attention, cache and tied head,
    with a TopKMoE FFN per layer. Its router is deterministic, so there is no noise, and its expert
    budget is top_k: k is refused unless it is None or top_k."""

    def expert_inputs(self, batch, seq, k, noise, expert_noise, generator):
        top_k = self.config.top_k
        if k is not None and k != top_k:
            raise InfMoEError(f"expert budget K = {k!r} does not apply to a conventional MoE: every token runs its "
                              f"top_k = {top_k} experts")
        if expert_noise is not None:
            raise InfMoEError("expert_noise does not apply to a conventional MoE: its router is deterministic")
        return None


def is_bias(name: str) -> bool:
    """A bias (vector, or one per expert): zero at init and never weight-decayed."""
    return name.endswith(("bias", ".b_in", ".b_out"))


def model_for(config):
    """A fresh model of config's architecture."""
    return MoEGPT(config) if isinstance(config, MoEConfig) else InfMoEGPT(config)
