"""Issue 28, section 4: what a new user meets on a fresh clone. The commands' defaults work
together; a KV pool larger than the machine's memory, a non-finite temperature and a wrong
hint in --help are caught in one line; SIGTERM stops `kvpool run` as Ctrl-C does, with the
report of what finished."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from kvpool.cli.main import main


def _one_error_line(capsys) -> str:
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in captured.err, captured.err
    return lines[0]


@pytest.fixture(scope="module")
def smollm2(smollm2_for_commands):
    return smollm2_for_commands


@pytest.fixture
def no_loading(monkeypatch):
    """Any model load fails the test: the check must come before it."""
    from kvpool.engine import build

    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before the flags were checked")

    monkeypatch.setattr(build, "load_model", refuse)


def test_simulate_with_no_arguments_runs(capsys):
    # the default chat workload (4 turns) and the default model and GPU fit together
    # (the 1,000 requests of 250 sessions: their longest needs 8,986 tokens)
    assert main(["simulate", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["num_finished"] == report["num_requests"] == 1000


def test_simulate_help_names_the_presets_not_a_missing_flag(capsys):
    from kvpool.spec.models import PRESET_NAMES

    with pytest.raises(SystemExit):
        main(["simulate", "--help"])
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps the help text
    assert "--list-models" not in out
    assert all(name in out for name in PRESET_NAMES), out


@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
def test_generate_refuses_a_non_finite_temperature_in_one_line(capsys, no_loading, value):
    assert main(["generate", "hi", f"--temperature={value}"]) == 2
    line = _one_error_line(capsys)
    assert line.startswith("kvpool generate: error:") and "temperature" in line and value.lstrip("-") in line


@pytest.mark.parametrize(
    ("argv", "fixed"),
    [
        (["generate", "-1,3", "--model", "tiny-dsv4"], "kvpool generate --model tiny-dsv4 -- -1,3"),
        (["generate", "--no-chat", "-5x", "--max-tokens", "2"], "kvpool generate --no-chat --max-tokens 2 -- -5x"),
    ],
)
def test_a_prompt_that_begins_with_a_dash_is_told_to_follow_dashes(capsys, no_loading, argv, fixed):
    """A prompt such as "-1,3" (tiny-dsv4's token ids) was read as an unknown option, and the
    error said only "the following arguments are required: prompt"; it now says what
    happened and the command that works ("--" before the value)."""
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    stray = argv[1] if argv[1] != "--no-chat" else argv[2]
    assert _one_error_line(capsys) == (
        "kvpool generate: error: the following arguments are required: prompt "
        f"({stray} was read as an option: give a value that begins with '-' after '--', as in {fixed})"
    )
    with pytest.raises(SystemExit):
        main(["generate", "--no-chat"])  # no such word: the plain line
    assert _one_error_line(capsys) == "kvpool generate: error: the following arguments are required: prompt"


def test_a_prompt_that_begins_with_a_short_options_letter_is_told_to_follow_dashes(capsys, no_loading):
    """`kvpool generate "-hello there"` is -h with "ello there" glued on, to argparse: the line
    was "argument -h: ignored explicit argument 'ello there'", naming neither the prompt nor
    the way to give it. A command with no value to give (run) keeps argparse's line."""
    for argv, fixed in (
        (["generate", "-hello there", "--max-tokens", "3"], "kvpool generate --max-tokens 3 -- '-hello there'"),
        (["generate", "--no-chat", "-hv"], "kvpool generate --no-chat -- -hv"),
    ):
        with pytest.raises(SystemExit) as exit_info:
            main(argv)
        assert exit_info.value.code == 2
        word = argv[1] if argv[1] != "--no-chat" else argv[2]
        assert _one_error_line(capsys) == (
            f"kvpool generate: error: {word!r} was read as the option -h: give a value that begins with '-' "
            f"after '--', as in {fixed}"
        )
    with pytest.raises(SystemExit):
        main(["run", "-h5"])
    assert _one_error_line(capsys) == "kvpool run: error: argument -h: ignored explicit argument '5'"


def _available_bytes() -> int:
    from kvpool.engine.memory import available_memory_bytes

    return available_memory_bytes("cpu")


def test_run_refuses_kv_memory_beyond_the_machine_before_loading(capsys, no_loading):
    assert main(["run", "--kv-memory", "2048GiB"]) == 2
    line = _one_error_line(capsys)
    assert "--kv-memory 2048GiB" in line and "GiB of memory available" in line, line
    assert main(["run", "--model", "tiny-dsv4", "--kv-memory", "2048GiB"]) == 2
    assert "--kv-memory 2048GiB" in _one_error_line(capsys)


def test_a_pool_beyond_the_machine_is_one_line_in_serve_and_generate(capsys, smollm2):
    # serve (the size checked where the pool is built, after the model loads) and generate's
    # --num-blocks: 2**26 blocks of 737,280 bytes are 45 TiB
    assert main(["serve", "--kv-memory", "2048GiB", "--host", "127.0.0.1", "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert err.splitlines()[0] == "kvpool serve: loading smollm2-135m" and "Traceback" not in err, err
    line = err.splitlines()[1]
    assert len(err.splitlines()) == 2 and line.startswith("kvpool serve: error: "), err
    assert "the KV pool" in line and "2048.0 GiB" in line and "memory available" in line, line
    assert main(["generate", "hi", "--num-blocks", str(2**26), "--max-tokens", "2"]) == 2
    line = _one_error_line(capsys)
    assert "67108864 blocks" in line and "memory available" in line, line


def test_a_tiny_models_pool_beyond_the_machine_is_one_line(capsys, monkeypatch):
    """The tiny models' pools were not checked: `kvpool run --model tiny-dsv4 --num-blocks
    99999999999` (or --max-num-seqs, which sizes the state blocks and slots) ended in a
    MemoryError traceback. Now every model's pool is checked as the Llama one is, to the
    byte: the classical and state blocks (V4), the attention blocks and state slots (hybrid)."""
    import torch

    from kvpool.engine import memory
    from kvpool.engine.build import build_engine
    from kvpool.engine.hybrid_runner import attention_for
    from kvpool.models.tiny_dsv4 import TinyDSV4
    from kvpool.models.tiny_hybrid import TINY_RECURRENT, TinyHybrid
    from kvpool.storage.dsv4 import DSV4Pools

    for argv, shown in (
        (["--model", "tiny-dsv4", "--num-blocks", "99999999999"], "the dual pool of 99999999999 classical and 16 "),
        (["--model", "tiny-dsv4", "--max-num-seqs", "99999999999"], "and 99999999999 state blocks needs"),
        (["--model", "tiny-gemma2", "--num-blocks", "99999999999"], "a KV cache of 99999999999 blocks of 16 tokens "),
        (["--model", "tiny-recurrent", "--max-num-seqs", "99999999999"], "and 399999999996 recurrent state slots"),
    ):
        assert main(["run", *argv, "--num-requests", "1"]) == 2
        err = capsys.readouterr().err
        assert err.splitlines()[0] == "kvpool run: loading the model" and "Traceback" not in err, err
        assert len(err.splitlines()) == 2, err
        line = err.splitlines()[1]
        assert line.startswith("kvpool run: error: ") and shown in line and "memory available" in line, line

    v4 = TinyDSV4(seed=0)
    # what the runner's pools allocate: the classical blocks, the state blocks and the
    # checkpoint slots (8 under the default restore), in the model's dtype (the check
    # counted neither the slots nor the dtype: 16 state blocks of fp32)
    pools = build_engine(v4, num_blocks=40).runner.executor.pools
    assert pools.num_slots == 16 + 8 and isinstance(pools, DSV4Pools)
    need_v4 = 40 * pools.classical_block_bytes() + pools.num_slots * pools.state_block_bytes()
    f64 = TinyDSV4(seed=0, dtype=torch.float64)
    pools = build_engine(f64, num_blocks=40, restore="recompute").runner.executor.pools
    need_f64 = 40 * pools.classical_block_bytes() + pools.num_slots * pools.state_block_bytes()
    assert need_f64 > need_v4
    hybrid = TinyHybrid(TINY_RECURRENT, seed=0)
    probe = attention_for(hybrid, 1, 8, 1)
    need_hybrid = 40 * sum(g.bytes_per_token for g in probe.groups.values()) * 8 + 24 * probe.recurrent.bytes_per_slot
    for model, options, need in (
        (v4, {}, need_v4),
        (f64, {"restore": "recompute"}, need_f64),
        (hybrid, {"block_size": 8, "num_slots": 24}, need_hybrid),
    ):
        monkeypatch.setattr(memory, "available_memory_bytes", lambda device, n=need: n)
        build_engine(model, num_blocks=40, **options)  # exactly what the machine has: built
        monkeypatch.setattr(memory, "available_memory_bytes", lambda device, n=need: n - 1)
        with pytest.raises(ValueError, match="lower --kv-memory, --num-blocks or --max-num-seqs$"):
            build_engine(model, num_blocks=40, **options)


def test_a_pool_that_fits_is_not_refused():
    from kvpool.engine.memory import check_fits

    check_fits(1 << 20, "cpu", "the KV pool")
    with pytest.raises(ValueError, match="the KV pool needs .* GiB of memory available"):
        check_fits(_available_bytes() + (1 << 30), "cpu", "the KV pool")


def test_sigterm_stops_run_like_ctrl_c_with_the_report():
    argv = [sys.executable, "-m", "kvpool", "run", "--model", "tiny-dsv4", "--json", "--threads", "1"]
    argv += ["--num-requests", "200", "--request-rate", "inf"]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        line = ""
        while "serving" not in line and time.monotonic() < deadline:  # the workload has started
            line = proc.stderr.readline()
        assert "serving" in line, line
        time.sleep(1.0)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 128 + signal.SIGTERM, err
    report = json.loads(out)
    assert report["interrupted"] is True and report["num_finished"] < report["num_requests"]
    assert "terminated; the report covers" in err and "Traceback" not in err, err


def test_sigterm_handler_is_restored_after_run(capsys, monkeypatch):
    import torch

    from kvpool.engine.engine import Engine

    def not_handled(signum, frame):  # without run's handler the signal reaches this one
        raise RuntimeError("SIGTERM was not handled by kvpool run")

    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)  # (keep the test process's)
    before = signal.signal(signal.SIGTERM, not_handled)
    step = Engine.step

    def terminated_step(self):
        os.kill(os.getpid(), signal.SIGTERM)
        return step(self)

    monkeypatch.setattr(Engine, "step", terminated_step)
    args = ["run", "--json", "--threads", "1", "--model", "tiny-dsv4", "--num-requests", "2", "--request-rate", "inf"]
    try:
        assert main(args) == 143
        assert json.loads(capsys.readouterr().out)["interrupted"] is True
        assert signal.getsignal(signal.SIGTERM) is not_handled
    finally:
        signal.signal(signal.SIGTERM, before)
