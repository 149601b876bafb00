"""Every model's one forward: `forward(token_ids, positions, metadata)`, each layer's
attention through the step a backend made of hand-written cache tables (no runner, no
cache manager), against the model's contiguous reference, in fp64 (the paged math is
the reference's math over gathered rows: only summation order differs, ~1e-15 relative).
Then what the metadata may select (logit rows) and what it refuses (one-line errors)."""

from __future__ import annotations

import inspect

import pytest
import torch

from kvpool.attention.backends import (
    DSV4SparseBackend,
    GroupTable,
    HybridChunk,
    PagedStepMetadata,
    StepMetadata,
    function_step,
)
from kvpool.attention.backends.torch_paged import TorchPagedBackend
from kvpool.attention.dsv4_paged import ChunkPlan
from kvpool.attention.reference import reference_logits
from kvpool.engine.hybrid_runner import attention_for
from kvpool.models.llama import LlamaModel
from kvpool.models.tiny_dsv4 import SMALL_DSV4_CONFIG, TinyDSV4
from kvpool.models.tiny_hybrid import TINY_GEMMA2, TINY_RECURRENT, TinyHybrid
from kvpool.storage.dsv4 import DSV4Pools
from kvpool.storage.kv import PagedKVStorage
from random_llama import CONFIG, random_ids, random_llama

TOL = 1e-10  # fp64: the paged and contiguous paths differ by summation order only


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and float((a - b).abs().max()) <= TOL * max(1.0, float(b.abs().max()))


def test_the_three_models_share_one_signature() -> None:
    for model in (LlamaModel, TinyHybrid, TinyDSV4):
        assert list(inspect.signature(model.forward).parameters)[:4] == ["self", "token_ids", "positions", "metadata"]
        assert not hasattr(model, "forward_paged")


