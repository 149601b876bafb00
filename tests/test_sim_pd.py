"""Prefill / decode disaggregation in the simulator (kvpool.sim.pd) against hand computations:
a request's TTFT is its prefill step, its prompt's full blocks over the link (waiting for
the link behind earlier transfers) and the decode replica's step over the unfinished last
block; the decode replica computes only that block."""

from __future__ import annotations

import pytest

from kvpool.cli.main import main
from kvpool.sim.cost import CostModel
from kvpool.sim.pd import KVLink, Landing, simulate_pd
from kvpool.sim.simulator import SimConfig
from kvpool.spec.gpus import get_gpu
from kvpool.spec.models import load_preset
from kvpool.workload.sessions import Session, Turn, Workload, uniform_workload
from session_census import census

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
        (["--kv-transfer-bandwidth", "fast"], "expected a bandwidth such as 50GB/s, 25GiB/s or 400Gb/s, got 'fast'"),
        (["--kv-transfer-latency-ms", "-1"], "expected a number of ms >= 0, got '-1'"),
        # negative first, whatever the unit ("-5G" was told it is ambiguous, "-5GB/s" to write a size)
        # (argparse takes "-5G" after a space for a flag: "=" passes it)
        (["--kv-transfer-bandwidth=-5G"], "argument --kv-transfer-bandwidth: expected a bandwidth > 0, got '-5G'"),
        (["--kv-transfer-bandwidth=-5GB/s"], "expected a bandwidth > 0, got '-5GB/s'"),
        (["--kv-transfer-bandwidth", "0Gb/s"], "expected a bandwidth > 0, got '0Gb/s'"),
        (["--kv-transfer-bandwidth", "0 GB/s"], "expected a bandwidth > 0, got '0 GB/s'"),
        (["--kv-transfer-bandwidth", "0"], "expected a bandwidth > 0, got '0'"),
        # a number 0 only as far as the parse's first digit: not a bandwidth, not a 0 (0.5 and 16 meant)
        (
            ["--kv-transfer-bandwidth", "0,5GB/s"],
            "expected a bandwidth such as 50GB/s, 25GiB/s or 400Gb/s, got '0,5GB/s'",
        ),
        (["--kv-transfer-bandwidth", "0x10"], "expected a bandwidth such as 50GB/s, 25GiB/s or 400Gb/s, got '0x10'"),
        # no B nor b: a NIC's 400G (400 Gb/s = 50 GB/s) or a size's (400 GiB/s), 8.6x apart: both named
        (
            ["--kv-transfer-bandwidth", "400G"],
            "'400G' is ambiguous: a NIC's 400G is 400 Gb/s = 50GB/s, a size's 400G is 400GiB/s; write 400Gb/s "
            "(or 50GB/s) for a 400 Gb/s NIC, or 400GiB/s",
        ),
        (["--kv-transfer-bandwidth", "200g/s"], "'200g/s' is ambiguous: a NIC's 200G is 200 Gb/s = 25GB/s"),
        (["--kv-transfer-bandwidth", "25Gi/s"], "'25Gi/s' has no B: the flag takes bytes per second, written 25GiB/s"),
    ):
        with pytest.raises(SystemExit):
            main([*flags, "--prefill-replicas", "1", *extra])
        assert expected in capsys.readouterr().err
    # bytes a second written as NICs' bits are: a capital B ("100GBps" was refused as bits)
    assert main([*flags, "--prefill-replicas", "1", "--kv-transfer-bandwidth", "100GBps", "--json"]) == 0
    assert '"bandwidth_bytes_per_s": 100000000000.0' in capsys.readouterr().out
    # the explicit forms as before: decimal GB/s, binary GiB/s, a plain number of bytes; and a
    # NIC's bits written as such, decimal, an eighth in bytes (they were refused)
    explicit = [("50GB/s", "50000000000.0"), ("2GiB/s", "2147483648.0"), ("6000000000", "6000000000.0")]
    explicit += [("400Gb/s", "50000000000.0"), ("400 Gbit/s", "50000000000.0"), ("100Gbps", "12500000000.0")]
    for given, taken in explicit:
        assert main([*flags, "--prefill-replicas", "1", "--kv-transfer-bandwidth", given, "--json"]) == 0
        assert f'"bandwidth_bytes_per_s": {taken}' in capsys.readouterr().out
    for extra in (["--kv-transfer-bandwidth", "25GiB/s"], ["--kv-transfer-latency-ms", "0"]):
        assert main([*flags, *extra]) == 2
        flag = extra[0]
        assert capsys.readouterr().err.strip() == (
            f"kvpool simulate: error: {flag}: the KV link of P/D; it needs --prefill-replicas"
        )
    assert main([*flags, "--prefill-replicas", "1", "--no-enable-prefix-caching"]) == 2
    assert capsys.readouterr().err.strip() == (
        "kvpool simulate: error: P/D: the decode side finds the transferred blocks by their content; "
        "it needs prefix caching"
    )


