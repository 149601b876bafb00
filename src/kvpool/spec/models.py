"""Model specs for capacity planning, read from Hugging Face config.json files.

A `ModelSpec` holds what the capacity model needs from a config: the attention family and
cache geometry (GQA / MHA / MQA with optional sliding-window layers, MLA latents with an
optional V3.2 indexer, or a DeepSeek-V4 `DSV4Spec`), and the shapes that fix the weight
bytes. Presets are the facts of public config.json files, stored as JSON under
`kvpool/presets/`; `--config PATH` reads any config.json the same way.

Parameter counts (`count_parameters`) are computed from the config, tensor by tensor, the
way the Hugging Face / reference implementations build the model (no checkpoint needed):
- embedding: vocab x hidden; lm_head: vocab x hidden unless `tie_word_embeddings`;
- attention per layer: GQA q (hidden x heads*head_dim), k and v (hidden x kv_heads*head_dim),
  o (heads*head_dim x hidden), biases where the config asks (`attention_bias`; Qwen2 has
  q/k/v biases only), q/k RMSNorms (Qwen3, Gemma 3), attention sinks (gpt-oss: one per
  head). MLA: q_a (hidden x q_lora_rank) + q_a_norm + q_b (q_lora_rank x heads*(nope+rope)),
  kv_a (hidden x (kv_lora_rank+rope)) + kv_a_norm + kv_b (kv_lora_rank x heads*(nope+v)),
  o (heads*v x hidden); V3.2 adds the indexer (wq_b, wk, k_norm, weights_proj). q_a,
  kv_a and the indexer are counted as `attention_replicated`: tensor-parallel engines keep
  them whole (V4's wq_a, wkv, compressors and indexer likewise);
- MLP: gated (gate, up, down) 3 x hidden x intermediate; MoE layers hold routed experts
  (3 x hidden x moe_intermediate each, gpt-oss with biases), shared experts and a router
  (experts x hidden, plus bias / correction bias);
- norms: 2 RMSNorms of `hidden` per layer (4 for Gemma 2/3) and the final norm.
MTP (next-token-prediction) layers are not counted: an engine loads them only for
speculative decoding. DeepSeek-V4 counts the attention tensors of DEEPSEEK_V4.md (wq_a,
q_norm, wq_b, wkv, kv_norm, wo_a, wo_b, attn_sink, compressors, indexer) plus the MoE facts
of its config (`_DSV4_MOE_FACTS` when the shipped preset lacks them); the hyper-connection
(mHC) mixers and hash-routing tables are small and not counted. The sums land on the
published totals: Llama-3.1-8B 8.03 B, 70B 70.6 B, DeepSeek-V3 671 B, gpt-oss-120b 116.8 B,
V4-Flash 284 B (tests compare several against transformers' own modules on the meta device).
"""

from __future__ import annotations

import difflib
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from kvpool.spec import dsv4 as dsv4_spec
from kvpool.spec.dsv4 import CSA_RATIO, DSV4Spec
from kvpool.spec.hf_defaults import HEAD_DIM_DEFAULTS, KV_HEADS_DEFAULTS, KV_HEADS_NULL


@dataclass(frozen=True)
class MLAGeometry:
    """DeepSeek multi-head latent attention: one cached latent of kv_lora_rank + rope dims."""

    kv_lora_rank: int
    qk_rope_head_dim: int
    qk_nope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None  # None: a plain q projection (DeepSeek-V2-Lite)


@dataclass(frozen=True)
class IndexerGeometry:
    """DeepSeek-V3.2's Lightning Indexer: one cached key of `head_dim` per token."""

    num_heads: int
    head_dim: int
    topk: int


@dataclass(frozen=True)
class MoEGeometry:
    num_experts: int
    num_shared_experts: int
    expert_intermediate_size: int
    experts_per_token: int
    moe_layers: tuple[int, ...]  # indices of the layers whose MLP is MoE
    expert_bias: bool = False  # gpt-oss experts carry biases
    router_bias: bool = False  # a router bias / e_score_correction_bias of num_experts


def _checked_moe(moe: MoEGeometry, model_type: str, experts_key: str, top_k_key: str) -> MoEGeometry:
    """`moe`, when a token's experts are among the routed ones: num_experts_per_tok 1000 of
    256 was planned (fused-MoE buffers for 1,000 experts a token: "does not fit")."""
    if moe.experts_per_token > moe.num_experts:
        raise ValueError(
            f"{model_type} config: {top_k_key}={moe.experts_per_token} is more than the "
            f"{experts_key}={moe.num_experts} experts a token is routed among"
        )
    return moe


def _deepseek_moe(
    src: dict[str, Any], model_type: str, moe_layers: tuple[int, ...], *, router_bias: bool = False
) -> MoEGeometry:
    """The routed experts of a DeepSeek-style config (`n_routed_experts`, `n_shared_experts`,
    `moe_intermediate_size`, `num_experts_per_tok`) over `moe_layers`, checked."""
    return _checked_moe(
        MoEGeometry(
            num_experts=_positive(src, "n_routed_experts", model_type),
            num_shared_experts=_non_negative(src, "n_shared_experts", model_type, 0),
            expert_intermediate_size=_positive(src, "moe_intermediate_size", model_type),
            experts_per_token=_positive(src, "num_experts_per_tok", model_type),
            moe_layers=moe_layers,
            router_bias=router_bias,
        ),
        model_type,
        "n_routed_experts",
        "num_experts_per_tok",
    )


