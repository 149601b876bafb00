"""Where `kvpool simulate sweep` runs its grid: a process pool on this host, or Ray.

    kvpool simulate sweep ... --executor ray                      (Ray in local mode: this machine)
    kvpool simulate sweep ... --executor ray --ray-address ADDR   (a running Ray cluster)

Both executors return the rows in grid order, so the JSONL, the plots and the cheapest
deployment come out the same whichever ran them (tests/test_sim_sweep.py checks it). Ray is
an optional extra (`pip install "kvpool[ray]"`); its workers on a cluster need kvpool
installed, as Ray ships the function by reference, not its package.

`cheapest_deployment` reads the rows: among the runs meeting the SLO (at least
`min_attainment` of their requests within both the TTFT and the TPOT bound), the one with the
fewest GPUs per unit of goodput (replicas x tp / goodput_req_s)."""

from __future__ import annotations

import multiprocessing
import signal
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

EXECUTORS = ("processes", "ray")


def _ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def map_processes(fn: Callable[[Any], dict], payloads: Sequence[Any], jobs: int) -> list[dict]:
    """fn over payloads in `jobs` spawned processes (in this one if jobs == 1), in order."""
    if jobs <= 1:
        return [fn(p) for p in payloads]
    # workers ignore Ctrl-C; the parent stops them and reports one line (cli/main.py)
    pool = multiprocessing.get_context("spawn").Pool(jobs, initializer=_ignore_sigint)
    try:
        rows = pool.map(fn, payloads)
        pool.close()
    except BaseException:
        pool.terminate()
        raise
    finally:
        pool.join()
    return rows


def map_ray(fn: Callable[[Any], dict], payloads: Sequence[Any], jobs: int, address: str | None) -> list[dict]:
    """fn over payloads as Ray tasks, in order. Without an address Ray starts in local mode on
    `jobs` CPUs of this machine (no dashboard) and stops afterwards; with one it joins that
    cluster and leaves it running. A Ray session already open in this process is reused."""
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
        rows: list[dict | None] = [None] * len(refs)
        index = {ref: i for i, ref in enumerate(refs)}
        pending = list(refs)
        while pending:  # as they finish: the first failure surfaces without waiting for the rest
            done, pending = ray.wait(pending, num_returns=1)
            try:
                rows[index[done[0]]] = ray.get(done[0])
            except ray.exceptions.RayTaskError as error:
                for ref in pending:
                    ray.cancel(ref)
                cause = error.cause if isinstance(error.cause, Exception) else None
                if isinstance(cause, ValueError | FileNotFoundError):  # a caller's mistake: one line
                    raise cause from None
                raise
        assert all(r is not None for r in rows)
        return rows  # type: ignore[return-value]
    finally:
        if started:
            ray.shutdown()


class Deployment(NamedTuple):
    """The cheapest run meeting the SLO: its row and its GPUs per unit of goodput (req/s)."""

    row: dict
    num_gpus: int
    gpus_per_goodput: float


def cheapest_deployment(rows: Sequence[dict], min_attainment: float) -> Deployment | None:
    """Among rows with slo_attainment >= min_attainment and goodput > 0, the fewest
    replicas x tp GPUs per request/s of goodput; the first in grid order on a tie. None when
    no run meets the SLO."""
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
    return best


def describe(best: Deployment | None, min_attainment: float) -> str:
    """The summary line a sweep prints on stderr."""
    if best is None:
        return f"kvpool simulate sweep: no run meets the SLO ({min_attainment:.0%} of requests within both bounds)"
    r = best.row
    gpus = f"{best.num_gpus} GPU{'s' if best.num_gpus != 1 else ''}"
    block = f" block {r['block_size']}" if r.get("block_size") is not None else ""
    return (
        f"kvpool simulate sweep: cheapest deployment meeting the SLO ({min_attainment:.0%} within "
        f"TTFT {r['slo_ttft_ms']:g} ms, TPOT {r['slo_tpot_ms']:g} ms): {r['model']} on {r['replicas']} x "
        f"tp {r['tp']} {r['gpu']} ({gpus}), layout {r['layout']}{block}, rate "
        f"{r['request_rate']}: goodput {r['goodput_req_s']:g} req/s, {best.gpus_per_goodput:.3g} GPUs per req/s"
    )
