"""Fused fp32 CPU kernels for the decode path: `cpu.c`, built on first use, loaded with ctypes.

At batch 1 a step is the weight reads of its matmuls plus ~15 small torch ops a layer,
each paying torch's dispatch (`kvpool bench engine --parts glue` times the step's matmuls
and these ops against the kernels; docs/engine.md gives the figures). The kernels fold the
work between two matmuls into one call: residual add + RMSNorm, RoPE in place, the K/V
write into the pool, decode attention straight from the blocks, SiLU * up. Each has a torch twin
(the code that runs without them) and a test that the two agree (tests/test_kernels.py).

Building: the machine's C compiler (`$CC`, else cc / gcc / clang) compiles cpu.c with
-O3 -march=native (FLAGS below) into `$KVPOOL_CACHE_DIR` (default ~/.cache/kvpool), under a name that
hashes the source, the flags, the compiler and the CPU, so a rebuild happens only when one
of them changes. About a second, once per machine. A cached library that does not load is
compiled again, once; a compile is killed after COMPILE_TIMEOUT_S.

KVPOOL_NATIVE selects: "0" never (the torch path), "1" always (an error when they cannot be
built), unset: use them when they build, else warn once and run the torch path.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import os
import platform
import shutil
import signal
import subprocess
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("cpu.c")
# -fno-trapping-math: no code here reads floating-point exception flags, and without it GCC
# will not vectorise a loop holding a float compare or a float -> int conversion.
# -ffp-contract=fast: a * b + c as one FMA (ISO C mode turns that off; it halves the
# latency of every accumulation here and rounds once instead of twice).
# -fopenmp: see cpu.c; a compiler without OpenMP builds the same code single-threaded.
FLAGS = ["-O3", "-march=native", "-fno-trapping-math", "-ffp-contract=fast", "-fPIC", "-shared", "-std=c11"]
OPENMP = ["-fopenmp"]

_p = ctypes.c_void_p
_i = ctypes.c_int64
_f = ctypes.c_float
_SIGNATURES = {
    # name: (restype, argtypes)
    "kv_add_rms_norm": (None, [_p, _p, _p, _p, _i, _i, _f]),
    "kv_head_rms_norm": (None, [_p, _i, _i, _i, _i, _i, _p, _p, _f]),
    "kv_rope": (ctypes.c_int, [_p, _i, _i, _i, _i, _p, _p, _p, _i]),
    "kv_write": (ctypes.c_int, [_p, _p, _i, _i, _i, _i, _p, _i, _i, _p, _p]),
    "kv_decode_attention": (ctypes.c_int, [_p, _i, _i, _p, _i, _p, _i, _p, _p, _p, _p, _i, _i, _i, _i, _i, _f, _p, _i]),
    "kv_decode_attention_q8": (
        ctypes.c_int,
        [_p, _i, _i, _p, _i, _p, _i, _p, _p, _p, _p, _p, _p, _i, ctypes.c_int, _p, _p, _p, _i, _i, _i, _i, _i, _i, _f]
        + [_p, _i],
    ),
    "kv_decode_codes": (ctypes.c_int, [_p, _i, ctypes.c_int, _p, _i, _p]),
    "kv_silu_mul": (None, [_p, _p, _i, _i]),
    "kv_row_dots": (None, [_p, _i, _i, _p, _i, _p]),
    "kv_openmp": (ctypes.c_int, []),
}
_ATTENTION_ERRORS = {
    -1: "a block id lies outside the pool",
    -2: "a block table does not cover exactly its context length",
    -3: "out of memory for the score buffer",
    -4: "a query row lies outside q, or the rows are not strictly increasing",
    -5: "a tail slot lies outside the tails, or the code kind or scale layout is unknown",
}
# the code kinds of kv_decode_attention_q8
Q8_KINDS = {torch.int8: 0, torch.float8_e4m3fn: 1, torch.float8_e5m2: 2}


class KernelBuildError(RuntimeError):
    pass


def _compiler() -> str:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return name
    raise KernelBuildError("no C compiler found (set CC, or install gcc)")


def _cpu_id() -> str:
    """The CPU's model and feature flags: -march=native code is only valid on such a CPU."""
    try:
        text = Path("/proc/cpuinfo").read_text()
        # x86: model name / flags; ARM: Features / CPU implementer / CPU part
        keys = ("model name", "flags", "Features", "CPU implementer", "CPU part", "CPU architecture")
        lines = [ln for ln in text.splitlines() if ln.startswith(keys)]
        return "\n".join(sorted(set(lines)))
    except OSError:
        return platform.processor() or platform.machine()


