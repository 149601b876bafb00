"""The contract between the coordinator (cache/coordinator.py) and one layer group. No torch.

A group is the layers of a model that share one kind of cache: block tables
(cache/window.py), a recurrent state and its checkpoints (cache/recurrent.py), V4's
classical blocks plus a state block (cache/dual_pool.py). The coordinator reaches every
group through `CacheGroup` only, never asking its kind; a new kind of layer is a class
that satisfies `CacheGroup` and a spec with a `build` method (cache/chains.py holds the
prefix-chain code the groups share).

Per request the coordinator holds one opaque *state* per group (what `apply_admit` and
`fork` return) and passes it back on every call. The request has `num_computed` tokens
computed and reserves [num_computed, end) for its next step. The step calls
(`blocks_needed`, `apply_reserve`, `commit`) are batched over the step's requests
(`StepRequest`): one call per group per step, not one per request.

Transactions (STYLE 5). The coordinator asks every group the read-only half first
(`plan_admit`, `blocks_needed`, `can_fork`) and sums the free blocks they need per pool;
only when every pool has them does it call the mutating half (`claim`, `apply_admit`,
`apply_reserve`, `fork`), which then must not fail. So a refusal leaves every group as it
was. Optional extras (checkpoint slots) are taken inside `apply_reserve` from what is
left and never refuse a step.

Hits. `hits` looks a prompt up (read-only); `upper_bound`, `extra_points` and `serves`
answer questions about that result; the coordinator takes the largest point every group
serves.
"""

from __future__ import annotations

from array import array
from collections.abc import Hashable, Iterable, Sequence
from typing import Any, NamedTuple, Protocol

from kvpool.cache.types import NO_RESERVATION, BlockCopy, GroupReservation, LookupPrompt, MMItem, StateRestore
from kvpool.pool import BlockPool, PrefixBlock
from kvpool.pool.hashing import as_count


class LowerTier(Protocol):
    """A tier below device memory as a cache manager sees it (kvpool.tiers.TierIndex)."""

    def find(self, chain: Sequence[PrefixBlock]) -> int:
        """How many blocks of `chain` (consecutive full blocks of a prompt), from the
        first, the tier holds with a valid descriptor."""
        ...


def check_int_fields(spec: Any, *fields: str) -> None:
    """A frozen spec's counts are ints (numpy's become Python ints; a bool or a float is no
    count): TypeError naming the group and the field, before any range check. A float
    block size or window failed deep in the first admission ('slice indices must be
    integers'), and a bool passed as 1."""
    for what in fields:
        value = getattr(spec, what)
        if value.__class__ is not int:
            object.__setattr__(spec, what, as_count(f"group {spec.name!r}: {what}", value))


def check_pool_size(name: str, size: object) -> int:
    """A group's own pool size, a positive int; ValueError naming the group otherwise."""
    if size is None:
        raise ValueError(
            f"group {name!r} has no pool size: None draws from the shared pool, which only attention "
            f"groups can, and only with shared_blocks"
        )
    if isinstance(size, tuple):
        raise ValueError(f"group {name!r}: a pair of pool sizes is for a dual-pool group only, got {size}")
    if size.__class__ is not int and not isinstance(size, bool) and hasattr(size, "__index__"):
        size = size.__index__()  # (numpy's ints: "must be a positive int, got 8" named none of them)
    if not isinstance(size, int) or isinstance(size, bool) or size <= 0:
        raise ValueError(f"group {name!r}: its pool size must be a positive int, got {size!r}")
    return size


class StepRequest(Protocol):
    """A request as a group's step calls see it (the coordinator's request record). Read it,
    never change it; `token_ids` is an array("I") (`token_bytes` of a slice is its packing),
    or the caller's list where it was admitted with share_ids (a slice is packed then)."""

    request_id: str
    token_ids: array[int] | list[int]
    mm_items: tuple[MMItem, ...]
    num_computed: int
    states: dict[str, Any]  # group name -> that group's state of the request


class GroupUsage(NamedTuple):
    """What one group's requests hold now (`CacheGroup.usage`)."""

    num_held_blocks: int  # distinct table blocks some request holds
    num_filled_slots: int  # of their token slots, those holding a committed token
    num_state_blocks: int = 0  # per-request state blocks / slots of the group, all
    num_free_state_blocks: int = 0


