"""`kvpool bench serve`: real streaming clients against `kvpool serve` (or any
OpenAI-compatible server) replaying the chat workload of `kvpool run`; TTFT / TPOT / ITL
p50 and p99, throughput, goodput under the SLOs and the prefix-cache hit rate, one row per
concurrency (or request rate). The figures and how they are measured: kvpool/server/loadgen.py.

Without --url it starts `kvpool serve --port 0` itself (the embedded SmolLM2-135M) and
stops it at the end. With --url it waits for the server's /v1/models to answer, up to
--ready-timeout (a server still loading its model: `kvpool serve` accepts connections before
it answers them), saying so on stderr after a second; a port that refuses connections for
REFUSED_TIMEOUT_S has nothing listening on it and is an error at once.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from kvpool.cli.args import positive_float, positive_int, rate

READY_TIMEOUT_S = 300.0  # --ready-timeout's default: a server that accepts connections, loading
REFUSED_TIMEOUT_S = 3.0  # retries while connecting fails (refused, no such host): nothing listens
WAITING_NOTICE_S = 1.0  # say that we wait once we have waited this long


def _levels(text: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected client counts such as 1,4,16, got {text!r}") from None
    if not values or min(values) <= 0:
        raise argparse.ArgumentTypeError(f"client counts must be positive, got {text!r}")
    return values


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
        "--request-rate", type=_rates, default=None, help="conversations per second (Poisson; inf), one row each"
    )
    parser.add_argument("--num-requests", type=positive_int, default=32, help="requests per row")
    parser.add_argument("--turns", type=positive_int, default=2, help="turns per conversation")
    parser.add_argument("--max-tokens", type=positive_int, default=32, help="max_tokens of each request")
    parser.add_argument("--duration-limit", type=positive_float, default=300.0, help="seconds per row, at most")
    parser.add_argument("--slo-ttft-ms", type=positive_float, default=1000.0, help="goodput SLO: TTFT, ms")
    parser.add_argument("--slo-tpot-ms", type=positive_float, default=200.0, help="goodput SLO: TPOT, ms")
    parser.add_argument("--seed", type=int, default=0, help="the workload's and the samplers' seed")
    parser.add_argument(
        "--kv-memory", default=None, help="without --url: the started server's --kv-memory (default: its own)"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")


def _start_server(args: argparse.Namespace) -> tuple[subprocess.Popen, str]:
    command = [sys.executable, "-m", "kvpool", "serve", "--port", "0"]
    if args.kv_memory:
        command += ["--kv-memory", args.kv_memory]
    if args.api_key:
        command += ["--api-key", args.api_key]
    print("kvpool bench serve: starting kvpool serve", file=sys.stderr)
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()  # the ready line, or EOF if it failed
    if "ready on " not in line:
        proc.kill()
        err = proc.stderr.read() if proc.stderr else ""
        raise ValueError(f"kvpool serve did not start: {(err or line).strip().splitlines()[-1:]}")
    url = line.split("ready on ", 1)[1].split()[0]
    return proc, url


def _stop_server(proc: subprocess.Popen) -> None:
    import signal

    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()


def _wait_ready(url: str, api_key: str | None, timeout_s: float) -> str:
    """The server's model name, once /v1/models answers. A refused connection is retried for
    REFUSED_TIMEOUT_S at most, anything else that is not an answer yet (a connection that
    waits, a 5xx) until `timeout_s`; a 4xx is an answer, and an error."""
    import httpx

    try:
        parsed = httpx.URL(url)
    except httpx.InvalidURL as error:
        raise ValueError(f"--url {url!r}: {error}") from None
    if parsed.scheme not in ("http", "https") or not parsed.host:
        raise ValueError(f"--url {url!r}: expected http://HOST:PORT")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    start = time.monotonic()
    refused_since: float | None = None
    noticed = False
    while True:
        waited = time.monotonic() - start
        # short tries until the notice is out, so that a server that accepts and says nothing
        # does not keep us silent
        attempt_s = min(10.0 if noticed else WAITING_NOTICE_S, max(0.1, timeout_s - waited))
        try:
            r = httpx.get(f"{url}/v1/models", headers=headers, timeout=attempt_s)
            refused_since = None
            if r.status_code == 401:
                raise ValueError(f"{url} wants an API key: give --api-key")
            if 400 <= r.status_code < 500:
                raise ValueError(f"{url} is no OpenAI-compatible server: GET /v1/models answered {r.status_code}")
            r.raise_for_status()
            try:
                return r.json()["data"][0]["id"]
            except (ValueError, KeyError, IndexError, TypeError):
                raise ValueError(f"{url}: GET /v1/models answered no model list: {r.text[:200]!r}") from None
        except httpx.HTTPError as error:
            now = time.monotonic()
            if isinstance(error, httpx.ConnectError):
                refused_since = now if refused_since is None else refused_since
                if now - refused_since >= REFUSED_TIMEOUT_S:
                    raise ValueError(
                        f"cannot connect to {url} ({error}; retried for {REFUSED_TIMEOUT_S:g} s): start "
                        "`kvpool serve` there, or leave out --url to let the bench start one"
                    ) from None
            if now - start >= timeout_s:
                raise ValueError(
                    f"no OpenAI-compatible server answered at {url} within --ready-timeout {timeout_s:g} s: {error}"
                ) from None
            if not noticed and now - start >= WAITING_NOTICE_S:
                print(f"kvpool bench serve: waiting for {url} to answer", file=sys.stderr, flush=True)
                noticed = True
            time.sleep(0.25)


def _scrape(url: str) -> dict[str, float]:
    import httpx

    from kvpool.server.loadgen import scrape

    try:
        return scrape(url)
    except httpx.HTTPError as error:
        raise ValueError(f"{url}/metrics: {type(error).__name__}: {error}") from None


def run(args: argparse.Namespace) -> int:
    import asyncio

    from kvpool.server.loadgen import LoadConfig, run_load, summarize

    proc = None
    url = args.url.rstrip("/") if args.url else None
    try:
        if url is None:
            proc, url = _start_server(args)
        served = _wait_ready(url, args.api_key, args.ready_timeout)  # with --model too: the server must answer
        model = args.model or served
        if args.request_rate is not None:
            rows = [("request_rate", r) for r in args.request_rate]
        else:
            rows = [("concurrency", c) for c in (args.concurrency or [1, 4, 16])]
        results = []
        for kind, value in rows:
            config = LoadConfig(
                url=url,
                model=model,
                num_requests=args.num_requests,
                turns=args.turns,
                max_tokens=args.max_tokens,
                concurrency=value if kind == "concurrency" else None,
                request_rate=value if kind == "request_rate" else None,
                duration_limit_s=args.duration_limit,
                slo_ttft_ms=args.slo_ttft_ms,
                slo_tpot_ms=args.slo_tpot_ms,
                seed=args.seed,
                api_key=args.api_key,
            )
            before = _scrape(url)
            records, wall = asyncio.run(run_load(config))
            after = _scrape(url)
            results.append(summarize(config, records, wall, before, after))
            if not args.json:
                print(f"kvpool bench serve: {kind} {value}: {len(records)} requests, {wall:.1f} s", file=sys.stderr)
    finally:
        if proc is not None:
            _stop_server(proc)
    report = {"url": url if args.url else "started by the bench", "model": model, "rows": results}
    if args.json:
        print(json.dumps(report))
    else:
        _print(report)
    return 1 if any(r["num_ok"] == 0 for r in results) else 0


def _print(report: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"kvpool bench serve: {report['model']} ({report['url']})")
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
    shown = [(title, key) for title, key in columns if key is None or any(r[key] is not None for r in rows)]
    for title, _ in shown:
        table.add_column(title, justify="right")
    for r in rows:
        table.add_row(*(f"{r['num_ok']}/{r['num_requests']}" if key is None else str(r[key]) for _, key in shown))
    console = Console()
    if not console.is_terminal:
        console = Console(width=160)  # piped: wide enough for every column
    console.print(table)
    print("times in ms; goodput: requests/s within both SLOs; hit rate: the server's prefix-cache hit tokens / queried")
    for r in rows:
        for error in r["errors"]:
            print(f"kvpool bench serve: failed: {error}", file=sys.stderr)
