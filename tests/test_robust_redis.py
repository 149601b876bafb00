"""Issue 28 section 5, the Redis tier: a fault is a miss, never a crash, a hang or a stall.
Each test starts its own redis-server on 127.0.0.1 and a free port (the `redis_server`
fixture) and faults it for real: a key of the wrong type, a database the server does not
have, SIGSTOP, FLUSHALL, a kill and restart, `maxmemory` with `noeviction`. The engine
tests run a small random Llama (tests/random_llama.py) in fp64 through the runner llama_runner builds and
compare its tokens and logits with the same requests on an engine without the tier."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from collections.abc import Callable
from urllib.parse import quote

import pytest
import redis
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from kvpool.engine.engine import Engine
from kvpool.engine.llama_runner import llama_runner
from kvpool.engine.sampling import SamplingParams
from kvpool.tiers.redis_tier import RedisTier, check_url, redact_url
from random_llama import DESCRIPTOR, random_ids, random_llama
from test_disk_tier import descriptor, key, tensors


def wait_until(condition: Callable[[], bool], timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def tier(server, **kw) -> tuple[RedisTier, list[str]]:
    """A tier on `server` whose warning lines are collected."""
    lines: list[str] = []
    return RedisTier(server.url, log=lines.append, **kw), lines


def client(server) -> redis.Redis:
    return redis.Redis.from_url(server.url)


def entry_keys(server) -> list[bytes]:
    return sorted(k for k in client(server).keys("kvpool:*") if k != b"kvpool:generation")


# ----- the engine: a small random Llama, fp64 ------------------------------------------------


@pytest.fixture(scope="module")
def model(one_thread):
    return random_llama("cpu", torch.float64)


def engine(model, tiers=(), num_blocks: int = 32) -> Engine:
    runner = llama_runner(model, num_blocks, 16, DESCRIPTOR, persistent_tiers=list(tiers))
    return Engine(runner, record_logits=True)


def serve(e: Engine, prompt: list[int], rid: str, step_s: list[float] | None = None):
    """(the output, its logits [tokens, vocab]); each step's wall time into step_s."""
    e.add_request(prompt, SamplingParams(max_tokens=3, ignore_eos=True), rid)
    while e.has_unfinished():
        start = time.perf_counter()
        e.step()
        if step_s is not None:
            step_s.append(time.perf_counter() - start)
        e.runner.check_integrity()
    return e.output(rid), torch.stack(e.requests[rid].seqs[0].logits)


def reference(model, prompts: list[list[int]]) -> list[tuple[list[int], torch.Tensor]]:
    e = engine(model, num_blocks=64)
    outs = [serve(e, p, f"ref{i}") for i, p in enumerate(prompts)]
    return [(o.completions[0].token_ids, logits) for o, logits in outs]


def tokens(out) -> list[int]:
    return out.completions[0].token_ids


def stored(model, server, seed: int) -> tuple[list[int], list[int], torch.Tensor]:
    """(prompt, its reference tokens, logits): a 50-token prompt (3 full blocks) that an
    engine has served, its blocks stored on `server`, and the same request's output on an
    engine without the tier."""
    prompt = random_ids(50, seed)
    ((ref_tokens, ref_logits),) = reference(model, [prompt])
    first = engine(model, [RedisTier(server.url)])
    serve(first, prompt, "a")
    first.runner.close()
    return prompt, ref_tokens, ref_logits


# ----- WRONGTYPE --------------------------------------------------------------------------


def test_a_key_of_the_wrong_type_is_a_counted_miss_and_the_engine_serves_on(model, redis_server) -> None:
    prompt, ref_tokens, ref_logits = stored(model, redis_server, 1)
    keys = entry_keys(redis_server)
    assert len(keys) == 3
    c = client(redis_server)
    for k in keys:  # another program's strings where the entries were
        c.delete(k)
        c.set(k, b"not a hash")
    lines: list[str] = []
    redis_tier = RedisTier(redis_server.url, log=lines.append)
    second = engine(model, [redis_tier])
    out, logits = serve(second, prompt, "b")  # before: redis.ResponseError out of engine.step()
    assert tokens(out) == ref_tokens and torch.equal(logits, ref_logits) and out.num_cached_tokens == 0
    assert second.runner.flush_tiers(30)
    report = second.runner.tier_reports()["redis_tier"]
    assert report["misses"] == {"error": 1}  # the first block's lookup: the prefix ends there
    # ... and the three writes met them: each foreign value (never an entry) was replaced
    assert report["errors"] == {"WRONGTYPE": 3} and report["num_errors"] == 3
    assert report["num_puts"] == 3 and report["num_write_errors"] == 0
    assert len(lines) == 1 and "WRONGTYPE" in lines[0]
    assert all(c.type(k) == b"hash" for k in entry_keys(redis_server)) and len(entry_keys(redis_server)) == 3
    second.runner.close()
    third = engine(model, [RedisTier(redis_server.url)])
    out, logits = serve(third, prompt, "c")
    assert out.num_cached_tokens == 48 and tokens(out) == ref_tokens
    assert (logits - ref_logits).abs().max().item() <= 1e-12  # a hit computes the last token alone
    third.runner.close()


