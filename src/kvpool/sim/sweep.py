"""A sweep's engine: the points of a grid that can run, two ways of running them in parallel,
and the cheapest deployment among the finished rows.

    from kvpool.sim.deployment import SimOptions, grid, sweep_point
    from kvpool.sim.sweep import cheapest_deployment, map_processes, runnable

    points = runnable(options, grid(...)).points
    rows = [{"point": i, **row} for i, row in map_processes(sweep_point, [(options, p) for p in points], jobs=4)]
    best = cheapest_deployment(rows, min_attainment=0.9)

`map_processes` and `map_ray` yield (index, row) as each point finishes, in the order they
finish, so a caller can write each row down at once (`kvpool simulate sweep` streams them
into JSONL: cli/sweep.py); a point whose worker dies outright (killed, out of memory) is
yielded as {"error": how}. Both give the same rows; tests/test_sim_sweep.py checks it. Ray
is an optional extra (`pip install "kvpool[ray]"`); its workers on a cluster need kvpool
installed, as Ray ships the function by reference, not its package.

`cheapest_deployment` reads the rows: among the runs meeting the SLO (at least
`min_attainment` of their requests within both the TTFT and the TPOT bound), the one with
the fewest GPUs per unit of goodput (replicas x tp / goodput_req_s); `describe` names it in
the words of `kvpool simulate`'s title ("1 H200", "8 H200 (2 replicas of TP 4)").
"""

from __future__ import annotations

import json
import math
import multiprocessing
import os
import signal
import tempfile
import traceback
from collections.abc import Callable, Generator, Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from typing import Any, NamedTuple

from kvpool.sim.deployment import SimOptions, deployment_of, deployment_words

EXECUTORS = ("processes", "ray")


def _ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _indexed(fn: Callable[[Any], dict], item: tuple[int, Any]) -> tuple[int, dict]:
    index, payload = item
    return index, fn(payload)


def _marked(fn: Callable[[Any], dict], marks: str, item: tuple[int, Any]) -> tuple[int, dict]:
    """In a worker: mark the point started (a file named by its index in `marks`, holding
    this process's id), then run it. A worker that dies takes no result back; its mark
    says which point it ran."""
    with open(os.path.join(marks, str(item[0])), "w") as f:
        f.write(str(os.getpid()))
    return _indexed(fn, item)


def map_processes(fn: Callable[[Any], dict], payloads: Sequence[Any], jobs: int) -> Iterator[tuple[int, dict]]:
    """(index, fn(payload)) as each finishes, over `jobs` spawned processes (in this one, in
    order, if jobs == 1). `fn` must be importable by name (a module-level function).

    A worker killed outright (the out-of-memory killer, kill -9) breaks the process pool, and
    every point it held fails with it. The point that worker ran comes back as (index,
    {"error": how its worker died}); the points it only stopped (run by the workers the
    broken pool terminates, or not started) run again in a fresh pool. Where the dead worker
    cannot be told apart from those the pool terminated (it died of a plain SIGTERM, or
    exited 0), each point running when the pool broke runs again alone, in a pool of one
    worker of its own: only a point whose worker dies again is such an error row. Those pools
    run side by side, and beside them a pool of the workers left (`jobs` in all) runs on
    through the other points while they run; then the sweep goes on with all `jobs`."""
    if jobs <= 1:
        for item in enumerate(payloads):
            yield _indexed(fn, item)
        return
    todo = list(range(len(payloads)))
    alone: list[int] = []  # points running when an unknown worker died: each reruns in a pool of its own
    while todo or alone:
        isolated = alone[:jobs]
        shared = todo if len(isolated) < jobs else []
        with tempfile.TemporaryDirectory(prefix="kvpool-sweep-") as marks:
            over, suspects = yield from _pool_round(fn, payloads, shared, isolated, jobs - len(isolated), marks)
        # (an isolated point always ends its round: a pool of one worker tells whose point died)
        alone = [i for i in alone if i not in over] + suspects
        todo = [i for i in todo if i not in over and i not in suspects]


