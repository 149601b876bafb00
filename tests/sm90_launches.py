"""What `kvpool run / generate / serve --device cuda` launches on SmolLM2-135M, compiled for an
H100 / H200 (sm_90) by Triton's own compiler and ptxas, no GPU needed. Run as a child process
without TRITON_INTERPRET (an interpreted kernel cannot be compiled):

    python tests/sm90_launches.py decode|extend

The kernels' launch code runs as it is (the attention backends on a CPU pool of SmolLM2's
shape: 9 query heads, 3 KV heads, head dim 64, blocks of 16), and every kernel launch,
`kernel[grid](*args, **kwargs)`, compiles for sm_90 instead of running (`CompileOnLaunch`):
the constexprs are those the launch code picks (split counts by the rule for an H100's 132
SMs, tile sizes, the accumulator, the bf16 dots), and the argument types and
specialisations (16-byte alignment, integers divisible by 16 or equal to 1) are Triton's own
binder's for the arguments the launch passes. So the compiles follow the code: a kernel or a
launch that the interpreter runs but the compiler refuses for some shape or dtype the
engine uses fails here. Prints one line a compiled variant, then "compiled N"."""

from __future__ import annotations

import sys

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton.runtime.jit import create_function_from_signature

TARGET = GPUTarget("cuda", 90, 32)  # an H100 / H200
NUM_SMS = 132  # theirs: the split rule's SM count
HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 9, 3, 64, 16  # SmolLM2-135M (presets/smollm2-135m.json), the engine's blocks
MODEL_DTYPES = (torch.bfloat16, torch.float16, torch.float32)  # cli/args.py MODEL_DTYPES
QUANT_FORMATS = ("fp8_e4m3", "fp8_e5m2", "fp8_e4m3_token", "fp8_e5m2_token", "int8")  # read in place (triton_quant)


class CompileOnLaunch:
    """Stands for a @triton.jit kernel: kernel[grid](*args, **kwargs) binds the arguments as
    a launch does (JITFunction.run: Triton's binder, then its _pack_args) and compiles the
    result for sm_90, once a specialisation; nothing runs."""

    def __init__(self, fn, compiled: dict, variants: list) -> None:
        self.fn, self.compiled, self.variants = fn, compiled, variants
        self.backend = make_backend(TARGET)
        self.binder = create_function_from_signature(fn.signature, fn.params, self.backend)

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            kwargs.setdefault("debug", False)
            bound, specialization, options = self.binder(*args, **kwargs)
            options, signature, constexprs, attrs = self.fn._pack_args(
                self.backend, kwargs, bound, specialization, options
            )
            key = (self.fn.__name__, repr(sorted(signature.items())), repr(sorted(constexprs.items())), repr(attrs))
            if key not in self.compiled:
                source = ASTSource(self.fn, signature, constexprs, attrs)
                kernel = triton.compile(source, target=TARGET, options=options.__dict__)
                assert kernel.asm["cubin"], key
                self.compiled[key] = kernel
                named = {self.fn.arg_names[path[0]]: value for path, value in constexprs.items()}
                types = sorted({t for t in signature.values() if t.startswith("*")})
                ptx = kernel.asm["ptx"]
                if self.fn.__name__ in ("_decode", "_extend_kernel") and not named.get("QUANT"):
                    # the K^T and V tiles in 16-byte vectors, no 16-bit element loaded alone
                    assert "ld.global.b16" not in ptx, (self.fn.__name__, types, named)
                self.variants.append((self.fn.__name__, signature, named))
                kept = {k: v for k, v in named.items() if not k.startswith("s_")}  # (strides of 1 apart)
                print(self.fn.__name__, types, kept, flush=True)

        return launch


