"""The Triton decode kernels (attention/backends/triton_decode.py) and their backend
(triton_paged.py), run on the CPU by Triton's interpreter, against the torch reference
paths: SDPA on a contiguous copy of each sequence's keys and values, the torch paged
backend, and the pool's torch write.

Without a GPU the kernels run in Triton's interpreter on CPU tensors: Triton reads
TRITON_INTERPRET when a function is decorated with triton.jit (its own helpers at its first
import), so tests/conftest.py sets it before anything imports triton; with a GPU they run
compiled on CUDA tensors.

Tolerances, as in test_attention_paged.py: fp64 1e-12 (rounding ~1e-15; a key read from a
wrong slot moves an output by ~|v| / n, 1e-3 and more here); fp32 from SDPA's own fp32
error on the same inputs (`fp32_tolerance`); bf16 by hand: the output is rounded once to
bf16 (<= u |o|, u = 2^-8) and the softmax weights are rounded to bf16 before p @ V, as a
GPU's bf16 dot takes them (<= u sum_t p_t |v_t| <= u max|v|), the rest in fp32.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as hst

from kvpool.attention.backends import TritonPagedBackend, select_backend
from kvpool.attention.backends.paged_step import PagedStepMetadata
from kvpool.attention.backends.torch_paged import TorchPagedBackend
from kvpool.storage.kv import PagedKVStorage

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed (bash setup.sh test installs it)", allow_module_level=True)

KVH, D = 2, 32
U32 = 2.0**-24
U_BF16 = 2.0**-8
U_FP16 = 2.0**-11
TOL64 = 1e-12
MODULE = "kvpool.attention.backends.triton_decode"
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(scope="module")
def ops():
    """triton_decode, its kernels compiled (CUDA) or interpreted (CPU)."""
    module = importlib.import_module(MODULE)
    if DEVICE == "cpu" and not module.interpreted():
        pytest.fail("no GPU, and triton was imported without TRITON_INTERPRET=1 (tests/conftest.py sets it)")
    return module


# Compiles the kernels for an H100 / H200 (sm_90) with Triton's own compiler and ptxas, no
# GPU needed: a kernel the interpreter runs but the compiler refuses fails here. In a child
# process without TRITON_INTERPRET (the interpreter's kernels cannot be compiled).
AOT = """
import triton, triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kvpool.attention.backends import triton_decode as td

def compile(fn, types, consts):
    signature = {a: "constexpr" if a in consts else types.get(a, "i32") for a in fn.arg_names}
    # what a launch specialises on: pointers 16-byte aligned, strides multiples of 16
    attrs = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(fn.arg_names) if a.startswith("stride")
             or signature[a].startswith("*")}
    kernel = triton.compile(ASTSource(fn, signature, consts, attrs), target=GPUTarget("cuda", 90, 32))
    assert kernel.asm["cubin"], fn.__name__
    return kernel.asm["ptx"]

cache = dict(k_cache="*bf16", v_cache="*bf16")
compile(td._write_kv, dict(k_new="*bf16", v_new="*bf16", slots="*i64", **cache), dict(KVH=8, D=128, BS=16, BLOCK_D=128))
tables = dict(rows="*i32", seqs="*i32", tables="*i32", lens="*i32", scale_log2="fp32")
for splits, part, dense in ((1, "*bf16", False), (4, "*fp32", True)):
    consts = dict(KVH=8, G=4, D=128, BS=16, TILE=64, BLOCK_G=16, BLOCK_D=128, NUM_SPLITS=splits,
                  ACC=tl.float32, PRECISION="ieee", UPCAST=False, DENSE=dense)
    ptx = compile(td._decode, dict(q="*bf16", out=part, lse=part, **cache, **tables), consts)
    # K^T and V tiles in 16-byte vectors, no bf16 loaded one element at a time
    assert "ld.global.b16" not in ptx and ptx.count("cp.async.cg.shared.global") >= 16, splits
# a block size that is not a power of two compiles too (tiles of 64 cutting blocks of 24)
consts.update(BS=24, NUM_SPLITS=1, DENSE=False)
compile(td._decode, dict(q="*bf16", out="*bf16", lse="*bf16", **cache, **tables), consts)
compile(td._write_kv, dict(k_new="*bf16", v_new="*bf16", slots="*i32", **cache), dict(KVH=8, D=128, BS=24, BLOCK_D=128))
for splits in (4, td.MAX_SPLITS):  # the rule's widest merge too: a [64, 128] fp32 tile
    merge = dict(H=32, D=128, NUM_SPLITS=splits, BLOCK_S=splits, BLOCK_D=128)
    compile(td._merge, dict(part="*fp32", lse="*fp32", rows="*i32", out="*bf16"), merge)
