"""A Llama from an HF config.json with seeded random weights (models/hf_config.py), against
transformers' LlamaForCausalLM loaded with the same weights.

fp64: transformers computes RMSNorm and the RoPE tables in fp32 whatever the model's dtype,
so the exact comparison gives both models the same RoPE tables (transformers' own) and runs
transformers' norm in the input's dtype; everything else is then equal to ~1e-15. fp32: the
engine's model (its own RoPE tables) against transformers in fp64, within 4x transformers'
own fp32-vs-fp64 error (~2e-6 on these logits of ~4)."""

from __future__ import annotations

import json

import pytest
import torch

from kvpool.attention.reference import reference_logits
from kvpool.models.hf_config import hf_tensor_name, llama_config, model_bytes, random_llama, random_tensors
from random_llama import LLAMA3_SCALING, TINY_HF_LLAMA

transformers = pytest.importorskip("transformers")
from transformers.models.llama import modeling_llama  # noqa: E402

RAW = TINY_HF_LLAMA
IDS = torch.randint(0, 300, (40,), generator=torch.Generator().manual_seed(0)).tolist()


def _config(tmp_path, **changes):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**RAW, **changes}))
    return path


def _hf(raw: dict, cfg, dtype: torch.dtype):
    model = modeling_llama.LlamaForCausalLM(transformers.LlamaConfig(**raw)).to(dtype).eval()
    state = {hf_tensor_name(n): t for n, t in random_tensors(cfg, 3, dtype)}
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and missing == (["lm_head.weight"] if cfg.tie_embeddings else [])
    if cfg.tie_embeddings:  # transformers ties the head to the embedding it just loaded
        assert torch.equal(model.lm_head.weight, state["model.embed_tokens.weight"])
    return model


def _hf_logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([IDS])).logits[0].double()


