#!/usr/bin/env python
"""V4 preemption by recompute against swap, alternated: `PYTHONPATH=src python scripts/v4_swap_ab.py`.

Four tiny-dsv4 requests (span 128, prompts of 200-290 tokens, 48 new tokens each) preempt
each other on 5 classical blocks with a host tier below; per round and mode: preemptions,
the tokens replayed to restore states, the states swapped out and back, the tokens past
their span boundaries those restored, and the wall time; then the best wall time of each
mode and whether both generated the same tokens (they must: both restores are exact)."""

from __future__ import annotations

import time

import torch

from kvpool.engine.dsv4_runner import dsv4_runner
from kvpool.engine.engine import Engine
from kvpool.engine.sampling import SamplingParams
from kvpool.models.tiny_dsv4 import TinyDSV4
from kvpool.tiers import HostTier

ROUNDS = 5


def main() -> None:
    torch.set_num_threads(1)
    model = TinyDSV4(seed=0)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (200, 230, 260, 290)]
    best: dict[str, float] = {}
    tokens: dict[str, list[list[int]]] = {}
    for rnd in range(ROUNDS):
        for mode in ("recompute", "swap"):
            runner = dsv4_runner(model, 5, 4, host_tier=HostTier(1 << 28), preemption=mode)
            engine = Engine(runner, max_num_batched_tokens=256, max_num_seqs=4)
            start = time.perf_counter()
            outs = engine.generate(prompts, SamplingParams(max_tokens=48))
            wall = time.perf_counter() - start
            m = runner.tier_moves
            print(
                f"{rnd} {mode:9s} preemptions {engine.num_preemptions} replayed {runner.num_replayed_tokens} "
                f"states out/in {m.num_states_swapped_out}/{m.num_swapped_in} tail tokens "
                f"{m.num_tail_tokens_restored} state bytes {m.state_bytes_swapped_out} wall {wall:.2f} s",
                flush=True,
            )
            best[mode] = min(best.get(mode, float("inf")), wall)
            tokens[mode] = [o.completions[0].token_ids for o in outs]
    same = tokens["recompute"] == tokens["swap"]
    print(f"best of {ROUNDS}: recompute {best['recompute']:.2f} s, swap {best['swap']:.2f} s; same tokens: {same}")


if __name__ == "__main__":
    main()
