"""kvpool.sim.deployment and kvpool.sim.sweep as a library user calls them, with no flags: the
grid's points counted by hand, the TP a deployment needs, a point's run against the
simulator driven directly, the points of a grid that cannot run and why, the process pool's
rows, the cheapest deployment of hand-made rows."""

from __future__ import annotations

import json
import math

import pytest

from kvpool.sim.deployment import (
    SimOptions,
    deployment_of,
    fit_tp,
    gpu_preset,
    grid,
    public,
    simulate_deployment,
)
from kvpool.sim.sweep import LeftOut, cheapest_deployment, map_processes, runnable

UNIFORM = SimOptions(workload="uniform", requests=6, prompt_len=(100, 200), output_len=(4, 8), seed=3)
# measured on this machine's clock, not the simulated one
WALL_CLOCK_KEYS = ("sim_wall_s", "alloc_latency_us_p50", "alloc_latency_us_p99", "sim_us_per_step_by_quarter")


def test_the_options_defaults_are_kvpool_simulates():
    import argparse

    from kvpool.cli.simulate import add_arguments, sim_options

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert sim_options(parser.parse_args([])) == SimOptions()
    flags = ["--requests", "7", "--prompt-len", "5:9", "--no-v4-turn-ends", "--kv-transfer-latency-ms", "2"]
    given = sim_options(parser.parse_args(flags))
    assert (given.requests, given.prompt_len, given.v4_turn_ends) == (7, (5, 9), False)
    assert given.kv_transfer_latency_ms == 2.0 and given.seed == 0


def test_the_grid_is_every_distinct_point_in_flag_order():
    points = grid(("m",), ("h200",), (None, 2), ("paged", "contiguous"), (16, 32), ("round-robin",), (2.0, 8.0))
    # paged: 2 TPs x 2 block sizes x 2 rates; contiguous ignores the block size: 2 TPs x 2 rates
    assert len(points) == 8 + 4
    assert points[0] == {
        "model": "m",
        "gpu": "h200",
        "tp": None,
        "layout": "paged",
        "block_size": 16,
        "routing": "round-robin",
        "rate": 2.0,
    }
    contiguous = [p for p in points if p["layout"] == "contiguous"]
    assert [(p["tp"], p["block_size"], p["rate"]) for p in contiguous] == [
        (None, None, 2.0),
        (None, None, 8.0),
        (2, None, 2.0),
        (2, None, 8.0),
    ]


def test_the_fewest_gpus_that_hold_the_model():
    from kvpool.spec.models import model_by_name

    h200 = gpu_preset("H200")
    assert fit_tp(model_by_name("llama-3.1-8b"), h200, None) == 1
    assert fit_tp(model_by_name("llama-3.1-8b"), h200, 4) == 4  # given: taken as it is
    # DeepSeek-V3's 671 B parameters in fp8: ~671 GB of weights, more than 4 x 141 GB
    assert fit_tp(model_by_name("deepseek-v3"), h200, None) == 8
    with pytest.raises(ValueError, match=r"^--tensor-parallel-size: the cpu preset is one machine"):
        fit_tp(model_by_name("llama-3.1-8b"), gpu_preset("cpu"), 2)
    with pytest.raises(ValueError, match=r"^--tensor-parallel-size 3: llama-3.1-8b's 32 attention heads do not split"):
        fit_tp(model_by_name("llama-3.1-8b"), h200, 3)
    assert gpu_preset("h100", 0.5).memory_bytes == gpu_preset("h100").memory_bytes // 2


