"""kvpool run's pieces as a library user calls them, with no flags: engine/live.py
`serve_live` driving the tiny V4 engine over the live workload (the finished count, the
prefix hits counted by hand, the kept turn-end states adopted), Ctrl-C in the middle of a
run, and engine/build.py `limit_model_len`."""

from __future__ import annotations

import random
import re

import pytest
import torch

from kvpool.engine import live
from kvpool.engine.build import build_engine, limit_model_len
from kvpool.engine.live import num_live_requests, serve_live
from kvpool.engine.sampling import SamplingParams, derived_seed
from kvpool.models.tiny_dsv4 import TinyDSV4
from kvpool.workload.live import LiveWorkload, live_token_ids
from kvpool.workload.metrics import report_notes, run_report


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny steps on shared cores
    yield
    torch.set_num_threads(threads)


def _tiny_v4(turn_ends: bool):
    """`kvpool run --model tiny-dsv4 --max-batch-tokens 1024`'s engine."""
    model = TinyDSV4(seed=0)
    engine = build_engine(
        model,
        kv_memory_bytes=16 * 2**20,
        num_state_blocks=16,
        max_num_batched_tokens=1024,
        max_num_seqs=16,
        turn_end_checkpoints=turn_ends,
    )
    return engine, model.vocab_size


def _serve(engine, vocab_size: int, num_conversations: int, **kwargs):
    rng = random.Random(0)
    workload = live_token_ids(vocab_size, num_conversations, 0, rng, seed=0)
    params = SamplingParams(max_tokens=4, temperature=0.7, top_p=0.9, seed=0)
    run = serve_live(engine, workload, params, turns=2, request_rate=float("inf"), rng=rng, **kwargs)
    return workload, run


def _report(engine, run) -> dict:
    return run_report(
        engine,
        context_ended=run.context_ended,
        model_name="tiny-dsv4",
        wall_s=run.wall_s,
        step_s=run.step_s,
        fragmentation=run.fragmentation,
        kv_read_bytes=run.kv_read_bytes,
        interrupted=run.stopped is not None,
        slo_ttft_ms=1e9,
        slo_tpot_ms=1e9,
        request_rate=float("inf"),
    )


@pytest.mark.parametrize("turn_ends", [False, True])
def test_serve_live_runs_every_turn_and_the_follow_ups_hit_their_first_turns(turn_ends):
    # 3 conversations over 3 distinct 300-token system prompts + 20-token questions, all at
    # once: first turns hit nothing. Each answer is 4 tokens (no EOS in the tiny model); a
    # follow-up is 320 + 4 + 12 = 336 tokens, of which its first turn computed 323: 2 whole
    # 128-token spans (256) without turn-end states, all 323 with them (the kept state adopted).
    engine, vocab_size = _tiny_v4(turn_ends)
    progress: list[int] = []
    workload, run = _serve(engine, vocab_size, 3, on_progress=lambda n, _: progress.append(n))
    assert run.stopped is None and num_live_requests(workload, 2) == 6 and sum(progress) == 6
    assert len(run.fragmentation) == len(progress) == engine.num_steps and run.step_s <= run.wall_s
    report = _report(engine, run)
    assert (report["num_requests"], report["num_finished"], report["num_generated_tokens"]) == (6, 6, 24)
    assert report["prefix_queried_tokens"] == 3 * 320 + 3 * 336
    assert report["prefix_hit_tokens"] == 3 * (323 if turn_ends else 256)
    assert (report["v4_turn_ends"], report["state_adoptions"]) == (turn_ends, 3 if turn_ends else 0)
    assert report["goodput_req_s"] == round(6 / run.wall_s, 3) and report["request_rate"] == "inf"
    assert report["read_bandwidth_gbps"] == round(run.kv_read_bytes / run.step_s / 1e9, 3) > 0
    # the run moved the conversations on: serving them again would give no follow-up turns
    fresh, _ = _tiny_v4(turn_ends)
    with pytest.raises(ValueError, match="conversations were served already"):
        serve_live(fresh, workload, SamplingParams(max_tokens=4), turns=2, request_rate=1.0, rng=random.Random(0))
    assert not fresh.has_unfinished() and fresh.num_steps == 0