@pytest.mark.parametrize("tied", [False, True])
def test_fp64_logits_equal_transformers_with_the_same_random_weights(tmp_path, monkeypatch, tied):
    raw = {**RAW, "tie_word_embeddings": tied}
    cfg = llama_config(_config(tmp_path, tie_word_embeddings=tied)).config
    assert (cfg.head_dim, cfg.tie_embeddings) == (16, tied)

    def norm_in_input_dtype(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))

    monkeypatch.setattr(modeling_llama.LlamaRMSNorm, "forward", norm_in_input_dtype)
    hf = _hf(raw, cfg, torch.float64)
    ours = random_llama(cfg, seed=3, dtype=torch.float64)
    # transformers' RoPE tables (fp32 math, fp64 values) in the engine's form, [-sin | sin]
    cos, sin = hf.model.rotary_emb(torch.zeros(1, dtype=torch.float64), torch.arange(cfg.max_position)[None])
    sin = sin[0].clone()
    sin[:, : cfg.head_dim // 2] *= -1
    ours.cos, ours.sin_signed = cos[0].clone(), sin
    want = _hf_logits(hf)
    got = reference_logits(ours, IDS, fused=False).double()
    assert want.abs().max() > 1.0  # logits that are not all near zero
    assert (got - want).abs().max() <= 1e-12 * want.abs().max()


def test_fp32_logits_within_transformers_own_fp32_error(tmp_path):
    cfg = llama_config(_config(tmp_path)).config
    truth = _hf_logits(_hf(RAW, cfg, torch.float64))
    hf_err = (_hf_logits(_hf(RAW, cfg, torch.float32)) - truth).abs().max()
    got = reference_logits(random_llama(cfg, seed=3, dtype=torch.float32), IDS, fused=False).double()
    assert (got - truth).abs().max() <= 4 * hf_err
    assert torch.equal(got.argmax(-1), truth.argmax(-1))
    # another seed is another model
    other = reference_logits(random_llama(cfg, seed=4, dtype=torch.float32), IDS, fused=False).double()
    assert (other - truth).abs().max() > 100 * hf_err


def test_a_directory_and_defaults(tmp_path):
    raw = {k: v for k, v in RAW.items() if k not in ("num_key_value_heads", "rope_theta", "max_position_embeddings")}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    hf = llama_config(tmp_path)
    assert (hf.config.num_kv_heads, hf.config.rope_theta, hf.config.max_position) == (4, 10000.0, 2048)
    # the max_position_embeddings transformers gives each model_type without the key (Mistral's was 2,048)
    # (with the KV heads: Mistral's and Qwen2's own defaults, 8 and 32, do not divide these 4 heads)
    kv = {"num_key_value_heads": RAW["num_key_value_heads"]}
    for model_type, extra in (("mistral", {"sliding_window": None, **kv}), ("qwen2", kv), ("llama", {})):
        (tmp_path / "config.json").write_text(json.dumps({**raw, "model_type": model_type, **extra}))
        reference = transformers.AutoConfig.for_model(model_type).max_position_embeddings
        assert llama_config(tmp_path).config.max_position == reference
    assert hf.config.rope_freq_divisors is None


def test_a_default_kv_heads_that_does_not_divide_the_heads_is_named_as_the_default(tmp_path):
    """review16 #11: a qwen2 config.json of 4 heads without num_key_value_heads is refused (transformers
    builds Qwen2Config's 32 KV heads) with "not a multiple of num_key_value_heads 32", a value the
    file does not hold; the message says it is the family's default."""
    raw = {k: v for k, v in RAW.items() if k != "num_key_value_heads"} | {"model_type": "qwen2"}
    assert transformers.Qwen2Config(num_attention_heads=raw["num_attention_heads"]).num_key_value_heads == 32
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(
        ValueError,
        match=r"config\.json: num_attention_heads 4 is not a multiple of num_key_value_heads 32 "
        r"\(qwen2's default: the file has no num_key_value_heads\)$",
    ):
        llama_config(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(raw | {"num_key_value_heads": 3}))
    with pytest.raises(ValueError, match=r"not a multiple of num_key_value_heads 3$"):
        llama_config(tmp_path)


LLAMA3 = LLAMA3_SCALING


@pytest.mark.parametrize(
    "changes",
    [
        {"rope_scaling": LLAMA3},  # transformers 4
        {"rope_theta": 1.0, "rope_scaling": {**LLAMA3, "rope_theta": 10000.0}},
        {"rope_theta": 1.0, "rope_parameters": {**LLAMA3, "rope_theta": 10000.0}},  # transformers 5: theta inside
    ],
    ids=["rope_scaling", "theta-inside", "rope_parameters"],
)
def test_llama3_and_linear_rope_are_read_as_divisors(tmp_path, changes):
    """Llama 3.1's rope_scaling was left out (listed as ignored): the model ran plain RoPE.
    Its divisors (models/rope.py): head dim 16 at theta 1e4 has wavelengths 6.3, 19.9, 62.8,
    199, ...: kept under 64 / 4, divided by 8 over 64, blended between. (The logits against
    transformers: tests/test_rope_scaling.py.)"""
    c = llama_config(_config(tmp_path, **changes)).config
    assert c.rope_theta == 10000.0
    assert c.rope_freq_divisors[0] == 1.0 and c.rope_freq_divisors[3:] == (8.0,) * 5
    assert all(1 < d < 8 for d in c.rope_freq_divisors[1:3])
    linear = llama_config(_config(tmp_path, rope_scaling={"type": "linear", "factor": 2.0})).config
    assert linear.rope_freq_divisors == (2.0,) * 8
    # high_freq_factor == low_freq_factor (Llama 4's): no blended band, a step (review 13 #5: refused)
    step = llama_config(_config(tmp_path, rope_scaling={**LLAMA3, "low_freq_factor": 2.0, "high_freq_factor": 2.0}))
    assert step.config.rope_freq_divisors == (1.0, 1.0) + (8.0,) * 6  # wavelengths 6.3, 19.9 under 64 / 2
    plain = llama_config(_config(tmp_path, rope_parameters={"rope_type": "default", "rope_theta": 5e5})).config
    assert (plain.rope_theta, plain.rope_freq_divisors) == (5e5, None)


@pytest.mark.parametrize(
    "changes, match",
    [
        ({"model_type": "gemma2"}, r"model_type 'gemma2' is not a Llama-family model \(llama, mistral, qwen2, qwen3\)"),
        ({"attention_bias": True}, "attention_bias True is not modelled"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not modelled"),
        ({"sliding_window": 4096}, "sliding_window 4096"),
        # transformers' MistralConfig slides 4096 positions without the key (it was read as full attention)
        ({"model_type": "mistral"}, "no sliding_window key: transformers' MistralConfig then slides a window of 4096"),
        ({"num_key_value_heads": 3}, "not a multiple of num_key_value_heads 3"),
        ({"hidden_size": 0}, "hidden_size must be a positive integer, got 0"),
        ({"num_hidden_layers": "2"}, "num_hidden_layers must be a positive integer, got '2'"),
        # one position serves no request: it reached run's advice of a larger --num-blocks
        ({"max_position_embeddings": 1}, "max_position_embeddings must be 2 or more .*, got 1"),
        # were float()'s message without the file or key, or a TypeError traceback
        ({"rope_theta": "abc"}, "rope_theta must be a number, got 'abc'"),
        ({"rope_theta": [1]}, r"rope_theta must be a number, got \[1\]"),
        ({"rms_norm_eps": None}, "rms_norm_eps must be a number, got None"),
        # json reads 1e999 / Infinity as inf: it was taken as the RoPE base
        ({"rope_theta": float("inf")}, "rope_theta must be finite and positive, got inf"),
        # an int past a double's range was an OverflowError traceback
        ({"rope_theta": 10**400}, "rope_theta must be finite and positive, got 1000"),
        ({"rms_norm_eps": -1e-5}, "rms_norm_eps must be finite and positive, got -1e-05"),
        # bool("false") is True: the string tied an untied model
        ({"tie_word_embeddings": "false"}, "tie_word_embeddings must be true or false, got 'false'"),
        # head dim hidden // heads = 0: a ZeroDivisionError traceback at the attention's scale
        ({"hidden_size": 2}, "hidden_size 2 is smaller than num_attention_heads 4, and no head_dim is given"),
        # an OverflowError traceback when run sized the model in GiB
        ({"vocab_size": 10**400}, r"vocab_size 1000.* is past any tensor's size \(2\^63\)"),
        ({"num_hidden_layers": 2**63}, r"num_hidden_layers 9223372036854775808 is past any tensor's size"),
        # a RoPE scaling models/rope.py does not compute: it was ignored, the model run with plain RoPE
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, r"rope_scaling type 'yarn' is not modelled \(only"),
        ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "rope_scaling type 'dynamic' is not modelled"),
        ({"rope_parameters": {"rope_type": "longrope"}}, "rope_parameters type 'longrope' is not modelled"),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "rope_scaling 'llama3' lacks 'low_freq_factor'"),
        ({"rope_scaling": {**LLAMA3, "factor": "8"}}, "rope_scaling.factor must be a number, got '8'"),
        (
            {"rope_scaling": {**LLAMA3, "high_freq_factor": 0.5}},
            "high_freq_factor 0.5 must be at least low_freq_factor 1.0",
        ),
        ({"rope_scaling": {"rope_type": "linear"}}, "rope_scaling 'linear' lacks 'factor'"),
        ({"rope_scaling": {"rope_type": "linear", "factor": 0}}, "rope_scaling.factor must be finite and positive"),
        ({"rope_scaling": "llama3"}, "rope_scaling must be an object or null, got 'llama3'"),
        (
            {"rope_scaling": LLAMA3, "rope_parameters": LLAMA3},
            r"both rope_scaling and rope_parameters are given; give one \(transformers 5 runs rope_scaling's",
        ),
        ({"rope_parameters": {"rope_type": "default", "rope_theta": 0}}, "rope_parameters.rope_theta must be finite"),
    ],
)
def test_a_config_the_model_cannot_compute_is_refused_naming_the_key(tmp_path, changes, match):
    with pytest.raises(ValueError, match=match):
        llama_config(_config(tmp_path, **changes))


