"""Instruction and preference data: the Alpaca prompt template, JSON / JSONL loading, and entry validation.

The template is the one of LLMs-from-scratch chapter 7 (``format_input``), itself Stanford Alpaca's::

    Below is an instruction that describes a task. Write a response that appropriately completes the request.

    ### Instruction:
    {instruction}

    ### Input:
    {input}

    ### Response:
    {response}

The ``### Input:`` block is left out when ``input`` is empty. Everything up to and including ``"### Response:\\n"``
is the *prompt* (the model reads it, the loss ignores it); the response follows, then the end-of-text token.

Files are a JSON list of objects or JSONL (one object per line; errors there name the line). An instruction entry
has ``instruction``, an optional ``input`` and ``output``; a preference entry has ``instruction``, an optional
``input``, ``chosen`` and ``rejected`` (other keys, such as ``output`` beside the preference keys, are ignored).
Every error names the file, the entry (its line in a JSONL file, its 0-based index in a JSON list) and the key.
"""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from .. import checks

PREAMBLE = ("Below is an instruction that describes a task. "
            "Write a response that appropriately completes the request.")
RESPONSE_HEADER = "\n\n### Response:\n"
# The Alpaca prompt as a chat template (``tinygpt.chat_template``), the one ``tinygpt sft`` writes beside the model:
# a user message renders exactly as ``format_prompt(content)``; a system message replaces the preamble; an earlier
# (user, assistant) exchange renders as an example (prompt + response) and examples are joined by a blank line. The
# preamble (or the system text) opens the first example only: every message is rendered once, so the prompt grows
# with the conversation, not with its turns x its system text.
ALPACA_CHAT_TEMPLATE = (
    "{%- set ns = namespace(system=[]) -%}"
    "{%- for message in messages if message['role'] == 'system' -%}"
    "{%- set ns.system = ns.system + [message['content']] -%}"
    "{%- endfor -%}"
    "{{- ns.system | join('\\n') if ns.system else '" + PREAMBLE + "' -}}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'user' -%}"
    "{{- '\\n\\n### Instruction:\\n' + message['content'] -}}"
    "{%- elif message['role'] == 'assistant' -%}"
    "{{- '\\n\\n### Response:\\n' + message['content'] -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '\\n\\n### Response:\\n' -}}{%- endif -%}"
)
# The template checkpoints written before carry: the system text repeated before every user turn (recognised for its
# stop texts, ``alignment.chat.template_stop_texts``).
ALPACA_CHAT_TEMPLATE_V1 = (
    "{%- set ns = namespace(system=[], started=false) -%}"
    "{%- for message in messages if message['role'] == 'system' -%}"
    "{%- set ns.system = ns.system + [message['content']] -%}"
    "{%- endfor -%}"
    "{%- set preamble = ns.system | join('\\n') if ns.system else '" + PREAMBLE + "' -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'user' -%}"
    "{{- '\\n\\n' if ns.started else '' -}}"
    "{{- preamble + '\\n\\n### Instruction:\\n' + message['content'] -}}"
    "{%- set ns.started = true -%}"
    "{%- elif message['role'] == 'assistant' -%}"
    "{{- '\\n\\n### Response:\\n' + message['content'] -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '\\n\\n### Response:\\n' -}}{%- endif -%}"
)
SFT_KEYS = ("instruction", "output")
PREFERENCE_KEYS = ("instruction", "chosen", "rejected")


@dataclass(frozen=True)
class InstructionExample:
    """One instruction entry: the prompt's two parts and the desired response."""

    instruction: str
    input: str
    output: str

    @property
    def prompt(self) -> str:
        return format_prompt(self.instruction, self.input)


@dataclass(frozen=True)
class PreferenceExample:
    """One preference entry: a prompt, the preferred response and the dispreferred one."""

    instruction: str
    input: str
    chosen: str
    rejected: str

    @property
    def prompt(self) -> str:
        return format_prompt(self.instruction, self.input)


def format_prompt(instruction: str, input: str = "") -> str:
    """The Alpaca prompt (see the module docstring), ending with ``"### Response:\\n"``."""
    text = f"{PREAMBLE}\n\n### Instruction:\n{instruction}"
    if input:
        text += f"\n\n### Input:\n{input}"
    return text + RESPONSE_HEADER


class Records(list):
    """Entries read from a file; ``lines`` holds each one's line number when the file is JSONL (errors name the
    line there, the 0-based entry index in a JSON list)."""

    lines: list[int] | None = None

    def where(self, source: str, index: int) -> str:
        return f"{source}: line {self.lines[index]}" if self.lines else f"{source}: entry {index}"


def _where(records: Sequence[Any], source: str, index: int) -> str:
    return records.where(source, index) if isinstance(records, Records) else f"{source}: entry {index}"


