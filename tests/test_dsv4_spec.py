"""DSV4Spec: config loading, layer kinds, span and the byte accounting of DEEPSEEK_V4.md §5."""

from __future__ import annotations

import dataclasses
import re

import pytest

from kvpool.spec.dsv4 import REQUIRED_KEYS, DSV4Spec, LayerKind, load_preset, load_preset_config


def test_flash_layer_pattern() -> None:
    spec = load_preset("deepseek-v4-flash")
    assert spec.num_layers == 43 and len(spec.compress_ratios) == 44
    kinds = spec.layer_kinds
    assert kinds[:2] == (LayerKind.SWA, LayerKind.SWA)
    assert all(kinds[i] is LayerKind.CSA for i in range(2, 43, 2))
    assert all(kinds[i] is LayerKind.HCA for i in range(3, 43, 2))
    assert spec.num_layers_of(LayerKind.CSA) == 21
    assert spec.num_layers_of(LayerKind.HCA) == 20
    assert spec.num_layers_of(LayerKind.SWA) == 2
    assert spec.mtp_kinds == (LayerKind.SWA,)
    assert spec.num_layers_of(LayerKind.SWA, include_mtp=True) == 3
    assert (spec.csa_ratio, spec.hca_ratio, spec.span, spec.window) == (4, 128, 128, 128)
    assert spec.yarn is not None and spec.yarn.factor == 16 and spec.yarn.original_max_position_embeddings == 65536
    assert (spec.hidden_size, spec.num_heads, spec.o_groups, spec.index_topk) == (4096, 64, 8, 512)


def test_pro_layer_pattern() -> None:
    spec = load_preset("deepseek-v4-pro")
    assert spec.num_layers == 61 and len(spec.compress_ratios) == 62
    assert spec.layer_kinds[:3] == (LayerKind.HCA, LayerKind.HCA, LayerKind.CSA)
    assert spec.num_layers_of(LayerKind.CSA) == 30
    assert spec.num_layers_of(LayerKind.HCA) == 31
    assert spec.num_layers_of(LayerKind.SWA) == 0
    assert spec.mtp_kinds == (LayerKind.SWA,)
    assert (spec.hidden_size, spec.num_heads, spec.o_groups, spec.q_lora_rank, spec.index_topk) == (
        7168,
        128,
        16,
        1536,
        1024,
    )


def test_entry_formats() -> None:
    spec = load_preset("deepseek-v4-flash")
    assert spec.main_entry_bytes() == 584  # 448 FP8 + 64 x 2 BF16 + 8 scale bytes
    assert spec.indexer_key_bytes("fp8") == 132
    assert spec.indexer_key_bytes("mxfp4") == 68
    assert spec.main_entry_bytes("float32") == 2048
    assert spec.main_entry_bytes("bfloat16") == 1024
    assert spec.indexer_key_bytes("float32") == 512


def test_classical_bytes_per_token_flash_and_pro() -> None:
    # Byte counts are integers divided by powers of two (the span): exact in binary floating point on any
    # CPU (scalar Python arithmetic, no kernel), so they are compared with ==, not a tolerance.
    flash = load_preset("deepseek-v4-flash")
    # 21 CSA x (584 + 132) / 4 + 20 HCA x 584 / 128
    assert flash.classical_bytes_per_token(indexer_format="fp8") == 21 * 716 / 4 + 20 * 584 / 128
    assert flash.classical_bytes_per_token(indexer_format="fp8") == 3850.25
    assert flash.classical_bytes_per_token(indexer_format="mxfp4") == 3514.25
    pro = load_preset("deepseek-v4-pro")
    assert pro.classical_bytes_per_token(indexer_format="fp8") == 30 * 716 / 4 + 31 * 584 / 128
    assert round(pro.classical_bytes_per_token(indexer_format="fp8") / 1000, 2) == 5.51
    assert round(pro.classical_bytes_per_token(indexer_format="mxfp4") / 1000, 2) == 5.03
    # fp32 storage: 2048 B main, 512 B indexer key
    assert flash.classical_bytes_per_token("float32") == 21 * (2048 + 512) / 4 + 20 * 2048 / 128
    # a block of 128 tokens = 128 tokens' worth; a 256-token span is the same per token
    assert flash.classical_bytes_per_block() == 128 * 3850.25
    wide = load_preset("deepseek-v4-flash", block_span=256)
    assert wide.span == 256 and wide.classical_bytes_per_token() == 3850.25
    assert wide.entries_per_block(2) == 64 and wide.entries_per_block(3) == 2 and wide.entries_per_block(0) == 0


