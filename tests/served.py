"""`kvpool serve` in a child process for a test: on 127.0.0.1 and a free port (`--port 0`),
ready within a bound, stopped by Ctrl-C (SIGINT) with its exit status (130) and its cache's
last integrity check asserted."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import kvpool


@contextmanager
def served(*flags: str, ready_s: float = 120) -> Iterator[str]:
    """The server's base URL while the block runs; `flags` are `kvpool serve`'s (--model ...)."""
    src = str(Path(kvpool.__file__).parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [src, os.environ.get("PYTHONPATH")]))}
    command = [sys.executable, "-m", "kvpool", "serve", "--port", "0", *flags]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        deadline, line = time.monotonic() + ready_s, ""
        while "ready on " not in line and time.monotonic() < deadline and proc.poll() is None:
            if select.select([proc.stdout], [], [], 1)[0]:
                line = proc.stdout.readline()
        assert "ready on " in line, proc.stderr.read() if proc.poll() is not None else f"not ready in {ready_s} s"
        yield line.split("ready on ", 1)[1].split()[0]
    finally:
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "cache integrity ok, 0 blocks held" in err, err
