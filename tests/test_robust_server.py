"""Issue 28, section 1: one request never fails the others; big bodies, keys and tenants.

Servers run as real processes on 127.0.0.1 and a port the system picks; the engine
thread's fault isolation is driven in-process with a fault injected into one request."""

from __future__ import annotations

import asyncio
import json
import re
import signal
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest

from kvpool.server.metrics import ServerMetrics

KEY = "sk-robust-gateway"
KEY_A, KEY_B = "sk-robust-a", "sk-robust-b"
MODEL = "smollm2-135m"
SYSTEM = "You answer for the city library. " + " ".join(f"Rule {i}: cite the shelf." for i in range(12))


def _start(*flags: str) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvpool", "serve", "--port", "0", *flags],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    line = proc.stdout.readline()
    if "ready on " not in line:
        proc.kill()
        pytest.fail(proc.stderr.read())
    return proc, line.split("ready on ", 1)[1].split()[0]


def _stop(proc: subprocess.Popen) -> str:
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "cache integrity ok, 0 blocks held" in err, err
    return err


@pytest.fixture(scope="module")
def server():
    proc, url = _start("--api-key", KEY)
    yield url
    _stop(proc)


def auth(key: str = KEY) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}


def _streams_of_tenant_b(url: str, num: int, max_tokens: int) -> tuple[list[threading.Thread], list, threading.Event]:
    """`num` streams of tenant b running in threads; the event is set once all have a chunk."""
    results: list = [None] * num
    started = [threading.Event() for _ in range(num)]
    all_started = threading.Event()

    def one(i: int) -> None:
        c = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, timeout=120)
        reasons, num_chunks = [], 0
        try:
            for chunk in c.completions.create(
                model=MODEL,
                prompt=f"Stream {i} counts slowly:",
                max_tokens=max_tokens,
                temperature=0,
                stream=True,
                user="tenant-b",
                extra_body={"ignore_eos": True},
            ):
                num_chunks += 1
                started[i].set()
                reasons += [ch.finish_reason for ch in chunk.choices if ch.finish_reason]
            results[i] = (reasons, num_chunks)
        except Exception as error:  # the test reads it
            results[i] = error
        finally:
            started[i].set()
            if all(e.is_set() for e in started):
                all_started.set()

    threads = [threading.Thread(target=one, args=(i,)) for i in range(num)]
    for t in threads:
        t.start()
    return threads, results, all_started


