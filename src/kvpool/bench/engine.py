"""`kvpool bench engine`'s measurement: the engine against transformers, measured side by side in one run.

  1. decode throughput, batch 1 (64-token prompt) and batch 16 (prompts of 16-136 tokens),
     N new tokens each, fp32, ours vs transformers `generate` on the same GGUF;
  2. TTFT of a request whose 1,000-token system prompt is cached, against cold;
  3. paged against contiguous decode attention at batch 16 and 4k context, every sequence's
     blocks scattered over the pool (block size 256, plus the ratio at block sizes 16 and 64);
  4. glue: what a batch-1 step is made of. The matmuls alone (the weight-read floor), one
     call of each torch op against its C kernel, and the sampler's two top-p paths.
Timings on a shared CPU are noisy: run it on an idle machine for the figures of docs/engine.md.
"""

from __future__ import annotations

import math
import os
import random
import time
from collections.abc import Iterable

from kvpool.bench.common import Progress, best_of, no_progress, run_to_completion

# the parts (run as attention, glue, ttft, decode; reported in this order)
PARTS: tuple[str, ...] = ("decode", "ttft", "attention", "glue")


def measure(
    model: str | None = None,
    parts: Iterable[str] = PARTS,
    new_tokens: int = 128,
    block_size: int = 16,
    attn_block_size: int = 256,
    attn_context: int = 4096,
    attn_batch: int = 16,
    skip_hf: bool = False,
    threads: int | None = None,
    progress: Progress = no_progress,
) -> dict:
    """The parts asked for, on `model` (a Llama-, Qwen2- or Qwen3-architecture GGUF file; None:
    the embedded SmolLM2-135M):
    {"threads", "dtype", "kernels", and one section per part}. `block_size` is the engine's
    (parts 1 and 2), `attn_*` the attention comparison's; `skip_hf` leaves transformers out
    (no ratios in part 1); `threads`: torch CPU threads (None: torch's choice)."""
    import torch

    from kvpool.engine.build import load_model
    from kvpool.engine.memory import check_fits

    if model == "tiny-dsv4":
        raise ValueError(
            "bench engine runs smollm2-135m, a Llama-, Qwen2- or Qwen3-architecture GGUF or an HF model directory; "
            "the tiny V4 model is benchmarked by kvpool bench dsv4"
        )
    parts = set(parts)
    if parts - set(PARTS):
        raise ValueError(f"unknown parts {sorted(parts - set(PARTS))}; from {','.join(PARTS)}")
    # the attention part also runs block sizes 16 and 64 over the same context
    block_sizes = math.lcm(attn_block_size, 16, 64)
    if "attention" in parts and attn_context % block_sizes:
        raise ValueError(
            f"--attn-context {attn_context} must be a multiple of {block_sizes} "
            f"(--attn-block-size {attn_block_size}, and 16 and 64 for the block-size ratios)"
        )
    if threads:
        torch.set_num_threads(threads)
    report: dict = {"threads": torch.get_num_threads(), "dtype": "fp32"}
    progress("loading the model")
    loaded = load_model(model, device="cpu")
    report["kernels"] = "native" if loaded.model.kernels is not None else "torch"
    cfg = loaded.model.config
    rng = random.Random(0)

    if "attention" in parts:
        progress("attention")
        shape = (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
        check_fits(
            attention_bytes_needed(attn_batch, attn_context, cfg.num_kv_heads, cfg.head_dim),
            "cpu",
            f"the attention part's --attn-batch {attn_batch} x --attn-context {attn_context}",
            "lower --attn-batch or --attn-context",
        )
        report["attention"] = bench_attention(attn_batch, attn_context, attn_block_size, *shape)
        # smaller blocks: more, shorter K^T rows per bag (16 floats at block size 16)
        report["attention"]["paged_over_contiguous_by_block_size"] = {
            bs: bench_attention(attn_batch, attn_context, bs, *shape, twin=False)["paged_over_contiguous"]
            for bs in (16, 64)
            if bs != attn_block_size
        }

    if "glue" in parts:
        progress("glue")
        report["glue"] = bench_glue(loaded)

    if "ttft" in parts:
        progress("ttft")
        report["ttft"] = bench_ttft(loaded, block_size, rng)

    if "decode" in parts:
        report["decode"] = bench_decode(loaded, model, new_tokens, block_size, skip_hf, rng, progress)
    return report


def attention_bytes_needed(batch: int, context: int, num_kv_heads: int, head_dim: int) -> int:
    """The fp32 memory bench_attention holds at the least: K and V in the paged pool and
    again laid out contiguously for SDPA. (A size past the machine's memory was the
    allocator's traceback.)"""
    return 4 * batch * context * num_kv_heads * head_dim * 4


def bench_attention(
    batch: int, context: int, block_size: int, num_heads: int, num_kv_heads: int, head_dim: int, twin: bool = True
) -> dict:
    """Decode attention at `batch` x `context`, every sequence's blocks scattered over the pool
    (a random permutation: no sequence owns a run of consecutive ids), against SDPA over the
    same K/V laid out contiguously [B, KVH, T, D]. Paths: the C kernel (the engine's, when it
    builds) and the embedding_bag path; twin: also the padded-gather twin.
    paged_over_contiguous is the engine's path (native when built, else bags)."""
    import torch
    import torch.nn.functional as F

    from kvpool.attention.paged import decode_attention, plan_step
    from kvpool.kernels import cpu_kernels

    kernels = cpu_kernels()

    torch.manual_seed(0)
    g = num_heads // num_kv_heads
    nb = context // block_size
    num_blocks = batch * nb
    k_cache = torch.randn(num_blocks, num_kv_heads, head_dim, block_size)  # K^T per block (storage/kv.py)
    v_cache = torch.randn(num_blocks, num_kv_heads, block_size, head_dim)
    perm = torch.randperm(num_blocks).view(batch, nb).tolist()
    indptr = [i * nb for i in range(batch + 1)]
    indices = [b for row in perm for b in row]
    q = torch.randn(batch, num_heads, head_dim)
    scale = head_dim**-0.5
    # the contiguous cache the same K/V would occupy: [B, KVH, T, D]
    idx = torch.tensor(indices).view(batch, nb)
    k_contig = k_cache[idx].permute(0, 2, 1, 4, 3).reshape(batch, num_kv_heads, context, head_dim).contiguous()
    v_contig = v_cache[idx].permute(0, 2, 1, 3, 4).reshape(batch, num_kv_heads, context, head_dim).contiguous()
    qf = q.view(batch, num_kv_heads, g, head_dim)  # GQA folded into rows, as the paged path does

    def contiguous():
        return F.scaled_dot_product_attention(qf, k_contig, v_contig)

    results = {}
    ref = contiguous().reshape(batch, num_heads, head_dim)
    paths = [("paged_native", "native")] if kernels is not None else []
    paths += [("paged_bags", "bags")] + ([("paged_padded", "padded")] if twin else [])
    for name, path in paths:
        plan = plan_step(
            [1] * batch,
            [context] * batch,
            [0] * batch,
            indptr,
            indices,
            block_size,
            num_heads,
            num_kv_heads,
            head_dim,
            torch.device("cpu"),
            decode_path=path,
            kernels=kernels,
        ).decode
        out = decode_attention(q, k_cache, v_cache, plan, scale)
        assert (out - ref).abs().max().item() < 1e-4, "paged attention disagrees with contiguous SDPA"
        results[name] = best_of(lambda plan=plan: decode_attention(q, k_cache, v_cache, plan, scale))
    results["contiguous_sdpa"] = best_of(contiguous)
    c = results["contiguous_sdpa"]
    report = {
        "batch": batch,
        "context": context,
        "block_size": block_size,
        "blocks": "scattered",
        **{f"{k}_ms": round(v * 1e3, 3) for k, v in results.items()},
        "engine_path": "native" if kernels is not None else "bags",
        "paged_over_contiguous": round(results["paged_native" if kernels is not None else "paged_bags"] / c, 3),
        "bags_over_contiguous": round(results["paged_bags"] / c, 3),
    }
    if twin:
        report["padded_gather_over_contiguous"] = round(results["paged_padded"] / c, 3)
    return report


def bench_glue(loaded) -> dict:
    """Batch 1, one token: the step's matmuls alone, per-call times of the torch ops the C
    kernels replace (and of the kernels), and sample_token at top-p 0.9 on real logits
    (nucleus among the first candidates) and on flat ones (the full-sort fallback)."""
    import torch
    import torch.nn.functional as F

    from kvpool.attention.reference import contiguous_step
    from kvpool.engine.sampling import SamplingParams, sample_token

    model = loaded.model
    cfg = model.config
    x = torch.randn(1, cfg.hidden_size)
    act = torch.randn(1, cfg.intermediate_size)
    attn = torch.randn(1, cfg.num_heads * cfg.head_dim)
    gate_up = torch.randn(1, 2 * cfg.intermediate_size)

    def matmuls():
        for layer in model.layers:
            x @ layer["wqkv"], attn @ layer["wo"], x @ layer["w_gate_up"], act @ layer["w_down"]
        model.logits(x)  # the LM head as the step computes it (over the tied embedding)

    # the layers' matrices and the LM head's (the embedding, when tied): what a step reads
    weight_bytes = sum(w.nbytes for layer in model.layers for w in layer.values())
    weight_bytes += (model.embed if model.lm_head is None else model.lm_head).nbytes
    floor = best_of(matmuls, repeat=10)
    report = {
        "matmuls_ms": round(floor * 1e3, 2),
        "weight_mb": round(weight_bytes / 1e6, 1),
        "weight_read_gb_s": round(weight_bytes / floor / 1e9, 1),
    }
    w = model.layers[0]["attn_norm"]
    eps = cfg.rms_norm_eps
    us = {
        "torch_rms_norm": lambda: F.rms_norm(x, (cfg.hidden_size,), w, eps),
        "torch_silu_mul": lambda: F.silu(gate_up[:, : cfg.intermediate_size]) * gate_up[:, cfg.intermediate_size :],
    }
    kern = model.kernels
    if kern is not None:
        out, x2 = torch.empty_like(x), x.clone()
        xp, wp, op = x2.data_ptr(), w.data_ptr(), out.data_ptr()
        us["c_add_rms_norm"] = lambda: kern.lib.kv_add_rms_norm(xp, None, wp, op, 1, cfg.hidden_size, eps)
        us["c_silu_mul"] = lambda: kern.lib.kv_silu_mul(gate_up.data_ptr(), act.data_ptr(), 1, cfg.intermediate_size)
    report.update({f"{k}_us": round(best_of(fn, repeat=200) * 1e6, 1) for k, fn in us.items()})
    ids = loaded.tokenizer.encode_chat([{"role": "user", "content": "Tell me about the sea."}])
    real = model.forward(torch.tensor(ids), torch.arange(len(ids)), contiguous_step(len(ids), [len(ids) - 1]))[0]
    flat = torch.randn(cfg.vocab_size) * 0.01
    params = SamplingParams(temperature=0.7, top_p=0.9, seed=0)
    report["sample_top_p_ms"] = round(best_of(lambda: sample_token(real, params, 0, 0), repeat=50) * 1e3, 3)
    report["sample_top_p_full_sort_ms"] = round(best_of(lambda: sample_token(flat, params, 0, 0), repeat=50) * 1e3, 3)
    return report


def _random_ids(rng: random.Random, n: int, vocab_size: int) -> list[int]:
    """n token ids drawn from [100, 49000) (SmolLM2's vocabulary of 49,152 holds them: its
    benchmark's ids as ever), within a smaller vocabulary (Llama 2's 32,000) its own range:
    a fixed range was refused by the engine after the parts before had run."""
    high = min(49000, vocab_size)
    low = min(100, high // 2)
    return [rng.randrange(low, high) for _ in range(n)]


def bench_ttft(loaded, block_size: int, rng: random.Random) -> dict:
    """Part 2: TTFT (the steps from arrival to the first token) of a 1,000-token system prompt
    plus 20 fresh tokens, cold, then again with the system prompt cached."""
    from kvpool.engine.build import build_engine
    from kvpool.engine.sampling import SamplingParams

    vocab = loaded.model.config.vocab_size
    system = _random_ids(rng, 1000, vocab)
    engine = build_engine(loaded, num_blocks=256, block_size=block_size, max_num_batched_tokens=2048)
    params = SamplingParams(max_tokens=1, ignore_eos=True)

    def ttft(prompt: list[int]) -> tuple[float, int]:
        rid = engine.add_request(prompt, params)
        t0 = time.perf_counter()
        run_to_completion(engine)
        return time.perf_counter() - t0, engine.output(rid).num_cached_tokens

    ttft(system[:64])  # warm-up
    cold, _ = ttft(system + _random_ids(rng, 20, vocab))
    warm, cached = ttft(system + _random_ids(rng, 20, vocab))
    return {
        "system_prompt_tokens": 1000,
        "cold_ms": round(cold * 1e3, 1),
        "cached_ms": round(warm * 1e3, 1),
        "cached_tokens": cached,
        "speedup": round(cold / warm, 2),
    }


def bench_decode(
    loaded,
    model: str | None,
    new_tokens: int,
    block_size: int,
    skip_hf: bool,
    rng: random.Random,
    progress: Progress = no_progress,
) -> dict:
    """Part 1: tokens per second of `engine.generate` at batch 1 (a 64-token prompt) and batch
    16 (16..136 tokens), `new_tokens` each, against transformers `generate` on the same GGUF
    (`model`; None: the embedded one) with left padding, unless `skip_hf`."""
    import torch

    from kvpool.engine.build import build_engine
    from kvpool.engine.sampling import SamplingParams
    from kvpool.models.gguf import default_gguf_path
    from kvpool.models.hf_tokenizer import is_hf_directory

    n = new_tokens
    vocab = loaded.model.config.vocab_size
    batches = {
        "batch1": [_random_ids(rng, 64, vocab)],
        "batch16": [_random_ids(rng, 16 + 8 * i, vocab) for i in range(16)],  # 16..136
    }
    hf = None
    if not skip_hf:
        progress("loading the model into transformers")
        import transformers

        path = model or default_gguf_path()
        if is_hf_directory(path):  # (its safetensors: read as a GGUF named by the folder, a traceback)
            hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        else:
            hf = transformers.AutoModelForCausalLM.from_pretrained(
                os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32
            )
        hf.eval()
    decode = {}
    for name, prompts in batches.items():
        progress(f"decode {name}, kvpool")
        engine = build_engine(
            loaded, num_blocks=512, block_size=block_size, max_num_batched_tokens=1024, max_num_seqs=32
        )
        params = SamplingParams(max_tokens=n, ignore_eos=True)
        engine.generate([prompts[0][:8]], SamplingParams(max_tokens=2, ignore_eos=True))  # warm-up
        t0 = time.perf_counter()
        engine.generate(prompts, params)
        ours = len(prompts) * n / (time.perf_counter() - t0)
        entry = {"ours_tok_s": round(ours, 2), "ours_ms_per_step": round(len(prompts) / ours * 1e3, 1)}
        if hf is not None:
            progress(f"decode {name}, transformers")
            width = max(len(p) for p in prompts)
            ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])  # left padding
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
            with torch.no_grad():
                hf.generate(ids[:, -8:], attention_mask=mask[:, -8:], max_new_tokens=2, do_sample=False, pad_token_id=0)
                t0 = time.perf_counter()
                hf.generate(
                    ids,
                    attention_mask=mask,
                    max_new_tokens=n,
                    min_new_tokens=n,
                    do_sample=False,
                    eos_token_id=None,
                    pad_token_id=0,
                )
            theirs = len(prompts) * n / (time.perf_counter() - t0)
            entry.update({"transformers_tok_s": round(theirs, 2), "speedup": round(ours / theirs, 2)})
        decode[name] = entry
    return decode
