"""Block hashes: a fixed binary layout, chained, stable across processes."""

from __future__ import annotations

import hashlib
import subprocess
import sys

import xxhash

from kvpool.pool import BlockHasher, BlockPool, token_bytes
from kvpool.pool.hashing import block_packer


def test_token_bytes_is_little_endian_uint32():
    assert token_bytes([1, 256, 2**32 - 1]) == bytes([1, 0, 0, 0, 0, 1, 0, 0, 255, 255, 255, 255])
    assert block_packer(3)([1, 256, 2**32 - 1]) == token_bytes([1, 256, 2**32 - 1])


def test_chain_is_hash_of_parent_tokens_and_extra():
    hasher = BlockHasher()
    parent = hasher.root(b"desc", "salt")
    tb = token_bytes([5, 6, 7, 8])
    assert hasher.chain(parent, tb) == xxhash.xxh3_128_digest(parent + tb)
    assert hasher.chain(parent, tb, b"mm") == xxhash.xxh3_128_digest(parent + tb + b"mm")
    assert BlockHasher("sha256").chain(parent, tb) == hashlib.sha256(parent + tb).digest()
    # the salt and the descriptor both change the root
    assert len({hasher.root(b"desc", "salt"), hasher.root(b"desc", ""), hasher.root(b"desc2", "salt")}) == 3
    # (descriptor, salt) boundaries are length-prefixed, so shifting a byte changes the root
    assert hasher.root(b"ab", "c") != hasher.root(b"a", "bc")


def test_hashes_are_stable_across_processes():
    code = (
        "from kvpool.pool import BlockHasher, token_bytes;"
        "h = BlockHasher(); print(h.chain(h.root(b'd', 's'), token_bytes(range(16))).hex())"
    )
    runs = {
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
        for _ in range(2)
    }
    h = BlockHasher()
    assert runs == {h.chain(h.root(b"d", "s"), token_bytes(range(16))).hex() + "\n"}


def test_pool_register_first_copy_wins_and_duplicates_free_as_plain_blocks():
    pool = BlockPool(4)
    a, b = pool.allocate(2)
    assert pool.register(a, b"h" * 16, b"t")
    assert not pool.register(b, b"h" * 16, b"t")  # same content computed twice
    pool.decref([b, a])
    assert pool.free_queue() == [2, 3, b, a]
    assert pool.lookup(b"h" * 16, b"t") == a
    assert pool.lookup(b"h" * 16, b"other") is None and pool.num_collisions == 1
    pool.check_integrity()
    assert pool.reset_prefix_cache() == 1
    assert pool.lookup(b"h" * 16, b"t") is None
    pool.check_integrity()
