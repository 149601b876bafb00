"""`kvpool bench hisparse`: DeepSeek-V4 HiSparse on the tiny V4 model: device bytes of the
CSA main entries against keeping them resident, and what a decode step fetches
(kvpool/bench/hisparse.py says how). Fails if HiSparse changes the outputs."""

from __future__ import annotations

import argparse
import sys

from kvpool.bench.hisparse import OutputsChanged, measure
from kvpool.cli.args import positive_int, torch_seed_int
from kvpool.cli.bench import call_with_flags, print_table, printed_json


def _sizes(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers, got {text!r}") from None
    if not values or min(values) <= 0:
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers, got {text!r}")
    return values


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--context", type=_sizes, default=(4096, 32768), help="prompt lengths (comma list)")
    parser.add_argument("--hot-set", type=_sizes, default=(8, 64, 512), help="hot-set sizes in CSA entries")
    parser.add_argument("--steps", type=positive_int, default=32, help="decode steps timed per run")
    parser.add_argument(
        "--seed", type=torch_seed_int, default=0, help="seed of the tiny model's weights and the prompts"
    )


def run(args: argparse.Namespace) -> int:
    try:
        result = call_with_flags(measure, args, contexts=args.context, hot_sets=args.hot_set)
    except OutputsChanged as error:  # the check failed: one line, status 1 (it was a traceback)
        print(f"kvpool bench hisparse: FAILED: {error}", file=sys.stderr)
        return 1
    if printed_json(args, result):
        return 0
    columns = ("context", "hot set", "CSA main on device", "fetched / step", "bytes / step", "step (ms)")
    rows = [
        (
            f"{row['context']:,}",
            "off (resident)" if row["hot_set"] is None else f"{row['hot_set']:,}",
            f"{row['csa_main_device_bytes'] / 2**10:,.1f} KiB",
            str(row.get("fetched_entries_per_decode_step", "")),
            str(row.get("fetched_bytes_per_decode_step", "")),
            str(row["decode_step_ms"]),
        )
        for row in result["rows"]
    ]
    print_table(f"kvpool bench hisparse: tiny-dsv4, {args.steps} decode steps after the prompt", columns, rows)
    return 0
