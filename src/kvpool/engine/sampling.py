"""Sampling parameters and the samplers: greedy, or temperature / top-k / top-p with a seed.

A draw's randomness is one uniform, `uniform_draw(seed, sample index, output position)`: a
counter-based hash, no generator state, so a token depends only on the logits and where
it sits: a request preempted and recomputed, or batched with different neighbours,
samples exactly the same tokens.

Two samplers with the same results: `sample_token` (one row at a time, on the CPU) and
`sample_batch` (every row of a step at once, in tensors on the logits' device, one host
synchronisation for the step's tokens). Both take the same uniform and the same
arithmetic: the temperature divides the fp32 logits; top-k keeps `topk(scores, k)` and
takes the softmax of those; top-p takes the softmax over the whole vocabulary (in
vocabulary order), then the candidates by decreasing probability; the draw is the first
candidate whose cumulative weight exceeds u * total. So on the same logits they give the
same token, except where two candidates tie exactly in probability (topk and sort may
order tied values differently) and, on a GPU, where its sums round otherwise.
`sample_token` looks for a top-p nucleus among the NUCLEUS_CANDIDATES most likely tokens
first (exact: the same candidates, sums and draw as the full sort's, the rest weighing
nothing), which costs it a synchronisation `sample_batch` does not make.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

# Temperatures below this sample greedily (vLLM's threshold). The scaled logits overflow fp32
# only far below it (logits of 20 at a temperature under ~6e-38; 1e-300 rounds to 0 in fp32),
# but there the softmax of infs is NaN and the draw garbage.
GREEDY_TEMPERATURE = 1e-5
# A seed is a signed 64-bit integer, as in OpenAI's API and vLLM; the generator sees it mod 2^64.
SEED_MIN, SEED_MAX = -(1 << 63), (1 << 63) - 1


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 64
    temperature: float = 0.0  # below GREEDY_TEMPERATURE (0 included): greedy
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    seed: int = 0
    n: int = 1  # parallel samples; they share the prompt's blocks (fork + copy-on-write)
    stop: tuple[str, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    # None: no log-probabilities; k >= 0: the sampled token's and the k most likely tokens'
    logprobs: int | None = None

    def __post_init__(self) -> None:
        if self.max_tokens <= 0:
            raise ValueError(f"max_tokens must be > 0, got {self.max_tokens}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:  # NaN fails both comparisons
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not SEED_MIN <= self.seed <= SEED_MAX:
            raise ValueError(f"seed must be a 64-bit signed integer, got {self.seed}")
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        if self.logprobs is not None and self.logprobs < 0:
            raise ValueError(f"logprobs must be >= 0, got {self.logprobs}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE


# Top-p looks for the nucleus among this many most likely tokens first; the full sort of
# every logit (an order of magnitude slower over SmolLM2's 49,152: `kvpool bench engine
# --parts glue` times both, docs/engine.md gives the figures) runs only when their mass falls short.
NUCLEUS_CANDIDATES = 256


_scratch_peak = 0  # the most bytes one sample_token call held in its tensors, in this process


def scratch_peak_bytes() -> int:
    """The largest scratch a `sample_token` call of this process made (a process-wide
    maximum, like the peak resident set it is held against)."""
    return _scratch_peak


def _note_scratch(*tensors: torch.Tensor | None, extra: int = 0) -> None:
    global _scratch_peak
    total = extra + sum(t.nbytes for t in tensors if t is not None)
    if total > _scratch_peak:
        _scratch_peak = total


def sample_token(logits: torch.Tensor, params: SamplingParams, sample_index: int, position: int) -> int:
    """logits [vocab] fp32 -> one token id.

    The kept tokens (top-k, then the top-p nucleus: the most likely tokens until their mass
    reaches top_p) are drawn by inverse CDF with `uniform_draw`'s uniform."""
    if params.greedy:
        return int(torch.argmax(logits))  # no scratch beyond a scalar
    # divided by the fp32 temperature as sample_batch divides its rows (same rounding)
    scores = logits.float().cpu() / params.temperature
    vocab = scores.shape[-1]
    k = min(params.top_k, vocab) if params.top_k else vocab
    ids: torch.Tensor | None = None  # candidates' token ids, most likely first; None: all tokens
    full = None  # the full-vocabulary probabilities, while a smaller candidate set is made
    if k < vocab:
        top = torch.topk(scores, k)
        probs, ids = torch.softmax(top.values, dim=-1), top.indices
    else:
        probs = full = torch.softmax(scores, dim=-1)
    cumulative = None
    if params.top_p < 1.0:
        if ids is None and vocab > NUCLEUS_CANDIDATES:
            top = torch.topk(probs, NUCLEUS_CANDIDATES)
            if float(top.values.sum()) >= params.top_p:  # the nucleus lies within them: exact
                probs, ids = top.values, top.indices
        if ids is None:
            probs, ids = torch.sort(probs, descending=True)
        cumulative = torch.cumsum(probs, dim=-1)
        # drop a token when the tokens before it already reach top_p; the first always stays,
        # even for a top_p that fp32 rounds to 0 (a mask of every token would leave nothing)
        dropped = (cumulative - probs) >= params.top_p
        dropped[0] = False
        probs = probs.masked_fill(dropped, 0.0)
    # the tensors alive at the draw, and the draw's CDF: one more vector of the candidates
    _note_scratch(scores, full if full is not probs else None, probs, ids, cumulative, extra=probs.nbytes)
    j = _draw(probs, uniform_draw(params.seed, sample_index, position))
    return int(ids[j]) if ids is not None else j


