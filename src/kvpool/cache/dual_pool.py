"""DeepSeek-V4's dual pool (DEEPSEEK_V4.md sections 5 and 6) as one `CacheGroup`
(cache/group.py) of the coordinator. No torch.

  classical pool  blocks of `span` tokens of compressed entries (a BlockPool: refcounts,
                  LRU free queue, the chained-hash prefix index). A block is taken by the
                  step that completes its span, written once by it and published at that
                  step's commit; it is never written again, so it is shared without
                  copy-on-write. An incomplete block never exists in the pool.
  state pool      a fixed number of state blocks (SWA window, compressor tails, the
                  unfinished span's entries), one per request, taken at admission and
                  returned at release. Mutable every step, never shared. A BlockPool whose
                  free unhashed blocks go FIFO; with turn ends kept (below), a cache.

Per request, while it computes [num_computed, end):

  [0, num_computed // span * span)   complete spans: classical blocks, published (shared
                                     read-only after a hit or a fork)
  [.., num_computed)                 the unfinished span: in the state block only
  spans completed by the step        fresh classical blocks (refcount 1, unpublished): the
                                     table covers [0, end // span)

Prefix hits. The prompt's complete spans are chained like full-attention blocks (a hit
point needs every span before it: CSA / HCA read all compressed entries), and a point P is
served at a span boundary only, P = q * span with the first q spans cached (the compressed
entries of an unfinished span are never stored), or at a kept turn end.

Restore: the state at a hit P = q * span is rebuilt exactly (section 6) by one of
  "recompute":  the runner replays tokens [max(0, P - replay_len), P) on top of the q cached
                blocks (V4: replay_len = n_win * num_layers rebuilds every layer's window; at
                a span boundary the compressor tails are empty);
  "checkpoint": the hit is cut to the longest prefix whose boundary has a checkpoint; the
                runner copies the checkpoint slot into the request's state block;
  "auto":       chosen per admission by cost (`choose_restore`, priced by the spec's
                `RestoreCost`);
  "adopt":      the hit is a turn end (below): the request takes the kept state block
                over as its own; nothing is copied or recomputed.
The request's `restore` says which until its first commit.

Turn ends (the coordinator's `turn_end_checkpoints`; Figure 12). A request that finishes
after P computed tokens, P inside a span, leaves its state block holding the state at P
exactly, on top of the classical blocks of the P // span spans before P. `keep_turn_end`
files that block in the state pool's index (`TurnEnds`, cache/chains.py) and the release
frees it as a cached block: kept states are free state blocks in LRU order, taken (evicted)
only when no unhashed state block is left, so they never cost an admission a state block.
A follow-up that repeats the P tokens and whose P // span spans are cached hits at P and
adopts the block: out of the index (it is about to change), no copy, no reset.

Spills (pooled checkpoints only). When a state block allocation takes a kept turn-end
state (every unhashed state block is held: `max_num_seqs` binds), the state is spilled
rather than dropped, if the classical pool has `spill_blocks` free blocks: a pooled
checkpoint of the whole state block, part 0 registered in the classical pool as the turn
end's own block (listed in a `TurnEnds` of the classical pool), parts 1.. chained after
it. Its blocks are freed at once as cached blocks (the LRU order of every cached block:
the free queue's most recent end), so a spill takes no block a running request could
need, and any allocation may evict it. The runner copies the state slot into the
checkpoint (`take_spills`) before anything writes the slot. A follow-up that hits it
restores by "checkpoint" (the copy back, priced as any checkpoint under "auto").

Checkpoints ("checkpoint", "auto") snapshot a request's state at the span boundaries its
steps complete. A checkpoint is blocks of a BlockPool registered in its prefix index under
the boundary block (part i chained after it with `_STATE_EXTRA` i) and freed at once as
cached blocks: the pool's LRU queue orders them, an allocation that evicts one of its
blocks drops it, and an undo (`BlockPool.unallocate`) makes it findable again. The pool is
  slots   (`num_checkpoints` > 0): a pool of its own of that many one-block checkpoints,
          numbered after the state blocks (the engine: its state tensors have that many
          rows more); a step that finds none free pushes out the least recently used;
  pooled  (`checkpoint_blocks` > 0): the classical pool, that many blocks each (a state
          block's bytes in classical blocks), so checkpoints and cached classical blocks
          share the pool's free memory and its one LRU eviction order (as vLLM v1 keeps
          Mamba states in its block pool): as many as free memory holds, none taken from a
          running request. A snapshot that finds too few free blocks is skipped.
"""

from __future__ import annotations

import operator
import sys
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal, NamedTuple, Protocol

from kvpool.cache.chains import (
    TurnEnds,
    chain_units,
    check_chain,
    check_held,
    may_reach,
    mm_extra_key,
    register_run,
    unit_extra,
)
from kvpool.cache.coordinator import HybridCacheManager
from kvpool.cache.group import CacheGroup, GroupUsage, LowerTier, StepRequest, check_int_fields
from kvpool.cache.types import NO_RESERVATION, CacheDescriptor, GroupReservation, LookupPrompt, MMItem, StateRestore
from kvpool.pool import BlockPool, PrefixBlock
from kvpool.pool.hashing import TOKEN_BYTES, token_bytes
from kvpool.spec.dsv4 import DSV4Spec

RestoreMethod = Literal["checkpoint", "recompute", "auto"]
RESTORE_METHODS: tuple[str, ...] = ("checkpoint", "recompute", "auto")


class RestoreCost(Protocol):
    """What a V4 state restore costs, in any one unit (seconds, or tokens), as the runner
    prices it: the simulator by its cost model, the engine by the rates it has measured.

    Optional `version`: a hashable value that is equal at two moments only if every price
    is the same at both (constant prices: a constant; measured ones: the totals they are
    made of). An "auto" lookup's cut reads the prices, so an admission takes the router's
    lookup again only under the same version (`DualPoolGroup.lookup_stamp`); a cost without
    one is read as changing at any time (every admission looks its prompt up again)."""

    def checkpoint_cost(self) -> float:
        """Copying one checkpoint into a request's state block."""
        ...

    def compute_cost(self, num_tokens: int, context_len: int) -> float:
        """Computing (replaying) the tokens [context_len - num_tokens, context_len)."""
        ...


class TokenCost:
    """The default `RestoreCost`: a checkpoint copy is free, computing costs its token count."""

    version = 0  # (the prices never change)

    def checkpoint_cost(self) -> float:
        return 0.0

    def compute_cost(self, num_tokens: int, context_len: int) -> float:
        return float(num_tokens)


class RestoreChoice(NamedTuple):
    """How an admission rebuilds its state: the hit it keeps (`num_cached_tokens`, at most the
    cached prefix found) and the method ("none" when nothing is kept)."""

    num_cached_tokens: int
    method: Literal["none", "checkpoint", "recompute"]


