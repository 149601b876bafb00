"""The disk tier on a mount that stops answering (an NFS hard mount whose server is gone, a
FUSE file system that hangs): every read and write has a deadline, as the Redis tier's
calls do. A read past it is a miss (the engine computes those tokens), a write past it is
dropped and counted, what either returns late is never installed, and after
`breaker_failures` operations in a row past the deadline a breaker opens: misses and dropped
writes at no cost, until a probe of the disk answers within the deadline after a cool-down.

The hang is `os.open` blocking on an Event for paths under the cache directory (what a
hung mount does to an open), armed and released by the test."""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from kvpool.tiers import DiskTier
from kvpool.tiers import disk as disk_module
from test_disk_tier import descriptor, key, stored, tensors
from test_robust_disk import engine_run, filled, same  # noqa: F401 - engine_run: a fixture

MARGIN_S = 1.0  # a loaded 2-core machine's scheduling, on top of a deadline


class Hang:
    """A call on a path under `root` blocks, while armed, for the kinds in `ops` ("read":
    os.open to read; "write": os.open to write; "meta": os.stat, os.unlink, os.replace,
    os.utime), until `release` (a mount that stops answering, then comes back). `entered`
    lists the paths that blocked, `entered_at` when (time.perf_counter)."""

    def __init__(self, monkeypatch, root: Path, ops: set[str]) -> None:
        self.root, self.ops = str(root.resolve()) + os.sep, ops
        self.armed, self.released = threading.Event(), threading.Event()
        self.entered: list[Path] = []
        self.entered_at: list[float] = []

        def block(kind: str, path) -> None:
            if self.armed.is_set() and kind in self.ops and not isinstance(path, int):
                where = os.path.realpath(os.fsdecode(path))
                if where.startswith(self.root):
                    self.entered.append(Path(where))
                    self.entered_at.append(time.perf_counter())
                    assert self.released.wait(60), "a hung call was never released"

        real_open = os.open

        def fake_open(path, flags, *args, **kwargs):
            block("write" if flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT) else "read", path)
            return real_open(path, flags, *args, **kwargs)

        def meta(real):
            def fake(path, *args, **kwargs):
                block("meta", path)
                return real(path, *args, **kwargs)

            return fake

        monkeypatch.setattr(os, "open", fake_open)
        if "meta" in ops:
            for name in ("stat", "unlink", "replace", "utime"):
                monkeypatch.setattr(os, name, meta(getattr(os, name)))

    def arm(self) -> None:
        self.released.clear()
        self.armed.set()

    def release(self) -> None:
        self.armed.clear()
        self.released.set()


@pytest.fixture
def hang_factory(monkeypatch):
    made: list[Hang] = []

    def make(root: Path, ops: set[str]) -> Hang:
        made.append(Hang(monkeypatch, root, ops))
        return made[-1]

    yield make
    for hang in made:  # (the stuck workers return, whatever the test did)
        hang.release()


def settled(tier: DiskTier) -> None:
    """Wait until every operation past its deadline, and the probe, has returned."""
    end = time.monotonic() + 30
    while tier.report()["stuck_io"] or (tier._probe is not None and not tier._probe.done.is_set()):
        assert time.monotonic() < end, "a released operation did not return"
        time.sleep(0.01)


def wait_for(condition) -> None:
    end = time.monotonic() + 30
    while not condition():
        assert time.monotonic() < end, "waited 30 s"
        time.sleep(0.01)


def timed(call):
    start = time.perf_counter()
    result = call()
    return result, time.perf_counter() - start


