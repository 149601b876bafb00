"""The load generator of `kvpool bench serve`: real HTTP clients (asyncio + httpx) replaying
the chat workload (kvpool/workload/chat.py, the one `kvpool run` serves) against an OpenAI-compatible
server, at a fixed concurrency or a request rate, bounded in requests and in time.

Every request is a streamed chat completion with `stream_options.include_usage`, so the
client sees each chunk as it arrives and the server's own token counts at the end:
  TTFT  request sent -> first chunk with content
  ITL   gaps between successive chunks with content (one token each, while nothing is held back)
  TPOT  (end - first content) / (completion tokens - 1), per request
  e2e   request sent -> [DONE]
A conversation's turn k + 1 (its history, the answer, a follow-up) is sent when turn k ends,
by the same client. Concurrency C: C clients, each taking the next conversation when its
last one is done. Rate R: conversations start as a Poisson process of R per second (seeded;
kvpool/workload/arrivals.py), their follow-ups as their answers arrive. Goodput: requests
within both SLOs (TTFT, TPOT) per second; percentiles and goodput as every report computes
them (kvpool/workload/metrics.py). The server's hit rate is the change of its /metrics prefix-cache counters over
the run; the client's, cached_tokens / prompt_tokens summed over the run's usage objects.

Bounded in time: no request starts after the duration limit, and the requests still in
flight `grace_s` after it are cancelled and counted as failed ("cancelled: ..."), so a run
against a server that stalls still ends with a report of what finished.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import random
import time
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import Any

import httpx

from kvpool.workload import chat
from kvpool.workload.arrivals import poisson_arrivals
from kvpool.workload.metrics import num_within_slo, p50_p99, percentile, ratio


@dataclass
class RequestRecord:
    ok: bool
    ttft_s: float = 0.0
    e2e_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    error: str = ""

    @property
    def tpot_s(self) -> float | None:
        if self.completion_tokens <= 1:
            return None
        return (self.e2e_s - self.ttft_s) / (self.completion_tokens - 1)


@dataclass(frozen=True)
class LoadConfig:
    url: str  # the server's base URL, e.g. http://127.0.0.1:8000
    model: str
    num_requests: int
    turns: int = 2
    max_tokens: int = 32
    concurrency: int | None = None  # clients; or None with a rate
    request_rate: float | None = None  # conversations per second; inf = all at once
    duration_limit_s: float = 300.0
    slo_ttft_ms: float = 1000.0
    slo_tpot_ms: float = 200.0
    seed: int = 0
    api_key: str | None = None
    temperature: float = 0.7
    top_p: float = 0.9
    grace_s: float = 60.0  # past the duration limit, for the requests in flight; then they are cancelled


def scrape(url: str) -> dict[str, float]:
    """The server's /metrics, as {sample name: value} (labels dropped: one model per server)."""
    from prometheus_client.parser import text_string_to_metric_families

    response = httpx.get(f"{url}/metrics", timeout=10.0)
    response.raise_for_status()
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            if sample.name.endswith(("_bucket", "_created")):
                continue
            key = sample.name
            if "finish_reason" in sample.labels:
                key += f"{{{sample.labels['finish_reason']}}}"
            values[key] = values.get(key, 0.0) + sample.value
    return values


