"""`kvpool simulate sweep`'s executors and its summary: Ray in local mode gives the process
pool's JSONL rows (all but the wall-clock keys), the cheapest deployment meeting the SLO is
picked by GPUs per goodput on hand-made rows and on a models x TP x rates grid checked by
hand from its JSONL, rows are written as their points finish (a failing point is a row
holding its error, the others run on, status 1; Ctrl-C still stops it all), deployments
that cannot run (a trace past a model's vocabulary too) are left out in a line, and bad
flags are one line."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
import warnings

import pytest

from kvpool.cli.main import main
from kvpool.cli.sweep import _point_words
from kvpool.sim.sweep import AXES, cheapest_deployment, describe, map_processes, map_ray

# measured on this machine's clock, not the simulated one: they differ from run to run
WALL_CLOCK_KEYS = ("sim_wall_s", "alloc_latency_us_p50", "alloc_latency_us_p99", "sim_us_per_step_by_quarter")
GRID = ["--model", "llama-3.1-8b", "--requests", "12", "--layout", "paged,contiguous", "--rate", "2,8"]


def _rows(path) -> list[dict]:
    """The rows in grid order (they are written as their points finish)."""
    rows = sorted((json.loads(line) for line in path.read_text().splitlines()), key=lambda r: r["point"])
    return [{k: v for k, v in r.items() if k not in WALL_CLOCK_KEYS} for r in rows]


def test_ray_local_mode_writes_the_process_pools_rows(tmp_path, capsys):
    pytest.importorskip("ray")
    pool_out, ray_out = tmp_path / "pool.jsonl", tmp_path / "ray.jsonl"
    assert main(["simulate", "sweep", *GRID, "--out", str(pool_out), "--jobs", "1"]) == 0
    pool_err = capsys.readouterr().err
    assert main(["simulate", "sweep", *GRID, "--out", str(ray_out), "--jobs", "2", "--executor", "ray"]) == 0
    ray_err = capsys.readouterr().err
    pool_rows, ray_rows = _rows(pool_out), _rows(ray_out)
    assert [r["point"] for r in ray_rows] == [0, 1, 2, 3]
    assert [(r["layout"], r["request_rate"]) for r in ray_rows] == [
        ("paged", 2.0),
        ("paged", 8.0),
        ("contiguous", 2.0),
        ("contiguous", 8.0),
    ]
    assert ray_rows == pool_rows
    summary = [line for line in pool_err.splitlines() if "cheapest deployment" in line]
    assert len(summary) == 1 and summary[0] in ray_err.splitlines()


def _row(replicas: int, tp: int, goodput: float, attainment: float, rate: float) -> dict:
    return {
        "model": "m",
        "gpu": "H200",
        "replicas": replicas,
        "tp": tp,
        "layout": "paged",
        "block_size": 16,
        "request_rate": rate,
        "goodput_req_s": goodput,
        "slo_attainment": attainment,
        "slo_ttft_ms": 2000.0,
        "slo_tpot_ms": 100.0,
    }


def test_the_cheapest_deployment_is_the_fewest_gpus_per_goodput_meeting_the_slo():
    rows = [
        _row(1, 1, 2.0, 0.95, 2.0),  # 1 GPU / 2 req/s = 0.5
        _row(1, 1, 5.0, 0.50, 8.0),  # 0.2, but half its requests miss the SLO
        _row(2, 2, 12.0, 0.92, 16.0),  # 4 GPUs / 12 req/s = 0.333...: the pick
        _row(1, 8, 20.0, 0.99, 32.0),  # 8 / 20 = 0.4
        _row(1, 1, 0.0, 1.00, 0.5),  # no goodput: never a pick
    ]
    best = cheapest_deployment(rows, 0.9)
    assert best is not None and best.row is rows[2] and best.num_gpus == 4
    assert best.gpus_per_goodput == pytest.approx(4 / 12, rel=1e-12)
    assert "m on 4 H200 (2 replicas of TP 2), layout paged" in describe(best, 0.9)
    assert "0.333 GPUs per req/s" in describe(best, 0.9)
    # at 50 % the one-GPU run at 8 req/s qualifies and wins (1 / 5 = 0.2)
    assert cheapest_deployment(rows, 0.5).row is rows[1]
    # a tie goes to the first in grid order
    assert cheapest_deployment([_row(1, 2, 4.0, 1.0, 4.0), _row(2, 1, 4.0, 1.0, 4.0)], 0.9).row["tp"] == 2
    assert cheapest_deployment(rows, 1.0) is None
    assert "no run meets the SLO (100% of requests" in describe(None, 1.0)


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (["--ray-address", "127.0.0.1:6379"], "--ray-address: a Ray cluster runs the sweep only with --executor ray"),
        (["--slo-attainment", "1.5"], "--slo-attainment: expected a fraction in (0, 1], got 1.5"),
    ],
)
def test_bad_sweep_flags_are_one_line(flags, expected, capsys):
    assert main(["simulate", "sweep", *GRID, *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"kvpool simulate: error: {expected}"]


def test_ray_missing_is_one_line(monkeypatch, capsys):
    import builtins

    real_import = builtins.__import__

    def no_ray(name, *args, **kwargs):
        if name == "ray" or name.startswith("ray."):
            raise ImportError("No module named 'ray'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_ray)
    assert main(["simulate", "sweep", *GRID, "--executor", "ray"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ['kvpool simulate: error: --executor ray: ray is not installed (pip install "kvpool[ray]")']


# 2 models x 2 TP x 2 rates of short uniform requests; at rate 64 on one GPU a third of them
# miss the 9 ms TPOT bound, at TP 2 one of twelve does
SMALL_GRID = ["--model", "llama-3.1-8b,qwen3-8b", "-tp", "1,2", "--rate", "4,64", "--workload", "uniform"]
SMALL_GRID += ["--requests", "12", "--prompt-len", "200:2000", "--output-len", "20:80"]
SMALL_GRID += ["--slo-tpot-ms", "9", "--slo-ttft-ms", "300"]
WORDS = {1: "1 H200", 2: "2 H200 (1 replica of TP 2)"}  # simulate's title, by hand


def test_a_models_by_tp_by_rates_grid_picks_what_its_jsonl_says(tmp_path, capsys):
    out = tmp_path / "grid.jsonl"
    assert main(["simulate", "sweep", *SMALL_GRID, "--slo-attainment", "0.95", "--jobs", "2", "--out", str(out)]) == 0
    err = capsys.readouterr().err.splitlines()
    rows = _rows(out)
    assert [(r["model"], r["tp"], r["request_rate"]) for r in rows] == [
        (m, tp, rate) for m in ("llama-3.1-8b", "qwen3-8b") for tp in (1, 2) for rate in (4.0, 64.0)
    ]
    # by hand: GPUs / goodput over the rows with at least 95 % of requests within both bounds
    ok = [r for r in rows if r["slo_attainment"] >= 0.95 and r["goodput_req_s"] > 0]
    pick = min(ok, key=lambda r: (r["tp"] / r["goodput_req_s"], r["point"]))
    unfiltered = min(rows, key=lambda r: r["tp"] / r["goodput_req_s"])
    assert unfiltered["slo_attainment"] < 0.95 and pick is not unfiltered  # the SLO decides this grid
    expected = (
        "kvpool simulate sweep: cheapest deployment meeting the SLO (95% within TTFT 300 ms, TPOT 9 ms): "
        f"{pick['model']} on {WORDS[pick['tp']]}, layout paged block 16, rate {pick['request_rate']}: "
        f"goodput {pick['goodput_req_s']:g} req/s, {pick['tp'] / pick['goodput_req_s']:.3g} GPUs per req/s"
    )
    assert err[-1] == expected


def test_rows_are_on_disk_as_their_points_finish_and_a_failing_point_is_a_row(tmp_path, capsys, monkeypatch):
    from kvpool.sim import deployment

    out = tmp_path / "grid.jsonl"
    real = deployment.sweep_point
    seen: list[list[str]] = []

    def second_fails(payload):
        _, combo = payload
        seen.append(out.read_text().splitlines())  # what the file holds as this point starts
        if len(seen) == 2:
            raise ValueError(f"point at rate {combo['rate']} failed")
        return real(payload)

    monkeypatch.setattr(deployment, "sweep_point", second_fails)
    assert main(["simulate", "sweep", *GRID, "--jobs", "1", "--out", str(out)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    point = "point 1 (llama-3.1-8b on H200 at TP 1, layout paged block 16, rate 8.0)"
    assert err[0] == f"kvpool simulate sweep: {point} failed: point at rate 8.0 failed"
    assert err[1] == f"kvpool simulate sweep: 4 runs -> {out}"
    assert err[2].startswith("kvpool simulate sweep: cheapest deployment meeting the SLO")
    assert err[3] == f"kvpool simulate sweep: 1 of 4 points failed (their rows in {out} hold the error)"
    assert len(seen) == 4 and seen[0] == [] and len(seen[1]) == 1 and len(seen[3]) == 3  # the others ran on
    rows = _rows(out)
    # its axes as the finished rows hold them (they were as typed: "h200", tp and block_size null)
    assert rows[1] == {
        "point": 1,
        "model": "llama-3.1-8b",
        "gpu": "H200",
        "tp": 1,
        "layout": "paged",
        "block_size": 16,
        "routing": "round-robin",
        "request_rate": 8.0,
        "error": "point at rate 8.0 failed",
    }
    assert {k: rows[0][k] for k in AXES} == {k: rows[1][k] for k in AXES}
    assert [(r["point"], r["layout"], r["request_rate"], "error" in r) for r in rows] == [
        (0, "paged", 2.0, False),
        (1, "paged", 8.0, True),
        (2, "contiguous", 2.0, False),
        (3, "contiguous", 8.0, False),
    ]


def test_an_unexpected_error_in_a_point_is_named_by_its_type_with_its_traceback(tmp_path, capsys, monkeypatch):
    from kvpool.sim import deployment

    def broken(payload):
        raise RuntimeError("a bug")

    monkeypatch.setattr(deployment, "sweep_point", broken)
    out = tmp_path / "grid.jsonl"
    assert main(["simulate", "sweep", *GRID, "--rate", "2", "--layout", "paged", "--jobs", "1", "--out", str(out)]) == 1
    err = capsys.readouterr().err
    assert "failed: RuntimeError: a bug\nTraceback (most recent call last):" in err
    assert err.rstrip().endswith(f"1 of 1 points failed (their rows in {out} hold the error)")
    assert "cheapest deployment" not in err  # no row ran: no summary to draw
    (row,) = _rows(out)
    assert row["error"] == "RuntimeError: a bug" and row["traceback"].rstrip().endswith("RuntimeError: a bug")


def test_ctrl_c_in_a_point_still_stops_the_sweep_in_one_line(tmp_path, capsys, monkeypatch):
    from kvpool.sim import deployment

    real = deployment.sweep_point
    calls = []

    def second_interrupted(payload):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(payload)

    monkeypatch.setattr(deployment, "sweep_point", second_interrupted)
    out = tmp_path / "grid.jsonl"
    assert main(["simulate", "sweep", *GRID, "--jobs", "1", "--out", str(out)]) == 130
    assert capsys.readouterr().err.strip().splitlines() == ["kvpool simulate: interrupted"]
    assert len(calls) == 2 and [r["point"] for r in _rows(out)] == [0]  # the finished row stayed


def test_a_trace_past_one_models_vocabulary_leaves_that_model_out(tmp_path, capsys):
    trace = tmp_path / "trace.jsonl"
    trace.write_text(
        '{"timestamp": 0.1, "prompt_ids": [1, 2, 60000, 5], "output_length": 4}\n'
        '{"timestamp": 0.2, "prompt_ids": [7, 8, 9], "output_length": 3}\n'
    )
    out = tmp_path / "grid.jsonl"
    flags = ["--trace", str(trace), "--model", "llama-3.1-8b,smollm2-135m", "--jobs", "1", "--out", str(out)]
    assert main(["simulate", "sweep", *flags, "--gpu", "h200,h100"]) == 0
    err = capsys.readouterr().err.splitlines()
    # once for the model, not once per GPU (it was said for h200 and again for h100)
    assert [line for line in err if "left out" in line] == [
        f"kvpool simulate sweep: left out smollm2-135m: {trace} line 1: prompt_ids[2] = 60000 is outside "
        "the vocabulary [0, 49152)"
    ]
    rows = _rows(out)  # llama-3.1-8b's 128,256 ids hold it
    assert [(r["model"], r["gpu"], r["request_rate"], r["num_requests"]) for r in rows] == [
        ("llama-3.1-8b", "H200", "trace", 2),
        ("llama-3.1-8b", "H100", "trace", 2),
    ]


def test_a_point_failing_in_a_worker_process_leaves_the_others_running(tmp_path, capsys):
    # 17.6 GiB of an H200: llama-3.1-8b's pool holds 1,472 tokens, fewer than one 2,004-token
    # request (found only once its cache is built, in the worker); smollm2-135m's holds it
    out = tmp_path / "grid.jsonl"
    flags = ["--model", "llama-3.1-8b,smollm2-135m", "--gpu-memory-utilization", "0.125", "--workload", "uniform"]
    flags += ["--requests", "2", "--prompt-len", "2000:2000", "--output-len", "4:4", "--rate", "2"]
    assert main(["simulate", "sweep", *flags, "--jobs", "2", "--out", str(out)]) == 1
    err = capsys.readouterr().err.splitlines()
    assert err[0] == (
        "kvpool simulate sweep: point 0 (llama-3.1-8b on H200 at TP 1, layout paged block 16, rate 2.0) failed: "
        "the workload's longest request "
        "(2,004 tokens) does not fit one replica's cache (1,472 tokens, layout paged)"
    )
    assert err[-1] == f"kvpool simulate sweep: 1 of 2 points failed (their rows in {out} hold the error)"
    failed, ran = _rows(out)
    assert failed["point"] == 0 and "error" in failed and "num_requests" not in failed
    assert (ran["point"], ran["model"], ran["num_requests"], "error" in ran) == (1, "smollm2-135m", 2, False)


def test_deployments_that_cannot_run_are_left_out_in_a_line(tmp_path, capsys):
    out = tmp_path / "grid.jsonl"
    flags = ["--model", "deepseek-v3", "-tp", "2,8", "--workload", "uniform", "--requests", "2", "--rate", "4"]
    flags += ["--prompt-len", "100:200", "--output-len", "4:8", "--jobs", "1", "--out", str(out)]
    assert main(["simulate", "sweep", *flags]) == 0
    err = capsys.readouterr().err.splitlines()
    assert err[0] == (
        "kvpool simulate sweep: left out deepseek-v3 on H200 at TP 2: deepseek-v3 leaves no KV pool on 2 x H200 "
        "(weights 314.0 GiB per device): raise --tensor-parallel-size"
    )
    assert [(r["point"], r["tp"]) for r in _rows(out)] == [(0, 8)]
    assert main(["simulate", "sweep", *flags[:2], "-tp", "2", *flags[4:]]) == 2
    assert (
        capsys.readouterr()
        .err.splitlines()[-1]
        .startswith("kvpool simulate: error: no point of the grid can run: deepseek-v3 leaves no KV pool on 2 x H200")
    )


def test_a_left_out_line_names_the_model_and_gpu_as_their_presets_do(capsys):
    """The line kept the names as typed ("on h100", "Llama-3.1-70B") while its reason and a
    run's report name the presets ("H100", "llama-3.1-70b"); the same GPU typed twice in
    two cases gave two lines. A name that is no preset stays as typed."""
    flags = ["--model", "Llama-3.1-70B", "--gpu", "h100,H100,b999", "-tp", "1", "--requests", "2", "--jobs", "1"]
    assert main(["simulate", "sweep", *flags]) == 2
    err = capsys.readouterr().err.splitlines()
    assert [line.split(":")[0] for line in err] == [
        "kvpool simulate sweep",
        "kvpool simulate sweep",
        "kvpool simulate",
    ], err
    assert err[0].startswith("kvpool simulate sweep: left out llama-3.1-70b on H100 at TP 1: llama-3.1-70b leaves ")
    assert err[1] == (
        "kvpool simulate sweep: left out llama-3.1-70b on b999 at TP 1: "
        "--gpu: unknown GPU 'b999'; known: B200, H100, H200"
    )


def test_one_run_takes_one_model_gpu_and_tp(capsys):
    assert main(["simulate", "--model", "llama-3.1-8b,qwen3-8b", "--requests", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["kvpool simulate: error: --model: a list (llama-3.1-8b, qwen3-8b) is a grid: kvpool simulate sweep"]


def test_a_pd_sweep_leaves_out_the_layouts_pd_cannot_move(tmp_path, capsys):
    out = tmp_path / "pd.jsonl"
    flags = ["--layout", "paged,contiguous", "--prefill-replicas", "1", "--workload", "uniform", "--requests", "2"]
    flags += ["--rate", "4", "--prompt-len", "100:200", "--output-len", "4:8", "--jobs", "1", "--out", str(out)]
    assert main(["simulate", "sweep", *flags]) == 0
    err = capsys.readouterr().err.splitlines()
    assert err[0] == (
        "kvpool simulate sweep: left out llama-3.1-8b on H200: P/D moves the blocks of a paged cache "
        "(--layout paged); llama-3.1-8b runs layout contiguous"
    )
    assert [(r["point"], r["layout"], r["prefill_replicas"]) for r in _rows(out)] == [(0, "paged", 1)]


def test_the_cheapest_deployment_says_it_counts_gpus_of_different_kinds():
    h100, h200 = _row(1, 1, 4.0, 1.0, 4.0) | {"gpu": "H100"}, _row(1, 1, 5.0, 1.0, 4.0)
    best = cheapest_deployment([h100, h200], 0.9)
    assert best is not None and best.row is h200 and best.gpu_kinds == ("H100", "H200")
    assert describe(best, 0.9).endswith("0.2 GPUs per req/s (GPU counts compared across H100, H200, not their prices)")
    alone = cheapest_deployment([h200], 0.9)
    assert alone is not None and describe(alone, 0.9).endswith("0.2 GPUs per req/s")


def test_plots_say_which_runs_they_leave_off(tmp_path, capsys):
    """A goodput-vs-rate plot has no x for rate inf or a trace's own times: the sweep names
    the runs it leaves off (silently, they were simply missing)."""
    flags = ["--workload", "uniform", "--requests", "4", "--prompt-len", "100:200", "--output-len", "4:8"]
    out, plot = tmp_path / "grid.jsonl", tmp_path / "plots"
    argv = ["simulate", "sweep", *flags, "--rate", "2,inf", "--jobs", "1", "--out", str(out), "--plot", str(plot)]
    assert main(argv) == 0
    err = capsys.readouterr().err.splitlines()
    assert err[3] == (
        "kvpool simulate sweep: the goodput-vs-rate plots leave off 1 of 2 runs, which have no arrival rate to "
        "plot: point 1 (llama-3.1-8b on H200 at TP 1, layout paged block 16, rate inf)"
    )
    assert sorted(os.listdir(plot)) == ["goodput_per_gpu_vs_rate.png", "goodput_vs_rate.png"]
    assert (
        main(["simulate", "sweep", *flags, "--rate", "2", "--jobs", "1", "--out", str(out), "--plot", str(plot)]) == 0
    )
    assert "leave off" not in capsys.readouterr().err  # every run has a rate: nothing to say


def test_a_sweep_with_no_rate_to_plot_writes_no_plot_and_says_so_once(tmp_path, capsys):
    """Every run rate inf (or a trace): no goodput-vs-rate plot has a point. Two empty PNGs
    were written, matplotlib warned "No artists with labels found to put in legend" and the
    line said "leave off 1 of 1 runs"; now no plot, one line."""
    flags = ["--workload", "uniform", "--requests", "4", "--prompt-len", "100:200", "--output-len", "4:8"]
    plot = tmp_path / "plots"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # matplotlib's legend warning fails the test
        argv = ["simulate", "sweep", *flags, "--rate", "inf", "--jobs", "1", "--out", str(tmp_path / "g.jsonl")]
        assert main([*argv, "--plot", str(plot)]) == 0
    err = capsys.readouterr().err.splitlines()
    assert err[1] == (
        "kvpool simulate sweep: --plot wrote no plot: no run has an arrival rate to plot goodput against "
        "(every one is rate inf); give --rate a list of finite rates to plot"
    )
    assert not any("leave off" in line or line.startswith("kvpool simulate sweep: wrote") for line in err)
    assert not plot.exists() or not os.listdir(plot)


def test_a_points_words_name_its_routing_and_a_traces_arrivals():
    """Two failed points differing only in routing read the same apart from their index, and
    a trace's run read "rate trace" (review 4 finding 6)."""
    from kvpool.cli.sweep import _point_words

    point = {"model": "llama-3.1-8b", "gpu": "h200", "tp": None, "layout": None, "block_size": None}
    assert _point_words(point | {"routing": "round-robin", "request_rate": 2.0}) == "llama-3.1-8b on h200, rate 2.0"
    assert _point_words(point | {"routing": "prefix-aware", "request_rate": 2.0}) == (
        "llama-3.1-8b on h200, routing prefix-aware, rate 2.0"
    )
    assert _point_words(point | {"routing": "round-robin", "request_rate": "trace"}) == (
        "llama-3.1-8b on h200, the trace's arrivals"
    )


