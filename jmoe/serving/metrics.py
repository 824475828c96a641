"""Prometheus metrics of a serving engine (`GET /metrics`): requests, tokens, latencies, offload."""

from __future__ import annotations

from jmoe.serving.batcher import BatchEngine
from jmoe.serving.compiles import CompileCounter
from jmoe.serving.requests import Stream

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


def _or_nan(value) -> float:
    return float("nan") if value is None else float(value)


class EngineMetrics:
    """The engine's observer: counts what it is told, and reads gauges (queue, offload, compiles)
    when scraped. One registry per engine, so several servers in a process do not collide."""

    def __init__(self, engine: BatchEngine):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        from jmoe.api import stats

        self.registry = registry = CollectorRegistry()
        self.requests = Counter("jmoe_requests", "Finished requests", ["finish_reason"], registry=registry)
        self.prompt_tokens = Counter("jmoe_prompt_tokens", "Prompt tokens of finished requests", registry=registry)
        self.generated_tokens = Counter("jmoe_generated_tokens", "Tokens generated", registry=registry)
        self.ttft = Histogram("jmoe_time_to_first_token_seconds", "From submit to the first token",
                              buckets=LATENCY_BUCKETS, registry=registry)
        self.inter_token = Histogram("jmoe_inter_token_latency_seconds", "Between a request's tokens",
                                     buckets=LATENCY_BUCKETS, registry=registry)
        self.step_time = Histogram("jmoe_step_seconds", "One batched decode step", buckets=LATENCY_BUCKETS,
                                   registry=registry)
        Gauge("jmoe_requests_running", "Requests in the batch", registry=registry).set_function(
            lambda: engine.running)
        Gauge("jmoe_requests_waiting", "Requests in the queue (or set aside for want of KV pages)",
              registry=registry).set_function(lambda: engine.queued)
        Gauge("jmoe_kv_pages", "Pages of the KV pool", registry=registry).set_function(lambda: engine.pool.pages)
        Gauge("jmoe_kv_pages_free", "Pages of the KV pool no row and no kept prompt block holds",
              registry=registry).set_function(lambda: engine.pool.free)
        Gauge("jmoe_kv_preemptions", "Requests that gave their KV pages back to be resumed later",
              registry=registry).set_function(lambda: engine.preemptions)
        Gauge("jmoe_compiles", "XLA compilations in this process", registry=registry).set_function(CompileCounter.count)
        Gauge("jmoe_expert_hit_rate", "Expert uses found resident (offloaded models; NaN: not counted)",
              registry=registry).set_function(lambda: _or_nan(stats(engine.model).get("hit_rate")))
        Gauge("jmoe_bytes_host_to_device", "Expert bytes moved host-to-device", registry=registry).set_function(
            lambda: stats(engine.model).get("bytes_h2d") or 0)
        prefixes = engine.model.prefixes
        if prefixes is not None:  # kept prompt blocks (jmoe/decoding/prefixes.py)
            Gauge("jmoe_prefix_cache_reused_tokens", "Prompt tokens read from kept prefix blocks, not prefilled",
                  registry=registry).set_function(lambda: prefixes.stats.reused_tokens)
            Gauge("jmoe_prefix_cache_pages", "KV pages holding kept prompt blocks (rows starting with them read them)",
                  registry=registry).set_function(lambda: len(engine.prefixes.pages()) if engine.prefixes else 0)
            Gauge("jmoe_prefix_cache_hit_rate", "Prompt tokens reused / prompt tokens looked up (NaN: none yet)",
                  registry=registry).set_function(lambda: _or_nan(prefixes.stats.summary()["token_hit_rate"]))
            Gauge("jmoe_prefix_cache_hits", "Prompts that reused at least one kept block",
                  registry=registry).set_function(lambda: prefixes.stats.hits)
        self._first: set[int] = set()  # streams that have had their first token
        engine.observer = self

    def step(self, seconds: float, rows: int) -> None:
        self.step_time.observe(seconds)

    def token(self, stream: Stream, seconds: float) -> None:
        self.generated_tokens.inc()
        if id(stream) in self._first:
            self.inter_token.observe(seconds)
        else:
            self._first.add(id(stream))
            self.ttft.observe(seconds)

    def finished(self, stream: Stream) -> None:
        self._first.discard(id(stream))
        self.requests.labels(stream.finish_reason).inc()
        self.prompt_tokens.inc(stream.usage["prompt_tokens"])

    def exposition(self) -> tuple[bytes, str]:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return generate_latest(self.registry), CONTENT_TYPE_LATEST
