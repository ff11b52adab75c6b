"""Request bodies -> dataclasses; every bad field is a 400 naming it."""

from __future__ import annotations

import re

import pytest

from tinygpt.generation import GenerationConfig
from tinygpt.serving.protocol import (
    APIError, fit_max_tokens, parse_chat, parse_completion, parse_detokenize, parse_inspect, parse_json,
    parse_tokenize,
)


def test_defaults_are_openais():
    req = parse_completion({"prompt": "hi"})
    s = req.sampling
    assert (s.max_tokens, s.temperature, s.top_p, s.top_k, s.n, s.stream, s.stop) == (None, 1.0, 1.0, None, 1,
                                                                                      False, [])
    assert req.prompts == ["hi"] and req.echo is False and req.logprobs is None


@pytest.mark.parametrize("prompt, expected", [
    ("a", ["a"]), (["a", "b"], ["a", "b"]), ([1, 2], [[1, 2]]), ([[1], [2, 3]], [[1], [2, 3]]),
])
def test_the_four_prompt_forms(prompt, expected):
    assert parse_completion({"prompt": prompt}).prompts == expected


@pytest.mark.parametrize("body, param", [
    ({}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [[1], []]}, "prompt"),
    ({"prompt": [1, "a"]}, "prompt"),
    ({"prompt": "a", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "a", "max_tokens": 2.5}, "max_tokens"),
    ({"prompt": "a", "max_tokens": True}, "max_tokens"),
    ({"prompt": "a", "temperature": -1}, "temperature"),
    ({"prompt": "a", "temperature": "hot"}, "temperature"),
    ({"prompt": "a", "top_p": 0}, "top_p"),
    ({"prompt": "a", "top_k": -3}, "top_k"),
    ({"prompt": "a", "repetition_penalty": 0}, "repetition_penalty"),
    ({"prompt": "a", "n": 0}, "n"),
    ({"prompt": "a", "n": 17}, "n"),
    ({"prompt": "a", "stop": ["a"] * 5}, "stop"),
    ({"prompt": "a", "stop": [""]}, "stop"),
    ({"prompt": "a", "stop": 3}, "stop"),
    ({"prompt": "a", "stream": "yes"}, "stream"),
    ({"prompt": "a", "stream_options": {"include_usage": True}}, "stream_options"),
    ({"prompt": "a", "logprobs": 21}, "logprobs"),
    ({"prompt": "a", "presence_penalty": 1}, "presence_penalty"),
    ({"prompt": "a", "logit_bias": {"1": 5}}, "logit_bias"),
    ({"prompt": "a", "best_of": 3}, "best_of"),
    ({"prompt": "a", "suffix": "x"}, "suffix"),
    ({"prompt": "a", "mystery": 1}, "mystery"),
])
def test_bad_completion_fields(body, param):
    with pytest.raises(APIError) as err:
        parse_completion(body)
    assert err.value.status == 400 and err.value.param == param and err.value.message.startswith(param)


def test_neutral_values_of_unsupported_fields_and_no_top_k_spellings_are_accepted():
    s = parse_completion({"prompt": "a", "presence_penalty": 0, "frequency_penalty": 0.0, "logit_bias": {},
                          "top_k": -1, "best_of": 1, "user": "me"}).sampling
    assert s.top_k is None
    assert parse_completion({"prompt": "a", "top_k": 0}).sampling.top_k is None


@pytest.mark.parametrize("body, param", [
    ({"messages": "hi"}, "messages"),
    ({"messages": [{"role": "user"}]}, "messages[0].content"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id"),  # serving.structured's
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content[0]"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": []}]}, "messages[0].tool_calls"),
    ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "max_completion_tokens": 2},
     "max_completion_tokens"),
    ({"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0}, "max_completion_tokens"),
])
def test_bad_chat_fields(body, param):
    from tinygpt.serving.structured import read_chat

    with pytest.raises(APIError) as err:
        read_chat(parse_chat(body), body)  # the tool fields are read by serving.structured
    assert err.value.status == 400 and err.value.param == param


def test_chat_content_parts_and_logprobs():
    req = parse_chat({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                                {"type": "text", "text": "b"}]}],
                      "logprobs": True, "top_logprobs": 3, "max_completion_tokens": 5})
    assert req.messages == [("user", "ab")] and req.logprobs == 3 and req.sampling.max_tokens == 5
    assert req.max_tokens_param == "max_completion_tokens"
    assert parse_chat({"messages": [{"role": "user", "content": "x"}], "logprobs": True}).logprobs == 0


