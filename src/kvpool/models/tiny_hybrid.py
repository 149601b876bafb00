"""Tiny hybrid models with seeded random weights, for exact CPU checks of the hybrid cache.

Two configs over one architecture (pre-norm residual blocks, RMSNorm, SwiGLU MLP, tied-free
output head), whose layers are one of three kinds:
- "full":   GQA attention with rotate-half RoPE over every earlier position;
- "window": the same, but the query at t reads keys [t - W + 1, t] only (Gemma-2 style);
- "recurrent": a gated delta rule (Gated DeltaNet), per head h with dk = dv = head_dim:
      q_t = l2norm(W_q x_t),  k_t = l2norm(W_k x_t),  v_t = W_v x_t
      beta_t = sigmoid(w_beta . x_t)            (write strength, per head)
      g_t = sigmoid(w_g . x_t + b_g)            (decay in (0, 1), per head)
      S_t = g_t * (S_{t-1} - beta_t (S_{t-1} k_t) k_t^T) + beta_t v_t k_t^T    S: [dv, dk]
      o_t = S_t q_t ;  output = W_o [o_t of every head]
  S_0 = 0. The layer's whole history is S_t: the recurrent cache group keeps exactly this
  tensor per request (the live state) and snapshots of it (checkpoints).

TINY_GEMMA2: window / full layers alternating (window 32), like Gemma-2's local / global.
TINY_RECURRENT: recurrent and full layers (Kimi Linear / Qwen3-Next style mix).

Two forwards over the same weights:
- `reference_logits`: the oracle, a full recompute of the whole token history, no cache
  (masks over the whole sequence, the recurrence from S_0);
- `forward(token_ids, positions, metadata)`, every model's signature: a batch of chunks on
  the paged cache, each layer through the step of the model's attention backends
  (attention/backends hybrid.py `HybridStep`, over slot_attention.py and recurrent.py,
  which hold the cache's tensors): each chunk reads and writes through its slots, its live
  state and its checkpoint slots.
The attention and recurrence math is attention/hybrid_ops.py, shared by both forwards.
Weights are drawn in fp64 from the seeded generator and cast; `model.to(torch.float64)`
is an fp32 model's rounding-free twin (the same rounded weights, fp64 arithmetic).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from kvpool.attention.backends import HybridStep, StepMetadata
from kvpool.attention.hybrid_ops import delta_rule, masked_attention

LAYER_KINDS = ("full", "window", "recurrent")

TINY_GEMMA2: dict[str, Any] = {
    "name": "tiny-gemma2",
    "vocab_size": 96,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_heads": 4,
    "num_kv_heads": 2,
    "head_dim": 8,
    "layers": ["window", "full", "window", "full"],
    "window": 32,
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 4096,
}

TINY_RECURRENT: dict[str, Any] = {
    **TINY_GEMMA2,
    "name": "tiny-recurrent-hybrid",
    "layers": ["recurrent", "full", "recurrent", "full"],
    "window": None,
}

DTYPES = (torch.float32, torch.float64)
_POSITIVE = ("vocab_size", "hidden_size", "intermediate_size", "num_heads", "num_kv_heads", "head_dim")
_REQUIRED = ("name", "layers", "rope_theta", "rms_norm_eps", "max_position_embeddings", *_POSITIVE)


def group_of(kind: str) -> str:
    """The cache group a layer kind belongs to (its name in the coordinator)."""
    return kind


def rms_norm(x: Tensor, w: Tensor, eps: float) -> Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rope(x: Tensor, positions: Tensor, theta: float) -> Tensor:
    """Rotate-half RoPE. x: [T, heads, d]; positions: int64 [T]."""
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = positions.to(torch.float64)[:, None] * inv[None, :]  # [T, d/2]
    cos = torch.cat([ang.cos(), ang.cos()], -1).to(x.dtype)[:, None, :]
    sin = torch.cat([ang.sin(), ang.sin()], -1).to(x.dtype)[:, None, :]
    half = d // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], -1)
    return x * cos + rotated * sin


class TinyHybrid:
    def __init__(self, config: dict[str, Any] | None = None, seed: int = 0, dtype: torch.dtype = torch.float32) -> None:
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be torch.float32 or torch.float64, got {dtype}")
        cfg = dict(TINY_GEMMA2 if config is None else config)
        # (a missing key was a KeyError, a head count of 0 a ZeroDivisionError, a size of -1
        # torch's "negative dimension", a vocabulary of 0 a model that could take no token)
        missing = [k for k in _REQUIRED if k not in cfg]
        if missing:
            raise ValueError(f"the tiny hybrid model's config lacks {missing}")
        for key in _POSITIVE:
            value = cfg[key]
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"the tiny hybrid model's {key} must be a positive integer, got {value!r}")
        bad = [k for k in cfg["layers"] if k not in LAYER_KINDS]
        if bad:
            raise ValueError(f"unknown layer kinds {bad}; each layer is one of {LAYER_KINDS}")
        if "window" in cfg["layers"] and not cfg.get("window"):
            raise ValueError("a config with window layers needs a positive 'window'")
        if cfg["num_heads"] % cfg["num_kv_heads"]:
            raise ValueError(f"num_heads {cfg['num_heads']} is not a multiple of num_kv_heads {cfg['num_kv_heads']}")
        self.config = cfg
        self.name: str = cfg["name"]
        self.vocab_size: int = cfg["vocab_size"]
        self.window: int | None = cfg.get("window")
        self.seed = seed
        self.dtype = dtype
        self.state_dict = {k: v.to(dtype) for k, v in self._init_weights(seed).items()}

    def to(self, dtype: torch.dtype) -> TinyHybrid:
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be torch.float32 or torch.float64, got {dtype}")
        other = copy.copy(self)
        other.dtype = dtype
        other.state_dict = {k: v.to(dtype) for k, v in self.state_dict.items()}
        return other

    # ---- layout ------------------------------------------------------------------------

    def attention_groups(self) -> dict[str, list[int]]:
        """Attention group name -> its layer indices, in layer order."""
        groups: dict[str, list[int]] = {}
        for i, kind in enumerate(self.config["layers"]):
            if kind != "recurrent":
                groups.setdefault(group_of(kind), []).append(i)
        return groups

    def recurrent_layers(self) -> list[int]:
        return [i for i, kind in enumerate(self.config["layers"]) if kind == "recurrent"]

    # ---- weights -----------------------------------------------------------------------

    def _init_weights(self, seed: int) -> dict[str, Tensor]:
        cfg = self.config
        gen = torch.Generator().manual_seed(seed)
        hid, inter, hd = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
        nh, nkv = cfg["num_heads"], cfg["num_kv_heads"]

        def randn(*shape: int, scale: float = 1.0) -> Tensor:
            return torch.randn(*shape, generator=gen, dtype=torch.float64) * scale

        sd: dict[str, Tensor] = {"embed": randn(self.vocab_size, hid)}
        for i, kind in enumerate(cfg["layers"]):
            p = f"layers.{i}."
            sd[p + "attn_norm"] = 1.0 + 0.1 * randn(hid)
            sd[p + "ffn_norm"] = 1.0 + 0.1 * randn(hid)
            if kind == "recurrent":
                sd[p + "wq"] = randn(nh * hd, hid, scale=hid**-0.5)
                sd[p + "wk"] = randn(nh * hd, hid, scale=hid**-0.5)
                sd[p + "wv"] = randn(nh * hd, hid, scale=hid**-0.5)
                sd[p + "w_beta"] = randn(nh, hid, scale=hid**-0.5)
                sd[p + "w_g"] = randn(nh, hid, scale=hid**-0.5)
                sd[p + "b_g"] = 2.0 + 0.5 * randn(nh)  # decays near sigmoid(2) ~ 0.88: long memory
            else:
                sd[p + "wq"] = randn(nh * hd, hid, scale=hid**-0.5)
                sd[p + "wk"] = randn(nkv * hd, hid, scale=hid**-0.5)
                sd[p + "wv"] = randn(nkv * hd, hid, scale=hid**-0.5)
            sd[p + "wo"] = randn(hid, nh * hd, scale=(nh * hd) ** -0.5)
            sd[p + "w1"] = randn(inter, hid, scale=hid**-0.5)
            sd[p + "w3"] = randn(inter, hid, scale=hid**-0.5)
            sd[p + "w2"] = randn(hid, inter, scale=inter**-0.5)
        sd["norm"] = 1.0 + 0.1 * randn(hid)
        sd["head"] = randn(self.vocab_size, hid, scale=hid**-0.5)
        return sd

    # ---- pieces ------------------------------------------------------------------------

    def _w(self, i: int, name: str) -> Tensor:
        return self.state_dict[f"layers.{i}.{name}"]

    def _embed(self, ids: Tensor) -> Tensor:
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.vocab_size):
            raise ValueError(f"token ids must lie in [0, {self.vocab_size}), got {ids.tolist()}")
        return self.state_dict["embed"][ids]

    def _ffn(self, i: int, h: Tensor) -> Tensor:
        x = rms_norm(h, self._w(i, "ffn_norm"), self.config["rms_norm_eps"])
        return h + (F.silu(x @ self._w(i, "w1").T) * (x @ self._w(i, "w3").T)) @ self._w(i, "w2").T

    def _qkv(self, i: int, x: Tensor, positions: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """x: [T, hidden] -> q [T, heads, hd], k / v [T, kv_heads, hd] (q, k rotated)."""
        cfg = self.config
        t, hd = x.shape[0], cfg["head_dim"]
        q = (x @ self._w(i, "wq").T).view(t, cfg["num_heads"], hd)
        k = (x @ self._w(i, "wk").T).view(t, cfg["num_kv_heads"], hd)
        v = (x @ self._w(i, "wv").T).view(t, cfg["num_kv_heads"], hd)
        theta = cfg["rope_theta"]
        return rope(q, positions, theta), rope(k, positions, theta), v

    def _layer_window(self, i: int) -> int | None:
        return self.window if self.config["layers"][i] == "window" else None

    def _attend(self, i: int, q: Tensor, k: Tensor, v: Tensor, q_pos: Tensor, k_pos: Tensor) -> Tensor:
        """q: [Tq, H, hd]; k, v: [Tk, KVH, hd]; positions int64. Returns [Tq, hidden]."""
        out = masked_attention(q, k, v, q_pos, k_pos, self._layer_window(i))
        return out.reshape(q.shape[0], -1) @ self._w(i, "wo").T

    def _recurrent_inputs(self, i: int, x: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        """x: [T, hidden] -> q, k (l2-normalised), v [T, H, hd]; beta, g [T, H]."""
        cfg = self.config
        t_len, nh, hd = x.shape[0], cfg["num_heads"], cfg["head_dim"]
        q = F.normalize((x @ self._w(i, "wq").T).view(t_len, nh, hd), dim=-1)
        k = F.normalize((x @ self._w(i, "wk").T).view(t_len, nh, hd), dim=-1)
        v = (x @ self._w(i, "wv").T).view(t_len, nh, hd)
        beta = torch.sigmoid(x @ self._w(i, "w_beta").T)  # [T, H]
        g = torch.sigmoid(x @ self._w(i, "w_g").T + self._w(i, "b_g"))  # [T, H]
        return q, k, v, beta, g

    def _recurrent_out(self, i: int, o: Tensor) -> Tensor:
        """o: [T, H, hd] -> [T, hidden]."""
        return o.reshape(o.shape[0], -1) @ self._w(i, "wo").T

    def _logits(self, h: Tensor) -> Tensor:
        return rms_norm(h, self.state_dict["norm"], self.config["rms_norm_eps"]) @ self.state_dict["head"].T

    # ---- the two forwards --------------------------------------------------------------

    @torch.no_grad()
    def reference_logits(self, token_ids: list[int] | Tensor) -> Tensor:
        """The oracle: logits [T, vocab] of every position, recomputed from scratch."""
        ids = torch.as_tensor(token_ids, dtype=torch.long)
        pos = torch.arange(ids.numel())
        h = self._embed(ids)
        cfg = self.config
        for i, kind in enumerate(cfg["layers"]):
            x = rms_norm(h, self._w(i, "attn_norm"), cfg["rms_norm_eps"])
            if kind == "recurrent":
                state = torch.zeros(cfg["num_heads"], cfg["head_dim"], cfg["head_dim"], dtype=self.dtype)
                h = h + self._recurrent_out(i, delta_rule(*self._recurrent_inputs(i, x), state))
            else:
                q, k, v = self._qkv(i, x, pos)
                h = h + self._attend(i, q, k, v, pos, pos)
            h = self._ffn(i, h)
        return self._logits(h)

    @torch.no_grad()
    def forward(self, token_ids: Tensor, positions: Tensor, metadata: StepMetadata) -> Tensor:
        """token_ids, positions: [N] int64, the step's chunks' tokens in order. Each layer
        runs through `metadata.attention`, a `HybridStep` of this model's backends, which
        writes every chunk's K/V into its write slots, reads its keys through its read
        slots, advances its live state and fills its checkpoint slots. Returns the logits
        of `metadata.logit_rows` (None: every row), [rows, vocab] in `dtype`."""
        metadata.check(token_ids, positions)
        step = metadata.attention
        if not isinstance(step, HybridStep):
            raise TypeError(
                f"a hybrid model's forward takes the step of its hybrid attention, got {type(step).__name__}"
            )
        cfg = self.config
        h = self._embed(token_ids)
        for i, kind in enumerate(cfg["layers"]):
            x = rms_norm(h, self._w(i, "attn_norm"), cfg["rms_norm_eps"])
            if kind == "recurrent":
                o = step.update(i, *self._recurrent_inputs(i, x))
            else:
                q, k, v = self._qkv(i, x, positions)
                o = step.attend(i, q, k, v)
            h = self._ffn(i, h + o.reshape(o.shape[0], -1) @ self._w(i, "wo").T)
        return self._logits(metadata.logit_hidden(h))
