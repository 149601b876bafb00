"""The engine builder: `build_engine(model, **options)` assembles the runner (cache, storage,
attention backend, tiers) and the engine for a Llama GGUF (`load_model`: weights,
tokenizer, digest), a bare LlamaModel, the tiny V4 model or a tiny hybrid model, through
the plain dict `ENGINE_BUILDERS` keyed by the model's type. `kvpool run`, `generate`,
`serve`, `kvpool.LLM` and the benchmarks and verify programs build their engines here,
except `bench gpu`'s host part (bench/gpu.py `_host_engine`): it needs the static step
buffers (decode_mode "static") and batched sampling on a CPU, which this builder derives
from the device (graphs and batched sampling on CUDA only)."""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import xxhash

from kvpool.cache import CacheDescriptor
from kvpool.cache.dual_pool import RestoreMethod
from kvpool.engine.dsv4_runner import dsv4_runner
from kvpool.engine.engine import Engine
from kvpool.engine.hybrid_runner import attention_for, hybrid_runner
from kvpool.engine.llama_runner import kv_format_for, llama_runner
from kvpool.engine.memory import check_fits, rss_bytes
from kvpool.kernels import cpu_kernels
from kvpool.models import weight_cache
from kvpool.models.gguf import GGUFModel, check_gguf_file, default_gguf_path, file_digest, load_gguf
from kvpool.models.gguf_header import check_header, read_header
from kvpool.models.hf_config import hf_tensors, hf_weight_files, llama_config, model_bytes
from kvpool.models.hf_tokenizer import is_hf_directory, load_hf_tokenizer
from kvpool.models.llama import LlamaModel
from kvpool.models.rope import rope_id
from kvpool.models.tiny_dsv4 import TinyDSV4
from kvpool.models.tiny_hybrid import TinyHybrid
from kvpool.models.tokenizer import ChatTokenizer, build_tokenizer, check_tokenizer_kind, skipped_ids
from kvpool.spec.layout import CacheSpec
from kvpool.storage.dsv4 import DSV4Pools
from kvpool.storage.kv import PagedKVStorage, QuantizedKVStorage
from kvpool.tiers import DEFAULT_DISK_CACHE_BYTES, TierDeadlines
from kvpool.tiers.swa import SWAStrategy


@dataclass
class LoadedModel:
    gguf: GGUFModel
    model: LlamaModel
    tokenizer: ChatTokenizer
    weights_version: str  # the GGUF's digest
    load_s: float = 0.0  # wall time of load_model
    load_source: str = ""  # "weight cache", or "gguf" (with why the cache had nothing usable)
    tokenizer_bytes: int = 0  # resident memory the tokenizer took when it was built


def _file_identity(path: str) -> tuple[int, int, int, int]:
    """What changes when a file is rewritten or replaced: device, inode, size, mtime."""
    st = os.stat(path)
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


