"""Prometheus metrics of the HTTP server: latencies as the client sees them, and the engine's
queue and streams read at scrape time. Pipeline-level figures (per-stage graph time, wire time)
register on the default registry in pipeline code; /metrics serves both."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import REGISTRY, Collector

from shardline.serving.engine import Serving

_LATENCY = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 60)


class ServerMetrics:
    def __init__(self, engine: Serving) -> None:
        self.registry = r = CollectorRegistry()
        self.ttft = Histogram("shardline_time_to_first_token_seconds", "request arrival to first token",
                              buckets=_LATENCY, registry=r)
        self.tpot = Histogram("shardline_time_per_output_token_seconds", "mean gap between output tokens",
                              buckets=_LATENCY, registry=r)
        self.e2e = Histogram("shardline_e2e_request_latency_seconds", "request arrival to last token",
                             buckets=_LATENCY, registry=r)
        # Every gap between two tokens of a running stream (its pauses, which a mean hides: a long
        # prompt arriving shows up here). Prefill against decode time: shardline_stage_graph_seconds
        # by phase (pipeline/metrics.py).
        self.gap = Histogram("shardline_token_gap_seconds", "time between consecutive tokens of a stream",
                             buckets=_LATENCY, registry=r)
        self.requests = Counter("shardline_requests", "finished requests", ["endpoint", "finish_reason"],
                                registry=r)
        self.prompt_tokens = Counter("shardline_prompt_tokens", "prompt tokens admitted", registry=r)
        self.completion_tokens = Counter("shardline_completion_tokens", "tokens generated", registry=r)
        self.rejected = Counter("shardline_rejected_requests", "requests turned away before generating",
                                ["reason"], registry=r)
        self.constrained_requests = Counter("shardline_constrained_requests",
                                            "requests whose output a grammar or JSON schema constrains", registry=r)
        self.grammar_compile = Histogram("shardline_grammar_compile_seconds",
                                         "compiling a request's grammar (cache misses only)", buckets=_LATENCY,
                                         registry=r)
        Gauge("shardline_queue_depth", "requests waiting for a stream", registry=r).set_function(
            lambda: engine.waiting)
        Gauge("shardline_active_streams", "streams holding KV state", registry=r).set_function(
            lambda: engine.active)
        r.register(SpeculationCollector(engine))
        r.register(PrefixCollector(engine))
        r.register(BlocksCollector(engine))
        Gauge("shardline_max_streams", "stream slots (bounded by memory per stream)", registry=r).set(
            engine.limits.max_streams)

    def observe(self, endpoint: str, finish: str, start: float, first: float | None, end: float, tokens: int) -> None:
        self.requests.labels(endpoint, finish).inc()
        self.completion_tokens.inc(tokens)
        self.e2e.observe(end - start)
        if first is not None:
            self.ttft.observe(first - start)
            if tokens > 1:
                self.tpot.observe((end - first) / (tokens - 1))

    def constrained(self, compile_s: float) -> None:
        """A constrained request was admitted; `compile_s` its grammar's compile time (0: cached)."""
        self.constrained_requests.inc()
        if compile_s > 0:
            self.grammar_compile.observe(compile_s)

    def render(self) -> bytes:
        return generate_latest(self.registry) + generate_latest(REGISTRY)


class SpeculationCollector(Collector):
    """Speculative decoding at scrape time: totals over every stream (ended and running), and
    each running stream's drafts offered, accepted and its last K (labelled by stream id)."""

    def __init__(self, engine: Serving) -> None:
        self.engine = engine

    def collect(self) -> Iterator[Metric]:
        running = self.engine.speculating()
        total = sum(running.values(), self.engine.spec_ended)
        drafted = CounterMetricFamily("shardline_spec_drafted_tokens", "draft tokens offered to verify steps")
        accepted = CounterMetricFamily("shardline_spec_accepted_tokens", "draft tokens the target accepted")
        steps = CounterMetricFamily("shardline_spec_verify_steps", "verify steps of speculating streams")
        drafted.add_metric([], total.drafted)
        accepted.add_metric([], total.accepted)
        steps.add_metric([], total.steps)
        yield from (drafted, accepted, steps)
        at = {name: CounterMetricFamily(f"shardline_spec_{name}_at_position", help_, labels=["position"])
              for name, help_ in (("offered", "drafts offered at each position of a verify step (0: the first)"),
                                  ("accepted", "drafts accepted at each position (a draft stands only if the ones "
                                               "before it did)"))}
        for i, (offered, kept) in enumerate(zip(total.offered_at, total.kept_at, strict=True)):
            at["offered"].add_metric([str(i)], offered)
            at["accepted"].add_metric([str(i)], kept)
        yield from at.values()
        per = {name: GaugeMetricFamily(f"shardline_spec_stream_{name}", help_, labels=["stream"])
               for name, help_ in (("drafted", "a running stream's drafts offered"),
                                   ("accepted", "a running stream's drafts accepted"),
                                   ("k", "a running stream's drafts in its last verify step"))}
        for stream, st in running.items():
            per["drafted"].add_metric([str(stream)], st.drafted)
            per["accepted"].add_metric([str(stream)], st.accepted)
            per["k"].add_metric([str(stream)], st.k)
        yield from per.values()


class PrefixCollector(Collector):
    """Prefix reuse at scrape time (serving/prefix.py): prompts that started from a kept prefix
    or not, the prompt tokens not prefilled thanks to one, and the bytes kept now."""

    def __init__(self, engine: Serving) -> None:
        self.engine = engine

    def collect(self) -> Iterator[Metric]:
        stats, held = self.engine.prefix_stats()
        for name, help_, value in (("hits", "prompts that started from a kept prefix", stats.hits),
                                   ("misses", "prompts that found no kept prefix", stats.misses),
                                   ("tokens_saved", "prompt tokens not prefilled thanks to a kept prefix",
                                    stats.tokens_saved),
                                   ("evictions", "kept prefixes evicted to stay within the budget (paged: "
                                    "cached blocks taken for new KV)", stats.evicted)):
            family = CounterMetricFamily(f"shardline_prefix_cache_{name}", help_)
            family.add_metric([], value)
            yield family
        held_bytes = GaugeMetricFamily("shardline_prefix_cache_bytes", "bytes of KV kept as prefixes (per process)")
        held_bytes.add_metric([], held)
        yield held_bytes


class BlocksCollector(Collector):
    """A paged pool's blocks at scrape time (serving/kv_blocks.py), over every paged instance:
    held by streams, cached (kept for prefix hits, evicted as new KV needs them) and free.
    Nothing on the keyed runner, whose KV is counted by stream."""

    def __init__(self, engine: Serving) -> None:
        self.engine = engine

    def collect(self) -> Iterator[Metric]:
        counts = self.engine.kv_blocks()
        if counts is None:
            return
        blocks = GaugeMetricFamily("shardline_kv_blocks", "KV blocks of the paged pool, by state", labels=["state"])
        for state, n in (("held", counts.held), ("cached", counts.cached), ("free", counts.free)):
            blocks.add_metric([state], n)
        yield blocks
        size = GaugeMetricFamily("shardline_kv_block_tokens", "tokens a KV block holds")
        size.add_metric([], counts.block_size)
        yield size