@dataclass(frozen=True)
class ModelSpec:
    """What capacity planning needs of one model. Build with `from_hf_config`."""

    name: str
    model_type: str
    attention: str  # "gqa" (MHA / GQA / MQA, maybe windowed) | "mla" | "dsv4"
    num_layers: int
    hidden_size: int
    vocab_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    layer_windows: tuple[int | None, ...]  # per layer: sliding window, or None for full
    intermediate_size: int
    tie_word_embeddings: bool
    max_position_embeddings: int
    weight_format: str  # "bf16" | "fp8" (128x128 block scales) | "mxfp4" (experts) | "fp4+fp8" (V4) | "unknown"
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False
    norms_per_layer: int = 2
    attention_sinks: bool = False
    mla: MLAGeometry | None = None
    indexer: IndexerGeometry | None = None
    moe: MoEGeometry | None = None
    dsv4: DSV4Spec | None = None
    # why weight_format is "unknown" (a quantization kvpool cannot price): the refusal that
    # pricing the weights in the model's own format gives
    weight_format_error: str | None = None

    def __post_init__(self) -> None:
        if self.attention not in ("gqa", "mla", "dsv4"):
            raise ValueError(f"attention must be 'gqa', 'mla' or 'dsv4', got {self.attention!r}")
        for field in ("num_layers", "hidden_size", "vocab_size", "num_heads", "num_kv_heads", "head_dim"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{self.name}: {field} must be a positive integer, got {value!r}")
        if len(self.layer_windows) != self.num_layers:
            raise ValueError(f"{self.name}: {len(self.layer_windows)} layer windows for {self.num_layers} layers")
        if self.attention == "gqa" and self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"{self.name}: num_attention_heads={self.num_heads} is not a multiple of "
                f"num_key_value_heads={self.num_kv_heads}"
            )
        if (self.attention == "mla") != (self.mla is not None):
            raise ValueError(f"{self.name}: MLA geometry is required exactly for attention='mla'")
        if (self.attention == "dsv4") != (self.dsv4 is not None):
            raise ValueError(f"{self.name}: a DSV4Spec is required exactly for attention='dsv4'")
        if (self.weight_format == "unknown") != (self.weight_format_error is not None):
            raise ValueError(f"{self.name}: weight_format_error says why exactly a weight_format is 'unknown'")

    @property
    def is_moe(self) -> bool:
        return self.moe is not None

    @property
    def attention_label(self) -> str:
        """MHA / GQA / MQA (+ sliding), MLA, or DeepSeek-V4 CSA/HCA, for tables."""
        if self.attention == "mla":
            return "MLA + indexer" if self.indexer else "MLA"
        if self.attention == "dsv4":
            return "V4 CSA/HCA"
        if self.num_kv_heads == 1:
            base = "MQA"
        elif self.num_kv_heads == self.num_heads:
            base = "MHA"
        else:
            base = f"GQA-{self.num_kv_heads}"
        windows = {w for w in self.layer_windows if w is not None}
        if windows:
            num_sliding = sum(1 for w in self.layer_windows if w is not None)
            base += f" ({num_sliding}/{self.num_layers} sliding {max(windows)})"
        return base


# ---------------------------------------------------------------------------------------
# Parameter counts
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ParamCounts:
    """Parameters by category; the categories decide sharding and weight format."""

    embedding: int
    lm_head: int
    attention: int  # linear weights sharded by tensor parallelism
    attention_replicated: int  # MLA q_a / kv_a, V4 wq_a / wkv / compressors / indexer: whole on every TP rank
    mlp: int  # dense MLP and shared experts (linear weights)
    experts: int  # routed-expert weight matrices
    expert_biases: int
    router: int
    norms: int  # norms, biases of attention, sinks: small, kept in 16-bit

    @property
    def total(self) -> int:
        return (
            self.embedding
            + self.lm_head
            + self.attention
            + self.attention_replicated
            + self.mlp
            + self.experts
            + self.expert_biases
            + self.router
            + self.norms
        )


def count_parameters(spec: ModelSpec) -> ParamCounts:
    """Parameters of `spec`'s main layers, embeddings and head (MTP layers excluded)."""
    h, L = spec.hidden_size, spec.num_layers
    embedding = spec.vocab_size * h
    lm_head = 0 if spec.tie_word_embeddings else spec.vocab_size * h
    norms = L * spec.norms_per_layer * h + h  # per-layer norms + the final norm
    attention = replicated = 0
    if spec.attention == "gqa":
        q_width, kv_width = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
        attention = L * (h * q_width + 2 * h * kv_width + q_width * h)
        if spec.qkv_bias:
            norms += L * (q_width + 2 * kv_width)
        if spec.o_bias:
            norms += L * h
        if spec.qk_norm:
            norms += L * 2 * spec.head_dim
        if spec.attention_sinks:
            norms += L * spec.num_heads
    elif spec.attention == "mla":
        attention, replicated, extra_norms = _mla_attention_params(spec)
        norms += extra_norms
    else:
        assert spec.dsv4 is not None
        attention, replicated, extra_norms = _dsv4_attention_params(spec.dsv4)
        norms += extra_norms
    mlp = experts = expert_biases = router = 0
    moe_layers = set(spec.moe.moe_layers) if spec.moe else set()
    for layer_id in range(L):
        if layer_id not in moe_layers:
            mlp += 3 * h * spec.intermediate_size
            continue
        assert spec.moe is not None
        moe = spec.moe
        per_expert = 3 * h * moe.expert_intermediate_size
        experts += moe.num_experts * per_expert
        mlp += moe.num_shared_experts * per_expert
        if moe.expert_bias:  # gate_up bias 2I + down bias h
            expert_biases += moe.num_experts * (2 * moe.expert_intermediate_size + h)
        router += moe.num_experts * h + (moe.num_experts if moe.router_bias else 0)
    return ParamCounts(embedding, lm_head, attention, replicated, mlp, experts, expert_biases, router, norms)


