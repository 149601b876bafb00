"""Full attention on an 8-bit quantized paged pool (storage/kv.py QuantizedKVStorage whose
blocks `reads_in_place`: fp8 e4m3 / e5m2 with a scale per (block, KV head), their per-token
twins, int8) through the Triton extend kernel (triton_extend.py), which reads the codes and
scales where they lie and a block not yet full from its tail. Every sequence of a step,
prefill chunk or decode, goes through the one kernel: nothing is dequantized into a
scratch copy, so the step needs no scratch reads (the dequantizing torch path, quant.py
`DequantBackend`, rewrites every block it reads into the scratch, every layer).

Devices: a CUDA pool; or, for tests on a machine without a GPU, a CPU pool when the kernel
runs in Triton's interpreter (TRITON_INTERPRET=1 before triton's first import). Triton is
imported when the backend is built, not with the registry.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvpool.attention.backends.paged_step import PagedBackend, PagedStep, PagedStepMetadata
from kvpool.attention.backends.triton_paged import CPU_NUM_SMS, triton_importable
from kvpool.attention.paged import StepPlan
from kvpool.storage.kv import QuantizedKVStorage


class TritonQuantBackend(PagedBackend):
    """The Triton backend of an 8-bit quantized pool (module docstring); the registry's
    constructor (`kernels`, the C CPU kernels, is unused). num_sms: the split rule's SM
    count (None: the CUDA device's, CPU_NUM_SMS for an interpreted CPU pool); num_splits:
    every step's split of the keys, in place of the rule (triton_extend.plan_extend)."""

    default_decode_path = "triton"

    def __init__(
        self,
        storage: QuantizedKVStorage,
        num_heads: int,
        kernels,
        dtype: torch.dtype,
        before_read: Callable[[], None] | None = None,
        *,
        decode_path: str | None = None,
        num_sms: int | None = None,
        num_splits: int | None = None,
    ) -> None:
        super().__init__(storage, num_heads, kernels, dtype, before_read, decode_path=decode_path)
        from kvpool.attention.backends import triton_extend

        self.ops = triton_extend
        device = storage.k.device
        if num_sms is None:
            num_sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 0
            num_sms = num_sms or CPU_NUM_SMS
        if num_sms <= 0 or (num_splits is not None and num_splits < 1):
            raise ValueError(f"num_sms and num_splits must be positive, got {num_sms}, {num_splits}")
        self.num_sms, self.num_splits = num_sms, num_splits

    def _check(self, storage: QuantizedKVStorage, kernels, decode_path: str) -> None:
        if decode_path != "triton":
            raise ValueError(f"the triton quantized backend attends by its kernel, not by {decode_path!r}")
        if not isinstance(storage, QuantizedKVStorage) or not storage.reads_in_place:
            name = storage.fmt.name if isinstance(storage, QuantizedKVStorage) else type(storage).__name__
            raise ValueError(
                f"the triton quantized backend reads 8-bit codes with per-token or per-block fp32 scales, not {name}"
            )
        if not triton_importable():
            raise ValueError("the triton quantized backend needs triton (pip install triton)")
        device = storage.k.device
        if device.type == "cpu":
            from kvpool.attention.backends.triton_extend import interpreted

            if not interpreted():
                raise ValueError(
                    "the triton quantized backend on a CPU pool needs Triton's interpreter: set TRITON_INTERPRET=1 "
                    "before triton is first imported"
                )
        elif device.type != "cuda":
            raise ValueError(
                f"the triton quantized backend runs on CUDA (or interpreted on the CPU), not {device.type!r}"
            )

    def begin_step(self, meta: PagedStepMetadata) -> PagedStep:
        """Where the step's tokens are written, the kernel's tables and each table entry's
        tail (after the write index: a block this step fills is read from its codes), once
        for every layer."""
        st, scale, before_read, ops = self.storage, self.scale, self.before_read, self.ops
        device = st.k.device
        num_tokens = sum(meta.q_lens)  # (checked before the write index, which takes tails)
        if len(meta.slots) != num_tokens:
            raise ValueError(
                f"the step has {len(meta.slots)} slots for {num_tokens} new tokens (the sum of its q_lens)"
            )
        slots = torch.tensor(meta.slots, dtype=torch.long, device=device)
        index = st.write_index(slots, host_slots=meta.slots)  # the list: no read back from the device
        plan = ops.plan_extend(
            meta.q_lens,
            meta.ctx_lens,
            meta.indptr,
            meta.indices,
            st.block_size,
            self.num_heads,
            st.num_kv_heads,
            device,
            num_splits=self.num_splits or 1,
            num_sms=None if self.num_splits else self.num_sms,
        )
        tails = st.tail_slots(meta.indices).to(device, torch.int32)  # [nnz]: -1, or the entry's tail slot
        assert st.k_scale is not None and st.v_scale is not None

        def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            if layer == 0 and before_read is not None:
                before_read()  # the first read of the cache this step
            st.write(layer, index, k, v)
            quant = ops.QuantPages(st.k_scale[layer], st.v_scale[layer], st.tail_k[layer], st.tail_v[layer], tails)
            return ops.extend_attention(q, st.k_layers[layer], st.v_layers[layer], plan, scale, quant)

        table_bytes = slots.nbytes + tails.nbytes + plan.num_bytes
        has_decode = any(n == 1 for n in meta.q_lens)
        # no prefill chunk is gathered: the kernel reads every key in place
        return PagedStep(StepPlan(slots, None, []), attend, "triton" if has_decode else None, table_bytes, 0)