def load_model(path: str | None = None, dtype: torch.dtype = torch.float32, device: str | None = None) -> LoadedModel:
    """The GGUF's weights, tokenizer and digest. On fp32 CPU the model runs the C kernels
    (kvpool.kernels) when they build; KVPOOL_NATIVE=0 keeps the plain torch path.

    First the header is read and checked (models/gguf_header.py: architecture, shapes,
    tokenizer kind, quantization types, memory), before the file is hashed: the digest reads
    every byte, and a refused 40 GB file was read whole (~80 s) before it was refused.
    A cached copy of the weights in the model's layout (models/weight_cache.py) is used when
    one matches the GGUF's digest and the layout version: memory-mapped, no GGUF parse.
    Otherwise the tensors are dequantized and fused one layer at a time (the load holds the
    final weights plus at most one layer's staging, and nothing of the file once it
    returns) and stored in the cache for the next start."""
    start = time.perf_counter()
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    path = path or default_gguf_path()
    if is_hf_directory(path):
        return _load_hf_directory(path, dtype, device, start)
    check_gguf_file(path)
    stat = _file_identity(path)
    # everything the header alone refuses, before the digest reads the whole file (~80 s
    # for 40 GB) and before the weight cache's metadata stands in for the file's
    facts = check_header(read_header(path), path)
    check_tokenizer_kind(facts.tokenizer_model, facts.tokenizer_pre)
    # the weights dequantized, refused in one line before the first tensor is read: an 8B
    # GGUF in fp32 (32 GB) on a 16 GB machine was read for minutes until the kernel killed
    # the process
    name = torch.finfo(dtype).dtype if dtype.is_floating_point else dtype
    config = facts.config
    check_fits(
        model_bytes(config, dtype),
        device,
        f"GGUF file {path} ({config.num_layers} layers of hidden {config.hidden_size}) in {name}",
        "a smaller model" + (", or --dtype bf16" if dtype == torch.float32 else ""),
    )
    kernels = cpu_kernels() if torch.device(device).type == "cpu" and dtype == torch.float32 else None
    cache = weight_cache.WeightCache() if weight_cache.enabled() and torch.device(device).type == "cpu" else None
    digest = file_digest(path)
    key = weight_cache.entry_key(digest, dtype) if cache is not None else ""
    cached = cache.load(key) if cache is not None else None
    if cached is not None:
        meta, state = cached
        meta = dataclasses.replace(meta, path=path)  # the same bytes, wherever the file lies now
        model = LlamaModel.from_state(meta.config, state, device, kernels)
        source = "weight cache"
    else:
        gguf_file = load_gguf(path, dtype, digest, facts)  # (the header checked above: not again)
        meta = gguf_file.meta
        model = LlamaModel.from_tensors(meta.config, gguf_file.tensors(dtype), device, kernels)
        del gguf_file
        source = "gguf"
        if cache is not None:
            source = f"gguf ({cache.last_miss} in the weight cache)"
            if _file_identity(path) != stat:  # rewritten while it was read: what was read has no digest
                print(f"kvpool: warning: {path} changed while it was read; not cached", file=sys.stderr)
            else:
                try:
                    cache.store(key, meta, model.state_tensors())
                except OSError as e:  # a full disk or a read-only home: run without the cache
                    source = f"gguf (the weight cache could not be written: {e.strerror or e})"
                    print(
                        f"kvpool: warning: the weight cache in {cache.root} could not be written: {e}", file=sys.stderr
                    )
    before = rss_bytes()
    tokenizer = build_tokenizer(meta.tokenizer)
    tokenizer_bytes = max(0, rss_bytes() - before)
    elapsed = time.perf_counter() - start
    return LoadedModel(meta, model, tokenizer, meta.digest, elapsed, source, tokenizer_bytes)


def hf_weights_version(directory: str) -> str:
    """The weights' version of an HF directory: its safetensors files' content digests (the
    descriptor's, as a GGUF's digest is: other weights never hit the tiers' blocks)."""
    return "safetensors:" + "-".join(file_digest(f) for f in hf_weight_files(directory))


def _load_hf_directory(path: str, dtype: torch.dtype, device: str, start: float) -> LoadedModel:
    """An HF model directory (config.json, safetensors, tokenizer.json): its tokenizer read
    first (a directory without one refused before the weights are hashed or read), then
    its config, digest and weights (models/hf_config.py; no weight cache)."""
    path = os.path.normpath(path)
    before = rss_bytes()
    tokenizer = load_hf_tokenizer(path)
    tokenizer_bytes = max(0, rss_bytes() - before)
    hf = llama_config(path)
    name = torch.finfo(dtype).dtype if dtype.is_floating_point else dtype
    check_fits(
        model_bytes(hf.config, dtype),
        device,
        f"HF model {path} ({hf.config.num_layers} layers of hidden {hf.config.hidden_size}) in {name}",
        "a smaller model" + (", or --dtype bf16" if dtype == torch.float32 else ""),
    )
    vocab = tokenizer.tokenizer.get_vocab_size(with_added_tokens=True)
    if vocab > hf.config.vocab_size:
        raise ValueError(
            f"{path}: tokenizer.json has {vocab} tokens, past config.json's vocab_size {hf.config.vocab_size}"
        )
    version = hf_weights_version(path)
    kernels = cpu_kernels() if torch.device(device).type == "cpu" and dtype == torch.float32 else None
    model = LlamaModel.from_tensors(hf.config, hf_tensors(path, hf.config, dtype), device, kernels)
    meta = GGUFModel(path, hf.config, None, "safetensors", version)  # (no GGUF: its tokenizer is `tokenizer`)
    return LoadedModel(meta, model, tokenizer, version, time.perf_counter() - start, "safetensors", tokenizer_bytes)


