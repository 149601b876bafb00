"""The DeepSeek-V4 dual-pool cache manager: Classical block ids + State block ids. No torch.

Classical pool: blocks of `span` tokens (a multiple of lcm(m, m')) from the core BlockPool,
with its refcounts, LRU free queue and prefix index. A request of history length
L = span * q + r holds exactly q classical blocks; a block joins the request (and is
published for prefix caching) only once its whole span is computed, so an incomplete block
never exists in the pool. The prefix chain is the pool's (root: descriptor + tenant salt).

State pool: a fixed number of per-request state blocks (SWA ring + compressor tails + the
unfinished span's entries), taken at admission and returned at release. No free state
block -> `admit` returns None and changes nothing (the request waits). Optional state
checkpoints snapshot a request's state at block boundaries, keyed by the boundary block's
prefix block, held in one of two ways:
  slots   (`num_checkpoints` > 0): that many extra state slots, LRU among themselves (the
          engine: its state tensors have that many rows more);
  pooled  (`checkpoint_blocks` > 0): each checkpoint occupies that many classical blocks
          (a state block's bytes in classical blocks), registered in the prefix index
          under the boundary block and freed at once as cached blocks, so checkpoints and
          cached classical blocks share the pool's free memory and its one LRU eviction
          order (as vLLM v1 keeps Mamba states in its block pool): as many as free memory
          holds, none taken from a running request. A snapshot that finds too few free
          blocks is skipped; an allocation that evicts one of its blocks drops it.

Prefix reuse restores the state at span * q exactly (DEEPSEEK_V4.md section 6), by one of:
  "checkpoint": the hit is cut to the longest prefix whose boundary has a checkpoint; the
                model copies the checkpoint slot into the request's state block;
  "recompute":  the model replays tokens [max(0, P - n_win * num_layers), P) on top of the
                cached entries (nothing written to the Classical pool);
  "auto":       chosen per admission by cost (`choose_restore`, priced by a `RestoreCost`
                the runner gives): the checkpoint held at the hit's end when copying it is
                cheaper than the replay, else the replay over the whole hit, unless cutting
                the hit back to the last checkpoint held within it (its tokens computed
                again, as prompt) costs less than that replay. Checkpoints are taken as with
                "checkpoint".

A step is explicit: `reserve` records the pending step (positions, fresh blocks for the
spans it completes, checkpoint slots to fill), the model runs it, `commit` (of exactly the
reserved tokens: the state has advanced by them) publishes it, `unreserve` undoes it,
restoring any checkpoint it pushed out.

Per request:  [0, num_blocks * span) classical blocks | [.., num_computed) state only.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal, NamedTuple, Protocol

from kvpool.cache.base import CacheManager, check_mm_items, mm_extra_key
from kvpool.cache.types import (
    Admission,
    CacheDescriptor,
    CacheUsage,
    MMItem,
    Reservation,
    StateRestore,
)
from kvpool.pool import BlockPool, PrefixBlock
from kvpool.pool.hashing import TOKEN_BYTES, token_bytes
from kvpool.spec.dsv4 import DSV4Spec

RestoreMethod = Literal["checkpoint", "recompute", "auto"]
RESTORE_METHODS: tuple[str, ...] = ("checkpoint", "recompute", "auto")


class RestoreCost(Protocol):
    """What a V4 state restore costs, in any one unit (seconds, or tokens), as the runner
    prices it: the simulator by its cost model, the engine by the rates it has measured."""

    def checkpoint_cost(self) -> float:
        """Copying one checkpoint into a request's state block."""
        ...

    def compute_cost(self, num_tokens: int, context_len: int) -> float:
        """Computing (replaying) the tokens [context_len - num_tokens, context_len)."""
        ...


class TokenCost:
    """The default `RestoreCost`: a checkpoint copy is free, computing costs its token count."""

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


@dataclass
class _Checkpoint:
    slot: int  # pooled: the first of its blocks
    block: PrefixBlock  # the boundary block whose prefix the snapshot is the state of
    last_used: int  # LRU stamp (slots; pooled: the pool's LRU order)
    parts: tuple[PrefixBlock, ...] = ()  # pooled: the registered contents of its blocks


def _state_part(block: PrefixBlock) -> bool:
    """Whether a prefix block is part of a pooled checkpoint (not a span of tokens)."""
    return not block.token_bytes and block.extra.startswith(_STATE_EXTRA)


_STATE_EXTRA = b"v4-state:"  # a pooled checkpoint's part i: chained after its boundary block