@pytest.mark.parametrize(
    ("model", "gpu", "layout", "changes"),
    [
        ("Llama-3.1-8B", "h100", None, {}),  # any case typed; the fewest GPUs, the layout's block
        ("llama-3.1-8b", "h200", "contiguous", {}),  # a block: the longest request
        ("llama-3.1-8b", "h200", "contiguous", {"max_model_len": 300}),  # ... or --max-model-len
        ("gpt-oss-120b", "H200", None, {}),  # hybrid
        ("deepseek-v4-flash", "h200", None, {}),  # dual, TP 2
        ("llama-3.1-8b", "h200", None, {"prefill_replicas": 1, "replicas": 2}),  # P/D
    ],
)
def test_a_points_resolved_axes_are_those_its_finished_run_reports(model, gpu, layout, changes):
    # what a failed point's row holds (sweep.error_row) is what the row of its run would hold
    from kvpool.sim.deployment import SimOptions, grid, simulate_deployment
    from kvpool.sim.sweep import resolved_axes

    options = SimOptions(workload="uniform", requests=2, prompt_len=(100, 200), output_len=(4, 8), **changes)
    (point,) = grid((model,), (gpu,), (None,), (layout,), (None,), ("round-robin",), (4.0,))
    report = simulate_deployment(options, point)
    assert resolved_axes(options, point) == ({k: report[k] for k in AXES}, [])


