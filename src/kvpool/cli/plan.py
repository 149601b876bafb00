"""`kvpool plan`: KV bytes, the peak-memory ledger and the capacity plan of a model on GPUs.

kvpool plan --model deepseek-v4-pro --gpu h200 --num-gpus 8 -tp 8 --max-model-len 1048576
kvpool plan --config path/to/config.json --memory-gib 80 --max-model-len 32768 --json
kvpool plan --plot kv.png            # KV bytes vs context for several presets
kvpool plan --model smollm2-135m --device cpu   # kvpool run's own ledger on this machine
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Callable
from typing import Any, TypeVar

from kvpool.capacity.engine import EngineConfig
from kvpool.capacity.kv import INDEXER_FORMATS, kv_layout, resolve_kv_dtype
from kvpool.capacity.ledger import LedgerAssumptions
from kvpool.capacity.planner import Plan, plan
from kvpool.capacity.weights import WEIGHT_DTYPES
from kvpool.cli.args import (
    add_plot_file_argument,
    byte_size,
    check_plot_path,
    non_negative_int,
    positive_float,
    positive_int,
)
from kvpool.cli.options import (
    BLOCK_SIZE,
    GPU_MEMORY_UTILIZATION,
    KV_MEMORY,
    MAX_MODEL_LEN,
    MAX_NUM_BATCHED_TOKENS,
    MAX_NUM_SEQS,
    add_kv_cache_dtype_option,
    add_option,
    add_planner_model_option,
    add_tp_option,
)
from kvpool.spec.gpus import GPUS, GPUSpec, cpu_device, custom_gpu, get_gpu
from kvpool.spec.models import ModelSpec, load_config_file, load_preset, model_by_name

GIB = 1 << 30
_MAX_CONTEXT = (1 << 63) - 1  # the lengths sampled for the fragmentation lines are int64 draws below it

T = TypeVar("T")
PLOT_MODELS: tuple[str, ...] = (
    "llama-3.1-8b",
    "llama-3.1-70b",
    "gemma-2-9b",
    "gpt-oss-120b",
    "deepseek-v3",
    "deepseek-v3.2",
    "deepseek-v4-flash",
    "deepseek-v4-pro",
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    src = parser.add_mutually_exclusive_group()
    add_planner_model_option(src, default=None, note=" (default: none, give one)")
    src.add_argument(
        "--config", help="a Hugging Face config.json or its folder, as --model takes (default: none, give one)"
    )
    hw = parser.add_mutually_exclusive_group()
    hw.add_argument("--gpu", default="h100", help=f"GPU preset, any case: {', '.join(g.lower() for g in GPUS)}")
    hw.add_argument(
        "--memory-gib",
        type=positive_float,
        default=None,
        help="GPU memory in GiB (default: --gpu's)",
    )
    hw.add_argument(
        "--device",
        choices=("cpu",),
        default=None,
        help="cpu: kvpool's own engine on this machine (its RAM), in kvpool run's configuration: "
        "fp32 weights and KV, --kv-memory of blocks (default: a GPU)",
    )
    add_option(
        parser,
        KV_MEMORY,
        default=None,
        type=byte_size,
        note=f"--device cpu: the pool, as kvpool run's (default: {EngineConfig().kv_memory_bytes >> 20}MiB)",
    )
    add_option(
        parser,
        GPU_MEMORY_UTILIZATION,
        default=1.0,
        note="--gpu's or --memory-gib's",
    )
    parser.add_argument(
        "--num-gpus", type=positive_int, default=None, help="GPUs in all (default: --tensor-parallel-size)"
    )
    add_tp_option(parser, note="of one model replica")
    add_option(parser, MAX_MODEL_LEN, default=None, note="the context the plan holds (default: the model's maximum)")
    parser.add_argument(
        "--ep",
        action="store_true",
        help="expert parallelism over all GPUs, attention in num-gpus/tp data-parallel replicas",
    )
    parser.add_argument(
        "--concurrency",
        type=positive_int,
        default=None,
        help="concurrent requests over all GPUs (default: what the pool holds)",
    )
    add_option(parser, BLOCK_SIZE, default=None, note="default: 16, 64 for MLA, 128 for V4")
    add_kv_cache_dtype_option(parser, planner=True)
    parser.add_argument(
        "--indexer-format", default=None, choices=INDEXER_FORMATS, help="V3.2 / V4 indexer-key format (default: fp8)"
    )
    parser.add_argument("--weight-dtype", default="auto", choices=WEIGHT_DTYPES, help="weight format")
    add_option(parser, MAX_NUM_SEQS, default=None, note="the ledger's running requests (default: 256; cpu: 16)")
    add_option(parser, MAX_NUM_BATCHED_TOKENS, default=None, note="the ledger's step (default: 8192; cpu: 256)")
    parser.add_argument("--no-cuda-graphs", action="store_true", help="no CUDA-graph memory in the ledger")
    parser.add_argument(
        "--hisparse-fraction",
        type=positive_float,
        default=None,
        help="DeepSeek-V4: the tokens the pool holds with HiSparse, this fraction of the CSA main entries on the "
        "device (the rest in host memory; default: all on the device)",
    )
    parser.add_argument(
        "--lengths",
        default=None,
        help="length distribution for measured fragmentation: uniform:LO:HI, "
        "lognormal:MEDIAN:SIGMA or fixed:N, every draw within the context (default: uniform:1:CONTEXT)",
    )
    parser.add_argument("--seed", type=non_negative_int, default=0, help="seed of the sampled lengths")
    parser.add_argument(
        "--pd",
        default=None,
        metavar="P,D",
        help="prefill / decode disaggregation: a prefill instance on P GPUs (TP P) holding --prompt-len-token "
        "prompts, and a decode instance on D GPUs (TP D) holding --max-model-len-token requests, sized apart "
        "(default: one instance)",
    )
    parser.add_argument(
        "--prompt-len", type=positive_int, default=None, help="--pd: tokens of a prompt (default: --max-model-len / 2)"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    add_plot_file_argument(parser, "draw KV bytes vs context, the type from the extension (default: none)")
    parser.add_argument(
        "--plot-models", default=None, help=f"comma-separated presets for --plot (default: {','.join(PLOT_MODELS)})"
    )


def _load_model(args: argparse.Namespace) -> ModelSpec | None:
    if args.model:
        return model_by_name(args.model)
    if args.config:
        return load_config_file(args.config)
    return None


def _gpu(args: argparse.Namespace) -> GPUSpec:
    """The device planned for: --device cpu (this machine's RAM), else --memory-gib or the
    --gpu preset at --gpu-memory-utilization of its memory."""
    if args.device == "cpu":
        if args.gpu_memory_utilization != 1.0:
            raise ValueError("--gpu-memory-utilization sizes a GPU; --device cpu's pool is --kv-memory")
        return cpu_device()
    if args.memory_gib is not None:
        gpu = _for_flag("--memory-gib", custom_gpu, args.memory_gib)
    else:
        try:
            gpu = get_gpu(args.gpu)
        except ValueError as e:  # (an A100, an L40S: planned by their memory)
            raise ValueError(f"--gpu: {e}; --memory-gib GIB plans another GPU by its memory") from None
    usable = int(gpu.memory_bytes * args.gpu_memory_utilization)
    if usable < 1:  # GPUSpec's own error would name memory_bytes, no flag the user gave
        raise ValueError(
            f"--gpu-memory-utilization {args.gpu_memory_utilization:g} of {gpu.memory_bytes:,} bytes "
            "is less than one byte"
        )
    return dataclasses.replace(gpu, memory_bytes=usable)


def _engine(args: argparse.Namespace) -> EngineConfig | None:
    """kvpool run's configuration with the flags given, for --device cpu; None for a GPU."""
    if args.device != "cpu":
        if args.kv_memory is not None:
            raise ValueError("--kv-memory sizes the pool of --device cpu; on a GPU the pool is what the ledger leaves")
        return None
    base = EngineConfig()
    return EngineConfig(
        kv_memory_bytes=args.kv_memory if args.kv_memory is not None else base.kv_memory_bytes,
        block_size=args.block_size if args.block_size is not None else base.block_size,
        max_num_batched_tokens=args.max_num_batched_tokens or base.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs or base.max_num_seqs,
    )


def _planner_options(args: argparse.Namespace, assumptions: LedgerAssumptions) -> dict[str, Any]:
    """What the planner (capacity/planner.py `plan`) and the P/D split (capacity/pd.py
    `plan_pd`) both take from the flags: block size, storage formats, ledger assumptions and
    the seed of the sampled lengths."""
    return {
        "block_size": args.block_size,
        "kv_dtype": args.kv_dtype,
        "indexer_format": args.indexer_format,
        "weight_dtype": args.weight_dtype,
        "assumptions": assumptions,
        "seed": args.seed,
    }


def warn_beyond_max_position(model: ModelSpec, context_len: int | None, command: str = "plan") -> None:
    """The plan still prints past the model's positions (the KV figures extrapolate), but
    the user should know that the model was not built for that context. (kvpool simulate
    warns the same: `command`.)"""
    if context_len is not None and context_len > model.max_position_embeddings:
        print(
            f"kvpool {command}: warning: --max-model-len {context_len:,} is beyond {model.name}'s maximum position "
            f"{model.max_position_embeddings:,} (max_position_embeddings); the figures extrapolate",
            file=sys.stderr,
        )


def run(args: argparse.Namespace) -> int:
    try:
        # flags that shape only another flag's output: alone they were dropped without a word
        if args.prompt_len is not None and args.pd is None:
            raise ValueError("--prompt-len sizes the prefill side of --pd P,D; give --pd too")
        if args.plot is not None:  # before the plan's work ("" too: read as no --plot, nothing was drawn)
            check_plot_path(args.plot)
        if args.plot_models is not None and not args.plot:
            raise ValueError("--plot-models picks the presets of --plot FILE; give --plot too")
        if args.max_model_len is not None and args.max_model_len >= _MAX_CONTEXT:
            # its default --lengths uniform:1:N refused it in words that named no flag the user gave
            # ("uniform HI must be below 2**63 - 1")
            raise ValueError(
                f"--max-model-len {args.max_model_len:,} is beyond any context: at most {_MAX_CONTEXT - 1:,} tokens"
            )
        if args.lengths is not None:  # its errors ("fixed length must be >= 0") named no flag
            from kvpool.capacity.fragmentation import check_lengths
            from kvpool.capacity.planner import MAX_SAMPLED_SEQS

            # as many draws as the plan may take, with its seed: a lognormal's tail is in them
            _for_flag("--lengths", check_lengths, args.lengths, MAX_SAMPLED_SEQS, args.seed)
        if args.no_cuda_graphs and args.device == "cpu":  # (the CPU ledger has no graph term: dropped)
            raise ValueError("--no-cuda-graphs sizes a GPU's ledger; kvpool's CPU engine captures no CUDA graphs")
        if args.pd is not None and args.ep:  # its sides are TP groups: --ep was dropped from them
            raise ValueError("--pd plans each side as one tensor-parallel group; --ep does not apply to them")
        if args.pd is not None and args.device == "cpu":  # its sides took a GPU ledger in this machine's RAM
            raise ValueError("--pd sizes GPU instances; --device cpu plans kvpool's engine in one process")
        model = _load_model(args)
        if model is None and not args.plot:
            raise ValueError("give --model NAME or --config PATH (or --plot FILE.png|svg|pdf alone)")
        plot_names: list[str] = []
        if args.plot:
            plot_names = [n.strip() for n in (args.plot_models or ",".join(PLOT_MODELS)).split(",") if n.strip()]
            if not plot_names:
                raise ValueError(f"--plot-models {args.plot_models!r} names no preset")
            plotted = [load_preset(n) for n in plot_names]
            _check_plotted_formats(plotted, args.kv_dtype, args.plot_models is not None)
        result = None
        if model is not None:
            if args.indexer_format is not None and model.indexer is None and model.attention != "dsv4":
                # kv_layout has no keys to give it: it was dropped without a word
                raise ValueError(f"--indexer-format: {model.name} has no indexer keys (DeepSeek-V3.2 and V4 have)")
            if args.indexer_format is not None and model.attention == "dsv4":
                dtype = resolve_kv_dtype(model, args.kv_dtype)
                if dtype in ("bf16", "fp16", "fp32") and args.indexer_format != dtype:  # (bf16 keys in bf16: agrees)
                    # (kv_layout refuses it too, in words that name no flag)
                    raise ValueError(
                        f"--indexer-format {args.indexer_format}: a {dtype} DeepSeek-V4 cache (--kv-cache-dtype "
                        f"{args.kv_dtype}) keeps its indexer keys in {dtype}; the key formats are its fp8 layout's"
                    )
            if args.max_model_len is None and args.device != "cpu" and model.max_position_embeddings >= _MAX_CONTEXT:
                # the default context: its --lengths uniform:1:N said "uniform HI must be below 2**63 - 1"
                raise ValueError(
                    f"{model.name}'s max_position_embeddings {model.max_position_embeddings:,} is beyond any context "
                    f"(at most {_MAX_CONTEXT - 1:,} tokens); give --max-model-len"
                )
            warn_beyond_max_position(model, args.max_model_len)
            engine = _engine(args)
            assumptions = LedgerAssumptions(
                max_num_batched_tokens=args.max_num_batched_tokens or LedgerAssumptions.max_num_batched_tokens,
                max_num_seqs=args.max_num_seqs or LedgerAssumptions.max_num_seqs,
                cuda_graphs=not args.no_cuda_graphs,
            )
            result = plan(
                model,
                _gpu(args),
                num_gpus=args.num_gpus if args.num_gpus is not None else args.tp,
                tp=args.tp,
                context_len=args.max_model_len,
                concurrency=args.concurrency,
                length_distribution=args.lengths,
                expert_parallel=args.ep,
                engine=engine,
                **_planner_options(args, assumptions),
            )
        if args.plot:
            models = plotted
            if model is not None and model.name not in {m.name for m in models}:
                models.append(model)
            plot_kv_vs_context(models, args.plot, kv_dtype=args.kv_dtype)
        # after the plot: a refused --pd or --hisparse-fraction still leaves the plot written
        pd = hisparse = None
        if result is not None and args.pd is not None:
            pd = _for_flag("--pd", _pd_split, args, model, assumptions, result.context_len)
        if result is not None and args.hisparse_fraction is not None:
            from kvpool.capacity.hisparse import hisparse_capacity

            hisparse = _for_flag("--hisparse-fraction", hisparse_capacity, result, args.hisparse_fraction)
    except ValueError as e:
        print(f"kvpool plan: error: {e}", file=sys.stderr)
        return 2
    if result is not None:
        if args.json:
            extra = ({"hisparse": hisparse} if hisparse else {}) | ({"pd": pd} if pd else {})
            print(json.dumps(result.as_dict() | extra, indent=2))
        else:
            print_plan(result, args.gpu_memory_utilization)
            if pd:
                _print_pd(pd)
            if hisparse:
                print(
                    f"HiSparse at {hisparse['hot_set_fraction']:.0%} of the CSA main entries on the device: "
                    f"{hisparse['kv_bytes_per_token_hisparse']:,.1f} B a token on the device (resident: "
                    f"{hisparse['kv_bytes_per_token_resident']:,.1f}; {hisparse['host_bytes_per_token']:,.1f} in host "
                    f"memory), the pool holds {hisparse['pool_tokens_hisparse']:,} tokens against "
                    f"{hisparse['pool_tokens_resident']:,} ({hisparse['token_gain']:.2f}x) per replica; "
                    f"{hisparse['deployment_tokens_hisparse']:,} against {hisparse['deployment_tokens_resident']:,} "
                    f"over {hisparse['replicas']} replica(s)"
                )
    if args.plot and not args.json:
        print(f"wrote {args.plot}")
    # a P/D side that holds no request fails the plan as one instance that holds none does
    pd_fits = pd is None or all(pd[side]["fits"] for side in ("prefill", "decode"))
    return 0 if result is None or (result.fits and pd_fits) else 1


def _for_flag(flag: str, fn: Callable[..., T], *args: object) -> T:
    """`fn(*args)`, a ValueError it raises said as one about `flag` ("--pd: ...")."""
    try:
        return fn(*args)
    except ValueError as e:
        raise ValueError(f"{flag}: {e}") from None


def _pd_split(args: argparse.Namespace, model: ModelSpec, assumptions, context_len: int) -> dict[str, object]:
    """--pd P,D: the prefill and decode instances, each planned on its own (capacity/pd.py)."""
    from kvpool.capacity.pd import plan_pd

    try:
        p, d = (int(x) for x in args.pd.split(","))
    except ValueError:
        raise ValueError(f"expected P,D (prefill and decode GPUs), got {args.pd!r}") from None
    if p <= 0 or d <= 0:
        raise ValueError(f"GPU counts must be positive, got {args.pd!r}")
    return plan_pd(
        model,
        _gpu(args),
        p,
        d,
        context_len,
        args.prompt_len,
        **_planner_options(args, assumptions),
    )


def _print_pd(pd: dict[str, object]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"P/D split: {pd['prompt_len']:,}-token prompts, {pd['context_len']:,}-token requests")
    columns = ("instance", "GPUs (TP)", "tokens a request holds", "KV pool / GPU", "KV B / token / GPU", "requests")
    for column in columns:
        table.add_column(column, justify="right")
    for side in ("prefill", "decode"):
        s = pd[side]
        table.add_row(
            side,
            str(s["gpus"]),
            f"{s['tokens_held']:,}",
            f"{s['kv_pool_bytes_per_gpu'] / GIB:.2f} GiB",
            f"{s['kv_bytes_per_token_per_gpu']:,.1f}",
            f"{s['max_concurrent_requests']:,}",
        )
    console = Console()
    console.print(table)
    for side in ("prefill", "decode"):
        s = pd[side]
        if not s["fits"]:
            gpus = f"{s['gpus']} GPU{'s' if s['gpus'] > 1 else ''}"
            why = (
                "has no room for a KV pool: the rest of its ledger fills its GPUs"
                if s["kv_pool_bytes_per_gpu"] <= 0
                else f"cannot hold one request of {s['tokens_held']:,} tokens"
            )
            console.print(
                f"[bold red]does not fit: the {side} instance ({gpus}) {why}[/]",
                soft_wrap=True,  # one line, whatever the terminal's width
            )
    print(f"a request's prompt moves {pd['transfer_bytes_per_request'] / (1 << 20):,.1f} MiB of KV, prefill -> decode")


# ---------------------------------------------------------------------------------------
# Tables
# ---------------------------------------------------------------------------------------


def _tail_words(p) -> str:
    """What a chunked format's per-request state is: its storage's full-precision tails."""
    from kvpool.spec.kv_formats import kv_schema

    if not p.layout.tail_bytes_per_request:
        return ""
    return f" (full-precision tails: {kv_schema(p.layout.kv_dtype).tail_slots} blocks of K and V)"


def _gib(x: float) -> str:
    """Bytes in the largest unit that keeps the figure >= 1 (GiB, MiB, KiB, B)."""
    for unit, size in (("GiB", GIB), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(x) >= size:
            return f"{x / size:,.2f} {unit}"
    return f"{x:,.0f} B"


def _kv_split(p: Plan) -> str:
    """How TP splits the cache, where it does not shard it head by head: a latent or V4's
    vector is on every rank; GQA past its KV heads puts each head on tp / heads ranks (it
    read "replicated over TP" with a rank's share at 1 / heads of the model's)."""
    if p.layout.sharded_by_head or p.tp == 1:
        return ""
    if p.layout.kv_heads_per_gpu is None or p.model.num_kv_heads == 1:
        return " (replicated over TP)"
    return f" (each of {p.model.num_kv_heads} KV heads on {p.tp // p.model.num_kv_heads} of {p.tp} ranks)"


def _gpu_size(p: Plan, utilization: float) -> str:
    """ "79.6 GiB", or "79.6 GiB, 90 % planned: 71.7 GiB" below the whole GPU (the title called
    the planned share the GPU's size)."""
    if utilization == 1.0:
        return f"{p.gpu.memory_gib:.1f} GiB"
    whole = p.gpu.memory_gib / utilization
    return f"{whole:.1f} GiB, {utilization * 100:.3g} % planned: {p.gpu.memory_gib:.1f} GiB"


def print_plan(p: Plan, utilization: float = 1.0) -> None:
    """The plan's tables; `utilization` (--gpu-memory-utilization) is the share of the GPU
    the plan's capacity is (p.gpu holds that capacity, not the GPU's size)."""
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    d = p.as_dict()
    console = Console(width=100)
    parallel = f"TP {p.tp}" + (f", EP {p.weights.ep}" if p.weights.ep else "")
    where = (
        f"kvpool's engine on this machine, {p.gpu.name}, {p.gpu.memory_gib:.1f} GiB RAM"
        if p.gpu.kind == "cpu"
        else f"{p.num_gpus} x {p.gpu.name} ({_gpu_size(p, utilization)}), {parallel}"
    )
    # the name is the user's (config.json's _name_or_path, or its folder): text, not rich markup
    head = Table(title=escape(f"kvpool plan: {p.model.name} on {where}"), show_header=False)
    head.add_column(style="bold")
    head.add_column(justify="right")
    rows = [
        ("attention", f"{d['attention']}, {d['num_layers']} layers"),
        (
            "parameters, weights (model)",
            f"{d['params'] / 1e9:,.1f} billion, {d['weight_dtype']} {_gib(d['weight_bytes'])}",
        ),
        (
            "KV format, block size",
            f"{d['kv_dtype']}, {d['block_size']} tokens" + _kv_split(p),
        ),
        ("KV bytes / token (model)", f"{d['kv_bytes_per_token']:,.1f} B"),
        ("KV bytes / token (per GPU)", f"{d['kv_bytes_per_token_per_gpu']:,.1f} B"),
        ("state bytes / request", f"{d['state_bytes_per_request']:,.0f} B" + _tail_words(p)),
        (f"KV at {p.context_len:,} tokens (model)", _gib(d["kv_bytes_at_context"])),
        (f"KV at {p.context_len:,} tokens (per GPU, paged)", _gib(d["kv_bytes_at_context_per_gpu"])),
    ]
    if p.gpu.kind == "cpu":  # one process, no GPU: the per-GPU rows would repeat the model's under a wrong name
        rows = [(k, v) for k, v in rows if "per GPU" not in k]
        rows.append((f"KV at {p.context_len:,} tokens (paged)", _gib(d["kv_bytes_at_context_per_gpu"])))
    for k, v in rows:
        head.add_row(k, v)
    console.print(head)

    on_cpu = p.gpu.kind == "cpu"
    ledger = Table(
        title="peak-memory ledger of kvpool run on this machine (compare: kvpool run --json, memory)"
        if on_cpu
        else "peak-memory ledger, one GPU (seed 003)"
    )
    ledger.add_column("term")
    ledger.add_column("bytes", justify="right")
    ledger.add_column("share", justify="right")
    cap = p.ledger.capacity
    for term in p.ledger.terms:
        ledger.add_row(term, _gib(p.ledger.terms[term]), f"{100 * p.ledger.terms[term] / cap:.1f} %")
        for sub, value in p.ledger.details.get(term, {}).items():
            if value:
                ledger.add_row(f"  {sub}", _gib(value), "", style="dim")
    ledger.add_row("total (M_peak)", _gib(p.ledger.total), f"{100 * p.ledger.total / cap:.1f} %", style="bold")
    ledger.add_row("capacity", _gib(cap), "")
    console.print(ledger)

    out = Table(title="plan", show_header=False)
    out.add_column(style="bold")
    out.add_column(justify="right")
    out.add_row("KV pool of this machine" if on_cpu else "KV pool per GPU", _gib(p.ledger.pool_bytes))
    n = p.max_concurrent_per_replica
    out.add_row(f"  filled with {n:,} requests of {p.context_len:,} tokens", "", style="dim")
    for sub, value in p.occupancy.items():
        out.add_row(f"    {sub}", _gib(value), style="dim")
    out.add_row(
        f"max concurrent requests at {p.context_len:,} tokens",
        f"{p.max_concurrent_requests:,} ({p.replicas} replica{'s' if p.replicas > 1 else ''})",
    )
    if p.concurrency is not None:
        limit = "" if p.max_context_len == p.max_context_memory_len else " (model limit)"
        out.add_row(f"max context at {p.concurrency:,} requests", f"{p.max_context_len:,} tokens{limit}")
    f = d["fragmentation"]
    out.add_row(f"tail fragmentation, {f['num_seqs']:,} seqs, q = {f['block_size']}", "")
    per_slot = f["bytes_per_slot_per_gpu"]
    for label, slots in (
        ("bound n(q-1)", f["bound_slots"]),
        ("expected n(q-1)/2", f["expected_slots"]),
        ("measured", f["measured_slots"]),
    ):
        text = f"{slots:,.0f} slots" + (f" = {_gib(slots * per_slot)}" if per_slot else "")
        out.add_row(f"  {label}", text)
    out.add_row("  measured on", f"{f['length_distribution']}, seed {f['seed']}")
    if f["lengths_past_context"]:  # (a lognormal's tail: see plan())
        out.add_row("  draws past the context, left out", f"{f['lengths_past_context']:,}")
    out.add_row("  measured rate 1 - useful/allocated", f"{100 * f['measured_rate']:.3f} %")
    if not per_slot:
        out.add_row("  (V4: a request's unfinished tail lives in its state block)", "")
    console.print(out)
    if not p.fits:
        # kvpool's CPU engine takes --kv-memory whatever the machine holds: its ledger can pass
        # the RAM with a pool that holds requests (a GPU's pool is what the other terms leave)
        if on_cpu and p.ledger.total > cap:
            why = f"the ledger's {_gib(p.ledger.total)} is more than this machine's {_gib(cap)} of RAM"
        elif p.ledger.pool_bytes <= 0:
            # the other terms fill the GPU: no context fits ("cannot hold one request at this
            # context" sent the user to shorten a context that was never the cause)
            largest = max((t for t in p.ledger.terms if t != "kv_pool"), key=p.ledger.terms.__getitem__)
            why = (
                f"the ledger without a KV pool is {_gib(p.ledger.total)}, more than its capacity, {_gib(cap)} "
                f"(its largest term: {largest}, {_gib(p.ledger.terms[largest])}): no context fits"
            )
        else:
            why = "the KV pool cannot hold one request at this context"
        console.print(f"[bold red]does not fit: {why}[/]", soft_wrap=True)


# ---------------------------------------------------------------------------------------
# Plot
# ---------------------------------------------------------------------------------------


def _check_plotted_formats(models: list[ModelSpec], kv_dtype: str, picked: bool) -> None:
    """Refuse, before any plan or figure, a --kv-cache-dtype a plotted preset cannot take, in
    words naming the flag that brought that preset in: kv_layout's own named a default preset
    the user never picked, and no flag; then told a user who gave --plot-models to use it."""
    for m in models:
        try:
            kv_layout(m, kv_dtype)
        except ValueError as e:
            if picked:
                raise ValueError(
                    f"--plot-models names {m.name}, which takes no --kv-cache-dtype {kv_dtype} ({e})"
                ) from None
            raise ValueError(
                f"--plot: {m.name} takes no --kv-cache-dtype {kv_dtype} ({e}); pick the presets with --plot-models"
            ) from None


def plot_kv_vs_context(models: list[ModelSpec], path: str, kv_dtype: str = "auto") -> None:
    """KV bytes of one request (whole model, unsharded) against context length, log-log."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from kvpool.sim.plots import save_figure

    contexts = [1 << k for k in range(10, 21)]  # 1 Ki .. 1 Mi tokens
    fig, ax = plt.subplots(figsize=(8, 5))
    for m in models:
        layout = kv_layout(m, kv_dtype)
        ys = [layout.kv_bytes_at_context(c) / GIB for c in contexts]
        # solid within the model's max_position_embeddings, dashed beyond (extrapolated)
        inside = [i for i, c in enumerate(contexts) if c <= m.max_position_embeddings]
        last = inside[-1] if inside else 0
        (line,) = ax.plot(
            contexts[: last + 1], ys[: last + 1], marker="o", markersize=3, label=f"{m.name} ({layout.kv_dtype})"
        )
        if last + 1 < len(contexts):
            ax.plot(contexts[last:], ys[last:], linestyle="--", color=line.get_color(), alpha=0.6)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("KV cache of one request (GiB, whole model)")
    ax.set_title("KV bytes vs context length (dashed: past the model's max positions)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0.0)  # covers no line
    try:
        save_figure(fig, path)  # the type from the extension, which check_plot_path accepted
    except OSError as e:  # check_plot_path looked first; the disk can still be full or read-only
        raise ValueError(f"--plot {path}: cannot write: {e.strerror or e}") from e
