import json

import numpy as np
import pytest
import torch

from tinygpt.training import PreparedCorpus, WindowSampler, find_text_files, prepare_corpus, prepare_or_reuse
from tinygpt.training.data import iter_text_chunks, token_dtype


def test_prepare_char_roundtrip(tmp_path, training_text_file):
    corpus = prepare_corpus([training_text_file], "char", tmp_path / "prep", progress=False)
    text = training_text_file.read_text(encoding="utf-8")
    tokenizer = corpus.load_tokenizer()
    tokens = np.concatenate([corpus.train, corpus.val])
    assert tokenizer.decode(tokens.tolist()) == text  # char has no end-of-text id: nothing added
    assert corpus.train.dtype == np.uint16 and len(tokens) == len(text)
    header = json.loads((tmp_path / "prep" / "prepared.json").read_text())
    assert header["total_tokens"] == len(text) and header["train_tokens"] == round(len(text) * 0.9)
    import hashlib

    assert header["sources"][0]["sha256"] == hashlib.sha256(training_text_file.read_bytes()).hexdigest()


def test_prepare_bpe_separates_files_with_end_of_text(tmp_path):
    folder = tmp_path / "docs"
    (folder / "sub").mkdir(parents=True)
    (folder / "a.txt").write_text("alpha beta gamma\n" * 40)
    (folder / "sub" / "b.md").write_text("delta epsilon\n" * 40)
    (folder / ".hidden.txt").write_text("never read")
    (folder / "blob.bin").write_bytes(b"\0\1\2")
    assert [p.name for p in find_text_files([folder])] == ["a.txt", "b.md"]
    corpus = prepare_corpus([folder], "bpe:300", tmp_path / "prep", progress=False)
    tok = corpus.load_tokenizer()
    tokens = np.concatenate([corpus.train, corpus.val]).tolist()
    assert tokens.count(tok.eot_id) == 2
    first = tokens.index(tok.eot_id)
    assert tok.decode(tokens[:first]) == "alpha beta gamma\n" * 40
    assert tok.decode(tokens[first + 1 : -1]) == "delta epsilon\n" * 40


def test_chunks_cover_the_file_exactly_across_multibyte_boundaries(tmp_path):
    text = "".join(f"zeile {i}: äöü € 漢字\n  indented\n\n" for i in range(200))
    path = tmp_path / "u.txt"
    path.write_text(text, encoding="utf-8")
    seen = bytearray()
    chunks = list(iter_text_chunks(path, chunk_bytes=37, on_bytes=seen.extend))
    assert "".join(chunks) == text and bytes(seen) == path.read_bytes()
    assert len(chunks) > 10
    assert all(c.endswith("\n") and not chunks[i + 1][0].isspace() for i, c in enumerate(chunks[:-1]))


def test_small_chunks_give_the_same_tokens(tmp_path, training_text_file):
    a = prepare_corpus([training_text_file], "char", tmp_path / "a", progress=False)
    b = prepare_corpus([training_text_file], "char", tmp_path / "b", chunk_bytes=50, progress=False)
    assert np.array_equal(a.train, b.train) and np.array_equal(a.val, b.val)


def test_token_dtype():
    assert token_dtype(65536) == np.uint16 and token_dtype(65537) == np.uint32


def _missing(d):
    return [d / "missing.txt"]


def _empty_file(d):
    (d / "empty.txt").write_text("")
    return [d / "empty.txt"]


def _empty_folder(d):
    (d / "nothing").mkdir()
    return [d / "nothing"]


def _no_paths(d):
    return []


