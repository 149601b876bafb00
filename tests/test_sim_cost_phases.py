"""Per-phase pricing (kvpool.sim.cost `step_cost`): a step as its GEMMs, its prefill
attention and its decode attention one after the other, each at its own roofline, against
a hand computation from Llama-3.1-8B's config."""

from __future__ import annotations

import pytest

from kvpool.sim.cost import CostModel
from kvpool.spec.gpus import get_gpu
from kvpool.spec.models import load_preset

H200 = get_gpu("H200")
FLOP_S, BYTE_S = 989e12 * 0.5, 4.8e12 * 0.8  # bf16 peak and HBM at the cuda default efficiencies
LAYERS, HEADS, D = 32, 32, 128
KV_TOKEN = LAYERS * 2 * 8 * D * 2  # bytes of one token's K and V over the layers, bf16


def test_a_chunked_prefill_beside_256_decodes_pays_its_gemms_and_its_decode_attention_in_turn() -> None:
    cm = CostModel(load_preset("llama-3.1-8b"), H200, weight_dtype="bf16", kv_dtype="bf16")
    steps = [(2048, 2048)] + [(1, 2048)] * 256
    cost = cm.step_cost(steps)
    n = 2048 + 256
    linear = 2 * n * cm.active_params_per_token + 2 * 257 * 128_256 * 4096
    weight = cm.dense_weight_bytes + n * 4096 * 2
    gemm = max(linear / FLOP_S, weight / BYTE_S)
    assert gemm == linear / FLOP_S  # 2,304 tokens: compute-bound
    prefill = max(LAYERS * 4 * HEADS * D * (2048 * 2049 // 2) / FLOP_S, 2 * 2048 * KV_TOKEN / BYTE_S)
    decode_bytes = 256 * 2049 * KV_TOKEN  # each reads 2,048 tokens and writes 1
    decode = max(256 * LAYERS * 4 * HEADS * D * 2048 / FLOP_S, decode_bytes / BYTE_S)
    assert decode == decode_bytes / BYTE_S  # memory-bound
    eager = 0.75e-3 + 32 * 76e-6 + 32 * 36.6e-6  # host: a step, 32 layers' launches; GPU: 32 layers' fixed time
    assert cost.gemm_s == pytest.approx(gemm, rel=1e-12)
    assert cost.prefill_attention_s == pytest.approx(prefill, rel=1e-12)
    assert cost.decode_attention_s == pytest.approx(decode, rel=1e-12)
    assert cost.time_s == pytest.approx(gemm + prefill + decode + eager, rel=1e-12)
    # one roofline over the step's totals hides the decodes' 18 ms of reads under the GEMMs
    assert max(cost.compute_s, cost.memory_s) + eager < cost.time_s - 15e-3


def test_decodes_only_or_a_lone_prefill_cost_what_one_roofline_said() -> None:
    cm = CostModel(load_preset("llama-3.1-8b"), H200, weight_dtype="bf16", kv_dtype="bf16")
    for steps in ([(1, 4000)] * 64, [(4096, 4096)]):
        cost = cm.step_cost(steps)
        assert cost.time_s == pytest.approx(max(cost.compute_s, cost.memory_s) + cost.host_s + cost.fixed_s, rel=1e-12)
