"""Paged attention over the block pool, for a mixed batch of prefill chunks and decodes.

Layout (storage/kv.py), per layer and block:
    k_cache [num_blocks, kv_heads, head_dim, block_size]   K stored transposed per block
    v_cache [num_blocks, kv_heads, block_size, head_dim]
A step's plan (`plan_step`) is built once from the CSR block tables and reused by every
layer.

Decode tokens (one query each) read the pool in place, wherever their blocks lie, through
`F.embedding_bag(mode="sum", per_sample_weights=...)`: a weighted sum of indexed rows,
which reads rows where they are (no gather copy) and is vectorised and multithreaded.
Both halves of attention are such sums once K is stored transposed:

    scores[b, h, blk, :] = sum_d q[b, h, d] * K^T[blk, kvh, d, :]   rows of K^T: [bs]
    out[b, h, :]         = sum_t p[b, h, t] * V[blk(t), kvh, slot(t), :]   rows of V: [D]

One bag per (sequence, query head, block) for the scores, one per (sequence, query head)
for the output; a softmax over each sequence's padded score row joins them. The GQA
group re-reads a KV head's rows G times, from cache. Cost: the bytes of the K/V read
once, so paging costs about what contiguous SDPA costs, whatever the block order.

`decode_path="native"` runs the same decode in C (kernels/cpu.c, when it builds): per
(sequence, KV head) one pass over the blocks for the G query heads, scores vectorised over
a K^T row's slots, the output over a V row's dims. It reads the same bytes as the bags
with no per-index dispatch and no padding, and is the engine's default on fp32 CPU.

`decode_attention_padded` is the plain twin (gather the batch's blocks into a padded
[B, KVH, T, D], one masked SDPA), selectable with decode_path="padded": it copies every
block it reads, so it is the slowest of the three. `kvpool bench engine --parts attention`
times all three against SDPA on a contiguous cache (docs/engine.md gives the figures); small
blocks cost the bags more (a block size of 16 makes 64-byte K^T rows, where per-index
work shows).

Prefill chunks (several queries, causal within the chunk) gather their own blocks into a
contiguous [KVH, T, D] and call SDPA with the offset-causal mask; prefill is compute-bound,
so that copy is a small part of its time.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from kvpool.kernels import CpuKernels

DECODE_PATHS = ("native", "bags", "padded")


@dataclass
class PrefillPlan:
    rows: slice  # the chunk's query rows in the flat batch
    block_ids: torch.Tensor  # [num_blocks] int64: the blocks covering [0, ctx_len)
    ctx_len: int  # keys [0, ctx_len) are readable after this step's write
    mask: torch.Tensor | None  # [q_len, ctx_len] bool: query i at position start + i sees keys <= it;
    # None when the chunk starts at position 0 (plain causal: SDPA's is_causal)


@dataclass
class BagPlan:
    """In-place decode through embedding_bag. B decode sequences, nb = max blocks per sequence."""

    # Row indices and offsets are int32 when every value fits (half the index bytes; at block
    # size 16 the K^T rows are 64 bytes, so index traffic is not small), else int64.
    k_rows: torch.Tensor  # [B * H * sum(nb_b) * D] int32/64: rows of k_cache.view(-1, bs)
    k_offsets: torch.Tensor  # [B * H * nb + 1] int32/64: bag (b, h, j) is empty for j >= nb_b (padding)
    q_rows: torch.Tensor | None  # [B * H * sum(nb_b)] int64: row of q.view(B * H, D) weighting each
    # real bag; None when no sequence is padded (every row then weights nb bags in a row)
    v_rows: torch.Tensor  # [B * H * sum(len_b)] int32/64: rows of v_cache.view(-1, D), b's readable slots
    v_offsets: torch.Tensor  # [B * H + 1] int32/64: bag (b, h) holds the slots [0, len_b) of b's blocks
    p_index: torch.Tensor | None  # [len(v_rows)] int64 into probs.view(-1); None when no slot is padding


@dataclass
class PaddedPlan:
    """Gather into a padded contiguous K/V, then one SDPA. nb = max blocks per sequence."""

    block_ids: torch.Tensor  # [B * nb] int64: each sequence's blocks, padded with its first block


@dataclass
class NativePlan:
    """The decode sequences' CSR block tables for the C kernel (kernels/cpu.c)."""

    kernels: CpuKernels
    indptr: torch.Tensor  # [B + 1] int64: sequence b's blocks are blocks[indptr[b]:indptr[b + 1]]
    blocks: torch.Tensor  # [nnz] int64
    ctx_lens: torch.Tensor  # [B] int64: keys [0, ctx_len) readable, this step's included


