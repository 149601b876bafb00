"""The contract every per-request cache manager implements, and what they share.

A cache manager keeps per-request block tables on one BlockPool and the request lifecycle
around them; it never touches a tensor. Two implement it: `HybridCacheManager`
(cache/coordinator.py: any model's layer groups, each reached through the `CacheGroup`
protocol of cache/group.py; `FullAttentionManager`, cache/full.py, is it over one
full-attention group) and `DSV4CacheManager` (cache/dsv4.py: DeepSeek-V4's immutable
Classical pool plus one state block per request). The engine's model runners and the
tests drive them through these methods only.

Lifecycle of a request, and the rules every implementation keeps:

  admit -> (reserve -> [the model writes the reserved positions] -> commit)* -> release
           append_token_ids whenever sampled tokens join the sequence

- Check, then mutate. A call that returns None (out of blocks or state) or raises leaves
  every structure exactly as it was; batched calls (`reserve_step`, `commit_step`) validate
  every request before they change any.
- `append_token_ids` must precede a `reserve` past the known tokens: a reservation covers
  positions whose token ids the manager already has (they are hashed when their block
  completes).
- Only committed positions are readable; a full block is published to the prefix cache
  when its last token is committed.
- A release (finish, cancel, preempt) happens once; a repeat returns False and does nothing.
  A preempted request that is admitted again is counted apart in `stats`, not in the hit rate.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from typing import Any, Protocol

from kvpool.cache.types import (
    RELEASE_REASONS,
    Admission,
    CacheDescriptor,
    CacheUsage,
    MMItem,
    PrefixStats,
    ReleaseReason,
    Reservation,
)
from kvpool.pool import BlockPool, PrefixBlock


class LowerTier(Protocol):
    """A tier below device memory as a cache manager sees it (kvpool.tiers.TierIndex)."""

    def find(self, chain: Sequence[PrefixBlock]) -> int:
        """How many blocks of `chain` (consecutive full blocks of a prompt), from the
        first, the tier holds with a valid descriptor."""
        ...


class CacheManager(ABC):
    """Base of the cache managers. Subclasses keep their requests in `_requests`, objects
    with at least `request_id`, `token_ids`, `num_computed` and `block_ids`."""

    pool: BlockPool
    block_size: int  # tokens one block of `pool` covers

    def __init__(self, pool: BlockPool, block_size: int, descriptor: CacheDescriptor) -> None:
        if not isinstance(descriptor, CacheDescriptor):
            raise TypeError(f"descriptor must be a CacheDescriptor, got {type(descriptor).__name__}")
        self.pool = pool
        self.block_size = block_size
        self.descriptor = descriptor
        self._descriptor_key = descriptor.key()
        self._requests: dict[str, Any] = {}
        self._preempted: set[str] = set()  # released by preemption, not yet admitted again
        self.stats = PrefixStats()

    # ---- the contract ----------------------------------------------------------------

    @abstractmethod
    def lookup_prefix(
        self,
        token_ids: Sequence[int],
        *,
        tenant_salt: str = "",
        mm_items: Sequence[MMItem] = (),
        descriptor: CacheDescriptor | None = None,
    ) -> int:
        """How many tokens of `token_ids` `admit` would find cached now. Changes nothing
        (no counter either)."""

    @abstractmethod
    def admit(
        self,
        request_id: str,
        token_ids: Sequence[int],
        max_new_tokens: int | None = None,
        *,
        tenant_salt: str = "",
        mm_items: Sequence[MMItem] = (),
        descriptor: CacheDescriptor | None = None,
    ) -> Admission | None:
        """Take a request in: its longest cached prefix (full blocks, always leaving at least
        one prompt token to compute, whose logits are needed) and a reservation for the next
        min(max_new_tokens, rest of the prompt) tokens (default: the whole rest). None when
        the pool cannot hold that now; nothing changed. `descriptor` overrides the manager's
        for this request (another adapter, say); a request never hits blocks of another
        descriptor or tenant salt. ValueError for an id in use, an empty prompt, a bad count."""

    @abstractmethod
    def reserve(self, request_id: str, num_new_tokens: int) -> Reservation | None:
        """Room for positions [num_computed, num_computed + num_new_tokens), whose token ids
        must be known. None when it does not fit; nothing changed."""

    @abstractmethod
    def reserve_step(self, request_ids: Sequence[str], num_new_tokens: Sequence[int]) -> bool:
        """`reserve` for a whole step, all or nothing: False (nothing changed) when the step
        does not fit. The engine's path; the details of each reservation are the manager's
        (copies to take, checkpoints to write), queried by the model runner."""

    def append_token_ids(self, request_id: str, token_ids: Iterable[int]) -> None:
        """Sampled tokens join the sequence; a later step computes them."""
        self._get(request_id).token_ids.extend(token_ids)

    @abstractmethod
    def commit(self, request_id: str, num_tokens: int) -> None:
        """The next `num_tokens` reserved positions are written: they become readable, and
        blocks they complete are published for prefix caching."""

    @abstractmethod
    def commit_step(
        self, request_ids: Sequence[str], num_tokens: Sequence[int], next_token_ids: Sequence[int | None]
    ) -> None:
        """`commit` for a whole step, then each request's sampled token joins its sequence
        (None: no token, e.g. a prefill chunk that ends before the prompt does). Validates
        every request first."""

    @abstractmethod
    def fork(self, parent_id: str, child_id: str) -> bool:
        """A child sharing every computed token of the parent. False (nothing changed) when
        the child cannot get the per-request state of its own that it needs."""

    def release(self, request_id: str, reason: ReleaseReason = "finish") -> bool:
        """Free everything the request holds (blocks tail-first, so a chain's tail is evicted
        before its head). False, and nothing done, for a request already released.
        ValueError (and nothing done) for a reason not in RELEASE_REASONS."""
        if reason not in RELEASE_REASONS:
            raise ValueError(f"unknown release reason {reason!r}; one of {RELEASE_REASONS}")
        released = self._release(request_id)
        # `_preempted` stays exact: a preemption marks the request; any other release of it
        # (a cancel of a preempted request that waits, say) clears the mark.
        if reason == "preempt" and released:
            self._preempted.add(request_id)
        elif reason != "preempt":
            self._preempted.discard(request_id)
        return released

    @abstractmethod
    def _release(self, request_id: str) -> bool:
        """The manager's part of `release`: free the request's blocks and state; False when it
        holds none (released already, or never admitted)."""

    @abstractmethod
    def usage(self) -> CacheUsage:
        """Blocks held now, each physical block counted once."""

    @abstractmethod
    def check_integrity(self) -> None:
        """Assert the lifecycle invariants of ARCHITECTURE.md; AssertionError names the broken one."""

    # ---- shared queries and helpers ----------------------------------------------------

    def finish(self, request_id: str) -> bool:
        return self.release(request_id, "finish")

    def cancel(self, request_id: str) -> bool:
        return self.release(request_id, "cancel")

    def preempt(self, request_id: str) -> bool:
        """Release everything; the engine admits the request again later and recomputes."""
        return self.release(request_id, "preempt")

    @property
    def enable_prefix_caching(self) -> bool:
        return self.pool.enable_caching

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def request_ids(self) -> list[str]:
        return list(self._requests)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._requests

    def block_ids(self, request_id: str) -> list[int]:
        return list(self._get(request_id).block_ids)

    def token_ids(self, request_id: str) -> list[int]:
        return list(self._get(request_id).token_ids)

    def num_tokens(self, request_id: str) -> int:
        return len(self._get(request_id).token_ids)

    def num_computed_tokens(self, request_id: str) -> int:
        return self._get(request_id).num_computed

    def _get(self, request_id: str) -> Any:
        try:
            return self._requests[request_id]
        except KeyError:
            raise KeyError(f"unknown request {request_id!r}") from None

    def _step_requests(
        self,
        request_ids: Sequence[str],
        num_tokens: Sequence[int],
        next_token_ids: Sequence[int | None] | None = None,
    ) -> list[Any]:
        """A step's requests, in order, once its lists agree in length (`next_token_ids`: a
        commit's) and name no request twice; ValueError otherwise, KeyError for an unknown id."""
        if next_token_ids is None and len(request_ids) != len(num_tokens):
            raise ValueError(f"{len(request_ids)} requests but {len(num_tokens)} token counts")
        if next_token_ids is not None and not len(request_ids) == len(num_tokens) == len(next_token_ids):
            raise ValueError(
                f"{len(request_ids)} requests, {len(num_tokens)} token counts, {len(next_token_ids)} next tokens"
            )
        if len(set(request_ids)) != len(request_ids):
            raise ValueError(f"a request appears twice in {list(request_ids)}")
        try:
            return list(map(self._requests.__getitem__, request_ids))  # (the engine's path: once per step)
        except KeyError as missing:
            raise KeyError(f"unknown request {missing.args[0]!r}") from None

    def _root(self, tenant_salt: str, descriptor: CacheDescriptor | None) -> PrefixBlock:
        if descriptor is None:
            return self.pool.root(self._descriptor_key, tenant_salt)
        if not isinstance(descriptor, CacheDescriptor):
            raise TypeError(f"descriptor must be a CacheDescriptor, got {type(descriptor).__name__}")
        return self.pool.root(descriptor.key(), tenant_salt)

    def _check_new(self, request_id: str, token_ids: Sequence[int], max_new_tokens: int | None) -> None:
        if request_id in self._requests:
            raise ValueError(f"request {request_id!r} is already admitted")
        if len(token_ids) == 0:
            raise ValueError(f"request {request_id!r} has an empty prompt")
        if max_new_tokens is not None and max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")

    def _count_admission(self, request_id: str, num_prompt_tokens: int, num_cached_tokens: int) -> None:
        stats = self.stats
        if request_id in self._preempted:
            self._preempted.discard(request_id)
            stats.num_readmissions += 1
            stats.num_readmitted_hit_tokens += num_cached_tokens
        else:
            stats.num_requests += 1
            stats.num_queried_tokens += num_prompt_tokens
            stats.num_hit_tokens += num_cached_tokens


def mm_extra_key(mm_items: Sequence[MMItem], block_size: int, block_index: int) -> bytes:
    """Extra hash key of one block: for every multimodal item that overlaps it, the item's
    identity and its offset relative to the block's first position (negative when it started
    in an earlier block). Two prompts with the same placeholder tokens and the same images
    placed differently inside a block get different keys. b"" when no item overlaps."""
    lo = block_index * block_size
    hi = lo + block_size
    parts = [
        [item.content_hash, item.start - lo] for item in mm_items if item.start < hi and lo < item.start + item.length
    ]
    # JSON: an identity may hold any character and still not run into the next item's
    return b"mm" + json.dumps(parts, separators=(",", ":")).encode() if parts else b""


def check_mm_items(mm_items: Sequence[MMItem], num_tokens: int) -> tuple[MMItem, ...]:
    items = tuple(MMItem(*item) for item in mm_items)
    for item in items:
        if item.start < 0 or item.length <= 0 or item.start + item.length > num_tokens:
            raise ValueError(f"multimodal item {item} lies outside the prompt of {num_tokens} tokens")
    return items
