"""`kvpool bench gpu`'s engine parts: the engine beside transformers and a plain forward on
the same random weights (models/hf_config.py), and its numerics against transformers.

- `engine_tpot`: TPOT and tokens/s at batch 1, 32 and 128, greedy, of the engine (decode
  steps replayed from CUDA graphs on CUDA unless enforce_eager), of transformers'
  LlamaForCausalLM decoding with its own KV cache, and of a plain torch forward over a
  contiguous cache (a CUDA graph on CUDA, eager on the CPU: gpu_baselines.py), all on the
  same prompts; and the weight-read floor (the weights' bytes at the measured copy rate).
- `prefill`: one prompt of `prompt_len` tokens (8,192 on a GPU) prefilled by the engine in
  one chunk, against the plain forward's prefill.
- `numerics`: the engine's own logits (its paged cache, chunked prefill over a cached
  prefix and decode steps, through the backend it picks on the device: Triton's on CUDA;
  on the CPU its CPU backend and, where triton imports in its interpreter, the Triton
  backend) against transformers' fp32 logits of the same tokens. fp32 within 1e-3 of the
  largest logit; bf16 within BF16_FACTOR times transformers' own bf16 error (its bf16
  logits against its fp32 ones on the same tokens).

Shapes: a model from an HF config.json or a preset (`--model`; Llama-3.1-8B by default on
CUDA), or on the CPU by default `TINY`, a 2-layer model whose run takes seconds. The
numerics always use `TINY` (transformers' fp32 twin of an 8B model would not fit beside it).
"""

from __future__ import annotations

import statistics
import time
from typing import TYPE_CHECKING

from kvpool.bench.common import Progress, no_progress
from kvpool.models.gguf import LlamaConfig

if TYPE_CHECKING:
    import torch

ENGINE_BATCHES = (1, 32, 128)
# The CPU's model: 2 layers, hidden 256, 8 query / 2 KV heads of 32, a 1,000-token vocabulary
TINY = LlamaConfig(2, 256, 512, 8, 2, 32, 10000.0, 1e-5, 1000, 2048, False)
# (prompt_len, new_tokens, prefill_len) on a GPU (the shapes) and on the CPU (seconds)
GPU_SHAPES = (128, 128, 8192)
CPU_SHAPES = (32, 16, 512)
FP32_BOUND = 1e-3  # the issue's: fp32 logits within 1e-3 of transformers', relative to the largest
# bf16: the engine's error (against transformers' fp32 logits) within this many times
# transformers' own bf16 error on the same tokens. The two compute the same math in a
# different order (fused projections, paged attention with fp32 accumulation, the cache
# written in bf16), so neither is closer to fp32 by construction; 2x allows the engine an
# error of the same size without letting through a larger one (the engine's logits moved
# by 3% of the largest in one column fail it: tests/test_bench_gpu.py)
BF16_FACTOR = 2.0


def model_config(model: str | None, device: str) -> tuple[str, LlamaConfig]:
    """(name, config) of `--model`: a preset or config.json
    (bench/gpu.py `config_path`); None: Llama-3.1-8B on CUDA, `TINY` on the CPU."""
    from kvpool.bench.gpu import config_path
    from kvpool.models.hf_config import llama_config

    if model is None and device != "cuda":
        return "tiny (2 layers, hidden 256: the CPU's stand-in)", TINY
    hf = llama_config(config_path(model or "llama-3.1-8b"))
    return hf.name, hf.config


def _random_model(name: str, config: LlamaConfig, dtype, device: str):
    """random_llama's model, refused in one line first when it does not fit the device (a
    70B config on one GPU was an out-of-memory traceback halfway through the draw)."""
    from kvpool.engine.memory import check_fits
    from kvpool.models.hf_config import model_bytes, random_llama

    check_fits(model_bytes(config, dtype), device, f"{name} with random weights", "a smaller --model")
    return random_llama(config, seed=0, dtype=dtype, device=device)


