"""The descriptor bound to every block that leaves device memory, and the content keys
tiers file blocks under (seed 003's correctness contract; ARCHITECTURE.md).

A block's `BlockDescriptor` holds everything its bytes depend on: its exact token ids and
the computed-token count it ends at, the content keys of its own prefix and of its parent
(the chained hash), the model and weights version, the tokenizer and prompt-template
versions, the adapter, its multimodal identity (the block's extra hash key), the RoPE /
position configuration, the layer / head / block / shard layout with the storage dtype
(`layout_id`), and the tenant boundary (a digest of the tenant salt, never the salt
itself). It serializes to JSON, so the disk and Redis tiers store it beside the tensors.

Content keys. The device pool's chained hash starts from a root of the whole cache
descriptor, so a block of other weights could never even be found under it; a tier keys
blocks by their content alone (the tenant, then the chain of token ids and extra keys)
and checks the rest of the descriptor field by field. A block written with another
tokenizer, template or adapter is then found, refused, counted under the fields that
differ (`template_version`, say) and reclaimed: a superseded block is not kept forever.
The disk and Redis tiers file a block under its model, weights and layout too
(entry.namespace): two engines of other weights keep their blocks side by side.

    root key   = xxh3_128("kvpool-content" || len(salt) || salt)
    key(i)     = xxh3_128(key(i - 1) || token ids of block i (uint32 LE) || extra key of block i)

A hit is accepted only if its descriptor names the expected parent key and token ids as
well, so by induction the whole prefix is what the key covers (the pool's collision guard,
for tiers).

Pure Python: no torch.
"""

from __future__ import annotations

import json
import struct
import weakref
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, fields

import xxhash

from kvpool.cache.types import CacheDescriptor
from kvpool.pool import PrefixBlock

_ROOT_MAGIC = b"kvpool-root\x00"  # pool/hashing.py's root preimage: magic, descriptor key, salt
_CONTENT_MAGIC = b"kvpool-content\x00"


@dataclass(frozen=True)
class BlockDescriptor:
    content_key: str  # hex: this block's content key (its whole prefix)
    parent_key: str  # hex: the previous block's content key (the root key for block 0)
    num_computed_tokens: int  # the position the block ends at: index x block size + its tokens
    token_ids: tuple[int, ...]  # the block's own tokens
    mm_identity: str  # hex of the block's extra hash key (multimodal placement); "" for none
    tenant: str  # xxh3_64 hex of the tenant salt
    model_id: str
    weights_version: str
    tokenizer_version: str
    template_version: str
    adapter_id: str
    rope_id: str
    layout_id: str  # layers, heads, head dim, block size, storage layout, dtype, shard

    def mismatches(self, expected: BlockDescriptor) -> list[str]:
        """The fields in which this (stored) descriptor differs from `expected`, in order."""
        return [f.name for f in fields(self) if getattr(self, f.name) != getattr(expected, f.name)]

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> BlockDescriptor:
        """The inverse of `to_json`; ValueError naming what is wrong with a bad one."""
        try:
            data = json.loads(text)
        except json.JSONDecodeError as error:
            raise ValueError(f"block descriptor is not JSON: {error}") from None
        names = {f.name for f in fields(cls)}
        if not isinstance(data, dict) or set(data) != names:
            got = sorted(data) if isinstance(data, dict) else type(data).__name__
            raise ValueError(f"block descriptor must have exactly the fields {sorted(names)}, got {got}")
        for name, value in data.items():
            if name == "token_ids":
                ok, want = isinstance(value, list) and all(_is_int(t) for t in value), "a list of ints"
            elif name == "num_computed_tokens":
                ok, want = _is_int(value) and value >= 0, "an int >= 0"
            else:
                ok, want = isinstance(value, str), "a string"
            if not ok:  # (another writer's bug: `kvpool cache stats` sliced weights_version)
                raise ValueError(f"block descriptor field {name} must be {want}, got {value!r}")
        data["token_ids"] = tuple(data["token_ids"])
        return cls(**data)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def descriptor_from_key(key: bytes) -> CacheDescriptor:
    """The CacheDescriptor whose `key()` is `key` (the inverse of CacheDescriptor.key)."""
    return CacheDescriptor(**json.loads(key))