def test_bad_requests_fail_alone_while_four_streams_of_another_tenant_finish(server):
    threads, results, all_started = _streams_of_tenant_b(server, 4, 96)
    assert all_started.wait(120)
    url = f"{server}/v1/completions"
    # a lone surrogate as the tenant: the salt cannot encode it
    surrogate = httpx.post(url, content=b'{"prompt": "hi", "user": "\\ud800", "max_tokens": 2}', headers=auth())
    tiny_top_p = httpx.post(url, json={"prompt": "hi", "max_tokens": 4, "top_p": 1e-50}, headers=auth(), timeout=60)
    for t in threads:  # the other tenant's streams all end as they should, whatever befell those two
        t.join(120)
    assert [r for r in results if not isinstance(r, tuple) or r[0] != ["length"]] == [], results
    assert surrogate.status_code == 400, surrogate.text
    assert surrogate.json()["error"]["param"] == "user" and "surrogate" in surrogate.json()["error"]["message"]
    assert tiny_top_p.status_code == 200, tiny_top_p.text
    # top_p that fp32 rounds to 0: the nucleus is the most likely token, i.e. greedy
    greedy = httpx.post(url, json={"prompt": "hi", "max_tokens": 4, "temperature": 0}, headers=auth(), timeout=60)
    for extra in ({"top_p": 1e-50}, {"temperature": 1e-300}):
        r = httpx.post(url, json={"prompt": "hi", "max_tokens": 4, **extra}, headers=auth(), timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == greedy.json()["choices"][0]["text"], extra
    for body, param in (
        ({"prompt": "hi", "seed": 2**63}, "seed"),
        ({"prompt": "hi", "temperature": 2.5}, "temperature"),
        ({"prompt": "hi", "top_p": 0}, "top_p"),
        ({"prompt": "\ud800"}, "prompt"),
    ):
        r = httpx.post(url, content=json.dumps(body).encode(), headers=auth(), timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)
    r = httpx.post(url, content=b'{"prompt": "hi", "temperature": NaN}', headers=auth(), timeout=60)
    assert r.status_code == 400 and "NaN" in r.json()["error"]["message"], r.text


def test_seed_bounds_are_int64(server):
    url = f"{server}/v1/completions"
    for seed, status in ((-(2**63), 200), (2**63 - 1, 200), (2**63, 400), (-(2**63) - 1, 400)):
        r = httpx.post(url, json={"prompt": "hi", "max_tokens": 1, "seed": seed}, headers=auth(), timeout=60)
        assert r.status_code == status, (seed, r.text)


def test_a_20mb_body_is_refused_at_once_while_a_stream_flows(server):
    threads, results, all_started = _streams_of_tenant_b(server, 1, 64)
    assert all_started.wait(120)
    big = json.dumps({"prompt": "word " * 4_000_000, "max_tokens": 1}).encode()
    assert len(big) > 20_000_000
    start = time.monotonic()
    r = httpx.post(f"{server}/v1/completions", content=big, headers=auth(), timeout=30)
    took = time.monotonic() - start
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large", r.text
    assert "--max-request-bytes" in r.json()["error"]["message"]
    assert took < 1.0, took
    start = time.monotonic()
    assert httpx.get(f"{server}/health", timeout=30).status_code == 200
    assert time.monotonic() - start < 1.0
    # a body without a length (chunked) is cut off at the limit too
    r = httpx.post(
        f"{server}/v1/completions",
        content=iter([big[i : i + (1 << 20)] for i in range(0, len(big), 1 << 20)]),
        headers=auth(),
        timeout=30,
    )
    assert r.status_code == 413, r.text
    threads[0].join(120)
    assert results[0][0] == ["length"] and results[0][1] >= 64 // 2, results


def test_the_key_is_checked_before_the_body_is_read(server):
    url = f"{server}/v1/chat/completions"
    plain = {"Content-Type": "application/json"}
    r = httpx.post(url, content=b'{"messages": [', headers=plain, timeout=30)  # bad JSON, no key
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", r.text
    r = httpx.post(url, json={"messages": "not a list"}, headers=plain, timeout=30)
    assert r.status_code == 401 and "messages" not in r.text, r.text
    body = json.dumps({"messages": [{"role": "user", "content": "word " * 1_400_000}]}).encode()  # 7 MB
    start = time.monotonic()
    r = httpx.post(url, content=body, headers=plain, timeout=30)
    assert r.status_code == 401 and time.monotonic() - start < 1.0, r.text
    assert httpx.get(f"{server}/openapi.json", timeout=30).status_code == 401
    r = httpx.get(f"{server}/openapi.json", headers=auth(), timeout=30)
    assert r.status_code == 200, r.text
    doc = r.json()
    body = doc["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    schema = doc["components"]["schemas"][body["$ref"].rsplit("/", 1)[1]]
    assert {"messages", "temperature", "seed"} <= set(schema["properties"]), schema


def test_malformed_bodies_get_openai_errors(server):
    url = f"{server}/v1/completions"
    for raw, needle in (
        (b"", "empty"),
        (b"   ", "empty"),
        (b'{"prompt": "caf\xe9"}', "UTF-8"),
        (b"[" * 100_000 + b"]" * 100_000, "nested"),
        (b'["hi"]', "JSON object"),
        (b'{"prompt": "hi"', "JSON"),
    ):
        r = httpx.post(url, content=raw, headers=auth(), timeout=30)
        assert r.status_code == 400, (raw[:20], r.text)
        error = r.json()["error"]
        assert needle in error["message"] and error["type"] == "invalid_request_error", (raw[:20], error)
    chat = f"{server}/v1/chat/completions"
    msgs = [{"role": "user", "content": "hi"}]
    for extra, param in (
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"tool_choice": "auto"}, "tool_choice"),
    ):
        r = httpx.post(chat, json={"messages": msgs, **extra}, headers=auth(), timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    r = httpx.post(
        chat, json={"messages": msgs, "max_tokens": 1, "response_format": {"type": "text"}}, headers=auth(), timeout=60
    )
    assert r.status_code == 200, r.text


def test_a_body_that_is_not_an_object_is_named_in_json_words():
    """`null` was "got a JSON NoneType", `[1]` "a JSON list": Python's names for JSON's values."""
    from kvpool.server.protocol import APIError, CompletionRequest, parse_body

    for raw, kind in (
        (b"null", "null"),
        (b"123", "a number"),
        (b"-1.5e3", "a number"),
        (b"true", "a boolean"),
        (b'"hi"', "a string"),
        (b'[{"prompt": "hi"}]', "an array"),
    ):
        with pytest.raises(APIError) as caught:
            parse_body(raw, CompletionRequest)
        assert caught.value.status == 400, raw
        assert caught.value.message == f"the body must be a JSON object, got {kind}", (raw, caught.value.message)


def _refused_unless_neutral(model, body: dict, name: str, asked: object, neutral: object) -> None:
    """`name` set to `asked` is a 400 naming it; its neutral value, and null (its default), are served."""
    from kvpool.server.protocol import APIError, parse_body

    with pytest.raises(APIError) as caught:
        parse_body(json.dumps({**body, name: asked}).encode(), model)
    assert (caught.value.status, caught.value.param) == (400, name), caught.value.message
    assert caught.value.message.startswith(f"{name}: not supported by kvpool serve"), caught.value.message
    for value in (neutral, None):
        parse_body(json.dumps({**body, name: value}).encode(), model)


def test_vllms_sampling_extensions_are_refused_unless_neutral_not_ignored():
    """A client written for vLLM sends repetition_penalty, min_p, min_tokens, guided_json...:
    they were unknown fields, ignored, and the tokens were not the ones asked for."""
    from kvpool.server.protocol import ChatCompletionRequest, CompletionRequest

    chat = {"messages": [{"role": "user", "content": "hi"}]}
    for name, asked, neutral in (
        ("length_penalty", 0.5, 1),
        ("bad_words", ["no"], []),
        ("allowed_token_ids", [1, 2], None),
        ("include_stop_str_in_output", True, False),
        ("skip_special_tokens", False, True),
        ("use_beam_search", True, False),
        ("prompt_logprobs", 1, None),
        ("truncate_prompt_tokens", 100, None),
        ("guided_json", {"type": "object"}, None),
        ("guided_regex", "[0-9]+", None),
        ("guided_choice", ["yes", "no"], None),
        ("guided_grammar", "root ::= 'a'", None),
    ):
        for model, body in ((CompletionRequest, {"prompt": "hi"}), (ChatCompletionRequest, chat)):
            _refused_unless_neutral(model, body, name, asked, neutral)


def test_vllms_prompt_and_output_extensions_are_refused_unless_neutral_not_ignored():
    """audit4 F1: vLLM's fields that change the prompt or the answer (a chat's
    continue_final_message, a custom chat_template, completions' response_format, usage in
    every chunk...) were unknown fields, ignored: a 200 with another prompt or answer."""
    from kvpool.server.protocol import APIError, ChatCompletionRequest, CompletionRequest, parse_body

    chat = (ChatCompletionRequest, {"messages": [{"role": "user", "content": "hi"}]})
    completion = (CompletionRequest, {"prompt": "hi"})
    cases = [
        # (endpoints, field, a value asking for something, the neutral value vLLM defaults to)
        ([chat], "chat_template", "{{ 'X' }}", None),
        ([chat], "echo", True, False),
        ([chat], "documents", [{"title": "a", "text": "b"}], []),
        ([chat], "add_special_tokens", True, False),
        ([completion], "add_special_tokens", False, True),
        ([completion], "response_format", {"type": "json_object"}, {"type": "text"}),
        ([chat, completion], "return_tokens_as_token_ids", True, False),
        ([chat, completion], "spaces_between_special_tokens", False, True),
        ([chat, completion], "structured_outputs", {"choice": ["yes", "no"]}, None),
        ([chat, completion], "logits_processors", ["some.module.Processor"], []),
    ]
    for endpoints, name, asked, neutral in cases:
        for model, body in endpoints:
            _refused_unless_neutral(model, body, name, asked, neutral)
    for model, body in (chat, completion):
        streamed = {**body, "stream": True}
        with pytest.raises(APIError) as caught:
            options = {"include_usage": True, "continuous_usage_stats": True}
            parse_body(json.dumps({**streamed, "stream_options": options}).encode(), model)
        param = "stream_options.continuous_usage_stats"
        assert (caught.value.status, caught.value.param) == (400, param), caught.value.message
        assert caught.value.message.startswith(f"{param}: not supported by kvpool serve"), caught.value.message
        for value in (False, None):
            options = {"include_usage": True, "continuous_usage_stats": value}
            assert parse_body(json.dumps({**streamed, "stream_options": options}).encode(), model).include_usage


def test_an_image_part_in_a_chat_message_is_named_as_such():
    """It was refused as "messages[0].content: Input should be a valid string" (the union's
    first member), which hides that the server takes text parts only."""
    from kvpool.server.protocol import APIError, ChatCompletionRequest, parse_body

    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}
    text = {"type": "text", "text": "What is this?"}
    body = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": [text, image]}]}
    with pytest.raises(APIError) as caught:
        parse_body(json.dumps(body).encode(), ChatCompletionRequest)
    assert (caught.value.status, caught.value.param) == (400, "messages[1].content[1].type"), caught.value.message
    assert "'image_url' parts are not supported" in caught.value.message
    body["messages"][1]["content"] = [text, text]
    assert parse_body(json.dumps(body).encode(), ChatCompletionRequest).template_messages()[1]["content"] == (
        "What is this?\nWhat is this?"
    )


