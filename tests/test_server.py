"""kvpool serve as a real process on 127.0.0.1 and a port the system picks, driven by the
official `openai` client, httpx and prometheus_client's parser."""

from __future__ import annotations

import asyncio
import json
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from types import SimpleNamespace

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from doc_blocks import ROOT, fenced_blocks
from kvpool.cache.types import CacheUsage
from kvpool.engine.engine import EngineStats
from kvpool.server.loadgen import LoadConfig, run_load, summarize
from kvpool.server.metrics import ServerMetrics

KEY = "sk-kvpool-test"
AUTH = {"Authorization": f"Bearer {KEY}"}
MODEL = "smollm2-135m"
SYSTEM = "You are a careful assistant for a museum. " + " ".join(f"Rule {i}: be precise." for i in range(12))


@pytest.fixture(scope="module")
def server():
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvpool",
            "serve",
            "--port",
            "0",
            "--api-key",
            KEY,
            "--max-seqs",
            "64",
            "--trust-tenant-header",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    line = proc.stdout.readline()
    assert "ready on " in line, proc.stderr.read()
    url = line.split("ready on ", 1)[1].split()[0]
    yield url
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "cache integrity ok, 0 blocks held" in err, err


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, timeout=120)


def metrics(url: str) -> dict[str, float]:
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics").text):
        for s in family.samples:
            key = s.name + (f"{{{s.labels['finish_reason']}}}" if "finish_reason" in s.labels else "")
            values[key] = s.value
    return values


def cache_report(url: str) -> dict:
    r = httpx.get(f"{url}/debug/cache", headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def test_completion_and_streamed_chat_equal_the_unstreamed_and_kvpool_generate(server):
    c = client(server)
    done = c.completions.create(model="smollm2-135m", prompt="The moon is", max_tokens=8, temperature=0)
    assert done.choices[0].finish_reason == "length" and done.usage.completion_tokens == 8
    assert done.choices[0].text.strip()
    messages = [{"role": "user", "content": "Name two colours of a rainbow."}]
    whole = c.chat.completions.create(model="smollm2-135m", messages=messages, max_tokens=20, temperature=0.9, seed=11)
    stream = c.chat.completions.create(
        model="smollm2-135m", messages=messages, max_tokens=20, temperature=0.9, seed=11, stream=True
    )
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert streamed == whole.choices[0].message.content and streamed
    # greedy: the server's answer is kvpool generate's. A raw prompt that shares no block with
    # anything served before, alone in the engine: the same prefill and decode batches as
    # generate's, so fp32 rounding is the same on any CPU.
    prompt = "The lighthouse keeper collected old maps and sea glass, and every evening he"
    greedy = c.completions.create(model="smollm2-135m", prompt=prompt, max_tokens=24, temperature=0)
    assert greedy.usage.prompt_tokens_details.cached_tokens == 0
    out = subprocess.run(
        [sys.executable, "-m", "kvpool", "generate", prompt, "--no-chat", "--max-tokens", "24", "--json"],
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    )
    generated = json.loads(out.stdout)
    assert generated["prompt_tokens"] == greedy.usage.prompt_tokens
    assert greedy.choices[0].finish_reason == "length" and greedy.usage.completion_tokens == 24
    assert greedy.choices[0].text == generated["text"] and greedy.choices[0].text.strip()


def test_the_serving_pages_curl_request_gets_the_answer_it_shows(server):
    """docs/serving.md's curl example: its path and body, sent twice, get the answer the page
    shows under it, and the same one both times (its "temperature": 0 decodes greedily)."""
    [(command, shown)] = [
        (body, out) for lang, body, out in fenced_blocks((ROOT / "docs" / "serving.md").read_text()) if "curl" in body
    ]
    words = shlex.split(command.replace("\\\n", " "))
    url = next(w for w in words if w.startswith("http://127.0.0.1:8000/"))
    body = json.loads(words[words.index("-d") + 1])
    assert body["temperature"] == 0 and ("-H", "Content-Type: application/json") in zip(words, words[1:], strict=False)
    path = url.removeprefix("http://127.0.0.1:8000")
    answers = [httpx.post(server + path, json=body, headers=AUTH, timeout=120) for _ in range(2)]
    assert [a.status_code for a in answers] == [200, 200], answers[0].text
    got = [a.json() for a in answers]
    assert got[0]["choices"] == got[1]["choices"]
    page = {k: json.loads(re.search(rf'"{k}":(\{{.*?\}}|"[^"]*")', shown).group(1)) for k in ("message", "model")}
    assert got[0]["choices"][0]["message"] == page["message"] and got[0]["model"] == page["model"]
    for key in ("prompt_tokens", "completion_tokens"):
        assert f'"{key}":{got[0]["usage"][key]},' in shown, key


def test_a_shared_system_prompt_hits_and_another_tenant_does_not(server):
    c = client(server)
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "When do you open?"}]
    first = c.chat.completions.create(model="smollm2-135m", messages=messages, max_tokens=2, user="tenant-a")
    again = c.chat.completions.create(model="smollm2-135m", messages=messages, max_tokens=2, user="tenant-a")
    other = c.chat.completions.create(model="smollm2-135m", messages=messages, max_tokens=2, user="tenant-b")
    header = c.chat.completions.create(
        model="smollm2-135m", messages=messages, max_tokens=2, extra_headers={"X-Tenant-Id": "tenant-c"}
    )
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert again.usage.prompt_tokens_details.cached_tokens > 0
    assert other.usage.prompt_tokens_details.cached_tokens == 0
    assert header.usage.prompt_tokens_details.cached_tokens == 0


