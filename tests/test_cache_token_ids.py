"""A request's token ids as the coordinator keeps them (`_Request.token_ids`): an array("I")
made from the prompt's packing, which sampled ids join. The ids are the caller's, a later
change of the caller's list does not reach them, and an id the array cannot hold is refused
with a ValueError naming it before anything changes (the decode, chunk and naive commits
alike)."""

from __future__ import annotations

from array import array
from sys import getsizeof

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


# ---- share_ids: the caller's list is the request's ids (the engine's sequence list) -------------


def _twin_managers() -> list[tuple[HybridCacheManager, HybridCacheManager]]:
    return [
        (DSV4CacheManager(SPEC, 24, 4, DESC), DSV4CacheManager(SPEC, 24, 4, DESC)),
        (FullAttentionManager(48, 4, DESC), FullAttentionManager(48, 4, DESC)),
    ]


@pytest.mark.parametrize("path", ["decodes", "chunks", "each"])
def test_shared_ids_are_the_callers_list_and_commit_as_the_coordinators_own(path: str) -> None:
    """A request admitted with share_ids reads its ids from the caller's list itself (no
    copy), and a commit appends nothing to it: the caller appends each sampled id first, as
    the engine does. Step by step, every path (the decode step's memo, the chunk path with an
    admission among the decodes, the naive twin) leaves it as a manager that keeps its own
    arrays and is handed the same ids by the commits: the same counts, ids, blocks."""
    for shared, own in _twin_managers():
        _shared_twin_run(shared, own, path)


def _shared_twin_run(shared: HybridCacheManager, own: HybridCacheManager, path: str) -> None:
    commit = (lambda m: m._commit_each) if path == "each" else (lambda m: m.commit_step)
    lists: dict[str, list[int]] = {}
    next_id = 1_000

    def step(rids: list[str], counts: list[int]) -> None:
        nonlocal next_id
        nexts: list[int | None] = []
        for r, n in zip(rids, counts, strict=True):
            if shared.num_computed_tokens(r) + n < len(lists[r]):
                nexts.append(None)  # a chunk inside the prompt: its next id is known
            else:
                next_id += 1
                lists[r].append(next_id)  # the caller's list takes the sampled id first
                nexts.append(next_id)
        commit(shared)(rids, counts, nexts)
        commit(own)(rids, counts, nexts)
        assert _view(shared) == _view(own)
        # metadata_bytes counts each request's ids' container, the caller's list (its pointer
        # array) or the own array: the same figure, those containers aside
        assert shared.metadata_bytes() - sum(getsizeof(ids) for ids in lists.values()) == (
            own.metadata_bytes() - sum(getsizeof(own._requests[r].token_ids) for r in lists)
        )
        for r in rids:
            assert shared._requests[r].token_ids is lists[r] and shared._requests[r].shared
            assert shared.block_ids(r) == own.block_ids(r)
        shared.check_integrity()
        own.check_integrity()

    for rid, first, n in (("a", 100, 10), ("b", 200, 6)):  # prefilled, each with its first sampled id
        lists[rid] = ids = list(range(first, first + n))
        prompt = pack_prompt(ids)._replace(token_ids=ids)
        assert shared.admit(rid, ids, prompt=prompt, check_packing=False, share_ids=True) is not None
        assert own.admit(rid, list(ids)) is not None
        step([rid], [n])
    for k in range(40):
        rids = list(lists)
        counts = [len(lists[r]) - shared.num_computed_tokens(r) for r in rids]
        assert shared.reserve_step(rids, counts) and own.reserve_step(rids, counts)
        if path == "chunks" and k == 5:  # an admission joins the decodes: a chunk of its prompt
            lists["c"] = ids = list(range(300, 309))
            assert shared.admit("c", ids, 4, share_ids=True) is not None
            assert own.admit("c", list(ids), 4) is not None
            rids, counts = [*rids, "c"], [*counts, 4]
        step(rids, counts)


def test_shared_ids_refuse_what_would_change_the_callers_list() -> None:
    m = DSV4CacheManager(SPEC, 12, 4, DESC)
    with pytest.raises(TypeError, match="share_ids needs the caller's list of token ids, got tuple"):
        m.admit("t", (1, 2, 3), share_ids=True)
    assert "t" not in m
    ids = list(range(10, 20))
    assert m.admit("a", ids, share_ids=True) is not None
    m.commit_step(["a"], [10], [None])
    ids.append(7)
    m.commit_step(["a"], [0], [7])  # (the sampled id the list took: named, not appended again)
    assert m.token_ids("a") == [*range(10, 20), 7] and ids == m.token_ids("a")
    before = _view(m)
    with pytest.raises(ValueError, match="request 'a' reads its token ids from the caller's list"):
        m.append_token_ids("a", [8])
    with pytest.raises(ValueError, match="request 'a' reads its token ids from the caller's list"):
        m.rollback("a", 4)
    assert _view(m) == before and ids == [*range(10, 20), 7]
    m.check_integrity()
    assert m.reserve_step(["a"], [1])
    m.commit_step(["a"], [1], [8])  # (a caller that forgot to append 8 to its list first)
    with pytest.raises(ValueError, match=r"only 11 token ids are known \(append the ids to the caller's list first"):
        m.reserve("a", 1)
    ids.append(8)
    assert m.reserve("a", 1) is not None
    m.check_integrity()


def test_a_fork_of_a_shared_request_keeps_an_array_of_its_own() -> None:
    m = FullAttentionManager(24, 4, DESC)
    ids = list(range(30, 36))
    assert m.admit("p", ids, share_ids=True) is not None
    ids.append(9)
    m.commit_step(["p"], [6], [9])
    assert m.fork("p", "c")
    child = m._requests["c"].token_ids
    assert type(child) is array and child.typecode == "I" and not m._requests["c"].shared
    m.append_token_ids("c", [11])  # the child's ids are the coordinator's: they join here
    assert m.token_ids("c") == [*range(30, 36), 11] and ids == [*range(30, 36), 9]
    m.check_integrity()


def test_the_naive_commit_checks_that_the_callers_list_holds_a_named_id() -> None:
    """share_ids' contract, which the commit's fast paths trust (docs/core_api.md): the
    caller appends the sampled id before the commit names it. The naive twin checks it and
    names the position; nothing changes."""
    for m, _ in _twin_managers():
        ids = list(range(100, 110))
        assert m.admit("a", ids, share_ids=True) is not None
        before = _view(m)
        with pytest.raises(ValueError, match=r"next token id 6 at position 10, where the caller's list ends at 10"):
            m._commit_each(["a"], [10], [6])
        with pytest.raises(ValueError, match=r"token id -1 is no int in \[0, 2\*\*32\)"):
            m._commit_each(["a"], [10], [-1])
        assert _view(m) == before
        ids.append(5)
        before = _view(m)
        with pytest.raises(ValueError, match=r"next token id 6 at position 10, where the caller's list holds 5"):
            m._commit_each(["a"], [10], [6])
        assert _view(m) == before
        m._commit_each(["a"], [10], [5])
        assert m.num_computed_tokens("a") == 10 and m.token_ids("a") == [*range(100, 110), 5]
        m.check_integrity()
