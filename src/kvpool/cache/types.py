"""Value types of the cache layer: the descriptor, and what the managers' calls return."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Literal, NamedTuple, get_args

if TYPE_CHECKING:
    from kvpool.pool.block_pool import MatchMemo

ReleaseReason = Literal["finish", "cancel", "preempt"]
RELEASE_REASONS: tuple[str, ...] = get_args(ReleaseReason)


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

    def __post_init__(self) -> None:
        # every field is text: CacheDescriptor(5) or (None) was taken, a descriptor whose key
        # differed from "5"'s and ""'s (no false hit, but not the descriptor anyone meant)
        for name, value in asdict(self).items():
            if not isinstance(value, str):
                raise TypeError(f"CacheDescriptor's {name} must be a str, got {value!r} ({type(value).__name__})")

    def key(self) -> bytes:
        """A canonical byte string of all fields (sorted JSON: stable across processes)."""
        return json.dumps(asdict(self), sort_keys=True, separators=(",", ":")).encode()


class MMItem(NamedTuple):
    """A multimodal input occupying token positions [start, start + length)."""

    start: int
    length: int
    content_hash: str


class LookupPrompt(NamedTuple):
    """A prompt checked and packed once, for lookups in several caches (the router asks
    every replica, then the admission in the replica it chose; `pack_prompt` builds it).
    The packing is the whole prompt's and is the same bytes in every cache (token ids as
    little-endian uint32), so one serves them all. Each cache chains the hashes from its
    own roots; where two caches' roots hash alike (same descriptor, tenant salt, algorithm
    and block width) the chained hashes are alike too, and `hashes` keeps them
    (`BlockPool.match`'s memo; None: none kept). Treat it as the pools' memo: read it, never
    fill it by hand."""

    token_ids: Sequence[int]  # a list, or a CheckedPrompt's tuple
    mm_items: tuple[MMItem, ...]
    packed: bytes  # token_bytes(token_ids)
    hashes: MatchMemo | None = None


# `CheckedPrompt`'s construction key: only `pack_prompt` (cache/coordinator.py) and the
# simulator's `turn_prompt`, which check or pack the ids themselves, pass it. A prompt the
# engine trusts without reading its ids must not be built by hand: its bytes could hold
# other ids than its tuple (blocks cached under the wrong prefix), or its ids could be no
# Python ints or outside the vocabulary.
_CHECKED_KEY = object()


class CheckedPrompt(LookupPrompt):
    """`pack_prompt`'s LookupPrompt (and the simulator's `turn_prompt`'s, packed the same
    way): its ids a tuple of Python ints, checked when it was packed. A tuple cannot change,
    so its ids stay the ids `packed` holds, and no caller's later change to the list it was
    made from reaches it: the engine's add_request takes it without reading the ids again
    (an id's int is a likely cache miss in a fleet run, and packing them again to compare
    cost more than the rest of the call). `turn_prompt`'s ids are a list instead, handed
    over: its caller reads it no more, and the one engine given it keeps it as the request's
    token list (no copy of a long chat history each turn). A LookupPrompt built any other way (its list may
    have changed after packing) is checked. Only those two functions make one (TypeError
    otherwise); `_replace`, `_make`, copy and pickle give a plain LookupPrompt, which the
    engine checks."""

    __slots__ = ()

    def __new__(
        cls,
        token_ids: Sequence[int],
        mm_items: tuple[MMItem, ...],
        packed: bytes,
        hashes: MatchMemo | None = None,
        *,
        key: object = None,
    ) -> CheckedPrompt:
        if key is not _CHECKED_KEY:
            raise TypeError(
                "a CheckedPrompt is made only by pack_prompt (its ids checked and packed there); "
                "build a LookupPrompt instead, which the engine checks"
            )
        return tuple.__new__(cls, (token_ids, mm_items, packed, hashes))

    @classmethod
    def _make(cls, iterable: Any) -> LookupPrompt:  # type: ignore[override]
        # (namedtuple's _make calls tuple.__new__ directly, past the key)
        return LookupPrompt._make(iterable)

    def _replace(self, **changes: Any) -> LookupPrompt:  # type: ignore[override]
        return LookupPrompt(*self)._replace(**changes)

    def __reduce__(self) -> tuple[Any, ...]:
        # copy and pickle rebuild a plain LookupPrompt: a copy the engine checks again
        # (an unpickled one may come from anywhere)
        return (LookupPrompt, tuple(self))


class BlockCopy(NamedTuple):
    """Copy-on-write: copy block `src` into `dst` before writing into `dst`."""

    src: int
    dst: int


@dataclass(frozen=True)
class StateRestore:
    """How the runner rebuilds a request's state (a recurrent state, V4's state block)
    before its first step.

    method "none": a fresh state, computed from token 0. "checkpoint": copy
    `checkpoint_slot` into `state_slot`. "recompute": replay tokens
    [replay_start, num_cached_tokens) on top of the cached blocks. "adopt" (V4): the
    state slot is a kept turn-end state that holds the hit's state already: neither reset
    nor copied. "swap" (V4): the runner wrote the state slot from a swapped-out request's
    tier entry (engine/tier_bridge.py `swap_in`): nothing left to run. `whole` (V4, a
    "checkpoint"): the checkpoint is a spilled turn end's, a whole state block off the span
    grid (the copy moves the whole block: the simulator's executor prices it so).
    """

    state_slot: int
    method: Literal["none", "checkpoint", "recompute", "adopt", "swap"]
    checkpoint_slot: int | None = None
    replay_start: int = 0
    whole: bool = False


class GroupReservation(NamedTuple):
    """One group's part of a step's reservation (`CacheGroup.apply_reserve`)."""

    new_block_ids: tuple[int, ...] = ()  # blocks appended to the group's table
    copies: tuple[BlockCopy, ...] = ()  # copy-on-write: each dst replaced its src in the table in place
    checkpoints: tuple[tuple[int, int], ...] = ()  # (position, slot): snapshot the state there


NO_RESERVATION = GroupReservation()  # a group's part of a step that took nothing


class GroupAdmission(NamedTuple):
    """One group's part of an admission: its table, the copies and the state restore to
    apply before the first step."""

    block_ids: tuple[int, ...]  # the group's table after admission (logical blocks [first_block, ...))
    first_block: int = 0
    copies: tuple[BlockCopy, ...] = ()
    restore: StateRestore | None = None  # groups with per-request state only
    checkpoints: tuple[tuple[int, int], ...] = ()  # of the first step
    loads: tuple[tuple[int, Any], ...] = ()  # (fresh block, prefix block) a lower tier loads (`complete_loads`)


class Admission(NamedTuple):
    """A request taken in: its cached prefix, its first step's reservation, and each group's
    part of both (`groups`: group name -> its table, copies, restore, checkpoints, loads)."""

    num_cached_tokens: int  # tokens [0, num_cached) already computed (prefix-cache hit)
    num_scheduled_tokens: int  # tokens [num_cached, num_cached + n) reserved for the first step
    groups: Mapping[str, GroupAdmission]


class Reservation(NamedTuple):
    """Room for positions [start, start + num_tokens) of one request, and each group's part
    (`groups`: group name -> its new blocks, copies, checkpoints)."""

    start: int
    num_tokens: int
    groups: Mapping[str, GroupReservation]


@dataclass
class PrefixStats:
    """Prefix-cache counters over first admissions. A request re-admitted after preemption
    hits its own blocks again: those hits are counted apart, not in the hit rate. An
    admission the caller gives up to retry (`give_up_admission`) is taken back at its
    release, and a request released to be recomputed after a step's fault
    (`will_recompute`) counts nothing when admitted again: each request counts once."""

    num_requests: int = 0
    num_queried_tokens: int = 0  # prompt tokens looked up at first admission
    num_hit_tokens: int = 0  # of those, found in the cache
    num_readmissions: int = 0  # admissions after a preemption
    num_readmitted_hit_tokens: int = 0  # tokens a readmission found cached (recompute saved)
    num_lower_tier_hit_tokens: int = 0  # of the hits (first admissions and readmissions), loaded from a lower tier

    @property
    def hit_rate(self) -> float:
        return self.num_hit_tokens / self.num_queried_tokens if self.num_queried_tokens else 0.0


class CacheUsage(NamedTuple):
    """What a manager holds now, each physical block counted once however many share it."""

    num_blocks: int
    num_free_blocks: int  # allocatable now (cached free blocks included)
    num_held_blocks: int  # distinct blocks some request holds
    num_filled_slots: int  # slots of the held blocks that hold a committed token
    block_size: int  # tokens per block (V4: the classical block's span)
    num_state_blocks: int = 0  # per-request state blocks (V4), all
    num_free_state_blocks: int = 0

    @property
    def fragmentation(self) -> float:
        """1 - useful / allocated slots of the held blocks (0 when nothing is held)."""
        slots = self.num_held_blocks * self.block_size
        return 1 - self.num_filled_slots / slots if slots else 0.0
