import os
from pathlib import Path

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


# ------------------------------------------------------------------------------------------------ save_into
import errno  # noqa: E402
import shutil  # noqa: E402

from tinygpt import fileio  # noqa: E402
from tinygpt.fileio import (CHECKPOINT, PREPARED_CORPUS, TEMP_PREFIX, OutputError, check_output_dir,  # noqa: E402
                            folder_kind, is_temporary, remove_temporaries, save_into)


def _checkpoint_files(tmp, config='{"emb_dim": 8}', weights=b"w"):
    (tmp / "config.json").write_text(config)
    (tmp / "model.safetensors").write_bytes(weights)


def test_save_into_a_new_folder_writes_the_files_and_no_temporaries(tmp_path):
    with save_into(tmp_path / "a" / "ckpt", CHECKPOINT) as tmp:
        assert tmp.parent == tmp_path / "a" / "ckpt" and tmp.name.startswith(TEMP_PREFIX)
        _checkpoint_files(tmp)
        (tmp / "sub").mkdir()
        (tmp / "sub" / "x.txt").write_text("x")
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")) == [
        "a", "a/ckpt", "a/ckpt/config.json", "a/ckpt/model.safetensors", "a/ckpt/sub", "a/ckpt/sub/x.txt"]
    assert folder_kind(tmp_path / "a" / "ckpt") is CHECKPOINT


def test_save_into_a_folder_of_unrelated_files_is_refused_and_force_keeps_them(tmp_path):
    target = tmp_path / "mine"
    target.mkdir()
    (target / "notes.txt").write_text("my notes")
    with pytest.raises(OutputError, match="already holds unrelated files, not a tinygpt checkpoint.*--force"):
        with save_into(target, CHECKPOINT) as tmp:
            pytest.fail("the body must not run")
    assert _siblings(target) == ["notes.txt"]
    with save_into(target, CHECKPOINT, overwrite=True) as tmp:
        _checkpoint_files(tmp)
    assert _siblings(target) == ["config.json", "model.safetensors", "notes.txt"]
    assert (target / "notes.txt").read_text() == "my notes"


def test_save_into_another_kind_is_refused(tmp_path):
    folders = {"corpus": ("prepared.json", "{}"), "hf": ("config.json", '{"model_type": "gpt2", "n_embd": 8}')}
    for name, (marker, text) in folders.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / marker).write_text(text)
    cases = [("corpus", CHECKPOINT, "a prepared corpus, not a tinygpt checkpoint"),
             ("hf", CHECKPOINT, "a Hugging Face model, not a tinygpt checkpoint"),
             ("hf", PREPARED_CORPUS, "a Hugging Face model, not a prepared corpus")]
    for name, kind, holds in cases:
        with pytest.raises(OutputError, match=f"already holds {holds}"):
            with save_into(tmp_path / name, kind):
                pytest.fail("the body must not run")
    corpus, hf = tmp_path / "corpus", tmp_path / "hf"
    assert _siblings(corpus) == ["prepared.json"] and _siblings(hf) == ["config.json"]


def test_save_over_its_own_kind_keeps_foreign_files_and_drops_its_stale_ones(tmp_path):
    target = tmp_path / "ckpt"
    with save_into(target, CHECKPOINT) as tmp:
        _checkpoint_files(tmp, weights=b"old")
        (tmp / "bpe.json").write_text("old tokenizer")
    (target / "README.md").write_text("about my model")
    with save_into(target, CHECKPOINT, replaces=("bpe.json", "README.md-is-not-listed")) as tmp:
        _checkpoint_files(tmp, weights=b"new")
    assert _siblings(target) == ["README.md", "config.json", "model.safetensors"]  # bpe.json: stale, removed
    assert (target / "model.safetensors").read_bytes() == b"new"


def test_save_into_failure_leaves_the_folder_as_it_was(tmp_path):
    target = tmp_path / "ckpt"
    with save_into(target, CHECKPOINT) as tmp:
        _checkpoint_files(tmp, weights=b"old")
    (target / "mine.txt").write_text("x")
    with pytest.raises(RuntimeError, match="crash"):
        with save_into(target, CHECKPOINT) as tmp:
            _checkpoint_files(tmp, weights=b"half")
            raise RuntimeError("crash")
    assert _siblings(target) == ["config.json", "mine.txt", "model.safetensors"]
    assert (target / "model.safetensors").read_bytes() == b"old"
    with pytest.raises(RuntimeError):
        with save_into(tmp_path / "new", CHECKPOINT) as tmp:
            raise RuntimeError("crash")
    assert _siblings(tmp_path) == ["ckpt"]  # the folder it created is gone again


