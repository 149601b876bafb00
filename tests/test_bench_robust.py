"""`kvpool bench` and `kvpool verify` under hostile input: figures printed only where they
were measured, --json that JSON parsers read, flags named in their errors, and the
processes a bench starts stopped when it is interrupted."""

from __future__ import annotations

import asyncio
import gc
import json
import math
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvpool.cli.main import build_parser, main

SRC = Path(__file__).resolve().parents[1] / "src"


def _strict_loads(text: str) -> object:
    """json.loads that refuses NaN / Infinity (Python's accepts them; JSON does not)."""

    def refuse(name: str) -> None:
        raise ValueError(f"not JSON: {name}")

    return json.loads(text, parse_constant=refuse)


def test_kv_quant_table_shows_no_speedup_without_fp32(capsys):
    """`kvpool bench kv-quant --formats int8`: fp32 was not measured, yet the table printed
    "1.00x" in each "vs fp32" column (a default of 1.0): a speed-up nobody measured."""
    small = ["--batch", "1", "--context", "16", "--layers", "1", "--repeats", "1", "--paths", "torch"]
    assert main(["bench", "kv-quant", *small, "--formats", "int8"]) == 0
    out = capsys.readouterr().out
    assert "int8" in out and not re.search(r"\d\.\d\dx", out), out
    # with fp32 measured the speed-up is there, and the JSON holds the same figures
    assert main(["bench", "kv-quant", *small, "--formats", "fp32,int8", "--json"]) == 0
    report = _strict_loads(capsys.readouterr().out)
    int8 = report["formats"][1]
    assert int8["format"] == "int8"
    assert int8["torch_speedup_vs_fp32"] == round(report["formats"][0]["torch_ms"] / int8["torch_ms"], 2)
    assert main(["bench", "kv-quant", *small, "--formats", "int8", "--json"]) == 0
    assert "torch_speedup_vs_fp32" not in _strict_loads(capsys.readouterr().out)["formats"][0]


@pytest.mark.parametrize(
    "argv",
    [
        ["bench", "hisparse", "--seed", str(2**70)],
        ["bench", "kv-quant", "--seed", str(2**70)],
        ["verify", "cp", "--seed", str(2**40)],
        ["bench", "serve", "--seed", str(10**13)],
    ],
)
def test_seed_out_of_range_names_the_flag(argv, capsys):
    """A seed torch cannot take was "error: Overflow when unpacking long long" after the
    run began (bench hisparse, kv-quant; verify cp on every rank), naming no flag; bench
    serve's made request seeds past 64 bits, every request refused by the server it had
    started ("HTTP 400: seed: Input should be less than or equal to 9223372036854775807")."""
    with pytest.raises(SystemExit) as stop:
        build_parser().parse_args(argv)
    assert stop.value.code == 2
    assert "argument --seed" in capsys.readouterr().err


def test_verify_tp_json_is_json_when_tokens_differ(monkeypatch, capsys):
    """`verify tp --json` when a request's tokens differ (a planted bug in shard_llama): its
    max_logit_difference is inf, printed as `Infinity`: not JSON (jq read 1.8e308)."""
    import kvpool.verify.tensor_parallel as tp

    request = {"tokens_equal": False, "max_logit_difference": math.inf, "single_process_fp32_error": 3e-5}
    result = {
        "tp": 3,
        "passed": False,
        "failures": ["request c: its tokens differ from the single-process engine's"],
        "requests": {"c": {**request, "passed": False}},
        "b_cached_tokens": 48,
        "preemptions": 1,
        "kv_bytes_per_token_per_rank": 15360,
        "kv_bytes_per_token_single": 46080,
        "single_process_s": 1.0,
        "tp_s": 2.0,
    }
    monkeypatch.setattr(tp, "run_tp", lambda max_tokens: result)
    assert main(["verify", "tp", "--json"]) == 1
    report = _strict_loads(capsys.readouterr().out)
    assert report["requests"]["c"]["max_logit_difference"] is None
    assert report["requests"]["c"]["single_process_fp32_error"] == 3e-5
    assert main(["verify", "tp"]) == 1  # the text keeps the figure
    assert "max logit difference inf" in capsys.readouterr().out


def test_bench_engine_attention_past_memory_is_one_line():
    """`bench engine --parts attention --attn-context 100000000 --attn-batch 1000`: the
    allocator's traceback ("you tried to allocate 76800000000000 bytes"), not the flags."""
    from kvpool.bench.engine import measure

    with pytest.raises(ValueError, match="--attn-batch 1000 x --attn-context 100000000 needs .* GiB"):
        measure(parts=["attention"], attn_context=100_000_000, attn_batch=1000)


