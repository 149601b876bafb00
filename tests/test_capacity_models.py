"""Model presets from config.json facts, parameter counts, weight bytes and config errors."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
import transformers

from kvpool.capacity.weights import weight_bytes
from kvpool.spec.gpus import GPUS, custom_gpu, get_gpu
from kvpool.spec.models import (
    PRESET_NAMES,
    count_parameters,
    from_hf_config,
    load_config_file,
    load_preset,
    load_preset_config,
)


def test_every_preset_loads() -> None:
    for name in PRESET_NAMES:
        model = load_preset(name)
        assert count_parameters(model).total > 0
    assert load_preset("Llama-3.1-8B").name == "llama-3.1-8b"  # names are case-insensitive
    with pytest.raises(ValueError, match="unknown model preset"):
        load_preset("llama-9")


@pytest.mark.parametrize(
    "name", ["smollm2-135m", "llama-3.1-8b", "qwen3-8b", "gemma-2-9b", "gpt-oss-120b", "deepseek-v3"]
)
def test_parameter_count_matches_transformers(name: str) -> None:
    """Independent reference: transformers (a test extra) builds the model on the meta device and counts."""
    cfg = load_preset_config(name)
    hf_config = transformers.AutoConfig.for_model(**cfg)
    with torch.device("meta"):
        hf_model = transformers.AutoModelForCausalLM.from_config(hf_config)
    expected = sum(p.numel() for p in hf_model.parameters())
    # DeepSeek's e_score_correction_bias is a buffer there, a (router) parameter here
    expected += sum(b.numel() for n, b in hf_model.named_buffers() if n.endswith("e_score_correction_bias"))
    assert count_parameters(load_preset(name)).total == expected


def test_parameter_counts_land_on_published_totals() -> None:
    def billions(name: str) -> float:
        return count_parameters(load_preset(name)).total / 1e9

    assert billions("llama-3.1-8b") == pytest.approx(8.03, abs=0.01)
    assert billions("llama-3.1-70b") == pytest.approx(70.55, abs=0.01)
    assert billions("deepseek-v3") == pytest.approx(671.0, rel=1e-3)
    assert billions("gpt-oss-120b") == pytest.approx(116.83, abs=0.01)
    assert billions("deepseek-v4-flash") == pytest.approx(284, rel=0.01)
    assert billions("deepseek-v4-pro") == pytest.approx(1600, rel=0.03)  # "1.6T" (rounded; MTP excluded)


def test_weight_bytes_by_format_and_tp() -> None:
    # Llama-3.1-8B: 32 layers, hidden 4096, 32 heads / 8 KV heads of 128, MLP 14336, vocab
    # 128256, untied head. Linear weights a layer: q, k, v, o 4096 x (4096 + 1024 + 1024 +
    # 4096) + gate, up, down 3 x 4096 x 14336; norms (2 x 32 + 1) x 4096.
    linear = 32 * (4096 * (4096 + 1024 + 1024 + 4096) + 3 * 4096 * 14336)
    embedding = 128_256 * 4096  # and as many in the head
    norms = (2 * 32 + 1) * 4096
    assert (linear, 2 * embedding + linear + norms) == (6_979_321_856, 8_030_261_248)
    llama = load_preset("llama-3.1-8b")
    w = weight_bytes(llama)
    assert w.total_bytes == w.per_gpu_bytes == 2 * 8_030_261_248
    # TP 2: everything but the norms is split in two (8 KV heads: 4 a rank)
    assert weight_bytes(llama, tp=2).per_gpu_bytes == (8_030_261_248 - norms) * 2 / 2 + norms * 2 == 8_030_527_488
    # FP8 (one fp32 scale per 128 x 128 block, every dimension a multiple of 128) on the
    # linears only: embeddings, head and norms stay BF16
    fp8 = linear + linear * 4 // (128 * 128) + 2 * (2 * embedding + norms)
    assert weight_bytes(llama, weight_dtype="fp8").total_bytes == fp8 == 9_082_904_576
    # gpt-oss: MXFP4 experts (4.25 bits) -> about 65 GB, as its checkpoint
    assert weight_bytes(load_preset("gpt-oss-120b")).total_bytes / 1e9 == pytest.approx(65.2, abs=0.5)
    # Llama-3.1-70B: 80 layers, hidden 8192, 64 heads / 8 KV heads of 128, MLP 28672
    w70 = load_preset("llama-3.1-70b")
    kv_proj = 2 * 80 * 8192 * 8 * 128  # the K and V projections of all layers
    total70 = 2 * 128_256 * 8192 + 80 * (8192 * (8192 + 1024 + 1024 + 8192) + 3 * 8192 * 28672) + 161 * 8192
    assert total70 == 70_553_706_496
    norms70 = 161 * 8192
    # TP 8: one KV head a rank, an even split of everything but the norms
    assert weight_bytes(w70, tp=8).per_gpu_bytes == (total70 - norms70) * 2 / 8 + norms70 * 2 == 17_640_734_720
    # TP 16 on 8 KV heads: a rank holds a whole head's K/V projections (1/8 of them), not half
    # of one; the rest splits 16 ways
    tp16 = (total70 - norms70 - kv_proj) * 2 / 16 + kv_proj * 2 / 8 + norms70 * 2
    assert weight_bytes(w70, tp=16).per_gpu_bytes == tp16 == 8_989_458_432
    with pytest.raises(ValueError, match="not divisible by tp"):
        weight_bytes(llama, tp=3)


def test_expert_parallelism_prices_the_fullest_gpu() -> None:
    # gpt-oss-120b: 36 layers of 128 MXFP4 experts (3 x 2880 x 2880 weights at 0.5 + 1/32 B, and
    # 2 x 2880 + 2880 BF16 biases each); the other 4,255,115,904 bytes on every GPU under EP
    oss = load_preset("gpt-oss-120b")
    experts = 36 * 128 * (3 * 2880 * 2880 * 17 / 32 + (2 * 2880 + 2880) * 2)
    rest = weight_bytes(oss).total_bytes - experts
    assert rest == 4_255_115_904
    assert weight_bytes(oss, ep=8).per_gpu_bytes == rest + experts / 8  # 16 experts a GPU
    # 128 over 3 GPUs: two hold 43, one 42; E / ep priced 42.67 a GPU, under the fullest
    assert weight_bytes(oss, ep=3).per_gpu_bytes == rest + experts * 43 / 128 == 24_745_186_944
    # more GPUs than experts: one whole expert a GPU (E / ep priced half of one)
    assert weight_bytes(oss, ep=256).per_gpu_bytes == rest + experts / 128


def test_missing_required_key_names_the_key(tmp_path: Path) -> None:
    cfg = load_preset_config("llama-3.1-8b")
    del cfg["num_hidden_layers"]
    with pytest.raises(ValueError, match="'num_hidden_layers'"):
        from_hf_config(cfg)
    mla = load_preset_config("deepseek-v3")
    del mla["kv_lora_rank"]
    with pytest.raises(ValueError, match="'kv_lora_rank'"):
        from_hf_config(mla)
    v32 = load_preset_config("deepseek-v3.2")
    del v32["index_head_dim"]
    with pytest.raises(ValueError, match="'index_head_dim'"):
        from_hf_config(v32)
    v4 = load_preset_config("deepseek-v4-pro")
    del v4["compress_ratios"]
    with pytest.raises(ValueError, match="'compress_ratios'"):
        from_hf_config(v4)
    path = tmp_path / "config.json"
    path.write_text(json.dumps({k: v for k, v in cfg.items() if k != "vocab_size"} | {"num_hidden_layers": 2}))
    with pytest.raises(ValueError, match="'vocab_size'"):
        load_config_file(path)


def test_unknown_model_kind_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="unknown model kind.*'mamba'"):
        from_hf_config({"model_type": "mamba", "architectures": ["MambaForCausalLM"], "hidden_size": 768})
    with pytest.raises(ValueError, match="'model_type'"):
        from_hf_config({"architectures": ["RwkvForCausalLM"], "hidden_size": 768})
    # no model_type, but a known architecture: accepted
    cfg = load_preset_config("llama-3.1-8b")
    del cfg["model_type"]
    assert from_hf_config(cfg).model_type == "llama"
    # a layer kind the capacity model does not understand
    bad = load_preset_config("gpt-oss-120b")
    bad["layer_types"] = ["linear_attention"] * 36
    with pytest.raises(ValueError, match="'linear_attention'"):
        from_hf_config(bad)
    # a quantization kvpool cannot price is read, and refused when its weights are priced
    # (tests/test_quantized_configs.py: a named weight dtype prices it)
    awq = from_hf_config(load_preset_config("llama-3.1-8b") | {"quantization_config": {"quant_method": "awq"}})
    with pytest.raises(ValueError, match="quant_method 'awq'"):
        weight_bytes(awq)


def test_config_file_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="does not exist"):
        load_config_file(tmp_path / "nope.json")
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_config_file(broken)
    folder = tmp_path / "Qwen3-8B"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(load_preset_config("qwen3-8b")))
    model = load_config_file(folder)
    assert model.name == "Qwen3-8B" and model.qk_norm


def test_sliding_patterns() -> None:
    assert load_preset("gemma-2-9b").layer_windows[:4] == (4096, None, 4096, None)
    assert load_preset("gpt-oss-120b").layer_windows[:2] == (128, None)
    gemma3 = GEMMA3_1B | {"num_hidden_layers": 12}
    windows = from_hf_config(gemma3).layer_windows
    assert [w is None for w in windows] == [False] * 5 + [True] + [False] * 5 + [True]
    assert all(w is None for w in load_preset("qwen3-8b").layer_windows)  # use_sliding_window: false


def test_a_missing_sliding_window_is_sized_as_transformers_fills_it_in() -> None:
    """MistralConfig's sliding_window defaults to 4096, and Qwen2Config / Qwen3Config fill in
    4096 with use_sliding_window true (transformers 5.25): without the key, those layers
    slide; an explicit null attends in full. A missing key was sized as full attention."""
    base = {k: v for k, v in load_preset_config("qwen3-8b").items() if k not in ("sliding_window", "layer_types")}
    n = base["num_hidden_layers"]
    mistral = base | {"model_type": "mistral", "architectures": ["MistralForCausalLM"]}
    assert from_hf_config(mistral).layer_windows == (4096,) * n
    assert from_hf_config(mistral | {"sliding_window": None}).layer_windows == (None,) * n
    assert from_hf_config(mistral | {"sliding_window": 512}).layer_windows == (512,) * n
    for model_type in ("qwen2", "qwen3"):
        qwen = base | {"model_type": model_type, "use_sliding_window": True, "max_window_layers": 2}
        assert from_hf_config(qwen).layer_windows == (None, None) + (4096,) * (n - 2)
        assert from_hf_config(qwen | {"sliding_window": None}).layer_windows == (None,) * n
        assert from_hf_config(qwen | {"use_sliding_window": False}).layer_windows == (None,) * n


def test_gpu_presets() -> None:
    assert set(GPUS) == {"H100", "H200", "B200"}
    assert get_gpu("h200").memory_bytes == 143_771 * (1 << 20)
    assert get_gpu("H100").memory_gib == pytest.approx(79.65, abs=0.01)
    assert get_gpu("B200").hbm_bandwidth_bytes_per_s == 8e12
    assert custom_gpu(80).memory_bytes == 80 << 30
    with pytest.raises(ValueError, match="unknown GPU"):
        get_gpu("A100")
    with pytest.raises(ValueError, match="positive"):
        custom_gpu(0)


def test_v4_config_needs_its_moe_facts_for_the_weights() -> None:
    cfg = load_preset_config("deepseek-v4-flash")
    assert from_hf_config(cfg, name="deepseek-v4-flash").moe is not None  # facts supplied by name
    with pytest.raises(ValueError, match="'n_routed_experts'"):
        from_hf_config(cfg, name="my-v4")
    cfg |= {"n_routed_experts": 8, "n_shared_experts": 1, "moe_intermediate_size": 64, "num_experts_per_tok": 2}
    model = from_hf_config(cfg, name="my-v4")
    assert model.moe is not None and model.moe.num_experts == 8
    assert count_parameters(model).experts == 43 * 8 * 3 * 4096 * 64


@pytest.mark.parametrize(
    ("changes", "words"),
    [
        ({"num_attention_heads": 0}, "num_attention_heads must be a positive integer, got 0"),  # divided by zero
        ({"num_attention_heads": 32.5}, "num_attention_heads must be a positive integer, got 32.5"),  # was 32
        ({"num_attention_heads": "32"}, 'num_attention_heads must be a positive integer, got "32"'),
        ({"num_attention_heads": True}, "num_attention_heads must be a positive integer, got true"),
        ({"num_key_value_heads": 0}, "num_key_value_heads must be a positive integer, got 0"),  # was MHA
        ({"head_dim": -128}, "head_dim must be a positive integer, got -128"),
        ({"max_position_embeddings": "big"}, 'max_position_embeddings must be a positive integer, got "big"'),
        ({"hidden_size": float("nan")}, "hidden_size must be a positive integer, got NaN"),
        ({"model_type": "mistral", "sliding_window": -5}, "sliding_window must be a positive integer, got -5"),
    ],
)
def test_a_config_value_that_is_not_a_positive_integer_is_refused_naming_the_key(changes, words) -> None:
    with pytest.raises(ValueError, match="llama config|mistral config") as raised:
        from_hf_config(load_preset_config("llama-3.1-8b") | changes)
    assert words in str(raised.value)


def test_a_config_file_that_is_not_utf8_text_names_the_file(tmp_path: Path) -> None:
    binary = tmp_path / "config.json"
    binary.write_bytes(b"\x89PNG\r\n\x1a\n\xb1\xa1")
    with pytest.raises(ValueError, match=f"config file '{binary}' is not UTF-8 text"):
        load_config_file(binary)


@pytest.mark.parametrize("key", ["tie_word_embeddings", "attention_bias", "use_sliding_window"])
@pytest.mark.parametrize("value", ["false", 0, 1, [], None])
def test_a_flag_is_a_json_boolean(key: str, value: object) -> None:
    # bool("false") is True: a quoted "false" tied Qwen3-8B's head to its embedding and
    # planned 7.57 B parameters where the model has 8.19 B; null is the key's default.
    cfg = load_preset_config("qwen3-8b") | {key: value}
    if value is None:
        assert count_parameters(from_hf_config(cfg)).total == 8_190_735_360
        return
    with pytest.raises(ValueError, match=re.escape(f"{key} must be true or false, got {json.dumps(value)}")):
        from_hf_config(cfg)


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("model_type", ["llama"], 'model_type must be a string, got ["llama"]'),
        ("model_type", {}, "model_type must be a string, got {}"),
        ("architectures", 5, "architectures must be a list of strings, got 5"),
        ("layer_types", 36, "layer_types must be a list of 36 layer kinds, got 36"),
        ("layer_types", "full_attention", 'layer_types must be a list of 36 layer kinds, got "full_attention"'),
        ("quantization_config", "fp8", 'quantization_config must be a JSON object, got "fp8"'),
        ("quantization_config", True, "quantization_config must be a JSON object, got true"),
    ],
)
def test_a_config_value_of_the_wrong_json_type_is_named(key: str, value: object, message: str) -> None:
    # each of these raised a TypeError / AttributeError (a traceback from `kvpool plan --config`)
    cfg = load_preset_config("qwen3-8b") | {key: value}
    if key == "architectures":
        del cfg["model_type"]
    with pytest.raises(ValueError, match=re.escape(message)):
        from_hf_config(cfg)


GEMMA3_1B = {
    "model_type": "gemma3_text",
    "num_hidden_layers": 26,
    "hidden_size": 1152,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 256,
    "intermediate_size": 6912,
    "vocab_size": 262144,
    "max_position_embeddings": 32768,
    "sliding_window": 512,
    "sliding_window_pattern": 6,
}


@pytest.mark.parametrize(
    ("base", "key", "value", "message"),
    [
        # int() took "32" as 32 and 1.5 as 1, and 0 divided by zero (ZeroDivisionError)
        ("deepseek-v3", "moe_layer_freq", 0, "moe_layer_freq must be a positive integer, got 0"),
        ("deepseek-v3", "moe_layer_freq", "1", 'moe_layer_freq must be a positive integer, got "1"'),
        ("deepseek-v3", "first_k_dense_replace", -1, "first_k_dense_replace must be an integer >= 0, got -1"),
        ("deepseek-v3", "first_k_dense_replace", 1.5, "first_k_dense_replace must be an integer >= 0, got 1.5"),
        ("deepseek-v3", "first_k_dense_replace", [], "first_k_dense_replace must be an integer >= 0, got []"),
        ("deepseek-v3", "n_shared_experts", -1, "n_shared_experts must be an integer >= 0, got -1"),
        ("deepseek-v3", "n_shared_experts", "1", 'n_shared_experts must be an integer >= 0, got "1"'),
        ("deepseek-v3", "q_lora_rank", 0, "q_lora_rank must be a positive integer, got 0"),
        ("deepseek-v3", "q_lora_rank", {}, "q_lora_rank must be a positive integer, got {}"),
        ("gpt-oss-120b", "num_experts_per_tok", "4", 'num_experts_per_tok must be a positive integer, got "4"'),
        ("gemma3-1b", "sliding_window_pattern", 0, "sliding_window_pattern must be a positive integer, got 0"),
        ("qwen3-8b", "max_window_layers", "28", 'max_window_layers must be an integer >= 0, got "28"'),
    ],
)
def test_an_optional_count_is_checked_like_a_required_one(base: str, key: str, value: object, message: str) -> None:
    cfg = GEMMA3_1B if base == "gemma3-1b" else load_preset_config(base)
    cfg = cfg | {key: value} | ({"use_sliding_window": True, "sliding_window": 4096} if base == "qwen3-8b" else {})
    with pytest.raises(ValueError, match=re.escape(message)):
        from_hf_config(cfg)


def test_optional_counts_keep_their_defaults() -> None:
    # absent or null: kvpool's defaults, no dense prefix, MoE every layer, no shared experts (not
    # DeepseekV3Config's 3 / 1; save_pretrained always writes these model-specific keys)
    v3 = load_preset_config("deepseek-v3")
    for key in ("first_k_dense_replace", "moe_layer_freq", "n_shared_experts"):
        spec = from_hf_config({k: v for k, v in v3.items() if k != key})
        assert spec.moe is not None
        expected = {"first_k_dense_replace": (0, 61, 1), "moe_layer_freq": (3, 58, 1), "n_shared_experts": (3, 58, 0)}
        assert (spec.moe.moe_layers[0], len(spec.moe.moe_layers), spec.moe.num_shared_experts) == expected[key]
    assert from_hf_config(v3 | {"q_lora_rank": None}).mla.q_lora_rank is None  # DeepSeek-V2-Lite's plain q
    assert sum(w is None for w in from_hf_config(GEMMA3_1B | {"sliding_window_pattern": None}).layer_windows) == 4
    qwen = load_preset_config("qwen3-8b") | {"use_sliding_window": True, "sliding_window": 4096}
    assert from_hf_config(qwen | {"max_window_layers": 28}).layer_windows.count(None) == 28
    assert from_hf_config(qwen | {"max_window_layers": None}).layer_windows.count(None) == 36


def test_a_config_file_that_is_no_config_is_refused_before_it_is_read(tmp_path: Path) -> None:
    # a weights shard given by mistake (5 GB): read whole into memory first (a 2 GiB file
    # took 31 s and 4.2 GB of RAM) before the JSON error; a sparse file costs no disk here
    shard = tmp_path / "model-00001-of-00004.safetensors"
    with shard.open("wb") as f:
        f.truncate(5 << 30)
    with pytest.raises(ValueError, match=re.escape(f"config file {str(shard)!r} is 5,368,709,120 bytes")):
        load_config_file(shard)
    # a device has no size to tell: /dev/zero read "is 0 bytes (over 64 MiB)"
    with pytest.raises(ValueError, match=re.escape("config file '/dev/zero' is over 64 MiB: a config.json is")):
        load_config_file("/dev/zero")
    # a config.json that is a folder: the OSError's words without the file's role
    (tmp_path / "m" / "config.json").mkdir(parents=True)
    with pytest.raises(ValueError, match=re.escape("config file") + ".*cannot be read: Is a directory"):
        load_config_file(tmp_path / "m")


@pytest.mark.parametrize(
    ("preset", "head_dim", "kv_bytes_per_token"),
    [
        # transformers' config classes default head_dim to these, not hidden / heads
        ("qwen3-32b", 128, 2 * 64 * 8 * 128 * 2),  # 5120 / 64 = 80 planned 163,840 B
        ("gemma-2-9b", 256, 2 * 42 * 8 * 256 * 2),  # 3584 / 16 = 224
        ("gpt-oss-120b", 64, 2 * 36 * 8 * 64 * 2),  # 2880 / 64 = 45
    ],
)
def test_an_absent_head_dim_takes_the_familys_default_and_a_null_one_is_refused(
    preset: str, head_dim: int, kv_bytes_per_token: int
) -> None:
    from kvpool.capacity.kv import kv_layout

    cfg = load_preset_config(preset)
    spec = from_hf_config({k: v for k, v in cfg.items() if k != "head_dim"})
    assert spec.head_dim == head_dim
    assert kv_layout(spec).bytes_per_token == kv_bytes_per_token
    # a null one: transformers 5.25's Qwen3Config / Gemma2Config / GptOssConfig refuse it
    # (StrictDataclassFieldValidationError: head_dim is an int), as hf_config does; it was
    # read as the default
    with pytest.raises(ValueError, match=rf"head_dim must be a positive integer, got null .*default, {head_dim}\)"):
        from_hf_config(cfg | {"head_dim": None})
    # Llama (and Mistral, Qwen2) derive it: hidden / heads, null or absent (transformers takes null)
    llama = load_preset_config("llama-3.1-8b")
    assert from_hf_config(llama | {"head_dim": None}).head_dim == 4096 // 32


@pytest.mark.parametrize(
    ("preset", "changes", "words"),
    [
        ("deepseek-v3", {"n_routed_experts": 2.5}, "n_routed_experts must be a positive integer, got 2.5"),  # was 2
        ("deepseek-v3", {"n_routed_experts": "8"}, 'n_routed_experts must be a positive integer, got "8"'),
        ("deepseek-v4-flash", {"n_routed_experts": 2.5}, "n_routed_experts must be a positive integer, got 2.5"),
        # counts whose weights no machine holds (1 PiB at fp4): a MemoryError traceback, or 2.5e24 parameters
        ("smollm2-135m", {"num_hidden_layers": 10**12}, "num_hidden_layers=1000000000000 layers of hidden_size 576"),
        ("deepseek-v3", {"n_routed_experts": 10**15}, "its experts (n_routed_experts"),
        ("gemma-2-9b", {"vocab_size": 10**14}, "its embedding (vocab_size x hidden_size)"),
        # more experts a token than routed ones: planned, 1,000 experts' fused-MoE buffers a token
        (
            "deepseek-v3",
            {"num_experts_per_tok": 1000},
            "num_experts_per_tok=1000 is more than the n_routed_experts=256",
        ),
        (
            "deepseek-v4-flash",
            {"num_experts_per_tok": 257},
            "num_experts_per_tok=257 is more than the n_routed_experts",
        ),
        (
            "gpt-oss-120b",
            {"num_experts_per_tok": 129},
            "num_experts_per_tok=129 is more than the num_local_experts=128",
        ),
    ],
)
def test_expert_counts_and_counts_beyond_any_machine_are_refused_naming_the_key(preset, changes, words) -> None:
    with pytest.raises(ValueError) as raised:
        from_hf_config(load_preset_config(preset) | changes, name=preset if "v4" in preset else None)
    assert words in str(raised.value)
    assert "config: " in str(raised.value)


def test_the_largest_real_configs_are_within_the_weight_bound() -> None:
    from kvpool.spec.models import MAX_WEIGHT_BYTES, PRESET_NAMES, load_preset

    # (the bound's margin: DeepSeek-V4-Pro, the largest preset, is ~1,400 times below it)
    largest = max(count_parameters(load_preset(name)).total for name in PRESET_NAMES)
    assert 1e12 < largest and largest * 0.5 * 1000 < MAX_WEIGHT_BYTES


# google/gemma-3-4b-it's config.json as published (transformers 4.50): its text_config names only
# what differs from Gemma3TextConfig's defaults, which fill the rest when transformers loads it
GEMMA3_4B_IT = {
    "architectures": ["Gemma3ForConditionalGeneration"],
    "model_type": "gemma3",
    "mm_tokens_per_image": 256,
    "text_config": {
        "hidden_size": 2560,
        "intermediate_size": 10240,
        "model_type": "gemma3_text",
        "num_hidden_layers": 34,
        "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
        "sliding_window": 1024,
    },
    "vision_config": {"hidden_size": 1152, "model_type": "siglip_vision_model", "num_hidden_layers": 27},
}


def test_a_multimodal_gemma3_config_takes_the_text_defaults_it_leaves_out() -> None:
    # it was "missing required key 'num_attention_heads'" (the 27B: 'vocab_size')
    spec = from_hf_config(GEMMA3_4B_IT)
    assert (spec.num_heads, spec.num_kv_heads, spec.head_dim) == (8, 4, 256)
    assert (spec.vocab_size, spec.max_position_embeddings) == (262_208, 131_072)
    assert spec.layer_windows.count(None) == 5 and spec.layer_windows[0] == 1024  # 5 local : 1 global
    # the language model's 3.88 B of the published 4.3 B (the rest is the SigLIP tower):
    # tied embedding 262,208 x 2,560 + 34 x (attention 15.73 M + MLP 78.64 M) + norms
    attention = 2560 * 2048 + 2 * 2560 * 1024 + 2048 * 2560
    expected = 262_208 * 2560 + 34 * (attention + 3 * 2560 * 10240 + 4 * 2560 + 2 * 256) + 2560
    assert count_parameters(spec).total == expected
    # what the top level says of the weights applies to the language model too
    quantized = GEMMA3_4B_IT | {"quantization_config": {"quant_method": "fp8"}}
    assert from_hf_config(quantized).weight_format == "fp8"
    # a text_config that is no object said "unknown model kind: model_type 'gemma3'"
    for bad, said in (({"text_config": "nope"}, '"nope"'), ({"text_config": None}, "null")):
        with pytest.raises(ValueError) as raised:
            from_hf_config(GEMMA3_4B_IT | bad)
        assert (
            str(raised.value)
            == f"gemma3 config: text_config must be a JSON object (the language model's facts), got {said}"
        )


def test_a_v4_compress_ratio_is_a_json_integer() -> None:
    # true was ratio 1: an "HCA" layer of one-token entries, blocks of lcm(4, 1) = 4 tokens
    cfg = load_preset_config("deepseek-v4-flash")
    with pytest.raises(ValueError, match=re.escape("compress_ratios[3] must be a non-negative integer, got True")):
        from_hf_config(
            cfg | {"compress_ratios": [0, 0, 4, True, *cfg["compress_ratios"][4:]]}, name="deepseek-v4-flash"
        )
    assert from_hf_config(cfg, name="deepseek-v4-flash").dsv4.lcm_ratio == 128  # the published one holds


def test_v4_latent_compressor_and_indexer_projections_are_whole_on_every_tp_rank() -> None:
    # vLLM's V4 builds wq_a + wkv, each compressor's wkv + wgate and the indexer's wq_b and
    # weights_proj as replicated linears (one vector a token that every head reads); only
    # wq_b, wo_a and wo_b split over TP. Counted here from the config's own fields by hand:
    # they were counted TP-sharded, V4-Pro at TP 8 1.68 GiB a GPU short.
    cfg = load_preset_config("deepseek-v4-flash")
    h, q, d = cfg["hidden_size"], cfg["q_lora_rank"], cfg["head_dim"]
    ih, idim = cfg["index_n_heads"], cfg["index_head_dim"]
    replicated = 0
    for ratio in cfg["compress_ratios"][: cfg["num_hidden_layers"]]:
        replicated += h * q + h * d  # wq_a, wkv
        if ratio:
            coff = 2 if ratio == 4 else 1  # CSA's overlapping windows: two entries' width
            replicated += 2 * h * coff * d  # compressor wkv, wgate
        if ratio == 4:
            replicated += q * ih * idim + h * ih + 2 * h * coff * idim  # indexer wq_b, weights_proj, compressor
    model = from_hf_config(cfg, name="deepseek-v4-flash")
    counts = count_parameters(model)
    assert counts.attention_replicated == replicated
    sharded = cfg["num_hidden_layers"] * (
        q * cfg["num_attention_heads"] * d  # wq_b
        + cfg["num_attention_heads"] * d * cfg["o_lora_rank"]  # wo_a: each group's heads -> its rank
        + cfg["o_groups"] * cfg["o_lora_rank"] * h  # wo_b
    )
    assert counts.attention == sharded
    # a TP rank holds the replicated ones whole: TP 8 saves 7/8 of the sharded attention only
    one, eight = weight_bytes(model, tp=1, weight_dtype="bf16"), weight_bytes(model, tp=8, weight_dtype="bf16")
    rest = counts.embedding + counts.lm_head + counts.mlp + counts.experts + counts.expert_biases
    assert one.per_gpu_bytes - eight.per_gpu_bytes == pytest.approx(2 * (sharded + rest) * 7 / 8, rel=1e-6)


@pytest.mark.parametrize(
    ("preset", "family", "kv_heads"),
    [
        ("qwen3-32b", "qwen2", 32),  # (Qwen2Config's default too: 32; 64 heads planned 64 KV heads, 2x the bytes)
        ("qwen3-32b", "qwen3", 32),
        ("qwen3-32b", "mistral", 8),
        ("llama-3.1-8b", "llama", 32),  # LlamaConfig's: num_attention_heads
        ("gemma-2-9b", "gemma2", 4),
        ("gpt-oss-120b", "gpt_oss", 8),
    ],
)
def test_an_absent_num_key_value_heads_takes_the_familys_default(preset: str, family: str, kv_heads: int) -> None:
    """transformers' config classes default num_key_value_heads to a constant (Qwen2 / Qwen3 32,
    Mistral and gpt-oss 8, Gemma 2 4), Llama's to num_attention_heads: the planner read every
    absent one as num_attention_heads. A null one is num_attention_heads where transformers
    takes it (Llama, Qwen2, Qwen3), refused where its int field refuses it."""
    classes = {
        "qwen2": transformers.Qwen2Config,
        "qwen3": transformers.Qwen3Config,
        "mistral": transformers.MistralConfig,
        "llama": transformers.LlamaConfig,
        "gemma2": transformers.Gemma2Config,
        "gpt_oss": transformers.GptOssConfig,
    }
    cfg = {k: v for k, v in load_preset_config(preset).items() if k != "num_key_value_heads"} | {"model_type": family}
    if family == "mistral":
        cfg["sliding_window"] = None
    heads = cfg["num_attention_heads"]
    assert classes[family](num_attention_heads=heads).num_key_value_heads == kv_heads  # (the premise)
    assert from_hf_config(cfg).num_kv_heads == kv_heads
    null = cfg | {"num_key_value_heads": None}
    if family in ("llama", "qwen2", "qwen3"):
        assert (
            from_hf_config(null).num_kv_heads
            == heads
            == classes[family](num_key_value_heads=None, num_attention_heads=heads).num_key_value_heads
        )
    else:
        with pytest.raises(
            ValueError, match=rf"num_key_value_heads must be a positive integer, got null .* {kv_heads}\)"
        ):
            from_hf_config(null)


def test_a_default_kv_heads_that_does_not_divide_the_heads_is_named_as_the_default() -> None:
    """review16 #11: a qwen2 config of 4 heads without num_key_value_heads (Qwen2Config's 32) was
    refused naming num_key_value_heads=32, a value the file does not hold; it says whose default."""
    cfg = {k: v for k, v in load_preset_config("qwen3-32b").items() if k != "num_key_value_heads"}
    cfg |= {"model_type": "qwen2", "num_attention_heads": 4}
    with pytest.raises(
        ValueError, match=r"not a multiple of num_key_value_heads=32 \(qwen2's default: the file has no"
    ):
        from_hf_config(cfg)
    with pytest.raises(ValueError, match=r"not a multiple of num_key_value_heads=3$"):
        from_hf_config(cfg | {"num_key_value_heads": 3})


def test_plan_refuses_a_null_head_dim_in_one_line(tmp_path, capsys) -> None:
    """`kvpool plan --model config.json` with Qwen3's head_dim null: it planned with 128,
    while transformers and the engine (hf_config) refuse the file."""
    from kvpool.cli.main import main

    path = tmp_path / "config.json"
    path.write_text(json.dumps(load_preset_config("qwen3-32b") | {"head_dim": None}))
    assert main(["plan", "--model", str(path)]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1, captured
    assert "qwen3 config: head_dim must be a positive integer, got null" in captured.err
