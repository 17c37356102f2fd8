"""Bytes in, bytes out: the byte tokenizer, the default corpus and its fixed train/validation split.

The default corpus is the running interpreter's standard-library source (*.py), text that every
machine has and nobody here wrote. It is split *by file*, by a hash of the file's path relative
to the corpus root, so the split does not depend on the machine or on the order files are found:

    crc32(relative path, "/"-separated, UTF-8) % 50 == 0  ->  validation (about 2%), otherwise train

Empty files are skipped; files are read in sorted order of that relative path and concatenated.
"""

import os
import sysconfig
import zlib
from pathlib import Path
from typing import List, Sequence, Union

import numpy as np
import torch

from .errors import InfMoEError
from .limits import MAX_TEXT_BYTES, check_file_size

SPLITS = ("train", "validation")
VALIDATION_BUCKET, BUCKETS = 0, 50
# Test suites are left out: large, repetitive data tables and generated strings, not "source".
EXCLUDED_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}


def encode(text: Union[str, bytes]) -> torch.Tensor:
    """Token id = byte value (UTF-8 for str), as a 1-D LongTensor."""
    data = text.encode("utf-8") if isinstance(text, str) else bytes(text)
    return torch.from_numpy(np.frombuffer(data, dtype=np.uint8).astype(np.int64))


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def split_of(relpath: str) -> str:
    """The fixed rule above, for a '/'-separated path relative to the corpus root."""
    bucket = zlib.crc32(relpath.encode("utf-8")) % BUCKETS
    return "validation" if bucket == VALIDATION_BUCKET else "train"


def _listing(root: Path) -> List[Path]:
    """The non-empty corpus files under root, sorted by relative path: *.py outside EXCLUDED_DIRS
    for the standard library, every regular non-hidden file for a user directory."""
    stdlib = root.resolve() == stdlib_root().resolve()
    found = []
    for folder, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if not d.startswith(".") and not (stdlib and d in EXCLUDED_DIRS)]
        for name in names:
            path = Path(folder) / name
            if (name.endswith(".py") if stdlib else not name.startswith(".")) \
                    and path.is_file() and path.stat().st_size > 0:
                found.append(path)
    return sorted(found, key=lambda p: p.relative_to(root).as_posix())


def corpus_files(split: str, root: Union[str, Path, None] = None) -> List[Path]:
    """Files of one split of the corpus in directory root (default: the standard library)."""
    if split not in SPLITS:
        raise InfMoEError(f"split must be one of {SPLITS}, got {split!r}")
    root = Path(root) if root is not None else stdlib_root()
    if not root.is_dir():
        raise InfMoEError(f"corpus {root} is not a directory")
    files = [p for p in _listing(root) if split_of(p.relative_to(root).as_posix()) == split]
    if not files:
        raise InfMoEError(f"corpus {root} has no {split} files (a file goes to validation when "
                          f"crc32 of its relative path % {BUCKETS} == {VALIDATION_BUCKET}); add more files")
    return files


def read_texts(paths: Sequence[Union[str, Path]]) -> bytes:
    """The files' bytes, concatenated in the order given; a missing or empty file is an error, and
    so is more text than MAX_TEXT_BYTES in all (checked from the sizes, before reading)."""
    paths = [Path(p) for p in paths]
    if not paths:
        raise InfMoEError("no text files given")
    total = 0
    for path in paths:
        if path.is_dir():
            raise InfMoEError(f"text file {path} is a directory; give the text files in it")
        if not path.is_file():
            raise InfMoEError(f"text file {path} does not exist or is not a regular file")
        total += check_file_size(path, MAX_TEXT_BYTES - total, "text file")
    chunks = [path.read_bytes() for path in paths]
    empty = next((path for path, data in zip(paths, chunks) if not data), None)
    if empty is not None:
        raise InfMoEError(f"text file {empty} is empty")
    return b"".join(chunks)


def corpus_bytes(split: str, corpus: Union[str, Path, None] = None) -> bytes:
    """One split of a corpus: the standard library (None), a directory split by file, or a
    single file, whose last 10% of bytes is the validation split (one file cannot be split by file)."""
    if corpus is not None and Path(corpus).is_file():
        data = read_texts([corpus])
        cut = len(data) - max(1, len(data) // 10)
        if cut < 2:
            raise InfMoEError(f"corpus file {corpus} is too short to split into train and validation")
        return data[:cut] if split == "train" else data[cut:]
    return read_texts(corpus_files(split, corpus))


def windows(data: Union[bytes, torch.Tensor], n_positions: int) -> List[torch.Tensor]:
    """Non-overlapping windows of n_positions tokens (the last one shorter), as LongTensors."""
    ids = data if isinstance(data, torch.Tensor) else encode(data)
    return list(ids.split(n_positions))
