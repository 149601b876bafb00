"""V4 swap preemption: a preempted request's spans and its state (window, pending compressor
rows, the unfinished span's entries) go to the host tier; on resume the spans come back as
hits and the state from its tier entry, so nothing is replayed (engine/tier_bridge.py
`swap_out` / `swap_in`)."""

from __future__ import annotations

import pytest
import torch

from kvpool.engine.dsv4_runner import dsv4_runner
from kvpool.engine.engine import Engine
from kvpool.engine.runner import ScheduledChunk
from kvpool.engine.sampling import SamplingParams
from kvpool.models.tiny_dsv4 import SMALL_DSV4_CONFIG, TinyDSV4
from kvpool.tiers import HostTier
from kvpool.verify.dsv4_tolerance import FP64_TOLERANCE

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model() -> TinyDSV4:
    return TinyDSV4(SMALL_DSV4_CONFIG, seed=0, dtype=torch.float64)  # span 16, n_win 16, 4 layers


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _recording(runner) -> list[tuple]:
    """The executor's tier moves, in order: ("to_host", block ids), ("snapshot", slot,
    position, rows), ("restore", slot, position), ("replay", start, end, slot)."""
    calls: list[tuple] = []
    ex = runner.executor
    to_host, snapshot, restore, replay = ex.to_host, ex.window_snapshot, ex.restore_window, ex.replay

    def rec_to_host(block_ids):
        calls.append(("to_host", list(block_ids)))
        return to_host(block_ids)

    def rec_snapshot(slot, position, rows, **kw):
        calls.append(("snapshot", slot, position, rows, kw.get("unfinished_span", False)))
        return snapshot(slot, position, rows, **kw)

    def rec_restore(slot, position, snapshots):
        calls.append(("restore", slot, position, [p for p, _ in snapshots]))
        return restore(slot, position, snapshots)

    def rec_replay(token_ids, start, block_ids, slot, valid_from):
        calls.append(("replay", start, start + len(token_ids), slot))
        return replay(token_ids, start, block_ids, slot, valid_from)

    ex.to_host, ex.window_snapshot, ex.restore_window, ex.replay = rec_to_host, rec_snapshot, rec_restore, rec_replay
    return calls


def _step(runner, request_id: str, token_ids: list[int], start: int, next_token: int) -> torch.Tensor:
    """One step over the request's reservation [start, start + len(token_ids)); its logits."""
    logits = runner.execute([ScheduledChunk(request_id, token_ids, start, True)], all_logits=True)
    runner.commit_step([request_id], [len(token_ids)], [next_token])
    return logits


