"""RoPE frequencies of the Llama family: plain, linear and Llama 3 scaling, as one vector.

Pair i of a head (dims i and i + D/2 in the rotate-half form) turns at position p by

    angle(p, i) = p * theta^(-2i / D) / divisor[i]        i in [0, D/2)

Every scaling kvpool runs is a per-pair divisor of the plain inverse frequency:

    plain     divisor[i] = 1
    linear    divisor[i] = factor              (HF divides inv_freq by it; llama.cpp scales
                                                the positions by 1 / factor: the same angle)
    llama3    divisor[i] = 1       for a wavelength 2 pi / inv_freq[i] under L / high_freq_factor
                           factor  for one over L / low_freq_factor (L: the original context)
                           1 / ((1 - s) / factor + s) between, s = (L / wavelength - low) / (high - low)

A Llama 3.1+ GGUF carries these divisors precomputed, tensor `rope_freqs.weight` [D/2] (llama.cpp's
converter computes them from the config's rope_scaling with the formula above, in fp32);
a config.json names the parameters, and `llama3_divisors` computes them in fp64. YaRN,
dynamic NTK and LongRoPE are not divisors of this kind (they scale the attention or change
with the sequence length) and are refused where a model is read.
"""

from __future__ import annotations

import math

import torch
import xxhash


def inv_freq(head_dim: int, theta: float, divisors: tuple[float, ...] | None) -> torch.Tensor:
    """The inverse frequency of each rotated pair, fp64 [head_dim / 2]: theta^(-2i / D), each
    divided by its divisor (None: plain RoPE; a LlamaConfig's rope_freq_divisors, one a pair:
    LlamaConfig checks their count)."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim
    plain = 1.0 / (theta**exponents)
    if divisors is None:
        return plain
    return plain / torch.tensor(divisors, dtype=torch.float64)


def llama3_divisors(
    head_dim: int,
    theta: float,
    factor: float,
    low_freq_factor: float,
    high_freq_factor: float,
    original_max_position: int,
) -> tuple[float, ...]:
    """Llama 3.1's per-pair divisors (module docstring), fp64. The bands by wavelength:
    [0, L / high) kept | [L / high, L / low] blended | (L / low, inf) divided by factor."""
    low_wavelen = original_max_position / low_freq_factor  # longer waves than this: divided by factor
    high_wavelen = original_max_position / high_freq_factor  # shorter waves than this: kept
    divisors = []
    for freq in inv_freq(head_dim, theta, None).tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen or (wavelen == high_wavelen and high_freq_factor == low_freq_factor):
            divisors.append(1.0)  # (high == low: a step, no band; a wave exactly at its edge kept)
        elif wavelen > low_wavelen:
            divisors.append(factor)
        else:  # (high_freq_factor > low_freq_factor here)
            smooth = (original_max_position / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
            divisors.append(1.0 / ((1.0 - smooth) / factor + smooth))
    return tuple(divisors)


def rope_tables(
    head_dim: int, theta: float, divisors: tuple[float, ...] | None, max_position: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin_signed), fp64 [max_position, head_dim] each, rotate-half: the angles of the
    pairs repeated over both halves; sin_signed carries the rotate-half sign, [-sin | +sin]."""
    angles = torch.outer(torch.arange(max_position, dtype=torch.float64), inv_freq(head_dim, theta, divisors))
    emb = torch.cat([angles, angles], dim=-1)
    sin = emb.sin()
    sin[:, : head_dim // 2] = -sin[:, : head_dim // 2]
    return emb.cos(), sin


def rope_id(theta: float, divisors: tuple[float, ...] | None) -> str:
    """The RoPE's name in a cache descriptor: plain RoPE keeps the name it always had; a
    scaled one adds a digest of its divisors (K computed under one never serves the other)."""
    name = f"rope-half:theta{theta}"
    if divisors is None:
        return name
    return f"{name}:div{xxhash.xxh3_64_hexdigest(repr(tuple(float(d) for d in divisors)).encode())}"