def descriptor_for(loaded: LoadedModel, block_size: int, kv_format: str | None = None) -> CacheDescriptor:
    """Everything the cache's bytes depend on; the layout names the KV storage format, so a
    block of one format never serves another."""
    cfg = loaded.model.config
    fmt = kv_format_for(loaded.model, kv_format)
    dtype = fmt.schema_id if fmt is not None else str(loaded.model.dtype).removeprefix("torch.")
    if loaded.model.shard is not None:  # tensor parallel: this rank's KV heads only
        rank, world = loaded.model.shard
        dtype += f":tp-rank{rank}-of{world}"
    return CacheDescriptor(
        model_id=os.path.basename(loaded.gguf.path),
        weights_version=loaded.weights_version,
        tokenizer_version=loaded.tokenizer.version,
        template_version=xxhash.xxh3_64_hexdigest((loaded.tokenizer.chat_template or "").encode()),
        layout_id=f"L{cfg.num_layers}:kvh{cfg.num_kv_heads}:d{cfg.head_dim}:bs{block_size}:{PagedKVStorage.LAYOUT}:{dtype}",
        rope_id=rope_id(cfg.rope_theta, cfg.rope_freq_divisors),
    )


def cache_spec_for(loaded: LoadedModel, block_size: int) -> CacheSpec:
    """The paged K/V layout of the model's cache: what the storage allocates per block."""
    return _cache_spec(loaded.model, os.path.basename(loaded.gguf.path), block_size)


def _cache_spec(model: LlamaModel, name: str, block_size: int) -> CacheSpec:
    cfg = model.config
    dtype = str(model.dtype).removeprefix("torch.")
    return CacheSpec.uniform(name, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, dtype, block_size=block_size)


def bytes_per_block(loaded: LoadedModel, block_size: int, kv_format: str | None = None) -> int:
    """A block's bytes in the pool: K and V of every layer, or for a quantized format the
    stored block and its share of the dequantization scratch (one layer, compute dtype)."""
    return _bytes_per_block(loaded.model, block_size, kv_format)


def _bytes_per_block(model: LlamaModel, block_size: int, kv_format: str | None) -> int:
    fmt = kv_format_for(model, kv_format)
    if fmt is None:
        return int(_cache_spec(model, "paged", block_size).bytes_per_block)
    cfg = model.config
    per_block = QuantizedKVStorage.block_bytes(cfg.num_layers, block_size, cfg.num_kv_heads, cfg.head_dim, fmt)
    return per_block + QuantizedKVStorage.scratch_block_bytes(block_size, cfg.num_kv_heads, cfg.head_dim, model.dtype)


def num_blocks_for_memory(
    loaded: LoadedModel, block_size: int, kv_memory_bytes: int, kv_format: str | None = None, max_num_seqs: int = 0
) -> int:
    """The blocks `kv_memory_bytes` hold in `kv_format`. A quantized pool also pays, out of the
    same budget, for its dequantization scratch (one layer of the pool, compute dtype) and,
    for the formats quantized a chunk at a time, for the full-precision tails of up to two
    blocks a sequence (KIVI: three), `max_num_seqs` of them (the tail store grows by doubling: the next
    power of two)."""
    return _num_blocks_for_memory(loaded.model, block_size, kv_memory_bytes, kv_format, max_num_seqs)


def _num_blocks_for_memory(
    model: LlamaModel, block_size: int, kv_memory_bytes: int, kv_format: str | None, max_num_seqs: int
) -> int:
    fmt = kv_format_for(model, kv_format)
    cfg = model.config
    reserved = 0
    per_block = _bytes_per_block(model, block_size, kv_format)
    if fmt is not None:
        if fmt.flush(block_size) > 1 and max_num_seqs > 0:
            # a step may hold two a sequence: the block a chunk fills, and the one it opens;
            # KIVI three: the block a chunk completes, and the two its V window may span
            per_seq = 3 if fmt.value_window else 2
            tails = 1 << (per_seq * max_num_seqs - 1).bit_length()
            layer = QuantizedKVStorage.scratch_block_bytes(block_size, cfg.num_kv_heads, cfg.head_dim, model.dtype)
            reserved = tails * cfg.num_layers * layer
    num_blocks = (kv_memory_bytes - reserved) // per_block
    if num_blocks <= 0:
        if reserved:
            raise ValueError(
                f"--kv-memory {kv_memory_bytes} bytes holds no block of {per_block} bytes after the "
                f"{reserved} bytes of full-precision tails that {fmt.name} keeps for --max-num-seqs "
                f"{max_num_seqs}: raise --kv-memory or lower --max-num-seqs"
            )
        raise ValueError(f"--kv-memory {kv_memory_bytes} bytes holds no block of {per_block} bytes")
    return int(num_blocks)


