"""The Triton paged extend kernel (attention/backends/triton_extend.py) against SDPA on a
contiguous copy of each sequence's K / V, through Triton's interpreter on a CPU machine
(on a GPU: the compiled kernel on CUDA tensors).

Every case is a mixed step over scattered blocks: a prefill from position 0, a chunk over a
cached prefix (chunked prefill), and a decode, lengths not multiples of the block. fp64
pools must agree to rounding (1e-12: any wrong key, slot or mask is an O(1) error); fp32
and bf16 within a few times the reference's own error in that dtype (the same SDPA in fp32
or bf16 against fp64); 8-bit pools (fp8 e4m3 with one scale per (block, KV head), its
per-token twin, int8) against SDPA over the values the storage dequantizes (its torch
path), exact in an fp64 compute dtype and in the fp32 bound otherwise.
"""

from __future__ import annotations

import os
import subprocess
import sys
from itertools import accumulate
from pathlib import Path
from unittest.mock import patch

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("triton", reason="triton is not installed (setup.sh test installs it)")

from kvpool.attention.backends import triton_extend  # noqa: E402
from kvpool.attention.backends.step_buffers import StepBuffers  # noqa: E402
from kvpool.attention.backends.triton_extend import (  # noqa: E402
    QuantPages,
    extend_attention,
    interpreted,
    plan_extend,
    plan_few_kept,
)
from kvpool.cache import BlockCopy  # noqa: E402
from kvpool.spec.kv_formats import kv_schema  # noqa: E402
from kvpool.storage.kv import PagedKVStorage, QuantizedKVStorage  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu" and not interpreted():
    raise RuntimeError(
        "no GPU, and triton was imported without TRITON_INTERPRET=1 (it reads it at its first import; "
        "tests/conftest.py sets it)"
    )
NUM_BLOCKS = 48
D = 32


def _step(lens, q_lens, bs, seed):
    """Scattered block tables covering each sequence's length: a seeded permutation of the pool."""
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(NUM_BLOCKS, generator=g).tolist()
    tables, used = [], 0
    for n in lens:
        nb = -(-n // bs)
        tables.append(perm[used : used + nb])
        used += nb
    assert used <= NUM_BLOCKS
    return tables


def _slots(table, bs, start, end):
    return torch.tensor([table[p // bs] * bs + p % bs for p in range(start, end)], dtype=torch.long)


def _write(storage, table, k, v, start=0):
    """Sequence positions [start, start + len(k)) written through the storage's own write path."""
    bs = storage.block_size
    slots = _slots(table, bs, start, start + k.shape[0])
    index = storage.write_index(slots)
    storage.write(0, index, k, v)


def _sdpa(q, k, v, ctx_len):
    """q [q_len, H, D] at positions [ctx_len - q_len, ctx_len), k / v [ctx_len, KVH, D]: the
    contiguous reference, offset-causal."""
    q_len = q.shape[0]
    pos = torch.arange(ctx_len - q_len, ctx_len)
    mask = torch.arange(ctx_len)[None, :] <= pos[:, None]
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], attn_mask=mask, enable_gqa=True
    )
    return out[0].transpose(0, 1)


def _csr(tables):
    indptr = [0]
    for t in tables:
        indptr.append(indptr[-1] + len(t))
    return indptr, [b for t in tables for b in t]


def _quant_pages(storage, tables):
    indptr, indices = _csr(tables)
    tails = storage.tail_slots(indices).to(torch.int32)
    return QuantPages(storage.k_scale[0], storage.v_scale[0], storage.tail_k[0], storage.tail_v[0], tails.to(DEVICE))


# lengths: a prefill from 0 (whole sequence new), a chunk over a prefix, a decode
LENS = (45, 83, 70)
Q_LENS = (45, 29, 1)


def _case(dtype, num_heads, num_kv_heads, bs, seed, head_dim=D):
    g = torch.Generator().manual_seed(seed)
    tables = _step(LENS, Q_LENS, bs, seed)
    ks = [torch.randn(n, num_kv_heads, head_dim, generator=g, dtype=torch.float64) for n in LENS]
    vs = [torch.randn(n, num_kv_heads, head_dim, generator=g, dtype=torch.float64) for n in LENS]
    qs = [torch.randn(n, num_heads, head_dim, generator=g, dtype=torch.float64) for n in Q_LENS]
    return tables, ks, vs, qs


def _run(storage_k, storage_v, tables, qs, dtype, bs, num_heads, num_kv_heads, quant=None, num_splits=1):
    indptr, indices = _csr(tables)
    plan = plan_extend(Q_LENS, LENS, indptr, indices, bs, num_heads, num_kv_heads, DEVICE, num_splits=num_splits)
    assert plan.num_splits == num_splits
    q = torch.cat(qs).to(DEVICE, dtype)
    scale = qs[0].shape[-1] ** -0.5
    return extend_attention(q, storage_k, storage_v, plan, scale, quant).cpu()


def _reference(qs, ks, vs, dtype):
    pieces = [_sdpa(q.to(dtype), k.to(dtype), v.to(dtype), k.shape[0]) for q, k, v in zip(qs, ks, vs, strict=True)]
    return torch.cat(pieces)


@pytest.mark.parametrize("bs", [16, 32, 64])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(2, 2), (8, 2), (8, 1)])  # GQA groups 1, 4, 8
def test_fp64_pool_is_exact(num_heads, num_kv_heads, bs) -> None:
    tables, ks, vs, qs = _case(torch.float64, num_heads, num_kv_heads, bs, seed=bs + num_heads)
    storage = PagedKVStorage(1, NUM_BLOCKS, bs, num_kv_heads, D, dtype=torch.float64, device=DEVICE)
    for table, k, v in zip(tables, ks, vs, strict=True):
        _write(storage, table, k.to(DEVICE), v.to(DEVICE))
    out = _run(storage.k[0], storage.v[0], tables, qs, torch.float64, bs, num_heads, num_kv_heads)
    assert (out - _reference(qs, ks, vs, torch.float64)).abs().max() < 1e-12


