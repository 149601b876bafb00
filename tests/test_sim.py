"""The simulator: the engine's scheduler and the real cache managers on a virtual clock.

The central claim: only the clock and the forward differ from the engine. The same small
SmolLM2 workload through the engine (llama_runner: the model computes every token) and
through the same runner with the simulator's cost executor makes identical cache decisions, step by
step: the same sequences run, with the same blocks, the same prefix hits, the same
preemptions. Both sample through one deterministic sampler, so the token streams agree."""

from __future__ import annotations

import json

import pytest

from kvpool.cache import FullAttentionManager
from kvpool.engine.build import descriptor_for, load_model
from kvpool.engine.engine import Engine
from kvpool.engine.llama_runner import llama_runner
from kvpool.engine.runner import ModelRunner
from kvpool.engine.sampling import SamplingParams
from kvpool.engine.tier_bridge import TierBridge
from kvpool.sim.executor import CostExecutor, VirtualClock
from kvpool.workload.tokens import stream_key, text_ids, token_at

NUM_BLOCKS, BLOCK = 12, 8  # small enough that the workload preempts


def _sampler(logits, params: SamplingParams, sample_index: int, position: int) -> int:
    """Ignores the logits: token `position` of the request's stream (its seed names it)."""
    return token_at(stream_key(f"seed{params.seed}/{sample_index}"), position, 49152)


def _workload() -> list[tuple[list[int], SamplingParams]]:
    shared = text_ids("system", 20, 49152)
    prompts = [shared + text_ids(f"user{i}", 5 + 3 * i, 49152) for i in range(5)]
    return [(p, SamplingParams(max_tokens=10 + 2 * i, seed=i, ignore_eos=True)) for i, p in enumerate(prompts)]


def _trace(engine: Engine, manager) -> list[tuple]:
    """Run to the end; per step: every running sequence (id, computed tokens, its blocks),
    the preemptions and prefix-hit tokens so far, and integrity checked."""
    for i, (prompt, params) in enumerate(_workload()):
        engine.add_request(prompt, params, f"r{i}")
    steps = []
    while engine.has_unfinished():
        engine.step()
        manager.check_integrity()
        running = tuple((s.seq_id, s.num_computed, tuple(manager.block_ids(s.seq_id))) for s in engine.running)
        steps.append((running, engine.num_preemptions, manager.stats.num_hit_tokens, manager.num_free_blocks))
    outputs = {rid: engine.output(rid).completions[0].token_ids for rid in engine.requests}
    return steps, outputs


@pytest.fixture(scope="module")
def smollm2():
    return load_model(device="cpu")


def test_the_simulator_makes_the_engines_cache_decisions(smollm2):
    kw = {"max_num_batched_tokens": 24, "max_num_seqs": 4}
    real = llama_runner(smollm2.model, NUM_BLOCKS, BLOCK, descriptor_for(smollm2, BLOCK))
    engine = Engine(real, sampler=_sampler, **kw)
    real_steps, real_out = _trace(engine, real.cache)

    clock = VirtualClock()
    chunks_per_step: list[int] = []

    def step_time(work, moved):
        chunks_per_step.append(len(work))
        return 1e-3 * len(work)

    executor = CostExecutor(
        smollm2.model.config.vocab_size,
        step_time=step_time,
        kv_read_bytes=lambda n: n,
        clock=clock,
        block_bytes=1,
        kv_capacity_bytes=0,
    )
    manager = FullAttentionManager(NUM_BLOCKS, BLOCK, descriptor_for(smollm2, BLOCK))
    sim = ModelRunner(
        manager,
        executor,
        TierBridge(None, (), BLOCK, enable_prefix_caching=True),
        descriptor=manager.descriptor,
        block_size=BLOCK,
        capacity_tokens=real.capacity_tokens,
        max_model_len=real.max_model_len,
    )
    sim_engine = Engine(sim, sampler=_sampler, clock=clock, **kw)
    sim_steps, sim_out = _trace(sim_engine, manager)

    assert sim_steps == real_steps
    assert sim_out == real_out
    assert real_steps[-1][1] > 0, "the workload preempts (else it tests less)"
    assert real_steps[-1][2] > 0, "and hits the shared prefix"
    # one priced forward per step, the clock moved by each price
    assert len(chunks_per_step) == len(sim_steps) and clock.now == pytest.approx(1e-3 * sum(chunks_per_step))


