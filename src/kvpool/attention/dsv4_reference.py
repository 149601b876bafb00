"""The contiguous oracle of one DeepSeek-V4 attention layer: the full token history, no cache.

Every quantity is recomputed from all T tokens, straight from the definitions of
DEEPSEEK_V4.md: the compressor pools every complete block (overlap rows for m = 4, block 0's
missing previous rows at score -inf / value 0, RoPE at the block's first token), the
indexer scores every visible CSA entry and keeps a stable top-k (ties -> lower index),
entry j is visible to query t iff j < (t + 1) // ratio, the window is
max(0, t - n_win + 1) .. t, and one softmax with the sink in the denominator runs over
window tokens and compressed entries together. No state, no pools, no block tables: the
paged path (`dsv4_paged.py`) must reproduce these outputs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from kvpool.attention.dsv4_ops import (
    DSV4AttnWeights,
    TokenProjections,
    indexer_scores,
    layer_rope_freqs,
    output_projection,
    overlap_rows,
    pool_entries,
    project_tokens,
    sink_attention,
    stable_topk,
)
from kvpool.spec.dsv4 import CSA_RATIO, DSV4Spec


def compress_all_blocks(
    kv: Tensor, score: Tensor, ratio: int, width: int, norm_weight: Tensor, eps: float, freqs: Tensor
) -> Tensor:
    """Entries of every complete block of a contiguous history.

    kv / score: [T, coff*width] compressor projections (score already includes ape).
    Returns [T // ratio, width]: entry i pools tokens i*ratio .. i*ratio + ratio - 1 (and, with
    overlap, the [0:width] half of the previous block's rows).
    """
    num_blocks = kv.shape[0] // ratio
    if num_blocks == 0:
        return kv.new_zeros(0, width)
    cur_kv = kv[: num_blocks * ratio].view(num_blocks, ratio, -1)
    cur_score = score[: num_blocks * ratio].view(num_blocks, ratio, -1)
    if ratio == CSA_RATIO:
        # Block i's "previous block" rows are block i-1's; block 0 has none (score -inf, value 0).
        prev_kv = torch.cat((torch.zeros_like(cur_kv[:1]), cur_kv[:-1]))
        prev_score = torch.cat((torch.full_like(cur_score[:1], float("-inf")), cur_score[:-1]))
        kv_rows, score_rows = overlap_rows(prev_kv, cur_kv, prev_score, cur_score, width)
    else:
        kv_rows, score_rows = cur_kv, cur_score
    first_positions = torch.arange(num_blocks) * ratio
    return pool_entries(kv_rows, score_rows, norm_weight, eps, first_positions, freqs)


def reference_attention(spec: DSV4Spec, layer_id: int, w: DSV4AttnWeights, x: Tensor) -> Tensor:
    """One V4 attention layer over a whole sequence. x: [T, hidden] (normed layer input,
    positions 0..T-1). Returns [T, hidden] (after the grouped output projection)."""
    num_tokens = x.shape[0]
    ratio = spec.layer_ratios[layer_id]
    freqs = layer_rope_freqs(spec, ratio)
    positions = torch.arange(num_tokens)
    p = project_tokens(spec, ratio, w, x, positions, freqs)

    # Window: key s is visible to query t iff t - n_win < s <= t.
    t_col = positions[:, None]
    s_row = positions[None, :]
    keys = p.kv  # [T, d]
    valid = (s_row <= t_col) & (s_row > t_col - spec.window)  # [T, T]

    if ratio:
        c = w.compressor
        assert c is not None and p.comp_kv is not None and p.comp_score is not None
        entries = compress_all_blocks(p.comp_kv, p.comp_score, ratio, spec.head_dim, c.norm, spec.rms_norm_eps, freqs)
        num_entries = entries.shape[0]
        num_visible = (positions + 1) // ratio  # [T]: entry j visible iff j < (t + 1) // ratio
        entry_valid = torch.arange(num_entries)[None, :] < num_visible[:, None]  # [T, E]
        if ratio == CSA_RATIO and num_entries:
            assert p.idx_q is not None and p.idx_w is not None
            scores = indexer_scores(p.idx_q, p.idx_w, _indexer_keys(spec, w, p, freqs))  # [T, E]
            top, top_valid = stable_topk(scores, num_visible, spec.index_topk)
            selected = torch.zeros(num_tokens, num_entries, dtype=torch.bool)
            rows = torch.arange(num_tokens)[:, None].expand_as(top)
            selected[rows[top_valid], top[top_valid]] = True
            entry_valid = entry_valid & selected
        keys = torch.cat((keys, entries))
        valid = torch.cat((valid, entry_valid), dim=1)

    o = sink_attention(p.q, keys, valid, w.attn_sink, spec.head_dim**-0.5)
    return output_projection(spec, w, o, positions, freqs)


def _indexer_keys(spec: DSV4Spec, w: DSV4AttnWeights, p: TokenProjections, freqs: Tensor) -> Tensor:
    """The CSA layer's indexer keys, one per complete block: [T // 4, index_head_dim]."""
    ix = w.indexer
    assert ix is not None and p.idx_kv is not None and p.idx_score is not None
    return compress_all_blocks(
        p.idx_kv, p.idx_score, CSA_RATIO, spec.index_head_dim, ix.compressor.norm, spec.rms_norm_eps, freqs
    )


@dataclass(frozen=True)
class IndexerTrace:
    """What the oracle's Lightning Indexer computed at one CSA layer, for checks of how close
    its top-k selection is to a tie. dots [T, H, E]: q_idx[t, h] . k_idx[s] before the relu;
    scores [T, E]: I[t, s] (the values stable_topk ranks); num_visible [T]: entries
    [0, num_visible[t]) are visible to query t."""

    layer_id: int
    dots: Tensor
    scores: Tensor
    num_visible: Tensor


def reference_indexer(spec: DSV4Spec, layer_id: int, w: DSV4AttnWeights, x: Tensor) -> IndexerTrace:
    """The indexer of CSA layer `layer_id` over a whole sequence (x as in reference_attention),
    computed exactly as `reference_attention` computes it."""
    if spec.layer_ratios[layer_id] != CSA_RATIO:
        raise ValueError(f"layer {layer_id} is not a CSA layer (ratio {spec.layer_ratios[layer_id]})")
    freqs = layer_rope_freqs(spec, CSA_RATIO)
    positions = torch.arange(x.shape[0])
    p = project_tokens(spec, CSA_RATIO, w, x, positions, freqs)
    assert p.idx_q is not None and p.idx_w is not None
    keys = _indexer_keys(spec, w, p, freqs)
    return IndexerTrace(
        layer_id,
        torch.einsum("nhd,ed->nhe", p.idx_q, keys),
        indexer_scores(p.idx_q, p.idx_w, keys),
        (positions + 1) // CSA_RATIO,
    )