@dataclass
class DecodePlan:
    rows: torch.Tensor  # [B] int64: rows of the flat batch holding decode queries
    num_seqs: int
    max_blocks: int  # nb: blocks of the longest decode sequence
    bias: torch.Tensor | None  # [B, 1, 1, nb * bs] fp: 0 for readable slots, -inf past each length
    # (None on the native path, which reads exactly ctx_len keys)
    bags: BagPlan | None  # exactly one of native / bags / padded is set
    padded: PaddedPlan | None
    native: NativePlan | None = None
    # [B, 1, 1, nb * bs] bool: True past each length (the bias's -inf slots), whose stale keys
    # and values the bags and padded paths replace (None on the native path)
    past: torch.Tensor | None = None


@dataclass
class StepPlan:
    slots: torch.Tensor  # [N] int64: each new token's slot, block * bs + offset
    decode: DecodePlan | None
    prefills: list[PrefillPlan]


def plan_step(
    q_lens: Sequence[int],
    ctx_lens: Sequence[int],
    slot_mapping: Sequence[int],
    indptr: Sequence[int],
    indices: Sequence[int],
    block_size: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    device: torch.device,
    dtype: torch.dtype = torch.float32,
    decode_path: str = "bags",
    kernels: CpuKernels | None = None,
) -> StepPlan:
    """q_lens[i] new tokens of sequence i sit at positions [ctx_lens[i] - q_lens[i], ctx_lens[i]);
    sequence i's blocks are indices[indptr[i]:indptr[i+1]] and cover its ctx_lens[i] tokens.
    decode_path: "native" (the C kernel, needs `kernels`), "bags" (in place through
    embedding_bag) or "padded" (gather, then SDPA: the plain twin)."""
    if decode_path not in DECODE_PATHS:
        raise ValueError(f"decode_path must be one of {DECODE_PATHS}, got {decode_path!r}")
    if decode_path == "native" and kernels is None:
        raise ValueError("decode_path 'native' needs the CPU kernels (kvpool.kernels.cpu_kernels())")
    slots = torch.tensor(slot_mapping, dtype=torch.long, device=device)
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
            prefills.append(plan_prefill(row, q_len, ctx_len, blocks, device))
        row += q_len
    if len(slot_mapping) != row:  # (a kernel would write the step's K/V through slots that are not its own)
        raise ValueError(f"the step has {len(slot_mapping)} slots for {row} new tokens (the sum of its q_lens)")
    decode = None
    if decode_rows and decode_path == "native":
        assert kernels is not None
        tables = [indices[indptr[i] : indptr[i + 1]] for i in decode_seqs]
        sub_indptr = [0]
        for t in tables:
            sub_indptr.append(sub_indptr[-1] + len(t))
        native = NativePlan(
            kernels,
            torch.tensor(sub_indptr, dtype=torch.long),
            torch.tensor([blk for t in tables for blk in t], dtype=torch.long),
            torch.tensor([ctx_lens[i] for i in decode_seqs], dtype=torch.long),
        )
        rows = torch.tensor(decode_rows, dtype=torch.long)
        decode = DecodePlan(rows, len(decode_seqs), max(len(t) for t in tables), None, None, None, native)
    elif decode_rows:
        tables = [indices[indptr[i] : indptr[i + 1]] for i in decode_seqs]
        lens = torch.tensor([ctx_lens[i] for i in decode_seqs], dtype=torch.long)
        b = len(decode_seqs)
        nb = max(len(t) for t in tables)
        # [B, 1, 1, nb * bs]: slot t of sequence b readable iff t < len_b (pad blocks: never)
        past = (torch.arange(nb * block_size)[None, :] >= lens[:, None]).view(b, 1, 1, -1)
        bias = torch.zeros(b, 1, 1, nb * block_size, dtype=dtype).masked_fill_(past, float("-inf"))
        bags = padded = None
        if decode_path == "bags":
            bags = _plan_bags(tables, lens, nb, block_size, num_heads, num_kv_heads, head_dim, device)
        else:
            ids = [t[j] if j < len(t) else t[0] for t in tables for j in range(nb)]
            padded = PaddedPlan(torch.tensor(ids, dtype=torch.long, device=device))
        decode = DecodePlan(
            torch.tensor(decode_rows, dtype=torch.long, device=device),
            b,
            nb,
            bias.to(device),
            bags,
            padded,
            past=past.to(device),
        )
    return StepPlan(slots, decode, prefills)


