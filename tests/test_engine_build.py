"""The one engine builder (engine/build.py `build_engine`): the runner each model kind gets,
its options, and an engine it builds serving tokens the model's oracle agrees with."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import pytest
import torch

import kvpool.engine
from kvpool.engine.build import build_engine
from kvpool.engine.dsv4_runner import DSV4Executor
from kvpool.engine.hybrid_runner import HybridExecutor
from kvpool.engine.llama_runner import LlamaExecutor
from kvpool.engine.runner import ModelRunner
from kvpool.engine.sampling import SamplingParams
from kvpool.models.tiny_dsv4 import TinyDSV4
from kvpool.models.tiny_hybrid import TINY_RECURRENT, TinyHybrid
from kvpool.storage.dsv4 import DSV4Pools


def test_each_model_kind_gets_its_runner_and_options() -> None:
    v4 = build_engine(TinyDSV4(), num_blocks=12, num_state_blocks=2, max_num_seqs=3, restore="checkpoint")
    assert isinstance(v4.runner.executor, DSV4Executor) and [g.name for g in v4.runner.cache.dual_groups] == ["v4"]
    assert v4.runner.cache.num_blocks == 12 and v4.runner.cache.usage().num_state_blocks == 3  # a state per sequence
    assert v4.max_num_seqs == 3
    hybrid = build_engine(TinyHybrid(TINY_RECURRENT), num_blocks=20, block_size=4, num_slots=6)
    assert isinstance(hybrid.runner.executor, HybridExecutor) and hybrid.runner.cache.recurrent_groups
    assert hybrid.runner.block_size == 4 and hybrid.runner.attention.recurrent.state.shape[0] == 6


def test_every_model_kind_runs_on_the_one_runner_class(smollm2_for_commands) -> None:
    # A Llama, the V4 dual pool and both hybrid models: each engine's runner is a ModelRunner
    # itself, not a subclass (llama_runner, dsv4_runner and hybrid_runner are functions that
    # build one), each with its own executor.
    engines = [
        build_engine(smollm2_for_commands, num_blocks=16, block_size=4),
        build_engine(TinyDSV4(), num_blocks=12, num_state_blocks=2),
        build_engine(TinyHybrid(TINY_RECURRENT), num_blocks=20, block_size=4, num_slots=6),
        build_engine(TinyHybrid(), num_blocks=20, block_size=4),
    ]
    assert [type(engine.runner) for engine in engines] == [ModelRunner] * 4
    executors = [type(engine.runner.executor).__name__ for engine in engines]
    assert executors == ["LlamaExecutor", "DSV4Executor", "HybridExecutor", "HybridExecutor"]
    # No other runner class in engine/: of every class defined in a kvpool.engine module,
    # only ModelRunner reserves a step (a subclass would inherit `reserve_step`).
    runners = []
    for info in pkgutil.iter_modules(kvpool.engine.__path__):
        module = importlib.import_module(f"kvpool.engine.{info.name}")
        for name, cls in inspect.getmembers(module, inspect.isclass):
            if cls.__module__ == module.__name__ and hasattr(cls, "reserve_step"):
                runners.append(f"{module.__name__}.{name}")
    assert runners == ["kvpool.engine.runner.ModelRunner"]


def test_kv_memory_sizes_the_v4_classical_pool() -> None:
    model = TinyDSV4()
    block_bytes = DSV4Pools(model.spec, 1, 1, entry_format="fp8").classical_block_bytes()
    engine = build_engine(model, kv_memory_bytes=5 * block_bytes + block_bytes - 1, kv_format="fp8")
    assert engine.runner.cache.num_blocks == 5
    with pytest.raises(ValueError, match=f"holds no classical block of {block_bytes} bytes"):
        build_engine(model, kv_memory_bytes=block_bytes - 1, kv_format="fp8")


def test_an_option_or_model_the_builder_does_not_take_is_named() -> None:
    with pytest.raises(TypeError, match="hot_set_entries"):
        build_engine(TinyHybrid(), hot_set_entries=8)
    with pytest.raises(TypeError, match="no engine builder for a str"):
        build_engine("SmolLM2.gguf")


def test_a_built_hybrid_engine_decodes_what_the_oracle_predicts() -> None:
    """Greedy decoding through the engine the builder made: every token is the argmax of the
    full-recompute oracle's logits over the history (fp64, so no near-tie can flip)."""
    model = TinyHybrid(TINY_RECURRENT, seed=3, dtype=torch.float64)
    engine = build_engine(model, num_blocks=32, block_size=4, checkpoint_interval=8, max_num_batched_tokens=16)
    prompts = [[5, 9, 2, 7, 1, 4, 4, 8, 3, 6, 0, 2, 9], [5, 9, 2, 7, 1, 4, 4, 8, 11, 30]]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    for prompt, out in zip(prompts, engine.generate(prompts, params), strict=True):
        history = list(prompt)
        assert len(out.completions[0].token_ids) == 6
        for token in out.completions[0].token_ids:
            assert token == int(model.reference_logits(history)[-1].argmax())
            history.append(token)
    engine.runner.check_integrity()