def test_any_block_size_head_dim_and_group() -> None:
    """Block size 5, head dim 24 (padded to 32 in the kernel), 3 query heads per KV head."""
    num_heads, num_kv_heads, bs = 6, 2, 5
    tables, ks, vs, qs = _case(torch.float64, num_heads, num_kv_heads, bs, seed=5, head_dim=24)
    storage = PagedKVStorage(1, NUM_BLOCKS, bs, num_kv_heads, 24, dtype=torch.float64, device=DEVICE)
    for table, k, v in zip(tables, ks, vs, strict=True):
        _write(storage, table, k.to(DEVICE), v.to(DEVICE))
    out = _run(storage.k[0], storage.v[0], tables, qs, torch.float64, bs, num_heads, num_kv_heads)
    assert (out - _reference(qs, ks, vs, torch.float64)).abs().max() < 1e-12


@pytest.mark.parametrize("fmt", [None, "fp8_e4m3"])
def test_keys_split_across_programs_merge_exactly(fmt) -> None:
    """The keys cut into 3 ranges (64 keys each over the longest context, 83), one program
    each, merged by log-sum-exp: in fp64 the same as SDPA to rounding. A prefill's early
    queries see no key of the later ranges (their ranges are empty, weight 0)."""
    num_heads, num_kv_heads, bs = 8, 2, 16
    tables, ks, vs, qs = _case(torch.float64, num_heads, num_kv_heads, bs, seed=23)
    if fmt is None:
        storage = PagedKVStorage(1, NUM_BLOCKS, bs, num_kv_heads, D, dtype=torch.float64, device=DEVICE)
        for table, k, v in zip(tables, ks, vs, strict=True):
            _write(storage, table, k.to(DEVICE), v.to(DEVICE))
        quant = None
    else:
        storage, ks, vs = _quantized(fmt, torch.float64, num_kv_heads, bs, tables, ks, vs)
        quant = _quant_pages(storage, tables)
    out = _run(storage.k[0], storage.v[0], tables, qs, torch.float64, bs, num_heads, num_kv_heads, quant, 3)
    assert (out - _reference(qs, ks, vs, torch.float64)).abs().max() < 1e-12


def _bound(qs, ks, vs, dtype) -> tuple[torch.Tensor, float]:
    """The fp64 reference and the error allowed in `dtype`. fp32: 4x the reference's own
    error (the same SDPA in fp32 against fp64; the kernel sums in another order). bf16 and
    fp16: 2x that, plus the rounding of the probabilities to the dtype before the p @ V
    product (a relative u each, u = 2^-8 in bf16 and 2^-11 in fp16, so at most u max|v| in
    the output), which the GPU's dot needs and SDPA's CPU kernel, summing in fp32, does
    without."""
    exact = _reference(qs, ks, vs, torch.float64)
    own = (_reference(qs, ks, vs, dtype).double() - exact).abs().max().item()
    if dtype == torch.float32:
        return exact, 4 * own
    u = torch.finfo(dtype).eps / 2  # 2^-8 for bf16, 2^-11 for fp16
    return exact, 2 * own + u * max(v.abs().max().item() for v in vs)


