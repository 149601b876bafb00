"""The Triton backend of 8-bit quantized pools (attention/backends/triton_quant.py) and the
quantized storage's write path it drives (storage/kv.py QuantizedKVStorage.write_index),
on what a GPU would see but a CPU run cannot: host reads of device values. Each one is a
synchronisation on CUDA; issue 30 allows a step one, its sampled tokens. The kernel's
numbers: tests/test_triton_extend.py.

Reads are counted as tests/test_decode_graphs.py counts them: the Tensor methods that copy
a value to the host, wrapped. Triton's interpreter reads its CPU tensors to run a kernel
(on a GPU the compiled launch reads nothing), so the launch itself is left out of the count:
everything the backend does around it, planning and the pool's write, is in.
"""

from __future__ import annotations

import contextlib
import types

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (setup.sh test installs it)")

from kvpool.attention.backends import PagedStepMetadata, triton_extend  # noqa: E402
from kvpool.attention.backends.triton_quant import TritonQuantBackend  # noqa: E402
from kvpool.spec.kv_formats import kv_schema  # noqa: E402
from kvpool.storage.kv import QuantizedKVStorage  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
HOST_READS = ("tolist", "item", "__int__", "__float__", "__bool__", "__index__", "numpy", "cpu")
BS, KVH, HEADS, D = 16, 2, 4, 16
TABLES = {"A": [9, 3, 20, 14], "B": [5, 27, 1, 11]}
# prefills (A's last block a tail, B's too), then A's decode beside B's chunk over its
# prefix, then two decodes (A's fills its block: 48 tokens)
STEPS = ({"A": (0, 40), "B": (0, 20)}, {"A": (40, 47), "B": (20, 50)}, {"A": (47, 48), "B": (50, 51)})


def _meta(spans: dict[str, tuple[int, int]]) -> PagedStepMetadata:
    q_lens = [end - start for start, end in spans.values()]
    ctx_lens = [end for _, end in spans.values()]
    slots = [TABLES[s][p // BS] * BS + p % BS for s, (start, end) in spans.items() for p in range(start, end)]
    covering = [TABLES[s][: -(-end // BS)] for s, (_, end) in spans.items()]
    indptr = [0]
    for t in covering:
        indptr.append(indptr[-1] + len(t))
    return PagedStepMetadata(q_lens, ctx_lens, slots, indptr, [b for t in covering for b in t])


@contextlib.contextmanager
def _counting(monkeypatch: pytest.MonkeyPatch, reads: list[str]):
    """Every host read of a tensor value appended to `reads` by its method's name."""
    with monkeypatch.context() as m:
        for name in HOST_READS:
            original = getattr(torch.Tensor, name)

            def counted(self, *args, _name=name, _original=original, **kwargs):
                if not getattr(reads, "paused", False):
                    reads.append(_name)
                return _original(self, *args, **kwargs)

            m.setattr(torch.Tensor, name, counted)
        yield


class _Reads(list):
    paused = False


def _uncounted_launch(reads: _Reads):
    """triton_extend with its kernel launch outside the count (the interpreter's own reads)."""

    def extend_attention(*args, **kwargs):
        reads.paused = True
        try:
            return triton_extend.extend_attention(*args, **kwargs)
        finally:
            reads.paused = False

    return types.SimpleNamespace(
        plan_extend=triton_extend.plan_extend, QuantPages=triton_extend.QuantPages, extend_attention=extend_attention
    )


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "fp8_e4m3_token"])
def test_a_quantized_step_reads_nothing_back_from_the_device(fmt, monkeypatch) -> None:
    """Each step of the backend (its plan, the pool's write of every layer, the tails and
    scales it hands the kernel) reads no tensor value on the host: the block-scaled
    format's per-block bookkeeping takes the step's host slots. Before the fix its
    write_index read the slots tensor back (`.tolist()`: a CUDA sync every step), which
    this test saw as ["tolist"] each step; the per-token format never read."""
    pool = QuantizedKVStorage(2, 32, BS, KVH, D, kv_schema(fmt), torch.float32, device=DEVICE)
    backend = TritonQuantBackend(pool, HEADS, None, torch.float32)
    reads = _Reads()
    backend.ops = _uncounted_launch(reads)
    g = torch.Generator().manual_seed(3)
    for spans in STEPS:
        meta = _meta(spans)
        n = len(meta.slots)
        qkv = [torch.randn(n, h, D, generator=g).to(DEVICE) for h in (HEADS, KVH, KVH)]
        reads.clear()
        with _counting(monkeypatch, reads):
            step = backend.begin_step(meta)
            outs = [step.attend(layer, *qkv) for layer in range(2)]
        assert reads == [], spans
        assert all(o.shape == (n, HEADS, D) and bool(o.isfinite().all()) for o in outs)
    assert pool.num_tails > 0 or fmt != "fp8_e4m3"  # the block-scaled tails were in play


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "fp8_e5m2", "kivi2-g8-r16"])
def test_write_index_from_host_slots_equals_the_one_read_from_the_tensor(fmt) -> None:
    """The naive twin: the same steps through two pools, one indexing from the tensor's
    values, one from the host slots: every index tensor equal, the pools' bytes equal after
    each write. (KIVI's window takes the sequences' spans too; they are the same for both.)"""
    from kvpool.storage.kv import SeqSpan

    pools = [QuantizedKVStorage(1, 32, BS, KVH, D, kv_schema(fmt), torch.float32, device=DEVICE) for _ in range(2)]
    g = torch.Generator().manual_seed(5)
    for spans in STEPS:
        meta = _meta(spans)
        slots = torch.tensor(meta.slots, dtype=torch.long, device=DEVICE)
        seqs = [SeqSpan(TABLES[s], start, end) for s, (start, end) in spans.items()]
        seqs_arg = seqs if pools[0].window else None
        read = pools[0].write_index(slots, seqs_arg)
        given = pools[1].write_index(slots, seqs_arg, host_slots=meta.slots)
        for field, x, y in zip(read._fields, read, given, strict=True):
            assert _same(x, y), field
        k, v = (torch.randn(len(meta.slots), KVH, D, generator=g).to(DEVICE) for _ in range(2))
        for pool, index in zip(pools, (read, given), strict=True):
            pool.write(0, index, k, v)
        for name in ("k", "v", "tail_k", "tail_v", "k_scale", "v_scale", "k_zero", "v_zero"):
            a, b = getattr(pools[0], name), getattr(pools[1], name)
            assert (a is None and b is None) or torch.equal(a, b), name


def _same(x, y) -> bool:
    """Equal index fields: tensors by value, named tuples (KIVI's fresh WriteIndex) field by field."""
    if isinstance(x, torch.Tensor):
        return isinstance(y, torch.Tensor) and torch.equal(x, y)
    if isinstance(x, tuple):
        return type(x) is type(y) and all(_same(a, b) for a, b in zip(x, y, strict=True))
    return x == y


def test_host_slots_of_another_length_are_refused() -> None:
    pool = QuantizedKVStorage(1, 8, BS, KVH, D, kv_schema("fp8_e4m3"), torch.float32, device=DEVICE)
    with pytest.raises(ValueError, match="3 host slots for a step of 2 slots"):
        pool.write_index(torch.tensor([0, 1], device=DEVICE), host_slots=[0, 1, 2])
