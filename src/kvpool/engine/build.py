"""Assemble an engine for a Llama GGUF: weights, tokenizer, paged cache, runner."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import xxhash

from kvpool.cache import CacheDescriptor
from kvpool.engine.engine import Engine
from kvpool.engine.llama_runner import LlamaRunner
from kvpool.kernels import cpu_kernels
from kvpool.models.gguf import GGUFModel, load_gguf
from kvpool.models.llama import LlamaModel
from kvpool.models.tokenizer import ChatTokenizer, build_tokenizer
from kvpool.spec.layout import CacheSpec
from kvpool.storage.kv import PagedKVStorage


@dataclass
class LoadedModel:
    gguf: GGUFModel
    model: LlamaModel
    tokenizer: ChatTokenizer
    weights_version: str


def file_fingerprint(path: str) -> str:
    """xxh3 of the file's size and first and last MiB: cheap, changes with the weights."""
    size = os.path.getsize(path)
    h = xxhash.xxh3_64()
    h.update(str(size).encode())
    with open(path, "rb") as f:
        h.update(f.read(1 << 20))
        f.seek(max(0, size - (1 << 20)))
        h.update(f.read(1 << 20))
    return h.hexdigest()


def load_model(path: str | None = None, dtype: torch.dtype = torch.float32, device: str | None = None) -> LoadedModel:
    """The GGUF's weights, tokenizer and fingerprint. On fp32 CPU the model runs the C kernels
    (kvpool.kernels) when they build; KVPOOL_NATIVE=0 keeps the plain torch path."""
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    g = load_gguf(path, dtype)
    kernels = cpu_kernels() if torch.device(device).type == "cpu" and dtype == torch.float32 else None
    model = LlamaModel.from_gguf(g, device, kernels)
    return LoadedModel(g, model, build_tokenizer(g.tokenizer), file_fingerprint(g.path))


def descriptor_for(loaded: LoadedModel, block_size: int) -> CacheDescriptor:
    cfg = loaded.model.config
    dtype = str(loaded.model.dtype).removeprefix("torch.")
    return CacheDescriptor(
        model_id=os.path.basename(loaded.gguf.path),
        weights_version=loaded.weights_version,
        tokenizer_version=loaded.tokenizer.version,
        template_version=xxhash.xxh3_64_hexdigest((loaded.tokenizer.chat_template or "").encode()),
        layout_id=f"L{cfg.num_layers}:kvh{cfg.num_kv_heads}:d{cfg.head_dim}:bs{block_size}:{PagedKVStorage.LAYOUT}:{dtype}",
        rope_id=f"rope-half:theta{cfg.rope_theta}",
    )


def cache_spec_for(loaded: LoadedModel, block_size: int) -> CacheSpec:
    """The paged K/V layout of the model's cache: what the storage allocates per block."""
    cfg = loaded.model.config
    dtype = str(loaded.model.dtype).removeprefix("torch.")
    name = os.path.basename(loaded.gguf.path)
    return CacheSpec.uniform(name, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, dtype, block_size=block_size)


def num_blocks_for_memory(loaded: LoadedModel, block_size: int, kv_memory_bytes: int) -> int:
    per_block = int(cache_spec_for(loaded, block_size).bytes_per_block)
    num_blocks = kv_memory_bytes // per_block
    if num_blocks <= 0:
        raise ValueError(f"KV memory of {kv_memory_bytes} bytes holds no block of {per_block} bytes")
    return int(num_blocks)


def build_engine(
    loaded: LoadedModel,
    *,
    num_blocks: int = 1024,
    block_size: int = 16,
    max_num_batched_tokens: int = 512,
    max_num_seqs: int = 64,
    enable_prefix_caching: bool = True,
    record_logits: bool = False,
) -> Engine:
    runner = LlamaRunner(
        loaded.model,
        num_blocks,
        block_size,
        descriptor_for(loaded, block_size),
        enable_prefix_caching=enable_prefix_caching,
    )
    tok = loaded.tokenizer
    eos = {tok.eos_token_id} if tok.eos_token_id is not None else set()
    im_end = tok.tokenizer.token_to_id("<|im_end|>")
    if im_end is not None:
        eos.add(im_end)  # chat models end a turn with <|im_end|>
    return Engine(
        runner,
        max_num_batched_tokens=max_num_batched_tokens,
        max_num_seqs=max_num_seqs,
        eos_token_ids=sorted(eos),
        decode_text=tok.decode,
        record_logits=record_logits,
    )