def test_bench_start_prompt_beginning_with_a_dash(monkeypatch):
    """`bench start --prompt=--help`: the child's argv read the prompt as an option (the help
    was printed where JSON was read: "Expecting value: line 1 column 1"; "-x" was refused)."""
    import kvpool.bench.start as start

    argvs = []

    def fake_start(argv, env):
        argvs.append(argv)
        out = b'{"load_s": 0.5, "load_source": "weight cache"}' if "--json" in argv else b"x"
        return 1.0, 1.5, out

    monkeypatch.setattr(start, "_start", fake_start)
    for prompt in ("--help", "-x", "hi"):
        argvs.clear()
        start.measure(runs=1, prompt=prompt)
        generates = [a for a in argvs if "generate" in a]
        assert len(generates) == 5
        for argv in generates:
            i = argv.index("generate")
            args = build_parser().parse_args(argv[i:])
            assert args.prompt == prompt and args.max_tokens == 1
            assert args.json == ("--json" in argv)


@pytest.mark.parametrize("prompt", ["", "  "])
def test_bench_start_refuses_an_empty_prompt_before_it_starts(monkeypatch, capsys, prompt):
    """An empty --prompt started the first cold start, whose `kvpool generate` refused it, and
    bench start said "kvpool generate --max-tokens 1 --json --  exited 2: kvpool generate:
    error: argument prompt: the prompt is empty": now its own parser refuses it, no start."""
    import kvpool.bench.start as start

    monkeypatch.setattr(start, "_start", lambda argv, env: pytest.fail(f"started {argv}"))
    with pytest.raises(SystemExit) as stop:
        main(["bench", "start", "--prompt", prompt])
    assert stop.value.code == 2
    assert capsys.readouterr().err == "kvpool bench start: error: argument --prompt: the prompt is empty\n"


def test_bench_tiers_lengths_name_the_flags():
    """`bench tiers --prefix-len 8160`: the host case's filler (the request's blocks and one
    more) passed SmolLM2's context, told as "prompt of 8208 tokens is too long" after the
    device case ran; a prefix past memory was told to "lower --kv-memory or --num-blocks"."""
    from kvpool.bench.tiers import check_lengths, measure

    check_lengths(8128, 16, 16, 8192)  # the filler: 511 blocks of 16, 8,176 tokens, fits
    for prefix in (8144, 8160, 100_000_000):
        with pytest.raises(ValueError, match="--prefix-len .* lower --prefix-len or --suffix-len"):
            check_lengths(prefix, 16, 16, 8192)
    with pytest.raises(ValueError, match="--v4-prefix-len 1048560 .* needs 1,048,577 positions"):
        measure(v4_prefix_len=1_048_560)
    with pytest.raises(ValueError, match="--prefix-len 8160 .*"):
        measure(prefix_len=8160, repeats=1, redis="redis://127.0.0.1:1")


def test_bench_serve_start_interrupted_kills_the_server(monkeypatch):
    """Ctrl-C (or SIGTERM) while `kvpool serve` loads: start_server had not returned its
    process, so nothing stopped it: the server kept serving, orphaned."""
    import kvpool.bench.serve as serve

    killed = []

    class Loading:
        def readline(self):
            raise KeyboardInterrupt

    class FakeProcess:
        def __init__(self, command, **kwargs):
            self.stdout = Loading()

        def kill(self):
            killed.append(True)

        def wait(self, timeout=None):
            return -9

    monkeypatch.setattr(serve.subprocess, "Popen", FakeProcess)
    with pytest.raises(KeyboardInterrupt):
        serve.start_server()
    assert killed == [True]


def test_bench_sigterm_stops_like_ctrl_c():
    """SIGTERM (`timeout`, a job's stop) killed a bench outright (status -15): the server
    bench serve started, or bench tiers' redis-server, was left running. Now it stops as
    Ctrl-C does: one line, status 143."""
    with socket.socket() as listener:  # accepts connections, never answers
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        url = f"http://127.0.0.1:{listener.getsockname()[1]}"
        env = {**os.environ, "PYTHONPATH": str(SRC)}
        command = [sys.executable, "-m", "kvpool", "bench", "serve", "--url", url, "--ready-timeout", "60"]
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        deadline = time.monotonic() + 60
        line = ""
        while "waiting for" not in line and time.monotonic() < deadline:  # the bench is in its wait
            line = proc.stderr.readline()
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 143, err
    assert err.strip().splitlines()[-1] == "kvpool bench serve: terminated"


def test_run_load_cancelled_logs_no_traceback():
    """Ctrl-C in `bench serve` mid-run: after "interrupted", asyncio logged a traceback a
    request, "_GatheringFuture exception was never retrieved" (wait_for cancels the gather
    and never reads its CancelledError)."""
    from kvpool.server.loadgen import LoadConfig, run_load

    with socket.socket() as listener:  # accepts connections, never answers
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        url = f"http://127.0.0.1:{listener.getsockname()[1]}"
        config = LoadConfig(url=url, model="m", num_requests=4, turns=1, max_tokens=1, concurrency=2)
        logged = []

        async def interrupted() -> None:
            asyncio.get_running_loop().set_exception_handler(lambda loop, context: logged.append(context))
            task = asyncio.ensure_future(run_load(config))
            await asyncio.sleep(0.5)
            task.cancel()  # what asyncio.run does with the main task on Ctrl-C
            with pytest.raises(asyncio.CancelledError):
                await task
            del task
            gc.collect()
            await asyncio.sleep(0)

        asyncio.run(interrupted())
    assert not logged, [c.get("message") for c in logged]