# A compile takes ~1 s (~5 s at load 8 on 2 cores); a compiler that has not finished in this
# long is hung (a wrapper waiting on a licence server, a stuck NFS include), and kvpool's first
# use of the kernels waited for it without end. Its whole process group is killed.
COMPILE_TIMEOUT_S = 120.0


def _run(cmd: list[str], timeout_s: float) -> subprocess.CompletedProcess:
    """`cmd` with its output captured; KernelBuildError once it has run `timeout_s`. In its
    own session, so that the kill reaches cc1 and as too: subprocess.run's timeout kills the
    driver alone, then waits for the pipes its children still hold open. Killed too when the
    wait is interrupted (Ctrl-C: the terminal's SIGINT does not reach another session)."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise KernelBuildError(f"`{' '.join(cmd[:2])} ...` did not finish in {timeout_s:g} s: killed") from None
    except BaseException:  # Ctrl-C: in its own session the compiler gets no SIGINT from the terminal
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def build(cache_dir: str | Path | None = None, rebuild: bool = False) -> Path:
    """Compile cpu.c (once per source / compiler / CPU) and return the shared library's path;
    `rebuild` compiles again over a library that is there (one that does not load)."""
    cc = _compiler()
    version = _run([cc, "--version"], COMPILE_TIMEOUT_S).stdout
    source = SOURCE.read_bytes()
    key = hashlib.sha256(b"\0".join([source, " ".join(FLAGS + OPENMP).encode(), version.encode(), _cpu_id().encode()]))
    root = Path(cache_dir or os.environ.get("KVPOOL_CACHE_DIR") or Path.home() / ".cache" / "kvpool")
    target = root / f"kvpool_cpu_{key.hexdigest()[:16]}.so"
    if target.exists() and not rebuild:
        return target
    root.mkdir(parents=True, exist_ok=True)
    # Compile to a private name, then rename: concurrent builders never load a half-written file.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=root)
    os.close(fd)
    try:
        cmd = [cc, *FLAGS, *OPENMP, "-o", tmp, str(SOURCE), "-lm"]
        with_omp = _run(cmd, COMPILE_TIMEOUT_S)
        if with_omp.returncode != 0:  # no OpenMP here (clang without libomp): one thread
            plain = _run([cc, *FLAGS, "-Wno-unknown-pragmas", "-o", tmp, str(SOURCE), "-lm"], COMPILE_TIMEOUT_S)
            if plain.returncode != 0:
                raise KernelBuildError(
                    f"{cc} failed to build {SOURCE.name}:\n{plain.stderr.strip()}\n"
                    f"(with {' '.join(OPENMP)}:\n{with_omp.stderr.strip()})"
                )
        os.chmod(tmp, 0o755)  # mkstemp made it private; a shared cache dir serves other users too
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def _check(t: torch.Tensor, name: str) -> None:
    if t.dtype != torch.float32 or t.device.type != "cpu":
        raise TypeError(f"{name} must be a float32 CPU tensor, got {t.dtype} on {t.device}")
    if t.stride(-1) != 1:
        raise ValueError(f"{name} must have a contiguous last dimension, got strides {t.stride()}")


def _check_index(t: torch.Tensor, name: str) -> None:
    if t.dtype != torch.int64 or t.device.type != "cpu" or not t.is_contiguous() or t.dim() != 1:
        raise TypeError(
            f"{name} must be a contiguous 1-D int64 CPU tensor, got {t.dtype} {tuple(t.shape)} on {t.device}"
        )


def _check_pool(k_cache: torch.Tensor, v_cache: torch.Tensor, kvh: int, d: int) -> tuple[int, int]:
    """One layer's pool: k_cache [num_blocks, kvh, d, bs], v_cache [num_blocks, kvh, bs, d], contiguous
    fp32 CPU. Returns (num_blocks, bs)."""
    for t, name in ((k_cache, "k_cache"), (v_cache, "v_cache")):
        _check(t, name)
    if k_cache.dim() != 4:
        raise ValueError(f"the pools must be 4-D, got {tuple(k_cache.shape)}")
    num_blocks, _, _, bs = k_cache.shape
    if k_cache.shape != (num_blocks, kvh, d, bs) or v_cache.shape != (num_blocks, kvh, bs, d):
        raise ValueError(
            f"pool shapes {tuple(k_cache.shape)} / {tuple(v_cache.shape)} do not fit {kvh} KV heads of {d}"
        )
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("k_cache and v_cache must be contiguous")
    return num_blocks, bs


def _check_decode_batch(
    q: torch.Tensor,
    rows: torch.Tensor,
    indptr: torch.Tensor,
    blocks: torch.Tensor,
    ctx_lens: torch.Tensor,
    out: torch.Tensor,
    kvh: int,
) -> None:
    """The query side both decode kernels share: q / out [N, H, D] fp32 with unit head stride
    and H a multiple of kvh; rows / ctx_lens [B], indptr [B + 1], blocks [nnz]: int64. q is
    already known to be 3-D."""
    for t, name in ((q, "q"), (out, "out")):
        _check(t, name)
    for t, name in ((rows, "rows"), (indptr, "indptr"), (blocks, "blocks"), (ctx_lens, "ctx_lens")):
        _check_index(t, name)
    _, h, d = q.shape
    b = rows.shape[0]
    if out.shape != q.shape or q.stride(1) != d or out.stride(1) != d or h % kvh:
        raise ValueError(f"q {tuple(q.shape)} / out {tuple(out.shape)} do not fit {kvh} KV heads of {d}")
    if indptr.shape != (b + 1,) or ctx_lens.shape != (b,) or blocks.dim() != 1:
        raise ValueError(f"indptr {tuple(indptr.shape)} / ctx_lens {tuple(ctx_lens.shape)} do not match {b} rows")


def _run_decode(
    kernel: Callable[..., int],
    q: torch.Tensor,
    rows: torch.Tensor,
    indptr: torch.Tensor,
    blocks: torch.Tensor,
    ctx_lens: torch.Tensor,
    pool_args: tuple[object, ...],
    num_blocks: int,
    kvh: int,
    bs: int,
    scale: float,
    out: torch.Tensor,
) -> torch.Tensor:
    """Call one of the decode kernels, which share their calling convention: the batch (q,
    q_row_stride, num_rows, rows, num_seqs, indptr, nnz, blocks, ctx_lens), then the kernel's
    own pool arguments, then the pool's geometry, the scale and out. Raises on its error code."""
    _, h, d = q.shape
    rc = kernel(
        q.data_ptr(),
        q.stride(0),
        q.shape[0],
        rows.data_ptr(),
        rows.shape[0],
        indptr.data_ptr(),
        blocks.shape[0],
        blocks.data_ptr(),
        ctx_lens.data_ptr(),
        *pool_args,
        num_blocks,
        h,
        kvh,
        d,
        bs,
        scale,
        out.data_ptr(),
        out.stride(0),
    )
    if rc != 0:
        raise ValueError(f"decode attention: {_ATTENTION_ERRORS.get(rc, f'error {rc}')}")
    return out