def test_a_pd_deployment_is_named_by_its_sides_and_a_layout_it_cannot_move_is_refused(capsys) -> None:
    from kvpool.sim.sweep import cheapest_deployment, describe

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


def _spy_installs(monkeypatch) -> list:
    """(decode replica, transfer, landing) of every install; the cache whole after each."""
    import kvpool.sim.pd as pd

    real, installs = pd._install, []

    def checked(rep, transfer, block_size):
        landing = real(rep, transfer, block_size)
        rep.runner.cache.check_integrity()
        installs.append((rep, transfer, landing))
        return landing

    monkeypatch.setattr(pd, "_install", checked)
    return installs


def test_the_decode_sides_hits_are_what_it_held_before_the_kv_landed(monkeypatch) -> None:
    """Two turns of one session (1,000 prompt tokens, 10 out; then 100 more) on 1 prefill and
    1 decode replica. Turn 0: both sides hit nothing; 62 blocks go over the link, the decode
    side computes the 8-token tail. Turn 1 (1,110 tokens): the prefill side holds turn 0's
    prompt blocks (992 tokens); the decode side turn 0's prompt and 9 computed output tokens
    (1,009: 63 blocks, 1,008 tokens), so 1,109 // 16 - 63 = 6 blocks are sent, and its
    admission's hit of 1,104 counts 1,008 as its own, 96 as transferred; it computes 6."""
    installs = _spy_installs(monkeypatch)
    session = Session("c", 0.0, (Turn(tuple(range(5, 1005)), 10), Turn(tuple(range(7, 107)), 10, 1.0)))
    records: list = []
    report = simulate_pd(
        MODEL, H200, Workload("two turns", (session,), MODEL.vocab_size), SimConfig(block_size=BLOCK),
        CostModel(MODEL, H200), 1, KVLink(50e9, 1e-4), on_finish=records.append,
    )  # fmt: skip
    assert [(t.first_block, t.num_blocks, landing) for _, t, landing in installs] == [
        (0, 62, Landing(62, 0)),
        (63, 6, Landing(6, 1008)),
    ]
    assert report["prefix_by_role"] == {
        "prefill_queried_tokens": 2110,
        "prefill_hit_tokens": 992,
        "prefill_hit_rate": round(992 / 2110, 4),
        "decode_queried_tokens": 2110,
        "decode_hit_tokens": 1008,
        "decode_hit_rate": round(1008 / 2110, 4),
    }
    assert report["kv_transfer"]["transferred_hit_tokens"] == 992 + 96
    assert [r.cached_tokens for r in records] == [0, 1008]
    (decode, _, _), _ = installs
    assert decode.engine.stats.num_prefill_tokens == 8 + 6  # the tails only
    assert decode.runner.cache.stats.num_requests == 2  # the installs are not requests


def test_a_prefix_that_landed_with_another_request_is_not_installed_again(monkeypatch) -> None:
    """Two requests of one 992-token prefix and 8 tokens of their own, prefilled in one step,
    each sends 62 blocks over a 1 GB/s link (130 ms each, the second waits). The first
    installs 62; when the second lands the decode replica holds all 62: nothing installed,
    its hit (992) is the decode replica's own. The decode side computes the two 8-token
    tails only, and the second's TTFT is the prefill, two transfers and its tail's step."""
    installs = _spy_installs(monkeypatch)
    prefix = tuple(range(1000, 1992))
    sessions = tuple(
        Session(n, 0.0, (Turn(tuple(range(k, k + 8)), 4),), prefix_ids=prefix) for n, k in (("a", 10), ("b", 20))
    )
    cost = CostModel(MODEL, H200)
    report = simulate_pd(
        MODEL, H200, Workload("one prefix", sessions, MODEL.vocab_size), SimConfig(block_size=BLOCK), cost, 1,
        KVLink(1e9, 0.0),
    )  # fmt: skip
    assert [landing for _, _, landing in installs] == [Landing(62, 0), Landing(0, 992)]
    t = report["kv_transfer"]
    assert (t["sent_blocks"], t["installed_blocks"], t["transferred_hit_tokens"]) == (124, 62, 992)
    assert report["prefix_by_role"]["decode_hit_tokens"] == 992
    (decode, _, _), _ = installs
    assert decode.engine.stats.num_prefill_tokens == 16
    transfer = 62 * BLOCK * KV_BYTES_PER_TOKEN / 1e9
    prefill = cost.step_time([(PROMPT, PROMPT), (PROMPT, PROMPT)])
    assert max(report["_series"]["ttft_ms"]) == pytest.approx(
        (prefill + 2 * transfer + cost.step_time([(8, PROMPT)])) * 1e3, rel=1e-9
    )


