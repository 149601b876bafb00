"""The prefix-aware router's probes (sim/routing.py): `HybridCacheManager.may_reach` says
False only where `lookup_packed` is below the point asked, and the router that probes
chooses the replica that full lookups of every replica choose, whatever the hint.

Narratives on small caches with exact hits, then a property over random caches of every
layout with turn ends (paged, V4's dual pool with each restore, a hybrid of a window, a full
and a recurrent group, a hybrid with a dual pool), evictions included: prompts of a few
shared families, admitted, computed, decoded and finished or left running."""

from __future__ import annotations

import os
from dataclasses import dataclass

from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.cache import CacheDescriptor, DSV4CacheManager, FullAttentionManager
from kvpool.cache.coordinator import HybridCacheManager, pack_prompt
from kvpool.cache.dual_pool import DualPoolGroupSpec
from kvpool.cache.recurrent import RecurrentGroupSpec
from kvpool.cache.window import AttentionGroupSpec
from kvpool.models.tiny_dsv4 import SMALL_DSV4_CONFIG
from kvpool.sim.routing import Router, _choose_by_lookups
from kvpool.spec.dsv4 import DSV4Spec

DESC = CacheDescriptor("router-probes")
SPEC = DSV4Spec.from_config(SMALL_DSV4_CONFIG)  # span 16


def prefill(m: HybridCacheManager, rid: str, tokens: list[int]) -> int:
    adm = m.admit(rid, tokens)
    assert adm is not None
    m.commit(rid, len(tokens) - adm.num_cached_tokens)
    m.check_integrity()
    return adm.num_cached_tokens


def decode(m: HybridCacheManager, rid: str, new_tokens: list[int]) -> None:
    for t in new_tokens:
        m.append_token_ids(rid, [t])
        assert m.reserve(rid, 1) is not None
        m.commit(rid, 1)
    m.check_integrity()


def paged_with_turn_ends(num_blocks: int) -> HybridCacheManager:
    """One full-attention group of blocks of 4 that keeps partial blocks at turn ends."""
    return HybridCacheManager([(AttentionGroupSpec("full", 4), num_blocks)], DESC, turn_end_checkpoints=True)


def reach(m: HybridCacheManager, tokens: list[int]) -> list[bool]:
    """may_reach at every point 0 .. len(tokens), after a lookup filled the prompt's memo."""
    packed = pack_prompt(tokens)
    m.lookup_packed(packed)
    return [m.may_reach(packed, t) for t in range(len(tokens) + 1)]


def test_paged_probe_rules_out_past_the_first_missing_block():
    m = FullAttentionManager(12, 4, DESC)
    prefill(m, "a", list(range(10)))  # blocks [0..3] [4..7] published; 8, 9 in a partial block
    prompt = list(range(8)) + [50, 51, 52, 53, 54]
    assert m.lookup_prefix(prompt) == 8
    # 8 tokens: block 1 is cached; 9 and up need block 2 ([8..11] of the prompt): not cached
    assert reach(m, prompt) == [True] * 9 + [False] * 5
    # A cold cache: nothing past 0; caching off: the same
    assert reach(FullAttentionManager(12, 4, DESC), prompt) == [True] + [False] * 13
    assert reach(FullAttentionManager(12, 4, DESC, enable_prefix_caching=False), prompt) == [True] + [False] * 13
    m.check_integrity()


def test_paged_probe_keeps_a_turn_end_inside_the_next_block():
    m = paged_with_turn_ends(12)
    prefill(m, "a", list(range(10)))
    m.release("a")  # its partial block [8, 9] is kept as a turn end at 10
    follow = list(range(10)) + [60, 61, 62]
    assert m.lookup_prefix(follow) == 10
    # points inside block 2 (9, 10, 11) may be served by the turn end listed after block 1
    assert reach(m, follow) == [True] * 12 + [False] * 2
    # another prompt after the same blocks but other tokens there: the turn end is listed
    # all the same (a probe does not compare tokens), so 9..11 stay possible; 12 needs block 2
    other = list(range(8)) + [70, 71, 72, 73, 74]
    assert m.lookup_prefix(other) == 8
    assert reach(m, other) == [True] * 12 + [False] * 2