def test_hung_reads_are_misses_within_the_deadline_and_the_breaker_opens_and_closes(
    tmp_path, monkeypatch, hang_factory
) -> None:
    filled(tmp_path, 5)
    clock = [1000.0]
    monkeypatch.setattr(disk_module, "_now", lambda: clock[0])
    lines: list[str] = []
    tier = DiskTier(tmp_path, 1 << 30, timeout_s=0.2, retry_s=4.0, breaker_failures=3, log=lines.append)
    hang = hang_factory(tmp_path, {"read"})
    hang.arm()
    # two lookups past the deadline, then the disk answers once (another key: absent)
    for i in (0, 1):
        found, took = timed(lambda i=i: tier.lookup(key(i), descriptor(i)))
        assert not found and took < 0.2 + MARGIN_S
        tier.check_integrity()
    hang.armed.clear()  # (the mount answers one call: an absent key's open, FileNotFoundError)
    assert not tier.lookup(key(9), descriptor(9))
    hang.armed.set()
    assert tier.available and tier.timeouts == {"read": 2} and lines == []  # not in a row: no breaker
    # three in a row: the breaker opens, said once
    for i in (2, 3, 4):
        found, took = timed(lambda i=i: tier.lookup(key(i), descriptor(i)))
        assert not found and took < 0.2 + MARGIN_S
        tier.check_integrity()
    report = tier.report()
    assert report["available"] is False and report["outages"] == 1 and report["timeouts"] == {"read": 5}
    assert report["misses"] == {"timeout": 5, "absent": 1} and report["stuck_io"] == 5
    assert len(lines) == 1 and "3 operations in a row got no answer" in lines[0] and "0.2 s" in lines[0]
    # open: lookups, gets and puts at no cost, nothing started on the disk
    for i in range(5):
        found, took = timed(lambda i=i: tier.lookup(key(i), descriptor(i)))
        assert not found and took < 0.1
        got, took = timed(lambda i=i: tier.get(key(i), descriptor(i)))
        assert got is None and took < 0.1
    assert not tier.put(key(7), descriptor(7), tensors(7)) and tier.flush(30)
    report = tier.report()
    assert report["misses"]["unavailable"] == 10 and report["num_get_misses"] == 5
    assert report["unavailable_puts"] == 1 and report["num_dropped_puts"] == 1 and report["num_puts"] == 0
    assert len(hang.entered) == 5  # the five timed-out reads: nothing asked since
    tier.check_integrity()
    # the cool-down ends with the disk still hung: one probe (the marker's read), stuck; it
    # holds every later probe back, however many cool-downs pass
    clock[0] += 4
    assert not tier.lookup(key(0), descriptor(0))
    wait_for(lambda: len(hang.entered) == 6)
    clock[0] += 50
    assert not tier.lookup(key(0), descriptor(0)) and not tier.lookup(key(1), descriptor(1))
    assert [p.name for p in hang.entered[5:]] == ["kvpool-disk-cache"] and not tier.available
    tier.check_integrity()
    # the mount comes back: the late reads' answers are dropped (nothing installed: the
    # entries' headers unread, no hit counted), and the probe's came late: another cool-down
    time.sleep(0.3)  # (the probe hung past its deadline)
    hang.release()
    settled(tier)
    assert all(found.descriptor is None for found in tier._entries.values())
    assert tier.stats.num_lookup_hits == 0 and not any(tier.holds(key(i), descriptor(i)) for i in range(5))
    assert not tier.lookup(key(0), descriptor(0)) and not tier.available and len(lines) == 1
    clock[0] += 3.5
    assert not tier.lookup(key(0), descriptor(0))  # (still cooling down: no probe)
    assert tier._probe is None
    clock[0] += 0.5
    assert not tier.lookup(key(0), descriptor(0))  # (a probe started; it answers at once)
    settled(tier)
    assert tier.lookup(key(0), descriptor(0)) and tier.available  # closed, said
    assert lines[1] == f"kvpool: disk cache {tier.root} answers again (its marker read within 0.2 s): serving from it"
    assert all(same(tier.get(key(i), descriptor(i)), i) for i in range(5))
    assert tier.report()["outages"] == 1 and tier.report()["stuck_io"] == 0
    tier.check_integrity()


def test_a_get_that_hangs_is_a_miss_and_its_late_payload_is_never_handed_out(tmp_path, hang_factory) -> None:
    filled(tmp_path, 2)
    tier = DiskTier(tmp_path, 1 << 30, timeout_s=0.2)
    assert tier.lookup(key(1), descriptor(1))  # (its header read: a hit)
    hang = hang_factory(tmp_path, {"read"})
    hang.arm()
    got, took = timed(lambda: tier.get(key(1), descriptor(1)))
    assert got is None and took < 0.2 + MARGIN_S
    assert tier.stats.num_get_misses == 1 and tier.stats.misses == {"timeout": 1} and tier.timeouts == {"read": 1}
    tier.check_integrity()
    hang.release()
    settled(tier)  # the payload read returned, late: dropped
    assert tier.stats.num_gets == 0 and tier.stats.num_get_bytes == 0 and not tier.holds(key(1), descriptor(1))
    assert tier.available and stored(tier, 1).exists() and tier.num_entries == 2  # kept: the entry is fine
    assert same(tier.get(key(1), descriptor(1)), 1) and tier.holds(key(1), descriptor(1))
    tier.check_integrity()


def test_a_write_that_hangs_is_dropped_counted_and_never_installed(tmp_path, hang_factory) -> None:
    tier = DiskTier(tmp_path, 1 << 30, timeout_s=0.2, write_timeout_s=0.3)
    hang = hang_factory(tmp_path, {"write"})
    hang.arm()
    assert tier.put(key(1), descriptor(1), tensors(1))  # (queued: put never waits)
    done, took = timed(lambda: tier.flush(30))
    assert done and took < 0.3 + MARGIN_S  # the writer gave up on it: a flush (an exit) is not held
    report = tier.report()
    assert report["num_write_errors"] == 1 and report["timeouts"] == {"write": 1} and report["num_puts"] == 0
    assert tier.num_entries == 0 and not tier.holds(key(1), descriptor(1))
    tier.check_integrity()
    hang.release()
    settled(tier)  # the write went on to its rename, found its writer gone: its temp file removed
    assert not stored(tier, 1).exists() and not list((tmp_path / "tmp").iterdir())
    assert tier.num_entries == 0 and not tier.lookup(key(1), descriptor(1))
    assert tier.put(key(1), descriptor(1), tensors(1)) and tier.flush(30)  # the disk answers: stored
    assert same(DiskTier(tmp_path, 1 << 30).get(key(1), descriptor(1)), 1)
    tier.check_integrity()


