"""Alignment data: the Alpaca template, JSON/JSONL loading, entry validation, encoding, masking, batching."""

from __future__ import annotations

import json

import pytest

from conftest import INSTRUCTION_DATA, PREFERENCE_DATA
from tinygpt.alignment.batches import (IGNORE_INDEX, EncodedExample, batch_for_step, collate_sequences,
                                       collate_targets, encode_example, split_indices)
from tinygpt.alignment.data import (format_prompt, load_instruction_data, load_preference_data, load_prompts,
                                    parse_instruction_records, parse_preference_records)
from tinygpt.tokenizer import CharTokenizer


def test_template_matches_the_book_chapter_7_format_input():
    ch07 = pytest.importorskip("llms_from_scratch.ch07")
    with_input = {"instruction": "Rewrite the sentence.", "input": "The cat sat.", "output": "x"}
    without = {"instruction": "Name a color.", "input": "", "output": "x"}
    for entry in (with_input, without):
        assert format_prompt(entry["instruction"], entry["input"]) == ch07.format_input(entry) + "\n\n### Response:\n"


def test_loads_json_and_jsonl_alike(tmp_path):
    entries = [{"instruction": "Say hi.", "input": "", "output": "hi"},
               {"instruction": "Add.", "input": "1+1", "output": "2", "extra": 1}]
    (tmp_path / "a.json").write_text(json.dumps(entries))
    (tmp_path / "a.jsonl").write_text("\n".join(json.dumps(e) for e in entries) + "\n\n")
    assert load_instruction_data(tmp_path / "a.json") == load_instruction_data(tmp_path / "a.jsonl")
    examples = load_instruction_data(tmp_path / "a.jsonl")
    assert [e.output for e in examples] == ["hi", "2"]
    assert examples[1].prompt.endswith("### Input:\n1+1\n\n### Response:\n")
    assert load_prompts(tmp_path / "a.json") == [e.prompt for e in examples]


def test_shared_files_load():
    if not PREFERENCE_DATA.exists():
        pytest.skip(f"instruction data not found in {PREFERENCE_DATA.parent}")
    assert len(load_instruction_data(INSTRUCTION_DATA, limit=30)) == 30
    pairs = load_preference_data(PREFERENCE_DATA, limit=30)
    assert all(p.chosen != p.rejected for p in pairs)


@pytest.mark.parametrize("records, message", [
    ([{"instruction": "a", "output": "b"}, {"input": "x", "output": "y"}], r"entry 1: missing key 'instruction'"),
    ([{"instruction": "a", "output": "b"}] * 2 + [{"instruction": "a", "input": ""}], r"entry 2: missing key 'output'"),
    ([{"instruction": "a", "output": "   "}], r"entry 0: empty response in key 'output'"),
    ([{"instruction": "a", "output": 3}], r"entry 0: key 'output' must be a string, got int"),
    ([["instruction", "output"]], r"entry 0 is a list, expected an object"),
])
def test_bad_instruction_entries_are_named(records, message):
    with pytest.raises(ValueError, match=message):
        parse_instruction_records(records, "f.json")


def test_bad_preference_entries_are_named():
    good = {"instruction": "a", "chosen": "b", "rejected": "c"}
    with pytest.raises(ValueError, match=r"entry 1: missing key 'rejected'"):
        parse_preference_records([good, {"instruction": "a", "chosen": "b"}])
    with pytest.raises(ValueError, match=r"entry 0: empty response in key 'chosen'"):
        parse_preference_records([{**good, "chosen": ""}])
    with pytest.warns(UserWarning, match=r"left out 1 entry whose 'chosen' and 'rejected' are identical \(entries 1\)"):
        assert parse_preference_records([good, {**good, "rejected": "b"}]) == parse_preference_records([good])
    with pytest.raises(ValueError, match="no entry with different"), pytest.warns(UserWarning):
        parse_preference_records([{**good, "rejected": "b"}])


