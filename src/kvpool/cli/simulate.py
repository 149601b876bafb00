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
import json
import math
import os
import re
import sys
import time
from typing import TYPE_CHECKING

from kvpool.cache.dual_pool import RESTORE_METHODS
from kvpool.cli.args import (
    SIZE_UNITS,
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
)
from kvpool.sim.deployment import WORKLOADS  # (stdlib imports only: --help stays fast)

if TYPE_CHECKING:  # rich loads on output only: --help stays fast
    from rich.console import Console
    from rich.table import Table

    from kvpool.sim.deployment import SimOptions

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


# the SLO attainment a sweep's cheapest deployment must reach where --slo-attainment is not given
SLO_ATTAINMENT = 0.9
# new sessions per second where --rate is not given
RATE = 4.0


def _list(parse):
    def parse_list(text: str) -> tuple:
        items = tuple(parse(item.strip()) for item in text.split(",") if item.strip())
        if not items:
            raise argparse.ArgumentTypeError("an empty list")
        return items

    return parse_list


# a rate's number, then its unit ("400Gb/s", "25 GiB/s", "-5G", "6e9")
_RATE = re.compile(r"\s*([+-]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?)\s*(.*?)\s*")
# bits per second, explicit: a lowercase b or "bit(s)" after a decimal prefix, "/s" or "ps" after
# ("400Gb/s", "400Gbit/s", "100Gbps"): a NIC's speed, unambiguous
_BITS = re.compile(r"([kKmMgGtT]?)(b|[bB][iI][tT][sS]?)(/s|ps)?")
_BIT_PREFIXES = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
BANDWIDTH_EXAMPLES = "50GB/s, 25GiB/s or 400Gb/s"


def _bandwidth(text: str) -> float:
    """A link's bandwidth, bytes per second: a size, "/s" or "ps" after a capital B optional
    ("50GB/s", "50GBps", "25GiB/s"), a plain number of bytes, or bits per second written as
    such ("400Gb/s", "400Gbit/s", "400Gbps": 50GB/s, decimal). A unit with neither B nor b
    ("400G") is refused, naming both readings: a NIC's 400G is 400 Gb/s (50GB/s), a size's
    400 GiB. A bandwidth <= 0 is refused as such first, whatever its unit, where the rest
    is a unit ("0,5GB/s" and "0x10" are no number 0: refused as not a bandwidth)."""
    match = _RATE.fullmatch(text)
    if match and not float(match.group(1)) > 0 and _a_unit(match.group(2)):  # ("-5G" was told it is ambiguous)
        raise argparse.ArgumentTypeError(f"expected a bandwidth > 0, got {text!r}")
    bits = _BITS.fullmatch(match.group(2)) if match else None
    if bits:  # 400Gb/s: 400e9 bits a second, 50e9 bytes
        value = float(match.group(1)) * _BIT_PREFIXES[bits.group(1).lower()] / 8
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"expected a finite bandwidth, got {text!r}")
        return value
    size = text.strip().removesuffix("/s")
    if size.endswith("Bps"):  # bytes per second, written as NICs' bits are ("100GBps")
        size = size[: -len("ps")]
    unit = size.lstrip("0123456789.eE+-_ ")
    if unit.strip() and "B" not in unit:
        raise argparse.ArgumentTypeError(_ambiguous_bandwidth(text, size, unit.strip()))
    try:
        value = byte_size(size)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected a bandwidth such as {BANDWIDTH_EXAMPLES}, got {text!r}") from None
    return float(value)


def _a_unit(unit: str) -> bool:
    """Whether `unit`, what follows a bandwidth's number, is one _bandwidth reads (bits, a
    size's unit with "/s" or "ps" after a B, or none) or refuses as ambiguous ("G")."""
    if _BITS.fullmatch(unit):
        return True
    size = unit.removesuffix("/s")
    if size.endswith("Bps"):
        size = size[: -len("ps")]
    return size.strip().lower() in SIZE_UNITS


