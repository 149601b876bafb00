"""The server's Prometheus metrics (prometheus-client, one registry per server).

The engine thread updates them after every step (`ServerMetrics.update`), from the engine's
own statistics and the runner's `usage()` / `cache_stats()`; `/metrics` renders the
registry. The tokens-per-second gauge alone is computed when it is rendered: an idle server
takes no step, and a rate set at the last step would show long after it went quiet. Every
name starts with `kvpool_`.

  kv cache     kvpool_kv_blocks_total / _used (held by a request) / _free (allocatable,
               cached ones included) / _cached_free (free, still findable by the prefix
               cache), kvpool_kv_usage_ratio (used / total)
  prefix cache kvpool_prefix_cache_queried_tokens_total, _hit_tokens_total (device hits
               and host-tier loads), kvpool_prefix_cache_hit_rate (hit / queried, since start)
  scheduler    kvpool_requests_running, kvpool_requests_waiting, kvpool_preemptions_total,
               kvpool_fault_recomputes_total (sequences released to be recomputed after a
               step that raised: no preemption, nothing ran out), kvpool_engine_steps_total,
               kvpool_prefill_tokens_total (prompt tokens computed: a prefix hit is not
               computed, recomputation after a preemption is),
               kvpool_decode_tokens_total
  requests     kvpool_requests_total{finish_reason} ("error": failed by an error while it
               was served, alone or with its step), kvpool_prompt_tokens_total,
               kvpool_cached_prompt_tokens_total, kvpool_generation_tokens_total,
               kvpool_generation_tokens_per_second (over the last 10 s, as of the scrape)
  latency      histograms kvpool_time_to_first_token_seconds, _time_per_output_token_seconds,
               _e2e_request_latency_seconds (engine-side: from the request's arrival at the
               engine)
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from kvpool.engine.engine import Engine, RequestOutput

RATE_WINDOW_S = 10.0
_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 60.0, 120.0)
_TPOT_BUCKETS = (0.002, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.0)
FINISH_REASONS = ("stop", "length", "abort", "error")


class WindowedRate:
    """Events per second over the last `window_s` seconds, as of `clock()` when asked.

    The engine thread adds, the scrape reads: a lock keeps the two from trimming the same
    deque at once."""

    def __init__(self, window_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        if window_s <= 0:
            raise ValueError(f"window_s must be positive, got {window_s}")
        self.window_s, self.clock = window_s, clock
        self._events: deque[tuple[float, int]] = deque()  # (time, count), oldest first
        self._lock = threading.Lock()

    def add(self, count: int) -> None:
        if count <= 0:
            return
        with self._lock:
            self._events.append((self.clock(), count))

    def rate(self) -> float:
        with self._lock:
            now = self.clock()
            events = self._events
            while events and events[0][0] < now - self.window_s:
                events.popleft()
            return sum(n for _, n in events) / self.window_s


class ServerMetrics:
    def __init__(
        self, model_name: str, rate_window_s: float = RATE_WINDOW_S, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.registry = registry = CollectorRegistry()
        labels = {"model_name": model_name}

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, labels.keys(), registry=registry).labels(**labels)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, labels.keys(), registry=registry).labels(**labels)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, labels.keys(), registry=registry, buckets=buckets).labels(**labels)

        self.blocks_total = gauge("kvpool_kv_blocks_total", "KV blocks in the device pool")
        self.blocks_used = gauge("kvpool_kv_blocks_used", "KV blocks held by at least one request")
        self.blocks_free = gauge("kvpool_kv_blocks_free", "KV blocks an allocation can take (cached ones included)")
        self.blocks_cached_free = gauge(
            "kvpool_kv_blocks_cached_free", "free KV blocks that the prefix cache can still hit"
        )
        self.usage_ratio = gauge("kvpool_kv_usage_ratio", "used / total KV blocks")
        self.queried = counter("kvpool_prefix_cache_queried_tokens", "prompt tokens looked up in the prefix cache")
        self.hit = counter("kvpool_prefix_cache_hit_tokens", "prompt tokens served by the prefix cache")
        self.hit_rate = gauge("kvpool_prefix_cache_hit_rate", "prefix-cache hit tokens / queried tokens since start")
        self.running = gauge("kvpool_requests_running", "requests with a sequence in the running batch")
        self.waiting = gauge("kvpool_requests_waiting", "requests waiting for admission (new or preempted)")
        self.preemptions = counter("kvpool_preemptions", "sequences preempted (their cache released)")
        self.fault_recomputes = counter(
            "kvpool_fault_recomputes", "sequences released after a step that raised, to be recomputed"
        )
        self.steps = counter("kvpool_engine_steps", "engine steps (one forward each)")
        self.prefill_tokens = counter("kvpool_prefill_tokens", "prompt tokens computed (prefix hits excluded)")
        self.decode_tokens = counter("kvpool_decode_tokens", "tokens computed one per step after the prompt")
        requests = Counter(
            "kvpool_requests", "finished requests by finish reason", [*labels, "finish_reason"], registry=registry
        )
        self.requests = {r: requests.labels(model_name=model_name, finish_reason=r) for r in FINISH_REASONS}
        self.prompt_tokens = counter("kvpool_prompt_tokens", "prompt tokens of finished requests")
        self.cached_prompt_tokens = counter(
            "kvpool_cached_prompt_tokens", "prompt tokens of finished requests served by the prefix cache"
        )
        self.generation_tokens = counter("kvpool_generation_tokens", "tokens generated (every sample)")
        self.generation_rate = WindowedRate(rate_window_s, clock)
        self.tokens_per_s = gauge(
            "kvpool_generation_tokens_per_second", f"tokens generated per second over the last {rate_window_s:g} s"
        )
        self.tokens_per_s.set_function(self.generation_rate.rate)  # computed at each scrape
        self.ttft = histogram("kvpool_time_to_first_token_seconds", "time to first token", _LATENCY_BUCKETS)
        self.tpot = histogram(
            "kvpool_time_per_output_token_seconds", "time per output token after the first", _TPOT_BUCKETS
        )
        self.e2e = histogram(
            "kvpool_e2e_request_latency_seconds", "request latency, arrival to finish", _LATENCY_BUCKETS
        )
        self._seen = {
            "steps": 0,
            "preemptions": 0,
            "fault_recomputes": 0,
            "prefill": 0,
            "decode": 0,
            "queried": 0,
            "hit": 0,
        }

    def update(self, engine: Engine, finished: list[RequestOutput], num_new_tokens: int) -> None:
        """After a step (engine thread): move the counters by what changed, set the gauges."""
        runner = engine.runner
        usage = runner.usage()
        stats = runner.cache_stats()
        self.blocks_total.set(usage.num_blocks)
        self.blocks_used.set(usage.num_held_blocks)
        self.blocks_free.set(usage.num_free_blocks)
        self.blocks_cached_free.set(stats.get("cached_free_blocks", 0))
        self.usage_ratio.set(usage.num_held_blocks / usage.num_blocks if usage.num_blocks else 0.0)
        hit = int(stats["prefix_hit_tokens"])  # host-tier loads included
        queried = int(stats["prefix_queried_tokens"])
        self.hit_rate.set(hit / queried if queried else 0.0)
        es = engine.stats
        self._advance("steps", es.num_steps, self.steps)
        self._advance("preemptions", es.num_preemptions, self.preemptions)
        self._advance("fault_recomputes", es.num_fault_recomputes, self.fault_recomputes)
        self._advance("prefill", es.num_prefill_tokens, self.prefill_tokens)
        self._advance("decode", es.num_decode_tokens, self.decode_tokens)
        self._advance("queried", queried, self.queried)
        self._advance("hit", hit, self.hit)
        self.running.set(len({s.request.request_id for s in engine.running}))
        self.waiting.set(len({s.request.request_id for s in engine.waiting}))
        self.generation_tokens.inc(num_new_tokens)
        self.generation_rate.add(num_new_tokens)
        for out in finished:
            reasons = {c.finish_reason for c in out.completions}
            if out.error is not None:
                reason = "error"
            else:
                reason = "abort" if "abort" in reasons else "stop" if reasons == {"stop"} else "length"
            self.requests[reason].inc()
            self.prompt_tokens.inc(len(out.prompt_token_ids))
            self.cached_prompt_tokens.inc(out.num_cached_tokens)
            if reason in ("abort", "error"):
                continue  # an aborted request's latencies describe the client; a failed one's, nothing
            if out.ttft_s is not None:
                self.ttft.observe(out.ttft_s)
            if out.tpot_s is not None:
                self.tpot.observe(out.tpot_s)
            if out.latency_s is not None:
                self.e2e.observe(out.latency_s)

    def _advance(self, key: str, total: int, counter: Counter) -> None:
        delta = total - self._seen[key]
        if delta > 0:
            counter.inc(delta)
        self._seen[key] = total

    def render(self) -> bytes:
        return generate_latest(self.registry)