def test_an_install_after_eviction_or_without_room_installs_nothing() -> None:
    """On an 80-block decode pool: a 1,000-token prompt's 62 blocks install. A second
    transfer sent its next 6 blocks (first block 62), but before it lands another request's
    1,200 tokens evict the 62: a gap, nothing installed, the replica's hits all its own.
    Then a request holding 70 blocks leaves no room for 62: nothing installed. The cache is
    whole and its prefix counters untouched after each."""
    from kvpool.sim.pd import _install, _Transfer
    from kvpool.sim.simulator import _make_replica, plan_replica

    config = SimConfig(block_size=BLOCK, num_blocks=80)
    rep = _make_replica(0, MODEL, plan_replica(MODEL, H200, config, "graph"), config, CostModel(MODEL, H200), 2000)
    cache = rep.runner.cache
    prompt = list(range(5, 1005))
    assert _install(rep, _Transfer("x", prompt, "", rep, 0, 62), BLOCK) == Landing(62, 0)
    assert cache.lookup_prefix(prompt) == 992
    assert cache.admit("evictor", list(range(2000, 3200))) is not None  # 75 blocks: 18 free + 57 evicted
    cache.release("evictor", "cancel")
    cache.check_integrity()
    longer = prompt + list(range(7, 107))
    assert cache.lookup_prefix(longer) < 62 * BLOCK
    assert _install(rep, _Transfer("y", longer, "", rep, 62, 6), BLOCK) == Landing(0, 1100)
    cache.check_integrity()
    assert cache.admit("holder", list(range(4000, 5120))) is not None  # 70 blocks held
    assert _install(rep, _Transfer("z", prompt, "", rep, 0, 62), BLOCK) == Landing(0, 1000)
    cache.check_integrity()
    assert (cache.stats.num_requests, cache.stats.num_queried_tokens) == (2, 1200 + 1120)


def test_prefix_aware_prefill_routing_spreads_by_the_tokens_left_to_compute() -> None:
    """One request of a 992-token prefix warms prefill replica 0; a second later eight more
    of that prefix arrive together on the two prefill replicas, prefix-aware (eligible: a
    load at most 1.5 x the least + 4; then the longest hit). By prompt tokens still to
    compute (1,000 a queued request), by hand: replica 0 takes #1 (1,000 : 0), #2 goes to
    replica 1 (1,000 > 4), #3 to 0 (cap 1,504), #4 to 1, #5 and #6 to 0 (3,000 <= 3,004),
    #7 to 1, #8 to 0: 6 and 3 with the first. By sequences (each load ~1) replica 0 stays
    under the cap for five in a row: 7 and 2."""
    prefix = tuple(range(1000, 1992))
    sessions = tuple(
        Session(f"s{i}", 0.0 if i == 0 else 1.0, (Turn(tuple(range(10 * i, 10 * i + 8)), 4),), prefix_ids=prefix)
        for i in range(9)
    )
    config = SimConfig(block_size=BLOCK, routing="prefix-aware")
    workload = Workload("one prefix", sessions, MODEL.vocab_size)
    report = simulate_pd(MODEL, H200, workload, config, CostModel(MODEL, H200), 2, KVLink(50e9, 1e-4))
    prefill_rows = [r for r in report["per_replica"] if r["role"] == "prefill"]
    assert [r["num_requests"] for r in prefill_rows] == [6, 3]
    assert [r["peak_running"] for r in prefill_rows] == [5, 3]  # counted in the step that ran them


def test_pd_holds_the_sessions_in_flight_not_every_session() -> None:
    """As simulate() does (tests/test_sim_stream.py): counted on the heap of live objects as
    requests finish, the sessions alive are those read so far less those done, not the
    workload's 120; the report keeps no record."""
    c = census(MODEL.vocab_size)
    config = SimConfig(block_size=BLOCK)
    cost = CostModel(MODEL, H200)
    c.check_in_flight(simulate_pd(MODEL, H200, c.workload, config, cost, 1, KVLink(50e9, 1e-4), None, c.on_finish))


def test_installs_on_a_small_decode_pool_keep_its_cache_whole(monkeypatch) -> None:
    """Chat turns over two prefill and two decode replicas of 400 blocks each: the decode
    cache passes check_integrity() after every install, among which some installed every
    block sent and some none (evicted before landing, or no room), and every request ends."""
    from kvpool.workload.sessions import chat_workload

    installs = _spy_installs(monkeypatch)
    workload = chat_workload(12, 4, 8.0, MODEL.vocab_size, 0)
    config = SimConfig(num_blocks=400, replicas=2, routing="prefix-aware")
    report = simulate_pd(MODEL, H200, workload, config, CostModel(MODEL, H200), 2, KVLink(50e9, 1e-4))
    assert report["num_finished"] == 48 and len(installs) == 48
    sent = [(t.num_blocks, landing.num_blocks) for _, t, landing in installs if t.num_blocks]
    assert any(n == m for n, m in sent) and any(m == 0 for _, m in sent)
    assert report["kv_transfer"]["installed_blocks"] == sum(m for _, m in sent)
