"""The simulator's report: the performance report of ARCHITECTURE.md with `kvpool run
--json`'s keys (latencies in ms at p50 / p99, throughput, goodput under the SLO, prefix
hit rate, KV capacity, fragmentation, allocation latency, preemptions, block size) plus
`layout`, `replicas`, `routing`, `sim_wall_s`, per-replica figures and the series the
plots draw. Times are virtual: `wall_s` is the simulated span from the first arrival to
the last finish; `sim_wall_s` is how long the simulation itself took. The figures are
computed as every report computes them (kvpool/workload/metrics.py)."""

from __future__ import annotations

from array import array
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvpool.capacity.planner import Plan
from kvpool.sim.cost import CostModel
from kvpool.spec.gpus import GPUSpec
from kvpool.spec.models import ModelSpec
from kvpool.workload.metrics import mean, p50_p99, ratio, within_slo

if TYPE_CHECKING:
    from kvpool.engine.engine import RequestOutput


@dataclass(frozen=True, slots=True)
class RequestRecord:
    """A finished request, as the simulator hands it to the report (and to `on_finish`)."""

    request_id: str
    replica: int
    arrival_s: float
    prompt_len: int
    output_len: int
    cached_tokens: int
    ttft_s: float | None
    tpot_s: float | None
    latency_s: float  # a record is made when the request finished

    @classmethod
    def of(cls, out: RequestOutput, replica: int, arrival_s: float, cached_tokens: int) -> RequestRecord:
        """The record of a finished request's output (its first completion's tokens)."""
        assert out.latency_s is not None, f"request {out.request_id!r} has not finished"
        return cls(
            out.request_id,
            replica,
            arrival_s,
            len(out.prompt_token_ids),
            len(out.completions[0].token_ids),
            cached_tokens,
            out.ttft_s,
            out.tpot_s,
            out.latency_s,
        )


class FinishedRequests:
    """What the report needs of the finished requests, kept as they finish instead of the
    records: counts and sums (requests, generated tokens in all and per replica, requests
    within both SLOs), the span's ends (first arrival, last finish), and each latency that
    was measured, in ms, in an array('d'): 24 bytes a request for exact percentiles (a
    100k-request run holds 2.4 MB; a record each held about 200 bytes). The figures are
    those the list of records gave: the same float operations in the same order."""

    def __init__(self, slo_ttft_ms: float, slo_tpot_ms: float) -> None:
        self.slo_ttft_ms, self.slo_tpot_ms = slo_ttft_ms, slo_tpot_ms
        self.num_finished = 0
        self.num_within_slo = 0
        self.generated_tokens: dict[int, int] = {}  # replica index -> tokens its requests generated
        self.start_s = 0.0  # the first arrival (0.0 before any request finished)
        self.end_s = 0.0  # the last finish
        self.ttft_ms = array("d")  # of the requests that measured it
        self.tpot_ms = array("d")
        self.latency_ms = array("d")

    def add(self, r: RequestRecord) -> None:
        end = r.arrival_s + r.latency_s
        if self.num_finished:
            self.start_s, self.end_s = min(self.start_s, r.arrival_s), max(self.end_s, end)
        else:
            self.start_s, self.end_s = r.arrival_s, end
        self.num_finished += 1
        self.num_within_slo += within_slo(r, self.slo_ttft_ms, self.slo_tpot_ms)
        self.generated_tokens[r.replica] = self.generated_tokens.get(r.replica, 0) + r.output_len
        if r.ttft_s is not None:
            self.ttft_ms.append(r.ttft_s * 1e3)
        if r.tpot_s is not None:
            self.tpot_ms.append(r.tpot_s * 1e3)
        self.latency_ms.append(r.latency_s * 1e3)

    def latency_report(self, digits: int) -> dict[str, float | None]:
        """metrics.latency_report's keys: ttft_ms, tpot_ms, latency_ms at p50 / p99 (None
        where no request measured the figure: the TPOTs when no answer had a second token,
        all six when none finished)."""
        return (
            p50_p99("ttft_ms", self.ttft_ms, digits, empty=None)
            | p50_p99("tpot_ms", self.tpot_ms, digits, empty=None)
            | p50_p99("latency_ms", self.latency_ms, digits, empty=None)
        )