def test_a_failed_row_keeps_the_axes_it_cannot_resolve_as_typed_and_names_them():
    from kvpool.sim.deployment import SimOptions, grid
    from kvpool.sim.sweep import error_row

    options = SimOptions(workload="uniform", requests=2)
    (point,) = grid(("Llama-3.1-8B",), ("h999",), (None,), (None,), (32,), ("least-loaded",), (float("inf"),))
    assert error_row(options, 3, point, {"error": "boom"}) == {
        "point": 3,
        "model": "llama-3.1-8b",  # resolved
        "gpu": "h999",  # no such preset: as typed, and so the deployment's axes
        "tp": None,
        "layout": None,
        "block_size": 32,
        "routing": "least-loaded",
        "request_rate": "inf",
        "as_given": ["gpu", "tp", "layout", "block_size"],
        "error": "boom",
    }


def _dies_at_a_mark(payload: dict) -> dict:
    """A point whose worker process dies outright where the payload says (the out-of-memory
    killer's SIGKILL, a plain SIGTERM, or an exit with no result); the others come back as they
    went. "started" names a file the point creates as it starts, "sleep" how long it runs then;
    "after" names a file to wait for (up to 20 s) before dying."""
    if "started" in payload:
        open(payload["started"], "w").close()
    time.sleep(payload.get("sleep", 0))
    deadline = time.monotonic() + 20
    while "after" in payload and not os.path.exists(payload["after"]) and time.monotonic() < deadline:
        time.sleep(0.02)
    if "sigterm" in payload:
        os.kill(os.getpid(), signal.SIGTERM)
    if "sigkill" in payload:
        os.kill(os.getpid(), signal.SIGKILL)
    if "exit" in payload:
        os._exit(payload["exit"])
    return payload


