"""`kvpool bench serve`: real streaming clients against `kvpool serve` (or any
OpenAI-compatible server) replaying the chat workload of `kvpool run`; TTFT / TPOT / ITL
p50 and p99, throughput, goodput under the SLOs and the prefix-cache hit rate, one row per
concurrency (or request rate). kvpool/bench/serve.py runs it (and starts a server without
--url); the figures and how they are measured: kvpool/server/loadgen.py.
"""

from __future__ import annotations

import argparse
import os
import sys

from kvpool.bench.serve import READY_TIMEOUT_S, REFUSED_TIMEOUT_S, measure
from kvpool.cli.args import parsed_number, positive_float, positive_int, rate
from kvpool.cli.bench import call_with_flags, print_table, printed_json
from kvpool.cli.options import add_kv_memory_option


def _levels(text: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected client counts such as 1,4,16, got {text!r}") from None
    if not values or min(values) <= 0:
        raise argparse.ArgumentTypeError(f"client counts must be positive, got {text!r}")
    return values


def _seed(text: str) -> int:
    """--seed: an int in [-2**43, 2**43). The requests' seeds are seed * 1,000,003 + 0, 1, ...
    (server/loadgen.py), which must stay 64-bit: past it the server refused every request
    ("HTTP 400: seed: Input should be less than or equal to 9223372036854775807"), the
    server started and the rows run for nothing."""
    return parsed_number(text, int, lambda v: -(2**43) <= v < 2**43, "an integer in [-2**43, 2**43)")


def _rates(text: str) -> list[float]:
    return [rate(part) for part in text.split(",")]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", default=None, help="the server, e.g. http://127.0.0.1:8000 (default: start one)")
    parser.add_argument(
        "--ready-timeout",
        type=positive_float,
        default=READY_TIMEOUT_S,
        help=f"seconds to wait for --url to answer (a port that refuses connections: {REFUSED_TIMEOUT_S:g} s)",
    )
    parser.add_argument(
        "--api-key", default=os.environ.get("KVPOOL_API_KEY"), help="bearer token (default: $KVPOOL_API_KEY)"
    )
    parser.add_argument("--model", default=None, help="the model name to send (default: the server's only model)")
    load = parser.add_mutually_exclusive_group()
    load.add_argument(
        "--concurrency", type=_levels, default=None, help="clients, one row per value: 1,4,16 (default: 1,4,16)"
    )
    load.add_argument(
        "--request-rate",
        type=_rates,
        default=None,
        help="conversations per second (Poisson; inf), one row each (default: --concurrency's levels instead)",
    )
    parser.add_argument("--num-requests", type=positive_int, default=32, help="requests per row")
    parser.add_argument("--turns", type=positive_int, default=2, help="turns per conversation")
    parser.add_argument("--max-tokens", type=positive_int, default=32, help="max_tokens of each request")
    parser.add_argument("--duration-limit", type=positive_float, default=300.0, help="seconds per row, at most")
    parser.add_argument("--slo-ttft-ms", type=positive_float, default=1000.0, help="goodput SLO: TTFT, ms")
    parser.add_argument("--slo-tpot-ms", type=positive_float, default=200.0, help="goodput SLO: TPOT, ms")
    parser.add_argument("--seed", type=_seed, default=0, help="the workload's and the samplers' seed")
    add_kv_memory_option(parser, default=None, note="without --url: the started server's (default: its own)")


def run(args: argparse.Namespace) -> int:
    def say(text: str) -> None:
        print(f"kvpool bench serve: {text}", file=sys.stderr, flush=True)

    report = call_with_flags(
        measure,
        args,
        ready_timeout_s=args.ready_timeout,
        duration_limit_s=args.duration_limit,
        notice=say,
        progress=(lambda text: None) if args.json else say,
    )
    if not printed_json(args, report):
        _print(report)
    return 1 if any(r["num_ok"] == 0 for r in report["rows"]) else 0


def _print(report: dict) -> None:
    from rich.console import Console

    columns = [
        ("clients", "concurrency"),
        ("rate", "request_rate"),
        ("ok/sent", None),
        ("TTFT p50", "ttft_ms_p50"),
        ("TTFT p99", "ttft_ms_p99"),
        ("TPOT p50", "tpot_ms_p50"),
        ("TPOT p99", "tpot_ms_p99"),
        ("ITL p50", "itl_ms_p50"),
        ("ITL p99", "itl_ms_p99"),
        ("tok/s", "output_tokens_per_s"),
        ("req/s", "requests_per_s"),
        ("goodput", "goodput_req_s"),
        ("hit rate", "server_hit_rate"),
    ]
    rows = report["rows"]
    # a column none of the rows has is left out; a latency of None (TPOT, ITL: no answer had a
    # second token; any: no request succeeded) is "n/a", the column kept
    no_sample = ("ttft_ms_p50", "ttft_ms_p99", "tpot_ms_p50", "tpot_ms_p99", "itl_ms_p50", "itl_ms_p99")
    shown = [
        (title, key)
        for title, key in columns
        if key is None or key in no_sample or any(r[key] is not None for r in rows)
    ]
    console = Console()
    if not console.is_terminal:
        console = Console(width=160)  # piped: wide enough for every column
    print_table(
        f"kvpool bench serve: {report['model']} ({report['url']})",
        [title for title, _ in shown],
        [[_cell(r, key) for _, key in shown] for r in rows],
        console=console,
    )
    print("times in ms; goodput: requests/s within both SLOs; hit rate: the server's prefix-cache hit tokens / queried")
    for r in rows:
        for error in r["errors"]:
            print(f"kvpool bench serve: failed: {error}", file=sys.stderr)


def _cell(row: dict, key: str | None) -> str:
    """A row's value in the table: ok/sent for no key, "n/a" for None."""
    if key is None:
        return f"{row['num_ok']}/{row['num_requests']}"
    return "n/a" if row[key] is None else str(row[key])
