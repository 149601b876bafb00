"""The batched device sampler `sample_batch` against the one-row sampler `sample_token`.

Both draw with the same uniform (`uniform_draw`: a hash of seed, sample index and
position) through the same arithmetic, so on the CPU every row's token is sample_token's,
greedy or not (a mixed batch of temperatures, top-k, top-p and seeds, row by row, and the
engine's tokens either way). The distributions are held to frequency bounds: 5 binomial
standard errors (a correct sampler misses one with probability ~6e-7), which a
distribution off by 0.04 or more at n = 3000 fails. The draws are a fixed function of the
code (no generator state): no test here can flake.
"""

from __future__ import annotations

import math
import random
import statistics
from collections import Counter

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.engine.batch_sampler import (
    AHEAD,
    FEW_JOINED,
    MAX_MISMATCHES,
    BatchSampler,
    _match,
    _sample_group,
    sample_batch,
)
from kvpool.engine.engine import Engine
from kvpool.engine.llama_runner import llama_runner
from kvpool.engine.sampling import (
    GREEDY_TEMPERATURE,
    SEED_MAX,
    SEED_MIN,
    NonFiniteLogitsError,
    SamplingParams,
    _draw,
    _splitmix64,
    draws_at,
    sample_token,
    seed_words,
    uniform_draw,
)
from random_llama import DESCRIPTOR, random_ids, random_llama

N = 3000


def batch_draws(logits: torch.Tensor, params: SamplingParams, n: int = N) -> Counter:
    """n draws of one row at positions 0..n-1, all in one sample_batch call."""
    rows = logits.unsqueeze(0).expand(n, -1)
    return Counter(sample_batch(rows, [params] * n, [0] * n, list(range(n))))


def assert_frequency(counts: Counter, token: int, p: float, n: int = N) -> None:
    assert abs(counts[token] / n - p) <= 5 * math.sqrt(p * (1 - p) / n), (token, counts[token] / n, p)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_greedy_rows_equal_sample_token_even_beside_stochastic_rows(dtype):
    logits = torch.randn(24, 5000, generator=torch.Generator().manual_seed(0)).to(dtype)
    params = [SamplingParams() if i % 3 else SamplingParams(temperature=0.8, top_p=0.9, seed=i) for i in range(24)]
    got = sample_batch(logits, params, list(range(24)), [7] * 24)
    for i, p in enumerate(params):
        if p.greedy:
            assert got[i] == sample_token(logits[i], p, i, 7)
        else:
            assert 0 <= got[i] < 5000


@pytest.mark.parametrize("scale", [1.0, 6.0], ids=["flat", "peaked"])  # peaked: sample_token's nucleus shortcut
def test_every_row_of_a_mixed_batch_is_sample_tokens_token(scale):
    vocab, num_rows = 3000, 96
    logits = scale * torch.randn(num_rows, vocab, generator=torch.Generator().manual_seed(3))
    kinds = [
        {},  # greedy
        {"temperature": 0.8},
        {"temperature": 1.3, "top_k": 40},
        {"temperature": 0.7, "top_p": 0.9},
        {"temperature": 1.0, "top_k": 500, "top_p": 0.5},
        {"temperature": 2.0, "top_k": 1},
        {"temperature": 0.9, "min_p": 0.1},
        {"temperature": 1.0, "top_k": 40, "top_p": 0.8, "min_p": 0.05},
    ]
    seeds = [0, 7, -1, (1 << 63) - 1, -(1 << 63)]
    params = [SamplingParams(seed=seeds[i % 5], **kinds[i % len(kinds)]) for i in range(num_rows)]
    indices, positions = [i % 3 for i in range(num_rows)], [(7 * i) % 41 for i in range(num_rows)]
    got = sample_batch(logits, params, indices, positions)
    want = [sample_token(logits[i], params[i], indices[i], positions[i]) for i in range(num_rows)]
    assert got == want
    # not a constant: the seeds, sample indices and positions move the stochastic rows' tokens
    hot = [p for p in params if not p.greedy and p.top_k != 1]
    assert len({sample_token(logits[0], hot[0], 0, pos) for pos in range(20)}) > 1


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_temperature_sampling_follows_the_softmax(temperature):
    probs = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)
    counts = batch_draws(torch.log(probs).float(), SamplingParams(temperature=temperature, seed=0))
    expected = probs ** (1 / temperature) / (probs ** (1 / temperature)).sum()
    for token, p in enumerate(expected.tolist()):
        assert_frequency(counts, token, p)
    # and sample_token's draws of the same distribution agree with the same bounds
    single = Counter(
        sample_token(torch.log(probs).float(), SamplingParams(temperature=temperature, seed=0), 0, k) for k in range(N)
    )
    for token, p in enumerate(expected.tolist()):
        assert_frequency(single, token, p)


def test_top_k_keeps_the_k_most_likely_renormalised():
    logits = torch.log(torch.tensor([0.4, 0.05, 0.3, 0.05, 0.2]))
    counts = batch_draws(logits, SamplingParams(temperature=1.0, top_k=2, seed=0))
    assert set(counts) == {0, 2}
    assert_frequency(counts, 0, 0.4 / 0.7)


def test_top_p_keeps_the_smallest_set_reaching_p():
    probs = torch.tensor([0.5, 0.3, 0.15] + [0.05 / 1000] * 1000)
    counts = batch_draws(torch.log(probs), SamplingParams(temperature=1.0, top_p=0.79, seed=0))
    assert set(counts) == {0, 1}
    assert_frequency(counts, 0, 0.5 / 0.8)
    assert 2 in batch_draws(torch.log(probs), SamplingParams(temperature=1.0, top_p=0.81, seed=0))


