"""A Llama-family model from a Hugging Face `config.json` with seeded random weights: real
shapes (Llama-3.1-8B, SmolLM2, any Llama-family config) benchmarked without downloading weights.

`llama_config(path)` reads the architecture into the engine's `LlamaConfig` and refuses
what `models/llama.py` does not compute (biases, another activation, a sliding window,
another architecture), one line naming the key. `random_llama(config, seed)` draws every
weight from a generator seeded by `seed`, on the target device, one layer at a time:
projections N(0, 1 / fan_in) (activations keep their scale through the layers), norm
weights 1 + N(0, 0.01), the embedding N(0, 1). `hf_tensor_names` maps the weights to
transformers' LlamaForCausalLM names, so the same random model can be loaded there.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvpool.models.gguf import LlamaConfig
from kvpool.models.llama import QK_NORM_PARTS, LlamaModel, layer_parts
from kvpool.models.rope import llama3_divisors
from kvpool.spec.hf_defaults import HEAD_DIM_DEFAULTS, KV_HEADS_DEFAULTS, KV_HEADS_NULL

ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")  # model_type values whose math models/llama.py computes
# transformers' defaults that differ by model_type (Qwen2Config's and Qwen3Config's context: 32,768;
# MistralConfig's 4096 x 32 = 131,072; LlamaConfig's 2,048 for the rest)
MAX_POSITION_DEFAULTS = {"qwen2": 32768, "qwen3": 32768, "mistral": 131072}
# the sliding_window that transformers' Qwen2Config and MistralConfig fill in where config.json has no key
# (Qwen2 uses it only with use_sliding_window true; Mistral always: a window of 4096 positions)
SLIDING_WINDOW_DEFAULT = 4096


@dataclass(frozen=True)
class HFConfig:
    """The engine's config of a config.json, and its name."""

    config: LlamaConfig
    name: str


def llama_config(path: str | Path) -> HFConfig:
    """The Llama architecture of an HF config.json (a file, or a directory holding one).
    ValueError naming the file and the key for anything models/llama.py cannot compute."""
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    try:
        raw: dict[str, Any] = json.loads(p.read_text())
    except FileNotFoundError:
        raise ValueError(f"{p}: no such config.json") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{p}: not JSON ({e.msg} at line {e.lineno})") from None
    except UnicodeDecodeError as e:  # (a binary file: the codec's words, without the file)
        raise ValueError(f"{p}: not JSON (not UTF-8 text: byte {e.object[e.start]:#04x} at {e.start})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{p}: not a JSON object")
    name = raw.get("_name_or_path") or (p.parent.name if p.name == "config.json" else p.stem)
    return HFConfig(_parse(raw, str(p)), name)


