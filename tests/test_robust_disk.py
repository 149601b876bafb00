"""Issue 28 §5, the disk tier: a fault is a miss and a counted error, never a crash, a hang
or a silent loss; and several processes (or kvpool versions) share one directory.

How each fault is made: a directory or a FIFO at an entry's or a temp file's path is
real; so are corrupted payloads and entries of another format version (written with the
safetensors library). Root reads any file whatever its mode, so an unreadable entry
(PermissionError) and a filesystem remounted read-only (EROFS) are simulated by
`fail_under`, which makes the OS calls on paths under the cache directory raise the
errno, as the kernel would."""

from __future__ import annotations

import builtins
import errno
import io
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import xxhash
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from safetensors.torch import save as st_save

from kvpool.tiers import DiskTier
from kvpool.tiers import disk as disk_module
from kvpool.tiers import entry as entry_format
from test_disk_tier import descriptor, key, stored, tensors

ROOT = Path(__file__).resolve().parents[1]


def fail_under(monkeypatch, root: Path, err: int, ops: set[str]) -> None:
    """OSError(err) from the calls in `ops` ("read": opening a file to read, "write":
    opening one to write or making a directory, "rename", "unlink", "utime") for every
    path under `root`."""
    root = root.resolve()

    def hit(op: str, path) -> bool:
        if op not in ops or isinstance(path, int):
            return False
        return Path(os.fsdecode(path)).resolve().is_relative_to(root)

    def refuse(path) -> None:
        raise OSError(err, os.strerror(err), os.fsdecode(path))

    real_open, real_os_open = builtins.open, os.open

    def fake_open(file, mode="r", *args, **kwargs):
        if hit("write" if any(c in mode for c in "wax+") else "read", file):
            refuse(file)
        return real_open(file, mode, *args, **kwargs)

    def fake_os_open(path, flags, *args, **kwargs):
        if hit("write" if flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT) else "read", path):
            refuse(path)
        return real_os_open(path, flags, *args, **kwargs)

    def wrap(op: str, real):
        def fake(path, *args, **kwargs):
            if hit(op, path):
                refuse(path)
            return real(path, *args, **kwargs)

        return fake

    monkeypatch.setattr(builtins, "open", fake_open)
    monkeypatch.setattr(io, "open", fake_open)
    monkeypatch.setattr(os, "open", fake_os_open)
    monkeypatch.setattr(os, "replace", wrap("rename", os.replace))
    monkeypatch.setattr(os, "rename", wrap("rename", os.rename))
    monkeypatch.setattr(os, "unlink", wrap("unlink", os.unlink))
    monkeypatch.setattr(os, "utime", wrap("utime", os.utime))
    monkeypatch.setattr(os, "mkdir", wrap("write", os.mkdir))


def filled(path: Path, n: int = 3) -> DiskTier:
    tier = DiskTier(path, 1 << 30)
    for i in range(n):
        assert tier.put(key(i), descriptor(i), tensors(i))
    assert tier.flush(30)
    return tier


def same(got: dict[str, torch.Tensor] | None, i: int) -> bool:
    return got is not None and all(torch.equal(got[n], tensors(i)[n]) for n in ("k", "v"))


def flip_payload(path: Path) -> None:
    """Flip a bit of the entry's payload: its header (what a lookup reads) still checks out."""
    raw = bytearray(path.read_bytes())
    raw[-5] ^= 0x10
    path.write_bytes(bytes(raw))


# ----- errors other than file-not-found ------------------------------------------------


def test_an_unreadable_entry_is_a_counted_miss_and_the_others_still_hit(tmp_path, monkeypatch) -> None:
    filled(tmp_path)
    tier = DiskTier(tmp_path, 1 << 30)
    fail_under(monkeypatch, stored(tier, 1), errno.EACCES, {"read"})  # key 1's entry only
    assert not tier.lookup(key(1), descriptor(1)) and tier.get(key(1), descriptor(1)) is None
    assert tier.stats.misses == {"io_error": 2} and tier.io_errors == {"read": 2}
    assert stored(tier, 1).exists()  # not ours to move: it stays, a miss each time
    assert same(tier.get(key(0), descriptor(0)), 0) and same(tier.get(key(2), descriptor(2)), 2)
    assert tier.report()["io_errors"] == {"read": 2}
    tier.check_integrity()


def test_a_hit_whose_lru_refresh_is_refused_is_still_a_hit(tmp_path, monkeypatch) -> None:
    filled(tmp_path)
    tier = DiskTier(tmp_path, 1 << 30)
    fail_under(monkeypatch, tmp_path, errno.EPERM, {"utime"})  # entries owned by another user
    assert same(tier.get(key(0), descriptor(0)), 0)
    assert tier.stats.num_gets == 1 and tier.io_errors == {"utime": 1} and not tier.stats.misses


def test_a_filesystem_remounted_read_only_keeps_serving_reads(tmp_path, monkeypatch) -> None:
    filled(tmp_path, 3)
    tier = DiskTier(tmp_path, 1 << 30)
    bad = stored(tier, 2)
    flip_payload(bad)  # key 2's: to be quarantined, which a read-only disk refuses
    fail_under(monkeypatch, tmp_path, errno.EROFS, {"write", "rename", "unlink", "utime"})
    assert same(tier.get(key(0), descriptor(0)), 0)  # a hit (its LRU refresh refused)
    assert tier.get(key(2), descriptor(2)) is None  # corrupt: a miss, left where it is
    assert tier.put(key(3), descriptor(3), tensors(3)) and tier.flush(30)  # queued, then refused
    assert tier.stats.num_write_errors == 1 and tier.stats.num_puts == 0
    assert tier.get(key(1), descriptor(1)) is not None  # still serving
    assert tier.io_errors == {"quarantine": 1, "utime": 2}
    assert tier.stats.misses == {"corrupt": 1} and bad.exists()
    tier.check_integrity()


def test_an_eviction_the_disk_refuses_is_counted_and_ends(tmp_path, monkeypatch) -> None:
    first = filled(tmp_path, 2)
    both = stored(first, 0).stat().st_size + stored(first, 1).stat().st_size
    fail_under(monkeypatch, tmp_path, errno.EROFS, {"unlink"})
    tier = DiskTier(tmp_path, both - 1)  # over its limit at open: its first write's evictions are refused
    assert tier.put(key(2), descriptor(2), tensors(2)) and tier.flush(30)
    # one to cut to the limit, one for entry 2, and the two undeleted files again at the rescan
    # that write is followed by (it passes 1/32 of the limit): each forgotten, so each loop ends
    assert tier.io_errors == {"evict": 4} and tier.num_entries == 1 and tier.stats.num_evictions == 0
    tier.check_integrity()


def test_a_directory_where_an_entry_or_a_temp_file_should_be(tmp_path) -> None:
    tier = filled(tmp_path / "c", 2)
    stored(tier, 0).unlink()
    stored(tier, 0).mkdir()  # a directory at key 0's entry path
    (tmp_path / "c" / "tmp" / f"{key(1).hex()}.99999999.0.tmp").mkdir()  # a dead writer's "temp file"
    fresh = DiskTier(tmp_path / "c", 1 << 30)  # opens (today: IsADirectoryError)
    assert fresh.io_errors == {"tmp": 1}
    assert not fresh.lookup(key(0), descriptor(0))
    assert fresh.stats.misses == {"corrupt": 1} and not stored(tier, 0).exists()  # moved aside
    # a directory where this writer's next temp file goes: the write fails, counted
    (tmp_path / "c" / "tmp" / disk_module.temp_file_name(key(5), 0)).mkdir()
    assert fresh.put(key(5), descriptor(5), tensors(5)) and fresh.flush(30)
    assert fresh.stats.num_write_errors == 1 and fresh._writer.num_failed == 0
    assert fresh.put(key(0), descriptor(0), tensors(0)) and fresh.flush(30)  # the path is free again
    assert same(DiskTier(tmp_path / "c", 1 << 30).get(key(0), descriptor(0)), 0)


def test_a_fifo_at_a_temp_file_path_fails_that_write_without_a_hang(tmp_path) -> None:
    tier = DiskTier(tmp_path, 1 << 30)
    os.mkfifo(tmp_path / "tmp" / disk_module.temp_file_name(key(1), 0))  # where its first write goes
    assert tier.put(key(1), descriptor(1), tensors(1))
    assert tier.flush(5), "the writer blocked on a FIFO"
    assert tier.stats.num_write_errors == 1 and tier.stats.num_puts == 0
    assert tier.put(key(1), descriptor(1), tensors(1)) and tier.flush(5) and tier.stats.num_puts == 1


def test_a_fifo_at_an_entry_path_is_a_prompt_miss(tmp_path) -> None:
    tier = filled(tmp_path, 2)
    path = stored(tier, 1)
    path.unlink()
    os.mkfifo(path)
    fresh = DiskTier(tmp_path, 1 << 30)
    result: list[bool] = []
    probe = threading.Thread(target=lambda: result.append(fresh.lookup(key(1), descriptor(1))), daemon=True)
    start = time.perf_counter()
    probe.start()
    probe.join(5)
    if probe.is_alive():  # blocked in open(): a writer end releases it
        fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
        os.close(fd)
        probe.join(5)
        pytest.fail("the lookup blocked on a FIFO")
    assert result == [False] and time.perf_counter() - start < 1.0
    assert fresh.stats.misses == {"corrupt": 1} and not path.exists()
    assert same(fresh.get(key(0), descriptor(0)), 0)


def _reencoded(path: Path, k: bytes, change) -> None:
    """Rewrite an entry with its tensors changed by `change` and every checksum valid."""
    desc, found = entry_format.decode(path.read_bytes(), k)
    path.write_bytes(entry_format.encode(k, desc, {n: change(t) for n, t in found.items()}))


def test_entries_of_the_wrong_shape_or_dtype_are_quarantined(tmp_path) -> None:
    tier = filled(tmp_path, 3)
    _reencoded(stored(tier, 1), key(1), lambda t: t.double())
    _reencoded(stored(tier, 2), key(2), lambda t: t[:, :-1].contiguous())
    fresh = DiskTier(tmp_path, 1 << 30)
    fresh.expect_tensors("m", "w1", "L2:bs16:fp32", {"k": (torch.float32, (2, 1024)), "v": (torch.float32, (2, 1024))})
    assert fresh.lookup(key(0), descriptor(0)) and same(fresh.get(key(0), descriptor(0)), 0)
    assert not fresh.lookup(key(1), descriptor(1))  # the manifest says so: no read of the tensors
    assert fresh.get(key(2), descriptor(2)) is None
    assert fresh.stats.num_corrupt == 2 and fresh.stats.misses == {"corrupt": 2}
    assert len(list((tmp_path / "quarantine").iterdir())) == 2
    with pytest.raises(ValueError, match="expected tensors"):
        fresh.expect_tensors("m", "w1", "x", {"k": (torch.float32, (2, -1))})


