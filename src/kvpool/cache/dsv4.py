"""The DeepSeek-V4 dual-pool cache manager: Classical block ids + State block ids. No torch.

Classical pool: blocks of `span` tokens (a multiple of lcm(m, m')) from the core BlockPool,
with its refcounts, LRU free queue and prefix hash index. A request of history length
L = span * q + r holds exactly q classical blocks; a block joins the request (and is hashed
for prefix caching) only once its whole span is computed, so an incomplete block never
exists in the pool. Hash chain: root(descriptor, tenant salt) -> chain(parent, span tokens).

State pool: a fixed number of per-request state blocks (SWA ring + compressor tails + the
unfinished span's entries), taken at admission and returned at finish / cancel /
preemption. No free state block -> `admit` returns None and changes nothing (the request
waits). Optional state checkpoints: `num_checkpoints` extra slots that snapshot a request's
state at block boundaries, keyed by the boundary block's chained hash (LRU).

Prefix reuse restores the state at span * q exactly (DEEPSEEK_V4.md §6), by one of:
  "checkpoint": the hit is cut to the longest prefix whose boundary has a checkpoint; the
                model copies the checkpoint slot into the request's state block;
  "recompute":  the model replays tokens [max(0, P - n_win * num_layers), P) on top of the
                cached entries (nothing written to the Classical pool).

Per request:  [0, num_blocks * span) classical blocks | [.., num_computed) state only.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from kvpool.pool import BlockHasher, BlockPool, token_bytes
from kvpool.spec.dsv4 import DSV4Spec

RestoreMethod = Literal["checkpoint", "recompute"]
RESTORE_METHODS: tuple[str, ...] = ("checkpoint", "recompute")


@dataclass(frozen=True)
class DSV4Admission:
    """What the model must do before computing a newly admitted request.

    restore "none": fresh state, compute from token 0. "checkpoint": copy `checkpoint_slot`
    into `state_slot`. "recompute": replay tokens [replay_start, num_cached_tokens).
    """

    request_id: str
    state_slot: int
    num_cached_tokens: int
    block_ids: tuple[int, ...]
    restore: Literal["none", "checkpoint", "recompute"]
    checkpoint_slot: int | None = None
    replay_start: int = 0


@dataclass(frozen=True)
class DSV4Reservation:
    """One request's step: positions [start, start + num_tokens).

    block_ids: the request's blocks after the step (held ones, then `num_new` fresh ones for
    the spans completing in this step, to be written whole by the model).
    checkpoints: (position, checkpoint slot) pairs; after the state reaches `position`
    (a multiple of span) the model copies it into that slot.
    """

    request_id: str
    state_slot: int
    start: int
    num_tokens: int
    block_ids: tuple[int, ...]
    num_new: int
    checkpoints: tuple[tuple[int, int], ...] = ()


@dataclass
class _Request:
    request_id: str
    token_ids: list[int]
    root: bytes
    state_slot: int
    num_computed: int = 0
    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)
    pending: DSV4Reservation | None = None
    pending_hashes: list[bytes] = field(default_factory=list)
    pending_token_bytes: list[bytes] = field(default_factory=list)


class DSV4CacheManager:
    def __init__(
        self,
        spec: DSV4Spec,
        num_classical_blocks: int,
        num_state_blocks: int,
        *,
        descriptor_key: bytes = b"",
        enable_prefix_caching: bool = True,
        restore: RestoreMethod = "recompute",
        num_checkpoints: int = 0,
        hash_algo: str = "xxh3_128",
    ) -> None:
        if num_state_blocks <= 0:
            raise ValueError(f"num_state_blocks must be positive, got {num_state_blocks}")
        if restore not in RESTORE_METHODS:
            raise ValueError(f"restore must be one of {RESTORE_METHODS}, got {restore!r}")
        if num_checkpoints < 0:
            raise ValueError(f"num_checkpoints must be >= 0, got {num_checkpoints}")
        if restore == "checkpoint" and enable_prefix_caching and num_checkpoints == 0:
            raise ValueError("restore='checkpoint' needs num_checkpoints > 0")
        self.spec = spec
        self.span = spec.span
        self.pool = BlockPool(num_classical_blocks, enable_caching=enable_prefix_caching)
        self.hasher = BlockHasher(hash_algo)
        self.descriptor_key = descriptor_key
        self.enable_prefix_caching = enable_prefix_caching
        self.restore = restore
        self.num_state_blocks = num_state_blocks
        self.num_checkpoints = num_checkpoints
        self._free_states: deque[int] = deque(range(num_state_blocks))
        # Checkpoint slots follow the state slots: [num_state_blocks, + num_checkpoints).
        self._free_checkpoints: deque[int] = deque(range(num_state_blocks, num_state_blocks + num_checkpoints))
        self._checkpoints: OrderedDict[bytes, int] = OrderedDict()  # boundary block hash -> slot, LRU
        self._requests: dict[str, _Request] = {}

    # ----- queries ------------------------------------------------------------------

    @property
    def num_free_state_blocks(self) -> int:
        return len(self._free_states)

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    def block_ids(self, request_id: str) -> list[int]:
        return list(self._get(request_id).block_ids)

    def state_slot(self, request_id: str) -> int:
        return self._get(request_id).state_slot

    def num_computed_tokens(self, request_id: str) -> int:
        return self._get(request_id).num_computed

    def num_tokens(self, request_id: str) -> int:
        return len(self._get(request_id).token_ids)

    def token_ids(self, request_id: str) -> list[int]:
        return list(self._get(request_id).token_ids)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._requests

    def pending_reservation(self, request_id: str) -> DSV4Reservation | None:
        """The reserved, not yet committed step of a request, if any."""
        return self._get(request_id).pending

    def num_new_blocks(self, request_id: str, num_new_tokens: int) -> int:
        """Classical blocks a step of `num_new_tokens` more tokens would take."""
        req = self._get(request_id)
        return (req.num_computed + num_new_tokens) // self.span - req.num_computed // self.span

    def _get(self, request_id: str) -> _Request:
        try:
            return self._requests[request_id]
        except KeyError:
            raise KeyError(f"unknown request {request_id!r}") from None

    # ----- admission ------------------------------------------------------------------

    def _chain(self, parent: bytes, token_ids: Sequence[int], k: int) -> tuple[bytes, bytes]:
        tb = token_bytes(token_ids[k * self.span : (k + 1) * self.span])
        return self.hasher.chain(parent, tb), tb

    def admit(self, request_id: str, token_ids: Sequence[int], *, tenant_salt: str = "") -> DSV4Admission | None:
        """Take a state block and the longest usable cached prefix; None if no state block is free.

        At least one prompt token is always left to compute (its logits are needed).
        """
        if request_id in self._requests:
            raise ValueError(f"request {request_id!r} is already admitted")
        if not token_ids:
            raise ValueError(f"request {request_id!r} has no tokens")
        if not self._free_states:
            return None
        root = self.hasher.root(self.descriptor_key, tenant_salt)
        hits: list[int] = []
        hashes: list[bytes] = []
        if self.enable_prefix_caching:
            parent = root
            for k in range((len(token_ids) - 1) // self.span):
                block_hash, tb = self._chain(parent, token_ids, k)
                block_id = self.pool.lookup(block_hash, tb)
                if block_id is None:
                    break
                hits.append(block_id)
                hashes.append(block_hash)
                parent = block_hash
        checkpoint_slot = None
        if hits and self.restore == "checkpoint":
            while hits and hashes[-1] not in self._checkpoints:  # cut to the last checkpointed boundary
                hits.pop()
                hashes.pop()
            if hits:
                checkpoint_slot = self._checkpoints[hashes[-1]]
                self._checkpoints.move_to_end(hashes[-1])
        # Check done; mutate.
        self.pool.incref(hits)
        slot = self._free_states.popleft()
        num_cached = len(hits) * self.span
        req = _Request(request_id, list(token_ids), root, slot, num_cached, hits, hashes)
        self._requests[request_id] = req
        if not hits:
            restore = "none"
        elif self.restore == "checkpoint":
            restore = "checkpoint"
        else:
            restore = "recompute"
        replay_start = max(0, num_cached - self.spec.window * self.spec.num_layers) if restore == "recompute" else 0
        return DSV4Admission(request_id, slot, num_cached, tuple(hits), restore, checkpoint_slot, replay_start)

    def append_token_ids(self, request_id: str, token_ids: Sequence[int]) -> None:
        """Sampled tokens join the sequence; a later step computes them."""
        self._get(request_id).token_ids.extend(token_ids)

    # ----- steps ------------------------------------------------------------------------

    def reserve(self, request_id: str, num_new_tokens: int) -> DSV4Reservation | None:
        """Blocks for the spans that complete within the next `num_new_tokens` tokens.
        All or nothing: None (no free classical block) changes nothing."""
        req = self._get(request_id)
        if req.pending is not None:
            raise ValueError(f"request {request_id!r} already has an uncommitted reservation")
        start = req.num_computed
        if num_new_tokens <= 0 or start + num_new_tokens > len(req.token_ids):
            raise ValueError(
                f"request {request_id!r}: cannot compute {num_new_tokens} tokens from {start}, "
                f"it has {len(req.token_ids)} tokens"
            )
        end = start + num_new_tokens
        num_new = end // self.span - start // self.span
        new_ids = self.pool.allocate(num_new) if num_new else []
        if new_ids is None:
            return None
        hashes: list[bytes] = []
        tbs: list[bytes] = []
        parent = req.block_hashes[-1] if req.block_hashes else req.root
        for k in range(len(req.block_ids), len(req.block_ids) + num_new):
            block_hash, tb = self._chain(parent, req.token_ids, k)
            hashes.append(block_hash)
            tbs.append(tb)
            parent = block_hash
        checkpoints: list[tuple[int, int]] = []
        if self.restore == "checkpoint" and self.enable_prefix_caching:
            first = len(req.block_ids) + 1
            wanted = [(k + first) * self.span for k, h in enumerate(hashes) if h not in self._checkpoints]
            # A long prefill may cross more boundaries than there are slots: keep the latest.
            available = len(self._free_checkpoints) + len(self._checkpoints)
            for position in wanted[max(0, len(wanted) - available) :]:
                checkpoints.append((position, self._take_checkpoint_slot()))
        req.pending = DSV4Reservation(
            request_id,
            req.state_slot,
            start,
            num_new_tokens,
            tuple(req.block_ids + new_ids),
            num_new,
            tuple(checkpoints),
        )
        req.pending_hashes = hashes
        req.pending_token_bytes = tbs
        return req.pending

    def _take_checkpoint_slot(self) -> int:
        if self._free_checkpoints:
            return self._free_checkpoints.popleft()
        _, slot = self._checkpoints.popitem(last=False)  # evict the least recently used checkpoint
        return slot

    def unreserve(self, request_id: str) -> None:
        """Undo an uncommitted reservation (e.g. another request of the batch did not fit)."""
        req = self._get(request_id)
        res = req.pending
        if res is None:
            return
        self.pool.decref(reversed(res.block_ids[len(req.block_ids) :]))
        self._free_checkpoints.extend(slot for _, slot in res.checkpoints)
        req.pending = None
        req.pending_hashes, req.pending_token_bytes = [], []

    def commit(self, request_id: str) -> None:
        """The reserved step's tokens are computed: new blocks join the request and are
        published for prefix caching, checkpoints become findable."""
        req = self._get(request_id)
        res = req.pending
        if res is None:
            raise ValueError(f"request {request_id!r} has no reservation to commit")
        new_ids = res.block_ids[len(req.block_ids) :]
        for block_id, block_hash, tb in zip(new_ids, req.pending_hashes, req.pending_token_bytes, strict=True):
            self.pool.register(block_id, block_hash, tb)
        req.block_ids.extend(new_ids)
        req.block_hashes.extend(req.pending_hashes)
        boundary_hash = {(k + 1) * self.span: h for k, h in enumerate(req.block_hashes)}
        for position, slot in res.checkpoints:
            block_hash = boundary_hash[position]
            if block_hash in self._checkpoints:  # another request checkpointed the same prefix first
                self._free_checkpoints.append(slot)
            else:
                self._checkpoints[block_hash] = slot
        req.num_computed += res.num_tokens
        req.pending = None
        req.pending_hashes, req.pending_token_bytes = [], []

    def fork(self, parent_id: str, child_id: str) -> int | None:
        """A child sharing the parent's classical blocks (refcount + 1) with its own state
        block, into which the model copies the parent's state. Returns the child's state
        slot, or None (nothing changed) when no state block is free."""
        parent = self._get(parent_id)
        if child_id in self._requests:
            raise ValueError(f"request {child_id!r} already exists")
        if parent.pending is not None:
            raise ValueError(f"request {parent_id!r} has an uncommitted reservation; fork after commit")
        if not self._free_states:
            return None
        self.pool.incref(parent.block_ids)
        slot = self._free_states.popleft()
        self._requests[child_id] = _Request(
            child_id,
            list(parent.token_ids),
            parent.root,
            slot,
            parent.num_computed,
            list(parent.block_ids),
            list(parent.block_hashes),
        )
        return slot

    # ----- release ------------------------------------------------------------------------

    def release(self, request_id: str) -> bool:
        """Finish, cancel or preempt: state block back, classical refs dropped tail-first.
        A second release of the same request returns False and does nothing."""
        if request_id not in self._requests:
            return False
        self.unreserve(request_id)
        req = self._requests.pop(request_id)
        self.pool.decref(reversed(req.block_ids))
        self._free_states.append(req.state_slot)
        return True

    finish = cancel = preempt = release

    # ----- invariants -----------------------------------------------------------------

    def check_integrity(self) -> None:
        self.pool.check_integrity()
        holders = [0] * self.pool.num_blocks
        held_states: list[int] = []
        for req in self._requests.values():
            ids = req.pending.block_ids if req.pending is not None else req.block_ids
            for block_id in ids:
                holders[block_id] += 1
            if len(req.block_ids) != req.num_computed // self.span:
                raise AssertionError(
                    f"request {req.request_id}: {len(req.block_ids)} classical blocks for "
                    f"{req.num_computed} computed tokens (span {self.span}): only complete spans may be pooled"
                )
            if len(req.block_hashes) != len(req.block_ids):
                raise AssertionError(f"request {req.request_id}: block hashes and block ids differ in length")
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
        pending_ckpt = [slot for r in self._requests.values() if r.pending for _, slot in r.pending.checkpoints]
        ckpts = list(self._checkpoints.values()) + list(self._free_checkpoints) + pending_ckpt
        expected = list(range(self.num_state_blocks, self.num_state_blocks + self.num_checkpoints))
        if sorted(ckpts) != expected:
            raise AssertionError(f"checkpoint slots leaked or doubled: {sorted(ckpts)}")
