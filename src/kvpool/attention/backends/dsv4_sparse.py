"""DeepSeek-V4's sparse attention on the Classical + State pools (attention/dsv4_paged.py):
the window, the compressed entries (HCA: all visible; CSA: the indexer's top-k, through
the HiSparse hot set when the pools keep one), one softmax with the sink.

The step's metadata is its `ChunkPlan`s (one per request: positions, state slot, block
table, fresh blocks, replay), which the executor makes from the cache's reservations;
`begin_step` binds them to the pools as a `DSV4Step`, which reads and writes the pools
layer by layer. The pools' entry format (exact, or V4's fp8 serving layout) is the pools'
own: the same math reads both.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from kvpool.attention import dsv4_paged
from kvpool.attention.dsv4_ops import DSV4AttnWeights
from kvpool.attention.dsv4_paged import ChunkPlan
from kvpool.spec.dsv4 import DSV4Spec
from kvpool.storage.dsv4 import DSV4Pools


class DSV4SparseBackend:
    """V4's attention layers over `pools` (made in the model's dtype)."""

    name = "torch"

    def __init__(self, pools: DSV4Pools) -> None:
        self.pools = pools

    @property
    def dtype(self) -> torch.dtype:
        return self.pools.dtype

    def begin_step(self, chunks: Sequence[ChunkPlan]) -> DSV4Step:
        """The step over `chunks`, whose tokens the flat batch holds in this order."""
        return DSV4Step(self.pools, tuple(chunks))


class DSV4Step:
    """One step's V4 attention: `attend` per layer over the step's chunks."""

    def __init__(self, pools: DSV4Pools, chunks: tuple[ChunkPlan, ...]) -> None:
        self.pools, self.chunks = pools, list(chunks)
        self.num_tokens = sum(c.num_tokens for c in chunks)
        # [N] int64: each token's position, from its chunk's plan
        self.positions = torch.cat(
            [torch.arange(c.start, c.start + c.num_tokens) for c in chunks] or [torch.empty(0, dtype=torch.long)]
        )

    @property
    def spec(self) -> DSV4Spec:
        return self.pools.spec

    @property
    def dtype(self) -> torch.dtype:
        return self.pools.dtype

    def attend(self, layer: int, w: DSV4AttnWeights, x: Tensor) -> Tensor:
        """Attention layer `layer` (weights `w`) for the step's chunks: x [N, hidden] (the
        normed residual of the chunks' tokens in order, the weights' dtype) -> [N, hidden],
        reading and writing the pools."""
        return dsv4_paged.paged_attention(self.pools.spec, layer, w, x, self.chunks, self.pools)
