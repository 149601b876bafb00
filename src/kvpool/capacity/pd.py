"""Prefill / decode disaggregation (P/D) sizing: the prefill and the decode instances of a
deployment, each planned on its own GPUs (`kvpool plan --pd P,D`).

The prefill pool holds prompts (`prompt_len` tokens a request), the decode pool whole
requests (`context_len`). Each side is one tensor-parallel group over all its GPUs. When a
prompt is prefilled, its full blocks before its last token (every KV head) move to the
decode side, as kvpool's engine moves them (engine/disaggregated.py needed_range: the
decode side's admission computes at least the last token, so a prompt of an exact number
of blocks keeps its last block there): transfer_bytes_per_request = the whole model's KV
bytes of a request of ((prompt_len - 1) // block_size) * block_size tokens: every
full-attention layer's entries for all of them, a sliding-window layer's for its window,
and DeepSeek-V4's state block.
"""

from __future__ import annotations

from kvpool.capacity.kv import kv_layout
from kvpool.capacity.ledger import LedgerAssumptions
from kvpool.capacity.planner import plan
from kvpool.spec.gpus import GPUSpec
from kvpool.spec.models import ModelSpec


def plan_pd(
    model: ModelSpec,
    gpu: GPUSpec,
    num_prefill_gpus: int,
    num_decode_gpus: int,
    context_len: int,
    prompt_len: int | None = None,
    *,
    block_size: int | None = None,
    kv_dtype: str = "auto",
    indexer_format: str | None = None,
    weight_dtype: str = "auto",
    assumptions: LedgerAssumptions | None = None,
    seed: int = 0,
) -> dict[str, object]:
    """{"prompt_len", "context_len", "prefill": {...}, "decode": {...},
    "transfer_bytes_per_request"}: each side's GPUs (= its TP), the tokens a request holds
    there, its KV pool and KV bytes a token per GPU, how many requests it holds and whether
    it fits. `prompt_len` defaults to half the context."""
    if num_prefill_gpus <= 0 or num_decode_gpus <= 0:
        raise ValueError(f"GPU counts must be positive, got {num_prefill_gpus},{num_decode_gpus}")
    prompt = prompt_len or max(1, context_len // 2)
    if prompt > context_len:
        raise ValueError(f"--prompt-len {prompt} exceeds the context {context_len}")
    out: dict[str, object] = {"prompt_len": prompt, "context_len": context_len}
    for side, gpus, length in (("prefill", num_prefill_gpus, prompt), ("decode", num_decode_gpus, context_len)):
        part = plan(
            model,
            gpu,
            num_gpus=gpus,
            tp=gpus,
            context_len=length,
            block_size=block_size,
            kv_dtype=kv_dtype,
            indexer_format=indexer_format,
            weight_dtype=weight_dtype,
            assumptions=assumptions,
            seed=seed,
        )
        info = part.as_dict()
        out[side] = {
            "gpus": gpus,
            "tp": gpus,
            "tokens_held": length,
            "kv_pool_bytes_per_gpu": int(info["kv_pool_bytes_per_gpu"]),
            "kv_bytes_per_token_per_gpu": info["kv_bytes_per_token_per_gpu"],
            "max_concurrent_requests": info["max_concurrent_requests"],
            "fits": part.fits,
        }
        if side == "prefill":
            # The prompt's full blocks before its last token, every KV head, move to the decode side: what the
            # decode side keeps of them, layer group by group (a sliding-window layer its
            # window, not the whole prompt), plus V4's state block (SWA window, compressor
            # tails), without which it cannot go on. Bytes a token x the prompt counted
            # every layer at the whole prompt and no state.
            bs = info["block_size"]
            whole = kv_layout(model, part.layout.kv_dtype, bs, 1, part.layout.indexer_format)
            # the blocks before the last token: at an exact multiple, one fewer than prompt // bs
            moved = (prompt - 1) // bs * bs
            # (kvpool's chunked formats: whole blocks move as codes; their full-precision tails
            # are the prefill side's workspace, counted in its state but not moved)
            moved_bytes = whole.kv_bytes_at_context(moved) - whole.tail_bytes_per_request
            out["transfer_bytes_per_request"] = int(moved_bytes)
    return out
