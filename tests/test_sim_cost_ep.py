"""Expert parallelism in the cost model (kvpool.sim.cost `alltoall_s`, `comm_s`) against hand
computations: a MoE layer trades its all-reduce for a dispatch and a combine all-to-all."""

from __future__ import annotations

import json

import pytest

from kvpool.cli.main import main
from kvpool.sim.cost import CostModel
from kvpool.spec.gpus import get_gpu
from kvpool.spec.models import load_preset

H200 = get_gpu("H200")
NVLINK4 = 450e9  # one direction, per GPU
LATENCY = 1e-6
V3 = load_preset("deepseek-v3")  # 61 layers, 58 of them MoE; hidden 7168; 256 experts, top-8


def ring_allreduce_s(num_bytes: float, tp: int) -> float:
    return 2 * (tp - 1) * (num_bytes / tp / NVLINK4 + LATENCY)


def test_v3_at_ep_8_sends_each_tokens_top_8_hidden_vectors_seven_eighths_off_the_gpu() -> None:
    tp = ep = 8
    ep_model = CostModel(V3, H200, tp=tp, expert_parallel=True)
    tp_model = CostModel(V3, H200, tp=tp)
    assert (ep_model.ep, tp_model.ep) == (8, 1)
    for n in (1, 64, 8192):
        sent = n / ep * 8 * 7168 * 2 * (ep - 1) / ep  # N / ep tokens x top-k x hidden x bf16, (ep-1)/ep leaves
        alltoall = sent / NVLINK4 + LATENCY
        assert ep_model.alltoall_s(n) == pytest.approx(alltoall, rel=1e-12)
        allreduce = ring_allreduce_s(n * 7168 * 2, tp)
        # 3 dense layers keep their two all-reduces; 58 MoE layers: one all-reduce's worth
        # (reduce-scatter + all-gather) and the dispatch and the combine
        hand = 2 * 3 * allreduce + 58 * (allreduce + 2 * alltoall)
        assert ep_model.comm_s(n) == pytest.approx(hand, rel=1e-12)
        assert tp_model.comm_s(n) == pytest.approx(2 * 61 * allreduce, rel=1e-12)
    # at 64 tokens: 802,816 bytes sent, 1.78 us of link + 1 us; the MoE all-reduce it
    # replaces is 14 steps: 14 us + 3.57 us
    assert 64 / 8 * 8 * 7168 * 2 * 7 / 8 == 802_816
    assert ep_model.alltoall_s(64) == pytest.approx(802_816 / 450e9 + 1e-6, rel=1e-12)
    # k = ep: the two all-to-alls send the MoE all-reduce's bytes, in 2 steps instead of 14
    big = 1 << 20
    moe_allreduce_bytes_s = ring_allreduce_s(big * 7168 * 2, tp) - 14 * LATENCY
    assert 2 * (ep_model.alltoall_s(big) - LATENCY) == pytest.approx(moe_allreduce_bytes_s, rel=1e-12)


def test_ep_changes_a_steps_time_by_its_communication_only() -> None:
    """The expected expert bytes and FLOPs on one GPU are the same whole or sliced (ep = tp):
    the step's time moves by exactly the communication it saves."""
    ep_model = CostModel(V3, H200, tp=8, expert_parallel=True)
    tp_model = CostModel(V3, H200, tp=8)
    for chunks in ([(1, 2000)], [(1, 2000)] * 64, [(2048, 4096), *[(1, 3000)] * 32]):
        a, b = ep_model.step_cost(chunks), tp_model.step_cost(chunks)
        assert a.weight_bytes == pytest.approx(b.weight_bytes, rel=1e-12)
        assert a.linear_flops == pytest.approx(b.linear_flops, rel=1e-12)
        assert a.time_s - b.time_s == pytest.approx(a.comm_s - b.comm_s, rel=1e-9)
    # a decode at batch 1 is latency-bound: 2 x 61 ring all-reduces of 14 steps (1.71 ms) against
    # 64 all-reduces and 116 all-to-alls of 1 step (1.02 ms)
    assert tp_model.step_cost([(1, 2000)]).comm_s == pytest.approx(1.715e-3, rel=1e-3)
    assert ep_model.step_cost([(1, 2000)]).comm_s == pytest.approx(1.019e-3, rel=1e-3)
    # one GPU: nothing to send either way
    assert CostModel(V3, H200, tp=1, expert_parallel=True).step_cost([(1, 2000)]).comm_s == 0.0


def test_expert_parallelism_of_a_dense_model_is_refused_in_one_line(capsys) -> None:
    with pytest.raises(ValueError, match="^expert parallelism spreads routed experts; llama-3.1-8b has no MoE layers$"):
        CostModel(load_preset("llama-3.1-8b"), H200, tp=2, expert_parallel=True)
    assert main(["simulate", "--requests", "2", "--enable-expert-parallel"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "kvpool simulate: error: --enable-expert-parallel: llama-3.1-8b has no MoE layers (no routed experts to spread)"
    ]


def test_simulate_reports_the_expert_parallel_size_and_decodes_faster(capsys) -> None:
    flags = ["simulate", "--model", "deepseek-v3", "-tp", "8", "--workload", "uniform", "--requests", "4"]
    flags += ["--prompt-len", "100:200", "--output-len", "10:20", "--json"]
    reports = []
    for extra in ([], ["--enable-expert-parallel"]):
        assert main([*flags, *extra]) == 0
        reports.append(json.loads(capsys.readouterr().out))
    tp_run, ep_run = reports
    assert (tp_run["cost_model"]["expert_parallel_size"], ep_run["cost_model"]["expert_parallel_size"]) == (1, 8)
    assert ep_run["tpot_ms_p50"] < tp_run["tpot_ms_p50"]  # the decodes' 14-step rings become 1-step all-to-alls
