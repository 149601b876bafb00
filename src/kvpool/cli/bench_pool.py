"""`kvpool bench pool`: block-pool and prefix-cache bookkeeping on two fixed traces (T1, T2),
timed on the calls the engine makes. kvpool/bench/pool.py defines the traces and figures;
this prints them as a table, or as one JSON object."""

from __future__ import annotations

import argparse
import json

from kvpool.bench.pool import COUNTS, TARGETS, measure
from kvpool.cli.args import positive_int


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--repeats", type=positive_int, default=5, help="runs per figure (median)")
    parser.add_argument("--hash", dest="hash_algo", default="xxh3_128", choices=["xxh3_128", "sha256"])


def run(args: argparse.Namespace) -> int:
    result = measure(args.repeats, args.hash_algo)
    if args.json:
        print(json.dumps(result))
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"kvpool bench pool ({args.hash_algo}, median of {args.repeats}, GC on)")
    table.add_column("figure")
    table.add_column("value", justify="right")
    table.add_column("target", justify="right")
    for key, value in result.items():
        if key in ("hash_algo", "repeats", "gc"):
            continue
        target = TARGETS.get(key)
        shown = f"{value:,}" if key in COUNTS else f"{value:,.3g}" if value < 10 else f"{value:,.1f}"
        table.add_row(key, shown, f"<= {target:g}" if target else "")
    Console().print(table)
    return 0
