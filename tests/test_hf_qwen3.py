"""Qwen3 (dense) in kvpool: an HF directory (config.json model_type "qwen3", as transformers'
Qwen3ForCausalLM.save_pretrained writes it) and a "qwen3" GGUF, against that transformers
model on the same random weights (test_qwen2's helpers, family "qwen3": no biases, an RMSNorm
over each query and key head before RoPE, and a head dim of 24 where hidden / heads is 16).
fp64: transformers' RoPE angles in fp64 and its norms without their fp32 casts, as
tests/test_qwen2.py runs it; logits to TOL of the largest (measured ~1e-15). fp32 with the C
kernels (the fused path's kv_head_rms_norm) within C_FP32 times transformers' own fp32 error.
What the model does not compute (an O bias, a sliding window in use, YaRN) is refused naming it."""

from __future__ import annotations

import json
import re

import pytest
import torch

from kvpool.attention.reference import reference_logits
from kvpool.cache import CacheDescriptor
from kvpool.engine.build import build_engine, load_model
from kvpool.models.gguf import load_gguf
from kvpool.models.hf_config import hf_tensor_name, hf_tensors, load_hf, model_bytes, random_llama, random_tensors
from kvpool.models.llama import LlamaModel
from test_hf_qwen2 import llama_config_of, save_dir
from test_qwen2 import C_FP32, HF3, IDS, hf_logits, hf_model, hf_weights, write_gguf
from test_rope_scaling import _engine_rows

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.usefixtures("one_thread")

TOL = 1e-13  # of the largest logit, fp64 (measured: 8.7e-16 untied, 4.4e-16 tied)


