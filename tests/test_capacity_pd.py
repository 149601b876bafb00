"""capacity/pd.py: a P/D deployment's prefill and decode instances planned apart, through
the Python API (`kvpool plan --pd` is tested end to end in test_disaggregated.py)."""

from __future__ import annotations

import pytest

from kvpool.capacity.pd import plan_pd
from kvpool.spec.gpus import get_gpu
from kvpool.spec.models import load_preset

PER_TOKEN = 32 * 8 * 128 * 2 * 2  # llama-3.1-8b: layers x KV heads x head dim x (K, V) x bf16


def test_plan_pd_defaults_the_prompt_to_half_the_context_and_moves_its_full_blocks() -> None:
    model, gpu = load_preset("llama-3.1-8b"), get_gpu("h200")
    out = plan_pd(model, gpu, 1, 2, 8191, block_size=16)
    assert (out["prompt_len"], out["context_len"]) == (4095, 8191)
    assert out["prefill"]["tokens_held"] == 4095 and out["decode"]["tokens_held"] == 8191
    assert (out["prefill"]["tp"], out["decode"]["tp"]) == (1, 2)
    assert out["prefill"]["kv_bytes_per_token_per_gpu"] == PER_TOKEN
    assert out["decode"]["kv_bytes_per_token_per_gpu"] == PER_TOKEN / 2  # TP 2: half the KV heads a GPU
    assert out["transfer_bytes_per_request"] == (4095 // 16) * 16 * PER_TOKEN  # 255 full blocks, not the tail
    with pytest.raises(ValueError, match="exceeds the context"):
        plan_pd(model, gpu, 1, 1, 1024, 2048)
    with pytest.raises(ValueError, match="must be positive"):
        plan_pd(model, gpu, 0, 1, 1024)
