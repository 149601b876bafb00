#!/usr/bin/env python
"""The cache's share of a V4 decode step, two ways:

PYTHONPATH=src python scripts/v4_decode_bookkeeping.py steady [BATCH]
    One simulated V4-Flash replica (H200, tp 2) whose BATCH requests (default 106) decode
    with hot caches: the coordinator's reserve_step, step_reservations and commit_step
    alone, us per step (best of 7 rounds of 128 steps, the collector off), and split by
    how many of the step's requests cross a span boundary (every 128 tokens), medians.
PYTHONPATH=src python scripts/v4_decode_bookkeeping.py run [SIMULATE ARGS...]
    Inside a `kvpool simulate` run (default: 3,000 V4 chat requests on 8 replicas): a
    crossing's DualPoolGroup.apply_reserve and _commit, us per call by the number of
    blocks they take or publish (a run's heap is large: each costs several times the
    steady figure). The collector runs as in any simulate run."""

from __future__ import annotations

import gc
import runpy
import statistics
import sys
import time
from collections import Counter

from kvpool.cache import dual_pool

RUN = (
    "--model deepseek-v4-flash --gpu h200 --workload chat --requests 3000 --replicas 8 --routing prefix-aware --rate 40"
)


def steady_engine(batch: int):  # type: ignore[no-untyped-def]
    """An engine of one V4 replica, `batch` requests past their prefill (steady.py's)."""
    import numpy as np

    from kvpool.engine.sampling import SamplingParams
    from kvpool.sim import simulator
    from kvpool.sim.cost import CostModel
    from kvpool.sim.deployment import gpu_preset
    from kvpool.spec.models import model_by_name
    from kvpool.workload.sessions import chat_workload

    model, gpu = model_by_name("deepseek-v4-flash"), gpu_preset("h200")
    config = simulator.SimConfig(tp=2)
    workload = chat_workload(25, 4, 40.0, model.vocab_size, 0)
    plan = simulator.plan_replica(model, gpu, config)
    replicas, _ = simulator.make_replicas(model, plan, workload, config, CostModel(model, gpu, tp=2), 1)
    engine = replicas[0].engine
    rng = np.random.default_rng(0)
    for i in range(batch):
        engine.add_request(rng.integers(0, 1000, 1000 + i).tolist(), SamplingParams(max_tokens=5000, ignore_eos=True))
    while engine.waiting or any(s.num_computed < len(s.token_ids) - 1 for s in engine.running):
        engine.step()
    return engine


def steady(batch: int) -> None:
    cache = steady_engine(batch).runner.cache
    ids = list(cache.request_ids)
    ones, tokens = [1] * batch, [7] * batch
    best = {"reserve_step": [], "step_reservations": [], "commit_step": []}
    by_crossings: dict[int, list[tuple[float, float, float]]] = {}
    gc.disable()
    try:
        for _ in range(7):
            total = dict.fromkeys(best, 0.0)
            for _ in range(128):
                starts = [cache.num_computed_tokens(r) for r in ids]
                ends = [s + 1 for s in starts]
                a = time.perf_counter()
                assert cache.reserve_step(ids, ones)
                b = time.perf_counter()
                cache.step_reservations(ids, starts, ends)
                c = time.perf_counter()
                cache.commit_step(ids, ones, tokens)
                d = time.perf_counter()
                total["reserve_step"] += b - a
                total["step_reservations"] += c - b
                total["commit_step"] += d - c
                crossings = sum(not e % 128 for e in ends)
                by_crossings.setdefault(crossings, []).append((b - a, c - b, d - c))
            for name, seconds in total.items():
                best[name].append(seconds / 128)
    finally:
        gc.enable()
    print(f"batch {batch}: " + ", ".join(f"{k} {min(v) * 1e6:.1f}" for k, v in best.items()) + " us/step")
    for crossings, times in sorted(by_crossings.items()):
        medians = [statistics.median(t[i] for t in times) * 1e6 for i in range(3)]
        print(f"  {crossings} crossing(s), {len(times)} steps: " + ", ".join(f"{m:.1f}" for m in medians) + " us")


def in_run(args: list[str]) -> None:
    calls: Counter[str] = Counter()
    seconds: Counter[str] = Counter()
    apply_reserve, commit = dual_pool.DualPoolGroup.apply_reserve, dual_pool.DualPoolGroup._commit

    def timed_apply_reserve(self, reqs, ends, **kw):  # type: ignore[no-untyped-def]
        need = sum(end // self.span - len(req.states[self.name].block_ids) for req, end in zip(reqs, ends, strict=True))
        start = time.perf_counter()
        out = apply_reserve(self, reqs, ends, **kw)
        key = f"apply_reserve, {min(need, 3)}{'+' if need >= 3 else ''} block(s)"
        seconds[key] += time.perf_counter() - start
        calls[key] += 1
        return out

    def timed_commit(self, state):  # type: ignore[no-untyped-def]
        num = state.pending.num_new
        start = time.perf_counter()
        commit(self, state)
        key = f"_commit, {min(num, 3)}{'+' if num >= 3 else ''} block(s)"
        seconds[key] += time.perf_counter() - start
        calls[key] += 1

    dual_pool.DualPoolGroup.apply_reserve = timed_apply_reserve  # type: ignore[method-assign]
    dual_pool.DualPoolGroup._commit = timed_commit  # type: ignore[method-assign]
    sys.argv = ["kvpool", "simulate", *(args or RUN.split()), "--json"]
    try:
        runpy.run_module("kvpool", run_name="__main__")
    except SystemExit:
        pass
    for key in sorted(calls):
        print(f"{key}: {calls[key]} calls, {seconds[key] / calls[key] * 1e6:.1f} us each", file=sys.stderr)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "run":
        in_run(sys.argv[2:])
    else:
        steady(int(sys.argv[2]) if len(sys.argv) > 2 else 106)
