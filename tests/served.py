"""`kvpool serve` in a child process for a test: on 127.0.0.1 and a free port (`--port 0`),
ready within a bound, stopped by Ctrl-C (SIGINT) with its exit status (130) and its cache's
last integrity check asserted."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import tempfile
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
    # stderr to a file: a pipe read only at the end would block a server that logs more than its buffer
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=log, text=True, env=env)
        try:
            deadline, line = time.monotonic() + ready_s, ""
            while "ready on " not in line and time.monotonic() < deadline and proc.poll() is None:
                if select.select([proc.stdout], [], [], 1)[0]:
                    line = proc.stdout.readline()
            if "ready on " not in line:
                proc.kill()
                proc.wait(timeout=60)
                log.seek(0)
                raise AssertionError(f"not ready in {ready_s} s" if proc.returncode == -9 else log.read())
            yield line.split("ready on ", 1)[1].split()[0]
        finally:
            proc.send_signal(signal.SIGINT)
            proc.communicate(timeout=60)
        log.seek(0)
        err = log.read()
    assert proc.returncode == 130, err
    assert "cache integrity ok, 0 blocks held" in err, err
