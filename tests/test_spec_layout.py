"""Cache layout specs: bytes per token and per block, by hand."""

from __future__ import annotations

import dataclasses

import pytest

from kvpool.spec import AttentionKind, CacheSpec, LayerSpec


def test_gqa_bytes_per_token_and_block():
    # SmolLM2-135M: 30 layers, 3 KV heads, head dim 64; K and V; fp32 = 4 B.
    spec = CacheSpec.uniform("smollm2", 30, 3, 64, "float32", block_size=16)
    assert spec.bytes_per_token == 2 * 30 * 3 * 64 * 4 == 46_080
    assert spec.bytes_per_block == 46_080 * 16
    # Llama-3.1-8B in BF16: 32 layers, 8 KV heads, head dim 128.
    assert CacheSpec.uniform("llama-8b", 32, 8, 128, "bfloat16").bytes_per_token == 131_072


def test_mla_stores_one_latent_and_windows_are_bounded():
    mla = LayerSpec(AttentionKind.MLA, 1, 512 + 64, "bfloat16")
    assert mla.bytes_per_token == 576 * 2
    window = LayerSpec(AttentionKind.SLIDING_WINDOW, 8, 128, "bfloat16", window=4096)
    full = LayerSpec(AttentionKind.FULL, 8, 128, "bfloat16")
    spec = CacheSpec("mixed", (window, full))
    assert spec.bytes_at_context(1000) == 2 * 1000 * 4096
    assert spec.bytes_at_context(100_000) == 4096 * (4096 + 100_000)


def test_specs_are_frozen_and_reject_bad_values():
    spec = CacheSpec.uniform("m", 2, 1, 8)
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.block_size = 32  # type: ignore[misc]
    with pytest.raises(ValueError, match="unknown storage dtype 'int3'"):
        LayerSpec(AttentionKind.FULL, 1, 8, "int3")
    with pytest.raises(ValueError, match="needs a positive window"):
        LayerSpec(AttentionKind.SLIDING_WINDOW, 1, 8)
    with pytest.raises(ValueError, match="num_kv_heads"):
        LayerSpec(AttentionKind.FULL, 0, 8)
    with pytest.raises(ValueError, match="block_size"):
        CacheSpec.uniform("m", 2, 1, 8, block_size=0)
