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
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

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
@pytest.mark.parametrize(
    "path",
    [
        "bags",
        "padded",
        "native",
        "dequant-bags",
        "dequant-padded",
        "q8-native",
        "triton",
        "triton-q8",
        "triton-q8-token",
    ],
)
def test_every_paged_backend_weighs_nothing_past_a_sequences_end(path, value, request) -> None:
    """The paged backends (the CPU's, and the Triton ones interpreted) on the step of
    `_stale_step`: the same output over blocks an earlier owner filled with inf or NaN as
    over fresh (zeroed) ones. The bags and padded decodes
    read whole blocks and masked the slots past a length by adding -inf to their scores (inf
    + -inf = NaN) and weighing their values by 0 (0 * inf = NaN): the decode row came out
    NaN. (The quantized pool's partly written block is read from its tail, which the
    earlier owner's codes never reach: held before the fix too.)"""
    from kvpool.attention.backends.native import NativeBackend
    from kvpool.attention.backends.quant import DequantBackend, QuantNativeBackend
    from kvpool.attention.backends.torch_paged import TorchPagedBackend
    from kvpool.attention.backends.triton_paged import TritonPagedBackend
    from kvpool.attention.backends.triton_quant import TritonQuantBackend
    from kvpool.spec.kv_formats import kv_schema
    from kvpool.storage.kv import PagedKVStorage, QuantizedKVStorage

    kernels = request.getfixturevalue("kernels") if "native" in path else None
    dtype = torch.float32 if "native" in path else torch.float64  # (the C kernels' pools are fp32)
    outs = []
    for value_ in (None, value):
        if path.startswith(("dequant", "q8", "triton-q8")):
            fmt = "fp8_e4m3_token" if path.endswith("token") else "fp8_e4m3"
            storage = QuantizedKVStorage(1, 8, 16, 2, 32, kv_schema(fmt), dtype, "cpu")
        else:
            storage = PagedKVStorage(1, 8, 16, 2, 32, dtype, "cpu", kernels if path == "native" else None)
        meta, q, k, v = _stale_step(storage, value_)
        if path == "native":
            backend = NativeBackend(storage, 8, kernels, dtype)
        elif path == "q8-native":
            backend = QuantNativeBackend(storage, 8, kernels, dtype)
        elif path == "triton":
            backend = TritonPagedBackend(storage, 8, None, dtype, num_splits=2)
        elif path.startswith("triton-q8"):
            backend = TritonQuantBackend(storage, 8, None, dtype, num_splits=2)
        elif path.startswith("dequant"):
            backend = DequantBackend(storage, 8, None, dtype, decode_path=path.split("-")[1])
        else:
            backend = TorchPagedBackend(storage, 8, None, dtype, decode_path=path)
        outs.append(backend.begin_step(meta).attend(0, q.to(dtype), k.to(dtype), v.to(dtype)).clone())
    assert torch.isfinite(outs[0]).all()
    bad = (~torch.isfinite(outs[1])).any(-1).any(-1).nonzero().flatten().tolist()
    assert not bad, f"rows {bad} read an earlier owner's {value} past their sequence's end"
    assert torch.equal(outs[0], outs[1])


def _tolerance(out, ref64, ref32, v_max) -> float:
    """fp64: 1e-12; fp32: 4x the fp32 reference's own error against fp64 + 16 ulps of max|v|."""
    if out.dtype == torch.float64:
        return 1e-12
    return 4 * (ref32 - ref64).abs().max().item() + 16 * 2.0**-24 * v_max


