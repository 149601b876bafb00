"""The workload package's arrivals, live workloads and metrics, each against an independent
reference: numpy's percentile, the exponential distribution's moments, the running-sum loop
`kvpool run` drew its arrivals with, numpy's cumsum the simulator drew them with."""

from __future__ import annotations

import math
import random
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.workload import chat
from kvpool.workload.arrivals import poisson_arrivals
from kvpool.workload.live import live_chat, live_token_ids
from kvpool.workload.metrics import latency_report, mean, num_within_slo, p50_p99, percentile, ratio, within_slo

# --- percentiles ----------------------------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.floats(-1e6, 1e6, allow_nan=False), min_size=1, max_size=60),
    st.sampled_from([0.0, 0.01, 0.25, 0.5, 0.9, 0.99, 1.0]),
)
def test_percentile_equals_numpys_linear_percentile(values, q):
    expected = float(np.percentile(np.array(values), 100 * q, method="linear"))
    assert percentile(values, q) == pytest.approx(expected, rel=1e-12, abs=1e-9)


def test_percentile_of_nothing_is_zero_and_of_two_interpolates():
    assert percentile([], 0.99) == 0.0
    assert percentile([10.0, 20.0], 0.5) == 15.0
    assert percentile([20.0, 10.0], 0.99) == pytest.approx(19.9)
    assert p50_p99("x_ms", [3.0, 1.0, 2.0], 1) == {"x_ms_p50": 2.0, "x_ms_p99": 3.0}
    assert p50_p99("x_ms", [], 1) == {"x_ms_p50": 0.0, "x_ms_p99": 0.0}
    assert p50_p99("x_ms", [], 1, empty=None) == {"x_ms_p50": None, "x_ms_p99": None}


def test_one_token_answers_have_no_tpot_not_a_zero_one():
    # kvpool run's figures: every answer one token (tpot_s None), TPOT is none, TTFT is measured
    requests = [SimpleNamespace(ttft_s=0.1 * (i + 1), tpot_s=None, latency_s=0.1 * (i + 1)) for i in range(4)]
    report = latency_report(requests, 1)
    assert (report["tpot_ms_p50"], report["tpot_ms_p99"]) == (None, None)
    assert report["ttft_ms_p50"] == 250.0
    assert num_within_slo(requests, 1000.0, 0.001) == 4  # no TPOT to miss


def test_latency_report_takes_each_figure_over_the_requests_that_measured_it():
    r = np.random.default_rng(3)
    requests = [
        SimpleNamespace(
            ttft_s=None if i % 5 == 0 else float(r.exponential(0.3)),
            tpot_s=None if i % 3 == 0 else float(r.exponential(0.02)),
            latency_s=float(1 + r.exponential(2.0)),
        )
        for i in range(50)
    ]
    report = latency_report(requests, 2)
    assert list(report) == [f"{n}_ms_{p}" for n in ("ttft", "tpot", "latency") for p in ("p50", "p99")]
    for name in ("ttft", "tpot", "latency"):
        values = np.array([getattr(x, f"{name}_s") for x in requests if getattr(x, f"{name}_s") is not None]) * 1e3
        assert len(values) == {"ttft": 40, "tpot": 33, "latency": 50}[name]
        for p, q in (("p50", 50), ("p99", 99)):
            assert report[f"{name}_ms_{p}"] == pytest.approx(np.percentile(values, q), abs=0.005 + 1e-9)


# --- SLOs, ratios ------------------------------------------------------------------------


def test_within_slo_at_the_boundaries():
    def req(ttft_s, tpot_s):
        return SimpleNamespace(ttft_s=ttft_s, tpot_s=tpot_s)

    assert within_slo(req(0.2, 0.05), 200.0, 50.0)  # exactly at both SLOs: within
    assert not within_slo(req(0.2001, 0.05), 200.0, 50.0)
    assert not within_slo(req(0.2, 0.0501), 200.0, 50.0)
    assert within_slo(req(0.1, None), 200.0, 50.0)  # a one-token answer has no TPOT
    assert not within_slo(req(None, 0.01), 200.0, 50.0)  # no first token: never within
    requests = [req(0.1, 0.01), req(0.3, 0.01), req(0.1, 0.2), req(None, None), req(0.05, None)]
    assert num_within_slo(requests, 200.0, 50.0) == 2


def test_ratio_and_mean_round_and_treat_nothing_as_zero():
    assert ratio(10, 4, 2) == 2.5
    assert ratio(1, 3, 3) == 0.333
    assert ratio(5, 0, 3) == 0.0
    assert ratio(5, 0.0, 3) == 0.0
    assert mean([0.1, 0.2, 0.4], 4) == 0.2333
    assert mean([], 4) == 0.0


# --- arrivals -------------------------------------------------------------------------------


