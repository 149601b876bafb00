"""Prefill / decode disaggregation in the simulator (kvpool.sim.pd) against hand computations:
a request's TTFT is its prefill step, its prompt's full blocks over the link (waiting for
the link behind earlier transfers) and the decode replica's step over the unfinished last
block; the decode replica computes only that block."""

from __future__ import annotations

import pytest

from kvpool.cli.main import main
from kvpool.sim.cost import CostModel
from kvpool.sim.pd import KVLink, simulate_pd
from kvpool.sim.simulator import SimConfig
from kvpool.spec.gpus import get_gpu
from kvpool.spec.models import load_preset
from kvpool.workload.sessions import uniform_workload

MODEL, H200 = load_preset("llama-3.1-8b"), get_gpu("H200")
KV_BYTES_PER_TOKEN = 32 * 8 * 128 * 2 * 2  # layers x KV heads x head dim x (K, V) x bf16 = 131,072
PROMPT, OUTPUT, BLOCK = 1000, 10, 16


def _run(num_requests: int, link: KVLink) -> dict:
    cost = CostModel(MODEL, H200)
    workload = uniform_workload(
        num_requests, float("inf"), MODEL.vocab_size, 0, prompt_len=(PROMPT, PROMPT), output_len=(OUTPUT, OUTPUT)
    )
    return simulate_pd(MODEL, H200, workload, SimConfig(block_size=BLOCK), cost, 1, link)


def test_one_requests_ttft_is_its_prefill_its_transfer_and_its_last_blocks_step() -> None:
    link = KVLink(50e9, 1e-4)
    report = _run(1, link)
    cost = CostModel(MODEL, H200)
    full_blocks = (PROMPT - 1) // BLOCK  # 62: the last block (8 tokens) is computed on the decode side
    sent = full_blocks * BLOCK * KV_BYTES_PER_TOKEN
    assert sent == 130_023_424
    transfer = 1e-4 + sent / 50e9  # 2.70 ms
    prefill = cost.step_time([(PROMPT, PROMPT)])
    tail = cost.step_time([(PROMPT - full_blocks * BLOCK, PROMPT)])
    (ttft_ms,) = report["_series"]["ttft_ms"]
    assert ttft_ms == pytest.approx((prefill + transfer + tail) * 1e3, rel=1e-9)
    decodes = [cost.step_time([(1, PROMPT + i)]) for i in range(1, OUTPUT)]
    (tpot_ms,) = report["_series"]["tpot_ms"]
    assert tpot_ms == pytest.approx(sum(decodes) / len(decodes) * 1e3, rel=1e-9)
    t = report["kv_transfer"]
    assert (t["sent_blocks"], t["installed_blocks"], t["sent_bytes"]) == (62, 62, sent)
    assert t["kv_bytes_per_token"] == KV_BYTES_PER_TOKEN
    assert (report["replicas"], report["prefill_replicas"]) == (2, 1)
    prefill_row, decode_row = report["per_replica"]
    assert (prefill_row["role"], prefill_row["num_steps"], decode_row["role"]) == ("prefill", 1, "decode")
    assert decode_row["num_steps"] == OUTPUT  # the last block's step (the first token), then 9 decodes


def test_transfers_queue_on_the_link() -> None:
    """Two prompts prefilled in one step leave over a 1 GB/s link one after the other: the
    second waits the first's 130 ms; each decodes on an idle decode replica."""
    link = KVLink(1e9, 0.0)
    report = _run(2, link)
    cost = CostModel(MODEL, H200)
    transfer = 62 * BLOCK * KV_BYTES_PER_TOKEN / 1e9
    prefill = cost.step_time([(PROMPT, PROMPT), (PROMPT, PROMPT)])
    tail = cost.step_time([(8, PROMPT)])
    first, second = report["_series"]["ttft_ms"]
    assert first == pytest.approx((prefill + transfer + tail) * 1e3, rel=1e-9)
    assert second == pytest.approx((prefill + 2 * transfer + tail) * 1e3, rel=1e-9)
    # the waits are 0 and one transfer; the percentiles interpolate linearly between them
    waits = report["kv_transfer"]
    assert (waits["link_wait_ms_p50"], waits["link_wait_ms_p99"]) == (
        round(0.5 * transfer * 1e3, 3),
        round(0.99 * transfer * 1e3, 3),
    )