def test_top_k_then_top_p_as_sample_token():
    # top-k 3 renormalises [0.4, 0.3, 0.2] to [4/9, 3/9, 2/9]; top-p 0.7 then keeps 4/9 + 3/9
    logits = torch.log(torch.tensor([0.4, 0.05, 0.3, 0.05, 0.2]))
    params = SamplingParams(temperature=1.0, top_k=3, top_p=0.7, seed=0)
    counts = batch_draws(logits, params)
    assert set(counts) == {0, 2}
    assert_frequency(counts, 0, 4 / 7)
    assert set(Counter(sample_token(logits, params, 0, k) for k in range(500))) == {0, 2}


@pytest.mark.parametrize("top_k", [2**63, 10**20])
def test_a_top_k_beyond_int64_keeps_the_whole_vocabulary_as_sample_token(top_k):
    # SamplingParams and the server take any top_k >= 0; the batch's numpy columns must not
    # overflow on one (a step's error would fail every request in the batch)
    logits = torch.randn(3, 10, generator=torch.Generator().manual_seed(5))
    params = [SamplingParams(temperature=1.0, top_k=top_k, seed=1 + i) for i in range(3)]
    expected = [sample_token(logits[i], params[i], 0, 4) for i in range(3)]
    assert sample_batch(logits, params, [0, 0, 0], [4, 4, 4]) == expected


def test_rows_of_different_parameters_in_one_batch_each_follow_their_own():
    probs = torch.tensor([0.4, 0.05, 0.3, 0.05, 0.2])
    row_params = [
        SamplingParams(temperature=1.0, top_k=1, seed=0),
        SamplingParams(temperature=1.0, top_p=0.65, seed=0),
        SamplingParams(temperature=1.0, seed=0),
    ]
    n = 1500
    params = [row_params[i % 3] for i in range(3 * n)]
    tokens = sample_batch(torch.log(probs).expand(3 * n, -1), params, [0] * (3 * n), [i // 3 for i in range(3 * n)])
    per = [Counter(tokens[r::3]) for r in range(3)]
    assert set(per[0]) == {0}
    assert set(per[1]) == {0, 2}
    assert_frequency(per[1], 0, 0.4 / 0.7, n)
    assert set(per[2]) == {0, 1, 2, 3, 4}
    assert_frequency(per[2], 4, 0.2, n)


def test_a_rows_token_does_not_depend_on_its_neighbours():
    logits = torch.randn(16, 4096, generator=torch.Generator().manual_seed(2))
    params = [SamplingParams(temperature=0.7, top_p=0.9, top_k=40, seed=3)] * 16
    together = sample_batch(logits, params, list(range(16)), list(range(16)))
    alone = [sample_batch(logits[i : i + 1], params[:1], [i], [i])[0] for i in range(16)]
    assert together == alone
    other_seed = [SamplingParams(temperature=0.7, top_p=0.9, top_k=40, seed=4)] * 16
    assert together != sample_batch(logits, other_seed, list(range(16)), list(range(16)))


def test_top_p_far_beyond_a_few_candidates_is_exact():
    torch.manual_seed(0)
    logits = torch.randn(49_152) * 0.01
    order = torch.argsort(logits, descending=True)
    probs = torch.softmax(logits, -1)[order]
    nucleus_size = int((torch.cumsum(probs, 0) - probs < 0.5).sum())
    counts = batch_draws(logits, SamplingParams(temperature=1.0, top_p=0.5, seed=0), n=100)
    assert set(counts) <= set(order[:nucleus_size].tolist())


def test_never_draws_a_token_of_zero_probability_and_tiny_top_p_keeps_the_first():
    logits = torch.tensor([0.2, 1.5, float("-inf"), 1.4, float("-inf")])
    counts = batch_draws(logits, SamplingParams(temperature=1.0, seed=0), n=500)
    assert set(counts) == {0, 1, 3}
    assert set(batch_draws(logits, SamplingParams(temperature=1.0, top_p=1e-50, seed=0), n=50)) == {1}


def test_uniform_draw_is_uniform_and_seeded_by_all_64_bits():
    us = [uniform_draw(5, 0, k) for k in range(N)]
    assert all(0.0 <= u < 1.0 for u in us)
    for lo in (0.0, 0.25, 0.5, 0.75):
        assert_frequency(Counter(lo <= u < lo + 0.25 for u in us), True, 0.25)
    assert uniform_draw(-1, 0, 0) != uniform_draw((1 << 63) - 1, 0, 0)


def test_the_hash_rounds_are_splitmix64():
    # SplitMix64's first output from state 0 (Vigna's splitmix64.c; Java's SplittableRandom)
    assert _splitmix64(0) == 0xE220A8397B1DCDAF


def test_a_draw_at_the_very_top_takes_the_last_token_of_non_zero_weight():
    """u = 1 - 2^-53 rounds to 1.0 in fp32, so u * total is the total itself and no cdf entry
    exceeds it: the draw is then the last token of non-zero weight (hand-picked rows whose
    zero weights, from -inf logits, trail it or sit between); u = 0 takes the first."""
    inf = float("inf")
    logits = torch.tensor([[0.0, 0.0, -inf, -inf], [0.0, -inf, 0.0, -inf], [-inf, 1.0, -inf, 2.0]])
    top = 1.0 - 2.0**-53
    u = torch.tensor([[top], [top], [0.0]], dtype=torch.float64).float()
    assert u[0].item() == 1.0
    ones = torch.ones(3, 1)
    assert _sample_group(logits, ones, ones, u, 4, False, at_top=True)[0].tolist() == [1, 2, 1]
    assert [_draw(torch.softmax(row, -1), u) for row, u in zip(logits, (top, top, 0.0), strict=True)] == [1, 2, 1]


def test_a_row_without_finite_probabilities_is_refused_by_both_samplers_naming_it():
    """A row whose softmax is NaN (every logit -inf, a +inf, a NaN) gives no token: both
    samplers raise NonFiniteLogitsError, the batch naming exactly those rows (a token drawn
    there was garbage: SmolLM2's all-NaN rows gave its end of text, an empty answer). An
    ordinary row beside them, and a row with some -inf logits (masked tokens), sample."""
    inf, nan = float("inf"), float("nan")
    rows = torch.tensor([[-inf] * 5, [0.0, inf, 1.0, inf, 0.0], [0.0, nan, 1.0, 2.0, 0.0], [0.3, -0.2, 1.1, 0.0, 0.5]])
    for temperature, top_k, top_p in ((0.0, 0, 1.0), (0.8, 0, 1.0), (0.8, 0, 0.5), (0.8, 3, 1.0), (0.8, 3, 0.5)):
        params = [SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=3 + i) for i in range(4)]
        for row, p in zip(rows[:3], params, strict=False):
            with pytest.raises(NonFiniteLogitsError, match="output position 5 are not finite"):
                sample_token(row, p, 0, 5)
        with pytest.raises(NonFiniteLogitsError) as refused:
            sample_batch(rows, params, [0] * 4, [5] * 4)
        assert refused.value.rows == [0, 1, 2], (temperature, top_k, top_p)
        masked = torch.tensor([[0.3, -inf, 1.1, -inf, 0.5], [0.3, -0.2, 1.1, 0.0, 0.5]])
        want = [sample_token(row, p, 0, 5) for row, p in zip(masked, params, strict=False)]
        assert sample_batch(masked, params[:2], [0, 0], [5, 5]) == want
        # a greedy and a drawing row in one batch (the mixed path checks both kinds)
        mixed = [SamplingParams(), params[1]]
        for bad in (0, 1):
            logits = masked.clone()
            logits[bad, 2] = nan
            with pytest.raises(NonFiniteLogitsError) as refused:
                sample_batch(logits, mixed, [0, 0], [5, 5])
            assert refused.value.rows == [bad]


def test_finite_logits_whose_scores_overflow_sample_as_the_temperatures_limit():
    """Finite logits past fp32's range once divided by the temperature (1e38 at 0.01, 2e37 at
    1e-4) made an +inf score and a NaN softmax, and both samplers refused them
    as not finite, where greedy took them. Now they are drawn from the logits less their
    maximum (the same softmax): what the temperature's limit gives, the largest logit, and
    between equal largest ones half and half. A NaN row beside them is still refused, and an
    ordinary row keeps its token."""
    inf, nan = float("inf"), float("nan")
    one_top = torch.tensor([1e38, 0.5e38, 3.0, -2.0, -inf])
    two_tops = torch.tensor([2e37, -1e37, 2e37, 0.0, 1.0])
    n = 400
    for temperature, top_k, top_p in ((0.01, 0, 1.0), (GREEDY_TEMPERATURE, 0, 0.9), (0.01, 3, 1.0), (1e-4, 2, 0.5)):
        params = [SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=s) for s in range(n)]
        for row, limit in ((one_top, {0}), (two_tops, {0, 2})):
            assert not torch.isfinite(row.float() / temperature).all()  # (the scores overflow)
            want = [sample_token(row, p, 0, 7) for p in params]
            assert sample_batch(row.expand(n, -1), params, [0] * n, [7] * n) == want
            if top_p > 0.5:  # (top-p 0.5 keeps one of two equal maxima: the first the sort gives)
                assert set(want) == limit, (temperature, top_k, top_p)
                if len(limit) == 2:
                    assert_frequency(Counter(want), 0, 0.5, n)
            else:
                assert len(set(want)) == 1 and set(want) <= limit
    # beside a NaN row and an ordinary row, batched and row by row
    ordinary = torch.tensor([0.3, -0.2, 1.1, 0.0, 0.5])
    rows = torch.stack([one_top, torch.tensor([0.0, nan, 1.0, 2.0, 0.0]), ordinary])
    params = [SamplingParams(temperature=0.01, seed=1), SamplingParams(temperature=0.01, seed=2)]
    params.append(SamplingParams(temperature=0.8, seed=3))
    with pytest.raises(NonFiniteLogitsError) as refused:
        sample_batch(rows, params, [0] * 3, [5] * 3)
    assert refused.value.rows == [1]
    assert refused.value.tokens == [0, -1, sample_token(ordinary, params[2], 0, 5)]
    with pytest.raises(NonFiniteLogitsError, match="not finite"):
        sample_token(rows[1], params[1], 0, 5)
    # a kept batch, stepped: the overflowed row's draws come from the same uniforms' table
    sampler, owners = BatchSampler(), [object(), object()]
    batch = torch.stack([one_top, ordinary])
    for step in range(3):
        got = sampler.sample(batch, owners, lambda: (params[::2], [0, 0], [0, 0]), lambda s=step: [5 + s, 5 + s])
        assert got == [0, sample_token(ordinary, params[2], 0, 5 + step)]


