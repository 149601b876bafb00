"""The Redis tier: blocks in a shared `redis-server`, so that engine processes hit each
other's prefixes.

Each block is one Redis hash under

    kvpool:<namespace>:<tenant>:<content key>     (namespace: entry.namespace, the model, weights and layout)

with two fields: `m`, the entry's header (safetensors header with the manifest and its
checksum, entry.py), read by a lookup to check the descriptor without moving the tensors;
and `d`, the whole entry, read by a get and checked tensor by tensor. A bad entry (or one
whose tensors are not the shapes and dtypes the engine declared for its namespace,
`expect_tensors`) is a counted miss and is deleted; a descriptor that does not match is a
miss counted by field and is deleted (reclaimed). An entry of another kvpool's entry
format (entry.OtherVersion) is a miss ("other_version") left to its writer. The server's
own memory limit and eviction policy bound it.

A fault is a miss, never a crash, a hang or a stall:
  - Every call has a deadline (`timeout_s`, one try; the host name's resolution within it,
    redis_conn.py). A call that finds the server
    unreachable or silent (down, restarting, SIGSTOPped) opens a circuit breaker: one
    warning line, and from then on every call is a miss at no cost, on the engine's thread.
    Whether the server is back is asked in the background (the writer's thread), at most
    every `retry_s`; when it answers, the breaker closes and the tier says it is back. A
    stalled server so costs the engine at most one deadline per outage.
  - A command the server refuses (a key of the wrong type, `OOM` under `noeviction`, a
    read-only replica) is a miss or a failed write, counted by the error's first word
    (`errors`, one line the first time each kind is seen). A value of another type under an
    entry's key can never be an entry: it is deleted like a corrupt one.
  - Writes go through a background writer like the disk tier's. One that an outage refuses
    is kept (bounded by `max_pending_bytes`) and written when the server is back.
  - What this process believes stored is checked against a generation key the processes
    share (`kvpool:generation`), in the background at most every `retry_s`: a server that
    lost its data (FLUSHALL, a restart without persistence) has lost the key too, and the
    belief is dropped, so the blocks are written again as they come by (evicted, computed).
    A value of another type under that key is replaced by a new generation, as a lost one.
  - `holds` (the writer's "already stored, skip it") trusts only entries whose payload this
    process wrote or read back whole: a lookup checks the header only, so an entry with a
    corrupted payload is rewritten as soon as the engine computes its block again.

Its breaker is not the disk tier's (disk.py), for reasons of the medium: one connection
refused or one socket timeout opens it (the server is away; the disk tier waits for
`breaker_failures` deadlines in a row, as one slow fsync or NFS answer is common on a healthy
disk); its probe is a ping on the writer's thread (a socket timeout always returns, and the
writes held during the outage are replayed there once it answers; a disk probe on a hung
mount may never return, so the disk tier's runs on a deadline worker and is never waited
for), and the same background check, while closed, asks whether the server lost its data
(the generation key); opening forgets what this process believed stored and holds its
writes (a server may come back empty; the disk tier keeps its index and drops writes, which
would go to the same hung mount).
"""

from __future__ import annotations

import itertools
import re
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from typing import Any, NamedTuple
from urllib.parse import parse_qsl, unquote, urlsplit

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry
from torch import Tensor

from kvpool.tiers import entry
from kvpool.tiers.base import Tier, TierStats
from kvpool.tiers.deadline import MAX_DEADLINE_S
from kvpool.tiers.descriptor import BlockDescriptor
from kvpool.tiers.redis_conn import resolve_within_deadline
from kvpool.tiers.writer import BackgroundWriter

_DOWN = object()  # a call that found the breaker open, or opened it
GENERATION_KEY = "kvpool:generation"  # a random value the processes share; gone with the server's data


_AUTHORITY = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*:)?//")  # (RFC 3986's scheme)


