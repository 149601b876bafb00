"""DeepSeek-V4's dual pool as one group of the hybrid coordinator (cache/coordinator.py). No torch.

The same semantics as `DSV4CacheManager` (cache/dsv4.py, DEEPSEEK_V4.md sections 5 and 6),
cut to the group protocol the coordinator drives (the one of cache/window.py and
cache/recurrent.py):

  classical pool  blocks of `span` tokens of compressed entries (a BlockPool: refcounts,
                  LRU free queue, the chained-hash prefix index). A block is written once,
                  by the step that completes its span, and published at that step's
                  commit; it is never written again, so it is shared without copy-on-write.
  state pool      a fixed number of state blocks (SWA window, compressor tails, the
                  unfinished span's entries), one per request, taken at admission and
                  returned at release. Mutable every step, never shared. A BlockPool with
                  caching off: its free queue is FIFO, as DSV4CacheManager's deque.

Per request, while it computes [num_computed, end):

  [0, num_computed // span * span)   complete spans: classical blocks, published (shared
                                     read-only after a hit or a fork)
  [.., num_computed)                 the unfinished span: in the state block only
  spans completed by the step        fresh classical blocks (refcount 1, unpublished): the
                                     table covers [0, end // span)

Prefix hits. The prompt's complete spans are chained like full-attention blocks (a hit
point needs every span before it: CSA / HCA read all compressed entries), and a point P is
served only at a span boundary, P = q * span with the first q spans cached: the
compressed entries of an unfinished span are never stored. The coordinator takes the
largest point every group serves, so an in-span point another group offers (a block end,
a recurrent checkpoint) is passed over for the largest common span boundary.

Restore. The state at a hit P is rebuilt by recompute (section 6): the runner replays
tokens [max(0, P - replay_len), P) on top of the q cached blocks (V4: replay_len =
n_win * num_layers rebuilds every layer's window; at a span boundary the compressor tails
are empty). The request's `replay_start` says so until its first commit.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from kvpool.cache.base import mm_extra_key
from kvpool.cache.group import CacheGroup, GroupUsage, StepRequest
from kvpool.cache.types import BlockCopy, GroupReservation, MMItem, StateRestore
from kvpool.pool import BlockPool, PrefixBlock
from kvpool.pool.hashing import TOKEN_BYTES, token_bytes
from kvpool.spec.dsv4 import DSV4Spec


@dataclass(frozen=True)
class DualPoolGroupSpec:
    """Layers of a V4-style model: one classical block per `span` tokens, one state block per
    request; a hit's state is rebuilt by replaying the `replay_len` tokens before it."""

    name: str
    span: int
    replay_len: int = 0

    def __post_init__(self) -> None:
        if self.span <= 0:
            raise ValueError(f"group {self.name!r}: span must be positive, got {self.span}")
        if self.replay_len < 0:
            raise ValueError(f"group {self.name!r}: replay_len must be >= 0, got {self.replay_len}")

    def build(
        self, size: object, *, enable_caching: bool, hash_algo: str, shared_pool: BlockPool | None
    ) -> DualPoolGroup:
        """The group; `size` is the pair (classical blocks, state blocks), both positive."""
        if not (isinstance(size, tuple) and len(size) == 2 and all(isinstance(n, int) and n > 0 for n in size)):
            raise ValueError(
                f"dual-pool group {self.name!r} needs (classical blocks, state blocks), both positive, got {size!r}"
            )
        return DualPoolGroup(self, *size, enable_caching=enable_caching, hash_algo=hash_algo)

    @classmethod
    def from_dsv4(cls, name: str, spec: DSV4Spec) -> DualPoolGroupSpec:
        """V4's dual pool: the classical span, and the window of every layer replayed."""
        return cls(name, spec.span, spec.window * spec.num_layers)

    def replay_start(self, point: int) -> int:
        """The first token the restore of a hit at `point` replays."""
        return max(0, point - self.replay_len)


@dataclass(slots=True)
class DualPoolState:
    """One request's blocks in one dual-pool group."""

    root: PrefixBlock
    state_slot: int  # the request's state block
    block_ids: list[int] = field(default_factory=list)  # classical blocks of spans [0, end // span)
    chain: list[PrefixBlock] = field(default_factory=list)  # spans [0, num_computed // span) (caching on)
    replay_start: int | None = None  # a hit's restore to run: replay [replay_start, num_computed)


@dataclass(slots=True)
class DualPoolHits:
    """The prompt's leading run of cached spans."""

    block_ids: list[int]
    chain: list[PrefixBlock]


@dataclass(slots=True)
class DualPoolAdmit:
    hit_ids: list[int]  # classical blocks of spans [0, P // span)
    num_new: int  # fresh classical blocks for the spans the first step completes
    chain: list[PrefixBlock]
    replay_start: int | None


_NO_RESERVATION = GroupReservation()