async def _one_request(
    client: httpx.AsyncClient, config: LoadConfig, messages: list[dict[str, str]], seed: int
) -> tuple[RequestRecord, str]:
    body = {
        "model": config.model,
        "messages": messages,
        "max_tokens": config.max_tokens,
        "temperature": config.temperature,
        "top_p": config.top_p,
        "seed": seed,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    start = time.perf_counter()
    record = RequestRecord(ok=False)
    text: list[str] = []
    last: float | None = None
    try:
        async with client.stream("POST", f"{config.url}/v1/chat/completions", json=body, headers=headers) as r:
            if r.status_code != 200:
                detail = (await r.aread()).decode(errors="replace")[:200]
                record.error = f"HTTP {r.status_code}: {detail}"
                return record, ""
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                payload = line[6:]
                if payload == "[DONE]":
                    record.ok = not record.error
                    break
                chunk = json.loads(payload)
                if "error" in chunk:
                    record.error = chunk["error"].get("message", "error")
                    continue
                if chunk.get("usage"):
                    usage = chunk["usage"]
                    record.prompt_tokens = usage["prompt_tokens"]
                    record.completion_tokens = usage["completion_tokens"]
                    record.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
                for choice in chunk.get("choices", ()):
                    content = choice.get("delta", {}).get("content")
                    if content:
                        now = time.perf_counter()
                        if last is None:
                            record.ttft_s = now - start
                        else:
                            record.itl_s.append(now - last)
                        last = now
                        text.append(content)
    except (httpx.HTTPError, json.JSONDecodeError) as error:
        record.error = f"{type(error).__name__}: {error}"
        record.ok = False
    record.e2e_s = time.perf_counter() - start
    if last is None and record.ok:  # an empty answer: its first token was its end
        record.ttft_s = record.e2e_s
    return record, "".join(text)


async def run_load(config: LoadConfig) -> tuple[list[RequestRecord], float]:
    """Replay the workload; (one record per request sent, wall seconds)."""
    if (config.concurrency is None) == (config.request_rate is None):
        raise ValueError("give a concurrency or a request rate, not both")
    rng = random.Random(config.seed)
    num_conversations = math.ceil(config.num_requests / config.turns)
    conversations = chat.first_turns(num_conversations, rng)
    records: list[RequestRecord] = []
    budget = {"left": config.num_requests}
    seeds = itertools.count(config.seed * 1_000_003)  # one per request, in the order they are sent
    deadline = time.perf_counter() + config.duration_limit_s
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    timeout = httpx.Timeout(config.duration_limit_s + 30.0)

    async def conversation(client: httpx.AsyncClient, messages: list[dict[str, str]]) -> None:
        for turn in range(config.turns):
            if budget["left"] <= 0 or time.perf_counter() >= deadline:
                return
            budget["left"] -= 1
            try:
                record, answer = await _one_request(client, config, messages, next(seeds))
            except asyncio.CancelledError:  # still in flight at the time bound (below): it failed
                records.append(RequestRecord(ok=False, error=cancelled))
                raise
            records.append(record)
            if not record.ok:
                return
            messages = chat.next_turn(messages, answer, turn + 1)

    cancelled = (
        f"cancelled: still in flight {config.grace_s:g} s after the duration limit of {config.duration_limit_s:g} s"
    )

    async def bounded(*aws: Awaitable[None]) -> None:
        """Await them until grace_s past the deadline; what is left then is cancelled."""
        gathered = asyncio.gather(*aws)
        try:
            await asyncio.wait_for(gathered, max(0.0, deadline - time.perf_counter()) + config.grace_s)
        except TimeoutError:
            pass  # each request that was cancelled recorded itself as failed: the report says so
        finally:
            # Ctrl-C: wait_for cancels the gather and never reads its outcome (a CancelledError
            # set as its exception), which asyncio then logged with a traceback per request,
            # "_GatheringFuture exception was never retrieved", after "interrupted"
            if gathered.done() and not gathered.cancelled():
                gathered.exception()

    start = time.perf_counter()
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        if config.concurrency is not None:
            queue: asyncio.Queue[list[dict[str, str]]] = asyncio.Queue()
            for c in conversations:
                queue.put_nowait(c)

            async def worker() -> None:
                while not queue.empty() and budget["left"] > 0 and time.perf_counter() < deadline:
                    await conversation(client, queue.get_nowait())

            await bounded(*(worker() for _ in range(config.concurrency)))
        else:
            assert config.request_rate is not None
            tasks = []
            arrivals = poisson_arrivals(len(conversations), config.request_rate, rng)
            for t, c in zip(arrivals, conversations, strict=True):
                delay = start + t - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                if budget["left"] <= 0 or time.perf_counter() >= deadline:
                    break
                tasks.append(asyncio.ensure_future(conversation(client, c)))
            await bounded(*tasks)
    return records, time.perf_counter() - start


def summarize(
    config: LoadConfig, records: list[RequestRecord], wall_s: float, before: dict[str, float], after: dict[str, float]
) -> dict[str, Any]:
    ok = [r for r in records if r.ok]
    ttft = [r.ttft_s * 1e3 for r in ok]
    tpot = [r.tpot_s * 1e3 for r in ok if r.tpot_s is not None]
    itl = [gap * 1e3 for r in ok for gap in r.itl_s]
    e2e = [r.e2e_s * 1e3 for r in ok]
    good = num_within_slo(ok, config.slo_ttft_ms, config.slo_tpot_ms)
    prompt = sum(r.prompt_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    generated = sum(r.completion_tokens for r in ok)

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    queried = delta("kvpool_prefix_cache_queried_tokens_total")
    hits = delta("kvpool_prefix_cache_hit_tokens_total")
    errors = sorted({r.error for r in records if not r.ok})
    return {
        "concurrency": config.concurrency,
        "request_rate": None
        if config.request_rate is None
        else ("inf" if math.isinf(config.request_rate) else config.request_rate),
        "num_requests": len(records),
        "num_ok": len(ok),
        "num_failed": len(records) - len(ok),
        "wall_s": round(wall_s, 3),
        "requests_per_s": ratio(len(ok), wall_s, 3),
        "output_tokens_per_s": ratio(generated, wall_s, 2),
        # None where no request measured it: no answer had a second token (TPOT, ITL), or
        # none succeeded (all of them), not 0 ms
        **p50_p99("ttft_ms", ttft, 1, empty=None),
        **p50_p99("tpot_ms", tpot, 2, empty=None),
        **p50_p99("itl_ms", itl, 2, empty=None),
        "e2e_ms_p50": round(percentile(e2e, 0.5), 1) if e2e else None,
        "goodput_req_s": ratio(good, wall_s, 3),
        "slo_ttft_ms": config.slo_ttft_ms,
        "slo_tpot_ms": config.slo_tpot_ms,
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "completion_tokens": generated,
        "client_hit_rate": ratio(cached, prompt, 4),
        "server_hit_rate": ratio(hits, queried, 4),
        "server_preemptions": int(delta("kvpool_preemptions_total")),
        "errors": errors[:5],
    }
