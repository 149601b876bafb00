"""The arithmetic of the KV storage formats of spec/kv_formats.py: quantize K and V chunks in
the paged layouts, and dequantize them back in the compute dtype.

Layouts (storage/kv.py): K is stored transposed per block, [..., head_dim, slots]; V as
[..., slots, head_dim]. The functions take a chunk of S slots in those layouts (S = the
schema's flush: 1 token, a block, or KIVI's R) and return its codes and scales:

  scale kind    K scale shape            V scale shape
  token         [..., S]                 [..., S]
  block         [..., 1]                 [..., 1]
  channel       [..., d, S / G]          -
  token-group   -                        [..., S, d / G]

Symmetric 8-bit (fp8, int8): s = amax / qmax over the scale's vector (a zero vector gets
s = 1), the value divided by s in fp32 and rounded to nearest even (fp8 saturating at
+-qmax, int8 clamped to [-127, 127]). Round-trip error: E4M3 |e| <= 2^-4 |x| for normal
values (|x| / s >= 2^-6) and <= 2^-10 s below; E5M2 2^-3 |x| (>= 2^-14 s) and 2^-17 s;
int8 <= s / 2. A vector holding a NaN or an inf gets s = NaN: it comes back NaN throughout,
never as finite numbers.

Asymmetric b-bit (KIVI): over each group, z = the minimum rounded down to fp16, s = (max -
z) / (2^b - 1) rounded up to fp16 (so the grid [z, z + (2^b - 1) s] covers the group), q =
round((x - z) / s) clamped to [0, 2^b - 1], x' = q s + z: |e| <= s / 2. Codes are packed
8 / b to a byte, the first in the low bits: K along slots, V along channels. Values
beyond fp16's range (65,504) saturate there.

fp16 (unscaled): a finite value past 65,504 saturates there too (a plain cast made it inf,
and attention over it NaN); an inf or a NaN is stored as it is. bf16 has fp32's range.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from kvpool.spec.kv_formats import KV_SCHEMAS, KVSchema, kv_schema

__all__ = ["KV_SCHEMAS", "KVSchema", "kv_schema", "Quantized", "code_dtype", "quantize", "dequantize", "round_trip"]

_ELEMENT = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
    "int8": torch.int8,
    "uint4": torch.uint8,
    "uint2": torch.uint8,
}


def code_dtype(schema: KVSchema) -> torch.dtype:
    """The dtype of the stored codes (packed KIVI codes: uint8)."""
    return _ELEMENT[schema.element]


def scale_dtype(schema: KVSchema) -> torch.dtype:
    return torch.float16 if schema.scale_dtype == "float16" else torch.float32


class Quantized(NamedTuple):
    codes: Tensor
    scale: Tensor | None
    zero: Tensor | None


# ---- per vector (the 8-bit and unscaled formats; tests and the eval use these) ---------


def quantize(schema: KVSchema, x: Tensor) -> tuple[Tensor, Tensor | None]:
    """x [..., n] (any float dtype) -> (codes [..., n], scales [...] fp32, or None unscaled):
    one symmetric scale per vector of the last dim."""
    if not schema.scaled:
        if schema.element == "float16" and x.dtype != torch.float16:
            # a finite value past fp16's range saturates at +-65,504 (as KIVI's codes do)
            # rather than becoming inf, which made attention NaN; an inf or NaN stays one.
            # (An fp16 input is within the range already: its K / V writes skip the 3 ops;
            # a lone clamp would saturate inf. A [1, 3, 64] write, one thread, `python -m timeit`
            # of quantize(kv_schema("fp16"), x): 10.9 us fp32 in, 1.22 us fp16 in, AMD EPYC.)
            x = torch.where(torch.isinf(x), x, x.clamp(-_F16_MAX, _F16_MAX))
        return x.to(code_dtype(schema)), None
    if schema.zero_point:
        raise ValueError(f"{schema.name} quantizes groups (quantize_k / quantize_v), not single vectors")
    x32 = x.to(torch.float32)
    scale = _sym_scale(schema, x32.abs().amax(dim=-1))
    return _sym_codes(schema, x32 / scale.unsqueeze(-1)), scale


def dequantize(schema: KVSchema, q: Tensor, scale: Tensor | None, dtype: torch.dtype) -> Tensor:
    """The inverse of `quantize` in `dtype`."""
    out = q.to(dtype)
    return out if scale is None else out * scale.to(dtype).unsqueeze(-1)


def round_trip(schema: KVSchema, x: Tensor) -> Tensor:
    """x quantized and dequantized in x's dtype (a per-vector schema)."""
    q, scale = quantize(schema, x)
    return dequantize(schema, q, scale, x.dtype)


