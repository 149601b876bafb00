"""Block tables: logical block index -> physical block id, their slots and their CSR export.

The one place where token positions become physical slots and tables become the CSR layout
of paged attention kernels: `step_tables` (a whole step at once, the engine's path);
`slot_mapping`, `physical_slot` and `to_csr` are views of it. The cache managers call these;
nothing re-derives them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple


class BlockTableCSR(NamedTuple):
    """A batch's block tables in CSR form (FlashInfer's paged-KV layout).

    indptr: [batch + 1]; request i's blocks are indices[indptr[i]:indptr[i+1]].
    last_block_len: [batch]; tokens used in each request's last block (1..block_size; 0
    for a request of no tokens).
    """

    indptr: list[int]
    indices: list[int]
    last_block_len: list[int]


class StepTables(NamedTuple):
    """A step's tables: the slots its new tokens are written to, and the blocks attention reads."""

    slots: list[int]  # [sum(ends - starts)]: positions [starts[i], ends[i]) of request i, in order
    # request i's blocks covering [0, ends[i]) of its table; a window group's table begins at
    # its first block (HybridCacheManager.step_tables shifts the ranges by first * bs): the
    # blocks cover the positions [first * bs, end), and nothing here says where that begins
    csr: BlockTableCSR


def step_tables(
    tables: Sequence[Sequence[int]], starts: Sequence[int], ends: Sequence[int], block_size: int
) -> StepTables:
    """Slots of positions [starts[i], ends[i]) in tables[i], and the CSR of each table over its
    first ends[i] positions. A slot is table[pos // bs] * bs + pos % bs.

    ValueError for block_size <= 0 or a range that is negative or reversed; IndexError when a
    range reaches past its table's blocks."""
    bs = block_size
    if bs <= 0:
        raise ValueError(f"block_size must be positive, got {bs}")
    slots: list[int] = []
    indptr = [0]
    indices: list[int] = []
    last_block_len: list[int] = []
    for table, start, end in zip(tables, starts, ends, strict=True):
        if not 0 <= start <= end:
            raise ValueError(f"positions [{start}, {end}) are not a range of non-negative positions")
        num_blocks = -(-end // bs)
        if num_blocks > len(table):
            raise IndexError(
                f"position {end - 1} lies in logical block {num_blocks - 1}, but only {len(table)} blocks are allocated"
            )
        if end - start == 1:  # the decode case
            slots.append(table[start // bs] * bs + start % bs)
        elif end > start:
            slots.extend([table[pos // bs] * bs + pos % bs for pos in range(start, end)])
        indices.extend(table[:num_blocks])
        indptr.append(len(indices))
        last_block_len.append(end - (num_blocks - 1) * bs if end else 0)
    return StepTables(slots, BlockTableCSR(indptr, indices, last_block_len))


def slot_mapping(block_table: Sequence[int], block_size: int, start: int, end: int) -> list[int]:
    """Slots of positions [start, end) of one table (`step_tables` of one request)."""
    return step_tables((block_table,), (start,), (end,), block_size).slots


def physical_slot(block_table: Sequence[int], block_size: int, token_pos: int) -> int:
    """The slot of one position (`slot_mapping` of [pos, pos + 1)); ValueError for a
    negative position or block id, IndexError past the allocated blocks."""
    if token_pos < 0:
        raise ValueError(f"token_pos must be non-negative, got {token_pos}")
    (slot,) = slot_mapping(block_table, block_size, token_pos, token_pos + 1)
    if slot < 0:
        raise ValueError(f"physical block id must be non-negative, got {block_table[token_pos // block_size]}")
    return slot


def to_csr(tables: Sequence[Sequence[int]], num_tokens: Sequence[int], block_size: int) -> BlockTableCSR:
    """CSR export of `tables`, where request i covers num_tokens[i] tokens (`step_tables`
    with no new tokens). ValueError for a negative count, IndexError past a table."""
    return step_tables(tables, num_tokens, num_tokens, block_size).csr