_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    """One SplitMix64 output for the state x in [0, 2^64): the golden-ratio increment,
    then its finalizer (a bijection of 64-bit words that spreads every input bit)."""
    x = x + 0x9E3779B97F4A7C15 & _MASK64
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9 & _MASK64
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB & _MASK64
    return x ^ (x >> 31)


def _mix64(seed: int, sample_index: int, position: int) -> int:
    """The 64-bit seed, sample index and position mixed one after another, each through a
    SplitMix64 round: the seed is mixed on its own first, so no two (seed, sample index)
    pairs share an input word (xoring the index into the raw seed gave (s, i) the draws of
    (s ^ i, 0): with n > 1, seeds 0, 1, 2, ... repeated each other's samples)."""
    x = _splitmix64(seed & _MASK64)
    x = _splitmix64(x ^ sample_index)
    return _splitmix64(x ^ position)


def uniform_draw(seed: int, sample_index: int, position: int) -> float:
    """Both samplers' uniform in [0, 1) for one draw: the top 53 bits of `_mix64` (a
    counter-based draw: no generator state, so no per-row generator on the device; ~1 us
    on the host, against ~20 us for seeding a torch generator per draw)."""
    return (_mix64(seed, sample_index, position) >> 11) * 2.0**-53


_GOLDEN, _MUL1, _MUL2 = np.uint64(0x9E3779B97F4A7C15), np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def _splitmix64_np(x: np.ndarray) -> np.ndarray:
    """`_splitmix64` of every word of x [n] uint64, in numpy's uint64 arithmetic, which
    wraps modulo 2^64 as `_splitmix64`'s `& _MASK64` does, and shifts logically: the same
    bits."""
    x = x + _GOLDEN
    x = (x ^ (x >> np.uint64(30))) * _MUL1
    x = (x ^ (x >> np.uint64(27))) * _MUL2
    return x ^ (x >> np.uint64(31))


def uniform_draws(seeds: Sequence[int], sample_indices: Sequence[int], positions: Sequence[int]) -> np.ndarray:
    """`uniform_draw` of each (seeds[i], sample_indices[i], positions[i]) at once -> [n]
    float64, bit for bit (tests/test_sampling_batch.py): a batch's draws in a few numpy
    calls instead of three Python SplitMix64 rounds a row (~2 us a row on the host, 0.25 ms
    at batch 128). Seeds are signed 64-bit (their two's complement words are `seed &
    _MASK64`); indices and positions are non-negative and below 2^63."""
    return _draws_at(_seed_words(seeds, sample_indices), np.fromiter(positions, np.int64, len(positions)))


