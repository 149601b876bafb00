"""redis-py connections whose host name is resolved within the connect deadline.

redis-py resolves the host (`socket.getaddrinfo`) before the connect deadline starts: a
DNS server that is down or slow costs the resolver's own timeout (5 s a try, often several
tries), not the tier's 0.5 s, and on the engine's thread (the call that finds the server
gone). Here the name is resolved on a thread of its own, waited for up to the connect
deadline, and the connection is made to the addresses found, in order (redis-py's own
getaddrinfo of a numeric address returns at once). TLS still checks the certificate
against the name, not the address.

A lookup the deadline gave up on is left to finish on its thread (a resolver call cannot be
cancelled); a later connect to the same name waits for that one instead of starting
another, so a hung resolver holds one thread, not one a retry.
"""

from __future__ import annotations

import socket
import threading
from typing import Any

import redis


class _Lookup:
    """One getaddrinfo call in flight, and what it came to."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.addresses: list[tuple[Any, ...]] = []
        self.error: OSError | None = None


class Resolver:
    """getaddrinfo with a deadline, one lookup in flight per (host, port, type)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: dict[tuple[str, int, int], _Lookup] = {}

    def resolve(self, host: str, port: int, socket_type: int, timeout_s: float | None) -> list[tuple[Any, ...]]:
        """getaddrinfo(host, port, socket_type, SOCK_STREAM)'s answer; TimeoutError when
        it takes longer than `timeout_s` (None: no deadline), its own OSError when it fails."""
        ident = (host, port, socket_type)
        with self._lock:
            lookup = self._pending.get(ident)
            if lookup is None:
                lookup = self._pending[ident] = _Lookup()
                threading.Thread(
                    target=self._run, args=(ident, lookup), name="kvpool-redis-resolve", daemon=True
                ).start()
        if not lookup.done.wait(timeout_s):
            raise TimeoutError(f"resolving {host!r} took longer than the {timeout_s:g} s connect deadline")
        if lookup.error is not None:
            error = lookup.error  # (a fresh one: the lookup's may be raised on several threads)
            raise type(error)(*error.args)
        return lookup.addresses

    def _run(self, ident: tuple[str, int, int], lookup: _Lookup) -> None:
        host, port, socket_type = ident
        try:
            lookup.addresses = socket.getaddrinfo(host, port, socket_type, socket.SOCK_STREAM)
        except OSError as error:
            lookup.error = error
        except Exception as error:  # (UnicodeError for a bad name: an OSError to redis-py's connect)
            lookup.error = OSError(f"resolving {host!r}: {error}")
        finally:
            with self._lock:
                del self._pending[ident]  # (the next connect resolves afresh: addresses change)
            lookup.done.set()


class DeadlineConnection(redis.Connection):
    """redis.Connection, its host resolved by `resolver` within the connect deadline."""

    def __init__(self, *args: Any, resolver: Resolver, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._resolver = resolver

    def _connect(self) -> socket.socket:
        name = self.host
        addresses = self._resolver.resolve(name, self.port, self.socket_type, self.socket_connect_timeout)
        error: OSError = OSError(f"no address for {name!r}")
        for *_, address in addresses:
            self.host = address[0]  # (numeric: redis-py's getaddrinfo answers at once)
            try:
                return super()._connect()
            except OSError as refused:
                error = refused
            finally:
                self.host = name  # (messages, and TLS's name check, use the name)
        raise error


class DeadlineSSLConnection(redis.SSLConnection, DeadlineConnection):
    """redis.SSLConnection over DeadlineConnection: TLS wraps the socket connected to the
    resolved address, and checks the certificate against the host name."""


def resolve_within_deadline(client: redis.Redis) -> None:
    """Make `client`'s TCP and TLS connections resolve their host within the connect
    deadline (a Unix socket has no name to resolve)."""
    pool = client.connection_pool
    kinds = {redis.Connection: DeadlineConnection, redis.SSLConnection: DeadlineSSLConnection}
    if pool.connection_class in kinds:
        pool.connection_class = kinds[pool.connection_class]
        pool.connection_kwargs["resolver"] = Resolver()
