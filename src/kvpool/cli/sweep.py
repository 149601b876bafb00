"""`kvpool simulate sweep`: a grid of runs, streamed into JSONL, and the cheapest deployment.

    kvpool simulate sweep --model llama-3.1-8b,qwen3-8b --gpu h100,h200 -tp 1,2 --rate 2,8 --out runs.jsonl
    kvpool simulate sweep ... --executor ray                      (Ray in local mode: this machine)
    kvpool simulate sweep ... --executor ray --ray-address ADDR   (a running Ray cluster)

The grid is models x GPUs x TP x layouts x block sizes x routings x rates (each flag a
comma list; sim/deployment.py `grid`). A deployment that cannot run (a model that leaves no
KV pool on its TP GPUs, TP past one node) is left out before anything is simulated, with a
line on stderr saying why (sim/sweep.py `runnable`: the deployment, and the workload on
each model: a trace's ids within its vocabulary); a grid of which nothing can run is an
error. A point that still fails as it runs, or whose worker process is killed outright (out
of memory), is a row holding its error (and a line on stderr); the others run on, and the
sweep's status is 1 at the end.

Each point's row is written to the JSONL (`--out`, else stdout) and flushed as soon as the
point finishes, in the order they finish, with its place in the grid as `point`: a sweep
that stops half way (a crash, Ctrl-C) keeps every row it finished. The plots and the summary
are drawn from that JSONL once the grid is done. The executors (a process pool, Ray) and the
cheapest-deployment search are sim/sweep.py's; this module parses, writes and prints."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from typing import Any

from kvpool.cli.simulate import SLO_ATTAINMENT
from kvpool.sim.deployment import SimOptions
from kvpool.sim.sweep import (
    cheapest_deployment,
    describe,
    error_row,
    finished,
    map_processes,
    map_ray,
    point_or_error,
    read_rows,
    runnable,
)


def run_sweep(args: argparse.Namespace, options: SimOptions, points: Sequence[dict[str, Any]]) -> int:
    """Run the grid, each row written as its point finishes; then the plots and the cheapest
    deployment, from the JSONL."""
    executor = args.executor or "processes"
    attainment = SLO_ATTAINMENT if args.slo_attainment is None else args.slo_attainment
    if args.ray_address and executor != "ray":
        raise ValueError("--ray-address: a Ray cluster runs the sweep only with --executor ray")
    if not attainment <= 1.0:
        raise ValueError(f"--slo-attainment: expected a fraction in (0, 1], got {attainment}")
    points, left_out = runnable(options, points)
    for why in left_out:
        tp = "" if why.tp is None else f" at TP {why.tp}"
        where = "" if why.gpu is None else f" on {why.gpu}{tp}"  # (None: the workload does not fit the model)
        print(f"kvpool simulate sweep: left out {why.model}{where}: {why.reason}", file=sys.stderr)
    if not points:
        raise ValueError(f"no point of the grid can run: {left_out[0].reason}")
    jobs = min(args.jobs or os.cpu_count() or 1, len(points))
    payloads = [(options, p) for p in points]
    if executor == "ray":
        results = map_ray(point_or_error, payloads, jobs, args.ray_address)
    else:
        results = map_processes(point_or_error, payloads, jobs)
    rows: list[dict] = []
    num_failed = 0
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    out = open(args.out, "w") if args.out else sys.stdout  # noqa: SIM115 (stdout is not ours to close)
    try:
        for index, row in results:
            if "error" in row:  # this point failed: its error is its row, the others run on
                num_failed += 1
                row = error_row(options, index, points[index], row)
                print(
                    f"kvpool simulate sweep: point {index} ({_point_words(row)}) failed: {row['error']}",
                    file=sys.stderr,
                )
                if "traceback" in row:
                    print(row["traceback"].rstrip(), file=sys.stderr)
            else:
                row = {"point": index, **row}
            out.write(json.dumps(row) + "\n")
            out.flush()  # on disk as the point finishes: a sweep that stops keeps it
            rows.append(row)
    finally:
        if out is not sys.stdout:
            out.close()
    if args.out:
        print(f"kvpool simulate sweep: {len(rows)} runs -> {args.out}", file=sys.stderr)
        rows = read_rows(args.out)  # what the plots and the summary read is the file
    else:
        rows.sort(key=lambda r: r["point"])
    ran = finished(rows)
    if args.plot and ran:
        from kvpool.sim.plots import plot_sweep, rateless

        left_off = rateless(ran)
        if len(left_off) == len(ran):  # (two empty plots were written, and matplotlib warned)
            kinds = " or ".join(sorted({"rate inf" if r["request_rate"] == "inf" else "a trace" for r in ran}))
            print(
                f"kvpool simulate sweep: --plot wrote no plot: no run has an arrival rate to plot goodput against "
                f"(every one is {kinds}); give --rate a list of finite rates to plot",
                file=sys.stderr,
            )
            left_off = []
        else:
            for path in plot_sweep(ran, args.plot):
                print(f"kvpool simulate sweep: wrote {path}", file=sys.stderr)
        if left_off:  # (silently, a rate-inf point was simply missing from the plots)
            named = ", ".join(f"point {r['point']} ({_point_words(r)})" for r in left_off)
            print(
                f"kvpool simulate sweep: the goodput-vs-rate plots leave off {len(left_off)} of {len(ran)} runs, "
                f"which have no arrival rate to plot: {named}",
                file=sys.stderr,
            )
    if ran:
        print(describe(cheapest_deployment(ran, attainment), attainment), file=sys.stderr)
    if num_failed:
        where = f" (their rows in {args.out} hold the error)" if args.out else " (their rows hold the error)"
        print(f"kvpool simulate sweep: {num_failed} of {len(points)} points failed{where}", file=sys.stderr)
        return 1
    return 0


def _point_words(row: dict) -> str:
    """'llama-3.1-8b on h200, layout paged, rate 8.0': a point, in the grid's words (the
    routing where it is not the default round-robin; a trace's run "the trace's arrivals")."""
    tp = "" if row["tp"] is None else f" at TP {row['tp']}"
    layout = "" if row["layout"] is None else f", layout {row['layout']}"
    block = "" if row["block_size"] is None else f" block {row['block_size']}"
    routing = "" if row.get("routing", "round-robin") == "round-robin" else f", routing {row['routing']}"
    rate = "the trace's arrivals" if row["request_rate"] == "trace" else f"rate {row['request_rate']}"
    return f"{row['model']} on {row['gpu']}{tp}{layout}{block}{routing}, {rate}"