def test_bench_hisparse_changed_outputs_is_one_failure_line(monkeypatch, capsys):
    """A HiSparse that changes the outputs (planted: the hot set keeping fetched[0] in every
    slot it fills) made `bench hisparse` end in a RuntimeError's traceback; its docstring says
    it fails. Now one line and status 1."""
    import torch

    import kvpool.bench.hisparse as hisparse

    def run(model, prompt, steps, hot):  # the hot set's logits differ from HiSparse off's
        logits = [torch.full((4,), 0.0 if hot is None else 1.0)]
        return {"decode_step_ms": 1.0, "csa_main_device_bytes": 1}, logits

    monkeypatch.setattr(hisparse, "_run", run)
    assert main(["bench", "hisparse", "--context", "256", "--hot-set", "8", "--steps", "2"]) == 1
    captured = capsys.readouterr()
    assert captured.err == (
        "kvpool bench hisparse: FAILED: HiSparse with a hot set of 8 changed the outputs at context 256\n"
    )
    assert captured.out == ""


@pytest.mark.parametrize("command", [["bench", "engine"], ["bench", "kv-quant"], ["run"], ["generate", "hi"]])
def test_threads_past_any_cpu_are_refused(command, capsys):
    """`--threads 100000`: torch tried to start them all; the kernels' build failed with
    "[Errno 11] Resource temporarily unavailable" and the process segfaulted (status 139)."""
    with pytest.raises(SystemExit) as stop:
        build_parser().parse_args([*command, "--threads", "100000"])
    assert stop.value.code == 2
    assert "argument --threads: expected at most 4096 (more than any CPU has), got 100000" in capsys.readouterr().err
    assert build_parser().parse_args([*command, "--threads", "4096"]).threads == 4096


def test_verify_cp_past_memory_is_one_line_before_the_group(monkeypatch, capsys):
    """`torchrun --nproc-per-node 2 -m kvpool verify cp --context 1000000000 --batch 100`:
    every rank listed block ids for a minute, then a MemoryError's traceback (with no
    memory limit, the machine's memory went first). Now each rank refuses before the group
    forms, naming the flags."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)  # refused before torchrun's absence is
    argv = ["verify", "cp", "--context", "1000000000", "--batch", "100", "--smollm2-prompt", "0"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(
        "kvpool verify cp: error: the paged check's --batch 100 x --context 1000000000 in blocks of --block-size 16 "
        "needs 429153.4 GiB but "
    ), err
    assert err.endswith("; lower --context, --batch or --block-size\n")
    # blocks that huge at the default --context 32768 --batch 4: the line named only the
    # flags at their defaults, not the one to lower
    assert main(["verify", "cp", "--block-size", "100000000", "--smollm2-prompt", "0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(
        "kvpool verify cp: error: the paged check's --batch 4 x --context 32768 in blocks of --block-size 100000000 "
        "needs 1716.6 GiB but "
    ), err


def test_verify_pd_sizes_name_the_flags_before_the_group():
    """`torchrun --nproc-per-node 2 -m kvpool verify pd --prompt-len 100000`: "request
    'req-0': prompt of 100020 tokens is too long" on the decode side, then "lost rank 1" on
    the other; `--prefill-block-size 100000`: "lower --kv-memory or --num-blocks", flags
    verify pd does not have. Now every rank refuses alike before the group forms, naming
    the flags. The largest prompt that fits is not refused (4,075: prompts of 4,095 tokens;
    --prompt-len 4068 --max-tokens 8 ran end to end and passed)."""
    from kvpool.engine.build import load_model
    from kvpool.verify.disaggregated import check_sizes

    loaded = load_model(device="cpu")
    check_sizes(loaded, 16, 16, 4075)
    with pytest.raises(ValueError, match=r"--prompt-len 4076 makes prompts of up to 4,096 tokens; .* hold 4,096 "):
        check_sizes(loaded, 16, 16, 4076)
    with pytest.raises(ValueError, match=r"--prompt-len 100000 .* lower --prompt-len, or raise the block sizes$"):
        check_sizes(loaded, 16, 16, 100_000)
    with pytest.raises(ValueError, match=r"hold 8,192 tokens a request, the output's included: lower --prompt-len$"):
        check_sizes(loaded, 64, 64, 8200)
    with pytest.raises(ValueError, match=r"--prefill-block-size 100000, --decode-block-size 16\) needs .* GiB"):
        check_sizes(loaded, 100_000, 16, 32)
