"""`kvpool bench ledger`: the engine's measured memory ledger next to the planner's
prediction, line by line, with the rule each line is held to (kvpool/bench/ledger.py says
how it is measured and what the rules are). Exits 1 when a line breaks its rule."""

from __future__ import annotations

import argparse

from kvpool.bench.ledger import measure
from kvpool.cli.bench import call_with_flags, printed_json


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--device", choices=("auto", "cpu"), default="auto", help="auto: CUDA when torch sees a GPU; cpu: hide it"
    )


def run(args: argparse.Namespace) -> int:
    result = call_with_flags(measure, args)
    ok, rows = result["ok"], result["rows"]
    if not printed_json(args, result, indent=2):
        print(f"memory ledger of `kvpool run` ({result['load_source']}), predicted vs measured, bytes")
        print(f"{'term':<10} {'line':<26} {'predicted':>14} {'measured':>14}  rule")
        for row in rows:
            mark = "" if row["ok"] else "   <-- FAILS"
            numbers = f"{row['predicted']:>14,} {row['measured']:>14,}"
            print(f"{row['term']:<10} {row['line']:<26} {numbers}  {row['rule']}{mark}")
        print("all lines hold their rule" if ok else "some lines break their rule")
    return 0 if ok else 1