@pytest.mark.parametrize("make, message", [
    (_missing, "does not exist"),
    (_empty_file, "empty"),
    (_empty_folder, "no text files"),
    (_no_paths, "no data paths"),
])
def test_bad_corpus_is_a_clear_error(tmp_path, make, message):
    with pytest.raises((ValueError, FileNotFoundError), match=message):
        prepare_corpus(make(tmp_path), "char", tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def test_reuse_only_when_sources_and_tokenizer_match(tmp_path, training_text_file):
    out = tmp_path / "prep"
    first = prepare_or_reuse([training_text_file], "char", out, progress=False)
    stamp = (out / "tokens.bin").stat().st_mtime_ns
    prepare_or_reuse([training_text_file], "char", out, progress=False)
    assert (out / "tokens.bin").stat().st_mtime_ns == stamp
    training_text_file.write_text(training_text_file.read_text() + "more words\n")
    second = prepare_or_reuse([training_text_file], "char", out, progress=False)
    assert len(second.train) + len(second.val) == len(first.train) + len(first.val) + len("more words\n")


def test_open_rejects_a_truncated_token_file(tmp_path, training_text_file):
    prepare_corpus([training_text_file], "char", tmp_path / "prep", progress=False)
    with open(tmp_path / "prep" / "tokens.bin", "r+b") as f:
        f.truncate(100)
    with pytest.raises(ValueError, match="prepare the corpus again"):
        PreparedCorpus.open(tmp_path / "prep")


def test_windows_are_shifted_seeded_and_resumable():
    tokens = np.arange(1000, dtype=np.uint16)
    a = WindowSampler(tokens, context_length=8, seed=3)
    x, y = a.sample(5)
    assert x.shape == (5, 8) and x.dtype == torch.int64
    assert torch.equal(y, x + 1)  # targets are the inputs shifted by one
    assert torch.equal(x[:, 1:], x[:, :-1] + 1)  # contiguous windows
    state = a.state_dict()
    after = a.sample(5)
    b = WindowSampler(tokens, context_length=8, seed=3)
    assert torch.equal(b.sample(5)[0], x)
    b.load_state_dict(state)
    assert torch.equal(b.sample(5)[0], after[0])


def test_ranks_slice_the_global_batch():
    tokens = np.arange(500, dtype=np.uint16)
    whole = WindowSampler(tokens, 4, seed=1).sample(6)[0]
    parts = [WindowSampler(tokens, 4, seed=1).sample(6, rows=slice(r * 3, r * 3 + 3))[0] for r in range(2)]
    assert torch.equal(torch.cat(parts), whole)


def test_window_larger_than_data_is_an_error():
    with pytest.raises(ValueError, match="fewer than one window"):
        WindowSampler(np.arange(8, dtype=np.uint16), context_length=8, seed=0)


def test_prepare_with_the_gpt2_tokenizer(tmp_path, gpt2_vocab_dir, monkeypatch):
    monkeypatch.setenv("TINYGPT_GPT2_VOCAB", str(gpt2_vocab_dir))
    (tmp_path / "a.txt").write_text("Hello world, this is tinygpt.\n")
    (tmp_path / "b.txt").write_text("A second document.\n")
    corpus = prepare_corpus([tmp_path / "a.txt", tmp_path / "b.txt"], "gpt2", tmp_path / "prep", progress=False)
    tokens = np.concatenate([corpus.train, corpus.val]).tolist()
    assert corpus.train.dtype == np.uint16 and corpus.vocab_size == 50257  # 50257 ids fit in 16 bits
    assert tokens[:2] == [15496, 995]  # "Hello", " world" in GPT-2's vocabulary
    # "A", " second", " document", ".", "\n", then the end-of-text id closing each file
    assert [i for i, t in enumerate(tokens) if t == 50256] == [len(tokens) - 7, len(tokens) - 1]


# ------------------------------------------------------------------------------------------------ saving safely
def _one_line_error(capsys, *fragments):
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    for fragment in fragments:
        assert fragment in err, err


@pytest.fixture
def no_tokenizing(monkeypatch):
    """Fails the test if the corpus is read for tokenizing: the checks must come before that work."""
    import tinygpt.tokenizer

    def refuse(*args, **kwargs):
        raise AssertionError("the corpus was tokenized before the output was checked")

    monkeypatch.setattr(tinygpt.tokenizer, "train_tokenizer", refuse)


def test_prepare_out_problems_are_one_line_before_any_tokenizing(tmp_path, training_text_file, capsys,
                                                                 no_tokenizing, monkeypatch):
    from tinygpt import fileio
    from tinygpt.cli import main

    data = ["prepare", "--data", str(training_text_file), "--no-progress", "--out"]
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps({"emb_dim": 8}))
    (tmp_path / "file").write_text("x")
    cases = [
        (mine, "already holds unrelated files, not a prepared corpus"),
        (ckpt, "already holds a tinygpt checkpoint, not a prepared corpus"),
        (tmp_path / "file", "is an existing file, not a folder"),
        (training_text_file, "is an existing file"),
        (tmp_path / "file" / "sub", "is a file, so no folder can be made under it"),
    ]
    for out, message in cases:
        assert main([*data, str(out)]) == 2
        _one_line_error(capsys, message)
    (tmp_path / "folder").mkdir()
    (tmp_path / "folder" / "a.txt").write_text("text in a folder\n")
    assert main(["prepare", "--data", str(tmp_path / "folder"), "--out", str(tmp_path / "folder" / "p")]) == 2
    _one_line_error(capsys, "lies inside the input")
    usage = fileio.shutil.disk_usage(tmp_path)
    monkeypatch.setattr(fileio.shutil, "disk_usage", lambda path: usage._replace(free=10_000))
    assert main([*data, str(tmp_path / "new")]) == 2
    _one_line_error(capsys, "free on its disk", "needed")
    assert (mine / "notes.txt").read_text() == "mine" and sorted(p.name for p in mine.iterdir()) == ["notes.txt"]
    assert not (tmp_path / "new").exists() and not (tmp_path / "folder" / "p").exists()


