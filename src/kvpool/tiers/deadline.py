"""File operations with a deadline: what keeps a hung mount from hanging the disk tier's
callers (an engine step, the background writer).

A read or write stuck in the kernel (an NFS hard mount whose server is gone, a FUSE file
system that stops answering, a dying disk) cannot be cancelled. So each operation runs on
a worker thread of its own, and the caller waits for it up to a deadline: past it, the
caller goes on without the answer (`NoAnswer`) and the worker is left to finish. What a
late operation returns is dropped with its job: nobody reads it, so a late answer is never
installed. A worker whose job is done goes back to a small idle set (no thread started per
operation in the steady state: one or two threads, each gone after 10 s without a job); one
still stuck is not handed more work, so a call never queues behind a hung one.

The functions run here do file I/O (and a get's checks of the bytes it read): no lock of
the caller's is taken in them while the caller waits (it may hold its own meanwhile, at most
one deadline). The one exception runs once its caller has given up: a disk write that lands
after its deadline takes the tier's lock to index itself (disk.py's `_Gate`).

A long job of many operations (the disk tier's open: its checks, the stale temp files, the
quarantine listing, the scan of every entry; `kvpool cache`'s reads) reports each answer
(`Progress.step`), and its caller waits while the answers keep coming (`wait_steady`): a
large directory on a slow disk lists slowly and is waited for whole, a hung mount answers
nothing and is given up on one deadline after its last answer.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from typing import Any

_MAX_IDLE = 2  # workers kept for the next calls; more exit when their job ends
_IDLE_S = 10.0  # a worker with no job for this long exits (a tier no longer used holds none)
# the longest deadline a tier or `kvpool cache --timeout` takes (about 31 years): Python's waits
# and socket timeouts overflow past threading.TIMEOUT_MAX (about 9.2e9 s), an OverflowError
# traceback at the first lookup or the open (audit5 #1)
MAX_DEADLINE_S = 1e9


def check_deadline(what: str, value: object) -> float:
    """`value` as a float when it is a number of seconds in (0, MAX_DEADLINE_S]; ValueError
    naming `what` otherwise (an infinite deadline is none: a hung mount or a stalled server
    would hang a step for ever)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= MAX_DEADLINE_S:
        raise ValueError(f"{what} must be a finite positive number of seconds up to {MAX_DEADLINE_S:g}, got {value!r}")
    return float(value)


class NoAnswer(Exception):  # noqa: N818 - not an error of the caller's: the file system's silence
    """An operation that did not answer: past its deadline ("timeout"), or not tried
    because the tier's breaker is open ("unavailable")."""

    def __init__(self, cause: str, what: str) -> None:
        super().__init__(f"{what}: {cause}")
        self.cause = cause
        self.what = what


class Progress:
    """What a long job has reached (`DeadlineRunner.wait_steady`): it calls `step` as each
    file operation answers, naming what it works on next."""

    def __init__(self, at: object = "") -> None:
        self.at = str(at)  # what the job waits on now (a directory, an entry's file)
        self.last = time.monotonic()  # when the file system last answered (the job's start)

    def step(self, at: object) -> None:
        self.at, self.last = str(at), time.monotonic()


class Job:
    """One operation handed to a worker, and what it came to."""

    def __init__(self, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
        self.fn, self.args = fn, args
        self.done = threading.Event()
        self.started = time.monotonic()
        self.elapsed_s = 0.0  # (set when done)
        self.result: Any = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.result = self.fn(*self.args)
        except BaseException as error:  # noqa: BLE001 - handed to the caller, who re-raises it
            self.error = error
        self.elapsed_s = time.monotonic() - self.started
        self.done.set()


class DeadlineRunner:
    """Runs `fn(*args)` on worker threads; `call` waits up to a deadline."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._lock = threading.Lock()
        self._idle: list[queue.SimpleQueue[Job]] = []  # the inboxes of workers waiting for a job
        self._late: set[Job] = set()  # jobs whose caller gave up, still running

    @property
    def num_stuck(self) -> int:
        """Operations past their deadline that have not returned (each holds a thread)."""
        with self._lock:
            return len(self._late)

    def start(self, fn: Callable[..., Any], *args: Any) -> Job:
        """Hand `fn(*args)` to an idle worker (or a new one); never waits."""
        job = Job(fn, args)
        with self._lock:
            inbox = self._idle.pop() if self._idle else None
        if inbox is None:
            threading.Thread(target=self._loop, args=(job,), name=f"kvpool-{self.name}-io", daemon=True).start()
        else:
            inbox.put(job)
        return job

    def call(self, what: str, timeout_s: float, fn: Callable[..., Any], *args: Any) -> Any:
        """fn(*args)'s result (or its exception); NoAnswer("timeout", what) when it has not
        returned within `timeout_s` (it goes on, and what it returns is dropped)."""
        return self.wait(what, timeout_s, self.start(fn, *args))

    def wait(self, what: str, timeout_s: float, job: Job) -> Any:
        """`call`'s wait, for a job `start` handed out: a caller may wait on one job again
        (a directory scan past its deadline is waited for by the next one, not started twice)."""
        if not job.done.wait(timeout_s):
            with self._lock:
                if not job.done.is_set():  # (it may have returned just now: then it answered)
                    self._late.add(job)
                    raise NoAnswer("timeout", what)
        if job.error is not None:
            raise job.error
        return job.result

    def wait_steady(self, timeout_s: float, job: Job, progress: Progress) -> Any:
        """`wait`, for a long job that reports its steps to `progress`: it takes as long as it
        needs while each step comes within `timeout_s` of the last; NoAnswer("timeout",
        progress.at, what it waited on) once none has for `timeout_s`."""
        while not job.done.wait(max(0.0, progress.last + timeout_s - time.monotonic())):
            with self._lock:
                if not job.done.is_set() and time.monotonic() - progress.last >= timeout_s:
                    self._late.add(job)
                    raise NoAnswer("timeout", progress.at)
        return self.wait("", 0.0, job)

    def _loop(self, job: Job) -> None:
        inbox: queue.SimpleQueue[Job] = queue.SimpleQueue()
        while True:
            job.run()
            with self._lock:
                self._late.discard(job)  # (a late one's answer is dropped with it)
                if len(self._idle) >= _MAX_IDLE:
                    return
                self._idle.append(inbox)
            try:
                job = inbox.get(timeout=_IDLE_S)
            except queue.Empty:
                with self._lock:
                    if inbox in self._idle:  # (else `start` took it meanwhile: its job is coming)
                        self._idle.remove(inbox)
                        return
                job = inbox.get()
