"""kvpool: a KV-cache system for LLM inference."""

from kvpool.pool.block_table import physical_slot

__all__ = ["physical_slot"]
__version__ = "0.1.0"