def _pool_round(
    fn: Callable[[Any], dict], payloads: Sequence[Any], shared: list[int], isolated: list[int], jobs: int, marks: str
) -> Generator[tuple[int, dict], None, tuple[set[int], list[int]]]:
    """One round: a process pool of up to `jobs` workers over the points `shared`, and beside
    it a pool of one worker for each point of `isolated`, yielding as map_processes does.
    With isolated points, the shared pool takes a point of `shared` at a time, only while one
    of them runs: the points it never took are not through (they run in a later round).
    Returns the points the round is through with (finished, or an error row for a dead
    worker) and those that ran when a worker that cannot be told apart died (to run again
    alone). A broken pool's other points are neither: they run again in the next round."""
    spawn = multiprocessing.get_context("spawn")
    # a round with isolated points feeds its shared pool a point at a time, only while an
    # isolated point runs: once they are through, the round ends with its running points and
    # the next one has all `jobs` workers (review 9: after a lone early death the rest of an
    # 80-point sweep ran on 3 of 4 workers). Points never submitted run in a later round.
    feed = list(shared) if isolated else []
    groups = [([i], 1) for i in isolated] + ([(shared, min(jobs, len(shared)))] if shared else [])
    # (executor, its points submitted, its workers, their processes): pid -> worker Process, the
    # executor's own table (no public one before Python 3.14), kept to stop the workers at
    # once (shutdown would wait for their points) and read how one died
    pools: list[tuple[ProcessPoolExecutor, list[int], int, dict[int, Any]]] = []
    done: set[int] = set()
    try:
        alone: set[Future] = set()
        fed: set[Future] = set()
        for points, num_workers in groups:
            # workers ignore Ctrl-C; the parent stops them (the CLI reports one line: cli/main.py)
            executor = ProcessPoolExecutor(num_workers, mp_context=spawn, initializer=_ignore_sigint)
            first = points[:num_workers] if feed and points is shared else points
            submitted = list(first)
            pools.append((executor, submitted, num_workers, executor._processes))
            futures = {executor.submit(_marked, fn, marks, (i, payloads[i])) for i in first}
            (alone if points is not shared else fed).update(futures)
        shared_executor, shared_submitted = (pools[-1][0], pools[-1][1]) if shared else (None, [])
        del feed[: len(shared_submitted)]
        pending = alone | fed
        while pending:
            finished, pending = wait(pending, return_when=FIRST_COMPLETED)
            for future in finished:
                alone.discard(future)
                try:
                    index, row = future.result()
                except BrokenProcessPool:  # its pool's points: read below, once every pool is through
                    if future in fed:
                        feed.clear()
                    continue
                done.add(index)
                if future in fed and alone and feed:  # (before the yield: a slow caller idles no worker)
                    try:
                        more = shared_executor.submit(_marked, fn, marks, (feed[0], payloads[feed[0]]))
                    except BrokenProcessPool:  # (its pool broke meanwhile: read below)
                        feed.clear()
                    else:
                        shared_submitted.append(feed.pop(0))
                        fed.add(more)
                        pending.add(more)
                yield index, row
    except BaseException:  # the caller stopped (Ctrl-C): the workers stop too
        for executor, _, _, workers in pools:
            _terminate(executor, workers)
        raise
    started = {int(name): _read_pid(os.path.join(marks, name)) for name in os.listdir(marks)}
    over, suspects = set(done), []
    for executor, points, num_workers, workers in pools:
        executor.shutdown()  # (a broken pool terminated its other workers: this joins them)
        errors, unknown = _broken_pool(points, num_workers, done, started, workers)
        for index, why in errors.items():
            yield index, {"error": why}
        over |= set(errors)
        suspects += unknown
    return over, suspects


