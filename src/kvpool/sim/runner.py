"""A ModelRunner without tensors: the real cache manager, a cost model for the forward.

`SimRunner` holds the manager the engine would hold (FullAttentionManager for GQA / MLA
and for the uniform layouts, DSV4CacheManager for V4's dual pool, HybridCacheManager for
models with sliding-window layers) and makes every cache
call the engine's runners make, in the same order: admission with prefix lookup,
reservations, copy-on-write, preemption, release. `execute` does no arithmetic: it prices
the step with the cost model (`sim/cost.py`), advances the virtual clock by that time, and
returns one "logits row" per chunk that needs one, a handle that `sample` turns into the
request's next answer token (`workload/tokens.py`: deterministic per request, so a later turn
of a session carries exactly the answer its prefix cache holds).

What each step costs beyond its chunks:
  - a V4 prefix hit restored by recompute replays tokens [replay_start, num_cached) in the
    step that needs the state (engine/dsv4_runner.py defers it the same way);
  - copy-on-write copies, and V4 state checkpoints (restored at admission, snapshot at
    block boundaries), are priced as the bytes they move (read + write).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvpool.cache import (
    Admission,
    CacheUsage,
    DSV4CacheManager,
    FullAttentionManager,
    HybridCacheManager,
    ReleaseReason,
)
from kvpool.engine.runner import ScheduledChunk
from kvpool.engine.sampling import SamplingParams
from kvpool.workload.tokens import stream_key, token_at


@dataclass
class VirtualClock:
    """Seconds since the simulation began; only the simulator moves it."""

    now: float = 0.0

    def __call__(self) -> float:
        return self.now


class SimRunner:
    """The engine's ModelRunner protocol on a cache manager and a cost model.

    kind: "full" (FullAttentionManager: paged or contiguous blocks), "dual" (V4) or
    hybrid (the coordinator over full and window groups on one shared pool)."""

    def __init__(
        self,
        manager: FullAttentionManager | DSV4CacheManager | HybridCacheManager,
        *,
        step_time: Callable[[Sequence[tuple[int, int]], int], float],
        kv_read_bytes: Callable[[int], int],
        clock: VirtualClock,
        vocab_size: int,
        max_model_len: int,
        block_bytes: int,
        state_block_bytes: int = 0,
        checkpoint_bytes: int | None = None,
    ) -> None:
        """step_time((num_new_tokens, context_len) per chunk, extra bytes moved) -> seconds.
        checkpoint_bytes: what a V4 state copy moves (None: a state block)."""
        self.manager = manager
        self.dual = isinstance(manager, DSV4CacheManager)
        # (FullAttentionManager, DSV4CacheManager: the coordinator over one group, the paged / dual layout)
        self.hybrid = isinstance(manager, HybridCacheManager) and not isinstance(
            manager, (FullAttentionManager, DSV4CacheManager)
        )
        self.block_size = manager.span if self.dual else manager.block_size
        self.step_time = step_time
        self._kv_read_bytes = kv_read_bytes
        self.clock = clock
        self.vocab_size = vocab_size
        self.block_bytes = block_bytes
        self.state_block_bytes = state_block_bytes
        self.checkpoint_bytes = state_block_bytes if checkpoint_bytes is None else checkpoint_bytes
        if self.dual:
            # the unfinished span lives in the state block (engine/dsv4_runner.py)
            self.capacity_tokens = manager.num_blocks * self.block_size + self.block_size - 1
        elif self.hybrid:
            self.capacity_tokens = _hybrid_capacity(manager, max_model_len)
        else:
            self.capacity_tokens = manager.num_blocks * self.block_size
        self.max_model_len = min(max_model_len, self.capacity_tokens)
        self._keys: dict[str, int] = {}  # sequence id -> its answer stream (workload/tokens.py)
        self._replays: dict[str, tuple[int, int]] = {}  # seq -> (replay_start, num_cached), priced next step
        self._num_states_taken = 0
        self._restores = 0  # checkpoint restores since the last step (priced as a state copy)
        self._checkpointing = self.dual and manager.checkpointing
        self.num_replayed_tokens = 0
        self.num_checkpoint_copies = 0
        self.num_copied_blocks = 0
        self.busy_s = 0.0  # the sum of step times: the replica's busy time

    # ---- the cache calls, as the engine's runners make them -------------------------------

    def admit(
        self, seq_id: str, token_ids: Sequence[int], max_new_tokens: int, *, tenant_salt: str = ""
    ) -> Admission | None:
        if max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens must be positive, got {max_new_tokens}")
        adm = self.manager.admit(seq_id, token_ids, max_new_tokens, tenant_salt=tenant_salt)
        if adm is not None and self.dual:
            self._num_states_taken += 1
            restore = adm.restore
            if restore is not None and restore.method == "recompute":
                self._replays[seq_id] = (restore.replay_start, adm.num_cached_tokens)
            elif restore is not None and restore.method == "checkpoint":
                self._restores += 1  # a checkpoint copied into the request's state block
        return adm

    def reserve(self, seq_ids: Sequence[str], num_new_tokens: Sequence[int]) -> bool:
        return self.manager.reserve_step(seq_ids, num_new_tokens)

    def append_tokens(self, seq_id: str, token_ids: Sequence[int]) -> None:
        self.manager.append_token_ids(seq_id, token_ids)

    def commit(self, seq_ids: Sequence[str], num_tokens: Sequence[int], next_token_ids: Sequence[int | None]) -> None:
        self.manager.commit_step(seq_ids, num_tokens, next_token_ids)

    def fork(self, parent_id: str, child_id: str) -> bool:
        if not self.manager.fork(parent_id, child_id):
            return False
        if self.dual:
            self._num_states_taken += 1
        return True

    def release(self, seq_id: str, reason: ReleaseReason) -> bool:
        self._replays.pop(seq_id, None)
        if reason != "preempt":
            self._keys.pop(seq_id, None)
        return self.manager.release(seq_id, reason)

    def num_computed_tokens(self, seq_id: str) -> int:
        return self.manager.num_computed_tokens(seq_id)

    def num_allocations(self) -> int:
        return self.manager.pool.num_allocated + self._num_states_taken

    def kv_read_bytes(self, num_context_tokens: int) -> int:
        return self._kv_read_bytes(num_context_tokens)

    def usage(self) -> CacheUsage:
        return self.manager.usage()

    def check_integrity(self) -> None:
        self.manager.check_integrity()

    # ---- the forward, priced -------------------------------------------------------------

    def execute(self, chunks: Sequence[ScheduledChunk]) -> list[ScheduledChunk]:
        """Advance the clock by the step's cost. The "logits" are the chunks that need them:
        a row only has to say whose it is (`sample` reads its seq_id)."""
        work = [(len(c.token_ids), c.start + len(c.token_ids)) for c in chunks]
        if self._replays:
            for start, end in self._replays.values():
                work.append((end - start, end))  # the state rebuilt over the cached prefix
                self.num_replayed_tokens += end - start
            self._replays.clear()
        moved = 0
        if self._checkpointing:
            # state copies: checkpoints restored at admission, snapshots the step takes
            copies = self._restores + sum(len(self.manager.pending_reservation(c.seq_id).checkpoints) for c in chunks)
            self._restores = 0
            self.num_checkpoint_copies += copies
            moved = 2 * copies * self.checkpoint_bytes
        if not self.dual:
            copies = [c for cs in self.manager.take_copies().values() for c in cs]
            self.num_copied_blocks += len(copies)
            moved = 2 * len(copies) * self.block_bytes  # read the source, write the copy
        seconds = self.step_time(work, moved)
        self.clock.now += seconds
        self.busy_s += seconds
        return [c for c in chunks if c.needs_logits]

    def sample(self, row: ScheduledChunk, params: SamplingParams, sample_index: int, position: int) -> int:
        """The engine's sampler: token `position` of the request's answer (sample j > 0 of a
        request with n > 1 answers its own stream). A forked sample is handed its parent's
        row for its first token, so the stream is keyed by the request and the sample index."""
        key = self._keys.get(row.seq_id) if not sample_index else None
        if key is None:
            request_id = row.seq_id.rpartition("/")[0]
            key = stream_key(f"{request_id}/{sample_index}" if sample_index else request_id)
            if not sample_index:
                self._keys[row.seq_id] = key
        return token_at(key, position, self.vocab_size)

    # ---- figures ----------------------------------------------------------------------------

    def num_used_blocks(self) -> int:
        """Blocks some request holds now (O(1): the pool's free count)."""
        return self.manager.num_blocks - self.manager.num_free_blocks

    def group_held_blocks(self) -> dict[str, int]:
        """Hybrid: blocks each group's requests hold now (walks them: a sample, not every
        step); {} for the other layouts."""
        return self.manager.group_held_blocks() if self.hybrid else {}

    def cache_stats(self) -> dict[str, float]:
        m = self.manager
        state_blocks = m.num_state_blocks if self.dual else 0
        return {
            "kv_capacity_tokens": self.capacity_tokens,
            "kv_capacity_bytes": self.block_bytes * m.num_blocks + self.state_block_bytes * state_blocks,
            "block_size": self.block_size,
            "num_blocks": m.num_blocks,
            "state_blocks": state_blocks,
            "prefix_queried_tokens": m.stats.num_queried_tokens,
            "prefix_hit_tokens": m.stats.num_hit_tokens,
            "prefix_hit_rate": m.stats.hit_rate,
            "readmitted_hit_tokens": m.stats.num_readmitted_hit_tokens,
            "hash_collisions": m.pool.num_collisions,
            "replayed_tokens": self.num_replayed_tokens,
            "copied_blocks": self.num_copied_blocks,
            "checkpoint_copies": self.num_checkpoint_copies,
        }


def _hybrid_capacity(manager: HybridCacheManager, max_model_len: int) -> int:
    """The longest sequence one replica's shared pool holds alone: each window group keeps
    the blocks of its window (one more when unaligned, one for the step's next position),
    each full group the whole sequence. Without a full group: max_model_len."""
    bs = manager.block_size
    full = [g for g in manager.attention_groups if g.spec.window is None]
    windows = [g.spec.window for g in manager.attention_groups if g.spec.window is not None]
    left = manager.num_blocks - sum(-(-w // bs) + 2 for w in windows)
    if not full:
        return max_model_len if left >= 0 else 0
    return max(0, left // len(full)) * bs
