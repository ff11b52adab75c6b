"""The batching engine: rows joining and leaving a running batch give exactly what each prompt gives alone."""

from __future__ import annotations

import random

import pytest
import torch

from inference_support import unchecked
from serving_support import Collector, offline, tiny_model, tokenizer, wait_until
from tinygpt import GenerationConfig
from tinygpt.serving.engine import EngineThread, EngineRequest, Finish, PromptLogprobs, QueueFull, Step


def _request(ids, max_tokens, sink, stop=(), logprobs=None, prompt_logprobs=False, unchecked_settings=None,
             **settings):
    settings.setdefault("eos_id", tokenizer().eot_id)
    config = unchecked(GenerationConfig(max_new_tokens=max_tokens, overflow="error", **settings),
                       **(unchecked_settings or {}))
    return EngineRequest(list(ids), config, sink, tuple(stop), logprobs, prompt_logprobs)


def _prompts(count, lo, hi, seed=0):
    rng = random.Random(seed)
    vocab = tokenizer().vocab_size
    return [[rng.randrange(vocab) for _ in range(rng.randint(lo, hi))] for _ in range(count)]


@pytest.fixture
def engine_factory(one_thread):
    engines = []

    def make(model, **options):
        engines.append(EngineThread(model, tokenizer(), **options))
        return engines[-1]

    yield make
    for engine in engines:
        engine.shutdown()


def test_rows_arriving_while_others_decode_give_the_offline_greedy_tokens(engine_factory):
    model = tiny_model()
    engine = engine_factory(model, max_batch=4, max_queue=16)
    prompts = _prompts(9, 1, 30)
    limits = [random.Random(i).randint(1, 30) for i in range(len(prompts))]
    sinks = [Collector() for _ in prompts]
    # the first arrives alone; the others join while it decodes (in two waves), more than max_batch in all
    engine.submit([_request(prompts[0], 30, sinks[0])])
    wait_until(lambda: len(sinks[0].events) >= 3, message="the first row's third token")
    engine.submit([_request(p, n, s) for p, n, s in zip(prompts[1:5], limits[1:5], sinks[1:5])])
    wait_until(lambda: sum(len(s.events) for s in sinks[1:5]) >= 6, message="the second wave decoding")
    engine.submit([_request(p, n, s) for p, n, s in zip(prompts[5:], limits[5:], sinks[5:])])
    for s in sinks:
        s.wait()
    limits[0] = 30
    for p, n, s in zip(prompts, limits, sinks):
        expected = offline(model, p, n)
        assert s.tokens == expected
        assert s.text == tokenizer().decode(expected)
        assert s.finish.reason == ("length" if len(expected) == n else "stop")
        assert (s.finish.prompt_tokens, s.finish.completion_tokens) == (len(p), n if len(expected) == n
                                                                         else len(expected) + 1)
    assert engine.max_rows_seen == 4  # the batch really was full, and never beyond max_batch


@pytest.mark.parametrize("overrides", [dict(pos_emb="rope", norm="rmsnorm", ffn="swiglu", bias=False),
                                       dict(n_kv_heads=1)])
def test_variant_models_batch_exactly_too(engine_factory, overrides):
    model = tiny_model(**overrides)
    engine = engine_factory(model, max_batch=3)
    prompts = _prompts(5, 2, 20, seed=1)
    sinks = [Collector() for _ in prompts]
    engine.submit([_request(prompts[0], 25, sinks[0])])
    wait_until(lambda: len(sinks[0].events) >= 2)
    engine.submit([_request(p, 12, s) for p, s in zip(prompts[1:], sinks[1:])])
    for p, s, n in zip(prompts, sinks, [25, 12, 12, 12, 12]):
        assert s.wait().tokens == offline(model, p, n)


def test_rows_filling_the_whole_context_come_and_go_beside_a_long_one(engine_factory):
    # C = 24: a long row keeps the batch running while rows that use the whole context come and go; every
    # change of rows re-packs the cache, which never needs more than C columns.
    model = tiny_model(context_length=24)
    engine = engine_factory(model, max_batch=2)
    long = Collector()
    engine.submit([_request(_prompts(1, 2, 2)[0], 22, long)])
    shorts = []
    for i, p in enumerate(_prompts(6, 10, 18, seed=2)):
        wait_until(lambda: not shorts or shorts[-1][1].done.is_set())
        s = Collector()
        engine.submit([_request(p, 24 - len(p) + 1, s)])
        shorts.append((p, s))
    for p, s in shorts:
        assert s.wait().tokens == offline(model, p, 24 - len(p) + 1)
    assert long.wait().tokens == offline(model, _prompts(1, 2, 2)[0], 22)


