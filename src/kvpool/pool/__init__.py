"""kvpool.pool: block pool, block tables and block hashing. Pure Python, no torch."""

from kvpool.pool.block_pool import BlockPool
from kvpool.pool.block_table import BlockTableCSR, physical_slot, to_csr
from kvpool.pool.hashing import BlockHasher, token_bytes

__all__ = ["BlockHasher", "BlockPool", "BlockTableCSR", "physical_slot", "to_csr", "token_bytes"]