def plan_prefill(row: int, q_len: int, ctx_len: int, blocks: Sequence[int], device: torch.device) -> PrefillPlan:
    """The plan of one prefill chunk: its q_len queries are rows [row, row + q_len) of the
    flat batch, at positions [ctx_len - q_len, ctx_len); blocks cover its ctx_len tokens."""
    start = ctx_len - q_len
    mask = None
    if start > 0:  # is_causal aligns the diagonal top-left: wrong past a prefix
        pos = torch.arange(start, ctx_len)
        mask = (torch.arange(ctx_len)[None, :] <= pos[:, None]).to(device)  # [q_len, ctx_len]
    block_ids = torch.tensor(blocks, dtype=torch.long, device=device)
    return PrefillPlan(slice(row, row + q_len), block_ids, ctx_len, mask)


def _plan_bags(
    tables: list[Sequence[int]],
    lens: torch.Tensor,
    nb: int,
    block_size: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    device: torch.device,
) -> BagPlan:
    """Row indices of every bag, built with tensor ops (a 4k-context batch has ~10^6 rows).
    lens [B] int64: each sequence's context. The V bags hold its slots [0, len_b) only: a
    slot past the end of a last block holds whatever its block's last owner wrote there (inf
    or NaN too), and its weight 0 times an inf is NaN in the sum."""
    b, h, kvh, d, bs = len(tables), num_heads, num_kv_heads, head_dim, block_size
    g = h // kvh
    counts = torch.tensor([len(t) for t in tables], dtype=torch.long)  # nb_b
    table = torch.zeros(b, nb, dtype=torch.long)  # [B, nb]: block ids, 0 past nb_b
    for i, t in enumerate(tables):
        table[i, : len(t)] = torch.tensor(t, dtype=torch.long)
    # bags (b, h, j) of the padded grid [B, H, nb]; real iff j < nb_b. nonzero keeps (b, h, j) order.
    real = (torch.arange(nb)[None, :] < counts[:, None])[:, None, :].expand(b, h, nb)
    seq, head, j = real.nonzero(as_tuple=True)  # [num real bags] each
    base = table[seq, j] * kvh + head // g  # block * KVH + kvh
    k_rows = (base * d)[:, None] + torch.arange(d)  # K^T rows [block, kvh, 0..D)
    k_offsets = torch.cat([torch.zeros(1, dtype=torch.long), torch.cumsum(real.reshape(-1).long() * d, 0)])
    q_rows = seq * h + head if int(counts.min()) < nb else None
    readable = (j * bs)[:, None] + torch.arange(bs) < lens[seq][:, None]  # [real bags, bs]: slot < len_b
    v_rows = ((base * bs)[:, None] + torch.arange(bs))[readable]  # V rows [block, kvh, slot], readable ones
    v_offsets = torch.cat([torch.zeros(1, dtype=torch.long), torch.cumsum(lens.repeat_interleave(h), 0)])
    p_index = None
    if int(lens.min()) < nb * bs:
        # probs [B, H, nb * bs] in (b, h, j, slot) order: keep the readable slots only
        p_index = ((((seq * h + head) * nb + j) * bs)[:, None] + torch.arange(bs))[readable].to(device)
    # largest row id or offset: rows of the pool's blocks up to the highest id read, bag sizes
    bound = max((int(table.max()) + 1) * kvh * max(d, bs), b * h * nb * max(d, bs))
    idx = torch.int32 if bound < 2**31 else torch.long
    return BagPlan(
        k_rows.reshape(-1).to(device, idx),
        k_offsets.to(device, idx),
        None if q_rows is None else q_rows.to(device),
        v_rows.reshape(-1).to(device, idx),
        v_offsets.to(device, idx),
        p_index,
    )


def decode_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: DecodePlan, scale: float
) -> torch.Tensor:
    """q [B, H, D] (one query per decode sequence) -> [B, H, D].
    k_cache [num_blocks, KVH, D, bs], v_cache [num_blocks, KVH, bs, D]."""
    if plan.native is not None:
        rows = torch.arange(q.shape[0])  # q holds exactly the decode rows, in order
        n = plan.native
        out = torch.empty_like(q)
        return n.kernels.decode_attention(q, rows, n.indptr, n.blocks, n.ctx_lens, k_cache, v_cache, scale, out)
    if plan.bags is not None:
        return decode_attention_bags(q, k_cache, v_cache, plan, scale)
    return decode_attention_padded(q, k_cache, v_cache, plan, scale)


