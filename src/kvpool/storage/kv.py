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
from kvpool.spec.layout import CacheSpec
from kvpool.storage.quant import KVFormat, quantize

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
    k_pos: torch.Tensor  # [N * KVH * D] int64, as WriteIndex
    v_pos: torch.Tensor
    s_pos: torch.Tensor  # [N * KVH] int64: positions in a layer's scales, (token, head) order


class QuantizedKVStorage:
    """Paged K/V in a storage format of storage/quant.py (bf16, fp16, fp8, int8), with the
    per-(token, KV head) scales of the scaled formats in tensors of their own, indexed by the
    same block ids: K [layers, blocks, kv_heads, head_dim, block_size] and V [layers, blocks,
    kv_heads, block_size, head_dim] in the format's dtype (PagedKVStorage's layout), scales
    [layers, blocks, kv_heads, block_size] fp32 for K and for V. A copy-on-write copy of a
    block carries its scales with it (the tiers keep unquantized blocks only).

    A step writes its new tokens quantized (`write`), then reads the blocks of the step
    dequantized in the compute dtype (`dequantized`): one layer's scratch K and V of the
    pool's shape, whose step blocks are refreshed from the stored bytes each call (other
    blocks of the scratch are stale and never read). Attention, paged or contiguous reference,
    then reads exactly the values the stored bytes hold."""

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        fmt: KVFormat,
        compute_dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
    ):
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"num_blocks and block_size must be positive, got {num_blocks}, {block_size}")
        self.fmt = fmt
        shape_k = (num_layers, num_blocks, num_kv_heads, head_dim, block_size)
        shape_v = (num_layers, num_blocks, num_kv_heads, block_size, head_dim)
        self.k = torch.zeros(shape_k, dtype=fmt.dtype, device=device)
        self.v = torch.zeros(shape_v, dtype=fmt.dtype, device=device)
        scales = (num_layers, num_blocks, num_kv_heads, block_size)
        self.k_scale = torch.ones(scales, dtype=torch.float32, device=device) if fmt.scaled else None
        self.v_scale = torch.ones(scales, dtype=torch.float32, device=device) if fmt.scaled else None
        self.scratch_k = torch.zeros(shape_k[1:], dtype=compute_dtype, device=device)
        self.scratch_v = torch.zeros(shape_v[1:], dtype=compute_dtype, device=device)
        self.k_layers = list(self.k.unbind(0))
        self.v_layers = list(self.v.unbind(0))
        self.kernels = None  # the C kernels write and read fp32 pools only
        self.num_layers, self.num_blocks, self.block_size = num_layers, num_blocks, block_size
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim

    @staticmethod
    def block_bytes(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, fmt: KVFormat) -> int:
        """One block over every layer: K and V elements and their scales."""
        return 2 * num_layers * block_size * num_kv_heads * fmt.bytes_per_token_head(head_dim)

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
    def scale_bytes(self) -> int:
        return 0 if self.k_scale is None or self.v_scale is None else self.k_scale.nbytes + self.v_scale.nbytes

    @property
    def num_bytes(self) -> int:
        """What the pool stores: elements and scales (the scratch is workspace, not pool)."""
        return self.k.nbytes + self.v.nbytes + self.scale_bytes

    @property
    def scratch_bytes(self) -> int:
        return self.scratch_k.nbytes + self.scratch_v.nbytes

    def write_index(self, slots: torch.Tensor) -> QuantWriteIndex:
        """As PagedKVStorage.write_index, plus the new tokens' scale positions. slots: [N] int64."""
        kvh, bs = self.num_kv_heads, self.block_size
        k_pos, v_pos = write_positions(slots, kvh, self.head_dim, bs)
        block_idx, offset_idx = slots // bs, slots % bs
        heads = torch.arange(kvh, device=slots.device).view(1, -1)
        s_pos = ((block_idx.view(-1, 1) * kvh + heads) * bs + offset_idx.view(-1, 1)).reshape(-1)
        return QuantWriteIndex(k_pos, v_pos, s_pos)

    @staticmethod
    def _raw(t: torch.Tensor) -> torch.Tensor:
        """A view index_copy_ takes: one-byte elements as uint8 (fp8 has no CPU index_copy_)."""
        return t.view(torch.uint8) if t.element_size() == 1 else t

    def write(self, layer: int, index: QuantWriteIndex, k: torch.Tensor, v: torch.Tensor) -> None:
        """Quantize and store the step's new K/V, k, v: [N, kv_heads, head_dim] (any float dtype)."""
        for new, pool, scales, pos in (
            (k, self.k_layers[layer], self.k_scale, index.k_pos),
            (v, self.v_layers[layer], self.v_scale, index.v_pos),
        ):
            q, scale = quantize(self.fmt, new)
            self._raw(pool).view(-1).index_copy_(0, pos, self._raw(q).reshape(-1))
            if scales is not None and scale is not None:
                scales[layer].view(-1).index_copy_(0, index.s_pos, scale.reshape(-1))

    def dequantized(self, layer: int, block_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The scratch K and V of `layer` (the pool's layer shapes, compute dtype) with blocks
        `block_ids` ([n] int64) dequantized from the stored bytes."""
        dtype = self.scratch_k.dtype
        k, v = self.k[layer, block_ids].to(dtype), self.v[layer, block_ids].to(dtype)
        if self.k_scale is not None and self.v_scale is not None:
            k = k * self.k_scale[layer, block_ids].to(dtype).unsqueeze(2)  # [n, kvh, 1, bs]: per slot
            v = v * self.v_scale[layer, block_ids].to(dtype).unsqueeze(-1)  # [n, kvh, bs, 1]
        self.scratch_k[block_ids] = k
        self.scratch_v[block_ids] = v
        return self.scratch_k, self.scratch_v

    def apply_copies(self, copies: Sequence[BlockCopy]) -> None:
        """Copy-on-write: block src -> dst in every layer, elements and scales, in order."""
        tensors = [t for t in (self.k, self.v, self.k_scale, self.v_scale) if t is not None]
        for c in copies:  # one by one: a chain (a -> b, then b -> c) needs the manager's order
            for t in tensors:
                t[:, c.dst] = t[:, c.src]