class CpuKernels:
    """The loaded library. Methods take torch tensors (shapes in each docstring) and check
    dtype, device and layout; the C side checks every index it follows into the pool.

    `lib` holds the typed C functions themselves, for hot loops that validated their
    buffers once (the model's fused forward, the runner's attend): a check costs ~0.1-0.5 us
    per tensor attribute, several times the work of a batch-1 call."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        lib = ctypes.CDLL(str(path))
        for name, (restype, argtypes) in _SIGNATURES.items():
            fn = getattr(lib, name)
            fn.restype = restype
            fn.argtypes = argtypes
        self.lib = lib
        self.openmp = bool(lib.kv_openmp())  # built with -fopenmp: large calls use torch's thread pool

    def add_rms_norm(
        self, x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, out: torch.Tensor, eps: float
    ) -> torch.Tensor:
        """x [N, hidden] += delta [N, hidden] (in place, when given); out [N, hidden] = RMSNorm(x) * weight.
        All contiguous; out may not alias x."""
        for t, name in ((x, "x"), (weight, "weight"), (out, "out")) + (
            ((delta, "delta"),) if delta is not None else ()
        ):
            _check(t, name)
            if not t.is_contiguous():
                raise ValueError(f"{name} must be contiguous")
        n, hidden = x.shape
        if out.shape != x.shape or weight.shape != (hidden,) or (delta is not None and delta.shape != x.shape):
            raise ValueError(
                f"shapes do not match: x {tuple(x.shape)}, weight {tuple(weight.shape)}, out {tuple(out.shape)}"
            )
        dptr = delta.data_ptr() if delta is not None else None
        self.lib.kv_add_rms_norm(x.data_ptr(), dptr, weight.data_ptr(), out.data_ptr(), n, hidden, eps)
        return out

    def head_rms_norm(
        self, x: torch.Tensor, q_heads: int, k_heads: int, head_dim: int, wq: torch.Tensor, wk: torch.Tensor, eps: float
    ) -> None:
        """RMSNorm in place over each head of the first q_heads + k_heads heads of each row of
        x [N, >= (q_heads + k_heads) * head_dim] (rows may be strided): the first q_heads
        scaled by wq [head_dim], the next k_heads by wk [head_dim] (Qwen3's q / k norms)."""
        _check(x, "x")
        for t, name in ((wq, "wq"), (wk, "wk")):
            _check(t, name)
            if not t.is_contiguous() or t.shape != (head_dim,):
                raise ValueError(f"{name} must be a contiguous [{head_dim}], got {tuple(t.shape)}")
        if x.dim() != 2 or x.stride(1) != 1 or x.shape[1] < (q_heads + k_heads) * head_dim:
            raise ValueError(f"x {tuple(x.shape)} does not hold {q_heads + k_heads} heads of {head_dim} in its rows")
        self.lib.kv_head_rms_norm(
            x.data_ptr(), x.shape[0], x.stride(0), q_heads, k_heads, head_dim, wq.data_ptr(), wk.data_ptr(), eps
        )

    def rope(
        self,
        x: torch.Tensor,
        num_heads: int,
        head_dim: int,
        positions: torch.Tensor,
        cos: torch.Tensor,
        sin_signed: torch.Tensor,
    ) -> None:
        """Rotate-half RoPE in place on the first num_heads heads of each row of x [N, >= num_heads * head_dim]
        (rows may be strided). positions [N] int64; cos / sin_signed [max_position, head_dim] ([-sin | sin])."""
        _check(x, "x")
        _check_index(positions, "positions")
        if x.dim() != 2 or head_dim <= 0 or head_dim % 2:
            raise ValueError(f"x must be 2-D [N, row] and head_dim even, got {tuple(x.shape)} and {head_dim}")
        for t, name in ((cos, "cos"), (sin_signed, "sin_signed")):
            _check(t, name)
            if not t.is_contiguous() or t.dim() != 2 or t.shape[1] != head_dim:
                raise ValueError(f"{name} must be a contiguous [max_position, {head_dim}] table")
        n = x.shape[0]
        if x.shape[1] < num_heads * head_dim or positions.shape != (n,):
            raise ValueError(
                f"x {tuple(x.shape)} / positions {tuple(positions.shape)} do not hold {num_heads} heads of {head_dim}"
            )
        if sin_signed.shape != cos.shape:
            raise ValueError(f"cos {tuple(cos.shape)} and sin_signed {tuple(sin_signed.shape)} differ")
        rc = self.lib.kv_rope(
            x.data_ptr(),
            n,
            x.stride(0),
            num_heads,
            head_dim,
            positions.data_ptr(),
            cos.data_ptr(),
            sin_signed.data_ptr(),
            cos.shape[0],
        )
        if rc != 0:
            raise ValueError(f"a position lies outside the RoPE table [0, {cos.shape[0]}): {positions.tolist()}")

    def write_kv(
        self, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor
    ) -> None:
        """Store k / v [N, KVH, D] (rows may be strided, same stride for both) at slots [N] int64
        (block * bs + offset) of one layer's k_cache [num_blocks, KVH, D, bs] and v_cache [num_blocks, KVH, bs, D]."""
        for t, name in ((k, "k"), (v, "v")):
            _check(t, name)
        _check_index(slots, "slots")
        if k.dim() != 3:
            raise ValueError(f"k / v must be [N, KVH, D], got {tuple(k.shape)}")
        n, kvh, d = k.shape
        if v.shape != k.shape or k.stride() != v.stride() or k.stride(1) != d or slots.shape != (n,):
            raise ValueError(f"k {tuple(k.shape)} / v {tuple(v.shape)} / slots {tuple(slots.shape)} do not match")
        num_blocks, bs = _check_pool(k_cache, v_cache, kvh, d)
        rc = self.lib.kv_write(
            k.data_ptr(),
            v.data_ptr(),
            n,
            k.stride(0),
            kvh,
            d,
            slots.data_ptr(),
            bs,
            num_blocks,
            k_cache.data_ptr(),
            v_cache.data_ptr(),
        )
        if rc != 0:
            raise ValueError(f"a slot lies outside the pool of {num_blocks} blocks of {bs}: {slots.tolist()}")

    def decode_attention(
        self,
        q: torch.Tensor,
        rows: torch.Tensor,
        indptr: torch.Tensor,
        blocks: torch.Tensor,
        ctx_lens: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        scale: float,
        out: torch.Tensor,
    ) -> torch.Tensor:
        """One query per sequence: rows[b] of q [N, H, D] and out [N, H, D] (rows may be strided),
        sequence b's blocks blocks[indptr[b]:indptr[b + 1]] cover keys [0, ctx_lens[b]).
        rows / ctx_lens [B], indptr [B + 1], blocks [nnz]: int64. Pool as in write_kv."""
        if q.dim() != 3 or k_cache.dim() != 4:
            raise ValueError(f"q must be [N, H, D] and the pools 4-D, got {tuple(q.shape)}, {tuple(k_cache.shape)}")
        d = q.shape[2]
        kvh = k_cache.shape[1]
        num_blocks, bs = _check_pool(k_cache, v_cache, kvh, d)
        _check_decode_batch(q, rows, indptr, blocks, ctx_lens, out, kvh)
        pool_args = (k_cache.data_ptr(), v_cache.data_ptr())
        return _run_decode(
            self.lib.kv_decode_attention, q, rows, indptr, blocks, ctx_lens, pool_args, num_blocks, kvh, bs, scale, out
        )

    def decode_attention_q8(
        self,
        q: torch.Tensor,
        rows: torch.Tensor,
        indptr: torch.Tensor,
        blocks: torch.Tensor,
        ctx_lens: torch.Tensor,
        k_codes: torch.Tensor,
        v_codes: torch.Tensor,
        k_scales: torch.Tensor,
        v_scales: torch.Tensor,
        tails: torch.Tensor,
        tail_k: torch.Tensor,
        tail_v: torch.Tensor,
        scale: float,
        out: torch.Tensor,
    ) -> torch.Tensor:
        """decode_attention over one layer of 8-bit quantized blocks: codes k [num_blocks, KVH,
        D, bs] and v [num_blocks, KVH, bs, D] (int8 / float8_e4m3fn / float8_e5m2), fp32
        scales [num_blocks, KVH, bs or 1]; tails [B] int64: the tail slot of tail_k [T, KVH,
        D, bs] / tail_v [T, KVH, bs, D] (fp32) holding sequence b's last block, or -1."""
        for t, name in ((k_scales, "k_scales"), (v_scales, "v_scales")):
            _check(t, name)
        _check_index(tails, "tails")
        kind = Q8_KINDS.get(k_codes.dtype)
        if kind is None or v_codes.dtype != k_codes.dtype:
            raise ValueError(f"codes must be int8 / float8_e4m3fn / float8_e5m2, got {k_codes.dtype}, {v_codes.dtype}")
        if q.dim() != 3 or k_codes.dim() != 4:
            raise ValueError(f"q must be [N, H, D] and the pools 4-D, got {tuple(q.shape)}, {tuple(k_codes.shape)}")
        d = q.shape[2]
        num_blocks, kvh, _, bs = k_codes.shape
        if k_codes.shape != (num_blocks, kvh, d, bs) or v_codes.shape != (num_blocks, kvh, bs, d):
            raise ValueError(f"code pools {tuple(k_codes.shape)} / {tuple(v_codes.shape)} do not hold heads of {d}")
        spb = k_scales.shape[-1]
        if k_scales.shape != (num_blocks, kvh, spb) or v_scales.shape != k_scales.shape or spb not in (1, bs):
            raise ValueError(f"scales {tuple(k_scales.shape)} / {tuple(v_scales.shape)} do not fit the pool")
        num_tails = tail_k.shape[0]
        for t, name in ((tail_k, "tail_k"), (tail_v, "tail_v")):
            if num_tails:
                _check(t, name)
        if tail_k.shape[1:] != (kvh, d, bs) or tail_v.shape != (num_tails, kvh, bs, d):
            raise ValueError(f"tails {tuple(tail_k.shape)} / {tuple(tail_v.shape)} do not fit the pool")
        if not all(t.is_contiguous() for t in (k_codes, v_codes, k_scales, v_scales, tail_k, tail_v)):
            raise ValueError("the code pools, scales and tails must be contiguous")
        _check_decode_batch(q, rows, indptr, blocks, ctx_lens, out, kvh)
        if tails.shape != rows.shape:
            raise ValueError(f"tails {tuple(tails.shape)} do not match {rows.shape[0]} rows")
        pool_args = (
            k_codes.data_ptr(),
            v_codes.data_ptr(),
            k_scales.data_ptr(),
            v_scales.data_ptr(),
            spb,
            kind,
            tails.data_ptr(),
            tail_k.data_ptr() if num_tails else None,
            tail_v.data_ptr() if num_tails else None,
            num_tails,
        )
        return _run_decode(
            self.lib.kv_decode_attention_q8,
            q,
            rows,
            indptr,
            blocks,
            ctx_lens,
            pool_args,
            num_blocks,
            kvh,
            bs,
            scale,
            out,
        )

    def decode_codes(self, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        """The kernels' 8-bit decoding on its own (a test hook): codes [n] int8 / float8_e4m3fn
        / float8_e5m2 times scales ([n], or [1] for one) -> [n] fp32."""
        kind = Q8_KINDS.get(codes.dtype)
        if kind is None or codes.dim() != 1 or not codes.is_contiguous():
            raise ValueError(f"codes must be a contiguous 1-D int8 / fp8 tensor, got {codes.dtype}")
        _check(scales, "scales")
        if scales.shape not in ((1,), codes.shape):
            raise ValueError(f"scales {tuple(scales.shape)} must be [1] or [{codes.shape[0]}]")
        out = torch.empty(codes.shape, dtype=torch.float32)
        step = 0 if scales.shape == (1,) and codes.shape != (1,) else 1
        self.lib.kv_decode_codes(codes.data_ptr(), codes.shape[0], kind, scales.data_ptr(), step, out.data_ptr())
        return out

    def silu_mul(self, gate_up: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """out [N, I] = silu(gate) * up, gate_up [N, 2 I] = [gate | up] per row; both contiguous."""
        _check(gate_up, "gate_up")
        _check(out, "out")
        n, inter = out.shape
        if gate_up.shape != (n, 2 * inter) or not (gate_up.is_contiguous() and out.is_contiguous()):
            raise ValueError(
                f"gate_up {tuple(gate_up.shape)} / out {tuple(out.shape)} must be contiguous [N, 2I] / [N, I]"
            )
        self.lib.kv_silu_mul(gate_up.data_ptr(), out.data_ptr(), n, inter)
        return out

    def row_dots(self, x: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """out [M, V] = x [M, H] @ w [V, H]^T: w row-major (an embedding used as the LM head);
        all three contiguous fp32."""
        for t, name in ((x, "x"), (w, "w"), (out, "out")):
            _check(t, name)
        m, hidden = x.shape
        vocab = w.shape[0]
        if w.shape != (vocab, hidden) or out.shape != (m, vocab):
            raise ValueError(
                f"x {tuple(x.shape)}, w {tuple(w.shape)}, out {tuple(out.shape)}: need [M, H], [V, H], [M, V]"
            )
        if not (x.is_contiguous() and w.is_contiguous() and out.is_contiguous()):
            raise ValueError("row_dots needs contiguous x, w and out")
        self.lib.kv_row_dots(x.data_ptr(), m, hidden, w.data_ptr(), vocab, out.data_ptr())
        return out


def _load_fresh(path: Path) -> CpuKernels:
    """The library at `path` loaded from a copy under a name this process has not loaded:
    dlopen of a path already loaded returns the loaded object (ctypes never closes one), so a
    rebuilt library that replaced one missing a symbol was never read, and failed the same way.
    The copy is removed once loaded (the loaded mapping stays)."""
    fd, fresh = tempfile.mkstemp(suffix=".so", prefix=f"{path.stem}.load-", dir=path.parent)
    os.close(fd)
    try:
        shutil.copyfile(path, fresh)
        kernels = CpuKernels(fresh)
    finally:
        os.unlink(fresh)
    kernels.path = path
    return kernels


@functools.cache
def _load_or_error() -> CpuKernels | KernelBuildError:
    """The kernels, or why not. A cached library that does not load (truncated or damaged on
    disk: dlopen's "file too short", "invalid ELF header"; a symbol missing) is compiled
    again once: it was never rebuilt, and every start warned until someone deleted it. One
    missing a symbol was loaded, so the rebuilt one is loaded from a fresh name (_load_fresh)."""
    try:
        path = build()
        try:
            return CpuKernels(path)
        except (OSError, AttributeError) as first:
            path = build(rebuild=True)
            try:
                return _load_fresh(path) if isinstance(first, AttributeError) else CpuKernels(path)
            except (OSError, AttributeError) as second:
                return KernelBuildError(
                    f"cannot load the CPU kernels at {path}, rebuilt once after it failed to load ({first}): {second}"
                )
    except (KernelBuildError, OSError) as e:
        return e if isinstance(e, KernelBuildError) else KernelBuildError(f"cannot build the CPU kernels: {e}")


def cpu_kernels() -> CpuKernels | None:
    """The kernels, built and loaded once per process, or None when KVPOOL_NATIVE=0 or (unset)
    when they cannot be built (with one warning). KVPOOL_NATIVE=1 turns that failure into an error."""
    mode = os.environ.get("KVPOOL_NATIVE", "")
    if mode not in ("", "0", "1"):
        raise ValueError(f"KVPOOL_NATIVE must be 0, 1 or unset, got {mode!r}")
    if mode == "0":
        return None
    loaded = _load_or_error()
    if isinstance(loaded, KernelBuildError):
        if mode == "1":
            raise loaded
        _warn_once(str(loaded))
        return None
    return loaded


@functools.cache
def _warn_once(message: str) -> None:
    warnings.warn(f"kvpool runs the torch path: {message}", RuntimeWarning, stacklevel=3)