def _broken_pool(
    points: list[int], num_workers: int, done: set[int], started: dict[int, int | None], workers: dict[int, Any]
) -> tuple[dict[int, str], list[int]]:
    """What a pool of `num_workers` over `points` leaves when it broke (nothing where all
    finished): an error for each point whose worker died, and the points that ran when a
    worker that cannot be told apart died (to run again alone). The others run again."""
    if all(i in done for i in points):
        return {}, []
    lost = sorted(i for i in points if i in started and i not in done)
    exit_codes = {pid: p.exitcode for pid, p in workers.items()}
    # the broken pool terminated the others (SIGTERM); the one that broke it died otherwise
    dead = {pid: code for pid, code in exit_codes.items() if code not in (0, -signal.SIGTERM, None)}
    killed = [i for i in lost if started[i] in dead]
    if killed:
        return {i: f"its worker process died as it ran this point ({_death(dead[started[i]])})" for i in killed}, []
    if lost and num_workers == 1:  # one worker: the point it lost is its own, however it died
        return {
            i: f"its worker process died as it ran this point ({_how(exit_codes.get(started[i]))})" for i in lost
        }, []
    if lost:  # which of them died cannot be told: each runs again alone
        return {}, lost
    if not any(i in done for i in points):  # (died before it started a point: running them again could loop)
        return {i: "not run: a worker process died before it started a point" for i in points}, []
    return {}, []


def _read_pid(path: str) -> int | None:
    """The process id a worker wrote into its point's mark (None: it died writing it)."""
    with open(path) as f:
        text = f.read()
    return int(text) if text.isdigit() else None


def _how(exit_code: int | None) -> str:
    """_death's words, or that the exit code is unknown (the worker died writing its mark)."""
    return "its exit status unknown" if exit_code is None else _death(exit_code)


def _death(exit_code: int) -> str:
    """How a process ended, from its exit code: 'killed by SIGKILL (...)', 'exit status 3'."""
    if exit_code >= 0:
        return f"exit status {exit_code}"
    name = signal.Signals(-exit_code).name
    if -exit_code == signal.SIGKILL:
        return f"killed by {name}: the out-of-memory killer's signal, or kill -9"
    return f"killed by {name}"


def _terminate(executor: ProcessPoolExecutor, workers: dict[int, Any]) -> None:
    """Stop the pool now: the points not started are cancelled, the running ones' workers
    terminated (shutdown alone would wait for them to finish)."""
    executor.shutdown(wait=False, cancel_futures=True)
    for worker in list(workers.values()):
        worker.terminate()
    for worker in list(workers.values()):
        worker.join()


def map_ray(
    fn: Callable[[Any], dict], payloads: Sequence[Any], jobs: int, address: str | None
) -> Iterator[tuple[int, dict]]:
    """(index, fn(payload)) as each Ray task finishes. Without an address Ray starts in local
    mode on `jobs` CPUs of this machine (no dashboard) and stops afterwards; with one it joins
    that cluster and leaves it running. A Ray session already open in this process is reused.
    A task whose worker dies outright (killed, out of memory) each time Ray retries it comes
    back as (index, {"error": how}), as map_processes gives a dead worker's point."""
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
            except (ray.exceptions.WorkerCrashedError, ray.exceptions.OutOfMemoryError) as error:
                # its worker died outright (after Ray's retries): this point's error, the others run on
                why = str(error).strip().splitlines()[0] if str(error).strip() else ""
                yield (
                    index[done[0]],
                    {"error": f"its Ray worker died as it ran this point ({type(error).__name__}: {why})"},
                )
                continue
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


class LeftOut(NamedTuple):
    """A deployment of the grid that cannot run, once per model, GPU, TP and reason; a
    workload the model cannot take (gpu and tp None) once per model. The model and GPU are
    named as their presets name them (`preset_names`), as the reason and a run's report do."""

    model: str
    gpu: str | None  # None: every deployment of the model (its workload does not fit it)
    tp: int | None  # as the grid gave it (None: the fewest GPUs that fit)
    reason: str


class Runnable(NamedTuple):
    points: list[dict[str, Any]]  # the grid's points that can run, in grid order
    left_out: list[LeftOut]


def _workload_fits(options: SimOptions, point: dict[str, Any]) -> None:
    """ValueError when the point's workload cannot run on its model: a trace's token id past
    the model's vocabulary, a request longer than its context or --max-model-len. Lengths and
    ids do not depend on the rate: one check per model covers its points."""
    from kvpool.sim.deployment import make_workload
    from kvpool.sim.simulator import check_request_lens
    from kvpool.spec.models import model_by_name

    model = model_by_name(point["model"])
    workload = make_workload(options, model, point["rate"])
    check_request_lens(model, workload, options.max_model_len, flag="--max-model-len")