@dataclass
class _Pending:
    """A reserved, uncommitted step, with what undoing it needs."""

    reservation: Reservation
    chain: list[PrefixBlock]  # prefix blocks of the spans the step completes (caching on)
    evicted: list[tuple[bytes, _Checkpoint]]  # checkpoints pushed out for its slots (undo restores them)
    fresh_slots: list[int]  # checkpoint slots it took from the free list
    evicted_blocks: list[tuple[int, PrefixBlock]]  # cached blocks its allocation evicted (undo restores them)
    snapshot_ids: list[list[int]] = field(default_factory=list)  # pooled: each checkpoint's blocks


# The pending step of a decode that completes no span (most decodes): one token, no block,
# no chain, no checkpoint. Everything else it would record follows from the request
# (its start is num_computed, which nothing moves before the commit), so one shared marker
# stands for all of them and `pending_reservation` spells it out on demand.
_ONE_TOKEN = _Pending(Reservation(-1, 1, (), (), ()), [], [], [], [])


@dataclass(slots=True)
class _Request:
    request_id: str
    token_ids: list[int]
    root: PrefixBlock
    state_slot: int
    mm_items: tuple[MMItem, ...]
    num_computed: int = 0
    block_ids: list[int] = field(default_factory=list)
    chain: list[PrefixBlock] = field(default_factory=list)
    pending: _Pending | None = None