def test_a_point_runs_as_the_simulator_driven_by_hand():
    from kvpool.sim.cost import CostModel
    from kvpool.sim.simulator import SimConfig, simulate
    from kvpool.spec.gpus import get_gpu
    from kvpool.spec.models import load_preset
    from kvpool.workload.sessions import uniform_workload

    (point,) = grid(("llama-3.1-8b",), ("h200",), (None,), (None,), (None,), ("round-robin",), (4.0,))
    report = simulate_deployment(UNIFORM, point)
    assert report["num_finished"] == 6 and report["request_rate"] == 4.0 and report["workload"] == "uniform"

    model, gpu = load_preset("llama-3.1-8b"), get_gpu("H200")
    workload = uniform_workload(6, 4.0, model.vocab_size, 3, prompt_len=(100, 200), output_len=(4, 8))
    cost = CostModel(model, gpu, tp=1, kv_dtype="auto", weight_dtype="auto", host_mode="graph", expert_parallel=False)
    reference = simulate(model, gpu, workload, SimConfig(tp=1), cost)
    keys = [k for k in reference if k not in WALL_CLOCK_KEYS and not k.startswith("_") and k != "cost_model"]
    assert {k: report[k] for k in keys} == {k: reference[k] for k in keys}
    private = {k for k in report if k.startswith("_")}
    assert private and public(report).keys() == report.keys() - private  # (the run's own objects dropped)


def test_a_deployment_is_planned_from_the_options():
    options = SimOptions(replicas=2, max_num_seqs=32, kv_dtype="fp8", slo_ttft_ms=500.0)
    point = {"model": "qwen3-8b", "gpu": "h100", "tp": 2, "layout": "paged", "block_size": 32}
    model, gpu, tp, cost, config = deployment_of(options, point | {"routing": "prefix-aware", "rate": 1.0})
    assert (model.name, gpu.name, tp) == ("qwen3-8b", "H100", 2)
    assert (config.tp, config.replicas, config.max_num_seqs, config.kv_dtype) == (2, 2, 32, "fp8")
    assert (config.block_size, config.routing, config.slo_ttft_ms) == (32, "prefix-aware", 500.0)
    with pytest.raises(ValueError, match=r"^--kv-transfer-latency-ms: the KV link of P/D"):
        deployment_of(SimOptions(kv_transfer_latency_ms=1.0), point | {"routing": "round-robin", "rate": 1.0})


def test_the_points_that_cannot_run_are_left_out_with_their_reason():
    points = grid(("deepseek-v3",), ("h200",), (2, 8), (None,), (None,), ("round-robin",), (1.0, 4.0))
    kept, left_out = runnable(UNIFORM, points)
    assert [(p["tp"], p["rate"]) for p in kept] == [(8, 1.0), (8, 4.0)]
    assert left_out == [
        LeftOut(
            "deepseek-v3",
            "H200",  # the preset's name, as the reason's (h200 typed)
            2,
            "deepseek-v3 leaves no KV pool on 2 x H200 (weights 314.0 GiB per device): raise --tensor-parallel-size",
        )
    ]  # once, though two points of it were left out
    assert runnable(UNIFORM, points[:2]).points == []


def test_the_process_pool_returns_every_row_by_its_index():
    payloads = [[("a", 1)], [("b", 2)], [("c", 3)]]
    assert sorted(map_processes(dict, payloads, jobs=2)) == [(0, {"a": 1}), (1, {"b": 2}), (2, {"c": 3})]
    assert list(map_processes(dict, payloads, jobs=1)) == [(0, {"a": 1}), (1, {"b": 2}), (2, {"c": 3})]


def test_the_cheapest_deployment_of_hand_made_rows():
    def row(gpu, replicas, tp, goodput, attainment):
        return {"gpu": gpu, "replicas": replicas, "tp": tp, "goodput_req_s": goodput, "slo_attainment": attainment}

    rows = [
        row("H200", 1, 1, 2.0, 0.8),  # 0.5 GPUs per req/s, but misses the SLO
        row("H200", 1, 2, 5.0, 0.95),  # 0.4
        row("H100", 2, 1, 5.0, 1.0),  # 0.4: a tie, the first in grid order wins
        row("H100", 4, 1, 8.0, 0.99),  # 0.5
        row("H100", 1, 1, 0.0, 1.0),  # no goodput
    ]
    best = cheapest_deployment(rows, 0.9)
    assert best is not None and best.row is rows[1] and best.num_gpus == 2
    assert math.isclose(best.gpus_per_goodput, 0.4) and best.gpu_kinds == ("H200", "H100")
    assert cheapest_deployment(rows, 0.999).row is rows[2] and cheapest_deployment(rows[:1], 0.9) is None
    with pytest.raises(ValueError, match=r"^--slo-attainment: expected a fraction in \(0, 1\], got 1.5"):
        cheapest_deployment(rows, 1.5)


