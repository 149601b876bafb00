"""Value types of the cache layer: the descriptor, and what its calls return."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import NamedTuple


@dataclass(frozen=True)
class CacheDescriptor:
    """Everything a cached block's bytes depend on besides its tokens (seed 003).

    `layout_id` names the layer / head / block / shard layout, the storage dtype and the
    quantization schema; `rope_id` the RoPE and position configuration. The tenant salt is
    per request (`admit(..., tenant_salt=)`). Two descriptors that differ in any field never
    share a block.
    """

    model_id: str
    weights_version: str = ""
    tokenizer_version: str = ""
    template_version: str = ""
    adapter_id: str = ""
    layout_id: str = ""
    rope_id: str = ""

    def key(self) -> bytes:
        """A canonical byte string of all fields (sorted JSON: stable across processes)."""
        return json.dumps(asdict(self), sort_keys=True, separators=(",", ":")).encode()


class MMItem(NamedTuple):
    """A multimodal input occupying token positions [start, start + length)."""

    start: int
    length: int
    content_hash: str


class Admission(NamedTuple):
    num_cached_tokens: int  # tokens whose KV came from the prefix cache
    num_new_blocks: int  # blocks allocated for the tokens reserved beyond the hit


class BlockCopy(NamedTuple):
    """Copy-on-write: copy block `src` into `dst` before writing into `dst`."""

    src: int
    dst: int


class Reservation(NamedTuple):
    new_block_ids: list[int]
    copies: list[BlockCopy]


@dataclass
class PrefixStats:
    num_queried_tokens: int = 0  # prompt tokens looked up at admission
    num_hit_tokens: int = 0  # of those, found in the cache

    @property
    def hit_rate(self) -> float:
        return self.num_hit_tokens / self.num_queried_tokens if self.num_queried_tokens else 0.0
