"""DeepSeek-V4 attention building blocks, shared by the oracle and the paged path.

Only the position-free math lives here (norms, RoPE, the per-channel softmax pooling of a
compressor, the indexer's scores and stable top-k, the sink softmax, the grouped output
projection). WHICH rows, entries and window positions a query uses is decided separately
by the contiguous oracle (`dsv4_reference.py`, from the full history) and by the paged
path (`dsv4_paged.py`, from the Classical and State pools); agreement of those two is what
the tests prove. Formulas: shared/design/DEEPSEEK_V4.md sections 2-4.

Weights use the official parameter names and the `[out, in]` layout of nn.Linear, so a
reference state dict loads by name (`DSV4AttnWeights.from_state_dict`). Exact mode: the
FP8 / FP4 fake quantization and the indexer's Hadamard rotation of the official code are
off (the rotation is orthogonal, so it leaves q . k unchanged up to rounding anyway).

Every op computes in the dtype of its inputs, fp32 (the model's mode) or fp64 (the
verification mode: rounding ~1e-16 instead of ~1e-7, so a single value read from a wrong
slot stands out by many orders of magnitude); one call never mixes the two. RoPE angles are
always computed in fp64 and cast.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
from torch import Tensor

from kvpool.spec.dsv4 import CSA_RATIO, DSV4Spec, YarnScaling

# ----- norms -------------------------------------------------------------------------


def rms_norm(x: Tensor, weight: Tensor | None, eps: float) -> Tensor:
    """RMSNorm over the last dim. x: [..., d] fp32 / fp64; weight: [d] (x's dtype) or None (no weight)."""
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return y * weight if weight is not None else y


# ----- RoPE (interleaved pairs, on the LAST rope_dim dims) -----------------------------


def rope_freqs(rope_dim: int, theta: float, yarn: YarnScaling | None) -> Tensor:
    """Per-pair angular frequencies [rope_dim // 2] (fp64), YaRN-scaled when `yarn` is set.

    YaRN here scales frequencies only (unit magnitude, no attention-scale factor): pairs that
    rotate fewer than beta_slow times over the original context are divided by `factor`,
    pairs that rotate more than beta_fast times are kept, and a linear ramp blends between.
    """
    freqs = 1.0 / (theta ** (torch.arange(0, rope_dim, 2, dtype=torch.float64) / rope_dim))
    if yarn is None:
        return freqs

    def correction_dim(num_rotations: float) -> float:
        return (
            rope_dim
            * math.log(yarn.original_max_position_embeddings / (num_rotations * 2 * math.pi))
            / (2 * math.log(theta))
        )

    low = max(math.floor(correction_dim(yarn.beta_fast)), 0)
    high = min(math.ceil(correction_dim(yarn.beta_slow)), rope_dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = ((torch.arange(rope_dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    smooth = 1 - ramp  # 1: keep the frequency, 0: interpolate it by `factor`
    return freqs / yarn.factor * (1 - smooth) + freqs * smooth


@functools.lru_cache(maxsize=64)
def layer_rope_freqs(spec: DSV4Spec, ratio: int) -> Tensor:
    """Ratio-0 layers: rope_theta, no YaRN. Compressed layers: compress_rope_theta + YaRN.
    Cached per (spec, ratio); callers must not modify the returned tensor."""
    if ratio == 0:
        return rope_freqs(spec.rope_head_dim, spec.rope_theta, None)
    return rope_freqs(spec.rope_head_dim, spec.compress_rope_theta, spec.yarn)


def apply_rope(x: Tensor, positions: Tensor, freqs: Tensor, inverse: bool = False) -> Tensor:
    """Rotate the last 2 * len(freqs) dims of x by position * freq, pairs (2i, 2i+1) (GPT-J).

    x: [n, ..., d] fp32 / fp64; positions: [n] int64 (one position per leading row); freqs:
    [rope_dim // 2] fp64 (cos / sin are cast to x's dtype). `inverse` rotates by minus the
    position. Returns a new tensor of x's dtype.
    """
    rope_dim = 2 * freqs.numel()
    angles = positions.to(torch.float64)[:, None] * freqs[None, :]  # [n, rope_dim/2]
    cos = torch.cos(angles).to(x.dtype)
    sin = torch.sin(angles).to(x.dtype)
    if inverse:
        sin = -sin
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (rope_dim // 2,)
    cos, sin = cos.view(shape), sin.view(shape)
    pairs = x[..., -rope_dim:].unflatten(-1, (rope_dim // 2, 2))
    x0, x1 = pairs[..., 0], pairs[..., 1]
    rotated = torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1).flatten(-2)
    return torch.cat((x[..., :-rope_dim], rotated), dim=-1)


# ----- weights -------------------------------------------------------------------------


@dataclass(frozen=True)
class CompressorWeights:
    """`compressor.{wkv, wgate, ape, norm}`: wkv / wgate [coff*d, hidden], ape [ratio, coff*d], norm [d]."""

    wkv: Tensor
    wgate: Tensor
    ape: Tensor
    norm: Tensor


@dataclass(frozen=True)
class IndexerWeights:
    """`indexer.{wq_b, weights_proj}` + `indexer.compressor`: wq_b [n_idx_heads*idx_dim, q_lora],
    weights_proj [n_idx_heads, hidden]."""

    wq_b: Tensor
    weights_proj: Tensor
    compressor: CompressorWeights


@dataclass(frozen=True)
class DSV4AttnWeights:
    """One V4 attention layer's weights, official names, [out, in] layout, all in one dtype
    (fp32, or fp64 for verification).

    wq_a [q_lora, hidden], q_norm [q_lora], wq_b [heads*d, q_lora], wkv [d, hidden],
    kv_norm [d], wo_a [o_groups*o_lora, heads*d/o_groups], wo_b [hidden, o_groups*o_lora],
    attn_sink [heads]; compressor on compressed layers, indexer on CSA layers.
    """

    wq_a: Tensor
    q_norm: Tensor
    wq_b: Tensor
    wkv: Tensor
    kv_norm: Tensor
    wo_a: Tensor
    wo_b: Tensor
    attn_sink: Tensor
    compressor: CompressorWeights | None = None
    indexer: IndexerWeights | None = None

    @classmethod
    def from_state_dict(
        cls, sd: dict[str, Tensor], prefix: str, ratio: int, dtype: torch.dtype = torch.float32
    ) -> DSV4AttnWeights:
        """Read `prefix + "wq_a.weight"` etc., cast to `dtype`; KeyError names a missing parameter."""

        def get(name: str) -> Tensor:
            key = prefix + name
            if key not in sd:
                raise KeyError(f"missing parameter {key!r}")
            return sd[key].to(dtype)

        def compressor(p: str) -> CompressorWeights:
            return CompressorWeights(
                get(p + "wkv.weight"), get(p + "wgate.weight"), get(p + "ape"), get(p + "norm.weight")
            )

        return cls(
            wq_a=get("wq_a.weight"),
            q_norm=get("q_norm.weight"),
            wq_b=get("wq_b.weight"),
            wkv=get("wkv.weight"),
            kv_norm=get("kv_norm.weight"),
            wo_a=get("wo_a.weight"),
            wo_b=get("wo_b.weight"),
            attn_sink=get("attn_sink"),
            compressor=compressor("compressor.") if ratio else None,
            indexer=IndexerWeights(
                get("indexer.wq_b.weight"), get("indexer.weights_proj.weight"), compressor("indexer.compressor.")
            )
            if ratio == CSA_RATIO
            else None,
        )


def init_attn_state_dict(spec: DSV4Spec, layer_id: int, prefix: str, gen: torch.Generator) -> dict[str, Tensor]:
    """Seeded random weights for one layer, official names, fp64 (a caller casts them, so an
    fp32 and an fp64 model from one seed hold the same weights up to rounding); scaled so
    activations stay O(1)."""
    ratio = spec.layer_ratios[layer_id]
    d, h, hid = spec.head_dim, spec.num_heads, spec.hidden_size

    def randn(*shape: int) -> Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    def lin(out_features: int, in_features: int) -> Tensor:
        return randn(out_features, in_features) / math.sqrt(in_features)

    def norm(n: int) -> Tensor:
        return 1.0 + 0.1 * randn(n)

    sd: dict[str, Tensor] = {
        "wq_a.weight": lin(spec.q_lora_rank, hid),
        "q_norm.weight": norm(spec.q_lora_rank),
        "wq_b.weight": lin(h * d, spec.q_lora_rank),
        "wkv.weight": lin(d, hid),
        "kv_norm.weight": norm(d),
        "wo_a.weight": lin(spec.o_groups * spec.o_lora_rank, h * d // spec.o_groups),
        "wo_b.weight": lin(hid, spec.o_groups * spec.o_lora_rank),
        "attn_sink": randn(h),
    }
    if ratio:
        coff = spec.coff(ratio)
        sd.update(
            {
                "compressor.wkv.weight": lin(coff * d, hid),
                "compressor.wgate.weight": lin(coff * d, hid),
                "compressor.ape": randn(ratio, coff * d),
                "compressor.norm.weight": norm(d),
            }
        )
    if ratio == CSA_RATIO:
        di = spec.index_head_dim
        sd.update(
            {
                "indexer.wq_b.weight": lin(spec.index_n_heads * di, spec.q_lora_rank),
                "indexer.weights_proj.weight": lin(spec.index_n_heads, hid),
                "indexer.compressor.wkv.weight": lin(2 * di, hid),
                "indexer.compressor.wgate.weight": lin(2 * di, hid),
                "indexer.compressor.ape": randn(CSA_RATIO, 2 * di),
                "indexer.compressor.norm.weight": norm(di),
            }
        )
    return {prefix + k: v for k, v in sd.items()}


# ----- per-token projections ----------------------------------------------------------


@dataclass(frozen=True)
class TokenProjections:
    """Everything one layer computes per token, before any cross-token mixing.

    q [n, heads, d] (head-RMSNormed, RoPE'd); kv [n, d] (normed, RoPE'd);
    comp_kv / comp_score [n, coff*d] (score includes ape[pos % ratio]); idx_q
    [n, idx_heads, idx_dim] (RoPE'd); idx_w [n, idx_heads]; idx_kv / idx_score [n, 2*idx_dim].
    Fields a layer kind does not have are None.
    """

    q: Tensor
    kv: Tensor
    comp_kv: Tensor | None
    comp_score: Tensor | None
    idx_q: Tensor | None
    idx_w: Tensor | None
    idx_kv: Tensor | None
    idx_score: Tensor | None


def project_tokens(
    spec: DSV4Spec, ratio: int, w: DSV4AttnWeights, x: Tensor, positions: Tensor, freqs: Tensor
) -> TokenProjections:
    """x: [n, hidden] in the weights' dtype (the layer's normed input); positions: [n] int64."""
    n = x.shape[0]
    eps = spec.rms_norm_eps
    qr = rms_norm(x @ w.wq_a.T, w.q_norm, eps)  # [n, q_lora]
    q = (qr @ w.wq_b.T).view(n, spec.num_heads, spec.head_dim)
    q = apply_rope(rms_norm(q, None, eps), positions, freqs)  # per-head RMSNorm without weight
    kv = apply_rope(rms_norm(x @ w.wkv.T, w.kv_norm, eps), positions, freqs)  # [n, d]
    comp_kv = comp_score = idx_q = idx_w = idx_kv = idx_score = None
    if ratio:
        c = w.compressor
        assert c is not None
        comp_kv = x @ c.wkv.T  # [n, coff*d]
        comp_score = x @ c.wgate.T + c.ape[positions % ratio]
    if ratio == CSA_RATIO:
        ix = w.indexer
        assert ix is not None
        idx_q = (qr @ ix.wq_b.T).view(n, spec.index_n_heads, spec.index_head_dim)
        idx_q = apply_rope(idx_q, positions, freqs)
        idx_w = (x @ ix.weights_proj.T) * (spec.index_head_dim**-0.5 * spec.index_n_heads**-0.5)
        idx_kv = x @ ix.compressor.wkv.T  # [n, 2*idx_dim]
        idx_score = x @ ix.compressor.wgate.T + ix.compressor.ape[positions % CSA_RATIO]
    return TokenProjections(q, kv, comp_kv, comp_score, idx_q, idx_w, idx_kv, idx_score)


# ----- compressor pooling --------------------------------------------------------------


def pool_entries(
    kv_rows: Tensor, score_rows: Tensor, norm_weight: Tensor, eps: float, first_positions: Tensor, freqs: Tensor
) -> Tensor:
    """Pool blocks of rows into entries: per-channel softmax over rows, weighted sum, RMSNorm,
    RoPE at the block's first token. kv_rows / score_rows: [num_blocks, rows, d] (score
    -inf and kv 0 for the missing previous block of block 0); first_positions: [num_blocks].
    Returns [num_blocks, d]."""
    weights = torch.softmax(score_rows, dim=1)
    entries = (weights * kv_rows).sum(dim=1)
    return apply_rope(rms_norm(entries, norm_weight, eps), first_positions, freqs)


def overlap_rows(
    prev_kv: Tensor, cur_kv: Tensor, prev_score: Tensor, cur_score: Tensor, d: int
) -> tuple[Tensor, Tensor]:
    """The 2m pooled rows of overlapping blocks: previous block's [0:d] half, current block's [d:2d].

    prev_* / cur_*: [num_blocks, m, 2d]. Returns (kv_rows, score_rows), each [num_blocks, 2m, d].
    """
    kv_rows = torch.cat((prev_kv[..., :d], cur_kv[..., d:]), dim=1)
    score_rows = torch.cat((prev_score[..., :d], cur_score[..., d:]), dim=1)
    return kv_rows, score_rows


# ----- indexer --------------------------------------------------------------------------


def indexer_scores(idx_q: Tensor, idx_w: Tensor, keys: Tensor) -> Tensor:
    """I[t, s] = sum_h w[t, h] * relu(q[t, h] . k[s]). idx_q [n, H, di], idx_w [n, H],
    keys [E, di] -> [n, E] in their dtype (visibility is the caller's mask)."""
    dots = torch.einsum("nhd,ed->nhe", idx_q, keys).clamp_min(0)
    return torch.einsum("nhe,nh->ne", dots, idx_w)


def stable_topk(scores: Tensor, num_visible: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """Top-k visible entries per row, ties broken by the lower entry index.

    scores: [n, E] float; num_visible: [n] int64 (entries [0, num_visible) are visible).
    Returns (indices [n, k'], valid [n, k'] bool) with k' = min(k, E): row i keeps its first
    min(k, num_visible[i]) indices of a stable descending sort over its visible entries.
    """
    n, num_entries = scores.shape
    cols = torch.arange(num_entries)
    masked = scores.masked_fill(cols[None, :] >= num_visible[:, None], float("-inf"))
    order = torch.sort(masked, dim=-1, descending=True, stable=True).indices
    kk = min(k, num_entries)
    indices = order[:, :kk]
    valid = torch.arange(kk)[None, :] < torch.clamp(num_visible, max=k)[:, None]
    return indices, valid


# ----- the one softmax with the sink ---------------------------------------------------


def sink_attention(q: Tensor, keys: Tensor, valid: Tensor, sink: Tensor, scale: float) -> Tensor:
    """p_j = exp(z_j) / (sum_k exp(z_k) + exp(sink_h)); out = sum_j p_j * kv_j (K = V).

    q: [n, H, d]; keys: [n, K, d] (each query's own key list) or [K, d] (one list shared
    by all queries, masked per query); valid: [n, K] bool; sink: [H]. Returns [n, H, d]
    in q's dtype. A query with no valid key returns 0.
    """
    shared = keys.dim() == 2
    z = torch.einsum("nhd,kd->nhk" if shared else "nhd,nkd->nhk", q, keys) * scale
    z = z.masked_fill(~valid[:, None, :], float("-inf"))
    sink_b = sink.view(1, -1, 1).expand(z.shape[0], -1, 1)
    m = torch.maximum(z.amax(dim=-1, keepdim=True), sink_b)  # the sink keeps m finite
    e = torch.exp(z - m)
    denom = e.sum(dim=-1, keepdim=True) + torch.exp(sink_b - m)
    probs = e / denom  # exactly 0 where not valid
    if math.isfinite(keys.sum(dtype=torch.float64 if keys.dtype == torch.float64 else torch.float32).item()):
        return torch.einsum("nhk,kd->nhd" if shared else "nhk,nkd->nhd", probs, keys)
    # A NaN or inf key (or a sum past fp32's range): 0 * NaN is NaN, so the weighted sum
    # would carry it to the queries that do not see it (a later key of the chunk, an
    # invalid entry of a query's list). Each query sums over its valid keys alone.
    if not shared:
        return torch.einsum("nhk,nkd->nhd", probs, keys.masked_fill(~valid[:, :, None], 0.0))
    return torch.stack([probs[i][:, ok] @ keys[ok] for i, ok in enumerate(valid)])


def output_projection(spec: DSV4Spec, w: DSV4AttnWeights, o: Tensor, positions: Tensor, freqs: Tensor) -> Tensor:
    """Inverse RoPE on o[..., -rope:], then the grouped projection. o: [n, H, d] -> [n, hidden]."""
    n = o.shape[0]
    o = apply_rope(o, positions, freqs, inverse=True)
    g = spec.o_groups
    o = o.reshape(n, g, spec.num_heads // g * spec.head_dim)  # heads split into o_groups groups
    wo_a = w.wo_a.view(g, spec.o_lora_rank, -1)  # each group's own slice of wo_a
    o = torch.einsum("ngd,grd->ngr", o, wo_a)
    return o.flatten(1) @ w.wo_b.T