def _tiers(
    host_cache_bytes: int | None,
    disk_cache,
    disk_cache_bytes: int,
    redis_url: str | None,
    deadlines: TierDeadlines | None,
):
    """(host tier or None, the persistent tiers) from the byte, location and deadline options."""
    from kvpool.tiers import HostTier, open_persistent_tiers

    host = HostTier(host_cache_bytes) if host_cache_bytes is not None else None
    return host, open_persistent_tiers(disk_cache, disk_cache_bytes, redis_url, deadlines)


def _llama_engine(loaded: LoadedModel, *, block_size: int = 16, kv_format: str | None = None, **options) -> Engine:
    """A loaded GGUF: its descriptor, and its tokenizer's end-of-turn tokens and text."""
    tok = loaded.tokenizer
    eos = {tok.eos_token_id} if tok.eos_token_id is not None else set()
    eos.update(tok.stop_token_ids)  # an HF directory's generation_config.json
    im_end = tok.tokenizer.token_to_id("<|im_end|>")
    if im_end is not None:
        eos.add(im_end)  # chat models end a turn with <|im_end|>
    return _paged_engine(
        loaded.model,
        descriptor_for(loaded, block_size, kv_format),
        block_size=block_size,
        kv_format=kv_format,
        eos_token_ids=sorted(eos),
        decode_text=tok.decode,
        # the special tokens, which tok.decode skips (skip_special_tokens): no text of a stop string
        textless_ids=sorted(skipped_ids(tok.tokenizer)),
        byte_fallback=tok.byte_fallback,  # (SentencePiece-style: stop strings follow byte runs)
        **options,
    )


def _bare_llama_engine(model: LlamaModel, *, descriptor: CacheDescriptor | None = None, **options) -> Engine:
    """A LlamaModel without a file or a tokenizer (random weights from a config.json, a test's
    model): token ids in and out, no end-of-turn token; `descriptor` names its weights."""
    if not isinstance(descriptor, CacheDescriptor):
        raise TypeError(
            f"build_engine(LlamaModel) needs descriptor=CacheDescriptor(...) naming the model and its weights, "
            f"got {type(descriptor).__name__}"
        )
    return _paged_engine(model, descriptor, **options)


def _paged_engine(
    model: LlamaModel,
    descriptor: CacheDescriptor,
    *,
    num_blocks: int | None = None,
    kv_memory_bytes: int | None = None,
    block_size: int = 16,
    max_num_batched_tokens: int = 512,
    max_num_seqs: int = 64,
    enable_prefix_caching: bool = True,
    record_logits: bool = False,
    host_cache_bytes: int | None = None,
    preemption: str = "recompute",
    disk_cache: str | os.PathLike | None = None,
    disk_cache_bytes: int = DEFAULT_DISK_CACHE_BYTES,
    redis_url: str | None = None,
    tier_deadlines: TierDeadlines | None = None,
    kv_format: str | None = None,
    decode_path: str | None = None,
    enforce_eager: bool = False,
    eos_token_ids: list[int] | None = None,
    decode_text: Callable[[list[int]], str] | None = None,
    textless_ids: list[int] | None = None,
    byte_fallback: dict[int, int] | None = None,
) -> Engine:
    if num_blocks is None:
        num_blocks = (
            1024
            if kv_memory_bytes is None
            else _num_blocks_for_memory(model, block_size, kv_memory_bytes, kv_format, max_num_seqs)
        )
    pool_bytes = num_blocks * _bytes_per_block(model, block_size, kv_format)
    where = f"the KV pool of {num_blocks} blocks of {block_size} tokens"
    check_fits(pool_bytes, model.device, where, "lower --kv-memory or --num-blocks")
    host, persistent = _tiers(host_cache_bytes, disk_cache, disk_cache_bytes, redis_url, tier_deadlines)
    runner = llama_runner(
        model,
        num_blocks,
        block_size,
        descriptor,
        enable_prefix_caching=enable_prefix_caching,
        decode_path=decode_path,
        host_tier=host,
        preemption=preemption,
        persistent_tiers=persistent,
        kv_format=kv_format,
        # CUDA: pure-decode steps replayed from graphs captured per batch bucket (cuda_graph.py)
        decode_mode="eager" if enforce_eager or model.device.type != "cuda" else "graphs",
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
    )
    return Engine(
        runner,
        max_num_batched_tokens=max_num_batched_tokens,
        max_num_seqs=max_num_seqs,
        eos_token_ids=eos_token_ids or (),
        decode_text=decode_text,
        textless_ids=textless_ids or (),
        byte_fallback=byte_fallback,
        record_logits=record_logits,
        # on a GPU a step's rows are sampled on the device with one synchronisation
        batched_sampling=model.device.type == "cuda",
    )


