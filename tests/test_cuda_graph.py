"""Decode CUDA graphs per batch bucket (engine/cuda_graph.py): the bucket and padding logic
on the CPU; on CUDA (skipped without one), a captured decode replayed equal to the eager
step, its padded rows writing only the dummy block."""

from __future__ import annotations

import pytest
import torch

from kvpool.attention.backends.step_buffers import StepBuffers
from kvpool.engine.cuda_graph import BATCH_BUCKETS, DecodeGraphs, bucket_for, buckets_up_to


def test_buckets_are_powers_of_two_capped_at_the_largest_batch():
    assert BATCH_BUCKETS == (1, 2, 4, 8, 16, 32, 64, 128, 256)
    assert buckets_up_to(100) == (1, 2, 4, 8, 16, 32, 64, 100)
    assert buckets_up_to(128) == (1, 2, 4, 8, 16, 32, 64, 128)
    assert buckets_up_to(1) == (1,)
    assert buckets_up_to(300) == BATCH_BUCKETS  # a step past 256 runs eagerly
    buckets = buckets_up_to(100)
    assert [bucket_for(n, buckets) for n in (1, 2, 3, 5, 64, 65, 100)] == [1, 2, 4, 8, 64, 100, 100]
    assert bucket_for(101, buckets) is None


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: buckets_up_to(0), "max_num_seqs must be positive, got 0"),
        (lambda: buckets_up_to(8, (4, 2)), r"buckets must be positive and increasing, got \(4, 2\)"),
        (lambda: bucket_for(0, (1, 2)), "num_seqs must be positive, got 0"),
        (
            lambda: DecodeGraphs(lambda n: torch.zeros(n), StepBuffers(4, 4, 2, 4, dummy_block=0)),
            "CUDA graphs need step buffers on a CUDA device, got cpu",
        ),
    ],
)
def test_bad_buckets_and_a_cpu_device_are_refused_naming_them(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_a_capture_pads_an_empty_step_to_its_bucket_with_the_dummy_block_only():
    b = StepBuffers(max_num_seqs=8, max_num_tokens=8, max_blocks_per_seq=3, block_size=4, dummy_block=5)
    b.update(["a", "b"], [3, 0], [4, 1], [[1], [2]])
    b.clear()
    v = b.pad(4)
    assert v.seq_rows.tolist() == [8] * 4 and v.ctx_lens.tolist() == [1] * 4
    assert v.query_start.tolist() == [0, 1, 2, 3, 4]
    assert v.slot_mapping.tolist() == [20] * 4 and v.positions.tolist() == [0] * 4
    b.check_integrity()


# ---- on CUDA ------------------------------------------------------------------------------

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
BS, KVH, D, VOCAB, HIDDEN = 4, 2, 8, 50, 16


def _toy_decode(buffers: StepBuffers, graphs_ids: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor):
    """A one-layer decode over the static inputs: embed, write K/V at the slots, attend over
    each row's blocks (masked to its context), project to logits. Pools [slots, KVH, D]."""
    g = torch.Generator(device="cuda").manual_seed(0)
    embed = torch.randn(VOCAB, HIDDEN, device="cuda", generator=g)
    wq, wk, wv = (torch.randn(HIDDEN, KVH * D, device="cuda", generator=g) for _ in range(3))
    head = torch.randn(KVH * D, VOCAB, device="cuda", generator=g)
    width = buffers.max_blocks_per_seq * BS

    def forward(n: int) -> torch.Tensor:
        x = embed[graphs_ids[:n]] + buffers.positions[:n, None].float()
        q, k, v = ((x @ w).view(n, KVH, D) for w in (wq, wk, wv))
        slots = buffers.slot_mapping[:n].long()
        k_pool[slots], v_pool[slots] = k, v
        table = buffers.block_tables[buffers.seq_rows[:n].long()].long()  # [n, max_blocks]
        ctx = (table[:, :, None] * BS + torch.arange(BS, device="cuda")).view(n, width)
        keys, values = k_pool[ctx], v_pool[ctx]  # [n, width, KVH, D]
        scores = torch.einsum("nhd,nthd->nht", q, keys) * D**-0.5
        live = torch.arange(width, device="cuda")[None, :] < buffers.ctx_lens[:n, None]
        scores = scores.masked_fill(~live[:, None, :], float("-inf"))
        out = torch.einsum("nht,nthd->nhd", torch.softmax(scores, -1), values)
        return out.reshape(n, KVH * D) @ head

    return forward


@cuda
def test_a_replayed_decode_equals_the_eager_one_and_padding_writes_only_the_dummy_block():
    num_blocks, dummy = 12, 11
    tables = {"a": [3, 7], "b": [1], "c": [0, 4, 9]}
    starts = {"a": 5, "b": 2, "c": 9}

    def setup():
        buffers = StepBuffers(8, 8, 3, BS, "cuda", dummy_block=dummy)
        ids = torch.zeros(8, dtype=torch.int64, device="cuda")
        pools = [
            torch.randn(num_blocks * BS, KVH, D, device="cuda", generator=torch.Generator("cuda").manual_seed(1))
            for _ in range(2)
        ]
        return buffers, ids, pools

    # eager: the three decodes, no padding
    buffers, ids, (k_eager, v_eager) = setup()
    names = list(tables)
    buffers.update(names, [starts[r] for r in names], [starts[r] + 1 for r in names], [tables[r] for r in names])
    ids[:3] = torch.tensor([7, 21, 40])
    want = _toy_decode(buffers, ids, k_eager, v_eager)(3)
    # graphed: captured per bucket over padding, then the same step replayed in bucket 4
    buffers, _, (k_graph, v_graph) = setup()
    graphs = DecodeGraphs(lambda n: None, buffers, buckets=(1, 2, 4, 8))
    graphs.forward = _toy_decode(buffers, graphs.input_ids, k_graph, v_graph)
    graphs.capture()
    k_graph[dummy * BS :].zero_()
    buffers.update(names, [starts[r] for r in names], [starts[r] + 1 for r in names], [tables[r] for r in names])
    graphs.set_input_ids([7, 21, 40])
    got = graphs.run(3)
    torch.cuda.synchronize()
    assert graphs.num_replays == 1 and graphs.num_eager == 0
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # every slot but the dummy block's equals the eager pools
    outside = slice(0, dummy * BS)
    torch.testing.assert_close(k_graph[outside], k_eager[outside], rtol=0, atol=0)
    torch.testing.assert_close(v_graph[outside], v_eager[outside], rtol=0, atol=0)
    assert k_graph[dummy * BS].abs().sum() > 0  # the padded row wrote there, and only there
