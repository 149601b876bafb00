"""Tensor-parallel communication in the cost model (kvpool.sim.cost `allreduce_s`) against
hand computations: two ring all-reduces per layer over NVLink."""

from __future__ import annotations

import pytest

from kvpool.sim.cost import CostModel
from kvpool.spec.gpus import GPUSpec, get_gpu
from kvpool.spec.models import load_preset

H200, B200 = get_gpu("H200"), get_gpu("B200")
NVLINK4 = 450e9  # 900 GB/s bidirectional per GPU: 450 GB/s each way
NVLINK5 = 900e9  # 1.8 TB/s bidirectional
STEP_LATENCY = 1e-6


def ring_allreduce_s(num_bytes: float, tp: int, bandwidth: float) -> float:
    """2 (tp - 1) steps, each sending num_bytes / tp and paying one latency."""
    return 2 * (tp - 1) * (num_bytes / tp / bandwidth + STEP_LATENCY)


def test_an_8k_prefill_of_llama_70b_at_tp_8_pays_two_all_reduces_per_layer() -> None:
    cm = CostModel(load_preset("llama-3.1-70b"), H200, weight_dtype="bf16", kv_dtype="bf16", tp=8)
    cost = cm.step_cost([(8192, 8192)])
    num_bytes = 8192 * 8192 * 2  # tokens x hidden x bf16
    hand = 2 * 80 * (2 * 7 / 8 * num_bytes / NVLINK4 + 14 * STEP_LATENCY)
    assert cost.comm_s == pytest.approx(hand, rel=1e-12)
    assert cost.comm_s == pytest.approx(0.08575, rel=1e-3)  # 160 x 536 us: 86 ms on 308 of compute
    eager = 0.75e-3 + 80 * 76e-6  # a prefill step launches its 80 layers' kernels
    fixed = 80 * 36.6e-6  # the GPU's fixed time per layer
    assert cost.time_s == pytest.approx(max(cost.compute_s, cost.memory_s) + hand + eager + fixed, rel=1e-12)
    # the same step at TP 1 sends nothing; TP 2 halves the ring's steps and its share
    assert CostModel(cm.model, H200, weight_dtype="bf16", kv_dtype="bf16").step_cost([(8192, 8192)]).comm_s == 0
    tp2 = CostModel(cm.model, H200, weight_dtype="bf16", kv_dtype="bf16", tp=2)
    assert tp2.step_cost([(8192, 8192)]).comm_s == pytest.approx(160 * ring_allreduce_s(num_bytes, 2, NVLINK4))


def test_a_decode_all_reduce_is_its_latency_and_nvlink_5_halves_the_bytes_term() -> None:
    model = load_preset("llama-3.1-8b")  # hidden 4096, 32 layers
    h200 = CostModel(model, H200, tp=4)
    assert h200.allreduce_s(1) == pytest.approx(6 * STEP_LATENCY + 1.5 * 4096 * 2 / NVLINK4, rel=1e-12)
    assert h200.step_cost([(1, 100)] * 3).comm_s == pytest.approx(64 * ring_allreduce_s(3 * 4096 * 2, 4, NVLINK4))
    b200 = CostModel(model, B200, tp=4)
    big = 4096 * 4096 * 2
    assert b200.allreduce_s(4096) - 6 * STEP_LATENCY == pytest.approx(1.5 * big / NVLINK5, rel=1e-12)
    assert h200.allreduce_s(4096) - 6 * STEP_LATENCY == pytest.approx(1.5 * big / NVLINK4, rel=1e-12)


def test_tp_past_one_node_or_without_an_nvlink_figure_is_refused_in_one_line() -> None:
    model = load_preset("llama-3.1-8b")
    with pytest.raises(ValueError, match=r"^tp=16 spans more than one node of 8 H200 GPUs: .*use tp <= 8"):
        CostModel(model, H200, tp=16)
    no_link = GPUSpec("pcie", 80 << 30, 2e12, peak_bf16_flops=1e15)
    with pytest.raises(ValueError, match="GPU pcie has no NVLink figure to price tp=2's all-reduces"):
        CostModel(model, no_link, tp=2)
    assert CostModel(model, no_link).step_cost([(1, 10)]).comm_s == 0.0  # one GPU needs no link
    with pytest.raises(ValueError, match="nvlink_bytes_per_s must be >= 0 or NaN"):
        GPUSpec("bad", 80 << 30, 2e12, nvlink_bytes_per_s=-1.0)
