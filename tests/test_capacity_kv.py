"""KV bytes per token / per request by attention kind, and the TP division rules."""

from __future__ import annotations

import pytest

from kvpool.capacity.kv import PageGroup, cache_spec, kv_heads_per_gpu, kv_layout
from kvpool.spec.models import from_hf_config, load_preset

ONE_MI = 1 << 20  # "1M tokens"


def _llama_like(num_layers: int, kv_heads: int, head_dim: int, **extra: object) -> dict:
    cfg = {
        "model_type": "llama",
        "num_hidden_layers": num_layers,
        "hidden_size": 4096,
        "num_attention_heads": 32,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "intermediate_size": 11008,
        "vocab_size": 32000,
        "max_position_embeddings": 1 << 20,
    }
    cfg.update(extra)
    return cfg


def test_llama_3_1_8b_bf16_is_131072_bytes_per_token() -> None:
    # 2 (K, V) x 32 layers x 8 KV heads x 128 dims x 2 bytes
    layout = kv_layout(load_preset("llama-3.1-8b"), "bf16")
    assert layout.bytes_per_token == 2 * 32 * 8 * 128 * 2 == 131_072
    assert layout.kv_bytes_at_context(1000) == 131_072 * 1000


def test_fp8_halves_gqa_and_counts_per_tensor_scales() -> None:
    model = load_preset("llama-3.1-8b")
    fp8 = kv_layout(model, "fp8")
    assert fp8.bytes_per_token == 65_536
    assert fp8.fixed_scale_bytes == 32 * 8  # one fp32 k_scale + v_scale per layer


def test_mla_latent_and_fp8_serving_format() -> None:
    v3 = load_preset("deepseek-v3")
    assert kv_layout(v3, "bf16").bytes_per_token == 61 * (512 + 64) * 2
    fp8 = kv_layout(v3, "fp8")
    # 512 FP8 + 4 fp32 scales + 64 BF16 rope dims = 656 B per layer
    (latent,) = fp8.groups
    assert latent.data_bytes_per_entry == 512 + 128 and latent.scale_bytes_per_entry == 16
    assert fp8.bytes_per_token == 61 * 656


def test_v3_2_adds_a_132_byte_indexer_key() -> None:
    layout = kv_layout(load_preset("deepseek-v3.2"))  # auto: the FP8 serving format
    assert layout.kv_dtype == "fp8"
    assert layout.bytes_per_token == (656 + 132) * 61 == 48_068
    key = next(g for g in layout.groups if g.name == "indexer-key")
    assert (key.data_bytes_per_entry, key.scale_bytes_per_entry) == (128, 4)


@pytest.mark.parametrize("indexer_format", ["fp8", "mxfp4"])
def test_v4_at_1m_tokens_against_v3_2(indexer_format: str) -> None:
    v32 = kv_layout(load_preset("deepseek-v3.2")).kv_bytes_at_context(ONE_MI)
    pro = kv_layout(load_preset("deepseek-v4-pro"), indexer_format=indexer_format).kv_bytes_at_context(ONE_MI)
    flash = kv_layout(load_preset("deepseek-v4-flash"), indexer_format=indexer_format).kv_bytes_at_context(ONE_MI)
    # the V4 report: Pro needs ~10 % and Flash ~7 % of V3.2's KV cache at 1M tokens
    assert 0.09 <= pro / v32 <= 0.12
    assert 0.065 <= flash / v32 <= 0.085


def test_v4_pro_is_about_2_percent_of_a_bf16_gqa8_baseline() -> None:
    baseline = kv_layout(from_hf_config(_llama_like(61, 8, 128), name="gqa8"), "bf16")
    assert baseline.bytes_per_token == 2 * 61 * 8 * 128 * 2
    pro = kv_layout(load_preset("deepseek-v4-pro"))
    ratio = pro.kv_bytes_at_context(ONE_MI) / baseline.kv_bytes_at_context(ONE_MI)
    assert 0.015 <= ratio <= 0.025


def test_v4_classical_bytes_come_from_the_dsv4_spec() -> None:
    model = load_preset("deepseek-v4-flash")
    assert model.dsv4 is not None
    for fmt in ("fp8", "mxfp4"):
        layout = kv_layout(model, indexer_format=fmt)
        assert layout.bytes_per_token == pytest.approx(model.dsv4.classical_bytes_per_token("serving", fmt))
        assert layout.state_bytes_per_request == model.dsv4.state_bytes_per_request("serving")