def describe_cost(cost: CostModel) -> dict:
    """The cost model's named parameters, for the report."""
    return {
        "compute_efficiency": cost.compute_efficiency,
        "bandwidth_efficiency": cost.bandwidth_efficiency,
        "host_mode": cost.host_mode,
        "step_overhead_s": cost.step_overhead_s,
        "layer_launch_s": cost.layer_launch_s,
        "layer_fixed_s": cost.layer_fixed_s,  # the GPU's fixed time per layer per step
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
    finished: FinishedRequests,
    num_requests: int,
    sim_wall_s: float,
    cost: CostModel,
) -> dict:
    """The report of a run whose finished requests `finished` holds."""
    span = finished.end_s - finished.start_s
    generated = sum(finished.generated_tokens.values())
    good = finished.num_within_slo
    stats = [rep.runner.cache_stats() for rep in replicas]
    queried = sum(s["prefix_queried_tokens"] for s in stats)
    hit = sum(s["prefix_hit_tokens"] for s in stats)
    alloc_us = [t * 1e6 for rep in replicas for t in rep.engine.stats.alloc_call_s]
    frag = [f for rep in replicas for f in rep.frag_samples]
    first = replicas[0]
    dual = first.layout.name == "dual"
    per_replica = []
    for rep, st in zip(replicas, stats, strict=True):
        per_replica.append(
            {
                "replica": rep.index,
                "num_requests": rep.num_routed,
                "prefix_hit_rate": round(st["prefix_hit_rate"], 4),
                "peak_running": rep.peak_running,
                "busy_share": ratio(rep.executor.busy_s, span, 4),
                "preemptions": rep.engine.num_preemptions,
                "num_steps": rep.engine.num_steps,
                "generated_tokens": finished.generated_tokens.get(rep.index, 0),
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
        # kvpool's chunked formats: the full-precision tails of --max-num-seqs requests, of the pool
        **({"kv_tail_bytes": int(first.layout.tail_bytes)} if first.layout.tail_bytes else {}),
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
        # V4's dual pool's settings: null where the run has no dual pool (they were "auto" /
        # true from the config on every model); without prefix caching no turn-end state is kept
        "v4_restore": config.v4_restore if dual else None,
        "v4_turn_ends": config.v4_turn_ends and config.enable_prefix_caching if dual else None,
        "state_adoptions": sum(g.num_adoptions for rep in replicas for g in rep.runner.cache.dual_groups),
        "state_spills": sum(g.num_spills for rep in replicas for g in rep.runner.cache.dual_groups),
        "spill_hits": sum(g.num_spill_hits for rep in replicas for g in rep.runner.cache.dual_groups),
        **p50_p99("alloc_latency_us", alloc_us, 2),
        "num_alloc_calls": sum(rep.engine.stats.num_alloc_calls for rep in replicas),
        "num_noop_alloc_calls": sum(rep.engine.stats.num_noop_calls for rep in replicas),
        **finished.latency_report(2),
        "throughput_tok_s": ratio(generated, span, 2),
        "goodput_req_s": ratio(good, span, 4),
        "slo_attainment": ratio(good, finished.num_finished, 4),
        "slo_ttft_ms": config.slo_ttft_ms,
        "slo_tpot_ms": config.slo_tpot_ms,
        "peak_running": max(rep.peak_running for rep in replicas),
        "preemptions": sum(rep.engine.num_preemptions for rep in replicas),
        "num_requests": num_requests,
        "num_finished": finished.num_finished,
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
        "ttft_ms": sorted(finished.ttft_ms),
        "tpot_ms": sorted(finished.tpot_ms),
        "occupancy": [rep.occupancy for rep in replicas],
    }
    return report
