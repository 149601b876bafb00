"""Tiny hybrid models on the coordinator, end to end: the verification matrix (fp64 exact,
fp32 within the oracle's own error), the fall-back hit that a deliberately broken
attention-only reuse gets wrong, the window group's memory at a context of 8 W measured
from the pool against the planner's formula, and `kvpool verify hybrid`."""

from __future__ import annotations

import json

import pytest
import torch

from kvpool.cache import BlockCopy
from kvpool.cache.coordinator import HybridCacheManager
from kvpool.cache.recurrent import RecurrentAdmit, RecurrentGroup
from kvpool.capacity.kv import PageGroup
from kvpool.cli.main import main
from kvpool.engine.engine import Engine
from kvpool.engine.hybrid_runner import descriptor_for, group_specs, hybrid_runner
from kvpool.engine.runner import ModelRunner
from kvpool.engine.sampling import SamplingParams
from kvpool.models.tiny_hybrid import TINY_GEMMA2, TINY_RECURRENT, TinyHybrid
from kvpool.verify.dsv4_tolerance import derived_fp32_tolerance
from kvpool.verify.hybrid import Verifier


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_the_verification_matrix_passes_for_both_models(one_thread, dtype):
    results = Verifier(dtype=dtype).run()
    assert len(results) == 59
    failed = [(r.name, r.max_abs_diff, r.tolerance, r.detail) for r in results if not r.passed]
    assert not failed
    if dtype == torch.float32:  # the bound is the oracle's own fp32 error, not a free constant
        assert all(r.tolerance < 1e-3 and r.reference_error is not None for r in results)


