"""Checkpoints (SPEC §2): a directory with config.json and model.safetensors, never a pickle."""

import json
from pathlib import Path
from typing import List, Optional, Union

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from .errors import InfMoEError
from .files import atomic_write, staged_dir
from .limits import MAX_CONFIG_BYTES, check_file_size
from .model import InfMoEGPT, config_from_dict, model_for

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
DEFAULT_CHECKPOINT = Path(__file__).parent / "default_model"
# Dense models trained by the same command, data, steps and seed (docs/guide/model.md): one with the
# bundled model's active FFN size at K = 1 (H = r), one with its total size (H = 1024).
BASELINES_DIR = Path(__file__).parent / "baselines"


def bundled_baselines() -> List[Path]:
    """The bundled dense baseline checkpoints that are present, by name."""
    if not BASELINES_DIR.is_dir():
        return []
    return sorted(p for p in BASELINES_DIR.iterdir() if (p / CONFIG_FILE).is_file())
FLOAT_DTYPES = ("F32", "F16", "BF16")  # safetensors' names
TENSORS_PER_MODEL = 4  # SPEC §2's table


def ffn_shapes(config) -> dict:
    """The FFN tensors of one layer, named below its 'h.{i}.' prefix, and their shapes."""
    D, H = config.d_model, config.ffn_hidden
    if config.model_type == "moe-gpt2":
        E, h = config.num_experts, config.expert_hidden
        return {"moe.router.weight": [E, D], "moe.w_in": [E, h, D], "moe.b_in": [E, h],
                "moe.w_out": [E, D, h], "moe.b_out": [E, D]}
    return {"moe.router.mu.weight": [1, D], "moe.router.mu.bias": [1],
            "moe.router.sigma.weight": [1, D], "moe.router.sigma.bias": [1],
            "moe.w_in": [H, D], "moe.b_in": [H], "moe.w_out": [H, D], "moe.b_out": [D]}


def layer_shapes(config) -> dict:
    """Every tensor of one layer, named below its 'h.{i}.' prefix, and its shape."""
    D = config.d_model
    return {"ln_1.weight": [D], "ln_1.bias": [D], "attn.qkv.weight": [3 * D, D], "attn.qkv.bias": [3 * D],
            "attn.proj.weight": [D, D], "attn.proj.bias": [D], "ln_2.weight": [D], "ln_2.bias": [D],
            **ffn_shapes(config)}


def expected_shapes(config) -> dict:
    """Every tensor name of SPEC §2 (or of the conventional MoE's table) and its shape."""
    V, P, D = config.vocab_size, config.n_positions, config.d_model
    shapes = {"wte.weight": [V, D], "wpe.weight": [P, D], "ln_f.weight": [D], "ln_f.bias": [D]}
    layer = layer_shapes(config)
    for i in range(config.n_layer):
        shapes.update({f"h.{i}.{name}": shape for name, shape in layer.items()})
    return shapes


ARCH_NAMES = {"infmoe-gpt2": "an ∞-MoE", "moe-gpt2": "a conventional top-k MoE"}


def require_arch(model_or_config, model_type: str, what: str) -> None:
    """Refuse a checkpoint of the other architecture, in one line naming both, before what
    (a command, an export) reads it as its own."""
    config = getattr(model_or_config, "config", model_or_config)
    if config.model_type != model_type:
        raise InfMoEError(f"{what} needs {ARCH_NAMES[model_type]} checkpoint (model_type {model_type!r}); this one is "
                          f"{ARCH_NAMES[config.model_type]} (model_type {config.model_type!r})")


def read_config(path: Union[str, Path]):
    path = Path(path)
    if not path.is_dir() or not (path / CONFIG_FILE).is_file():
        raise InfMoEError(f"{path} is not a checkpoint: expected a directory with {CONFIG_FILE} and {WEIGHTS_FILE}")
    check_file_size(path / CONFIG_FILE, MAX_CONFIG_BYTES, "config file")
    try:
        data = json.loads((path / CONFIG_FILE).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise InfMoEError(f"{path / CONFIG_FILE} is not valid JSON: {error}") from None
    except RecursionError:
        raise InfMoEError(f"{path / CONFIG_FILE} is nested too deeply to be a config") from None
    return config_from_dict(data)


def load_checkpoint(path: Union[str, Path, None] = None) -> InfMoEGPT:
    """Load and validate a checkpoint of either architecture (the bundled default model when path
    is None), in eval mode: an InfMoEGPT, or its subclass MoEGPT."""
    path = Path(path) if path is not None else DEFAULT_CHECKPOINT
    config = read_config(path)
    weights_path = path / WEIGHTS_FILE
    if not weights_path.is_file():
        raise InfMoEError(f"{path} is not a checkpoint: {WEIGHTS_FILE} is missing")
    # Names, shapes and dtypes come from the header: all are checked before any tensor is read,
    # and the count first, so a config claiming a million layers costs nothing.
    try:
        with safe_open(str(weights_path), framework="pt") as f:
            names = set(f.keys())
            most = (len(names) - TENSORS_PER_MODEL) // len(layer_shapes(config)) + 1
            if config.n_layer > most:
                raise InfMoEError(f"{weights_path} holds {len(names)} tensors, too few for config.json's n_layer = "
                                  f"{config.n_layer}")
            expected = expected_shapes(config)
            missing = [name for name in expected if name not in names]
            if missing:
                raise InfMoEError(f"{weights_path}: missing tensor {missing[0]!r}")
            extra = sorted(names - set(expected))
            if extra:
                raise InfMoEError(f"{weights_path}: unexpected tensor {extra[0]!r}")
            for name, shape in expected.items():
                found = list(f.get_slice(name).get_shape())
                if found != shape:
                    raise InfMoEError(f"{weights_path}: tensor {name!r} has shape {found}, expected {shape}")
                dtype = f.get_slice(name).get_dtype()
                if dtype not in FLOAT_DTYPES:
                    raise InfMoEError(f"{weights_path}: tensor {name!r} has dtype {dtype}, expected a float type")
        tensors = load_file(str(weights_path))
    except (SafetensorError, OSError, ValueError) as error:
        raise InfMoEError(f"{weights_path} is not a readable safetensors file ({error})") from None
    for name, tensor in tensors.items():
        if not torch.isfinite(tensor).all():
            raise InfMoEError(f"{weights_path}: tensor {name!r} holds NaN or infinite values")

    model = model_for(config)
    model.load_state_dict({name: t.float() for name, t in tensors.items()}, strict=True)
    return model.eval()


def save_checkpoint(model: InfMoEGPT, path: Union[str, Path], metadata: Optional[dict] = None,
                    extra_files: Optional[dict] = None) -> Path:
    """Write config.json + model.safetensors (+ extra_files: {name: text}) into a staging folder
    beside path, then publish it (files.staged_dir: an existing path is replaced only if this
    program made it)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with staged_dir(path) as staging:
        atomic_write(staging / CONFIG_FILE, json.dumps(model.config.to_dict(), indent=2) + "\n")
        state = {name: t.detach().contiguous().cpu() for name, t in model.state_dict().items()}
        save_file(state, str(staging / WEIGHTS_FILE), metadata={k: str(v) for k, v in (metadata or {}).items()})
        (staging / WEIGHTS_FILE).chmod(0o644)  # safetensors writes it private
        for name, text in (extra_files or {}).items():
            atomic_write(staging / name, text)
    return path
