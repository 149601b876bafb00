"""A paged step's metadata and plan, shared by the backends of the paged K^T block pool.

The runner hands a backend `PagedStepMetadata` (what the cache manager's step tables say);
the backend turns it into the attention plan (`attention/paged.py` `plan_step`) once for
the step, and into the `attend(layer, q, k, v)` the model calls for every layer.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from kvpool.attention.paged import StepPlan, plan_step

# attend(layer, q [N, H, D], k / v [N, KVH, D]) -> [N, H, D]: write the step's K/V of that
# layer into the pool, then attend over each sequence's blocks
Attend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class PagedStepMetadata:
    """One step of the paged pool, as the cache manager's step tables give it.

    Sequence i's q_lens[i] new tokens sit at positions [ctx_lens[i] - q_lens[i], ctx_lens[i]);
    its blocks are indices[indptr[i] : indptr[i + 1]] and cover its ctx_lens[i] tokens;
    slots[j] is the j-th new token's slot (block * block_size + offset)."""

    q_lens: Sequence[int]
    ctx_lens: Sequence[int]
    slots: Sequence[int]
    indptr: Sequence[int]
    indices: Sequence[int]


@dataclass
class PagedStep:
    """What a backend made of one step: the plan (for the memory ledger and reports), the
    attend the model calls, and the path the step's decodes took (None: no decode)."""

    plan: StepPlan
    attend: Attend
    decode_path: str | None


def plan_paged(
    meta: PagedStepMetadata,
    block_size: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    device: torch.device,
    dtype: torch.dtype,
    decode_path: str,
    kernels,
) -> StepPlan:
    """The step's plan (attention/paged.py `plan_step`), built once and read by every layer."""
    return plan_step(
        meta.q_lens,
        meta.ctx_lens,
        meta.slots,
        meta.indptr,
        meta.indices,
        block_size,
        num_heads,
        num_kv_heads,
        head_dim,
        device,
        dtype,
        decode_path,
        kernels,
    )


def taken_path(plan: StepPlan) -> str | None:
    """The decode path a plan's decodes take: "native", "bags", "padded", or None."""
    d = plan.decode
    if d is None:
        return None
    return "native" if d.native is not None else "bags" if d.bags is not None else "padded"
