"""GPU presets for capacity planning: memory bytes and HBM bandwidth.

`memory_bytes` is the device memory as `nvidia-smi --query-gpu=memory.total` reports it
(MiB x 2**20), not the marketing figure in decimal GB: H100 "80 GB" shows 81,559 MiB, H200
"141 GB" 143,771 MiB, B200 "192 GB" (HBM3e, 180 GB usable in the DGX B200 data sheet)
183,359 MiB. The CUDA context and library handles come out of this figure; the peak
ledger (`kvpool.capacity.ledger`) counts them as their own line, so no fudge factor hides
them here. Bandwidth is the SXM data-sheet HBM figure in bytes per second.

Peak FLOPs are the data-sheet figures, dense (without 2:4 sparsity), per GPU: the roofline
of `kvpool.sim.cost` divides a step's FLOPs by them.
| GPU | BF16 tensor | FP8 tensor | FP32 (CUDA cores) | source |
|---|---|---|---|---|
| H100 SXM | 989 TFLOPS | 1,979 TFLOPS | 67 TFLOPS | H100 data sheet (its BF16 1,979 / FP8 3,958: sparse) |
| H200 SXM | 989 TFLOPS | 1,979 TFLOPS | 67 TFLOPS | H200 data sheet: Hopper's compute, more HBM |
| B200 | 2.25 PFLOPS | 4.5 PFLOPS | 75 TFLOPS | DGX / HGX B200: 72 PF FP8, 36 PF BF16 sparse / 8 GPUs / 2 |

NVLink, for the tensor-parallel all-reduces of `kvpool.sim.cost`: the figure per GPU in each
direction (what a ring all-reduce step sends while it receives as much), half the vendor's
bidirectional figure, and the GPUs one NVLink domain (a node) holds:
| GPU | NVLink | per direction | GPUs per node | source |
|---|---|---|---|---|
| H100 SXM | NVLink 4, 900 GB/s bidirectional | 450 GB/s | 8 | H100 data sheet (HGX H100 8-GPU) |
| H200 SXM | NVLink 4, 900 GB/s bidirectional | 450 GB/s | 8 | H200 data sheet (HGX H200 8-GPU) |
| B200 | NVLink 5, 1.8 TB/s bidirectional | 900 GB/s | 8 | DGX / HGX B200 data sheet |
`nvlink_latency_s` is the time one step of a ring takes beyond its bytes (launch, the
NVSwitch hop, the handshake): 1 us, an assumption (neither a vendor figure nor measured
here) that puts a small all-reduce over 8 GPUs, a ring of 14 steps, at 14 us; a
calibration on a real node should replace it.
`layer_fixed_s` is the GPU time each layer of each step costs beyond its bytes and FLOPs at
the efficiencies' rates, whether the step replays a CUDA graph or not: a layer runs ten or so
kernels one after another, and each boundary costs a few microseconds that no roofline
holds (the next kernel's launch from the graph or the stream, its prologue and the
previous one's tail while part of the SMs idle, small kernels, norms, activations, rotary,
that never reach the bandwidth). It is read from issue 31's H200 measurement of a
Llama-3.1-8B bf16 decode at batch 1 replayed from a CUDA graph (4.71 ms), a bare forward
with no scheduler or sampler, so its host share is one graph launch (taken as 0): its
15.14 GB (the weights the step reads and 1,024 tokens of KV) at the run's own measured
copy bandwidth, 4.28 TB/s, take 3.54 ms, leaving 1.17 ms over 32 layers, 36.6 us a layer
(`kvpool.sim.gpufit.derive_layer_fixed_s` computes it from the shipped file). The bytes at
the copy's rate is the best a batch-1 GEMV streams, so 36.6 us is what the gap leaves at
least. H100 is the same chip (GH100) with less HBM and takes the figure; B200 takes it
too, unmeasured (a Blackwell measurement should replace it). 0 for a custom GPU or a CPU.

A GPU without a figure (a custom GPU, `cpu_device()`) carries NaN, "unknown": inf would
make compute free and 0 infinitely slow, so the cost model refuses NaN with a ValueError.

`cpu_preset()` is the machine kvpool's own CPU engine was calibrated on, with the read
bandwidth and fp32 matmul FLOPs that `python3 -m kvpool.sim.calibrate` measured there.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

MIB = 1 << 20
GIB = 1 << 30
PRECISIONS: tuple[str, ...] = ("bf16", "fp8", "fp32")


@dataclass(frozen=True)
class GPUSpec:
    name: str
    memory_bytes: int
    hbm_bandwidth_bytes_per_s: float
    kind: str = "cuda"  # "cuda", or "cpu": this machine's RAM, for kvpool's own CPU engine
    # Dense peak FLOPs per second by math precision; NaN = unknown (see the module docstring).
    peak_bf16_flops: float = math.nan
    peak_fp8_flops: float = math.nan
    peak_fp32_flops: float = math.nan
    # NVLink per GPU and direction, a ring step's latency, GPUs per node (module docstring)
    nvlink_bytes_per_s: float = math.nan
    nvlink_latency_s: float = math.nan
    gpus_per_node: int = 8
    # GPU time every layer of every step costs beyond its bytes and FLOPs (module docstring)
    layer_fixed_s: float = 0.0

    def __post_init__(self) -> None:
        if self.memory_bytes <= 0:
            raise ValueError(f"memory_bytes must be positive, got {self.memory_bytes}")
        if self.hbm_bandwidth_bytes_per_s <= 0:
            raise ValueError(f"hbm_bandwidth_bytes_per_s must be positive, got {self.hbm_bandwidth_bytes_per_s}")
        for precision in PRECISIONS:
            value = getattr(self, f"peak_{precision}_flops")
            if not (math.isnan(value) or value > 0):
                raise ValueError(f"peak_{precision}_flops must be positive or NaN (unknown), got {value}")
        for field in ("nvlink_bytes_per_s", "nvlink_latency_s"):
            value = getattr(self, field)
            if not (math.isnan(value) or value >= 0):
                raise ValueError(f"{field} must be >= 0 or NaN (unknown), got {value}")
        if not self.layer_fixed_s >= 0:
            raise ValueError(f"layer_fixed_s must be >= 0, got {self.layer_fixed_s}")
        if self.gpus_per_node < 1:
            raise ValueError(f"gpus_per_node must be >= 1, got {self.gpus_per_node}")

    def peak_flops(self, precision: str) -> float:
        """Dense peak FLOPs per second at `precision` ("bf16", "fp8", "fp32"); ValueError
        when the figure is unknown, so that no step time is ever computed from a guess."""
        if precision not in PRECISIONS:
            raise ValueError(f"unknown precision {precision!r}; known: {', '.join(PRECISIONS)}")
        value = getattr(self, f"peak_{precision}_flops")
        if math.isnan(value):
            raise ValueError(
                f"GPU {self.name} has no {precision} FLOPs figure (peak_{precision}_flops is unknown); "
                "give it one to compute step times"
            )
        return value

    @property
    def memory_gib(self) -> float:
        return self.memory_bytes / GIB


# NVLink 4 (H100, H200): 900 GB/s bidirectional per GPU; NVLink 5 (B200): 1.8 TB/s (module docstring).
_NVLINK4 = {"nvlink_bytes_per_s": 450e9, "nvlink_latency_s": 1e-6}
_NVLINK5 = {"nvlink_bytes_per_s": 900e9, "nvlink_latency_s": 1e-6}
# A layer's fixed GPU time per step, from issue 31's H200 batch-1 CUDA-graph decode
# (sim/gpufit.py `derive_layer_fixed_s`, module docstring); H100 and B200 take it too.
LAYER_FIXED_S = 36.6e-6
GPUS: dict[str, GPUSpec] = {
    "H100": GPUSpec(
        "H100",
        81_559 * MIB,
        3.35e12,
        peak_bf16_flops=989e12,
        peak_fp8_flops=1979e12,
        peak_fp32_flops=67e12,
        layer_fixed_s=LAYER_FIXED_S,
        **_NVLINK4,
    ),
    "H200": GPUSpec(
        "H200",
        143_771 * MIB,
        4.8e12,
        peak_bf16_flops=989e12,
        peak_fp8_flops=1979e12,
        peak_fp32_flops=67e12,
        layer_fixed_s=LAYER_FIXED_S,
        **_NVLINK4,
    ),
    "B200": GPUSpec(
        "B200",
        183_359 * MIB,
        8.0e12,
        peak_bf16_flops=2.25e15,
        peak_fp8_flops=4.5e15,
        peak_fp32_flops=75e12,
        layer_fixed_s=LAYER_FIXED_S,
        **_NVLINK5,
    ),
}


def get_gpu(name: str) -> GPUSpec:
    """The preset named `name` (case-insensitive: "h200", "H200")."""
    for key, spec in GPUS.items():
        if key.lower() == name.lower():
            return spec
    raise ValueError(f"unknown GPU {name!r}; known: {', '.join(sorted(GPUS))}")


def custom_gpu(memory_gib: float, name: str | None = None) -> GPUSpec:
    """A GPU of `memory_gib` GiB (for --memory-gib). Its bandwidth is unknown and set to inf:
    bandwidth does not enter the capacity plan, and inf invents no number."""
    if not memory_gib > 0:
        raise ValueError(f"memory_gib must be positive, got {memory_gib}")
    memory_bytes = memory_gib * GIB
    # a finite GiB figure can still overflow to inf bytes (int(inf) raised OverflowError)
    # or round down to no byte at all
    if not math.isfinite(memory_bytes):
        raise ValueError(f"{memory_gib:g} GiB is more bytes than a number can count")
    if memory_bytes < 1:
        raise ValueError(f"{memory_gib:g} GiB is less than one byte")
    return GPUSpec(name or f"{memory_gib:g} GiB", int(memory_bytes), float("inf"))


def cpu_device() -> GPUSpec:
    """This machine as a device: its physical memory (sysconf, as /proc/meminfo MemTotal
    reports it), for the ledger of kvpool's CPU engine. Bandwidth unknown: inf."""
    import os

    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError) as e:
        raise ValueError(f"cannot read this machine's memory size: {e}") from e
    return GPUSpec(f"cpu ({os.cpu_count()} cores)", int(memory), float("inf"), kind="cpu")


