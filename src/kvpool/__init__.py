"""kvpool: a KV-cache system for LLM inference.

`kvpool.LLM` and `kvpool.SamplingParams` (the high-level API, kvpool/llm.py) load on first
use, so `import kvpool` stays free of torch for the pure-Python cache layers."""

from typing import Any

from kvpool.pool.block_table import physical_slot

__all__ = ["LLM", "SamplingParams", "physical_slot"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from kvpool.llm import LLM

        return LLM
    if name == "SamplingParams":
        from kvpool.engine.sampling import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'kvpool' has no attribute {name!r}")