def _ambiguous_bandwidth(text: str, size: str, unit: str) -> str:
    """Why a bandwidth with a unit but no B is refused: "400G" is 400 GiB/s as a size
    (byte_size's K/M/G/T are powers of 1024) and 400 Gb/s = 50 GB/s as a NIC's speed, 8.6x
    apart. Both readings, spelt so the flag takes them."""
    number = size[: len(size) - len(size.lstrip("0123456789.eE+-_ "))].strip()
    prefix = unit.rstrip("iI").upper()
    try:
        value = float(number)
    except ValueError:
        value = None
    if value is None or prefix not in ("K", "M", "G", "T") or unit.upper() not in (prefix, prefix + "I"):
        return f"expected a bandwidth such as {BANDWIDTH_EXAMPLES}, got {text!r}"
    if unit.upper() == prefix + "I":  # (Gi: binary, no NIC's; only the B is missing)
        return f"{text!r} has no B: the flag takes bytes per second, written {value:g}{prefix}iB/s"
    return (
        f"{text!r} is ambiguous: a NIC's {value:g}{prefix} is {value:g} {prefix}b/s = {value / 8:g}{prefix}B/s, "
        f"a size's {value:g}{prefix} is {value:g}{prefix}iB/s; write {value:g}{prefix}b/s (or "
        f"{value / 8:g}{prefix}B/s) for a {value:g} {prefix}b/s NIC, or {value:g}{prefix}iB/s"
    )


def _milliseconds(text: str) -> float:
    """A finite duration >= 0, ms."""
    return parsed_number(text, float, lambda v: math.isfinite(v) and v >= 0, "a number of ms >= 0")


def _load_cap(text: str) -> float:
    """A finite factor >= 1 (0.5 was 'load_cap must be >= 1', naming no flag)."""
    return parsed_number(text, float, lambda v: math.isfinite(v) and v >= 1, "a finite number >= 1")


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
        default=None,  # (None, not 1000: a trace must tell a --requests given from the default)
        help="requests (chat, agentic: ceil(requests / turns) sessions of --turns turns each; a trace replays "
        "all its lines) (default: 1000)",
    )
    parser.add_argument(
        "--sessions", type=positive_int, default=None, help="chat, agentic: sessions (default: requests / turns)"
    )
    parser.add_argument(
        "--turns", type=positive_int, default=None, help="chat, agentic: turns per session (default: chat 4, agentic 8)"
    )
    # (--rate, --prompt-len, --output-len default to None: a trace, or a workload they do not
    # shape, must tell them given from their defaults; `_runs` and `sim_options` fill those in)
    parser.add_argument(
        "--rate",
        type=_list(rate),
        default=None,
        help="new sessions per second, Poisson (inf: all at once); a list (not with --trace: it keeps its own times) "
        "(default: 4)",
    )
    parser.add_argument(
        "--prompt-len", type=_range, default=None, help="uniform: prompt tokens LO:HI (default: 128:2048)"
    )
    parser.add_argument(
        "--output-len", type=_range, default=None, help="uniform: output tokens LO:HI (default: 64:512)"
    )
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
        help="--prefill-replicas: the link from each prefill replica to the decode side, its NICs together: "
        "bytes per second (50GB/s, 25GiB/s) or bits written as such (400Gb/s, 400Gbit/s, 400Gbps: 50GB/s); "
        "a bare 400G is refused as ambiguous (default 50GB/s)",
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
    parser.add_argument(
        "--load-cap", type=_load_cap, default=1.5, help="prefix-aware: load cap x the least load (>= 1)"
    )
    add_option(parser, MAX_NUM_SEQS, default=256)
    add_option(parser, MAX_NUM_BATCHED_TOKENS, default=8192)
    add_option(parser, MAX_MODEL_LEN, default=None, note="default: the longest request")
    parser.add_argument(
        "--v4-restore",
        choices=RESTORE_METHODS,
        default=None,  # (None: not given, which a model without the dual layout is checked for; then auto)
        help="V4 dual: a prefix hit's state by replaying the last n_win x layers tokens, from a checkpoint, "
        "or whichever costs less per admission (default: auto)",
    )
    add_option(parser, V4_TURN_ENDS, default=None, note="the dual layout (--layout dual; default: on)")
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
    parser.add_argument(
        "--jobs",
        type=positive_int,
        default=None,
        help="sweep: points run at once, at most one per point: the process pool's workers (1: in this process), "
        "or Ray's CPUs in local mode; a --ray-address cluster runs as many as it has (default: cores)",
    )
    parser.add_argument(
        "--executor",
        choices=("processes", "ray"),
        default=None,  # (None: not given, which one run checks; a sweep reads it as "processes")
        help="sweep: a process pool on this host (default), or Ray (the [ray] extra; local mode unless --ray-address)",
    )
    parser.add_argument(
        "--ray-address",
        default=None,
        help="sweep, --executor ray: a Ray cluster to join (default: none, Ray in local mode on this machine)",
    )
    parser.add_argument(
        "--slo-attainment",
        type=positive_float,
        default=None,  # (None: not given; a sweep reads it as SLO_ATTAINMENT)
        help=f"sweep: a run meets the SLO when this fraction of its requests is within both bounds (default "
        f"{SLO_ATTAINMENT}); the cheapest such deployment (GPUs per goodput) is printed",
    )


