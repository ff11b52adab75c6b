"""The per-row hook in the engine's sampling: a mask before every draw, tokens forced after a drawn one.

Each claim is checked against a written-out reference decoding loop (the full uncached forward over the whole
sequence at every step), so the engine's cached, batched path must agree with it token for token."""

from __future__ import annotations

import pytest
import torch

from inference_support import variant_model
from tinygpt import GenerationConfig, generate
from tinygpt.inference.constraint import masked_logits
from tinygpt.inference.engine import InferenceEngine
from tinygpt.inference.row import Row


class EvenOnly:
    """Allows even token ids only; forces ``force`` after every drawn multiple of 4; done after ``done_after``."""

    def __init__(self, vocab: int, force: list[int] = (), done_after: int | None = None) -> None:
        self.mask = torch.arange(vocab) % 2 == 0
        self.force, self.done_after, self.drawn = list(force), done_after, []

    def allowed(self) -> torch.Tensor:
        return self.mask

    def advance(self, token: int) -> list[int]:
        self.drawn.append(token)
        return list(self.force) if token % 4 == 0 else []

    def is_done(self) -> bool:
        return self.done_after is not None and len(self.drawn) >= self.done_after


def _reference(model, prompt: list[int], steps: int, force: list[int]) -> tuple[list[int], list[bool]]:
    """Greedy over even ids by the full forward, forcing ``force`` after each drawn multiple of 4."""
    seq, new, forced = list(prompt), [], []
    with torch.no_grad():
        while len(new) < steps:
            logits = model(torch.tensor([seq]))[0, -1]  # [V]
            logits[1::2] = float("-inf")
            token = int(logits.argmax())
            seq.append(token), new.append(token), forced.append(False)
            if token % 4 == 0:
                for f in force[:steps - len(new)]:
                    seq.append(f), new.append(f), forced.append(True)
    return new, forced


@pytest.mark.parametrize("variant", ["gpt2", "llama"])
def test_masked_and_forced_tokens_equal_the_written_out_loop(variant):
    model = variant_model(variant).eval()
    prompts = [[1, 2, 3, 5], [7, 11, 13], [17]]
    force = [9, 21, 33]  # odd ids: the mask would never allow them, so only forcing can put them there
    result = generate(model, prompts, max_new_tokens=12,
                      constraints=[EvenOnly(53, force), None, EvenOnly(53, force)])
    plain = generate(model, [prompts[1]], max_new_tokens=12).rows()[0]
    assert result.rows()[1] == plain  # an unconstrained neighbour is untouched
    assert result.forced[1] == [False] * 12
    for i in (0, 2):
        want, want_forced = _reference(model, prompts[i], 12, force)
        assert result.rows()[i] == want
        assert result.forced[i] == want_forced
    assert any(any(f) for f in result.forced)  # the test forced something


def test_sampled_rows_draw_only_allowed_tokens():
    model = variant_model("gpt2").eval()
    cfg = GenerationConfig(max_new_tokens=20, temperature=1.5, seed=3)
    out = generate(model, [[1, 2], [3, 4]], cfg, constraints=[EvenOnly(53), EvenOnly(53)]).rows()
    assert all(t % 2 == 0 for row in out for t in row)
    free = generate(model, [[1, 2], [3, 4]], cfg).rows()
    assert any(t % 2 for row in free for t in row)  # without the mask the same seed draws odd ids


def test_is_done_ends_the_row_with_stop_and_forced_tokens_count_against_the_length():
    model = variant_model("gpt2").eval()
    out = generate(model, [[1, 2, 3]], max_new_tokens=10, constraints=[EvenOnly(53, done_after=3)])
    assert out.finish_reasons == ["stop"] and sum(not f for f in out.forced[0]) == 3
    capped = generate(model, [[1, 2, 3]], max_new_tokens=2, constraints=[EvenOnly(53, force=[9] * 10)])
    assert capped.lengths == [2] and capped.finish_reasons == ["length"]


class Nothing(EvenOnly):
    def allowed(self) -> torch.Tensor:
        return torch.zeros(53, dtype=torch.bool)


def test_a_mask_that_allows_nothing_fails_its_row_alone():
    model = variant_model("gpt2").eval()
    engine = InferenceEngine(model, max_rows=2)
    cfg = GenerationConfig(max_new_tokens=5)
    bad = engine.add(Row([1, 2], cfg, constraint=Nothing(53)))
    good = engine.add(Row([1, 2], cfg))
    engine.run_until_done()
    assert bad.finish_reason == "error" and "allows no token" in bad.error
    assert good.finish_reason == "length" and good.tokens[2:] == generate(model, [[1, 2]], cfg).rows()[0]


def test_constrained_rows_never_draft():
    model = variant_model("gpt2").eval()
    engine = InferenceEngine(model, max_rows=1, speculative_tokens=4)
    row = engine.add(Row([2, 4, 2, 4, 2, 4], GenerationConfig(max_new_tokens=8), constraint=EvenOnly(53)))
    engine.run_until_done()
    assert row.drafted == 0 and len(row.tokens) == 14


def test_masked_logits_checks_its_mask():
    logits = torch.zeros(5)
    assert masked_logits(logits, None) is logits
    out = masked_logits(logits, torch.tensor([True, False, True]))  # shorter: the padding stays disallowed
    assert out.tolist() == [0.0, float("-inf"), 0.0, float("-inf"), float("-inf")]
    with pytest.raises(ValueError, match="1-D bool"):
        masked_logits(logits, torch.ones(6, dtype=torch.bool))
    with pytest.raises(TypeError, match="allowed\\(\\), advance"):
        generate(variant_model("gpt2"), [[1]], max_new_tokens=1, constraints=[object()])
    with pytest.raises(ValueError, match="one per prompt"):
        generate(variant_model("gpt2"), [[1]], max_new_tokens=1, constraints=[None, None])


def test_forced_tokens_grow_the_row_across_blocks_in_a_tight_cache():
    """Blocks of 4 and a cache that holds the rows with little to spare: forced runs cross block boundaries and
    need new blocks mid-decode; a token budget of 3 cuts them into chunks."""
    model = variant_model("llama").eval()
    engine = InferenceEngine(model, max_rows=3, token_budget=3, cache_tokens=64, block_size=4)
    force = [9, 21, 33, 45, 5]
    prompts = [[1, 2, 3], [4, 6], [8, 10, 12, 14]]
    rows = [engine.add(Row(p, GenerationConfig(max_new_tokens=14), constraint=EvenOnly(53, force)))
            for p in prompts]
    engine.run_until_done()
    for p, row in zip(prompts, rows):
        assert (row.tokens[len(p):], row.forced) == _reference(model, p, 14, force)
    assert engine.blocks.num_free == engine.blocks.capacity_blocks
