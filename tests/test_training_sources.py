"""`tinygpt prepare` on people's own data (tinygpt.training.sources): JSON Lines, Parquet, saved datasets, workers,
and bad records named by file and line with nothing written."""

import json
import sys

import numpy as np
import pytest
from conftest import one_line_error

from tinygpt.cli import main
from tinygpt.training import PreparedCorpus, prepare_corpus
from tinygpt.training.sources import find_sources, iter_documents

RECORDS = [f"document {i}: the quick brown fox {'jumps ' * (i % 7)}over the lazy dog.\nline two of {i}."
           for i in range(60)] + ["naïve café — ünïcode", ""]


def _jsonl(path, records, field="text"):
    path.write_text("".join(json.dumps({field: r, "id": i}) + "\n" for i, r in enumerate(records)), encoding="utf-8")
    return path


def _parquet(path, records, field="text", row_group_size=16):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    pq.write_table(pa.table({"id": list(range(len(records))), field: records}), path, row_group_size=row_group_size)
    return path


def _tokens(directory):
    return (directory / "tokens.bin").read_bytes()


def test_jsonl_records_are_documents_ended_by_end_of_text(tmp_path, gpt2_vocab_dir, monkeypatch):
    from tinygpt.tokenizer import gpt2_tokenizer

    monkeypatch.setenv("TINYGPT_GPT2_VOCAB", str(gpt2_vocab_dir))
    tok = gpt2_tokenizer(gpt2_vocab_dir)
    data = _jsonl(tmp_path / "d.jsonl", RECORDS, field="body")
    corpus = prepare_corpus([data], "gpt2", tmp_path / "p", text_field="body", progress=False)
    expected = [t for r in RECORDS for t in (*tok.encode(r), tok.eot_id)]
    assert np.concatenate([corpus.train, corpus.val]).tolist() == expected
    assert corpus.header["sources"][0]["format"] == "jsonl" and corpus.header["text_field"] == "body"


def test_parquet_and_saved_datasets_give_the_same_tokens_as_jsonl(tmp_path):
    datasets = pytest.importorskip("datasets")
    _jsonl(tmp_path / "d.jsonl", RECORDS)
    _parquet(tmp_path / "d.parquet", RECORDS)  # 4 row groups, read batch by batch
    datasets.Dataset.from_dict({"text": RECORDS}).save_to_disk(str(tmp_path / "saved"))
    split = datasets.Dataset.from_dict({"text": ["held out"] * 3})
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": RECORDS}), "test": split}).save_to_disk(
        str(tmp_path / "dict"))
    hub = tmp_path / "snapshot" / "data"  # a hub dataset's folder: shards of both formats
    hub.mkdir(parents=True)
    _parquet(hub / "train-00000.parquet", RECORDS[:30])
    _jsonl(hub / "train-00001.jsonl", RECORDS[30:])
    reference = prepare_corpus([tmp_path / "d.jsonl"], "bpe:300", tmp_path / "p-jsonl", progress=False)
    for name, path in (("parquet", "d.parquet"), ("saved", "saved"), ("dict", "dict"), ("hub", "snapshot")):
        corpus = prepare_corpus([tmp_path / path], "bpe:300", tmp_path / f"p-{name}", progress=False)
        assert _tokens(tmp_path / f"p-{name}") == _tokens(tmp_path / "p-jsonl"), name
        assert corpus.header["total_tokens"] == reference.header["total_tokens"]
    assert [s.format for s in find_sources([tmp_path / "snapshot"])] == ["parquet", "jsonl"]
    assert [t for t, _ in iter_documents(find_sources([tmp_path / "dict"])[0], split="test")] == ["held out"] * 3
    with pytest.raises(ValueError, match=r"no split 'valid' \(splits: train, test\)"):
        list(iter_documents(find_sources([tmp_path / "dict"])[0], split="valid"))


@pytest.mark.slow  # spawns two worker processes
def test_workers_give_byte_identical_tokens(tmp_path, training_text_file):
    _jsonl(tmp_path / "d.jsonl", RECORDS * 5)
    data = ["--data", str(training_text_file), str(tmp_path / "d.jsonl"), "--tokenizer", "bpe:300", "--no-progress"]
    assert main(["prepare", *data, "--out", str(tmp_path / "one")]) == 0
    assert main(["prepare", *data, "--out", str(tmp_path / "two"), "--workers", "2"]) == 0
    assert _tokens(tmp_path / "one") == _tokens(tmp_path / "two")
    one, two = (json.loads((tmp_path / n / "prepared.json").read_text()) for n in ("one", "two"))
    assert one == two and len(_tokens(tmp_path / "one")) > 2 * 10_000


def test_workers_split_the_corpus_into_the_same_jobs(tmp_path):
    """The pool path, in process: job boundaries and their encodings do not depend on the worker count."""
    from tinygpt.training import data as data_module

    _jsonl(tmp_path / "d.jsonl", RECORDS)
    seen = []
    original = data_module._encode

    def spy(tok, items, dtype):
        seen.append(len(items))
        return original(tok, items, dtype)

    data_module._encode = spy
    try:
        prepare_corpus([tmp_path / "d.jsonl"], "char", tmp_path / "p", chunk_bytes=200, progress=False)
    finally:
        data_module._encode = original
    assert len(seen) > 5 and sum(seen) == len(RECORDS)  # many jobs of a few records each


