"""The batched sampler: every row of a step at once, in tensors on the logits' device.

`sample_batch` samples a step's rows (greedy, temperature, top-k, top-p, per-request seeds)
with one host synchronisation, for the tokens; `BatchSampler` keeps what a batch's
parameters alone determine from one step to the next while an engine samples the same
rows. Their tokens are sampling.py's `sample_token`'s, row by row: the same uniform
(`uniform_draw`) through the same arithmetic (sampling.py's module docstring says where the
two can differ: exact ties in probability, a GPU's other rounding).
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Iterable, Sequence
from itertools import compress, count, islice, repeat
from typing import Any, NamedTuple, Protocol

import numpy as np
import torch

from kvpool.engine.sampling import (
    _MASK64,
    GREEDY_TEMPERATURE,
    NonFiniteLogitsError,
    SamplingParams,
    _splitmix64,
    draws_at,
    min_p_filtered,
    seed_words,
)

_TEMPERATURE, _TOP_P, _TOP_K, _SEED, _MIN_P = map(
    operator.attrgetter, ("temperature", "top_p", "top_k", "seed", "min_p")
)
_NO_WORDS, _NO_DRAWS = np.empty(0, dtype=np.uint64), np.empty((0, 1), dtype=np.float32)  # (never written)
_NO_ROWS = np.empty(0, dtype=np.int64)  # a greedy batch's rows that draw (never written)
# The least positive fp32 (a subnormal): sample_batch's least top_p in its fp32 arithmetic.
TOP_P_MIN = 2.0**-149
# A kept batch whose rows draw at consecutive positions hashes this many steps' uniforms at
# once (`_BatchRows.uniforms`): ~13 numpy calls every AHEAD steps instead of every step.
AHEAD = 32
# A drawing batch edited in place (`_BatchRows.edited`) hashes this many joined rows' seed
# words in Python, more in numpy (`seed_words`, its twin: the same bits). At 8 rows
# `PYTHONPATH=src python -m timeit -s "from kvpool.engine.sampling import _splitmix64,
# _MASK64, seed_words; s = list(range(8)); i = [0] * 8" "[_splitmix64(_splitmix64(a &
# _MASK64) ^ b) for a, b in zip(s, i)]"` 11 us, "seed_words(s, i)" 18.6 us; 2026-12-06,
# 2 shared Xeon cores, load ~10
FEW_JOINED = 8
# A changed batch is matched to the last one by identity, in order (`_match`), with at most
# this many mismatches (a row joined or moved, a run of rows left) before its other rows are
# placed by a dict of the last owners' ids instead
MAX_MISMATCHES = 16


def sample_batch(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    sample_indices: Sequence[int],
    positions: Sequence[int],
) -> list[int]:
    """logits [rows, vocab] (any float dtype, any device) -> one token id per row, row i
    sampled by params[i] at (sample_indices[i], positions[i]).

    Every row in tensor ops on the logits' device (one group of ops per kind of top-k /
    top-p among the rows); the host synchronises once, for the tokens. Greedy rows are the
    argmax; a stochastic row keeps its top-k, then its top-p nucleus (both renormalised),
    and draws by inverse CDF with `uniform_draw`'s uniform: `sample_token`'s token (the
    module docstring says where they can differ)."""
    num_rows = logits.shape[0]
    if not len(params) == len(sample_indices) == len(positions) == num_rows:
        raise ValueError(
            f"sample_batch: {num_rows} logit rows but {len(params)} params, "
            f"{len(sample_indices)} sample indices, {len(positions)} positions"
        )
    if num_rows == 0:
        return []
    rows = _BatchRows.of(params, sample_indices, logits.shape[-1], logits.device)
    return rows.sample(logits, lambda: np.fromiter(positions, np.int64, num_rows))


class _BatchRows:
    """What `sample_batch` derives from a batch's parameters alone, made once for a batch of
    rows (`BatchSampler` keeps it while the rows stay), in persistent tensors on the logits'
    device: which rows draw, their groups of one top-k and top-p kind with each group's fp32
    temperature and top_p columns, the draws' seed words (`_mix64`'s first two rounds of
    (seed, sample index), which only the position, its third round, changes from step to
    step) and the buffer a step writes its fp32 uniforms into. A step then costs its
    uniforms (`uniforms`: most steps of a kept batch copy them from a table of the next
    AHEAD steps' draws), one copy of them (none on the CPU) and the groups' tensor ops."""

    __slots__ = (
        "num_rows",
        "stochastic",
        "stochastic_t",
        "mixed",
        "groups",
        "order",
        "u_host",
        "u_np",
        "u",
        "next_at",
        "ahead",
        "ahead_top",
        "num_ahead_used",
        "host_columns",
        "fresh",
    )

    def __init__(self, num_rows: int, stochastic: np.ndarray) -> None:
        self.num_rows = num_rows
        self.stochastic = stochastic  # [m] int64, increasing: the rows that draw
        self.stochastic_t: torch.Tensor | None = None  # the same on the device, when some rows are greedy
        # the rest is set by `of` where some row draws (m > 0)
        self.mixed = _NO_WORDS  # [m] uint64: `seed_words` of the rows that draw
        self.groups: list[_Group] = []
        self.order: np.ndarray | None = None  # [m]: the drawing rows in group order; None: one group
        self.u_host: torch.Tensor | None = None  # [m, 1] fp32: the uniforms, in group order (pinned on CUDA)
        self.u: torch.Tensor | None = None  # the same on the device (u_host itself on the CPU)
        self.u_np = _NO_DRAWS  # [m, 1] fp32: u_host's memory
        # `uniforms`' state: the drawing rows' positions one on from the last step's (None
        # before the first step); the table of AHEAD steps' uniforms made at the second of
        # consecutive steps, ahead[:, j] [m] fp32 in group order the j-th step's from there
        # (ahead_top[j]: whether one is 1.0), num_ahead_used of them taken. A row's draws
        # lie together (a row of the table): an edit moves rows, one contiguous copy each
        self.next_at: np.ndarray | None = None  # [m] int64
        self.ahead: np.ndarray | None = None  # [m, AHEAD] fp32
        self.ahead_top: list[bool] = []
        self.num_ahead_used = 0
        self.host_columns: np.ndarray | None = None  # [m, 2] fp64: temperature, top_p (what `edited` moves)
        # [f] int64: drawing rows that joined by `edited`, whose columns of the table are
        # filled at the next step (their positions are known then); None: none
        self.fresh: np.ndarray | None = None

    @classmethod
    def of(
        cls, params: Sequence[SamplingParams], sample_indices: Sequence[int], vocab: int, device: torch.device
    ) -> _BatchRows:
        num_rows = len(params)
        # the rows that are not `greedy` (temperature >= GREEDY_TEMPERATURE), in numpy: one
        # attribute read a row, no Python comparison a row
        temperature = np.fromiter(map(_TEMPERATURE, params), np.float64, num_rows)
        stochastic = np.flatnonzero(temperature >= GREEDY_TEMPERATURE)  # [m] int64, increasing
        rows = cls(num_rows, stochastic)
        m = len(stochastic)
        if not m:  # a greedy batch: nothing to draw with
            return rows
        if m == num_rows:  # every row draws (a temperature step): the rows as they come
            picked, indices = params, sample_indices
        else:
            rows_at = stochastic.tolist()
            picked, indices = [params[i] for i in rows_at], [sample_indices[i] for i in rows_at]
            rows.stochastic_t = _to_device(torch.from_numpy(stochastic), device)
        rows.mixed = seed_words(list(map(_SEED, picked)), indices)
        # the per-row parameters in fp32, as the arithmetic reads them (torch's conversion of
        # the fp64 values). A top_p is at least TOP_P_MIN, the least positive fp32: one that
        # fp32 rounds to 0 keeps the first candidate by itself (0 >= top_p would drop it), as
        # sample_token's does
        top_p = np.maximum(np.fromiter(map(_TOP_P, picked), np.float64, m), TOP_P_MIN)
        host_columns = np.empty((m, 2))  # [m, 2] fp64: temperature, top_p
        host_columns[:, 0], host_columns[:, 1] = temperature[stochastic] if m < num_rows else temperature, top_p
        rows.host_columns = host_columns
        columns = torch.from_numpy(host_columns).float()  # [m, 2] fp32
        # clamped in Python first: a top_k may be any int, beyond int64 too
        k = np.fromiter(map(min, map(_TOP_K, picked), repeat(vocab)), np.int64, m)
        k[k == 0] = vocab  # top-k off (0), or at least the vocabulary: all of it
        nucleus = top_p < 1.0
        min_p = np.fromiter(map(_MIN_P, picked), np.float64, m)
        filtered = min_p > 0.0
        # the groups of one (k, top-p on, min-p on) kind, in their first rows' order
        keys = (k << 2) | (nucleus << 1) | filtered  # [m] int64: one key a kind
        if (keys == keys[0]).all():  # (the usual step: every row alike)
            members = [np.arange(m)]
        else:
            _, first, inverse = np.unique(keys, return_index=True, return_inverse=True)
            members = [np.flatnonzero(inverse == g) for g in np.argsort(first, kind="stable")]
            rows.order = np.concatenate(members)
        pin = device.type == "cuda"
        rows.u_host = torch.empty((m, 1), dtype=torch.float32, pin_memory=pin)
        rows.u_np = rows.u_host.numpy()
        rows.u = rows.u_host if device.type == "cpu" else torch.empty((m, 1), dtype=torch.float32, device=device)
        start = 0
        for member in members:
            g = len(member)
            index = None if g == m else _to_device(torch.from_numpy(member), device)
            picked_columns = _to_device(columns if g == m else columns[torch.from_numpy(member)], device)
            # (min_p's fp32 column, as sample_token's fp32 scalar: torch's conversion of the fp64 values)
            min_p_column = None
            if filtered[member[0]]:
                min_p_column = _to_device(torch.from_numpy(min_p[member, None]).float(), device)
            rows.groups.append(
                _Group(
                    int(k[member[0]]),
                    bool(nucleus[member[0]]),
                    index,
                    picked_columns[:, 0:1],
                    picked_columns[:, 1:2],
                    rows.u[start : start + g],
                    min_p_column,
                )
            )
            start += g
        return rows

    def edited(
        self,
        src: np.ndarray,
        joined: list[int],
        params: Sequence[SamplingParams],
        sample_indices: Sequence[int],
        vocab: int,
        device: torch.device,
    ) -> _BatchRows | None:
        """These rows for a batch that changed by a few rows (`BatchSampler`): src [n] int64,
        each new row's row here (-1 for the rows `joined`, increasing, whose params and
        sample indices are given) -> the new batch's rows, the kept rows' seed words,
        parameter columns, positions and table of coming draws moved with them (a few numpy
        passes) and only the joined rows' made; their columns of the table are filled at the
        next step (`uniforms`, where their positions are known). `of` builds the same rows
        (its twin: BatchSampler.incremental False). None where the edit does not hold and the
        rows are built anew: here or there a row that does not draw, more than one group of
        top-k / top-p kinds (or a joined row of another kind than the rows here)."""
        m, n = len(self.stochastic), len(src)
        if not m or m != self.num_rows or len(self.groups) != 1 or self.host_columns is None:
            return None
        if self.groups[0].min_p is not None or any(map(_MIN_P, params)):  # (min-p rows: built anew)
            return None
        group = self.groups[0]
        num_joined = len(joined)
        # (`of`'s rules, each joined row against the one group's kind: a few rows, in Python)
        temperature = list(map(_TEMPERATURE, params))
        top_p = [max(p, TOP_P_MIN) for p in map(_TOP_P, params)]
        for t, p, top_k in zip(temperature, top_p, map(_TOP_K, params), strict=True):
            k = min(top_k, vocab)
            if t < GREEDY_TEMPERATURE or (k if k else vocab) != group.k or (p < 1.0) != group.nucleus:
                return None
        rows = _BatchRows(n, self.stochastic if n == m else np.arange(n))
        kept_at = (src >= 0).nonzero()[0]  # [n - num_joined]: the kept rows, now
        taken = src.take(kept_at)  # [n - num_joined]: their rows here
        # where they go: the leading rows where the joined ones are appended (the engine's
        # batch: a slice, no index), else by index (`take` reads: at 128 rows `python -m timeit
        # -s "import numpy as np; h = np.zeros((256, 2)); i = np.arange(0, 256, 2)" "h.take(i,
        # axis=0)"` 0.67 us, "h[i]" 3.6 us; 2026-12-06, 2 shared Xeon cores, load ~10)
        num_kept = n - num_joined
        appended = not joined or joined[0] == num_kept  # (joined increasing: rows [num_kept, n))
        place: slice | np.ndarray = slice(0, num_kept) if appended else kept_at
        # (a slice: at 4 rows `python -m timeit -s "import numpy as np; x = np.zeros(256,
        # dtype=np.uint64); v = [1, 2, 3, 4]; j = [124, 125, 126, 127]" "x[124:128] = v"` 0.38
        # us, "x[j] = v" 1.3 us; 2026-12-06, 2 shared Xeon cores, load ~10)
        tail: slice | list[int] = slice(num_kept, n) if appended else joined
        rows.mixed = np.empty(n, dtype=np.uint64)
        rows.mixed[place] = self.mixed.take(taken)
        host_columns = np.empty((n, 2))
        host_columns[place] = self.host_columns.take(taken, axis=0)
        if num_joined:
            seeds = list(map(_SEED, params))
            if num_joined <= FEW_JOINED:  # `seed_words`' two rounds in Python (FEW_JOINED's figures)
                rows.mixed[tail] = [
                    _splitmix64(_splitmix64(seed & _MASK64) ^ index)
                    for seed, index in zip(seeds, sample_indices, strict=True)
                ]
            else:
                rows.mixed[tail] = seed_words(seeds, sample_indices)
            host_columns[tail, 0], host_columns[tail, 1] = temperature, top_p
        rows.host_columns = host_columns
        # [n, 1] fp32 each (numpy's IEEE rounding of the fp64 values, as torch's .float() in
        # `of`: the twin test holds them equal; at 128 rows `python -m timeit -s "import numpy
        # as np, torch; c = np.zeros((128, 2))" "c.astype(np.float32)"` 0.55 us,
        # "torch.from_numpy(c).float()" 3.0 us; 2026-12-06, 2 shared Xeon cores, load ~10)
        temperature_t, top_p_t = _column_views(host_columns.astype(np.float32), device)
        if n == m:  # the uniforms' buffers kept (their size is the batch's), the group's view of them too
            rows.u_host, rows.u_np, rows.u = self.u_host, self.u_np, self.u
            u = group.u
        else:
            rows.u_host = torch.empty((n, 1), dtype=torch.float32, pin_memory=device.type == "cuda")
            rows.u_np = rows.u_host.numpy()
            rows.u = rows.u_host if device.type == "cpu" else torch.empty((n, 1), dtype=torch.float32, device=device)
            u = rows.u[0:n]
        rows.groups.append(_Group(group.k, group.nucleus, None, temperature_t, top_p_t, u))
        if self.next_at is not None:  # the kept rows' next positions, the joined ones' set at the next step
            rows.next_at = np.zeros(n, dtype=np.int64)
            rows.next_at[place] = self.next_at.take(taken)
            rows.fresh = np.array(joined, dtype=np.int64)
            if self.ahead is not None:  # the kept rows' rows of the table (one group: rows in order)
                rows.ahead = np.empty((n, AHEAD), dtype=np.float32)
                rows.ahead[place] = self.ahead.take(taken, axis=0)
                rows.num_ahead_used = self.num_ahead_used
                rows.ahead_top = self.ahead_top  # (the joined rows' added at the next step)
        return rows

    def sample(self, logits: torch.Tensor, positions: Callable[[], np.ndarray]) -> list[int]:
        """logits [num_rows, vocab] -> a token a row; positions() gives the rows' output
        positions ([num_rows] int64), called only when a row draws: `sample_batch`'s tokens.
        NonFiniteLogitsError naming the rows whose logits give no token (`_finite_tokens`)."""
        stochastic, m = self.stochastic, len(self.stochastic)
        if not m:
            # (max's indices are argmax's, the first maximum; its values come with them: a
            # NaN is the largest, so a row's value is finite unless the row is not)
            best, tokens = torch.max(logits, dim=-1)
            return _finite_tokens(tokens, best)
        at = positions()
        if m < self.num_rows:
            at = at[stochastic]
        # (the buffer is rewritten only after the last step's tokens were read: a copy from
        # it has ended by then)
        at_top = self.uniforms(at)
        if self.u is not self.u_host:
            self.u.copy_(self.u_host, non_blocking=True)
        try:  # (no cost where nothing raises)
            return self.draw(logits, at_top)
        except NonFiniteLogitsError as refused:
            return self.overflowed(logits, at_top, refused)

    def draw(self, logits: torch.Tensor, at_top: bool) -> list[int]:
        """A step's tokens with this step's uniforms (written by `uniforms`), at_top its
        answer: the groups' draws, the greedy rows' argmax, then `_finite_tokens`."""
        m = len(self.stochastic)
        if m == self.num_rows and len(self.groups) == 1:  # every row draws, in one group
            return _finite_tokens(*self.groups[0].sample(logits, at_top))
        if m == self.num_rows:
            tokens = torch.empty(m, dtype=torch.long, device=logits.device)
            totals = torch.empty(m, dtype=torch.float32, device=logits.device)
            for group in self.groups:
                drawn, weight = group.sample(logits.index_select(0, group.index), at_top)
                tokens.index_copy_(0, group.index, drawn)
                totals.index_copy_(0, group.index, weight)
            return _finite_tokens(tokens, totals)
        best, tokens = torch.max(logits, dim=-1)  # [rows] int64
        drawn = logits.index_select(0, self.stochastic_t)
        if len(self.groups) == 1:
            sampled, totals = self.groups[0].sample(drawn, at_top)
        else:
            sampled = torch.empty(m, dtype=torch.long, device=logits.device)
            totals = torch.empty(m, dtype=torch.float32, device=logits.device)
            for group in self.groups:
                picked, weight = group.sample(drawn.index_select(0, group.index), at_top)
                sampled.index_copy_(0, group.index, picked)
                totals.index_copy_(0, group.index, weight)
        # (the drawing rows' tokens and totals in their rows of the argmax and the maxima)
        tokens.index_copy_(0, self.stochastic_t, sampled)
        return _finite_tokens(tokens, best.index_copy_(0, self.stochastic_t, totals.to(best.dtype)))

    def overflowed(self, logits: torch.Tensor, at_top: bool, refused: NonFiniteLogitsError) -> list[int]:
        """The rows `draw` refused, drawn again from their logits less the row's maximum
        (`shifted_logits`, as sample_token's second try: finite logits whose scores
        overflowed at their temperature), with the same uniforms; the other rows keep
        their tokens. NonFiniteLogitsError (the batch's tokens, -1 at its rows) for the rows
        refused again: a NaN, a +inf, or -inf throughout. A greedy row divides by nothing:
        where only greedy rows were refused, the error stands as it is (and on a device the
        step reads the host once, as any step; a drawing row refused costs a second read)."""
        tokens = list(refused.tokens)
        rows = refused.rows
        if len(self.stochastic) < self.num_rows and not np.isin(rows, self.stochastic).any():
            raise refused
        base = logits.float()
        maxima = base.amax(dim=-1, keepdim=True)  # [rows, 1]
        # every row less its maximum; a row whose maximum is not finite stays refused (its
        # shifted logits are NaN: x - NaN, x - inf, -inf - -inf)
        try:
            again = self.draw(base - maxima, at_top)
        except NonFiniteLogitsError as still:
            again = still.tokens
        for i in rows:
            tokens[i] = again[i]
        bad = [i for i in rows if tokens[i] < 0]
        if bad:
            raise NonFiniteLogitsError(bad, tokens=tokens)
        return tokens

    def uniforms(self, at: np.ndarray) -> bool:
        """The drawing rows' uniforms at positions at ([m] int64) into u_np, in group order:
        `uniform_draw`'s draws rounded to fp32 (IEEE round to nearest, as torch's .float()),
        and whether one of them is 1.0 (~2^-25 of draws: `_sample_group` then takes the last
        index of non-zero weight). Where every row is one position on from the last step,
        from the table of the coming steps' draws (made at the second such step, for AHEAD
        steps); any other step hashes its own and the table goes."""
        nxt, ahead, fresh = self.next_at, self.ahead, self.fresh
        if fresh is not None:  # rows that joined (`edited`): their positions start here
            self.fresh = None
            nxt[fresh] = at[fresh]
        consecutive = nxt is not None and bool((at == nxt).all())
        self.next_at = at + 1
        if not consecutive:  # a first step, or positions that moved otherwise: this step alone
            self.ahead = None
            draws = draws_at(self.mixed, at)  # [m] float64: uniform_draw's draws, bit for bit
            u = self.u_np
            u[:, 0] = draws if self.order is None else draws[self.order]
            return bool(u.max() >= 1.0)
        j = self.num_ahead_used
        if ahead is None or j == AHEAD:
            # the steps at at, at + 1, ..., at + AHEAD - 1: [m, AHEAD] draws in one pass
            steps = at[:, None] + np.arange(AHEAD, dtype=np.int64)
            draws = draws_at(np.broadcast_to(self.mixed[:, None], steps.shape), steps)
            ahead = self.ahead = (draws if self.order is None else draws[self.order]).astype(np.float32)
            self.ahead_top = (ahead >= 1.0).any(axis=0).tolist()
            j = 0
        elif fresh is not None:  # a table kept through an edit: the joined rows' rows, from here
            if len(fresh):
                steps = at[fresh][:, None] + np.arange(AHEAD - j, dtype=np.int64)  # [f, AHEAD - j]
                ahead[fresh, j:] = draws_at(np.broadcast_to(self.mixed[fresh][:, None], steps.shape), steps)
            # the coming steps' 1.0s: where the kept rows had none (the rule: ~2^-25 a draw), the
            # joined rows' alone; else every row's again (a row that left may have held it)
            if any(self.ahead_top[j:]):
                self.ahead_top = (ahead >= 1.0).any(axis=0).tolist()
            elif len(fresh):
                self.ahead_top = (ahead[fresh] >= 1.0).any(axis=0).tolist()
        self.u_np[:, 0] = ahead[:, j]
        self.num_ahead_used = j + 1
        return self.ahead_top[j]


class _Group:
    """Drawing rows of one top-k and top-p kind: their index among the drawing rows (None:
    all of them) and their fp32 columns [g, 1] on the device: temperature, top_p, and the
    uniform (a view of the batch's buffer, written per step)."""

    __slots__ = ("k", "nucleus", "index", "temperature", "top_p", "u", "min_p")

    def __init__(
        self,
        k: int,
        nucleus: bool,
        index: torch.Tensor | None,
        temperature: torch.Tensor,
        top_p: torch.Tensor,
        u: torch.Tensor,
        min_p: torch.Tensor | None = None,
    ) -> None:
        self.k, self.nucleus, self.index = k, nucleus, index
        self.temperature, self.top_p, self.u = temperature, top_p, u
        self.min_p = min_p  # [g, 1] fp32, where the group's rows filter by min-p; None: they do not

    def sample(self, logits: torch.Tensor, at_top: bool) -> tuple[torch.Tensor, torch.Tensor]:
        return _sample_group(logits, self.temperature, self.top_p, self.u, self.k, self.nucleus, at_top, self.min_p)


# rows(which): the params, sample indices and origins of a step's rows `which` (None: every
# row), in that order (the engine's closure over its step's sequences)
RowsOf = Callable[[Sequence[int] | None], tuple[Sequence[SamplingParams], Sequence[int], Sequence[int]]]


class StepSampler(Protocol):
    """What an engine's batched steps sample with (Engine's `step_sampler`): `BatchSampler`,
    over the logits' rows in tensors, or a runner's own where its logits hold nothing to
    sample (the simulator's sim/executor.py `AnswerSampler`, whose rows name streams)."""

    def sample(
        self,
        logits: Any,
        owners: Sequence[object],
        rows: RowsOf,
        lengths: Callable[[], Iterable[int]],
    ) -> list[int]:
        """A step's rows (`BatchSampler.sample`'s contract): a token for each. rows(which)
        may ask for some rows only (BatchSampler asks for all, with rows())."""
        ...

    def sample_rows(
        self, logits: Any, params: Sequence[SamplingParams], sample_indices: Sequence[int], positions: Sequence[int]
    ) -> list[int]:
        """Rows outside a step's batch (a forked sample's first token): `sample_batch`'s
        contract, keeping nothing."""
        ...


class BatchSampler:
    """`sample_batch` for an engine's steps, keeping what a batch's parameters alone
    determine (`_BatchRows`: which rows draw, their groups and fp32 parameter columns, their seeds' hash
    words; each row's origin, from which its output positions count) from one step to the
    next while the step samples the same rows in the same order (a decode step of the same
    requests), the way vLLM's persistent batch keeps its requests' sampling parameters in
    arrays by row. A step of other rows (one joined, left or moved) builds them again, but
    where the last batch was greedy throughout: then only the rows that joined it are read
    (rows(joined)), and greedy too, the batch is greedy throughout as it stands (a greedy
    batch keeps nothing per row); and where it drew throughout in one group: then only the
    joined rows are read too, and drawing in that group, the kept rows' columns and table
    of coming draws are moved with them (`_BatchRows.edited`; a joined row of another kind
    reads the batch whole after all). `incremental` False reads every row: the twin. Its
    tokens are `sample_batch`'s, bit for bit (tests/test_sampling_batch.py): the same
    columns, the same draws, the same tensor ops."""

    def __init__(self) -> None:
        self._owners: list[object] = []  # the last batch's rows' owners, compared by identity
        self._rows: _BatchRows | None = None
        # [rows]: where each row's output begins (None: not read, in a greedy batch nothing draws)
        self._origins: np.ndarray | None = np.empty(0, dtype=np.int64)
        self._greedy = False  # whether the last batch is greedy throughout
        # the last batch's owners' one kind where it compares by identity (`_identity_kind`), else None
        self._kind: type | None = None
        self.incremental = True
        self.num_edited = 0  # batches of drawing rows edited in place (`_BatchRows.edited`), not built anew

    def sample(
        self,
        logits: torch.Tensor,
        owners: Sequence[object],
        rows: RowsOf,
        lengths: Callable[[], Iterable[int]],
    ) -> list[int]:
        """logits [rows, vocab] -> a token a row. owners[i]: the object that row i samples
        for (the engine's sequence: the same object for as long as it runs, its parameters
        fixed); rows(which): the params, sample index and origin (the length at which its
        output begins, fixed: the engine's prompt length) of rows `which` (None: every row),
        called only when the owners differ from the last call's (`which`: the rows that
        joined a greedy batch); lengths(): every row's length now, called only when a row
        draws. Row i draws at output position lengths()[i] - origin[i]."""
        n = logits.shape[0]
        if len(owners) != n:
            raise ValueError(f"BatchSampler: {n} logit rows but {len(owners)} owners")
        if n == 0:
            return []
        last = self._owners
        if self._rows is None or len(last) != n or not all(map(operator.is_, owners, last)):
            self._take(owners, rows, logits)
        origins = self._origins
        return self._rows.sample(logits, lambda: np.fromiter(lengths(), np.int64, n) - origins)

    def _take(self, owners: Sequence[object], rows: RowsOf, logits: torch.Tensor) -> None:
        """The batch of `owners` kept: after a greedy batch, the params of the owners that
        joined it read, and where they are greedy too the batch is (nothing else read);
        after a batch that draws throughout in one group, the joined owners' params read
        and, where they draw in that group too, the kept rows moved (`_BatchRows.edited`);
        else every row's parameters read and the batch's rows built (`_BatchRows.of`).
        Both edits need owners of one kind that compares by identity (`_identity_kind`):
        the last batch's were, and every new owner must be of that kind too (checked before
        `_match`, whose list compares would call another type's __eq__)."""
        n = len(owners)
        kind, last_rows = self._kind, self._rows
        # (a batch that draws throughout, in one group: what `_BatchRows.edited` moves)
        editable = (
            last_rows is not None and len(last_rows.groups) == 1 and len(last_rows.stochastic) == last_rows.num_rows
        )
        matched = None
        # `_match` tests runs by comparing list slices, which calls an owner's own __eq__
        # where it is not the row it faces: every owner must be of the kept identity kind
        # (a joined owner of another type that says == would be taken for a left row), so
        # the types are checked first, in C (a count of a list of pointers)
        if (
            self.incremental
            and kind is not None
            and (self._greedy or editable)
            and list(map(type, owners)).count(kind) == n
        ):
            matched = _match(owners, self._owners)
        if matched is not None and self._greedy:
            joined = matched.joined
            params = rows(joined)[0] if joined else ()
            if len(params) != len(joined):
                raise ValueError(f"BatchSampler: {len(joined)} rows joined but rows() gave {len(params)} params")
            # (`_BatchRows.of`'s test of a row that draws, negated for each)
            if not any(map(GREEDY_TEMPERATURE.__le__, map(_TEMPERATURE, params))):
                if last_rows is None or last_rows.num_rows != n:  # (a greedy batch's rows hold only their count)
                    self._rows = _BatchRows(n, _NO_ROWS)
                self._origins = None  # (read only where a row draws)
                self._owners = list(owners)
                return
        if matched is not None and editable:
            # a batch that draws throughout, in one group: each new row's row in it (`_match`),
            # the joined rows' params read, and the kept rows moved (`_BatchRows.edited`),
            # the table of coming draws with them
            joined = matched.joined
            if len(joined) < n:  # (some row kept: else nothing to move)
                params, sample_indices, origins = rows(joined) if joined else ((), (), ())
                if not len(params) == len(sample_indices) == len(origins) == len(joined):
                    raise ValueError(
                        f"BatchSampler: {len(joined)} rows joined but rows() gave {len(params)} params, "
                        f"{len(sample_indices)} sample indices, {len(origins)} origins"
                    )
                src = matched.src(n)
                edited = last_rows.edited(src, joined, params, sample_indices, logits.shape[-1], logits.device)
                if edited is not None:
                    kept_origins = self._origins.take(src)  # (the joined rows' entries, -1's, set next)
                    kept_origins[joined] = origins
                    self._rows, self._origins, self._owners = edited, kept_origins, list(owners)
                    self.num_edited += 1
                    return
        params, sample_indices, origins = rows()
        if not len(params) == len(sample_indices) == len(origins) == n:
            raise ValueError(
                f"BatchSampler: {n} logit rows but {len(params)} params, {len(sample_indices)} sample "
                f"indices, {len(origins)} origins"
            )
        self._rows = _BatchRows.of(params, sample_indices, logits.shape[-1], logits.device)
        self._origins = np.fromiter(origins, np.int64, n)
        self._owners = list(owners)  # (held: an owner's id is never another's while it is here)
        self._greedy = not len(self._rows.stochastic)
        self._kind = _identity_kind(self._owners)

    def sample_rows(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        sample_indices: Sequence[int],
        positions: Sequence[int],
    ) -> list[int]:
        """`sample_batch` itself: the kept batch is left as it is."""
        return sample_batch(logits, params, sample_indices, positions)


def _identity_kind(owners: Sequence[object]) -> type | None:
    """The one type of the owners where it compares and hashes as `object` does (the
    engine's sequences: dataclasses with eq=False), so that an owner is its object, never
    another equal one (str and int ids are not: an interned 2 would be every request 2);
    None for any other owners: a changed batch of them is read whole."""
    kinds = set(map(type, owners))
    if len(kinds) != 1:
        return None
    (kind,) = kinds
    return kind if kind.__eq__ is object.__eq__ and kind.__hash__ is object.__hash__ else None


class _Matched(NamedTuple):
    """A batch matched to the last one by identity (`_match`): joined [j] the rows whose
    owner was not in the last batch, increasing; runs (i, j, k): rows [i, i + k) are the last
    batch's rows [j, j + k) (a moved row a run of its own); the other rows of the last
    batch left."""

    joined: list[int]
    runs: list[tuple[int, int, int]]

    def src(self, n: int) -> np.ndarray:
        """[n] int64: each row's row in the last batch, -1 for a joined row."""
        src = np.full(n, -1, dtype=np.int64)
        for i, j, k in self.runs:
            if k == 1:
                src[i] = j
            else:
                src[i : i + k] = np.arange(j, j + k)
        return src


def _match(owners: Sequence[object], last: Sequence[object]) -> _Matched:
    """owners against the last batch's, by identity (`is`: every owner, joined ones too, of the
    last batch's identity kind, `_identity_kind`: the caller checks, since a run is
    tested by a list compare, which calls the __eq__ of an owner of another type). The
    engine's changed batch is the last one less the rows that left, in its order, then
    the joined rows: matched in order, a run at a time (a C-level pass a run), an owner
    that is not the last batch's next row looked for further on (a C-level scan: the
    rows between left). Past MAX_MISMATCHES (a batch reordered), and for the rows the
    walk could not place (a joined row, or one moved back), by a dict of the ids of the
    last batch's rows it passed by (the last batch's owners are held: an id is theirs
    alone)."""
    n, m = len(owners), len(last)
    # (lists: a run is tested by comparing two slices, below)
    owners = owners if type(owners) is list else list(owners)
    last = last if type(last) is list else list(last)
    runs: list[tuple[int, int, int]] = []
    unplaced: list[int] = []  # rows the walk did not match in order
    skipped: list[int] = []  # last rows the walk passed by (left, or moved)
    i = j = mismatches = 0
    while i < n and j < m:
        # the run from (i, j), up to the first row that is not the same object: where it
        # reaches the end of either batch (the common step's last run) one comparison of the
        # two slices (an identity kind's == is `is`, and a list's == tests identity first: a
        # pointer compare a row in C; at 128 rows `python -m timeit -s "import operator; o =
        # [object() for _ in range(128)]; p = list(o)" "o == p"` 0.19 us, "all(map(operator.is_,
        # o, p))" 3.2 us; 2026-12-06, 2 shared Xeon cores, load ~10), else the pass that
        # finds where it ends
        k = 0
        if owners[i] is last[j]:
            k = min(n - i, m - j)
            if owners[i : i + k] != last[j : j + k]:
                k = next(compress(count(), map(operator.is_not, islice(owners, i, None), islice(last, j, None))))
        if k:
            runs.append((i, j, k))
            i, j = i + k, j + k
            continue
        mismatches += 1
        if mismatches > MAX_MISMATCHES:
            break
        owner = owners[i]
        ahead = next(compress(count(j + 1), map(operator.is_, repeat(owner), islice(last, j + 1, None))), None)
        if ahead is None:  # joined, or moved back: placed below
            unplaced.append(i)
            i += 1
        else:  # the last rows [j, ahead) left (or moved on)
            skipped.extend(range(j, ahead))
            j = ahead
    unplaced.extend(range(i, n))
    if not unplaced:
        return _Matched([], runs)
    skipped.extend(range(j, m))
    # the unplaced rows among the skipped ones (a row that moved), by id
    where = {id(last[j]): j for j in skipped} if skipped else {}
    joined = []
    for i in unplaced:
        j = where.get(id(owners[i]))
        if j is None:
            joined.append(i)
        else:
            runs.append((i, j, 1))
    return _Matched(joined, runs)


def _to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A small host tensor on `device`, its copy queued, not waited for: through pinned
    memory on CUDA (a copy out of pageable memory first waits for the stream, here for the
    step's forward: a second synchronisation before the tokens' own). On the CPU itself
    (`.to` of the CPU is a dispatch to return it: `python -m timeit -s "import torch; t =
    torch.zeros(16); d = torch.device('cpu')" "t.to(d)"` 0.57 us; 2026-12-06, 2 shared
    Xeon cores, load ~10)."""
    if device.type == "cpu":
        return host
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def _column_views(columns: np.ndarray, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """columns [n, 2] fp32 (temperature, top_p) -> their [n, 1] columns on `device`: on the
    CPU tensors over numpy's views (`python -m timeit -s "import numpy as np, torch; c =
    np.zeros((128, 2), dtype=np.float32); t = torch.from_numpy(c)" "torch.from_numpy(c[:,
    0:1])"` 1.5 us, a tensor's column slice "t[:, 0:1]" 3.2 us; 2026-12-06, 2 shared
    Xeon cores, load ~10), else the device copy's column slices (one copy)."""
    if device.type == "cpu":
        return torch.from_numpy(columns[:, 0:1]), torch.from_numpy(columns[:, 1:2])
    on_device = _to_device(torch.from_numpy(columns), device)
    return on_device[:, 0:1], on_device[:, 1:2]