def test_prepare_force_and_re_prepare_keep_foreign_files(tmp_path, training_text_file, capsys):
    from tinygpt.cli import main

    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    args = ["prepare", "--data", str(training_text_file), "--no-progress", "--out", str(mine)]
    assert main([*args, "--tokenizer", "bpe:300", "--force"]) == 0
    assert sorted(p.name for p in mine.rglob("*")) == ["bpe.json", "notes.txt", "prepared.json",
                                                       "tinygpt_tokenizer.json", "tokenizer", "tokens.bin"]
    assert main([*args, "--tokenizer", "char"]) == 0  # over a corpus: no flag needed; the BPE's file goes
    assert sorted(p.name for p in mine.rglob("*")) == ["notes.txt", "prepared.json", "tinygpt_tokenizer.json",
                                                       "tokenizer", "tokens.bin"]
    assert PreparedCorpus.open(mine).header["tokenizer"]["kind"] == "char"
    assert (mine / "notes.txt").read_text() == "mine"


def test_prepare_into_the_working_directory(tmp_path, training_text_file, monkeypatch):
    (tmp_path / "here").mkdir()
    monkeypatch.chdir(tmp_path / "here")
    prepare_corpus([training_text_file], "char", ".", progress=False)
    assert sorted(p.name for p in (tmp_path / "here").iterdir()) == ["prepared.json", "tokenizer", "tokens.bin"]


def test_text_that_is_not_utf8_is_refused_with_file_and_offset(tmp_path, capsys):
    from tinygpt.cli import main

    good = tmp_path / "good.txt"
    good.write_text("plain text\n" * 50, encoding="utf-8")
    bad = tmp_path / "latin1.txt"
    bad.write_bytes(("caf\u00e9 au lait\n" * 3).encode("utf-8") + "na\u00efve\n".encode("latin-1"))
    offset = len(("caf\u00e9 au lait\n" * 3).encode("utf-8")) + 2
    for chunk_bytes in (7, 1 << 20):  # the offset is the file's, whichever block the byte falls in
        with pytest.raises(ValueError, match=f"latin1.txt is not UTF-8 text: byte 0xef at byte offset {offset}"):
            list(iter_text_chunks(bad, chunk_bytes=chunk_bytes))
    assert main(["prepare", "--data", str(good), str(bad), "--out", str(tmp_path / "out"), "--no-progress"]) == 2
    _one_line_error(capsys, "latin1.txt is not UTF-8 text", f"byte offset {offset}", "iconv")
    assert not (tmp_path / "out").exists()
