"""Internal fragmentation of paged KV: the unused slots of each request's last block.

Seed 003: with blocks of q tokens, n live sequences waste at most F_max = n(q - 1) slots,
and about E[F] = n(q - 1) / 2 when the tail remainders are close to uniform. The measured
value comes from a length distribution, sampled with a seed, and is reported as wasted
slots and as seed 003's fragmentation rate 1 - useful / allocated.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


def fragmentation_bound(num_seqs: int, block_size: int) -> int:
    """F_max = n(q - 1) slots."""
    _check(num_seqs, block_size)
    return num_seqs * (block_size - 1)


def fragmentation_expectation(num_seqs: int, block_size: int) -> float:
    """E[F] = n(q - 1) / 2 slots, for tail remainders uniform over 0..q-1."""
    _check(num_seqs, block_size)
    return num_seqs * (block_size - 1) / 2


def _check(num_seqs: int, block_size: int) -> None:
    if num_seqs < 0:
        raise ValueError(f"num_seqs must be >= 0, got {num_seqs}")
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")


@dataclass(frozen=True)
class Fragmentation:
    num_seqs: int
    block_size: int
    useful_slots: int  # tokens actually cached
    allocated_slots: int  # whole blocks x block_size
    bound_slots: int  # n(q - 1)
    expected_slots: float  # n(q - 1) / 2

    @property
    def wasted_slots(self) -> int:
        return self.allocated_slots - self.useful_slots

    @property
    def rate(self) -> float:
        """1 - useful / allocated (0 for an empty batch)."""
        return 1 - self.useful_slots / self.allocated_slots if self.allocated_slots else 0.0


def measure_fragmentation(lengths: Sequence[int], block_size: int) -> Fragmentation:
    """Wasted tail slots of requests with these cached lengths in blocks of `block_size`."""
    _check(len(lengths), block_size)
    for n in lengths:
        if n < 0:
            raise ValueError(f"a request length must be >= 0, got {n}")
    # integer ceil: math.ceil(n / q) divides in floats, which past 2**53 tokens rounded the
    # length (fixed:99999999999999999999 wasted 62 slots in 62 requests where none is; a
    # context of 2**62 measured -112, fewer slots than tokens)
    allocated = sum(-(-n // block_size) * block_size for n in lengths)
    return Fragmentation(
        num_seqs=len(lengths),
        block_size=block_size,
        useful_slots=sum(lengths),
        allocated_slots=allocated,
        bound_slots=fragmentation_bound(len(lengths), block_size),
        expected_slots=fragmentation_expectation(len(lengths), block_size),
    )


_INT64_MAX = (1 << 63) - 1


def sample_lengths(distribution: str, num_seqs: int, seed: int = 0) -> list[int]:
    """`num_seqs` request lengths drawn with `seed` from one of:

    "uniform:LO:HI"        integers uniform on [LO, HI]
    "lognormal:MEDIAN:SIGMA" exp(N(ln MEDIAN, SIGMA)), rounded, at least 1 (chat-like tails)
    "fixed:N"              every request N tokens
    """
    kind, draws = _draw_lengths(distribution, num_seqs, seed)
    if kind == "lognormal":  # (Python's ints: a long tail's rounded length can pass int64)
        return [max(1, int(round(x))) for x in draws]
    return draws.tolist()  # (Python ints)


def check_lengths(distribution: str, num_seqs: int, seed: int = 0) -> None:
    """The ValueError sample_lengths(distribution, num_seqs, seed) raises, if any: the same
    parse and the same draws, checked as numpy arrays without building the list (`kvpool
    plan --lengths` checks 100,000 draws up front: 0.5 s for a lognormal's list, ~10 ms so)."""
    _draw_lengths(distribution, num_seqs, seed)


def _draw_lengths(distribution: str, num_seqs: int, seed: int) -> tuple[str, np.ndarray]:
    """sample_lengths' draws, checked: the distribution's kind and its lengths (a
    lognormal's unrounded floats, finite)."""
    if num_seqs < 0:
        raise ValueError(f"num_seqs must be >= 0, got {num_seqs}")
    kind, _, rest = distribution.partition(":")
    args = rest.split(":") if rest else []
    rng = np.random.default_rng(seed)
    try:
        if kind == "uniform" and len(args) == 2:
            lo, hi = int(args[0]), int(args[1])
            if not 0 <= lo <= hi:
                raise ValueError(f"uniform bounds must satisfy 0 <= LO <= HI, got {lo}, {hi}")
            if hi >= _INT64_MAX:  # numpy draws int64 (its own words: "high is out of bounds for int64")
                raise ValueError(f"uniform HI must be below 2**63 - 1, got {hi}")
            return kind, rng.integers(lo, hi + 1, size=num_seqs)
        if kind == "lognormal" and len(args) == 2:
            median, sigma = float(args[0]), float(args[1])
            # nan passes neither comparison; inf draws infinite lengths (int() of them overflows)
            if not (0 < median < math.inf and 0 <= sigma < math.inf):
                raise ValueError(f"lognormal needs a finite MEDIAN > 0 and a finite SIGMA >= 0, got {median}, {sigma}")
            draws = rng.lognormal(math.log(median), sigma, size=num_seqs)
            if not np.isfinite(draws).all():  # finite parameters can still draw past a float
                raise ValueError(f"lognormal:{median:g}:{sigma:g} draws lengths beyond a float; use a smaller one")
            return kind, draws
        if kind == "fixed" and len(args) == 1:
            n = int(args[0])
            if n < 0:
                raise ValueError(f"fixed length must be >= 0, got {n}")
            return kind, np.full(num_seqs, n, dtype=object)  # (object: N may pass int64)
    except ValueError as e:
        if "invalid literal" in str(e) or "could not convert" in str(e):
            raise ValueError(f"length distribution {distribution!r} has a non-numeric parameter") from None
        raise
    raise ValueError(
        f"unknown length distribution {distribution!r}; use uniform:LO:HI, lognormal:MEDIAN:SIGMA or fixed:N"
    )