def test_a_missing_or_broken_file_is_one_line(tmp_path):
    with pytest.raises(ValueError, match="no such config.json"):
        llama_config(tmp_path / "nope.json")
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(ValueError, match="not JSON"):
        llama_config(tmp_path / "bad.json")
    (tmp_path / "binary.json").write_bytes(b"\x00\xffGGUF")  # was the codec's message, without the file
    with pytest.raises(ValueError) as e:
        llama_config(tmp_path / "binary.json")
    assert str(e.value) == f"{tmp_path / 'binary.json'}: not JSON (not UTF-8 text: byte 0xff at 1)"


def test_model_bytes_counts_the_kept_weights_one_fp32_draw_and_the_rope_tables(tmp_path):
    """Exactly its docstring's three terms: the weights and RoPE tables the model keeps, the
    largest weight drawn in fp32 before its cast (counted for fp32 too), and the RoPE tables'
    two fp64 temporaries; the fusing's copies are not counted."""
    for tied, dtype in ((False, torch.float32), (True, torch.bfloat16), (False, torch.float64)):
        cfg = llama_config(_config(tmp_path, tie_word_embeddings=tied)).config
        model = random_llama(cfg, dtype=dtype)
        kept = model.weight_bytes() + model.cos.nbytes + model.sin_signed.nbytes
        largest = max(t.numel() for _, t in random_tensors(cfg, 0, dtype)) * 4
        assert model_bytes(cfg, dtype) == kept + largest + 2 * model.cos.numel() * 8


