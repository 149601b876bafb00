"""The disk tier: a crash-safe prefix cache in a directory, shared by every process that
opens it.

    DIR/kvpool-disk-cache                     marker (format), written when the cache is made
    DIR/entries/<namespace>/<kk>/<key>.safetensors   one block: tensors + manifest (entry.py)
    DIR/tmp/<key>.s<start>.<pid>.<n>.tmp      writes in progress (<start>: the writer's start
                                              time, /proc/<pid>/stat's field 22; 0 unknown)
    DIR/quarantine/<key>.<ns>.safetensors     entries whose bytes did not check out (the
                                              newest, within 1/32 of the byte limit; listed
                                              at open, then kept as a list)

Writes (SQLite's discipline): the entry goes to a temp file of a unique name, is fsynced,
renamed onto its final name (atomic on POSIX), and the directory is fsynced. A reader
sees the old entry or the new one, never a torn one; a writer killed at any point leaves
at most a temp file, which the next process to open the cache removes once its writer is
gone (dead, or its pid now another process's: temp_file_owner_alive). Two processes
writing the same entry both rename whole files: the last one wins.

Reads check the manifest's checksum and every tensor's (entry.py): a corrupted or
truncated entry, or one whose tensors are not the shapes and dtypes the engine declared
for its namespace (`expect_tensors`), is moved to quarantine/, counted, and is a miss; so
is anything at an entry's path that is not a regular file (a FIFO is opened non-blocking,
so it cannot hang a lookup). A descriptor that does not match the caller's is a miss
counted under each differing field, and the entry is deleted (reclaimed): after a template
or tokenizer switch, the old entries go as they are met, and the LRU limit ages out the
rest. Other weights are another namespace (their entries side by side, never met; the LRU
ages out a superseded version's). An entry
of another kvpool's format version is a miss ("other_version"), left in place for its
writer, and aged out by the byte limit like any entry.

Faults are misses, never crashes: an entry the process may not read, a read-only
filesystem, a directory where a file should be. Each is counted in `io_errors` by what
failed ("read", "utime", "evict", "quarantine", "trim", "reclaim", "tmp"); a lookup or get it ends
is a miss of cause "io_error"; a write it ends counts in num_write_errors. Each kind of
failure (what failed and its errno) is said once, in one line naming the directory (the
cache removed under a running engine, say: every later write fails, and without the line
nothing but --json's counters told). A filesystem that fills up (ENOSPC, EDQUOT) before
the byte limit is reached is a limit too: the write makes room by evicting least recently
used entries, as many bytes as it needs, and tries once more, so the tier keeps taking
new blocks (it stopped taking any, its old entries kept for ever). When that retry finds
the filesystem full again, evicting did not help (files held open, another user's quota,
another writer): making room stops until a write succeeds or a back-off ends, and the
entries stay (it drained the whole tier, one entry a write). That is said once an episode
(until a write succeeds), a flapping disk's episodes at most once a quiet time.

`holds` (the writer's "already stored, skip it") trusts only entries whose payload this
process wrote or read back whole: a lookup checks the header only, so an entry with a
corrupted payload is rewritten as soon as the engine computes its block again.

The byte limit is LRU over the directory's entries by modification time (a hit refreshes
it). Each process knows the entries at open, its own writes and the entries it finds; and
after every `capacity_bytes / 32` bytes it writes, it scans the directory again and evicts
the least recently used of everyone's entries. Several processes on one directory then
hold at most the limit plus, each, what it wrote since its last scan (1/32 of the limit,
or one entry when that is larger). A process whose limit is below what the directory holds
cuts it down at the first write it takes (other processes' entries too), and says so in one
line; not as it opens: a limit too small for any entry, refused once the engine knows its
block size, had already cut a shared cache to nothing. Evictions choose their victims and
drop them from the index under the lock, and unlink the files after it: a cut of thousands
of entries on the writer's thread held the lookups of the engine's thread for seconds.

Writes run on a background writer (writer.py): `put` encodes nothing and never waits; a
full queue drops the write and counts it.

Deadlines: a mount that stops answering (an NFS hard mount whose server is gone, a FUSE file
system that hangs, a dying disk) stalled the engine's step for ever on a lookup's read. File
operations now run on a worker thread (deadline.py) and are waited for up to a deadline:
`timeout_s` (1 s; --disk-timeout) for a lookup's read (the open, fstat and header of an
entry not yet read here) and a get's (the whole entry read and checked, and its LRU
refresh), each one worker job (a hand-off costs tens of microseconds: one per file operation
made lookups and gets 1.5-3x slower, review 12), and for an unlink or a rename;
`write_timeout_s` (10 s; --disk-write-timeout) for a whole write (an fsync waits for the
disk's other dirty data too) and a rescan of the directory. A read past
it is a miss (cause "timeout": the engine computes those tokens, nothing wrong is served); what
it returns late is dropped with it, nothing indexed from it. A write past it is dropped and
counted (num_write_errors): once its writer gave up, the write removes its temp file instead of
renaming it in. One whose rename had begun (the rename, or the directory's fsync, was the call
that hung) may land all the same: it is indexed as it lands (`_Gate`), counted in num_puts and
no longer in num_write_errors. A rescan past its deadline is counted (timeouts["scan"]) and
goes on: the next rescan waits for that same scan, never a second at once, and uses its answer
however late (a large directory on a slow disk is not a hung mount: it does not count towards
the breaker). A lookup or get waits for at most one operation past its deadline (two where a
bad entry is moved to quarantine/: the move, the trim); the engine's thread waits under the
tier's lock, so the writer's index updates wait with it. After `breaker_failures`
(3) operations in a row past their deadline (any answer, an error too, starts the count
again) a breaker opens, said in one line: every lookup and get is a miss ("unavailable") and
every write is dropped (unavailable_puts), at no cost. Once its cool-down (`retry_s`, 1 s)
has passed, the next call starts one probe, a read of the marker file, and does not wait for
it; a probe that answered within `timeout_s` closes the breaker (said), a late one starts
another cool-down, and one still stuck holds every later probe back: an outage holds at
most `breaker_failures` worker threads and a probe, and costs the engine at most that many
deadlines. The report says `available`, `outages`, `timeouts` (by what), `stuck_io` (the
operations past their deadline still not returned) and `unavailable_puts`.

Its breaker is not the Redis tier's (redis_tier.py), for reasons of the medium, not of
history: a single operation past its deadline is common on a healthy disk (an fsync behind
the disk's other dirty data, a loaded NFS server), so it takes `breaker_failures` in a row,
where a Redis connection refused or a socket timeout says the server is away; a probe on a
hung mount never returns (a system call that cannot be cancelled), so it runs on a deadline
worker and is never waited for, where Redis pings on its writer thread (a socket timeout
always returns, and a server back means replaying the held writes on that thread); and the
index and the files stay while it is open (a local mount keeps them), with writes dropped
(held ones would go to the same hung mount), where Redis forgets what it believed stored (a
server may come back empty) and holds its writes. What the two share, a count, an open flag
and the outages, is a few lines; a common class would not shorten either.

The open (the directory's checks, the stale temp files removed, quarantine/ listed, every
entry scanned) is one worker job, waited for while the directory answers: `open_timeout_s`
(10 s; --disk-open-timeout) is how long it waits for the next answer, not for the whole open, so a directory that
lists slowly is indexed whole (review 12: it opened with nothing indexed, its byte limit
unenforced), and a mount already hung when the tier opens (which hung the open for ever) is a
ValueError naming the directory, what the open waited on and the deadline: no tier is made
and the engine does not start (as a directory that cannot be reached). Not an outage to
serve through, as a Redis server down at the start is: an outage's breaker assumes an
opened, indexed tier (its byte limit, its quarantine list), and a tier asked for on the
command line that never came up would serve without it after one line (LMCache's backend
factory, too, lets its local disk backend's failure end the start; only plug-in backends
are logged and skipped).
"""

from __future__ import annotations

import enum
import errno
import io
import itertools
import os
import stat
import sys
import threading
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from torch import Tensor

from kvpool.tiers import entry
from kvpool.tiers.base import Tier, TierStats
from kvpool.tiers.deadline import DeadlineRunner, Job, NoAnswer, Progress, check_deadline
from kvpool.tiers.descriptor import BlockDescriptor
from kvpool.tiers.writer import BackgroundWriter