# (seed 0, sample 0, position 22,601,155): a draw of 0.99999997..., which fp32 rounds to 1.0
# (~2^-25 of draws do); found by a numpy scan of seed 0's positions, checked below
TOP_DRAW = (0, 0, 22_601_155)


def test_the_shortcut_where_no_draw_rounds_to_one_equals_the_full_last_index(one_thread):
    """`_sample_group` clamps the searched index (at_top False) where no row's u is 1.0 in
    fp32, instead of the last index of non-zero weight: the same token on every row, finite
    or not (random rows with -inf, +inf and NaN logits, u up to 1 - 2^-24, the largest fp32
    below 1), top-k and top-p on and off. And a draw that does round to 1.0 goes the full
    way inside `sample_batch`: rows whose nucleus leaves trailing zero weights take their
    last kept token, as sample_token's `_draw` does."""
    gen = torch.Generator().manual_seed(11)
    inf, nan = float("inf"), float("nan")
    for case in range(200):
        rows, vocab = 1 + case % 9, 1 + case % 23
        logits = torch.randn(rows, vocab, generator=gen) * (0.3 + case % 5)
        odd = torch.rand(rows, vocab, generator=gen)
        logits[odd < 0.05], logits[(odd > 0.1) & (odd < 0.13)] = -inf, inf
        logits[(odd > 0.2) & (odd < 0.21)] = nan
        temperature = torch.rand(rows, 1, generator=gen) * 2 + 0.01
        top_p = torch.where(torch.rand(rows, 1, generator=gen) < 0.5, 1.0, torch.rand(rows, 1, generator=gen))
        u = torch.rand(rows, 1, generator=gen)
        u[torch.rand(rows, 1, generator=gen) < 0.2] = 1 - 2.0**-24
        k = (case % 4) if case % 4 < vocab else vocab
        k = vocab if k == 0 else k
        for nucleus in (False, True):
            fast = _sample_group(logits, temperature, top_p, u, k, nucleus, at_top=False)[0]
            full = _sample_group(logits, temperature, top_p, u, k, nucleus, at_top=True)[0]
            assert fast.tolist() == full.tolist(), (case, nucleus)
    seed, index, position = TOP_DRAW
    assert np.float32(uniform_draw(seed, index, position)) == 1.0
    flat = torch.tensor([[2.0, 1.9, 1.8, -3.0, -9.0, 1.7, -inf]] * 3)
    params = [SamplingParams(temperature=1.0, seed=seed, top_p=p) for p in (1.0, 0.6, 0.9)]
    got = sample_batch(flat, params, [index] * 3, [position] * 3)
    assert got == [sample_token(row, p, index, position) for row, p in zip(flat, params, strict=True)]
    # the last token of non-zero weight: without top-p in vocabulary order (1.7: -inf weighs 0),
    # with it the nucleus's last by probability (top-p 0.6: 2.0, 1.9, 1.8; 0.9: and 1.7)
    assert got == [5, 2, 5]


