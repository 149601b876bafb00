"""Paged prefill / extend attention as a Triton kernel over the CSR block tables, on the
unquantized pool or on 8-bit codes with fp32 scales (fp8 e4m3 / e5m2, int8) read in place.

A step's sequence i has q_len new tokens at positions [ctx_len - q_len, ctx_len), already
written into the pool (the step writes, then attends, as every paged backend); its blocks
are kv_indices[kv_indptr[i] : kv_indptr[i + 1]]. Query j of the chunk sees keys [0, prefix
+ j], prefix = ctx_len - q_len, whether they were cached before the step or written by it:

    keys   [0, prefix) the cached prefix | [prefix, ctx_len) the chunk itself (causal)
    query  j at position prefix + j sees [0, prefix + j]

so a prefill from position 0, a chunk starting mid-sequence (chunked prefill, a prefix
hit) and a decode (q_len 1) are the same loop. The pool is read where its blocks lie, in
any order and at any block size: each key's block is looked up from its position (t //
block_size in the table, slot t % block_size), so a key tile (BLOCK_N keys) need not match
a block.

One program per (query tile, KV head): a tile is BLOCK_M consecutive queries of one
sequence, and all G = H / KVH query heads of the KV head ride in it as rows (row r: query r
// G', head r % G', G' = G rounded up to a power of two), so the G heads share each K / V
tile they read. The host lists the tiles once a step (`plan_extend`), every layer reuses
them. A tile holds as many queries as the step's longest chunk needs, 16 to 64 rows.

Split: when tiles x KV heads are too few programs for the GPU (a step of a few long
decodes: 16 x 32k at 8 KV heads is 128 programs on 132 SMs), the keys are cut into
`num_splits` ranges of split_len keys, one program each; each writes its normalised
partial output and its log2-sum-exp (-inf when its range holds no key the row may see), and
triton_decode's `_merge` combines them exactly. The rule is the decode's
(`triton_decode.num_splits_for` on tiles instead of sequences).

Scores and the online softmax are in fp32 (fp64 for an fp64 pool, which makes the kernel
exact against an fp64 reference up to summation order); both products are tl.dot
with input_precision "ieee" (no TF32 on fp32). Triton 3.9's interpreter multiplies a
bf16 tl.dot's operands as their raw bits (numpy has no bf16: it keeps them as uint16), so
the interpreted kernel widens bf16 operands to fp32 first (`WIDEN`): the same products (one
of two bf16 values is exact in fp32) and the same fp32 sums as the GPU's dot. Its fp16 dot
multiplies the values (numpy's float16), so an fp16 step runs the GPU's branch, its 16-bit
operands straight into tl.dot (tests/test_triton_extend.py's fp16 cases).

Layouts are the CPU pool's (storage/kv.py), passed by strides, so another layout with the
same four axes reads through the same kernel:
    K pages [num_blocks, KVH, D, bs]   (K^T per block: a key tile's rows are contiguous slots)
    V pages [num_blocks, KVH, bs, D]   (a key's head_dim contiguous)

Quantized pages (storage/kv.py QuantizedKVStorage, 8-bit codes with fp32 scales: its
`reads_natively` formats) are dequantized in registers, code * scale, with one scale per
(block, KV head) (fp8_e4m3, fp8_e5m2) or per (token, KV head) (fp8_*_token, int8): the scale
tensor [num_blocks, KVH, S] is read at (block, head, slot * [S > 1]). A block-scaled block
not yet full lives in full precision in the storage's tail (spec/kv_formats.py "flush");
`kv_tails[e]` names the tail slot of table entry e (or -1), and its keys are read from the
tail tensors (the pages' layout, the compute dtype) instead of the codes. The dequantized
K / V go into the dots in the query's dtype, as the dequantizing torch path's scratch holds
them in the compute dtype.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import accumulate, islice
from typing import NamedTuple

import numpy as np
import torch
import triton
import triton.language as tl

from kvpool.attention.backends import triton_decode  # (its _merge read at launch: sm90_launches.py replaces it)
from kvpool.attention.backends.step_buffers import _PADS, TABLE_ALIGN, _aligned, split_aligned
from kvpool.attention.backends.triton_decode import dots_widened, num_splits_for

__all__ = ["ExtendPlan", "QuantPages", "extend_attention", "interpreted", "plan_extend"]

BLOCK_N = 64  # keys per iteration
ROWS = 64  # query rows (queries x heads of a group) per program at most ...
MIN_ROWS = 16  # ... and at least (tl.dot's smallest M)
# a dense plan of at most this many sequences, unsplit, is listed in Python (`_plan_few`,
# ~10 us for a step's few prompt chunks) instead of plan_extend's ~25 numpy passes (~40 us
# whatever the count); its twin is the numpy path (tests/test_triton_extend.py)
FEW_SEQS = 16


class ExtendPlan(NamedTuple):
    """One step's tables for the kernel, int32 on the pool's device, built once per step.
    (A named tuple: a frozen dataclass's fourteen fields cost ~4 us to set, every step.)"""

    q_rows: torch.Tensor  # [B]: sequence i's queries are rows [q_rows[i], q_rows[i] + q_lens[i]) of q
    q_lens: torch.Tensor  # [B]
    kv_indptr: torch.Tensor  # [B + 1]: its blocks are kv_indices[kv_indptr[i] : kv_indptr[i + 1]]
    kv_indices: torch.Tensor  # [nnz] block ids (dense tables: kv_indptr [B] row offsets into the flat table)
    ctx_lens: torch.Tensor  # [B]: keys [0, ctx_len) readable, this step's own included
    tile_seq: torch.Tensor  # [num_tiles]: the sequence of each query tile
    tile_start: torch.Tensor  # [num_tiles]: its first query, counted within the sequence's chunk
    block_m: int  # queries per tile
    group: int  # query heads per KV head (G)
    num_rows: int  # N: rows of q (rows no sequence names are neither read nor written)
    num_splits: int  # programs sharing a tile's keys, merged by log-sum-exp (1: none)
    split_len: int  # keys per split, a multiple of BLOCK_N
    part_rows: torch.Tensor  # [B]: sequence i's first row among the R rows the plan writes
    merge_rows: torch.Tensor  # [R]: those rows of q / out, sequence by sequence

    @property
    def num_bytes(self) -> int:
        tables = (self.q_rows, self.q_lens, self.kv_indptr, self.kv_indices, self.ctx_lens, self.tile_seq)
        tables += (self.tile_start, self.part_rows, self.merge_rows)
        return sum(t.nbytes for t in tables)


@dataclass(frozen=True)
class QuantPages:
    """The scales and tails of one layer of an 8-bit QuantizedKVStorage."""

    k_scale: torch.Tensor  # [num_blocks, KVH, S] fp32, S = 1 (per block) or block_size (per token)
    v_scale: torch.Tensor  # [num_blocks, KVH, S] fp32
    tail_k: torch.Tensor  # [num_tails, KVH, D, bs] compute dtype (K^T, as the pages)
    tail_v: torch.Tensor  # [num_tails, KVH, bs, D]
    kv_tails: torch.Tensor  # [nnz] int32: the tail slot of each table entry, -1: read the codes


def interpreted() -> bool:
    """True when the kernel runs in Triton's interpreter, on CPU tensors: TRITON_INTERPRET=1
    was set before triton was first imported (triton.jit reads it when it decorates)."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(_extend_kernel, InterpretedFunction)


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _refuse_overlapping_rows(rows: Sequence[int], q_lens: Sequence[int]) -> None:
    """ValueError naming two sequences whose query rows [rows[i], rows[i] + q_lens[i])
    overlap (both would write the same output rows, the later program winning). For rows
    given in an order other than increasing: sorted here, off the callers' path (theirs
    increase, which one comparison a sequence checks)."""
    order = sorted(range(len(rows)), key=rows.__getitem__)
    for a, b in zip(order[:-1], order[1:], strict=True):
        if rows[b] < rows[a] + q_lens[a]:
            i, j = sorted((a, b))
            raise ValueError(
                f"sequences {i} and {j} overlap in query rows: [{rows[i]}, {rows[i] + q_lens[i]}) "
                f"and [{rows[j]}, {rows[j] + q_lens[j]})"
            )


def plan_extend(
    q_lens: Sequence[int],
    ctx_lens: Sequence[int],
    indptr: Sequence[int] | torch.Tensor,
    indices: Sequence[int] | torch.Tensor,
    block_size: int,
    num_heads: int,
    num_kv_heads: int,
    device: torch.device | str,
    q_rows: Sequence[int] | None = None,
    num_rows: int | None = None,
    num_splits: int = 1,
    num_sms: int | None = None,
    first_row: int = 0,
    store: Callable[[list[int], tuple[int, ...]], Sequence[torch.Tensor]] | None = None,
) -> ExtendPlan:
    """The tables of one step: sequence i's q_lens[i] queries at positions [ctx_lens[i] -
    q_lens[i], ctx_lens[i]), its blocks indices[indptr[i]:indptr[i + 1]] covering exactly
    ctx_lens[i] tokens. q_rows: the row of q holding each sequence's first query (None: the
    sequences' rows follow one another from row `first_row`); num_rows: q's rows (None: the
    last sequence's end), e.g. a mixed step whose decode rows another kernel attends.
    num_splits: programs per (tile, KV head), each a range of the keys, merged by
    log-sum-exp; num_sms: choose it instead by triton_decode's rule for this GPU's SM count
    (split when the tiles x KV heads cannot give every SM two programs, no split shorter
    than its MIN_SPLIT_TOKENS). ValueError naming the first inconsistency (given q_rows:
    also two sequences whose rows overlap).

    Dense tables (the persistent step buffers'): indices an int32 tensor on `device`, the
    flat table, and indptr [B] the offset of sequence i's table row in it (row *
    max_blocks_per_seq), an int32 tensor on `device` used as it is or host integers sent
    with the plan's other tables (one copy); the kernel reads entry indptr[i] + t //
    block_size for key t as it reads the CSR; the rows' coverage is the buffers' to check
    (their update did), and the flat table is used as it is, nothing copied. The merge's
    rows (`merge_rows`) are listed only for a split plan: nothing else reads them.

    store: where a plan of a few sequences over dense tables with host row offsets, unsplit
    (`_plan_few`), puts its tables: store(values, sizes) -> the tables, the values end to
    end, table k's sizes[k] entries padded with zeros to a multiple of TABLE_ALIGN (the step
    buffers' persistent plan area, `StepBuffers.plan_tables`); None: a new tensor each
    plan, as every other plan. Every table starts 16-byte aligned in its buffer
    (TABLE_ALIGN: one compiled kernel for every plan)."""
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads are not a multiple of {num_kv_heads} KV heads")
    dense = isinstance(indices, torch.Tensor)
    if dense and num_splits == 1 and num_sms is None and len(q_lens) <= FEW_SEQS:
        if not isinstance(indptr, torch.Tensor):
            group = num_heads // num_kv_heads
            return _plan_few(
                q_lens, ctx_lens, indptr, indices, block_size, group, device, q_rows, num_rows, first_row, store
            )
    q = np.asarray(q_lens, dtype=np.int64)  # [B]
    c = np.asarray(ctx_lens, dtype=np.int64)  # [B]
    num_seqs = len(q)
    if len(c) != num_seqs or len(indptr) != num_seqs + (not dense):
        raise ValueError(f"{len(q_lens)} q_lens, {len(ctx_lens)} ctx_lens and {len(indptr)} indptr entries disagree")
    # the checks over every sequence at once; the first failing one is named, by the first
    # check it fails (as a loop over them would)
    # (dense: the lengths alone, by two reductions; the masks are made only to name one)
    if dense and (not num_seqs or q.min() > 0 and (c - q).min() >= 0):
        bad = None
    else:
        bad_len = (q <= 0) | (q > c)  # [B]
        bad = bad_len
        if not dense:
            bounds = np.asarray(indptr, dtype=np.int64)
            bad = bad_len | (bounds[1:] - bounds[:-1] != -(-c // block_size))
    if num_seqs and bad is not None and bad.any():
        i = int(np.argmax(bad))
        if bad_len[i]:
            raise ValueError(f"sequence {i}: q_len {q[i]} must be in [1, ctx_len {c[i]}]")
        raise ValueError(
            f"sequence {i}: {bounds[i + 1] - bounds[i]} blocks do not cover exactly {c[i]} tokens "
            f"of block size {block_size}"
        )
    group = num_heads // num_kv_heads
    # a tile's queries: ROWS rows' worth, fewer when no chunk is that long (a step of
    # decodes fills MIN_ROWS rows, not ROWS, with padding); a power of two (tl.arange)
    g = _pow2(group)
    block_m = max(1, MIN_ROWS // g, min(ROWS // g, _pow2(int(q.max()) if num_seqs else 1)))
    # in numpy, not a Python loop a tile or a row (a step's 4 prompts of 1,024 tokens: 4,096
    # merge rows): sequence i's tiles start at its queries 0, block_m, 2 * block_m, ...
    # (ufuncs and array methods called directly: numpy's module functions add ~1 us each)
    firsts = np.zeros(num_seqs + 1, dtype=np.int64)  # [B + 1]: sequence i's first query among all
    np.add.accumulate(q, out=firsts[1:])
    num_tiles = (q + (block_m - 1)) // block_m  # [B]
    tile_seq = np.arange(num_seqs).repeat(num_tiles)  # [T]
    tile_first = (np.add.accumulate(num_tiles) - num_tiles).repeat(num_tiles)  # [T]: its sequence's first tile
    tile_start = (np.arange(len(tile_seq)) - tile_first) * block_m
    if q_rows is None:  # [B]: one after another from first_row, the last ending at firsts[-1] + first_row
        rows = firsts[:-1] + first_row
        lowest, highest = first_row, int(firsts[-1]) + first_row
    else:
        rows = np.asarray(q_rows, dtype=np.int64)
        ends = rows + q  # [B]
        if not num_seqs:
            lowest, highest = 0, 0
        elif (rows[1:] >= ends[:-1]).all():  # each sequence's rows end where the next one's may start (the callers')
            lowest, highest = int(rows[0]), int(ends[-1])  # (no reduction needed: the check costs none)
        else:  # (sorted only where they do not increase)
            _refuse_overlapping_rows(rows.tolist(), q.tolist())
            lowest, highest = int(rows.min()), int(ends.max())
    if num_rows is None:
        num_rows = highest if num_seqs else 0
    if num_seqs and (lowest < 0 or highest > num_rows):
        raise ValueError(f"query rows {rows.tolist()} with lengths {q.tolist()} do not fit {num_rows} rows")

    max_ctx_len = int(c.max()) if num_seqs else 1
    if num_sms is not None:
        num_splits = num_splits_for(len(tile_seq), num_kv_heads, max_ctx_len, num_sms)
    if num_splits < 1:
        raise ValueError(f"num_splits must be at least 1, got {num_splits}")
    per_split = -(-max_ctx_len // num_splits)
    split_len = -(-per_split // BLOCK_N) * BLOCK_N
    # every row of every sequence, sequence by sequence: [R], R = sum(q_lens), for the
    # merge of a split plan ([0] without a split: an unsplit kernel writes its rows itself)
    if num_splits > 1:
        merge_rows = np.arange(int(firsts[-1])) + np.repeat(rows - firsts[:-1], q)
    else:
        merge_rows = firsts[:0]

    # every table in one int32 buffer, sent to the device in one copy, each a slice of it
    parts = [rows, q, c, tile_seq, tile_start, firsts, merge_rows]
    if not dense:
        parts += [bounds, np.asarray(indices, dtype=np.int64)]
    elif not isinstance(indptr, torch.Tensor):  # host row offsets: sent with the rest
        parts.append(np.asarray(indptr))
    lengths = [len(x) for x in parts]
    buffer = np.zeros(sum(map(_aligned, lengths)), dtype=np.int32)  # each table 16-byte aligned (TABLE_ALIGN)
    at = 0
    for part, n in zip(parts, lengths, strict=True):
        buffer[at : at + n] = part
        at += _aligned(n)
    packed = torch.from_numpy(buffer)
    if torch.device(device).type != "cpu":
        packed = packed.to(device)
    tables = split_aligned(packed, lengths)
    if not dense:
        kv_indptr, kv_indices = tables[7:]
    else:
        kv_indptr, kv_indices = (indptr if isinstance(indptr, torch.Tensor) else tables[7]), indices
    return ExtendPlan(
        tables[0], tables[1], kv_indptr, kv_indices, tables[2], tables[3], tables[4], block_m, group, num_rows,
        num_splits, split_len, tables[5], tables[6],
    )  # fmt: skip


class FewHead(NamedTuple):
    """What `_plan_few` lists of a plan before its row offsets (kv_indptr, the last table):
    values, its tables rows, q, c, tile_seq, tile_start, firsts end to end (each padded to
    a multiple of TABLE_ALIGN), sizes every table's length (the offsets' and the empty
    merge rows' included), and the plan's scalars."""

    values: list[int]
    sizes: tuple[int, ...]
    block_m: int
    num_rows: int
    split_len: int


def _few_head(
    q: list[int], c: list[int], group: int, q_rows: list[int] | None, num_rows: int | None, first_row: int
) -> FewHead:
    """`_plan_few`'s tables but the row offsets, from Python ints, checked (ValueError
    naming the first bad sequence)."""
    num_seqs = len(q)
    # (two C-level reductions; the loop only to name the first bad sequence)
    if num_seqs and (min(q) < 1 or min(map(operator.sub, c, q)) < 0):
        for i, (q_len, ctx_len) in enumerate(zip(q, c, strict=True)):
            if not 0 < q_len <= ctx_len:
                raise ValueError(f"sequence {i}: q_len {q_len} must be in [1, ctx_len {ctx_len}]")
    g = _pow2(group)
    longest = max(q) if num_seqs else 1
    block_m = max(1, MIN_ROWS // g, min(ROWS // g, _pow2(longest)))
    firsts = list(accumulate(q, initial=0))  # [B + 1]: sequence i's first query among all
    # sequence i's tiles start at its queries 0, block_m, 2 * block_m, ... (below q_len)
    if longest <= block_m:  # (one tile a sequence: the common step's few short chunks)
        tile_seq, tile_start = list(range(num_seqs)), [0] * num_seqs
    else:
        tile_seq, tile_start = [], []
        for i, q_len in enumerate(q):
            starts = range(0, q_len, block_m)
            tile_seq += [i] * len(starts)
            tile_start += starts
    if q_rows is None:  # one after another from first_row
        rows = [first + first_row for first in firsts[:-1]]
        lowest, highest = first_row, firsts[-1] + first_row
    else:
        rows = q_rows
        if not num_seqs:
            lowest, highest = 0, 0
        elif all(map(operator.le, map(int.__add__, rows, q), islice(rows, 1, None))):  # (as the numpy path)
            lowest, highest = rows[0], rows[-1] + q[-1]
        else:
            _refuse_overlapping_rows(rows, q)
            lowest, highest = min(rows), max(map(int.__add__, rows, q))
    if num_rows is None:
        num_rows = highest if num_seqs else 0
    if num_seqs and (lowest < 0 or highest > num_rows):
        raise ValueError(f"query rows {rows} with lengths {q} do not fit {num_rows} rows")
    max_ctx_len = max(c) if num_seqs else 1
    split_len = -(-max_ctx_len // BLOCK_N) * BLOCK_N  # (one split: all the keys)
    # rows, q, c, tiles' sequences and starts, firsts, no merge rows (unsplit); each padded
    # with zeros to a multiple of TABLE_ALIGN (`_PADS`, by its length: one list display, no
    # call a table)
    num_tiles = len(tile_seq)
    pad_b, pad_t, pad_f = (
        _PADS[num_seqs % TABLE_ALIGN],
        _PADS[num_tiles % TABLE_ALIGN],
        _PADS[(num_seqs + 1) % TABLE_ALIGN],
    )
    values = [
        *rows, *pad_b, *q, *pad_b, *c, *pad_b, *tile_seq, *pad_t, *tile_start, *pad_t, *firsts, *pad_f,
    ]  # fmt: skip
    sizes = (num_seqs, num_seqs, num_seqs, num_tiles, num_tiles, num_seqs + 1, 0, num_seqs)
    return FewHead(values, sizes, block_m, num_rows, split_len)


def _plan_few(
    q_lens: Sequence[int],
    ctx_lens: Sequence[int],
    indptr: Sequence[int],
    indices: torch.Tensor,
    block_size: int,
    group: int,
    device: torch.device | str,
    q_rows: Sequence[int] | None,
    num_rows: int | None,
    first_row: int,
    store: Callable[[list[int], tuple[int, ...]], Sequence[torch.Tensor]] | None,
) -> ExtendPlan:
    """`plan_extend` of a few sequences over dense tables with host row offsets, unsplit:
    the same tables (the same values, checks and messages) listed in Python, a few C-level
    list passes a sequence instead of numpy passes of ~1 us each over the whole step."""
    q = q_lens.tolist() if isinstance(q_lens, np.ndarray) else list(q_lens)  # [B] Python ints
    c = ctx_lens.tolist() if isinstance(ctx_lens, np.ndarray) else list(ctx_lens)
    offsets = indptr.tolist() if isinstance(indptr, np.ndarray) else list(indptr)
    num_seqs = len(q)
    if len(c) != num_seqs or len(offsets) != num_seqs:
        raise ValueError(f"{len(q)} q_lens, {len(c)} ctx_lens and {len(offsets)} indptr entries disagree")
    rows = None if q_rows is None else q_rows.tolist() if isinstance(q_rows, np.ndarray) else list(q_rows)
    head = _few_head(q, c, group, rows, num_rows, first_row)
    # every table in one int32 buffer, sent in one copy: the head's, then the row offsets
    values = [*head.values, *offsets, *_PADS[num_seqs % TABLE_ALIGN]]
    if store is not None:
        t = store(values, head.sizes)
    else:
        packed = torch.from_numpy(np.array(values, dtype=np.int32))
        if torch.device(device).type != "cpu":
            packed = packed.to(device)
        t = split_aligned(packed, head.sizes)
    return _few_plan(t, indices, head, group)


def _few_plan(t: Sequence[torch.Tensor], indices: torch.Tensor, head: FewHead, group: int) -> ExtendPlan:
    """The ExtendPlan of `_plan_few`'s tables t (as `FewHead.sizes` lists them)."""
    return ExtendPlan(
        t[0], t[1], t[7], indices, t[2], t[3], t[4], head.block_m, group, head.num_rows, 1, head.split_len, t[5], t[6]
    )