def compile_on_launch() -> list[tuple[str, dict, dict]]:
    """The kernels of triton_decode and triton_extend replaced by `CompileOnLaunch` (the
    launch code reads them as module globals at each call) -> the variants compiled, in
    order: (kernel, its signature by argument, its constexprs by name), filled as launches come."""
    from kvpool.attention.backends import triton_decode, triton_extend

    compiled: dict = {}
    variants: list[tuple[str, dict, dict]] = []
    for module, name in ((triton_decode, "_write_kv"), (triton_decode, "_decode"), (triton_decode, "_merge")):
        setattr(module, name, CompileOnLaunch(getattr(module, name), compiled, variants))
    triton_extend._extend_kernel = CompileOnLaunch(triton_extend._extend_kernel, compiled, variants)
    return variants


def _backend(cls, storage, dtype):
    """The backend on a CPU pool, with an H100's SM count. Its check refuses a CPU pool
    outside the interpreter (the launches could not run there); here none runs, each
    compiles for the GPU instead, so the check is set aside (in this child process only)."""
    cls._check = lambda *args: None
    return cls(storage, HEADS, None, dtype, num_sms=NUM_SMS)


def _qkv(num_tokens: int, dtype: torch.dtype, generator: torch.Generator) -> list[torch.Tensor]:
    """A step's q, k, v as the model hands them: views of one fused projection (strided rows)."""
    fused = torch.randn(num_tokens, HEADS + 2 * KV_HEADS, HEAD_DIM, generator=generator).to(dtype)
    return [fused[:, :HEADS], fused[:, HEADS : HEADS + KV_HEADS], fused[:, HEADS + KV_HEADS :]]


def decode_launches(variants: list) -> None:
    """Per model dtype, a CUDA graph's decode steps (`begin_decode` over the step buffers:
    write_kv with the buffers' int32 slots, the dense decode at the bucket's split, the
    merge): in bf16 (the GPU's default) every bucket, each at the split the rule gives it
    (the buffers' 8,192-token context: 16 down to 1), in fp16 and fp32 the smallest and the
    largest bucket; and in bf16 an eager step (`begin_step`, --enforce-eager: the CSR
    decode beside a prompt, int64 slots)."""
    from kvpool.attention.backends.paged_step import PagedStepMetadata
    from kvpool.attention.backends.step_buffers import StepBuffers
    from kvpool.attention.backends.triton_decode import num_splits_for
    from kvpool.attention.backends.triton_paged import TritonPagedBackend
    from kvpool.engine.cuda_graph import buckets_up_to
    from kvpool.storage.kv import PagedKVStorage

    g = torch.Generator().manual_seed(0)
    max_blocks = 8192 // BLOCK_SIZE  # SmolLM2's 8,192 positions (llama_runner's buffers)
    all_buckets = buckets_up_to(256)
    for dtype in MODEL_DTYPES:
        pool = PagedKVStorage(1, 64, BLOCK_SIZE, KV_HEADS, HEAD_DIM, dtype, "cpu")
        backend = _backend(TritonPagedBackend, pool, dtype)
        buffers = StepBuffers(256, 512, max_blocks, BLOCK_SIZE, "cpu", dummy_block=63)
        buckets = all_buckets if dtype == torch.bfloat16 else (all_buckets[0], all_buckets[-1])
        for bucket in buckets:
            backend.begin_decode(buffers, bucket).attend(0, *_qkv(bucket, dtype, g))
        if dtype == torch.bfloat16:
            meta = PagedStepMetadata([1, 16], [21, 16], [2 * 16 + 4] + list(range(64, 80)), [0, 2, 3], [1, 2, 4])
            backend.begin_step(meta).attend(0, *_qkv(17, dtype, g))
        # (the splits the rule gives the buckets, each compiled: the rule picks, not this file)
        name = str(dtype).removeprefix("torch.").replace("bfloat16", "bf16").replace("float", "fp")
        splits = {
            v[2]["NUM_SPLITS"] for v in variants if v[0] == "_decode" and v[1]["q"] == f"*{name}" and v[2]["DENSE"]
        }
        assert splits == {num_splits_for(b, KV_HEADS, max_blocks * BLOCK_SIZE, NUM_SMS) for b in buckets}, splits
    assert any(v[0] == "_decode" and not v[2]["DENSE"] for v in variants)  # (the eager CSR decode)