MARKER = "kvpool-disk-cache"
SUFFIX = ".safetensors"
_CHUNK = 1 << 20
_FULL = (errno.ENOSPC, errno.EDQUOT)
# the BlockDescriptor fields that come from the engine's CacheDescriptor (tiers/descriptor.py)
_CACHE_FIELDS = (
    "model_id",
    "weights_version",
    "tokenizer_version",
    "template_version",
    "adapter_id",
    "rope_id",
    "layout_id",
)
# a full filesystem that evicting did not relieve: no eviction to make room for this long
# (doubled each time it happens again, up to the cap), or until a write succeeds
_NO_ROOM_BACKOFF_S = 60.0
_NO_ROOM_BACKOFF_MAX_S = 3600.0
_now = time.monotonic  # (the tests move it)
# deadlines (module docstring): a lookup's or a get's read (one job each), an unlink, a rename ...
DEFAULT_TIMEOUT_S = 1.0
# ... and a whole write (temp file written and fsynced, renamed, the directory fsynced: an
# fsync waits for the disk's other dirty data too) or a scan of the directory
DEFAULT_WRITE_TIMEOUT_S = 10.0
# ... and the open (its checks, stale temp files, quarantine/ listed, every entry scanned):
# how long it waits for the directory's next answer (a slow, large directory is waited for
# whole; a hung mount is given up on this long after its last answer)
DEFAULT_OPEN_TIMEOUT_S = 10.0
DEFAULT_BREAKER_FAILURES = 3  # operations in a row past their deadline that open the breaker
DEFAULT_RETRY_S = 1.0  # the breaker's cool-down: how often, at most, the tier asks the disk again
_WHAT = {  # what failed (io_errors' names, and "write"), as a fault line says it
    "write": "a write",
    "full": "a write (the filesystem is full)",
    "no room": "a write after making room (the filesystem is still full)",
    "read": "a read",
    "stat": "a stat of an entry's file",
    "scan": "a scan of the directory",
    "utime": "refreshing an entry's LRU time",
    "evict": "an eviction",
    "quarantine": "moving a bad entry to quarantine/",
    "trim": "removing an old quarantined entry (quarantine/ kept within 1/32 of the limit)",
    "reclaim": "removing an entry of another descriptor",
    "tmp": "removing a stale temp file",
}


class _Outcome(enum.Enum):
    """What an operation on an entry's file (`DiskTier._file_op`) came to."""

    DONE = "done"  # this process did it
    GONE = "gone"  # the file was not there: another process removed or moved it first
    FAILED = "failed"  # the OS refused (counted in io_errors, said once)
    SILENT = "silent"  # no answer within the deadline, or not tried: the breaker open (counted)


class _Gate:
    """A write's rename, the step that installs it, taken only while its writer still waits
    for it: a write the writer gave up on (past its deadline) before that step removes its
    temp file instead, and never appears. One whose rename had begun when its writer gave up
    may still land (the rename, or the directory's fsync after it, was the call that hung):
    then `late` indexes it as it lands (review 12: it was on disk, found by lookups, counted
    as a failed write and outside the byte limit)."""

    def __init__(self, late: Callable[[int], None]) -> None:
        self._lock = threading.Lock()
        self._late = late  # (the landed file's inode) on the write's worker, once its writer gave up
        self._abandoned = False  # its writer gave up waiting
        self._committed = False  # its rename began
        self._landed: int | None = None  # the inode it landed as, while its writer waited

    def commit(self) -> bool:
        """In the write, before its rename: whether to go on (its writer still waits)."""
        with self._lock:
            self._committed = not self._abandoned
            return self._committed

    def landed(self, inode: int) -> None:
        """In the write, once its file is in place: `late` if its writer gave up meanwhile."""
        with self._lock:
            late = self._abandoned
            self._landed = inode
        if late:
            self._late(inode)

    def abandon(self) -> int | None:
        """The writer's deadline passed: no rename from now on; the inode when the write
        landed all the same before this (then the writer installs it: `late` is not called)."""
        with self._lock:
            self._abandoned = True
            return self._landed


class _Removed(NamedTuple):
    """What unlinking evicted entries' files freed (`DiskTier._remove_evicted`)."""

    num_bytes: int  # of the files this process removed
    num_gone_bytes: int  # of those another process had removed first (freed, but not by this one)


class _Quarantined(NamedTuple):
    """A file in quarantine/ (`DiskTier._quarantined`)."""

    at_ns: int  # when it was quarantined (its name's time_ns)
    num_bytes: int
    path: Path


@dataclass
class _Entry:
    path: Path
    num_bytes: int
    descriptor: BlockDescriptor | None  # known once read or written by this process
    inode: int = 0  # the file's (a rewrite renames a new file in: a new inode)
    verified: bool = False  # its payload checked out here (written, or read back whole)


def _open_entry(path: Path) -> io.BufferedReader:
    """A binary file object on the regular file at `path`. Non-blocking open: a FIFO
    returns at once (and, like a directory or a device, is refused as CorruptEntry)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            kind = "directory" if stat.S_ISDIR(mode) else "FIFO" if stat.S_ISFIFO(mode) else "special file"
            raise entry.CorruptEntry(f"a {kind} at the entry's path, not a file")
        return os.fdopen(fd, "rb")  # (O_NONBLOCK does nothing to a regular file's reads)
    except BaseException:
        os.close(fd)
        raise


class _Read(NamedTuple):
    """What one worker job made of an entry's file (`_read_entry`)."""

    st: os.stat_result | None  # the file's, as opened (None: the open failed: `error`)
    descriptor: BlockDescriptor | None  # its header's, checked (None: `error`)
    tensors: dict[str, Tensor] | None  # a get's, every checksum checked (None: a lookup, `error`, `differ`)
    num_bytes: int  # read
    error: Exception | None  # OSError, CorruptEntry, OtherVersion: what ended the read
    differ: list[str]  # the descriptor's fields that are not the expected ones (a get's: no payload read)
    refresh_error: OSError | None  # the LRU refresh's (a get's hit)


