"""Hostile inputs to the model layer (models/gguf.py, tokenizer.py, hf_config.py): each is one
line naming the problem, with no traceback, no allocation sized by a corrupt count, no hang,
and never weights read from the wrong bytes. The GGUFs are the well-formed tiny Llama of
test_gguf_metadata with bytes overwritten at offsets read from its own layout."""

from __future__ import annotations

import struct

import gguf
import pytest

from kvpool.cli.main import main
from kvpool.models.gguf import load_gguf
from test_gguf_metadata import write_gguf


def layout(path: str) -> dict[str, int]:
    """Byte offsets in a well-formed GGUF: the tokens array's item type and length, the first
    tensor's dims count and its offset field, the data section."""
    r = gguf.GGUFReader(path)
    tokens = r.fields["tokenizer.ggml.tokens"]
    key_len = int(tokens.parts[0][0])
    t = r.tensors[0].field
    name_len, num_dims = int(t.parts[0][0]), int(t.parts[2][0])
    return {
        "tokens_item_type": tokens.offset + 8 + key_len + 4,
        "tensor0_dims_count": t.offset + 8 + name_len,
        "tensor0_offset": t.offset + 8 + name_len + 4 + 8 * num_dims + 4,
        "data": r.data_offset,
    }


def patched(tmp_path, name: str, at: int, fmt: str, *values: int) -> str:
    path = write_gguf(tmp_path / "ok.gguf")
    data = bytearray(open(path, "rb").read())
    struct.pack_into(fmt, data, at, *values)
    out = tmp_path / name
    out.write_bytes(bytes(data))
    return str(out)


def refused(path: str) -> str:
    with pytest.raises(ValueError) as e:
        for _ in load_gguf(path).tensors():
            pass
    assert "\n" not in str(e.value)
    return str(e.value)


@pytest.mark.parametrize("length", [10**6, 2**63])
def test_an_array_claiming_more_items_than_the_file_holds_is_refused_before_it_is_read(tmp_path, length):
    """The tokens array retyped as uint8 with 2^63 items: the reader's loop read empty items
    past the end of the file forever, its list growing until memory ran out (MemoryError
    under a 3 GiB limit); 10^6 items read 10^6 empty ones first."""
    at = layout(write_gguf(tmp_path / "ok.gguf"))["tokens_item_type"]
    path = patched(tmp_path, "array.gguf", at, "<IQ", 0, length)
    size = len(open(path, "rb").read())
    assert refused(path) == (
        f"GGUF file {path} is corrupt or truncated: the array at offset {at} claims {length} items, "
        f"more than the file's {size} bytes hold"
    )


def test_a_tensor_offset_that_wraps_past_2_to_the_64_is_refused_not_read_from_the_wrong_bytes(tmp_path):
    """The reader adds the data section's start to a tensor's offset in uint64: 2^64 - 1
    wrapped to the byte before the data, and the model loaded with every embedding weight
    read one byte off, without a word."""
    at = layout(write_gguf(tmp_path / "ok.gguf"))["tensor0_offset"]
    path = patched(tmp_path, "wrap.gguf", at, "<Q", 2**64 - 1)
    message = refused(path)
    assert f"tensor 'token_embd.weight': 2048 bytes at offset {2**64 - 1} of the data section run past" in message


@pytest.mark.parametrize(
    ("what", "fmt", "value", "message"),
    [
        ("tensor_count", "<Q", 2**63, "its header claims 9223372036854775808 tensors and 11 metadata keys"),
        ("kv_count", "<Q", 10**6, "its header claims 20 tensors and 1000000 metadata keys"),
        # (4294967295 dims of 8 bytes)
        ("tensor0_dims_count", "<I", 2**32 - 1, "34359738360 bytes at offset"),
        (
            "tensor0_offset",
            "<Q",
            2**40,
            "tensor 'token_embd.weight': 2048 bytes at offset 1099511627776 of the data section run past the end",
        ),
    ],
)
def test_absurd_counts_and_offsets_are_named(tmp_path, what, fmt, value, message):
    path = write_gguf(tmp_path / "ok.gguf")
    at = {"tensor_count": 8, "kv_count": 16, **layout(path)}[what]
    assert message in refused(patched(tmp_path, f"{what}.gguf", at, fmt, value))


def test_a_gguf_cut_short_anywhere_is_named_as_truncated(tmp_path):
    """Every cut of the header, the metadata, the tensor descriptions and the data: the
    message said numpy's "When changing to a larger dtype, its size must be a divisor" or
    "index 0 is out of bounds" for most of them."""
    data = open(write_gguf(tmp_path / "ok.gguf"), "rb").read()
    for cut in [5, 23, 24, 100, 471, 822, 830, 2015, 2021, len(data) - 1]:
        path = tmp_path / f"cut{cut}.gguf"
        path.write_bytes(data[:cut])
        message = refused(str(path))
        assert message.startswith(f"GGUF file {path} is ") and "truncated" in message, message
        assert "divisor" not in message and "out of bounds" not in message, message


