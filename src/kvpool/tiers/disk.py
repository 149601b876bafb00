"""The disk tier: a crash-safe prefix cache in a directory, shared by every process that
opens it.

    DIR/kvpool-disk-cache                     marker (format), written when the cache is made
    DIR/entries/<namespace>/<kk>/<key>.safetensors   one block: tensors + manifest (entry.py)
    DIR/tmp/<key>.<pid>.<n>.tmp               writes in progress
    DIR/quarantine/<key>.<ns>.safetensors     entries whose bytes did not check out

Writes (SQLite's discipline): the entry goes to a temp file of a unique name, is fsynced,
renamed onto its final name (atomic on POSIX), and the directory is fsynced. A reader
sees the old entry or the new one, never a torn one; a writer killed at any point leaves
at most a temp file, which the next process to open the cache removes once its writer is
dead. Two processes writing the same entry both rename whole files: the last one wins.

Reads check the manifest's checksum and every tensor's (entry.py): a corrupted or
truncated entry is moved to quarantine/, counted, and is a miss. A descriptor that does
not match the caller's is a miss counted under each differing field, and the entry is
deleted (reclaimed): after a weights switch, the old entries go as they are met, and the
LRU limit ages out the rest.

The byte limit is LRU over the entries this process knows (the directory's at open, by
modification time, then its own writes and the entries it finds); a hit refreshes an
entry's modification time so that the order carries over to the next process. Several
processes on one directory each enforce the limit on what they know, so together they
may briefly hold more.

Writes run on a background writer (writer.py): `put` encodes nothing and never waits; a
full queue drops the write and counts it.
"""

from __future__ import annotations

import itertools
import os
import threading
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass
from pathlib import Path

from torch import Tensor

from kvpool.tiers import entry
from kvpool.tiers.base import Tier, TierStats
from kvpool.tiers.descriptor import BlockDescriptor
from kvpool.tiers.writer import BackgroundWriter

MARKER = "kvpool-disk-cache"
SUFFIX = ".safetensors"
_CHUNK = 1 << 20


@dataclass
class _Entry:
    path: Path
    num_bytes: int
    descriptor: BlockDescriptor | None  # known once read or written by this process


def _fsync_dir(path: Path) -> None:
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


def open_directory(directory: str | os.PathLike) -> Path:
    """The cache directory, created if absent; ValueError naming the problem when it is a
    file, is not writable, or is a directory that holds something other than a cache."""
    root = Path(directory).expanduser()
    if root.exists() and not root.is_dir():
        raise ValueError(f"disk cache {str(root)!r} is a file, not a directory")
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise ValueError(f"disk cache {str(root)!r} cannot be created: {error.strerror}") from None
    marker = root / MARKER
    if not marker.exists():
        if any(p.name not in ("entries", "tmp", "quarantine") for p in root.iterdir()):
            raise ValueError(f"disk cache {str(root)!r} is a directory with other files in it (not a kvpool cache)")
        try:
            marker.write_text(f"kvpool disk cache, entry format {entry.FORMAT}\n")
        except OSError as error:
            raise ValueError(f"disk cache {str(root)!r} is not writable: {error.strerror}") from None
    for sub in ("entries", "tmp", "quarantine"):
        try:
            (root / sub).mkdir(exist_ok=True)
        except OSError as error:
            raise ValueError(f"disk cache {str(root)!r} is not writable: {error.strerror}") from None
    if not os.access(root / "tmp", os.W_OK | os.X_OK) or not os.access(root / "entries", os.W_OK | os.X_OK):
        raise ValueError(f"disk cache {str(root)!r} is not writable")
    return root


def scan_entries(root: Path) -> list[tuple[Path, os.stat_result]]:
    """Every entry file under root/entries, least recently used (modified) first."""
    found = []
    for path in (root / "entries").glob(f"*/*/*{SUFFIX}"):
        try:
            found.append((path, path.stat()))
        except FileNotFoundError:  # another process evicted it meanwhile
            continue
    found.sort(key=lambda item: item[1].st_mtime_ns)
    return found