def _dsv4_engine(
    model: TinyDSV4,
    *,
    num_blocks: int | None = None,
    kv_memory_bytes: int | None = None,
    num_state_blocks: int = 16,
    max_num_batched_tokens: int = 512,
    max_num_seqs: int = 16,
    restore: RestoreMethod | None = None,
    enable_prefix_caching: bool = True,
    record_logits: bool = False,
    hot_set_entries: int | None = None,
    host_cache_bytes: int | None = None,
    disk_cache: str | os.PathLike | None = None,
    disk_cache_bytes: int = DEFAULT_DISK_CACHE_BYTES,
    redis_url: str | None = None,
    tier_deadlines: TierDeadlines | None = None,
    swa: SWAStrategy | None = None,
    kv_format: str | None = None,
    indexer_format: str = "fp8",
    turn_end_checkpoints: bool = True,
    preemption: str = "recompute",
) -> Engine:
    kv_format = kv_format or "exact"
    pools = DSV4Pools(  # (sizes only: the runner's pools take the model's dtype)
        model.spec, 1, 1, dtype=model.dtype, entry_format=kv_format, indexer_format=indexer_format
    )
    if num_blocks is None:
        num_blocks = 64
        if kv_memory_bytes is not None:  # classical blocks only: the state blocks come on top
            block_bytes = pools.classical_block_bytes()
            num_blocks = kv_memory_bytes // block_bytes
            if num_blocks <= 0:
                raise ValueError(
                    f"KV memory of {kv_memory_bytes} bytes holds no classical block of {block_bytes} bytes"
                )
    # a pool too large for the machine, told in one line (`kvpool run --model tiny-dsv4
    # --num-blocks 99999999999` or `--max-num-seqs 99999999999`, whose state blocks come
    # with it, ended in a MemoryError traceback)
    num_state = max(num_state_blocks, max_num_seqs)
    if restore is None:  # chosen per admission by measured costs; the persistent tiers restore by their SWA strategy
        restore = "recompute" if disk_cache is not None or redis_url is not None else "auto"
    num_checkpoints = 0 if restore == "recompute" else 8  # state slots after the state blocks
    check_fits(
        num_blocks * pools.classical_block_bytes() + (num_state + num_checkpoints) * pools.state_block_bytes(),
        "cpu",
        f"the dual pool of {num_blocks} classical and {num_state} state blocks",
        "lower --kv-memory, --num-blocks or --max-num-seqs",
    )
    host, persistent = _tiers(host_cache_bytes, disk_cache, disk_cache_bytes, redis_url, tier_deadlines)
    runner = dsv4_runner(
        model,
        num_blocks,
        num_state,
        restore=restore,
        num_checkpoints=num_checkpoints,
        enable_prefix_caching=enable_prefix_caching,
        hot_set_entries=hot_set_entries,
        host_tier=host,
        persistent_tiers=persistent,
        swa=swa,
        kv_format=kv_format,
        indexer_format=indexer_format,
        turn_end_checkpoints=turn_end_checkpoints,
        preemption=preemption,
    )
    return Engine(
        runner, max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs, record_logits=record_logits
    )


def _hybrid_engine(
    model: TinyHybrid,
    *,
    num_blocks: int | None = None,
    num_slots: int = 16,
    block_size: int = 8,
    checkpoint_interval: int = 16,
    max_num_batched_tokens: int = 512,
    max_num_seqs: int = 16,
    enable_prefix_caching: bool = True,
    record_logits: bool = False,
) -> Engine:
    num_blocks = 64 if num_blocks is None else num_blocks
    # (as the dual pool's: --num-blocks or --max-num-seqs, 4 state slots each, past the
    # machine ended in a MemoryError traceback)
    probe = attention_for(model, 1, block_size, 1)  # one block and one slot: their sizes
    block_bytes = sum(g.bytes_per_token for g in probe.groups.values()) * block_size
    slot_bytes = probe.recurrent.bytes_per_slot if model.recurrent_layers() else 0
    check_fits(
        num_blocks * block_bytes + num_slots * slot_bytes,
        "cpu",
        f"a KV cache of {num_blocks} blocks of {block_size} tokens"
        + (f" and {num_slots} recurrent state slots" if slot_bytes else ""),
        "lower --kv-memory, --num-blocks or --max-num-seqs",
    )
    runner = hybrid_runner(
        model,
        num_blocks,
        num_slots,
        block_size=block_size,
        checkpoint_interval=checkpoint_interval,
        enable_prefix_caching=enable_prefix_caching,
    )
    return Engine(
        runner, max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs, record_logits=record_logits
    )


