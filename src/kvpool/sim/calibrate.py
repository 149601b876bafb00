"""Measure this machine for the simulator's `cpu` preset: read bandwidth and fp32 matmul FLOPs;
or fit the GPU cost model to a measured run (`--fit`, kvpool/sim/gpufit.py).

    python3 -m kvpool.sim.calibrate [--repeats 20] [--buffer-mib 512] [--processes 8]
    python3 -m kvpool.sim.calibrate --fit h200-issue31|FILE.json [--json]

The first prints one JSON object. Each figure is the best of `--repeats` timed runs in one process (a
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
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, fields

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
    import torch  # (here, not at the top: a Ctrl-C in its seconds of import is one line)

    if buffer_mib <= 0:
        raise ValueError(f"buffer_mib must be positive, got {buffer_mib}")
    x = torch.ones(buffer_mib * MIB // 4, dtype=torch.float32)  # [buffer_mib MiB / 4 B] fp32
    return x.numel() * x.element_size() / best_seconds(lambda: x.sum(), repeats)


def matmul_flops(m: int, k: int, n: int, repeats: int = 20) -> float:
    """fp32 FLOPs per second of [m x k] @ [k x n]; small products are timed in batches of
    calls so that one timing lasts ~10 ms or more."""
    import torch

    a = torch.randn(m, k, dtype=torch.float32)  # [m, k]
    b = torch.randn(k, n, dtype=torch.float32)  # [k, n]
    flops = 2 * m * k * n
    inner = max(1, int(2e9 // flops))  # ~2 GFLOP a timing: ~10 ms at ~200 GFLOP/s
    return flops / best_seconds(lambda: a @ b, repeats, inner)


def calibrate(buffer_mib: int = 512, repeats: int = 20) -> dict[str, object]:
    import torch

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


@dataclass(frozen=True)
class EngineFit:
    """The cpu cost model's engine terms, fitted on timed steps of kvpool's own engine.

    `times` (EngineStepTimes) holds what it was fitted to, each the median of `repeats`
    engine steps timed in this process: decode_1_s and decode_b_s, a decode step of 1 and
    of `batch` sequences over `prefill_tokens` tokens of context each; prefill_s and
    prefill_small_s, one step computing a fresh prompt of `prefill_tokens` and of
    `prefill_small_tokens` tokens. With C and M a step's compute and memory seconds at
    efficiency 1 (cost.py), the model is

        t = max(C / compute_eff, M / bandwidth_eff) + step_overhead
            + sequences x seq_overhead + prefill chunks x prefill_chunk_overhead

    and the four times give, in order (the prefills are compute-bound, the decodes
    memory-bound, at the bandwidth efficiency's default unless the overhead would be
    negative: then the step overhead is 0 and the bandwidth efficiency is fitted):

        compute_eff            = (C_prefill - C_small) / (prefill_s - prefill_small_s)
        seq_overhead           = (decode_b_s - decode_1_s - (step_b - step_1)) / (batch - 1)
                                 where step_x = max(C_x / compute_eff, M_x / bandwidth_eff)
        step_overhead          = decode_1_s - seq_overhead - step_1
        prefill_chunk_overhead = prefill_small_s - C_small / compute_eff - step_overhead - seq_overhead

    On kvpool's CPU engine a prefill chunk costs tens of ms beyond its FLOPs, whatever its
    length (a decode does not): that is the last term. The fitted steps are not the
    workload's: `kvpool bench sim` predicts a mix of chunks over cached prefixes and decodes
    of other batch sizes with them."""

    times: EngineStepTimes  # what it was fitted to
    compute_efficiency: float
    bandwidth_efficiency: float
    step_overhead_s: float
    seq_overhead_s: float
    prefill_chunk_overhead_s: float

    def overrides(self) -> dict[str, float]:
        """CostModel keyword arguments: the five fitted parameters (every field but `times`),
        as gpufit's GPUFit.overrides() gives a GPU fit's."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "times"}

    def cost_model(self, model, gpu):
        from kvpool.sim.cost import CostModel

        return CostModel(model, gpu, **self.overrides())


