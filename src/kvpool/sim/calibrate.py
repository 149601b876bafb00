"""Measure this machine for the simulator's `cpu` preset: read bandwidth and fp32 matmul FLOPs.

    python3 -m kvpool.sim.calibrate [--repeats 20] [--buffer-mib 512] [--processes 8]

prints one JSON object. Each figure is the best of `--repeats` timed runs in one process (a
shared VM is noisy, and the best run is the closest to what the hardware can do), with
torch's default thread count, which is what kvpool's CPU engine runs with. On the VMs this
was written on, the figure also depends on the process: where its memory lands, fixed for
the process's life, moves the read bandwidth between ~23 and ~54 GB/s from one process to
the next. So the measurement runs in `--processes` fresh processes and reports each one,
their median (what an engine process can expect) and their best.
- read bandwidth: `torch.sum` over a `--buffer-mib` fp32 tensor (far beyond the caches),
  bytes of the tensor / seconds;
- fp32 matmul FLOPs, 2 x M x K x N / seconds, for two shapes: [256 x 576] @ [576 x 1536],
  a 256-token step through SmolLM2-135M's MLP up-projection (the engine's compute-bound
  case), and a large square [2048 x 2048] @ [2048 x 2048] (the machine's GEMM ceiling).
The per-step overhead is not measured here: it belongs to the engine, not the hardware, and
is calibrated against the engine's own step times.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

import torch

MIB = 1 << 20
MATMUL_SHAPES: dict[str, tuple[int, int, int]] = {
    "smollm2_step_256x576x1536": (256, 576, 1536),  # (M, K, N)
    "square_2048": (2048, 2048, 2048),
}


def best_seconds(fn: Callable[[], object], repeats: int, inner: int = 1) -> float:
    """The fastest of `repeats` timings of `inner` back-to-back calls, per call (one warm-up)."""
    if repeats <= 0 or inner <= 0:
        raise ValueError(f"repeats and inner must be positive, got repeats={repeats}, inner={inner}")
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(inner):
            fn()
        best = min(best, (time.perf_counter() - start) / inner)
    return best


def read_bandwidth(buffer_mib: int = 512, repeats: int = 20) -> float:
    """Bytes per second that `torch.sum` streams from memory over a `buffer_mib` fp32 tensor."""
    if buffer_mib <= 0:
        raise ValueError(f"buffer_mib must be positive, got {buffer_mib}")
    x = torch.ones(buffer_mib * MIB // 4, dtype=torch.float32)  # [buffer_mib MiB / 4 B] fp32
    return x.numel() * x.element_size() / best_seconds(lambda: x.sum(), repeats)


def matmul_flops(m: int, k: int, n: int, repeats: int = 20) -> float:
    """fp32 FLOPs per second of [m x k] @ [k x n]; small products are timed in batches of
    calls so that one timing lasts ~10 ms or more."""
    a = torch.randn(m, k, dtype=torch.float32)  # [m, k]
    b = torch.randn(k, n, dtype=torch.float32)  # [k, n]
    flops = 2 * m * k * n
    inner = max(1, int(2e9 // flops))  # ~2 GFLOP a timing: ~10 ms at ~200 GFLOP/s
    return flops / best_seconds(lambda: a @ b, repeats, inner)


def calibrate(buffer_mib: int = 512, repeats: int = 20) -> dict[str, object]:
    return {
        "machine": f"{platform.machine()} {platform.processor() or platform.platform()}, {os.cpu_count()} CPUs",
        "torch": torch.__version__,
        "num_threads": torch.get_num_threads(),
        "repeats": repeats,
        "read_bandwidth_bytes_per_s": read_bandwidth(buffer_mib, repeats),
        "read_buffer_mib": buffer_mib,
        "fp32_matmul_flops": {name: matmul_flops(m, k, n, repeats) for name, (m, k, n) in MATMUL_SHAPES.items()},
    }


def calibrate_processes(num_processes: int, buffer_mib: int = 512, repeats: int = 20) -> dict[str, object]:
    """`calibrate` in `num_processes` fresh processes, one after the other: each process's
    figures, and their median and best."""
    if num_processes <= 0:
        raise ValueError(f"num_processes must be positive, got {num_processes}")
    cmd = [sys.executable, "-m", "kvpool.sim.calibrate", "--processes", "1"]
    cmd += ["--repeats", str(repeats), "--buffer-mib", str(buffer_mib)]
    runs = [
        json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout) for _ in range(num_processes)
    ]
    bandwidths = [run["read_bandwidth_bytes_per_s"] for run in runs]
    flops = {name: [run["fp32_matmul_flops"][name] for run in runs] for name in MATMUL_SHAPES}
    return {
        **{key: runs[0][key] for key in ("machine", "torch", "num_threads", "repeats", "read_buffer_mib")},
        "num_processes": num_processes,
        "read_bandwidth_bytes_per_s": {"median": statistics.median(bandwidths), "best": max(bandwidths)},
        "fp32_matmul_flops": {
            name: {"median": statistics.median(values), "best": max(values)} for name, values in flops.items()
        },
        "per_process": [
            {
                "read_bandwidth_bytes_per_s": run["read_bandwidth_bytes_per_s"],
                "fp32_matmul_flops": run["fp32_matmul_flops"],
            }
            for run in runs
        ],
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python3 -m kvpool.sim.calibrate", description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20, help="timed runs per figure; the best counts")
    parser.add_argument("--buffer-mib", type=int, default=512, help="size of the fp32 tensor torch.sum reads")
    parser.add_argument("--processes", type=int, default=8, help="fresh processes to measure in (1: this one)")
    args = parser.parse_args(argv)
    if args.processes == 1:
        result = calibrate(args.buffer_mib, args.repeats)
    else:
        result = calibrate_processes(args.processes, args.buffer_mib, args.repeats)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