class DualPoolGroup(CacheGroup):
    """A `CacheGroup` (cache/group.py): classical blocks of complete spans, one state block
    per request."""

    kind = "dual_pool"
    reads_whole_prefix = True
    has_table = True
    whole_steps = True
    has_state = True

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
        self.state_pool = BlockPool(num_state_blocks, enable_caching=False)
        self.granularity = self.commit_period = spec.span

    def pools(self) -> tuple[BlockPool, ...]:
        return (self.pool, self.state_pool)

    # ---- prefix hits -------------------------------------------------------------------

    def _extras(self, mm_items: tuple[MMItem, ...], num: int) -> list[bytes] | None:
        return [mm_extra_key(mm_items, self.span, k) for k in range(num)] if mm_items else None

    def hits(
        self,
        root: PrefixBlock,
        token_ids: list[int],
        mm_items: tuple[MMItem, ...],
        limit: int | None = None,
        *,
        admission: bool = False,
        packed: bytes | None = None,
    ) -> DualPoolHits:
        """The leading run of cached complete spans, leaving a token to compute, and no
        further than `limit` tokens (another group's upper bound). Changes nothing."""
        if not self.pool.enable_caching:
            return DualPoolHits([], [])
        span = self.span
        num = (len(token_ids) - 1) // span
        if limit is not None:
            num = min(num, limit // span)
        hit = self.pool.match(
            root,
            packed[: num * span * TOKEN_BYTES] if packed is not None else token_bytes(token_ids[: num * span]),
            span * TOKEN_BYTES,
            num,
            self._extras(mm_items, num),
            count_collisions=False,
        )
        return DualPoolHits(hit.block_ids, hit.chain)

    def upper_bound(self, hits: DualPoolHits) -> int:
        return len(hits.block_ids) * self.span

    def serves(self, hits: DualPoolHits, point: int) -> bool:
        """A span boundary whose spans before it are all cached (or the start)."""
        return point % self.span == 0 and point // self.span <= len(hits.block_ids)

    def plan_admit(
        self,
        hits: DualPoolHits | None,
        root: PrefixBlock,
        token_ids: list[int],
        mm_items: tuple[MMItem, ...],
        point: int,
        end: int,
    ) -> tuple[DualPoolAdmit, dict[BlockPool, int]]:
        """(the plan, free blocks it needs per pool) for a hit at `point` and a first step to
        `end`: the step's fresh classical blocks, the hit's blocks revived out of the free
        queue, and one state block."""
        q = point // self.span
        assert q * self.span == point, f"group {self.name!r} serves no point inside a span ({point})"
        hit_ids = list(hits.block_ids[:q]) if hits is not None else []
        assert len(hit_ids) == q, "serves() was checked"
        num_new = end // self.span - q
        revived = sum(1 for b in hit_ids if self.pool.refcount(b) == 0)
        chain = list(hits.chain[:q]) if hits is not None and self.pool.enable_caching else []
        replay = self.spec.replay_start(point) if point else None
        return DualPoolAdmit(hit_ids, num_new, chain, replay), {self.pool: num_new + revived, self.state_pool: 1}

    def claim(self, plan: DualPoolAdmit) -> None:
        """Hold the hit's blocks before any group allocates."""
        self.pool.incref(plan.hit_ids)

    def apply_admit(self, plan: DualPoolAdmit, root: PrefixBlock) -> tuple[DualPoolState, tuple[BlockCopy, ...]]:
        """After `claim`: the state block and the first step's classical blocks."""
        slot = self.state_pool.allocate(1)
        new = self.pool.allocate(plan.num_new)
        assert slot is not None and new is not None, "the coordinator checked the free counts"
        return DualPoolState(root, slot[0], [*plan.hit_ids, *new], list(plan.chain), plan.replay_start), ()

    # ---- steps -------------------------------------------------------------------------

    def blocks_needed(self, reqs: Sequence[StepRequest], ends: Sequence[int]) -> int:
        """Classical blocks a step takes: one per span it completes."""
        name, span = self.name, self.span
        return sum(end // span - len(req.states[name].block_ids) for req, end in zip(reqs, ends, strict=True))

    def apply_reserve(
        self, reqs: Sequence[StepRequest], ends: Sequence[int], *, detail: bool = True
    ) -> list[GroupReservation]:
        out = []
        for req, end in zip(reqs, ends, strict=True):
            state = req.states[self.name]
            num_new = end // self.span - len(state.block_ids)
            if not num_new:
                out.append(_NO_RESERVATION)  # the common decode step: no span completes
                continue
            new = self.pool.allocate(num_new)
            assert new is not None, "the coordinator checked the free count"
            state.block_ids.extend(new)
            out.append(GroupReservation(tuple(new)))
        return out

    def commit(self, reqs: Sequence[StepRequest]) -> None:
        """The steps are computed: publish the spans they completed (each written once, now
        immutable); a hit's restore is done."""
        for req in reqs:
            self._commit(req.states[self.name], req.token_ids, req.num_computed, req.mm_items)

    def _commit(
        self, state: DualPoolState, token_ids: list[int], num_computed: int, mm_items: tuple[MMItem, ...]
    ) -> None:
        span = self.span
        assert len(state.block_ids) == num_computed // span, "a commit is of the whole reserved step"
        k0, k1 = len(state.chain), num_computed // span
        if self.pool.enable_caching and k1 > k0:
            parent = state.chain[-1] if state.chain else state.root
            data, width = token_bytes(token_ids[k0 * span : k1 * span]), span * TOKEN_BYTES
            for k in range(k0, k1):
                extra = mm_extra_key(mm_items, span, k) if mm_items else b""
                block = self.pool.chain(parent, data[(k - k0) * width : (k - k0 + 1) * width], extra)
                # Another request may have published the same span first: the chain goes on
                # from that copy (same content, same hash), this block joins it as a copy.
                parent = self.pool.register(state.block_ids[k], block) or block
                state.chain.append(parent)
        state.replay_start = None

    # ---- queries on a request's state ---------------------------------------------------

    def block_ids(self, state: DualPoolState) -> list[int]:
        return state.block_ids

    def held_blocks(self, state: DualPoolState) -> list[int]:
        return state.block_ids

    def state_slot(self, state: DualPoolState) -> int | None:
        return state.state_slot

    def restore(self, state: DualPoolState) -> StateRestore | None:
        """A hit's replay on top of the cached spans, until the first commit; else "none"."""
        if state.replay_start is None:
            return StateRestore(state.state_slot, "none")
        return StateRestore(state.state_slot, "recompute", replay_start=state.replay_start)

    def prefix_chain(self, state: DualPoolState) -> list[PrefixBlock]:
        return state.chain

    def metadata_bytes(self, state: DualPoolState) -> int:
        return sys.getsizeof(state) + sys.getsizeof(state.block_ids) + sys.getsizeof(state.chain)

    def can_fork(self) -> bool:
        return self.state_pool.num_free > 0

    def fork(self, state: DualPoolState) -> DualPoolState:
        """The child shares the complete spans and gets a state block of its own (the runner
        copies the parent's state into it; a parent's pending replay is the child's too)."""
        slot = self.state_pool.allocate(1)
        assert slot is not None, "can_fork was checked"
        self.pool.incref(state.block_ids)
        return DualPoolState(state.root, slot[0], list(state.block_ids), list(state.chain), state.replay_start)

    def release(self, state: DualPoolState) -> None:
        """Classical blocks tail-first (a chain's tail is evicted first), then the state block."""
        self.pool.decref(reversed(state.block_ids))
        self.state_pool.decref((state.state_slot,))
        state.block_ids = []

    # ---- invariants and figures ---------------------------------------------------------

    def usage(self, states: Iterable[tuple[DualPoolState, int]]) -> GroupUsage:
        """Classical blocks, each once, whole by construction (a computed span's slots are
        all filled); the state blocks as state blocks."""
        ids: set[int] = set()
        computed: set[int] = set()
        for state, num_computed in states:
            ids.update(state.block_ids)
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
        if len(set(state.block_ids)) != len(state.block_ids):
            raise AssertionError(f"invariant 1: {where} holds a classical block twice")
        for b in state.block_ids:
            holders[b] += 1
        for b in state.block_ids[num_computed // span :]:
            if self.pool.refcount(b) != 1 or self.pool.block_hash(b) is not None:
                raise AssertionError(
                    f"written once: {where} will write classical block {b} (refcount {self.pool.refcount(b)}, "
                    f"published {self.pool.block_hash(b) is not None})"
                )
        if state.replay_start is not None and not (
            0 < num_computed and num_computed % span == 0 and state.replay_start == self.spec.replay_start(num_computed)
        ):
            raise AssertionError(f"{where}: a replay from {state.replay_start} pending at {num_computed} computed")
        if self.pool.enable_caching:
            if len(state.chain) != num_computed // span:
                raise AssertionError(f"invariant 6: {where} has {len(state.chain)} chained spans for {num_computed}")
            for k, block in enumerate(state.chain):
                if block.parent is not (state.chain[k - 1] if k else state.root) or block.token_bytes != token_bytes(
                    token_ids[k * span : (k + 1) * span]
                ):
                    raise AssertionError(f"invariant 6: {where} chain element {k} is not its own prefix")
                registered = self.pool.prefix_block(state.block_ids[k])
                if registered is not None and registered is not block:
                    raise AssertionError(f"invariant 6: {where} classical block {k} is registered as other content")

    def check_states(self, states: dict[str, DualPoolState]) -> None:
        """Each request holds one state block of its own; the others are free."""
        self.state_pool.check_integrity()
        held = sorted(s.state_slot for s in states.values())
        free = sorted(self.state_pool.free_queue())
        if sorted(held + free) != list(range(self.state_pool.num_blocks)):
            raise AssertionError(f"group {self.name!r}: state blocks leaked or doubled: held {held}, free {free}")
        for rid, s in states.items():
            if self.state_pool.refcount(s.state_slot) != 1:
                raise AssertionError(
                    f"group {self.name!r}: request {rid!r}'s state block {s.state_slot} has refcount "
                    f"{self.state_pool.refcount(s.state_slot)}"
                )
