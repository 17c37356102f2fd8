"""Writing files safely: never a half-written file, and checksums for manifests and caches."""

import hashlib
import os
import tempfile
from pathlib import Path
from typing import Union


def atomic_write(path: Union[str, os.PathLike], data: Union[str, bytes]) -> Path:
    """Write data into a temporary file beside path, then rename it over path: readers see the
    old file or the new one, never a part. The file gets ordinary permissions (0644)."""
    path = Path(path)
    fd, temp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
        os.chmod(temp, 0o644)  # mkstemp makes it private
        os.replace(temp, path)
    except BaseException:
        os.unlink(temp)
        raise
    return path


def sha256(*paths: Union[str, os.PathLike], prefix: bytes = b"") -> str:
    """Hex SHA-256 of prefix followed by the files' bytes, read in 1 MiB blocks."""
    digest = hashlib.sha256(prefix)
    for path in paths:
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()
