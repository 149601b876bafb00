"""Decode attention read entirely from the persistent step buffers: the plain torch form a
CUDA graph can capture (engine/cuda_graph.py).

Every shape is fixed by the batch bucket and the buffers' sizes, and every step value (rows,
slots, context lengths) is read from the buffers' tensors, never from the host: a step's
sequence i has one new token at slot_mapping[i], its table row block_tables[seq_rows[i]],
and attends over the first ctx_lens[i] positions of that row. The gather reads a row's
whole table width (max_blocks_per_seq blocks) and masks past its context: simple and
graph-safe, wasteful on long tables (a Triton kernel reading the same buffers does better).
Padded rows (`StepBuffers.pad`) write and read only the dummy block.

Pool layout (storage/kv.py PagedKVStorage): K [blocks, KVH, D, bs] (K^T per block),
V [blocks, KVH, bs, D] per layer.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvpool.attention.backends.step_buffers import StepBuffers
from kvpool.storage.kv import PagedKVStorage


def buffered_decode_attend(storage: PagedKVStorage, buffers: StepBuffers, num_seqs: int):
    """attend(layer, q [n, H, D], k / v [n, KVH, D]) -> [n, H, D] for a decode step of
    n = num_seqs rows of `buffers` (one token each, padding included): write the rows' K/V
    at their slots, then attend each over its table row up to its context length."""
    bs, width = storage.block_size, buffers.max_blocks_per_seq
    n = num_seqs
    slots = buffers.slot_mapping[:n].long()
    blocks, offsets = slots // bs, slots % bs
    table = buffers.block_tables[buffers.seq_rows[:n].long()].long()  # [n, width]
    # [n, 1, 1, width * bs]: position t of the row is visible when t < ctx_len
    visible = (torch.arange(width * bs, device=slots.device) < buffers.ctx_lens[:n, None]).view(n, 1, 1, -1)
    hidden = ~visible.view(n, 1, width, bs, 1)  # [n, 1, width, bs, 1]: the positions no query sees
    zero = torch.zeros((), dtype=storage.k_layers[0].dtype, device=slots.device)

    def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        k_pool, v_pool = storage.k_layers[layer], storage.v_layers[layer]
        k_pool[blocks, :, :, offsets] = k  # [n, KVH, D] into K^T's column `offset` of each block
        v_pool[blocks, :, offsets, :] = v
        kvh, d = k.shape[1], k.shape[2]
        # The gathered positions past each context zeroed (copies: the pool is untouched): the
        # last block's slots past the end and the row's entries past its blocks (an earlier
        # request's, or other requests' blocks now) hold any values, inf or NaN too, which
        # the mask's -inf would not cancel (inf + -inf, 0 * inf: NaN). Zeroed in the copy that
        # makes the gather contiguous (`where` into [n, KVH, width, bs, D]), not in passes of
        # their own after it: 8.3 ms a layer where two masked_fill_ passes took 9.7 and no
        # zeroing 7.7 (CPU, 1 thread, n 8, KVH 2, H 8, D 64, 64 blocks of 16, load ~7)
        keys = torch.empty(n, kvh, width, bs, d, dtype=k_pool.dtype, device=k_pool.device)
        values = torch.empty_like(keys)
        torch.where(hidden, zero, k_pool[table].permute(0, 2, 1, 4, 3), out=keys)  # [n, KVH, width, bs, D]
        torch.where(hidden, zero, v_pool[table].permute(0, 2, 1, 3, 4), out=values)
        keys, values = keys.view(n, kvh, width * bs, d), values.view(n, kvh, width * bs, d)
        out = F.scaled_dot_product_attention(q.unsqueeze(2), keys, values, attn_mask=visible, enable_gqa=True)
        return out.squeeze(2)  # [n, H, D]

    return attend