def _parse(raw: dict[str, Any], where: str) -> LlamaConfig:
    model_type = raw.get("model_type")
    if model_type not in ARCHITECTURES:
        raise ValueError(f"{where}: model_type {model_type!r} is not a Llama-family model ({', '.join(ARCHITECTURES)})")
    qwen2 = model_type == "qwen2"  # Q / K / V biases always (transformers' Qwen2Attention), none on O or the MLP
    qwen3 = model_type == "qwen3"  # no biases; an RMSNorm over each query and key head (q_norm, k_norm)
    checked = [("hidden_act", ("silu",)), ("mlp_bias", (False,))]
    if not qwen2:  # (Llama's and Qwen3's attention_bias adds an O bias too)
        checked.append(("attention_bias", (False,)))
    for key, allowed in checked:
        if key in raw and raw[key] not in allowed:
            raise ValueError(f"{where}: {key} {raw[key]!r} is not modelled (only {allowed[0]!r})")
    if model_type == "mistral" and "sliding_window" not in raw:
        raise ValueError(
            f"{where}: no sliding_window key: transformers' MistralConfig then slides a window of "
            f"{SLIDING_WINDOW_DEFAULT} positions, which is not modelled (full attention only; "
            '"sliding_window": null attends in full)'
        )
    if not (qwen2 or qwen3) and raw.get("sliding_window") is not None:
        raise ValueError(f"{where}: sliding_window {raw['sliding_window']!r} is not modelled (full attention only)")

    def positive(key: str, default: int | None = None) -> int:
        value = raw.get(key, default)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"{where}: {key} must be a positive integer, got {value!r}")
        if value >= 2**63:  # (a size past int64: an OverflowError traceback sizing the model)
            raise ValueError(f"{where}: {key} {value} is past any tensor's size (2^63)")
        return value

    num_layers = positive("num_hidden_layers")
    if qwen2 or qwen3:  # (Qwen3Config decides its layers' windows as Qwen2Config does)
        _check_qwen2_full_attention(raw, where, num_layers)
    hidden = positive("hidden_size")
    num_heads = positive("num_attention_heads")
    # absent: the family's default, as transformers' attention is then built (a qwen3 of 64 heads ran
    # 64 KV heads for its 32); null: num_attention_heads (MistralConfig's int field refuses it)
    if raw.get("num_key_value_heads", 0) is None and model_type in KV_HEADS_NULL:
        num_kv_heads = num_heads
    else:
        num_kv_heads = positive("num_key_value_heads", KV_HEADS_DEFAULTS.get(model_type, num_heads))
    if num_heads % num_kv_heads:
        # (a default the file does not hold: it says whose)
        default = (
            "" if "num_key_value_heads" in raw else f" ({model_type}'s default: the file has no num_key_value_heads)"
        )
        raise ValueError(
            f"{where}: num_attention_heads {num_heads} is not a multiple of num_key_value_heads {num_kv_heads}{default}"
        )
    head_dim = raw.get("head_dim")
    if model_type in HEAD_DIM_DEFAULTS:  # (null too is refused: transformers' attention cannot size its heads)
        head_dim = positive("head_dim", HEAD_DIM_DEFAULTS[model_type])
    else:
        head_dim = positive("head_dim") if head_dim is not None else hidden // num_heads
    if head_dim == 0:  # (a head dim of 0 was a ZeroDivisionError traceback at its scale)
        raise ValueError(
            f"{where}: hidden_size {hidden} is smaller than num_attention_heads {num_heads}, and no head_dim is given"
        )
    if head_dim % 2:
        raise ValueError(f"{where}: head_dim {head_dim} must be even (rotate-half RoPE)")

    def positive_number(key: str, default: float) -> float:
        return _positive_number(where, key, raw.get(key, default))

    rope_theta, divisors = _rope(raw, where, head_dim)
    eps = positive_number("rms_norm_eps", 1e-6)
    max_position = positive("max_position_embeddings", MAX_POSITION_DEFAULTS.get(model_type, 2048))
    if max_position < 2:  # a request needs one position for its prompt and one for its output token
        raise ValueError(
            f"{where}: max_position_embeddings must be 2 or more (a prompt token and the token it "
            f"makes), got {max_position}"
        )
    tie = raw.get("tie_word_embeddings", False)
    if not isinstance(tie, bool):  # bool("false") is True: a string tied an untied model
        raise ValueError(f"{where}: tie_word_embeddings must be true or false, got {tie!r}")
    return LlamaConfig(
        num_layers=num_layers,
        hidden_size=hidden,
        intermediate_size=positive("intermediate_size"),
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        rope_theta=rope_theta,
        rms_norm_eps=eps,
        vocab_size=positive("vocab_size"),
        max_position=max_position,
        tie_embeddings=tie,
        rope_freq_divisors=divisors,
        qkv_bias=qwen2,
        qk_norm=qwen3,
    )


def _check_qwen2_full_attention(raw: dict[str, Any], where: str, num_layers: int) -> None:
    """ValueError unless every layer of a Qwen2 (or Qwen3) config.json attends in full, as
    transformers' Qwen2Config (Qwen3Config alike) decides: the window is `sliding_window`
    (4096 when the key is missing) where `use_sliding_window` is true, else none (Qwen2.5's
    config.json names a sliding_window with use_sliding_window false: full attention);
    `layer_types` when given (one per layer, as transformers checks), else a window on the
    layers from `max_window_layers` on."""
    use = raw.get("use_sliding_window", False)
    if not isinstance(use, bool):  # bool("false") is True
        raise ValueError(f"{where}: use_sliding_window must be true or false, got {use!r}")
    window = raw.get("sliding_window", SLIDING_WINDOW_DEFAULT) if use else None
    shown = f"{window!r}" if "sliding_window" in raw else f"{window} (transformers' default: config.json has no key)"
    types = raw.get("layer_types")
    if types is not None:
        if not isinstance(types, list) or not all(isinstance(t, str) for t in types):
            raise ValueError(f"{where}: layer_types must be a list of strings, got {types!r:.200}")
        if len(types) != num_layers:
            raise ValueError(
                f"{where}: layer_types has {len(types)} entries for num_hidden_layers {num_layers} (one per layer)"
            )
        other = sorted(set(types) - {"full_attention", "attention"})  # (transformers reads "attention" as full)
        if other == ["sliding_attention"] and window is not None:
            raise ValueError(
                f"{where}: layer_types 'sliding_attention' with use_sliding_window and sliding_window {shown} "
                "is not modelled (full attention only)"
            )
        if other == ["sliding_attention"]:  # (transformers 5.25 fails building the mask: no window to slide)
            raise ValueError(
                f"{where}: layer_types 'sliding_attention' without a window (use_sliding_window false or "
                "sliding_window null) is not modelled: give those layers 'full_attention'"
            )
        if other:
            raise ValueError(f"{where}: layer_types {other[0]!r} is not modelled (full_attention only)")
        return
    first = raw.get("max_window_layers", 28)
    if window is not None and not (isinstance(first, int) and first >= num_layers):
        raise ValueError(
            f"{where}: use_sliding_window with sliding_window {shown} is not modelled "
            f"(full attention only; layers from max_window_layers {first!r} would slide)"
        )


