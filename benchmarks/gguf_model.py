"""Dense GPT-2 with random weights as a GGUF file (llama.cpp's `gpt2` architecture), written by the
gguf package: what llama.cpp runs in benchmarks.peers.

Every matrix is stored at the file's type (F16, Q8_0 or Q4_0; the tied embedding too, as
llama.cpp's quantize does with --pure); norms, biases and the position embedding stay F32. The
tokenizer is a minimal byte-level GPT-2 BPE vocabulary: the 256 byte tokens, merges of byte pairs
up to the vocabulary size, and <|endoftext|> last, as in GPT-2 (256 + 50000 + 1 = 50257)."""

import os
from pathlib import Path

import numpy as np

from infmoe_export.errors import InfMoEError
from infmoe_export.model import InfMoEConfig

FILE_TYPES = ("F16", "Q8_0", "Q4_0")
END_OF_TEXT = "<|endoftext|>"
LAYER_NORM_EPS = 1e-5


def byte_symbols() -> list:
    """GPT-2's printable stand-in for each byte value (byte-level BPE's alphabet), by byte value."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    symbols, shifted = {}, 0
    for byte in range(256):
        if byte in printable:
            symbols[byte] = chr(byte)
        else:
            symbols[byte] = chr(256 + shifted)
            shifted += 1
    return [symbols[byte] for byte in range(256)]


def byte_vocab(vocab_size: int):
    """(tokens, merges) of a byte-level BPE vocabulary of vocab_size tokens: the bytes, then one
    token per merge of two byte symbols, then <|endoftext|>."""
    merges_needed = vocab_size - 257
    if not 0 <= merges_needed <= 256 * 256:
        raise InfMoEError(f"a byte-level vocabulary holds 257 to {257 + 256 * 256} tokens, asked for {vocab_size}")
    symbols = byte_symbols()
    pairs = [(a, b) for a in symbols for b in symbols][:merges_needed]
    return symbols + [a + b for a, b in pairs] + [END_OF_TEXT], [f"{a} {b}" for a, b in pairs]


def gpt2_tensors(config: InfMoEConfig, seed: int = 0):
    """(name, float32 array) of a dense GPT-2 of this config with random weights, in GGUF's names
    and numpy's [rows, columns] order (rows = outputs of a matrix)."""
    if not config.is_dense:
        raise InfMoEError("llama.cpp's gpt2 architecture is dense: ffn_hidden must equal slice_width")
    rng = np.random.default_rng(seed)
    d, f = config.d_model, config.ffn_hidden

    def matrix(rows, columns):
        return (rng.standard_normal((rows, columns), dtype=np.float32) * 0.02)

    def vector(n, mean=0.0):
        return (mean + rng.standard_normal(n, dtype=np.float32) * 0.02).astype(np.float32)

    yield "token_embd.weight", matrix(config.vocab_size, d)
    yield "position_embd.weight", matrix(config.n_positions, d)
    for i in range(config.n_layer):
        yield f"blk.{i}.attn_norm.weight", vector(d, 1.0)
        yield f"blk.{i}.attn_norm.bias", vector(d)
        yield f"blk.{i}.attn_qkv.weight", matrix(3 * d, d)
        yield f"blk.{i}.attn_qkv.bias", vector(3 * d)
        yield f"blk.{i}.attn_output.weight", matrix(d, d)
        yield f"blk.{i}.attn_output.bias", vector(d)
        yield f"blk.{i}.ffn_norm.weight", vector(d, 1.0)
        yield f"blk.{i}.ffn_norm.bias", vector(d)
        yield f"blk.{i}.ffn_up.weight", matrix(f, d)
        yield f"blk.{i}.ffn_up.bias", vector(f)
        yield f"blk.{i}.ffn_down.weight", matrix(d, f)
        yield f"blk.{i}.ffn_down.bias", vector(d)
    yield "output_norm.weight", vector(d, 1.0)
    yield "output_norm.bias", vector(d)


def write_gpt2(path, config: InfMoEConfig, file_type: str, seed: int = 0) -> Path:
    """A dense GPT-2 of this config, random weights, at file_type (F16, Q8_0, Q4_0), as GGUF at
    path: written beside it, then renamed over it."""
    from gguf import GGMLQuantizationType, GGUFWriter, LlamaFileType, TokenType, quants

    if file_type not in FILE_TYPES:
        raise InfMoEError(f"GGUF file type must be one of {', '.join(FILE_TYPES)}, got {file_type!r}")
    qtype = GGMLQuantizationType[file_type]
    path = Path(path)
    temp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    writer = GGUFWriter(temp, "gpt2")
    writer.add_name(f"random GPT-2 D{config.d_model} L{config.n_layer}")
    writer.add_file_type(LlamaFileType[f"MOSTLY_{file_type}"])
    writer.add_context_length(config.n_positions)
    writer.add_embedding_length(config.d_model)
    writer.add_block_count(config.n_layer)
    writer.add_feed_forward_length(config.ffn_hidden)
    writer.add_head_count(config.n_head)
    writer.add_layer_norm_eps(LAYER_NORM_EPS)
    tokens, merges = byte_vocab(config.vocab_size)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(tokens)
    writer.add_token_types([TokenType.NORMAL] * (len(tokens) - 1) + [TokenType.CONTROL])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(len(tokens) - 1)
    writer.add_eos_token_id(len(tokens) - 1)
    for name, array in gpt2_tensors(config, seed):
        if array.ndim == 2 and name != "position_embd.weight":
            writer.add_tensor(name, quants.quantize(array, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(name, array)
    try:
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        os.replace(temp, path)
    finally:
        if temp.exists():
            temp.unlink()
    return path