def _mla_attention_params(spec: ModelSpec) -> tuple[int, int, int]:
    """(TP-sharded linears, replicated linears, norms) of all MLA layers (+ V3.2 indexer)."""
    mla, h, H = spec.mla, spec.hidden_size, spec.num_heads
    assert mla is not None
    qk_head = mla.qk_nope_head_dim + mla.qk_rope_head_dim
    sharded = H * (mla.qk_nope_head_dim + mla.v_head_dim) * mla.kv_lora_rank  # kv_b
    sharded += H * mla.v_head_dim * h  # o_proj
    replicated = h * (mla.kv_lora_rank + mla.qk_rope_head_dim)  # kv_a_proj_with_mqa
    norms = mla.kv_lora_rank  # kv_a_layernorm
    if mla.q_lora_rank is None:
        sharded += h * H * qk_head
    else:
        replicated += h * mla.q_lora_rank  # q_a_proj
        sharded += mla.q_lora_rank * H * qk_head  # q_b_proj
        norms += mla.q_lora_rank  # q_a_layernorm
    if spec.indexer is not None:
        idx = spec.indexer
        q_in = mla.q_lora_rank if mla.q_lora_rank is not None else h
        replicated += q_in * idx.num_heads * idx.head_dim  # indexer.wq_b
        replicated += h * idx.head_dim + h * idx.num_heads  # indexer.wk, indexer.weights_proj
        norms += 2 * idx.head_dim  # indexer.k_norm (LayerNorm: weight + bias)
    L = spec.num_layers
    return L * sharded, L * replicated, L * norms


def _dsv4_attention_params(v4: DSV4Spec) -> tuple[int, int, int]:
    """(TP-sharded linears, replicated linears, norms + small tensors) of all V4 attention
    layers, by reference name. Sharded: wq_b (by head), wo_a (by output group), wo_b (its
    rows). Replicated, whole on every TP rank as vLLM's V4 builds them (its fused wq_a + wkv,
    the compressors' fused wkv + wgate and the indexer's wq_b and weights_proj are
    replicated linears), as MLA's q_a / kv_a are: each makes one vector a token that every
    head reads (the query latent, the shared K/V, the compressed entry, the index scores)."""
    h, d, H = v4.hidden_size, v4.head_dim, v4.num_heads
    sharded = replicated = small = 0
    for ratio in v4.layer_ratios:
        replicated += h * v4.q_lora_rank + h * d  # wq_a, wkv
        sharded += v4.q_lora_rank * H * d  # wq_b
        sharded += v4.o_groups * (v4.heads_per_group * d) * v4.o_lora_rank  # wo_a (grouped)
        sharded += v4.o_groups * v4.o_lora_rank * h  # wo_b
        small += v4.q_lora_rank + d + H  # q_norm, kv_norm, attn_sink
        if ratio == 0:
            continue
        coff = v4.coff(ratio)
        replicated += 2 * h * coff * d  # compressor.wkv, compressor.wgate
        small += ratio * coff * d + d  # compressor.ape, compressor.norm
        if ratio == CSA_RATIO:
            di = v4.index_head_dim
            replicated += v4.q_lora_rank * v4.index_n_heads * di + h * v4.index_n_heads  # wq_b, weights_proj
            replicated += 2 * h * coff * di  # indexer.compressor.wkv, wgate
            small += ratio * coff * di + di  # indexer.compressor.ape, norm
    return sharded, replicated, small


# ---------------------------------------------------------------------------------------
# Parsing config.json
# ---------------------------------------------------------------------------------------


def _req(cfg: dict[str, Any], key: str, kind: str) -> Any:
    if key not in cfg or cfg[key] is None:
        raise ValueError(f"{kind} config is missing required key {key!r}")
    return cfg[key]


def _positive(cfg: dict[str, Any], key: str, kind: str, default: int | None = None) -> int:
    """cfg[key] (`default` where absent or null; required without one): a JSON integer > 0.
    int() of it took 32.5 heads as 32 and "32" as 32, and 0 heads divided by zero; a
    count or size is an integer in every config.json that transformers writes."""
    value = _req(cfg, key, kind) if default is None else cfg.get(key, default)
    value = default if value is None else value
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{kind} config: {key} must be a positive integer, got {json.dumps(value)}")
    return value


def _non_negative(cfg: dict[str, Any], key: str, kind: str, default: int) -> int:
    """cfg[key] (`default` where absent or null): a JSON integer >= 0, a count that may be
    zero (dense layers before the first MoE one, shared experts, full-attention layers)."""
    value = cfg.get(key)
    if value is None:
        return default
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{kind} config: {key} must be an integer >= 0, got {json.dumps(value)}")
    return value


def _flag(cfg: dict[str, Any], key: str, kind: str, default: bool) -> bool:
    """cfg[key] (`default` where absent or null): a JSON true / false. bool() of it took the
    string "false" as True (a quoted "false" tied the head to the embedding, a silent wrong
    weight figure), and 0 / 1 are not what transformers writes for a flag."""
    value = cfg.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ValueError(f"{kind} config: {key} must be true or false, got {json.dumps(value)}")
    return value


