"""The decodes' sums of `CostModel.step_cost` from integer sums per context (`_decode_scan`,
the fast path a fleet simulation takes every step) against its naive twin, the loop over
every decode and attention term: the same StepCost, bit for bit, on every preset."""

from __future__ import annotations

import dataclasses
import random

import pytest

from kvpool.sim.cost import CostModel
from kvpool.spec.gpus import get_gpu
from kvpool.spec.models import PRESET_NAMES, load_preset

H200 = get_gpu("H200")


def _twin(cm: CostModel) -> CostModel:
    """A copy of `cm` that adds every decode in the loop (no `_decode_scale`)."""
    loop = dataclasses.replace(cm)
    loop.__dict__["_decode_scale"] = None  # the cached property, set before its first read
    return loop


@pytest.mark.parametrize("name", PRESET_NAMES)
def test_the_decode_sums_equal_the_loops_bit_for_bit_on_every_preset(name: str) -> None:
    model = load_preset(name)
    rng = random.Random(name)
    models = []
    for kv_dtype in ("auto", "fp8"):
        for tp in (1, 2):
            try:
                models.append(CostModel(model, H200, kv_dtype=kv_dtype, tp=tp))
            except ValueError:  # a format or a split the model cannot take
                continue
    assert models
    for cm in models:
        assert cm._decode_scale is not None  # the fast path is taken
        loop = _twin(cm)
        top = model.max_position_embeddings
        for batch in (1, 7, 256):
            decodes = [(1, rng.randrange(1, top + 1)) for _ in range(batch)]
            prefills = [(n, n + rng.randrange(0, 4096)) for n in (2, 512)]
            for chunks in (decodes, prefills + decodes, decodes[:3] + prefills + decodes[3:]):
                assert cm.step_cost(chunks) == loop.step_cost(chunks), (name, cm.kv_dtype, cm.tp, batch)


def test_sums_past_2_to_the_53_leave_the_fast_path_for_the_loop() -> None:
    cm = CostModel(load_preset("deepseek-v4-flash"), H200, tp=2)
    assert cm._decode_scale == 4  # V4's write bytes per token: 28,962.25
    huge = [(1, 10**12)] * 3  # each reads 10^12 // 4 compressed entries of its CSA indexer keys
    assert cm._decode_scan(huge) is None
    assert cm._decode_scan(huge[:1] + [(1, 5000)]) is None
    assert cm._decode_scan([(1, 5000)]) is not None
    assert cm.step_cost(huge) == _twin(cm).step_cost(huge)


@pytest.mark.parametrize("name", ["llama-3.1-8b", "deepseek-v4-flash"])
def test_a_bad_chunk_is_named_on_the_fast_path_as_by_the_loop(name: str) -> None:
    cm = CostModel(load_preset(name), H200, tp=2)
    for chunks, message in (
        ([], "a step needs at least one chunk, got none"),
        ([(1, 9), (0, 5)], "chunk 1: num_new_tokens must be >= 1, got 0"),
        ([(1, 9), (3, 2)], "chunk 1: context_len=2 is shorter than its num_new_tokens=3"),
        ([(1, 5.0)], "chunk 0: context_len must be an integer, got 5.0"),
        ([(True, 5)], "chunk 0: num_new_tokens must be an integer, got True"),
        ([(1, 2, 3)], r"chunk 0 must be \(num_new_tokens, context_len\), got \(1, 2, 3\)"),
    ):
        for model in (cm, _twin(cm)):
            with pytest.raises(ValueError, match=f"^{message}$"):
                model.step_cost(chunks)


@pytest.mark.parametrize("name", PRESET_NAMES)
def test_step_time_is_the_step_costs_time_bit_for_bit_on_every_preset(name: str) -> None:
    """step_time prices a step of decodes only from terms kept per batch size: the same float
    as step_cost's time_s, for graph and eager steps, any TP, batches on both sides of the
    graph's largest, and steps with a prefill chunk (which take step_cost itself)."""
    model = load_preset(name)
    rng = random.Random(f"{name}/time")
    models = [CostModel(model, H200, host_mode=mode) for mode in ("graph", "eager")]
    try:
        models.append(CostModel(model, H200, tp=2, kv_dtype="fp8"))
    except ValueError:  # a format the model cannot take
        pass
    top = model.max_position_embeddings
    for cm in models:
        for batch in (1, 2, 7, cm.graph_max_batch, cm.graph_max_batch + 1):
            for _ in range(2):  # the second step of a size reads the kept terms
                decodes = [(1, rng.randrange(1, top + 1)) for _ in range(batch)]
                assert cm.step_time(decodes) == cm.step_cost(decodes).time_s, (name, cm.host_mode, cm.tp, batch)
            mixed = decodes[:1] + [(300, 300 + rng.randrange(0, 4096))] + decodes[1:]
            assert cm.step_time(mixed) == cm.step_cost(mixed).time_s, (name, cm.host_mode, cm.tp, batch)
    # the kept terms are per batch size: two sizes' steps over the same contexts differ
    cm = models[0]
    assert cm.step_time([(1, 4000)] * 3) != cm.step_time([(1, 4000)] * 4)
