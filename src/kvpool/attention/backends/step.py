"""The step metadata every model's forward takes: `forward(token_ids, positions, metadata)`.

    token_ids [N] int64   the step's tokens, flat: each sequence's new tokens in order
    positions [N] int64   each token's position in its sequence
    metadata  StepMetadata

`StepMetadata.attention` is what the backend the runner chose once (attention/backends)
made of the step's cache tables in its `begin_step`: the model hands it each layer's
inputs and never sees a block table, a slot or a pool. What a layer hands it depends on the
attention kind, not on the backend:

    kind         the step object                  per layer
    full         PagedStep (paged_step.py),       attend(layer, q [N, H, D], k / v [N, KVH, D]) -> [N, H, D]
                 FunctionStep (a plain function)
    hybrid       HybridStep (hybrid.py)           attend(layer, q, k, v) on full / window layers,
                                                  update(layer, q, k, v, beta, g) on recurrent ones
    dsv4-sparse  DSV4Step (dsv4_sparse.py)        attend(layer, weights, x [N, hidden]) -> [N, hidden]

`logit_rows` names the rows whose logits the forward returns (None: every row), so a
decode step computes the LM head for its sampled rows only and a replay for none.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

# attend(layer, q [N, H, D], k / v [N, KVH, D]) -> [N, H, D]: one layer's attention of the
# step's N tokens (a paged backend also writes k / v into the pool first)
Attend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class StepAttention(Protocol):
    """What every step object has (its per-layer calls are its kind's: the module's table)."""

    @property
    def num_tokens(self) -> int:
        """The N tokens of the flat batch the step was planned for."""
        ...


@dataclass(frozen=True)
class StepMetadata:
    """The third argument of every model's forward (module docstring).

    attention: the step's attention (a backend's `begin_step`, or a `FunctionStep`); its
    `num_tokens` is the N the token ids must have.
    logit_rows: the rows of the flat batch whose logits to return, in that order (None:
    all N). max_position: the largest of the step's positions, known on the host."""

    attention: StepAttention
    logit_rows: Sequence[int] | None = None
    # the step's largest position when the caller knows it on the host (None: the forward
    # reads it off the positions tensor, a device synchronisation a CUDA graph capture refuses)
    max_position: int | None = None

    def check(self, token_ids: torch.Tensor, positions: torch.Tensor) -> None:
        """ValueError naming the mismatch when token_ids / positions are not the [N] the
        step was planned for."""
        n = self.attention.num_tokens
        if token_ids.shape != (n,) or positions.shape != (n,):
            raise ValueError(
                f"token ids of shape {tuple(token_ids.shape)} and positions of shape {tuple(positions.shape)} "
                f"for a step planned for {n} tokens"
            )

    def logit_hidden(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, ...] -> the rows whose logits the forward returns, `logit_rows` in
        order ([len(logit_rows), ...]; hidden itself for None). One index_select over the
        rows as an int64 tensor made in numpy: `hidden[logit_rows]` (the twin,
        tests/test_forward_signature.py) converts the list element by element (~25 us for
        128 rows on the host, on any device) and gathers at twice index_select's time on a
        CPU: 99 vs 21 us for 128 rows of [144, 576] fp32."""
        rows = self.logit_rows
        if rows is None:
            return hidden
        index = torch.from_numpy(np.fromiter(rows, np.int64, len(rows)))
        if hidden.device.type != "cpu":
            index = index.to(hidden.device)
        return hidden.index_select(0, index)


@dataclass(frozen=True)
class FunctionStep:
    """A full-attention step whose attention is a plain function of each layer's q / k / v
    (the contiguous reference's causal attention, a test's probe): no cache."""

    attend: Attend
    num_tokens: int


def function_step(attend: Attend, num_tokens: int, logit_rows: Sequence[int] | None = None) -> StepMetadata:
    """The metadata of a step of `num_tokens` tokens whose every layer attends by `attend`."""
    return StepMetadata(FunctionStep(attend, num_tokens), logit_rows)