# No model's weights reach this: 1 PiB, ~80 times the HBM of a 72-GPU NVL72 rack (~13.5 TB,
# the largest machine one model is served on), at fp4's half a byte a parameter (the
# smallest weight format kvpool knows). A config whose counts put its weights beyond it is a
# typo or a hostile file: num_hidden_layers 10**12 was a MemoryError (a tuple entry a layer).
MAX_WEIGHT_BYTES = 1 << 50
MIN_WEIGHT_BYTES_PER_PARAM = 0.5


def _check_weights_fit(kind: str, what: str, num_params: int) -> None:
    if num_params * MIN_WEIGHT_BYTES_PER_PARAM > MAX_WEIGHT_BYTES:
        raise ValueError(
            f"{kind} config: {what}: weights of at least {num_params * MIN_WEIGHT_BYTES_PER_PARAM / 2**50:.3g} PiB "
            f"({num_params:.3g} parameters at fp4), more than any machine holds (1 PiB); no model has such counts"
        )


TRANSFORMERS_SLIDING_WINDOW = 4096  # MistralConfig's default (Qwen2's / Qwen3's with use_sliding_window)


def _layer_windows(cfg: dict[str, Any], model_type: str, num_layers: int) -> tuple[int | None, ...]:
    """Per-layer sliding window (None = full attention), from `layer_types` or the family rule."""
    window = cfg.get("sliding_window")
    if "layer_types" in cfg and cfg["layer_types"] is not None:
        types = cfg["layer_types"]
        if not isinstance(types, list):  # len() of a number raised TypeError; a string's counted its letters
            raise ValueError(
                f"{model_type} config: layer_types must be a list of {num_layers} layer kinds, got {json.dumps(types)}"
            )
        if len(types) != num_layers:
            raise ValueError(f"layer_types has {len(types)} entries for num_hidden_layers={num_layers}")
        out: list[int | None] = []
        for i, t in enumerate(types):
            if t == "full_attention":
                out.append(None)
            elif t == "sliding_attention":
                out.append(_positive(cfg, "sliding_window", model_type))
            else:
                raise ValueError(
                    f"layer_types[{i}] = {t!r} is a layer kind kvpool does not understand "
                    "(known: 'full_attention', 'sliding_attention')"
                )
        return tuple(out)
    if model_type == "gemma2":
        # Gemma 2 alternates local (sliding) and global layers, starting with a local one.
        w = _positive(cfg, "sliding_window", model_type)
        return tuple(w if i % 2 == 0 else None for i in range(num_layers))
    if model_type == "gemma3_text":
        w = _positive(cfg, "sliding_window", model_type)
        pattern = _positive(cfg, "sliding_window_pattern", model_type, default=6)  # 5 local : 1 global
        return tuple(w if (i + 1) % pattern else None for i in range(num_layers))
    # a missing sliding_window is the one transformers fills in (Qwen2Config / Qwen3Config with
    # use_sliding_window true, MistralConfig always): those layers slide; an explicit null is full
    # attention (transformers 5.25; it was sized as full attention, as if a key said so)
    defaulted = "sliding_window" not in cfg
    if (
        model_type in ("qwen2", "qwen3")
        and _flag(cfg, "use_sliding_window", model_type, False)
        and (window or defaulted)
    ):
        first = _non_negative(cfg, "max_window_layers", model_type, num_layers)
        window = _positive(cfg, "sliding_window", model_type, default=TRANSFORMERS_SLIDING_WINDOW)
        return tuple(window if i >= first else None for i in range(num_layers))
    if model_type == "mistral" and (window or defaulted):
        return (_positive(cfg, "sliding_window", model_type, default=TRANSFORMERS_SLIDING_WINDOW),) * num_layers
    return (None,) * num_layers


# What a checkpoint may leave unquantized and still be priced as "fp8": kvpool's fp8 keeps
# the embeddings, the head and the MoE router in BF16 anyway (module names, or
# compressed-tensors' "re:" patterns such as "re:.*mlp.gate$").
_BF16_ANYWAY = ("lm_head", "embed_tokens", "gate")
# ... and a multimodal checkpoint's vision side, which kvpool does not price at all (it plans
# the language model: a Gemma 3's text_config)
_NOT_PRICED = ("vision_tower", "multi_modal_projector", "vision_model")


def _unquantized_refusal(method: str, modules: Any, key: str) -> str | None:
    """Why `modules` (a checkpoint's list of unquantized modules) keeps its weights from being
    priced as "fp8", or None when every entry is a module fp8 prices in BF16 anyway."""
    if modules is None:
        return None
    if not isinstance(modules, list) or not all(isinstance(m, str) for m in modules):
        raise ValueError(f"quantization_config.{key} must be a list of module names, got {json.dumps(modules)}")
    # A checkpoint that keeps some linears in BF16 (fbgemm's modules_to_not_convert, as in
    # Meta's Llama-3.1-405B-FP8; which modules it lists was not checked here) would come out
    # light priced as fp8 by the bytes of those linears.
    others = [
        m
        for m in modules
        if not m.removeprefix("re:").removesuffix("$").endswith(_BF16_ANYWAY)
        and not any(part in m for part in _NOT_PRICED)
    ]
    if not others:
        return None
    return (
        f"quantization_config.quant_method {method!r} keeps {len(others)} linear module(s) unquantized "
        f"({key} names {others[0]!r}), which no kvpool weight format prices"
    )