def runnable(options: SimOptions, points: Sequence[dict[str, Any]]) -> Runnable:
    """The points whose deployment can run (sim/deployment.py `deployment_of` accepts it) and
    whose workload fits the model (a trace's ids within its vocabulary, every request within
    its context), and why the others cannot (none can: `points` is empty, `left_out` says why)."""
    keep: list[dict[str, Any]] = []
    left_out: list[LeftOut] = []
    # (model, gpu, tp, block size, layout) -> why it cannot run ("": it can)
    checked: dict[tuple, str] = {}
    workload_checked: dict[str, str] = {}  # model -> why its workload cannot run ("": it can)
    for point in points:
        key = (point["model"], point["gpu"], point["tp"], point["block_size"], point["layout"])
        if key not in checked:
            try:
                deployment_of(options, point)
                checked[key] = ""
            except ValueError as error:
                checked[key] = str(error)
            if not checked[key]:
                if point["model"] not in workload_checked:
                    try:
                        _workload_fits(options, point)
                        workload_checked[point["model"]] = ""
                    except ValueError as error:
                        workload_checked[point["model"]] = str(error)
                checked[key] = workload_checked[point["model"]]
        if not checked[key]:
            keep.append(point)
        else:
            model, gpu = preset_names(options, point)
            model, gpu = model or point["model"], gpu or point["gpu"]  # (no preset: as typed)
            if workload_checked.get(point["model"]) == checked[key]:  # the workload's: once per model
                why = LeftOut(model, None, None, checked[key])
            else:
                why = LeftOut(model, gpu, point["tp"], checked[key])
            if why not in left_out:  # its reason once per model, GPU and TP
                left_out.append(why)
    return Runnable(keep, left_out)


def point_or_error(payload: tuple[SimOptions, dict[str, Any]]) -> dict:
    """What a sweep maps over its points: sim/deployment.py `sweep_point`'s row, or, for a
    point that fails, {"error": why} (the other points run on; the caller writes the error
    down as that point's row). A caller's mistake (ValueError, a file) is its message; any
    other exception is named by its type, its traceback kept under "traceback". Ctrl-C
    (KeyboardInterrupt, no Exception) still stops the sweep."""
    from kvpool.sim import deployment

    try:
        return deployment.sweep_point(payload)
    except (ValueError, FileNotFoundError) as error:
        return {"error": str(error)}
    except Exception as error:
        return {"error": f"{type(error).__name__}: {error}", "traceback": traceback.format_exc()}


# a point's axes, under a report's keys (the rate is request_rate)
AXES = ("model", "gpu", "tp", "layout", "block_size", "routing")


def preset_names(options: SimOptions, point: dict[str, Any]) -> tuple[str | None, str | None]:
    """`point`'s model and GPU as their presets name them, as a run's report does
    ("llama-3.1-8b", "H200", whatever the case typed); None for one that names no preset."""
    from kvpool.sim.deployment import gpu_preset
    from kvpool.spec.models import model_by_name

    model = gpu = None
    try:
        model = model_by_name(point["model"]).name
    except (ValueError, OSError):
        pass
    try:
        gpu = gpu_preset(point["gpu"], options.gpu_memory_utilization).name
    except ValueError:
        pass
    return model, gpu


