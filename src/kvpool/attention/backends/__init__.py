"""Attention backends: one module per way of computing attention over a kind of cache
storage, chosen once by a runner through the plain dict `BACKENDS`.

Key: `BackendKey(kind, format, device, impl)`:
- kind: the attention kind: "full" (every earlier position), "window" (the last W),
  "recurrent" (a state updated per token), "dsv4-sparse" (DeepSeek-V4's window +
  compressed entries);
- format: the storage the backend reads: "paged" (storage/kv.py PagedKVStorage, the
  model's dtype), "paged-q8" (QuantizedKVStorage whose 8-bit codes with fp32 scales a
  kernel reads in place: on the CPU the C kernel, `reads_natively`; on CUDA the Triton
  kernel, `reads_in_place`), "paged-quantized" (any other QuantizedKVStorage),
  "slots" (a token-slot pool, the hybrid models), "state" (recurrent state slots),
  "dsv4-exact" / "dsv4-fp8" (storage/dsv4.py DSV4Pools in the model's dtype, or in V4's
  fp8 serving layout);
- device: the torch device type ("cpu", "cuda");
- impl: the implementation, where a (kind, format, device) has more than one (the CPU
  decode paths "native", "bags", "padded"; "triton", the Triton kernels on CUDA).

`select_backend` returns the key it chose and the class; a runner builds the backend once,
at construction. The interface, what every backend offers the runner and the model:

    runner, once       backend = select_backend(kind, format, device, impl).backend(...)
    runner, each step  step = backend.begin_step(tables)   the cache's tables for the step
    model, each step   model.forward(token_ids [N], positions [N], StepMetadata(step, logit_rows))
    model, each layer  step.attend(layer, ...) / step.update(layer, ...)   (step.py's table)

`begin_step` takes the step's tables in the kind's own form: `PagedStepMetadata` (CSR block
tables, slots, lengths) for the paged pool, `HybridChunk`s (each group's table, the state
slot and checkpoints) for the hybrid models' `HybridAttention`, `ChunkPlan`s for V4's
pools. Its step has `num_tokens` (the N it was planned for) and the per-layer calls of its
kind; it reads and writes the cache, and the model never sees a table, a slot or a pool
(step.py). A combination with no entry is a ValueError naming it and listing what exists.

The modules: step.py (`StepMetadata`, the models' third argument), paged_step.py (the
paged pool's metadata and step), native.py (the C CPU kernels), torch_paged.py (the torch
bag and padded paths), quant.py (the quantized pool: the C kernel on 8-bit codes, or
dequantize then torch), triton_paged.py (the Triton kernels of triton_decode.py and
triton_extend.py on a CUDA pool; an interpreted CPU pool in tests), triton_quant.py
(triton_extend.py's kernel on an 8-bit quantized CUDA pool), dsv4_sparse.py (V4's sparse
attention), slot_attention.py (the hybrid models' full and window attention),
recurrent.py (the gated delta rule's state update), hybrid.py (those two bound to a
hybrid model's layers).

A GPU backend is an entry here and a module beside these: e.g. a CUDA/Triton paged
attention registers `BackendKey("full", "paged", "cuda", "triton")`, a class with the same
constructor as `TorchPagedBackend` (paged_step.py `PagedBackend`) whose
`begin_step(PagedStepMetadata)` returns a `PagedStep` (its `attend(layer, q, k, v)`, which
writes the layer's K/V and returns its attention, and the byte figures the memory ledger
reads), and a first place in `PREFERRED` for ("full", "paged", "cuda"); neither the
runners nor the models change: they never look inside a backend's plan.
"""

from __future__ import annotations

from typing import NamedTuple

from kvpool.attention.backends.dsv4_sparse import DSV4SparseBackend, DSV4Step
from kvpool.attention.backends.hybrid import GroupTable, HybridAttention, HybridChunk, HybridStep
from kvpool.attention.backends.native import NativeBackend
from kvpool.attention.backends.paged_step import PagedStep, PagedStepMetadata
from kvpool.attention.backends.quant import DequantBackend, QuantNativeBackend
from kvpool.attention.backends.recurrent import RecurrentBackend
from kvpool.attention.backends.slot_attention import AttnPlan, SlotAttentionBackend
from kvpool.attention.backends.step import FunctionStep, StepMetadata, function_step
from kvpool.attention.backends.torch_paged import TorchPagedBackend
from kvpool.attention.backends.triton_paged import TritonPagedBackend, triton_importable
from kvpool.attention.backends.triton_quant import TritonQuantBackend
from kvpool.storage.kv import PagedKVStorage, QuantizedKVStorage

__all__ = [
    "BACKENDS",
    "BackendChoice",
    "PREFERRED",
    "AttnPlan",
    "BackendKey",
    "DSV4SparseBackend",
    "DSV4Step",
    "FunctionStep",
    "GroupTable",
    "HybridAttention",
    "HybridChunk",
    "HybridStep",
    "PagedStep",
    "PagedStepMetadata",
    "RecurrentBackend",
    "SlotAttentionBackend",
    "StepMetadata",
    "TritonPagedBackend",
    "TritonQuantBackend",
    "function_step",
    "paged_format",
    "select_backend",
]


