"""The tiny hybrid models' attention and recurrence math (models/tiny_hybrid.py), shared by
the model's full-recompute oracle and the cache backends (backends/slot_attention.py,
backends/recurrent.py): the oracle and the paged path differ only in which keys and which
starting state they hand these functions.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def masked_attention(q: Tensor, k: Tensor, v: Tensor, q_pos: Tensor, k_pos: Tensor, window: int | None) -> Tensor:
    """GQA softmax attention over the keys each query may see.

    q: [Tq, H, hd]; k, v: [Tk, KVH, hd]; q_pos [Tq], k_pos [Tk] int64 positions. Query t sees
    key p iff p <= t (and t - p < window for a window layer). Returns [Tq, H, hd]."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(q.shape[-1])
    visible = k_pos[None, :] <= q_pos[:, None]
    if window is not None:
        visible &= q_pos[:, None] - k_pos[None, :] < window
    scores = scores.masked_fill(~visible[None], -math.inf)
    probs = torch.softmax(scores, dim=-1)  # [H, Tq, Tk]: exactly 0 where not visible
    if math.isfinite(v.sum(dtype=torch.float64 if v.dtype == torch.float64 else torch.float32).item()):
        return torch.einsum("hqk,khd->qhd", probs, v)
    # A NaN or inf value (or a sum past fp32's range): 0 * NaN is NaN, so p @ V would carry a
    # value to the queries that do not see it (a later key of the chunk, one out of the
    # window). Each query sums over its visible keys alone.
    return torch.stack([torch.einsum("hk,khd->hd", probs[:, t, seen], v[seen]) for t, seen in enumerate(visible)])


def delta_rule(
    q: Tensor, k: Tensor, v: Tensor, beta: Tensor, g: Tensor, state: Tensor, snapshots: dict[int, Tensor] | None = None
) -> Tensor:
    """The gated delta rule over T tokens, per head h (dk = dv = hd):

        S_t = g_t * (S_{t-1} - beta_t (S_{t-1} k_t) k_t^T) + beta_t v_t k_t^T ;  o_t = S_t q_t

    q, k: [T, H, hd] (l2-normalised); v: [T, H, hd]; beta, g: [T, H]; state: [H, hd, hd]
    S_{-1}, updated in place to S_{T-1}. snapshots: {t: out tensor [H, hd, hd]}: after
    token t, the state is copied there. Returns o [T, H, hd]."""
    t_len, nh, hd = v.shape
    out = torch.empty(t_len, nh, hd, dtype=v.dtype)
    s = state
    for t in range(t_len):
        kt, vt = k[t], v[t]  # [H, hd]
        sk = torch.einsum("hvk,hk->hv", s, kt)
        s = g[t][:, None, None] * (s - beta[t][:, None, None] * sk[:, :, None] * kt[:, None, :])
        s = s + beta[t][:, None, None] * vt[:, :, None] * kt[:, None, :]
        out[t] = torch.einsum("hvk,hk->hv", s, q[t])
        if snapshots is not None and t in snapshots:
            snapshots[t].copy_(s)
    state.copy_(s)
    return out