def test_reset_prefix_cache_forgets_the_cached_prompts(server):
    """POST /reset_prefix_cache (vLLM's path; SGLang's /flush_cache): between two steps the
    engine forgets every cached prefix; the next request computes its prompt again."""
    c = client(server)
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Where is the cloakroom?"}]
    c.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, user="tenant-r")
    again = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, user="tenant-r")
    assert again.usage.prompt_tokens_details.cached_tokens > 0
    assert httpx.post(f"{server}/reset_prefix_cache", timeout=60).status_code == 401  # (the API key guards it)
    r = httpx.post(f"{server}/reset_prefix_cache", headers=AUTH, timeout=60)
    assert r.status_code == 200 and r.json() == {"reset": True}, r.text
    assert cache_report(server)["num_cached_free_blocks"] == 0
    after = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, user="tenant-r")
    assert after.usage.prompt_tokens_details.cached_tokens == 0


def test_32_streams_a_quarter_disconnecting_leave_no_block_held(server):
    before = metrics(server)

    async def one(i: int, ac: openai.AsyncOpenAI) -> tuple[str | None, int]:
        stream = await ac.chat.completions.create(
            model="smollm2-135m",
            messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"Question {i}?"}],
            max_tokens=24,
            temperature=0.8,
            seed=i,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        chunks, reason = 0, None
        async for chunk in stream:
            chunks += 1
            if chunk.choices and chunk.choices[0].finish_reason:
                reason = chunk.choices[0].finish_reason
            if i % 4 == 0 and chunks == 3:
                await stream.close()  # the client goes away mid-stream
                return "disconnected", chunks
        return reason, chunks

    async def all_clients():
        ac = openai.AsyncOpenAI(base_url=f"{server}/v1", api_key=KEY, timeout=300)
        async with ac:
            return await asyncio.gather(*(one(i, ac) for i in range(32)))

    results = asyncio.run(all_clients())
    assert [r for r, _ in results].count("disconnected") == 8
    assert all(r == "length" for i, (r, _) in enumerate(results) if i % 4)
    report = {}
    for _ in range(100):  # the aborts run before the engine's next step; the loop may still be mid-step
        report = cache_report(server)
        if report["num_requests"] == 0:
            break
        time.sleep(0.05)
    assert report["integrity"] == "ok" and report["num_used_blocks"] == 0 and report["num_requests"] == 0
    after = metrics(server)
    assert after["kvpool_kv_blocks_used"] == 0
    assert after["kvpool_kv_blocks_free"] == after["kvpool_kv_blocks_total"]
    assert after["kvpool_requests_running"] == 0 and after["kvpool_requests_waiting"] == 0
    assert after["kvpool_requests_total{abort}"] - before["kvpool_requests_total{abort}"] == 8
    assert after["kvpool_requests_total{length}"] - before["kvpool_requests_total{length}"] == 24


def test_n4_computes_the_prompt_once(server):
    c = client(server)
    before = metrics(server)
    prompt = "A list of unusual hobbies, one per line, starting with beekeeping and"
    out = c.completions.create(
        model="smollm2-135m", prompt=prompt, max_tokens=6, temperature=1.0, n=4, seed=3, extra_body={"ignore_eos": True}
    )
    after = metrics(server)
    assert sorted(ch.index for ch in out.choices) == [0, 1, 2, 3]
    assert len({ch.text for ch in out.choices}) > 1  # four samples, not one copied
    computed = after["kvpool_prefill_tokens_total"] - before["kvpool_prefill_tokens_total"]
    assert computed == out.usage.prompt_tokens - out.usage.prompt_tokens_details.cached_tokens
    assert out.usage.completion_tokens == 24


def test_logprobs_are_the_sampled_tokens(server):
    c = client(server)
    out = c.completions.create(model="smollm2-135m", prompt="One, two,", max_tokens=3, temperature=0, logprobs=2)
    lp = out.choices[0].logprobs
    assert "".join(lp.tokens) == out.choices[0].text
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert value <= 0 and max(top.values()) == pytest.approx(value)  # greedy: the top token
        assert top[token] == pytest.approx(value)


def test_completion_logprobs_always_show_the_sampled_token_and_chat_top_logprobs_0_none(server):
    """`logprobs: 0` gave top_logprobs [{}]: OpenAI documents that the sampled token's logprob is
    always there (up to logprobs + 1 entries), and vLLM answers it so. Chat's top_logprobs is the
    k most likely only: 0 is [] in both, and here."""
    c = client(server)
    for k in (0, 1):
        out = c.completions.create(model=MODEL, prompt="Once upon", max_tokens=12, temperature=1.5, seed=3, logprobs=k)
        lp = out.choices[0].logprobs
        assert len(lp.top_logprobs) == len(lp.tokens) == out.usage.completion_tokens == 12
        for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
            assert top[token] == pytest.approx(value) and 1 <= len(top) <= k + 1, (k, token, top)
        if k == 0:
            assert all(len(top) == 1 for top in lp.top_logprobs)
    out = c.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4, logprobs=True, top_logprobs=0
    )
    assert [e.top_logprobs for e in out.choices[0].logprobs.content] == [[]] * out.usage.completion_tokens


