"""Defaults of transformers' config classes that kvpool reads a config.json with: the planner
(spec/models.py) and the engine's HF loader (models/hf_config.py) take them from here, one table
(importing spec/models.py for it cost the engine's loader ~150 ms)."""

from __future__ import annotations

# head_dim of transformers' config classes where config.json leaves it out (Qwen3Config,
# Gemma2Config, Gemma3TextConfig, GptOssConfig): a constant, not hidden / heads (Qwen3-32B:
# 5120 / 64 = 80 for its 128); the other families derive hidden / heads.
HEAD_DIM_DEFAULTS: dict[str, int] = {"qwen3": 128, "gemma2": 256, "gemma3_text": 256, "gpt_oss": 64}
# num_key_value_heads of those config classes where config.json leaves it out: a constant, not
# num_attention_heads (LlamaConfig's); null is num_attention_heads for the families in KV_HEADS_NULL
# (the others' int field refuses it)
KV_HEADS_DEFAULTS: dict[str, int] = {
    "qwen2": 32,
    "qwen3": 32,
    "mistral": 8,
    "gemma2": 4,
    "gemma3_text": 4,
    "gpt_oss": 8,
}
KV_HEADS_NULL = ("llama", "qwen2", "qwen3")
