"""A private `redis-server` on 127.0.0.1 and a free port, in memory only: what the tests and
`kvpool bench tiers` run the Redis tier against when no server is given. It can be killed
(SIGKILL: the data goes with it, as in a crash) and started again on the same port, and
paused (SIGSTOP: a stalled server, which still accepts connections but never answers) and
resumed."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time


class LocalRedisServer:
    def __init__(self, workdir: str | os.PathLike, *, password: str | None = None) -> None:
        """password: the server's `requirepass` (its `url` names none: a test adds it)."""
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not installed (Debian's package; `bash setup.sh test` installs it)")
        self.binary = binary
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.workdir = str(workdir)
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.password = password
        self.proc: subprocess.Popen | None = None

    def start(self, timeout_s: float = 10.0) -> LocalRedisServer:
        import redis

        argv = [self.binary, "--bind", "127.0.0.1", "--port", str(self.port), "--save", "", "--appendonly", "no"]
        argv += ["--dir", self.workdir] + (["--requirepass", self.password] if self.password else [])
        self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis(host="127.0.0.1", port=self.port, password=self.password, socket_connect_timeout=0.2)
        deadline = time.monotonic() + timeout_s
        try:
            while True:
                try:
                    client.ping()
                    return self
                except redis.ConnectionError:
                    if self.proc.poll() is not None or time.monotonic() > deadline:
                        self.stop()
                        raise RuntimeError(f"redis-server did not start on 127.0.0.1:{self.port}") from None
                    time.sleep(0.05)
        finally:
            client.close()

    def pause(self) -> None:
        """SIGSTOP: the kernel still completes connections, nothing answers them."""
        assert self.proc is not None, "the server is not running"
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        if self.proc is not None:
            self.proc.send_signal(signal.SIGCONT)

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(10)
            self.proc = None

    def stop(self) -> None:
        if self.proc is not None:
            self.resume()  # a paused server would not act on SIGTERM
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
            self.proc = None

    def __enter__(self) -> LocalRedisServer:
        return self.start() if self.proc is None else self

    def __exit__(self, *exc: object) -> None:
        self.stop()
