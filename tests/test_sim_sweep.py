"""`kvpool simulate sweep`'s executors and its summary: Ray in local mode gives the process
pool's JSONL rows (all but the wall-clock keys), the cheapest deployment meeting the SLO is
picked by GPUs per goodput on hand-made rows, and bad flags are one line."""

from __future__ import annotations

import json

import pytest

from kvpool.cli.main import main
from kvpool.cli.sweep import cheapest_deployment, describe

# measured on this machine's clock, not the simulated one: they differ from run to run
WALL_CLOCK_KEYS = ("sim_wall_s", "alloc_latency_us_p50", "alloc_latency_us_p99", "sim_us_per_step_by_quarter")
GRID = ["--model", "llama-3.1-8b", "--requests", "12", "--layout", "paged,contiguous", "--rate", "2,8"]


def _rows(path) -> list[dict]:
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    return [{k: v for k, v in r.items() if k not in WALL_CLOCK_KEYS} for r in rows]


def test_ray_local_mode_writes_the_process_pools_rows(tmp_path, capsys):
    pytest.importorskip("ray")
    pool_out, ray_out = tmp_path / "pool.jsonl", tmp_path / "ray.jsonl"
    assert main(["simulate", "sweep", *GRID, "--out", str(pool_out), "--jobs", "1"]) == 0
    pool_err = capsys.readouterr().err
    assert main(["simulate", "sweep", *GRID, "--out", str(ray_out), "--jobs", "2", "--executor", "ray"]) == 0
    ray_err = capsys.readouterr().err
    pool_rows, ray_rows = _rows(pool_out), _rows(ray_out)
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
    assert "2 x tp 2 H200 (4 GPUs)" in describe(best, 0.9) and "0.333 GPUs per req/s" in describe(best, 0.9)
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
