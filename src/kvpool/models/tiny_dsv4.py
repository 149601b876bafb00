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
- `forward(token_ids, positions, metadata)`, every model's signature: a batch of chunks on
  the Classical + State pools (`DSV4Pools`), each layer's attention through the step of V4's
  sparse attention backend (attention/backends/dsv4_sparse.py `DSV4Step`).

`dtype` is fp32 (default) or fp64. The weights are always drawn in fp64 from the seeded
generator and then cast, so `TinyDSV4(seed=s)` and `TinyDSV4(seed=s, dtype=torch.float64)`
are the same model, the fp32 one with its weights rounded: the fp64 model is the fp32
model's rounding-free twin (tests use it for exactness checks and to measure fp32 error).
"""

from __future__ import annotations

import copy
import math
from typing import Any, NamedTuple

import torch
from torch import Tensor

from kvpool.attention.backends import DSV4Step, StepMetadata
from kvpool.attention.dsv4_ops import DSV4AttnWeights, init_attn_state_dict, rms_norm
from kvpool.attention.dsv4_reference import IndexerTrace, reference_attention, reference_indexer
from kvpool.spec.dsv4 import CSA_RATIO, DSV4Spec

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


DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.float64)


class ReferenceOutput(NamedTuple):
    """logits [T, vocab]; indexer: one IndexerTrace per CSA layer, in layer order."""

    logits: Tensor
    indexer: list[IndexerTrace]


class TinyDSV4:
    """Seeded random V4-architecture model. `state_dict` uses the official names; every
    weight, activation and logit is in `dtype`."""

    def __init__(self, config: dict[str, Any] | None = None, seed: int = 0, dtype: torch.dtype = torch.float32) -> None:
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be torch.float32 or torch.float64, got {dtype}")
        cfg = dict(TINY_DSV4_CONFIG if config is None else config)
        self.config = cfg
        self.spec = DSV4Spec.from_config(cfg, name=cfg.get("name", "tiny-dsv4"))
        if self.spec.vocab_size is None:
            raise ValueError("the tiny model's config needs vocab_size")
        self.vocab_size: int = self.spec.vocab_size
        self.intermediate_size: int = int(cfg.get("intermediate_size", 2 * self.spec.hidden_size))
        self.seed = seed
        self._set_weights(self._init_weights(seed), dtype)

    def _set_weights(self, weights: dict[str, Tensor], dtype: torch.dtype) -> None:
        self.dtype = dtype
        self.state_dict = {name: w.to(dtype) for name, w in weights.items()}
        self.attn = [
            DSV4AttnWeights.from_state_dict(self.state_dict, f"layers.{i}.attn.", ratio, dtype)
            for i, ratio in enumerate(self.spec.layer_ratios)
        ]

    def to(self, dtype: torch.dtype) -> TinyDSV4:
        """A new model holding this model's weights cast to `dtype`. fp32 -> fp64 is exact, so
        `model.to(torch.float64)` is an fp32 model's rounding-free twin: the same weights,
        fp64 arithmetic (unlike `TinyDSV4(seed=s, dtype=torch.float64)`, whose weights are
        the unrounded fp64 draws)."""
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be torch.float32 or torch.float64, got {dtype}")
        other = copy.copy(self)
        other._set_weights(self.state_dict, dtype)
        return other

    def _init_weights(self, seed: int) -> dict[str, Tensor]:
        """Every weight in fp64 (the caller casts), drawn from one generator in a fixed order."""
        gen = torch.Generator().manual_seed(seed)
        spec, hid, inter = self.spec, self.spec.hidden_size, self.intermediate_size

        def randn(*shape: int) -> Tensor:
            return torch.randn(*shape, generator=gen, dtype=torch.float64)

        sd: dict[str, Tensor] = {"embed.weight": randn(self.vocab_size, hid)}
        for i in range(spec.num_layers):
            sd.update(init_attn_state_dict(spec, i, f"layers.{i}.attn.", gen))
            sd[f"layers.{i}.attn_norm.weight"] = 1.0 + 0.1 * randn(hid)
            sd[f"layers.{i}.ffn_norm.weight"] = 1.0 + 0.1 * randn(hid)
            sd[f"layers.{i}.ffn.w1.weight"] = randn(inter, hid) / math.sqrt(hid)
            sd[f"layers.{i}.ffn.w3.weight"] = randn(inter, hid) / math.sqrt(hid)
            sd[f"layers.{i}.ffn.w2.weight"] = randn(hid, inter) / math.sqrt(inter)
        sd["norm.weight"] = 1.0 + 0.1 * randn(hid)
        sd["head.weight"] = randn(self.vocab_size, hid) / math.sqrt(hid)
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
        """The contiguous oracle: logits [T, vocab] (in `dtype`) of every position of `token_ids`."""
        return self._reference(token_ids, None)

    @torch.no_grad()
    def reference_with_indexer(self, token_ids: list[int] | Tensor) -> ReferenceOutput:
        """The oracle's logits and its indexer at every CSA layer (IndexerTrace), one forward."""
        traces: list[IndexerTrace] = []
        logits = self._reference(token_ids, traces)
        return ReferenceOutput(logits, traces)

    def _reference(self, token_ids: list[int] | Tensor, traces: list[IndexerTrace] | None) -> Tensor:
        ids = torch.as_tensor(token_ids, dtype=torch.long)
        h = self._embed(ids)
        for i, ratio in enumerate(self.spec.layer_ratios):
            x = self._attn_input(i, h)
            if traces is not None and ratio == CSA_RATIO:
                traces.append(reference_indexer(self.spec, i, self.attn[i], x))
            h = self._ffn(i, h + reference_attention(self.spec, i, self.attn[i], x))
        return self._logits(h)

    @torch.no_grad()
    def forward(self, token_ids: Tensor, positions: Tensor, metadata: StepMetadata) -> Tensor:
        """token_ids, positions: [N] int64, the step's chunks' tokens in order (V4's attention
        takes each chunk's positions from its ChunkPlan: `positions` must be them). Reads
        and writes the cache only through `metadata.attention`, a `DSV4Step` over pools made
        with this model's spec and precision. Returns the logits of `metadata.logit_rows`
        (None: every row), [rows, vocab] in `dtype`."""
        metadata.check(token_ids, positions)
        step = metadata.attention
        if not isinstance(step, DSV4Step):
            raise TypeError(f"a V4 model's forward takes the step of V4's sparse attention, got {type(step).__name__}")
        if (step.dtype == torch.float64) != (self.dtype == torch.float64):
            raise ValueError(f"a {self.dtype} model needs pools of its precision, got {step.dtype} pools")
        if step.spec != self.spec:
            raise ValueError(f"pools made for the V4 spec {step.spec.name!r}, not this model's {self.spec.name!r}")
        if not torch.equal(positions, step.positions):
            raise ValueError(f"positions {positions.tolist()} are not those of the step's chunks")
        h = self._embed(token_ids)
        for i in range(self.spec.num_layers):
            h = h + step.attend(i, self.attn[i], self._attn_input(i, h))
            h = self._ffn(i, h)
        return self._logits(metadata.logit_hidden(h))