def test_a_messages_text_parts_are_joined_one_a_line_as_vllm_joins_them():
    """They were joined with "" ("Hello" + "world" -> "Helloworld"), so the same messages gave
    another prompt than on vLLM, which joins a message's text parts with "\n"."""
    from kvpool.server.protocol import ChatCompletionRequest, parse_body

    def rendered(content: object) -> list[dict[str, str]]:
        body = {"messages": [{"role": "developer", "content": content}, {"role": "user", "content": "hi"}]}
        return parse_body(json.dumps(body).encode(), ChatCompletionRequest).template_messages()

    def parts(*texts: str) -> list[dict[str, str]]:
        return [{"type": "text", "text": t} for t in texts]

    assert rendered(parts("Hello", "world")) == rendered("Hello\nworld")
    assert rendered(parts("Hello", "world"))[0] == {"role": "system", "content": "Hello\nworld"}
    assert rendered(parts("a", "", "b\n")) == rendered("a\n\nb\n")  # empty parts keep their line
    assert rendered(parts("alone")) == rendered("alone")  # one part is the string itself
    assert rendered([]) == rendered("") == rendered(None)


def test_a_messages_name_reaches_the_chat_template_as_vllm_passes_it():
    """audit4 F3: a message's `name` (OpenAI's participant name) was dropped: a template that
    renders names got another prompt than on vLLM, which hands the template the message with
    its name. A message without one has no `name` key, so templates that test for it see none."""
    from kvpool.server.protocol import APIError, ChatCompletionRequest, parse_body

    messages = [{"role": "developer", "content": "be brief", "name": "ops"}, {"role": "user", "content": "hi"}]
    body = {"messages": messages}
    assert parse_body(json.dumps(body).encode(), ChatCompletionRequest).template_messages() == [
        {"role": "system", "content": "be brief", "name": "ops"},
        {"role": "user", "content": "hi"},
    ]
    with pytest.raises(APIError) as caught:  # a name is a string, as OpenAI's
        named = {"messages": [{"role": "user", "content": "hi", "name": 7}]}
        parse_body(json.dumps(named).encode(), ChatCompletionRequest)
    assert (caught.value.status, caught.value.param) == (400, "messages[0].name"), caught.value.message


def test_top_k_minus_one_is_vllms_all_tokens_and_is_served_as_no_top_k():
    """vLLM reads top_k -1 (its old default) and 0 as "all tokens": a client written for vLLM
    sends -1, and it was refused with a 400. Below -1 is still refused, naming the field."""
    from kvpool.server.protocol import APIError, ChatCompletionRequest, CompletionRequest, parse_body

    chat = {"messages": [{"role": "user", "content": "hi"}]}
    for model, body in ((CompletionRequest, {"prompt": "hi"}), (ChatCompletionRequest, chat)):
        for sent, served in ((-1, 0), (0, 0), (None, 0), (1, 1), (40, 40)):
            assert parse_body(json.dumps({**body, "top_k": sent}).encode(), model).top_k == served, sent
        for sent in (-2, -100):
            with pytest.raises(APIError) as caught:
                parse_body(json.dumps({**body, "top_k": sent}).encode(), model)
            assert (caught.value.status, caught.value.param) == (400, "top_k"), caught.value.message
            assert "-1" in caught.value.message, caught.value.message


def test_an_error_names_the_field_even_when_it_starts_like_a_type_name():
    """`stream` starts with "str", pydantic's tag for a union's string member: the field was
    dropped from the error (param null), and `stream_options.` from its members' errors."""
    from kvpool.server.protocol import APIError, CompletionRequest, parse_body

    for body, param in (
        ({"prompt": "hi", "stream": "maybe"}, "stream"),
        ({"prompt": "hi", "stream": [1]}, "stream"),
        ({"prompt": "hi", "stream": True, "stream_options": 5}, "stream_options"),
        (
            {"prompt": "hi", "stream": True, "stream_options": {"include_usage": "maybe"}},
            "stream_options.include_usage",
        ),
        ({"prompt": [[1.5]]}, "prompt"),  # (a union's member tags still leave the location)
    ):
        with pytest.raises(APIError) as caught:
            parse_body(json.dumps(body).encode(), CompletionRequest)
        assert caught.value.status == 400 and caught.value.param == param, (body, caught.value.message)
        assert caught.value.message.startswith(f"{param}: "), caught.value.message


def test_a_value_of_the_wrong_json_type_is_refused_not_converted():
    """`true` was a count (max_tokens: true -> 1, prompt: [true] -> token id 1, completions'
    logprobs: true -> one top logprob) and strings were numbers and booleans, as OpenAI's API
    never reads them: each is a 400 naming the field. A JSON integer still fills a float."""
    from kvpool.server.protocol import APIError, ChatCompletionRequest, CompletionRequest, parse_body

    chat = {"messages": [{"role": "user", "content": "hi"}]}
    for model, extra, param in (
        (CompletionRequest, {"max_tokens": True}, "max_tokens"),
        (CompletionRequest, {"max_tokens": "5"}, "max_tokens"),
        (CompletionRequest, {"n": True}, "n"),
        (CompletionRequest, {"logprobs": True}, "logprobs"),
        (CompletionRequest, {"prompt": [True, False]}, "prompt"),
        (CompletionRequest, {"prompt": [1.0, 2.0]}, "prompt"),
        (CompletionRequest, {"temperature": "0"}, "temperature"),
        (CompletionRequest, {"seed": "7"}, "seed"),
        (CompletionRequest, {"stream": "false"}, "stream"),
        (CompletionRequest, {"ignore_eos": "yes"}, "ignore_eos"),
        (CompletionRequest, {"stream": True, "stream_options": {"include_usage": 1}}, "stream_options.include_usage"),
        (ChatCompletionRequest, {"logprobs": 1}, "logprobs"),
        (ChatCompletionRequest, {"max_completion_tokens": True}, "max_completion_tokens"),
        (ChatCompletionRequest, {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}, "messages"),
    ):
        body = {**({"prompt": "hi"} if model is CompletionRequest else chat), **extra}
        with pytest.raises(APIError) as caught:
            parse_body(json.dumps(body).encode(), model)
        assert caught.value.status == 400 and caught.value.param.startswith(param), (body, caught.value.message)
    parsed = parse_body(b'{"prompt": [1, 2], "temperature": 0, "top_p": 1, "max_tokens": 3}', CompletionRequest)
    assert (parsed.prompt, parsed.temperature, parsed.top_p, parsed.max_tokens) == ([1, 2], 0.0, 1.0, 3)