def _parse_root(root: PrefixBlock) -> tuple[CacheDescriptor, str]:
    """(descriptor, tenant salt) a chain's root stands for, read back from its preimage."""
    preimage = root.token_bytes
    if not preimage.startswith(_ROOT_MAGIC):
        raise ValueError(f"{root!r} is not a chain root")
    at = len(_ROOT_MAGIC)
    (n,) = struct.unpack_from("<I", preimage, at)
    descriptor = descriptor_from_key(preimage[at + 4 : at + 4 + n])
    at += 4 + n
    (m,) = struct.unpack_from("<I", preimage, at)
    return descriptor, preimage[at + 4 : at + 4 + m].decode()


@dataclass(frozen=True)
class _Described:
    key: bytes
    index: int  # the block's index in its chain (0: the first block after the root)
    root: PrefixBlock


class TierIndex:
    """A tier seen from a cache manager: content keys and descriptors of prefix blocks,
    and the longest run of blocks a tier holds valid (`find`). Keys are memoized on the
    prefix blocks (weakly: a block the pool forgets takes its memo with it)."""

    def __init__(self, tier, block_size: int) -> None:
        self.tier = tier
        self.block_size = block_size
        self._memo: weakref.WeakKeyDictionary[PrefixBlock, _Described] = weakref.WeakKeyDictionary()
        self._roots: weakref.WeakKeyDictionary[PrefixBlock, tuple[CacheDescriptor, str, bytes]] = (
            weakref.WeakKeyDictionary()
        )

    def _root(self, root: PrefixBlock) -> tuple[CacheDescriptor, str, bytes]:
        found = self._roots.get(root)
        if found is None:
            descriptor, salt = _parse_root(root)
            salt_bytes = salt.encode()
            key = xxhash.xxh3_128_digest(_CONTENT_MAGIC + len(salt_bytes).to_bytes(4, "little") + salt_bytes)
            found = self._roots[root] = (descriptor, salt, key)
        return found

    def _described(self, block: PrefixBlock) -> _Described:
        """Content key and chain index of `block`, computed down from the nearest memoized
        ancestor (or the root)."""
        path: list[PrefixBlock] = []
        node = block
        while node.parent is not None and node not in self._memo:
            path.append(node)
            node = node.parent
        if node.parent is None:
            key, index, root = self._root(node)[2], -1, node
        else:
            known = self._memo[node]
            key, index, root = known.key, known.index, known.root
        for node in reversed(path):
            key = xxhash.xxh3_128_digest(key + node.token_bytes + node.extra)
            index += 1
            self._memo[node] = _Described(key, index, root)
        return self._memo[block]

    def describe(self, block: PrefixBlock) -> tuple[bytes, BlockDescriptor]:
        """(content key, descriptor) of a full block of a prefix chain."""
        described = self._described(block)
        assert block.parent is not None
        parent_key = self._root(described.root)[2] if block.parent.parent is None else self._described(block.parent).key
        cache, salt, _ = self._root(described.root)
        count = len(block.token_bytes) // 4
        descriptor = BlockDescriptor(
            content_key=described.key.hex(),
            parent_key=parent_key.hex(),
            num_computed_tokens=described.index * self.block_size + count,  # (a swapped tail block is partial)
            token_ids=struct.unpack(f"<{count}I", block.token_bytes),
            mm_identity=block.extra.hex(),
            tenant=xxhash.xxh3_64_hexdigest(salt.encode()),
            **asdict(cache),  # the model, weights, tokenizer, template, adapter, RoPE and layout
        )
        return described.key, descriptor

    def find(self, chain: Sequence[PrefixBlock]) -> int:
        """How many blocks of `chain` (consecutive full blocks of a prompt), from the first,
        the tier holds with a valid descriptor."""
        lookup: Callable[[bytes, BlockDescriptor], bool] = self.tier.lookup
        for i, block in enumerate(chain):
            if not lookup(*self.describe(block)):
                return i
        return len(chain)
