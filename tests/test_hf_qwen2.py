"""Qwen2 from a Hugging Face directory (models/hf_config.py): config.json with model_type
"qwen2" (Q / K / V biases, tied or untied) and its safetensors, as transformers'
Qwen2ForCausalLM.save_pretrained writes them (one file, or shards and their index), against
that same transformers model: in fp64 to TOL64 of the largest logit (transformers' RoPE
frequencies and angles in fp64 and its norms in the input's dtype, as tests/test_qwen2.py
runs it for Qwen2 GGUFs). A config.json alone runs with seeded random weights, biases
included, equal to transformers holding those weights. What the model does not compute
(a sliding window in use, an O bias, a tensor of another shape) is refused naming it."""

from __future__ import annotations

import json
import re

import pytest
import torch
from safetensors.torch import save_file

from kvpool.attention.reference import reference_logits
from kvpool.cache import CacheDescriptor
from kvpool.engine.build import build_engine
from kvpool.models.hf_config import (
    hf_tensor_name,
    hf_weight_files,
    llama_config,
    load_hf,
    model_bytes,
    random_llama,
    random_tensors,
)
from test_qwen2 import HF, IDS, TOL64, hf_logits, hf_model, hf_weights
from test_rope_scaling import _engine_rows

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.usefixtures("one_thread")


def save_dir(path, tied: bool, family: str = "qwen2", **save) -> tuple[object, object]:
    """transformers' fp64 Qwen2 (Qwen3 of family "qwen3") of test_qwen2's random weights,
    saved to `path` by save_pretrained (safetensors): (the model, the path)."""
    model = hf_model(hf_weights(tied, family=family), tied, torch.float64, family)
    model.save_pretrained(path, **save)
    return model, path


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_an_hf_qwen2_directory_loads_and_equals_transformers_in_fp64(tmp_path, tied):
    hf, path = save_dir(tmp_path / "qwen2", tied)
    raw = json.loads((path / "config.json").read_text())
    assert raw["model_type"] == "qwen2" and hf_weight_files(path) == [path / "model.safetensors"]
    config, model = load_hf(path, torch.float64)
    cfg = config.config
    assert (cfg.qkv_bias, cfg.tie_embeddings, cfg.rope_theta, cfg.head_dim) == (True, tied, 1e6, 16)
    assert model.dtype == torch.float64 and (model.lm_head is None) == tied
    want = hf_logits(hf, IDS)
    got = reference_logits(model, IDS, fused=False).double()
    assert want.abs().max() > 1.0
    assert (got - want).abs().max() <= TOL64 * want.abs().max()
    # the biases were read: zeroed, the logits are far off
    for layer in model.layers:
        layer["bqkv"].zero_()
    assert (reference_logits(model, IDS, fused=False).double() - want).abs().max() > 1e-3 * want.abs().max()


def test_sharded_safetensors_and_the_paged_engine(tmp_path):
    """Shards named by model.safetensors.index.json load as the single file does; the paged
    engine (a prefix hit on the second prompt) on the loaded model equals transformers."""
    hf, path = save_dir(tmp_path / "qwen2", False, max_shard_size="40KB")
    files = hf_weight_files(path)
    assert len(files) > 2 and (path / "model.safetensors.index.json").is_file()
    _, model = load_hf(path, torch.float64)
    engine = build_engine(
        model,
        descriptor=CacheDescriptor("qwen2", weights_version="x"),
        num_blocks=32,
        block_size=16,
        record_logits=True,
    )
    prompts = [IDS[:70], IDS[:70] + IDS[70:100]]
    runs = _engine_rows(engine, prompts, new_tokens=6)
    assert runs[1][2] >= 64
    for (sequence, rows, _), prompt in zip(runs, prompts, strict=True):
        want = hf_logits(hf, sequence[:-1])[len(prompt) - 1 :]
        assert (rows - want).abs().max() <= TOL64 * want.abs().max()


def test_each_tensor_of_shards_is_read_from_the_file_the_index_names(tmp_path):
    """A stale copy of a tensor in another shard is not read (the file sorting last won: a
    wrong norm, or 'lacks tensors' for a layer's); a tensor the index puts in a file that
    lacks it is refused naming both."""
    from safetensors import safe_open

    _, path = save_dir(tmp_path / "qwen2", False, max_shard_size="40KB")
    _, want = load_hf(path, torch.float64)
    weight_map = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    files = sorted(set(weight_map.values()))
    for stale in ("model.norm.weight", "model.layers.0.self_attn.q_proj.weight"):
        home = weight_map[stale]
        other = files[-1] if home != files[-1] else files[0]
        with safe_open(path / other, framework="pt") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
        with safe_open(path / home, framework="pt") as f:
            tensors[stale] = torch.full_like(f.get_tensor(stale), 7.0)
        save_file(tensors, str(path / other), metadata={"format": "pt"})
        _, model = load_hf(path, torch.float64)
        assert torch.equal(model.norm, want.norm)
        for got, expected in zip(model.layers, want.layers, strict=True):
            assert all(torch.equal(got[k], expected[k]) for k in expected)
        del tensors[stale]
        save_file(tensors, str(path / other), metadata={"format": "pt"})
    index = json.loads((path / "model.safetensors.index.json").read_text())
    other = files[0] if weight_map["model.norm.weight"] != files[0] else files[1]
    index["weight_map"]["model.norm.weight"] = other
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match=re.escape(f"{path / other}: lacks tensor 'model.norm.weight', which model")):
        load_hf(path, torch.float64)