def test_a_write_onto_a_key_of_the_wrong_type_is_counted_and_replaces_it(redis_server) -> None:
    t, lines = tier(redis_server)
    rkey = RedisTier.redis_key(key(1), descriptor(1))
    client(redis_server).set(rkey, b"foreign")
    assert t.put(key(1), descriptor(1), tensors(1)) and t.put(key(2), descriptor(2), tensors(2))
    assert t.flush(30)  # before: the writer swallowed the ResponseError, counted nowhere
    assert t.stats.num_puts == 2 and t.stats.num_write_errors == 0 and client(redis_server).type(rkey) == b"hash"
    assert t.report()["errors"] == {"WRONGTYPE": 1} and len(lines) == 1 and "WRONGTYPE" in lines[0]
    reader, _ = tier(redis_server)
    got = reader.get(key(1), descriptor(1))
    assert got is not None and torch.equal(got["v"], tensors(1)["v"])
    t.check_integrity()


def test_an_entry_with_a_header_and_no_data_is_a_corrupt_miss_and_deleted(redis_server) -> None:
    """A partial foreign write (the header `m`, no data `d`) hit every lookup and missed every
    get ("absent") without ever being deleted."""
    writer, _ = tier(redis_server)
    assert writer.put(key(1), descriptor(1), tensors(1)) and writer.flush(30)
    rkey = RedisTier.redis_key(key(1), descriptor(1))
    client(redis_server).hdel(rkey, "d")
    t, _ = tier(redis_server)
    assert not t.lookup(key(1), descriptor(1))
    assert (t.stats.num_corrupt, t.stats.misses["corrupt"], client(redis_server).exists(rkey)) == (1, 1, 0)
    assert t.get(key(1), descriptor(1)) is None and t.stats.misses["absent"] == 1
    t.check_integrity()


@pytest.mark.parametrize("field", ["m", "d"])
def test_a_good_entry_written_between_reading_a_corrupt_one_and_deleting_it_stays(redis_server, monkeypatch, field):
    """_refuse deleted the key unwatched: a good entry another process wrote between the
    read and the delete was lost. Now it deletes only what it read."""
    import kvpool.tiers.redis_tier as redis_tier

    rkey = RedisTier.redis_key(key(1), descriptor(1))
    client(redis_server).hset(rkey, mapping={"m": b"garbage", "d": b"garbage"})
    other, _ = tier(redis_server)
    decode = redis_tier.entry.peek if field == "m" else redis_tier.entry.decode

    def meanwhile(raw, k):  # (the other process's write lands after this tier's read)
        assert other._write(key(1), descriptor(1), tensors(1))
        return decode(raw, k)

    monkeypatch.setattr(redis_tier.entry, "peek" if field == "m" else "decode", meanwhile)
    t, _ = tier(redis_server)
    read = t.lookup if field == "m" else t.get
    assert not read(key(1), descriptor(1)) if field == "m" else read(key(1), descriptor(1)) is None
    assert t.stats.num_corrupt == 1
    monkeypatch.undo()
    got = tier(redis_server)[0].get(key(1), descriptor(1))
    assert got is not None and torch.equal(got["v"], tensors(1)["v"])


def test_a_good_entry_written_between_reading_a_wrong_type_and_deleting_it_stays(redis_server, monkeypatch) -> None:
    """A value of another type under an entry's key is deleted on a read (WRONGTYPE); the
    delete was unwatched, so an entry another process wrote there meanwhile was lost."""
    rkey = RedisTier.redis_key(key(1), descriptor(1))
    client(redis_server).set(rkey, b"a string")
    other, _ = tier(redis_server)
    missed = RedisTier._missed

    def meanwhile(self, rkey, k, answer):  # (the other process replaces it after this tier's read)
        client(redis_server).delete(rkey)
        assert other._write(key(1), descriptor(1), tensors(1))
        return missed(self, rkey, k, answer)

    monkeypatch.setattr(RedisTier, "_missed", meanwhile)
    t, _ = tier(redis_server)
    assert not t.lookup(key(1), descriptor(1)) and t.stats.misses["error"] == 1
    monkeypatch.undo()
    got = tier(redis_server)[0].get(key(1), descriptor(1))
    assert got is not None and torch.equal(got["v"], tensors(1)["v"])
    # with nobody writing meanwhile, the foreign value is still deleted
    client(redis_server).set(rkey, b"a string")
    t, _ = tier(redis_server)
    assert not t.lookup(key(1), descriptor(1)) and not client(redis_server).exists(rkey)


