"""``/metrics``: the server's state in Prometheus' text format, under vLLM's metric names.

Gateways (the Gateway API Inference Extension, llm-d), autoscalers and Grafana dashboards built for vLLM read these
names unchanged: they route on queue depth and KV-cache use and chart latency. The gauges are read from the
scheduler when Prometheus scrapes (a custom collector), so they say what the scheduler holds at that moment; the
counters and histograms are fed as rows finish, from the engine's thread (``prometheus_client`` is thread-safe).

The gauges: ``vllm:num_requests_running`` / ``_waiting`` (rows), ``vllm:kv_cache_usage_perc`` (and its older name
``vllm:gpu_cache_usage_perc``: used KV blocks over all). The counters: ``vllm:prompt_tokens`` /
``generation_tokens``, ``vllm:prefix_cache_queries`` / ``_hits`` (prompt tokens), ``vllm:request_success`` (by
``finished_reason``). The histograms: ``vllm:time_to_first_token_seconds``, ``vllm:time_per_output_token_seconds``,
``vllm:inter_token_latency_seconds``, ``vllm:e2e_request_latency_seconds`` (docs/serving.md has the table).
Every sample carries ``model_name`` (the served base's name), as vLLM's do.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# vLLM's buckets (seconds)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
                80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)


class _SchedulerGauges:
    """The gauges, read from the engine at scrape time: ``read()`` returns (running, waiting, used blocks, blocks)
    or None while the engine is not running."""

    def __init__(self, model_name: str, read: Callable[[], tuple[int, int, int, int] | None]) -> None:
        self.model_name, self.read = model_name, read

    def collect(self) -> Iterator[GaugeMetricFamily]:
        running, waiting, used, total = self.read() or (0, 0, 0, 1)
        for name, text, value in (
                ("vllm:num_requests_running", "Number of requests in model execution batches.", running),
                ("vllm:num_requests_waiting", "Number of requests waiting to be processed.", waiting),
                ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", used / total),
                ("vllm:gpu_cache_usage_perc", "KV-cache usage (the older name). 1 means 100 percent usage.",
                 used / total)):
            family = GaugeMetricFamily(name, text, labels=["model_name"])
            family.add_metric([self.model_name], value)
            yield family


class ServerMetrics:
    """One registry per app (several apps in one process never share counters)."""

    def __init__(self, model_name: str, read: Callable[[], tuple[int, int, int, int] | None]) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry()
        r, labels = self.registry, ["model_name"]
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Number of prefill tokens processed.", labels,
                                     registry=r)
        self.generation_tokens = Counter("vllm:generation_tokens", "Number of generation tokens processed.",
                                         labels, registry=r)
        self.prefix_queries = Counter("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of "
                                      "queried tokens.", labels, registry=r)
        self.prefix_hits = Counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached "
                                   "tokens.", labels, registry=r)
        self.success = Counter("vllm:request_success", "Count of successfully processed requests.",
                               [*labels, "finished_reason"], registry=r)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              labels, buckets=TTFT_BUCKETS, registry=r)
        self.tpot = Histogram("vllm:time_per_output_token_seconds", "Histogram of time per output token in "
                              "seconds.", labels, buckets=TPOT_BUCKETS, registry=r)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                             labels, buckets=TPOT_BUCKETS, registry=r)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Histogram of end to end request latency in "
                             "seconds.", labels, buckets=E2E_BUCKETS, registry=r)
        r.register(_SchedulerGauges(model_name, read))

    def row_timer(self) -> "RowTimer":
        return RowTimer(self)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class RowTimer:
    """One row's clock, from its request's arrival: ``step`` at each token event, ``finish`` at its end. Called from
    the engine's thread (the event's own moment)."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self.metrics, self.start = metrics, time.perf_counter()
        self.first: float | None = None
        self.last: float | None = None

    def step(self) -> None:
        now, m = time.perf_counter(), self.metrics
        if self.first is None:
            self.first = now
            m.ttft.labels(m.model_name).observe(now - self.start)
        else:
            m.itl.labels(m.model_name).observe(now - self.last)
        self.last = now

    def finish(self, reason: str, prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> None:
        """A row's end: its counts and its latencies ("cancelled" and "error" rows count only their tokens)."""
        now, m, name = time.perf_counter(), self.metrics, self.metrics.model_name
        m.prompt_tokens.labels(name).inc(prompt_tokens)
        m.generation_tokens.labels(name).inc(completion_tokens)
        m.prefix_queries.labels(name).inc(prompt_tokens)
        m.prefix_hits.labels(name).inc(cached_tokens)
        if reason in ("cancelled", "error"):
            return
        m.success.labels(name, reason).inc()
        m.e2e.labels(name).observe(now - self.start)
        if self.first is not None and completion_tokens > 1:
            m.tpot.labels(name).observe((now - self.first) / (completion_tokens - 1))


def scheduler_reading(engine: Any) -> tuple[int, int, int, int]:
    """(running rows, waiting rows, used KV blocks, all KV blocks) of an ``EngineThread``."""
    load = engine.load()
    blocks = engine.core.blocks
    total = blocks.capacity_blocks
    return load["running"], load["waiting"], total - blocks.num_free, total