@pytest.mark.parametrize(
    ("dtype", "num_heads", "num_kv_heads", "bs"),
    [
        (torch.float32, 2, 2, 16),
        (torch.float32, 8, 2, 32),
        (torch.float32, 8, 1, 64),
        (torch.bfloat16, 2, 2, 64),
        (torch.bfloat16, 8, 2, 16),
        (torch.bfloat16, 8, 1, 32),
        # fp16: the GPU's branch (no WIDEN), 16-bit operands into the interpreter's dot
        (torch.float16, 8, 2, 16),
        (torch.float16, 8, 1, 24),
    ],
)
def test_fp32_and_bf16_pools_within_the_references_own_error(dtype, num_heads, num_kv_heads, bs) -> None:
    tables, ks, vs, qs = _case(dtype, num_heads, num_kv_heads, bs, seed=7 * bs + num_heads)
    # the inputs rounded to the dtype first: both sides then see the same K, V and q
    ks, vs, qs = ([x.to(dtype).double() for x in xs] for xs in (ks, vs, qs))
    storage = PagedKVStorage(1, NUM_BLOCKS, bs, num_kv_heads, D, dtype=dtype, device=DEVICE)
    for table, k, v in zip(tables, ks, vs, strict=True):
        _write(storage, table, k.to(DEVICE, dtype), v.to(DEVICE, dtype))
    out = _run(storage.k[0], storage.v[0], tables, qs, dtype, bs, num_heads, num_kv_heads)
    exact, bound = _bound(qs, ks, vs, dtype)
    err = (out.double() - exact).abs().max().item()
    assert 0 < bound and err <= bound, (err, bound)


def _quantized(fmt, compute, num_kv_heads, bs, tables, ks, vs):
    """A quantized pool written chunk by chunk as steps would (each sequence's prefix, then
    its step's chunk), and each sequence's K / V as the storage's torch path dequantizes them."""
    storage = QuantizedKVStorage(1, NUM_BLOCKS, bs, num_kv_heads, D, kv_schema(fmt), compute, device=DEVICE)
    for table, k, v, q_len in zip(tables, ks, vs, Q_LENS, strict=True):
        prefix = k.shape[0] - q_len
        if prefix:
            _write(storage, table, k[:prefix].to(DEVICE, compute), v[:prefix].to(DEVICE, compute))
        _write(storage, table, k[prefix:].to(DEVICE, compute), v[prefix:].to(DEVICE, compute), start=prefix)
    seen = [storage.contiguous(0, table, k.shape[0]) for table, k in zip(tables, ks, strict=True)]
    kd = [kc.transpose(0, 1).double().cpu() for kc, _ in seen]  # [len, KVH, D]
    vd = [vc.transpose(0, 1).double().cpu() for _, vc in seen]
    return storage, kd, vd


@pytest.mark.parametrize(
    ("fmt", "num_heads", "num_kv_heads", "bs"),
    [
        ("fp8_e4m3", 2, 2, 16),
        ("fp8_e4m3", 8, 2, 32),
        ("fp8_e4m3", 8, 1, 64),
        ("fp8_e4m3_token", 8, 2, 16),
        ("int8", 4, 1, 32),
    ],
)
def test_8bit_pools_read_in_place_exact_in_fp64(fmt, num_heads, num_kv_heads, bs) -> None:
    """Codes times scales in registers, the unfinished blocks from the tails: the same values
    the storage's torch path dequantizes, exactly (fp64 compute)."""
    tables, ks, vs, qs = _case(torch.float64, num_heads, num_kv_heads, bs, seed=11 * bs + num_heads)
    storage, kd, vd = _quantized(fmt, torch.float64, num_kv_heads, bs, tables, ks, vs)
    if fmt == "fp8_e4m3":
        assert storage.num_tails > 0  # lengths 45, 83, 70: some last blocks are read from tails
    quant = _quant_pages(storage, tables)
    out = _run(storage.k[0], storage.v[0], tables, qs, torch.float64, bs, num_heads, num_kv_heads, quant)
    assert (out - _reference(qs, kd, vd, torch.float64)).abs().max() < 1e-12
    # and the quantization is real: against the unquantized K / V the error is fp8's
    assert (out - _reference(qs, ks, vs, torch.float64)).abs().max() > 1e-4


@pytest.mark.parametrize(("compute", "bs"), [(torch.float32, 16), (torch.bfloat16, 32)])
def test_fp8_pool_in_fp32_and_bf16(compute, bs) -> None:
    num_heads, num_kv_heads = 8, 2
    tables, ks, vs, qs = _case(compute, num_heads, num_kv_heads, bs, seed=13 * bs)
    qs = [x.to(compute).double() for x in qs]
    storage, kd, vd = _quantized("fp8_e4m3", compute, num_kv_heads, bs, tables, ks, vs)
    quant = _quant_pages(storage, tables)
    out = _run(storage.k[0], storage.v[0], tables, qs, compute, bs, num_heads, num_kv_heads, quant)
    exact, bound = _bound(qs, kd, vd, compute)
    err = (out.double() - exact).abs().max().item()
    assert 0 < bound and err <= bound, (err, bound)


