"""The tiny V4 model on the dual pool under the engine's scheduler (token ids in, ids out)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvpool.engine.build import build_engine
from kvpool.engine.dsv4_runner import dsv4_runner
from kvpool.engine.engine import Engine
from kvpool.engine.runner import MeasuredRestoreCost, ScheduledChunk, last_token_rows
from kvpool.engine.sampling import SamplingParams
from kvpool.models.tiny_dsv4 import TinyDSV4
from kvpool.verify.dsv4_tolerance import FP64_TOLERANCE, derived_fp32_tolerance

pytestmark = pytest.mark.usefixtures("one_thread")


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(77)
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in (5, 130, 200)]


MARGIN = 1e-3  # logits; fp32 rounding on this model is ~3e-6 (kvpool verify dsv4 --dtype fp32)


def _assert_greedy_matches_oracle(model: TinyDSV4, prompt: list[int], output: list[int]) -> None:
    """Greedy: token i is the argmax of the oracle's logits at the position before it. The
    oracle runs on the same weights in fp64; wherever its top-2 margin is wider than MARGIN,
    fp32 rounding on any CPU cannot move the argmax, so the tokens must agree there. At the
    first position that close to a tie the sequences may part, and the check stops."""
    logits = model.to(torch.float64).reference_logits(prompt + output[:-1])[len(prompt) - 1 :]
    top2 = logits.topk(2, dim=-1)
    for i, token in enumerate(output):
        if top2.values[i, 0] - top2.values[i, 1] < MARGIN:
            assert i > 0, "the first token is a near tie: pick another prompt"
            return
        assert token == int(top2.indices[i, 0]), f"position {i}: {token} != the oracle's {int(top2.indices[i, 0])}"


@pytest.mark.parametrize("restore", ["recompute", "checkpoint", None])
def test_generate_greedy_equals_oracle(restore: str | None) -> None:
    engine = build_engine(TinyDSV4(), max_num_batched_tokens=64, restore=restore)  # chunked prefill
    assert isinstance(engine, Engine)
    assert engine.runner.cache.groups["v4"].spec.restore == restore or (
        restore is None and engine.runner.cache.groups["v4"].spec.restore == "auto"
    )
    prompts = _prompts()
    outs = engine.generate(prompts, SamplingParams(max_tokens=12))
    model = engine.runner.model  # type: ignore[attr-defined]
    for prompt, out in zip(prompts, outs, strict=True):
        assert len(out.completions[0].token_ids) == 12
        _assert_greedy_matches_oracle(model, prompt, out.completions[0].token_ids)
    engine.runner.check_integrity()
    # a second round reuses the 130- and 200-token prompts' first span from the prefix cache
    again = engine.generate(prompts[1:], SamplingParams(max_tokens=4))
    assert [o.completions[0].token_ids for o in again] == [o.completions[0].token_ids[:4] for o in outs[1:]]
    usage = engine.runner.usage()
    assert usage.num_free_state_blocks == usage.num_state_blocks
    engine.runner.check_integrity()


def test_preemption_under_a_small_classical_pool() -> None:
    model = TinyDSV4(seed=0)
    runner = dsv4_runner(model, num_classical_blocks=2, num_state_blocks=3)
    engine = Engine(runner, max_num_batched_tokens=256, max_num_seqs=3)
    prompts = _prompts()
    outs = engine.generate(prompts, SamplingParams(max_tokens=60))  # 200 + 60 tokens need 2 blocks alone
    for prompt, out in zip(prompts, outs, strict=True):
        _assert_greedy_matches_oracle(model, prompt, out.completions[0].token_ids)
    assert engine.num_preemptions > 0
    runner.check_integrity()
    assert runner.cache.num_free_blocks == 2 and runner.cache.usage().num_free_state_blocks == 3


def test_parallel_samples_fork_the_state() -> None:
    engine = build_engine(TinyDSV4())
    prompt = _prompts()[1]
    (out,) = engine.generate([prompt], SamplingParams(max_tokens=5, n=2, temperature=0.0))
    a, b = (c.token_ids for c in out.completions)
    assert a == b  # greedy children of one forked state agree
    _assert_greedy_matches_oracle(engine.runner.model, prompt, a)  # type: ignore[attr-defined]
    engine.runner.check_integrity()


def test_parallel_samples_without_a_free_state_block_wait_and_recompute() -> None:
    # 4 samples, 2 state blocks: the fork finds room for one child; the other two take
    # their first token from the shared prompt logits, wait, and are recomputed through
    # the prefix cache once a sample finishes. Greedy: all four must equal the oracle.
    model = TinyDSV4(seed=0)
    runner = dsv4_runner(model, num_classical_blocks=8, num_state_blocks=2)
    engine = Engine(runner, max_num_batched_tokens=256, max_num_seqs=4)
    forks: list[bool] = []
    fork = runner.fork
    runner.fork = lambda parent, child: forks.append(fork(parent, child)) or forks[-1]  # type: ignore[method-assign]
    prompt = _prompts()[1]
    (out,) = engine.generate([prompt], SamplingParams(max_tokens=6, n=4, temperature=0.0))
    assert forks == [True, False, False]  # the parent holds one state block, one child the other
    assert len(out.completions) == 4
    for c in out.completions:
        assert c.finish_reason == "length"
        _assert_greedy_matches_oracle(model, prompt, c.token_ids)
    runner.check_integrity()
    assert runner.cache.usage().num_free_state_blocks == 2 and runner.cache.num_free_blocks == 8


def _generate_args(**kw: object):
    """`kvpool generate --model tiny-dsv4`'s flags as its parser reads them (every default
    there, the new ones included), with `kw` set over them."""
    from kvpool.cli.main import build_parser

    argv = ["generate", "5,17,42,99", "--no-chat", "--max-tokens", "6", "--seed", "0", "--num-blocks", "16"]
    args = build_parser().parse_args([*argv, "--json", "--model", "tiny-dsv4"])
    for name, value in kw.items():
        setattr(args, name, value)
    return args


def test_generate_tiny_dsv4_token_ids(capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from kvpool.cli import generate_dsv4

    assert generate_dsv4.run(_generate_args()) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["prompt_tokens"] == 4 and len(out["token_ids"]) == 6
    _assert_greedy_matches_oracle(TinyDSV4(seed=0), [5, 17, 42, 99], out["token_ids"])
    with pytest.raises(ValueError, match="--no-chat"):
        generate_dsv4.run(_generate_args(no_chat=False))
    with pytest.raises(ValueError, match="token ids"):
        generate_dsv4.run(_generate_args(prompt="hello"))
    with pytest.raises(ValueError, match=r"\[0, 256\)"):
        generate_dsv4.run(_generate_args(prompt="1,999"))


def test_kvpool_generate_command_runs_tiny_dsv4(capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from kvpool.cli.main import main

    assert main(["generate", "5,17,42,99", "--model", "tiny-dsv4", "--no-chat", "--json", "--max-tokens", "6"]) == 0
    out = json.loads(capsys.readouterr().out)
    _assert_greedy_matches_oracle(TinyDSV4(seed=0), [5, 17, 42, 99], out["token_ids"])


def test_a_deferred_restore_leaves_with_its_request() -> None:
    # b hits a's first span and is restored by recompute, which waits for b's first step;
    # b is preempted before that step: its replay must not run (nor fail) in c's step, and
    # b admitted again is restored by its own, new replay.
    runner = dsv4_runner(TinyDSV4(seed=0), num_classical_blocks=8, num_state_blocks=3)
    a = _prompts()[1]
    assert runner.admit("a", a, len(a)) is not None
    runner.execute([ScheduledChunk("a", a, 0, True)])
    runner.commit_step(["a"], [len(a)], [None])
    b = a[:128] + [1, 2, 3]
    adm = runner.admit("b", b, 3)
    assert adm.num_cached_tokens == 128 and adm.groups["v4"].restore.method == "recompute"
    assert list(runner._replays) == ["b"]
    assert runner.release("b", "preempt")
    assert not runner._replays
    assert runner.admit("c", [7, 8, 9], 3) is not None
    runner.execute([ScheduledChunk("c", [7, 8, 9], 0, True)])
    runner.commit_step(["c"], [3], [None])
    adm = runner.admit("b", b, 3)
    (logits,) = runner.execute([ScheduledChunk("b", b[128:], 128, True)])
    model = runner.model
    ref32, ref64 = model.reference_logits(b)[-1], model.to(torch.float64).reference_logits(b)[-1]
    tol = derived_fp32_tolerance(float((ref32.double() - ref64).abs().max()), float(ref64.abs().max()))
    assert float((logits.double() - ref64).abs().max()) <= tol  # a missing or doubled replay is O(0.1)
    runner.commit_step(["b"], [3], [None])
    runner.check_integrity()


def test_measured_restore_cost_prices_in_tokens_until_it_knows_both_rates() -> None:
    cost = MeasuredRestoreCost()
    assert (cost.checkpoint_cost(), cost.compute_cost(10, 100)) == (0.0, 10.0)  # TokenCost
    cost.num_copies, cost.copy_s = 2, 0.004
    assert (cost.checkpoint_cost(), cost.compute_cost(10, 100)) == (0.0, 10.0)  # no replay timed yet
    cost.num_replayed_tokens, cost.replay_s = 100, 0.5
    assert cost.checkpoint_cost() == pytest.approx(0.002) and cost.compute_cost(10, 100) == pytest.approx(0.05)


def test_the_engine_report_counts_a_hash_collision_among_checkpoint_slots() -> None:
    # A pool of checkpoint slots of its own (num_checkpoints) is one of the cache's pools:
    # the report's hash_collisions sums over them (before: the slot pool was left out, 0)
    runner = dsv4_runner(TinyDSV4(), 8, 3, restore="checkpoint", num_checkpoints=2)
    slots = runner.cache.groups["v4"].checkpoint_pool
    digest = slots.hasher.digest
    slots.hasher.digest = lambda data: digest(b"x") if b"v4-state:" in data else digest(data)
    prompt = torch.randint(0, 256, (2 * 128 + 5,), generator=torch.Generator().manual_seed(3)).tolist()
    runner.add_request("a", prompt)
    runner.step([("a", len(prompt))])  # checkpoints at 128 and 256: the second collides
    runner.check_integrity()
    assert slots.num_collisions == 1 and runner.cache_stats()["hash_collisions"] == 1


def test_a_follow_up_turn_adopts_the_state_its_turn_left_and_equals_the_oracle() -> None:
    """fp64: a conversation's next turn resumes inside a span, on the state block its turn
    left (nothing reset, copied or replayed), and its logits are the contiguous oracle's
    over the whole prompt; the same follow-up again (the kept block is gone) hits the span
    boundary and replays, equally exact."""
    model = TinyDSV4(dtype=torch.float64)  # span 128, n_win 128, 5 layers
    runner = dsv4_runner(model, 16, 4, restore="recompute", turn_end_checkpoints=True)
    engine = Engine(runner, max_num_batched_tokens=256, max_num_seqs=4, record_logits=True)
    moves: list[tuple[str, int]] = []
    reset, copy = runner.executor.reset_state, runner.executor.copy_state
    runner.executor.reset_state = lambda slot: (moves.append(("reset", slot)), reset(slot))[1]  # type: ignore[method-assign]
    runner.executor.copy_state = lambda src, dst: (moves.append(("copy", dst)), copy(src, dst))[1]  # type: ignore[method-assign]
    prompt = _prompts()[1]  # 130 tokens
    (first,) = engine.generate([prompt], SamplingParams(max_tokens=12))
    states = runner.cache.groups["v4"].state_pool
    (kept,) = [b for b in range(states.num_blocks) if states.block_hash(b) is not None]
    assert moves == [("reset", kept)]  # turn 1: a fresh state; it ends at 130 + 11 = 141, in span 1
    follow_up = prompt + first.completions[0].token_ids + [5, 7, 11]
    for expected_hit, expected_moves in ((141, []), (128, [("reset", 1)])):
        moves.clear()
        hits, replayed = runner.cache.stats.num_hit_tokens, runner.num_replayed_tokens
        (out,) = engine.generate([follow_up], SamplingParams(max_tokens=6))
        assert runner.cache.stats.num_hit_tokens - hits == expected_hit
        assert moves == expected_moves and runner.restore_cost.num_copies == 0
        assert runner.num_replayed_tokens - replayed == (expected_hit if expected_hit == 128 else 0)
        tokens = out.completions[0].token_ids
        got = torch.stack(list(engine.requests.values())[-1].seqs[0].logits)
        want = model.reference_logits(follow_up + tokens[:-1])[len(follow_up) - 1 :]
        assert got.shape == want.shape and (got - want).abs().max().item() <= FP64_TOLERANCE
    runner.check_integrity()


@pytest.mark.parametrize("restore", ["checkpoint", "auto"])
def test_a_pooled_checkpoint_restore_equals_the_oracle(restore: str) -> None:
    """fp64: checkpoints pooled in the classical pool (2 blocks each), taken at 128 and 256
    inside a chunked prefill; follow-ups hitting 256 and 128 restore their state from them
    (nothing replayed), and every logit is the contiguous oracle's. The snapshots' first
    blocks are classical ids that are state slots too (0-2): a copy from the state slot of
    that number instead of the snapshot's own row is O(0.1) off."""
    model = TinyDSV4(dtype=torch.float64)  # span 128, n_win 128, 5 layers
    runner = dsv4_runner(model, 12, 3, restore=restore, checkpoint_blocks=2)
    engine = Engine(runner, max_num_batched_tokens=96, max_num_seqs=3, record_logits=True)
    g = torch.Generator().manual_seed(5)
    prompt = torch.randint(0, 256, (300,), generator=g).tolist()
    admissions, restored = [], []
    admit = runner.admit
    runner.admit = lambda *a, **kw: admissions.append(admit(*a, **kw)) or admissions[-1]  # type: ignore[method-assign]
    for hit in (None, 256, 128):
        ids = prompt if hit is None else prompt[:hit] + torch.randint(0, 256, (10,), generator=g).tolist()
        (out,) = engine.generate([ids], SamplingParams(max_tokens=5))
        tokens = out.completions[0].token_ids
        got = torch.stack(list(engine.requests.values())[-1].seqs[0].logits)
        want = model.reference_logits(ids + tokens[:-1])[len(ids) - 1 :]
        assert got.shape == want.shape and (got - want).abs().max().item() <= FP64_TOLERANCE
        assert tokens == want.argmax(dim=-1).tolist()
        if hit is not None:
            part = admissions[-1].groups["v4"]
            assert admissions[-1].num_cached_tokens == hit and part.restore.method == "checkpoint"
            restored.append(part.restore.checkpoint_slot)
    assert restored == [4, 1]  # (128's snapshot: blocks 1, 2; 256's: 4, 5; block 0 and 3 are spans)
    assert runner.num_replayed_tokens == 0 and runner.restore_cost.num_copies == 4  # 2 taken, 2 restored
    runner.check_integrity()