class BackendKey(NamedTuple):
    kind: str
    format: str
    device: str
    impl: str


BACKENDS: dict[BackendKey, type] = {
    BackendKey("full", "paged", "cpu", "native"): NativeBackend,
    BackendKey("full", "paged", "cpu", "bags"): TorchPagedBackend,
    BackendKey("full", "paged", "cpu", "padded"): TorchPagedBackend,
    BackendKey("full", "paged", "cuda", "triton"): TritonPagedBackend,
    BackendKey("full", "paged", "cuda", "bags"): TorchPagedBackend,
    BackendKey("full", "paged", "cuda", "padded"): TorchPagedBackend,
    BackendKey("full", "paged-q8", "cpu", "native"): QuantNativeBackend,
    BackendKey("full", "paged-q8", "cpu", "bags"): DequantBackend,
    BackendKey("full", "paged-q8", "cpu", "padded"): DequantBackend,
    BackendKey("full", "paged-q8", "cuda", "triton"): TritonQuantBackend,
    BackendKey("full", "paged-q8", "cuda", "bags"): DequantBackend,
    BackendKey("full", "paged-q8", "cuda", "padded"): DequantBackend,
    BackendKey("full", "paged-quantized", "cpu", "native"): DequantBackend,
    BackendKey("full", "paged-quantized", "cpu", "bags"): DequantBackend,
    BackendKey("full", "paged-quantized", "cpu", "padded"): DequantBackend,
    BackendKey("full", "paged-quantized", "cuda", "bags"): DequantBackend,
    BackendKey("full", "paged-quantized", "cuda", "padded"): DequantBackend,
    BackendKey("full", "slots", "cpu", "gather"): SlotAttentionBackend,
    BackendKey("window", "slots", "cpu", "gather"): SlotAttentionBackend,
    BackendKey("recurrent", "state", "cpu", "delta-rule"): RecurrentBackend,
    BackendKey("dsv4-sparse", "dsv4-exact", "cpu", "torch"): DSV4SparseBackend,
    BackendKey("dsv4-sparse", "dsv4-fp8", "cpu", "torch"): DSV4SparseBackend,
}

# (kind, format, device) -> its implementations, best first, for a runner given no impl;
# "native" needs the C kernels and "triton" needs triton: each is passed over without them. A combination missing
# here has one implementation: the only entry of BACKENDS.
PREFERRED: dict[tuple[str, str, str], tuple[str, ...]] = {
    ("full", "paged", "cpu"): ("native", "bags"),
    ("full", "paged", "cuda"): ("triton", "bags"),
    ("full", "paged-q8", "cpu"): ("native", "bags"),
    ("full", "paged-q8", "cuda"): ("triton", "bags"),
    ("full", "paged-quantized", "cpu"): ("native", "bags"),
    ("full", "paged-quantized", "cuda"): ("bags",),
}

NEEDS_KERNELS = ("native",)  # implementations that run the C kernels (kvpool.kernels)
NEEDS_TRITON = ("triton",)  # implementations that run Triton kernels


def paged_format(storage: PagedKVStorage | QuantizedKVStorage) -> str:
    """The format key of a paged pool (see the module docstring)."""
    if isinstance(storage, PagedKVStorage):
        return "paged"
    in_place = storage.reads_natively if storage.k.device.type == "cpu" else storage.reads_in_place
    return "paged-q8" if in_place else "paged-quantized"


class BackendChoice(NamedTuple):
    key: BackendKey  # with the implementation chosen
    backend: type  # the class to build


def select_backend(
    kind: str, format: str, device: str, impl: str | None = None, *, has_kernels: bool = False
) -> BackendChoice:
    """The backend for (kind, format, device) and implementation `impl` (None: the first of
    PREFERRED this process can run; has_kernels: the C kernels built; triton: whether it
    imports). ValueError naming the combination and listing those that exist when there is none."""
    if impl is None:
        preferred = PREFERRED.get((kind, format, device))
        if preferred is not None:
            has_triton = triton_importable()
            impl = next(
                (
                    i
                    for i in preferred
                    if (has_kernels or i not in NEEDS_KERNELS) and (has_triton or i not in NEEDS_TRITON)
                ),
                None,
            )
        else:
            impls = [k.impl for k in BACKENDS if (k.kind, k.format, k.device) == (kind, format, device)]
            impl = impls[0] if len(impls) == 1 else None
    key = BackendKey(kind, format, device, impl or "?")
    backend = BACKENDS.get(key)
    if backend is None:
        have = ", ".join("/".join(k) for k in BACKENDS)
        raise ValueError(
            f"no attention backend for kind {kind!r}, storage format {format!r}, device {device!r}, "
            f"implementation {impl!r}; the backends are (kind/format/device/impl): {have}"
        )
    if key.impl in NEEDS_KERNELS and not has_kernels:
        raise ValueError(f"the {key.impl!r} attention backend for {kind}/{format}/{device} needs the CPU kernels")
    return BackendChoice(key, backend)
