"""A request's token ids as the coordinator keeps them (`_Request.token_ids`): an array("I")
made from the prompt's packing, which sampled ids join. The ids are the caller's, a later
change of the caller's list does not reach them, and an id the array cannot hold is refused
with a ValueError naming it before anything changes (the decode, chunk and naive commits
alike)."""

from __future__ import annotations

from array import array

import pytest

from kvpool.cache import CacheDescriptor, DSV4CacheManager, FullAttentionManager
from kvpool.cache.coordinator import HybridCacheManager, pack_prompt
from kvpool.models.tiny_dsv4 import SMALL_DSV4_CONFIG
from kvpool.pool import token_bytes
from kvpool.spec.dsv4 import DSV4Spec

SPEC = DSV4Spec.from_config(SMALL_DSV4_CONFIG)  # span 16
DESC = CacheDescriptor("small-dsv4", layout_id="span16:fp32")
BAD_IDS = [-1, 2**32, 3.0, "7"]


def _view(m: HybridCacheManager) -> list[tuple[str, int, int, list[int]]]:
    return [(r, m.num_computed_tokens(r), m.num_reserved_tokens(r), m.token_ids(r)) for r in m.request_ids]


def _two_decoding(m: HybridCacheManager) -> list[str]:
    """Requests "a" (10 ids) and "b" (6) prefilled, each with its first sampled id."""
    for rid, n, first in (("a", 10, 100), ("b", 6, 200)):  # (no common prefix: nothing cached)
        adm = m.admit(rid, list(range(first, first + n)))
        assert adm is not None and adm.num_cached_tokens == 0
        m.commit_step([rid], [n], [n])
    return ["a", "b"]


def test_the_ids_are_an_array_of_the_prompt_and_not_the_callers_list() -> None:
    m = DSV4CacheManager(SPEC, 12, 4, DESC)
    prompt = [5, 2**32 - 1, 0, 70_000]
    # (pack_prompt's own ids are a tuple no caller can change: a LookupPrompt over a list of
    # the caller's, as one built by hand, is what could alias the cache's ids)
    packed = pack_prompt(prompt)._replace(token_ids=list(prompt))
    assert m.admit("a", prompt, prompt=packed, check_packing=False) is not None
    prompt.append(9)  # the caller's list changes after the admission (the engine appends to its own)
    packed.token_ids.append(9)
    ids = m._requests["a"].token_ids
    assert type(ids) is array and ids.typecode == "I"
    assert m.token_ids("a") == [5, 2**32 - 1, 0, 70_000] and token_bytes(ids) == token_bytes(prompt[:4])
    m.commit_step(["a"], [4], [11])
    m.append_token_ids("a", [12, 13])
    assert m.token_ids("a") == [5, 2**32 - 1, 0, 70_000, 11, 12, 13]
    m.check_integrity()


@pytest.mark.parametrize("bad", BAD_IDS)
def test_append_token_ids_refuses_an_id_the_array_cannot_hold_and_appends_none(bad: object) -> None:
    m = DSV4CacheManager(SPEC, 12, 4, DESC)
    _two_decoding(m)
    before = _view(m)
    with pytest.raises(ValueError, match=rf"request 'a': token id {bad!r} is no int in \[0, 2\*\*32\)"):
        m.append_token_ids("a", [1, 2, bad, 3])  # type: ignore[list-item]
    assert _view(m) == before
    m.check_integrity()


@pytest.mark.parametrize("bad", BAD_IDS)
@pytest.mark.parametrize("path", ["decodes", "chunks", "each"])
def test_a_commit_with_a_bad_next_id_changes_nothing_on_every_path(path: str, bad: object) -> None:
    # The decode path (every count 1), the chunk path (a count of 0 among them) and the naive
    # twin: "b"'s id is bad, so "a" (before it, changed first by the fast paths) is undone
    for m in (DSV4CacheManager(SPEC, 12, 4, DESC), FullAttentionManager(24, 4, DESC)):
        ids = _two_decoding(m)
        if path == "chunks":
            assert m.admit("c", list(range(50, 55)), 0) is not None  # admitted, nothing reserved
            ids = [*ids, "c"]
        counts = [1, 1, 0][: len(ids)]
        assert m.reserve_step(ids[:2], counts[:2])
        before = _view(m)
        nexts = [7, bad, None][: len(ids)]
        commit = m._commit_each if path == "each" else m.commit_step
        with pytest.raises(ValueError, match=rf"request 'b': token id {bad!r} is no int in \[0, 2\*\*32\)"):
            commit(ids, counts, nexts)  # type: ignore[arg-type]
        assert _view(m) == before
        m.check_integrity()
        m.commit_step(ids, counts, [7, 8, None][: len(ids)])  # the step commits with good ids
        assert [m.token_ids(r)[-1] for r in ids[:2]] == [7, 8]
        m.check_integrity()
