"""The exported model as a folder in the layout of `optimum-cli export onnx`, so that the
ecosystem's own clients load it with no hand-written file:

    model.onnx (+ model.onnx.data)   the export (export_onnx), written by the caller
    config.json                      a GPT-2 config Hugging Face clients understand (the cache
                                     geometry they need), the ∞-MoE config and the export's
                                     metadata under "infmoe"
    generation_config.json           greedy by default; no EOS (a byte model has none)
    tokenizer.json                   byte-level, built with `tokenizers`: token id = byte value
    tokenizer_config.json, special_tokens_map.json
    genai_config.json                onnxruntime-genai's "decoder" model type with our I/O names
                                     (not for --no-past: genai needs the cache)
    libinfmoe_ort.so                 the onnxruntime kernel, only for a model without the fallback
                                     function (onnxruntime-genai loads a custom-op library only
                                     from inside the model folder)

Readings where no client says (docs/guide/interop.md): the model type is "gpt2" because the graph's
inputs, outputs and cache layout are GPT-2's (Optimum's GPT-2 names, [batch, n_head, past,
head_dim]) and Optimum, transformers and onnxruntime-genai key their cache handling on it; the
folder holds no PyTorch weights, so AutoModelForCausalLM cannot load a dense GPT-2 from it by
mistake. Padding uses id 0 (the NUL byte) on the left, masked by attention_mask.
"""

import json
import os
import shutil
from pathlib import Path
from typing import Dict, Optional, Union

from ..contract import FOLDER_CONFIG, FOLDER_KEY, ExportedModel
from ..errors import InfMoEError

MODEL_FILE = "model.onnx"
CONFIG_FILE = FOLDER_CONFIG
GENAI_CONFIG_FILE = "genai_config.json"
# The key of config.json under which our own config and the export's metadata live
# (contract.folder_metadata reads it back when a tool dropped the model's metadata).
INFMOE_KEY = FOLDER_KEY
PAD_ID = 0  # the NUL byte; left padding, masked by attention_mask

FILES = (CONFIG_FILE, "generation_config.json", "tokenizer.json", "tokenizer_config.json",
         "special_tokens_map.json", GENAI_CONFIG_FILE)


def _dump(path: Path, data: dict):
    path.write_text(json.dumps(data, indent=2, sort_keys=False) + "\n")


def hf_config(exported: ExportedModel) -> dict:
    """config.json: GPT-2's keys for the clients, ours under "infmoe" (the metadata, verbatim)."""
    c, io = exported.io.config, exported.io
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": c.vocab_size,
        "n_positions": c.n_positions,
        "n_ctx": c.n_positions,
        "n_embd": c.d_model,
        "n_layer": c.n_layer,
        "n_head": c.n_head,
        "n_inner": c.ffn_hidden,
        "activation_function": "gelu_new",  # GELU, tanh form
        "layer_norm_epsilon": c.layer_norm_eps,
        "tie_word_embeddings": True,
        "use_cache": io.past,
        "bos_token_id": None,
        "eos_token_id": None,
        "pad_token_id": PAD_ID,
        "torch_dtype": "float32",  # the model's inputs and outputs (fp16 is inside the FFN only)
        INFMOE_KEY: {
            "config": c.to_dict(),
            "metadata": dict(exported.metadata),
            "note": (("A conventional top-k MoE decoder with GPT-2's inputs, outputs and cache; its FFN is "
                      "onnxruntime's com.microsoft MoE / QMoE op. " if io.is_moe else
                      "An ∞-MoE (continuous-slice MoE) decoder with GPT-2's inputs, outputs and cache; its FFN is "
                      "the custom op infmoe::ContinuousSliceFFN. ") +
                     "No PyTorch weights here: load it with ORTModelForCausalLM or onnxruntime-genai, not "
                     "AutoModelForCausalLM."),
        },
    }


def generation_config(exported: ExportedModel) -> dict:
    c = exported.io.config
    config = {"do_sample": False, "bos_token_id": None, "eos_token_id": None, "pad_token_id": PAD_ID,
              "max_length": c.n_positions}
    if c.vocab_size > 256:  # ids >= 256 are not bytes: never generated (as `infmoe-export run`)
        config["suppress_tokens"] = list(range(256, c.vocab_size))
    return config


def byte_tokenizer_json() -> str:
    """tokenizer.json of a byte-level tokenizer whose token id is the byte's value: GPT-2's
    byte-to-character map, a BPE model with the 256 byte tokens and no merges."""
    try:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers
        from tokenizers.pre_tokenizers import ByteLevel
    except ImportError:
        raise InfMoEError("writing an exported folder needs the `tokenizers` package: pip install tokenizers "
                          "(or export a single file: --out model.onnx)") from None

    alphabet = ByteLevel.alphabet()  # 256 characters, one per byte, in no particular order
    byte_to_char = _bytes_to_unicode()
    assert sorted(alphabet) == sorted(byte_to_char.values())
    vocab = {byte_to_char[b]: b for b in range(256)}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[], fuse_unk=False, byte_fallback=False))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer.to_str(pretty=True)


