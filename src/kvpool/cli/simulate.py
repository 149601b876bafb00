"""`kvpool simulate`: serving at GPU scale on the engine's own scheduler and cache managers.

    kvpool simulate --model deepseek-v4-flash --gpu h200 -tp 8 --workload chat --requests 2000
    kvpool simulate ... --layout dual,paged,contiguous      (one run each, compared)
    kvpool simulate ... --replicas 4 --routing round-robin,prefix-aware
    kvpool simulate ... --prefill-replicas 1 --replicas 3    (P/D: sim/pd.py)
    kvpool simulate ... --trace FILE.jsonl                   (docs/SIM_TRACE.md)
    kvpool simulate sweep ... --layout dual,paged --rate 1,2,4 --block-size 128,256 --out runs.jsonl
    kvpool simulate sweep --model llama-3.1-8b,qwen3-8b --gpu h100,h200 -tp 1,2 --rate 8,32 --out runs.jsonl

A comma list in --layout, --routing, --block-size or --rate runs every combination (contiguous
has no block size: it runs once per rate, whatever --block-size lists); `sweep` also takes
lists of --model, --gpu and -tp, runs the grid in parallel processes (or Ray tasks:
--executor ray), writes one JSON line per run as it finishes (cli/sweep.py), then the
cheapest deployment meeting the SLO. --plot DIR writes PNGs: latency CDFs, KV
occupancy over time and, for several runs, a comparison chart. Output paths are checked
before anything is simulated: a run of minutes must not end in a path error.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import sys
import time
from typing import TYPE_CHECKING

from kvpool.cache.dual_pool import RESTORE_METHODS
from kvpool.cli.args import (
    byte_size,
    check_output_dir,
    comma_choices,
    non_negative_int,
    parsed_number,
    positive_float,
    positive_int,
    rate,
)
from kvpool.cli.options import (
    BLOCK_SIZE,
    GPU_MEMORY_UTILIZATION,
    MAX_MODEL_LEN,
    MAX_NUM_BATCHED_TOKENS,
    MAX_NUM_SEQS,
    PREFIX_CACHING,
    TENSOR_PARALLEL_SIZE,
    V4_TURN_ENDS,
    add_kv_cache_dtype_option,
    add_option,
    add_planner_model_option,
    planner_model,
)

if TYPE_CHECKING:  # rich loads on output only: --help stays fast
    from rich.console import Console
    from rich.table import Table

WORKLOADS = ("chat", "agentic", "uniform")
# kvpool.capacity.weights WEIGHT_DTYPES and kvpool.sim.cost HOST_MODES, spelled here so that
# --help imports neither (tests/test_sim_cost_host.py checks that they agree)
WEIGHT_DTYPES = ("auto", "bf16", "fp8", "mxfp4", "fp4+fp8", "fp32")
HOST_MODES = ("graph", "eager")
SUMMARY_KEYS = (
    "layout",
    "routing",
    "block_size",
    "request_rate",
    "kv_capacity_tokens",
    "peak_running",
    "prefix_hit_rate",
    "ttft_ms_p50",
    "ttft_ms_p99",
    "tpot_ms_p50",
    "tpot_ms_p99",
    "throughput_tok_s",
    "goodput_req_s",
    "preemptions",
    "sim_wall_s",
)


def _list(parse):
    def parse_list(text: str) -> tuple:
        items = tuple(parse(item.strip()) for item in text.split(",") if item.strip())
        if not items:
            raise argparse.ArgumentTypeError("an empty list")
        return items

    return parse_list


def _bandwidth(text: str) -> float:
    """A link's bandwidth, bytes per second: a size, "/s" optional ("50GB/s", "400G")."""
    size = text.strip().removesuffix("/s")
    try:
        value = byte_size(size)
    except argparse.ArgumentTypeError:
        expected = "a size per second such as 50GB/s or 25GiB/s"
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a bandwidth > 0, got {text!r}")
    return float(value)


def _milliseconds(text: str) -> float:
    """A finite duration >= 0, ms."""
    return parsed_number(text, float, lambda v: math.isfinite(v) and v >= 0, "a number of ms >= 0")