def test_llama_paged_steps_equal_the_contiguous_reference() -> None:
    """Two sequences on scattered blocks of 4 tokens: a prefill step, then a step with a
    decode and a chunk that continues mid-block, through the torch paged backend."""
    model = random_llama("cpu", torch.float64)
    bs = 4
    storage = PagedKVStorage(CONFIG.num_layers, 12, bs, CONFIG.num_kv_heads, CONFIG.head_dim, torch.float64)
    backend = TorchPagedBackend(storage, CONFIG.num_heads, None, torch.float64, decode_path="padded")
    a, b = random_ids(8, 1), random_ids(9, 2)
    tables = {"a": [9, 2], "b": [5, 0, 7]}

    def run(chunks: list[tuple[str, int, int]], logit_rows=None) -> torch.Tensor:
        """chunks: (sequence, start, end); the step's logits."""
        ids, pos, slots, indptr, indices = [], [], [], [0], []
        for name, start, end in chunks:
            seq, table = (a if name == "a" else b), tables[name]
            ids += seq[start:end]
            pos += range(start, end)
            slots += [table[p // bs] * bs + p % bs for p in range(start, end)]
            indices += table[: -(-end // bs)]
            indptr.append(len(indices))
        q_lens = [end - start for _, start, end in chunks]
        meta = PagedStepMetadata(q_lens, [end for *_, end in chunks], slots, indptr, indices)
        step = backend.begin_step(meta)
        return model.forward(torch.tensor(ids), torch.tensor(pos), StepMetadata(step, logit_rows), fused=False)

    first = run([("a", 0, 7), ("b", 0, 5)])
    ref_a, ref_b = reference_logits(model, a), reference_logits(model, b)
    assert close(first, torch.cat([ref_a[:7], ref_b[:5]]))
    second = run([("a", 7, 8), ("b", 5, 9)], logit_rows=[0, 4])  # a's decode, b's last token
    assert close(second, torch.stack([ref_a[7], ref_b[8]]))


def _hybrid_run(model: TinyHybrid, attention, chunks, tables, slots, checkpoints=None, logit_rows=None):
    """chunks: (sequence ids, start, end); tables: name -> block ids (every group the same
    ids in its own pool); slots: name -> live state slot."""
    window = model.window
    items, ids, pos = [], [], []
    for name, seq, start, end in chunks:
        group_tables = {}
        for group in model.attention_groups():
            read_start = max(0, start - window + 1) if group == "window" else 0
            group_tables[group] = GroupTable(0, tables[name], read_start)
        marks = tuple((checkpoints or {}).get(name, ()))
        items.append(HybridChunk(start, end - start, group_tables, slots.get(name), marks))
        ids += seq[start:end]
        pos += range(start, end)
    step = attention.begin_step(items)
    return model.forward(torch.tensor(ids), torch.tensor(pos), StepMetadata(step, logit_rows))


@pytest.mark.parametrize("config", [TINY_GEMMA2, TINY_RECURRENT], ids=["gemma2", "recurrent"])
def test_hybrid_steps_equal_the_contiguous_reference(config) -> None:
    """Two requests in two steps (prefill chunks, then a chunk past the window of 32 and a
    decode), through the model's backends on scattered blocks of 8; the recurrent model
    also fills a checkpoint at position 16 in step one, from which a third request restarts
    (its state copied from the checkpoint) and must continue exactly as the first."""
    model = TinyHybrid(config, seed=3, dtype=torch.float64)
    attention = attention_for(model, 16, 8, 4)
    gen = torch.Generator().manual_seed(5)
    a = torch.randint(0, model.vocab_size, (45,), generator=gen).tolist()
    b = torch.randint(0, model.vocab_size, (12,), generator=gen).tolist()
    tables = {"a": [11, 3, 14, 0, 8, 6], "b": [2, 9]}
    slots = {"a": 0, "b": 1} if model.recurrent_layers() else {}
    marks = {"a": [(16, 2)]} if slots else None
    first = _hybrid_run(model, attention, [("a", a, 0, 20), ("b", b, 0, 11)], tables, slots, marks)
    ref_a, ref_b = model.reference_logits(a), model.reference_logits(b)
    assert close(first, torch.cat([ref_a[:20], ref_b[:11]]))
    second = _hybrid_run(model, attention, [("a", a, 20, 45), ("b", b, 11, 12)], tables, slots, logit_rows=[24, 25])
    assert close(second, torch.stack([ref_a[44], ref_b[11]]))
    if slots:  # restart from the checkpoint: rows [16, 20) of a, its K/V blocks read in place
        attention.recurrent.copy_state(2, 3)
        again = _hybrid_run(model, attention, [("c", a, 16, 20)], {"c": tables["a"]}, {"c": 3})
        assert close(again, ref_a[16:20])


def test_dsv4_chunks_equal_the_contiguous_reference() -> None:
    """One request on the small V4 config (span 16): a prefill of 20 tokens (one span
    completes into block 3), then a chunk of 5; the second step's last row only."""
    model = TinyDSV4(SMALL_DSV4_CONFIG, seed=1, dtype=torch.float64)
    span = model.spec.span
    assert span == 16
    pools = DSV4Pools(model.spec, 4, 1, dtype=torch.float64)
    pools.reset_state(0)  # as the runner does when it admits a request to the slot
    backend = DSV4SparseBackend(pools)
    ids = torch.randint(0, model.vocab_size, (25,), generator=torch.Generator().manual_seed(2)).tolist()
    ref = model.reference_logits(ids)
    step = backend.begin_step([ChunkPlan(0, 20, 0, (), (3,))])
    first = model.forward(torch.tensor(ids[:20]), torch.arange(20), StepMetadata(step))
    assert close(first, ref[:20])
    step = backend.begin_step([ChunkPlan(20, 5, 0, (3,), ())])
    second = model.forward(torch.tensor(ids[20:]), torch.arange(20, 25), StepMetadata(step, [4]))
    assert close(second, ref[24:25])


def test_no_logit_rows_computes_no_head() -> None:
    model = random_llama("cpu", torch.float64)
    out = model.forward(torch.tensor([1, 2, 3]), torch.arange(3), function_step(lambda i, q, k, v: q, 3, []))
    assert out.shape == (0, CONFIG.vocab_size)


@pytest.mark.parametrize(
    "rows", [None, [], [3], [0, 1, 2, 3, 4, 5, 6], [6, 0, 6, 2], (1, 5), range(2, 7), list(range(7))[::-1]]
)
def test_logit_hidden_takes_the_rows_indexing_takes(rows) -> None:
    # the forward's rows for the LM head (one index_select over them as an int64 tensor):
    # its twin is hidden[rows], the list indexing itself, bit for bit, for any sequence of
    # rows (repeats, any order, none) and for None (every row: hidden itself)
    hidden = torch.randn(7, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    out = StepMetadata(function_step(lambda i, q, k, v: q, 7).attention, rows).logit_hidden(hidden)
    if rows is None:
        assert out is hidden
    else:
        twin = hidden[list(rows)]
        assert out.shape == twin.shape == (len(rows), 5) and torch.equal(out, twin)


def test_bad_metadata_is_a_one_line_error() -> None:
    model = random_llama("cpu", torch.float64)
    with pytest.raises(ValueError, match=r"token ids of shape \(3,\).*planned for 4 tokens"):
        model.forward(torch.tensor([1, 2, 3]), torch.arange(3), function_step(lambda i, q, k, v: q, 4))
    dsv4 = TinyDSV4(SMALL_DSV4_CONFIG, dtype=torch.float64)
    step = DSV4SparseBackend(DSV4Pools(dsv4.spec, 2, 1, dtype=torch.float64)).begin_step([ChunkPlan(0, 2, 0, ())])
    with pytest.raises(ValueError, match=r"positions \[5, 6\] are not those of the step's chunks"):
        dsv4.forward(torch.tensor([1, 2]), torch.tensor([5, 6]), StepMetadata(step))
    with pytest.raises(TypeError, match="V4's sparse attention, got FunctionStep"):
        dsv4.forward(torch.tensor([1, 2]), torch.arange(2), function_step(lambda i, q, k, v: q, 2))
    hybrid = TinyHybrid(TINY_GEMMA2, dtype=torch.float64)
    with pytest.raises(TypeError, match="its hybrid attention, got DSV4Step"):
        hybrid.forward(torch.tensor([1, 2]), torch.arange(2), StepMetadata(step))