@pytest.mark.parametrize("name", ["timeout_s", "write_timeout_s", "retry_s", "open_timeout_s"])
def test_a_deadline_past_what_python_can_wait_is_refused_in_one_line(tmp_path, name) -> None:
    """audit5 #1: 1e10 s passed the finite check, then the first lookup (timeout_s) or the
    open itself (open_timeout_s) raised OverflowError from the wait: threading's waits
    overflow past threading.TIMEOUT_MAX (about 9.2e9 s). Refused as ValueError; 1e9 works."""
    with pytest.raises(ValueError, match=f"disk tier {name} must be a finite positive number of seconds up to 1e"):
        DiskTier(tmp_path / "a", 1 << 30, **{name: 1e10})
    tier = DiskTier(tmp_path / "b", 1 << 30, **{name: 1e9})
    assert tier.put(key(1), descriptor(1), tensors(1)) and tier.flush(30)
    assert tier.lookup(key(1), descriptor(1)) and same(tier.get(key(1), descriptor(1)), 1)
    tier.check_integrity()
    with pytest.raises(ValueError, match="the disk cache's deadline must be a finite positive number of seconds"):
        disk_module.open_directory(tmp_path / "c", timeout_s=1e10)


@pytest.mark.parametrize(
    "argv",
    [
        ["cache", "ls", "--timeout", "1e10", "DIR"],
        ["cache", "stats", "--timeout", "1e300", "DIR"],
        ["run", "--model", "tiny-dsv4", "--disk-cache", "DIR", "--disk-open-timeout", "1e10"],
        ["run", "--model", "tiny-dsv4", "--disk-cache", "DIR", "--disk-timeout", "1e10"],
        ["run", "--model", "tiny-dsv4", "--redis", "redis://127.0.0.1:1", "--redis-timeout", "1e10"],
    ],
)
def test_a_deadline_flag_past_what_python_can_wait_is_one_line(tmp_path, capsys, argv) -> None:
    """audit5 #1: `kvpool cache ls --timeout 1e10` and `kvpool run --disk-open-timeout 1e10`
    ended in an OverflowError traceback; now argparse's one line, nothing stored touched."""
    from kvpool.cli.main import main

    tier = filled(tmp_path, 2)
    before = sorted((p.name, p.stat().st_mtime_ns) for p in tmp_path.rglob("*"))
    argv = [str(tmp_path) if a == "DIR" else a for a in argv]
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    flag, value = argv[-2:] if argv[0] == "run" else argv[2:4]
    assert err.endswith(f"error: argument {flag}: expected a positive number up to 1e+09, got {value!r}\n")
    assert len(err.splitlines()) == 1
    assert sorted((p.name, p.stat().st_mtime_ns) for p in tmp_path.rglob("*")) == before
    assert all(stored(tier, i).exists() for i in range(2))


@pytest.mark.parametrize(
    "options",
    [{"timeout_s": 0}, {"timeout_s": float("inf")}, {"write_timeout_s": -1.0}, {"retry_s": "1"}, {"timeout_s": True}],
)
def test_a_deadline_that_is_not_a_finite_positive_number_is_refused(tmp_path, options) -> None:
    name = next(iter(options))
    with pytest.raises(ValueError, match=f"disk tier {name} must be a finite positive number of seconds"):
        DiskTier(tmp_path, 1 << 30, **options)
    with pytest.raises(ValueError, match="breaker_failures must be a positive integer, got 0"):
        DiskTier(tmp_path, 1 << 30, breaker_failures=0)


def test_the_engine_over_a_hung_mount_recomputes_within_the_deadline(
    engine_run,  # noqa: F811 - the fixture imported above
    fp64_model,
    tmp_path,
    hang_factory,
) -> None:
    """A prefix on a disk that stops answering (every open under it hangs): the admission's
    lookup gives up at the deadline and the engine computes the prompt; its tokens are a run
    without tiers' (the reference), each tier call returns within the deadline, and the
    runner checks out after each step. The blocks it writes through time out too: three
    failures in a row (the lookup's read, then, after the first write's scan answered, two
    writes... the third) open the breaker, and the rest are dropped at no cost."""
    from kvpool.engine.build import build_engine
    from kvpool.engine.sampling import SamplingParams

    source, follow, expected = engine_run
    directory = tmp_path / "c"
    shutil.copytree(source, directory)
    engine = build_engine(fp64_model, num_blocks=16, disk_cache=directory)
    (tier,) = engine.runner.persistent_tiers
    tier.timeout_s, tier.write_timeout_s = 0.3, 0.3
    calls: list[float] = []
    for name in ("lookup", "get"):
        real = getattr(tier, name)

        def timed_call(*args, real=real):
            result, took = timed(lambda: real(*args))
            calls.append(took)
            return result

        setattr(tier, name, timed_call)
    hang = hang_factory(directory, {"read", "write"})
    hang.arm()
    engine.add_request(follow, SamplingParams(max_tokens=4, ignore_eos=True), "b")
    while engine.has_unfinished():
        engine.step()
        engine.runner.check_integrity()
    assert list(engine.output("b").completions[0].token_ids) == expected
    assert calls and max(calls) < 0.3 + MARGIN_S
    assert tier.flush(30)
    disk = engine.runner.tier_reports()["disk_tier"]
    assert engine.output("b").num_cached_tokens == 0 and disk["num_gets"] == 0
    assert disk["num_lookups"] == 1 and disk["misses"] == {"timeout": 1}
    # the six blocks written through: three past the deadline (the breaker opens), three dropped
    assert disk["timeouts"] == {"read": 1, "write": 3} and disk["num_write_errors"] == 3
    assert disk["unavailable_puts"] == 3 and disk["num_puts"] == 0 and disk["outages"] == 1
    assert disk["available"] is False
    hang.release()
    settled(tier)
    assert not list((directory / "tmp").iterdir())  # the late writes' temp files removed, none renamed in
    engine.runner.check_integrity()
    engine.runner.close()


