"""The disk tier: entries that check out or are quarantined, atomic writes proven by
killing the writer, LRU under a byte limit, descriptors field by field, a background
writer that drops instead of blocking, two processes on one directory, and SmolLM2's
logits and tokens through it (in this process and in a second one)."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvpool.tiers import BlockDescriptor, DiskTier
from kvpool.tiers import entry as entry_format

ROOT = Path(__file__).resolve().parents[1]


def descriptor(i: int, **changes) -> BlockDescriptor:
    base = BlockDescriptor(
        content_key=f"{i:032x}",
        parent_key=f"{i + 1000:032x}",
        num_computed_tokens=16 * (i + 1),
        token_ids=tuple(range(i, i + 16)),
        mm_identity="",
        tenant="t0",
        model_id="m",
        weights_version="w1",
        tokenizer_version="tok1",
        template_version="tpl1",
        adapter_id="",
        rope_id="rope",
        layout_id="L2:bs16:fp32",
    )
    return dataclasses.replace(base, **changes)


def key(i: int) -> bytes:
    return bytes.fromhex(f"{i:032x}")


def tensors(i: int, n: int = 1024) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(i)
    return {"k": torch.randn(2, n, generator=g), "v": torch.randn(2, n, generator=g)}


def stored(tier: DiskTier, i: int) -> Path:
    return tier._path(key(i), descriptor(i))


def test_an_entry_comes_back_bit_for_bit_in_a_new_tier_on_the_same_directory(tmp_path) -> None:
    tier = DiskTier(tmp_path / "c", 1 << 30)
    for i in range(3):
        assert tier.put(key(i), descriptor(i), tensors(i))
    assert tier.flush(30)
    tier.check_integrity()
    assert tier.num_entries == 3 and tier.stats.num_puts == 3
    again = DiskTier(tmp_path / "c", 1 << 30)  # what a restarted process sees
    assert again.num_entries == 3 and again.num_bytes == tier.num_bytes
    for i in range(3):
        assert again.lookup(key(i), descriptor(i))
        got = again.get(key(i), descriptor(i))
        assert got is not None and all(torch.equal(got[n], tensors(i)[n]) for n in ("k", "v"))
    assert not again.lookup(key(9), descriptor(9)) and again.stats.misses == {"absent": 1}
    assert again.stats.num_gets == 3 and again.stats.num_lookup_hits == 3
    again.check_integrity()
    # a file is one safetensors file the library reads, the manifest in its metadata
    from safetensors import safe_open

    with safe_open(stored(tier, 0), "pt") as f:
        manifest = json.loads(f.metadata()["kvpool.manifest"])
        assert torch.equal(f.get_tensor("k"), tensors(0)["k"])
    assert manifest["key"] == key(0).hex() and manifest["descriptor"]["weights_version"] == "w1"
    assert manifest["tensors"]["k"]["shape"] == [2, 1024]


def test_a_second_tier_finds_an_entry_another_one_wrote_after_it_opened(tmp_path) -> None:
    reader = DiskTier(tmp_path, 1 << 30)
    writer = DiskTier(tmp_path, 1 << 30)
    assert not reader.lookup(key(1), descriptor(1))
    writer.put(key(1), descriptor(1), tensors(1))
    writer.flush(30)
    assert reader.lookup(key(1), descriptor(1)) and reader.get(key(1), descriptor(1)) is not None
    reader.check_integrity()


@pytest.mark.parametrize(
    "field",
    [
        f.name
        for f in dataclasses.fields(BlockDescriptor)
        if f.name not in ("model_id", "weights_version", "layout_id")  # these name the entry's directory (below)
    ],
)
def test_a_descriptor_mismatch_is_a_miss_counted_by_field_and_reclaimed(tmp_path, field) -> None:
    tier = DiskTier(tmp_path, 1 << 30)
    tier.put(key(1), descriptor(1), tensors(1))
    tier.flush(30)
    old = getattr(descriptor(1), field)
    other = (old[:-1] + (999,)) if isinstance(old, tuple) else old + 1 if isinstance(old, int) else f"{old}x"
    expected = descriptor(1, **{field: other})
    fresh = DiskTier(tmp_path, 1 << 30)  # reads the header from the file
    assert not fresh.lookup(key(1), expected)
    assert fresh.stats.mismatches == {field: 1} and fresh.stats.misses == {"mismatch": 1}
    assert fresh.stats.num_reclaimed == 1 and not stored(tier, 1).exists()  # reclaimed, not kept
    assert not fresh.lookup(key(1), descriptor(1))  # gone for everyone
    fresh.check_integrity()


def test_another_model_weights_or_layout_never_reaches_the_entry(tmp_path) -> None:
    tier = DiskTier(tmp_path, 1 << 30)
    tier.put(key(1), descriptor(1), tensors(1))
    tier.flush(30)
    fresh = DiskTier(tmp_path, 1 << 30)
    for change in ({"model_id": "other"}, {"weights_version": "w2"}, {"layout_id": "L2:bs16:bf16"}):
        assert not fresh.lookup(key(1), descriptor(1, **change))
    assert fresh.stats.misses == {"absent": 3} and stored(tier, 1).exists()  # still serves its own model
    assert fresh.lookup(key(1), descriptor(1))


def test_two_engines_of_one_model_name_and_other_weights_keep_their_entries(tmp_path) -> None:
    """Two GGUFs of one file name (model_id) and other weights on one directory: each get
    found the other's entry of the same content key, refused it (weights_version) and deleted
    it, so neither ever hit (every get a miss and a reclaim). Now each has its own."""
    engines = [(DiskTier(tmp_path, 1 << 30), descriptor(1, weights_version=w)) for w in ("w1", "w2")]
    hits = []
    for _ in range(3):
        for tier, expected in engines:
            got = tier.get(key(1), expected)
            hits.append(got is not None)
            if got is None:
                tier.put(key(1), expected, tensors(1))
                tier.flush(30)
    assert hits == [False, False, True, True, True, True]
    for tier, _ in engines:
        assert tier.stats.num_reclaimed == 0 and tier.stats.mismatches == {}
        tier.check_integrity()
    assert sorted(p.parent.parent.name for p in tmp_path.glob("entries/*/*/*")) == sorted(
        entry_format.namespace(expected) for _, expected in engines
    )


def test_lru_under_the_byte_limit_carries_over_to_the_next_process(tmp_path) -> None:
    one = len(entry_format.encode(key(0), descriptor(0), tensors(0)))
    tier = DiskTier(tmp_path, 3 * one)
    for i in range(3):
        tier.put(key(i), descriptor(i), tensors(i))
        tier.flush(30)
    assert tier.get(key(0), descriptor(0)) is not None  # 0 is now the most recently used
    tier.put(key(3), descriptor(3), tensors(3))
    tier.flush(30)
    assert tier.stats.num_evictions == 1 and not stored(tier, 1).exists() and stored(tier, 0).exists()
    tier.check_integrity()
    os.utime(stored(tier, 2), ns=(1, 1))  # the oldest on disk, as a next process orders them
    smaller = DiskTier(tmp_path, 2 * one)  # opens over its limit: its first write pushes out the least recent
    assert smaller.num_entries == 3 and smaller.stats.num_evictions == 0  # (the open evicts nothing)
    assert smaller.put(key(4), descriptor(4), tensors(4)) and smaller.flush(30)
    assert not stored(tier, 2).exists() and stored(tier, 4).exists() and smaller.num_entries == 2
    assert smaller.stats.num_evictions == 2  # 2 to the limit, then one more for entry 4
    smaller.check_integrity()
    too_big = DiskTier(tmp_path / "small", one // 2)
    assert not too_big.put(key(5), descriptor(5), tensors(5)) and too_big.stats.num_rejected_puts == 1


def test_lookups_that_index_another_processs_entries_past_the_limit_leave_them_to_the_next_write(tmp_path) -> None:
    """Two processes' tiers on one directory (its documented use). A's lookups find B's
    entries, written since A's scan, and index them: past A's byte limit, which the writes
    enforce (evictions are the writer's, off the lookup path). check_integrity() called that
    a violation ("over the limit only while the open's cut waits"), and so did a runner's
    check after a step where a lookup indexed this process's own write that landed before the
    writer indexed it (the engine fuzz with a disk tier of 4 blocks, audit6). A's next write
    cuts the index to the limit again."""
    one = len(entry_format.encode(key(0), descriptor(0), tensors(0)))
    a, b = DiskTier(tmp_path, 2 * one), DiskTier(tmp_path, 1 << 30)
    assert a.put(key(0), descriptor(0), tensors(0)) and a.flush(30)  # (its open's cut done)
    for i in range(1, 5):
        b.put(key(i), descriptor(i), tensors(i))
    assert b.flush(30)
    assert all(a.lookup(key(i), descriptor(i)) for i in range(1, 5))
    assert a.num_entries == 5 and a.num_bytes == 5 * one > a.capacity_bytes
    a.check_integrity()
    assert a.put(key(5), descriptor(5), tensors(5)) and a.flush(30)
    assert a.num_entries == 2 and a.num_bytes == 2 * one  # the least recently used went
    a.check_integrity()
    with a._lock:  # the check still holds the limit where nothing explains the excess
        a._num_bytes += a.capacity_bytes
        a._entries[next(iter(a._entries))].num_bytes += a.capacity_bytes
    with pytest.raises(AssertionError, match="B limit"):
        a.check_integrity()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_a_flipped_or_truncated_entry_is_never_served_wrong(tmp_path_factory, data) -> None:
    root = tmp_path_factory.mktemp("flip")
    tier = DiskTier(root, 1 << 30)
    tier.put(key(1), descriptor(1), tensors(1, 64))
    tier.flush(30)
    path = stored(tier, 1)
    raw = bytearray(path.read_bytes())
    if data.draw(st.booleans(), label="truncate"):
        raw = raw[: data.draw(st.integers(0, len(raw) - 1), label="length")]
    else:
        at = data.draw(st.integers(0, len(raw) - 1), label="at")
        raw[at] ^= 1 << data.draw(st.integers(0, 7), label="bit")
    path.write_bytes(bytes(raw))
    fresh = DiskTier(root, 1 << 30)
    got = fresh.get(key(1), descriptor(1)) if fresh.lookup(key(1), descriptor(1)) else None
    if got is not None:  # a flip the format ignores (header padding): the tensors are exact
        assert all(torch.equal(got[n], tensors(1, 64)[n]) for n in ("k", "v"))
    else:
        assert fresh.stats.num_corrupt + fresh.stats.num_reclaimed == 1 and not path.exists()
        if fresh.stats.num_corrupt:
            assert len(list((root / "quarantine").iterdir())) == 1
    fresh.check_integrity()


def test_corruption_in_the_tensors_is_caught_by_their_checksum_and_quarantined(tmp_path) -> None:
    tier = DiskTier(tmp_path, 1 << 30)
    tier.put(key(1), descriptor(1), tensors(1))
    tier.flush(30)
    path = stored(tier, 1)
    raw = bytearray(path.read_bytes())
    raw[-5] ^= 0x10  # inside v's data: the header is intact, so the lookup passes
    path.write_bytes(bytes(raw))
    fresh = DiskTier(tmp_path, 1 << 30)
    assert fresh.lookup(key(1), descriptor(1))
    assert fresh.get(key(1), descriptor(1)) is None
    assert fresh.stats.num_corrupt == 1 and fresh.stats.misses == {"corrupt": 1} and not path.exists()
    assert [p.name.split(".")[0] for p in (tmp_path / "quarantine").iterdir()] == [key(1).hex()]
    assert not fresh.lookup(key(1), descriptor(1))  # a miss from now on


_WRITER = """
import os, signal, sys, torch
from kvpool.tiers import DiskTier
sys.path.insert(0, {tests!r})
from test_disk_tier import descriptor, key, tensors
stage = sys.argv[2]
tier = DiskTier(sys.argv[1], 1 << 30)
def hook(name):
    if name == stage:
        os.kill(os.getpid(), signal.SIGKILL)
tier.fault_hook = hook
tier.put(key(1), descriptor(1), tensors(1, 300_000))  # 4.8 MB: five chunks of 1 MiB
tier.flush(60)
print("survived", flush=True)
"""


@pytest.mark.parametrize("stage", ["open", "wrote 1048576", "wrote 3145728", "synced", "renamed", "dir synced"])
def test_a_writer_killed_at_any_point_leaves_no_torn_entry(tmp_path, stage) -> None:
    script = tmp_path / "writer.py"
    script.write_text(_WRITER.format(tests=str(ROOT / "tests")))
    proc = subprocess.run([sys.executable, str(script), str(tmp_path / "c"), stage], capture_output=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()
    reader = DiskTier(tmp_path / "c", 1 << 30)
    committed = stage in ("renamed", "dir synced")
    assert reader.lookup(key(1), descriptor(1)) == committed
    if committed:
        got = reader.get(key(1), descriptor(1))
        assert got is not None and torch.equal(got["v"], tensors(1, 300_000)["v"])
    else:
        assert reader.num_entries == 0
        assert reader.num_stale_tmp_removed == (stage != "open")  # the dead writer's temp file, gone
    assert not list((tmp_path / "c" / "tmp").iterdir()) and reader.stats.num_corrupt == 0


_MANY = """
import sys
sys.path.insert(0, {tests!r})
from kvpool.tiers import DiskTier
from test_disk_tier import descriptor, key, tensors
tier = DiskTier(sys.argv[1], 1 << 30, max_pending_bytes=1 << 30)
first, count = int(sys.argv[2]), int(sys.argv[3])
for i in range(first, first + count):
    tier.put(key(i % 12), descriptor(i % 12), tensors(i % 12, 20_000))
tier.flush(120)
print("done", flush=True)
"""


def test_writers_killed_at_random_moments_and_two_at_once_never_corrupt(tmp_path) -> None:
    script = tmp_path / "many.py"
    script.write_text(_MANY.format(tests=str(ROOT / "tests")))
    cache = tmp_path / "c"
    # two writers on the same directory at once, over the same keys: both finish
    both = [subprocess.Popen([sys.executable, str(script), str(cache), str(s), "24"]) for s in (0, 5)]
    assert [p.wait(timeout=180) for p in both] == [0, 0]
    # writers SIGKILLed after 0.3 .. 1.5 s, mid-stream
    for delay in (0.3, 0.6, 0.9, 1.5):
        proc = subprocess.Popen([sys.executable, str(script), str(cache), "3", "400"], stdout=subprocess.DEVNULL)
        try:
            proc.wait(timeout=delay)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=30)
    reader = DiskTier(cache, 1 << 30)
    assert reader.num_entries == 12
    for i in range(12):
        got = reader.get(key(i), descriptor(i))
        assert got is not None and torch.equal(got["k"], tensors(i, 20_000)["k"])
    assert reader.stats.num_corrupt == 0 and not list((cache / "tmp").iterdir())
    reader.check_integrity()


def test_a_full_write_queue_drops_and_counts_instead_of_blocking(tmp_path) -> None:
    tier = DiskTier(tmp_path, 1 << 30, max_pending_bytes=3 * 2 * 2 * 1024 * 4)  # three blocks' bytes
    release = threading.Event()
    tier.fault_hook = lambda stage: release.wait(30) if stage == "open" else None  # a disk that hangs
    accepted = [tier.put(key(i), descriptor(i), tensors(i)) for i in range(6)]  # returns while the disk hangs
    assert accepted == [True, True, True, False, False, False]
    assert tier.stats.num_dropped_puts == 3 and tier.pending_bytes > 0
    release.set()
    assert tier.flush(30) and tier.num_entries == 3 and tier.pending_bytes == 0
    assert tier.put(key(7), descriptor(7), tensors(7))  # room again


def test_bad_directories_are_one_clear_error(tmp_path) -> None:
    a_file = tmp_path / "f"
    a_file.write_text("x")
    with pytest.raises(ValueError, match="is a file, not a directory"):
        DiskTier(a_file, 1 << 20)
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="other files in it"):
        DiskTier(tmp_path / "other", 1 << 20)
    with pytest.raises(ValueError, match="cannot be created"):
        DiskTier("/proc/kvpool-cache", 1 << 20)
    with pytest.raises(ValueError, match="positive number of bytes"):
        DiskTier(tmp_path / "c", 0)


def test_an_empty_cache_path_is_refused_not_taken_as_the_working_directory(tmp_path, monkeypatch) -> None:
    """`--disk-cache ""` (an unset variable in quotes) made the working directory the cache
    (Path("") is "."), or said "'.' is a directory with other files in it"."""
    from kvpool.tiers.disk_admin import existing_cache

    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=r"an empty path \(give the cache's directory\)"):
        DiskTier("", 1 << 20)
    with pytest.raises(ValueError, match="an empty path"):
        existing_cache("")
    assert list(tmp_path.iterdir()) == []
    # " " is a path (a directory named by one space): taken, not told it is empty
    tier = DiskTier(" ", 1 << 20)
    assert tier.put(key(1), descriptor(1), tensors(1)) and tier.flush(30)
    assert (tmp_path / " " / "entries").is_dir() and existing_cache(" ") == Path(" ")
    assert tier.lookup(key(1), descriptor(1))
    tier.close()


# ----- SmolLM2 through the disk tier --------------------------------------------------


def _serve(engine, prompt, rid):
    from kvpool.engine.sampling import SamplingParams

    rid = engine.add_request(prompt, SamplingParams(max_tokens=3, ignore_eos=True), rid)
    while engine.has_unfinished():
        engine.step()
        engine.runner.check_integrity()
    return engine.output(rid), torch.stack(engine.requests[rid].seqs[0].logits)


def test_engine_logits_from_the_disk_tier_equal_a_device_hit_and_the_reference(fp64_model, tmp_path) -> None:
    import random

    from kvpool.attention.reference import reference_logits
    from kvpool.engine.build import build_engine

    rng = random.Random(4)
    p = [rng.randrange(100, 49000) for _ in range(96)]
    follow = p + [rng.randrange(100, 49000) for _ in range(20)]
    first = build_engine(fp64_model, num_blocks=16, record_logits=True, disk_cache=tmp_path)
    _serve(first, p + [7], "a")
    first.runner.close()
    assert first.runner.tier_moves.num_persisted == 6 and first.runner.tier.persistent[0].stats.num_puts == 6
    # a fresh engine (an empty device pool) on the same directory, and a device hit for reference
    second = build_engine(fp64_model, num_blocks=16, record_logits=True, disk_cache=tmp_path)
    out, logits = _serve(second, follow, "b")
    device = build_engine(fp64_model, num_blocks=64, record_logits=True)
    _serve(device, p + [7], "a")
    ref_out, ref_logits = _serve(device, follow, "b")
    assert out.num_cached_tokens == ref_out.num_cached_tokens == 96
    assert second.runner.cache.stats.num_lower_tier_hit_tokens == 96
    assert torch.equal(logits, ref_logits)  # the KV read back is the KV computed, bit for bit
    history = second.requests["b"].seqs[0].token_ids[:-1]
    ref = reference_logits(fp64_model.model, history)[len(follow) - 1 :]
    assert (logits - ref).abs().max().item() <= 1e-9
    report = second.runner.tier_reports()
    assert report["disk_tier"]["num_gets"] == 6 and report["disk_tier"]["hit_tokens"] == 96
    assert report["tiers"]["lookup_order"] == ["disk"] and report["tiers"]["blocks_loaded"] == 6
    second.runner.close()


def test_disk_then_host_order_and_tenant_isolation_in_the_engine(fp64_model, tmp_path) -> None:
    import random

    from kvpool.engine.build import build_engine
    from kvpool.engine.sampling import SamplingParams

    rng = random.Random(5)
    p = [rng.randrange(100, 49000) for _ in range(64)]
    a = build_engine(fp64_model, num_blocks=16, disk_cache=tmp_path, host_cache_bytes=1 << 26)
    rid = a.add_request(p + [1], SamplingParams(max_tokens=2, ignore_eos=True), tenant="alice")
    while a.has_unfinished():
        a.step()
    a.runner.close()
    b = build_engine(fp64_model, num_blocks=16, disk_cache=tmp_path, host_cache_bytes=1 << 26)
    assert b.runner.tier_reports()["tiers"]["lookup_order"] == ["host", "disk"]
    cached = {}
    for tenant in ("bob", "alice"):
        rid = b.add_request(p + [2], SamplingParams(max_tokens=2, ignore_eos=True), tenant=tenant)
        while b.has_unfinished():
            b.step()
            b.runner.check_integrity()
        cached[tenant] = b.output(rid).num_cached_tokens
    assert cached == {"bob": 0, "alice": 64}  # bob's content keys differ: never alice's blocks
    b.runner.close()


def _generate(*flags: str) -> dict:
    proc = subprocess.run(
        [sys.executable, "-m", "kvpool", "generate", *flags, "--json"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


PROMPT = textwrap.dedent(
    """\
    Keep these notes for the crew. The harbour opens at six and closes at nine; boats wait at
    the north wall when the wind is from the east. Fuel is sold at the second pier. The
    lighthouse is shut on Mondays. What time does the harbour open?"""
)


def test_a_second_process_hits_the_directory_and_gives_the_same_tokens(tmp_path) -> None:
    cache = str(tmp_path / "cache")
    first = _generate(PROMPT, "--max-tokens", "12", "--disk-cache", cache)
    second = _generate(PROMPT, "--max-tokens", "12", "--disk-cache", cache)
    assert first["cached_tokens"] == 0 and first["disk_tier"]["num_puts"] >= first["prompt_tokens"] // 16
    assert second["cached_tokens"] == (first["prompt_tokens"] - 1) // 16 * 16 > 0  # >= 1 token left to compute
    assert second["disk_tier"]["num_gets"] == second["cached_tokens"] // 16
    assert second["token_ids"] == first["token_ids"]
    # corrupt every entry: misses, quarantined, and the engine still answers the same
    entries = list((tmp_path / "cache" / "entries").rglob("*.safetensors"))
    for path in entries:
        raw = bytearray(path.read_bytes())
        raw[-3] ^= 0xFF
        path.write_bytes(bytes(raw))
    third = _generate(PROMPT, "--max-tokens", "12", "--disk-cache", cache)
    assert third["cached_tokens"] == 0 and third["token_ids"] == first["token_ids"]
    assert third["disk_tier"]["num_corrupt"] == 1  # the first block: the prefix stops there
    assert len(list((tmp_path / "cache" / "quarantine").iterdir())) == 1


def test_kvpool_cache_ls_stats_and_clear(tmp_path) -> None:
    tier = DiskTier(tmp_path / "c", 1 << 30)
    for i in range(3):
        tier.put(key(i), descriptor(i), tensors(i))
    tier.flush(30)
    raw = bytearray(stored(tier, 2).read_bytes())
    raw[10] ^= 0xFF  # the header: unreadable
    stored(tier, 2).write_bytes(bytes(raw))

    def cache(*argv: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "kvpool", "cache", *argv], capture_output=True, text=True, timeout=60
        )

    listing = json.loads(cache("ls", str(tmp_path / "c"), "--json").stdout)
    assert sorted(e["key"] for e in listing["entries"]) == sorted(key(i).hex() for i in range(3))
    assert sum(bool(e["problem"]) for e in listing["entries"]) == 1
    stats = json.loads(cache("stats", str(tmp_path / "c"), "--json").stdout)
    assert stats["entries"] == 3 and stats["unreadable"] == 1 and stats["bytes"] == tier.num_bytes
    assert stored(tier, 2).exists()  # ls and stats change nothing
    done = cache("clear", str(tmp_path / "c"))
    assert done.returncode == 0 and "removed 3 files" in done.stdout
    assert json.loads(cache("stats", str(tmp_path / "c"), "--json").stdout)["entries"] == 0
    missing = cache("ls", str(tmp_path / "nope"))
    assert (
        missing.returncode == 2
        and missing.stderr.strip().endswith("does not exist")
        and "Traceback" not in missing.stderr
    )


def _three_entries_in_two_namespaces(tmp_path) -> tuple[DiskTier, Path]:
    """A cache of 3 entries, the third of another model (its own namespace directory); the
    namespace directory of the first two, which `kvpool cache` may be unable to list."""
    tier = DiskTier(tmp_path / "c", 1 << 30)
    for i, d in enumerate((descriptor(0), descriptor(1), descriptor(2, model_id="other"))):
        tier.put(key(i), d, tensors(i))
    tier.flush(30)
    namespace = stored(tier, 0).parent.parent
    assert (
        stored(tier, 1).parent.parent == namespace != tier._path(key(2), descriptor(2, model_id="other")).parent.parent
    )
    return tier, namespace


def test_kvpool_cache_says_which_directories_it_could_not_list(tmp_path, monkeypatch, capsys) -> None:
    # Path.glob skips a directory it may not read silently: "entries: 1" of 3, no word of the
    # other two. The tests may run as root, whom no mode bit stops: os.access says no here.
    from kvpool.cli.main import main
    from kvpool.tiers import disk_admin

    tier, namespace = _three_entries_in_two_namespaces(tmp_path)
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda path, mode: Path(path) != namespace and real_access(path, mode))
    assert disk_admin.unlisted_dirs(tier.root) == [namespace]
    assert main(["cache", "stats", str(tier.root), "--json"]) == 1
    captured = capsys.readouterr()
    stats = json.loads(captured.out)
    assert stats["unlisted_dirs"] == [str(namespace)]  # (the entries glob found: all 3 as root, 1 otherwise)
    assert f"1 directory could not be listed (permission denied): {namespace}" in captured.err
    assert main(["cache", "ls", str(tier.root)]) == 1
    captured = capsys.readouterr()
    assert f"1 directory could not be listed (permission denied): {namespace}" in captured.err
    monkeypatch.undo()
    assert disk_admin.unlisted_dirs(tier.root) == []
    assert main(["cache", "stats", str(tier.root), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["unlisted_dirs"] == []
    # A directory gone (a clear meanwhile, or no entry yet) is no refusal: os.access says no for it too
    shutil.rmtree(namespace)
    assert disk_admin.unlisted_dirs(tier.root) == []
    shutil.rmtree(tier.root / "entries")
    assert disk_admin.unlisted_dirs(tier.root) == []
    assert main(["cache", "stats", str(tier.root), "--json"]) == 0


@pytest.mark.skipif(os.geteuid() == 0, reason="root lists a directory of mode 000")
def test_a_namespace_directory_of_mode_000_is_named_by_kvpool_cache(tmp_path) -> None:
    from kvpool.tiers import disk_admin

    tier, namespace = _three_entries_in_two_namespaces(tmp_path)
    namespace.chmod(0)
    try:
        assert disk_admin.unlisted_dirs(tier.root) == [namespace]
        assert len(disk_admin.inspect_cache(tier.root)) == 1  # (what Path.glob skipped silently)
    finally:
        namespace.chmod(0o755)


@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        (["--disk-cache", "{file}"], "is a file, not a directory"),
        (["--disk-cache", "/proc/kvpool-x"], "cannot be created"),
        (["--disk-cache-gib", "2"], "--disk-cache-gib needs --disk-cache DIR"),
        (["--redis", "http://127.0.0.1:6379"], "expected redis://HOST:PORT"),
        (["--redis", "redis://127.0.0.1:99999"], "the port is not a number"),
        (["--swa-strategy", "full", "--disk-cache", "{dir}"], "only tiny-dsv4 (DeepSeek-V4) keeps a sliding-window"),
        (["--model", "tiny-dsv4", "--swa-strategy", "full"], "give --disk-cache or --redis"),
        (["--model", "tiny-dsv4", "--disk-cache", "{dir}", "--swa-period", "256"], "goes with --swa-strategy periodic"),
        (["--model", "tiny-dsv4", "--disk-cache", "{dir}", "--swa-strategy", "periodic"], "needs --swa-period P"),
        (
            ["--model", "tiny-dsv4", "--disk-cache", "{dir}", "--swa-strategy", "periodic", "--swa-period", "100"],
            "--swa-period 100 must be a multiple of the classical block span 128",
        ),
    ],
)
def test_bad_tier_flags_are_one_clear_line(tmp_path, flags, needle) -> None:
    (tmp_path / "f").write_text("x")
    flags = [f.format(file=tmp_path / "f", dir=tmp_path / "d") for f in flags]
    for command in ("generate", "run"):
        argv = [sys.executable, "-m", "kvpool", command, *(["hello"] if command == "generate" else []), *flags]
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=120)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1 and needle in lines[0], proc.stderr


def test_entries_stranded_under_an_old_namespace_are_said_so_by_cache_stats_and_ls(tmp_path, capsys) -> None:
    """Review 9 #6: entries written before the namespace held the weights version (b8b77ad)
    sit under a namespace no engine computes (never a hit), and `kvpool cache stats` filed
    them under the very line of the live entries. Now stats and ls say they are stranded."""
    import xxhash

    from kvpool.cli.main import main
    from kvpool.tiers.disk_admin import STRANDED

    tier = DiskTier(tmp_path / "c", 1 << 30)
    for i in range(3):
        assert tier.put(key(i), descriptor(i), tensors(i))
    assert tier.flush(30)
    d = descriptor(0)
    old = xxhash.xxh3_64_hexdigest(f"{d.model_id}\x00{d.layout_id}".encode())  # (the namespace before b8b77ad)
    moved = tmp_path / "c" / "entries" / old / stored(tier, 0).parent.name / stored(tier, 0).name
    moved.parent.mkdir(parents=True)
    stored(tier, 0).rename(moved)
    assert main(["cache", "stats", str(tmp_path / "c"), "--json"]) == 0
    stats = json.loads(capsys.readouterr().out)
    live = f"{d.model_id} ({d.weights_version[:12]}, {d.layout_id})"
    assert stats["entries"] == 3 and stats["stranded"] == 1
    assert {name: v["entries"] for name, v in stats["models"].items()} == {live: 2, f"{live}, {STRANDED}": 1}
    assert main(["cache", "ls", str(tmp_path / "c"), "--json"]) == 0
    rows = {r["key"]: r for r in json.loads(capsys.readouterr().out)["entries"]}
    assert [rows[key(i).hex()]["stranded"] for i in range(3)] == [True, False, False]
    assert rows[key(0).hex()]["weights_version"] == d.weights_version
    assert main(["cache", "ls", str(tmp_path / "c")]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if STRANDED in line]
    assert len(lines) == 1 and lines[0].startswith(key(0).hex())
    reopened = DiskTier(tmp_path / "c", 1 << 30)
    assert not reopened.lookup(key(0), descriptor(0)) and reopened.lookup(key(1), descriptor(1))  # never found


def test_evict_makes_its_entries_a_miss_while_their_files_are_unlinked(tmp_path, monkeypatch) -> None:
    """Review 9 #9: evict() dropped an entry, then unlinked its file without marking it
    `_removing`: a lookup between the two found the file and indexed the entry again (a hit
    on a file about to go, left indexed after it went). Now it is a miss, as an LRU victim's."""
    tier = DiskTier(tmp_path / "c", 1 << 30)
    for i in range(2):
        assert tier.put(key(i), descriptor(i), tensors(i))
    assert tier.flush(30)
    path, seen = stored(tier, 0), []
    real_unlink = Path.unlink

    def unlink(self, *args, **kwargs):
        if self == path:
            seen.append(tier.lookup(key(0), descriptor(0)))  # (a lookup while the unlink is under way)
        return real_unlink(self, *args, **kwargs)

    monkeypatch.setattr(Path, "unlink", unlink)
    assert tier.evict(key(0)) and seen == [False] and not path.exists()
    tier.check_integrity()
    assert tier.report()["entries"] == 1 and tier.stats.num_evictions == 0
    assert not tier.lookup(key(0), descriptor(0)) and tier.lookup(key(1), descriptor(1))


def test_a_directory_of_this_model_and_layout_under_other_weights_is_said_so(tmp_path) -> None:
    """Review 9 #7: a directory holding only this model and layout under other weights said
    "nothing of this model and layout there yet", which it holds: the line names the weights."""
    tier = DiskTier(tmp_path / "c", 1 << 30)
    for i in range(2):
        assert tier.put(key(i), descriptor(i), tensors(i))
    assert tier.flush(30)
    d, lines = descriptor(0), []
    shapes = {name: (t.dtype, tuple(t.shape)) for name, t in tensors(0).items()}
    DiskTier(tmp_path / "c", 1 << 30, log=lines.append).expect_tensors(d.model_id, "f" * 32, d.layout_id, shapes)
    assert len(lines) == 1 and lines[0].startswith(
        f"kvpool: disk cache {tmp_path / 'c'}: nothing of this model, weights and layout there yet "
        f"({d.model_id}, weights {'f' * 12}, {d.layout_id}); its 2 entries are of other models or weights, "
    ), lines
    lines.clear()
    DiskTier(tmp_path / "c", 1 << 30, log=lines.append).expect_tensors(
        d.model_id, d.weights_version, d.layout_id, shapes
    )
    assert lines == []  # (its own: nothing to say)
