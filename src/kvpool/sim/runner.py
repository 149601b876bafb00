"""The simulator's runner: the engine's own runner (engine/runner.py `ModelRunner`) over
the layout's cache (sim/layouts.py) and the cost executor (sim/executor.py), so every
cache decision (admission with prefix lookup, restore, reservation, copy-on-write,
preemption, release) is the engine's, made by the engine's code; only the forward is
priced instead of computed.

`SimRunner` is the V4 dual layout's runner until the engine's runner drives the dual pool
(issue 29 item 5): a copy of the V4 runner's cache calls with the cost model in place of
the forward. A V4 prefix hit restored by recompute replays tokens [replay_start,
num_cached) in the step that needs the state (engine/dsv4_runner.py defers it the same
way); state checkpoints (restored at admission, snapshot at block boundaries) are priced
as the bytes they move (read + write).
"""

from __future__ import annotations

from collections.abc import Sequence

from kvpool.cache import Admission, CacheUsage, DSV4CacheManager, ReleaseReason
from kvpool.engine.runner import ModelRunner, ScheduledChunk
from kvpool.engine.tier_bridge import TierBridge
from kvpool.sim.executor import CostExecutor
from kvpool.sim.layouts import BuiltLayout
from kvpool.tiers import Tier


def sim_runner(
    built: BuiltLayout,
    executor: CostExecutor,
    max_model_len: int,
    *,
    host_tier: Tier | None = None,
    preemption: str = "recompute",
) -> ModelRunner:
    """The engine's runner over the layout's cache and `executor`; host_tier, preemption:
    as the engine's runner takes them (a host tier below the device pool, swap)."""
    cache = built.manager
    bridge = TierBridge(host_tier, (), built.block_size, enable_prefix_caching=cache.enable_prefix_caching)
    return ModelRunner(
        cache,
        executor,
        bridge,
        descriptor=cache.descriptor,
        block_size=built.block_size,
        capacity_tokens=built.capacity_tokens,
        max_model_len=min(max_model_len, built.capacity_tokens),
        preemption=preemption,
    )


class SimRunner:
    """The engine's ModelRunner protocol on V4's dual pool (DSV4CacheManager) and the cost
    executor (its forward priced, its figures: busy_s, replayed tokens, checkpoint copies)."""

    def __init__(self, built: BuiltLayout, executor: CostExecutor, max_model_len: int) -> None:
        self.cache: DSV4CacheManager = built.manager  # type: ignore[assignment]
        self.executor = executor
        self.block_size = built.block_size
        self.vocab_size = executor.vocab_size
        self.capacity_tokens = built.capacity_tokens
        self.max_model_len = min(max_model_len, self.capacity_tokens)
        self._replays: dict[str, tuple[int, int]] = {}  # seq -> (replay_start, num_cached), priced next step
        self._num_states_taken = 0
        self._restores = 0  # checkpoint restores since the last step (priced as a state copy)
        self._checkpointing = self.cache.checkpointing

    # ---- the cache calls, as the engine's V4 runner makes them ---------------------------

    def admit(
        self, seq_id: str, token_ids: Sequence[int], max_new_tokens: int, *, tenant_salt: str = ""
    ) -> Admission | None:
        if max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens must be positive, got {max_new_tokens}")
        adm = self.cache.admit(seq_id, token_ids, max_new_tokens, tenant_salt=tenant_salt)
        if adm is not None:
            self._num_states_taken += 1
            restore = adm.restore
            if restore is not None and restore.method == "recompute":
                self._replays[seq_id] = (restore.replay_start, adm.num_cached_tokens)
            elif restore is not None and restore.method == "checkpoint":
                self._restores += 1  # a checkpoint copied into the request's state block
        return adm

    def reserve(self, seq_ids: Sequence[str], num_new_tokens: Sequence[int]) -> bool:
        return self.cache.reserve_step(seq_ids, num_new_tokens)

    def append_tokens(self, seq_id: str, token_ids: Sequence[int]) -> None:
        self.cache.append_token_ids(seq_id, token_ids)

    def commit(self, seq_ids: Sequence[str], num_tokens: Sequence[int], next_token_ids: Sequence[int | None]) -> None:
        self.cache.commit_step(seq_ids, num_tokens, next_token_ids)

    def fork(self, parent_id: str, child_id: str) -> bool:
        if not self.cache.fork(parent_id, child_id):
            return False
        self._num_states_taken += 1
        return True

    def release(self, seq_id: str, reason: ReleaseReason) -> bool:
        self._replays.pop(seq_id, None)
        return self.cache.release(seq_id, reason)

    def num_computed_tokens(self, seq_id: str) -> int:
        return self.cache.num_computed_tokens(seq_id)

    def num_allocations(self) -> int:
        return self.cache.pool.num_allocated + self._num_states_taken

    def kv_read_bytes(self, num_context_tokens: int) -> int:
        return self.executor.kv_read_bytes(num_context_tokens)

    def usage(self) -> CacheUsage:
        return self.cache.usage()

    def check_integrity(self) -> None:
        self.cache.check_integrity()

    # ---- the forward, priced -------------------------------------------------------------

    def execute(self, chunks: Sequence[ScheduledChunk]) -> list[ScheduledChunk]:
        """The executor's calls the V4 runner would make: the replays, the state copies
        (checkpoints restored at admission, snapshots the step takes), the forward."""
        ex = self.executor
        for start, end in self._replays.values():
            ex.replay(range(start, end), start, (), 0, 0)  # the state rebuilt over the cached prefix
        self._replays.clear()
        if self._checkpointing:
            copies = self._restores + sum(len(self.cache.pending_reservation(c.seq_id).checkpoints) for c in chunks)
            self._restores = 0
            for _ in range(copies):
                ex.copy_state(0, 0)
        return ex.forward(chunks, self.cache, False)

    def cache_stats(self) -> dict[str, float]:
        m = self.cache
        return {
            "kv_capacity_tokens": self.capacity_tokens,
            "block_size": self.block_size,
            "num_blocks": m.num_blocks,
            "prefix_queried_tokens": m.stats.num_queried_tokens,
            "prefix_hit_tokens": m.stats.num_hit_tokens,
            "prefix_hit_rate": m.stats.hit_rate,
            "readmitted_hit_tokens": m.stats.num_readmitted_hit_tokens,
            "hash_collisions": m.pool.num_collisions,
            **self.executor.cache_stats(m),
        }