def _positive_number(where: str, key: str, value: Any) -> float:
    """value as a float: a JSON number, finite (json reads 1e999 as inf: an inf RoPE base
    ran) and positive; a string or a list was float()'s bare message or a TypeError
    traceback."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise ValueError(f"{where}: {key} must be a number, got {value!r}")
    try:
        number = float(value)  # (an int past a double's range: OverflowError)
    except OverflowError:
        number = math.inf
    if not (math.isfinite(number) and number > 0):
        raise ValueError(f"{where}: {key} must be finite and positive, got {value!r}")
    return number


ROPE_TYPES = ("default", "linear", "llama3")  # rope_type values whose RoPE models/rope.py computes


def _rope(raw: dict[str, Any], where: str, head_dim: int) -> tuple[float, tuple[float, ...] | None]:
    """(rope_theta, the per-pair divisors of models/rope.py or None) of a config.json: its
    `rope_scaling` (transformers 4), or `rope_parameters` (transformers 5, which holds
    rope_theta too). ValueError naming the key for another rope_type (yarn, dynamic,
    longrope: not divisors of the frequencies) or a parameter that is missing or not a
    finite positive number; left out, the model ran with plain RoPE without a word."""
    scaling, key = raw.get("rope_scaling"), "rope_scaling"
    if raw.get("rope_parameters") is not None:
        if scaling is not None:
            raise ValueError(  # (transformers 5.25: LlamaConfig(rope_scaling=a, rope_parameters=b) runs a)
                f"{where}: both rope_scaling and rope_parameters are given; give one (transformers 5 runs "
                "rope_scaling's and ignores rope_parameters)"
            )
        scaling, key = raw["rope_parameters"], "rope_parameters"
    if scaling is None:
        return _positive_number(where, "rope_theta", raw.get("rope_theta", 10000.0)), None
    if not isinstance(scaling, dict):
        raise ValueError(f"{where}: {key} must be an object or null, got {scaling!r}")
    params = {"rope_theta": raw.get("rope_theta", 10000.0), **scaling}  # (rope_parameters' rope_theta wins)
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"{where}: {key} type {rope_type!r} is not modelled (only {', '.join(ROPE_TYPES)})")

    def number(name: str) -> float:
        if name not in params:
            raise ValueError(f"{where}: {key} {rope_type!r} lacks {name!r}")
        shown = name if name == "rope_theta" and name not in scaling else f"{key}.{name}"
        return _positive_number(where, shown, params[name])

    theta = number("rope_theta")
    if rope_type == "default":
        return theta, None
    factor = number("factor")
    if rope_type == "linear":
        return theta, (factor,) * (head_dim // 2)
    low, high = number("low_freq_factor"), number("high_freq_factor")
    if high < low:  # (equal: no blended band, a step, as transformers and llama.cpp compute it; Llama 4's)
        raise ValueError(f"{where}: {key} high_freq_factor {high} must be at least low_freq_factor {low}")
    original = number("original_max_position_embeddings")
    return theta, llama3_divisors(head_dim, theta, factor, low, high, original)


def model_bytes(config: LlamaConfig, dtype: torch.dtype) -> int:
    """An estimate of the bytes `random_llama` holds for `config`, to refuse a model too large
    for the device before the first tensor is drawn (a config.json of 100 B parameters was a
    traceback from the allocator, or the process killed as pages were touched). It counts
    exactly three terms: every weight `random_tensors` yields, in `dtype` (the embedding,
    the untied LM head, the norms, each layer's q, k, v, o, gate, up, down and two norms (a
    Qwen2's biases and a Qwen3's q / k norms too): the same elements LlamaModel keeps fused);
    the largest of them (the embedding, a gate / up / down or a q matrix) once more in fp32,
    its draw before the cast (an fp32 model casts nothing: a margin then); and max_position
    x head_dim x 24 bytes of RoPE tables (two fp64 tables, the angles and sines being built,
    and the fp32 cos and sin kept; 32 for an fp64 model, whose kept tables are fp64).
    Not counted: a layer's parts and their fused copies while `fuse_layer` concatenates and
    transposes them (about two fused layers at the peak), the fp64 [max_position, head_dim
    / 2] frequencies, and the allocator's and Python's own overhead."""
    c = config
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    embed = c.vocab_size * c.hidden_size
    layer = [q * c.hidden_size, 2 * kv * c.hidden_size, q * c.hidden_size, 3 * c.intermediate_size * c.hidden_size]
    elements = embed * (1 if c.tie_embeddings else 2) + c.hidden_size * (1 + 2 * c.num_layers)
    if c.qkv_bias:
        elements += c.num_layers * (q + 2 * kv)
    if c.qk_norm:
        elements += c.num_layers * 2 * c.head_dim
    elements += c.num_layers * sum(layer)
    largest = max(embed, c.intermediate_size * c.hidden_size, q * c.hidden_size)
    table_bytes = 8 if dtype == torch.float64 else 4  # (an fp64 model keeps fp64 tables: models/llama.py)
    rope = c.max_position * c.head_dim * (2 * 8 + 2 * table_bytes)
    return elements * dtype.itemsize + largest * 4 + rope


def random_tensors(
    config: LlamaConfig, seed: int, dtype: torch.dtype, device: str | torch.device = "cpu"
) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF-style name, tensor) of every weight, HF layout ([out, in]), drawn in fp32 from a
    generator on `device` seeded by `seed` and cast to `dtype` (in the order
    LlamaModel.from_tensors fuses them: one layer's tensors at a time)."""
    c = config
    device = torch.device(device)
    g = torch.Generator(device=device).manual_seed(seed)

    def draw(*shape: int, std: float, mean: float = 0.0) -> torch.Tensor:
        t = torch.empty(shape, dtype=torch.float32, device=device).normal_(mean, std, generator=g)
        return t.to(dtype)

    kv = c.num_kv_heads * c.head_dim
    yield "embed", draw(c.vocab_size, c.hidden_size, std=1.0)
    yield "norm", draw(c.hidden_size, std=0.1, mean=1.0)
    if not c.tie_embeddings:
        yield "lm_head", draw(c.vocab_size, c.hidden_size, std=c.hidden_size**-0.5)
    shapes = {
        "q": (c.num_heads * c.head_dim, c.hidden_size),
        "k": (kv, c.hidden_size),
        "v": (kv, c.hidden_size),
        "o": (c.hidden_size, c.num_heads * c.head_dim),
        "gate": (c.intermediate_size, c.hidden_size),
        "up": (c.intermediate_size, c.hidden_size),
        "down": (c.hidden_size, c.intermediate_size),
    }
    for i in range(c.num_layers):
        for part, (n_out, n_in) in shapes.items():
            yield f"layers.{i}.{part}", draw(n_out, n_in, std=n_in**-0.5)
        for part in ("attn_norm", "ffn_norm"):
            yield f"layers.{i}.{part}", draw(c.hidden_size, std=0.1, mean=1.0)
        if c.qkv_bias:  # (drawn last: a model without biases draws what it always drew)
            for part in ("q", "k", "v"):
                yield f"layers.{i}.{part}_bias", draw(shapes[part][0], std=1.0)
        if c.qk_norm:  # (as the other norms' weights)
            for part in QK_NORM_PARTS:
                yield f"layers.{i}.{part}", draw(c.head_dim, std=0.1, mean=1.0)


