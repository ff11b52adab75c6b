"""Atomic file and directory writes: a crash mid-write leaves either the old content or the new, never a mix.

A file is written to a temporary sibling (same directory, so same filesystem), flushed and fsynced, then
``os.replace``d onto its name -- an atomic rename on POSIX and on Windows -- and the directory is fsynced so that
the rename itself survives a power cut. A directory (a checkpoint) is assembled in a temporary sibling directory and
renamed into place the same way.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable, Iterator


def _fsync_path(path: Path) -> None:
    """fsync a file or (where the OS allows it) a directory."""
    flags = os.O_RDONLY
    if path.is_dir():
        if os.name == "nt":  # directories cannot be opened for fsync on Windows; NTFS journals the rename
            return
        flags |= getattr(os, "O_DIRECTORY", 0)
    fd = os.open(path, flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _umask() -> int:
    """The process umask (read without changing it where /proc allows; else set and restored at once)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _default_permissions(path: Path, *, directory: bool) -> None:
    """mkstemp/mkdtemp create 0600/0700 entries; give the final one the mode a plain open()/mkdir() would have."""
    os.chmod(path, (0o777 if directory else 0o666) & ~_umask())


def atomic_write_with(path: str | Path, write: Callable[[Path], None]) -> None:
    """Call ``write(tmp_path)`` on a temporary file beside ``path``, fsync it, then rename it onto ``path``.

    If ``write`` raises, the temporary file is removed and ``path`` is left exactly as it was.
    """
    path = Path(path)
    parent = path.parent
    parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=parent)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        write(tmp)
        _default_permissions(tmp, directory=False)
        _fsync_path(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_path(parent)


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically."""
    atomic_write_with(path, lambda tmp: tmp.write_bytes(data))


def atomic_write_text(path: str | Path, text: str) -> None:
    """Write ``text`` (UTF-8, newlines untranslated) to ``path`` atomically."""
    atomic_write_bytes(path, text.encode("utf-8"))


@contextlib.contextmanager
def atomic_directory(path: str | Path) -> Iterator[Path]:
    """Yield a temporary sibling directory; on normal exit it becomes ``path``.

    On exit every file in it is fsynced and the directory is renamed into place. An existing ``path`` is first
    renamed aside, then the new one renamed in, then the old one deleted: at every instant either the old or the
    new directory is complete on disk (between the two renames ``path`` is briefly absent, the closest a directory
    replace gets to atomic with portable calls). If the body raises, the temporary directory is deleted and an
    existing ``path`` is untouched.
    """
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise ValueError(f"{path} exists and is not a directory")
    parent = path.parent
    parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=parent))
    try:
        _default_permissions(tmp, directory=True)
        yield tmp
        for root, _dirs, files in os.walk(tmp):
            for name in files:
                _fsync_path(Path(root) / name)
            _fsync_path(Path(root))
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    old = None
    if path.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".old", dir=parent))
        old.rmdir()  # only the unique name is wanted; os.replace needs the target to be absent or empty
        os.replace(path, old)
    try:
        os.replace(tmp, path)
    except BaseException:
        if old is not None:
            os.replace(old, path)  # put the previous directory back
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _fsync_path(parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
