"""The contract between the coordinator (cache/coordinator.py) and one layer group. No torch.

A group is the layers of a model that share one kind of cache: an attention group's
block tables (cache/window.py), a recurrent group's live state and checkpoints
(cache/recurrent.py), V4's classical blocks plus a state block (cache/dual_pool.py). The
coordinator keeps one token history and one computed count per request and reaches every
group through the calls below only; it never asks what kind a group is. A new kind of
layer is a new class that satisfies `CacheGroup` and a spec with a `build` method.

Per request the coordinator holds one opaque *state* per group (what `apply_admit` and
`fork` return) and passes it back on every call; a group keeps no per-request dict of its
own. Positions follow one convention everywhere: the request has `num_computed` tokens
computed and reserves [num_computed, end) for its next step.

Transactions (STYLE 5). The coordinator asks every group first (`plan_admit`,
`blocks_needed`, `can_fork`: these change nothing) and sums the free blocks they need per
pool; only when every pool has them does it call the mutating half (`claim`,
`apply_admit`, `apply_reserve`, `fork`), which then must not fail. So a refusal (an
admission or a step that does not fit) leaves every group exactly as it was. Optional
extras (a recurrent group's checkpoint slots) are taken inside `apply_reserve` from what
is left and never refuse a step.

Hits. `hits` looks a prompt up (read-only); `upper_bound`, `extra_points` and `serves`
answer questions about that result, and the coordinator takes the largest point every
group serves (cache/coordinator.py explains the search).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, NamedTuple, Protocol

from kvpool.cache.types import BlockCopy, GroupReservation, MMItem, StateRestore
from kvpool.pool import BlockPool, PrefixBlock


def check_pool_size(name: str, size: object) -> int:
    """A group's own pool size, a positive int; ValueError naming the group otherwise."""
    if size is None:
        raise ValueError(
            f"group {name!r} has no pool size: None draws from the shared pool, which only attention "
            f"groups can, and only with shared_blocks"
        )
    if isinstance(size, tuple):
        raise ValueError(f"group {name!r}: a pair of pool sizes is for a dual-pool group only, got {size}")
    if not isinstance(size, int) or size <= 0:
        raise ValueError(f"group {name!r}: its pool size must be a positive int, got {size!r}")
    return size


class GroupUsage(NamedTuple):
    """What one group's requests hold now (`CacheGroup.usage`)."""

    num_held_blocks: int  # distinct table blocks some request holds
    num_filled_slots: int  # of their token slots, those holding a committed token
    num_state_blocks: int = 0  # per-request state blocks / slots of the group, all
    num_free_state_blocks: int = 0