def redact_url(url: str) -> str:
    """The URL as messages and reports show it: a password (redis://USER:PASSWORD@HOST, or
    ?password=) replaced by ***, so that it never reaches a log, a terminal or a --json
    report, whatever characters it holds. Textual (a URL that does not parse is redacted
    too), and generous where the URL is ambiguous: after `//USER:` the password runs to the
    last '@' of the whole URL (a raw '/', '?', '#' or '@' in it, not percent-encoded, ends
    the host part for a URL parser and was shown), and a `password=` value (after any '?' or
    '&', raw ones in a password included) runs to the end (a raw '&', '#' or '@' in it).
    A URL without '//' (mistyped: user:PASSWORD@h, redis:/:PASSWORD@h) hides what lies
    between its first ':' (else its start) and its last '@'. Over-redaction
    (`redis://HOST:PORT/x?y=a@b` shows `redis://HOST:***@b`) shows less, never a password."""
    spans = []  # [lo, hi) of the text hidden
    at = url.rfind("@")
    authority = _AUTHORITY.match(url)  # SCHEME:// or // (a '//' further on may be a password's)
    if authority and authority.end() <= at and ":" in url[authority.end() : at]:
        # USER ends at its first ':', the password is the rest
        spans.append((url.index(":", authority.end()) + 1, at))
    elif not authority and at >= 0:
        # no '//': a mistyped URL (user:PASSWORD@h, redis:/:PASSWORD@h), what check_url's
        # refusal shows (review 9: shown whole): hidden from the first ':' (else the start) to the '@'
        spans.append((url.find(":", 0, at) + 1, at))
    for i, char in enumerate(url):  # every '?' and '&' (a raw one may sit inside a password)
        name, equals, _ = url[i + 1 :].partition("=") if char in "?&" else ("", "", "")
        if equals and unquote(name).lower() == "password":  # (a parser unquotes the name: %70assword)
            spans.append((i + len(name) + 2, len(url)))
            break
    hidden = bytearray(len(url))
    for lo, hi in spans:
        hidden[lo:hi] = b"\1" * (hi - lo)
    runs = itertools.groupby(zip(url, hidden, strict=True), key=lambda pair: pair[1])
    return "".join("***" if hide else "".join(char for char, _ in run) for hide, run in runs)


# the query arguments redis-py takes as text (its others are numbers and booleans)
_TEXT_QUERY_ARGUMENTS = ("password", "username", "client_name")


def _in_a_string_query_value(url: str, start: int, at: int) -> bool:
    """Whether the '@' at `at` lies in the value of a query argument redis-py reads as text
    (?password=a@b, ?client_name=me@x): legal raw in a query (RFC 3986), and parsed right,
    port or not (review 9: refused when the URL had a port). An '@' in a fragment, after a
    raw '&' that ends the argument, or in a name=value redis-py does not read as text (say
    redis://u:1234?x=1@h, a password with a raw '?') is not: the parser splits it otherwise."""
    query = url.find("?", start, at)
    if query < 0 or "#" in url[query:at]:
        return False
    argument = url[max(url.rfind("&", query, at), query) + 1 : at]
    name, equals, _ = argument.partition("=")
    return bool(equals) and unquote(name) in _TEXT_QUERY_ARGUMENTS


