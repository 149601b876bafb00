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

if TYPE_CHECKING:
    from kvpool.kernels import CpuKernels


class WriteIndex(NamedTuple):
    k_pos: torch.Tensor  # [N * KVH * D] int64: positions in k[layer].view(-1), (token, head, dim) order
    v_pos: torch.Tensor  # [N * KVH * D] int64: positions in v[layer].view(-1)


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
        kvh, d, bs = self.num_kv_heads, self.head_dim, self.block_size
        block_idx, offset_idx = slots // self.block_size, slots % self.block_size
        base = block_idx.view(-1, 1, 1) * kvh + torch.arange(kvh, device=block_idx.device).view(1, -1, 1)  # [N, KVH, 1]
        dims = torch.arange(d, device=block_idx.device).view(1, 1, -1)
        off = offset_idx.view(-1, 1, 1)
        # K^T [block, kvh, d, slot]: ((block * KVH + h) * D + d) * bs + slot
        k_pos = ((base * d + dims) * bs + off).reshape(-1)
        # V [block, kvh, slot, d]: ((block * KVH + h) * bs + slot) * D + d
        v_pos = ((base * bs + off) * d + dims).reshape(-1)
        return WriteIndex(k_pos, v_pos)

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