def test_dual_pool_probe_at_span_boundaries_and_turn_ends():
    m = DSV4CacheManager(SPEC, 8, 3, DESC, turn_end_checkpoints=True)
    prompt = list(range(40))
    prefill(m, "a", prompt)  # spans [0, 16) and [16, 32) published; 8 tokens in the state
    probe = prompt[:32] + [90] * 9
    assert m.lookup_prefix(probe) == 32
    # 33 and up: span 2 ([32, 48)) is not whole in a 41-token prompt, and no turn end is listed
    assert reach(m, probe) == [True] * 33 + [False] * 9
    decode(m, "a", [7, 8])
    m.release("a")  # a turn end at 42 (inside span 2), after spans 0 and 1
    follow = prompt + [7, 8, 5, 6]
    assert m.lookup_prefix(follow) == 42
    assert reach(m, follow) == [True] * 44 + [False]  # 43 is the last point a 44-token prompt offers
    # spans 0 and 1 cached, the next ones not: with no turn end kept after span 1, 33 and up are out
    m2 = DSV4CacheManager(SPEC, 8, 3, DESC, turn_end_checkpoints=True)
    prefill(m2, "a", prompt)
    assert m2.lookup_prefix(follow) == 32
    assert reach(m2, follow) == [True] * 33 + [False] * 12


def test_the_router_asks_the_hint_first_and_probes_the_others():
    # three V4 replicas: 0 holds spans 0..1 of the prompt, 1 holds span 0, 2 nothing
    caches = [DSV4CacheManager(SPEC, 8, 3, DESC) for _ in range(3)]
    prompt = list(range(50))
    prefill(caches[0], "a", prompt[:40])
    prefill(caches[1], "a", prompt[:20])
    lookups = []
    for i, m in enumerate(caches):
        m.lookup_packed = _counting(m.lookup_packed, lookups, i)  # type: ignore[method-assign]
    reps = [FakeReplica(i, m, load) for i, (m, load) in enumerate(zip(caches, [3, 1, 0], strict=True))]
    router = Router("prefix-aware", reps, load_cap=10.0)
    assert router.route(pack_prompt(prompt), hint=0) is reps[0]
    assert lookups == [0]  # 1 and 2 cannot reach 32 tokens: ruled out without a lookup
    lookups.clear()
    # no hint: the least loaded first (2: nothing), then 1 (16), then 0 (32)
    assert router.route(pack_prompt(prompt)) is reps[0]
    assert lookups == [2, 1, 0]
    lookups.clear()
    assert router.route(pack_prompt(prompt), hint=1) is reps[0]
    assert lookups == [1, 0]  # 2 cannot reach 17 tokens


def test_a_replica_that_would_need_the_whole_prompt_is_not_probed():
    # three paged replicas each hold blocks [0, 4) and [4, 8) of a 9-token prompt: every hit
    # is 8, the most a 9-token prompt offers (a token is left to compute)
    caches = [FullAttentionManager(12, 4, DESC) for _ in range(3)]
    prompt = list(range(9))
    for m in caches:
        prefill(m, "a", prompt)
    lookups: list[int] = []
    probes: list[int] = []
    for i, m in enumerate(caches):
        m.lookup_packed = _counting(m.lookup_packed, lookups, i)  # type: ignore[method-assign]
        m.may_reach = _counting(m.may_reach, probes, i)  # type: ignore[method-assign]
    reps = [FakeReplica(i, m, load) for i, (m, load) in enumerate(zip(caches, [2, 1, 3], strict=True))]
    router = Router("prefix-aware", reps, load_cap=10.0)
    naive = _choose_by_lookups(reps, {r.index: r.load for r in reps}, pack_prompt(prompt), "")
    lookups.clear()
    # the hint (0, hit 8) first; 1 (less loaded) wins with an equal hit, so it needs 8 and is
    # probed and looked up; 2 (more loaded) would need 9, the whole prompt: not even probed
    assert router.route(pack_prompt(prompt), hint=0) is reps[1] is naive
    assert lookups == [0, 1]
    assert probes == [1]


def _counting(lookup, calls: list[int], index: int):
    def counted(*args, **kwargs):
        calls.append(index)
        return lookup(*args, **kwargs)

    return counted


@dataclass
class _Runner:
    cache: HybridCacheManager


class FakeReplica:
    """What the router reads of a replica: its index, cache and load."""

    def __init__(self, index: int, cache: HybridCacheManager, load: int) -> None:
        self.index, self.runner, self.load, self.num_routed = index, _Runner(cache), load, 0


# ---- the property: probes never rule out a reachable point; the choice is the naive one ----

FAMILIES = [list(range(1, 60)), [1, 2, 3, 4, 5, 6, 7, 8] + [9] * 51, [5] * 59]


