"""`kvpool bench gpu`: kvpool on a CUDA GPU, side by side in one run.

- host: the host's work per decode step at batch B (`host_step`), through the engine's
  own decode path (the Llama executor's static step buffers and `DecodeGraphs`, as a
  CUDA-graph engine runs it): schedule (with the reservation), the step metadata into the
  persistent buffers (StepBuffers: `advance` in place, or `update`), sampling
  (`sample_batch`: its parameter table, launch and one synchronisation) and the
  bookkeeping (commit, the tokens' acceptance, the token ids into the static input, the
  padding to the bucket), with the model's decode step (what a graph replays on the
  device) replaced by logits made once, 16 columns wide (`HOST_VOCAB`: on the CPU a
  kernel's compute over a real vocabulary would be timed as host work): what the host
  adds to every step whatever the GPU does. Greedy, a fixed batch (every step after the
  first advances the buffers in place); beside it the same engine's step with every
  request at temperature / top-p, and with requests finishing and joining every step
  (churn: mixed steps, `update`); a temperature batch of the same rows is timed apart
  (`sample_batch` alone). On a CPU it is a stand-in: a CUDA step's host-to-device copies
  and events, the replay's launch, the logits' clone and the synchronisation do not run.
  Runs on any device (`--parts host` on a machine without CUDA).
- attention: paged decode through the CUDA backend against SDPA on a contiguous copy of
  the same K/V (batch x context 1x4k, 16x4k, 64x4k, 16x32k; Llama-3.1-8B's heads), in
  GB/s of K/V read; extend (a chunk over a cached prefix) against SDPA causal. The paged
  figures time the backend's `attend` (the K/V write and the kernels) over a step planned
  once before the timing; the plan (`begin_step`: the CSR tables made from the cache's
  Python lists and copied to the device) is timed apart on the host, `plan_host_ms`.
- engine, prefill, numerics (gpu_engine.py): the engine's TPOT and tokens/s at batch 1, 32
  and 128 beside transformers on the same weights and a plain torch forward over a
  contiguous cache (a CUDA graph on CUDA, eager on the CPU) and the weight-read floor; an
  8,192-token prefill, the engine against the plain forward; the engine's logits against
  transformers' in fp32 and bf16.

Without CUDA every part runs on the CPU at small shapes (CPU_DECODE_SHAPES, CPU_EXTEND,
gpu_engine.py's TINY model and CPU_SHAPES), in seconds: it checks that the parts run and
what they compare, and is no measure of a GPU. Every section says its device.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from kvpool.bench.common import Progress, no_progress

if TYPE_CHECKING:
    import torch  # (imported where used: `kvpool --help` imports no torch)

DECODE_SHAPES = ((1, 4096), (16, 4096), (64, 4096), (16, 32768))
PRESETS = Path(__file__).resolve().parent.parent / "presets"
DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}  # --dtype -> torch's name


def config_path(model: str) -> Path:
    """An HF config.json path, or a preset's name (src/kvpool/presets: llama-3.1-8b, ...)."""
    p = Path(model)
    if p.exists():
        return p
    preset = PRESETS / f"{model.lower()}.json"
    if preset.exists():
        return preset
    have = ", ".join(sorted(q.stem for q in PRESETS.glob("*.json")))
    raise ValueError(f"--model {model!r}: no such config.json, nor a preset ({have})")


# ---- the host's work per step -----------------------------------------------------------


# The fixed logits' columns. On a GPU the sampler's kernels run on the device and its host
# only launches them and reads back the tokens; on the CPU their compute is host time too
# (torch's argmax over 128 x 512 fp32: ~0.08 ms on the 2-vCPU EPYC, one thread). Over 16
# columns a kernel's compute is ~1 us, so what the sampling figure times is its dispatch,
# the parameter table and the tokens' trip to Python: what a GPU step's host does.
HOST_VOCAB = 16

# The churn workload's requests that finish, and as many that join, every step: one in
# CHURN_EVERY of the batch (4 of 128), at least one.
CHURN_EVERY = 32