@pytest.mark.parametrize("fmt", [None, "fp8_e4m3"])
def test_extend_over_a_copy_on_write_tail(fmt) -> None:
    """Sequence A holds 40 tokens (blocks of 16: the last holds 8); B forks it, its partly
    filled last block copied on write, and extends by 30 tokens from position 40 while A
    writes 5 other tokens into its own last block. B must read the copy: A's 8 shared
    tokens, then its own."""
    bs, num_heads, num_kv_heads = 16, 8, 2
    dtype = torch.float64
    g = torch.Generator().manual_seed(3)
    a_table, b_table = [7, 2, 11], [7, 2, 5, 9, 0]  # B: A's two full blocks, the copy (5), two more
    k_a, v_a = (torch.randn(45, num_kv_heads, D, generator=g, dtype=dtype) for _ in range(2))
    k_b, v_b = (torch.randn(70, num_kv_heads, D, generator=g, dtype=dtype) for _ in range(2))
    k_b[:40], v_b[:40] = k_a[:40], v_a[:40]  # the shared prefix
    if fmt is None:
        storage = PagedKVStorage(1, NUM_BLOCKS, bs, num_kv_heads, D, dtype=dtype, device=DEVICE)
    else:
        storage = QuantizedKVStorage(1, NUM_BLOCKS, bs, num_kv_heads, D, kv_schema(fmt), dtype, device=DEVICE)
    _write(storage, a_table, k_a[:40], v_a[:40])
    storage.apply_copies([BlockCopy(11, 5)])
    slots = torch.cat([_slots(a_table, bs, 40, 45), _slots(b_table, bs, 40, 70)])
    index = storage.write_index(slots)
    storage.write(0, index, torch.cat([k_a[40:], k_b[40:]]), torch.cat([v_a[40:], v_b[40:]]))
    tables, lens, q_lens = [a_table, b_table], (45, 70), (5, 30)
    if fmt is None:
        kd, vd, quant = [k_a, k_b], [v_a, v_b], None
    else:  # A's last block is still a tail; B's copy filled and was quantized
        assert storage.tail_slots([11, 5]).tolist()[1] == -1 and storage.tail_slots([11]).tolist()[0] >= 0
        seen = [storage.contiguous(0, t, n) for t, n in zip(tables, lens, strict=True)]
        kd = [kc.transpose(0, 1).cpu() for kc, _ in seen]
        vd = [vc.transpose(0, 1).cpu() for _, vc in seen]
        quant = _quant_pages(storage, tables)
    qs = [torch.randn(n, num_heads, D, generator=g, dtype=dtype) for n in q_lens]
    indptr, indices = _csr(tables)
    plan = plan_extend(q_lens, lens, indptr, indices, bs, num_heads, num_kv_heads, DEVICE)
    out = extend_attention(torch.cat(qs).to(DEVICE), storage.k[0], storage.v[0], plan, D**-0.5, quant).cpu()
    ref = torch.cat([_sdpa(q, k, v, n) for q, k, v, n in zip(qs, kd, vd, lens, strict=True)])
    assert (out - ref).abs().max() < 1e-12


def test_bad_tables_are_named() -> None:
    with pytest.raises(ValueError, match="sequence 1: 2 blocks do not cover exactly 40 tokens"):
        plan_extend([3, 4], [10, 40], [0, 1, 3], [4, 5, 6], 16, 8, 2, "cpu")
    with pytest.raises(ValueError, match="sequence 0: q_len 11 must be in"):
        plan_extend([11], [10], [0, 1], [4], 16, 8, 2, "cpu")
    with pytest.raises(ValueError, match="not a multiple of 3 KV heads"):
        plan_extend([1], [10], [0, 1], [4], 16, 8, 3, "cpu")


def _plan_fields(plan) -> tuple:
    """Every field of an ExtendPlan, its tensors as lists (the flat table: its identity)."""
    out = []
    for name in plan._fields:
        value = getattr(plan, name)
        if name == "kv_indices":
            out.append(id(value))
        elif isinstance(value, torch.Tensor):
            out.append((name, value.dtype, value.tolist()))
        else:
            out.append((name, value))
    return tuple(out)


