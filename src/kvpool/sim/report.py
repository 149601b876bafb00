"""The simulator's report: the performance report of ARCHITECTURE.md with `kvpool run
--json`'s keys (latencies in ms at p50 / p99, throughput, goodput under the SLO, prefix
hit rate, KV capacity, fragmentation, allocation latency, preemptions, block size) plus
`layout`, `replicas`, `routing`, `sim_wall_s`, per-replica figures and the series the
plots draw. Times are virtual: `wall_s` is the simulated span from the first arrival to
the last finish; `sim_wall_s` is how long the simulation itself took. The figures are
computed as every report computes them (kvpool/workload/metrics.py)."""

from __future__ import annotations

from kvpool.capacity.planner import Plan
from kvpool.sim.cost import CostModel
from kvpool.spec.gpus import GPUSpec
from kvpool.spec.models import ModelSpec
from kvpool.workload.metrics import latency_report, mean, num_within_slo, p50_p99, ratio


def describe_cost(cost: CostModel) -> dict:
    """The cost model's named parameters, for the report."""
    return {
        "compute_efficiency": cost.compute_efficiency,
        "bandwidth_efficiency": cost.bandwidth_efficiency,
        "host_mode": cost.host_mode,
        "step_overhead_s": cost.step_overhead_s,
        "layer_launch_s": cost.layer_launch_s,
        "seq_overhead_s": cost.seq_overhead_s,
        "prefill_chunk_overhead_s": cost.prefill_chunk_overhead_s,
        # the formats used ("auto" resolved): the weights' and the cache's
        "weight_dtype": cost.weights.weight_dtype,
        "kv_dtype": cost.layout.kv_dtype,
        "tp_allreduce": "ring over NVLink" if cost.tp > 1 else None,
        "moe_routing": "uniform" if cost.model.moe else None,  # the experts_touched assumption
        "expert_parallel_size": cost.ep if cost.model.moe else None,  # routed experts spread over ep GPUs
    }


def _group_blocks_per_request(replicas) -> dict[str, float]:
    """Hybrid layout: per group, the blocks a running sequence holds on average, over the
    samples with sequences running (a window group: about window / block_size + 1 for a
    decoding sequence; a full group: its context / block_size). {} for other layouts."""
    samples = [(n, held) for rep in replicas for n, held in rep.group_samples if n]
    if not samples:
        return {}
    names = samples[0][1]
    return {name: round(sum(held[name] / n for n, held in samples) / len(samples), 2) for name in names}


def build_report(
    model: ModelSpec,
    gpu: GPUSpec,
    p: Plan,
    config,
    replicas,
    records,
    num_requests: int,
    sim_wall_s: float,
    cost: CostModel,
) -> dict:
    start = min((r.arrival_s for r in records), default=0.0)
    end = max((r.arrival_s + r.latency_s for r in records), default=0.0)
    span = end - start
    generated = sum(r.output_len for r in records)
    good = num_within_slo(records, config.slo_ttft_ms, config.slo_tpot_ms)
    stats = [rep.runner.cache_stats() for rep in replicas]
    queried = sum(s["prefix_queried_tokens"] for s in stats)
    hit = sum(s["prefix_hit_tokens"] for s in stats)
    alloc_us = [t * 1e6 for rep in replicas for t in rep.engine.stats.alloc_call_s]
    frag = [f for rep in replicas for f in rep.frag_samples]
    first = replicas[0]
    per_replica = []
    for rep, st in zip(replicas, stats, strict=True):
        mine = [r for r in records if r.replica == rep.index]
        per_replica.append(
            {
                "replica": rep.index,
                "num_requests": rep.num_routed,
                "prefix_hit_rate": round(st["prefix_hit_rate"], 4),
                "peak_running": rep.peak_running,
                "busy_share": ratio(rep.executor.busy_s, span, 4),
                "preemptions": rep.engine.num_preemptions,
                "num_steps": rep.engine.num_steps,
                "generated_tokens": sum(r.output_len for r in mine),
            }
        )
    report = {
        "model": model.name,
        "gpu": gpu.name,
        "tp": config.tp,
        "layout": first.layout.name,
        "replicas": len(replicas),
        "routing": config.routing,
        "kv_capacity_tokens": int(sum(s["kv_capacity_tokens"] for s in stats)),
        "kv_capacity_bytes": int(sum(s["kv_capacity_bytes"] for s in stats)),
        "kv_pool_bytes": int(first.layout.pool_bytes),
        "block_size": int(stats[0]["block_size"]),
        "num_blocks": int(sum(s["num_blocks"] for s in stats)),
        "state_blocks": int(sum(s["state_blocks"] for s in stats)),
        "block_bytes": first.layout.block_bytes,
        "enable_prefix_caching": config.enable_prefix_caching,
        "max_model_len": first.runner.max_model_len,
        "fragmentation": mean(frag, 4),
        "prefix_hit_rate": ratio(hit, queried, 4),
        "prefix_queried_tokens": int(queried),
        "prefix_hit_tokens": int(hit),
        "replayed_tokens": int(sum(s["replayed_tokens"] for s in stats)),
        "checkpoint_copies": int(sum(s["checkpoint_copies"] for s in stats)),
        "v4_restore": config.v4_restore,
        **p50_p99("alloc_latency_us", alloc_us, 2),
        "num_alloc_calls": sum(rep.engine.stats.num_alloc_calls for rep in replicas),
        "num_noop_alloc_calls": sum(rep.engine.stats.num_noop_calls for rep in replicas),
        **latency_report(records, 2),
        "throughput_tok_s": ratio(generated, span, 2),
        "goodput_req_s": ratio(good, span, 4),
        "slo_attainment": ratio(good, len(records), 4),
        "slo_ttft_ms": config.slo_ttft_ms,
        "slo_tpot_ms": config.slo_tpot_ms,
        "peak_running": max(rep.peak_running for rep in replicas),
        "preemptions": sum(rep.engine.num_preemptions for rep in replicas),
        "num_requests": num_requests,
        "num_finished": len(records),
        "num_generated_tokens": generated,
        "num_steps": sum(rep.engine.num_steps for rep in replicas),
        "wall_s": round(span, 3),
        "sim_wall_s": round(sim_wall_s, 3),
        "interrupted": False,
        "cost_model": describe_cost(cost),
        "per_replica": per_replica,
    }
    groups = _group_blocks_per_request(replicas)
    if groups:
        report["group_blocks_per_request"] = groups
    # series for the plots (not printed in the table)
    report["_series"] = {
        "ttft_ms": sorted(r.ttft_s * 1e3 for r in records if r.ttft_s is not None),
        "tpot_ms": sorted(r.tpot_s * 1e3 for r in records if r.tpot_s is not None),
        "occupancy": [rep.occupancy for rep in replicas],
    }
    return report
