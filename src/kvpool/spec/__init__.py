"""kvpool.spec: frozen model / layer / format specs and presets."""

from kvpool.spec.layout import AttentionKind, CacheSpec, LayerSpec, dtype_bytes

__all__ = ["AttentionKind", "CacheSpec", "LayerSpec", "dtype_bytes"]