def _seed_words(seeds: Sequence[int], sample_indices: Sequence[int]) -> np.ndarray:
    """`uniform_draws`' first two SplitMix64 rounds, of (seed, sample index): [n] uint64,
    what a row's draws share from step to step."""
    n = len(seeds)
    x = _splitmix64_np(np.fromiter(seeds, np.int64, n).view(np.uint64))
    return _splitmix64_np(x ^ np.fromiter(sample_indices, np.int64, n).view(np.uint64))


def _draws_at(words: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """`uniform_draws`' third round, on the positions ([n] int64), and the draws it gives."""
    x = _splitmix64_np(words ^ positions.view(np.uint64))
    # the top 53 bits, below 2^53: exact in float64, and the power of two scales exactly
    return (x >> np.uint64(11)).astype(np.float64) * 2.0**-53


def _draw(weights: torch.Tensor, u: float) -> int:
    """An index i with probability weights[i] / sum (weights [m] >= 0) for the uniform u:
    the first i whose cumulative weight exceeds u * total (u rounded to the weights'
    dtype, as `sample_batch` rounds it). A zero weight adds no width, so it is never drawn."""
    cdf = torch.cumsum(weights, dim=-1)
    target = cdf[-1] * u  # a Python float meets the tensor in its dtype: u rounded to it
    i = int(torch.searchsorted(cdf, target, right=True))
    if i >= len(cdf):  # u * total rounded up to the total: the last token of non-zero weight
        i = int(torch.nonzero(weights)[-1])
    return i


def token_logprobs(logits: torch.Tensor, token: int, k: int) -> tuple[float, list[tuple[int, float]]]:
    """The log-probability of `token` under the model's distribution (the raw logits, before
    temperature and truncation, as OpenAI and vLLM report it) and the k most likely tokens'
    (id, log-probability), most likely first."""
    logp = torch.log_softmax(logits.double(), dim=-1)
    top: list[tuple[int, float]] = []
    if k:
        values, ids = torch.topk(logp, min(k, logp.shape[-1]))
        top = list(zip(ids.tolist(), values.tolist(), strict=True))
    return float(logp[token]), top


_TEMPERATURE, _TOP_P, _TOP_K, _SEED = map(operator.attrgetter, ("temperature", "top_p", "top_k", "seed"))
_NO_WORDS, _NO_DRAWS = np.empty(0, dtype=np.uint64), np.empty((0, 1), dtype=np.float32)  # (never written)
# The least positive fp32 (a subnormal): sample_batch's least top_p in its fp32 arithmetic.
TOP_P_MIN = 2.0**-149


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
    return rows.sample(logits, positions)


class _BatchRows:
    """What `sample_batch` derives from a batch's parameters alone, made once for a batch of
    rows (`BatchSampler` keeps it while the rows stay), in persistent tensors on the logits'
    device: which rows draw, their groups of one top-k and top-p kind with each group's fp32
    temperature and top_p columns, the draws' seed words (`_mix64`'s first two rounds of
    (seed, sample index), which only the position, its third round, changes from step to
    step) and the buffer a step writes its fp32 uniforms into. A step then costs the draws'
    numpy rounds, one copy of the uniforms (none on the CPU) and the groups' tensor ops."""

    __slots__ = ("num_rows", "stochastic", "stochastic_t", "mixed", "groups", "order", "u_host", "u_np", "u")

    def __init__(self, num_rows: int, stochastic: np.ndarray) -> None:
        self.num_rows = num_rows
        self.stochastic = stochastic  # [m] int64, increasing: the rows that draw
        self.stochastic_t: torch.Tensor | None = None  # the same on the device, when some rows are greedy
        # the rest is set by `of` where some row draws (m > 0)
        self.mixed = _NO_WORDS  # [m] uint64: `_seed_words` of the rows that draw
        self.groups: list[_Group] = []
        self.order: np.ndarray | None = None  # [m]: the drawing rows in group order; None: one group
        self.u_host: torch.Tensor | None = None  # [m, 1] fp32: the uniforms, in group order (pinned on CUDA)
        self.u: torch.Tensor | None = None  # the same on the device (u_host itself on the CPU)
        self.u_np = _NO_DRAWS  # [m, 1] fp32: u_host's memory

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
        rows.mixed = _seed_words(list(map(_SEED, picked)), indices)
        # the per-row parameters in fp32, as the arithmetic reads them (torch's conversion of
        # the fp64 values). A top_p is at least TOP_P_MIN, the least positive fp32: one that
        # fp32 rounds to 0 keeps the first candidate by itself (0 >= top_p would drop it), as
        # sample_token's does
        top_p = np.maximum(np.fromiter(map(_TOP_P, picked), np.float64, m), TOP_P_MIN)
        host_columns = np.empty((m, 2))  # [m, 2] fp64: temperature, top_p
        host_columns[:, 0], host_columns[:, 1] = temperature[stochastic] if m < num_rows else temperature, top_p
        columns = torch.from_numpy(host_columns).float()  # [m, 2] fp32
        k = np.fromiter(map(_TOP_K, picked), np.int64, m)
        k[(k == 0) | (k > vocab)] = vocab  # top-k off (0), or at least the vocabulary: all of it
        nucleus = top_p < 1.0
        # the groups of one (k, top-p on) kind, in their first rows' order
        keys = (k << 1) | nucleus  # [m] int64: one key a kind
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
            rows.groups.append(
                _Group(
                    int(k[member[0]]),
                    bool(nucleus[member[0]]),
                    index,
                    picked_columns[:, 0:1],
                    picked_columns[:, 1:2],
                    rows.u[start : start + g],
                )
            )
            start += g
        return rows

    def sample(self, logits: torch.Tensor, positions: Sequence[int] | Callable[[], Sequence[int]]) -> list[int]:
        """logits [num_rows, vocab] -> a token a row, the rows' output positions given (or
        a callable giving them, called only when a row draws): `sample_batch`'s tokens."""
        stochastic, m = self.stochastic, len(self.stochastic)
        if not m:
            return torch.argmax(logits, dim=-1).tolist()  # the step's one host synchronisation
        at = np.fromiter(positions() if callable(positions) else positions, np.int64, self.num_rows)
        if m < self.num_rows:
            at = at[stochastic]
        draws = _draws_at(self.mixed, at)  # [m] float64: uniform_draws' draws, bit for bit
        # fp32, as the arithmetic reads them (IEEE round to nearest, as torch's .float()).
        # (the buffer is rewritten only after the last step's tokens were read: a copy from
        # it has ended by then)
        self.u_np[:, 0] = draws if self.order is None else draws[self.order]
        if self.u is not self.u_host:
            self.u.copy_(self.u_host, non_blocking=True)
        # a draw whose u rounds to 1.0 in fp32 (~2^-25 a draw) needs the last index of
        # non-zero weight (`_sample_group`)
        at_top = bool(self.u_np.max() >= 1.0)
        if m == self.num_rows and len(self.groups) == 1:  # every row draws, in one group
            return self.groups[0].sample(logits, at_top).tolist()  # the step's one host synchronisation
        if m == self.num_rows:
            out = torch.empty(m, dtype=torch.long, device=logits.device)
            for group in self.groups:
                out.index_copy_(0, group.index, group.sample(logits.index_select(0, group.index), at_top))
            return out.tolist()
        tokens = torch.argmax(logits, dim=-1)  # [rows] int64
        drawn = logits.index_select(0, self.stochastic_t)
        if len(self.groups) == 1:
            sampled = self.groups[0].sample(drawn, at_top)
        else:
            sampled = torch.empty(m, dtype=torch.long, device=logits.device)
            for group in self.groups:
                sampled.index_copy_(0, group.index, group.sample(drawn.index_select(0, group.index), at_top))
        return tokens.index_copy_(0, self.stochastic_t, sampled).tolist()  # the step's one host synchronisation


class _Group:
    """Drawing rows of one top-k and top-p kind: their index among the drawing rows (None:
    all of them) and their fp32 columns [g, 1] on the device: temperature, top_p, and the
    uniform (a view of the batch's buffer, written per step)."""

    __slots__ = ("k", "nucleus", "index", "temperature", "top_p", "u")

    def __init__(
        self,
        k: int,
        nucleus: bool,
        index: torch.Tensor | None,
        temperature: torch.Tensor,
        top_p: torch.Tensor,
        u: torch.Tensor,
    ) -> None:
        self.k, self.nucleus, self.index = k, nucleus, index
        self.temperature, self.top_p, self.u = temperature, top_p, u

    def sample(self, logits: torch.Tensor, at_top: bool) -> torch.Tensor:
        return _sample_group(logits, self.temperature, self.top_p, self.u, self.k, self.nucleus, at_top)


class BatchSampler:
    """`sample_batch` for an engine's steps, keeping what a batch's parameters alone
    determine (`_BatchRows`: which rows draw, their groups and fp32 parameter columns, their seeds' hash
    words) from one step to the next while the step samples the same rows in the same
    order (a decode step of the same requests), the way vLLM's persistent batch keeps its
    requests' sampling parameters in arrays by row. A step of other rows (one joined, left
    or moved) builds them again. Its tokens are `sample_batch`'s, bit for bit
    (tests/test_sampling_batch.py): the same columns, the same draws, the same tensor ops."""

    def __init__(self) -> None:
        self._owners: list[object] = []  # the last batch's rows' owners, compared by identity
        self._rows: _BatchRows | None = None

    def sample(
        self,
        logits: torch.Tensor,
        owners: Sequence[object],
        rows: Callable[[], tuple[Sequence[SamplingParams], Sequence[int]]],
        positions: Callable[[], Sequence[int]],
    ) -> list[int]:
        """logits [rows, vocab] -> a token a row. owners[i]: the object that row i samples
        for (the engine's sequence: the same object for as long as it runs, its parameters
        fixed); rows(): every row's params and sample index, called only when the owners
        differ from the last call's; positions(): every row's output position, called only
        when a row draws."""
        n = logits.shape[0]
        if len(owners) != n:
            raise ValueError(f"BatchSampler: {n} logit rows but {len(owners)} owners")
        if n == 0:
            return []
        last = self._owners
        if self._rows is None or len(last) != n or not all(map(operator.is_, owners, last)):
            params, sample_indices = rows()
            if not len(params) == len(sample_indices) == n:
                raise ValueError(
                    f"BatchSampler: {n} logit rows but {len(params)} params, {len(sample_indices)} sample indices"
                )
            self._rows = _BatchRows.of(params, sample_indices, logits.shape[-1], logits.device)
            self._owners = list(owners)  # (held: an owner's id is never another's while it is here)
        return self._rows.sample(logits, positions)


def _to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A small host tensor on `device`, its copy queued, not waited for: through pinned
    memory on CUDA (a copy out of pageable memory first waits for the stream, here for the
    step's forward: a second synchronisation before the tokens' own)."""
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def _sample_group(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_p: torch.Tensor,
    u: torch.Tensor,
    k: int,
    nucleus: bool,
    at_top: bool = True,
) -> torch.Tensor:
    """Rows of one kind: logits [g, vocab], their fp32 columns [g, 1] each (temperature,
    top_p >= TOP_P_MIN, u in [0, 1]), every row's top-k k (vocab: off) and top-p on or off
    (nucleus) -> [g] int64 token ids, through `sample_token`'s arithmetic (the module
    docstring). at_top: whether some u is 1.0 (False where none is: one op, not four)."""
    vocab = logits.shape[-1]
    scores = logits.float() / temperature  # [g, vocab]
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
    return (j if ids is None else ids.gather(-1, j)).view(-1)