def test_a_stop_string_longer_than_the_library_takes_is_a_400_naming_stop():
    """The protocol refuses what SamplingParams would (a ValueError there is the server's 500)."""
    from kvpool.engine.sampling import MAX_STOP_CHARS
    from kvpool.server.protocol import APIError, CompletionRequest, parse_body

    body = {"prompt": "hi", "stop": ["ok", "y" * (MAX_STOP_CHARS + 1)]}
    with pytest.raises(APIError) as caught:
        parse_body(json.dumps(body).encode(), CompletionRequest)
    assert (caught.value.status, caught.value.param) == (400, "stop"), caught.value.message
    assert f"at most {MAX_STOP_CHARS} characters" in caught.value.message
    assert parse_body(json.dumps({**body, "stop": "y" * MAX_STOP_CHARS}).encode(), CompletionRequest).stop


def test_a_prompt_of_token_ids_alone_in_a_list_is_one_prompt(server):
    """`prompt: [[ids]]`, what the openai client sends for a batch of one token-id prompt, was
    refused ("prompt: Input should be a valid string") while `["text"]` was one prompt."""
    c = openai.OpenAI(base_url=f"{server}/v1", api_key=KEY, timeout=120)
    ids = [504, 3875, 314, 253]
    kw = {"model": MODEL, "max_tokens": 3, "temperature": 0, "extra_body": {"ignore_eos": True}}
    flat = c.completions.create(prompt=ids, **kw)
    nested = c.completions.create(prompt=[ids], **kw)
    assert nested.choices[0].text == flat.choices[0].text and nested.usage.prompt_tokens == len(ids)
    for prompt, needle in (([ids, []], "prompt: prompt 1 is empty"), ([[]], "prompt: empty"), ([[-1]], "vocabulary")):
        r = httpx.post(f"{server}/v1/completions", json={"prompt": prompt}, headers=auth(), timeout=60)
        assert r.status_code == 400 and needle in r.json()["error"]["message"], (prompt, r.text)
        assert r.json()["error"]["param"] == "prompt", r.text


def test_request_ids_do_not_count_requests(server):
    c = openai.OpenAI(base_url=f"{server}/v1", api_key=KEY, timeout=120)
    ids = [c.completions.create(model=MODEL, prompt="hi", max_tokens=1).id for _ in range(2)]
    assert all(re.fullmatch(r"cmpl-[0-9a-f]{32}", i) for i in ids) and ids[0] != ids[1], ids


def test_keys_carry_their_tenant():
    """Keys bound to tenants a and b, and one unbound key for a gateway that names tenants."""
    proc, server = _start(
        "--api-key", f"{KEY_A}:tenant-a", "--api-key", f"{KEY_B}:tenant-b", "--api-key", KEY, "--trust-tenant-header"
    )
    try:
        _check_keys_carry_their_tenant(server)
    finally:
        _stop(proc)


def _check_keys_carry_their_tenant(server: str) -> None:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "When do you open?"}]

    def cached(key: str, **extra) -> int:
        c = openai.OpenAI(base_url=f"{server}/v1", api_key=key, timeout=120)
        out = c.chat.completions.create(model=MODEL, messages=messages, max_tokens=1, **extra)
        return out.usage.prompt_tokens_details.cached_tokens

    assert cached(KEY_A) == 0
    assert cached(KEY_A) > 0  # tenant a's own prefix
    assert cached(KEY_A, user="tenant-a") > 0  # naming its own tenant is fine
    assert cached(KEY_B) == 0  # tenant b never sees tenant a's prefix
    # a key bound to tenant b cannot claim tenant a, by header or by user
    for extra in ({"extra_headers": {"X-Tenant-Id": "tenant-a"}}, {"user": "tenant-a"}):
        with pytest.raises(openai.PermissionDeniedError) as caught:
            cached(KEY_B, **extra)
        assert "tenant-a" in str(caught.value)
    # the unbound gateway key names tenants with the header (--trust-tenant-header)
    assert cached(KEY, extra_headers={"X-Tenant-Id": "tenant-a"}) > 0
    assert cached(KEY, extra_headers={"X-Tenant-Id": "tenant-z"}) == 0


def test_an_untrusted_tenant_header_is_refused_and_keys_come_from_a_file(tmp_path):
    keys = tmp_path / "keys"
    keys.write_text(f"# key:tenant\n{KEY_A}:tenant-a\n\n{KEY}\n")
    proc, url = _start("--api-key-file", str(keys))
    try:
        ok = httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 1}, headers=auth(KEY_A))
        assert ok.status_code == 200, ok.text
        r = httpx.post(
            f"{url}/v1/completions",
            json={"prompt": "hi", "max_tokens": 1},
            headers={**auth(KEY), "X-Tenant-Id": "tenant-a"},
        )
        assert r.status_code == 403 and "--trust-tenant-header" in r.json()["error"]["message"], r.text
        # a stream the client drops: an abort in the server's lifetime, not in flight at the end
        body = {"prompt": "hi", "max_tokens": 2000, "stream": True, "ignore_eos": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, headers=auth(KEY), timeout=60) as s:
            next(s.iter_lines())
        deadline = time.monotonic() + 30
        while not re.search(r'requests_total\{finish_reason="abort"[^}]*\} 1\.0', httpx.get(f"{url}/metrics").text):
            assert time.monotonic() < deadline
            time.sleep(0.1)
        # and one stream in flight when the server stops
        flowing = threading.Event()

        def stream() -> None:
            with httpx.stream("POST", f"{url}/v1/completions", json=body, headers=auth(KEY), timeout=60) as s:
                for _ in s.iter_lines():
                    flowing.set()

        streamer = threading.Thread(target=stream, daemon=True)
        streamer.start()
        assert flowing.wait(60)
    finally:
        err = _stop(proc)
    assert "stopped (1 request aborted in flight;" in err, err
    bad = tmp_path / "bad"
    bad.write_text(f"{KEY_A}:tenant-a\n:tenant-b\n")
    for flags, needle in (
        (["--api-key-file", str(tmp_path / "missing")], "missing"),
        (["--api-key-file", str(bad)], f"{bad}:2"),
        (["--api-key", f"{KEY_A}:a", "--api-key", f"{KEY_A}:b"], "twice"),
        (["--max-request-bytes", "lots"], "--max-request-bytes"),
        (["--max-model-len", "1"], "--max-model-len 2 or more"),  # (it started, refusing every request)
    ):
        out = subprocess.run(
            [sys.executable, "-m", "kvpool", "serve", *flags], capture_output=True, text=True, timeout=60
        )
        assert out.returncode == 2 and needle in out.stderr and "Traceback" not in out.stderr, out.stderr