def check_url(url: str) -> str:
    """The URL, or ValueError naming what is wrong with it (the URL shown redacted)."""
    shown = redact_url(url)
    try:
        parts = urlsplit(url)
    except ValueError as error:  # urlsplit's own ("Invalid IPv6 URL") named neither the flag nor the URL
        raise ValueError(f"--redis {shown!r}: {error}") from None
    if parts.scheme not in ("redis", "rediss", "unix"):
        raise ValueError(f"--redis {shown!r}: expected redis://HOST:PORT[/DB] (or rediss://, unix://)")
    start, at = url.find("//") + 2, url.rfind("@")  # (urlsplit's netloc: the raw text after '//')
    past_host = parts.netloc and at > start + len(parts.netloc) and ":" in url[start:at]
    if past_host and not _in_a_string_query_value(url, start, at):
        # USER:PASSWORD whose password holds a raw '/', '?' or '#': the parser's host part ends
        # there, and the rest (the password's tail) would reach the connection as a host, a
        # port or a database, and its messages
        raise ValueError(
            f"--redis {shown!r}: an '@' after the URL's host part: percent-encode a password's "
            "'/', '?', '#' and '@' (%2F, %3F, %23, %40), and an '@' elsewhere (%40)"
        )
    unknown = _unknown_query_option(url, parts.scheme, parts.query)
    if unknown is not None:
        if unknown == "":
            # (a name after ?password= may be a piece of the password: never shown)
            raise ValueError(
                f"--redis {shown!r}: the URL's query holds an option redis-py does not take after ?password=: "
                "percent-encode a password's '&' and '#' (%26, %23)"
            )
        raise ValueError(
            f"--redis {shown!r}: redis-py takes no option {unknown!r} in the URL's query (a connection of "
            f"{parts.scheme}:// takes {', '.join(_documented_options(parts.scheme))}, among others)"
        )
    if parts.scheme == "unix" and not parts.path.strip("/"):
        raise ValueError(f"--redis {shown!r}: no socket path (unix:///PATH/TO/redis.sock)")
    if parts.scheme != "unix":
        try:
            parts.port  # noqa: B018 - parses it (redis-py's default when absent: 6379)
        except ValueError:
            raise ValueError(f"--redis {shown!r}: the port is not a number from 0 to 65535") from None
        if not parts.hostname:
            raise ValueError(f"--redis {shown!r}: no host")
        db = parts.path.strip("/")
        if db and not (db.isascii() and db.isdigit()):
            raise ValueError(
                f"--redis {shown!r}: the database {db!r} is not a number (redis://HOST:PORT/DB, DB from 0)"
            )
    return url


def _options_taken(scheme: str) -> set[str]:
    """The keyword arguments redis-py's connection of `scheme` (and its pool) take: the
    names of a URL's query it may be given (redis-py hands it every name with a value)."""
    import inspect

    from redis import connection

    classes = {"rediss": connection.SSLConnection, "unix": connection.UnixDomainSocketConnection}
    names: set[str] = set()
    for cls in (classes.get(scheme, connection.Connection), connection.ConnectionPool):
        for klass in cls.__mro__:
            if "__init__" in vars(klass):
                for p in inspect.signature(klass.__init__).parameters.values():
                    if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY):
                        names.add(p.name)
    return names


def _documented_options(scheme: str) -> list[str]:
    """The query options a message suggests: redis-py's parsed ones and its text ones that
    a connection of `scheme` takes."""
    from redis import connection

    return sorted((set(connection.URL_QUERY_ARGUMENT_PARSERS) | set(_TEXT_QUERY_ARGUMENTS)) & _options_taken(scheme))


def _unknown_query_option(url: str, scheme: str, query: str) -> str | None:
    """The first name of the URL's query that redis-py would hand its connection and that the
    connection does not take (a TypeError at the first connection: a traceback, after the
    model loaded; audit5 #2), "" for one after a ?password= (a raw '&' in the password: the
    name may be a piece of it, never shown), None for none. As redis-py reads a query:
    parse_qs, names with an empty value dropped."""
    taken = _options_taken(scheme)
    after_password = False
    for name, _ in parse_qsl(query):
        if name not in taken:
            return "" if after_password or "password" in name.lower() else name
        after_password = after_password or name == "password"
    return None


# the errors redis-py gives a class of their own, without the server's first word
_KINDS = {
    redis.exceptions.OutOfMemoryError: "OOM",
    redis.exceptions.ReadOnlyError: "READONLY",
    redis.exceptions.NoPermissionError: "NOPERM",
}


def _delete_if_unchanged(pipe: redis.client.Pipeline, rkey: str, field: str, raw: bytes | None) -> None:
    """Inside `Redis.transaction` (rkey WATCHed, re-run if it changes before EXEC): delete
    the entry only while its `field` still reads `raw` (None: still absent, beside a header),
    so a good entry another process writes between our read and the delete stays (an
    unwatched DEL dropped it)."""
    if pipe.hget(rkey, field) == raw and pipe.exists(rkey):
        pipe.multi()
        pipe.delete(rkey)