@settings(max_examples=150, deadline=None)
@given(
    chunks=st.lists(st.tuples(st.integers(1, 300), st.integers(0, 500), st.integers(0, 40)), min_size=0, max_size=6),
    first_row=st.integers(0, 200),
    heads=st.sampled_from([(8, 2), (4, 4), (6, 2), (32, 8)]),
    bs=st.sampled_from([1, 16, 32]),
    explicit_rows=st.booleans(),
)
def test_a_few_dense_sequences_plan_as_the_numpy_path(chunks, first_row, heads, bs, explicit_rows) -> None:
    """The few-sequence dense plan (`_plan_few`, listed in Python: what a step buffers' plan
    of a step's prompt chunks takes) equals the numpy path's tables, its twin (FEW_SEQS 0
    sends every plan there): query rows given or following from first_row."""
    q_lens = [q for q, _, _ in chunks]
    ctx_lens = [q + prefix for q, prefix, _ in chunks]
    offsets = np.array([row * 40 for _, _, row in chunks], dtype=np.int32)
    flat = torch.zeros(41 * 40, dtype=torch.int32)
    q_rows = list(accumulate(q_lens, initial=first_row))[:-1] if explicit_rows else None
    num_rows = first_row + sum(q_lens) + 3
    args = (q_lens, ctx_lens, offsets, flat, bs, *heads, "cpu")
    few = plan_extend(*args, q_rows=q_rows, num_rows=num_rows, first_row=0 if explicit_rows else first_row)
    with patch.object(triton_extend, "FEW_SEQS", -1):
        twin = plan_extend(*args, q_rows=q_rows, num_rows=num_rows, first_row=0 if explicit_rows else first_row)
    assert _plan_fields(few) == _plan_fields(twin)
    assert few.num_bytes == twin.num_bytes
    # the step buffers' plan area holds the same tables; every plan's tables start 16-byte
    # aligned in their buffers (one compiled kernel for every step: TABLE_ALIGN)
    buffers = StepBuffers(max_num_seqs=8, max_num_tokens=2048, max_blocks_per_seq=2, block_size=16)
    stored = plan_extend(
        *args, q_rows=q_rows, num_rows=num_rows, first_row=0 if explicit_rows else first_row, store=buffers.plan_tables
    )
    assert _plan_fields(stored) == _plan_fields(few)
    for plan in (few, twin, stored):
        assert _misaligned_tables(plan) == []


@settings(max_examples=40, deadline=None)
@given(
    steps=st.lists(
        st.tuples(st.sampled_from([(16,), (16, 3), (40,), (5,)]), st.integers(0, 30), st.integers(0, 4)),
        min_size=1,
        max_size=12,
    )
)
def test_a_kept_few_plan_equals_a_new_one_each_step(steps) -> None:
    """`plan_few_kept` over a run of steps whose chunk shapes repeat (its kept plans) and
    change (another shape's tables overwrite the area between): after each step the plan it
    returns, kept or new, holds what `plan_extend` of that step alone lists (its twin, in
    other buffers), and its bytes are the twin's less the flat table's."""
    buffers = StepBuffers(max_num_seqs=8, max_num_tokens=256, max_blocks_per_seq=4, block_size=16)
    flat = buffers.block_tables_flat
    kept: dict = {}
    for q_lens, prefix, num_decodes in steps:
        q_lens = list(q_lens)
        ctx_lens = [q + prefix for q in q_lens]
        offsets = [((prefix + 7 * i) % 8) * 4 for i in range(len(q_lens))]  # (rows of the 8)
        num_rows = num_decodes + sum(q_lens)
        plan, num_bytes = plan_few_kept(
            kept, q_lens, ctx_lens, offsets, flat, 4, num_rows, num_decodes, buffers.plan_tables
        )
        twin_buffers = StepBuffers(max_num_seqs=8, max_num_tokens=256, max_blocks_per_seq=4, block_size=16)
        twin = plan_extend(
            q_lens, ctx_lens, np.array(offsets), twin_buffers.block_tables_flat, 16, 8, 2, "cpu",
            num_rows=num_rows, first_row=num_decodes, store=twin_buffers.plan_tables,
        )  # fmt: skip
        want = _plan_fields(twin)
        assert (
            _plan_fields(plan)[:3] == want[:3] and _plan_fields(plan)[4:] == want[4:]
        )  # (kv_indices: its own flat table)
        assert num_bytes == twin.num_bytes - twin.kv_indices.nbytes
    assert len(kept) == len({(d + sum(q), d, q, p) for q, p, d in steps})
    with pytest.raises(ValueError, match=r"sequence 0: q_len 16 must be in \[1, ctx_len 10\]"):
        plan_few_kept({}, [16], [10], [0], flat, 4, 16, 0, buffers.plan_tables)
    with pytest.raises(ValueError, match="1 q_lens, 1 ctx_lens and 2 indptr entries disagree"):
        plan_few_kept(kept, [16], [16], [0, 4], flat, 4, 16, 0, buffers.plan_tables)


def _misaligned_tables(plan) -> list[str]:
    """The plan's int32 tables that do not start on a 16-byte boundary of their buffer."""
    return [
        name
        for name, value in plan._asdict().items()
        if isinstance(value, torch.Tensor) and value.storage_offset() * value.element_size() % 16
    ]