def choose_restore(hit_len: int, checkpoint_len: int, replay_len: int, cost: RestoreCost) -> RestoreChoice:
    """The cheapest restore of a prefix hit of `hit_len` tokens when the longest checkpointed
    boundary within it is `checkpoint_len` (0: none held), the replay window being
    `replay_len` = n_win x num_layers tokens. The options and their costs:

        recompute at hit_len:        compute(hit_len - max(0, hit_len - replay_len), hit_len)
        checkpoint at checkpoint_len: checkpoint() + compute(hit_len - checkpoint_len, hit_len)
                                      (the cut tokens are computed again, as prompt; nothing
                                      when checkpoint_len == hit_len)

    A tie goes to the checkpoint (no replay step). A shorter cut, or a replay at a shorter
    hit, is never cheaper: both compute a superset of the same tokens."""
    if not 0 <= checkpoint_len <= hit_len:
        raise ValueError(f"need 0 <= checkpoint_len <= hit_len, got {checkpoint_len} and {hit_len}")
    if hit_len == 0:
        return RestoreChoice(0, "none")
    replay = cost.compute_cost(hit_len - max(0, hit_len - replay_len), hit_len)
    if checkpoint_len:
        cut = hit_len - checkpoint_len
        restore = cost.checkpoint_cost() + (cost.compute_cost(cut, hit_len) if cut else 0.0)
        if restore <= replay:
            return RestoreChoice(checkpoint_len, "checkpoint")
    return RestoreChoice(hit_len, "recompute")


@dataclass(frozen=True)
class DualPoolGroupSpec:
    """Layers of a V4-style model: one classical block per `span` tokens, one state block per
    request; a hit's state is rebuilt by replaying the `replay_len` tokens before it, or
    from a checkpoint (`restore`, `num_checkpoints` slots or `checkpoint_blocks` classical
    blocks each, `restore_cost`: the module docstring)."""

    name: str
    span: int
    replay_len: int = 0
    restore: RestoreMethod = "recompute"
    num_checkpoints: int = 0
    checkpoint_blocks: int = 0
    restore_cost: RestoreCost | None = field(default=None, compare=False)  # None: TokenCost
    # classical blocks a spilled turn-end state takes (a whole state block; pooled
    # checkpoints only); 0: checkpoint_blocks (the engine's pooled snapshot is a whole state)
    spill_blocks: int = 0

    def __post_init__(self) -> None:
        check_int_fields(self, "span", "replay_len", "num_checkpoints", "checkpoint_blocks", "spill_blocks")
        if self.span <= 0:
            raise ValueError(f"group {self.name!r}: span must be positive, got {self.span}")
        for what in ("replay_len", "num_checkpoints", "checkpoint_blocks", "spill_blocks"):
            if getattr(self, what) < 0:
                raise ValueError(f"group {self.name!r}: {what} must be >= 0, got {getattr(self, what)}")
        if self.restore not in RESTORE_METHODS:
            raise ValueError(f"restore must be one of {RESTORE_METHODS}, got {self.restore!r}")
        if self.checkpoint_blocks and self.num_checkpoints:
            raise ValueError("checkpoints in slots (num_checkpoints) or pooled (checkpoint_blocks), not both")

    def build(
        self,
        size: object,
        *,
        enable_caching: bool,
        hash_algo: str,
        shared_pool: BlockPool | None,
        lower_tier: LowerTier | None = None,
        record_published: bool = False,
    ) -> DualPoolGroup:
        """The group; `size` is the pair (classical blocks, state blocks), both positive.
        With `lower_tier` (which `prefetch_candidates` serves: the group does not look it up)
        the cached classical blocks an allocation evicts are recorded (`take_evicted`); with
        `record_published`, those a commit publishes (`take_published`)."""
        if not (isinstance(size, tuple) and len(size) == 2 and all(isinstance(n, int) and n > 0 for n in size)):
            raise ValueError(
                f"dual-pool group {self.name!r} needs (classical blocks, state blocks), both positive, got {size!r}"
            )
        if self.restore == "checkpoint" and enable_caching and not (self.num_checkpoints or self.checkpoint_blocks):
            raise ValueError("restore='checkpoint' needs num_checkpoints > 0 or checkpoint_blocks > 0")
        group = DualPoolGroup(self, *size, enable_caching=enable_caching, hash_algo=hash_algo)
        if lower_tier is not None:
            group._evicted = []
        if record_published and enable_caching:
            group._published = []
        return group

    @classmethod
    def from_dsv4(cls, name: str, spec: DSV4Spec, **restore: Any) -> DualPoolGroupSpec:
        """V4's dual pool: the classical span, and the window of every layer replayed."""
        return cls(name, spec.span, spec.window * spec.num_layers, **restore)

    def replay_start(self, point: int) -> int:
        """The first token the restore of a hit at `point` replays."""
        return max(0, point - self.replay_len)


@dataclass(slots=True)  # (no __dict__: a fleet run holds ~100,000, one a pooled checkpoint or spill)
class _Checkpoint:
    slot: int  # the state slot a restore copies (pooled: the first of its blocks)
    block: PrefixBlock  # the boundary block whose prefix the snapshot is the state of
    parts: tuple[PrefixBlock, ...]  # the registered contents of its blocks


# the restore choices a group keeps at most (`_restore_choice`): a hit's spans and its
# checkpointed ones, a few hundred pairs at chat lengths, and the spilled turn ends' points;
# past this, they are made again
MAX_RESTORE_CHOICES = 4096
_STATE_EXTRA = b"v4-state:"  # a pooled checkpoint's part i: chained after its boundary block


_SWAP_EXTRA = b"v4-swap:"  # a swapped-out state's tier entry: never a span's or a turn end's key
# a prefix block's copies: listed only while it is its hash's entry in the index, so for a
# block that is no root, truthy exactly when `BlockPool.is_published` is (no index probe)
_COPIES = operator.attrgetter("block_ids")


def _state_part(block: PrefixBlock) -> bool:
    """Whether a classical prefix block is part of a pooled checkpoint or of a spilled
    turn-end state (not a span of tokens)."""
    return (not block.token_bytes and block.extra.startswith(_STATE_EXTRA)) or block.extra.startswith(b"turn")


@dataclass(slots=True)
class _Pending:
    """A reserved step that took classical blocks, with what its commit and its undo need."""

    num_new: int  # the fresh blocks at the table's end
    chain: list[PrefixBlock]  # prefix blocks of the spans the step completes (caching on)
    checkpoints: tuple[tuple[int, int], ...]  # (position, slot): snapshot the state there
    dropped: list[tuple[bytes, _Checkpoint]]  # checkpoints its allocations pushed out (undo restores them)
    evicted_blocks: list[tuple[int, PrefixBlock]]  # cached blocks its allocations evicted (undo restores them)
    snapshot_ids: list[list[int]]  # each checkpoint's blocks in the checkpoint pool
    snapshot_evicted: list[tuple[int, PrefixBlock]]  # slots: what its checkpoints' allocation evicted


@dataclass(slots=True)
class DualPoolState:
    """One request's blocks in one dual-pool group."""

    root: PrefixBlock
    state_slot: int  # the request's state block
    block_ids: list[int] = field(default_factory=list)  # classical blocks of spans [0, end // span)
    chain: list[PrefixBlock] = field(default_factory=list)  # spans [0, num_computed // span) (caching on)
    restore: StateRestore | None = None  # a hit's restore to run or done ("adopt"), until the first commit
    pending: _Pending | None = None  # the reserved step, when it took blocks