def _delete_if_no_entry(pipe: redis.client.Pipeline, rkey: str) -> None:
    """Inside `Redis.transaction` (rkey WATCHed): delete a value of another type under an
    entry's key only while it is still no hash, so an entry another process wrote there
    between our read and the delete stays (as `_delete_if_unchanged`)."""
    kind = pipe.type(rkey)
    if (kind.decode() if isinstance(kind, bytes) else kind) not in ("hash", "none"):
        pipe.multi()
        pipe.delete(rkey)


def _needs_password(error: redis.RedisError) -> bool:
    """Whether the server refused a client that sent no password (NOAUTH; redis-py's HELLO
    handshake gets "HELLO must be called with the client already authenticated")."""
    text = str(error)
    return "NOAUTH" in text or "already authenticated" in text


def _error_kind(error: redis.RedisError) -> str:
    """The server's error code: the first word of its answer (WRONGTYPE, OOM, READONLY, ERR ...)."""
    if type(error) in _KINDS:
        return _KINDS[type(error)]
    words = str(error).split(maxsplit=1)
    return words[0] if words and words[0].isupper() else type(error).__name__


class _Read(NamedTuple):
    """An entry field read and checked (`RedisTier._read_checked`)."""

    redis_key: str
    descriptor: BlockDescriptor
    body: Any  # the header's manifest, or the entry's tensors
    num_bytes: int  # of the field as stored