@pytest.mark.parametrize("make_rng", [random.Random, np.random.default_rng], ids=["random", "numpy"])
@pytest.mark.parametrize("rate", [0.5, 4.0, 100.0])
def test_poisson_gaps_have_the_exponential_mean_and_spread(make_rng, rate):
    n = 20_000
    times = poisson_arrivals(n, rate, make_rng(11))
    gaps = np.diff([0.0, *times])
    assert len(times) == n and (gaps > 0).all()
    # the sample mean of n exponential gaps has standard error (1 / rate) / sqrt(n): 5 of them
    assert abs(gaps.mean() - 1 / rate) < 5 * (1 / rate) / math.sqrt(n)
    # exponential: std = mean (the sample std's standard error is about std / sqrt(n) * 1.1)
    assert abs(gaps.std() - 1 / rate) < 6 * (1 / rate) / math.sqrt(n)
    # arrivals in [0, T] are Poisson(rate T): within 5 standard deviations of rate T
    horizon = times[n // 2]
    counts = np.histogram(times, bins=50, range=(0.0, horizon))[0]
    expected = rate * horizon / 50
    assert abs(counts.mean() - expected) < 5 * math.sqrt(expected / 50)
    assert counts.var(ddof=1) == pytest.approx(expected, rel=0.5)  # variance = mean


def test_poisson_arrivals_draw_what_each_command_always_drew():
    # kvpool run and the load generator: t += rng.expovariate(rate), one draw per arrival
    ref, t = [], 0.0
    rng = random.Random(7)
    for _ in range(500):
        t += rng.expovariate(2.0)
        ref.append(t)
    assert poisson_arrivals(500, 2.0, random.Random(7)) == ref
    # the simulator: numpy's cumsum of one vector of exponential gaps
    expected = np.cumsum(np.random.default_rng(7).exponential(1 / 2.0, size=500)).tolist()
    assert poisson_arrivals(500, 2.0, np.random.default_rng(7)) == expected
    # and the generator is left where those draws left it
    a, b = random.Random(1), random.Random(1)
    poisson_arrivals(10, 3.0, a)
    for _ in range(10):
        b.expovariate(3.0)
    assert a.random() == b.random()


def test_poisson_arrivals_at_an_infinite_rate_are_all_at_zero_and_draw_nothing():
    rng = random.Random(5)
    assert poisson_arrivals(3, math.inf, rng) == [0.0, 0.0, 0.0]
    assert rng.random() == random.Random(5).random()
    assert poisson_arrivals(0, 1.0, rng) == []
    for bad_n in (-1, 2.0, True):
        with pytest.raises(ValueError, match="n must be"):
            poisson_arrivals(bad_n, 1.0, rng)


# --- live workloads -------------------------------------------------------------------------


def test_live_token_ids_shape_and_follow_ups_extend_the_history():
    w = live_token_ids(97, 7, 2, random.Random(0), seed=0)
    assert [len(p) for p in w.first_prompts] == [320] * 7
    assert [len(p) for p in w.long_prompts] == [700, 750]
    systems = {tuple(p[:300]) for p in w.first_prompts}
    assert len(systems) == 3  # conversation i opens with system prompt i mod 3
    assert w.first_prompts[0][:300] == w.first_prompts[3][:300] == w.first_prompts[6][:300]
    assert all(0 <= t < 97 for p in w.first_prompts + w.long_prompts for t in p)
    conv = w.conversations[2]
    nxt = w.follow_up(conv, [5, 6], "unused")
    assert nxt[:320] == w.first_prompts[2] and nxt[320:322] == [5, 6] and len(nxt) == 334
    assert conv.history == nxt


def test_live_token_ids_follow_ups_do_not_depend_on_the_order_they_are_made_in():
    """A follow-up is made when its answer finishes, in the clock's order: its 12 ids came
    from the shared generator in that order, so a given seed gave other prompts from run to
    run. Each conversation draws from its own generator now: the same seed, the same
    follow-ups in any order; another seed, others; the first turns and the shared stream
    (the arrivals drawn after them) are untouched by follow-ups."""

    def follow_ups(order, seed=0):
        rng = random.Random(0)
        w = live_token_ids(97, 4, 1, rng, seed=seed)
        state = rng.getstate()
        made = {}
        for c in order:  # each conversation twice: turns 1 and 2
            conv = w.conversations[c]
            made[c, conv.turn] = w.follow_up(conv, [c, conv.turn], "unused")
            conv.turn += 1
        assert rng.getstate() == state
        return made

    in_order = follow_ups([0, 0, 1, 1, 2, 2, 3, 3])
    assert follow_ups([3, 1, 0, 2, 2, 0, 1, 3]) == in_order
    assert follow_ups([2, 3, 2, 1, 0, 3, 1, 0]) == in_order
    other = follow_ups([0, 0, 1, 1, 2, 2, 3, 3], seed=1)
    assert all(other[key][-12:] != in_order[key][-12:] for key in in_order)
    # (conversations 0 and 3 share system prompt 0 and get [c, turn]: their drawn ids differ)
    assert in_order[0, 0][-12:] != in_order[3, 0][-12:]


def test_live_chat_renders_the_chat_conversations():
    def encode(messages):
        return [ord(ch) for m in messages for ch in m["role"] + ":" + m["content"]]

    rng = random.Random(4)
    w = live_chat(encode, 4, 1, rng)
    firsts = chat.first_turns(4, random.Random(4))
    assert w.first_prompts == [encode(m) for m in firsts]
    assert w.long_prompts == [encode(m) for m in chat.long_prompts(1)]
    conv = w.conversations[1]
    prompt = w.follow_up(conv, [1, 2], "Sure.")
    expected = [*firsts[1], {"role": "assistant", "content": "Sure."}, {"role": "user", "content": chat.FOLLOW_UPS[0]}]
    assert prompt == encode(expected)


def test_long_prompts_stop_at_the_first_that_does_not_fit_the_context():
    """`kvpool run --num-long 1000` made (and tokenized) all 1,000 long prompts, 4 minutes
    and 3.1 GB, to refuse the 58th at the start of the run; 100,000 ran out of memory. Each
    is longer than the one before: the first that does not fit stops the making there."""
    checked: list[tuple[int, str]] = []

    def fits_below(limit: int):
        def check_length(num_tokens: int, request_id: str) -> None:
            checked.append((num_tokens, request_id))
            if num_tokens >= limit:
                raise ValueError(f"request {request_id!r}: prompt of {num_tokens} tokens is too long")

        return check_length

    with pytest.raises(ValueError, match="^request 'long2': prompt of 800 tokens is too long$"):
        live_token_ids(97, 2, 40, random.Random(0), seed=0, check_length=fits_below(800))
    assert checked == [(700, "long0"), (750, "long1"), (800, "long2")]

    encoded: list[int] = []

    def encode(messages):  # (a token per 10 characters: long prompts 0, 1, 2 are 345, 388, 431)
        encoded.append(len(messages[-1]["content"]))
        return [0] * (len(messages[-1]["content"]) // 10)

    checked.clear()
    with pytest.raises(ValueError, match="^request 'long2': prompt of 431 tokens is too long$"):
        live_chat(encode, 2, 40, random.Random(0), check_length=fits_below(400))
    assert checked == [(345, "long0"), (388, "long1"), (431, "long2")]
    assert len(encoded) == 2 + 3  # the two first turns, long prompts 0 to 2: no more


def test_the_workload_package_imports_no_torch():
    code = (
        "import sys\n"
        "import kvpool.workload.arrivals, kvpool.workload.chat, kvpool.workload.live\n"
        "import kvpool.workload.metrics, kvpool.workload.sessions, kvpool.workload.tokens, kvpool.workload.trace\n"
        "print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_first_requests_are_the_first_turns_and_long_prompts_at_their_poisson_arrivals():
    rng = random.Random(3)
    w = live_token_ids(50, 4, 2, rng, seed=3)
    ref = random.Random()
    ref.setstate(rng.getstate())
    times, t = [], 0.0
    for _ in range(6):  # one gap per first turn, then per long prompt, from where the workload left the stream
        t += ref.expovariate(1.5)
        times.append(t)
    ids = ["chat0-t0", "chat1-t0", "chat2-t0", "chat3-t0", "long0", "long1"]
    prompts = w.first_prompts + w.long_prompts
    expected = sorted(zip(times, ids, prompts, strict=True), key=lambda item: item[0])
    assert [tuple(item) for item in w.first_requests(1.5, rng)] == expected
    # all at once: in order, first turns then long prompts
    at_once = live_token_ids(50, 4, 2, random.Random(3), seed=3).first_requests(math.inf, random.Random(0))
    assert [(item.arrival_s, item.request_id) for item in at_once] == [(0.0, rid) for rid in ids]


# --- the performance report of kvpool run and kvpool simulate ----------------------------------

# the seed's figures (ARCHITECTURE.md, "Performance report") that both reports carry
REPORT_KEYS = (
    "kv_capacity_tokens",
    "kv_capacity_bytes",
    "fragmentation",
    "alloc_latency_us_p50",
    "alloc_latency_us_p99",
    "block_size",
    "prefix_hit_rate",
    *(f"{name}_ms_{p}" for name in ("ttft", "tpot", "latency") for p in ("p50", "p99")),
    "throughput_tok_s",
    "goodput_req_s",
    "slo_ttft_ms",
    "slo_tpot_ms",
)


def _fake_engine(num_requests: int, seed: int) -> SimpleNamespace:
    """What run_report reads of an engine: outputs, cache stats, allocation timings, the
    cache's groups (a one-group paged cache: no V4 turn-end keys)."""
    r = np.random.default_rng(seed)
    outputs = {}
    for i in range(num_requests):
        finish = "abort" if i % 7 == 3 else "stop"
        completion = SimpleNamespace(token_ids=list(range(int(r.integers(1, 9)))), finish_reason=finish)
        outputs[f"r{i}"] = SimpleNamespace(
            completions=[completion],
            ttft_s=float(r.exponential(0.8)),
            tpot_s=None if i % 4 == 1 else float(r.exponential(0.1)),
            latency_s=float(1 + r.exponential(3)),
        )
    stats = {"kv_capacity_tokens": 100, "kv_capacity_bytes": 2000, "block_size": 16, "num_blocks": 7}
    stats |= {"prefix_hit_rate": 0.5, "prefix_queried_tokens": 10, "prefix_hit_tokens": 5}
    runner = SimpleNamespace(
        cache_stats=lambda: stats, tier_reports=dict, cache=SimpleNamespace(dual_groups=[]), max_model_len=2048
    )
    engine_stats = SimpleNamespace(alloc_call_s=list(r.exponential(1e-5, 33)), num_alloc_calls=33, num_noop_calls=4)
    return SimpleNamespace(
        requests=list(outputs),
        output=outputs.__getitem__,
        runner=runner,
        stats=engine_stats,
        num_preemptions=0,
        num_steps=40,
    )


def test_kvpool_runs_report_against_numpy_and_a_hand_count_of_the_slos():
    from kvpool.workload.metrics import run_report

    engine = _fake_engine(40, 1)
    report = run_report(
        engine,
        model_name="m",
        wall_s=20.0,
        step_s=5.0,
        fragmentation=[0.1, 0.2],
        kv_read_bytes=10**9,
        interrupted=False,
        slo_ttft_ms=800.0,
        slo_tpot_ms=100.0,
        request_rate=2.0,
    )
    assert set(REPORT_KEYS) <= set(report) and "read_bandwidth_gbps" in report
    done = [engine.output(rid) for rid in engine.requests if engine.output(rid).completions[0].finish_reason == "stop"]
    assert report["num_finished"] == len(done) == 34
    ttft = np.array([o.ttft_s for o in done]) * 1e3
    tpot = np.array([o.tpot_s for o in done if o.tpot_s is not None]) * 1e3
    assert report["ttft_ms_p50"] == pytest.approx(np.percentile(ttft, 50), abs=0.05)
    assert report["tpot_ms_p99"] == pytest.approx(np.percentile(tpot, 99), abs=0.05)
    alloc = np.array(engine.stats.alloc_call_s) * 1e6
    assert report["alloc_latency_us_p99"] == pytest.approx(np.percentile(alloc, 99), abs=0.005)
    good = sum(1 for o in done if o.ttft_s <= 0.8 and (o.tpot_s is None or o.tpot_s <= 0.1))
    assert 0 < good < len(done) and report["goodput_req_s"] == round(good / 20.0, 3)
    generated = sum(len(o.completions[0].token_ids) for o in done)
    assert report["throughput_tok_s"] == round(generated / 20.0, 2)
    assert report["fragmentation"] == 0.15 and report["read_bandwidth_gbps"] == 0.2


def test_the_simulators_report_against_numpy_over_its_own_latencies():
    from kvpool.sim.cost import CostModel
    from kvpool.sim.simulator import SimConfig, simulate
    from kvpool.spec.gpus import get_gpu
    from kvpool.spec.models import load_preset
    from kvpool.workload.sessions import uniform_workload

    model, gpu = load_preset("llama-3.1-8b"), get_gpu("h200")
    workload = uniform_workload(80, 20.0, model.vocab_size, seed=3, prompt_len=(100, 900), output_len=(5, 60))
    config = SimConfig(slo_ttft_ms=50.0, slo_tpot_ms=20.0)
    report = simulate(model, gpu, workload, config, CostModel(model, gpu, tp=config.tp))
    assert set(REPORT_KEYS) <= set(report)
    assert report["num_finished"] == 80
    ttft, tpot = np.array(report["_series"]["ttft_ms"]), np.array(report["_series"]["tpot_ms"])
    assert len(ttft) == 80 and len(tpot) > 0
    for q in (50, 99):
        assert report[f"ttft_ms_p{q}"] == pytest.approx(np.percentile(ttft, q), abs=0.005)
        assert report[f"tpot_ms_p{q}"] == pytest.approx(np.percentile(tpot, q), abs=0.005)
    assert 0 < report["slo_attainment"] < 1  # the SLOs part the requests
    assert report["goodput_req_s"] == pytest.approx(report["slo_attainment"] * 80 / report["wall_s"], rel=2e-3)
