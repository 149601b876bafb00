"""The plain torch paged attention (attention/paged.py): decodes through embedding_bag sums
in place ("bags") or gathered into a padded batch ("padded", the plain twin), prefill
chunks through SDPA over their gathered blocks. Any device, any unquantized dtype. A
decode step can also be read from the persistent step buffers (`begin_decode`, buffered.py).
"""

from __future__ import annotations

import torch

from kvpool.attention.backends.buffered import buffered_decode_attend
from kvpool.attention.backends.native import NativeAttend
from kvpool.attention.backends.paged_step import BufferedStep, PagedBackend, PagedStep, PagedStepMetadata
from kvpool.attention.backends.step_buffers import StepBuffers
from kvpool.attention.paged import paged_attention
from kvpool.storage.kv import PagedKVStorage

TORCH_DECODE_PATHS = ("bags", "padded")


class TorchPagedBackend(PagedBackend):
    """Full attention on the unquantized paged pool in torch ops; `decode_path` "bags" or
    "padded" chooses how decodes read the pool. before_read is called before the step first
    reads the pool (layer 0): on CUDA the compute stream waits there for the tier loads in
    flight. With the C kernels (else None), a step without decodes on a pool that has them
    writes through the C kernel (`NativeAttend`)."""

    default_decode_path = "bags"

    def _check(self, storage: PagedKVStorage, kernels, decode_path: str) -> None:
        # kernels may be None: they only write a step without decodes (`NativeAttend`)
        if decode_path not in TORCH_DECODE_PATHS:
            raise ValueError(f"the torch paged backend decodes by {TORCH_DECODE_PATHS}, got {decode_path!r}")

    def begin_step(self, meta: PagedStepMetadata) -> PagedStep:
        st, scale, before_read = self.storage, self.scale, self.before_read
        plan = self._plan(meta)
        if st.kernels is not None and plan.decode is None:
            return self._step(plan, NativeAttend(st, plan, scale))
        write_index = st.write_index(plan.slots)
        k_layers, v_layers = st.k_layers, st.v_layers

        def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            if layer == 0 and before_read is not None:
                before_read()  # the first read of the cache this step
            st.write(layer, write_index, k, v)
            return paged_attention(q, k_layers[layer], v_layers[layer], plan, scale)

        return self._step(plan, attend)

    def begin_decode(self, buffers: StepBuffers, num_seqs: int) -> BufferedStep:
        """A decode step of the first num_seqs rows of `buffers` (one token each), every
        step value read from the buffers' tensors (buffered.py): graph-capturable. The
        caller waits for the tier loads in flight first (no before_read here: a captured
        graph would replay the wait)."""
        return BufferedStep(buffered_decode_attend(self.storage, buffers, num_seqs), num_seqs)
