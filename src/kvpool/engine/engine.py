"""The engine: requests in, tokens out, over any ModelRunner.

Each step the scheduler (continuous batching under a token budget):
  1. gives every running sequence its next chunk, in arrival order: one token for a
     decode, up to the remaining budget for a prompt still being prefilled (chunked
     prefill). When the cache cannot grow, the latest-arrived running sequence is
     preempted (its cache released; it recomputes later) until the reservation fits;
  2. admits waiting sequences in arrival order with the budget left (the runner looks up
     their cached prefix, so only the uncached part is prefilled).
A sequence that fits the pool alone always makes progress (the oldest is never the
victim of a younger one), so the loop cannot deadlock. The scheduler only asks the runner
"can this sequence get N more tokens?"; it never sees blocks or tensors.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from kvpool.engine.runner import ModelRunner, ScheduledChunk
from kvpool.engine.sampling import SamplingParams, sample_token


@dataclass
class SequenceState:
    seq_id: str
    request: RequestState
    sample_index: int
    token_ids: list[int]  # prompt + generated so far
    num_computed: int = 0
    in_runner: bool = False  # admitted (holds cache) in the runner
    finish_reason: str | None = None
    text: str = ""
    logits: list[torch.Tensor] = field(default_factory=list)  # recorded when the engine asks

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.request.num_prompt_tokens :]


@dataclass
class RequestState:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    arrival_time: float
    seqs: list[SequenceState] = field(default_factory=list)
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache at first admission
    first_admitted: bool = False
    first_token_time: float | None = None
    finish_time: float | None = None
    error: str | None = None
    forked: bool = False

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.seqs) and (self.forked or self.params.n == 1)


@dataclass(frozen=True)
class Completion:
    token_ids: list[int]
    text: str
    finish_reason: str  # "stop" (EOS or stop string), "length", "abort"


@dataclass(frozen=True)
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    completions: list[Completion]
    num_cached_tokens: int
    ttft_s: float | None
    tpot_s: float | None
    latency_s: float | None


class Engine:
    def __init__(
        self,
        runner: ModelRunner,
        *,
        max_num_batched_tokens: int = 512,
        max_num_seqs: int = 64,
        eos_token_ids: Sequence[int] = (),
        decode_text: Callable[[list[int]], str] | None = None,
        record_logits: bool = False,
        clock: Callable[[], float] = time.perf_counter,
    ):
        if max_num_batched_tokens <= 0 or max_num_seqs <= 0:
            raise ValueError(
                f"max_num_batched_tokens and max_num_seqs must be positive, "
                f"got {max_num_batched_tokens}, {max_num_seqs}"
            )
        self.runner = runner
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.eos_token_ids = frozenset(eos_token_ids)
        self.decode_text = decode_text
        self.record_logits = record_logits
        self.clock = clock
        self.requests: dict[str, RequestState] = {}
        self.waiting: deque[SequenceState] = deque()
        self.running: list[SequenceState] = []
        self.num_preemptions = 0
        self.num_steps = 0
        self._ids = itertools.count()

    # ---- public API -----------------------------------------------------------------

    def add_request(
        self, prompt_ids: Sequence[int], params: SamplingParams | None = None, request_id: str | None = None
    ) -> str:
        """Queue a request. ValueError (and nothing queued) for an empty or too-long prompt."""
        params = params or SamplingParams()
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        prompt = [int(t) for t in prompt_ids]
        if not prompt:
            raise ValueError(f"request {request_id!r}: the prompt is empty")
        limit = self.runner.max_model_len
        if len(prompt) >= limit:
            raise ValueError(
                f"request {request_id!r}: prompt of {len(prompt)} tokens is too long; "
                f"at most {limit - 1} tokens fit (max_model_len {limit}, leaving room for one output token)"
            )
        vocab = self.runner.vocab_size
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"request {request_id!r}: token ids {bad[:5]} outside the vocabulary [0, {vocab})")
        req = RequestState(request_id, prompt, params, self.clock())
        seq = SequenceState(f"{request_id}/0", req, 0, list(prompt))
        req.seqs.append(seq)
        self.requests[request_id] = req
        self.waiting.append(seq)
        return request_id

    def abort(self, request_id: str) -> bool:
        """Cancel a request at any point; its cache is released once. False if unknown or done."""
        req = self.requests.get(request_id)
        if req is None or req.finished:
            return False
        for seq in req.seqs:
            if seq.finish_reason is None:
                self._finish(seq, "abort")
        req.forked = True  # no fork is coming any more
        req.finish_time = self.clock()
        return True

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def output(self, request_id: str) -> RequestOutput:
        req = self.requests[request_id]
        completions = [
            Completion(s.output_ids, s.text if self.decode_text else "", s.finish_reason or "") for s in req.seqs
        ]
        ttft = None if req.first_token_time is None else req.first_token_time - req.arrival_time
        n_out = max(len(s.output_ids) for s in req.seqs)
        tpot = None
        if req.finish_time is not None and req.first_token_time is not None and n_out > 1:
            tpot = (req.finish_time - req.first_token_time) / (n_out - 1)
        latency = None if req.finish_time is None else req.finish_time - req.arrival_time
        return RequestOutput(request_id, req.prompt_ids, completions, req.num_cached_tokens, ttft, tpot, latency)

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams | None = None) -> list[RequestOutput]:
        ids = [self.add_request(p, params) for p in prompts]
        while self.has_unfinished():
            self.step()
        return [self.output(i) for i in ids]

    # ---- scheduling -----------------------------------------------------------------

    def _preempt(self, seq: SequenceState) -> None:
        self.runner.release(seq.seq_id, "preempt")
        seq.in_runner = False
        seq.num_computed = 0
        self.running.remove(seq)
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def _finish(self, seq: SequenceState, reason: str) -> None:
        seq.finish_reason = reason
        if seq.in_runner:
            self.runner.release(seq.seq_id, "cancel" if reason == "abort" else "finish")
            seq.in_runner = False
        if seq in self.running:
            self.running.remove(seq)
        if seq in self.waiting:
            self.waiting.remove(seq)

    def schedule(self) -> list[ScheduledChunk]:
        budget = self.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(len(seq.token_ids) - seq.num_computed, budget)
            assert n > 0, "a running sequence always has a token to compute"
            while not self.runner.reserve(seq.seq_id, n):
                preempted = True
                victim = self.running[-1]
                self._preempt(victim)
                if victim is seq:
                    break
            if not seq.in_runner:
                break  # it preempted itself: everything after it is gone too
            end = seq.num_computed + n
            chunks.append(
                ScheduledChunk(
                    seq.seq_id, seq.token_ids[seq.num_computed : end], seq.num_computed, end == len(seq.token_ids)
                )
            )
            budget -= n
            i += 1
        while self.waiting and budget > 0 and not preempted and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            admitted = self.runner.admit(seq.seq_id, seq.token_ids, budget)
            if admitted is None:
                break
            self.waiting.popleft()
            seq.in_runner = True
            seq.num_computed = admitted.num_cached_tokens
            req = seq.request
            if not req.first_admitted:
                req.first_admitted = True
                req.num_cached_tokens = min(admitted.num_cached_tokens, req.num_prompt_tokens)
            self.running.append(seq)
            n = admitted.num_scheduled_tokens
            end = seq.num_computed + n
            chunks.append(
                ScheduledChunk(
                    seq.seq_id, seq.token_ids[seq.num_computed : end], seq.num_computed, end == len(seq.token_ids)
                )
            )
            budget -= n
        if not chunks and self.waiting:
            head = self.waiting[0]
            raise RuntimeError(
                f"sequence {head.seq_id!r} of {len(head.token_ids)} tokens cannot be admitted into an idle cache "
                f"of {self.runner.capacity_tokens} tokens"
            )
        return chunks

    # ---- one step -------------------------------------------------------------------

    def step(self) -> list[str]:
        """Schedule, run the model once, sample. Returns the ids of requests finished in this step."""
        chunks = self.schedule()
        if not chunks:
            return []
        self.num_steps += 1
        logits = self.runner.execute(chunks)
        now = self.clock()
        seqs = {s.seq_id: s for s in self.running}
        finished: list[str] = []
        row = 0
        for chunk in chunks:
            seq = seqs[chunk.seq_id]
            self.runner.commit(seq.seq_id, len(chunk.token_ids))
            seq.num_computed += len(chunk.token_ids)
            if not chunk.needs_logits:
                continue
            seq_logits = logits[row]
            row += 1
            req = seq.request
            family = [seq]
            if req.params.n > 1 and not req.forked:
                # The prompt is computed once: fork the other samples off it (they share its
                # blocks; the shared tail block is copied on their first write).
                req.forked = True
                for j in range(1, req.params.n):
                    child_id = f"{req.request_id}/{j}"
                    if self.runner.fork(seq.seq_id, child_id):
                        child = SequenceState(child_id, req, j, list(seq.token_ids), seq.num_computed, True)
                        self.running.append(child)
                    else:
                        # No cache state of its own to be had now (a V4 state block): the child
                        # takes its first token from these logits, then waits like a preempted
                        # sequence and is admitted through the prefix cache when room frees up.
                        child = SequenceState(child_id, req, j, list(seq.token_ids), 0, False)
                        self.waiting.appendleft(child)
                    req.seqs.append(child)
                    family.append(child)
            for s in family:
                self._accept_token(s, seq_logits, now)
            if req.finished and req.finish_time is None:
                req.finish_time = now
                finished.append(req.request_id)
        return finished

    def _accept_token(self, seq: SequenceState, logits: torch.Tensor, now: float) -> None:
        req = seq.request
        params = req.params
        position = len(seq.output_ids)
        token = sample_token(logits, params, seq.sample_index, position)
        if self.record_logits:
            seq.logits.append(logits.detach().clone())
        if req.first_token_time is None:
            req.first_token_time = now
        seq.token_ids.append(token)
        reason = None
        stop_text: str | None = None
        if token in self.eos_token_ids and not params.ignore_eos:
            reason = "stop"
        elif params.stop and self.decode_text is not None:
            text = self.decode_text(seq.output_ids)
            hits = [text.find(s) for s in params.stop if s in text]
            if hits:
                stop_text = text[: min(hits)]  # the text ends before the stop string
                reason = "stop"
        if reason is None and (
            len(seq.output_ids) >= params.max_tokens or len(seq.token_ids) >= self.runner.max_model_len
        ):
            reason = "length"
        if reason is not None:
            if stop_text is not None:
                seq.text = stop_text
            elif self.decode_text is not None:
                ids = seq.output_ids
                if reason == "stop" and ids and ids[-1] in self.eos_token_ids:
                    ids = ids[:-1]
                seq.text = self.decode_text(ids)
            self._finish(seq, reason)
        elif seq.in_runner:  # a waiting sequence hands over all its tokens when admitted
            self.runner.append_tokens(seq.seq_id, [token])
