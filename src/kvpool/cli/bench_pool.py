"""`kvpool bench pool`: block-pool and prefix-cache bookkeeping on two fixed traces (T1, T2),
timed on the calls the engine makes. kvpool/bench/pool.py defines the traces and figures;
this prints them as a table, or as one JSON object."""

from __future__ import annotations

import argparse

from kvpool.bench.pool import COUNTS, TARGETS, measure
from kvpool.cli.args import positive_int
from kvpool.cli.bench import call_with_flags, print_table, printed_json


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--repeats", type=positive_int, default=5, help="runs per figure (median)")
    parser.add_argument(
        "--hash", dest="hash_algo", default="xxh3_128", choices=["xxh3_128", "sha256"], help="the block hash"
    )


def run(args: argparse.Namespace) -> int:
    result = call_with_flags(measure, args)
    if printed_json(args, result):
        return 0
    rows = []
    for key, value in result.items():
        if key in ("hash_algo", "repeats", "gc"):
            continue
        target = TARGETS.get(key)
        shown = f"{value:,}" if key in COUNTS else f"{value:,.3g}" if value < 10 else f"{value:,.1f}"
        rows.append((key, shown, f"<= {target:g}" if target else ""))
    title = f"kvpool bench pool ({args.hash_algo}, median of {args.repeats}, GC on)"
    print_table(title, ("figure", "value", "target"), rows, num_left=1)
    return 0
