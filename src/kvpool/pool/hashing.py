"""Chained block hashes for prefix caching.

A full block's hash is H(parent hash || the block's token ids || extra keys). The first
block's parent is a root hash of the cache descriptor and the tenant salt, so a different
model version, layout or tenant changes every hash down the chain. Token ids are hashed in
a fixed binary layout (little-endian uint32), never a pickle, so hashes are stable across
processes and machines. xxh3_128 is the default; sha256 is selectable where a
collision-resistant hash matters (multi-tenant caches). Whatever the algorithm, the pool's
prefix index compares what the hash covers on every hit: the parent, the token bytes and
the extra keys (the collision guard, pool/block_pool.py).
"""

from __future__ import annotations

import hashlib
import operator
import sys
from array import array
from collections.abc import Callable, Sequence

import xxhash

# array('I') is the platform's unsigned int; kvpool needs exactly 4 little-endian bytes.
assert array("I").itemsize == 4, "kvpool hashes token ids as 4-byte unsigned ints"
_BIG_ENDIAN = sys.byteorder == "big"
TOKEN_BYTES = 4


def is_int(value: object) -> bool:
    try:
        operator.index(value)  # (numpy's and torch's integers are ints: array("I") takes them)
    except TypeError:
        return False
    return True


def as_count(what: str, value: object) -> int:
    """A count or size as a Python int (numpy's and torch's integers are: `__index__`; a bool
    or a float is no count): TypeError naming `what`, the type and the value otherwise."""
    if value.__class__ is int:
        return value  # type: ignore[return-value]
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        raise TypeError(f"{what} must be an int, got {type(value).__name__} {value!r}")
    return value.__index__()  # type: ignore[union-attr]


def token_bytes(token_ids: Sequence[int]) -> bytes:
    """Token ids as little-endian uint32 bytes (ValueError for ids outside [0, 2**32)). An
    `array("I")` (a cache's own token ids, `token_array`) is that layout already: its bytes,
    one copy, no id converted."""
    if type(token_ids) is array and token_ids.typecode == "I":
        if _BIG_ENDIAN:
            swapped = array("I", token_ids)
            swapped.byteswap()
            return swapped.tobytes()
        return token_ids.tobytes()
    try:
        packed = array("I", token_ids)
    except OverflowError:
        bad = next(t for t in token_ids if not 0 <= t < 2**32)
        raise ValueError(f"token id {bad} is outside [0, 2**32)") from None
    except TypeError:  # (array's message names neither the id nor what it is)
        bad = next((t for t in token_ids if not is_int(t)), None)
        if bad is None:
            raise
        raise TypeError(f"token id {bad!r} is no int") from None
    if _BIG_ENDIAN:
        packed.byteswap()
    return packed.tobytes()


def token_array(packed: bytes) -> array[int]:
    """The ids `token_bytes` packed, as a growable `array("I")`: one copy of the bytes, no
    int object made or touched (a request's token ids as the cache keeps them: 4 bytes a
    token, freed as one buffer). ValueError for bytes that are no whole number of ids."""
    if len(packed) % TOKEN_BYTES:
        raise ValueError(f"{len(packed)} bytes are not whole {TOKEN_BYTES}-byte token ids")
    ids = array("I", packed)
    if _BIG_ENDIAN:
        ids.byteswap()
    return ids


def _sha256(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


HASH_ALGOS: dict[str, Callable[[bytes], bytes]] = {
    "xxh3_128": xxhash.xxh3_128_digest,
    "sha256": _sha256,
}


class BlockHasher:
    """Computes root and chained block hashes with one algorithm."""

    __slots__ = ("algo", "digest")

    def __init__(self, algo: str = "xxh3_128") -> None:
        if algo not in HASH_ALGOS:
            raise ValueError(f"unknown hash algorithm {algo!r}; choose one of {sorted(HASH_ALGOS)}")
        self.algo = algo
        self.digest: Callable[[bytes], bytes] = HASH_ALGOS[algo]

    @staticmethod
    def root_preimage(descriptor_key: bytes, tenant_salt: str = "") -> bytes:
        """The bytes a chain's root stands for: descriptor and tenant salt, length-prefixed
        so that (descriptor, salt) pairs cannot collide by concatenation. ValueError for a
        salt UTF-8 cannot encode (a lone surrogate), TypeError for one that is no str (a
        numeric user id: its bytes would be a choice made here)."""
        if not isinstance(tenant_salt, str):
            raise TypeError(f"tenant salt must be a str, got {type(tenant_salt).__name__} {tenant_salt!r}")
        try:
            salt = tenant_salt.encode()
        except UnicodeEncodeError as error:
            raise ValueError(f"tenant salt {tenant_salt!r} is not valid Unicode text: {error.reason}") from None
        return (
            b"kvpool-root\x00"
            + len(descriptor_key).to_bytes(4, "little")
            + descriptor_key
            + len(salt).to_bytes(4, "little")
            + salt
        )

    def root(self, descriptor_key: bytes, tenant_salt: str = "") -> bytes:
        """The parent hash of a request's first block: descriptor and tenant salt."""
        return self.digest(self.root_preimage(descriptor_key, tenant_salt))

    def chain(self, parent: bytes, block_token_bytes: bytes, extra: bytes = b"") -> bytes:
        """Hash of one full block given its parent's hash.

        The parent digest has a fixed size and a pool's blocks all hold the same number of
        tokens, so `parent || tokens || extra` is unambiguous.
        """
        return self.digest(parent + block_token_bytes + extra)
