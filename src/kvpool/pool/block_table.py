"""Block tables: logical block index -> physical block id, and their CSR export."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple


def physical_slot(block_table: Sequence[int], block_size: int, token_pos: int) -> int:
    """The slot of `token_pos` in a linear KV pool: block_table[pos // bs] * bs + pos % bs.

    ValueError for block_size <= 0, token_pos < 0 or a negative block id; IndexError when
    the position lies past the allocated blocks.
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    if token_pos < 0:
        raise ValueError(f"token_pos must be non-negative, got {token_pos}")
    logical_block, offset = divmod(token_pos, block_size)
    if logical_block >= len(block_table):
        raise IndexError(
            f"token_pos {token_pos} lies in logical block {logical_block}, "
            f"but only {len(block_table)} blocks are allocated"
        )
    block_id = block_table[logical_block]
    if block_id < 0:
        raise ValueError(f"physical block id must be non-negative, got {block_id}")
    return block_id * block_size + offset


class BlockTableCSR(NamedTuple):
    """A batch's block tables in CSR form (FlashInfer's paged-KV layout).

    indptr: [batch + 1]; request i's blocks are indices[indptr[i]:indptr[i+1]].
    last_block_len: [batch]; tokens used in each request's last block (1..block_size).
    """

    indptr: list[int]
    indices: list[int]
    last_block_len: list[int]


def to_csr(tables: Sequence[Sequence[int]], num_tokens: Sequence[int], block_size: int) -> BlockTableCSR:
    """CSR export of `tables`, where request i covers num_tokens[i] tokens."""
    indptr = [0]
    indices: list[int] = []
    last_block_len: list[int] = []
    for table, n in zip(tables, num_tokens, strict=True):
        num_blocks = -(-n // block_size)
        if num_blocks > len(table):
            raise ValueError(f"{n} tokens need {num_blocks} blocks, the table holds {len(table)}")
        indices.extend(table[:num_blocks])
        indptr.append(len(indices))
        last_block_len.append(n - (num_blocks - 1) * block_size if n else 0)
    return BlockTableCSR(indptr, indices, last_block_len)