# ----- a database the server does not have ------------------------------------------------


@pytest.mark.parametrize(
    ("url", "needle"),
    [("redis://[::1", "Invalid IPv6 URL"), ("unix://", "no socket path"), ("unix:///", "no socket path")],
)
def test_a_redis_url_check_url_cannot_read_names_the_flag(url, needle) -> None:
    """urlsplit's own error named neither the flag nor the URL; a unix:// URL without a
    path passed, and the tier opened on nothing (an outage line, served without Redis)."""
    with pytest.raises(ValueError, match=rf"^--redis {re.escape(repr(url))}: .*{needle}"):
        check_url(url)


@pytest.mark.parametrize(
    ("timeout_s", "retry_s"),
    # (1e10: past threading.TIMEOUT_MAX, an OverflowError from socket.settimeout; audit5 #1)
    [(float("inf"), 1.0), (0.5, float("inf")), (float("nan"), 1.0), (0, 1.0), (1e10, 1.0), (0.5, 1e10)],
)
def test_a_deadline_that_is_not_a_finite_positive_number_is_refused(timeout_s, retry_s) -> None:
    """Every call's deadline is the tier's promise against a stalled server: inf (no
    deadline: a step stalled for ever) passed the check, as did an infinite retry period
    (a breaker never closed again). Refused before any connection (no server here)."""
    with pytest.raises(ValueError, match="timeout_s and retry_s must be finite positive numbers of seconds"):
        RedisTier("redis://127.0.0.1:1/0", timeout_s=timeout_s, retry_s=retry_s)


def test_a_database_the_server_lacks_is_a_value_error_naming_it(redis_server) -> None:
    url = redis_server.url.rsplit("/", 1)[0] + "/99"
    with pytest.raises(ValueError, match=r"database 99.*DB index is out of range"):
        RedisTier(url)
    with pytest.raises(ValueError, match="the database 'x1' is not a number"):
        RedisTier(url.replace("/99", "/x1"))