# the model's type -> the part of the builder that makes its runner and engine
ENGINE_BUILDERS: dict[type, Callable[..., Engine]] = {
    LoadedModel: _llama_engine,
    LlamaModel: _bare_llama_engine,
    TinyDSV4: _dsv4_engine,
    TinyHybrid: _hybrid_engine,
}


def build_engine(model: LoadedModel | LlamaModel | TinyDSV4 | TinyHybrid, **options) -> Engine:
    """The engine builder (the module docstring says who uses it): the runner for the
    model's kind, its cache and tiers, the engine over it.

    model: a loaded Llama GGUF (`load_model`), a bare LlamaModel (no tokenizer: it needs
    descriptor=, the CacheDescriptor naming it and its weights), the tiny V4 model, or a
    tiny hybrid model.
    Options every model takes: num_blocks (the KV blocks; V4: classical blocks),
    max_num_batched_tokens, max_num_seqs, enable_prefix_caching, record_logits. Llama and
    V4: kv_memory_bytes (the blocks those bytes hold, when num_blocks is None),
    host_cache_bytes (a host tier below the device pool, kvpool.tiers.HostTier),
    disk_cache / disk_cache_bytes (a crash-safe disk tier, LRU under the limit), redis_url
    (a shared Redis tier; lookups go host -> disk -> Redis), tier_deadlines (the disk and
    Redis tiers' deadlines, kvpool.tiers.TierDeadlines; None: theirs), kv_format (the KV storage
    format: kvpool.storage.quant's names for Llama, None: the model's dtype; "exact" or
    "fp8" for V4). Llama and V4: preemption ("recompute", "swap", "auto": ModelRunner;
    swap and auto need the host tier; V4 swaps its state too). Llama: block_size, decode_path (the attention backend's
    implementation, attention/backends), enforce_eager (no CUDA graphs: on CUDA the decode
    steps are otherwise replayed from graphs, engine/cuda_graph.py). V4: num_state_blocks, restore (None: "auto", or
    "recompute" with disk / Redis tiers), hot_set_entries (HiSparse), swa (tiers/swa.py),
    indexer_format, turn_end_checkpoints (default on, as the simulator's dual layout: a
    finished turn's state block is kept for the next turn to adopt; dsv4_runner's own
    default is off). Hybrid: num_slots, block_size, checkpoint_interval. Every model: seed
    (Engine's: the seeds of requests that give none). An option the
    model's runner does not take is a TypeError naming it."""
    builder = ENGINE_BUILDERS.get(type(model))
    if builder is None:
        kinds = ", ".join(t.__name__ for t in ENGINE_BUILDERS)
        raise TypeError(f"no engine builder for a {type(model).__name__}; one of {kinds}")
    seed = options.pop("seed", 0)
    engine = builder(model, **options)
    engine.reseed(seed)
    return engine


def limit_model_len(engine: Engine, max_model_len: int | None) -> None:
    """Cap the engine's longest request (prompt and output) at `max_model_len` (--max-model-len),
    at most what the model's positions and the KV pool allow (the runner's own limit); None
    keeps that limit. A larger value is a ValueError naming both; so is a context below 2
    tokens, given or the runner's own (one prompt token and one output token at least: every
    request would be refused, each as too long)."""
    if max_model_len is not None:
        most = engine.runner.max_model_len
        if max_model_len > most:
            raise ValueError(
                f"--max-model-len {max_model_len}: this model and KV pool hold at most {most} tokens a request "
                "(a larger --kv-memory or --num-blocks holds more, up to the model's positions)"
            )
    context = engine.runner.max_model_len if max_model_len is None else max_model_len
    if context < 2:
        given = "" if max_model_len is None else f"--max-model-len {max_model_len}: "
        fix = (
            "give a larger --num-blocks / --block-size"  # (the pool's own limit: --max-model-len 2 is past it)
            if max_model_len is None
            else "give --max-model-len 2 or more (or a larger --num-blocks / --block-size)"
        )
        raise ValueError(
            f"{given}a context of {context} token serves no request (one prompt token and one output token at "
            f"least): {fix}"
        )
    if max_model_len is not None:
        engine.runner.max_model_len = max_model_len