def plan_few_kept(
    kept: dict[tuple[int, ...], tuple[FewHead, ExtendPlan, int]],
    q_lens: list[int],
    ctx_lens: list[int],
    offsets: list[int],
    indices: torch.Tensor,
    group: int,
    num_rows: int,
    first_row: int,
    store: Callable[[list[int], tuple[int, ...]], Sequence[torch.Tensor]],
) -> tuple[ExtendPlan, int]:
    """`_plan_few` of chunks one after another from row first_row (q_rows None) whose
    tables `store` puts in one persistent area (`StepBuffers.plan_tables`: a shape's tables
    are the same views every time), keeping in `kept` (the caller's, for this store and
    `indices`) each shape's head and plan: a shape seen before (the same lengths, rows and
    first row: a step's joining chunk of a common prompt length) writes its head and its
    row offsets, the only tables that change, and returns the plan made the first time
    (its tensors the same views, rewritten). The same values as `_plan_few`'s. -> the plan
    and the bytes of its tables but the flat table's (ExtendPlan.num_bytes less
    kv_indices: what the step adds to the buffers' tensors), read once a shape."""
    if not len(q_lens) == len(ctx_lens) == len(offsets):
        raise ValueError(f"{len(q_lens)} q_lens, {len(ctx_lens)} ctx_lens and {len(offsets)} indptr entries disagree")
    # (-1 apart: no length is -1 in a plan kept, whose lengths were checked)
    key = (num_rows, first_row, *q_lens, -1, *ctx_lens)
    known = kept.get(key)
    if known is None:
        head = _few_head(q_lens, ctx_lens, group, None, num_rows, first_row)
        t = store([*head.values, *offsets, *_PADS[len(offsets) % TABLE_ALIGN]], head.sizes)
        if len(kept) >= 256:  # (a bound on shapes kept: prompts of many lengths)
            kept.clear()
        plan = _few_plan(t, indices, head, group)
        kept[key] = head, plan, plan.num_bytes - indices.nbytes
        return plan, kept[key][2]
    head, plan, num_bytes = known
    store([*head.values, *offsets, *_PADS[len(offsets) % TABLE_ALIGN]], head.sizes)
    return plan, num_bytes