def test_a_bare_llama_model_is_built_by_the_same_builder_and_decodes_what_the_reference_predicts() -> None:
    """`kvpool run --model CONFIG.json` and `verify kv-quant` hand build_engine a LlamaModel
    without a file or tokenizer: its engine pages the cache like a GGUF's, and every greedy
    token is the argmax of the contiguous reference's logits over the history (fp64: no
    near-tie can flip)."""
    from kvpool.attention.reference import reference_logits
    from random_llama import DESCRIPTOR, random_llama

    model = random_llama(dtype=torch.float64)
    engine = build_engine(model, descriptor=DESCRIPTOR, num_blocks=12, block_size=4, max_num_seqs=2)
    assert type(engine.runner) is ModelRunner and isinstance(engine.runner.executor, LlamaExecutor)
    assert engine.runner.cache.num_blocks == 12
    assert engine.runner.block_size == 4 and engine.max_num_seqs == 2
    prompts = [[5, 9, 2, 7, 1, 4, 4, 8, 3], [5, 9, 2, 7, 1, 4, 4, 8, 30, 6]]
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    for prompt in prompts:  # one after the other: the second hits the first's two full blocks
        (out,) = engine.generate([prompt], params)
        history = list(prompt)
        for token in out.completions[0].token_ids:
            assert token == int(reference_logits(model, history)[-1].argmax())
            history.append(token)
    assert engine.runner.cache_stats()["prefix_hit_tokens"] == 8
    engine.runner.check_integrity()


def test_a_bare_llama_model_needs_a_descriptor() -> None:
    from random_llama import random_llama

    with pytest.raises(TypeError, match=r"needs descriptor=CacheDescriptor\(...\) .* got NoneType"):
        build_engine(random_llama(), num_blocks=8)


def test_kv_memory_too_small_for_a_quantized_pool_names_the_tails_it_keeps() -> None:
    """A format quantized a chunk at a time keeps full-precision tails for every sequence out
    of the same budget: when they leave no block, the error says so and how to fix it, not
    that one block is bigger than the budget (review of 425f5b4)."""
    from random_llama import DESCRIPTOR, random_llama

    model = random_llama()
    one_mib = 1 << 20
    engine = build_engine(
        model, descriptor=DESCRIPTOR, kv_memory_bytes=one_mib, kv_format="fp8_e4m3", block_size=4, max_num_seqs=2
    )
    assert engine.runner.cache.num_blocks > 0  # two sequences' tails leave room
    with pytest.raises(ValueError, match=r"after the \d+ bytes of full-precision tails .* --max-num-seqs 4096: raise"):
        build_engine(
            model, descriptor=DESCRIPTOR, kv_memory_bytes=one_mib, kv_format="fp8_e4m3", block_size=4, max_num_seqs=4096
        )
    with pytest.raises(ValueError, match=r"--kv-memory 16 bytes holds no block of \d+ bytes$"):
        build_engine(model, descriptor=DESCRIPTOR, kv_memory_bytes=16, block_size=4)
