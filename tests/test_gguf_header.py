"""load_model refuses what a GGUF's header alone refuses before it hashes the file
(models/gguf_header.py): the digest reads every byte, and a refused 40 GB file was read
whole (~80 s) before its one-line refusal. The header reader, no gguf library, is checked
against the library's reader on SmolLM2 and on tiny GGUFs of either byte order."""

from __future__ import annotations

import os
import subprocess
import sys

import gguf
import numpy as np
import pytest
import torch

from kvpool.engine import build
from kvpool.models import gguf as kv_gguf
from kvpool.models.gguf import default_gguf_path, load_gguf
from kvpool.models.gguf_header import QUANT_TYPES, SkippedArray, check_header, read_header
from test_gguf_metadata import write_gguf

PADDED_BYTES = 1 << 30  # a refused file's size: sparse, so it takes no disk, but a digest reads it all


def test_the_quantization_table_is_the_gguf_librarys():
    for type_id, (name, block, block_bytes) in QUANT_TYPES.items():
        quant = gguf.GGMLQuantizationType(type_id)
        assert (quant.name, *gguf.GGML_QUANT_SIZES[quant]) == (name, block, block_bytes)
    assert {name for name, _, _ in QUANT_TYPES.values()} == kv_gguf.SUPPORTED_QUANT_TYPES


def _tiny(path, endianess=gguf.GGUFEndian.LITTLE) -> str:
    """write_gguf's tiny Llama, in either byte order, with an array of numbers and of arrays."""
    original = gguf.GGUFWriter.__init__

    def writer(self, *args, **kwargs):
        original(self, *args, **{**kwargs, "endianess": endianess})
        self.add_array("test.nested", [[1, 2], [3]])
        self.add_array("test.numbers", [1.5, 2.5, 3.5])

    try:
        gguf.GGUFWriter.__init__ = writer
        # (and Llama 3.1's RoPE factors, whose values the header reads from the data section)
        rope_freqs = {"rope_freqs.weight": np.array([1.0, 2.5], dtype=np.float32)}
        return write_gguf(path, raw_kv={"tokenizer.ggml.pre": "smollm", "test.flag": True}, extra=rope_freqs)
    finally:
        gguf.GGUFWriter.__init__ = original


@pytest.mark.parametrize("which", ["smollm2", "tiny", "tiny big-endian"])
def test_the_header_reads_what_the_gguf_reader_reads(tmp_path, which):
    path = {
        "smollm2": default_gguf_path,
        "tiny": lambda: _tiny(tmp_path / "tiny.gguf"),
        "tiny big-endian": lambda: _tiny(tmp_path / "big.gguf", gguf.GGUFEndian.BIG),
    }[which]()
    header = read_header(path)
    reader = gguf.GGUFReader(path)
    assert list(header.fields) == [k for k in reader.fields if not k.startswith("GGUF.")]
    for key, field in header.fields.items():
        theirs = reader.fields[key].contents()
        if isinstance(field.value, SkippedArray):
            assert len(field.value) == len(theirs), key
        elif isinstance(field.value, tuple):  # an array of arrays (the library's answer flattens it)
            assert [len(a) for a in field.value] == [2, 1] and len(theirs) == 3, key
        else:
            assert field.value == theirs and type(field.value) is type(theirs), key
    assert header.data_offset == reader.data_offset
    assert [(t.name, t.shape, t.type_id, t.offset) for t in header.tensors] == [
        (t.name, tuple(int(x) for x in t.shape), int(t.tensor_type), int(t.field.parts[-1][0])) for t in reader.tensors
    ]
    facts = check_header(header, path)
    assert facts.config == load_gguf(path).meta.config
    if which != "smollm2":
        assert facts.config.rope_freq_divisors == (1.0, 2.5)
    assert (facts.tokenizer_model, facts.tokenizer_pre) == ("gpt2", "smollm")
    assert header.bytes_read == min(os.path.getsize(path), 4 << 20)


def _refusals(tmp_path) -> dict[str, tuple[str, str]]:
    """Name -> (path, the end of its refusal)."""
    deepseek = "unsupported GGUF pre-tokenizer tokenizer.ggml.pre 'deepseek-llm': kvpool splits text as"
    cases = {
        "pre-tokenizer": ({"raw_kv": {"tokenizer.ggml.pre": "deepseek-llm"}}, deepseek),
        "RoPE scaling": (
            {"raw_kv": {"llama.rope.scaling.type": "yarn"}},
            "unsupported RoPE scaling llama.rope.scaling.type 'yarn'; kvpool runs plain, linear and Llama 3 "
            "(rope_freqs.weight) RoPE",
        ),
        "RoPE factors": (
            {"extra": {"rope_freqs.weight": np.array([1.0, 0.0], dtype=np.float32)}},
            "tensor 'rope_freqs.weight' holds 0.0 at [1]: a RoPE frequency factor must be finite and positive",
        ),
        "quantization": ({"dtype": np.float64}, "unsupported GGUF quantization type F64 in tensor 'token_embd.weight'"),
        "missing tensor": ({"skip": ("blk.1.attn_q.weight",)}, "lacks tensors ['blk.1.attn_q.weight']"),
        "head count": ({"heads": 0}, "llama.attention.head_count must be a positive integer, got 0"),
        "shape": ({"q_rows": 12}, "tensor 'blk.0.attn_q.weight' has dims [16, 12], but the metadata's architecture"),
        "too large": ({}, "GiB of memory available; a smaller model, or --dtype bf16"),
    }
    return {
        name: (write_gguf(tmp_path / f"{name.replace(' ', '_')}.gguf", **over), message)
        for name, (over, message) in cases.items()
    }


