"""The simulator: the engine's scheduler and the real cache managers on a virtual clock.

The central claim: only the clock and the forward differ from the engine. The same small
SmolLM2 workload through the engine (LlamaRunner: the model computes every token) and
through the simulator's runner (a cost model) makes identical cache decisions, step by
step: the same sequences run, with the same blocks, the same prefix hits, the same
preemptions. Both sample through one deterministic sampler, so the token streams agree."""

from __future__ import annotations

import json

import pytest

from kvpool.cache import FullAttentionManager
from kvpool.engine.build import descriptor_for, load_model
from kvpool.engine.engine import Engine
from kvpool.engine.llama_runner import LlamaRunner
from kvpool.engine.sampling import SamplingParams
from kvpool.sim.runner import SimRunner, VirtualClock
from kvpool.sim.tokens import stream_key, text_ids, token_at

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
    real = LlamaRunner(smollm2.model, NUM_BLOCKS, BLOCK, descriptor_for(smollm2, BLOCK))
    engine = Engine(real, sampler=_sampler, **kw)
    real_steps, real_out = _trace(engine, real.manager)

    clock = VirtualClock()
    chunks_per_step: list[int] = []

    def step_time(work, moved):
        chunks_per_step.append(len(work))
        return 1e-3 * len(work)

    manager = FullAttentionManager(NUM_BLOCKS, BLOCK, descriptor_for(smollm2, BLOCK))
    sim = SimRunner(
        manager,
        step_time=step_time,
        kv_read_bytes=lambda n: n,
        clock=clock,
        vocab_size=smollm2.model.config.vocab_size,
        max_model_len=real.max_model_len,
        block_bytes=1,
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
    for key in ("ttft_ms_p50", "tpot_ms_p99", "throughput_tok_s", "goodput_req_s", "prefix_hit_rate", "preemptions"):
        assert key in report
    assert (report["layout"], report["replicas"], report["routing"]) == ("paged", 1, "round-robin")
    assert report["num_finished"] == 60 and report["sim_wall_s"] > 0
    assert report["prefix_hit_rate"] > 0.3  # chat: shared system prompts and each session's history


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--model", "no-such-model"], "--model: unknown model 'no-such-model'"),
        (["--gpu", "a100"], "--gpu: unknown GPU 'a100'"),
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
    assert main(["simulate", "--trace", str(trace), "--requests", "2"]) == 2
    err = capsys.readouterr().err
    assert "line 2" in err and len(err.strip().splitlines()) == 1, err