def _bytes_to_unicode() -> Dict[int, str]:
    """GPT-2's reversible byte -> printable character map (as in its encoder.py)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def tokenizer_config(exported: ExportedModel) -> dict:
    pad = _bytes_to_unicode()[PAD_ID]
    return {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": exported.io.config.n_positions,
            "padding_side": "left", "pad_token": pad, "add_bos_token": False, "add_eos_token": False,
            "clean_up_tokenization_spaces": False, "model_input_names": ["input_ids", "attention_mask"]}


def genai_config(exported: ExportedModel, custom_ops_library: Optional[str]) -> dict:
    """onnxruntime-genai's config: the generic "decoder" type with our names (its "gpt2" type
    expects other input names), greedy search. past_present_share_buffer for the onnxruntime
    target, whose GroupQueryAttention writes the new keys and values into a buffer of
    context_length in place; a portable graph returns a new present (past + new tokens) each
    step, so its cache cannot be shared."""
    c = exported.io.config
    session_options = {"log_id": "onnxruntime-genai", "provider_options": []}
    if custom_ops_library:
        session_options["custom_ops_library"] = custom_ops_library
    return {
        "model": {
            "type": "decoder",
            "bos_token_id": PAD_ID,
            # genai needs an EOS inside the vocabulary; a byte model has none, so the NUL byte,
            # which text never holds (`infmoe-export run` does not stop on it)
            "eos_token_id": PAD_ID,
            "pad_token_id": PAD_ID,
            "context_length": c.n_positions,
            "vocab_size": c.vocab_size,
            "decoder": {
                "filename": MODEL_FILE,
                "session_options": session_options,
                "head_size": c.head_dim,
                "hidden_size": c.d_model,
                "num_attention_heads": c.n_head,
                "num_key_value_heads": c.n_head,
                "num_hidden_layers": c.n_layer,
                "inputs": {"input_ids": "input_ids", "attention_mask": "attention_mask",
                           "past_key_names": "past_key_values.%d.key", "past_value_names": "past_key_values.%d.value"},
                "outputs": {"logits": "logits", "present_key_names": "present.%d.key",
                            "present_value_names": "present.%d.value"},
            },
        },
        "search": {"do_sample": False, "num_beams": 1, "num_return_sequences": 1, "max_length": c.n_positions,
                   "min_length": 0, "past_present_share_buffer": exported.io.shares_cache, "early_stopping": True,
                   "length_penalty": 1.0, "repetition_penalty": 1.0, "no_repeat_ngram_size": 0,
                   "temperature": 1.0, "top_k": 1, "top_p": 1.0, "diversity_penalty": 0.0},
    }


def client_limitations(exported: ExportedModel) -> list:
    """What the clients cannot do with this export, one sentence each (printed by `onnx --out DIR`)."""
    notes = []
    if exported.io.noise == "sampled":
        notes.append("sampled noise: the model needs the input expert_noise [batch, sequence, K], which Optimum, "
                     "transformers and onnxruntime-genai cannot feed (they pass only ids, mask and cache); "
                     "export with --noise quantile for them, or drive it with `infmoe-export run`")
    if not exported.io.past:
        notes.append("no past: no genai_config.json (onnxruntime-genai feeds only the new token after the first "
                     "step, so it needs the KV cache); Optimum runs it with use_cache=False")
    if not exported.has_function and exported.io.custom_ops:
        notes.append("no fallback function: every client needs the onnxruntime kernel library registered "
                     "(Optimum: session_options.register_custom_ops_library; genai: the copy in this folder)")
    return notes


def write_hf_folder(folder: Union[str, os.PathLike], exported: ExportedModel, *,
                    kernel_library: Optional[Union[str, os.PathLike]] = None) -> Path:
    """Write the clients' files beside folder/model.onnx (exported, already written there).
    kernel_library is copied into the folder and named in genai_config.json when the model has
    no fallback function (required then; ignored otherwise, so the folder stays portable)."""
    folder = Path(folder)
    if Path(exported.path).resolve() != (folder / MODEL_FILE).resolve():
        raise InfMoEError(f"the model must be {folder / MODEL_FILE}, got {exported.path}")
    library_name = None
    needs_kernel = not exported.has_function and exported.io.custom_ops
    if needs_kernel and kernel_library is not None:
        library_name = Path(kernel_library).name
        shutil.copyfile(kernel_library, folder / library_name)
    _dump(folder / CONFIG_FILE, hf_config(exported))
    _dump(folder / "generation_config.json", generation_config(exported))
    (folder / "tokenizer.json").write_text(byte_tokenizer_json())
    _dump(folder / "tokenizer_config.json", tokenizer_config(exported))
    _dump(folder / "special_tokens_map.json", {"pad_token": _bytes_to_unicode()[PAD_ID]})
    if exported.io.past:  # genai feeds only the new tokens after the first step: it needs the cache
        _dump(folder / GENAI_CONFIG_FILE, genai_config(exported, library_name))
    return folder
