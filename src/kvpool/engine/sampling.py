"""Sampling parameters and the samplers: greedy, or temperature / top-k / top-p with a seed.

A draw's randomness is one uniform, `uniform_draw(seed, sample index, output position)`: a
counter-based hash, no generator state, so a token depends only on the logits and where
it sits: a request preempted and recomputed, or batched with different neighbours,
samples exactly the same tokens.

Two samplers with the same results: `sample_token` here (one row at a time, on the CPU)
and `sample_batch` (batch_sampler.py: every row of a step at once, in tensors on the
logits' device, one host synchronisation for the step's tokens). Both take the same uniform and the same
arithmetic: the temperature divides the fp32 logits; min-p, where asked, sets the scores
whose probability falls below min_p times the largest to -inf (`min_p_filtered`); top-k keeps `topk(scores, k)` and
takes the softmax of those; top-p takes the softmax over the whole vocabulary (in
vocabulary order), then the candidates by decreasing probability; the draw is the first
candidate whose cumulative weight exceeds u * total. So on the same logits they give the
same token, except where two candidates tie exactly in probability (topk and sort may
order tied values differently) and, on a GPU, where its sums round otherwise.
`sample_token` looks for a top-p nucleus among the NUCLEUS_CANDIDATES most likely tokens
first (exact: the same candidates, sums and draw as the full sort's, the rest weighing
nothing), which costs it a synchronisation `sample_batch` does not make.

The penalties, logit_bias and min_tokens change a request's logits before either sampler
(`processed_logits`, which the engine applies to its rows): the samplers see them as logits.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

# Temperatures below this sample greedily (vLLM's threshold). Logits of 20 overflow fp32 once
# divided by the temperature only far below it (under ~6e-38; 1e-300 rounds to 0 in fp32);
# larger finite logits do above it (1e38 at 0.01), and a row whose scores overflowed is
# sampled again from its logits less their maximum (`shifted_logits`), not refused.
GREEDY_TEMPERATURE = 1e-5
# A seed is a signed 64-bit integer, as in OpenAI's API and vLLM; the generator sees it mod 2^64.
SEED_MIN, SEED_MAX = -(1 << 63), (1 << 63) - 1
# More samples of one prompt than this are refused: vLLM's bound (the default of its
# VLLM_MAX_N_SEQUENCES), so what runs there runs here. Time grows linearly in n (n = 1,000 of
# 2 tokens on SmolLM2: ~6 s of CPU), but no one means n = 10**6 (minutes to hours, and a
# sequence's token list each); kvpool serve takes at most 16 (server/protocol.py MAX_N).
MAX_N = 16384
# Stop strings: a streamed response holds back len(longest) - 1 characters while one may be
# forming, and each token's stop check decodes the last 4 * len(longest) + 2 tokens. One of
# 100 KB held every character back to the end and decoded the whole output each token; 256
# characters hold back at most ~60 tokens of English text. OpenAI takes 4 stop strings (and
# kvpool serve too); the library takes more, for scripts that list many delimiters.
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256


def integer(name: str, value: object) -> int:
    """value as an int, any integral number taken (numpy's too); TypeError naming `name`
    for anything else, a bool included (True is 1 to Python, not to a user)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an integer, got {value!r} ({type(value).__name__})")
    return int(value)


class NonFiniteLogitsError(ValueError):
    """A row of the model's logits holds a NaN or +inf, or nothing but -inf: no token can be
    sampled from it (argmax takes the NaN's index, a softmax is NaN throughout), so a token
    drawn there is garbage; SmolLM2's all-NaN rows gave token 0, its end of text: an empty
    answer without a word. The cause is the model's (a non-finite weight, or a forward that
    overflowed its dtype), not the request's. `rows`: the step's rows it holds (indices of
    the logits' rows); `request_ids`: their requests, where the engine named them; `position`:
    the first one's output position; `tokens`: where a batch sampler refused rows, the batch's
    tokens (a row refused holds -1), so that a step may go on with the other rows."""

    def __init__(
        self,
        rows: Sequence[int],
        request_ids: Sequence[str] = (),
        position: int | None = None,
        tokens: list[int] | None = None,
    ) -> None:
        self.rows, self.request_ids, self.position, self.tokens = list(rows), list(request_ids), position, tokens
        if self.request_ids:
            where = f"request {self.request_ids[0]!r}"
        else:
            where = f"rows {self.rows}" if len(self.rows) != 1 else f"row {self.rows[0]}"
        if position is not None:
            where += f" at output position {position}"
        more = len(self.request_ids) - 1
        if more > 0:
            where += f" (and {more} more in the step)"
        super().__init__(
            f"the model's logits for {where} are not finite (a NaN or +inf, or every one -inf): no token can "
            "be sampled; a weight of the model is not finite, or its forward overflowed its dtype"
        )


def checked_seed(value: object) -> int:
    """An engine's seed (`Engine.reseed`, `LLM(seed=)`): an integer in a request seed's range."""
    seed = integer("seed", value)
    if not SEED_MIN <= seed <= SEED_MAX:
        raise ValueError(f"seed must be a 64-bit signed integer, got {seed}")
    return seed


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 64
    temperature: float = 0.0  # below GREEDY_TEMPERATURE (0 included): greedy
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    # None: the engine gives the request its next seed (`Engine.seed_for`: a stream of its own,
    # reproducible from the engine's seed); an int: the same tokens wherever it runs
    seed: int | None = None
    n: int = 1  # parallel samples; they share the prompt's blocks (fork + copy-on-write)
    stop: tuple[str, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    # None: no log-probabilities; k >= 0: the sampled token's and the k most likely tokens'
    logprobs: int | None = None
    # token ids that end the sample besides the model's EOS ids (with finish reason "stop",
    # the token kept in the ids, not in the text, as an EOS); ignore_eos leaves them on, as vLLM
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    # Penalties and biases on the logits before sampling (greedy too), in vLLM's order:
    # logit_bias added, then the repetition penalty (over the prompt's and the output's tokens:
    # a logit > 0 divided by it, else multiplied), then the frequency penalty (times each
    # token's count in the output so far) and the presence penalty (once for a token the
    # output holds) subtracted (`processed_logits`). Log-probabilities are the raw model's.
    presence_penalty: float = 0.0  # in [-2, 2], as OpenAI's
    frequency_penalty: float = 0.0  # in [-2, 2], as OpenAI's
    repetition_penalty: float = 1.0  # > 0; 1: off
    # token id -> a bias in [-100, 100] added to its logit (OpenAI's); a mapping given is kept
    # as (id, bias) pairs in increasing id order (hashable, as a frozen field)
    logit_bias: tuple[tuple[int, float], ...] = field(default_factory=tuple)
    # in [0, 1]: a drawing row keeps the tokens whose probability after the temperature is at
    # least min_p times the most likely token's (before top-k and top-p, as vLLM); 0: off.
    # Greedy rows take the argmax, which it keeps
    min_p: float = 0.0
    # No EOS, stop_token_ids id or stop string ends the sample before this many output
    # tokens (at most max_tokens), as vLLM: the stop ids' logits are -inf until then
    # (`processed_logits`), and a stop string counts only where it ends after the text of
    # the first min_tokens tokens (Engine._stop_reason)
    min_tokens: int = 0

    def __post_init__(self) -> None:
        self._check_types()
        if self.max_tokens <= 0:
            raise ValueError(f"max_tokens must be > 0, got {self.max_tokens}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:  # NaN fails both comparisons
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if self.seed is not None and not SEED_MIN <= self.seed <= SEED_MAX:
            raise ValueError(f"seed must be a 64-bit signed integer, got {self.seed}")
        if not 1 <= self.n <= MAX_N:
            raise ValueError(
                f"n must be >= 1, got {self.n}" if self.n < 1 else f"n must be at most {MAX_N}, got {self.n}"
            )
        if isinstance(self.stop, str):
            # one stop string, as vLLM and OpenAI's API take it: iterated as it is, "User:" would
            # stop at its first "U", "s", ... of the output
            object.__setattr__(self, "stop", (self.stop,))
        elif not isinstance(self.stop, tuple):
            if not isinstance(self.stop, Sequence):
                raise TypeError(f"stop must be a string or a list of strings, got {type(self.stop).__name__}")
            object.__setattr__(self, "stop", tuple(self.stop))  # a list: kept hashable, as a frozen field
        for s in self.stop:
            if not isinstance(s, str):
                raise TypeError(f"stop strings must be strings, got {s!r} ({type(s).__name__})")
        if self.stop:
            if any(not s for s in self.stop):
                raise ValueError("stop strings must be non-empty")
            if len(self.stop) > MAX_STOP_STRINGS:
                raise ValueError(f"stop: at most {MAX_STOP_STRINGS} stop strings, got {len(self.stop)}")
            longest = max(len(s) for s in self.stop)
            if longest > MAX_STOP_CHARS:
                raise ValueError(f"stop: a stop string of {longest} characters; at most {MAX_STOP_CHARS} are taken")
        if self.logprobs is not None and self.logprobs < 0:
            raise ValueError(f"logprobs must be >= 0, got {self.logprobs}")
        self._check_stop_token_ids()
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:  # NaN fails both
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not 0 < self.repetition_penalty < math.inf:
            raise ValueError(f"repetition_penalty must be a finite number > 0, got {self.repetition_penalty}")
        self._check_logit_bias()
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(
                f"min_tokens must be >= 0, got {self.min_tokens}"
                if self.min_tokens < 0
                else f"min_tokens must be at most max_tokens ({self.max_tokens}), got {self.min_tokens}"
            )

    def _check_logit_bias(self) -> None:
        """logit_bias as (id, bias) pairs, ids >= 0 increasing, biases floats in [-100, 100]:
        a mapping (OpenAI's dict; an id given as a decimal string, as JSON keys are, taken) or
        pairs. The engine refuses an id outside its model's vocabulary (`Engine.add_request`)."""
        bias = self.logit_bias
        if isinstance(bias, Mapping):
            items = list(bias.items())
        elif isinstance(bias, Sequence) and not isinstance(bias, str | bytes):
            items = list(bias)
            if not all(isinstance(item, Sequence) and len(item) == 2 for item in items):
                raise TypeError("logit_bias must be a mapping of token id -> bias (or (id, bias) pairs)")
        else:
            raise TypeError(f"logit_bias must be a mapping of token id -> bias, got {type(bias).__name__}")
        pairs: dict[int, float] = {}
        for key, value in items:
            if isinstance(key, str) and key.strip().lstrip("-").isdecimal():
                key = int(key)
            token = integer("logit_bias: a token id", key)
            if token < 0:
                raise ValueError(f"logit_bias: token ids are >= 0, got {token}")
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                raise TypeError(f"logit_bias: the bias of token {token} must be a number, got {value!r}")
            if not -100.0 <= value <= 100.0:
                raise ValueError(f"logit_bias: the bias of token {token} must be in [-100, 100], got {value}")
            if token in pairs:
                raise ValueError(f"logit_bias: token {token} is given twice")
            pairs[token] = float(value)
        object.__setattr__(self, "logit_bias", tuple(sorted(pairs.items())))

    @property
    def transforms_logits(self) -> bool:
        """Whether the logits are changed before sampling (`processed_logits`): a penalty, a
        bias, min_tokens. Such a request takes none of the engine's fast paths."""
        return bool(
            self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
            or self.logit_bias
            or self.min_tokens
        )

    def _check_stop_token_ids(self) -> None:
        """stop_token_ids as a tuple of ints >= 0 (a list taken; kept hashable, as `stop`); the
        engine refuses one outside its model's vocabulary (`Engine.add_request`)."""
        ids = self.stop_token_ids
        if isinstance(ids, str | bytes) or not isinstance(ids, Sequence):
            raise TypeError(f"stop_token_ids must be a list of token ids, got {type(ids).__name__}")
        ids = tuple(integer("stop_token_ids: a token id", i) for i in ids)
        if any(i < 0 for i in ids):
            raise ValueError(f"stop_token_ids: token ids are >= 0, got {min(ids)}")
        object.__setattr__(self, "stop_token_ids", ids)

    def _check_types(self) -> None:
        """TypeError naming the field for a value of the wrong kind, before the range checks
        compare it: max_tokens=2.5 generated 3 tokens, n=2.0 and top_k=1.5 failed deep in the
        engine ("'float' object cannot be interpreted as an integer"), seed="1" in a comparison
        naming no field. An integer field takes any integral number (numpy's too), kept as int;
        a bool is refused where a number is asked for (True is 1 to Python, not to a user)."""
        for name in ("max_tokens", "top_k", "seed", "n", "logprobs", "min_tokens"):
            value = getattr(self, name)
            if type(value) is int or (value is None and name in ("logprobs", "seed")):
                continue
            object.__setattr__(self, name, integer(name, value))
        for name in ("temperature", "top_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "min_p"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                raise TypeError(f"{name} must be a number, got {value!r} ({type(value).__name__})")
            if type(value) is not float:  # kept as a float: a Fraction failed in torch ("unsupported operand")
                object.__setattr__(self, name, float(value))
        if not isinstance(self.ignore_eos, bool):
            raise TypeError(f"ignore_eos must be True or False, got {self.ignore_eos!r}")

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
        best = torch.argmax(logits)  # no scratch beyond a scalar
        # argmax takes a NaN as the largest: the logit taken is finite unless the row holds a
        # NaN or +inf, or is -inf throughout (NonFiniteLogitsError); read with the token as -1,
        # one host read (as the batched sampler's `_finite_tokens`)
        token = int(torch.where(torch.isfinite(logits[best]), best, -1))
        if token < 0:
            raise NonFiniteLogitsError([0], position=position)
        return token
    if params.seed is None:  # (the engine seeds every request it takes: `Engine.seed_for`)
        raise ValueError("sample_token draws from params.seed: give SamplingParams a seed")
    token = _sample_scores(logits, params, sample_index, position)
    if token is None:
        # one second try, from the logits less their maximum (scores that overflowed at the
        # temperature). Its largest score is 0, so it should not overflow again; should it
        # give no token all the same, the row is refused, never tried a third time (the bound
        # is this one call, not only the arithmetic's argument)
        shifted = shifted_logits(logits.float().cpu())
        token = None if shifted is None else _sample_scores(shifted, params, sample_index, position)
        if token is None:
            raise NonFiniteLogitsError([0], position=position)
    return token


def _sample_scores(logits: torch.Tensor, params: SamplingParams, sample_index: int, position: int) -> int | None:
    """`sample_token`'s draw from logits [vocab] (params drawing, seeded), or None where the
    softmax is not finite: a NaN or +inf logit, all of them -inf, or scores past fp32's range."""
    # divided by the fp32 temperature as sample_batch divides its rows (same rounding)
    scores = logits.float().cpu() / params.temperature
    if params.min_p > 0.0:  # (in fp32, as sample_batch's column: the same bits)
        scores = min_p_filtered(scores, torch.tensor(params.min_p, dtype=torch.float32))
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
    # a softmax is finite or NaN throughout (a NaN or +inf logit, or all of them -inf, or
    # scores past fp32's range): the weight drawn says which (topk keeps a NaN among the largest)
    if not math.isfinite(probs[j]):
        return None
    return int(ids[j]) if ids is not None else j


def min_p_filtered(scores: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """scores [..., vocab] fp32 (the logits over the temperature) with the tokens whose
    probability is below min_p times the row's largest set to -inf (min_p: an fp32 scalar, or
    a column [rows, 1]): both samplers' min-p, before top-k and top-p (vLLM's order). The
    most likely token always stays (its probability is the largest, min_p <= 1); a row whose
    softmax is NaN masks nothing (NaN compares False) and is refused after, as without it."""
    probs = torch.softmax(scores, dim=-1)
    return scores.masked_fill(probs < min_p * probs.amax(dim=-1, keepdim=True), -math.inf)


def shifted_logits(logits: torch.Tensor) -> torch.Tensor | None:
    """fp32 logits [..., vocab] less each row's maximum, where every row's maximum is finite
    (no NaN, no +inf, not -inf throughout); else None: a row gives no token.

    The samplers' second try at a row whose scores overflowed: finite logits past fp32's
    range once divided by the temperature (1e38 at 0.01; 1e34 at GREEDY_TEMPERATURE) made an
    +inf score and a softmax of NaN. The softmax of (x - max) / t is the softmax of x / t,
    and its largest score is 0 (x - max is 0 only at the maxima: a subtraction rounds to 0
    only where the two are equal), so no score overflows; those past fp32's range the other
    way round to -inf, weigh 0 and are never drawn: a tiny temperature gives what its
    limit gives, the maximum (greedy). Only a row refused at first takes it, so the common
    step pays nothing, and a row that overflowed nowhere keeps its tokens bit for bit."""
    top = logits.amax(dim=-1, keepdim=True)
    if not bool(torch.isfinite(top).all()):
        return None
    return logits - top


_MASK64 = (1 << 64) - 1


def derived_seed(base_seed: int, index: int) -> int:
    """The seed of the index-th unseeded request of an engine seeded `base_seed`: two
    SplitMix64 rounds, as a signed 64-bit integer (a request's seed's range). Spread over
    the 2^64 seeds, so it does not repeat the small seeds (0, 1, 2, ...) people give by hand."""
    x = _splitmix64(_splitmix64(base_seed & _MASK64) ^ index)
    return x - (1 << 64) if x >> 63 else x


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


def seed_words(seeds: Sequence[int], sample_indices: Sequence[int]) -> np.ndarray:
    """The first two of `uniform_draw`'s SplitMix64 rounds for a batch, of (seed, sample
    index): [n] uint64, what a row's draws share from step to step (numpy's wrapping uint64:
    a batch's draws in a few calls, not three Python rounds a row). Seeds are signed 64-bit
    (their two's complement words); indices are non-negative and below 2^63."""
    n = len(seeds)
    x = _splitmix64_np(np.fromiter(seeds, np.int64, n).view(np.uint64))
    return _splitmix64_np(x ^ np.fromiter(sample_indices, np.int64, n).view(np.uint64))


def draws_at(words: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """The third round, on the positions ([n] int64, non-negative), and the draws it gives:
    `uniform_draw` of each row, bit for bit (tests/test_sampling_batch.py)."""
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


def processed_logits(
    logits: torch.Tensor,
    params: SamplingParams,
    token_ids: Sequence[int],
    num_prompt_tokens: int,
    stop_ids: Collection[int] = (),
) -> torch.Tensor:
    """The logits [vocab] a request with `transforms_logits` samples from, a new tensor (fp32,
    or the logits' dtype where it is wider; the logits are not written): token_ids the
    sequence's tokens so far, the prompt's first `num_prompt_tokens` of them, then its output;
    stop_ids the ids that would end it (its EOS ids and stop_token_ids: the engine's request's
    `stop_ids`). vLLM's order: while the output holds fewer than min_tokens tokens, the stop
    ids' logits -inf; logit_bias added; the repetition penalty p over every token the prompt or
    the output holds (a logit > 0 divided by p, else multiplied by it: the CTRL rule); then
    the frequency penalty times each token's count in the output, and the presence penalty
    for each token in it, subtracted (two subtractions, frequency first)."""
    out = logits.to(torch.promote_types(logits.dtype, torch.float32), copy=True)
    if stop_ids and len(token_ids) - num_prompt_tokens < params.min_tokens:
        out[torch.tensor(sorted(stop_ids), dtype=torch.long, device=out.device)] = -math.inf
    if params.logit_bias:
        ids, bias = zip(*params.logit_bias, strict=True)
        out[torch.tensor(ids, device=out.device)] += torch.tensor(bias, dtype=out.dtype, device=out.device)
    penalty = params.repetition_penalty
    if penalty != 1.0 and token_ids:
        seen = torch.unique(torch.tensor(token_ids, dtype=torch.long, device=out.device))
        values = out[seen]
        out[seen] = torch.where(values > 0, values / penalty, values * penalty)
    output = token_ids[num_prompt_tokens:]
    if output and (params.frequency_penalty or params.presence_penalty):
        ids, counts = torch.unique(torch.tensor(output, dtype=torch.long, device=out.device), return_counts=True)
        if params.frequency_penalty:
            out[ids] -= params.frequency_penalty * counts.to(out.dtype)
        if params.presence_penalty:
            out[ids] -= params.presence_penalty
    return out


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
