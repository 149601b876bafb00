"""The performance report as a person reads it (workload/metrics.py: units, headings, the SLO
verdict, warnings), on hand-made reports whose every figure is known; `--json` keeps the raw keys."""

import json
import os

import pytest

from kvpool.cli.main import main
from kvpool.workload import metrics
from kvpool.workload.metrics import (
    cpu_load,
    format_bytes,
    format_ms,
    format_share,
    report_notes,
    report_sections,
    slo_verdict,
)


def _report(**changes) -> dict:
    report = {
        "model": "m",
        "kv_capacity_tokens": 173055,
        "kv_capacity_bytes": 3 * 2**30 + 2**28,  # 3.25 GiB
        "block_size": 16,
        "num_blocks": 7,
        "fragmentation": 0.1534,
        "prefix_hit_rate": 0.5,
        "alloc_latency_us_p50": 12.0,
        "alloc_latency_us_p99": 250.0,
        "ttft_ms_p50": 400.0,
        "ttft_ms_p99": 900.0,
        "tpot_ms_p50": 8.25,
        "tpot_ms_p99": 150.0,
        "throughput_tok_s": 1234.56,
        "goodput_req_s": 2.5,
        "slo_ttft_ms": 1000.0,
        "slo_tpot_ms": 200.0,
        "num_requests": 10,
        "num_finished": 10,
        "wall_s": 12.5,
        "interrupted": False,
        "memory": None,
        "_series": {"ttft_ms": [1.0]},
    }
    return report | changes


def test_units_by_hand():
    assert [format_bytes(n) for n in (512, 2048 + 512, 20 * 2**20 + 2**19, 3 * 2**30 + 2**28)] == [
        "512 B",
        "2.5 KiB",
        "20.5 MiB",
        "3.25 GiB",
    ]
    assert [format_ms(ms) for ms in (0.42, 12.34, 999.0, 1250.0)] == ["0.42 ms", "12.3 ms", "999.0 ms", "1.25 s"]
    assert format_share(0.1534) == "15.3 %"


def test_sections_group_the_figures_with_units_and_keep_the_rest_raw():
    sections = dict(report_sections(_report(tier="host"), skip=("memory",)))
    assert list(sections) == ["capacity", "latency", "throughput", "cache", "other"]
    capacity = dict(sections["capacity"])
    assert capacity["KV capacity"] == "3.25 GiB" and capacity["KV capacity (tokens)"] == "173,055"
    assert capacity["fragmentation (held block slots holding no token)"] == "15.3 %"
    latency = dict(sections["latency"])
    assert (latency["TTFT p99"], latency["TPOT p50"], latency["block allocation p99"]) == (
        "900.0 ms",
        "8.25 ms",
        "0.25 ms",
    )
    throughput = dict(sections["throughput"])
    assert (throughput["throughput"], throughput["goodput (requests within both SLOs)"]) == (
        "1,234.6 tok/s",
        "2.50 req/s",
    )
    assert throughput["wall time"] == "12.50 s" and dict(sections["cache"])["prefix hit rate"] == "50.0 %"
    # what no heading claims stays as it is; memory (a table of its own) and "_series" are not shown
    assert sections["other"] == [("model", "m"), ("interrupted", "False"), ("tier", "host")]


@pytest.mark.parametrize(
    ("changes", "verdict"),
    [
        ({}, "SLO met: TTFT p99 900.0 ms <= 1.00 s, TPOT p99 150.0 ms <= 200.0 ms"),
        ({"tpot_ms_p99": 250.0}, "SLO missed: TPOT p99 250.0 ms > 200.0 ms"),
        (
            {"ttft_ms_p99": 1500.0, "tpot_ms_p99": 250.0},
            "SLO missed: TTFT p99 1.50 s > 1.00 s, TPOT p99 250.0 ms > 200.0 ms",
        ),
        (
            {"ttft_ms_p99": 1000.0},
            "SLO met: TTFT p99 1.00 s <= 1.00 s, TPOT p99 150.0 ms <= 200.0 ms",
        ),  # the bound holds
        ({"num_finished": 0}, "SLO: no request finished, nothing to judge"),
        # every answer one token: no TPOT, which the verdict neither claims met nor missed
        (
            {"tpot_ms_p50": None, "tpot_ms_p99": None},
            "SLO met: TTFT p99 900.0 ms <= 1.00 s; TPOT n/a: no answer had a second token",
        ),
        (
            {"tpot_ms_p50": None, "tpot_ms_p99": None, "ttft_ms_p99": 1500.0, "num_within_slo": 0},
            "SLO missed: TTFT p99 1.50 s > 1.00 s; TPOT n/a: no answer had a second token "
            "(0 of 10 finished requests within both)",
        ),
        (
            {"ttft_ms_p99": 1500.0, "num_within_slo": 9},
            "SLO missed: TTFT p99 1.50 s > 1.00 s (9 of 10 finished requests within both)",
        ),
        (
            {"slo_attainment": 0.995},
            "SLO met: TTFT p99 900.0 ms <= 1.00 s, TPOT p99 150.0 ms <= 200.0 ms (99.5 % of the requests within both)",
        ),
    ],
)
def test_the_slo_verdict(changes, verdict):
    assert slo_verdict(_report(**changes)) == verdict


