"""One engine loop on its own thread, shared by every HTTP request.

Handlers never touch the engine. They hand it work through `submit` / `abort` / `call`,
which queue a command and wake the thread; the thread runs the queued commands between
two steps, then one `Engine.step()` over everything in flight (continuous batching: a
request that arrives mid-generation joins the next step), then tells every request what
it gained: new token ids, the text they complete, their log-probabilities, and at the end
the engine's `RequestOutput`. Those events cross to the handler's asyncio loop with
`call_soon_threadsafe`, so no handler blocks another and none blocks the engine.

Faults. An exception from one request's own work (its sampling or stop-string text in the
engine step, its detokenization here) fails that request alone: it is aborted, its blocks
released, and its handler gets Failed; the step goes on for the others. Only a fault of the
step itself (scheduling, the forward) fails every request in flight.

Cancellation (seed 003's rule): `abort` is a command like any other, so it runs before the
next step starts; the engine releases the request's blocks at once, exactly once (a second
abort, or one for a finished request, is a no-op).

Text. A sample's text is the decoded output (EOS excluded) up to what can no longer change:
an incomplete UTF-8 sequence at the end (decoded as U+FFFD) waits for its next byte (an aborted
sample's never comes: its last delta leaves the half character out; a U+FFFD the model did
write, the character itself or a byte no UTF-8 character holds, is text and is sent), and the
last len(longest stop string) - 1 characters wait while a stop string could still be
forming, so a stream never shows text that the final answer cuts. The finished sample's
text is the engine's (cut before the stop string); the deltas add up to exactly it
(server/text_stream.py, which kvpool generate's streamed text shares).
"""

from __future__ import annotations

import asyncio
import sys
import threading
import traceback
import uuid
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TypeVar

from kvpool.engine.engine import Engine, RequestOutput, SequenceState
from kvpool.engine.sampling import SamplingParams
from kvpool.server.text_stream import TextStream

_T = TypeVar("_T")


@dataclass(frozen=True, slots=True)
class Delta:
    """What one sample gained in a step."""

    index: int  # the sample (choice) index
    text: str  # new text, possibly empty (held back, or a token with no text)
    token_ids: list[int]
    logprobs: list[tuple[float, list[tuple[int, float]]]]  # one per token id, when asked for
    finish_reason: str | None  # set on the sample's last delta: "stop", "length" or "abort"


@dataclass(frozen=True, slots=True)
class Finished:
    """The request is done: its output, as the engine reports it."""

    output: RequestOutput


@dataclass(frozen=True, slots=True)
class Failed:
    """The request could not be served; the message says why. status: 400 when its input
    was at fault (the engine refused it), 500 for an error while serving it."""

    message: str
    status: int = 500


Event = Delta | Finished | Failed


@dataclass(slots=True)
class _SampleStream:
    text: TextStream  # its text as the stream shows it
    num_sent_tokens: int = 0
    done: bool = False


@dataclass(slots=True)
class _Tracked:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[Event]
    holdback: int  # characters held back while a stop string may be forming
    samples: dict[int, _SampleStream] = field(default_factory=dict)
    # the prompt tokens its samples' text is decoded after, and how many are cut (TokenBytes.context)
    context: tuple[list[int], int] | None = None


