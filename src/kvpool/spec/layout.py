"""Frozen specs of a model's KV-cache layout; every derived size is computed here, once.

A layer's cache is described by its attention kind and geometry. Bytes per token and per
block follow seed 003's capacity model, m_token = 2 * L * H_kv * d_h * s for K and V, with
the per-kind variants (MLA stores one latent, sliding-window layers are bounded by the
window). Later layers (capacity, dsv4) extend these specs; they never re-derive the sizes.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class AttentionKind(enum.Enum):
    FULL = "full"  # MHA / GQA / MQA: K and V per KV head
    SLIDING_WINDOW = "sliding"  # like FULL, but only the last `window` tokens are kept
    MLA = "mla"  # one latent (kv_lora_rank + rope dims) per token, K = V source


# bytes per element of the storage dtypes kvpool knows
DTYPE_BYTES: dict[str, float] = {
    "float64": 8,
    "fp64": 8,
    "float32": 4,
    "fp32": 4,
    "bfloat16": 2,
    "bf16": 2,
    "float16": 2,
    "fp16": 2,
    "fp8": 1,
    "float8_e4m3fn": 1,
    "int8": 1,
    "fp4": 0.5,
}


def dtype_bytes(dtype: str) -> float:
    try:
        return DTYPE_BYTES[dtype]
    except KeyError:
        raise ValueError(f"unknown storage dtype {dtype!r}; known: {', '.join(sorted(DTYPE_BYTES))}") from None


@dataclass(frozen=True)
class LayerSpec:
    """One attention layer's cache geometry.

    FULL / SLIDING_WINDOW: `num_kv_heads` x `head_dim` for K and again for V.
    MLA: one latent of `head_dim` elements per token (kv_lora_rank + rope dims), no V copy.
    """

    kind: AttentionKind
    num_kv_heads: int
    head_dim: int
    dtype: str = "bfloat16"
    window: int | None = None  # SLIDING_WINDOW only

    def __post_init__(self) -> None:
        if self.num_kv_heads <= 0:
            raise ValueError(f"num_kv_heads must be positive, got {self.num_kv_heads}")
        if self.head_dim <= 0:
            raise ValueError(f"head_dim must be positive, got {self.head_dim}")
        dtype_bytes(self.dtype)
        if self.kind is AttentionKind.SLIDING_WINDOW:
            if self.window is None or self.window <= 0:
                raise ValueError(f"a sliding-window layer needs a positive window, got {self.window}")
        elif self.window is not None:
            raise ValueError(f"window={self.window} is only valid for sliding-window layers")

    @property
    def bytes_per_token(self) -> float:
        """Bytes one cached token costs in this layer."""
        num_vectors = 1 if self.kind is AttentionKind.MLA else 2  # MLA: one latent; else K and V
        return num_vectors * self.num_kv_heads * self.head_dim * dtype_bytes(self.dtype)

    def cached_tokens(self, context_len: int) -> int:
        """Tokens this layer keeps for a sequence of `context_len` tokens."""
        if self.kind is AttentionKind.SLIDING_WINDOW:
            assert self.window is not None
            return min(context_len, self.window)
        return context_len


@dataclass(frozen=True)
class CacheSpec:
    """A model's whole KV-cache layout: one LayerSpec per layer, one block size."""

    name: str
    layers: tuple[LayerSpec, ...]
    block_size: int = 16

    def __post_init__(self) -> None:
        if not self.layers:
            raise ValueError(f"cache spec {self.name!r} has no layers")
        if self.block_size <= 0:
            raise ValueError(f"block_size must be positive, got {self.block_size}")

    @classmethod
    def uniform(
        cls,
        name: str,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: str = "bfloat16",
        kind: AttentionKind = AttentionKind.FULL,
        block_size: int = 16,
    ) -> CacheSpec:
        if num_layers <= 0:
            raise ValueError(f"num_layers must be positive, got {num_layers}")
        layer = LayerSpec(kind, num_kv_heads, head_dim, dtype)
        return cls(name, (layer,) * num_layers, block_size)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def bytes_per_token(self) -> float:
        """Bytes per cached token summed over all layers (window layers count while not full)."""
        return sum(layer.bytes_per_token for layer in self.layers)

    @property
    def bytes_per_block(self) -> float:
        return self.bytes_per_token * self.block_size

    def bytes_at_context(self, context_len: int) -> float:
        """KV bytes one sequence of `context_len` tokens holds, window layers bounded."""
        if context_len < 0:
            raise ValueError(f"context_len must be >= 0, got {context_len}")
        return sum(layer.bytes_per_token * layer.cached_tokens(context_len) for layer in self.layers)
