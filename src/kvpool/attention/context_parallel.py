"""Context-parallel decode attention: one sequence's KV blocks split over ranks, each rank
attending over its own blocks, the partial results merged by the log-sum-exp rule.

Block j of a sequence lives on rank j mod R (round robin: a growing sequence adds its new
blocks to every rank in turn, so the ranks' shares differ by at most one block). Each rank
keeps its blocks in a pool of its own, at block ids of its own choosing; the positions a
block stands for do not matter to decode attention (RoPE is already in the keys), only
that a rank's keys are all valid but the tail of the sequence's last block.

For one query head, a rank r with keys K_r and values V_r returns

    lse_r = log sum_t exp(s_t)          s_t = scale * q . k_t over its keys
    out_r = sum_t exp(s_t - lse_r) v_t  (its own softmax over its own keys)

and the full attention is the merge  out = sum_r w_r out_r / sum_r w_r  with
w_r = exp(lse_r - max_r lse_r): the softmax over all keys, regrouped. A rank without keys
of a sequence returns lse = -inf and a zero output, whose weight is 0. The ranks exchange
out [B, H, D] and lse [B, H] (an all-gather over torch.distributed), never their K / V:
the traffic is independent of the context length.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor


def owner_of(block_index: int, world_size: int) -> int:
    """The rank holding a sequence's block number `block_index` (0-based, in position order)."""
    return block_index % world_size


def local_block_indices(num_blocks: int, rank: int, world_size: int) -> list[int]:
    """The sequence's block numbers rank `rank` holds, in position order."""
    return list(range(rank, num_blocks, world_size))


def local_num_keys(seq_len: int, block_size: int, rank: int, world_size: int) -> int:
    """Keys of a `seq_len`-token sequence that rank `rank` holds."""
    num_blocks = -(-seq_len // block_size)
    return sum(min(block_size, seq_len - j * block_size) for j in local_block_indices(num_blocks, rank, world_size))


def partial_decode_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    tables: Sequence[Sequence[int]],
    num_keys: Sequence[int],
    scale: float,
) -> tuple[Tensor, Tensor]:
    """One decode query per sequence over this rank's blocks. q [B, H, D]; the pool in the
    paged layout (storage/kv.py: k_cache [blocks, KVH, D, bs], v_cache [blocks, KVH, bs, D]);
    tables[b]: sequence b's local block ids (in position order), whose first num_keys[b]
    slots are its keys here (0: none). -> (out [B, H, D], lse [B, H]) in q's dtype; a
    sequence with no keys here gets out 0 and lse -inf."""
    b, h, d = q.shape
    _, kvh, bs, _ = v_cache.shape
    if len(tables) != b or len(num_keys) != b:
        raise ValueError(f"{b} queries, {len(tables)} tables and {len(num_keys)} key counts")
    nb = max([len(t) for t in tables] + [1])
    for t, n in zip(tables, num_keys, strict=True):
        if not 0 <= n <= len(t) * bs or (t and n <= (len(t) - 1) * bs):
            raise ValueError(f"{n} keys do not fill a table of {len(t)} blocks of {bs} (only its last is partial)")
    # padded gather: every sequence's blocks (the first one repeating as padding), masked
    ids = torch.tensor([t[j] if j < len(t) else (t[0] if t else 0) for t in tables for j in range(nb)])
    ids = ids.to(k_cache.device)
    k = k_cache.index_select(0, ids).view(b, nb, kvh, d, bs).permute(0, 2, 1, 4, 3).reshape(b, kvh, nb * bs, d)
    v = v_cache.index_select(0, ids).view(b, nb, kvh, bs, d).transpose(1, 2).reshape(b, kvh, nb * bs, d)
    g = h // kvh
    scores = torch.einsum("bkgd,bktd->bkgt", q.view(b, kvh, g, d).to(k.dtype), k) * scale  # [B, KVH, G, T]
    valid = torch.arange(nb * bs, device=q.device)[None, :] < torch.tensor(num_keys, device=q.device)[:, None]
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [B, KVH, G]; -inf without keys
    probs = torch.exp(scores - torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse)).unsqueeze(-1))
    # the values past num_keys (padding, or a last block's slots whatever its earlier owner
    # wrote: inf or NaN too, which a weight of 0 would not cancel) zeroed in the gathered copy
    v = v.masked_fill_(~valid[:, None, :, None], 0.0)
    out = torch.einsum("bkgt,bktd->bkgd", probs, v)  # zero without keys
    return out.reshape(b, h, d).to(q.dtype), lse.reshape(b, h).to(q.dtype)


def merge_partials(outs: Tensor, lses: Tensor) -> Tensor:
    """outs [R, B, H, D], lses [R, B, H] -> the attention over all ranks' keys, [B, H, D]."""
    top = lses.amax(dim=0, keepdim=True)  # [1, B, H]; finite when any rank has keys
    weights = torch.exp(lses - torch.where(torch.isfinite(top), top, torch.zeros_like(top)))  # [R, B, H]
    total = weights.sum(dim=0)
    if bool((total == 0).any()):
        raise ValueError("a sequence has no keys on any rank")
    return (weights.unsqueeze(-1) * outs).sum(dim=0) / total.unsqueeze(-1)


def cp_decode_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    tables: Sequence[Sequence[int]],
    num_keys: Sequence[int],
    scale: float,
    group: dist.ProcessGroup | None = None,
) -> Tensor:
    """Context-parallel decode attention: this rank's partial result (its blocks), all-gathered
    with every other rank's and merged; every rank returns the same [B, H, D]. q must be the
    same on every rank."""
    # a rank whose arguments are wrong must not leave the others waiting in the all-gather:
    # every rank learns of a failure and raises together
    failure: ValueError | None = None
    try:
        out, lse = partial_decode_attention(q, k_cache, v_cache, tables, num_keys, scale)
    except ValueError as e:
        failure = e
    failed = torch.tensor([failure is not None], dtype=torch.int64)
    dist.all_reduce(failed, op=dist.ReduceOp.MAX, group=group)
    if failure is not None:
        raise failure
    if int(failed):
        raise ValueError("context-parallel attention: another rank's arguments were refused")
    world = dist.get_world_size(group)
    outs = [torch.empty_like(out) for _ in range(world)]
    lses = [torch.empty_like(lse) for _ in range(world)]
    dist.all_gather(outs, out.contiguous(), group=group)
    dist.all_gather(lses, lse.contiguous(), group=group)
    return merge_partials(torch.stack(outs), torch.stack(lses))
