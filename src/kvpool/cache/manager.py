"""The KV cache manager: per-request block tables on one BlockPool, with prefix caching.

One request's token positions, against its block table (bs = block_size):

  [0, num_cached)            blocks found in the prefix cache at admission (shared, read-only)
  [num_cached, num_computed) KV written and committed by this request
  [num_computed, num_reserved) writable slots: blocks exclusive to this request, unpublished
  [num_reserved, ...)        no slots yet

Reservations are block-granular: a block this request may write is writable to its end, so
`num_reserved` is a multiple of bs and the decode path needs work only at block boundaries
(a fresh block) or on a shared tail (copy-on-write). `len(block_ids) == num_reserved / bs`
for a request with a writable tail, `ceil(num_reserved / bs)` in general: a block-table
change and the token counts move together (invariant 5). Every operation checks first and mutates after, so a
call that returns None (out of blocks) or raises leaves no trace (invariant 7).

Pure Python: the storage layer applies the copy-on-write copies this class records
(`take_copies`) before the forward that writes into the new blocks.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from kvpool.cache.types import Admission, BlockCopy, CacheDescriptor, MMItem, PrefixStats, Reservation
from kvpool.pool.block_pool import BlockPool
from kvpool.pool.block_table import BlockTableCSR
from kvpool.pool.hashing import TOKEN_BYTES, BlockHasher, block_packer, token_bytes


class _Request:
    __slots__ = (
        "request_id",
        "block_ids",
        "token_ids",
        "num_computed",
        "num_reserved",
        "block_hashes",
        "root_hash",
        "mm_items",
        "prompt_bytes",
    )

    def __init__(self, request_id: str, token_ids: list[int], root_hash: bytes, mm_items: tuple[MMItem, ...]) -> None:
        self.request_id = request_id
        self.block_ids: list[int] = []
        self.token_ids = token_ids
        self.num_computed = 0
        self.num_reserved = 0
        self.block_hashes: list[bytes] = []  # chained hashes of the full computed blocks
        self.root_hash = root_hash
        self.mm_items = mm_items
        self.prompt_bytes = b""  # token bytes of the prompt, kept to hash its blocks once


class KVCacheManager:
    """Block tables, prefix caching and the request lifecycle for one group of layers."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        descriptor: CacheDescriptor,
        *,
        enable_prefix_caching: bool = True,
        hash_algo: str = "xxh3_128",
    ) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self.descriptor = descriptor
        self.pool = BlockPool(num_blocks, enable_caching=enable_prefix_caching)
        self.hasher = BlockHasher(hash_algo)
        self._pack_block = block_packer(block_size)
        self.enable_prefix_caching = enable_prefix_caching
        self._descriptor_key = descriptor.key()
        self._requests: dict[str, _Request] = {}
        self._pending_copies: list[BlockCopy] = []
        self.stats = PrefixStats()

    # ---- queries ---------------------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def request_ids(self) -> list[str]:
        return list(self._requests)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._requests

    def _get(self, request_id: str) -> _Request:
        try:
            return self._requests[request_id]
        except KeyError:
            raise KeyError(f"unknown request {request_id!r}") from None

    def block_ids(self, request_id: str) -> list[int]:
        return list(self._get(request_id).block_ids)

    def token_ids(self, request_id: str) -> list[int]:
        return list(self._get(request_id).token_ids)

    def num_tokens(self, request_id: str) -> int:
        return len(self._get(request_id).token_ids)

    def num_computed_tokens(self, request_id: str) -> int:
        return self._get(request_id).num_computed

    def num_reserved_tokens(self, request_id: str) -> int:
        return self._get(request_id).num_reserved

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def slot_mapping(self, request_id: str, start: int, end: int) -> list[int]:
        """Physical slots of positions [start, end); they must lie within the reservation."""
        req = self._get(request_id)
        if not 0 <= start <= end <= req.num_reserved:
            raise ValueError(f"positions [{start}, {end}) outside the reserved [0, {req.num_reserved})")
        bs = self.block_size
        table = req.block_ids
        return [table[pos // bs] * bs + pos % bs for pos in range(start, end)]

    def csr(self, request_ids: Sequence[str], num_tokens: Sequence[int] | None = None) -> BlockTableCSR:
        """The batch's block tables in CSR form, each covering `num_tokens[i]` tokens
        (default: the computed tokens; pass computed + in-flight for the step's attention)."""
        bs = self.block_size
        indptr = [0]
        indices: list[int] = []
        last_block_len: list[int] = []
        for i, request_id in enumerate(request_ids):
            req = self._get(request_id)
            n = req.num_computed if num_tokens is None else num_tokens[i]
            if n > req.num_reserved:
                raise ValueError(f"request {request_id!r}: {n} tokens, only {req.num_reserved} reserved")
            num_blocks = -(-n // bs)
            indices.extend(req.block_ids[:num_blocks])
            indptr.append(len(indices))
            last_block_len.append(n - (num_blocks - 1) * bs if n else 0)
        return BlockTableCSR(indptr, indices, last_block_len)

    def take_copies(self) -> list[BlockCopy]:
        """Pending copy-on-write copies, in order; the caller applies them to the tensors."""
        copies, self._pending_copies = self._pending_copies, []
        return copies

    # ---- prefix lookup ---------------------------------------------------------------

    def _extra_keys(self, mm_items: tuple[MMItem, ...], block_index: int) -> bytes:
        """Hashes of the multimodal items overlapping block `block_index`."""
        if not mm_items:
            return b""
        lo = block_index * self.block_size
        hi = lo + self.block_size
        keys = [item.content_hash for item in mm_items if item.start < hi and lo < item.start + item.length]
        return ("\x00mm:" + "\x00".join(keys)).encode() if keys else b""

    def _lookup(self, req: _Request) -> tuple[list[int], list[bytes]]:
        """Longest run of cached full blocks of the prompt, leaving >= 1 token to compute."""
        if not self.enable_prefix_caching:
            return [], []
        width = self.block_size * TOKEN_BYTES
        prompt_bytes = req.prompt_bytes
        max_blocks = (len(req.token_ids) - 1) // self.block_size
        # The hot loop of admission: BlockHasher.chain and BlockPool.lookup, inlined.
        digest = self.hasher.digest
        index = self.pool._index
        stored_tokens = self.pool._token_bytes
        mm_items = req.mm_items
        parent = req.root_hash
        hit_blocks: list[int] = []
        hit_hashes: list[bytes] = []
        for start in range(0, max_blocks * width, width):
            chunk = prompt_bytes[start : start + width]
            if mm_items:
                block_hash = digest(parent + chunk + self._extra_keys(mm_items, start // width))
            else:
                block_hash = digest(parent + chunk)
            block_id = index.get(block_hash)
            if block_id is None:
                break
            if stored_tokens[block_id] != chunk:  # the collision guard
                self.pool.num_collisions += 1
                break
            hit_blocks.append(block_id)
            hit_hashes.append(block_hash)
            parent = block_hash
        return hit_blocks, hit_hashes

    def lookup_prefix(
        self,
        token_ids: Sequence[int],
        *,
        tenant_salt: str = "",
        mm_items: Sequence[MMItem] = (),
        descriptor: CacheDescriptor | None = None,
    ) -> int:
        """How many tokens of `token_ids` admit() would find cached now (changes nothing)."""
        req = self._new_request("<lookup>", token_ids, tenant_salt, mm_items, descriptor, copy=False)
        return len(self._lookup(req)[0]) * self.block_size

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
        items = tuple(MMItem(*item) for item in mm_items)
        for item in items:
            if item.start < 0 or item.length <= 0 or item.start + item.length > len(token_ids):
                raise ValueError(f"multimodal item {item} lies outside the prompt of {len(token_ids)} tokens")
        descriptor_key = self._descriptor_key if descriptor is None else descriptor.key()
        # A lookup only reads the ids; an admitted request owns (and later extends) a copy.
        ids = list(token_ids) if copy or not isinstance(token_ids, list) else token_ids
        req = _Request(request_id, ids, self.hasher.root(descriptor_key, tenant_salt), items)
        req.prompt_bytes = token_bytes(req.token_ids)
        return req

    # ---- lifecycle -------------------------------------------------------------------

    def admit(
        self,
        request_id: str,
        token_ids: Sequence[int],
        num_new_tokens: int | None = None,
        *,
        tenant_salt: str = "",
        mm_items: Sequence[MMItem] = (),
        descriptor: CacheDescriptor | None = None,
    ) -> Admission | None:
        """Admit a request: take its cached prefix and reserve `num_new_tokens` more slots.

        `num_new_tokens` defaults to the rest of the prompt. `descriptor` overrides the
        manager's for this request (another adapter, say). All or nothing: None means the
        pool cannot hold it now, and nothing changed.
        """
        if request_id in self._requests:
            raise ValueError(f"request {request_id!r} is already admitted")
        req = self._new_request(request_id, token_ids, tenant_salt, mm_items, descriptor)
        hit_blocks, hit_hashes = self._lookup(req)
        num_cached = len(hit_blocks) * self.block_size
        if num_new_tokens is None:
            num_new_tokens = len(req.token_ids) - num_cached
        if not 0 <= num_new_tokens <= len(req.token_ids) - num_cached:
            raise ValueError(
                f"num_new_tokens={num_new_tokens} outside [0, {len(req.token_ids) - num_cached}] "
                f"({len(req.token_ids)} prompt tokens, {num_cached} cached)"
            )
        num_new_blocks = self.blocks_needed(num_cached + num_new_tokens) - len(hit_blocks)
        # Hit blocks that sit in the free queue count as free but are about to be taken.
        num_revived = sum(1 for b in hit_blocks if self.pool.refcount(b) == 0)
        if num_new_blocks > self.pool.num_free - num_revived:
            return None
        self.pool.incref(hit_blocks)
        new_blocks = self.pool.allocate(num_new_blocks)
        assert new_blocks is not None
        req.block_ids = hit_blocks + new_blocks
        req.block_hashes = hit_hashes
        req.num_computed = num_cached
        req.num_reserved = len(req.block_ids) * self.block_size
        self._requests[request_id] = req
        self.stats.num_queried_tokens += len(req.token_ids)
        self.stats.num_hit_tokens += num_cached
        return Admission(num_cached, num_new_blocks)

    def _blocks_for_write(self, req: _Request, num_new_tokens: int) -> tuple[int, bool]:
        """(new blocks needed, whether the first written block must be copied first)."""
        bs = self.block_size
        end = req.num_computed + num_new_tokens
        num_new = max(0, -(-end // bs) - len(req.block_ids))
        cow = False
        offset = req.num_computed % bs
        if offset and num_new_tokens and req.num_reserved == req.num_computed:
            # The write starts inside an existing block. A shared block is copied first (one
            # more block); an exclusive block still registered (possible after a rollback)
            # needs no block: _prepare_tail unregisters it before it changes under its hash.
            tail = req.block_ids[req.num_computed // bs]
            if self.pool.refcount(tail) > 1:
                cow = True
        return num_new + cow, cow

    def _prepare_tail(self, req: _Request, cow: bool, new_blocks: list[int]) -> BlockCopy | None:
        bs = self.block_size
        index = req.num_computed // bs
        tail = req.block_ids[index]
        if cow:
            dst = new_blocks.pop()
            self.pool.decref((tail,))
            req.block_ids[index] = dst
            return BlockCopy(tail, dst)
        if self.pool.block_hash(tail) is not None and req.num_computed % bs:
            self.pool.unregister(tail)
        return None

    def reserve(self, request_id: str, num_new_tokens: int) -> Reservation | None:
        """Slots for positions [num_computed, num_computed + n), copying a shared tail first.

        A repeated reserve before commit replaces the previous one (the reservation only
        grows the table). None: not enough free blocks, and nothing changed.
        """
        req = self._get(request_id)
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        end = req.num_computed + num_new_tokens
        if end > len(req.token_ids):
            raise ValueError(
                f"request {request_id!r}: reserving up to position {end}, but only "
                f"{len(req.token_ids)} token ids are known (append_token_ids first)"
            )
        needed, cow = self._blocks_for_write(req, num_new_tokens)
        new_blocks = self.pool.allocate(needed)
        if new_blocks is None:
            return None
        copies = []
        if num_new_tokens and req.num_computed % self.block_size and req.num_reserved == req.num_computed:
            copy = self._prepare_tail(req, cow, new_blocks)
            if copy is not None:
                copies.append(copy)
                self._pending_copies.append(copy)
        req.block_ids.extend(new_blocks)
        if num_new_tokens:
            req.num_reserved = len(req.block_ids) * self.block_size
        return Reservation(new_blocks, copies)

    def append_token_ids(self, request_id: str, token_ids: Iterable[int]) -> None:
        """Sampled tokens join the sequence; a later step computes their KV."""
        self._get(request_id).token_ids.extend(token_ids)

    def commit(self, request_id: str, num_tokens: int) -> None:
        """The next `num_tokens` tokens have their KV written: count them, register full blocks."""
        req = self._get(request_id)
        if not 0 <= num_tokens <= req.num_reserved - req.num_computed:
            raise ValueError(
                f"request {request_id!r}: commit of {num_tokens} tokens, {req.num_reserved - req.num_computed} reserved"
            )
        if req.num_computed + num_tokens > len(req.token_ids):
            raise ValueError(
                f"request {request_id!r}: commit up to position {req.num_computed + num_tokens}, "
                f"but only {len(req.token_ids)} token ids are known (append_token_ids first)"
            )
        req.num_computed += num_tokens
        if self.enable_prefix_caching and len(req.block_hashes) < req.num_computed // self.block_size:
            self._register_full_blocks(req)

    def _register_full_blocks(self, req: _Request) -> None:
        bs = self.block_size
        width = bs * TOKEN_BYTES
        hashes = req.block_hashes
        prompt_bytes = req.prompt_bytes
        chain = self.hasher.chain
        register = self.pool.register
        for i in range(len(hashes), req.num_computed // bs):
            if (i + 1) * width <= len(prompt_bytes):
                chunk = prompt_bytes[i * width : (i + 1) * width]
            else:
                chunk = self._pack_block(req.token_ids[i * bs : (i + 1) * bs])
            block_hash = chain(
                hashes[-1] if hashes else req.root_hash,
                chunk,
                self._extra_keys(req.mm_items, i) if req.mm_items else b"",
            )
            hashes.append(block_hash)
            register(req.block_ids[i], block_hash, chunk)

    # ---- the batched decode path -----------------------------------------------------

    def reserve_decode(self, request_ids: Sequence[str]) -> list[BlockCopy] | None:
        """One slot for each request's next token; all or nothing. Returns the COW copies.

        Every request needs at most one block (a fresh one at a block boundary, or a copy of
        a shared tail), so when the pool has a block per request the pass cannot fail and
        runs once; otherwise a counting pass decides first.
        """
        requests = self._requests
        pool = self.pool
        if pool.num_free < len(request_ids):
            num_needed = 0
            for request_id in request_ids:
                req = requests[request_id]
                nc = req.num_computed
                if nc < req.num_reserved:
                    continue
                if nc % self.block_size == 0 or pool._refcounts[req.block_ids[-1]] > 1:
                    num_needed += 1
            if num_needed > pool.num_free:
                return None
        bs = self.block_size
        refcounts = pool._refcounts
        hashes = pool._hashes
        copies: list[BlockCopy] = []
        for req in map(requests.__getitem__, request_ids):
            nc = req.num_computed
            if nc < req.num_reserved:
                continue  # its slot is already reserved
            if nc % bs == 0:
                req.block_ids.append(pool.allocate(1)[0])  # type: ignore[index]
                req.num_reserved = nc + bs
            else:
                # [0, nc) computed | the tail block holds position nc: it must be ours to write.
                tail = req.block_ids[-1]
                if refcounts[tail] > 1:  # shared: copy-on-write
                    copy = self._prepare_tail(req, True, pool.allocate(1))  # type: ignore[arg-type]
                    assert copy is not None
                    copies.append(copy)
                elif hashes[tail] is not None:  # ours, but published (after a rollback)
                    pool.unregister(tail)
                req.num_reserved = len(req.block_ids) * bs
        if copies:
            self._pending_copies.extend(copies)
        return copies

    def commit_decode(self, request_ids: Sequence[str], next_token_ids: Sequence[int]) -> None:
        """Commit one computed token per request and append each one's sampled next token."""
        if len(request_ids) != len(next_token_ids):
            raise ValueError(f"{len(request_ids)} requests but {len(next_token_ids)} next tokens")
        bs = self.block_size
        caching = self.enable_prefix_caching
        for req, next_token_id in zip(map(self._requests.__getitem__, request_ids), next_token_ids, strict=True):
            nc = req.num_computed + 1
            token_ids = req.token_ids
            if nc > req.num_reserved or nc > len(token_ids):
                raise ValueError(
                    f"request {req.request_id!r}: commit of position {nc - 1} without a reserved "
                    f"slot or a known token id"
                )
            req.num_computed = nc
            token_ids.append(next_token_id)
            if nc % bs == 0 and caching:
                hashes = req.block_hashes
                if len(hashes) * bs + bs != nc or req.mm_items:
                    self._register_full_blocks(req)
                    continue
                # The block just completed: [nc - bs, nc). Inlined _register_full_blocks.
                chunk = self._pack_block(token_ids[nc - bs : nc])
                block_hash = self.hasher.digest((hashes[-1] if hashes else req.root_hash) + chunk)
                hashes.append(block_hash)
                self.pool.register(req.block_ids[nc // bs - 1], block_hash, chunk)

    # ---- fork, rollback, release -----------------------------------------------------

    def fork(self, parent_id: str, child_id: str) -> None:
        """A child that shares every computed block of the parent (refcounts + 1).

        The shared tail becomes read-only for both: the parent's writable slots past its
        computed end are given up (blocks wholly past it are released), and each side
        copies the tail on its next write.
        """
        parent = self._get(parent_id)
        if child_id in self._requests:
            raise ValueError(f"request {child_id!r} already exists")
        nc = parent.num_computed
        keep = self.blocks_needed(nc)
        released = parent.block_ids[keep:]
        del parent.block_ids[keep:]
        self.pool.decref(reversed(released))
        parent.num_reserved = nc
        child = _Request(child_id, parent.token_ids[:nc], parent.root_hash, parent.mm_items)
        child.prompt_bytes = parent.prompt_bytes[: nc * TOKEN_BYTES]
        shared = parent.block_ids
        self.pool.incref(shared)
        child.block_ids = list(shared)
        child.num_computed = child.num_reserved = parent.num_computed
        child.block_hashes = list(parent.block_hashes)
        self._requests[child_id] = child

    def rollback(self, request_id: str, num_computed_tokens: int) -> None:
        """Shrink to `num_computed_tokens` (e.g. rejected speculative tokens).

        Blocks past the new end are released tail-first; the token ids past it are dropped.
        A kept tail block that others share stays untouched: the next write copies it.
        """
        req = self._get(request_id)
        if not 0 <= num_computed_tokens <= req.num_computed:
            raise ValueError(
                f"request {request_id!r}: rollback to {num_computed_tokens} outside [0, {req.num_computed}]"
            )
        keep = self.blocks_needed(num_computed_tokens)
        released = req.block_ids[keep:]
        del req.block_ids[keep:]
        self.pool.decref(reversed(released))
        del req.token_ids[num_computed_tokens:]
        del req.block_hashes[num_computed_tokens // self.block_size :]
        req.num_computed = req.num_reserved = num_computed_tokens
        req.prompt_bytes = req.prompt_bytes[: num_computed_tokens * TOKEN_BYTES]

    def _release(self, request_id: str) -> bool:
        req = self._requests.pop(request_id, None)
        if req is None:
            return False  # released already (or never admitted): releasing twice is a no-op
        self.pool.decref(reversed(req.block_ids))  # tail-first: a chain's tail is evicted first
        return True

    def finish(self, request_id: str) -> bool:
        return self._release(request_id)

    def cancel(self, request_id: str) -> bool:
        return self._release(request_id)

    def preempt(self, request_id: str) -> bool:
        """Release everything; the engine re-admits the request later and recomputes."""
        return self._release(request_id)

    # ---- invariants ------------------------------------------------------------------

    def check_integrity(self) -> None:
        """Assert the lifecycle invariants of ARCHITECTURE.md; the message names the broken one."""
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
            if self.enable_prefix_caching and len(req.block_hashes) != req.num_computed // bs:
                raise AssertionError(
                    f"invariant 6 (only computed full blocks are published): request {rid!r} has "
                    f"{len(req.block_hashes)} block hashes for {req.num_computed} computed tokens"
                )
            for index, block_hash in enumerate(req.block_hashes):
                stored = self.pool.block_hash(req.block_ids[index])
                if stored is not None and stored != block_hash:
                    raise AssertionError(
                        f"invariant 6: request {rid!r} block {req.block_ids[index]} is registered "
                        f"under another chain's hash"
                    )
        for block_id, count in enumerate(holders):
            if self.pool.refcount(block_id) != count:
                raise AssertionError(
                    f"invariant 1 (refcount == number of block tables holding it): block {block_id} "
                    f"has refcount {self.pool.refcount(block_id)}, held by {count} tables"
                )