def _bytes_read() -> int:
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("rchar:")).split()[1])


@pytest.mark.skipif(not os.path.exists("/proc/self/io"), reason="counts the bytes read in /proc/self/io")
@pytest.mark.parametrize(
    "case",
    [
        "pre-tokenizer",
        "RoPE scaling",
        "RoPE factors",
        "quantization",
        "missing tensor",
        "head count",
        "shape",
        "too large",
    ],
)
def test_a_refused_header_is_refused_before_the_file_is_hashed(tmp_path, monkeypatch, case):
    """Each refusal as load_gguf words it (the pre-tokenizer's and the memory's are
    load_model's), of a 1 GiB file, after reading its header: a few MiB, no digest."""
    import kvpool.engine.memory as memory

    monkeypatch.setenv("KVPOOL_CACHE_DIR", str(tmp_path / "cache"))
    path, message = _refusals(tmp_path)[case]
    if case not in ("pre-tokenizer", "too large"):
        with pytest.raises(ValueError) as theirs:
            load_gguf(path)
        assert str(theirs.value).endswith(message) or message in str(theirs.value)
    if case == "too large":
        monkeypatch.setattr(memory, "available_memory_bytes", lambda device: 8 << 10)
    os.truncate(path, PADDED_BYTES)
    digests = []
    monkeypatch.setattr(build, "file_digest", lambda p: digests.append(p) or kv_gguf.file_digest(p))
    before = _bytes_read()
    with pytest.raises(ValueError) as e:
        build.load_model(path, device="cpu")
    read = _bytes_read() - before
    assert message in str(e.value) and str(e.value).startswith(("GGUF file", "unsupported GGUF pre")), str(e.value)
    if case not in ("pre-tokenizer", "too large"):
        assert str(e.value) == str(theirs.value)
    assert digests == [] and read < 8 << 20, (digests, read)


def test_the_weight_cache_does_not_stand_in_for_a_check_the_header_fails(tmp_path, monkeypatch):
    """An entry's metadata comes from the weight cache, so a check added after the entry was
    stored was never made on a hit (mendC: entries from before 290ffce). The header is
    checked on every load: here the cached file's F32 tensors stop being a supported type."""
    monkeypatch.setenv("KVPOOL_CACHE_DIR", str(tmp_path / "cache"))
    path = write_gguf(tmp_path / "ok.gguf")
    assert build.load_model(path, device="cpu").load_source.startswith("gguf (no entry")
    assert build.load_model(path, device="cpu").load_source == "weight cache"
    monkeypatch.setattr(kv_gguf, "SUPPORTED_QUANT_TYPES", frozenset({"F16"}))
    with pytest.raises(ValueError, match=r"unsupported GGUF quantization type F32 in tensor 'token_embd.weight'"):
        build.load_model(path, device="cpu")


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda b: b[:4] + (7).to_bytes(4, "little") + b[8:], "GGUF version 7; kvpool reads versions 2 and 3"),
        (lambda b: b[:1000], "runs past the end of the file"),
        (lambda b: b[:24] + (1 << 60).to_bytes(8, "little") + b[32:], "a string of 1152921504606846976 bytes"),
    ],
)
def test_a_corrupt_header_is_named_in_one_line(tmp_path, damage, message):
    path = write_gguf(tmp_path / "ok.gguf")
    with open(path, "rb") as f:
        data = f.read()
    with open(path, "wb") as f:
        f.write(damage(data))
    with pytest.raises(ValueError) as e:
        check_header(read_header(path), path)
    assert str(e.value).startswith(f"GGUF file {path} is corrupt or truncated: ") and message in str(e.value)


def _huge_token_length(data: bytes) -> bytes:
    """The first token's byte count set past 2^63: walking the strings went past what
    struct can index (OverflowError, a traceback; review 13's fuzz)."""
    key = b"tokenizer.ggml.tokens"
    first = data.index(key) + len(key) + 4 + 4 + 8  # value type, item type, count
    return data[:first] + (0xD70B_0000_0000_0001).to_bytes(8, "little") + data[first + 8 :]