@contextlib.contextmanager
def _fails_after(seconds: int):
    """TimeoutError in the block after `seconds`: multiprocessing.Pool waited for ever on a
    point whose worker died, and a test of it would hang instead of failing."""

    def time_out(signum, frame):
        raise TimeoutError(f"still waiting after {seconds} s for a point whose worker died")

    before = signal.signal(signal.SIGALRM, time_out)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, before)


def test_a_worker_killed_outright_fails_its_point_and_the_others_run():
    payloads = [{"a": 1}, {"sigkill": True}, {"c": 3}, {"d": 4}, {"exit": 3}, {"f": 6}]
    with _fails_after(120):
        results = dict(map_processes(_dies_at_a_mark, payloads, jobs=2))
    assert sorted(results) == [0, 1, 2, 3, 4, 5]  # each point once
    assert [results[i] for i in (0, 2, 3, 5)] == [payloads[i] for i in (0, 2, 3, 5)]
    assert results[1] == {
        "error": "its worker process died as it ran this point (killed by SIGKILL: the out-of-memory killer's "
        "signal, or kill -9)"
    }
    assert results[4] == {"error": "its worker process died as it ran this point (exit status 3)"}


@pytest.mark.parametrize("death", [{"sigterm": True}, {"exit": 0}], ids=["sigterm", "exit-0"])
def test_a_worker_dying_as_the_pool_stops_its_workers_fails_only_its_point(tmp_path, death):
    # a worker ended by a plain SIGTERM (the code the broken pool gives the workers it
    # terminates: kill PID, earlyoom's first signal) or exiting 0 cannot be told from its
    # neighbours: the points running then each run again alone, and only the one whose
    # worker dies again is an error row; the neighbour running beside it comes back
    started = str(tmp_path / "neighbour-started")
    payloads = [{"a": 1, "started": started, "sleep": 1.5}, {"after": started, **death}, {"c": 3}, {"d": 4}]
    with _fails_after(120):
        results = dict(map_processes(_dies_at_a_mark, payloads, jobs=2))
    assert sorted(results) == [0, 1, 2, 3]  # each point once
    assert [results[i] for i in (0, 2, 3)] == [payloads[i] for i in (0, 2, 3)]
    how = "killed by SIGTERM" if "sigterm" in death else "exit status 0"
    assert results[1] == {"error": f"its worker process died as it ran this point ({how})"}


