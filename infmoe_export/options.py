"""Parsing and settings shared by the commands."""

import math
import os
from typing import List, Optional

import click

from .errors import InfMoEError
from .limits import check_fits, forward_bytes

# Seeds feed torch and numpy generators, which take 64-bit values.
SEED = click.IntRange(0, 2**63 - 1)
# Intra-op threads: more than any machine has cores is a mistake, and overflows the runtimes' int.
THREADS = click.IntRange(1, 1024)


class FiniteFloat(click.FloatRange):
    """A float range that also refuses nan and inf (click's range lets nan through)."""
    name = "finite float"

    def convert(self, value, param, ctx):
        number = super().convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value!r} is not a finite number", param, ctx)
        return number


# Counts (K, batch, sequence) beyond this are never meaningful and would overflow int32 shapes.
MAX_COUNT = 2**31 - 1


def positive_ints(text: str, option: str = "--k") -> List[int]:
    """'1,2,4,8' -> [1, 2, 4, 8], sorted and unique; anything else is a one-line error naming the option."""
    try:
        values = sorted({int(part) for part in text.split(",") if part.strip()})
    except ValueError:
        values = []
    if not values or values[0] < 1 or values[-1] > MAX_COUNT:
        raise InfMoEError(f"{option} must be a comma-separated list of positive integers up to {MAX_COUNT}, "
                          f"got {text!r}")
    return values


def check_forward_memory(config, batch: int, seq: int, k: int) -> None:
    """Refuse a batch, sequence and expert budget whose forward pass would not fit in memory."""
    check_fits(forward_bytes(config, batch, seq, k), f"a forward pass at batch {batch}, sequence {seq}, K={k}")


def set_threads(threads: Optional[int] = None) -> int:
    """Torch intra-op threads: as asked, else as OMP_NUM_THREADS says, else at most 4 (small
    models gain little beyond that, and on a shared machine more threads only fight)."""
    import torch

    if threads is None and os.environ.get("OMP_NUM_THREADS"):
        return torch.get_num_threads()
    threads = threads or min(4, os.cpu_count() or 1)
    torch.set_num_threads(threads)
    return threads


QUANTIZE_OTHER_HELP = ("Precision of attention and the tied embedding / LM head in the int8 / int4 models "
                       "(docs/quantization.md); fp32 and fp16 models stay float.")
