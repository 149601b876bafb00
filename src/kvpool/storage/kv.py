"""Paged K/V tensors behind the block pool.

Layout per layer: K [num_blocks, kv_heads, head_dim, block_size] (transposed per block),
V [num_blocks, kv_heads, block_size, head_dim]. Decode attention is then two weighted sums
of indexed rows, q-weighted rows of K^T for the scores and p-weighted rows of V for the
output, which `F.embedding_bag` computes reading the blocks where they lie, in any order
(see attention/paged.py). All layers live in one tensor [num_layers, num_blocks, ...] so a
copy-on-write copy of a block is one indexed copy for all layers at once.

Slots are never read before they are written (the attention masks positions past a
sequence's length), but the tensors start zeroed so that a masked slot can never carry
a NaN into a masked-out product.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

import torch

from kvpool.cache import BlockCopy
from kvpool.spec.kv_formats import KVSchema, block_bytes
from kvpool.spec.layout import CacheSpec
from kvpool.storage.quant import (
    Quantized,
    code_dtype,
    dequantize_k,
    dequantize_v,
    quantize,
    quantize_k,
    quantize_v,
    scale_dtype,
)

if TYPE_CHECKING:
    from kvpool.kernels import CpuKernels


class WriteIndex(NamedTuple):
    k_pos: torch.Tensor  # [N * KVH * D] int64: positions in k[layer].view(-1), (token, head, dim) order
    v_pos: torch.Tensor  # [N * KVH * D] int64: positions in v[layer].view(-1)


def write_positions(slots: torch.Tensor, kvh: int, d: int, bs: int) -> WriteIndex:
    """Flat element positions, within one layer, of N new tokens' K and V in the paged
    layout (module docstring). slots: [N] int64, block * bs + offset."""
    block_idx, offset_idx = slots // bs, slots % bs
    base = block_idx.view(-1, 1, 1) * kvh + torch.arange(kvh, device=block_idx.device).view(1, -1, 1)  # [N, KVH, 1]
    dims = torch.arange(d, device=block_idx.device).view(1, 1, -1)
    off = offset_idx.view(-1, 1, 1)
    # K^T [block, kvh, d, slot]: ((block * KVH + h) * D + d) * bs + slot
    k_pos = ((base * d + dims) * bs + off).reshape(-1)
    # V [block, kvh, slot, d]: ((block * KVH + h) * bs + slot) * D + d
    v_pos = ((base * bs + off) * d + dims).reshape(-1)
    return WriteIndex(k_pos, v_pos)


class PagedKVStorage:
    # The per-block layout, for a cache descriptor's layout_id: bytes are not interchangeable
    # with the former [block, head, slot, dim] K.
    LAYOUT = "k:[block,head,dim,slot] v:[block,head,slot,dim]"

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        kernels: CpuKernels | None = None,
    ):
        """kernels: the C kernels (kvpool.kernels), used by `write` when the pool is fp32 on CPU."""
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"num_blocks and block_size must be positive, got {num_blocks}, {block_size}")
        self.k = torch.zeros(num_layers, num_blocks, num_kv_heads, head_dim, block_size, dtype=dtype, device=device)
        self.v = torch.zeros(num_layers, num_blocks, num_kv_heads, block_size, head_dim, dtype=dtype, device=device)
        # per-layer views, made once (indexing self.k[layer] costs a view per call)
        self.k_layers = list(self.k.unbind(0))
        self.v_layers = list(self.v.unbind(0))
        native = kernels is not None and dtype == torch.float32 and self.k.device.type == "cpu"
        self.kernels = kernels if native else None
        self.num_layers = num_layers
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        # The byte accounting is the spec's (spec/layout.py), the same the planner uses.
        self.spec = CacheSpec.uniform(
            "paged", num_layers, num_kv_heads, head_dim, str(dtype).removeprefix("torch."), block_size=block_size
        )
        assert self.k.nbytes + self.v.nbytes == self.num_bytes, "the tensors disagree with the spec's byte count"

    @property
    def bytes_per_token(self) -> int:
        return int(self.spec.bytes_per_token)

    @property
    def bytes_per_block(self) -> int:
        return int(self.spec.bytes_per_block)

    @property
    def num_bytes(self) -> int:
        return self.bytes_per_block * self.num_blocks

    def write_index(self, slots: torch.Tensor) -> WriteIndex:
        """Flat element positions, within one layer, of N new tokens' K and V; built once per
        step and used by every layer. slots: [N] int64, block * bs + offset."""
        return write_positions(slots, self.num_kv_heads, self.head_dim, self.block_size)

    def write(self, layer: int, index: WriteIndex, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store the step's new K/V, k, v: [N, kv_heads, head_dim], at `write_index`'s positions.
        One index_copy_ of a flat view per tensor (cheaper than a 4-D index_put)."""
        self.k_layers[layer].view(-1).index_copy_(0, index.k_pos, k.reshape(-1))
        self.v_layers[layer].view(-1).index_copy_(0, index.v_pos, v.reshape(-1))

    def write_slots(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """The native twin of `write`: k, v [N, kv_heads, head_dim] (rows may be strided views of
        one qkv row) stored at slots [N] int64 by the C kernel. Needs `self.kernels`."""
        assert self.kernels is not None, "write_slots needs the CPU kernels"
        self.kernels.write_kv(k, v, slots, self.k_layers[layer], self.v_layers[layer])

    def apply_copies(self, copies: Sequence[BlockCopy]) -> None:
        """Copy-on-write: block src -> dst in every layer, in the order the manager recorded."""
        if not copies:
            return
        src = torch.tensor([c.src for c in copies], dtype=torch.long, device=self.k.device)
        dst = torch.tensor([c.dst for c in copies], dtype=torch.long, device=self.k.device)
        # A chain (a -> b, then b -> c: a fork of a request whose tail copy is still queued)
        # needs the order the manager made them in: then the copies go one by one.
        if set(src.tolist()) & set(dst.tolist()):
            for c in copies:
                self.k[:, c.dst] = self.k[:, c.src]
                self.v[:, c.dst] = self.v[:, c.src]
            return
        self.k[:, dst] = self.k[:, src]
        self.v[:, dst] = self.v[:, src]


class QuantWriteIndex(NamedTuple):
    """One step's writes into a QuantizedKVStorage, computed once for every layer."""

    k_pos: torch.Tensor  # per-token formats: positions in a layer's K codes (WriteIndex order);
    v_pos: torch.Tensor  # chunked formats: positions in a layer's tail K / V
    s_pos: torch.Tensor | None  # per-token formats: [N * KVH] positions in a layer's scales
    chunk_tails: torch.Tensor | None  # chunked formats: the tail slot, block and chunk index
    chunk_blocks: torch.Tensor | None  # of every chunk this step completes from a tail
    chunk_index: torch.Tensor | None
    tail_rows: torch.Tensor | None = None  # chunked formats: the step's rows that go to tails
    direct_rows: torch.Tensor | None = None  # [n * block_size]: the rows of blocks written whole
    direct_blocks: torch.Tensor | None = None  # [n]: those blocks (quantized without a tail)
    v_rows: torch.Tensor | None = None  # KIVI: [N * KVH] rows (block, head, slot) of a layer's V codes
    fresh: WriteIndex | None = None  # KIVI: the step's tokens in the scratch (read in full precision)
    read_from: dict[int, tuple[int, int]] | None = None  # KIVI: block -> the first slots of K
    # and of V its tail held before this step (the step reads the cache as it began, and its own K / V)


class SeqSpan(NamedTuple):
    """One sequence's writes in a step: its block table and the token span [start, end)."""

    block_ids: Sequence[int]
    start: int
    end: int


class ReadIndex(NamedTuple):
    """The blocks a step reads, and where its tail tokens overlay their dequantized bytes."""

    block_ids: torch.Tensor  # [n] int64
    k_src: torch.Tensor | None  # positions in a layer's tail K (flat) ...
    k_dst: torch.Tensor | None  # ... and in the scratch K (flat), of every tail token read
    v_src: torch.Tensor | None
    v_dst: torch.Tensor | None


def _chunked(t: torch.Tensor, axis: int, num_chunks: int) -> torch.Tensor:
    """A view of t [blocks, ...] with its slot axis `axis` split into (num_chunks, rest) and
    the chunk dim moved next to the block dim: [blocks, num_chunks, ...]."""
    axis %= t.dim()
    shape = list(t.shape)
    view = t.view(*shape[:axis], num_chunks, shape[axis] // num_chunks, *shape[axis + 1 :])
    return view.movedim(axis, 1)


def _raw(t: torch.Tensor) -> torch.Tensor:
    """A view index_copy_ / index_put_ take: one-byte elements as uint8 (fp8 has no CPU kernels)."""
    return t.view(torch.uint8) if t.element_size() == 1 and t.dtype != torch.uint8 else t


class QuantizedKVStorage:
    """Paged K/V in a storage format of spec/kv_formats.py, with the scales (and KIVI's zero
    points) in tensors of their own indexed by the same block ids. Per layer and block:

      K codes [kv_heads, head_dim, block_size * bits / 8]   (K^T, KIVI codes packed along slots)
      V codes [kv_heads, block_size, head_dim * bits / 8]   (KIVI codes packed along channels)
      scales  token: [kv_heads, block_size]; block: [kv_heads, 1];
              KIVI K: [kv_heads, head_dim, block_size / G]; KIVI V: [kv_heads, block_size, head_dim / G]

    Per-token formats (bf16, fp16, int8, fp8_*_token) quantize each token as it is written.
    Chunked formats (fp8 with block scales: the chunk is the block; KIVI: its residual R)
    write each token in full precision into the block's tail (compute dtype, beside the
    pool) and quantize a chunk from there when its last token is written; a chunk not yet
    whole is read from the tail, a whole one from its bytes (spec/kv_formats.py). A block's
    tail slot is freed in the step after the block fills; the tail of a block released half
    written goes with its last holder (`drop_tails`, from the runner's release). A
    copy-on-write copy of a block carries its scales and its tail.

    KIVI (spec/kv_formats.py `value_window`, `attends_new_exactly`): K as above in R-chunks;
    V quantized a token at a time as it is written, and also kept in the tail while it is
    among its sequence's last R tokens: `_v_from[b]` is the first slot of block b whose V is
    still read from the tail. The window is the block's, moved on by the sequences that
    write past it (`SeqSpan`s given to `write_index`), never back; a block leaves its tail
    once it is full and out of the window (at most two blocks a sequence are in it, R <= the
    block size). A step reads the window it began with and its own new K / V exact
    (`dequantized(..., fresh=...)`). A prefix hit on blocks whose writer has gone reads their
    codes: the residual is the writer's workspace, not part of the stored bytes.

    A step writes its new tokens (`write`), then reads the blocks of the step dequantized
    in the compute dtype (`dequantized`): one layer's scratch K and V of the pool's shape,
    whose step blocks are refreshed from the stored bytes each call (other blocks of the
    scratch are stale and never read). Attention, paged or contiguous reference, then reads
    exactly the values the stored bytes and tails hold."""

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        fmt: KVSchema,
        compute_dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        max_seqs: int | None = None,
    ):
        """max_seqs: the most sequences that run at once (the engine's max_num_seqs), where
        known: the tails then grow by doubling up to `fmt.tail_slots` a sequence, what `kvpool
        plan` prices, and past it only by what a step needs (`_reserve_tails`)."""
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"num_blocks and block_size must be positive, got {num_blocks}, {block_size}")
        fmt.check(block_size, head_dim)
        self.fmt = fmt
        self.flush = fmt.flush(block_size)
        self.num_chunks = block_size // self.flush
        per_byte = 8 // fmt.bits if fmt.packed else 1
        lb = (num_layers, num_blocks, num_kv_heads)
        self.k = torch.zeros(*lb, head_dim, block_size // per_byte, dtype=code_dtype(fmt), device=device)
        self.v = torch.zeros(*lb, block_size, head_dim // per_byte, dtype=code_dtype(fmt), device=device)
        k_scale = {"token": (block_size,), "block": (1,), "channel": (head_dim, block_size // max(fmt.group, 1))}
        v_scale = {"token": (block_size,), "block": (1,), "token-group": (block_size, head_dim // max(fmt.group, 1))}
        sd = scale_dtype(fmt)

        def scales(shape: tuple[int, ...] | None, zero: bool) -> torch.Tensor | None:
            if shape is None or (zero and not fmt.zero_point):
                return None
            return (torch.zeros if zero else torch.ones)(*lb, *shape, dtype=sd, device=device)

        self.k_scale = scales(k_scale.get(fmt.k_scale), False)
        self.v_scale = scales(v_scale.get(fmt.v_scale), False)
        self.k_zero = scales(k_scale.get(fmt.k_scale), True)
        self.v_zero = scales(v_scale.get(fmt.v_scale), True)
        shape_k = (num_blocks, num_kv_heads, head_dim, block_size)
        shape_v = (num_blocks, num_kv_heads, block_size, head_dim)
        self.scratch_k = torch.zeros(shape_k, dtype=compute_dtype, device=device)
        self.scratch_v = torch.zeros(shape_v, dtype=compute_dtype, device=device)
        # the tails of chunked formats: [layers, tail slots, ...] in the compute dtype, grown on demand
        self.tail_k = torch.zeros(num_layers, 0, *shape_k[1:], dtype=compute_dtype, device=device)
        self.tail_v = torch.zeros(num_layers, 0, *shape_v[1:], dtype=compute_dtype, device=device)
        self._tail_of: dict[int, int] = {}  # block id -> tail slot
        self._fill: dict[int, int] = {}  # block id -> tokens its tail covers (slots [0, fill))
        self._free_tails: list[int] = []
        self._max_tails = None if max_seqs is None else max_seqs * fmt.tail_slots
        self._filled: list[int] = []  # blocks filled by the last step: their tails go at the next
        self.window = fmt.value_window  # KIVI's R for V, else 0
        self._v_from: dict[int, int] = {}  # KIVI: block id -> first slot whose V the tail holds
        self.k_layers = list(self.k.unbind(0))
        self.v_layers = list(self.v.unbind(0))
        self.kernels = None  # the fp32 C kernels do not read these pools
        self.num_layers, self.num_blocks, self.block_size = num_layers, num_blocks, block_size
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        assert self.num_bytes == self.bytes_per_block * num_blocks, "the tensors disagree with the schema's bytes"

    @staticmethod
    def block_bytes(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, fmt: KVSchema) -> int:
        """One block over every layer: codes, scales and zero points (spec/kv_formats.py)."""
        return block_bytes(fmt, num_layers, block_size, num_kv_heads, head_dim)

    @staticmethod
    def scratch_block_bytes(block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        """One block's share of the dequantization scratch: K and V of one layer, `dtype`."""
        return 2 * block_size * num_kv_heads * head_dim * torch.empty(0, dtype=dtype).element_size()

    @property
    def bytes_per_block(self) -> int:
        return self.block_bytes(self.num_layers, self.block_size, self.num_kv_heads, self.head_dim, self.fmt)

    @property
    def bytes_per_token(self) -> int:
        return self.bytes_per_block // self.block_size

    @property
    def _scale_tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.k_scale, self.v_scale, self.k_zero, self.v_zero) if t is not None]

    @property
    def scale_bytes(self) -> int:
        """Scales and zero points."""
        return sum(t.nbytes for t in self._scale_tensors)

    @property
    def num_bytes(self) -> int:
        """What the pool stores: codes, scales and zero points (scratch and tails are workspace)."""
        return self.k.nbytes + self.v.nbytes + self.scale_bytes

    @property
    def scratch_bytes(self) -> int:
        return self.scratch_k.nbytes + self.scratch_v.nbytes

    @property
    def tail_bytes(self) -> int:
        return self.tail_k.nbytes + self.tail_v.nbytes

    @property
    def num_tails(self) -> int:
        return len(self._tail_of)

    @property
    def reads_in_place(self) -> bool:
        """A kernel can read these blocks where they lie: 8-bit symmetric codes with fp32
        scales per token or per block, a partly written block from its tail whole (the C
        kernel kv_decode_attention_q8 on the CPU, attention/backends/triton_extend.py on CUDA)."""
        return (
            self.fmt.bits == 8
            and not self.fmt.zero_point
            and self.flush in (1, self.block_size)
            and self.fmt.scale_dtype == "float32"
        )

    @property
    def reads_natively(self) -> bool:
        """The C kernel kv_decode_attention_q8 reads these blocks (`reads_in_place`, an fp32
        compute dtype, on the CPU)."""
        return self.reads_in_place and self.scratch_k.dtype == torch.float32 and self.k.device.type == "cpu"

    def tail_slots(self, block_ids: Sequence[int]) -> torch.Tensor:
        """[n] int64: the tail slot each block is read from whole (a block-scaled block not yet
        full), else -1."""
        out = [-1] * len(block_ids)
        if self._tail_of:
            for i, b in enumerate(block_ids):
                slot = self._tail_of.get(b)
                if slot is not None and self._fill[b] < self.block_size:
                    out[i] = slot
        return torch.tensor(out, dtype=torch.long)

    # ---- tails ---------------------------------------------------------------------------

    def _take_tail(self, block_id: int) -> int:
        slot = self._tail_of.get(block_id)
        if slot is not None:
            return slot
        self._reserve_tails(1)
        slot = self._free_tails.pop()
        self._tail_of[block_id] = slot
        return slot

    def _reserve_tails(self, n: int) -> None:
        """At least n free tail slots (a step reserves its new tails at once). The tensors
        double (a copy of them each time: amortized, as a list grows), but never past the
        sequences' bound (`max_seqs` x `fmt.tail_slots`, what `kvpool plan` prices), where one
        was given, unless the step needs more: then by what is missing."""
        missing = n - len(self._free_tails)
        if missing <= 0:
            return
        old = self.tail_k.shape[1]
        grow = max(old, 1)
        if self._max_tails is not None:
            grow = min(grow, self._max_tails - old)
        grow = max(grow, missing)
        for name in ("tail_k", "tail_v"):
            t = getattr(self, name)
            more = t.new_zeros(t.shape[0], grow, *t.shape[2:])
            setattr(self, name, torch.cat([t, more], 1))
        self._free_tails.extend(range(old + grow - 1, old - 1, -1))

    def _drop_tail(self, block_id: int) -> None:
        slot = self._tail_of.pop(block_id, None)
        self._fill.pop(block_id, None)
        self._v_from.pop(block_id, None)
        if slot is not None:
            self._free_tails.append(slot)

    def _retire_filled(self) -> None:
        """Free the tails of the blocks the previous step filled: their chunks are quantized
        for good and every layer has written them. Runs first in a step (before copies, which
        may take such a block as a target, and before the writes), so no tail slot of a
        block is ever handed on while that block still points at it."""
        for b in self._filled:
            self._drop_tail(b)
        self._filled = []

    def drop_tails(self, block_ids: Sequence[int]) -> None:
        """Forget the tails of these blocks (their last holder released them)."""
        for b in block_ids:
            if b not in self._filled:
                self._drop_tail(b)

    # ---- writes --------------------------------------------------------------------------

    def write_index(
        self, slots: torch.Tensor, seqs: Sequence[SeqSpan] | None = None, *, host_slots: Sequence[int] | None = None
    ) -> QuantWriteIndex:
        """Where the step's N new tokens go, for every layer; slots: [N] int64. Chunked
        formats also take the tail slots of the blocks written and list the chunks the
        step completes. KIVI needs `seqs` (each written sequence's blocks and span, the
        slots being theirs in order) to move V's window; ValueError without it.

        host_slots: the same N slots as host integers (the step's list the slots tensor was
        made from). The chunked formats' bookkeeping is per block on the host: given them,
        it reads them instead of `slots.tolist()`, which on a CUDA pool is a device-to-host
        copy and a synchronisation every step (the Triton backend passes them)."""
        kvh, d, bs = self.num_kv_heads, self.head_dim, self.block_size
        if self.window and seqs is None:
            raise ValueError(
                f"{self.fmt.name} keeps each sequence's last {self.window} values exact: "
                "write_index needs the sequences' block tables and spans (seqs)"
            )
        if host_slots is not None and len(host_slots) != slots.shape[0]:
            raise ValueError(f"{len(host_slots)} host slots for a step of {slots.shape[0]} slots")
        self._retire_filled()
        if self.flush == 1:
            k_pos, v_pos = write_positions(slots, kvh, d, bs)
            block_idx, offset_idx = slots // bs, slots % bs
            heads = torch.arange(kvh, device=slots.device).view(1, -1)
            s_pos = ((block_idx.view(-1, 1) * kvh + heads) * bs + offset_idx.view(-1, 1)).reshape(-1)
            return QuantWriteIndex(k_pos, v_pos, s_pos, None, None, None)
        if host_slots is None:  # (a device read on CUDA: host_slots above)
            host_slots = slots.tolist()
        blocks = [slot // bs for slot in host_slots]
        offsets = [slot % bs for slot in host_slots]
        first: dict[int, int] = {}
        last: dict[int, int] = {}
        rows_of: dict[int, list[int]] = {}
        for i, (b, o) in enumerate(zip(blocks, offsets, strict=True)):
            first[b] = min(first.get(b, o), o)
            last[b] = max(last.get(b, o), o + 1)
            rows_of.setdefault(b, []).append(i)
        # KIVI: where each written sequence's V window starts in its blocks after the step,
        # over the blocks from the window's start before the step to the sequence's end:
        #   [0, end - R) codes | [end - R, end) the tail's exact values
        window: dict[int, int] = {}
        if self.window:
            assert seqs is not None
            for seq in seqs:
                new_start = max(0, seq.end - self.window)
                for i in range(max(0, seq.start - self.window) // bs, -(-seq.end // bs)):
                    b = seq.block_ids[i]
                    window[b] = max(window.get(b, 0), min(bs, max(0, new_start - i * bs)))
        tails, chunk_tails, chunk_blocks, chunk_index = {}, [], [], []
        read_from: dict[int, tuple[int, int]] = {}
        direct_blocks: list[int] = []
        direct_rows: list[int] = []
        r = self.flush

        def direct(b: int) -> bool:  # written whole, out of any window: from the rows
            return first[b] == 0 and last[b] == bs and len(rows_of[b]) == bs and window.get(b, bs) == bs

        # the new tails, less the stale ones the direct blocks give back below
        held = [b in self._tail_of for b in first]
        news = [not h and not direct(b) for b, h in zip(first, held, strict=True)]
        stale = [h and direct(b) for b, h in zip(first, held, strict=True)]
        self._reserve_tails(sum(news) - sum(stale))
        for b, fb in first.items():
            fa = last[b]
            if direct(b):
                self._drop_tail(b)  # (a stale one of a block freed half written)
                direct_blocks.append(b)
                direct_rows.extend(sorted(rows_of[b], key=lambda i: offsets[i]))
                continue
            if fb == 0:  # a block's first write: no window of an earlier holder applies
                self._v_from.pop(b, None)
            if self.window:
                old_fill = self._fill.get(b, 0) if b in self._tail_of else 0
                read_from[b] = ((old_fill // self.flush) * self.flush, self._v_from.get(b, 0))
            tails[b] = slot = self._take_tail(b)
            self._fill[b] = fa
            for c in range(fb // r, fa // r):
                chunk_tails.append(slot)
                chunk_blocks.append(b)
                chunk_index.append(c)
            if fa == bs and not self.window:
                self._filled.append(b)
        if self.window:
            for b, start in window.items():
                if b not in self._tail_of:
                    continue
                old = self._v_from.get(b, 0)
                if b not in read_from:
                    read_from[b] = ((self._fill[b] // self.flush) * self.flush, old)
                self._v_from[b] = max(old, start)
                if self._v_from[b] == bs and self._fill[b] == bs and b not in self._filled:
                    self._filled.append(b)  # full, and out of the window: its tail goes next step
        tail_rows = [i for i, b in enumerate(blocks) if b in tails]
        tail_slots = torch.tensor([tails[blocks[i]] * bs + offsets[i] for i in tail_rows], dtype=torch.long)
        k_pos, v_pos = write_positions(tail_slots.to(slots.device), kvh, d, bs)

        def t(x: list[int]) -> torch.Tensor:
            return torch.tensor(x, dtype=torch.long, device=slots.device)

        v_rows = fresh = None
        if self.window:
            heads = torch.arange(kvh, device=slots.device).view(1, -1)
            v_rows = (((slots // bs).view(-1, 1) * kvh + heads) * bs + (slots % bs).view(-1, 1)).reshape(-1)
            fresh = write_positions(slots, kvh, d, bs)
        return QuantWriteIndex(
            k_pos,
            v_pos,
            None,
            t(chunk_tails),
            t(chunk_blocks),
            t(chunk_index),
            t(tail_rows),
            t(direct_rows),
            t(direct_blocks),
            v_rows,
            fresh,
            read_from if self.window else None,
        )

    def write(self, layer: int, index: QuantWriteIndex, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store the step's new K/V, k, v: [N, kv_heads, head_dim] (any float dtype)."""
        if index.s_pos is not None:  # per token: quantized now
            for new, pool, scales, pos in (
                (k, self.k_layers[layer], self.k_scale, index.k_pos),
                (v, self.v_layers[layer], self.v_scale, index.v_pos),
            ):
                q, scale = quantize(self.fmt, new)
                _raw(pool).view(-1).index_copy_(0, pos, _raw(q).reshape(-1))
                if scales is not None and scale is not None:
                    scales[layer].view(-1).index_copy_(0, index.s_pos, scale.reshape(-1))
            return
        dtype = self.tail_k.dtype
        nc, r = self.num_chunks, self.flush
        assert index.tail_rows is not None and index.direct_rows is not None and index.direct_blocks is not None
        if index.v_rows is not None:  # KIVI: V a token at a time, now (its window reads the tail)
            n_rows = index.v_rows.shape[0]
            qv = quantize_v(self.fmt, v.reshape(n_rows, 1, self.head_dim))
            for pool, value in (
                (self.v_layers[layer], qv.codes),
                (None if self.v_scale is None else self.v_scale[layer], qv.scale),
                (None if self.v_zero is None else self.v_zero[layer], qv.zero),
            ):
                if pool is not None and value is not None:
                    pool.view(-1, pool.shape[-1]).index_copy_(0, index.v_rows, value.reshape(n_rows, -1))
        if len(index.tail_rows):
            tk, tv = k.index_select(0, index.tail_rows), v.index_select(0, index.tail_rows)
            self.tail_k[layer].view(-1).index_copy_(0, index.k_pos, tk.to(dtype).reshape(-1))
            self.tail_v[layer].view(-1).index_copy_(0, index.v_pos, tv.to(dtype).reshape(-1))
        if index.chunk_tails is not None and len(index.chunk_tails):
            tails, chunks = index.chunk_tails, index.chunk_index
            # K: slots are the last axis of codes, tails and scales; V: the slot axis is -2
            qk = quantize_k(self.fmt, _chunked(self.tail_k[layer], -1, nc)[tails, chunks])
            qv = None if self.window else quantize_v(self.fmt, _chunked(self.tail_v[layer], -2, nc)[tails, chunks])
            self._store_chunks(layer, index.chunk_blocks, chunks, qk, qv)
        n = len(index.direct_blocks)
        if n:  # blocks written whole this step: every chunk from the new rows, in the compute dtype
            kvh, d, bs = self.num_kv_heads, self.head_dim, self.block_size
            kd = k.index_select(0, index.direct_rows).to(dtype).view(n, bs, kvh, d)
            vd = v.index_select(0, index.direct_rows).to(dtype).view(n, bs, kvh, d)
            kc = kd.permute(0, 2, 3, 1).reshape(n, kvh, d, nc, r).movedim(3, 1).reshape(n * nc, kvh, d, r)
            vc = vd.permute(0, 2, 1, 3).reshape(n, kvh, nc, r, d).movedim(2, 1).reshape(n * nc, kvh, r, d)
            chunks = torch.arange(nc, device=kd.device).repeat(n)
            blocks = index.direct_blocks.repeat_interleave(nc)
            qv = None if self.window else quantize_v(self.fmt, vc)
            self._store_chunks(layer, blocks, chunks, quantize_k(self.fmt, kc), qv)

    def _store_chunks(
        self, layer: int, blocks: torch.Tensor, chunks: torch.Tensor, qk: Quantized, qv: Quantized | None
    ) -> None:
        """Chunk `chunks[i]` of block `blocks[i]`: its codes, scales and zero points (V's too
        unless qv is None: KIVI's V is stored a token at a time)."""
        nc = self.num_chunks
        v_axis = -2 if self.fmt.v_scale == "token-group" else -1
        parts = [
            (self.k_layers[layer], -1, qk.codes),
            (None if self.k_scale is None else self.k_scale[layer], -1, qk.scale),
            (None if self.k_zero is None else self.k_zero[layer], -1, qk.zero),
        ]
        if qv is not None:
            parts += [
                (self.v_layers[layer], -2, qv.codes),
                (None if self.v_scale is None else self.v_scale[layer], v_axis, qv.scale),
                (None if self.v_zero is None else self.v_zero[layer], v_axis, qv.zero),
            ]
        for pool, axis, value in parts:
            if pool is not None and value is not None:
                _chunked(_raw(pool), axis, nc)[blocks, chunks] = _raw(value)

    # ---- reads ---------------------------------------------------------------------------

    def read_index(self, block_ids: torch.Tensor, step: QuantWriteIndex | None = None) -> ReadIndex:
        """The step's blocks ([n] int64, after `write_index`), and the tail tokens that
        overlay their bytes: in each block with a tail, K past its last whole chunk, V past
        the same point or, KIVI, from its window's start (`step`, KIVI: that step reads the
        tails as they were before its writes, its own K / V coming exact from `dequantized`;
        None: the tails as they are now)."""
        kvh, d, bs = self.num_kv_heads, self.head_dim, self.block_size
        src: tuple[list[int], list[int]] = ([], [])  # K, V (V's apart only for KIVI's window)
        dst: tuple[list[int], list[int]] = ([], [])
        before = step.read_from if step is not None and step.read_from is not None else {}
        if self._tail_of:
            r = self.flush
            for b in block_ids.tolist():
                slot = self._tail_of.get(b)
                if slot is None:
                    continue
                k_start = (self._fill[b] // r) * r
                v_start = self._v_from.get(b, 0) if self.window else k_start
                k_start, v_start = before.get(b, (k_start, v_start))
                for which, start in ((0, k_start), (1, v_start)) if self.window else ((0, k_start),):
                    src[which].extend(range(slot * bs + start, slot * bs + bs))
                    dst[which].extend(range(b * bs + start, b * bs + bs))
        if not src[0] and not src[1]:
            return ReadIndex(block_ids, None, None, None, None)

        def t(x: list[int]) -> torch.Tensor:
            return torch.tensor(x, dtype=torch.long, device=block_ids.device)

        # one position list a side where V's tail slots are K's (every format but KIVI)
        k_src, v_src = write_positions(t(src[0]), kvh, d, bs)
        k_dst, v_dst = write_positions(t(dst[0]), kvh, d, bs)
        if self.window:  # KIVI: V from its window's start, not K's unfinished chunk
            v_src = write_positions(t(src[1]), kvh, d, bs).v_pos
            v_dst = write_positions(t(dst[1]), kvh, d, bs).v_pos
        return ReadIndex(block_ids, k_src, k_dst, v_src, v_dst)

    def dequantized(
        self,
        layer: int,
        read: ReadIndex | torch.Tensor,
        fresh: tuple[QuantWriteIndex, torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The scratch K and V of `layer` (the pool's layer shapes, compute dtype) with the
        read's blocks dequantized from the stored bytes, tail tokens over them, and (KIVI,
        `fresh` = the step's write index and its k, v [N, kv_heads, head_dim]) the step's
        own K and V over those, exact."""
        if not isinstance(read, ReadIndex):
            read = self.read_index(read)
        ids = read.block_ids
        dtype = self.scratch_k.dtype

        def at(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t[layer, ids]

        k = dequantize_k(self.fmt, Quantized(self.k[layer, ids], at(self.k_scale), at(self.k_zero)), dtype)
        v = dequantize_v(self.fmt, Quantized(self.v[layer, ids], at(self.v_scale), at(self.v_zero)), dtype)
        self.scratch_k[ids] = k
        self.scratch_v[ids] = v
        if read.k_src is not None:
            assert read.k_dst is not None and read.v_src is not None and read.v_dst is not None
            self.scratch_k.view(-1).index_copy_(0, read.k_dst, self.tail_k[layer].view(-1)[read.k_src])
            self.scratch_v.view(-1).index_copy_(0, read.v_dst, self.tail_v[layer].view(-1)[read.v_src])
        if fresh is not None and fresh[0].fresh is not None:
            pos, k_new, v_new = fresh[0].fresh, fresh[1], fresh[2]
            self.scratch_k.view(-1).index_copy_(0, pos.k_pos, k_new.to(dtype).reshape(-1))
            self.scratch_v.view(-1).index_copy_(0, pos.v_pos, v_new.to(dtype).reshape(-1))
        return self.scratch_k, self.scratch_v

    def contiguous(self, layer: int, block_ids: Sequence[int], length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V [kv_heads, length, head_dim] of one sequence whose blocks are `block_ids`,
        dequantized from the same bytes and tails as `dequantized` (the contiguous reference)."""
        ids = torch.tensor(list(block_ids), dtype=torch.long, device=self.k.device)
        k, v = self.dequantized(layer, ids)
        kvh, d, bs = self.num_kv_heads, self.head_dim, self.block_size
        kc = k[ids].permute(1, 0, 3, 2).reshape(kvh, -1, d)[:, :length]
        vc = v[ids].transpose(0, 1).reshape(kvh, -1, d)[:, :length]
        assert kc.shape[1] == length <= len(ids) * bs, "the blocks do not cover the length"
        return kc.clone(), vc.clone()

    def apply_copies(self, copies: Sequence[BlockCopy]) -> None:
        """Copy-on-write: block src -> dst in every layer (codes, scales, zero points, and
        the tail of a partly written block), in the order the manager recorded them."""
        self._retire_filled()
        tensors = [self.k, self.v, *self._scale_tensors]
        for c in copies:  # one by one: a chain (a -> b, then b -> c) needs the manager's order
            for t in tensors:
                t[:, c.dst] = t[:, c.src]
            src_tail = self._tail_of.get(c.src)
            if src_tail is not None:
                dst_tail = self._take_tail(c.dst)
                self.tail_k[:, dst_tail] = self.tail_k[:, src_tail]
                self.tail_v[:, dst_tail] = self.tail_v[:, src_tail]
                self._fill[c.dst] = self._fill[c.src]
                if c.src in self._v_from:  # KIVI: the window's start goes with the tail
                    self._v_from[c.dst] = self._v_from[c.src]
                else:
                    self._v_from.pop(c.dst, None)
            else:
                self._drop_tail(c.dst)
