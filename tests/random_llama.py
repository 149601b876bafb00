"""A small Llama with seeded random weights (no GGUF needed), for tests of the engine's
storage paths on any device and in any dtype."""

from __future__ import annotations

import random

import torch

from kvpool.cache import CacheDescriptor
from kvpool.models.gguf import LlamaConfig
from kvpool.models.llama import LlamaModel

CONFIG = LlamaConfig(
    num_layers=4,
    hidden_size=128,
    intermediate_size=256,
    num_heads=4,
    num_kv_heads=2,
    head_dim=32,
    rope_theta=10000.0,
    rms_norm_eps=1e-5,
    vocab_size=512,
    max_position=2048,
    tie_embeddings=True,
)
DESCRIPTOR = CacheDescriptor("random-llama", weights_version="seed0", layout_id="L4:kvh2:d32:bs16:fp64")
# a tiny Hugging Face config.json of a Llama (transformers' field names), for the tests that
# compare a model built from a config with transformers'; and Llama 3's RoPE scaling at a
# small original context, so that positions of a few hundred cross all three bands
TINY_HF_LLAMA = {
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 160,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 300,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
}
LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


def random_llama(
    device: str = "cpu", dtype: torch.dtype = torch.float64, seed: int = 0, config: LlamaConfig = CONFIG
) -> LlamaModel:
    """`config`'s Llama (CONFIG's by default) with seeded random fp64 weights, in `dtype`: an
    untied head is drawn after the final norm, before the layers."""
    g = torch.Generator().manual_seed(seed)
    c = config
    kv = c.num_kv_heads * c.head_dim
    shapes = {
        "q": (c.num_heads * c.head_dim, c.hidden_size),
        "k": (kv, c.hidden_size),
        "v": (kv, c.hidden_size),
        "o": (c.hidden_size, c.num_heads * c.head_dim),
        "gate": (c.intermediate_size, c.hidden_size),
        "up": (c.intermediate_size, c.hidden_size),
        "down": (c.hidden_size, c.intermediate_size),
    }

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    tensors = [("embed", randn(c.vocab_size, c.hidden_size)), ("norm", 1 + 0.1 * randn(c.hidden_size))]
    if not c.tie_embeddings:
        tensors.append(("lm_head", randn(c.vocab_size, c.hidden_size) / c.hidden_size**0.5))
    for i in range(c.num_layers):
        for part, shape in shapes.items():
            tensors.append((f"layers.{i}.{part}", randn(*shape) / shape[1] ** 0.5))
        for part in ("attn_norm", "ffn_norm"):
            tensors.append((f"layers.{i}.{part}", 1 + 0.1 * randn(c.hidden_size)))
    return LlamaModel.from_tensors(c, [(n, t.to(dtype)) for n, t in tensors], device)


def random_ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(CONFIG.vocab_size) for _ in range(n)]
