"""Chat templates: rendering equals transformers' apply_chat_template; the template travels with the tokenizer
(tinygpt checkpoint, convert --to-hf, a Hugging Face folder's own); SFT writes the Alpaca one."""

from __future__ import annotations

import json
import threading
import time

import pytest
import torch

from tinygpt import GPTConfig, GPTModel, save_model
from tinygpt.alignment.data import ALPACA_CHAT_TEMPLATE, format_prompt
from tinygpt.chat_template import ChatTemplate, RenderLimits, end_of_turn, read_chat_template
from tinygpt.checkpoint import load_checkpoint_tokenizer
from tinygpt.tokenizer import ENDOFTEXT, BPETokenizer, CharTokenizer, write_hf_tokenizer

pytestmark = pytest.mark.usefixtures("one_thread")

CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
          "'<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
# Whitespace control by trim_blocks / lstrip_blocks, loop controls, tojson, bos/eos variables, raise_exception,
# transformers' {% generation %} block.
FANCY = """{{ bos_token }}
{% for message in messages %}
    {% if message['role'] not in ['system', 'user', 'assistant'] %}{{ raise_exception('bad role') }}{% endif %}
    {% if loop.first and message['role'] == 'system' %}
[SYS] {{ message['content'] | tojson }}
        {% continue %}
    {% endif %}
{{ message['role'] | upper }}: {% generation %}{{ message['content'] | trim }}{% endgeneration %}
{%- if message['role'] == 'assistant' %}{{ eos_token }}{% endif %}

{% endfor %}
{% if add_generation_prompt %}ASSISTANT:{% endif %}"""

CONVERSATIONS = [
    [{"role": "user", "content": "Name a colour."}],
    [{"role": "system", "content": "Be brief <&>."}, {"role": "user", "content": "A?"},
     {"role": "assistant", "content": "B."}, {"role": "user", "content": "  C?\n"}],
    [{"role": "user", "content": "café → naïve"}, {"role": "assistant", "content": "ok"},
     {"role": "user", "content": "again"}, {"role": "assistant", "content": "done"}],
]

TEXT = "Name a colour. Be brief. café → naïve résumé " * 8


@pytest.fixture(scope="module")
def bpe():
    return BPETokenizer.train([TEXT], 300)


@pytest.mark.parametrize("source", [ALPACA_CHAT_TEMPLATE, CHATML, FANCY], ids=["alpaca", "chatml", "fancy"])
def test_rendering_equals_transformers_apply_chat_template(tmp_path, bpe, source):
    transformers = pytest.importorskip("transformers")
    ours = bpe.with_chat_template(source)
    write_hf_tokenizer(ours, tmp_path, model_max_length=64)  # what convert --to-hf writes
    theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    assert theirs.chat_template == source
    for messages in CONVERSATIONS:
        for add in (True, False):
            expected = theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=add)
            assert ours.chat_template.render(messages, add_generation_prompt=add) == expected, (messages, add)


def test_the_alpaca_template_renders_the_sft_prompt_exactly():
    template = ChatTemplate(ALPACA_CHAT_TEMPLATE)
    assert template.render([{"role": "user", "content": "Name a colour."}]) == format_prompt("Name a colour.")
    preamble = format_prompt("x").split("\n\n")[0]
    two = template.render([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "A?"},
                           {"role": "assistant", "content": "B."}, {"role": "user", "content": "C?"}])
    assert two == (format_prompt("A?").replace(preamble, "Be brief.") + "B.\n\n"
                   + format_prompt("C?").replace(preamble + "\n\n", ""))
    assert end_of_turn(template) == ""
    assert end_of_turn(ChatTemplate(CHATML)) == "<|im_end|>"


def test_templates_are_sandboxed_and_their_errors_are_value_errors():
    with pytest.raises(ValueError, match="bad role"):
        ChatTemplate(FANCY, {"bos_token": "", "eos_token": ""}).render([{"role": "robot", "content": "x"}])
    with pytest.raises(ValueError, match="not valid Jinja"):
        ChatTemplate("{% for %}").render([])
    with pytest.raises(ValueError, match="refused"):  # the sandbox: no attribute access to Python internals
        ChatTemplate("{{ messages.__class__.__mro__ }}").render([])


