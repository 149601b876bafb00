"""Internal fragmentation: seed 003's bound n(q-1), expectation n(q-1)/2, and measured."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.capacity.fragmentation import (
    fragmentation_bound,
    fragmentation_expectation,
    measure_fragmentation,
    sample_lengths,
)


def test_bound_and_expectation() -> None:
    assert fragmentation_bound(10, 16) == 150
    assert fragmentation_expectation(10, 16) == 75.0
    assert fragmentation_bound(3, 1) == 0  # one-token blocks never waste
    with pytest.raises(ValueError):
        fragmentation_bound(1, 0)


def test_measured_by_hand() -> None:
    f = measure_fragmentation([16, 17, 31, 1], 16)
    assert f.allocated_slots == 16 + 32 + 32 + 16
    assert f.useful_slots == 65 and f.wasted_slots == 31
    assert f.bound_slots == 60 and f.expected_slots == 30
    assert f.rate == pytest.approx(1 - 65 / 96)
    assert measure_fragmentation([], 16).rate == 0.0


def test_the_bound_is_reached_and_never_exceeded() -> None:
    worst = measure_fragmentation([1 + 16 * k for k in range(50)], 16)  # every tail holds one token
    assert worst.wasted_slots == worst.bound_slots
    aligned = measure_fragmentation([16 * k for k in range(1, 50)], 16)
    assert aligned.wasted_slots == 0
    for seed in range(5):
        f = measure_fragmentation(sample_lengths("lognormal:900:1.2", 300, seed), 64)
        assert 0 <= f.wasted_slots <= f.bound_slots


def test_uniform_lengths_measure_close_to_the_expectation() -> None:
    f = measure_fragmentation(sample_lengths("uniform:1:100000", 20_000, seed=7), 16)
    assert f.wasted_slots == pytest.approx(f.expected_slots, rel=0.03)


def test_sampling_is_seeded() -> None:
    a = sample_lengths("uniform:1:1000", 50, seed=1)
    assert a == sample_lengths("uniform:1:1000", 50, seed=1)
    assert a != sample_lengths("uniform:1:1000", 50, seed=2)
    assert all(1 <= n <= 1000 for n in a)
    assert sample_lengths("fixed:33", 3) == [33, 33, 33]
    assert min(sample_lengths("lognormal:10:3", 1000)) >= 1
    for bad in ("normal:1:2", "uniform:5", "uniform:9:1", "fixed:x"):
        with pytest.raises(ValueError):
            sample_lengths(bad, 4)


@pytest.mark.parametrize(
    ("distribution", "message"),
    [
        # inf drew inf lengths (int() raised OverflowError, a traceback through kvpool plan)
        ("lognormal:inf:1", "lognormal needs a finite MEDIAN > 0 and a finite SIGMA >= 0, got inf, 1.0"),
        ("lognormal:1:inf", "lognormal needs a finite MEDIAN > 0 and a finite SIGMA >= 0, got 1.0, inf"),
        # nan passed the comparisons, then numpy said "cannot convert float NaN to integer"
        ("lognormal:nan:1", "lognormal needs a finite MEDIAN > 0 and a finite SIGMA >= 0, got nan, 1.0"),
        ("lognormal:1e307:10", "lognormal:1e+307:10 draws lengths beyond a float; use a smaller one"),
        # numpy said "high is out of bounds for int64"
        ("uniform:1:10000000000000000000", "uniform HI must be below 2**63 - 1, got 10000000000000000000"),
    ],
)
def test_lengths_past_what_the_sampler_draws_are_named(distribution: str, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        sample_lengths(distribution, 4)


def test_lengths_past_a_float_are_counted_exactly() -> None:
    # math.ceil(n / q) divided in floats: 10**20 (a multiple of 16) wasted one slot a request,
    # and lengths near 2**62 measured fewer allocated slots than tokens (negative waste)
    aligned = measure_fragmentation([10**20] * 62, 16)
    assert aligned.wasted_slots == 0 and aligned.allocated_slots == 62 * 10**20
    tail = measure_fragmentation([2**62 + 1, 2**62 + 15], 16)
    assert tail.wasted_slots == 15 + 1 and tail.allocated_slots == 2 * (2**62 + 16)


_DISTRIBUTIONS = st.one_of(
    st.builds(lambda lo, hi: f"uniform:{lo}:{hi}", st.integers(-2, 2**64), st.integers(-2, 2**64)),
    st.builds(
        lambda m, s: f"lognormal:{m}:{s}",
        st.sampled_from(["2000", "1e300", "1e307", "0", "-1", "inf", "nan", "x"]),
        st.sampled_from(["0", "0.5", "3", "40", "400", "-1", "inf", "nan"]),
    ),
    st.builds(lambda n: f"fixed:{n}", st.integers(-2, 2**70)),
    st.sampled_from(["", "uniform", "uniform:1", "fixed:1:2", "zipf:1", "fixed:a", "lognormal:1:2:3"]),
)


@settings(max_examples=200, deadline=None)
@given(distribution=_DISTRIBUTIONS, num_seqs=st.sampled_from([0, 1, 7, 1000, -1]), seed=st.integers(0, 3))
def test_check_lengths_raises_exactly_what_sample_lengths_raises(distribution, num_seqs, seed) -> None:
    """check_lengths (kvpool plan's up-front check of --lengths, review 9 #5: it built
    100,000 lengths as a list only to check them) draws the same and refuses the same."""
    from kvpool.capacity.fragmentation import check_lengths

    try:
        sample_lengths(distribution, num_seqs, seed)
    except ValueError as refused:
        with pytest.raises(ValueError) as checked:
            check_lengths(distribution, num_seqs, seed)
        assert str(checked.value) == str(refused)
    else:
        check_lengths(distribution, num_seqs, seed)


def test_sample_lengths_draws_as_numpy_does() -> None:
    # (an independent reference: the generator's own draws, converted one by one)
    rng = np.random.default_rng(5)
    assert sample_lengths("uniform:3:900", 50, 5) == [int(x) for x in rng.integers(3, 901, size=50)]
    rng = np.random.default_rng(5)
    expected = [max(1, int(round(x))) for x in rng.lognormal(math.log(300), 2.0, size=50)]
    assert sample_lengths("lognormal:300:2", 50, 5) == expected
    assert sample_lengths("fixed:99999999999999999999", 3) == [99999999999999999999] * 3
    assert all(type(n) is int for n in sample_lengths("uniform:0:5", 4) + sample_lengths("fixed:5", 2))