def _names(text: str) -> tuple[str, ...]:
    """A comma list of --model or --gpu ("llama-3.1-8b,qwen3-8b"), each as given."""
    return tuple(name.strip() for name in text.split(",") if name.strip())


def _runs(args) -> list[dict]:
    """Every distinct combination the flags ask for (sim/deployment.py `grid`), in flag
    order; one run (not a sweep) takes one model, GPU and TP. A trace carries its own
    arrival times: one rate."""
    models, gpus, tps = _names(args.model), _names(args.gpu), args.tp or (None,)
    if args.mode != "sweep":
        for flag, values in (("--model", models), ("--gpu", gpus), ("--tensor-parallel-size", tps)):
            if len(values) > 1:
                raise ValueError(f"{flag}: a list ({', '.join(map(str, values))}) is a grid: kvpool simulate sweep")
    if not models or not gpus:
        raise ValueError(f"{'--model' if not models else '--gpu'}: an empty list")
    from kvpool.sim.deployment import grid

    rates = (math.nan,) if args.trace else args.rate or (RATE,)
    return grid(models, gpus, tps, args.layout or (None,), args.block_size, args.routing, rates)


def sim_options(args: argparse.Namespace) -> SimOptions:
    """The settings every run of the grid shares, from the flags of the same names."""
    import dataclasses

    from kvpool.sim.deployment import SimOptions

    values = {field.name: getattr(args, field.name) for field in dataclasses.fields(SimOptions)}
    # (not given: None tells one given from the default)
    for name in ("requests", "prompt_len", "output_len", "v4_restore", "v4_turn_ends"):
        if values[name] is None:
            values[name] = getattr(SimOptions, name)
    return SimOptions(**values)


def _check_output_paths(args) -> None:
    """ValueError naming the flag and the path when --plot or --out cannot be written, before
    any simulating."""
    if args.plot:
        check_output_dir("--plot", args.plot, args.plot)
    if args.out and args.mode != "sweep":
        # (a run prints its report: taken silently, --out would leave the user believing it saved)
        raise ValueError(
            f"--out {args.out!r}: --out is the JSONL file of `kvpool simulate sweep`; one run prints its report "
            "(--json > FILE writes it)"
        )
    if args.out:
        if os.path.isdir(args.out):
            raise ValueError(f"--out {args.out!r}: a directory; expected a file to write")
        check_output_dir("--out", args.out, os.path.dirname(os.path.abspath(args.out)))
        if os.path.exists(args.out) and not os.access(args.out, os.W_OK):
            # (the sweep opens it once its points run: a PermissionError there was a traceback)
            raise ValueError(f"--out {args.out!r}: the file exists and is not writable")
        for flag, given in (("--trace", args.trace), ("--calibration", args.calibration)):
            # (the sweep truncates --out as its workers start reading their input: --out naming the
            # trace emptied it, and the runs failed on "the trace has no requests")
            if given and os.path.exists(given) and os.path.exists(args.out) and os.path.samefile(given, args.out):
                raise ValueError(f"--out {args.out!r} is the {flag} file: the sweep would overwrite its input")