def _range(text: str) -> tuple[int, int]:
    try:
        lo, hi = (int(x) for x in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected LO:HI (two integers), got {text!r}") from None
    if not 0 < lo <= hi:
        raise argparse.ArgumentTypeError(f"expected 0 < LO <= HI, got {text!r}")
    return lo, hi


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from kvpool.sim.routing import LAYOUTS, ROUTINGS  # (no imports there: --help stays fast)

    parser.add_argument("mode", nargs="?", choices=("run", "sweep"), default="run", help="one run (or a few) / a sweep")
    # The default model must hold the default workload: 4-turn chats reach ~9k tokens, past
    # SmolLM2's 8,192 positions; Llama-3.1-8B on one H200 is the common serving setup.
    add_planner_model_option(parser, default="llama-3.1-8b", note="; sweep: a comma list")
    parser.add_argument(
        "--gpu", default="h200", help="h100, h200, b200 (any case) or cpu (this machine, calibrated); sweep: a list"
    )
    add_option(
        parser,
        GPU_MEMORY_UTILIZATION,
        default=1.0,
        note="not with --gpu cpu",
    )
    add_option(
        parser,
        TENSOR_PARALLEL_SIZE,
        default=None,
        type=_list(positive_int),
        note="of one replica (default: the fewest GPUs that fit); sweep: a comma list",
    )
    parser.add_argument("--workload", choices=WORKLOADS, default="chat", help="chat, agentic or uniform")
    parser.add_argument(
        "--trace", default=None, help="replay a JSONL trace instead (docs/SIM_TRACE.md; default: --workload)"
    )
    parser.add_argument("--trace-block-size", type=positive_int, default=512, help="tokens per hash id of a trace")
    parser.add_argument(
        "--requests",
        type=positive_int,
        default=1000,
        help="requests (chat, agentic: ceil(requests / turns) sessions of --turns turns each)",
    )
    parser.add_argument(
        "--sessions", type=positive_int, default=None, help="chat, agentic: sessions (default: requests / turns)"
    )
    parser.add_argument(
        "--turns", type=positive_int, default=None, help="chat, agentic: turns per session (default: chat 4, agentic 8)"
    )
    parser.add_argument(
        "--rate",
        type=_list(rate),
        default="4",
        help="new sessions per second, Poisson (inf: all at once); a list (a trace keeps its own times)",
    )
    parser.add_argument("--prompt-len", type=_range, default="128:2048", help="uniform: prompt tokens LO:HI")
    parser.add_argument("--output-len", type=_range, default="64:512", help="uniform: output tokens LO:HI")
    parser.add_argument("--seed", type=non_negative_int, default=0, help="seed of the workload and its arrivals")
    parser.add_argument(
        "--layout",
        type=comma_choices(LAYOUTS),
        default=None,
        help="paged, contiguous, dual (V4), hybrid (sliding windows); a list compares (default: the model's: dual for "
        "V4, hybrid with sliding windows, else paged)",
    )
    add_option(
        parser,
        BLOCK_SIZE,
        default=(None,),
        type=_list(positive_int),
        note="a list runs each (contiguous has none: one run per rate); default: the layout's own, 16, 64 for MLA, "
        "128 for V4",
    )
    add_option(parser, PREFIX_CACHING, default=True)
    parser.add_argument(
        "--replicas",
        type=positive_int,
        default=1,
        help="engine replicas behind the router (with --prefill-replicas: the decode replicas)",
    )
    parser.add_argument(
        "--prefill-replicas",
        type=non_negative_int,
        default=0,
        help="prefill / decode disaggregation: this many prefill replicas compute prompts and send their KV to the "
        "--replicas decode replicas (default 0: each replica does both)",
    )
    parser.add_argument(
        "--kv-transfer-bandwidth",
        type=_bandwidth,
        default=None,
        metavar="SIZE/s",
        help="--prefill-replicas: the link from each prefill replica to the decode side (its NICs together; "
        "default 50GB/s)",
    )
    parser.add_argument(
        "--kv-transfer-latency-ms",
        type=_milliseconds,
        default=None,
        help="--prefill-replicas: the link's latency per transfer, ms (default 0.1)",
    )
    parser.add_argument(
        "--routing", type=comma_choices(ROUTINGS), default="round-robin", help=f"{', '.join(ROUTINGS)}; a list"
    )
    parser.add_argument("--load-cap", type=positive_float, default=1.5, help="prefix-aware: load cap x the least load")
    add_option(parser, MAX_NUM_SEQS, default=256)
    add_option(parser, MAX_NUM_BATCHED_TOKENS, default=8192)
    add_option(parser, MAX_MODEL_LEN, default=None, note="default: the longest request")
    parser.add_argument(
        "--v4-restore",
        choices=RESTORE_METHODS,
        default="auto",
        help="V4 dual: a prefix hit's state by replaying the last n_win x layers tokens, from a checkpoint, "
        "or whichever costs less per admission (auto)",
    )
    add_option(parser, V4_TURN_ENDS, default=True, note="the dual layout (--layout dual)")
    parser.add_argument(
        "--v4-checkpoints",
        type=non_negative_int,
        default=None,
        help="V4 checkpoints in this many slots carved out of the pool (default: pooled, in the classical pool's "
        "free memory)",
    )
    add_kv_cache_dtype_option(parser, planner=True)
    parser.add_argument(
        "--weight-dtype",
        choices=WEIGHT_DTYPES,
        default="auto",
        help="weight format the GPUs hold and the GEMMs run in (auto: the model's own; fp32 on --gpu cpu)",
    )
    parser.add_argument(
        "--host-mode",
        choices=HOST_MODES,
        default="graph",
        help="graph: decode-only steps replay a CUDA graph (vLLM's default); eager: every step launches each "
        "layer's kernels",
    )
    parser.add_argument(
        "--enable-expert-parallel",
        action="store_true",
        help="MoE: the routed experts whole over the replica's TP GPUs (ep = TP) instead of a slice of each on every "
        "GPU; vLLM's flag at data parallelism 1: every GPU keeps all tokens and the MoE's output is all-reduced as "
        "under TP, so the modelled step time is TP's (no all-to-all; needs -tp > 1)",
    )
    parser.add_argument(
        "--calibration",
        default=None,
        metavar="NAME|FILE",
        help="a GPU calibration: the efficiencies and host overheads fitted to a measured run (kvpool.sim.gpufit; "
        "shipped: h200-issue31), in place of the GPU defaults (compute 0.5, bandwidth 0.8)",
    )
    parser.add_argument(
        "--slo-ttft-ms", type=positive_float, default=2000.0, help="goodput SLO: time to first token, ms"
    )
    parser.add_argument(
        "--slo-tpot-ms", type=positive_float, default=100.0, help="goodput SLO: time per output token, ms"
    )
    parser.add_argument("--json", action="store_true", help="one JSON object (a sweep: JSON lines)")
    parser.add_argument("--plot", default=None, metavar="DIR", help="write PNG plots into DIR (default: no plots)")
    parser.add_argument("--out", default=None, help="sweep: the JSONL file to write (default: stdout)")
    parser.add_argument("--jobs", type=positive_int, default=None, help="sweep: parallel processes (default: cores)")
    parser.add_argument(
        "--executor",
        choices=("processes", "ray"),
        default="processes",
        help="sweep: a process pool on this host, or Ray (the [ray] extra; local mode unless --ray-address)",
    )
    parser.add_argument(
        "--ray-address",
        default=None,
        help="sweep, --executor ray: a Ray cluster to join (default: none, Ray in local mode on this machine)",
    )
    parser.add_argument(
        "--slo-attainment",
        type=positive_float,
        default=0.9,
        help="sweep: a run meets the SLO when this fraction of its requests is within both bounds; the "
        "cheapest such deployment (GPUs per goodput) is printed",
    )


def _gpu(name: str, utilization: float = 1.0):
    """--gpu's preset (any case) at --gpu-memory-utilization of its memory, or the cpu preset."""
    import dataclasses

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


def _calibration(name: str | None, gpu) -> dict[str, float]:
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


def _workload(args, model, rate_value: float):
    from kvpool.workload import sessions as wl
    from kvpool.workload.trace import load_trace

    vocab = model.vocab_size
    if args.trace:
        return load_trace(args.trace, vocab, block_size=args.trace_block_size)
    if args.workload == "uniform":
        if args.sessions or args.turns:
            raise ValueError("--sessions and --turns shape chat and agentic sessions; uniform has single requests")
        return wl.uniform_workload(
            args.requests, rate_value, vocab, args.seed, prompt_len=args.prompt_len, output_len=args.output_len
        )
    turns = args.turns or (4 if args.workload == "chat" else 8)
    sessions = args.sessions or max(1, math.ceil(args.requests / turns))
    make = wl.chat_workload if args.workload == "chat" else wl.agentic_workload
    return make(sessions, turns, rate_value, vocab, args.seed)


def _fit_tp(model, gpu, tp: int | None, args) -> int:
    """`tp` (one of --tensor-parallel-size's), or the fewest GPUs (1, 2, 4, 8) whose pool holds a block."""
    from kvpool.capacity.planner import plan

    if gpu.kind == "cpu":  # one machine: no tensor parallelism across CPUs
        if tp not in (None, 1):
            raise ValueError("--tensor-parallel-size: the cpu preset is one machine; tensor parallelism needs GPUs")
        return 1
    if tp:
        return tp
    from kvpool.capacity.kv import kv_layout

    kv_layout(model, args.kv_dtype)  # a format the model cannot take is said as such, not as "does not fit"
    for tp in (1, 2, 4, 8):
        try:
            p = plan(model, gpu, num_gpus=tp, tp=tp, kv_dtype=args.kv_dtype, weight_dtype=args.weight_dtype)
        except ValueError:
            continue
        if p.ledger.pool_bytes > 4 * p.layout.bytes_per_block_all_groups + p.layout.state_block_bytes * 4:
            return tp
    raise ValueError(f"{model.name} does not fit 8 x {gpu.name}")


def _names(text: str) -> tuple[str, ...]:
    """A comma list of --model or --gpu ("llama-3.1-8b,qwen3-8b"), each as given."""
    return tuple(name.strip() for name in text.split(",") if name.strip())


def _runs(args) -> list[dict]:
    """Every distinct combination the flags ask for, as keyword sets of `_one`, in flag order:
    models x GPUs x TP x layouts x block sizes x routings x rates (a sweep's grid; one run
    takes one model, GPU and TP). Contiguous reserves max_model_len per request whatever the
    block size, so it runs once per rate (at the planner's default block size, which only
    sizes paged-only reservations), not once per block size as identical runs under the
    same label."""
    models, gpus, tps = _names(args.model), _names(args.gpu), args.tp or (None,)
    if args.mode != "sweep":
        for flag, values in (("--model", models), ("--gpu", gpus), ("--tensor-parallel-size", tps)):
            if len(values) > 1:
                raise ValueError(f"{flag}: a list ({', '.join(map(str, values))}) is a grid: kvpool simulate sweep")
    if not models or not gpus:
        raise ValueError(f"{'--model' if not models else '--gpu'}: an empty list")
    layouts = args.layout or (None,)
    rates = (math.nan,) if args.trace else args.rate  # a trace carries its own arrival times
    runs: list[dict] = []
    grid = itertools.product(models, gpus, tps, layouts, args.block_size, args.routing, rates)
    for mo, gp, tp, lay, bs, ro, ra in grid:
        combo = {"model": mo, "gpu": gp, "tp": tp, "layout": lay, "block_size": None if lay == "contiguous" else bs}
        combo |= {"routing": ro, "rate": ra}
        if combo not in runs:  # (nan != nan: a trace has a single rate, so no duplicate slips by)
            runs.append(combo)
    return runs


def _check_output_paths(args) -> None:
    """ValueError naming the flag and the path when --plot or --out cannot be written, before
    any simulating."""
    if args.plot:
        check_output_dir("--plot", args.plot, args.plot)
    if args.out and args.mode == "sweep":
        if os.path.isdir(args.out):
            raise ValueError(f"--out {args.out!r}: a directory; expected a file to write")
        check_output_dir("--out", args.out, os.path.dirname(os.path.abspath(args.out)))


def _deployment_of(args, combo: dict):
    """(model, gpu, tp, cost model, SimConfig) of one combination; ValueError naming what
    cannot run (an unknown model or GPU, a deployment the model does not fit)."""
    from kvpool.sim.cost import CostModel
    from kvpool.sim.layouts import check_pool
    from kvpool.sim.simulator import SimConfig, plan_replica

    model, gpu = planner_model(combo["model"]), _gpu(combo["gpu"], args.gpu_memory_utilization)
    if gpu.kind == "cpu" and args.weight_dtype not in ("auto", "fp32"):
        raise ValueError(f"--weight-dtype {args.weight_dtype}: --gpu cpu is kvpool's CPU engine, fp32 weights only")
    for flag in ("kv_transfer_bandwidth", "kv_transfer_latency_ms"):
        if getattr(args, flag) is not None and not args.prefill_replicas:
            raise ValueError(f"--{flag.replace('_', '-')}: the KV link of P/D; it needs --prefill-replicas")
    tp = _fit_tp(model, gpu, combo["tp"], args)
    # the deployment, as the simulator's config and the cost model take it
    deployment = {"tp": tp, "kv_dtype": args.kv_dtype, "weight_dtype": args.weight_dtype}
    config = SimConfig(
        layout=combo["layout"],
        block_size=combo["block_size"],
        enable_prefix_caching=args.enable_prefix_caching,
        replicas=args.replicas,
        routing=combo["routing"],
        load_cap=args.load_cap,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        v4_restore=args.v4_restore,
        v4_turn_ends=args.v4_turn_ends,
        num_checkpoints=args.v4_checkpoints,
        slo_ttft_ms=args.slo_ttft_ms,
        slo_tpot_ms=args.slo_tpot_ms,
        **deployment,
    )
    calibration = _calibration(args.calibration, gpu)
    cost = CostModel(
        model, gpu, host_mode=args.host_mode, expert_parallel=args.enable_expert_parallel, **deployment, **calibration
    )
    p = plan_replica(model, gpu, config)
    check_pool(p)  # a model that leaves no KV pool on tp GPUs says so here
    if args.prefill_replicas:  # what P/D cannot move, before a sweep runs anything
        from kvpool.sim.layouts import default_layout
        from kvpool.sim.pd import check_pd

        check_pd(model, config.layout or default_layout(p), config.enable_prefix_caching)
    return model, gpu, tp, cost, config


def _one(args, combo: dict, progress: bool) -> dict:
    from kvpool.sim.simulator import check_request_lens, simulate

    model, gpu, _, cost, config = _deployment_of(args, combo)
    workload = _workload(args, model, combo["rate"])
    check_request_lens(model, workload, args.max_model_len, flag="--max-model-len")
    bar = _Progress(workload.num_requests) if progress else None
    try:
        if args.prefill_replicas:
            from kvpool.sim.pd import KVLink, simulate_pd

            link = KVLink(
                50e9 if args.kv_transfer_bandwidth is None else args.kv_transfer_bandwidth,
                (0.1 if args.kv_transfer_latency_ms is None else args.kv_transfer_latency_ms) / 1e3,
            )
            update = bar.update if bar else None
            report = simulate_pd(model, gpu, workload, config, cost, args.prefill_replicas, link, update)
        else:
            report = simulate(model, gpu, workload, config, cost, bar.update if bar else None)
    finally:
        if bar:
            bar.close()
    report["workload"] = "trace" if args.trace else args.workload
    report["request_rate"] = "trace" if args.trace else combo["rate"] if math.isfinite(combo["rate"]) else "inf"
    report["workload_params"] = workload.params
    report["cost_model"]["calibration"] = args.calibration  # None: the GPU defaults
    return report


class _Progress:
    """Progress on stderr once a run has taken a second: a bar on a terminal, else (piped,
    CI) a line every 15 s. Updates are throttled: the simulator calls it every step."""

    def __init__(self, total: int) -> None:
        self.total, self.start, self.bar, self.task = total, time.perf_counter(), None, None
        self.tty = sys.stderr.isatty()
        self._next = self.start + 1.0

    def update(self, done: int, total: int) -> None:
        now = time.perf_counter()
        if now < self._next:
            return
        if not self.tty:
            print(f"kvpool simulate: {done:,} of {total:,} requests finished", file=sys.stderr, flush=True)
            self._next = now + 15.0
            return
        self._next = now + 0.1
        if self.bar is None:
            from rich.console import Console
            from rich.progress import Progress

            self.bar = Progress(console=Console(stderr=True), transient=True)
            self.bar.start()
            self.task = self.bar.add_task("simulating", total=total)
        self.bar.update(self.task, completed=done)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()


def _public(report: dict) -> dict:
    return {k: v for k, v in report.items() if not k.startswith("_")}


def _sweep_one(payload: tuple[argparse.Namespace, dict]) -> dict:
    args, combo = payload
    return _public(_one(args, combo, progress=False))


def run(args: argparse.Namespace) -> int:
    _check_output_paths(args)
    combos = _runs(args)
    if args.mode == "sweep":
        from kvpool.cli.sweep import run_sweep

        return run_sweep(args, combos)
    reports = [_one(args, c, progress=True) for c in combos]
    if args.plot:
        from kvpool.sim.plots import plot_runs

        for path in plot_runs(reports, args.plot):
            print(f"kvpool simulate: wrote {path}", file=sys.stderr)
    public = [_public(r) for r in reports]
    if args.json:
        print(json.dumps(public[0] if len(public) == 1 else {"runs": public}))
    else:
        _print(public)
    return 0


def _print(reports: list[dict]) -> None:
    from rich.markup import escape
    from rich.table import Table

    from kvpool.workload.metrics import report_notes, report_sections

    tables = []
    if len(reports) == 1:
        r = reports[0]
        table = Table(
            title=f"kvpool simulate: {_count(r['num_requests'], 'request')}, {r['model']} on "
            f"{_deployment(r['replicas'], r['tp'], r['gpu'], r.get('prefill_replicas', 0))}, layout {r['layout']}"
        )
        table.add_column("metric")
        table.add_column("value", justify="right")
        # the figures kvpool run prints, under the same headings with the same units
        for heading, rows in report_sections(r, skip=("per_replica", "cost_model", "workload_params")):
            table.add_row(f"[bold]{heading}[/bold]", "")
            for label, value in rows:
                table.add_row(f"  {escape(label)}", escape(value))
            table.add_section()
        tables.append(table)
        if r["replicas"] > 1:
            tables.append(_replicas_table(r))
    else:
        table = Table(title=f"kvpool simulate: {reports[0]['model']} on {reports[0]['gpu']}, compared")
        for key in SUMMARY_KEYS:
            table.add_column(key, justify="right")
        for r in reports:
            table.add_row(*(str(r.get(key, "")) for key in SUMMARY_KEYS))
        tables.append(table)
    console = _console(tables)
    for table in tables:
        console.print(table)
    if len(reports) == 1:  # virtual times: no CPU to oversubscribe, only the SLO verdict
        for note in report_notes(reports[0]):
            console.print(escape(note), highlight=False, soft_wrap=True)


def _console(tables: list) -> Console:
    """On a terminal, its width. Piped (`| cat`, a file), rich assumes 80 columns and cuts a
    comparison's cells to "…"; there the widest table's natural width (COLUMNS if wider)."""
    from rich.console import Console
    from rich.measure import Measurement

    console = Console()
    if console.is_terminal:
        return console
    unbounded = console.options.update_width(10_000)
    natural = max(Measurement.get(console, unbounded, table).maximum for table in tables)
    return Console(width=max(console.width, natural))


def _replicas_table(report: dict) -> Table:
    from rich.table import Table

    rows = report["per_replica"]
    table = Table(title=f"per replica ({report['routing']})")
    for key in rows[0]:
        table.add_column(key, justify="right")
    for row in rows:
        table.add_row(*(str(v) for v in row.values()))
    return table


def _count(n: int, noun: str) -> str:
    return f"{n:,} {noun}{'' if n == 1 else 's'}"


def _deployment(replicas: int, tp: int, gpu: str, prefill_replicas: int = 0) -> str:
    """'1 H200', '8 H200 (2 replicas of TP 4)', '4 H200 (1 prefill + 3 decode replicas of
    TP 1)': the GPUs in all, then how they are split (`replicas` counts both P/D sides)."""
    gpus = f"{replicas * tp:,} {gpu}"
    if prefill_replicas:
        return f"{gpus} ({prefill_replicas} prefill + {replicas - prefill_replicas} decode replicas of TP {tp})"
    if replicas == 1 and tp == 1:
        return gpus
    return f"{gpus} ({_count(replicas, 'replica')} of TP {tp})"
