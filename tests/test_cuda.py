"""The tiers' copies on a GPU: blocks saved to and loaded from pinned host memory on the
runner's copy stream, ordered against compute by events, give the logits of a device hit;
preemption by swap and the disk tier through the same path. A random small Llama on the
GPU (no GGUF needed). Skipped without CUDA; KVPOOL_TEST_DEVICE=cpu runs the same
scenarios on the CPU path."""

from __future__ import annotations

import os

import pytest
import torch

from kvpool.engine.engine import Engine
from kvpool.engine.llama_runner import llama_runner
from kvpool.engine.runner import ModelRunner
from kvpool.engine.sampling import SamplingParams
from kvpool.models.llama import LlamaModel
from kvpool.tiers import DiskTier, HostTier
from random_llama import DESCRIPTOR, random_ids, random_llama

DEVICE = os.environ.get("KVPOOL_TEST_DEVICE", "cuda")
pytestmark = pytest.mark.skipif(
    DEVICE == "cuda" and not torch.cuda.is_available(), reason="needs a CUDA GPU (KVPOOL_TEST_DEVICE=cpu: CPU path)"
)


@pytest.fixture(scope="module")
def model() -> LlamaModel:
    return random_llama(DEVICE)


_ids = random_ids


def _engine(model, num_blocks: int, **kw) -> tuple[Engine, ModelRunner]:
    runner = llama_runner(model, num_blocks, 16, DESCRIPTOR, **kw)
    return Engine(runner, max_num_batched_tokens=256, max_num_seqs=4, record_logits=True), runner


def _serve(engine, runner, prompts, max_tokens=3):
    out = []
    for i, prompt in enumerate(prompts):
        rid = engine.add_request(prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True), f"r{i}")
        while engine.has_unfinished():
            engine.step()
            runner.check_integrity()
        out.append((engine.output(rid).num_cached_tokens, torch.stack(engine.requests[rid].seqs[0].logits).cpu()))
    return out


def test_host_tier_loads_on_the_copy_stream_equal_a_device_hit(model) -> None:
    p = _ids(8 * 16, 1)
    prompts = [p + [3], _ids(9 * 16 + 5, 2), p + _ids(10, 3)]  # the filler pushes part of p out
    tier = HostTier(1 << 26)
    engine, runner = _engine(model, 12, host_tier=tier)
    small = _serve(engine, runner, prompts)
    big_engine, big_runner = _engine(model, 64)
    large = _serve(big_engine, big_runner, prompts)
    assert (runner.executor._copy_stream is not None) == (DEVICE == "cuda")
    assert small[2][0] == large[2][0] == 128  # all of p: device + host, and device
    assert 0 < runner.tier_moves.num_loaded < 8 and runner.tier_moves.num_offloaded > 0
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(small, large, strict=True))
    entry = next(iter(tier._entries.values()))
    assert entry.tensors["k"].is_pinned() == (DEVICE == "cuda")  # page-locked for asynchronous copies


def test_swap_on_the_copy_stream_finishes_every_request_exactly(model) -> None:
    prompts = [_ids(20 + i, 10 + i) for i in range(4)]
    engine, runner = _engine(model, 10, host_tier=HostTier(1 << 26), preemption="swap")
    ids = [
        engine.add_request(p, SamplingParams(max_tokens=30, ignore_eos=True), f"s{i}") for i, p in enumerate(prompts)
    ]
    while engine.has_unfinished():
        engine.step()
        runner.check_integrity()
    assert runner.tier_moves.num_swapped_out > 0 and runner.tier_moves.num_swapped_in > 0
    assert runner.cache.num_free_blocks == 10  # nothing held once every request finished
    big_engine, big_runner = _engine(model, 64)
    for i, rid in enumerate(ids):
        seq = engine.requests[rid].seqs[0]
        ref_id = big_engine.add_request(prompts[i], SamplingParams(max_tokens=30, ignore_eos=True), f"b{i}")
        while big_engine.has_unfinished():
            big_engine.step()
        ref = big_engine.requests[ref_id].seqs[0]
        assert seq.token_ids == ref.token_ids
        got, want = torch.stack(seq.logits).cpu(), torch.stack(ref.logits).cpu()
        assert (got - want).abs().max().item() <= 1e-9  # fp64: recomputed and swapped KV alike


def test_disk_tier_through_the_copy_path_equals_a_device_hit(model, tmp_path) -> None:
    p = _ids(6 * 16, 4)
    first, first_runner = _engine(model, 16, persistent_tiers=[DiskTier(tmp_path, 1 << 30)])
    _serve(first, first_runner, [p + [5]])
    first_runner.close()
    second, second_runner = _engine(model, 16, persistent_tiers=[DiskTier(tmp_path, 1 << 30)])
    got = _serve(second, second_runner, [p + _ids(7, 6)])
    device, device_runner = _engine(model, 64)
    ref = _serve(device, device_runner, [p + [5], p + _ids(7, 6)])
    assert got[0][0] == ref[1][0] == 96 and second_runner.tier_moves.num_loaded == 6
    assert torch.equal(got[0][1], ref[1][1])
    second_runner.close()


@pytest.mark.skipif(DEVICE != "cuda", reason="a CUDA stream to slow down")
def test_a_slow_copy_stream_is_waited_for_never_raced(model) -> None:
    """The copy stream is kept busy for ~0.1 s before every save and load. A fresh engine
    loads a whole prefix from a host tier another engine filled, into blocks that were never
    written, and nothing else in its step syncs with the copy stream: were compute not
    ordered after the load, attention would read zeros; were the host not ordered after a
    save, the tier would keep bytes not yet copied out."""

    def slowly(executor, name: str) -> None:
        copy, stream = getattr(executor, name), executor._copy_stream

        def run(*args):
            with torch.cuda.stream(stream):
                torch.cuda._sleep(200_000_000)  # GPU cycles, about 0.1 s on the copy stream
            return copy(*args)

        setattr(executor, name, run)

    p = _ids(8 * 16, 1)
    tier = HostTier(1 << 26)
    writer, writer_runner = _engine(model, 12, host_tier=tier)
    slowly(writer_runner.executor, "_gather")
    _serve(writer, writer_runner, [p + [3], _ids(12 * 16 - 4, 2)])  # a filler of the whole pool: all of p out
    prompt = p + _ids(10, 3)
    # a first reader warms the pinned-memory cache: a fresh cudaHostAlloc for the staging
    # would wait for the whole device, and hide a missing wait
    warm, warm_runner = _engine(model, 64, host_tier=tier)
    _serve(warm, warm_runner, [prompt])
    reader, runner = _engine(model, 64, host_tier=tier)
    slowly(runner.executor, "to_device")
    slow = _serve(reader, runner, [prompt])
    device, device_runner = _engine(model, 64)
    fast = _serve(device, device_runner, [p + [3], prompt])
    assert runner.tier_moves.num_loaded == 8 and runner.tier_moves.num_offloaded == 0
    assert slow[0][0] == fast[1][0] == 128 and torch.equal(slow[0][1], fast[1][1])