def test_the_reads_counted_are_every_chunk_the_steps_ran_those_that_finished_included():
    """kv_read_bytes summed the contexts of `engine.running` after each step, which no longer
    holds a sequence that finished in it: every request's last step went uncounted (here, 4-
    token answers, a quarter of the reads; `kvpool run --max-tokens 1`: two thirds), and the
    report's read_bandwidth_gbps with it. Counted here from the chunks the runner executed."""
    engine, vocab_size = _tiny_v4(False)
    execute, ends = engine.runner.execute, []

    def counted_execute(chunks):
        ends.extend(c.start + len(c.token_ids) for c in chunks)
        return execute(chunks)

    engine.runner.execute = counted_execute
    _, run = _serve(engine, vocab_size, 3)
    assert run.stopped is None and len(ends) > engine.num_steps  # (steps of several chunks)
    assert run.kv_read_bytes == sum(engine.runner.kv_read_bytes(end) for end in ends)


def test_ctrl_c_aborts_what_is_left_and_the_report_covers_what_finished():
    engine, vocab_size = _tiny_v4(True)
    step, calls = engine.step, []

    def interrupted_step():
        calls.append(1)
        if len(calls) == 8:  # past the first turns (4 tokens each: 4 steps), inside the follow-ups
            raise KeyboardInterrupt
        return step()

    engine.step = interrupted_step
    _, run = _serve(engine, vocab_size, 3)
    assert isinstance(run.stopped, KeyboardInterrupt) and not engine.has_unfinished()
    assert len(run.fragmentation) == 7  # the steps that ran
    report = _report(engine, run)
    assert report["interrupted"] is True and report["num_finished"] == 3 and report["num_requests"] == 6


def test_an_arrival_far_off_is_slept_towards_in_slices_and_ctrl_c_still_stops_the_run(monkeypatch):
    """`kvpool run --request-rate 1e-300`: the first arrival lies ~1e300 s away, and one
    time.sleep of it raised OverflowError ("timestamp out of range for platform time_t"), a
    traceback. The loop sleeps at most MAX_SLEEP_S at a time and looks at the clock again."""
    engine, vocab_size = _tiny_v4(False)
    slept: list[float] = []

    def sleep(seconds: float) -> None:
        slept.append(seconds)
        if len(slept) == 3:  # (Ctrl-C, the only way out of a wait this long)
            raise KeyboardInterrupt

    monkeypatch.setattr(live.time, "sleep", sleep)
    rng = random.Random(0)
    workload = live_token_ids(vocab_size, 1, 0, rng, seed=0)
    run = serve_live(engine, workload, SamplingParams(max_tokens=4), turns=1, request_rate=1e-300, rng=rng)
    assert slept == [live.MAX_SLEEP_S] * 3 and isinstance(run.stopped, KeyboardInterrupt)
    assert engine.num_steps == 0 and engine.requests == {}


def test_limit_model_len_caps_the_runner_and_refuses_more_than_it_holds():
    engine, _ = _tiny_v4(False)
    most = engine.runner.max_model_len
    limit_model_len(engine, None)
    assert engine.runner.max_model_len == most
    with pytest.raises(ValueError, match=rf"^--max-model-len {most + 1}: this model and KV pool hold at most {most} "):
        limit_model_len(engine, most + 1)
    limit_model_len(engine, 500)
    assert engine.runner.max_model_len == 500
    # a context of 1 token holds no prompt token beside its output token: every command that
    # takes --max-model-len (run, serve) refuses it here, before a request (run loaded the
    # model and failed its first request: "at most 0 tokens fit"); the cap stays as it was
    with pytest.raises(ValueError, match=r"^--max-model-len 1: a context of 1 token serves no request .* 2 or more"):
        limit_model_len(engine, 1)
    assert engine.runner.max_model_len == 500
    limit_model_len(engine, 2)
    assert engine.runner.max_model_len == 2
    # the pool's own limit below 2 (no flag given): the fix is a larger pool, not the flag
    engine.runner.max_model_len = 1
    with pytest.raises(ValueError, match=r"^a context of 1 token serves no request .*: give a larger --num-blocks"):
        limit_model_len(engine, None)