def test_bad_files(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"instruction": "a", "output": "b"}\n{not json}\n')
    with pytest.raises(ValueError, match="line 2 is not valid JSON"):
        load_instruction_data(bad)
    (tmp_path / "empty.json").write_text("[]")
    with pytest.raises(ValueError, match="no entries"):
        load_instruction_data(tmp_path / "empty.json")
    with pytest.raises(ValueError, match="does not exist"):
        load_instruction_data(tmp_path / "missing.json")
    (tmp_path / "object.json").write_text('  {"instruction": "a", "output": "b"}')  # JSONL with one line: fine
    assert len(load_instruction_data(tmp_path / "object.json")) == 1
    with pytest.raises(ValueError, match="limit=0 must be an integer >= 1"):
        load_instruction_data(tmp_path / "object.json", limit=0)


def test_encoding_appends_end_of_text_truncates_and_names_long_entries(alignment_tokenizer):
    tok = alignment_tokenizer
    prompt = format_prompt("Say hi.")
    p = len(tok.encode(prompt))
    e = encode_example(tok, prompt, "hi there", 200, "entry 0")
    assert e.ids == tuple(tok.encode(prompt) + tok.encode("hi there") + [tok.eot_id]) and e.prompt_len == p
    cut = encode_example(tok, prompt, "hi there", p + 1, "entry 0")
    assert cut.ids == e.ids[: p + 2]  # C + 1 tokens: C inputs, C targets
    long_response = "word " * 300
    n = len(tok.encode(long_response))
    with pytest.raises(ValueError, match=rf"entry 7: response 'output' is {n} tokens, longer than context_length=128"):
        encode_example(tok, prompt, long_response, 128, "entry 7")
    with pytest.raises(ValueError, match=rf"entry 3: the prompt is {p} tokens; with context_length={p - 1}"):
        encode_example(tok, prompt, "hi", p - 1, "entry 3")
    with pytest.raises(ValueError, match="no end-of-text token"):
        encode_example(CharTokenizer("abc"), "ab", "c", 8, "entry 0")


def test_collate_masks_prompt_and_padding_with_minus_100():
    a = EncodedExample((1, 2, 3, 4, 9), prompt_len=2)  # prompt 1 2 | response 3 4 | eot 9
    b = EncodedExample((5, 6, 7), prompt_len=2)
    inputs, targets = collate_targets([a, b], pad_id=9)
    assert inputs.tolist() == [[1, 2, 3, 4], [5, 6, 9, 9]]
    x = IGNORE_INDEX
    assert targets.tolist() == [[x, 3, 4, 9], [x, 7, x, x]]
    ids, lengths = collate_sequences([[1, 2, 3], [4]], pad_id=0)
    assert ids.tolist() == [[1, 2, 3], [4, 0, 0]] and lengths.tolist() == [3, 1]


def test_split_and_batch_order_are_seeded_and_cover_every_example():
    train, val = split_indices(20, 0.1, seed=3)
    assert len(val) == 2 and sorted(train + val) == list(range(20))
    assert split_indices(20, 0.1, seed=3) == (train, val)
    epoch = [i for step in range(3) for i in batch_for_step(18, 7, step, seed=1)]
    assert sorted(epoch) == list(range(18))  # 7 + 7 + 4: one pass over every example
    assert batch_for_step(18, 7, 3, seed=1) != batch_for_step(18, 7, 0, seed=1)  # epoch 2 is a new permutation
    assert batch_for_step(18, 7, 4, seed=1) == batch_for_step(18, 7, 4, seed=1)
    with pytest.raises(ValueError, match="val_fraction"):
        split_indices(10, 1.0, seed=0)


def test_jsonl_errors_name_the_line(tmp_path):
    path = tmp_path / "sft.jsonl"
    path.write_text('{"instruction": "a", "output": "b"}\n\n{"instruction": "a", "output": 3}\n')
    with pytest.raises(ValueError, match=r"sft.jsonl: line 3: key 'output' must be a string, got int"):
        load_instruction_data(path)
    path = tmp_path / "pairs.jsonl"
    path.write_text('{"instruction": "a", "chosen": "b", "rejected": "c"}\n{"instruction": "a", "chosen": "b"}\n')
    with pytest.raises(ValueError, match=r"pairs.jsonl: line 2: missing key 'rejected'"):
        load_preference_data(path)
