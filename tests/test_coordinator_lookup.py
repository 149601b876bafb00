"""The one-group lookup paths of the coordinator (`_hits`, `hit_point`: what the router asks
every replica for each arrival, and each admission) against their twins over any number of
groups (`_hits_of_groups`, `_hit_point_of_groups`), on attention caches whose finished
turns keep partial blocks (turn ends: hit points off the block grid). The dual pool's are
checked after every operation of tests/test_dsv4_cache.py's lifecycles."""

from __future__ import annotations

import dataclasses
import os

from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.cache import CacheDescriptor
from kvpool.cache.coordinator import HybridCacheManager, pack_prompt
from kvpool.cache.window import AttentionGroupSpec
from kvpool.pool import PrefixBlock

DESC = CacheDescriptor("tiny-model", layout_id="bs4")
BS = 4


def _key(value: object) -> object:
    """`value` with each prefix block as its hash and physical blocks (a lookup chains the
    prompt's blocks past the cached run anew: equal, not the same objects)."""
    if isinstance(value, PrefixBlock):
        return (value.block_hash, value.block_ids)
    if dataclasses.is_dataclass(value):
        return tuple(_key(getattr(value, f.name)) for f in dataclasses.fields(value))
    if isinstance(value, dict):
        return {k: _key(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_key(v) for v in value]
    return value


def _agree(m: HybridCacheManager, tokens: list[int], tenant: str) -> int:
    prompt = pack_prompt(tokens)
    roots = m._request_roots(tenant, None)
    hits = m._hits(roots, prompt)
    assert _key(hits) == _key(m._hits_of_groups(roots, prompt, True, False))
    for n in range(1, len(tokens) + 2):
        assert m.hit_point(hits, n) == m._hit_point_of_groups(hits, n), (tokens, n)
    # the turn ends after the cached run, found in the packing and by hashing (the twin)
    g = m.groups["full"]
    parent = hits["full"].chain[-1] if hits["full"].chain else roots["full"]
    start = len(hits["full"].chain) * BS
    for limit in range(start, len(tokens) + 1):
        by_bytes = g._turn_ends.find(parent, start, tokens, (), limit, prompt.packed)
        assert by_bytes == g._turn_ends.find(parent, start, tokens, (), limit)
    return m.hit_point(hits, len(tokens))


@settings(max_examples=int(os.environ.get("KVPOOL_HYPOTHESIS_EXAMPLES", "150")) // 3, deadline=None)
@given(
    window=st.sampled_from([None, 6]),
    turns=st.lists(
        st.tuples(st.integers(0, 2), st.lists(st.integers(0, 3), min_size=1, max_size=9), st.sampled_from("ab")),
        min_size=1,
        max_size=12,
    ),
)
def test_one_group_lookups_agree_with_their_twins(window: int | None, turns: list[tuple[int, list[int], str]]) -> None:
    # conversations that grow turn by turn (a follow-up repeats an earlier turn's tokens),
    # each finished inside a block, so the next lookups meet turn ends kept after cached blocks
    m = HybridCacheManager([(AttentionGroupSpec("full", BS, window=window), 12)], DESC, turn_end_checkpoints=True)
    seen: list[list[int]] = [[]]
    for i, (base, more, tenant) in enumerate(turns):
        tokens = [*seen[min(base, len(seen) - 1)], *more]
        point = _agree(m, tokens, tenant)
        rid = f"r{i}"
        adm = m.admit(rid, tokens, tenant_salt=tenant)
        m.check_integrity()
        if adm is None:  # out of blocks: nothing changed
            continue
        assert adm.num_cached_tokens == point
        m.commit(rid, len(tokens) - point)
        m.release(rid, "finish")
        m.check_integrity()
        assert _agree(m, tokens, tenant) == m.lookup_prefix(tokens, tenant_salt=tenant)
        seen.append(tokens)


class _UnsortedExtras:
    """A group whose off-grid points come out of order and repeated (the protocol asks for
    increasing points, each once): the one-group walk must give its twin's answer anyway."""

    def upper_bound(self, found: object) -> int:
        return 20

    def extra_points(self, found: object) -> list[int]:
        return [6, 13, 6]

    def serves(self, found: object, point: int) -> bool:
        return point in (13, 6)


def test_one_group_hit_point_takes_unsorted_extra_points_as_its_twin() -> None:
    cache = HybridCacheManager([(AttentionGroupSpec("full", BS), 12)], DESC)
    group = _UnsortedExtras()
    cache._one_group = ("full", group)
    cache.groups = {"full": group}
    # the largest served point under min(21 - 1, 20) is 13 (neither grid point 20..4 is served)
    assert cache._hit_point_of_groups({"full": None}, 21) == 13
    assert cache.hit_point({"full": None}, 21) == 13
    assert cache.hit_point({"full": None}, 10) == 6  # 13 > 9: the next served below is 6
