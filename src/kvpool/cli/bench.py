"""`kvpool bench NAME`: reproducible benchmarks that print tables or one JSON object."""

from __future__ import annotations

import argparse
import inspect
import json
import math
import sys
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

from kvpool.cli.main import add_modules, terminate_like_ctrl_c

T = TypeVar("T")

# bench name -> module exposing add_arguments(parser) and run(args) -> int
BENCHES: dict[str, tuple[str, str]] = {
    "pool": ("kvpool.cli.bench_pool", "block pool and prefix cache bookkeeping (traces T1, T2)"),
    "engine": (
        "kvpool.cli.bench_engine",
        "engine vs transformers: decode tok/s, cached-prefix TTFT, paged vs contiguous attention",
    ),
    "dsv4": ("kvpool.cli.bench_dsv4", "DeepSeek-V4 dual pool: Flash/Pro bytes, tiny-model paged vs oracle decode"),
    "start": ("kvpool.cli.bench_start", "kvpool generate from a cold process to its first token, load phase apart"),
    "sim": ("kvpool.cli.bench_sim", "the simulator's cpu preset against the engine on the same workload: TPOT, TTFT"),
    "ledger": ("kvpool.cli.bench_ledger", "kvpool run's measured memory ledger against the planner's, line by line"),
    "hisparse": ("kvpool.cli.bench_hisparse", "DeepSeek-V4 HiSparse on tiny-dsv4: device bytes and fetches per step"),
    "serve": (
        "kvpool.cli.bench_serve",
        "streaming clients against kvpool serve: TTFT / TPOT / ITL p50 and p99, throughput, goodput, hit rate",
    ),
    "kv-quant": (
        "kvpool.cli.bench_kv_quant",
        "decode attention over int8 / fp8 / bf16 KV blocks against fp32 on the same path (batch 16, 4k context)",
    ),
    "gpu": (
        "kvpool.cli.bench_gpu",
        "CUDA: decode / extend attention against SDPA, engine TPOT at batch 1/32/128, host time per step, numerics",
    ),
    "tiers": (
        "kvpool.cli.bench_tiers",
        "TTFT of a prefix from the host, disk and Redis tiers against recompute; write MB/s; V4 SWA strategies",
    ),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="bench", required=True)
    add_modules(sub, BENCHES, "_bench_run", name_prefix="bench ")  # errors say which bench: "bench NAME"
    for bench_parser in sub.choices.values():  # every bench: its tables, or with --json its report (printed_json)
        bench_parser.add_argument("--json", action="store_true", help="print the report as one JSON object instead")


def strict_json(value: object) -> object:
    """`value` with every nan and inf float as None (null), so that --json prints JSON:
    json.dumps writes them as NaN / Infinity, which JSON parsers refuse (jq read Infinity as
    1.8e308). A failed check's figure is one: verify tp's logit difference when the tokens
    differ is inf."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: strict_json(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [strict_json(v) for v in value]
    return value


def printed_json(args: argparse.Namespace, report: object, indent: int | None = None) -> bool:
    """With --json: `report` printed as one JSON object (for scripts: nothing else goes to
    stdout; a nan or inf figure as null) and True; without: False, and the bench prints its
    tables."""
    if args.json:
        print(json.dumps(strict_json(report), indent=indent, allow_nan=False))
    return args.json


def run(args: argparse.Namespace) -> int:
    # SIGTERM (timeout, a job's stop) stops a bench as Ctrl-C does, status 143: the processes
    # a bench started (bench serve's server, bench tiers' redis-server) are stopped on the way
    # out; killed outright, they were left running, orphaned
    with terminate_like_ctrl_c():
        return int(args._bench_run(args) or 0)


def stderr_progress(name: str) -> Callable[[str], None]:
    """A progress callback (kvpool.bench.common.Progress) that prints `NAME: PHASE ...` on
    stderr when stdout is not a terminal (piped, CI), so a run of minutes is not silent;
    stdout keeps only the JSON or the table."""

    def progress(phase: str) -> None:
        if not sys.stdout.isatty():
            print(f"{name}: {phase} ...", file=sys.stderr, flush=True)

    return progress


def call_with_flags(fn: Callable[..., T], args: argparse.Namespace, **given: Any) -> T:
    """`fn(**kwargs)`, each of `fn`'s parameters taken from `given`, else from the flag of the
    same name (its argparse dest) in `args`: a benchmark's settings are its flags. A
    parameter with neither, or a `given` name `fn` does not take, is a TypeError."""
    parameters = inspect.signature(fn).parameters
    unknown = set(given) - set(parameters)
    if unknown:
        raise TypeError(f"{fn.__qualname__} takes no {sorted(unknown)}")
    kwargs = {}
    for name in parameters:
        if name in given:
            kwargs[name] = given[name]
        elif hasattr(args, name):
            kwargs[name] = getattr(args, name)
        else:
            raise TypeError(f"{fn.__qualname__}({name}=...): no flag of that name and no value given")
    return fn(**kwargs)


def print_table(
    title: str, columns: Sequence[str], rows: Iterable[Sequence[str]], num_left: int = 0, console: Any = None
) -> None:
    """A rich table on `console` (default: a new one): the first `num_left` columns
    left-justified, the others right-justified."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for i, column in enumerate(columns):
        table.add_column(column, justify="left" if i < num_left else "right")
    for row in rows:
        table.add_row(*row)
    (console or Console()).print(table)