def test_the_cli_names_a_truncated_gguf_in_one_line(tmp_path, capsys):
    data = open(write_gguf(tmp_path / "ok.gguf"), "rb").read()
    path = tmp_path / "cut.gguf"
    path.write_bytes(data[:900])
    assert main(["generate", "hi", "--model", str(path)]) == 2
    err = capsys.readouterr().err
    assert (
        err.startswith(f"kvpool generate: error: GGUF file {path} is corrupt or truncated: ") and err.count("\n") == 1
    )


@pytest.mark.parametrize(
    ("template", "message"),
    [
        ("{% for %}", "the GGUF's chat template is not valid jinja (line 1): Expected an expression"),
        ("{{ raise_exception('Conversation roles must alternate') }}", "refused the messages: Conversation roles must"),
        # an attribute of an unset name (an unset name alone prints '', as transformers renders it)
        ("{{ messages[0].nope.deeper }}", "the chat template refused the messages: "),
    ],
)
def test_a_chat_template_that_fails_is_one_line_from_the_cli(tmp_path, capsys, monkeypatch, template, message):
    """A template that is not jinja, or one that refuses the messages through HF's
    raise_exception (undefined here: "'raise_exception' is undefined") or an undefined
    name, was a jinja2 traceback from `kvpool generate`."""
    monkeypatch.setenv("KVPOOL_CACHE_DIR", str(tmp_path / "cache"))
    path = write_gguf(tmp_path / "t.gguf", template=template)
    assert main(["generate", "hi", "--model", path]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvpool generate: error: ") and message in err and err.count("\n") == 1, err


@pytest.mark.parametrize(
    ("over", "message"),
    [
        ({"token_types": [1, 1, 3]}, "tokenizer.ggml.token_type has 3 entries for 32 tokens"),
        ({"merges": ["t1 t2", "t3t4"]}, "tokenizer.ggml.merges[1] 't3t4' is not two tokens joined by a space"),
        ({"merges": [" t2"]}, "tokenizer.ggml.merges[0] ' t2' is not two tokens joined by a space"),
        # bool("false") is True: the string added a BOS token to every prompt
        (
            {"raw_kv": {"tokenizer.ggml.add_bos_token": "false"}},
            "tokenizer.ggml.add_bos_token must be true or false, got 'false'",
        ),
        (
            {"raw_kv": {"tokenizer.ggml.add_eos_token": "yes"}},
            "tokenizer.ggml.add_eos_token must be true or false, got 'yes'",
        ),
        ({"raw_kv": {"tokenizer.ggml.add_eos_token": 1}}, "tokenizer.ggml.add_eos_token must be true or false, got 1"),
        # int() read 1.5 as 1, and "two" in its own words, without the key
        ({"raw_kv": {"tokenizer.ggml.bos_token_id": 1.5}}, "tokenizer.ggml.bos_token_id must be a token id (an"),
        ({"raw_kv": {"tokenizer.ggml.eos_token_id": "two"}}, "tokenizer.ggml.eos_token_id must be a token id (an"),
        # an id past the vocabulary was accepted: encode put the BOS id in front of every prompt
        (
            {"raw_kv": {"tokenizer.ggml.bos_token_id": 32}},
            "tokenizer.ggml.bos_token_id is 32, not a token of the vocabulary of 32 tokens",
        ),
        (
            {"raw_kv": {"tokenizer.ggml.eos_token_id": 1000}},
            "tokenizer.ggml.eos_token_id is 1000, not a token of the vocabulary of 32 tokens",
        ),
    ],
)
def test_tokenizer_metadata_of_the_wrong_shape_is_named_with_the_file(tmp_path, over, message):
    """A short token_type array was "zip() argument 2 is shorter than argument 1" (no key,
    no file); a merge without its space a TypeError traceback from the tokenizers library."""
    path = write_gguf(tmp_path / "tok.gguf", **over)
    with pytest.raises(ValueError) as e:
        load_gguf(path)
    assert str(e.value).startswith(f"GGUF file {path}: GGUF metadata {message}")


def test_a_bos_past_the_vocabulary_is_one_line_from_the_cli(tmp_path, capsys, monkeypatch):
    """The last token (31 of 32) is a BOS; one past it is refused with the key and the size."""
    monkeypatch.setenv("KVPOOL_CACHE_DIR", str(tmp_path / "cache"))
    load_gguf(write_gguf(tmp_path / "last.gguf", raw_kv={"tokenizer.ggml.bos_token_id": 31}))
    path = write_gguf(tmp_path / "bos.gguf", raw_kv={"tokenizer.ggml.bos_token_id": 40})
    assert main(["generate", "hi", "--model", path, "--no-chat"]) == 2
    err = capsys.readouterr().err
    assert err == (
        f"kvpool generate: error: GGUF file {path}: GGUF metadata tokenizer.ggml.bos_token_id is 40, "
        "not a token of the vocabulary of 32 tokens\n"
    ), err


def test_a_merge_of_tokens_outside_the_vocabulary_is_one_line_from_the_cli(tmp_path, capsys, monkeypatch):
    """It was the tokenizers library's bare Exception: a 20-line traceback."""
    monkeypatch.setenv("KVPOOL_CACHE_DIR", str(tmp_path / "cache"))
    path = write_gguf(tmp_path / "merges.gguf", merges=["x y"])
    assert main(["generate", "hi", "--model", path, "--no-chat"]) == 2
    assert capsys.readouterr().err == (
        "kvpool generate: error: the GGUF's tokenizer.ggml.merges do not fit its tokens: "
        "Error while initializing BPE: Token `x` out of vocabulary\n"
    )


@pytest.mark.parametrize(
    ("name", "rows", "message"),
    [
        ("layers.0.attn_norm", 8, "weight layers.0.attn_norm is [8] torch.float32, but the config needs [64]"),
        ("layers.1.q", 32, "weight layers.1.wqkv is [64, 96] torch.float32, but the config needs [64, 128]"),
        ("embed", 99, "weight embed is [99, 64] torch.float32, but the config needs [100, 64]"),
    ],
)
def test_a_llama_model_whose_weights_disagree_with_its_config_is_refused_before_the_kernels_run(name, rows, message):
    """build_engine takes a bare LlamaModel (docs/core_api.md): built from weights of the
    wrong shapes, its fused forward ran the C kernels on the config's sizes, reading past a
    short norm weight (the logits came out NaN, blamed on a non-finite weight)."""
    import torch

    from kvpool.kernels import cpu_kernels
    from kvpool.models.gguf import LlamaConfig
    from kvpool.models.hf_config import random_tensors
    from kvpool.models.llama import LlamaModel

    cfg = LlamaConfig(2, 64, 128, 4, 2, 16, 1e4, 1e-5, 100, 64, True)
    tensors = dict(random_tensors(cfg, 0, torch.float32))
    tensors[name] = tensors[name][:rows].clone()
    with pytest.raises(ValueError) as e:
        LlamaModel.from_tensors(cfg, tensors.items(), "cpu", cpu_kernels())
    assert str(e.value).startswith(message)


def test_a_position_past_the_context_is_refused_even_when_metadata_understates_it():
    """StepMetadata.max_position (docs/core_api.md) spares the forward reading the positions;
    one below the true largest position skipped its check, and on the fused path the RoPE
    kernel's refusal went unread: q and k stayed unrotated and the logits came back."""
    import torch

    from kvpool.attention.backends.step import FunctionStep, StepMetadata
    from kvpool.kernels import cpu_kernels
    from kvpool.models.gguf import LlamaConfig
    from kvpool.models.hf_config import random_tensors
    from kvpool.models.llama import LlamaModel

    kernels = cpu_kernels()
    if kernels is None:
        pytest.skip("the C kernels do not build here")
    cfg = LlamaConfig(1, 64, 128, 4, 2, 16, 1e4, 1e-5, 100, 64, True)
    model = LlamaModel.from_tensors(cfg, random_tensors(cfg, 0, torch.float32), "cpu", kernels)
    step = FunctionStep(lambda layer, q, k, v: q, 2)
    ids, positions = torch.tensor([1, 2]), torch.tensor([3, 70])
    with pytest.raises(ValueError, match="position lies past the model's context 64"):
        model.forward(ids, positions, StepMetadata(step, max_position=3))
    with pytest.raises(ValueError, match="position 70 exceeds the model's context 64"):  # (read off the tensor)
        model.forward(ids, positions, StepMetadata(step))


def test_kvpool_native_1_without_a_compiler_is_one_line_from_the_cli(tmp_path):
    """KVPOOL_NATIVE=1 makes a kernel build failure an error (docs/install.md): from the CLI
    it was a KernelBuildError traceback."""
    import os
    import subprocess
    import sys

    env = {
        **os.environ,
        "PATH": str(tmp_path / "no-bin"),  # no cc / gcc / clang
        "KVPOOL_NATIVE": "1",
        "KVPOOL_CACHE_DIR": str(tmp_path / "cache"),
    }
    env.pop("CC", None)
    path = write_gguf(tmp_path / "ok.gguf")
    run = subprocess.run(
        [sys.executable, "-m", "kvpool.cli.main", "generate", "hi", "--model", path, "--device", "cpu"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert (run.returncode, run.stderr) == (
        1,
        "kvpool generate: error: KVPOOL_NATIVE=1, but the C kernels cannot be used: no C compiler found "
        "(set CC, or install gcc)\n",
    )


def test_a_device_or_a_pipe_is_not_reported_as_missing(tmp_path):
    """--model /dev/null said "GGUF file not found: /dev/null"."""
    import os

    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    for path in ("/dev/null", str(fifo)):
        with pytest.raises(ValueError, match=f"^{path} is not a regular file, not a GGUF file$"):
            load_gguf(path)
    with pytest.raises(FileNotFoundError, match="GGUF file not found"):
        load_gguf(str(tmp_path / "missing.gguf"))


def test_a_gguf_too_large_for_the_machine_is_refused_before_its_weights_are_read(tmp_path, monkeypatch, capsys):
    """The config.json models were sized against the machine's memory, a GGUF's weights
    were not: an 8B GGUF in fp32 (32 GB) on a 16 GB machine was dequantized for minutes
    until the kernel killed the process. Here the machine has 8 KiB available, and the
    2-layer model needs more."""
    import kvpool.engine.memory as memory
    from kvpool.engine.build import load_model

    monkeypatch.setenv("KVPOOL_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(memory, "available_memory_bytes", lambda device: 8 << 10)
    path = write_gguf(tmp_path / "ok.gguf")
    with pytest.raises(ValueError) as e:
        load_model(path, device="cpu")
    assert str(e.value).startswith(f"GGUF file {path} (2 layers of hidden 16) in float32 needs 0.0 GiB but this")
    assert str(e.value).endswith("GiB of memory available; a smaller model, or --dtype bf16")
    monkeypatch.setattr(memory, "available_memory_bytes", lambda device: None)  # (unknown: no check)
    assert load_model(path, device="cpu").model.config.num_layers == 2


def test_a_pre_tokenizer_kvpool_does_not_implement_is_refused_not_replaced_by_gpt2s(tmp_path, capsys, monkeypatch):
    """A GGUF split another way (DeepSeek's "deepseek-llm"; Llama 3's "llama-bpe" before kvpool
    built it) was tokenized with GPT-2's regex, without a word: token ids its own tokenizer
    never makes. The ones kvpool builds load (tests/test_tokenizer_pre.py holds their splits)."""
    monkeypatch.setenv("KVPOOL_CACHE_DIR", str(tmp_path / "cache"))
    path = write_gguf(tmp_path / "deepseek.gguf", raw_kv={"tokenizer.ggml.pre": "deepseek-llm"})
    assert main(["generate", "12345", "--model", path, "--no-chat"]) == 2
    err = capsys.readouterr().err
    assert err == (
        "kvpool generate: error: unsupported GGUF pre-tokenizer tokenizer.ggml.pre 'deepseek-llm': kvpool splits "
        "text as codeshell, command-r, default, exaone, gpt-2, llama-bpe, minerva-7b, qwen2, refact, smollm, "
        "starcoder, and another split would give token ids the model was not trained on\n"
    )
    for pre in ("gpt-2", "smollm", "llama-bpe", "qwen2"):  # GPT-2's regex, digit by digit before it, their own
        path = write_gguf(tmp_path / f"{pre}.gguf", raw_kv={"tokenizer.ggml.pre": pre})
        assert main(["generate", "t1", "--model", path, "--no-chat", "--max-tokens", "1"]) in (0, 2)
        assert "pre-tokenizer" not in capsys.readouterr().err


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"num_kv_heads": 0}, "the tiny hybrid model's num_kv_heads must be a positive integer, got 0"),
        ({"head_dim": 0}, "the tiny hybrid model's head_dim must be a positive integer, got 0"),
        ({"hidden_size": -1}, "the tiny hybrid model's hidden_size must be a positive integer, got -1"),
        ({"vocab_size": 0}, "the tiny hybrid model's vocab_size must be a positive integer, got 0"),
        ({"num_heads": 4.0}, "the tiny hybrid model's num_heads must be a positive integer, got 4.0"),
    ],
)
def test_a_tiny_hybrid_config_it_cannot_compute_with_is_named(change, message):
    """build_engine takes a TinyHybrid: these were a ZeroDivisionError, torch's "negative
    dimension", a model of no tokens, and (a missing key) a KeyError."""
    from kvpool.models.tiny_hybrid import TINY_GEMMA2, TinyHybrid

    with pytest.raises(ValueError, match=f"^{message}$"):
        TinyHybrid({**TINY_GEMMA2, **change})
    with pytest.raises(ValueError, match=r"^the tiny hybrid model's config lacks \['num_heads'\]$"):
        TinyHybrid({k: v for k, v in TINY_GEMMA2.items() if k != "num_heads"})