def _one(options: SimOptions, combo: dict) -> dict:
    """One run, its progress on stderr."""
    from kvpool.sim.deployment import simulate_deployment

    bar = _Progress()
    try:
        return simulate_deployment(options, combo, bar.update)
    finally:
        bar.close()


class _Progress:
    """Progress on stderr once a run has simulated for a second: a bar on a terminal, else
    (piped, CI) a line every 15 s. Updates are throttled: the simulator calls it every step."""

    def __init__(self) -> None:
        self.bar, self.task, self._next = None, None, None
        self.tty = sys.stderr.isatty()

    def update(self, done: int, total: int) -> None:
        now = time.perf_counter()
        if self._next is None:  # the first step: the clock starts once the run is planned
            self._next = now + 1.0
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


def _check_sweep_flags(args: argparse.Namespace) -> None:
    """ValueError for a sweep-only flag given to one run, which has no pool, executor or
    attainment to apply it to (taken silently, as --out was, it seemed to do something)."""
    if args.mode != "sweep":
        for flag, value in (
            ("--jobs", args.jobs),
            ("--executor", args.executor),
            ("--ray-address", args.ray_address),
            ("--slo-attainment", args.slo_attainment),
        ):
            if value is not None:
                raise ValueError(f"{flag} is a flag of `kvpool simulate sweep`; one run (kvpool simulate) takes none")


def _check_paths_given(args: argparse.Namespace) -> None:
    """ValueError for an empty path: `--trace "$TRACE"` with TRACE unset simulated the chat
    workload instead, `--plot ""` drew nothing and `--out ""` printed to stdout, all silently
    (an empty string reads as not given)."""
    for flag, value in (("--trace", args.trace), ("--plot", args.plot), ("--out", args.out)):
        if value is not None and not value.strip():
            raise ValueError(f"{flag}: an empty path ({value!r})")


def _check_trace_flags(args: argparse.Namespace) -> None:
    """ValueError for a flag that shapes a generated workload given with --trace, which
    replays its own lines (taken silently, --requests 1000 of a 23,000-line trace ran all
    23,000). --requests' default is SimOptions', filled in by `sim_options`."""
    if args.trace:
        given = [
            f for f, v in (("--requests", args.requests), ("--sessions", args.sessions), ("--turns", args.turns)) if v
        ]
        if given:
            raise ValueError(
                f"{' / '.join(given)} with --trace: a trace replays every line, each a single request; to replay "
                f"fewer, cut the file (head -n N {args.trace} > part.jsonl)"
            )
        # (taken silently, --rate 1,2,4 ran the trace once at its own times)
        if args.rate:
            raise ValueError("--rate with --trace: a trace replays its own arrival times, once")
    lengths = [f for f, v in (("--prompt-len", args.prompt_len), ("--output-len", args.output_len)) if v]
    if lengths and (args.trace or args.workload != "uniform"):
        # (taken silently, --prompt-len 4096:8192 left a chat run's lengths as they were)
        source = "--trace: a trace gives each request's" if args.trace else f"--workload {args.workload} draws its own"
        verb = "shapes" if len(lengths) == 1 else "shape"
        raise ValueError(f"{' / '.join(lengths)} {verb} --workload uniform; {source} lengths")


V4_FLAGS = (("--v4-restore", "v4_restore"), ("--v4-checkpoints", "v4_checkpoints"), ("--v4-turn-ends", "v4_turn_ends"))