def test_cli_runs_and_reports_the_runs_keys(capsys, tmp_path):
    from kvpool.cli.main import main

    assert main(["simulate", "--model", "llama-3.1-8b", "--gpu", "h200", "--requests", "60", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    # every key of `kvpool run --json`'s report but the engine's own (memory, load, bandwidth)
    run_keys = (
        "model kv_capacity_tokens kv_capacity_bytes block_size num_blocks fragmentation prefix_hit_rate "
        "prefix_queried_tokens prefix_hit_tokens alloc_latency_us_p50 alloc_latency_us_p99 num_alloc_calls "
        "num_noop_alloc_calls ttft_ms_p50 ttft_ms_p99 tpot_ms_p50 tpot_ms_p99 latency_ms_p50 latency_ms_p99 "
        "throughput_tok_s goodput_req_s slo_ttft_ms slo_tpot_ms request_rate preemptions num_requests "
        "num_finished num_generated_tokens num_steps wall_s interrupted"
    ).split()
    assert set(run_keys) <= set(report), set(run_keys) - set(report)
    assert (report["layout"], report["replicas"], report["routing"]) == ("paged", 1, "round-robin")
    assert report["num_requests"] == report["num_finished"] == 60 and report["sim_wall_s"] > 0
    assert report["throughput_tok_s"] == pytest.approx(report["num_generated_tokens"] / report["wall_s"], rel=1e-3)
    assert 0 < report["per_replica"][0]["busy_share"] <= 1
    assert 0 < report["fragmentation"] < 1  # sampled from the first step: partial tail blocks
    assert report["prefix_hit_rate"] > 0.3  # chat: shared system prompts and each session's history


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--model", "no-such-model"], "--model: unknown model 'no-such-model'"),
        (["--gpu", "a100"], "--gpu: unknown GPU 'a100'; known: B200, H100, H200"),
        (["--model", "llama-3.1-8b", "--layout", "dual"], "layout 'dual' is DeepSeek-V4's"),
        (["--model", "smollm2-135m", "--workload", "agentic"], "holds 8,192"),
    ],
)
def test_bad_input_is_one_line(capsys, flags, message):
    from kvpool.cli.main import main

    assert main(["simulate", "--requests", "8", *flags]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err


def test_a_negative_rate_is_refused(capsys):
    from kvpool.cli.main import main

    with pytest.raises(SystemExit):
        main(["simulate", "--rate", "-1"])
    assert "--rate" in capsys.readouterr().err


def test_a_malformed_trace_line_names_the_line(capsys, tmp_path):
    from kvpool.cli.main import main

    trace = tmp_path / "t.jsonl"
    trace.write_text('{"timestamp": 0, "prompt_ids": [1, 2, 3], "output_length": 4}\n{"timestamp": 1, "oops"\n')
    assert main(["simulate", "--trace", str(trace)]) == 2
    err = capsys.readouterr().err
    assert "line 2" in err and len(err.strip().splitlines()) == 1, err


def test_a_trace_request_longer_than_the_model_names_its_line(capsys, tmp_path):
    from kvpool.cli.main import main

    trace = tmp_path / "t.jsonl"
    trace.write_text(
        '{"timestamp": 0, "prompt_ids": [1, 2, 3], "output_length": 4}\n'
        '{"timestamp": 1, "hash_ids": [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16],'
        ' "input_length": 8192, "output_length": 8}\n'
    )
    assert main(["simulate", "--model", "smollm2-135m", "--trace", str(trace)]) == 2
    err = capsys.readouterr().err
    assert "line2-t0" in err and "8,200 tokens" in err and "holds 8,192" in err, err


# ---- the simulator's own claims, each on a small run --------------------------------------


def _simulate(model_name: str, workload, **config):
    from kvpool.sim.cost import CostModel
    from kvpool.sim.simulator import SimConfig, simulate
    from kvpool.spec.gpus import get_gpu
    from kvpool.spec.models import load_preset

    model, gpu = load_preset(model_name), get_gpu("h200")
    cfg = SimConfig(**config)
    return simulate(model, gpu, workload, cfg, CostModel(model, gpu, tp=cfg.tp))


def test_a_sessions_next_turn_hits_its_own_history():
    """One chat session of 3 turns alone on a replica: turn k's prompt extends turn k-1's
    prompt and answer, and the cache holds their full blocks (all but the answer's last
    token, whose KV no step computed): the hit is exactly those blocks."""
    from kvpool.workload.sessions import chat_workload

    wl = chat_workload(1, 3, float("inf"), 128_256, seed=3)
    report = _simulate("llama-3.1-8b", wl)
    s = wl.sessions[0]
    lens = [s.prompt_len(k) for k in range(3)]
    outs = [t.output_len for t in s.turns]
    expected = sum(min((lens[k - 1] + outs[k - 1] - 1) // 16, (lens[k] - 1) // 16) * 16 for k in (1, 2))
    assert report["prefix_hit_tokens"] == expected
    assert report["prefix_queried_tokens"] == sum(lens)


def test_prefix_aware_routing_beats_round_robin_on_hit_rate():
    from kvpool.workload.sessions import chat_workload

    wl = chat_workload(60, 3, 4.0, 128_256, seed=0)
    rr = _simulate("llama-3.1-8b", wl, replicas=4, routing="round-robin")
    pa = _simulate("llama-3.1-8b", wl, replicas=4, routing="prefix-aware")
    assert pa["prefix_hit_rate"] > rr["prefix_hit_rate"] + 0.05, (pa["prefix_hit_rate"], rr["prefix_hit_rate"])
    assert sum(r["num_requests"] for r in pa["per_replica"]) == 180
    assert min(r["num_requests"] for r in pa["per_replica"]) > 0  # the load cap spreads the sessions


def test_contiguous_reserves_the_longest_request_for_each():
    from kvpool.workload.sessions import uniform_workload

    wl = uniform_workload(300, float("inf"), 128_256, seed=1, prompt_len=(1000, 4000), output_len=(200, 400))
    paged = _simulate("llama-3.1-8b", wl, layout="paged")
    contiguous = _simulate("llama-3.1-8b", wl, layout="contiguous", max_model_len=8192)
    per_token = 32 * 2 * 8 * 128 * 2  # llama-3.1-8b bf16 K and V, all layers
    assert contiguous["block_bytes"] == 8192 * per_token and contiguous["block_size"] == 8192
    assert contiguous["num_blocks"] == contiguous["kv_pool_bytes"] // (8192 * per_token)
    assert contiguous["peak_running"] <= contiguous["num_blocks"] < paged["peak_running"]
    assert contiguous["prefix_hit_tokens"] == 0


def test_the_dual_pool_holds_more_long_requests_than_uniform_paging():
    """V4-Flash at long context: uniform paging keeps every layer's window entry for every
    token; the dual pool keeps a window per running request only."""
    from kvpool.workload.sessions import uniform_workload

    wl = uniform_workload(60, float("inf"), 129_280, seed=2, prompt_len=(60_000, 64_000), output_len=(1500, 2000))
    dual = _simulate("deepseek-v4-flash", wl, layout="dual", tp=2)
    paged = _simulate("deepseek-v4-flash", wl, layout="paged", tp=2, block_size=128)
    assert dual["kv_capacity_tokens"] > 5 * paged["kv_capacity_tokens"]
    assert dual["peak_running"] > paged["peak_running"]
    assert dual["preemptions"] <= paged["preemptions"]
    assert dual["throughput_tok_s"] >= paged["throughput_tok_s"]  # (deterministic: a virtual clock)
    assert dual["num_finished"] == paged["num_finished"] == 60


def test_sweep_writes_a_line_per_run_and_the_plots_open(tmp_path, capsys):
    import matplotlib.image as mpimg

    from kvpool.cli.main import main

    out, plots = tmp_path / "runs.jsonl", tmp_path / "plots"
    flags = ["--model", "llama-3.1-8b", "--requests", "24", "--layout", "paged,contiguous", "--rate", "2,8"]
    assert main(["simulate", "sweep", *flags, "--out", str(out), "--plot", str(plots), "--jobs", "2"]) == 0
    # written as each run finishes: in grid order by "point"
    rows = sorted((json.loads(line) for line in out.read_text().splitlines()), key=lambda r: r["point"])
    assert [(r["layout"], r["request_rate"]) for r in rows] == [
        ("paged", 2.0),
        ("paged", 8.0),
        ("contiguous", 2.0),
        ("contiguous", 8.0),
    ]
    image = mpimg.imread(plots / "goodput_vs_rate.png")
    assert image.shape[0] > 100 and image.shape[1] > 100 and image.std() > 0  # drawn, not blank

    run_plots = tmp_path / "run"
    flags = ["--model", "llama-3.1-8b", "--requests", "24", "--layout", "paged,contiguous", "--json"]
    assert main(["simulate", *flags, "--plot", str(run_plots)]) == 0
    runs = json.loads(capsys.readouterr().out)["runs"]
    assert [r["layout"] for r in runs] == ["paged", "contiguous"]
    for name in ("latency_cdf.png", "kv_occupancy.png", "comparison.png"):
        assert mpimg.imread(run_plots / name).std() > 0


def test_the_sample_trace_replays(capsys):
    from kvpool.cli.main import main
    from kvpool.workload.trace import sample_trace_path

    assert main(["simulate", "--model", "llama-3.1-8b", "--trace", str(sample_trace_path()), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["workload"] == "trace" and report["num_finished"] == 39 and report["request_rate"] == "trace"
    assert report["prefix_hit_tokens"] > 0  # its hash ids share prefixes


def test_v4_checkpoint_restore_replays_nothing_and_costs_state_blocks():
    """A V4 prefix hit by recompute replays the last n_win x layers tokens (all of a chat
    prompt); from a checkpoint it copies one state block instead, whose slots come out of
    the classical pool. (Turn ends off: a follow-up adopting its turn's state restores neither way.)"""
    from kvpool.workload.sessions import chat_workload

    wl = chat_workload(20, 3, 4.0, 129_280, seed=5)
    off = {"tp": 2, "max_num_seqs": 32, "v4_turn_ends": False}
    replay = _simulate("deepseek-v4-flash", wl, v4_restore="recompute", **off)
    ckpt = _simulate("deepseek-v4-flash", wl, v4_restore="checkpoint", num_checkpoints=64, **off)
    assert replay["replayed_tokens"] == replay["prefix_hit_tokens"] > 0  # every hit shorter than 5,504 tokens
    assert ckpt["replayed_tokens"] == 0 and ckpt["checkpoint_copies"] > 0 and ckpt["prefix_hit_tokens"] > 0
    assert ckpt["ttft_ms_p50"] < replay["ttft_ms_p50"]
    state = replay["kv_capacity_bytes"] - replay["num_blocks"] * replay["block_bytes"]  # 32 state blocks
    assert replay["num_blocks"] - ckpt["num_blocks"] == pytest.approx(64 * state / 32 / replay["block_bytes"], abs=1)


def test_v4_auto_restore_keeps_every_hit_in_pooled_checkpoints_while_memory_is_free():
    """The default V4 restore ("auto", checkpoints pooled in the classical pool's free
    memory): with memory to spare every hit's boundary keeps its snapshot, so the dual pool
    hits what uniform paging hits (which keeps every window entry) and replays nothing,
    and no block is carved out for checkpoints. (Turn ends off: with them a follow-up hits
    past paging's block, the next test.)"""
    from kvpool.workload.sessions import chat_workload

    wl = chat_workload(20, 3, 4.0, 129_280, seed=5)
    auto = _simulate("deepseek-v4-flash", wl, tp=2, max_num_seqs=32, v4_turn_ends=False)
    replay = _simulate("deepseek-v4-flash", wl, tp=2, max_num_seqs=32, v4_restore="recompute", v4_turn_ends=False)
    paged = _simulate("deepseek-v4-flash", wl, tp=2, max_num_seqs=32, layout="paged", block_size=128)
    assert auto["v4_restore"] == "auto" and auto["num_blocks"] == replay["num_blocks"]
    assert auto["prefix_hit_tokens"] == paged["prefix_hit_tokens"] == replay["prefix_hit_tokens"] > 0
    assert auto["replayed_tokens"] == 0 and auto["checkpoint_copies"] > 0
    assert auto["ttft_ms_p50"] < replay["ttft_ms_p50"]


def test_v4_follow_up_turns_adopt_their_turns_states_and_hit_past_paging():
    """The dual layout's default: a turn that ends inside a span keeps its state block, and
    the session's next turn hits there and adopts it. On the chat workload of the tests
    above every follow-up hits its whole history, up to 127 tokens past paging's block-
    aligned hit (its answer's last token is not computed); nothing is replayed and the
    copies are the snapshots the steps take, fewer than without turn ends (no restores)."""
    from kvpool.workload.sessions import chat_workload

    wl = chat_workload(20, 3, 4.0, 129_280, seed=5)
    on = _simulate("deepseek-v4-flash", wl, tp=2, max_num_seqs=32)
    off = _simulate("deepseek-v4-flash", wl, tp=2, max_num_seqs=32, v4_turn_ends=False)
    paged = _simulate("deepseek-v4-flash", wl, tp=2, max_num_seqs=32, layout="paged", block_size=128)
    assert on["prefix_hit_tokens"] - paged["prefix_hit_tokens"] == _turn_end_extra(wl, 128) > 0
    assert off["prefix_hit_tokens"] == paged["prefix_hit_tokens"]
    assert on["replayed_tokens"] == 0 and 0 < on["checkpoint_copies"] < off["checkpoint_copies"]


def _turn_end_extra(wl, span: int) -> int:
    """The tokens a turn-end adoption hits past the block-aligned hit, by hand: each
    follow-up's previous turn ends after its prompt and answer less the last token."""
    extra = 0
    for session in wl.in_arrival_order():
        for k in range(1, len(session.turns)):
            ended = session.prompt_len(k - 1) + session.turns[k - 1].output_len - 1
            extra += ended % span
    return extra


def test_a_step_in_pieces_is_priced_one_chunk_per_request_from_its_first_start_to_its_last_end():
    from kvpool.engine.runner import ScheduledChunk

    clock, priced = VirtualClock(), []
    executor = CostExecutor(
        10,
        step_time=lambda work, moved: priced.append((work, moved)) or 1.0,
        kv_read_bytes=lambda n: n,
        clock=clock,
        block_bytes=4,
        kv_capacity_bytes=0,
    )

    def chunk(request_id: str, start: int, end: int) -> ScheduledChunk:
        return ScheduledChunk(request_id, list(range(start, end)), start, False)

    # the runner's V4 step cut at b's checkpoints (positions 14 and 20): every request's first
    # piece, then b's next two, the second with d, which the first forward did not carry
    executor.forward([chunk("a", 0, 1), chunk("b", 10, 14), chunk("c", 5, 6)], None, True)
    executor.copy_state(0, 1)  # the state copied at 14: 2 x checkpoint_bytes (0 here)
    executor.forward([chunk("b", 14, 20)], None, True)
    executor.copy_blocks({"g": [object()]})  # one copy-on-write block: 2 x 4 bytes
    executor.forward([chunk("b", 20, 22), chunk("d", 0, 3)], None, True)
    assert clock() == 1.0
    assert priced == [([(1, 1), (12, 22), (1, 6), (3, 3)], 8)]
    # the next step starts afresh: one forward, priced as it came
    executor.forward([chunk("b", 22, 23), chunk("a", 1, 2)], None, False)
    assert clock() == 2.0 and clock() == 2.0  # (read twice: priced once)
    assert priced[1:] == [([(1, 23), (1, 2)], 0)]