def _meets_the_others(payload: dict) -> dict:
    """A point that marks each run it starts ("NAME.RUN" in payload["dir"]) and waits, up to
    15 s, for the points named in "meet" to have started the same run: whether they did says
    if those runs were side by side. On its first run it then runs on for a minute (until its
    pool stops it), unless "sigterm": then its worker dies of a plain SIGTERM, on every run."""
    d, name = payload["dir"], payload["name"]
    with open(os.path.join(d, f"{name}.runs"), "a") as f:
        f.write("run\n")
    with open(os.path.join(d, f"{name}.runs")) as f:
        run = len(f.read().splitlines())
    open(os.path.join(d, f"{name}.{run}"), "w").close()
    others = [os.path.join(d, f"{other}.{run}") for other in payload["meet"]]
    deadline = time.monotonic() + 15
    while not all(map(os.path.exists, others)) and time.monotonic() < deadline:
        time.sleep(0.02)
    if payload.get("sigterm"):
        os.kill(os.getpid(), signal.SIGTERM)
    if run == 1 and payload["meet"]:
        time.sleep(60)
    return {"name": name, "run": run, "met": all(map(os.path.exists, others))}


def test_the_points_rerun_alone_run_side_by_side(tmp_path):
    """Points running when a worker that cannot be told apart died each run again in a pool
    of their own. Those pools ran one after another, the rest of the sweep waiting (review 8:
    4 workers, 5.5 s instead of ~2.5 s); now side by side, `jobs` processes in all. a, b and c
    meet on their first run, and c's worker dies of a SIGTERM: the three run again, and meet
    again (one after another, none would find the others started)."""
    d = str(tmp_path)
    payloads = [
        {"dir": d, "name": "a", "meet": ["b", "c"]},
        {"dir": d, "name": "b", "meet": ["a", "c"]},
        {"dir": d, "name": "c", "meet": ["a", "b"], "sigterm": True},
        {"dir": d, "name": "d", "meet": []},
        {"dir": d, "name": "e", "meet": []},
    ]
    with _fails_after(120):
        results = dict(map_processes(_meets_the_others, payloads, jobs=3))
    assert results == {
        0: {"name": "a", "run": 2, "met": True},
        1: {"name": "b", "run": 2, "met": True},
        2: {"error": "its worker process died as it ran this point (killed by SIGTERM)"},
        3: {"name": "d", "run": 1, "met": True},
        4: {"name": "e", "run": 1, "met": True},
    }