def test_pd_flags_and_what_it_refuses_are_one_line(capsys) -> None:
    flags = ["simulate", "--workload", "uniform", "--requests", "2", "--prompt-len", "100:200", "--output-len", "4:8"]
    assert main([*flags, "--prefill-replicas", "1", "--kv-transfer-bandwidth", "25GiB/s", "--json"]) == 0
    out = capsys.readouterr().out
    assert '"bandwidth_bytes_per_s": 26843545600.0' in out and '"prefill_replicas": 1' in out
    for extra, expected in (
        (["--kv-transfer-bandwidth", "fast"], "expected a size per second such as 50GB/s or 25GiB/s, got 'fast'"),
        (["--kv-transfer-latency-ms", "-1"], "expected a number of ms >= 0, got '-1'"),
    ):
        with pytest.raises(SystemExit):
            main([*flags, "--prefill-replicas", "1", *extra])
        assert expected in capsys.readouterr().err
    assert main([*flags, "--prefill-replicas", "1", "--no-enable-prefix-caching"]) == 2
    assert capsys.readouterr().err.strip() == (
        "kvpool simulate: error: P/D: the decode side finds the transferred blocks by their content; "
        "it needs prefix caching"
    )


def test_a_pd_deployment_is_named_by_its_sides_and_a_layout_it_cannot_move_is_refused(capsys) -> None:
    from kvpool.cli.sweep import cheapest_deployment, describe

    flags = ["simulate", "--workload", "uniform", "--requests", "2", "--prompt-len", "100:200", "--output-len", "4:8"]
    assert main([*flags, "--prefill-replicas", "1", "--replicas", "3"]) == 0
    title = " ".join(capsys.readouterr().out.split())  # (rich wraps the title)
    assert "llama-3.1-8b on 4 H200 (1 prefill + 3 decode replicas of TP 1), layout paged" in title
    row = {"model": "m", "gpu": "H200", "replicas": 3, "prefill_replicas": 1, "tp": 2, "layout": "paged"}
    row |= {"block_size": 16, "request_rate": 4.0, "goodput_req_s": 3.0, "slo_attainment": 1.0}
    row |= {"slo_ttft_ms": 2000.0, "slo_tpot_ms": 100.0}
    best = cheapest_deployment([row], 0.9)
    assert best is not None and best.num_gpus == 6  # (1 + 2) replicas x TP 2
    assert "m on 6 H200 (1 prefill + 2 decode replicas of TP 2), layout paged" in describe(best, 0.9)
    assert main([*flags, "--model", "gemma-2-9b", "--prefill-replicas", "1"]) == 2
    assert capsys.readouterr().err.strip() == (
        "kvpool simulate: error: P/D moves the blocks of a paged cache (--layout paged); gemma-2-9b runs layout hybrid"
    )


def test_installs_keep_the_decode_cache_whole(monkeypatch) -> None:
    """Chat turns over two prefill and two decode replicas with a small decode pool: after
    every install the cache passes check_integrity(), and nothing is installed that was not
    sent."""
    import kvpool.sim.pd as pd
    from kvpool.workload.sessions import chat_workload

    real, installs = pd._install, []

    def checked(rep, transfer, block_size):
        num = real(rep, transfer, block_size)
        rep.runner.cache.check_integrity()
        assert 0 <= num <= transfer.num_blocks
        installs.append(num)
        return num

    monkeypatch.setattr(pd, "_install", checked)
    workload = chat_workload(12, 4, 8.0, MODEL.vocab_size, 0)
    config = SimConfig(num_blocks=3000, replicas=2, routing="prefix-aware")
    report = simulate_pd(MODEL, H200, workload, config, CostModel(MODEL, H200), 2, KVLink(50e9, 1e-4))
    assert report["num_finished"] == 48 and len(installs) == 48
    assert sum(installs) == report["kv_transfer"]["installed_blocks"] <= report["kv_transfer"]["sent_blocks"]
