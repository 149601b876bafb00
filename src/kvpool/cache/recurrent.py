"""One recurrent layer group of a hybrid model (KDA, Mamba, gated DeltaNet): a fixed-size
state per request and checkpoints of that state, driven by the coordinator
(cache/coordinator.py). No torch.

A recurrent layer keeps no per-token cache: after t tokens its whole history is one state
S_t of fixed size. So a prefix hit at P needs S_P, and only a snapshot taken at exactly P
can give it. The group keeps one pool of state slots (a BlockPool whose "blocks" are
slots, so checkpoints get refcounts, LRU eviction and the collision-guarded index for
free):

  live state   refcount 1, unregistered: the state of one running request
  checkpoint   registered under the prefix it is the state of; refcount 0 in the LRU free
               queue while nobody restores from it (reused after unhashed free slots, the
               least recently used first), > 0 while a restore reads it

Checkpoints are taken at hash boundaries every C tokens (C = `checkpoint_interval`, any
positive number: a multiple of the attention block size or not; Kimi K3 pages 1,024-6,144
tokens and checkpoints every ~512). A step that computes [num_computed, end) gets a slot
for each boundary b = k * C in (num_computed, end] whose prefix has no checkpoint yet, as
far as free slots go (checkpoints are a cache: a step never fails for lack of one); the
runner snapshots the state after position b - 1 into it; the commit publishes it. The
prefix chain runs over C-token chunks and each checkpoint is looked up on its own
(`BlockPool.lookup`), so a checkpoint stays findable when earlier ones were evicted.

Turn ends. A conversation's next turn extends the previous turn's prompt and answer, whose
end T is rarely a multiple of C. At a turn end (the request finishes, or
`mark_turn_end`) the group keeps a checkpoint of S_T too, hashed as the chain of T's full
C-chunks followed by the partial chunk [T // C * C, T) with a "turn" key. A side index
keyed by that chunk parent's hash lists the turn ends after it, so `hits` probes only the
turn ends recorded under the prompt's own chunks (each verified by the pool's content
guard). At a finish the live slot itself becomes the checkpoint (it holds S_T: no copy);
`mark_turn_end` takes a fresh slot that the runner fills from the live state at once.

A hit at P restores from the checkpoint of P: the request gets a fresh live slot, the
runner copies the checkpoint into it, and the checkpoint stays held until the request's
first commit (so no allocation can reuse it before the copy is made).
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from kvpool.cache.group import (
    CacheGroup,
    GroupUsage,
    StepRequest,
    TurnEnds,
    chain_units,
    check_pool_size,
    held_copy,
    num_leading,
)
from kvpool.cache.types import BlockCopy, GroupReservation, MMItem, StateRestore
from kvpool.pool import BlockPool, PrefixBlock
from kvpool.pool.hashing import token_bytes


@dataclass(frozen=True)
class RecurrentGroupSpec:
    """Recurrent layers sharing one state slot per request; a checkpoint every
    `checkpoint_interval` tokens."""

    name: str
    checkpoint_interval: int

    def __post_init__(self) -> None:
        if self.checkpoint_interval <= 0:
            raise ValueError(
                f"group {self.name!r}: checkpoint_interval must be positive, got {self.checkpoint_interval}"
            )

    def build(
        self, size: int | None, *, enable_caching: bool, hash_algo: str, shared_pool: BlockPool | None
    ) -> RecurrentGroup:
        """The group with `size` state slots (live states and checkpoints) of its own."""
        return RecurrentGroup(
            self, check_pool_size(self.name, size), enable_caching=enable_caching, hash_algo=hash_algo
        )


@dataclass(slots=True)
class RecurrentState:
    """One request's state in one recurrent group."""

    root: PrefixBlock
    slot: int  # the live state
    chain: list[PrefixBlock] = field(default_factory=list)  # C-chunks [0, num_computed // C) (caching on)
    pending: list[tuple[int, int]] = field(default_factory=list)  # (position b, slot): snapshot S_b in this step
    held_src: int | None = None  # the checkpoint restored from, held until the first commit
    held_turn: list[int] = field(default_factory=list)  # turn-end snapshots, held until the next commit


@dataclass(slots=True)
class RecurrentHits:
    found: list[PrefixBlock | None]  # per C-chunk k: the checkpoint of the state after (k + 1) * C tokens
    turn_ends: dict[int, PrefixBlock] = field(default_factory=dict)  # point T (not a multiple of C) -> checkpoint


@dataclass(slots=True)
class RecurrentAdmit:
    src: int | None  # checkpoint slot to restore from (None: a fresh state)
    chain: list[PrefixBlock]


