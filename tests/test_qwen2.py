"""Qwen2-architecture GGUFs (general.architecture "qwen2": Llama with Q / K / V biases,
RoPE base 1e6, tied or untied embeddings) against transformers' Qwen2ForCausalLM on the
same random weights, as tests/test_rope_scaling.py holds Llama 3.1: in fp64 transformers'
own RoPE frequencies run in fp64 and its norms without their fp32 casts (TOL64 = 1e-10 of
the largest logit; measured below 1e-14), in fp32 within C_FP32 times transformers' own fp32
error on the same tokens. llama.cpp writes a Qwen2 GGUF's Q / K rows as they are (its Qwen2
runs rotate-half RoPE): the writer here does too, and the loader leaves them."""

from __future__ import annotations

import re

import gguf
import numpy as np
import pytest
import torch

from kvpool.attention.reference import reference_logits
from kvpool.cache import CacheDescriptor
from kvpool.engine.build import build_engine, load_model
from kvpool.models.gguf import load_gguf
from kvpool.models.llama import LlamaModel
from random_llama import TINY_HF_LLAMA
from test_gguf_metadata import add_architecture
from test_rope_scaling import _engine_rows, _Fp64Torch, _norm_in_input_dtype, _rotary_fp64

transformers = pytest.importorskip("transformers")
from transformers.models.qwen2 import modeling_qwen2  # noqa: E402
from transformers.models.qwen3 import modeling_qwen3  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

TOL64 = 1e-10
C_FP32 = 3.0  # as tests/test_model.py's
# the tiny Llama's sizes, with Qwen2's norm epsilon and RoPE base
HF = {k: v for k, v in TINY_HF_LLAMA.items() if k not in ("model_type", "tie_word_embeddings")}
HF.update(rms_norm_eps=1e-6, rope_theta=1e6, use_sliding_window=False)
# Qwen3 (tests/test_hf_qwen3.py): the same sizes with a head dim that is not hidden / heads (16)
HF3 = {**HF, "head_dim": 24}
# family -> (its sizes, transformers' modeling module, its config and model classes)
FAMILIES = {
    "qwen2": (HF, modeling_qwen2, transformers.Qwen2Config, modeling_qwen2.Qwen2ForCausalLM),
    "qwen3": (HF3, modeling_qwen3, transformers.Qwen3Config, modeling_qwen3.Qwen3ForCausalLM),
}
IDS = torch.randint(0, 300, (120,), generator=torch.Generator().manual_seed(2)).tolist()


def hf_weights(tied: bool, seed: int = 7, family: str = "qwen2") -> dict[str, torch.Tensor]:
    """Random Qwen2 weights in transformers' names, fp64 (the biases O(1): they matter); of
    family "qwen3" no biases, and q / k norm weights 1 + N(0, 0.3^2) in their place."""
    g = torch.Generator().manual_seed(seed)
    cfg = FAMILIES[family][0]
    h, i = cfg["hidden_size"], cfg["intermediate_size"]
    d = cfg.get("head_dim", h // cfg["num_attention_heads"])
    kv = cfg["num_key_value_heads"] * d

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return torch.randn(*shape, generator=g, dtype=torch.float64) * scale

    w = {"model.embed_tokens.weight": randn(HF["vocab_size"], h), "model.norm.weight": 1 + 0.1 * randn(h)}
    if not tied:
        w["lm_head.weight"] = randn(HF["vocab_size"], h, scale=h**-0.5)
    for n in range(HF["num_hidden_layers"]):
        p = f"model.layers.{n}."
        shapes = {"q": (4 * d, h), "k": (kv, h), "v": (kv, h)}
        for x, shape in shapes.items():
            w[p + f"self_attn.{x}_proj.weight"] = randn(*shape, scale=h**-0.5)
            if family == "qwen2":
                w[p + f"self_attn.{x}_proj.bias"] = randn(shape[0])
            elif x != "v":
                w[p + f"self_attn.{x}_norm.weight"] = 1 + 0.3 * randn(d)
        w[p + "self_attn.o_proj.weight"] = randn(h, 4 * d, scale=(4 * d) ** -0.5)
        w[p + "mlp.gate_proj.weight"] = randn(i, h, scale=h**-0.5)
        w[p + "mlp.up_proj.weight"] = randn(i, h, scale=h**-0.5)
        w[p + "mlp.down_proj.weight"] = randn(h, i, scale=i**-0.5)
        w[p + "input_layernorm.weight"] = 1 + 0.1 * randn(h)
        w[p + "post_attention_layernorm.weight"] = 1 + 0.1 * randn(h)
    return w


_GGUF_NAMES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
}


