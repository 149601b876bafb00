"""The full-attention cache manager: per-request block tables of paged K/V on one BlockPool,
with prefix caching, copy-on-write of shared tails, fork and rollback.

One request's token positions, against its block table (bs = block_size):

  [0, num_cached)              blocks found in the prefix cache at admission (shared, read-only)
  [num_cached, num_computed)   KV written and committed by this request
  [num_computed, num_reserved) writable slots: blocks exclusive to this request, unpublished
  [num_reserved, ...)          no slots yet

Reservations are block-granular: a block this request may write is writable to its end, so
`num_reserved` is a multiple of bs and the decode path needs work only at block boundaries
(a fresh block) or on a shared tail (copy-on-write). `len(block_ids) == num_reserved / bs`
for a request with a writable tail, `ceil(num_reserved / bs)` in general: a block-table
change and the token counts move together (invariant 5). The contract (cache/base.py) holds:
check first, mutate after; a call that returns None or raises leaves no trace (invariant 7).

Pure Python: the storage layer applies the copy-on-write copies this class records
(`take_copies`) before the forward that writes into the new blocks.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from kvpool.cache.base import CacheManager, LowerTier, check_mm_items, mm_extra_key
from kvpool.cache.types import (
    Admission,
    BlockCopy,
    CacheDescriptor,
    CacheUsage,
    MMItem,
    Reservation,
)
from kvpool.pool import BlockPool, BlockTableCSR, PrefixBlock, StepTables, slot_mapping, step_tables, to_csr
from kvpool.pool.hashing import TOKEN_BYTES, block_packer, token_bytes


class _Request:
    __slots__ = (
        "request_id",
        "block_ids",
        "token_ids",
        "num_computed",
        "num_reserved",
        "chain",
        "root",
        "mm_items",
        "prompt_bytes",
        "loading",
        "budget",
        "readmitted",
    )

    def __init__(self, request_id: str, token_ids: list[int], root: PrefixBlock, mm_items: tuple[MMItem, ...]) -> None:
        self.request_id = request_id
        self.block_ids: list[int] = []
        self.token_ids = token_ids
        self.num_computed = 0
        self.num_reserved = 0
        self.chain: list[PrefixBlock] = []  # prefix blocks of the full computed blocks (caching on)
        self.root = root
        self.mm_items = mm_items
        self.prompt_bytes = b""  # token bytes of the prompt, kept to hash its blocks once
        self.loading: list[tuple[int, PrefixBlock]] = []  # lower-tier blocks admitted, not yet loaded
        self.budget = 0  # the admission's max_new_tokens, for complete_loads
        self.readmitted = False  # admitted after a preemption (its hits count apart)


_NO_COPIES: tuple[BlockCopy, ...] = ()

_INT_BYTES = sys.getsizeof(1 << 20)  # an int object of 28 B on 64-bit CPython


class FullAttentionManager(CacheManager):
    """Block tables, prefix caching and the request lifecycle for one group of full-attention
    layers (MHA / GQA / MQA / MLA: every position keeps its KV)."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        descriptor: CacheDescriptor,
        *,
        enable_prefix_caching: bool = True,
        hash_algo: str = "xxh3_128",
        lower_tier: LowerTier | None = None,
        record_published: bool = False,
    ) -> None:
        """lower_tier: a tier below device memory (kvpool.tiers). With one, admission takes
        the longest prefix across the device pool and the tier (the tier's blocks go into
        fresh device blocks, `Admission.loads`, and become findable once `complete_loads`
        says they are loaded), and every cached block the allocator evicts is recorded for
        the runner to write to the tier before anything overwrites it (`take_evicted`).
        record_published: every block that becomes a full cached block is recorded for the
        runner to write through to persistent tiers (`take_published`)."""
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        pool = BlockPool(num_blocks, enable_caching=enable_prefix_caching, hash_algo=hash_algo)
        super().__init__(pool, block_size, descriptor)
        self.lower_tier = lower_tier if enable_prefix_caching else None
        # evicted cached blocks whose content the runner has not yet saved (None: no tier)
        self._evicted: list[tuple[int, PrefixBlock]] | None = [] if self.lower_tier is not None else None
        # blocks computed and published since the runner last took them (None: not recorded)
        self._published: list[tuple[int, PrefixBlock]] | None = (
            [] if record_published and enable_prefix_caching else None
        )
        self._pack_block = block_packer(block_size)
        # Copy-on-write copies not yet taken, in the order they were made (a later copy may
        # read an earlier one's destination). One leaves only when its destination is freed.
        self._pending_copies: list[BlockCopy] = []

    # ---- queries ---------------------------------------------------------------------

    def num_reserved_tokens(self, request_id: str) -> int:
        return self._get(request_id).num_reserved

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def slot_mapping(self, request_id: str, start: int, end: int) -> list[int]:
        """Physical slots of positions [start, end); they must lie within the reservation."""
        req = self._get(request_id)
        if not 0 <= start <= end <= req.num_reserved:
            raise ValueError(f"positions [{start}, {end}) outside the reserved [0, {req.num_reserved})")
        return slot_mapping(req.block_ids, self.block_size, start, end)

    def csr(self, request_ids: Sequence[str], num_tokens: Sequence[int] | None = None) -> BlockTableCSR:
        """The batch's block tables in CSR form, each covering `num_tokens[i]` tokens
        (default: the computed tokens; pass computed + in-flight for the step's attention).
        ValueError for a count outside [0, reserved]."""
        reqs = [self._get(r) for r in request_ids]
        if num_tokens is None:
            counts = [req.num_computed for req in reqs]
        else:
            counts = list(num_tokens)
            if len(counts) != len(reqs):
                raise ValueError(f"{len(reqs)} requests but {len(counts)} token counts")
            for req, n in zip(reqs, counts, strict=True):
                if not 0 <= n <= req.num_reserved:
                    raise ValueError(
                        f"request {req.request_id!r}: {n} tokens outside the reserved [0, {req.num_reserved}]"
                    )
        return to_csr([req.block_ids for req in reqs], counts, self.block_size)

    def step_tables(self, request_ids: Sequence[str], starts: Sequence[int], ends: Sequence[int]) -> StepTables:
        """What a step's attention needs, in one pass: the slots of each request's positions
        [starts[i], ends[i]), and its table over [0, ends[i]). A step continues the computed
        prefix (starts[i] is the request's computed count) within its reservation."""
        reqs = [self._get(r) for r in request_ids]
        for req, start, end in zip(reqs, starts, ends, strict=True):
            if start != req.num_computed or end > req.num_reserved:
                raise ValueError(
                    f"request {req.request_id!r}: positions [{start}, {end}) do not continue its {req.num_computed} "
                    f"computed tokens within the reserved [0, {req.num_reserved})"
                )
        return step_tables([req.block_ids for req in reqs], starts, ends, self.block_size)

    def take_copies(self) -> list[BlockCopy]:
        """Pending copy-on-write copies, in the order they were made; the caller applies them
        to the tensors before the forward that writes into their destinations."""
        copies, self._pending_copies = self._pending_copies, []
        return copies

    def metadata_bytes(self) -> int:
        """Bytes of the manager's Python structures: the pool's, and every request's block
        table, chain, token ids and prompt bytes (sys.getsizeof). A token id is an int object
        of 28 B (ids up to 2^30; the shared small ints below 257 make this a slight
        overcount), counted, not walked: a harness calls this every step."""
        size = sys.getsizeof
        total = self.pool.metadata_bytes() + size(self._requests) + size(self._pending_copies)
        for req in self._requests.values():
            total += size(req) + size(req.block_ids) + size(req.chain) + size(req.prompt_bytes)
            total += size(req.token_ids) + _INT_BYTES * len(req.token_ids)
        return total

    def usage(self) -> CacheUsage:
        bs = self.block_size
        filled: dict[int, int] = {}
        for req in self._requests.values():
            nc = req.num_computed
            for index, block_id in enumerate(req.block_ids):
                n = min(bs, max(0, nc - index * bs))
                if n > filled.get(block_id, -1):
                    filled[block_id] = n
        return CacheUsage(self.pool.num_blocks, self.pool.num_free, len(filled), sum(filled.values()), bs)

    # ---- prefix lookup ---------------------------------------------------------------

    def _extras(self, req: _Request, num_blocks: int) -> list[bytes] | None:
        if not req.mm_items:
            return None
        return [mm_extra_key(req.mm_items, self.block_size, i) for i in range(num_blocks)]

    def _match(self, req: _Request, count_collisions: bool) -> tuple[list[int], list[PrefixBlock]]:
        """Longest run of cached full blocks of the prompt, leaving >= 1 token to compute."""
        if not self.enable_prefix_caching:
            return [], []
        max_blocks = (len(req.token_ids) - 1) // self.block_size
        hit = self.pool.match(
            req.root,
            req.prompt_bytes,
            self.block_size * TOKEN_BYTES,
            max_blocks,
            self._extras(req, max_blocks),
            count_collisions=count_collisions,
        )
        return hit.block_ids, hit.chain

    def lookup_prefix(
        self,
        token_ids: Sequence[int],
        *,
        tenant_salt: str = "",
        mm_items: Sequence[MMItem] = (),
        descriptor: CacheDescriptor | None = None,
    ) -> int:
        req = self._new_request("<lookup>", token_ids, tenant_salt, mm_items, descriptor, copy=False)
        return len(self._match(req, count_collisions=False)[0]) * self.block_size

    def prefix_blocks(self, token_ids: Sequence[int], *, tenant_salt: str = "") -> tuple[list[int], list[PrefixBlock]]:
        """The cached full blocks of `token_ids` from the first (all of them may match, unlike
        an admission's hit, which leaves a token to compute): their ids and prefix blocks.
        Changes nothing; the ids are valid until the pool next allocates."""
        req = self._new_request("<lookup>", token_ids, tenant_salt, (), None, copy=False)
        if not self.enable_prefix_caching:
            return [], []
        hit = self.pool.match(
            req.root,
            req.prompt_bytes,
            self.block_size * TOKEN_BYTES,
            len(token_ids) // self.block_size,
            count_collisions=False,
        )
        return hit.block_ids, hit.chain

    def chain_for(self, token_ids: Sequence[int], *, tenant_salt: str = "") -> list[PrefixBlock]:
        """The prefix blocks (hashes) the full blocks of `token_ids` have under this manager's
        descriptor and `tenant_salt`, cached or not (nothing is registered)."""
        root = self._root(tenant_salt, None)
        chain: list[PrefixBlock] = []
        parent = root
        for j in range(len(token_ids) // self.block_size):
            parent = self.pool.chain(parent, token_bytes(token_ids[j * self.block_size : (j + 1) * self.block_size]))
            chain.append(parent)
        return chain

    def _new_request(
        self,
        request_id: str,
        token_ids: Sequence[int],
        tenant_salt: str,
        mm_items: Sequence[MMItem],
        descriptor: CacheDescriptor | None,
        copy: bool = True,
    ) -> _Request:
        if len(token_ids) == 0:
            raise ValueError(f"request {request_id!r} has an empty prompt")
        items = check_mm_items(mm_items, len(token_ids))
        # A lookup only reads the ids; an admitted request owns (and later extends) a copy.
        ids = list(token_ids) if copy or not isinstance(token_ids, list) else token_ids
        req = _Request(request_id, ids, self._root(tenant_salt, descriptor), items)
        req.prompt_bytes = token_bytes(ids)
        return req

    # ---- lifecycle -------------------------------------------------------------------

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
        hit_blocks, hit_chain = self._match(req, count_collisions=True)
        lower = self._match_lower(req, hit_chain, len(hit_blocks))
        num_device = len(hit_blocks) * self.block_size
        num_cached = num_device + len(lower) * self.block_size
        rest = len(req.token_ids) - num_cached
        n = rest if max_new_tokens is None else min(max_new_tokens, rest)
        num_new_blocks = self.blocks_needed(num_cached + n) - len(hit_blocks)
        # Hit blocks that sit in the free queue count as free but are about to be taken.
        num_revived = sum(1 for b in hit_blocks if self.pool.refcount(b) == 0)
        if num_new_blocks > self.pool.num_free - num_revived:
            return None
        self.pool.incref(hit_blocks)
        new_blocks = self.pool.allocate(num_new_blocks, self._evicted)
        assert new_blocks is not None
        req.block_ids = hit_blocks + new_blocks
        req.chain = hit_chain
        # The lower tier's blocks are in flight until loaded: not computed, not findable.
        req.num_computed = num_device
        req.loading = list(zip(new_blocks[: len(lower)], lower, strict=True))
        req.budget = rest if max_new_tokens is None else max_new_tokens
        req.readmitted = request_id in self._preempted
        req.num_reserved = len(req.block_ids) * self.block_size
        self._requests[request_id] = req
        self._count_admission(request_id, len(req.token_ids), num_device)
        return Admission(num_cached, n, tuple(req.block_ids), None, tuple(req.loading))

    def _match_lower(self, req: _Request, hit_chain: list[PrefixBlock], num_hit: int) -> list[PrefixBlock]:
        """The prompt's full blocks after the device hit that the lower tier holds, in order
        (leaving >= 1 token to compute), as unregistered prefix blocks."""
        if self.lower_tier is None:
            return []
        bs, width = self.block_size, self.block_size * TOKEN_BYTES
        max_blocks = (len(req.token_ids) - 1) // bs
        if num_hit >= max_blocks:
            return []
        extras = self._extras(req, max_blocks)
        parent = hit_chain[-1] if hit_chain else req.root
        candidates = []
        for i in range(num_hit, max_blocks):
            extra = extras[i] if extras is not None else b""
            parent = self.pool.chain(parent, req.prompt_bytes[i * width : (i + 1) * width], extra)
            candidates.append(parent)
        return candidates[: self.lower_tier.find(candidates)]

    def complete_loads(self, request_id: str, num_loaded: int) -> Admission:
        """The first `num_loaded` blocks of the admission's `loads` hold their content now
        (copied and checked): they join the request's computed prefix and become findable,
        in order. The rest (a lower-tier entry gone or refused since admission) are computed
        instead: the returned Admission is the one the engine must follow, its first step
        starting after the loaded blocks."""
        req = self._get(request_id)
        if not 0 <= num_loaded <= len(req.loading):
            raise ValueError(f"request {request_id!r}: {num_loaded} blocks loaded, but {len(req.loading)} were to load")
        parent = req.chain[-1] if req.chain else req.root
        for block_id, block in req.loading[:num_loaded]:
            if block.parent is not parent:  # the previous block joined an equal copy another request published
                block = self.pool.chain(parent, block.token_bytes, block.extra)
            parent = self.pool.register(block_id, block) or block
            req.chain.append(parent)
        loaded_tokens = num_loaded * self.block_size
        req.num_computed += loaded_tokens
        req.loading = []
        stats = self.stats
        stats.num_lower_tier_hit_tokens += loaded_tokens
        if req.readmitted:
            stats.num_readmitted_hit_tokens += loaded_tokens
        else:
            stats.num_hit_tokens += loaded_tokens
        n = min(req.budget, len(req.token_ids) - req.num_computed)
        assert req.num_computed + n <= req.num_reserved, "the admission's blocks cover the step"
        return Admission(req.num_computed, n, tuple(req.block_ids))

    def restore_tail(self, request_id: str, num_tokens: int) -> Admission:
        """The runner has written the KV of the `num_tokens` positions after the computed
        full blocks (a partial block swapped out at preemption, loaded back): they count as
        computed. Only right after admission, before the first step: the computed prefix
        ends on a block boundary, the block that receives them is the request's own
        (exclusive, unregistered) and at least one token is left to compute. Returns the
        admission the engine follows."""
        req = self._get(request_id)
        bs = self.block_size
        nc = req.num_computed
        if req.loading or nc % bs or not 0 < num_tokens < bs or nc + num_tokens >= len(req.token_ids):
            raise ValueError(
                f"request {request_id!r}: cannot restore {num_tokens} tokens after {nc} computed "
                f"({len(req.token_ids)} known, block size {bs})"
            )
        if nc + num_tokens > req.num_reserved:
            raise ValueError(f"request {request_id!r}: {num_tokens} restored tokens lie past its reservation")
        block_id = req.block_ids[nc // bs]
        assert self.pool.refcount(block_id) == 1 and self.pool.block_hash(block_id) is None, "a fresh block"
        req.num_computed = nc + num_tokens
        if req.readmitted:
            self.stats.num_readmitted_hit_tokens += num_tokens
        else:
            self.stats.num_hit_tokens += num_tokens
        # the first step stays inside the admission's reservation (a block boundary past nc)
        n = min(req.budget, len(req.token_ids) - req.num_computed, req.num_reserved - req.num_computed)
        assert n > 0
        return Admission(req.num_computed, n, tuple(req.block_ids))

    def tail_block(self, request_id: str) -> tuple[int, PrefixBlock, int] | None:
        """(block id, an unregistered prefix block for its content, tokens) of the request's
        computed partial block, for a swap; None when its computed tokens end on a block
        boundary (or caching is off)."""
        req = self._get(request_id)
        bs = self.block_size
        nc = req.num_computed
        if not self.enable_prefix_caching or nc % bs == 0:
            return None
        index = nc // bs
        parent = req.chain[-1] if req.chain else req.root
        extra = mm_extra_key(req.mm_items, bs, index) if req.mm_items else b""
        block = self.pool.chain(parent, token_bytes(req.token_ids[index * bs : nc]), extra)
        return req.block_ids[index], block, nc % bs

    def tail_block_for_restore(self, request_id: str, num_tokens: int) -> tuple[int, PrefixBlock] | None:
        """(block id, prefix block of its would-be content) for restoring `num_tokens`
        positions after the computed full blocks (`restore_tail`); None when they cannot be."""
        req = self._get(request_id)
        bs, nc = self.block_size, req.num_computed
        if req.loading or nc % bs or not 0 < num_tokens < bs:
            return None
        if nc + num_tokens >= len(req.token_ids) or nc + num_tokens > req.num_reserved:
            return None
        index = nc // bs
        parent = req.chain[-1] if req.chain else req.root
        extra = mm_extra_key(req.mm_items, bs, index) if req.mm_items else b""
        return req.block_ids[index], self.pool.chain(parent, token_bytes(req.token_ids[nc : nc + num_tokens]), extra)

    def prefix_chain(self, request_id: str) -> list[PrefixBlock]:
        """The prefix blocks of the request's computed full blocks, in order (caching on)."""
        return list(self._get(request_id).chain)

    def take_evicted(self) -> list[tuple[int, PrefixBlock]]:
        """Cached blocks the allocator has evicted since the last call, (block id, the
        content it held), oldest first: their slots still hold that content until the next
        forward writes them. Empty without a lower tier."""
        if not self._evicted:
            return []
        evicted, self._evicted = self._evicted, []
        return evicted

    def take_published(self) -> list[tuple[int, PrefixBlock]]:
        """Blocks that became full cached blocks since the last call, (block id, its prefix
        block), in order: their content is final. Empty unless `record_published`."""
        if not self._published:
            return []
        published, self._published = self._published, []
        return published

    def _writes_into_tail(self, req: _Request, num_new_tokens: int) -> bool:
        """Whether the write starts inside an existing block the request may not write yet:
        a tail it shares (copy it first) or a published one (unregister it first)."""
        return bool(num_new_tokens) and req.num_computed % self.block_size != 0 and req.num_reserved == req.num_computed

    def _blocks_for_write(self, req: _Request, num_new_tokens: int) -> tuple[int, bool]:
        """(new blocks needed, whether the first written block must be copied first). A
        shared tail is copied (one more block); an exclusive one still registered (possible
        after a rollback) needs no block: _prepare_tail unregisters it."""
        bs = self.block_size
        end = req.num_computed + num_new_tokens
        num_new = max(0, -(-end // bs) - len(req.block_ids))
        cow = (
            self._writes_into_tail(req, num_new_tokens)
            and self.pool.refcount(req.block_ids[req.num_computed // bs]) > 1
        )
        return num_new + cow, cow

    def _prepare_tail(self, req: _Request, cow: bool, new_blocks: list[int]) -> BlockCopy | None:
        """Make the block holding position num_computed writable: copy it if shared, else
        drop its registration (it is about to change under its hash)."""
        index = req.num_computed // self.block_size
        tail = req.block_ids[index]
        if cow:
            dst = new_blocks.pop()
            self.pool.decref((tail,))
            req.block_ids[index] = dst
            copy = BlockCopy(tail, dst)
            self._pending_copies.append(copy)
            return copy
        if self.pool.block_hash(tail) is not None:
            self.pool.unregister(tail)
        return None

    def _check_reserve(self, req: _Request, num_new_tokens: int) -> None:
        if req.loading:
            raise ValueError(f"request {req.request_id!r} has lower-tier blocks to load (complete_loads first)")
        end = req.num_computed + num_new_tokens
        if num_new_tokens < 0:
            raise ValueError(f"request {req.request_id!r}: num_new_tokens must be >= 0, got {num_new_tokens}")
        if end > len(req.token_ids):
            raise ValueError(
                f"request {req.request_id!r}: reserving up to position {end}, but only "
                f"{len(req.token_ids)} token ids are known (append_token_ids first)"
            )

    def _apply_reserve(self, req: _Request, num_new_tokens: int, needed: int, cow: bool) -> Reservation:
        new_blocks = self.pool.allocate(needed, self._evicted)
        assert new_blocks is not None, "the caller checked the free count"
        copy = self._prepare_tail(req, cow, new_blocks) if self._writes_into_tail(req, num_new_tokens) else None
        req.block_ids.extend(new_blocks)
        if num_new_tokens:
            req.num_reserved = len(req.block_ids) * self.block_size
        return Reservation(req.num_computed, num_new_tokens, tuple(new_blocks), _NO_COPIES if copy is None else (copy,))

    def reserve(self, request_id: str, num_new_tokens: int) -> Reservation | None:
        """Slots for positions [num_computed, num_computed + n), copying a shared tail first.

        A repeated reserve before commit replaces the previous one (the reservation only
        grows the table). None: not enough free blocks, and nothing changed."""
        req = self._get(request_id)
        self._check_reserve(req, num_new_tokens)
        needed, cow = self._blocks_for_write(req, num_new_tokens)
        if needed > self.pool.num_free:
            return None
        return self._apply_reserve(req, num_new_tokens, needed, cow)

    def _requests_of(self, request_ids: Sequence[str]) -> list[_Request]:
        """The requests, in order. ValueError for a repeated id, KeyError for an unknown one."""
        if len(set(request_ids)) != len(request_ids):
            raise ValueError(f"a request appears twice in {list(request_ids)}")
        try:
            return list(map(self._requests.__getitem__, request_ids))
        except KeyError as missing:
            raise KeyError(f"unknown request {missing.args[0]!r}") from None

    def reserve_step(self, request_ids: Sequence[str], num_new_tokens: Sequence[int]) -> bool:
        """All requests of a step at once (the engine's path). A request whose reserved slots
        already cover its tokens (a decode inside its block) costs one comparison; one that
        starts a block takes fresh blocks; only a write into a read-only tail (shared, or
        published) goes through the copy-on-write path.

        Token ids are checked where blocks are taken; a request inside its reservation is
        checked by `commit_step`, which refuses (before any change) a commit past its known
        tokens."""
        if len(request_ids) != len(num_new_tokens):
            raise ValueError(f"{len(request_ids)} requests but {len(num_new_tokens)} token counts")
        if not request_ids:
            return True
        if num_new_tokens.count(1) == len(request_ids):  # all decodes: most need nothing at all
            try:
                pending = [r for r in map(self._requests.__getitem__, request_ids) if r.num_computed >= r.num_reserved]
            except KeyError as missing:
                raise KeyError(f"unknown request {missing.args[0]!r}") from None
            if not pending:
                return True  # a request listed twice inside its reservation is harmless: nothing is taken
            if len(set(map(id, pending))) != len(pending):
                raise ValueError(f"a request appears twice in {list(request_ids)}")
            counts: Sequence[int] = [1] * len(pending)
        else:
            pending, counts = self._requests_of(request_ids), num_new_tokens
            if min(num_new_tokens) < 0:
                raise ValueError(f"num_new_tokens must be >= 0, got {min(num_new_tokens)}")
        bs = self.block_size
        growing: list[tuple[_Request, int]] = []  # (request, fresh blocks): no tail to copy
        tail_writes: list[tuple[_Request, int]] = []  # (request, tokens): the write starts in a read-only tail
        num_needed = 0
        shared_tails: dict[int, int] = {}  # shared tail block -> writers in this step
        for req, n in zip(pending, counts, strict=True):
            end = req.num_computed + n
            if end <= req.num_reserved:
                continue  # inside its reservation: nothing to take
            self._check_reserve(req, n)  # raises: append_token_ids first
            nc = req.num_computed
            if nc % bs == 0 or nc < req.num_reserved:
                num_fresh = -(-end // bs) - len(req.block_ids)
                num_needed += num_fresh
                growing.append((req, num_fresh))
            else:
                needed, cow = self._blocks_for_write(req, n)
                num_needed += needed - cow
                if cow:
                    tail = req.block_ids[nc // bs]
                    shared_tails[tail] = shared_tails.get(tail, 0) + 1
                tail_writes.append((req, n))
        # Copies of a shared tail: one per writer, except that when every holder writes,
        # the last one finds the block exclusive and writes in place.
        for tail, writers in shared_tails.items():
            num_needed += writers - (writers == self.pool.refcount(tail))
        if num_needed > self.pool.num_free:
            return False
        allocate, evicted = self.pool.allocate, self._evicted
        for req, num_fresh in growing:
            fresh = allocate(num_fresh, evicted)
            assert fresh is not None, "counted above"
            req.block_ids.extend(fresh)
            req.num_reserved = len(req.block_ids) * bs
        for req, n in tail_writes:
            needed, cow = self._blocks_for_write(req, n)  # an earlier copy may have freed a tail
            self._apply_reserve(req, n, needed, cow)
        return True

    def commit(self, request_id: str, num_tokens: int) -> None:
        """The next `num_tokens` tokens have their KV written: count them, register full blocks."""
        self.commit_step((request_id,), (num_tokens,), (None,))

    def commit_step(
        self, request_ids: Sequence[str], num_tokens: Sequence[int], next_token_ids: Sequence[int | None]
    ) -> None:
        if not len(request_ids) == len(num_tokens) == len(next_token_ids):
            raise ValueError(
                f"{len(request_ids)} requests, {len(num_tokens)} token counts, {len(next_token_ids)} next tokens"
            )
        reqs = self._requests_of(request_ids)
        if not reqs:
            return
        decode = num_tokens.count(1) == len(reqs)  # all decodes: the engine's common step
        if decode:
            bad = []
            try:
                for req in reqs:
                    nc = req.num_computed
                    if nc >= req.num_reserved:
                        bad.append(req)
                        break
                    req.token_ids[nc]  # the committed position's token id is known (IndexError if not)
            except IndexError:
                bad.append(req)
        else:
            if min(num_tokens) < 0:
                raise ValueError(f"a commit of {min(num_tokens)} tokens")
            bad = [
                req
                for req, n in zip(reqs, num_tokens, strict=True)
                if n > req.num_reserved - req.num_computed or req.num_computed + n > len(req.token_ids)
            ]
        if bad:
            req = bad[0]
            nc, n = req.num_computed, num_tokens[reqs.index(req)]
            raise ValueError(
                f"request {req.request_id!r}: commit of {n} tokens from position {nc}: "
                f"{req.num_reserved - nc} reserved, {len(req.token_ids) - nc} token ids known"
            )
        bs = self.block_size
        caching = self.enable_prefix_caching
        if decode:
            publish, pack = self.pool.publish, self._pack_block
            for req, next_token_id in zip(reqs, next_token_ids, strict=True):
                nc = req.num_computed + 1
                req.num_computed = nc
                if nc % bs == 0 and caching:  # the token completed block nc // bs - 1
                    chain = req.chain
                    if req.mm_items or len(chain) * bs + bs != nc or nc * TOKEN_BYTES <= len(req.prompt_bytes):
                        self._register_full_blocks(req)
                    else:  # _register_full_blocks of one decoded block, inlined: the hot case
                        chunk = pack(req.token_ids[nc - bs : nc])
                        block_id = req.block_ids[nc // bs - 1]
                        chain.append(publish(block_id, chain[-1] if chain else req.root, chunk))
                        if self._published is not None:
                            self._published.append((block_id, chain[-1]))
                if next_token_id is not None:
                    req.token_ids.append(next_token_id)
            return
        for req, n, next_token_id in zip(reqs, num_tokens, next_token_ids, strict=True):
            nc = req.num_computed + n
            req.num_computed = nc
            if caching and nc % bs < n:  # the commit completed a block (n >= bs always does)
                self._register_full_blocks(req)
            if next_token_id is not None:
                req.token_ids.append(next_token_id)

    def _register_full_blocks(self, req: _Request) -> None:
        """Hash and publish the request's newly completed blocks (the chain grows in order)."""
        bs = self.block_size
        width = bs * TOKEN_BYTES
        chain = req.chain
        prompt_bytes = req.prompt_bytes
        pool = self.pool
        parent = chain[-1] if chain else req.root
        for i in range(len(chain), req.num_computed // bs):
            if (i + 1) * width <= len(prompt_bytes):
                chunk = prompt_bytes[i * width : (i + 1) * width]
            else:
                chunk = self._pack_block(req.token_ids[i * bs : (i + 1) * bs])
            extra = mm_extra_key(req.mm_items, bs, i) if req.mm_items else b""
            # Findable as our block, or as the copy another request published first; or not
            # at all (a collision): the chain goes on with our own, unregistered, element.
            parent = pool.publish(req.block_ids[i], parent, chunk, extra)
            chain.append(parent)
            if self._published is not None:
                self._published.append((req.block_ids[i], parent))

    # ---- fork, rollback, release -----------------------------------------------------

    def fork(self, parent_id: str, child_id: str) -> bool:
        """A child that shares every computed block of the parent (refcounts + 1). Needs no
        free block, so it never fails.

        The shared tail becomes read-only for both: the parent's writable slots past its
        computed end are given up (blocks wholly past it are released), and each side
        copies the tail on its next write."""
        parent = self._get(parent_id)
        if child_id in self._requests:
            raise ValueError(f"request {child_id!r} already exists")
        nc = parent.num_computed
        keep = self.blocks_needed(nc)
        released = parent.block_ids[keep:]
        del parent.block_ids[keep:]
        self.pool.decref(reversed(released))
        parent.num_reserved = nc
        child = _Request(child_id, parent.token_ids[:nc], parent.root, parent.mm_items)
        child.prompt_bytes = parent.prompt_bytes[: nc * TOKEN_BYTES]
        self.pool.incref(parent.block_ids)
        child.block_ids = list(parent.block_ids)
        child.num_computed = child.num_reserved = nc
        child.chain = list(parent.chain)
        self._requests[child_id] = child
        return True

    def rollback(self, request_id: str, num_computed_tokens: int) -> None:
        """Shrink to `num_computed_tokens` (e.g. rejected speculative tokens).

        Blocks past the new end are released tail-first; the token ids past it are dropped.
        A kept tail block that others share stays untouched: the next write copies it."""
        req = self._get(request_id)
        if not 0 <= num_computed_tokens <= req.num_computed:
            raise ValueError(
                f"request {request_id!r}: rollback to {num_computed_tokens} outside [0, {req.num_computed}]"
            )
        keep = self.blocks_needed(num_computed_tokens)
        released = req.block_ids[keep:]
        del req.block_ids[keep:]
        self.pool.decref(reversed(released))
        self._drop_dead_copies()
        del req.token_ids[num_computed_tokens:]
        del req.chain[num_computed_tokens // self.block_size :]
        req.num_computed = req.num_reserved = num_computed_tokens
        req.prompt_bytes = req.prompt_bytes[: num_computed_tokens * TOKEN_BYTES]

    def _drop_dead_copies(self) -> None:
        """A queued copy into a block nobody reads any more is dropped: nobody holds the
        block, and no later queued copy reads it. (A copy into a block a fork shares stays,
        the child reads it too; so does one a later copy of a fork reads from.)"""
        if self._pending_copies:
            self._pending_copies = self._live_copies()

    def _live_copies(self) -> list[BlockCopy]:
        refcount = self.pool.refcount
        read: set[int] = set()  # blocks a later kept copy reads
        kept: list[BlockCopy] = []
        for copy in reversed(self._pending_copies):
            if refcount(copy.dst) > 0 or copy.dst in read:
                kept.append(copy)
                read.add(copy.src)
        kept.reverse()
        return kept

    def _release(self, request_id: str) -> bool:
        req = self._requests.pop(request_id, None)
        if req is None:
            return False
        self.pool.decref(reversed(req.block_ids))  # tail-first: a chain's tail is evicted first
        self._drop_dead_copies()  # a queued copy dies with the last request holding its destination
        return True

    # ---- invariants ------------------------------------------------------------------

    def check_integrity(self) -> None:
        self.pool.check_integrity()
        bs = self.block_size
        holders = [0] * self.pool.num_blocks
        for req in self._requests.values():
            rid = req.request_id
            for block_id in req.block_ids:
                holders[block_id] += 1
            if len(set(req.block_ids)) != len(req.block_ids):
                raise AssertionError(f"invariant 1: request {rid!r} holds a block twice")
            if not 0 <= req.num_computed <= req.num_reserved:
                raise AssertionError(
                    f"invariant 5 (table and computed count commit together): request {rid!r} "
                    f"computed {req.num_computed} > reserved {req.num_reserved}"
                )
            if len(req.block_ids) != self.blocks_needed(req.num_reserved):
                raise AssertionError(
                    f"invariant 5 (table and computed count commit together): request {rid!r} holds "
                    f"{len(req.block_ids)} blocks for {req.num_reserved} reserved tokens"
                )
            if req.num_computed > len(req.token_ids):
                raise AssertionError(
                    f"invariant 6 (no uninitialized read): request {rid!r} counts {req.num_computed} "
                    f"computed tokens but knows only {len(req.token_ids)}"
                )
            # Invariant 2: the blocks being written in the step in flight are exclusive.
            in_flight = range(req.num_computed // bs, self.blocks_needed(req.num_reserved))
            for index in in_flight if req.num_reserved > req.num_computed else ():
                block_id = req.block_ids[index]
                if self.pool.refcount(block_id) != 1:
                    raise AssertionError(
                        f"invariant 2 (copy-on-write before a partial write): request {rid!r} will write "
                        f"into block {block_id} with refcount {self.pool.refcount(block_id)}"
                    )
                if self.pool.block_hash(block_id) is not None:
                    raise AssertionError(
                        f"invariant 2 (cached blocks are immutable): request {rid!r} will write into "
                        f"registered block {block_id}"
                    )
            if self.enable_prefix_caching and len(req.chain) != req.num_computed // bs:
                raise AssertionError(
                    f"invariant 6 (only computed full blocks are published): request {rid!r} has "
                    f"{len(req.chain)} chained blocks for {req.num_computed} computed tokens"
                )
            for index, block in enumerate(req.chain):
                registered = self.pool.prefix_block(req.block_ids[index])
                if registered is not None and registered is not block:
                    raise AssertionError(
                        f"invariant 6: request {rid!r} block {req.block_ids[index]} is registered "
                        f"as another chain's content"
                    )
                if (block.parent is not (req.chain[index - 1] if index else req.root)) or (
                    block.token_bytes != token_bytes(req.token_ids[index * bs : (index + 1) * bs])
                ):
                    raise AssertionError(f"invariant 6: request {rid!r} chain element {index} is not its own prefix")
        if self._live_copies() != self._pending_copies:
            raise AssertionError(f"a queued copy nobody reads: {self._pending_copies}")
        for block_id, count in enumerate(holders):
            if self.pool.refcount(block_id) != count:
                raise AssertionError(
                    f"invariant 1 (refcount == number of block tables holding it): block {block_id} "
                    f"has refcount {self.pool.refcount(block_id)}, held by {count} tables"
                )
