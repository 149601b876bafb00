"""Paged attention over the block pool, for a mixed batch of prefill chunks and decodes.

The K/V of layer l are `k_cache`, `v_cache` [num_blocks, kv_heads, block_size, head_dim]
(storage/kv.py). A step's plan (`plan_step`) is built once from the CSR block tables and
reused by every layer.

Decode tokens (one query each) use block-wise attention: every block the batch reads is
multiplied, where it lies, with the query of the sequence that owns it; a segment softmax
over each sequence's blocks (max and sum gathered with index_reduce / index_add) joins the
blocks. GQA folds the H / KVH query heads of one KV head into the rows of one matmul,
so each K/V block is read once for its whole group:

    scores [P, KVH, bs, G] = K_blocks [P, KVH, bs, D] @ q_owner [P, KVH, D, G]

When the batch's blocks fill most of a contiguous id range of the pool and no block is
read twice, the blocks are taken as a view of that range (no gather copy at all; blocks in
the range the batch does not read get a dummy owner and are masked). Otherwise they are
gathered with one index_select. Either way no per-sequence contiguous K/V is built.

Prefill chunks (several queries, causal within the chunk) gather their own blocks into a
contiguous [KVH, T, D] and call SDPA with the offset-causal mask; prefill is compute-bound,
so that copy is a small part of its time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F

# Take a view of the pool range when at least this fraction of its blocks is read.
RANGE_DENSITY = 0.75


@dataclass
class PrefillPlan:
    rows: slice  # the chunk's query rows in the flat batch
    block_ids: torch.Tensor  # [num_blocks] int64: the blocks covering [0, ctx_len)
    ctx_len: int  # keys [0, ctx_len) are readable after this step's write
    mask: torch.Tensor  # [G * q_len, ctx_len] bool: query (g, i) at position start + i sees keys <= it


@dataclass
class DecodePlan:
    rows: torch.Tensor  # [B] int64: rows of the flat batch holding decode queries
    num_seqs: int
    blocks: torch.Tensor | None  # [P] int64 block ids to gather, or None when range_lo is used
    range_lo: int  # with blocks None: blocks [range_lo, range_lo + P) of the pool, as a view
    owner: torch.Tensor  # [P] int64: owning decode sequence (num_seqs = dummy, discarded)
    bias: torch.Tensor  # [P, 1, bs, 1] fp: 0 for readable slots, -inf past the owner's length


@dataclass
class StepPlan:
    block_idx: torch.Tensor  # [N] int64: block of each new token's slot
    offset_idx: torch.Tensor  # [N] int64: offset of each new token's slot
    decode: DecodePlan | None
    prefills: list[PrefillPlan]


def plan_step(
    q_lens: Sequence[int],
    ctx_lens: Sequence[int],
    slot_mapping: Sequence[int],
    indptr: Sequence[int],
    indices: Sequence[int],
    block_size: int,
    group: int,
    device: torch.device,
    dtype: torch.dtype = torch.float32,
    allow_range_view: bool = True,
) -> StepPlan:
    """q_lens[i] new tokens of sequence i sit at positions [ctx_lens[i] - q_lens[i], ctx_lens[i]);
    sequence i's blocks are indices[indptr[i]:indptr[i+1]] and cover its ctx_lens[i] tokens."""
    slots = torch.tensor(slot_mapping, dtype=torch.long)
    block_idx = (slots // block_size).to(device)
    offset_idx = (slots % block_size).to(device)
    prefills: list[PrefillPlan] = []
    decode_rows: list[int] = []
    decode_seqs: list[int] = []
    row = 0
    for i, (q_len, ctx_len) in enumerate(zip(q_lens, ctx_lens, strict=True)):
        blocks = indices[indptr[i] : indptr[i + 1]]
        assert len(blocks) == -(-ctx_len // block_size), "block table must cover exactly ctx_len tokens"
        if q_len == 1:
            decode_rows.append(row)
            decode_seqs.append(i)
        else:
            start = ctx_len - q_len
            pos = torch.arange(start, ctx_len)
            causal = torch.arange(ctx_len)[None, :] <= pos[:, None]  # [q_len, ctx_len]
            prefills.append(
                PrefillPlan(
                    slice(row, row + q_len),
                    torch.tensor(blocks, dtype=torch.long, device=device),
                    ctx_len,
                    causal.repeat(group, 1).to(device),
                )
            )
        row += q_len
    decode = None
    if decode_rows:
        pairs_block: list[int] = []
        pairs_owner: list[int] = []
        pairs_len: list[int] = []
        for j, i in enumerate(decode_seqs):
            blocks = indices[indptr[i] : indptr[i + 1]]
            ctx_len = ctx_lens[i]
            for b, block_id in enumerate(blocks):
                pairs_block.append(block_id)
                pairs_owner.append(j)
                pairs_len.append(min(block_size, ctx_len - b * block_size))
        num_seqs = len(decode_rows)
        lo, hi = min(pairs_block), max(pairs_block) + 1
        unique = len(set(pairs_block)) == len(pairs_block)
        if allow_range_view and unique and len(pairs_block) >= RANGE_DENSITY * (hi - lo):
            # One entry per block of the range [lo, hi); unread blocks get the dummy owner.
            owner = [num_seqs] * (hi - lo)
            valid = [0] * (hi - lo)
            for block_id, j, n in zip(pairs_block, pairs_owner, pairs_len):
                owner[block_id - lo] = j
                valid[block_id - lo] = n
            blocks_t = None
            range_lo = lo
        else:
            owner, valid = pairs_owner, pairs_len
            blocks_t = torch.tensor(pairs_block, dtype=torch.long, device=device)
            range_lo = 0
        valid_t = torch.tensor(valid, dtype=torch.long)
        bias = torch.zeros(len(valid), 1, block_size, 1, dtype=dtype)
        bias.masked_fill_((torch.arange(block_size)[None, :] >= valid_t[:, None]).view(len(valid), 1, block_size, 1), float("-inf"))
        decode = DecodePlan(
            torch.tensor(decode_rows, dtype=torch.long, device=device),
            num_seqs,
            blocks_t,
            range_lo,
            torch.tensor(owner, dtype=torch.long, device=device),
            bias.to(device),
        )
    return StepPlan(block_idx, offset_idx, decode, prefills)


def decode_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: DecodePlan, scale: float
) -> torch.Tensor:
    """q [B, H, D] (one query per decode sequence) -> [B, H, D], reading the pool in place."""
    num_blocks_read = plan.owner.shape[0]
    if plan.blocks is None:
        kb = k_cache[plan.range_lo : plan.range_lo + num_blocks_read]  # a view: no copy
        vb = v_cache[plan.range_lo : plan.range_lo + num_blocks_read]
    else:
        kb = k_cache.index_select(0, plan.blocks)
        vb = v_cache.index_select(0, plan.blocks)
    b, h, d = q.shape
    kvh = kb.shape[1]
    g = h // kvh
    if b == 1:
        return _decode_one(q, kb, vb, plan.bias, scale)
    # queries of each block's owner, the dummy owner (row b) reads zeros: [P, KVH, D, G]
    q_pad = torch.zeros(b + 1, kvh, g, d, dtype=q.dtype, device=q.device)
    q_pad[:b] = q.view(b, kvh, g, d) * scale
    q_owner = q_pad[plan.owner].transpose(-1, -2)
    scores = torch.matmul(kb, q_owner) + plan.bias  # [P, KVH, bs, G]
    block_max = scores.amax(dim=2)  # [P, KVH, G]; -inf for dummy blocks
    seq_max = torch.full((b + 1, kvh, g), float("-inf"), dtype=q.dtype, device=q.device)
    seq_max.scatter_reduce_(0, plan.owner.view(-1, 1, 1).expand_as(block_max), block_max, "amax")
    seq_max = torch.nan_to_num(seq_max, neginf=0.0)  # dummy row only: keeps exp finite
    probs = torch.exp(scores - seq_max[plan.owner].unsqueeze(2))  # [P, KVH, bs, G]
    denom = torch.zeros(b + 1, kvh, g, dtype=q.dtype, device=q.device).index_add_(0, plan.owner, probs.sum(2))
    block_out = torch.matmul(probs.transpose(-1, -2), vb)  # [P, KVH, G, D]
    out = torch.zeros(b + 1, kvh, g, d, dtype=q.dtype, device=q.device).index_add_(0, plan.owner, block_out)
    return (out[:b] / denom[:b].unsqueeze(-1)).view(b, h, d)


def _decode_one(
    q: torch.Tensor, kb: torch.Tensor, vb: torch.Tensor, bias: torch.Tensor, scale: float
) -> torch.Tensor:
    """One decode sequence: every block read is its own (blocks of a range view that it
    does not read are all -inf in `bias`), so one softmax over (block, slot) and no
    per-owner scatter: q [1, H, D], kb / vb [P, KVH, bs, D], bias [P, 1, bs, 1] -> [1, H, D].

    Half the kernel launches of the general path; at batch 1 launches, not bytes, are
    what attention costs."""
    _, h, d = q.shape
    kvh = kb.shape[1]
    g = h // kvh
    qg = (q.view(kvh, g, d) * scale).transpose(-1, -2)  # [KVH, D, G]
    scores = torch.matmul(kb, qg) + bias  # [P, KVH, bs, G]; -inf past the length
    probs = torch.exp(scores - scores.amax(dim=(0, 2), keepdim=True))
    denom = probs.sum(dim=(0, 2))  # [KVH, G]
    out = torch.matmul(probs.transpose(-1, -2), vb).sum(0)  # [KVH, G, D]
    return (out / denom.unsqueeze(-1)).view(1, h, d)


def prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: PrefillPlan) -> torch.Tensor:
    """q [q_len, H, D] of one chunk -> [q_len, H, D]; keys gathered from the chunk's blocks."""
    q_len, h, d = q.shape
    kvh, bs = k_cache.shape[1], k_cache.shape[2]
    g = h // kvh
    nb = plan.block_ids.shape[0]
    # [nb, KVH, bs, D] -> [KVH, nb * bs, D] -> first ctx_len keys
    k = k_cache.index_select(0, plan.block_ids).transpose(0, 1).reshape(kvh, nb * bs, d)[:, : plan.ctx_len]
    v = v_cache.index_select(0, plan.block_ids).transpose(0, 1).reshape(kvh, nb * bs, d)[:, : plan.ctx_len]
    # fold the G query heads of each KV head into rows: [KVH, G * q_len, D], rows ordered (g, i)
    qf = q.view(q_len, kvh, g, d).permute(1, 2, 0, 3).reshape(kvh, g * q_len, d)
    out = F.scaled_dot_product_attention(qf, k, v, attn_mask=plan.mask)
    return out.view(kvh, g, q_len, d).permute(2, 0, 1, 3).reshape(q_len, h, d)


def paged_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: StepPlan, scale: float
) -> torch.Tensor:
    """q [N, H, D] for the flat step -> [N, H, D]. K/V of this step must already be written."""
    out = torch.empty_like(q)
    if plan.decode is not None:
        out[plan.decode.rows] = decode_attention(q[plan.decode.rows], k_cache, v_cache, plan.decode, scale)
    for p in plan.prefills:
        out[p.rows] = prefill_attention(q[p.rows], k_cache, v_cache, p)
    return out