def test_a_prompt_too_long_for_the_context_is_refused_before_anything_is_served():
    """A long prompt over the context failed at its arrival, after the run had served the
    other requests until then (`kvpool run --kv-memory 32MiB`: 10 s in, no report; at a low
    --request-rate, minutes): every prompt known at the start is checked at the start."""
    engine, vocab_size = _tiny_v4(False)
    limit_model_len(engine, 500)  # the 320-token first turns fit; the 700-token long prompt does not
    rng = random.Random(0)
    workload = live_token_ids(vocab_size, 2, 1, rng, seed=0)
    with pytest.raises(ValueError, match=r"^request 'long0': prompt of 700 tokens is too long; at most 499 tokens fit"):
        serve_live(engine, workload, SamplingParams(max_tokens=4), turns=2, request_rate=1.0, rng=rng)
    assert engine.num_steps == 0 and not engine.has_unfinished() and engine.requests == {}


def test_a_follow_up_that_outgrows_the_context_ends_its_conversation_and_the_run_goes_on():
    """A follow-up turn too long for the context stopped the run mid-way with a ValueError and
    no report. Now its conversation ends there (the turn is not sent, named in the report and
    its notes) and the others are served: first turns of 320 tokens and 4-token answers fit a
    context of 330; every follow-up (336 tokens) does not, but for the one whose history is
    cut short here."""
    engine, vocab_size = _tiny_v4(False)
    limit_model_len(engine, 330)
    rng = random.Random(0)
    workload = live_token_ids(vocab_size, 3, 0, rng, seed=0)
    follow_up = workload.follow_up

    def shorter_for_chat1(conv, answer_ids, answer_text):
        prompt = follow_up(conv, answer_ids, answer_text)
        return prompt[-100:] if conv is workload.conversations[1] else prompt

    workload.follow_up = shorter_for_chat1
    params = SamplingParams(max_tokens=4, seed=0)
    unsent: list[int] = []
    run = serve_live(engine, workload, params, turns=2, request_rate=float("inf"), rng=rng, on_unsent=unsent.append)
    assert run.stopped is None and run.context_ended == ("chat0-t1", "chat2-t1")
    assert unsent == [1, 1]  # (each its second, last turn)
    report = _report(engine, run)
    assert (report["num_requests"], report["num_finished"], report["num_context_ended"]) == (4, 4, 2)
    assert report["context_ended"] == ["chat0-t1", "chat2-t1"] and report["max_model_len"] == 330
    assert (
        "note: 2 conversation(s) outgrew the context of 330 tokens and ended there, their next turn not sent "
        "(chat0-t1, chat2-t1)"
    ) in report_notes(report)
    assert not engine.has_unfinished()
    engine.runner.check_integrity()


def _tokens(engine) -> dict[str, list[int]]:
    return {rid: engine.output(rid).completions[0].token_ids for rid in engine.requests}


