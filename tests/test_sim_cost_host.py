"""The host overhead of a step (kvpool.sim.cost `host_s`): a CUDA-graph replay or eager
launches, against hand computations; --weight-dtype, --host-mode and the resolved formats."""

from __future__ import annotations

import dataclasses

import pytest

from kvpool.capacity.weights import WEIGHT_DTYPES
from kvpool.cli import simulate as cli
from kvpool.sim.cost import HOST_MODES, CostModel
from kvpool.sim.report import describe_cost
from kvpool.spec.gpus import get_gpu
from kvpool.spec.models import load_preset

H200 = get_gpu("H200")
STEP, LAYER = 0.75e-3, 76e-6  # issue 31's H200 decode: 4.71 ms graph, 7.14 ms eager, 32 layers


def test_decodes_replay_a_graph_and_prefill_or_big_batches_launch_every_layer() -> None:
    model = load_preset("llama-3.1-8b")  # 32 layers
    graph = CostModel(model, H200, weight_dtype="bf16", kv_dtype="bf16")
    eager = CostModel(model, H200, weight_dtype="bf16", kv_dtype="bf16", host_mode="eager")
    decode = [(1, 1000)] * 4
    assert graph.step_cost(decode).host_s == pytest.approx(STEP, rel=1e-12)
    assert eager.step_cost(decode).host_s == pytest.approx(STEP + 32 * LAYER, rel=1e-12)
    # the eager gap at batch 1 is the measured one: 7.14 - 4.71 = 2.43 ms over 32 layers
    gap = eager.step_time([(1, 1000)]) - graph.step_time([(1, 1000)])
    assert gap == pytest.approx(32 * LAYER, rel=1e-12) and gap == pytest.approx(2.43e-3, rel=1e-3)
    # a prefill chunk beside the decodes, or more decodes than the largest captured graph: eager
    assert graph.step_cost([(64, 64), *decode]).host_s == pytest.approx(STEP + 32 * LAYER, rel=1e-12)
    assert graph.step_cost([(1, 100)] * 512).host_s == pytest.approx(STEP, rel=1e-12)
    assert graph.step_cost([(1, 100)] * 513).host_s == pytest.approx(STEP + 32 * LAYER, rel=1e-12)
    cost = graph.step_cost([(64, 64)])
    assert cost.time_s == pytest.approx(max(cost.compute_s, cost.memory_s) + cost.host_s + cost.fixed_s, rel=1e-12)
    with pytest.raises(ValueError, match="host_mode must be one of .*'graph', 'eager'.*, got 'cuda-graph'"):
        CostModel(model, H200, host_mode="cuda-graph")


def test_every_step_pays_each_layers_fixed_gpu_time_graph_or_eager() -> None:
    model = load_preset("llama-3.1-8b")  # 32 layers
    graph = CostModel(model, H200, weight_dtype="bf16", kv_dtype="bf16")
    eager = CostModel(model, H200, weight_dtype="bf16", kv_dtype="bf16", host_mode="eager")
    none = CostModel(model, H200, weight_dtype="bf16", kv_dtype="bf16", layer_fixed_s=0.0)
    assert graph.layer_fixed_s == H200.layer_fixed_s == 36.6e-6
    for chunks in ([(1, 1000)], [(1, 1000)] * 600, [(512, 512)]):
        assert graph.step_cost(chunks).fixed_s == eager.step_cost(chunks).fixed_s == 32 * 36.6e-6
        assert graph.step_time(chunks) - none.step_time(chunks) == pytest.approx(32 * 36.6e-6, rel=1e-12)
    # Llama-70B's 80 layers at 10 us each, an override
    big = CostModel(load_preset("llama-3.1-70b"), H200, tp=4, layer_fixed_s=10e-6)
    assert big.step_cost([(1, 100)]).fixed_s == pytest.approx(80 * 10e-6, rel=1e-12)
    # the H200 bare forward (no host step, bytes at the run's measured 4.28 TB/s copy) is the
    # 4.71 ms batch-1 graph decode the figure was read from: 15.14 GB / 4.28 TB/s + 32 x 36.6 us
    bare = CostModel(model, H200, "bf16", "bf16", bandwidth_efficiency=4.28 / 4.8, step_overhead_s=0.0)
    assert bare.step_time([(1, 1024)]) == pytest.approx((15_009_857_536 + 134_348_800) / 4.28e12 + 32 * 36.6e-6)
    assert bare.step_time([(1, 1024)]) == pytest.approx(4.71e-3, rel=1e-4)
    with pytest.raises(ValueError, match="layer_fixed_s must be >= 0, got -1e-06"):
        dataclasses.replace(H200, layer_fixed_s=-1e-6)
    with pytest.raises(ValueError, match="layer_fixed_s must be >= 0, got -1e-06"):
        CostModel(model, H200, layer_fixed_s=-1e-6)


def test_the_report_names_the_formats_used_not_auto() -> None:
    d = describe_cost(CostModel(load_preset("deepseek-v3"), H200, tp=8))
    assert (d["weight_dtype"], d["kv_dtype"], d["moe_routing"], d["host_mode"]) == ("fp8", "bf16", "uniform", "graph")
    d = describe_cost(CostModel(load_preset("llama-3.1-8b"), H200, weight_dtype="fp8"))
    assert (d["weight_dtype"], d["kv_dtype"], d["moe_routing"], d["tp_allreduce"]) == ("fp8", "bf16", None, None)
    assert d["layer_fixed_s"] == 36.6e-6


def test_fp8_weights_halve_a_batch_1_decodes_weight_reads() -> None:
    model = load_preset("llama-3.1-8b")
    bf16 = CostModel(model, H200, weight_dtype="bf16").step_cost([(1, 10)])
    fp8 = CostModel(model, H200, weight_dtype="fp8").step_cost([(1, 10)])
    # every linear weight at 1 byte + one fp32 scale per 128 x 128 block, the embedding and norms as they were
    assert fp8.weight_bytes < 0.56 * bf16.weight_bytes and fp8.weight_bytes > 0.5 * bf16.weight_bytes


def test_the_cli_choices_are_the_cost_models() -> None:
    assert cli.WEIGHT_DTYPES == WEIGHT_DTYPES and cli.HOST_MODES == HOST_MODES
