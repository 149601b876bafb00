"""The Redis tier: blocks in a shared `redis-server`, so that engine processes hit each
other's prefixes.

Each block is one Redis hash under

    kvpool:<namespace>:<tenant>:<content key>     (namespace: entry.namespace, the model and layout)

with two fields: `m`, the entry's header (safetensors header with the manifest and its
checksum, entry.py), read by a lookup to check the descriptor without moving the tensors;
and `d`, the whole entry, read by a get and checked tensor by tensor. A bad entry is a
counted miss and is deleted; a descriptor that does not match is a miss counted by field
and is deleted (reclaimed). The server's own memory limit and eviction policy bound it.

Writes go through a background writer like the disk tier's. The client has short
timeouts: when the server cannot be reached, the tier prints one warning line, answers
misses without trying for `retry_s`, then tries again; the first call that succeeds prints
that it is back. The engine keeps serving throughout.
"""

from __future__ import annotations

import sys
import threading
import time
from urllib.parse import urlsplit

import redis
from torch import Tensor

from kvpool.tiers import entry
from kvpool.tiers.base import Tier, TierStats
from kvpool.tiers.descriptor import BlockDescriptor
from kvpool.tiers.writer import BackgroundWriter

_DOWN = object()  # a call that found the server unreachable


def check_url(url: str) -> str:
    """The URL, or ValueError naming what is wrong with it."""
    parts = urlsplit(url)
    if parts.scheme not in ("redis", "rediss", "unix"):
        raise ValueError(f"--redis {url!r}: expected redis://HOST:PORT[/DB] (or rediss://, unix://)")
    if parts.scheme != "unix":
        try:
            parts.port  # noqa: B018 - parses it (redis-py's default when absent: 6379)
        except ValueError:
            raise ValueError(f"--redis {url!r}: the port is not a number from 0 to 65535") from None
        if not parts.hostname:
            raise ValueError(f"--redis {url!r}: no host")
    return url


