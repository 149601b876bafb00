"""The host tier: the block descriptor contract, LRU under a byte limit, the manager's
admission across device + host, and the engine's logits with the tier on (SmolLM2)."""

from __future__ import annotations

import dataclasses
import os
import random
import re
import subprocess
import sys
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.cache import CacheDescriptor, FullAttentionManager, HybridCacheManager
from kvpool.cache.window import AttentionGroupSpec
from kvpool.engine import tier_bridge
from kvpool.tiers import BlockDescriptor, HostTier, TierIndex

DESC = CacheDescriptor("m", weights_version="w1", layout_id="bs4:fp32")
BS = 4


def make(num_blocks: int, tier: HostTier, descriptor: CacheDescriptor = DESC):
    index = TierIndex(tier, BS)
    return FullAttentionManager(num_blocks, BS, descriptor, lower_tier=index), index


class Store:
    """The device pool's slots as a model: block id -> the prefix its content was computed for."""

    def __init__(self) -> None:
        self.blocks: dict[int, tuple[int, ...]] = {}

    def offload(self, m: FullAttentionManager, index: TierIndex, tier: HostTier) -> None:
        """What the runner does after each allocation: save the evicted blocks' content."""
        for block_id, block in tier_bridge.take_evicted(m):
            key, descriptor = index.describe(block)
            content = torch.tensor(self.blocks[block_id], dtype=torch.int64)
            assert descriptor.num_computed_tokens == len(content)
            tier.put(key, descriptor, {"content": content})

    def admit(self, m, index, tier, rid: str, prompt: list[int], tenant: str = ""):
        adm = m.admit(rid, prompt, tenant_salt=tenant)
        if adm is None:
            return None
        self.offload(m, index, tier)  # before the loads overwrite the fresh blocks
        loaded = 0
        for block_id, block in adm.groups["full"].loads:
            tensors = tier.get(*index.describe(block))
            if tensors is None:
                break
            self.blocks[block_id] = tuple(tensors["content"].tolist())
            loaded += 1
        if adm.groups["full"].loads:
            adm = m.complete_loads(rid, loaded)
        m.check_integrity()
        return adm

    def compute(self, m: FullAttentionManager, rid: str, prompt: list[int], start: int) -> None:
        """The forward of [start, len): each block's content is the prefix through it."""
        for i, block_id in enumerate(m.block_ids(rid)):
            end = min((i + 1) * BS, len(prompt))
            if end > start:
                self.blocks[block_id] = tuple(prompt[:end])
        m.commit(rid, len(prompt) - start)
        m.check_integrity()

    def check(self, m: FullAttentionManager, rid: str, prompt: list[int], upto: int | None = None) -> None:
        """The request's full blocks through `upto` tokens (default: all of the prompt)."""
        upto = len(prompt) if upto is None else upto
        for i, block_id in enumerate(m.block_ids(rid)[: upto // BS]):
            assert self.blocks[block_id] == tuple(prompt[: (i + 1) * BS]), f"{rid} block {i} holds another prefix"


def _serve_and_push_out(store, m, index, tier, prompt: list[int], filler_len: int, tenant: str = "") -> None:
    """Request "a" computes `prompt` and finishes; a filler of `filler_len` other tokens then
    takes the pool, pushing a's cached blocks (tail first) out to the host tier."""
    store.compute(m, "a", prompt, store.admit(m, index, tier, "a", prompt, tenant=tenant).num_cached_tokens)
    m.release("a")
    filler = list(range(500, 500 + filler_len))
    store.compute(m, "f", filler, store.admit(m, index, tier, "f", filler).num_cached_tokens)
    m.release("f")


def _tensor_bytes(num_tokens: int) -> int:
    return num_tokens * 8  # int64 content tensors


# ----- the manager across device + host --------------------------------------------------


def test_a_prefix_half_on_the_device_half_on_the_host() -> None:
    tier = HostTier(1 << 20)
    m, index = make(6, tier)
    store = Store()
    p = list(range(100, 116))  # 4 full blocks
    adm = store.admit(m, index, tier, "a", p + [1])
    store.compute(m, "a", p + [1], adm.num_cached_tokens)
    m.release("a")  # blocks 0-3 cached, freed tail-first: block 3 leaves first
    filler = list(range(500, 513))  # 13 tokens: 4 blocks, 2 of them evicted cached ones
    adm = store.admit(m, index, tier, "f", filler)
    assert adm.groups["full"].loads == () and tier.num_entries == 2  # a's blocks 3 and 2 went to the host
    store.compute(m, "f", filler, 0)
    m.release("f")
    again = p + [7, 8]
    adm = store.admit(m, index, tier, "b", again)
    assert adm.num_cached_tokens == 16 and adm.num_scheduled_tokens == 2
    assert m.stats.num_lower_tier_hit_tokens == 8  # blocks 2, 3 from the host; 0, 1 from the device
    store.check(m, "b", again, 16)
    assert m.lookup_prefix(again) == 16  # the loaded blocks are findable now
    store.compute(m, "b", again, 16)
    store.check(m, "b", again)
    tier.check_integrity()


def test_a_load_that_fails_is_computed_instead() -> None:
    tier = HostTier(1 << 20)
    m, index = make(6, tier)
    store = Store()
    p = list(range(100, 116))
    _serve_and_push_out(store, m, index, tier, p + [1], filler_len=13)
    adm = m.admit("b", p + [7], 3)  # first step of 3 tokens at most
    store.offload(m, index, tier)
    assert [b for b, _ in adm.groups["full"].loads] and adm.num_cached_tokens == 16
    first = adm.groups["full"].loads[0]
    store.blocks[first[0]] = tuple(p[:12])  # loaded
    fixed = m.complete_loads("b", 1)  # the second block is gone: computed instead
    assert (fixed.num_cached_tokens, fixed.num_scheduled_tokens) == (12, 3)
    m.check_integrity()
    with pytest.raises(ValueError, match="2 blocks loaded, but 0 were to load"):
        m.complete_loads("b", 2)


def _make_tiered(exact: bool, num_blocks: int, tier: HostTier):
    """`make`'s cache, or (exact) the coordinator over the same attention group with exact
    steps: a reservation is committed whole, as on V4's and the hybrid's caches."""
    if not exact:
        return make(num_blocks, tier)
    index = TierIndex(tier, BS)
    return HybridCacheManager([(AttentionGroupSpec("full", BS), num_blocks)], DESC, lower_tier=index), index


def _admitted_while_loading(exact: bool):
    """Request b admitted with a hit of 16 tokens: blocks 0, 1 on the device, 2, 3 still
    loading from the host tier (a's, evicted); its state before anything is tried on it."""
    tier = HostTier(1 << 20)
    m, index = _make_tiered(exact, 8, tier)
    store = Store()
    p = list(range(100, 116))
    _serve_and_push_out(store, m, index, tier, p + [1], filler_len=21)
    again = p + [7]
    adm = m.admit("b", again)
    store.offload(m, index, tier)
    assert [b for b, _ in adm.groups["full"].loads] == [2, 3] and adm.num_cached_tokens == 16
    before = (m.num_computed_tokens("b"), m.block_ids("b"), m.num_free_blocks, m.lookup_prefix(again))
    assert before == (8, [0, 1, 2, 3, 4], 3, 8)
    return m, index, tier, store, adm, again, before


@pytest.mark.parametrize("exact", [False, True])
def test_a_commit_over_blocks_still_loading_is_refused_and_changes_nothing(exact) -> None:
    # The admission's first step is reserved from the end of the device hit, over the blocks
    # a lower tier still loads: a commit before `complete_loads` (of that step, or of one
    # token) went through on both caches, counted the unloaded slots computed and published
    # them (the next lookup of the prompt hit 16 tokens of blocks that held nothing of it),
    # and `complete_loads` then found them "already registered"
    m, index, tier, store, adm, again, before = _admitted_while_loading(exact)
    for num_tokens in [9, 1] if not exact else [9]:  # (not exact: a decode inside the reservation too)
        with pytest.raises(ValueError, match="'b' has lower-tier blocks to load"):
            m.commit_step(["b"], [num_tokens], [9])
        assert (m.num_computed_tokens("b"), m.block_ids("b"), m.num_free_blocks, m.lookup_prefix(again)) == before
        m.check_integrity()
    for block_id, block in adm.groups["full"].loads:
        store.blocks[block_id] = tuple(tier.get(*index.describe(block))["content"].tolist())
    adm = m.complete_loads("b", 2)
    assert (adm.num_cached_tokens, adm.num_scheduled_tokens) == (16, 1)
    store.compute(m, "b", again, 16)
    store.check(m, "b", again)
    assert m.lookup_prefix(again + [9]) == 16


@pytest.mark.parametrize("exact", [False, True])
@pytest.mark.parametrize("budget", [0, 3])
def test_an_admission_with_loads_then_a_load_that_fails_keeps_its_table_and_step(exact, budget) -> None:
    # An admission of no new token (max_new_tokens=0) counted its table's loading blocks
    # reserved to none (check_integrity: "holds blocks [0, 4) for 8 reserved tokens"); and on
    # exact steps, a load that failed left the step [12, 17) reserved while complete_loads'
    # admission said 3 tokens, whose commit was refused ("the step reserved 5")
    tier = HostTier(1 << 20)
    m, index = _make_tiered(exact, 6, tier)
    store = Store()
    p = list(range(100, 116))
    _serve_and_push_out(store, m, index, tier, p + [1], filler_len=13)
    adm = m.admit("b", p + [7], budget)
    store.offload(m, index, tier)
    assert len(adm.groups["full"].loads) == 2 and adm.num_cached_tokens == 16
    m.check_integrity()
    first = adm.groups["full"].loads[0]
    store.blocks[first[0]] = tuple(p[:12])  # loaded; the second is gone: computed instead
    fixed = m.complete_loads("b", 1)
    m.check_integrity()
    # exact: the admission's reserved step, the failed block's tokens with it; else the budget
    expected = (5 if budget else 4) if exact else budget
    assert (fixed.num_cached_tokens, fixed.num_scheduled_tokens) == (12, expected)
    if expected:
        store.compute(m, "b", (p + [7])[: 12 + expected], 12)
        store.check(m, "b", p + [7], 12 + expected)


@pytest.mark.parametrize("exact", [False, True])
def test_a_fork_or_rollback_of_a_request_still_loading_is_refused_and_changes_nothing(exact) -> None:
    # The fork truncated the loading parent to its computed prefix (not exact steps): blocks
    # 2, 3 left its table while its state still listed them as loading, and complete_loads
    # then asserted 'register of free block 2'; a rollback was refused only because the
    # group cannot truncate a loading state, a turn end only because the admission's step
    # was pending. All are refused first now, naming the request and its loads
    m, index, tier, store, adm, again, before = _admitted_while_loading(exact)
    calls = (
        lambda: m.fork("b", "c"),
        lambda: m.rollback("b", 8),
        lambda: m.rollback("b", 0),
        lambda: m.mark_turn_end("b"),
    )
    for call in calls:
        with pytest.raises(ValueError, match=r"'b' has lower-tier blocks to load \(complete_loads first\)"):
            call()
        assert (m.num_computed_tokens("b"), m.block_ids("b"), m.num_free_blocks, m.lookup_prefix(again)) == before
        assert "c" not in m
        m.check_integrity()
    for block_id, block in adm.groups["full"].loads:
        store.blocks[block_id] = tuple(tier.get(*index.describe(block))["content"].tolist())
    adm = m.complete_loads("b", 2)
    assert (adm.num_cached_tokens, m.num_computed_tokens("b")) == (16, 16)
    store.compute(m, "b", again, 16)
    store.check(m, "b", again)
    # loaded and committed, the same fork goes through: the child shares the parent's blocks
    assert m.fork("b", "c") is True
    assert (m.block_ids("c"), m.num_computed_tokens("c")) == ([0, 1, 2, 3, 4], 17)
    m.check_integrity()
    store.check(m, "c", again)


STEP_OPS = st.lists(
    st.tuples(st.sampled_from(["admit", "admit", "step", "step", "load", "release", "release"]), st.integers(0, 5)),
    min_size=8,
    max_size=40,
)


@settings(max_examples=int(os.environ.get("KVPOOL_HYPOTHESIS_EXAMPLES", "60")), deadline=None)
@given(ops=STEP_OPS, exact=st.booleans(), tier_blocks=st.integers(1, 6))
def test_lower_tier_hits_in_mixed_steps_keep_every_block_its_prefix(ops, exact, tier_blocks) -> None:
    """Requests admitted with lower-tier hits while others are in flight: the admissions'
    chunks, loaded whole, in part or not yet, committed together with the other requests'
    decodes in one step; a commit that names a request still loading is refused whole and
    changes nothing; integrity after every operation, and every full block a request holds
    holds its own prefix."""
    tier = HostTier(tier_blocks * _tensor_bytes(BS * 8))
    m, index = _make_tiered(exact, 6, tier)
    store = Store()
    tokens: dict[str, list[int]] = {}  # every request's known ids (the prompt, then decoded ones)
    loading: dict[str, Any] = {}  # the requests whose loads are pending: their admission's loads
    behind: set[str] = set()
    for n, (op, pick) in enumerate(ops):
        ids = sorted(tokens)
        if op == "admit":
            prompt = [1000 * (pick % 2) + i for i in range(9 + 4 * (pick // 2))]  # two prefixes, 3 to 5 blocks
            adm = m.admit(f"r{n}", prompt)
            store.offload(m, index, tier)
            if adm is not None:
                tokens[f"r{n}"] = prompt
                if adm.groups["full"].loads:
                    loading[f"r{n}"] = adm.groups["full"].loads
                else:
                    store.check(m, f"r{n}", prompt, adm.num_cached_tokens)
        elif op == "load" and loading:
            rid = sorted(loading)[pick % len(loading)]
            loaded = 0
            for block_id, block in loading.pop(rid)[: pick + 1]:
                found = tier.get(*index.describe(block))
                if found is None:
                    break
                store.blocks[block_id] = tuple(found["content"].tolist())
                loaded += 1
            adm = m.complete_loads(rid, loaded)
            store.check(m, rid, tokens[rid], adm.num_cached_tokens)
        elif op == "step":
            # every request not loading steps: its reserved chunk, or a decode past its prompt
            # (`behind`: a decode whose reservation did not fit, its id appended: tried again)
            rows = [rid for rid in ids if rid not in loading]
            decodes = [rid for rid in rows if m.num_computed_tokens(rid) == len(tokens[rid]) or rid in behind]
            for rid in decodes:
                if rid not in behind:
                    tokens[rid].append(2000 + len(tokens[rid]))
                    m.append_token_ids(rid, tokens[rid][-1:])
            behind = set()
            if decodes and not m.reserve_step(decodes, [1] * len(decodes)):
                behind = set(decodes)
                rows = [rid for rid in rows if rid not in behind]
            store.offload(m, index, tier)  # (a decode's new block may be an evicted cached one)
            counts = [len(tokens[rid]) - m.num_computed_tokens(rid) for rid in rows]
            if loading:  # first, the same step with a request still loading among its rows
                rid = sorted(loading)[pick % len(loading)]
                before = {r: m.num_computed_tokens(r) for r in tokens}, m.num_free_blocks
                with pytest.raises(ValueError, match="lower-tier blocks to load"):
                    m.commit_step(
                        [*rows, rid], [*counts, len(tokens[rid]) - m.num_computed_tokens(rid)], [None] * (len(rows) + 1)
                    )
                assert ({r: m.num_computed_tokens(r) for r in tokens}, m.num_free_blocks) == before
                m.check_integrity()
                for call, args in ((m.fork, (rid, f"f{n}")), (m.rollback, (rid, 0))):  # (likewise)
                    with pytest.raises(ValueError, match="lower-tier blocks to load"):
                        call(*args)
                    assert ({r: m.num_computed_tokens(r) for r in tokens}, m.num_free_blocks) == before
                    m.check_integrity()
            for rid, count in zip(rows, counts, strict=True):
                for i, block_id in enumerate(m.block_ids(rid)):
                    end = min((i + 1) * BS, len(tokens[rid]))
                    if end > len(tokens[rid]) - count:
                        store.blocks[block_id] = tuple(tokens[rid][:end])
            m.commit_step(rows, counts, [None] * len(rows))
            for rid in rows:
                store.check(m, rid, tokens[rid])
        elif op == "release" and ids:
            rid = ids[pick % len(ids)]
            m.release(rid)
            del tokens[rid]
            loading.pop(rid, None)
            behind.discard(rid)
        m.check_integrity()
        tier.check_integrity()
    for rid in tokens:
        m.release(rid)
    m.check_integrity()
    assert m.num_free_blocks == 6


def test_tenants_never_meet_through_the_host_tier() -> None:
    tier = HostTier(1 << 20)
    m, index = make(6, tier)
    store = Store()
    p = list(range(100, 116))
    _serve_and_push_out(store, m, index, tier, p + [1], filler_len=21, tenant="t1")
    assert tier.num_entries >= 4  # all of t1's blocks are on the host now
    other = store.admit(m, index, tier, "b", p + [2], tenant="t2")
    assert other.num_cached_tokens == 0 and m.stats.num_lower_tier_hit_tokens == 0
    m.release("b")
    same = store.admit(m, index, tier, "c", p + [2], tenant="t1")
    assert same.num_cached_tokens == 16
    store.check(m, "c", p + [2], 16)


def test_a_descriptor_mismatch_is_a_miss_counted_by_field_and_reclaimed() -> None:
    tier = HostTier(1 << 20)
    m, index = make(6, tier)
    store = Store()
    p = list(range(100, 116))
    _serve_and_push_out(store, m, index, tier, p + [1], filler_len=21)
    entries = tier.num_entries
    # another engine on the same host tier, with new weights: found by content, refused
    m2, index2 = make(6, tier, dataclasses.replace(DESC, weights_version="w2"))
    adm = m2.admit("b", p + [2])
    assert adm.num_cached_tokens == 0 and adm.groups["full"].loads == ()
    assert tier.stats.mismatches == {"weights_version": 1}  # the first block; the probe stops there
    assert tier.stats.num_reclaimed == 1 and tier.num_entries == entries - 1
    # a layout switch on the next block
    m3, _ = make(6, tier, dataclasses.replace(DESC, layout_id="bs4:bf16"))
    m3.admit("c", p[4:] + [2])  # starts with a's block 1 content, but not as a's prefix: no key matches
    assert tier.stats.mismatches == {"weights_version": 1}
    # a version switch: reclaim every entry of the old weights at once
    assert tier.reclaim(dataclasses.replace(DESC, weights_version="w2")) == entries - 1
    assert tier.num_entries == 0 and tier.stats.num_reclaimed == entries
    tier.check_integrity()


def test_block_descriptors_name_every_field_and_round_trip() -> None:
    tier = HostTier(1 << 20)
    m, index = make(6, tier)
    prompt = list(range(100, 110))
    m.admit("a", prompt)
    m.commit("a", 10)
    chain = m.part("a").prefix_chain()
    key0, d0 = index.describe(chain[0])
    key1, d1 = index.describe(chain[1])
    assert (d0.num_computed_tokens, d0.token_ids, d1.token_ids) == (4, (100, 101, 102, 103), (104, 105, 106, 107))
    assert d1.parent_key == key0.hex() and d0.content_key == key0.hex() and d1.content_key == key1.hex()
    assert (d0.model_id, d0.weights_version, d0.layout_id) == ("m", "w1", "bs4:fp32")
    assert BlockDescriptor.from_json(d1.to_json()) == d1
    assert d1.mismatches(dataclasses.replace(d1, tenant="x", rope_id="r")) == ["tenant", "rope_id"]
    with pytest.raises(ValueError, match="must have exactly the fields"):
        BlockDescriptor.from_json('{"content_key": "00"}')
    with pytest.raises(ValueError, match="not JSON"):
        BlockDescriptor.from_json("{")
    # the content key is the tokens' and the tenant's, not the model's
    other, other_index = make(6, tier, dataclasses.replace(DESC, weights_version="w9"))
    other.admit("a", prompt)
    other.commit("a", 10)
    assert other_index.describe(other.part("a").prefix_chain()[1])[0] == key1


# ----- the tier itself -------------------------------------------------------------------


def _entry(index: TierIndex, m: FullAttentionManager, rid: str, prompt: list[int]):
    m.admit(rid, prompt)
    m.commit(rid, len(prompt))
    return [index.describe(b) for b in m.part(rid).prefix_chain()]


def test_lru_under_a_byte_limit() -> None:
    tier = HostTier(3 * 32)  # three blocks of 4 int64 values
    m, index = make(16, HostTier(1))
    blocks = _entry(index, m, "a", list(range(100, 120)))  # 5 full blocks
    t = {"content": torch.zeros(4, dtype=torch.int64)}
    for key, d in blocks[:3]:
        assert tier.put(key, d, t)
    assert tier.lookup(*blocks[0])  # block 0 is the most recently used now
    assert tier.put(*blocks[3], t)  # pushes out block 1, the least recently used
    assert [tier.contains(k) for k, _ in blocks[:4]] == [True, False, True, True]
    assert tier.stats.num_evictions == 1 and tier.num_bytes == 96
    assert tier.put(*blocks[3], t) and tier.num_entries == 3  # a replacement, not an eviction
    assert not tier.put(*blocks[4], {"content": torch.zeros(13, dtype=torch.int64)})  # 104 B > 96 B
    assert tier.stats.num_rejected_puts == 1 and tier.num_entries == 3
    assert tier.evict(blocks[0][0]) and not tier.evict(blocks[0][0])
    assert tier.get(*blocks[1]) is None and tier.stats.num_get_misses == 1
    got = tier.get(*blocks[2])
    assert got is not None and torch.equal(got["content"], t["content"]) and got["content"] is not t["content"]
    tier.check_integrity()


def test_a_put_whose_copy_fails_leaves_every_entry_in_place(monkeypatch) -> None:
    """A copy into host memory that raises (pinned memory refused, a device error) is raised
    to the caller, and the entry it would replace and the least recent one it would push out
    are both still there: put dropped them first, then copied, and lost them to the error."""
    tier = HostTier(3 * 32)
    m, index = make(16, HostTier(1))
    blocks = _entry(index, m, "a", list(range(100, 120)))
    t = {"content": torch.zeros(4, dtype=torch.int64)}
    for key, d in blocks[:3]:
        assert tier.put(key, d, t)

    def refuse(tensor: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("pinned memory allocation failed")

    monkeypatch.setattr(tier, "_copy", refuse)
    for block in (blocks[0], blocks[3]):  # a replacement, then a put that pushes one out
        with pytest.raises(RuntimeError, match="pinned"):
            tier.put(*block, t)
    assert [tier.contains(k) for k, _ in blocks[:4]] == [True, True, True, False]
    assert tier.num_bytes == 96 and tier.stats.num_evictions == 0 and tier.stats.num_puts == 3
    tier.check_integrity()


@pytest.mark.parametrize("bad", [0, -5, 1.5, True, "1"])
def test_a_bad_capacity_is_refused(bad) -> None:
    with pytest.raises(ValueError, match="host tier capacity must be a positive number of bytes"):
        HostTier(bad)


# ----- the lifecycle, against a model of the slots ---------------------------------------

OPS = st.lists(
    st.tuples(st.sampled_from(["run", "run", "hold", "release"]), st.integers(0, 5), st.integers(1, 14)),
    min_size=4,
    max_size=40,
)


@settings(max_examples=int(os.environ.get("KVPOOL_HYPOTHESIS_EXAMPLES", "150")), deadline=None)
@given(ops=OPS, tier_blocks=st.integers(1, 6))
def test_every_block_a_request_reads_holds_its_own_prefix(ops, tier_blocks) -> None:
    """Requests over a few shared prefixes on a 6-block pool with a small host tier: after
    every admission (device hits, host loads, evictions) and every forward, each full block
    of a request holds exactly the prefix it stands for; integrity after every operation."""
    tier = HostTier(tier_blocks * _tensor_bytes(BS * 8))
    m, index = make(6, tier)
    store = Store()
    held: dict[str, list[int]] = {}
    for n, (op, family, length) in enumerate(ops):
        if op == "release" and held:
            m.release(sorted(held)[family % len(held)])
            del held[sorted(held)[family % len(held)]]
            m.check_integrity()
            continue
        prompt = [1000 * (family % 3) + i for i in range(length + 4 * (family // 3))]
        rid = f"r{n}"
        adm = store.admit(m, index, tier, rid, prompt)
        if adm is None:
            continue
        store.check(m, rid, prompt, adm.num_cached_tokens)  # the hit, device and host blocks alike
        store.compute(m, rid, prompt, adm.num_cached_tokens)
        store.check(m, rid, prompt)
        if op == "hold":
            held[rid] = prompt
        else:
            m.release(rid)
            m.check_integrity()
        store.offload(m, index, tier)
        tier.check_integrity()
    for rid in held:
        m.release(rid)
    m.check_integrity()
    assert m.num_free_blocks == 6


# ----- the engine on SmolLM2 -------------------------------------------------------------


def _prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 49000) for _ in range(n)]


def _serve(engine, prompts):
    from kvpool.engine.sampling import SamplingParams

    outs = []
    for i, prompt in enumerate(prompts):
        rid = engine.add_request(prompt, SamplingParams(max_tokens=3, ignore_eos=True), f"r{i}")
        while engine.has_unfinished():
            engine.step()
            engine.runner.check_integrity()
        outs.append((engine.output(rid), torch.stack(engine.requests[rid].seqs[0].logits)))
    return outs


def test_engine_logits_with_the_host_tier_equal_a_device_hit(fp64_model) -> None:
    from kvpool.attention.reference import reference_logits
    from kvpool.engine.build import build_engine

    p = _prompt(96, 1)  # 6 blocks of 16
    prompts = [p + [7], _prompt(116, 2), p + _prompt(20, 3)]  # the filler evicts p's last blocks
    small = build_engine(fp64_model, num_blocks=12, block_size=16, record_logits=True, host_cache_bytes=1 << 28)
    large = build_engine(fp64_model, num_blocks=64, block_size=16, record_logits=True)
    got, want = _serve(small, prompts), _serve(large, prompts)
    runner = small.runner
    (out, logits), (ref_out, ref_logits) = got[2], want[2]
    assert out.num_cached_tokens == ref_out.num_cached_tokens == 96  # all of p: device + host, and device
    hits = runner.cache.stats.num_lower_tier_hit_tokens
    assert 0 < hits < 96  # half on the host, the head still on the device
    assert runner.tier_moves.num_loaded == hits // 16 and runner.tier_moves.num_offloaded >= hits // 16
    assert torch.equal(logits, ref_logits)  # the loaded KV is the computed KV, bit for bit
    history = small.requests["r2"].seqs[0].token_ids[:-1]
    ref = reference_logits(fp64_model.model, history)[len(prompts[2]) - 1 :]
    assert (logits - ref).abs().max().item() <= 1e-9
    report = runner.tier_reports()["host_tier"]
    assert report["blocks_loaded"] == hits // 16 and report["mismatches"] == {}
    from kvpool.engine import memory

    ledger = memory.measure(runner, 0, 0).as_dict()  # the tier's peak is a line of the KV pool's term
    assert ledger["details"]["kv_pool"]["host_tier"] == runner.tier.peak_bytes >= runner.tier.num_bytes > 0


def test_the_cli_refuses_a_bad_host_cache_size() -> None:
    for flag, needle in (("0", "expected a finite positive number, got '0'"), ("-1", "expected a finite positive")):
        proc = subprocess.run(
            [sys.executable, "-m", "kvpool", "run", "--host-cache-gib", flag],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode == 2 and needle in proc.stderr and "Traceback" not in proc.stderr


def test_a_tier_that_holds_no_block_or_a_host_tier_past_the_memory_is_refused(tmp_path) -> None:
    """A disk tier smaller than one block (--disk-cache-gib 1e-9) refused every block,
    silently (the host tier's check was its own); a host tier larger than the memory the
    machine has (--host-cache-gib 100000) was taken, to be killed by the OOM killer as it
    filled. Both are one ValueError when the runner is built."""
    from kvpool.engine.engine import Engine
    from kvpool.engine.llama_runner import llama_runner
    from kvpool.engine.memory import available_memory_bytes
    from kvpool.engine.sampling import SamplingParams
    from kvpool.tiers import DiskTier
    from random_llama import DESCRIPTOR, random_ids, random_llama

    model = random_llama("cpu", torch.float64)
    block = 2 * 4 * 2 * 32 * 16 * 8  # K and V, 4 layers, 2 KV heads, dim 32, 16 slots, fp64
    with pytest.raises(
        ValueError, match=rf"^a disk tier of 1000 bytes \(--disk-cache-gib\) holds no KV block of {block}"
    ):
        llama_runner(model, 8, 16, DESCRIPTOR, persistent_tiers=[DiskTier(tmp_path, 1000)])
    too_much = 2 * available_memory_bytes("cpu")
    with pytest.raises(
        ValueError, match=r"^the host tier \(--host-cache-gib\) needs .* GiB of memory available; lower"
    ):
        llama_runner(model, 8, 16, DESCRIPTOR, host_tier=HostTier(too_much))
    # the disk tier weighs an entry, header included: a limit of the tensors' bytes alone
    # passed and refused every block (review_6 #4)
    with pytest.raises(ValueError, match=rf"holds no KV block of {block} bytes \((\d+) bytes stored") as refused:
        llama_runner(model, 8, 16, DESCRIPTOR, persistent_tiers=[DiskTier(tmp_path / "d", block)])
    entry_bytes = int(re.search(r"\((\d+) bytes stored", str(refused.value)).group(1))
    assert block < entry_bytes < block + 8192  # (a header of a few KiB)
    with pytest.raises(ValueError, match="holds no KV block"):
        llama_runner(model, 8, 16, DESCRIPTOR, persistent_tiers=[DiskTier(tmp_path / "d", entry_bytes - 1)])
    disk = DiskTier(tmp_path / "d", entry_bytes)  # one entry: taken, and a block served through it is stored
    runner = llama_runner(model, 8, 16, DESCRIPTOR, host_tier=HostTier(block), persistent_tiers=[disk])
    engine = Engine(runner)
    engine.add_request(random_ids(40, 5), SamplingParams(max_tokens=1, ignore_eos=True), "a")
    while engine.has_unfinished():
        engine.step()
    assert runner.flush_tiers(30)
    assert disk.num_entries == 1 and disk.stats.num_rejected_puts == 0 and disk.num_bytes <= entry_bytes
    runner.close()


@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        (["--host-cache-gib", "1e6"], "the host tier (--host-cache-gib) needs"),
        (["--disk-cache-gib", "1e-9"], "(--disk-cache-gib) holds no KV block"),
    ],
)
def test_kvpool_run_refuses_a_tier_size_that_cannot_work_in_one_line(tmp_path, flags, needle) -> None:
    if "--disk-cache-gib" in flags:
        flags = [*flags, "--disk-cache", str(tmp_path / "d")]
    argv = [sys.executable, "-m", "kvpool", "run", "--model", "tiny-dsv4", *flags, "--json"]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    errors = [line for line in proc.stderr.splitlines() if "error" in line]
    assert proc.returncode == 2 and len(errors) == 1 and needle in errors[0], proc.stderr
    assert "Traceback" not in proc.stderr and proc.stdout == ""


@pytest.mark.parametrize("preemption", ["swap", "auto"])
def test_kvpool_run_swaps_tiny_dsv4_states_to_the_host_tier(capsys, preemption: str) -> None:
    """Three tiny-dsv4 requests at once on 3 classical blocks: two preemptions. --preemption
    swap writes both preempted requests' states to the host tier and both resumes take them
    back (64 tokens past their span boundaries not recomputed): the report says how many and
    their bytes. auto decides by the rates it measures (swap or not: a state for each swap)."""
    import json

    from kvpool.cli.main import main

    args = ["run", "--model", "tiny-dsv4", "--num-blocks", "3", "--host-cache-gib", "1", "--request-rate", "inf"]
    args += ["--num-requests", "3", "--turns", "1", "--num-long", "0", "--max-tokens", "16"]
    assert main([*args, "--preemption", preemption, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    host = report["host_tier"]
    assert (report["preemptions"], report["num_finished"], host["preemption"]) == (2, 3, preemption)
    assert host["states_swapped_out"] == host["swapped_out"] and host["swapped_in"] <= host["swapped_out"]
    if preemption == "swap":
        assert (host["swapped_out"], host["swapped_in"], host["tail_tokens_restored"]) == (2, 2, 64)
        assert host["state_bytes_swapped_out"] > 0


def test_bench_tiers_serves_the_prefix_from_every_tier(capsys) -> None:
    import json

    from kvpool.cli.main import main

    argv = ["bench", "tiers", "--prefix-len", "64", "--suffix-len", "4", "--repeats", "1", "--json"]
    assert main([*argv, "--v4-prefix-len", "640", "--swa-period", "256"]) == 0
    report = json.loads(capsys.readouterr().out)
    cases = report["cases"]
    assert all(cases[name]["cached_tokens"] == [64] for name in ("device", "host", "disk", "redis"))
    assert cases["host"]["blocks_loaded_per_request"] >= 3  # the filler left at most one block on the device
    assert cases["recompute"]["cached_tokens"] == [0]
    assert report["writes"]["disk"]["blocks"] == report["writes"]["redis"]["blocks"] == 68 // 16
    v4 = report["v4_swa"]
    assert [v4[name]["tokens_recomputed"] for name in ("full", "periodic 256", "zero")] == [0, 128, 640]
    assert v4["full"]["bytes_per_cached_token"] > v4["periodic 256"]["bytes_per_cached_token"]
    assert v4["periodic 256"]["bytes_per_cached_token"] > v4["zero"]["bytes_per_cached_token"] > 0
    assert v4["zero"]["snapshot_bytes"] == 0 and v4["recompute"]["cached_tokens"] == 0


# ----- preemption by swap ----------------------------------------------------------------


def _preempting_workload(fp64_model, **kw):
    """Four requests whose decodes outgrow a 10-block pool: preemptions mid-block."""
    from kvpool.engine.build import build_engine
    from kvpool.engine.sampling import SamplingParams

    engine = build_engine(fp64_model, num_blocks=10, block_size=16, record_logits=True, **kw)
    ids = [
        engine.add_request(_prompt(20 + i, 10 + i), SamplingParams(max_tokens=30, ignore_eos=True), f"r{i}")
        for i in range(4)
    ]
    while engine.has_unfinished():
        engine.step()
        engine.runner.check_integrity()
    return engine, ids


def _check_exact(fp64_model, engine, ids) -> None:
    from kvpool.attention.reference import reference_logits

    for rid in ids:
        seq = engine.requests[rid].seqs[0]
        assert len(seq.output_ids) == 30 and seq.finish_reason == "length"
        got = torch.stack(seq.logits)
        start = engine.requests[rid].num_prompt_tokens - 1
        ref = reference_logits(fp64_model.model, seq.token_ids[:-1])[start : start + len(got)]
        assert (got - ref).abs().max().item() <= 1e-9, rid


def test_swapped_out_and_back_requests_are_exact(fp64_model) -> None:
    engine, ids = _preempting_workload(fp64_model, host_cache_bytes=1 << 28, preemption="swap")
    moves = engine.runner.tier_moves
    assert engine.num_preemptions > 0 and moves.num_swapped_out == engine.num_preemptions
    assert moves.num_swapped_in > 0 and moves.num_tail_tokens_restored > 0  # partial blocks came back
    _check_exact(fp64_model, engine, ids)
    assert engine.runner.cache.num_free_blocks == 10  # nothing leaked


def test_a_swap_that_does_not_fit_falls_back_to_recompute(fp64_model) -> None:
    block = 30 * 2 * 3 * 64 * 16 * 8  # one fp64 block of SmolLM2: 30 layers x K, V x 3 heads x 64 x 16
    engine, ids = _preempting_workload(fp64_model, host_cache_bytes=block, preemption="swap")
    assert engine.num_preemptions > 0 and engine.runner.tier.num_bytes <= block
    _check_exact(fp64_model, engine, ids)
    assert engine.runner.cache.num_free_blocks == 10


class _Slots:
    """An executor's block moves as a model: block id -> the tensors it holds."""

    def __init__(self) -> None:
        self.blocks: dict[int, dict[str, torch.Tensor]] = {}

    def to_host(self, block_ids: list[int]) -> list[dict[str, torch.Tensor]]:
        return [{"kv": torch.tensor([block_id, 7])} for block_id in block_ids]

    def to_device(self, block_ids: list[int], tensors: list[dict[str, torch.Tensor]]) -> None:
        self.blocks.update(zip(block_ids, tensors, strict=True))


@pytest.mark.parametrize("resume", ["restored", "refused", "fewer blocks"])
def test_a_swapped_tail_leaves_the_host_tier_restored_or_not(resume: str) -> None:
    # "a": 10 tokens, blocks 0, 1 full and the tail block 2 holding 2; swapped out, then
    # admitted again with a sampled token more (the tail comes back), with no token more
    # (restore_refusal: a token must be left to compute) or with its first block only:
    # either way the tail's entry leaves the tier (before: it stayed unless restored)
    from kvpool.engine.tier_bridge import TierBridge

    tier = HostTier(1 << 20)
    bridge = TierBridge(tier, [], BS, enable_prefix_caching=True)
    m, slots = FullAttentionManager(8, BS, DESC), _Slots()
    tokens = list(range(10))
    m.admit("a", tokens)
    m.commit("a", 10)
    tail_id, tail, num_tail = tier_bridge.tail_block(m, "a")
    assert (tail_id, num_tail) == (2, 2)
    tail_key = bridge.index.describe(tail)[0]
    bridge.swap_out(m, slots, "a")
    m.release("a", "preempt")
    assert tier.num_entries == 3 and tier.contains(tail_key) and bridge.swapped["a"][:2] == (10, 2)
    prompt = {"restored": tokens + [42], "refused": tokens, "fewer blocks": tokens[:4] + [99] * 7}[resume]
    adm = bridge.swap_in(m, slots, "a", m.admit("a", prompt))
    m.check_integrity()
    assert not tier.contains(tail_key) and tier.num_entries == 2 and "a" not in bridge.swapped
    if resume == "restored":  # blocks 0, 1 hit on the device; a fresh block 3 gets block 2's tail
        assert m.num_computed_tokens("a") == 10 and bridge.moves.num_tail_tokens_restored == 2
        assert m.block_ids("a") == [0, 1, 3] and slots.blocks[3]["kv"].tolist() == [2, 7]
    else:
        hit = 8 if resume == "refused" else 4
        assert adm.num_cached_tokens == m.num_computed_tokens("a") == hit and not slots.blocks
        assert bridge.moves.num_swapped_in == 0


def test_a_swapped_request_released_while_it_waits_leaves_no_tail_in_the_tier() -> None:
    # "a" swapped out as above (blocks 0, 1 full, tail block 2 holding 2 tokens), then
    # cancelled before it resumes: the tail's entry leaves the tier with it (before: it
    # stayed until the LRU evicted it); the full blocks' entries stay for later hits
    from kvpool.engine.tier_bridge import TierBridge

    tier = HostTier(1 << 20)
    bridge = TierBridge(tier, [], BS, enable_prefix_caching=True)
    m, slots = FullAttentionManager(8, BS, DESC), _Slots()
    m.admit("a", list(range(10)))
    m.commit("a", 10)
    tail_key = bridge.index.describe(tier_bridge.tail_block(m, "a")[1])[0]
    bridge.swap_out(m, slots, "a")
    m.release("a", "preempt")
    assert tier.num_entries == 3 and tier.contains(tail_key)
    bridge.drop_swapped("a")
    bridge.drop_swapped("a")  # once only: nothing else goes
    m.check_integrity()
    assert not tier.contains(tail_key) and tier.num_entries == 2 and "a" not in bridge.swapped


def _engine_with_one_swapped_out(fp64_model):
    """An engine over 10 blocks of 16 whose four 30-token answers make it swap one request
    out to its host tier: stepped until the first swap-out."""
    from kvpool.engine.build import build_engine
    from kvpool.engine.sampling import SamplingParams

    engine = build_engine(fp64_model, num_blocks=10, block_size=16, host_cache_bytes=1 << 28, preemption="swap")
    for i in range(4):
        engine.add_request(_prompt(20 + i, 10 + i), SamplingParams(max_tokens=30, ignore_eos=True), f"r{i}")
    while not engine.runner.bridge.swapped:
        engine.step()
    return engine


def test_an_engine_request_aborted_while_swapped_out_takes_its_tail_out_of_the_tier(fp64_model) -> None:
    # the runner's release of a request swapped out and not resumed drops its tail's entry
    engine = _engine_with_one_swapped_out(fp64_model)
    bridge = engine.runner.bridge
    rid, (_, _, key) = next(iter(bridge.swapped.items()))
    assert engine.runner.tier.contains(key)
    assert engine.abort(rid.rsplit("/", 1)[0])  # the cache holds sequence ids: request/index
    engine.runner.check_integrity()
    assert rid not in bridge.swapped and not engine.runner.tier.contains(key)


def test_a_prefix_cache_reset_waits_for_a_request_swapped_out(fp64_model) -> None:
    # A Llama request swapped out waits with its KV in the host tier, as one that runs holds it
    # in the pool: the reset (after a weights update, say) is refused until it has finished,
    # by the runner's own check: the cache, which holds no request then, would forget at once
    engine = _engine_with_one_swapped_out(fp64_model)
    bridge = engine.runner.bridge
    swapped = next(iter(bridge.swapped)).rsplit("/", 1)[0]
    for rid in {seq.request.request_id for seq in engine.running}:
        assert engine.abort(rid)
    assert not engine.runner.cache.request_ids and bridge.swapped  # only the swapped-out request is left
    assert engine.reset_prefix_cache() is False
    while engine.has_unfinished():
        engine.step()
    assert len(engine.pop_output(swapped).completions[0].token_ids) == 30
    assert not bridge.swapped and engine.reset_prefix_cache() is True
    engine.runner.check_integrity()


def test_swap_needs_a_host_tier() -> None:
    from kvpool.engine.build import build_engine, load_model

    with pytest.raises(ValueError, match="preemption 'swap' needs a host tier"):
        build_engine(load_model(device="cpu"), num_blocks=8, preemption="swap")
    with pytest.raises(ValueError, match="unknown preemption 'later'"):
        build_engine(load_model(device="cpu"), num_blocks=8, host_cache_bytes=1 << 20, preemption="later")
    proc = subprocess.run(
        [sys.executable, "-m", "kvpool", "run", "--preemption", "swap"], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.splitlines()[-1] == (
        "kvpool run: error: --preemption swap swaps to the host tier: give --host-cache-gib too"
    )
    proc = subprocess.run(
        [sys.executable, "-m", "kvpool", "generate", "hi", "--preemption", "auto"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and proc.stderr.splitlines()[-1] == (
        "kvpool generate: error: --preemption auto swaps to the host tier: give --host-cache-gib too"
    )


def test_holds_means_this_very_block() -> None:
    m, index = make(16, HostTier(1))
    (key, d), *_ = _entry(index, m, "a", list(range(100, 108)))
    tier = HostTier(1 << 10)
    tier.put(key, d, {"content": torch.zeros(4, dtype=torch.int64)})
    assert tier.holds(key, d) and tier.contains(key)
    newer = dataclasses.replace(d, weights_version="w2")  # same content key, other weights
    assert not tier.holds(key, newer)  # a writer of the new weights stores its own block
    assert tier.stats.num_lookups == 0 and tier.stats.mismatches == {}  # no counter moved


# ----- the tiny V4 model: classical blocks through the host tier ---------------------------


def test_tiny_v4_logits_with_the_host_tier_equal_a_device_hit() -> None:
    from kvpool.engine.dsv4_runner import dsv4_runner
    from kvpool.engine.engine import Engine
    from kvpool.engine.sampling import SamplingParams
    from kvpool.models.tiny_dsv4 import TinyDSV4

    model = TinyDSV4(dtype=torch.float64)
    rng = random.Random(0)
    p = [rng.randrange(256) for _ in range(4 * 128)]  # 4 classical spans
    filler = [rng.randrange(256) for _ in range(5 * 128 + 10)]  # takes 2 of p's cached blocks
    prompts = [p + [7], filler, p + [rng.randrange(256) for _ in range(30)]]

    def serve(num_blocks: int, tier):
        runner = dsv4_runner(model, num_blocks, 2, host_tier=tier)
        engine = Engine(runner, max_num_batched_tokens=512, max_num_seqs=2, record_logits=True)
        outs = []
        for i, prompt in enumerate(prompts):
            rid = engine.add_request(prompt, SamplingParams(max_tokens=4, ignore_eos=True), f"r{i}")
            while engine.has_unfinished():
                engine.step()
                runner.check_integrity()
            outs.append((engine.output(rid).num_cached_tokens, torch.stack(engine.requests[rid].seqs[0].logits)))
        return outs, runner

    small, runner = serve(7, HostTier(1 << 26))
    large, _ = serve(64, None)
    assert small[2][0] == large[2][0] == 512  # all of p: device + host, and device
    report = runner.tier_reports()["host_tier"]
    assert 0 < report["blocks_loaded"] < 4 and report["mismatches"] == {}  # half from the host
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(small, large, strict=True))
    assert runner.cache.num_free_blocks == 7


def test_dsv4_install_publishes_only_what_was_loaded() -> None:
    from kvpool.cache import DSV4CacheManager
    from kvpool.models.tiny_dsv4 import SMALL_DSV4_CONFIG
    from kvpool.spec.dsv4 import DSV4Spec

    spec = DSV4Spec.from_config(SMALL_DSV4_CONFIG)
    m = DSV4CacheManager(spec, 6, 2, CacheDescriptor("v4", layout_id="span16"))
    prompt = list(range(50, 50 + 3 * spec.span + 1))
    hit, candidates = tier_bridge.prefetch_candidates(m, prompt)
    assert hit == [] and len(candidates) == 3
    group = m.groups["v4"]
    ids = group.install(3, hold=())
    assert ids is not None and m.num_free_blocks == 3
    group.publish_installed(ids, candidates, 2)  # the third could not be loaded
    m.check_integrity()
    assert m.num_free_blocks == 6 and m.lookup_prefix(prompt) == 2 * spec.span
    assert group.install(7, hold=()) is None and m.num_free_blocks == 6  # nothing taken


def test_a_preempted_v4_request_gets_its_blocks_back_from_the_host_exactly() -> None:
    from kvpool.engine.dsv4_runner import dsv4_runner
    from kvpool.engine.engine import Engine
    from kvpool.engine.sampling import SamplingParams
    from kvpool.models.tiny_dsv4 import SMALL_DSV4_CONFIG, TinyDSV4

    model = TinyDSV4(SMALL_DSV4_CONFIG, dtype=torch.float64)  # 16-token spans: many blocks, quickly
    rng = random.Random(0)
    prompts = [[rng.randrange(256) for _ in range(20 + i)] for i in range(4)]

    def serve(num_blocks: int, tier):
        runner = dsv4_runner(model, num_blocks, 4, host_tier=tier)
        engine = Engine(runner, max_num_batched_tokens=64, max_num_seqs=4, record_logits=True)
        for i, p in enumerate(prompts):
            engine.add_request(p, SamplingParams(max_tokens=30, ignore_eos=True), f"r{i}")
        while engine.has_unfinished():
            engine.step()
            runner.check_integrity()
        return engine, runner

    small, runner = serve(7, HostTier(1 << 26))  # 4 requests of 3-4 blocks each in 7: preemptions
    large, _ = serve(64, None)
    report = runner.tier_reports()["host_tier"]
    assert small.num_preemptions > 0 and report["blocks_loaded"] > 0 and report["hit_tokens"] > 0
    for i in range(4):
        a, b = small.requests[f"r{i}"].seqs[0], large.requests[f"r{i}"].seqs[0]
        assert a.token_ids == b.token_ids
        assert (torch.stack(a.logits) - torch.stack(b.logits)).abs().max().item() <= 1e-9  # state replayed in fp64
    assert runner.cache.num_free_blocks == 7


@pytest.mark.parametrize(
    "field", [f.name for f in dataclasses.fields(BlockDescriptor) if f.name not in ("content_key", "tenant")]
)
def test_every_descriptor_field_is_a_counted_miss_in_the_host_tier(field) -> None:
    m, index = make(16, HostTier(1))
    key, d = _entry(index, m, "a", list(range(100, 108)))[1]
    tier = HostTier(1 << 20)
    tier.put(key, d, {"content": torch.zeros(4, dtype=torch.int64)})
    old = getattr(d, field)
    other = (old[:-1] + (999,)) if isinstance(old, tuple) else old + 1 if isinstance(old, int) else f"{old}x"
    assert not tier.lookup(key, dataclasses.replace(d, **{field: other}))
    assert tier.stats.mismatches == {field: 1} and tier.stats.misses == {"mismatch": 1}
    assert tier.stats.num_reclaimed == 1 and tier.num_entries == 0  # reclaimed: it can never serve this caller
    tier.check_integrity()


def test_auto_preemption_swaps_only_when_moving_costs_less_than_recomputing(fp64_model) -> None:
    engine, ids = _preempting_workload(fp64_model, host_cache_bytes=1 << 26, preemption="auto")
    runner = engine.runner
    assert runner.tier_moves.num_swapped_out > 0  # on this CPU a copy is far cheaper than a prefill
    _check_exact(fp64_model, engine, ids)
    # the rule itself, on measured rates set by hand: 4 blocks of 16 tokens computed
    runner.cache.admit("x", list(range(100, 164)), 64)
    runner.cache.commit("x", 64)
    moves = runner.tier_moves
    moves.offload_s, moves.load_s, moves.num_offloaded, moves.num_loaded = 1.0, 0.0, 10, 0  # 0.1 s a block
    runner._prefill_tokens, runner._prefill_s = 1000, 1.0  # 1 ms a token: recompute 64 ms < move 400 ms
    assert not runner._should_swap("x")
    runner._prefill_s = 10.0  # 10 ms a token: recompute 640 ms > move 400 ms
    assert runner._should_swap("x")