def test_unseeded_requests_each_take_a_seed_by_their_place_in_the_workload():
    """With no seed in the parameters each request samples with derived_seed(engine seed, k),
    k its place in `request_ids` (not the order it joined, which the clock decides): two
    conversations with the same first prompt draw different answers, and the same engine
    seed gives the same answers again."""
    runs, prompts = [], []
    for engine_seed, rate in ((3, float("inf")), (3, 50.0), (4, float("inf"))):
        engine, vocab_size = _tiny_v4(False)
        engine.reseed(engine_seed)
        rng = random.Random(0)
        workload = live_token_ids(vocab_size, 3, 1, rng, seed=0)
        workload.first_prompts[1] = list(workload.first_prompts[0])  # chat1 asks what chat0 asks
        workload.conversations[1].history = list(workload.conversations[0].history)
        params = SamplingParams(max_tokens=4, temperature=0.7, top_p=0.9)
        run = serve_live(engine, workload, params, turns=2, request_rate=rate, rng=rng)
        assert run.stopped is None and len(engine.requests) == 7
        order = workload.request_ids(2)
        assert order == ["chat0-t0", "chat0-t1", "chat1-t0", "chat1-t1", "chat2-t0", "chat2-t1", "long0"]
        assert [engine.requests[rid].params.seed for rid in order] == [derived_seed(engine_seed, k) for k in range(7)]
        tokens = _tokens(engine)
        assert tokens["chat0-t0"] != tokens["chat1-t0"]
        runs.append(tokens)
        prompts.append({rid: engine.requests[rid].prompt_ids for rid in order})
        engine.runner.check_integrity()
    # arrivals spread out (another join order, and the follow-ups made in another order): the
    # same seeds, the same prompts and the same answers, follow-ups included (their ids come
    # from each conversation's own generator: from the shared one in the clock's order they
    # differed); another engine seed: other answers
    assert prompts[0] == prompts[1] and runs[0] == runs[1]
    first = ["chat0-t0", "chat1-t0", "chat2-t0", "long0"]
    assert [runs[0][rid] for rid in first] != [runs[2][rid] for rid in first]


def test_a_run_of_a_billion_turns_makes_each_requests_parameters_as_it_sends_it(monkeypatch):
    """`kvpool run --turns 1000000` (24 conversations) made the parameters of every turn the
    run might send before the first step: 24 million, 6.6 GB and minutes, where the
    conversations end at the context after a few turns. Each request's seed is computed as
    it is sent (`request_index`: its place in `request_ids`, with no list of them)."""
    engine, vocab_size = _tiny_v4(False)
    # first turns of 320 tokens, each turn 16 more (a 4-token answer, 12 ids), the 700-token
    # long prompt: a conversation ends at this context after 30 turns
    limit_model_len(engine, 800)
    rng = random.Random(0)
    workload = live_token_ids(vocab_size, 2, 1, rng, seed=0)
    monkeypatch.setattr(LiveWorkload, "request_ids", lambda self, turns: pytest.fail("every turn listed"))
    turns = 10**9
    params = SamplingParams(max_tokens=4, temperature=0.7)
    run = serve_live(engine, workload, params, turns=turns, request_rate=float("inf"), rng=rng)
    assert run.stopped is None and run.context_ended == ("chat0-t30", "chat1-t30")
    assert len(engine.requests) == 2 * 30 + 1
    for rid, req in engine.requests.items():
        assert req.params.seed == derived_seed(engine.seed, workload.request_index(rid, turns))
    assert engine.requests["long0"].params.seed == derived_seed(engine.seed, 2 * turns)


def test_request_index_is_the_place_in_request_ids():
    workload = live_token_ids(50, 3, 2, random.Random(0), seed=0)
    for turns in (1, 2, 5):
        ids = workload.request_ids(turns)
        assert [workload.request_index(rid, turns) for rid in ids] == list(range(len(ids)))
    for rid in ("chat3-t0", "chat0-t2", "long2", "chat01-t0", "chat0-t-1", "long", "x", "chat0-t0 "):
        with pytest.raises(ValueError, match=f"^request id {re.escape(repr(rid))} is not one of this workload's"):
            workload.request_index(rid, 2)