class EngineThread:
    """The engine's only user. `on_step(engine, finished outputs, new tokens)` runs on the
    engine thread after every step and every batch of commands (the server's metrics)."""

    def __init__(
        self,
        engine: Engine,
        decode: Callable[[list[int]], str],
        *,
        token_bytes: Callable[[int], bytes] | None = None,
        on_step: Callable[[Engine, list[RequestOutput], int], None] | None = None,
        name: str = "kvpool-engine",
    ) -> None:
        self.engine = engine
        engine.contain_request_faults = True  # one request's fault fails it alone (Failed)
        self.decode = decode
        # a token id's bytes: they tell half a character (its U+FFFD waits) from a U+FFFD the
        # model wrote; without them every trailing U+FFFD is taken for half a character
        self.token_bytes = token_bytes
        self.on_step = on_step
        self._cond = threading.Condition()
        self._commands: list[Callable[[], None]] = []
        self._stopping = False
        self._tracked: dict[str, _Tracked] = {}
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.num_aborted_at_stop = 0  # requests in flight when the server stopped, aborted then
        self.error: BaseException | None = None  # what stopped the thread, if anything did

    # ---- the handlers' side ---------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Abort whatever is in flight, release it, and end the thread."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def stopping(self) -> bool:
        """Set by `stop` (or by the thread's end): no request will be taken any more."""
        return self._stopping

    @staticmethod
    def new_request_id(prefix: str) -> str:
        """A random id (122 random bits): it tells a client nothing about other requests."""
        return f"{prefix}-{uuid.uuid4().hex}"

    def submit(
        self, request_id: str, prompt_ids: list[int], params: SamplingParams, tenant: str = ""
    ) -> asyncio.Queue[Event]:
        """Queue a request (from the handler's event loop); its events arrive on the
        returned queue, the last one Finished or Failed."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[Event] = asyncio.Queue()
        holdback = max((len(s) for s in params.stop), default=1) - 1

        def add() -> None:
            try:
                self.engine.add_request(prompt_ids, params, request_id, tenant=tenant)
            except ValueError as error:  # the request's input (the handlers check it first)
                loop.call_soon_threadsafe(queue.put_nowait, Failed(str(error), 400))
                return
            except Exception as error:  # a bug: this request fails, the engine goes on
                _log(f"adding request {request_id} failed", traceback.format_exc())
                loop.call_soon_threadsafe(queue.put_nowait, Failed(f"{type(error).__name__}: {error}"))
                return
            self._tracked[request_id] = _Tracked(loop, queue, holdback)

        self._queue(add)
        return queue

    def abort(self, request_id: str) -> None:
        """Cancel the request before the next step (no-op once it has finished)."""

        self._queue(lambda: self.engine.abort(request_id))

    def call(self, fn: Callable[[Engine], _T]) -> Future[_T]:
        """Run `fn(engine)` on the engine thread between two steps (an integrity check, a
        usage snapshot); its result or exception comes back through the future."""
        future: Future[_T] = Future()

        def run() -> None:
            if not future.set_running_or_notify_cancel():
                return
            try:
                future.set_result(fn(self.engine))
            except BaseException as error:  # handed to the caller, who decides
                future.set_exception(error)

        self._queue(run)
        return future

    def _queue(self, command: Callable[[], None]) -> None:
        with self._cond:
            if self._stopping or not self._thread.is_alive():
                raise RuntimeError("the engine is not running")
            self._commands.append(command)
            self._cond.notify()

    # ---- the engine thread ----------------------------------------------------------

    def _run(self) -> None:
        engine = self.engine
        try:
            while True:
                with self._cond:
                    while not self._commands and not self._stopping and not engine.has_unfinished():
                        self._cond.wait()
                    commands, self._commands = self._commands, []
                    stopping = self._stopping
                for command in commands:
                    command()
                if stopping:
                    self._abort_all()
                    self._publish()
                    return
                if engine.has_unfinished():
                    try:
                        engine.step()
                    except Exception:  # the step itself, no one request's fault: fail what is in flight
                        message = traceback.format_exc()
                        _log("the engine step failed", message)
                        self._fail_all(message.strip().splitlines()[-1])
                self._publish()
        except BaseException as error:
            self.error = error
            _log("the engine thread stopped", traceback.format_exc())
            self._fail_all(f"the engine stopped: {error!r}")
            raise
        finally:
            with self._cond:
                self._stopping = True
                leftover, self._commands = self._commands, []
            for command in leftover:  # a submit that raced the stop: answer it
                command()
            self._fail_all("the server is shutting down")

    def _abort_all(self) -> None:
        for request_id in list(self._tracked):
            if self.engine.abort(request_id):
                self.num_aborted_at_stop += 1

    def _fail_all(self, message: str) -> None:
        outputs: list[RequestOutput] = []
        for request_id, tracked in list(self._tracked.items()):
            try:
                if self.engine.fail(request_id, message) or request_id in self.engine.requests:
                    outputs.append(self.engine.pop_output(request_id))
            except Exception:  # the engine is broken (what failed the step): forget the request
                self.engine.requests.pop(request_id, None)
            _send(tracked, Failed(message))
        self._tracked.clear()
        if outputs and self.on_step is not None:
            try:
                self.on_step(self.engine, outputs, 0)  # the metrics count the failures
            except Exception:
                _log("the metrics could not count the failed requests", traceback.format_exc())

    def _publish(self) -> None:
        """Every tracked request's new tokens and text; the finished ones' outputs."""
        engine = self.engine
        finished: list[RequestOutput] = []
        num_new_tokens = 0
        for request_id, tracked in list(self._tracked.items()):
            req = engine.requests[request_id]
            if req.error is None:
                try:
                    deltas = [d for d in (self._delta(seq, tracked) for seq in req.seqs) if d is not None]
                except Exception as error:  # this request's text: it fails alone
                    message, trace = f"{type(error).__name__}: {error}", traceback.format_exc()
                    if not engine.fail(request_id, message, trace):
                        # it finished this step: its last text is lost all the same
                        req.error, req.error_trace = message, trace
                else:
                    for delta in deltas:
                        num_new_tokens += len(delta.token_ids)
                        _send(tracked, delta)
            if req.finished and req.finish_time is not None:
                output = engine.pop_output(request_id)
                del self._tracked[request_id]
                finished.append(output)
                if output.error is not None:  # once, with the traceback where the fault was ours
                    _log(f"request {request_id} failed: {output.error}", req.error_trace or "")
                _send(tracked, Finished(output) if output.error is None else Failed(output.error))
        if self.on_step is not None:
            self.on_step(engine, finished, num_new_tokens)

    def _delta(self, seq: SequenceState, tracked: _Tracked) -> Delta | None:
        stream = tracked.samples.get(seq.sample_index)
        if stream is None:
            text_stream = TextStream(self.decode, self.token_bytes, tracked.holdback)
            if tracked.context is None:  # (once a request: its samples share the prompt)
                context = getattr(self.token_bytes, "context", None)
                tracked.context = ([], 0) if context is None else context(seq.token_ids, seq.request.num_prompt_tokens)
            text_stream.start_after(*tracked.context)
            stream = tracked.samples[seq.sample_index] = _SampleStream(text_stream)
        if stream.done:
            return None
        output = seq.output_ids
        new_ids = output[stream.num_sent_tokens :]
        reason = seq.finish_reason
        if not new_ids and reason is None:
            return None
        eos = self.engine.eos_token_ids
        # (on "stop" / "length" the engine's final text: cut before a stop string, EOS dropped)
        new_text = stream.text.advance([t for t in new_ids if t not in eos], reason, seq.text)
        logprobs = seq.logprobs[stream.num_sent_tokens : len(output)] if seq.logprobs else []
        stream.num_sent_tokens = len(output)
        stream.done = reason is not None
        return Delta(seq.sample_index, new_text, new_ids, logprobs, reason)


def _log(what: str, trace: str) -> None:
    print(f"kvpool serve: {what}" + (f":\n{trace}" if trace else ""), file=sys.stderr)


def _send(tracked: _Tracked, event: Event) -> None:
    try:
        tracked.loop.call_soon_threadsafe(tracked.queue.put_nowait, event)
    except RuntimeError:  # the handler's loop has closed (the server is going down)
        pass