@pytest.mark.parametrize(
    ("kw", "checkpoint_rows"),
    [
        ({}, 0),
        ({"restore": "checkpoint", "num_checkpoints": 4}, 4),
        ({"restore": "auto", "checkpoint_blocks": 2}, 64),  # a row per classical block
        ({"restore": "recompute", "checkpoint_blocks": 2}, 0),  # the cache takes no snapshot
        ({"restore": "auto", "checkpoint_blocks": 2, "enable_prefix_caching": False}, 0),
    ],
)
def test_kv_capacity_bytes_counts_every_state_row_the_executor_allocates(kw: dict, checkpoint_rows: int) -> None:
    from kvpool.models.tiny_dsv4 import SMALL_DSV4_CONFIG

    runner = dsv4_runner(TinyDSV4(SMALL_DSV4_CONFIG), 64, 16, **kw)
    pools = runner.executor.pools
    assert pools.num_slots == 16 + checkpoint_rows
    allocated = sum(t.numel() * t.element_size() for st in pools.state for t in st.tensors())
    allocated += pools.classical_block_bytes() * 64
    assert runner.cache_stats()["kv_capacity_bytes"] == allocated


def test_a_step_cut_at_checkpoints_computes_only_the_rows_it_returns() -> None:
    """fp64, checkpoints at 128 and 256: a step whose first and third chunks cross them (a
    chunk with logits cut in three, one without cut in two) beside a chunk that needs none
    and a decode-sized prompt. Without all_logits each piece forward computes only the rows
    the step returns, which the runner puts in chunk order: the rows of the same step on a
    twin runner computed with every token's logits, at the chunks' last tokens."""
    g = torch.Generator().manual_seed(11)
    prompts = {
        name: torch.randint(0, 256, (n,), generator=g).tolist() for name, n in (("a", 300), ("b", 5), ("c", 200))
    }
    chunks = [
        ScheduledChunk("a", prompts["a"], 0, True),
        ScheduledChunk("b", prompts["b"], 0, True),
        ScheduledChunk("c", prompts["c"][:150], 0, False),
    ]
    got = []
    for all_logits in (False, True):
        runner = dsv4_runner(TinyDSV4(dtype=torch.float64), 16, 4, restore="checkpoint", checkpoint_blocks=2)
        forwards: list[tuple[list[int], int]] = []  # each forward's chunk lengths and rows of logits

        def counted(c, cache, every, forward=runner.executor.forward, forwards=forwards):
            out = forward(c, cache, every)
            forwards.append(([len(x.token_ids) for x in c], len(out)))
            return out

        runner.executor.forward = counted  # type: ignore[method-assign]
        for name, prompt in prompts.items():
            assert runner.admit(name, prompt, 150 if name == "c" else len(prompt)) is not None
        logits = runner.execute(chunks, all_logits=all_logits)
        rows = [1, 0, 1] if not all_logits else [261, 150, 44]  # b's, then a's last token's
        assert forwards == list(
            zip([[128, 5, 128], [128, 22], [44]], rows, strict=True)
        )  # cut at a's 128, 256, c's 128
        got.append(logits if not all_logits else logits[last_token_rows(chunks)])
        runner.commit_step(["a", "b", "c"], [300, 5, 150], [None, None, None])
        runner.check_integrity()
    assert got[0].shape == (2, got[0].shape[1])
    assert (got[0] - got[1]).abs().max().item() <= FP64_TOLERANCE
    model = TinyDSV4(dtype=torch.float64)
    want = torch.stack([model.reference_logits(prompts[name])[-1] for name in ("a", "b")])
    assert (got[0] - want).abs().max().item() <= FP64_TOLERANCE


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"params": {"max_tokens": 2}}, "params must be a SamplingParams, got dict"),
        ({"request_id": 7}, "request_id must be a str, got int"),
        ({"tenant": 3}, "tenant must be a str, got int"),
        ({"arrival_time": "0"}, "arrival_time must be a finite number of seconds, got '0'"),
        ({"arrival_time": float("nan")}, "arrival_time must be a finite number of seconds, got nan"),
        ({"arrival_time": True}, "arrival_time must be a finite number of seconds, got True"),
    ],
)
def test_add_request_refuses_arguments_of_the_wrong_type(options, message) -> None:
    """An id of 7 (or a SamplingParams given in its place) was taken as the request's id; an
    arrival time of "0" was taken and failed `output` with a TypeError once the request was
    served; nan gave a nan TTFT; a dict of params or an int tenant were AttributeErrors.
    Each is a TypeError naming the argument now, nothing queued."""
    engine = build_engine(TinyDSV4(), num_blocks=4)
    with pytest.raises(TypeError, match=message.replace("(", r"\(")):
        engine.add_request([1, 2, 3], **options)
    assert not engine.requests and not engine.has_unfinished()
    assert engine.add_request([1, 2, 3], SamplingParams(max_tokens=1), "ok", arrival_time=0, tenant="t") == "ok"