class DSV4CacheManager(CacheManager):
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
    ) -> None:
        """restore: how a prefix hit rebuilds the state (module docstring); "auto" prices the
        options by `restore_cost` (None: `TokenCost`) at each admission. Checkpoints in
        `num_checkpoints` slots of their own, or pooled: `checkpoint_blocks` classical
        blocks each (module docstring); not both."""
        if num_state_blocks <= 0:
            raise ValueError(f"num_state_blocks must be positive, got {num_state_blocks}")
        if restore not in RESTORE_METHODS:
            raise ValueError(f"restore must be one of {RESTORE_METHODS}, got {restore!r}")
        if num_checkpoints < 0:
            raise ValueError(f"num_checkpoints must be >= 0, got {num_checkpoints}")
        if checkpoint_blocks < 0:
            raise ValueError(f"checkpoint_blocks must be >= 0, got {checkpoint_blocks}")
        if checkpoint_blocks and num_checkpoints:
            raise ValueError("checkpoints in slots (num_checkpoints) or pooled (checkpoint_blocks), not both")
        if restore == "checkpoint" and enable_prefix_caching and not (num_checkpoints or checkpoint_blocks):
            raise ValueError("restore='checkpoint' needs num_checkpoints > 0 or checkpoint_blocks > 0")
        pool = BlockPool(num_classical_blocks, enable_caching=enable_prefix_caching, hash_algo=hash_algo)
        super().__init__(pool, spec.span, descriptor)
        self.spec = spec
        self.span = spec.span
        self.restore = restore
        self.restore_cost: RestoreCost = restore_cost if restore_cost is not None else TokenCost()
        # snapshots are taken at block boundaries (checkpoint, auto), when there are slots
        self.checkpoint_blocks = checkpoint_blocks
        self.checkpointing = (
            restore != "recompute" and enable_prefix_caching and (num_checkpoints or checkpoint_blocks) > 0
        )
        self._evicted: list[tuple[int, PrefixBlock]] | None = None  # record_evictions
        self.num_state_blocks = num_state_blocks
        self.num_checkpoints = num_checkpoints
        self._free_states: deque[int] = deque(range(num_state_blocks))
        # Checkpoint slots follow the state slots: [num_state_blocks, + num_checkpoints).
        self._free_checkpoints: deque[int] = deque(range(num_state_blocks, num_state_blocks + num_checkpoints))
        self._checkpoints: dict[bytes, _Checkpoint] = {}  # boundary block hash -> findable checkpoint
        self._clock = 0

    # ----- queries ------------------------------------------------------------------

    @property
    def num_free_state_blocks(self) -> int:
        return len(self._free_states)

    def state_slot(self, request_id: str) -> int:
        return self._get(request_id).state_slot

    def pending_reservation(self, request_id: str) -> Reservation | None:
        """The reserved, not yet committed step of a request, if any."""
        req = self._get(request_id)
        pending = req.pending
        if pending is _ONE_TOKEN:
            return Reservation(req.num_computed, 1, (), (), ())
        return None if pending is None else pending.reservation

    def prefix_blocks(self, request_id: str) -> list[PrefixBlock]:
        """The prefix blocks of the request's complete spans, committed then reserved, in
        order (empty with prefix caching off): a runner names tier entries by them."""
        req = self._get(request_id)
        return req.chain + (req.pending.chain if req.pending is not None else [])

    def num_new_blocks(self, request_id: str, num_new_tokens: int) -> int:
        """Classical blocks a step of `num_new_tokens` more tokens would take."""
        req = self._get(request_id)
        return (req.num_computed + num_new_tokens) // self.span - req.num_computed // self.span

    def usage(self) -> CacheUsage:
        held = {b for req in self._requests.values() for b in req.block_ids}
        # A classical block is whole by construction: every slot of a held block is useful.
        return CacheUsage(
            self.pool.num_blocks,
            self.pool.num_free,
            len(held),
            len(held) * self.span,
            self.span,
            self.num_state_blocks,
            len(self._free_states),
        )

    # ----- admission ------------------------------------------------------------------

    def _span_bytes(self, req: _Request, k: int) -> bytes:
        return token_bytes(req.token_ids[k * self.span : (k + 1) * self.span])

    def _extra(self, req: _Request, k: int) -> bytes:
        return mm_extra_key(req.mm_items, self.span, k) if req.mm_items else b""

    def _match(self, req: _Request, count_collisions: bool) -> tuple[list[int], list[PrefixBlock], str]:
        """The hit an admission keeps (its blocks and prefix blocks) and how it restores the
        state: "none" (no hit), "checkpoint" or "recompute"."""
        if not self.enable_prefix_caching:
            return [], [], "none"
        max_blocks = (len(req.token_ids) - 1) // self.span  # at least one token left to compute
        extras = [self._extra(req, k) for k in range(max_blocks)] if req.mm_items else None
        hit = self.pool.match(
            req.root,
            token_bytes(req.token_ids[: max_blocks * self.span]),
            self.span * TOKEN_BYTES,
            max_blocks,
            extras,
            count_collisions=count_collisions,
        )
        block_ids, chain = hit.block_ids, hit.chain
        if not block_ids:
            return [], [], "none"
        if self.restore == "recompute":
            return block_ids, chain, "recompute"
        # the last boundary within the hit whose state is checkpointed
        k = len(block_ids)
        while k and self._findable_checkpoint(chain[k - 1]) is None:
            k -= 1
        if self.restore == "checkpoint":  # the hit is usable only up to there
            return block_ids[:k], chain[:k], "checkpoint" if k else "none"
        span = self.span
        choice = choose_restore(
            len(block_ids) * span, k * span, self.spec.window * self.spec.num_layers, self.restore_cost
        )
        k = choice.num_cached_tokens // span
        return block_ids[:k], chain[:k], choice.method

    # ----- a tier below the classical pool (kvpool.tiers) -------------------------------

    def record_evictions(self) -> None:
        """From now on, every cached classical block the allocator evicts is recorded for
        the runner to save to a lower tier before anything overwrites it (`take_evicted`)."""
        if self._evicted is None:
            self._evicted = []

    def take_evicted(self) -> list[tuple[int, PrefixBlock]]:
        """Cached blocks evicted since the last call, (block id, the content it held)."""
        if not self._evicted:
            return []
        evicted, self._evicted = self._evicted, []
        return evicted

    def prefetch_candidates(
        self, token_ids: Sequence[int], *, tenant_salt: str = ""
    ) -> tuple[list[int], list[PrefixBlock]]:
        """(the device hit's blocks, the prompt's full spans after it as unregistered prefix
        blocks, leaving >= 1 token to compute): what a lower tier may hold and `install`
        can bring in."""
        if not self.enable_prefix_caching or len(token_ids) == 0:
            return [], []
        req = self._new_request("<prefetch>", token_ids, tenant_salt, (), None, -1)
        max_blocks = (len(req.token_ids) - 1) // self.span
        hit = self.pool.match(
            req.root,
            token_bytes(req.token_ids[: max_blocks * self.span]),
            self.span * TOKEN_BYTES,
            max_blocks,
            None,
            count_collisions=False,
        )
        parent = hit.chain[-1] if hit.chain else req.root
        out = []
        for k in range(len(hit.block_ids), max_blocks):
            parent = self.pool.chain(parent, self._span_bytes(req, k), b"")
            out.append(parent)
        return hit.block_ids, out

    def install(self, num_blocks: int, hold: Sequence[int] = ()) -> list[int] | None:
        """Fresh classical blocks for lower-tier content (the runner writes them, then
        `publish_installed`); None, nothing taken, when that many are not free. `hold`: the
        device hit the content continues, kept out of this allocation's reach."""
        self.pool.incref(hold)
        evicted: list[tuple[int, PrefixBlock]] = []
        ids = self.pool.allocate(num_blocks, evicted)
        self.pool.decref(reversed(hold))
        if ids is not None:
            self._note_evicted(evicted, [])
        return ids

    def _note_evicted(self, evicted: list[tuple[int, PrefixBlock]], dropped: list[tuple[bytes, _Checkpoint]]) -> None:
        """Cached blocks an allocation just evicted: classical ones go to the tier record
        (`record_evictions`); a pooled checkpoint that lost its last copy of a part is
        dropped (into `dropped`, for an undo to put back)."""
        if self.checkpoint_blocks:
            for _, block in evicted:
                if _state_part(block) and not block.block_ids:
                    assert block.parent is not None
                    ckpt = self._checkpoints.get(block.parent.block_hash)
                    if ckpt is not None and block in ckpt.parts:
                        dropped.append((block.parent.block_hash, self._checkpoints.pop(block.parent.block_hash)))
        if self._evicted is not None:
            self._evicted.extend(e for e in evicted if not _state_part(e[1]))

    def publish_installed(self, block_ids: Sequence[int], blocks: Sequence[PrefixBlock], num_loaded: int) -> None:
        """The first `num_loaded` installed blocks hold their content (copied and checked):
        they are published, in order, as cached blocks nobody holds (an admission hits them
        like any cached block); every installed block is then freed, the tail first."""
        parent = None
        for block_id, block in list(zip(block_ids, blocks, strict=True))[:num_loaded]:
            if parent is not None and block.parent is not parent:
                block = self.pool.chain(parent, block.token_bytes, block.extra)
            parent = self.pool.register(block_id, block) or block
        self.pool.decref(reversed(block_ids))

    def _findable_checkpoint(self, block: PrefixBlock) -> _Checkpoint | None:
        ckpt = self._checkpoints.get(block.block_hash)
        return ckpt if ckpt is not None and ckpt.block is block else None

    def _touch(self, ckpt: _Checkpoint) -> None:
        """A restore used `ckpt`: most recently used now (pooled: its blocks go to the end of
        the pool's LRU queue)."""
        if ckpt.parts:
            ids = [part.block_ids[0] for part in ckpt.parts]
            self.pool.incref(ids)
            self.pool.decref(ids)
            return
        self._clock += 1
        ckpt.last_used = self._clock

    def _new_request(
        self,
        request_id: str,
        token_ids: Sequence[int],
        tenant_salt: str,
        mm_items: Sequence[MMItem],
        descriptor: CacheDescriptor | None,
        state_slot: int,
    ) -> _Request:
        items = check_mm_items(mm_items, len(token_ids))
        return _Request(request_id, list(token_ids), self._root(tenant_salt, descriptor), state_slot, items)

    def lookup_prefix(
        self,
        token_ids: Sequence[int],
        *,
        tenant_salt: str = "",
        mm_items: Sequence[MMItem] = (),
        descriptor: CacheDescriptor | None = None,
    ) -> int:
        if len(token_ids) == 0:
            raise ValueError("lookup of an empty prompt")
        req = self._new_request("<lookup>", token_ids, tenant_salt, mm_items, descriptor, -1)
        return len(self._match(req, count_collisions=False)[0]) * self.span

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
        """Take a state block, the longest usable cached prefix and the first step's blocks;
        None (nothing changed) when no state block or not enough classical blocks are free."""
        self._check_new(request_id, token_ids, max_new_tokens)
        req = self._new_request(request_id, token_ids, tenant_salt, mm_items, descriptor, -1)
        if not self._free_states:
            return None
        hits, chain, method = self._match(req, count_collisions=True)
        num_cached = len(hits) * self.span
        rest = len(req.token_ids) - num_cached
        n = rest if max_new_tokens is None else min(max_new_tokens, rest)
        num_revived = sum(1 for b in hits if self.pool.refcount(b) == 0)
        if (num_cached + n) // self.span - len(hits) > self.pool.num_free - num_revived:
            return None
        # Checked; mutate.
        self.pool.incref(hits)
        req.state_slot = self._free_states.popleft()
        req.block_ids, req.chain, req.num_computed = hits, chain, num_cached
        self._requests[request_id] = req
        restore: StateRestore
        if method == "none":
            restore = StateRestore(req.state_slot, "none")
        elif method == "checkpoint":
            ckpt = self._findable_checkpoint(chain[-1])
            assert ckpt is not None
            self._touch(ckpt)
            restore = StateRestore(req.state_slot, "checkpoint", ckpt.slot)
        else:
            replay_start = max(0, num_cached - self.spec.window * self.spec.num_layers)
            restore = StateRestore(req.state_slot, "recompute", replay_start=replay_start)
        if n:
            reservation = self.reserve(request_id, n)
            assert reservation is not None, "the classical blocks were checked"
            block_ids = tuple(hits) + reservation.new_block_ids
        else:
            block_ids = tuple(hits)
        self._count_admission(request_id, len(req.token_ids), num_cached)
        return Admission(num_cached, n, block_ids, restore)

    # ----- steps ------------------------------------------------------------------------

    def _check_reserve(self, req: _Request, num_new_tokens: int) -> None:
        if req.pending is not None:
            raise ValueError(f"request {req.request_id!r} already has an uncommitted reservation")
        if num_new_tokens <= 0:
            raise ValueError(f"request {req.request_id!r}: a V4 step computes at least one token, got {num_new_tokens}")
        start = req.num_computed
        if start + num_new_tokens > len(req.token_ids):
            raise ValueError(
                f"request {req.request_id!r}: cannot compute {num_new_tokens} tokens from {start}, "
                f"it has {len(req.token_ids)} tokens (append_token_ids first)"
            )

    def reserve(self, request_id: str, num_new_tokens: int) -> Reservation | None:
        """Blocks for the spans that complete within the next `num_new_tokens` tokens, and
        checkpoint slots for their boundaries. None (no free classical block): no change."""
        req = self._get(request_id)
        self._check_reserve(req, num_new_tokens)
        start = req.num_computed
        num_new = (start + num_new_tokens) // self.span - start // self.span
        if num_new > self.pool.num_free:
            return None
        return self._apply_reserve(req, num_new_tokens, num_new)

    def reserve_step(self, request_ids: Sequence[str], num_new_tokens: Sequence[int]) -> bool:
        reqs = self._step_requests(request_ids, num_new_tokens)
        span = self.span
        if num_new_tokens.count(1) == len(reqs):  # all decodes: most complete no span
            growing = []
            for req in reqs:
                if req.pending is not None or req.num_computed >= len(req.token_ids):
                    self._check_reserve(req, 1)  # raises, naming the problem
                if (req.num_computed + 1) % span:
                    continue
                growing.append(req)
            if len(growing) > self.pool.num_free:
                return False
            for req in reqs:
                req.pending = _ONE_TOKEN
            for k, req in enumerate(growing, 1):
                req.pending = None
                self._apply_reserve(req, 1, 1, keep=len(growing) - k)
            return True
        needs = []
        for req, n in zip(reqs, num_new_tokens, strict=True):
            self._check_reserve(req, n)
            needs.append((req.num_computed + n) // self.span - req.num_computed // self.span)
        num_needed = sum(needs)
        if num_needed > self.pool.num_free:
            return False
        for req, n, need in zip(reqs, num_new_tokens, needs, strict=True):
            num_needed -= need
            self._apply_reserve(req, n, need, keep=num_needed)
        return True

    def _apply_reserve(self, req: _Request, num_new_tokens: int, num_new: int, keep: int = 0) -> Reservation:
        """Reserve a checked step; `keep`: free blocks the rest of its batch needs (pooled
        snapshots leave them alone)."""
        if num_new == 0:  # the step completes no span (most decodes): no block, no chain, no checkpoint
            if num_new_tokens == 1:
                req.pending = _ONE_TOKEN
                return Reservation(req.num_computed, 1, (), (), ())
            reservation = Reservation(req.num_computed, num_new_tokens, (), (), ())
            req.pending = _Pending(reservation, [], [], [], [])
            return reservation
        evicted_blocks: list[tuple[int, PrefixBlock]] = []
        new_ids = self.pool.allocate(num_new, evicted_blocks)
        assert new_ids is not None, "the caller checked the free count"
        chain: list[PrefixBlock] = []
        if self.enable_prefix_caching:
            parent = req.chain[-1] if req.chain else req.root
            for k in range(len(req.block_ids), len(req.block_ids) + num_new):
                parent = self.pool.chain(parent, self._span_bytes(req, k), self._extra(req, k))
                chain.append(parent)
        checkpoints: list[tuple[int, int]] = []
        evicted: list[tuple[bytes, _Checkpoint]] = []
        fresh: list[int] = []
        snapshot_ids: list[list[int]] = []
        if self.checkpointing:
            first = len(req.block_ids) + 1
            wanted = [(k + first) * self.span for k, b in enumerate(chain) if not self._has_checkpoint(b.block_hash)]
        if self.checkpointing and self.checkpoint_blocks:
            # Pooled: the latest boundaries whose blocks are free now (a snapshot never makes
            # a step wait); taking them may evict cached blocks, checkpoints included.
            c = self.checkpoint_blocks
            for position in wanted[max(0, len(wanted) - (self.pool.num_free - keep) // c) :]:
                ids = self.pool.allocate(c, evicted_blocks)
                assert ids is not None
                snapshot_ids.append(ids)
                checkpoints.append((position, ids[0]))
        elif self.checkpointing:
            # A long prefill may cross more boundaries than there are slots: keep the latest.
            available = len(self._free_checkpoints) + len(self._checkpoints)
            for position in wanted[max(0, len(wanted) - available) :]:
                if self._free_checkpoints:
                    slot = self._free_checkpoints.popleft()
                    fresh.append(slot)
                else:  # push out the least recently used checkpoint (undo puts it back)
                    block_hash = min(self._checkpoints, key=lambda h: self._checkpoints[h].last_used)
                    ckpt = self._checkpoints.pop(block_hash)
                    evicted.append((block_hash, ckpt))
                    slot = ckpt.slot
                checkpoints.append((position, slot))
        self._note_evicted(evicted_blocks, evicted)
        reservation = Reservation(req.num_computed, num_new_tokens, tuple(new_ids), (), tuple(checkpoints))
        req.pending = _Pending(reservation, chain, evicted, fresh, evicted_blocks, snapshot_ids)
        return reservation

    def _has_checkpoint(self, block_hash: bytes) -> bool:
        """A findable checkpoint is filed under this hash: its boundary block is the content
        the index holds (a checkpoint of an evicted prefix is stale: it is replaced)."""
        ckpt = self._checkpoints.get(block_hash)
        return ckpt is not None and self.pool.is_published(ckpt.block)

    def unreserve(self, request_id: str) -> None:
        """Undo an uncommitted reservation whose step has not run (e.g. another request of
        the batch did not fit), exactly: its blocks go back where they were (cached blocks
        its allocation evicted are findable again), its checkpoint slots go back, and every
        checkpoint it pushed out is findable again with its LRU place, unless the same
        prefix has been checkpointed since (then the slot is free) or, pooled, another
        allocation has since taken one of its other blocks."""
        req = self._get(request_id)
        pending = req.pending
        if pending is None:
            return
        allocated = [*pending.reservation.new_block_ids, *(b for ids in pending.snapshot_ids for b in ids)]
        self.pool.unallocate(allocated, pending.evicted_blocks)
        self._free_checkpoints.extendleft(reversed(pending.fresh_slots))
        for block_hash, ckpt in pending.evicted:
            if ckpt.parts:  # pooled: back unless a later allocation took another of its blocks
                if block_hash not in self._checkpoints and all(self.pool.is_published(p) for p in ckpt.parts):
                    self._checkpoints[block_hash] = ckpt
            elif block_hash in self._checkpoints:
                self._free_checkpoints.append(ckpt.slot)
            else:
                self._checkpoints[block_hash] = ckpt
        if self._evicted is not None and pending.evicted_blocks:  # not evicted after all: the tier needs them not
            undone = {block_id for block_id, _ in pending.evicted_blocks}
            self._evicted = [e for e in self._evicted if e[0] not in undone]
        req.pending = None

    def _abandon(self, req: _Request) -> None:
        """Drop an uncommitted step that may have run (a release): its blocks and all the
        checkpoint slots it took are free; a checkpoint it pushed out is not restored, since
        the step's forward may have written over its slot."""
        pending = req.pending
        if pending is None:
            return
        self.pool.decref(reversed(pending.reservation.new_block_ids))
        if pending.snapshot_ids:
            self.pool.decref(b for ids in reversed(pending.snapshot_ids) for b in ids)
        else:
            self._free_checkpoints.extend(slot for _, slot in pending.reservation.checkpoints)
        req.pending = None

    def commit(self, request_id: str, num_tokens: int) -> None:
        """The reserved step's `num_tokens` tokens are computed (exactly the reserved ones:
        the state has advanced by them). New blocks join the request and are published for
        prefix caching, checkpoints become findable."""
        req = self._get(request_id)
        self._check_commit(req, num_tokens)
        self._apply_commit(req)

    def _check_commit(self, req: _Request, num_tokens: int) -> None:
        if req.pending is None:
            raise ValueError(f"request {req.request_id!r} has no reservation to commit")
        if num_tokens != req.pending.reservation.num_tokens:
            raise ValueError(
                f"request {req.request_id!r}: commit of {num_tokens} tokens, but the step reserved "
                f"{req.pending.reservation.num_tokens} (a V4 state advances by whole steps)"
            )

    def _apply_commit(self, req: _Request) -> None:
        pending = req.pending
        assert pending is not None
        res = pending.reservation
        parent = req.chain[-1] if req.chain else req.root
        for k, block in enumerate(pending.chain):  # empty when caching is off
            if block.parent is not parent:
                # The previous span was published as a copy that another request computed
                # first: hang this one under that copy (same content, so the same hash).
                block = self.pool.chain(parent, block.token_bytes, block.extra)
            parent = pending.chain[k] = self.pool.register(res.new_block_ids[k], block) or block
        req.block_ids.extend(res.new_block_ids)
        req.chain.extend(pending.chain)
        if pending.snapshot_ids:
            self._commit_pooled(req, res.checkpoints, pending.snapshot_ids)
        for position, slot in () if pending.snapshot_ids else res.checkpoints:
            block = req.chain[position // self.span - 1]
            if not self.pool.is_published(block) or self._has_checkpoint(block.block_hash):
                # not findable (a collision), or another request checkpointed the prefix first
                self._free_checkpoints.append(slot)
                continue
            stale = self._checkpoints.get(block.block_hash)
            if stale is not None:  # a checkpoint of an evicted copy of the prefix gives way
                self._free_checkpoints.append(stale.slot)
            self._clock += 1
            self._checkpoints[block.block_hash] = _Checkpoint(slot, block, self._clock)
        req.num_computed += res.num_tokens
        req.pending = None

    def _commit_pooled(
        self, req: _Request, checkpoints: Sequence[tuple[int, int]], snapshot_ids: list[list[int]]
    ) -> None:
        """Pooled checkpoints the step wrote: each one's blocks registered under its boundary
        block (part i: `_STATE_EXTRA` i), then freed as cached blocks (the newest of the
        LRU queue); blocks that cannot be published (the boundary is not findable, or
        another request checkpointed it first) are freed unhashed."""
        for (position, _), ids in zip(checkpoints, snapshot_ids, strict=True):
            block = req.chain[position // self.span - 1]
            if self.pool.is_published(block) and not self._has_checkpoint(block.block_hash):
                parts = []
                for i, block_id in enumerate(ids):
                    part = self.pool.register(block_id, self.pool.chain(block, b"", _STATE_EXTRA + str(i).encode()))
                    if part is None:  # a collision: this checkpoint is not findable
                        break
                    parts.append(part)
                if len(parts) == len(ids):
                    self._checkpoints[block.block_hash] = _Checkpoint(ids[0], block, 0, tuple(parts))
            self.pool.decref(ids)

    def commit_step(
        self, request_ids: Sequence[str], num_tokens: Sequence[int], next_token_ids: Sequence[int | None]
    ) -> None:
        reqs = self._step_requests(request_ids, num_tokens, next_token_ids)
        for req, n in zip(reqs, num_tokens, strict=True):
            if req.pending is not _ONE_TOKEN or n != 1:
                self._check_commit(req, n)
        for req, next_token_id in zip(reqs, next_token_ids, strict=True):
            if req.pending is _ONE_TOKEN:
                req.num_computed += 1
                req.pending = None
            else:
                self._apply_commit(req)
            if next_token_id is not None:
                req.token_ids.append(next_token_id)

    def fork(self, parent_id: str, child_id: str) -> bool:
        """A child sharing the parent's classical blocks (refcount + 1) and its computed
        tokens, with its own state block (`state_slot(child_id)`), into which the model
        copies the parent's state. False (nothing changed) when no state block is free."""
        parent = self._get(parent_id)
        if child_id in self._requests:
            raise ValueError(f"request {child_id!r} already exists")
        if parent.pending is not None:
            raise ValueError(f"request {parent_id!r} has an uncommitted reservation; fork after commit")
        if not self._free_states:
            return False
        self.pool.incref(parent.block_ids)
        child = _Request(
            child_id,
            parent.token_ids[: parent.num_computed],
            parent.root,
            self._free_states.popleft(),
            parent.mm_items,
            parent.num_computed,
            list(parent.block_ids),
            list(parent.chain),
        )
        self._requests[child_id] = child
        return True

    # ----- release ------------------------------------------------------------------------

    def _release(self, request_id: str) -> bool:
        """State block back, an uncommitted step undone, classical refs dropped tail-first."""
        req = self._requests.get(request_id)
        if req is None:
            return False
        self._abandon(req)
        del self._requests[request_id]
        self.pool.decref(reversed(req.block_ids))
        self._free_states.append(req.state_slot)
        return True

    # ----- invariants -----------------------------------------------------------------

    def check_integrity(self) -> None:
        self.pool.check_integrity()
        holders = [0] * self.pool.num_blocks
        held_states: list[int] = []
        for req in self._requests.values():
            rid = req.request_id
            ids = list(req.block_ids)
            if req.pending is not None:
                ids += [*req.pending.reservation.new_block_ids, *(b for s in req.pending.snapshot_ids for b in s)]
            if len(set(ids)) != len(ids):
                raise AssertionError(f"invariant 1: request {rid!r} holds a classical block twice: {ids}")
            for block_id in ids:
                holders[block_id] += 1
            if len(req.block_ids) != req.num_computed // self.span:
                raise AssertionError(
                    f"request {rid!r}: {len(req.block_ids)} classical blocks for {req.num_computed} computed "
                    f"tokens (span {self.span}): only complete spans may be pooled"
                )
            if req.num_computed > len(req.token_ids):
                raise AssertionError(
                    f"invariant 6: request {rid!r} computed {req.num_computed} of {len(req.token_ids)}"
                )
            if self.enable_prefix_caching and len(req.chain) != len(req.block_ids):
                raise AssertionError(f"request {rid!r}: {len(req.chain)} chained blocks for {len(req.block_ids)}")
            for k, block in enumerate(req.chain):
                registered = self.pool.prefix_block(req.block_ids[k])
                if registered is not None and registered is not block:
                    raise AssertionError(f"request {rid!r}: block {req.block_ids[k]} registered as other content")
                if block.parent is not (req.chain[k - 1] if k else req.root) or block.token_bytes != self._span_bytes(
                    req, k
                ):
                    raise AssertionError(f"request {rid!r}: chain element {k} is not its own prefix")
            held_states.append(req.state_slot)
        for block_id, count in enumerate(holders):
            if self.pool.refcount(block_id) != count:
                raise AssertionError(
                    f"invariant 1 (refcount == holders): block {block_id} refcount "
                    f"{self.pool.refcount(block_id)}, held by {count}"
                )
        states = held_states + list(self._free_states)
        if sorted(states) != list(range(self.num_state_blocks)):
            raise AssertionError(f"state blocks leaked or doubled: held {held_states}, free {list(self._free_states)}")
        if self.checkpoint_blocks:
            self._check_pooled_checkpoints()
            return
        pending = [r.pending for r in self._requests.values() if r.pending is not None]
        pending_slots = [slot for p in pending for _, slot in p.reservation.checkpoints]
        ckpts = [c.slot for c in self._checkpoints.values()] + list(self._free_checkpoints) + pending_slots
        expected = list(range(self.num_state_blocks, self.num_state_blocks + self.num_checkpoints))
        if sorted(ckpts) != expected:
            raise AssertionError(f"checkpoint slots leaked or doubled: {sorted(ckpts)}")
        for block_hash, ckpt in self._checkpoints.items():
            if ckpt.block.block_hash != block_hash:
                raise AssertionError(f"checkpoint in slot {ckpt.slot} is filed under another hash")

    def _check_pooled_checkpoints(self) -> None:
        for block_hash, ckpt in self._checkpoints.items():
            if ckpt.block.block_hash != block_hash or len(ckpt.parts) != self.checkpoint_blocks:
                raise AssertionError(
                    f"pooled checkpoint of {block_hash.hex()[:12]} is not {self.checkpoint_blocks} parts"
                )
            for part in ckpt.parts:
                if not part.block_ids or not self.pool.is_published(part) or part.parent is not ckpt.block:
                    raise AssertionError(
                        f"pooled checkpoint of {block_hash.hex()[:12]} lost a part: it is not findable"
                    )
