"""V4 sparse attention on the Classical + State pools: prefill, chunked prefill and decode.

One call processes a batch of chunks (decode is a chunk of one token). Per request and
layer, for a chunk of positions [L0, L1):

  history:  [0, q*span)           complete spans: entries in the Classical pool (block table)
            [q*span, B0*ratio)    complete entries of the unfinished span: state tail entries
            [B0*ratio, L0)        rows of the unfinished compressor block: state compressor tail
            [L0 - n_win, L0)      window KV: state ring, token p in row p % n_win
  chunk:    [L0, L1)              this call's tokens

1. The chunk's rows enter the compressor after the state's rows; every block completed in
   [L0, L1) is pooled into an entry (the compressor runs before attention, so the token that
   completes a block already sees its entry). The state keeps the rows still needed: the
   partial block, and for the overlapping compressor the last complete block's rows.
2. Entries of spans that complete in this chunk are written, whole, into the fresh
   classical blocks the cache manager reserved (`new_block_ids`); the remaining complete
   entries go to the state's tail entries. An incomplete block never reaches the pool.
3. Each query attends, in one softmax with the sink, over its window (ring + chunk) and its
   compressed entries: all visible HCA entries, or the indexer's stable top-k CSA entries.
4. The chunk's last n_win tokens overwrite their ring rows.

Replay (restore by recompute, DEEPSEEK_V4.md §6): the request's block table already covers
the chunk (a prefix hit), so entries come from the pool only, the freshly pooled ones are
dropped, nothing is written to the Classical pool, and window positions before
`valid_from` (the replay start) hold nothing. The state that comes out at the end of the
hit is exact once the replay spans n_win * num_layers tokens or starts at 0.
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
from kvpool.storage.dsv4 import DSV4Pools, HotSet, LayerClassical, LayerState


@dataclass(frozen=True)
class ChunkPlan:
    """One request's share of a step.

    start: tokens already folded into the state (L0); num_tokens: n (positions L0 .. L0+n-1);
    state_slot: the request's state block; block_table: classical block ids of its complete
    spans, in order; new_block_ids: fresh blocks for the spans completing in this chunk
    (empty in replay); replay / valid_from: see the module docstring.
    """

    start: int
    num_tokens: int
    state_slot: int
    block_table: tuple[int, ...]
    new_block_ids: tuple[int, ...] = ()
    replay: bool = False
    valid_from: int = 0


def paged_attention(
    spec: DSV4Spec, layer_id: int, w: DSV4AttnWeights, x: Tensor, chunks: list[ChunkPlan], pools: DSV4Pools
) -> Tensor:
    """x: [N, hidden] (the weights' dtype), the chunks' tokens concatenated in `chunks` order.
    Returns [N, hidden]."""
    ratio = spec.layer_ratios[layer_id]
    freqs = layer_rope_freqs(spec, ratio)
    positions = torch.cat([torch.arange(c.start, c.start + c.num_tokens) for c in chunks])
    p = project_tokens(spec, ratio, w, x, positions, freqs)  # per-token work, batched
    outputs = []
    offset = 0
    for c in chunks:
        sl = slice(offset, offset + c.num_tokens)
        part = TokenProjections(
            *(
                None if f is None else f[sl]
                for f in (p.q, p.kv, p.comp_kv, p.comp_score, p.idx_q, p.idx_w, p.idx_kv, p.idx_score)
            )
        )
        outputs.append(
            _chunk_attention(spec, ratio, w, part, pools.state[layer_id], pools.classical[layer_id], c, freqs)
        )
        offset += c.num_tokens
    return output_projection(spec, w, torch.cat(outputs), positions, freqs)


def _compress_chunk(
    kv_state: Tensor,
    score_state: Tensor,
    new_kv: Tensor,
    new_score: Tensor,
    ratio: int,
    width: int,
    start: int,
    end: int,
    norm_weight: Tensor,
    eps: float,
    freqs: Tensor,
) -> Tensor:
    """Feed positions [start, end) into one compressor's state; return the entries completed.

    kv_state / score_state: [coff*ratio, coff*width], the request's rows (updated in place);
    new_kv / new_score: [end - start, coff*width]. Returns [end // ratio - start // ratio, width].
    """
    first_block, end_block = start // ratio, end // ratio
    num_new = end_block - first_block
    if ratio == CSA_RATIO:
        # Rows [0, ratio): the previous complete block (score -inf before block 0);
        # rows [ratio, ratio + start % ratio): the partial block. Followed by the chunk, the
        # rows cover positions (first_block - 1) * ratio .. end - 1 contiguously.
        keep = ratio + start % ratio
        rows_kv = torch.cat((kv_state[:keep], new_kv))
        rows_score = torch.cat((score_state[:keep], new_score))
        entries = rows_kv.new_zeros(0, width)
        if num_new:
            span = slice(0, num_new * ratio)
            cur = slice(ratio, (num_new + 1) * ratio)
            kv_rows, score_rows = overlap_rows(
                rows_kv[span].view(num_new, ratio, -1),
                rows_kv[cur].view(num_new, ratio, -1),
                rows_score[span].view(num_new, ratio, -1),
                rows_score[cur].view(num_new, ratio, -1),
                width,
            )
            first_positions = torch.arange(first_block, end_block) * ratio
            entries = pool_entries(kv_rows, score_rows, norm_weight, eps, first_positions, freqs)
        # New state: the last complete block's rows, then the partial block's rows.
        tail = rows_kv[num_new * ratio :], rows_score[num_new * ratio :]
    else:
        keep = start % ratio
        rows_kv = torch.cat((kv_state[:keep], new_kv))  # positions first_block * ratio .. end - 1
        rows_score = torch.cat((score_state[:keep], new_score))
        entries = rows_kv.new_zeros(0, width)
        if num_new:
            n = num_new * ratio
            first_positions = torch.arange(first_block, end_block) * ratio
            entries = pool_entries(
                rows_kv[:n].view(num_new, ratio, -1),
                rows_score[:n].view(num_new, ratio, -1),
                norm_weight,
                eps,
                first_positions,
                freqs,
            )
        tail = rows_kv[num_new * ratio :], rows_score[num_new * ratio :]
    kv_state[: tail[0].shape[0]] = tail[0]
    score_state[: tail[1].shape[0]] = tail[1]
    return entries


def _entries_for_chunk(pool: Tensor, tail: Tensor, new_entries: Tensor, ratio: int, span: int, c: ChunkPlan) -> Tensor:
    """All entries complete by the chunk's end ([end // ratio, width]), and, outside replay,
    write completed spans to their new classical blocks and the rest to the tail entries.

    pool: [num_blocks, span // ratio, width]; tail: [span // ratio, width] (this request's).
    Under HiSparse the CSA main entries go through `_open_entries` instead.
    """
    per_block = span // ratio
    end = c.start + c.num_tokens
    num_entries = end // ratio
    table = torch.tensor(c.block_table, dtype=torch.long)
    pooled = pool[table].reshape(-1, pool.shape[-1])  # [len(table) * per_block, width]
    if c.replay:
        assert num_entries <= pooled.shape[0], "replay must stay inside the prefix hit"
        return pooled[:num_entries]
    num_blocks = len(c.block_table)
    assert num_blocks == c.start // span, (
        f"block table holds {num_blocks} spans, start {c.start} needs {c.start // span}"
    )
    num_tail = c.start // ratio - num_blocks * per_block  # complete entries of the unfinished span
    # [num_blocks * per_block, num_entries): the unfinished span's entries, old then new
    open_entries = torch.cat((tail[:num_tail], new_entries))
    num_done = end // span - num_blocks
    assert num_done == len(c.new_block_ids), f"{num_done} spans complete, {len(c.new_block_ids)} blocks reserved"
    for k, block_id in enumerate(c.new_block_ids):
        pool[block_id] = open_entries[k * per_block : (k + 1) * per_block]
    left = open_entries[num_done * per_block :]
    tail[: left.shape[0]] = left
    return torch.cat((pooled, open_entries))


def _open_entries(
    pool: Tensor, tail: Tensor, new_entries: Tensor, per_block: int, span: int, c: ChunkPlan, hot: HotSet
) -> Tensor:
    """`_entries_for_chunk` under HiSparse (`pool` is the host copy): the same writes, and a
    rewritten block leaves the hot set, but the pool is not read: only the entries after
    the block table's (the unfinished span's, old then new) come back; the block table's
    are selected through the hot set."""
    if c.replay:
        return new_entries[:0]  # every visible entry is in the pool (the prefix hit)
    num_blocks = len(c.block_table)
    assert num_blocks == c.start // span, (
        f"block table holds {num_blocks} spans, start {c.start} needs {c.start // span}"
    )
    num_tail = c.start // (span // per_block) - num_blocks * per_block
    open_entries = torch.cat((tail[:num_tail], new_entries))
    num_done = (c.start + c.num_tokens) // span - num_blocks
    assert num_done == len(c.new_block_ids), f"{num_done} spans complete, {len(c.new_block_ids)} blocks reserved"
    for k, block_id in enumerate(c.new_block_ids):
        hot.invalidate_block(block_id)
        pool[block_id] = open_entries[k * per_block : (k + 1) * per_block].to(pool.device)
    left = open_entries[num_done * per_block :]
    tail[: left.shape[0]] = left
    return open_entries


def _select_entries(cl: LayerClassical, open_entries: Tensor, top: Tensor, top_valid: Tensor, c: ChunkPlan) -> Tensor:
    """HiSparse: the entries `top` ([n, k'] indices into the chunk's entry list: the block
    table's entries, then `open_entries`) names, [n, k', width]. Block-table entries come
    through the hot set (fetched from the host copy when not resident); a masked-out pick
    reads nothing (zeros, which attention never weighs)."""
    assert cl.hot is not None and cl.main is not None
    per_block = cl.hot.per_block
    num_pool = len(c.block_table) * per_block
    flat, ok = top.reshape(-1), top_valid.reshape(-1)
    out = torch.zeros(flat.shape[0], open_entries.shape[-1], dtype=open_entries.dtype, device=open_entries.device)
    from_pool = ok & (flat < num_pool)
    if bool(from_pool.any()):
        table = torch.tensor(c.block_table, dtype=torch.long)
        local = flat[from_pool]
        ids = table[local // per_block] * per_block + local % per_block
        out[from_pool] = cl.hot.gather(cl.main, ids)
    from_open = ok & (flat >= num_pool)
    if bool(from_open.any()):
        out[from_open] = open_entries[flat[from_open] - num_pool]
    return out.view(*top.shape, -1)


def _chunk_attention(
    spec: DSV4Spec,
    ratio: int,
    w: DSV4AttnWeights,
    p: TokenProjections,
    st: LayerState,
    cl: LayerClassical,
    c: ChunkPlan,
    freqs: Tensor,
) -> Tensor:
    """One request's chunk at one layer. Returns o [n, heads, head_dim] before the output path."""
    n_win, slot = spec.window, c.state_slot
    start, end = c.start, c.start + c.num_tokens
    eps = spec.rms_norm_eps

    # Window keys: the ring unrolled in position order, then the chunk.
    key_pos = torch.arange(start - n_win, end)  # [n_win + n]
    ring = st.ring[slot]
    win_keys = torch.cat((ring[torch.arange(start - n_win, start) % n_win], p.kv))  # copies the ring rows
    t = torch.arange(start, end)[:, None]
    win_valid = (key_pos <= t) & (key_pos > t - n_win) & (key_pos >= max(c.valid_from, 0))

    keys: Tensor = win_keys
    valid = win_valid
    if ratio:

        def compress(
            kv_state: Tensor, score_state: Tensor, new_kv: Tensor, new_score: Tensor, width: int, norm: Tensor
        ) -> Tensor:
            """The entries the chunk completes in one compressor of this layer (the main one, or
            the indexer's at a CSA layer: the same ratio, positions and RoPE); its state rows of
            this request (kv_state / score_state: every slot's) are updated."""
            return _compress_chunk(
                kv_state[slot], score_state[slot], new_kv, new_score, ratio, width, start, end, norm, eps, freqs
            )

        comp = w.compressor
        assert comp is not None and st.comp_kv is not None and st.comp_score is not None
        assert cl.main is not None and st.tail_main is not None
        new_entries = compress(st.comp_kv, st.comp_score, p.comp_kv, p.comp_score, spec.head_dim, comp.norm)
        hot = cl.hot if ratio == CSA_RATIO else None
        if hot is None:
            entries = _entries_for_chunk(cl.main, st.tail_main[slot], new_entries, ratio, spec.span, c)
        else:
            entries = _open_entries(cl.main, st.tail_main[slot], new_entries, spec.span // ratio, spec.span, c, hot)
        num_visible = (torch.arange(start, end) + 1) // ratio  # entry j visible iff j < (t + 1) // ratio
        if ratio == CSA_RATIO:
            ix = w.indexer
            assert ix is not None and st.idx_kv is not None and st.idx_score is not None
            assert cl.idx is not None and st.tail_idx is not None
            new_keys = compress(st.idx_kv, st.idx_score, p.idx_kv, p.idx_score, spec.index_head_dim, ix.compressor.norm)
            idx_keys = _entries_for_chunk(cl.idx, st.tail_idx[slot], new_keys, ratio, spec.span, c)
            if idx_keys.shape[0]:  # (the indexer keys stay on the device: one per entry)
                scores = indexer_scores(p.idx_q, p.idx_w, idx_keys)  # [n, E]
                top, top_valid = stable_topk(scores, num_visible, spec.index_topk)  # [n, k']
                n = c.num_tokens
                picked = entries[top] if hot is None else _select_entries(cl, entries, top, top_valid, c)
                keys = torch.cat((win_keys.expand(n, -1, -1), picked), dim=1)  # [n, n_win + n + k', d]
                valid = torch.cat((win_valid, top_valid), dim=1)
        else:
            entry_valid = torch.arange(entries.shape[0])[None, :] < num_visible[:, None]
            keys = torch.cat((win_keys, entries))
            valid = torch.cat((win_valid, entry_valid), dim=1)

    o = sink_attention(p.q, keys, valid, w.attn_sink, spec.head_dim**-0.5)

    # The chunk's last n_win tokens replace their ring rows (after the reads above).
    first = max(start, end - n_win)
    ring[torch.arange(first, end) % n_win] = p.kv[first - start :]
    return o
