"""kvpool.capacity: bytes per token by kind, the peak-memory ledger, the planner (and its P/D
split, pd.py) and internal fragmentation (seed 003's capacity model)."""

from kvpool.capacity.fragmentation import (
    Fragmentation,
    fragmentation_bound,
    fragmentation_expectation,
    measure_fragmentation,
    sample_lengths,
)
from kvpool.capacity.kv import KVLayout, PageGroup, kv_layout
from kvpool.capacity.ledger import Ledger, LedgerAssumptions, build_ledger
from kvpool.capacity.pd import plan_pd
from kvpool.capacity.planner import Plan, max_concurrent, max_context, plan
from kvpool.capacity.weights import WeightBytes, weight_bytes

__all__ = [
    "Fragmentation",
    "KVLayout",
    "Ledger",
    "LedgerAssumptions",
    "PageGroup",
    "Plan",
    "WeightBytes",
    "build_ledger",
    "fragmentation_bound",
    "fragmentation_expectation",
    "kv_layout",
    "max_concurrent",
    "max_context",
    "measure_fragmentation",
    "plan",
    "plan_pd",
    "sample_lengths",
    "weight_bytes",
]