def _row_by_row(logits, params, indices, at) -> tuple[list[int], list[int]]:
    """sample_token's tokens of each row (-1 where it refused the row: NonFiniteLogitsError),
    and the rows it refused."""
    tokens, refused = [], []
    for r in range(len(params)):
        try:
            tokens.append(sample_token(logits[r], params[r], indices[r], at[r]))
        except NonFiniteLogitsError:
            tokens.append(-1)
            refused.append(r)
    return tokens, refused


def _batched(sample) -> tuple[list[int], list[int]]:
    """A batch's tokens (where it refused rows, the error's: -1 at those rows), and the rows
    it refused."""
    try:
        return sample(), []
    except NonFiniteLogitsError as error:
        return error.tokens, error.rows


def test_thousands_of_random_batches_equal_sample_token_row_by_row(one_thread):
    """2,000 random batches (1 to 12 rows, vocabularies of 1 to 40, fp32 / fp64
    logits, a fifth of the rows with -inf, +inf or NaN logits), each row its own mix of
    temperature (greedy ones too), top-k, top-p, seed, sample index and position: every
    token of `sample_batch`, and of a `BatchSampler` kept over two steps, is sample_token's
    (continuous logits: no two candidates tie in probability, where the two may order them
    apart), and where sample_token refuses rows (NonFiniteLogitsError: a NaN or +inf, or
    every logit -inf) the batch is refused naming those rows, its other rows' tokens
    still sample_token's. A tenth of the rows hold finite logits near fp32's largest
    (randn * 5e37), whose scores overflow at the smaller temperatures: both samplers take
    them again less their maximum, the same way (`shifted_logits`)."""
    rng = random.Random(17)
    gen = torch.Generator().manual_seed(17)
    inf, nan = float("inf"), float("nan")
    drawn = odd_rows = num_refused = num_huge = 0
    for case in range(2000):
        rows, vocab = rng.randint(1, 12), rng.randint(1, 40)
        logits = torch.randn(rows, vocab, generator=gen) * rng.choice((0.2, 1.0, 4.0))
        for r in range(rows):
            kind = rng.random()
            if kind > 0.9:
                num_huge += 1
                logits[r] = (logits[r] * 5e37).clamp(-3e38, 3e38)  # finite in fp32
            elif kind < 0.2:
                odd_rows += 1
                if kind < 0.04:
                    logits[r] = -inf
                else:
                    logits[r, rng.randrange(vocab)] = (inf, nan, -inf)[int(kind * 100) % 3]
        logits = logits.to(rng.choice((torch.float32, torch.float32, torch.float64)))
        shared = rng.random() < 0.4  # a batch of one kind (the usual step) or of every kind

        def draw_params(rng=rng, vocab=vocab):
            return SamplingParams(
                temperature=rng.choice((0.0, 1e-6, 1e-5, 0.01, 0.4, 0.8, 1.0, 1.7)),
                top_p=rng.choice((1.0, 1.0, 0.95, 0.6, 1e-9)),
                top_k=rng.choice((0, 0, 1, 3, vocab, vocab + 5)),
                seed=rng.randint(SEED_MIN, SEED_MAX),
                min_p=rng.choice((0.0, 0.0, 0.0, 0.05, 0.3, 1.0)),
            )

        one = draw_params()
        params = [one if shared else draw_params() for _ in range(rows)]
        indices = [rng.randint(0, 3) for _ in range(rows)]
        positions = [rng.randint(0, 9999) for _ in range(rows)]
        want, refused = _row_by_row(logits, params, indices, positions)
        got = _batched(lambda: sample_batch(logits, params, indices, positions))  # noqa: B023 (called here)
        assert got == (want, refused), case
        sampler, owners = BatchSampler(), list(range(rows))
        for step in range(2):
            at = [p + step for p in positions]
            want, refused = _row_by_row(logits, params, indices, at)
            of = lambda p=params, i=indices, o=[0] * rows: (p, i, o)  # noqa: E731
            got = _batched(lambda: sampler.sample(logits, owners, of, lambda: at))  # noqa: B023 (called here)
            assert got == (want, refused), (case, step)
        drawn += sum(not p.greedy for p in params)
        num_refused += len(refused)
    assert drawn > 5000 and odd_rows > 1500 and num_refused > 500 and num_huge > 1000  # (what the batches held)