def host_step(
    batch: int = 128,
    context: int = 1024,
    num_steps: int = 50,
    block_size: int = 16,
    device: str = "cpu",
    churn: int | None = None,
) -> dict[str, float]:
    """Median milliseconds per decode step of `batch` requests of `context` tokens, by part
    (schedule, metadata, sampling, bookkeeping: the rest of Engine.step) and in all, the
    model's forward replaced by a fixed logits tensor on `device` of `HOST_VOCAB` columns
    (below): greedy, a fixed batch (no request joins or leaves: after the first step every
    step is `StepBuffers.advance` in place). Beside it, the same engine's whole step
    (`_host_engine`'s, the forward replaced alike) in two other workloads: every request
    at temperature 0.8 and top-p 0.95, its own seed (`temperature_step_ms`, its sampling
    `temperature_step_sampling_ms`), and greedy with `churn` requests finishing and as
    many joining every step (`churn_step_ms`: each step a mixed one, the joiners' prompts
    of `context` tokens prefilled in it, the buffers written by `update`, the plan made
    by the Triton backend from the buffers where it runs here; churn None: batch //
    CHURN_EVERY, at least 1), and the same with joiners of one block's prompt
    (`churn_short_step_ms`: the step apart from the joiners' own prefill), and that short
    churn with one request finishing and one joining every step (`churn1_short_step_ms`:
    steady serving's step at batch 128, where about one request leaves and one joins a
    step; issue 30's 0.3 ms of host work a step is checked against it). Also: the
    list-built step tables of the greedy steps (the cache's `step_tables`, what the
    non-buffered backends plan from), and `sample_batch` alone on the same rows at
    temperature 0.8. On the CPU with one intra-op thread: the step's tensors are tiny, and
    on a shared machine waking a second thread for an argmax of 128 x 512 was measured at
    ~30 ms."""
    import torch

    churn = max(1, batch // CHURN_EVERY) if churn is None else churn
    if not 0 < churn < batch:
        raise ValueError(f"churn must be in [1, batch {batch}), got {churn}")
    if device == "cpu" and "triton" not in sys.modules:
        # Triton's backend on the CPU pool runs in its interpreter, which triton reads at its
        # first import (the kernels never run here: `_host_engine` replaces the forward)
        os.environ.setdefault("TRITON_INTERPRET", "1")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        report = _host_step(batch, context, num_steps, block_size, device)
        report.update(_temperature_step(batch, context, num_steps, block_size, device))
        report.update(_churn_step(batch, context, num_steps, block_size, device, churn, context, "churn"))
        # the same churn with joiners of one block's prompt: what the step costs apart from
        # the joiners' own prefill tokens
        report.update(_churn_step(batch, context, num_steps, block_size, device, churn, block_size, "churn_short"))
        # one leaves and one joins each step: steady serving's changed batch
        report.update(_churn_step(batch, context, num_steps, block_size, device, 1, block_size, "churn1_short"))
        return report
    finally:
        torch.set_num_threads(threads)


def _host_engine(batch: int, context: int, num_steps: int, block_size: int, device: str):
    """An engine of `batch` request slots over a 2-layer random Llama whose forward, decode
    (what a graph replays on a GPU) and prefill alike, returns rows of one fixed logits
    tensor [batch * context, HOST_VOCAB] on `device`: (engine, runner, graphs, logits)."""
    import torch

    from kvpool.cache import CacheDescriptor
    from kvpool.engine.engine import Engine
    from kvpool.engine.llama_runner import llama_runner
    from kvpool.engine.memory import check_fits
    from kvpool.models.gguf import LlamaConfig
    from kvpool.models.hf_config import model_bytes, random_llama

    config = LlamaConfig(2, 64, 128, 4, 2, 16, 10000.0, 1e-5, 512, context + num_steps + 8, True)
    blocks_per_seq = -(-(context + num_steps + 2) // block_size)
    num_blocks = batch * blocks_per_seq + 1
    # refused in one line before the first tensor (a --context of 10^12 was the allocator's
    # traceback): the model with its RoPE tables, the fp32 pool, the fixed logits; at least
    # (the step buffers come on top)
    pool_bytes = num_blocks * block_size * config.num_layers * 2 * config.num_kv_heads * config.head_dim * 4
    check_fits(
        model_bytes(config, torch.float32) + pool_bytes + batch * context * HOST_VOCAB * 4,
        device,
        f"the host part's --batch {batch} x --context {context}",
        "lower --batch or --context",
    )
    model = random_llama(config, seed=0, dtype=torch.float32, device=device)
    # the engine's decode path without the model: the static step buffers (what a CUDA
    # graph reads) and DecodeGraphs' padding, its decode step (a replay on a GPU) fixed logits.
    # Not build_engine: it derives the decode mode and batched sampling from the device
    # (neither on a CPU), and this stand-in needs both on any device
    runner = llama_runner(
        model,
        num_blocks,
        block_size,
        CacheDescriptor("bench-host", "seed0"),
        decode_mode="static",
        max_num_seqs=batch,
        max_num_batched_tokens=batch * context,
    )
    executor = runner.executor
    if device == "cpu" and _interpreted_triton():
        # the backend a CUDA engine picks, Triton's, on this CPU pool: a step the buffers
        # hold and the graphs do not take is planned from them (`begin_buffered_step`), as
        # on a GPU; its kernels never run here (the forward is replaced below)
        from kvpool.attention.backends.triton_paged import TritonPagedBackend

        executor.attention = TritonPagedBackend(
            executor.storage, config.num_heads, None, model.dtype, executor.wait_for_loads, decode_path="triton"
        )
    logits = torch.randn(batch * context, HOST_VOCAB, generator=torch.Generator().manual_seed(0)).to(device)
    graphs = executor._graphs
    graphs.forward = lambda num_seqs: logits[:num_seqs]
    # the prefill step: the model's forward replaced alike (a row per sampled chunk)
    runner.executor.model.forward = lambda ids, pos, meta: logits[: len(meta.logit_rows)]
    engine = Engine(runner, max_num_batched_tokens=batch * context, max_num_seqs=batch, batched_sampling=True)
    return engine, runner, graphs, logits


def _interpreted_triton() -> bool:
    """Whether Triton's backend can be built on a CPU pool here: triton installed and its
    kernels made in its interpreter (TRITON_INTERPRET=1 before triton's first import, which
    `host_step` sets on a machine without CUDA when triton is not imported yet)."""
    from kvpool.attention.backends.triton_paged import triton_importable

    if not triton_importable():
        return False
    from kvpool.attention.backends.triton_decode import interpreted

    return interpreted()


def _prompts(n: int, context: int, seed: int) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 512, (context,), generator=g).tolist() for _ in range(n)]


