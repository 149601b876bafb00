"""`kvpool bench dsv4`: V4 dual-pool bytes (Flash / Pro presets) and paged vs oracle decode
time (kvpool/bench/dsv4.py says what is counted and timed)."""

from __future__ import annotations

import argparse

from kvpool.bench.dsv4 import measure
from kvpool.cli.args import comma_list, positive_int
from kvpool.cli.bench import call_with_flags, printed_json


def add_arguments(parser: argparse.ArgumentParser) -> None:
    # argparse types, as the other benches': a bad value is "kvpool bench dsv4: error: argument
    # ..." with status 2 (it was a bare SystemExit line with status 1)
    parser.add_argument(
        "--contexts",
        type=comma_list(positive_int),
        default=(128, 512, 1024),
        help="comma-separated context lengths for the timing",
    )
    parser.add_argument("--steps", type=positive_int, default=16, help="decode steps timed per context")
    parser.add_argument("--repeats", type=positive_int, default=3, help="median of this many runs")
    parser.add_argument("--no-timing", action="store_true", help="print the byte accounting only")


def run(args: argparse.Namespace) -> int:
    result = call_with_flags(measure, args, contexts=list(args.contexts), timing=not args.no_timing)
    if printed_json(args, result):
        return 0
    bytes_, timing = result["bytes"], result["tiny_decode_timing"]
    print("DeepSeek-V4 dual pool, bytes (serving formats; fp32 compressor state; MTP layer not counted unless noted)")
    keys = list(next(iter(bytes_.values())))
    print(f"{'':44s}" + "".join(f"{name:>20s}" for name in bytes_))
    for key in keys:
        vals = "".join(
            f"{bytes_[name][key]:>20,.2f}" if isinstance(bytes_[name][key], float) else f"{bytes_[name][key]:>20,}"
            for name in bytes_
        )
        print(f"{key:44s}{vals}")
    print(
        "(state_bytes_kvpool_fp32_storage: kvpool's own fp32 state block = fp32 ring + fp32 compressor "
        "tails + room for the unfinished span's entries)"
    )
    if timing:
        print(f"\ntiny-dsv4 decode step (fp32, CPU, 1 thread, {args.steps} steps, median of {args.repeats})")
        print(f"{'context':>8}  {'paged ms/step':>14}  {'oracle ms/step':>15}  {'oracle/paged':>12}")
        for row in timing:
            print(
                f"{row['context']:>8}  {row['paged_ms_per_step']:>14.2f}  {row['oracle_ms_per_step']:>15.2f}  "
                f"{row['speedup']:>12.1f}"
            )
    return 0