def _check_v4_flags(args: argparse.Namespace, combos: list[dict]) -> None:
    """ValueError naming the V4 flags given for models none of which has the dual layout
    (DeepSeek-V4's state pool): taken silently, --v4-checkpoints 5 on llama-3.1-8b changed
    nothing. A sweep whose grid holds a V4 model takes them (its other models have no state
    to restore)."""
    given = [flag for flag, dest in V4_FLAGS if getattr(args, dest) is not None]
    if not given:
        return
    from kvpool.spec.models import model_by_name

    models = []
    for name in dict.fromkeys(c["model"] for c in combos):
        try:
            models.append(model_by_name(name))
        except ValueError:
            return  # (an unknown model is said where the run or the sweep meets it)
    if given[-1] == "--v4-turn-ends" and args.v4_turn_ends is False:
        given[-1] = "--no-v4-turn-ends"
    flags = " / ".join(given)
    verb = "needs" if len(given) == 1 else "need"
    if any(m.dsv4 is not None for m in models):
        if args.layout and "dual" not in args.layout:  # (V4 on a paged layout keeps no state)
            raise ValueError(
                f"{flags} {verb} the dual layout (DeepSeek-V4's state pool); --layout {','.join(args.layout)}"
            )
        return
    has = "; ".join(f"{m.name} has {m.attention} attention" for m in models)
    raise ValueError(f"{flags} {verb} a DeepSeek-V4 model (the dual layout's state pool); {has}")


def _warn_beyond_max_position(args: argparse.Namespace, combos: list[dict]) -> None:
    """A warning line, as kvpool plan's, for a --max-model-len past a model's positions: the
    simulation runs (contiguous reserves max_model_len per request), but was silent that the
    model was never built for that context."""
    if args.max_model_len is None:
        return
    from kvpool.cli.plan import warn_beyond_max_position
    from kvpool.spec.models import model_by_name

    for name in dict.fromkeys(c["model"] for c in combos):
        try:
            model = model_by_name(name)
        except ValueError:
            continue  # (an unknown model is said where the run or the sweep meets it)
        warn_beyond_max_position(model, args.max_model_len, command="simulate")


def run(args: argparse.Namespace) -> int:
    from kvpool.sim.deployment import public

    _check_paths_given(args)
    _check_trace_flags(args)
    _check_output_paths(args)
    _check_sweep_flags(args)
    combos = _runs(args)
    _check_v4_flags(args, combos)
    _warn_beyond_max_position(args, combos)
    options = sim_options(args)
    if args.mode == "sweep":
        from kvpool.cli.sweep import run_sweep

        return run_sweep(args, options, combos)
    reports = [_one(options, c) for c in combos]
    if args.plot:
        from kvpool.sim.plots import plot_runs

        for path in plot_runs(reports, args.plot):
            print(f"kvpool simulate: wrote {path}", file=sys.stderr)
    public_reports = [public(r) for r in reports]
    if args.json:
        print(json.dumps(public_reports[0] if len(public_reports) == 1 else {"runs": public_reports}))
    else:
        _print(public_reports)
    return 0


def _print(reports: list[dict]) -> None:
    from rich.markup import escape
    from rich.table import Table

    from kvpool.sim.deployment import count_words, deployment_words
    from kvpool.workload.metrics import report_notes, report_sections

    tables = []
    if len(reports) == 1:
        r = reports[0]
        on = deployment_words(r["replicas"], r["tp"], r["gpu"], r.get("prefill_replicas", 0))
        requests = count_words(r["num_requests"], "request")
        # (escaped: a config.json's name is no rich markup, as in plan's title)
        table = Table(title=escape(f"kvpool simulate: {requests}, {r['model']} on {on}, layout {r['layout']}"))
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
        table = Table(title=escape(f"kvpool simulate: {reports[0]['model']} on {reports[0]['gpu']}, compared"))
        for key in SUMMARY_KEYS:
            table.add_column(key, justify="right")
        for r in reports:
            # (a TPOT of None: no answer had a second token)
            table.add_row(*("n/a" if r.get(key, "") is None else str(r.get(key, "")) for key in SUMMARY_KEYS))
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
