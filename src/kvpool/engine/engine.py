"""The engine: requests in, tokens out, over any ModelRunner.

Each step the scheduler (continuous batching under a token budget):
  1. gives every running sequence its next chunk, in arrival order: one token for a
     decode, up to the remaining budget for a prompt still being prefilled (chunked
     prefill), and reserves room for all of them in one call to the runner. Only when the
     cache cannot hold that step does it go sequence by sequence, preempting the
     latest-arrived running sequence (released as preempted: the runner drops its cache, or
     swaps it to the host tier in swap mode; it is admitted again later) until each
     reservation fits;
  2. admits waiting sequences in arrival order with the budget left (the runner looks up
     their cached prefix, so only the uncached part is prefilled).
After the forward it samples every sequence's next token, commits the step's tokens and
the sampled ones in one call, forks parallel samples off a finished prompt, and releases
what finished.
A sequence that fits the pool alone always makes progress (the oldest is never the
victim of a younger one), so the loop cannot deadlock. The scheduler only asks the runner
"can this sequence get N more tokens?"; it never sees blocks or tensors.
"""

from __future__ import annotations

import codecs
import copy
import itertools
import math
import numbers
import operator
import time
import traceback
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import compress, islice, repeat
from typing import Any, TypeVar

import numpy as np
import torch

from kvpool.cache.types import CheckedPrompt, LookupPrompt, MMItem, ReleaseReason
from kvpool.engine.batch_sampler import BatchSampler, StepSampler
from kvpool.engine.runner import ModelRunner, ScheduledChunk, StepChunks
from kvpool.engine.sampling import (
    NonFiniteLogitsError,
    SamplingParams,
    checked_seed,
    derived_seed,
    processed_logits,
    sample_token,
    token_logprobs,
)
from kvpool.pool import token_bytes
from kvpool.pool.hashing import TOKEN_BYTES

_T = TypeVar("_T")
# ScheduledChunk(...) without the named tuple's Python-level __new__: the engine makes one
# per sequence per step
_new_chunk = tuple.__new__
_NEEDS_LOGITS = operator.attrgetter("needs_logits")
_TOKEN_IDS, _REQUEST, _NUM_COMPUTED = map(operator.attrgetter, ("token_ids", "request", "_num_computed"))
_NO_IDS: frozenset[int] = frozenset()
_STOP_IDS, _END_LEN = map(operator.attrgetter, ("stop_ids", "end_len"))
LATENCY_SAMPLES = 1 << 16  # admit / reserve_step latencies kept per kind (the latest)


def _leads(running: list[SequenceState], seqs: list[SequenceState]) -> bool:
    """Whether `running` begins with `seqs`, the same objects in the same order (no longer
    than it). Lists compared with ==: a sequence equals only itself (SequenceState's eq=False),
    and the list's compare tests identity before equality, so a match is a pointer compare a
    row in C; the twin, all(map(operator.is_, running, seqs)), is held to it by
    tests/test_engine_scheduler.py."""
    return (running if len(running) == len(seqs) else running[: len(seqs)]) == seqs


class _SpmRuns:
    """A sequence's byte-fallback runs as a SentencePiece-style decoder reads its output's
    tokens of text (Engine._spm_window): the runs that ended, (start, end, valid) in text
    tokens, those the stop-string window may still cut; the trailing run's start (None: the
    last token of text is no byte) and its validity so far (UTF-8 checked a byte at a time);
    the text before it (its last characters) and the last window's text."""

    __slots__ = ("closed", "num_text", "start", "broken", "decoder", "before", "window", "end")

    def __init__(self) -> None:
        self.closed: deque[tuple[int, int, bool]] = deque()
        self.num_text = 0
        self.start: int | None = None
        self.broken = False
        self.decoder = codecs.getincrementaldecoder("utf-8")("strict")
        self.before = ""
        self.window = ""
        self.end = 0  # the sequence's length (tokens) it was brought up to

    @property
    def valid(self) -> bool:
        """Whether the trailing run's bytes are UTF-8 text (then it decodes as that text)."""
        return not self.broken and not self.decoder.getstate()[0]

    def add(self, token: int, byte: int | None, window: str) -> None:
        """One more token of text (`byte`: its byte, None for a piece); `window`: the text
        before it (the last window), kept where a run starts."""
        if byte is None:
            if self.start is not None:
                self.closed.append((self.start, self.num_text, self.valid))
                self.start = None
        else:
            if self.start is None:
                self.start, self.broken, self.before = self.num_text, False, window
                self.decoder.reset()
            if not self.broken:
                try:
                    self.decoder.decode(bytes((byte,)))
                except UnicodeDecodeError:
                    self.broken = True
        self.num_text += 1


# eq=False: a sequence (a request) is itself, compared by identity. The engine's queue
# removals and membership tests (`seq in self.running`) compared every field of every
# element they passed, the token lists included, at a request's finish or preemption.
@dataclass(slots=True, eq=False)
class SequenceState:
    seq_id: str
    request: RequestState
    sample_index: int
    # prompt + generated so far. Sequence 0's list is the prompt's list add_request made or
    # was handed (no copy of it: the request keeps no other), given back by pop_output cut
    # to the prompt; a forked sequence's is a copy of its parent's
    token_ids: list[int]
    # its tokens computed, the engine's to set (read `num_computed`): while the sequence is a
    # row of its engine's decode columns (`owner` not None) the columns' `computed` holds the
    # count and this slot the count as of when the columns last wrote theirs back (the engine
    # reads and writes the slot where it knows the row is no column's, or wrote them back)
    _num_computed: int = 0
    in_runner: bool = False  # admitted (holds cache) in the runner
    finish_reason: str | None = None
    text: str = ""
    logits: list[torch.Tensor] = field(default_factory=list)  # recorded when the engine asks
    # per output token, when the params ask (SamplingParams.logprobs): (log-probability of
    # the sampled token, the most likely tokens' (id, log-probability), most likely first)
    logprobs: list[tuple[float, list[tuple[int, float]]]] = field(default_factory=list)
    # the prompt as add_request packed it, for the first admission's lookup (then dropped)
    prompt: LookupPrompt | None = None
    # with stop strings: the output's last tokens of text, as of a length of text_tail_end
    # tokens (Engine._text_tail)
    text_tail: deque[int] | None = None
    text_tail_end: int = 0
    # with stop strings and a SentencePiece-style decoder: its byte-fallback runs (_SpmRuns)
    spm_runs: _SpmRuns | None = None
    # a SentencePiece-style decoder's prompt context (Engine._output_text): its tokens and text
    spm_context: tuple[list[int], str] | None = None
    # the engine whose decode columns hold this sequence's computed count (`Engine._owned`),
    # else None
    owner: Engine | None = field(default=None, init=False, repr=False)

    @property
    def num_computed(self) -> int:
        """Its tokens computed (the next chunk's start): its engine's columns' count while it
        is a row of them (written back into the sequences first, where a take moved it on),
        so a reader between or during steps (the server's and the simulator's views, a test)
        sees the true count."""
        owner = self.owner
        if owner is not None and owner._columns_moved:
            owner._write_back_columns()
        return self._num_computed

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.request.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.request.num_prompt_tokens  # (no copy of the output)


@dataclass(slots=True, eq=False)
class RequestState:
    request_id: str
    num_prompt_tokens: int  # every sequence's token ids begin with the prompt's (`prompt_ids`)
    params: SamplingParams
    arrival_time: float
    seqs: list[SequenceState] = field(default_factory=list)
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache at first admission
    first_admitted: bool = False
    first_token_time: float | None = None
    finish_time: float | None = None
    error: str | None = None
    error_trace: str | None = None  # the traceback of a contained fault, for the operator's log
    forked: bool = False
    tenant: str = ""  # the cache's tenant salt: no prefix is shared across tenants
    # What ends a sequence of it, fixed at add_request and read per token (_accept_token): its
    # length in tokens at which it ends by length (prompt + max_tokens, or the runner's
    # max_model_len where that is less: one comparison a token), the ids that stop it (the
    # engine's EOS ids, none with ignore_eos, and its stop_token_ids: `_stop_ids`), whether
    # its stop strings are matched in decoded text
    end_len: int = 0
    stop_ids: frozenset[int] = frozenset()
    matches_text: bool = False
    # its logits are changed before sampling (penalties, logit_bias, min_tokens: `processed_logits`)
    controls: bool = False
    # one sample, no logprobs, no controls: its decode tokens take the step's inline path
    plain: bool = False
    # plain, its first token taken (by `_accept_token`) and no stop strings to match in text:
    # a batched decode step takes its tokens in one tight loop (`_take_inline_tokens`)
    inline: bool = False

    @property
    def prompt_ids(self) -> list[int]:
        """The prompt's ids, a copy: sequence 0's first `num_prompt_tokens` (the request holds
        no list of its own: a chat prompt's copy, and its free, touch every id's int)."""
        return self.seqs[0].token_ids[: self.num_prompt_tokens]

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.seqs) and (self.forked or self.params.n == 1)


@dataclass(slots=True, eq=False)
class _DecodeColumns:
    """Decode rows as columns: the leading running sequences, in order, that the last step
    took as plain requests' inline decode tokens (`_take_column_tokens`, `_take_inline_tokens`)
    and that did not end there. Each is then one token behind (its last, the one sampled), so
    the next step plans, samples and takes these rows from the columns (`_plan_running`,
    `_take_column_tokens`) in C-level passes, without reading each sequence's attributes
    again: at a fleet run's scale every object a row touches is a likely cache miss. Rows
    that end leave the columns (`without`); rows that join the running list behind them join
    them once a step took them inline (`joined`). Row i is seqs[i]; the lists are never
    mutated (a step replaces `computed` and `last_tokens` with new ones)."""

    seqs: list[SequenceState]
    ids: list[str]  # seqs[i].seq_id
    token_lists: list[list[int]]  # seqs[i].token_ids: the lists themselves, which the take appends to
    # seqs[i]'s computed count = len(token_lists[i]) - 1: the next chunk's start. While the
    # columns are the engine's (`Engine._owned`), the count is theirs: a take moves it on
    # here alone, and it is written back into the sequence where the row leaves (`without`),
    # the columns are given up, or something reads the sequence's `num_computed`
    computed: list[int]
    last_tokens: list[int]  # token_lists[i][-1]: the next chunk's one token
    row_stop_ids: list[frozenset[int]]  # seqs[i].request.stop_ids
    # the number of the engine step (`Engine._step_no`) whose token brings seqs[i] to its end
    # length, seqs[i].request.end_len: each step takes one token a row, so the number stays
    # as it is while the row is in the columns (no pass a step over the rows' lengths); a row
    # ends by length in step t exactly where end_steps[i] == t (none is below the step's own).
    # That holds because columns outlive no step that took no token: `step` drops them before
    # its forward, so a step that raises leaves none (the next step forms them anew)
    end_steps: list[int]
    stop_ids: frozenset[int] | None  # every row's stop ids where they are one set; None: they differ
    # at most the least of end_steps: no row ends by length before that step. A bound, not
    # the least itself, once rows left (`without`): the take finds the least where the
    # bound says a row may end
    first_end: int

    def joined(self, other: _DecodeColumns) -> _DecodeColumns:
        """These rows, then `other`'s."""
        stop_ids = self.stop_ids if self.stop_ids is not None and self.stop_ids == other.stop_ids else None
        return _DecodeColumns(
            self.seqs + other.seqs,
            self.ids + other.ids,
            self.token_lists + other.token_lists,
            self.computed + other.computed,
            self.last_tokens + other.last_tokens,
            self.row_stop_ids + other.row_stop_ids,
            self.end_steps + other.end_steps,
            stop_ids,
            min(self.first_end, other.first_end),
        )

    def without(self, rows: list[int], fresh: bool = False) -> _DecodeColumns | None:
        """The rows but `rows` (increasing row numbers: those that ended), or None where none
        is left. (Each column copied, then those rows deleted: a step ends a few rows of many,
        and a copy and a few deletions cost a third of a filter of every row.) fresh: these
        columns' lists were made for this step alone (`joined`, `_form_columns`), nothing
        else holds them: the rows are deleted from them in place, no copy."""
        # (the rows that leave take their computed count with them: `computed`)
        seqs, computed = self.seqs, self.computed
        for i in rows:
            seq = seqs[i]
            seq._num_computed, seq.owner = computed[i], None
        if len(rows) == len(self.seqs):
            return None
        columns = (
            self.seqs,
            self.ids,
            self.token_lists,
            self.computed,
            self.last_tokens,
            self.row_stop_ids,
            self.end_steps,
        )
        if not fresh:
            columns = tuple(column.copy() for column in columns)
        for i in reversed(rows):
            for column in columns:
                del column[i]
        # (the bound over every row bounds the least of those left)
        return _DecodeColumns(*columns, self.stop_ids, self.first_end)


