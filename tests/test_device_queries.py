"""The CUDA device queries kvpool makes, run on a machine without CUDA: torch.cuda's queries
replaced by a stand-in GPU (`FakeCuda`: two devices of other sizes, every call recorded) and
the code given tensors that report a CUDA device (`on_cuda`: a tensor subclass with a CUDA
device and no storage, which refuses any op, so only the device is read).

Without these, engine/memory.py's CUDA branches (the free memory `check_fits` compares a pool
with, the ledger's device peak and allocator figures, its host-memory lines kept outside the
device peak), the Triton backends' SM counts (which size every decode's split) and the GPU
bench's event timing (bench/gpu.py `_device_time`) never run:
each test compares them with exact values the stand-in set, on the device they were asked
for (cuda:1, whose figures differ from cuda:0's)."""

from __future__ import annotations

import types

import pytest
import torch

from kvpool.engine import memory
from kvpool.engine.engine import Engine
from kvpool.engine.llama_runner import llama_runner
from kvpool.engine.sampling import SamplingParams
from random_llama import DESCRIPTOR, random_ids, random_llama

GIB = 1 << 30


class FakeCuda:
    """torch.cuda's queries on two stand-in devices: cuda:0 an H100 (132 SMs, 80 GiB), cuda:1
    a smaller card (46 SMs, 24 GiB); each call recorded with its device's index."""

    SMS = {0: 132, 1: 46}
    MEMORY = {0: (71 * GIB, 80 * GIB), 1: (3 * GIB, 24 * GIB)}  # (free, total)
    STATS = {"allocated_bytes.all.peak": 5_000_000, "reserved_bytes.all.peak": 6_291_456, "num_alloc_retries": 2}

    def __init__(self, monkeypatch) -> None:
        self.calls: list[tuple[str, int | None]] = []
        monkeypatch.setattr(torch.cuda, "get_device_properties", self.get_device_properties)
        monkeypatch.setattr(torch.cuda, "mem_get_info", self.mem_get_info)
        monkeypatch.setattr(torch.cuda, "max_memory_allocated", self.max_memory_allocated)
        monkeypatch.setattr(torch.cuda, "memory_stats", self.memory_stats)

    @staticmethod
    def _index(device) -> int:
        dev = torch.device(device)
        assert dev.type == "cuda", dev
        return dev.index or 0

    def get_device_properties(self, device):
        self.calls.append(("get_device_properties", self._index(device)))
        return types.SimpleNamespace(multi_processor_count=self.SMS[self._index(device)])

    def mem_get_info(self, device=None):
        self.calls.append(("mem_get_info", self._index(device)))
        return self.MEMORY[self._index(device)]

    def max_memory_allocated(self, device=None):
        self.calls.append(("max_memory_allocated", device))
        return 4_800_000

    def memory_stats(self, device=None):
        self.calls.append(("memory_stats", device))
        return dict(self.STATS)


class _OnCuda(torch.Tensor):
    """A tensor that reports a CUDA device and holds nothing: any op on it is refused."""

    @staticmethod
    def __new__(cls, like: torch.Tensor, device: torch.device):
        return torch.Tensor._make_wrapper_subclass(cls, like.shape, dtype=like.dtype, device=device)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise AssertionError(f"{func} ran on the stand-in CUDA tensor: only its device may be read")


def on_cuda(like: torch.Tensor, index: int = 1) -> torch.Tensor:
    return _OnCuda(like, torch.device("cuda", index))


@pytest.fixture
def cuda(monkeypatch) -> FakeCuda:
    return FakeCuda(monkeypatch)


def test_the_free_memory_of_the_cuda_device_asked_for(cuda) -> None:
    """available_memory_bytes reads cudaMemGetInfo's free bytes (not the total) of the device
    named; check_fits refuses a pool over them naming the device and both sizes."""
    assert memory.available_memory_bytes("cuda:1") == 3 * GIB
    assert memory.available_memory_bytes(torch.device("cuda", 0)) == 71 * GIB
    assert cuda.calls == [("mem_get_info", 1), ("mem_get_info", 0)]
    memory.check_fits(3 * GIB, "cuda:1", "the KV pool")  # (exactly what is free fits)
    with pytest.raises(ValueError, match=r"^the KV pool needs 4\.0 GiB but cuda:1 has 3\.0 GiB of memory available; "):
        memory.check_fits(4 * GIB, "cuda:1", "the KV pool", "lower --num-blocks")
    memory.check_fits(4 * GIB, "cuda:0", "the KV pool")  # (cuda:0 has 71 GiB free)


