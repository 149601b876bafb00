"""Shared fixtures."""

from __future__ import annotations

import os

import pytest


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op torch thread for a test module: with two cores shared by the test run,
    oversubscribed OpenMP threads make tiny matrix ops far slower, not faster."""
    import torch

    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.fixture(scope="session")
def kernels():
    """The C kernels (src/kvpool/kernels/cpu.c). They ship with kvpool and setup.sh builds them,
    so a test that needs them fails, with the compiler's or loader's message, when they do not
    load. KVPOOL_NATIVE=0 is the one way out: the user switched them off, and those tests skip."""
    from kvpool.kernels import CpuKernels, KernelBuildError, build, cpu_kernels

    if os.environ.get("KVPOOL_NATIVE") == "0":
        pytest.skip("KVPOOL_NATIVE=0: the C kernels are switched off")
    loaded = cpu_kernels()  # KVPOOL_NATIVE=1 raises here when they do not build
    if loaded is None:  # unset: cpu_kernels() warned and fell back to torch; say why
        try:
            CpuKernels(build())
        except (KernelBuildError, OSError) as e:
            pytest.fail(f"the C kernels do not load here (KVPOOL_NATIVE=0 runs without them): {e}")
        pytest.fail("cpu_kernels() returned None, yet cpu.c builds and loads")
    return loaded


@pytest.fixture(scope="module")
def fp64_model():
    """SmolLM2-135M in fp64 on the CPU, one torch thread: the engine's tier tests compare
    logits bit for bit and against the fp64 reference."""
    import torch

    from kvpool.engine.build import LoadedModel, load_model

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    fp32 = load_model(device="cpu")
    yield LoadedModel(fp32.gguf, fp32.model.astype(torch.float64), fp32.tokenizer, fp32.weights_version)
    torch.set_num_threads(threads)


class RedisServer:
    """A real `redis-server` (Debian package; `bash setup.sh test` installs it) on 127.0.0.1
    and a free port, in memory only, that a test can kill (SIGKILL: the data goes with it,
    as in a crash) and start again on the same port."""

    def __init__(self, workdir) -> None:
        import shutil
        import socket

        self.binary = shutil.which("redis-server")
        if self.binary is None:
            pytest.fail("redis-server is not installed: `bash setup.sh test` installs the Debian package")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.workdir = workdir
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc = None

    def start(self, timeout_s: float = 10.0) -> None:
        import subprocess
        import time

        import redis

        argv = [self.binary, "--bind", "127.0.0.1", "--port", str(self.port), "--save", "", "--appendonly", "no"]
        argv += ["--dir", str(self.workdir), "--protected-mode", "no"]
        self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis(host="127.0.0.1", port=self.port, socket_connect_timeout=0.2)
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    pytest.fail(f"redis-server did not start on port {self.port}")
                time.sleep(0.05)
        client.close()

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(10)
            self.proc = None

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except Exception:
                self.proc.kill()
            self.proc = None


@pytest.fixture
def redis_server(tmp_path_factory):
    """A started RedisServer, stopped after the test whatever happens."""
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    server.start()
    yield server
    server.stop()
