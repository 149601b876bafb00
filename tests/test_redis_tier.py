"""The Redis tier on a real `redis-server` (started by the tests on 127.0.0.1 and a free
port): entries that come back bit for bit through another client, descriptors field by
field, tenants and models kept apart, corrupted values refused, an outage that degrades to
misses with one warning line and ends when the server is back, and SmolLM2 through it: two
engines and two processes sharing prefixes, and a server killed mid-run."""

from __future__ import annotations

import dataclasses
import json
import random
import subprocess
import sys
import time

import pytest
import redis
import torch

from kvpool.tiers import BlockDescriptor
from kvpool.tiers.redis_tier import RedisTier
from test_disk_tier import descriptor, key, tensors


def tier(server, **kw) -> tuple[RedisTier, list[str]]:
    """A tier on `server` whose warning lines are collected."""
    lines: list[str] = []
    return RedisTier(server.url, log=lines.append, **kw), lines


def test_an_entry_comes_back_bit_for_bit_through_another_client(redis_server) -> None:
    writer, _ = tier(redis_server)
    for i in range(3):
        assert writer.put(key(i), descriptor(i), tensors(i))
    assert writer.flush(30) and writer.stats.num_puts == 3 and writer.num_entries == 3
    writer.check_integrity()
    reader, _ = tier(redis_server)  # another process's view: knows nothing yet
    assert reader.num_entries == 0 and not reader.contains(key(0))
    for i in range(3):
        assert reader.lookup(key(i), descriptor(i))
        got = reader.get(key(i), descriptor(i))
        assert got is not None and all(torch.equal(got[n], tensors(i)[n]) for n in ("k", "v"))
    assert not reader.lookup(key(9), descriptor(9)) and reader.stats.misses == {"absent": 1}
    assert reader.stats.num_gets == 3 and reader.holds(key(1), descriptor(1))
    reader.check_integrity()
    # the value is the disk tier's entry format: a safetensors file with its manifest
    raw = redis.Redis.from_url(redis_server.url).hget(RedisTier.redis_key(key(0), descriptor(0)), "d")
    from safetensors.torch import load

    assert torch.equal(load(raw)["v"], tensors(0)["v"])


@pytest.mark.parametrize(
    "field",
    [
        f.name
        for f in dataclasses.fields(BlockDescriptor)
        if f.name not in ("model_id", "weights_version", "layout_id", "tenant")  # these name the key (below)
    ],
)
def test_a_descriptor_mismatch_is_a_miss_counted_by_field_and_reclaimed(redis_server, field) -> None:
    writer, _ = tier(redis_server)
    writer.put(key(1), descriptor(1), tensors(1))
    writer.flush(30)
    old = getattr(descriptor(1), field)
    other = (old[:-1] + (999,)) if isinstance(old, tuple) else old + 1 if isinstance(old, int) else f"{old}x"
    reader, _ = tier(redis_server)
    assert not reader.lookup(key(1), descriptor(1, **{field: other}))
    assert reader.stats.mismatches == {field: 1} and reader.stats.misses == {"mismatch": 1}
    assert reader.stats.num_reclaimed == 1
    assert not reader.lookup(key(1), descriptor(1))  # reclaimed: gone for everyone
    assert redis.Redis.from_url(redis_server.url).keys() == [b"kvpool:generation"]  # (redis_tier.py: FLUSHALL)


def test_another_tenant_model_weights_or_layout_never_reaches_the_entry(redis_server) -> None:
    """Other weights under one model name were found, refused and deleted: two engines of
    them on one server deleted each other's blocks. They have keys of their own now."""
    writer, _ = tier(redis_server)
    writer.put(key(1), descriptor(1), tensors(1))
    writer.flush(30)
    reader, _ = tier(redis_server)
    changes = ({"tenant": "t1"}, {"model_id": "other"}, {"weights_version": "w2"}, {"layout_id": "L2:bs16:bf16"})
    for change in changes:
        assert not reader.lookup(key(1), descriptor(1, **change))
        assert reader.get(key(1), descriptor(1, **change)) is None
    assert reader.stats.misses == {"absent": 8} and reader.stats.num_reclaimed == 0
    assert reader.lookup(key(1), descriptor(1))  # still there for its own tenant and model