def _off(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| over the largest |want|."""
    return ((got.double() - want).abs().max() / want.abs().max()).item()


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_an_hf_qwen3_directory_loads_and_equals_transformers_in_fp64(tmp_path, tied):
    hf, path = save_dir(tmp_path / "qwen3", tied, "qwen3")
    raw = json.loads((path / "config.json").read_text())
    assert raw["model_type"] == "qwen3" and raw["head_dim"] == 24 != raw["hidden_size"] // raw["num_attention_heads"]
    config, model = load_hf(path, torch.float64)
    cfg = config.config
    assert (cfg.qk_norm, cfg.qkv_bias, cfg.tie_embeddings, cfg.head_dim) == (True, False, tied, 24)
    assert model.layers[0]["q_norm"].shape == model.layers[0]["k_norm"].shape == (24,)
    want = hf_logits(hf, IDS)
    assert want.abs().max() > 1.0
    assert _off(reference_logits(model, IDS, fused=False), want) <= TOL
    # the norms were read and applied: with either set to ones, the logits are far off
    for part in ("q_norm", "k_norm"):
        _, other = load_hf(path, torch.float64)
        for layer in other.layers:
            layer[part].fill_(1.0)
        assert _off(reference_logits(other, IDS, fused=False), want) > 1e-3


def test_the_paged_engine_with_chunked_prefill_equals_transformers_in_fp64_and_fp32(tmp_path, kernels):
    """Prefill in chunks of 32 tokens, a prefix hit on the second prompt, 8 decode steps each:
    fp64 rows to TOL and the greedy tokens transformers' argmax; fp32 on the C kernels'
    fused path within C_FP32 x transformers' fp32 error."""
    hf64, path = save_dir(tmp_path / "qwen3", False, "qwen3")
    hf32 = hf_model(hf_weights(False, family="qwen3"), False, torch.float32, "qwen3")
    prompts = [IDS[:70], IDS[:70] + IDS[70:100]]
    _, model64 = load_hf(path, torch.float64)
    cfg = model64.config
    model32 = LlamaModel.from_tensors(cfg, hf_tensors(path, cfg, torch.float32), kernels=kernels)
    assert model32.kernels is not None
    for model in (model64, model32):
        engine = build_engine(
            model,
            descriptor=CacheDescriptor("qwen3", weights_version=str(model.dtype)),
            num_blocks=32,
            block_size=16,
            max_num_batched_tokens=32,
            record_logits=True,
        )
        runs = _engine_rows(engine, prompts, new_tokens=8)
        assert runs[1][2] >= 64  # the first prompt's full blocks from the cache
        for (sequence, rows, _), prompt in zip(runs, prompts, strict=True):
            exact = hf_logits(hf64, sequence[:-1])
            want = exact[len(prompt) - 1 :]
            if model is model64:
                assert _off(rows, want) <= TOL
                assert sequence[len(prompt) :] == want.argmax(-1).tolist()  # greedy: transformers' tokens
            else:
                hf_err = (hf_logits(hf32, sequence[:-1]) - exact).abs().max().item()
                err = (rows - want).abs().max().item()
                assert 0 < hf_err < 1e-3 * exact.abs().max()
                assert err <= C_FP32 * hf_err, f"{err} off fp64, transformers' fp32 {hf_err}"


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_a_qwen3_gguf_equals_the_hf_directory(tmp_path, tied):
    """llama.cpp's names (attn_q_norm / attn_k_norm), the head dim from attention.key_length,
    Q / K rows as they are; its eps is stored in fp32 (1e-6 read back as 9.99999997e-7),
    the one difference from the directory's logits (measured 1.3e-15 of the largest)."""
    weights = hf_weights(tied, family="qwen3")
    _, directory = save_dir(tmp_path / "qwen3", tied, "qwen3")
    path = write_gguf(tmp_path / "qwen3.gguf", weights, family="qwen3")
    f = load_gguf(path)
    cfg = f.meta.config
    assert (cfg.qk_norm, cfg.qkv_bias, cfg.head_dim, cfg.tie_embeddings) == (True, False, 24, tied)
    assert not f.permuted_qk
    _, want_model = load_hf(directory, torch.float64)
    got = reference_logits(LlamaModel.from_tensors(cfg, f.tensors(torch.float32)).astype(torch.float64), IDS)
    want = reference_logits(want_model, IDS)
    assert _off(got, want) <= TOL


def test_a_qwen3_gguf_loads_from_the_weight_cache_with_its_norms(tmp_path, monkeypatch, kernels):
    weights = hf_weights(False, family="qwen3")
    path = write_gguf(tmp_path / "qwen3.gguf", weights, family="qwen3")
    monkeypatch.setenv("KVPOOL_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("KVPOOL_WEIGHT_CACHE", raising=False)
    first = load_model(path, device="cpu")
    loaded = load_model(path, device="cpu")
    assert loaded.load_source == "weight cache" and loaded.model.config.qk_norm and loaded.model.kernels is not None
    assert torch.equal(reference_logits(loaded.model, IDS), reference_logits(first.model, IDS))
    want = hf_logits(hf_model(weights, False, torch.float64, "qwen3"), IDS)
    hf_err = (hf_logits(hf_model(weights, False, torch.float32, "qwen3"), IDS) - want).abs().max().item()
    assert (reference_logits(loaded.model, IDS).double() - want).abs().max().item() <= C_FP32 * hf_err


def test_a_qwen3_config_json_with_random_weights_equals_transformers_holding_them(tmp_path):
    """The config.json path (`kvpool run --model config.json`, bench gpu): random_llama draws
    the q / k norms, hf_tensor_name names them as transformers does, and model_bytes counts them."""
    raw = {**HF3, "model_type": "qwen3", "tie_word_embeddings": False}
    cfg = llama_config_of(raw, tmp_path)
    assert cfg.qk_norm and not cfg.qkv_bias and cfg.max_position == HF3["max_position_embeddings"]
    weights = {hf_tensor_name(n): t for n, t in random_tensors(cfg, 5, torch.float64)}
    assert weights["model.layers.1.self_attn.k_norm.weight"].shape == (24,)
    want = hf_logits(hf_model(weights, False, torch.float64, "qwen3"), IDS)
    got = reference_logits(random_llama(cfg, seed=5, dtype=torch.float64), IDS, fused=False)
    assert _off(got, want) <= TOL
    plain = llama_config_of({**raw, "model_type": "llama"}, tmp_path)  # (the same shapes, no norms)
    assert model_bytes(cfg, torch.float64) - model_bytes(plain, torch.float64) == cfg.num_layers * 2 * 24 * 8


def test_a_qwen3_config_without_head_dim_takes_transformers_128(tmp_path):
    """Qwen3Config's default head_dim is 128, not hidden / heads (Qwen3-0.6B: 1024 / 16 = 64
    for its 128); a null head_dim is refused (transformers' attention cannot size it)."""
    raw = {k: v for k, v in HF3.items() if k != "head_dim"} | {"model_type": "qwen3"}
    cfg = llama_config_of(raw, tmp_path)
    reference = transformers.Qwen3Config(**{k: v for k, v in raw.items() if k != "model_type"})
    assert cfg.head_dim == reference.head_dim == 128
    assert llama_config_of({**raw, "model_type": "qwen2"}, tmp_path).head_dim == 16  # (Qwen2: hidden / heads)
    with pytest.raises(ValueError, match="head_dim must be a positive integer, got None"):
        llama_config_of({**raw, "head_dim": None}, tmp_path)


@pytest.mark.parametrize(("model_type", "default"), [("qwen3", 32), ("qwen2", 32), ("mistral", 8), ("llama", 64)])
def test_an_absent_num_key_value_heads_takes_transformers_default(tmp_path, model_type, default):
    """Qwen2Config / Qwen3Config default num_key_value_heads to 32, MistralConfig to 8 (LlamaConfig
    to num_attention_heads): a config.json of 64 heads without the key ran 64 KV heads where
    transformers builds 32. null is num_attention_heads (MistralConfig refuses it)."""
    classes = {
        "qwen3": transformers.Qwen3Config,
        "qwen2": transformers.Qwen2Config,
        "mistral": transformers.MistralConfig,
        "llama": transformers.LlamaConfig,
    }
    raw = {k: v for k, v in HF3.items() if k != "num_key_value_heads"}
    raw |= {"model_type": model_type, "num_attention_heads": 64, "head_dim": 8, "sliding_window": None}
    assert classes[model_type](**{k: v for k, v in raw.items() if k != "model_type"}).num_key_value_heads == default
    assert llama_config_of(raw, tmp_path).num_kv_heads == default
    null = {**raw, "num_key_value_heads": None}
    if model_type == "mistral":
        with pytest.raises(ValueError, match="num_key_value_heads must be a positive integer, got None"):
            llama_config_of(null, tmp_path)
    else:
        assert llama_config_of(null, tmp_path).num_kv_heads == 64


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        # an O bias too in transformers' Qwen3Attention: not computed
        ({"attention_bias": True}, "attention_bias True is not modelled"),
        ({"use_sliding_window": True, "sliding_window": 64, "max_window_layers": 1}, "use_sliding_window with"),
        (
            {"layer_types": ["full_attention", "sliding_attention"], "use_sliding_window": True, "sliding_window": 64},
            "layer_types 'sliding_attention' with use_sliding_window and sliding_window 64 is not modelled",
        ),
        (
            {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}},
            "rope_scaling type 'yarn' is not modelled",
        ),
        ({"head_dim": 25}, "head_dim 25 must be even"),
    ],
)
def test_a_qwen3_config_the_model_cannot_compute_is_refused(tmp_path, changes, match):
    with pytest.raises(ValueError, match=match):
        llama_config_of({**HF3, "model_type": "qwen3", **changes}, tmp_path)


