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
from .model import InfMoEConfig, InfMoEGPT

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
TENSORS_PER_MODEL, TENSORS_PER_LAYER = 4, 16  # SPEC §2's table


def expected_shapes(config: InfMoEConfig) -> dict:
    """Every tensor name of SPEC §2 and its shape."""
    V, P, D, H = config.vocab_size, config.n_positions, config.d_model, config.ffn_hidden
    shapes = {"wte.weight": [V, D], "wpe.weight": [P, D], "ln_f.weight": [D], "ln_f.bias": [D]}
    for i in range(config.n_layer):
        p = f"h.{i}."
        shapes.update({
            p + "ln_1.weight": [D], p + "ln_1.bias": [D],
            p + "attn.qkv.weight": [3 * D, D], p + "attn.qkv.bias": [3 * D],
            p + "attn.proj.weight": [D, D], p + "attn.proj.bias": [D],
            p + "ln_2.weight": [D], p + "ln_2.bias": [D],
            p + "moe.router.mu.weight": [1, D], p + "moe.router.mu.bias": [1],
            p + "moe.router.sigma.weight": [1, D], p + "moe.router.sigma.bias": [1],
            p + "moe.w_in": [H, D], p + "moe.b_in": [H],
            p + "moe.w_out": [H, D], p + "moe.b_out": [D],
        })
    return shapes


def read_config(path: Union[str, Path]) -> InfMoEConfig:
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
    return InfMoEConfig.from_dict(data)


def load_checkpoint(path: Union[str, Path, None] = None) -> InfMoEGPT:
    """Load and validate a checkpoint (the bundled default model when path is None), in eval mode."""
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
            most = (len(names) - TENSORS_PER_MODEL) // TENSORS_PER_LAYER + 1
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

    model = InfMoEGPT(config)
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
