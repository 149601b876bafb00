"""The attention backend registry (attention/backends): which backend each runner gets for
its (attention kind, storage format, device), and the error for a combination with none."""

from __future__ import annotations

import pytest
import torch

from kvpool.attention.backends import BACKENDS, BackendKey, select_backend
from kvpool.attention.backends.native import NativeBackend
from kvpool.attention.backends.quant import DequantBackend, QuantNativeBackend
from kvpool.attention.backends.torch_paged import TorchPagedBackend
from kvpool.attention.backends.triton_paged import TritonPagedBackend, triton_importable
from kvpool.engine.llama_runner import llama_runner
from kvpool.models.llama import LlamaModel
from random_llama import CONFIG, DESCRIPTOR, random_llama


def fp32_model(kernels) -> LlamaModel:
    base = random_llama("cpu", torch.float32)
    return LlamaModel(CONFIG, base.embed, base.norm, base.layers, None, "cpu", kernels)


# (model, kv_format, decode_path) -> (backend class, its implementation), written out by hand
@pytest.mark.parametrize(
    ("model_kind", "kv_format", "decode_path", "want", "impl"),
    [
        ("fp32", None, None, NativeBackend, "native"),
        ("fp32", None, "bags", TorchPagedBackend, "bags"),
        ("fp32", None, "padded", TorchPagedBackend, "padded"),
        ("fp32", "int8", None, QuantNativeBackend, "native"),  # 8-bit codes the C kernel reads
        ("fp32", "fp8_e4m3", None, QuantNativeBackend, "native"),
        ("fp32", "int8", "padded", DequantBackend, "padded"),
        ("fp32", "fp16", None, DequantBackend, "native"),  # 16-bit codes: dequantized, C decode
        ("fp32", "kivi4-g16-r16", None, DequantBackend, "native"),
        ("fp64", None, None, TorchPagedBackend, "bags"),  # no C kernels in fp64
        ("fp64", "int8", None, DequantBackend, "bags"),
        ("fp64", None, "padded", TorchPagedBackend, "padded"),
    ],
)
def test_the_llama_runner_gets_the_expected_backend(kernels, model_kind, kv_format, decode_path, want, impl) -> None:
    model = fp32_model(kernels) if model_kind == "fp32" else random_llama("cpu", torch.float64)
    runner = llama_runner(model, 8, 16, DESCRIPTOR, kv_format=kv_format, decode_path=decode_path)
    assert type(runner.attention) is want
    assert runner.executor.decode_path == impl
    runner.executor.decode_path = "padded"  # choosing another implementation picks the backend again
    assert runner.executor.decode_path == "padded"
    assert type(runner.attention) is (TorchPagedBackend if kv_format is None else DequantBackend)


def test_every_key_selects_its_own_entry() -> None:
    for key, backend in BACKENDS.items():
        chosen = select_backend(key.kind, key.format, key.device, key.impl, has_kernels=True)
        assert chosen.key == key and chosen.backend is backend


@pytest.mark.parametrize(
    ("kind", "fmt", "device", "has_kernels", "impl"),
    [
        ("full", "paged", "cpu", True, "native"),
        ("full", "paged", "cpu", False, "bags"),
        ("full", "paged", "cuda", True, "triton"),  # the C kernels are CPU code; triton imports here
        ("full", "paged-q8", "cpu", False, "bags"),
        ("window", "slots", "cpu", False, "gather"),  # one implementation: that one
        ("recurrent", "state", "cpu", False, "delta-rule"),
        ("dsv4-sparse", "dsv4-fp8", "cpu", False, "torch"),
    ],
)
def test_the_default_implementation(kind, fmt, device, has_kernels, impl) -> None:
    if impl == "triton" and not triton_importable():
        impl = "bags"  # passed over without triton (next test)
    assert select_backend(kind, fmt, device, has_kernels=has_kernels).key == BackendKey(kind, fmt, device, impl)


def test_the_triton_backend_is_passed_over_without_triton(monkeypatch) -> None:
    import kvpool.attention.backends as backends
    from kvpool.attention.backends import triton_paged
    from kvpool.storage.kv import PagedKVStorage

    monkeypatch.setattr(backends, "triton_importable", lambda: False)
    assert select_backend("full", "paged", "cuda").key.impl == "bags"
    # named, it is chosen: building it says what is missing (triton_paged.py's own check)
    assert select_backend("full", "paged", "cuda", "triton").backend is TritonPagedBackend
    monkeypatch.setattr(triton_paged, "triton_importable", lambda: False)
    with pytest.raises(ValueError, match="needs triton"):
        TritonPagedBackend(PagedKVStorage(1, 4, 16, 2, 32), 4, None, torch.float32)