# The machine kvpool's CPU engine was calibrated on: `python3 -m kvpool.sim.calibrate
# --processes 12 --repeats 20`, 2026-12-02, a 2-vCPU AMD EPYC VM (torch 2.13 CPU, 2 threads).
# Each figure is the median over 12 fresh processes of each process's best of 20 runs.
CPU_PRESET_MEMORY_BYTES = 25_276_502_016  # MemTotal 24,684,084 kB
CPU_PRESET_READ_BANDWIDTH = 33.2e9  # torch.sum over 512 MiB fp32; best process 44.1e9 (54e9 seen once)
CPU_PRESET_FP32_FLOPS = 179e9  # [256 x 576] @ [576 x 1536] fp32; best process 188e9


def cpu_preset() -> GPUSpec:
    """The 2-vCPU AMD EPYC VM the simulator's CPU figures were measured on, 2026-12-02, by

        python3 -m kvpool.sim.calibrate --processes 12 --repeats 20

    read bandwidth 33.2 GB/s (torch.sum over a 512 MiB fp32 tensor) and fp32 matmul
    179 GFLOP/s ([256 x 576] @ [576 x 1536], a 256-token step through SmolLM2-135M's MLP;
    a [2048]^3 square product measured 178 GFLOP/s), each the median over 12 fresh
    processes of each one's best of 20 runs, with torch's default 2 threads. The median,
    not the best, because on this VM the bandwidth is a property of the process (where its
    memory lands): 30-34 GB/s in most processes, 44-54 GB/s in a few, steady within one.
    The matmul figure is close to the two cores' FMA peak (2 x 32 FLOP/cycle at ~3 GHz).
    Constants, not a live measurement, so that simulations repeat exactly; the engine runs
    fp32 weights and KV, so only the fp32 FLOPs figure is known (bf16 / fp8: NaN)."""
    return GPUSpec(
        "cpu (2-vCPU AMD EPYC, calibrated 2026-12-02)",
        CPU_PRESET_MEMORY_BYTES,
        CPU_PRESET_READ_BANDWIDTH,
        kind="cpu",
        peak_fp32_flops=CPU_PRESET_FP32_FLOPS,
    )
