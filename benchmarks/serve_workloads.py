"""The serving benchmark's workloads beyond plain throughput: a long prompt arriving mid-decode, a shared system
prompt, multi-turn chats, and speculative decoding (issue 22's measurements). Each takes a server's URL and a
``Body`` that writes its request bodies, and returns one measurement (a dict of figures); ``benchmarks.serve``
runs them against every server, interleaved, and takes medians.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable

from .serve_driver import client, percentile, stream_request

Body = Callable[[str, int], dict[str, Any]]  # (prompt, max_tokens) -> a greedy streaming /v1/completions body
WORKLOADS = ("throughput", "long-arrival", "shared-prefix", "conversation", "speculative", "structured")


@dataclass(frozen=True)
class Sizes:
    """Every workload's sizes (full: the issue's; quick: a tiny model's 128-token context)."""

    long_prompt: int = 1000  # tokens of the prompt that arrives while streams decode
    long_streams: int = 4
    long_stream_tokens: int = 128
    long_after: int = 8  # tokens every stream has received before the long prompt is sent
    prefix_tokens: int = 512  # the shared system prompt
    prefix_clients: int = 16
    prefix_user_tokens: int = 16
    prefix_new_tokens: int = 8
    chats: int = 8
    turns: int = 4
    turn_user_tokens: int = 48
    turn_new_tokens: int = 48
    speculative_new_tokens: int = 128


QUICK_SIZES = Sizes(long_prompt=80, long_streams=2, long_stream_tokens=24, long_after=2, prefix_tokens=48,
                    prefix_clients=3, prefix_user_tokens=6, prefix_new_tokens=3, chats=2, turns=3,
                    turn_user_tokens=8, turn_new_tokens=6, speculative_new_tokens=12)

# The copy-heavy task: rewrite a given piece of code with small edits. A trained model copies most of it; prompt
# lookup drafts exactly those copies.
CODE = '''def top_p_filter(logits, p):
    """Keep the smallest set of most likely tokens whose probability sums to at least p."""
    if p >= 1.0:
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    drop_sorted = mass_before >= p
    drop = torch.zeros_like(drop_sorted).scatter_(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))
'''
COPY_PROMPT = ("# Rewrite this function with `logits` renamed to `scores` and `p` renamed to `top_p`; change "
               "nothing else.\n\n" + CODE + "\n# Rewritten:\n\ndef top_p_filter(scores, top_p):\n")


def _gaps(times: list[float]) -> list[tuple[float, float]]:
    """(start, length) of every interval between two consecutive text events (absolute times)."""
    return [(a, b - a) for a, b in zip(times, times[1:])]


async def long_arrival(url: str, body: Body, stream_prompts: list[str], long_prompt: str, sizes: Sizes,
                       timeout: float = 600.0) -> dict[str, Any]:
    """``long_streams`` streams decode; once each has ``long_after`` tokens, ``long_prompt`` arrives. Figures: the
    longest gap between two tokens of any stream from then on, the median gap before it (the step), their ratio.

    The streams ask for ``logprobs`` so that every token is an event of its own: timed by text alone, a random
    model's tokens that end inside a UTF-8 character are held back until it completes, and the longest "gap" would
    be several steps that the engine ran without a pause."""
    async with client() as http:
        records: list[dict[str, Any]] = [{} for _ in stream_prompts[:sizes.long_streams]]
        streams = [asyncio.create_task(stream_request(http, url, {**body(p, sizes.long_stream_tokens), "logprobs": 0}, r))
                   for p, r in zip(stream_prompts, records)]
        deadline = time.perf_counter() + timeout
        while any(len(r.get("times", ())) < sizes.long_after for r in records):
            if time.perf_counter() > deadline or any(s.done() for s in streams):
                break
            await asyncio.sleep(0.005)
        arrival = time.perf_counter()
        long_record = await stream_request(http, url, body(long_prompt, 4))
        await asyncio.gather(*streams)
    before, after = [], []
    for r in records:
        for start, gap in _gaps([r["started"] + t for t in r["times"]]):
            (before if start + gap <= arrival else after).append(gap)
    step = statistics.median(before) if before else None
    longest = max(after) if after else None
    return {"step_ms": None if step is None else 1e3 * step, "longest_gap_ms": None if longest is None
            else 1e3 * longest, "gap_over_step": longest / step if step and longest else None,
            "long_ttft_ms": 1e3 * long_record["ttft_s"]}


