"""torch's CPU threads for the engine commands (`kvpool.cli.options.set_torch_threads`): torch's
count, cut to the CPUs that other processes left free while the model loaded (`CpuProbe`, from
/proc/stat less this process's own CPU time); --threads wins."""

from __future__ import annotations

import argparse
import json
import os
import time

import pytest
import torch

from kvpool.cli import options
from kvpool.cli.options import CpuProbe, free_cpus, set_torch_threads, start_torch_threads


@pytest.mark.parametrize(
    ("cpus", "others_busy", "free"),
    [
        (2, 0.0, 2),  # idle
        (2, 0.4, 2),  # 1.6 free: rounds to 2
        (2, 0.6, 1),  # 1.4 free
        (2, 1.0, 1),  # one busy process beside us
        (2, 6.8, 1),  # never below one
        (8, 3.2, 5),  # 4.8 free
        (8, 0.0, 8),
    ],
)
def test_free_cpus_by_hand(cpus, others_busy, free):
    assert free_cpus(cpus, others_busy) == free


class FakeMachine:
    """/proc/stat's ticks of 2 CPUs (100 a second each), this process's CPU time and the
    clock, moved by `run`."""

    def __init__(self, monkeypatch):
        self.now, self.all, self.idle, self.own = 1000.0, 0, 0, 0.0
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
        monkeypatch.setattr(options, "_cpu_ticks", lambda cpus: (self.all, self.idle))
        monkeypatch.setattr(options, "_own_cpu_s", lambda: self.own)
        monkeypatch.setattr(time, "monotonic", lambda: self.now)
        monkeypatch.setattr(time, "sleep", self.run)  # (a wait passes idle on both CPUs: `others` busy)
        self.others = 0.0  # CPUs' worth of other processes' work

    def run(self, seconds: float, own_busy: float = 0.0) -> None:
        ticks = round(200 * seconds)
        busy = round(100 * seconds * min(2.0, self.others + own_busy))
        self.now += seconds
        self.all += ticks
        self.idle += ticks - busy
        self.own += own_busy * seconds


@pytest.fixture
def threads_kept():
    threads = torch.get_num_threads()
    yield threads
    torch.set_num_threads(threads)


def test_the_probe_subtracts_this_processs_own_work(monkeypatch):
    machine = FakeMachine(monkeypatch)
    probe = CpuProbe()
    machine.run(0.5, own_busy=1.0)  # the model loads on one CPU, nothing else runs
    assert probe.others_busy() == pytest.approx(0.0)
    machine.others = 1.0
    probe = CpuProbe()
    machine.run(0.5, own_busy=1.0)
    assert probe.others_busy() == pytest.approx(1.0)


def test_a_short_load_is_waited_out(monkeypatch):
    machine = FakeMachine(monkeypatch)
    machine.others = 1.0
    probe = CpuProbe()
    machine.run(0.05, own_busy=1.0)
    assert probe.others_busy() == pytest.approx(1.0, abs=0.05)
    assert machine.now == pytest.approx(1000.0 + CpuProbe.MIN_INTERVAL_S)


def test_a_busy_machine_cuts_torchs_threads(monkeypatch, capsys, threads_kept):
    torch.set_num_threads(2)
    machine = FakeMachine(monkeypatch)
    machine.others = 1.0
    probe = CpuProbe()
    machine.run(0.5, own_busy=1.0)
    assert set_torch_threads(argparse.Namespace(threads=None), probe) == 1
    assert torch.get_num_threads() == 1
    assert capsys.readouterr().err == ""  # (nothing said: `kvpool run`'s report holds the count)


def test_an_idle_machine_keeps_torchs_count(monkeypatch, threads_kept):
    torch.set_num_threads(2)
    machine = FakeMachine(monkeypatch)
    probe = CpuProbe()
    machine.run(0.5, own_busy=1.0)
    assert set_torch_threads(argparse.Namespace(threads=None), probe) == 2
    assert torch.get_num_threads() == 2


def test_threads_flag_wins_whatever_the_load_and_is_set_before_the_load(monkeypatch, threads_kept):
    torch.set_num_threads(1)
    machine = FakeMachine(monkeypatch)
    machine.others = 2.0
    args = argparse.Namespace(threads=2)
    probe = start_torch_threads(args)
    assert probe is None and torch.get_num_threads() == 2  # (the model loads on the threads asked for)
    machine.run(0.5)
    assert set_torch_threads(args, probe) == 2
    assert torch.get_num_threads() == 2


def test_no_proc_stat_keeps_torchs_count(monkeypatch, threads_kept):
    torch.set_num_threads(2)
    monkeypatch.setattr(options, "_cpu_ticks", lambda cpus: None)
    assert set_torch_threads(argparse.Namespace(threads=None), CpuProbe()) == 2
    assert torch.get_num_threads() == 2


def test_proc_stat_is_read_for_the_affinity_cpus():
    cpus = frozenset(os.sched_getaffinity(0))
    first = options._cpu_ticks(cpus)
    assert first is not None and first[0] >= first[1] >= 0
    assert options._cpu_ticks(frozenset({10**6})) is None  # (a CPU the file does not list)


def test_the_run_report_holds_the_count(capsys, threads_kept):
    from kvpool.cli.main import main

    args = ["run", "--json", "--model", "tiny-gemma2", "--num-requests", "1", "--turns", "1", "--num-long", "0"]
    assert main([*args, "--max-tokens", "2", "--threads", "1"]) == 0
    assert json.loads(capsys.readouterr().out)["torch_threads"] == 1
    assert torch.get_num_threads() == 1