def random_llama(
    config: LlamaConfig, seed: int = 0, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
) -> LlamaModel:
    """A LlamaModel of `config` with `random_tensors`' weights (no C kernels: a benchmark's
    plain torch path on any device)."""
    return LlamaModel.from_tensors(config, random_tensors(config, seed, dtype, device), device)


_HF_PARTS = {
    "q": "self_attn.q_proj",
    "k": "self_attn.k_proj",
    "v": "self_attn.v_proj",
    "o": "self_attn.o_proj",
    "gate": "mlp.gate_proj",
    "up": "mlp.up_proj",
    "down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "q_norm": "self_attn.q_norm",
    "k_norm": "self_attn.k_norm",
}


def hf_tensor_name(name: str) -> str:
    """transformers' LlamaForCausalLM state-dict name of a `random_tensors` name."""
    if name == "embed":
        return "model.embed_tokens.weight"
    if name == "norm":
        return "model.norm.weight"
    if name == "lm_head":
        return "lm_head.weight"
    _, index, part = name.split(".")
    if part.endswith("_bias"):
        return f"model.layers.{index}.{_HF_PARTS[part.removesuffix('_bias')]}.bias"
    return f"model.layers.{index}.{_HF_PARTS[part]}.weight"


def _model_name(hf_name: str) -> str | None:
    """The inverse of `hf_tensor_name`; None for a name it never makes."""
    top = {"model.embed_tokens.weight": "embed", "model.norm.weight": "norm", "lm_head.weight": "lm_head"}
    if hf_name in top:
        return top[hf_name]
    parts = hf_name.split(".")
    if len(parts) < 5 or parts[:2] != ["model", "layers"] or not (parts[2].isascii() and parts[2].isdigit()):
        return None
    short = {v: k for k, v in _HF_PARTS.items()}.get(".".join(parts[3:-1]))
    if short is None or parts[-1] not in ("weight", "bias"):
        return None
    return f"layers.{int(parts[2])}.{short}" + ("_bias" if parts[-1] == "bias" else "")


