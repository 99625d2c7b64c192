"""Prometheus metrics of the serving frontend, with vLLM's names under the `kvflow:` prefix,
so dashboards and routers built for vLLM port by a prefix change. Label: `model_name`.

Per-request figures (latencies, token counts, finish reasons) are measured here, where every
request of the HTTP and ZMQ servers passes; engine-wide ones (running, waiting, KV usage,
prefix cache, preemptions) come from the EngineStats that ride on every EngineOutputs.
"""
from __future__ import annotations

from prometheus_client import (CollectorRegistry, Counter, Gauge, Histogram,
                               disable_created_metrics)

from kvflow.ipc.messages import EngineStats, FinishReason

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0,
                    1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0)
_TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)


class Metrics:
    def __init__(self, model_name: str, registry: CollectorRegistry | None = None) -> None:
        disable_created_metrics()     # no `*_created` series (vLLM turns them off too)
        self.registry = registry or CollectorRegistry()
        labels = {"model_name": model_name}

        def counter(name: str, doc: str) -> Counter:
            return Counter(f"kvflow:{name}", doc, ["model_name"],
                           registry=self.registry).labels(**labels)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(f"kvflow:{name}", doc, ["model_name"],
                         registry=self.registry).labels(**labels)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(f"kvflow:{name}", doc, ["model_name"], buckets=buckets,
                             registry=self.registry).labels(**labels)

        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens processed.")
        self.generation_tokens = counter("generation_tokens", "Tokens generated.")
        success = Counter("kvflow:request_success", "Finished requests, by finish reason.",
                          ["model_name", "finished_reason"], registry=self.registry)
        self.finished = {r: success.labels(model_name=model_name, finished_reason=r.value)
                         for r in FinishReason}
        self.prefix_queries = counter("prefix_cache_queries",
                                      "Prompt tokens looked up in the prefix cache.")
        self.prefix_hits = counter("prefix_cache_hits",
                                   "Prompt tokens served from the prefix cache.")
        self.preemptions = counter("num_preemptions", "Requests preempted by the scheduler.")
        # Speculative decoding (vLLM's names): verifications, drafts, accepted drafts, and
        # accepted drafts by their position in the draft (acceptance per position).
        self.spec_drafts = counter("spec_decode_num_drafts",
                                   "Speculative verifications (one per drafting request and step).")
        self.spec_draft_tokens = counter("spec_decode_num_draft_tokens",
                                         "Draft tokens proposed and verified.")
        self.spec_accepted = counter("spec_decode_num_accepted_tokens",
                                     "Draft tokens accepted by the target model.")
        self.spec_per_pos = Counter("kvflow:spec_decode_num_accepted_tokens_per_pos",
                                    "Accepted draft tokens by position in the draft.",
                                    ["model_name", "position"], registry=self.registry)
        self.model_name = model_name
        self.running = gauge("num_requests_running", "Requests running in the engine.")
        self.waiting = gauge("num_requests_waiting", "Requests waiting for the engine.")
        self.kv_usage = gauge("kv_cache_usage_perc", "Share of KV cache blocks in use (0..1).")
        self.ttft = histogram("time_to_first_token_seconds", "Arrival to first token.",
                              _LATENCY_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Time between output tokens.",
                             _LATENCY_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to finish.",
                             _LATENCY_BUCKETS)
        self.queue = histogram("request_queue_time_seconds",
                               "Arrival to first scheduling in the engine.", _LATENCY_BUCKETS)
        self.request_prompt = histogram("request_prompt_tokens", "Prompt tokens per request.",
                                        _TOKEN_BUCKETS)
        self.request_generation = histogram("request_generation_tokens",
                                            "Generated tokens per request.", _TOKEN_BUCKETS)
        restarts = Counter("kvflow:engine_restarts", "Engine restarts (docs/design.md, "
                           "Self-healing), by cause: worker, engine_core, hung.",
                           ["model_name", "cause"], registry=self.registry)
        self.restarts = {c: restarts.labels(model_name=model_name, cause=c)
                         for c in ("worker", "engine_core", "hung")}
        self.resumed = counter("requests_resumed",
                               "Unfinished requests sent again to a restarted engine.")
        self.last = EngineStats()

    def record_restart(self, cause: str, num_resumed: int) -> None:
        self.restarts[cause].inc()
        self.resumed.inc(num_resumed)
        self.last = EngineStats()           # the new engine's totals start from zero
        for gauge in (self.running, self.waiting, self.kv_usage):
            gauge.set(0)                    # as `last` says (record_stats sets on change)

    def record_stats(self, stats: EngineStats) -> None:
        """Gauges from the latest stats; counters by what the engine's totals grew (each
        metric touched only when it changed: this runs for every engine output)."""
        last = self.last
        if stats.num_running != last.num_running:
            self.running.set(stats.num_running)
        if stats.num_waiting != last.num_waiting:
            self.waiting.set(stats.num_waiting)
        if stats.kv_usage != last.kv_usage:
            self.kv_usage.set(stats.kv_usage)
        for counter, now, before in (
                (self.prefix_queries, stats.prefix_cache_queries, last.prefix_cache_queries),
                (self.prefix_hits, stats.prefix_cache_hits, last.prefix_cache_hits),
                (self.preemptions, stats.num_preemptions, last.num_preemptions),
                (self.spec_drafts, stats.spec_num_drafts, last.spec_num_drafts),
                (self.spec_draft_tokens, stats.spec_num_draft_tokens,
                 last.spec_num_draft_tokens),
                (self.spec_accepted, stats.spec_num_accepted_tokens,
                 last.spec_num_accepted_tokens)):
            if now > before:
                counter.inc(now - before)
        before_pos = last.spec_accepted_per_pos
        for pos, total in enumerate(stats.spec_accepted_per_pos):
            grown = total - (before_pos[pos] if pos < len(before_pos) else 0)
            if grown > 0:
                self.spec_per_pos.labels(model_name=self.model_name, position=str(pos)).inc(
                    grown)
        self.last = stats

    def record_first_token(self, num_prompt_tokens: int, ttft: float,
                           queue_seconds: float) -> None:
        self.prompt_tokens.inc(num_prompt_tokens)
        self.ttft.observe(ttft)
        self.queue.observe(queue_seconds)

    def record_tokens(self, num_tokens: int, gap: float | None) -> None:
        """`num_tokens` new output tokens, `gap` seconds after the previous ones (None: the
        first tokens of a request)."""
        self.generation_tokens.inc(num_tokens)
        if gap is not None:
            for _ in range(num_tokens):
                self.itl.observe(gap / num_tokens)

    def record_finished(self, reason: str, num_prompt_tokens: int, num_output_tokens: int,
                        e2e: float) -> None:
        known = reason in FinishReason._value2member_map_
        self.finished[FinishReason(reason) if known else FinishReason.ERROR].inc()
        self.e2e.observe(e2e)
        self.request_prompt.observe(num_prompt_tokens)
        self.request_generation.observe(num_output_tokens)