def test_ctrl_c_pressed_three_times_while_streams_flow_stops_once_without_a_traceback():
    """An impatient operator's Ctrl-C, Ctrl-C, Ctrl-C: uvicorn took the second as "force quit"
    and logged the cancelled lifespan task as a traceback; later ones could cut the cleanup.
    The streams in flight end with an "abort" chunk and [DONE]; a request in flight without
    a stream was a 200 with its cut text (finish_reason "abort") and is a 503 a client retries."""
    proc, url = _start()
    body = {"prompt": "Count:", "max_tokens": 2000, "stream": True, "ignore_eos": True}
    flowing = [threading.Event() for _ in range(2)]
    last_lines: list[list[str]] = [[], []]
    whole: list[httpx.Response] = []

    def stream(i: int) -> None:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as s:
            for line in s.iter_lines():
                if line:
                    last_lines[i] = [*last_lines[i][-1:], line]
                flowing[i].set()

    def unstreamed() -> None:
        whole.append(httpx.post(f"{url}/v1/completions", json={**body, "stream": False}, timeout=60))

    threads = [threading.Thread(target=stream, args=(i,), daemon=True) for i in range(2)]
    threads.append(threading.Thread(target=unstreamed, daemon=True))
    for t in threads:
        t.start()
    assert all(f.wait(60) for f in flowing)
    deadline = time.monotonic() + 60
    while httpx.get(f"{url}/debug/cache", timeout=60).json()["num_running"] < 3:  # the third is in too
        assert time.monotonic() < deadline
        time.sleep(0.05)
    for _ in range(3):
        proc.send_signal(signal.SIGINT)
        time.sleep(0.05)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "Traceback" not in err and err.count("kvpool serve: stopped") == 1, err
    assert "stopped (3 requests aborted in flight; cache integrity ok, 0 blocks held)" in err, err
    for t in threads:
        t.join(30)
    for lines in last_lines:
        assert lines[-1] == "data: [DONE]", lines
        assert json.loads(lines[0].removeprefix("data: "))["choices"][0]["finish_reason"] == "abort", lines
    assert whole[0].status_code == 503, whole[0].text
    error = whole[0].json()["error"]
    assert error["type"] == "server_error" and error["code"] == "server_shutting_down", error


def test_a_server_whose_output_reader_left_stops_quietly():
    """`kvpool serve | head -0`: the ready line met a closed pipe inside uvicorn's startup,
    which logged a traceback and exited 3; every command stops quietly then, status 141."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvpool", "serve", "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    proc.stdout.close()  # the reader leaves before the server is ready
    err = proc.stderr.read()
    assert proc.wait(60) == 141, err
    assert "Traceback" not in err and "stopped (0 requests aborted in flight; cache integrity ok" in err, err


def test_a_key_or_tenant_that_is_not_utf8_is_refused_at_start(monkeypatch):
    """argv and the environment carry undecodable bytes as lone surrogates: such a key made
    every request's key comparison raise, a 500 even for the other, valid keys."""
    import argparse

    from kvpool.cli.serve import api_keys_from

    def keys(*given: str, env: str | None = None) -> dict:
        if env is None:
            monkeypatch.delenv("KVPOOL_API_KEY", raising=False)
        else:
            monkeypatch.setenv("KVPOOL_API_KEY", env)
        return api_keys_from(argparse.Namespace(api_key=list(given) or None, api_key_file=None))

    assert keys("good", "k2:acme") == {"good": None, "k2": "acme"}
    for given, env in ((("good", "k\udcff"), None), (("k:t\udcff",), None), ((), "k\udcff")):
        with pytest.raises(ValueError, match="not valid UTF-8"):
            keys(*given, env=env)


# ---- the engine thread, in-process: a fault in one request ----------------------------------


@pytest.fixture(scope="module")
def loaded():
    from kvpool.engine.build import load_model

    return load_model(None)


def test_a_fault_in_one_requests_sampling_or_text_fails_it_alone(loaded, capfd):
    from kvpool.engine.build import build_engine
    from kvpool.engine.sampling import SamplingParams, sample_token
    from kvpool.server.engine_thread import EngineThread, Failed, Finished

    engine = build_engine(loaded, num_blocks=256, block_size=16)
    bad_seed = 666

    def sampler(logits, params, sample_index, position):
        if params.seed == bad_seed and position == 2:
            raise RuntimeError("injected sampler fault")
        return sample_token(logits, params, sample_index, position)

    engine.sampler = sampler
    metrics = ServerMetrics(MODEL)
    thread = EngineThread(engine, loaded.tokenizer.decode, on_step=metrics.update)
    delta = thread._delta

    def faulty_delta(seq, tracked):
        if seq.request.request_id == "bad-text" and seq.num_output_tokens >= 3:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected detokenizer fault")
        return delta(seq, tracked)

    thread._delta = faulty_delta
    prompt = loaded.tokenizer.encode("The river flows")

    async def drive() -> dict[str, list]:
        queues = {}
        for name, seed, n in (("ok-0", 1, 1), ("bad-sample", bad_seed, 2), ("ok-1", 2, 2), ("bad-text", 3, 1)):
            params = SamplingParams(max_tokens=8, temperature=0.8, seed=seed, n=n, ignore_eos=True)
            queues[name] = thread.submit(name, prompt, params, tenant="t")
        events: dict[str, list] = {}
        for name, queue in queues.items():
            events[name] = []
            while not isinstance(events[name][-1:] and events[name][-1], Finished | Failed):
                events[name].append(await asyncio.wait_for(queue.get(), 60))
        return events

    thread.start()
    try:
        events = asyncio.run(drive())
        assert thread.call(lambda e: e.runner.check_integrity()).result(60) is None
        held = thread.call(lambda e: e.runner.usage().num_held_blocks).result(60)
    finally:
        thread.stop()
    for name in ("ok-0", "ok-1"):
        out = events[name][-1]
        assert isinstance(out, Finished), events[name]
        assert [len(c.token_ids) for c in out.output.completions] == [8] * (1 if name == "ok-0" else 2)
    assert isinstance(events["bad-sample"][-1], Failed) and "injected sampler fault" in events["bad-sample"][-1].message
    assert isinstance(events["bad-text"][-1], Failed) and "injected detokenizer fault" in events["bad-text"][-1].message
    assert held == 0 and engine.requests == {}
    assert metrics.requests["error"]._value.get() == 2 and metrics.requests["length"]._value.get() == 2
    # the operator's log has each failure once, with the traceback down to the fault
    log = capfd.readouterr().err
    for name, where in (("bad-sample", "in sampler"), ("bad-text", "in faulty_delta")):
        assert log.count(f"kvpool serve: request {name} failed:") == 1, log
        assert where in log.split(f"request {name} failed:")[1], log


