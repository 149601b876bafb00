"""The simulator's runner: the engine's own runner (engine/runner.py `ModelRunner`) over
the layout's cache (sim/layouts.py) and the cost executor (sim/executor.py), so every
cache decision (admission with prefix lookup, V4's restore by checkpoint or deferred
replay, reservation, copy-on-write, the step cut at V4's checkpoints, preemption,
release) is the engine's, made by the engine's code; only the tensor work is priced
instead of done.
"""

from __future__ import annotations

from kvpool.engine.runner import ModelRunner
from kvpool.engine.tier_bridge import TierBridge
from kvpool.sim.executor import CostExecutor
from kvpool.sim.layouts import BuiltLayout


def sim_runner(built: BuiltLayout, executor: CostExecutor, max_model_len: int) -> ModelRunner:
    """The engine's runner over the layout's cache and `executor`, without tiers (a
    layout's cache has no lower tier); requests up to `max_model_len` tokens."""
    cache = built.cache
    bridge = TierBridge(None, (), built.block_size, enable_prefix_caching=cache.enable_prefix_caching)
    return ModelRunner(
        cache,
        executor,
        bridge,
        descriptor=cache.descriptor,
        block_size=built.block_size,
        capacity_tokens=built.capacity_tokens,
        max_model_len=min(max_model_len, built.capacity_tokens),
    )