def extend_launches(variants: list) -> None:
    """The extend kernel as the engine launches it: unquantized, in each model dtype, a
    mixed step from the step buffers (`begin_buffered_step`: two decodes beside a prompt's
    16-token chunk); on each 8-bit format read in place (TritonQuantBackend, bf16 compute:
    prompts leaving partial blocks, then a decode beside a chunk over a cached prefix)."""
    from kvpool.attention.backends.paged_step import PagedStepMetadata
    from kvpool.attention.backends.step_buffers import StepBuffers
    from kvpool.attention.backends.triton_paged import TritonPagedBackend
    from kvpool.attention.backends.triton_quant import TritonQuantBackend
    from kvpool.spec.kv_formats import kv_schema
    from kvpool.storage.kv import PagedKVStorage, QuantizedKVStorage

    g = torch.Generator().manual_seed(0)
    for dtype in MODEL_DTYPES:
        pool = PagedKVStorage(1, 16, BLOCK_SIZE, KV_HEADS, HEAD_DIM, dtype, "cpu")
        backend = _backend(TritonPagedBackend, pool, dtype)
        buffers = StepBuffers(256, 512, 8192 // BLOCK_SIZE, BLOCK_SIZE, "cpu", dummy_block=15)
        buffers.update(["a", "b", "c"], [20, 5, 0], [21, 6, 16], [[1, 2], [3], [4]])
        backend.begin_buffered_step(buffers, [1, 1, 16], [21, 6, 16]).attend(0, *_qkv(18, dtype, g))
    tables = [[5, 9, 2], [7, 1, 3, 8]]

    def meta(q_lens: list[int], ctx_lens: list[int]) -> PagedStepMetadata:
        slots, indptr, indices = [], [0], []
        for table, q_len, ctx_len in zip(tables, q_lens, ctx_lens, strict=True):
            slots += [table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(ctx_len - q_len, ctx_len)]
            indices += table[: -(-ctx_len // BLOCK_SIZE)]
            indptr.append(len(indices))
        return PagedStepMetadata(q_lens, ctx_lens, slots, indptr, indices)

    for fmt in QUANT_FORMATS:
        pool = QuantizedKVStorage(1, 16, BLOCK_SIZE, KV_HEADS, HEAD_DIM, kv_schema(fmt), torch.bfloat16, device="cpu")
        backend = _backend(TritonQuantBackend, pool, torch.bfloat16)
        for q_lens, ctx_lens in (([40, 20], [40, 20]), ([1, 30], [41, 50])):
            backend.begin_step(meta(q_lens, ctx_lens)).attend(0, *_qkv(sum(q_lens), torch.bfloat16, g))
    # one sequence decoding at 4,000 tokens: the rule splits its keys (then the merge)
    tables = [list(range(250))]
    pool = QuantizedKVStorage(1, 251, BLOCK_SIZE, KV_HEADS, HEAD_DIM, kv_schema("fp8_e4m3"), torch.bfloat16, "cpu")
    backend = _backend(TritonQuantBackend, pool, torch.bfloat16)
    backend.begin_step(meta([1], [4000])).attend(0, *_qkv(1, torch.bfloat16, g))
    assert any(v[0] == "_merge" for v in variants) and any(
        v[2]["NUM_SPLITS"] > 1 for v in variants if v[2].get("QUANT")
    )
    # every format's codes, by block and by token (the scales' slot stride 0 or 1)
    quantized = {(v[1]["K"], "s_ss" in v[2]) for v in variants if v[0] == "_extend_kernel" and v[2]["QUANT"]}
    assert quantized == {("*fp8e4nv", False), ("*fp8e5", False), ("*fp8e4nv", True), ("*fp8e5", True), ("*i8", True)}, (
        quantized
    )


if __name__ == "__main__":
    variants = compile_on_launch()
    {"decode": decode_launches, "extend": extend_launches}[sys.argv[1]](variants)
    print("compiled", len(variants))
