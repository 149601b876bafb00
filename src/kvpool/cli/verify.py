"""`kvpool verify dsv4`: the V4 dual-pool verification matrix (paged vs contiguous oracle).

Prints one row per case (name, max abs logit difference, pass) and exits 1 if any case
fails. `--lengths 1,129,300` runs only the prompt-length cases for those lengths;
`--json` prints {"cases": [{"name", "max_abs_diff", "passed"}, ...]}.
"""

from __future__ import annotations

import argparse
import json
import math


def _lengths(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"--lengths must be comma-separated integers, got {text!r}") from None
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"--lengths must be positive integers, got {text!r}")
    return values


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="target", required=True)
    dsv4 = sub.add_parser("dsv4", help="DeepSeek-V4 Classical + State pools against the contiguous oracle")
    dsv4.add_argument(
        "--lengths", type=_lengths, default=None, help="comma-separated prompt lengths; runs only those length cases"
    )
    dsv4.add_argument("--json", action="store_true", help="print one JSON object")
    dsv4.add_argument("--seed", type=int, default=0, help="seed of the tiny model's weights")
    dsv4.add_argument("--tolerance", type=float, default=1e-5, help="max abs logit difference to pass")


def run(args: argparse.Namespace) -> int:
    import torch

    from kvpool.verify.dsv4 import Verifier

    torch.set_num_threads(1)  # tiny matrices: one thread is the fastest and plays well on shared CPUs
    results = Verifier(seed=args.seed).run(args.lengths, tolerance=args.tolerance)
    if args.json:
        cases = [
            {
                "name": r.name,
                "max_abs_diff": None if math.isnan(r.max_abs_diff) else r.max_abs_diff,
                "passed": r.passed,
                **({"detail": r.detail} if r.detail else {}),
            }
            for r in results
        ]
        print(json.dumps({"cases": cases}))
    else:
        width = max(len(r.name) for r in results)
        print(f"{'case':<{width}}  {'max abs diff':>12}  pass")
        for r in results:
            print(
                f"{r.name:<{width}}  {r.max_abs_diff:>12.3e}  {'yes' if r.passed else 'NO'}"
                + (f"  ({r.detail})" if r.detail else "")
            )
        num_failed = sum(not r.passed for r in results)
        print(f"{len(results) - num_failed}/{len(results)} passed (tolerance {args.tolerance:g}, fp32)")
    return 0 if all(r.passed for r in results) else 1