def test_qwen3_configs_that_attend_in_full_are_read(tmp_path):
    for changes in (
        {"use_sliding_window": False, "sliding_window": None, "max_window_layers": 28},  # Qwen3-0.6B's
        {"use_sliding_window": True, "sliding_window": 64, "max_window_layers": 2},
        {"layer_types": ["full_attention"] * 2, "attention_bias": False},
    ):
        assert llama_config_of({**HF3, "model_type": "qwen3", **changes}, tmp_path).qk_norm


def test_what_a_qwen3_directory_or_gguf_lacks_or_adds_is_refused_naming_it(tmp_path):
    from safetensors.torch import save_file

    weights = hf_weights(True, family="qwen3")
    _, path = save_dir(tmp_path / "qwen3", True, "qwen3")
    good = {k: v.float() for k, v in weights.items()}
    save_file(
        {k: v for k, v in good.items() if k != "model.layers.1.self_attn.k_norm.weight"}, path / "model.safetensors"
    )
    with pytest.raises(ValueError, match=re.escape("lack tensors ['model.layers.1.self_attn.k_norm.weight']")):
        load_hf(path)
    save_file({**good, "model.layers.0.self_attn.q_norm.weight": torch.ones(16)}, path / "model.safetensors")
    with pytest.raises(ValueError, match=re.escape("q_norm.weight' is [16] torch.float32; the config needs [24]")):
        load_hf(path)
    save_file({**good, "model.layers.0.self_attn.q_proj.bias": torch.zeros(96)}, path / "model.safetensors")
    with pytest.raises(ValueError, match="q_proj.bias' is no weight kvpool's model of this config uses"):
        load_hf(path)
    # GGUFs: a qwen3's norm missing, a bias, V heads of another size; a qwen2's q norm
    lacking = write_gguf(tmp_path / "lacking.gguf", weights, skip=("blk.1.attn_k_norm.weight",), family="qwen3")
    with pytest.raises(ValueError, match=re.escape("lacks tensors ['blk.1.attn_k_norm.weight']")):
        load_gguf(lacking)
    bias = {"blk.0.attn_q.bias": torch.zeros(96)}
    with pytest.raises(ValueError, match=re.escape("does not add (none on a llama or qwen3 GGUF's attention")):
        load_gguf(write_gguf(tmp_path / "bias.gguf", weights, extra=bias, family="qwen3"))
    norm = {"blk.0.attn_q_norm.weight": torch.ones(16)}
    with pytest.raises(ValueError, match="'blk.0.attn_q_norm.weight' is a per-head q / k norm kvpool's model of this"):
        load_gguf(write_gguf(tmp_path / "qwen2.gguf", hf_weights(True), extra=norm))