class CacheGroup(Protocol):
    """One layer group as the coordinator drives it. `state` below is what this group's
    `apply_admit` / `fork` returned for the request. A group class subclasses this
    protocol and inherits the defaults below (what a group without tables, copies, tiers,
    state or turn ends answers); the calls that end in `...` it must write."""

    name: str  # unique within a model; also the group's key in every per-group result
    # "attention" | "recurrent" | "dual_pool": a label for callers that own per-kind tensors
    # (the runners) to pick their groups, and for the coordinator's default group of a
    # query that names none; no call of the coordinator branches on it
    kind: str
    pool: BlockPool  # the pool `blocks_needed` counts against (a shared pool for some attention groups)
    # Pools the group draws from apart from `pool` (V4's dual pool: its state blocks, and
    # its checkpoint slots when they are a pool of their own): the coordinator lists them
    # in `pools` (the engine's allocation and hash-collision counts), `metadata_bytes`
    # and nothing else; the group checks their integrity in `check_states`
    extra_pools: tuple[BlockPool, ...] = ()
    can_unreserve: bool = False  # `unreserve` undoes a reserved step exactly
    # Tier records, for the group's `take_evicted` / `take_published` (None: not recorded):
    # cached blocks the allocator evicted that the runner has not saved yet, blocks
    # published since the runner last took them
    _evicted: list[tuple[int, PrefixBlock]] | None = None
    _published: list[tuple[int, PrefixBlock]] | None = None
    granularity: int  # tokens of one hash unit: block size, checkpoint interval, span
    reads_whole_prefix: bool  # a point needs every unit before it: its hits end at the first miss
    has_table: bool  # keeps block tables (`block_ids`); False: only per-request state
    has_state: bool  # keeps a per-request state block or slot (`state_slot`, `restore`)
    # Its steps are exact: a commit is of the whole reserved step (a recurrent state
    # advances by whole steps). False: blocks are reserved whole and a step may commit
    # part of its reservation (the coordinator's `exact_steps=False` needs every group so)
    whole_steps: bool
    # A commit that ends off a multiple of this, of a request with no admission, fork or
    # turn end since its last commit, changes nothing in the group: the coordinator's
    # decode path skips it
    commit_period: int
    # An exact decode step [num_computed, num_computed + 1) of a request with no step pending
    # takes or changes something in the group only when num_computed + 1 is a multiple of
    # this (the dual pool: the step that completes a span), and its `pending` is empty
    # otherwise; the coordinator's decode reserve hands the group only those requests, and
    # `step_reservations` asks it only about them. None: any decode step may (all are asked)
    decode_reserve_period: int | None = None

    # ---- prefix hits (read-only) --------------------------------------------------------

    def hits(self, root: PrefixBlock, prompt: LookupPrompt, limit: int | None, *, admission: bool = False) -> Any:
        """What the group's cache holds of the prompt (packed once by the coordinator, for
        every group to slice), looking no further than `limit` tokens (another group's
        `upper_bound`) when given. Changes nothing, not even a counter, unless `admission`
        (the lookup of an admission: it counts hash collisions and may consult a lower tier)."""
        ...

    def lookup_stamp(self) -> tuple[Hashable, ...] | None:
        """A value equal at two moments only if `hits` of any root and prompt gives the same
        answer at both, and counts the same hash collisions (an admission takes the router's
        lookup again by it: `HybridCacheManager.admit`): it covers everything the lookup
        reads that can change, prices included. None, the default: no such value (the
        lookup reads a lower tier, say): every admission looks up again."""
        return None

    def may_reach(self, root: PrefixBlock, prompt: LookupPrompt, point: int) -> bool:
        """Whether `hits(root, prompt, None)` may serve a point >= `point` (> 0): False only
        when it surely serves none, found without the lookup's walk (a probe: the router
        rules replicas out with it). True, the default, where no probe is known (a window,
        a recurrent group, whose units are found each on its own). Changes nothing."""
        return True

    def upper_bound(self, hits: Any) -> int:
        """No point above this is served (lets the coordinator skip hopeless points)."""
        ...

    def extra_points(self, hits: Any) -> list[int]:
        """Points off the group's `granularity` grid it can serve (a turn end), in increasing
        order, each once (the coordinator's one-group `hit_point` walks them down)."""
        return []

    def serves(self, hits: Any, point: int) -> bool:
        """Whether a request can resume after `point` cached tokens in this group."""
        ...

    # ---- admission ----------------------------------------------------------------------

    def plan_admit(self, hits: Any | None, point: int, end: int) -> tuple[Any, dict[BlockPool, int]]:
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

    def loads(self, state: Any) -> list[tuple[int, PrefixBlock]]:
        """Blocks of the admission's hit a lower tier holds, (fresh block, its content), to
        load before they are read; their tokens are not computed until `complete_loads`.
        [] for a group without a lower tier."""
        return []

    def complete_loads(self, state: Any, num_loaded: int) -> None:
        """The first `num_loaded` of `loads` hold their content: they join the computed
        prefix and become findable; the rest are computed instead."""
        return None

    # ---- steps --------------------------------------------------------------------------

    def blocks_needed(self, reqs: Sequence[StepRequest], ends: Sequence[int]) -> int:
        """Free blocks of `pool` a step takes, request i computing [num_computed, ends[i]),
        all together. Changes nothing."""
        ...

    def apply_reserve(
        self, reqs: Sequence[StepRequest], ends: Sequence[int], *, detail: bool = True
    ) -> list[GroupReservation] | None:
        """Take the step's blocks (exactly `blocks_needed`; never fails) and any optional
        extras from what is left; per request, the new blocks, queued copies and checkpoint
        slots. detail False (the engine's step, which takes none back): may return None."""
        ...

    def commit(self, reqs: Sequence[StepRequest]) -> None:
        """The requests' steps are written: their `num_computed` is advanced already.
        Publish what the tokens complete, let go of what no later step reads. Never fails."""
        ...

    def take_copies(self) -> list[BlockCopy]:
        """Copies queued since the last call (apply them in order before the next forward).
        [] for a group that never copies."""
        return []

    def take_evicted(self) -> list[tuple[int, PrefixBlock]]:
        """Cached blocks the allocator evicted since the last call, (block id, its content),
        oldest first: for a lower tier to save before the next forward overwrites them. []
        without one. (Read from `_evicted`, which a group with a lower tier keeps.)"""
        evicted = self._evicted
        if evicted:
            self._evicted = []
        return evicted or []

    def take_published(self) -> list[tuple[int, PrefixBlock]]:
        """Blocks published since the last call, (block id, its content), for write-through
        tiers. [] unless recorded (in `_published`)."""
        published = self._published
        if published:
            self._published = []
        return published or []

    def pending(self, state: Any) -> GroupReservation:
        """The reserved, uncommitted step's part (new blocks, checkpoints), for a group that
        keeps it; empty for one that does not (an attention group: its table is its part)."""
        return NO_RESERVATION

    def unreserve(self, state: Any) -> None:
        """Undo the reserved step, whose forward has not run, exactly (`can_unreserve`)."""
        raise AssertionError(f"group {self.name!r} cannot undo a step (can_unreserve said so)")

    # ---- a lower tier that fills the prefix cache before an admission --------------------

    def prefetch_candidates(self, root: PrefixBlock, token_ids: Sequence[int]) -> tuple[list[int], list[PrefixBlock]]:
        """(the device hit's blocks, the prompt's full units after it as unregistered prefix
        blocks, leaving a token to compute): what a lower tier may hold and `install` can
        bring in before the admission. ([], []) for a group whose admission loads a lower
        tier's blocks itself (`loads`), or that has none. Changes nothing."""
        return [], []

    def install(self, num_blocks: int, hold: Sequence[int]) -> list[int] | None:
        """Fresh blocks for lower-tier content (`prefetch_candidates`); None, nothing taken,
        when that many are not free. `hold`: the device hit, kept out of reach."""
        raise AssertionError(f"group {self.name!r} has no prefetch candidates to install")

    def publish_installed(self, block_ids: Sequence[int], blocks: Sequence[PrefixBlock], num_loaded: int) -> None:
        """The first `num_loaded` installed blocks hold `blocks`' content: published, in
        order, as cached blocks nobody holds; every installed block is then freed."""
        raise AssertionError(f"group {self.name!r} has no prefetch candidates to install")

    # ---- prefix queries for P/D transfer, the swap of a partial block -------------------

    def prefix_blocks(self, root: PrefixBlock, token_ids: list[int]) -> tuple[list[int], list[PrefixBlock]]:
        """Ids and prefix blocks of the cached full units of `token_ids` from the first (all may
        match, unlike an admission's hit); ([], []) without such blocks. Changes nothing."""
        return [], []

    def chain_for(self, root: PrefixBlock, token_ids: list[int]) -> list[PrefixBlock]:
        """The prefix blocks of `token_ids`' full units, cached or not; [] without such blocks."""
        return []

    def partial_block(
        self, state: Any, token_ids: list[int], mm_items: tuple[MMItem, ...], start: int, end: int
    ) -> tuple[int, PrefixBlock] | None:
        """(block id, unregistered prefix block of [start, end)) a swap saves or restores; None: no such block."""
        return None

    def swap_state_block(
        self, state: Any, token_ids: list[int], mm_items: tuple[MMItem, ...], num_computed: int
    ) -> PrefixBlock | None:
        """An unregistered prefix block naming the request's live state after `num_computed`
        tokens (its content: the prefix up to there), under which a swap files that state as
        a tier entry; None for a group whose state a swap does not save. Changes nothing."""
        return None

    def restore_swapped(self, state: Any) -> None:
        """The request's state block now holds its state at its computed tokens, written from
        a swapped-out state's tier entry: no restore is left to run."""
        raise ValueError(f"group {self.name!r} keeps no swapped state")

    def hold_swapped(self, block: PrefixBlock, held: bool) -> None:
        """A swapped-out state named `block` (`swap_state_block`) now waits in a tier (held)
        or no longer does: a group that cuts its hits at checkpoints keeps the span boundary
        before it servable, so the state's resume is not cut below it. Changes no request
        and no table; a group whose state a swap does not save ignores it."""

    # ---- a reset of the prefix cache (the coordinator's `reset_prefix_cache`) -------------

    def can_forget_prefixes(self) -> bool:
        """Whether the group can forget every prefix its pools' indexes hold now, with no
        request admitted; False where something outside the cache still counts on one (a
        swapped-out state waiting in a tier, whose resume needs its boundary). Changes nothing."""
        return True

    def forget_prefixes(self) -> None:
        """Forget the group's own records of what its pools' indexes hold (turn ends listed,
        checkpoints filed): the coordinator empties those indexes next. No request is admitted;
        after `can_forget_prefixes` said yes, never fails."""
        return None

    # ---- queries on a request's state ---------------------------------------------------

    def block_ids(self, state: Any) -> list[int]:
        """The request's table (logical blocks [first_block, ...)); [] without a table."""
        return []

    def first_block(self, state: Any) -> int:
        """The logical index of block_ids[0] (> 0 once blocks left a window)."""
        return 0

    def held_blocks(self, state: Any) -> list[int]:
        """Every block of `pool` the request holds (table, copy sources, slots)."""
        ...

    def prefix_chain(self, state: Any) -> list[PrefixBlock]:
        """The prefix blocks of the request's computed hash units, in order (caching on)."""
        ...

    def pending_chain(self, state: Any) -> list[PrefixBlock]:
        """The prefix blocks of the units the reserved step completes, for a group that
        chains them at reservation; [] for one that chains them at commit."""
        return []

    def metadata_bytes(self, state: Any) -> int:
        """Bytes of the request's bookkeeping in the group (sys.getsizeof)."""
        ...

    def state_slot(self, state: Any) -> int | None:
        """The request's live state block / slot; None for a group without one."""
        return None

    def restore(self, state: Any) -> StateRestore | None:
        """How the runner rebuilds the request's state before its first step ("none" once
        done or for a fresh state); None for a group without per-request state."""
        return None

    def checkpoints(self, state: Any) -> list[tuple[int, int]]:
        """(position b, slot) of the reserved step: snapshot the state after b tokens there."""
        return []

    # ---- turn ends, fork, release -------------------------------------------------------

    def mark_turn_end(
        self, state: Any, token_ids: list[int], mm_items: tuple[MMItem, ...], num_computed: int
    ) -> int | None:
        """A slot to copy the live state into now, filed as a turn-end checkpoint; None
        when the group keeps none (nothing changed)."""
        return None

    def keep_turn_end(self, state: Any, token_ids: list[int], mm_items: tuple[MMItem, ...], num_computed: int) -> bool:
        """At a finish with no step pending: keep what the request holds at its turn end
        findable; False (nothing changed) when there is nothing to keep."""
        return False

    def can_fork(self) -> bool:
        """Whether `fork` would find what a child needs of its own (a state block). Changes nothing."""
        return True

    def fork(self, state: Any) -> Any:
        """A child's state sharing the parent's computed blocks (no step is pending); after
        `can_fork` said yes, never fails."""
        ...

    def can_truncate(self, state: Any, num_tokens: int) -> bool:
        """Whether the request can go back to `num_tokens` computed tokens (a recurrent
        state cannot; a window cannot below the blocks it let go). Changes nothing."""
        return False

    def truncate(self, state: Any, num_tokens: int) -> None:
        """Go back to `num_tokens` computed tokens with no step reserved past them (a
        rollback, or a fork giving up the parent's reservation). After `can_truncate`."""
        raise AssertionError(f"group {self.name!r} cannot go back (can_truncate said so)")

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
        self.pool.check_integrity()
        for b, count in enumerate(holders):
            if self.pool.refcount(b) != count:
                raise AssertionError(
                    f"invariant 1 (refcount == number of holders): group {self.name!r} block {b} has refcount "
                    f"{self.pool.refcount(b)}, held {count} times"
                )

    def check_states(self, states: dict[str, Any]) -> None:
        """Assert what spans every request of the group (a dual pool's state blocks)."""
        return None
