"""kvpool.pool: block pool, prefix index, block tables and block hashing. Pure Python, no torch."""

from kvpool.pool.block_pool import BlockPool, PrefixBlock, PrefixMatch
from kvpool.pool.block_table import BlockTableCSR, StepTables, physical_slot, slot_mapping, step_tables, to_csr
from kvpool.pool.hashing import BlockHasher, token_bytes

__all__ = [
    "BlockHasher",
    "BlockPool",
    "BlockTableCSR",
    "PrefixBlock",
    "PrefixMatch",
    "StepTables",
    "physical_slot",
    "slot_mapping",
    "step_tables",
    "to_csr",
    "token_bytes",
]