class CacheGroup(Protocol):
    """One layer group as the coordinator drives it. `state` below is what this group's
    `apply_admit` / `fork` returned for the request."""

    name: str  # unique within a model; also the group's key in every per-group result
    # "attention" | "recurrent" | "dual_pool": a label for callers that own per-kind tensors
    # (the runners) to pick their groups, and for the coordinator's default group of a
    # query that names none; no call of the coordinator branches on it
    kind: str
    pool: BlockPool  # the pool `blocks_needed` counts against (a shared pool for some attention groups)
    granularity: int  # tokens of one hash unit: block size, checkpoint interval, span
    reads_whole_prefix: bool  # a point needs every unit before it: its hits end at the first miss
    has_table: bool  # keeps block tables (`block_ids`); False: only per-request state
    has_state: bool  # keeps a per-request state block or slot (`state_slot`, `restore`)

    def pools(self) -> tuple[BlockPool, ...]:
        """Every pool the group draws from, `pool` first (the dual pool: classical, state)."""
        ...

    # ---- prefix hits (read-only) --------------------------------------------------------

    def hits(self, root: PrefixBlock, token_ids: list[int], mm_items: tuple[MMItem, ...], limit: int | None) -> Any:
        """What the group's cache holds of the prompt, looking no further than `limit` tokens
        (another group's `upper_bound`) when given. Changes nothing, not even a counter."""
        ...

    def upper_bound(self, hits: Any) -> int:
        """No point above this is served (lets the coordinator skip hopeless points)."""
        ...

    def extra_points(self, hits: Any) -> list[int]:
        """Points off the group's `granularity` grid it can serve (a turn end)."""
        ...

    def serves(self, hits: Any, point: int) -> bool:
        """Whether a request can resume after `point` cached tokens in this group."""
        ...

    # ---- admission ----------------------------------------------------------------------

    def plan_admit(
        self,
        hits: Any | None,
        root: PrefixBlock,
        token_ids: list[int],
        mm_items: tuple[MMItem, ...],
        point: int,
        end: int,
    ) -> tuple[Any, dict[BlockPool, int]]:
        """(a plan, free blocks it needs per pool) for a hit at `point` (one `serves`
        accepted; hits None: caching is off and point is 0) and a first step [point, end).
        Changes nothing; blocks of the hit that sit in the free queue count as needed."""
        ...

    def claim(self, plan: Any) -> None:
        """Hold the plan's hit (refcounts). Called for every group before any group's
        `apply_admit`, so no allocation can evict another group's hit."""
        ...

    def apply_admit(self, plan: Any, root: PrefixBlock) -> tuple[Any, tuple[BlockCopy, ...]]:
        """After `claim`: take the plan's fresh blocks; (the request's state, the copies
        the admission queued). Never fails: the coordinator checked the free counts."""
        ...

    # ---- steps --------------------------------------------------------------------------

    def blocks_needed(self, state: Any, num_computed: int, end: int) -> int:
        """Free blocks of `pool` a step [num_computed, end) takes. Changes nothing."""
        ...

    def apply_reserve(
        self, state: Any, token_ids: list[int], mm_items: tuple[MMItem, ...], num_computed: int, end: int
    ) -> GroupReservation:
        """Take the step's blocks (exactly `blocks_needed`; never fails) and any optional
        extras from what is left; the new blocks, queued copies and checkpoint slots."""
        ...

    def commit(self, state: Any, token_ids: list[int], num_computed: int, mm_items: tuple[MMItem, ...]) -> None:
        """The reserved step is written: tokens [.., num_computed) are computed. Publish
        what they complete, let go of what no later step reads. Never fails."""
        ...

    def take_copies(self) -> list[BlockCopy]:
        """Copies queued since the last call (apply them in order before the next forward);
        a copy into a block nobody holds any more is dropped. [] for a group that never copies."""
        ...

    # ---- queries on a request's state ---------------------------------------------------

    def block_ids(self, state: Any) -> list[int]:
        """The request's table (logical blocks [first_block, ...)); [] without a table."""
        ...

    def first_block(self, state: Any) -> int:
        """The logical index of block_ids[0] (> 0 once blocks left a window)."""
        ...

    def held_blocks(self, state: Any) -> list[int]:
        """Every block of `pool` the request holds (table, copy sources, slots)."""
        ...

    def state_slot(self, state: Any) -> int | None:
        """The request's live state block / slot; None for a group without one."""
        ...

    def restore(self, state: Any) -> StateRestore | None:
        """How the runner rebuilds the request's state before its first step ("none" once
        done or for a fresh state); None for a group without per-request state."""
        ...

    def checkpoints(self, state: Any) -> list[tuple[int, int]]:
        """(position b, slot) of the reserved step: snapshot the state after b tokens there."""
        ...

    # ---- turn ends, fork, release -------------------------------------------------------

    def mark_turn_end(
        self, state: Any, token_ids: list[int], mm_items: tuple[MMItem, ...], num_computed: int
    ) -> int | None:
        """A slot to copy the live state into now, filed as a turn-end checkpoint; None
        when the group keeps none (nothing changed)."""
        ...

    def keep_turn_end(self, state: Any, token_ids: list[int], mm_items: tuple[MMItem, ...], num_computed: int) -> bool:
        """At a finish with no step pending: keep what the request holds at its turn end
        findable; False (nothing changed) when there is nothing to keep."""
        ...

    def can_fork(self) -> bool:
        """Whether `fork` would find what a child needs of its own (a state block). Changes nothing."""
        ...

    def fork(self, state: Any) -> Any:
        """A child's state sharing the parent's computed blocks (no step is pending); after
        `can_fork` said yes, never fails."""
        ...

    def release(self, state: Any) -> None:
        """Let go of everything the request holds (tables tail-first). Called once."""
        ...

    # ---- invariants and figures ---------------------------------------------------------

    def usage(self, states: Iterable[tuple[Any, int]]) -> GroupUsage:
        """What the requests hold, given (state, num_computed) of each."""
        ...

    def check_state(
        self, rid: str, state: Any, token_ids: list[int], num_computed: int, end: int, holders: list[int]
    ) -> None:
        """Assert one request's invariants; add 1 to `holders[b]` for each block of `pool`
        it holds (the coordinator checks refcount == holders per pool)."""
        ...

    def check_holders(self, holders: list[int]) -> None:
        """Assert `pool`'s integrity and refcount == holders (once per pool)."""
        ...

    def check_states(self, states: dict[str, Any]) -> None:
        """Assert what spans every request of the group (a dual pool's state blocks)."""
        ...
