"""KV-cache storage formats: what a stored K or V element is, where its scale lives, and the
round trip (quantize at write, dequantize at read).

Each format is a named schema that the cache descriptor carries (its name is part of the
layout id), so a block written in one format never serves a reader of another.

  format      element             scale (fp32)                       round-trip error (theory)
  fp32        float32             none                               0
  bf16        bfloat16            none                               |e| <= 2^-8 |x|   (8-bit significand)
  fp16        float16             none                               |e| <= 2^-11 |x|  (normal range)
  fp8_e4m3    float8 E4M3 (1 B)   one per (token, KV head)           |e| <= 2^-4 |x| for normal values,
                                                                     <= 2^-10 s below 2^-6 s (subnormal)
  fp8_e5m2    float8 E5M2 (1 B)   one per (token, KV head)           |e| <= 2^-3 |x|, <= 2^-17 s subnormal
  int8        int8, symmetric     one per (token, KV head)           |e| <= s / 2

Scales: s = amax / qmax over the head's head_dim values of one token (qmax 448 for E4M3,
57,344 for E5M2, 127 for int8), computed when the token is written and never updated: a
token's bytes depend on that token alone, whatever was written before or after it, so a
block's content is the same in any engine and any chunking (prefix reuse and the contiguous
reference see the same bytes). A zero vector gets s = 1 (any scale holds zeros exactly).
Values are divided by s in fp32 and rounded to nearest even (fp8: saturating at +-qmax;
int8: clamped to [-127, 127]); a read multiplies back in the reader's dtype. The cost is
4 bytes of scale per token and KV head for K and again for V (head_dim 64: 6 %).

Per-(block, head) FP8 scales and KIVI's 2 / 4-bit groups need a rule for blocks written a
token at a time (a full-precision tail until the block or group fills); they are not here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class KVFormat:
    name: str
    dtype: torch.dtype  # the stored element
    qmax: float = 0.0  # scaled formats: the largest magnitude an element holds (0: unscaled)

    @property
    def scaled(self) -> bool:
        return self.qmax > 0

    @property
    def element_bytes(self) -> int:
        return torch.empty(0, dtype=self.dtype).element_size()

    def bytes_per_token_head(self, head_dim: int) -> int:
        """One token's K (or V) of one KV head: its elements and its scale."""
        return head_dim * self.element_bytes + (4 if self.scaled else 0)


KV_FORMATS: dict[str, KVFormat] = {
    f.name: f
    for f in (
        KVFormat("fp32", torch.float32),
        KVFormat("bf16", torch.bfloat16),
        KVFormat("fp16", torch.float16),
        KVFormat("fp8_e4m3", torch.float8_e4m3fn, 448.0),
        KVFormat("fp8_e5m2", torch.float8_e5m2, 57344.0),
        KVFormat("int8", torch.int8, 127.0),
    )
}


def kv_format(name: str) -> KVFormat:
    """The format called `name`; ValueError naming the known ones otherwise."""
    try:
        return KV_FORMATS[name]
    except KeyError:
        raise ValueError(f"unknown KV format {name!r}; one of {', '.join(KV_FORMATS)}") from None


def quantize(fmt: KVFormat, x: Tensor) -> tuple[Tensor, Tensor | None]:
    """x [..., head_dim] (any float dtype) -> (elements [..., head_dim] in fmt.dtype, scales
    [...] fp32, or None for an unscaled format). One scale per vector of the last dim."""
    if not fmt.scaled:
        return x.to(fmt.dtype), None
    x32 = x.to(torch.float32)
    amax = x32.abs().amax(dim=-1)
    scale = torch.where(amax > 0, amax / fmt.qmax, torch.ones_like(amax))
    y = x32 / scale.unsqueeze(-1)
    if fmt.dtype == torch.int8:
        return torch.round(y).clamp_(-127, 127).to(torch.int8), scale
    return y.clamp_(-fmt.qmax, fmt.qmax).to(fmt.dtype), scale


def dequantize(fmt: KVFormat, q: Tensor, scale: Tensor | None, dtype: torch.dtype) -> Tensor:
    """The inverse of `quantize` in `dtype`: q [..., head_dim], scale [...] (None: unscaled)."""
    out = q.to(dtype)
    return out if scale is None else out * scale.to(dtype).unsqueeze(-1)


def round_trip(fmt: KVFormat, x: Tensor) -> Tensor:
    """x quantized and dequantized in x's dtype: what a reader of the stored bytes sees."""
    q, scale = quantize(fmt, x)
    return dequantize(fmt, q, scale, x.dtype)
