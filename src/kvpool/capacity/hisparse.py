"""What DeepSeek-V4's HiSparse buys in a plan: the CSA main entries live in host memory but
for a hot set, a fraction of them, on the device; indexer keys, HCA entries and the state
pool stay on the device (DEEPSEEK_V4.md sections 5 and 7; kvpool.storage.dsv4.HotSet).

    device bytes / token = csa_main x fraction + (every other classical byte per token)
    tokens the pool holds = pool bytes / that

The hot set is sized per token of history here (a fraction of every request's CSA
entries); per-request state blocks are not affected. Pure arithmetic on the plan.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvpool.capacity.planner import Plan

CSA_MAIN_GROUP = "csa-entry"


def hisparse_capacity(p: Plan, fraction: float) -> dict[str, float]:
    """Per GPU: bytes per token of history with HiSparse at a hot-set `fraction` in (0, 1],
    and the tokens the plan's KV pool then holds against keeping everything resident (per
    replica, and over the deployment's replicas).
    ValueError for a model without CSA main entries or a fraction outside (0, 1]."""
    if not 0 < fraction <= 1:
        raise ValueError(f"the HiSparse hot-set fraction must be in (0, 1], got {fraction}")
    groups = {g.name: g for g in p.layout.groups}
    if CSA_MAIN_GROUP not in groups:
        raise ValueError(f"{p.model.name} has no CSA layers: HiSparse applies to DeepSeek-V4 models only")
    g = groups[CSA_MAIN_GROUP]
    csa_main = g.num_layers * g.entry_bytes / g.tokens_per_entry
    resident = p.layout.bytes_per_token
    with_hisparse = resident - csa_main * (1 - fraction)
    pool = p.ledger.pool_bytes
    return {
        "hot_set_fraction": fraction,
        "csa_main_bytes_per_token": csa_main,
        "kv_bytes_per_token_resident": resident,
        "kv_bytes_per_token_hisparse": with_hisparse,
        "host_bytes_per_token": csa_main * (1 - fraction),
        "pool_tokens_resident": int(pool // resident) if pool > 0 else 0,
        "pool_tokens_hisparse": int(pool // with_hisparse) if pool > 0 else 0,
        "token_gain": resident / with_hisparse,
        # every replica (TP group) holds its own pool: the deployment's tokens
        "replicas": p.replicas,
        "deployment_tokens_resident": int(pool // resident) * p.replicas if pool > 0 else 0,
        "deployment_tokens_hisparse": int(pool // with_hisparse) * p.replicas if pool > 0 else 0,
    }
