"""Decode attention read from the persistent step buffers (attention/backends/buffered.py),
the graph-capturable form, against the torch paged backend ("padded", the plain twin) on
the same pool: fp64 outputs equal to 1e-12, the same pool after the step's writes, and a
step padded to a bucket equal on its real rows while its padding touches only the dummy
block."""

from __future__ import annotations

import pytest
import torch

from kvpool.attention.backends import PagedStepMetadata
from kvpool.attention.backends.buffered import buffered_decode_attend
from kvpool.attention.backends.step_buffers import StepBuffers
from kvpool.attention.backends.torch_paged import TorchPagedBackend
from kvpool.storage.kv import PagedKVStorage

BS, KVH, D, DUMMY = 4, 2, 8, 15


def _pool(seed: int) -> PagedKVStorage:
    storage = PagedKVStorage(2, 16, BS, KVH, D, torch.float64)
    g = torch.Generator().manual_seed(seed)
    storage.k.copy_(torch.randn(storage.k.shape, generator=g, dtype=torch.float64))
    storage.v.copy_(torch.randn(storage.v.shape, generator=g, dtype=torch.float64))
    return storage


@pytest.mark.parametrize("heads", [2, 8])  # GQA groups 1 and 4
def test_a_buffered_decode_equals_the_paged_backend_and_padding_touches_only_the_dummy_block(heads):
    # three sequences over scattered blocks, contexts not a multiple of the block size
    tables = {"a": [9, 2, 11], "b": [5], "c": [0, 7, 3]}
    ctx = {"a": 10, "b": 3, "c": 12}  # after the step: the new token at position ctx - 1
    names = list(tables)
    g = torch.Generator().manual_seed(1)
    q = torch.randn(3, heads, D, generator=g, dtype=torch.float64)
    k = torch.randn(3, KVH, D, generator=g, dtype=torch.float64)
    v = torch.randn(3, KVH, D, generator=g, dtype=torch.float64)

    # the reference: the torch paged backend's padded decode over the same tables
    ref_pool = _pool(0)
    slots = [tables[r][(ctx[r] - 1) // BS] * BS + (ctx[r] - 1) % BS for r in names]
    indptr = [0, 3, 4, 7]
    meta = PagedStepMetadata([1, 1, 1], [ctx[r] for r in names], slots, indptr, [b for r in names for b in tables[r]])
    backend = TorchPagedBackend(ref_pool, heads, None, torch.float64, decode_path="padded")
    want = [backend.begin_step(meta).attend(layer, q, k, v) for layer in range(2)]

    buffers = StepBuffers(8, 8, 4, BS, dummy_block=DUMMY)
    buffers.update(names, [ctx[r] - 1 for r in names], [ctx[r] for r in names], [tables[r] for r in names])
    pool = _pool(0)
    attend = buffered_decode_attend(pool, buffers, 3)
    got = [attend(layer, q, k, v) for layer in range(2)]
    for layer in range(2):
        torch.testing.assert_close(got[layer], want[layer], rtol=1e-12, atol=1e-12)
    assert torch.equal(pool.k, ref_pool.k) and torch.equal(pool.v, ref_pool.v)

    # padded to a bucket of 4: the real rows alike, the pool alike outside the dummy block
    padded_pool = _pool(0)
    buffers.pad(4)
    pad_q, pad_k, pad_v = (torch.cat([t, t[:1]]) for t in (q, k, v))
    attend = buffered_decode_attend(padded_pool, buffers, 4)
    for layer in range(2):
        torch.testing.assert_close(attend(layer, pad_q, pad_k, pad_v)[:3], want[layer], rtol=1e-12, atol=1e-12)
    keep = [b for b in range(16) if b != DUMMY]
    assert torch.equal(padded_pool.k[:, keep], ref_pool.k[:, keep])
    assert torch.equal(padded_pool.v[:, keep], ref_pool.v[:, keep])
    assert not torch.equal(padded_pool.k[:, DUMMY], ref_pool.k[:, DUMMY])  # the padding wrote there
