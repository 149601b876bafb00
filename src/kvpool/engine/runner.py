"""What the scheduler needs from a model and its cache: the model-runner protocol.

The scheduler (engine/engine.py) never sees block ids, tensors or the model's family.
It asks a runner to admit a sequence (with prefix lookup), to reserve room for the next
tokens of a whole step, to execute the step's token chunks and return logits, to commit
the computed tokens (with each sequence's sampled next token), and to release a sequence
(finish, cancel, preempt). A Llama on the paged KV pool (engine/llama_runner.py) and a
DeepSeek-V4 model on its classical + state pools (engine/dsv4_runner.py) both implement it,
each over a cache manager of cache/ (whose contract, cache/base.py, this one follows), and
run under the same scheduler.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple, Protocol

import torch

from kvpool.cache import Admission, CacheUsage, ReleaseReason


class ScheduledChunk(NamedTuple):
    """One sequence's work in a step: compute KV for positions [start, start + len(token_ids)).
    (A named tuple: the engine makes one per sequence per step, a frozen dataclass costs 3x.)"""

    seq_id: str
    token_ids: list[int]
    start: int
    needs_logits: bool  # True when the chunk ends at the sequence's last known token (sample next)


class ModelRunner(Protocol):
    max_model_len: int  # the longest sequence (prompt + output) one sequence may reach
    capacity_tokens: int  # the most tokens a single sequence can hold when it runs alone
    vocab_size: int

    def admit(
        self, seq_id: str, token_ids: Sequence[int], max_new_tokens: int, *, tenant_salt: str = ""
    ) -> Admission | None:
        """Look up the cached prefix of `token_ids` (under the tenant's salt: no tenant hits
        another's), take it, restore any per-sequence state it needs, and reserve room for up
        to `max_new_tokens` of the rest (at least 1). None: no room now, nothing changed."""
        ...

    def reserve(self, seq_ids: Sequence[str], num_new_tokens: Sequence[int]) -> bool:
        """Room for the next num_new_tokens[i] tokens of each admitted sequence; all or nothing."""
        ...

    def append_tokens(self, seq_id: str, token_ids: Sequence[int]) -> None:
        """Sampled tokens join the sequence (their KV is computed by a later step)."""
        ...

    def execute(self, chunks: Sequence[ScheduledChunk]) -> torch.Tensor:
        """Run one step. Returns logits [num chunks with needs_logits, vocab] in chunk order:
        fp32, or fp64 for an fp64 model."""
        ...

    def commit(self, seq_ids: Sequence[str], num_tokens: Sequence[int], next_token_ids: Sequence[int | None]) -> None:
        """The step's tokens have their KV written; each sequence's sampled token (None: no
        token, or the sequence has finished) joins it."""
        ...

    def fork(self, parent_id: str, child_id: str) -> bool:
        """A child sharing every computed token of the parent (copy-on-write on write).
        False (nothing changed) when the child cannot get the cache state of its own that
        it needs (a V4 state block); the engine then recomputes it like a preempted sequence."""
        ...

    def release(self, seq_id: str, reason: ReleaseReason) -> bool:
        """Free the sequence's cache: reason is "finish", "cancel" or "preempt". Once only:
        False for a sequence the runner does not hold."""
        ...

    def num_computed_tokens(self, seq_id: str) -> int: ...

    def num_allocations(self) -> int:
        """Blocks (and per-sequence state blocks) taken from the pools so far. The engine
        tells the admit / reserve calls that allocated from the ones that took nothing."""
        ...

    def kv_read_bytes(self, num_context_tokens: int) -> int:
        """Cache bytes one query over `num_context_tokens` tokens of context reads."""
        ...

    def usage(self) -> CacheUsage:
        """What the cache holds now, each physical block counted once."""
        ...

    def check_integrity(self) -> None: ...

    def cache_stats(self) -> dict[str, float]:
        """Capacity and prefix-cache figures for the performance report."""
        ...