def test_kvpool_run_with_a_database_the_server_lacks_is_one_error_line(redis_server) -> None:
    url = redis_server.url.rsplit("/", 1)[0] + "/99"
    done = subprocess.run(
        [sys.executable, "-m", "kvpool", "run", "--model", "tiny-dsv4", "--redis", url, "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr
    errors = [line for line in done.stderr.splitlines() if "error" in line.lower()]  # (and progress lines)
    assert len(errors) == 1 and errors[0].startswith("kvpool run: error: --redis") and "database 99" in errors[0]
    assert "Traceback" not in done.stderr and done.stderr.strip().splitlines()[-1] == errors[0]


# ----- a server that wants a password ----------------------------------------------------

SECRET = "hunter2-kvpool"


@pytest.fixture
def locked_server(tmp_path):
    """A redis-server with `requirepass SECRET` (its url names no password)."""
    from kvpool.tiers.redis_server import LocalRedisServer

    with LocalRedisServer(tmp_path, password=SECRET) as server:
        yield server


def _with_password(url: str, password: str) -> str:
    return url.replace("redis://", f"redis://:{password}@")


def test_a_missing_or_wrong_password_is_one_error_that_never_shows_it(locked_server) -> None:
    """A server with requirepass and a URL without a password said "HELLO must be called
    with the client already authenticated"; a wrong password was echoed in the error, and
    the right one in every warning line and in the --json report's url."""
    with pytest.raises(ValueError, match=r"the server requires a password, and the URL gives none"):
        RedisTier(locked_server.url)
    wrong = _with_password(locked_server.url, "not-" + SECRET)
    with pytest.raises(ValueError, match=r"refused the URL's user and password") as refused:
        RedisTier(wrong)
    assert SECRET not in str(refused.value) and ":***@127.0.0.1" in str(refused.value)
    t, lines = tier(type("S", (), {"url": _with_password(locked_server.url, SECRET)}))
    assert t.available and t.put(key(1), descriptor(1), tensors(1)) and t.flush(10)
    assert t.get(key(1), descriptor(1)) is not None  # the password works: the entry round-trips
    locked_server.kill()
    assert not t.lookup(key(1), descriptor(1))
    report = t.report()
    assert len(lines) == 1 and "unavailable" in lines[0]
    assert SECRET not in lines[0] + str(report) and report["url"].startswith("redis://:***@127.0.0.1:")
    t.close()


@pytest.mark.parametrize(
    "url",
    [
        "redis://:%s@127.0.0.1:port/0",
        "redis://user:%s@[::1/0",
        "redis://127.0.0.1:port/0?password=%s",
        "redis://:se/%s@127.0.0.1:6379/0",  # a raw '/' in the password: it was shown whole
        "redis://user:%s/a@b@127.0.0.1:6379/0",
        # review 9: no '//' (mistyped), shown whole in the refusal
        "user:%s@127.0.0.1:6379",
        "redis:/:%s@127.0.0.1:6379",
        ":%s@127.0.0.1:6379",
        "redis:%s@127.0.0.1",
    ],
)
def test_a_url_check_url_refuses_never_shows_its_password(url) -> None:
    with pytest.raises(ValueError) as refused:
        check_url(url % SECRET)
    assert SECRET not in str(refused.value) and "***" in str(refused.value)


def test_a_raw_at_sign_in_a_query_value_is_taken_with_a_port_too() -> None:
    """Review 9 #3: '?password=a@b' and '?client_name=me@x' were refused when the URL had a
    port (its ':' read as USER:PASSWORD's), taken without one; redis-py parses them right.
    A password's raw '?' or '/' that puts its '@' in a query redis-py would split otherwise
    stays refused."""
    from redis.connection import parse_url

    for url, meant in [
        ("redis://h:6379/0?password=a@b", {"password": "a@b", "host": "h", "port": 6379, "db": 0}),
        ("redis://h:6379/0?client_name=me@x", {"client_name": "me@x", "host": "h", "port": 6379, "db": 0}),
        ("redis://h/0?password=a@b", {"password": "a@b", "host": "h", "db": 0}),
    ]:
        assert check_url(url) == url and parse_url(url) == meant
    for url in [
        "redis://u:12?ss@h",  # (the password '12?ss': host u, port 12 for redis-py)
        "redis://u:1234?x=1@h",
        "redis://u:1/2@h",
        "redis://:pa#ss@h:6379/0",
        "redis://h:6379/0?password=a&b@c",  # (password 'a', and 'b@c' dropped)
        "redis://h:6379/0?password=a#b@c",  # (password 'a', 'b@c' a fragment)
    ]:
        with pytest.raises(ValueError, match="an '@' after the URL's host part: percent-encode"):
            check_url(url)


_SEPARATORS = "/?#@:&=% ;"  # what ends a URL's parts, raw in a password
_PART = st.text(alphabet="ABCDEFGHJKLMNPQRSTUVWXYZ", min_size=6, max_size=12)  # (no message holds 6 capitals)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@example(head="PAWORD", sep="#", tail="SECRET", form=1)  # review 8 #5's two URLs
@example(head="PAWORD", sep="?", tail="SECRET", form=0)
@example(head="PAWORD", sep="#", tail="SECRET", form=3)
@example(head="PAWORD", sep="@", tail="SECRET", form=3)  # review 9 #3: taken, port or not
@example(head="PAWORD", sep="&@", tail="SECRET", form=3)
@example(head="PAWORD", sep="//", tail="SECRET", form=4)
@example(head="PAWORD", sep="&=", tail="SECRET", form=3)  # audit5 #2: '&=SECRET', an option '' (TypeError)
@given(head=_PART, sep=st.text(alphabet=_SEPARATORS, min_size=1, max_size=3), tail=_PART, form=st.integers(0, 5))
def test_a_password_never_shows_whatever_characters_it_holds(head, sep, tail, form) -> None:
    """redact_url showed a password with a raw '#' or '?' whole (review 8 #5:
    redis://:pa#ss@h:6379/0), and a ?password= value up to a raw '#' or '&'. Neither part of
    a password, raw or percent-encoded, appears in redact_url's text, in check_url's error,
    or in the lines and report of a tier over an unreachable server."""
    password = f"{head}{sep}{tail}"
    url = [
        f"redis://user:{password}@127.0.0.1:1/0",
        f"redis://:{password}@127.0.0.1:1",
        f"redis://:{quote(password, safe='')}@127.0.0.1:1/0",
        f"redis://127.0.0.1:1/0?db=0&password={password}",
        f"user:{password}@127.0.0.1:1",  # mistyped, without '//' (review 9 #10)
        f"redis:/:{password}@127.0.0.1:1",
    ][form]
    # an '@' past the parser's host part: USER:PASSWORD with a raw '/', '?' or '#', or an '@'
    # in the query that a raw '&' or '#' before it takes out of the ?password= value (a raw
    # '@' within the value is parsed right, port or not: review 9 #3)
    before_at = sep[: sep.rindex("@")] if "@" in sep else ""
    past_host = bool(set(sep) & set("/?#")) if form in (0, 1) else form == 3 and bool(set(before_at) & set("&#"))
    expected = [
        "redis://user:***@127.0.0.1:1/0",
        "redis://:***@127.0.0.1:1",
        "redis://:***@127.0.0.1:1/0",
        "redis://127.0.0.1:***" if "@" in sep else "redis://127.0.0.1:1/0?db=0&password=***",
        "user:***@127.0.0.1:1",
        "redis:***@127.0.0.1:1",
    ]
    assert redact_url(url) == expected[form]
    lines: list[str] = []
    try:
        check_url(url)
        t = RedisTier(url, timeout_s=0.2, log=lines.append)  # (port 1: refused at once, an outage)
    except ValueError as refused:
        if form >= 4:  # (not a redis:// URL at all)
            assert "expected redis://" in str(refused) or "no host" in str(refused), (url, refused)
        elif not past_host and form == 3 and "&" in sep:
            # a raw '&' in ?password=: what follows it is an option of its own, one redis-py's
            # connection does not take (a TypeError traceback; audit5 #2)
            assert "percent-encode a password's '&'" in str(refused), (url, refused)
        else:
            assert past_host and "percent-encode" in str(refused), (url, refused)  # never half-parsed
        said = str(refused)
    else:
        assert not past_host, url
        said = "\n".join(lines) + str(t.report())
        t.close()
    assert head not in said and tail not in said and quote(head) not in said, said


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("redis://127.0.0.1:1/0?foo=1", "redis-py takes no option 'foo' in the URL's query"),
        ("redis://127.0.0.1:1/0?db=0&timeout=1", "redis-py takes no option 'timeout' in the URL's query"),
        ("redis://127.0.0.1:1/0?ssl_min_version=2", "redis-py takes no option 'ssl_min_version'"),
        ("unix:///tmp/kvpool-no.sock?socket_keepalive=1", "redis-py takes no option 'socket_keepalive'"),
        ("redis://127.0.0.1:1/0?password=SECRET&=TAIL", "an option redis-py does not take after ?password="),
        ("redis://127.0.0.1:1/0?password=SECRET&TAIL=x", "an option redis-py does not take after ?password="),
    ],
)
def test_a_query_option_the_connection_does_not_take_is_refused_in_one_line(url, message, capsys) -> None:
    """audit5 #2: redis-py hands every query name with a value to its connection class, and
    one that class does not take (a typo, ?timeout=, an ssl_ option on redis://, the tail of
    a password with a raw '&') was a TypeError traceback at the first connection (kvpool run:
    after the model loaded). Now check_url's ValueError, with `kvpool run`'s one line before
    the model loads; the tail of a password never shown."""
    from kvpool.cli.main import main

    with pytest.raises(ValueError, match=re.escape(message)) as refused:
        check_url(url)
    assert "SECRET" not in str(refused.value) and "TAIL" not in str(refused.value)
    with pytest.raises(ValueError, match=re.escape(message)):
        RedisTier(url, timeout_s=0.2)
    assert main(["run", "--model", "tiny-dsv4", "--num-requests", "1", "--redis", url]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvpool run: error: --redis ") and message in err and len(err.splitlines()) == 1, err
    assert "SECRET" not in err and "TAIL" not in err


@pytest.mark.parametrize(
    "url",
    [
        "redis://127.0.0.1:1/0?socket_timeout=0.5&client_name=me&max_connections=4",
        "redis://127.0.0.1:1/0?foo=",  # (an empty value: redis-py drops it)
        "redis://127.0.0.1:1/0?password=SEC%26RET",
        "rediss://127.0.0.1:1/0?ssl_min_version=2",
    ],
)
def test_a_query_option_the_connection_takes_is_served(url) -> None:
    """What redis-py's connection takes still passes: an unreachable server is an outage."""
    lines: list[str] = []
    tier = RedisTier(check_url(url), timeout_s=0.2, log=lines.append)
    assert not tier.available and lines and "SEC" not in "\n".join(lines)
    tier.close()


# ----- a host name the resolver does not answer ---------------------------------------------


def test_a_host_name_that_does_not_resolve_costs_one_deadline_not_the_resolvers_timeout(
    redis_server, monkeypatch
) -> None:
    """redis-py resolved the host before the connect deadline started: a DNS server down
    cost the resolver's own timeout (3 s here; 5 s a try for glibc) on the engine's thread,
    whatever timeout_s said (atier's log). Now the name resolves within the deadline, the
    background checks do not pile up lookups while one hangs, and a name that resolves still
    serves (TLS would check the certificate against it)."""
    import socket
    import threading

    real = socket.getaddrinfo

    def resolver(host, *args, **kwargs):
        if host == "slow.invalid":
            time.sleep(3)
            raise socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")
        return real(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", resolver)
    lines: list[str] = []
    began = time.perf_counter()
    t = RedisTier("redis://slow.invalid:6379/0", timeout_s=0.3, retry_s=0.2, log=lines.append)
    assert time.perf_counter() - began < 1.5 and not t.available  # (3.0 s before)
    assert len(lines) == 1 and "unavailable" in lines[0] and "slow.invalid" in lines[0], lines
    began = time.perf_counter()
    while time.perf_counter() - began < 1.0:  # background checks every 0.2 s meanwhile
        assert not t.lookup(key(1), descriptor(1))
        time.sleep(0.05)
    lookups = [th for th in threading.enumerate() if th.name == "kvpool-redis-resolve"]
    assert len(lookups) <= 1, lookups  # one hung lookup at a time, not one a check
    t.close()
    by_name = redis_server.url.replace("127.0.0.1", "localhost")
    lines = []
    t = RedisTier(by_name, log=lines.append)
    assert t.available and t.put(key(2), descriptor(2), tensors(2)) and t.flush(10)
    assert t.get(key(2), descriptor(2)) is not None and lines == []
    t.close()


# ----- a stalled server (SIGSTOP) ---------------------------------------------------------


def test_a_stalled_server_costs_one_deadline_then_nothing_until_it_is_back(redis_server) -> None:
    deadline = 0.3
    t, lines = tier(redis_server, timeout_s=deadline, retry_s=0.2)
    t.put(key(1), descriptor(1), tensors(1))
    assert t.flush(30) and t.lookup(key(1), descriptor(1))
    redis_server.pause()
    calls: list[float] = []
    start = time.monotonic()
    while time.monotonic() - start < 1.5:  # several retry periods: before, each one cost a deadline
        began = time.perf_counter()
        assert not t.lookup(key(1), descriptor(1))
        calls.append(time.perf_counter() - began)
        time.sleep(0.01)
    slow = [s for s in calls if s > deadline / 2]
    assert len(slow) <= 1 and max(calls) < deadline + 0.25, (len(calls), slow)
    assert not t.available and t.num_outages == 1 and len(lines) == 1 and "unavailable" in lines[0]
    redis_server.resume()
    assert wait_until(lambda: t.lookup(key(1), descriptor(1)) or t.available)  # the breaker closes
    assert t.lookup(key(1), descriptor(1)) and lines[-1].endswith("is back")
    t.check_integrity()


def test_a_stalled_server_stalls_no_engine_step_but_the_first(model, redis_server) -> None:
    deadline = 0.4
    shared = random_ids(32, 100)  # two blocks every prompt starts with
    redis_tier = RedisTier(redis_server.url, timeout_s=deadline, retry_s=0.2, log=lambda line: None)
    e = engine(model, [redis_tier], num_blocks=8)
    ref = engine(model, num_blocks=8)  # the same engine without the tier
    serve(e, shared + random_ids(9, 0), "r0")
    serve(ref, shared + random_ids(9, 0), "r0")
    assert e.runner.flush_tiers(30)
    redis_server.pause()
    step_s: list[float] = []
    start, i = time.monotonic(), 1
    while time.monotonic() - start < 2.0:  # ten retry periods: before, each one cost a deadline
        prompt = shared + random_ids(20, i)  # a third block that only the tier could hold
        out, logits = serve(e, prompt, f"r{i}", step_s)
        ref_out, ref_logits = serve(ref, prompt, f"r{i}")
        assert tokens(out) == tokens(ref_out) and torch.equal(logits, ref_logits)
        i += 1
    slow = [s for s in step_s if s > 0.75 * deadline]
    assert len(slow) <= 1 and max(step_s) < deadline + 0.3, (len(step_s), slow)
    assert not redis_tier.available and redis_tier.stats.misses["unavailable"] >= 1
    redis_server.resume()
    assert wait_until(lambda: redis_tier.ping() or redis_tier.available)
    hits = redis_tier.stats.num_lookup_hits
    fresh = engine(model, [redis_tier], num_blocks=8)  # the breaker is closed: the tier serves again
    out, _ = serve(fresh, shared + random_ids(9, 0), "again")
    assert out.num_cached_tokens == 32 and redis_tier.stats.num_lookup_hits == hits + 2
    e.runner.close()


# ----- FLUSHALL, a restart, writes refused during an outage ---------------------------------


@pytest.mark.parametrize("loss", ["flushall", "restart"])
def test_after_flushall_or_a_restart_the_blocks_are_written_again(redis_server, loss) -> None:
    t, _ = tier(redis_server, retry_s=0.1)
    for i in range(3):
        t.put(key(i), descriptor(i), tensors(i))
    assert t.flush(30) and t.holds(key(0), descriptor(0))
    if loss == "flushall":
        client(redis_server).flushall()
    else:  # between two calls of the tier: it never saw the server away
        redis_server.kill()
        redis_server.start()
    # holds() asks the server in the background, at most every retry_s: the belief ends
    assert wait_until(lambda: not t.holds(key(0), descriptor(0)), 5), "still believes its blocks are stored"
    assert wait_until(lambda: t.ping() or t.available) and t.num_entries == 0
    assert t.report()["resets"] + t.report()["outages"] == 1  # (a restart may be seen as an outage)
    for i in range(3):  # the write path: a block nobody holds is written again
        assert not t.holds(key(i), descriptor(i)) and t.put(key(i), descriptor(i), tensors(i))
    assert t.flush(30) and len(entry_keys(redis_server)) == 3
    t.check_integrity()


def test_a_value_of_another_type_at_the_generation_key_is_replaced_and_a_loss_still_seen(redis_server) -> None:
    """A hash at kvpool:generation (another program's, a typo in redis-cli): the tier
    replaces it with a generation of its own (it can never be one), so a FLUSHALL after it
    still ends the belief in the blocks stored. It read WRONGTYPE at every check and, never
    seeing a generation, believed its blocks stored forever: none was written again."""
    c = client(redis_server)
    c.hset("kvpool:generation", "x", "y")
    t, lines = tier(redis_server, retry_s=0.05)
    assert c.type("kvpool:generation") == b"string"
    assert t.put(key(1), descriptor(1), tensors(1, 64)) and t.flush(30) and t.holds(key(1), descriptor(1))
    c.flushall()
    c.hset("kvpool:generation", "x", "y")
    assert wait_until(lambda: not t.holds(key(1), descriptor(1)), 3), "still believes its block is stored"
    assert t.num_resets == 1 and t.errors == {"WRONGTYPE": 2}
    assert t.put(key(1), descriptor(1), tensors(1, 64)) and t.flush(30) and len(entry_keys(redis_server)) == 1
    assert c.type("kvpool:generation") == b"string"
    t.check_integrity()


def test_an_engine_rewrites_its_blocks_after_flushall(model, redis_server) -> None:
    prompts = [random_ids(50, 7)] + [random_ids(50, s) for s in (8, 9, 10)]
    expected = reference(model, prompts)
    redis_tier = RedisTier(redis_server.url, retry_s=0.1)
    e = engine(model, [redis_tier], num_blocks=6)
    serve(e, prompts[0], "p")
    assert e.runner.flush_tiers(30) and len(entry_keys(redis_server)) == 3
    client(redis_server).flushall()
    assert wait_until(lambda: redis_tier.ping() and redis_tier.num_entries == 0, 5)
    for i in (1, 2, 3):  # the device pool (6 blocks) evicts p's blocks: they go to Redis again
        out, logits = serve(e, prompts[i], f"q{i}")
        assert tokens(out) == expected[i][0] and torch.equal(logits, expected[i][1])
    e.runner.close()
    fresh = engine(model, [RedisTier(redis_server.url)])
    out, logits = serve(fresh, prompts[0], "p")
    assert out.num_cached_tokens == 48 and tokens(out) == expected[0][0]
    fresh.runner.close()


def test_writes_refused_during_an_outage_are_written_when_it_ends(redis_server) -> None:
    t, lines = tier(redis_server, retry_s=0.1)
    assert t.put(key(1), descriptor(1), tensors(1)) and t.flush(30)
    redis_server.kill()
    assert not t.lookup(key(1), descriptor(1))  # the outage is seen
    for i in (2, 3):
        assert t.put(key(i), descriptor(i), tensors(i))  # kept for later, not lost
    assert t.flush(30) and t.report()["deferred_puts"] == 2
    redis_server.start()  # empty, on the same port
    assert wait_until(lambda: t.ping() or t.available)
    assert t.flush(30)
    assert entry_keys(redis_server) == sorted(RedisTier.redis_key(key(i), descriptor(i)).encode() for i in (2, 3))
    assert t.report()["retried_puts"] == 2 and t.holds(key(2), descriptor(2)) and not t.holds(key(1), descriptor(1))
    reader, _ = tier(redis_server)
    got = reader.get(key(3), descriptor(3))
    assert got is not None and torch.equal(got["k"], tensors(3)["k"])
    assert len(lines) == 2 and "unavailable" in lines[0] and lines[1].endswith("is back")
    t.check_integrity()


# ----- maxmemory + noeviction -------------------------------------------------------------


def test_writes_the_server_refuses_for_memory_are_counted_in_the_report(model, redis_server) -> None:
    c = client(redis_server)
    used = int(c.info("memory")["used_memory"])
    c.config_set("maxmemory-policy", "noeviction")
    c.config_set("maxmemory", used + (1 << 20))  # room for about half the blocks (64 KiB each)
    prompts = [random_ids(50, s) for s in range(20, 28)]  # 24 full blocks
    expected = reference(model, prompts)
    lines: list[str] = []
    redis_tier = RedisTier(redis_server.url, log=lines.append)
    e = engine(model, [redis_tier], num_blocks=64)
    for i, p in enumerate(prompts):
        out, logits = serve(e, p, f"r{i}")
        assert tokens(out) == expected[i][0] and torch.equal(logits, expected[i][1])
    assert e.runner.flush_tiers(30)
    report = e.runner.tier_reports()
    stored = len(entry_keys(redis_server))
    assert 0 < stored < 24 and report["tiers"]["blocks_persisted"] == 24
    r = report["redis_tier"]
    assert r["num_puts"] == stored and r["num_write_errors"] == 24 - stored  # before: 0 write errors
    assert r["errors"] == {"OOM": 24 - stored} and len(lines) == 1 and "OOM" in lines[0]
    e.runner.close()


# ----- the background writer ----------------------------------------------------------------


def test_a_writer_job_that_raises_is_counted_with_its_error_and_the_next_jobs_run() -> None:
    from kvpool.tiers.writer import BackgroundWriter

    writer, done = BackgroundWriter("test", 1 << 20), []

    def bad() -> None:
        raise RuntimeError("a bug in a write")

    assert writer.submit(bad, 10) and writer.submit(lambda: done.append(1), 10) and writer.flush(10)
    assert writer.num_failed == 1 and writer.last_error == "RuntimeError: a bug in a write" and done == [1]
    assert writer.pending_bytes == 0 and writer.close(10)


def test_an_engine_rewrites_every_entry_with_a_corrupted_payload_in_one_run(model, redis_server) -> None:
    prompt, ref_tokens, ref_logits = stored(model, redis_server, 11)
    c = client(redis_server)
    for k in entry_keys(redis_server):
        data = bytearray(c.hget(k, "d"))
        data[-3] ^= 0xFF  # the payload: every header (what a lookup reads) still checks out
        c.hset(k, "d", bytes(data))
    second = engine(model, [RedisTier(redis_server.url)])
    out, logits = serve(second, prompt, "b")
    assert tokens(out) == ref_tokens and torch.equal(logits, ref_logits) and out.num_cached_tokens == 0
    assert second.runner.flush_tiers(30)
    report = second.runner.tier_reports()["redis_tier"]
    # block 0's get found it corrupt; the lookups that had passed blocks 1 and 2 on their
    # headers alone must not make holds() skip their rewrite (before: 1 put, 2 left corrupt)
    assert report["num_corrupt"] == 1 and report["num_puts"] == 3
    second.runner.close()
    from kvpool.tiers import entry

    for k in entry_keys(redis_server):  # every payload checks out again
        entry.decode(c.hget(k, "d"), bytes.fromhex(k.decode().rpartition(":")[2]))


@pytest.mark.parametrize("change", ["shape", "dtype"])
def test_an_entry_of_the_wrong_shape_or_dtype_is_a_corrupt_miss_and_the_engine_serves_on(
    model, redis_server, change
) -> None:
    from kvpool.tiers import entry

    prompt, ref_tokens, ref_logits = stored(model, redis_server, 12)
    c = client(redis_server)
    for k in entry_keys(redis_server):  # valid checksums, tensors that are not this engine's blocks
        key_bytes = bytes.fromhex(k.decode().rpartition(":")[2])
        desc, t = entry.decode(c.hget(k, "d"), key_bytes)
        bad = {n: x[..., :-1].contiguous() if change == "shape" else x.float() for n, x in t.items()}
        data = entry.encode(key_bytes, desc, bad)
        c.hset(k, mapping={"m": data[: 8 + entry.header_length(data)], "d": data})
    second = engine(model, [RedisTier(redis_server.url)])
    out, logits = serve(second, prompt, "b")  # before: AssertionError (shape) or a silent cast (dtype)
    assert tokens(out) == ref_tokens and torch.equal(logits, ref_logits) and out.num_cached_tokens == 0
    assert second.runner.flush_tiers(30)
    report = second.runner.tier_reports()["redis_tier"]
    assert report["misses"] == {"corrupt": 1} and report["num_corrupt"] == 1 and report["num_puts"] == 3
    second.runner.close()
    third = engine(model, [RedisTier(redis_server.url)])
    out, logits = serve(third, prompt, "c")
    assert out.num_cached_tokens == 48 and tokens(out) == ref_tokens
    third.runner.close()