def test_a_checkpoint_keeps_its_template_and_a_save_without_one_removes_it(tmp_path, bpe):
    torch.manual_seed(0)
    model = GPTModel(GPTConfig(vocab_size=bpe.vocab_size, context_length=16, emb_dim=8, n_heads=2, n_layers=1))
    save_model(model, tmp_path / "m", bpe.with_chat_template(CHATML))
    config = json.loads((tmp_path / "m" / "tokenizer_config.json").read_text(encoding="utf-8"))
    assert config == {"bos_token": ENDOFTEXT, "eos_token": ENDOFTEXT, "unk_token": ENDOFTEXT, "chat_template": CHATML}
    loaded = load_checkpoint_tokenizer(tmp_path / "m")
    assert loaded.chat_template == bpe.with_chat_template(CHATML).chat_template
    assert bpe.chat_template is None  # with_chat_template copies
    save_model(model, tmp_path / "m", bpe)
    assert not (tmp_path / "m" / "tokenizer_config.json").exists()
    assert load_checkpoint_tokenizer(tmp_path / "m").chat_template is None


def test_a_char_tokenizer_template_sees_no_special_tokens(tmp_path):
    chars = CharTokenizer("abc").with_chat_template(ALPACA_CHAT_TEMPLATE)
    assert chars.chat_template.special_tokens == {}
    chars.save(tmp_path)
    assert read_chat_template(tmp_path) == chars.chat_template


def test_read_chat_template_follows_transformers_files(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "eos_token": {"content": "<|im_end|>", "special": True}, "pad_token": None,
        "chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default", "template": CHATML}]}))
    assert read_chat_template(tmp_path) == ChatTemplate(CHATML, {"eos_token": "<|im_end|>"})
    (tmp_path / "chat_template.jinja").write_text("J", encoding="utf-8")  # current transformers' own file wins
    assert read_chat_template(tmp_path).source == "J"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": 3}))
    (tmp_path / "chat_template.jinja").unlink()
    with pytest.raises(ValueError, match="must be a string"):
        read_chat_template(tmp_path)


# ------------------------------------------------------------------------------ bounded rendering (issue 43: E1, E6)
def test_the_alpaca_template_renders_each_message_once():
    """E1: the system text opened every user turn, so a 127 KB request rendered millions of tokens."""
    system = "S" * 1000
    messages = [{"role": "system", "content": system}]
    for i in range(50):
        messages += [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]
    messages.append({"role": "user", "content": "last"})
    text = ChatTemplate(ALPACA_CHAT_TEMPLATE).render(messages)
    assert text.count(system) == 1
    assert len(text) < sum(len(m["content"]) for m in messages) + 40 * len(messages)


LOOPS = "{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}x"
HUGE = [
    ("{{ 'x' * 100000000 }}", "larger than"),
    ("{{ 9 ** 99999999 }}", "larger than"),
    ("{{ 'x'.center(100000000) }}", "more than"),
    ("{{ '%0100000000d' % 1 }}", "wider than"),
    ("{% for i in range(99999) %}{{ 'yyyyyyyyyy' }}{% endfor %}", "wrote more than"),
]


def test_a_template_is_stopped_at_its_time_limit_with_a_one_line_error():
    """E6: a template that loops hung the worker threads for good."""
    start = time.monotonic()
    with pytest.raises(ValueError, match=r"the chat template was stopped: it ran longer than its time limit "
                                         r"\(at most 0.2 s"):
        ChatTemplate(LOOPS).render([{"role": "user", "content": "x"}], limits=RenderLimits(seconds=0.2))
    assert time.monotonic() - start < 5


def test_a_cancelled_rendering_stops():
    cancelled = threading.Event()
    threading.Timer(0.1, cancelled.set).start()
    with pytest.raises(ValueError, match="cancelled"):
        ChatTemplate(LOOPS).render([{"role": "user", "content": "x"}],
                                   limits=RenderLimits(seconds=60, cancelled=cancelled))


@pytest.mark.parametrize("source, match", HUGE)
def test_a_template_is_stopped_before_it_builds_or_writes_too_much(source, match):
    with pytest.raises(ValueError, match=match):
        ChatTemplate(source).render([{"role": "user", "content": "x"}], limits=RenderLimits(max_chars=100000))


@pytest.mark.parametrize("source", ["{{ 1 // 0 }}", "{{ messages[0]['content'] + 1 }}",
                                    "{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}"])
def test_any_failure_of_a_template_is_a_value_error(source):
    """E6: failures other than jinja2's TemplateError (ZeroDivisionError, TypeError, RecursionError) were 500s."""
    with pytest.raises(ValueError, match="the chat template failed"):
        ChatTemplate(source).render([{"role": "user", "content": "x"}])
