"""The recurrent group of a hybrid model (KDA, Mamba, gated DeltaNet): one fixed-size state
per request and checkpoints of it, a `CacheGroup` (cache/group.py) of the coordinator
(cache/coordinator.py). No torch.

A recurrent layer keeps no per-token cache: after t tokens its whole history is one state
S_t. So a prefix hit at P needs S_P, and only a snapshot taken at exactly P can give it.
The group's pool of state slots is a BlockPool whose "blocks" are slots (refcounts, LRU
eviction and the collision-guarded index for free):

  live state   refcount 1, unregistered: the state of one running request
  checkpoint   registered under the prefix it is the state of; refcount 0 in the LRU free
               queue while nobody restores from it, > 0 while a restore reads it

Checkpoints sit at hash boundaries every C tokens (C = `checkpoint_interval`, any positive
number; Kimi K3 pages 1,024-6,144 tokens and checkpoints every ~512). A step computing
[num_computed, end) gets a slot for each boundary b = k * C in (num_computed, end] whose
prefix has no checkpoint yet, as far as free slots go (a cache: a step never fails for
lack of one); the runner snapshots the state after position b - 1 into it and the commit
publishes it. Each checkpoint is looked up on its own (`BlockPool.lookup`), so it stays
findable when earlier ones were evicted.

Turn ends. The next turn of a conversation extends the previous prompt and answer, whose
end T is rarely a multiple of C: at a turn end the group files a checkpoint of S_T too
(`TurnEnds` in cache/chains.py). At a finish the live slot itself becomes it (it holds S_T:
no copy); `mark_turn_end` takes a fresh slot that the runner fills from the live state.

A hit at P restores from the checkpoint of P into a fresh live slot; the checkpoint stays
held until the request's first commit, so nothing reuses it before the runner's copy.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from kvpool.cache import chains
from kvpool.cache.chains import TurnEnds, UnitHits
from kvpool.cache.group import CacheGroup, GroupUsage, StepRequest, check_int_fields, check_pool_size
from kvpool.cache.types import NO_RESERVATION, BlockCopy, GroupReservation, LookupPrompt, MMItem, StateRestore
from kvpool.pool import BlockPool, PrefixBlock


@dataclass(frozen=True)
class RecurrentGroupSpec:
    """Recurrent layers sharing one state slot per request; a checkpoint every
    `checkpoint_interval` tokens."""

    name: str
    checkpoint_interval: int

    def __post_init__(self) -> None:
        check_int_fields(self, "checkpoint_interval")
        if self.checkpoint_interval <= 0:
            raise ValueError(
                f"group {self.name!r}: checkpoint_interval must be positive, got {self.checkpoint_interval}"
            )

    def build(
        self, size: int | None, *, enable_caching: bool, hash_algo: str, shared_pool: BlockPool | None
    ) -> RecurrentGroup:
        """The group with `size` state slots (live states and checkpoints) of its own."""
        return RecurrentGroup(
            self, BlockPool(check_pool_size(self.name, size), enable_caching=enable_caching, hash_algo=hash_algo)
        )


@dataclass(slots=True)
class RecurrentState:
    root: PrefixBlock
    slot: int  # the live state
    chain: list[PrefixBlock] = field(default_factory=list)  # C-chunks [0, num_computed // C) (caching on)
    pending: list[tuple[int, int]] = field(default_factory=list)  # (position b, slot): snapshot S_b in this step
    step_chain: list[PrefixBlock] = field(default_factory=list)  # the units the reserved step completes
    held_src: int | None = None  # the checkpoint restored from, held until the first commit
    held_turn: list[int] = field(default_factory=list)  # turn-end snapshots, held until the next commit


@dataclass(slots=True)
class RecurrentAdmit:
    src: int | None  # checkpoint slot to restore from (None: a fresh state)
    chain: list[PrefixBlock]


class RecurrentGroup(CacheGroup):
    """One live state per request and checkpoints of it."""

    kind = "recurrent"
    reads_whole_prefix = False
    has_table = False
    whole_steps = True
    has_state = True

    def __init__(self, spec: RecurrentGroupSpec, pool: BlockPool) -> None:
        self.spec = spec
        self.name = spec.name
        self.granularity = self.commit_period = spec.checkpoint_interval
        self.pool = pool
        self._turn_ends = TurnEnds(pool, spec.checkpoint_interval)  # turn-end checkpoints

    # ---- prefix hits -------------------------------------------------------------------

    def hits(self, root: PrefixBlock, prompt: LookupPrompt, limit: int | None, *, admission: bool = False) -> UnitHits:
        """Per C-chunk k, the checkpoint of the state after (k + 1) * C tokens, and the turn
        ends (points off the grid), up to `limit`, leaving a token to compute."""
        if not self.pool.enable_caching:
            return UnitHits([], [])
        token_ids, mm_items, packed, _ = prompt
        c = self.granularity
        top = min(len(token_ids) - 1, len(token_ids) if limit is None else limit)
        hits = chains.find_units(self.pool, root, token_ids, mm_items, c, top // c, packed)
        if self._turn_ends:
            hits.turn_ends = self._turn_ends.find_along([root, *hits.chain], token_ids, mm_items, top, packed)
        return hits

    def upper_bound(self, hits: UnitHits) -> int:
        return hits.upper_bound(self.granularity)

    def extra_points(self, hits: UnitHits) -> list[int]:
        return sorted(hits.turn_ends)

    def serves(self, hits: UnitHits, point: int) -> bool:
        k, rest = divmod(point, self.granularity)
        if rest:
            return point in hits.turn_ends
        return k == 0 or (k <= len(hits.found) and hits.found[k - 1] is not None)

    def plan_admit(self, hits: UnitHits | None, point: int, end: int) -> tuple[RecurrentAdmit, dict[BlockPool, int]]:
        """A live slot, and the checkpoint if it is free."""
        src, need, chain = None, 1, []
        if point:
            assert hits is not None, "a hit point comes from hits"
            chain = hits.chain[: point // self.granularity]
            ckpt = hits.turn_ends.get(point) or hits.found[point // self.granularity - 1]
            assert ckpt is not None, "serves() was checked"
            src = chains.held_copy(self.pool, ckpt)
            need += self.pool.refcount(src) == 0  # revived out of the free queue
        return RecurrentAdmit(src, chain), {self.pool: need}

    def claim(self, plan: RecurrentAdmit) -> None:
        if plan.src is not None:
            self.pool.incref((plan.src,))

    def apply_admit(self, plan: RecurrentAdmit, root: PrefixBlock) -> tuple[RecurrentState, tuple[BlockCopy, ...]]:
        slots = self.pool.allocate(1)
        assert slots is not None, "the coordinator checked the free count"
        return RecurrentState(root, slots[0], plan.chain, held_src=plan.src), ()

    # ---- steps -------------------------------------------------------------------------

    def blocks_needed(self, reqs: Sequence[StepRequest], ends: Sequence[int]) -> int:
        return 0  # a step needs only the live slot it has (checkpoint slots are optional)

    def apply_reserve(
        self, reqs: Sequence[StepRequest], ends: Sequence[int], *, detail: bool = True
    ) -> list[GroupReservation]:
        """Checkpoint slots for the step's boundaries whose prefix has no findable checkpoint
        yet, as far as free slots go (the latest boundaries first)."""
        c, pool, out = self.granularity, self.pool, []
        for req, end in zip(reqs, ends, strict=True):
            state = req.states[self.name]
            k0, k1 = req.num_computed // c, end // c
            if k1 == k0 or not pool.enable_caching:
                out.append(NO_RESERVATION)
                continue
            parent = state.chain[-1] if state.chain else state.root
            state.step_chain = chains.chain_units(pool, parent, req.token_ids, req.mm_items, c, k0, k1)
            wanted = [(k + 1) * c for k, block in enumerate(state.step_chain, k0) if pool.lookup(block) is None]
            wanted = wanted[max(0, len(wanted) - pool.num_free) :]
            slots = pool.allocate(len(wanted)) if wanted else []
            assert slots is not None
            taken = tuple(zip(wanted, slots, strict=True))
            state.pending.extend(taken)
            out.append(GroupReservation(checkpoints=taken) if taken else NO_RESERVATION)
        return out

    def commit(self, reqs: Sequence[StepRequest]) -> None:
        """Publish the steps' snapshots as cached checkpoints (free, in the LRU queue; one
        whose prefix another request checkpointed first joins it as a copy)."""
        pool, c = self.pool, self.granularity
        for req in reqs:
            state = req.states[self.name]
            state.chain += state.step_chain  # (a whole step: its units are all computed)
            state.step_chain = []
            for position, slot in state.pending:
                pool.register(slot, state.chain[position // c - 1], orphan_ok=True)
            pool.decref(slot for _, slot in reversed(state.pending))
            state.pending = []
            if state.held_src is not None:
                pool.decref((state.held_src,))
                state.held_src = None
            pool.decref(state.held_turn)
            state.held_turn = []

    # ---- turn ends ---------------------------------------------------------------------

    def mark_turn_end(
        self, state: RecurrentState, token_ids: list[int], mm_items: tuple[MMItem, ...], num_computed: int
    ) -> int | None:
        """Held until the request's next commit. None also when no slot is free (a cache)."""
        parent = state.chain[-1] if state.chain else state.root
        block = self._turn_ends.new_block(parent, token_ids, mm_items, num_computed)
        if block is None or self.pool.num_free == 0:
            return None
        slot = self.pool.allocate(1)
        assert slot is not None
        if not self._turn_ends.file(slot[0], block, orphan_ok=True):
            self.pool.decref(slot)
            return None
        state.held_turn.append(slot[0])
        return slot[0]

    def keep_turn_end(
        self, state: RecurrentState, token_ids: list[int], mm_items: tuple[MMItem, ...], num_computed: int
    ) -> bool:
        """The live slot holds S_num_computed: file it (the release leaves it cached, free);
        not while a restore is pending."""
        if state.held_src is not None:
            return False
        block = self._turn_ends.new_block(
            state.chain[-1] if state.chain else state.root, token_ids, mm_items, num_computed
        )
        return block is not None and self._turn_ends.file(state.slot, block, orphan_ok=True)

    # ---- queries on a request's state ---------------------------------------------------

    def held_blocks(self, state: RecurrentState) -> list[int]:
        held = [state.slot, *(s for _, s in state.pending), *state.held_turn]
        return held if state.held_src is None else [*held, state.held_src]

    def state_slot(self, state: RecurrentState) -> int | None:
        return state.slot

    def restore(self, state: RecurrentState) -> StateRestore | None:
        if state.held_src is None:
            return StateRestore(state.slot, "none")
        return StateRestore(state.slot, "checkpoint", state.held_src)

    def checkpoints(self, state: RecurrentState) -> list[tuple[int, int]]:
        return state.pending

    def prefix_chain(self, state: RecurrentState) -> list[PrefixBlock]:
        return state.chain

    def metadata_bytes(self, state: RecurrentState) -> int:
        return sys.getsizeof(state) + sys.getsizeof(state.chain) + sys.getsizeof(state.pending)

    def can_fork(self) -> bool:
        return self.pool.num_free > 0

    def fork(self, state: RecurrentState) -> RecurrentState:
        slots = self.pool.allocate(1)
        assert slots is not None, "can_fork was checked"
        return RecurrentState(state.root, slots[0], list(state.chain))

    def forget_prefixes(self) -> None:
        """The turn ends kept go with the pool's index (the coordinator empties it next)."""
        self._turn_ends.clear()

    def release(self, state: RecurrentState) -> None:
        """The live slot and unwritten snapshot slots go back unhashed."""
        self.pool.decref([slot for _, slot in reversed(state.pending)] + [state.slot] + state.held_turn)
        if state.held_src is not None:
            self.pool.decref((state.held_src,))
        state.pending = []
        state.held_src = None
        state.held_turn = []

    # ---- invariants and figures ---------------------------------------------------------

    def usage(self, states: Iterable[tuple[RecurrentState, int]]) -> GroupUsage:
        """No table blocks; every slot (live states and checkpoints) as a state block."""
        return GroupUsage(0, 0, self.pool.num_blocks, self.pool.num_free)

    def check_states(self, states: dict[str, RecurrentState]) -> None:
        self._turn_ends.check_integrity()

    def check_state(
        self, rid: str, state: RecurrentState, token_ids: list[int], num_computed: int, end: int, holders: list[int]
    ) -> None:
        where = f"group {self.name!r}, request {rid!r}"
        written = [state.slot, *(slot for _, slot in state.pending)]
        chains.check_held(where, self.pool, self.held_blocks(state), written, holders)
        for slot in state.held_turn:
            if self.pool.block_hash(slot) is None:
                raise AssertionError(f"{where}: turn-end slot {slot} is held but not filed as a checkpoint")
        for position, _ in state.pending:
            if not (num_computed < position <= end and position % self.granularity == 0):
                raise AssertionError(f"{where}: a snapshot at {position} outside the step ({num_computed}, {end}]")
        if self.pool.enable_caching:
            chains.check_chain(where, self.pool, state.chain, state.root, token_ids, num_computed, self.granularity)