def test_v4_pool_holds_complete_blocks_only() -> None:
    layout = kv_layout(load_preset("deepseek-v4-pro"))
    state = layout.state_block_bytes
    assert layout.request_bytes(1) == layout.request_bytes(127) == state  # tail lives in state
    assert layout.request_bytes(128) == state + layout.bytes_per_block_all_groups
    assert layout.request_bytes(300) == state + 2 * layout.bytes_per_block_all_groups
    with pytest.raises(ValueError, match="multiple of lcm"):
        kv_layout(load_preset("deepseek-v4-pro"), block_size=64)


def test_sliding_window_layers_are_bounded_by_the_window() -> None:
    gemma = load_preset("gemma-2-9b")  # 21 global + 21 local layers, window 4096
    layout = kv_layout(gemma, "bf16")
    per_layer = 2 * 8 * 256 * 2
    assert layout.kv_bytes_at_context(1000) == 42 * per_layer * 1000
    assert layout.kv_bytes_at_context(100_000) == 21 * per_layer * 100_000 + 21 * per_layer * 4096
    # agrees with the lead's frozen CacheSpec wherever both apply
    for model_name in ("gemma-2-9b", "gpt-oss-120b", "llama-3.1-8b", "smollm2-135m"):
        model = load_preset(model_name)
        spec = cache_spec(model, "bf16")
        ours = kv_layout(model, "bf16")
        assert ours.bytes_per_token == spec.bytes_per_token
        for n in (0, 1, 127, 128, 129, 5000, 200_000):
            assert ours.kv_bytes_at_context(n) == spec.bytes_at_context(n)


def test_sliding_window_blocks_follow_the_positions_kept() -> None:
    g = PageGroup(
        "sliding-128", 1, block_size=16, tokens_per_entry=1, data_bytes_per_entry=4, scale_bytes_per_entry=0, window=128
    )
    assert g.num_blocks(0) == 0
    assert g.num_blocks(128) == 8  # positions [0, 127]
    assert g.num_blocks(129) == 9  # [1, 128]: blocks 0..8
    assert g.num_blocks(200) == 9  # [72, 199]: blocks 4..12
    assert g.num_blocks(208) == 8  # [80, 207]: blocks 5..12, aligned again
    full = PageGroup("full", 1, 16, 1, 4, 0)
    assert [full.num_blocks(n) for n in (1, 16, 17, 32, 33)] == [1, 1, 2, 2, 3]


def test_alignment_padding_is_counted() -> None:
    # V4 HCA: one 584 B entry per 128-token block per layer, padded to 768 B
    layout = kv_layout(load_preset("deepseek-v4-pro"))
    hca = next(g for g in layout.groups if g.name == "hca-entry")
    assert hca.raw_block_bytes_per_layer == 584 and hca.block_bytes_per_layer == 768
    assert hca.padding_bytes_per_block == 31 * 184
    unaligned = kv_layout(load_preset("deepseek-v4-pro"), alignment=8)
    assert next(g for g in unaligned.groups if g.name == "hca-entry").padding_bytes_per_block == 0


def test_tp_divides_head_sharded_caches_only() -> None:
    llama = load_preset("llama-3.1-70b")  # 8 KV heads
    tp1 = kv_layout(llama, tp=1).bytes_per_token
    assert kv_layout(llama, tp=8).bytes_per_token == tp1 / 8
    assert kv_layout(llama, tp=8).sharded_by_head
    # TP 16 > 8 heads: a head lives on two ranks, so a rank still holds 1/8, not 1/16
    tp16 = kv_layout(llama, tp=16)
    assert tp16.bytes_per_token == tp1 / 8 and not tp16.sharded_by_head
    with pytest.raises(ValueError, match="neither divides"):
        kv_layout(llama, tp=3)
    # MLA latents and V4's shared vector are replicated: every rank stores all of it
    for name in ("deepseek-v3", "deepseek-v3.2", "deepseek-v4-flash"):
        model = load_preset(name)
        assert kv_layout(model, tp=8).bytes_per_token == kv_layout(model, tp=1).bytes_per_token
        assert not kv_layout(model, tp=8).sharded_by_head
    # MQA: one KV head, replicated over TP
    mqa = from_hf_config(_llama_like(4, 1, 128), name="mqa")
    assert kv_layout(mqa, tp=4).bytes_per_token == kv_layout(mqa, tp=1).bytes_per_token
    assert [kv_heads_per_gpu(8, t) for t in (1, 2, 4, 8, 16, 32)] == [8, 4, 2, 1, 1, 1]


def test_bad_kv_arguments_are_rejected() -> None:
    model = load_preset("llama-3.1-8b")
    with pytest.raises(ValueError, match="kv dtype"):
        kv_layout(model, "int3")
    with pytest.raises(ValueError, match="block_size"):
        kv_layout(model, block_size=0)
    with pytest.raises(ValueError, match="indexer format"):
        kv_layout(load_preset("deepseek-v3.2"), indexer_format="fp2")
