"""What the scheduler needs from a model and its cache: the model-runner protocol.

The scheduler (engine/scheduler.py) never sees block ids, tensors or the model's family.
It asks a runner to admit a sequence (with prefix lookup), to reserve room for N more
tokens, to execute a batch of token chunks and return logits, to commit computed tokens,
and to release a sequence (finish, cancel, preempt). A Llama on the paged KV pool
(engine/llama_runner.py) and a DeepSeek-V4 model on its classical + state pools both
implement this protocol and run under the same scheduler.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import torch


class Admitted(NamedTuple):
    num_cached_tokens: int  # tokens [0, num_cached) already computed (prefix-cache hit)
    num_scheduled_tokens: int  # tokens [num_cached, num_cached + n) reserved for this step


@dataclass(frozen=True)
class ScheduledChunk:
    """One sequence's work in a step: compute KV for positions [start, start + len(token_ids))."""

    seq_id: str
    token_ids: list[int]
    start: int
    needs_logits: bool  # True when the chunk ends at the sequence's last known token (sample next)


class ModelRunner(Protocol):
    max_model_len: int  # the longest sequence (prompt + output) one sequence may reach
    capacity_tokens: int  # the most tokens a single sequence can hold when it runs alone
    vocab_size: int

    def admit(self, seq_id: str, token_ids: Sequence[int], max_new_tokens: int) -> Admitted | None:
        """Look up the cached prefix of `token_ids`, take it, and reserve room for up to
        `max_new_tokens` of the rest (at least 1). None: no room now, nothing changed."""
        ...

    def reserve(self, seq_id: str, num_new_tokens: int) -> bool:
        """Room for the next `num_new_tokens` tokens of an admitted sequence; all or nothing."""
        ...

    def append_tokens(self, seq_id: str, token_ids: Sequence[int]) -> None:
        """Sampled tokens join the sequence (their KV is computed by a later step)."""
        ...

    def execute(self, chunks: Sequence[ScheduledChunk]) -> torch.Tensor:
        """Run one step. Returns fp32 logits [num chunks with needs_logits, vocab] in chunk order."""
        ...

    def commit(self, seq_id: str, num_tokens: int) -> None:
        """The next `num_tokens` tokens of the sequence have their KV written."""
        ...

    def fork(self, parent_id: str, child_id: str) -> bool:
        """A child sharing every computed token of the parent (copy-on-write on write).
        False (nothing changed) when the child cannot get the cache state of its own that
        it needs (a V4 state block); the engine then recomputes it like a preempted sequence."""
        ...

    def release(self, seq_id: str, reason: str) -> None:
        """Free the sequence's cache: reason is "finish", "cancel" or "preempt". Once only."""
        ...

    def num_computed_tokens(self, seq_id: str) -> int: ...

    def check_integrity(self) -> None: ...

    def cache_stats(self) -> dict[str, float]:
        """Capacity / usage figures for the performance report."""
        ...