def test_a_qwen2_config_json_with_random_weights_equals_transformers_holding_them(tmp_path):
    """The config.json path (`kvpool run --model config.json`, bench gpu): random_llama draws
    the biases too, and hf_tensor_name names them as transformers does."""
    (tmp_path / "config.json").write_text(json.dumps({**HF, "model_type": "qwen2", "tie_word_embeddings": False}))
    cfg = llama_config(tmp_path).config
    assert cfg.qkv_bias and cfg.max_position == HF["max_position_embeddings"]
    weights = {hf_tensor_name(n): t for n, t in random_tensors(cfg, 5, torch.float64)}
    assert weights["model.layers.1.self_attn.v_proj.bias"].shape == (32,)
    hf = hf_model(weights, False, torch.float64)
    want = hf_logits(hf, IDS)
    got = reference_logits(random_llama(cfg, seed=5, dtype=torch.float64), IDS, fused=False).double()
    assert (got - want).abs().max() <= TOL64 * want.abs().max()
    # the estimate counts the biases: exactly their elements more than without them
    plain = llama_config_of({**HF, "model_type": "llama", "tie_word_embeddings": False}, tmp_path)
    extra = cfg.num_layers * (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim * 8
    assert model_bytes(cfg, torch.float64) - model_bytes(plain, torch.float64) == extra


def llama_config_of(raw: dict, tmp_path):
    (tmp_path / "other.json").write_text(json.dumps(raw))
    return llama_config(tmp_path / "other.json").config


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"use_sliding_window": True, "sliding_window": 64, "max_window_layers": 1}, "use_sliding_window with"),
        # transformers 5.25 fails building this model's mask (a window of None)
        (
            {"layer_types": ["full_attention", "sliding_attention"], "use_sliding_window": True, "sliding_window": 64},
            "layer_types 'sliding_attention' with use_sliding_window and sliding_window 64 is not modelled",
        ),
        ({"use_sliding_window": "false"}, "use_sliding_window must be true or false"),
        # no sliding_window key: transformers fills in 4096 and slides (it was read as full attention)
        (
            {"use_sliding_window": True, "max_window_layers": 0},
            re.escape("sliding_window 4096 (transformers' default: config.json has no key)"),
        ),
        # one type per layer, as transformers checks (a short list was read)
        ({"layer_types": ["full_attention"]}, "layer_types has 1 entries for num_hidden_layers 2"),
        ({"layer_types": ["full_attention", "sliding_attention"]}, "'sliding_attention' without a window"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not modelled"),
    ],
)
def test_a_qwen2_config_the_model_cannot_compute_is_refused(tmp_path, changes, match):
    with pytest.raises(ValueError, match=match):
        llama_config_of({**HF, "model_type": "qwen2", **changes}, tmp_path)


def test_qwen2_configs_that_attend_in_full_are_read(tmp_path):
    # Qwen2.5's: a window named, not used; or used from a layer past the last
    for changes in (
        {"use_sliding_window": False, "sliding_window": 131072, "max_window_layers": 21},
        {"use_sliding_window": True, "sliding_window": 64, "max_window_layers": 2},
        {"layer_types": ["full_attention"] * 2, "attention_bias": True},
        {"layer_types": ["attention", "full_attention"]},  # (transformers' legacy name of full_attention)
        {"use_sliding_window": True, "sliding_window": None, "max_window_layers": 0},
    ):
        assert llama_config_of({**HF, "model_type": "qwen2", **changes}, tmp_path).qkv_bias


@pytest.mark.parametrize(
    "changes",
    [
        {},
        {"use_sliding_window": True},
        {"use_sliding_window": True, "max_window_layers": 1},
        {"use_sliding_window": True, "max_window_layers": 2},
        {"use_sliding_window": True, "sliding_window": None, "max_window_layers": 0},
        {"use_sliding_window": True, "sliding_window": 64, "max_window_layers": 0},
        {"use_sliding_window": False, "max_window_layers": 0},
        {"use_sliding_window": True, "max_window_layers": 0, "layer_types": ["full_attention"] * 2},
    ],
)
def test_a_qwen2_config_is_read_where_transformers_attends_in_full_on_every_layer(tmp_path, changes):
    raw = {**HF, "model_type": "qwen2", **changes}
    reference = transformers.Qwen2Config(**{k: v for k, v in raw.items() if k != "model_type"})
    full = set(reference.layer_types) == {"full_attention"}
    try:
        llama_config_of(raw, tmp_path)
        read = True
    except ValueError as e:
        assert "sliding" in str(e)
        read = False
    assert read == full, (reference.sliding_window, reference.layer_types)


