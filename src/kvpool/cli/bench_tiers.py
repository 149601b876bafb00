"""`kvpool bench tiers`: a cached prefix served from each tier below the device pool (host,
disk, Redis) against recompute, the tiers' write throughput, and tiny-dsv4's SWA strategies
through the disk tier (kvpool/bench/tiers.py says what each case is and how it is timed)."""

from __future__ import annotations

import argparse

from kvpool.bench.tiers import measure
from kvpool.cli.args import positive_int
from kvpool.cli.bench import call_with_flags, print_table, printed_json
from kvpool.cli.options import BLOCK_SIZE, add_option


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prefix-len", type=positive_int, default=2048, help="tokens of the cached SmolLM2 prefix")
    parser.add_argument("--suffix-len", type=positive_int, default=16, help="new tokens after it, each repeat")
    parser.add_argument("--repeats", type=positive_int, default=3, help="requests per case (the median counts)")
    add_option(parser, BLOCK_SIZE, default=16, note="SmolLM2's")
    parser.add_argument("--v4-prefix-len", type=positive_int, default=2304, help="tokens of the tiny-dsv4 prefix")
    parser.add_argument("--swa-period", type=positive_int, default=512, help="the periodic strategy's period")
    parser.add_argument(
        "--redis", default=None, metavar="URL", help="a Redis server to use (default: a private one, if installed)"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the prompts")


def run(args: argparse.Namespace) -> int:
    report = call_with_flags(measure, args)
    if printed_json(args, report):
        return 0
    from rich.console import Console

    console = Console()
    print_table(
        f"SmolLM2-135M: TTFT of a {args.prefix_len}-token prefix + {args.suffix_len} new tokens",
        ("case", "TTFT p50 (ms)", "cached tokens", "load (ms)"),
        [
            (name, str(c["ttft_ms_p50"]), str(c["cached_tokens"][-1]), str(c.get("load_ms_per_request", "")))
            for name, c in report["cases"].items()
        ],
        console=console,
    )
    print_table(
        "writes through the background writers",
        ("tier", "blocks", "MiB", "seconds", "MB/s"),
        [
            (name, str(w["blocks"]), f"{w['bytes'] / 2**20:.1f}", str(w["write_s"]), str(w["write_mb_per_s"]))
            for name, w in report["writes"].items()
        ],
        console=console,
    )
    print_table(
        f"tiny-dsv4 through the disk tier: a {args.v4_prefix_len}-token prefix, by SWA strategy",
        ("strategy", "B / cached token", "snapshots read", "tokens recomputed", "restore (ms)", "TTFT (ms)"),
        [
            (
                name,
                str(row.get("bytes_per_cached_token", "")),
                str(row.get("snapshots_read", "")),
                str(row.get("tokens_recomputed", "")),
                str(row.get("restore_ms_p50", "")),
                str(row["ttft_ms_p50"]),
            )
            for name, row in report["v4_swa"].items()
        ],
        console=console,
    )
    if report["redis"].startswith("skipped"):
        console.print(f"redis: {report['redis']}")
    return 0
