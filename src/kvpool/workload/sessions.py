"""Workloads known in advance (the simulator's): sessions of turns, each turn one request,
and the generators that draw them. Same seed, same workload (one
`numpy.random.default_rng(seed)`, drawn in a fixed order); token ids come from tokens.py, so
prompts are pure functions of names. live.py holds the other kind, whose next turn carries
a real model's answer.

A session's turn k sends the whole conversation so far, which is what makes history hits:

    turn k's prompt = prefix_ids | user_0 | answer_0 | user_1 | answer_1 | ... | user_k
    answer_j        = answer_ids(request_id(j), output_len_j)   (what the simulated model says)

`prefix_ids` is the shared head (a system prompt, a long document): one tuple object per
distinct prefix, referenced by every session that uses it, so 10,000 sessions over four
200k-token documents hold four documents, not 10,000 copies. A session built by hand may
leave it empty and put everything in turn 0's `user_ids`: the prompts are the same.

Generators and their parameters (lengths in tokens, times in seconds; "log-normal(m, s,
[lo, hi])" is exp(N(ln m, s)) rounded and clipped to [lo, hi], so m is its median):

  chat_workload     multi-turn chat over a few shared system prompts.
                    system prompt k = text_ids(f"system{k}", len_k), len_k ~ CHAT_SYSTEM_LEN =
                    log-normal(1000, 0.5, [128, 4096]), drawn once per prompt; each session
                    picks one uniformly at random. User message of turn j = text_ids(
                    f"{session_id}-u{j}", n), n ~ CHAT_USER_LEN = log-normal(120, 1.0, [4, 4096]).
                    Answer length ~ CHAT_OUTPUT_LEN = log-normal(250, 0.8, [8, 2048]).
                    Think time before turns 1.. ~ exponential, mean CHAT_THINK_S = 5.0.
  agentic_workload  a few long shared documents with many short follow-ups.
                    document k = text_ids(f"doc{k}", L_k), L_k uniform in context_len =
                    [30_000, 200_000]; each session picks one uniformly at random; question of
                    turn j = text_ids(f"{session_id}-u{j}", n), n uniform in question_len =
                    [20, 300]; answer length uniform in answer_len = [20, 400]; think time
                    (the agent's tool call) exponential, mean AGENTIC_THINK_S = 2.0.
  uniform_workload  single-turn requests of unrelated text: prompt text_ids(f"{session_id}-u0",
                    n), n uniform in prompt_len = [128, 2048]; output uniform in output_len =
                    [16, 512].

Session starts: arrivals.py's Poisson process at `rate` sessions per second (exponential
gaps, the first one gap after 0), or all at 0 when `rate` is math.inf.

A generator draws every length, start and think time up front (numpy arrays: the draws stay
in their order, so a seed gives the workload it always gave) and makes a session's token
ids only when the session is read (GeneratedSessions): a run streams its sessions in.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import NamedTuple, overload

import numpy as np

from kvpool.workload.arrivals import poisson_arrivals
from kvpool.workload.tokens import batch_text_ids, int_table, stream_key, stream_tokens

# --- argument checks: a ValueError that names the parameter ---------------------------------


def _check_count(name: str, value: object, minimum: int) -> None:
    if type(value) is not int or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")


def _check_range(name: str, value: object, minimum: int) -> None:
    ok = (
        isinstance(value, tuple | list)
        and len(value) == 2
        and all(type(v) is int for v in value)
        and minimum <= value[0] <= value[1]
    )
    if not ok:
        raise ValueError(f"{name} must be a pair of integers ({minimum} <= lo <= hi), got {value!r}")


def _check_mean(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value < math.inf:
        raise ValueError(f"{name} must be a finite number >= 0 (the mean), got {value!r}")


@dataclass(frozen=True, slots=True)
class Turn:
    """One request of a session."""

    user_ids: tuple[int, ...]  # tokens this turn appends to the conversation (after prefix_ids for turn 0)
    output_len: int  # tokens the answer has: the request ends after exactly this many
    think_s: float = 0.0  # seconds after the previous turn FINISHED before this one arrives (turn 0: unused)

    def __post_init__(self) -> None:
        if type(self.output_len) is not int or self.output_len < 1:
            raise ValueError(f"output_len must be an integer >= 1, got {self.output_len!r}")
        if not self.think_s >= 0 or math.isinf(self.think_s):
            raise ValueError(f"think_s must be a finite number >= 0, got {self.think_s!r}")


@dataclass(frozen=True, slots=True)
class Session:
    """A conversation: turn k arrives think_s after turn k-1 finished (turn 0 at start_s)."""

    session_id: str
    start_s: float  # arrival of turn 0, seconds after the start of the run
    turns: tuple[Turn, ...]
    tenant: str = ""
    prefix_ids: tuple[int, ...] = ()  # shared head of every prompt (system prompt, document)
    trace_line: int | None = None  # the trace line it was read from (errors name it); None: generated

    def __post_init__(self) -> None:
        if not self.turns:
            raise ValueError(f"session {self.session_id!r} has no turns")
        if not self.start_s >= 0 or math.isinf(self.start_s):
            raise ValueError(f"start_s must be a finite number >= 0, got {self.start_s!r}")

    def request_id(self, turn: int) -> str:
        return f"{self.session_id}-t{turn}"

    def describe(self, turn: int) -> str:
        """The request as an error message names it: by its trace line when it has one."""
        if self.trace_line is not None:
            return f"trace line {self.trace_line} (request {self.request_id(turn)})"
        return f"request {self.request_id(turn)}"

    def prompt_len(self, turn: int) -> int:
        """len(prompt_ids(turn)), from lengths alone."""
        self._check_turn(turn)
        history = sum(len(t.user_ids) + t.output_len for t in self.turns[:turn])
        return len(self.prefix_ids) + history + len(self.turns[turn].user_ids)

    def prompt_ids(
        self, turn: int, vocab_size: int, table: np.ndarray | None = None, previous: Sequence[int] | None = None
    ) -> list[int]:
        """prefix_ids | user_0 | answer_0 | ... | user_{turn-1} | answer_{turn-1} | user_turn.
        `table` (tokens.int_table(vocab_size)): the answers' ints are its shared objects, not
        new ones (8 bytes a token where a prompt is kept, not 40). `previous`: what
        prompt_ids(turn - 1) returned, kept by the caller (the simulator, between a turn and
        the next): the prompt is then it, answer_{turn-1} and user_turn, made in the time of
        those tokens rather than of every earlier answer (ValueError for turn 0 or a list
        that is not that prompt's length; its tokens are the caller's word)."""
        self._check_turn(turn)
        if previous is not None:
            if turn == 0 or len(previous) != self.prompt_len(turn - 1):
                raise ValueError(
                    f"previous holds {len(previous)} tokens; prompt_ids({turn - 1}) of session "
                    f"{self.session_id!r} holds {self.prompt_len(turn - 1) if turn else 'nothing (no turn -1)'}"
                )
            answer, user = self.turn_tail(turn, vocab_size)
            ids = list(previous)
            ids += (answer if table is None else table[answer.astype(np.intp)]).tolist()
            ids += user
            return ids
        earlier = self.turns[:turn]
        # every earlier answer in one vectorised pass: [answer_0 | answer_1 | ... ] end to end
        streams = stream_tokens(
            [stream_key(self.request_id(j)) for j in range(turn)],
            [t.output_len for t in earlier],
            vocab_size,
        )
        answers = (streams if table is None else table[streams.astype(np.intp)]).tolist()
        ids = list(self.prefix_ids)
        start = 0
        for t in earlier:
            ids += t.user_ids
            ids += answers[start : start + t.output_len]
            start += t.output_len
        ids += self.turns[turn].user_ids
        return ids

    def turn_tail(self, turn: int, vocab_size: int) -> tuple[np.ndarray, tuple[int, ...]]:
        """What turn `turn` (>= 1) appends to prompt_ids(turn - 1): answer_{turn-1}'s tokens
        ([output_len] uint64, `stream_tokens`') and user_turn's ids. ValueError for turn 0."""
        self._check_turn(turn)
        if turn == 0:
            raise ValueError(f"turn 0 of session {self.session_id!r} extends no earlier prompt")
        key = stream_key(self.request_id(turn - 1))
        return stream_tokens([key], [self.turns[turn - 1].output_len], vocab_size), self.turns[turn].user_ids

    def _check_turn(self, turn: int) -> None:
        if not 0 <= turn < len(self.turns):
            raise ValueError(f"turn must be in [0, {len(self.turns)}) for session {self.session_id!r}, got {turn}")


@dataclass(frozen=True, slots=True)
class Workload:
    """`sessions`: a tuple (a trace, a hand-built workload) or, from the generators,
    GeneratedSessions, which makes each session when it is read."""

    name: str
    sessions: tuple[Session, ...] | GeneratedSessions
    vocab_size: int
    params: dict[str, object] = field(default_factory=dict)  # the generator's parameters, for the report

    def __post_init__(self) -> None:
        if isinstance(self.sessions, GeneratedSessions):
            return  # ids f"{kind}{i}": unique by construction
        ids = {s.session_id for s in self.sessions}
        if len(ids) != len(self.sessions):
            raise ValueError(f"workload {self.name!r}: session ids are not unique")

    @property
    def num_requests(self) -> int:
        if isinstance(self.sessions, GeneratedSessions):
            return self.sessions.num_requests
        return sum(len(s.turns) for s in self.sessions)

    def max_request_len(self) -> int:
        """The longest prompt + output over all turns, from lengths alone (0 if empty)."""
        longest = self.longest_request()
        return 0 if longest is None else longest.num_tokens

    def longest_request(self) -> RequestLen | None:
        """The first request of the longest prompt + output, from lengths alone (None if empty)."""
        if isinstance(self.sessions, GeneratedSessions):
            return self.sessions.longest_request()
        longest = None
        for s in self.sessions:
            done = len(s.prefix_ids)  # tokens of the conversation before the current turn
            for k, t in enumerate(s.turns):
                done += len(t.user_ids) + t.output_len
                if longest is None or done > longest.num_tokens:
                    longest = RequestLen(s, k, done)
        return longest

    def in_arrival_order(self) -> Iterator[Session]:
        """The sessions by the arrival of their turn 0 (ties in their order here), one at a
        time: generated ones are made as they are read (their starts never decrease)."""
        if isinstance(self.sessions, GeneratedSessions):
            return iter(self.sessions)
        return iter(sorted(self.sessions, key=lambda s: s.start_s))


class RequestLen(NamedTuple):
    """One request (a session's turn) and its prompt + output tokens."""

    session: Session
    turn: int
    num_tokens: int

    def describe(self) -> str:
        return self.session.describe(self.turn)


@dataclass(frozen=True, slots=True)
class LogNormal:
    """exp(N(ln median, sigma)), rounded to an integer and clipped to [lo, hi]."""

    median: float
    sigma: float
    lo: int
    hi: int

    def __post_init__(self) -> None:
        if not self.median > 0 or not self.sigma >= 0:
            raise ValueError(f"LogNormal needs median > 0 and sigma >= 0, got {self.median!r}, {self.sigma!r}")
        _check_range("LogNormal [lo, hi]", (self.lo, self.hi), 1)

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """[n] int64 lengths."""
        x = rng.lognormal(math.log(self.median), self.sigma, size=n)
        return np.clip(np.rint(x), self.lo, self.hi).astype(np.int64)


CHAT_SYSTEM_LEN = LogNormal(median=1000, sigma=0.5, lo=128, hi=4096)
CHAT_USER_LEN = LogNormal(median=120, sigma=1.0, lo=4, hi=4096)
CHAT_OUTPUT_LEN = LogNormal(median=250, sigma=0.8, lo=8, hi=2048)
CHAT_THINK_S = 5.0
AGENTIC_THINK_S = 2.0


def chat_workload(
    num_sessions: int,
    turns: int,
    rate: float,
    vocab_size: int,
    seed: int,
    *,
    num_system_prompts: int = 4,
    system_len: LogNormal = CHAT_SYSTEM_LEN,
    user_len: LogNormal = CHAT_USER_LEN,
    output_len: LogNormal = CHAT_OUTPUT_LEN,
    think_s: float = CHAT_THINK_S,
) -> Workload:
    """Multi-turn chat: `turns` turns per session over `num_system_prompts` shared system
    prompts (parameters in the module docstring)."""
    lengths = {
        "system_len": (system_len.sample, asdict(system_len)),
        "user_len": (user_len.sample, asdict(user_len)),
        "output_len": (output_len.sample, asdict(output_len)),
    }
    return _shared_prefix_workload(
        ("chat", "chat", "system"),
        num_sessions,
        turns,
        rate,
        vocab_size,
        seed,
        ("num_system_prompts", num_system_prompts),
        lengths,
        think_s,
    )


def agentic_workload(
    num_sessions: int,
    turns: int,
    rate: float,
    vocab_size: int,
    seed: int,
    *,
    num_contexts: int = 4,
    context_len: tuple[int, int] = (30_000, 200_000),
    question_len: tuple[int, int] = (20, 300),
    answer_len: tuple[int, int] = (20, 400),
    think_s: float = AGENTIC_THINK_S,
) -> Workload:
    """Long shared documents, short follow-ups: each session reads one of `num_contexts`
    documents and asks `turns` short questions (parameters in the module docstring)."""
    _check_range("context_len", context_len, 1)
    _check_range("question_len", question_len, 1)
    _check_range("answer_len", answer_len, 1)
    lengths = {
        "context_len": (_uniform(context_len), list(context_len)),
        "question_len": (_uniform(question_len), list(question_len)),
        "answer_len": (_uniform(answer_len), list(answer_len)),
    }
    return _shared_prefix_workload(
        ("agentic", "agent", "doc"),
        num_sessions,
        turns,
        rate,
        vocab_size,
        seed,
        ("num_contexts", num_contexts),
        lengths,
        think_s,
    )


def uniform_workload(
    num_requests: int,
    rate: float,
    vocab_size: int,
    seed: int,
    *,
    prompt_len: tuple[int, int] = (128, 2048),
    output_len: tuple[int, int] = (16, 512),
) -> Workload:
    """Single-turn requests of unrelated text, lengths uniform in the (inclusive) ranges."""
    _check_count("num_requests", num_requests, 1)
    _check_count("vocab_size", vocab_size, 1)
    _check_range("prompt_len", prompt_len, 1)
    _check_range("output_len", output_len, 1)
    rng = np.random.default_rng(seed)
    starts = poisson_arrivals(num_requests, rate, rng)
    prompt_lens = _uniform(prompt_len)(rng, num_requests)
    output_lens = _uniform(output_len)(rng, num_requests)
    sessions = GeneratedSessions("req", starts, [()], [0] * num_requests, 1, prompt_lens, output_lens, None, vocab_size)
    params = {
        "num_requests": num_requests,
        "rate": rate,
        "seed": seed,
        "prompt_len": list(prompt_len),
        "output_len": list(output_len),
    }
    return Workload("uniform", sessions, vocab_size, params)


# n lengths drawn from a generator: LogNormal.sample, or _uniform's
Sampler = Callable[[np.random.Generator, int], np.ndarray]


def _uniform(lo_hi: tuple[int, int]) -> Sampler:
    """Integers uniform in [lo, hi], both ends included."""
    lo, hi = lo_hi
    return lambda rng, n: rng.integers(lo, hi, size=n, endpoint=True)


def _shared_prefix_workload(
    names: tuple[str, str, str],
    num_sessions: int,
    turns: int,
    rate: float,
    vocab_size: int,
    seed: int,
    num_prefixes: tuple[str, int],
    lengths: dict[str, tuple[Sampler, object]],
    think_s: float,
) -> Workload:
    """`num_sessions` sessions of `turns` turns, each on one of `num_prefixes` shared
    prefixes (chat's system prompts, agentic's documents). names: (the workload's name, its
    sessions' kind, the prefixes' name); num_prefixes: (its parameter's name, the count);
    lengths: the prefix's, a user turn's and an output's length parameter -> (its sampler,
    how `params` shows it). `params` also holds the prefixes' drawn lengths, under the
    prefix length's name + "s". Drawn from default_rng(seed) in this order: session starts,
    the prefixes' lengths, each session's prefix, every turn's user and output lengths, the
    think times (none when think_s is 0). Prefix k is text_ids(f"{prefix_name}{k}", its length)."""
    name, kind, prefix_name = names
    count_name, count = num_prefixes
    for what, value in (("num_sessions", num_sessions), ("turns", turns), ("vocab_size", vocab_size), num_prefixes):
        _check_count(what, value, 1)
    _check_mean("think_s", think_s)
    (prefix_len, _), (user_len, _), (output_len, _) = lengths.values()
    rng = np.random.default_rng(seed)
    starts = poisson_arrivals(num_sessions, rate, rng)
    prefix_lens = prefix_len(rng, count).tolist()
    picks = rng.integers(count, size=num_sessions)
    n = num_sessions * turns
    user_lens, output_lens = user_len(rng, n), output_len(rng, n)
    thinks = rng.exponential(think_s, size=n) if think_s > 0 else None
    # each prefix once (text_ids is ~0.5 us a token in pure Python; this is the batched twin)
    prefixes = batch_text_ids([f"{prefix_name}{k}" for k in range(count)], prefix_lens, vocab_size)
    sessions = GeneratedSessions(kind, starts, prefixes, picks, turns, user_lens, output_lens, thinks, vocab_size)
    params: dict[str, object] = {"num_sessions": num_sessions, "turns": turns, "rate": rate, "seed": seed}
    params[count_name] = count
    params |= {what: shown for what, (_, shown) in lengths.items()}
    params |= {"think_s": think_s, f"{next(iter(lengths))}s": prefix_lens}
    return Workload(name, sessions, vocab_size, params)


# generated sessions `GeneratedSessions.__iter__` makes in one pass: their messages (turns
# each) stay within tokens.stream_tokens' few-streams path (64 streams) at 4 turns
SESSIONS_PER_PASS = 16


class GeneratedSessions(Sequence[Session]):
    """A generator's sessions, each made when it is read.

    Held: each session's start and prefix (an index into the shared prefixes, held once),
    each turn's user and output lengths and think time: numpy arrays, about 30 bytes a
    request. `[i]` makes session i = f"{kind}{i}": its turn j's user message is
    text_ids(f"{kind}{i}-u{j}", user_lens[i * turns + j]), the same tokens the whole
    workload built up front held. Nothing keeps a session made: the simulator reads them in
    arrival order (`iter`) and drops each when its last turn finished, so a run holds the
    sessions in flight, not every session's token ids (a 100k-request chat built up front
    held about 250 MB of them)."""

    def __init__(
        self,
        kind: str,
        starts: Sequence[float],
        prefixes: Sequence[tuple[int, ...]],
        picks: Sequence[int],
        turns: int,
        user_lens: Sequence[int],
        output_lens: Sequence[int],
        thinks: Sequence[float] | None,
        vocab_size: int,
    ) -> None:
        num = len(starts)
        if not (len(picks) == num and len(user_lens) == len(output_lens) == num * turns):
            raise ValueError(f"{num} sessions of {turns} turns: got {len(picks)} picks, {len(user_lens)} lengths")
        self.kind, self.turns, self.vocab_size = kind, turns, vocab_size
        self.prefixes = tuple(prefixes)
        self._starts = np.asarray(starts, dtype=np.float64)  # [sessions] seconds, non-decreasing
        if num and not np.all(np.diff(self._starts) >= 0):
            raise ValueError("generated sessions start in order: the starts must not decrease")
        self._picks = np.asarray(picks, dtype=np.int64)  # [sessions] index into prefixes
        self._user_lens = np.asarray(user_lens, dtype=np.int64)  # [sessions * turns]
        self._output_lens = np.asarray(output_lens, dtype=np.int64)  # [sessions * turns]
        self._thinks = None if thinks is None else np.asarray(thinks, dtype=np.float64)  # [sessions * turns]
        self._table = int_table(vocab_size)  # the token ints every session shares

    def __len__(self) -> int:
        return len(self._starts)

    @property
    def num_requests(self) -> int:
        return len(self) * self.turns

    @overload
    def __getitem__(self, index: int) -> Session: ...

    @overload
    def __getitem__(self, index: slice) -> tuple[Session, ...]: ...

    def __getitem__(self, index: int | slice) -> Session | tuple[Session, ...]:
        if isinstance(index, slice):
            return tuple(self[i] for i in range(*index.indices(len(self))))
        num = len(self)
        if not -num <= index < num:
            raise IndexError(f"session {index} of {num}")
        i = index % num
        return self._make(i, i + 1)[0]

    def _make(self, lo: int, hi: int) -> list[Session]:
        """Sessions [lo, hi), their user messages made in one `batch_text_ids` pass."""
        turns = self.turns
        names = [f"{self.kind}{i}-u{j}" for i in range(lo, hi) for j in range(turns)]
        first, last = lo * turns, hi * turns
        messages = batch_text_ids(names, self._user_lens[first:last].tolist(), self.vocab_size, self._table)
        outputs = self._output_lens[first:last].tolist()
        thinks = [0.0] * len(names) if self._thinks is None else self._thinks[first:last].tolist()
        starts, picks, prefixes = self._starts[lo:hi].tolist(), self._picks[lo:hi].tolist(), self.prefixes
        out = []
        for k in range(hi - lo):
            base = k * turns
            session_turns = tuple(
                Turn(messages[base + j], outputs[base + j], thinks[base + j] if j else 0.0) for j in range(turns)
            )
            out.append(Session(f"{self.kind}{lo + k}", starts[k], session_turns, prefix_ids=prefixes[picks[k]]))
        return out

    def __iter__(self) -> Iterator[Session]:
        """Every session in order, made SESSIONS_PER_PASS at a time (`_make`: one pass of the
        numpy work for their messages, whose cost is mostly per call at a session's ~700
        tokens); `self[i]`, one at a time, is its twin."""
        for lo in range(0, len(self), SESSIONS_PER_PASS):
            made = self._make(lo, min(lo + SESSIONS_PER_PASS, len(self)))
            made.reverse()
            while made:  # (popped: a session read and done is not held by its pass)
                yield made.pop()

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, GeneratedSessions):
            return NotImplemented
        same_thinks = (self._thinks is None and other._thinks is None) or (
            self._thinks is not None and other._thinks is not None and np.array_equal(self._thinks, other._thinks)
        )
        return (
            (self.kind, self.turns, self.vocab_size, self.prefixes)
            == (other.kind, other.turns, other.vocab_size, other.prefixes)
            and same_thinks
            and all(
                np.array_equal(a, b)
                for a, b in (
                    (self._starts, other._starts),
                    (self._picks, other._picks),
                    (self._user_lens, other._user_lens),
                    (self._output_lens, other._output_lens),
                )
            )
        )

    __hash__ = None  # type: ignore[assignment]

    def longest_request(self) -> RequestLen | None:
        """Workload.longest_request from the lengths: the first (session, turn), in that
        order, of the most prompt + output tokens; only that session is made."""
        if not len(self):
            return None
        per_turn = (self._user_lens + self._output_lens).reshape(len(self), self.turns)
        prefix_lens = np.array([len(p) for p in self.prefixes], dtype=np.int64)[self._picks]
        done = prefix_lens[:, None] + np.cumsum(per_turn, axis=1)  # [sessions, turns] tokens so far
        flat = int(np.argmax(done))  # the first of the largest, row by row
        i, k = divmod(flat, self.turns)
        return RequestLen(self[i], k, int(done[i, k]))