def test_the_batch_of_draws_is_uniform_draw_bit_for_bit():
    """`draws_at(seed_words(...), positions)` (numpy's wrapping uint64) against `uniform_draw` (Python integers
    masked to 64 bits), draw by draw, float64 equality: seeds over the whole signed range
    and its ends, indices and positions small and near 2^63, where a lost carry or an
    arithmetic (sign-extending) shift would show."""
    rng = random.Random(7)
    seeds = [SEED_MIN, SEED_MAX, -1, 0, 1] + [rng.randint(SEED_MIN, SEED_MAX) for _ in range(2000)]
    indices = [rng.choice((0, 1, 7, (1 << 63) - 1, rng.randrange(1 << 63))) for _ in seeds]
    positions = [rng.choice((0, 5, 4095, (1 << 62) + 3, rng.randrange(1 << 63))) for _ in seeds]
    got = draws_at(seed_words(seeds, indices), np.array(positions, np.int64))
    assert got.dtype == np.float64 and got.shape == (len(seeds),)
    assert got.tolist() == [uniform_draw(*key) for key in zip(seeds, indices, positions, strict=True)]
    assert draws_at(seed_words([], []), np.array([], np.int64)).shape == (0,)


def test_a_sample_index_never_replays_another_seeds_draws():
    """(seed s, sample i) and (seed s ^ i, sample 0) draw apart (a hash that xors the index
    into the raw seed gives them the same uniforms: with n > 1, requests seeded 0, 1, 2, ...
    repeat each other's samples); every (seed, sample, position) of a small grid draws its
    own uniform, and neighbouring seeds' and aliased pairs' draws are uncorrelated: their
    sample correlation over N positions within 5 standard errors (1 / sqrt(N)) of 0."""
    grid = {uniform_draw(s, i, k) for s in range(8) for i in range(4) for k in range(64)}
    assert len(grid) == 8 * 4 * 64
    bound = 5 / math.sqrt(N)
    for s in range(4):
        for other, i in ((s + 1, 0), (s ^ 1, 1), (s ^ 3, 3)):
            a = [uniform_draw(s, i, k) for k in range(N)]
            b = [uniform_draw(other, 0, k) for k in range(N)]
            assert abs(statistics.correlation(a, b)) <= bound, (s, i, other)
    # through the sampler: a flat 50-token row, the two samples' tokens over 40 positions
    flat, hot = torch.zeros(50), SamplingParams(temperature=1.0, seed=2)
    aliased = SamplingParams(temperature=1.0, seed=3)  # 3 = 2 ^ 1
    drawn = [sample_token(flat, hot, 1, k) for k in range(40)]
    assert drawn != [sample_token(flat, aliased, 0, k) for k in range(40)]


def test_the_batch_sampler_keeps_a_batch_and_samples_sample_batchs_tokens(one_thread):
    """`BatchSampler` over 150 steps of a batch that changes as an engine's does (rows finish,
    join, a step samples a few rows only, the order changes; a new owner with another's
    parameters), each row at its own position: every token is `sample_batch`'s on the same
    rows, and the rows' parameters are read again exactly when the owners changed."""
    rng = random.Random(5)
    kinds = [
        {},
        {"temperature": 0.7, "seed": 11},
        {"temperature": 1.3, "top_p": 0.8, "seed": -2},
        {"temperature": 0.9, "top_k": 5, "top_p": 0.9, "seed": SEED_MAX},
        {"temperature": 2.0, "top_k": 3, "seed": 0},
        {"temperature": 0.8, "min_p": 0.2, "seed": 4},
    ]

    class Owner:  # an engine's sequence: its params and sample index fixed while it runs
        def __init__(self) -> None:
            self.params = SamplingParams(**rng.choice(kinds))
            self.index, self.position = rng.randint(0, 3), rng.randint(0, 50)
            self.origin = self.position % 7  # (its length is origin + position)

    sampler = BatchSampler()
    batch = [Owner() for _ in range(6)]
    reads, last = 0, []
    for step in range(150):
        event = rng.random()
        if event < 0.1:  # one finishes, one joins
            batch.pop(rng.randrange(len(batch)))
            batch.append(Owner())
        elif event < 0.15:
            rng.shuffle(batch)
        rows = batch if event < 0.9 else rng.sample(batch, 3)  # a step that samples some rows only
        logits = torch.randn(len(rows), 24, generator=torch.Generator().manual_seed(step)) * 3
        read_before = reads

        def params_of(which=None, rows=rows):
            nonlocal reads
            reads += 1
            picked = rows if which is None else [rows[i] for i in which]
            return [o.params for o in picked], [o.index for o in picked], [o.origin for o in picked]

        got = sampler.sample(logits, rows, params_of, lambda rows=rows: [o.origin + o.position for o in rows])
        want = sample_batch(logits, [o.params for o in rows], [o.index for o in rows], [o.position for o in rows])
        assert got == want, step
        # read again exactly when the rows are not the last step's objects in the same order
        # (after a batch greedy throughout, or drawing throughout, the rows that joined first,
        # then the whole batch where they do not fit it: the tests below)
        changed = len(rows) != len(last) or any(a is not b for a, b in zip(rows, last, strict=False))
        greedy = bool(last) and all(o.params.temperature < GREEDY_TEMPERATURE for o in last)
        drawing = bool(last) and all(o.params.temperature >= GREEDY_TEMPERATURE for o in last)
        assert reads - read_before == changed or ((greedy or drawing) and reads - read_before <= 2 * changed), step
        last = list(rows)
        for o in rows:
            o.position += 1
    assert 15 < reads < 75  # most steps kept their batch