def write_gguf(
    path,
    weights: dict[str, torch.Tensor],
    skip: tuple[str, ...] = (),
    extra: dict | None = None,
    family: str = "qwen2",
) -> str:
    """A `family` GGUF of `weights` in F32 (llama.cpp's names; Q / K rows as they are); a
    qwen3's head dim in attention.key_length / value_length, as llama.cpp's converter writes it."""
    sizes = FAMILIES[family][0]
    w = gguf.GGUFWriter(str(path), family)
    if "head_dim" in sizes:
        w.add_key_length(sizes["head_dim"])
        w.add_value_length(sizes["head_dim"])
    keys = ("num_hidden_layers", "max_position_embeddings", "hidden_size", "intermediate_size")
    keys += ("num_attention_heads", "num_key_value_heads", "rope_theta", "rms_norm_eps")
    add_architecture(w, *(sizes[k] for k in keys))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list([f"t{i}" for i in range(sizes["vocab_size"])])
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
    top["lm_head.weight"] = "output.weight"
    tensors = {}
    for name, t in weights.items():
        if name in top:
            tensors[top[name]] = t
            continue
        _, _, n, *rest = name.split(".")
        module, kind = ".".join(rest[:-1]), rest[-1]
        tensors[f"blk.{n}.{_GGUF_NAMES[module]}.{kind}"] = t
    for name, t in {**tensors, **(extra or {})}.items():
        if name not in skip:
            w.add_tensor(name, np.ascontiguousarray(t.numpy().astype(np.float32)))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def hf_model(weights: dict[str, torch.Tensor], tied: bool, dtype: torch.dtype, family: str = "qwen2"):
    """transformers' Qwen2 (Qwen3 of family "qwen3") holding `weights` (rounded to fp32
    first: the GGUF's F32) in `dtype`; fp64: its RoPE frequencies made in fp64 by its own function."""
    sizes, modeling, config_class, model_class = FAMILIES[family]
    with pytest.MonkeyPatch.context() as patch:
        if dtype == torch.float64:
            patch.setattr(modeling, "torch", _Fp64Torch())
        model = model_class(config_class(**sizes, tie_word_embeddings=tied))
    model = model.to(dtype).eval()
    if dtype == torch.float64:
        assert model.model.rotary_emb.inv_freq.dtype == torch.float64
    state = {k: v.float().to(dtype) for k, v in weights.items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and missing == (["lm_head.weight"] if tied else [])
    return model


def hf_logits(model, ids: list[int]) -> torch.Tensor:
    """`model`'s logits of `ids`; fp64: its RoPE angles in fp64, its norms (a Qwen3's q / k
    norms too: the same class) without their fp32 casts."""
    with pytest.MonkeyPatch.context() as patch, torch.no_grad():
        if next(model.parameters()).dtype == torch.float64:
            patch.setattr(type(model.model.rotary_emb), "forward", _rotary_fp64)
            patch.setattr(type(model.model.norm), "forward", _norm_in_input_dtype)
        return model(torch.tensor([ids])).logits[0].double()


def write_gguf_llama_with_bias(path) -> str:
    from test_gguf_metadata import write_gguf as write_llama

    return write_llama(path, extra={"blk.0.attn_q.bias": np.zeros(16, dtype=np.float32)})


def model64(path: str) -> LlamaModel:
    f = load_gguf(path)
    return LlamaModel.from_tensors(f.meta.config, f.tensors(torch.float32)).astype(torch.float64)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_fp64_logits_equal_transformers_qwen2(tmp_path, tied):
    weights = hf_weights(tied)
    path = write_gguf(tmp_path / "qwen2.gguf", weights)
    cfg = load_gguf(path).meta.config
    assert (cfg.qkv_bias, cfg.tie_embeddings, cfg.rope_theta, cfg.head_dim) == (True, tied, 1e6, 16)
    want = hf_logits(hf_model(weights, tied, torch.float64), IDS)
    got = reference_logits(model64(path), IDS, fused=False).double()
    assert want.abs().max() > 1.0
    assert (got - want).abs().max() <= TOL64 * want.abs().max()
    # the biases are no detail: without them the logits are far off
    nobias = model64(path)
    for layer in nobias.layers:
        layer["bqkv"].zero_()
    assert (reference_logits(nobias, IDS, fused=False).double() - want).abs().max() > 1e-3 * want.abs().max()


def test_the_engine_in_fp64_and_fp32_with_the_c_kernels_equals_transformers_qwen2(tmp_path, monkeypatch, kernels):
    """The paged engine (a prefix hit on the second prompt) in fp64, and in fp32 with the C
    kernels, loaded the second time from the weight cache."""
    weights = hf_weights(False)
    path = write_gguf(tmp_path / "qwen2.gguf", weights)
    prompts = [IDS[:70], IDS[:70] + IDS[70:100]]
    hf64, hf32 = hf_model(weights, False, torch.float64), hf_model(weights, False, torch.float32)
    descriptor = CacheDescriptor("qwen2", weights_version="x")
    engine = build_engine(model64(path), descriptor=descriptor, num_blocks=32, block_size=16, record_logits=True)
    runs = _engine_rows(engine, prompts, new_tokens=8)
    assert runs[1][2] >= 64  # the first prompt's full blocks from the cache
    for (sequence, rows, _), prompt in zip(runs, prompts, strict=True):
        want = hf_logits(hf64, sequence[:-1])[len(prompt) - 1 :]
        assert (rows - want).abs().max() <= TOL64 * want.abs().max()
    monkeypatch.setenv("KVPOOL_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("KVPOOL_WEIGHT_CACHE", raising=False)
    load_model(path, device="cpu")
    loaded = load_model(path, device="cpu")
    assert loaded.load_source == "weight cache" and loaded.model.config.qkv_bias and loaded.model.kernels is not None
    engine = build_engine(loaded, num_blocks=32, block_size=16, max_num_batched_tokens=64, record_logits=True)
    runs = _engine_rows(engine, prompts, new_tokens=8)
    assert runs[1][2] >= 64
    for (sequence, rows, _), prompt in zip(runs, prompts, strict=True):
        exact = hf_logits(hf64, sequence[:-1])
        hf_err = (hf_logits(hf32, sequence[:-1]) - exact).abs().max().item()
        err = (rows - exact[len(prompt) - 1 :]).abs().max().item()
        assert 0 < hf_err < 1e-3 * exact.abs().max()
        assert err <= C_FP32 * hf_err, f"{err} off fp64, transformers' fp32 {hf_err}"


def test_what_a_qwen2_gguf_lacks_or_adds_is_refused_naming_the_tensor(tmp_path):
    weights = hf_weights(True)
    lacking = write_gguf(tmp_path / "nobias.gguf", weights, skip=("blk.1.attn_k.bias",))
    with pytest.raises(ValueError, match=re.escape("lacks tensors ['blk.1.attn_k.bias']")):
        load_gguf(lacking)
    extra = {"blk.0.attn_output.bias": torch.zeros(64, dtype=torch.float64)}
    with pytest.raises(
        ValueError,
        match=re.escape("'blk.0.attn_output.bias' is a bias kvpool's model does not add (Q / K / V biases only)"),
    ):
        load_gguf(write_gguf(tmp_path / "obias.gguf", weights, extra=extra))
    # a "llama" GGUF's Q bias: refused (it failed as a shape mismatch of its weight's dims)
    llama_bias = write_gguf_llama_with_bias(tmp_path / "llama_bias.gguf")
    # (review 13 #11: it read "(Q / K / V biases only)", of a Q bias)
    qwen2_only = "does not add (none on a llama or qwen3 GGUF's attention; Q / K / V of qwen2 GGUFs)"
    with pytest.raises(
        ValueError, match=re.escape(f"tensor 'blk.0.attn_q.bias' is a bias kvpool's model {qwen2_only}")
    ):
        load_gguf(llama_bias)