_CALLS = st.tuples(st.sampled_from(["lookup", "get", "put", "evict"]), st.integers(0, 3))
_ACTIONS = st.lists(  # (three calls to one change of the mount or the clock, on average)
    st.one_of(_CALLS, _CALLS, _CALLS, st.sampled_from(["hang", "answer", "cool-down"]).map(lambda a: (a, 0))),
    min_size=3,
    max_size=20,
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(hung=st.booleans(), actions=_ACTIONS)
@example(  # the breaker's round: opened by three calls, a probe stuck, the mount back, closed
    hung=True,
    actions=[("lookup", 0), ("get", 1), ("put", 2), ("cool-down", 0), ("lookup", 0), ("answer", 0), ("get", 0)],
)
def test_a_mount_that_hangs_and_answers_at_random_never_serves_a_wrong_block(
    tmp_path, monkeypatch, hung, actions
) -> None:
    """Lookups, gets, puts and evictions while the mount hangs and answers again at random,
    and the breaker's cool-downs pass: every call returns within its deadline, a get hands
    back its block or nothing, the index checks out after each call; once the mount answers
    for good, the breaker closes, nothing stays stuck, and every entry on disk is whole."""
    root = Path(tempfile.mkdtemp(dir=tmp_path))
    filled(root, 2)  # (by another tier: this one reads their headers)
    clock = [0.0]
    monkeypatch.setattr(disk_module, "_now", lambda: clock[0])
    hang = Hang(monkeypatch, root, {"read", "write", "meta"})
    tier = DiskTier(root, 1 << 30, timeout_s=0.05, write_timeout_s=0.05, retry_s=1.0, log=lambda line: None)
    if hung:
        hang.arm()
    try:
        for action, i in actions:
            if action == "hang":
                hang.arm()
            elif action == "answer":
                hang.release()
            elif action == "cool-down":
                clock[0] += 1.0
            else:
                result, took = timed(lambda a=action, i=i: getattr(tier, a)(key(i), *_args(a, i)))
                assert took < 0.05 + MARGIN_S, f"{action} took {took:.2f} s"
                if action == "get":
                    assert result is None or same(result, i)
                if action == "put":
                    assert tier.flush(30)  # (the writer gives up within its deadline)
            tier.check_integrity()
        hang.release()
        settled(tier)
        end = time.monotonic() + 30
        while not tier.available:  # cool-downs pass, a probe answers (in time, on a loaded machine)
            assert time.monotonic() < end, "the breaker never closed"
            clock[0] += 1.0
            tier.lookup(key(0), descriptor(0))
            settled(tier)
            tier.lookup(key(0), descriptor(0))
        assert tier.report()["stuck_io"] == 0 and not list((root / "tmp").iterdir())
        for path in (root / "entries").rglob("*.safetensors"):  # whole entries only, each its key's block
            i = next(i for i in range(4) if path.name == f"{key(i).hex()}.safetensors")
            assert same(DiskTier(root, 1 << 30).get(key(i), descriptor(i)), i)
        tier.check_integrity()
    finally:
        hang.release()
        tier.close()


def _args(action: str, i: int) -> tuple:
    return {"lookup": (descriptor(i),), "get": (descriptor(i),), "put": (descriptor(i), tensors(i)), "evict": ()}[
        action
    ]


def test_the_cut_to_the_limit_waits_for_a_scan_that_answers(tmp_path, hang_factory) -> None:
    """A tier opened over its limit cuts the directory at its first write, after scanning
    it again: when that scan gets no answer, the cut waits for the next write (it was
    marked done, the index stayed over the limit, and check_integrity failed)."""
    filled(tmp_path, 5)
    one = stored(DiskTier(tmp_path, 1 << 30), 0).stat().st_size
    small = DiskTier(tmp_path, 2 * one + 100, write_timeout_s=0.2, log=lambda line: None)  # (sizes differ a little)
    hang = hang_factory(tmp_path, {"meta", "write"})  # (a scan stats every entry)
    hang.arm()
    assert small.put(key(5), descriptor(5), tensors(5)) and small.flush(30)
    assert small.timeouts == {"scan": 1, "write": 1} and small.available
    assert small.num_entries == 5 and small.stats.num_evictions == 0
    small.check_integrity()  # (over the limit: the cut still to come)
    hang.release()
    settled(small)
    assert small.put(key(6), descriptor(6), tensors(6)) and small.flush(30)
    assert small.num_entries == 2 and small.num_bytes <= 2 * one + 100 and small.stats.num_evictions == 4
    assert same(small.get(key(6), descriptor(6)), 6)
    small.check_integrity()


def test_idle_workers_exit(tmp_path, monkeypatch) -> None:
    """A tier no longer used holds no thread (the engine opens one per run; tests, hundreds)."""
    from kvpool.tiers import deadline

    monkeypatch.setattr(deadline, "_IDLE_S", 0.05)
    filled(tmp_path, 2)
    tier = DiskTier(tmp_path, 1 << 30)
    assert same(tier.get(key(0), descriptor(0)), 0) and same(tier.get(key(1), descriptor(1)), 1)
    wait_for(lambda: not [t for t in threading.enumerate() if t.name == "kvpool-disk-io"])
    assert same(tier.get(key(1), descriptor(1)), 1)  # (a new worker for the next call)
    tier.check_integrity()


def test_the_runner_hands_each_caller_its_own_answer_under_concurrent_calls(monkeypatch) -> None:
    """Four threads calling at once, some operations past their deadline, workers coming and
    going (a 10 ms idle exit): each call gets its own operation's result or NoAnswer, never
    another's, and every late one returns."""
    import random

    from kvpool.tiers import deadline

    monkeypatch.setattr(deadline, "_IDLE_S", 0.01)
    runner = deadline.DeadlineRunner("test")
    wrong: list[tuple[int, object]] = []
    answered: list[int] = []
    late: list[int] = []

    def op(value: int, sleep_s: float) -> int:
        time.sleep(sleep_s)
        return value

    def caller(seed: int) -> None:
        rng = random.Random(seed)
        for n in range(150):
            value, slow = seed * 1000 + n, rng.random() < 0.1
            try:
                got = runner.call("op", 0.02, op, value, 0.05 if slow else 0.0)
            except deadline.NoAnswer:
                late.append(value)
                continue
            answered.append(value)
            if got != value:
                wrong.append((value, got))

    threads = [threading.Thread(target=caller, args=(seed,)) for seed in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not wrong and len(answered) + len(late) == 600 and late
    wait_for(lambda: runner.num_stuck == 0)


def test_a_directory_that_scans_slower_than_the_deadline_is_indexed_and_kept_within_its_limit(
    tmp_path, monkeypatch
) -> None:
    """A healthy but slow directory (a large shared cache on NFS, a loaded disk) whose scans
    all answer, each after longer than write_timeout_s (review 12): the open indexes it whole
    (its scan has no deadline), the byte limit holds from the first write, and a rescan past
    its deadline is waited for again by the next one, never started twice at once. Before, the
    tier opened with nothing indexed, the directory grew past the limit, and every write started
    one or two more scans."""
    filled(tmp_path, 12)
    on_disk = lambda: sum(p.stat().st_size for p in (tmp_path / "entries").glob("*/*/*.safetensors"))  # noqa: E731
    total = on_disk()
    real_scan = disk_module.scan_entries
    running, started, most = [0], [0], [0]

    def slow_scan(root, *args):
        started[0] += 1
        running[0] += 1
        most[0] = max(most[0], running[0])
        time.sleep(0.3)
        try:
            return real_scan(root)
        finally:
            running[0] -= 1

    monkeypatch.setattr(disk_module, "scan_entries", slow_scan)
    limit = total // 4
    tier = DiskTier(tmp_path, limit, write_timeout_s=0.1, log=lambda line: None)
    assert tier.num_entries == 12 and tier.num_bytes == total and started == [1]
    for i in range(100, 106):
        assert tier.put(key(i), descriptor(i), tensors(i)) and tier.flush(30)
        assert on_disk() <= limit and tier.num_bytes <= limit
        tier.check_integrity()
    assert most == [1] and started[0] <= 1 + 6  # (one scan at a time: at most one started a write)
    assert tier.stats.num_puts == 6 and tier.available and not tier.stats.num_write_errors
    wait_for(lambda: not tier.report()["stuck_io"])
    assert same(tier.get(key(105), descriptor(105)), 105)
    tier.check_integrity()


def test_a_lookup_and_a_get_are_one_worker_job_each(tmp_path, monkeypatch) -> None:
    """Each hand-off to a deadline worker costs tens of microseconds (52-68 us, review 12):
    a lookup of an entry not yet read here (its open, fstat and header) and a get (its read,
    checks and LRU refresh) take one job each, not one per file operation (a get took 2-3)."""
    filled(tmp_path, 3)
    tier = DiskTier(tmp_path, 1 << 30, log=lambda line: None)
    jobs: list[str] = []
    real_start = tier._runner.start

    def start(fn, *args):
        jobs.append(fn.__name__)
        return real_start(fn, *args)

    monkeypatch.setattr(tier._runner, "start", start)
    tier.evict(key(2))  # (known, then gone: its unlink is one job)
    jobs.clear()
    assert tier.lookup(key(0), descriptor(0)) and len(jobs) == 1  # the header, read
    assert tier.lookup(key(0), descriptor(0)) and len(jobs) == 1  # known: no I/O
    assert same(tier.get(key(0), descriptor(0)), 0) and len(jobs) == 2  # read, checked, refreshed
    assert same(tier.get(key(1), descriptor(1)), 1) and len(jobs) == 3  # never looked up: the same one job
    assert not tier.lookup(key(2), descriptor(2)) and len(jobs) == 4  # absent: one open
    assert not tier.lookup(key(7), descriptor(7)) and len(jobs) == 5
    tier.check_integrity()


def test_a_write_whose_rename_hung_and_then_landed_is_indexed(tmp_path, hang_factory) -> None:
    """The rename is the call that hangs (a hung mount's metadata): the writer gives up after
    write_timeout_s and counts a write error; once the mount answers, the rename lands. The
    entry is on disk and a lookup hits it, so it is indexed as it lands, within the byte limit
    and counted as a put, its write error taken back (review 12: counted as failed, its bytes
    outside the limit until the next rescan, and the docs said it was never installed)."""
    tier = DiskTier(tmp_path, 1 << 30, timeout_s=0.2, write_timeout_s=0.3, log=lambda line: None)
    hang = hang_factory(tmp_path, {"meta"})  # (the temp file is written and fsynced; the rename hangs)
    hang.arm()
    assert tier.put(key(1), descriptor(1), tensors(1)) and tier.flush(30)
    assert tier.stats.num_write_errors == 1 and tier.timeouts["write"] == 1
    assert tier.stats.num_puts == 0 and tier.num_entries == 0
    hang.release()
    settled(tier)
    assert stored(tier, 1).exists() and tier.num_entries == 1
    assert tier.num_bytes == stored(tier, 1).stat().st_size
    assert tier.stats.num_puts == 1 and tier.stats.num_write_errors == 0 and tier.timeouts["write"] == 1
    assert tier.holds(key(1), descriptor(1)) and same(tier.get(key(1), descriptor(1)), 1)
    tier.check_integrity()


@pytest.mark.parametrize("where", ["marker", "tmp", "quarantine", "entries"])
def test_a_mount_hung_as_the_tier_opens_is_an_error_naming_it_within_the_open_deadline(
    tmp_path, hang_factory, where
) -> None:
    """A mount already hung when the tier opens, at each step of the open: its checks of the
    directory (the marker's stat), the removal of a dead writer's temp file, quarantine/'s
    listing, the scan of the entries. The open hung for ever (diskdl "Left"); now, one open
    deadline after the directory's last answer, it is a ValueError naming the directory, what
    it waited on and the deadline, and no tier is made. The mount back, the tier opens whole."""
    filled(tmp_path, 3)
    stale = tmp_path / "tmp" / f"{key(9).hex()}.999999999.0.tmp"  # (no such pid: a dead writer's)
    stale.write_bytes(b"x")
    quarantined = tmp_path / "quarantine" / f"{key(8).hex()}.123{disk_module.SUFFIX}"
    quarantined.write_bytes(b"x")
    waited = {
        "marker": str(tmp_path / disk_module.MARKER),
        "tmp": str(stale),
        "quarantine": str(quarantined),
        "entries": str(tmp_path / "entries"),  # (an entry's file in it: whichever is stat'd first)
    }[where]
    hang = hang_factory(tmp_path if where == "marker" else tmp_path / where, {"meta"})
    hang.arm()
    start = time.perf_counter()
    with pytest.raises(ValueError) as raised:
        DiskTier(tmp_path, 1 << 30, open_timeout_s=0.3)
    assert time.perf_counter() - start < 0.3 + MARGIN_S
    message = str(raised.value)
    assert message.startswith(f"disk cache {str(tmp_path)!r} did not answer within 0.3 s as the disk tier opened")
    assert f"(waiting on {waited}" in message and "a hung mount?" in message, message
    assert len(hang.entered) == 1 and hang.entered[0].name in message
    if where == "marker":  # (the CLI's check of --disk-cache, before the model loads)
        with pytest.raises(
            ValueError, match=r"did not answer within 0\.2 s as it was opened \(waiting on .*kvpool-disk-cache\)"
        ):
            disk_module.open_directory(tmp_path, timeout_s=0.2)
    hang.release()
    tier = DiskTier(tmp_path, 1 << 30)
    # (the temp file removed by this open, or by the one given up on, which went on once released)
    assert tier.num_entries == 3 and not stale.exists() and len(tier._quarantined) == 1
    assert same(tier.get(key(2), descriptor(2)), 2)
    tier.check_integrity()


def test_an_open_that_answers_slowly_but_steadily_is_waited_for_whole(tmp_path, monkeypatch) -> None:
    """The open's deadline is on each answer, not on the whole open: a large directory on a
    slow disk (each entry's stat 0.1 s here, 1.2 s for the scan, four open deadlines) is
    indexed whole (review 12: a directory that lists slowly must not open with nothing
    indexed), and the open's steps were each within the deadline."""
    filled(tmp_path, 12)
    real_stat = os.stat
    entries = str((tmp_path / "entries").resolve()) + os.sep

    def slow_stat(path, *args, **kwargs):
        if os.path.realpath(os.fsdecode(path)).startswith(entries):
            time.sleep(0.1)
        return real_stat(path, *args, **kwargs)

    monkeypatch.setattr(os, "stat", slow_stat)
    tier, took = timed(lambda: DiskTier(tmp_path, 1 << 30, open_timeout_s=0.3))
    assert took > 4 * 0.3 and tier.num_entries == 12
    monkeypatch.setattr(os, "stat", real_stat)
    assert same(tier.get(key(11), descriptor(11)), 11)
    tier.check_integrity()


@pytest.mark.parametrize(("action", "ops"), [("ls", {"read"}), ("stats", {"read"}), ("clear", {"meta"})])
def test_kvpool_cache_over_a_hung_mount_is_one_error_line_naming_what_it_waited_on(
    tmp_path, hang_factory, capsys, action, ops
) -> None:
    """`kvpool cache ls / stats` read every entry, `clear` removes them: on a mount that stops
    answering (an entry's open hangs; an unlink hangs) the command hung for ever. Now, one
    --timeout after the directory's last answer, it ends in one line naming the directory,
    the entry it waited on and the deadline, status 2, no traceback."""
    from kvpool.cli.main import main

    filled(tmp_path, 2)
    hang = hang_factory(tmp_path / "entries", ops)
    hang.arm()
    start = time.perf_counter()
    assert main(["cache", action, str(tmp_path), "--timeout", "0.3"]) == 2
    assert time.perf_counter() - start < 0.3 + MARGIN_S
    out, err = capsys.readouterr()
    assert out == "" and len(err.strip().splitlines()) == 1, err
    assert err.startswith(
        f"kvpool cache: error: disk cache {str(tmp_path)!r} did not answer within 0.3 s as `kvpool cache {action}` "
        "read it (--timeout 0.3) (waiting on "
    ), err
    assert len(hang.entered) == 1 and f"{hang.entered[0].name}): a hung mount?" in err
    hang.release()
    if action == "clear":  # (the clear given up on went on once the mount answered: whole files)
        wait_for(lambda: not list((tmp_path / "entries").iterdir()))
    else:
        assert main(["cache", action, str(tmp_path), "--json"]) == 0
        assert "entries" in capsys.readouterr().out


def test_kvpool_run_on_a_mount_hung_at_the_start_is_one_error_line_before_the_model_loads(
    tmp_path, hang_factory, capsys
) -> None:
    """`kvpool run --disk-cache DIR` on a mount already hung: the check of DIR before the
    model loads hung for ever. Now one line naming DIR, what it waited on and the deadline
    (--disk-open-timeout), status 2, within that deadline; no engine is built."""
    from kvpool.cli.main import main

    filled(tmp_path, 2)
    hang = hang_factory(tmp_path, {"meta"})
    hang.arm()
    assert main(["run", "--disk-cache", str(tmp_path), "--disk-open-timeout", "0.3", "--json"]) == 2
    assert time.perf_counter() - hang.entered_at[0] < 0.3 + MARGIN_S  # (building the parser takes seconds)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(
        f"kvpool run: error: disk cache {str(tmp_path)!r} did not answer within 0.3 s as it was opened "
        f"(waiting on {tmp_path / disk_module.MARKER}): a hung mount?"
    ), err


def test_the_engine_is_not_built_over_a_mount_hung_as_its_disk_tier_opens(fp64_model, tmp_path, hang_factory) -> None:
    """build_engine with a disk tier whose directory stops answering while the tier opens (the
    scan of its entries): a ValueError naming it within the open deadline, no engine."""
    from kvpool.engine.build import build_engine
    from kvpool.tiers import TierDeadlines

    filled(tmp_path, 2)
    hang = hang_factory(tmp_path / "entries", {"meta"})
    hang.arm()
    start = time.perf_counter()
    with pytest.raises(
        ValueError, match=r"did not answer within 0\.3 s as the disk tier opened \(waiting on .*entries"
    ):
        build_engine(fp64_model, num_blocks=16, disk_cache=tmp_path, tier_deadlines=TierDeadlines(disk_open_s=0.3))
    assert time.perf_counter() - start < 0.3 + MARGIN_S


def test_the_tier_deadline_flags_reach_the_tiers(fp64_model, tmp_path, redis_server) -> None:
    """--disk-timeout, --disk-write-timeout, --disk-open-timeout and --redis-timeout (run,
    generate and serve share them) become the tiers' deadlines; one without its tier's flag,
    or not a finite positive number, is refused in one line."""
    import argparse

    from kvpool.cli.args import add_persistent_cache_arguments, persistent_cache_options
    from kvpool.cli.main import build_parser, parse
    from kvpool.engine.build import build_engine

    redis_url = redis_server.url
    parser = argparse.ArgumentParser()
    add_persistent_cache_arguments(parser, swa=False)
    given = ["--disk-timeout", "0.25", "--disk-write-timeout", "3", "--disk-open-timeout", "7", "--redis-timeout", "2"]
    options = persistent_cache_options(parser.parse_args(["--disk-cache", str(tmp_path), "--redis", redis_url, *given]))
    engine = build_engine(fp64_model, num_blocks=16, **options)
    disk, redis = engine.runner.persistent_tiers
    assert (disk.timeout_s, disk.write_timeout_s, redis.timeout_s) == (0.25, 3.0, 2.0)
    assert options["tier_deadlines"].disk_open_s == 7.0
    assert redis._client.connection_pool.connection_kwargs["socket_timeout"] == 2.0
    engine.runner.close()
    assert "tier_deadlines" not in persistent_cache_options(parser.parse_args(["--disk-cache", str(tmp_path)]))
    with pytest.raises(ValueError, match="--redis-timeout needs --redis: it is that tier's deadline"):
        persistent_cache_options(parser.parse_args(["--disk-cache", str(tmp_path), "--redis-timeout", "1"]))
    with pytest.raises(ValueError, match="--disk-timeout needs --disk-cache"):
        persistent_cache_options(parser.parse_args(["--disk-timeout", "1"]))
    for command in ("run", "generate", "serve"):
        with pytest.raises(SystemExit):
            parse(build_parser(), [command, "--disk-cache", str(tmp_path), "--disk-timeout", "inf"])


def test_the_scan_lists_what_the_glob_it_replaced_listed(tmp_path) -> None:
    """scan_entries replaced `entries/*/*/*.safetensors` and skipped dot names, which the glob
    matches: a dot-named namespace's entries were no longer counted against the limit nor
    evicted (review 13 #4)."""
    for name in (
        "ns/ab/ab01.safetensors",
        "ns/ab/.x.safetensors",
        ".hid/ab/ab02.safetensors",
        "ns/.cd/ab03.safetensors",
        "ns/ab/notes.txt",
        "ns/ab01.safetensors",
        "ns/ab/deeper/ab04.safetensors",
    ):
        path = tmp_path / "entries" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"x")
    found = sorted(path for path, _ in disk_module.scan_entries(tmp_path))
    assert found == sorted((tmp_path / "entries").glob("*/*/*.safetensors")) and len(found) == 4