SAFETENSORS, SAFETENSORS_INDEX = "model.safetensors", "model.safetensors.index.json"


def hf_weight_files(directory: str | Path) -> list[Path]:
    """The safetensors files of an HF model directory: model.safetensors, or the shards
    model.safetensors.index.json names. ValueError naming the directory when it holds
    neither, or naming the index when it is not one."""
    return list(_weight_map(directory))


def _weight_map(directory: str | Path) -> dict[Path, frozenset[str] | None]:
    """Each safetensors file of an HF model directory and the tensor names to read from it:
    None (every tensor) for a single model.safetensors, else the names the index's weight_map
    assigns to that file (a copy of a tensor in another shard is not the index's, and is not
    read: the last file in sorted order won). ValueError as `hf_weight_files`."""
    d = Path(directory)
    single, index = d / SAFETENSORS, d / SAFETENSORS_INDEX
    if single.is_file():
        return {single: None}
    if not index.is_file():
        raise ValueError(f"{d}: no {SAFETENSORS} nor {SAFETENSORS_INDEX} (kvpool reads an HF model's safetensors)")
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        names = sorted(set(weight_map.values()))
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"{index}: not a safetensors index (a weight_map of tensor -> file): {e}") from None
    if not all(isinstance(n, str) and n and Path(n).name == n for n in names):
        raise ValueError(f"{index}: its weight_map names files outside the directory: {names[:4]}")
    missing = [n for n in names if not (d / n).is_file()]
    if missing:
        raise ValueError(f"{index} names {missing[0]}, which {d} lacks")
    return {d / n: frozenset(k for k, v in weight_map.items() if v == n) for n in names}