def test_max_tokens_must_fit_the_context_and_the_default_is_cut_to_fit():
    assert fit_max_tokens(None, 16, 10, 64) == 16
    assert fit_max_tokens(None, 16, 60, 64) == 5  # 60 + 5 - 1 = 64
    assert fit_max_tokens(None, None, 60, 64) == 5
    assert fit_max_tokens(5, None, 60, 64) == 5
    with pytest.raises(APIError, match="at most 5 fit"):
        fit_max_tokens(6, None, 60, 64)
    with pytest.raises(APIError, match="prompt: has 65 tokens, more than the model's context of 64"):
        fit_max_tokens(None, 16, 65, 64)


def test_a_scored_prompt_may_hold_one_token_more_than_the_context():
    """echo + logprobs: the C + 1-token window lm-eval's HF class scores; one new token fits after it (and after C)."""
    assert fit_max_tokens(None, 16, 65, 64, scoring=True) == 1
    assert fit_max_tokens(1, None, 65, 64, scoring=True) == 1
    assert fit_max_tokens(None, 16, 64, 64, scoring=True) == 1
    assert fit_max_tokens(None, 16, 10, 64, scoring=True) == 16
    with pytest.raises(APIError, match="at most 1 fit"):
        fit_max_tokens(2, None, 65, 64, scoring=True)
    with pytest.raises(APIError, match=r"has 66 tokens, more than the model's context of 64 tokens \(\+ 1 when"):
        fit_max_tokens(None, 16, 66, 64, scoring=True)


def test_json_tokenize_detokenize_inspect():
    with pytest.raises(APIError, match="not valid JSON"):
        parse_json(b"{")
    with pytest.raises(APIError, match="JSON object"):
        parse_json(b"[]")
    assert parse_tokenize({"prompt": "x"}) == (None, "x")
    assert parse_tokenize({"model": "m", "content": "y"}) == ("m", "y")
    with pytest.raises(APIError, match="tokens"):
        parse_detokenize({"tokens": ["a"]})
    assert parse_inspect({"text": "x"}).layer == 0
    with pytest.raises(APIError, match="text"):
        parse_inspect({"text": ""})
    with pytest.raises(APIError, match="top"):
        parse_inspect({"text": "x", "top": 0})


@pytest.mark.parametrize("raw, words", [
    (b'{"prompt": "a", "temperature": NaN}', "NaN is not a JSON number"),
    (b'{"prompt": "a", "top_p": -Infinity}', "-Infinity is not a JSON number"),
    (b'{"a": ' * 33 + b'1' + b'}' * 33, "nested more than 32 levels"),
    (b'{"seed": ' + b"1" * 21 + b'}', "21 digits"),
    (b'{"prompt": ["\\\\ud800"]}', None),  # an escaped backslash, then text: no surrogate
])
def test_json_limits(raw, words):
    if words is None:
        assert parse_json(raw) == {"prompt": ["\\ud800"]}
        return
    with pytest.raises(APIError, match=words):
        parse_json(raw)


def test_a_lone_surrogate_is_named_by_its_field():
    with pytest.raises(APIError) as err:
        parse_json(b'{"messages": [{"role": "user", "content": "\\ud800"}]}')
    assert err.value.message.startswith("messages[0].content: contains the lone surrogate '\\ud800'")


@pytest.mark.parametrize("field, value, words", [
    ("temperature", 1e-6, "0 (greedy) or a number in [1e-05, 100000]"),
    ("top_p", 1e-9, "in [1e-08, 1]"),
    ("repetition_penalty", 1e7, "in [1e-06, 1e+06]"),
    ("seed", 2 ** 63, "signed 64-bit integer"),
])
def test_sampling_ranges_are_generations(field, value, words):
    with pytest.raises(APIError) as err:
        parse_completion({"prompt": "a", field: value})
    assert err.value.param == field and words in err.value.message
    with pytest.raises(ValueError, match=re.escape(words)):
        GenerationConfig(**{field: value})


def test_stop_strings_are_limited_in_number_and_length():
    assert parse_completion({"prompt": "a", "stop": ["x" * 128] * 4}).sampling.stop == ["x" * 128] * 4
    with pytest.raises(APIError, match="at most 128 characters, got 129"):
        parse_completion({"prompt": "a", "stop": ["x" * 129]})
