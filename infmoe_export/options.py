"""Parsing shared by the commands' options."""

from typing import List

from .errors import InfMoEError


def positive_ints(text: str, option: str = "--k") -> List[int]:
    """'1,2,4,8' -> [1, 2, 4, 8], sorted and unique; anything else is a one-line error naming the option."""
    try:
        values = sorted({int(part) for part in text.split(",") if part.strip()})
    except ValueError:
        values = []
    if not values or values[0] < 1:
        raise InfMoEError(f"{option} must be a comma-separated list of positive integers, got {text!r}")
    return values
