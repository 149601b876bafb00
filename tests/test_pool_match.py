"""`BlockPool.match` against its naive twin: block by block, the prompt's block chained
(`chain`) after the last one found and looked up (`lookup`, which checks the content), kept
only when the stored entry hangs off that very block, one held copy preferred
(`chains.held_copy`). Over random pools (chains registered, freed, evicted by allocations,
under a weak hash that collides often or the real one), with and without a memo of hashes,
the memo filled by earlier matches of other lengths."""

from __future__ import annotations

import os

from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.cache.chains import held_copy
from kvpool.pool import BlockPool, PrefixBlock, PrefixMatch
from kvpool.pool.hashing import TOKEN_BYTES, token_bytes

BS = 2  # tokens a block
WIDTH = BS * TOKEN_BYTES


def naive_match(pool: BlockPool, root: PrefixBlock, prompt: bytes, max_blocks: int) -> PrefixMatch:
    parent, block_ids, chain = root, [], []
    for i in range(max_blocks):
        chunk = prompt[i * WIDTH : (i + 1) * WIDTH]
        found = pool.lookup(pool.chain(parent, chunk))
        if found is None or found.parent is not parent or len(chunk) != WIDTH:
            break
        block_ids.append(held_copy(pool, found))
        chain.append(found)
        parent = found
    return PrefixMatch(block_ids, chain)


# (op, tokens): "add" registers the prompt's blocks as a new request's; "free" releases the
# oldest request; "take" allocates a block (evicting the least recently freed cached one)
OPS = st.lists(
    st.tuples(st.sampled_from(["add", "add", "free", "take"]), st.lists(st.integers(0, 2), max_size=8)),
    max_size=20,
)