def test_a_run_without_tpot_shows_it_as_na():
    latency = dict(dict(report_sections(_report(tpot_ms_p50=None, tpot_ms_p99=None)))["latency"])
    assert (latency["TPOT p50"], latency["TPOT p99"], latency["SLO: TPOT at most"]) == ("n/a", "n/a", "200.0 ms")
    assert format_ms(None) == "n/a"


def test_simulate_of_one_token_answers_reports_no_tpot(capsys):
    argv = ["simulate", "--workload", "uniform", "--requests", "4", "--prompt-len", "100:200", "--output-len", "1:1"]
    assert main([*argv, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert (report["tpot_ms_p50"], report["tpot_ms_p99"], report["num_generated_tokens"]) == (None, None, 4)
    assert report["slo_attainment"] == 1.0  # no TPOT to miss
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "SLO met: TTFT p99" in out and "; TPOT n/a: no answer had a second token" in out
    assert "TPOT p99 0.00 ms" not in out


def test_warnings_for_an_oversubscribed_cpu_and_a_run_cut_short(monkeypatch):
    monkeypatch.setattr(os, "getloadavg", lambda: (5.0, 4.0, 3.0))
    assert cpu_load() == 5.0
    assert report_notes(_report(), [1.5, 2.0], num_cpus=2) == [slo_verdict(_report())]  # at the bound: not over
    notes = report_notes(_report(), [1.0, cpu_load()], num_cpus=4)
    assert notes[1:] == [
        "warning: the CPU was oversubscribed (load average 1.0, 5.0 on 4 CPUs): the timings include waiting for a CPU"
    ]
    monkeypatch.setattr(os, "cpu_count", lambda: 8)  # the machine's own count when none is given
    assert len(report_notes(_report(), [cpu_load()])) == 1
    cut = report_notes(_report(interrupted=True, num_finished=3), [None, None])
    assert cut[1:] == ["warning: the run was cut short; the figures cover the 3 of 10 requests that finished"]

    def no_loadavg():
        raise OSError("no load average here")

    monkeypatch.setattr(metrics.os, "getloadavg", no_loadavg)
    assert cpu_load() is None


def test_kvpool_runs_text_report_and_its_json(monkeypatch, capsys):
    from kvpool.cli.run import print_report

    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    report = _report(tpot_ms_p99=250.0)
    raw = json.dumps(report)
    print_report(report, [3.5, 1.0])
    out = capsys.readouterr().out
    assert json.dumps(report) == raw  # printing leaves the report (what --json prints) as it was
    for line in ("capacity", "3.25 GiB", "1,234.6 tok/s", "SLO missed: TPOT p99 250.0 ms > 200.0 ms"):
        assert line in out
    assert "warning: the CPU was oversubscribed (load average 3.5, 1.0 on 2 CPUs)" in out
    print_report(report, [1.0, 1.0])
    assert "oversubscribed" not in capsys.readouterr().out


def test_simulates_text_report_shares_the_headings_units_and_verdict(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    argv = ["simulate", "--model", "llama-3.1-8b", "--requests", "8", "--slo-tpot-ms", "2"]
    assert main(argv + ["--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert main(argv) == 0
    out = capsys.readouterr().out
    verdict = f"SLO missed: TPOT p99 {format_ms(report['tpot_ms_p99'])} > 2.00 ms"
    assert report["tpot_ms_p99"] > 2 and verdict in out  # the virtual decode step is over 2 ms
    for heading in ("capacity", "latency", "throughput", "cache"):
        assert f" {heading} " in out
    assert format_bytes(report["kv_capacity_bytes"]) in out and "sim_wall_s" in out


def test_a_run_where_no_request_finished_has_no_latency_figure_in_any_report(capsys):
    # no sample, no figure: kvpool run's, the simulator's and the load generator's reports say
    # None ("n/a"), not 0 ms, for a TTFT and a latency no request measured
    from kvpool.cli.bench_serve import _print
    from kvpool.server import loadgen
    from kvpool.sim.report import FinishedRequests

    none = {f"{name}_ms_{p}": None for name in ("ttft", "tpot", "latency") for p in ("p50", "p99")}
    assert metrics.latency_report([], 1) == none  # kvpool run's
    assert FinishedRequests(2000.0, 100.0).latency_report(2) == none  # the simulator's
    failed = [loadgen.RequestRecord(ok=False, error="connection refused") for _ in range(3)]
    row = loadgen.summarize(loadgen.LoadConfig("u", "m", 3, concurrency=1), failed, 1.5, {}, {})
    latencies = ("ttft_ms_p50", "ttft_ms_p99", "tpot_ms_p50", "tpot_ms_p99", "itl_ms_p50", "itl_ms_p99", "e2e_ms_p50")
    assert [row[key] for key in latencies] == [None] * 7 and row["num_ok"] == 0
    _print({"model": "m", "url": "u", "rows": [row]})
    table = capsys.readouterr().out
    assert "0/3" in table and table.count("n/a") == 6  # TTFT, TPOT, ITL at p50 / p99

    report = _report(num_finished=0, num_within_slo=0, **none)
    latency = dict(dict(report_sections(report))["latency"])
    assert [latency[f"{name} {p}"] for name in ("TTFT", "TPOT", "request latency") for p in ("p50", "p99")] == [
        "n/a"
    ] * 6
    assert report_notes(report, [None]) == ["SLO: no request finished, nothing to judge"]