def test_a_kept_batch_at_consecutive_positions_draws_sample_tokens_tokens(one_thread):
    """A kept batch whose rows step one position at a time takes its uniforms from a table
    of the coming AHEAD steps' draws: over 100 steps (tables made at steps 1, 33, 65, and
    again after the positions jump), every token is sample_token's at the row's position,
    and the step at TOP_DRAW, whose uniform rounds to 1.0 in fp32, read from inside a table,
    takes each row's last token of non-zero weight (as by hand in the test above)."""
    seed, index, top = TOP_DRAW
    flat = torch.tensor([[2.0, 1.9, 1.8, -3.0, -9.0, 1.7, -float("inf")]] * 3)
    params = [SamplingParams(temperature=1.0, seed=seed, top_p=p) for p in (1.0, 0.6, 0.9)]
    sampler, owners = BatchSampler(), ["a", "b", "c"]
    origins = [7, 0, 100]
    at = [top - 40] * 3
    for step in range(100):
        if step == 70:  # every row jumps: the table goes
            at = [a + 5 for a in at]
        if step == 80:  # one row falls behind the others by a position
            at[1] -= 1
        lengths = [o + a for o, a in zip(origins, at, strict=True)]
        got = sampler.sample(flat, owners, lambda: (params, [index] * 3, origins), lambda lengths=lengths: lengths)
        assert got == [sample_token(row, p, index, a) for row, p, a in zip(flat, params, at, strict=True)], step
        if step == 40:
            assert at == [top] * 3 and got == [5, 2, 5]
        at = [a + 1 for a in at]
    assert AHEAD < 40 < 2 * AHEAD  # (TOP_DRAW's step lies in the second table, not at its start)


def test_mismatched_lengths_are_refused_naming_them():
    with pytest.raises(ValueError, match="3 logit rows but 2 params"):
        sample_batch(torch.zeros(3, 4), [SamplingParams()] * 2, [0] * 3, [0] * 3)
    with pytest.raises(ValueError, match="2 logit rows but 2 params, 2 sample indices, 1 origins"):
        BatchSampler().sample(torch.zeros(2, 4), [1, 2], lambda: ([SamplingParams()] * 2, [0] * 2, [0]), list)


def _engine(batched: bool):
    runner = llama_runner(random_llama("cpu", torch.float32), 64, 16, DESCRIPTOR)
    return Engine(runner, max_num_batched_tokens=256, max_num_seqs=8, batched_sampling=batched)


def _serve(engine, prompts, params):
    ids = [engine.add_request(p, params, f"r{i}") for i, p in enumerate(prompts)]
    while engine.has_unfinished():
        engine.step()
        engine.runner.check_integrity()
    return [[c.token_ids for c in engine.output(i).completions] for i in ids]


def test_the_engine_batched_equals_row_by_row_and_stochastic_ignores_batching():
    prompts = [random_ids(5 + 7 * i, seed=i) for i in range(5)]
    greedy = SamplingParams(max_tokens=6, ignore_eos=True)
    assert _serve(_engine(True), prompts, greedy) == _serve(_engine(False), prompts, greedy)
    seeded = SamplingParams(max_tokens=6, ignore_eos=True, temperature=20.0, top_p=0.95, seed=-5, n=2)
    assert _serve(_engine(True), prompts, seeded) == _serve(_engine(False), prompts, seeded)
    # a stochastic request samples the same tokens alone as beside four others (the random
    # logits spread ~11: a hot temperature; n = 2: the fork's first token is drawn from
    # the parent's logits)
    hot = SamplingParams(max_tokens=6, ignore_eos=True, temperature=30.0, top_k=50, seed=9, n=2)
    together = _serve(_engine(True), prompts, hot)
    alone = _serve(_engine(True), prompts[2:3], hot)
    assert together[2] == alone[0]
    assert together[2][0] != together[2][1]  # the two samples draw at different sample indices


def test_after_a_greedy_batch_the_batch_sampler_reads_only_the_rows_that_joined(one_thread):
    """A `BatchSampler` whose last batch was greedy throughout reads, for a batch of other
    owners, only the rows whose owner joined (rows(joined)); greedy too, it keeps nothing
    per row. Its twins: the same sampler with `incremental` False (every row read at every
    change) and `sample_batch` on the same rows, over 300 steps of a batch that changes as an
    engine's does (rows finish, join, move; a step samples some rows only), mostly greedy
    owners and now and then one that draws (the batch then read whole)."""
    rng = random.Random(13)

    class Owner:
        def __init__(self) -> None:
            hot = rng.random() < 0.08
            self.params = SamplingParams(temperature=0.8, seed=rng.randrange(99)) if hot else SamplingParams()
            self.index, self.position = rng.randint(0, 2), rng.randint(0, 40)
            self.origin = self.position % 5

    fast, twin = BatchSampler(), BatchSampler()
    twin.incremental = False
    batch = [Owner() for _ in range(8)]
    last: list[Owner] = []
    num_partial = num_whole = 0
    for step in range(300):
        event = rng.random()
        if event < 0.3:  # some finish, some join
            for _ in range(min(rng.randint(1, 2), len(batch) - 1)):  # (one row stays)
                batch.pop(rng.randrange(len(batch)))
            batch += [Owner() for _ in range(rng.randint(0, 3))]
        elif event < 0.35:
            rng.shuffle(batch)
        rows = batch if event < 0.9 else rng.sample(batch, min(3, len(batch)))
        logits = torch.randn(len(rows), 24, generator=torch.Generator().manual_seed(step)) * 3
        asked: list[list[int] | None] = []

        def rows_of(which=None, rows=rows, asked=asked):
            asked.append(which)
            picked = rows if which is None else [rows[i] for i in which]
            return [o.params for o in picked], [o.index for o in picked], [o.origin for o in picked]

        def lengths(rows=rows):
            return [o.origin + o.position for o in rows]

        got = fast.sample(logits, rows, rows_of, lengths)
        asked_fast, asked[:] = list(asked), []
        assert got == twin.sample(logits, rows, rows_of, lengths), step
        assert asked in ([], [None])  # (the twin reads every row, or none where the batch stands)
        want = sample_batch(logits, [o.params for o in rows], [o.index for o in rows], [o.position for o in rows])
        assert got == want, step
        for which in asked_fast:
            if which is not None:  # exactly the rows whose owner was not in the last batch
                assert which == [i for i, o in enumerate(rows) if not any(o is p for p in last)], step
                num_partial += 1
            else:
                num_whole += 1
        last = list(rows)
        for o in rows:
            o.position += 1
    assert num_partial > 20 and num_whole > 10