def test_what_an_hf_directory_lacks_or_adds_is_refused_naming_it(tmp_path):
    _, path = save_dir(tmp_path / "qwen2", True)
    good = dict(_tensors(path))
    cases = {
        "o_bias": ({**good, "model.layers.0.self_attn.o_proj.bias": torch.zeros(64)}, "o_proj.bias' is no weight"),
        "layer2": ({**good, "model.layers.2.input_layernorm.weight": torch.ones(64)}, "layers.2.input_layernorm"),
        "shape": (
            {**good, "model.layers.1.self_attn.k_proj.bias": torch.zeros(16)},
            r"is \[16\] torch.float32; the config needs \[32\]",
        ),
        "ints": ({**good, "model.norm.weight": torch.ones(64, dtype=torch.int32)}, "floating point"),
        "nan": (
            {**good, "model.layers.1.mlp.up_proj.weight": good["model.layers.1.mlp.up_proj.weight"] * torch.nan},
            "up_proj.weight' holds a NaN",
        ),
    }
    for tensors, match in cases.values():
        save_file(tensors, str(path / "model.safetensors"))
        with pytest.raises(ValueError, match=match):
            load_hf(path, torch.float64)
    save_file(
        {k: v for k, v in good.items() if k != "model.layers.1.self_attn.q_proj.bias"}, str(path / "model.safetensors")
    )
    # the directory and transformers' names (a GGUF's 'layers.1.q_bias' / 'output.weight' were named)
    with pytest.raises(
        ValueError, match=re.escape(f"{path}: its safetensors lack tensors ['model.layers.1.self_attn.q_proj.bias']")
    ):
        load_hf(path, torch.float64)
    save_file({k: v for k, v in good.items() if not k.startswith("model.layers.1.")}, str(path / "model.safetensors"))
    with pytest.raises(
        ValueError, match=re.escape("lack tensors ['model.layers.1.self_attn.q_proj.weight', ") + ".* and 8 more"
    ):
        load_hf(path, torch.float64)
    raw = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**raw, "tie_word_embeddings": False}))
    save_file(good, str(path / "model.safetensors"))
    with pytest.raises(ValueError, match=re.escape(f"{path}: lacks tensor 'lm_head.weight' (the LM head), and its")):
        load_hf(path, torch.float64)
    (path / "config.json").write_text(json.dumps(raw))
    (path / "model.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(ValueError, match="not a safetensors file"):
        load_hf(path)
    (path / "model.safetensors").unlink()
    with pytest.raises(ValueError, match="no model.safetensors nor model.safetensors.index.json"):
        load_hf(path)
    # a Llama's Q bias: its model adds none
    raw = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**raw, "model_type": "llama"}))
    save_file(good, str(path / "model.safetensors"))
    with pytest.raises(ValueError, match="k_proj.bias' is no weight kvpool's model of this config uses"):
        load_hf(path)


def _tensors(path):
    from safetensors import safe_open

    with safe_open(path / "model.safetensors", framework="pt") as f:
        return [(k, f.get_tensor(k)) for k in f.keys()]  # noqa: SIM118


def test_kvpool_run_serves_an_hf_directory_with_its_weights(tmp_path, capsys):
    from kvpool.cli.main import main

    _, path = save_dir(tmp_path / "qwen2", False)
    raw = json.loads((path / "config.json").read_text())  # (room for the workload's prompts)
    (path / "config.json").write_text(json.dumps({**raw, "max_position_embeddings": 2048}))
    argv = ["run", "--model", str(path), "--num-requests", "2", "--turns", "1", "--num-long", "0"]
    assert main([*argv, "--request-rate", "inf", "--max-tokens", "3", "--kv-memory", "1MiB", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert (report["num_finished"], report["num_generated_tokens"]) == (2, 6)
    assert report["load_source"] == "safetensors"  # (was "built in")
    # one process only: the flag was ignored without a word
    assert main([*argv, "--tensor-parallel-size", "2"]) == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"kvpool run: error: --model {path}: an HF directory without a tokenizer.json runs on one process "
        "(no --tensor-parallel-size 2)"
    )
    (path / "model.safetensors").unlink()  # a directory without its weights: refused, not run with random ones
    assert main(argv) == 2
    assert "no model.safetensors nor model.safetensors.index.json" in capsys.readouterr().err