def test_add_request_takes_numpys_numbers_as_arrival_times() -> None:
    """numpy's ints and floats are numbers (they were taken before the type checks above, and
    refused as 'not a finite number' by them): each is taken as a float."""
    engine = build_engine(TinyDSV4(), num_blocks=8)
    for i, when in enumerate((np.int64(3), np.float32(2.5), 1, 0.5)):
        engine.add_request([1, 2, 3], SamplingParams(max_tokens=1), f"r{i}", arrival_time=when)
        arrival = engine.requests[f"r{i}"].arrival_time
        assert type(arrival) is float and arrival == float(when)


@pytest.mark.parametrize("restore", ["checkpoint", "auto"])
def test_turn_end_states_spilled_under_max_num_seqs_are_hit_and_equal_the_run_without_caching(restore: str) -> None:
    """fp64, 2 state blocks and max_num_seqs 2: three conversations of three turns, each turn
    of all three queued at once, so another conversation's turn takes a kept turn-end state's
    block before its follow-up comes: the state is spilled to a pooled checkpoint (2
    classical blocks) and the follow-up restores it from there, inside a span. Tokens and
    logits equal the run without prefix caching; check_integrity after every step."""
    model = TinyDSV4(dtype=torch.float64)  # span 128, n_win 128, 5 layers
    g = torch.Generator().manual_seed(11)
    first = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (130, 150, 170)]

    def run(caching: bool) -> tuple[object, list[tuple[list[int], torch.Tensor]]]:
        runner = dsv4_runner(
            model, 24, 2, restore=restore, checkpoint_blocks=2, turn_end_checkpoints=True, enable_prefix_caching=caching
        )
        engine = Engine(runner, max_num_batched_tokens=256, max_num_seqs=2, record_logits=True)
        convs, outputs = [list(p) for p in first], []
        for turn in range(3):
            rids = [engine.add_request(conv, SamplingParams(max_tokens=6)) for conv in convs]
            while engine.has_unfinished():
                engine.step()
                runner.check_integrity()
            for i, rid in enumerate(rids):
                seq = engine.requests[rid].seqs[0]
                out = seq.token_ids[len(convs[i]) :]
                outputs.append((out, torch.stack(seq.logits)))
                convs[i] = convs[i] + out + [turn, 7]  # the next turn: inside span 1
        return runner, outputs

    cached, got = run(True)
    plain, want = run(False)
    group = cached.cache.groups["v4"]
    # every follow-up (6) restores a spilled state (none is adopted), at its turn end
    assert (group.num_spills, group.num_spill_hits, group.num_adoptions) == (7, 6, 0)
    assert plain.cache.groups["v4"].num_spills == 0 and plain.cache.stats.num_hit_tokens == 0
    assert cached.cache.stats.num_hit_tokens == 954 and cached.num_replayed_tokens == 0
    for (tokens, logits), (tokens_ref, logits_ref) in zip(got, want, strict=True):
        assert tokens == tokens_ref and (logits - logits_ref).abs().max().item() <= FP64_TOLERANCE