def test_an_unknown_combination_names_itself_and_what_exists() -> None:
    with pytest.raises(ValueError) as e:
        select_backend("full", "paged", "mps")
    message = str(e.value)
    assert "'full'" in message and "'paged'" in message and "'mps'" in message
    assert "full/paged/cpu/native" in message and "dsv4-sparse/dsv4-exact/cpu/torch" in message
    with pytest.raises(ValueError, match="'dsv4-sparse'.*'cuda'"):
        select_backend("dsv4-sparse", "dsv4-exact", "cuda")
    with pytest.raises(ValueError, match="needs the CPU kernels"):
        select_backend("full", "paged", "cpu", "native", has_kernels=False)


def test_a_runner_refuses_a_path_its_model_cannot_run() -> None:
    with pytest.raises(ValueError, match="needs the CPU kernels"):
        llama_runner(random_llama("cpu", torch.float64), 8, 16, DESCRIPTOR, decode_path="native")
    with pytest.raises(ValueError, match="'fast'"):
        llama_runner(random_llama("cpu", torch.float64), 8, 16, DESCRIPTOR, decode_path="fast")


@pytest.mark.parametrize(("kv_format", "fmt"), [("exact", "dsv4-exact"), ("fp8", "dsv4-fp8")])
def test_the_v4_runner_gets_the_sparse_backend_over_its_pools(kv_format, fmt) -> None:
    from kvpool.attention.backends import DSV4SparseBackend
    from kvpool.engine.dsv4_runner import dsv4_runner
    from kvpool.models.tiny_dsv4 import TinyDSV4

    runner = dsv4_runner(TinyDSV4(), 4, 2, kv_format=kv_format)
    assert type(runner.attention) is DSV4SparseBackend and runner.attention.pools is runner.executor.pools
    assert select_backend("dsv4-sparse", fmt, "cpu").backend is DSV4SparseBackend


def test_the_hybrid_runner_gets_a_slot_backend_per_group_and_the_recurrent_update() -> None:
    from kvpool.attention.backends import RecurrentBackend, SlotAttentionBackend
    from kvpool.engine.hybrid_runner import hybrid_runner
    from kvpool.models.tiny_hybrid import TINY_GEMMA2, TINY_RECURRENT, TinyHybrid

    gemma = hybrid_runner(TinyHybrid(TINY_GEMMA2), 10, 3, block_size=4)
    groups = gemma.attention.groups
    assert sorted(groups) == ["full", "window"] and all(type(b) is SlotAttentionBackend for b in groups.values())
    assert groups["window"].window == TINY_GEMMA2["window"] and groups["full"].window is None
    # [blocks * block size, the group's layers (2 of 4 each), K and V, kv heads, head dim]
    assert groups["full"].kv.shape == (40, 2, 2, TINY_GEMMA2["num_kv_heads"], TINY_GEMMA2["head_dim"])
    assert gemma.attention.recurrent.state.shape[0] == 0  # no recurrent layer: no state slots
    rec = hybrid_runner(TinyHybrid(TINY_RECURRENT), 10, 3, block_size=4)
    assert sorted(rec.attention.groups) == ["full"] and type(rec.attention.recurrent) is RecurrentBackend
    heads, hd = TINY_RECURRENT["num_heads"], TINY_RECURRENT["head_dim"]
    assert rec.attention.recurrent.state.shape == (3, 2, heads, hd, hd)


def test_a_new_backend_plugs_in_through_the_dict_alone(monkeypatch) -> None:
    """What the GPU issue will do: a module's class and a BACKENDS entry, the runner as it
    is. The stand-in backend wraps the padded path and counts its steps; the engine's
    logits equal the padded backend's own, and every step went through it."""
    from kvpool.engine.engine import Engine
    from kvpool.engine.sampling import SamplingParams

    class CountingBackend(TorchPagedBackend):
        def __init__(self, *args, decode_path: str, **kwargs) -> None:
            super().__init__(*args, decode_path="padded", **kwargs)
            self.name, self.num_steps = decode_path, 0

        def begin_step(self, meta):
            self.num_steps += 1
            return super().begin_step(meta)

    monkeypatch.setitem(BACKENDS, BackendKey("full", "paged", "cpu", "counting"), CountingBackend)
    model = random_llama("cpu", torch.float64)
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5], [2, 7, 1, 8, 2, 8]]
    logits = {}
    for path in ("counting", "padded"):
        runner = llama_runner(model, 8, 4, DESCRIPTOR, decode_path=path)
        engine = Engine(runner, max_num_batched_tokens=8, record_logits=True)
        engine.generate(prompts, SamplingParams(max_tokens=4, ignore_eos=True))
        logits[path] = [torch.stack(s.logits) for r in engine.requests.values() for s in r.seqs]
        if path == "counting":
            assert type(runner.attention) is CountingBackend and runner.executor.decode_path == "counting"
            assert runner.attention.num_steps == engine.num_steps > 0
    assert all(torch.equal(a, b) for a, b in zip(logits["counting"], logits["padded"], strict=True))
