"""The running engine's memory, term by term, next to the peak the OS measured.

The terms are those of the planner's ledger (capacity/ledger.py), each measured where it is
allocated:
  weights     every weight tensor the model holds (`LlamaModel.weight_bytes`)
  kv_pool     the K/V tensors (`PagedKVStorage.num_bytes`), their quantization scales (none
              unquantized), the largest
              step's block tables and slot mapping as tensors, and the cache manager's
              Python structures when measured: refcounts, free queues, prefix index,
              per-request tables and token ids (`metadata_bytes`, sys.getsizeof)
  workspace   the largest step's buffers: the forward's step buffers (`step_buffer_bytes`)
              and attention output, the logits tensor, the largest scratch a sampler call
              held (`scratch_peak_bytes`), a quantized pool's dequantization scratch
              (`kv_dequant`: one layer of the pool in the compute dtype), and on CUDA the
              decode graphs' memory pool (`graph_pool`, `graph_logits`: their outputs)
  transient   the largest step's copy-on-write staging (the source blocks' K, then V, of
              every layer) and a prefill chunk's key / value gathers and fp32 SDPA mask
  runtime     the interpreter, torch and the libraries before the model loads (RSS then),
              and the tokenizer (RSS grown while it was built)
On CUDA the peak is `torch.cuda.max_memory_allocated`; on CPU it is the process's peak
resident set (VmHWM), and `unaccounted` is what the terms do not explain: allocator
slack, freed memory not returned to the OS, everything else.
"""

from __future__ import annotations

import os
import resource
import sys
from dataclasses import dataclass, field

from kvpool.spec.gpus import GIB

TERMS = ("weights", "kv_pool", "workspace", "transient", "runtime")


def rss_bytes() -> int:
    """The process's resident set now (Linux /proc; 0 where there is none)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def _proc_kib(path: str, key: str) -> int | None:
    """The `key:` line of a /proc file (a size in KiB) in bytes; None where there is none."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(f"{key}:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def peak_rss_bytes() -> int:
    """The process's peak resident set: VmHWM of /proc/self/status on Linux, the high-water
    mark of this program's own memory. Not getrusage's ru_maxrss there: Linux carries that
    across fork and exec, so a process started by a large one (a test run) reports its
    parent's size. Elsewhere ru_maxrss (KiB on Linux, bytes on macOS)."""
    hwm = _proc_kib("/proc/self/status", "VmHWM")
    if hwm is not None:
        return hwm
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def available_memory_bytes(device: object) -> int | None:
    """Memory a new allocation on `device` can take now: on CUDA the free device memory
    (cudaMemGetInfo), on CPU MemAvailable of /proc/meminfo (free pages plus the cache the
    kernel can drop; sysconf's free pages elsewhere). None where it cannot be told."""
    import torch

    dev = torch.device(device)  # type: ignore[arg-type]
    if dev.type == "cuda":
        return int(torch.cuda.mem_get_info(dev)[0])
    if dev.type != "cpu":
        return None
    available = _proc_kib("/proc/meminfo", "MemAvailable")
    if available is not None:
        return available
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def check_fits(num_bytes: int, device: object, what: str, advice: str = "") -> None:
    """ValueError naming `what` and both sizes when `num_bytes` exceed the memory `device`
    has available: a pool too large for the machine is the user's mistake, told in one line
    before torch tries (on CPU a failed allocation is a long traceback; a pool just under
    the physical memory but over what is free gets the process killed as it is zeroed)."""
    available = available_memory_bytes(device)
    if available is None or num_bytes <= available:
        return
    where = "this machine has" if str(device).startswith("cpu") else f"{device} has"
    raise ValueError(
        f"{what} needs {num_bytes / GIB:.1f} GiB but {where} {available / GIB:.1f} GiB of memory available"
        + (f"; {advice}" if advice else "")
    )


@dataclass
class StepPeaks:
    """The largest bytes any one step allocated, by kind (the runner updates it)."""

    activations: int = 0  # the forward's buffers for the step's tokens, and the attention output
    step_tables: int = 0  # the step's slots and block tables as tensors
    logits: int = 0  # the logits rows the step returns
    cow_staging: int = 0  # copy-on-write: the copied blocks, staged once
    chunked_prefill: int = 0  # a prefill chunk's keys and values gathered for attention (one layer)
    bookkeeping: int = 0  # the cache manager's Python structures, where a harness samples them
    graph_pool: int = 0  # CUDA graphs: their shared pool's segments but the output logits
    graph_logits: int = 0  # CUDA graphs: every bucket's output logits [bucket, vocab], in that pool

    def note(self, kind: str, num_bytes: int) -> None:
        if num_bytes > getattr(self, kind):
            setattr(self, kind, num_bytes)