class _Row:
    """An owner that compares by identity (as the engine's sequences)."""


@settings(max_examples=300, deadline=None)
@given(
    num_last=st.integers(0, 40),
    edits=st.lists(
        st.tuples(st.sampled_from(["leave", "join", "insert", "move", "shuffle"]), st.integers(0, 10**6)), max_size=30
    ),
)
def test_match_finds_each_row_in_the_last_batch_as_a_search_by_identity_does(num_last, edits):
    """`_match`'s in-order walk (its runs, a few rows ahead, the id dict past MAX_MISMATCHES
    or for a moved row) against its twin, a search of the last batch by identity for every
    row: the same joined rows and each kept row's row in the last batch, for batches edited
    as an engine's (rows leave anywhere, join at the end) and otherwise (joined in the
    middle, moved, shuffled: many mismatches)."""
    last = [_Row() for _ in range(num_last)]
    owners = list(last)
    rng = random.Random(len(edits))
    for kind, at in edits:
        if kind == "leave" and owners:
            owners.pop(at % len(owners))
        elif kind == "join":
            owners.append(_Row())
        elif kind == "insert":
            owners.insert(at % (len(owners) + 1), _Row())
        elif kind == "move" and owners:
            owners.insert(at % len(owners), owners.pop(rng.randrange(len(owners))))
        elif kind == "shuffle":
            rng.shuffle(owners)
    matched = _match(owners, last)
    where = [next((j for j, p in enumerate(last) if p is o), -1) for o in owners]
    assert matched.joined == [i for i, j in enumerate(where) if j < 0]
    assert matched.src(len(owners)).tolist() == where


def test_match_walks_an_engines_changed_batch_in_a_few_runs():
    # the engine's changed batch: rows 3 and 4 left, then rows 9 .. 13, two joined at the end:
    # three runs, each gap passed by in one scan, the joined rows placed by the dict (empty)
    last = [_Row() for _ in range(20)]
    gone = {3, 4, 9, 10, 11, 12, 13}
    owners = [o for j, o in enumerate(last) if j not in gone] + [_Row(), _Row()]
    matched = _match(owners, last)
    assert matched.joined == [13, 14]
    assert matched.runs == [(0, 0, 3), (3, 5, 4), (7, 14, 6)]
    assert matched.src(15).tolist() == [0, 1, 2, 5, 6, 7, 8, 14, 15, 16, 17, 18, 19, -1, -1]
    # a row moved back: the walk passes it by, the dict places it
    moved = [last[1], last[2], last[0], *last[3:]]
    matched = _match(moved, last)
    assert matched.joined == [] and matched.runs == [(0, 1, 2), (3, 3, 17), (2, 0, 1)]
    # a reversed batch mismatches at every row: past MAX_MISMATCHES the dict places the rest
    rev = last[::-1]
    matched = _match(rev, last)
    assert matched.joined == [] and matched.src(20).tolist() == list(range(19, -1, -1))
    assert len(matched.runs) == 20 > MAX_MISMATCHES


def test_a_one_in_the_table_of_coming_draws_is_flagged_through_edits():
    """A uniform of 1.0 (~2^-25 of draws: the step then takes the last index of non-zero
    weight) planted in the table of coming draws of a drawing batch: an edit keeps its
    step's flag while its row stays, and drops it with the row (the joined rows' draws
    flagged as they come)."""
    owners = [_Row() for _ in range(6)]
    params = SamplingParams(temperature=0.9, seed=3)
    logits = torch.zeros(6, 8)
    sampler = BatchSampler()

    def rows_of(which=None, rows=owners):
        n = len(rows) if which is None else len(which)
        return [params] * n, [0] * n, [0] * n

    for position in range(3):  # consecutive positions: the table made at the second step
        sampler.sample(logits, owners, rows_of, lambda position=position: [position] * 6)
    table, j = sampler._rows.ahead, sampler._rows.num_ahead_used
    table[2, j + 3] = 1.0  # (row 2's draw 3 steps on)
    sampler._rows.ahead_top[j + 3] = True
    stay = owners[1:] + [_Row()]  # row 0 leaves: row 2's 1.0 stays
    sampler.sample(logits, stay, lambda which=None: rows_of(which, stay), lambda: [3] * 6)
    rows = sampler._rows
    assert sampler.num_edited == 1 and rows.ahead_top[j + 3] and rows.ahead[1, j + 3] == 1.0
    gone = stay[:1] + stay[2:]  # its row leaves: the flag goes
    sampler.sample(logits[:5], gone, lambda which=None: rows_of(which, gone), lambda: [4] * 5)
    rows = sampler._rows
    assert sampler.num_edited == 2 and not any(rows.ahead_top[j + 2 :])
    assert rows.ahead_top[j + 2 :] == (rows.ahead >= 1.0).any(axis=0).tolist()[j + 2 :]


def test_owners_that_compare_by_value_are_read_whole_after_a_greedy_batch():
    # a set would take two equal owners for one (a row that joins for one that left): owners
    # of a type with its own equality (here str and int ids, each equal to a new one) are
    # read whole at every change; the engine's sequences compare by identity
    for first, second in ((["a", "b"], ["b", "c"]), ([1, 2], [2, 3])):
        sampler, asked = BatchSampler(), []

        def rows_of(which=None, asked=asked):
            asked.append(which)
            n = 2 if which is None else len(which)
            return [SamplingParams()] * n, [0] * n, [0] * n

        logits = torch.tensor([[0.0, 1.0], [2.0, 0.0]])
        assert sampler.sample(logits, first, rows_of, list) == [1, 0]
        assert sampler.sample(logits, second, rows_of, list) == [1, 0]
        assert asked == [None, None]


class _EqualToAll:
    """A caller's owner of another type whose == says True to anything (an ANY-like handle)."""

    def __init__(self, params: SamplingParams) -> None:
        self.params = params

    def __eq__(self, other: object) -> bool:
        return True

    __hash__ = object.__hash__