def test_a_fault_in_the_text_of_a_requests_last_step_fails_it(loaded):
    """The request finished in the step whose text raised: it is failed, not answered as a
    success whose last text (and finish_reason) never came."""
    from kvpool.engine.build import build_engine
    from kvpool.engine.sampling import SamplingParams
    from kvpool.server.engine_thread import EngineThread, Failed, Finished

    engine = build_engine(loaded, num_blocks=64, block_size=16)
    metrics = ServerMetrics(MODEL)
    thread = EngineThread(engine, loaded.tokenizer.decode, on_step=metrics.update)
    delta = thread._delta

    def faulty_delta(seq, tracked):
        if seq.request.request_id == "bad-end" and seq.finish_reason is not None:
            raise RuntimeError("injected fault in the last text")
        return delta(seq, tracked)

    thread._delta = faulty_delta
    prompt = loaded.tokenizer.encode("The river flows")
    params = SamplingParams(max_tokens=4, ignore_eos=True)

    async def drive() -> dict[str, object]:
        queues = {name: thread.submit(name, prompt, params) for name in ("bad-end", "ok")}
        last = {}
        for name, queue in queues.items():
            while not isinstance(event := await asyncio.wait_for(queue.get(), 60), Finished | Failed):
                pass
            last[name] = event
        return last

    thread.start()
    try:
        last = asyncio.run(drive())
        held = thread.call(lambda e: e.runner.usage().num_held_blocks).result(60)
    finally:
        thread.stop()
    assert isinstance(last["bad-end"], Failed) and "injected fault in the last text" in last["bad-end"].message
    assert isinstance(last["ok"], Finished)
    assert held == 0 and engine.requests == {}
    assert metrics.requests["error"]._value.get() == 1 and metrics.requests["length"]._value.get() == 1


def test_a_request_fault_still_raises_outside_the_server(loaded):
    """Only the server contains a request's fault (its engine thread opts in): elsewhere
    (kvpool generate, run, verify, the simulator) nothing reads RequestOutput.error, so a
    sampler bug contained there would pass as a quietly aborted request."""
    from kvpool.engine.build import build_engine
    from kvpool.engine.sampling import SamplingParams
    from kvpool.server.engine_thread import EngineThread

    def sampler(logits, params, sample_index, position):
        raise RuntimeError("injected sampler fault")

    engine = build_engine(loaded, num_blocks=64, block_size=16)
    engine.sampler = sampler
    engine.add_request(loaded.tokenizer.encode("The river flows"), SamplingParams(max_tokens=2))
    with pytest.raises(RuntimeError, match="injected sampler fault"):
        while engine.has_unfinished():
            engine.step()
    served = build_engine(loaded, num_blocks=64, block_size=16)
    assert not served.contain_request_faults
    EngineThread(served, loaded.tokenizer.decode)
    assert served.contain_request_faults


def test_a_tenant_the_salt_cannot_encode_is_refused_by_the_engine(loaded):
    from kvpool.engine.build import build_engine
    from kvpool.pool.hashing import BlockHasher

    engine = build_engine(loaded, num_blocks=64, block_size=16)
    with pytest.raises(ValueError, match="tenant"):
        engine.add_request([1, 2, 3], tenant="\ud800")
    assert engine.requests == {} and not engine.has_unfinished()
    with pytest.raises(ValueError, match="tenant salt"):
        BlockHasher().root(b"d", "\udfff")


def test_a_fault_of_the_step_itself_fails_the_batch_and_serving_goes_on(loaded):
    from kvpool.engine.build import build_engine
    from kvpool.engine.sampling import SamplingParams
    from kvpool.server.engine_thread import EngineThread, Failed, Finished

    engine = build_engine(loaded, num_blocks=256, block_size=16)
    execute = engine.runner.execute
    broken = threading.Event()

    def faulty_execute(chunks):
        # once, in a step that runs all three requests: the engine thread may step before the
        # last of them is submitted, and a fault of an earlier step would fail fewer of them
        if broken.is_set() and len(chunks) == 3:
            broken.clear()
            raise RuntimeError("injected forward fault")
        return execute(chunks)

    engine.runner.execute = faulty_execute
    metrics = ServerMetrics(MODEL)
    thread = EngineThread(engine, loaded.tokenizer.decode, on_step=metrics.update)
    prompt = loaded.tokenizer.encode("The river flows")
    params = SamplingParams(max_tokens=6, ignore_eos=True)

    async def last_event(queue) -> object:
        while True:
            event = await asyncio.wait_for(queue.get(), 60)
            if isinstance(event, Finished | Failed):
                return event

    async def drive() -> tuple[list, object]:
        broken.set()
        queues = [thread.submit(f"r{i}", prompt, params) for i in range(3)]
        batch = [await last_event(q) for q in queues]
        return batch, await last_event(thread.submit("after", prompt, params))

    thread.start()
    try:
        batch, after = asyncio.run(drive())
        held = thread.call(lambda e: e.runner.usage().num_held_blocks).result(60)
    finally:
        thread.stop()
    assert all(isinstance(e, Failed) and "injected forward fault" in e.message for e in batch), batch
    assert isinstance(after, Finished) and len(after.output.completions[0].token_ids) == 6
    assert held == 0 and engine.requests == {}
    assert metrics.requests["error"]._value.get() == 3 and metrics.requests["length"]._value.get() == 1