def test_a_seed_in_the_parameters_is_every_requests():
    engine, vocab_size = _tiny_v4(False)
    rng = random.Random(0)
    workload = live_token_ids(vocab_size, 2, 0, rng, seed=0)
    serve_live(engine, workload, SamplingParams(max_tokens=2, seed=9), turns=2, request_rate=float("inf"), rng=rng)
    assert {r.params.seed for r in engine.requests.values()} == {9}


def test_kvpool_run_gives_each_request_its_own_seed_from_seed(monkeypatch, capsys):
    """`kvpool run` gave all its requests `--seed` itself, so requests with equal prompts (the
    main job's chats share 3 system prompts and 8 questions) drew equal tokens."""
    import kvpool.engine.live as live
    from kvpool.cli.main import main

    engines = []

    def serve_and_keep(engine, *args, **kwargs):
        engines.append(engine)
        return serve_live(engine, *args, **kwargs)

    monkeypatch.setattr(live, "serve_live", serve_and_keep)
    flags = ["--model", "tiny-dsv4", "--num-requests", "2", "--num-long", "1", "--max-tokens", "2"]
    assert main(["run", *flags, "--request-rate", "inf", "--seed", "5", "--threads", "1", "--json"]) == 0
    capsys.readouterr()
    (engine,) = engines
    order = ["chat0-t0", "chat0-t1", "chat1-t0", "chat1-t1", "long0"]
    assert [engine.requests[rid].params.seed for rid in order] == [derived_seed(5, k) for k in range(5)]


def test_the_progress_total_drops_the_turns_a_conversation_past_the_context_never_sends(capsys):
    """`kvpool run --turns 100` over 2 conversations counted 200 requests in its progress, and
    the conversations end at the context after 6 turns: the run ended at 12/200 (a bar that
    stopped short, lines that never reached the total), saying nothing of why. Now each
    conversation that ends takes its unsent turns off the total, and the line says so."""
    from kvpool.cli.main import main

    flags = ["--model", "tiny-dsv4", "--num-requests", "2", "--num-long", "0", "--threads", "1", "--json"]
    flags += ["--turns", "100", "--max-tokens", "2", "--max-model-len", "400", "--request-rate", "inf"]
    assert main(["run", *flags]) == 0
    err = capsys.readouterr().err
    assert "kvpool run: serving up to 200 requests on tiny-dsv4\n" in err
    last = re.findall(r"kvpool run: (\d+)/(\d+) requests finished, [\d.]+ s(.*)\n", err)[-1]
    done, total, why = int(last[0]), int(last[1]), last[2]
    assert done == total == 12 and why == " (188 turns not sent: their conversations outgrew the context)"


def test_the_serving_line_follows_the_length_check_and_says_up_to_when_turns_may_go_unsent(capsys):
    """`kvpool run: serving N requests` was printed before the prompts' lengths were checked
    (an error line could follow it), and counted every turn --turns asks for as sent, where a
    conversation that outgrows the context ends before them: which only the answers tell."""
    from kvpool.cli.main import main

    flags = ["--model", "tiny-dsv4", "--num-requests", "2", "--num-long", "0", "--threads", "1", "--json"]
    # first turns of 320 tokens in a context of 300: refused before the line
    assert main(["run", *flags, "--max-model-len", "300"]) == 2
    err = capsys.readouterr().err
    assert "serving" not in err and "request 'chat0-t0': prompt of 320 tokens is too long" in err
    # 2 conversations x 3 turns: at most 6, so said
    assert main(["run", *flags, "--turns", "3", "--max-tokens", "2", "--request-rate", "inf"]) == 0
    assert "kvpool run: serving up to 6 requests on tiny-dsv4\n" in capsys.readouterr().err
    # one turn each: every request is sent
    assert main(["run", *flags, "--turns", "1", "--max-tokens", "2", "--request-rate", "inf"]) == 0
    assert "kvpool run: serving 2 requests on tiny-dsv4\n" in capsys.readouterr().err
