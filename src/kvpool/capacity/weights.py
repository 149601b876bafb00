"""Weight bytes per GPU: parameter counts x storage format, split by tensor parallelism.

Formats (bytes per parameter):
- "bf16": every tensor in BF16 (2 B);
- "fp8": DeepSeek-style block FP8, every linear weight of the layers in E4M3 (1 B) with one
  fp32 scale per 128 x 128 block (4 / 16384 B); embeddings, head, router and norms BF16;
- "mxfp4": gpt-oss, routed-expert matrices in MXFP4 (4-bit values + one E8M0 scale byte per
  32: 0.5 + 1/32 B); everything else BF16 (its `modules_to_not_convert`);
- "fp4+fp8": DeepSeek-V4, FP4 (MXFP4 layout) routed experts, block FP8 for the other linears;
- "fp32": every tensor in fp32 (4 B): kvpool's CPU engine.
"auto" takes the model's own format (its `quantization_config`): "fp8" for the methods fp8,
fbgemm_fp8 (Meta's rowwise FP8) and compressed-tensors with 8-bit float weights (RedHatAI /
neuralmagic FP8), "mxfp4" for mxfp4. Those FP8 checkpoints keep a scale per output row or per
tensor, not per 128 x 128 block: a row of n inputs with an fp32 scale is 4 / n B a weight
where fp8 prices 4 / 16384, under 0.2 % of the weight's bytes for rows of 2,048 or more. A quantization no format
prices (GPTQ / AWQ int4, a module list kept in BF16 past the head, embeddings and router) is
the model's "unknown" format: "auto" refuses it, naming why; a named weight_dtype prices it.

Tensor parallelism shards embeddings (vocab-parallel), the head, attention projections, the
dense MLP and the experts by the TP size. Kept whole on every rank: norms, biases, router,
MLA's q_a / kv_a projections, and GQA K/V projections past one head per rank (a TP size
above the KV-head count replicates those heads, so their projections repeat too).
With expert parallelism (`ep`), routed experts are split over the EP group instead
(DeepSeek-style serving: data-parallel attention, experts over all GPUs).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from kvpool.capacity.kv import kv_heads_per_gpu
from kvpool.spec.models import ModelSpec, ParamCounts, count_parameters

WEIGHT_DTYPES: tuple[str, ...] = ("auto", "bf16", "fp8", "mxfp4", "fp4+fp8", "fp32")

_FP8_BLOCK = 1 + 4 / (128 * 128)  # E4M3 + an fp32 scale per 128 x 128 block
_MXFP4 = 0.5 + 1 / 32  # 4-bit value + one E8M0 scale byte per 32 values
_BF16 = 2.0
# formats that quantize only routed experts -> the format of every other linear
_EXPERTS_ONLY = {"mxfp4": "bf16", "fp4+fp8": "fp8"}


@dataclass(frozen=True)
class WeightBytes:
    params: ParamCounts
    weight_dtype: str
    total_bytes: float  # the whole model, one copy
    per_gpu_bytes: float  # one TP rank
    tp: int
    ep: int | None = None


def _bytes_per_param(weight_dtype: str) -> dict[str, float]:
    """Bytes per parameter for each ParamCounts category."""
    if weight_dtype == "fp32":
        return {f.name: 4.0 for f in fields(ParamCounts)}
    linear = {"bf16": _BF16, "fp8": _FP8_BLOCK, "mxfp4": _BF16, "fp4+fp8": _FP8_BLOCK}[weight_dtype]
    experts = {"bf16": _BF16, "fp8": _FP8_BLOCK, "mxfp4": _MXFP4, "fp4+fp8": _MXFP4}[weight_dtype]
    return {
        "embedding": _BF16,
        "lm_head": _BF16,
        "attention": linear,
        "attention_replicated": linear,
        "mlp": linear,
        "experts": experts,
        "expert_biases": _BF16,
        "router": _BF16,
        "norms": _BF16,
    }


def weight_bytes(model: ModelSpec, tp: int = 1, weight_dtype: str = "auto", ep: int | None = None) -> WeightBytes:
    """Weight bytes of `model`; with `ep`, routed experts are split over `ep` GPUs (expert
    parallelism) instead of over the TP group."""
    if ep is not None and ep <= 0:
        raise ValueError(f"ep must be positive, got {ep}")
    if weight_dtype not in WEIGHT_DTYPES:
        raise ValueError(f"unknown weight dtype {weight_dtype!r}; known: {list(WEIGHT_DTYPES)}")
    if tp <= 0:
        raise ValueError(f"tp must be positive, got {tp}")
    if model.num_heads % tp:
        raise ValueError(f"{model.name}: num_attention_heads={model.num_heads} is not divisible by tp={tp}")
    fmt = model.weight_format if weight_dtype == "auto" else weight_dtype
    if fmt == "unknown":
        raise ValueError(
            f"{model.name}: {model.weight_format_error}; name a weight dtype to price its weights "
            f"(--weight-dtype {', '.join(WEIGHT_DTYPES[1:])})"
        )
    if fmt in _EXPERTS_ONLY and model.moe is None:
        # The format quantizes routed experts alone: a dense model came out at the bytes of the
        # rest's format under the 4-bit name (llama-3.1-8b "mxfp4": 14.96 GiB, its BF16 size).
        rest = _EXPERTS_ONLY[fmt]
        if weight_dtype != "auto":
            raise ValueError(
                f"{model.name}: --weight-dtype {fmt} puts only routed experts in FP4 (the rest in {rest}), and "
                f"{model.name} has none: every weight would be priced in {rest}; name --weight-dtype {rest} for that"
            )
        raise ValueError(
            f"{model.name}: quantization_config.quant_method {fmt!r} on a model without routed experts is not one "
            f"kvpool prices (its {fmt} puts only experts in FP4); name a weight dtype to price its weights "
            "(--weight-dtype bf16, fp8 or fp32)"
        )
    params = count_parameters(model)
    per_param = _bytes_per_param(fmt)
    sharded = {"embedding", "lm_head", "attention", "mlp", "experts", "expert_biases"}
    total = per_gpu = 0.0
    # Under expert parallelism the fullest GPU holds ceil(E / ep) whole experts (engines give
    # the remainder to the first ranks); E / ep undercounted it where ep does not divide E
    # (gpt-oss-120b's 128 over 3 GPUs: 42.67 where a GPU holds 43, and 256 over 512 half an expert).
    num_experts = model.moe.num_experts if model.moe is not None else 1
    expert_share = -(-num_experts // ep) / num_experts if ep is not None else 0.0
    for category, bytes_per in per_param.items():
        n = getattr(params, category)
        total += n * bytes_per
        if category in ("experts", "expert_biases") and ep is not None:
            per_gpu += n * bytes_per * expert_share
        else:
            per_gpu += n * bytes_per / tp if category in sharded else n * bytes_per
    if model.attention == "gqa" and tp > 1:
        # K and V projections: a rank holds kv_heads_per_gpu heads, not num_kv_heads / tp.
        kv_proj = 2 * model.num_layers * model.hidden_size * model.head_dim
        exact = kv_proj * kv_heads_per_gpu(model.num_kv_heads, tp)
        even_split = kv_proj * model.num_kv_heads / tp
        per_gpu += (exact - even_split) * per_param["attention"]
    return WeightBytes(params, fmt, total, per_gpu, tp, ep)