def test_a_swapped_state_comes_back_and_resumes_exactly(model) -> None:
    """A 40-token prompt (spans 0 and 1 in classical blocks 0 and 1, 8 tokens of span 2 in
    state block 0) is preempted: blocks 0 and 1 go to the host tier, and the state at 40 as
    one entry. Resumed, the two spans hit on the device, the state comes back into state
    block 1 (the FIFO's next), the admission counts 40 tokens computed and its restore is
    "swap": nothing replayed, the next token's logits are the contiguous oracle's. Preempted
    again with its state entry evicted, the resume falls back to today's replay of the window
    before the boundary at 32, equally exact."""
    runner = dsv4_runner(model, 6, 2, host_tier=HostTier(1 << 24), preemption="swap")
    calls = _recording(runner)
    prompt = _ids(40, 1)
    adm = runner.admit("a", prompt, None)
    assert (adm.num_cached_tokens, adm.num_scheduled_tokens) == (0, 40)
    _step(runner, "a", prompt, 0, 7)
    assert runner.cache.block_ids("a") == [0, 1] and runner.cache.part("a").state_slot == 0
    calls.clear()
    assert runner.release("a", "preempt")
    assert calls == [("to_host", [0, 1]), ("snapshot", 0, 40, 16, True)]
    moves = runner.tier_moves
    assert (moves.num_offloaded, moves.num_swapped_out, moves.num_states_swapped_out) == (2, 1, 1)
    (computed, key, _) = runner.bridge.swapped_states["a"]
    assert computed == 40 and runner.host_tier.num_entries == 3
    runner.check_integrity()

    calls.clear()
    tokens = prompt + [7]
    adm = runner.admit("a", tokens, None)
    part = adm.groups["v4"]
    assert (adm.num_cached_tokens, adm.num_scheduled_tokens) == (40, 1)
    assert list(part.block_ids) == [0, 1] and part.restore.method == "swap" and part.restore.state_slot == 1
    assert calls == [("restore", 1, 40, [40])]
    assert (moves.num_swapped_in, moves.num_tail_tokens_restored) == (1, 8)
    assert not runner.host_tier.contains(key) and runner.host_tier.num_entries == 2  # the state entry is spent
    logits = _step(runner, "a", [7], 40, 9)
    want = model.reference_logits(tokens)[-1]
    assert (logits[-1] - want).abs().max().item() <= FP64_TOLERANCE
    assert runner.num_replayed_tokens == 0
    runner.check_integrity()

    # preempted again at 41; its state entry gone before it resumes: today's replay
    calls.clear()
    runner.release("a", "preempt")
    assert calls == [("snapshot", 1, 41, 16, True)]  # blocks 0 and 1: the tier holds them
    runner.host_tier.evict(runner.bridge.swapped_states["a"][1])
    calls.clear()
    tokens = tokens + [9]
    adm = runner.admit("a", tokens, None)
    part = adm.groups["v4"]
    assert (adm.num_cached_tokens, adm.num_scheduled_tokens) == (32, 10)
    assert part.restore.method == "recompute" and part.restore.state_slot == 0
    assert "a" not in runner.bridge.swapped_states and moves.num_swapped_in == 1
    logits = _step(runner, "a", tokens[32:], 32, 3)
    assert calls == [("replay", 0, 32, 0)]  # n_win x layers = 64 tokens back: from 0
    want = model.reference_logits(tokens)[32:]
    assert (logits - want).abs().max().item() <= FP64_TOLERANCE
    runner.release("a")
    runner.check_integrity()
    assert runner.cache.usage().num_free_state_blocks == 2


def test_a_swapped_state_at_a_span_boundary_replaces_the_replay(model) -> None:
    """Preempted on a span boundary (32 computed): the state entry holds the window and the
    carried compressor rows; the resume hits 32 and takes them instead of replaying."""
    runner = dsv4_runner(model, 6, 2, host_tier=HostTier(1 << 24), preemption="swap")
    prompt = _ids(32, 2)
    runner.admit("b", prompt, None)
    _step(runner, "b", prompt, 0, 5)
    calls = _recording(runner)
    runner.release("b", "preempt")
    assert calls == [("to_host", [0, 1]), ("snapshot", 0, 32, 16, True)]
    calls.clear()
    adm = runner.admit("b", prompt + [5], None)
    assert (adm.num_cached_tokens, adm.groups["v4"].restore.method) == (32, "swap")
    logits = _step(runner, "b", [5], 32, 1)
    assert calls == [("restore", 1, 32, [32])]
    assert (logits[-1] - model.reference_logits(prompt + [5])[-1]).abs().max().item() <= FP64_TOLERANCE
    runner.check_integrity()


def test_a_released_swapped_request_leaves_no_state_entry(model) -> None:
    runner = dsv4_runner(model, 6, 2, host_tier=HostTier(1 << 24), preemption="swap")
    prompt = _ids(20, 3)
    runner.admit("c", prompt, None)
    _step(runner, "c", prompt, 0, 5)
    runner.release("c", "preempt")
    (_, key, _) = runner.bridge.swapped_states["c"]
    assert runner.host_tier.contains(key)
    assert not runner.release("c", "cancel")  # cancelled while it waited: its entry goes
    assert not runner.host_tier.contains(key) and "c" not in runner.bridge.swapped_states


