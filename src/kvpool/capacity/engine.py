"""The ledger of kvpool's own engine on a CPU: what `kvpool run` will hold, predicted from
the model's config and the serving configuration alone (no model loaded), term by term as
`kvpool run --json` measures it (engine/memory.py):

  weights    every parameter once in fp32 (a tied embedding is the LM head: counted once)
  kv_pool    data: kv_memory // bytes_per_block whole blocks, K and V of every layer, fp32,
             no padding (the storage is one tensor per layer, nothing rounds a block up);
             quant_scales: none in fp32;
             block_tables (bound): the largest step's plan tensors, int64: the slot
             mapping of its tokens; the decode rows, lengths and offsets of its sequences;
             every sequence's block table at the longest context; and the boolean mask
             [chunk, context] of prefill chunks that continue a prefix (at most the step's
             tokens x the longest context), on the native decode path (the torch paths'
             gather tables are larger);
             bookkeeping (estimate): the manager's Python structures: per block its refcount
             and free-queue slots, prefix-index entry and prefix block (hash, token bytes):
             `bookkeeping_bytes_per_block`; per running sequence its token ids at the longest
             context, a list slot and an int object each (`token_id_bytes`)
  workspace  activations of the largest step (max_num_batched_tokens tokens): the fused
             forward's buffers, residual x, normed input, delta [N, hidden], qkv [N, (H + 2
             KVH) D], gate_up [N, 2 I], act [N, I], and the attention output [N, H D];
             logits: fp32 [max_num_seqs, vocab]; the sampler's scratch for one row (bound:
             its full-sort top-p path, six fp32 and one int64 vector of the vocabulary)
  transient  (bounds) copy-on-write staging: one block per running sequence (a fork copies
             its shared tail once), staged K first, then V: half a block each; chunked
             prefill: one layer's K and V gathered for a chunk whose context is the longest,
             plus the gather's intermediate copy (3x), and SDPA's fp32 copy of the boolean
             mask, at most the step's tokens x the longest context x 4 B
  runtime    (assumptions) the interpreter, torch and the libraries (`runtime_bytes`,
             measured on the reference machine), and the tokenizer (`tokenizer_bytes_per_token`
             of vocabulary, measured for SmolLM2's byte-level BPE)

The longest context is min(the model's positions, the pool's tokens). Weights and the
pool's data are exact; the other lines are bounds or estimates, each named as such.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvpool.capacity.kv import KVLayout
from kvpool.capacity.ledger import MIB, Ledger
from kvpool.spec.models import ModelSpec

ENGINE_TERMS: tuple[str, ...] = ("weights", "kv_pool", "workspace", "transient", "runtime")
FP32 = 4


@dataclass(frozen=True)
class EngineConfig:
    """A `kvpool run` configuration; the defaults are kvpool run's (cli/run.py reads them)."""

    kv_memory_bytes: int = 256 * MIB
    block_size: int = 16
    max_num_batched_tokens: int = 256
    max_num_seqs: int = 16
    # assumptions, measured on this project's 2-vCPU AMD EPYC (Python 3.11, torch 2.13 CPU):
    runtime_bytes: int = 225 * MIB  # RSS of the process with torch and kvpool imported, no model
    tokenizer_bytes_per_token: int = 380  # RSS the tokenizers BPE takes per vocabulary entry
    bookkeeping_bytes_per_block: int = 1024  # ~630 B measured at block size 16
    token_id_bytes: int = 36  # a list slot (8 B) and an int object above the small ints (28 B)

    def __post_init__(self) -> None:
        for name in ("kv_memory_bytes", "block_size", "max_num_batched_tokens", "max_num_seqs"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")


def engine_num_blocks(layout: KVLayout, config: EngineConfig) -> int:
    """The blocks `kvpool run` allocates: whole blocks of kv_memory (none is a ValueError)."""
    num_blocks = config.kv_memory_bytes // layout.bytes_per_block_all_groups
    if num_blocks <= 0:
        raise ValueError(
            f"a KV memory of {config.kv_memory_bytes:,} bytes holds no block of "
            f"{layout.bytes_per_block_all_groups:,} bytes"
        )
    return num_blocks


def engine_max_context(model: ModelSpec, layout: KVLayout, config: EngineConfig) -> int:
    """The longest request the engine can hold: the model's positions, or the pool's tokens."""
    return min(model.max_position_embeddings, engine_num_blocks(layout, config) * config.block_size)


def build_engine_ledger(
    model: ModelSpec, layout: KVLayout, weight_bytes: float, capacity: int, config: EngineConfig
) -> Ledger:
    """kvpool's CPU engine (fp32 weights, activations and KV) serving `config`; `capacity`
    is the machine's memory. GQA models only: the CPU engine runs Llama-architecture GGUFs."""
    if model.attention != "gqa" or any(w is not None for w in model.layer_windows):
        raise ValueError(f"{model.name}: kvpool's CPU engine runs full-attention GQA (Llama) models only")
    if layout.kv_dtype != "fp32" or layout.block_size != config.block_size:
        raise ValueError(f"the engine's KV layout is fp32 in blocks of {config.block_size}, not {layout.kv_dtype}")
    T, S, bs = config.max_num_batched_tokens, config.max_num_seqs, config.block_size
    h, heads, kvh, d = model.hidden_size, model.num_heads, model.num_kv_heads, model.head_dim
    inter, vocab = model.intermediate_size, model.vocab_size
    num_blocks = engine_num_blocks(layout, config)
    block_bytes = layout.bytes_per_block_all_groups
    max_ctx = engine_max_context(model, layout, config)
    blocks_per_seq = math.ceil(max_ctx / bs)

    plan_tensors = 8 * (T + 3 * S + 1 + 2 * S * blocks_per_seq) + T * max_ctx  # int64 tables, bool mask
    kv_pool = {
        "data": float(num_blocks * block_bytes),
        "quant_scales": 0.0,
        "block_tables": float(plan_tensors),
        "bookkeeping": float(num_blocks * config.bookkeeping_bytes_per_block + S * max_ctx * config.token_id_bytes),
    }
    forward = T * (3 * h + (heads + 2 * kvh) * d + 3 * inter) * FP32
    workspace = {
        "activations": float(forward + T * heads * d * FP32),
        "logits": float(S * vocab * FP32),
        "sampler": float(vocab * (6 * FP32 + 8)),
    }
    per_layer_block = bs * kvh * d * FP32  # K (or V) of one block in one layer
    transient = {
        "cow_staging": float(S * block_bytes // 2),
        "chunked_prefill": float(3 * blocks_per_seq * per_layer_block + T * max_ctx * FP32),
    }
    runtime = {
        "interpreter_and_libraries": float(config.runtime_bytes),
        "tokenizer": float(vocab * config.tokenizer_bytes_per_token),
    }
    details = {"kv_pool": kv_pool, "workspace": workspace, "transient": transient, "runtime": runtime}
    terms = {"weights": float(weight_bytes), **{term: sum(lines.values()) for term, lines in details.items()}}
    return Ledger(capacity, terms, {"weights": {"model": float(weight_bytes)}, **details}, pool_key="data")
