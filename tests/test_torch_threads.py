"""torch's CPU threads for the engine commands (`kvpool.cli.options.set_torch_threads`): torch's
count, cut to the CPUs that the machine's other work leaves free at the start; --threads wins."""

from __future__ import annotations

import argparse
import os

import pytest
import torch

from kvpool.cli.options import free_cpus, set_torch_threads


@pytest.mark.parametrize(
    ("cpus", "machine_cpus", "load", "free"),
    [
        (2, 2, 0.0, 2),  # idle
        (2, 2, 0.4, 2),  # 1.6 free: rounds to 2
        (2, 2, 0.6, 1),  # 1.4 free
        (2, 2, 1.0, 1),  # one busy process beside us
        (2, 2, 6.8, 1),  # never below one
        (16, 64, 40.0, 6),  # a cpuset of 16 of 64 CPUs: its share of the load is 40 x 16 / 64 = 10
        (8, 8, 0.0, 8),
        (8, 8, 3.2, 5),  # 4.8 free
    ],
)
def test_free_cpus_by_hand(cpus, machine_cpus, load, free):
    assert free_cpus(cpus, machine_cpus, load) == free


@pytest.fixture
def threads_kept():
    threads = torch.get_num_threads()
    yield threads
    torch.set_num_threads(threads)


def _machine(monkeypatch, load: float, cpus: int) -> None:
    monkeypatch.setattr(os, "getloadavg", lambda: (load, load, load))
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cpus)))
    monkeypatch.setattr(os, "cpu_count", lambda: cpus)


def test_a_busy_machine_cuts_torchs_threads(monkeypatch, capsys, threads_kept):
    torch.set_num_threads(2)
    _machine(monkeypatch, 1.3, 2)
    assert set_torch_threads(argparse.Namespace(threads=None)) == 1
    assert torch.get_num_threads() == 1
    assert capsys.readouterr().err == ""  # (nothing said: `kvpool run`'s report holds the count)


def test_an_idle_machine_keeps_torchs_count(monkeypatch, capsys, threads_kept):
    torch.set_num_threads(2)
    _machine(monkeypatch, 0.2, 2)
    assert set_torch_threads(argparse.Namespace(threads=None)) == 2
    assert torch.get_num_threads() == 2
    assert capsys.readouterr().err == ""


def test_threads_flag_wins_whatever_the_load(monkeypatch, capsys, threads_kept):
    torch.set_num_threads(1)
    _machine(monkeypatch, 9.0, 2)
    assert set_torch_threads(argparse.Namespace(threads=2)) == 2
    assert torch.get_num_threads() == 2
    assert capsys.readouterr().err == ""


def test_no_load_average_keeps_torchs_count(monkeypatch, threads_kept):
    torch.set_num_threads(2)

    def unavailable():
        raise OSError("no load average")

    monkeypatch.setattr(os, "getloadavg", unavailable)
    assert set_torch_threads(argparse.Namespace(threads=None)) == 2
    assert torch.get_num_threads() == 2


def test_the_run_report_holds_the_count(capsys, threads_kept):
    import json

    from kvpool.cli.main import main

    args = ["run", "--json", "--model", "tiny-gemma2", "--num-requests", "1", "--turns", "1", "--num-long", "0"]
    assert main([*args, "--max-tokens", "2", "--threads", "1"]) == 0
    assert json.loads(capsys.readouterr().out)["torch_threads"] == 1
    assert torch.get_num_threads() == 1