def _served_runner():
    """A runner on the CPU after a few requests (the ledger's lines all set)."""
    runner = llama_runner(random_llama("cpu", torch.float64), 24, 4, DESCRIPTOR, decode_path="bags")
    engine = Engine(runner, max_num_batched_tokens=32, max_num_seqs=4)
    for i in range(3):
        engine.add_request(random_ids(6 + i, i), SamplingParams(max_tokens=3, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    return runner


def test_the_memory_ledger_of_a_cuda_runner(cuda, monkeypatch) -> None:
    """measure() of a runner whose pool is on CUDA: the peak is max_memory_allocated, the
    allocator's peaks are memory_stats'; the lines that live in host memory (the manager's
    bookkeeping, the sampler's scratch, the runtime, the tokenizer, the host tier) are moved
    to `host` and count 0 in the device terms; every other line is the CPU ledger's."""
    runner = _served_runner()
    on_cpu = memory.measure(runner, 7000, 300)
    assert not cuda.calls
    storage = runner.executor.storage
    monkeypatch.setattr(storage, "k", on_cuda(storage.k))
    ledger = memory.measure(runner, 7000, 300)
    assert [name for name, _ in cuda.calls] == ["max_memory_allocated", "memory_stats"]
    assert (ledger.peak, ledger.peak_source) == (4_800_000, "torch.cuda.max_memory_allocated")
    assert ledger.allocator == {"allocated_peak": 5_000_000, "reserved_peak": 6_291_456, "num_alloc_retries": 2}
    host_lines = {
        ("kv_pool", "bookkeeping"): "bookkeeping",
        ("kv_pool", "host_tier"): "host_tier",
        ("workspace", "sampler"): "sampler",
        ("runtime", "interpreter_and_libraries"): "interpreter_and_libraries",
        ("runtime", "tokenizer"): "tokenizer",
    }
    assert ledger.host == {name: on_cpu.details[term][line] for (term, line), name in host_lines.items()}
    assert ledger.host["interpreter_and_libraries"] == 7000 and ledger.host["tokenizer"] == 300
    assert ledger.host["bookkeeping"] > 0
    for term, lines in on_cpu.details.items():
        for line, num_bytes in lines.items():
            assert ledger.details[term][line] == (0 if (term, line) in host_lines else num_bytes), (term, line)
    assert ledger.accounted == on_cpu.accounted - sum(ledger.host.values())
    assert ledger.as_dict()["unaccounted"] == 4_800_000 - ledger.accounted
    assert on_cpu.host is None and on_cpu.allocator is None


def test_the_triton_backends_split_for_the_sm_count_of_their_device(cuda) -> None:
    """TritonPagedBackend and TritonQuantBackend on a pool of cuda:1 take its SM count (46,
    not cuda:0's 132), which the split rule reads; a count given is kept, nothing asked."""
    pytest.importorskip("triton")
    from kvpool.attention.backends.triton_decode import num_splits_for
    from kvpool.attention.backends.triton_paged import TritonPagedBackend
    from kvpool.attention.backends.triton_quant import TritonQuantBackend
    from kvpool.spec.kv_formats import kv_schema
    from kvpool.storage.kv import PagedKVStorage, QuantizedKVStorage

    paged = PagedKVStorage(1, 4, 16, 2, 32, torch.float32)
    quant = QuantizedKVStorage(1, 4, 16, 2, 32, kv_schema("fp8_e4m3"), torch.float32)
    for storage, backend in ((paged, TritonPagedBackend), (quant, TritonQuantBackend)):
        storage.k = on_cuda(storage.k)
        cuda.calls.clear()
        assert backend(storage, 4, None, torch.float32).num_sms == 46, backend
        assert cuda.calls == [("get_device_properties", 1)], backend
        cuda.calls.clear()
        assert backend(storage, 4, None, torch.float32, num_sms=7).num_sms == 7
        assert not cuda.calls
    # (the two counts split a decode batch differently: the count read matters)
    assert (num_splits_for(4, 2, 32768, 46), num_splits_for(4, 2, 32768, 132)) == (16, 64)


class _TimingEvents:
    """torch.cuda.Event(enable_timing=True) on a stand-in device whose clock the timed
    function advances: `record` reads the clock, `elapsed_time` is milliseconds between two
    records (once the host waited for the second), `synchronize` a host wait (counted)."""

    def __init__(self, monkeypatch) -> None:
        self.clock_ms, self.waits = 0.0, 0
        events = self

        class Event:
            def __init__(self, enable_timing: bool = False) -> None:
                assert enable_timing, "a timing event made without enable_timing"
                self.at = None

            def record(self, stream=None) -> None:
                self.at, self.done = events.clock_ms, False

            def synchronize(self) -> None:
                events.waits += 1
                self.done = True

            def elapsed_time(self, end: Event) -> float:
                assert self.at is not None and end.at is not None, "elapsed_time of an event never recorded"
                # (CUDA: "device not ready" until the end event has passed)
                assert end.done, "elapsed_time before the end event was waited for"
                return end.at - self.at

        monkeypatch.setattr(torch.cuda, "Event", Event)


def test_the_bench_times_a_cuda_call_between_events(monkeypatch) -> None:
    """bench/gpu.py _device_time on CUDA: two warm-up calls outside the events, then each of
    `repeat` samples times `inner` calls between two events and waits for the second once:
    the median of the samples' milliseconds per call, in seconds. The stand-in's calls take
    3, 5, 7, ... ms of device time in turn (the warm-ups 1 and 2 ms, never counted).
    (bench/gpu_engine.py's _copy_rate, its one other CUDA caller, allocates 256 MiB on
    "cuda" itself: no stand-in reaches it without a GPU.)"""
    from kvpool.bench.gpu import _device_time

    events = _TimingEvents(monkeypatch)
    durations_ms = [1, 2, *range(3, 29, 2)]  # the warm-ups', then 3, 5, ..., 27
    calls = []

    def call() -> None:
        events.clock_ms += durations_ms[len(calls)]
        calls.append(events.clock_ms)

    # samples of 4 calls each: calls 3-6 take 3+5+7+9 = 24 ms, 7-10: 11+13+15+17 = 56, 11-14: 88
    assert _device_time(call, "cuda", repeat=3, inner=4) == pytest.approx(56 / 4 / 1e3, rel=1e-12)
    assert len(calls) == 2 + 3 * 4 and events.waits == 3
