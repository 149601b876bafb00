"""Expert parallelism in the cost model (kvpool.sim.cost, `expert_parallel`) against hand
computations: vLLM's --enable-expert-parallel at data parallelism 1 places the routed experts
whole (E / ep on each GPU) but keeps every token on every GPU and all-reduces the MoE's
output, so a step's communication is TP's two ring all-reduces a layer, its expected expert
bytes and FLOPs are TP's, and so is its time."""

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


def test_ep_at_data_parallelism_1_all_reduces_every_layer_as_tp_does() -> None:
    ep_model = CostModel(V3, H200, tp=8, expert_parallel=True)
    tp_model = CostModel(V3, H200, tp=8)
    assert (ep_model.ep, tp_model.ep) == (8, 1)
    for n in (1, 64, 8192):
        hand = 2 * 61 * ring_allreduce_s(n * 7168 * 2, 8)  # every layer: attention's and MLP / MoE's
        assert ep_model.comm_s(n) == pytest.approx(hand, rel=1e-12)
        assert tp_model.comm_s(n) == pytest.approx(hand, rel=1e-12)
    # a batch-1 decode: 122 all-reduces of 14 ring steps, each 1 us + 14,336 / 8 bytes at 450 GB/s
    assert ep_model.comm_s(1) == pytest.approx(122 * 14 * (1e-6 + 1792 / 450e9), rel=1e-12)
    assert ep_model.comm_s(1) == pytest.approx(1.715e-3, rel=1e-3)


def test_ep_reads_the_same_expected_expert_bytes_and_takes_tps_time() -> None:
    """E / ep whole experts per GPU, touched(N) / ep of them read on average, against a 1/tp
    slice of each touched one: the same bytes at ep = tp; the step's time is TP's."""
    ep_model = CostModel(V3, H200, tp=8, expert_parallel=True)
    tp_model = CostModel(V3, H200, tp=8)
    whole = CostModel(V3, H200, tp=1).expert_bytes  # one routed expert of one layer, whole
    assert ep_model.expert_bytes == pytest.approx(whole / 8, rel=1e-12)
    for chunks in ([(1, 2000)], [(1, 2000)] * 64, [(2048, 4096), *[(1, 3000)] * 32]):
        a, b = ep_model.step_cost(chunks), tp_model.step_cost(chunks)
        assert a.weight_bytes == pytest.approx(b.weight_bytes, rel=1e-12)
        assert a.linear_flops == pytest.approx(b.linear_flops, rel=1e-12)
        assert (a.comm_s, a.time_s) == pytest.approx((b.comm_s, b.time_s), rel=1e-12)


def test_expert_parallelism_of_a_dense_model_or_one_gpu_is_refused_in_one_line(capsys) -> None:
    with pytest.raises(ValueError, match="^expert parallelism spreads routed experts; llama-3.1-8b has no MoE layers$"):
        CostModel(load_preset("llama-3.1-8b"), H200, tp=2, expert_parallel=True)
    with pytest.raises(ValueError, match="^expert parallelism spreads the routed experts over the TP GPUs; tp=1"):
        CostModel(V3, H200, tp=1, expert_parallel=True)
    assert main(["simulate", "--requests", "2", "--enable-expert-parallel"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    # simulate leaves the refusal to the CostModel (one check, one line: the same as above)
    assert err == ["kvpool simulate: error: expert parallelism spreads routed experts; llama-3.1-8b has no MoE layers"]
    flags = ["simulate", "--model", "gpt-oss-120b", "--requests", "2", "--enable-expert-parallel", "-tp", "1"]
    assert main(flags) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "kvpool simulate: error: expert parallelism spreads the routed experts over the TP GPUs; tp=1 has one GPU"
    ]


def test_simulate_reports_the_expert_parallel_size_and_tps_latencies(capsys) -> None:
    flags = ["simulate", "--model", "deepseek-v3", "-tp", "8", "--workload", "uniform", "--requests", "4"]
    flags += ["--prompt-len", "100:200", "--output-len", "10:20", "--json"]
    reports = []
    for extra in ([], ["--enable-expert-parallel"]):
        assert main([*flags, *extra]) == 0
        reports.append(json.loads(capsys.readouterr().out))
    tp_run, ep_run = reports
    assert (tp_run["cost_model"]["expert_parallel_size"], ep_run["cost_model"]["expert_parallel_size"]) == (1, 8)
    for key in ("ttft_ms_p50", "ttft_ms_p99", "tpot_ms_p50", "tpot_ms_p99", "latency_ms_p99"):
        assert ep_run[key] == tp_run[key], key