def test_a_config_too_large_for_the_machine_is_refused_before_allocating(tmp_path, capsys):
    from kvpool.cli.main import main

    # 100 B parameters: was the allocator's traceback (or the process killed as pages were touched)
    path = _config(tmp_path, hidden_size=16384, intermediate_size=65536, num_hidden_layers=100, vocab_size=200_000)
    assert main(["run", "--model", str(path), "--num-requests", "1"]) == 2
    err = capsys.readouterr().err.splitlines()[-1]  # after the progress line "loading the model"
    assert err.startswith(f"kvpool run: error: --model {path} with random weights needs "), err
    assert "GiB of memory available; a smaller config.json" in err
    # RoPE tables of 10^9 positions: 10^9 x 16 dims x (2 fp64 + 2 fp32) bytes = 357.6 GiB
    path = _config(tmp_path, max_position_embeddings=10**9)
    assert main(["run", "--model", str(path), "--num-requests", "1"]) == 2
    assert "with random weights needs 357.6 GiB but this machine has" in capsys.readouterr().err


def test_kvpool_run_serves_a_config_json_with_random_weights(tmp_path, capsys):
    from kvpool.cli.main import main

    path = _config(tmp_path, tie_word_embeddings=True, max_position_embeddings=2048)
    argv = ["run", "--model", str(path), "--num-requests", "2", "--turns", "1", "--num-long", "0"]
    assert main([*argv, "--request-rate", "inf", "--max-tokens", "3", "--kv-memory", "1MiB", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    # 1 MiB of blocks of 16 tokens x 2 layers x K and V x 2 KV heads x 16 dims x 4 bytes
    assert report["num_blocks"] == (1 << 20) // (16 * 2 * 2 * 2 * 16 * 4) == 128
    assert (report["model"], report["num_finished"], report["num_generated_tokens"]) == (tmp_path.name, 2, 6)
    assert report["load_source"] == "random weights (--seed 0)"  # (was "built in")
    assert main([*argv, "--tp", "2"]) == 2  # (the flag was ignored: one process ran the whole model)
    assert "a config.json's random model runs on one process (no --tensor-parallel-size 2)" in capsys.readouterr().err
    assert main(["run", "--model", str(path), "--host-cache-gib", "1"]) == 2
    assert "random weights serve no tiers" in capsys.readouterr().err