def test_a_prefix_cache_reset_waits_for_a_swapped_request(model) -> None:
    """A request preempted by swap waits with its state in the host tier and its span boundary
    held in the group for its resume: the reset is refused (False, its span still hits), by
    the runner and by the cache alike; once it is cancelled the reset forgets the span."""
    runner = dsv4_runner(model, 6, 2, host_tier=HostTier(1 << 24), preemption="swap")
    prompt = _ids(20, 5)
    runner.admit("c", prompt, None)
    _step(runner, "c", prompt, 0, 5)
    runner.release("c", "preempt")
    assert runner.reset_prefix_cache() is False and runner.cache.reset_prefix_cache() is False
    assert runner.cache.lookup_prefix(prompt) == 16
    runner.release("c", "cancel")
    assert runner.reset_prefix_cache() is True
    assert runner.cache.lookup_prefix(prompt) == 0
    runner.cache.check_integrity()


def test_restore_swapped_state_names_what_it_refuses(model) -> None:
    runner = dsv4_runner(model, 6, 2, host_tier=HostTier(1 << 24), preemption="swap")
    prompt = _ids(40, 4)
    runner.admit("d", prompt, 10)  # [0, 10) reserved
    with pytest.raises(ValueError, match="a state 10 tokens on leaves no reserved token"):
        runner.cache.restore_swapped_state("d", 10)
    with pytest.raises(ValueError, match="cannot restore a state 16 tokens after 0 computed"):
        runner.cache.restore_swapped_state("d", 16)  # a whole span: not an unfinished one
    runner.check_integrity()


def _assert_logits_are_the_oracles(model, engine, prompts, outs) -> None:
    """Every logit row each request recorded is the contiguous oracle's over its prompt and
    the tokens it generated before it (fp64)."""
    for request, prompt, out in zip(engine.requests.values(), prompts, outs, strict=True):
        tokens = out.completions[0].token_ids
        got = torch.stack(request.seqs[0].logits)
        want = model.reference_logits(prompt + tokens[:-1])[len(prompt) - 1 :]
        assert got.shape == want.shape and (got - want).abs().max().item() <= FP64_TOLERANCE


@pytest.mark.parametrize("preemption", ["swap", "auto"])
def test_engine_logits_through_swap_preemptions_equal_the_oracle(model, preemption: str) -> None:
    """fp64: three requests on 6 classical blocks preempt each other; every logit of every
    request is the contiguous oracle's, and (swap) some resumes took their state from the
    tier. (auto decides by the rates it measures: swap or not, the logits are exact.)"""
    runner = dsv4_runner(model, 6, 3, host_tier=HostTier(1 << 24), preemption=preemption)
    engine = Engine(runner, max_num_batched_tokens=48, max_num_seqs=3, record_logits=True)
    prompts = [_ids(n, 10 + n) for n in (20, 37, 45)]
    outs = engine.generate(prompts, SamplingParams(max_tokens=30))
    assert engine.num_preemptions > 0 and (runner.tier_moves.num_swapped_in > 0 or preemption == "auto")
    _assert_logits_are_the_oracles(model, engine, prompts, outs)
    runner.check_integrity()
    assert runner.cache.usage().num_free_state_blocks == 3 and not runner.bridge.swapped_states
    report = runner.tier_reports()["host_tier"]
    assert report["swapped_in"] == runner.tier_moves.num_swapped_in
    assert report["states_swapped_out"] == runner.tier_moves.num_states_swapped_out