class AttentionOnlyReuse(RecurrentGroup):
    """Deliberately broken: serves every point, restoring the latest checkpoint at or
    before it (or a fresh state) without replaying the tokens in between."""

    def serves(self, hits, point):
        return True

    def upper_bound(self, hits):
        return 1 << 62  # bounds nothing: every point is served

    def plan_admit(self, hits, point, end):
        c = self.granularity
        found = [b for b in hits.found[: point // c] if b is not None] if hits else []
        src = found[-1].block_ids[0] if found else None
        need = 1 + (src is not None and self.pool.refcount(src) == 0)
        chain = hits.chain[: point // c] if hits else []  # the prompt's units, cached or not
        return RecurrentAdmit(src, chain), {self.pool: need}


def _runner(model: TinyHybrid, broken: bool) -> ModelRunner:
    cache = HybridCacheManager(group_specs(model, 8, 12, 32, 8), descriptor_for(model, 8))
    if broken:
        cache.groups["recurrent"].__class__ = AttentionOnlyReuse
    return hybrid_runner(model, 32, 8, block_size=8, checkpoint_interval=12, cache=cache)


def _second_turn(model: TinyHybrid, broken: bool) -> tuple[int, torch.Tensor, list[int]]:
    """A 41-token history computed, then a prompt sharing its first 40 tokens: the
    attention groups could serve 40 (5 blocks of 8), the recurrent group only 36."""
    runner = _runner(model, broken)
    g = torch.Generator().manual_seed(5)
    a = torch.randint(0, model.vocab_size, (41,), generator=g).tolist()
    runner.admit("a", a, None)
    runner.run([("a", a, 0)])
    runner.commit_step(["a"], [41], [None])
    b = a[:40] + [3, 1, 4, 1, 5]
    points = runner.cache.group_hit_points(b)
    assert points["full"][-1] == 40 and points["recurrent"][-1] == (44 if broken else 36)  # broken: serves all
    adm = runner.admit("b", b, None)
    logits = runner.run([("b", b[adm.num_cached_tokens :], adm.num_cached_tokens)])[0]
    runner.commit_step(["b"], [len(b) - adm.num_cached_tokens], [None])
    runner.check_integrity()
    return adm.num_cached_tokens, logits, b


def test_a_hit_the_recurrent_side_cannot_serve_falls_back_and_attention_only_reuse_is_wrong(one_thread):
    model = TinyHybrid(TINY_RECURRENT, seed=3)  # fp32, the model's own precision
    twin = model.to(torch.float64)
    point, logits, b = _second_turn(model, broken=False)
    assert point == 36  # the largest point both sides have; block 4 ([32, 40)) copied on write
    ref, exact = model.reference_logits(b), twin.reference_logits(b)
    tol = derived_fp32_tolerance(float((ref.double() - exact).abs().max()), float(exact.abs().max()))
    assert float((logits.double() - exact[36:]).abs().max()) <= tol
    # Reusing the attention side's 40 tokens with the state of 36 skips tokens [36, 40) in
    # the recurrence: the logits are wrong by far more than fp32 can explain.
    point, broken_logits, _ = _second_turn(model, broken=True)
    assert point == 40
    assert float((broken_logits.double() - exact[40:]).abs().max()) > 100 * tol
    # In fp64 the correct path is exact.
    point, logits64, _ = _second_turn(twin, broken=False)
    assert point == 36 and float((logits64 - exact[36:]).abs().max()) <= 1e-12


def test_a_follow_up_turn_resumes_inside_the_block_where_the_previous_turn_ended(one_thread):
    # Figure 12 in full, end to end: turn 1 (41 tokens, blocks of 8, checkpoints every 12)
    # finishes inside block 5; with turn ends kept, the follow-up resumes at 41: the state
    # from the turn-end checkpoint, block 5 (position 40's K/V) copied on write. Its logits
    # are the fp64 oracle's; without turn ends the hit is 36 (the last checkpoint).
    twin = TinyHybrid(TINY_RECURRENT, seed=3).to(torch.float64)
    g = torch.Generator().manual_seed(5)
    a = torch.randint(0, twin.vocab_size, (41,), generator=g).tolist()
    b = a + [3, 1, 4, 1, 5]
    exact = twin.reference_logits(b)
    for turn_ends, want in ((False, 36), (True, 41)):
        specs = group_specs(twin, 8, 12, 32, 8)
        cache = HybridCacheManager(specs, descriptor_for(twin, 8), turn_end_checkpoints=turn_ends)
        runner = hybrid_runner(twin, 32, 8, block_size=8, checkpoint_interval=12, cache=cache)
        runner.admit("a", a, None)
        runner.run([("a", a, 0)])
        runner.commit_step(["a"], [41], [None])
        assert runner.release("a", "finish")
        adm = runner.admit("b", b, None)
        assert adm is not None and adm.num_cached_tokens == want
        # The block of the hit point is copied into 6, the first unhashed free block: a's
        # partial block 5 (turn ends), else a's full block 4 (hit 36); block 7 for [40, 46)
        if turn_ends:
            full = adm.groups["full"]
            assert full.copies == (BlockCopy(5, 6),) and full.block_ids == (0, 1, 2, 3, 4, 6)
        else:
            full = adm.groups["full"]
            assert full.copies == (BlockCopy(4, 6),) and full.block_ids == (0, 1, 2, 3, 6, 7)
        logits = runner.run([("b", b[want:], want)])[0]
        runner.commit_step(["b"], [len(b) - want], [None])
        runner.check_integrity()
        assert float((logits - exact[want:]).abs().max()) <= 1e-12


def test_window_groups_hold_about_one_window_per_request_at_8w(one_thread):
    model = TinyHybrid(TINY_GEMMA2, seed=0)
    w, bs = model.window, 8
    runner = hybrid_runner(model, num_blocks=80, num_slots=1, block_size=bs)
    held: list[dict[str, int]] = []
    execute = runner.execute

    def measured(chunks):
        held.append(runner.cache.group_held_blocks())  # after the step's reservation, from the pools
        return execute(chunks)

    runner.execute = measured  # type: ignore[method-assign]
    engine = Engine(runner, max_num_batched_tokens=64)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, model.vocab_size, (6 * w,), generator=g).tolist()
    engine.add_request(prompt, SamplingParams(max_tokens=2 * w + 1, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
        runner.check_integrity()
    # The last step computes position 8 W - 1 (its sampled token, the last, is never
    # computed): a context of 8 W = 256 tokens.
    planner = PageGroup("window", 2, bs, 1, 1.0, 0.0, window=w)
    assert held[-1]["window"] == planner.num_blocks(8 * w) == w // bs  # 4 blocks: 32 tokens = W
    assert held[-1]["full"] == 8 * w // bs  # 32 blocks: the whole context
    decode_steps = held[-2 * w :]  # (the first output token came with the prefill)
    assert max(h["window"] for h in decode_steps) <= w // bs + 1  # an unaligned window straddles one more
    # During a 64-token prefill chunk the window group also holds the chunk: (W + 64) / bs.
    assert max(h["window"] for h in held) <= (w + 64) // bs + 1


@pytest.mark.parametrize(
    ("model", "context", "full_layers", "window_layers", "window", "bytes_per_layer_token"),
    [("gemma-2-9b", 8 * 4096, 21, 21, 4096, 2 * 8 * 256 * 2), ("gpt-oss-120b", 8 * 128, 18, 18, 128, 2 * 8 * 64 * 2)],
)
def test_the_planner_counts_window_blocks_as_held(
    capsys, model, context, full_layers, window_layers, window, bytes_per_layer_token
):
    assert main(["plan", "--model", model, "--context", str(context), "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["block_size"] == 16 and plan["kv_dtype"] == "bf16"
    # Full layers keep the whole context; window layers the blocks of the last W tokens
    # (aligned here: W / 16 blocks), not the context.
    expected = bytes_per_layer_token * (full_layers * context + window_layers * window)
    assert plan["kv_bytes_at_context"] == expected
    assert plan["kv_bytes_at_context"] < bytes_per_layer_token * (full_layers + window_layers) * context


def test_verify_hybrid_cli(capsys):
    assert main(["verify", "hybrid", "--lengths", "9,33", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [c["name"] for c in out["cases"]] == [
        "gemma: prompt 9",
        "gemma: prompt 33",
        "recurrent: prompt 9",
        "recurrent: prompt 33",
    ]
    assert all(c["passed"] and c["max_abs_diff"] <= 1e-12 for c in out["cases"])
    with pytest.raises(SystemExit) as exc:
        main(["verify", "hybrid", "--lengths", "0"])
    assert exc.value.code == 2
    assert "--lengths must be positive integers" in capsys.readouterr().err


@pytest.mark.parametrize("length", [100000, 10**13])
def test_verify_hybrid_refuses_a_length_past_its_pool_not_reports_a_failed_check(capsys, length):
    # it read "gemma: prompt 100000  nan  nan  NO  (assertion: the pool holds the prompt)", 0/2 passed;
    # 10**13 drew its ids before the pool's check: a traceback of torch's failed 80 TB allocation
    assert main(["verify", "hybrid", "--lengths", str(length)]) == 2
    assert capsys.readouterr().err == (
        f"kvpool verify hybrid: error: --lengths {length}: a prompt of {length:,} tokens does not fit the verifier's "
        "KV pool; give shorter lengths\n"
    )


@pytest.mark.parametrize("layers", [["window", "recurrent"], ["window", "window"]])
@pytest.mark.parametrize(("num_blocks", "block_size"), [(4, 2), (2, 4), (5, 1), (2, 16)])
def test_a_hybrid_without_full_attention_chunks_a_prompt_its_window_pool_cannot_take_in_one_step(
    one_thread, layers, num_blocks, block_size
):
    """A hybrid with no full-attention layer holds a request of any length (its capacity is
    the model's positions: each window group keeps a window's blocks), but a prefill chunk
    of the whole step budget needs the chunk's blocks at once. With a budget past what the
    pool holds, the long prompt was never admitted: every step raised "cannot be admitted
    into an idle cache", and the short request queued behind it never ran. Its chunks are
    now cut to what the pool takes; both requests get the reference's greedy tokens."""
    model = TinyHybrid({**TINY_GEMMA2, "layers": layers, "window": 5}, seed=1, dtype=torch.float64)
    runner = hybrid_runner(model, num_blocks, 8, block_size=block_size, checkpoint_interval=4)
    engine = Engine(runner, max_num_batched_tokens=64, max_num_seqs=4)
    prompts = {"long": list(range(1, 40)), "short": [1, 2, 3]}
    for rid, prompt in prompts.items():
        engine.add_request(prompt, SamplingParams(max_tokens=5, ignore_eos=True), rid)
    steps = 0
    while engine.has_unfinished():
        engine.step()
        runner.check_integrity()
        steps += 1
        assert steps < 500
    for rid, prompt in prompts.items():
        tokens = engine.pop_output(rid).completions[0].token_ids
        assert tokens == model.reference_logits(prompt + tokens[:-1]).argmax(-1).tolist()[len(prompt) - 1 :]
    usage = runner.usage()
    assert usage.num_free_blocks == usage.num_blocks


@pytest.mark.parametrize(("num_blocks", "block_size"), [(3, 1), (4, 1), (1, 16), (1, 4)])
def test_a_hybrid_without_full_attention_whose_pool_cannot_hold_its_window_holds_what_the_pool_holds(
    one_thread, num_blocks, block_size
):
    """A window of 5 spans up to ceil(4 / block_size) + 1 blocks: a pool of fewer cannot take a
    request past it, whatever its chunks. Its capacity was the model's positions (4096), so a
    long prompt was taken and never admitted (every step raised, the requests behind it
    starved); it is now the pool's, and too long a prompt a ValueError at add_request."""
    model = TinyHybrid({**TINY_GEMMA2, "layers": ["window", "recurrent"], "window": 5}, seed=1, dtype=torch.float64)
    runner = hybrid_runner(model, num_blocks, 8, block_size=block_size, checkpoint_interval=4)
    assert runner.max_model_len == runner.capacity_tokens == num_blocks * block_size
    engine = Engine(runner, max_num_batched_tokens=64, max_num_seqs=4)
    with pytest.raises(ValueError, match="'long': prompt of 39 tokens is too long"):
        engine.add_request(list(range(1, 40)), SamplingParams(max_tokens=5), "long")
    prompt = list(range(1, num_blocks * block_size))
    engine.add_request(prompt, SamplingParams(max_tokens=5, ignore_eos=True), "fits")
    while engine.has_unfinished():
        engine.step()
        runner.check_integrity()
    tokens = engine.pop_output("fits").completions[0].token_ids
    assert len(tokens) == 1  # (max_model_len)
    assert tokens == model.reference_logits(prompt).argmax(-1).tolist()[-1:]
