"""DeepSeek-V4's three SWA strategies for a persistent prefix cache (DEEPSEEK_V4.md section 6;
the V4 report, section 3.5.2).

A V4 prefix hit reuses the compressed entries up to the last complete classical block,
which the tiers store like any block. The state at the hit (the sliding window of every
layer, and the compressor rows the next entry still needs) must be rebuilt exactly, and
each strategy trades stored bytes for recompute:

  full      a window snapshot at every block boundary: the last min(span, n_win) tokens'
            SWA KV of every layer, so every token's SWA KV is stored once (V4: n_win = span
            = 128); a hit reads the snapshots of its last n_win tokens and recomputes nothing;
  periodic  a window snapshot (the last n_win tokens) at every boundary that is a multiple
            of `period` tokens; a hit restores the nearest one at or below it and recomputes
            the tokens from there (an earlier one when that one is missing);
  zero      no snapshot; a hit recomputes the last n_win x num_layers tokens over the cached
            entries (the recompute restore the device prefix cache already uses).

A snapshot also holds the compressor rows pending at its boundary (the overlapping CSA
compressor keeps the previous block's rows; at a boundary nothing else is pending), so
with it the state at the boundary is exactly what the forward left there. A strategy
never reads a snapshot when recomputing from scratch is cheaper (a snapshot further back
than n_win x num_layers tokens): every strategy restores with at most that recompute.

Snapshots are tier entries like blocks: filed under a key derived from the boundary
block's content key and the number of window rows they hold, with the block's descriptor
(its layout marked as a window snapshot), so the descriptor contract, tenants, checksums,
LRU and reclaim apply to them unchanged. Pure Python: no torch.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import xxhash

from kvpool.tiers.descriptor import BlockDescriptor

SWA_STRATEGIES: tuple[str, ...] = ("full", "periodic", "zero")
_SNAPSHOT_MAGIC = b"kvpool-swa-snapshot\x00"


@dataclass(frozen=True)
class SWAStrategy:
    kind: str = "zero"
    period: int = 0  # periodic: tokens between snapshots (a multiple of the span)

    def __post_init__(self) -> None:
        if self.kind not in SWA_STRATEGIES:
            raise ValueError(f"unknown SWA strategy {self.kind!r}; one of {', '.join(SWA_STRATEGIES)}")
        if self.kind == "periodic" and self.period <= 0:
            raise ValueError(f"--swa-strategy periodic needs --swa-period P > 0, got {self.period}")
        if self.kind != "periodic" and self.period:
            raise ValueError(f"--swa-period is for --swa-strategy periodic, not {self.kind}")

    def check(self, span: int) -> SWAStrategy:
        """Itself, or ValueError when the period is not a whole number of classical blocks."""
        if self.kind == "periodic" and self.period % span:
            raise ValueError(f"--swa-period {self.period} must be a multiple of the classical block span {span}")
        return self

    def window_rows(self, span: int, window: int) -> int:
        """Window rows a snapshot holds: full, the block's own tokens (capped at the
        window); periodic, the whole window."""
        return min(span, window) if self.kind == "full" else window

    def stores(self, boundary: int) -> bool:
        """Whether a snapshot is kept at this block boundary (a multiple of the span)."""
        if self.kind == "zero" or boundary <= 0:
            return False
        return self.kind == "full" or boundary % self.period == 0

    def snapshot_positions(self, start: int, end: int, span: int) -> list[int]:
        """Boundaries in (start, end] a step over tokens [start, end) crosses and snapshots."""
        first = start // span + 1
        return [b * span for b in range(first, end // span + 1) if self.stores(b * span)]

    def restore_points(self, hit: int, span: int, window: int, num_layers: int) -> list[tuple[int, list[int]]]:
        """Where a hit of `hit` tokens may restore its state from, best first: (C, the
        boundaries whose snapshots make the state at C), for every stored boundary C at or
        below the hit from which recomputing [C, hit) costs no more than the zero strategy's
        n_win x num_layers tokens; [] for none (recompute). Full mode needs the snapshots of
        the window before C, one per block; periodic mode one."""
        floor = hit - window * num_layers
        if self.kind == "zero" or hit <= 0:
            return []
        step = span if self.kind == "full" else self.period
        rows = self.window_rows(span, window)
        points = range(hit - hit % step, max(0, floor - 1), -step)
        if self.kind == "periodic":
            return [(point, [point]) for point in points if point > 0]
        return [(point, list(range(point, max(0, point - window), -rows))) for point in points if point > 0]


def snapshot_key(block_key: bytes, num_rows: int) -> bytes:
    """The tier key of the window snapshot at the end of the block whose content key is
    `block_key`, holding `num_rows` window rows."""
    return xxhash.xxh3_128_digest(_SNAPSHOT_MAGIC + num_rows.to_bytes(4, "little") + block_key)


def snapshot_descriptor(block_key: bytes, block: BlockDescriptor, num_rows: int) -> BlockDescriptor:
    """The boundary block's descriptor, filed under the snapshot's key (its parent: the
    block), with the layout marked as a window snapshot of `num_rows` rows."""
    return dataclasses.replace(
        block,
        content_key=snapshot_key(block_key, num_rows).hex(),
        parent_key=block_key.hex(),
        layout_id=f"{block.layout_id}:swa-snapshot{num_rows}",
    )
