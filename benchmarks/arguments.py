"""Argument types the benchmarks share: a bad value is argparse's one-line error (exit 2), never a
traceback, a run that measures nothing, or a size that takes the machine down."""

import argparse

from infmoe_export.contract import MAX_K

MAX_THREADS = 256


def count(minimum: int = 1, maximum: int = 1 << 20):
    """An integer in [minimum, maximum]."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if not minimum <= value <= maximum:
            raise argparse.ArgumentTypeError(f"expected an integer in [{minimum}, {maximum}], got {value}")
        return value

    return parse


def counts(minimum: int = 1, maximum: int = 1 << 20, empty: bool = False):
    """Comma-separated integers in [minimum, maximum] ('1,2,8'); '' is the empty list only where
    `empty` allows it."""
    one = count(minimum, maximum)

    def parse(text: str) -> list:
        if not text.strip():
            if empty:
                return []
            raise argparse.ArgumentTypeError("expected comma-separated integers, got nothing")
        return [one(part.strip()) for part in text.split(",")]

    return parse


ks = counts(1, MAX_K)                 # expert budgets
threads = counts(1, MAX_THREADS)      # intra-op thread counts
thread_count = count(1, MAX_THREADS)
