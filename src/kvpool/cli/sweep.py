"""`kvpool simulate sweep`: a grid of runs, streamed into JSONL, and the cheapest deployment.

    kvpool simulate sweep --model llama-3.1-8b,qwen3-8b --gpu h100,h200 -tp 1,2 --rate 2,8 --out runs.jsonl
    kvpool simulate sweep ... --executor ray                      (Ray in local mode: this machine)
    kvpool simulate sweep ... --executor ray --ray-address ADDR   (a running Ray cluster)

The grid is models x GPUs x TP x layouts x block sizes x routings x rates (each flag a
comma list; cli/simulate.py `_runs`). A deployment that cannot run (a model that leaves no
KV pool on its TP GPUs, TP past one node) is left out before anything is simulated, with a
line on stderr saying why; a grid of which nothing can run is an error.

Each point's row is written to the JSONL (`--out`, else stdout) and flushed as soon as the
point finishes, in the order they finish, with its place in the grid as `point`: a sweep
that stops half way (a crash, Ctrl-C) keeps every row it finished. The plots and the summary
are drawn from that JSONL once the grid is done. Both executors give the same rows;
tests/test_sim_sweep.py checks it. Ray is an optional extra (`pip install "kvpool[ray]"`);
its workers on a cluster need kvpool installed, as Ray ships the function by reference, not
its package.

`cheapest_deployment` reads the rows: among the runs meeting the SLO (at least
`min_attainment` of their requests within both the TTFT and the TPOT bound), the one with the
fewest GPUs per unit of goodput (replicas x tp / goodput_req_s), named in the words of
`kvpool simulate`'s title ("1 H200", "8 H200 (2 replicas of TP 4)")."""

from __future__ import annotations

import argparse
import functools
import json
import multiprocessing
import os
import signal
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

EXECUTORS = ("processes", "ray")


def _ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _indexed(fn: Callable[[Any], dict], item: tuple[int, Any]) -> tuple[int, dict]:
    index, payload = item
    return index, fn(payload)


def map_processes(fn: Callable[[Any], dict], payloads: Sequence[Any], jobs: int) -> Iterator[tuple[int, dict]]:
    """(index, fn(payload)) as each finishes, over `jobs` spawned processes (in this one, in
    order, if jobs == 1)."""
    if jobs <= 1:
        for item in enumerate(payloads):
            yield _indexed(fn, item)
        return
    # workers ignore Ctrl-C; the parent stops them and reports one line (cli/main.py)
    pool = multiprocessing.get_context("spawn").Pool(jobs, initializer=_ignore_sigint)
    try:
        yield from pool.imap_unordered(functools.partial(_indexed, fn), enumerate(payloads))
        pool.close()
    except BaseException:  # a failed point, or the caller stopped: the other workers stop too
        pool.terminate()
        raise
    finally:
        pool.join()


def map_ray(
    fn: Callable[[Any], dict], payloads: Sequence[Any], jobs: int, address: str | None
) -> Iterator[tuple[int, dict]]:
    """(index, fn(payload)) as each Ray task finishes. Without an address Ray starts in local
    mode on `jobs` CPUs of this machine (no dashboard) and stops afterwards; with one it joins
    that cluster and leaves it running. A Ray session already open in this process is reused."""
    try:
        import ray
    except ImportError:
        raise ValueError('--executor ray: ray is not installed (pip install "kvpool[ray]")') from None
    started = not ray.is_initialized()
    if started:
        if address:
            ray.init(address=address, log_to_driver=False)
        else:
            ray.init(num_cpus=jobs, include_dashboard=False, log_to_driver=False)
    try:
        task = ray.remote(num_cpus=1)(fn)
        refs = [task.remote(p) for p in payloads]
        index = {ref: i for i, ref in enumerate(refs)}
        pending = list(refs)
        while pending:  # as they finish: the first failure surfaces without waiting for the rest
            done, pending = ray.wait(pending, num_returns=1)
            try:
                row = ray.get(done[0])
            except ray.exceptions.RayTaskError as error:
                for ref in pending:
                    ray.cancel(ref)
                cause = error.cause if isinstance(error.cause, Exception) else None
                if isinstance(cause, ValueError | FileNotFoundError):  # a caller's mistake: one line
                    raise cause from None
                raise
            yield index[done[0]], row
    finally:
        if started:
            ray.shutdown()


