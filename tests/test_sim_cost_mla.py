"""MLA prefill in the decompressed MHA form (kvpool.sim.cost `_mla_terms`) against a hand
count from DeepSeek-V3's config; decodes stay in the absorbed form."""

from __future__ import annotations

import pytest

from kvpool.sim.cost import CostModel
from kvpool.spec.gpus import get_gpu
from kvpool.spec.models import load_preset

H200 = get_gpu("H200")
# DeepSeek-V3: 61 layers, 128 heads, kv_lora_rank 512, nope 128, rope 64, v 128; TP 8: 16 heads a GPU
LAYERS, HEADS, R, NOPE, ROPE, V = 61, 16, 512, 128, 64, 128


def test_a_v3_prefill_chunk_attends_decompressed_heads_and_pays_the_decompression() -> None:
    cm = CostModel(load_preset("deepseek-v3"), H200, tp=8)
    absorbed = 2 * HEADS * (R + ROPE) + 2 * HEADS * R
    mha = 2 * HEADS * (NOPE + ROPE) + 2 * HEADS * V
    assert (absorbed, mha) == (34_816, 10_240)  # the figures
    n, ctx = 8192, 32_768
    cost = cm.step_cost([(n, ctx)])
    assert cost.attention_flops == LAYERS * mha * sum(range(ctx - n + 1, ctx + 1))
    # the linear work: the usual 2 N P_active + the head, and kv_b_proj over the 24,576 cached latents
    head = 2 * 129_280 * 7168 / 8
    decompress = LAYERS * 2 * R * HEADS * (NOPE + V) * (ctx - n)
    assert cost.linear_flops == pytest.approx(2 * n * cm.active_params_per_token + head + decompress, rel=1e-12)
    # K / V of every context token, bf16, written then read once, beside the latents' reads and writes
    workspace = LAYERS * 2 * HEADS * (NOPE + ROPE + V) * 2 * ctx
    latents = LAYERS * ctx * cm.layout.groups[0].entry_bytes
    assert cost.kv_bytes == pytest.approx(latents + workspace + n * cm.kv_write_bytes_per_token, rel=1e-12)
    # a decode keeps the absorbed form and reads no workspace
    decode = cm.step_cost([(1, ctx)])
    assert decode.attention_flops == LAYERS * absorbed * ctx
    assert decode.kv_bytes == pytest.approx(
        LAYERS * ctx * cm.layout.groups[0].entry_bytes + cm.kv_write_bytes_per_token
    )


def test_v32_prefill_stays_absorbed_over_its_top_k() -> None:
    cm = CostModel(load_preset("deepseek-v3.2"), H200, tp=8)
    absorbed = 2 * HEADS * (R + ROPE) + 2 * HEADS * R
    index = 2 * 64 * 128  # the indexer: 64 heads of 128 on every rank
    n, ctx = 4096, 8192
    topk = sum(min(2048, k) for k in range(ctx - n + 1, ctx + 1))
    assert cm.step_cost([(n, ctx)]).attention_flops == LAYERS * (
        absorbed * topk + index * sum(range(ctx - n + 1, ctx + 1))
    )
