import os

import pytest

from tinygpt.fileio import atomic_directory, atomic_write_bytes, atomic_write_text, atomic_write_with


def _siblings(directory):
    return sorted(p.name for p in directory.iterdir())


def test_write_bytes_and_text_replace_content(tmp_path):
    path = tmp_path / "sub" / "f.bin"
    atomic_write_bytes(path, b"\x00\x01")
    assert path.read_bytes() == b"\x00\x01"
    atomic_write_text(path, "héllo\n")
    assert path.read_bytes() == "héllo\n".encode("utf-8")
    assert _siblings(path.parent) == ["f.bin"]


def test_write_with_failure_keeps_old_file_and_cleans_up(tmp_path):
    path = tmp_path / "f.txt"
    atomic_write_text(path, "old")

    def broken(tmp):
        tmp.write_text("half of the new")
        raise RuntimeError("crash mid-write")

    with pytest.raises(RuntimeError, match="crash mid-write"):
        atomic_write_with(path, broken)
    assert path.read_text() == "old"
    assert _siblings(tmp_path) == ["f.txt"]


def test_write_with_uses_a_temp_file_in_the_same_directory(tmp_path):
    seen = []

    def write(tmp):
        seen.append(tmp)
        tmp.write_text("x")

    atomic_write_with(tmp_path / "f.txt", write)
    assert seen[0].parent == tmp_path and seen[0] != tmp_path / "f.txt"
    assert not seen[0].exists()


def test_atomic_directory_creates_and_replaces(tmp_path):
    target = tmp_path / "ckpt"
    with atomic_directory(target) as tmp:
        assert tmp.parent == tmp_path and tmp != target and not target.exists()
        (tmp / "a.txt").write_text("one")
    assert _siblings(target) == ["a.txt"]
    with atomic_directory(target) as tmp:
        (tmp / "b.txt").write_text("two")
        assert (target / "a.txt").read_text() == "one"  # the old one stays readable while the new is written
    assert _siblings(target) == ["b.txt"]
    assert _siblings(tmp_path) == ["ckpt"]  # no leftover temp or old directories


def test_atomic_directory_failure_leaves_existing_untouched(tmp_path):
    target = tmp_path / "ckpt"
    with atomic_directory(target) as tmp:
        (tmp / "a.txt").write_text("one")
    with pytest.raises(RuntimeError):
        with atomic_directory(target) as tmp:
            (tmp / "a.txt").write_text("half")
            raise RuntimeError("crash")
    assert (target / "a.txt").read_text() == "one"
    assert _siblings(tmp_path) == ["ckpt"]


def test_atomic_directory_failed_rename_restores_old(tmp_path, monkeypatch):
    target = tmp_path / "ckpt"
    with atomic_directory(target) as tmp:
        (tmp / "a.txt").write_text("one")
    real_replace = os.replace
    calls = []

    def flaky_replace(src, dst):
        calls.append((src, dst))
        if len(calls) == 2:  # the second rename (new -> path) fails
            raise OSError("disk gone")
        return real_replace(src, dst)

    monkeypatch.setattr(os, "replace", flaky_replace)
    with pytest.raises(OSError, match="disk gone"):
        with atomic_directory(target) as tmp:
            (tmp / "a.txt").write_text("two")
    monkeypatch.undo()
    assert (target / "a.txt").read_text() == "one"
    assert _siblings(tmp_path) == ["ckpt"]


def test_atomic_directory_refuses_a_file(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(ValueError, match="not a directory"):
        with atomic_directory(tmp_path / "f"):
            pass


@pytest.mark.skipif(os.name != "posix", reason="POSIX permission bits")
def test_results_get_the_usual_permissions_not_the_temp_ones(tmp_path):
    mask = os.umask(0o022)
    try:
        atomic_write_text(tmp_path / "f.txt", "x")
        with atomic_directory(tmp_path / "d") as tmp:
            (tmp / "g.txt").write_text("y")
    finally:
        os.umask(mask)
    assert (tmp_path / "f.txt").stat().st_mode & 0o777 == 0o644
    assert (tmp_path / "d").stat().st_mode & 0o777 == 0o755
