"""Published quantized checkpoints' config.json shapes: the weight format each prices as, the
refusal of one kvpool cannot price, and --weight-dtype overriding it."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

from kvpool.capacity.weights import weight_bytes
from kvpool.cli.main import main
from kvpool.spec.models import from_hf_config, load_preset_config

# Llama-3.1-8B's parameters (test_capacity_models.test_weight_bytes_by_format_and_tp):
# linears of 32 layers, embedding and untied head, norms.
LINEAR = 32 * (4096 * (4096 + 1024 + 1024 + 4096) + 3 * 4096 * 14336)
EMBEDDING = 128_256 * 4096
NORMS = (2 * 32 + 1) * 4096
# FP8 linears (E4M3 + an fp32 scale per 128 x 128 block), BF16 embedding, head and norms
FP8_BYTES = LINEAR + LINEAR * 4 // (128 * 128) + 2 * (2 * EMBEDDING + NORMS)
BF16_BYTES = 2 * (LINEAR + 2 * EMBEDDING + NORMS)

# RedHatAI/Meta-Llama-3.1-*-Instruct-FP8 (llm-compressor, FP8 dynamic): per-channel E4M3
# weights, per-token FP8 activations, the head left out.
COMPRESSED_FP8 = {
    "quant_method": "compressed-tensors",
    "format": "float-quantized",
    "quantization_status": "compressed",
    "kv_cache_scheme": None,
    "ignore": ["lm_head"],
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 8, "type": "float", "strategy": "channel", "group_size": None, "symmetric": True},
            "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True},
            "output_activations": None,
        }
    },
}
# RedHatAI/Meta-Llama-3.1-8B-Instruct-quantized.w4a16: 4-bit int weights in groups of 128
COMPRESSED_W4A16 = COMPRESSED_FP8 | {
    "format": "pack-quantized",
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128, "symmetric": True},
            "input_activations": None,
            "output_activations": None,
        }
    },
}
# Meta's fbgemm rowwise FP8 (transformers' FbgemmFp8Config)
FBGEMM_FP8 = {"quant_method": "fbgemm_fp8", "activation_scale_ub": 1200.0, "modules_to_not_convert": ["lm_head"]}
GPTQ = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": True, "sym": True, "damp_percent": 0.01}
AWQ = {"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemm", "zero_point": True}


def _llama(quant: dict[str, Any]) -> dict[str, Any]:
    return load_preset_config("llama-3.1-8b") | {"quantization_config": quant}


def test_the_fp8_methods_are_priced_as_fp8() -> None:
    assert FP8_BYTES == 9_082_904_576
    for quant in (COMPRESSED_FP8, FBGEMM_FP8, {"quant_method": "fp8"}):
        spec = from_hf_config(_llama(quant))
        assert (spec.weight_format, spec.weight_format_error) == ("fp8", None)
        assert weight_bytes(spec).total_bytes == FP8_BYTES
    # the router (compressed-tensors' "re:.*mlp.gate$") and embeddings are BF16 in fp8 anyway
    ignore = COMPRESSED_FP8 | {"ignore": ["lm_head", "re:.*mlp.gate$", "model.embed_tokens"]}
    assert from_hf_config(_llama(ignore)).weight_format == "fp8"
    # a multimodal checkpoint's vision side left out (llm-compressor's Gemma 3 recipe): kvpool
    # prices the language model alone
    vision = ["re:.*lm_head", "re:vision_tower.*", "re:multi_modal_projector.*"]
    assert from_hf_config(_llama(COMPRESSED_FP8 | {"ignore": vision})).weight_format == "fp8"
    # FP8 in 128 x 128 blocks (llm-compressor's FP8_BLOCK) too
    weights = {"num_bits": 8, "type": "float", "strategy": "block"}
    block = COMPRESSED_FP8 | {"config_groups": {"g": {"targets": ["Linear"], "weights": weights}}}
    assert from_hf_config(_llama(block)).weight_format == "fp8"


@pytest.mark.parametrize(
    ("quant", "why"),
    [
        (
            COMPRESSED_W4A16,
            "quant_method 'compressed-tensors' with 4-bit 'int' weights (config_groups.group_0, group_size 128)",
        ),
        (GPTQ, "quant_method 'gptq' (4-bit int weights, group_size 128)"),
        (AWQ, "quant_method 'awq' (4-bit int weights, group_size 128)"),
        ({"quant_method": "bitsandbytes"}, "quant_method 'bitsandbytes' is not one kvpool understands"),
        # Llama-3.1-405B-Instruct-FP8 keeps its attention in BF16: fp8 would price it light
        (
            FBGEMM_FP8 | {"modules_to_not_convert": ["model.layers.0.self_attn.q_proj", "lm_head"]},
            "'fbgemm_fp8' keeps 1 linear module(s) unquantized "
            "(modules_to_not_convert names 'model.layers.0.self_attn.q_proj')",
        ),
        (
            COMPRESSED_FP8
            | {"config_groups": {"mlp": COMPRESSED_FP8["config_groups"]["group_0"] | {"targets": ["re:.*mlp.*"]}}},
            'quantizes the targets ["re:.*mlp.*"] (config_groups.mlp), not every Linear',
        ),
        (
            COMPRESSED_FP8 | {"ignore": ["lm_head", "re:.*down_proj"]},
            "'compressed-tensors' keeps 1 linear module(s) unquantized (ignore names 're:.*down_proj')",
        ),
    ],
)
def test_a_quantization_kvpool_cannot_price_is_refused_only_when_priced(quant: dict[str, Any], why: str) -> None:
    spec = from_hf_config(_llama(quant))  # reading the config is fine
    assert spec.weight_format == "unknown"
    with pytest.raises(ValueError, match="^llama: quantization_config.") as refusal:
        weight_bytes(spec)
    assert why in str(refusal.value) and "--weight-dtype" in str(refusal.value)
    # a weight dtype the user names prices it
    assert weight_bytes(spec, weight_dtype="fp8").total_bytes == FP8_BYTES
    assert weight_bytes(spec, weight_dtype="bf16").total_bytes == BF16_BYTES


@pytest.mark.parametrize(
    ("quant", "message"),
    [
        ({"quant_method": "compressed-tensors"}, "config_groups must be a non-empty JSON object of groups, got null"),
        ({"quant_method": "compressed-tensors", "config_groups": {"g": []}}, "config_groups.g.weights must be"),
        ({"quant_method": "compressed-tensors", "config_groups": {"g": {"targets": ["Linear"]}}}, "g.weights must be"),
        (FBGEMM_FP8 | {"modules_to_not_convert": "lm_head"}, 'modules_to_not_convert must be a list.*got "lm_head"'),
    ],
)
def test_a_malformed_quantization_config_is_named(quant: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        from_hf_config(_llama(quant))


def test_plan_and_simulate_read_a_quantized_checkpoint_folder(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    fp8 = tmp_path / "Llama-3.1-8B-Instruct-FP8"
    fp8.mkdir()
    (fp8 / "config.json").write_text(json.dumps(_llama(COMPRESSED_FP8)))
    assert main(["plan", "--config", str(fp8), "--context", "8192", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["weight_dtype"], out["weight_bytes"]) == ("fp8", FP8_BYTES)
    assert main(["simulate", "--model", str(fp8), "--requests", "4"]) == 0
    capsys.readouterr()
    # GPTQ: refused without --weight-dtype, naming the method; planned with it
    gptq = tmp_path / "gptq"
    gptq.mkdir()
    (gptq / "config.json").write_text(json.dumps(_llama(GPTQ)))
    assert main(["plan", "--config", str(gptq), "--context", "8192"]) == 2
    assert "quant_method 'gptq' (4-bit int weights, group_size 128)" in capsys.readouterr().err
    assert main(["plan", "--config", str(gptq), "--context", "8192", "--weight-dtype", "fp8", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["weight_bytes"] == FP8_BYTES
    assert main(["simulate", "--model", str(gptq), "--requests", "4"]) == 2
    assert "quant_method 'gptq'" in capsys.readouterr().err
    assert main(["simulate", "--model", str(gptq), "--requests", "4", "--weight-dtype", "fp8"]) == 0


def test_an_unknown_weight_format_carries_its_refusal() -> None:
    spec = from_hf_config(load_preset_config("llama-3.1-8b"))
    with pytest.raises(ValueError, match="weight_format_error says why exactly a weight_format is 'unknown'"):
        dataclasses.replace(spec, weight_format="unknown")
    with pytest.raises(ValueError, match="weight_format_error says why"):
        dataclasses.replace(spec, weight_format_error="no reason to be here")


def test_an_experts_only_format_on_a_dense_model_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # mxfp4 and fp4+fp8 put only routed experts in FP4: Llama-3.1-8B "mxfp4" came out at its
    # BF16 bytes (14.96 GiB) and "fp4+fp8" at its FP8 bytes, each under the 4-bit name
    spec = from_hf_config(_llama(None))
    for fmt, rest in (("mxfp4", "bf16"), ("fp4+fp8", "fp8")):
        with pytest.raises(ValueError) as refusal:
            weight_bytes(spec, weight_dtype=fmt)
        assert str(refusal.value) == (
            f"llama: --weight-dtype {fmt} puts only routed experts in FP4 (the rest in {rest}), and llama has none: "
            f"every weight would be priced in {rest}; name --weight-dtype {rest} for that"
        )
        assert main(["plan", "--model", "llama-3.1-8b", "--context", "8192", "--weight-dtype", fmt]) == 2
        assert capsys.readouterr().err.startswith(f"kvpool plan: error: llama-3.1-8b: --weight-dtype {fmt} puts")
    # a dense checkpoint that says mxfp4 is refused as a format kvpool cannot price ...
    dense = tmp_path / "config.json"
    dense.write_text(json.dumps(_llama({"quant_method": "mxfp4"})))
    assert main(["plan", "--config", str(dense), "--context", "8192"]) == 2
    assert "quant_method 'mxfp4' on a model without routed experts" in capsys.readouterr().err
    # ... and priced in a format the user names
    assert main(["plan", "--config", str(dense), "--context", "8192", "--weight-dtype", "fp8", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["weight_bytes"] == FP8_BYTES
    # a MoE model keeps the format: gpt-oss-120b's MXFP4 experts (by hand: 114,661,785,600
    # expert weights at 0.5 + 1/32 B, its other 2,167,371,072 parameters at 2 B)
    moe = from_hf_config(load_preset_config("gpt-oss-120b"))
    assert weight_bytes(moe, weight_dtype="mxfp4").total_bytes == 65_248_815_744