def test_seeded_sampling_repeats_whatever_else_is_in_the_batch(engine_factory):
    model = tiny_model()
    engine = engine_factory(model, max_batch=4)
    prompt = tokenizer().encode("Every effort")
    settings = dict(temperature=0.9, top_k=50, top_p=0.95, repetition_penalty=1.2, seed=7)
    alone = Collector()
    engine.submit([_request(prompt, 20, alone, **settings)])
    alone.wait()
    crowd = [Collector() for _ in range(4)]
    others = _prompts(3, 3, 12, seed=3)
    engine.submit([_request(p, 20, s, temperature=1.0) for p, s in zip(others, crowd[1:])])
    engine.submit([_request(prompt, 20, crowd[0], **settings)])
    for s in crowd:
        s.wait()
    assert crowd[0].tokens == alone.tokens == offline(model, prompt, 20, **settings)


def test_stop_text_and_eos_finish_a_row_and_the_text_stops_before_the_stop(engine_factory):
    model = tiny_model()
    engine = engine_factory(model, max_batch=2)
    prompt = tokenizer().encode("The quick")
    full = Collector()
    engine.submit([_request(prompt, 30, full)])
    text = full.wait().text
    assert len(text) > 6
    stop = text[3:6]
    cut = Collector()
    engine.submit([_request(prompt, 30, cut, stop=[stop, "never there"])])
    assert cut.wait().text == text[: text.find(stop)]
    assert cut.finish.reason == "stop"
    # an end-of-text id: take the fourth token of the full answer as the row's eos_id
    eos_id = full.tokens[3]
    first = full.tokens.index(eos_id)
    eos = Collector()
    engine.submit([_request(prompt, 30, eos, eos_id=eos_id)])
    assert eos.wait().finish.reason == "stop" and eos.tokens == full.tokens[:first]
    assert eos.text == tokenizer().decode(full.tokens[:first])
    assert eos.finish.completion_tokens == first + 1  # the eos itself is generated, counted, not shown


def test_logprobs_are_the_models_log_softmax_and_prompt_logprobs_each_position(engine_factory):
    model = tiny_model()
    engine = engine_factory(model, max_batch=2)
    prompt = tokenizer().encode("Every effort moves")
    sink = Collector()
    engine.submit([_request(prompt, 4, sink, logprobs=3, prompt_logprobs=True)])
    sink.wait()
    assert isinstance(sink.events[0], PromptLogprobs)
    ids = prompt + sink.tokens
    with torch.no_grad():
        ref = model(torch.tensor([ids]))[0].log_softmax(-1)  # [T, V]
    infos = sink.events[0].tokens + [e.token for e in sink.events if isinstance(e, Step)]
    assert [i.id for i in infos] == ids and infos[0].logprob is None
    for t in range(1, len(ids)):
        assert infos[t].logprob == pytest.approx(ref[t - 1, ids[t]].item(), abs=1e-4)
        top = ref[t - 1].topk(3)
        assert [i for i, _ in infos[t].top] == top.indices.tolist()


def test_a_cancelled_row_leaves_at_the_next_step(engine_factory):
    model = tiny_model()
    engine = engine_factory(model, max_batch=2)
    sink = Collector()
    req = _request(tokenizer().encode("The"), 60, sink)
    engine.submit([req])
    wait_until(lambda: len(sink.events) >= 2)
    req.cancel()
    sink.wait()
    assert sink.finish.reason == "cancelled" and len(sink.tokens) < 60
    wait_until(lambda: engine.load() == {"running": 0, "waiting": 0})


def test_the_queue_is_bounded_and_shutdown_cancels_what_is_left(engine_factory):
    model = tiny_model()
    engine = engine_factory(model, max_batch=1, max_queue=2)
    sinks = [Collector() for _ in range(3)]
    engine.submit([_request([1, 2], 60, sinks[0])])
    wait_until(lambda: engine.load()["running"] == 1)
    engine.submit([_request([3], 60, s) for s in sinks[1:]])
    with pytest.raises(QueueFull, match="--max-queue 2"):
        engine.submit([_request([4], 5, Collector())])
    engine.shutdown()
    for s in sinks:
        assert isinstance(s.wait().finish, Finish) and s.finish.reason in ("cancelled", "length")
    assert sinks[2].finish.reason == "cancelled"


def test_bad_settings_are_value_errors():
    with pytest.raises(ValueError, match="max_batch"):
        EngineThread(tiny_model(), tokenizer(), max_batch=0)
    with pytest.raises(ValueError, match="max_queue"):
        EngineThread(tiny_model(), tokenizer(), max_queue=-1)