# ----- silent losses -------------------------------------------------------------------


def test_holds_trusts_only_entries_whose_payload_checked_out(tmp_path) -> None:
    tier = filled(tmp_path, 3)
    assert all(tier.holds(key(i), descriptor(i)) for i in range(3))  # written by this process
    for i in range(3):
        flip_payload(stored(tier, i))
    fresh = DiskTier(tmp_path, 1 << 30)
    assert all(fresh.lookup(key(i), descriptor(i)) for i in range(3))  # headers only
    assert fresh.get(key(0), descriptor(0)) is None
    # the prefix stopped at block 0; blocks 1 and 2 must be rewritten too, not trusted
    assert not any(fresh.holds(key(i), descriptor(i)) for i in range(3))
    for i in range(3):
        fresh.put(key(i), descriptor(i), tensors(i))
    assert fresh.flush(30)
    again = DiskTier(tmp_path, 1 << 30)
    assert all(same(again.get(key(i), descriptor(i)), i) for i in range(3))  # healed in one run
    assert again.stats.num_corrupt == 0


def cache_cli(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvpool", "cache", *argv], capture_output=True, text=True, timeout=60)


def test_cache_stats_counts_a_corrupted_payload_as_unreadable(tmp_path) -> None:
    tier = filled(tmp_path, 3)
    flip_payload(stored(tier, 1))
    stored(tier, 2).unlink()
    os.mkfifo(stored(tier, 2))  # (read without blocking: unreadable, not a hang)
    stats = json.loads(cache_cli("stats", str(tmp_path), "--json").stdout)
    assert stats["entries"] == 3 and stats["unreadable"] == 2
    listing = json.loads(cache_cli("ls", str(tmp_path), "--json").stdout)
    problems = {e["key"]: e["problem"] for e in listing["entries"]}
    assert "checksum mismatch" in problems[key(1).hex()] and not problems[key(0).hex()]
    assert "FIFO" in problems[key(2).hex()]
    quick = json.loads(cache_cli("stats", str(tmp_path), "--json", "--headers-only").stdout)
    assert quick["unreadable"] == 1  # the headers alone cannot tell a corrupted payload
    assert stored(tier, 1).exists()  # stats and ls change nothing


# ----- sharing a directory ---------------------------------------------------------------

_WRITER = """
import sys, time
from pathlib import Path
sys.path.insert(0, {tests!r})
from kvpool.tiers import DiskTier
from test_disk_tier import descriptor, key, tensors
tier = DiskTier(sys.argv[1], int(sys.argv[2]))
first = int(sys.argv[3])
here = Path(sys.argv[1]).parent
(here / f"ready.{{first}}").touch()
while not (here / "go").exists():  # all open before any writes
    time.sleep(0.01)
for i in range(first, first + 40):
    tier.put(key(i), descriptor(i), tensors(i, 2048))
    tier.flush(60)
tier.close()
"""


def test_the_byte_limit_holds_across_processes_sharing_the_directory(tmp_path) -> None:
    one = len(entry_format.encode(key(0), descriptor(0), tensors(0, 2048)))
    capacity = 12 * one
    script = tmp_path / "writer.py"
    script.write_text(_WRITER.format(tests=str(ROOT / "tests")))
    cache = tmp_path / "c"
    DiskTier(cache, capacity)
    procs = [
        subprocess.Popen([sys.executable, str(script), str(cache), str(capacity), str(first)])
        for first in (0, 1000, 2000)
    ]
    deadline = time.monotonic() + 120
    while len(list(tmp_path.glob("ready.*"))) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    (tmp_path / "go").touch()
    assert [p.wait(timeout=240) for p in procs] == [0, 0, 0]
    held = sum(p.stat().st_size for p in (cache / "entries").rglob("*.safetensors"))
    # each process goes past the limit by at most its rescan interval (1/32 of the limit,
    # at least one entry) before it sees the others' entries and evicts the least recent
    slack = 3 * max(capacity // 32, one)
    assert capacity // 2 < held <= capacity + slack, (held, capacity)  # (3 x the limit before)


def test_clear_quarantine_leaves_a_live_writers_temp_file(tmp_path) -> None:
    filled(tmp_path, 1)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    live = tmp_path / "tmp" / f"{key(7).hex()}.{os.getpid()}.0.tmp"  # this process: alive
    stale = tmp_path / "tmp" / f"{key(8).hex()}.{int(dead.stdout)}.0.tmp"
    live.write_bytes(b"half an entry")
    stale.write_bytes(b"half an entry")
    (tmp_path / "quarantine" / "x.1.safetensors").write_bytes(b"bad")
    done = cache_cli("clear", str(tmp_path), "--quarantine")
    assert done.returncode == 0 and "removed 2 files" in done.stdout, done.stdout + done.stderr
    assert live.exists() and not stale.exists() and not list((tmp_path / "quarantine").iterdir())
    assert "1 temp file of a live writer kept" in done.stdout
    everything = cache_cli("clear", str(tmp_path))
    assert everything.returncode == 0 and live.exists()  # a full clear keeps it too
    assert not list((tmp_path / "entries").rglob("*.safetensors"))


def test_a_temp_file_of_a_reused_pid_is_swept_and_this_processs_own_kept(tmp_path) -> None:
    """audit5 #5: in a container the engine gets the same pid at every start, so a killed
    writer's temp file named by pid alone was kept for ever (the sweep saw its pid alive).
    The name carries the writer's start time too: a live pid of another start time is a
    writer gone, swept at open and by `cache clear --quarantine`; this process's own kept;
    an old-scheme name keeps the old rule (its pid alive: kept)."""
    if disk_module._start_time(os.getpid()) is None:
        pytest.skip("no /proc/<pid>/stat here: the pid alone decides (the old rule)")
    filled(tmp_path, 1)
    mine = disk_module.temp_file_name(key(7), 0)
    start, pid = mine.split(".")[1], mine.split(".")[2]
    assert start == f"s{disk_module._start_time(os.getpid())}" and pid == str(os.getpid())
    own = tmp_path / "tmp" / disk_module.temp_file_name(key(7), 99)
    reused = tmp_path / "tmp" / f"{key(8).hex()}.s{int(start[1:]) - 1}.{os.getpid()}.0.tmp"  # this pid, before
    parent = os.getppid()  # (alive, another start time than the one named)
    reused_other = tmp_path / "tmp" / f"{key(9).hex()}.s{disk_module._start_time(parent) + 1}.{parent}.0.tmp"
    parents = tmp_path / "tmp" / f"{key(10).hex()}.s{disk_module._start_time(parent)}.{parent}.0.tmp"
    old_scheme = tmp_path / "tmp" / f"{key(11).hex()}.{parent}.0.tmp"  # (an earlier kvpool's: pid alive)
    unknown = tmp_path / "tmp" / f"{key(12).hex()}.s0.{parent}.0.tmp"  # (its writer had no /proc: pid alive)
    for p in (own, reused, reused_other, parents, old_scheme, unknown):
        p.write_bytes(b"half an entry")
    files = (own, reused, reused_other, parents, old_scheme, unknown)
    assert [disk_module.temp_file_owner_alive(p) for p in files] == [True, False, False, True, True, True]
    tier = DiskTier(tmp_path, 1 << 30)  # the next engine's open sweeps
    assert tier.num_stale_tmp_removed == 2 and not reused.exists() and not reused_other.exists()
    assert own.exists() and parents.exists() and old_scheme.exists() and unknown.exists()
    assert not tier.lookup(key(7), descriptor(7)) and not tier.lookup(key(8), descriptor(8))  # never a hit
    reused.write_bytes(b"half an entry")
    done = cache_cli("clear", str(tmp_path), "--quarantine")  # another process: reads /proc/<pid>/stat
    assert done.returncode == 0 and "removed 1 file" in done.stdout, done.stdout + done.stderr
    assert not reused.exists() and own.exists() and parents.exists() and old_scheme.exists()
    assert "4 temp files of live writers kept" in done.stdout, done.stdout
    tier.check_integrity()


def test_the_start_time_is_read_past_a_process_name_of_spaces_and_parentheses(tmp_path, monkeypatch) -> None:
    """/proc/<pid>/stat's second field is the name in parentheses, which may hold both."""
    line = b"4242 (a) b (c)) S 1 4242 4242 0 -1 4194560 10 0 0 0 1 2 0 0 20 0 1 0 987654 100 200\n"
    real_open = builtins.open

    def fake_open(path, *args, **kwargs):
        return io.BytesIO(line) if path == "/proc/4242/stat" else real_open(path, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", fake_open)
    assert disk_module._start_time(4242) == 987654
    assert disk_module._start_time(2**22 + 1) is None  # (above pid_max: no such process)


def test_without_proc_a_temp_file_is_judged_by_its_pid_alone(tmp_path, monkeypatch) -> None:
    """No /proc (or its stat unreadable): the writer names s0 and the sweep falls back to the
    pid alone (the old rule), keeping a live writer's file; writes go on as before."""
    monkeypatch.setattr(disk_module, "_start_time", lambda pid: None)
    monkeypatch.setattr(disk_module, "_own_start", (0, None))
    assert disk_module.temp_file_name(key(1), 3) == f"{key(1).hex()}.s0.{os.getpid()}.3.tmp"
    tier = filled(tmp_path, 2)
    named = tmp_path / "tmp" / f"{key(7).hex()}.s123.{os.getpid()}.0.tmp"  # (a start time not checkable here)
    dead = tmp_path / "tmp" / f"{key(8).hex()}.s123.{2**22 + 1}.0.tmp"  # (above pid_max: no such process)
    named.write_bytes(b"half an entry")
    dead.write_bytes(b"half an entry")
    again = DiskTier(tmp_path, 1 << 30)
    assert again.num_stale_tmp_removed == 1 and named.exists() and not dead.exists()
    assert same(again.get(key(1), descriptor(1)), 1)
    tier.check_integrity()


def _other_version(k: bytes, desc, found: dict[str, torch.Tensor], sum_key: str = "kvpool.manifest_xxh3") -> bytes:
    """An entry as a kvpool of entry format 2 might write it."""
    manifest = json.dumps({"format": 2, "key": k.hex(), "descriptor": json.loads(desc.to_json()), "layout": "new"})
    return st_save(found, metadata={"kvpool.manifest": manifest, sum_key: xxhash.xxh3_128_hexdigest(manifest.encode())})


@pytest.mark.parametrize("sum_key", ["kvpool.manifest_xxh3", "kvpool.manifest_blake3"])
def test_entries_of_another_format_version_are_skipped_not_quarantined(tmp_path, sum_key) -> None:
    tier = filled(tmp_path, 2)
    one = tier.num_bytes // 2
    path = stored(tier, 0)
    path.write_bytes(_other_version(key(0), descriptor(0), tensors(0), sum_key))
    os.utime(path, ns=(1, 1))  # the least recently used
    stats = json.loads(cache_cli("stats", str(tmp_path), "--json").stdout)
    assert stats["other_version"] == 1 and stats["unreadable"] == 0
    fresh = DiskTier(tmp_path, 2 * one + 100)
    assert not fresh.lookup(key(0), descriptor(0)) and fresh.get(key(0), descriptor(0)) is None
    assert fresh.stats.misses == {"other_version": 2} and fresh.stats.num_corrupt == 0
    assert path.exists() and not list((tmp_path / "quarantine").iterdir())
    assert same(fresh.get(key(1), descriptor(1)), 1)
    # reclaimed by age: the byte limit pushes it out first
    assert fresh.put(key(2), descriptor(2), tensors(2)) and fresh.flush(30)
    assert not path.exists() and fresh.stats.num_evictions == 1 and stored(tier, 1).exists()
    fresh.check_integrity()


def test_no_single_flipped_bit_makes_an_entry_look_like_another_version() -> None:
    data = entry_format.encode(key(1), descriptor(1), tensors(1, 4))
    n = entry_format.header_length(data)
    kinds = set()
    for at in range(8 + n):  # every bit of the length and the header (the rest is tensor bytes)
        for bit in range(8):
            raw = bytearray(data)
            raw[at] ^= 1 << bit
            try:
                entry_format.peek(bytes(raw), key(1))
                kinds.add("read")  # (JSON whitespace and the like: the same manifest)
            except entry_format.CorruptEntry:
                kinds.add("corrupt")
            except entry_format.OtherVersion:
                pytest.fail(f"a flip of bit {bit} at byte {at} reads as another version")
    assert "corrupt" in kinds


# ----- the engine serves on over a faulty disk tier ----------------------------------


@pytest.fixture(scope="module")
def engine_run(fp64_model, tmp_path_factory):
    """A directory the engine filled with a 96-token prompt's 6 blocks, and the tokens a run
    of the follow-up prompt gives without any tier."""
    import random

    from kvpool.engine.build import build_engine

    rng = random.Random(28)
    prompt = [rng.randrange(100, 49000) for _ in range(96)]
    follow = prompt + [rng.randrange(100, 49000) for _ in range(5)]
    directory = tmp_path_factory.mktemp("filled")
    first = build_engine(fp64_model, num_blocks=16, disk_cache=directory)
    _serve(first, prompt + [7], "a")
    first.runner.close()
    plain = build_engine(fp64_model, num_blocks=16)
    return directory, follow, _serve(plain, follow, "b")


def _serve(engine, prompt, rid) -> list[int]:
    from kvpool.engine.sampling import SamplingParams

    engine.add_request(prompt, SamplingParams(max_tokens=4, ignore_eos=True), rid)
    while engine.has_unfinished():
        engine.step()
        engine.runner.check_integrity()
    return list(engine.output(rid).completions[0].token_ids)


def _entry_ending_at(directory: Path, num_tokens: int) -> Path:
    """The entry of the prompt's block that ends at token `num_tokens`."""
    for path in (directory / "entries").rglob("*.safetensors"):
        k = bytes.fromhex(path.name.removesuffix(".safetensors"))
        n = entry_format.header_length(path.read_bytes()[:8])
        desc, _ = entry_format.read_header(path.read_bytes()[8 : 8 + n], k)
        if desc.num_computed_tokens == num_tokens:
            return path
    raise AssertionError(f"no entry ends at {num_tokens}")


def _fault(kind: str, path: Path, monkeypatch) -> None:
    k = bytes.fromhex(path.name.removesuffix(".safetensors"))
    if kind == "wrong dtype":  # (loaded, it would be fp32-rounded KV in an fp64 engine)
        _reencoded(path, k, lambda t: t.float())
    elif kind == "wrong shape":
        _reencoded(path, k, lambda t: t[..., :-1].contiguous())
    elif kind == "directory":
        path.unlink()
        path.mkdir()
    elif kind == "fifo":
        path.unlink()
        os.mkfifo(path)
    elif kind == "unreadable":
        fail_under(monkeypatch, path, errno.EACCES, {"read"})
    elif kind == "read-only":
        fail_under(monkeypatch, path.parents[3], errno.EROFS, {"write", "rename", "unlink", "utime"})


@pytest.mark.parametrize("kind", ["wrong dtype", "wrong shape", "directory", "fifo", "unreadable", "read-only"])
def test_the_engine_serves_on_over_a_faulty_disk(engine_run, fp64_model, tmp_path, monkeypatch, kind) -> None:
    from kvpool.engine.build import build_engine

    source, follow, expected = engine_run
    directory = tmp_path / "c"
    shutil.copytree(source, directory)
    _fault(kind, _entry_ending_at(directory, 48), monkeypatch)
    engine = build_engine(fp64_model, num_blocks=16, disk_cache=directory)
    done = threading.Event()
    tokens: list[list[int]] = []
    errors: list[BaseException] = []

    def serve() -> None:
        try:
            tokens.append(_serve(engine, follow, "b"))
        except BaseException as error:  # noqa: BLE001 - reported below
            errors.append(error)
        done.set()

    threading.Thread(target=serve, daemon=True).start()
    assert done.wait(120), f"the engine hung over a {kind} entry"
    assert not errors, f"the engine failed over a {kind} entry: {errors[0]!r}"
    assert tokens == [expected]
    disk = engine.runner.tier_reports()["disk_tier"]
    cached = engine.output("b").num_cached_tokens
    if kind == "read-only":
        assert cached == 96 and disk["io_errors"] == {"utime": 6}  # every hit, its refresh refused
    else:
        assert cached == 32  # blocks 0 and 1 load; block 2 is a miss, the rest computed
        cause = "io_error" if kind == "unreadable" else "corrupt"
        assert disk["misses"].get(cause, 0) >= 1 and disk["num_gets"] == 2
    engine.runner.close()


def test_a_v4_classical_block_of_the_wrong_shape_is_a_miss_recomputed_exactly(tmp_path, one_thread) -> None:
    import random

    from kvpool.models.tiny_dsv4 import TinyDSV4
    from test_dsv4_disk import STRATEGIES
    from test_dsv4_disk import _serve as serve_v4

    model = TinyDSV4(dtype=torch.float64)
    rng = random.Random(7)
    prompt = [rng.randrange(256) for _ in range(2 * 128 + 5)]
    serve_v4(model, [DiskTier(tmp_path, 1 << 30)], STRATEGIES["zero"], prompt)
    path = _entry_ending_at(tmp_path, 128)  # the first classical block: CSA main and indexer, HCA
    _reencoded(path, bytes.fromhex(path.name.removesuffix(".safetensors")), lambda t: t[:-1].contiguous())
    follow = prompt[:256] + [rng.randrange(256) for _ in range(6)]
    out, logits, history, report = serve_v4(model, [DiskTier(tmp_path, 1 << 30)], STRATEGIES["zero"], follow)
    ref = model.reference_logits(history[:-1])[len(follow) - 1 :]
    assert (logits - ref).abs().max().item() <= 1e-9  # fp64: exact up to rounding
    assert out.num_cached_tokens == 0 and report["disk_tier"]["misses"] == {"corrupt": 1}
    assert report["disk_tier"]["num_corrupt"] == 1 and len(list((tmp_path / "quarantine").iterdir())) == 1


def test_the_engine_heals_every_corrupted_payload_in_one_run(engine_run, fp64_model, tmp_path) -> None:
    from kvpool.engine.build import build_engine
    from kvpool.tiers.disk_admin import inspect_cache

    source, follow, expected = engine_run
    directory = tmp_path / "c"
    shutil.copytree(source, directory)
    for path in (directory / "entries").rglob("*.safetensors"):
        raw = bytearray(path.read_bytes())
        raw[-3] ^= 0xFF  # the payload: every header still checks out
        path.write_bytes(bytes(raw))
    assert [bool(i.problem) for i in inspect_cache(directory)] == [True] * 6
    engine = build_engine(fp64_model, num_blocks=16, disk_cache=directory)
    assert _serve(engine, follow, "b") == expected
    engine.runner.close()
    disk = engine.runner.tier_reports()["disk_tier"]
    assert disk["num_corrupt"] == 1 and disk["num_puts"] == 6  # block 0 quarantined; all 6 rewritten
    assert [i.problem for i in inspect_cache(directory)] == [""] * 6  # (one a run before)


def test_an_entry_path_that_cannot_be_reached_is_a_counted_miss(tmp_path) -> None:
    tier = DiskTier(tmp_path, 1 << 30)
    path = stored(tier, 1)
    path.parent.parent.mkdir(parents=True)
    path.parent.write_bytes(b"not a directory")  # a file where the entry's <kk> directory goes
    assert not tier.lookup(key(1), descriptor(1))  # before: NotADirectoryError out of the stat
    assert tier.get(key(1), descriptor(1)) is None
    assert tier.stats.misses == {"io_error": 2} and tier.io_errors == {"read": 2}
    assert tier.put(key(1), descriptor(1), tensors(1)) and tier.flush(30)
    assert tier.stats.num_write_errors == 1 and tier._writer.num_failed == 0
    path.parent.unlink()
    assert tier.put(key(1), descriptor(1), tensors(1)) and tier.flush(30)
    assert same(tier.get(key(1), descriptor(1)), 1)
    tier.check_integrity()


def _crafted(manifest: str) -> bytes:
    """Key 1's entry whose manifest is `manifest`, its checksum valid (crafted, never torn)."""
    if manifest == "not json":
        text = "{not json"
    else:
        m = {"format": entry_format.FORMAT, "key": key(1).hex(), "descriptor": json.loads(descriptor(1).to_json())}
        m["tensors"] = ["k", "v"] if manifest == "tensors a list" else {"k": "float32", "v": "float32"}
        text = json.dumps(m)
    checksum = xxhash.xxh3_128_hexdigest(text.encode())
    return st_save(tensors(1), metadata={"kvpool.manifest": text, "kvpool.manifest_xxh3": checksum})


@pytest.mark.parametrize("manifest", ["not json", "tensors a list", "a tensor's entry a string"])
def test_a_crafted_manifest_with_a_valid_checksum_is_corrupt(manifest) -> None:
    with pytest.raises(entry_format.CorruptEntry):  # before: JSONDecodeError / TypeError
        entry_format.decode(_crafted(manifest), key(1))


def test_a_crafted_manifest_on_disk_is_quarantined(tmp_path) -> None:
    tier = filled(tmp_path, 2)
    stored(tier, 1).write_bytes(_crafted("not json"))
    fresh = DiskTier(tmp_path, 1 << 30)
    assert fresh.get(key(1), descriptor(1)) is None  # before: JSONDecodeError out of it
    assert fresh.stats.misses == {"corrupt": 1} and not stored(tier, 1).exists()
    assert same(fresh.get(key(0), descriptor(0)), 0)


def test_an_entry_dropped_while_the_directory_is_rescanned_stays_dropped(tmp_path, monkeypatch) -> None:
    import kvpool.tiers.disk as disk_module

    tier = filled(tmp_path, 3)
    real_scan = disk_module.scan_entries

    def scan(root):  # the engine evicts key 1 while the writer's rescan lists the directory
        found = real_scan(root)
        tier.evict(key(1))
        return found

    monkeypatch.setattr(disk_module, "scan_entries", scan)
    tier._rescan()
    # before: the rescan put the evicted entry back in the index (its bytes counted, its
    # key "contained") from the listing made before the eviction
    assert not tier.contains(key(1)) and tier.num_entries == 2
    assert tier.num_bytes == sum(stored(tier, i).stat().st_size for i in (0, 2))
    tier.check_integrity()


def test_a_block_whose_entry_outgrows_the_limit_is_refused_and_evicts_nothing(tmp_path) -> None:
    """A block's tensors within the byte limit, its entry (tensors plus the header with the
    manifest) past it: refused and counted, as a block larger than the tier is. It was
    written, then evicted every entry, least recent first, and finally itself."""
    limit = len(entry_format.encode(key(5), descriptor(5), tensors(5))) - 1
    assert 2 * 2 * 1024 * 4 <= limit  # the tensors' bytes, what put can weigh without encoding
    tier = DiskTier(tmp_path, limit)
    assert tier.put(key(0), descriptor(0), tensors(0, 64))
    assert tier.flush(30) and tier.num_entries == 1
    tier.put(key(5), descriptor(5), tensors(5))
    assert tier.flush(30)
    assert tier.stats.num_rejected_puts == 1 and tier.stats.num_evictions == 0 and tier.stats.num_puts == 1
    assert not stored(tier, 5).exists() and not list((tmp_path / "tmp").iterdir())
    assert tier.get(key(0), descriptor(0)) is not None and stored(tier, 0).exists()
    tier.check_integrity()


def test_a_multimodal_block_past_entry_bytes_is_refused_and_said(tmp_path) -> None:
    """entry_bytes (what check_sizes weighs a limit by) bounds a text block's entry; a
    multimodal block's extra key, which the descriptor keeps whole, takes its entry past
    that (m6b, review 8 #10). Such a block on a limit of exactly entry_bytes was refused
    with no word (num_rejected_puts only): now one line says so, its key's share named."""
    import dataclasses

    from kvpool.cache.chains import mm_extra_key
    from kvpool.cache.types import MMItem

    shapes = {name: (t.dtype, tuple(t.shape)) for name, t in tensors(0).items()}
    lines: list[str] = []
    limit = DiskTier(tmp_path / "probe", 1 << 30).entry_bytes(descriptor(0), 16, shapes)
    tier = DiskTier(tmp_path / "c", limit, log=lines.append)
    largest = {"token_ids": ((1 << 32) - 1,) * 16, "num_computed_tokens": 1 << 40, "tenant": "0" * 16}
    text = dataclasses.replace(descriptor(1), **largest)  # (the bound's own case: stored)
    assert tier.put(key(1), text, tensors(1)) and tier.flush(30) and tier.stats.num_puts == 1
    extra = mm_extra_key([MMItem(start=3, length=5, content_hash="ab" * 32)], 16, 0)
    for i in (2, 3):
        image = dataclasses.replace(descriptor(i), mm_identity=extra.hex(), **largest)
        assert tier.put(key(i), image, tensors(i)) and tier.flush(30)
        assert not tier._path(key(i), image).exists()
    assert tier.stats.num_puts == 1 and tier.stats.num_rejected_puts == 2 and tier.num_entries == 1
    assert len(lines) == 1 and f"its multimodal key adds {2 * len(extra)} bytes" in lines[0], lines
    assert f"({limit:,} bytes, --disk-cache-gib" in lines[0] and "num_rejected_puts" in lines[0]
    tier.check_integrity()


def _entry_with_foreign_copies(tmp_path):
    """A tier holding one entry, and two copies of its file under names that parse as hex but
    are no entry's (upper case, a space: bytes.fromhex takes both). -> (the tier, the entry's path)"""
    tier = DiskTier(tmp_path, 1 << 30)
    tier.put(key(0xAB), descriptor(0xAB), tensors(0xAB, 64))
    assert tier.flush(30)
    path = stored(tier, 0xAB)
    shutil.copy(path, path.with_name(path.name.upper().replace("SAFETENSORS", "safetensors")))
    shutil.copy(path, path.with_name("ab cd.safetensors"))
    return tier, path


def test_a_foreign_file_whose_name_is_not_an_entrys_is_left_alone(tmp_path) -> None:
    """Copies of an entry under names that parse as hex but are no entry's (upper case, a
    space: bytes.fromhex takes both) are foreign files: not indexed, not counted, not
    evicted. They were indexed: check_integrity failed on them, and the upper-case copy
    took the real entry's index slot, so one of the two files was never counted."""
    tier, path = _entry_with_foreign_copies(tmp_path)
    again = DiskTier(tmp_path, 1 << 30)
    again.check_integrity()
    assert again.num_entries == 1 and again.num_bytes == path.stat().st_size
    assert again.get(key(0xAB), descriptor(0xAB)) is not None
    assert again.evict(key(0xAB)) and not path.exists() and len(list(path.parent.iterdir())) == 2


def test_a_cache_path_behind_a_directory_the_user_may_not_enter_is_one_error_line(tmp_path, monkeypatch, capsys):
    """`--disk-cache` or `kvpool cache ls` on a path under another user's home: stat refuses
    (EACCES; root is never refused, so the refusal is planted). One line naming the path,
    status 2, no traceback: Path.exists() raised PermissionError out of both."""
    import pathlib

    from kvpool.cli.main import main
    from kvpool.tiers.disk import open_directory

    DiskTier(tmp_path / "home" / "c", 1 << 30)  # a cache there, as its owner made it
    locked = str(tmp_path / "home")
    real_stat = pathlib.Path.stat

    def stat(self, *args, **kwargs):
        if str(self).startswith(locked):
            raise PermissionError(errno.EACCES, "Permission denied", str(self))
        return real_stat(self, *args, **kwargs)

    monkeypatch.setattr(pathlib.Path, "stat", stat)
    with pytest.raises(ValueError, match=r"disk cache '.*home/c' cannot be reached: Permission denied"):
        open_directory(tmp_path / "home" / "c")
    for action in ("ls", "stats", "clear"):
        assert main(["cache", action, str(tmp_path / "home" / "c")]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "home/c" in err[0] and "Permission denied" in err[0], err
    # clear with entries/ refused: said in one line, status 1, the other directories cleared
    locked = str(tmp_path / "home" / "c" / "entries")  # (the planted stat reads it at each call)
    (tmp_path / "home" / "c" / "quarantine" / "x.safetensors").write_bytes(b"x")
    assert main(["cache", "clear", str(tmp_path / "home" / "c")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "1 could not be removed" in err[0] and "entries" in err[0], err
    assert not list((tmp_path / "home" / "c" / "quarantine").iterdir())


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("weights_version", 5),
        ("model_id", None),
        ("num_computed_tokens", "16"),
        ("num_computed_tokens", True),
        ("token_ids", "abc"),
        ("token_ids", [1, "2"]),
    ],
)
def test_a_descriptor_field_of_the_wrong_type_is_a_corrupt_entry(tmp_path, capsys, field, value) -> None:
    """A manifest whose checksum is valid and whose descriptor holds a field of the wrong
    type (another writer's bug, a crafted file): unreadable in `kvpool cache ls / stats`,
    quarantined by the tier. `stats` raised TypeError out of weights_version[:12], `ls`
    out of formatting a token count that is not a number."""
    from kvpool.cli.main import main
    from kvpool.tiers import BlockDescriptor

    text = json.loads(descriptor(1).to_json())
    text[field] = value
    with pytest.raises(ValueError, match=f"block descriptor field {field}"):
        BlockDescriptor.from_json(json.dumps(text))
    tier = filled(tmp_path, 2)
    m = {"format": entry_format.FORMAT, "key": key(1).hex(), "descriptor": text}
    m["tensors"] = {
        n: {"dtype": "float32", "shape": list(t.shape), "xxh3": entry_format._tensor_sum(t)}
        for n, t in sorted(tensors(1).items())
    }
    manifest = json.dumps(m)
    checksum = xxhash.xxh3_128_hexdigest(manifest.encode())
    stored(tier, 1).write_bytes(st_save(tensors(1), {"kvpool.manifest": manifest, "kvpool.manifest_xxh3": checksum}))
    assert main(["cache", "ls", str(tmp_path), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["entries"]
    assert [bool(r["problem"]) for r in rows] == [False, True] and f"field {field}" in rows[1]["problem"], rows
    assert main(["cache", "stats", str(tmp_path), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["entries"] == 2 and out["unreadable"] == 1
    fresh = DiskTier(tmp_path, 1 << 30)
    assert fresh.get(key(1), descriptor(1)) is None and fresh.stats.misses == {"corrupt": 1}
    assert same(fresh.get(key(0), descriptor(0)), 0)


def test_a_marker_written_by_another_process_meanwhile_is_no_foreign_file(tmp_path, monkeypatch) -> None:
    """Two engines opening one new directory at once: A writes the marker after B found
    none and before B lists the directory. B saw the marker among "other files" and refused
    the directory as no kvpool cache; it is A's cache being made, and B opens it."""
    import pathlib

    from kvpool.tiers.disk import MARKER, open_directory

    open_directory(tmp_path / "c")  # A, done: the marker and the subdirectories
    real_exists = pathlib.Path.exists
    seen = []

    def exists(self):  # B's look at the marker came a moment before A wrote it
        if self.name == MARKER and not seen:
            seen.append(self)
            return False
        return real_exists(self)

    monkeypatch.setattr(pathlib.Path, "exists", exists)
    assert open_directory(tmp_path / "c") == tmp_path / "c" and seen
    assert sorted(p.name for p in (tmp_path / "c").iterdir()) == sorted([MARKER, "entries", "quarantine", "tmp"])


# ----- a full filesystem, a cache removed under the engine -------------------------------


def _entry_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in (root / "entries").rglob("*.safetensors"))


def full_at(monkeypatch, num_bytes: int) -> None:
    """A filesystem of `num_bytes` under every disk tier: a write whose entry would take the
    entry files past it fails with ENOSPC, its temp file removed (as the kernel's would)."""
    real = DiskTier._store

    def store(self, key, data, final, gate=None):
        if _entry_bytes(self.root) + len(data) > num_bytes:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self.root / "tmp" / "x.tmp"))
        return real(self, key, data, final, gate)

    monkeypatch.setattr(DiskTier, "_store", store)


def full_when(monkeypatch) -> list[bool]:
    """A filesystem that is full while the returned flag's one item is True: every write
    fails with ENOSPC, whatever eviction frees (a foreign writer, another user's quota)."""
    full = [False]
    real = DiskTier._store

    def store(self, key, data, final, gate=None):
        if full[0]:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self.root / "tmp" / "x.tmp"))
        return real(self, key, data, final, gate)

    monkeypatch.setattr(DiskTier, "_store", store)
    return full


def check_full_disk(tier: DiskTier, lines: list[str], n: int, fits: int) -> None:
    """After `n` puts on a disk that holds `fits` entries: every write made room, the
    newest `fits` entries hit, the oldest were evicted, and one line said so."""
    assert tier.flush(30)
    tier.check_integrity()
    assert tier.stats.num_puts == n and tier.stats.num_write_errors == 0
    assert [i for i in range(n) if same(tier.get(key(i), descriptor(i)), i)] == list(range(n - fits, n))
    # (on a real filesystem a write may need two entries' room: blocks and inodes)
    assert tier.stats.num_evictions == n - fits and 0 < tier.report()["disk_full"] <= n - fits
    assert len(lines) == 1 and "ENOSPC" in lines[0] and "evicting least recently used entries" in lines[0]


def test_a_disk_that_fills_before_the_byte_limit_evicts_to_make_room(tmp_path, monkeypatch) -> None:
    """The disk filled before --disk-cache-gib (16 GiB by default) was reached: every later
    write failed, silently, and the tier kept its old entries for ever (no new prefix was
    ever cached again). Now a full disk is a byte limit: the LRU entries make room."""
    probe = DiskTier(tmp_path / "probe", 1 << 30)
    assert probe.put(key(0), descriptor(0), tensors(0)) and probe.flush(30)
    one = _entry_bytes(probe.root)
    full_at(monkeypatch, 4 * one + one // 2)
    lines: list[str] = []
    tier = DiskTier(tmp_path / "c", 1 << 30, log=lines.append)
    for i in range(10):
        assert tier.put(key(i), descriptor(i), tensors(i))
    check_full_disk(tier, lines, 10, 4)


def test_a_full_disk_whose_least_recently_used_entries_cannot_be_removed_evicts_past_them(
    tmp_path, monkeypatch
) -> None:
    """Review 9: making room counted the bytes of the victims it chose, not of those it
    freed: two LRU entries whose unlink the OS refuses (EACCES: another user's entries) took
    the whole need, nothing was freed, and the write was refused (stored before 2b327ad).
    Now a refused victim frees nothing and the next least recently used one is evicted."""
    probe = DiskTier(tmp_path / "probe", 1 << 30)
    assert probe.put(key(0), descriptor(0), tensors(0)) and probe.flush(30)
    one = _entry_bytes(probe.root)
    lines: list[str] = []
    tier = DiskTier(tmp_path / "c", 1 << 30, fsync=False, log=lines.append)
    for i in range(6):
        assert tier.put(key(i), descriptor(i), tensors(i)) and tier.flush(30)
    locked = {tier._path(key(i), descriptor(i)) for i in (0, 1)}
    real_unlink = Path.unlink

    def unlink(self, *args, **kwargs):
        if self in locked:
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(self))
        return real_unlink(self, *args, **kwargs)

    monkeypatch.setattr(Path, "unlink", unlink)
    sizes = [tier._path(key(i), descriptor(i)).stat().st_size for i in range(6)]
    full_at(monkeypatch, 6 * one + one // 2)
    assert tier.put(key(6), descriptor(6), tensors(6)) and tier.flush(30)
    tier.check_integrity()
    # the LRU entries past the two locked ones, as many as free the new entry's bytes
    need = tier._path(key(6), descriptor(6)).stat().st_size
    evicted = next(k for k in range(1, 5) if sum(sizes[2 : 2 + k]) >= need)
    assert tier.stats.num_write_errors == 0 and tier.stats.num_evictions == evicted and tier.report()["disk_full"] == 1
    assert tier.io_errors == {"evict": 2} and all(path.exists() for path in locked)
    assert [tier._path(key(i), descriptor(i)).exists() for i in range(2, 6)] == [i >= 2 + evicted for i in range(2, 6)]
    assert [i for i in range(2, 7) if same(tier.get(key(i), descriptor(i)), i)] == list(range(2 + evicted, 7))
    tier.check_integrity()


def test_a_real_tmpfs_that_fills_evicts_to_make_room(tmp_path) -> None:
    """The same on a real 1 MiB tmpfs (root only: skipped where mount is refused)."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1M", "tmpfs", str(mnt)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        lines: list[str] = []
        tier = DiskTier(mnt / "c", 1 << 30, log=lines.append)
        n = 80  # ~17 kB entries: about 60 fit in 1 MiB
        for i in range(n):
            assert tier.put(key(i), descriptor(i), tensors(i))
        assert tier.flush(30)
        fits = tier.num_entries
        assert 40 < fits < n
        check_full_disk(tier, lines, n, fits)
        tier.close()
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


def test_a_tier_size_error_comes_alone_not_after_the_line_on_another_models_entries(tmp_path) -> None:
    """A disk tier too small for a block, on a directory of another model's entries: the
    line on what the directory holds came first (expect_blocks ran before check_sizes), then
    the error. Now the size error is checked first, and comes alone (review_6 #7)."""
    from kvpool.engine.llama_runner import llama_runner
    from random_llama import DESCRIPTOR, random_llama

    other = DiskTier(tmp_path / "c", 1 << 30)
    assert other.put(key(0), descriptor(0), tensors(0)) and other.flush(30)
    other.close()
    one = _entry_bytes(tmp_path / "c")
    lines: list[str] = []
    small = DiskTier(tmp_path / "c", one + 100, log=lines.append)  # (holds the foreign entry, no block of this model)
    assert small.num_entries == 1
    with pytest.raises(ValueError, match=r"\(--disk-cache-gib\) holds no KV block"):
        llama_runner(random_llama("cpu", torch.float64), 8, 16, DESCRIPTOR, persistent_tiers=[small])
    assert lines == []


def test_a_full_disk_that_evicting_does_not_relieve_keeps_the_entries(tmp_path, monkeypatch) -> None:
    """A disk filled by something eviction cannot undo (a foreign writer, entry files held
    open by a reader, another user's quota): every write evicted an entry, found the disk
    full again and failed, so the tier emptied itself and stored nothing (10 puts: all 5
    entries gone). Now making room stops at the first retry that fails, one line says so,
    and it is tried again after a back-off (doubled each time) or when a write succeeds."""
    import kvpool.tiers.disk as disk_module

    full = full_when(monkeypatch)
    clock = [1000.0]
    monkeypatch.setattr(disk_module, "_now", lambda: clock[0], raising=False)  # (the fix adds it)
    lines: list[str] = []
    tier = DiskTier(tmp_path / "c", 1 << 30, log=lines.append)
    for i in range(5):
        assert tier.put(key(i), descriptor(i), tensors(i))
    assert tier.flush(30)
    full[0] = True  # the space is gone, and no eviction of ours brings it back
    for i in range(5, 15):
        assert tier.put(key(i), descriptor(i), tensors(i))
    assert tier.flush(30)
    tier.check_integrity()
    report = tier.report()
    assert report["num_evictions"] == 1 and report["entries"] == 4, report  # (0 and all 10 failed before)
    assert report["num_write_errors"] == 10 and report["disk_full"] == 1 and report["disk_full_no_room"] == 1
    assert [i for i in range(15) if same(tier.get(key(i), descriptor(i)), i)] == [1, 2, 3, 4]
    assert len(lines) == 2 and "evicting least recently used entries" in lines[0], lines
    assert "freed no room" in lines[1] and "keeps its entries" in lines[1] and "60 s" in lines[1], lines
    clock[0] += 61  # the back-off over: room is made (and found useless) once more, the next back-off 120 s
    for i in range(15, 18):
        assert tier.put(key(i), descriptor(i), tensors(i))
    assert tier.flush(30)
    report = tier.report()
    evicted = report["num_evictions"]  # (two when the oldest entry is a few bytes smaller than the new one)
    assert report["disk_full"] == report["disk_full_no_room"] == 2 and evicted in (2, 3), report
    assert report["entries"] == 5 - evicted and report["num_write_errors"] == 13, report
    clock[0] += 61  # (within the doubled back-off: nothing evicted)
    assert tier.put(key(18), descriptor(18), tensors(18)) and tier.flush(30)
    assert tier.report()["num_evictions"] == evicted and tier.num_entries == 5 - evicted
    full[0] = False  # space again: the write succeeds, and the back-off is reset
    assert tier.put(key(19), descriptor(19), tensors(19)) and tier.flush(30)
    assert tier.num_entries == 6 - evicted and same(tier.get(key(19), descriptor(19)), 19)
    assert tier._no_room_until == 0.0 and tier._no_room_backoff_s == disk_module._NO_ROOM_BACKOFF_S
    assert len(lines) == 2  # said once
    tier.check_integrity()


def test_each_episode_of_a_full_disk_is_said_and_a_flapping_one_does_not_flood(tmp_path, monkeypatch) -> None:
    """Making room that stops (a full disk evicting cannot relieve) was said once a process
    (review 8 #6): the disk filling again hours after a write succeeded was silent. Each
    episode (from that stop to the next write that succeeds) is said now, but one that comes
    within the quiet time since the last line (60 s, doubled with each line) is only counted,
    and the next line tells how many were not said."""
    import kvpool.tiers.disk as disk_module

    full = full_when(monkeypatch)
    clock = [1000.0]
    monkeypatch.setattr(disk_module, "_now", lambda: clock[0])
    lines: list[str] = []
    tier = DiskTier(tmp_path, 1 << 30, log=lines.append)
    n = iter(range(10_000))

    def episode(at: float) -> list[str]:
        """The disk fills at `at` (a write fails after making room), then has room again."""
        clock[0] = at
        said = len(lines)
        for i in range(3):  # (room first, so that there is an entry to evict)
            assert tier.put(key(i := next(n)), descriptor(i), tensors(i)) and tier.flush(30)
        full[0] = True
        assert tier.put(key(i := next(n)), descriptor(i), tensors(i)) and tier.flush(30)
        full[0] = False
        assert tier.put(key(i := next(n)), descriptor(i), tensors(i)) and tier.flush(30)  # the episode ends
        return [line for line in lines[said:] if "freed no room" in line]

    assert len(episode(1000)) == 1  # (and the "evicting least recently used entries" line, once)
    assert episode(1030) == []  # 30 s later: within the first quiet time (60 s)
    (again,) = episode(1070)  # said again: a new episode, after the quiet time
    assert "ENOSPC" in again and "1 more since the last line" in again and "for 60 s" in again, again
    assert episode(1150) == []  # (the quiet time doubled: 120 s)
    assert len(episode(1200)) == 1
    assert len(episode(9000)) == 1  # hours later
    assert tier.num_no_room == 6 and tier.report()["disk_full_no_room"] == 6
    tier.check_integrity()


def test_a_real_tmpfs_whose_entries_are_held_open_keeps_them(tmp_path) -> None:
    """review_6's repro on a real 1 MiB tmpfs (root only): 20 entries, a foreign file takes
    the rest, every entry file held open by a reader (unlinked, it frees nothing): 20 more
    puts emptied the tier (20 evictions, 0 entries). Now one write's room evicted, 18-19 kept."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1M", "tmpfs", str(mnt)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    held = []
    try:
        lines: list[str] = []
        tier = DiskTier(mnt / "c", 1 << 30, log=lines.append)
        for i in range(20):
            assert tier.put(key(i), descriptor(i), tensors(i))
        assert tier.flush(30) and tier.num_entries == 20
        with open(mnt / "foreign", "wb") as f, pytest.raises(OSError):
            f.write(b"x" * (2 << 20))
            f.flush()
        held = [open(p, "rb") for p in (mnt / "c" / "entries").rglob("*.safetensors")]
        assert len(held) == 20
        for i in range(20, 40):
            assert tier.put(key(i), descriptor(i), tensors(i))
        assert tier.flush(30)
        tier.check_integrity()
        report = tier.report()
        evicted = report["num_evictions"]  # (one entry's room or two: the new entries are a few bytes larger)
        assert evicted in (1, 2) and report["entries"] == 20 - evicted and report["num_write_errors"] == 20, report
        assert report["disk_full"] == report["disk_full_no_room"] == 1, report
        assert sum(same(tier.get(key(i), descriptor(i)), i) for i in range(20)) == 20 - evicted
        assert len(lines) == 2 and "freed no room" in lines[1], lines
        tier.close()
    finally:
        for f in held:
            f.close()
        subprocess.run(["umount", str(mnt)], check=True)


def test_a_cache_removed_under_the_engine_is_said_once_and_it_serves_on(tmp_path, capfd) -> None:
    """`rm -rf` of the cache directory under a running engine: every write failed, counted
    in --json alone and never said. Now one line names the directory; the engine serves
    the same tokens, and what it computed before stays a device hit."""
    from kvpool.engine.engine import Engine
    from kvpool.engine.llama_runner import llama_runner
    from random_llama import DESCRIPTOR, random_ids, random_llama

    model = random_llama("cpu", torch.float64)
    first, second = random_ids(40, 1), random_ids(40, 2)

    def serve(e: Engine, prompt: list[int], rid: str) -> tuple[list[int], int]:
        from kvpool.engine.sampling import SamplingParams

        e.add_request(prompt, SamplingParams(max_tokens=3, ignore_eos=True), rid)
        while e.has_unfinished():
            e.step()
            e.runner.check_integrity()
        out = e.output(rid)
        return list(out.completions[0].token_ids), out.num_cached_tokens

    plain = Engine(llama_runner(model, 32, 16, DESCRIPTOR))
    expected = [serve(plain, p, f"r{i}")[0] for i, p in enumerate((first, second))]
    capfd.readouterr()
    engine = Engine(llama_runner(model, 32, 16, DESCRIPTOR, persistent_tiers=[DiskTier(tmp_path / "c", 1 << 30)]))
    assert serve(engine, first, "a") == (expected[0], 0)
    assert engine.runner.flush_tiers(30)
    shutil.rmtree(tmp_path / "c")
    assert serve(engine, second, "b") == (expected[1], 0)
    assert serve(engine, first + [7], "c")[1] == 32  # what it computed: still a device hit
    assert engine.runner.flush_tiers(30)
    disk = engine.runner.tier_reports()["disk_tier"]
    err = capfd.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("kvpool: disk cache")]
    assert disk["num_write_errors"] >= 2 and "Traceback" not in err
    assert disk["entries"] == disk["bytes_used"] == 0  # the removed entries no longer counted
    assert len(lines) == 1 and "ENOENT" in lines[0] and "removed" in lines[0] and str(tmp_path / "c") in lines[0]
    engine.runner.close()


def test_a_directory_of_another_block_size_or_dtype_is_said_and_never_served(tmp_path, capfd) -> None:
    """A cache written by an engine of another block size (or KV dtype, model, layout) is
    in another namespace: a miss, never a wrong load; but nothing said why every prefix
    missed. One line now names the directory and what it holds instead."""
    import dataclasses

    from kvpool.engine.engine import Engine
    from kvpool.engine.llama_runner import llama_runner
    from kvpool.engine.sampling import SamplingParams
    from random_llama import DESCRIPTOR, random_ids, random_llama

    model = random_llama("cpu", torch.float64)
    prompt = random_ids(70, 3)

    def serve(block_size: int, descriptor, rid: str) -> tuple[list[int], int]:
        tier = DiskTier(tmp_path / "c", 1 << 30)
        engine = Engine(llama_runner(model, 32, block_size, descriptor, persistent_tiers=[tier]))
        engine.add_request(prompt, SamplingParams(max_tokens=3, ignore_eos=True), rid)
        while engine.has_unfinished():
            engine.step()
        assert engine.runner.flush_tiers(30)
        engine.runner.close()
        out = engine.output(rid)
        return list(out.completions[0].token_ids), out.num_cached_tokens

    tokens16, _ = serve(16, DESCRIPTOR, "a")
    assert "kvpool: disk cache" not in capfd.readouterr().err  # (an empty directory: nothing to say)
    other = dataclasses.replace(DESCRIPTOR, layout_id=DESCRIPTOR.layout_id.replace("bs16", "bs32"))
    tokens32, cached = serve(32, other, "b")
    err = capfd.readouterr().err
    assert cached == 0 and tokens32 == tokens16  # computed, not read from the bs16 entries
    lines = [line for line in err.splitlines() if line.startswith("kvpool: disk cache")]
    assert len(lines) == 1 and "nothing of this model, weights and layout there yet" in lines[0], err
    assert f"weights {other.weights_version[:12]}" in lines[0], err  # (review 9 #7: the weights named)
    assert "its 4 entries are of other models" in lines[0], err
    assert other.layout_id in lines[0] and "kvpool cache stats" in lines[0]
    assert serve(16, DESCRIPTOR, "c")[1] == 64  # its own entries still serve it, and no line
    assert "kvpool: disk cache" not in capfd.readouterr().err


def test_a_shared_cache_cut_down_to_a_smaller_limit_at_its_first_write_is_said(tmp_path) -> None:
    """A process opening a shared directory with a smaller --disk-cache-gib (the 16 GiB
    default on a team's larger cache) evicted everyone's least recently used entries down
    to its own limit without a word. Now one line says how many and how much, and the cut
    waits for the first write the tier takes (the open only indexes)."""
    tier = filled(tmp_path, 10)
    for i in range(10):  # the LRU order a next process reads (file times may tie within a tick)
        os.utime(stored(tier, i), ns=(i + 1, (i + 1) * 10**9))
    one = len(entry_format.encode(key(10), descriptor(10), tensors(10)))
    newest = sum(stored(tier, i).stat().st_size for i in range(7, 10)) + one  # 3 of these, and entry 10
    lines: list[str] = []
    DiskTier(tmp_path, 1 << 30, log=lines.append)  # (room for all: nothing to say)
    assert lines == []
    small = DiskTier(tmp_path, newest, log=lines.append)
    assert small.num_entries == 10 and small.stats.num_evictions == 0 and lines == []  # opened: all kept
    small.check_integrity()  # (over its limit while the cut waits: an engine's /debug/cache, a serve's stop)
    assert small.put(key(10), descriptor(10), tensors(10)) and small.flush(30)
    assert small.num_entries == 4 and small.stats.num_evictions == 7
    assert [i for i in range(11) if small.lookup(key(i), descriptor(i))] == [7, 8, 9, 10]  # the oldest went
    assert len(lines) == 1 and "held more than this process's byte limit" in lines[0]
    assert (
        "its 6 least recently used entries" in lines[0]
    )  # (the 7th made room for entry 10) and str(tmp_path) in lines[0]
    small.check_integrity()


def test_the_cut_at_the_first_write_takes_the_least_recently_used_as_the_directory_holds_them_then(tmp_path) -> None:
    """The cut waits for the first write, so it reads the directory again: entries another
    process read since this one opened are its most recently used, not the ones to evict
    (the open's index, reused, evicted them and kept older ones)."""
    tier = filled(tmp_path, 10)
    for i in range(10):  # entry i last used at second i + 1: 0 the least recently used
        os.utime(stored(tier, i), ns=((i + 1) * 10**9, (i + 1) * 10**9))
    one = len(entry_format.encode(key(10), descriptor(10), tensors(10)))
    size = stored(tier, 0).stat().st_size
    small = DiskTier(tmp_path, 4 * size + one)  # room for 4 of them and its own write
    for i in range(3):  # another process serves entries 0-2 meanwhile: now the newest
        os.utime(stored(tier, i), ns=((20 + i) * 10**9, (20 + i) * 10**9))
    assert small.put(key(10), descriptor(10), tensors(10)) and small.flush(30)
    left = sorted(i for i in range(11) if stored(tier, i).exists())
    # the three read meanwhile and the new one stay; of the rest, the oldest went first
    assert left[:3] == [0, 1, 2] and left[-1] == 10 and left[3:-1] == list(range(10 - len(left[3:-1]), 10)), left
    assert small.stats.num_evictions >= 6  # (4 entries' room at most: 6 of 3-9 went, or 7)
    small.check_integrity()


def test_lookups_go_on_while_the_cut_at_the_first_write_unlinks_its_victims(tmp_path, monkeypatch) -> None:
    """The cut to the limit unlinked every victim under the tier's lock, on the writer's
    thread while the engine served: a lookup waited for all of them (review 8 #3: 0.47 s
    behind 5,000 unlinks; a 100 GiB cache under the 16 GiB default, seconds). The victims
    now leave the index under the lock and are unlinked after it: with an unlink held up, a
    lookup still answers (a victim's a miss, a kept entry a hit) and the index checks out."""
    tier = filled(tmp_path, 10)
    for i in range(10):  # entry i last used at second i + 1: 0 the least recently used
        os.utime(stored(tier, i), ns=((i + 1) * 10**9, (i + 1) * 10**9))
    one = len(entry_format.encode(key(10), descriptor(10), tensors(10)))
    newest = sum(stored(tier, i).stat().st_size for i in range(7, 10)) + one  # 3 of these, and entry 10
    small = DiskTier(tmp_path, newest, log=lambda line: None)
    unlink, started, release = Path.unlink, threading.Event(), threading.Event()

    def held_up(self, *args, **kwargs):
        if self.suffix == ".safetensors" and self.parent.parent.parent.name == "entries":
            started.set()
            release.wait(30)
        return unlink(self, *args, **kwargs)

    monkeypatch.setattr(Path, "unlink", held_up)
    assert small.put(key(10), descriptor(10), tensors(10))
    assert started.wait(30)  # the writer is in the cut's first unlink
    answers: list[bool] = []
    looker = threading.Thread(target=lambda: answers.extend(small.lookup(key(i), descriptor(i)) for i in (0, 9)))
    looker.start()
    looker.join(5)
    done = not looker.is_alive()
    if done:
        small.check_integrity()  # (the victims out of the index, the files not yet)
    release.set()
    assert small.flush(30)
    looker.join(30)
    assert done, "a lookup waited for the cut's unlinks"
    assert answers == [False, True]  # 0 is a victim (its unlink under way): a miss, not re-indexed
    assert sorted(i for i in range(11) if stored(tier, i).exists()) == [7, 8, 9, 10]
    assert small.stats.num_evictions == 7 and small.num_entries == 4
    assert small.num_bytes == sum(stored(tier, i).stat().st_size for i in (7, 8, 9, 10))
    small.check_integrity()


@pytest.mark.parametrize("capacity", [1, "entry - 1"])
def test_a_limit_too_small_for_any_entry_leaves_a_shared_cache_whole(tmp_path, capacity) -> None:
    """DiskTier(dir, 1) (what `--disk-cache-gib 1e-9` opens before the runner refuses the
    size) cut the directory to its limit as it opened: a shared cache's entries all deleted,
    and then the size refused. Now a tier whose limit takes no entry never evicts one."""
    tier = filled(tmp_path, 5)
    entry_size = stored(tier, 0).stat().st_size
    before = sorted(p for p in (tmp_path / "entries").rglob("*.safetensors"))
    small = DiskTier(tmp_path, entry_size - 1 if capacity == "entry - 1" else capacity)
    assert not small.put(key(9), descriptor(9), tensors(9)) or small.flush(30)  # refused, whole or by header
    assert small.stats.num_puts == 0 and small.stats.num_evictions == 0
    assert sorted(p for p in (tmp_path / "entries").rglob("*.safetensors")) == before
    assert all(same(DiskTier(tmp_path, 1 << 30).get(key(i), descriptor(i)), i) for i in range(5))


def test_kvpool_run_refusing_a_too_small_disk_cache_gib_deletes_nothing(tmp_path) -> None:
    """`kvpool run --disk-cache DIR --disk-cache-gib 1e-9` deleted DIR's entries, then said
    the size holds no block (exit 2)."""
    tier = filled(tmp_path, 5)
    before = sorted(p for p in (tmp_path / "entries").rglob("*.safetensors"))
    argv = [sys.executable, "-m", "kvpool", "run", "--model", "tiny-dsv4", "--disk-cache", str(tmp_path)]
    proc = subprocess.run([*argv, "--disk-cache-gib", "1e-9"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "(--disk-cache-gib) holds no KV block" in proc.stderr, proc.stderr
    assert "evicted" not in proc.stderr
    assert sorted(p for p in (tmp_path / "entries").rglob("*.safetensors")) == before
    assert all(stored(tier, i).is_file() for i in range(5))


def test_quarantine_stays_within_a_32nd_of_the_limit(tmp_path) -> None:
    """Quarantined entries were never removed: a disk that keeps corrupting entries grew
    quarantine/ outside the byte limit until `kvpool cache clear --quarantine`. It keeps
    the newest now, within 1/32 of the limit (always the newest one)."""
    one = len(entry_format.encode(key(0), descriptor(0), tensors(0)))
    tier = DiskTier(tmp_path, 64 * one)  # quarantine: 2 entries' bytes
    for i in range(6):
        assert tier.put(key(i), descriptor(i), tensors(i))
    assert tier.flush(30)
    for i in range(6):
        flip_payload(stored(tier, i))
        assert tier.get(key(i), descriptor(i)) is None
    kept = sorted((tmp_path / "quarantine").iterdir())
    assert tier.stats.num_corrupt == 6 and 1 <= len(kept) <= 2
    assert sum(p.stat().st_size for p in kept) <= 2 * one + 64 and tier.report()["quarantine_trimmed"] == 6 - len(kept)
    assert any(p.name.startswith(key(5).hex()) for p in kept)  # the newest stays


def test_a_quarantine_trim_that_cannot_unlink_is_counted_as_a_trim_failure(tmp_path, monkeypatch) -> None:
    """Unlinks in quarantine/ refused (EACCES): each failed one was counted as trimmed, under
    io_errors["quarantine"] and its line ("moving a bad entry to quarantine/ failed"), and
    every old file was tried at each quarantine (review 7, /tmp/review_7/quar.py: 6 files,
    quarantine_trimmed 10, io_errors quarantine 10). Now only removals count, a failure is
    io_errors["trim"] with its own line, and a trim stops at its first failure."""
    one = len(entry_format.encode(key(0), descriptor(0), tensors(0)))
    lines: list[str] = []
    tier = DiskTier(tmp_path, 64 * one, log=lines.append)  # quarantine: 2 entries' bytes
    for i in range(6):
        assert tier.put(key(i), descriptor(i), tensors(i))
    assert tier.flush(30)
    unlink = Path.unlink

    def refused(self, *args, **kwargs):
        if self.parent.name == "quarantine":
            raise PermissionError(errno.EACCES, "Permission denied", str(self))
        return unlink(self, *args, **kwargs)

    monkeypatch.setattr(Path, "unlink", refused)
    for i in range(6):
        flip_payload(stored(tier, i))
        assert tier.get(key(i), descriptor(i)) is None
    report = tier.report()
    assert len(list((tmp_path / "quarantine").iterdir())) == 6 and tier.stats.num_corrupt == 6
    assert report["quarantine_trimmed"] == 0 and "quarantine" not in report["io_errors"]
    assert report["io_errors"]["trim"] == 4  # one try a quarantine past the bound (the 3rd to the 6th)
    assert len(lines) == 1 and "removing an old quarantined entry" in lines[0] and "EACCES" in lines[0], lines
    assert "the file stays in quarantine/" in lines[0] and "a miss" not in lines[0]
    monkeypatch.setattr(Path, "unlink", unlink)  # the disk lets go: the next quarantine trims them
    assert tier.put(key(6), descriptor(6), tensors(6)) and tier.flush(30)
    flip_payload(stored(tier, 6))
    assert tier.get(key(6), descriptor(6)) is None
    kept = list((tmp_path / "quarantine").iterdir())
    assert 1 <= len(kept) <= 2 and tier.report()["quarantine_trimmed"] == 7 - len(kept)
    tier.check_integrity()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        # each was dropped without a word; clear's removed every entry of a user who meant a look
        (["clear", "--json"], "--json is an option of ls / stats, not of clear"),
        (["clear", "--headers-only"], "--headers-only is an option of ls / stats, not of clear"),
        (["ls", "--quarantine"], "--quarantine is an option of clear, not of ls"),
        (["stats", "--quarantine"], "--quarantine is an option of clear, not of stats"),
    ],
)
def test_cache_refuses_another_actions_flag_and_changes_nothing(tmp_path, capsys, argv, message) -> None:
    from kvpool.cli.main import main

    tier = filled(tmp_path, 3)
    before = sorted(p.name for p in tmp_path.rglob("*"))
    assert main(["cache", argv[0], str(tmp_path), *argv[1:]]) == 2
    captured = capsys.readouterr()
    assert captured.err == f"kvpool cache: error: {message}; nothing was done\n" and captured.out == ""
    assert sorted(p.name for p in tmp_path.rglob("*")) == before
    assert all(stored(tier, i).exists() for i in range(3))


def test_a_quarantine_does_not_list_the_quarantine_directory(tmp_path, monkeypatch) -> None:
    """Each quarantine globbed, stat-ed and sorted the whole of quarantine/ under the tier's
    lock, on the engine's lookup path (review 7 #2: ~1,400 stats a corrupt entry at 1/32 of
    16 GiB). quarantine/ is listed once, at open; the trim reads the list this process keeps."""
    one = len(entry_format.encode(key(0), descriptor(0), tensors(0)))
    tier = DiskTier(tmp_path, 64 * one)  # quarantine: 2 entries' bytes
    for i in range(6):
        assert tier.put(key(i), descriptor(i), tensors(i))
    assert tier.flush(30)
    flip_payload(stored(tier, 0))
    assert tier.get(key(0), descriptor(0)) is None
    again = DiskTier(tmp_path, 64 * one)  # (its open lists the one quarantined file)
    listed: list[str] = []
    quarantine = (tmp_path / "quarantine").resolve()

    def recorded(real):
        def listing(self_or_path, *args, **kwargs):
            if Path(os.fsdecode(self_or_path)).resolve() == quarantine:
                listed.append(real.__name__)
            return real(self_or_path, *args, **kwargs)

        return listing

    for owner, name in ((Path, "glob"), (Path, "iterdir"), (os, "scandir"), (os, "listdir")):
        monkeypatch.setattr(owner, name, recorded(getattr(owner, name)))
    for i in range(1, 6):
        flip_payload(stored(again, i))
        assert again.get(key(i), descriptor(i)) is None
    monkeypatch.undo()
    assert listed == []
    kept = sorted(p.name for p in (tmp_path / "quarantine").iterdir())
    assert again.stats.num_corrupt == 5 and 1 <= len(kept) <= 2 and kept[-1].startswith(key(5).hex()), kept
    assert again.report()["quarantine_trimmed"] == 6 - len(kept)  # entry 0's file, known from the open, too
    again.check_integrity()


def test_files_another_process_removed_first_are_not_counted_as_this_ones(tmp_path) -> None:
    """An eviction or a quarantine trim that found its file already gone (another process
    evicted it, `kvpool cache clear --quarantine`) counted it as this process's eviction or
    trim (review 8 #7). The counters count what this process removed."""
    sizes = []
    for i in range(6):
        sizes.append(len(entry_format.encode(key(i), descriptor(i), tensors(i))))
    tier = DiskTier(tmp_path, sum(sizes[1:]))  # entries 0-4 fit; writing 5 evicts 0
    for i in range(5):
        assert tier.put(key(i), descriptor(i), tensors(i))
    assert tier.flush(30) and tier.stats.num_evictions == 0
    os.utime(stored(tier, 0), ns=(1, 10**9))  # (the least recently used, whatever the clock's tick)
    stored(tier, 0).unlink()  # another process evicts it
    assert tier.put(key(5), descriptor(5), tensors(5)) and tier.flush(30)
    assert not stored(tier, 0).exists() and all(stored(tier, i).is_file() for i in range(1, 6))
    assert tier.stats.num_evictions == 0 and tier.num_entries == 5
    assert tier.num_bytes == sum(stored(tier, i).stat().st_size for i in range(1, 6))
    tier.check_integrity()

    one = max(sizes)
    tier = DiskTier(tmp_path / "q", 64 * one)  # quarantine: 2 entries' bytes
    for i in range(6):
        assert tier.put(key(i), descriptor(i), tensors(i))
    assert tier.flush(30)
    for i in (0, 1):
        flip_payload(stored(tier, i))
        assert tier.get(key(i), descriptor(i)) is None
    assert len(list((tmp_path / "q" / "quarantine").iterdir())) == 2 and tier.num_quarantine_trimmed == 0
    for path in (tmp_path / "q" / "quarantine").iterdir():  # `kvpool cache clear --quarantine`
        path.unlink()
    for i in (2, 3, 4, 5):
        flip_payload(stored(tier, i))
        assert tier.get(key(i), descriptor(i)) is None
    kept = list((tmp_path / "q" / "quarantine").iterdir())
    assert 1 <= len(kept) <= 2 and tier.num_quarantine_trimmed == 4 - len(kept)  # of 2-5, not 0 and 1
    tier.check_integrity()


_SHARED_OPS = st.lists(
    st.tuples(st.sampled_from(["put", "put", "rm", "touch", "lookup", "get", "reopen"]), st.integers(0, 7)),
    min_size=1,
    max_size=25,
)


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=_SHARED_OPS, room=st.integers(1, 5))
@example(ops=[("put", 0), ("put", 1), ("rm", 0), ("put", 2)], room=2)  # the victim already gone
@example(ops=[("put", i) for i in range(8)] + [("reopen", 0), ("touch", 1), ("put", 0), ("get", 1)], room=8)
def test_the_index_under_evictions_and_another_process_stays_exact(tmp_path_factory, ops, room) -> None:
    """The lifecycle of a tier whose directory another process also removes from and reads
    (its files' LRU times): after every operation the index checks out, a get returns exactly
    the entries whose files are there (a lookup hits them all), the bytes stay within the limit once the tier has
    written, and `num_evictions` counts exactly the files the tier's own operations removed
    (review 8 #3 moved the unlinks out of the lock; #7: one another process removed is not
    this one's)."""
    root = tmp_path_factory.mktemp("shared")
    one = max(len(entry_format.encode(key(i), descriptor(i), tensors(i, 16))) for i in range(8))
    tier = DiskTier(root, room * one, fsync=False)
    evicted = 0  # by the tier's own operations, model side

    def on_disk() -> set[int]:
        return {i for i in range(8) if stored(tier, i).is_file()}

    for op, i in ops:
        before = on_disk()
        if op == "put":
            assert tier.put(key(i), descriptor(i), tensors(i, 16)) and tier.flush(30)
            assert i in on_disk()
        elif op == "rm":  # another process evicts it
            stored(tier, i).unlink(missing_ok=True)
            before = on_disk()
        elif op == "touch" and i in before:  # another process reads it: its most recent
            os.utime(stored(tier, i), ns=(time.time_ns(), time.time_ns()))
        elif op == "lookup":  # (an indexed entry another process removed is still a hit: the get misses)
            assert tier.lookup(key(i), descriptor(i)) or i not in before
        elif op == "get":
            got = tier.get(key(i), descriptor(i))
            assert (got is not None and all(torch.equal(got[n], tensors(i, 16)[n]) for n in got)) == (i in before)
        elif op == "reopen":
            evicted -= tier.stats.num_evictions  # (a new process's counters start at 0)
            tier = DiskTier(root, room * one, fsync=False)
        evicted += len(before - on_disk())
        tier.check_integrity()
        assert tier.stats.num_evictions == evicted, (op, i, tier.stats.num_evictions, evicted)
        assert tier.stats.num_corrupt == 0 and not tier._removing


def test_cache_ls_and_stats_escape_what_others_wrote_into_the_directory(tmp_path, capsys) -> None:
    """audit5 #3: an entry's model id and weights version (any JSON string) and a file's name
    (any bytes) were printed raw by `kvpool cache ls / stats`: an escape sequence (clear the
    screen, set the terminal's title) reached the terminal and a newline forged a line of the
    listing. Now escaped as Python writes them; --json (escaped by json) is unchanged."""
    from kvpool.cli.main import main

    evil = "evil\x1b[2J\x1b]0;title\x07\nforged 16 m\u202e"
    tier = DiskTier(tmp_path, 1 << 30)
    assert tier.put(key(0), descriptor(0, model_id=evil, weights_version="w\r\x1b[31m"), tensors(0, 8))
    assert tier.put(key(1), descriptor(1), tensors(1, 8)) and tier.flush(30)
    odd = stored(tier, 1).parent / "x\x1b[2Jy\n.safetensors"
    odd.write_bytes(b"junk")
    tier.close()
    for action in ("ls", "stats"):
        assert main(["cache", action, str(tmp_path)]) == 0
        out = capsys.readouterr().out
        assert all(c.isprintable() for c in out.replace("\n", "")), out  # no control character but the line ends
        assert "evil\\x1b[2J\\x1b]0;title\\x07\\nforged 16 m\\u202e" in out
        lines = out.splitlines()
        if action == "ls":  # the header and one line per entry: nothing forged
            assert len(lines) == 4 and sum("x\\x1b[2Jy\\n" in line for line in lines) == 1
        else:
            assert "w\\r\\x1b[31m" in out and not any(line.startswith("forged") for line in lines)
    assert main(["cache", "ls", "--json", str(tmp_path)]) == 0
    rows = json.loads(capsys.readouterr().out)["entries"]
    assert {r["model"] for r in rows} == {evil, "m", None}  # (the JSON carries the strings exact)


def test_cache_clear_goes_on_past_a_file_it_cannot_remove(tmp_path, monkeypatch, capsys) -> None:
    """audit5 #4: clear removed a namespace with a walk that stopped at its first failed
    removal (another user's entry in a shared directory, a read-only filesystem), leaving the
    entries not yet walked in place, and counted the namespace as one failure. Now every
    other entry goes, and the line counts the files that stay."""
    from kvpool.cli.main import main

    tier = filled(tmp_path, 6)
    tier.close()
    prefix = stored(tier, 0).parent
    refused = prefix / os.listdir(prefix)[0]  # the walk's first: the old walk stopped there
    real_unlink = os.unlink

    def unlink(path, *args, **kwargs):
        if os.fspath(path) == str(refused):
            raise PermissionError(13, "Permission denied", os.fspath(path))
        return real_unlink(path, *args, **kwargs)

    monkeypatch.setattr(os, "unlink", unlink)
    assert main(["cache", "clear", str(tmp_path)]) == 1
    captured = capsys.readouterr()
    assert captured.out == f"kvpool cache: removed 5 files from {tmp_path}\n"
    assert captured.err == (
        f"kvpool cache: 1 could not be removed, the first: [Errno 13] Permission denied: '{refused}'\n"
    )
    left = [p for p in (tmp_path / "entries").rglob("*") if p.is_file()]
    assert left == [refused]
    monkeypatch.setattr(os, "unlink", real_unlink)
    assert main(["cache", "clear", str(tmp_path)]) == 0 and not list((tmp_path / "entries").iterdir())


def test_cache_ls_and_stats_count_only_what_the_tier_reads_as_an_entry(tmp_path, capsys) -> None:
    """audit5 #6: `kvpool cache ls / stats` parsed a file's name with bytes.fromhex, which
    takes upper case and spaces: an upper-case copy of an entry was listed and counted as a
    second good entry, though the tier never indexes or reads it (the test above), and a name
    that is no hex showed Python's fromhex error. Now both are unreadable, saying why."""
    from kvpool.cli.main import main

    tier, path = _entry_with_foreign_copies(tmp_path)
    (path.parent / "zz.safetensors").write_bytes(b"x")
    tier.close()
    assert DiskTier(tmp_path, 1 << 30).num_entries == 1  # (the tier's count, the reference)
    assert main(["cache", "stats", "--json", str(tmp_path)]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert stats["entries"] == 4 and stats["unreadable"] == 3
    assert stats["models"]["m (w1, L2:bs16:fp32)"] == {"entries": 1, "bytes": path.stat().st_size}
    assert main(["cache", "ls", "--json", str(tmp_path)]) == 0
    rows = json.loads(capsys.readouterr().out)["entries"]
    assert sorted(r["key"] for r in rows if r["model"] == "m") == [path.name.removesuffix(".safetensors")]
    odd = [r["problem"] for r in rows if r["model"] is None]
    assert len(odd) == 3 and all(p.startswith("not an entry's name (a key in lower-case hex") for p in odd)
