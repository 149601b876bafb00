"""The C CPU kernels' paged attention (kernels/cpu.c) over an unquantized fp32 pool.

`NativeBackend` plans each step with native decodes; `NativeAttend` writes the step's K/V
into the pool and decodes straight from it in C, prefill chunks through SDPA
(attention/paged.py). The torch backends (torch_paged.py) also use `NativeAttend` for a
step without decodes when the pool has the kernels: its write is the C kernel's.
"""

from __future__ import annotations

import torch

from kvpool.attention.backends.paged_step import PagedBackend, PagedStep, PagedStepMetadata
from kvpool.attention.paged import StepPlan, paged_attention, prefill_attention
from kvpool.storage.kv import PagedKVStorage


class NativeBackend(PagedBackend):
    """Full attention on the paged fp32 CPU pool through the C kernels: every step's decodes
    by kv_decode_attention, its writes by kv_write."""

    name = "native"
    default_decode_path = "native"

    def _check(self, storage: PagedKVStorage, kernels, decode_path: str) -> None:
        # storage made with `kernels` (kvpool.kernels.cpu_kernels()), the compute dtype fp32;
        # before_read is unused (the pool is on the CPU: no loads in flight)
        if decode_path != "native":
            raise ValueError(f"the native backend decodes natively, not by {decode_path!r}")
        if storage.kernels is None or kernels is None:
            raise ValueError("the native attention backend needs the CPU kernels on an fp32 CPU pool")

    def begin_step(self, meta: PagedStepMetadata) -> PagedStep:
        plan = self._plan(meta)
        return self._step(plan, NativeAttend(self.storage, plan, self.scale))


class NativeAttend:
    """The attend of one step on the C kernels: write the step's K/V into the pool, decode
    attention straight from it, prefill chunks through SDPA (attention/paged.py).

    The fused forward hands the same q / k / v views to every layer, so they are checked
    once (through the checked kernel methods, on the first layer), and the C arguments of
    every later layer are those of layer 0 with that layer's pool addresses. The returned
    tensor is one buffer for the step, valid until the next call."""

    def __init__(self, storage: PagedKVStorage, plan: StepPlan, scale: float):
        assert storage.kernels is not None
        self.storage, self.plan, self.scale = storage, plan, scale
        self.kernels = storage.kernels
        self._bound: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self._out: torch.Tensor | None = None
        self._write_args: tuple = ()  # kv_write's arguments before the pool's two addresses
        self._attn_args: tuple[tuple, tuple] | None = None  # kv_decode_attention's, around them
        self._k_ptrs = [t.data_ptr() for t in storage.k_layers]
        self._v_ptrs = [t.data_ptr() for t in storage.v_layers]

    @property
    def out_bytes(self) -> int | None:
        """The bytes of the step's one output buffer (None before the first layer)."""
        return None if self._out is None else self._out.nbytes

    def _bind(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Check q / k / v on layer 0's pool through the checked methods (which also run it),
        then keep the C arguments that every layer shares."""
        st, plan = self.storage, self.plan
        k0, v0 = st.k_layers[0], st.v_layers[0]
        st.write_slots(0, plan.slots, k, v)
        out = torch.empty(q.shape, dtype=q.dtype)
        n, kvh, hd = k.shape
        self._write_args = (
            k.data_ptr(),
            v.data_ptr(),
            n,
            k.stride(0),
            kvh,
            hd,
            plan.slots.data_ptr(),
            st.block_size,
            st.num_blocks,
        )
        d = plan.decode
        if d is not None:
            nat = d.native
            assert nat is not None
            self.kernels.decode_attention(q, d.rows, nat.indptr, nat.blocks, nat.ctx_lens, k0, v0, self.scale, out)
            self._attn_args = (
                (
                    q.data_ptr(),
                    q.stride(0),
                    q.shape[0],
                    d.rows.data_ptr(),
                    d.num_seqs,
                    nat.indptr.data_ptr(),
                    nat.blocks.shape[0],
                    nat.blocks.data_ptr(),
                    nat.ctx_lens.data_ptr(),
                ),
                (st.num_blocks, q.shape[1], kvh, hd, st.block_size, self.scale, out.data_ptr(), out.stride(0)),
            )
        self._bound, self._out = (q, k, v), out

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        st, plan = self.storage, self.plan
        bound = self._bound
        if bound is None or bound[0] is not q or bound[1] is not k or bound[2] is not v:
            if layer != 0:  # not the fused forward's shared views: the checked path, every layer
                st.write_slots(layer, plan.slots, k, v)
                return paged_attention(q, st.k_layers[layer], st.v_layers[layer], plan, self.scale)
            self._bind(q, k, v)
        else:
            lib = self.kernels.lib
            kp, vp = self._k_ptrs[layer], self._v_ptrs[layer]
            rc = lib.kv_write(*self._write_args, kp, vp)
            assert rc == 0, "slots were checked on layer 0"
            if self._attn_args is not None:
                head, tail = self._attn_args
                rc = lib.kv_decode_attention(*head, kp, vp, *tail)
                assert rc == 0, "the plan was checked on layer 0"
        out = self._out
        assert out is not None
        for p in plan.prefills:
            out[p.rows] = prefill_attention(q[p.rows], st.k_layers[layer], st.v_layers[layer], p)
        return out
