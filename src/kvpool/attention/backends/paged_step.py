"""A paged step's metadata and plan, shared by the backends of the paged K^T block pool.

The runner hands a backend `PagedStepMetadata` (what the cache manager's step tables say);
the backend turns it into the attention plan (`attention/paged.py` `plan_step`) once for
the step, and into the `PagedStep` whose `attend(layer, q, k, v)` the model calls for
every layer (as `StepMetadata.attention`, step.py). A backend that can also read a decode
step from the persistent step buffers (torch_paged.py, triton_paged.py) has
`begin_decode(buffers, num_seqs) -> BufferedStep`: nothing planned on the host.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from kvpool.attention.backends.step import Attend
from kvpool.attention.paged import StepPlan, plan_step


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
    """What a backend made of one step: the plan, the attend the model calls, the path the
    step's decodes took (None: no decode), and for the memory ledger (engine/memory.py
    `StepPeaks`) the bytes of the plan's tensors and of the largest prefill chunk's
    gathered keys and values."""

    plan: StepPlan
    attend: Attend  # write the layer's K/V into the pool, then attend over each sequence's blocks
    decode_path: str | None
    table_bytes: int
    prefill_bytes: int

    @property
    def num_tokens(self) -> int:
        """The step's N tokens (one slot each)."""
        return self.plan.slots.shape[0]


@dataclass(frozen=True)
class BufferedStep:
    """A decode step whose attention reads every step value (slots, table rows, context
    lengths) from the runner's persistent step buffers (step_buffers.py), none from the
    host: a backend's `begin_decode(buffers, num_seqs)`, what a CUDA graph captures.
    num_tokens: the step's rows, one token a sequence (a graph's bucket, padding included)."""

    attend: Attend
    num_tokens: int


def make_step(plan: StepPlan, attend: Attend, block_size: int, num_kv_heads: int, head_dim: int, dtype) -> PagedStep:
    """A `PagedStep` of `plan` (attention/paged.py), its byte figures computed."""
    tables = [plan.slots]
    if plan.decode is not None:
        d = plan.decode
        tables += [d.rows] + ([d.native.indptr, d.native.blocks, d.native.ctx_lens] if d.native else [])
        if d.bias is not None:
            tables.append(d.bias)
        if d.past is not None:
            tables.append(d.past)
        if d.bags is not None:
            b = d.bags
            tables += [t for t in (b.k_rows, b.k_offsets, b.q_rows, b.v_rows, b.v_offsets, b.p_index) if t is not None]
        if d.padded is not None:
            tables.append(d.padded.block_ids)
    tables += [p.block_ids for p in plan.prefills] + [p.mask for p in plan.prefills if p.mask is not None]
    # prefill_attention gathers one layer's K and V blocks of a chunk's context: the two
    # gathered tensors and the intermediate copy of one of them are alive together; SDPA
    # turns a chunk's boolean mask [q_len, ctx] into an fp32 one (measured with the torch
    # profiler: one aten::where of q_len x ctx x 4 B)
    per_copy = block_size * num_kv_heads * head_dim * dtype.itemsize
    prefill = [
        3 * p.block_ids.shape[0] * per_copy + (p.mask.numel() * 4 if p.mask is not None else 0) for p in plan.prefills
    ]
    return PagedStep(plan, attend, taken_path(plan), sum(t.nbytes for t in tables), max(prefill, default=0))


class PagedBackend:
    """What the paged full-attention backends share (native.py, torch_paged.py, quant.py):
    the registry's constructor, the step's plan (attention/paged.py `plan_step`, built once
    and read by every layer) and its PagedStep. A subclass names its `default_decode_path`,
    refuses what it cannot run in `_check` and builds each step's attend in `begin_step`."""

    default_decode_path: str  # the decode path when the constructor is given none

    def __init__(
        self,
        storage,
        num_heads: int,
        kernels,
        dtype: torch.dtype,
        before_read: Callable[[], None] | None = None,
        *,
        decode_path: str | None = None,
    ) -> None:
        """storage: the pool; num_heads: query heads; kernels: the C kernels or None;
        dtype: the compute dtype; before_read: called before the step first reads the pool
        (on CUDA the compute stream waits there for the tier loads in flight);
        decode_path: how the step's decodes read the pool (None: `default_decode_path`).
        ValueError (from `_check`) when this backend cannot run it on `storage`, or when
        num_heads is not a positive multiple of the pool's KV heads (each KV head serves a
        group of query heads: 3 heads over 2 KV heads read a head past the pool's in the
        bags decode, and left one head unwritten in the Triton decode, silently)."""
        kvh = storage.num_kv_heads
        if isinstance(num_heads, bool) or not isinstance(num_heads, int) or num_heads < 1 or num_heads % kvh:
            raise ValueError(f"num_heads must be a positive multiple of the pool's {kvh} KV heads, got {num_heads!r}")
        if decode_path is None:
            decode_path = self.default_decode_path
        self._check(storage, kernels, decode_path)
        self.name = self.decode_path = decode_path  # its registry name; how its plans decode
        self.storage, self.num_heads, self.kernels, self.dtype = storage, num_heads, kernels, dtype
        self.before_read = before_read
        self.scale = storage.head_dim**-0.5

    def _check(self, storage, kernels, decode_path: str) -> None:
        """ValueError naming what is missing when this backend cannot decode by
        `decode_path` on `storage` with `kernels` (None: no C kernels)."""
        raise NotImplementedError

    def _plan(self, meta: PagedStepMetadata) -> StepPlan:
        st = self.storage
        return plan_step(
            meta.q_lens,
            meta.ctx_lens,
            meta.slots,
            meta.indptr,
            meta.indices,
            st.block_size,
            self.num_heads,
            st.num_kv_heads,
            st.head_dim,
            st.k.device,
            self.dtype,
            self.decode_path,
            self.kernels,
        )

    def _step(self, plan: StepPlan, attend: Attend) -> PagedStep:
        st = self.storage
        return make_step(plan, attend, st.block_size, st.num_kv_heads, st.head_dim, self.dtype)


def taken_path(plan: StepPlan) -> str | None:
    """The decode path a plan's decodes take: "native", "bags", "padded", or None."""
    d = plan.decode
    if d is None:
        return None
    return "native" if d.native is not None else "bags" if d.bags is not None else "padded"