def test_dtype_is_every_commands_dtype_bf16_autocast_on_the_engines_thread(engine_factory):
    model = tiny_model()
    seen = []
    model.register_forward_pre_hook(lambda module, args: seen.append(torch.is_autocast_enabled("cpu")))
    for dtype, autocast_on in (("float32", False), ("bfloat16", True)):
        seen.clear()
        sink = Collector()
        engine_factory(model, dtype=dtype).submit([_request(_prompts(1, 4, 4)[0], 3, sink)])
        sink.wait()
        assert sink.finish is not None and seen and set(seen) == {autocast_on}
    assert next(model.parameters()).dtype == torch.float32  # autocast: the weights stay float32
    with pytest.raises(ValueError, match="dtype='fp16' is not allowed"):
        EngineThread(model, tokenizer(), dtype="fp16")


class _FailingSink(Collector):
    """Raises on its third event, as a sink whose client went away mid-stream."""

    def __call__(self, event):
        super().__call__(event)
        if len(self.events) == 3:
            raise ConnectionError("the client went away")


def test_rows_that_fail_finish_alone_and_every_request_gets_an_answer(engine_factory):
    model = tiny_model()
    engine = engine_factory(model, max_batch=4, max_queue=16, token_budget=6)
    prompts = _prompts(5, 3, 14, seed=4)
    good = [Collector() for _ in prompts]
    engine.submit([_request(p, 12, s) for p, s in zip(prompts[:2], good[:2])])
    wait_until(lambda: len(good[0].events) >= 2, message="the batch running")
    # values that fail on the engine (refused at the edge and by GenerationConfig; set past that): a seed torch
    # refuses, a temperature that makes the probabilities inf, and a sink that raises; they join a running batch
    # beside well-behaved rows
    bad_seed, bad_temperature, bad_sink = Collector(), Collector(), _FailingSink()
    engine.submit([_request(prompts[2], 12, good[2]),
                   _request([5, 6, 7], 8, bad_seed, temperature=0.8, unchecked_settings=dict(seed=2 ** 70)),
                   _request([8, 9], 8, bad_temperature, temperature=1.0, unchecked_settings=dict(temperature=1e-40)),
                   _request(prompts[3], 12, bad_sink),
                   _request(prompts[4], 12, good[4])])
    for s in good[:3] + good[4:] + [bad_seed, bad_temperature]:
        s.wait()
    wait_until(lambda: engine.load() == {"running": 0, "waiting": 0}, message="every row gone")
    assert bad_seed.finish.reason == "error" and bad_seed.tokens == []
    assert bad_temperature.finish.reason == "error" and "probability" in bad_temperature.finish.message
    assert bad_sink.finish.reason == "error" and len(bad_sink.tokens) == 3  # nothing after the failed delivery
    for p, s in zip(prompts[:3] + prompts[4:], good[:3] + good[4:]):
        assert s.tokens == offline(model, p, 12)
    assert engine.core.blocks.all_free()


def test_a_shared_prefix_is_computed_once_and_changes_no_token(engine_factory):
    model = tiny_model()
    engine = engine_factory(model, max_batch=4, max_queue=16)
    system = _prompts(1, 40, 40, seed=5)[0]
    first = Collector()
    engine.submit([_request(system + [7, 8], 6, first)])
    first.wait()
    turns = [system + tail for tail in ([9], [10, 11], [12, 13, 14])]
    sinks = [Collector() for _ in turns]
    engine.submit([_request(t, 6, s) for t, s in zip(turns, sinks)])
    for t, s in zip(turns, sinks):
        assert s.wait().tokens == offline(model, t, 6)
    assert engine.core.blocks.hits >= 3 * 32  # each newcomer took the system prompt's two full blocks


def test_prompt_logprobs_are_the_cores_scoring_rows_under_the_token_budget(engine_factory):
    """echo + logprobs: the prompt is scored by a scoring row of the core, prefilled in chunks of the token budget
    (no forward of its own), before the generation row joins; a one-token prompt has nothing to score."""
    model = tiny_model()
    engine = engine_factory(model, max_batch=2, token_budget=4)
    prompt = _prompts(1, 13, 13, seed=3)[0]
    sink, single = Collector(), Collector()
    engine.submit([_request(prompt, 2, sink, logprobs=1, prompt_logprobs=True),
                   _request(prompt[:1], 2, single, prompt_logprobs=True)])
    sink.wait()
    single.wait()
    assert engine.steps >= 12 // 4  # 12 scored positions, at most 4 tokens per forward
    with torch.no_grad():
        ref = model(torch.tensor([prompt]))[0].log_softmax(-1)  # [P, V]
    scored = sink.events[0].tokens
    assert [t.id for t in scored] == prompt and scored[0].logprob is None
    for t in range(1, len(prompt)):
        assert scored[t].logprob == pytest.approx(ref[t - 1, prompt[t]].item(), abs=1e-4)
        assert scored[t].top[0][0] == int(ref[t - 1].argmax())
    assert isinstance(single.events[0], PromptLogprobs) and [t.id for t in single.events[0].tokens] == prompt[:1]
    assert sink.finish.reason == "length" and len(sink.tokens) == 2
    assert engine.core.blocks.all_free()