def extend_attention(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    plan: ExtendPlan,
    scale: float,
    quant: QuantPages | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [N, H, D] (fp32, bf16, fp16 or fp64; the step's rows, sequence by sequence) ->
    out [N, H, D] in q's dtype. k_pages [num_blocks, KVH, D, bs], v_pages [num_blocks, KVH,
    bs, D]: one layer of the pool, in q's dtype, or its 8-bit codes with `quant`."""
    n, h, d = q.shape
    num_blocks, kvh, d_k, bs = k_pages.shape
    if n != plan.num_rows or h != plan.group * kvh or d_k != d or v_pages.shape != (num_blocks, kvh, bs, d):
        raise ValueError(
            f"q {tuple(q.shape)}, K pages {tuple(k_pages.shape)} and V pages {tuple(v_pages.shape)} do not fit "
            f"a plan of {plan.num_rows} rows and {plan.group} query heads per KV head"
        )
    if q.stride(2) != 1:
        raise ValueError("q's head_dim must be contiguous")
    if quant is None and k_pages.dtype != q.dtype:
        raise ValueError(f"unquantized pages must be in q's dtype {q.dtype}, not {k_pages.dtype}")
    if out is None:
        out = torch.empty_like(q)
    if quant is not None:
        ks, vs, tk, tv, tails = quant.k_scale, quant.v_scale, quant.tail_k, quant.tail_v, quant.kv_tails
        has_tails = tk.shape[0] > 0  # else every entry is -1 and the tail tensors are not read
        per_token = ks.shape[-1] > 1
        scale_strides = (ks.stride(0), ks.stride(1), ks.stride(2) if per_token else 0)
        assert vs.stride() == ks.stride(), "K and V scales share one layout"
    else:  # not read (QUANT is off): the pages stand in for every quantized argument
        ks = vs = tk = k_pages
        tv = v_pages
        has_tails = False
        tails = plan.kv_indices
        scale_strides = (0, 0, 0)

    group = plan.group
    splits = plan.num_splits
    grid = (plan.tile_seq.shape[0], kvh, splits)
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    if splits > 1:  # each split's normalised output and log2-sum-exp, merged below
        part = torch.empty(plan.merge_rows.shape[0], h, splits, d, dtype=acc, device=q.device)
        lse = torch.empty(plan.merge_rows.shape[0], h, splits, dtype=acc, device=q.device)
    else:  # not written
        part, lse = out, out
    _extend_kernel[grid](
        q, out, part, lse, k_pages, v_pages, ks, vs, tk, tv,
        plan.tile_seq, plan.tile_start, plan.q_rows, plan.q_lens, plan.kv_indptr, plan.kv_indices, tails, plan.ctx_lens,
        plan.part_rows, scale, plan.split_len,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        *k_pages.stride(), *v_pages.stride(), *tk.stride(), *tv.stride(), *scale_strides,
        HEAD_DIM=d, BLOCK_D=max(16, _pow2(d)), GROUP=group, GROUP_P=_pow2(group),
        BLOCK_M=plan.block_m, BLOCK_N=BLOCK_N, PAGE=bs, QUANT=quant is not None,
        ACC=tl.float64 if acc == torch.float64 else tl.float32,
        TAILS=has_tails, WIDEN=dots_widened(q.dtype), NUM_SPLITS=splits,
    )  # fmt: skip
    if splits > 1:
        merge_grid = (plan.merge_rows.shape[0], h)
        triton_decode._merge[merge_grid](
            part, lse, plan.merge_rows, out, out.stride(0), out.stride(1),
            H=h, D=d, NUM_SPLITS=splits, BLOCK_S=_pow2(splits), BLOCK_D=_pow2(d),
        )  # fmt: skip
    return out


@triton.jit
def _extend_kernel(
    Q, Out, Part, Lse, K, V, KScale, VScale, TailK, TailV,
    TileSeq, TileStart, QRows, QLens, KvIndptr, KvIndices, KvTails, CtxLens,
    PartRows, sm_scale, split_len,
    s_qn, s_qh, s_on, s_oh,
    s_kb, s_kh, s_kd, s_ks,  # K pages: block, head, dim, slot
    s_vb, s_vh, s_vs, s_vd,  # V pages: block, head, slot, dim
    s_tkb, s_tkh, s_tkd, s_tks,  # K tails (the same axes)
    s_tvb, s_tvh, s_tvs, s_tvd,  # V tails
    s_sb, s_sh, s_ss,  # scales: block, head, slot (0: one scale per block)
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, GROUP: tl.constexpr, GROUP_P: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PAGE: tl.constexpr, QUANT: tl.constexpr, ACC: tl.constexpr,
    TAILS: tl.constexpr, WIDEN: tl.constexpr, NUM_SPLITS: tl.constexpr,
):  # fmt: skip
    tile = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq = tl.load(TileSeq + tile)
    start = tl.load(TileStart + tile)  # the tile's first query within the chunk
    q0 = tl.load(QRows + seq)
    q_len = tl.load(QLens + seq)
    ctx_len = tl.load(CtxLens + seq)
    kv0 = tl.load(KvIndptr + seq)
    prefix = ctx_len - q_len

    # rows: (query, head of the group) pairs; padding rows (past the chunk, or heads past G
    # when G is not a power of two) compute on zeros and are never stored
    rows = tl.arange(0, BLOCK_M * GROUP_P)
    tok = start + rows // GROUP_P
    head = kvh * GROUP + rows % GROUP_P
    row_ok = (tok < q_len) & (rows % GROUP_P < GROUP)
    pos = prefix + tok  # sees keys [0, pos]; pos >= 0, so every row sees key 0: m stays finite
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < HEAD_DIM
    q_rows = (q0 + tok).to(tl.int64)
    q = tl.load(
        Q + q_rows[:, None] * s_qn + head[:, None] * s_qh + dims[None, :],
        mask=row_ok[:, None] & dim_ok[None, :],
        other=0.0,
    )
    if WIDEN:
        q = q.to(tl.float32)

    m = tl.full([BLOCK_M * GROUP_P], float("-inf"), ACC)
    l = tl.zeros([BLOCK_M * GROUP_P], ACC)  # noqa: E741
    acc = tl.zeros([BLOCK_M * GROUP_P, BLOCK_D], ACC)
    # keys [0, kv_end): the tile's last query's view (the causal mask trims the others)
    kv_end = tl.minimum(ctx_len, prefix + start + BLOCK_M)
    # this program's keys: [lo, hi), its split's range of them
    lo = split * split_len
    hi = tl.minimum(kv_end, lo + split_len) if NUM_SPLITS > 1 else kv_end
    for n0 in range(lo, hi, BLOCK_N):
        t = n0 + tl.arange(0, BLOCK_N)  # key positions
        t_ok = t < hi
        # Unquantized K^T loads by whole blocks (b_ok is constant over a block's slots): with
        # a mask per key the compiler loads K^T's rows of slots one element per instruction,
        # with this one as 16-byte vectors (sm_90 PTX, Triton 3.9). The slots read past `hi`
        # in a block hold whatever was written there last, maybe inf or NaN (a freed block's
        # stale keys): their scores become -inf below, whatever they were. V is masked per
        # key (its rows of head_dim are vectors whatever the mask): a stale inf or NaN value
        # times its weight 0 would be NaN in p @ V. 8-bit codes keep the mask per key:
        # masked by blocks, the compiler asks cp.async for 1-byte transfers and fails
        # (Triton 3.9, sm_90).
        b_ok = t_ok if QUANT else (t // PAGE) * PAGE < hi
        entry = kv0 + t // PAGE  # each key's entry in the block table
        blk = tl.load(KvIndices + entry, mask=b_ok, other=0).to(tl.int64)
        slot = t % PAGE
        k_at = blk[None, :] * s_kb + kvh * s_kh + dims[:, None] * s_kd + slot[None, :] * s_ks  # [BLOCK_D, BLOCK_N]
        v_at = blk[:, None] * s_vb + kvh * s_vh + slot[:, None] * s_vs + dims[None, :] * s_vd  # [BLOCK_N, BLOCK_D]
        k_mask = dim_ok[:, None] & b_ok[None, :]
        v_mask = t_ok[:, None] & dim_ok[None, :]
        if QUANT:
            tail = tl.load(KvTails + entry, mask=b_ok, other=-1).to(tl.int64)
            coded = tail < 0
            at = blk * s_sb + kvh * s_sh + slot * s_ss
            k_s = tl.load(KScale + at, mask=b_ok & coded, other=0.0)
            v_s = tl.load(VScale + at, mask=b_ok & coded, other=0.0)
            # dequantized in the accumulator's dtype (in fp64 the product is exact); every
            # 8-bit code is exact in fp32, the step between (the interpreter's fp8 -> fp64
            # conversion fails on zero codes in Triton 3.9)
            kc = tl.load(K + k_at, mask=k_mask & coded[None, :], other=0.0).to(tl.float32).to(ACC)
            vc = tl.load(V + v_at, mask=v_mask & coded[:, None], other=0.0).to(tl.float32).to(ACC)
            kc = kc * k_s.to(ACC)[None, :]
            vc = vc * v_s.to(ACC)[:, None]
            if TAILS:
                tk_at = tail[None, :] * s_tkb + kvh * s_tkh + dims[:, None] * s_tkd + slot[None, :] * s_tks
                tv_at = tail[:, None] * s_tvb + kvh * s_tvh + slot[:, None] * s_tvs + dims[None, :] * s_tvd
                kf = tl.load(TailK + tk_at, mask=k_mask & ~coded[None, :], other=0.0).to(ACC)
                vf = tl.load(TailV + tv_at, mask=v_mask & ~coded[:, None], other=0.0).to(ACC)
                kc = tl.where(coded[None, :], kc, kf)
                vc = tl.where(coded[:, None], vc, vf)
            kt = kc.to(Q.dtype.element_ty)
            v = vc.to(Q.dtype.element_ty)
        else:
            kt = tl.load(K + k_at, mask=k_mask, other=0.0)
            v = tl.load(V + v_at, mask=v_mask, other=0.0)
        if WIDEN:
            kt = kt.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, kt, input_precision="ieee", out_dtype=ACC) * sm_scale  # [rows, BLOCK_N]
        s = tl.where((t[None, :] <= pos[:, None]) & t_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        # a row that has seen no key yet (one of a split past its position) keeps m = -inf:
        # shift by 0 there, so that exp(-inf - -inf) never makes a NaN
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l = l * alpha + tl.sum(p, 1)  # noqa: E741
        p_in = p.to(Q.dtype.element_ty)  # the dot's operand in the query's dtype, as SDPA's
        if WIDEN:
            p_in = p_in.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p_in, v, input_precision="ieee", out_dtype=ACC)
        m = m_new
    if NUM_SPLITS == 1:
        out = acc / l[:, None]
        tl.store(
            Out + q_rows[:, None] * s_on + head[:, None] * s_oh + dims[None, :],
            out.to(Out.dtype.element_ty),
            mask=row_ok[:, None] & dim_ok[None, :],
        )
    else:  # Part [R, H, NUM_SPLITS, HEAD_DIM], Lse [R, H, NUM_SPLITS] (log2 units, -inf: no key)
        seen = l > 0
        l_safe = tl.where(seen, l, 1.0)
        # row r of the plan, head h, this split: ((r * H + h) * NUM_SPLITS + split), H = GROUP * KVH
        r = (tl.load(PartRows + seq) + tok).to(tl.int64)
        at = (r * (GROUP * tl.num_programs(1)) + head) * NUM_SPLITS + split
        part_mask = row_ok[:, None] & dim_ok[None, :]
        tl.store(Part + at[:, None] * HEAD_DIM + dims[None, :], acc / l_safe[:, None], mask=part_mask)
        lse = tl.where(seen, m * 1.4426950408889634 + tl.log2(l_safe), float("-inf"))
        tl.store(Lse + at, lse, mask=row_ok)