def _compressed_tensors_format(quant: dict[str, Any]) -> tuple[str, str | None]:
    """compressed-tensors (llm-compressor's RedHatAI / neuralmagic releases): `config_groups`
    of {targets, weights: {num_bits, type, strategy, group_size, ...}}; FP8 weights (8-bit
    "float", per channel, per tensor or in blocks) are kvpool's fp8."""
    groups = quant.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise ValueError(
            f"quantization_config.config_groups must be a non-empty JSON object of groups, got {json.dumps(groups)}"
        )
    for name, group in groups.items():
        weights = group.get("weights") if isinstance(group, dict) else None
        if not isinstance(weights, dict):
            raise ValueError(f"quantization_config.config_groups.{name}.weights must be a JSON object")
        bits, kind = weights.get("num_bits"), weights.get("type")
        targets = group.get("targets")
        if targets != ["Linear"]:
            # a group aimed at some layers (["re:.*mlp.*"]) leaves the others in BF16
            return "unknown", (
                f"quantization_config.quant_method 'compressed-tensors' quantizes the targets "
                f"{json.dumps(targets)} (config_groups.{name}), not every Linear, which no kvpool weight format prices"
            )
        if (bits, kind) != (8, "float"):
            group_size = weights.get("group_size")
            grouped = f", group_size {group_size}" if group_size else ""
            return "unknown", (
                f"quantization_config.quant_method 'compressed-tensors' with {bits}-bit {kind!r} weights "
                f"(config_groups.{name}{grouped}) is not one kvpool prices (8-bit 'float' is: fp8)"
            )
    why = _unquantized_refusal("compressed-tensors", quant.get("ignore"), "ignore")
    return ("unknown" if why else "fp8"), why


def _weight_format(cfg: dict[str, Any]) -> tuple[str, str | None]:
    """(kvpool weight format, None), or ("unknown", why) for a quantization kvpool cannot
    price: that refusal waits for the weights to be priced from the config, so that a
    weight dtype the user names (--weight-dtype) still plans the model."""
    quant = cfg.get("quantization_config")
    if quant is None:
        return "bf16", None
    if not isinstance(quant, dict):  # quant.get raised AttributeError on "fp8", true, 1
        raise ValueError(f"quantization_config must be a JSON object, got {json.dumps(quant)}")
    if not quant:
        return "bf16", None
    method = quant.get("quant_method")
    if method == "fp8":
        return "fp8", None
    if method == "mxfp4":
        return "mxfp4", None
    if method == "fbgemm_fp8":
        # Meta's FP8 releases: E4M3 weights with one scale per output row (fbgemm's rowwise).
        why = _unquantized_refusal(method, quant.get("modules_to_not_convert"), "modules_to_not_convert")
        return ("unknown" if why else "fp8"), why
    if method == "compressed-tensors":
        return _compressed_tensors_format(quant)
    if method in ("gptq", "awq"):
        bits, group_size = quant.get("bits"), quant.get("group_size")
        return "unknown", (
            f"quantization_config.quant_method {method!r} ({bits}-bit int weights, group_size {group_size}) "
            "is not one kvpool prices (known: fp8, mxfp4, fbgemm_fp8, compressed-tensors FP8)"
        )
    return "unknown", (
        f"quantization_config.quant_method {method!r} is not one kvpool understands "
        "(known: fp8, mxfp4, fbgemm_fp8, compressed-tensors FP8)"
    )


def _hf_fields(cfg: dict[str, Any], model_type: str) -> dict[str, Any]:
    """The ModelSpec fields that GQA and MLA config.json files spell alike (HF names)."""
    fields = {
        "num_layers": _positive(cfg, "num_hidden_layers", model_type),
        "hidden_size": _positive(cfg, "hidden_size", model_type),
        "num_heads": _positive(cfg, "num_attention_heads", model_type),
        "vocab_size": _positive(cfg, "vocab_size", model_type),
        "intermediate_size": _positive(cfg, "intermediate_size", model_type),
        "max_position_embeddings": _positive(cfg, "max_position_embeddings", model_type),
    }
    fields["weight_format"], fields["weight_format_error"] = _weight_format(cfg)
    # Checked before anything is built a layer at a time. Every layer holds at least one MLP
    # of intermediate_size (a dense one; an MoE layer's experts hold more: gpt-oss's
    # intermediate_size is one expert's, DeepSeek-V3's 256 experts of 2,048 outweigh its 18,432).
    L, h = fields["num_layers"], fields["hidden_size"]
    _check_weights_fit(
        model_type,
        f"num_hidden_layers={L} layers of hidden_size {h} and intermediate_size {fields['intermediate_size']}",
        L * 3 * h * fields["intermediate_size"],
    )
    return fields


