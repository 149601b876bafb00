"""Shared fixtures."""

from __future__ import annotations

import os
import sys

import pytest
import torch

# Without a GPU, Triton's kernels run in its interpreter on CPU tensors. Triton reads
# TRITON_INTERPRET when it is first imported (its library's jit functions are made then),
# so it is set here, before any test module is collected.
if "triton" not in sys.modules and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


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
def smollm2_for_commands(one_thread):
    """The embedded SmolLM2-135M, loaded once a module; the CLI commands a test runs get it
    from build.load_model instead of loading it again."""
    from kvpool.engine import build

    loaded = build.load_model()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(build, "load_model", lambda path=None, **kw: loaded)
        yield loaded


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


@pytest.fixture
def redis_server(tmp_path_factory):
    """A real redis-server (kvpool.tiers.redis_server.LocalRedisServer) on 127.0.0.1 and a
    free port, started for the test and stopped after it whatever happens; the test may
    kill() it and start() it again."""
    from kvpool.tiers.redis_server import LocalRedisServer

    try:
        server = LocalRedisServer(tmp_path_factory.mktemp("redis")).start()
    except RuntimeError as e:
        pytest.fail(str(e))
    yield server
    server.stop()