@settings(max_examples=60, deadline=None)
@given(
    lens=st.lists(st.tuples(st.integers(1, 70), st.integers(0, 90)), min_size=1, max_size=7),
    num_splits=st.sampled_from([1, 2, 3]),
)
def test_every_plan_table_starts_16_byte_aligned(lens, num_splits) -> None:
    """Triton compiles a kernel again for each pattern of its pointer arguments' 16-byte
    alignment: CSR plans, split or not, cut their tables from one buffer at offsets the
    step's lengths decide, so each table is padded to start aligned (TABLE_ALIGN). Without
    the padding, lengths like these give several patterns."""
    bs = 16
    q_lens = [q for q, _ in lens]
    ctx_lens = [q + prefix for q, prefix in lens]
    counts = [-(-c // bs) for c in ctx_lens]
    indptr = list(accumulate(counts, initial=0))
    indices = list(range(indptr[-1]))
    plan = plan_extend(q_lens, ctx_lens, indptr, indices, bs, 8, 2, "cpu", num_splits=num_splits)
    assert _misaligned_tables(plan) == []
    assert plan.kv_indices.tolist() == indices and plan.q_lens.tolist() == q_lens
    assert plan.kv_indptr.tolist() == indptr and plan.ctx_lens.tolist() == ctx_lens


def test_a_few_dense_sequences_name_bad_lengths_as_the_numpy_path() -> None:
    flat = torch.zeros(80, dtype=torch.int32)
    for few_seqs in (triton_extend.FEW_SEQS, -1):
        with patch.object(triton_extend, "FEW_SEQS", few_seqs):
            with pytest.raises(ValueError, match=r"sequence 1: q_len 11 must be in \[1, ctx_len 10\]"):
                plan_extend([3, 11], [10, 10], np.array([0, 40]), flat, 16, 8, 2, "cpu")
            with pytest.raises(ValueError, match="2 q_lens, 2 ctx_lens and 1 indptr entries disagree"):
                plan_extend([3, 4], [10, 10], np.array([0]), flat, 16, 8, 2, "cpu")
            # (rows that do not overlap: rows [0, 2] overlap too, which is named first now)
            with pytest.raises(ValueError, match=r"query rows \[0, 3\] with lengths \[3, 4\] do not fit 5 rows"):
                plan_extend([3, 4], [10, 10], np.array([0, 40]), flat, 16, 8, 2, "cpu", q_rows=[0, 3], num_rows=5)


@pytest.mark.parametrize(
    ("q_rows", "message"),
    [
        ([0, 1, 9], r"sequences 0 and 1 overlap in query rows: \[0, 3\) and \[1, 5\)"),
        ([9, 0, 2], r"sequences 1 and 2 overlap in query rows: \[0, 4\) and \[2, 4\)"),
        ([4, 9, 3], r"sequences 0 and 2 overlap in query rows: \[4, 7\) and \[3, 5\)"),
        ([5, 5, 0], r"sequences 0 and 1 overlap in query rows: \[5, 8\) and \[5, 9\)"),
        ([0, 3, 7], None),  # (one after another)
        ([8, 4, 0], None),  # (disjoint, in another order)
    ],
)
def test_overlapping_query_rows_are_refused_by_name(q_rows, message) -> None:
    """Two sequences whose query rows overlap would write the same output rows (the later
    program winning, silently): every path refuses them, naming both sequences and their
    rows (CSR tables, dense tables through numpy and through the few-sequence lists).
    Disjoint rows in any order plan as before."""
    q_lens, ctx_lens = [3, 4, 2], [10, 10, 10]
    flat = torch.zeros(120, dtype=torch.int32)
    plans = []
    for kind in ("csr", "dense", "few"):
        if kind == "csr":
            args = (q_lens, ctx_lens, [0, 1, 2, 3], [0, 1, 2], 16, 8, 2, "cpu")
        else:
            args = (q_lens, ctx_lens, np.array([0, 40, 80]), flat, 16, 8, 2, "cpu")
        with patch.object(triton_extend, "FEW_SEQS", triton_extend.FEW_SEQS if kind == "few" else -1):
            if message is None:
                plans.append(plan_extend(*args, q_rows=q_rows, num_rows=13))
            else:
                with pytest.raises(ValueError, match=message):
                    plan_extend(*args, q_rows=q_rows, num_rows=13)
    if plans:
        assert plans[0].q_rows.tolist() == q_rows
        assert _plan_fields(plans[1]) == _plan_fields(plans[2])


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "fp8_e4m3_token"])
def test_quantized_backend_steps_equal_the_dequantizing_torch_path(fmt) -> None:
    """Three steps of two sequences through TritonQuantBackend and through DequantBackend
    (dequantize, then torch attention), each on its own pool fed the same K / V, 2 layers,
    fp64 compute: prefills (A 40 tokens, its last block a tail; B 20), then A's decode with
    B's chunk over its prefix, then two decodes (unsplit: the rule, at 132 SMs, finds these
    contexts too short; the split itself: test_keys_split_across_programs_merge_exactly)."""
    from kvpool.attention.backends import PagedStepMetadata
    from kvpool.attention.backends.quant import DequantBackend
    from kvpool.attention.backends.triton_quant import TritonQuantBackend

    bs, num_heads, num_kv_heads, num_layers = 16, 8, 2, 2
    dtype = torch.float64
    tables = {"A": [9, 3, 20, 14], "B": [5, 27, 1, 11]}
    pools = [
        QuantizedKVStorage(num_layers, 32, bs, num_kv_heads, D, kv_schema(fmt), dtype, device=DEVICE) for _ in range(2)
    ]
    triton_backend = TritonQuantBackend(pools[0], num_heads, None, dtype)
    torch_backend = DequantBackend(pools[1], num_heads, None, dtype, decode_path="bags")
    g = torch.Generator().manual_seed(17)
    for spans in ({"A": (0, 40), "B": (0, 20)}, {"A": (40, 41), "B": (20, 50)}, {"A": (41, 42), "B": (50, 51)}):
        q_lens = [end - start for start, end in spans.values()]
        ctx_lens = [end for _, end in spans.values()]
        slots = torch.cat([_slots(tables[s], bs, start, end) for s, (start, end) in spans.items()]).tolist()
        covering = [tables[s][: -(-end // bs)] for s, (_, end) in spans.items()]
        indptr, indices = _csr(covering)
        meta = PagedStepMetadata(q_lens, ctx_lens, slots, indptr, indices)
        steps = [triton_backend.begin_step(meta), torch_backend.begin_step(meta)]
        if fmt == "fp8_e4m3" and spans["A"] == (0, 40):
            assert pools[0].num_tails == 2  # A's block 20 and B's block 27 are partly written
        n = sum(q_lens)
        for layer in range(num_layers):
            q = torch.randn(n, num_heads, D, generator=g, dtype=dtype)
            k, v = (torch.randn(n, num_kv_heads, D, generator=g, dtype=dtype) for _ in range(2))
            got = steps[0].attend(layer, q.to(DEVICE), k.to(DEVICE), v.to(DEVICE)).cpu()
            want = steps[1].attend(layer, q.to(DEVICE), k.to(DEVICE), v.to(DEVICE)).cpu()
            assert (got - want).abs().max() < 1e-12
    assert steps[0].decode_path == "triton" and steps[0].prefill_bytes == 0


def test_quantized_backend_refuses_what_it_cannot_read() -> None:
    from kvpool.attention.backends.triton_quant import TritonQuantBackend

    kivi = QuantizedKVStorage(1, 4, 16, 2, D, kv_schema("kivi4-g16-r16"), torch.float32)
    with pytest.raises(ValueError, match="8-bit codes with per-token or per-block fp32 scales, not kivi4"):
        TritonQuantBackend(kivi, 8, None, torch.float32)
    fp8 = QuantizedKVStorage(1, 4, 16, 2, D, kv_schema("fp8_e4m3"), torch.float32)
    with pytest.raises(ValueError, match="attends by its kernel, not by 'bags'"):
        TritonQuantBackend(fp8, 8, None, torch.float32, decode_path="bags")
    with pytest.raises(ValueError, match="num_sms and num_splits must be positive, got 132, 0"):
        TritonQuantBackend(fp8, 8, None, torch.float32, num_splits=0)


def test_an_8bit_pool_off_the_cpu_is_paged_q8_and_gets_the_triton_backend(monkeypatch) -> None:
    """The format key follows the device: on the CPU "paged-q8" is what the C kernel reads
    (fp32 compute), elsewhere what the Triton kernel reads (any compute dtype)."""
    import kvpool.attention.backends as backends
    from kvpool.attention.backends import TritonQuantBackend, paged_format, select_backend
    from kvpool.attention.backends.quant import DequantBackend

    def pool(fmt: str, compute: torch.dtype, device: str) -> QuantizedKVStorage:
        return QuantizedKVStorage(1, 4, 16, 2, D, kv_schema(fmt), compute, device=device)

    assert paged_format(pool("fp8_e4m3", torch.bfloat16, "meta")) == "paged-q8"
    assert paged_format(pool("int8", torch.float16, "meta")) == "paged-q8"
    assert paged_format(pool("kivi4-g16-r16", torch.bfloat16, "meta")) == "paged-quantized"
    assert paged_format(pool("fp8_e4m3", torch.bfloat16, "cpu")) == "paged-quantized"
    assert paged_format(pool("fp8_e4m3", torch.float32, "cpu")) == "paged-q8"
    assert select_backend("full", "paged-q8", "cuda").backend is TritonQuantBackend
    monkeypatch.setattr(backends, "triton_importable", lambda: False)  # passed over without triton
    assert select_backend("full", "paged-q8", "cuda").backend is DequantBackend


# The kernel compiled for an H100 / H200 (sm_90) by Triton's own compiler and ptxas, no GPU
# needed: what the interpreter runs but the compiler refuses fails here. In a child process
# without TRITON_INTERPRET (an interpreted kernel cannot be compiled).
AOT = """
import triton, triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kvpool.attention.backends.triton_extend import _extend_kernel as fn

names = ("TileSeq", "TileStart", "QRows", "QLens", "KvIndptr", "KvIndices", "KvTails", "CtxLens", "PartRows")
kvh, d, page = 8, 128, 16
# a launch's strides (K [blocks, 8, 128, 16], V [blocks, 8, 16, 128], scales [blocks, 8, 1]), which it
# specialises on: 1 as a constant, multiples of 16 as such (and pointers 16-byte aligned)
strides = dict(s_qn=32 * d, s_qh=d, s_on=32 * d, s_oh=d, s_kb=kvh * d * page, s_kh=d * page, s_kd=page, s_ks=1,
               s_vb=kvh * d * page, s_vh=d * page, s_vs=d, s_vd=1, s_sb=kvh, s_sh=1, s_ss=0, split_len=64)
for t in ("k", "v"):
    strides.update({f"s_t{t}{a[-1]}": v for a, v in strides.items() if a.startswith(f"s_{t}")})
cases = (("*bf16", "*bf16", False, False, 16, 1), ("*fp32", "*fp32", False, False, 16, 1),
         ("*bf16", "*fp8e4nv", True, True, 16, 1), ("*bf16", "*fp8e4nv", True, True, 4, 4))
for q, pages, quant, tails, block_m, splits in cases:  # block_m 4: a step of decodes, 16 rows
    types = dict.fromkeys(names, "*i32")
    types.update(Q=q, Out=q, K=pages, V=pages, KScale="*fp32", VScale="*fp32", TailK=q, TailV=q)
    types.update(Part="*fp32", Lse="*fp32", sm_scale="fp32")
    consts = dict(HEAD_DIM=d, BLOCK_D=d, GROUP=4, GROUP_P=4, BLOCK_M=block_m, BLOCK_N=64, PAGE=page, QUANT=quant,
                  ACC=tl.float32, TAILS=tails, WIDEN=False, NUM_SPLITS=splits)
    consts.update({a: 1 for a, v in strides.items() if v == 1})
    signature = {a: "constexpr" if a in consts else types.get(a, "i32") for a in fn.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(fn.arg_names)
             if signature[a].startswith("*") or (signature[a] == "i32" and strides.get(a, 1) % 16 == 0)}
    kernel = triton.compile(ASTSource(fn, signature, consts, attrs), target=GPUTarget("cuda", 90, 32))
    ptx = kernel.asm["ptx"]
    assert kernel.asm["cubin"], (q, pages)
    if not quant:  # the K^T and V tiles in 16-byte vectors, no element loaded alone
        assert "ld.global.b16" not in ptx and ptx.count("cp.async.cg.shared.global") >= 32, (q, pages)
print("compiled")
"""


def test_the_extend_kernel_compiles_for_sm90() -> None:
    """bf16 and fp32 pools, fp8 e4m3 codes with block scales and tails (bf16 compute; chunks,
    and decodes: 16 rows, their keys split in 4), Llama-3.1-8B's head dim and GQA group, with
    the specialisations a launch makes; unquantized, the K^T and V tiles load as 16-byte
    vectors (a per-key mask made bf16 K^T 64 two-byte loads a thread a tile)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parents[1] / "src"), env.get("PYTHONPATH", "")])
    run = subprocess.run([sys.executable, "-c", AOT], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and "compiled" in run.stdout, run.stderr[-3000:]


def test_the_extend_launches_of_smollm2_and_every_8_bit_format_compile_for_sm90() -> None:
    """The extend kernel as `--device cuda` launches it on SmolLM2-135M's shape, compiled for
    sm_90 by launching the backends' own code with each launch compiling instead of running
    (tests/sm90_launches.py: the constexprs and argument specialisations are the launch's):
    a mixed step from the step buffers in bf16, fp16 and fp32, and TritonQuantBackend's steps
    on every 8-bit format it reads in place (fp8_e4m3, fp8_e5m2, their per-token twins,
    int8; bf16 compute, with and without tails, and a long decode whose keys the rule
    splits)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parents[1] / "src"), env.get("PYTHONPATH", "")])
    script = str(Path(__file__).parent / "sm90_launches.py")
    run = subprocess.run([sys.executable, script, "extend"], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and "compiled" in run.stdout, run.stderr[-3000:]
