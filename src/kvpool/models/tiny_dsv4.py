"""A tiny DeepSeek-V4-architecture model with seeded random weights, for exact CPU checks.

Attention is exact V4 attention (DEEPSEEK_V4.md §2-4): low-rank query with per-head RMSNorm,
one shared K = V vector per token, the SWA window, the overlapping CSA compressor with the
Lightning Indexer's stable top-k, the HCA compressor, the attention sink, inverse RoPE and
the grouped output projection; RoPE / YaRN exactly as in the real model, scaled-down dims.
The layer pattern is Flash's: SWA-only layers first, then CSA / HCA alternating, ending
with CSA, plus the trailing MTP entry (an SWA-only MTP block that this model does not run).

NOT the real model outside attention: each block's MoE and hyper-connections are replaced
by a plain SwiGLU MLP (`ffn.w1/w2/w3`) with a residual, and there is no MTP head:
`h = h + attn(attn_norm(h)); h = h + ffn(ffn_norm(h))`. Parameter names follow the
official checkpoint (`embed`, `layers.{i}.attn.wq_a`, ..., `norm`, `head`).

Two forwards over the same weights:
- `reference_logits`: the contiguous oracle, the whole token history, no cache;
- `forward_paged`: a batch of chunks on the Classical + State pools (`DSV4Pools`).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from kvpool.attention.dsv4_ops import DSV4AttnWeights, init_attn_state_dict, rms_norm
from kvpool.attention.dsv4_paged import ChunkPlan, paged_attention
from kvpool.attention.dsv4_reference import reference_attention
from kvpool.spec.dsv4 import DSV4Spec
from kvpool.storage.dsv4 import DSV4Pools

# config.json of the tiny model: real m = 4, m' = 128, n_win = 128; small widths.
TINY_DSV4_CONFIG: dict[str, Any] = {
    "name": "tiny-dsv4",
    "model_type": "deepseek_v4",
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 5,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 32,
    "qk_rope_head_dim": 8,
    "q_lora_rank": 32,
    "o_groups": 2,
    "o_lora_rank": 16,
    "sliding_window": 128,
    "index_n_heads": 2,
    "index_head_dim": 16,
    "index_topk": 8,
    "rope_theta": 10000,
    "compress_rope_theta": 160000,
    "rope_scaling": {
        "type": "yarn",
        "factor": 16,
        "original_max_position_embeddings": 65536,
        "beta_fast": 32,
        "beta_slow": 1,
    },
    "max_position_embeddings": 1048576,
    "rms_norm_eps": 1e-6,
    "num_nextn_predict_layers": 1,
    "compress_ratios": [0, 0, 4, 128, 4, 0],
}

# The small config of the recompute test: m' = 16, n_win = 16, 4 layers.
SMALL_DSV4_CONFIG: dict[str, Any] = {
    **TINY_DSV4_CONFIG,
    "name": "tiny-dsv4-small",
    "num_hidden_layers": 4,
    "sliding_window": 16,
    "compress_ratios": [0, 4, 16, 4, 0],
}


class TinyDSV4:
    """Seeded random V4-architecture model. `state_dict` uses the official names."""

    def __init__(self, config: dict[str, Any] | None = None, seed: int = 0) -> None:
        cfg = dict(TINY_DSV4_CONFIG if config is None else config)
        self.config = cfg
        self.spec = DSV4Spec.from_config(cfg, name=cfg.get("name", "tiny-dsv4"))
        if self.spec.vocab_size is None:
            raise ValueError("the tiny model's config needs vocab_size")
        self.vocab_size: int = self.spec.vocab_size
        self.intermediate_size: int = int(cfg.get("intermediate_size", 2 * self.spec.hidden_size))
        self.seed = seed
        self.state_dict = self._init_weights(seed)
        self.attn = [
            DSV4AttnWeights.from_state_dict(self.state_dict, f"layers.{i}.attn.", ratio)
            for i, ratio in enumerate(self.spec.layer_ratios)
        ]

    def _init_weights(self, seed: int) -> dict[str, Tensor]:
        gen = torch.Generator().manual_seed(seed)
        spec, hid, inter = self.spec, self.spec.hidden_size, self.intermediate_size
        sd: dict[str, Tensor] = {"embed.weight": torch.randn(self.vocab_size, hid, generator=gen)}
        for i in range(spec.num_layers):
            sd.update(init_attn_state_dict(spec, i, f"layers.{i}.attn.", gen))
            sd[f"layers.{i}.attn_norm.weight"] = 1.0 + 0.1 * torch.randn(hid, generator=gen)
            sd[f"layers.{i}.ffn_norm.weight"] = 1.0 + 0.1 * torch.randn(hid, generator=gen)
            sd[f"layers.{i}.ffn.w1.weight"] = torch.randn(inter, hid, generator=gen) / math.sqrt(hid)
            sd[f"layers.{i}.ffn.w3.weight"] = torch.randn(inter, hid, generator=gen) / math.sqrt(hid)
            sd[f"layers.{i}.ffn.w2.weight"] = torch.randn(hid, inter, generator=gen) / math.sqrt(inter)
        sd["norm.weight"] = 1.0 + 0.1 * torch.randn(hid, generator=gen)
        sd["head.weight"] = torch.randn(self.vocab_size, hid, generator=gen) / math.sqrt(hid)
        return sd

    # ----- pieces shared by both forwards ------------------------------------------------

    def _embed(self, token_ids: Tensor) -> Tensor:
        if token_ids.numel() and (int(token_ids.min()) < 0 or int(token_ids.max()) >= self.vocab_size):
            raise ValueError(f"token ids must lie in [0, {self.vocab_size}), got {token_ids.tolist()}")
        return self.state_dict["embed.weight"][token_ids]

    def _ffn(self, i: int, h: Tensor) -> Tensor:
        sd = self.state_dict
        x = rms_norm(h, sd[f"layers.{i}.ffn_norm.weight"], self.spec.rms_norm_eps)
        gate = torch.nn.functional.silu(x @ sd[f"layers.{i}.ffn.w1.weight"].T)
        return h + (gate * (x @ sd[f"layers.{i}.ffn.w3.weight"].T)) @ sd[f"layers.{i}.ffn.w2.weight"].T

    def _attn_input(self, i: int, h: Tensor) -> Tensor:
        return rms_norm(h, self.state_dict[f"layers.{i}.attn_norm.weight"], self.spec.rms_norm_eps)

    def _logits(self, h: Tensor) -> Tensor:
        h = rms_norm(h, self.state_dict["norm.weight"], self.spec.rms_norm_eps)
        return h @ self.state_dict["head.weight"].T

    # ----- the two forwards ------------------------------------------------------------

    @torch.no_grad()
    def reference_logits(self, token_ids: list[int] | Tensor) -> Tensor:
        """The contiguous oracle: logits [T, vocab] of every position of `token_ids`."""
        ids = torch.as_tensor(token_ids, dtype=torch.long)
        h = self._embed(ids)
        for i in range(self.spec.num_layers):
            h = h + reference_attention(self.spec, i, self.attn[i], self._attn_input(i, h))
            h = self._ffn(i, h)
        return self._logits(h)

    @torch.no_grad()
    def forward_paged(self, token_ids: list[int] | Tensor, chunks: list[ChunkPlan], pools: DSV4Pools) -> Tensor:
        """token_ids: [N], the chunks' tokens concatenated in order. Reads and writes the pools;
        returns logits [N, vocab]."""
        ids = torch.as_tensor(token_ids, dtype=torch.long)
        if ids.numel() != sum(c.num_tokens for c in chunks):
            raise ValueError(f"{ids.numel()} token ids for chunks of {sum(c.num_tokens for c in chunks)} tokens")
        h = self._embed(ids)
        for i in range(self.spec.num_layers):
            h = h + paged_attention(self.spec, i, self.attn[i], self._attn_input(i, h), chunks, pools)
            h = self._ffn(i, h)
        return self._logits(h)