class DiskTier(Tier):
    name = "disk"

    def __init__(
        self,
        directory: str | os.PathLike,
        capacity_bytes: int,
        *,
        max_pending_bytes: int = 64 << 20,
        fsync: bool = True,
    ) -> None:
        """capacity_bytes: the LRU byte limit of the entry files. max_pending_bytes: the
        background writer's queue bound. fsync: off only for benchmarks of the unsafe rate."""
        if isinstance(capacity_bytes, bool) or not isinstance(capacity_bytes, int) or capacity_bytes <= 0:
            raise ValueError(f"disk tier capacity must be a positive number of bytes, got {capacity_bytes!r}")
        self.root = open_directory(directory)
        self.capacity_bytes = capacity_bytes
        self.fsync = fsync
        self.stats = TierStats()
        self._lock = threading.Lock()
        # (namespace, content key) -> entry, LRU first; blocks of the same tokens under two
        # models are two entries. _keys counts each content key's namespaces (contains()).
        self._entries: OrderedDict[tuple[str, bytes], _Entry] = OrderedDict()
        self._keys: Counter[bytes] = Counter()
        self._num_bytes = 0
        self._tmp_names = itertools.count()
        self._writer = BackgroundWriter("disk", max_pending_bytes)
        self.num_stale_tmp_removed = self._remove_stale_tmp()
        for path, st in scan_entries(self.root):
            try:
                key = bytes.fromhex(path.name.removesuffix(SUFFIX))
            except ValueError:
                continue
            self._add((path.parent.parent.name, key), _Entry(path, st.st_size, None))
        with self._lock:
            self._evict_over_limit()
        # a crash test stops the writer here (the stage's name); None in normal use
        self.fault_hook = None

    # ---- layout -----------------------------------------------------------------------

    def _path(self, key: bytes, descriptor: BlockDescriptor) -> Path:
        hexkey = key.hex()
        return self.root / "entries" / entry.namespace(descriptor) / hexkey[:2] / f"{hexkey}{SUFFIX}"

    @staticmethod
    def _id(key: bytes, descriptor: BlockDescriptor) -> tuple[str, bytes]:
        return entry.namespace(descriptor), key

    def _remove_stale_tmp(self) -> int:
        """Temp files of writers that are gone (killed mid-write): removed."""
        removed = 0
        for path in (self.root / "tmp").glob("*.tmp"):
            parts = path.name.split(".")
            try:
                pid = int(parts[-3])
            except (IndexError, ValueError):
                pid = -1
            if pid != os.getpid() and (pid <= 0 or not _pid_alive(pid)):
                try:
                    path.unlink()
                    removed += 1
                except FileNotFoundError:
                    pass
        return removed

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

    def _evict_over_limit(self) -> None:
        while self._num_bytes > self.capacity_bytes and self._entries:
            ident, old = next(iter(self._entries.items()))
            self._drop(ident)
            try:
                old.path.unlink()
            except FileNotFoundError:
                pass
            self.stats.num_evictions += 1

    def _find(self, ident: tuple[str, bytes], expected: BlockDescriptor) -> _Entry | None:
        """The entry, known or just written by another process (lock held)."""
        found = self._entries.get(ident)
        if found is None:
            path = self._path(ident[1], expected)
            try:
                size = path.stat().st_size
            except FileNotFoundError:
                return None
            found = _Entry(path, size, None)
            self._add(ident, found)
        return found

    def _quarantine(self, ident: tuple[str, bytes], found: _Entry) -> None:
        """Move a bad entry aside (lock held): counted, a miss from now on."""
        self._drop(ident)
        target = self.root / "quarantine" / f"{found.path.stem}.{time.time_ns()}{SUFFIX}"
        try:
            os.replace(found.path, target)
        except FileNotFoundError:
            pass
        self.stats.num_corrupt += 1
        self.stats.misses["corrupt"] += 1

    def _reclaim(self, ident: tuple[str, bytes], found: _Entry, differ: list[str]) -> None:
        self.stats.mismatches.update(differ)
        self.stats.misses["mismatch"] += 1
        self._drop(ident)
        try:
            found.path.unlink()
        except FileNotFoundError:
            pass
        self.stats.num_reclaimed += 1

    def _header(self, found: _Entry, key: bytes) -> BlockDescriptor:
        with open(found.path, "rb") as f:
            n = entry.header_length(f.read(8))
            header = f.read(n)
        if len(header) < n:
            raise entry.CorruptEntry(f"entry of {found.num_bytes} bytes is shorter than its header")
        return entry.read_header(header, key)[0]

    def _checked(self, key: bytes, expected: BlockDescriptor) -> _Entry | None:
        """The entry, its descriptor checked against `expected` (lock held)."""
        ident = self._id(key, expected)
        found = self._find(ident, expected)
        if found is None:
            self.stats.misses["absent"] += 1
            return None
        if found.descriptor is None:
            try:
                found.descriptor = self._header(found, key)
            except FileNotFoundError:
                self._drop(ident)
                self.stats.misses["absent"] += 1
                return None
            except entry.CorruptEntry:
                self._quarantine(ident, found)
                return None
        differ = found.descriptor.mismatches(expected)
        if differ:
            self._reclaim(ident, found, differ)
            return None
        self._entries.move_to_end(ident)
        return found

    # ---- the interface ----------------------------------------------------------------

    def contains(self, key: bytes) -> bool:
        return key in self._keys

    def holds(self, key: bytes, descriptor: BlockDescriptor) -> bool:
        found = self._entries.get(self._id(key, descriptor))
        return found is not None and found.descriptor == descriptor

    def lookup(self, key: bytes, expected: BlockDescriptor) -> bool:
        with self._lock:
            self.stats.num_lookups += 1
            found = self._checked(key, expected) is not None
            self.stats.num_lookup_hits += found
        return found

    def get(self, key: bytes, expected: BlockDescriptor) -> dict[str, Tensor] | None:
        start = time.perf_counter()
        ident = self._id(key, expected)
        with self._lock:
            found = self._checked(key, expected)
            if found is None:
                self.stats.num_get_misses += 1
                return None
            try:
                data = found.path.read_bytes()
                descriptor, tensors = entry.decode(data, key)
            except FileNotFoundError:
                self._drop(ident)
                self.stats.misses["absent"] += 1
                self.stats.num_get_misses += 1
                return None
            except entry.CorruptEntry:
                self._quarantine(ident, found)
                self.stats.num_get_misses += 1
                return None
            if descriptor != found.descriptor:  # rewritten by another process since the header was read
                differ = descriptor.mismatches(expected)
                if differ:
                    self._reclaim(ident, found, differ)
                    self.stats.num_get_misses += 1
                    return None
                found.descriptor = descriptor
            try:
                os.utime(found.path)  # the LRU order, for the next process
            except FileNotFoundError:
                pass
            self.stats.num_gets += 1
            self.stats.num_get_bytes += len(data)
        self.stats.get_s += time.perf_counter() - start
        return tensors

    def put(self, key: bytes, descriptor: BlockDescriptor, tensors: dict[str, Tensor]) -> bool:
        num_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
        if num_bytes > self.capacity_bytes:
            self.stats.num_rejected_puts += 1
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
        data = entry.encode(key, descriptor, tensors)
        final = self._path(key, descriptor)
        tmp = self.root / "tmp" / f"{key.hex()}.{os.getpid()}.{next(self._tmp_names)}.tmp"
        try:
            self._stage("open")
            with open(tmp, "wb") as f:
                for at in range(0, len(data), _CHUNK):
                    f.write(data[at : at + _CHUNK])
                    f.flush()
                    self._stage(f"wrote {min(at + _CHUNK, len(data))}")
                if self.fsync:
                    os.fsync(f.fileno())
                self._stage("synced")
            final.parent.mkdir(parents=True, exist_ok=True)
            os.replace(tmp, final)
            self._stage("renamed")
            if self.fsync:
                _fsync_dir(final.parent)
            self._stage("dir synced")
        except OSError:
            self.stats.num_write_errors += 1
            try:
                tmp.unlink()
            except FileNotFoundError:
                pass
            return
        with self._lock:
            self._add(self._id(key, descriptor), _Entry(final, len(data), descriptor))
            self.stats.num_puts += 1
            self.stats.num_put_bytes += len(data)
            self._evict_over_limit()
            self.stats.put_s += time.perf_counter() - start

    def evict(self, key: bytes) -> bool:
        """Drop the entries of `key` (under every namespace this process knows)."""
        with self._lock:
            dropped = [self._drop(ident) for ident in [i for i in self._entries if i[1] == key]]
        for found in dropped:
            try:
                found.path.unlink()
            except FileNotFoundError:
                pass
        return bool(dropped)

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
            **self.stats.as_dict(),
        }

    def check_integrity(self) -> None:
        with self._lock:
            total = sum(e.num_bytes for e in self._entries.values())
            if total != self._num_bytes or total > self.capacity_bytes:
                raise AssertionError(
                    f"disk tier: {total} B indexed, {self._num_bytes} B counted, {self.capacity_bytes} B limit"
                )
            for (ns, key), found in self._entries.items():
                if found.path.name != f"{key.hex()}{SUFFIX}" or found.path.parent.parent.name != ns:
                    raise AssertionError(f"disk tier: {ns}/{key.hex()} indexed at {found.path}")
            if sum(self._keys.values()) != len(self._entries):
                raise AssertionError(
                    f"disk tier: {sum(self._keys.values())} keys counted, {len(self._entries)} entries"
                )


