"""Paged dual-pool V4 attention equals the contiguous oracle (fp32, max abs diff <= 1e-5).

The tiny model has the real m = 4, m' = 128, n_win = 128 (span 128); the small config has
m' = 16, n_win = 16 and 4 layers. Each case also asserts its structural facts (hit sizes,
refcounts, restore method, blocks per computed span) inside `Verifier`.
"""

from __future__ import annotations

import pytest
import torch

from kvpool.engine.dsv4_runner import DSV4PagedRunner
from kvpool.models.tiny_dsv4 import TinyDSV4
from kvpool.verify.dsv4 import TOLERANCE, ClassicalPoolWatcher, Verifier

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def verifier() -> Verifier:
    return Verifier(seed=0)


def test_tiny_model_is_v4_geometry(verifier: Verifier) -> None:
    spec = verifier.model.spec
    assert (spec.csa_ratio, spec.hca_ratio, spec.window, spec.span) == (4, 128, 128, 128)
    small = verifier.small.spec
    assert (small.hca_ratio, small.window, small.num_layers, small.span) == (16, 16, 4, 16)


@pytest.mark.parametrize("length", [1, 3, 4, 5, 127, 128, 129, 130, 300])
def test_prompt_lengths(verifier: Verifier, length: int) -> None:
    assert verifier.prompt(length) <= TOLERANCE


@pytest.mark.parametrize("chunk", [1, 7, 64, 128])
def test_chunked_prefill(verifier: Verifier, chunk: int) -> None:
    assert verifier.prompt(300, chunk) <= TOLERANCE


def _state_after(model: TinyDSV4, ids: list[int], chunk: int) -> DSV4PagedRunner:
    runner = DSV4PagedRunner(model, 8, 1)
    runner.add_request("r", ids)
    pos = 0
    while pos < len(ids):
        n = min(chunk, len(ids) - pos)
        assert runner.step([("r", n)]) is not None
        pos += n
    return runner


def test_any_chunk_size_writes_the_state_of_token_by_token_decode(verifier: Verifier) -> None:
    ids = verifier.tokens(263, seed=40)
    by_token = _state_after(verifier.model, ids, 1)
    for chunk in (5, 64, 263):
        other = _state_after(verifier.model, ids, chunk)
        assert other.cache.block_ids("r") == by_token.cache.block_ids("r") == [0, 1]
        live_a = by_token.pools.live_state(0, len(ids))
        live_b = other.pools.live_state(0, len(ids))
        for la, lb in zip(live_a, live_b, strict=True):
            assert la.keys() == lb.keys()
            for name in la:
                a, b = la[name], lb[name]
                assert a.shape == b.shape, name
                assert torch.isfinite(a).all() and torch.isfinite(b).all()  # past block 0: no -inf rows
                assert torch.allclose(a, b, atol=1e-5, rtol=0), name
        for cl_a, cl_b in zip(by_token.pools.classical, other.pools.classical, strict=True):
            for a, b in ((cl_a.main, cl_b.main), (cl_a.idx, cl_b.idx)):
                if a is not None:
                    assert torch.allclose(a, b, atol=1e-5, rtol=0)


def test_decode_200_steps_across_block_boundaries(verifier: Verifier) -> None:
    # 100-token prompt + 200 steps crosses the span boundaries at 128 and 256; the
    # Classical pool is watched after every step (complete spans only, never rewritten)
    assert verifier.decode(100, 200) <= TOLERANCE


def test_batch_of_mixed_lengths(verifier: Verifier) -> None:
    assert verifier.batch_mixed((1, 5, 130, 77), 10) <= TOLERANCE


@pytest.mark.parametrize("restore", ["checkpoint", "recompute"])
@pytest.mark.parametrize("num_blocks", [1, 2])
def test_prefix_hit_restores_state_exactly(verifier: Verifier, num_blocks: int, restore: str) -> None:
    assert verifier.prefix_hit(num_blocks, restore) <= TOLERANCE


def test_small_config_recompute_covers_part_of_a_long_hit(verifier: Verifier) -> None:
    # 8 blocks of 16 = 128 cached tokens; n_win * L = 64, so the replay starts at token 64
    spec = verifier.small.spec
    assert spec.window * spec.num_layers < 8 * spec.span
    assert verifier.prefix_hit(8, "recompute", small=True) <= TOLERANCE


def test_small_config_checkpoint_hit(verifier: Verifier) -> None:
    assert verifier.prefix_hit(8, "checkpoint", small=True) <= TOLERANCE


def test_two_requests_share_a_block_while_decoding(verifier: Verifier) -> None:
    assert verifier.shared_decode(20) <= TOLERANCE


def test_classical_pool_never_holds_an_incomplete_block(verifier: Verifier) -> None:
    runner = DSV4PagedRunner(verifier.model, 8, 1)
    ids = verifier.tokens(130, seed=50)
    runner.add_request("r", ids[:1])
    runner.append_tokens("r", ids[1:])
    watcher = ClassicalPoolWatcher(runner)
    zero = [t.clone() for cl in runner.pools.classical for t in (cl.main, cl.idx) if t is not None]
    for pos in range(130):
        assert runner.step([("r", 1)]) is not None
        watcher.check()
        computed = pos + 1
        assert len(runner.cache.block_ids("r")) == computed // 128
        if computed < 128:  # 127 tokens hold 31 complete CSA entries, all in state, none pooled
            now = [t for cl in runner.pools.classical for t in (cl.main, cl.idx) if t is not None]
            assert all(torch.equal(a, b) for a, b in zip(now, zero, strict=True))
    assert runner.cache.block_ids("r") == [0]


def test_release_frees_state_and_drops_classical_refs(verifier: Verifier) -> None:
    runner = DSV4PagedRunner(verifier.model, 4, 1)
    ids = verifier.tokens(200, seed=60)
    runner.add_request("r", ids)
    assert runner.add_request("waiting", ids) is None  # one state block: admission waits
    assert runner.step([("r", 200)]) is not None
    assert runner.cache.pool.refcount(0) == 1 and runner.cache.num_free_state_blocks == 0
    runner.check_integrity()
    assert runner.release("r") is True
    assert runner.cache.pool.refcount(0) == 0 and runner.cache.num_free_state_blocks == 1
    assert runner.cache.pool.is_free_cached(0)  # the span stays findable for prefix reuse
    runner.check_integrity()
    assert runner.release("r") is False  # a second release is a no-op
    assert runner.add_request("waiting", ids) is not None  # now it gets the state block
    runner.check_integrity()


def test_step_that_does_not_fit_changes_nothing(verifier: Verifier) -> None:
    runner = DSV4PagedRunner(verifier.model, 1, 2)
    a, b = verifier.tokens(130, seed=70), verifier.tokens(130, seed=71)
    runner.add_request("a", a)
    runner.add_request("b", b)
    assert runner.step([("a", 130), ("b", 130)]) is None  # needs 2 classical blocks, 1 exists
    assert runner.cache.num_computed_tokens("a") == 0 and runner.cache.num_free_blocks == 1
    runner.check_integrity()
    out = runner.step([("a", 130)])
    assert out is not None
    assert float((out[0].logits - verifier.oracle(verifier.model, a)).abs().max()) <= TOLERANCE