def test_a_corrupted_value_is_a_miss_and_is_deleted(redis_server) -> None:
    writer, _ = tier(redis_server)
    for i in (1, 2):
        writer.put(key(i), descriptor(i), tensors(i))
    writer.flush(30)
    client = redis.Redis.from_url(redis_server.url)
    rkey = RedisTier.redis_key(key(1), descriptor(1))
    data = bytearray(client.hget(rkey, "d"))
    data[-5] ^= 0x10  # inside the tensors: the header (and so a lookup) still passes
    client.hset(rkey, "d", bytes(data))
    reader, _ = tier(redis_server)
    assert reader.lookup(key(1), descriptor(1)) and reader.get(key(1), descriptor(1)) is None
    assert reader.stats.num_corrupt == 1 and reader.stats.misses == {"corrupt": 1} and not client.exists(rkey)
    rkey2 = RedisTier.redis_key(key(2), descriptor(2))
    client.hset(rkey2, "m", b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all}")
    assert not reader.lookup(key(2), descriptor(2)) and reader.stats.num_corrupt == 2 and not client.exists(rkey2)


def test_an_outage_is_misses_and_one_warning_and_the_tier_comes_back(redis_server) -> None:
    t, lines = tier(redis_server, retry_s=0.3)
    t.put(key(1), descriptor(1), tensors(1))
    t.flush(30)
    assert t.lookup(key(1), descriptor(1))
    redis_server.kill()
    start = time.monotonic()
    for i in range(5):
        assert not t.lookup(key(1), descriptor(1)) and t.get(key(1), descriptor(1)) is None
        assert not t.put(key(i + 2), descriptor(i + 2), tensors(i + 2)) or t.flush(5)
    assert time.monotonic() - start < 3  # misses are quick: no waiting on a dead server per call
    assert len(lines) == 1 and "unavailable" in lines[0] and t.num_outages == 1 and not t.available
    assert t.stats.misses["unavailable"] >= 5 and t.num_entries == 0  # nothing is believed held
    redis_server.start()  # an empty server on the same port
    deadline = time.monotonic() + 10  # calls are misses at once; the background asks whether it is back
    while not t.available and time.monotonic() < deadline:
        assert not t.lookup(key(1), descriptor(1))
        time.sleep(0.02)
    assert not t.lookup(key(1), descriptor(1))  # the crash took the entry: a miss, never a wrong block
    assert lines[-1].endswith("is back") and t.available
    assert t.put(key(7), descriptor(7), tensors(7)) and t.flush(30)
    assert t.lookup(key(7), descriptor(7)) and len(lines) == 2
    t.check_integrity()


# ----- SmolLM2 through the Redis tier ------------------------------------------------------


def _prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 49000) for _ in range(n)]


def _serve(engine, prompt, rid, tenant=""):
    from kvpool.engine.sampling import SamplingParams

    rid = engine.add_request(prompt, SamplingParams(max_tokens=3, ignore_eos=True), rid, tenant=tenant)
    while engine.has_unfinished():
        engine.step()
        engine.runner.check_integrity()
    return engine.output(rid), torch.stack(engine.requests[rid].seqs[0].logits)


def test_two_engines_share_prefixes_through_redis_exactly_and_tenants_apart(fp64_model, redis_server) -> None:
    from kvpool.engine.build import build_engine

    p = _prompt(80, 6)
    follow = p + _prompt(20, 7)
    first = build_engine(fp64_model, num_blocks=16, record_logits=True, redis_url=redis_server.url)
    _serve(first, p + [7], "a", tenant="alice")
    first.runner.close()
    second = build_engine(fp64_model, num_blocks=16, record_logits=True, redis_url=redis_server.url)
    out_bob, _ = _serve(second, follow, "bob", tenant="bob")
    out, logits = _serve(second, follow, "b", tenant="alice")
    device = build_engine(fp64_model, num_blocks=64, record_logits=True)
    _serve(device, p + [7], "a", tenant="alice")
    ref_out, ref_logits = _serve(device, follow, "b", tenant="alice")
    assert out_bob.num_cached_tokens == 0  # another tenant: other keys, never alice's blocks
    assert out.num_cached_tokens == ref_out.num_cached_tokens == 80
    assert torch.equal(logits, ref_logits)  # the KV read back from Redis is the KV computed
    report = second.runner.tier_reports()
    assert report["redis_tier"]["num_gets"] == 5 and report["tiers"]["lookup_order"] == ["redis"]
    second.runner.close()