@dataclass(slots=True)
class DualPoolHits:
    """The prompt's leading run of cached spans an admission keeps, and how it restores."""

    block_ids: list[int]
    chain: list[PrefixBlock]
    method: str = "none"  # "none" (no hit), "checkpoint" or "recompute"
    # Turn ends T -> the kept state block's content (state pool), each after cached spans of
    # the whole run (`turn_ids`, `turn_chain`: before the restore's cut) or in the span after it
    turn_ends: dict[int, PrefixBlock] = field(default_factory=dict)
    turn_ids: list[int] = field(default_factory=list)
    turn_chain: list[PrefixBlock] = field(default_factory=list)
    spilled: dict[int, _Checkpoint] = field(default_factory=dict)  # T -> a spilled turn end's checkpoint


@dataclass(slots=True)
class DualPoolAdmit:
    hit_ids: list[int]  # classical blocks of spans [0, P // span)
    chain: list[PrefixBlock]
    replay_start: int | None  # a restore by recompute from there
    checkpoint: _Checkpoint | None = None  # a restore from this checkpoint
    adopt: int | None = None  # the kept turn-end state block taken over


class DualPoolGroup(CacheGroup):
    """A `CacheGroup` (cache/group.py): classical blocks of complete spans, one state block
    per request, optional checkpoints of the state."""

    kind = "dual_pool"
    reads_whole_prefix = True
    has_table = True
    whole_steps = True
    has_state = True
    can_unreserve = True

    def __init__(
        self,
        spec: DualPoolGroupSpec,
        num_classical_blocks: int,
        num_state_blocks: int,
        *,
        enable_caching: bool = True,
        hash_algo: str = "xxh3_128",
    ) -> None:
        self.spec = spec
        self.name = spec.name
        self.span = spec.span
        self.pool = BlockPool(num_classical_blocks, enable_caching=enable_caching, hash_algo=hash_algo)
        # (caching on: kept turn-end states are registered in it; without any, FIFO as before)
        self.state_pool = BlockPool(num_state_blocks, enable_caching=enable_caching, hash_algo=hash_algo)
        self._turn_ends = TurnEnds(self.state_pool, spec.span)
        # the span boundaries (their prefix blocks' hashes) where swapped-out states wait, with
        # how many: a hit is not cut below one (`_cut`), since the resume restores its state
        # there. A hint only: the hit is still served exactly (a replay if the state is gone).
        self._swap_boundaries: dict[bytes, int] = {}
        self.num_adoptions = 0  # admissions that took a kept turn-end state over (for reports)
        # (a request without a pending step holds num_computed // span blocks: check_state)
        self.granularity = self.commit_period = self.decode_reserve_period = spec.span
        self.restore_cost: RestoreCost = spec.restore_cost if spec.restore_cost is not None else TokenCost()
        self._priced = spec.restore == "auto"  # the cut reads the restore cost (`lookup_stamp`)
        # (hit, checkpointed tokens) -> their `choose_restore`, under the cost's version
        # `_choices_version` (`_restore_choice`)
        self._choices: dict[tuple[int, int], RestoreChoice] = {}
        self._choices_version: Hashable = None
        # snapshots are taken at span boundaries (checkpoint, auto), when there is room for them
        self.checkpointing = (
            spec.restore != "recompute" and enable_caching and (spec.num_checkpoints or spec.checkpoint_blocks) > 0
        )
        # Where checkpoints live: the classical pool (pooled), or a pool of one-block slots
        # numbered after the state slots, [num_state_blocks, + num_checkpoints)
        self.checkpoint_pool = self.pool
        self._slot_base, self._parts = 0, spec.checkpoint_blocks
        if spec.num_checkpoints:
            self.checkpoint_pool = BlockPool(spec.num_checkpoints, enable_caching=enable_caching, hash_algo=hash_algo)
            self._slot_base, self._parts = num_state_blocks, 1
        pooled = self.checkpoint_pool is self.pool
        self.extra_pools = (self.state_pool,) if pooled else (self.state_pool, self.checkpoint_pool)
        self._checkpoints: dict[bytes, _Checkpoint] = {}  # boundary block hash -> findable checkpoint
        # each part's extra key, made once (a commit that completes a span registers every part)
        self._part_extras = tuple(_STATE_EXTRA + str(i).encode() for i in range(self._parts))
        # Spilled turn-end states (the module docstring): part 0 filed in `_spills` (a TurnEnds
        # of the classical pool), the record under its hash (dead ones dropped as met);
        # `_spill_copies`: (state slot, checkpoint slot) copies the runner still has to make
        self._spill_parts = (spec.spill_blocks or spec.checkpoint_blocks) if self.checkpointing and pooled else 0
        self._spills = TurnEnds(self.pool, spec.span)
        self._spilled: dict[bytes, _Checkpoint] = {}
        self._spilled_prune_at = 64  # dead records dropped when this many are kept (2 x live + 64)
        self._spill_extras = tuple(_STATE_EXTRA + str(i).encode() for i in range(1, self._spill_parts))
        self._spill_copies: list[tuple[int, int]] = []
        self.num_spills = 0  # turn-end states spilled (for reports)
        self.num_spill_hits = 0  # admissions restored from a spilled turn end

    # ---- prefix hits -------------------------------------------------------------------

    def hits(
        self, root: PrefixBlock, prompt: LookupPrompt, limit: int | None, *, admission: bool = False
    ) -> DualPoolHits:
        """The leading run of cached complete spans, leaving a token to compute, cut as the
        restore method chooses; the turn ends kept after its spans."""
        if not self.pool.enable_caching:
            return DualPoolHits([], [])
        span, (token_ids, mm_items, packed, memo) = self.span, prompt
        num = (len(token_ids) - 1) // span
        if limit is not None:
            num = min(num, limit // span)
        hit = self.pool.match(
            root,
            packed,  # (num spans of it at most: match reads them in place, no slice copied)
            span * TOKEN_BYTES,
            num,
            [mm_extra_key(mm_items, span, k) for k in range(num)] if mm_items else None,
            count_collisions=admission,
            memo=memo,
        )
        block_ids, chain = hit.block_ids, hit.chain
        out = self._cut(block_ids, chain)
        if self._turn_ends:  # kept states inside the run's spans or the next one (one token left)
            top = len(token_ids) - 1 if limit is None else min(len(token_ids) - 1, limit)
            out.turn_ends.update(self._turn_ends.find_along([root, *chain], token_ids, mm_items, top, packed))
            if out.turn_ends:
                out.turn_ids, out.turn_chain = block_ids, chain
        if self._spills:  # spilled ones likewise, where no kept state block is found
            top = len(token_ids) - 1 if limit is None else min(len(token_ids) - 1, limit)
            for point, block in self._spills.find_along([root, *chain], token_ids, mm_items, top, packed).items():
                ckpt = self._spilled.get(block.block_hash)
                if point not in out.turn_ends and ckpt is not None and self._spill_pays(ckpt, point):
                    out.spilled[point] = ckpt
            if out.spilled:
                out.turn_ids, out.turn_chain = block_ids, chain
        return out

    def _spill_pays(self, ckpt: _Checkpoint, point: int) -> bool:
        """Whether a spilled turn end at `point` is served: its checkpoint is whole (every
        part findable), and under "auto" its copy is priced no dearer than a replay there."""
        if not all(map(_COPIES, ckpt.parts)):  # (`is_published` of each part: listed copies)
            return False
        if self.spec.restore != "auto":
            return True
        return self._restore_choice(point, point).method == "checkpoint"

    def lookup_stamp(self) -> tuple[Hashable, ...] | None:
        """`hits` reads the classical pool's index (the run; the checkpoints' boundaries), the
        state pool's (the turn ends, listed as they are filed there) and the checkpoint
        pool's (`_checkpoints` changes only with it or with the classical pool's index: a
        checkpoint published, evicted or put back), and counts the classical walk's refused
        hits: their versions and that count. "auto" (`_cut`, `plan_admit`'s restore at the
        hit's end) also reads the restore cost's prices, which move without any pool's
        knowing (the engine's measured timings): its `version` too, None for a cost without
        one. A swapped-out state's boundary moves the cut likewise: None while one is held.
        The rest `hits`, `_cut` and `serves` read is fixed at construction (the spec's
        restore, replay_len and span; caching on or off)."""
        if self._swap_boundaries:
            return None
        pool, state_pool, checkpoint_pool = self.pool, self.state_pool, self.checkpoint_pool
        if not self._priced:
            return (pool.index_version, pool.num_refused, state_pool.index_version, checkpoint_pool.index_version)
        version = getattr(self.restore_cost, "version", None)
        if version is None:
            return None
        return (pool.index_version, pool.num_refused, state_pool.index_version, checkpoint_pool.index_version, version)

    def may_reach(self, root: PrefixBlock, prompt: LookupPrompt, point: int) -> bool:
        """A probe of the span before `point` (`chains.may_reach`): every point `hits` serves
        lies within its run of cached spans (the cut keeps a prefix of it) or is a turn end
        kept after one of them."""
        if point <= 0:
            return True
        if not self.pool.enable_caching:
            return False
        return may_reach(self.pool, self._turn_ends, root, prompt, point, self.span) or (
            bool(self._spills) and may_reach(self.pool, self._spills, root, prompt, point, self.span)
        )

    def _cut(self, block_ids: list[int], chain: list[PrefixBlock]) -> DualPoolHits:
        """The run of cached spans cut as the restore method chooses."""
        span, restore = self.span, self.spec.restore
        if not block_ids:
            return DualPoolHits([], [])
        if restore == "recompute":
            return DualPoolHits(block_ids, chain, "recompute")
        k = len(block_ids)  # the last boundary within the hit whose state is checkpointed
        while k and self._checkpoint(chain[k - 1]) is None:
            k -= 1
        if restore == "checkpoint":  # the hit is usable only up to there
            method = "checkpoint" if k else "none"
        else:
            choice = self._restore_choice(len(block_ids) * span, k * span)
            k, method = choice.num_cached_tokens // span, choice.method
        if self._swap_boundaries:  # a swapped-out state's boundary past the cut: the hit reaches it
            j = len(block_ids)
            while j > k and chain[j - 1].block_hash not in self._swap_boundaries:
                j -= 1
            if j > k:  # (a replay there, unless its state comes back: the tier bridge's swap-in)
                k, method = j, "checkpoint" if self._checkpoint(chain[j - 1]) is not None else "recompute"
        return DualPoolHits(block_ids[:k], chain[:k], method)

    def _restore_choice(self, hit_len: int, checkpoint_len: int) -> RestoreChoice:
        """`choose_restore(hit_len, checkpoint_len, ...)`, kept while the restore cost's
        `version` holds (its prices are then the same): every "auto" lookup prices its hit,
        the router's on each replica it asks, at whole spans of a few lengths, and each
        spilled turn end it finds at its point (`_spill_pays`). A cost without a version is
        asked each time."""
        cost = self.restore_cost
        version = getattr(cost, "version", None)
        if version is None:
            return choose_restore(hit_len, checkpoint_len, self.spec.replay_len, cost)
        if version != self._choices_version or len(self._choices) >= MAX_RESTORE_CHOICES:
            self._choices.clear()
            self._choices_version = version
        key = (hit_len, checkpoint_len)
        choice = self._choices.get(key)
        if choice is None:
            choice = self._choices[key] = choose_restore(hit_len, checkpoint_len, self.spec.replay_len, cost)
        return choice

    def upper_bound(self, hits: DualPoolHits) -> int:
        bound = len(hits.block_ids) * self.span
        return max(bound, *hits.turn_ends, *hits.spilled) if hits.turn_ends or hits.spilled else bound

    def extra_points(self, hits: DualPoolHits) -> list[int]:
        return sorted({*hits.turn_ends, *hits.spilled}) if hits.spilled else sorted(hits.turn_ends)

    def serves(self, hits: DualPoolHits, point: int) -> bool:
        """A span boundary whose spans before it are all cached (or the start); restoring
        by checkpoint only, one with a checkpoint. Inside a span: a kept turn end."""
        q, r = divmod(point, self.span)
        if r:
            return point in hits.turn_ends or point in hits.spilled
        if q > len(hits.block_ids):
            return False
        if not q or self.spec.restore != "checkpoint":
            return True
        boundary = hits.chain[q - 1]
        return self._checkpoint(boundary) is not None or boundary.block_hash in self._swap_boundaries

    def plan_admit(self, hits: DualPoolHits | None, point: int, end: int) -> tuple[DualPoolAdmit, dict[BlockPool, int]]:
        """The restore: the one `hits` chose at its end; at a point below it (another
        group's bound), a checkpoint where one is held and priced no dearer than the
        replay, else the replay; at a turn end, its kept state block adopted (one state
        block out of the free queue all the same)."""
        q, r = divmod(point, self.span)
        if r:
            assert hits is not None, f"group {self.name!r} keeps no turn end at {point}"
            if point in hits.turn_ends:
                (kept,) = hits.turn_ends[point].block_ids  # (filed once: `TurnEnds.new_block`)
                plan = DualPoolAdmit(list(hits.turn_ids[:q]), list(hits.turn_chain[:q]), None, adopt=kept)
            else:  # a spilled one: its checkpoint copied into a state block of its own
                ckpt = hits.spilled[point]
                plan = DualPoolAdmit(list(hits.turn_ids[:q]), list(hits.turn_chain[:q]), None, checkpoint=ckpt)
            assert len(plan.hit_ids) == q, "a turn end follows cached spans"
        else:
            hit_ids = list(hits.block_ids[:q]) if hits is not None else []
            assert len(hit_ids) == q, "serves() was checked"
            chain = list(hits.chain[:q]) if hits is not None and self.pool.enable_caching else []
            plan = DualPoolAdmit(hit_ids, chain, None)
            if q:  # (hit_ids holds q blocks: hits is there)
                assert hits is not None
                ckpt = self._checkpoint(plan.chain[q - 1])
                if q == len(hits.block_ids):
                    method = hits.method
                elif self.spec.restore == "auto" and ckpt is not None:
                    method = self._restore_choice(point, point).method
                else:  # (restoring by checkpoint, a swapped state's boundary may have none: a replay there)
                    method = "checkpoint" if self.spec.restore == "checkpoint" and ckpt is not None else "recompute"
                if method == "checkpoint":
                    plan.checkpoint = ckpt
                else:
                    plan.replay_start = self.spec.replay_start(point)
        revived = sum(1 for b in plan.hit_ids if self.pool.refcount(b) == 0)  # (out of the free queue)
        return plan, {self.pool: end // self.span - q + revived, self.state_pool: 1}

    def claim(self, plan: DualPoolAdmit) -> None:
        """A checkpoint the plan restores from is the most recently used now."""
        self.pool.incref(plan.hit_ids)
        if plan.checkpoint is not None:
            self._touch(plan.checkpoint)
        if plan.adopt is not None:  # out of the free queue: no allocation can take it now
            self.state_pool.incref((plan.adopt,))

    def apply_admit(self, plan: DualPoolAdmit, root: PrefixBlock) -> tuple[DualPoolState, tuple]:
        """The state block (the first step's blocks come with its reservation); an adopted
        one leaves the index, since the request's steps change it."""
        if plan.adopt is not None:
            adopted = self.state_pool.prefix_block(plan.adopt)
            assert adopted is not None
            self.state_pool.unregister(plan.adopt)
            self._turn_ends.drop(adopted)
            self.num_adoptions += 1
            state = DualPoolState(root, plan.adopt, list(plan.hit_ids), list(plan.chain))
            state.restore = StateRestore(plan.adopt, "adopt")
            return state, ()
        # (a pooled checkpoint restored from is held while a spill allocates: the copy back reads it after)
        restored = [p.block_ids[0] for p in plan.checkpoint.parts] if plan.checkpoint and self._spill_parts else []
        self.pool.incref(restored)
        slot = self._take_state_block()
        self.pool.decref(reversed(restored))
        state = DualPoolState(root, slot, list(plan.hit_ids), list(plan.chain))
        if plan.checkpoint is not None:
            spilled = plan.checkpoint.parts[0] is plan.checkpoint.block  # (a spilled turn end's: part 0 is its block)
            self.num_spill_hits += spilled
            state.restore = StateRestore(slot, "checkpoint", plan.checkpoint.slot, whole=spilled)
        elif plan.replay_start is not None:
            state.restore = StateRestore(slot, "recompute", replay_start=plan.replay_start)
        return state, ()

    # ---- steps -------------------------------------------------------------------------

    def blocks_needed(self, reqs: Sequence[StepRequest], ends: Sequence[int]) -> int:
        """Classical blocks a step takes: one per span it completes."""
        name, span = self.name, self.span
        return sum([end // span - len(req.states[name].block_ids) for req, end in zip(reqs, ends, strict=True)])

    def apply_reserve(
        self, reqs: Sequence[StepRequest], ends: Sequence[int], *, detail: bool = True
    ) -> list[GroupReservation] | None:
        """The blocks of the spans each step completes, and checkpoint slots (or pooled
        snapshot blocks) for their boundaries, from what the rest of the step leaves. detail
        False (the engine's step, which reads them back through `pending`): None."""
        name, span = self.name, self.span
        needs = [end // span - len(req.states[name].block_ids) for req, end in zip(reqs, ends, strict=True)]
        keep = sum(needs)  # free blocks the requests after this one take
        out = [NO_RESERVATION] * len(reqs) if detail else None  # the common decode step: no span completes
        if not keep:
            return out
        for i, need in enumerate(needs):
            if need:
                keep -= need
                req = reqs[i]
                part = self._reserve(req.states[name], req.token_ids, req.mm_items, need, keep, out is not None)
                if out is not None and part is not None:
                    out[i] = part
        return out

    def _reserve(
        self,
        state: DualPoolState,
        token_ids: list[int],
        mm_items: tuple[MMItem, ...],
        num_new: int,
        keep: int,
        detail: bool = True,
    ) -> GroupReservation | None:
        """Reserve a checked step's `num_new` blocks; `keep`: free blocks the rest of its batch
        needs (pooled snapshots leave them alone). The step's part, or None without `detail`
        (the engine's step reads it back through `pending`: no result for the collector)."""
        span, pool = self.span, self.pool
        evicted_blocks: list[tuple[int, PrefixBlock]] = []
        new_ids = pool.allocate(num_new, evicted_blocks)
        assert new_ids is not None, "the coordinator checked the free count"
        first = len(state.block_ids)
        state.block_ids += new_ids
        chain: list[PrefixBlock] = []
        if pool.enable_caching:
            parent = state.chain[-1] if state.chain else state.root
            if num_new == 1 and not mm_items:  # a decode crossing its span boundary: `chain_units` of one span
                chain = [pool.chain(parent, token_bytes(token_ids[first * span : (first + 1) * span]))]
            else:
                chain = chain_units(pool, parent, token_ids, mm_items, span, first, first + num_new)
        checkpoints: list[tuple[int, int]] = []
        dropped: list[tuple[bytes, _Checkpoint]] = []
        snapshot_ids: list[list[int]] = []
        ckpt_pool = self.checkpoint_pool
        pooled = ckpt_pool is pool
        snapshot_evicted = evicted_blocks if pooled else []
        if self.checkpointing:
            if len(chain) == 1:  # (a decode's crossing: one boundary, no comprehension over the chain)
                wanted = [] if self._checkpoint(chain[0]) is not None else [(first + 1) * span]
            else:
                wanted = [(first + k + 1) * span for k, b in enumerate(chain) if self._checkpoint(b) is None]
            # The latest boundaries whose blocks are free now (a snapshot never makes a step
            # wait; a long prefill may cross more boundaries than that); taking them may
            # evict cached blocks, checkpoints included (the least recently used first).
            c, base = self._parts, self._slot_base
            num = (ckpt_pool.num_free - (keep if pooled else 0)) // c
            for position in wanted[max(0, len(wanted) - num) :]:
                ids = ckpt_pool.allocate(c, snapshot_evicted)
                assert ids is not None
                snapshot_ids.append(ids)
                checkpoints.append((position, base + ids[0]))
        if evicted_blocks:  # (most crossings take unhashed blocks: nothing evicted, nothing to note)
            self._note_evicted(evicted_blocks, dropped)
        if not pooled and snapshot_evicted:
            self._note_evicted(snapshot_evicted, dropped)
        state.pending = _Pending(
            num_new, chain, tuple(checkpoints), dropped, evicted_blocks, snapshot_ids, snapshot_evicted
        )
        return GroupReservation(tuple(new_ids), (), state.pending.checkpoints) if detail else None

    def commit(self, reqs: Sequence[StepRequest]) -> None:
        """The steps are computed: publish the spans they completed (each written once, now
        immutable), file their checkpoints; a hit's restore is done."""
        name, span = self.name, self.span
        for req in reqs:
            state = req.states[name]
            state.restore = None
            if state.pending is not None:
                self._commit(state)
            assert len(state.block_ids) == req.num_computed // span, "a commit is of the whole reserved step"

    def _commit(self, state: DualPoolState) -> None:
        pending = state.pending
        assert pending is not None
        pool = self.pool
        num_new = pending.num_new
        new_ids = state.block_ids[len(state.block_ids) - num_new :]
        if pending.chain:  # (empty when caching is off)
            parent = state.chain[-1] if state.chain else state.root
            block = pending.chain[0]
            if num_new == 1 and block.parent is parent:  # a decode's crossing: `register_run` of one block
                run = [pool.register(new_ids[0], block) or block]
            else:
                run = register_run(pool, parent, zip(new_ids, pending.chain, strict=True))
            state.chain += run
            if self._published is not None:  # (a collision's copy is findable by nobody: not recorded)
                published = zip(new_ids, run, strict=True)
                self._published += [(b, block) for b, block in published if pool.is_published(block)]
        state.pending = None
        # The step's checkpoints (the module docstring); a checkpoint of an evicted copy of the
        # prefix gives way (`register`), and blocks that cannot be published (the boundary is
        # not findable, or another request checkpointed it first) are freed unhashed.
        ckpt_pool = self.checkpoint_pool
        for (position, slot), ids in zip(pending.checkpoints, pending.snapshot_ids, strict=True):
            block = state.chain[position // self.span - 1]
            if pool.is_published(block) and self._checkpoint(block) is None:
                # (its blocks freed in the same pass, as cached blocks: the checkpoint holds no reference)
                parts = ckpt_pool.publish_parts(ids, block, self._part_extras, release=True)
                if parts is not None:
                    self._checkpoints[block.block_hash] = _Checkpoint(slot, block, parts)
            else:
                ckpt_pool.decref(ids)

    def unreserve(self, state: DualPoolState) -> None:
        """Undo the reserved step, whose forward has not run (e.g. another request of the
        batch did not fit), exactly: its blocks go back where they were (cached blocks its
        allocation evicted are findable again), its checkpoint slots go back, and every
        checkpoint it pushed out is findable again at the head of the LRU queue (its place,
        when steps are undone latest first), unless the same prefix has been checkpointed
        since (then the slot is free) or another allocation has since taken one of its
        other blocks. Nothing to undo: nothing done."""
        pending = state.pending
        if pending is None:
            return
        new_ids = state.block_ids[len(state.block_ids) - pending.num_new :]
        del state.block_ids[len(state.block_ids) - pending.num_new :]
        snapshot_ids = [b for ids in pending.snapshot_ids for b in ids]
        if self.checkpoint_pool is self.pool:
            self.pool.unallocate([*new_ids, *snapshot_ids], pending.evicted_blocks)
        else:
            self.pool.unallocate(new_ids, pending.evicted_blocks)
            self.checkpoint_pool.unallocate(snapshot_ids, pending.snapshot_evicted)
        if self._spilled:  # spilled turn ends it evicted: findable again, so listed again
            for _, block in pending.evicted_blocks:
                if block.token_bytes and block.block_hash in self._spilled and self.pool.is_published(block):
                    self._spills.relist(block)
        for block_hash, ckpt in pending.dropped:  # back unless a later allocation took another of its blocks
            if block_hash not in self._checkpoints and all(map(_COPIES, ckpt.parts)):
                self._checkpoints[block_hash] = ckpt
        if self._evicted is not None and pending.evicted_blocks:  # not evicted after all: the tier needs them not
            undone = {block_id for block_id, _ in pending.evicted_blocks}
            self._evicted = [e for e in self._evicted if e[0] not in undone]
        state.pending = None

    # ---- spilled turn ends ---------------------------------------------------------------

    def _take_state_block(self) -> int:
        """A state block for an admission or a fork (the coordinator checked there is one); a
        kept turn-end state it takes is spilled to the classical pool where it fits."""
        evicted: list[tuple[int, PrefixBlock]] = []
        slot = self.state_pool.allocate(1, evicted if self._spill_parts else None)
        assert slot is not None, "the coordinator checked the free counts"
        for _, kept in evicted:
            self._spill(slot[0], kept)
        return slot[0]

    def _spill(self, slot: int, kept: PrefixBlock) -> None:
        """Spill the turn-end state `kept` that state block `slot` held (the module
        docstring): `_spill_parts` free classical blocks, registered and freed at once as
        cached blocks; the copy queued for the runner. Nothing when the blocks are not free,
        its spans before it left the index, or the same turn end is spilled already."""
        c, pool = self._spill_parts, self.pool
        parent = kept.parent
        assert parent is not None
        if pool.num_free < c or not (parent.parent is None or parent.block_ids):
            return
        block = pool.chain(parent, kept.token_bytes, kept.extra)
        if pool.lookup(block) is not None:
            return
        evicted: list[tuple[int, PrefixBlock]] = []
        ids = pool.allocate(c, evicted)
        assert ids is not None, "the free count was checked"
        self._note_evicted(evicted, [])  # (an admission is never undone: nothing to put back)
        # (the allocation may have evicted the spans before it: then it is not filed)
        if not self._spills.file(ids[0], block, orphan_ok=False):
            pool.decref(reversed(ids))
            return
        rest = pool.publish_parts(ids[1:], block, self._spill_extras, release=True) if c > 1 else ()
        pool.decref(ids[:1])
        if rest is None:  # (a collision: the parts left unpublished were freed unhashed)
            return
        if len(self._spilled) >= self._spilled_prune_at:  # dead records dropped (a live one holds its blocks)
            self._spilled = {h: ck for h, ck in self._spilled.items() if all(map(_COPIES, ck.parts))}
            self._spilled_prune_at = 2 * len(self._spilled) + 64
        self._spilled[block.block_hash] = _Checkpoint(ids[0], block, (block, *rest))
        self._spill_copies.append((slot, self._slot_base + ids[0]))
        self.num_spills += 1

    def take_spills(self) -> list[tuple[int, int]]:
        """(state slot, checkpoint slot) copies the spills since the last call need, in order:
        the runner makes them before anything writes those state slots (right after the
        admission or fork that spilled)."""
        out, self._spill_copies = self._spill_copies, []
        return out

    # ---- checkpoints ---------------------------------------------------------------------

    def _checkpoint(self, block: PrefixBlock) -> _Checkpoint | None:
        """The findable checkpoint of `block`'s prefix: filed under its hash, its boundary
        block the content the index holds (a checkpoint of an evicted prefix is stale: it
        is replaced)."""
        ckpt = self._checkpoints.get(block.block_hash)
        return ckpt if ckpt is not None and ckpt.block.block_ids else None  # (`is_published`: it lists copies)

    def _touch(self, ckpt: _Checkpoint) -> None:
        """A restore used `ckpt`: most recently used now (its blocks go to the end of the
        checkpoint pool's LRU queue)."""
        self.checkpoint_pool.touch([part.block_ids[0] for part in ckpt.parts])  # (incref, then decref)

    def _note_evicted(self, evicted: list[tuple[int, PrefixBlock]], dropped: list[tuple[bytes, _Checkpoint]]) -> None:
        """Cached blocks an allocation just evicted: classical ones go to the tier record
        (with a lower tier); a checkpoint that lost its last copy of a part is dropped
        (into `dropped`, for an undo to put back)."""
        if self._checkpoints:
            for _, block in evicted:
                # (`_state_part` inlined: every block an allocation evicts passes here)
                if not block.block_ids and not block.token_bytes and block.extra.startswith(_STATE_EXTRA):
                    assert block.parent is not None
                    ckpt = self._checkpoints.get(block.parent.block_hash)
                    if ckpt is not None and block in ckpt.parts:
                        dropped.append((block.parent.block_hash, self._checkpoints.pop(block.parent.block_hash)))
        if self._evicted is not None and evicted:
            self._evicted.extend(e for e in evicted if not _state_part(e[1]))

    # ---- a tier below the classical pool (kvpool.tiers) ----------------------------------

    def prefetch_candidates(self, root: PrefixBlock, token_ids: Sequence[int]) -> tuple[list[int], list[PrefixBlock]]:
        if not self.pool.enable_caching or len(token_ids) == 0:
            return [], []
        span = self.span
        num = (len(token_ids) - 1) // span
        hit = self.pool.match(
            root, token_bytes(token_ids[: num * span]), span * TOKEN_BYTES, num, None, count_collisions=False
        )
        parent = hit.chain[-1] if hit.chain else root
        return hit.block_ids, chain_units(self.pool, parent, list(token_ids), (), span, len(hit.block_ids), num)

    def install(self, num_blocks: int, hold: Sequence[int] = ()) -> list[int] | None:
        if num_blocks > self.pool.num_free - sum(1 for b in hold if self.pool.refcount(b) == 0):
            return None  # (checked first: holding would move the hit in the LRU order)
        self.pool.incref(hold)
        evicted: list[tuple[int, PrefixBlock]] = []
        ids = self.pool.allocate(num_blocks, evicted)
        assert ids is not None, "the free count was checked"
        self.pool.decref(reversed(hold))
        self._note_evicted(evicted, [])
        return ids

    def publish_installed(self, block_ids: Sequence[int], blocks: Sequence[PrefixBlock], num_loaded: int) -> None:
        if num_loaded:
            assert blocks[0].parent is not None
            register_run(self.pool, blocks[0].parent, list(zip(block_ids, blocks, strict=True))[:num_loaded])
        self.pool.decref(reversed(block_ids))

    # ---- queries on a request's state ---------------------------------------------------

    def block_ids(self, state: DualPoolState) -> list[int]:
        return state.block_ids

    def held_blocks(self, state: DualPoolState) -> list[int]:
        if state.pending is None or not state.pending.snapshot_ids or self.checkpoint_pool is not self.pool:
            return state.block_ids
        return state.block_ids + [b for ids in state.pending.snapshot_ids for b in ids]

    def state_slot(self, state: DualPoolState) -> int | None:
        return state.state_slot

    def restore(self, state: DualPoolState) -> StateRestore | None:
        return state.restore if state.restore is not None else StateRestore(state.state_slot, "none")

    def checkpoints(self, state: DualPoolState) -> list[tuple[int, int]]:
        return list(state.pending.checkpoints) if state.pending is not None else []

    def prefix_chain(self, state: DualPoolState) -> list[PrefixBlock]:
        return state.chain

    def pending(self, state: DualPoolState) -> GroupReservation:
        pending = state.pending
        if pending is None:  # the step took no block (most decodes): no checkpoint either
            return NO_RESERVATION
        return GroupReservation(tuple(state.block_ids[-pending.num_new :]), (), pending.checkpoints)

    def pending_chain(self, state: DualPoolState) -> list[PrefixBlock]:
        return state.pending.chain if state.pending is not None else []

    def metadata_bytes(self, state: DualPoolState) -> int:
        return sys.getsizeof(state) + sys.getsizeof(state.block_ids) + sys.getsizeof(state.chain)

    def keep_turn_end(
        self, state: DualPoolState, token_ids: list[int], mm_items: tuple[MMItem, ...], num_computed: int
    ) -> bool:
        """At a finish inside a span: the state block holds the state after `num_computed`
        tokens: file it (the release then frees it as a cached block). Not on a span
        boundary (a checkpoint's place), where every restore but an adoption is: a
        state block whose restore is pending is kept only when it was adopted (it holds
        that state already)."""
        if state.pending is not None:  # (a restore pending is one at a span boundary, or adopted)
            return False
        parent = state.chain[-1] if state.chain else state.root
        block = self._turn_ends.new_block(parent, token_ids, mm_items, num_computed)
        return block is not None and self._turn_ends.file(state.state_slot, block, orphan_ok=True)

    def swap_state_block(
        self, state: DualPoolState, token_ids: list[int], mm_items: tuple[MMItem, ...], num_computed: int
    ) -> PrefixBlock | None:
        """The state after `num_computed` tokens, named as the unfinished span's tokens
        [num_computed // span * span, num_computed) chained after the computed spans, under a
        swap key of its own (a span boundary: no tokens); the tier keys it by the whole
        prefix. None with caching off (no content keys) or nothing computed."""
        if not self.pool.enable_caching or num_computed <= 0:
            return None
        start = num_computed - num_computed % self.span
        assert len(state.chain) == start // self.span, "the chain covers the computed spans"
        parent = state.chain[-1] if state.chain else state.root
        extra = _SWAP_EXTRA + unit_extra(mm_items, self.span, start // self.span)
        return self.pool.chain(parent, token_bytes(token_ids[start:num_computed]), extra)

    def hold_swapped(self, block: PrefixBlock, held: bool) -> None:
        boundary = block.parent  # (the state's unfinished span hangs off its last computed span)
        if boundary is None or boundary.parent is None:  # at the start: no hit to keep
            return
        key, counts = boundary.block_hash, self._swap_boundaries
        if held:
            counts[key] = counts.get(key, 0) + 1
        elif counts.get(key, 0) > 1:
            counts[key] -= 1
        else:
            assert key in counts, "a swapped state released once"
            del counts[key]

    def restore_swapped(self, state: DualPoolState) -> None:
        """The runner wrote the state block from the swapped-out state's tier entry: in place
        of the admission's restore (a replay, a checkpoint copy) there is nothing to run."""
        state.restore = StateRestore(state.state_slot, "swap")

    def can_fork(self) -> bool:
        return self.state_pool.num_free > 0

    def fork(self, state: DualPoolState) -> DualPoolState:
        """The child shares the complete spans and gets a state block of its own (the runner
        copies the parent's state into it). A parent's pending replay is the child's too (a
        runner may defer it to the next step; replaying twice rebuilds the same state); a
        checkpoint copy is not (done at admission, and the slot may be reused since)."""
        self.pool.incref(state.block_ids)
        slot = self._take_state_block()
        restore = state.restore
        if restore is not None:
            restore = replace(restore, state_slot=slot) if restore.method == "recompute" else None
        return DualPoolState(state.root, slot, list(state.block_ids), list(state.chain), restore)

    def can_forget_prefixes(self) -> bool:
        """Not while a swapped-out state waits in a tier: its resume needs the boundary kept."""
        return not self._swap_boundaries

    def forget_prefixes(self) -> None:
        """The kept turn ends and the checkpoints go with the pools' indexes (the coordinator
        empties them next: a checkpoint's parts and a kept state are free cached blocks)."""
        self._turn_ends.clear()
        self._checkpoints.clear()
        self._spills.clear()
        self._spilled.clear()

    def release(self, state: DualPoolState) -> None:
        """An uncommitted step dropped (it may have run: a checkpoint it pushed out is not
        restored, since the forward may have written over its slot), then the classical
        blocks tail-first (a chain's tail is evicted first), then the state block."""
        pending = state.pending
        if pending is not None:
            new_ids = state.block_ids[len(state.block_ids) - pending.num_new :]
            del state.block_ids[len(state.block_ids) - pending.num_new :]
            self.pool.decref(reversed(new_ids))
            snapshots = pending.snapshot_ids if self._slot_base else reversed(pending.snapshot_ids)
            self.checkpoint_pool.decref(b for ids in snapshots for b in ids)  # (slots: in the order taken)
            state.pending = None
        self.pool.decref(reversed(state.block_ids))
        self.state_pool.decref((state.state_slot,))
        state.block_ids = []

    # ---- invariants and figures ---------------------------------------------------------

    def usage(self, states: Iterable[tuple[DualPoolState, int]]) -> GroupUsage:
        """Classical blocks, each once, whole by construction (a computed span's slots are
        all filled), with an open reservation's checkpoint snapshot blocks where they are
        classical blocks (held_blocks); the state blocks as state blocks."""
        ids: set[int] = set()
        computed: set[int] = set()
        for state, num_computed in states:
            ids.update(self.held_blocks(state))
            computed.update(state.block_ids[: num_computed // self.span])
        return GroupUsage(len(ids), len(computed) * self.span, self.state_pool.num_blocks, self.state_pool.num_free)

    def check_state(
        self, rid: str, state: DualPoolState, token_ids: list[int], num_computed: int, end: int, holders: list[int]
    ) -> None:
        span = self.span
        where = f"group {self.name!r}, request {rid!r}"
        if len(state.block_ids) != end // span:
            raise AssertionError(
                f"only complete spans are pooled: {where} holds {len(state.block_ids)} classical blocks for "
                f"{end} reserved tokens (span {span})"
            )
        written = state.block_ids[num_computed // span :]
        rule = "written once (V4 never copies)"
        check_held(where, self.pool, self.held_blocks(state), written, holders, "classical block", rule)
        pending = state.pending
        if pending is not None and (pending.num_new != end // span - num_computed // span or not pending.num_new):
            raise AssertionError(f"{where}: a pending step of {pending.num_new} blocks for [{num_computed}, {end})")
        restore = state.restore
        if restore is not None and not (
            0 < num_computed
            and restore.state_slot == state.state_slot
            and (
                restore.method in ("adopt", "swap")
                or (restore.method == "checkpoint" and self._serves_checkpoint(restore, num_computed))
                or (
                    restore.method == "recompute"
                    and num_computed % span == 0
                    and restore.replay_start == self.spec.replay_start(num_computed)
                )
            )
        ):
            raise AssertionError(f"{where}: a restore {restore} pending at {num_computed} computed")
        if self.pool.enable_caching:
            chain, root = state.chain, state.root
            check_chain(where, self.pool, chain, root, token_ids, num_computed, span, block_ids=state.block_ids)

    def _serves_checkpoint(self, restore: StateRestore, point: int) -> bool:
        """Whether a restore by checkpoint at `point` is one this group can make: at a span
        boundary, from a checkpoint slot (checkpointing on); inside a span, from a spilled
        turn end only (spills on, `whole`), whose blocks are the classical pool's."""
        slot = restore.checkpoint_slot
        if slot is None or not self.checkpointing:
            return False
        if point % self.span == 0:
            return not restore.whole and self._slot_base <= slot < self._slot_base + self.checkpoint_pool.num_blocks
        return restore.whole and bool(self._spill_parts) and 0 <= slot < self.pool.num_blocks

    def check_states(self, states: dict[str, DualPoolState]) -> None:
        """Each request holds one state block of its own, unregistered; the others are
        free. Every kept turn-end state is a free block, findable, filed once. Every
        checkpoint is findable in all its parts; a pool of checkpoint slots of its own holds
        free slots and those of pending steps, once."""
        states_pool = self.state_pool
        states_pool.check_integrity()
        self._turn_ends.check_integrity()
        held = sorted(s.state_slot for s in states.values())
        free = sorted(states_pool.free_queue())
        if sorted(held + free) != list(range(states_pool.num_blocks)):
            raise AssertionError(f"group {self.name!r}: state blocks leaked or doubled: held {held}, free {free}")
        for rid, s in states.items():
            if states_pool.refcount(s.state_slot) != 1 or states_pool.block_hash(s.state_slot) is not None:
                raise AssertionError(
                    f"group {self.name!r}: request {rid!r}'s state block {s.state_slot} has refcount "
                    f"{states_pool.refcount(s.state_slot)}, kept {states_pool.block_hash(s.state_slot) is not None}"
                )
        for b in range(states_pool.num_blocks):
            kept = states_pool.prefix_block(b)
            if kept is not None and (
                kept.block_ids != (b,) or not states_pool.is_published(kept) or not self._turn_ends.listed(kept)
            ):
                raise AssertionError(
                    f"group {self.name!r}: kept state block {b} is not findable once (copies {kept.block_ids})"
                )
        self._spills.check_integrity()
        for block_hash, ckpt in self._spilled.items():  # (dead ones may wait to be dropped)
            if (
                ckpt.block.block_hash != block_hash
                or len(ckpt.parts) != self._spill_parts
                or ckpt.parts[0] is not ckpt.block
            ):
                raise AssertionError(f"spilled turn end {block_hash.hex()[:12]} is not {self._spill_parts} parts")
            if all(self.pool.is_published(part) for part in ckpt.parts) and (
                not self._spills.listed(ckpt.block)
                or any(part.parent is not ckpt.block for part in ckpt.parts[1:])
                or ckpt.slot != ckpt.block.block_ids[0] + self._slot_base
            ):
                raise AssertionError(f"spilled turn end {block_hash.hex()[:12]} is not findable as filed")
        pool = self.checkpoint_pool
        for block_hash, ckpt in self._checkpoints.items():
            if ckpt.block.block_hash != block_hash or len(ckpt.parts) != self._parts:
                raise AssertionError(f"checkpoint of {block_hash.hex()[:12]} is not {self._parts} parts")
            for part in ckpt.parts:
                if not part.block_ids or not pool.is_published(part) or part.parent is not ckpt.block:
                    raise AssertionError(f"checkpoint of {block_hash.hex()[:12]} lost a part: it is not findable")
            if ckpt.slot - self._slot_base not in ckpt.parts[0].block_ids:
                raise AssertionError(f"checkpoint in slot {ckpt.slot} is filed under another block")
        if pool is not self.pool:  # slots: held by pending steps only (pooled: the coordinator counts them)
            pool.check_integrity()
            held = [b for s in states.values() if s.pending is not None for ids in s.pending.snapshot_ids for b in ids]
            for b in range(pool.num_blocks):
                if pool.refcount(b) != held.count(b):
                    raise AssertionError(
                        f"group {self.name!r}: checkpoint slot {self._slot_base + b} has refcount "
                        f"{pool.refcount(b)}, held {held.count(b)} times"
                    )


class DSV4CacheManager(HybridCacheManager):
    """DeepSeek-V4's cache: the coordinator over one dual-pool group named "v4" (the module
    docstring; the tier hooks: `DualPoolGroupSpec.build`)."""

    def __init__(
        self,
        spec: DSV4Spec,
        num_classical_blocks: int,
        num_state_blocks: int,
        descriptor: CacheDescriptor,
        *,
        enable_prefix_caching: bool = True,
        restore: RestoreMethod = "recompute",
        num_checkpoints: int = 0,
        hash_algo: str = "xxh3_128",
        restore_cost: RestoreCost | None = None,
        checkpoint_blocks: int = 0,
        lower_tier: LowerTier | None = None,
        record_published: bool = False,
        turn_end_checkpoints: bool = False,
        spill_blocks: int = 0,
    ) -> None:
        restores = dict(
            restore=restore,
            num_checkpoints=num_checkpoints,
            checkpoint_blocks=checkpoint_blocks,
            spill_blocks=spill_blocks,
        )
        group = DualPoolGroupSpec.from_dsv4("v4", spec, restore_cost=restore_cost, **restores)
        super().__init__(
            [(group, (num_classical_blocks, num_state_blocks))],
            descriptor,
            enable_prefix_caching=enable_prefix_caching,
            hash_algo=hash_algo,
            lower_tier=lower_tier,
            record_published=record_published,
            turn_end_checkpoints=turn_end_checkpoints,
        )