def test_save_into_dot_and_relative_paths(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with save_into(".", CHECKPOINT) as tmp:
        _checkpoint_files(tmp)
    with save_into("rel/ckpt", CHECKPOINT) as tmp:
        _checkpoint_files(tmp)
    assert _siblings(tmp_path) == ["config.json", "model.safetensors", "rel"]
    assert _siblings(tmp_path / "rel" / "ckpt") == ["config.json", "model.safetensors"]


def test_output_equal_to_or_inside_an_input_is_refused(tmp_path):
    source = tmp_path / "src"
    source.mkdir()
    for out in (source, source / "inner", tmp_path / "src" / ".." / "src"):
        with pytest.raises(OutputError, match="the input"):
            check_output_dir(out, inputs=[source])
    check_output_dir(tmp_path / "elsewhere", inputs=[source])  # a sibling is fine
    (tmp_path / "corpus.txt").write_text("text")
    check_output_dir(tmp_path / "out", inputs=[tmp_path / "corpus.txt"])  # an input file's folder is fine


def test_preflight_existing_file_and_file_in_the_path(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(OutputError, match="is an existing file, not a folder"):
        check_output_dir(tmp_path / "f")
    with pytest.raises(OutputError, match="is a file, so no folder can be made under it"):
        check_output_dir(tmp_path / "f" / "sub")
    assert (tmp_path / "f").read_text() == "x"


def test_preflight_unwritable_folder(tmp_path, monkeypatch):
    locked = tmp_path / "locked"
    locked.mkdir()
    if os.name == "posix" and os.geteuid() != 0:
        locked.chmod(0o555)
    else:  # root writes anywhere: make the probe fail as the kernel would for anyone else
        def refuse(*args, **kwargs):
            raise PermissionError(errno.EACCES, "Permission denied")

        monkeypatch.setattr(fileio.tempfile, "mkstemp", refuse)
    try:
        with pytest.raises(OutputError, match=r"cannot write in .*locked \(Permission denied\)"):
            check_output_dir(locked / "out")
    finally:
        locked.chmod(0o755)


def test_preflight_full_disk(tmp_path, monkeypatch):
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(fileio.shutil, "disk_usage", lambda path: usage._replace(free=1000))
    with pytest.raises(OutputError, match="only 1.0 KB free on its disk, about 1.0 MB needed"):
        check_output_dir(tmp_path / "out")
    monkeypatch.setattr(fileio.shutil, "disk_usage", lambda path: usage._replace(free=5 << 20))
    with pytest.raises(OutputError, match="about 10.5 MB needed"):
        check_output_dir(tmp_path / "out", needed_bytes=10 << 20)
    check_output_dir(tmp_path / "out", needed_bytes=1 << 20)


def test_disk_full_mid_save_is_one_error_and_cleans_up(tmp_path, monkeypatch):
    target = tmp_path / "ckpt"
    real_replace = os.replace

    def full(src, dst):
        if str(dst).endswith("model.safetensors"):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_replace(src, dst)

    monkeypatch.setattr(fileio.os, "replace", full)
    with pytest.raises(OutputError, match="cannot write .*ckpt: No space left on device"):
        with save_into(target, CHECKPOINT) as tmp:
            _checkpoint_files(tmp)
    assert not target.exists()
    with pytest.raises(OutputError, match="No space left on device"):
        atomic_write_text(tmp_path / "model.safetensors", "x")
    assert _siblings(tmp_path) == []


def test_a_kill_at_any_rename_leaves_only_what_remove_temporaries_takes(tmp_path, rename_snapshots):
    """Snapshots of the tree just before each rename of atomic_write_text, atomic_directory (over an existing
    folder: one renamed aside) and save_into (over its kind): what a SIGKILL at that instant would leave. In each,
    the leftovers carry TEMP_PREFIX, and once remove_temporaries ran, every other entry is an old or a new one."""
    root = tmp_path / "run"
    (root / "step-2").mkdir(parents=True)
    (root / "step-2" / "a.txt").write_text("old")
    (root / ".hidden-user-file").write_text("mine")
    with save_into(root / "ckpt", CHECKPOINT) as tmp:
        _checkpoint_files(tmp, weights=b"old")
    before = {str(p.relative_to(root)) for p in root.rglob("*")}
    shots = rename_snapshots(root)
    atomic_write_text(root / "metrics.jsonl", "x")
    with atomic_directory(root / "step-2") as tmp:
        (tmp / "a.txt").write_text("new")
    with save_into(root / "ckpt", CHECKPOINT) as tmp:
        _checkpoint_files(tmp, weights=b"new")
    after = {str(p.relative_to(root)) for p in root.rglob("*")}
    assert len(shots) >= 5
    for shot in shots:
        assert any(is_temporary(p.name) for p in shot.rglob("*"))  # each rename moves a temporary
        remove_temporaries(shot)
        left = {str(p.relative_to(shot)) for p in shot.rglob("*")}
        assert not any(is_temporary(p.name) for p in shot.rglob("*"))
        assert left <= before | after, left - (before | after)
        assert (shot / ".hidden-user-file").read_text() == "mine"


@pytest.mark.skipif(os.name != "posix", reason="POSIX permission bits")
def test_save_into_files_get_the_umask_mode(tmp_path):
    mask = os.umask(0o027)
    try:
        with save_into(tmp_path / "ckpt", CHECKPOINT) as tmp:
            _checkpoint_files(tmp)
            (tmp / "tokenizer").mkdir()
            fd = os.open(tmp / "tokenizer" / "t.json", os.O_CREAT | os.O_WRONLY, 0o600)  # as mkstemp makes them
            os.close(fd)
    finally:
        os.umask(mask)
    modes = {str(p.relative_to(tmp_path)): p.stat().st_mode & 0o777 for p in tmp_path.rglob("*")}
    assert modes == {"ckpt": 0o750, "ckpt/config.json": 0o640, "ckpt/model.safetensors": 0o640,
                     "ckpt/tokenizer": 0o750, "ckpt/tokenizer/t.json": 0o640}


def test_a_save_removes_what_a_killed_save_into_the_same_folder_left(tmp_path):
    target = tmp_path / "ckpt"
    with save_into(target, CHECKPOINT) as tmp:
        _checkpoint_files(tmp)
    (target / f"{TEMP_PREFIX}save.abc").mkdir()  # the staging folder of a save that was SIGKILLed
    (target / f"{TEMP_PREFIX}save.abc" / "model.safetensors").write_bytes(b"a full copy")
    (target / f"{TEMP_PREFIX}config.json.xyz").write_text("half")
    assert folder_kind(target) is CHECKPOINT
    with save_into(target, CHECKPOINT) as tmp:
        _checkpoint_files(tmp)
    assert _siblings(target) == ["config.json", "model.safetensors"]


def test_one_json_reader_words_its_errors_and_its_probe_says_none(tmp_path):
    from tinygpt.fileio import json_object_or_none, read_json_object

    good, listed, broken = tmp_path / "good.json", tmp_path / "list.json", tmp_path / "broken.json"
    good.write_text('{"a": 1}', encoding="utf-8")
    listed.write_text("[1]", encoding="utf-8")
    broken.write_text("{", encoding="utf-8")
    assert read_json_object(good) == {"a": 1} and json_object_or_none(good) == {"a": 1}
    for path, why in ((listed, "expected a JSON object, got list"), (broken, "not a readable JSON file"),
                      (tmp_path / "none.json", "not a readable JSON file")):
        with pytest.raises(ValueError, match=f"{path.name}: {why}"):
            read_json_object(path)
        assert json_object_or_none(path) is None


@pytest.mark.parametrize("command, name, content, fragment", [
    ("params --config {}", "none.json", None, "none.json: not a readable JSON file: there is no such file"),
    ("params --config {}", "bad.json", b"{oops", "bad.json: not a readable JSON file: not valid JSON (Expecting "
                                                 "property name enclosed in double quotes at line 1 column 2)"),
    ("params --model {}", "config.json", b"[1]", "config.json: expected a JSON object, got list"),
    ("merge --out {tmp}/out --adapter {}", "adapter_config.json", b"{", "adapter_config.json: not a readable JSON "
                                                                         "file: not valid JSON"),
    ("train --out {tmp}/run --no-progress --prepared {}", "prepared.json", b"\xff{}",
     "prepared.json: not a readable JSON file: not UTF-8"),
])
def test_a_bad_json_file_is_one_line_naming_it_at_the_command_line(tmp_path, capsys, command, name, content,
                                                                   fragment):
    """Every JSON file is read by read_json_object: missing, not JSON, not UTF-8 or not an object, the command
    says so in one line naming the file."""
    from conftest import one_line_error
    from tinygpt.cli import main

    folder = tmp_path / "in"
    folder.mkdir()
    if content is not None:
        (folder / name).write_bytes(content)
    target = folder if command.startswith(("merge", "train", "params --model")) else folder / name
    assert main(command.format(target, tmp=tmp_path).split()) == 2
    one_line_error(capsys, f"{folder / name}: ", fragment)