def test_redis_killed_mid_run_degrades_to_misses_and_hits_again_when_back(fp64_model, redis_server, capfd) -> None:
    from kvpool.engine.build import build_engine

    prompts = [_prompt(48, s) for s in (10, 11, 12)]
    device = build_engine(fp64_model, num_blocks=64, record_logits=True)
    expected = [_serve(device, p + [5], f"r{i}")[1] for i, p in enumerate(prompts)]
    engine = build_engine(fp64_model, num_blocks=8, record_logits=True, redis_url=redis_server.url)
    redis_tier = engine.runner.persistent_tiers[0]
    redis_tier.retry_s = 0.3
    assert torch.equal(_serve(engine, prompts[0] + [5], "r0")[1], expected[0])
    engine.runner.flush_tiers(30)
    redis_server.kill()
    # the server is gone: the engine serves on, exactly, with misses and one warning line
    out, logits = _serve(engine, prompts[1] + [5], "r1")
    assert torch.equal(logits, expected[1]) and out.num_cached_tokens == 0
    err = capfd.readouterr().err
    assert err.count("unavailable") == 1 and "Traceback" not in err
    assert redis_tier.stats.misses["unavailable"] >= 1
    redis_server.start()
    time.sleep(0.35)
    _serve(engine, prompts[2] + [5], "r2")  # written through again
    assert engine.runner.flush_tiers(30) and "is back" in capfd.readouterr().err
    fresh = build_engine(fp64_model, num_blocks=8, record_logits=True, redis_url=redis_server.url)
    out, logits = _serve(fresh, prompts[2] + [5], "r2")
    # a hit computes the last token alone: fp64 rounding apart, the logits of a full prefill
    assert out.num_cached_tokens == 48 and (logits - expected[2]).abs().max().item() <= 1e-9
    for e in (engine, fresh):
        e.runner.close()


def _generate(*flags: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "kvpool", "generate", *flags, "--json"], capture_output=True, text=True, timeout=300
    )


def test_two_processes_share_a_prefix_through_redis(redis_server) -> None:
    prompt = "The harbour opens at six and closes at nine; boats wait at the north wall. When does it open?"
    first = _generate(prompt, "--max-tokens", "8", "--redis", redis_server.url)
    second = _generate(prompt, "--max-tokens", "8", "--redis", redis_server.url)
    assert first.returncode == second.returncode == 0, first.stderr + second.stderr
    a, b = json.loads(first.stdout), json.loads(second.stdout)
    assert a["cached_tokens"] == 0 and a["redis_tier"]["num_puts"] == a["prompt_tokens"] // 16
    assert b["cached_tokens"] == (b["prompt_tokens"] - 1) // 16 * 16 > 0
    assert b["redis_tier"]["num_gets"] == b["cached_tokens"] // 16 and b["token_ids"] == a["token_ids"]
    redis_server.kill()
    third = _generate(prompt, "--max-tokens", "8", "--redis", redis_server.url)
    assert third.returncode == 0 and json.loads(third.stdout)["token_ids"] == a["token_ids"]
    lines = third.stderr.strip().splitlines()
    assert len(lines) == 1 and "unavailable" in lines[0], third.stderr


def test_an_entry_of_another_format_version_is_a_miss_left_in_place(redis_server) -> None:
    import xxhash
    from safetensors.torch import save as st_save

    from kvpool.tiers import entry

    # another kvpool's entry (format 2, its manifest summed as ours): before, OtherVersion
    # raised out of lookup and get (a crash of the engine step), where format 1 was corrupt
    manifest = json.dumps({"format": 2, "key": key(1).hex()})
    checksum = xxhash.xxh3_128_hexdigest(manifest.encode())
    data = st_save({"k": torch.zeros(4)}, metadata={"kvpool.manifest": manifest, "kvpool.manifest_xxh3": checksum})
    rkey = RedisTier.redis_key(key(1), descriptor(1))
    c = redis.Redis.from_url(redis_server.url)
    c.hset(rkey, mapping={"m": data[: 8 + entry.header_length(data)], "d": data})
    reader, _ = tier(redis_server)
    assert not reader.lookup(key(1), descriptor(1)) and reader.get(key(1), descriptor(1)) is None
    assert reader.stats.misses == {"other_version": 2} and reader.stats.num_corrupt == 0
    assert c.hget(rkey, "d") == data and not reader.contains(key(1))  # left to its writer