def test_calls_and_close_after_workers_left_hung_are_bounded_and_the_late_answers_never_applied(
    tmp_path, hang_factory
) -> None:
    """The mount hangs for good: a get's worker, then another get's, then a write's, stay
    blocked (uncancellable: each left to finish). Each later call gets a worker of its own
    (none waits behind a hung one) and returns within its deadline, and close() within the
    write deadline (the writer gave up on the write); the breaker then answers at no cost.
    Released at last, the late answers (two payloads, a write's rename) are dropped: nothing
    counted as got, nothing held, nothing installed."""
    filled(tmp_path, 2)
    tier = DiskTier(tmp_path, 1 << 30, timeout_s=0.2, write_timeout_s=0.3)
    assert tier.lookup(key(0), descriptor(0)) and tier.lookup(key(1), descriptor(1))
    hang = hang_factory(tmp_path, {"read", "write", "meta"})
    hang.arm()
    for i in (0, 1):
        got, took = timed(lambda i=i: tier.get(key(i), descriptor(i)))
        assert got is None and took < 0.2 + MARGIN_S
    assert tier.put(key(2), descriptor(2), tensors(2))
    _, took = timed(tier.close)
    assert took < 0.3 + MARGIN_S
    report = tier.report()
    assert report["timeouts"]["read"] == 2 and report["timeouts"]["write"] == 1 and not report["available"]
    assert report["stuck_io"] == len(hang.entered) >= 3  # (each hung call holds its worker)
    got, took = timed(lambda: tier.get(key(0), descriptor(0)))  # (the breaker open: no I/O)
    assert got is None and took < 0.05 + MARGIN_S and tier.stats.misses["unavailable"] == 1
    assert tier.report()["stuck_io"] == len(hang.entered)
    hang.release()
    settled(tier)
    assert tier.stats.num_gets == 0 and tier.stats.num_get_bytes == 0
    assert not tier.holds(key(0), descriptor(0)) and not tier.holds(key(1), descriptor(1))
    assert tier.num_entries == 2 and not stored(tier, 2).exists() and not list((tmp_path / "tmp").iterdir())
    tier.check_integrity()
