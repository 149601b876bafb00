"""Contiguous reference attention: no cache, full recompute. The oracle for the paged path."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from kvpool.attention.backends.step import StepMetadata, function_step


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """One sequence, all positions: q [T, H, D], k / v [T, KVH, D] -> [T, H, D].

    GQA by repeating each KV head for its H / KVH query heads (the plainest form)."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True)
    return out.transpose(0, 1)


def contiguous_step(num_tokens: int, logit_rows: Sequence[int] | None = None) -> StepMetadata:
    """The metadata of a Llama forward over one whole sequence, positions [0, num_tokens),
    every layer attending by `causal_attention` (no cache): the contiguous reference."""
    return function_step(lambda layer, q, k, v: causal_attention(q, k, v), num_tokens, logit_rows)


def reference_logits(model, token_ids: list[int], fused: bool = True) -> torch.Tensor:
    """Logits [T, vocab] of one sequence by full recompute through `causal_attention`.

    fused: the model's own math between the attentions (its C kernels when it has them),
    so that a comparison with the engine isolates the cache and paged attention. The
    fused and plain layer math differ by rounding (~1 ulp an op), which 30 layers carry to
    the logits; tests/test_engine.py and tests/test_model.py bound both against fp64."""
    ids = torch.tensor(token_ids, dtype=torch.long, device=model.device)
    positions = torch.arange(len(token_ids), device=model.device)
    return model.forward(ids, positions, contiguous_step(len(token_ids)), fused=fused)
