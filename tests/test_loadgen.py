"""The load generator's traffic and summary without a server: an in-process mock transport
answers each streamed chat completion at once, and a virtual clock (the generator's
perf_counter; a sleep moves it on) makes the times it waits for exact. References: the
seeded draws written out by hand (the chat questions, then one expovariate gap per
conversation) and numpy's percentiles."""

from __future__ import annotations

import asyncio
import json
import random
from types import SimpleNamespace

import httpx
import numpy as np
import pytest

from kvpool.server import loadgen
from kvpool.workload import chat


@pytest.fixture
def mock_server(monkeypatch):
    """(sent, wakes): each request as (its seed, its messages), in the order sent; the
    virtual time at the end of each sleep. Answers are three content chunks "a{n}-{i} "."""
    clock = [0.0]
    sent: list[tuple[int, list[dict[str, str]]]] = []
    wakes: list[float] = []
    real_sleep = asyncio.sleep

    async def sleep(delay: float, *args) -> None:
        clock[0] += max(0.0, delay)
        wakes.append(clock[0])
        await real_sleep(0)

    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        sent.append((body["seed"], body["messages"]))
        n = len(sent)
        chunks = [{"choices": [{"delta": {"content": f"a{n}-{i} "}}]} for i in range(3)]
        chunks.append({"choices": [], "usage": {"prompt_tokens": 10, "completion_tokens": 3}})
        text = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
        return httpx.Response(200, content=text.encode(), headers={"content-type": "text/event-stream"})

    real_client = httpx.AsyncClient
    monkeypatch.setattr(loadgen, "time", SimpleNamespace(perf_counter=lambda: clock[0]))
    monkeypatch.setattr(asyncio, "sleep", sleep)
    monkeypatch.setattr(httpx, "AsyncClient", lambda **kw: real_client(transport=httpx.MockTransport(handler), **kw))
    return sent, wakes


def test_conversations_start_at_the_seeded_poisson_arrivals(mock_server):
    sent, wakes = mock_server
    config = loadgen.LoadConfig("http://mock", "m", num_requests=10, turns=2, request_rate=3.0, seed=5)
    records, _ = asyncio.run(loadgen.run_load(config))
    assert len(records) == 10 and all(r.ok for r in records)
    rng = random.Random(5)
    firsts = chat.first_turns(5, rng)  # the questions are drawn first ...
    starts, t = [], 0.0
    for _ in firsts:  # ... then one exponential gap per conversation
        t += rng.expovariate(3.0)
        starts.append(t)
    assert wakes == pytest.approx(starts, rel=1e-12)  # it waited for each start, and only for them
    assert [messages for _, messages in sent if len(messages) == 2] == firsts  # in the order they started
    # each second turn re-sends its history, the answer and the first follow-up
    seconds = [messages for _, messages in sent if len(messages) == 4]
    assert sorted(firsts.index(m[:2]) for m in seconds) == list(range(5))
    for messages in seconds:
        assert messages[2]["role"] == "assistant" and messages[2]["content"].endswith("-2 ")
        assert messages[3] == {"role": "user", "content": chat.follow_up(1)}
    assert sorted(seed for seed, _ in sent) == [5 * 1_000_003 + i for i in range(10)]


def test_an_infinite_rate_starts_every_conversation_at_once(mock_server):
    sent, wakes = mock_server
    config = loadgen.LoadConfig("http://mock", "m", num_requests=6, turns=1, request_rate=float("inf"), seed=2)
    asyncio.run(loadgen.run_load(config))
    assert wakes == []  # nothing waited
    assert [m for _, m in sent] == chat.first_turns(6, random.Random(2))


def test_one_token_answers_have_no_tpot_or_itl():
    records = [
        loadgen.RequestRecord(ok=True, ttft_s=0.2, e2e_s=0.2, itl_s=[], prompt_tokens=5, completion_tokens=1)
        for _ in range(3)
    ]
    config = loadgen.LoadConfig("u", "m", 3, concurrency=1, slo_ttft_ms=500.0, slo_tpot_ms=1.0)
    row = loadgen.summarize(config, records, 1.0, {}, {})
    assert [row[k] for k in ("tpot_ms_p50", "tpot_ms_p99", "itl_ms_p50", "itl_ms_p99")] == [None] * 4
    assert row["ttft_ms_p99"] == 200.0 and row["goodput_req_s"] == 3.0


def test_summarize_against_numpy_and_the_slos():
    r = np.random.default_rng(1)
    records = [
        loadgen.RequestRecord(
            ok=i % 6 != 0,
            ttft_s=float(r.exponential(0.4)),
            e2e_s=float(1.0 + r.exponential(1.0)),
            itl_s=[float(x) for x in r.exponential(0.03, 4)],
            prompt_tokens=50,
            completion_tokens=int(r.integers(1, 20)),
            cached_tokens=10,
            error="" if i % 6 else "boom",
        )
        for i in range(60)
    ]
    config = loadgen.LoadConfig("u", "m", 60, concurrency=4, slo_ttft_ms=500.0, slo_tpot_ms=150.0)
    row = loadgen.summarize(config, records, 8.0, {}, {})
    ok = [x for x in records if x.ok]
    ttft = np.array([x.ttft_s for x in ok]) * 1e3
    tpot = np.array([x.tpot_s for x in ok if x.tpot_s is not None]) * 1e3
    itl = np.array([g for x in ok for g in x.itl_s]) * 1e3
    assert row["num_ok"] == 50 and row["num_failed"] == 10 and row["errors"] == ["boom"]
    assert row["ttft_ms_p50"] == pytest.approx(np.percentile(ttft, 50), abs=0.05)
    assert row["ttft_ms_p99"] == pytest.approx(np.percentile(ttft, 99), abs=0.05)
    assert row["tpot_ms_p99"] == pytest.approx(np.percentile(tpot, 99), abs=0.005)
    assert row["itl_ms_p50"] == pytest.approx(np.percentile(itl, 50), abs=0.005)
    good = sum(1 for x in ok if x.ttft_s <= 0.5 and (x.tpot_s is None or x.tpot_s <= 0.15))
    assert 0 < good < 50
    assert row["goodput_req_s"] == round(good / 8.0, 3)
    assert row["client_hit_rate"] == 0.2 and row["server_hit_rate"] == 0.0
