"""The sampler: greedy, temperature, top-k and top-p, drawn from a seeded generator."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from kvpool.engine.sampling import NUCLEUS_CANDIDATES, SamplingParams, sample_token


def draws(logits: torch.Tensor, params: SamplingParams, n: int = 3000) -> Counter:
    return Counter(sample_token(logits, params, 0, position) for position in range(n))


def test_greedy_is_the_argmax():
    logits = torch.tensor([0.1, 3.0, -2.0, 2.9])
    assert sample_token(logits, SamplingParams(), 0, 0) == 1


def test_temperature_sampling_follows_the_softmax():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.2]))
    counts = draws(logits, SamplingParams(temperature=1.0))
    for token, p in enumerate([0.5, 0.3, 0.2]):
        assert abs(counts[token] / 3000 - p) < 0.04  # ~4.5 standard errors at n = 3000


def test_top_k_keeps_the_k_most_likely_renormalised():
    logits = torch.log(torch.tensor([0.4, 0.05, 0.3, 0.05, 0.2]))
    counts = draws(logits, SamplingParams(temperature=1.0, top_k=2))
    assert set(counts) == {0, 2}
    assert abs(counts[0] / 3000 - 0.4 / 0.7) < 0.04


def test_top_p_keeps_the_smallest_set_reaching_p():
    # 0.5 + 0.3 = 0.8 reaches top_p = 0.79: token 2 (0.15) is dropped, the rest as well
    probs = torch.tensor([0.5, 0.3, 0.15] + [0.05 / 1000] * 1000)
    counts = draws(torch.log(probs), SamplingParams(temperature=1.0, top_p=0.79))
    assert set(counts) == {0, 1}
    assert abs(counts[0] / 3000 - 0.5 / 0.8) < 0.04
    # just above 0.8 the third token joins
    assert 2 in draws(torch.log(probs), SamplingParams(temperature=1.0, top_p=0.81))


def test_top_p_beyond_the_candidates_takes_the_full_sort():
    # a flat 49,152-token distribution: the nucleus at top_p 0.5 holds ~24,576 tokens,
    # far more than the first candidates; every one of the lowest half must stay out
    torch.manual_seed(0)
    logits = torch.randn(49_152) * 0.01
    order = torch.argsort(logits, descending=True)
    probs = torch.softmax(logits, -1)[order]
    nucleus_size = int((torch.cumsum(probs, 0) - probs < 0.5).sum())
    assert nucleus_size > 10 * NUCLEUS_CANDIDATES
    allowed = set(order[:nucleus_size].tolist())
    counts = draws(logits, SamplingParams(temperature=1.0, top_p=0.5), n=500)
    assert set(counts) <= allowed
    assert len(set(counts) - set(order[:NUCLEUS_CANDIDATES].tolist())) > 0  # drawn past the candidates


@pytest.mark.parametrize(
    "params", [SamplingParams(temperature=0.7, top_p=0.9, top_k=40), SamplingParams(temperature=1.3)]
)
def test_a_token_depends_only_on_seed_sample_and_position(params):
    logits = torch.randn(49_152, generator=torch.Generator().manual_seed(1))
    a = [sample_token(logits, params, 2, pos) for pos in range(50)]
    assert a == [sample_token(logits.clone(), params, 2, pos) for pos in range(50)]
    other_seed = SamplingParams(**{**params.__dict__, "seed": params.seed + 1})
    assert a != [sample_token(logits, other_seed, 2, pos) for pos in range(50)]


def test_never_draws_a_token_of_zero_probability():
    logits = torch.full((10,), -math.inf)
    logits[7] = 0.0
    assert set(draws(logits, SamplingParams(temperature=1.0), n=200)) == {7}