def test_state_bytes_per_request() -> None:
    flash = load_preset("deepseek-v4-flash")
    assert flash.swa_state_bytes() == 128 * 584 * 43  # ~3.2 MB, MTP not counted
    assert flash.swa_state_bytes(include_mtp=True) == 128 * 584 * 44
    csa = 2 * 8 * 1024 * 4 + 2 * 8 * 256 * 4  # main + indexer, kv + score, fp32
    hca = 2 * 128 * 512 * 4
    assert flash.compressor_state_bytes() == 21 * csa + 20 * hca
    assert round(flash.compressor_state_bytes() / 2**20, 1) == 11.6
    assert flash.compressor_state_bytes(include_mtp=True) == flash.compressor_state_bytes()  # MTP is SWA-only
    assert flash.state_bytes_per_request() == 128 * 584 * 43 + 21 * csa + 20 * hca
    pro = load_preset("deepseek-v4-pro")
    assert round(pro.swa_state_bytes() / 1e6, 1) == 4.6
    assert round(pro.compressor_state_bytes() / 2**20, 1) == 17.8
    assert flash.state_bytes_per_request("float32") == 128 * 2048 * 43 + 21 * csa + 20 * hca


def test_the_state_at_a_span_boundary_is_the_window_and_the_carried_csa_rows() -> None:
    # DEEPSEEK_V4.md section 3: at a multiple of 128 every compressor has just pooled its
    # block; an overlapping CSA compressor carries the previous block's 4 rows (of its 8, at
    # width 2 x 512 main, 2 x 128 indexer) into the next one, HCA's 128-row tail is empty
    flash = load_preset("deepseek-v4-flash")
    carried = 2 * 4 * 1024 * 4 + 2 * 4 * 256 * 4  # main + indexer, kv + score, fp32
    assert flash.boundary_compressor_bytes() == 21 * carried == 860_160
    assert flash.boundary_state_bytes() == 128 * 584 * 43 + 21 * carried == 4_074_496
    assert flash.boundary_state_bytes() < flash.state_bytes_per_request() / 3


def test_missing_key_names_it() -> None:
    cfg = load_preset_config("deepseek-v4-flash")
    for key in REQUIRED_KEYS:
        broken = {k: v for k, v in cfg.items() if k != key}
        with pytest.raises(ValueError, match=key):
            DSV4Spec.from_config(broken)


def test_bad_configs() -> None:
    cfg = load_preset_config("deepseek-v4-flash")
    with pytest.raises(ValueError, match="compress_ratios"):
        DSV4Spec.from_config({**cfg, "compress_ratios": [0, 4]})
    with pytest.raises(ValueError, match="num_key_value_heads"):
        DSV4Spec.from_config({**cfg, "num_key_value_heads": 8})
    with pytest.raises(ValueError, match="block_span"):
        DSV4Spec.from_config(cfg, block_span=96)
    with pytest.raises(ValueError, match="o_groups"):
        DSV4Spec.from_config({**cfg, "o_groups": 7})
    with pytest.raises(ValueError, match="rope_scaling"):
        DSV4Spec.from_config({**cfg, "rope_scaling": {"type": "linear", "factor": 2}})
    with pytest.raises(ValueError, match="unknown DeepSeek-V4 preset"):
        load_preset("deepseek-v5")


def test_small_config_and_roundtrip() -> None:
    cfg = {
        **load_preset_config("deepseek-v4-flash"),
        "num_hidden_layers": 4,
        "compress_ratios": [0, 4, 16, 4, 0],
        "sliding_window": 16,
    }
    spec = DSV4Spec.from_config(cfg, name="small")
    assert spec.layer_kinds == (LayerKind.SWA, LayerKind.CSA, LayerKind.HCA, LayerKind.CSA)
    assert (spec.hca_ratio, spec.span, spec.window) == (16, 16, 16)
    assert DSV4Spec.from_config(spec.to_dict(), name="small") == spec
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.window = 3  # type: ignore[misc]  # frozen