class _Known(NamedTuple):
    """What this process knows of an entry it wrote or validated."""

    redis_key: str
    descriptor: BlockDescriptor
    num_bytes: int
    # its payload checked out here (written, or read back whole); a lookup checks the header
    # only, and holds() (the writer's "stored, skip it") trusts payloads alone
    verified: bool


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
        """timeout_s: every call's deadline (one try). retry_s: how often, at most, the
        background asks whether the server is back (breaker open) or still holds this
        process's entries (closed). max_pending_bytes: the writer's queue, and apart from
        it the writes an outage holds back. ValueError for a URL, a database or credentials
        the server refuses; an unreachable server is an outage (served without it)."""
        self.url = check_url(url)
        self.shown_url = redact_url(url)  # what messages and the report say (no password)
        # finite: an infinite deadline is none (a stalled server stalls a step for ever)
        # (at most MAX_DEADLINE_S: a socket timeout past threading.TIMEOUT_MAX is an OverflowError)
        if not 0 < timeout_s <= MAX_DEADLINE_S or not 0 < retry_s <= MAX_DEADLINE_S:
            raise ValueError(
                f"timeout_s and retry_s must be finite positive numbers of seconds up to {MAX_DEADLINE_S:g}, "
                f"got {timeout_s} and {retry_s}"
            )
        try:
            self._client = redis.Redis.from_url(
                url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s, retry=Retry(NoBackoff(), 0)
            )
        except ValueError as error:
            raise ValueError(f"--redis {self.shown_url!r}: {error}") from None
        resolve_within_deadline(self._client)  # (redis-py resolves the host before its deadline starts)
        self.timeout_s = timeout_s
        self.retry_s = retry_s
        self.max_pending_bytes = max_pending_bytes
        self.stats = TierStats()
        self._log = log or (lambda line: print(line, file=sys.stderr, flush=True))
        self._lock = threading.Lock()
        self._open = False  # the breaker: open while the server is away or silent
        self._next_check = time.monotonic() + retry_s  # the background's next look at the server
        self._check_queued = False
        self.num_outages = 0
        self.num_errors = 0  # commands the server refused (by kind in `errors`)
        self.errors: Counter[str] = Counter()
        self.num_resets = 0  # times the server was found to have lost this process's entries
        self.num_deferred_puts = 0  # writes an outage held back ...
        self.num_retried_puts = 0  # ... written when it ended
        self._known: dict[bytes, _Known] = {}  # content key -> what this process wrote or validated
        self._epoch = 0  # bumped whenever _known is dropped: a write begun before records nothing
        self._generation: bytes | None = None
        # writes an outage refused, written when it ends: content key -> (descriptor, tensors, bytes)
        self._backlog: dict[bytes, tuple[BlockDescriptor, dict[str, Tensor], int]] = {}
        self._backlog_bytes = 0
        # namespace -> {tensor name: (dtype, shape)} every entry of it must have
        self._expected: dict[str, dict[str, tuple[str, list[int]]]] = {}
        self._writer = BackgroundWriter("redis", max_pending_bytes)
        self._connect()

    def _connect(self) -> None:
        """One round trip now, so that a database the server lacks or refused credentials
        are said at once, as the caller's mistake."""
        try:
            self._client.ping()
        except (redis.AuthenticationError, redis.ResponseError) as error:
            self._client.close()
            db = self._client.connection_pool.connection_kwargs.get("db", 0)
            if "DB index" in str(error):
                raise ValueError(
                    f"--redis {self.shown_url!r}: the server has no database {db} ({error}; a server has 16, "
                    "0 to 15, unless its `databases` setting says otherwise)"
                ) from None
            if _needs_password(error) and not self._client.connection_pool.connection_kwargs.get("password"):
                raise ValueError(
                    f"--redis {self.shown_url!r}: the server requires a password, and the URL gives none "
                    f"(redis://:PASSWORD@HOST:PORT/DB, or redis://USER:PASSWORD@... with an ACL user; {error})"
                ) from None
            if isinstance(error, redis.AuthenticationError) or "WRONGPASS" in str(error):
                raise ValueError(
                    f"--redis {self.shown_url!r}: the server refused the URL's user and password ({error})"
                ) from None
            raise ValueError(f"--redis {self.shown_url!r}: the server refused the connection ({error})") from None
        except (redis.ConnectionError, redis.TimeoutError, OSError) as error:
            self._trip(error)
            return
        self._check_generation()

    def expect_tensors(
        self, model_id: str, weights_version: str, layout_id: str, tensors: dict[str, tuple[object, tuple[int, ...]]]
    ) -> None:
        """Declare the tensors every block of (model_id, weights_version, layout_id) has:
        {name: (torch dtype, shape)}. An entry of that namespace whose tensors differ,
        checksums valid or not, is a corrupt miss and is deleted, never handed to the engine."""
        self._expected[entry.namespace_of(model_id, weights_version, layout_id)] = entry.expected_layout(tensors)

    @staticmethod
    def redis_key(key: bytes, descriptor: BlockDescriptor) -> str:
        return f"kvpool:{entry.namespace(descriptor)}:{descriptor.tenant}:{key.hex()}"

    # ---- availability: the breaker, refused commands, the background checks ------------

    def _call(self, fn):
        """fn(client); _DOWN when the breaker is open or the call opens it (unreachable,
        or no answer within the deadline); the error itself when the server refuses the
        command (counted)."""
        self._kick()
        if self._open:
            return _DOWN
        try:
            return fn(self._client)
        except (redis.ConnectionError, redis.TimeoutError, OSError) as error:
            self._trip(error)
            return _DOWN
        except redis.RedisError as error:
            self._refused(error)
            return error

    def _trip(self, error: Exception) -> None:
        """Open the breaker: one warning line; what was stored may be gone when it is back."""
        with self._lock:
            if self._open:
                return
            self._open = True
            self.num_outages += 1
            self._known.clear()
            self._epoch += 1
            self._next_check = time.monotonic() + self.retry_s
        self._log(
            f"kvpool: redis tier {self.shown_url} unavailable ({type(error).__name__}: {error}); "
            f"serving without it, checking every {self.retry_s:g} s in the background"
        )

    def _refused(self, error: redis.RedisError) -> None:
        kind = _error_kind(error)
        with self._lock:
            self.num_errors += 1
            first = kind not in self.errors
            self.errors[kind] += 1
        if first:
            self._log(
                f"kvpool: redis tier {self.shown_url} refused a command ({error}); a miss or a lost write, "
                f"counted under errors.{kind}; serving on"
            )

    def _kick(self) -> None:
        """Queue one background check when it is due: never waits."""
        with self._lock:
            if self._check_queued or time.monotonic() < self._next_check:
                return
            self._check_queued = True
        if not self._writer.submit(self._check, 0):  # (closed)
            with self._lock:
                self._check_queued = False

    def _check(self) -> None:
        """On the writer's thread: open, whether the server is back; closed, whether it
        still holds this process's entries."""
        try:
            if self._open:
                self._probe()
            else:
                self._check_generation()
        finally:
            with self._lock:
                self._check_queued = False
                self._next_check = time.monotonic() + self.retry_s

    def _probe(self) -> None:
        try:
            self._client.ping()
        except (redis.RedisError, OSError):
            return  # still away, or refusing us (NOAUTH, LOADING): the breaker stays open
        with self._lock:
            self._open = False
            backlog, self._backlog, self._backlog_bytes = self._backlog, {}, 0
        self._log(f"kvpool: redis tier {self.shown_url} is back")
        self._check_generation()
        for key, (descriptor, tensors, _) in backlog.items():
            self.num_retried_puts += self._write(key, descriptor, tensors)

    def _check_generation(self) -> None:
        """Drop what this process believes stored when the server's generation key is not
        the one it last saw (the server lost its data: FLUSHALL, a restart)."""
        seen = self._call(lambda c: c.get(GENERATION_KEY))
        if isinstance(seen, redis.RedisError) and _error_kind(seen) == "WRONGTYPE":
            # a value of another type (counted) can never be a generation: replaced, or this
            # process would never again see a loss and never write its blocks again
            self._call(lambda c: c.delete(GENERATION_KEY))
            seen = None
        if seen is _DOWN or isinstance(seen, redis.RedisError):
            return
        if seen is None:  # the first process here, or the data is gone: a new generation
            self._call(lambda c: c.set(GENERATION_KEY, uuid.uuid4().hex.encode(), nx=True))
            seen = self._call(lambda c: c.get(GENERATION_KEY))
            if seen is _DOWN or isinstance(seen, redis.RedisError) or seen is None:
                return
        if seen == self._generation:
            return
        with self._lock:
            lost = len(self._known) if self._generation is not None else 0
            self._generation = seen
            if lost:
                self._known.clear()
                self._epoch += 1
                self.num_resets += 1
        if lost:
            self._log(
                f"kvpool: redis tier {self.shown_url} lost its entries (FLUSHALL or a restart): {lost} of this "
                "process's blocks will be written again as they come by"
            )

    @property
    def available(self) -> bool:
        return not self._open

    def ping(self) -> bool:
        """Whether the server answered (never waits past the deadline; open: no call)."""
        answer = self._call(lambda c: c.ping())
        return answer is not _DOWN and not isinstance(answer, redis.RedisError)

    # ---- the interface ----------------------------------------------------------------

    @property
    def num_bytes(self) -> int:
        return sum(known.num_bytes for known in list(self._known.values()))  # (the writer thread adds to it)

    @property
    def num_entries(self) -> int:
        return len(self._known)

    def contains(self, key: bytes) -> bool:
        return key in self._known

    def holds(self, key: bytes, descriptor: BlockDescriptor) -> bool:
        self._kick()
        known = self._known.get(key)
        return known is not None and known.descriptor == descriptor and known.verified

    def _refuse(self, rkey: str, key: bytes, differ: list[str] | None, field: str, raw: bytes | None) -> None:
        """A bad or foreign entry (its `field` read as `raw`; None: the header with no data):
        counted, deleted while it still holds what was read."""
        if differ:
            self.stats.mismatches.update(differ)
            self.stats.misses["mismatch"] += 1
            self.stats.num_reclaimed += 1
        else:
            self.stats.num_corrupt += 1
            self.stats.misses["corrupt"] += 1
        self._known.pop(key, None)
        self._call(lambda c: c.transaction(lambda pipe: _delete_if_unchanged(pipe, rkey, field, raw), rkey))

    def _other_version(self, key: bytes) -> None:
        """An entry another kvpool's entry format wrote (entry.OtherVersion): a miss, left
        to its writer (the server's eviction ages it out), never deleted as corrupt."""
        self._known.pop(key, None)
        self.stats.misses["other_version"] += 1

    def _missed(self, rkey: str, key: bytes, answer: object) -> None:
        """A read that found no entry: the server away (_DOWN), the key absent (None), or
        the command refused (the error, counted by _call). A value of another type under
        the entry's key can never be an entry: it is deleted."""
        if answer is _DOWN:
            self.stats.misses["unavailable"] += 1
            return
        self._known.pop(key, None)
        if answer is None:
            self.stats.misses["absent"] += 1
            return
        self.stats.misses["error"] += 1
        if isinstance(answer, redis.RedisError) and _error_kind(answer) == "WRONGTYPE":
            self._call(lambda c: c.transaction(lambda pipe: _delete_if_no_entry(pipe, rkey), rkey))

    def lookup(self, key: bytes, expected: BlockDescriptor) -> bool:
        self.stats.num_lookups += 1
        found = self._read_checked(key, expected, "m", entry.peek, entry.tensor_layout)
        if found is None:
            return False
        self.stats.num_lookup_hits += 1
        known = self._known.get(key)
        if known is None or known.descriptor != found.descriptor:  # (a payload checked here stays checked)
            self._known[key] = _Known(found.redis_key, found.descriptor, found.num_bytes, verified=False)
        return True

    def get(self, key: bytes, expected: BlockDescriptor) -> dict[str, Tensor] | None:
        start = time.perf_counter()
        found = self._read_checked(key, expected, "d", entry.decode, entry.layout_of)
        if found is None:
            self.stats.num_get_misses += 1
            return None
        self._known[key] = _Known(found.redis_key, found.descriptor, found.num_bytes, verified=True)
        self.stats.num_gets += 1
        self.stats.num_get_bytes += found.num_bytes
        self.stats.get_s += time.perf_counter() - start
        return found.body

    def _read_checked(
        self,
        key: bytes,
        expected: BlockDescriptor,
        field: str,
        decode: Callable[[bytes, bytes], tuple[BlockDescriptor, Any]],
        layout_of: Callable[[Any], dict[str, tuple[str, list[int]]]],
    ) -> _Read | None:
        """The entry's `field` ("m": its header, for lookup; "d": the whole entry, for get),
        decoded and checked against `expected`. None: a miss, already handled and counted as
        its kind (server down or absent, corrupt, another version, another descriptor)."""
        rkey = self.redis_key(key, expected)
        if field == "m":
            # the header, and whether the data is there: a header alone (a partial foreign
            # write) hit every lookup and missed every get, never deleted. (One round trip.)
            answer = self._call(
                lambda c: c.pipeline(transaction=False).hget(rkey, "m").hexists(rkey, "d").execute(raise_on_error=False)
            )
            raw, has_data = answer if isinstance(answer, list) else (answer, True)
            if isinstance(raw, redis.RedisError):
                self._refused(raw)  # (a pipeline hands a refused command's error back, uncounted by _call)
        else:
            raw, has_data = self._call(lambda c: c.hget(rkey, field)), True
        if raw is _DOWN or raw is None or isinstance(raw, redis.RedisError):
            self._missed(rkey, key, raw)
            return None
        if not has_data:
            self._refuse(rkey, key, None, "d", None)
            return None
        try:
            descriptor, body = decode(raw, key)
            entry.check_layout(layout_of(body), self._expected.get(entry.namespace(expected)))
        except entry.CorruptEntry:
            self._refuse(rkey, key, None, field, raw)
            return None
        except entry.OtherVersion:
            self._other_version(key)
            return None
        differ = descriptor.mismatches(expected)
        if differ:
            self._refuse(rkey, key, differ, field, raw)
            return None
        return _Read(rkey, descriptor, body, len(raw))

    def put(self, key: bytes, descriptor: BlockDescriptor, tensors: dict[str, Tensor]) -> bool:
        """Queue the write; while the breaker is open, keep it for when the server is back
        (False when that backlog is full: dropped, counted)."""
        owned = {name: t.detach().to("cpu", copy=True) for name, t in tensors.items()}
        num_bytes = sum(t.numel() * t.element_size() for t in owned.values())
        self._kick()
        if self._open:
            return self._defer(key, descriptor, owned)
        if not self._writer.submit(lambda: self._write(key, descriptor, owned), num_bytes):
            self.stats.num_dropped_puts += 1
            return False
        return True

    def _defer(self, key: bytes, descriptor: BlockDescriptor, tensors: dict[str, Tensor]) -> bool:
        """Keep a write for when the breaker closes (False: the backlog is full, dropped);
        written now when it closed meanwhile (its backlog is drained already)."""
        num_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
        with self._lock:
            if self._open:
                old = self._backlog.pop(key, None)
                self._backlog_bytes -= old[2] if old else 0
                if self._backlog_bytes + num_bytes > self.max_pending_bytes:
                    self.stats.num_dropped_puts += 1
                    return False
                self._backlog[key] = (descriptor, tensors, num_bytes)
                self._backlog_bytes += num_bytes
                self.num_deferred_puts += 1
                return True
        if not self._writer.submit(lambda: self._write(key, descriptor, tensors), num_bytes):
            self.stats.num_dropped_puts += 1
            return False
        return True

    def _write(self, key: bytes, descriptor: BlockDescriptor, tensors: dict[str, Tensor]) -> bool:
        """On the writer's thread: whether the block was stored."""
        start = time.perf_counter()
        data = entry.encode(key, descriptor, tensors)
        header = data[: 8 + entry.header_length(data)]
        rkey = self.redis_key(key, descriptor)
        epoch = self._epoch
        done = self._call(lambda c: c.hset(rkey, mapping={"m": header, "d": data}))
        if isinstance(done, redis.RedisError) and _error_kind(done) == "WRONGTYPE":
            # a value of another type under the entry's key (counted): never an entry, replaced
            done = self._call(
                lambda c: c.pipeline().delete(rkey).hset(rkey, mapping={"m": header, "d": data}).execute()
            )
        if done is _DOWN:
            self._defer(key, descriptor, tensors)  # written when the server is back
            return False
        if isinstance(done, redis.RedisError):
            self.stats.num_write_errors += 1  # refused (OOM, WRONGTYPE ...): counted in errors by kind
            return False
        with self._lock:
            if self._epoch == epoch:  # else the server lost its data meanwhile: maybe this too
                self._known[key] = _Known(rkey, descriptor, len(data), verified=True)
        self.stats.num_puts += 1
        self.stats.num_put_bytes += len(data)
        self.stats.put_s += time.perf_counter() - start
        return True

    def evict(self, key: bytes) -> bool:
        with self._lock:
            deferred = self._backlog.pop(key, None)
            self._backlog_bytes -= deferred[2] if deferred else 0
        known = self._known.pop(key, None)
        if known is None:
            return deferred is not None
        self._call(lambda c: c.delete(known.redis_key))
        return True

    def flush(self, timeout: float | None = None) -> bool:
        """Wait for the queued writes (those an outage holds back wait for the server)."""
        return self._writer.flush(timeout)

    def close(self) -> None:
        self._writer.close()
        self._client.close()

    def report(self) -> dict[str, object]:
        return {
            "url": self.shown_url,
            "available": not self._open,
            "outages": self.num_outages,
            "num_errors": self.num_errors,
            "errors": dict(sorted(self.errors.items())),
            "resets": self.num_resets,
            "deferred_puts": self.num_deferred_puts,
            "retried_puts": self.num_retried_puts,
            "backlog_bytes": self._backlog_bytes,
            "writer_failures": self._writer.num_failed,  # (a job that raised: a bug, said here)
            "writer_last_error": self._writer.last_error,
            "entries_known": len(self._known),
            "pending_bytes": self._writer.pending_bytes,
            **self.stats.as_dict(),
        }

    def check_integrity(self) -> None:
        for key, (rkey, descriptor, _, _) in list(self._known.items()):
            if descriptor.content_key != key.hex() or not rkey.endswith(key.hex()):
                raise AssertionError(f"redis tier: key {key.hex()} known as {rkey} / {descriptor.content_key}")
        with self._lock:
            held = sum(n for _, _, n in self._backlog.values())
            if held != self._backlog_bytes or held > self.max_pending_bytes:
                raise AssertionError(f"redis tier: backlog of {held} bytes counted as {self._backlog_bytes}")
