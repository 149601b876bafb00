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


def test_mla_latent_and_fp8_formats() -> None:
    v3 = load_preset("deepseek-v3")
    assert kv_layout(v3, "bf16").bytes_per_token == 61 * (512 + 64) * 2
    # Dense MLA (V2 / V3) in fp8: the 576-dim latent + rope vector in E4M3, one byte a value,
    # with one fp32 per-tensor scale a layer (vLLM's MLA page: block x 576 x 1 B; SGLang's
    # the same). The 656 B layout (512 FP8 + 4 fp32 scales + 64 BF16 rope dims) is the sparse
    # FlashMLA kernels' format, V3.2's (and V4's): V3 planned 656 B, 14 % over.
    fp8 = kv_layout(v3, "fp8")
    (latent,) = fp8.groups
    assert (latent.data_bytes_per_entry, latent.scale_bytes_per_entry) == (576, 0)
    assert fp8.bytes_per_token == 61 * 576 == 35_136
    assert fp8.fixed_scale_bytes == 61 * 4
    # a block of 64 tokens: 64 x 576 = 36,864 B a layer, already 256-aligned
    assert fp8.bytes_per_block_all_groups == 61 * 64 * 576
    # V3.2's sparse format keeps the 656 B entry, its scales in it
    (v32_latent, _) = kv_layout(load_preset("deepseek-v3.2"), "fp8").groups
    assert (v32_latent.data_bytes_per_entry, v32_latent.scale_bytes_per_entry) == (512 + 128, 16)


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


def test_v4_flash_classical_and_state_bytes_by_hand() -> None:
    # V4-Flash: 43 layers, ratios 0, 0, then 4 / 128 alternating from layer 2: 21 CSA and 20 HCA
    # layers. An entry is 448 FP8 + 64 x 2 BF16 + 8 scale bytes = 584 B; an indexer key 128 + 4
    # (FP8) or 64 + 4 (MXFP4). Per token: CSA 21 x (584 + key) / 4, HCA 20 x 584 / 128.
    model = load_preset("deepseek-v4-flash")
    assert kv_layout(model, indexer_format="fp8").bytes_per_token == 21 * (584 + 132) / 4 + 20 * 584 / 128 == 3850.25
    assert kv_layout(model, indexer_format="mxfp4").bytes_per_token == 21 * (584 + 68) / 4 + 20 * 584 / 128 == 3514.25
    # State: the SWA ring, 128 x 584 B every layer, + the fp32 compressor tails, kv and score
    # buffers of DEEPSEEK_V4.md section 3: CSA 8 x 1024 main + 8 x 256 indexer, HCA 128 x 512.
    swa = 128 * 584 * 43
    compressor = 21 * 2 * 4 * (8 * 1024 + 8 * 256) + 20 * 2 * 4 * 128 * 512
    assert (swa, compressor) == (3_214_336, 12_206_080)  # ~3.2 MB and ~11.6 MiB, as section 5 quotes
    assert kv_layout(model).state_bytes_per_request == swa + compressor


def test_v4_pool_holds_complete_blocks_only() -> None:
    # V4-Pro: 61 layers, ratios 128, 128, then 4 / 128 alternating: 30 CSA, 31 HCA layers.
    # A 128-token block, each layer's part aligned to 256 B: CSA 32 x 584 = 18,688 B (73 x 256)
    # and 32 x 132 = 4,224 -> 4,352 B of indexer keys; HCA 1 x 584 -> 768 B.
    layout = kv_layout(load_preset("deepseek-v4-pro"))
    block = 30 * 18_688 + 30 * 4_352 + 31 * 768
    # state: SWA 128 x 584 x 61 + fp32 compressor tails (30 CSA x 81,920 + 31 HCA x 524,288)
    state = 128 * 584 * 61 + 30 * 2 * 4 * (8 * 1024 + 8 * 256) + 31 * 2 * 4 * 128 * 512
    assert (block, state) == (715_008, 23_270_400)  # the state is 90,900 x 256 B: no padding
    assert layout.bytes_per_block_all_groups == block and layout.state_block_bytes == state
    assert layout.request_bytes(1) == layout.request_bytes(127) == state  # the tail lives in state
    assert layout.request_bytes(128) == state + block
    assert layout.request_bytes(300) == state + 2 * block
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
    llama = load_preset("llama-3.1-70b")  # 80 layers, 8 KV heads of 128, BF16
    assert kv_layout(llama, tp=1).bytes_per_token == 2 * 80 * 8 * 128 * 2 == 327_680
    tp8 = kv_layout(llama, tp=8)  # one KV head per rank
    assert tp8.bytes_per_token == 2 * 80 * 1 * 128 * 2 == 40_960 and tp8.sharded_by_head
    # TP 16 > 8 heads: a head lives on two ranks, so a rank still holds one head, not half
    tp16 = kv_layout(llama, tp=16)
    assert tp16.bytes_per_token == 40_960 and tp16.kv_heads_per_gpu == 1 and not tp16.sharded_by_head
    with pytest.raises(ValueError, match="neither divides"):
        kv_layout(llama, tp=3)
    # MLA latents and V4's shared vector are replicated: every rank stores all of it
    for name, per_token in (
        ("deepseek-v3", 61 * (512 + 64) * 2),  # BF16 latent + rope dims
        ("deepseek-v3.2", 61 * (656 + 132)),  # FP8 latent format + FP8 indexer key
        ("deepseek-v4-flash", 3850.25),  # test_v4_flash_classical_and_state_bytes_by_hand
    ):
        model = load_preset(name)
        for tp in (1, 8):
            layout = kv_layout(model, tp=tp)
            assert layout.bytes_per_token == per_token and not layout.sharded_by_head, (name, tp)
    # MQA: one KV head, replicated over TP: 4 layers x K, V x 128 dims x 2 B on every rank
    mqa = from_hf_config(_llama_like(4, 1, 128), name="mqa")
    assert kv_layout(mqa, tp=1).bytes_per_token == kv_layout(mqa, tp=4).bytes_per_token == 4 * 2 * 128 * 2
    assert not kv_layout(mqa, tp=4).sharded_by_head
    assert [kv_heads_per_gpu(8, t) for t in (1, 2, 4, 8, 16, 32)] == [8, 4, 2, 1, 1, 1]


def test_bad_kv_arguments_are_rejected() -> None:
    model = load_preset("llama-3.1-8b")
    with pytest.raises(ValueError, match="kv dtype"):
        kv_layout(model, "int3")
    with pytest.raises(ValueError, match="block_size"):
        kv_layout(model, block_size=0)
    with pytest.raises(ValueError, match="indexer format"):
        kv_layout(load_preset("deepseek-v3.2"), indexer_format="fp2")