def runnable(args: argparse.Namespace, combos: Sequence[dict]) -> list[dict]:
    """The combinations whose deployment can run; a line on stderr for each one left out (its
    reason once per model, GPU and TP), ValueError when none can."""
    from kvpool.cli.simulate import _deployment_of

    keep: list[dict] = []
    # (model, gpu, tp, block size, layout) -> why it cannot run ("": it can)
    checked: dict[tuple, str] = {}
    left_out: set[tuple] = set()
    for combo in combos:
        key = (combo["model"], combo["gpu"], combo["tp"], combo["block_size"], combo["layout"])
        if key not in checked:
            try:
                _deployment_of(args, combo)
                checked[key] = ""
            except ValueError as error:
                checked[key] = str(error)
        if not checked[key]:
            keep.append(combo)
        elif (*key[:3], checked[key]) not in left_out:  # its reason once per model, GPU and TP
            left_out.add((*key[:3], checked[key]))
            tp = "" if combo["tp"] is None else f" at TP {combo['tp']}"
            print(f"kvpool simulate sweep: left out {key[0]} on {key[1]}{tp}: {checked[key]}", file=sys.stderr)
    if not keep:
        raise ValueError(f"no point of the grid can run: {next(iter(checked.values()))}")
    return keep


def read_rows(path: str) -> list[dict]:
    """A sweep's JSONL rows, in grid order (by `point`)."""
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return sorted(rows, key=lambda r: r["point"])


def run_sweep(args: argparse.Namespace, combos: Sequence[dict]) -> int:
    """Run the grid, each row written as its point finishes; then the plots and the cheapest
    deployment, from the JSONL."""
    from kvpool.cli import simulate

    if args.ray_address and args.executor != "ray":
        raise ValueError("--ray-address: a Ray cluster runs the sweep only with --executor ray")
    if not args.slo_attainment <= 1.0:
        raise ValueError(f"--slo-attainment: expected a fraction in (0, 1], got {args.slo_attainment}")
    combos = runnable(args, combos)
    jobs = min(args.jobs or os.cpu_count() or 1, len(combos))
    payloads = [(args, c) for c in combos]
    if args.executor == "ray":
        results = map_ray(simulate._sweep_one, payloads, jobs, args.ray_address)
    else:
        results = map_processes(simulate._sweep_one, payloads, jobs)
    rows: list[dict] = []
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    out = open(args.out, "w") if args.out else sys.stdout  # noqa: SIM115 (stdout is not ours to close)
    try:
        for index, row in results:
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
    if args.plot:
        from kvpool.sim.plots import plot_sweep

        for path in plot_sweep(rows, args.plot):
            print(f"kvpool simulate sweep: wrote {path}", file=sys.stderr)
    print(describe(cheapest_deployment(rows, args.slo_attainment), args.slo_attainment), file=sys.stderr)
    return 0


class Deployment(NamedTuple):
    """The cheapest run meeting the SLO: its row and its GPUs per unit of goodput (req/s)."""

    row: dict
    num_gpus: int
    gpus_per_goodput: float
    gpu_kinds: tuple[str, ...] = ()  # the GPUs of the rows compared: counts, whatever each costs


def cheapest_deployment(rows: Sequence[dict], min_attainment: float) -> Deployment | None:
    """Among rows with slo_attainment >= min_attainment and goodput > 0, the fewest
    replicas x tp GPUs per request/s of goodput; the first in grid order on a tie. None when
    no run meets the SLO. GPUs are counted: an H100 and an H200 count one each (the
    Deployment names the kinds compared)."""
    if not 0.0 < min_attainment <= 1.0:
        raise ValueError(f"--slo-attainment: expected a fraction in (0, 1], got {min_attainment}")
    best: Deployment | None = None
    for row in rows:
        goodput = row["goodput_req_s"]
        if row["slo_attainment"] < min_attainment or not goodput > 0:
            continue
        num_gpus = row["replicas"] * row["tp"]
        candidate = Deployment(row, num_gpus, num_gpus / goodput)
        if best is None or candidate.gpus_per_goodput < best.gpus_per_goodput:
            best = candidate
    if best is None:
        return None
    return best._replace(gpu_kinds=tuple(dict.fromkeys(row["gpu"] for row in rows)))


def describe(best: Deployment | None, min_attainment: float) -> str:
    """The summary line a sweep prints on stderr, the deployment in `kvpool simulate`'s words."""
    from kvpool.cli.simulate import _deployment

    if best is None:
        return f"kvpool simulate sweep: no run meets the SLO ({min_attainment:.0%} of requests within both bounds)"
    r = best.row
    mixed = len(best.gpu_kinds) > 1
    where = _deployment(r["replicas"], r["tp"], r["gpu"], r.get("prefill_replicas", 0))
    block = f" block {r['block_size']}" if r.get("block_size") is not None else ""
    return (
        f"kvpool simulate sweep: cheapest deployment meeting the SLO ({min_attainment:.0%} within "
        f"TTFT {r['slo_ttft_ms']:g} ms, TPOT {r['slo_tpot_ms']:g} ms): {r['model']} on "
        f"{where}, layout {r['layout']}{block}, rate "
        f"{r['request_rate']}: goodput {r['goodput_req_s']:g} req/s, {best.gpus_per_goodput:.3g} GPUs per req/s"
        + (f" (GPU counts compared across {', '.join(best.gpu_kinds)}, not their prices)" if mixed else "")
    )