def _point_kills_its_worker_at_rate_8(payload):
    from kvpool.sim.sweep import point_or_error

    if payload[1]["rate"] == 8.0:
        os.kill(os.getpid(), signal.SIGKILL)
    return point_or_error(payload)


def test_a_sweep_whose_worker_is_killed_keeps_its_rows_and_ends_in_one_line(tmp_path, capsys, monkeypatch):
    from kvpool.cli import sweep as sweep_cli

    monkeypatch.setattr(sweep_cli, "point_or_error", _point_kills_its_worker_at_rate_8)
    out = tmp_path / "grid.jsonl"
    with _fails_after(300):
        assert main(["simulate", "sweep", *GRID, "--jobs", "2", "--out", str(out)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert "Traceback" not in "\n".join(err)
    rows = _rows(out)
    assert [(r["point"], r["layout"], r["request_rate"], "error" in r) for r in rows] == [
        (0, "paged", 2.0, False),
        (1, "paged", 8.0, True),
        (2, "contiguous", 2.0, False),
        (3, "contiguous", 8.0, True),
    ]
    assert rows[1]["error"].startswith("its worker process died as it ran this point (killed by SIGKILL: ")
    failed = sorted(line for line in err if " failed: " in line)  # (in the order they failed)
    assert failed == [
        f"kvpool simulate sweep: point {r['point']} ({_point_words(r)}) failed: {r['error']}" for r in rows[1::2]
    ]
    assert err[-1] == f"kvpool simulate sweep: 2 of 4 points failed (their rows in {out} hold the error)"


def test_a_ray_task_whose_worker_is_killed_fails_its_point_and_the_others_run(monkeypatch):
    pytest.importorskip("ray")
    # Ray's workers import _dies_at_a_mark by its module's name, from their PYTHONPATH
    here = os.path.dirname(os.path.abspath(__file__))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, (here, os.environ.get("PYTHONPATH")))))
    payloads = [{"a": 1}, {"sigkill": True}, {"c": 3}]
    with _fails_after(300):
        results = dict(map_ray(_dies_at_a_mark, payloads, jobs=2, address=None))
    assert [results[0], results[2]] == [{"a": 1}, {"c": 3}]
    assert results[1]["error"].startswith("its Ray worker died as it ran this point (WorkerCrashedError: ")