@pytest.mark.parametrize("content, fragment", [
    ('{"text": "fine"}\n{"text": broken}\n', "d.jsonl: line 2 is not valid JSON"),
    ('{"text": "fine"}\n\n{"body": "x"}\n', "d.jsonl: line 3: no field 'text'"),
    ('{"text": 3}\n', "d.jsonl: line 1: field 'text' is int, not text"),
    ('{"text": null}\n', "d.jsonl: line 1: field 'text' is null, not text"),
    ('["text"]\n', "d.jsonl: line 1 is a JSON list, not an object"),
    # issue 43, E15: a record nested 100,000 deep was a RecursionError traceback
    ('{"text": "fine"}\n{"text": ' + "[" * 100000 + "]" * 100000 + '}\n', "d.jsonl: line 2 is nested too deeply"),
])
def test_bad_jsonl_records_name_the_file_and_line_and_write_nothing(tmp_path, capsys, content, fragment):
    (tmp_path / "d.jsonl").write_text(content, encoding="utf-8")
    prepare_corpus([_jsonl(tmp_path / "good.jsonl", RECORDS)], "char", tmp_path / "old", progress=False)
    before = _tokens(tmp_path / "old")
    for out, tokenizer in ((tmp_path / "new", "bpe:300"), (tmp_path / "old", "char")):
        assert main(["prepare", "--data", str(tmp_path / "d.jsonl"), "--tokenizer", tokenizer, "--out", str(out),
                     "--no-progress", "--force"]) == 2
        one_line_error(capsys, fragment)
    assert not (tmp_path / "new").exists()
    assert _tokens(tmp_path / "old") == before  # an earlier corpus there is untouched
    assert PreparedCorpus.open(tmp_path / "old").header["sources"][0]["path"].endswith("good.jsonl")


def test_bad_parquet_columns_and_rows(tmp_path, capsys):
    _parquet(tmp_path / "d.parquet", RECORDS)
    _parquet(tmp_path / "nulls.parquet", ["a", "b", None, "d"], row_group_size=2)
    pa = pytest.importorskip("pyarrow")
    pytest.importorskip("pyarrow.parquet").write_table(pa.table({"text": [1, 2]}), tmp_path / "ints.parquet")
    (tmp_path / "fake.parquet").write_bytes(b"PAR1 not really")
    cases = [(["d.parquet", "--text-field", "content"], "d.parquet: no column 'content' (columns: id, text)"),
             (["nulls.parquet"], "nulls.parquet: row 3: field 'text' is null"),
             (["ints.parquet"], "ints.parquet: column 'text' holds int64, not text"),
             (["fake.parquet"], "fake.parquet: not a readable Parquet file")]
    for (name, *flags), fragment in cases:
        out = tmp_path / f"out-{name}"
        assert main(["prepare", "--data", str(tmp_path / name), *flags, "--out", str(out), "--no-progress"]) == 2
        one_line_error(capsys, fragment)
        assert not out.exists()


def test_missing_optional_packages_are_named(tmp_path, capsys, monkeypatch):
    _parquet(tmp_path / "d.parquet", RECORDS)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)  # import fails as if pyarrow were not installed
    assert main(["prepare", "--data", str(tmp_path / "d.parquet"), "--out", str(tmp_path / "o"), "--no-progress"]) == 2
    one_line_error(capsys, "needs pyarrow: pip install 'tinygpt[data]'")
    assert main(["prepare", "--data", str(tmp_path), "--workers", "0", "--out", str(tmp_path / "o")]) == 2
    one_line_error(capsys, "--workers 0 must be an integer >= 1")


def test_a_record_longer_than_the_limit_is_refused_before_it_is_parsed(tmp_path):
    """Issue 43, E15: one 200 MB record peaked at 5.4 GB; a line is read at most ``max_record_bytes`` + 1 at a time
    and a longer one is a one-line error."""
    from tinygpt.training.sources import iter_jsonl

    path = tmp_path / "d.jsonl"
    path.write_text('{"text": "short"}\n{"text": "' + "x" * 1000 + '"}\n{"text": "after"}\n', encoding="utf-8")
    texts = iter_jsonl(path, "text", max_record_bytes=100)
    assert next(texts) == "short"
    with pytest.raises(ValueError, match=r"d.jsonl: line 2 is longer than 100 bytes, the most one record may have"):
        next(texts)
    assert list(iter_jsonl(path, "text", max_record_bytes=2000)) == ["short", "x" * 1000, "after"]


@pytest.mark.parametrize("name, content, fragment", [
    ("dataset_dict.json", "[1]", "dataset_dict.json: expected a JSON object, got list"),
    ("dataset_dict.json", '{"splits": [1]}', "dataset_dict.json: 'splits' must be a list of split names"),
    ("dataset_dict.json", "{", "dataset_dict.json: not a readable JSON file"),
])
def test_a_malformed_saved_dataset_is_a_one_line_error(tmp_path, capsys, name, content, fragment):
    """Issue 43, E15: a dataset_dict.json of [1] was an AttributeError traceback."""
    folder = tmp_path / "ds"
    folder.mkdir()
    (folder / name).write_text(content, encoding="utf-8")
    assert main(["prepare", "--data", str(folder), "--out", str(tmp_path / "out"), "--no-progress"]) == 2
    one_line_error(capsys, fragment)
    assert not (tmp_path / "out").exists()
