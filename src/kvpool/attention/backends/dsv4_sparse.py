"""DeepSeek-V4's sparse attention on the Classical + State pools (attention/dsv4_paged.py):
the window, the compressed entries (HCA: all visible; CSA: the indexer's top-k, through
the HiSparse hot set when the pools keep one), one softmax with the sink.

The step's plan is its `ChunkPlan`s (one per request: positions, state slot, block table,
fresh blocks), which the runner makes from the cache's reservations; the backend reads and
writes the pools for them, layer by layer. The pools' entry format (exact, or V4's fp8
serving layout) is the pools' own: the same math reads both.
"""

from __future__ import annotations

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

    def attend(self, spec: DSV4Spec, layer_id: int, w: DSV4AttnWeights, x: Tensor, chunks: list[ChunkPlan]) -> Tensor:
        """One attention layer for the step's chunks: x [N, hidden] (the chunks' tokens in
        order, the weights' dtype) -> [N, hidden], reading and writing the pools."""
        return dsv4_paged.paged_attention(spec, layer_id, w, x, chunks, self.pools)