def _timed_step(engine, device: str) -> tuple[float, list[str]]:
    import torch

    began = time.perf_counter()
    finished = engine.step()
    if device != "cpu":
        torch.cuda.synchronize()
    return time.perf_counter() - began, finished


def _temperature_step(batch: int, context: int, num_steps: int, block_size: int, device: str) -> dict[str, float]:
    """The fixed batch's whole engine step with every request at temperature 0.8, top-p
    0.95, each its own seed: the sampler's stochastic path inside the engine."""
    from kvpool.engine.sampling import SamplingParams

    engine, _, graphs, _ = _host_engine(batch, context, num_steps, block_size, device)
    for i, prompt in enumerate(_prompts(batch, context, 1)):
        params = SamplingParams(max_tokens=num_steps + 4, ignore_eos=True, temperature=0.8, top_p=0.95, seed=i)
        engine.add_request(prompt, params)
    engine.step()  # every prefill in one step
    sampling: list[float] = [0.0]
    sample_step = engine._sample_step

    def timed_sample_step(*args):
        began = time.perf_counter()
        out = sample_step(*args)
        sampling[-1] += time.perf_counter() - began
        return out

    engine._sample_step = timed_sample_step
    steps = []
    for _ in range(num_steps):
        sampling.append(0.0)
        steps.append(_timed_step(engine, device)[0])
    assert graphs.num_static == num_steps, "every timed step took the engine's static-buffer decode path"
    return {
        "temperature_step_ms": round(statistics.median(steps) * 1e3, 4),
        "temperature_step_sampling_ms": round(statistics.median(sampling[1:]) * 1e3, 4),
    }


