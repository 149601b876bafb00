"""A hybrid model's attention: one slot-attention backend per attention group (full or
window, slot_attention.py) and the recurrent state update (recurrent.py), bound together
for the model's layers.

The executor hands `begin_step` one `HybridChunk` per request (the request's table in each
attention group, its live state slot and the checkpoints to fill, read from the
coordinator); the `HybridStep` it returns is what the model's layers call, with the flat
batch of every chunk's tokens:

    attend(layer, q [N, H, hd], k / v [N, KVH, hd]) -> [N, H, hd]      full / window layers
    update(layer, q / k / v [N, H, hd], beta / g [N, H]) -> [N, H, hd]  recurrent layers

Each call runs the layer's backend chunk by chunk: a chunk reads its own request's rows
and state only.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import NamedTuple

import torch
from torch import Tensor

from kvpool.attention.backends.recurrent import RecurrentBackend
from kvpool.attention.backends.slot_attention import AttnPlan, SlotAttentionBackend

RECURRENT = "recurrent"  # the layer kind whose state the recurrent backend keeps


class GroupTable(NamedTuple):
    """A request's table in one attention group: block_ids[j] holds positions
    [(first_block + j) * block_size, (first_block + j + 1) * block_size); a chunk reads
    positions from read_start on (0 for full attention, the window's first needed)."""

    first_block: int
    block_ids: Sequence[int]
    read_start: int


class HybridChunk(NamedTuple):
    """One request's chunk of a step: positions [start, start + num_tokens)."""

    start: int
    num_tokens: int
    tables: Mapping[str, GroupTable]  # attention group name -> the request's table there
    state_slot: int | None  # the live recurrent state (None: no recurrent layer)
    checkpoints: tuple[tuple[int, int], ...] = ()  # (position b, slot): snapshot S_b there


class HybridAttention:
    """The backends of one hybrid model's cache, built once by the runner.

    layer_kinds: each model layer's kind, "full", "window" (an attention group of that
    name) or "recurrent"; groups: attention group name -> its backend, holding its layers
    in layer order; recurrent: the state slots of the recurrent layers, in layer order.

    groups[name].kv: [num_blocks * block_size, layers of the group, 2 (K, V), kv_heads, head_dim]
    recurrent.state: [num_slots, recurrent layers, heads, head_dim (v), head_dim (k)]
    """

    def __init__(
        self, layer_kinds: Sequence[str], groups: dict[str, SlotAttentionBackend], recurrent: RecurrentBackend
    ) -> None:
        missing = sorted({k for k in layer_kinds if k != RECURRENT} - set(groups))
        if missing:
            raise ValueError(f"layers of kinds {missing} have no attention group backend (groups: {sorted(groups)})")
        self.groups, self.recurrent = groups, recurrent
        # model layer -> (its group, or "recurrent"; its index among that group's layers)
        seen: dict[str, int] = {}
        self.layer_map: list[tuple[str, int]] = []
        for kind in layer_kinds:
            self.layer_map.append((kind, seen.get(kind, 0)))
            seen[kind] = seen.get(kind, 0) + 1

    def begin_step(self, chunks: Sequence[HybridChunk]) -> HybridStep:
        """The step over `chunks` (their tokens in this order in the flat batch): each
        chunk's slot plan in every attention group, made once for all layers."""
        plans = []
        for c in chunks:
            end = c.start + c.num_tokens
            plans.append(
                {
                    name: self.groups[name].plan_chunk(c.start, end, t.read_start, t.first_block, list(t.block_ids))
                    for name, t in c.tables.items()
                }
            )
        return HybridStep(self, list(chunks), plans)


class HybridStep:
    """One step of a hybrid model's attention (module docstring)."""

    def __init__(self, attention: HybridAttention, chunks: list[HybridChunk], plans: list[dict[str, AttnPlan]]):
        self.attention, self.chunks, self.plans = attention, chunks, plans
        self.num_tokens = sum(c.num_tokens for c in chunks)

    def _rows(self):
        """(chunk, its plans, its rows [lo, hi) of the flat batch), in order."""
        lo = 0
        for c, plans in zip(self.chunks, self.plans, strict=True):
            yield c, plans, lo, lo + c.num_tokens
            lo += c.num_tokens

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """Full / window layer `layer` (the model's index): write each chunk's k, v into its
        group's slots, then attend its q over the positions it may read."""
        group, j = self.attention.layer_map[layer]
        if group == RECURRENT:
            raise ValueError(f"layer {layer} is a recurrent layer, not an attention one")
        backend = self.attention.groups[group]
        outs = [
            backend.attend(j, plans[group], q[lo:hi], k[lo:hi], v[lo:hi], c.start) for c, plans, lo, hi in self._rows()
        ]
        return torch.cat(outs)

    def update(self, layer: int, q: Tensor, k: Tensor, v: Tensor, beta: Tensor, g: Tensor) -> Tensor:
        """Recurrent layer `layer` (the model's index): advance each chunk's live state from
        where its previous chunk left it, filling the chunk's checkpoint slots."""
        kind, j = self.attention.layer_map[layer]
        if kind != RECURRENT:
            raise ValueError(f"layer {layer} is a {kind} attention layer, not a recurrent one")
        rec = self.attention.recurrent
        outs = []
        for c, _, lo, hi in self._rows():
            if c.state_slot is None:
                raise ValueError(f"a chunk at position {c.start} has no state slot for recurrent layer {layer}")
            rows = slice(lo, hi)
            outs.append(
                rec.update(j, c.state_slot, c.checkpoints, c.start, q[rows], k[rows], v[rows], beta[rows], g[rows])
            )
        return torch.cat(outs)