def _parse_gqa(cfg: dict[str, Any], name: str, model_type: str) -> ModelSpec:
    common = _hf_fields(cfg, model_type)
    L, h, heads = common["num_layers"], common["hidden_size"], common["num_heads"]
    # absent: the family's default, as transformers builds the attention (a qwen3 of 64 heads was planned
    # with 64 KV heads for its 32); null: num_attention_heads where transformers takes it
    if "num_key_value_heads" in cfg and cfg["num_key_value_heads"] is None and model_type not in KV_HEADS_NULL:
        raise ValueError(
            f"{model_type} config: num_key_value_heads must be a positive integer, got null (leave it out for "
            f"the family's default, {KV_HEADS_DEFAULTS[model_type]})"
        )
    kv_heads = _positive(cfg, "num_key_value_heads", model_type, default=KV_HEADS_DEFAULTS.get(model_type, heads))
    if "num_key_value_heads" in cfg and cfg["num_key_value_heads"] is None:
        kv_heads = heads
    if "num_key_value_heads" not in cfg and heads % kv_heads:  # (ModelSpec's message would not say whose)
        raise ValueError(
            f"{model_type} config: num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads} "
            f"({model_type}'s default: the file has no num_key_value_heads)"
        )
    # absent: transformers' own default, which for these families is a constant, not
    # hidden / heads (Qwen3-32B: 5120 / 64 = 80 for its 128)
    if model_type in HEAD_DIM_DEFAULTS and "head_dim" in cfg and cfg["head_dim"] is None:
        # transformers 5.25's config class of these families refuses null (its field is an
        # int), Llama's / Qwen2's take it for hidden / heads
        raise ValueError(
            f"{model_type} config: head_dim must be a positive integer, got null "
            f"(leave it out for the family's default, {HEAD_DIM_DEFAULTS[model_type]})"
        )
    head_dim = _positive(cfg, "head_dim", model_type, default=HEAD_DIM_DEFAULTS.get(model_type, h // heads))
    gemma = model_type in ("gemma2", "gemma3_text")
    moe = None
    if model_type == "gpt_oss":
        num_experts = _positive(cfg, "num_local_experts", model_type)
        # transformers' name, or the original checkpoint's
        top_k_key = "num_experts_per_tok" if cfg.get("num_experts_per_tok") is not None else "experts_per_token"
        moe = _checked_moe(
            MoEGeometry(
                num_experts=num_experts,
                num_shared_experts=0,
                # gpt-oss experts: gate_up [h, 2I] + down [I, h]; the 3 x h x I count holds.
                expert_intermediate_size=_positive(cfg, "intermediate_size", model_type),
                experts_per_token=_positive(cfg, top_k_key, model_type),
                moe_layers=tuple(range(L)),
                expert_bias=True,
                router_bias=True,
            ),
            model_type,
            "num_local_experts",
            top_k_key,
        )
    bias = _flag(cfg, "attention_bias", model_type, False)
    return ModelSpec(
        name=name,
        model_type=model_type,
        attention="gqa",
        **common,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        layer_windows=_layer_windows(cfg, model_type, L),
        tie_word_embeddings=_flag(cfg, "tie_word_embeddings", model_type, gemma),
        qkv_bias=bias or model_type == "qwen2",
        o_bias=bias,
        qk_norm=model_type in ("qwen3", "gemma3_text"),
        norms_per_layer=4 if gemma else 2,
        attention_sinks=model_type == "gpt_oss",
        moe=moe,
    )


def _parse_mla(cfg: dict[str, Any], name: str, model_type: str) -> ModelSpec:
    common = _hf_fields(cfg, model_type)
    L = common["num_layers"]
    mla = MLAGeometry(
        kv_lora_rank=_positive(cfg, "kv_lora_rank", model_type),
        qk_rope_head_dim=_positive(cfg, "qk_rope_head_dim", model_type),
        qk_nope_head_dim=_positive(cfg, "qk_nope_head_dim", model_type),
        v_head_dim=_positive(cfg, "v_head_dim", model_type),
        q_lora_rank=None if cfg.get("q_lora_rank") is None else _positive(cfg, "q_lora_rank", model_type),
    )
    indexer = None
    if "index_topk" in cfg or model_type == "deepseek_v32":
        indexer = IndexerGeometry(
            num_heads=_positive(cfg, "index_n_heads", model_type),
            head_dim=_positive(cfg, "index_head_dim", model_type),
            topk=_positive(cfg, "index_topk", model_type),
        )
    moe = None
    if cfg.get("n_routed_experts") not in (None, 0):  # (0 or null: a dense model)
        first_dense = _non_negative(cfg, "first_k_dense_replace", model_type, 0)
        freq = _positive(cfg, "moe_layer_freq", model_type, default=1)
        moe = _deepseek_moe(
            cfg,
            model_type,
            tuple(i for i in range(L) if i >= first_dense and i % freq == 0),
            router_bias=cfg.get("topk_method") == "noaux_tc",  # e_score_correction_bias
        )
    return ModelSpec(
        name=name,
        model_type=model_type,
        attention="mla",
        **common,
        num_kv_heads=1,  # one latent per token, shared by all heads
        head_dim=mla.kv_lora_rank + mla.qk_rope_head_dim,
        layer_windows=(None,) * L,
        tie_word_embeddings=_flag(cfg, "tie_word_embeddings", model_type, False),
        mla=mla,
        indexer=indexer,
        moe=moe,
    )


# MoE facts of the V4 config.json files that the shipped V4 presets (which carry only the
# attention / cache keys) do not repeat. Used only for the weights line of the ledger.
_DSV4_MOE_FACTS: dict[str, dict[str, int]] = {
    "deepseek-v4-flash": {
        "n_routed_experts": 256,
        "n_shared_experts": 1,
        "moe_intermediate_size": 2048,
        "num_experts_per_tok": 6,
    },
    "deepseek-v4-pro": {
        "n_routed_experts": 384,
        "n_shared_experts": 1,
        "moe_intermediate_size": 3072,
        "num_experts_per_tok": 6,
    },
}


def _parse_dsv4(cfg: dict[str, Any], name: str, model_type: str) -> ModelSpec:
    v4 = DSV4Spec.from_config(cfg, name=name)
    facts = {**_DSV4_MOE_FACTS.get(name, {}), **{k: cfg[k] for k in _DSV4_MOE_FACTS["deepseek-v4-pro"] if k in cfg}}
    if "n_routed_experts" not in facts:
        # Every V4 layer is MoE; without the expert facts the weights line would be fiction.
        raise ValueError(f"{model_type} config is missing required key 'n_routed_experts'")
    moe = _deepseek_moe(facts, model_type, tuple(range(v4.num_layers)))  # every V4 layer is MoE
    return ModelSpec(
        name=name,
        model_type=model_type,
        attention="dsv4",
        num_layers=v4.num_layers,
        hidden_size=v4.hidden_size,
        vocab_size=_positive(cfg, "vocab_size", model_type),
        num_heads=v4.num_heads,
        num_kv_heads=1,
        head_dim=v4.head_dim,
        layer_windows=(None,) * v4.num_layers,
        intermediate_size=moe.expert_intermediate_size,  # no dense MLP layers in V4
        tie_word_embeddings=_flag(cfg, "tie_word_embeddings", model_type, False),
        max_position_embeddings=v4.max_position_embeddings,
        weight_format="fp4+fp8",  # FP4 routed experts, FP8 (128x128 blocks) elsewhere
        moe=moe,
        dsv4=v4,
    )


# model_type -> parser: a plain dict, the single place that lists what kvpool understands.
_PARSERS: dict[str, Callable[[dict[str, Any], str, str], ModelSpec]] = {
    "llama": _parse_gqa,
    "mistral": _parse_gqa,
    "qwen2": _parse_gqa,
    "qwen3": _parse_gqa,
    "gemma2": _parse_gqa,
    "gemma3_text": _parse_gqa,
    "gpt_oss": _parse_gqa,
    "deepseek_v2": _parse_mla,
    "deepseek_v3": _parse_mla,
    "deepseek_v32": _parse_mla,
    "deepseek_v4": _parse_dsv4,
}

_ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3_text",
    "GptOssForCausalLM": "gpt_oss",
    "DeepseekV2ForCausalLM": "deepseek_v2",
    "DeepseekV3ForCausalLM": "deepseek_v3",
    "DeepseekV32ForCausalLM": "deepseek_v32",
    "DeepseekV4ForCausalLM": "deepseek_v4",
}

KNOWN_MODEL_TYPES: tuple[str, ...] = tuple(sorted(_PARSERS))


# transformers' Gemma3TextConfig defaults for the keys that shape the plan (checked against
# transformers 5.25's Gemma3TextConfig()); head_dim's is HEAD_DIM_DEFAULTS'.
_GEMMA3_TEXT_DEFAULTS: dict[str, int] = {
    "vocab_size": 262_208,
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "num_hidden_layers": 26,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "max_position_embeddings": 131_072,
    "sliding_window": 4096,
}


def from_hf_config(cfg: dict[str, Any], name: str | None = None) -> ModelSpec:
    """A ModelSpec from a config.json dict.

    ValueError naming the key when a required key is missing, and naming the model kind
    when `model_type` / `architectures` is one kvpool does not understand.
    """
    if not isinstance(cfg, dict):
        raise ValueError(f"a config must be a JSON object, got {type(cfg).__name__}")
    if cfg.get("model_type") == "gemma3" and not isinstance(cfg.get("text_config"), dict):
        # it fell through to "unknown model kind: model_type 'gemma3'", a kind kvpool reads
        raise ValueError(
            f"gemma3 config: text_config must be a JSON object (the language model's facts), "
            f"got {json.dumps(cfg.get('text_config'))}"
        )
    if cfg.get("model_type") == "gemma3":
        # Multimodal Gemma 3: the language model's facts live in text_config, which names
        # only what differs from Gemma3TextConfig's defaults (google/gemma-3-4b-it's gives no
        # heads, the 27B's no vocab_size); the weights' format is said at the top level.
        top = {k: cfg[k] for k in ("quantization_config",) if k in cfg}
        cfg = {"model_type": "gemma3_text", **_GEMMA3_TEXT_DEFAULTS, **top, **cfg["text_config"]}
    model_type = cfg.get("model_type")
    architectures = cfg.get("architectures") or []
    # a list or object here hashed (TypeError), a number iterated (TypeError): name the key
    if model_type is not None and not isinstance(model_type, str):
        raise ValueError(f"config: model_type must be a string, got {json.dumps(model_type)}")
    if not isinstance(architectures, list) or not all(isinstance(a, str) for a in architectures):
        raise ValueError(f"config: architectures must be a list of strings, got {json.dumps(architectures)}")
    if model_type is None:
        known = [_ARCHITECTURES[a] for a in architectures if a in _ARCHITECTURES]
        if not known:
            raise ValueError(
                "config is missing required key 'model_type' and names no architecture kvpool knows "
                f"(architectures={architectures}); known model types: {', '.join(KNOWN_MODEL_TYPES)}"
            )
        model_type = known[0]
    if model_type not in _PARSERS:
        raise ValueError(
            f"unknown model kind: model_type {model_type!r} (architectures={architectures}) is not one kvpool "
            f"understands; known model types: {', '.join(KNOWN_MODEL_TYPES)}"
        )
    spec = _PARSERS[model_type](cfg, name or str(cfg.get("_name_or_path") or model_type), model_type)
    # every count now, experts and vocabulary included (n_routed_experts 10**15 gave 2.5e24
    # parameters), named by the category that holds most of them
    counts = count_parameters(spec)
    largest = max(_COUNT_FIELDS, key=lambda category: getattr(counts, category))
    _check_weights_fit(model_type, f"its {largest} ({_COUNT_FIELDS[largest]})", counts.total)
    return spec


# ParamCounts' categories -> the config.json keys that size them (for the error above)
_COUNT_FIELDS = {
    "embedding": "vocab_size x hidden_size",
    "lm_head": "vocab_size x hidden_size",
    "attention": "num_attention_heads, head_dim, num_key_value_heads",
    "attention_replicated": "q_lora_rank, kv_lora_rank",
    "mlp": "intermediate_size, n_shared_experts",
    "experts": "n_routed_experts / num_local_experts x moe_intermediate_size",
    "expert_biases": "num_local_experts",
    "router": "n_routed_experts / num_local_experts",
    "norms": "num_hidden_layers x hidden_size",
}


# ---------------------------------------------------------------------------------------
# Presets and files
# ---------------------------------------------------------------------------------------

PRESET_NAMES: tuple[str, ...] = (
    "smollm2-135m",
    "llama-3.1-8b",
    "llama-3.1-70b",
    "qwen3-8b",
    "qwen3-32b",
    "gemma-2-9b",
    "gpt-oss-120b",
    "deepseek-v3",
    "deepseek-v3.2",
) + dsv4_spec.PRESET_NAMES


def load_preset_config(name: str) -> dict[str, Any]:
    key = name.lower()
    if key not in PRESET_NAMES:
        raise ValueError(f"unknown model preset {name!r}; known: {', '.join(PRESET_NAMES)}")
    if key in dsv4_spec.PRESET_NAMES:
        return dsv4_spec.load_preset_config(key)
    text = resources.files("kvpool").joinpath("presets", f"{key}.json").read_text(encoding="utf-8")
    return json.loads(text)


def load_preset(name: str) -> ModelSpec:
    """The ModelSpec of a shipped preset (case-insensitive name, e.g. "Llama-3.1-8B")."""
    return from_hf_config(load_preset_config(name), name=name.lower())


_MAX_CONFIG_BYTES = 64 << 20  # the largest config.json files (label maps) are a few MB


def load_config_file(path: str | Path) -> ModelSpec:
    """A ModelSpec from a config.json on disk; the file's parent folder names the model."""
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    try:
        # At most _MAX_CONFIG_BYTES: a weights shard named by mistake was read whole into
        # memory (gigabytes) before the JSON error. A bounded read, not a stat, so that a
        # pipe (/dev/stdin) still works.
        with path.open("rb") as f:
            data = f.read(_MAX_CONFIG_BYTES + 1)
            if len(data) > _MAX_CONFIG_BYTES:
                # a device or a pipe has no size to tell (/dev/zero read "is 0 bytes (over 64 MiB)")
                size = path.stat().st_size
                told = f"{size:,} bytes (over {_MAX_CONFIG_BYTES >> 20} MiB)" if size > _MAX_CONFIG_BYTES else None
                raise ValueError(
                    f"config file {str(path)!r} is {told or f'over {_MAX_CONFIG_BYTES >> 20} MiB'}: "
                    "a config.json is a few KB; is this a weights file?"
                )
        cfg = json.loads(data.decode("utf-8"))
    except FileNotFoundError:
        raise ValueError(f"config file {str(path)!r} does not exist") from None
    except OSError as e:  # a folder named config.json, no permission: the file's role named
        raise ValueError(f"config file {str(path)!r} cannot be read: {e.strerror or e}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"config file {str(path)!r} is not valid JSON: {e}") from None
    except UnicodeDecodeError as e:  # (a ValueError, whose own words name no file)
        raise ValueError(f"config file {str(path)!r} is not UTF-8 text ({e.reason} at byte {e.start})") from None
    default_name = path.parent.name if path.name == "config.json" and path.parent.name else path.stem
    name = str(cfg.get("_name_or_path") or default_name) if isinstance(cfg, dict) else default_name
    return from_hf_config(cfg, name=name)


def model_by_name(name: str) -> ModelSpec:
    """The ModelSpec of a --model of plan / simulate: a preset (any case) or a config.json
    (or the folder holding one); ValueError naming the presets otherwise."""
    if name.lower() in PRESET_NAMES:
        return load_preset(name)
    if Path(name).exists():
        return load_config_file(name)
    if name.lower().endswith(".json"):  # a file meant, not a preset: "not a config.json path" misled
        raise ValueError(f"--model: config file {name!r} does not exist")
    raise ValueError(
        f"--model: unknown model {name!r}{_preset_hint(name)}: no config.json or folder of that name, and an "
        f"unknown model preset (nothing is downloaded; presets: {', '.join(PRESET_NAMES)})"
    )


def _preset_hint(name: str) -> str:
    """ " (did you mean llama-3.1-8b?)" for a --model close to a preset: a Hugging Face id
    ("meta-llama/Llama-3.1-8B-Instruct": a preset and a suffix) or a typo ("llama3.1-8b")."""
    base = name.lower().rstrip("/").rsplit("/", 1)[-1]
    longest_first = sorted(PRESET_NAMES, key=len, reverse=True)
    near = [p for p in longest_first if base == p or base.startswith(p + "-")][:1]
    # a typo keeps the model's numbers: llama-2-7b is no misspelt llama-3.1-70b
    same_numbers = [p for p in PRESET_NAMES if re.findall(r"\d+", p) == re.findall(r"\d+", base)]
    near = near or difflib.get_close_matches(base, same_numbers, n=1, cutoff=0.75)
    return f" (did you mean {near[0]}?)" if near else ""