def _layouts() -> dict[str, object]:
    return {
        "paged": lambda: FullAttentionManager(14, 4, DESC),
        "paged-turn-ends": lambda: paged_with_turn_ends(14),
        "dual-recompute": lambda: DSV4CacheManager(SPEC, 6, 3, DESC, turn_end_checkpoints=True),
        "dual-auto": lambda: DSV4CacheManager(
            SPEC, 8, 3, DESC, restore="auto", checkpoint_blocks=1, turn_end_checkpoints=True
        ),
        "dual-checkpoint": lambda: DSV4CacheManager(
            SPEC, 8, 3, DESC, restore="checkpoint", num_checkpoints=2, turn_end_checkpoints=True
        ),
        "hybrid": lambda: HybridCacheManager(
            [
                (AttentionGroupSpec("swa", 4, window=6), 12),
                (AttentionGroupSpec("full", 4), 16),
                (RecurrentGroupSpec("rec", 6), 12),
            ],
            DESC,
            turn_end_checkpoints=True,
        ),
        "hybrid-dual": lambda: HybridCacheManager(
            [(AttentionGroupSpec("full", 4), 16), (DualPoolGroupSpec("v4", 8, replay_len=2), (8, 4))],
            DESC,
            turn_end_checkpoints=True,
        ),
    }


LAYOUTS = _layouts()
# (family, prompt length, its tail token, decoded tokens, finish)
OPS = st.lists(
    st.tuples(st.integers(0, 2), st.integers(1, 50), st.integers(0, 3), st.integers(0, 5), st.booleans()),
    max_size=12,
)


def _prompt(family: int, length: int, tail: int) -> list[int]:
    return FAMILIES[family][:length] + [100 + tail] * (tail % 3)


def run(m: HybridCacheManager, rid: str, tokens: list[int], num_decoded: int = 0, finish: bool = True) -> bool:
    """Admit `tokens`, compute them, decode `num_decoded` tokens (fewer where a reservation
    does not fit) and finish (or keep running); False when the admission does not fit."""
    adm = m.admit(rid, tokens)
    if adm is None:
        return False
    m.take_copies()  # (the runner's: applied before the forward)
    m.commit(rid, len(tokens) - adm.num_cached_tokens)
    decode_while_it_fits(m, rid, num_decoded)
    if finish:
        m.release(rid)
    m.check_integrity()
    return True


def decode_while_it_fits(m: HybridCacheManager, rid: str, num_tokens: int, first_id: int = 200) -> None:
    """Decode up to `num_tokens` tokens of running request `rid` (ids first_id, first_id +
    1, ...), stopping at the first reservation that does not fit."""
    for k in range(num_tokens):
        m.append_token_ids(rid, [first_id + k])
        if m.reserve(rid, 1) is None:
            return
        m.take_copies()
        m.commit(rid, 1)


def _fill(m: HybridCacheManager, ops: list[tuple[int, int, int, int, bool]]) -> None:
    """Admit, compute, decode and finish (or keep running) prompts of the families; an
    admission that does not fit is skipped (as a waiting request would be)."""
    for i, (family, length, tail, num_decoded, finish) in enumerate(ops):
        run(m, f"r{i}", _prompt(family, length, tail), num_decoded, finish)


@settings(max_examples=int(os.environ.get("KVPOOL_HYPOTHESIS_EXAMPLES", "150")), deadline=None)
@given(
    layout=st.sampled_from(sorted(LAYOUTS)),
    replica_ops=st.lists(OPS, min_size=2, max_size=4),
    queries=st.lists(st.tuples(st.integers(0, 2), st.integers(1, 58), st.integers(0, 5)), min_size=1, max_size=4),
    loads=st.lists(st.integers(0, 3), min_size=4, max_size=4),
)
def test_probes_never_rule_out_a_reachable_hit_and_the_choice_is_the_naive_one(
    layout: str,
    replica_ops: list[list[tuple[int, int, int, int, bool]]],
    queries: list[tuple[int, int, int]],
    loads: list[int],
) -> None:
    caches = [LAYOUTS[layout]() for _ in replica_ops]
    for m, ops in zip(caches, replica_ops, strict=True):
        _fill(m, ops)
    reps = [FakeReplica(i, m, loads[i]) for i, m in enumerate(caches)]
    router = Router("prefix-aware", reps, load_cap=100.0)
    for family, length, tail in queries:
        tokens = _prompt(family, length, tail) + [300 + tail]
        for m in caches:
            packed = pack_prompt(tokens)
            probes_first = [m.may_reach(packed, t) for t in range(len(tokens) + 1)]  # an empty memo
            hit = m.lookup_packed(packed)
            probes = [m.may_reach(packed, t) for t in range(len(tokens) + 1)]
            assert probes[: hit + 1] == [True] * (hit + 1), (hit, probes)
            assert probes_first[: hit + 1] == [True] * (hit + 1), (hit, probes_first)
        naive = _choose_by_lookups(reps, {r.index: r.load for r in reps}, pack_prompt(tokens), "")
        for hint in (None, *range(len(reps))):
            assert router.route(pack_prompt(tokens), hint=hint) is naive
            assert router.route(tokens, hint=hint) is naive
    for m in caches:
        m.check_integrity()