def read_records(path: str | Path, limit: int | None = None) -> Records:
    """The raw entries of a JSON list file or a JSONL file (chosen by content: a file starting with ``[`` is JSON),
    the first ``limit`` of them when given."""
    checks.positive_int("limit", limit, optional=True, note="(unset: every entry)")
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ValueError(f"data file {path} does not exist") from None
    except (OSError, UnicodeDecodeError) as err:
        raise ValueError(f"{path}: cannot read the data file ({err})") from None
    if text.lstrip().startswith("["):
        try:
            records = json.loads(text)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}: not valid JSON ({err})") from None
        lines = None
    else:
        records, lines = [], []
        for number, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            lines.append(number)
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}: line {number} is not valid JSON ({err}); a JSONL file holds one object "
                                 f"per line, a JSON file one list") from None
    if not isinstance(records, list) or not records:
        raise ValueError(f"{path}: no entries" if isinstance(records, list) else
                         f"{path}: a JSON file must hold a list of entries, not a {type(records).__name__}")
    out = Records(records[:limit])
    out.lines = lines[:limit] if lines else None
    return out


def _text(record: dict[str, Any], key: str, where: str, *, required: bool, non_empty: bool) -> str:
    if key not in record:
        if required:
            raise ValueError(f"{where}: missing key {key!r}")
        return ""
    value = record[key]
    if value is None and not required:
        return ""
    if not isinstance(value, str):
        raise ValueError(f"{where}: key {key!r} must be a string, got {type(value).__name__}")
    if non_empty and not value.strip():
        what = "empty response" if key in ("output", "chosen", "rejected") else "empty text"
        raise ValueError(f"{where}: {what} in key {key!r}")
    return value


def _check_object(record: Any, where: str, keys: Sequence[str]) -> dict[str, Any]:
    if not isinstance(record, dict):
        raise ValueError(f"{where} is a {type(record).__name__}, expected an object with keys "
                         f"{', '.join(keys)} (and optionally input)")
    return record


def parse_instruction_records(records: Sequence[Any], source: str = "data") -> list[InstructionExample]:
    """Validate instruction entries; ``ValueError`` naming ``source``, the entry index and the key."""
    out = []
    for i, record in enumerate(records):
        where = _where(records, source, i)
        record = _check_object(record, where, SFT_KEYS)
        out.append(InstructionExample(
            instruction=_text(record, "instruction", where, required=True, non_empty=True),
            input=_text(record, "input", where, required=False, non_empty=False),
            output=_text(record, "output", where, required=True, non_empty=True),
        ))
    return out


def parse_preference_records(records: Sequence[Any], source: str = "data") -> list[PreferenceExample]:
    """Validate preference entries; errors as ``parse_instruction_records``. A pair whose chosen and rejected
    texts are identical states no preference (its loss has zero gradient and it can never be ranked right): it is
    left out, with a warning naming the entries (the shared data file has such a pair)."""
    out, identical = [], []
    for i, record in enumerate(records):
        where = _where(records, source, i)
        record = _check_object(record, where, PREFERENCE_KEYS)
        example = PreferenceExample(
            instruction=_text(record, "instruction", where, required=True, non_empty=True),
            input=_text(record, "input", where, required=False, non_empty=False),
            chosen=_text(record, "chosen", where, required=True, non_empty=True),
            rejected=_text(record, "rejected", where, required=True, non_empty=True),
        )
        if example.chosen == example.rejected:
            identical.append(i)
            continue
        out.append(example)
    if identical:
        warnings.warn(f"{source}: left out {len(identical)} entr{'y' if len(identical) == 1 else 'ies'} whose "
                      f"'chosen' and 'rejected' are identical (entries {', '.join(map(str, identical[:10]))}"
                      f"{', ...' if len(identical) > 10 else ''})", stacklevel=2)
    if not out:
        raise ValueError(f"{source}: no entry with different 'chosen' and 'rejected' texts")
    return out


def load_instruction_data(path: str | Path, limit: int | None = None) -> list[InstructionExample]:
    """Instruction entries of a JSON/JSONL file (the first ``limit`` when given), validated."""
    return parse_instruction_records(read_records(path, limit), str(path))


def load_preference_data(path: str | Path, limit: int | None = None) -> list[PreferenceExample]:
    """Preference entries of a JSON/JSONL file (the first ``limit`` when given), validated."""
    return parse_preference_records(read_records(path, limit), str(path))


def load_prompts(path: str | Path, limit: int | None = None) -> list[str]:
    """The Alpaca prompts of an instruction or preference file (only ``instruction`` and ``input`` are read), for
    PPO, which samples its own responses."""
    records = read_records(path, limit)
    prompts = []
    for i, record in enumerate(records):
        where = _where(records, str(path), i)
        record = _check_object(record, where, ("instruction",))
        prompts.append(format_prompt(_text(record, "instruction", where, required=True, non_empty=True),
                                     _text(record, "input", where, required=False, non_empty=False)))
    return prompts