def test_long_prompts_are_tokenized_off_the_event_loop(loaded):
    """A prompt's tokenization (seconds for 450 KB on a loaded machine) must not run on the
    event loop, where /health and every stream wait for it. Asserted without a clock (a
    median /health time failed at load 10): the tokenizer here holds a prompt until /health
    has answered meanwhile. On the event loop /health cannot answer while the prompt is held,
    and the hold ends by its bound instead (`asyncio.to_thread` in the app moved onto the loop
    fails this test). A prompt too long to fit is refused without being tokenized at all."""
    entered, answered, held = threading.Event(), threading.Event(), []

    class Gated:  # the model's tokenizer, its encode held until /health has answered
        def __init__(self, inner) -> None:
            self.inner = inner

        def __getattr__(self, name: str):
            return getattr(self.inner, name)

        def encode(self, text: str) -> list[int]:
            entered.set()
            held.append(answered.wait(HOLD_S))
            return self.inner.encode(text)

    app, thread = _app_over(loaded, tokenizer=Gated(loaded.tokenizer))

    async def scenario() -> tuple[httpx.Response, httpx.Response, bool]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=120) as client:
            # 3.9 MB, under the body limit: a prompt that cannot fit is refused without tokenizing
            too_long = await client.post("/v1/completions", json={"prompt": "word " * 780_000})
            tokenized_too_long = entered.is_set()
            # a prompt tokenized, then refused: more tokens than the 1,024 of this engine's context
            post = asyncio.ensure_future(client.post("/v1/completions", json={"prompt": PROMPT}))
            while not entered.is_set() and not post.done():
                await asyncio.sleep(0.01)
            health = await client.get("/health")
            answered.set()
            refused = await post
            assert health.status_code == 200 and refused.status_code == 400, (health.text, refused.text)
            assert f"{len(loaded.tokenizer.encode(PROMPT))} tokens do not fit" in refused.json()["error"]["message"]
            return too_long, refused, tokenized_too_long

    try:
        too_long, _, tokenized_too_long = asyncio.run(scenario())
    finally:
        answered.set()
        thread.stop()
    assert too_long.status_code == 400 and too_long.json()["error"]["code"] == "context_length_exceeded"
    assert "at least" in too_long.json()["error"]["message"] and not tokenized_too_long
    assert held == [True]  # /health answered while the prompt was being tokenized


HOLD_S = 60.0  # the gated tokenizer's bound: /health answers in well under a second off the loop
PROMPT = "word " * 2000


def test_the_tokenizer_lets_other_threads_run(loaded):
    """encode releases the GIL: a thread that wakes every millisecond keeps waking while a
    2 MB text is tokenized (with the GIL held it woke twice in 2 s)."""
    text = "word " * 400_000
    num_wakes, stop = [0], threading.Event()

    def wake() -> None:
        while not stop.is_set():
            num_wakes[0] += 1
            time.sleep(0.001)

    waker = threading.Thread(target=wake)
    waker.start()
    start = time.monotonic()
    try:
        ids = loaded.tokenizer.encode(text)
    finally:
        took = time.monotonic() - start
        stop.set()
        waker.join()
    assert ids == [
        *([loaded.tokenizer.bos_token_id] if loaded.tokenizer.add_bos_token else []),
        *loaded.tokenizer.tokenizer.encode(text, add_special_tokens=False).ids,
    ]
    assert num_wakes[0] >= min(100, took * 100), (num_wakes, took)


def test_the_tokens_bytes_the_stream_reads_join_to_what_decode_gives(loaded):
    """The stream tells half a character (left out of an aborted stream's end) from a U+FFFD
    the model wrote by the tokens' bytes: they must be what the text's decode joins. Every
    token alone, and random runs of tokens (special ones among them, which decode skips)."""
    import random

    from kvpool.server.protocol import decoded_bytes

    tok = loaded.tokenizer
    token_bytes = decoded_bytes(tok)
    vocab_size = tok.tokenizer.get_vocab_size()
    specials = [t for t in range(vocab_size) if token_bytes(t) == b""]
    assert 0 < len(specials) < 50 and tok.eos_token_id in specials
    for t in range(vocab_size):
        assert tok.decode([t]) == token_bytes(t).decode("utf-8", errors="replace"), t
    rng = random.Random(0)
    for _ in range(3000):
        ids = [
            rng.choice(specials) if rng.random() < 0.1 else rng.randrange(vocab_size) for _ in range(rng.randint(1, 6))
        ]
        assert tok.decode(ids) == b"".join(map(token_bytes, ids)).decode("utf-8", errors="replace"), ids


def test_no_token_spans_more_bytes_than_the_bound_the_server_refuses_by(loaded):
    """The 400 without tokenizing rests on this: a text whose B bytes have a token each
    (the others are dropped) has at least ceil(B / longest token's bytes) tokens. Checked on
    texts mixing scripts, digits, spaces, the chat template's control tokens and characters
    of planes 4-16, whose lead byte SmolLM2's vocabulary lacks."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from kvpool.server.protocol import TokenBound, TokenText

    tok = loaded.tokenizer
    tt = TokenText(tok.tokenizer.id_to_token)
    bound = TokenBound(tt, tok.tokenizer.get_vocab_size())  # the server's own bound
    assert 0xF1 in bound.untokenized  # SmolLM2 has no token for it: the byte is dropped
    pieces = st.sampled_from(
        ["word ", " ", "    ", "\n\n", "1234", "日本語", "é", "<|im_start|>", "=" * 40, "🙂", "\U00040000"]
    )
    texts = st.lists(st.one_of(pieces, st.text(max_size=20)), max_size=60).map("".join)

    @settings(max_examples=200, deadline=None)
    @given(texts)
    def check(text: str) -> None:
        try:
            num_bytes = bound.num_bytes(text)
        except UnicodeEncodeError:
            return  # a lone surrogate: refused before this point
        ids = tok.tokenizer.encode(text, add_special_tokens=False).ids
        assert sum(len(tt.bytes(t)) for t in ids) == num_bytes  # every byte in exactly one token
        assert len(ids) >= bound.least_tokens(num_bytes)

    check()


# ---- the app, in-process over raw ASGI: bodies that never arrive whole -----------------------


def _app_over(loaded, tokenizer=None, **options):
    """The server's app over a started engine thread (options: ServerState's; the model's
    tokenizer unless another is given), and the thread."""
    from kvpool.engine.build import build_engine
    from kvpool.server.app import ServerState, build_app
    from kvpool.server.engine_thread import EngineThread

    engine = build_engine(loaded, num_blocks=64, block_size=16)
    thread = EngineThread(engine, loaded.tokenizer.decode)
    tokenizer = tokenizer or loaded.tokenizer
    state = ServerState(thread, tokenizer, ServerMetrics(MODEL), MODEL, engine.runner.max_model_len, **options)
    app = build_app(state)
    thread.start()
    return app, thread


async def _post(app, messages: list[dict], headers: list[tuple[bytes, bytes]]) -> list[dict]:
    """POST /v1/completions whose receive() hands out `messages`, then waits forever (a client
    that stopped sending); -> what the app sent back."""
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/v1/completions",
        "raw_path": b"/v1/completions",
        "root_path": "",
        "query_string": b"",
        "headers": [(b"host", b"test"), *headers],
        "client": ("127.0.0.1", 50000),
        "server": ("127.0.0.1", 8000),
    }
    pending = list(messages)
    sent: list[dict] = []

    async def receive() -> dict:
        if pending:
            return pending.pop(0)
        await asyncio.Event().wait()  # nothing more comes
        raise AssertionError("unreachable")

    async def send(message: dict) -> None:
        sent.append(message)

    await app(scope, receive, send)
    return sent


def test_a_client_that_drops_its_upload_gets_no_traceback_in_the_log(loaded, capfd):
    """A body cut by the client's disconnect: the handler ends quietly (499, nobody reads it),
    where starlette's ClientDisconnect escaped it as a 500 and a logged traceback."""
    app, thread = _app_over(loaded)
    partial = {"type": "http.request", "body": b'{"prompt"', "more_body": True}
    try:
        for headers in ([(b"content-length", b"100")], [(b"transfer-encoding", b"chunked")]):
            sent = asyncio.run(_post(app, [partial, {"type": "http.disconnect"}], headers))
            assert [m["status"] for m in sent if m["type"] == "http.response.start"] == [499], sent
    finally:
        thread.stop()
    assert "Traceback" not in capfd.readouterr().err