@settings(max_examples=int(os.environ.get("KVPOOL_HYPOTHESIS_EXAMPLES", "150")), deadline=None)
@given(
    weak_hash=st.booleans(),
    ops=OPS,
    prompts=st.lists(st.lists(st.integers(0, 2), min_size=0, max_size=10), min_size=1, max_size=4),
    lengths=st.lists(st.integers(0, 6), min_size=1, max_size=3),
)
def test_match_is_its_naive_twin(
    weak_hash: bool, ops: list[tuple[str, list[int]]], prompts: list[list[int]], lengths: list[int]
) -> None:
    pool = BlockPool(8)
    if weak_hash:  # 5 hash values: entries collide, the guard refuses them
        pool.hasher.digest = lambda data: bytes([sum(data) % 5]) * 16  # type: ignore[method-assign]
    root = pool.root(b"desc")
    held: list[list[int]] = []
    for op, tokens in ops:
        if op == "add":
            data = token_bytes(tokens)
            n = len(tokens) // BS
            ids = pool.allocate(n)
            if ids is None:
                continue
            parent = root
            for k, b in enumerate(ids):
                parent = pool.register(b, pool.chain(parent, data[k * WIDTH : (k + 1) * WIDTH])) or pool.chain(
                    parent, data[k * WIDTH : (k + 1) * WIDTH]
                )
            held.append(ids)
        elif op == "free" and held:
            pool.decref(reversed(held.pop(0)))
        elif op == "take" and pool.num_free:
            held.append(pool.allocate(1) or [])
        pool.check_integrity()
    for tokens in prompts:
        prompt = token_bytes(tokens)
        memo: dict = {}
        for max_blocks in [*lengths, len(tokens) // BS]:
            expected = naive_match(pool, root, prompt, max_blocks)
            assert pool.match(root, prompt, WIDTH, max_blocks, count_collisions=False) == expected
            assert pool.match(root, prompt, WIDTH, max_blocks, count_collisions=False, memo=memo) == expected
            assert pool.match(root, prompt, WIDTH, max_blocks, [b""] * max_blocks, count_collisions=False) == expected
    pool.check_integrity()


def test_a_memo_hash_that_leads_to_an_entry_after_another_parent_is_refused():
    # A hash of the block's tokens alone (the parent left out): block [3, 4] after [1, 2]
    # hashes as [3, 4] after the root, which another chain registered first
    pool = BlockPool(4)
    pool.hasher.digest = lambda data: data[-WIDTH:].rjust(16, b"\0")  # type: ignore[method-assign]
    root = pool.root(b"desc")
    a, b, c = pool.allocate(3)
    other = pool.register(a, pool.chain(root, token_bytes([3, 4])))
    first = pool.register(b, pool.chain(root, token_bytes([1, 2])))
    assert other is not None and first is not None
    assert pool.register(c, pool.chain(first, token_bytes([3, 4]))) is None  # the hash is taken
    prompt = token_bytes([1, 2, 3, 4])
    memo: dict = {}
    for m in (None, memo, memo):  # hashed, then read from the memo
        hit = pool.match(root, prompt, WIDTH, 2, memo=m)
        assert hit == naive_match(pool, root, prompt, 2) and hit.block_ids == [b]
    assert len(memo[pool.memo_key(root, WIDTH)]) == 2
    pool.check_integrity()


@settings(max_examples=int(os.environ.get("KVPOOL_HYPOTHESIS_EXAMPLES", "150")), deadline=None)
@given(
    weak_hash=st.booleans(),
    steps=st.lists(st.tuples(OPS, st.integers(0, 6)), min_size=1, max_size=6),
    prompts=st.lists(st.lists(st.integers(0, 2), min_size=0, max_size=10), min_size=1, max_size=3),
)
def test_a_memo_kept_across_changes_of_the_pool_matches_as_the_naive_twin(
    weak_hash: bool, steps: list[tuple[list[tuple[str, list[int]]], int]], prompts: list[list[int]]
) -> None:
    # A prompt's memo lives while the pool changes (the router's lookup, then the admission a
    # step or more later): the run its last walk accepted is taken again only while the
    # index holds each of its blocks; chains registered, freed, evicted and taken in between
    # (under a weak hash, equal hashes of other content) must never make it answer otherwise
    pool = BlockPool(8)
    if weak_hash:
        pool.hasher.digest = lambda data: bytes([sum(data) % 5]) * 16  # type: ignore[method-assign]
    root = pool.root(b"desc")
    memos: list[dict] = [{} for _ in prompts]
    held: list[list[int]] = []
    for ops, max_blocks in steps:
        for op, tokens in ops:
            if op == "add":
                data = token_bytes(tokens)
                ids = pool.allocate(len(tokens) // BS)
                if ids is None:
                    continue
                parent = root
                for k, b in enumerate(ids):
                    block = pool.chain(parent, data[k * WIDTH : (k + 1) * WIDTH])
                    parent = pool.register(b, block) or block
                held.append(ids)
            elif op == "free" and held:
                pool.decref(reversed(held.pop(0)))
            elif op == "take" and pool.num_free:
                held.append(pool.allocate(1) or [])
        for tokens, memo in zip(prompts, memos, strict=True):
            prompt = token_bytes(tokens)
            for n in (max_blocks, len(tokens) // BS):
                expected = naive_match(pool, root, prompt, n)
                assert pool.match(root, prompt, WIDTH, n, count_collisions=False, memo=memo) == expected
        pool.check_integrity()


def test_a_free_copy_that_turns_held_moves_the_index_version():
    # `match` shares a held copy of a block with several copies rather than revive a free
    # one: a free copy that turns held can change its answer, so `index_version` (which a
    # coordinator compares to take a router's lookup again at the admission:
    # tests/test_lookup_reuse.py) must move. (The coordinator's own groups revive only the
    # copy `match` names, the first where none is held, which changes no answer; a caller
    # of the public `incref` may hold any copy.)
    pool = BlockPool(4)
    root = pool.root(b"desc")
    a, b = pool.allocate(2)
    block = pool.register(a, pool.chain(root, token_bytes([1, 2])))
    assert block is not None and pool.register(b, pool.chain(root, token_bytes([1, 2]))) is block  # b: a copy
    pool.decref([a, b])  # both free, cached
    prompt = token_bytes([1, 2])
    assert pool.match(root, prompt, WIDTH, 1).block_ids == [a]  # none held: the first copy
    version = pool.index_version
    pool.incref([b])
    assert pool.match(root, prompt, WIDTH, 1).block_ids == [b]  # the held copy
    assert pool.index_version != version
    pool.check_integrity()