def _churn_step(
    batch: int, context: int, num_steps: int, block_size: int, device: str, churn: int, prompt_len: int, key: str
) -> dict[str, float | str]:
    """Greedy steps of `batch` rows in which `churn` requests finish and `churn` join: the
    first batch's max_tokens staggered (churn of them end at each step), a joiner's
    batch // churn, so each step's finished are replaced before the next and every step
    runs `batch` rows, `churn` of them a new request's `prompt_len`-token prefill. The
    figures' names start with `key`; the step's pieces: schedule (the joiners' admission
    and its prefix lookup included), the step buffers (`update`), the attention backend's
    plan (from the buffers, `begin_buffered_step`, or from the cache's lists, `begin_step`:
    `{key}_plan_path` says which ran), sampling, the commit (the joiners' full blocks
    hashed and registered), and the rest of Engine.step."""
    from kvpool.engine.sampling import SamplingParams

    engine, runner, graphs, _ = _host_engine(batch, context, num_steps, block_size, device)
    for i, prompt in enumerate(_prompts(batch, context, 1)):
        engine.add_request(prompt, SamplingParams(max_tokens=2 + i // churn, ignore_eos=True))
    joiner = SamplingParams(max_tokens=batch // churn, ignore_eos=True)
    prompts = iter(p[:prompt_len] for p in _prompts(num_steps * churn + churn, context, 2))
    engine.step()  # every prefill in one step
    _, finished = _timed_step(engine, device)  # the first decode: `churn` finish
    buffers, attention = runner.step_buffers, runner.executor.attention
    advanced_before, static_before = buffers.num_advanced, graphs.num_static
    changed_before = buffers.num_advanced_changed
    planned_before = runner.executor.num_buffered_steps
    timed: dict[str, list[float]] = {k: [] for k in ("schedule", "metadata", "plan", "sampling", "commit")}
    lists_planned = [0]  # steps the backend planned from the cache's lists

    def timer(name: str, fn: Callable, counter: list[int] | None = None) -> Callable:
        def call(*args, **kwargs):
            began = time.perf_counter()
            out = fn(*args, **kwargs)
            timed[name][-1] += time.perf_counter() - began
            if counter is not None:
                counter[0] += 1
            return out

        return call

    engine.schedule = timer("schedule", engine.schedule)
    buffers.update = timer("metadata", buffers.update)
    buffers.advance = timer("metadata", buffers.advance)
    attention.begin_step = timer("plan", attention.begin_step, lists_planned)
    if hasattr(attention, "begin_buffered_step"):
        attention.begin_buffered_step = timer("plan", attention.begin_buffered_step)
    engine._sample_step = timer("sampling", engine._sample_step)
    runner.commit_step = timer("commit", runner.commit_step)
    steps, rows, prompt_tokens, num_finished = [], 0, 0, 0
    for _ in range(num_steps):
        for _ in finished:
            prompt = next(prompts)
            prompt_tokens += len(prompt)
            engine.add_request(prompt, joiner)
        rows += len(engine.running) + len(engine.waiting)
        for values in timed.values():
            values.append(0.0)
        elapsed, finished = _timed_step(engine, device)
        steps.append(elapsed)
        num_finished += len(finished)
    for obj, name in ((engine, "schedule"), (buffers, "update"), (buffers, "advance"), (attention, "begin_step")):
        delattr(obj, name)
    for obj, name in ((attention, "begin_buffered_step"), (engine, "_sample_step"), (runner, "commit_step")):
        if name in vars(obj):
            delattr(obj, name)
    buffered = runner.executor.num_buffered_steps - planned_before
    paths = [f"{buffered} from the step buffers (begin_buffered_step)"] if buffered else []
    paths += [f"{lists_planned[0]} from the cache's lists (begin_step)"] if lists_planned[0] else []
    # the printed pieces add up to the printed step: the rest is what they leave
    step = round(statistics.median(steps) * 1e3, 4)
    pieces = {name: round(statistics.median(values) * 1e3, 4) for name, values in timed.items()}
    report: dict[str, float | str] = {f"{key}_step_ms": step}
    report.update({f"{key}_{name}_ms": ms for name, ms in pieces.items()})
    report[f"{key}_rest_ms"] = round(step - sum(pieces.values()), 4)
    report.update(
        {
            f"{key}_attention_backend": attention.name,
            f"{key}_plan_path": ", ".join(paths),
            f"{key}_rows_per_step": round(rows / num_steps, 2),
            f"{key}_prompt_tokens_per_step": round(prompt_tokens / num_steps, 2),
            f"{key}_finished_per_step": round(num_finished / num_steps, 2),
            f"{key}_steps_advanced_in_place": buffers.num_advanced - advanced_before,
            # (a changed batch moved on from the last step's vectors, only its new rows written)
            f"{key}_steps_advanced_changed": buffers.num_advanced_changed - changed_before,
            f"{key}_decode_only_steps": graphs.num_static - static_before,
        }
    )
    return report


def _host_step(batch: int, context: int, num_steps: int, block_size: int, device: str) -> dict[str, float]:
    import torch

    from kvpool.engine.batch_sampler import sample_batch
    from kvpool.engine.sampling import SamplingParams

    engine, runner, graphs, logits = _host_engine(batch, context, num_steps, block_size, device)
    params = SamplingParams(max_tokens=num_steps + 4, ignore_eos=True)
    for prompt in _prompts(batch, context, 1):
        engine.add_request(prompt, params)
    engine.step()  # every prefill in one step
    timed: dict[str, list[float]] = {"schedule": [], "metadata": [], "sampling": [], "step": [], "tables": []}

    def timer(name: str, fn: Callable) -> Callable:
        def call(*args, **kwargs):
            began = time.perf_counter()
            out = fn(*args, **kwargs)
            timed[name][-1] += time.perf_counter() - began
            return out

        return call

    engine.schedule = timer("schedule", engine.schedule)
    runner.step_buffers.update = timer("metadata", runner.step_buffers.update)
    runner.step_buffers.advance = timer("metadata", runner.step_buffers.advance)
    engine._sample_step = timer("sampling", engine._sample_step)
    writes_before = runner.step_buffers.num_table_writes
    advanced_before = runner.step_buffers.num_advanced
    for _ in range(num_steps):
        for values in timed.values():
            values.append(0.0)
        timed["step"][-1] = _timed_step(engine, device)[0]
        running = [s.seq_id for s in engine.running]
        ends = [runner.num_computed_tokens(r) for r in running]  # (the last step's tables again)
        began = time.perf_counter()
        runner.cache.step_tables(running, [e - 1 for e in ends], ends, check=False)
        timed["tables"][-1] = time.perf_counter() - began
    # a temperature batch of the same rows, sampled as the engine's batched step samples
    seqs = engine.running
    hot = [SamplingParams(max_tokens=1, temperature=0.8, seed=i) for i in range(len(seqs))]
    indices = [seq.sample_index for seq in seqs]
    positions = [seq.num_output_tokens for seq in seqs]
    timed["temperature"] = []
    for _ in range(num_steps):
        began = time.perf_counter()
        sample_batch(logits[: len(seqs)], hot, indices, positions)
        if device != "cpu":
            torch.cuda.synchronize()
        timed["temperature"].append(time.perf_counter() - began)
    ms = {name: statistics.median(values) * 1e3 for name, values in timed.items()}
    # the step's pieces as printed: the rest is what the printed step leaves, so they add up
    step, schedule, metadata, sampling = (round(ms[k], 4) for k in ("step", "schedule", "metadata", "sampling"))
    assert graphs.num_static == num_steps, "every timed step took the engine's static-buffer decode path"
    return {
        "batch": batch,
        "context": context,
        "steps": num_steps,
        "device": device,
        "step_ms": step,
        "schedule_ms": schedule,
        "metadata_ms": metadata,
        "sampling_ms": sampling,
        "bookkeeping_ms": round(step - schedule - metadata - sampling, 4),
        "list_step_tables_ms": round(ms["tables"], 4),
        "temperature_sampling_ms": round(ms["temperature"], 4),
        "vocab": HOST_VOCAB,
        "table_entries_written_per_step": round((runner.step_buffers.num_table_writes - writes_before) / num_steps, 2),
        "steps_advanced_in_place": runner.step_buffers.num_advanced - advanced_before,
        "decode_path": "static step buffers, padded to bucket " + ",".join(map(str, sorted(graphs.steps_by_bucket))),
    }


# ---- attention: the paged backend against SDPA on a contiguous copy --------------------------

LLAMA_8B_HEADS = (32, 8, 128)  # Llama-3.1-8B's attention: query heads, KV heads, head dim
# Without CUDA the attention part runs these (the same heads, short contexts): the CPU backend
# against SDPA on the CPU, bounded to a second or so, no GPU figure
CPU_DECODE_SHAPES = ((1, 512), (4, 512))
CPU_EXTEND = (1, 256, 64)  # batch, context, chunk
CPU_REPEAT = 5  # samples of one call each on the CPU (a GPU's: `repeat` of `inner` calls)


def _device_time(fn: Callable[[], object], device: str, repeat: int = 20, inner: int = 5) -> float:
    """Median seconds of one call of `fn` on `device`: each of `repeat` samples times `inner`
    calls back to back (on CUDA between two events, so the host's launches of a call run ahead
    of the GPU behind the one before it and the events count the kernels, not the host's
    Python between them; on the CPU the wall clock of CPU_REPEAT single calls), after two
    warm-up calls."""
    import torch

    fn()
    fn()
    times = []
    for _ in range(repeat if device == "cuda" else CPU_REPEAT):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(inner):
                fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3 / inner)
        else:
            began = time.perf_counter()
            fn()
            times.append(time.perf_counter() - began)
    return statistics.median(times)


def _host_time(fn: Callable[[], object], device: str, repeat: int = 10) -> float:
    """Median wall seconds of `fn` on the host, the device synchronised after each call (what
    the host spends making a step's plan, its copies to the device included)."""
    import torch

    fn()
    times = []
    for _ in range(repeat if device == "cuda" else CPU_REPEAT):
        began = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - began)
    return statistics.median(times)


def _paged_case(
    batch: int,
    context: int,
    q_len: int,
    dtype: torch.dtype,
    device: str = "cuda",
    heads: tuple[int, int, int] = LLAMA_8B_HEADS,
    block_size: int = 16,
    seed: int = 0,
):
    """A one-layer pool of `heads` (query heads, KV heads, head dim; Llama-3.1-8B's by
    default) holding `batch` sequences of `context` tokens in scattered blocks on `device`;
    the backend the engine picks for it there (CUDA: Triton's where it imports; the CPU:
    the torch bags path); the step's metadata (q_len new tokens a sequence, the last of its
    context), q [batch * q_len, H, D] and the new k / v [batch * q_len, KVH, D]; and the
    same K / V as contiguous [batch, KVH, context, D]."""
    import torch

    from kvpool.attention.backends import PagedStepMetadata, select_backend
    from kvpool.storage.kv import PagedKVStorage

    num_heads, kv_heads, dim = heads
    per_seq = -(-context // block_size)
    g = torch.Generator(device=device).manual_seed(seed)
    storage = PagedKVStorage(1, batch * per_seq, block_size, kv_heads, dim, dtype, device)
    k = torch.randn(batch, context, kv_heads, dim, generator=g, device=device).to(dtype)
    v = torch.randn(batch, context, kv_heads, dim, generator=g, device=device).to(dtype)
    order = torch.randperm(batch * per_seq, generator=torch.Generator().manual_seed(seed)).tolist()
    tables = [order[i * per_seq : (i + 1) * per_seq] for i in range(batch)]
    slots = [t[p // block_size] * block_size + p % block_size for t in tables for p in range(context)]
    index = storage.write_index(torch.tensor(slots, dtype=torch.long, device=device))
    storage.write(0, index, k.reshape(-1, kv_heads, dim), v.reshape(-1, kv_heads, dim))
    key, backend = select_backend("full", "paged", device)
    attention = backend(storage, num_heads, None, dtype, decode_path=key.impl)
    step_slots = [
        t[p // block_size] * block_size + p % block_size for t in tables for p in range(context - q_len, context)
    ]
    indptr = [i * per_seq for i in range(batch + 1)]
    meta = PagedStepMetadata([q_len] * batch, [context] * batch, step_slots, indptr, [b for t in tables for b in t])
    q = torch.randn(batch * q_len, num_heads, dim, generator=g, device=device).to(dtype)
    new_k = k[:, context - q_len :].reshape(-1, kv_heads, dim)
    new_v = v[:, context - q_len :].reshape(-1, kv_heads, dim)
    return key.impl, attention, meta, q, new_k, new_v, k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous()


def decode_attention(
    dtype: torch.dtype,
    shapes=DECODE_SHAPES,
    progress: Progress = no_progress,
    device: str = "cuda",
    heads: tuple[int, int, int] = LLAMA_8B_HEADS,
) -> list[dict]:
    """Per (batch, context): one layer's paged decode step (the K/V write and the attention)
    over a plan made once before the timing, and SDPA over contiguous K / V, their
    milliseconds and GB/s of K / V read, the largest difference of their outputs, and the
    host's time to make the step's plan (`plan_host_ms`, timed apart: the backend's
    `begin_step` builds its tables from Python lists, which on a GPU would otherwise leave
    the device idle inside the timed window)."""
    rows = []
    for batch, context in shapes:
        progress(f"decode attention {batch}x{context}")
        rows.append(_decode_row(batch, context, dtype, device, heads))
    return rows


def _decode_row(batch: int, context: int, dtype: torch.dtype, device: str, heads: tuple[int, int, int]) -> dict:
    import torch

    num_heads, _, dim = heads
    impl, attention, meta, q, k_new, v_new, k, v = _paged_case(batch, context, 1, dtype, device, heads)
    qs = q.view(batch, num_heads, 1, dim)
    plan_s = _host_time(lambda: attention.begin_step(meta), device)
    step = attention.begin_step(meta)  # the plan, made once: every timed call attends over it

    def paged():
        return step.attend(0, q, k_new, v_new)

    def sdpa():
        return torch.nn.functional.scaled_dot_product_attention(qs, k, v, enable_gqa=True)

    kv_bytes = k.nbytes + v.nbytes
    paged_s, sdpa_s = _device_time(paged, device), _device_time(sdpa, device)
    got, want = paged().view(batch, num_heads, dim).float(), sdpa().view(batch, num_heads, dim).float()
    return {
        "batch": batch,
        "context": context,
        "backend": impl,
        "paged_ms": round(paged_s * 1e3, 4),
        "sdpa_ms": round(sdpa_s * 1e3, 4),
        "paged_gb_s": round(kv_bytes / paged_s / 1e9, 1),
        "sdpa_gb_s": round(kv_bytes / sdpa_s / 1e9, 1),
        "paged_over_sdpa": round(sdpa_s / paged_s, 3),
        "plan_host_ms": round(plan_s * 1e3, 4),
        "max_abs_diff": (got - want).abs().max().item(),
    }


def extend_attention(
    dtype: torch.dtype,
    batch: int = 4,
    context: int = 4096,
    chunk: int = 512,
    progress: Progress = no_progress,
    device: str = "cuda",
    heads: tuple[int, int, int] = LLAMA_8B_HEADS,
) -> dict:
    """A chunk of `chunk` new tokens a sequence over a cached prefix (context - chunk):
    the paged step over a plan made once before the timing against SDPA causal over the
    contiguous K / V (the chunk's queries at the end of the context: a bottom-right causal
    mask); the plan's host time apart (`plan_host_ms`)."""
    import torch

    num_heads, _, dim = heads
    progress(f"extend attention {batch}x{context} chunk {chunk}")
    impl, attention, meta, q, k_new, v_new, k, v = _paged_case(batch, context, chunk, dtype, device, heads)
    qs = q.view(batch, chunk, num_heads, dim).transpose(1, 2)
    mask = torch.ones(chunk, context, dtype=torch.bool, device=device).tril(context - chunk)
    plan_s = _host_time(lambda: attention.begin_step(meta), device)
    step = attention.begin_step(meta)

    def paged():
        return step.attend(0, q, k_new, v_new)

    def sdpa():
        return torch.nn.functional.scaled_dot_product_attention(qs, k, v, attn_mask=mask, enable_gqa=True)

    paged_s, sdpa_s = _device_time(paged, device, 10), _device_time(sdpa, device, 10)
    got, want = paged().view(batch, chunk, num_heads, dim).float(), sdpa().transpose(1, 2).float()
    return {
        "batch": batch,
        "context": context,
        "chunk": chunk,
        "backend": impl,
        "paged_ms": round(paged_s * 1e3, 4),
        "sdpa_ms": round(sdpa_s * 1e3, 4),
        "paged_over_sdpa": round(sdpa_s / paged_s, 3),
        "plan_host_ms": round(plan_s * 1e3, 4),
        "max_abs_diff": (got - want).abs().max().item(),
    }


PARTS = ("host", "attention", "engine", "prefill", "numerics")


def measure(
    parts: tuple[str, ...] = PARTS,
    model: str | None = None,
    dtype: str = "bf16",
    batch: int = 128,
    context: int = 1024,
    progress: Progress = no_progress,
    enforce_eager: bool = False,
) -> dict:
    """The parts asked for (PARTS) in one report, on CUDA where it is, else on the CPU at
    the CPU's shapes (CPU_DECODE_SHAPES, CPU_EXTEND; gpu_engine.py's TINY model and
    CPU_SHAPES unless `model`): seconds, and no GPU figure."""
    import torch

    from kvpool.bench.gpu_engine import engine_tpot, numerics, prefill

    torch_dtype = getattr(torch, DTYPES[dtype])
    device = "cuda" if torch.cuda.is_available() else "cpu"
    report: dict = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "dtype": dtype}
    if "host" in parts:
        progress("host work per step")
        report["host"] = host_step(batch=batch, context=context, device=device)
    threads = torch.get_num_threads()
    if device == "cpu":
        # the CPU's shapes are small: on a shared machine a second intra-op thread costs
        # more to wake than it saves (host_step's docstring)
        torch.set_num_threads(1)
    try:
        if "attention" in parts:
            if device == "cuda":
                report["decode_attention"] = decode_attention(torch_dtype, progress=progress)
                report["extend_attention"] = extend_attention(torch_dtype, progress=progress)
            else:
                shapes = CPU_DECODE_SHAPES
                report["decode_attention"] = decode_attention(torch_dtype, shapes, progress, device)
                report["extend_attention"] = extend_attention(torch_dtype, *CPU_EXTEND, progress, device)
        if "engine" in parts:
            report["engine"] = engine_tpot(
                model, torch_dtype, progress=progress, enforce_eager=enforce_eager, device=device
            )
        if "prefill" in parts:
            report["prefill"] = prefill(model, torch_dtype, progress=progress, device=device)
        if "numerics" in parts:
            progress("numerics against transformers")
            report["numerics"] = numerics(device, progress=progress)
    finally:
        torch.set_num_threads(threads)
    return report
