"""Hostile checks of the attention kernels (attention/backends/triton_decode.py,
triton_extend.py) against an independent reference: each sequence's keys and values
gathered token by token through its block table (position t in block table[t // bs], slot
t % bs) into contiguous tensors, then a plain softmax in fp64. Triton runs in its
interpreter on a machine without a GPU (tests/conftest.py sets TRITON_INTERPRET=1).

What tests/test_triton_kernels.py and tests/test_triton_extend.py leave out: pools whose
slots past a sequence's end hold what an earlier owner of the block wrote (inf, NaN), block
ids repeated across and within tables, block sizes 1 and odd, head dims not a power of two,
more splits than a sequence has tokens, drawn at random.

Tolerances: fp64 1e-12 (a wrong key or slot moves an output by ~|v| / n, far above);
fp32 4x the same reference's own fp32 error against fp64 plus 16 ulps of max|v| (the
kernel sums in another order).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed (bash setup.sh test installs it)", allow_module_level=True)

from kvpool.attention.backends import triton_decode, triton_extend  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu" and not triton_decode.interpreted():
    raise RuntimeError("no GPU, and triton was imported without TRITON_INTERPRET=1 (tests/conftest.py sets it)")
I32 = torch.int32


def _gather(k_cache, v_cache, table, n):
    """Sequence keys and values [n, KVH, D], token by token through the table (no view tricks)."""
    bs = v_cache.shape[2]
    k = torch.stack([k_cache[table[t // bs], :, :, t % bs] for t in range(n)])
    v = torch.stack([v_cache[table[t // bs], :, t % bs, :] for t in range(n)])
    return k, v


def _attend(q, k, v, scale):
    """q [q_len, H, D] at positions [n - q_len, n) over k, v [n, KVH, D], causal: a plain
    softmax in q's dtype, the GQA group of head h is KV head h // (H / KVH)."""
    q_len, h, _ = q.shape
    n, kvh, _ = k.shape
    kk = k.repeat_interleave(h // kvh, 1)  # [n, H, D]
    vv = v.repeat_interleave(h // kvh, 1)
    scores = torch.einsum("qhd,nhd->hqn", q, kk) * scale
    pos = torch.arange(n - q_len, n)
    scores = scores.masked_fill(torch.arange(n)[None, None, :] > pos[None, :, None], float("-inf"))
    return torch.einsum("hqn,nhd->qhd", torch.softmax(scores, dim=-1), vv)


def _reference(q_rows, k_cache, v_cache, tables, lens, scale, dtype):
    """Every sequence's output [q_len, H, D] in `dtype`, in the order given."""
    out = []
    for q, table, n in zip(q_rows, tables, lens, strict=True):
        k, v = _gather(k_cache.to(dtype), v_cache.to(dtype), table, n)
        out.append(_attend(q.to(dtype), k, v, scale))
    return out


def _csr(tables):
    indptr = [0]
    for t in tables:
        indptr.append(indptr[-1] + len(t))
    return indptr, [b for t in tables for b in t]


def _poison(k_cache, v_cache, tables, lens, value):
    """Every slot past each sequence's end in its last block set to `value` (an earlier
    owner's stale keys and values), except slots some sequence does read."""
    bs = v_cache.shape[2]
    read = {(table[t // bs], t % bs) for table, n in zip(tables, lens, strict=True) for t in range(n)}
    for table, n in zip(tables, lens, strict=True):
        last = table[(n - 1) // bs]
        for slot in range(bs):
            if (last, slot) not in read:
                k_cache[last, :, :, slot] = value
                v_cache[last, :, slot, :] = value


@pytest.mark.parametrize("value", [float("inf"), float("-inf"), float("nan")])
@pytest.mark.parametrize("num_splits", [1, 2])
def test_stale_non_finite_slots_past_the_end_change_nothing(value, num_splits) -> None:
    """A freed block keeps what its last owner wrote; a fp16 model whose activations
    overflowed wrote inf there (or NaN). The next owner's sequence ends inside it: the
    kernels read the whole last block (their vector loads) but must weigh nothing past the
    end. Decode (CSR and dense) and extend (a prefill, a chunk over a prefix, a decode),
    each split or not: the same output as over a clean pool, bit for bit, in fp64.
    (The extend kernel once masked V by whole blocks: 0 * inf = NaN in p @ V.)"""
    bs, kvh, h, d = 16, 2, 8, 32
    lens, q_lens = [5, 40, 23], [5, 9, 1]
    tables = [[3], [7, 1, 6], [0, 4]]
    g = torch.Generator().manual_seed(1)
    k_cache = torch.randn(8, kvh, d, bs, generator=g, dtype=torch.float64)
    v_cache = torch.randn(8, kvh, bs, d, generator=g, dtype=torch.float64)
    q = torch.randn(sum(q_lens), h, d, generator=g, dtype=torch.float64)
    dirty_k, dirty_v = k_cache.clone(), v_cache.clone()
    _poison(dirty_k, dirty_v, tables, lens, value)
    assert not torch.isfinite(dirty_v).all()
    indptr, indices = _csr(tables)
    plan = triton_extend.plan_extend(q_lens, lens, indptr, indices, bs, h, kvh, DEVICE, num_splits=num_splits)
    clean = triton_extend.extend_attention(q, k_cache, v_cache, plan, d**-0.5)
    dirty = triton_extend.extend_attention(q, dirty_k, dirty_v, plan, d**-0.5)
    assert torch.isfinite(clean).all()
    assert torch.equal(clean, dirty), "stale slots past a sequence's end reached the extend's output"
    # the decodes: one query each, the last of each sequence's rows
    last_rows = torch.tensor([sum(q_lens[: i + 1]) - 1 for i in range(3)], dtype=I32)
    last_len = torch.tensor([n - (len(t) - 1) * bs for t, n in zip(tables, lens, strict=True)], dtype=I32)
    ptr, idx = torch.tensor(indptr, dtype=I32), torch.tensor(indices, dtype=I32)
    outs = []
    for kc, vc in ((k_cache, v_cache), (dirty_k, dirty_v)):
        out = torch.zeros_like(q)
        triton_decode.paged_decode(q, last_rows, ptr, idx, last_len, kc, vc, d**-0.5, out, num_splits)
        dense = torch.zeros_like(q)
        block_tables = torch.tensor([t + [0] * (3 - len(t)) for t in tables], dtype=I32)
        seq_rows, ctx = torch.arange(3, dtype=I32), torch.tensor(lens, dtype=I32)
        triton_decode.paged_decode_dense(q, last_rows, seq_rows, block_tables, ctx, kc, vc, d**-0.5, dense, num_splits)
        outs.append((out, dense))
    assert torch.isfinite(outs[0][0]).all()
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    # and the clean outputs are the reference's
    qs = list(q.split(q_lens))
    ref = torch.cat(_reference(qs, k_cache, v_cache, tables, lens, d**-0.5, torch.float64))
    assert (clean - ref).abs().max() < 1e-12
    assert (outs[0][0][last_rows.long()] - ref[last_rows.long()]).abs().max() < 1e-12


def _stale_step(storage, value):
    """A step over a pool whose blocks an earlier owner filled with `value` (every slot,
    through the storage's own write) and freed: a prefill from 0 (5 tokens in block 3), a
    chunk over a 31-token prefix (40 tokens, blocks 7, 1, 6), a decode (23 tokens, blocks 0,
    4). -> the step's metadata and its q, k, v [N, heads, D] fp64."""
    from kvpool.attention.backends.paged_step import PagedStepMetadata

    bs, kvh, d = storage.block_size, storage.num_kv_heads, storage.head_dim
    lens, q_lens, tables = [5, 40, 23], [5, 9, 1], [[3], [7, 1, 6], [0, 4]]
    g = torch.Generator().manual_seed(4)
    if value is not None:  # the earlier owner's whole blocks
        slots = torch.tensor([b * bs + s for t in tables for b in t for s in range(bs)])
        stale = torch.full((len(slots), kvh, d), value, dtype=torch.float64).to(storage.k.dtype)
        storage.write(0, storage.write_index(slots), stale, stale)
    for table, n, q_len in zip(tables, lens, q_lens, strict=True):  # the prefixes, written earlier
        if n > q_len:
            slots = torch.tensor([table[p // bs] * bs + p % bs for p in range(n - q_len)])
            k, v = (torch.randn(n - q_len, kvh, d, generator=g, dtype=torch.float64) for _ in range(2))
            storage.write(0, storage.write_index(slots), k.to(storage.k.dtype), v.to(storage.k.dtype))
    slots = [t[p // bs] * bs + p % bs for t, n, ql in zip(tables, lens, q_lens, strict=True) for p in range(n - ql, n)]
    indptr, indices = _csr(tables)
    meta = PagedStepMetadata(q_lens, lens, slots, indptr, indices)
    n = sum(q_lens)
    q = torch.randn(n, 4 * kvh, d, generator=g, dtype=torch.float64)
    k, v = (torch.randn(n, kvh, d, generator=g, dtype=torch.float64) for _ in range(2))
    return meta, q, k, v


@pytest.mark.parametrize("value", [float("inf"), float("nan")])
@pytest.mark.parametrize("path", ["bags", "padded", "native", "dequant-bags", "dequant-padded", "q8-native"])
def test_the_torch_and_c_paths_weigh_nothing_past_a_sequences_end(path, value, request) -> None:
    """The CPU backends on the step of `_stale_step`: the same output over blocks an earlier
    owner filled with inf or NaN as over fresh (zeroed) ones. The bags and padded decodes
    read whole blocks and masked the slots past a length by adding -inf to their scores (inf
    + -inf = NaN) and weighing their values by 0 (0 * inf = NaN): the decode row came out
    NaN. (The quantized pool's partly written block is read from its tail, which the
    earlier owner's codes never reach: held before the fix too.)"""
    from kvpool.attention.backends.native import NativeBackend
    from kvpool.attention.backends.quant import DequantBackend, QuantNativeBackend
    from kvpool.attention.backends.torch_paged import TorchPagedBackend
    from kvpool.spec.kv_formats import kv_schema
    from kvpool.storage.kv import PagedKVStorage, QuantizedKVStorage

    kernels = request.getfixturevalue("kernels") if "native" in path else None
    dtype = torch.float32 if "native" in path else torch.float64  # (the C kernels' pools are fp32)
    outs = []
    for value_ in (None, value):
        if path.startswith(("dequant", "q8")):
            storage = QuantizedKVStorage(1, 8, 16, 2, 32, kv_schema("fp8_e4m3"), dtype, "cpu")
        else:
            storage = PagedKVStorage(1, 8, 16, 2, 32, dtype, "cpu", kernels if path == "native" else None)
        meta, q, k, v = _stale_step(storage, value_)
        if path == "native":
            backend = NativeBackend(storage, 8, kernels, dtype)
        elif path == "q8-native":
            backend = QuantNativeBackend(storage, 8, kernels, dtype)
        elif path.startswith("dequant"):
            backend = DequantBackend(storage, 8, None, dtype, decode_path=path.split("-")[1])
        else:
            backend = TorchPagedBackend(storage, 8, None, dtype, decode_path=path)
        outs.append(backend.begin_step(meta).attend(0, q.to(dtype), k.to(dtype), v.to(dtype)).clone())
    assert torch.isfinite(outs[0]).all()
    bad = (~torch.isfinite(outs[1])).any(-1).any(-1).nonzero().flatten().tolist()
    assert not bad, f"rows {bad} read an earlier owner's {value} past their sequence's end"
    assert torch.equal(outs[0], outs[1])