def _read_entry(path: Path, key: bytes, expected: BlockDescriptor, layout: dict | None, whole: bool) -> _Read:
    """A lookup's or a get's whole file work, in one worker job under one deadline (review 12:
    a hand-off each for the stat, the header, the payload and the refresh cost 52-68 us each,
    lookups and gets 1.5-3x slower): the open (its fstat is the stat an entry not yet indexed
    needs), the header read and checked (`layout`: the tensors its namespace must have), and for
    a get (`whole`) the whole file read, its descriptor compared with `expected` (a mismatch
    reads no further), every checksum checked, and the hit's LRU time refreshed. No lock: the
    caller applies the outcome to the index. OSError from the open itself (FileNotFoundError:
    not there)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # (a FIFO returns at once, refused below)
    st = None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            kind = "directory" if stat.S_ISDIR(st.st_mode) else "FIFO" if stat.S_ISFIFO(st.st_mode) else "special file"
            raise entry.CorruptEntry(f"a {kind} at the entry's path, not a file")
        with os.fdopen(fd, "rb") as f:
            fd = -1  # (the file object closes it)
            if whole:
                data = f.read()
            else:
                n = entry.header_length(f.read(8))
                data = f.read(n)
                if len(data) < n:
                    raise entry.CorruptEntry(f"entry of {8 + len(data)} bytes is shorter than its header ({n} bytes)")
        peeked = entry.peek(data, key) if whole else entry.read_header(data, key)
        descriptor, manifest = peeked
        entry.check_layout(entry.tensor_layout(manifest), layout)
        differ = descriptor.mismatches(expected) if whole else []
        if differ:
            return _Read(st, descriptor, None, len(data), None, differ, None)
        tensors = None
        if whole:
            descriptor, tensors = entry.decode(data, key, peeked)
            entry.check_layout(entry.layout_of(tensors), layout)
    except (OSError, entry.CorruptEntry, entry.OtherVersion) as error:
        if st is None:
            raise  # (the open's fstat: as the open's own error)
        return _Read(st, None, None, 0, error, [], None)
    finally:
        if fd >= 0:
            os.close(fd)
    refresh_error = None
    if whole:
        try:  # the LRU order, for the next process
            os.utime(path)
        except FileNotFoundError:  # (removed meanwhile by another process: nothing to refresh)
            pass
        except OSError as error:  # entries of another user, a read-only disk: still a hit
            refresh_error = error
    return _Read(st, descriptor, tensors, len(data), None, [], refresh_error)


def _read_marker(path: Path) -> bytes:
    """The breaker's probe: a read of the cache's marker file (the read path, not a stat
    alone, which a FUSE file system may answer while its reads hang)."""
    with _open_entry(path) as f:
        return f.read(4096)


def temp_file_name(key: bytes, n: int) -> str:
    """The name of this process's `n`th temp file for `key`: <key>.s<start>.<pid>.<n>.tmp,
    its writer named beyond its pid (a pid is reused: in a container the engine often gets
    the same one at every start) by its start time. The pid stays third from the end, where
    a kvpool that knows only <key>.<pid>.<n>.tmp reads it (and keeps the file while that pid
    lives, as it did)."""
    pid = os.getpid()
    return f"{key.hex()}.s{_own_start_time(pid) or 0}.{pid}.{n}.tmp"


def temp_file_owner_alive(path: Path) -> bool:
    """Whether the writer named in a temp file's name is a live process of this machine: the
    process of that pid and, where the name carries one, that start time
    (<key>.s<start>.<pid>.<n>.tmp; a start time unknown, to the writer or here (no /proc,
    or another user's hidden), falls back to the pid alone). A name of the old scheme
    (<key>.<pid>.<n>.tmp, written by an earlier kvpool) keeps the old rule: that pid lives."""
    parts = path.name.split(".")
    try:
        pid = int(parts[-3])
        start = int(parts[-4][1:]) if len(parts) >= 5 and parts[-4][:1] == "s" else None
    except (IndexError, ValueError):
        return False
    if pid <= 0:
        return False
    if not start:  # the old scheme, or a writer that could not read its own start time
        return pid == os.getpid() or _pid_alive(pid)
    now = _own_start_time(pid) if pid == os.getpid() else _start_time(pid)
    if now is None:  # no /proc, or hidden (hidepid): the pid alone
        return _pid_alive(pid) if pid != os.getpid() else True
    return now == start


def _start_time(pid: int) -> int | None:
    """A process's start time (clock ticks after boot: /proc/<pid>/stat's field 22); None
    where there is no such process or it cannot be read (no /proc)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            text = f.read()
        # after the name's closing parenthesis (a name may hold spaces and parentheses): field 3 on
        return int(text[text.rindex(b")") + 1 :].split()[22 - 3])
    except (OSError, ValueError, IndexError):
        return None


_own_start: tuple[int, int | None] = (0, None)  # (pid, its start time): read once per process


def _own_start_time(pid: int) -> int | None:
    global _own_start
    if _own_start[0] != pid:  # (first call, or a forked child)
        _own_start = (pid, _start_time(pid))
    return _own_start[1]


def fsync_path(path: Path) -> None:
    """Flush a file's data, or a directory's entries (a rename into it), to the disk.
    models/weight_cache.py shares it: one place for the open/fsync/close."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def cache_path(directory: str | os.PathLike) -> Path:
    """The directory as given (`~` expanded); ValueError for an empty path."""
    if os.fspath(directory) == "":  # Path("") is "." (" " is a directory name, if an odd one)
        raise ValueError(f"disk cache {os.fspath(directory)!r}: an empty path (give the cache's directory)")
    return Path(directory).expanduser()


def bounded(root: Path, doing: str, timeout_s: float, fn: Callable[..., object], *args: object):
    """fn(*args, progress) on a worker thread of its own, waited for while the directory
    answers, each answer within `timeout_s` of the last (a large directory on a slow disk
    takes as long as it needs: deadline.py's `wait_steady`); ValueError naming the directory,
    what `doing`, what it waited on and the deadline once it stops answering (a hung mount:
    the open hung for ever). Its exceptions are raised as they are."""
    check_deadline("the disk cache's deadline", timeout_s)
    runner = DeadlineRunner("disk-open")
    progress = Progress(root)
    try:
        return runner.wait_steady(timeout_s, runner.start(fn, *args, progress), progress)
    except NoAnswer as silent:
        raise ValueError(
            f"disk cache {str(root)!r} did not answer within {timeout_s:g} s {doing} (waiting on {silent.what}): "
            "a hung mount? (an NFS server gone, a FUSE file system that stopped answering)"
        ) from None


def open_directory(directory: str | os.PathLike, timeout_s: float = DEFAULT_OPEN_TIMEOUT_S) -> Path:
    """The cache directory, created if absent; ValueError naming the problem when it is a
    file, is not writable, cannot be reached (a parent the user may not enter), is a
    directory that holds something other than a cache, or does not answer within
    `timeout_s` (a hung mount)."""
    root = cache_path(directory)
    return bounded(root, "as it was opened", timeout_s, _open_directory, root)


def _open_directory(root: Path, progress: Progress) -> Path:
    """open_directory's checks, each answer told to `progress`."""
    try:
        return _open_directory_checks(root, progress)
    except OSError as error:  # a parent the user may not enter (another user's home), a failing disk
        raise ValueError(f"disk cache {str(root)!r} cannot be reached: {error.strerror or error}") from None


def _open_directory_checks(root: Path, progress: Progress) -> Path:
    """open_directory's checks; OSError from a stat the system refuses (Path.exists raises
    all but ENOENT-like errors)."""
    if root.exists() and not root.is_dir():
        raise ValueError(f"disk cache {str(root)!r} is a file, not a directory")
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise ValueError(f"disk cache {str(root)!r} cannot be created: {error.strerror}") from None
    marker = root / MARKER
    progress.step(marker)
    if not marker.exists():
        # (the marker itself: another process made the cache since the look above)
        progress.step(root)
        if any(p.name not in ("entries", "tmp", "quarantine", MARKER) for p in root.iterdir()):
            raise ValueError(f"disk cache {str(root)!r} is a directory with other files in it (not a kvpool cache)")
        progress.step(marker)
        try:
            marker.write_text(f"kvpool disk cache, entry format {entry.FORMAT}\n")
        except OSError as error:
            raise ValueError(f"disk cache {str(root)!r} is not writable: {error.strerror}") from None
    for sub in ("entries", "tmp", "quarantine"):
        progress.step(root / sub)
        try:
            (root / sub).mkdir(exist_ok=True)
        except OSError as error:
            raise ValueError(f"disk cache {str(root)!r} is not writable: {error.strerror}") from None
    progress.step(root / "tmp")
    if not os.access(root / "tmp", os.W_OK | os.X_OK) or not os.access(root / "entries", os.W_OK | os.X_OK):
        raise ValueError(f"disk cache {str(root)!r} is not writable")
    progress.step(root)
    return root


def scan_entries(root: Path, progress: Progress | None = None) -> list[tuple[Path, os.stat_result]]:
    """Every entry file under root/entries (entries/<namespace>/<key prefix>/<key>.safetensors,
    dot names too, as the glob `*/*/*.safetensors` it replaced matches them), least
    recently used (modified) first. A directory that cannot be listed is skipped (as a glob
    does). progress: told of each answer, naming what is asked next (the open's scan,
    `kvpool cache`'s: `bounded`)."""
    progress = progress or Progress()
    found = []
    level = [root / "entries"]
    for depth in range(3):  # entries/ | <namespace>/ | <key prefix>/
        below = []
        for directory in level:
            progress.step(directory)
            try:
                with os.scandir(directory) as listing:
                    # (is_dir follows a link, as the glob did; the last level's any type: a
                    # directory at an entry's path is the tier's to quarantine)
                    names = [e.name for e in listing if depth == 2 or e.is_dir()]
            except OSError:  # gone meanwhile, not a directory, or not listable
                continue
            below += [directory / name for name in names if depth < 2 or name.endswith(SUFFIX)]
        level = below
    for path in level:
        progress.step(path)
        try:
            found.append((path, path.stat()))
        except OSError:  # another process evicted it meanwhile (or it cannot be reached)
            continue
    found.sort(key=lambda item: item[1].st_mtime_ns)
    return found


def _remove_stale_tmp(root: Path, progress: Progress) -> tuple[int, int]:
    """Temp files of writers that are gone (killed mid-write), removed: (how many, how many
    could not be: a directory, a read-only disk, left there)."""
    removed = failed = 0
    progress.step(root / "tmp")
    for path in (root / "tmp").glob("*.tmp"):
        progress.step(path)
        if not temp_file_owner_alive(path):
            try:
                path.unlink()
                removed += 1
            except FileNotFoundError:
                pass
            except OSError:
                failed += 1
    return removed, failed


def _list_quarantine(root: Path, progress: Progress) -> deque[_Quarantined]:
    """quarantine/'s files, oldest first (by the time in their names; the move keeps a
    file's mtime)."""
    found = []
    progress.step(root / "quarantine")
    for path in (root / "quarantine").glob(f"*{SUFFIX}"):
        progress.step(path)
        try:
            num_bytes = path.stat().st_size
        except OSError:  # (removed meanwhile, or unreachable: not ours to trim)
            continue
        when = path.name.split(".")[-2]  # <key>.<time_ns>.safetensors
        found.append(_Quarantined(int(when) if when.isdigit() else 0, num_bytes, path))
    return deque(sorted(found, key=lambda q: q.at_ns))


class _Opened(NamedTuple):
    """What the tier's open found (`_open_files`)."""

    root: Path
    num_stale_tmp_removed: int
    num_tmp_errors: int  # stale temp files that could not be removed
    quarantined: deque[_Quarantined]
    found: list[tuple[Path, os.stat_result]]  # scan_entries'


def _open_files(root: Path, progress: Progress) -> _Opened:
    """The tier's open, one worker job under the open's deadline (`bounded`): the directory
    checked (made if absent), the stale temp files removed, quarantine/ listed, every entry
    scanned."""
    root = _open_directory(root, progress)
    removed, failed = _remove_stale_tmp(root, progress)
    return _Opened(root, removed, failed, _list_quarantine(root, progress), scan_entries(root, progress))


class DiskTier(Tier):
    name = "disk"

    def __init__(
        self,
        directory: str | os.PathLike,
        capacity_bytes: int,
        *,
        max_pending_bytes: int = 64 << 20,
        fsync: bool = True,
        log: Callable[[str], None] | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        write_timeout_s: float = DEFAULT_WRITE_TIMEOUT_S,
        breaker_failures: int = DEFAULT_BREAKER_FAILURES,
        retry_s: float = DEFAULT_RETRY_S,
        open_timeout_s: float = DEFAULT_OPEN_TIMEOUT_S,
    ) -> None:
        """capacity_bytes: the LRU byte limit of the entry files. max_pending_bytes: the
        background writer's queue bound. fsync: off only for benchmarks of the unsafe rate.
        log: where the once-per-kind fault lines go (default: stderr). timeout_s: the
        deadline of a lookup's read (an entry's open and header) and of a get's (the
        entry read and checked, its LRU refresh: one job each), of an unlink or a rename;
        write_timeout_s: of a whole write, and of a scan of the directory.
        breaker_failures: operations in a row past their deadline that open the breaker;
        retry_s: its cool-down, after which the tier asks the disk again (module docstring).
        open_timeout_s: the open's (its checks, stale temp files, quarantine/ listed, every
        entry scanned): how long it waits for the directory's next answer, past which it is
        a ValueError naming the directory and the deadline (a hung mount: the open hung)."""
        if isinstance(capacity_bytes, bool) or not isinstance(capacity_bytes, int) or capacity_bytes <= 0:
            raise ValueError(f"disk tier capacity must be a positive number of bytes, got {capacity_bytes!r}")
        for name, value in (
            ("timeout_s", timeout_s),
            ("write_timeout_s", write_timeout_s),
            ("retry_s", retry_s),
            ("open_timeout_s", open_timeout_s),
        ):
            check_deadline(f"disk tier {name}", value)
        if isinstance(breaker_failures, bool) or not isinstance(breaker_failures, int) or breaker_failures < 1:
            raise ValueError(f"disk tier breaker_failures must be a positive integer, got {breaker_failures!r}")
        self.timeout_s, self.write_timeout_s = float(timeout_s), float(write_timeout_s)
        self.breaker_failures, self.retry_s = breaker_failures, float(retry_s)
        # the breaker (module docstring); its own lock, never held while waiting, taken
        # inside _lock (never the other way round)
        self._runner = DeadlineRunner("disk")
        self._breaker_lock = threading.Lock()
        self._failures = 0  # operations in a row that got no answer within their deadline
        self._open_until: float | None = None  # (_now()) open: the cool-down's end; None: closed
        self._probe: Job | None = None  # the read that asks whether the disk answers again
        self.num_outages = 0  # times the breaker opened
        self.timeouts: Counter[str] = Counter()  # operations past their deadline, by what
        self.num_unavailable_puts = 0  # writes dropped while the breaker was open
        # the open's file work first, on a worker, given up on when the directory stops
        # answering (ValueError): no tier half open, nothing started
        root = cache_path(directory)
        opened = bounded(root, "as the disk tier opened", open_timeout_s, _open_files, root)
        self.root = opened.root
        self.capacity_bytes = capacity_bytes
        self.fsync = fsync
        self.stats = TierStats()
        self.io_errors: Counter[str] = Counter()  # OS errors by what failed (module docstring)
        self._log = log or (lambda line: print(line, file=sys.stderr, flush=True))
        self._said: set[tuple[str, str]] = set()  # (what failed, errno name) already said
        self.num_full = 0  # writes that found the filesystem full and made room
        self.num_no_room = 0  # ... and still found it full: making room stops for a while
        self._no_room_until = 0.0  # (_now()) no eviction to make room before this
        self._no_room_backoff_s = _NO_ROOM_BACKOFF_S
        # an episode of no room (from a failed retry to a write that succeeds) is said once;
        # the next one again, unless it comes within the quiet time since the last line
        # (doubled with each line, up to the cap, back to the first step after an hour unsaid)
        self._no_room_quiet_until = 0.0
        self._no_room_quiet_s = _NO_ROOM_BACKOFF_S
        self._no_room_unsaid = 0  # episodes in a quiet time, told in the next line
        self.num_quarantine_trimmed = 0  # quarantined files this process removed to keep quarantine/ bounded
        self._lock = threading.Lock()
        # (namespace, content key) -> entry, LRU first; blocks of the same tokens under two
        # models are two entries. _keys counts each content key's namespaces (contains()).
        self._entries: OrderedDict[tuple[str, bytes], _Entry] = OrderedDict()
        self._keys: Counter[bytes] = Counter()
        # entries evicted from the index whose files are being unlinked, outside the lock (a
        # cut of thousands of entries held it for seconds, lookups waiting): a miss meanwhile
        self._removing: set[tuple[str, bytes]] = set()
        self._num_bytes = 0
        self._tmp_names = itertools.count()
        # namespace -> {tensor name: (dtype, shape)} every entry of it must have
        self._expected: dict[str, dict[str, tuple[str, list[int]]]] = {}
        # the directory is scanned again (other processes' entries) after this many bytes
        self.rescan_bytes = max(1, capacity_bytes // 32)
        self._written_since_scan = 0
        # a scan of the directory still running past its deadline, and the index it started
        # from: the next rescan waits for it again (never a second scan at once) and uses
        # its answer, however late (a large, slow directory is not a hung mount)
        self._scan: tuple[Job, dict[tuple[str, bytes], _Entry]] | None = None
        self._writer = BackgroundWriter("disk", max_pending_bytes)
        self.num_stale_tmp_removed = opened.num_stale_tmp_removed
        if opened.num_tmp_errors:  # (a directory, a read-only disk: left there, counted)
            self.io_errors["tmp"] = opened.num_tmp_errors
        # quarantine/ as it was at open, then as this process adds to it, oldest first: the
        # trim after each quarantine reads this, not the directory (a glob and a stat of every
        # file, under the lock, on the engine's lookup path, at each quarantine)
        self._quarantined = opened.quarantined
        self._quarantine_bytes = sum(q.num_bytes for q in self._quarantined)
        # the directory is indexed, not cut to the limit: that waits for the first write this
        # tier takes (_cut_to_limit). A limit that holds no entry (--disk-cache-gib 1e-9, which
        # the runner's check_sizes refuses only once the tier is open) cut a shared cache to
        # nothing as it opened, and then was refused.
        self._cut_pending = True
        # a lookup indexed an entry it found on disk (another process's, or this one's write
        # landed before its writer indexed it) past the limit: the next write's eviction cuts
        # the index to it again (evictions are the writer's, off the lookup path)
        self._found_over = False
        self._index(opened.found, {}, evict=False)
        # a crash test stops the writer here (the stage's name); None in normal use
        self.fault_hook = None

    # ---- layout -----------------------------------------------------------------------

    def _path(self, key: bytes, descriptor: BlockDescriptor) -> Path:
        hexkey = key.hex()
        return self.root / "entries" / entry.namespace(descriptor) / hexkey[:2] / f"{hexkey}{SUFFIX}"

    @staticmethod
    def _id(key: bytes, descriptor: BlockDescriptor) -> tuple[str, bytes]:
        return entry.namespace(descriptor), key

    def _cut_to_limit(self) -> None:
        """Before the first write this tier takes (its entry fits the limit): a shared cache
        larger than this process's limit (the 16 GiB default, say) is cut down to it, other
        processes' entries too, so said, once (writer thread)."""
        self._cut_pending = False
        # indexed again first: the open's index is stale by now (other processes' reads moved
        # their entries' LRU times, their writes and evictions changed the set), and the cut
        # takes the least recently used entries as the directory holds them now
        before = self.stats.num_evictions
        freed = self._rescan()
        if freed is None:  # the scan got no answer: the cut waits for the next write
            self._cut_pending = True
            return
        evicted = self.stats.num_evictions - before
        if freed:
            self._log(
                f"kvpool: disk cache {self.root} held more than this process's byte limit "
                f"(--disk-cache-gib {self.capacity_bytes / 2**30:.4g}): its {evicted} least recently "
                f"used entries ({freed / 2**20:,.1f} MiB) were evicted; a larger --disk-cache-gib keeps a shared "
                "cache whole"
            )

    def _rescan(self) -> int | None:
        """Index the directory's entries as they are now (other processes' writes and
        evictions) and evict down to the limit (`_index`; the bytes this process freed are
        returned).

        (The open's scan is the open's: `_open_files`, waited for while the directory
        answers, so a directory that takes long to list is indexed whole: review 12, it opened
        with nothing indexed, its byte limit unenforced.) A rescan runs on a worker, waited
        for up to the write deadline: past it, None (the index left as it was), the scan goes
        on and is due again after the next 1/32 of the limit, when that same scan is waited
        for again (never two at once) and its answer, however late, is used. A scan's
        lateness is counted in timeouts["scan"], not in the breaker's failures in a row (a
        listing answers late on a healthy, large directory too); its answer within the
        deadline starts that count again, as any operation's does."""
        if self._scan is None:
            if self._unavailable():
                return None
            with self._lock:
                known = dict(self._entries)
            self._scan = (self._runner.start(scan_entries, self.root), known)  # (no lock: lookups go on)
        job, known = self._scan
        try:
            found = self._runner.wait("scan", self.write_timeout_s, job)
        except NoAnswer:
            with self._breaker_lock:
                self.timeouts["scan"] += 1
            with self._lock:
                self._written_since_scan = 0  # (waited for again after the next 1/32 of the limit)
            return None
        except OSError:  # (scan_entries skips what it cannot list or stat: a bug's, or a fake's)
            with self._lock:
                self._written_since_scan = 0
            return None
        finally:
            if job.done.is_set():
                self._scan = None
        if job.elapsed_s <= self.write_timeout_s:
            self._answered()  # (an answer in time, as any operation's, starts the count again)
        return self._index(found, known)

    def _index(
        self, found: list[tuple[Path, os.stat_result]], known: dict[tuple[str, bytes], _Entry], evict: bool = True
    ) -> int:
        """Index the entries a scan `found` (scan_entries'), least recently modified first,
        and evict down to the limit unless `evict` is False (the open: see _cut_to_limit);
        the bytes this process freed. What this process knew of an entry when the scan
        started (`known`: its descriptor, a checked payload) is kept while the file is the
        same one."""
        entries: OrderedDict[tuple[str, bytes], _Entry] = OrderedDict()
        for path, st in found:
            try:
                key = bytes.fromhex(path.name.removesuffix(SUFFIX))
            except ValueError:
                continue
            if path.name != f"{key.hex()}{SUFFIX}":
                # fromhex takes upper case and spaces: another program's file, not an entry
                # (an upper-case twin would share the entry's index slot, its bytes uncounted)
                continue
            ident = (path.parent.parent.name, key)
            old = known.get(ident)
            same_file = old is not None and old.inode == st.st_ino and old.num_bytes == st.st_size
            entries[ident] = old if same_file else _Entry(path, st.st_size, None, st.st_ino)
        with self._lock:
            for ident in [i for i in entries if i in known and i not in self._entries]:
                del entries[ident]  # dropped meanwhile (evicted, quarantined, reclaimed): not back
            for ident, entry_now in self._entries.items():
                if ident not in known:
                    entries[ident] = entry_now  # found meanwhile by a lookup (the newest use)
            self._entries, self._keys = entries, Counter(key for _, key in entries)
            self._num_bytes = sum(e.num_bytes for e in entries.values())
            self._written_since_scan = 0
            victims = self._evict_over_limit() if evict else []
        return self._remove_evicted(victims).num_bytes

    def entry_bytes(self, cache: object, block_size: int, tensors: dict[str, tuple[object, tuple[int, ...]]]) -> int:
        """The bytes a block of these tensors ({name: (torch dtype, shape)}) takes at most as
        an entry under `cache` (the engine's CacheDescriptor): the tensors and the header
        (manifest, descriptor, checksums), what `_write` weighs against the limit. (The
        header grows with the token ids' digits: the largest ids are taken.) A block with
        multimodal items is larger by its extra key's hex, which no bound holds: the key names
        every item the block overlaps, and the descriptor keeps it whole (a mismatch must be a
        miss, never a near match). A limit within that of one entry refuses such a block: counted
        in num_rejected_puts, and said once (`_refuse`)."""
        import torch  # (the tier itself weighs only bytes)

        zeros = {name: torch.zeros(shape, dtype=dtype) for name, (dtype, shape) in tensors.items()}
        key = bytes(16)  # (an xxh3_128 content key)
        largest = BlockDescriptor(
            content_key=key.hex(),
            parent_key=key.hex(),
            num_computed_tokens=1 << 40,
            token_ids=((1 << 32) - 1,) * block_size,  # (uint32 ids)
            mm_identity="",
            tenant="0" * 16,
            **{f: getattr(cache, f) for f in _CACHE_FIELDS},
        )
        return len(entry.encode(key, largest, zeros))

    def expect_tensors(
        self, model_id: str, weights_version: str, layout_id: str, tensors: dict[str, tuple[object, tuple[int, ...]]]
    ) -> None:
        """Declare the tensors every block of (model_id, weights_version, layout_id) has:
        {name: (torch dtype, shape)}. An entry of that namespace whose tensors differ,
        checksums valid or not, is quarantined (a miss), never handed to the engine."""
        namespace = entry.namespace_of(model_id, weights_version, layout_id)
        self._expected[namespace] = entry.expected_layout(tensors)
        with self._lock:
            others = sum(ns != namespace for ns, _ in self._entries)
        if others == len(self._entries) > 0:
            # a directory filled by another model, weights, block size, KV dtype or layout: no hit can
            # come of it yet, and nothing but a hit rate of 0 said so. (Information: a
            # directory shared by several models is supported, this model's entries go beside.)
            # (the weights named: a directory of this model and layout under other weights read
            # "nothing of this model and layout", review 9)
            self._log(
                f"kvpool: disk cache {self.root}: nothing of this model, weights and layout there yet "
                f"({model_id}, weights {weights_version[:12]}, {layout_id}); its {others} entries are of other "
                "models or weights, block sizes, "
                f"KV dtypes or layouts, which never serve this one (`kvpool cache stats {self.root}` "
                "lists what it holds)"
            )

    def _check_layout(self, namespace: str, layout: dict[str, tuple[str, list[int]]]) -> None:
        entry.check_layout(layout, self._expected.get(namespace))

    @property
    def num_bytes(self) -> int:
        return self._num_bytes

    @property
    def num_entries(self) -> int:
        return len(self._entries)

    # ---- the index --------------------------------------------------------------------

    def _add(self, ident: tuple[str, bytes], found: _Entry) -> None:
        """Index an entry as the most recently used (lock held)."""
        self._drop(ident)
        self._entries[ident] = found
        self._keys[ident[1]] += 1
        self._num_bytes += found.num_bytes

    def _drop(self, ident: tuple[str, bytes]) -> _Entry | None:
        """Forget an entry (lock held)."""
        found = self._entries.pop(ident, None)
        if found is not None:
            self._num_bytes -= found.num_bytes
            self._keys[ident[1]] -= 1
            if not self._keys[ident[1]]:
                del self._keys[ident[1]]
        return found

    def _file_op(self, what: str, op: Callable[..., object], *args: object, timeout_s: float | None = None) -> _Outcome:
        """op(*args) on an entry's file: DONE; GONE when the file is not there (another
        process removed it: not this one's doing, not counted as such); FAILED when the OS
        refuses (a read-only disk, another user's file), counted in io_errors[what]; SILENT
        when it did not answer within `timeout_s` (the read deadline unless given), or the
        breaker is open (counted in timeouts[what])."""
        try:
            self._io(what, self.timeout_s if timeout_s is None else timeout_s, op, *args)
        except NoAnswer:
            return _Outcome.SILENT
        except FileNotFoundError:
            return _Outcome.GONE
        except OSError as error:
            self.io_errors[what] += 1
            self._say(what, error)
            return _Outcome.FAILED
        return _Outcome.DONE

    def _say(self, what: str, error: OSError, then: str = "") -> bool:
        """One line the first time `what` fails with this errno (True then): a fault that
        repeats is said once, and counted always. then: what the tier does about it."""
        name = errno.errorcode.get(error.errno, type(error).__name__) if error.errno else type(error).__name__
        if (what, name) in self._said:
            return False
        self._said.add((what, name))
        where = f": {error.filename}" if error.filename else ""
        if not then and what == "write" and self._tmp_gone():
            then = "the cache directory was removed under this process? blocks are not stored there"
        if not then and what == "trim":
            then = "the file stays in quarantine/, removed at a later quarantine once it can be"
        then = then or ("the block is not stored there" if what == "write" else "a miss")
        failed = f"{_WHAT.get(what, what)} failed ({name}: {error.strerror or error}{where})"
        self._log(
            f"kvpool: disk cache {self.root}: {failed}; "
            f"{then}, counted in the report's disk_tier; serving on (said once)"
        )
        return True

    def _tmp_gone(self) -> bool:
        """Whether tmp/ is gone (the cache directory removed under this process); False
        when the disk does not answer in time (it may be there)."""
        try:
            return not self._io("stat", self.timeout_s, os.path.isdir, self.root / "tmp")
        except NoAnswer:
            return False

    # ---- deadlines and the breaker ----------------------------------------------------

    def _io(self, what: str, timeout_s: float, fn: Callable[..., object], *args: object):
        """fn(*args), file I/O, on a deadline worker: its result or its exception; NoAnswer
        ("unavailable") at no cost while the breaker is open, NoAnswer("timeout") when it
        did not return within `timeout_s` (counted in timeouts[what]; what it returns late
        is dropped). An exception is an answer: the disk answered, the breaker's count of
        failures in a row starts again."""
        if self._unavailable():
            raise NoAnswer("unavailable", what)
        try:
            result = self._runner.call(what, timeout_s, fn, *args)
        except NoAnswer:
            self._silent(what, timeout_s)
            raise
        except BaseException:
            self._answered()
            raise
        self._answered()
        return result

    def _answered(self) -> None:
        if self._failures:
            with self._breaker_lock:
                self._failures = 0

    def _silent(self, what: str, timeout_s: float) -> None:
        """An operation past its deadline: counted; the breaker opens at the
        `breaker_failures`-th in a row, said in one line."""
        with self._breaker_lock:
            self.timeouts[what] += 1
            self._failures += 1
            if self._open_until is not None or self._failures < self.breaker_failures:
                return
            self._open_until = _now() + self.retry_s
            self.num_outages += 1
            failures = self._failures
        self._log(
            f"kvpool: disk cache {self.root}: {failures} operations in a row got no answer within their "
            f"deadline (the last {_WHAT.get(what, what)}, {timeout_s:g} s; a hung mount? an NFS server gone, a FUSE "
            "file system that stopped answering): serving without it, lookups are misses and writes are dropped, "
            "counted in the report's disk_tier (timeouts, misses.unavailable, unavailable_puts); asking "
            f"again every {self.retry_s:g} s"
        )

    def _unavailable(self) -> bool:
        """Whether the breaker is open (never waits). Open, once its cool-down has passed,
        one read of the marker file is started on a worker (never two at once: one still
        stuck holds the next back); a probe that answered within the read deadline (an
        error is an answer too: the disk is back, its faults are the usual misses) closes
        the breaker (said), one that answered late starts another cool-down."""
        if self._open_until is None:
            return False
        with self._breaker_lock:
            if self._open_until is None:
                return False
            probe = self._probe
            if probe is not None and probe.done.is_set():
                self._probe = None
                if probe.elapsed_s <= self.timeout_s:
                    self._open_until, self._failures = None, 0
                    back = True
                else:  # (a late answer is no answer: the disk may hang again at once)
                    self._open_until = _now() + self.retry_s
                    back = False
            elif probe is None and _now() >= self._open_until:
                self._probe = self._runner.start(_read_marker, self.root / MARKER)
                return True
            else:
                return True
        if not back:
            return True
        self._log(
            f"kvpool: disk cache {self.root} answers again (its marker read within {self.timeout_s:g} s): "
            "serving from it"
        )
        return False

    @property
    def available(self) -> bool:
        """Whether the breaker is closed (no probe started, no wait)."""
        return self._open_until is None

    def _evict_over_limit(self) -> list[tuple[tuple[str, bytes], _Entry]]:
        """Drop least recently used entries from the index down to the limit (lock held):
        the victims, whose files `_remove_evicted` unlinks once the lock is released."""
        victims = []
        while self._num_bytes > self.capacity_bytes and self._entries:
            ident, old = next(iter(self._entries.items()))
            self._drop(ident)  # (forgotten even when the unlink fails: the loop ends)
            self._removing.add(ident)
            victims.append((ident, old))
        self._found_over = False
        return victims

    def _remove_evicted(
        self, victims: list[tuple[tuple[str, bytes], _Entry]], counted: bool = True, timeout_s: float | None = None
    ) -> _Removed:
        """Unlink the files of entries `_evict_over_limit` dropped (lock not held: lookups
        go on, and find those entries absent). Only the files this process removed count as
        its evictions (unless not `counted`: `evict`'s). timeout_s: each unlink's deadline
        (the writer's thread: the write deadline; the engine's, `evict`: the read one)."""
        timeout_s = self.write_timeout_s if timeout_s is None else timeout_s
        outcomes = [self._file_op("evict", old.path.unlink, timeout_s=timeout_s) for _, old in victims]
        with self._lock:
            self._removing.difference_update(ident for ident, _ in victims)
            self.stats.num_evictions += outcomes.count(_Outcome.DONE) if counted else 0
        return _Removed(
            sum(old.num_bytes for (_, old), done in zip(victims, outcomes, strict=True) if done is _Outcome.DONE),
            sum(old.num_bytes for (_, old), done in zip(victims, outcomes, strict=True) if done is _Outcome.GONE),
        )

    def _quarantine(self, ident: tuple[str, bytes], found: _Entry) -> None:
        """Move a bad entry aside (lock held): counted, a miss from now on."""
        self._drop(ident)
        at_ns = time.time_ns()
        target = self.root / "quarantine" / f"{found.path.stem}.{at_ns}{SUFFIX}"
        # a read-only disk: it stays, a miss each time it is met; gone: another process
        # moved or removed it first
        if self._file_op("quarantine", os.replace, found.path, target) is _Outcome.DONE:
            try:  # (the file moved, maybe not the one indexed)
                num_bytes = self._io("quarantine", self.timeout_s, os.stat, target).st_size
            except (OSError, NoAnswer):
                num_bytes = found.num_bytes
            self._quarantined.append(_Quarantined(at_ns, num_bytes, target))
            self._quarantine_bytes += num_bytes
            self._trim_quarantine()
        self.stats.num_corrupt += 1
        self.stats.misses["corrupt"] += 1

    def _trim_quarantine(self) -> None:
        """Keep quarantine/ within 1/32 of the byte limit (the newest file always): bad
        entries are kept to be looked at, not to fill the disk outside the limit, which a
        disk that keeps corrupting entries did (lock held). From the list kept since the
        open, oldest first; a file another process removed meanwhile (`kvpool cache clear
        --quarantine`) is dropped from it, not counted."""
        while len(self._quarantined) > 1 and self._quarantine_bytes > self.rescan_bytes:
            oldest = self._quarantined[0]
            done = self._file_op("trim", oldest.path.unlink)
            if done in (_Outcome.FAILED, _Outcome.SILENT):
                return  # (said once, or a timeout counted; tried again at the next quarantine)
            self._quarantined.popleft()
            self._quarantine_bytes -= oldest.num_bytes
            if done is _Outcome.DONE:
                self.num_quarantine_trimmed += 1

    def _reclaim(self, ident: tuple[str, bytes], found: _Entry, differ: list[str]) -> None:
        self.stats.mismatches.update(differ)
        self.stats.misses["mismatch"] += 1
        self._drop(ident)
        if self._file_op("reclaim", found.path.unlink) is _Outcome.DONE:
            self.stats.num_reclaimed += 1

    def _failed(self, ident: tuple[str, bytes], found: _Entry, error: Exception, op: str) -> None:
        """A lookup or get that met `error` reading the entry: the miss it is (lock held)."""
        if isinstance(error, FileNotFoundError):
            self._drop(ident)
            self.stats.misses["absent"] += 1
        elif isinstance(error, entry.CorruptEntry):
            self._quarantine(ident, found)
        elif isinstance(error, entry.OtherVersion):
            found.descriptor, found.verified = None, False
            self.stats.misses["other_version"] += 1  # left to its writer; the LRU ages it out
        else:
            self.io_errors[op] += 1
            self.stats.misses["io_error"] += 1
            if isinstance(error, OSError):
                self._say(op, error)

    def _checked(
        self, key: bytes, expected: BlockDescriptor, whole: bool = False
    ) -> tuple[_Entry, _Read | None] | None:
        """The entry, its descriptor checked against `expected` (lock held), and what the read
        of its file came to (None: a lookup of an entry whose descriptor was known, no I/O). A
        lookup reads the header of an entry not yet read here (one not yet indexed: another
        process's, written since the scan); a get (`whole`) the whole entry, its LRU time
        refreshed: one worker job either way (`_read_entry`), under one deadline. A miss (counted)
        while the breaker is open, at no cost, and when the disk does not answer in time."""
        if self._unavailable():
            self.stats.misses["unavailable"] += 1
            return None
        ident = self._id(key, expected)
        found = self._entries.get(ident)
        if found is None and ident in self._removing:  # (evicted, its unlink under way)
            self.stats.misses["absent"] += 1
            return None
        if found is not None and found.descriptor is not None:
            differ = found.descriptor.mismatches(expected)
            if differ:
                self._reclaim(ident, found, differ)
                return None
            if not whole:
                self._entries.move_to_end(ident)
                return found, None
        path = found.path if found is not None else self._path(key, expected)
        layout = self._expected.get(ident[0])
        try:
            read = self._io("read", self.timeout_s, _read_entry, path, key, expected, layout, whole)
        except NoAnswer as silent:  # (what the read returns late is dropped: never installed)
            self.stats.misses[silent.cause] += 1
            return None
        except FileNotFoundError:
            self._drop(ident)
            self.stats.misses["absent"] += 1
            return None
        except OSError as error:  # the open refused: a file where a directory should be, no permission
            self._failed(ident, found, error, "read")
            return None
        assert read.st is not None  # (set whenever the open answered)
        if found is None or found.inode != read.st.st_ino or found.num_bytes != read.st.st_size:
            found = _Entry(path, read.st.st_size, None, read.st.st_ino)  # (new here, or rewritten by another process)
            self._add(ident, found)
            self._found_over = self._found_over or self._num_bytes > self.capacity_bytes
        if read.error is not None:
            self._failed(ident, found, read.error, "read")
            return None
        found.descriptor = read.descriptor  # (set wherever the read ended without an error)
        assert found.descriptor is not None
        differ = read.differ if whole else found.descriptor.mismatches(expected)
        if differ:
            self._reclaim(ident, found, differ)
            return None
        self._entries.move_to_end(ident)
        return found, read

    # ---- the interface ----------------------------------------------------------------

    def contains(self, key: bytes) -> bool:
        return key in self._keys

    def holds(self, key: bytes, descriptor: BlockDescriptor) -> bool:
        found = self._entries.get(self._id(key, descriptor))
        return found is not None and found.verified and found.descriptor == descriptor

    def lookup(self, key: bytes, expected: BlockDescriptor) -> bool:
        with self._lock:
            self.stats.num_lookups += 1
            found = self._checked(key, expected) is not None
            self.stats.num_lookup_hits += found
        return found

    def get(self, key: bytes, expected: BlockDescriptor) -> dict[str, Tensor] | None:
        start = time.perf_counter()
        with self._lock:
            checked = self._checked(key, expected, whole=True)
            if checked is None:
                self.stats.num_get_misses += 1
                return None
            found, read = checked
            assert read is not None and read.tensors is not None  # (a get's read: the whole entry)
            found.verified = True
            if read.refresh_error is not None:  # entries of another user, a read-only disk: still a hit
                self.io_errors["utime"] += 1
                self._say("utime", read.refresh_error)
            self.stats.num_gets += 1
            self.stats.num_get_bytes += read.num_bytes
        self.stats.get_s += time.perf_counter() - start
        return read.tensors

    def put(self, key: bytes, descriptor: BlockDescriptor, tensors: dict[str, Tensor]) -> bool:
        num_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
        if num_bytes > self.capacity_bytes:
            self._refuse(num_bytes, descriptor)
            return False
        if self._unavailable():  # the breaker open: dropped, counted
            self.stats.num_dropped_puts += 1
            self.num_unavailable_puts += 1
            return False
        owned = {name: t.detach().to("cpu", copy=True) for name, t in tensors.items()}
        if not self._writer.submit(lambda: self._write(key, descriptor, owned), num_bytes):
            self.stats.num_dropped_puts += 1
            return False
        return True

    def _stage(self, name: str) -> None:
        if self.fault_hook is not None:
            self.fault_hook(name)

    def _write(self, key: bytes, descriptor: BlockDescriptor, tensors: dict[str, Tensor]) -> None:
        start = time.perf_counter()
        if self._unavailable():  # (queued before the breaker opened)
            self.stats.num_dropped_puts += 1
            self.num_unavailable_puts += 1
            return
        data = entry.encode(key, descriptor, tensors)
        if len(data) > self.capacity_bytes:
            # the header made the entry larger than the whole tier (put weighs the tensors
            # alone): written, it would evict every entry and then itself
            self._refuse(len(data), descriptor)
            return
        if self._cut_pending:
            self._cut_to_limit()
        final = self._path(key, descriptor)
        gate = _Gate(lambda inode: self._landed_late(key, descriptor, final, len(data), inode))
        try:
            inode = self._store_making_room(key, data, final, gate)
        except NoAnswer as silent:
            with self._lock:  # (before a late landing's _landed_late, which takes the lock)
                # its temp file removed when the write gets there, never renamed in; or, its
                # rename begun, indexed when it lands (_landed_late); or landed meanwhile
                landed = gate.abandon()
                if landed is None and silent.cause == "unavailable":
                    self.stats.num_dropped_puts += 1
                    self.num_unavailable_puts += 1
                elif landed is None:
                    self.stats.num_write_errors += 1  # (and timeouts["write"])
            if landed is None:
                return
            inode = landed
        except OSError as error:
            self.stats.num_write_errors += 1
            if error.errno in _FULL and self._no_room_until:
                return  # (said when making room stopped)
            if self._say("write", error) and self._tmp_gone():
                # the directory removed under us: index what is left (nothing, usually), so
                # that the report and the lookups stop counting the removed entries
                self._rescan()
            return
        with self._lock:
            self._add(self._id(key, descriptor), _Entry(final, len(data), descriptor, inode, verified=True))
            self.stats.num_puts += 1
            self.stats.num_put_bytes += len(data)
            victims = self._evict_over_limit()
            self._written_since_scan += len(data)
            rescan = self._written_since_scan >= self.rescan_bytes
        self._remove_evicted(victims)
        if rescan:  # (on the writer's thread, off the engine's path)
            self._rescan()
        self.stats.put_s += time.perf_counter() - start

    def _landed_late(self, key: bytes, descriptor: BlockDescriptor, final: Path, num_bytes: int, inode: int) -> None:
        """A write whose writer gave up on it (past its deadline, counted in num_write_errors)
        landed all the same, its rename begun before: indexed now, as `_write` indexes one, its
        write error taken back (timeouts["write"] keeps it). On the write's worker thread."""
        with self._lock:
            self.stats.num_write_errors -= 1
            self._add(self._id(key, descriptor), _Entry(final, num_bytes, descriptor, inode, verified=True))
            self.stats.num_puts += 1
            self.stats.num_put_bytes += num_bytes
            victims = self._evict_over_limit()
            self._written_since_scan += num_bytes
        self._remove_evicted(victims)

    def _refuse(self, num_bytes: int, descriptor: BlockDescriptor) -> None:
        """A block whose entry (`num_bytes`) the whole limit cannot hold: counted, and said
        once (check_sizes refuses a limit below a text block's entry at the start; a
        multimodal block's key can take its entry past that bound: entry_bytes)."""
        self.stats.num_rejected_puts += 1
        if ("refused", "") in self._said:
            return
        self._said.add(("refused", ""))
        key = (
            f" (its multimodal key adds {len(descriptor.mm_identity):,} bytes to its header)"
            if descriptor.mm_identity
            else ""
        )
        self._log(
            f"kvpool: disk cache {self.root}: a block's entry of {num_bytes:,} bytes{key} is larger than the "
            f"whole byte limit ({self.capacity_bytes:,} bytes, --disk-cache-gib {self.capacity_bytes / 2**30:.4g}); "
            "such blocks are not stored, counted in the report's disk_tier.num_rejected_puts; serving on (said once)"
        )

    def _store_making_room(self, key: bytes, data: bytes, final: Path, gate: _Gate) -> int:
        """`_store`, and on a full filesystem, room made and the write tried once more (a
        full filesystem is a byte limit too). When that write finds it full again, the
        evictions freed nothing it could use (an entry file held open by another process,
        the quota of another user whose entries they were, another writer taking the space
        first): making room stops, the entries kept, until a write succeeds or the back-off
        ends (it drained the whole tier, one entry a write, and stored nothing)."""
        store = self._store
        try:
            inode = self._io("write", self.write_timeout_s, store, key, data, final, gate)
        except OSError as error:
            if error.errno not in _FULL or _now() < self._no_room_until or not self._make_room(len(data), error):
                raise
            try:
                inode = self._io("write", self.write_timeout_s, store, key, data, final, gate)
            except OSError as again:
                if again.errno in _FULL:
                    self._stop_making_room(again)
                raise
        self._no_room_until, self._no_room_backoff_s = 0.0, _NO_ROOM_BACKOFF_S
        return inode

    def _stop_making_room(self, error: OSError) -> None:
        episode = self._no_room_until == 0.0  # (reset by the next write that succeeds)
        self.num_no_room += 1
        now, backoff = _now(), self._no_room_backoff_s
        self._no_room_until = now + backoff
        self._no_room_backoff_s = min(2 * backoff, _NO_ROOM_BACKOFF_MAX_S)
        if not episode:
            return  # (said when it began: one line an episode, however long)
        if now < self._no_room_quiet_until:
            self._no_room_unsaid += 1  # a flapping disk: told in the next line
            return
        if now >= self._no_room_quiet_until + _NO_ROOM_BACKOFF_MAX_S:
            self._no_room_quiet_s = _NO_ROOM_BACKOFF_S  # (an hour without a line due: quiet again)
        self._no_room_quiet_until = now + self._no_room_quiet_s
        self._no_room_quiet_s = min(2 * self._no_room_quiet_s, _NO_ROOM_BACKOFF_MAX_S)
        name = errno.errorcode.get(error.errno, type(error).__name__) if error.errno else type(error).__name__
        unsaid = (
            f"; {self._no_room_unsaid} more since the last line, each ended by a write" if self._no_room_unsaid else ""
        )
        self._no_room_unsaid = 0
        self._log(
            f"kvpool: disk cache {self.root}: {_WHAT['no room']} failed ({name}: {error.strerror or error}); "
            "evicting entries freed no room for the block (their files held open by another "
            "process? another user's quota? another writer?): the tier keeps its entries and "
            f"evicts none to make room until a write succeeds, or for {backoff:g} s, then twice as long "
            f"each time up to {_NO_ROOM_BACKOFF_MAX_S / 3600:g} h; the blocks that do not fit are not stored, "
            f"counted in the report's disk_tier.disk_full_no_room (said once an episode{unsaid})"
        )

    def _make_room(self, num_bytes: int, error: OSError) -> bool:
        """The filesystem is full (`error`): evict least recently used entries until
        `num_bytes` are freed; whether any was. In rounds: victims chosen under the lock for
        the bytes still missing, unlinked outside it; a victim whose unlink the OS refuses
        (EACCES: another user's entry) frees nothing, and the next round chooses more
        (review 9: its bytes counted as freed, two such victims refused the write)."""
        freed = 0
        while freed < num_bytes:
            victims: list[tuple[tuple[str, bytes], _Entry]] = []
            chosen = 0
            with self._lock:
                while freed + chosen < num_bytes and self._entries:
                    ident, old = next(iter(self._entries.items()))
                    self._drop(ident)  # (forgotten even when its unlink fails: each round takes new ones)
                    self._removing.add(ident)
                    victims.append((ident, old))
                    chosen += old.num_bytes
            if not victims:  # (none left to evict)
                break
            removed = self._remove_evicted(victims)
            freed += removed.num_bytes + removed.num_gone_bytes  # (gone meanwhile: room all the same)
        if freed:
            self.num_full += 1
            self._say(
                "full", error, "evicting least recently used entries to make room (it fills before the byte limit)"
            )
        return freed > 0

    def _store(self, key: bytes, data: bytes, final: Path, gate: _Gate | None = None) -> int:
        """Write `data` to `final` through a temp file (module docstring): its inode. The
        OSError of a refused write, its temp file removed; so is a write whose writer gave
        up on it before its rename (`gate`: past its deadline, never installed). On a
        deadline worker: no lock."""
        tmp = self.root / "tmp" / temp_file_name(key, next(self._tmp_names))
        try:
            self._stage("open")
            # non-blocking: a FIFO at the temp file's path is an error (ENXIO), not a hang
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NONBLOCK, 0o666)
            with os.fdopen(fd, "wb") as f:
                if not stat.S_ISREG(os.fstat(fd).st_mode):
                    raise OSError(errno.EEXIST, "not a regular file", str(tmp))
                for at in range(0, len(data), _CHUNK):
                    f.write(data[at : at + _CHUNK])
                    f.flush()
                    self._stage(f"wrote {min(at + _CHUNK, len(data))}")
                if self.fsync:
                    os.fsync(f.fileno())
                self._stage("synced")
            final.parent.mkdir(parents=True, exist_ok=True)
            if gate is not None and not gate.commit():
                raise OSError(errno.ETIMEDOUT, "past its deadline, the write was given up: not installed", str(final))
            os.replace(tmp, final)
            self._stage("renamed")
            if self.fsync:
                fsync_path(final.parent)
            self._stage("dir synced")
            inode = os.stat(final).st_ino
        except OSError:
            try:
                tmp.unlink()
            except OSError:  # not there, or not ours to remove (a directory, a read-only disk)
                pass
            raise
        if gate is not None:
            gate.landed(inode)  # (its writer gave up meanwhile: indexed now)
        return inode

    def evict(self, key: bytes) -> bool:
        """Drop the entries of `key` (under every namespace this process knows), as the LRU
        drops its victims: marked `_removing` until their files are unlinked outside the lock,
        so that a lookup meanwhile is a miss, not an entry indexed again from its file (review
        9). Not counted in num_evictions, which counts what the byte limit pushed out."""
        with self._lock:
            victims = [(ident, self._entries[ident]) for ident in self._entries if ident[1] == key]
            for ident, _ in victims:
                self._drop(ident)
                self._removing.add(ident)
        self._remove_evicted(victims, counted=False, timeout_s=self.timeout_s)  # (the engine's thread)
        return bool(victims)

    def flush(self, timeout: float | None = None) -> bool:
        return self._writer.flush(timeout)

    def close(self) -> None:
        self._writer.close()

    @property
    def pending_bytes(self) -> int:
        return self._writer.pending_bytes

    def report(self) -> dict[str, object]:
        return {
            "directory": str(self.root),
            "capacity_bytes": self.capacity_bytes,
            "bytes_used": self._num_bytes,
            "entries": len(self._entries),
            "pending_bytes": self._writer.pending_bytes,
            "stale_tmp_removed": self.num_stale_tmp_removed,
            "quarantine_trimmed": self.num_quarantine_trimmed,
            "disk_full": self.num_full,  # writes that found the filesystem full and evicted to make room
            "disk_full_no_room": self.num_no_room,  # ... and found it full again: making room paused
            "available": self._open_until is None,  # the breaker closed
            "outages": self.num_outages,  # times it opened (operations in a row past their deadline)
            "timeouts": dict(sorted(self.timeouts.items())),  # operations past their deadline, by what
            "stuck_io": self._runner.num_stuck,  # ... still not returned (each holds a thread)
            "unavailable_puts": self.num_unavailable_puts,  # writes dropped while it was open
            "timeout_s": self.timeout_s,
            "write_timeout_s": self.write_timeout_s,
            **self.stats.as_dict(),
            "io_errors": dict(sorted(self.io_errors.items())),
        }

    def check_integrity(self) -> None:
        with self._lock:
            total = sum(e.num_bytes for e in self._entries.values())
            # (over the limit only while the open's cut waits for the first write, _cut_to_limit,
            # or the next write's eviction, after a lookup indexed what it found: _found_over)
            over = total > self.capacity_bytes and not (self._cut_pending or self._found_over)
            if total != self._num_bytes or over:
                raise AssertionError(
                    f"disk tier: {total} B indexed, {self._num_bytes} B counted, {self.capacity_bytes} B limit"
                )
            if self._removing & self._entries.keys():
                raise AssertionError(f"disk tier: {len(self._removing & self._entries.keys())} evicted entries indexed")
            for (ns, key), found in self._entries.items():
                if found.path.name != f"{key.hex()}{SUFFIX}" or found.path.parent.parent.name != ns:
                    raise AssertionError(f"disk tier: {ns}/{key.hex()} indexed at {found.path}")
            if sum(self._keys.values()) != len(self._entries):
                raise AssertionError(
                    f"disk tier: {sum(self._keys.values())} keys counted, {len(self._entries)} entries"
                )
        with self._breaker_lock:
            if self._open_until is None and self._probe is not None:
                raise AssertionError("disk tier: a probe in flight with the breaker closed")
            if self._open_until is None and self._failures >= self.breaker_failures:
                raise AssertionError(f"disk tier: {self._failures} failures in a row and the breaker closed")
