"""The cache coordinator: per-request block tables and the request lifecycle over every layer
group of a model, reached through the `CacheGroup` protocol only (cache/group.py: what a
group keeps, and the transaction rule every call here follows). Pure Python, no torch;
`FullAttentionManager` (cache/full.py) and `DSV4CacheManager` (cache/dual_pool.py) are it
over one group.

  admit -> (reserve -> [the model writes the reserved positions] -> commit)* -> release
           append_token_ids whenever sampled tokens join the sequence

- A call that returns None or False (out of blocks or state) or raises leaves every group
  as it was; batched calls (`reserve_step`, `commit_step`) validate every request first.
- A reservation covers positions whose token ids are known (`append_token_ids` first). Only
  committed positions are readable; a unit is published when its last token is committed.
- A release happens once (a repeat returns False and does nothing). A preempted request
  that is admitted again is counted apart in `stats`, not in the hit rate.

Prefix hits. The hit is the largest point P every group serves (candidates: multiples of
the gcd of the groups' granularities, at most len(prompt) - 1, and the points off that grid
some group offers, such as turn ends). An attention group whose cached blocks end at {512,
1024, 1536} and a recurrent group with checkpoints at {0, 1024} give P = 1024: K/V up to
1536 with a recurrent state from anywhere else than 1536 is not the state of that prefix.

Pools. Each group has a pool of its own, or the attention groups draw from one shared pool
(`shared_blocks`; vLLM's hybrid allocator): a block that leaves a window goes back to the
one free queue, where any group's next step can take it. On a shared pool the group's name
is in its chain root, so a group never finds another group's blocks; the free counts that
a transaction checks are summed per pool.

Steps. With `exact_steps` (the default, and required by recurrent and dual-pool groups) a
reservation covers [num_computed, end) and the commit is of exactly those tokens. Without
(attention groups only: `FullAttentionManager`), reservations are block-granular:
`num_reserved_tokens` is the table's end, a commit may take part of the reservation, and a
decode inside its block costs one comparison in `reserve_step` and one in `commit_step`.
The runner applies the copies (`take_copies`), restores and snapshots the groups record.
"""

from __future__ import annotations

import _signal  # (signal's own calls, without its enum wrappers: `_InterruptsHeld`)
import math
import operator
import signal
import sys
import threading
from array import array
from collections.abc import Iterable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

from kvpool.cache.group import CacheGroup, LowerTier
from kvpool.cache.types import (
    _CHECKED_KEY,
    NO_RESERVATION,
    RELEASE_REASONS,
    Admission,
    BlockCopy,
    CacheDescriptor,
    CacheUsage,
    CheckedPrompt,
    GroupAdmission,
    GroupReservation,
    LookupPrompt,
    MMItem,
    PrefixStats,
    ReleaseReason,
    Reservation,
    StateRestore,
)
from kvpool.pool import BlockPool, PrefixBlock, StepTables, step_tables, token_bytes
from kvpool.pool.block_pool import MatchMemo
from kvpool.pool.hashing import TOKEN_BYTES, as_count, is_int, token_array


class RequestPart(NamedTuple):
    """One group's part of one request now (`HybridCacheManager.part`): the group, its
    bookkeeping of the request, and the request's tokens and computed count. Read it, never
    change it (`token_ids` is `_Request.token_ids`: the coordinator's own array, or the
    caller's list where the request was admitted with share_ids, the engine's sequence list,
    which may hold the step's sampled id before its commit: read it only up to num_computed +
    1). Each property is the group's call of that name on `state` (cache/group.py says what it
    returns)."""

    group: CacheGroup
    state: Any
    token_ids: array[int] | list[int]
    mm_items: tuple[MMItem, ...]
    num_computed: int

    @property
    def block_ids(self) -> list[int]:
        return list(self.group.block_ids(self.state))

    @property
    def first_block(self) -> int:
        return self.group.first_block(self.state)

    @property
    def state_slot(self) -> int | None:
        return self.group.state_slot(self.state)

    @property
    def restore(self) -> StateRestore | None:
        return self.group.restore(self.state)

    @property
    def checkpoints(self) -> list[tuple[int, int]]:
        return list(self.group.checkpoints(self.state))

    def prefix_chain(self, reserved: bool = False) -> list[PrefixBlock]:
        """reserved: then the prefix blocks of the units the reserved step completes, where
        the group chains them at reservation (a dual pool: a runner names tier entries by them)."""
        chain = self.group.prefix_chain(self.state)
        return [*chain, *self.group.pending_chain(self.state)] if reserved else list(chain)


def check_mm_items(mm_items: Sequence[MMItem], num_tokens: int) -> tuple[MMItem, ...]:
    """The items as MMItems: start and length ints (numpy's become Python ints), the content
    hash a str (a subclass's, numpy's str_, becomes a str; TypeError naming the item: a float
    start was taken, and offset the block's key by a fraction; a bytes hash failed as 'Object
    of type bytes is not JSON serializable'), each within the prompt (ValueError)."""
    items = tuple(MMItem(*item) for item in mm_items)
    if any(i.start.__class__ is not int or i.length.__class__ is not int for i in items):
        items = tuple(
            MMItem(
                as_count(f"multimodal item {i}: start", i.start),
                as_count(f"multimodal item {i}: length", i.length),
                i.content_hash,
            )
            for i in items
        )
    for item in items:
        if not isinstance(item.content_hash, str):
            raise TypeError(f"multimodal item {item}: its content_hash must be a str")
        if item.start < 0 or item.length <= 0 or item.start + item.length > num_tokens:
            raise ValueError(f"multimodal item {item} lies outside the prompt of {num_tokens} tokens")
    if any(i.content_hash.__class__ is not str for i in items):  # a str subclass (numpy's str_)
        items = tuple(i._replace(content_hash=str(i.content_hash)) for i in items)
    return items


MAX_MEMO_SALTS = 1024  # tenant salts whose roots a coordinator keeps at hand (`_request_roots`)
# requests that may leave between two steps with `_resolve`'s memo carried (`_resolve_changed`)
MAX_LEFT_CARRIED = 32
# the fewest rows a carried memo serves: a smaller step is looked up id by id at less cost
# (an admission's commit of one request, the simulator's small batches)
MIN_ROWS_CARRIED = 16
# lookups a coordinator keeps for their prompts' admissions (`_admission_hits`): the
# arrivals looked up in a replica before its next step (a few at a fleet's rates)
MAX_LOOKED_UP = 8
# fresh requests (`_fresh`) that a commit's pass finds apart, not by a question at every row
MAX_FRESH_APART = 8


def pack_prompt(
    token_ids: Sequence[int], mm_items: Sequence[MMItem] = (), request_id: str = "<lookup>"
) -> CheckedPrompt:
    """`token_ids` and its items checked (ValueError: an empty prompt, an id that is no
    token, a bad item) and packed for `lookup_packed`: a CheckedPrompt, its ids a tuple of
    Python ints (numpy's or torch's converted, as the engine's add_request converts them;
    a bool is kept as given, an int subclass equal to 0 or 1 and packed so)."""
    items = _checked_items(token_ids, mm_items, request_id)
    ids = tuple(token_ids)
    packed = token_bytes(ids)  # ValueError for an id that is no token; packed once for the groups
    # Every id is an integer in [0, 2**32) now (array("I") took it by __index__): `sum`
    # stays an exact int over Python ints (and bools) in one C pass, and turns into a numpy
    # or torch integer at the first such id; only then is every id converted
    if type(sum(ids)) is not int:
        ids = tuple(map(int, ids))
    return CheckedPrompt(ids, items, packed, {}, key=_CHECKED_KEY)


def _pack(token_ids: Sequence[int], mm_items: Sequence[MMItem] = (), request_id: str = "<lookup>") -> LookupPrompt:
    """pack_prompt's checks and packing for this cache's own use (a lookup, an admission
    given no packing), where the ids are read from the bytes and no engine takes the ids
    as checked ints: no pass to find ids that are not Python ints."""
    items = _checked_items(token_ids, mm_items, request_id)
    return LookupPrompt(list(token_ids), items, token_bytes(token_ids), {})


def _checked_items(token_ids: Sequence[int], mm_items: Sequence[MMItem], request_id: str) -> tuple[MMItem, ...]:
    """The checks of a prompt before its packing, `pack_prompt`'s and `_pack`'s (the packing
    checks the ids): ValueError for an empty prompt or a bad item, TypeError for ids that
    are no sequence (a dict or a set would give its keys, in their order); the items checked."""
    if token_ids.__class__ is not list and (
        isinstance(token_ids, (str, bytes, bytearray, Mapping, AbstractSet)) or not hasattr(token_ids, "__len__")
    ):
        raise TypeError(f"request {request_id!r}: token_ids must be a sequence of ints, got {type(token_ids).__name__}")
    if len(token_ids) == 0:
        raise ValueError(f"request {request_id!r} has an empty prompt")
    return check_mm_items(mm_items, len(token_ids))


class GroupSpec(Protocol):
    """A frozen spec that builds its group (cache/window.py, recurrent.py, dual_pool.py)."""

    name: str

    def build(
        self, size: Any, *, enable_caching: bool, hash_algo: str, shared_pool: BlockPool | None, **tiers: Any
    ) -> CacheGroup: ...


@dataclass(slots=True, eq=False)
class _Request:
    request_id: str
    # The request's token ids, the coordinator's own: an array("I") made from the prompt's
    # packing (`token_array`: one copy of its bytes, where a list would take a reference to
    # every id's int object at admission and drop them all at release, a cache miss an id
    # in a big run), 4 bytes an id; sampled ids are appended. A block's hash bytes are a
    # slice of it (`token_bytes` of an array slice: no id converted). Or, admitted with
    # share_ids (`shared`), the caller's own list, which the caller grows (the engine's
    # sequence list: each step's sampled id appended before the commit that names it) and
    # the coordinator only reads: a commit appends nothing to it, so a decode row touches
    # no second copy of its ids a step (the array's append was ~a third of a fleet run's
    # commit: the engine's list and the coordinator's array were two copies of every id)
    token_ids: array[int] | list[int]
    mm_items: tuple[MMItem, ...]
    roots: dict[str, PrefixBlock]  # per group (each pool interns its own roots)
    num_computed: int = 0
    # Reserved positions [num_computed, end); end == num_computed: no step pending. Not
    # exact steps: the end of the blocks the request may write (a multiple of the block size)
    end: int = 0
    states: dict[str, Any] = field(default_factory=dict)  # group name -> the group's state of the request
    budget: int = 0  # the admission's max_new_tokens (or the rest of the prompt): for complete_loads
    num_loading: int = 0  # tokens of the hit a lower tier is still loading (complete_loads)
    readmitted: bool = False  # admitted after a preemption (its hits count apart)
    # What its admission added to `stats` (prompt tokens queried, hit tokens, of those from a
    # lower tier; loads and restores included): taken back at its release where the caller
    # gave the admission up (`give_up_admission`: it admits the request again)
    counted: tuple[int, int, int] = (0, 0, 0)
    given_up: bool = False
    # Released to be admitted again and recomputed (`will_recompute`: a step's fault), and an
    # admission of such a request: counted once already, it counts nothing
    recompute: bool = False
    uncounted: bool = False
    # A release under way (`release`): its bookkeeping done, and how many of the groups (in
    # `_group_list` order) have released their part; one that raised left the rest to a
    # repeat of the release, the request admitted till then (nothing but a release follows)
    releasing: bool = False
    num_released: int = 0
    joined_at: int = 0  # the coordinator's `_requests_version` when it joined (`_add_request`)
    # The admission's hit point: a swap's restore (`restore_tail`, `restore_swapped_state`)
    # follows the admission, before any step; -1: none (a fork's child)
    admitted_at: int = -1
    shared: bool = False  # token_ids is the caller's list (admit's share_ids): never appended to here


class _LookedUp(NamedTuple):
    """A `lookup_packed` kept for its prompt's admission (`_admission_hits`): what it read,
    the groups' stamps through it, the hits it found and their point."""

    packed: bytes
    hashes: MatchMemo | None
    num_tokens: int
    mm_items: tuple[MMItem, ...]
    roots: dict[str, PrefixBlock]
    stamp: tuple[Any, ...]
    hits: dict[str, Any]
    point: int  # hit_point(hits, num_tokens)


# The decode-step memo (`HybridCacheManager._decode_step`, see its __init__): rows, ends,
# the rows on the decode period, pending, starts, the ids of the rows without a next token
_DecodeMemo = tuple[list[_Request], list[int], list[_Request], bool, list[int] | None, list[str]]