def resolved_axes(options: SimOptions, point: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """`point`'s axes as a finished run of it reports them (sim/report.py): the model's and
    the GPU's names ("llama-3.1-8b", "H200", whatever the case typed), the TP picked where
    none was asked, the layout and block size the run builds (the model's default layout;
    contiguous: a block is the longest request, or --max-model-len), the routing as given;
    and the names of the axes left as the grid gave them because resolving them failed
    (say, a deployment the planner refuses: its tp, layout and block_size stay as typed)."""
    from kvpool.sim.deployment import make_workload
    from kvpool.sim.layouts import default_layout
    from kvpool.sim.simulator import plan_replica

    model_name, gpu_name = preset_names(options, point)
    resolved: dict[str, Any] = {"model": model_name, "gpu": gpu_name}
    resolved = {axis: name for axis, name in resolved.items() if name is not None}
    try:
        model, gpu, tp, _, config = deployment_of(options, point)
        p = plan_replica(model, gpu, config, options.host_mode)
        layout = config.layout or default_layout(p)
        if layout == "contiguous":  # (its block is one request's reservation: layouts.build_layout)
            block_size = config.max_model_len or make_workload(options, model, point["rate"]).max_request_len()
        else:
            block_size = p.layout.block_size
        resolved |= {"tp": tp, "layout": layout, "block_size": block_size}
    except (ValueError, OSError):
        pass
    as_given = [k for k in AXES if k not in resolved and k != "routing"]
    return {k: resolved.get(k, point[k]) for k in AXES}, as_given


def error_row(options: SimOptions, index: int, point: dict[str, Any], failed: dict) -> dict:
    """The JSONL row of a point that failed: its place, its axes as a finished row of it
    would hold them (`resolved_axes`: "H200", tp 1, layout "paged", block_size 16), its
    request_rate as a report writes it, and the error. An axis that could not be resolved
    keeps the grid's value (gpu "h200", tp None where the default was asked), and
    "as_given" names those (the key only where there are some)."""
    rate = point["rate"]
    request_rate = "trace" if options.trace else rate if math.isfinite(rate) else "inf"
    axes, as_given = resolved_axes(options, point)
    unresolved = {"as_given": as_given} if as_given else {}
    return {"point": index, **axes, "request_rate": request_rate, **unresolved, **failed}


def finished(rows: Sequence[dict]) -> list[dict]:
    """The rows of the points that ran (a failed point's row holds "error" instead of a report)."""
    return [row for row in rows if "error" not in row]


def read_rows(path: str) -> list[dict]:
    """A sweep's JSONL rows, in grid order (by `point`)."""
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return sorted(rows, key=lambda r: r["point"])


class Deployment(NamedTuple):
    """The cheapest run meeting the SLO: its row and its GPUs per unit of goodput (req/s)."""

    row: dict
    num_gpus: int
    gpus_per_goodput: float
    gpu_kinds: tuple[str, ...] = ()  # the GPUs of the rows compared: counts, whatever each costs


def cheapest_deployment(rows: Sequence[dict], min_attainment: float) -> Deployment | None:
    """Among rows with slo_attainment >= min_attainment and goodput > 0 (a failed point's
    row, which holds "error", is none of them), the fewest
    replicas x tp GPUs per request/s of goodput; the first in grid order on a tie. None when
    no run meets the SLO. GPUs are counted: an H100 and an H200 count one each (the
    Deployment names the kinds compared)."""
    if not 0.0 < min_attainment <= 1.0:
        raise ValueError(f"--slo-attainment: expected a fraction in (0, 1], got {min_attainment}")
    best: Deployment | None = None
    rows = finished(rows)
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
    if best is None:
        return f"kvpool simulate sweep: no run meets the SLO ({min_attainment:.0%} of requests within both bounds)"
    r = best.row
    mixed = len(best.gpu_kinds) > 1
    where = deployment_words(r["replicas"], r["tp"], r["gpu"], r.get("prefill_replicas", 0))
    block = f" block {r['block_size']}" if r.get("block_size") is not None else ""
    return (
        f"kvpool simulate sweep: cheapest deployment meeting the SLO ({min_attainment:.0%} within "
        f"TTFT {r['slo_ttft_ms']:g} ms, TPOT {r['slo_tpot_ms']:g} ms): {r['model']} on "
        f"{where}, layout {r['layout']}{block}, rate "
        f"{r['request_rate']}: goodput {r['goodput_req_s']:g} req/s, {best.gpus_per_goodput:.3g} GPUs per req/s"
        + (f" (GPU counts compared across {', '.join(best.gpu_kinds)}, not their prices)" if mixed else "")
    )
