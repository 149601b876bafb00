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
    # kivi2 (128-token blocks of 24,576 B a token): the prompt's 31 whole blocks of codes,
    # not the prefill side's full-precision tails (its per-request state)
    out = plan_pd(model, gpu, 1, 2, 8191, kv_dtype="kivi2")
    assert out["transfer_bytes_per_request"] == (4095 // 128) * 128 * 24_576
    with pytest.raises(ValueError, match="exceeds the context"):
        plan_pd(model, gpu, 1, 1, 1024, 2048)
    with pytest.raises(ValueError, match="must be positive"):
        plan_pd(model, gpu, 0, 1, 1024)


def test_a_prompt_moves_only_what_the_decode_side_keeps() -> None:
    # gpt-oss-120b: 18 full layers move the prompt, 18 sliding-window layers only their 128
    # tokens; the figure was every layer at the whole prompt (36 x 2,048 B x 65,536: 2x)
    gpu = get_gpu("h200")
    out = plan_pd(load_preset("gpt-oss-120b"), gpu, 1, 1, 131072, 65536)
    per_layer_token = 2 * 8 * 64 * 2  # (K, V) x KV heads x head dim x bf16
    # (blocks of 16: the prompt's last block, 65,536 being a multiple, stays to be computed)
    assert out["transfer_bytes_per_request"] == 18 * per_layer_token * (65536 - 16) + 18 * per_layer_token * 128
    # DeepSeek-V4-Flash: the complete blocks' compressed entries plus the request's state
    # block (SWA window and compressor tails), without which the decode side cannot go on
    v4 = load_preset("deepseek-v4-flash")
    out = plan_pd(v4, gpu, 4, 4, 1 << 20, 100_000)
    state = 128 * 584 * 43 + 21 * (2 * 8 * 1024 * 4 + 2 * 8 * 256 * 4) + 20 * 2 * 128 * 512 * 4
    assert out["transfer_bytes_per_request"] == (100_000 // 128) * 128 * 3850.25 + state


@pytest.mark.parametrize("block_size", [16, 7])
def test_the_plan_moves_what_the_engine_moves_at_below_and_above_a_block_multiple(block_size) -> None:
    """`kvpool plan --pd` counted prompt // bs full blocks; the engine moves the blocks before
    the prompt's last token, (n - 1) // bs of them (its admission computes that token), so at
    an exact multiple the plan said one block more (8,192 tokens: 1,024 MiB for 1,022 MiB).
    The plan's bytes must be what the engine's decode side asks for, times its bytes a token."""
    from kvpool.engine.build import build_engine, load_model
    from kvpool.engine.disaggregated import needed_range

    loaded = load_model(device="cpu")
    engine = build_engine(loaded, num_blocks=16, block_size=block_size, host_cache_bytes=1 << 20)
    per_token = engine.runner.executor.storage.bytes_per_token  # SmolLM2 in fp32: 46,080 B
    smollm2, gpu = load_preset("smollm2-135m"), get_gpu("h200")
    for n in (4 * block_size - 1, 4 * block_size, 4 * block_size + 1):
        start, end = needed_range(engine, engine.runner.host_tier, list(range(1000, 1000 + n)), "")
        assert start == 0 and end == (n - 1) // block_size * block_size
        out = plan_pd(smollm2, gpu, 1, 1, 1024, n, block_size=block_size, kv_dtype="fp32")
        assert out["transfer_bytes_per_request"] == end * per_token, (n, end)
