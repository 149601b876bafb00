"""Paged attention over a quantized pool (storage/kv.py QuantizedKVStorage).

`QuantNativeBackend`: 8-bit codes with fp32 scales (`reads_natively`) on the CPU with the C
kernels: decodes by kv_decode_attention_q8 reading the codes and scales where they lie (a
partly written block of a block-scaled format from its fp32 tail), prefill chunks through
SDPA over their blocks dequantized. `DequantBackend`: any format, any device: the step's
blocks dequantized into the compute dtype, then the plain paged attention (its decode path
"native", "bags" or "padded").
"""

from __future__ import annotations

import torch

from kvpool.attention.backends.paged_step import Attend, PagedBackend, PagedStep, PagedStepMetadata
from kvpool.attention.paged import DECODE_PATHS, StepPlan, paged_attention, prefill_attention
from kvpool.storage.kv import QuantizedKVStorage, QuantWriteIndex, SeqSpan


def _write_index(storage: QuantizedKVStorage, meta: PagedStepMetadata, plan: StepPlan) -> QuantWriteIndex:
    """Where the step's new tokens are written; KIVI moves each sequence's V window, so it
    is given their block tables and spans."""
    spans = None
    if storage.window:
        ptr, ids = meta.indptr, meta.indices
        spans = [
            SeqSpan(ids[ptr[i] : ptr[i + 1]], ctx - n, ctx)
            for i, (n, ctx) in enumerate(zip(meta.q_lens, meta.ctx_lens, strict=True))
        ]
    return storage.write_index(plan.slots, spans, host_slots=meta.slots)  # (plan.slots' list: no device read)


def _dequant_attend(
    storage: QuantizedKVStorage, meta: PagedStepMetadata, plan: StepPlan, index: QuantWriteIndex, scale: float
) -> Attend:
    """Write the new tokens quantized, then read the step's blocks as their bytes say."""
    step_blocks = torch.unique(torch.as_tensor(meta.indices, dtype=torch.long, device=storage.k.device))
    read = storage.read_index(step_blocks, index)

    def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        storage.write(layer, index, k, v)
        # KIVI: the step's own K / V exact over what the cache holds
        k_cache, v_cache = storage.dequantized(layer, read, (index, k, v))
        return paged_attention(q, k_cache, v_cache, plan, scale)

    return attend


class DequantBackend(PagedBackend):
    """Any quantized format: dequantize the step's blocks, then plain paged attention."""

    default_decode_path = "bags"

    def _check(self, storage: QuantizedKVStorage, kernels, decode_path: str) -> None:
        if decode_path not in DECODE_PATHS:
            raise ValueError(f"decode_path must be one of {DECODE_PATHS}, got {decode_path!r}")
        if decode_path == "native" and kernels is None:
            raise ValueError("decode_path 'native' needs the CPU kernels (kvpool.kernels.cpu_kernels())")

    def begin_step(self, meta: PagedStepMetadata) -> PagedStep:
        plan = self._plan(meta)
        index = _write_index(self.storage, meta, plan)
        return self._step(plan, _dequant_attend(self.storage, meta, plan, index, self.scale))


class QuantNativeBackend(DequantBackend):
    """8-bit codes with fp32 scales on the CPU: decodes by the C kernel from the codes."""

    default_decode_path = "native"

    def _check(self, storage: QuantizedKVStorage, kernels, decode_path: str) -> None:
        if decode_path != "native":
            raise ValueError(f"the quantized native backend decodes natively, not by {decode_path!r}")
        if not storage.reads_natively:
            raise ValueError(f"the C kernel does not read the {storage.fmt.name} format's blocks")
        super()._check(storage, kernels, decode_path)

    def begin_step(self, meta: PagedStepMetadata) -> PagedStep:
        plan = self._plan(meta)
        index = _write_index(self.storage, meta, plan)
        if plan.decode is None:  # prefill chunks only: dequantized, as any format
            return self._step(plan, _dequant_attend(self.storage, meta, plan, index, self.scale))
        return self._step(plan, QuantNativeAttend(self.storage, plan, index, self.scale))


class QuantNativeAttend:
    """The attend of one step over an 8-bit QuantizedKVStorage with the C kernels: write the
    step's K/V (quantized, or into the tails), decode attention by kv_decode_attention_q8,
    prefill chunks through SDPA over their blocks dequantized."""

    def __init__(self, storage: QuantizedKVStorage, plan: StepPlan, index: QuantWriteIndex, scale: float):
        d = plan.decode
        assert d is not None and d.native is not None and storage.reads_natively
        self.storage, self.plan, self.index, self.scale = storage, plan, index, scale
        self.native = d.native
        last = self.native.blocks[self.native.indptr[1:] - 1].tolist()  # each sequence's last block
        self.tails = storage.tail_slots(last)
        self.read = None
        if plan.prefills:
            blocks = torch.unique(torch.cat([p.block_ids for p in plan.prefills]))
            self.read = storage.read_index(blocks)

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        st, plan, n = self.storage, self.plan, self.native
        st.write(layer, self.index, k, v)
        out = torch.empty_like(q)
        d = plan.decode
        assert d is not None and st.k_scale is not None and st.v_scale is not None
        n.kernels.decode_attention_q8(
            q,
            d.rows,
            n.indptr,
            n.blocks,
            n.ctx_lens,
            st.k_layers[layer],
            st.v_layers[layer],
            st.k_scale[layer],
            st.v_scale[layer],
            self.tails,
            st.tail_k[layer],
            st.tail_v[layer],
            self.scale,
            out,
        )
        if self.read is not None:
            k_cache, v_cache = st.dequantized(layer, self.read)
            for p in plan.prefills:
                out[p.rows] = prefill_attention(q[p.rows], k_cache, v_cache, p)
        return out