@pytest.mark.parametrize(
    "restore", [dict(restore="auto", num_checkpoints=8), dict(restore="checkpoint", num_checkpoints=2)]
)
def test_a_checkpoint_cut_keeps_a_swapped_states_boundary(model, restore: dict) -> None:
    """Restoring from checkpoints (build_engine's V4 default is auto with 8), a resume's hit
    used to be cut back to the last checkpointed boundary (or 0), below the swapped state,
    which was then thrown away. The span boundary before a state waiting in the tier stays
    a hit point: the state comes back, nothing is replayed, the logits are the oracle's,
    and the boundaries held are released with the states."""
    runner = dsv4_runner(model, 8, 3, host_tier=HostTier(1 << 24), preemption="swap", **restore)
    engine = Engine(runner, max_num_batched_tokens=48, max_num_seqs=3, record_logits=True)
    prompts = [_ids(n, 10 + n) for n in (20, 37, 45)]
    outs = engine.generate(prompts, SamplingParams(max_tokens=30, temperature=1.0, seed=5))
    moves = runner.tier_moves
    assert engine.num_preemptions > 0 and moves.num_states_swapped_out > 0
    assert moves.num_swapped_in > 0 and runner.num_replayed_tokens == 0
    _assert_logits_are_the_oracles(model, engine, prompts, outs)
    runner.check_integrity()
    assert not runner.bridge.swapped_states and not next(iter(runner.cache.groups.values()))._swap_boundaries


def test_auto_prices_the_state_entry_against_the_replay_it_saves(model) -> None:
    """The rule on rates set by hand: a request 40 tokens in (boundary 32, 8 past it) would
    recompute the window before 32 (n_win x layers = 64 tokens back: all 32) and the 8: 40
    tokens; a swap moves its state entry out and back, two blocks' bytes each way, at 1 s
    over the 16 blocks' bytes moved so far (10 blocks, 3 state entries): 0.25 s."""
    runner = dsv4_runner(model, 6, 2, host_tier=HostTier(1 << 24), preemption="auto")
    prompt = _ids(40, 5)
    runner.admit("x", prompt, None)
    _step(runner, "x", prompt, 0, 5)
    moves, block_bytes = runner.tier_moves, runner.executor.block_bytes
    moves.offload_s, moves.load_s, moves.num_offloaded, moves.num_loaded = 1.0, 0.0, 10, 0  # 0.1 s a block
    moves.num_states_swapped_out, moves.state_bytes_swapped_out = 3, 6 * block_bytes  # 2 blocks' bytes each
    runner._prefill_tokens, runner._prefill_s = 1000, 1.0  # 1 ms a token: recompute 40 ms < move 250 ms
    assert not runner._should_swap("x")
    runner._prefill_s = 6.0  # 6 ms a token: recompute 240 ms, still less
    assert not runner._should_swap("x")
    runner._prefill_s = 7.0  # 7 ms a token: recompute 280 ms > move 250 ms
    assert runner._should_swap("x")


def test_a_request_preempted_before_its_deferred_replay_swaps_no_state(model) -> None:
    """ "b" hits "a"'s two spans (32 tokens, blocks 0 and 1) and its restore by replay waits
    for the next step; preempted before that step, its state block holds no state of its own
    yet: the swap writes the two blocks (the tier lacks them) and no state entry; its resume
    replays as without a swap, and its logits are the oracle's."""
    runner = dsv4_runner(model, 6, 2, host_tier=HostTier(1 << 24), preemption="swap")
    prompt = _ids(40, 6)
    runner.admit("a", prompt, None)
    _step(runner, "a", prompt, 0, 5)
    runner.release("a")
    calls = _recording(runner)
    follow = prompt[:32] + _ids(12, 7)
    adm = runner.admit("b", follow, None)
    assert (adm.num_cached_tokens, adm.groups["v4"].restore.method) == (32, "recompute")
    runner.release("b", "preempt")
    assert calls == [("to_host", [0, 1])] and "b" not in runner.bridge.swapped_states
    assert runner.tier_moves.num_states_swapped_out == 0
    calls.clear()
    adm = runner.admit("b", follow, None)
    assert (adm.num_cached_tokens, adm.groups["v4"].restore.method) == (32, "recompute")
    logits = _step(runner, "b", follow[32:], 32, 1)
    assert calls == [("replay", 0, 32, adm.groups["v4"].restore.state_slot)]
    assert (logits - model.reference_logits(follow)[32:]).abs().max().item() <= FP64_TOLERANCE
    runner.check_integrity()
