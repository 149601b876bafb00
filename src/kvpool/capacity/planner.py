"""The capacity planner: how much KV fits, how many requests, how long a context.

For a model on `num_gpus` GPUs in tensor-parallel groups of `tp` (num_gpus / tp data-
parallel replicas), every GPU of a group holds its share of the weights and the same
number of tokens of KV. The ledger (`kvpool.capacity.ledger`) gives the per-GPU pool; a
request of context L costs `layout.request_bytes(L)` of it (whole blocks of every page
group plus, for V4, one state block, and for kvpool's chunked formats the full-precision
tails their storage keeps per running request). Then

    max concurrent requests at L = floor(pool / request_bytes(L))  (per replica)
    max context at n requests     = the largest L with n * request_bytes(L) <= pool

request_bytes is non-decreasing in L, so the second is a binary search. A model whose
layers are all windowed has bounded request bytes; its context is then limited by the
model's `max_position_embeddings`, not by memory.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from kvpool.capacity.engine import FP32, EngineConfig, build_engine_ledger, engine_max_context
from kvpool.capacity.fragmentation import Fragmentation, measure_fragmentation, sample_lengths
from kvpool.capacity.kv import KVLayout, kv_layout
from kvpool.capacity.ledger import Ledger, LedgerAssumptions, build_ledger
from kvpool.capacity.weights import WeightBytes, weight_bytes
from kvpool.spec.gpus import GPUSpec
from kvpool.spec.models import ModelSpec

_MAX_SEARCH_LEN = 1 << 36  # a context beyond any model's positions: "memory is not the limit"
MAX_SAMPLED_SEQS = 100_000  # fragmentation is measured on at most this many sampled requests


@dataclass(frozen=True)
class Plan:
    model: ModelSpec
    gpu: GPUSpec
    num_gpus: int
    tp: int
    layout: KVLayout
    weights: WeightBytes
    ledger: Ledger
    context_len: int
    concurrency: int | None  # requests over the whole deployment, if asked
    max_concurrent_per_replica: int  # at context_len
    max_context_len: int | None  # at `concurrency`, capped by the model's positions
    max_context_memory_len: int | None  # memory bound alone (may exceed the model's positions)
    occupancy: dict[str, float]  # the pool filled with max_concurrent_per_replica requests
    fragmentation: Fragmentation
    fragmentation_bytes_per_slot: float
    length_distribution: str
    seed: int
    lengths_past_context: int = 0  # a lognormal's draws past context_len, left out of the measurement

    @property
    def replicas(self) -> int:
        return self.num_gpus // self.tp

    @property
    def max_concurrent_requests(self) -> int:
        return self.max_concurrent_per_replica * self.replicas

    @property
    def fits(self) -> bool:
        # On a GPU the pool is what the other terms leave, so a total past the capacity shows
        # as an empty pool (and its float sum may pass the capacity by a rounding where the pool
        # took every byte); kvpool's CPU engine takes --kv-memory whatever the machine holds,
        # and a ledger of 130 % of its RAM (llama-3.1-8b's fp32 weights on 23.5 GiB) "fit".
        within = self.gpu.kind != "cpu" or self.ledger.total <= self.ledger.capacity
        return self.ledger.pool_bytes > 0 and self.max_concurrent_per_replica > 0 and within

    def as_dict(self) -> dict[str, Any]:
        """One JSON-ready object (what `kvpool plan --json` prints); byte counts are per GPU
        unless a key says otherwise."""
        # the unsharded model, for whole-model figures
        whole = kv_layout(self.model, self.layout.kv_dtype, self.layout.block_size, 1, self.layout.indexer_format)
        frag = self.fragmentation
        per_slot = self.fragmentation_bytes_per_slot
        return {
            "model": self.model.name,
            "model_type": self.model.model_type,
            "attention": self.model.attention_label,
            "num_layers": self.model.num_layers,
            "params": self.weights.params.total,
            "weight_dtype": self.weights.weight_dtype,
            "weight_bytes": self.weights.total_bytes,
            "gpu": self.gpu.name,
            "gpu_memory_bytes": self.gpu.memory_bytes,
            "num_gpus": self.num_gpus,
            "tp": self.tp,
            "ep": self.weights.ep,
            "replicas": self.replicas,
            "kv_dtype": self.layout.kv_dtype,
            "block_size": self.layout.block_size,
            "kv_sharded_by_head": self.layout.sharded_by_head,
            "kv_bytes_per_token": whole.bytes_per_token,  # whole model, unpadded
            "kv_bytes_per_token_per_gpu": self.layout.bytes_per_token,
            "state_bytes_per_request": self.layout.state_bytes_per_request,
            # of which the chunked formats' full-precision tails (storage/kv.py), per GPU
            "kv_tail_bytes_per_request": self.layout.tail_bytes_per_request,
            "context_len": self.context_len,
            "kv_bytes_at_context": whole.kv_bytes_at_context(self.context_len),  # whole model, one request
            "kv_bytes_at_context_per_gpu": self.layout.request_bytes(self.context_len),  # paged, padded
            "kv_pool_bytes_per_gpu": self.ledger.pool_bytes,
            "max_concurrent_requests": self.max_concurrent_requests,
            "max_concurrent_requests_per_replica": self.max_concurrent_per_replica,
            "concurrency": self.concurrency,
            "max_context_len": self.max_context_len,
            "max_context_memory_len": self.max_context_memory_len,
            "max_position_embeddings": self.model.max_position_embeddings,
            "fits": self.fits,
            "ledger": self.ledger.as_dict(),
            "ledger_details": self.ledger.details,
            "kv_pool_occupancy": self.occupancy,
            "fragmentation": {
                "block_size": frag.block_size,
                "num_seqs": frag.num_seqs,
                "length_distribution": self.length_distribution,
                "seed": self.seed,
                "lengths_past_context": self.lengths_past_context,
                "bound_slots": frag.bound_slots,
                "expected_slots": frag.expected_slots,
                "measured_slots": frag.wasted_slots,
                "measured_rate": frag.rate,
                "bytes_per_slot_per_gpu": per_slot,
                "bound_bytes": frag.bound_slots * per_slot,
                "expected_bytes": frag.expected_slots * per_slot,
                "measured_bytes": frag.wasted_slots * per_slot,
            },
        }


def _state_words(layout: KVLayout) -> str:
    if layout.tail_bytes_per_request:
        return " and its full-precision tails"
    return " and its state" if layout.state_block_bytes else ""


def max_concurrent(layout: KVLayout, pool_bytes: float, context_len: int) -> int:
    """Requests of `context_len` tokens that fit in `pool_bytes` on one GPU."""
    if context_len <= 0:
        raise ValueError(f"context_len must be positive, got {context_len}")
    return int(pool_bytes // layout.request_bytes(context_len))


def max_context(layout: KVLayout, pool_bytes: float, num_requests: int) -> int:
    """Largest context L with num_requests * request_bytes(L) <= pool_bytes (0 if none;
    `_MAX_SEARCH_LEN` when memory never runs out, e.g. only windowed layers)."""
    if num_requests <= 0:
        raise ValueError(f"num_requests must be positive, got {num_requests}")

    def fits(n_tokens: int) -> bool:
        return num_requests * layout.request_bytes(n_tokens) <= pool_bytes

    if not fits(1):
        return 0
    lo, hi = 1, 2  # invariant: fits(lo)
    while fits(hi):
        lo, hi = hi, hi * 2
        if hi > _MAX_SEARCH_LEN:
            return _MAX_SEARCH_LEN
    while hi - lo > 1:  # fits(lo), not fits(hi)
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def occupancy(layout: KVLayout, pool_bytes: float, context_len: int, num_requests: int) -> dict[str, float]:
    """Where the pool's bytes go with `num_requests` requests of `context_len` tokens.

    data / quant_scales: the cached entries; alignment_padding: per-layer block round-up;
    tail_waste: unfilled slots of partial blocks (internal fragmentation); state: V4 state
    blocks, or kv_tails: the chunked formats' full-precision tails (the per-request state of
    a GQA layout); unused: the rest. The lines sum to pool_bytes.
    """
    data = scales = padding = tail = 0.0
    for g in layout.groups:
        blocks = g.num_blocks(context_len)
        entries = g.cached_tokens(context_len) // g.tokens_per_entry
        data += entries * g.num_layers * g.data_bytes_per_entry
        scales += entries * g.num_layers * g.scale_bytes_per_entry
        padding += blocks * g.padding_bytes_per_block
        tail += blocks * (g.data_bytes_per_block + g.scale_bytes_per_block) - entries * g.num_layers * g.entry_bytes
    out = {
        "data": data * num_requests,
        "quant_scales": scales * num_requests,
        "alignment_padding": padding * num_requests,
        "tail_waste": tail * num_requests,
        ("kv_tails" if layout.tail_bytes_per_request else "state"): float(layout.state_block_bytes * num_requests),
    }
    out["unused"] = pool_bytes - sum(out.values())
    return out


def plan(
    model: ModelSpec,
    gpu: GPUSpec,
    num_gpus: int = 1,
    tp: int = 1,
    context_len: int | None = None,
    concurrency: int | None = None,
    block_size: int | None = None,
    kv_dtype: str = "auto",
    indexer_format: str | None = None,
    weight_dtype: str = "auto",
    assumptions: LedgerAssumptions | None = None,
    length_distribution: str | None = None,
    seed: int = 0,
    expert_parallel: bool = False,
    engine: EngineConfig | None = None,
) -> Plan:
    """Plan `model` on `num_gpus` x `gpu` with TP size `tp`.

    context_len defaults to the model's max_position_embeddings; concurrency (requests over
    the whole deployment) is optional and sets the max-context question and the sample size
    of the fragmentation measurement (else the max concurrency found is used).
    expert_parallel splits the routed experts over all `num_gpus` GPUs while attention runs
    in num_gpus / tp data-parallel replicas, each with its own KV pool (DeepSeek-style EP +
    DP attention); without it experts are split over the TP group like other weights.

    engine: plan kvpool's own CPU engine serving this configuration (`gpu` is then the
    machine, `cpu_device()`): fp32 weights and KV, a pool of `engine.kv_memory_bytes`, the
    ledger of capacity/engine.py; context_len defaults to the longest request it holds.
    """
    if engine is not None:
        if (num_gpus, tp, expert_parallel) != (1, 1, False):
            raise ValueError("kvpool's CPU engine runs in one process: no tensor or expert parallelism")
        if kv_dtype not in ("auto", "fp32") or weight_dtype not in ("auto", "fp32"):
            raise ValueError("kvpool's CPU engine holds fp32 weights and fp32 KV")
        if block_size not in (None, engine.block_size):
            raise ValueError(f"block_size {block_size} differs from the engine's {engine.block_size}")
        kv_dtype, weight_dtype, block_size = "fp32", "fp32", engine.block_size
    if num_gpus <= 0 or tp <= 0:
        raise ValueError(f"num_gpus and tp must be positive, got num_gpus={num_gpus}, tp={tp}")
    if num_gpus % tp:
        raise ValueError(f"num_gpus={num_gpus} is not a multiple of tp={tp}")
    if concurrency is not None and concurrency <= 0:
        raise ValueError(f"concurrency must be positive, got {concurrency}")
    ctx = model.max_position_embeddings if context_len is None else context_len
    if ctx <= 0:
        raise ValueError(f"context_len must be positive, got {ctx}")
    if expert_parallel and model.moe is None:
        raise ValueError(f"{model.name} has no experts to split: expert parallelism needs a MoE model")
    ep = num_gpus if expert_parallel else None
    if engine is None:
        assumptions = assumptions if assumptions is not None else LedgerAssumptions()
    # the CPU engine's storage pads nothing: one tensor per layer, blocks back to back; the
    # chunked formats' tails are in the compute dtype (the activations')
    extra = {"alignment": FP32} if engine else {"compute_bytes": assumptions.activation_bytes}
    layout = kv_layout(model, kv_dtype, block_size, tp, indexer_format, **extra)
    weights = weight_bytes(model, tp, weight_dtype, ep)
    if engine is not None:
        ctx = engine_max_context(model, layout, engine) if context_len is None else ctx
        ledger = build_engine_ledger(model, layout, weights.per_gpu_bytes, gpu.memory_bytes, engine)
    else:
        ledger = build_ledger(model, layout, weights.per_gpu_bytes, gpu.memory_bytes, ctx, assumptions, ep)
    pool = ledger.pool_bytes
    per_replica = max_concurrent(layout, pool, ctx)

    replicas = num_gpus // tp
    max_ctx = max_ctx_mem = None
    if concurrency is not None:
        per_replica_requests = math.ceil(concurrency / replicas)
        # More requests than the pool holds at any context: "max context at N requests: 0
        # tokens" and status 0 read as an answer, not as N not fitting. (A pool that holds no
        # request at all is the plan's own failure: it does not fit, status 1.)
        most = max_concurrent(layout, pool, 1) if pool > 0 else 0
        if 0 < most < per_replica_requests:
            raise ValueError(
                f"--concurrency {concurrency:,} does not fit the KV pool at any context: its "
                f"{pool / 2**30:,.2f} GiB per GPU hold at most {most:,} requests of one token "
                f"({layout.request_bytes(1):,} B each: a block of every group"
                f"{_state_words(layout)}), {most * replicas:,} over "
                f"{replicas:,} replica{'s' if replicas > 1 else ''}; ask for {most * replicas:,} or fewer"
            )
        max_ctx_mem = max_context(layout, pool, per_replica_requests)
        max_ctx = min(max_ctx_mem, model.max_position_embeddings)

    num_sampled = min(concurrency or max(per_replica * replicas, 1), MAX_SAMPLED_SEQS)
    dist = length_distribution or f"uniform:1:{ctx}"
    lengths = sample_lengths(dist, num_sampled, seed)
    # A request past the context is one an engine refuses: its tail measures nothing real
    # (`fixed:100000` at --max-model-len 4096 printed its 0 slots as the measured waste). A
    # bounded distribution (fixed, uniform) past it is the caller's to correct; a lognormal's
    # tail has no bound, and its draws past the context are left out and counted.
    past = sum(n > ctx for n in lengths)
    if past and (not dist.startswith("lognormal:") or past == len(lengths)):
        raise ValueError(
            f"length distribution (--lengths) {dist} draws requests past the context of {ctx:,} tokens "
            f"({past:,} of the {len(lengths):,} drawn, the longest {max(lengths):,}); draw lengths within it"
        )
    if past:
        lengths = [n for n in lengths if n <= ctx]
    frag = measure_fragmentation(lengths, layout.block_size)
    # A token slot's bytes in the groups that page token by token (V4's tail lives in state).
    bytes_per_slot = sum(g.bytes_per_token for g in layout.groups if not g.complete_blocks_only)

    return Plan(
        model=model,
        gpu=gpu,
        num_gpus=num_gpus,
        tp=tp,
        layout=layout,
        weights=weights,
        ledger=ledger,
        context_len=ctx,
        concurrency=concurrency,
        max_concurrent_per_replica=per_replica,
        max_context_len=max_ctx,
        max_context_memory_len=max_ctx_mem,
        occupancy=occupancy(layout, pool, ctx, per_replica),
        fragmentation=frag,
        fragmentation_bytes_per_slot=bytes_per_slot,
        length_distribution=dist,
        seed=seed,
        lengths_past_context=past,
    )