@dataclass
class EngineStats:
    """What the engine measures itself: steps, preemptions, and the latency of the runner's
    admit / reserve_step calls, apart for the calls that took blocks from the pools and the ones
    that took none (a decode inside its block)."""

    num_steps: int = 0
    num_preemptions: int = 0
    # sequences released after a step that raised, to be recomputed (`_after_a_fault`): no
    # preemption (nothing ran out), counted apart
    num_fault_recomputes: int = 0
    num_prefill_tokens: int = 0  # tokens computed in prompt chunks (recomputation after preemption included)
    num_decode_tokens: int = 0  # tokens computed one per step after the prompt
    num_alloc_calls: int = 0
    num_noop_calls: int = 0
    # the latest calls' seconds, for percentiles: bounded, so a long-running engine holds a
    # fixed amount whatever it has served
    alloc_call_s: deque[float] = field(default_factory=lambda: deque(maxlen=LATENCY_SAMPLES))  # allocated
    noop_call_s: deque[float] = field(default_factory=lambda: deque(maxlen=LATENCY_SAMPLES))  # took nothing


@dataclass(frozen=True)
class Completion:
    token_ids: list[int]
    text: str
    finish_reason: str  # "stop" (EOS, a stop_token_ids id or a stop string), "length", "abort"
    # with SamplingParams(logprobs=k), one entry per token id: (the sampled token's
    # log-probability, the k most likely tokens' (id, log-probability), most likely first);
    # None when not asked for
    logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None


@dataclass(frozen=True)
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    completions: list[Completion]
    num_cached_tokens: int
    ttft_s: float | None
    tpot_s: float | None
    latency_s: float | None
    error: str | None = None  # set when the request failed (Engine.fail): why


