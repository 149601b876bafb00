"""Decode attention paths (in-place bags, padded gather) against contiguous SDPA.

Each sequence's blocks are scattered over the pool (random ids, not a dense range), lengths
differ (pad blocks and partial last blocks), and every path must equal the plain
per-sequence SDPA over the same keys to fp32 tolerance.
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from kvpool.attention.paged import decode_attention, plan_step, prefill_attention
from kvpool.kernels import cpu_kernels

H, KVH, D = 9, 3, 64


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


def reference(q, k_cache, v_cache, indptr, ids, lens, scale):
    outs = []
    for i, n in enumerate(lens):
        blocks = torch.tensor(ids[indptr[i] : indptr[i + 1]])
        k = k_cache[blocks].permute(1, 0, 3, 2).reshape(KVH, -1, D)[:, :n].repeat_interleave(H // KVH, 0)
        v = v_cache[blocks].transpose(0, 1).reshape(KVH, -1, D)[:, :n].repeat_interleave(H // KVH, 0)
        outs.append(F.scaled_dot_product_attention(q[i][:, None], k, v, scale=scale)[:, 0])
    return torch.stack(outs)


def run_path(q, k_cache, v_cache, indptr, ids, lens, block_size, path):
    b = len(lens)
    kernels = None
    if path == "native":
        kernels = cpu_kernels()
        if kernels is None:
            pytest.skip("the C kernels did not build here")
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
        decode_path=path,
        kernels=kernels,
    )
    return plan.decode, decode_attention(q, k_cache, v_cache, plan.decode, D**-0.5)


@pytest.mark.parametrize("path", ["native", "bags", "padded"])
@pytest.mark.parametrize(
    "lens, block_size",
    [([1], 16), ([37], 16), ([5, 40, 16, 17, 1, 100], 16), ([64, 64, 64], 16), ([300, 7, 129], 8), ([33, 80], 32)],
)
def test_decode_paths_match_contiguous_sdpa_on_scattered_blocks(lens, block_size, path):
    q, k_cache, v_cache, indptr, ids = scattered_batch(lens, block_size, num_blocks=64, seed=len(lens) + block_size)
    plan, out = run_path(q, k_cache, v_cache, indptr, ids, lens, block_size, path)
    assert (plan.bags is not None) == (path == "bags")
    ref = reference(q, k_cache, v_cache, indptr, ids, lens, D**-0.5)
    assert (out - ref).abs().max().item() <= 1e-5


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


@pytest.mark.parametrize("q_len, ctx_len", [(37, 37), (12, 37), (2, 16)])
def test_prefill_chunk_matches_causal_sdpa(q_len, ctx_len):
    # start 0 takes is_causal, a chunk after a prefix the explicit offset-causal mask
    bs = 8
    _, k_cache, v_cache, indptr, ids = scattered_batch([ctx_len], bs, num_blocks=32, seed=q_len)
    q = torch.randn(q_len, H, D)
    plan = plan_step([q_len], [ctx_len], list(range(q_len)), indptr, ids, bs, H, KVH, D, torch.device("cpu"))
    (chunk,) = plan.prefills
    assert (chunk.mask is None) == (q_len == ctx_len)
    out = prefill_attention(q, k_cache, v_cache, chunk)
    blocks = torch.tensor(ids)
    k = k_cache[blocks].permute(1, 0, 3, 2).reshape(KVH, -1, D)[:, :ctx_len].repeat_interleave(H // KVH, 0)
    v = v_cache[blocks].transpose(0, 1).reshape(KVH, -1, D)[:, :ctx_len].repeat_interleave(H // KVH, 0)
    start = ctx_len - q_len
    mask = torch.arange(ctx_len)[None, :] <= torch.arange(start, ctx_len)[:, None]
    ref = F.scaled_dot_product_attention(q.transpose(0, 1), k, v, attn_mask=mask).transpose(0, 1)
    assert (out - ref).abs().max().item() <= 1e-5