def decode_attention_bags(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: DecodePlan, scale: float
) -> torch.Tensor:
    """In place, any block order: two embedding_bag sums and one softmax (module docstring)."""
    bags = plan.bags
    assert bags is not None
    b, h, d = q.shape
    bs = v_cache.shape[2]
    nb = plan.max_blocks
    if bags.q_rows is None:  # one kernel: scale and repeat each row for its nb bags
        weights = torch.mul(q.reshape(b * h, 1, d).expand(b * h, nb, d), scale).view(-1)
    else:
        weights = (q.reshape(b * h, d) * scale).index_select(0, bags.q_rows).view(-1)  # [real bags * D]
    # torch.embedding_bag is what F.embedding_bag calls after its argument checks (two calls
    # a layer, every step); arguments: scale_grad_by_freq, mode 0 = sum, sparse,
    # per_sample_weights, include_last_offset. The plan built the indices, so they are valid.
    scores = torch.embedding_bag(k_cache.view(-1, bs), bags.k_rows, bags.k_offsets, False, 0, False, weights, True)[0]
    # scores [B * H * nb, bs]; pad bags are zeros, slots past a length whatever their stale
    # keys make (inf, NaN: an added -inf would leave a NaN), both replaced by the bias's -inf
    # (in place: embedding_bag's output is this call's own)
    scores = scores.view(b, h, nb * bs).masked_fill_(plan.past.view(b, 1, -1), float("-inf"))
    probs = torch.softmax(scores, dim=-1).view(-1)  # [B * H * nb * bs]
    if bags.p_index is not None:
        probs = probs.index_select(0, bags.p_index)
    out = torch.embedding_bag(v_cache.view(-1, d), bags.v_rows, bags.v_offsets, False, 0, False, probs, True)[0]
    return out.view(b, h, d)  # [B * H, D] -> [B, H, D]