def test_a_body_that_stops_arriving_is_answered_in_bounded_time(loaded):
    """A client that sent part of its body and then nothing held its handler forever, and a
    stopping server waited out its whole grace for it, then logged the cancelled handler."""
    partial = [{"type": "http.request", "body": b'{"prompt"', "more_body": True}]
    length = [(b"content-length", b"100")]

    def status(sent: list[dict]) -> int:
        return next(m["status"] for m in sent if m["type"] == "http.response.start")

    app, thread = _app_over(loaded, body_timeout_s=0.5)
    try:
        start = time.monotonic()
        sent = asyncio.run(asyncio.wait_for(_post(app, partial, length), 10))
        assert status(sent) == 408 and 0.5 <= time.monotonic() - start < 5
        body = json.loads(next(m["body"] for m in sent if m["type"] == "http.response.body"))
        assert body["error"]["code"] == "request_timeout" and "0.5 s" in body["error"]["message"], body
    finally:
        thread.stop()

    app, thread = _app_over(loaded)  # the default bound (a minute): the stop ends the wait first

    async def stop_meanwhile() -> list[dict]:
        waiting = asyncio.ensure_future(_post(app, partial, length))
        await asyncio.sleep(0.3)
        thread.stop()
        return await asyncio.wait_for(waiting, 5)

    sent = asyncio.run(stop_meanwhile())
    assert status(sent) == 503, sent
    body = json.loads(next(m["body"] for m in sent if m["type"] == "http.response.body"))
    assert body["error"]["code"] == "server_shutting_down", body


def test_every_answer_of_a_stopped_server_carries_the_code_clients_key_on(loaded):
    """A completion sent after the stop: 503 with code server_shutting_down, as the body still
    arriving and the request cut mid-way get (docs/serving.md), not a 503 without a code."""
    app, thread = _app_over(loaded)
    thread.stop()
    whole = [{"type": "http.request", "body": json.dumps({"prompt": "hi", "max_tokens": 2}).encode()}]
    sent = asyncio.run(asyncio.wait_for(_post(app, whole, [(b"content-type", b"application/json")]), 10))
    assert next(m["status"] for m in sent if m["type"] == "http.response.start") == 503, sent
    body = json.loads(next(m["body"] for m in sent if m["type"] == "http.response.body"))
    assert body["error"]["code"] == "server_shutting_down" and body["error"]["type"] == "server_error", body


def test_an_unknown_endpoint_or_method_gets_an_openai_error_naming_it(loaded):
    """`POST /v1/embeddings`, `GET /v1/completions`: starlette's {"detail": "Not Found"} was no
    OpenAI error object (no message a client shows, nothing naming what is served)."""
    app, thread = _app_over(loaded)

    async def ask() -> list[httpx.Response]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return [
                await client.post("/v1/embeddings", json={"input": "hi"}),
                await client.get("/v1/completions"),
            ]

    try:
        missing, wrong_method = asyncio.run(ask())
    finally:
        thread.stop()
    assert missing.status_code == 404, missing.text
    error = missing.json()["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == "not_found", error
    assert "/v1/embeddings" in error["message"] and "/v1/chat/completions" in error["message"], error
    assert "/debug/cache" in error["message"], error  # (every served path, from the routes themselves)
    assert wrong_method.status_code == 405 and wrong_method.headers["allow"] == "POST", wrong_method.headers
    error = wrong_method.json()["error"]
    assert error["code"] == "method_not_allowed" and "GET /v1/completions" in error["message"], error
    assert "POST" in error["message"], error


def test_a_completions_top_logprobs_hold_the_sampled_token_where_it_is_not_among_the_k():
    """OpenAI: "the API will always return the logprob of the sampled token, so there may be up
    to logprobs+1 elements"; vLLM answers so. The sampled token outside the top k was left out
    (and `logprobs: 0` gave {})."""
    from kvpool.server.protocol import TextOffsets, TokenText, completion_logprobs

    tt = TokenText(lambda token_id: "abcdef"[token_id])
    offsets = TextOffsets(tt)
    assert [offsets.add(t) for t in (1, 1, 3)] == [0, 1, 2]  # (the sample's earlier tokens: "bbd")
    entries = [(-0.1, [(0, -0.1), (1, -2.5)]), (-3.0, [(0, -0.5), (1, -1.0)]), (-0.2, []), (-4.0, [])]
    out = completion_logprobs(entries, [0, 4, 2, 5], tt, offsets)
    assert out == {
        "tokens": ["a", "e", "c", "f"],
        "token_logprobs": [-0.1, -3.0, -0.2, -4.0],
        "top_logprobs": [{"a": -0.1, "b": -2.5}, {"a": -0.5, "b": -1.0, "e": -3.0}, {"c": -0.2}, {"f": -4.0}],
        "text_offset": [3, 4, 5, 6],
    }
