"""Chat messages -> the Alpaca prompt SFT trains on."""

from __future__ import annotations

import pytest

from tinygpt.alignment.data import format_prompt
from tinygpt.serving.chat_format import render_chat


def test_one_user_message_is_exactly_the_sft_prompt():
    assert render_chat([("user", "Name a colour.")]) == format_prompt("Name a colour.")


def test_earlier_turns_are_complete_examples_and_a_system_message_replaces_the_preamble():
    text = render_chat([("system", "Be brief."), ("user", "A?"), ("assistant", "B."), ("user", "C?")])
    first = format_prompt("A?").replace(format_prompt("A?").split("\n\n")[0], "Be brief.") + "B."
    last = format_prompt("C?").replace(format_prompt("C?").split("\n\n")[0], "Be brief.")
    assert text == first + "\n\n" + last


@pytest.mark.parametrize("messages, match", [
    ([("assistant", "x")], "end with a user message"),
    ([("user", "a"), ("assistant", "b")], "end with a user message"),
    ([("user", "a"), ("user", "b")], "two user messages in a row"),
    ([("system", "s")], "end with a user message"),
])
def test_bad_conversations(messages, match):
    with pytest.raises(ValueError, match=match):
        render_chat(messages)