def _median_step_s(engine, steps: int) -> float:
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


@dataclass(frozen=True)
class EngineStepTimes:
    """Median seconds of the engine steps `EngineFit` is solved from (see there)."""

    batch: int
    prefill_tokens: int
    prefill_small_tokens: int
    decode_1_s: float
    decode_b_s: float
    prefill_s: float
    prefill_small_s: float

    @staticmethod
    def mean(a: EngineStepTimes, b: EngineStepTimes) -> EngineStepTimes:
        """The mean of two measurements of the same steps (timed before and after a run)."""
        shape = ("batch", "prefill_tokens", "prefill_small_tokens")
        if any(getattr(a, k) != getattr(b, k) for k in shape):
            raise ValueError("the two measurements timed different steps")
        times = ("decode_1_s", "decode_b_s", "prefill_s", "prefill_small_s")
        return EngineStepTimes(*(getattr(a, k) for k in shape), *((getattr(a, k) + getattr(b, k)) / 2 for k in times))


def time_engine_steps(
    loaded,
    engine_kwargs: dict,
    *,
    batch: int = 8,
    prefill_tokens: int = 256,
    prefill_small_tokens: int = 64,
    repeats: int = 7,
    seed: int = 0,
) -> EngineStepTimes:
    """Time the engine's decode and prefill steps on `loaded` (kvpool.engine.build), each
    the median of `repeats`. The prompts are random token ids, drawn fresh each, so no step
    hits the prefix cache."""
    import random

    from kvpool.engine.build import build_engine
    from kvpool.engine.sampling import SamplingParams

    if batch < 2 or not 2 <= prefill_small_tokens < prefill_tokens or repeats < 1:
        raise ValueError(
            f"need batch >= 2, 2 <= prefill_small_tokens < prefill_tokens and repeats >= 1, "
            f"got {batch}, {prefill_small_tokens}, {prefill_tokens}, {repeats}"
        )
    if prefill_tokens > engine_kwargs["max_num_batched_tokens"]:
        raise ValueError(f"prefill_tokens={prefill_tokens} does not fit one step of the engine")
    rng = random.Random(seed)
    vocab = loaded.model.config.vocab_size

    def prompt(n: int) -> list[int]:
        return [rng.randrange(vocab) for _ in range(n)]

    def decode_s(num_seqs: int) -> float:
        engine = build_engine(loaded, **engine_kwargs)
        params = SamplingParams(max_tokens=repeats + num_seqs + 2, ignore_eos=True)
        for _ in range(num_seqs):
            engine.add_request(prompt(prefill_tokens), params)  # a chat prompt's context, not an empty one
        while engine.waiting or any(s.num_computed < s.request.num_prompt_tokens for s in engine.running):
            engine.step()  # the prompts, a step's budget at a time
        engine.step()  # one decode of all of them to warm up
        return _median_step_s(engine, repeats)

    def prefill_s(n: int) -> float:
        engine = build_engine(loaded, **engine_kwargs)
        times = []
        for _ in range(repeats + 1):
            engine.add_request(prompt(n), SamplingParams(max_tokens=1, ignore_eos=True))
            start = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - start)
        return statistics.median(times[1:])  # the first warms up

    d1, db = decode_s(1), decode_s(batch)
    return EngineStepTimes(
        batch, prefill_tokens, prefill_small_tokens, d1, db, prefill_s(prefill_tokens), prefill_s(prefill_small_tokens)
    )