async def shared_prefix(url: str, body: Body, system_prompt: str, user_prompts: list[str], sizes: Sizes
                        ) -> dict[str, Any]:
    """One request with the system prompt first (a cache can keep it), then ``prefix_clients`` at once, each the
    system prompt + its own question. Figures: their TTFT p50 / p95."""
    async with client() as http:
        await stream_request(http, url, body(system_prompt + user_prompts[0], sizes.prefix_new_tokens))
        records = await asyncio.gather(*(stream_request(http, url, body(system_prompt + u, sizes.prefix_new_tokens))
                                         for u in user_prompts[1:sizes.prefix_clients + 1]))
    ttft = [r["ttft_s"] for r in records]
    return {"ttft_p50_ms": 1e3 * percentile(ttft, 0.5), "ttft_p95_ms": 1e3 * percentile(ttft, 0.95)}


async def conversation(url: str, body: Body, chats: list[list[str]], sizes: Sizes) -> dict[str, Any]:
    """``chats`` conversations at once, each ``turns`` turns: every turn's prompt is the whole conversation so far
    (the server's answers included) + a new user message. Figures: TTFT p50 at each turn, the last over the first."""
    async def chat(messages: list[str], http: Any) -> list[float]:
        history, ttfts = "", []
        for message in messages[:sizes.turns]:
            prompt = history + f"User: {message}\nAssistant:"
            record = await stream_request(http, url, body(prompt, sizes.turn_new_tokens))
            ttfts.append(record["ttft_s"])
            history = prompt + record["text"] + "\n"
        return ttfts

    async with client() as http:
        per_chat = await asyncio.gather(*(chat(m, http) for m in chats[:sizes.chats]))
    by_turn = [1e3 * statistics.median(t[i] for t in per_chat) for i in range(sizes.turns)]
    return {**{f"turn{i + 1}_ttft_ms": v for i, v in enumerate(by_turn)}, "last_over_first": by_turn[-1] / by_turn[0]}


async def one_stream(url: str, body: Body, prompt: str, sizes: Sizes) -> dict[str, Any]:
    """One request alone. Figures: tokens/s over the request's whole time, the draft acceptance rate when the
    server reports it (OpenAI's ``usage.completion_tokens_details.accepted/rejected_prediction_tokens``)."""
    async with client() as http:
        start = time.perf_counter()
        record = await stream_request(http, url, body(prompt, sizes.speculative_new_tokens))
        wall = time.perf_counter() - start
    details = record["usage"].get("completion_tokens_details") or {}
    accepted, rejected = details.get("accepted_prediction_tokens"), details.get("rejected_prediction_tokens")
    rate = accepted / (accepted + rejected) if accepted is not None and rejected is not None and accepted + rejected \
        else None
    return {"tokens": record["tokens"], "tokens_per_s": record["tokens"] / wall, "acceptance": rate,
            "text": record["text"]}


def offline_speculative(model: Any, prompt_ids: list[int], new_tokens: int, rounds: int) -> dict[str, dict[str, Any]]:
    """The inference engine in this process (what ``generate`` runs: one row, its paged cache), prompt lookup
    against plain decoding, interleaved over ``rounds`` (at least 3): tokens/s (median) and the acceptance rate,
    per mode. Lookup drafts up to 8 tokens (each row's controller starts at 4); prefix reuse is off, so every run
    prefills its prompt."""
    import torch

    from tinygpt.generation import GenerationConfig
    from tinygpt.inference.engine import InferenceEngine
    from tinygpt.inference.row import Row

    engines = {mode: InferenceEngine(model, max_rows=1, prefix_reuse=False, speculative_tokens=k,
                                     cache_tokens=model.config.context_length + k)  # a row, its draft on top
               for mode, k in (("lookup", 8), ("off", 0))}

    def run(mode: str, tokens: int) -> Row:
        row = engines[mode].add(Row(list(prompt_ids), GenerationConfig(max_new_tokens=tokens)))
        engines[mode].run_until_done()
        return row

    times: dict[str, list[float]] = {"lookup": [], "off": []}
    results: dict[str, Row] = {}
    model.eval()
    with torch.inference_mode():
        for mode in times:  # warm-up: the first calls build kernels per shape
            run(mode, 4)
        for r in range(max(rounds, 3)):  # in-process calls are cheap next to a server round: at least 3
            for mode in (("lookup", "off") if r % 2 == 0 else ("off", "lookup")):
                start = time.perf_counter()
                results[mode] = run(mode, new_tokens)
                times[mode].append(time.perf_counter() - start)
    new = {mode: row.tokens[row.prompt_len:] for mode, row in results.items()}
    same = new["lookup"] == new["off"]
    return {mode: {"tokens": len(new[mode]), "tokens_per_s": len(new[mode]) / statistics.median(times[mode]),
                   "acceptance": (results[mode].accepted / results[mode].drafted if results[mode].drafted else 0.0)
                   if mode == "lookup" else None, "same_tokens": same} for mode in times}