@pytest.mark.parametrize(
    ("limits", "plan_flags"),
    [
        ([], []),
        (["--max-num-batched-tokens", "65536"], []),
        (["--max-num-seqs", "32"], []),
        (["--max-num-batched-tokens", "65536", "--host-mode", "eager"], ["--no-cuda-graphs"]),
    ],
)
def test_the_simulated_pool_is_kvpool_plans_under_the_same_engine_limits(tmp_path, capsys, limits, plan_flags):
    """The engine limits size the ledger's activations and CUDA graphs, an eager host keeps
    no graph memory: simulate's pool (alone, P/D's, a sweep's) is what `kvpool plan` gives
    under the same flags (with --max-num-batched-tokens 65536 it kept the 8,192-token step's
    123.03 GiB where plan gives 116.53; --host-mode eager kept the graphs' 116.534 GiB where
    plan --no-cuda-graphs gives 116.629)."""
    from kvpool.cli.main import main

    plan_limits = [f for f in limits if f not in ("--host-mode", "eager")]
    assert main(["plan", "--model", "llama-3.1-8b", "--gpu", "h200", *plan_limits, *plan_flags, "--json"]) == 0
    planned = json.loads(capsys.readouterr().out)["kv_pool_bytes_per_gpu"]
    run = ["--workload", "uniform", "--requests", "2", *limits]
    assert main(["simulate", *run, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["kv_pool_bytes"] == planned
    assert main(["simulate", *run, "--replicas", "1", "--prefill-replicas", "1", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["kv_pool_bytes"] == planned
    out = tmp_path / "grid.jsonl"
    assert main(["simulate", "sweep", *run, "--rate", "2", "--jobs", "1", "--out", str(out)]) == 0
    assert [json.loads(line)["kv_pool_bytes"] for line in out.read_text().splitlines()] == [planned]
    if limits[:2] == ["--max-num-batched-tokens", "65536"]:  # by hand, from the audit
        assert round(planned / 2**30, 3) == (116.629 if plan_flags else 116.534)


def test_the_fewest_gpus_are_found_under_the_runs_engine_limits():
    """fit_tp asks the planner under the run's ledger: 8,192 tokens a step (LedgerAssumptions'
    default) leave llama-3.1-70b a pool on 2 H100s; a step of 131,072 tokens' activations leave
    too little on 2, so it takes 4 (before, fit_tp asked under the defaults whatever the run's
    limits, and picked 2 GPUs that then held no pool)."""
    from kvpool.capacity.ledger import LedgerAssumptions
    from kvpool.sim.simulator import engine_assumptions
    from kvpool.spec.models import model_by_name

    model, h100 = model_by_name("llama-3.1-70b"), gpu_preset("h100")
    assert fit_tp(model, h100, None) == fit_tp(model, h100, None, assumptions=LedgerAssumptions()) == 2
    assert fit_tp(model, h100, None, assumptions=engine_assumptions(256, 131_072, "graph")) == 4
    (point,) = grid(("llama-3.1-70b",), ("h100",), (None,), (None,), (None,), ("round-robin",), (4.0,))
    options = SimOptions(max_num_batched_tokens=131_072)
    assert deployment_of(options, point).tp == 4  # simulate's own pick
    assert deployment_of(SimOptions(), point).tp == 2
