"""Writing files and folders so that nothing is lost: atomic files, saves into folders, and the checks before them.

- A *file* is written to a temporary sibling (same directory, so same filesystem), flushed and fsynced, then
  ``os.replace``d onto its name -- an atomic rename on POSIX and on Windows -- and the directory is fsynced so that
  the rename itself survives a power cut (``atomic_write_with``).
- A *save into a folder* (``save_into``: a checkpoint, a Hugging Face export, a prepared corpus) assembles its files
  in a staging folder inside the target, then moves each file onto its name (one atomic rename per file), the kind's
  marker file (``config.json``, ``prepared.json``) last. It never deletes a file it did not write, and it refuses to
  write into a folder that holds something else -- another kind of artifact or unrelated files -- unless
  ``overwrite=True`` (the CLI's ``--force``). As Hugging Face's ``save_pretrained`` does with stale weight shards, a
  save over its own kind removes the files of that kind the new save no longer has (a tokenizer that is gone).
- A folder wholly owned by tinygpt (a training run's ``step-N/``) is assembled beside its target and renamed into
  place (``atomic_directory``), so it is either complete or absent.
- Every temporary entry any of these creates is named ``TEMP_PREFIX...``: whatever a killed process leaves behind,
  ``remove_temporaries`` finds it by that one rule.
- ``check_output_dir`` is the preflight every command with ``--out`` runs before its work: the path must not be a
  file, must be writable, must not lie inside an input, and its disk must have room.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Sequence

TEMP_PREFIX = ".tinygpt-tmp-"
MIN_FREE_BYTES = 1 << 20  # below this a disk counts as full even when the caller cannot estimate its output
# errno values of a write that fails because of where it writes (not a bug): reported as one OutputError line.
_OUTPUT_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EACCES, errno.EPERM, errno.EROFS, errno.EISDIR, errno.ENOTDIR}


class OutputError(ValueError):
    """An output path that cannot be written (a file in the way, no permission, no space, another kind of folder).

    A ``ValueError``, so the CLI prints it as its one-line ``error:``."""


def is_temporary(name: str) -> bool:
    """True for the name of a temporary file or folder written by this module."""
    return name.startswith(TEMP_PREFIX)


def _temp_label(path: Path) -> str:
    return path.resolve().name or "root"


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


def _output_error(err: OSError, path: Path) -> OutputError | OSError:
    """An OSError caused by the output location as an OutputError naming it; any other OSError unchanged."""
    if err.errno in _OUTPUT_ERRNOS:
        return OutputError(f"cannot write {path}: {os.strerror(err.errno)}")
    return err


def atomic_write_with(path: str | Path, write: Callable[[Path], None]) -> None:
    """Call ``write(tmp_path)`` on a temporary file beside ``path``, fsync it, then rename it onto ``path``.

    If ``write`` raises, the temporary file is removed and ``path`` is left exactly as it was. The file gets the
    umask's mode (not mkstemp's 0600). A write that fails for lack of space or permission is an ``OutputError``.
    """
    path = Path(path)
    parent = path.parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
        fd, tmp_name = tempfile.mkstemp(prefix=f"{TEMP_PREFIX}{path.name}.", dir=parent)
    except OSError as err:
        raise _output_error(err, path) from None
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        write(tmp)
        _default_permissions(tmp, directory=False)
        _fsync_path(tmp)
        os.replace(tmp, path)
    except OSError as err:
        tmp.unlink(missing_ok=True)
        raise _output_error(err, path) from None
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


def _finish_tree(root: Path) -> None:
    """Give every file and folder under ``root`` the umask's mode (writers such as safetensors' create 0600 files)
    and fsync it."""
    for here, dirs, files in os.walk(root):
        for name in files:
            _default_permissions(Path(here) / name, directory=False)
            _fsync_path(Path(here) / name)
        for name in dirs:
            _default_permissions(Path(here) / name, directory=True)
        _fsync_path(Path(here))


@contextlib.contextmanager
def atomic_directory(path: str | Path) -> Iterator[Path]:
    """Yield a temporary sibling directory; on normal exit it becomes ``path``. For folders tinygpt wholly owns
    (a run's ``step-N/``); a user-facing save uses ``save_into``, which keeps what else the folder holds.

    An existing ``path`` is first renamed aside, then the new one renamed in, then the old one deleted: at every
    instant either the old or the new directory is complete on disk. Both temporaries are named ``TEMP_PREFIX...``
    (``remove_temporaries``). If the body raises, the temporary directory is deleted and ``path`` is untouched.
    """
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise OutputError(f"{path} exists and is not a directory")
    parent = path.parent
    label = _temp_label(path)
    try:
        parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f"{TEMP_PREFIX}{label}.", dir=parent))
    except OSError as err:
        raise _output_error(err, path) from None
    try:
        _default_permissions(tmp, directory=True)
        yield tmp
        _finish_tree(tmp)
    except OSError as err:
        shutil.rmtree(tmp, ignore_errors=True)
        raise _output_error(err, path) from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    old = None
    if path.exists():
        old = Path(tempfile.mkdtemp(prefix=f"{TEMP_PREFIX}{label}.old.", dir=parent))
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


def _remove(entry: Path) -> None:
    if entry.is_dir() and not entry.is_symlink():
        shutil.rmtree(entry, ignore_errors=True)
    else:
        entry.unlink(missing_ok=True)


def remove_temporaries(root: str | Path) -> list[Path]:
    """Delete every ``TEMP_PREFIX...`` file or folder under ``root`` (what a killed writer of this module left:
    half-written files, staging folders, folders renamed aside); returns what was removed. Never anything else."""
    root = Path(root)
    removed: list[Path] = []
    if not root.is_dir():
        return removed
    for here, dirs, files in os.walk(root):
        for name in [*files, *dirs]:
            if is_temporary(name):
                entry = Path(here) / name
                _remove(entry)
                removed.append(entry)
        dirs[:] = [d for d in dirs if not is_temporary(d)]  # not descended into: already gone
    return removed


# ------------------------------------------------------------------------------------------------ JSON files
def read_json_object(path: str | os.PathLike) -> dict[str, Any]:
    """The JSON object in ``path``; a ``ValueError`` naming the file and what is wrong with it otherwise: missing,
    unreadable, not UTF-8, not JSON (where), or JSON but not an object. Every JSON file tinygpt reads whole comes
    through here, so a bad one is always worded the same way."""
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ValueError(f"{path}: not a readable JSON file: there is no such file") from None
    except OSError as err:
        raise ValueError(f"{path}: not a readable JSON file: {err.strerror or err}") from None
    except UnicodeDecodeError as err:
        raise ValueError(f"{path}: not a readable JSON file: not UTF-8 ({err.reason} at byte {err.start})") from None
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: not a readable JSON file: not valid JSON ({err.msg} at line {err.lineno} "
                         f"column {err.colno})") from None
    except RecursionError:
        raise ValueError(f"{path}: not a readable JSON file: nested too deeply to parse") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def json_object_or_none(path: str | os.PathLike) -> dict[str, Any] | None:
    """``read_json_object`` for a probe (what kind of folder is this?): None instead of the error."""
    try:
        return read_json_object(path)
    except ValueError:
        return None


# ------------------------------------------------------------------------------------------------ folder kinds
def _json_keys(path: Path) -> set[str]:
    return set(json_object_or_none(path) or ())


_STEP_DIR = re.compile(r"^step-\d+$")


def _is_run(d: Path) -> bool:
    """A training or fine-tuning run's folder: its metrics, summary, prepared data/ or step-N/ checkpoints."""
    return ((d / "metrics.jsonl").is_file() or (d / "summary.json").is_file() or (d / "data").is_dir()
            or any(_STEP_DIR.match(p.name) and p.is_dir() for p in d.iterdir()))


def _is_checkpoint(d: Path) -> bool:
    return "emb_dim" in _json_keys(d / "config.json")


@dataclass(frozen=True)
class FolderKind:
    """A kind of folder tinygpt writes, known by its marker files. ``markers`` are moved into place last (a folder
    without them is not this kind yet); ``over`` names the other kinds a save of this kind may write into."""

    name: str
    markers: tuple[str, ...]
    test: Callable[[Path], bool]
    over: tuple[str, ...] = ()

    def matches(self, directory: Path) -> bool:
        return self.test(directory)


RUN = FolderKind("tinygpt run folder", (), _is_run)
REWARD_MODEL = FolderKind("tinygpt reward model", ("config.json",),
                          lambda d: _is_checkpoint(d) and (d / "reward_head.safetensors").is_file(), over=(RUN.name,))
CHECKPOINT = FolderKind("tinygpt checkpoint", ("config.json",), _is_checkpoint, over=(RUN.name,))
HF_MODEL = FolderKind("Hugging Face model", ("config.json",),
                      lambda d: (d / "config.json").is_file() and not _is_checkpoint(d))
PREPARED_CORPUS = FolderKind("prepared corpus", ("prepared.json",), lambda d: (d / "prepared.json").is_file())
ADAPTER = FolderKind("LoRA adapter", ("adapter_config.json",), lambda d: (d / "adapter_config.json").is_file(),
                     over=(RUN.name,))
KINDS = (RUN, REWARD_MODEL, CHECKPOINT, ADAPTER, HF_MODEL, PREPARED_CORPUS)  # the first that matches names a folder
UNRELATED = FolderKind("folder of other files", (), lambda d: True)


def folder_kind(directory: str | Path) -> FolderKind | None:
    """What ``directory`` holds: None when it is absent or empty (temporaries aside), one of ``KINDS``, or
    ``UNRELATED``."""
    directory = Path(directory)
    if not directory.is_dir() or all(is_temporary(p.name) for p in directory.iterdir()):
        return None
    return next((kind for kind in KINDS if kind.matches(directory)), UNRELATED)


# ------------------------------------------------------------------------------------------------ preflight
def _nearest_existing(path: Path) -> Path:
    here = path
    while not here.exists():
        if here.parent == here:
            break
        here = here.parent
    return here


def _human(n: int) -> str:
    for unit in ("bytes", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:,} {unit}" if unit == "bytes" else f"{n:,.1f} {unit}"
        n /= 1000
    return f"{n} TB"


def check_output_dir(path: str | os.PathLike, *, inputs: Iterable[str | os.PathLike] = (), needed_bytes: int = 0,
                     what: str = "--out") -> Path:
    """The checks a command runs on its output folder before any work, each failure one ``OutputError`` line:

    - ``path`` must not be an existing file, nor lie under one;
    - it must not equal, nor lie inside, any of ``inputs`` (a save would overwrite or feed on its source);
    - the folder (or the nearest existing parent, where it will be created) must accept a new file -- probed by
      creating and deleting one, which catches permissions, read-only mounts and quotas alike;
    - its disk must have ``needed_bytes`` free (the caller's estimate of the output), and at least MIN_FREE_BYTES.

    Returns ``path`` as a ``Path``. Nothing is created.
    """
    out = Path(path)
    if out.exists() and not out.is_dir():
        raise OutputError(f"{what} {out} is an existing file, not a folder; give a folder path")
    resolved = out.resolve()
    for source in inputs:
        src = Path(source).resolve()
        if resolved == src or resolved.is_relative_to(src) and src.is_dir():
            where = "is" if resolved == src else "lies inside"
            raise OutputError(f"{what} {out} {where} the input {source}: a save there would overwrite or feed on its "
                              f"own source; choose a folder outside it")
    base = _nearest_existing(resolved)
    if not base.is_dir():
        raise OutputError(f"{what} {out}: {base} is a file, so no folder can be made under it")
    try:
        fd, probe = tempfile.mkstemp(prefix=f"{TEMP_PREFIX}probe.", dir=base)
        os.close(fd)
        os.unlink(probe)
    except OSError as err:
        raise OutputError(f"{what} {out}: cannot write in {base} ({os.strerror(err.errno) if err.errno else err})"
                          ) from None
    free = shutil.disk_usage(base).free
    needed = max(int(needed_bytes), MIN_FREE_BYTES)
    if free < needed:
        raise OutputError(f"{what} {out}: only {_human(free)} free on its disk, about {_human(needed)} needed")
    return out


# ------------------------------------------------------------------------------------------------ save into
def check_save_target(directory: str | os.PathLike, kind: FolderKind, *, overwrite: bool = False,
                      inputs: Iterable[str | os.PathLike] = (), needed_bytes: int = 0, what: str = "--out"
                      ) -> FolderKind | None:
    """``check_output_dir``, then whether a save of ``kind`` may go into ``directory``: absent, empty, of ``kind`` or
    of a kind in ``kind.over``; anything else (another kind, unrelated files) is an ``OutputError`` unless
    ``overwrite``. Returns ``folder_kind(directory)``. ``save_into`` runs it; a command runs it first as well when
    it has long work to do before the save."""
    directory = check_output_dir(directory, inputs=inputs, needed_bytes=needed_bytes, what=what)
    existing = folder_kind(directory)
    if existing is not None and existing is not kind and existing.name not in kind.over and not overwrite:
        holds = "unrelated files" if existing is UNRELATED else f"a {existing.name}"
        raise OutputError(
            f"{what} {directory} already holds {holds}, not a {kind.name}: refusing to write into it; choose a new "
            f"or empty folder, or pass --force (overwrite=True) to add the {kind.name} files (nothing else in the "
            f"folder is deleted)")
    return existing


def _files_under(root: Path) -> list[Path]:
    return sorted(p.relative_to(root) for p in root.rglob("*") if p.is_file() or p.is_symlink())


@contextlib.contextmanager
def save_into(directory: str | os.PathLike, kind: FolderKind, *, overwrite: bool = False,
              inputs: Iterable[str | os.PathLike] = (), replaces: Sequence[str] = (), needed_bytes: int = 0,
              what: str = "--out") -> Iterator[Path]:
    """Save one artifact of ``kind`` into ``directory``: yield an empty staging folder to write its files into.

    Before the body: ``check_output_dir`` (so a file in the way, no permission, no space or an output inside
    ``inputs`` fails before any work), then the folder's kind: absent, empty, of ``kind`` or of a kind in
    ``kind.over`` is fine; anything else (another kind, unrelated files) is an ``OutputError`` unless
    ``overwrite``. On normal exit each staged file is moved onto its name in ``directory`` (subfolders created),
    ``kind.markers`` last and removed first when the folder is of ``kind``, so a save killed midway leaves no
    marker rather than a mix posing as whole. Files in ``replaces`` (paths relative to ``directory``) that this save
    did not write are deleted, only when the folder already was of ``kind``. Nothing else is ever deleted. If the
    body or a move fails, the staging folder is removed (and ``directory`` too when this call created it and it is
    empty again). Every file and folder gets the umask's mode.
    """
    directory = Path(directory)
    existing = check_save_target(directory, kind, overwrite=overwrite, inputs=inputs, needed_bytes=needed_bytes,
                                 what=what)
    created = not directory.exists()
    try:
        directory.mkdir(parents=True, exist_ok=True)
        for entry in directory.iterdir():  # what an earlier, killed save into this folder left behind
            if is_temporary(entry.name):
                _remove(entry)
        staging = Path(tempfile.mkdtemp(prefix=f"{TEMP_PREFIX}save.", dir=directory))
    except OSError as err:
        raise _output_error(err, directory) from None
    try:
        try:
            yield staging
            written = _files_under(staging)
            written.sort(key=lambda rel: str(rel) in kind.markers)  # markers last
            for rel in written:
                if (directory / rel).is_dir():
                    raise OutputError(f"cannot write {directory / rel}: a folder of that name is in the way")
            mode_dir = 0o777 & ~_umask()
            for rel in written:
                _default_permissions(staging / rel, directory=False)
                _fsync_path(staging / rel)
            if existing is kind:
                for marker in kind.markers:
                    (directory / marker).unlink(missing_ok=True)
            for rel in written:
                target = directory / rel
                if not target.parent.is_dir():
                    target.parent.mkdir(parents=True, exist_ok=True)
                    os.chmod(target.parent, mode_dir)
                os.replace(staging / rel, target)
            for parent in sorted({(directory / rel).parent for rel in written}, key=lambda p: len(p.parts)):
                _fsync_path(parent)
            if existing is kind:
                for rel in set(replaces) - {str(r) for r in written}:
                    stale = directory / rel
                    if stale.is_file():
                        stale.unlink()
        except OSError as err:
            raise _output_error(err, directory) from None
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        if created:
            with contextlib.suppress(OSError):
                directory.rmdir()  # only when empty: nothing of the failed save is left
        raise
    shutil.rmtree(staging, ignore_errors=True)
