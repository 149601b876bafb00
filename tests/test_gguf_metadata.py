"""A GGUF whose metadata the model cannot compute with, or whose tensors disagree with it, is
refused at load with one line naming the key or the tensor (models/gguf.py read_config,
check_shapes): a head count of 0 raised ZeroDivisionError, a NaN epsilon or a RoPE base of 0
generated garbage without a word, a wrong tensor shape failed in numpy's words."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from kvpool.cli.main import main
from kvpool.models.gguf import load_gguf

TOKENS = [f"t{i}" for i in range(32)]


def add_architecture(
    w, layers: int, ctx: int, hidden: int, ff: int, heads: int, kvh: int, theta: float, eps: float
) -> None:
    """The architecture's metadata of a Llama-family GGUF (keys under GGUFWriter `w`'s arch)."""
    w.add_block_count(layers)
    w.add_context_length(ctx)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(ff)
    w.add_head_count(heads)
    w.add_head_count_kv(kvh)
    w.add_rope_freq_base(theta)
    w.add_layer_norm_rms_eps(eps)


def write_gguf(path, **over) -> str:
    """A 2-layer Llama GGUF (hidden 16, 4 heads, 2 KV heads, vocab 32); `over` replaces
    metadata (heads, kvh, hidden, key_length, ctx, theta, eps, vocab; tokenizer_model, template,
    merges, token_types, scores, bos / eos: the tokenizer's; raw_kv {key: value} any key) or a tensor's dims (q_rows,
    embed_rows, tokens); `skip` leaves tensors out; `extra` {name: array} adds tensors;
    `poison` {tensor: [(index, value), ...]} writes values into a tensor (numpy shape:
    [out, in]); `dtype` the tensors'."""
    o = {"layers": 2, "hidden": 16, "ff": 24, "heads": 4, "kvh": 2, "ctx": 64, "theta": 1e4, "eps": 1e-5, **over}
    head_dim = o.get("key_length") or 4
    tokens = o.get("tokens", TOKENS)
    w = gguf.GGUFWriter(str(path), "llama")
    add_architecture(w, o["layers"], o["ctx"], o["hidden"], o["ff"], o["heads"], o["kvh"], o["theta"], o["eps"])
    if "key_length" in o:
        w.add_key_length(o["key_length"])
    if "vocab" in o:
        w.add_vocab_size(o["vocab"])
    w.add_tokenizer_model(o.get("tokenizer_model", "gpt2"))
    w.add_token_list(tokens)
    if "scores" in o:
        w.add_token_scores(o["scores"])
    if "bos" in o:
        w.add_bos_token_id(o["bos"])
    if "eos" in o:
        w.add_eos_token_id(o["eos"])
    if "template" in o:
        w.add_chat_template(o["template"])
    if "merges" in o:
        w.add_token_merges(o["merges"])
    if "token_types" in o:
        w.add_token_types(o["token_types"])
    for key, value in o.get("raw_kv", {}).items():  # a key written with a value of any type
        {str: w.add_string, float: w.add_float32, int: w.add_uint32, bool: w.add_bool}[type(value)](key, value)
    hidden, q, kv, ff = o["hidden"], 4 * head_dim, 2 * head_dim, o["ff"]
    shapes = {"token_embd.weight": (o.get("embed_rows", len(tokens)), hidden), "output_norm.weight": (hidden,)}
    for i in range(o["layers"]):
        shapes |= {
            f"blk.{i}.attn_q.weight": (o.get("q_rows", q), hidden),
            f"blk.{i}.attn_k.weight": (kv, hidden),
            f"blk.{i}.attn_v.weight": (kv, hidden),
            f"blk.{i}.attn_output.weight": (hidden, q),
            f"blk.{i}.ffn_gate.weight": (ff, hidden),
            f"blk.{i}.ffn_up.weight": (ff, hidden),
            f"blk.{i}.ffn_down.weight": (hidden, ff),
            f"blk.{i}.attn_norm.weight": (hidden,),
            f"blk.{i}.ffn_norm.weight": (hidden,),
        }
    for name, shape in shapes.items():
        if name not in o.get("skip", ()):
            data = np.full(shape, 0.01, dtype=o.get("dtype", np.float32))
            for index, value in o.get("poison", {}).get(name, ()):
                data[index] = value
            w.add_tensor(name, data)
    for name, data in o.get("extra", {}).items():  # a tensor the model does not use
        w.add_tensor(name, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def test_a_well_formed_tiny_gguf_loads_with_its_metadata(tmp_path):
    loaded = load_gguf(write_gguf(tmp_path / "ok.gguf"))
    c = loaded.meta.config
    assert (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.vocab_size) == (2, 16, 4, 2, 4, 32)
    assert sum(1 for _ in loaded.tensors()) == 2 + 2 * 9


@pytest.mark.parametrize(
    ("over", "message"),
    [
        ({"heads": 0}, "llama.attention.head_count must be a positive integer, got 0"),
        ({"kvh": 0}, "llama.attention.head_count_kv must be a positive integer, got 0"),
        ({"kvh": 3}, "llama.attention.head_count 4 is not a multiple of llama.attention.head_count_kv 3"),
        ({"layers": 0}, "llama.block_count must be a positive integer, got 0"),
        ({"ctx": 0}, "llama.context_length must be a positive integer, got 0"),
        ({"hidden": 18}, "llama.embedding_length 18 is not a multiple of llama.attention.head_count 4"),
        ({"key_length": 3}, "head dim 3 must be even (rotate-half RoPE)"),
        ({"eps": float("nan")}, "llama.attention.layer_norm_rms_epsilon must be finite and positive, got nan"),
        ({"eps": 0.0}, "llama.attention.layer_norm_rms_epsilon must be finite and positive, got 0.0"),
        ({"theta": 0.0}, "llama.rope.freq_base must be finite and positive, got 0.0"),
        ({"theta": float("inf")}, "llama.rope.freq_base must be finite and positive, got inf"),
        (
            {"q_rows": 12},
            "tensor 'blk.0.attn_q.weight' has dims [16, 12], but the metadata's architecture needs [16, 16]",
        ),
        ({"vocab": 40}, "tensor 'token_embd.weight' has dims [16, 32], but the metadata's architecture needs [16, 40]"),
        (
            {"embed_rows": 8},
            "tensor 'token_embd.weight' has dims [16, 8], but the metadata's architecture needs [16, 32]",
        ),
        ({"vocab": 8, "embed_rows": 8}, "the tokenizer has 32 tokens, more than the model's vocabulary of 8"),
        # (it loaded, and the first chat was jinja2's TypeError traceback: "Can't compile non template nodes")
        # (it read "value_length '4' is not the head dim 4")
        ({"raw_kv": {"llama.attention.value_length": "4"}}, "value_length must be a positive integer, got '4'"),
        ({"raw_kv": {"tokenizer.chat_template": 5}}, "tokenizer.chat_template must be a string (jinja), got 5"),
    ],
)
def test_metadata_the_model_cannot_compute_with_is_named(tmp_path, over, message):
    path = write_gguf(tmp_path / "bad.gguf", **over)
    with pytest.raises(ValueError) as e:
        load_gguf(path)
    assert str(e.value).startswith(f"GGUF file {path}: ") and message in str(e.value), str(e.value)


def test_a_missing_layer_tensor_is_named_with_the_file(tmp_path):
    """It was "lacks tensors ['layers.1.q']" once the weights were read, without the file."""
    path = write_gguf(tmp_path / "noq.gguf", skip=("blk.1.attn_q.weight",))
    with pytest.raises(ValueError) as e:
        load_gguf(path)
    assert str(e.value) == f"GGUF file {path}: lacks tensors ['blk.1.attn_q.weight']"
    path = write_gguf(tmp_path / "nolayers.gguf", skip=tuple(f"blk.{i}.ffn_up.weight" for i in range(2)))
    with pytest.raises(ValueError, match=r"lacks tensors \['blk.0.ffn_up.weight', 'blk.1.ffn_up.weight'\]$"):
        load_gguf(path)


def test_the_cli_names_a_zero_head_count_without_a_traceback(tmp_path, capsys):
    path = write_gguf(tmp_path / "heads0.gguf", heads=0)
    assert main(["generate", "hi", "--model", path]) == 2
    err = capsys.readouterr().err
    assert err == (
        f"kvpool generate: error: GGUF file {path}: GGUF metadata llama.attention.head_count "
        "must be a positive integer, got 0\n"
    )


@pytest.mark.parametrize(
    ("over", "message"),
    [
        (
            {"raw_kv": {"llama.rope.scaling.type": "yarn"}},
            "unsupported RoPE scaling llama.rope.scaling.type 'yarn'; kvpool runs plain, linear and Llama 3 "
            "(rope_freqs.weight) RoPE",
        ),
        (
            {"raw_kv": {"llama.rope.scaling.type": "longrope"}},
            "unsupported RoPE scaling llama.rope.scaling.type 'longrope'; kvpool runs plain, linear and Llama 3 "
            "(rope_freqs.weight) RoPE",
        ),
        (  # Llama 3.1's factors are F32 [head_dim / 2] (llama.cpp asserts F32): another tensor is not them
            {"extra": {"rope_freqs.weight": np.ones(2, dtype=np.float16)}},
            "tensor 'rope_freqs.weight' is F16 [2]; Llama 3 RoPE factors are F32 [2] (one a rotated pair of the "
            "head dim 4)",
        ),
    ],
)
def test_a_scaled_rope_is_refused_not_run_as_plain_rope(tmp_path, over, message):
    """A scaled RoPE kvpool does not compute (YaRN, LongRoPE; Llama 3.1's rope_freqs.weight
    and a linear rope.scaling.factor it does: tests/test_rope_scaling.py) was left out without
    a word: the model ran with plain RoPE, every position's attention not the model's."""
    path = write_gguf(tmp_path / "scaled.gguf", **over)
    with pytest.raises(ValueError) as e:
        load_gguf(path)
    assert str(e.value) == f"GGUF file {path}: {message}"
    assert load_gguf(write_gguf(tmp_path / "plain.gguf", raw_kv={"llama.rope.scaling.type": "none"})).meta


@pytest.mark.parametrize(
    ("raw_kv", "adds_bos"),
    [
        ({"tokenizer.ggml.pre": "llama-bpe"}, True),  # a Llama 3 GGUF without the key: BOS, as llama.cpp
        ({"tokenizer.ggml.pre": "llama-bpe", "tokenizer.ggml.add_bos_token": False}, False),  # the key decides
        ({"tokenizer.ggml.pre": "qwen2"}, False),
        ({}, False),
        ({"tokenizer.ggml.add_bos_token": True}, True),
    ],
)
def test_add_bos_is_the_key_or_else_the_pre_tokenizers_default(tmp_path, raw_kv, adds_bos):
    assert load_gguf(write_gguf(tmp_path / "t.gguf", raw_kv=raw_kv)).meta.tokenizer.add_bos_token is adds_bos


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_a_non_finite_weight_is_named_with_the_file_and_tensor_when_read(tmp_path, dtype):
    """A NaN weight loaded, every logit came out NaN, and `kvpool generate` printed nothing
    (SmolLM2 sampled token 0, its end of text). Now reading the tensor names the file, the
    tensor, the first such element and how many more there are; an infinity too."""
    nan, inf = float("nan"), float("inf")
    poison = {"blk.1.ffn_down.weight": [((2, 3), nan), ((5, 0), inf)]}
    path = write_gguf(tmp_path / "nan.gguf", poison=poison, dtype=dtype)
    loaded = load_gguf(path)  # (the metadata is sound: the weights are checked as they are read)
    with pytest.raises(ValueError) as e:
        for _ in loaded.tensors():
            pass
    assert str(e.value) == (
        f"GGUF file {path}: tensor 'blk.1.ffn_down.weight' holds nan at [2, 3] (and 1 more non-finite values): "
        "the model cannot compute with it (every logit would be NaN)"
    )
    path = write_gguf(tmp_path / "inf.gguf", poison={"output_norm.weight": [(7, -inf)]}, dtype=dtype)
    with pytest.raises(ValueError, match=r"tensor 'output_norm.weight' holds -inf at \[7\]: "):
        for _ in load_gguf(path).tensors():
            pass


def test_a_weight_past_float16s_range_is_refused_as_fp16_and_loads_as_fp32(tmp_path):
    """1e5 is finite in the file's fp32 but rounds to inf in float16 (largest 65504): a
    --dtype fp16 load names it; fp32 and bf16 hold it."""
    path = write_gguf(tmp_path / "big.gguf", poison={"blk.0.ffn_up.weight": [(4, 1e5)]})
    with pytest.raises(ValueError) as e:
        for _ in load_gguf(path, torch.float16).tensors(torch.float16):
            pass
    assert str(e.value) == (
        f"GGUF file {path}: tensor 'blk.0.ffn_up.weight' holds 100000 at [4, 0] (as layers.0.up), past "
        "float16's largest value 65504: it would load as inf; load it as fp32 or bf16 (--dtype)"
    )
    for dtype in (torch.float32, torch.bfloat16):
        weights = dict(load_gguf(path, dtype).tensors(dtype))
        assert float(weights["layers.0.up"][4, 0]) == pytest.approx(1e5, rel=1e-2)


def test_a_weight_past_bfloat16s_range_is_refused_as_bf16_naming_it_in_the_models_layout(tmp_path):
    """bf16 loads were unchecked: 3.4e38 is finite in the file's fp32 and rounds to inf in
    bfloat16 (largest 3.38953e38), and the forward to NaN. Named as the fp16 load names
    its overflow, at its place in the model's layout (a Q row moves: the GGUF's rows are
    permuted for RoPE); fp32 holds it."""
    path = write_gguf(tmp_path / "huge.gguf", poison={"blk.1.attn_q.weight": [((1, 2), -3.4e38)]})
    with pytest.raises(ValueError) as e:
        for _ in load_gguf(path, torch.bfloat16).tensors(torch.bfloat16):
            pass
    assert str(e.value) == (
        f"GGUF file {path}: tensor 'blk.1.attn_q.weight' holds -3.4e+38 at [2, 2] (as layers.1.q), past "
        "bfloat16's largest value 3.38953e+38: it would load as inf; load it as fp32 (--dtype)"
    )
    with pytest.raises(ValueError, match=r"holds -3.4e\+38 at \[2, 2\] \(as layers.1.q\), past float16's largest"):
        for _ in load_gguf(path, torch.float16).tensors(torch.float16):
            pass
    weights = dict(load_gguf(path).tensors())
    assert float(weights["layers.1.q"][2, 2]) == np.float32(-3.4e38)


@pytest.mark.parametrize(
    "dtype, held, refused",
    [(torch.float16, 65519.0, 65520.0), (torch.bfloat16, 3.39617e38, 3.39618e38)],
    ids=["fp16", "bf16"],
)
def test_the_overflow_check_refuses_exactly_what_the_cast_makes_inf(tmp_path, dtype, held, refused):
    """The check reads a tensor's least and largest values (no mask the tensor's size) and
    casts those: its verdict is the cast's, at the rounding boundary (halfway past the
    dtype's largest value) either sign: a value below it loads as the largest, one at it is
    refused."""
    for sign in (1.0, -1.0):
        for value, bad in ((held, False), (refused, True)):
            assert bool(torch.isinf(torch.tensor(sign * value).to(dtype))) is bad  # (the cast's verdict)
            path = write_gguf(
                tmp_path / f"edge{sign}{value}.gguf", poison={"blk.0.ffn_gate.weight": [((5, 7), sign * value)]}
            )
            if bad:
                with pytest.raises(
                    ValueError, match=r"'blk.0.ffn_gate.weight' holds .* at \[5, 7\] \(as layers.0.gate\)"
                ):
                    for _ in load_gguf(path, dtype).tensors(dtype):
                        pass
            else:
                weights = dict(load_gguf(path, dtype).tensors(dtype))
                assert float(weights["layers.0.gate"][5, 7]) == sign * torch.finfo(dtype).max


def test_generate_names_a_nan_weight_without_a_traceback(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("KVPOOL_CACHE_DIR", str(tmp_path / "cache"))
    path = write_gguf(tmp_path / "nan.gguf", poison={"blk.0.attn_v.weight": [((1, 2), float("nan"))]})
    assert main(["generate", "hi", "--model", path]) == 2
    err = capsys.readouterr().err
    assert err == (
        f"kvpool generate: error: GGUF file {path}: tensor 'blk.0.attn_v.weight' holds nan at [1, 2]: "
        "the model cannot compute with it (every logit would be NaN)\n"
    )