@dataclass(frozen=True)
class EntryInfo:
    path: Path
    num_bytes: int
    mtime_ns: int
    descriptor: BlockDescriptor | None  # None: the header does not check out
    problem: str  # "" or why the header is bad


def existing_cache(directory: str | os.PathLike) -> Path:
    """A directory that holds a kvpool disk cache (nothing is created); ValueError otherwise."""
    root = Path(directory).expanduser()
    if not root.exists():
        raise ValueError(f"disk cache {str(root)!r} does not exist")
    if not root.is_dir():
        raise ValueError(f"disk cache {str(root)!r} is a file, not a directory")
    if not (root / MARKER).exists():
        raise ValueError(f"{str(root)!r} is not a kvpool disk cache (no {MARKER} marker)")
    return root


def inspect_cache(root: Path) -> list[EntryInfo]:
    """Every entry's header, read without changing anything, least recently used first."""
    out = []
    for path, st in scan_entries(root):
        try:
            key = bytes.fromhex(path.name.removesuffix(SUFFIX))
            with open(path, "rb") as f:
                n = entry.header_length(f.read(8))
                descriptor, problem = entry.read_header(f.read(n), key)[0], ""
        except (ValueError, OSError) as error:  # CorruptEntry is a ValueError
            descriptor, problem = None, str(error)
        out.append(EntryInfo(path, st.st_size, st.st_mtime_ns, descriptor, problem))
    return out
