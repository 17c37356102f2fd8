"""llama.cpp (through llama-cpp-python's low-level API) running a GGUF model the way the
benchmarks time onnxruntime: batch-1 decode at an exact past, one decode step for B sequences at
once, and prefill.

A context's KV cache is per sequence (llama.cpp's default, not unified): the batched step's B
sequences each hold their own copy of the past, as B independent streams would, rather than
sharing one prefix. Each timing function prepares the cache for its measurement and returns a
step that restores it before running, so a step is valid until the next function is called on
the same context.

`python -m benchmarks.llama MODEL.gguf --threads 2 --past 128` is the peak-RSS child: in a fresh
process, it imports llama_cpp, loads the model, prefills `past` tokens, decodes a few steps and
prints one JSON line (as infmoe_export.report.memory does for onnxruntime).
"""

import argparse
import ctypes
import json
import sys

import numpy as np

DECODE_STEPS = 8
CTX_PER_SEQUENCE = 1024  # positions a sequence may hold: GPT-2's n_positions
BATCHED_CTX_PER_SEQUENCE = 256  # a batched step's sequences hold past + 1 tokens, past <= 255


def available() -> str:
    """'' when llama_cpp imports, else why not."""
    try:
        import llama_cpp  # noqa: F401
    except ImportError as error:
        return f"llama-cpp-python is not installed ({error.msg}; pip install 'infmoe-export[bench]')"
    except OSError as error:  # its shared library failed to load
        return f"llama-cpp-python's library does not load: {error}"
    return ""


_quiet = None  # the log callback, kept alive as long as llama.cpp may call it


def _silence(llama_cpp):
    global _quiet
    if _quiet is None:
        _quiet = llama_cpp.llama_log_callback(lambda level, text, data: None)
        llama_cpp.llama_log_set(_quiet, ctypes.c_void_p(0))
        llama_cpp.llama_backend_init()


class LlamaModel:
    """One GGUF model loaded once (mmap'd, CPU), contexts made for each kind of measurement."""

    def __init__(self, path, threads: int):
        import llama_cpp

        _silence(llama_cpp)
        self.lib, self.threads = llama_cpp, threads
        params = llama_cpp.llama_model_default_params()
        params.n_gpu_layers = 0
        self.model = llama_cpp.llama_model_load_from_file(str(path).encode(), params)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {path}")
        self.positions = llama_cpp.llama_model_n_ctx_train(self.model)
        self.ctx, self.sequences, self.batches = None, 0, []

    def context(self, sequences: int):
        """A context of `sequences` sequences; the one made before is freed when it had another
        count (one measurement at a time: the largest batched context holds 8192 positions)."""
        if self.sequences != sequences:
            self._free_context()
            params = self.lib.llama_context_default_params()
            per_sequence = CTX_PER_SEQUENCE if sequences == 1 else BATCHED_CTX_PER_SEQUENCE
            params.n_ctx = sequences * per_sequence
            params.n_batch = params.n_ubatch = CTX_PER_SEQUENCE
            params.n_seq_max = sequences
            params.n_threads = params.n_threads_batch = self.threads
            self.ctx = self.lib.llama_init_from_model(self.model, params)
            if not self.ctx:
                raise RuntimeError(f"llama.cpp could not make a context of {sequences} sequences")
            self.sequences = sequences
        return self.ctx

    def _free_context(self):
        if self.ctx:
            self.lib.llama_free(self.ctx)
        self.ctx, self.sequences = None, 0

    def close(self):
        for batch in self.batches:
            self.lib.llama_batch_free(batch)
        self.batches = []
        self._free_context()
        if self.model:
            self.lib.llama_model_free(self.model)
            self.model = None

    def _decode(self, ctx, batch):
        status = self.lib.llama_decode(ctx, batch)
        if status != 0:
            raise RuntimeError(f"llama_decode returned {status}")
        self.lib.llama_synchronize(ctx)

    def _batch(self, tokens, positions, sequences, last_only: bool):
        """A llama_batch of tokens[i] at positions[i] in sequence sequences[i]; logits of every
        token, or of the last only (a prefill). Freed with the model."""
        n = len(tokens)
        batch = self.lib.llama_batch_init(n, 0, 1)
        self.batches.append(batch)
        batch.n_tokens = n
        for i, (token, position, sequence) in enumerate(zip(tokens, positions, sequences)):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = int(token), int(position), 1
            batch.seq_id[i][0] = int(sequence)
            batch.logits[i] = int(not last_only or i == n - 1)
        return batch

    def _check_positions(self, count: int):
        """llama.cpp aborts the process on a position past the model's; refuse it here instead."""
        if count > self.positions:
            raise ValueError(f"{count} tokens do not fit the model's {self.positions} positions")

    def prefill_at(self, tokens: np.ndarray):
        """A step that prefills `tokens` from position 0 of sequence 0 (logits of the last)."""
        self._check_positions(len(tokens))
        ctx = self.context(1)
        memory = self.lib.llama_get_memory(ctx)
        batch = self._batch(tokens, range(len(tokens)), [0] * len(tokens), last_only=True)

        def step():
            self.lib.llama_memory_clear(memory, False)
            self._decode(ctx, batch)
        return step

    def step_at(self, tokens: np.ndarray, past: int, batch_size: int = 1):
        """A step of `batch_size` sequences, each one new token (tokens[past]) at exactly `past`
        after tokens[:past]: each call first removes what the previous call added."""
        self._check_positions(past + 1)
        ctx = self.context(batch_size)
        memory = self.lib.llama_get_memory(ctx)
        self.lib.llama_memory_clear(memory, True)
        prompt = self._batch(tokens[:past], range(past), [0] * past, last_only=True)
        self._decode(ctx, prompt)
        for sequence in range(1, batch_size):
            self.lib.llama_memory_seq_cp(memory, 0, sequence, -1, -1)
        batch = self._batch([tokens[past]] * batch_size, [past] * batch_size, range(batch_size), last_only=False)

        def step():
            self.lib.llama_memory_seq_rm(memory, -1, past, -1)
            self._decode(ctx, batch)
        return step


def child(path: str, threads: int, past: int) -> dict:
    """In a fresh process: load, prefill `past` tokens, decode DECODE_STEPS steps; peak figures."""
    from infmoe_export.report.timing import status_kib

    before = status_kib("VmRSS")
    model = LlamaModel(path, threads)
    tokens = np.arange(past + 1) % 256
    step = model.step_at(tokens, past)
    for _ in range(DECODE_STEPS):
        step()
    peak = status_kib("VmHWM")
    return {"rss_before_load_bytes": before * 1024 if before is not None else None,
            "peak_rss_bytes": peak * 1024 if peak is not None else None}


def main():
    parser = argparse.ArgumentParser(description="peak RSS of llama.cpp loading and decoding a GGUF model")
    parser.add_argument("model")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--past", type=int, default=128)
    args = parser.parse_args()
    reason = available()
    if reason:
        sys.exit(f"benchmarks.llama: {reason}")
    try:
        print(json.dumps(child(args.model, args.threads, args.past)))
    except (RuntimeError, ValueError) as error:
        sys.exit(f"benchmarks.llama: {error}")


if __name__ == "__main__":
    main()