class HybridCacheManager:
    """groups: (spec, its pool size) per group, in layer-map order; the spec builds the group
    (`spec.build`) and says what a size is: blocks or state slots, None for an attention
    group that draws from the shared pool of `shared_blocks` blocks, (classical blocks,
    state blocks) for a dual-pool group (V4). All attention groups share one block size
    (one page size; heterogeneous pages are not done). exact_steps: see the module
    docstring. lower_tier, record_published: an attention group's tier hooks
    (cache/window.py), passed to every spec's `build` when given."""

    def __init__(
        self,
        groups: Sequence[tuple[GroupSpec, Any]],
        descriptor: CacheDescriptor,
        *,
        enable_prefix_caching: bool = True,
        hash_algo: str = "xxh3_128",
        shared_blocks: int | None = None,
        turn_end_checkpoints: bool = False,
        exact_steps: bool = True,
        lower_tier: LowerTier | None = None,
        record_published: bool = False,
    ) -> None:
        if not groups:
            raise ValueError("a hybrid cache needs at least one group")
        if not isinstance(descriptor, CacheDescriptor):
            raise TypeError(f"descriptor must be a CacheDescriptor, got {type(descriptor).__name__}")
        shared = None
        if shared_blocks is not None:
            shared_blocks = as_count("shared_blocks", shared_blocks)  # (numpy's ints, as a group's pool size)
            if shared_blocks <= 0:
                raise ValueError(f"shared_blocks must be positive, got {shared_blocks}")
            shared = BlockPool(shared_blocks, enable_caching=enable_prefix_caching, hash_algo=hash_algo)
        tiers: dict[str, Any] = {}
        if lower_tier is not None:
            tiers["lower_tier"] = lower_tier
        if record_published:
            tiers["record_published"] = True
        if tiers and len(groups) != 1:
            # the loads, the published blocks and their tier keys are one pool's
            raise ValueError(
                f"a lower tier and published-block records serve a one-group cache, got {len(groups)} groups"
            )
        built: dict[str, CacheGroup] = {}
        for spec, size in groups:
            build = getattr(spec, "build", None)
            if build is None:
                raise TypeError(f"unknown group spec {type(spec).__name__}: a group spec has a build method")
            if spec.name in built:
                raise ValueError(f"two groups are named {spec.name!r}")
            built[spec.name] = build(
                size, enable_caching=enable_prefix_caching, hash_algo=hash_algo, shared_pool=shared, **tiers
            )
        if shared is not None and not any(g.pool is shared for g in built.values()):
            raise ValueError("shared_blocks is given but no group draws from it (give an attention group None)")
        if not exact_steps and any(g.whole_steps for g in built.values()):
            raise ValueError(f"exact_steps=False needs groups without whole steps, got {sorted(built)}")
        # Callers that own per-kind tensors pick their groups by kind; nothing below does
        self.attention_groups = [g for g in built.values() if g.kind == "attention"]
        self.recurrent_groups = [g for g in built.values() if g.kind == "recurrent"]
        self.dual_groups = [g for g in built.values() if g.kind == "dual_pool"]
        sizes = {g.granularity for g in self.attention_groups}
        if len(sizes) > 1:
            raise ValueError(f"attention groups must share one block size, got {sorted(sizes)}")
        # Groups with block tables, attention first: the default of `block_ids` and of an
        # admission's blocks (`part` has no default on a cache of several groups)
        self._table_groups = sorted((g for g in built.values() if g.has_table), key=lambda g: g.kind != "attention")
        first = self._table_groups[0] if self._table_groups else next(iter(built.values()))
        self.pool, self.block_size = first.pool, first.granularity  # the default table group's
        self.descriptor, self._descriptor_key = descriptor, descriptor.key()
        # Changed only by `_add_request` and `_pop_request` (tests/test_coordinator_resolve.py
        # holds the source to it): they bump the version that `_resolve`'s memo is valid at
        self._requests: dict[str, _Request] = {}
        self._requests_version = 0
        # `_resolve`'s memo: the last decode step's ids (a copy as a list and as a tuple: the
        # engine passes a list to reserve_step and commit_step, the runner a tuple to
        # step_reservations), their requests, and the version they were looked up at. The
        # tuple is made when a tuple is first compared with it (None till then): a copy
        # touches every id's string, a likely cache miss a row at a fleet run's scale, and a
        # step of the engine's decode columns passes lists alone
        self._resolved_list: list[str] = []
        self._resolved_tuple: tuple[str, ...] | None = ()
        self._resolved: list[_Request] = []
        self._resolved_at = -1
        # The memo carried through a batch change (`_resolve_changed`): the ids that left
        # `_requests` since `_resolved_at`, in order (None: more than MAX_LEFT_CARRIED, or the
        # memo let go of its requests), and whether the memo's ids are distinct (None: not
        # known yet; `_distinct` finds out once per list)
        self._left: list[str] | None = []
        self._resolved_distinct: bool | None = None
        # The last carried `_resolve_changed`: the memo list it started from and the indices
        # of the rows it deleted, in order (`_reserve_decodes` deletes the same from its
        # memo's ends); None once read. Exact decode steps only (a paged cache would hold a
        # list of requests that left for nothing)
        self._carried: tuple[list[_Request], list[int]] | None = None
        # The last exact step's memo, while no request's counts moved since: (its `_resolve`
        # list, each row's end, the rows whose end is on the decode period in step order, and
        # pending). pending (`_reserve_decodes` reserved a decode step): row i's reserved step
        # is [ends[i] - 1, ends[i]); not pending (`_commit_decodes` committed a decode step,
        # or `_commit_chunks` a step of any token counts): row i is computed to ends[i], no
        # step pending, nothing loading, its token id at ends[i] known unless it is a hole
        # (below). Every function that writes a request's
        # `end` or `num_computed` sets it to None first (tests/test_coordinator_resolve.py
        # holds the source to it; `check_integrity` holds the rows to it). It spares the
        # passes of the step's other calls their checks: `step_reservations` reads the rows
        # on the period from it (one C-level comparison of the ends), `commit_step` and the
        # next step's `reserve_step` move the counts unchecked. Then, pending only, the step's
        # starts (each ends[i] - 1) where a committed memo gave them (its ends), else None:
        # `step_reservations` compares the starts it is given to them, no subtraction a row.
        # Last, not pending only, the holes: the ids of the rows whose next token id is not
        # known (no token given: a request that finished in the step, or a joiner's prompt
        # ended without its sampled id). A hole may stay for the next step: the memo vouches
        # for the other rows only, and the next reserve checks a hole as a new row
        self._decode_step: _DecodeMemo | None = None
        self._preempted: set[str] = set()  # released by preemption, not yet admitted again
        self._recomputing: set[str] = set()  # released to be recomputed (`will_recompute`), not yet admitted again
        # the request whose release completed and then raised KeyboardInterrupt (held off till
        # then), until the next release: the engine repeats it, and the repeat keeps the marks
        self._interrupted: str | None = None
        # The requests whose admission's lower-tier blocks are still loading (`num_loading`,
        # until `complete_loads`): a commit that names one is refused (`commit_step`), one
        # test a step while none loads (a cache without a lower tier: always)
        self._loading: set[str] = set()
        self.stats = PrefixStats()
        self.groups = built
        self._group_list = list(built.values())
        # Each distinct pool once (a dict keeps layer-map order; a BlockPool hashes by identity)
        self._pools: dict[BlockPool, list[CacheGroup]] = {}
        for g in built.values():
            self._pools.setdefault(g.pool, []).append(g)
        self._block_pools = list(dict.fromkeys(g.pool for g in self._table_groups))
        extra_pools = [pool for g in self._group_list for pool in g.extra_pools]
        self._all_pools = tuple(dict.fromkeys([*self._pools, *extra_pools]))
        # On a shared pool the group's name is in its root: groups never find each other's blocks
        self._root_keys = {
            name: b"|group=" + name.encode() if len(self._pools[g.pool]) > 1 else b"" for name, g in built.items()
        }
        # Whole-prefix groups are looked up first: their hit bounds the others' lookups
        self._lookup_order = sorted(built.items(), key=lambda item: not item[1].reads_whole_prefix)
        # A one-group cache (V4's dual pool, one attention kind): its name and group, for the
        # lookups' paths without the loops over groups (`_hits`, `hit_point`); None otherwise
        self._one_group: tuple[str, CacheGroup] | None = next(iter(built.items())) if len(built) == 1 else None
        self._caching = enable_prefix_caching
        self.turn_end_checkpoints = turn_end_checkpoints
        self.exact_steps = exact_steps
        self.hit_granularity = math.gcd(*(g.granularity for g in built.values()))
        self._commit_period = math.gcd(*(g.commit_period for g in built.values()))
        # Every group says at which ends an exact decode step may change it: the decode
        # reserve asks the groups about those requests only (None: some group may change
        # at any step, and is asked about every request)
        periods = [g.decode_reserve_period for g in built.values()]
        # their gcd, as `_commit_period`: a multiple of any group's period is one of it
        self._decode_period = None if None in periods else math.gcd(*periods)
        # (a decode-step memo's rows on the decode period are its commit's: a group with a
        # decode period commits on it, the dual pool's span)
        assert self._decode_period in (None, self._commit_period), "a decode period that is not the commit period"
        # Requests admitted, forked or marked at a turn end since their last commit: the
        # decode path's commit does not skip them (a held copy source, a restore to end)
        self._fresh: set[str] = set()
        # Per tenant salt, each group's root under the coordinator's descriptor (`_new_request`):
        # this spares the preimage a lookup. Read-only dicts, shared by the requests. A memo
        # only: the pools intern roots (weakly: a root with cached blocks lives on through
        # them), so it is emptied when it holds MAX_MEMO_SALTS salts, not kept for every salt
        # ever seen (per-user tenants)
        self._default_roots: dict[str, dict[str, PrefixBlock]] = {}
        # The last MAX_LOOKED_UP `lookup_packed`s, by the id of their packing (each entry
        # holds it), for their prompts' admissions: the router looks a prompt up in the
        # replica it then hands it to, whose admission comes at its next step, often with no
        # change to the index in between (`_admission_hits`); other arrivals' lookups may
        # come between (a prompt the router then sends elsewhere, or here too)
        self._looked_up: dict[int, _LookedUp] = {}

    # ---- queries -----------------------------------------------------------------------

    @property
    def enable_prefix_caching(self) -> bool:
        return self._caching

    @property
    def num_blocks(self) -> int:
        """Blocks of every table pool (a shared pool once)."""
        return sum(pool.num_blocks for pool in self._block_pools)

    @property
    def num_free_blocks(self) -> int:
        return sum(pool.num_free for pool in self._block_pools)

    @property
    def pools(self) -> list[BlockPool]:
        """Every pool the groups draw from, each once: the pools their tables and slots count
        against, then each group's `extra_pools` (state pools, a pool of checkpoint slots).
        Fixed at construction: the engine counts their allocations around every admit and
        reserve, and sums their hash collisions."""
        return list(self._all_pools)

    def is_shared(self, group: str) -> bool:
        """Whether the group draws from a pool that other groups draw from too."""
        return len(self._pools[self.groups[group].pool]) > 1

    def _fits(self, needs: dict[BlockPool, int]) -> bool:
        """Whether every pool has the free blocks the groups need of it together."""
        for pool, n in needs.items():  # (a loop: all() over a generator costs more for one or two pools)
            if n > pool.num_free:
                return False
        return True

    def num_reserved_tokens(self, request_id: str) -> int:
        return self._get(request_id).end

    @property
    def request_ids(self) -> list[str]:
        return list(self._requests)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._requests

    def token_ids(self, request_id: str) -> list[int]:
        """The request's ids, a copy (of the caller's list itself for a request admitted with
        share_ids)."""
        ids = self._get(request_id).token_ids
        return ids.tolist() if type(ids) is array else list(ids)

    def num_tokens(self, request_id: str) -> int:
        return len(self._get(request_id).token_ids)

    def num_computed_tokens(self, request_id: str) -> int:
        return self._get(request_id).num_computed

    def first_off_step(self, request_ids: Sequence[str], starts: Sequence[int], ends: Sequence[int]) -> int | None:
        """The index of the first request whose step positions [starts[i], ends[i]) do not
        continue its computed tokens within its reservation, at least one token:
          [0, computed) written | [start = computed, end) the step | start < end <= reserved
        None when every request's do (a planned step's check in one pass, ~0.07 us a
        request). KeyError for an unknown id, ValueError for lists of other lengths."""
        if not len(request_ids) == len(starts) == len(ends):
            raise ValueError(f"{len(request_ids)} requests, {len(starts)} starts, {len(ends)} ends")
        requests = self._requests
        try:
            # (`_resolve`: the step's ids are the reserve's, or they with the joiners at the end)
            for req, start, end in zip(self._resolve(request_ids), starts, ends, strict=True):
                if start != req.num_computed or not start < end <= req.end:
                    break
            else:
                return None
        except KeyError as missing:
            raise KeyError(f"unknown request {missing.args[0]!r}") from None
        # a refusal: a second pass finds its index (the pass above counts nothing, ~20 % faster)
        for i, (request_id, start, end) in enumerate(zip(request_ids, starts, ends, strict=True)):
            req = requests[request_id]
            if start != req.num_computed or not start < end <= req.end:
                return i
        raise AssertionError("the first pass found a request at fault")

    def _add_request(self, req: _Request) -> None:
        """The one place a request joins `_requests`: `_resolve`'s memo is stale from here
        (`joined_at` tells `_resolve_changed` the request is newer than the memo)."""
        self._requests[req.request_id] = req
        self._requests_version += 1
        req.joined_at = self._requests_version

    def _pop_request(self, request_id: str) -> _Request | None:
        """The one place a request leaves `_requests` (None: it was not there): `_resolve`'s
        memo is stale from here, its id noted for `_resolve_changed`. The memo lets go of its
        requests when the cache is empty or more than MAX_LEFT_CARRIED left since: a replica
        gone idle keeps no finished request's tokens, a busy one at most that many."""
        req = self._requests.pop(request_id, None)
        if req is not None:
            self._requests_version += 1
            if req.num_loading:
                self._loading.discard(request_id)
            left = self._left
            if left is None or len(left) >= MAX_LEFT_CARRIED or not self._requests:
                self._resolved, self._resolved_list, self._resolved_tuple, self._left = [], [], (), None
                self._resolved_distinct = None  # (the empty memo's: known by no step yet)
                self._decode_step = self._carried = None
            else:
                left.append(request_id)
                memo = self._decode_step
                # A committed decode-step memo over `_resolve`'s rows stays: the next step's
                # reserve carries it to the rows that stay (`_reserve_decodes`); a pending
                # one goes (its step's passes read every row of it)
                if memo is not None and (memo[3] or memo[0] is not self._resolved):
                    self._decode_step = None
        return req

    def _resolve(self, request_ids: Sequence[str], keep: bool = True) -> list[_Request]:
        """A step's requests, in order; KeyError (the dict's, the id alone) for an unknown
        id. The last call's list again when no request joined or left since and the ids are
        equal: a C-level comparison that finds the same string objects by identity (the
        engine's ids of an unchanged batch), without a dict lookup per row. Three passes of
        a decode step (reserve, step_reservations, commit) and the next step's share it.
        Callers read the list, never change it; the ids' requests are the same objects, their
        counts checked by each pass unless the decode-step memo (`_decode_step`) vouches for
        them. A batch changed since (rows left, rows joined at the end) is carried over by
        `_resolve_changed`. Other sequence types, and any
        other ids with keep=False (a query about some of the step's rows): looked up, not
        kept."""
        kind = type(request_ids)
        if kind is list:
            if request_ids == self._resolved_list and self._resolved_at == self._requests_version:
                return self._resolved
        elif kind is tuple:
            if self._resolved_at == self._requests_version and len(request_ids) == len(self._resolved_list):
                if self._resolved_tuple is None:
                    self._resolved_tuple = tuple(self._resolved_list)
                if request_ids == self._resolved_tuple:
                    return self._resolved
        else:
            return list(map(self._requests.__getitem__, request_ids))
        if not keep:
            return list(map(self._requests.__getitem__, request_ids))
        carried = self._resolve_changed(request_ids)  # (raises before the memo changes)
        if carried is None:
            reqs = list(map(self._requests.__getitem__, request_ids))  # (raises before the memo changes)
            distinct, ids = None, list(request_ids)
        else:  # (its ids list: the ids, a list no caller holds, never changed after)
            reqs, distinct, ids = carried
        if self._left:  # a committed decode-step memo's rows that left are known by `_left` only
            self._decode_step = None
        self._resolved_list, self._resolved_tuple = ids, None
        self._resolved, self._resolved_at = reqs, self._requests_version
        self._left, self._resolved_distinct = [], distinct
        return reqs

    def _resolve_changed(
        self, request_ids: list[str] | tuple[str, ...]
    ) -> tuple[list[_Request], bool | None, list[str]] | None:
        """`_resolve` of a batch that is the memo's less the rows whose requests left since,
        plus rows at the end (steady serving: a few finish, a few join): the memo's requests
        with those rows deleted and the new rows looked up, in C-level passes (a comparison
        of the kept ids, a lookup per new row), not a lookup per row. Sound because an id
        that did not leave since the memo names the same request (an id joins `_requests`
        only when it is not there). Also whether the ids are distinct, where that follows
        from the memo's (its own were, and the new rows are of requests that joined after
        it, each once); None when the batch is no such change (the caller looks every id
        up). KeyError (the dict's) for an unknown new row's id. Third, the ids as a list of
        its own (the memo's, edited, where it is all of them: no other copy of them made)
        that nothing changes after (`_resolved_list`)."""
        left, kept_ids, kept = self._left, self._resolved_list, self._resolved
        if left is None or len(request_ids) < MIN_ROWS_CARRIED or not self._resolved_distinct:
            return None  # (an id named twice: its every row would have to go)
        gone = []  # the indices deleted, in order (`_carried`)
        if left:
            kept_ids, kept = kept_ids.copy(), kept.copy()
            for request_id in left:  # (one row each at most: the memo's ids are distinct)
                try:
                    i = kept_ids.index(request_id)
                except ValueError:
                    continue  # (a request that was not in the step)
                del kept_ids[i], kept[i]
                gone.append(i)
        k = len(kept_ids)
        if len(request_ids) < k or request_ids[:k] != (kept_ids if type(request_ids) is list else tuple(kept_ids)):
            return None
        if self._decode_period is not None and self.exact_steps:  # (its one reader: `_reserve_decodes`)
            self._carried = (self._resolved, gone)
        if len(request_ids) == k:  # (kept_ids: the memo's list edited, or the memo's own, unchanged)
            return kept, True, kept_ids
        new = list(map(self._requests.__getitem__, request_ids[k:]))
        at = self._resolved_at
        distinct = None
        if all(req.joined_at > at for req in new) and len(set(map(id, new))) == len(new):
            distinct = True
        return kept + new, distinct, kept_ids + list(request_ids[k:])

    def _distinct(self, request_ids: Sequence[str], reqs: list[_Request]) -> bool:
        """Whether the step names each request once; `reqs`: `_resolve(request_ids)`. Known
        from the memo where it is `_resolve`'s (its list's ids were counted once, or a
        change of it kept them distinct: `_resolve_changed`), else counted."""
        if reqs is self._resolved:
            if self._resolved_distinct is None:
                self._resolved_distinct = len(set(request_ids)) == len(request_ids)
            return self._resolved_distinct
        return len(set(request_ids)) == len(request_ids)

    def _get(self, request_id: str) -> _Request:
        try:
            return self._requests[request_id]
        except KeyError:
            raise KeyError(f"unknown request {request_id!r}") from None

    def _group(self, group: str | None, defaults: list[CacheGroup], what: str) -> CacheGroup:
        g = (defaults[0] if defaults else None) if group is None else self.groups.get(group)
        if g is None or g not in defaults:
            raise KeyError(f"no {what} group {group!r}")
        return g

    def block_ids(self, request_id: str, group: str | None = None) -> list[int]:
        """The held blocks of one table group (default: the first attention group, else the
        first dual pool's classical blocks), logical blocks [first_block(...), ...)."""
        g = self._group(group, self._table_groups, "block-table")
        return list(g.block_ids(self._get(request_id).states[g.name]))

    def tables(self, request_ids: Sequence[str], group: str | None = None) -> list[list[int]]:
        """Each request's table of a table group itself, not a copy (`block_ids` copies):
        read it, never change it. The cache changes a running request's table in place: it
        appends blocks, and a copy-on-write replaces the entry of the block a step starts in
        (attention/backends/step_buffers.py relies on nothing else changing)."""
        g = self._group(group, self._table_groups, "block-table")
        name, block_ids = g.name, g.block_ids
        try:
            # (the step's rows after `first_off_step` of the same ids: `_resolve`'s memo; the
            # step buffers' question about a few of them leaves it as it is)
            return [block_ids(req.states[name]) for req in self._resolve(request_ids, keep=False)]
        except KeyError as missing:
            raise KeyError(f"unknown request {missing.args[0]!r}") from None

    def part(self, request_id: str, group: str | None = None) -> RequestPart:
        """One group's part of the request. `group` may be left out on a cache of one group
        only: of several, no default would answer both a table question and a state question
        (ValueError naming the groups)."""
        req = self._get(request_id)
        if group is None:
            if len(self._group_list) > 1:
                raise ValueError(
                    f"part({request_id!r}): the cache has several groups; name one of {sorted(self.groups)}"
                )
            g: CacheGroup | None = self._group_list[0]
        else:
            g = self.groups.get(group)
        if g is None:
            raise KeyError(f"no group {group!r}; the groups are {sorted(self.groups)}")
        return RequestPart(g, req.states[g.name], req.token_ids, req.mm_items, req.num_computed)

    def pending_reservation(self, request_id: str) -> Reservation | None:
        """The request's reserved, uncommitted positions [num_computed, num_reserved) and each
        group's part of the step that reserved them, where the group keeps it
        (`CacheGroup.pending`; an attention group keeps none: its table is its part); None
        when nothing is reserved past the computed tokens. Block-granular reservations
        (exact_steps False) keep the rest of the last block reserved after a commit inside
        it (a commit there needs no `reserve` first): that rest, whose step is committed
        (no group's part left), until a commit ends on a block's end. Exact steps: None
        after each commit."""
        req = self._get(request_id)
        if req.end == req.num_computed:
            return None
        parts = {name: g.pending(req.states[name]) for name, g in self.groups.items()}
        return Reservation(req.num_computed, req.end - req.num_computed, parts)

    def step_reservations(
        self, request_ids: Sequence[str], starts: Sequence[int], ends: Sequence[int]
    ) -> dict[str, Reservation]:
        """`pending_reservation` for a whole step whose request i computes [starts[i],
        ends[i]), which must be its reserved step (ValueError naming the request otherwise):
        only the requests whose step took anything in some group (blocks, copies,
        checkpoints), in step order. Exact steps whose groups all have a decode period (V4):
        a decode that ends off it costs four comparisons, no group asked (its request from
        `_resolve`: no lookup while the batch is unchanged), and where the step is the one
        `_reserve_decodes` just reserved (`_decode_step`) only the memo's rows on the period
        are asked, no row checked; otherwise every group is asked about every request
        (`_each_reservation`)."""
        if not len(request_ids) == len(starts) == len(ends):
            raise ValueError(f"{len(request_ids)} requests, {len(starts)} starts, {len(ends)} ends")
        period = self._decode_period
        if not self.exact_steps or period is None:
            return self._each_reservation(request_ids, starts, ends)
        groups, empty = self._group_list, NO_RESERVATION
        try:
            reqs = self._resolve(request_ids)
        except KeyError:  # an unknown id: the twin raises what is wrong first, in step order
            return self._each_reservation(request_ids, starts, ends)
        out: dict[str, Reservation] = {}
        reserved = self._decode_step
        k = 0  # the leading rows the memo answers
        if reserved is not None and reserved[3]:
            if reqs is reserved[0]:  # (the decode step: no slices)
                if ends == reserved[1] and (
                    starts == reserved[4] or list(map(operator.sub, ends, starts)).count(1) == len(reqs)
                ):
                    k = len(reqs)
            else:
                k = len(reserved[0])
                if not (
                    reqs[:k] == reserved[0]
                    and ends[:k] == reserved[1]
                    and (starts[:k] == reserved[4] or list(map(operator.sub, ends[:k], starts)).count(1) == k)
                ):
                    k = 0
        if k:
            # The decodes `_reserve_decodes` reserved (the step, or its leading rows: the
            # joiners admitted since follow them), nothing moved since: row i's reserved step
            # is [ends[i] - 1, ends[i]) (the memo's invariant), which the ends and starts name
            # (lengths equal: checked above). Only its rows on the period took anything
            for req in reserved[2]:
                states = req.states
                parts = {g.name: g.pending(states[g.name]) for g in groups}
                for part in parts.values():
                    if part != empty:
                        out[req.request_id] = Reservation(req.end - 1, 1, parts)
                        break
            if k == len(reqs):
                return out
            # the rows after them (a joiner's chunk) as below
            reqs, starts, ends = reqs[k:], starts[k:], ends[k:]
        for req, start, end in zip(reqs, starts, ends, strict=True):
            if start != req.num_computed or end != req.end:
                self._not_reserved(req.request_id, start, end)  # raises
            if end % period and end - start == 1:
                continue  # a decode ending off the period took nothing in any group (`decode_reserve_period`)
            states = req.states
            parts = {g.name: g.pending(states[g.name]) for g in groups}
            for part in parts.values():  # (a loop, not any() over a generator: one per crossing)
                if part != empty:
                    out[req.request_id] = Reservation(start, end - start, parts)
                    break
        return out

    def _each_reservation(
        self, request_ids: Sequence[str], starts: Sequence[int], ends: Sequence[int]
    ) -> dict[str, Reservation]:
        """`step_reservations` request by request, every group asked about each: the naive
        twin of its decode-period path (tests/test_dsv4_cache.py holds them equal)."""
        requests, groups, exact = self._requests, self._group_list, self.exact_steps
        out: dict[str, Reservation] = {}
        for request_id, start, end in zip(request_ids, starts, ends, strict=True):
            req = requests.get(request_id)
            if req is None or start != req.num_computed or (end != req.end if exact else not start < end <= req.end):
                self._not_reserved(request_id, start, end)  # raises
            states = req.states
            for g in groups:
                if g.pending(states[g.name]) != NO_RESERVATION:
                    parts = {g.name: g.pending(states[g.name]) for g in groups}
                    out[request_id] = Reservation(start, end - start, parts)
                    break
        return out

    def _not_reserved(self, request_id: str, start: int, end: int) -> None:
        """`step_reservations`' error for a step that is not the request's reserved one."""
        req = self._requests.get(request_id)
        if req is None:
            raise KeyError(f"unknown request {request_id!r}")
        raise ValueError(
            f"request {request_id!r}: positions [{start}, {end}) are not its reserved step "
            f"[{req.num_computed}, {req.end})"
        )

    def take_spills(self) -> list[tuple[int, int]]:
        """The (state slot, checkpoint slot) copies the dual-pool groups' spills of kept
        turn-end states queued (cache/dual_pool.py): the runner makes them right after the
        admission or fork that took those state blocks, before anything writes them."""
        return [copy for g in self.dual_groups for copy in g.take_spills()] if self.dual_groups else []

    def take_copies(self) -> dict[str, list[BlockCopy]]:
        """Per group that queued any, the copies to apply before the next forward, in order."""
        out = {}
        for name, g in self.groups.items():
            copies = g.take_copies()
            if copies:
                out[name] = copies
        return out

    def slot_mapping(self, request_id: str, start: int, end: int, group: str | None = None) -> list[int]:
        """Physical slots of positions [start, end); they must lie within the reservation (and,
        in a window group, at or after its first block: `step_tables`)."""
        req = self._get(request_id)
        if not 0 <= start <= end <= req.end:
            raise ValueError(f"positions [{start}, {end}) outside the reserved [0, {req.end})")
        return self.step_tables([request_id], [start], [end], group, check=False).slots

    def step_tables(
        self,
        request_ids: Sequence[str],
        starts: Sequence[int],
        ends: Sequence[int],
        group: str | None = None,
        *,
        check: bool = True,
    ) -> StepTables:
        """What a step's attention needs, in one pass: the slots of each request's positions
        [starts[i], ends[i]), and its table over [0, ends[i]). A step continues the computed
        prefix (starts[i] is the request's computed count) within its reservation. A window
        group's table begins at its first block (the blocks before it left the window): each
        table covers [first_block * block_size, ends[i]), and a position before it is a
        ValueError. So is a request whose lower-tier loads are pending (complete_loads first,
        as for every step call): its slots past the computed prefix are blocks still in flight,
        which no forward may read or write (it could not commit them either)."""
        if not len(request_ids) == len(starts) == len(ends):
            raise ValueError(f"{len(request_ids)} requests, {len(starts)} starts, {len(ends)} ends")
        g = self._group(group, self._table_groups, "block-table")
        reqs = [self._get(r) for r in request_ids]
        if self._loading:  # (a set test a step while nothing loads: a cache without a lower tier, always)
            loading = next((req for req in reqs if req.num_loading), None)
            if loading is not None:
                raise ValueError(f"request {loading.request_id!r} has lower-tier blocks to load (complete_loads first)")
        if check:
            for req, start, end in zip(reqs, starts, ends, strict=True):
                if start != req.num_computed or not start <= end <= req.end:
                    raise ValueError(
                        f"request {req.request_id!r}: positions [{start}, {end}) do not continue its "
                        f"{req.num_computed} computed tokens within the reserved [0, {req.end})"
                    )
        name, block_ids = g.name, g.block_ids
        if getattr(getattr(g, "spec", None), "window", None) is not None:  # its table begins at its first block
            bs = g.granularity
            offsets = [g.first_block(req.states[name]) * bs for req in reqs]
            if any(offsets):
                # table[0] is logical block `first`: position p is at table[p // bs - first], so
                # the ranges shift by first * bs, and each CSR table covers [first * bs, end)
                early = next((i for i, (o, s) in enumerate(zip(offsets, starts, strict=True)) if s < o), None)
                if early is not None:
                    raise ValueError(
                        f"request {reqs[early].request_id!r}: position {starts[early]} left the window of group "
                        f"{name!r} (its table begins at position {offsets[early]})"
                    )
                starts = [s - o for s, o in zip(starts, offsets, strict=True)]
                ends = [e - o for e, o in zip(ends, offsets, strict=True)]
        return step_tables([block_ids(req.states[name]) for req in reqs], starts, ends, g.granularity)

    def metadata_bytes(self) -> int:
        """Bytes of the coordinator's Python structures: every pool's (`pools`), and every request's
        token ids (an array: its buffer, 4 B an id, is in its getsizeof; a caller's list shared
        with share_ids: its pointer array, 8 B a slot, the ids' int objects not walked; the
        engine's sequence list is counted here, the one place the ledger sees it) and each
        group's bookkeeping of it (sys.getsizeof). Counted, not walked: a harness calls this
        every step."""
        size = sys.getsizeof
        total = sum(pool.metadata_bytes() for pool in self._all_pools) + size(self._requests)
        for req in self._requests.values():
            total += size(req) + size(req.token_ids)
            total += sum(g.metadata_bytes(req.states[name]) for name, g in self.groups.items())
        return total

    def usage(self) -> CacheUsage:
        """Table blocks of every group, each physical block counted once (a dual pool's
        classical blocks whole by construction); recurrent slots and dual-pool state blocks
        as state blocks."""
        held = filled = num_state = num_free_state = 0
        reqs = self._requests.values()
        for name, g in self.groups.items():
            u = g.usage([(req.states[name], req.num_computed) for req in reqs])
            held += u.num_held_blocks
            filled += u.num_filled_slots
            num_state += u.num_state_blocks
            num_free_state += u.num_free_state_blocks
        return CacheUsage(
            self.num_blocks, self.num_free_blocks, held, filled, self.block_size, num_state, num_free_state
        )

    def group_held_blocks(self) -> dict[str, int]:
        """Per group, blocks (or slots) that are not free: what the pool really holds. A
        group on a shared pool: the distinct blocks its requests hold (by invariant 1 the
        same count, since no block is held by two groups; check_integrity asserts it)."""
        held = {}
        for name, g in self.groups.items():
            if not self.is_shared(name):
                held[name] = g.pool.num_blocks - g.pool.num_free
                continue
            ids: set[int] = set()
            for req in self._requests.values():
                ids.update(g.held_blocks(req.states[name]))
            held[name] = len(ids)
        return held

    # ---- a one-group cache's partial-block swap (the tier queries: engine/tier_bridge.py) ----

    def restore_refusal(self, request_id: str, num_tokens: int) -> str | None:
        """Why `num_tokens` positions after the computed prefix cannot be restored, or None."""
        return self._restore_refusal(request_id, num_tokens, state=False)

    def restore_tail(self, request_id: str, num_tokens: int) -> Admission:
        """The KV of `num_tokens` positions after the computed full blocks is loaded back into
        the request's fresh block (`CacheGroup.partial_block`) before its first step: they
        count as computed (a token is left to compute). Returns the admission the engine
        follows. ValueError, nothing changed, naming why they cannot be (`restore_refusal`)."""
        req, g, num_tokens = self._checked_restore(request_id, num_tokens, state=False)
        nc = req.num_computed
        tail = g.partial_block(req.states[g.name], req.token_ids, req.mm_items, nc, nc + num_tokens)
        if tail is None:
            raise ValueError(f"request {request_id!r}: its group swaps no block")
        assert self.pool.refcount(tail[0]) == 1 and self.pool.block_hash(tail[0]) is None, "a fresh block"
        return self._restored(req, num_tokens)

    def swapped_state_refusal(self, request_id: str, num_tokens: int) -> str | None:
        """Why a swapped-out state `num_tokens` positions after the admission's hit cannot come
        back (`restore_swapped_state`), or None."""
        return self._restore_refusal(request_id, num_tokens, state=True)

    def restore_swapped_state(self, request_id: str, num_tokens: int) -> Admission:
        """A swapped-out request's state came back into its state block (the runner wrote it
        from the tier entry `CacheGroup.swap_state_block` named): the `num_tokens` tokens of
        its unfinished span after the admission's hit (a span boundary) count as computed (a
        token is left to compute) and the group's restore is done ("swap"). Returns the
        admission the engine follows. ValueError, nothing changed, naming why it cannot be
        (`swapped_state_refusal`)."""
        req, g, num_tokens = self._checked_restore(request_id, num_tokens, state=True)
        g.restore_swapped(req.states[g.name])
        return self._restored(req, num_tokens)

    def _restore_refusal(self, request_id: str, num_tokens: int, state: bool) -> str | None:
        """`restore_refusal` (state False: a swapped partial block, 1 to bs - 1 tokens) and
        `swapped_state_refusal` (state True: a swapped state, 0 to bs - 1 tokens on)."""
        req = self._get(request_id)
        num_tokens = _int_counts((num_tokens,), "a restore's token count", (request_id,))[0]
        nc, bs = req.num_computed, self.block_size
        if len(self._group_list) != 1:
            what = "swapped state" if state else "partial block"
            return f"request {request_id!r}: a cache of {len(self._group_list)} groups restores no {what}"
        if nc != req.admitted_at and not req.num_loading:  # (a step since: its tokens are computed)
            what = "state" if state else "tail"
            return f"request {request_id!r}: a swapped {what} is restored right after the admission, before any step"
        least = 0 if state else 1
        if req.num_loading or nc % bs or not least <= num_tokens < bs or not 0 < nc + num_tokens < len(req.token_ids):
            tokens = f"a state {num_tokens} tokens" if state else f"{num_tokens} tokens"
            return (
                f"request {request_id!r}: cannot restore {tokens} after {nc} computed "
                f"({len(req.token_ids)} known, block size {bs})"
            )
        if nc + num_tokens >= req.end:  # (the first step must keep a token of its reservation: an exact step's end)
            what = f"a state {num_tokens} tokens on leaves" if state else f"{num_tokens} restored tokens leave"
            return f"request {request_id!r}: {what} no reserved token to compute"
        return None

    def _checked_restore(self, request_id: str, num_tokens: int, state: bool) -> tuple[_Request, CacheGroup, int]:
        """The request, its one group and the count of a restore `_restore_refusal` has no
        objection to; ValueError, nothing changed, naming the objection."""
        num_tokens = _int_counts((num_tokens,), "a restore's token count", (request_id,))[0]
        refusal = self._restore_refusal(request_id, num_tokens, state)
        if refusal is not None:
            raise ValueError(refusal)
        return self._requests[request_id], self._group_list[0], num_tokens

    def _restored(self, req: _Request, num_tokens: int) -> Admission:
        """`num_tokens` more of the prefix came back: computed, counted as hit; the admission
        the engine follows, its first step inside the admission's reservation (a block
        boundary past the computed prefix)."""
        self._decode_step = None  # (the counts move below)
        req.num_computed += num_tokens
        self._count_hit(req, num_tokens)
        n = min(req.budget, len(req.token_ids) - req.num_computed, req.end - req.num_computed)
        assert n > 0
        return Admission(req.num_computed, n, self._admission_parts(req))

    def hold_swapped_state(self, block: PrefixBlock, held: bool) -> None:
        """A swapped-out state named `block` (`CacheGroup.swap_state_block`) was filed in a
        tier (held) or left it (taken back, dropped): the group keeps its span boundary a hit
        point (`CacheGroup.hold_swapped`). One group only, as the swap of a state."""
        assert len(self._group_list) == 1, "a state swap is a one-group cache's"
        self._group_list[0].hold_swapped(block, held)

    # ---- prefix hits -------------------------------------------------------------------

    def root(self, tenant_salt: str = "") -> PrefixBlock:
        """The root of `pool`'s chains under the coordinator's descriptor, for a one-group
        model (its group's root key is empty)."""
        return self.pool.root(self._descriptor_key, tenant_salt)

    def _new_request(
        self,
        request_id: str,
        prompt: LookupPrompt,
        tenant_salt: str,
        descriptor: CacheDescriptor | None,
        shared: list[int] | None = None,
    ) -> _Request:
        """prompt: `pack_prompt`'s, its packing checked: the request's ids are made from its
        bytes, or are `shared` (admit's share_ids: the caller's list of those ids, not copied)."""
        roots = self._request_roots(tenant_salt, descriptor)
        if shared is not None:
            return _Request(request_id, shared, prompt.mm_items, roots, shared=True)
        return _Request(request_id, token_array(prompt.packed), prompt.mm_items, roots)

    def _request_roots(self, tenant_salt: str, descriptor: CacheDescriptor | None) -> dict[str, PrefixBlock]:
        """Each group's chain root for a request of that salt and descriptor (None: the
        coordinator's, whose roots are made once per salt). Read it, never change it."""
        if descriptor is None:
            roots = self._default_roots.get(tenant_salt)
            if roots is None:
                if len(self._default_roots) >= MAX_MEMO_SALTS:
                    self._default_roots.clear()
                roots = self._default_roots[tenant_salt] = self._roots(self._descriptor_key, tenant_salt)
            return roots
        if not isinstance(descriptor, CacheDescriptor):
            raise TypeError(f"descriptor must be a CacheDescriptor, got {type(descriptor).__name__}")
        return self._roots(descriptor.key(), tenant_salt)

    def _roots(self, descriptor_key: bytes, tenant_salt: str) -> dict[str, PrefixBlock]:
        """Each group's chain root under a descriptor and salt (interned by its pool)."""
        return {
            name: g.pool.root(descriptor_key + self._root_keys[name], tenant_salt) for name, g in self.groups.items()
        }

    def _hits(
        self, roots: dict[str, PrefixBlock], prompt: LookupPrompt, bounded: bool = True, admission: bool = False
    ) -> dict[str, Any]:
        """Each group's hits of `prompt` from its root. bounded: whole-prefix groups first, and
        the others look no further than the smallest bound so far (a cold prompt then costs a
        block's hash per group, not the whole prompt's: the simulator retries a waiting
        admission every step). A lookup makes no request: it reads the roots and the prompt.
        One group (V4's dual pool, one attention kind: the router asks every replica for each
        arrival) is looked up unbounded directly: what `_hits_of_groups` gives it."""
        if self._one_group is not None:
            name, g = self._one_group
            return {name: g.hits(roots[name], prompt, None, admission=admission)}
        return self._hits_of_groups(roots, prompt, bounded, admission)

    def _hits_of_groups(
        self, roots: dict[str, PrefixBlock], prompt: LookupPrompt, bounded: bool, admission: bool
    ) -> dict[str, Any]:
        """`_hits` over any number of groups (the one-group path's twin)."""
        limit: int | None = None
        hits = {}
        for name, g in self._lookup_order:
            hits[name] = found = g.hits(roots[name], prompt, limit, admission=admission)
            if bounded:
                bound = g.upper_bound(found)
                limit = bound if limit is None or bound < limit else limit
        return hits

    def hit_point(self, hits: dict[str, Any], num_tokens: int) -> int:
        """The largest point every group serves, leaving one token to compute: candidates are
        the multiples of the hit granularity and the points off that grid some group offers
        (a recurrent group's turn ends). `hits`: `_hits`' (every group's). One group (the
        common lookup: the router asks it 8 times an arrival) walks its grid and its own
        off-grid points down from its bound directly: what `_hit_point_of_groups` gives it,
        without the candidate set and the closures (~4 us a call)."""
        if self._one_group is None:
            return self._hit_point_of_groups(hits, num_tokens)
        name, group = self._one_group
        found = hits[name]
        g, serves = self.hit_granularity, group.serves
        top = min(num_tokens - 1, group.upper_bound(found))
        if top <= 0:
            return 0  # (nothing cached: no point, on the grid or off it, lies in (0, top])
        point = top // g * g
        extras = group.extra_points(found)  # increasing, each once (a group's turn ends)
        if any(map(operator.ge, extras, extras[1:])):
            # the protocol's order, where a group broke it: the walk below reads them in order
            extras = sorted(set(extras))
        if not extras:
            while point > 0 and not serves(found, point):
                point -= g
            return max(point, 0)  # (below 0 only for an empty prompt's num_tokens - 1)
        # the grid and the off-grid points merged, from the top down: the first served wins
        i = len(extras) - 1
        while i >= 0 and extras[i] > top:
            i -= 1
        while point > 0:
            while i >= 0 and extras[i] > point:
                if serves(found, extras[i]):
                    return extras[i]
                i -= 1
            if serves(found, point):
                return point
            point -= g
        while i >= 0 and extras[i] > 0:
            if serves(found, extras[i]):
                return extras[i]
            i -= 1
        return 0

    def _hit_point_of_groups(self, hits: dict[str, Any], num_tokens: int) -> int:
        """`hit_point` over any number of groups and off-grid points (the one-group path's twin)."""
        g = self.hit_granularity
        parts = [(group, hits[name]) for name, group in self.groups.items()]
        top = num_tokens - 1
        for group, found in parts:
            bound = group.upper_bound(found)
            if bound < top:
                top = bound
        extras = sorted({p for group, found in parts for p in group.extra_points(found) if 0 < p <= top}, reverse=True)

        def served(p: int) -> bool:
            return all(group.serves(found, p) for group, found in parts)

        point, i = top // g * g, 0
        while point > 0:
            while i < len(extras) and extras[i] > point:
                if served(extras[i]):
                    return extras[i]
                i += 1
            if served(point):
                return point
            point -= g
        return next((p for p in extras[i:] if p > 0 and served(p)), 0)

    def group_hit_points(self, token_ids: Sequence[int], *, tenant_salt: str = "") -> dict[str, list[int]]:
        """Per group, every point it alone could serve (for reports and tests). Changes nothing."""
        hits = self._hits(self._request_roots(tenant_salt, None), _pack(token_ids), bounded=False)
        g = self.hit_granularity
        extras = {p for name, group in self.groups.items() for p in group.extra_points(hits[name])}
        points = sorted({*range(0, (len(token_ids) - 1) // g * g + 1, g), *(p for p in extras if p < len(token_ids))})
        return {name: [p for p in points if group.serves(hits[name], p)] for name, group in self.groups.items()}

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
        if not self._caching:
            return 0
        return self.lookup_packed(_pack(token_ids, mm_items), tenant_salt=tenant_salt, descriptor=descriptor)

    def lookup_packed(
        self, prompt: LookupPrompt, *, tenant_salt: str = "", descriptor: CacheDescriptor | None = None
    ) -> int:
        """`lookup_prefix` of a prompt `pack_prompt` packed: a prompt looked up in several
        caches is checked and packed once (the router's prefix-aware policy)."""
        if not isinstance(prompt, LookupPrompt):
            raise TypeError(f"prompt must be pack_prompt's LookupPrompt, got {type(prompt).__name__}")
        if not self._caching:
            return 0
        roots = self._request_roots(tenant_salt, descriptor)
        stamp = self._lookup_stamp()
        hits = self._hits(roots, prompt)
        num_tokens = len(prompt.token_ids)
        point = self.hit_point(hits, num_tokens)
        # kept for the prompt's admission when the stamp held through the lookup (no refused
        # hit, which the admission's walk would count)
        if stamp is not None and self._lookup_stamp() == stamp:
            looked_up = self._looked_up
            looked_up.pop(id(prompt.packed), None)  # (a later lookup of the same packing: the newest entry)
            if len(looked_up) >= MAX_LOOKED_UP:
                del looked_up[next(iter(looked_up))]  # the oldest
            looked_up[id(prompt.packed)] = _LookedUp(
                prompt.packed, prompt.hashes, num_tokens, prompt.mm_items, roots, stamp, hits, point
            )
        return point

    def _lookup_stamp(self) -> tuple[Any, ...] | None:
        """Every group's `lookup_stamp` (None where a group has none): equal at two moments,
        `_hits` of any roots and prompt is the same at both."""
        if self._one_group is not None:
            return self._one_group[1].lookup_stamp()
        stamps = tuple(g.lookup_stamp() for g in self._group_list)
        return None if None in stamps else stamps

    def _admission_hits(self, roots: dict[str, PrefixBlock], prompt: LookupPrompt) -> tuple[dict[str, Any], int]:
        """`_hits(roots, prompt, admission=True)` and their `hit_point` at the prompt's
        length (the naive twin): a kept lookup's (`_looked_up`), taken once, when it was of this prompt under these
        roots and no group's stamp moved since (the router's lookup in the replica it
        chose): the same packing (the very bytes object: the admission checked, or its
        caller vouched, that the ids are its ids), length, items and memo of hashes (the
        walk skipped would have left that memo as the lookup left it). The hits and the
        point are then equal, and the walk would count no collision; else a fresh lookup."""
        looked = self._looked_up.pop(id(prompt.packed), None)
        if (
            looked is not None
            and looked.packed is prompt.packed
            and looked.hashes is prompt.hashes
            and looked.roots is roots
            and looked.num_tokens == len(prompt.token_ids)
            and looked.mm_items == prompt.mm_items
            and looked.stamp == self._lookup_stamp()
        ):
            return looked.hits, looked.point
        hits = self._hits(roots, prompt, admission=True)
        return hits, self.hit_point(hits, len(prompt.token_ids))

    def may_reach(
        self, prompt: LookupPrompt, num_tokens: int, *, tenant_salt: str = "", descriptor: CacheDescriptor | None = None
    ) -> bool:
        """Whether `lookup_packed` of these arguments may be at least `num_tokens`: False only
        when it is surely below, told without its walk (a probe of the prompt's memo of
        hashes in each group that keeps a run from the root: `CacheGroup.may_reach`). The
        hit is a point every group serves, so one group that serves none at or past
        `num_tokens` rules it out. The router asks this before a full lookup, for the replicas
        that could beat the best hit so far only by reaching it. Changes nothing."""
        if not isinstance(prompt, LookupPrompt):
            raise TypeError(f"prompt must be pack_prompt's LookupPrompt, got {type(prompt).__name__}")
        if num_tokens <= 0:
            return True
        if not self._caching or num_tokens >= len(prompt.token_ids):  # (a hit leaves a token to compute)
            return False
        roots = self._request_roots(tenant_salt, descriptor)
        if self._one_group is not None:  # (V4's dual pool, one attention kind: the router's common case)
            name, group = self._one_group
            return group.may_reach(roots[name], prompt, num_tokens)
        return all(g.may_reach(roots[name], prompt, num_tokens) for name, g in self.groups.items())

    # ---- lifecycle ---------------------------------------------------------------------

    def admit(
        self,
        request_id: str,
        token_ids: Sequence[int],
        max_new_tokens: int | None = None,
        *,
        tenant_salt: str = "",
        mm_items: Sequence[MMItem] = (),
        descriptor: CacheDescriptor | None = None,
        prompt: LookupPrompt | None = None,
        check_packing: bool = True,
        share_ids: bool = False,
    ) -> Admission | None:
        """Take a request in: its longest cached prefix (always leaving at least one prompt
        token to compute, whose logits are needed) and a reservation for the next
        min(max_new_tokens, rest of the prompt) tokens (default: the whole rest). None when
        the pools cannot hold that now; nothing changed. `descriptor` overrides the
        coordinator's for this request (another adapter, say); a request never hits blocks of
        another descriptor or tenant salt. ValueError for an id in use, an empty prompt, a bad
        count. With a lower tier, the hit may end in blocks the tier holds: they are not
        computed until `complete_loads` (`GroupAdmission.loads` names them). `prompt`:
        `token_ids` and `mm_items` as `pack_prompt` packed them already (the engine's
        add_request, the router's lookups): its packing and the hashes its lookups chained
        are reused, not redone; ValueError when it holds other tokens or items.
        check_packing=False: the caller vouches that `prompt.packed` is the packing of
        `prompt.token_ids` (the engine checked it at add_request, in a list of its own that
        nothing changes before the admission): the ids, the items and the packing's length
        are compared, the bytes are not packed again (~5 ns a token).
        share_ids=True: `token_ids`, a list, becomes the request's ids itself, not copied
        (the engine's sequence list). The caller grows it: each sampled id joins it before
        the `commit_step` that names it (a commit appends nothing to it, and `append_token_ids`
        and `rollback` are refused), no id up to its `num_computed + 1` changes or is removed
        while the request is admitted (an uncommitted id past it may go: the engine's undone
        take), and its ids are ints in [0, 2**32) (a commit does not check the ids it
        names: they are in the list already). TypeError for a token_ids that is no list, and
        for a request id that is no str (5, None and "5" were three requests)."""
        if request_id.__class__ is not str:
            _check_id(request_id)
        if share_ids and type(token_ids) is not list:
            raise TypeError(f"share_ids needs the caller's list of token ids, got {type(token_ids).__name__}")
        # (the counts move below: the new request's only, which is no row of the decode-step
        # memo, so an admission that succeeds gives the memo back: a mixed step's decodes
        # reserved before the joiners' admissions keep it through step_reservations and commit)
        memo, self._decode_step = self._decode_step, None
        if request_id in self._requests:
            raise ValueError(f"request {request_id!r} is already admitted")
        if max_new_tokens is not None:
            if max_new_tokens.__class__ is not int:  # (nan passed the check below and leaked a block mid-grab)
                max_new_tokens = _int_counts((max_new_tokens,), "max_new_tokens", (request_id,))[0]
            if max_new_tokens < 0:
                raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
        if prompt is None:
            prompt = _pack(token_ids, mm_items, request_id)
        elif not isinstance(prompt, LookupPrompt):
            raise TypeError(f"prompt must be pack_prompt's LookupPrompt, got {type(prompt).__name__}")
        else:
            # The request's own ids are made from `prompt.packed` (`_new_request`), and the
            # lookups read `prompt`: both must be these ids'. Nothing is copied: a list
            # comparison (C speed; the same int objects compare by identity first), and the
            # bytes, unless the caller vouches for them (a LookupPrompt whose list was changed
            # after pack_prompt, or one built by hand, would have other bytes). Unchecked, the
            # packing's length still is (one comparison): the request's ids, made from the
            # bytes, are then as many as the ids its lookups and hit point count
            ids = token_ids if type(token_ids) is list else list(token_ids)
            known = prompt.token_ids  # (a CheckedPrompt's tuple compares as a list only to a tuple)
            if (
                # the engine's admission passes the one list its prompt was packed over
                # (add_request's): equal to itself, not read (a chat prompt's ~2,000 ids)
                (known is not ids and (known if type(known) is list else list(known)) != ids)
                or prompt.mm_items != (check_mm_items(mm_items, len(ids)) if mm_items else ())
                or (
                    prompt.packed != token_bytes(ids) if check_packing else len(prompt.packed) != len(ids) * TOKEN_BYTES
                )
            ):
                raise ValueError(f"request {request_id!r}: the packed prompt is not of these token ids and items")
        req = self._new_request(request_id, prompt, tenant_salt, descriptor, token_ids if share_ids else None)  # type: ignore[arg-type]
        hits, point = self._admission_hits(req.roots, prompt) if self._caching else ({}, 0)
        rest = len(req.token_ids) - point
        n = rest if max_new_tokens is None else min(max_new_tokens, rest)
        end = point + n
        plans: dict[str, Any] = {}
        needs: dict[BlockPool, int] = {}
        for name, g in self.groups.items():
            plans[name], need = g.plan_admit(hits.get(name), point, end)
            for pool, k in need.items():
                needs[pool] = needs.get(pool, 0) + k
        if not self._fits(needs):
            return None
        # Checked in every group; mutate: every group's hit held first, then the allocations
        for name, g in self.groups.items():
            g.claim(plans[name])
        admit_copies = {}
        for name, g in self.groups.items():
            req.states[name], admit_copies[name] = g.apply_admit(plans[name], req.roots[name])
        # The lower tier's blocks are in flight until loaded: not computed, not findable
        num_loading = 0
        for name, g in self.groups.items():
            loads = g.loads(req.states[name])
            if loads:
                num_loading += len(loads) * g.granularity
        req.num_loading = num_loading
        if num_loading:
            self._loading.add(request_id)
        # (the loading blocks are in the table: its end covers them, a step reserved or not)
        req.num_computed, req.end = point - num_loading, point
        req.admitted_at = point
        req.budget = rest if max_new_tokens is None else max_new_tokens
        self._add_request(req)
        self._fresh.add(request_id)
        req.readmitted = request_id in self._preempted
        req.uncounted = request_id in self._recomputing
        self._count_admission(req)
        step = self._apply_reserve([req], [end]) if n else {}
        self._decode_step = memo  # (its rows were admitted before this request, which joined last)
        return Admission(point, n, self._admission_parts(req, admit_copies, step))

    def _admission_parts(
        self,
        req: _Request,
        admit_copies: dict[str, tuple[BlockCopy, ...]] | None = None,
        step: dict[str, list[GroupReservation] | None] | None = None,
    ) -> dict[str, GroupAdmission]:
        """Each group's part of an admission: its table now, the admission's copies and the
        first step's (`step`: `_apply_reserve`'s result), its restore, checkpoints, loads."""
        parts = {}
        for name, g in self.groups.items():
            state, step_parts = req.states[name], (step or {}).get(name)
            res = step_parts[0] if step_parts else None
            copies = admit_copies[name] if admit_copies else ()
            parts[name] = GroupAdmission(
                tuple(g.block_ids(state)),
                g.first_block(state),
                copies + res.copies if res is not None else copies,
                g.restore(state),
                res.checkpoints if res is not None else (),
                tuple(g.loads(state)),
            )
        return parts

    def complete_loads(self, request_id: str, num_loaded: int) -> Admission:
        """The first `num_loaded` blocks of the admission's `loads` hold their content now
        (copied and checked): they join the request's computed prefix and become findable,
        in order. The rest (a lower-tier entry gone or refused since admission) are computed
        instead: the returned Admission is the one the engine must follow, its first step
        starting after the loaded blocks."""
        self._decode_step = None  # (the counts move below)
        req = self._get(request_id)
        num_loaded = _int_counts((num_loaded,), "num_loaded", (request_id,))[0]
        loading = [(name, g) for name, g in self.groups.items() if g.loads(req.states[name])]
        num_blocks = sum(len(g.loads(req.states[name])) for name, g in loading)
        if not 0 <= num_loaded <= num_blocks or len(loading) > 1:
            raise ValueError(f"request {request_id!r}: {num_loaded} blocks loaded, but {num_blocks} were to load")
        loaded_tokens = 0
        for name, g in loading:
            g.complete_loads(req.states[name], num_loaded)
            loaded_tokens = num_loaded * g.granularity
        req.num_computed += loaded_tokens
        req.num_loading = 0
        self._loading.discard(request_id)
        if not req.uncounted:
            self.stats.num_lower_tier_hit_tokens += loaded_tokens
            queried, hits, loaded = req.counted
            req.counted = (queried, hits, loaded + loaded_tokens)
            self._count_hit(req, loaded_tokens)
        # exact steps: the step reserved (the admission's, from the loads' start) is committed
        # whole: the tokens of the blocks not loaded join it, past the budget by them
        n = req.end - req.num_computed if self.exact_steps else min(req.budget, len(req.token_ids) - req.num_computed)
        assert req.num_computed + n <= req.end, "the admission's blocks cover the step"
        return Admission(req.num_computed, n, self._admission_parts(req))

    def _count_admission(self, req: _Request) -> None:
        if req.uncounted:  # (admitted again to be recomputed: it counted at its first admission)
            self._recomputing.discard(req.request_id)
            self._preempted.discard(req.request_id)
            return
        if req.readmitted:
            self._preempted.discard(req.request_id)
            self.stats.num_readmissions += 1
        else:
            self.stats.num_requests += 1
            self.stats.num_queried_tokens += len(req.token_ids)
            req.counted = (len(req.token_ids), 0, 0)
        self._count_hit(req, req.num_computed)

    def _count_hit(self, req: _Request, num_tokens: int) -> None:
        """`num_tokens` more of the request's prefix came from the cache (or a lower tier)."""
        if req.uncounted:
            return
        if req.readmitted:
            self.stats.num_readmitted_hit_tokens += num_tokens
        else:
            self.stats.num_hit_tokens += num_tokens
        queried, hits, loaded = req.counted
        req.counted = (queried, hits + num_tokens, loaded)

    def give_up_admission(self, request_id: str) -> None:
        """The caller gives the request's admission up and will admit it again (what its
        admission needed past the cache's part raised: a tier's load, a state restore): its
        release, next, takes back what the admission added to `stats`, so that each request
        counts once, and a readmission stays marked preempted (admitted again, it counts as
        one). KeyError for a request not admitted."""
        self._requests[request_id].given_up = True

    def will_recompute(self, request_id: str) -> None:
        """The caller releases the request next and admits it again to recompute it (the
        engine, after a step's fault where the step cannot be reserved again: a cache of exact
        steps, an executor with per-request state). Counted at its admission already, its
        next admission counts nothing (queried, hit or lower-tier tokens, a readmission): the
        stats are the run's without the fault, as where the step is reserved again. KeyError
        for a request not admitted."""
        self._requests[request_id].recompute = True

    def _uncount_admission(self, req: _Request) -> bool:
        """The request's admission as if never counted (`give_up_admission`). True where its
        next admission counts nothing: this one counted nothing (its release marks it to recompute)."""
        if req.uncounted:
            return True
        stats, (queried, hits, loaded) = self.stats, req.counted
        stats.num_lower_tier_hit_tokens -= loaded
        if req.readmitted:
            stats.num_readmissions -= 1
            stats.num_readmitted_hit_tokens -= hits
            self._preempted.add(req.request_id)
        else:
            stats.num_requests -= 1
            stats.num_queried_tokens -= queried
            stats.num_hit_tokens -= hits
        return False

    def _step_requests(self, request_ids: Sequence[str]) -> list[_Request]:
        """A step's requests, in order, once they name no request twice (its lists agree in
        length: `reserve_step` and `commit_step` checked them first); ValueError otherwise,
        KeyError for an unknown id."""
        if len(set(request_ids)) != len(request_ids):
            raise ValueError(f"a request appears twice in {list(request_ids)}")
        try:
            return list(map(self._requests.__getitem__, request_ids))  # (the engine's path: once per step)
        except KeyError as missing:
            raise KeyError(f"unknown request {missing.args[0]!r}") from None

    def _check_reserve(self, req: _Request, num_new_tokens: int) -> None:
        if req.num_loading:
            raise ValueError(f"request {req.request_id!r} has lower-tier blocks to load (complete_loads first)")
        if self.exact_steps and req.end != req.num_computed:
            raise ValueError(
                f"request {req.request_id!r} already has an uncommitted reservation (an uncommitted step: "
                f"commit it first)"
            )
        if num_new_tokens < 0:
            raise ValueError(f"request {req.request_id!r}: num_new_tokens must be >= 0, got {num_new_tokens}")
        if req.num_computed + num_new_tokens > len(req.token_ids):
            first = "append the ids to the caller's list first: share_ids" if req.shared else "append_token_ids first"
            raise ValueError(
                f"request {req.request_id!r}: cannot compute {num_new_tokens} tokens from {req.num_computed}: only "
                f"{len(req.token_ids)} token ids are known ({first})"
            )

    def _needs(self, reqs: list[_Request], ends: list[int]) -> dict[BlockPool, int]:
        """Free blocks each pool gives the step, all groups together."""
        total: dict[BlockPool, int] = {}
        for g in self._group_list:
            n = g.blocks_needed(reqs, ends)
            if n:
                total[g.pool] = total.get(g.pool, 0) + n
        return total

    def _apply_reserve(
        self, reqs: list[_Request], ends: list[int], detail: bool = True
    ) -> dict[str, list[GroupReservation] | None]:
        """Every group's part of the step, per request; the requests' reserved ends move."""
        self._decode_step = None  # (the counts move below)
        parts = {g.name: g.apply_reserve(reqs, ends, detail=detail) for g in self._group_list}
        if self.exact_steps:
            for req, end in zip(reqs, ends, strict=True):
                req.end = end
        else:  # the blocks a step may write are writable to their end
            unit = self.hit_granularity
            for req, end in zip(reqs, ends, strict=True):
                if end > req.end:
                    req.end = -(-end // unit) * unit
        return parts

    def reserve(self, request_id: str, num_new_tokens: int) -> Reservation | None:
        """Room for positions [num_computed, num_computed + num_new_tokens), whose token ids
        must be known; each group's part in `groups`. None when it does not fit; nothing
        changed. Not exact steps: a repeated reserve before commit replaces the previous one
        (the reservation only grows)."""
        req = self._get(request_id)
        if num_new_tokens.__class__ is not int:
            num_new_tokens = _int_counts((num_new_tokens,), "a reservation's token count", (request_id,))[0]
        self._check_reserve(req, num_new_tokens)
        start = req.num_computed
        end = start + num_new_tokens
        if not self.exact_steps and end <= req.end:
            return Reservation(start, num_new_tokens, dict.fromkeys(self.groups, NO_RESERVATION))  # nothing to take
        if not self._fits(self._needs([req], [end])):
            return None
        parts = {name: res[0] for name, res in self._apply_reserve([req], [end]).items()}
        return Reservation(start, num_new_tokens, parts)

    def unreserve(self, request_id: str) -> None:
        """Undo the request's reserved step, whose forward has not run (another request of
        the batch did not fit, say). Undone latest first (no call since that changed the
        cache), every group is exactly as it was before the reservation; out of order, each
        group's `unreserve` says what it restores. Nothing reserved: nothing done.
        ValueError, nothing done, when a group cannot (`CacheGroup.can_unreserve`)."""
        self._decode_step = None  # (the counts move below)
        req = self._get(request_id)
        if req.end == req.num_computed:
            return
        cannot = [name for name, g in self.groups.items() if not g.can_unreserve]
        if cannot:
            raise ValueError(f"request {request_id!r}: groups {cannot} cannot undo a reserved step")
        for name, g in self.groups.items():
            g.unreserve(req.states[name])
        req.end = req.num_computed

    def reserve_step(self, request_ids: Sequence[str], num_new_tokens: Sequence[int]) -> bool:
        """`reserve` for a whole step, all or nothing: False (nothing changed) when the step
        does not fit; the details (copies, checkpoints) are queried apart. Not exact steps: a request whose
        reserved slots already cover its tokens (a decode inside its block) costs one
        comparison, and token ids are checked only where blocks are taken (`commit_step`
        refuses a commit past the known tokens before any change)."""
        if num_new_tokens.__class__ is not list and num_new_tokens.__class__ is not tuple:
            num_new_tokens = list(num_new_tokens)  # (a numpy array has no `count`, which the paths below ask)
        if len(request_ids) != len(num_new_tokens):
            raise ValueError(f"{len(request_ids)} requests but {len(num_new_tokens)} token counts")
        if not request_ids:
            return True
        period = self._decode_period
        if self.exact_steps and period is not None and num_new_tokens.count(1) == len(request_ids):  # all decodes
            fits = self._reserve_decodes(request_ids, period)
            if fits is not None:
                return fits
            # a request at fault, nothing changed: the twin names it
        return self._reserve_each(request_ids, num_new_tokens)

    def _reserve_decodes(self, request_ids: Sequence[str], period: int) -> bool | None:
        """An exact decode step's reservation in one pass that checks each request and moves
        its end; only the requests whose step ends on the decode period go to the groups
        (`decode_reserve_period`). True, or False when the step does not fit, or None when a
        request is unknown, listed twice (its second entry finds a step reserved) or cannot
        reserve; on False or None every end is back (nothing changed). Rows the committed
        memo vouches for are moved unchecked: every row of the step it committed but its
        holes (rows without their next token id), or, the batch changed since (rows left,
        rows joined at the end), its rows that stayed, holes excepted; the others checked.
        `_reserve_each` is its naive twin (tests/test_dsv4_cache.py holds them equal)."""
        committed, self._decode_step = self._decode_step, None
        memo_ids = left = None  # the committed memo's ids and those that left since, for a carry
        if committed is not None and not committed[3] and committed[0] is self._resolved:
            memo_ids, left = self._resolved_list, self._left  # (`_resolve` replaces, never changes, them)
        self._carried = None
        try:
            reqs = self._resolve(request_ids)
        except KeyError:
            return None
        carried, self._carried = self._carried, None  # (`_resolve_changed`'s deletions, if it carried)
        touched: list[_Request] = []
        ends: list[int] = []  # (its length counts the requests moved)
        starts = None  # (each row's computed count, where the committed memo has them)
        kept: list[int] = []  # the committed memo's ends of the rows [0, len(kept)) it vouches for
        if committed is not None and not committed[3]:
            if reqs is committed[0] and not committed[5]:
                kept = starts = committed[1]
            elif left is not None and memo_ids is not None:
                holes = committed[5]
                if carried is not None and carried[0] is committed[0] and all(h in left for h in holes):
                    # `_resolve` carried the memo's rows (its own, `reqs[:k]`), deleting those
                    # that left, the holes among them: the same rows of the ends
                    kept = committed[1].copy()
                    for i in carried[1]:
                        del kept[i]
                else:  # (the rows without a next token, which leave: as the rows that left)
                    kept = self._carried_ends(reqs, memo_ids, [*left, *holes] if holes else left, committed)
                if len(kept) == len(reqs):  # (rows left, none joined: its ends are the starts)
                    starts = kept
        # The step `_commit_decodes` or `_commit_chunks` committed, nothing moved since (the
        # memo's invariant): a row it vouches for is computed to its end with no step
        # pending, nothing loading, its next token id known: its step [end, end + 1) needs
        # no check
        for req, end in zip(reqs, kept, strict=False):  # (the first len(kept) rows)
            req.end = end = end + 1
            ends.append(end)
            if not end % period:
                touched.append(req)
        if len(kept) < len(reqs):
            for req in reqs[len(kept) :] if kept else reqs:  # the rows joined since: checked
                nc = req.num_computed
                if req.end != nc or req.num_loading or nc >= len(req.token_ids):
                    break  # (a request listed twice: its second entry finds its step reserved)
                req.end = nc = nc + 1
                ends.append(nc)
                if not nc % period:
                    touched.append(req)
            if len(ends) < len(reqs):  # undo the ends moved before the request at fault
                for req in reqs[: len(ends)]:
                    req.end -= 1
                return None
        if touched:
            touched_ends = [req.end for req in touched]
            if not self._fits(self._needs(touched, touched_ends)):
                for req in reqs:
                    req.end -= 1
                return False
            for g in self._group_list:  # `_apply_reserve`, whose loop over the ends is done above
                g.apply_reserve(touched, touched_ends, detail=False)
        self._decode_step = (reqs, ends, touched, True, starts, [])
        if reqs is self._resolved:  # (a row named twice finds its step reserved: these are distinct)
            self._resolved_distinct = True  # (which lets `_resolve_changed` carry the next change)
        return True

    @staticmethod
    def _carried_ends(
        reqs: list[_Request],
        memo_ids: list[str],
        left: list[str],
        committed: _DecodeMemo,
    ) -> list[int]:
        """The committed memo's ends of a changed step's leading rows: the memo's rows less
        those whose ids are in `left` (the ids that left since, each deleted as
        `_resolve_changed` deletes it, and the rows the memo does not vouch for), when the
        step's rows begin with exactly those (the same objects); else none."""
        ids, kept, ends = memo_ids.copy(), committed[0].copy(), committed[1].copy()
        for request_id in left:  # (one row each at most: the memo's rows are distinct)
            try:
                i = ids.index(request_id)
            except ValueError:
                continue  # (a request that was not in the step)
            del ids[i], kept[i], ends[i]
        return ends if reqs[: len(kept)] == kept else []

    def _reserve_each(self, request_ids: Sequence[str], num_new_tokens: Sequence[int]) -> bool:
        """`reserve_step` request by request: every request checked, then the groups asked
        about every request that takes anything."""
        if self._loading and not self.exact_steps:
            # a step inside a loading request's reserved blocks takes nothing, so the checks
            # below never see it; it would write the blocks its loads fill: refused as `reserve`
            for request_id in request_ids:
                if request_id in self._loading:
                    self._check_reserve(self._requests[request_id], 0)  # raises
        if not self.exact_steps and num_new_tokens.count(1) == len(request_ids):  # all decodes
            try:
                pending = [r for r in map(self._requests.__getitem__, request_ids) if r.num_computed >= r.end]
            except KeyError as missing:
                raise KeyError(f"unknown request {missing.args[0]!r}") from None
            if not pending:
                return True  # a request listed twice inside its reservation is harmless: nothing is taken
            if len(set(map(id, pending))) != len(pending):
                raise ValueError(f"a request appears twice in {list(request_ids)}")
            ends = []
            for req in pending:
                end = req.num_computed + 1
                if req.num_loading or end > len(req.token_ids):
                    self._check_reserve(req, 1)  # raises
                ends.append(end)
        elif self.exact_steps and num_new_tokens.count(1) == len(request_ids):  # exact steps, all decodes
            pending, ends = self._step_requests(request_ids), []
            for req in pending:  # one pass: checked (`_check_reserve` names what is wrong), and the ends
                nc = req.num_computed
                if req.end != nc or req.num_loading or nc >= len(req.token_ids):
                    self._check_reserve(req, 1)  # raises
                ends.append(nc + 1)
        else:
            reqs = self._step_requests(request_ids)
            if not _all_ints(num_new_tokens):  # (the checks below are comparisons, which nan passes)
                num_new_tokens = _int_counts(num_new_tokens, "a reservation's token count", request_ids)
            if min(num_new_tokens) < 0:
                raise ValueError(f"num_new_tokens must be >= 0, got {min(num_new_tokens)}")
            if self.exact_steps:  # every request reserves; `_check_reserve` names what is wrong
                pending, ends = reqs, [req.num_computed + n for req, n in zip(reqs, num_new_tokens, strict=True)]
                for req, end in zip(reqs, ends, strict=True):
                    if req.end != req.num_computed or req.num_loading or end > len(req.token_ids):
                        self._check_reserve(req, end - req.num_computed)  # raises
            else:
                pending, ends = [], []
                for req, n in zip(reqs, num_new_tokens, strict=True):
                    if req.num_computed + n > req.end:
                        self._check_reserve(req, n)
                        pending.append(req)
                        ends.append(req.num_computed + n)
        if not pending:
            return True
        if not self._fits(self._needs(pending, ends)):
            return False
        self._apply_reserve(pending, ends, detail=False)
        return True

    def append_token_ids(self, request_id: str, token_ids: Iterable[int]) -> None:
        """Sampled tokens join the sequence; a later step computes them. ValueError, nothing
        changed, for an id that is no int in [0, 2**32), or for a request admitted with
        share_ids (its ids are the caller's list: they join it there); TypeError for ids
        that are no sequence (a str, bytes, a dict or a set), as admit's."""
        req = self._get(request_id)
        if req.shared:
            raise ValueError(f"request {request_id!r} reads its token ids from the caller's list (share_ids)")
        if token_ids.__class__ is not list and isinstance(token_ids, (str, bytes, bytearray, Mapping, AbstractSet)):
            # (as admit's: bytes joined as their byte values, a dict as its keys, a set in hash order)
            raise TypeError(
                f"request {request_id!r}: token_ids must be a sequence of ints, got {type(token_ids).__name__}"
            )
        req.token_ids.extend(_token_ids_array(request_id, token_ids))

    def commit(self, request_id: str, num_tokens: int) -> None:
        """The next `num_tokens` reserved positions are written: they become readable, and
        blocks they complete are published for prefix caching."""
        self.commit_step((request_id,), (num_tokens,), (None,))

    def commit_step(
        self, request_ids: Sequence[str], num_tokens: Sequence[int], next_token_ids: Sequence[int | None]
    ) -> None:
        """`commit` for a whole step, validated first, then each request's sampled token joins
        its sequence (None: no token, e.g. a prefill chunk that ends before the prompt does).
        Every group is called once, with the requests whose commit may change it: those of
        more than one token, and those of one that complete one of its units (`commit_period`)
        or that are new since their last commit."""
        if num_tokens.__class__ is not list and num_tokens.__class__ is not tuple:
            num_tokens = list(num_tokens)  # (a numpy array has no `count`, which the paths below ask)
        if not len(request_ids) == len(num_tokens) == len(next_token_ids):
            raise ValueError(
                f"{len(request_ids)} requests, {len(num_tokens)} token counts, {len(next_token_ids)} next tokens"
            )
        # (a request whose hit a lower tier still loads: its admission's step begins at the
        # loading blocks, not computed until `complete_loads`, and a commit over them would
        # count unloaded slots computed and publish them: the twin refuses it)
        if request_ids and not (self._loading and not self._loading.isdisjoint(request_ids)):
            if num_tokens.count(1) == len(request_ids):  # all decodes: the engine's common step
                changed = self._commit_decodes(request_ids, next_token_ids)
            else:  # prefill chunks, with the decodes of the running requests (counts of ints: see `_all_ints`)
                changed = (
                    self._commit_chunks(request_ids, num_tokens, next_token_ids) if _all_ints(num_tokens) else None
                )
            if changed is not None:
                if changed:
                    self._commit_groups(changed)
                return
            # a request at fault, nothing changed: the twin below names it
        self._commit_each(request_ids, num_tokens, next_token_ids)

    def _commit_decodes(
        self, request_ids: Sequence[str], next_token_ids: Sequence[int | None]
    ) -> list[_Request] | None:
        """A decode step's commit in one pass that checks and changes each request: the
        requests the groups must see (`commit_step`), or None when a request is unknown or
        listed twice, or its commit is not of one reserved token whose id is known: then
        every change is undone (None: nothing changed). `_commit_each` is its naive twin
        (tests/test_dsv4_cache.py holds them equal)."""
        reserved, self._decode_step = self._decode_step, None  # (the counts move below)
        period, exact = self._commit_period, self.exact_steps
        try:
            reqs = self._resolve(request_ids)
        except KeyError:
            return None
        if not exact and not self._distinct(request_ids, reqs):
            return None  # (exact steps: a request's second entry finds its one token committed)
        changed: list[_Request] = []
        i = 0  # rows committed (the checked loop counts them; the memo's loop, all or the one at fault)
        memo = reserved is not None and reserved[3] and reqs is reserved[0]
        try:
            if memo:
                # The step `_reserve_decodes` reserved, nothing moved since: row i's reserved
                # step is its one token [ends[i] - 1, ends[i]) (the memo's invariant), nothing
                # to check; the rows on the decode period are the memo's
                holes: list[str] = []  # the rows whose next token id is not given
                for req, end, next_token_id in zip(reqs, reserved[1], next_token_ids, strict=True):
                    req.num_computed = end
                    if next_token_id is None:
                        holes.append(req.request_id)
                    elif not req.shared:  # (a shared list holds it already)
                        req.token_ids.append(next_token_id)
                i = len(reqs)
                changed = reserved[2]  # (the commit period is the decode period: see __init__)
                # the next step's reserve needs no check of the other rows (see __init__)
                self._decode_step = (reqs, reserved[1], [], False, None, holes)
            else:
                for req, next_token_id in zip(reqs, next_token_ids, strict=True):
                    nc = req.num_computed + 1
                    # exact: the step reserved this one token; else: it lies within the reservation, its id known
                    if (req.end != nc) if exact else (nc > req.end or nc > len(req.token_ids)):
                        break
                    req.num_computed = nc
                    if not nc % period:
                        changed.append(req)
                    if not req.shared and next_token_id is not None:  # (a shared list holds it already)
                        req.token_ids.append(next_token_id)
                    i += 1
        except (OverflowError, TypeError):  # an id the array cannot hold: undone, the twin names it
            if memo:
                i = reqs.index(req)  # (`req`: the row at fault; the memo's rows are distinct)
            reqs[i].num_computed -= 1
        if i < len(reqs):  # undo the requests before the one at fault, latest first
            for req, next_token_id in zip(reversed(reqs[:i]), reversed(next_token_ids[:i]), strict=True):
                req.num_computed -= 1
                if next_token_id is not None and not req.shared:
                    req.token_ids.pop()
            return None
        fresh = self._fresh
        if fresh:  # (in step order: the order groups publish in decides which copy is findable)
            changed = [req for req in reqs if not req.num_computed % period or req.request_id in fresh]
        return changed

    def _commit_chunks(
        self, request_ids: Sequence[str], num_tokens: Sequence[int], next_token_ids: Sequence[int | None]
    ) -> list[_Request] | None:
        """`_commit_decodes` for a step of any token counts (an admitted request's prefill
        chunk among the decodes): the requests the groups must see, or None when a request
        is unknown or listed twice, or its commit is not of its reserved step (exact steps)
        or does not lie within its reservation and known token ids: then every change is
        undone. The step's leading rows that `_reserve_decodes` reserved (the engine's
        running decodes, the joiners' chunks after them), where the decode-step memo vouches
        for them (an admission since keeps it), go unchecked as a decode step's do; the
        other rows are checked one by one. A step that went through the memo's rows leaves a
        committed memo over all its rows (see __init__), the rows without their next token
        id (or loading) among its holes. `_commit_each` is its naive twin
        (tests/test_dsv4_cache.py holds them equal)."""
        reserved, self._decode_step = self._decode_step, None  # (the counts move below)
        period, exact, fresh = self._commit_period, self.exact_steps, self._fresh
        try:
            reqs = self._resolve(request_ids)
        except KeyError:
            return None
        if not self._distinct(request_ids, reqs):
            return None
        changed: list[_Request] = []
        # A few fresh requests (the joiners, whose chunks change the groups anyway) are
        # looked for after the pass, not asked about at every decode row
        ask_fresh = len(fresh) > MAX_FRESH_APART
        k = 0  # [0, k) the memo's rows, committed unchecked | [k, len) checked
        if reserved is not None and reserved[3]:
            k = len(reserved[0])
            if not (reqs[:k] == reserved[0] and num_tokens[:k].count(1) == k):
                k = 0
        req = None
        i = 0  # (the memo's rows committed: all, or the one at fault)
        failed = False
        holes: list[str] = []  # the memo's rows whose next token id is not given
        try:
            if k:
                # The decodes `_reserve_decodes` reserved, nothing moved since (the memo's
                # invariant): row i's step is its one token [ends[i] - 1, ends[i]), nothing
                # to check; the rows on the decode period are the memo's (`_commit_decodes`)
                for req, end, next_token_id in zip(reqs, reserved[1], next_token_ids, strict=False):  # (its k rows)
                    req.num_computed = end
                    if next_token_id is None:
                        holes.append(req.request_id)
                    elif not req.shared:  # (a shared list holds it already)
                        req.token_ids.append(next_token_id)
                i = k
                if ask_fresh:  # (in step order, the memo's fresh requests among them)
                    changed = [req for req in reqs[:k] if not req.num_computed % period or req.request_id in fresh]
                else:  # (the commit period is the decode period: see __init__)
                    changed = reserved[2].copy()  # (the memo's own list: the rows after are appended)
            rows = (
                zip(reqs[k:], num_tokens[k:], next_token_ids[k:], strict=True)
                if k
                else zip(reqs, num_tokens, next_token_ids, strict=True)
            )
            n = 0
            for req, n, next_token_id in rows:
                nc = req.num_computed + n
                # exact: the whole reserved step (its end stays num_computed after); else within it, ids known
                if (req.end != nc) if exact else (n < 0 or nc > req.end or nc > len(req.token_ids)):
                    failed = True
                    break
                if n:
                    req.num_computed = nc
                    # a one-token commit off the period of a request not fresh changes no group (`commit_period`)
                    if n != 1 or not nc % period or (ask_fresh and req.request_id in fresh):
                        changed.append(req)
                if not req.shared and next_token_id is not None:  # (a shared list holds it already)
                    req.token_ids.append(next_token_id)
        except (OverflowError, TypeError):  # an id the array cannot hold: undone, the twin names it
            if i < k:  # (in the memo's rows: `req` is the one at fault, the rows are distinct)
                i = reqs.index(req)
            req.num_computed -= 1 if i < k else n  # (its count moved, its token did not join)
            failed = True
        if failed:  # undo the rows before the one at fault, latest first (`req`: distinct rows)
            for j in reversed(range(i if i < k else reqs.index(req))):
                req = reqs[j]
                req.num_computed -= num_tokens[j]
                if next_token_ids[j] is not None and not req.shared:
                    req.token_ids.pop()
            return None
        if fresh and not ask_fresh and self._fresh_decodes(request_ids, reqs, num_tokens):
            # a fresh request's one-token commit off the period (a fork's first decode, say):
            # the groups see it too, in step order (the order groups publish in decides which
            # copy is findable)
            changed = [
                req
                for req, n in zip(reqs, num_tokens, strict=True)
                if n and (n != 1 or not req.num_computed % period or req.request_id in fresh)
            ]
        if k:
            # The next step's reserve needs no check of the memo's rows that know their next
            # token id (see __init__), nor of the rows after them that are computed to their
            # end and know it (a chunk that ends the prompt: the sampled token; one inside it:
            # the prompt's next). None of them loads: `commit_step` sends a step that names a
            # request still loading to the twin, which refuses it (and a memo is kept on a
            # cache of dual-pool groups only, the groups with a decode period, none of which
            # loads: its lower tier installs blocks at `prefetch_candidates`, no admission's
            # `loads`)
            for req in reqs[k:]:
                if len(req.token_ids) <= req.num_computed:
                    holes.append(req.request_id)
            self._decode_step = (reqs, reserved[1] + [req.num_computed for req in reqs[k:]], [], False, None, holes)
        return changed

    def _fresh_decodes(self, request_ids: Sequence[str], reqs: list[_Request], num_tokens: Sequence[int]) -> bool:
        """Whether a fresh request's row in a committed step is a one-token commit off the
        commit period (which the pass over the rows left out of the changed ones)."""
        period = self._commit_period
        for request_id in self._fresh:
            try:
                i = request_ids.index(request_id)
            except ValueError:
                continue  # (not in this step)
            if num_tokens[i] == 1 and reqs[i].num_computed % period:
                return True
        return False

    def _commit_groups(self, changed: list[_Request]) -> None:
        """Every group commits the requests whose commit may change it; they are not fresh any more."""
        for g in self._group_list:
            g.commit(changed)
        if self._fresh:
            self._fresh.difference_update(req.request_id for req in changed)

    def _commit_each(
        self, request_ids: Sequence[str], num_tokens: Sequence[int], next_token_ids: Sequence[int | None]
    ) -> None:
        """`commit_step` request by request: every request checked, then changed. The naive
        twin of the fast paths, and the contract they trust: a share_ids request's named next
        ids are in the caller's list already (checked here only)."""
        self._decode_step = None  # (the counts move below)
        reqs = self._step_requests(request_ids)
        if not reqs:
            return
        num_tokens = _int_counts(num_tokens, "a commit's token count", request_ids)
        loading = next((req for req in reqs if req.num_loading), None)
        if loading is not None:
            raise ValueError(f"request {loading.request_id!r} has lower-tier blocks to load (complete_loads first)")
        for req, next_token_id in zip(reqs, next_token_ids, strict=True):  # (the arrays take them below)
            if next_token_id is not None:
                _token_ids_array(req.request_id, (next_token_id,))  # ValueError naming a bad id
        bad = None
        if self.exact_steps:
            for req, n in zip(reqs, num_tokens, strict=True):
                if n != req.end - req.num_computed:
                    raise ValueError(
                        f"request {req.request_id!r}: commit of {n} token{'s' * (n != 1)}, but the step reserved "
                        f"{req.end - req.num_computed} (a recurrent state advances by whole steps)"
                    )
        else:
            if min(num_tokens) < 0:
                raise ValueError(f"a commit of {min(num_tokens)} tokens")
            bad = next(
                (
                    req
                    for req, n in zip(reqs, num_tokens, strict=True)
                    if n > req.end - req.num_computed or req.num_computed + n > len(req.token_ids)
                ),
                None,
            )
        if bad is not None:
            nc, n = bad.num_computed, num_tokens[reqs.index(bad)]
            raise ValueError(
                f"request {bad.request_id!r}: commit of {n} tokens from position {nc}: "
                f"{bad.end - nc} reserved, {len(bad.token_ids) - nc} token ids known"
            )
        # share_ids' contract, which the fast paths trust (docs/core_api.md): the caller's list
        # holds a commit's named next id at its position already
        for req, n, next_token_id in zip(reqs, num_tokens, next_token_ids, strict=True):
            if next_token_id is not None and req.shared:
                at, ids = req.num_computed + n, req.token_ids
                if at >= len(ids) or ids[at] != next_token_id:
                    held = f"holds {ids[at]}" if at < len(ids) else f"ends at {len(ids)}"
                    raise ValueError(
                        f"request {req.request_id!r}: the commit names next token id {next_token_id} at position "
                        f"{at}, where the caller's list {held} (share_ids: append it to the list before the commit)"
                    )
        fresh, period = self._fresh, self._commit_period
        changed = []
        for req, n, next_token_id in zip(reqs, num_tokens, next_token_ids, strict=True):
            if n:
                nc = req.num_computed + n
                req.num_computed = nc
                # a one-token commit off the period of a request not fresh changes no group (`commit_period`)
                if n != 1 or not nc % period or req.request_id in fresh:
                    changed.append(req)
            if next_token_id is not None and not req.shared:
                req.token_ids.append(next_token_id)
        if self.exact_steps:  # the whole reserved step is committed
            for req in reqs:
                req.end = req.num_computed
        if changed:
            self._commit_groups(changed)

    def fork(self, parent_id: str, child_id: str) -> bool:
        """A child sharing the parent's computed blocks, with its own live state in every
        recurrent group and its own state block in every dual-pool group (the runner copies
        the parent's into them). False, nothing changed, when one of them has no free slot.
        Not exact steps: the parent gives up its reservation past its computed tokens (the
        shared tail is read-only for both; each side copies it on its next write).
        ValueError, nothing changed, when the parent's lower-tier loads are pending; TypeError,
        nothing changed, for a child id that is no str."""
        if child_id.__class__ is not str:
            _check_id(child_id)
        self._decode_step = None  # (the counts move below)
        parent = self._get(parent_id)
        if parent.num_loading:
            # its blocks past the computed prefix await their data: the truncation below would
            # drop them from its table while its states still list them as loading (and the
            # child would share a table whose loads only the parent completes)
            raise ValueError(f"request {parent_id!r} has lower-tier blocks to load (complete_loads first)")
        if child_id in self._requests:
            raise ValueError(f"request {child_id!r} already exists")
        nc = parent.num_computed
        if self.exact_steps and parent.end != nc:
            raise ValueError(f"request {parent_id!r} has an uncommitted step; fork after commit")
        if not all(g.can_fork() for g in self._group_list):
            return False
        if parent.end != nc:
            for name, g in self.groups.items():
                g.truncate(parent.states[name], nc)
            parent.end = nc
        ids = parent.token_ids[:nc]  # (the child's own: an array, also of a parent's shared list)
        child = _Request(child_id, ids if type(ids) is array else array("I", ids), parent.mm_items, dict(parent.roots))
        child.num_computed = child.end = nc
        for name, g in self.groups.items():
            child.states[name] = g.fork(parent.states[name])
        self._add_request(child)
        self._fresh.add(child_id)
        return True

    def rollback(self, request_id: str, num_computed_tokens: int) -> None:
        """Shrink to `num_computed_tokens` (e.g. rejected speculative tokens): every group
        goes back (blocks past the new end released tail-first), the token ids past it are
        dropped. ValueError, nothing changed, when a group cannot (a recurrent state) or the
        request's lower-tier loads are pending, or it was admitted with share_ids (its ids are
        the caller's list, which the coordinator does not cut)."""
        req = self._get(request_id)
        if req.shared:
            raise ValueError(f"request {request_id!r} reads its token ids from the caller's list (share_ids)")
        self._decode_step = None  # (the counts move below)
        if req.num_loading:  # (its loads sit right after the computed prefix: complete_loads counts on it)
            raise ValueError(f"request {request_id!r} has lower-tier blocks to load (complete_loads first)")
        num_computed_tokens = _int_counts((num_computed_tokens,), "num_computed_tokens", (request_id,))[0]
        if not 0 <= num_computed_tokens <= req.num_computed:
            raise ValueError(
                f"request {request_id!r}: rollback to {num_computed_tokens} outside [0, {req.num_computed}]"
            )
        if not all(g.can_truncate(req.states[name], num_computed_tokens) for name, g in self.groups.items()):
            raise ValueError(f"request {request_id!r}: a group cannot go back to {num_computed_tokens} tokens")
        for name, g in self.groups.items():
            g.truncate(req.states[name], num_computed_tokens)
        del req.token_ids[num_computed_tokens:]
        req.num_computed = req.end = num_computed_tokens

    def mark_turn_end(self, request_id: str) -> dict[str, int]:
        """A turn ends here: per recurrent group, a slot to copy the live state into now (the
        state after the computed tokens), filed as a checkpoint that a follow-up turn extending
        this conversation hits, on the C grid or not. Groups with nothing to take (a
        checkpoint there already, no free slot) are left out. No step may be pending, nor a
        lower-tier load (ValueError naming the request, nothing changed)."""
        req = self._get(request_id)
        if req.num_loading:  # (its admission's step is pending too: named first, as fork and rollback do)
            raise ValueError(f"request {request_id!r} has lower-tier blocks to load (complete_loads first)")
        if req.end != req.num_computed:
            raise ValueError(f"request {request_id!r} has an uncommitted step; mark the turn end after commit")
        slots = {}
        for name, g in self.groups.items():
            slot = g.mark_turn_end(req.states[name], req.token_ids, req.mm_items, req.num_computed)
            if slot is not None:
                slots[name] = slot
        if slots:
            self._fresh.add(request_id)
        return slots

    def release(self, request_id: str, reason: ReleaseReason = "finish") -> bool:
        """Free everything the request holds (tables tail-first, so a chain's tail is evicted
        before its head). False, and nothing done, for a request already released;
        ValueError (nothing done) for a reason not in RELEASE_REASONS. A finish (no step
        pending) also keeps, when `turn_end_checkpoints` is on, what each group holds at the
        turn end of the request's computed tokens: a recurrent group's live state (the live
        slot holds it: nothing to copy), an attention group's partial last block."""
        if reason not in RELEASE_REASONS:
            raise ValueError(f"unknown release reason {reason!r}; one of {RELEASE_REASONS}")
        req = self._requests.get(request_id)
        interrupted, self._interrupted = self._interrupted, None
        if req is None:
            # `_preempted` stays exact: a preemption marks the request; any other release of
            # it (a cancel of a preempted request that waits, say) clears the mark. The marks
            # follow the reason of the last release: a repeat of a release that completed but
            # raised KeyboardInterrupt (the engine's, next step) keeps the recompute mark
            if reason != "preempt":
                self._preempted.discard(request_id)
            if interrupted != request_id:
                self._recomputing.discard(request_id)
            return False
        # All or nothing: Ctrl-C is held off till the request is gone (`_InterruptsHeld`), and
        # a group's release that raises leaves the request admitted, the groups before it
        # released: a repeat of the release goes on from that group (check_integrity holds)
        try:
            with _InterruptsHeld():
                if not req.releasing:
                    req.releasing = True
                    if reason != "preempt":
                        self._preempted.discard(request_id)
                    self._recomputing.discard(request_id)
                    if req.given_up:  # (the mark itself waits for the release's end, below)
                        req.recompute = self._uncount_admission(req)
                    if reason == "preempt":
                        self._preempted.add(request_id)
                    elif reason == "finish" and self.turn_end_checkpoints and req.end == req.num_computed:
                        for name, g in self.groups.items():
                            g.keep_turn_end(req.states[name], req.token_ids, req.mm_items, req.num_computed)
                    self._fresh.discard(request_id)
                elif reason == "preempt":  # a repeat: the preempt mark follows its reason (an
                    self._preempted.add(request_id)  # abort in between makes it a "cancel")
                elif not (req.given_up and req.readmitted and not req.uncounted):
                    self._preempted.discard(request_id)  # (a given-up readmission stays marked)
                groups, states = self._group_list, req.states
                while req.num_released < len(groups):
                    g = groups[req.num_released]
                    g.release(states[g.name])
                    req.num_released += 1
                # marked to recompute once the release completes, never while admitted (marked
                # at its start, a group's release that raised left an admitted request marked)
                if req.recompute:
                    self._recomputing.add(request_id)
                self._pop_request(request_id)
        except KeyboardInterrupt:
            if request_id not in self._requests:  # (done, the interrupt raised after it)
                self._interrupted = request_id
            raise
        return True

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix, as vLLM's `reset_prefix_cache` and SGLang's `flush_cache`
        do (after a weights update, or between benchmark runs): every group forgets its own
        records (turn ends, checkpoints), then every pool's cached free blocks become plain
        free blocks, so no lookup hits until new admissions publish their blocks again. The
        blocks' contents are not touched, and the tiers below a runner's pool keep their
        entries (a runner's lower tier is the runner's to clear). `stats` and the pools'
        collision counts go on counting. True when done (also with nothing cached).

        False, and nothing changed, while a request is admitted (its blocks are in use: a
        running request reads its own cached prefix; vLLM refuses while any block is in use,
        SGLang while any request runs or waits), or while a swapped-out state waits in a
        tier for its resume (`hold_swapped_state`): release them first."""
        if self._requests or not all(g.can_forget_prefixes() for g in self._group_list):
            return False
        for g in self._group_list:
            g.forget_prefixes()
        for pool in self._all_pools:  # (each pool once: a shared pool, V4's state and checkpoint pools)
            pool._forget_cached()  # (the one caller: the groups' records went first)
        self._looked_up.clear()  # (their stamps moved with the pools' versions anyway)
        return True

    # ---- invariants --------------------------------------------------------------------

    def check_integrity(self) -> None:
        # `_resolve`'s memo: each row's request is the one its id names, unless the id left
        # since (`_left`: the rows `_resolve_changed` deletes); its distinct flag is true
        assert (self._left is not None) or not self._resolved, "a memo without its log of the ids that left"
        left = set(self._left or ())
        assert len(self._resolved) == len(self._resolved_list)
        assert self._resolved_tuple is None or self._resolved_tuple == tuple(self._resolved_list)
        for request_id, req in zip(self._resolved_list, self._resolved, strict=True):
            assert request_id == req.request_id and (request_id in left or self._requests.get(request_id) is req), (
                f"resolve memo: row {request_id!r} is not its request"
            )
        if self._resolved_distinct is not None:
            assert self._resolved_distinct == (len(set(self._resolved_list)) == len(self._resolved_list))
        assert not self._recomputing & self._requests.keys(), "a request marked to recompute is admitted"
        memo = self._decode_step
        if memo is not None:  # the last decode step's memo (see __init__)
            reqs, ends, touched, pending, starts, holes = memo
            assert starts is None or (pending and starts == [end - 1 for end in ends]), "the memo's starts"
            assert not (pending and holes), "a pending memo's rows all know their token ids"
            period = self._decode_period
            assert self.exact_steps and period is not None, "a decode-step memo without a decode period"
            assert len(ends) == len(reqs) == len(set(map(id, reqs))), "the memo's rows are one step's"
            # a committed memo over `_resolve`'s rows keeps the rows that left since (`_left`)
            gone = left if not pending and reqs is self._resolved else set()
            for req, end in zip(reqs, ends, strict=True):
                if req.request_id in gone:
                    continue
                assert self._requests.get(req.request_id) is req, f"memo: request {req.request_id!r} left"
                computed, known = (end - 1, end) if pending else (end, end + (req.request_id not in holes))
                if not (req.num_computed == computed and req.end == end and len(req.token_ids) >= known):
                    raise AssertionError(
                        f"memo: request {req.request_id!r} computed {req.num_computed}, reserved to {req.end}, "
                        f"knows {len(req.token_ids)} tokens; the memo's step ends at {end} (pending: {pending})"
                    )
                assert not req.num_loading, f"memo: request {req.request_id!r} loads"
            rows = [req for req, end in zip(reqs, ends, strict=True) if not end % period] if pending else []
            assert touched == rows, "the memo's rows on the period"
        loading = {rid for rid, req in self._requests.items() if req.num_loading}
        assert self._loading == loading, f"requests loading {sorted(loading)}, noted {sorted(self._loading)}"
        holders = {pool: [0] * pool.num_blocks for pool in self._pools}
        for rid, req in self._requests.items():
            if set(req.states) != set(self.groups):
                raise AssertionError(f"request {rid!r} has state in groups {sorted(req.states)}")
            known = len(req.token_ids)
            num_loading = sum(len(g.loads(req.states[name])) * g.granularity for name, g in self.groups.items())
            assert req.releasing or req.num_loading == num_loading, (
                f"request {rid!r} loads {num_loading} tokens, counts {req.num_loading}"
            )
            if not 0 <= req.num_computed <= req.end or (self.exact_steps and req.end > known):
                raise AssertionError(
                    f"invariant 5 (table and computed count commit together): request {rid!r} computed "
                    f"{req.num_computed}, reserved to {req.end}, knows {known} tokens"
                )
            if req.num_computed > known:
                raise AssertionError(
                    f"invariant 6 (no uninitialized read): request {rid!r} counts {req.num_computed} "
                    f"computed tokens but knows only {known}"
                )
            assert req.releasing or not req.num_released, f"request {rid!r}: groups released, no release under way"
            # (a release that raised: the groups before `num_released` hold nothing of it)
            for g in self._group_list[req.num_released :]:
                g.check_state(rid, req.states[g.name], req.token_ids, req.num_computed, req.end, holders[g.pool])
        for pool, groups in self._pools.items():
            groups[0].check_holders(holders[pool])
            if len(groups) > 1:
                self._check_owners(groups)
        for i, g in enumerate(self._group_list):
            g.check_states({rid: req.states[g.name] for rid, req in self._requests.items() if req.num_released <= i})

    def _check_owners(self, groups: list[CacheGroup]) -> None:
        """On a shared pool a block is held by the requests of one group only."""
        owner: dict[int, str] = {}
        for g in groups:
            i = self._group_list.index(g)
            for rid, req in self._requests.items():
                if req.num_released > i:  # (released: it holds nothing in g)
                    continue
                for b in g.held_blocks(req.states[g.name]):
                    if owner.setdefault(b, g.name) != g.name:
                        raise AssertionError(
                            f"shared pool: block {b} is held by groups {owner[b]!r} and {g.name!r} ({rid!r})"
                        )


class _InterruptsHeld:
    """A block of code Ctrl-C does not cut in two: in the main thread, while Python's own
    SIGINT handler is set (the one that raises KeyboardInterrupt between any two bytecodes),
    a SIGINT received inside the block is noted and its KeyboardInterrupt raised once the
    block is done (also where it raised: the interrupt wins). Elsewhere (another thread,
    which gets no KeyboardInterrupt, or a handler of the caller's) nothing is changed. Not
    nested: an inner block finds the outer's handler set and leaves it. 2-5 us a block (the
    C module's calls, 2.2 us of it; signal.getsignal / signal.signal with a Python handler
    set cost 8 and 10 us each, their enum conversion's ValueError; `python -m timeit` on
    the shared 2-vCPU box, 2026-12-07)."""

    __slots__ = ("_held", "_received")

    def __enter__(self) -> None:
        self._received = False
        self._held = threading.get_ident() == _MAIN_THREAD_ID and _signal.getsignal(_SIGINT) is _DEFAULT_INT_HANDLER
        if self._held:
            _signal.signal(_SIGINT, self._note)

    def _note(self, signum: int, frame: object) -> None:
        self._received = True

    def __exit__(self, *exc: object) -> None:
        if self._held:
            _signal.signal(_SIGINT, _DEFAULT_INT_HANDLER)
            if self._received:
                raise KeyboardInterrupt


_MAIN_THREAD_ID = threading.main_thread().ident
_SIGINT, _DEFAULT_INT_HANDLER = int(signal.SIGINT), signal.default_int_handler


def _check_id(request_id: object) -> None:
    """A request id is a str (a subclass too); TypeError naming it otherwise. A coordinator
    stores the ids it is given: an int, None or a tuple was a request of its own beside the
    str of the same look, and a list failed as "unhashable type"."""
    if not isinstance(request_id, str):
        raise TypeError(f"a request id must be a str, got {request_id!r} ({type(request_id).__name__})")


def _all_ints(counts: Sequence[int]) -> bool:
    """Whether every count is a Python int (a bool too), told by one C-level sum (4.0 ns a
    count, where a test of each count's type in a loop costs 20.5: `python -m timeit -s
    "c=[1]*128" "sum(c).__class__ is int"` against `"all(n.__class__ is int for n in c)"`,
    2-vCPU Intel Xeon, 2026-12-06): a float (3.0, nan) or
    numpy's int makes the sum another type, anything else makes it fail. The fast paths'
    checks are comparisons, which 3.0 and nan pass: a count that is no int goes to the naive
    twin, which converts it (`_int_counts`) or names it."""
    try:
        return sum(counts).__class__ is int
    except TypeError:
        return False


def _int_counts(counts: Sequence[int], what: str, request_ids: Sequence[str]) -> list[int]:
    """The counts as ints (numpy's ints and bools are: `operator.index`); TypeError naming
    the request and the first that is not."""
    try:
        return list(map(operator.index, counts))
    except TypeError:
        request_id, bad = next((r, n) for r, n in zip(request_ids, counts, strict=True) if not is_int(n))
        raise TypeError(f"request {request_id!r}: {what} must be an int, got {bad!r}") from None


def _token_ids_array(request_id: str, token_ids: Iterable[int]) -> array[int]:
    """Ids that join a request, as its array holds them (`_Request.token_ids`); ValueError
    naming the first that is no int in [0, 2**32), before anything changes."""
    ids = list(token_ids)
    try:
        return array("I", ids)
    except (OverflowError, TypeError):
        for t in ids:
            try:
                array("I", [t])
            except (OverflowError, TypeError):
                raise ValueError(f"request {request_id!r}: token id {t!r} is no int in [0, 2**32)") from None
        raise