def _sample_group(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_p: torch.Tensor,
    u: torch.Tensor,
    k: int,
    nucleus: bool,
    at_top: bool,
    min_p: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of one kind: logits [g, vocab], their fp32 columns [g, 1] each (temperature,
    top_p >= TOP_P_MIN, u in [0, 1]), every row's top-k k (vocab: off) and top-p on or off
    (nucleus) -> ([g] int64 token ids, [g] fp32 each row's total weight: NaN where its
    softmax is, `_finite_tokens`), through `sample_token`'s arithmetic (the module
    docstring). at_top: whether some u is 1.0 (False where none is: one op, not four).
    min_p: the rows' fp32 min-p column [g, 1] (`min_p_filtered`, before top-k), or None."""
    vocab = logits.shape[-1]
    scores = logits.float() / temperature  # [g, vocab]
    if min_p is not None:
        scores = min_p_filtered(scores, min_p)
    ids: torch.Tensor | None = None  # [g, candidates]: their token ids, most likely first
    if k < vocab:
        top = torch.topk(scores, k, dim=-1)
        probs, ids = torch.softmax(top.values, dim=-1), top.indices
    else:
        probs = torch.softmax(scores, dim=-1)
    if nucleus:
        if ids is None:
            probs, ids = torch.sort(probs, dim=-1, descending=True)
        # drop a token when the tokens before it already reach top_p. The first always stays
        # without a write of its own: its tokens before weigh exactly 0 (cumsum's first entry
        # is the entry itself), below any top_p (>= TOP_P_MIN, `_BatchRows.of`); a later
        # token's weigh at least the first's (>= 1 / width, far above TOP_P_MIN), so it is
        # dropped exactly where a top_p rounded to 0 dropped it; NaN is never >= anything.
        # (in place: probs and the sums are this call's own tensors)
        before = torch.cumsum(probs, dim=-1).sub_(probs)
        probs.masked_fill_(before >= top_p, 0.0)
    # inverse CDF: the first index whose cumulative weight exceeds u * total; when u * total
    # rounds up to the total, the last index of non-zero weight (a zero weight is never drawn)
    cdf = torch.cumsum(probs, dim=-1)  # [g, width] fp32
    j = torch.searchsorted(cdf, u * cdf[:, -1:], right=True)  # [g, 1]
    if at_top:
        # the last index of non-zero weight: where the count of non-zero weights so far first
        # reaches its total (argmax takes the first of equal maxima). `!= 0`, not `> 0`: a NaN
        # weight (a row of all -inf logits, a +inf, a NaN) counts, as torch.nonzero counts it
        # in `_draw`, so a row without finite weights takes sample_token's last index, not 0
        j = torch.minimum(j, torch.argmax(torch.cumsum(probs != 0, dim=-1), dim=-1, keepdim=True))
    else:
        # The same index where no u is 1.0. A row's softmax is either finite (its maximum
        # exp(0) = 1 in the sum) or NaN throughout (an inf or NaN logit, or every logit -inf,
        # makes the maximum or the sum NaN). Finite: u < 1 in fp32 is at most 1 - 2^-24, so
        # u * total rounds below the total (the product lies at least half an ulp below it,
        # exactly representable where the total is a power of two): j < width, a token of
        # non-zero weight (cdf[j] > cdf[j - 1]), at most the last. NaN: every weight
        # counts, the last index is width - 1, and searchsorted may give width
        j = j.clamp_(max=cdf.shape[-1] - 1)
    # (each op here is a kernel launch on a GPU: views and no extra copies keep them few)
    return (j if ids is None else ids.gather(-1, j)).view(-1), cdf[:, -1]