def _rope_freqs_offset_wrapped(data: bytes) -> bytes:
    """rope_freqs.weight's data offset set to 2^64 - 1 (its seek raised OverflowError)."""
    name = b"rope_freqs.weight"
    at = data.index(name) + len(name) + 4 + 8 + 4  # dims count, one dim, type
    return data[:at] + (2**64 - 1).to_bytes(8, "little") + data[at + 8 :]


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("tokens a number", "GGUF metadata tokenizer.ggml.tokens must be an array of strings"),
        ("tokens a number, vocab_size given", "GGUF metadata tokenizer.ggml.tokens must be an array of strings"),
        ("a token's length past 2^63", "is corrupt or truncated: the strings of the array at offset"),
        ("rope_freqs offset wrapped", "is corrupt or truncated: tensor 'rope_freqs.weight': 8 bytes at offset"),
    ],
)
def test_a_malformed_header_is_refused_in_one_line_not_a_traceback(tmp_path, monkeypatch, case, message):
    """Whatever the malformed header makes the checks raise (TypeError, OverflowError, ...)
    is load_model's one-line ValueError naming the file, as load_gguf's was (review 13: the
    CLI printed a traceback, status 1)."""
    monkeypatch.setenv("KVPOOL_CACHE_DIR", str(tmp_path / "cache"))
    if case.startswith("tokens a number"):
        monkeypatch.setattr(
            gguf.GGUFWriter, "add_token_list", lambda self, tokens: self.add_uint32("tokenizer.ggml.tokens", 32)
        )
        raw = {"llama.vocab_size": 32} if case.endswith("given") else {}
        path = write_gguf(tmp_path / "bad.gguf", raw_kv=raw)
    else:
        path = _tiny(tmp_path / "bad.gguf")
        with open(path, "rb") as f:
            data = f.read()
        damage = _huge_token_length if case.startswith("a token") else _rope_freqs_offset_wrapped
        with open(path, "wb") as f:
            f.write(damage(data))
    with pytest.raises(ValueError) as e:
        build.load_model(path, device="cpu")
    assert str(e.value).startswith(f"GGUF file {path}") and message in str(e.value), str(e.value)


def test_a_huge_block_count_is_refused_without_exhausting_memory(tmp_path):
    """block_count 2^31: the check of the tensors a model needs listed 2^31 x 9 names, a
    MemoryError traceback (or the OOM killer) before any refusal (review 13). Run under a 4 GiB
    address-space limit, so that a regression fails here instead of taking the machine."""
    path = write_gguf(tmp_path / "blocks.gguf")
    with open(path, "rb") as f:
        data = bytearray(f.read())
    key = b"llama.block_count"
    at = data.index(key) + len(key) + 4  # the u32 value after its type
    data[at : at + 4] = (2**31).to_bytes(4, "little")
    with open(path, "wb") as f:
        f.write(data)
    limit = "import resource; resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30)); "
    code = limit + "import sys; from kvpool.cli.main import main; sys.exit(main(sys.argv[1:]))"
    env = {**os.environ, "KVPOOL_CACHE_DIR": str(tmp_path / "cache"), "KVPOOL_NATIVE": "0"}
    run = subprocess.run(
        [sys.executable, "-c", code, "generate", "--model", str(path), "hi"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 2 and "Traceback" not in run.stderr, run.stderr[-2000:]
    assert "lacks tensors ['blk.2.attn_q.weight'" in run.stderr and " more" in run.stderr, run.stderr


def test_a_header_longer_than_the_first_read_is_read_on(tmp_path, monkeypatch):
    import kvpool.models.gguf_header as header_module

    path = write_gguf(tmp_path / "ok.gguf", tokens=[f"token{i}" for i in range(4000)], vocab=4000, embed_rows=4000)
    monkeypatch.setattr(header_module, "FIRST_READ_BYTES", 1000)
    header = read_header(path)
    assert len(header.fields["tokenizer.ggml.tokens"].value) == 4000
    assert header.bytes_read // 2 < header.data_offset <= header.bytes_read  # read on, doubling, no further
    assert check_header(header, path).config == load_gguf(path, torch.float32).meta.config


def test_a_cold_load_checks_the_header_once(tmp_path, monkeypatch):
    """load_model checks the header before it hashes the file, and load_gguf took it up again:
    read_config, check_shapes and check_tensor_types ran twice on every cold load (the second
    time through gguf's reader). Now load_gguf takes load_model's result; alone, it checks."""
    from kvpool.models import gguf_header

    calls: dict[str, int] = {}
    for name in ("read_config", "check_shapes", "check_tensor_types"):
        original = getattr(kv_gguf, name)

        def counted(*args, _name=name, _original=original):
            calls[_name] = calls.get(_name, 0) + 1
            return _original(*args)

        monkeypatch.setattr(kv_gguf, name, counted)
        monkeypatch.setattr(gguf_header, name, counted)
    monkeypatch.setenv("KVPOOL_WEIGHT_CACHE", "0")
    path = write_gguf(tmp_path / "tiny.gguf")
    loaded = build.load_model(path, device="cpu")
    assert loaded.load_source == "gguf" and loaded.model.config.num_layers == 2
    assert calls == {"read_config": 1, "check_shapes": 1, "check_tensor_types": 1}
    calls.clear()
    assert load_gguf(path).meta.config == loaded.model.config
    assert calls == {"read_config": 1, "check_shapes": 1, "check_tensor_types": 1}