def hf_tensors(
    directory: str | Path, config: LlamaConfig, dtype: torch.dtype = torch.float32
) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of every weight of an HF model directory's safetensors, in
    `random_tensors`' names and HF layout ([out, in]), cast to `dtype`, one tensor read at a
    time (LlamaModel.from_tensors fuses a layer once its parts are in). A tied model's
    lm_head.weight, if the file holds one, is not read (transformers ties it to the
    embedding); of shards, each tensor is read from the file the index names for it.
    ValueError naming the file and tensor for one the model does not use (an O bias, a
    Llama's Q bias, a layer past num_hidden_layers), of a shape the config does not give,
    not of a floating type, or holding a value that is not finite in `dtype`; naming the
    directory and the HF names of the weights it lacks, once every file is read."""
    from safetensors import SafetensorError, safe_open

    c = config
    seen: set[str] = set()
    for path, assigned in _weight_map(directory).items():
        try:
            with safe_open(path, framework="pt") as f:
                held = list(f.keys())
                if assigned is not None:
                    lacking = sorted(assigned - set(held))
                    if lacking:
                        raise ValueError(
                            f"{path}: lacks tensor {lacking[0]!r}, which {SAFETENSORS_INDEX} says it holds"
                        )
                    held = [k for k in held if k in assigned]  # (the index's file for each tensor, not a copy)
                for hf_name in held:
                    if hf_name.endswith("rotary_emb.inv_freq"):  # (older checkpoints' buffer: computed here)
                        continue
                    if hf_name == "lm_head.weight" and c.tie_embeddings:
                        continue
                    name = _model_name(hf_name)
                    shape = None if name is None else _shape(name, c)
                    if shape is None:
                        raise ValueError(f"{path}: tensor {hf_name!r} is no weight kvpool's model of this config uses")
                    tensor = f.get_tensor(hf_name)
                    if tuple(tensor.shape) != shape or not tensor.dtype.is_floating_point:
                        raise ValueError(
                            f"{path}: tensor {hf_name!r} is {list(tensor.shape)} {tensor.dtype}; the config needs "
                            f"{list(shape)}, floating point"
                        )
                    tensor = tensor.to(dtype)
                    if not bool(torch.isfinite(tensor).all()):  # (every logit NaN, as a GGUF's: gguf._check_finite)
                        raise ValueError(
                            f"{path}: tensor {hf_name!r} holds a NaN or an infinity in {dtype}: the model cannot "
                            "compute with it"
                        )
                    seen.add(name)
                    yield name, tensor
        except SafetensorError as e:
            raise ValueError(f"{path}: not a safetensors file ({e})") from None
    _check_complete(directory, c, seen)


def _check_complete(directory: str | Path, config: LlamaConfig, seen: set[str]) -> None:
    """ValueError naming the directory and transformers' names of the weights its safetensors
    lack (LlamaModel.from_tensors' own message names a GGUF's: 'layers.1.k', 'output.weight')."""
    c = config
    if not c.tie_embeddings and "lm_head" not in seen:
        raise ValueError(
            f"{directory}: lacks tensor 'lm_head.weight' (the LM head), and its config.json does not tie it to "
            "the embedding (tie_word_embeddings true)"
        )
    wanted = ["embed", "norm"] + [f"layers.{i}.{p}" for i in range(c.num_layers) for p in layer_parts(c)]
    missing = [hf_tensor_name(n) for n in wanted if n not in seen]
    if missing:
        more = f" and {len(missing) - 4} more" if len(missing) > 4 else ""
        raise ValueError(f"{directory}: its safetensors lack tensors {missing[:4]}{more}")


def _shape(name: str, config: LlamaConfig) -> tuple[int, ...] | None:
    """The HF shape ([out, in]) of weight `name` (`random_tensors`' names) in `config`'s
    model; None for a weight it does not hold (an untied head of a tied model, a bias of a
    model without them, a layer past its last)."""
    c = config
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    top = {"embed": (c.vocab_size, c.hidden_size), "norm": (c.hidden_size,)}
    if not c.tie_embeddings:
        top["lm_head"] = (c.vocab_size, c.hidden_size)
    if not name.startswith("layers."):
        return top.get(name)
    _, index, part = name.split(".")
    if int(index) >= c.num_layers:
        return None
    parts = {
        "q": (q, c.hidden_size),
        "k": (kv, c.hidden_size),
        "v": (kv, c.hidden_size),
        "o": (c.hidden_size, q),
        "gate": (c.intermediate_size, c.hidden_size),
        "up": (c.intermediate_size, c.hidden_size),
        "down": (c.hidden_size, c.intermediate_size),
        "attn_norm": (c.hidden_size,),
        "ffn_norm": (c.hidden_size,),
    }
    if c.qkv_bias:
        parts.update(q_bias=(q,), k_bias=(kv,), v_bias=(kv,))
    if c.qk_norm:
        parts.update(q_norm=(c.head_dim,), k_norm=(c.head_dim,))
    return parts.get(part)


def load_hf(
    directory: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
) -> tuple[HFConfig, LlamaModel]:
    """An HF model directory (config.json and its safetensors) as a LlamaModel: its config
    read by `llama_config`, its weights by `hf_tensors` (no C kernels: the plain torch path)."""
    hf = llama_config(directory)
    return hf, LlamaModel.from_tensors(hf.config, hf_tensors(directory, hf.config, dtype), device)