def _free(device: str) -> None:
    """Give the memory of the models and engines dropped so far back to the device (the
    engine's graphs and runner hold reference cycles, so collect them first)."""
    import gc

    import torch

    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def _copy_rate(device: str) -> float:
    """Bytes read and written per second by a clone of 256 MiB (16 MiB on the CPU)."""
    import torch

    from kvpool.bench.gpu import _device_time

    scratch = torch.empty(1 << (28 if device == "cuda" else 24), dtype=torch.uint8, device=device)
    return 2 * scratch.nbytes / _device_time(scratch.clone, device, 5, 1)


def _engine(llama, batch: int, max_len: int, budget: int, **options):
    from kvpool.cache import CacheDescriptor
    from kvpool.engine.build import build_engine

    block_size = 16
    return build_engine(
        llama,
        descriptor=CacheDescriptor("bench-gpu", "seed0"),
        num_blocks=batch * -(-(max_len + 1) // block_size) + 1,
        block_size=block_size,
        max_num_seqs=batch,
        max_num_batched_tokens=budget,
        **options,
    )


def engine_tpot(
    model: str | None,
    dtype: torch.dtype,
    batches=ENGINE_BATCHES,
    prompt_len: int | None = None,
    new_tokens: int | None = None,
    progress: Progress = no_progress,
    enforce_eager: bool = False,
    device: str = "cuda",
) -> list[dict]:
    """The model row (its name, the weight-read floor), then per batch: the engine's TPOT
    (the median decode step after the last prefill chunk) and tokens/s, what ran its decode
    steps (decode_mode: "graphs" or "eager", and the graph replays), and on the same prompts
    transformers' and the plain forward's TPOT (gpu_baselines.py) and the engine's ratio
    to each. prompt_len / new_tokens None: GPU_SHAPES on CUDA, CPU_SHAPES on the CPU."""
    import torch

    from kvpool.bench.gpu_baselines import _sync, plain_tpot, transformers_llama, transformers_tpot
    from kvpool.engine.sampling import SamplingParams

    shapes = GPU_SHAPES if device == "cuda" else CPU_SHAPES
    prompt_len = shapes[0] if prompt_len is None else prompt_len
    new_tokens = shapes[1] if new_tokens is None else new_tokens
    if new_tokens < 2:
        raise ValueError(f"new_tokens must be at least 2 (a decode step after the first token), got {new_tokens}")
    name, config = model_config(model, device)
    progress(f"random {name} weights")
    llama = _random_model(name, config, dtype, device)
    weight_bytes = llama.weight_bytes()
    copy_rate = _copy_rate(device)
    g = torch.Generator().manual_seed(0)
    prompts = {b: torch.randint(0, config.vocab_size, (b, prompt_len), generator=g) for b in batches}
    rows = []
    for batch in batches:
        progress(f"engine batch {batch}")
        # on CUDA the builder replays decode steps from graphs (unless enforce_eager) and
        # samples a step's rows on the device, as `kvpool run` does
        engine = _engine(llama, batch, prompt_len + new_tokens, max(2048, prompt_len), enforce_eager=enforce_eager)
        runner = engine.runner
        params = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
        for prompt in prompts[batch].tolist():
            engine.add_request(prompt, params)
        step_s: list[float] = []
        unfinished = batch
        while engine.has_unfinished():
            # a decode-only step: every unfinished request is running and has its first
            # token, so its prompt is prefilled (a request's num_computed is no sign: it may
            # be admitted, and its prefill planned, inside the step)
            decode_only = len(engine.running) == unfinished and all(
                len(s.token_ids) > s.request.num_prompt_tokens for s in engine.running
            )
            began = time.perf_counter()
            unfinished -= len(engine.step())
            _sync(device)
            if decode_only:
                step_s.append(time.perf_counter() - began)
        tpot = statistics.median(step_s)
        graphs = runner.executor._graphs
        rows.append(
            {
                "batch": batch,
                "tpot_ms": round(tpot * 1e3, 3),
                "tok_s": round(batch / tpot, 1),
                "decode_path": runner.executor.last_decode_path,
                # what ran the decode steps: graphs off by --enforce-eager, or because the
                # backend cannot read the step buffers (decode_mode "eager" then)
                "decode_mode": runner.executor.decode_mode,
                "decode_steps": len(step_s),  # the steps timed: every one after the last prefill chunk
                "graph_replays": 0 if graphs is None else graphs.num_replays,
            }
        )
        del engine, runner, graphs
    del llama  # transformers' copy of the weights next (an 8B model twice would crowd a GPU)
    _free(device)
    progress(f"transformers' {name} on the same weights")
    hf = transformers_llama(config, 0, dtype, device)
    for row in rows:
        batch = row["batch"]
        progress(f"transformers and the plain forward, batch {batch}")
        ids = prompts[batch].to(device)
        theirs = transformers_tpot(hf, ids, new_tokens)
        plain = plain_tpot(hf, ids, new_tokens)
        row.update(
            {
                "transformers_tpot_ms": round(theirs["tpot_s"] * 1e3, 3),
                "transformers_tok_s": round(batch / theirs["tpot_s"], 1),
                "plain_tpot_ms": round(plain["tpot_s"] * 1e3, 3),
                "plain_tok_s": round(batch / plain["tpot_s"], 1),
                "plain_decode": plain["decode"],  # "cuda graph", or "eager (CPU)"
                "tpot_over_transformers": round(row["tpot_ms"] / (theirs["tpot_s"] * 1e3), 3),
                "tpot_over_plain": round(row["tpot_ms"] / (plain["tpot_s"] * 1e3), 3),
            }
        )
    head = {
        "model": name,
        "device": device,
        "prompt_len": prompt_len,
        "new_tokens": new_tokens,
        "weight_bytes": weight_bytes,
        "copy_gb_s": round(copy_rate / 1e9, 1),
        "weight_read_ms": round(weight_bytes / copy_rate * 1e3, 3),
    }
    return [head, *rows]


def prefill(
    model: str | None,
    dtype: torch.dtype,
    prompt_len: int | None = None,
    runs: int = 3,
    progress: Progress = no_progress,
    device: str = "cuda",
) -> dict:
    """Seconds to prefill one prompt of prompt_len tokens (None: 8,192 on CUDA, CPU_SHAPES'
    on the CPU): the engine's step (one chunk: max_num_batched_tokens = prompt_len; the K/V
    written to its paged cache; the first token sampled), median of `runs` after a warm-up,
    each a new random prompt (no prefix hit), against the plain forward's prefill
    (gpu_baselines.py `plain_prefill_s`) on the same weights."""
    import torch

    from kvpool.bench.gpu_baselines import _sync, plain_prefill_s, transformers_llama
    from kvpool.engine.sampling import SamplingParams

    prompt_len = (GPU_SHAPES if device == "cuda" else CPU_SHAPES)[2] if prompt_len is None else prompt_len
    name, config = model_config(model, device)
    if prompt_len + 1 > config.max_position:
        raise ValueError(f"a {prompt_len}-token prefill exceeds {name}'s {config.max_position} positions")
    progress(f"prefill of {prompt_len} tokens")
    llama = _random_model(name, config, dtype, device)
    engine = _engine(llama, 1, prompt_len + 1, prompt_len, enable_prefix_caching=False)
    g = torch.Generator().manual_seed(1)
    times = []
    for i in range(runs + 1):
        engine.add_request(
            torch.randint(0, config.vocab_size, (prompt_len,), generator=g).tolist(),
            SamplingParams(max_tokens=1, ignore_eos=True),
        )
        _sync(device)
        began = time.perf_counter()
        engine.step()
        _sync(device)
        assert not engine.has_unfinished(), "the prompt was prefilled in one step"
        if i:
            times.append(time.perf_counter() - began)
    engine_s = statistics.median(times)
    del engine, llama
    _free(device)
    plain_s = plain_prefill_s(transformers_llama(config, 0, dtype, device), prompt_len, runs)
    return {
        "model": name,
        "prompt_len": prompt_len,
        "engine_ms": round(engine_s * 1e3, 3),
        "plain_ms": round(plain_s * 1e3, 3),
        "engine_over_plain": round(engine_s / plain_s, 3),
    }


NUMERICS_PROMPT = 40  # tokens: prefilled in chunks of 16 (16, 16, 8), each over the cached prefix
NUMERICS_NEW = 8


def _engine_logits(
    dtype: torch.dtype, device: str, prompt: list[int], triton: bool
) -> tuple[list[int], torch.Tensor, str]:
    """The engine's greedy run of `prompt` on `TINY` (seed 1) in `dtype`: its tokens (prompt
    and output), the logits it sampled each output token from [NUMERICS_NEW, vocab] fp32
    (fp64 in an fp64 run, kept for tests/test_bench_gpu.py's exactness check), and its
    attention backend's name. triton: the Triton backend on a CPU pool (its
    interpreter), as a CUDA engine has it."""
    import torch

    from kvpool.engine.sampling import SamplingParams
    from kvpool.models.hf_config import random_llama

    llama = random_llama(TINY, seed=1, dtype=dtype, device=device)
    engine = _engine(llama, 2, len(prompt) + NUMERICS_NEW, 16, record_logits=True)
    executor = engine.runner.executor
    if triton and device == "cpu":
        from kvpool.attention.backends.triton_paged import TritonPagedBackend

        executor.attention = TritonPagedBackend(
            executor.storage, TINY.num_heads, None, dtype, executor.wait_for_loads, decode_path="triton"
        )
    engine.add_request(prompt, SamplingParams(max_tokens=NUMERICS_NEW, ignore_eos=True), "numerics")
    while engine.has_unfinished():
        engine.step()
    seq = engine.requests["numerics"].seqs[0]
    logits = torch.stack(seq.logits)
    return list(seq.token_ids), logits if logits.dtype == torch.float64 else logits.float(), executor.attention.name


def _transformers_logits(model, tokens: list[int], num_prompt: int) -> torch.Tensor:
    """transformers' logits [len(tokens) - num_prompt, vocab] fp32 of the positions that
    predicted each output token (num_prompt - 1 onwards), over the same tokens."""
    import torch

    device = model.model.embed_tokens.weight.device
    with torch.no_grad():
        return model(torch.tensor([tokens[:-1]], device=device)).logits[0, num_prompt - 1 :].float()


def numerics(
    device: str = "cuda",
    dtypes: tuple[str, ...] = ("fp32", "bf16"),
    triton_on_cpu: bool = False,
    progress: Progress = no_progress,
) -> list[dict]:
    """Per dtype (and on the CPU per backend: the CPU's, and Triton's in its interpreter when
    triton_on_cpu and it runs here): the engine's logits of its own greedy tokens against
    transformers' fp32 logits of the same tokens (`max_rel_diff`: the largest |difference|
    over the largest |logit|), the bound (fp32: FP32_BOUND; bf16: BF16_FACTOR times
    transformers' own bf16 error, `transformers_rel_diff`), `within`, and whether the
    engine's greedy tokens are the argmax of transformers' fp32 logits (`greedy_equal`;
    in bf16 a near-tie may differ without an error, so `within` does not ask for it)."""
    import torch

    from kvpool.bench.gpu import DTYPES, _interpreted_triton
    from kvpool.bench.gpu_baselines import transformers_llama

    prompt = torch.randint(0, TINY.vocab_size, (NUMERICS_PROMPT,), generator=torch.Generator().manual_seed(2)).tolist()
    truth = transformers_llama(TINY, 1, torch.float32, device)
    backends = [False] + ([True] if device == "cpu" and triton_on_cpu and _interpreted_triton() else [])
    rows = []
    for name in dtypes:
        dtype = getattr(torch, DTYPES[name])
        theirs = None if name == "fp32" else transformers_llama(TINY, 1, dtype, device)
        for triton in backends:
            progress(f"numerics {name}{' (triton)' if triton else ''}")
            tokens, got, backend = _engine_logits(dtype, device, prompt, triton)
            want = _transformers_logits(truth, tokens, len(prompt))
            scale = want.abs().max()
            diff = ((got - want).abs().max() / scale).item()
            row = {"dtype": name, "device": device, "backend": backend, "max_rel_diff": diff}
            if theirs is None:
                bound = FP32_BOUND
            else:
                own = ((_transformers_logits(theirs, tokens, len(prompt)) - want).abs().max() / scale).item()
                row["transformers_rel_diff"] = own
                bound = BF16_FACTOR * own
            row.update(
                {
                    "bound": bound,
                    "within": diff <= bound,
                    "greedy_equal": tokens[len(prompt) :] == want.argmax(-1).tolist(),
                    "max_abs_logit": scale.item(),
                }
            )
            rows.append(row)
    return rows