@st.composite
def _decode_case(draw):
    """Sequences over a small pool whose block ids repeat within and across tables (a
    kernel reads, so any table is legal), lengths at the block's edges (1, bs, bs + 1) or
    anywhere, more splits than the shortest sequence has tokens."""
    bs = draw(st.sampled_from([1, 3, 16, 32, 64]))
    kvh = draw(st.sampled_from([1, 2]))
    g = draw(st.sampled_from([1, 3, 4, 8]))
    d = draw(st.sampled_from([64, 128, 40]))
    num_blocks = draw(st.integers(1, 6))
    edge = st.sampled_from([1, bs, bs + 1])
    lens = draw(st.lists(st.one_of(edge, st.integers(1, 3 * bs + 2)), min_size=1, max_size=3))
    tables = [draw(st.lists(st.integers(0, num_blocks - 1), min_size=-(-n // bs), max_size=-(-n // bs))) for n in lens]
    splits = draw(st.sampled_from([1, 2, 3, 8, 64]))
    dtype = draw(st.sampled_from([torch.float32, torch.float64]))
    seed = draw(st.integers(0, 2**16))
    return bs, kvh, g, d, num_blocks, lens, tables, splits, dtype, seed


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(case=_decode_case())
def test_paged_decode_csr_and_dense_equal_a_plain_softmax(case) -> None:
    """Both table forms of the decode kernel against the token-by-token reference, the
    query rows scattered among rows the kernel must not write, the dense table's rows
    holding junk entries past each sequence's blocks (never read)."""
    bs, kvh, g, d, num_blocks, lens, tables, splits, dtype, seed = case
    gen = torch.Generator().manual_seed(seed)
    h, b = kvh * g, len(lens)
    k_cache = torch.randn(num_blocks, kvh, d, bs, generator=gen, dtype=torch.float64)
    v_cache = torch.randn(num_blocks, kvh, bs, d, generator=gen, dtype=torch.float64)
    q = torch.randn(b, h, d, generator=gen, dtype=torch.float64)
    scale = d**-0.5
    ref64 = torch.cat(_reference(list(q[:, None]), k_cache, v_cache, tables, lens, scale, torch.float64))
    ref32 = torch.cat(_reference(list(q[:, None]), k_cache, v_cache, tables, lens, scale, torch.float32)).double()
    tol = _tolerance(q.to(dtype), ref64, ref32, v_cache.abs().max().item())
    rows = torch.tensor([2 * i + 1 for i in range(b)], dtype=I32)
    q_step = torch.zeros(2 * b + 1, h, d, dtype=dtype)
    q_step[rows.long()] = q.to(dtype)
    kc, vc = k_cache.to(dtype), v_cache.to(dtype)
    indptr, indices = _csr(tables)
    last_len = [n - (len(t) - 1) * bs for t, n in zip(tables, lens, strict=True)]
    width = max(map(len, tables)) + 2
    dense_tables = torch.tensor([t + [num_blocks + 99] * (width - len(t)) for t in reversed(tables)], dtype=I32)
    seq_rows = torch.tensor(list(reversed(range(b))), dtype=I32)  # sequence i's row: b - 1 - i
    for form in ("csr", "dense"):
        out = torch.full_like(q_step, 7.0)
        if form == "csr":
            ptr, idx, last = (torch.tensor(x, dtype=I32) for x in (indptr, indices, last_len))
            triton_decode.paged_decode(q_step, rows, ptr, idx, last, kc, vc, scale, out, splits)
        else:
            ctx = torch.tensor(lens, dtype=I32)
            triton_decode.paged_decode_dense(q_step, rows, seq_rows, dense_tables, ctx, kc, vc, scale, out, splits)
        assert (out[0::2] == 7.0).all(), f"{form}: a row that is not a decode was written"
        err = (out[rows.long()].double() - ref64).abs().max().item()
        assert err <= tol, (form, err, tol)


@st.composite
def _extend_case(draw):
    """A step of prefills, chunks over a prefix and decodes over a small pool whose block ids
    repeat (sequences sharing a prefix's blocks: a fork, a prefix hit), at block sizes 1,
    odd and powers of two, heads and head dims that are not powers of two."""
    bs = draw(st.sampled_from([1, 3, 16, 64]))
    kvh = draw(st.sampled_from([1, 2]))
    g = draw(st.sampled_from([1, 3, 4, 8]))
    d = draw(st.sampled_from([64, 40, 128]))
    num_blocks = draw(st.integers(1, 6))
    edge = st.sampled_from([1, bs, bs + 1])
    lens = draw(st.lists(st.one_of(edge, st.integers(1, 2 * bs + 70)), min_size=1, max_size=3))
    q_lens = [draw(st.one_of(st.just(1), st.just(n), st.integers(1, n))) for n in lens]
    tables = [draw(st.lists(st.integers(0, num_blocks - 1), min_size=-(-n // bs), max_size=-(-n // bs))) for n in lens]
    splits = draw(st.sampled_from([1, 2, 3, 8]))
    gaps = draw(st.lists(st.integers(0, 2), min_size=len(lens), max_size=len(lens)))  # rows between sequences
    dtype = draw(st.sampled_from([torch.float32, torch.float64]))
    seed = draw(st.integers(0, 2**16))
    return bs, kvh, g, d, num_blocks, lens, q_lens, tables, splits, gaps, dtype, seed


# (6 examples: ~9 s each in the interpreter on a loaded 2-vCPU machine; the stale-slot test
# above and tests/test_triton_extend.py run the extend kernel on cases of their own)
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(case=_extend_case())
def test_extend_equals_a_plain_causal_softmax(case) -> None:
    """The extend kernel (CSR tables, split or not, each sequence's rows placed with gaps
    that must stay unwritten) against the token-by-token causal reference."""
    bs, kvh, g, d, num_blocks, lens, q_lens, tables, splits, gaps, dtype, seed = case
    gen = torch.Generator().manual_seed(seed)
    h = kvh * g
    k_cache = torch.randn(num_blocks, kvh, d, bs, generator=gen, dtype=torch.float64)
    v_cache = torch.randn(num_blocks, kvh, bs, d, generator=gen, dtype=torch.float64)
    qs = [torch.randn(n, h, d, generator=gen, dtype=torch.float64) for n in q_lens]
    scale = d**-0.5
    q_rows, row = [], 0
    for gap, n in zip(gaps, q_lens, strict=True):
        q_rows.append(row + gap)
        row += gap + n
    num_rows = row + 1
    q = torch.zeros(num_rows, h, d, dtype=dtype)
    for r, x in zip(q_rows, qs, strict=True):
        q[r : r + x.shape[0]] = x.to(dtype)
    indptr, indices = _csr(tables)
    plan = triton_extend.plan_extend(
        q_lens, lens, indptr, indices, bs, h, kvh, DEVICE, q_rows=q_rows, num_rows=num_rows, num_splits=splits
    )
    out = torch.full_like(q, 7.0)
    triton_extend.extend_attention(q, k_cache.to(dtype), v_cache.to(dtype), plan, scale, out=out)
    ref64 = _reference(qs, k_cache, v_cache, tables, lens, scale, torch.float64)
    ref32 = _reference(qs, k_cache, v_cache, tables, lens, scale, torch.float32)
    written = torch.zeros(num_rows, dtype=torch.bool)
    for r, x64, x32 in zip(q_rows, ref64, ref32, strict=True):
        n = x64.shape[0]
        written[r : r + n] = True
        tol = _tolerance(q, x64, x32.double(), v_cache.abs().max().item())
        err = (out[r : r + n].double() - x64).abs().max().item()
        assert err <= tol, (r, err, tol)
    assert (out[~written] == 7.0).all(), "a row no sequence names was written"


@pytest.mark.parametrize("value", [float("inf"), float("nan")])
def test_a_ranks_partial_decode_weighs_nothing_past_its_keys(value) -> None:
    """Context-parallel decode (attention/context_parallel.py): a rank's last block holds an
    earlier owner's inf or NaN past the sequence's keys; its partial output and log-sum-exp
    are those of a clean pool, bit for bit (its gathered values were weighed by 0: NaN)."""
    from kvpool.attention.context_parallel import partial_decode_attention

    g = torch.Generator().manual_seed(2)
    k = torch.randn(4, 2, 8, 4, generator=g, dtype=torch.float64)
    v = torch.randn(4, 2, 4, 8, generator=g, dtype=torch.float64)
    q = torch.randn(2, 4, 8, generator=g, dtype=torch.float64)
    tables, num_keys = [[2, 0], [3]], [6, 1]  # block 0's slots 2, 3 and block 3's 1..3 are past the keys
    clean = partial_decode_attention(q, k, v, tables, num_keys, 0.3)
    k[0, :, :, 2:], v[0, :, 2:, :], k[3, :, :, 1:], v[3, :, 1:, :] = value, value, value, value
    dirty = partial_decode_attention(q, k, v, tables, num_keys, 0.3)
    assert torch.isfinite(dirty[0]).all() and torch.equal(clean[0], dirty[0]) and torch.equal(clean[1], dirty[1])


@pytest.mark.parametrize("num_heads", [3, 0, -2, 2.0, True])
@pytest.mark.parametrize("backend", ["bags", "padded", "triton", "dequant", "triton-q8"])
def test_query_heads_that_are_not_a_multiple_of_the_kv_heads_are_refused(backend, num_heads) -> None:
    """3 query heads over 2 KV heads: the bags decode read a KV head past the pool's and the
    Triton decode left a head unwritten (torch.empty's bytes), both without a word; now
    every paged backend refuses the head count by name, as plan_extend did."""
    from kvpool.attention.backends.quant import DequantBackend
    from kvpool.attention.backends.torch_paged import TorchPagedBackend
    from kvpool.attention.backends.triton_paged import TritonPagedBackend
    from kvpool.attention.backends.triton_quant import TritonQuantBackend
    from kvpool.spec.kv_formats import kv_schema
    from kvpool.storage.kv import PagedKVStorage, QuantizedKVStorage

    if backend in ("dequant", "triton-q8"):
        storage = QuantizedKVStorage(1, 4, 16, 2, 32, kv_schema("fp8_e4m3"), torch.float32, "cpu")
        cls, kw = (DequantBackend, {}) if backend == "dequant" else (TritonQuantBackend, {})
    else:
        storage = PagedKVStorage(1, 4, 16, 2, 32, torch.float32, "cpu")
        cls, kw = (TritonPagedBackend, {}) if backend == "triton" else (TorchPagedBackend, {"decode_path": backend})
    with pytest.raises(ValueError, match="num_heads must be a positive multiple of the pool's 2 KV heads"):
        cls(storage, num_heads, None, torch.float32, **kw)
    assert cls(storage, 4, None, torch.float32, **kw).num_heads == 4


@pytest.mark.parametrize("value", [float("inf"), float("nan")])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_a_buffered_decode_weighs_nothing_past_a_context(backend, value) -> None:
    """The decode a CUDA graph captures (`begin_decode` over StepBuffers): the torch form
    gathers a table row's whole width, so it reads the last block's slots past the context
    and the row's entries past its blocks (an earlier request's, or other live requests'
    blocks). Those holding inf or NaN change nothing (the torch form's masked -inf and
    zero weights made them NaN); padded rows read the dummy block only."""
    from kvpool.attention.backends.torch_paged import TorchPagedBackend
    from kvpool.attention.backends.triton_paged import TritonPagedBackend
    from kvpool.storage.kv import PagedKVStorage

    bs, kvh, d, h = 4, 2, 8, 4
    outs = []
    for value_ in (None, value):
        storage = PagedKVStorage(1, 10, bs, kvh, d, torch.float64, "cpu")
        g = torch.Generator().manual_seed(0)
        storage.k.copy_(torch.randn(storage.k.shape, generator=g, dtype=torch.float64))
        storage.v.copy_(torch.randn(storage.v.shape, generator=g, dtype=torch.float64))
        buffers = StepBuffers(3, 4, 4, bs, dummy_block=9)
        buffers.update(["old"], [12], [13], [[6, 7, 8, 5]])  # an earlier request's row: entries 6, 7, 8, 5
        buffers.forget("old")
        if value_ is not None:
            storage.k[0, 3, :, :, 2:] = storage.v[0, 3, :, 2:, :] = value_  # past a's end in its last block
            storage.k[0, 8] = storage.v[0, 8] = value_  # a block the reused row still names
        buffers.clear()
        buffers.update(["a", "b"], [5, 2], [6, 3], [[1, 3], [2]])  # a takes the old row: entries 1, 3, 8, 5
        buffers.pad(3)
        cls = TritonPagedBackend if backend == "triton" else TorchPagedBackend
        step = cls(storage, h, None, torch.float64).begin_decode(buffers, 3)
        q = torch.randn(3, h, d, generator=g, dtype=torch.float64)
        k, v = (torch.randn(3, kvh, d, generator=g, dtype=torch.float64) for _ in range(2))
        outs.append(step.attend(0, q, k, v)[:2])
    assert torch.isfinite(outs[0]).all() and torch.isfinite(outs[1]).all()
    assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("num_slots", [2, 4])
@pytest.mark.parametrize(
    "path", ["bags", "padded", "native", "dequant-bags", "q8-native", "triton", "triton-q8", "triton-q8-token"]
)
def test_a_step_whose_slots_are_not_its_tokens_is_refused_before_anything_is_written(path, num_slots, request) -> None:
    """PagedStepMetadata with 2 or 4 slots for a 3-token chunk: the Triton backend's write
    read a slot past the tensor's end (a segfault in the interpreter; on a GPU a write
    through whatever lay there), the torch path failed in index_copy_ with torch's words.
    Now every backend names the counts when it plans the step, before the pool (or a
    quantized pool's tails) is touched."""
    from kvpool.attention.backends.native import NativeBackend
    from kvpool.attention.backends.paged_step import PagedStepMetadata
    from kvpool.attention.backends.quant import DequantBackend, QuantNativeBackend
    from kvpool.attention.backends.torch_paged import TorchPagedBackend
    from kvpool.attention.backends.triton_paged import TritonPagedBackend
    from kvpool.attention.backends.triton_quant import TritonQuantBackend
    from kvpool.spec.kv_formats import kv_schema
    from kvpool.storage.kv import PagedKVStorage, QuantizedKVStorage

    kernels = request.getfixturevalue("kernels") if "native" in path else None
    if path.startswith(("dequant", "q8", "triton-q8")):
        fmt = "fp8_e4m3_token" if path.endswith("token") else "fp8_e4m3"
        storage = QuantizedKVStorage(1, 4, 16, 2, 32, kv_schema(fmt), torch.float32, "cpu")
    else:
        storage = PagedKVStorage(1, 4, 16, 2, 32, torch.float32, "cpu", kernels if path == "native" else None)
    if path == "native":
        backend = NativeBackend(storage, 4, kernels, torch.float32)
    elif path == "q8-native":
        backend = QuantNativeBackend(storage, 4, kernels, torch.float32)
    elif path.startswith("dequant"):
        backend = DequantBackend(storage, 4, None, torch.float32, decode_path="bags")
    elif path == "triton":
        backend = TritonPagedBackend(storage, 4, None, torch.float32)
    elif path.startswith("triton-q8"):
        backend = TritonQuantBackend(storage, 4, None, torch.float32)
    else:
        backend = TorchPagedBackend(storage, 4, None, torch.float32, decode_path=path)
    before = [t.clone() for t in (storage.k, storage.v)]
    tails = getattr(storage, "num_tails", None)
    meta = PagedStepMetadata([3], [3], list(range(16, 16 + num_slots)), [0, 1], [1])
    with pytest.raises(ValueError, match=f"the step has {num_slots} slots for 3 new tokens"):
        backend.begin_step(meta)
    assert torch.equal(storage.k, before[0]) and torch.equal(storage.v, before[1])
    assert getattr(storage, "num_tails", None) == tails
    # and the same step with its three slots runs
    step = backend.begin_step(PagedStepMetadata([3], [3], [16, 17, 18], [0, 1], [1]))
    assert torch.isfinite(step.attend(0, torch.randn(3, 4, 32), torch.randn(3, 2, 32), torch.randn(3, 2, 32))).all()


# ---- the batched sampler (engine/batch_sampler.py) against a plain fp64 sampler ----------


def _plain_sample(logits, params, sample_index, position):
    """One row by the documented rule, in fp64 and Python: temperature, the top-k largest,
    the nucleus (by decreasing probability, a token kept while the mass before it is below
    top_p), the first candidate whose cumulative weight exceeds u * total. -> (token, the
    candidates with their cumulative weights, u * total), or None for greedy: argmax."""
    from kvpool.engine.sampling import uniform_draw

    row = logits.double().tolist()
    if params.temperature < 1e-5:
        return max(range(len(row)), key=lambda i: (row[i], -i)), None, None
    scores = [x / params.temperature for x in row]
    k = min(params.top_k, len(row)) if params.top_k else len(row)
    # the candidates most likely first where top-k or top-p choose them (sampling.py's
    # module docstring); the whole vocabulary in its own order otherwise
    order = sorted(range(len(row)), key=lambda i: -scores[i])  # stable: ties by id
    kept = order[:k] if k < len(row) or params.top_p < 1.0 else list(range(len(row)))
    top = max(scores[i] for i in kept)
    weights = [torch.tensor(scores[i] - top, dtype=torch.float64).exp().item() for i in kept]
    total = sum(weights)
    probs = [w / total for w in weights]
    if params.top_p < 1.0:
        mass, nucleus = 0.0, []
        for i, p in zip(kept, probs, strict=True):
            if nucleus and mass >= params.top_p:
                break
            nucleus.append((i, p))
            mass += p
        kept, probs = [i for i, _ in nucleus], [p for _, p in nucleus]
    cdf, run = [], 0.0
    for p in probs:
        run += p
        cdf.append(run)
    target = uniform_draw(params.seed, sample_index, position) * run
    j = next((j for j, c in enumerate(cdf) if c > target), len(cdf) - 1)
    return kept[j], list(zip(kept, cdf, strict=True)), target


@settings(max_examples=100, deadline=None)
@given(data=st.data())
def test_sample_batch_draws_what_a_plain_fp64_sampler_draws(data) -> None:
    """Random rows (vocabularies of 1 to 40, logits spread over [-s, s] with s up to 30,
    exact ties at times), each its own greedy / temperature / top-k (1, some, past the
    vocabulary) / top-p (tiny, some, 1) and seed: the batch's token is the plain sampler's,
    unless u * total lies within fp32's rounding of a boundary of the CDF (then either side
    of it, and nothing else); and each row's token is the one it gets alone (a seed's draws
    do not depend on the batch)."""
    from kvpool.engine.batch_sampler import sample_batch
    from kvpool.engine.sampling import SamplingParams

    vocab = data.draw(st.integers(1, 40))
    num_rows = data.draw(st.integers(1, 6))
    spread = data.draw(st.sampled_from([0.0, 1.0, 8.0, 30.0]))
    seed = data.draw(st.integers(0, 2**16))
    logits = (torch.rand(num_rows, vocab, generator=torch.Generator().manual_seed(seed)) * 2 - 1) * spread
    if data.draw(st.booleans()):  # rounded: exact ties between tokens
        logits = logits.round()
    params = [
        SamplingParams(
            temperature=data.draw(st.sampled_from([0.0, 1.2e-5, 0.3, 1.0, 2.5])),
            top_k=data.draw(st.sampled_from([0, 1, 2, 5, vocab, vocab + 7, 2**70])),
            top_p=data.draw(st.sampled_from([1.0, 0.9, 0.5, 1e-30])),
            seed=data.draw(st.integers(-(2**63), 2**63 - 1)),
        )
        for _ in range(num_rows)
    ]
    indices = [data.draw(st.integers(0, 3)) for _ in range(num_rows)]
    positions = [data.draw(st.integers(0, 10**6)) for _ in range(num_rows)]
    tokens = sample_batch(logits, params, indices, positions)
    for i, (token, p) in enumerate(zip(tokens, params, strict=True)):
        assert sample_batch(logits[i : i + 1], [p], [indices[i]], [positions[i]]) == [token], "batch-dependent"
        want, cdf, target = _plain_sample(logits[i], p, indices[i], positions[i])
        if cdf is None:
            assert token == want, (i, token, want)
            continue
        if token == want:
            continue
        # a tie in score between the two (topk and sort may order ties either way), or a
        # boundary within fp32's rounding of u * total
        scores = logits[i].double() / p.temperature
        tied = scores[token] == scores[want]
        slack = 1e-5 * cdf[-1][1]
        near = [c for _, c in cdf if abs(c - target) <= slack]
        assert tied or near, (i, token, want, cdf, target)
        if not tied:  # the token is a candidate of the plain sampler, next to the boundary
            assert token in [t for t, _ in cdf], (i, token, cdf)


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_non_finite_rows_are_named_and_the_others_keep_their_tokens(data) -> None:
    """Rows whose logits hold a NaN or +inf, or are -inf throughout, are the error's rows,
    exactly; every other row's token is the one it gets alone, and a -inf logit (a banned
    token) is never drawn, whatever the row's parameters."""
    from kvpool.engine.batch_sampler import sample_batch
    from kvpool.engine.sampling import NonFiniteLogitsError, SamplingParams

    vocab, num_rows = data.draw(st.integers(2, 12)), data.draw(st.integers(1, 5))
    logits = torch.randn(num_rows, vocab, generator=torch.Generator().manual_seed(data.draw(st.integers(0, 99))))
    bad = []
    for i in range(num_rows):
        kind = data.draw(st.sampled_from(["ok", "banned", "nan", "inf", "all-inf"]))
        j = data.draw(st.integers(0, vocab - 1))
        if kind == "banned":  # all but one banned
            logits[i, :] = float("-inf")
            logits[i, j] = 0.0
        elif kind == "nan":
            logits[i, j] = float("nan")
        elif kind == "inf":
            logits[i, j] = float("inf")
        elif kind == "all-inf":
            logits[i, :] = float("-inf")
        if kind in ("nan", "inf", "all-inf"):
            bad.append(i)
    params = [
        SamplingParams(
            temperature=data.draw(st.sampled_from([0.0, 0.7])),
            top_k=data.draw(st.sampled_from([0, 1, 3])),
            top_p=data.draw(st.sampled_from([1.0, 0.5])),
            seed=data.draw(st.integers(0, 9)),
        )
        for _ in range(num_rows)
    ]
    indices, positions = [0] * num_rows, list(range(num_rows))
    try:
        tokens = sample_batch(logits, params, indices, positions)
        refused = []
    except NonFiniteLogitsError as e:
        tokens, refused = e.tokens, e.rows
    assert sorted(refused) == bad
    for i, token in enumerate(tokens):
        if i in bad:
            assert token == -1
            continue
        assert logits[i, token] > float("-inf"), f"row {i} drew a banned token"
        assert sample_batch(logits[i : i + 1], [params[i]], [0], [i]) == [token]


# ---- the persistent step buffers (attention/backends/step_buffers.py) against a rebuild ----

from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule  # noqa: E402

from kvpool.attention.backends.step_buffers import StepBuffers  # noqa: E402

_BS, _WIDTH, _SEQS, _TOKENS, _DUMMY = 4, 10, 5, 24, 0


class StepBuffersMachine(RuleBasedStateMachine):
    """An engine's steps over one StepBuffers, in any order the rules allow: requests join
    (prompts chunked), decode, sit steps out, roll tokens back, copy a shared tail on write,
    leave or are preempted (forget), steps the buffers cannot hold (skip), decode steps
    padded to a graph's bucket. After every step, what a kernel reads (each sequence's
    table row up to its blocks, lengths, query starts, slots, positions) is a plain rebuild
    of the step from the cache's tables, token by token; no padded row's slot is a real one."""

    def __init__(self) -> None:
        super().__init__()
        self.b = StepBuffers(_SEQS, _TOKENS, _WIDTH, _BS, dummy_block=_DUMMY)
        self.running: list[str] = []
        self.computed: dict[str, int] = {}
        self.prompt: dict[str, int] = {}
        self.tables: dict[str, list[int]] = {}
        self.blocks = iter(range(_DUMMY + 1, 10**6))  # (the dummy block is no request's)
        self.cow: set[str] = set()  # requests whose tail was copied since their last step
        self.num = 0
        self.last: tuple | None = None  # the last step the buffers hold: ids, starts, ends

    @precondition(lambda self: len(self.running) < _SEQS + 1)
    @rule(prompt=st.integers(1, 14))
    def join(self, prompt) -> None:  # (one more than the buffers' rows at most: a step they skip)
        rid = f"r{self.num}"
        self.num += 1
        self.running.append(rid)
        self.computed[rid], self.prompt[rid], self.tables[rid] = 0, prompt, []

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def leave(self, data) -> None:
        rid = data.draw(st.sampled_from(self.running))
        self.running.remove(rid)
        del self.computed[rid], self.tables[rid]
        self.prompt.pop(rid, None)
        self.cow.discard(rid)
        self.b.forget(rid)

    @precondition(lambda self: any(c % _BS for c in self.computed.values()))
    @rule(data=st.data())
    def copy_on_write(self, data) -> None:
        rid = data.draw(st.sampled_from([r for r in self.running if self.computed[r] % _BS]))
        self.tables[rid][self.computed[rid] // _BS] = next(self.blocks)
        self.cow.add(rid)

    @precondition(lambda self: any(r not in self.prompt and self.computed[r] for r in self.running))
    @rule(data=st.data(), back=st.integers(1, 5))
    def roll_back(self, data, back) -> None:
        rid = data.draw(st.sampled_from([r for r in self.running if r not in self.prompt and self.computed[r]]))
        self.computed[rid] -= min(back, self.computed[rid])
        del self.tables[rid][-(-self.computed[rid] // _BS) :]

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def step(self, data) -> None:
        order = [r for r in self.running if data.draw(st.integers(0, 7), label="sits out") > 0]
        if self.last is not None and data.draw(st.booleans(), label="steady"):  # the last step's again
            order = [r for r in self.last[0] if r in self.computed]
        elif data.draw(st.integers(0, 8), label="reorder") == 0:
            order = data.draw(st.permutations(order))
        starts, ends, ids = [], [], []
        for rid in order:
            if self.computed[rid] >= (_WIDTH - 1) * _BS:  # (the row's width: it would finish)
                continue
            left = self.prompt[rid] - self.computed[rid] if rid in self.prompt else 1
            q = min(left, data.draw(st.integers(1, 6), label="chunk"))
            ids.append(rid)
            starts.append(self.computed[rid])
            ends.append(self.computed[rid] + q)
        if not ids:
            return
        for rid, end in zip(ids, ends, strict=True):
            while len(self.tables[rid]) * _BS < end:
                self.tables[rid].append(next(self.blocks))
        num_tokens = sum(e - s for s, e in zip(starts, ends, strict=True))
        if not self.b.fits(ids, num_tokens):
            self.b.skip(ids)
            self.last = None
            return  # (the step ran elsewhere: its tokens are computed)
        tables = [self.tables[r] for r in ids]
        cow = any(r in self.cow for r in ids)
        if cow or not self.b.advance(tuple(ids), starts, ends, lambda some: [self.tables[r] for r in some]):
            self.b.update(ids, starts, ends, tables)
        self.cow -= set(ids)
        self.last = (tuple(ids), starts, ends)
        self.check_step()
        if num_tokens == len(ids) and data.draw(st.booleans(), label="pad"):
            bucket = data.draw(st.integers(len(ids), _SEQS))
            view = self.b.pad(bucket)
            slots = view.slot_mapping.tolist()
            real = {t[p // _BS] * _BS + p % _BS for t in self.tables.values() for p in range(len(t) * _BS)}
            assert not set(slots[len(ids) :]) & real, "a padded row writes a real slot"
            assert all(s == _DUMMY * _BS for s in slots[len(ids) :])
            self.check_step()  # the real rows stand
        self.b.clear()
        for rid, end in zip(ids, ends, strict=True):
            self.computed[rid] = end
            if rid in self.prompt and end == self.prompt[rid]:
                del self.prompt[rid]

    def check_step(self) -> None:
        """The buffers' step against the plain rebuild of self.last."""
        ids, starts, ends = self.last
        n = len(ids)
        v = self.b.view(n, sum(e - s for s, e in zip(starts, ends, strict=True)))
        assert self.b.num_seqs == n
        assert v.ctx_lens.tolist() == list(ends)
        q = [e - s for s, e in zip(starts, ends, strict=True)]
        assert v.query_start.tolist() == [sum(q[:i]) for i in range(n + 1)]
        positions = [p for s, e in zip(starts, ends, strict=True) for p in range(s, e)]
        assert v.positions.tolist() == positions
        slots = [
            self.tables[r][p // _BS] * _BS + p % _BS
            for r, s, e in zip(ids, starts, ends, strict=True)
            for p in range(s, e)
        ]
        assert v.slot_mapping.tolist() == slots
        rows = v.seq_rows.tolist()
        assert len(set(rows)) == n and _SEQS not in rows  # (the padding row is no request's)
        for rid, row, end in zip(ids, rows, ends, strict=True):
            k = -(-end // _BS)
            assert v.block_tables[row, :k].tolist() == self.tables[rid][:k], rid
        self.b.check_integrity({r: self.tables[r] for r in ids})

    @invariant()
    def integrity(self) -> None:
        self.b.check_integrity()


def test_check_integrity_names_a_table_that_holds_the_dummy_block() -> None:
    """Padded rows write the dummy block's slot 0: a request whose table held it would have
    its key and value overwritten by every padded step. The runner keeps it past the
    cache's blocks (llama_runner.py); check_integrity says so when a table breaks that."""
    b = StepBuffers(2, 4, 2, _BS, dummy_block=3)
    b.update(["a"], [0], [2], [[3]])
    with pytest.raises(AssertionError, match="a: its table holds the dummy block"):
        b.check_integrity({"a": [3]})
    b.update(["a"], [2], [3], [[1]])  # (a table without it: whole, every entry checked)
    b.check_integrity({"a": [1]})


StepBuffersMachine.TestCase.settings = settings(
    max_examples=60, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
test_step_buffers_equal_a_rebuild_after_every_step = StepBuffersMachine.TestCase
