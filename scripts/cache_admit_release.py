#!/usr/bin/env python
"""A V4-Flash replica's cache (the simulator's, H200, tp 2): admit and release of 3,000-token
prompts as the engine does them (packed once, `check_packing=False`, a 2,048-token first
chunk reserved; released by cancel), us per call, best of 7 rounds of 64 requests, the
collector off. The prompts' ids are distinct int objects spread through a heap of other
objects, as in a long run.

PYTHONPATH=src python scripts/cache_admit_release.py"""

from __future__ import annotations

import gc
import random
import time

from kvpool.cache.coordinator import pack_prompt
from kvpool.sim import simulator
from kvpool.sim.cost import CostModel
from kvpool.sim.deployment import gpu_preset
from kvpool.spec.models import model_by_name
from kvpool.workload.sessions import chat_workload

NUM_REQUESTS, PROMPT_LEN, ROUNDS = 64, 3000, 7


def main() -> None:
    model, gpu = model_by_name("deepseek-v4-flash"), gpu_preset("h200")
    config = simulator.SimConfig(tp=2)
    workload = chat_workload(25, 4, 40.0, model.vocab_size, 0)
    plan = simulator.plan_replica(model, gpu, config)
    replicas, _ = simulator.make_replicas(model, plan, workload, config, CostModel(model, gpu, tp=2), 1)
    cache = replicas[0].engine.runner.cache
    rng = random.Random(0)
    prompts = [[rng.randrange(1000, model.vocab_size) for _ in range(PROMPT_LEN)] for _ in range(NUM_REQUESTS)]
    heap = [[object() for _ in range(50)] for _ in range(20_000)]  # other objects the ids lie among
    gc.disable()
    best_admit = best_release = float("inf")
    for r in range(ROUNDS):
        packed = [pack_prompt(p) for p in prompts]
        admit_s = release_s = 0.0
        for i, (prompt, pk) in enumerate(zip(prompts, packed, strict=True)):
            t0 = time.perf_counter()
            assert cache.admit(f"r{r}-{i}", prompt, 2048, prompt=pk, check_packing=False) is not None
            admit_s += time.perf_counter() - t0
        for i in range(NUM_REQUESTS):
            t0 = time.perf_counter()
            cache.release(f"r{r}-{i}", "cancel")
            release_s += time.perf_counter() - t0
        best_admit = min(best_admit, admit_s / NUM_REQUESTS)
        best_release = min(best_release, release_s / NUM_REQUESTS)
    cache.check_integrity()
    del heap
    print(f"admit {best_admit * 1e6:.1f} us  release {best_release * 1e6:.1f} us")


if __name__ == "__main__":
    main()