class RedisTier(Tier):
    name = "redis"

    def __init__(
        self,
        url: str,
        *,
        timeout_s: float = 0.5,
        retry_s: float = 1.0,
        max_pending_bytes: int = 64 << 20,
        log=None,
    ) -> None:
        self.url = check_url(url)
        try:
            self._client = redis.Redis.from_url(
                url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s, retry_on_timeout=False
            )
        except ValueError as error:
            raise ValueError(f"--redis {url!r}: {error}") from None
        self.retry_s = retry_s
        self.stats = TierStats()
        self._log = log or (lambda line: print(line, file=sys.stderr, flush=True))
        self._lock = threading.Lock()
        self._down_until = 0.0
        self._down = False
        self.num_outages = 0
        # what this process wrote or validated: content key -> (redis key, descriptor, bytes)
        self._known: dict[bytes, tuple[str, BlockDescriptor, int]] = {}
        self._writer = BackgroundWriter("redis", max_pending_bytes)

    @staticmethod
    def redis_key(key: bytes, descriptor: BlockDescriptor) -> str:
        return f"kvpool:{entry.namespace(descriptor)}:{descriptor.tenant}:{key.hex()}"

    # ---- availability -----------------------------------------------------------------

    def _call(self, fn):
        """fn(client), or _DOWN when the server is unreachable (one warning per outage)."""
        now = time.monotonic()
        with self._lock:
            if self._down and now < self._down_until:
                return _DOWN
        try:
            result = fn(self._client)
        except (redis.ConnectionError, redis.TimeoutError, OSError) as error:
            with self._lock:
                if not self._down:
                    self._down = True
                    self.num_outages += 1
                    self._known.clear()  # the server may come back empty: nothing is known held
                    self._log(
                        f"kvpool: redis tier {self.url} unavailable ({type(error).__name__}: {error}); "
                        f"serving without it, retrying every {self.retry_s:g} s"
                    )
                self._down_until = time.monotonic() + self.retry_s
            return _DOWN
        with self._lock:
            if self._down:
                self._down = False
                self._log(f"kvpool: redis tier {self.url} is back")
        return result

    @property
    def available(self) -> bool:
        return not self._down

    def ping(self) -> bool:
        return self._call(lambda c: c.ping()) is not _DOWN

    # ---- the interface ----------------------------------------------------------------

    @property
    def num_bytes(self) -> int:
        return sum(n for _, _, n in list(self._known.values()))  # (the writer thread adds to it)

    @property
    def num_entries(self) -> int:
        return len(self._known)

    def contains(self, key: bytes) -> bool:
        return key in self._known

    def holds(self, key: bytes, descriptor: BlockDescriptor) -> bool:
        known = self._known.get(key)
        return known is not None and known[1] == descriptor

    def _refuse(self, rkey: str, key: bytes, differ: list[str] | None) -> None:
        """A bad or foreign entry: counted, deleted."""
        if differ:
            self.stats.mismatches.update(differ)
            self.stats.misses["mismatch"] += 1
            self.stats.num_reclaimed += 1
        else:
            self.stats.num_corrupt += 1
            self.stats.misses["corrupt"] += 1
        self._known.pop(key, None)
        self._call(lambda c: c.delete(rkey))

    def lookup(self, key: bytes, expected: BlockDescriptor) -> bool:
        self.stats.num_lookups += 1
        rkey = self.redis_key(key, expected)
        header = self._call(lambda c: c.hget(rkey, "m"))
        if header is _DOWN:
            self.stats.misses["unavailable"] += 1
            return False
        if header is None:
            self._known.pop(key, None)
            self.stats.misses["absent"] += 1
            return False
        try:
            descriptor = entry.peek(header, key)[0]
        except entry.CorruptEntry:
            self._refuse(rkey, key, None)
            return False
        differ = descriptor.mismatches(expected)
        if differ:
            self._refuse(rkey, key, differ)
            return False
        self.stats.num_lookup_hits += 1
        known = self._known.get(key)
        self._known[key] = (rkey, descriptor, known[2] if known else len(header))
        return True

    def get(self, key: bytes, expected: BlockDescriptor) -> dict[str, Tensor] | None:
        start = time.perf_counter()
        rkey = self.redis_key(key, expected)
        data = self._call(lambda c: c.hget(rkey, "d"))
        if data is _DOWN or data is None:
            self.stats.misses["unavailable" if data is _DOWN else "absent"] += 1
            self.stats.num_get_misses += 1
            return None
        try:
            descriptor, tensors = entry.decode(data, key)
        except entry.CorruptEntry:
            self._refuse(rkey, key, None)
            self.stats.num_get_misses += 1
            return None
        differ = descriptor.mismatches(expected)
        if differ:
            self._refuse(rkey, key, differ)
            self.stats.num_get_misses += 1
            return None
        self._known[key] = (rkey, descriptor, len(data))
        self.stats.num_gets += 1
        self.stats.num_get_bytes += len(data)
        self.stats.get_s += time.perf_counter() - start
        return tensors

    def put(self, key: bytes, descriptor: BlockDescriptor, tensors: dict[str, Tensor]) -> bool:
        num_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
        with self._lock:
            if self._down and time.monotonic() < self._down_until:
                self.stats.num_write_errors += 1  # not even queued: the server is away
                return False
        owned = {name: t.detach().to("cpu", copy=True) for name, t in tensors.items()}
        if not self._writer.submit(lambda: self._write(key, descriptor, owned), num_bytes):
            self.stats.num_dropped_puts += 1
            return False
        return True

    def _write(self, key: bytes, descriptor: BlockDescriptor, tensors: dict[str, Tensor]) -> None:
        start = time.perf_counter()
        data = entry.encode(key, descriptor, tensors)
        header = data[: 8 + entry.header_length(data)]
        rkey = self.redis_key(key, descriptor)
        done = self._call(lambda c: c.hset(rkey, mapping={"m": header, "d": data}))
        if done is _DOWN:
            self.stats.num_write_errors += 1
            return
        self._known[key] = (rkey, descriptor, len(data))
        self.stats.num_puts += 1
        self.stats.num_put_bytes += len(data)
        self.stats.put_s += time.perf_counter() - start

    def evict(self, key: bytes) -> bool:
        known = self._known.pop(key, None)
        if known is None:
            return False
        self._call(lambda c: c.delete(known[0]))
        return True

    def flush(self, timeout: float | None = None) -> bool:
        return self._writer.flush(timeout)

    def close(self) -> None:
        self._writer.close()
        self._client.close()

    def report(self) -> dict[str, object]:
        return {
            "url": self.url,
            "available": not self._down,
            "outages": self.num_outages,
            "entries_known": len(self._known),
            "pending_bytes": self._writer.pending_bytes,
            **self.stats.as_dict(),
        }

    def check_integrity(self) -> None:
        for key, (rkey, descriptor, _) in list(self._known.items()):
            if descriptor.content_key != key.hex() or not rkey.endswith(key.hex()):
                raise AssertionError(f"redis tier: key {key.hex()} known as {rkey} / {descriptor.content_key}")