def test_bad_requests_get_openai_errors_and_disturb_nothing(server):
    c = client(server)
    running = c.chat.completions.create(
        model="smollm2-135m",
        messages=[{"role": "user", "content": "Count to twenty."}],
        max_tokens=40,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    auth = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    chat = f"{server}/v1/chat/completions"
    msgs = [{"role": "user", "content": "hi"}]
    cases = [
        ({"model": "gpt-9", "messages": msgs}, 404, "model"),  # (as OpenAI and vLLM: was 400)
        ({"messages": msgs, "max_tokens": -5}, 400, "max_tokens"),
        ({"messages": msgs, "max_tokens": 100_000}, 400, "max_tokens"),
        ({"messages": msgs, "max_completion_tokens": 100_000}, 400, "max_completion_tokens"),  # (was max_tokens)
        ({"messages": msgs, "temperature": 2.5}, 400, "temperature"),
        ({"messages": []}, 400, "messages"),
        ({"messages": [{"role": "user", "content": "word " * 7000}]}, 400, "messages"),
    ]
    for body, status, param in cases:
        r = httpx.post(chat, json=body, headers=auth, timeout=60)
        assert r.status_code == status, (body, r.text)
        error = r.json()["error"]
        assert error["param"] == param and param in error["message"] and error["type"] == "invalid_request_error"
    r = httpx.post(chat, content=b'{"messages": [', headers=auth)
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    r = httpx.post(chat, json={"messages": msgs})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.NotFoundError) as caught:
        c.chat.completions.create(model="gpt-9", messages=msgs)
    assert caught.value.code == "model_not_found" and MODEL in caught.value.message
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server}/v1", api_key="wrong").models.list()
    reasons = [ch.choices[0].finish_reason for ch in running if ch.choices and ch.choices[0].finish_reason]
    assert reasons == ["length"]


def test_metrics_parse_and_move(server):
    before = metrics(server)
    client(server).completions.create(model="smollm2-135m", prompt="Hello", max_tokens=3, temperature=0)
    after = metrics(server)
    for name in ("kvpool_engine_steps_total", "kvpool_generation_tokens_total", "kvpool_prompt_tokens_total"):
        assert after[name] > before[name], name
    assert after["kvpool_time_to_first_token_seconds_count"] == before["kvpool_time_to_first_token_seconds_count"] + 1
    assert 0 <= after["kvpool_prefix_cache_hit_rate"] <= 1


def test_health_and_models_name_the_served_model(server):
    r = httpx.get(f"{server}/health")  # open: no key needed for a probe
    assert r.status_code == 200 and r.json() == {"status": "ok"}
    r = httpx.get(f"{server}/v1/models", headers=AUTH)
    assert r.status_code == 200
    body = r.json()
    assert body["object"] == "list" and [m["id"] for m in body["data"]] == [MODEL]
    assert body["data"][0]["max_model_len"] > 0
    assert [m.id for m in client(server).models.list()] == [MODEL]


def test_a_stop_string_ends_the_text_before_it(server):
    # a prompt shorter than a block: no prefix hit, so both runs compute the same greedy tokens
    c = client(server)
    kw = {"model": MODEL, "prompt": "Monday, Tuesday, Wednesday,", "max_tokens": 16, "temperature": 0}
    full = c.completions.create(**kw, extra_body={"ignore_eos": True}).choices[0].text
    stop = full.split()[2]  # the third word: the text before it is not empty
    cut = full.find(stop)
    assert cut > 0, full
    out = c.completions.create(**kw, stop=[stop, "no such stop"], extra_body={"ignore_eos": True})
    assert out.choices[0].finish_reason == "stop"
    assert out.choices[0].text == full[:cut]
    assert out.usage.completion_tokens < 16


def test_top_p_keeps_only_the_nucleus(server):
    c = client(server)
    kw = {"model": MODEL, "prompt": "My favourite fruit is", "max_tokens": 8, "extra_body": {"ignore_eos": True}}
    greedy = c.completions.create(**kw, temperature=0).choices[0].text
    wandering = c.completions.create(**kw, temperature=1.0, top_p=1.0, seed=1).choices[0].text
    nucleus = c.completions.create(**kw, temperature=1.0, top_p=1e-6, seed=1).choices[0].text
    assert wandering != greedy  # seed 1 at temperature 1 leaves the greedy path...
    assert nucleus == greedy  # ...and a nucleus of one token keeps to it


def test_chat_logprobs_with_top_logprobs(server):
    out = client(server).chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Say hello to the museum visitors."}],
        max_tokens=5,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
        extra_body={"ignore_eos": True},
    )
    choice = out.choices[0]
    content = choice.logprobs.content
    assert len(content) == out.usage.completion_tokens == 5
    assert "".join(e.token for e in content) == choice.message.content
    for e in content:
        top = [t.logprob for t in e.top_logprobs]
        assert len(top) == 3 and top == sorted(top, reverse=True) and top[0] <= 0
        assert e.top_logprobs[0].token == e.token and e.top_logprobs[0].logprob == pytest.approx(e.logprob)  # greedy
        assert e.bytes == list(e.token.encode())