print("compiled")
"""


def test_the_kernels_compile_for_sm90() -> None:
    """bf16: the write, the decode on CSR tables unsplit and on dense tables split, the merge
    (AOT above); the decode's tiles load as 16-byte vectors (a token-granular K^T mask made
    them 2-byte loads)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parents[1] / "src"), env.get("PYTHONPATH", "")])
    run = subprocess.run([sys.executable, "-c", AOT], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and "compiled" in run.stdout, run.stderr[-3000:]


def test_smollm2s_decode_launches_compile_for_sm90() -> None:
    """What `--device cuda` launches for SmolLM2-135M's decodes (heads 9 / 3, head dim 64,
    blocks of 16), compiled for sm_90 by launching the backends' own code with each kernel
    launch compiling instead of running (tests/sm90_launches.py: the constexprs and argument
    specialisations are the launch's): a CUDA graph's decode of each bucket at the split the
    rule gives it (every bucket in bf16; the first and the last in fp16 and fp32), its
    write_kv and merges, and bf16's eager CSR decode; no 16-bit tile loaded an element at
    a time."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parents[1] / "src"), env.get("PYTHONPATH", "")])
    script = str(Path(__file__).parent / "sm90_launches.py")
    run = subprocess.run([sys.executable, script, "decode"], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and "compiled" in run.stdout, run.stderr[-3000:]


def scattered(lens: list[int], bs: int, g: int, dtype: torch.dtype, seed: int):
    """A pool of random K^T / V blocks, each sequence's blocks at random ids, one query each."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    need = [-(-n // bs) for n in lens]
    num_blocks = sum(need) + 5
    ids = rng.sample(range(num_blocks), sum(need))
    tables = []
    for n in need:
        tables.append(ids[:n])
        ids = ids[n:]
    k_cache = torch.randn(num_blocks, KVH, D, bs, dtype=torch.float64).to(DEVICE, dtype)
    v_cache = torch.randn(num_blocks, KVH, bs, D, dtype=torch.float64).to(DEVICE, dtype)
    q = torch.randn(len(lens), KVH * g, D, dtype=torch.float64).to(DEVICE, dtype)
    return q, k_cache, v_cache, tables


def csr(tables: list[list[int]], lens: list[int], bs: int):
    """indptr, indices, last_block_len as the kernel takes them (int32)."""
    indptr = [0]
    for t in tables:
        indptr.append(indptr[-1] + len(t))
    last = [n - (len(t) - 1) * bs for t, n in zip(tables, lens, strict=True)]
    as32 = [torch.tensor(x, dtype=torch.int32, device=DEVICE) for x in (indptr, [b for t in tables for b in t], last)]
    return as32[0], as32[1], as32[2]


def contiguous_sdpa(q, k_cache, v_cache, tables, lens):
    """Per sequence, SDPA over its keys copied contiguous (GQA heads repeated): [B, H, D]."""
    h = q.shape[1]
    outs = []
    for i, (t, n) in enumerate(zip(tables, lens, strict=True)):
        blocks = torch.tensor(t)
        k = k_cache[blocks].permute(1, 0, 3, 2).reshape(KVH, -1, D)[:, :n].repeat_interleave(h // KVH, 0)
        v = v_cache[blocks].transpose(0, 1).reshape(KVH, -1, D)[:, :n].repeat_interleave(h // KVH, 0)
        outs.append(F.scaled_dot_product_attention(q[i][:, None], k, v, scale=D**-0.5)[:, 0])
    return torch.stack(outs)


def max_abs_v(v_cache, table, n) -> torch.Tensor:
    return v_cache[torch.tensor(table)].transpose(0, 1).reshape(KVH, -1, D)[:, :n].double().abs().max()


def check_close(out, q, k_cache, v_cache, tables, lens) -> None:
    """out [B, H, D] of q against the exact (fp64) contiguous SDPA, within its dtype's bound."""
    exact = contiguous_sdpa(q.double(), k_cache.double(), v_cache.double(), tables, lens)
    own = contiguous_sdpa(q, k_cache, v_cache, tables, lens).double()  # SDPA in out's dtype
    for i, (t, n) in enumerate(zip(tables, lens, strict=True)):
        err = (out[i].double() - exact[i]).abs()
        vmax = max_abs_v(v_cache, t, n)
        if out.dtype == torch.float64:
            assert err.max() <= TOL64, (i, err.max())
        elif out.dtype == torch.float32:  # 4x SDPA's own fp32 error + 16 ulps of max|v|
            assert err.max() <= 4 * (own[i] - exact[i]).abs().max() + 16 * U32 * vmax, (i, err.max())
        else:  # bf16 / fp16: module docstring, per element (u = 2^-8 / 2^-11); 1e-5 for the fp32 sums
            u = U_BF16 if out.dtype == torch.bfloat16 else U_FP16
            assert (err <= u * (exact[i].abs() + vmax) + 1e-5).all(), (i, err.max())


# GQA groups 1, 4, 8 and block sizes 16, 32, 64; lengths off the block size, one of a single
# token, one over several of the kernel's 64-token tiles
@pytest.mark.parametrize(("g", "bs", "lens"), [(1, 16, [37, 1, 130]), (4, 32, [5, 97, 64]), (8, 64, [200, 3])])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=["fp64", "fp32", "bf16"])
def test_paged_decode_matches_contiguous_sdpa(ops, g, bs, lens, dtype) -> None:
    q, k_cache, v_cache, tables = scattered(lens, bs, g, dtype, seed=g * bs)
    indptr, indices, last = csr(tables, lens, bs)
    # the decode rows sit among other rows of the step's batch (prefill rows): only theirs are written
    n_rows = 2 * len(lens) + 1
    rows = torch.tensor([2 * i + 1 for i in range(len(lens))], dtype=torch.int32, device=DEVICE)
    q_step = torch.zeros(n_rows, *q.shape[1:], dtype=dtype, device=DEVICE)
    q_step[rows.long()] = q
    for splits in (1, 3):  # split off; on: 3 ranges, some empty past a short sequence's end
        out = torch.full_like(q_step, 7.0)
        ops.paged_decode(q_step, rows, indptr, indices, last, k_cache, v_cache, D**-0.5, out, splits)
        assert (out[0::2] == 7.0).all(), "a row that is not a decode was written"
        check_close(out[rows.long()], q, k_cache, v_cache, tables, lens)


def test_split_decode_equals_unsplit_in_fp64(ops) -> None:
    """The log-sum-exp merge is exact: any split of a 200-token context gives the unsplit output
    to rounding (a dropped or doubled range would move it by ~1/|range|)."""
    lens = [200, 45]
    q, k_cache, v_cache, tables = scattered(lens, 16, 4, torch.float64, seed=5)
    indptr, indices, last = csr(tables, lens, 16)
    rows = torch.arange(len(lens), dtype=torch.int32, device=DEVICE)
    whole = ops.paged_decode(q, rows, indptr, indices, last, k_cache, v_cache, 0.2, torch.empty_like(q), 1)
    # 4: ranges of one tile, 3 of the short sequence's empty; 64: the rule's cap (the merge's
    # widest tile), all but 4 of the long sequence's ranges empty
    for splits in (2, 4, 64):
        split = ops.paged_decode(q, rows, indptr, indices, last, k_cache, v_cache, 0.2, torch.empty_like(q), splits)
        assert (split - whole).abs().max() <= TOL64


def test_the_gpu_branch_of_the_16_bit_dots_in_fp16(ops) -> None:
    """The decode's dots as a GPU runs them for bf16 and fp16 pools (UPCAST off: the 16-bit
    q, K^T, p and V tiles straight into tl.dot, p rounded to the pool's dtype first), run
    here in fp16: the interpreter's fp16 dot multiplies the values, its bf16 dot does not
    (it is widened to fp32 there: the branch a GPU never runs). CSR unsplit and split in 4,
    dense rows, against SDPA in fp64 within fp16's bound (check_close).

    What it proves: that branch's operands, their dtypes and the rounding of p feed the
    dots correctly, so the branch a GPU takes gives the right numbers in a 16-bit dtype.
    What it cannot: bf16 itself in that branch (only the compiled kernel on a GPU runs it:
    tests/test_cuda_engine.py's bf16 commands, which check no numbers), nor the tensor
    cores' own accumulation order and rounding, nor what ptxas makes of it beyond compiling
    (test_the_kernels_compile_for_sm90)."""
    from kvpool.attention.backends.step_buffers import StepBuffers

    assert not ops.dots_widened(torch.float16) and not ops.dots_widened(torch.float32)
    assert ops.dots_widened(torch.bfloat16) == (DEVICE == "cpu")  # the interpreter's only
    bs, g, lens = 16, 4, [37, 1, 130, 200]
    q, k_cache, v_cache, tables = scattered(lens, bs, g, torch.float16, seed=11)
    indptr, indices, last = csr(tables, lens, bs)
    rows = torch.arange(len(lens), dtype=torch.int32, device=DEVICE)
    for splits in (1, 4):
        out = ops.paged_decode(q, rows, indptr, indices, last, k_cache, v_cache, D**-0.5, torch.empty_like(q), splits)
        check_close(out, q, k_cache, v_cache, tables, lens)
    buffers = StepBuffers(4, 4, 13, bs, DEVICE)
    buffers.update(["a", "b", "c", "d"], [n - 1 for n in lens], lens, tables)
    view = buffers.view(4, 4)
    out = torch.empty_like(q)
    ops.paged_decode_dense(q, rows, view.seq_rows, view.block_tables, view.ctx_lens, k_cache, v_cache, D**-0.5, out)
    check_close(out, q, k_cache, v_cache, tables, lens)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_write_kv_equals_the_pools_torch_write(ops, dtype) -> None:
    """The kernel's write through the slot mapping stores exactly what the pool's index_copy
    write stores, from strided rows (k and v as views of one qkv row), nothing else."""
    bs, n = 16, 11
    torch.manual_seed(0)
    mine = PagedKVStorage(1, 6, bs, KVH, D, dtype, DEVICE)
    theirs = PagedKVStorage(1, 6, bs, KVH, D, dtype, DEVICE)
    qkv = torch.randn(n, 3 * KVH * D, dtype=torch.float64).to(DEVICE, dtype)
    k = qkv[:, KVH * D : 2 * KVH * D].view(n, KVH, D)
    v = qkv[:, 2 * KVH * D :].view(n, KVH, D)
    # a prefill of 7 tokens over block 4's last 4 slots then block 1's first 3, decodes into blocks 0, 5, 2, 3
    prefill = [4 * bs + 12, 4 * bs + 13, 4 * bs + 14, 4 * bs + 15, 1 * bs + 0, 1 * bs + 1, 1 * bs + 2]
    slots = torch.tensor(prefill + [0 * bs + 15, 5 * bs + 3, 2 * bs + 0, 3 * bs + 1], device=DEVICE)
    ops.write_kv(k, v, slots, mine.k_layers[0], mine.v_layers[0])
    theirs.write(0, theirs.write_index(slots), k, v)
    assert torch.equal(mine.k, theirs.k) and torch.equal(mine.v, theirs.v)
    assert mine.k.count_nonzero() == n * KVH * D  # no other slot touched (randn is never 0.0 here)


def test_the_split_rule(ops) -> None:
    from kvpool.attention.backends.triton_decode import num_splits_for

    # 132 SMs: 64 sequences x 8 KV heads = 512 programs fill them: no split, however long
    assert num_splits_for(64, 8, 32768, 132) == 1
    # 16 x 32k at 8 KV heads: 128 programs; 2 per SM wants ceil(264 / 128) = 3 each, rounded up to 4
    assert num_splits_for(16, 8, 32768, 132) == 4
    # one 4k sequence: ceil(264 / 8) = 33 wanted (64 rounded up), 4096 // 512 = 8 allowed
    assert num_splits_for(1, 8, 4096, 132) == 8
    # 4k + 511: still 8 (8 * 512 <= 4607 < 16 * 512; the unrounded rule took 8 here too) ...
    assert num_splits_for(1, 8, 4607, 132) == 8
    # ... and 6k: 12 allowed, rounded down to 8 (the unrounded rule's 12, a new constexpr)
    assert num_splits_for(1, 8, 6144, 132) == 8
    assert num_splits_for(1, 8, 128 * 1024, 132) == 64  # 33 wanted -> 64, 256 allowed
    assert num_splits_for(1, 1, 128 * 1024, 132) == 64  # 264 wanted -> 512, 256 allowed: the cap
    assert num_splits_for(1, 8, 700, 132) == 1  # too short to split
    assert num_splits_for(2, 2, 100, 4) == 1
    assert num_splits_for(0, 8, 0, 132) == 1  # an empty step: nothing to split (was a ZeroDivisionError)


def test_the_split_rule_takes_few_values(ops) -> None:
    """The split count is a constexpr: each new value compiles `_decode` and `_merge` again
    (seconds, mid-step, on a GPU). Over every context 1..131072 and batch 1..256 at 1, 2, 3
    and 8 KV heads and 132 / 114 / 80 SMs, the rule takes powers of two <= MAX_SPLITS = 64
    only: at most 7 values (the unrounded rule took 33 at batch 1 and 8 KV heads on 132 SMs).
    The context enters only as ctx // MIN_SPLIT_TOKENS, so the contexts 1 and k * 512
    (k = 1..256) stand for every context of [1, 131072]. Each value still keeps the rule:
    no split under 512 tokens, and a count below 2 programs an SM only where that floor or
    the cap stops it."""
    from kvpool.attention.backends.triton_decode import MAX_SPLITS, MIN_SPLIT_TOKENS, num_splits_for

    assert MAX_SPLITS == 64 and MIN_SPLIT_TOKENS == 512
    contexts = [1] + [k * 512 for k in range(1, 257)]
    seen = set()
    for num_sms in (132, 114, 80):
        for kvh in (1, 2, 3, 8):
            for batch in range(1, 257):
                programs = batch * kvh
                for ctx in contexts:
                    n = num_splits_for(batch, kvh, ctx, num_sms)
                    seen.add(n)
                    assert n & (n - 1) == 0 and 1 <= n <= MAX_SPLITS, (batch, kvh, ctx, n)
                    assert n == 1 or n * MIN_SPLIT_TOKENS <= ctx, (batch, kvh, ctx, n)
                    if programs * n < 2 * num_sms:  # short of two per SM: the floor or the cap
                        assert n == MAX_SPLITS or 2 * n * MIN_SPLIT_TOKENS > ctx, (batch, kvh, ctx, n)
    assert seen == {1, 2, 4, 8, 16, 32, 64}
    # the 33 of the unrounded rule, min(ceil(264 / 8), ctx // 512), against this one's 7
    unrounded = {min(33, max(1, c // 512)) for c in contexts}
    assert len(unrounded) == 33 and len({num_splits_for(1, 8, c, 132) for c in contexts}) == 7


@pytest.mark.parametrize("bs", [16, 24])
def test_dense_decode_over_step_buffers(ops, bs) -> None:
    """The decode over persistent step buffers' dense tables (as a CUDA graph replays them)
    equals contiguous SDPA; padded to a bucket, each padding row reads only the dummy
    block's slot 0, so its output is that slot's V (one key: softmax weight exactly 1).
    Blocks of 24: tiles that cut blocks, over dense rows."""
    from kvpool.attention.backends.step_buffers import StepBuffers

    g, lens = 4, [37, 1, 130]
    q, k_cache, v_cache, tables = scattered(lens, bs, g, torch.float64, seed=7)
    used = {blk for t in tables for blk in t}
    dummy = next(blk for blk in range(k_cache.shape[0]) if blk not in used)  # scattered() leaves 5 unused
    buffers = StepBuffers(8, 8, 10, bs, DEVICE, dummy_block=dummy)
    ids = ["a", "b", "c"]
    buffers.update(ids, [n - 1 for n in lens], lens, tables)
    view = buffers.pad(5)
    q_step = torch.cat([q, torch.randn(2, *q.shape[1:], dtype=q.dtype, device=DEVICE)])
    rows = view.query_start[:5]
    for splits in (1, 2):
        out = torch.full_like(q_step, 7.0)
        tabs = (view.seq_rows, view.block_tables, view.ctx_lens)
        ops.paged_decode_dense(q_step, rows, *tabs, k_cache, v_cache, D**-0.5, out, splits)
        check_close(out[:3], q, k_cache, v_cache, tables, lens)
        want = v_cache[dummy, :, 0].repeat_interleave(g, 0)  # [H, D]: each head's KV head's slot 0
        assert torch.equal(out[3], want) and torch.equal(out[4], want)


def pool_with_context(dtype, bs: int, lens: list[int], seed: int):
    """A pool whose sequences i hold lens[i] - q_lens[i] earlier tokens at scattered blocks."""
    torch.manual_seed(seed)
    need = [-(-n // bs) for n in lens]
    ids = random.Random(seed).sample(range(sum(need) + 3), sum(need))
    st = PagedKVStorage(2, sum(need) + 3, bs, KVH, D, dtype, DEVICE)
    st.k.copy_(torch.randn(st.k.shape, dtype=torch.float64))
    st.v.copy_(torch.randn(st.v.shape, dtype=torch.float64))
    indptr = [0]
    for n in need:
        indptr.append(indptr[-1] + n)
    return st, indptr, ids


def copy_of(st: PagedKVStorage, dtype: torch.dtype) -> PagedKVStorage:
    twin = PagedKVStorage(st.num_layers, st.num_blocks, st.block_size, KVH, D, dtype, DEVICE)
    twin.k.copy_(st.k)
    twin.v.copy_(st.v)
    return twin


@pytest.mark.parametrize(
    ("dtype", "num_splits", "bs"),
    [(torch.float64, 3, 16), (torch.float32, None, 16), (torch.float64, 3, 5), (torch.float64, 2, 24)]
    + [(torch.float64, 1, 48), (torch.float64, 2, 96)],
    ids=["fp64", "fp32", "fp64-bs5", "fp64-bs24", "fp64-bs48", "fp64-bs96"],
)
def test_backend_step_equals_the_torch_backend(ops, dtype, num_splits, bs) -> None:
    """A mixed step (a prefill chunk after a cached prefix, a prefill from 0, three decodes),
    then a step of decodes only (each sequence's last token again: the step's own tables),
    through the Triton backend (its decodes split in 3, or by the rule: 1) and through the
    torch backend (padded) on copies of one pool: the same pool after the writes, the same
    attention (fp32: within 4x the torch backend's own fp32 error against its fp64 run + 16
    ulps of max|v|). Block sizes that are not powers of two too: the decode's 64-token tiles
    (128 for blocks of 96) then start and end inside blocks, each token's block looked up
    by t // block_size; a split range (a multiple of the tile) starts inside one too."""
    g = 4
    ctx_lens = [160, 50, 17, 9, 64]
    st, indptr, ids = pool_with_context(dtype, bs, ctx_lens, seed=3)
    twin, exact_pool = copy_of(st, dtype), copy_of(st, torch.float64)
    triton_backend = TritonPagedBackend(st, KVH * g, None, dtype, num_splits=num_splits)
    torch_backend = TorchPagedBackend(twin, KVH * g, None, dtype, decode_path="padded")
    exact_backend = TorchPagedBackend(exact_pool, KVH * g, None, torch.float64, decode_path="padded")
    for q_lens in ([1, 20, 1, 9, 1], [1] * 5):
        slots = []
        for i, (ql, cl) in enumerate(zip(q_lens, ctx_lens, strict=True)):
            table = ids[indptr[i] : indptr[i + 1]]
            slots += [table[p // bs] * bs + p % bs for p in range(cl - ql, cl)]
        meta = PagedStepMetadata(q_lens, ctx_lens, slots, indptr, ids)
        n = sum(q_lens)
        step = triton_backend.begin_step(meta)
        assert step.decode_path == "triton" and step.table_bytes > 0
        reference, exact_step = torch_backend.begin_step(meta), exact_backend.begin_step(meta)
        for layer in range(2):
            q, k, v = (torch.randn(n, h, D, dtype=torch.float64).to(DEVICE, dtype) for h in (KVH * g, KVH, KVH))
            out = step.attend(layer, q, k, v)
            want = reference.attend(layer, q, k, v)
            exact = exact_step.attend(layer, q.double(), k.double(), v.double())
            assert torch.equal(st.k, twin.k) and torch.equal(st.v, twin.v)
            err = (out.double() - exact).abs().max()
            if dtype == torch.float64:
                assert err <= TOL64
            else:
                assert err <= 4 * (want.double() - exact).abs().max() + 16 * U32 * st.v.abs().max()


@pytest.mark.parametrize("few_shapes", [True, False], ids=["few", "numpy"])
@pytest.mark.parametrize("num_splits", [None, 3], ids=["rule", "split3"])
def test_a_step_planned_from_the_step_buffers_equals_the_list_plan(ops, num_splits, few_shapes) -> None:
    """The mixed step above (a chunk after a cached prefix, a prefill from 0, three
    decodes), the engine's order of one (the decodes first, then the chunks) and a
    prefill-only step, fp32, block size 16, GQA group 4: planned from
    persistent step buffers (`begin_buffered_step`: table rows at seq_rows, not rows 0..4,
    slots from the buffers) and from the lists (`begin_step`), on copies of one pool. The
    same kernels over the same blocks: the outputs and the pools after the writes are
    equal bit for bit."""
    from kvpool.attention.backends.step_buffers import StepBuffers

    bs, g, dtype = 16, 4, torch.float32
    ctx_lens = [160, 50, 17, 9, 64]
    st, indptr, ids = pool_with_context(dtype, bs, ctx_lens, seed=5)
    twin = copy_of(st, dtype)
    buffered = TritonPagedBackend(st, KVH * g, None, dtype, num_splits=num_splits)
    buffered.few_shapes = few_shapes  # (False: every step's shape in numpy, `_shape`)
    listed = TritonPagedBackend(twin, KVH * g, None, dtype, num_splits=num_splits)
    buffers = StepBuffers(max_num_seqs=8, max_num_tokens=64, max_blocks_per_seq=12, block_size=bs, device=DEVICE)
    buffers.update(["x", "y", "z"], [0, 0, 0], [1, 1, 1], [[0], [1], [2]])
    buffers.forget("x")
    buffers.forget("z")  # rows 0 and 2 free, row 1 held: the step's rows are not 0..4
    names = [f"s{i}" for i in range(5)]
    tables = [ids[indptr[i] : indptr[i + 1]] for i in range(5)]
    # (the engine's order twice, another plan's tables written between: the second time its
    # chunks' plan is the one kept for the shape, `plan_few_kept`)
    for q_lens in ([1, 1, 1, 9, 30], [1, 20, 1, 9, 1], [1, 1, 1, 9, 30], [30, 2, 17, 9, 4]):
        starts = [c - q for c, q in zip(ctx_lens, q_lens, strict=True)]
        buffers.update(names, starts, ctx_lens, tables)
        spans = zip(tables, starts, ctx_lens, strict=True)
        slots = [t[p // bs] * bs + p % bs for t, s, c in spans for p in range(s, c)]
        n = sum(q_lens)
        assert buffers.view(5, n).slot_mapping.tolist() == slots
        step = buffered.begin_buffered_step(buffers, q_lens, ctx_lens)
        want_step = listed.begin_step(PagedStepMetadata(q_lens, ctx_lens, slots, indptr, ids))
        assert step.decode_path == want_step.decode_path and step.num_tokens == n
        for layer in range(2):
            q, k, v = (torch.randn(n, h, D, dtype=torch.float64).to(DEVICE, dtype) for h in (KVH * g, KVH, KVH))
            assert torch.equal(step.attend(layer, q, k, v), want_step.attend(layer, q, k, v))
            assert torch.equal(st.k, twin.k) and torch.equal(st.v, twin.v)
    with pytest.raises(ValueError, match=r"hold 5 sequences of 62 tokens, not 5 of 5 \(5 context lengths\)"):
        buffered.begin_buffered_step(buffers, [1] * 5, ctx_lens)


def _shape_fields(shape) -> tuple:
    return tuple(None if v is None else v if isinstance(v, int) else [int(x) for x in v] for v in shape)


def test_a_buffered_steps_few_shape_equals_its_numpy_twin() -> None:
    """`_few_shape` (the sequences after the buffers' leading decodes read in Python) against
    `_shape` (every sequence in numpy), over 300 random steps written by `update` and
    `advance` as an engine's (decodes one token on, some leave, chunks and joining requests
    after them or among them): the same shape, field by field, wherever the buffers' leading
    decodes leave at most FEW_OTHERS others; and the same refusals of lengths that are not
    the step the buffers hold."""
    from kvpool.attention.backends.step_buffers import StepBuffers
    from kvpool.attention.backends.triton_paged import FEW_OTHERS, _few_shape, _shape

    rng = random.Random(3)
    bs, width = 4, 16
    buffers = StepBuffers(max_num_seqs=12, max_num_tokens=256, max_blocks_per_seq=width, block_size=bs)
    tables: dict[str, list[int]] = {}
    running: list[tuple[str, int]] = []  # (id, context)
    num_few = num_lead = 0
    for step in range(300):
        running = [r for r in running if rng.random() > 0.1]
        for rid in set(tables) - {r for r, _ in running}:
            buffers.forget(rid)
            del tables[rid]
        ids, starts, ends = [], [], []
        for rid, ctx in running:  # decodes, now and then a chunk among them
            q = 1 if rng.random() < 0.9 else rng.randint(2, 6)
            ids.append(rid), starts.append(ctx), ends.append(ctx + q)
        while len(ids) < 12 and rng.random() < 0.5:  # joining requests after them
            rid = f"r{step}.{len(ids)}"
            tables[rid] = []
            ids.append(rid), starts.append(0), ends.append(rng.choice([1, 5, 16]))
        if not ids or max(ends) > width * bs:
            running = []
            continue
        for rid, end in zip(ids, ends, strict=True):
            tables[rid] += [rng.randrange(1000) for _ in range(-(-end // bs) - len(tables[rid]))]
        if not buffers.advance(ids, starts, ends, lambda w: [tables[r] for r in w]):
            buffers.update(ids, starts, ends, [tables[r] for r in ids])
        q = np.array(ends) - np.array(starts)
        c = np.array(ends)
        lead = buffers.num_lead
        assert (q[:lead] == 1).all()
        if len(ids) - lead <= FEW_OTHERS:
            assert _shape_fields(_few_shape(buffers, q, c, lead)) == _shape_fields(_shape(buffers, q, c)), step
            num_few += 1
            num_lead += lead > 0
            if len(ids) > 1:  # (another count of sequences, the same tokens: the last two as one)
                merged_q, merged_c = np.append(q[:-2], q[-2:].sum()), np.append(c[:-2], c[-1])
                for args in ((buffers, merged_q, merged_c, 0), (buffers, merged_q, merged_c)):
                    with pytest.raises(ValueError, match=rf"hold {len(ids)} sequences of {q.sum()} tokens, not"):
                        (_few_shape if len(args) == 4 else _shape)(*args)
            if lead < len(ids):  # (a step of other totals: the leading decodes' lengths are the buffers')
                bad = q.copy()
                bad[-1] += 1
                for args in ((buffers, bad, c, lead), (buffers, bad, c)):
                    with pytest.raises(ValueError, match=rf"hold {len(ids)} sequences of {q.sum()} tokens, not"):
                        (_few_shape if len(args) == 4 else _shape)(*args)
        running = [(r, e) for r, e in zip(ids, ends, strict=True)]
    assert num_few > 200 and num_lead > 100


def _shape_or_refusal(f, *args) -> tuple | str:
    """f's shape as plain fields, or its refusal's message (any other exception propagates)."""
    try:
        return _shape_fields(f(*args))
    except ValueError as e:
        return str(e)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=hst.data())
def test_few_shape_refuses_and_accepts_what_its_twin_does(data) -> None:
    """`_few_shape` against `_shape` on right and wrong steps: an engine's steps written by
    `update`/`advance` (decodes, a chunk among them now and then, joining requests after
    them, finished ones forgotten; the runner's `clear` after a step, or not), each passed
    as it is and broken: a sequence dropped, added or two merged (another count, maybe the
    same tokens), a leading row of 0 or several tokens (with another row compensating, so
    the totals match by accident, or not), a leading or later row's context 0 or short of
    its tokens, one context length too many or too few, the lists as arrays or Python lists;
    after a `clear`, the empty step and the stale one. With the lead `begin_buffered_step`
    passes (num_lead where the counts agree, else 0) and any other lead in [0, n + 1]: both
    accept with the same shape or refuse with the same message."""
    from kvpool.attention.backends.step_buffers import StepBuffers
    from kvpool.attention.backends.triton_paged import _few_shape, _shape

    bs, width = 4, 16
    buffers = StepBuffers(max_num_seqs=12, max_num_tokens=256, max_blocks_per_seq=width, block_size=bs)
    tables: dict[str, list[int]] = {}
    running: list[tuple[str, int]] = []  # (id, context)
    ints = data.draw

    def agree(q, c) -> None:
        n = len(q)
        for lead in {buffers.num_lead if buffers.num_seqs == n else 0, ints(hst.integers(0, n + 1))}:
            few, twin = _shape_or_refusal(_few_shape, buffers, q, c, lead), _shape_or_refusal(_shape, buffers, q, c)
            assert few == twin, (list(q), list(c), lead, buffers.num_seqs, buffers.num_tokens)

    for step in range(ints(hst.integers(1, 8))):
        running = [r for r in running if not ints(hst.booleans())] if len(running) > 8 else running
        for rid in set(tables) - {r for r, _ in running}:
            buffers.forget(rid)
            del tables[rid]
        ids, starts, ends = [], [], []
        for rid, ctx in running:  # decodes, now and then a chunk among them
            q_len = ints(hst.sampled_from([1, 1, 1, 1, 1, 1, 2, 5]))
            ids.append(rid), starts.append(ctx), ends.append(ctx + q_len)
        for _ in range(ints(hst.integers(0, min(3, 12 - len(ids))))):  # joining requests after them
            rid = f"r{step}.{len(ids)}"
            tables[rid] = []
            ids.append(rid), starts.append(0), ends.append(ints(hst.sampled_from([1, 3, 16])))
        if not ids or max(ends) > width * bs:
            for rid, _ in running:
                buffers.forget(rid)
                del tables[rid]
            running = []
            continue
        for rid, end in zip(ids, ends, strict=True):
            tables[rid] += [7 * len(tables) + k for k in range(-(-end // bs) - len(tables[rid]))]
        if not buffers.advance(ids, starts, ends, lambda w: [tables[r] for r in w]):
            buffers.update(ids, starts, ends, [tables[r] for r in ids])
        buffers.check_integrity(tables)
        q, c = np.array(ends) - np.array(starts), np.array(ends)
        n, lead = len(ids), buffers.num_lead
        assert buffers.num_seqs == n and (q[:lead] == 1).all()
        agree(q, c)
        # the step broken
        bad_q, bad_c = q.copy(), c.copy()
        kind = ints(hst.sampled_from(["drop", "add", "merge", "lead q", "q", "lead c", "c", "c count"]))
        i = ints(hst.integers(0, max(lead - 1, 0))) if kind.startswith("lead") else ints(hst.integers(0, n - 1))
        if kind == "drop":
            bad_q, bad_c = np.delete(q, i), np.delete(c, i)
        elif kind == "add":
            bad_q, bad_c = np.insert(q, i, 1), np.insert(c, i, ints(hst.integers(0, 9)))
        elif kind == "merge" and n > 1:  # (the same tokens: only the count tells)
            i = min(i, n - 2)
            bad_q = np.concatenate((q[:i], [q[i] + q[i + 1]], q[i + 2 :]))
            bad_c = np.concatenate((c[:i], [c[i + 1]], c[i + 2 :]))
        elif kind in ("lead q", "q"):
            bad_q[i] = ints(hst.sampled_from([0, 2, 3, -1]))
            if n > 1 and ints(hst.booleans()):  # another row makes up the difference: the same total
                j = (i + ints(hst.integers(1, n - 1))) % n
                bad_q[j] += q[i] - bad_q[i]
        elif kind in ("lead c", "c"):
            bad_c[i] = ints(hst.sampled_from([0, int(q[i]) - 1]))
        elif kind == "c count":
            bad_c = c[:-1] if ints(hst.booleans()) else np.append(c, 5)
        as_lists = ints(hst.booleans())
        agree(*((bad_q.tolist(), bad_c.tolist()) if as_lists else (bad_q, bad_c)))
        if ints(hst.booleans()):  # the runner's clear after the step's forward
            buffers.clear()
            assert buffers.num_lead == 0
            empty = np.zeros(0, dtype=np.int64)
            agree(empty, empty)
            agree(q, c)  # (the stale step: the buffers hold none)
        running = list(zip(ids, ends, strict=True))


def test_few_shape_on_the_reviews_wrong_steps() -> None:
    """The review's steps (buffers holding 3 decodes) that `_few_shape` took where `_shape`
    refuses: another count, a leading context of 0, leading lengths [2, 0, 1] of the same
    total; and after a clear, the empty step both accept."""
    from kvpool.attention.backends.step_buffers import StepBuffers
    from kvpool.attention.backends.triton_paged import _few_shape, _shape

    b = StepBuffers(max_num_seqs=12, max_num_tokens=256, max_blocks_per_seq=16, block_size=4)
    b.update(["a", "b", "c"], [5, 6, 7], [6, 7, 8], [[1, 2], [3, 4], [5, 6]])
    assert b.num_lead == 3
    for q, c, lead, message in (
        ([2, 1], [7, 8], 0, "the step buffers hold 3 sequences of 3 tokens, not 2 of 3 (2 context lengths)"),
        ([1, 1, 1], [0, 7, 8], 3, "sequence 0: 0 tokens with 1 new ones"),
        ([2, 0, 1], [6, 7, 8], 3, "sequence 1: 7 tokens with 0 new ones"),
    ):
        for f, args in ((_few_shape, (b, np.array(q), np.array(c), lead)), (_shape, (b, np.array(q), np.array(c)))):
            with pytest.raises(ValueError) as refused:
                f(*args)
            assert str(refused.value) == message
    b.clear()
    assert b.num_lead == 0
    empty = np.zeros(0, dtype=np.int64)
    want = (0, 0, None, 0, [], [], [], None)
    assert _shape_fields(_few_shape(b, empty, empty, b.num_lead)) == _shape_fields(_shape(b, empty, empty)) == want


def test_the_engine_on_the_triton_backend_equals_the_torch_path(ops, monkeypatch) -> None:
    """The engine, its runner as it is, on the Triton backend (registered for this device for
    the test) against the padded torch backend: a random 4-layer Llama in fp64, chunked
    prefill (8 tokens a step), a prefix hit then a chunk over it, decodes beside prefills;
    every logit within 1e-12 (relative to the largest)."""
    from kvpool.attention.backends import BACKENDS, BackendKey
    from kvpool.engine.engine import Engine
    from kvpool.engine.llama_runner import llama_runner
    from kvpool.engine.sampling import SamplingParams
    from random_llama import DESCRIPTOR, random_llama

    monkeypatch.setitem(BACKENDS, BackendKey("full", "paged", DEVICE, "triton"), TritonPagedBackend)
    model = random_llama(DEVICE, torch.float64)
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5], [3, 1, 4, 1, 5, 9, 2, 6, 7, 7], [2, 7, 1, 8, 2, 8]]
    logits = {}
    for path in ("triton", "padded"):
        runner = llama_runner(model, 16, 4, DESCRIPTOR, decode_path=path)
        engine = Engine(runner, max_num_batched_tokens=8, record_logits=True)
        params = SamplingParams(max_tokens=4, ignore_eos=True)
        engine.generate(prompts[:1], params)
        engine.generate(prompts[1:], params)  # the second prompt's first 8 tokens: a hit of 2 blocks
        assert runner.executor.last_decode_path == path
        assert [r.num_cached_tokens for r in engine.requests.values()] == [0, 8, 0]
        logits[path] = [torch.stack(s.logits) for r in engine.requests.values() for s in r.seqs]
    for a, b in zip(logits["triton"], logits["padded"], strict=True):
        assert (a - b).abs().max() <= TOL64 * b.abs().max().clamp(min=1)


def test_backend_registry_and_refusals(ops) -> None:
    choice = select_backend("full", "paged", "cuda")
    assert choice.key.impl == "triton" and choice.backend is TritonPagedBackend
    st = PagedKVStorage(1, 4, 16, KVH, D, torch.float32, DEVICE)
    with pytest.raises(ValueError, match="not by 'bags'"):
        TritonPagedBackend(st, 4, None, torch.float32, decode_path="bags")
    with pytest.raises(ValueError, match="num_splits must be at least 1, got 0"):
        TritonPagedBackend(st, 4, None, torch.float32, num_splits=0)
    backend = TritonPagedBackend(st, 4, None, torch.float32, num_sms=4)
    # the rule's split of a step's decodes: 4 SMs, 1 sequence x 2 KV heads: min(ceil(8 / 2), 1100 // 512)
    long = PagedStepMetadata([1], [1100], [0], [0, 69], list(range(69)))
    assert backend._plan_decodes(long, [0], [0]).num_splits == 2
    with pytest.raises(ValueError, match="sequence 0: 1 blocks of 16 for 17 tokens"):
        backend.begin_step(PagedStepMetadata([1], [17], [16], [0, 1], [1]))
