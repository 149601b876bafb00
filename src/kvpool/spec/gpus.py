"""GPU presets for capacity planning: memory bytes and HBM bandwidth.

`memory_bytes` is the device memory as `nvidia-smi --query-gpu=memory.total` reports it
(MiB x 2**20), not the marketing figure in decimal GB: H100 "80 GB" shows 81,559 MiB, H200
"141 GB" 143,771 MiB, B200 "192 GB" (HBM3e, 180 GB usable in the DGX B200 data sheet)
183,359 MiB. The CUDA context and library handles come out of this figure; the peak
ledger (`kvpool.capacity.ledger`) counts them as their own line, so no fudge factor hides
them here. Bandwidth is the SXM data-sheet HBM figure in bytes per second.
"""

from __future__ import annotations

from dataclasses import dataclass

MIB = 1 << 20
GIB = 1 << 30


@dataclass(frozen=True)
class GPUSpec:
    name: str
    memory_bytes: int
    hbm_bandwidth_bytes_per_s: float
    kind: str = "cuda"  # "cuda", or "cpu": this machine's RAM, for kvpool's own CPU engine

    def __post_init__(self) -> None:
        if self.memory_bytes <= 0:
            raise ValueError(f"memory_bytes must be positive, got {self.memory_bytes}")
        if self.hbm_bandwidth_bytes_per_s <= 0:
            raise ValueError(f"hbm_bandwidth_bytes_per_s must be positive, got {self.hbm_bandwidth_bytes_per_s}")

    @property
    def memory_gib(self) -> float:
        return self.memory_bytes / GIB


GPUS: dict[str, GPUSpec] = {
    "H100": GPUSpec("H100", 81_559 * MIB, 3.35e12),
    "H200": GPUSpec("H200", 143_771 * MIB, 4.8e12),
    "B200": GPUSpec("B200", 183_359 * MIB, 8.0e12),
}


def get_gpu(name: str) -> GPUSpec:
    """The preset named `name` (case-insensitive: "h200", "H200")."""
    for key, spec in GPUS.items():
        if key.lower() == name.lower():
            return spec
    raise ValueError(f"unknown GPU {name!r}; known: {sorted(GPUS)}")


def custom_gpu(memory_gib: float, name: str | None = None) -> GPUSpec:
    """A GPU of `memory_gib` GiB (for --memory-gib). Its bandwidth is unknown and set to inf:
    bandwidth does not enter the capacity plan, and inf invents no number."""
    if memory_gib <= 0:
        raise ValueError(f"memory_gib must be positive, got {memory_gib}")
    return GPUSpec(name or f"{memory_gib:g} GiB", int(memory_gib * GIB), float("inf"))


def cpu_device() -> GPUSpec:
    """This machine as a device: its physical memory (sysconf, as /proc/meminfo MemTotal
    reports it), for the ledger of kvpool's CPU engine. Bandwidth unknown: inf."""
    import os

    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError) as e:
        raise ValueError(f"cannot read this machine's memory size: {e}") from e
    return GPUSpec(f"cpu ({os.cpu_count()} cores)", int(memory), float("inf"), kind="cpu")