class Engine:
    def __init__(
        self,
        runner: ModelRunner,
        *,
        max_num_batched_tokens: int = 512,
        max_num_seqs: int = 64,
        eos_token_ids: Sequence[int] = (),
        decode_text: Callable[[list[int]], str] | None = None,
        textless_ids: Iterable[int] = (),
        byte_fallback: Mapping[int, int] | None = None,
        record_logits: bool = False,
        clock: Callable[[], float] = time.perf_counter,
        sampler: Callable[[torch.Tensor, SamplingParams, int, int], int] = sample_token,
        batched_sampling: bool = False,
        step_sampler: StepSampler | None = None,
        seed: int = 0,
    ):
        """record_logits: keep each logit row a sequence samples from (`SequenceState.logits`,
        for tests against a reference); `generate` then leaves its finished requests in
        `requests`, for those rows to be read.
        seed: where the seeds of requests that give none come from (`seed_for`): the
        k-th such request samples with `derived_seed(seed, k)`, so two unseeded requests draw
        different tokens and a run (the same requests in the same order) draws the same again.
        textless_ids: tokens `decode_text` gives no text for (special tokens, skipped):
        the stop-string check reaches past them. byte_fallback: a SentencePiece-style
        `decode_text`'s byte-fallback tokens, id -> byte (None: byte-level BPE); the
        stop-string check follows their runs (_SpmRuns). clock: when things happen (the simulator's
        is virtual). sampler: (a row of the runner's logits, params, sample index, output
        position) -> token id; a runner without a model (sim/runner.py) returns rows its own
        sampler reads.
        batched_sampling: sample a step's rows at once on the logits' device
        (batch_sampler.py `sample_batch`, one host synchronisation a step) instead of `sampler`
        row by row; greedy tokens are the same, stochastic ones are drawn differently.
        step_sampler: what a batched step samples with (default: a `BatchSampler` of the
        logits); a runner without a model passes its own (the simulator's `AnswerSampler`:
        the same tokens as its per-row `sampler`), so its steps take the batched path."""
        if step_sampler is not None and not batched_sampling:
            raise ValueError("step_sampler samples batched steps: pass batched_sampling=True with it")
        if max_num_batched_tokens <= 0 or max_num_seqs <= 0:
            raise ValueError(
                f"max_num_batched_tokens and max_num_seqs must be positive, "
                f"got {max_num_batched_tokens}, {max_num_seqs}"
            )
        self.reseed(seed)
        self.runner = runner
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.eos_token_ids = frozenset(eos_token_ids)
        self.decode_text = decode_text
        self.textless_ids = frozenset(textless_ids)
        self.byte_fallback = dict(byte_fallback) if byte_fallback else None
        # a byte token of an ASCII letter: put before a window, it joins a byte run without
        # changing its validity, and keeps the decoder's first-space strip off the window
        self._plain_byte = None
        if self.byte_fallback:
            from kvpool.models.tokenizer import ascii_letter_byte  # (as decode_context: not the simulator's)

            self._plain_byte = ascii_letter_byte(self.byte_fallback)
        self.record_logits = record_logits
        self.clock = clock
        self.sampler = sampler
        self.batched_sampling = batched_sampling
        # the batched steps' (BatchSampler keeps a batch's rows while it runs)
        self._batch_sampler: StepSampler = BatchSampler() if step_sampler is None else step_sampler
        # A fault of one request's own work (its sampling, stop-string text or fork) fails
        # that request alone (`fail`, RequestOutput.error) when this is set; else it raises,
        # as any bug does. Only a consumer that reads `error` sets it (the server's engine
        # thread): elsewhere a contained fault would pass as a quietly aborted request.
        self.contain_request_faults = False
        # A plain request's decode tokens are taken inline in `step` (the common token), not
        # through `_accept_token`; off: every token goes through it and its stop checks in full
        # (`_stop_reason`, without the shortcut for a token that ends nothing: the twin, for tests)
        self.inline_decode = True
        self.requests: dict[str, RequestState] = {}
        # requests held with `controls` (added, not yet popped): while none is, a batched step
        # looks at no row's (`_sample_step`); one forgotten otherwise costs that look alone
        self._num_controlled = 0
        self.waiting: deque[SequenceState] = deque()
        self.running: list[SequenceState] = []
        self._scheduled: list[SequenceState] = []  # the sequences of the last schedule(), in chunk order
        self._step_ids: list[str] = []
        # the sequences and ids of the last step where it was a decode of every one of them
        # that ended none (so each is one token behind now), else None (`_plan_running`)
        self._decode_rows: list[SequenceState] | None = None
        self._decode_ids: list[str] = []
        self._step_counts: list[int] = []
        self._step_num_tokens = 0  # sum(self._step_counts)
        # the leading running sequences as columns (_DecodeColumns), else None; `_plan_running`
        # plans from them when the running sequences still begin with those rows
        # (`_plan_columns`, with `_plan_ends`: each row's chunk end), and the step takes their
        # tokens (its leading chunks) through them (`_step_columns`) where its reservation held
        self._columns: _DecodeColumns | None = None
        self._plan_columns: _DecodeColumns | None = None
        self._plan_ends: list[int] = []
        self._step_columns: _DecodeColumns | None = None
        # The columns whose rows' computed counts are theirs (`_DecodeColumns.computed`; each
        # row's `owner` is this engine), from the take that formed them (`_next_columns`) until
        # rows leave them (`without`) or they are given up (`_give_up_columns`): the one of
        # `_columns` (between steps) and `_step_columns` (in a step, up to its take) that holds
        # rows, else None. _columns_moved: a take moved the counts on since they were last
        # written back into the sequences (a read of a row's `num_computed` writes them back)
        self._owned: _DecodeColumns | None = None
        self._columns_moved = False
        self.stats = EngineStats()
        # the steps started so far (with chunks), numbering them, a step that raised among
        # them: the decode columns' end_steps count in it, and as `step` drops the columns
        # before its forward, the steps the columns live through are steps that took a token
        # a row (stats.num_steps counts the same, but stats are the caller's to read)
        self._step_no = 0
        self._ids = itertools.count()
        # While a step takes its tokens and commits them: its chunks, and whether its commit
        # began (`_undo_take` reads them when that part raises); None between steps
        self._taking: list[ScheduledChunk] | StepChunks | None = None
        self._committing = False
        # Sequences that left the running list and the queue (finished, preempted, a fault's
        # recompute) whose cache the runner has not released yet: seq id -> the release's
        # reason, in release order. The bookkeeping comes first, then `_release_pending`; a
        # release that raises (Ctrl-C landing in it, a tier's fault) stays listed and is done
        # again before the next step schedules anything (the runner's release is once only:
        # a repeat of one that ran is False), so no sequence is half gone and no block leaks.
        self._unreleased: dict[str, ReleaseReason] = {}
        # Sequences finished (aborted) while their release waited there (a preemption's, a
        # fault's recompute: it raised): the finish's own release follows it, as it follows
        # the completed release of a sequence that waits, so that the cache drops the marks
        # the first one set (preempted, to recompute); one call in place of two kept them
        self._release_again: set[str] = set()
        # the ids of requests a step finished whose releases raised: the next step reports
        # them (each request reported once)
        self._unreported: list[str] = []

    @property
    def num_preemptions(self) -> int:
        return self.stats.num_preemptions

    @property
    def num_steps(self) -> int:
        return self.stats.num_steps

    @property
    def last_step_sequences(self) -> tuple[SequenceState, ...]:
        """The sequences the last schedule gave a chunk (the last step's, once it ran), in
        chunk order: those that finished in it included, which `running` no longer holds
        (engine/live.py counts their reads)."""
        return tuple(self._scheduled)

    # ---- public API -----------------------------------------------------------------

    def add_request(
        self,
        prompt_ids: Sequence[int] | LookupPrompt,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        arrival_time: float | None = None,
        tenant: str = "",
    ) -> str:
        """Queue a request. ValueError (and nothing queued) for an empty or too-long prompt,
        or a tenant that is not text UTF-8 can encode (a lone surrogate).
        `arrival_time` (on the engine's clock; default: now) is where TTFT counts from.
        `tenant` salts the request's prefix chain: it hits only its own tenant's cache.
        `prompt_ids` may be `pack_prompt`'s packing of them (the simulator's router packed
        it for its lookups): its admission then hashes no block those lookups hashed, and its
        ids are not checked again (a CheckedPrompt's tuple cannot have changed since
        pack_prompt checked it): copied once into the engine's list, or, where they are a
        list (the simulator's `turn_prompt`, which hands the list over: its caller reads it
        no more), kept as that list, not copied. A LookupPrompt built otherwise is checked:
        ValueError where its bytes are not its ids' packing. The engine's list of the
        prompt is the request's sequence's token list (its tokens are appended to it), which
        `pop_output` gives back cut to the prompt. TypeError, nothing queued, for params that
        are no SamplingParams, a request id or tenant that is no str, an arrival time that is
        no finite number (an id of 7 was taken as it was; an arrival of "0" was taken and
        failed `output` after the request was served; nan made its TTFT nan)."""
        if params is not None and not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
        if request_id is not None and not isinstance(request_id, str):
            raise TypeError(f"request_id must be a str, got {type(request_id).__name__}")
        if not isinstance(tenant, str):
            raise TypeError(f"tenant must be a str, got {type(tenant).__name__}")
        if arrival_time is not None:
            if type(arrival_time) is not float:  # (numpy's numbers too: numbers.Real, taken as floats)
                if isinstance(arrival_time, bool) or not isinstance(arrival_time, numbers.Real):
                    raise TypeError(f"arrival_time must be a finite number of seconds, got {arrival_time!r}")
                arrival_time = float(arrival_time)
            if not math.isfinite(arrival_time):
                raise TypeError(f"arrival_time must be a finite number of seconds, got {arrival_time!r}")
        params = params or SamplingParams()
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        try:
            tenant.encode()  # here, not in the step's admission, where it would fail the batch
        except UnicodeEncodeError as error:
            raise ValueError(
                f"request {request_id!r}: tenant {tenant!r} is not valid Unicode text ({error.reason} at {error.start})"
            ) from None
        if type(prompt_ids) is CheckedPrompt:
            prompt, packed = self._from_checked(prompt_ids, request_id)
        else:
            prompt, packed = self._check_prompt(prompt_ids, request_id)
        self._check_token_params(params, request_id)
        if params.seed is None:  # (after the checks: a refused request takes no seed)
            params = self.seed_for(params)
        limit = self.runner.max_model_len
        arrival = self.clock() if arrival_time is None else arrival_time
        controls = params.transforms_logits
        req = RequestState(
            request_id,
            len(prompt),
            params,
            arrival,
            tenant=tenant,
            # the runner's max_model_len as of now: it is set before any request is added
            # (engine/build.py's limit_model_len) and not changed after; _stop_reason reads it live
            end_len=min(len(prompt) + params.max_tokens, limit),
            stop_ids=self._stop_ids(params),
            matches_text=bool(params.stop) and self.decode_text is not None,
            plain=params.n == 1 and params.logprobs is None and not controls,
            controls=controls,
        )
        if controls:
            self._num_controlled += 1
        # (the engine's list of the prompt: the sequence's tokens are appended to it)
        seq = SequenceState(f"{request_id}/0", req, 0, prompt, prompt=packed)
        req.seqs.append(seq)
        self.requests[request_id] = req
        self.waiting.append(seq)
        return request_id

    def reseed(self, seed: int) -> None:
        """Start the seeds of unseeded requests (`seed_for`) afresh from `seed`."""
        self.seed = checked_seed(seed)
        self._num_unseeded = 0  # the requests given a seed by `seed_for` since

    def seed_for(self, params: SamplingParams) -> SamplingParams:
        """params with the engine's next seed, for a request that gives none (vLLM's rule:
        unseeded requests draw independently, each from its own stream). Every request the
        engine takes has a seed from here on: the samplers read it (a greedy one's too, in
        the simulator's answers)."""
        seeded = copy.copy(params)  # (not dataclasses.replace: its checks ran when params was made)
        object.__setattr__(seeded, "seed", derived_seed(self.seed, self._num_unseeded))
        self._num_unseeded += 1
        return seeded

    def _from_checked(self, prompt: CheckedPrompt, request_id: str) -> tuple[list[int], LookupPrompt]:
        """`pack_prompt`'s packing: its ids Python ints that are its bytes' ids
        (types.CheckedPrompt), never empty. The engine's list of them is the prompt's own
        list where it is one (`turn_prompt`'s, handed over), else one copy of its tuple; one
        C-level pass over the bytes for the vocabulary: the same errors as `_check_prompt`'s,
        without the ids read again to check them."""
        ids = prompt.token_ids
        if type(ids) is not list:
            ids = list(ids)
        elif len(prompt.packed) != TOKEN_BYTES * len(ids):  # (a handed-over list taken once and grown since)
            raise ValueError(f"request {request_id!r}: the packed prompt is not the packing of its token ids")
        self._check_shape(len(ids), prompt.mm_items, request_id)
        self.check_length(len(ids), request_id)
        vocab = self.runner.vocab_size
        data = np.frombuffer(prompt.packed, dtype="<u4")  # (not empty: _check_shape)
        if int(data.max()) >= vocab:  # (packed: ids in [0, 2**32))
            # the ids the bytes hold, as the cache reads them
            raise self._outside_vocabulary(data[data >= vocab].tolist(), request_id)
        # over the engine's own list, as `_check_prompt`'s (its bytes and memo of hashes shared)
        return ids, LookupPrompt(ids, (), prompt.packed, prompt.hashes)

    @staticmethod
    def _check_shape(num_tokens: int, mm_items: tuple[MMItem, ...], request_id: str) -> None:
        """ValueError (the request's id named) for an empty prompt or multimodal items: the
        checks of both kinds of prompt (`_check_prompt`, `_from_checked`) before their ids'."""
        if not num_tokens:
            raise ValueError(f"request {request_id!r}: the prompt is empty")
        if mm_items:
            raise ValueError(f"request {request_id!r}: the engine takes no multimodal items ({len(mm_items)} given)")

    def _stop_ids(self, params: SamplingParams) -> frozenset[int]:
        """The ids that end a request's sample: the engine's EOS ids (none with ignore_eos) and
        its stop_token_ids. Without stop_token_ids the engine's own set, one object that every
        such request shares (`_DecodeColumns` compares its rows' sets, identity first)."""
        base = _NO_IDS if params.ignore_eos else self.eos_token_ids
        return base.union(params.stop_token_ids) if params.stop_token_ids else base

    def _check_token_params(self, params: SamplingParams, request_id: str) -> None:
        """ValueError (the request's id and the field named) for sampling parameters that name
        a token id outside the model's vocabulary (stop_token_ids)."""
        vocab = self.runner.vocab_size
        for name, ids in (("stop_token_ids", params.stop_token_ids), ("logit_bias", [t for t, _ in params.logit_bias])):
            bad = [t for t in ids if t >= vocab]
            if bad:
                raise ValueError(
                    f"request {request_id!r}: {name}: token ids {bad[:5]} outside the vocabulary [0, {vocab})"
                )

    def _outside_vocabulary(self, bad: list[int], request_id: str) -> ValueError:
        """The error for a prompt whose ids `bad` (in order) are outside the vocabulary."""
        vocab = self.runner.vocab_size
        return ValueError(f"request {request_id!r}: token ids {bad[:5]} outside the vocabulary [0, {vocab})")

    def check_length(self, num_tokens: int, request_id: str) -> None:
        """ValueError (the request's id named) for a prompt of `num_tokens` that leaves no room
        for one output token within max_model_len."""
        limit = self.runner.max_model_len
        if num_tokens >= limit:
            raise ValueError(
                f"request {request_id!r}: prompt of {num_tokens} tokens is too long; "
                f"at most {limit - 1} tokens fit (max_model_len {limit}, leaving room for one output token)"
            )

    def _check_prompt(
        self, prompt_ids: Sequence[int] | LookupPrompt, request_id: str
    ) -> tuple[list[int], LookupPrompt]:
        """The prompt's ids as the engine's own list of Python ints, and their packing over
        it; ValueError (the request's id named) for an empty or too-long prompt, multimodal
        items, an id that is no integer or outside the vocabulary, or a LookupPrompt whose
        bytes are not its ids' (its list changed after packing, or built by hand)."""
        packed = prompt_ids if isinstance(prompt_ids, LookupPrompt) else None
        prompt = list(packed.token_ids if packed is not None else prompt_ids)
        self._check_shape(len(prompt), packed.mm_items if packed is not None else (), request_id)
        # The ids as Python ints, in one C pass where they are (the common case): `sum` stays
        # an exact int over exact ints and bools, and turns into a numpy or torch integer (or
        # a float) at the first such id; only then is every id converted (as int() does)
        try:
            total = sum(prompt)
        except TypeError:  # (a str, bytes, None... among the ids)
            bad = next((t for t in prompt if not isinstance(t, (int, float, np.number, torch.Tensor))), None)
            raise ValueError(f"request {request_id!r}: token ids must be integers, got {bad!r}") from None
        hashes = packed.hashes if packed is not None else {}
        if type(total) is not int:
            prompt = list(map(int, prompt))
            packed, hashes = None, {}  # (its list held other ids than ints: packed anew)
        self.check_length(len(prompt), request_id)
        vocab = self.runner.vocab_size
        stale = False
        data = b""
        try:
            data = token_bytes(prompt)  # checked and packed once: the admission's lookup reuses it
            # (a LookupPrompt's list changed after packing, or one built by hand)
            stale = packed is not None and packed.packed != data
            top = int(np.frombuffer(data, dtype="<u4").max())  # (packed: ids in [0, 2**32))
        except ValueError:
            top = -1  # an id below 0 or past 2**32: named below
        if stale:
            raise ValueError(f"request {request_id!r}: the packed prompt is not the packing of its token ids")
        if not 0 <= top < vocab:
            raise self._outside_vocabulary([t for t in prompt if not 0 <= t < vocab], request_id)
        # The packing over the engine's own list (the caller's may change after this call; its
        # bytes and memo of hashes are shared): the bytes are these ids' (checked or packed
        # just now), so the admission compares the ids and does not pack them again
        return prompt, LookupPrompt(prompt, (), data, hashes)

    def abort(self, request_id: str) -> bool:
        """Cancel a request at any point; its cache is released once. False if unknown or done.
        A release that raises (Ctrl-C) raises here with the request aborted all the same; the
        release is done again at the next step."""
        if not self._abort(request_id):
            return False
        self._release_pending()
        return True

    def _abort(self, request_id: str) -> bool:
        """`abort` without the releases: they wait in `_unreleased`."""
        req = self.requests.get(request_id)
        if req is None or req.finished:
            return False
        for seq in req.seqs:
            if seq.finish_reason is None:
                self._finish(seq, "abort")
                if self.decode_text is not None:  # its text so far (it was "", beside the output's token ids)
                    seq.text = self._output_text(seq, seq.output_ids)
        req.forked = True  # no fork is coming any more
        req.finish_time = self.clock()
        return True

    def fail(self, request_id: str, message: str, trace: str | None = None) -> bool:
        """End a request because serving it raised (its sampling, its text): aborted like a
        cancel, its blocks released once, `message` in its output's `error` (what the client
        is told) and `trace` in the request's `error_trace` (what the operator's log shows).
        False if unknown or done."""
        if not self._fail(request_id, message, trace):
            return False
        self._release_pending()
        return True

    def _fail(self, request_id: str, message: str, trace: str | None) -> bool:
        """`fail` without the releases: they wait in `_unreleased`."""
        req = self.requests.get(request_id)
        if req is None or req.finished:
            return False
        req.error, req.error_trace = message, trace
        return self._abort(request_id)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix of the runner's device cache (vLLM's
        `LLM.reset_prefix_cache`: after a weights update, or between benchmark runs); True when
        done. False, nothing changed, while a request runs or waits preempted with its cache
        swapped out (their blocks are in use): finish or abort them first. Requests that wait
        unadmitted stay queued and find no hit. The tiers below the device pool keep their
        entries (their keys carry the descriptor's weights version)."""
        self._release_pending()  # (a finished request whose release raised holds its blocks until then)
        return self.runner.reset_prefix_cache()

    def has_unfinished(self) -> bool:
        """Requests wait or run, or a step's work is left over from a fault: a release that
        raised (`_unreleased`), finished requests not yet reported (`_unreported`); the next
        step does it."""
        return bool(self.waiting or self.running or self._unreleased or self._unreported)

    def output(self, request_id: str) -> RequestOutput:
        req = self.requests[request_id]
        return self._output(req, req.prompt_ids)

    def _output(self, req: RequestState, prompt_ids: list[int]) -> RequestOutput:
        # (the logprobs were dropped here: asked for, computed per token, and never given back)
        asked = req.params.logprobs is not None
        completions = [
            Completion(
                s.output_ids,
                s.text if self.decode_text else "",
                s.finish_reason or "",
                list(s.logprobs) if asked else None,
            )
            for s in req.seqs
        ]
        ttft = None if req.first_token_time is None else req.first_token_time - req.arrival_time
        n_out = max(s.num_output_tokens for s in req.seqs)  # (counted: no second copy of the outputs)
        tpot = None
        if req.finish_time is not None and req.first_token_time is not None and n_out > 1:
            tpot = (req.finish_time - req.first_token_time) / (n_out - 1)
        latency = None if req.finish_time is None else req.finish_time - req.arrival_time
        return RequestOutput(
            req.request_id, prompt_ids, completions, req.num_cached_tokens, ttft, tpot, latency, req.error
        )

    def pop_output(self, request_id: str) -> RequestOutput:
        """The output of a finished request, which the engine then forgets (a long-running
        server or simulator keeps no finished request), its state freed at once (no cycle
        left for the collector). ValueError while it runs."""
        req = self.requests.get(request_id)
        if req is None:
            raise ValueError(f"unknown request id {request_id!r}")
        if not req.finished or req.finish_time is None:
            raise ValueError(f"request {request_id!r} has not finished")
        # The prompt given back is sequence 0's own list cut to the prompt (the completions
        # are copies of the outputs, made first): no copy of the prompt, whose ids the
        # simulator's next turn extends in place (sim/simulator.py turn_prompt)
        tokens = req.seqs[0].token_ids
        out = self._output(req, tokens)
        del tokens[req.num_prompt_tokens :]
        del self.requests[request_id]
        if req.controls:
            self._num_controlled -= 1
        # The request and its sequences refer to each other (req.seqs, seq.request): a cycle
        # that only the cyclic collector frees, after the objects it holds (prompt and output
        # lists, params) have waited in the heap it walks. Unlinked, refcounting frees them
        # here (the output holds its own lists and the prompt).
        req.seqs.clear()
        return out

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams | None = None) -> list[RequestOutput]:
        """Run the prompts (and whatever else is queued) to the end; their outputs, in order.
        Their requests are forgotten once given back (`pop_output`: a long-lived engine kept
        every request it had generated, prompts and outputs, growing without end), except
        with record_logits, whose requests stay in `requests` for their logits to be read."""
        ids = [self.add_request(p, params) for p in prompts]
        while self.has_unfinished():
            self.step()
        if self.record_logits:
            return [self.output(i) for i in ids]
        return [self.pop_output(i) for i in ids]

    # ---- scheduling -----------------------------------------------------------------

    def _timed(self, call: Callable[..., _T], *args: Any, **kwargs: Any) -> _T:
        """call(*args, **kwargs), a runner call that may allocate; its latency joins the
        allocating or the no-op calls. (Its arguments passed on, not a closure over them: the
        step's reserve and each admission make none.)"""
        before = self.runner.num_allocations()
        start = time.perf_counter()
        result = call(*args, **kwargs)
        elapsed = time.perf_counter() - start
        stats = self.stats
        if self.runner.num_allocations() != before:
            stats.num_alloc_calls += 1
            stats.alloc_call_s.append(elapsed)
        else:
            stats.num_noop_calls += 1
            stats.noop_call_s.append(elapsed)
        return result

    def _preempt(self, seq: SequenceState, reason: ReleaseReason = "preempt", release: bool = True) -> None:
        """The sequence back to the queue's head, computed nothing, its cache released (with
        release=False: listed in `_unreleased`, for the caller's `_release_pending`)."""
        self._unreleased[seq.seq_id] = reason
        seq.in_runner = False
        seq._num_computed = 0
        running = self.running
        if running and running[-1] is seq:  # (the victim is the latest-arrived: no scan of the list from its start)
            running.pop()
        else:
            running.remove(seq)
        self.waiting.appendleft(seq)
        if reason == "preempt":
            self.stats.num_preemptions += 1
        else:  # ("cancel": `_after_a_fault` releases a step's sequences to recompute them)
            self.stats.num_fault_recomputes += 1
        if release:  # (the reservation that follows needs the blocks back)
            self._release_pending()

    def _finish(self, seq: SequenceState, reason: str) -> None:
        """The sequence finished and gone from the running list (or the queue); its release
        waits in `_unreleased` for the caller's `_release_pending`."""
        seq.finish_reason = reason
        # Also for a sequence that waits (preempted): the runner forgets it, holding nothing.
        if seq.seq_id in self._unreleased:  # (its release raised and waits: this one follows it)
            self._release_again.add(seq.seq_id)
        self._unreleased[seq.seq_id] = "cancel" if reason == "abort" else "finish"
        seq.in_runner = False
        # (one scan of the running list, not a membership test and then the removal's own: a
        # sequence compares by identity, but every other one it passes costs a call to __eq__)
        try:
            self.running.remove(seq)
        except ValueError:  # not running: a sequence that waits (preempted, or a fork's child)
            if seq in self.waiting:  # (a running sequence never waits: no scan of the queue)
                self.waiting.remove(seq)

    def _release_pending(self) -> None:
        """The runner releases each sequence listed in `_unreleased`, in order, each struck
        off once its release returned. One that raises stays listed (and those after it): the
        next step begins with them (`_step`)."""
        unreleased, again = self._unreleased, self._release_again
        release = self.runner.release
        while unreleased:
            seq_id = next(iter(unreleased))
            release(seq_id, unreleased[seq_id])
            if again and seq_id in again:  # (a finish's release after it: listed first still, done next)
                again.discard(seq_id)
                continue
            del unreleased[seq_id]

    def _report(self, finished: list[str]) -> list[str]:
        """The step's finished request ids, after the releases left to do: those of an earlier
        step whose releases raised first. If a release raises, the ids wait for the next step."""
        self._unreported += finished
        self._release_pending()
        finished, self._unreported = self._unreported, []
        return finished

    def _write_back_columns(self) -> None:
        """Each row of the columns the engine owns (`_owned`) given its computed count from
        them, where a take moved the counts on since they were last written back."""
        cols = self._owned
        if cols is not None:
            for seq, computed in zip(cols.seqs, cols.computed, strict=True):
                seq._num_computed = computed
        self._columns_moved = False

    def _give_up_columns(self) -> None:
        """The columns' counts written back into their rows, which are no column's any more
        (their own counts theirs again), and no columns kept for the next step."""
        cols = self._owned
        if cols is None:
            return
        self._write_back_columns()
        for seq in cols.seqs:
            seq.owner = None
        self._owned = self._columns = None

    @staticmethod
    def _chunk(seq: SequenceState, n: int) -> ScheduledChunk:
        start = seq._num_computed
        end = start + n
        tokens = seq.token_ids
        return _new_chunk(ScheduledChunk, (seq.seq_id, tokens[start:end], start, end == len(tokens)))

    def _plan_running(
        self, budget: int
    ) -> tuple[list[SequenceState], list[str], list[int], list[ScheduledChunk] | StepChunks]:
        """The running sequences' next chunks, in arrival order, within `budget` tokens: the
        sequences, their ids, token counts and chunks (one pass: a decode is one token)."""
        running = self.running
        cols = self._plan_columns = self._columns
        if cols is not None and len(cols.seqs) <= len(running) and _leads(running, cols.seqs):
            # the running sequences begin with the columns' rows, each one token behind: chunk
            # i < k is (ids[i], [last_tokens[i]], computed[i], True), held as those columns
            # (StepChunks: made as chunks only where something reads them so); the rows after
            # them (joined since) as below, in what the columns' rows leave of the budget
            # (the test of _chunk below holds them all to it)
            k = len(cols.seqs)
            if k <= budget:
                starts = cols.computed
                self._plan_ends = [start + 1 for start in starts]
                chunks = StepChunks(cols.ids, cols.last_tokens, starts)
                if k == len(running):
                    # (the sequences and ids shared: `schedule` copies them before it adds an
                    # admission; no list of the rows made, nor a reference taken a row)
                    return cols.seqs, cols.ids, [1] * k, chunks
                # (the rows after the columns' are no column's: their own counts are theirs)
                extras = running[k:]
                counts = [len(seq.token_ids) - seq._num_computed for seq in extras]
                assert min(counts) > 0, "a running sequence always has a token to compute"
                if sum(counts) <= budget - k:  # every one's whole rest fits
                    chunks.rest += [
                        _new_chunk(
                            ScheduledChunk, (seq.seq_id, seq.token_ids[seq._num_computed :], seq._num_computed, True)
                        )
                        for seq in extras
                    ]
                    return list(running), cols.ids + [seq.seq_id for seq in extras], [1] * k + counts, chunks
                return self._plan_over_budget(extras, budget - k, list(cols.seqs), cols.ids.copy(), [1] * k, chunks)
        self._plan_columns = None
        if self._columns_moved:  # (not planned from the columns: the rows read their own counts below)
            self._write_back_columns()
        rows = self._decode_rows
        if rows is not None and len(rows) == len(running) <= budget and running == rows:  # (identity: `_leads`)
            # the running sequences of the last step, a decode of them all that ended none:
            # each has one token to compute (its last), so its count is 1 and its id the last
            # step's (the test of _chunk below holds these to the computed ones too)
            chunks = [
                _new_chunk(ScheduledChunk, (seq.seq_id, seq.token_ids[seq._num_computed :], seq._num_computed, True))
                for seq in running
            ]
            return rows, self._decode_ids, [1] * len(running), chunks  # (both shared: `schedule`)
        counts = [len(seq.token_ids) - seq._num_computed for seq in running]
        if running and sum(counts) <= budget:  # every sequence's whole rest fits (a decode step): list comprehensions
            assert min(counts) > 0, "a running sequence always has a token to compute"
            # (chunk i is _chunk(running[i], counts[i]), below: tests/test_engine_scheduler.py
            # holds them to it; on Python 3.11 these comprehensions beat map() over
            # attrgetters by a third)
            chunks = [
                _new_chunk(ScheduledChunk, (seq.seq_id, seq.token_ids[seq._num_computed :], seq._num_computed, True))
                for seq in running
            ]
            return list(running), [seq.seq_id for seq in running], counts, chunks
        return self._plan_over_budget(running, budget, [], [], [], [])  # (the common decode step took the paths above)

    def _plan_over_budget(
        self,
        running: list[SequenceState],
        budget: int,
        seqs: list[SequenceState],
        ids: list[str],
        counts: list[int],
        chunks: list[ScheduledChunk] | StepChunks,
    ) -> tuple[list[SequenceState], list[str], list[int], list[ScheduledChunk] | StepChunks]:
        """`_plan_running` where the sequences' whole rests do not fit `budget`: `running`
        (the running sequences after those planned in seqs, ids, counts, chunks) one by one
        while the budget lasts, each its rest or what the budget leaves."""
        for seq in running:
            if budget <= 0:
                break
            n = min(len(seq.token_ids) - seq._num_computed, budget)
            assert n > 0, "a running sequence always has a token to compute"
            seqs.append(seq)
            ids.append(seq.seq_id)
            counts.append(n)
            chunks.append(self._chunk(seq, n))
            budget -= n
        return seqs, ids, counts, chunks

    def _after_a_fault(self, recompute: bool = False) -> None:
        """The step raised after its reservation (its forward, its sampler), before any token
        was taken or committed (or `_undo_take` put them back). Stepping on must give the
        tokens of a run without the fault. Where the runner says the step may be reserved
        again (`runner.may_reserve_again`: a cache not of exact steps, which takes a repeated
        reservation of the same step, and an executor without per-request state), the next
        step plans and reserves it again. Where it cannot (a cache of exact steps: V4's, the
        hybrid's; or an executor whose state, V4's compressor or a recurrent layer's, a forward
        that ran, whole or in part, moved past the step and a rerun would move again: a
        sampler's fault after V4's forward gave other tokens), the step's
        sequences are released and recomputed, as a preemption that recomputes: their state
        rebuilt from their tokens, the prefix cache's hits kept ("cancel": never swapped out
        with the moved state). recompute: release them whatever the cache (a commit that
        raised may have changed it)."""
        if self._owned is not None:  # (the columns' counts are the rows' again: the step is planned anew)
            self._give_up_columns()
        if not recompute:
            # (a runner of its own may have no may_reserve_again: its cache is its own, as a
            # paged one, which takes a repeated reservation of the same step)
            may_reserve_again = getattr(self.runner, "may_reserve_again", None)
            if may_reserve_again is None or may_reserve_again():
                return
        # (the cache told: admitted again, the sequence counts nothing more in its stats)
        will_recompute = getattr(self.runner, "will_recompute", None)
        for seq in reversed(self._scheduled):
            if seq.in_runner:
                if will_recompute is not None:
                    will_recompute(seq.seq_id)
                self._preempt(seq, "cancel", release=False)
        self._release_pending()  # (after every sequence's bookkeeping: one that raises leaves none half done)

    def _undo_take(self) -> None:
        """The step raised while it took its tokens (a row's sampler or stop check, the take's
        own code) or in its commit, after some rows took theirs: every sequence of the step
        back to where it was before it (each computed to its chunk's start; one whose chunk
        needed logits back to its chunk's end, its token and what came with it, its logits
        and logprobs recorded, its first token's time, dropped), no columns kept, then the
        cache's side as `_after_a_fault` undoes a fault before the take. A commit that
        raised may have changed the cache (a tier's write-through after it): those sequences
        are recomputed whatever the cache."""
        chunks, committing = self._taking, self._committing
        self._taking, self._committing = None, False
        assert chunks is not None
        if self._owned is not None:  # (each row's count is its own again, set below)
            self._give_up_columns()
        for seq, chunk in zip(self._scheduled, chunks, strict=True):
            seq._num_computed = chunk.start
            if not chunk.needs_logits:  # (its chunk ends inside the known tokens: none taken)
                continue
            del seq.token_ids[chunk.start + len(chunk.token_ids) :]
            req = seq.request
            num_output = len(seq.token_ids) - req.num_prompt_tokens
            del seq.logits[num_output:], seq.logprobs[num_output:]  # (one a token, where recorded)
            seq.text = ""  # (set only where the sequence ended: not any more)
            if not num_output and not req.forked:  # its first token was the step's: as never taken
                req.first_token_time = None
                req.inline = False
        self._columns = self._decode_rows = None
        self._after_a_fault(recompute=committing)

    def _reserve_with_preemption(self) -> list[tuple[SequenceState, int]]:
        """The step does not fit: reserve sequence by sequence, in arrival order, preempting
        the latest-arrived running sequence until each reservation fits."""
        budget = self.max_num_batched_tokens
        plan: list[tuple[SequenceState, int]] = []
        i = 0
        try:
            while i < len(self.running) and budget > 0:
                seq = self.running[i]
                n = min(len(seq.token_ids) - seq._num_computed, budget)
                while not self._timed(lambda seq=seq, n=n: self.runner.reserve_step([seq.seq_id], [n])):
                    victim = self.running[-1]
                    if victim is seq and not plan and n > 1:
                        # Alone, and its chunk does not fit the idle cache: a prefill chunk
                        # larger than a window group's pool holds at once (a hybrid without
                        # full attention, whose capacity is the model's positions). A smaller
                        # chunk, not a preemption of itself (readmitted, its chunk would not
                        # fit either: every step raised). A cache it fits alone never gets here.
                        n = -(-n // 2)
                        continue
                    self._preempt(victim)
                    if victim is seq:
                        break
                if not seq.in_runner:
                    break  # it preempted itself: everything after it is gone too
                plan.append((seq, n))
                budget -= n
                i += 1
        except BaseException:  # a reservation that raised: those made before it go as schedule's admissions' do
            self._scheduled = [seq for seq, _ in plan]
            self._after_a_fault()
            raise
        return plan

    def schedule(self) -> list[ScheduledChunk] | StepChunks:
        scheduled, ids, counts, chunks = self._plan_running(self.max_num_batched_tokens)
        columns = self._plan_columns
        if columns is None and self._owned is not None:  # (the step plans its rows without them)
            self._give_up_columns()
        preempted = False
        if ids and not self._timed(self.runner.reserve_step, ids, counts):
            if columns is not None:  # (the plan is taken again, sequence by sequence, from each row's own count)
                self._give_up_columns()
                columns = None
            num_preemptions = self.stats.num_preemptions
            plan = self._reserve_with_preemption()
            preempted = self.stats.num_preemptions > num_preemptions
            chunk = self._chunk
            chunks = [chunk(seq, n) for seq, n in plan]
            scheduled = [seq for seq, _ in plan]  # chunks[i] is scheduled[i]'s
            counts = [n for _, n in plan]
            ids = [seq.seq_id for seq in scheduled]
        # the step's tokens so far (a plan of the columns' rows alone: one each, not summed)
        num_tokens = len(counts) if columns is not None and len(counts) == len(columns.seqs) else sum(counts)
        budget = self.max_num_batched_tokens - num_tokens
        # The plan's ids of a step of the decode columns' rows (or of the last step's decode
        # rows) are that list itself, not a copy (`_plan_running`): a copy, and its free a step
        # later, touch every id's string, a likely cache miss a row at a fleet run's scale
        # where nothing else of the step reads them. The lists are never changed: an
        # admission appends its id to a copy of its own (only of a shared list: another is
        # the plan's own already)
        ids_shared = ids is self._decode_ids or (columns is not None and ids is columns.ids)
        # An admission that raises (the runner's admit: a tier's load, a check) comes after the
        # running sequences reserved the step, and those admitted before it: their reservations
        # go as a faulted forward's do (`_after_a_fault`: a cache of exact steps refuses them
        # reserved again, and every later step raised)
        first_chunk = budget  # (cut only where nothing is scheduled and the head does not fit: below)
        try:
            while self.waiting and budget > 0 and not preempted and len(self.running) < self.max_num_seqs:
                seq = self.waiting[0]
                admitted = self._timed(
                    self.runner.admit,
                    seq.seq_id,
                    seq.token_ids,
                    min(budget, first_chunk),
                    tenant_salt=seq.request.tenant,
                    prompt=seq.prompt,
                    check_packing=False,  # (add_request checked seq.prompt's bytes)
                    # the cache reads the sequence's own list: each take appends a sampled id to it
                    # before the step's commit, which then appends nothing (no second copy of the
                    # ids to grow a row a step)
                    share_ids=True,
                )
                if admitted is None:
                    if chunks or first_chunk <= 1:
                        break
                    # Nothing scheduled and the head of the queue does not fit the idle cache
                    # with `budget` tokens: a smaller first chunk (as above, a window group's
                    # pool); at one token that does not fit, the error below
                    first_chunk = -(-first_chunk // 2)
                    continue
                first_chunk = self.max_num_batched_tokens  # (the cut was that head's alone)
                if ids_shared:
                    ids, ids_shared = ids.copy(), False
                    if scheduled is self._decode_rows or (columns is not None and scheduled is columns.seqs):
                        scheduled = scheduled.copy()  # (shared with them alike: `_plan_running`)
                self.waiting.popleft()
                seq.prompt = None  # (a readmission after a preemption holds more tokens: packed anew)
                seq.in_runner = True
                seq._num_computed = admitted.num_cached_tokens
                req = seq.request
                if not req.first_admitted:
                    req.first_admitted = True
                    req.num_cached_tokens = min(admitted.num_cached_tokens, req.num_prompt_tokens)
                self.running.append(seq)
                scheduled.append(seq)
                chunk = self._chunk(seq, admitted.num_scheduled_tokens)
                chunks.append(chunk)
                ids.append(seq.seq_id)
                counts.append(len(chunk.token_ids))
                budget -= admitted.num_scheduled_tokens
        except BaseException:
            self._scheduled = scheduled
            self._after_a_fault()
            raise
        if self.waiting and not chunks:  # (waiting first: a StepChunks' len is a Python call)
            head = self.waiting[0]
            raise RuntimeError(
                f"sequence {head.seq_id!r} of {len(head.token_ids)} tokens cannot be admitted into an idle cache "
                f"of {self.runner.capacity_tokens} tokens"
            )
        self._scheduled = scheduled
        self._step_ids, self._step_counts = ids, counts  # chunks[i]'s request id and token count
        self._step_num_tokens = self.max_num_batched_tokens - budget  # sum(counts)
        # the step's leading chunks are the columns' rows (admissions append after them)
        self._step_columns = columns
        if columns is None:
            return chunks
        # (the plan held: chunks is the StepChunks of the columns' rows, then the rest.) Their
        # starts and ends are at hand (chunks [computed[i], ends[i])): the chunks go with
        # every chunk's columns, which the runner reads instead of transposing the chunks
        assert type(chunks) is StepChunks
        starts, ends = columns.computed, self._plan_ends
        if chunks.rest:
            more = [chunk.start for chunk in chunks.rest]
            starts, ends = starts + more, ends + list(map(operator.add, more, islice(counts, len(columns.seqs), None)))
        chunks.columns = (ids, starts, ends)
        return chunks

    # ---- one step -------------------------------------------------------------------

    def step(self) -> list[str]:
        """Schedule, run the model once, sample, commit. Returns the ids of requests finished in this step.
        A step that raises leaves the engine as it was before it (or, where that cannot be,
        the step's sequences released to be recomputed: `_after_a_fault`); stepping on gives
        the tokens of a run without the fault."""
        try:
            return self._step()
        except BaseException:
            if self._taking is not None:  # (the schedule, forward and sampler undo their own)
                self._undo_take()
            raise

    def _step(self) -> list[str]:
        if self._unreleased:  # releases that raised (a fault, Ctrl-C): done before anything is admitted again
            self._release_pending()
        chunks = self.schedule()
        counts = self._step_counts  # (counts[i] is len(chunks[i].token_ids))
        num_chunks = len(counts)  # (len(chunks): a StepChunks' len is a Python call, the list's is not)
        if not num_chunks:
            return self._report([]) if self._unreported else []
        stats = self.stats
        stats.num_steps += 1
        self._step_no += 1
        # The columns (and the decode memo) are dropped before anything that may raise: the
        # forward, the sampler, the take. Each set of columns then lives from the take that
        # formed it (this step's, below) to the next step's start, which takes one token a row
        # through them, so their end steps count the steps that took tokens. (Kept across a
        # step that raised, they would miss that step's number: a row's end step gone by,
        # `_rows_at_end` never finds it due, and it runs past its end length.)
        self._decode_rows = self._columns = None
        # The forward, the clock's reading after it (the simulator's prices the step there) and
        # the batch's sampling: a fault in any of them comes before the take, so the step's
        # reservation is undone or its sequences released alike (`_after_a_fault`)
        # With contain_request_faults, a request whose own sampling or text raises fails
        # alone, after the step's commit; the others go on. (A fault of the step itself,
        # schedule or forward, always raises.)
        failed: dict[str, tuple[str, str]] = {}  # request id -> (message, traceback)
        try:
            logits = self.runner.execute(chunks)
            now = self.clock()
            sampled = self._sample_step(chunks, logits, failed) if self.batched_sampling else None
        except BaseException:
            self._after_a_fault()
            raise
        next_token_ids: list[int | None]
        done: list[tuple[SequenceState, str]] = []
        forks: list[tuple[SequenceState, int]] = []  # (a parent, its row of the logits)
        self._taking = chunks  # (from here the take changes the sequences: `_undo_take`)
        accept = self._accept_token
        # the per-token fast path (below) holds while nothing is recorded per token; a
        # batched step has every token sampled already (`sampled`). A batched step that
        # refused rows (`failed` already) takes the loop below, row by row, which passes
        # over the failed requests' rows as it does for a fault of its own
        plain = self.inline_decode and not self.record_logits and not failed
        row = 0
        num_decode = 0  # chunks of one token after the prompt
        scheduled = self._scheduled
        head = 0  # chunks [0, head) taken before the loop below (a mixed step's leading decode tokens)
        step_columns = self._step_columns
        if (
            plain
            and sampled is not None
            and len(sampled) == num_chunks
            # (a step of the columns' rows alone is one of decodes: no count of its counts)
            and ((step_columns is not None and len(step_columns.seqs) == num_chunks) or counts.count(1) == num_chunks)
        ):
            # a decode step (one sampled token a chunk): the loop below without its per-chunk branches
            gone: list[int] = []  # the rows [0, end) the takes below ended or failed, increasing
            next_token_ids, num_decode, end = self._take_decode_tokens(sampled, logits, now, done, forks, failed, gone)
            columns = step_columns
            if gone or columns is None or end != len(columns.seqs):
                columns = self._next_columns(gone, end, sampled)
            self._columns = columns  # (the step's columns, one token on, where they are all its rows and none ended)
            self._owned = columns
            if not done and not forks and not failed:  # each of them one token behind now
                self._decode_rows, self._decode_ids = scheduled, self._step_ids
        else:
            next_token_ids = [None] * num_chunks
            if plain and sampled is not None:
                # A mixed step (a prompt chunk among them, most often an admitted request's
                # after the running ones): its leading chunks of one sampled token each, where
                # every one is a plain request's decode token, go through the columns' take
                # (the columns' rows, which lead) and _take_inline_tokens' passes (the rest of
                # them), the rest through the loop below (from chunk `head`: sampled row `head`)
                columns = step_columns
                k = 0 if columns is None else len(columns.seqs)
                # the first chunk of more than one token (the columns' rows are one token each:
                # the search starts after them)
                end = next(
                    compress(itertools.count(k), map(operator.ne, islice(counts, k, None), repeat(1))), len(counts)
                )
                gone = []  # the rows [0, head) the takes below ended or failed, increasing
                if columns is not None:  # (its rows, each a decode, are chunks and sampled rows [0, k))
                    head = k
                    next_token_ids[:head] = self._take_column_tokens(columns, sampled[:head], done, failed, gone)
                if end > head and all(map(_NEEDS_LOGITS, chunks[head:end])):
                    taken = self._take_inline_tokens(scheduled[head:end], sampled[head:end], done, failed, gone, head)
                    next_token_ids[head : head + len(taken)] = taken
                    head += len(taken)
                self._columns = self._owned = self._next_columns(gone, head, sampled)
                num_decode = row = head
            elif self._owned is not None:  # (the loop below takes the columns' rows too: from their own counts)
                self._give_up_columns()
            # (slices from head: a StepChunks' leading chunks, all before head, are not made, and
            # the lists' slices copy the few rows after head where islice steps over the rest)
            rest = zip(scheduled[head:], chunks[head:], counts[head:], strict=True)
            for i, (seq, chunk, n) in enumerate(rest, head):
                seq._num_computed += n  # (no column's row: those before head, or none kept)
                req = seq.request
                if n == 1 and chunk.start >= req.num_prompt_tokens:
                    num_decode += 1
                if not chunk.needs_logits:
                    continue
                token = sampled[row] if sampled is not None else None
                row += 1
                if failed and req.request_id in failed:
                    continue
                try:
                    if plain and req.plain and req.first_token_time is not None:
                        # A decode token of a plain request (no logprobs, one sample, not its first
                        # token, nothing recorded): `_accept_token`'s work without its checks (its
                        # twin: tests/test_engine_scheduler.py runs both paths on the same requests)
                        tokens = seq.token_ids
                        if token is None:
                            position = len(tokens) - req.num_prompt_tokens
                            try:
                                token = self.sampler(logits[row - 1], req.params, seq.sample_index, position)
                            except NonFiniteLogitsError:  # (named: the sampler knows no request)
                                raise NonFiniteLogitsError([row - 1], [req.request_id], position) from None
                        tokens.append(token)
                        if not req.matches_text and token not in req.stop_ids and len(tokens) < req.end_len:
                            next_token_ids[i] = token
                            continue
                        reason = self._stop_reason(seq, token)
                    else:
                        reason = accept(seq, logits, row - 1, now, token)
                except Exception as error:
                    if not self.contain_request_faults:
                        raise
                    failed[req.request_id] = (f"{type(error).__name__}: {error}", traceback.format_exc())
                    continue
                if req.params.n > 1 and not req.forked:
                    forks.append((seq, row - 1))
                if reason is None:
                    next_token_ids[i] = seq.token_ids[-1]
                else:
                    done.append((seq, reason))
        # (the other samples' first tokens taken here, inside the undo window: nothing of the
        # engine's changes until their fork, after the commit)
        children = self._first_samples(forks, logits, now, failed) if forks else ()
        self._committing = True
        self.runner.commit_step(self._step_ids, counts, next_token_ids)
        for parent, samples in children:
            if parent.request.request_id in failed:
                continue
            try:
                self._fork_samples(parent, samples, done)
            except Exception as error:
                if not self.contain_request_faults:
                    raise  # (the step undone: `_fork_samples` dropped the children it forked)
                failed[parent.request.request_id] = (f"{type(error).__name__}: {error}", traceback.format_exc())
        self._taking, self._committing = None, False
        stats.num_decode_tokens += num_decode  # (after the commit: a step undone counts nothing)
        stats.num_prefill_tokens += self._step_num_tokens - num_decode
        for seq, reason in done:
            if seq.request.request_id not in failed:
                self._finish(seq, reason)
        finished: list[str] = []
        for seq, _ in done:
            req = seq.request
            if req.finished and req.finish_time is None and req.request_id not in failed:
                req.finish_time = now
                finished.append(req.request_id)
        for request_id, (message, trace) in failed.items():
            self._fail(request_id, message, trace)
            finished.append(request_id)
        # The releases last, after every sequence left the running list: one that raises
        # (Ctrl-C) leaves them to the next step, which reports these requests then
        if self._unreleased or self._unreported:
            return self._report(finished)
        return finished

    def _take_decode_tokens(
        self,
        sampled: list[int],
        logits: torch.Tensor,
        now: float,
        done: list[tuple[SequenceState, str]],
        forks: list[tuple[SequenceState, int]],
        failed: dict[str, tuple[str, str]],
        gone: list[int],
    ) -> tuple[list[int | None], int, int]:
        """`step`'s loop for a step of one sampled token a chunk, every chunk (`sampled[i]`:
        the token of the i-th scheduled sequence), nothing recorded per token: the same work,
        without the branches a prefill chunk takes. The columns' rows (the leading chunks)
        go through `_take_column_tokens`, the others through `_take_inline_tokens` where every
        one is a plain request's decode token, else through the loop below. Returns each
        chunk's next token id for the commit (None: none, its request finished or failed),
        the number of decode chunks (those after the prompt), and the number of leading chunks
        taken through the columns and the inline take (`_next_columns`)."""
        n = len(sampled)
        columns = self._step_columns
        if columns is None:
            k = 0
            next_token_ids: list[int | None] = []
        else:
            k = len(columns.seqs)
            next_token_ids = self._take_column_tokens(columns, sampled if k == n else sampled[:k], done, failed, gone)
            if k == n:
                return next_token_ids, n, n
        inline = self._take_inline_tokens(self._scheduled[k:], sampled[k:], done, failed, gone, k)
        next_token_ids += inline  # (the leading rows that are plain requests' decode tokens, no text to match)
        k += len(inline)
        if k == n:
            return next_token_ids, n, n
        put = next_token_ids.append
        num_in_prompt = 0  # chunks inside the prompt (a prompt's last token): not decodes
        accept = self._accept_token
        for seq, token in zip(islice(self._scheduled, k, None), islice(sampled, k, None), strict=True):
            req = seq.request
            seq._num_computed += 1  # (rows after the columns': no column's)
            try:
                if req.plain and req.first_token_time is not None:  # `step`'s inline path
                    # (one sample, so no sibling failed it; a decode: its chunk, the last
                    # token, starts past the prompt, as the sequence has its first token)
                    tokens = seq.token_ids
                    tokens.append(token)
                    if not req.matches_text and token not in req.stop_ids and len(tokens) < req.end_len:
                        put(token)
                        continue
                    reason = self._stop_reason(seq, token)
                else:
                    if seq._num_computed <= req.num_prompt_tokens:  # (the chunk's start < the prompt's length)
                        num_in_prompt += 1
                    if failed and req.request_id in failed:  # a sibling sample failed it this step
                        put(None)
                        continue
                    reason = accept(seq, logits, len(next_token_ids), now, token)  # (the row: one put a row)
            except Exception as error:
                if not self.contain_request_faults:
                    raise
                failed[req.request_id] = (f"{type(error).__name__}: {error}", traceback.format_exc())
                put(None)
                continue
            if req.params.n > 1 and not req.forked:
                forks.append((seq, len(next_token_ids)))
            if reason is None:
                put(seq.token_ids[-1])
            else:
                put(None)
                done.append((seq, reason))
        return next_token_ids, n - num_in_prompt, k

    def _take_inline_tokens(
        self,
        seqs: list[SequenceState],
        sampled: list[int],
        done: list[tuple[SequenceState, str]],
        failed: dict[str, tuple[str, str]],
        gone: list[int],
        first_row: int = 0,
    ) -> list[int | None]:
        """`_take_decode_tokens`' loop for the leading rows that are `inline` (a plain request
        past its first token, no stop string to match), up to the first that is not, in its
        least work a row: the sequence computed its last token and appends its sampled one;
        then, in a second pass only when some row ended (its token a stop id, or its end
        length reached: the inline path's checks), the rows that ended meet `_stop_reason` in
        row order. (seqs[i]: the sequence of the step's chunk i, a decode of one token;
        sampled[i] its token.) The next token ids for the commit of the rows taken, the first
        len(result) (None where a request finished or failed, its step row, first_row + its
        row here, then in `gone`); the others are left as they were."""
        for i, seq in enumerate(seqs):  # (a loop: on Python 3.11 faster than map(attrgetter))
            if not seq.request.inline:
                seqs, sampled = seqs[:i], sampled[:i]
                break
        ended = False
        for seq, token in zip(seqs, sampled, strict=True):
            seq._num_computed += 1  # (rows after the columns': no column's)
            tokens = seq.token_ids
            tokens.append(token)
            req = seq.request
            if token in req.stop_ids or len(tokens) >= req.end_len:
                ended = True
        next_token_ids: list[int | None] = list(sampled)
        if ended:
            self._end_rows(seqs, sampled, next_token_ids, done, failed, gone, first_row)
        return next_token_ids

    def _end_rows(
        self,
        seqs: list[SequenceState],
        sampled: list[int],
        next_token_ids: list[int | None],
        done: list[tuple[SequenceState, str]],
        failed: dict[str, tuple[str, str]],
        gone: list[int],
        first_row: int,
        rows: Iterable[int] | None = None,
    ) -> None:
        """The inline takes' second pass, for a step where some row may have ended (each
        row's token appended): the rows whose token is a stop id or reaches their end length
        meet `_stop_reason`, in row order; next_token_ids[i] is None where one ended or failed,
        and first_row + i joins `gone` (the step's row of seqs[i]: `_next_columns` drops those).
        rows: the only rows that may have (increasing; `_column_end_rows` finds them in C),
        else every row is looked at (the twin)."""
        if rows is None:
            rows = range(len(seqs))
        for i in rows:
            seq, token = seqs[i], sampled[i]
            req = seq.request
            if token not in req.stop_ids and len(seq.token_ids) < req.end_len:
                continue
            try:
                reason = self._stop_reason(seq, token)
            except Exception as error:
                if not self.contain_request_faults:
                    raise
                failed[req.request_id] = (f"{type(error).__name__}: {error}", traceback.format_exc())
                next_token_ids[i] = None
                gone.append(first_row + i)
                continue
            if reason is not None:
                next_token_ids[i] = None
                gone.append(first_row + i)
                done.append((seq, reason))

    def _take_column_tokens(
        self,
        cols: _DecodeColumns,
        sampled: list[int],
        done: list[tuple[SequenceState, str]],
        failed: dict[str, tuple[str, str]],
        gone: list[int],
    ) -> list[int | None]:
        """`_take_inline_tokens` for a step of the columns' rows (`_step_columns`: every row
        inline, each one token behind, as when the columns formed): each row's token appended
        and its computed count set to its chunk's end, in C-level passes, and the end checks
        on the columns (the step at which each row reaches its end length, their stop ids)
        instead of each request's; only where some row may have ended do the rows meet `_end_rows`. The
        next token ids for the commit; the columns move on one token."""
        ends = self._plan_ends  # (row i's chunk [computed[i], ends[i]): one token)
        any(map(list.append, cols.token_lists, sampled))  # (append returns None: any() runs the map to its end)
        # (each row's computed count moves on in the columns alone: they are the engine's,
        # `_owned`, and the rows' own counts are written back where read. Not a store a row:
        # at a fleet run's scale each sequence touched is a likely cache miss)
        assert cols is self._owned
        cols.computed, cols.last_tokens = ends, sampled
        self._columns_moved = True
        due = None  # the rows whose token reaches their end length, where the bound says some may
        step_no = self._step_no
        if cols.first_end <= step_no:  # (a bound: then the rows are counted, in C)
            due = self._rows_at_end(cols.end_steps, step_no)
            if not due:  # (none ends before its end step: the least is past this step)
                cols.first_end = min(cols.end_steps)
        stop_ids = cols.stop_ids
        if due:  # some row's token reached its end length
            ended = True
        elif stop_ids is None:  # the rows' stop ids differ: row by row, in C
            ended = any(map(operator.contains, cols.row_stop_ids, sampled))
        else:
            ended = bool(stop_ids) and not stop_ids.isdisjoint(sampled)
        next_token_ids: list[int | None] = list(sampled)
        if ended:
            # only the rows that may have ended meet `_end_rows` (a step ends a few of many)
            rows = self._column_end_rows(cols, sampled, due)
            self._end_rows(cols.seqs, sampled, next_token_ids, done, failed, gone, 0, rows)
        return next_token_ids

    @staticmethod
    def _rows_at_end(end_steps: list[int], step_no: int) -> list[int]:
        """The rows of a columns' take in step `step_no` whose token reaches their end
        length, increasing: those whose end step (`_DecodeColumns.end_steps`) is this step,
        the least it can be (a row ends by length in its end step). Counted, then found, in
        C: no pass a row in Python, none at all past the count where no row is due
        (tests/test_engine_scheduler.py holds them to a filter)."""
        rows: list[int] = []
        i = -1
        for _ in range(end_steps.count(step_no)):
            i = end_steps.index(step_no, i + 1)
            rows.append(i)
        return rows

    @staticmethod
    def _column_end_rows(cols: _DecodeColumns, sampled: list[int], due: list[int] | None) -> list[int]:
        """The rows of a columns' step (each row's token appended: sampled[i]) that may have
        ended, increasing: those whose token is one of their stop ids, and `due` (the rows
        whose length reached their end length, `_rows_at_end`, given where the bound said
        some row may). Found in C-level passes; `_end_rows` checks each again, as it checks
        every row without them (tests/test_engine_scheduler.py holds the two to each other)."""
        stop_ids = cols.stop_ids
        if stop_ids is None:  # the rows' stop ids differ: row by row
            stops = list(compress(itertools.count(), map(operator.contains, cols.row_stop_ids, sampled)))
        elif stop_ids:
            stops = list(compress(itertools.count(), map(stop_ids.__contains__, sampled)))
        else:
            stops = []
        if not due:
            return stops
        return sorted({*stops, *due}) if stops else due

    def _next_columns(self, gone: list[int], end: int, sampled: list[int]) -> _DecodeColumns | None:
        """The columns for the next step: the step's leading chunks [0, end), each a plain
        request's decode token, taken through the step's columns (the first k) and
        `_take_inline_tokens` (the others, which join them), less the rows that ended or
        failed (`gone`, increasing: the takes' `_end_rows` named them, so no row is looked
        at for them). None where no row is left."""
        cols = self._step_columns
        k = 0 if cols is None else len(cols.seqs)
        fresh = end > k  # (the columns' lists made here, of slices and concatenations: ours alone)
        if fresh:
            seqs, ids = self._scheduled, self._step_ids
            more = self._form_columns(seqs[k:end], ids[k:end], sampled[k:end], self._step_no)
            for seq in more.seqs:  # (their counts the columns' from here: `_owned`)
                seq.owner = self
            cols = more if cols is None else cols.joined(more)
        if cols is None or not gone:
            return cols
        return cols.without(gone, fresh)

    @staticmethod
    def _form_columns(seqs: list[SequenceState], ids: list[str], sampled: list[int], step_no: int) -> _DecodeColumns:
        """The columns of rows an inline take of step `step_no` took (each row's token
        appended), read off the sequences in C-level passes. (Rows that ended leave them
        after: `without`.) A row of length L reaches its end length end_len in step
        step_no + end_len - L, one token a step."""
        reqs = list(map(_REQUEST, seqs))
        lists = list(map(_TOKEN_IDS, seqs))
        row_stop_ids = list(map(_STOP_IDS, reqs))
        end_steps = list(map(step_no.__add__, map(operator.sub, map(_END_LEN, reqs), map(len, lists))))
        first = row_stop_ids[0]
        return _DecodeColumns(
            seqs,
            ids,
            lists,
            list(map(_NUM_COMPUTED, seqs)),
            sampled,
            row_stop_ids,
            end_steps,
            first if row_stop_ids.count(first) == len(row_stop_ids) else None,
            min(end_steps),
        )

    def _sample_step(
        self, chunks: Sequence[ScheduledChunk], logits: torch.Tensor, failed: dict[str, tuple[str, str]]
    ) -> list[int]:
        """Every sampled row's token (the chunks needing logits, in order), in one batch. The
        batch sampler keeps the rows' columns, seed words and prompt lengths while the step samples
        the same sequences in the same order (a decode step of the same batch): then only
        the sequences' lengths are read, and only when a row draws. Rows whose logits give
        no token (NonFiniteLogitsError) raise, naming their requests; with
        contain_request_faults their requests go in `failed` instead, each named as the
        row-by-row path names it, and the other rows' tokens are returned (the rows refused
        hold -1)."""
        seqs = self._scheduled
        columns = self._step_columns
        # (a decode step samples every chunk: no filtered copy; the columns' rows all need
        # logits: only the chunks after them are read, a StepChunks' leading ones not made)
        k = 0 if columns is None else len(columns.seqs)
        if k != len(self._step_counts):  # (len(chunks): a StepChunks' len is a Python call)
            # (a StepChunks of the columns' rows: the chunks after them are its rest, not a slice made)
            rest = chunks.rest if type(chunks) is StepChunks and len(chunks.lead_tokens) == k else chunks[k:]
            if not all(map(_NEEDS_LOGITS, rest)):
                seqs = seqs[:k] + [seq for seq, c in zip(seqs[k:], rest, strict=True) if c.needs_logits]

        def rows(which: Sequence[int] | None = None) -> tuple[list[SamplingParams], list[int], list[int]]:
            picked = seqs if which is None else [seqs[i] for i in which]
            # (a sequence's output positions count from its prompt's length)
            params, origins = [seq.request.params for seq in picked], [seq.request.num_prompt_tokens for seq in picked]
            return params, [seq.sample_index for seq in picked], origins

        def lengths() -> list[int]:
            columns = self._step_columns
            if columns is None:
                return [len(seq.token_ids) for seq in seqs]
            # the columns' rows lead (each a decode, sampled): each one's length is its chunk's end
            k = len(columns.seqs)
            return self._plan_ends if k == len(seqs) else self._plan_ends + [len(seq.token_ids) for seq in seqs[k:]]

        # (a tensor's rows, or a runner's list of empty rows; a tensor's len is a Python call, its shape not)
        if (logits.shape[0] if type(logits) is torch.Tensor else len(logits)) != len(seqs):
            logits = logits[: len(seqs)]
        if self._num_controlled:
            logits = self._controlled_logits(seqs, logits)
        try:
            return self._batch_sampler.sample(logits, seqs, rows, lengths)
        except NonFiniteLogitsError as error:  # named: the sampler knows rows, not requests
            if error.tokens is None or not self.contain_request_faults:
                first = seqs[error.rows[0]]
                position = len(first.token_ids) - first.request.num_prompt_tokens
                ids = [seqs[r].request.request_id for r in error.rows]
                raise NonFiniteLogitsError(error.rows, ids, position, error.tokens) from None
            trace = traceback.format_exc()
            for r in error.rows:
                seq = seqs[r]
                req = seq.request
                position = len(seq.token_ids) - req.num_prompt_tokens
                refused = NonFiniteLogitsError([r], [req.request_id], position)
                failed.setdefault(req.request_id, (f"{type(refused).__name__}: {refused}", trace))
            return error.tokens

    @staticmethod
    def _controlled_logits(seqs: Sequence[SequenceState], logits: torch.Tensor) -> torch.Tensor:
        """A step's logits rows (row i: seqs[i]'s) with each controlled request's row processed
        (`processed_logits`: its min_tokens mask, biases and penalties over its tokens so far), in a copy;
        the logits themselves where no row is (the step's logprobs and recorded logits read
        those: the raw model's)."""
        out = None
        for i, seq in enumerate(seqs):
            req = seq.request
            if req.controls:
                row = processed_logits(logits[i], req.params, seq.token_ids, req.num_prompt_tokens, req.stop_ids)
                if out is None:
                    out = logits.to(row.dtype, copy=True)
                out[i] = row
        return logits if out is None else out

    def _first_samples(
        self,
        forks: list[tuple[SequenceState, int]],
        logits: torch.Tensor,
        now: float,
        failed: dict[str, tuple[str, str]],
    ) -> list[tuple[SequenceState, list[tuple[SequenceState, str | None]]]]:
        """Each forking parent's other samples (the step's row of its logits, `forks`) made
        and given their first token (`_accept_token`: sampler, logprobs, stop check), with
        its finish reason, before the step's commit: they are the engine's, the runner's and
        the request's only when `_fork_samples` forks them after it, so a fault here changes
        nothing the step's undo (`_undo_take`) does not put back. With
        contain_request_faults a fault fails the request alone (`failed`)."""
        made = []
        for parent, row in forks:
            req = parent.request
            if req.request_id in failed:
                continue
            prompt = parent.token_ids[: parent._num_computed]  # (a forking request's: no column's row)
            samples = []
            try:
                for j in range(1, req.params.n):
                    child = SequenceState(f"{req.request_id}/{j}", req, j, list(prompt), parent._num_computed, False)
                    samples.append((child, self._accept_token(child, logits, row, now)))
            except Exception as error:
                if not self.contain_request_faults:
                    raise
                failed[req.request_id] = (f"{type(error).__name__}: {error}", traceback.format_exc())
                continue
            made.append((parent, samples))
        return made

    def _fork_samples(
        self,
        parent: SequenceState,
        samples: list[tuple[SequenceState, str | None]],
        done: list[tuple[SequenceState, str]],
    ) -> None:
        """The prompt is computed once: the other samples (`_first_samples`: each with its
        first token, from the parent's logits) fork off it (they share its blocks; the shared
        tail block is copied on their first write). If the runner raises, the children forked
        so far are dropped again (released, gone from the running list and the request), the
        request not forked: the step's undo then recomputes it whole."""
        req = parent.request
        req.forked = True
        num_seqs = len(req.seqs)  # (the parent's: the children join after it)
        waiting: list[SequenceState] = []
        # The batch's room for children that go on: max_num_seqs counts every sample, as the
        # admission loop counts sequences (n = 1000 ran steps of up to 364 rows at the default 64). A child that ends
        # on its first token leaves the running list at this step's end and takes no room.
        room = self.max_num_seqs - len(self.running)
        try:
            for child, reason in samples:
                child_id = child.seq_id
                if (room > 0 or reason is not None) and self.runner.fork(parent.seq_id, child_id):
                    child.in_runner = True
                    self.running.append(child)
                    room -= reason is None
                else:
                    # No room in the batch, or no cache state of its own to be had now (a V4
                    # state block): the child waits like a preempted sequence and is admitted
                    # through the prefix cache later.
                    child._num_computed = 0
                    waiting.append(child)
                req.seqs.append(child)
                if reason is not None:
                    done.append((child, reason))
                elif child.in_runner:  # a waiting sequence hands over all its tokens when admitted
                    self.runner.append_token_ids(child_id, [child.token_ids[-1]])
        except BaseException:
            for child, _ in samples:
                self._unreleased[child.seq_id] = "cancel"  # (the runner's release: False where it holds none)
                if child.in_runner:
                    child.in_runner = False
                    self.running.remove(child)
            del req.seqs[num_seqs:]
            req.forked = False
            self._release_pending()
            raise
        # The children that wait go first, in sample order (ahead of the queue, as preempted
        # ones); one that finishes on its first token leaves the queue again in _finish.
        self.waiting.extendleft(reversed(waiting))

    def _accept_token(
        self, seq: SequenceState, logits: torch.Tensor, row: int, now: float, token: int | None = None
    ) -> str | None:
        """Sample the sequence's next token from row `row` of the step's logits (unless
        `token`: sampled already, with the step's batch) and append it; the finish reason,
        if it ends here. The row is indexed only when something reads it (a tensor view per
        sequence per step is a cost the batched path does without)."""
        req = seq.request
        params = req.params
        tokens = seq.token_ids
        position = len(tokens) - req.num_prompt_tokens  # seq.num_output_tokens, before this token
        if token is None:
            # (a controlled request's row processed: its mask, biases and penalties over its tokens so far)
            processed = None
            if req.controls:
                processed = processed_logits(logits[row], params, tokens, req.num_prompt_tokens, req.stop_ids)
            try:
                if self.batched_sampling:
                    token = self._batch_sampler.sample_rows(
                        logits[row : row + 1] if processed is None else processed.unsqueeze(0),
                        [params],
                        [seq.sample_index],
                        [position],
                    )[0]
                else:
                    token = self.sampler(
                        logits[row] if processed is None else processed, params, seq.sample_index, position
                    )
            except NonFiniteLogitsError:
                raise NonFiniteLogitsError([row], [req.request_id], position) from None
        if self.record_logits:
            seq.logits.append(logits[row].detach().clone())
        if params.logprobs is not None:
            seq.logprobs.append(token_logprobs(logits[row], token, params.logprobs))
        if req.first_token_time is None:
            req.first_token_time = now
            req.inline = req.plain and not req.matches_text
        tokens.append(token)
        # The common token ends nothing: exactly the negation of `_stop_reason`'s checks, on
        # what the request fixed at add_request (its length, its stop ids, whether text
        # matters). Off with `inline_decode`: every token then meets `_stop_reason` itself, the
        # reference that tests/test_engine_scheduler.py holds both shortcuts to
        if self.inline_decode and not req.matches_text and token not in req.stop_ids and len(tokens) < req.end_len:
            return None
        return self._stop_reason(seq, token)

    def _text_tail(self, seq: SequenceState, num_tokens: int) -> deque[int]:
        """The last `num_tokens` output tokens of the sequence that have text, in order (its
        last token among them if it has text): the window a stop string ending in the last
        token lies in. A token of no text (a special token, which decode skips) holds no byte
        of a stop string, so the window passes over it, and leaves it out: decoded, the
        window's text is the same. Kept on the sequence from token to token (one append), and
        made afresh by one walk back where it does not end at the last token but one (its
        first check, a forked sequence): a window that reached back past each textless token
        every token, then decoded them all, was quadratic in an output of mostly special
        tokens."""
        tail, tokens, end = seq.text_tail, seq.token_ids, len(seq.token_ids)
        textless = self.textless_ids
        if tail is not None and tail.maxlen == num_tokens and seq.text_tail_end == end - 1:
            if tokens[-1] not in textless:
                tail.append(tokens[-1])
        else:
            tail = seq.text_tail = deque(maxlen=num_tokens)
            first = seq.request.num_prompt_tokens
            i = end
            while i > first and len(tail) < num_tokens:
                i -= 1
                if tokens[i] not in textless:
                    tail.appendleft(tokens[i])
        seq.text_tail_end = end
        return tail

    def _output_text(self, seq: SequenceState, ids: list[int]) -> str:
        """The text of output tokens `ids` (from the output's first): for a SentencePiece-style
        decoder, decoded after the prompt's last tokens of text and their text cut off (its
        first-space strip took the space of the output's first piece; a character the prompt
        leaves open is the output's: models/tokenizer.py decode_context, the server's and
        generate's stream's rule too), as the whole prompt and output decode it."""
        if self.byte_fallback is None:
            return self.decode_text(ids)
        if seq.spm_context is None:
            from kvpool.models.tokenizer import decode_context  # (the tokenizers library: not the simulator's)

            context, num_cut = decode_context(
                seq.token_ids, seq.request.num_prompt_tokens, self.byte_fallback, self.textless_ids, self._plain_byte
            )
            seq.spm_context = (context, self.decode_text(context[:num_cut]) if context else "")
        context, before = seq.spm_context
        if not context:
            return self.decode_text(ids)
        # (as many characters as its own text: a letter ending it that the output's bytes turn
        # invalid, with the run it joins, is one U+FFFD)
        return self.decode_text([*context, *ids])[len(before) :]

    def _spm_window(self, seq: SequenceState, longest: int) -> str:
        """The text of the output's last tokens (4 x `longest` + 6 of text) as the whole
        output's decode holds it, for a SentencePiece-style decoder: a run of byte-fallback
        tokens decodes as its UTF-8 text when all its bytes are valid, else as one U+FFFD a
        byte, so a window that cuts a run cannot be decoded alone (its part of the run may be
        valid where the run is not, or start inside a character). Where it cuts one: a valid
        run's part from its first character on; an invalid one's, one U+FFFD a byte. A trailing
        run that turns invalid (a byte that ends no character yet, or a bad one) turns all its
        text to U+FFFD: a stop string holding U+FFFD may then begin before it, in the text
        before the run (kept from the window of the token before it). Each step costs the
        window's decode and one byte's UTF-8 check, whatever the run's length."""
        tail = list(self._text_tail(seq, 4 * longest + 6))
        runs = self._spm_runs(seq)
        first = runs.num_text - len(tail)  # the text index of tail[0]
        while runs.closed and runs.closed[0][1] <= first:
            runs.closed.popleft()
        if runs.closed and runs.closed[0][0] < first:
            _, end, valid = runs.closed[0]
        elif runs.start is not None and runs.start < first:
            end, valid = runs.num_text, runs.valid
        else:
            end = None
        if end is None:  # (from the output's first token: decoded after the prompt's)
            window = self._output_text(seq, tail) if first == 0 else self.decode_text(tail)
        elif valid:  # its part from the first byte that begins a character
            skip = 0
            while skip < len(tail) and (self.byte_fallback.get(tail[skip], 0) & 0xC0) == 0x80:
                skip += 1
            window = self.decode_text(tail[skip:])
        elif end < runs.num_text:  # an invalid run the window cuts, and what follows it
            window = "\ufffd" * (end - first) + self.decode_text([self._plain_byte, *tail[end - first :]])[1:]
        else:  # a trailing invalid run: all its text U+FFFD
            window = runs.before + "\ufffd" * min(runs.num_text - runs.start, longest)
        runs.window = window
        return window

    def _spm_runs(self, seq: SequenceState) -> _SpmRuns:
        """The sequence's _SpmRuns, brought up to its last token (one token's step; a sequence
        seen for the first time, or forked, is read through once)."""
        runs, tokens, end = seq.spm_runs, seq.token_ids, len(seq.token_ids)
        if runs is None or runs.end != end - 1:
            runs = seq.spm_runs = _SpmRuns()
            runs.end = seq.request.num_prompt_tokens
            text = [t for t in tokens[runs.end : end - 1] if t not in self.textless_ids]
            for token in text:
                runs.add(token, self.byte_fallback.get(token), "")
            if runs.start is not None:
                runs.before = self._output_text(seq, text[: runs.start])
            runs.window = self._output_text(seq, text)
            runs.end = end - 1
        if tokens[-1] not in self.textless_ids:
            runs.add(tokens[-1], self.byte_fallback.get(tokens[-1]), runs.window)
        runs.end = end
        return runs

    def _stop_reason(self, seq: SequenceState, token: int) -> str | None:
        """Why the sequence ends with `token`, its last token (None: it goes on), and then its
        text."""
        req = seq.request
        params = req.params
        position = len(seq.token_ids) - 1 - req.num_prompt_tokens  # the output position of `token`
        reason = None
        stop_text: str | None = None
        # min_tokens: nothing but the length ends the sample before that many output tokens
        # (its stop ids were -inf: `processed_logits`), and after it only a stop string that
        # ends past the text of those tokens (vLLM's rule)
        early = position < params.min_tokens
        if token in req.stop_ids and not early:  # (the EOS ids, unless ignore_eos, and the request's stop_token_ids)
            reason = "stop"
        elif params.stop and self.decode_text is not None and position >= params.min_tokens:
            # A stop string that first appears with this token ends in it: it spans at most
            # 4 bytes a character, so at most that many tokens (byte-level BPE: each decodes
            # to one byte or more), plus the token it starts in. Decode that window, not the
            # whole output every step (quadratic in its length); the whole text on a hit.
            longest = max(len(s) for s in params.stop)
            if self.byte_fallback is None or self._plain_byte is None:
                window = self.decode_text(list(self._text_tail(seq, 4 * longest + 2)))
            else:
                window = self._spm_window(seq, longest)
            if any(s in window for s in params.stop):
                output = seq.output_ids
                text = self._output_text(seq, output)
                hits = [text.find(s) for s in params.stop if s in text]
                if params.min_tokens:  # only those ending past the text of the first min_tokens tokens
                    held = self._output_text(seq, output[: params.min_tokens])
                    # (where that text ends in half a character, U+FFFD, up to the characters it shares)
                    base = next((i for i, (a, b) in enumerate(zip(held, text, strict=False)) if a != b), len(held))
                    hits = [text.find(s, max(0, base - len(s) + 1)) for s in params.stop]
                    hits = [i for i in hits if i >= 0]
                if hits:
                    stop_text = text[: min(hits)]  # the text ends before the stop string
                    reason = "stop"
        # (the live max_model_len, which the request's end_len took at add_request: the same
        # while nothing changes it once requests are in, as nothing does)
        if reason is None and (position + 1 >= params.max_tokens or len(seq.token_ids) >= self.runner.max_model_len):
            reason = "length"
        if reason is not None:
            if stop_text is not None:
                seq.text = stop_text
            elif self.decode_text is not None:
                ids = seq.output_ids
                if reason == "stop" and ids and ids[-1] in req.stop_ids:
                    ids = ids[:-1]
                seq.text = self._output_text(seq, ids)
        return reason
