"""Block tables: logical block index -> physical block id, their slots and their CSR export.

The one place where a token position becomes a physical slot: `slot_mapping` (and
`physical_slot`, one position of it), and where tables become the CSR layout of paged
attention kernels: `to_csr`. The cache managers call these; nothing re-derives them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple


def slot_mapping(block_table: Sequence[int], block_size: int, start: int, end: int) -> list[int]:
    """Slots of positions [start, end): block_table[pos // bs] * bs + pos % bs.

    ValueError for block_size <= 0 or a range that is negative or reversed; IndexError when
    the range reaches past the allocated blocks."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    if not 0 <= start <= end:
        raise ValueError(f"positions [{start}, {end}) are not a range of non-negative positions")
    if end > len(block_table) * block_size:
        raise IndexError(
            f"position {end - 1} lies in logical block {(end - 1) // block_size}, "
            f"but only {len(block_table)} blocks are allocated"
        )
    if end - start == 1:  # the decode case
        block_id = block_table[start // block_size]
        return [block_id * block_size + start % block_size]
    return [block_table[pos // block_size] * block_size + pos % block_size for pos in range(start, end)]


def physical_slot(block_table: Sequence[int], block_size: int, token_pos: int) -> int:
    """The slot of one position (`slot_mapping` of [pos, pos + 1)); ValueError for a
    negative position or block id, IndexError past the allocated blocks."""
    if token_pos < 0:
        raise ValueError(f"token_pos must be non-negative, got {token_pos}")
    (slot,) = slot_mapping(block_table, block_size, token_pos, token_pos + 1)
    if slot < 0:
        raise ValueError(f"physical block id must be non-negative, got {block_table[token_pos // block_size]}")
    return slot


class BlockTableCSR(NamedTuple):
    """A batch's block tables in CSR form (FlashInfer's paged-KV layout).

    indptr: [batch + 1]; request i's blocks are indices[indptr[i]:indptr[i+1]].
    last_block_len: [batch]; tokens used in each request's last block (1..block_size; 0
    for a request of no tokens).
    """

    indptr: list[int]
    indices: list[int]
    last_block_len: list[int]


def to_csr(tables: Sequence[Sequence[int]], num_tokens: Sequence[int], block_size: int) -> BlockTableCSR:
    """CSR export of `tables`, where request i covers num_tokens[i] tokens.

    ValueError for a negative count or one that needs more blocks than its table holds."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    indptr = [0]
    indices: list[int] = []
    last_block_len: list[int] = []
    for table, n in zip(tables, num_tokens, strict=True):
        num_blocks = -(-n // block_size)
        if n < 0 or num_blocks > len(table):
            raise ValueError(f"{n} tokens: outside what a table of {len(table)} blocks of {block_size} covers")
        indices.extend(table[:num_blocks])
        indptr.append(len(indices))
        last_block_len.append(n - (num_blocks - 1) * block_size if n else 0)
    return BlockTableCSR(indptr, indices, last_block_len)