def fit_engine(times: EngineStepTimes) -> EngineFit:
    """The cpu cost model's efficiencies and overheads that reproduce `times` (see
    EngineFit). RuntimeError when the times do not fit the model (another process on the
    CPUs, typically)."""
    from kvpool.sim.cost import DEVICE_DEFAULTS, CostModel
    from kvpool.spec.gpus import cpu_preset
    from kvpool.spec.models import load_preset

    batch, n_pf, n_ps = times.batch, times.prefill_tokens, times.prefill_small_tokens
    d1, db, pf, ps = times.decode_1_s, times.decode_b_s, times.prefill_s, times.prefill_small_s
    model, gpu = load_preset("smollm2-135m"), cpu_preset()
    unit = CostModel(model, gpu, compute_efficiency=1.0, bandwidth_efficiency=1.0, step_overhead_s=0.0)
    one, many = unit.step_cost([(1, n_pf + 4)]), unit.step_cost([(1, n_pf + 4)] * batch)  # mid-measurement
    c1, m1, cb, mb = one.compute_s, one.memory_s, many.compute_s, many.memory_s
    c_pf = unit.step_cost([(n_pf, n_pf)]).compute_s
    c_ps = unit.step_cost([(n_ps, n_ps)]).compute_s
    compute_eff = (c_pf - c_ps) / (pf - ps) if pf > ps else math.inf
    bw_eff = DEVICE_DEFAULTS["cpu"].bandwidth_efficiency
    step_1, step_b = max(c1 / compute_eff, m1 / bw_eff), max(cb / compute_eff, mb / bw_eff)
    seq_ov = (db - d1 - (step_b - step_1)) / (batch - 1)
    step_ov = d1 - seq_ov - step_1
    memory_bound = True  # the decodes, where the solution below assumes it
    if step_ov < 0:
        # The weights stream faster than the default says: no step overhead, and the two
        # (memory-bound) decodes give the rest, d1 = seq_ov + m1 / e and db = batch x seq_ov + mb / e.
        step_ov = 0.0
        inverse = (batch * d1 - db) / (batch * m1 - mb)  # 1 / e
        bw_eff = 1 / inverse if inverse > 0 else math.inf
        seq_ov = d1 - m1 * inverse
        memory_bound = cb / compute_eff <= mb * inverse
    chunk_ov = ps - c_ps / compute_eff - step_ov - seq_ov
    if not (0 < compute_eff <= 1 and 0 < bw_eff <= 1 and seq_ov >= 0 and chunk_ov >= 0 and memory_bound):
        raise RuntimeError(
            f"the engine's step times do not fit the cost model (decodes of 1 and {batch}: {d1 * 1e3:.1f} and "
            f"{db * 1e3:.1f} ms, prefills of {n_pf} and {n_ps} tokens: {pf * 1e3:.1f} and {ps * 1e3:.1f} ms): "
            "is another process using the CPUs?"
        )
    return EngineFit(times, compute_eff, bw_eff, step_ov, seq_ov, chunk_ov)


def _positive_int(text: str) -> int:
    """A count flag, checked by the parser (0 or -5 were tracebacks from the measurement;
    sim sits below cli, so cli/args' own check is not imported)."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python3 -m kvpool.sim.calibrate", description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=_positive_int, default=20, help="timed runs per figure; the best counts")
    parser.add_argument("--buffer-mib", type=_positive_int, default=512, help="size of the fp32 tensor torch.sum reads")
    parser.add_argument(
        "--processes", type=_positive_int, default=8, help="fresh processes to measure in (1: this one)"
    )
    parser.add_argument(
        "--fit",
        default=None,
        metavar="NAME|FILE",
        help="instead: fit the GPU cost model to a measurement file (shipped: h200-issue31) and print the fit",
    )
    parser.add_argument("--json", action="store_true", help="--fit: the fit as one JSON object")
    args = parser.parse_args(argv)
    try:
        _run(parser, args)
    except KeyboardInterrupt:  # (a traceback was all a Ctrl-C printed, status -2)
        print(f"{parser.prog}: interrupted", file=sys.stderr)
        raise SystemExit(130) from None


def _run(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.fit is not None:
        from kvpool.sim.gpufit import format_fit, load_fit

        try:
            fit = load_fit(args.fit)
        except ValueError as e:
            parser.error(str(e))
        print(json.dumps(fit.to_json(), indent=2) if args.json else format_fit(fit))
        return
    if args.processes == 1:
        result = calibrate(args.buffer_mib, args.repeats)
    else:
        result = calibrate_processes(args.processes, args.buffer_mib, args.repeats)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