def _sym_scale(schema: KVSchema, amax: Tensor) -> Tensor:
    return symmetric_scale(amax, schema.qmax)


def symmetric_scale(amax: Tensor, qmax: float) -> Tensor:
    """amax / qmax; 1 for a zero vector; NaN for a vector holding a NaN or an inf, so that
    every value under the scale comes back NaN, as attention over the exact values would be
    (a scale of 1 turned a NaN into int8 zeros, and left fp8's other values saturated)."""
    scale = amax / qmax
    # 1 also where amax / qmax underflows (amax below qmax x the smallest subnormal): a scale
    # of 0 made every 0 / 0 a NaN code; at 1 the codes are ~0, the error within amax
    scale = torch.where(scale > 0, scale, torch.ones_like(amax))
    return torch.where(torch.isfinite(amax), scale, torch.full_like(amax, torch.nan))


def _sym_codes(schema: KVSchema, y: Tensor) -> Tensor:
    if schema.element == "int8":
        return torch.round(y).clamp_(-127, 127).to(torch.int8)
    return y.clamp_(-schema.qmax, schema.qmax).to(code_dtype(schema))


# ---- asymmetric groups (KIVI) -----------------------------------------------------------

_F16_MAX = 65504.0


def _asym(schema: KVSchema, x: Tensor) -> Quantized:
    """x [..., G] fp32, one group per row -> codes [..., G] uint8 (unpacked), s and z [...] fp16."""
    levels = 2**schema.bits - 1
    lo = x.amin(dim=-1).clamp(-_F16_MAX, _F16_MAX)
    hi = x.amax(dim=-1).clamp(-_F16_MAX, _F16_MAX)
    z = lo.half()
    z = torch.where(z.float() > lo, torch.nextafter(z, torch.full_like(z, -torch.inf)), z)
    s_exact = (hi - z.float()) / levels
    s = s_exact.half()
    s = torch.where(s.float() < s_exact, torch.nextafter(s, torch.full_like(s, torch.inf)), s)
    s = torch.where(s > 0, s, torch.ones_like(s))  # a constant group: every code is 0
    q = torch.round((x.clamp(-_F16_MAX, _F16_MAX) - z.float().unsqueeze(-1)) / s.float().unsqueeze(-1))
    return Quantized(q.clamp_(0, levels).to(torch.uint8), s, z)