@dataclass
class MeasuredLedger:
    peak: int  # bytes: peak RSS (CPU) or max_memory_allocated (CUDA)
    peak_source: str
    details: dict[str, dict[str, int]] = field(default_factory=dict)  # term -> line -> bytes
    host: dict[str, int] | None = None  # CUDA: host-memory lines, outside the device peak
    allocator: dict[str, int] | None = None  # CUDA: the caching allocator's peaks (memory_stats)

    @property
    def terms(self) -> dict[str, int]:
        return {term: sum(self.details.get(term, {}).values()) for term in TERMS}

    @property
    def accounted(self) -> int:
        return sum(self.terms.values())

    @property
    def unaccounted(self) -> int:
        return self.peak - self.accounted

    def as_dict(self) -> dict:
        return {
            **self.terms,
            "details": self.details,
            "accounted": self.accounted,
            "peak": self.peak,
            "peak_source": self.peak_source,
            "unaccounted": self.unaccounted,
            "unaccounted_share": round(self.unaccounted / self.peak, 4) if self.peak else 0.0,
            **({"host": self.host} if self.host is not None else {}),
            **({"allocator": self.allocator} if self.allocator is not None else {}),
        }


def runtime_baseline() -> int:
    """The resident set of the interpreter, torch and the engine's libraries, before any
    model: what `runtime` counts (read it first thing, the libraries imported)."""
    import kvpool.engine.build  # noqa: F401  (torch, numpy, the engine: everything but the model)

    return rss_bytes()


def measure(runner, runtime_bytes: int, tokenizer_bytes: int) -> MeasuredLedger:
    """The ledger of a Llama's runner (engine/llama_runner.py) after (or during) a run. Each
    line is its own largest value over the run; the lines need not peak in the same step,
    so their sum can exceed what was alive at the moment of the peak (then `unaccounted`
    reads low).

    On CUDA the peak counts device memory only: the lines that live in host memory (the
    manager's bookkeeping, the sampler's scratch, the runtime) are reported under `host`,
    outside the terms. (No GPU has run this path yet.)"""
    import torch

    from kvpool.engine.sampling import scratch_peak_bytes

    storage, manager, peaks = runner.executor.storage, runner.cache, runner.executor.peaks
    cuda = storage.k.device.type == "cuda"
    peak = torch.cuda.max_memory_allocated() if cuda else peak_rss_bytes()
    tier = getattr(runner, "tier", None)
    host = {
        "host_tier": tier.peak_bytes if tier is not None else 0,
        "bookkeeping": max(peaks.bookkeeping, manager.metadata_bytes()),
        "sampler": scratch_peak_bytes(),
        "interpreter_and_libraries": runtime_bytes,
        "tokenizer": tokenizer_bytes,
    }
    on_host = {k: 0 for k in host} if cuda else host
    ledger = MeasuredLedger(
        peak,
        "torch.cuda.max_memory_allocated" if cuda else "peak RSS (VmHWM)",
        {
            "weights": {"model": runner.model.weight_bytes()},
            "kv_pool": {
                "data": storage.num_bytes - getattr(storage, "scale_bytes", 0),
                "quant_scales": getattr(storage, "scale_bytes", 0),  # scales and zero points (spec/kv_formats.py)
                "block_tables": peaks.step_tables,
                "bookkeeping": on_host["bookkeeping"],
                "host_tier": on_host["host_tier"],  # the host tier's peak (its blocks; in host memory on CUDA)
            },
            "workspace": {
                "activations": peaks.activations,
                "logits": peaks.logits,
                "sampler": on_host["sampler"],
                # a quantized pool's dequantization scratch: one layer of the pool, compute dtype
                **({"kv_dequant": storage.scratch_bytes} if hasattr(storage, "scratch_bytes") else {}),
                # block-scaled / KIVI formats: the full-precision tails of blocks not yet whole
                # (their tensor only grows, so its size now is its peak)
                **({"kv_tails": storage.tail_bytes} if getattr(storage, "tail_bytes", 0) else {}),
                # decode CUDA graphs (captured at build): their pool's segments, held for them
                # whole, and the buckets' output logits in it (no lines without graphs)
                **({"graph_pool": peaks.graph_pool, "graph_logits": peaks.graph_logits} if peaks.graph_logits else {}),
            },
            "transient": {"cow_staging": peaks.cow_staging, "chunked_prefill": peaks.chunked_prefill},
            "runtime": {
                "interpreter_and_libraries": on_host["interpreter_and_libraries"],
                "tokenizer": on_host["tokenizer"],
            },
        },
    )
    if cuda:
        ledger.host = host
        stats = torch.cuda.memory_stats()
        # reserved - allocated at the peak is the allocator's slack (segments it holds)
        ledger.allocator = {
            "allocated_peak": int(stats.get("allocated_bytes.all.peak", 0)),
            "reserved_peak": int(stats.get("reserved_bytes.all.peak", 0)),
            "num_alloc_retries": int(stats.get("num_alloc_retries", 0)),
        }
    return ledger
