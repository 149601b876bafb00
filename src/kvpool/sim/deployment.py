"""One simulated deployment from plain values: what `kvpool simulate` runs once for each
combination of its flags, callable without them.

    from kvpool.sim.deployment import SimOptions, grid, simulate_deployment

    options = SimOptions(workload="uniform", requests=40)
    (point,) = grid(("llama-3.1-8b",), ("h200",), (None,), (None,), (None,), ("round-robin",), (8.0,))
    report = simulate_deployment(options, point)  # the dict `kvpool simulate --json` prints

A point of the grid (`grid`) is a dict of the axes a sweep varies: model, gpu, tp, layout,
block_size, routing, rate (tp, layout, block_size None: the planner's or the model's
default; rate: new sessions a second, inf: all at once). `SimOptions` holds
everything the points of one grid share: the deployment's formats and engine limits, the
SLO, the workload. `deployment_of` turns a point into the planner's model spec, the GPU
preset, the tensor-parallel size, the cost model and the simulator's `SimConfig`, refusing
a deployment that cannot run with a ValueError that says why (a sweep leaves such points
out: sim/sweep.py `runnable`). Error messages name the `kvpool simulate` flag a value
came from, so the CLI passes them on as they are.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    from kvpool.capacity.ledger import LedgerAssumptions
    from kvpool.sim.cost import CostModel
    from kvpool.sim.simulator import SimConfig
    from kvpool.spec.gpus import GPUSpec
    from kvpool.spec.models import ModelSpec
    from kvpool.workload.sessions import Workload

WORKLOADS = ("chat", "agentic", "uniform")


@dataclass(frozen=True)
class SimOptions:
    """The settings every point of a grid shares (`kvpool simulate`'s flags of the same names,
    kv_dtype's being --kv-cache-dtype; the defaults are its defaults)."""

    # the deployment
    gpu_memory_utilization: float = 1.0
    kv_dtype: str = "auto"
    weight_dtype: str = "auto"
    host_mode: str = "graph"
    enable_expert_parallel: bool = False
    calibration: str | None = None  # a GPU fit's name or file (sim/gpufit.py); None: the GPU defaults
    replicas: int = 1  # with prefill_replicas: the decode replicas
    prefill_replicas: int = 0
    kv_transfer_bandwidth: float | None = None  # bytes/s of P/D's link (None: 50 GB/s)
    kv_transfer_latency_ms: float | None = None  # (None: 0.1 ms)
    load_cap: float = 1.5
    # the engine
    enable_prefix_caching: bool = True
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int | None = None
    v4_restore: str = "auto"
    v4_turn_ends: bool = True
    v4_checkpoints: int | None = None
    slo_ttft_ms: float = 2000.0
    slo_tpot_ms: float = 100.0
    # the workload
    workload: str = "chat"
    trace: str | None = None  # a JSONL trace replayed instead of `workload`
    trace_block_size: int = 512
    requests: int = 1000
    sessions: int | None = None
    turns: int | None = None
    prompt_len: tuple[int, int] = (128, 2048)
    output_len: tuple[int, int] = (64, 512)
    seed: int = 0


class PlannedDeployment(NamedTuple):
    """What one point of a grid runs on."""

    model: ModelSpec
    gpu: GPUSpec
    tp: int
    cost: CostModel
    config: SimConfig


def gpu_preset(name: str, utilization: float = 1.0) -> GPUSpec:
    """--gpu's preset (any case) at --gpu-memory-utilization of its memory, or the cpu preset."""
    from kvpool.sim.cost import cpu_preset
    from kvpool.spec.gpus import get_gpu

    if name.lower() == "cpu":
        if utilization != 1.0:
            raise ValueError("--gpu-memory-utilization sizes a GPU; --gpu cpu is this machine, calibrated")
        return cpu_preset()
    try:
        gpu = get_gpu(name)
    except ValueError as e:
        raise ValueError(f"--gpu: {e}") from None
    return dataclasses.replace(gpu, memory_bytes=int(gpu.memory_bytes * utilization))


def load_calibration(name: str | None, gpu: GPUSpec) -> dict[str, float]:
    """--calibration's fitted CostModel parameters ({} without one). A calibration is a GPU's:
    the cpu preset has its own engine fit (kvpool bench sim)."""
    if name is None:
        return {}
    if gpu.kind != "cuda":
        raise ValueError(f"--calibration fits a GPU's cost model; --gpu {gpu.name} is not a GPU")
    from kvpool.sim.gpufit import load_fit

    try:
        return load_fit(name).overrides()
    except ValueError as e:
        raise ValueError(f"--calibration: {e}") from None


def make_workload(options: SimOptions, model: ModelSpec, rate: float) -> Workload:
    """The workload of one point: the trace, or `options.workload` at `rate` new sessions
    (uniform: requests) per second."""
    from kvpool.workload import sessions as wl
    from kvpool.workload.trace import load_trace

    vocab = model.vocab_size
    if options.trace:
        return load_trace(options.trace, vocab, block_size=options.trace_block_size)
    if options.workload == "uniform":
        if options.sessions or options.turns:
            raise ValueError("--sessions and --turns shape chat and agentic sessions; uniform has single requests")
        return wl.uniform_workload(
            options.requests,
            rate,
            vocab,
            options.seed,
            prompt_len=options.prompt_len,
            output_len=options.output_len,
        )
    if options.workload not in WORKLOADS:
        raise ValueError(f"--workload: unknown workload {options.workload!r}; one of {', '.join(WORKLOADS)}")
    turns = options.turns or (4 if options.workload == "chat" else 8)
    sessions = options.sessions or max(1, math.ceil(options.requests / turns))
    make = wl.chat_workload if options.workload == "chat" else wl.agentic_workload
    return make(sessions, turns, rate, vocab, options.seed)


def fit_tp(
    model: ModelSpec,
    gpu: GPUSpec,
    tp: int | None,
    kv_dtype: str = "auto",
    weight_dtype: str = "auto",
    assumptions: LedgerAssumptions | None = None,
) -> int:
    """`tp`, or the fewest GPUs (1, 2, 4, 8) whose pool holds a few blocks of every group,
    under `assumptions` (None: LedgerAssumptions' defaults); deployment_of passes the run's
    engine limits and host mode (simulator.engine_assumptions), as plan_replica sizes the pool."""
    from kvpool.capacity.ledger import LedgerAssumptions
    from kvpool.capacity.planner import plan

    if gpu.kind == "cpu":  # one machine: no tensor parallelism across CPUs
        if tp not in (None, 1):
            raise ValueError("--tensor-parallel-size: the cpu preset is one machine; tensor parallelism needs GPUs")
        return 1
    if tp:
        if model.num_heads % tp:  # (the planner would say it without the flag)
            heads = f"{model.name}'s {model.num_heads} attention heads"
            raise ValueError(f"--tensor-parallel-size {tp}: {heads} do not split over {tp} GPUs")
        return tp
    from kvpool.capacity.kv import kv_layout
    from kvpool.capacity.weights import weight_bytes

    kv_layout(model, kv_dtype)  # a format the model cannot take is said as such, not as "does not fit"
    weight_bytes(model, weight_dtype=weight_dtype)  # so is a quantization kvpool cannot price
    for tp in (1, 2, 4, 8):
        try:
            p = plan(
                model,
                gpu,
                num_gpus=tp,
                tp=tp,
                kv_dtype=kv_dtype,
                weight_dtype=weight_dtype,
                assumptions=assumptions,
            )
        except ValueError:
            continue
        state = p.layout.state_block_bytes * 4
        if p.layout.tail_bytes_per_request:  # the chunked formats' tails of every request that may run
            state = p.layout.tail_bytes_per_request * (assumptions or LedgerAssumptions()).max_num_seqs
        if p.ledger.pool_bytes > 4 * p.layout.bytes_per_block_all_groups + state:
            return tp
    raise ValueError(f"{model.name} does not fit 8 x {gpu.name}")


def grid(
    models: Sequence[str],
    gpus: Sequence[str],
    tps: Sequence[int | None],
    layouts: Sequence[str | None],
    block_sizes: Sequence[int | None],
    routings: Sequence[str],
    rates: Sequence[float],
) -> list[dict[str, Any]]:
    """Every distinct point of models x GPUs x TP x layouts x block sizes x routings x rates,
    in that order. Contiguous reserves max_model_len per request whatever the block size, so
    it is one point per rate (block_size None), not one per block size under the same label."""
    points: list[dict[str, Any]] = []
    for mo, gp, tp, lay, bs, ro, ra in itertools.product(models, gpus, tps, layouts, block_sizes, routings, rates):
        point = {"model": mo, "gpu": gp, "tp": tp, "layout": lay, "block_size": None if lay == "contiguous" else bs}
        point |= {"routing": ro, "rate": ra}
        if point not in points:  # (nan != nan: a trace has a single rate, so no duplicate slips by)
            points.append(point)
    return points


def deployment_of(options: SimOptions, point: dict[str, Any]) -> PlannedDeployment:
    """The model, GPU, TP, cost model and SimConfig of one point; ValueError naming what
    cannot run (an unknown model or GPU, a deployment the model does not fit)."""
    from kvpool.sim.cost import CostModel
    from kvpool.sim.layouts import check_pool
    from kvpool.sim.simulator import SimConfig, engine_assumptions, plan_replica
    from kvpool.spec.models import model_by_name

    model, gpu = model_by_name(point["model"]), gpu_preset(point["gpu"], options.gpu_memory_utilization)
    if gpu.kind == "cpu" and options.weight_dtype not in ("auto", "fp32"):
        raise ValueError(f"--weight-dtype {options.weight_dtype}: --gpu cpu is kvpool's CPU engine, fp32 weights only")
    for flag in ("kv_transfer_bandwidth", "kv_transfer_latency_ms"):
        if getattr(options, flag) is not None and not options.prefill_replicas:
            raise ValueError(f"--{flag.replace('_', '-')}: the KV link of P/D; it needs --prefill-replicas")
    if options.v4_restore == "checkpoint" and options.v4_checkpoints == 0:
        # (the dual pool's own words named no flag: "restore='checkpoint' needs num_checkpoints > 0")
        raise ValueError(
            "--v4-restore checkpoint with --v4-checkpoints 0: no slot to keep a checkpoint in; give "
            "--v4-checkpoints N > 0, or leave it out (pooled in the classical pool's free memory)"
        )
    assumptions = engine_assumptions(options.max_num_seqs, options.max_num_batched_tokens, options.host_mode)
    tp = fit_tp(model, gpu, point["tp"], options.kv_dtype, options.weight_dtype, assumptions)
    # the deployment, as the simulator's config and the cost model take it
    deployment = {"tp": tp, "kv_dtype": options.kv_dtype, "weight_dtype": options.weight_dtype}
    config = SimConfig(
        layout=point["layout"],
        block_size=point["block_size"],
        enable_prefix_caching=options.enable_prefix_caching,
        replicas=options.replicas,
        routing=point["routing"],
        load_cap=options.load_cap,
        max_num_seqs=options.max_num_seqs,
        max_num_batched_tokens=options.max_num_batched_tokens,
        max_model_len=options.max_model_len,
        v4_restore=options.v4_restore,
        v4_turn_ends=options.v4_turn_ends,
        num_checkpoints=options.v4_checkpoints,
        slo_ttft_ms=options.slo_ttft_ms,
        slo_tpot_ms=options.slo_tpot_ms,
        **deployment,
    )
    calibration = load_calibration(options.calibration, gpu)
    cost = CostModel(
        model,
        gpu,
        host_mode=options.host_mode,
        expert_parallel=options.enable_expert_parallel,
        **deployment,
        **calibration,
    )
    p = plan_replica(model, gpu, config, options.host_mode)
    check_pool(p)  # a model that leaves no KV pool on tp GPUs says so here
    if options.prefill_replicas:  # what P/D cannot move, before a sweep runs anything
        from kvpool.sim.layouts import default_layout
        from kvpool.sim.pd import check_pd

        check_pd(model, config.layout or default_layout(p), config.enable_prefix_caching)
    return PlannedDeployment(model, gpu, tp, cost, config)


def simulate_deployment(
    options: SimOptions, point: dict[str, Any], on_progress: Callable[[int, int], None] | None = None
) -> dict:
    """Simulate one point: the report `kvpool simulate --json` prints, plus the simulator's
    private keys (those starting with "_": the plots read them; `public` drops them).
    `on_progress(num_finished, num_requests)` is called every step."""
    from kvpool.sim.simulator import check_request_lens, simulate

    model, gpu, _, cost, config = deployment_of(options, point)
    workload = make_workload(options, model, point["rate"])
    check_request_lens(model, workload, options.max_model_len, flag="--max-model-len")
    if options.prefill_replicas:
        from kvpool.sim.pd import KVLink, simulate_pd

        link = KVLink(
            50e9 if options.kv_transfer_bandwidth is None else options.kv_transfer_bandwidth,
            (0.1 if options.kv_transfer_latency_ms is None else options.kv_transfer_latency_ms) / 1e3,
        )
        report = simulate_pd(model, gpu, workload, config, cost, options.prefill_replicas, link, on_progress)
    else:
        report = simulate(model, gpu, workload, config, cost, on_progress)
    rate = point["rate"]
    report["workload"] = "trace" if options.trace else options.workload
    report["request_rate"] = "trace" if options.trace else rate if math.isfinite(rate) else "inf"
    # (an inf rate is "inf", as request_rate's: json.dumps wrote Infinity, which is no JSON and
    # which JSON.parse, Go's encoding/json and Python's strict readers refuse)
    report["workload_params"] = {k: "inf" if v == math.inf else v for k, v in workload.params.items()}
    report["cost_model"]["calibration"] = options.calibration  # None: the GPU defaults
    return report


def public(report: dict) -> dict:
    """A report without the simulator's private keys (those starting with "_")."""
    return {k: v for k, v in report.items() if not k.startswith("_")}


def sweep_point(payload: tuple[SimOptions, dict[str, Any]]) -> dict:
    """One point of a sweep, as a worker process or a Ray task runs it: (options, point) in,
    the public report out (module-level: a spawned process or Ray imports it by name)."""
    options, point = payload
    return public(simulate_deployment(options, point))


def count_words(n: int, noun: str) -> str:
    """'1 request', '2,000 requests'."""
    return f"{n:,} {noun}{'' if n == 1 else 's'}"


def deployment_words(replicas: int, tp: int, gpu: str, prefill_replicas: int = 0) -> str:
    """'1 H200', '8 H200 (2 replicas of TP 4)', '4 H200 (1 prefill + 3 decode replicas of
    TP 1)': the GPUs in all, then how they are split (`replicas` counts both P/D sides)."""
    gpus = f"{replicas * tp:,} {gpu}"
    if prefill_replicas:
        return f"{gpus} ({prefill_replicas} prefill + {replicas - prefill_replicas} decode replicas of TP {tp})"
    if replicas == 1 and tp == 1:
        return gpus
    return f"{gpus} ({count_words(replicas, 'replica')} of TP {tp})"