def decode_attention_padded(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: DecodePlan, scale: float
) -> torch.Tensor:
    """Gather each sequence's blocks (padded to the longest) into [B, KVH, nb * bs, D], one SDPA
    with the plan's key mask. GQA folded into rows: queries [B, KVH, G, D]."""
    padded = plan.padded
    assert padded is not None
    b, h, d = q.shape
    _, kvh, bs, _ = v_cache.shape
    nb = plan.max_blocks
    # k: [B * nb, KVH, D, bs] -> [B, KVH, nb, bs, D]; v: [B * nb, KVH, bs, D] -> [B, KVH, nb, bs, D]
    k = (
        k_cache.index_select(0, padded.block_ids)
        .view(b, nb, kvh, d, bs)
        .permute(0, 2, 1, 4, 3)
        .reshape(b, kvh, nb * bs, d)
    )
    v = v_cache.index_select(0, padded.block_ids).view(b, nb, kvh, bs, d).transpose(1, 2).reshape(b, kvh, nb * bs, d)
    # the copies' slots past each length (padding, or stale keys and values of a last block:
    # inf or NaN too, which the mask's -inf would not cancel) zeroed
    past = plan.past.view(b, 1, nb * bs, 1)
    k, v = k.masked_fill_(past, 0.0), v.masked_fill_(past, 0.0)
    out = F.scaled_dot_product_attention(q.view(b, kvh, h // kvh, d), k, v, attn_mask=plan.bias, scale=scale)
    return out.view(b, h, d)


def prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: PrefillPlan) -> torch.Tensor:
    """q [q_len, H, D] of one chunk -> [q_len, H, D]; keys gathered from the chunk's blocks."""
    q_len, h, d = q.shape
    _, kvh, bs, _ = v_cache.shape
    nb = plan.block_ids.shape[0]
    # k: [nb, KVH, D, bs] -> [KVH, nb * bs, D]; v: [nb, KVH, bs, D] -> [KVH, nb * bs, D]; first ctx_len keys
    k = k_cache.index_select(0, plan.block_ids).permute(1, 0, 3, 2).reshape(kvh, nb * bs, d)[:, : plan.ctx_len]
    v = v_cache.index_select(0, plan.block_ids).transpose(0, 1).reshape(kvh, nb * bs, d)[:, : plan.ctx_len]
    # A NaN or an inf in a key the chunk writes makes SDPA's score of it non-finite, and its
    # mask (added to the scores: inf + -inf, NaN + -inf) leaves that NaN in the queries
    # before it too, which never see that key (CPU SDPA, torch 2.13, chunks up to ~32
    # queries from position 0, any chunk over a prefix); a NaN or an inf value, weighted
    # exactly 0 for them, is NaN in p @ V all the same (0 * NaN, 0 * inf). Those earlier
    # positions' outputs feed the next layer's K / V, which the prefix cache keeps for other
    # requests: so the chunk is cut at its non-finite keys and values, each piece attending
    # to the keys up to its end, among which its masked ones are finite (a prefix key is
    # seen by every query: no cut). Found by one sum over the chunk's own K and one over its
    # V (q_len x KVH x D each; a NaN or inf makes it non-finite, a finite sum past the
    # dtype's range takes the exact cut path too). Its cost, this function against the one
    # without the check, alternated in one process, median of 20 rounds (heads 9 / 3, head
    # dim 64, fp32, one thread, thread time; 2026-12-08, 2 shared vCPUs, load 3-5): within
    # 1-4 % at 128 and 512 tokens, +14 us (of ~110) for a chunk of 16 from position 0, +25
    # us (of ~390) for 16 over a prefix of 384. An isfinite bool mask over K alone cost
    # 470 / 26 us at 512 / 16 tokens. On CUDA (the torch backend there: Triton's is
    # preferred) the sums' read back waits for the device once a chunk and layer;
    # unmeasured (no GPU).
    start = plan.ctx_len - q_len
    chunk_k, chunk_v = k[:, start:], v[:, start:]
    acc = None if k.dtype in (torch.float32, torch.float64) else torch.float32  # (16-bit sums overflow sooner)
    if not math.isfinite(chunk_k.sum(dtype=acc).item() + chunk_v.sum(dtype=acc).item()):
        finite = torch.isfinite(chunk_k).all(dim=2) & torch.isfinite(chunk_v).all(dim=2)  # [KVH, q_len]
        bad = ~finite.all(dim=0)  # [q_len]: the chunk's positions with a non-finite key or value
        cuts = [0, *(int(i) for i in bad.nonzero()[:, 0] if i > 0), q_len]
        out = torch.empty_like(q)
        for a, b in zip(cuts[:-1], cuts[1:], strict=True):
            end = start + b  # queries [a, b) of the chunk see keys [0, start + b) at most
            mask = torch.arange(end, device=q.device)[None, :] <= torch.arange(start + a, end, device=q.device)[:, None]
            out[a:b] = _sdpa(q[a:b], k[:, :end], v[:, :end], mask)
        return out
    return _sdpa(q, k, v, plan.mask)


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """q [L, H, D], k / v [KVH, S, D], mask [L, S] bool (None: causal from position 0, L = S) -> [L, H, D]."""
    # 4-D inputs with enable_gqa (query head h reads KV head h // G): CPU SDPA then takes
    # its flash kernel. 3-D inputs with the G query heads folded into rows and the mask
    # repeated G times fall back to its math path, several times slower; is_causal (a chunk
    # from position 0) is the fastest case.
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k[None], v[None], attn_mask=mask, is_causal=mask is None, enable_gqa=True
    )  # [1, H, q_len, D]
    return out[0].transpose(0, 1)


def paged_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: StepPlan, scale: float
) -> torch.Tensor:
    """q [N, H, D] for the flat step -> [N, H, D]. K/V of this step must already be written."""
    d = plan.decode
    if d is not None and d.native is not None:  # the kernel reads q's rows and writes out's in place
        out = torch.empty_like(q)
        n = d.native
        n.kernels.decode_attention(q, d.rows, n.indptr, n.blocks, n.ctx_lens, k_cache, v_cache, scale, out)
    elif d is not None and not plan.prefills:  # decodes only: rows are 0..N-1
        return decode_attention(q, k_cache, v_cache, d, scale)
    else:
        out = torch.empty_like(q)
    if d is not None and d.native is None:
        out[plan.decode.rows] = decode_attention(q[plan.decode.rows], k_cache, v_cache, plan.decode, scale)
    for p in plan.prefills:
        out[p.rows] = prefill_attention(q[p.rows], k_cache, v_cache, p)
    return out