def test_actual_pool_tensors_match_the_spec_bytes() -> None:
    from kvpool.models.tiny_dsv4 import TinyDSV4
    from kvpool.storage.dsv4 import DSV4Pools

    spec = TinyDSV4().spec
    pools = DSV4Pools(spec, 2, 1)
    assert pools.classical_block_bytes() == spec.classical_bytes_per_block("float32")
    assert pools.state_block_bytes() == spec.storage_state_bytes_per_request("float32")
    # by hand: 2 CSA layers x 32 x (32 + 16) x 4 B + 1 HCA layer x 1 x 32 x 4 B
    assert spec.classical_bytes_per_block("float32") == 2 * 32 * 48 * 4 + 32 * 4


def test_pool_dtypes_and_the_compressor_state_rule() -> None:
    """Storage follows the pools' dtype; the compressor tails stay fp32 below fp64 storage
    (DEEPSEEK_V4.md §3) and are fp64 in fp64 pools (a verification run must not round them)."""
    import torch

    from kvpool.models.tiny_dsv4 import TinyDSV4
    from kvpool.storage.dsv4 import DSV4Pools

    spec = TinyDSV4().spec
    fp32 = DSV4Pools(spec, 2, 1)
    bf16 = DSV4Pools(spec, 2, 1, dtype=torch.bfloat16)
    fp64 = DSV4Pools(spec, 2, 1, dtype=torch.float64)
    for pools, storage, compressor in (
        (fp32, torch.float32, torch.float32),
        (bf16, torch.bfloat16, torch.float32),
        (fp64, torch.float64, torch.float64),
    ):
        for st in pools.state:
            assert st.ring.dtype == storage
            assert all(t.dtype == storage for t in (st.tail_main, st.tail_idx) if t is not None)
            assert all(
                t.dtype == compressor for t in (st.comp_kv, st.comp_score, st.idx_kv, st.idx_score) if t is not None
            )
        assert all(t.dtype == storage for cl in pools.classical for t in (cl.main, cl.idx) if t is not None)
    assert bf16.state_block_bytes() == spec.storage_state_bytes_per_request("bfloat16")  # fp32 tails
    assert bf16.classical_block_bytes() == spec.classical_bytes_per_block("bfloat16")
    # fp64: every element, compressor tails included, takes 8 bytes instead of 4
    assert fp64.state_block_bytes() == 2 * fp32.state_block_bytes()
    assert fp64.classical_block_bytes() == 2 * fp32.classical_block_bytes()


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        # each was a TypeError (a traceback through kvpool plan --config): compared, added or float()ed as is
        ("qk_rope_head_dim", "64", 'qk_rope_head_dim must be a positive integer, got "64"'),
        ("qk_rope_head_dim", None, "qk_rope_head_dim must be a positive integer, got null"),
        ("max_position_embeddings", "1048576", 'max_position_embeddings must be a positive integer, got "1048576"'),
        ("num_nextn_predict_layers", None, "num_nextn_predict_layers must be an integer >= 0, got null"),
        ("num_nextn_predict_layers", "1", 'num_nextn_predict_layers must be an integer >= 0, got "1"'),
        ("compress_rope_theta", None, "compress_rope_theta must be a finite positive number, got null"),
        ("rope_theta", [], "rope_theta must be a finite positive number, got []"),
        # float("1e-6") took a string
        ("rms_norm_eps", "1e-6", 'rms_norm_eps must be a finite positive number, got "1e-6"'),
        # the field's name, not the config's key, was in the message
        ("sliding_window", 0, "sliding_window must be a positive integer, got 0"),
        ("num_hidden_layers", 0, "num_hidden_layers must be a positive integer, got 0"),
    ],
)
def test_a_config_value_of_the_wrong_type_is_named_by_its_key(key: str, value: object, message: str) -> None:
    cfg = load_preset_config("deepseek-v4-flash") | {key: value}
    with pytest.raises(ValueError, match=re.escape(message)):
        DSV4Spec.from_config(cfg)
