"""A background writer with a bounded queue: how the disk and Redis tiers keep their
writes off the decode path.

`submit` hands over a job (an encoded entry, which owns its bytes) and returns at once;
when the bytes already waiting would exceed the bound, the job is dropped and `submit`
says so (the tier counts it): a step never waits for a write. One daemon thread runs the
jobs in order. `flush` waits until everything submitted so far has run (a process does it
before it exits, so that the next one finds its entries).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable


class BackgroundWriter:
    def __init__(self, name: str, max_pending_bytes: int) -> None:
        if max_pending_bytes <= 0:
            raise ValueError(f"max_pending_bytes must be positive, got {max_pending_bytes}")
        self.name = name
        self.max_pending_bytes = max_pending_bytes
        self._jobs: deque[tuple[Callable[[], None], int]] = deque()
        self._pending_bytes = 0
        self._running = 0  # jobs taken off the queue and not yet finished
        self._cond = threading.Condition()
        self._closed = False
        self._thread: threading.Thread | None = None
        self.num_failed = 0  # jobs that raised (the tier's job counts what it can; these are bugs)
        self.last_error: str | None = None  # the last one's exception, for the tier's report

    @property
    def pending_bytes(self) -> int:
        return self._pending_bytes

    def submit(self, job: Callable[[], None], num_bytes: int) -> bool:
        """Queue `job`; False (dropped) when the queue's bytes would pass the bound."""
        with self._cond:
            if self._closed or self._pending_bytes + num_bytes > self.max_pending_bytes:
                return False
            self._jobs.append((job, num_bytes))
            self._pending_bytes += num_bytes
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name=f"kvpool-{self.name}-writer", daemon=True)
                self._thread.start()
            self._cond.notify_all()
        return True

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._jobs and not self._closed:
                    self._cond.wait()
                if not self._jobs:
                    return
                job, num_bytes = self._jobs.popleft()
                self._running += 1
            try:
                job()
            except Exception as error:  # noqa: BLE001 - a failed write is a lost cache entry, never a crash
                self.num_failed += 1
                self.last_error = f"{type(error).__name__}: {error}"
            finally:
                with self._cond:
                    self._running -= 1
                    self._pending_bytes -= num_bytes
                    self._cond.notify_all()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every job submitted so far has run; False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._jobs and not self._running, timeout)

    def close(self, timeout: float | None = 30.0) -> bool:
        """Run what is queued, then stop the thread; False when it did not finish in time."""
        done = self.flush(timeout)
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)
        return done
