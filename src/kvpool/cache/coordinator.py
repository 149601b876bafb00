"""The hybrid cache coordinator: one CacheManager over every layer group of a model.

A hybrid model mixes layer kinds whose caches differ in granularity (DEEPSEEK_V4.md
section 8, Kimi K3's Figure 12): full-attention and sliding-window groups keep physical
blocks of K/V (cache/window.py), recurrent groups one state per request plus checkpoints
of it (cache/recurrent.py), a V4 dual-pool group immutable classical blocks of complete
spans plus one state block per request (cache/dual_pool.py). Each group has its own pool
(the dual pool two); the coordinator keeps one token history and one computed count per
request and moves every group together.

Prefix hits. Every group reports which hit points it can serve; the coordinator takes the
largest point P that every group serves (candidates: multiples of the gcd of the groups'
granularities, at most len(prompt) - 1, so one token is left to compute). Example: an
attention group whose cached blocks end at {512, 1024, 1536} and a recurrent group with
checkpoints at {0, 1024} give P = 1024. Reusing only one side is wrong: attention K/V up
to 1536 with a recurrent state from anywhere else than 1536 is not the state of that
prefix. A P inside an attention block copies that block on write (cache/window.py); a
dual-pool group serves span boundaries only, so P is one (its blocks are never copied).

Transactions. `admit`, `reserve`, `reserve_step` and `fork` first ask every group what
they need from its pool, and change nothing unless every group has it (one group out of
room: nothing changes in any group; a dual-pool group without a free state block refuses
an admission and a fork the same way). Optional checkpoint slots are taken last, from
what is left. A release frees every group exactly once.

Pools. Each group has a pool of its own, or the attention groups draw from one shared
pool (`shared_blocks`; vLLM's hybrid allocator, and what a serving engine does when the
groups' pages have one byte size): a block that leaves a window goes back to the one
free queue, where any group's next step can take it, so the pool holds what the requests
really hold. Each group chains its hashes from a root of its own (the group's name is in
the root), so a group never finds another group's blocks; the free counts that a
transaction checks are summed per pool.

Steps are explicit, as for the V4 manager: a reservation covers [num_computed, end) and
the commit is of exactly those tokens (a recurrent state advances by whole steps).

Pure Python: the runner applies the groups' copies (`take_copies`) and restores
(`restore_source`, `state_restore`) and writes the snapshots (`checkpoints`) that the
coordinator records.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvpool.cache.base import CacheManager, check_mm_items
from kvpool.cache.dual_pool import DualPoolGroup, DualPoolGroupSpec, DualPoolState
from kvpool.cache.recurrent import RecurrentGroup, RecurrentGroupSpec, RecurrentState
from kvpool.cache.types import (
    Admission,
    BlockCopy,
    CacheDescriptor,
    CacheUsage,
    MMItem,
    ReleaseReason,
    Reservation,
    StateRestore,
)
from kvpool.cache.window import AttentionGroup, AttentionGroupSpec, AttentionHits
from kvpool.pool import BlockPool, PrefixBlock

GroupSpec = AttentionGroupSpec | RecurrentGroupSpec | DualPoolGroupSpec
Group = AttentionGroup | RecurrentGroup | DualPoolGroup
# One concrete group class per spec type (a plain dict, STYLE 11).
GROUP_CLASSES: dict[type, type] = {
    AttentionGroupSpec: AttentionGroup,
    RecurrentGroupSpec: RecurrentGroup,
    DualPoolGroupSpec: DualPoolGroup,
}


def _is_full(group: Group) -> bool:
    """A group whose hits end at the prompt's first miss (every block before a point is read)."""
    return isinstance(group, DualPoolGroup) or (isinstance(group, AttentionGroup) and group.spec.window is None)


@dataclass(slots=True)
class _Request:
    request_id: str
    token_ids: list[int]
    mm_items: tuple[MMItem, ...]
    roots: dict[str, PrefixBlock]  # per group (each pool interns its own roots)
    num_computed: int = 0
    end: int = 0  # reserved positions [num_computed, end); end == num_computed: no step pending
    states: dict[str, Any] = field(default_factory=dict)  # group name -> AttentionState | RecurrentState