_NO_RESERVATION = GroupReservation()


class RecurrentGroup(CacheGroup):
    """A `CacheGroup` (cache/group.py): one live state per request and checkpoints of it."""

    kind = "recurrent"
    reads_whole_prefix = False
    has_table = False
    whole_steps = True
    has_state = True

    def __init__(
        self, spec: RecurrentGroupSpec, num_slots: int, *, enable_caching: bool = True, hash_algo: str = "xxh3_128"
    ) -> None:
        self.spec = spec
        self.name = spec.name
        self.granularity = self.commit_period = spec.checkpoint_interval
        self.pool = BlockPool(num_slots, enable_caching=enable_caching, hash_algo=hash_algo)
        self._turn_ends = TurnEnds(self.pool, spec.checkpoint_interval)  # turn-end checkpoints

    @property
    def num_checkpoints(self) -> int:
        """Checkpoints findable now (held or free)."""
        return self.pool.num_cached

    # ---- prefix hits -------------------------------------------------------------------

    def hits(
        self,
        root: PrefixBlock,
        token_ids: list[int],
        mm_items: tuple[MMItem, ...],
        limit: int | None = None,
        *,
        admission: bool = False,
        packed: bytes | None = None,
    ) -> RecurrentHits:
        """The checkpoint of each C-chunk boundary, up to `limit` tokens (another group's
        upper bound on the hit) when given. Changes nothing."""
        if not self.pool.enable_caching:
            return RecurrentHits([])
        c = self.granularity
        n = len(token_ids) if limit is None else min(len(token_ids), limit)
        top = min(n, len(token_ids) - 1)  # (a point leaves a token to compute)
        chain = chain_units(self.pool, root, token_ids, mm_items, c, 0, top // c)
        hits = RecurrentHits([self.pool.lookup(b) for b in chain[: n // c]])
        if self._turn_ends:
            for k, parent in enumerate([root, *chain]):
                hits.turn_ends.update(self._turn_ends.find(parent, k * c, token_ids, mm_items, top))
        return hits

    def upper_bound(self, hits: RecurrentHits) -> int:
        """No point above the last findable checkpoint is served."""
        found = hits.found
        bound = num_leading(found) * self.granularity
        return max(bound, *hits.turn_ends) if hits.turn_ends else bound

    def extra_points(self, hits: RecurrentHits) -> list[int]:
        """Points off the C grid this group serves: its turn ends."""
        return sorted(hits.turn_ends)

    def serves(self, hits: RecurrentHits, point: int) -> bool:
        if point == 0:
            return True
        k, rest = divmod(point, self.granularity)
        if rest:
            return point in hits.turn_ends
        return k <= len(hits.found) and hits.found[k - 1] is not None

    def plan_admit(
        self,
        hits: RecurrentHits | None,
        root: PrefixBlock,
        token_ids: list[int],
        mm_items: tuple[MMItem, ...],
        point: int,
        end: int,
    ) -> tuple[RecurrentAdmit, dict[BlockPool, int]]:
        """(the plan, free slots it needs): a live slot, and the checkpoint if it is free."""
        src = None
        need = 1
        if point:
            assert hits is not None, "a hit point comes from hits"
            ckpt = hits.turn_ends.get(point) or hits.found[point // self.granularity - 1]
            assert ckpt is not None, "serves() was checked"
            src = held_copy(self.pool, ckpt)
            need += self.pool.refcount(src) == 0  # revived out of the free queue
        num = point // self.granularity if self.pool.enable_caching else 0
        chain = chain_units(self.pool, root, token_ids, mm_items, self.granularity, 0, num)
        return RecurrentAdmit(src, chain), {self.pool: need}

    def claim(self, plan: RecurrentAdmit) -> None:
        """Hold the checkpoint to restore from (before any allocation can reuse it)."""
        if plan.src is not None:
            self.pool.incref((plan.src,))

    def apply_admit(self, plan: RecurrentAdmit, root: PrefixBlock) -> tuple[RecurrentState, tuple[BlockCopy, ...]]:
        """After `claim`: the live slot."""
        slots = self.pool.allocate(1)
        assert slots is not None, "the coordinator checked the free count"
        return RecurrentState(root, slots[0], plan.chain, [], plan.src), ()

    # ---- steps -------------------------------------------------------------------------

    def blocks_needed(self, reqs: Sequence[StepRequest], ends: Sequence[int]) -> int:
        """None: a step needs only the live slot it has (checkpoint slots are optional)."""
        return 0

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
                out.append(_NO_RESERVATION)
                continue
            parent = state.chain[-1] if state.chain else state.root
            chain = chain_units(pool, parent, req.token_ids, req.mm_items, c, k0, k1)
            wanted = [(k + 1) * c for k, block in enumerate(chain, k0) if pool.lookup(block) is None]
            wanted = wanted[max(0, len(wanted) - pool.num_free) :]
            slots = pool.allocate(len(wanted)) if wanted else []
            assert slots is not None
            taken = tuple(zip(wanted, slots, strict=True))
            state.pending.extend(taken)
            out.append(GroupReservation(checkpoints=taken) if taken else _NO_RESERVATION)
        return out

    def commit(self, reqs: Sequence[StepRequest]) -> None:
        """The steps' snapshots hold S_b: publish them as cached checkpoints (free, in the
        LRU queue; one whose prefix another request checkpointed first joins it as a copy)."""
        for req in reqs:
            self._commit(req.states[self.name], req.token_ids, req.num_computed, req.mm_items)

    def _commit(
        self, state: RecurrentState, token_ids: list[int], num_computed: int, mm_items: tuple[MMItem, ...]
    ) -> None:
        pool, c = self.pool, self.granularity
        if pool.enable_caching:
            parent = state.chain[-1] if state.chain else state.root
            state.chain += chain_units(pool, parent, token_ids, mm_items, c, len(state.chain), num_computed // c)
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

    def _turn_block(
        self, state: RecurrentState, token_ids: list[int], mm_items: tuple[MMItem, ...], num_computed: int
    ) -> PrefixBlock | None:
        parent = state.chain[-1] if state.chain else state.root
        return self._turn_ends.new_block(parent, token_ids, mm_items, num_computed)

    def mark_turn_end(
        self, state: RecurrentState, token_ids: list[int], mm_items: tuple[MMItem, ...], num_computed: int
    ) -> int | None:
        """A slot for a checkpoint of the live state (S_num_computed), filed now and held
        until the request's next commit; the runner copies the live state into it at once.
        None when none is needed or no slot is free (a checkpoint is a cache)."""
        block = self._turn_block(state, token_ids, mm_items, num_computed)
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
        """At a finish: the live slot holds S_num_computed; file it as the turn-end checkpoint
        (the release then leaves it cached, free). Only with no step pending and the restore
        done (the caller checks the step)."""
        if state.held_src is not None:
            return False
        block = self._turn_block(state, token_ids, mm_items, num_computed)
        return block is not None and self._turn_ends.file(state.slot, block, orphan_ok=True)

    # ---- queries on a request's state ---------------------------------------------------

    def held_blocks(self, state: RecurrentState) -> list[int]:
        held = [state.slot, *(s for _, s in state.pending), *state.held_turn]
        return held if state.held_src is None else [*held, state.held_src]

    def state_slot(self, state: RecurrentState) -> int | None:
        return state.slot

    def restore(self, state: RecurrentState) -> StateRestore | None:
        """From the checkpoint the hit found, until the first commit; else "none"."""
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

    def release(self, state: RecurrentState) -> None:
        """The live slot and unwritten snapshot slots go back unhashed; a held source is let go."""
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

    def check_state(
        self, rid: str, state: RecurrentState, token_ids: list[int], num_computed: int, end: int, holders: list[int]
    ) -> None:
        where = f"group {self.name!r}, request {rid!r}"
        for slot in [state.slot] + [s for _, s in state.pending]:
            holders[slot] += 1
            if self.pool.block_hash(slot) is not None:
                raise AssertionError(f"{where}: slot {slot} is written this step but registered as a checkpoint")
        if state.held_src is not None:
            holders[state.held_src] += 1
        for slot in state.held_turn:
            holders[slot] += 1
            if self.pool.block_hash(slot) is None:
                raise AssertionError(f"{where}: turn-end slot {slot} is held but not filed as a checkpoint")
        for position, _ in state.pending:
            if not (num_computed < position <= end and position % self.granularity == 0):
                raise AssertionError(f"{where}: a snapshot at {position} outside the step ({num_computed}, {end}]")
        if self.pool.enable_caching:
            if len(state.chain) != num_computed // self.granularity:
                raise AssertionError(f"{where}: {len(state.chain)} chained chunks for {num_computed} computed")
            c = self.granularity
            for k, block in enumerate(state.chain):
                if block.token_bytes != token_bytes(token_ids[k * c : (k + 1) * c]):
                    raise AssertionError(f"{where}: chain element {k} is not its own prefix")