def _pack(codes: Tensor, bits: int) -> Tensor:
    """[..., n] uint8 codes < 2^bits -> [..., n * bits / 8], 8 / bits a byte, first lowest."""
    per = 8 // bits
    c = codes.view(*codes.shape[:-1], codes.shape[-1] // per, per).to(torch.int32)
    shifts = torch.arange(0, 8, bits, dtype=torch.int32, device=codes.device)
    return (c << shifts).sum(dim=-1).to(torch.uint8)


def _unpack(packed: Tensor, bits: int) -> Tensor:
    shifts = torch.arange(0, 8, bits, dtype=torch.int32, device=packed.device)
    c = (packed.to(torch.int32).unsqueeze(-1) >> shifts) & (2**bits - 1)
    return c.reshape(*packed.shape[:-1], packed.shape[-1] * (8 // bits))


# ---- chunks in the paged layouts ---------------------------------------------------------


def quantize_k(schema: KVSchema, kt: Tensor) -> Quantized:
    """K chunk kt [..., d, S] (S slots, transposed) -> codes in the K layout and its scales."""
    return _quantize_chunk(schema, schema.k_scale, kt, channel_dim=-2)


def quantize_v(schema: KVSchema, v: Tensor) -> Quantized:
    """V chunk v [..., S, d] -> codes in the V layout and its scales."""
    return _quantize_chunk(schema, schema.v_scale, v, channel_dim=-1)


def dequantize_k(schema: KVSchema, q: Quantized, dtype: torch.dtype) -> Tensor:
    """The inverse of `quantize_k`: [..., d, S] in `dtype`."""
    return _dequantize_chunk(schema, schema.k_scale, q, dtype, channel_dim=-2)


def dequantize_v(schema: KVSchema, q: Quantized, dtype: torch.dtype) -> Tensor:
    """The inverse of `quantize_v`: [..., S, d] in `dtype`."""
    return _dequantize_chunk(schema, schema.v_scale, q, dtype, channel_dim=-1)


# K and V chunks differ only in where the head dim lies (channel_dim: -2 in K^T [..., d, S],
# -1 in V [..., S, d]); the grouped kinds (K's "channel": each channel over groups of G slots;
# V's "token-group": each token over groups of G channels) both group the last axis.


def _quantize_chunk(schema: KVSchema, kind: str, x: Tensor, channel_dim: int) -> Quantized:
    if kind == "none":
        return Quantized(x.to(code_dtype(schema)), None, None)
    x = x.to(torch.float32)
    if kind == "token":
        scale = _sym_scale(schema, x.abs().amax(dim=channel_dim))  # [..., S]
        return Quantized(_sym_codes(schema, x / scale.unsqueeze(channel_dim)), scale, None)
    if kind == "block":
        scale = _sym_scale(schema, x.abs().amax(dim=(-2, -1))).unsqueeze(-1)  # [..., 1]
        return Quantized(_sym_codes(schema, x / scale.unsqueeze(-1)), scale, None)
    g = schema.group
    *lead, rows, cols = x.shape
    q = _asym(schema, x.reshape(*lead, rows, cols // g, g))
    return Quantized(_pack(q.codes.reshape(*lead, rows, cols), schema.bits), q.scale, q.zero)


def _dequantize_chunk(schema: KVSchema, kind: str, q: Quantized, dtype: torch.dtype, channel_dim: int) -> Tensor:
    if kind == "none":
        return q.codes.to(dtype)
    assert q.scale is not None
    if kind == "token":
        return q.codes.to(dtype) * q.scale.to(dtype).unsqueeze(channel_dim)
    if kind == "block":
        return q.codes.to(dtype) * q.scale.to(dtype).unsqueeze(-1)
    assert q.zero is not None
    codes = _unpack(q.codes, schema.bits)  # [..., rows, cols], the last axis grouped
    *lead, rows, cols = codes.shape
    g = schema.group
    grouped = codes.view(*lead, rows, cols // g, g).to(dtype)
    x = grouped * q.scale.to(dtype).unsqueeze(-1) + q.zero.to(dtype).unsqueeze(-1)
    return x.view(*lead, rows, cols)


def round_trip_kv(schema: KVSchema, k: Tensor, v: Tensor, block_size: int) -> tuple[Tensor, Tensor]:
    """What a sequence written from position 0, k and v [T, kv_heads, head_dim], is held as
    for the steps after (storage/kv.py): every whole chunk of the schema's flush quantized,
    the unfinished chunk's tokens in full precision; KIVI's V quantized but for its last R
    tokens (`value_window`). In k's dtype."""
    flush = schema.flush(block_size)
    t, kvh, d = k.shape
    if flush == 1:
        if not schema.scaled:
            return k.to(code_dtype(schema)).to(k.dtype), v.to(code_dtype(schema)).to(v.dtype)
        return round_trip(schema, k), round_trip(schema, v)
    whole = (t // flush) * flush
    kt = k[:whole].reshape(-1, flush, kvh, d).permute(0, 2, 3, 1)  # [chunks, kvh, d, flush]
    kq = dequantize_k(schema, quantize_k(schema, kt), k.dtype).permute(0, 3, 1, 2).reshape(whole, kvh, d)
    if schema.value_window:  # V a token at a time, its last R exact
        whole = max(0, t - schema.value_window)
        vt = v[:whole].transpose(0, 1)  # [kvh, tokens, d]
        vq = dequantize_v(schema, quantize_v(schema, vt), v.dtype).transpose(0, 1)
    else:
        vt = v[:whole].reshape(-1, flush, kvh, d).transpose(1, 2)  # [chunks, kvh, flush, d]
        vq = dequantize_v(schema, quantize_v(schema, vt), v.dtype).transpose(1, 2).reshape(whole, kvh, d)
    return torch.cat([kq, k[kq.shape[0] :]]), torch.cat([vq, v[whole:]])


# ---- DeepSeek-V4's serving layout (spec/dsv4.py main_entry_bytes / indexer_key_bytes) ----
#
# A main entry (SWA, CSA, HCA): the non-RoPE dims as FP8 E4M3 with one power-of-two scale
# per 64 of them, stored as its exponent byte (UE8M0: 2^(e - 127)), the scale bytes padded
# to 8; the RoPE dims (the last rope_dim) as BF16. An indexer key: FP8 E4M3 with one fp32
# scale per 128 dims, or MXFP4: FP4 E2M1 codes (0, 0.5, 1, 1.5, 2, 3, 4, 6, and their
# negatives), two a byte, one UE8M0 scale per 32 dims. Power-of-two scales divide exactly:
# the only rounding is the element's. Scales are the smallest power of two that keeps the
# group's amax within the element's range (no saturation): E4M3 |e| <= 2^-4 |x| for
# |x| >= 2^-6 s and <= 2^-10 s below; E2M1 |e| <= s / 4 below 2 s, s / 2 below 4 s, s at
# most (half the grid's step), ties to the smaller magnitude. A group holding a NaN or an
# inf gets the scale byte 0xFF, UE8M0's NaN (OCP MX), and comes back NaN throughout: no
# power-of-two scale describes it (the exponent clamped at 2^-127 made every value tiny).

E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
UE8M0_BIAS = 127
UE8M0_NAN = 0xFF


def _pow2_exponent(v: Tensor) -> Tensor:
    """The smallest e with 2^e >= v (v > 0), int32; 0 where v == 0 or v is not finite."""
    v = torch.where(torch.isfinite(v), v, torch.zeros_like(v))
    e = torch.ceil(torch.log2(torch.where(v > 0, v, torch.ones_like(v)))).to(torch.int32)
    p = torch.ldexp(torch.ones_like(v), e)
    e = torch.where(p < v, e + 1, e)  # log2 rounded the wrong way
    e = torch.where(torch.ldexp(torch.ones_like(v), e - 1) >= v, e - 1, e)
    return torch.where(v > 0, e, torch.zeros_like(e)).clamp_(-UE8M0_BIAS, UE8M0_BIAS)


def _groups(x: Tensor, group: int) -> Tensor:
    """x [..., n] -> [..., ceil(n / group), group], zero-padded."""
    n = x.shape[-1]
    pad = -n % group
    if pad:
        x = torch.nn.functional.pad(x, (0, pad))
    return x.reshape(*x.shape[:-1], (n + pad) // group, group)


def quantize_fp8_ue8m0(x: Tensor, group: int = 64) -> tuple[Tensor, Tensor]:
    """x [..., n] -> (E4M3 codes [..., n] as uint8, exponent bytes [..., ceil(n / group)])."""
    g = _groups(x.to(torch.float32), group)
    amax = g.abs().amax(dim=-1)
    e = _pow2_exponent(amax / 448.0)
    y = torch.ldexp(g, -e.unsqueeze(-1)).clamp_(-448.0, 448.0)  # exact: a power of two
    codes = y.to(torch.float8_e4m3fn).view(torch.uint8).reshape(*x.shape[:-1], g.shape[-2] * group)[..., : x.shape[-1]]
    return codes.contiguous(), _scale_bytes(e, amax)


def _scale_bytes(e: Tensor, amax: Tensor) -> Tensor:
    """UE8M0 bytes of the exponents e, UE8M0_NAN where a group's amax is not finite."""
    return torch.where(torch.isfinite(amax), e + UE8M0_BIAS, UE8M0_NAN).to(torch.uint8)


def _scaled(g: Tensor, exps: Tensor) -> Tensor:
    """g [..., groups, group] times 2^(exps - bias) per group; NaN under UE8M0_NAN."""
    # the NaN on the per-group scale, not a pass over every value (ldexp is x * 2^e: the same
    # bits for the finite groups)
    e = exps[..., : g.shape[-2]]
    scale = torch.pow(2.0, e.to(torch.int32) - UE8M0_BIAS).masked_fill_(e == UE8M0_NAN, torch.nan)
    return g * scale.unsqueeze(-1)


def dequantize_fp8_ue8m0(codes: Tensor, exps: Tensor, dtype: torch.dtype, group: int = 64) -> Tensor:
    n = codes.shape[-1]
    g = _groups(codes.view(torch.float8_e4m3fn).to(torch.float32), group)
    return _scaled(g, exps).reshape(*codes.shape[:-1], g.shape[-2] * group)[..., :n].to(dtype)


def quantize_mxfp4(x: Tensor) -> tuple[Tensor, Tensor]:
    """x [..., n] (n even) -> (E2M1 codes packed two a byte [..., n / 2], exponent bytes
    [..., ceil(n / 32)]); code = sign << 3 | grid index, the first of a pair in the low bits."""
    g = _groups(x.to(torch.float32), 32)
    amax = g.abs().amax(dim=-1)
    e = _pow2_exponent(amax / 6.0)
    y = torch.ldexp(g, -e.unsqueeze(-1))
    grid = torch.tensor(E2M1_GRID, device=x.device)
    mids = (grid[1:] + grid[:-1]) / 2
    index = torch.bucketize(y.abs().clamp_(max=6.0), mids)  # ties to the smaller magnitude
    codes = (index | ((y < 0).to(torch.int64) << 3)).reshape(*x.shape[:-1], g.shape[-2] * 32)[..., : x.shape[-1]]
    return _pack(codes.to(torch.uint8).contiguous(), 4), _scale_bytes(e, amax)


def dequantize_mxfp4(packed: Tensor, exps: Tensor, dtype: torch.dtype) -> Tensor:
    codes = _unpack(packed, 4)  # [..., n]
    n = codes.shape[-1]
    grid = torch.tensor(E2M1_GRID, device=packed.device)
    y = grid[codes & 7] * torch.where(codes >= 8, -1.0, 1.0)
    g = _groups(y, 32)
    return _scaled(g, exps).reshape(*packed.shape[:-1], g.shape[-2] * 32)[..., :n].to(dtype)
