"""Triton kernels of the paged pool's decode step: the K/V write through the slot mapping,
paged decode attention over the CSR block tables, and the log-sum-exp merge of a decode
whose context was split across programs. Self-contained: torch tensors in, torch tensors
out; the backend (triton_paged.py) plans a step and calls `write_kv` / `paged_decode`.
Index tensors may be int32 or int64 (the kernels widen what they load to int64).

Layout: the pool's own (storage/kv.py), per layer
    k_cache [num_blocks, kv_heads, head_dim, block_size]   K^T per block
    v_cache [num_blocks, kv_heads, block_size, head_dim]
The GPU keeps the CPU's layout. What a GPU needs is that a warp's loads fall on adjacent
addresses (coalesced), and a decode program reads whole blocks of one KV head: in either
layout a (block, KV head) is one contiguous run of head_dim * block_size elements (4 KiB
at head dim 128, block 16, bf16), so the tile loads can be fully coalesced whichever of
head_dim or the slots is innermost (K^T's given a mask constant over a block's slots:
below); K^T per block is already the [head_dim, tokens] operand
that q @ K^T takes, and V's rows of head_dim are the [tokens, head_dim] operand of p @ V.
The one access that favours head_dim innermost for K is the write of a new token's K (its
head_dim values land block_size elements apart: head_dim strided stores per token and KV
head instead of one contiguous row); a decode step writes one token per sequence, a few
KiB, against the whole context it reads. Keeping the layout keeps every other reader of the
pool (copy-on-write, the tiers, the torch prefill path, the cache descriptor's layout id)
as it is. A [block, kv_heads, slot, head_dim] K would be worth measuring where prefill
writes dominate; it is unmeasured here (no GPU was at hand).

What the compiler makes of it (sm_90 PTX from Triton 3.9's compiler, no GPU needed: the
test's compile check): V's rows of head_dim load as 16-byte vectors whatever the mask, as
head_dim is innermost; K^T's rows of slots do only when the tile's mask is constant over a
block's slots. With a mask per token (t < end) the bf16 K^T tile loaded one 2-byte element
per instruction (64 a thread a tile, 128 registers); masked per block (the whole last
block read, its slots past the end dropped from the scores), every K and V load is a
16-byte cp.async, 96 registers (D 128, GQA 4, blocks of 16 or 64).

Decode (`paged_decode`): one program per (sequence, KV head, split) holds that KV head's
G = heads / kv_heads query heads as the rows of one tile (padded to 16 rows, the smallest
tl.dot), so each K/V byte is read once for the whole GQA group. It walks the sequence's
blocks indices[indptr[b] : indptr[b + 1]] TILE tokens at a time (a tile is whole blocks
when the block size is a power of two; any other size is read too, a tile then cutting
blocks, each token's block looked up by t // block_size, without the 16-byte K^T loads),
with an online softmax in fp32 (fp64 for an fp64 pool). The context length is
(num_blocks - 1) * block_size + last_block_len[b]. `paged_decode_dense` is the same kernel
over dense block-table rows and context lengths, as the persistent step buffers hold them
(step_buffers.py), for a decode that a CUDA graph replays over fixed addresses.

Split: with few sequences, batch x kv_heads programs cannot fill the GPU (16 x 32k at 8
KV heads: 128 programs on 132 SMs that each want several resident programs), so the
context is cut into `num_splits` ranges of whole tiles, one program each; each writes its
normalised partial output and its log-sum-exp, and `_merge` (one program per sequence and
query head) combines them exactly: out = sum_s exp(lse_s - m) o_s / sum_s exp(lse_s - m),
m = max_s lse_s. A split that starts past a shorter sequence's end writes lse = -inf and
weighs nothing. `num_splits_for` is the rule, taken on the host from the step's lengths;
the split count is a constexpr, so a CUDA graph captured per batch bucket needs its count
fixed for the bucket, and the rule takes powers of two only (at most 7 counts ever compiled,
not one per 512-token step of the longest context). (Elsewhere: SGLang's Triton decode computes a split count per
sequence on the device, from the lengths and the GPU's core count, up to a maximum, and
merges by log-sum-exp in a second kernel; vLLM's Triton decode kernel splits every
sequence into a fixed number of ranges; FlashInfer's planner picks a chunk size so that
the work items fill the SMs.)

Interpreter: with TRITON_INTERPRET=1 set before triton is first imported (triton.jit reads
it when it decorates: triton's own helpers at its import, these kernels at this module's),
the kernels run on CPU tensors (the tests; tests/conftest.py sets it on a machine without a
GPU); `interpreted()` says which mode this import took. Triton 3.9's
interpreter multiplies tl.dot's bf16 operands as their raw 16-bit patterns (it keeps bf16
as uint16 and calls numpy's matmul on them: results ~1e10 off), so there a bf16 decode
converts the dot operands to fp32 first. The values are the GPU's: a product of two bf16
values is exact in fp32, both accumulate in fp32, and p is rounded to bf16 before p @ V
either way; only the order of the sums may differ. Its fp16 dot multiplies the values
(numpy's float16), so an interpreted fp16 decode runs the branch a GPU runs for bf16 and
fp16, the 16-bit operands straight into tl.dot (`dots_widened`; tests/test_triton_kernels.py
::test_the_gpu_branch_of_the_16_bit_dots_in_fp16).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MIN_ROWS = 16  # tl.dot's smallest M: the GQA group's rows are padded to it
TILE_TOKENS = 64  # tokens a decode program reads per iteration (whole blocks; more when a block is larger)
MIN_SPLIT_TOKENS = 512  # a split reads at least this much context (a chosen floor, not measured on a GPU)
# the most splits the rule chooses: `_merge` holds a [splits, head_dim] tile of partial
# outputs per program (64 x 128 fp32: 32 KiB of registers across its warps); a chosen cap,
# not measured on a GPU
MAX_SPLITS = 64
LOG2E = 1.4426950408889634


def interpreted() -> bool:
    """True when this module's kernels run in Triton's interpreter (TRITON_INTERPRET=1 was
    set before triton's first import): they then take CPU tensors."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(_write_kv, InterpretedFunction)


def dots_widened(dtype: torch.dtype) -> bool:
    """Whether the decode's dots take fp32 copies of `dtype` operands (UPCAST): only bf16 in
    the interpreter (module docstring). Every other case, a GPU's bf16 and fp16 included,
    feeds the pool's dtype to tl.dot."""
    return dtype == torch.bfloat16 and interpreted()


def num_splits_for(num_seqs: int, num_kv_heads: int, max_ctx_len: int, num_sms: int) -> int:
    """How many programs share one (sequence, KV head)'s context: a power of two, at most
    MAX_SPLITS. 1 when num_seqs * num_kv_heads programs already give every SM two; else the
    power of two that gives every SM two (rounded up), but no split shorter than
    MIN_SPLIT_TOKENS (rounded down: below it the merge's extra launch and partial outputs
    are likely to cost more than the split saves; the floor is a choice, not a GPU
    measurement).

    Powers of two because the count is a constexpr of `_decode` and `_merge` (and of the
    extend kernel, which takes this rule): every new value compiles them again, seconds of
    stall inside a serving step. Taken from each step's longest context, the unrounded rule
    gave 33 distinct counts over contexts up to 128k at batch 1 and 8 KV heads; this one
    gives at most log2(MAX_SPLITS) + 1 = 7 whatever the batch, heads, context or SM count
    (tests/test_triton_kernels.py::test_the_split_rule_takes_few_values)."""
    programs = num_seqs * num_kv_heads
    if programs == 0 or programs >= 2 * num_sms:  # (no sequence: nothing to split)
        return 1
    wanted = -(-2 * num_sms // programs)
    up = 1 << (wanted - 1).bit_length()  # the power of two at or above wanted
    floor = max_ctx_len // MIN_SPLIT_TOKENS
    down = 1 << (floor.bit_length() - 1) if floor > 1 else 1  # the power of two at or below it
    return min(up, down, MAX_SPLITS)


@triton.jit
def _write_kv(
    k_new,  # [N, KVH, D]
    v_new,
    slots,  # [N] int64
    k_cache,  # [num_blocks, KVH, D, BS]
    v_cache,  # [num_blocks, KVH, BS, D]
    stride_kn,
    stride_kh,
    stride_vn,
    stride_vh,
    KVH: tl.constexpr,
    D: tl.constexpr,
    BS: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    n = tl.program_id(0)
    h = tl.program_id(1)
    slot = tl.load(slots + n).to(tl.int64)
    block = slot // BS
    off = slot % BS
    d = tl.arange(0, BLOCK_D)
    dm = d < D
    k = tl.load(k_new + n * stride_kn + h * stride_kh + d, mask=dm)
    v = tl.load(v_new + n * stride_vn + h * stride_vh + d, mask=dm)
    head = block * KVH + h
    tl.store(k_cache + (head * D + d) * BS + off, k, mask=dm)  # K^T: head_dim values BS apart
    tl.store(v_cache + (head * BS + off) * D + d, v, mask=dm)  # V: one contiguous row


def write_kv(
    k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor
) -> None:
    """Store k, v [N, KVH, D] (rows may be strided views; head_dim contiguous) at slots [N]
    int64 (block * block_size + offset) of one layer's k_cache [blocks, KVH, D, BS] and
    v_cache [blocks, KVH, BS, D]. The slots are the cache manager's: not checked here."""
    n, kvh, d = k.shape
    if n == 0:
        return
    assert k.stride(2) == 1 and v.stride(2) == 1, "head_dim must be contiguous"
    bs = v_cache.shape[2]
    _write_kv[(n, kvh)](
        k,
        v,
        slots,
        k_cache,
        v_cache,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        KVH=kvh,
        D=d,
        BS=bs,
        BLOCK_D=triton.next_power_of_2(d),
    )


@triton.jit
def _decode(
    q,  # [N, H, D]: rows[b] is sequence b's query
    rows,  # [B] int32
    seqs,  # CSR: indptr [B + 1]; DENSE: seq_rows [B], each sequence's row of the tables
    tables,  # CSR: indices [nnz]; DENSE: block_tables [rows, table_stride]
    lens,  # CSR: last_block_len [B], 1..BS; DENSE: ctx_lens [B]
    k_cache,  # [num_blocks, KVH, D, BS]
    v_cache,  # [num_blocks, KVH, BS, D]
    out,  # [N, H, D] (NUM_SPLITS == 1) or partial [B, H, NUM_SPLITS, D] fp32 / fp64
    lse,  # [B, H, NUM_SPLITS] (NUM_SPLITS > 1; log2 units)
    scale_log2,  # softmax scale * log2(e)
    stride_qn,
    stride_qh,
    stride_on,
    stride_oh,
    table_stride,  # DENSE: entries per row of block_tables
    KVH: tl.constexpr,
    G: tl.constexpr,
    D: tl.constexpr,
    BS: tl.constexpr,
    TILE: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_D: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    ACC: tl.constexpr,  # accumulation dtype
    PRECISION: tl.constexpr,  # tl.dot's input precision ("ieee": no tf32 for fp32 pools)
    UPCAST: tl.constexpr,  # dot operands in fp32 (the interpreter's bf16 dot: module docstring)
    DENSE: tl.constexpr,  # the tables as dense rows (paged_decode_dense) instead of CSR
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    split = tl.program_id(2)
    row = tl.load(rows + b).to(tl.int64)
    if DENSE:
        first = tl.load(seqs + b).to(tl.int64) * table_stride  # the sequence's row
        ctx_len = tl.load(lens + b)
    else:
        first = tl.load(seqs + b).to(tl.int64)
        ctx_len = (tl.load(seqs + b + 1) - first - 1) * BS + tl.load(lens + b)
    # [start, end): this program's tokens, whole tiles; past ctx_len for a short sequence's last splits
    per_split = tl.cdiv(tl.cdiv(ctx_len, NUM_SPLITS), TILE) * TILE
    start = split * per_split
    end = tl.minimum(start + per_split, ctx_len)

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    gm = g < G
    dm = d < D
    heads = h * G + g  # the group's query heads
    qt = tl.load(q + row * stride_qn + heads[:, None] * stride_qh + d[None, :], mask=gm[:, None] & dm[None, :], other=0)
    m = tl.full([BLOCK_G], float("-inf"), ACC)
    s = tl.zeros([BLOCK_G], ACC)
    acc = tl.zeros([BLOCK_G, BLOCK_D], ACC)
    t_in = tl.arange(0, TILE)
    for t0 in range(start, end, TILE):
        # [TILE] token positions; t0 is a multiple of TILE, so of BS when BS is a power of two
        # (any other BS: the tile starts and ends inside blocks; each token's block and slot
        # come from t alone, so the tile need not align, it only loses the vector loads)
        t = t0 + t_in
        tm = t < end
        # The K^T tile is read by whole blocks (mask bm, constant over a block's BS slots):
        # a token mask (tm) would change inside a row of BS slots, and the compiler then
        # loads one element per address instead of 16-byte vectors. The slots past `end`
        # in the last block hold finite values (the pool starts zeroed; stale ones later)
        # and their scores are replaced by -inf below.
        lb = t // BS
        bm = lb * BS < end
        block = tl.load(tables + first + lb, mask=bm, other=0).to(tl.int64)
        head = block * KVH + h
        slot = t % BS
        # K^T tile [D, TILE]: each block's [D, BS] is one contiguous run
        kt_ptr = k_cache + (head[None, :] * D + d[:, None]) * BS + slot[None, :]
        kt = tl.load(kt_ptr, mask=dm[:, None] & bm[None, :], other=0)
        if UPCAST:  # exact: a product of two bf16 values fits fp32's mantissa
            scores = tl.dot(qt.to(tl.float32), kt.to(tl.float32), out_dtype=ACC, input_precision=PRECISION)
        else:
            scores = tl.dot(qt, kt, out_dtype=ACC, input_precision=PRECISION)
        scores *= scale_log2  # [BLOCK_G, TILE], log2 units
        scores = tl.where(tm[None, :], scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, 1))  # finite: the tile holds at least one token
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(scores - m_new[:, None])
        s = s * alpha + tl.sum(p, 1)
        vt_ptr = v_cache + (head[:, None] * BS + slot[:, None]) * D + d[None, :]  # V tile [TILE, D]
        vt = tl.load(vt_ptr, mask=tm[:, None] & dm[None, :], other=0)
        pv = p.to(vt.dtype)  # rounded to the pool's dtype, as the GPU's dot takes it
        if UPCAST:
            pv, vt = pv.to(tl.float32), vt.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(pv, vt, out_dtype=ACC, input_precision=PRECISION)
        m = m_new
    if NUM_SPLITS == 1:
        o = acc / s[:, None]
        tl.store(
            out + row * stride_on + heads[:, None] * stride_oh + d[None, :],
            o.to(out.dtype.element_ty),
            mask=gm[:, None] & dm[None, :],
        )
    else:
        # an empty split (start >= end) leaves s = 0, m = -inf: output 0, lse -inf (weight 0)
        nonempty = s > 0
        o = tl.where(nonempty[:, None], acc / tl.where(nonempty, s, 1.0)[:, None], 0.0)
        part = (b * (KVH * G) + heads) * NUM_SPLITS + split  # [BLOCK_G]
        tl.store(out + part[:, None] * D + d[None, :], o, mask=gm[:, None] & dm[None, :])
        tl.store(lse + part, tl.where(nonempty, m + tl.log2(tl.where(nonempty, s, 1.0)), float("-inf")), mask=gm)


@triton.jit
def _merge(
    part,  # [B, H, NUM_SPLITS, D]
    lse,  # [B, H, NUM_SPLITS] (log2 units)
    rows,  # [B] int32
    out,  # [N, H, D]
    stride_on,
    stride_oh,
    H: tl.constexpr,
    D: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    sp = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    sm = sp < NUM_SPLITS
    base = (b * H + h) * NUM_SPLITS
    ls = tl.load(lse + base + sp, mask=sm, other=float("-inf"))  # split 0 always holds a token: finite
    w = tl.exp2(ls - tl.max(ls, 0))  # [BLOCK_S]
    o = tl.load(part + (base + sp[:, None]) * D + d[None, :], mask=sm[:, None] & (d < D)[None, :], other=0)
    merged = tl.sum(w[:, None] * o, 0) / tl.sum(w, 0)
    row = tl.load(rows + b).to(tl.int64)
    tl.store(out + row * stride_on + h * stride_oh + d, merged.to(out.dtype.element_ty), mask=d < D)


def paged_decode(
    q: torch.Tensor,
    rows: torch.Tensor,
    indptr: torch.Tensor,
    indices: torch.Tensor,
    last_len: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    num_splits: int = 1,
) -> torch.Tensor:
    """Decode attention of B sequences, one query each, into `out`; returns out.

    q, out: [N, H, D] (the step's flat batch; head_dim contiguous): sequence b's query is
    row rows[b] ([B] int32), and only those rows of out are written; indptr [B + 1],
    indices [nnz], last_len [B] int32: sequence b's blocks are indices[indptr[b]:indptr[b+1]]
    (at least one), its context (num_blocks - 1) * block_size + last_len[b] tokens, all
    written; k_cache [blocks, KVH, D, BS], v_cache [blocks, KVH, BS, D] of one layer;
    num_splits: programs per (sequence, KV head) (`num_splits_for`), merged by log-sum-exp."""
    return _launch(q, rows, indptr, indices, last_len, 0, False, k_cache, v_cache, scale, out, num_splits)


def paged_decode_dense(
    q: torch.Tensor,
    rows: torch.Tensor,
    seq_rows: torch.Tensor,
    block_tables: torch.Tensor,
    ctx_lens: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    num_splits: int = 1,
) -> torch.Tensor:
    """`paged_decode` over dense block tables, as persistent step buffers hold them
    (attention/backends/step_buffers.py: a CUDA graph replays these addresses): sequence b's
    blocks are block_tables[seq_rows[b], :ceil(ctx_lens[b] / block_size)], its context
    ctx_lens[b] tokens; rows, seq_rows, ctx_lens [B] int32 (a decode step's rows are its
    query_start[:B]), block_tables [num_rows, max_blocks] int32, rows contiguous."""
    assert block_tables.stride(1) == 1, "block table rows must be contiguous"
    stride = block_tables.stride(0)
    return _launch(q, rows, seq_rows, block_tables, ctx_lens, stride, True, k_cache, v_cache, scale, out, num_splits)


def _launch(q, rows, seqs, tables, lens, table_stride, dense, k_cache, v_cache, scale, out, num_splits):
    """The decode (and merge) launch of both table forms (see `_decode`'s arguments)."""
    _, h, d = q.shape
    _, kvh, bs, _ = v_cache.shape
    b = rows.shape[0]
    if b == 0:
        return out
    if num_splits < 1:
        raise ValueError(f"num_splits must be at least 1, got {num_splits}")
    assert q.stride(2) == 1 and out.stride(2) == 1, "head_dim must be contiguous"
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    meta = {
        "KVH": kvh,
        "G": h // kvh,
        "D": d,
        "BS": bs,
        # a power of two (tl.arange): whole blocks when bs is one; else tiles cut blocks
        "TILE": max(TILE_TOKENS, triton.next_power_of_2(bs)),
        "BLOCK_G": max(MIN_ROWS, triton.next_power_of_2(h // kvh)),
        "BLOCK_D": max(MIN_ROWS, triton.next_power_of_2(d)),  # tl.dot's K is at least 16 too
        "NUM_SPLITS": num_splits,
        "ACC": tl.float64 if acc == torch.float64 else tl.float32,
        "PRECISION": "ieee",
        "UPCAST": dots_widened(q.dtype),
        "DENSE": dense,
    }
    strides = (q.stride(0), q.stride(1), out.stride(0), out.stride(1), table_stride)
    scale_log2 = scale * LOG2E
    tabs = (rows, seqs, tables, lens, k_cache, v_cache)
    if num_splits == 1:
        _decode[(b, kvh, 1)](q, *tabs, out, out, scale_log2, *strides, **meta)
        return out
    part = torch.empty(b, h, num_splits, d, dtype=acc, device=q.device)
    lse = torch.empty(b, h, num_splits, dtype=acc, device=q.device)
    _decode[(b, kvh, num_splits)](q, *tabs, part, lse, scale_log2, *strides, **meta)
    _merge[(b, h)](
        part,
        lse,
        rows,
        out,
        out.stride(0),
        out.stride(1),
        H=h,
        D=d,
        NUM_SPLITS=num_splits,
        BLOCK_S=triton.next_power_of_2(num_splits),
        BLOCK_D=triton.next_power_of_2(d),
    )
    return out