def _finite_tokens(tokens: torch.Tensor, values: torch.Tensor) -> list[int]:
    """tokens [rows] int64 -> their list (the step's one host synchronisation), where every
    row's value (values [rows]: its maximum logit, or its softmax's total weight) is finite;
    else NonFiniteLogitsError naming the rows whose value is not: their logits hold a NaN or
    +inf or are -inf throughout, and a token drawn there is garbage. On a GPU the check rides
    in the one read (such a row's token read as -1: two kernels, no second wait); on the
    CPU the values are read too (host memory, no wait) and summed in Python's doubles, which
    a row's NaN or inf makes non-finite, cheaper than the two ops here (docs/engine.md gives
    the step's measured cost, `kvpool bench gpu --parts host`).
    The error carries the batch's tokens (`tokens`, -1 at the rows refused): the other rows'
    tokens stand, and a step may go on with them."""
    if tokens.device.type == "cpu":
        out = tokens.tolist()
        listed = values.tolist()
        if math.isfinite(sum(listed)):
            return out
        bad = [i for i, value in enumerate(listed) if not math.isfinite(value)]
        if not bad:  # (fp64 values whose sum overflowed, each finite)
            return out
        for i in bad:
            out[i] = -1
    else:
        out = torch.where(torch.isfinite(values), tokens, -1).tolist()
        if not out or min(out) >= 0:
            return out
        bad = [i for i, token in enumerate(out) if token < 0]
    raise NonFiniteLogitsError(bad, tokens=out)