def test_a_round_with_a_point_rerun_alone_hands_its_workers_back_once_that_point_is_through(tmp_path):
    """Review 9: after a lone early death of an unknown kind, the point reran alone beside a
    pool of the other `jobs - 1` workers, and that pool went on through all the rest of the
    sweep (79 of 80 points on 3 of 4 workers). Now the round's shared pool takes points only
    while the isolated one runs: the points it never took come back as not through, for the
    next round's full pool. Here the isolated point dies at once (its error row), and of 16
    shared points of 0.5 s (8 s on the one shared worker) the round runs a few."""
    from kvpool.sim.sweep import _pool_round

    payloads = [{"sigterm": True}] + [{"i": i, "sleep": 0.5} for i in range(1, 17)]
    shared = list(range(1, 17))
    rows, rounds = {}, _pool_round(_dies_at_a_mark, payloads, shared, [0], 1, str(tmp_path))
    with _fails_after(120):
        try:
            while True:
                index, row = next(rounds)
                rows[index] = row
        except StopIteration as stop:
            over, suspects = stop.value
    assert rows[0] == {"error": "its worker process died as it ran this point (killed by SIGTERM)"}
    ran = sorted(set(rows) - {0})
    assert 1 <= len(ran) <= 8 and ran == shared[: len(ran)]  # in order, one at a time, then it stopped
    assert [rows[i] for i in ran] == [payloads[i] for i in ran]
    assert over == {0, *ran} and suspects == []