def test_a_streamed_completion_is_chunks_then_done_and_equals_the_unstreamed(server):
    url = f"{server}/v1/completions"
    body = {"model": MODEL, "prompt": "Three facts about owls:", "max_tokens": 12, "temperature": 0.9, "seed": 7}
    body["ignore_eos"] = True
    whole = httpx.post(url, json=body, headers=AUTH, timeout=120)
    assert whole.status_code == 200, whole.text
    payloads = []
    with httpx.stream("POST", url, json={**body, "stream": True}, headers=AUTH, timeout=120) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line:
                assert line.startswith("data: "), line
                payloads.append(line.removeprefix("data: "))
    assert payloads[-1] == "[DONE]" and "[DONE]" not in payloads[:-1]
    chunks = [json.loads(p) for p in payloads[:-1]]
    assert len(chunks) > 1
    assert all(ch["object"] == "text_completion" and ch["id"] == chunks[0]["id"] for ch in chunks)
    assert [ch["choices"][0]["finish_reason"] for ch in chunks] == [None] * (len(chunks) - 1) + ["length"]
    streamed = "".join(ch["choices"][0]["text"] for ch in chunks)
    assert streamed == whole.json()["choices"][0]["text"] and streamed


def test_a_completion_prompt_longer_than_the_context_gets_400_context_length_exceeded(server):
    # a 400, as OpenAI and vLLM answer it (it was a 413): the openai client raises BadRequestError,
    # which is what callers that trim a conversation on context_length_exceeded catch
    r = httpx.post(f"{server}/v1/completions", json={"prompt": "word " * 10000}, headers=AUTH, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "prompt" and error["code"] == "context_length_exceeded" and "prompt" in error["message"]
    with pytest.raises(openai.BadRequestError) as caught:
        client(server).completions.create(model=MODEL, prompt="word " * 10000)
    assert caught.value.code == "context_length_exceeded"


def test_null_sampling_fields_take_their_defaults(server):
    # OpenAI reads null as "not given"; a client library that serializes its unset options
    # as null must not get a 400
    nulls = dict.fromkeys(
        ("model", "temperature", "top_p", "top_k", "n", "seed", "stop", "stream", "stream_options", "user")
        + ("presence_penalty", "frequency_penalty", "logit_bias")
    )
    completion = {"prompt": "Once upon a time", "max_tokens": None, "logprobs": None, "echo": None}
    completion |= {"best_of": None, "suffix": None, "ignore_eos": True}
    r = httpx.post(f"{server}/v1/completions", json={**nulls, **completion}, headers=AUTH, timeout=120)
    assert r.status_code == 200, r.text
    body = r.json()
    assert len(body["choices"]) == 1 and body["choices"][0]["logprobs"] is None  # n: 1, no logprobs
    assert body["usage"]["completion_tokens"] == 16  # max_tokens: OpenAI's 16
    chat = {"messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 4, "max_completion_tokens": None}
    chat |= {"logprobs": None, "top_logprobs": None, "tools": None, "ignore_eos": True}
    r = httpx.post(f"{server}/v1/chat/completions", json={**nulls, **chat}, headers=AUTH, timeout=120)
    assert r.status_code == 200, r.text
    body = r.json()
    assert len(body["choices"]) == 1 and body["choices"][0]["logprobs"] is None
    assert body["usage"]["completion_tokens"] == 4
    r = httpx.post(f"{server}/v1/completions", json={"prompt": None}, headers=AUTH)  # a required field stays so
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text


def test_the_token_rate_falls_to_zero_once_the_server_is_idle():
    # the engine takes no step while idle: the rate must be computed when /metrics is read
    now = [100.0]
    m = ServerMetrics(MODEL, rate_window_s=2.0, clock=lambda: now[0])
    stats = {"prefix_hit_tokens": 0, "prefix_queried_tokens": 0}
    runner = SimpleNamespace(usage=lambda: CacheUsage(8, 8, 0, 0, 16), cache_stats=lambda: stats)
    engine = SimpleNamespace(runner=runner, stats=EngineStats(), running=[], waiting=[])

    def rate() -> float:
        families = text_string_to_metric_families(m.render().decode())
        return next(f for f in families if f.name == "kvpool_generation_tokens_per_second").samples[0].value

    m.update(engine, [], 6)  # t=100
    now[0] = 101.0
    m.update(engine, [], 4)
    assert rate() == 5.0  # 10 tokens in the last 2 s
    now[0] = 102.5  # no step since: the first one left the window
    assert rate() == 2.0
    now[0] = 103.5
    assert rate() == 0.0
    m.update(engine, [], 0)  # an idle step adds nothing
    assert rate() == 0.0


def test_fault_recomputes_are_a_counter_apart_from_the_preemptions():
    # a step that raised releases its sequences to be recomputed: counted, but not as preemptions
    m = ServerMetrics(MODEL)
    stats = {"prefix_hit_tokens": 0, "prefix_queried_tokens": 0}
    runner = SimpleNamespace(usage=lambda: CacheUsage(8, 8, 0, 0, 16), cache_stats=lambda: stats)
    engine = SimpleNamespace(runner=runner, stats=EngineStats(), running=[], waiting=[])

    def scraped() -> dict[str, tuple[str, float]]:
        families = text_string_to_metric_families(m.render().decode())
        wanted = ("kvpool_fault_recomputes", "kvpool_preemptions")
        return {f.name: (f.type, f.samples[0].value) for f in families if f.name in wanted}

    m.update(engine, [], 0)
    assert scraped() == {"kvpool_fault_recomputes": ("counter", 0.0), "kvpool_preemptions": ("counter", 0.0)}
    engine.stats.num_fault_recomputes, engine.stats.num_preemptions = 3, 1
    m.update(engine, [], 0)
    assert scraped() == {"kvpool_fault_recomputes": ("counter", 3.0), "kvpool_preemptions": ("counter", 1.0)}
    engine.stats.num_fault_recomputes = 5
    m.update(engine, [], 0)
    assert scraped()["kvpool_fault_recomputes"] == ("counter", 5.0)


def test_bench_serve_drives_the_server(server):
    out = subprocess.run(
        [sys.executable, "-m", "kvpool", "bench", "serve", "--url", server, "--api-key", KEY, "--concurrency", "2"]
        + ["--num-requests", "4", "--max-tokens", "4", "--json"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    row = json.loads(out.stdout)["rows"][0]
    assert row["num_ok"] == 4 and row["concurrency"] == 2
    assert row["ttft_ms_p50"] > 0 and row["completion_tokens"] > 0
    assert row["cached_tokens"] > 0 and row["server_hit_rate"] > 0  # two conversations share a system prompt


def test_serve_refuses_bad_flags_without_a_traceback():
    for flags, needle in (
        (["--port", "70000"], "port"),
        (["--model", "/no/such.gguf"], "no such GGUF"),
        (["--kv-memory", "lots"], "--kv-memory"),
    ):
        out = subprocess.run([sys.executable, "-m", "kvpool", "serve", *flags], capture_output=True, text=True)
        assert out.returncode == 2 and needle in out.stderr and "Traceback" not in out.stderr, out.stderr


def test_bench_serve_without_a_server_is_one_error_line_quickly():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}"  # closed again: it refuses connections
    start = time.monotonic()
    out = subprocess.run(
        [sys.executable, "-m", "kvpool", "bench", "serve", "--url", url], capture_output=True, text=True, timeout=120
    )
    took = time.monotonic() - start
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 2, out.stderr
    assert lines[0] == f"kvpool bench serve: waiting for {url} to answer"
    assert lines[1].startswith(f"kvpool bench serve: error: cannot connect to {url} (")
    assert took < 30  # 3 s of retries, and the interpreter's start


def test_a_load_that_outlives_its_time_bound_reports_what_finished():
    async def against_a_stalled_server():
        async def stall(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await reader.read()  # never answers; returns when the client hangs up
            writer.close()

        stalled = await asyncio.start_server(stall, "127.0.0.1", 0)
        url = f"http://127.0.0.1:{stalled.sockets[0].getsockname()[1]}"
        config = LoadConfig(url, "m", num_requests=3, turns=1, concurrency=2, duration_limit_s=0.2, grace_s=0.3)
        async with stalled:
            return config, await run_load(config)

    config, (records, wall_s) = asyncio.run(against_a_stalled_server())
    assert wall_s < 10  # not the per-request timeout of duration + 30 s
    # two clients, each cancelled in its first request; the third conversation never started
    assert [r.ok for r in records] == [False, False]
    assert {r.error for r in records} == {"cancelled: still in flight 0.3 s after the duration limit of 0.2 s"}
    row = summarize(config, records, wall_s, {}, {})
    assert row["num_requests"] == 2 and row["num_ok"] == 0 and row["errors"] == [records[0].error]


def test_streamed_deltas_decode_incrementally_and_add_up_to_the_text() -> None:
    """The engine thread decodes only the tokens after the last whole character each step:
    the deltas still add up to the full decode, a character split over two tokens (bytes
    b"\\xc3", b"\\xa9") is sent whole, and the work grows linearly with the output."""
    import random
    from types import SimpleNamespace

    from kvpool.server.engine_thread import EngineThread, _Tracked

    pieces = [b"a", b"b ", b"\xc3", b"\xa9", "ü".encode(), b"cd", "日".encode(), b"!"]
    decoded_tokens = []

    def decode(ids: list[int]) -> str:  # byte-level: bytes joined, then UTF-8 with U+FFFD for a cut
        decoded_tokens.append(len(ids))
        return b"".join(pieces[t] for t in ids).decode("utf-8", errors="replace")

    rng = random.Random(0)
    ids: list[int] = []
    while len(ids) < 300:  # b"\xc3" is always followed by b"\xa9": "é" split over two tokens
        t = rng.randrange(len(pieces))
        ids += [2, 3] if t in (2, 3) else [t]
    thread = EngineThread(SimpleNamespace(eos_token_ids=set()), decode)
    tracked = _Tracked(None, None, 0)
    seq = SimpleNamespace(sample_index=0, output_ids=[], finish_reason=None, text="", logprobs=[])
    sent = ""
    for n in range(1, len(ids) + 1):
        seq.output_ids = ids[:n]
        if n == len(ids):
            seq.finish_reason, seq.text = "length", decode(ids)
        delta = thread._delta(seq, tracked)
        sent += delta.text if delta is not None else ""
        assert "\ufffd" not in sent  # half a character is never sent
    assert sent == decode(ids)
    assert sum(decoded_tokens[:-2]) < 4 * len(ids)  # a few tokens a step, not the whole output


def test_an_aborted_stream_does_not_end_with_half_a_character() -> None:
    """A stream in flight when the server stops ends with an "abort" delta: it flushed the
    text held back for a stop string (text the model did write) and, when the output ended
    inside a UTF-8 character, a U+FFFD for the half that will never be completed."""
    from types import SimpleNamespace

    from kvpool.server.engine_thread import EngineThread, _Tracked

    pieces = [b"ok ", b"wait", b"\xc3"]  # "é" is b"\xc3\xa9": the last token is half of it

    def decode(ids: list[int]) -> str:
        return b"".join(pieces[t] for t in ids).decode("utf-8", errors="replace")

    thread = EngineThread(SimpleNamespace(eos_token_ids=set()), decode)
    tracked = _Tracked(None, None, 3)  # a stop string of 4 characters may be forming
    seq = SimpleNamespace(sample_index=0, output_ids=[0, 1], finish_reason=None, text="", logprobs=[])
    assert thread._delta(seq, tracked).text == "ok w"  # "ait" held back
    seq.output_ids = [0, 1, 2]
    seq.finish_reason, seq.text = "abort", decode(seq.output_ids)  # (the engine's text at an abort)
    last = thread._delta(seq, tracked)
    assert (last.text, last.finish_reason) == ("ait", "abort")


def test_a_u_fffd_the_model_wrote_is_sent_and_only_half_a_character_waits() -> None:
    """The abort's last delta dropped any trailing U+FFFD, also one the model wrote (the
    character's own bytes, or a byte no UTF-8 character holds): text the client never got.
    With the tokens' bytes only a lead byte still waiting for its continuation is left out,
    and a U+FFFD the model wrote is sent at once, not one token late. The deltas of a stream
    aborted anywhere add up to the bytes decoded up to their last whole character (Python's
    incremental UTF-8 decoder, the reference)."""
    import codecs
    from types import SimpleNamespace

    from hypothesis import given, settings
    from hypothesis import strategies as st

    from kvpool.server.engine_thread import EngineThread, _Tracked

    pieces = [b"ok ", "\ufffd".encode(), b"\xff", b"\x80", b"\xc3", b"\xef\xbf", b"\xbd", b"\xa9z", b"\xf0\x9f"]

    def decode(ids: list[int]) -> str:
        return b"".join(pieces[t] for t in ids).decode("utf-8", errors="replace")

    def stream(ids: list[int], holdback: int, reason: str = "abort") -> list[str]:
        thread = EngineThread(SimpleNamespace(eos_token_ids=set()), decode, token_bytes=pieces.__getitem__)
        tracked = _Tracked(None, None, holdback)
        seq = SimpleNamespace(sample_index=0, output_ids=[], finish_reason=None, text="", logprobs=[])
        sent = []
        for n in range(1, len(ids) + 1):
            seq.output_ids = ids[:n]
            if n == len(ids):
                seq.finish_reason, seq.text = reason, decode(ids)
            delta = thread._delta(seq, tracked)
            sent.append(delta.text if delta is not None else "")
        return sent

    for ids, text in (
        ([0, 1], "ok \ufffd"),  # U+FFFD itself
        ([0, 2], "ok \ufffd"),  # 0xFF: in no character
        ([0, 3], "ok \ufffd"),  # a continuation byte with no lead
        ([0, 4], "ok "),  # half of "é"
        ([0, 5], "ok "),  # two thirds of U+FFFD
        ([0, 5, 6], "ok \ufffd"),  # ...and its last byte
        ([0, 2, 8], "ok \ufffd"),  # 0xFF, then half of an emoji
    ):
        assert "".join(stream(ids, holdback=0)) == text, ids
    assert stream([0, 1, 0], holdback=0)[:2] == ["ok ", "\ufffd"]  # sent with its token

    @settings(max_examples=300, deadline=None)
    @given(st.lists(st.integers(0, len(pieces) - 1), min_size=1, max_size=12), st.integers(0, 3))
    def aborted_anywhere(ids: list[int], holdback: int) -> None:
        whole = codecs.getincrementaldecoder("utf-8")("replace").decode(b"".join(pieces[t] for t in ids))
        assert "".join(stream(ids, holdback)) == whole
        assert "".join(stream(ids, holdback, reason="length")) == decode(ids)

    aborted_anywhere()


def test_with_include_usage_every_chunk_carries_usage_null_and_the_last_the_counts(server):
    """OpenAI's stream_options.include_usage: "All other chunks will also include a usage
    field, but with a null value"; the chunks had no usage field at all."""
    body = {"model": MODEL, "prompt": "Two birds:", "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    for extra, usage_field in (({"stream_options": {"include_usage": True}}, True), ({}, False)):
        chunks = []
        with httpx.stream(
            "POST", f"{server}/v1/completions", json={**body, "stream": True, **extra}, headers=AUTH, timeout=120
        ) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    chunks.append(json.loads(line.removeprefix("data: ")))
        content = [ch for ch in chunks if ch["choices"]]
        assert content and all(("usage" in ch) == usage_field for ch in content), chunks
        assert all(ch.get("usage") is None for ch in content)
        if usage_field:
            assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 4, chunks[-1]
        else:
            assert chunks == content


def test_add_generation_prompt_false_renders_the_messages_without_the_assistants_header(server):
    """audit4: vLLM's add_generation_prompt (default true) was an unknown field, ignored: false
    got the same prompt as true. SmolLM2's template opens the answer with
    '<|im_start|>assistant\\n', four tokens: [1, 520, 9531, 198], the special token, 'ass',
    'istant' and the newline (load_model(None).tokenizer.encode_rendered of the two renderings)."""
    messages = [{"role": "user", "content": "Name a colour"}, {"role": "assistant", "content": "The colour is"}]

    def prompt_tokens(**extra: object) -> int:
        body = {"model": MODEL, "messages": messages, "max_tokens": 1, "temperature": 0, **extra}
        r = httpx.post(f"{server}/v1/chat/completions", json=body, headers=AUTH, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens"]

    opened = prompt_tokens()
    assert prompt_tokens(add_generation_prompt=True) == opened
    assert prompt_tokens(add_generation_prompt=False) == opened - 4


def test_continue_final_message_answers_on_from_the_last_messages_text(server):
    """audit4: vLLM's continue_final_message renders the messages without the answer's opening
    and ends the prompt at the last message's text (no end-of-turn after it), so the model
    continues that message. SmolLM2 closes a turn with '<|im_end|>\\n', two tokens, and opens
    the answer with four (the test above): continuing is 6 tokens fewer than the opened prompt."""
    messages = [{"role": "user", "content": "Name a colour"}, {"role": "assistant", "content": "The colour is"}]

    def post(**extra: object) -> httpx.Response:
        body = {"model": MODEL, "messages": messages, "max_tokens": 8, "temperature": 0, **extra}
        return httpx.post(f"{server}/v1/chat/completions", json=body, headers=AUTH, timeout=120)

    opened, continued = post(), post(continue_final_message=True, add_generation_prompt=False)
    assert continued.status_code == 200, continued.text
    assert continued.json()["usage"]["prompt_tokens"] == opened.json()["usage"]["prompt_tokens"] - 6
    # the same text sent as a completion prompt gets the same greedy continuation
    system = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
    prompt = system + "<|im_start|>user\nName a colour<|im_end|>\n<|im_start|>assistant\nThe colour is"
    done = httpx.post(
        f"{server}/v1/completions",
        json={"model": MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 0, "logprobs": 2},
        headers=AUTH,
        timeout=120,
    )
    assert done.status_code == 200, done.text
    # (the completion reads the chat's cached prefix, other shapes than its prefill: its greedy
    # tokens equal the chat's on any CPU only where no step is within fp32 rounding of a tie)
    for top in done.json()["choices"][0]["logprobs"]["top_logprobs"]:
        best, second = sorted(top.values(), reverse=True)[:2]
        assert best - second > 1e-3, top
    assert continued.json()["choices"][0]["message"]["content"] == done.json()["choices"][0]["text"]
    both = post(continue_final_message=True)  # add_generation_prompt left true: vLLM refuses the pair
    assert both.status_code == 400 and both.json()["error"]["param"] == "continue_final_message", both.text


def test_a_batch_of_prompts_gets_n_choices_each_prompt_by_prompt(server):
    """prompt=["a", "b"] with n=2: four choices, index prompt * n + sample, each prompt's text
    its own single greedy request's; usage the prompts' and the choices' sums; each prompt is
    one engine request (the metrics count two, as a request with n=2 counts one)."""
    c = client(server)
    prompts = ["The capital city of France is", "Three primary colours are red,"]
    kw = {"model": MODEL, "max_tokens": 5, "temperature": 0, "extra_body": {"ignore_eos": True}}
    alone = [c.completions.create(prompt=p, logprobs=2, **kw) for p in prompts]
    # the batch computes these prompts in other shapes than alone (two prompts a step, their
    # prefixes cached): its greedy tokens equal theirs on any CPU only where no step's best two
    # logprobs are within fp32 rounding of a tie, far below 1e-3 here (checked, not assumed)
    for one in alone:
        for top in one.choices[0].logprobs.top_logprobs:
            best, second = sorted(top.values(), reverse=True)[:2]
            assert best - second > 1e-3, (one.choices[0].text, top)
    before = metrics(server)
    batch = c.completions.create(prompt=prompts, n=2, logprobs=1, **kw)
    after = metrics(server)
    assert [ch.index for ch in batch.choices] == [0, 1, 2, 3]
    assert [ch.text for ch in batch.choices] == [alone[i // 2].choices[0].text for i in range(4)]
    assert all(ch.finish_reason == "length" and len(ch.logprobs.tokens) == 5 for ch in batch.choices)
    assert batch.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
    assert batch.usage.completion_tokens == 20 == batch.usage.total_tokens - batch.usage.prompt_tokens
    ttft = "kvpool_time_to_first_token_seconds_count"
    assert after[ttft] == before[ttft] + 2
    # streamed: each choice's chunks carry its index and join to the same text, each ends with
    # its own finish_reason; then the usage chunk and [DONE]
    stream = c.completions.create(prompt=prompts, n=2, stream=True, stream_options={"include_usage": True}, **kw)
    texts: dict[int, str] = {}
    finishes: dict[int, list[str]] = {}
    chunks = list(stream)
    for chunk in chunks[:-1]:
        assert chunk.usage is None and len(chunk.choices) == 1
        ch = chunk.choices[0]
        texts[ch.index] = texts.get(ch.index, "") + ch.text
        if ch.finish_reason:
            finishes.setdefault(ch.index, []).append(ch.finish_reason)
    assert texts == {ch.index: ch.text for ch in batch.choices}
    assert finishes == {i: ["length"] for i in range(4)}
    assert not chunks[-1].choices and chunks[-1].usage.completion_tokens == 20
    assert chunks[-1].usage.prompt_tokens == batch.usage.prompt_tokens
    # token-id lists
    r = httpx.post(
        f"{server}/v1/completions",
        json={"prompt": [[504, 3875, 314], [504, 3875]], "max_tokens": 2, "temperature": 0, "ignore_eos": True},
        headers={"Authorization": f"Bearer {KEY}"},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert [ch["index"] for ch in body["choices"]] == [0, 1] and body["usage"]["prompt_tokens"] == 5
    assert cache_report(server)["num_requests"] == 0


def test_a_bad_prompt_anywhere_in_a_batch_is_a_400_before_any_is_served(server):
    headers = {"Authorization": f"Bearer {KEY}"}
    before = metrics(server)
    for body, needle in (
        ({"prompt": [[504, 3875], [-1]]}, "prompt[1]: token ids [-1] outside the vocabulary"),
        ({"prompt": [[504], []]}, "prompt: prompt 1 is empty"),
        ({"prompt": ["a", ""]}, "prompt"),
        ({"prompt": ["a"] * 33, "n": 2}, "33 prompts x n=2 make 66 choices; at most 64 a request"),
        ({"prompt": ["a", "b"], "echo": True}, "echo: not supported"),
        ({"prompt": ["a", "b"], "max_tokens": 10**6}, "max_tokens"),
    ):
        r = httpx.post(f"{server}/v1/completions", json={**body, "model": MODEL}, headers=headers, timeout=60)
        assert r.status_code == 400 and needle in r.json()["error"]["message"], (body, r.text)
        assert r.json()["error"]["param"] in ("prompt", "echo", "max_tokens"), r.text
    after = metrics(server)
    ttft = "kvpool_time_to_first_token_seconds_count"
    assert after[ttft] == before[ttft]  # nothing was submitted


def test_a_batch_stream_the_client_leaves_aborts_every_prompt(server):
    prompts = ["Once upon a time", "In a galaxy far away", "The recipe begins with"]
    body = {"model": MODEL, "prompt": prompts, "n": 2, "max_tokens": 1500, "ignore_eos": True, "stream": True}
    with httpx.stream(
        "POST", f"{server}/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=60
    ) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                break
    deadline = time.monotonic() + 30
    while (report := cache_report(server))["num_requests"] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert report["num_requests"] == 0 and report["num_used_blocks"] == 0, report


def test_the_sampling_controls_through_the_openai_client(server):
    """The official client sends OpenAI's penalties and logit_bias as its own arguments and
    vLLM's extensions in extra_body; they reach the engine (the greedy answer that repeats
    "hello" does not with them), a streamed answer is the unstreamed one, a stop token id
    ends a completion with "stop", and out-of-range values are 400s naming the field."""
    c = client(server)
    messages = [{"role": "user", "content": "Say the word hello five times."}]
    plain = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0)
    assert plain.choices[0].message.content.lower().count("hello") >= 4
    asked = {"model": MODEL, "messages": messages, "max_tokens": 12, "temperature": 0}
    asked |= {"frequency_penalty": 1.5, "presence_penalty": 0.5}
    asked |= {"extra_body": {"repetition_penalty": 1.2, "min_tokens": 4, "min_p": 0.1}}
    # (each its own tenant: no prefix hit on the plain answer's blocks or each other's, so the
    # two compute the same prefill in the same shapes and their fp32 logits are bit-equal on
    # any CPU, with no near tie to guard)
    whole = c.chat.completions.create(**asked, user="whole")
    stream = c.chat.completions.create(**asked, user="stream", stream=True)
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert streamed == whole.choices[0].message.content != plain.choices[0].message.content
    hello = 33662  # SmolLM2's " hello" (tokenizer.encode(" hello"))
    prompt = {"model": MODEL, "prompt": "hello, hello, hello,", "max_tokens": 6, "temperature": 0}
    assert " hello" in c.completions.create(**prompt).choices[0].text
    biased = c.completions.create(**prompt, logit_bias={str(hello): -100})
    assert " hello" not in biased.choices[0].text and biased.usage.completion_tokens == 6
    stopped = c.completions.create(**prompt, extra_body={"stop_token_ids": [hello]})
    assert stopped.choices[0].finish_reason == "stop" and " hello" not in stopped.choices[0].text
    for name, extra in (
        ("logit_bias", {"logit_bias": {"49152": 1}}),
        ("stop_token_ids", {"extra_body": {"stop_token_ids": [49152]}}),
        ("min_tokens", {"extra_body": {"min_tokens": 7}}),
    ):
        with pytest.raises(openai.BadRequestError) as caught:
            c.completions.create(**prompt, **extra)
        assert caught.value.body["param"] == name, caught.value.body