class HybridCacheManager(CacheManager):
    """groups: (spec, number of blocks or state slots) per group, in layer-map order; None
    for an attention group that draws from the shared pool of `shared_blocks` blocks; for a
    dual-pool group (V4), (classical blocks, state blocks). All attention groups share one
    block size (one page size; heterogeneous pages are not done)."""

    def __init__(
        self,
        groups: Sequence[tuple[GroupSpec, int | tuple[int, int] | None]],
        descriptor: CacheDescriptor,
        *,
        enable_prefix_caching: bool = True,
        hash_algo: str = "xxh3_128",
        shared_blocks: int | None = None,
        turn_end_checkpoints: bool = False,
    ) -> None:
        if not groups:
            raise ValueError("a hybrid cache needs at least one group")
        shared = None
        if shared_blocks is not None:
            if shared_blocks <= 0:
                raise ValueError(f"shared_blocks must be positive, got {shared_blocks}")
            shared = BlockPool(shared_blocks, enable_caching=enable_prefix_caching, hash_algo=hash_algo)
        built: dict[str, Group] = {}
        for spec, num in groups:
            cls = GROUP_CLASSES.get(type(spec))
            if cls is None:
                raise TypeError(
                    f"unknown group spec {type(spec).__name__}; one of {[c.__name__ for c in GROUP_CLASSES]}"
                )
            if spec.name in built:
                raise ValueError(f"two groups are named {spec.name!r}")
            if isinstance(spec, DualPoolGroupSpec):
                if not (isinstance(num, tuple) and len(num) == 2 and all(isinstance(n, int) and n > 0 for n in num)):
                    raise ValueError(
                        f"dual-pool group {spec.name!r} needs (classical blocks, state blocks), both positive, "
                        f"got {num!r}"
                    )
                built[spec.name] = DualPoolGroup(spec, *num, enable_caching=enable_prefix_caching, hash_algo=hash_algo)
                continue
            if isinstance(num, tuple):
                raise ValueError(f"group {spec.name!r}: a pair of pool sizes is for a dual-pool group only, got {num}")
            if num is None:
                if shared is None or not isinstance(spec, AttentionGroupSpec):
                    raise ValueError(
                        f"group {spec.name!r} has no pool size: None draws from the shared pool, which only "
                        f"attention groups can, and only with shared_blocks"
                    )
                built[spec.name] = AttentionGroup(spec, shared_blocks or 0, pool=shared)
                continue
            if num <= 0:
                raise ValueError(f"group {spec.name!r}: its pool size must be positive, got {num}")
            built[spec.name] = cls(spec, num, enable_caching=enable_prefix_caching, hash_algo=hash_algo)
        if shared is not None and not any(g.pool is shared for g in built.values()):
            raise ValueError("shared_blocks is given but no group draws from it (give an attention group None)")
        attention = [g for g in built.values() if isinstance(g, AttentionGroup)]
        sizes = {g.block_size for g in attention}
        if len(sizes) > 1:
            raise ValueError(f"attention groups must share one block size, got {sorted(sizes)}")
        dual = [g for g in built.values() if isinstance(g, DualPoolGroup)]
        first = next(iter(built.values()))
        block_size = attention[0].block_size if attention else dual[0].span if dual else first.granularity
        super().__init__(first.pool, block_size, descriptor)
        self.groups = built
        self.attention_groups = attention
        self.recurrent_groups = [g for g in built.values() if isinstance(g, RecurrentGroup)]
        self.dual_groups = dual
        # Groups with block tables: the default of `block_ids` and of an admission's blocks
        self._block_groups: list[AttentionGroup | DualPoolGroup] = [*attention, *dual]
        # Each distinct pool once (a dict keeps layer-map order; a BlockPool hashes by identity)
        self._pools: dict[BlockPool, list[Group]] = {}
        for g in built.values():
            self._pools.setdefault(g.pool, []).append(g)
        self._block_pools = list(dict.fromkeys(g.pool for g in self._block_groups))
        self._caching = enable_prefix_caching
        self.turn_end_checkpoints = turn_end_checkpoints
        self.hit_granularity = math.gcd(*(g.granularity for g in built.values()))

    # ---- queries -----------------------------------------------------------------------

    @property
    def enable_prefix_caching(self) -> bool:
        return self._caching

    @property
    def num_blocks(self) -> int:
        """Blocks of every attention pool (a shared pool once) and classical pool."""
        return sum(pool.num_blocks for pool in self._block_pools)

    @property
    def num_free_blocks(self) -> int:
        return sum(pool.num_free for pool in self._block_pools)

    def is_shared(self, group: str) -> bool:
        """Whether the group draws from a pool that other groups draw from too."""
        return len(self._pools[self.groups[group].pool]) > 1

    def _fits(self, needs: dict[str, int | dict[BlockPool, int]]) -> bool:
        """Whether every pool has the free blocks its groups need together (a need: blocks of
        the group's pool, or blocks per pool for a group with two, the dual pool)."""
        total: dict[BlockPool, int] = {}
        for name, need in needs.items():
            for pool, n in (need if isinstance(need, dict) else {self.groups[name].pool: need}).items():
                total[pool] = total.get(pool, 0) + n
        return all(n <= pool.num_free for pool, n in total.items())

    def num_reserved_tokens(self, request_id: str) -> int:
        return self._get(request_id).end

    def block_ids(self, request_id: str, group: str | None = None) -> list[int]:
        """The held blocks of one attention group (default: the first), logical blocks
        [first_block(...), ...), or a dual-pool group's classical blocks (spans [0, ...))."""
        if group is None and not self.attention_groups and self.dual_groups:
            group = self.dual_groups[0].name
        if isinstance(self.groups.get(group or ""), DualPoolGroup):
            return list(self._get(request_id).states[group].block_ids)
        state = self._get(request_id).states[self._attention(group).name]
        return list(state.block_ids)

    def first_block(self, request_id: str, group: str | None = None) -> int:
        """The logical index of the request's first held block in an attention group."""
        return self._get(request_id).states[self._attention(group).name].first

    def state_slot(self, request_id: str, group: str | None = None) -> int:
        """The live state slot of a recurrent group (default: the first) or the state block
        of a dual-pool group (default when there is no recurrent group: the first)."""
        if group is None and not self.recurrent_groups and self.dual_groups:
            group = self.dual_groups[0].name
        if isinstance(self.groups.get(group or ""), DualPoolGroup):
            return self._get(request_id).states[group].state_slot
        return self._get(request_id).states[self._recurrent(group).name].slot

    def state_restore(self, request_id: str, group: str) -> StateRestore:
        """How the runner rebuilds the request's state in a recurrent or dual-pool group before
        its first step: from a checkpoint (recurrent), by replaying tokens on top of the
        cached classical blocks (dual pool), or "none" (a fresh state, or the restore is done)."""
        g = self.groups.get(group)
        state = self._get(request_id).states[group] if g is not None else None
        if isinstance(g, DualPoolGroup):
            assert isinstance(state, DualPoolState)
            if state.replay_start is None:
                return StateRestore(state.state_slot, "none")
            return StateRestore(state.state_slot, "recompute", replay_start=state.replay_start)
        if isinstance(g, RecurrentGroup):
            assert isinstance(state, RecurrentState)
            if state.held_src is None:
                return StateRestore(state.slot, "none")
            return StateRestore(state.slot, "checkpoint", state.held_src)
        raise KeyError(f"no recurrent or dual-pool group {group!r}")

    def checkpoints(self, request_id: str, group: str | None = None) -> list[tuple[int, int]]:
        """(position b, slot) of the reserved step: snapshot the state after b tokens there."""
        return list(self._get(request_id).states[self._recurrent(group).name].pending)

    def restore_source(self, request_id: str, group: str | None = None) -> int | None:
        """The checkpoint slot the request's state is to be restored from before its first
        step (None: a fresh state, or the restore is done)."""
        return self._get(request_id).states[self._recurrent(group).name].held_src

    def take_copies(self) -> dict[str, list[BlockCopy]]:
        """Per attention group, the copies to apply before the next forward, in order."""
        return {g.name: g.take_copies() for g in self.attention_groups}

    def _attention(self, group: str | None) -> AttentionGroup:
        g = self.attention_groups[0] if group is None and self.attention_groups else self.groups.get(group or "")
        if not isinstance(g, AttentionGroup):
            raise KeyError(f"no attention group {group!r}")
        return g

    def _recurrent(self, group: str | None) -> RecurrentGroup:
        g = self.recurrent_groups[0] if group is None and self.recurrent_groups else self.groups.get(group or "")
        if not isinstance(g, RecurrentGroup):
            raise KeyError(f"no recurrent group {group!r}")
        return g

    def usage(self) -> CacheUsage:
        """Attention blocks of every attention group, each physical block counted once, and
        the classical blocks of the dual-pool groups (whole by construction: every slot
        counts as filled); the recurrent groups' slots and the dual pools' state blocks as
        state blocks."""
        held = filled = 0
        bs = self.block_size
        for g in self.dual_groups:
            ids: set[int] = set()
            computed: set[int] = set()
            for req in self._requests.values():
                table = req.states[g.name].block_ids
                ids.update(table)
                computed.update(table[: req.num_computed // g.span])
            held += len(ids)
            filled += len(computed) * bs
        for g in self.attention_groups:
            counts: dict[int, int] = {}
            for req in self._requests.values():
                state = req.states[g.name]
                for i, b in enumerate(state.block_ids):
                    start = (state.first + i) * bs
                    counts[b] = max(counts.get(b, 0), min(bs, max(0, req.num_computed - start)))
            held += len(counts)
            filled += sum(counts.values())
        num_slots = sum(g.pool.num_blocks for g in self.recurrent_groups)
        num_slots += sum(g.state_pool.num_blocks for g in self.dual_groups)
        free_slots = sum(g.pool.num_free for g in self.recurrent_groups)
        free_slots += sum(g.state_pool.num_free for g in self.dual_groups)
        return CacheUsage(self.num_blocks, self.num_free_blocks, held, filled, bs, num_slots, free_slots)

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
                state = req.states[name]
                ids.update(state.block_ids)
                if state.held_src is not None:
                    ids.add(state.held_src)
            held[name] = len(ids)
        return held

    # ---- prefix hits -------------------------------------------------------------------

    def _new_request(
        self,
        request_id: str,
        token_ids: Sequence[int],
        tenant_salt: str,
        mm_items: Sequence[MMItem],
        descriptor: CacheDescriptor | None,
    ) -> _Request:
        if len(token_ids) == 0:
            raise ValueError(f"request {request_id!r} has an empty prompt")
        items = check_mm_items(mm_items, len(token_ids))
        if descriptor is not None and not isinstance(descriptor, CacheDescriptor):
            raise TypeError(f"descriptor must be a CacheDescriptor, got {type(descriptor).__name__}")
        key = self._descriptor_key if descriptor is None else descriptor.key()
        # The group's name in its root: groups on a shared pool never find each other's blocks
        roots = {name: g.pool.root(key + b"|group=" + name.encode(), tenant_salt) for name, g in self.groups.items()}
        return _Request(request_id, list(token_ids), items, roots)

    def _hits(self, req: _Request, bounded: bool = True) -> dict[str, Any]:
        """Each group's hits. bounded: full-attention groups first, and the others look no
        further than the smallest bound so far (a cold prompt then costs a block's hash per
        group, not the whole prompt's: the simulator retries a waiting admission every step)."""
        order = sorted(self.groups.items(), key=lambda item: not _is_full(item[1]))
        limit: int | None = None
        hits = {}
        for name, g in order:
            hits[name] = g.hits(req.roots[name], req.token_ids, req.mm_items, limit)
            if bounded:
                bound = g.upper_bound(hits[name])
                limit = bound if limit is None else min(limit, bound)
        return hits

    def hit_point(self, hits: dict[str, Any], num_tokens: int) -> int:
        """The largest point every group serves, leaving one token to compute: candidates are
        the multiples of the hit granularity and the points off that grid some group offers
        (a recurrent group's turn ends)."""
        g = self.hit_granularity
        top = num_tokens - 1
        if hits:
            top = min(top, *(group.upper_bound(hits[name]) for name, group in self.groups.items()))
        extras = sorted(
            {p for name, group in self.groups.items() if hits for p in group.extra_points(hits[name]) if 0 < p <= top},
            reverse=True,
        )

        def served(p: int) -> bool:
            return all(group.serves(hits[name], p) for name, group in self.groups.items())

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
        req = self._new_request("<lookup>", token_ids, tenant_salt, (), None)
        hits = self._hits(req, bounded=False)
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
        if not self._caching:
            return 0
        req = self._new_request("<lookup>", token_ids, tenant_salt, mm_items, descriptor)
        return self.hit_point(self._hits(req), len(req.token_ids))

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
    ) -> Admission | None:
        self._check_new(request_id, token_ids, max_new_tokens)
        req = self._new_request(request_id, token_ids, tenant_salt, mm_items, descriptor)
        hits = self._hits(req) if self._caching else {}
        point = self.hit_point(hits, len(req.token_ids)) if self._caching else 0
        rest = len(req.token_ids) - point
        n = rest if max_new_tokens is None else min(max_new_tokens, rest)
        end = point + n
        plans: dict[str, Any] = {}
        needs: dict[str, int | dict[BlockPool, int]] = {}
        for name, g in self.groups.items():
            need: int | dict[BlockPool, int]
            if isinstance(g, AttentionGroup):
                plan, need = g.plan_admit(hits.get(name, AttentionHits([], [])), point, end)
            elif isinstance(g, DualPoolGroup):
                plan, need = g.plan_admit(hits.get(name), point, end)
            else:
                plan, need = g.plan_admit(hits.get(name), req.roots[name], req.token_ids, req.mm_items, point)
            plans[name], needs[name] = plan, need
        if not self._fits(needs):
            return None
        # Checked in every group; mutate: every group's hit held first, then the allocations
        for name, g in self.groups.items():
            g.claim(plans[name])
        for name, g in self.groups.items():
            req.states[name] = g.apply_admit(plans[name], req.roots[name])
        req.num_computed = req.end = point
        self._requests[request_id] = req
        self._count_admission(request_id, len(req.token_ids), point)
        if n:
            self._apply_reserve(req, end)
        # The first recurrent group's restore, else the first dual pool's (`state_restore`
        # names each group's); the first block group's table
        stateful = [*self.recurrent_groups, *self.dual_groups]
        restore = self.state_restore(request_id, stateful[0].name) if stateful else None
        block_ids = tuple(self.block_ids(request_id)) if self._block_groups else ()
        return Admission(point, n, block_ids, restore)

    def _check_reserve(self, req: _Request, num_new_tokens: int) -> None:
        if req.end != req.num_computed:
            raise ValueError(f"request {req.request_id!r} has an uncommitted step; commit it first")
        if num_new_tokens < 0:
            raise ValueError(f"request {req.request_id!r}: num_new_tokens must be >= 0, got {num_new_tokens}")
        if req.num_computed + num_new_tokens > len(req.token_ids):
            raise ValueError(
                f"request {req.request_id!r}: reserving up to position {req.num_computed + num_new_tokens}, but only "
                f"{len(req.token_ids)} token ids are known (append_token_ids first)"
            )

    def _needs(self, req: _Request, end: int) -> dict[str, int]:
        return {g.name: g.blocks_needed(req.states[g.name], req.num_computed, end) for g in self._block_groups}

    def _apply_reserve(self, req: _Request, end: int) -> Reservation:
        """The reservation names the first block group's new blocks and copies."""
        new_ids: tuple[int, ...] = ()
        copies: tuple[BlockCopy, ...] = ()
        for i, g in enumerate(self._block_groups):
            if isinstance(g, DualPoolGroup):
                new, cps = g.apply_reserve(req.states[g.name], req.num_computed, end), []
            else:
                new, cps = g.apply_reserve(req.states[g.name], req.num_computed, end)
            if i == 0:
                new_ids, copies = tuple(new), tuple(cps)
        checkpoints: tuple[tuple[int, int], ...] = ()
        for i, rg in enumerate(self.recurrent_groups):
            st = req.states[rg.name]
            wanted = rg.plan_checkpoints(st, req.token_ids, req.mm_items, req.num_computed, end)
            taken = rg.take_checkpoint_slots(st, wanted)
            if i == 0:
                checkpoints = tuple(taken)
        start = req.num_computed
        req.end = end
        return Reservation(start, end - start, new_ids, copies, checkpoints)

    def reserve(self, request_id: str, num_new_tokens: int) -> Reservation | None:
        req = self._get(request_id)
        self._check_reserve(req, num_new_tokens)
        end = req.num_computed + num_new_tokens
        if not self._fits(self._needs(req, end)):
            return None
        return self._apply_reserve(req, end)

    def reserve_step(self, request_ids: Sequence[str], num_new_tokens: Sequence[int]) -> bool:
        reqs = self._step_requests(request_ids, num_new_tokens)
        total = dict.fromkeys(self.groups, 0)
        for req, n in zip(reqs, num_new_tokens, strict=True):
            self._check_reserve(req, n)
            for name, need in self._needs(req, req.num_computed + n).items():
                total[name] += need
        if not self._fits(total):
            return False
        for req, n in zip(reqs, num_new_tokens, strict=True):
            self._apply_reserve(req, req.num_computed + n)
        return True

    def commit(self, request_id: str, num_tokens: int) -> None:
        self.commit_step((request_id,), (num_tokens,), (None,))

    def commit_step(
        self, request_ids: Sequence[str], num_tokens: Sequence[int], next_token_ids: Sequence[int | None]
    ) -> None:
        reqs = self._step_requests(request_ids, num_tokens, next_token_ids)
        for req, n in zip(reqs, num_tokens, strict=True):
            if n != req.end - req.num_computed:
                raise ValueError(
                    f"request {req.request_id!r}: commit of {n} tokens, but the step reserved "
                    f"{req.end - req.num_computed} (a recurrent state advances by whole steps)"
                )
        for req, next_token_id in zip(reqs, next_token_ids, strict=True):
            req.num_computed = req.end
            for name, g in self.groups.items():
                g.commit(req.states[name], req.token_ids, req.num_computed, req.mm_items)
            if next_token_id is not None:
                req.token_ids.append(next_token_id)

    def fork(self, parent_id: str, child_id: str) -> bool:
        """A child sharing the parent's blocks, with its own live state in every recurrent
        group and its own state block in every dual-pool group (the runner copies the
        parent's into them). False, nothing changed, when one of them has no free slot."""
        parent = self._get(parent_id)
        if child_id in self._requests:
            raise ValueError(f"request {child_id!r} already exists")
        if parent.end != parent.num_computed:
            raise ValueError(f"request {parent_id!r} has an uncommitted step; fork after commit")
        if not all(g.can_fork() for g in [*self.recurrent_groups, *self.dual_groups]):
            return False
        child = _Request(child_id, parent.token_ids[: parent.num_computed], parent.mm_items, dict(parent.roots))
        child.num_computed = child.end = parent.num_computed
        for name, g in self.groups.items():
            child.states[name] = g.fork(parent.states[name])
        self._requests[child_id] = child
        return True

    def mark_turn_end(self, request_id: str) -> dict[str, int]:
        """A turn ends here: per recurrent group, a slot to copy the live state into now (the
        state after the computed tokens), filed as a checkpoint that a follow-up turn extending
        this conversation hits, on the C grid or not. Groups with nothing to take (a
        checkpoint there already, no free slot) are left out. No step may be pending."""
        req = self._get(request_id)
        if req.end != req.num_computed:
            raise ValueError(f"request {request_id!r} has an uncommitted step; mark the turn end after commit")
        slots = {}
        for g in self.recurrent_groups:
            slot = g.mark_turn_end(req.states[g.name], req.token_ids, req.mm_items, req.num_computed)
            if slot is not None:
                slots[g.name] = slot
        return slots

    def release(self, request_id: str, reason: ReleaseReason = "finish") -> bool:
        """As the contract says; a finish (no step pending) also keeps each recurrent group's
        live state as the turn-end checkpoint of the request's computed tokens (the live slot
        holds that state: nothing to copy), when `turn_end_checkpoints` is on."""
        req = self._requests.get(request_id)
        if reason == "finish" and self.turn_end_checkpoints and req is not None and req.end == req.num_computed:
            for g in self.recurrent_groups:
                g.keep_turn_end(req.states[g.name], req.token_ids, req.mm_items, req.num_computed)
        return super().release(request_id, reason)

    def _release(self, request_id: str) -> bool:
        req = self._requests.pop(request_id, None)
        if req is None:
            return False
        for name, g in self.groups.items():
            g.release(req.states[name])
        return True

    # ---- invariants --------------------------------------------------------------------

    def check_integrity(self) -> None:
        holders = {pool: [0] * pool.num_blocks for pool in self._pools}
        for rid, req in self._requests.items():
            if not 0 <= req.num_computed <= req.end <= len(req.token_ids):
                raise AssertionError(
                    f"invariant 5: request {rid!r} computed {req.num_computed}, reserved to {req.end}, "
                    f"knows {len(req.token_ids)} tokens"
                )
            if set(req.states) != set(self.groups):
                raise AssertionError(f"request {rid!r} has state in groups {sorted(req.states)}")
            for name, g in self.groups.items():
                g.check_state(rid, req.states[name], req.token_ids, req.num_computed, req.end, holders[g.pool])
        for pool, groups in self._pools.items():
            groups[0].check_holders(holders[pool])
            if len(groups) > 1:
                self._check_owners(groups)
        for g in self.dual_groups:
            g.check_state_blocks({rid: req.states[g.name] for rid, req in self._requests.items()})

    def _check_owners(self, groups: list[Group]) -> None:
        """On a shared pool a block is held by the requests of one group only."""
        owner: dict[int, str] = {}
        for g in groups:
            for rid, req in self._requests.items():
                state = req.states[g.name]
                for b in [*state.block_ids, *([state.held_src] if state.held_src is not None else [])]:
                    if owner.setdefault(b, g.name) != g.name:
                        raise AssertionError(
                            f"shared pool: block {b} is held by groups {owner[b]!r} and {g.name!r} ({rid!r})"
                        )
