"""Decode attention paths (C kernel, in-place bags, padded gather) against contiguous SDPA.

Each sequence's blocks are scattered over the pool (random ids, not a dense range), lengths
differ (pad blocks and partial last blocks), and every path must equal the plain
per-sequence SDPA over the same keys.

Exactness is shown in fp64, where the torch paths (bags, padded, prefill) run as they are:
rounding is ~1e-15 there (measured <= 1.3e-15 on these inputs), while a key or value read
from a wrong slot moves an output by ~|v| / n (1e-3 and more at these lengths), so
TOL64 = 1e-12 leaves 1000x for rounding and sits 1e9x below the smallest such error.
In fp32 (the C kernel's only dtype, and the engine's) rounding differs by machine, so each
sequence's bound comes from SDPA's own fp32 error on the same inputs: 4x that error
+ 16 U max|v| (see fp32_tolerance).
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from kvpool.attention.paged import decode_attention, plan_step, prefill_attention

H, KVH, D = 9, 3, 64
U = 2.0**-24  # fp32 unit roundoff
TOL64 = 1e-12


def scattered_batch(lens: list[int], block_size: int, num_blocks: int, seed: int):
    rng = random.Random(seed)
    torch.manual_seed(seed)
    need = [-(-n // block_size) for n in lens]
    ids = rng.sample(range(num_blocks), sum(need))
    indptr = [0]
    for n in need:
        indptr.append(indptr[-1] + n)
    k_cache = torch.randn(num_blocks, KVH, D, block_size)  # K^T per block
    v_cache = torch.randn(num_blocks, KVH, block_size, D)
    q = torch.randn(len(lens), H, D)
    return q, k_cache, v_cache, indptr, ids


def contiguous_kv(k_cache, v_cache, blocks: list[int], n: int):
    """The first n keys and values of a block list, contiguous, GQA heads repeated: [H, n, D] each."""
    blocks = torch.tensor(blocks)
    k = k_cache[blocks].permute(1, 0, 3, 2).reshape(KVH, -1, D)[:, :n].repeat_interleave(H // KVH, 0)
    v = v_cache[blocks].transpose(0, 1).reshape(KVH, -1, D)[:, :n].repeat_interleave(H // KVH, 0)
    return k, v


def reference(q, k_cache, v_cache, indptr, ids, lens, scale):
    """Per-sequence SDPA over contiguous keys, in the dtype of the inputs: [B, H, D]."""
    outs = []
    for i, n in enumerate(lens):
        k, v = contiguous_kv(k_cache, v_cache, ids[indptr[i] : indptr[i + 1]], n)
        outs.append(F.scaled_dot_product_attention(q[i][:, None], k, v, scale=scale)[:, 0])
    return torch.stack(outs)


def fp32_tolerance(sdpa32: torch.Tensor, exact: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """The bound for an fp32 attention output against fp64: 4x SDPA's own fp32 error on the same
    inputs (sdpa32 against exact, [..., H, D]) + 16 U max|values|.

    Measured on this project's AMD EPYC, these inputs: SDPA's error 2-7e-7, each fp32 path
    here 0.7-2.4x it (padded, bags and prefill run other torch kernels than the reference's
    SDPA; the C kernel's rounding is fixed by cpu.c); the worst case uses 0.13 of the bound.
    SDPA's max error is a noisy figure (exact for one key), hence the floor: 16 U max|v|,
    ~8 ulps of the largest value, 2.4x the C kernel's worst over 7,500 random shapes
    (tests/test_kernels.py)."""
    return 4 * (sdpa32.double() - exact).abs().max() + 16 * U * values.abs().max()


def run_path(q, k_cache, v_cache, indptr, ids, lens, block_size, path, kernels=None):
    b = len(lens)
    plan = plan_step(
        [1] * b,
        lens,
        [0] * b,
        indptr,
        ids,
        block_size,
        H,
        KVH,
        D,
        torch.device("cpu"),
        dtype=q.dtype,
        decode_path=path,
        kernels=kernels,
    )
    return plan.decode, decode_attention(q, k_cache, v_cache, plan.decode, D**-0.5)


@pytest.mark.parametrize(
    "path, dtype",
    [
        ("native", torch.float32),  # fp32 only
        ("bags", torch.float64),
        ("bags", torch.float32),
        ("padded", torch.float64),
        ("padded", torch.float32),
    ],
    ids=["native-fp32", "bags-fp64", "bags-fp32", "padded-fp64", "padded-fp32"],
)
@pytest.mark.parametrize(
    "lens, block_size",
    [([1], 16), ([37], 16), ([5, 40, 16, 17, 1, 100], 16), ([64, 64, 64], 16), ([300, 7, 129], 8), ([33, 80], 32)],
)
def test_decode_paths_match_contiguous_sdpa_on_scattered_blocks(lens, block_size, path, dtype, request):
    kernels = request.getfixturevalue("kernels") if path == "native" else None
    q, k_cache, v_cache, indptr, ids = scattered_batch(lens, block_size, num_blocks=64, seed=len(lens) + block_size)
    plan, out = run_path(
        q.to(dtype), k_cache.to(dtype), v_cache.to(dtype), indptr, ids, lens, block_size, path, kernels
    )
    assert (plan.bags is not None) == (path == "bags") and out.dtype == dtype
    exact = reference(q.double(), k_cache.double(), v_cache.double(), indptr, ids, lens, D**-0.5)
    sdpa32 = reference(q, k_cache, v_cache, indptr, ids, lens, D**-0.5)
    for i, n in enumerate(lens):
        err = (out[i].double() - exact[i]).abs().max()
        if dtype == torch.float64:
            assert err <= TOL64, (i, err)
        else:
            _, v = contiguous_kv(k_cache, v_cache, ids[indptr[i] : indptr[i + 1]], n)
            assert err <= fp32_tolerance(sdpa32[i], exact[i], v), (i, err)


def test_bad_decode_path_is_a_clear_error():
    with pytest.raises(ValueError, match="decode_path"):
        plan_step([1], [1], [0], [0, 1], [0], 16, H, KVH, D, torch.device("cpu"), decode_path="fast")
    with pytest.raises(ValueError, match="needs the CPU kernels"):
        plan_step([1], [1], [0], [0, 1], [0], 16, H, KVH, D, torch.device("cpu"), decode_path="native")


def test_bag_indices_are_int32_unless_a_row_id_would_overflow():
    small = plan_step([1], [20], [0], [0, 2], [3, 9], 16, H, KVH, D, torch.device("cpu")).decode.bags
    assert small.k_rows.dtype == small.v_offsets.dtype == torch.int32
    assert small.k_rows[:D].tolist() == [3 * KVH * D + i for i in range(D)]  # block 3, head 0
    # K^T rows of block 12M: (12M * KVH + kvh) * D > 2^31
    big = plan_step([1], [20], [0], [0, 2], [3, 12_000_000], 16, H, KVH, D, torch.device("cpu")).decode.bags
    assert big.k_rows.dtype == big.k_offsets.dtype == torch.int64
    assert int(big.k_rows.max()) == (12_000_000 * KVH + KVH - 1) * D + D - 1


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("q_len, ctx_len", [(37, 37), (12, 37), (2, 16)])
def test_prefill_chunk_matches_causal_sdpa(q_len, ctx_len, dtype):
    # start 0 takes is_causal, a chunk after a prefix the explicit offset-causal mask
    bs = 8
    _, k_cache, v_cache, indptr, ids = scattered_batch([ctx_len], bs, num_blocks=32, seed=q_len)
    q = torch.randn(q_len, H, D)
    plan = plan_step([q_len], [ctx_len], list(range(q_len)), indptr, ids, bs, H, KVH, D, torch.device("cpu"))
    (chunk,) = plan.prefills
    assert (chunk.mask is None) == (q_len == ctx_len)
    out = prefill_attention(q.to(dtype), k_cache.to(dtype), v_cache.to(dtype), chunk)
    assert out.dtype == dtype
    start = ctx_len - q_len
    mask = torch.arange(ctx_len)[None, :] <= torch.arange(start, ctx_len)[:, None]

    def causal_sdpa(q, k_cache, v_cache):
        k, v = contiguous_kv(k_cache, v_cache, ids, ctx_len)
        return F.scaled_dot_product_attention(q.transpose(0, 1), k, v, attn_mask=mask).transpose(0, 1)

    exact = causal_sdpa(q.double(), k_cache.double(), v_cache.double())
    err = (out.double() - exact).abs().max()
    if dtype == torch.float64:
        assert err <= TOL64
    else:
        _, v = contiguous_kv(k_cache, v_cache, ids, ctx_len)
        assert err <= fp32_tolerance(causal_sdpa(q, k_cache, v_cache), exact, v)


@pytest.mark.parametrize("which", ["k", "v"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize(
    "q_len, ctx_len", [(37, 37), (10, 10), (12, 37)], ids=["from-0", "from-0-short", "over-a-prefix"]
)
def test_a_non_finite_key_or_value_of_a_chunk_reaches_only_the_queries_that_see_it(q_len, ctx_len, bad, which):
    """Keys (or values) at chunk positions 3 and 7 with one dim NaN / +-inf: the queries
    before position 3 never see them, so their outputs are the exact ones; from 3 on each
    query is what plain attention over what it sees gives (fp64, a loop over the queries: NaN,
    or for a -inf key a key of weight 0 where the query's dim is positive, ...). SDPA's
    mask, added to the scores, made a masked NaN / inf score NaN in the earlier queries too
    (chunks of 10 from position 0 and 12 over a prefix; 37 from 0 took another SDPA kernel),
    and a masked value's weight 0 times NaN or inf is NaN in p @ V (every chunk), so a bad
    key or value written later in a chunk poisoned the earlier positions (whose K / V the
    next layer computes and the prefix cache then holds for another request): causality
    broken."""
    bs, start = 16, ctx_len - q_len
    _, k_cache, v_cache, indptr, ids = scattered_batch([ctx_len], bs, num_blocks=32, seed=q_len)
    k_cache, v_cache = k_cache.double(), v_cache.double()
    for p in (start + 3, start + 7):
        if which == "k":
            k_cache[ids[p // bs], 1, 0, p % bs] = bad  # K^T: [block, kv head, dim, slot]
        else:
            v_cache[ids[p // bs], 1, p % bs, 0] = bad  # V: [block, kv head, slot, dim]
    q = torch.randn(q_len, H, D, dtype=torch.float64)
    plan = plan_step([q_len], [ctx_len], list(range(q_len)), indptr, ids, bs, H, KVH, D, torch.device("cpu"))
    out = prefill_attention(q, k_cache, v_cache, plan.prefills[0])
    k, v = contiguous_kv(k_cache, v_cache, ids, ctx_len)  # [H, ctx, D]
    want = []
    for i in range(q_len):  # query i sees keys [0, start + i]
        seen = start + i + 1
        probs = torch.softmax(torch.einsum("hd,hkd->hk", q[i], k[:, :seen]) * D**-0.5, -1)
        want.append(torch.einsum("hk,hkd->hd", probs, v[:, :seen]))
    want = torch.stack(want)
    finite = want.isfinite()
    assert finite[:3].all() and (out[:3] - want[:3]).abs().max() <= TOL64
    assert (out[finite] - want[finite]).abs().max() <= TOL64 and not out[~finite].isfinite().any()