def test_a_gguf_whose_value_heads_differ_in_size_is_refused(tmp_path, monkeypatch):
    import gguf

    add_value_length = gguf.GGUFWriter.add_value_length
    monkeypatch.setattr(gguf.GGUFWriter, "add_value_length", lambda self, n: add_value_length(self, 32))
    path = write_gguf(tmp_path / "v32.gguf", hf_weights(False, family="qwen3"), family="qwen3")
    with pytest.raises(ValueError, match="qwen3.attention.value_length 32 is not the head dim 24"):
        load_gguf(path)


def test_kvpool_generate_and_run_on_a_qwen3_directory(tmp_path, capsys):
    """`kvpool generate --model DIR` gives transformers' greedy tokens (fp32, its margins
    checked as test_hf_dir does); `kvpool run --model DIR` serves it with its weights."""
    from hf_tiny import save_tokenizer
    from kvpool.cli.main import main
    from test_hf_dir import _hf_greedy

    _, path = save_dir(tmp_path / "qwen3", False, "qwen3")
    save_tokenizer(path)
    raw = json.loads((path / "config.json").read_text())  # (room for run's workload)
    (path / "config.json").write_text(json.dumps({**raw, "max_position_embeddings": 2048}))
    n = 10
    loaded = load_model(str(path), dtype=torch.float32, device="cpu")
    assert loaded.model.config.qk_norm and loaded.model.kernels is not None
    prompt = loaded.tokenizer.encode_chat([{"role": "user", "content": "Hello world"}])
    ref64, _ = _hf_greedy(path, torch.float64, prompt, n)
    ref32, gap = _hf_greedy(path, torch.float32, prompt, n)
    assert ref32 == ref64 and gap > 1e-3, gap
    assert main(["generate", "Hello world", "--model", str(path), "--max-tokens", str(n), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    stop = set(loaded.tokenizer.stop_token_ids) | {loaded.tokenizer.eos_token_id}
    end = next((i + 1 for i, t in enumerate(ref64) if t in stop), n)  # the CLI stops at an end of turn
    assert report["token_ids"] == ref64[:end] and report["load_source"] == "safetensors"
    argv = ["run", "--model", str(path), "--num-requests", "2", "--turns", "1", "--num-long", "0"]
    assert main([*argv, "--request-rate", "inf", "--max-tokens", "3", "--kv-memory", "1MiB", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert (report["num_finished"], report["num_generated_tokens"], report["load_source"]) == (2, 6, "safetensors")


def test_the_fused_forward_runs_the_norm_kernel_only_for_a_qwen3(tmp_path, monkeypatch, kernels):
    """A model without q / k norms never calls kv_head_rms_norm (nothing per token is added
    to a Llama / Qwen2 step); a Qwen3 calls it once a layer."""
    calls = []
    norm = kernels.lib.kv_head_rms_norm
    monkeypatch.setattr(kernels.lib, "kv_head_rms_norm", lambda *args: calls.append(args[1]) or norm(*args))
    for model_type, expected in (("qwen3", [5, 5]), ("qwen2", []), ("llama", [])):
        cfg = llama_config_of({**HF3, "model_type": model_type}, tmp_path)
        model = LlamaModel.from_tensors(cfg, random_tensors(cfg, 1, torch.float32), kernels=kernels)
        calls.clear()
        reference_logits(model, IDS[:5])
        assert calls == expected, model_type


# Qwen3-0.6B's config.json (its sizes and keys; no weights)
QWEN3_0_6B = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "hidden_size": 1024,
    "intermediate_size": 3072,
    "num_hidden_layers": 28,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 151936,
    "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-6,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "tie_word_embeddings": True,
    "attention_bias": False,
    "use_sliding_window": False,
    "sliding_window": None,
    "max_window_layers": 28,
    "hidden_act": "silu",
    "torch_dtype": "bfloat16",
}


def test_qwen3_0_6b_kv_bytes_use_its_head_dim_in_the_engine_and_the_capacity_model(tmp_path):
    """hidden / heads is 64, its heads 128: a KV token is 2 x 28 layers x 8 heads x 128 x 2
    bytes in bf16 (114,688), in the engine's pool as in kvpool plan's capacity model."""
    from kvpool.capacity.kv import kv_layout
    from kvpool.spec.models import from_hf_config
    from kvpool.storage.kv import PagedKVStorage

    cfg = llama_config_of(QWEN3_0_6B, tmp_path)
    assert (cfg.head_dim, cfg.num_kv_heads, cfg.qk_norm, cfg.tie_embeddings) == (128, 8, True, True)
    pool = PagedKVStorage(cfg.num_layers, 1, 16, cfg.num_kv_heads, cfg.head_dim, torch.bfloat16)
    assert pool.bytes_per_token == kv_layout(from_hf_config(QWEN3_0_6B)).bytes_per_token == 2 * 28 * 8 * 128 * 2
