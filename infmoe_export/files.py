"""Writing files safely: never a half-written file, never a file or folder this program did not
make, and checksums for manifests and caches."""

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import stat
import tempfile
from pathlib import Path
from typing import Sequence, Union

from .errors import InfMoEError


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


def write_json(path: Union[str, os.PathLike], data) -> Path:
    """data as indented JSON at path (its folder made if missing), written with atomic_write: a
    benchmark's results file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    return atomic_write(path, json.dumps(data, indent=2) + "\n")


def sha256(*paths: Union[str, os.PathLike], prefix: bytes = b"") -> str:
    """Hex SHA-256 of prefix followed by the files' bytes, read in 1 MiB blocks."""
    digest = hashlib.sha256(prefix)
    for path in paths:
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()


# ---------------------------------------------------------------------------------------------
# The output-path policy of every command: create, or replace what this program made; refuse
# anything else. A folder this program made holds MARKER; it doubles as the folder's lock.

MARKER = ".infmoe-export"


def _refuse(path: Path, why: str):
    raise InfMoEError(f"refusing to write {path}: {why}")


Inputs = Sequence[Union[str, os.PathLike, None]]


def _refuse_inputs(path: Path, inputs: Inputs):
    """An output may not be one of the command's inputs, a folder that holds one, or lie inside
    an input folder (a checkpoint, a model folder)."""
    target = path.resolve()
    for source in inputs:
        if source is None:
            continue
        resolved = Path(source).resolve()
        if resolved == target or target in resolved.parents or resolved in target.parents:
            _refuse(path, f"it is, holds or lies inside this command's input {source}")


def output_file(path: Union[str, os.PathLike], *, inputs: Inputs = ()) -> Path:
    """Check an output file before any work: absent, or a regular file to replace. Directories,
    symlinks, FIFOs, devices and the command's own input files are refused; the parent folder is
    created and must be writable."""
    path = Path(path)
    if path.is_symlink():
        _refuse(path, "it is a symbolic link (give the file it points to, or a new name)")
    if path.exists():
        kind = path.lstat().st_mode
        if stat.S_ISDIR(kind):
            _refuse(path, "it is a directory; give a file name inside it")
        if not stat.S_ISREG(kind):
            _refuse(path, "it exists and is not a regular file (a device, FIFO or socket)")
        for source in inputs:
            if source is not None and Path(source).exists() and os.path.samefile(path, source):
                _refuse(path, "it is one of this command's inputs")
    _refuse_inputs(path, inputs)
    _writable_dir(path.parent)
    return path


def _writable_dir(folder: Path):
    if folder.exists() and not folder.is_dir():
        _refuse(folder, "it exists and is not a directory")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".probe.", dir=folder)
        os.close(fd)
        os.unlink(probe)
    except OSError as error:
        raise InfMoEError(f"cannot write into {folder}: {error.strerror or error}") from None


def is_ours(folder: Path) -> bool:
    return (folder / MARKER).is_file()


def output_dir(path: Union[str, os.PathLike], *, inputs: Inputs = ()) -> Path:
    """A folder the command may fill: new (created and marked), empty (marked), or made by this
    program before (it holds MARKER; what is in it may be replaced). A folder with other files,
    a symlink or a non-directory is refused, so no user file is ever replaced or deleted."""
    path = check_replaceable_dir(path, inputs=inputs)
    _writable_dir(path)
    (path / MARKER).touch()
    return path


@contextlib.contextmanager
def locked(folder: Path):
    """Hold the folder's lock (its MARKER file) for the duration; a second run into the same
    folder is refused at once instead of mixing its files with ours."""
    with open(Path(folder) / MARKER, "a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise InfMoEError(f"another infmoe-export run is writing {folder}; wait for it or give another "
                              "folder") from None
        try:
            yield folder
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def check_replaceable_dir(path: Union[str, os.PathLike], *, inputs: Inputs = ()) -> Path:
    """Check, before any work, that a folder the command will publish whole may be replaced:
    absent, empty, or made by this program, and holding none of the command's inputs. Its
    parent must be writable."""
    path = Path(path)
    _refuse_inputs(path, inputs)
    if path.is_symlink():
        _refuse(path, "it is a symbolic link; give the folder itself")
    if path.exists():
        if not path.is_dir():
            _refuse(path, "it exists and is not a directory")
        if not is_ours(path) and any(path.iterdir()):
            _refuse(path, "the folder holds files infmoe-export did not write; give a new or empty folder")
    _writable_dir(path.parent)
    return path


def publish_dir(staging: Path, target: Path) -> Path:
    """Move a finished staging folder to target, replacing target only if this program made it
    (it holds MARKER). The old folder is renamed aside first, so target is never half-written."""
    check_replaceable_dir(target)
    (staging / MARKER).touch()
    old = None
    if target.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{target.name}.old.", dir=target.parent))
        os.replace(target, old / target.name)
    os.replace(staging, target)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return target


@contextlib.contextmanager
def staged_dir(target: Path):
    """A staging folder beside target, published over it (publish_dir) when the block succeeds
    and removed when it fails: target holds a whole run or the previous one, never a mix."""
    target = Path(target)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.staging.", dir=target.parent))
    umask = os.umask(0)
    os.umask(umask)
    staging.chmod(0o777 & ~umask)  # mkdtemp makes it private; the published folder is an ordinary one
    (staging / MARKER).touch()
    try:
        yield staging
        publish_dir(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