class _EqRaises(_EqualToAll):
    """An owner whose == cannot be asked (an array-like handle)."""

    def __eq__(self, other: object) -> bool:
        raise TypeError("this owner has no truth value for ==")

    __hash__ = object.__hash__


@pytest.mark.parametrize("owner_kind", [_EqualToAll, _EqRaises])
@pytest.mark.parametrize("last_draws", [False, True])
def test_a_joined_owner_of_another_type_is_never_taken_for_a_left_row(one_thread, owner_kind, last_draws):
    """The kept batch's owners are of an identity kind; a new owner of another type takes
    the place of a row that left. It is matched by identity, as the twin (`incremental`
    False) does: never taken for the left row whatever its == says (or raises), its own
    params read (it draws, where the left row was greedy or drew with another seed)."""

    class Seq:
        def __init__(self, params: SamplingParams) -> None:
            self.params = params

    left = SamplingParams(temperature=0.9, seed=3) if last_draws else SamplingParams()
    first = [Seq(left), Seq(left), Seq(left)]
    second = [first[0], first[1], owner_kind(SamplingParams(temperature=1.0, seed=7))]
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))

    def rows_of(owners):
        def rows(which=None):
            picked = owners if which is None else [owners[i] for i in which]
            return [o.params for o in picked], [0] * len(picked), [0] * len(picked)

        return rows

    fast, twin = BatchSampler(), BatchSampler()
    twin.incremental = False
    for sampler in (fast, twin):
        sampler.sample(logits, first, rows_of(first), lambda: [5, 5, 5])
    got = fast.sample(logits, second, rows_of(second), lambda: [6, 6, 6])
    assert got == twin.sample(logits, second, rows_of(second), lambda: [6, 6, 6])
    assert got == sample_batch(logits, [o.params for o in second], [0, 0, 0], [6, 6, 6])
    # (the joined row's own draw: the left row's params would give another token here)
    assert got[2] != sample_batch(logits[2:], [left], [0], [6])[0]


@pytest.mark.parametrize("top_k, top_p", [(0, 1.0), (7, 0.9)])
def test_a_drawing_batch_that_changes_is_edited_in_place_and_samples_as_its_twin(one_thread, top_k, top_p):
    """A batch that draws throughout in one group of top-k / top-p kind, changing as an
    engine's does (rows finish anywhere, join at the end, now and then one of another kind
    or a greedy one, or many at once, the order changes): `BatchSampler` reads only the joined rows and
    moves the kept rows' seed words, columns, positions and table of the coming AHEAD
    steps' draws (`_BatchRows.edited`; the joined rows' columns of the table filled at their
    first step), or reads the batch whole where the joined rows do not fit it. Every token
    equals its twin's (`incremental` False: every change read whole, the table dropped) and
    `sample_batch`'s over 400 steps of consecutive positions, 40 rows of 24 tokens."""
    rng = random.Random(29)

    class Owner:
        def __init__(self, odd: bool = False) -> None:
            kind = {"temperature": 0.9, "top_k": top_k, "top_p": top_p, "seed": rng.randrange(-50, 50)}
            if odd:  # another kind: a greedy row, or another top-k
                kind = {} if rng.random() < 0.5 else {**kind, "top_k": top_k + 2}
            self.params = SamplingParams(**kind)
            self.index, self.position = rng.randint(0, 2), rng.randint(0, 60)
            self.origin = self.position % 9

    fast, twin = BatchSampler(), BatchSampler()
    twin.incremental = False
    batch = [Owner() for _ in range(40)]
    last: list[Owner] = []
    edited_reads = 0
    for step in range(400):
        event = rng.random()
        if event < 0.4:  # some finish, as many or one more or fewer join
            for _ in range(rng.randint(1, 3)):
                batch.pop(rng.randrange(len(batch)))
            batch += [Owner(odd=rng.random() < 0.01) for _ in range(rng.randint(0, 4))]
        elif event < 0.43:  # many join at once (their seed words in numpy: more than FEW_JOINED)
            batch += [Owner() for _ in range(FEW_JOINED + 2)]
        elif event < 0.45:
            rng.shuffle(batch)
        logits = torch.randn(len(batch), 24, generator=torch.Generator().manual_seed(step)) * 2
        asked: list[list[int] | None] = []

        def rows_of(which=None, asked=asked, rows=batch):
            asked.append(which)
            picked = rows if which is None else [rows[i] for i in which]
            return [o.params for o in picked], [o.index for o in picked], [o.origin for o in picked]

        def lengths(rows=batch):
            return [o.origin + o.position for o in rows]

        edits = fast.num_edited
        got = fast.sample(logits, batch, rows_of, lengths)
        if fast.num_edited > edits:  # exactly the joined rows read (none where rows only left), nothing else
            joined = [i for i, o in enumerate(batch) if not any(o is p for p in last)]
            assert asked == ([joined] if joined else []), step
            edited_reads += 1
        asked.clear()
        assert got == twin.sample(logits, batch, rows_of, lengths), step
        want = sample_batch(logits, [o.params for o in batch], [o.index for o in batch], [o.position for o in batch])
        assert got == want, step
        if fast.num_edited > edits:  # the edited rows' fp32 columns (numpy's rounding) are `of`'s (torch's)
            (edited,), (made,) = fast._rows.groups, twin._rows.groups
            assert torch.equal(edited.temperature, made.temperature) and torch.equal(edited.top_p, made.top_p)
        table = fast._rows.ahead
        if table is not None:  # the coming steps' flags of a 1.0 are the table's (kept through edits)
            j = fast._rows.num_ahead_used
            assert fast._rows.ahead_top[j:] == (table >= 1.0).any(axis=0).tolist()[j:], step
        last = list(batch)
        for o in batch:
            o.position += 1
    assert twin.num_edited == 0
    assert fast.num_edited == edited_reads > 60
