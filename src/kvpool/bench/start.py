"""`kvpool bench start`'s measurement: how long `kvpool generate PROMPT` takes from a cold
process to its first token, as a user sees it: a fresh `python -m kvpool generate PROMPT
--max-tokens 1` is started, and the clock stops at the first byte of the answer on its
stdout (generate streams as it decodes); `exit_s` is when the process is gone.

Runs: one first run that fills the weight cache if it is empty (its load is reported
apart), then `runs` warm starts (the cache and the OS page cache warm), and one start with
the cache switched off (KVPOOL_WEIGHT_CACHE=0: the GGUF read, dequantized and fused). A
`--json` start of each kind reports the load phase as generate measures it. The floor: a
process that only imports torch, timed the same way.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from kvpool.bench.common import Progress, no_progress


def _start(argv: list[str], env: dict[str, str]) -> tuple[float, float, bytes]:
    """(seconds to the first byte on stdout, seconds to exit, stdout) of a fresh process."""
    begin = time.perf_counter()
    # unbuffered: the first byte is read from the pipe itself, and nothing sits in a buffer
    # that communicate() would not see
    # stderr to a file, not a pipe: a child that writes more than a pipe holds to stderr
    # before its first byte on stdout would block, and so would this read
    with tempfile.TemporaryFile() as err_file:
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=err_file, env=env, bufsize=0)
        assert proc.stdout is not None
        first = proc.stdout.read(1)
        first_s = time.perf_counter() - begin
        rest, _ = proc.communicate(timeout=600)
        exit_s = time.perf_counter() - begin
        err_file.seek(0)
        err = err_file.read()
    if proc.returncode != 0:  # a ValueError: main prints it as one line (a bad --model, say)
        raise ValueError(f"{' '.join(argv[2:])} exited {proc.returncode}: {err.decode(errors='replace')[-500:]}")
    return first_s, exit_s, first + rest


def measure(runs: int = 5, prompt: str = "hi", model: str | None = None, progress: Progress = no_progress) -> dict:
    """The starts above: first-token and exit seconds of the warm starts, the load phases,
    the start without the weight cache and the torch floor, in seconds rounded to 1 ms.
    `model`: a GGUF file (None: the embedded SmolLM2-135M)."""
    if runs < 1:
        raise ValueError(f"runs must be at least 1, got {runs}")
    options = ["--max-tokens", "1"] + (["--model", model] if model else [])
    command = [sys.executable, "-m", "kvpool", "generate"]

    def generate(*more: str) -> list[str]:
        # the prompt after "--": one that begins with '-' ("-5 degrees", "--help") is the
        # prompt, not an option (it was refused, or printed the help where JSON was read)
        return [*command, *options, *more, "--", prompt]

    env = dict(os.environ)
    env.pop("KVPOOL_WEIGHT_CACHE", None)
    off = {**env, "KVPOOL_WEIGHT_CACHE": "0"}

    progress("first start (fills the weight cache if empty)")
    first = json.loads(_start(generate("--json"), env)[2])
    progress(f"{runs} warm starts")
    warm = [_start(generate(), env)[:2] for _ in range(runs)]
    warm_json = json.loads(_start(generate("--json"), env)[2])
    progress("a start without the weight cache")
    gguf_first, gguf_exit, _ = _start(generate(), off)
    gguf_json = json.loads(_start(generate("--json"), off)[2])
    torch_floor = [_start([sys.executable, "-c", "import torch, sys; sys.stdout.write('x')"], env)[0] for _ in range(3)]

    firsts, exits = [w[0] for w in warm], [w[1] for w in warm]
    report = {
        "runs": runs,
        "first_token_s": {"median": statistics.median(firsts), "min": min(firsts), "max": max(firsts)},
        "exit_s_median": statistics.median(exits),
        "load_s_warm": warm_json["load_s"],
        "load_source_warm": warm_json["load_source"],
        "first_run_load_s": first["load_s"],
        "first_run_load_source": first["load_source"],
        "no_cache_first_token_s": gguf_first,
        "no_cache_exit_s": gguf_exit,
        "no_cache_load_s": gguf_json["load_s"],
        "import_torch_s_median": statistics.median(torch_floor),
    }
    report = {k: round(v, 3) if isinstance(v, float) else v for k, v in report.items()}
    report["first_token_s"] = {k: round(v, 3) for k, v in report["first_token_s"].items()}
    return report
