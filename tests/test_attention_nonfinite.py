"""A NaN or an inf in a key or value reaches only the queries that see it, in the plain
masked attentions the tiny hybrid models (attention/hybrid_ops.py `masked_attention`) and
DeepSeek-V4 (attention/dsv4_ops.py `sink_attention`) share with their oracles.

A chunk's queries attend over one key list masked per query (causal, a window). A masked
key's weight is exactly 0, but 0 * NaN (or 0 * inf) is NaN in p @ V: the bad value of a
key written later in the chunk, or out of a later query's window, poisoned queries that
never see it, whose outputs become the next layer's K / V and what the cache then shares.
The expected output is each query's attention over its visible keys alone, by a loop, in
fp64 (a query that sees the bad value is non-finite there too).
"""

from __future__ import annotations

import math

import pytest
import torch

from kvpool.attention.hybrid_ops import masked_attention

TOL64 = 1e-12


def _per_query(q, k, v, visible):
    """q [Tq, H, d], k / v [Tk, H, d] (heads repeated), visible [Tq, Tk] -> [Tq, H, d]."""
    outs = []
    for t in range(q.shape[0]):
        ks, vs = k[visible[t]], v[visible[t]]
        p = torch.softmax(torch.einsum("hd,khd->hk", q[t], ks) / math.sqrt(q.shape[-1]), -1)
        outs.append(torch.einsum("hk,khd->hd", p, vs))
    return torch.stack(outs)


def _close_where_finite(out, want, seen_rows):
    """out equals want where want is finite, is non-finite where want is; rows seen_rows
    (the queries that see no bad value) are finite."""
    finite = want.isfinite()
    assert finite[seen_rows].all()
    assert (out[finite] - want[finite]).abs().max() <= TOL64
    assert not out[~finite].isfinite().any()


@pytest.mark.parametrize("which", ["k", "v"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")], ids=["nan", "inf"])
@pytest.mark.parametrize("window", [None, 4], ids=["full", "window4"])
def test_masked_attention_keeps_a_bad_key_or_value_to_the_queries_that_see_it(which, bad, window) -> None:
    """A chunk of 8 queries at positions 6..13 over keys 2..13; the bad value at key 9: the
    queries at 6..8 never see it (it is later), nor, with a window of 4, those at 13 (13 - 9 = 4)."""
    g = torch.Generator().manual_seed(5)
    h, kvh, d = 4, 2, 8
    q_pos, k_pos = torch.arange(6, 14), torch.arange(2, 14)
    q = torch.randn(8, h, d, generator=g, dtype=torch.float64)
    k = torch.randn(12, kvh, d, generator=g, dtype=torch.float64)
    v = torch.randn(12, kvh, d, generator=g, dtype=torch.float64)
    {"k": k, "v": v}[which][9 - 2, 1, 0] = bad
    out = masked_attention(q, k, v, q_pos, k_pos, window)
    visible = k_pos[None, :] <= q_pos[:, None]
    if window is not None:
        visible &= q_pos[:, None] - k_pos[None, :] < window
    want = _per_query(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), visible)
    clean = [0, 1, 2] + ([7] if window else [])
    _close_where_finite(out, want, clean)


def _sink_per_query(q, keys, valid, sink, scale):
    """sink_attention's formula, each query over its valid keys alone (fp64)."""
    outs = []
    for i in range(q.shape[0]):
        ks = (keys if keys.dim() == 2 else keys[i])[valid[i]]  # [k, d]
        z = torch.einsum("hd,kd->hk", q[i], ks) * scale
        m = torch.maximum(
            z.amax(-1, keepdim=True) if ks.shape[0] else torch.full_like(sink[:, None], -math.inf), sink[:, None]
        )
        e = torch.exp(z - m)
        outs.append(torch.einsum("hk,kd->hd", e / (e.sum(-1, keepdim=True) + torch.exp(sink[:, None] - m)), ks))
    return torch.stack(outs)


@pytest.mark.parametrize("shared", [True, False], ids=["shared-list", "own-lists"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_sink_attention_keeps_a_bad_key_to_the_queries_that_see_it(shared, bad) -> None:
    """DeepSeek-V4's softmax with the sink (K = V): 6 queries over one list of 10 keys,
    query i seeing keys [0, 4 + i] (a chunk's causal mask), the bad value at key 7 (seen
    from query 3 on); or each query's own list of 10 whose entries past 4 + i are invalid,
    the bad value in an invalid entry of every query's list (seen by none)."""
    from kvpool.attention.dsv4_ops import sink_attention

    g = torch.Generator().manual_seed(7)
    n, h, d = 6, 4, 8
    q = torch.randn(n, h, d, generator=g, dtype=torch.float64)
    sink = torch.randn(h, generator=g, dtype=torch.float64)
    valid = torch.arange(10)[None, :] <= 4 + torch.arange(n)[:, None]
    if shared:
        keys = torch.randn(10, d, generator=g, dtype=torch.float64)
        keys[7, 0] = bad
        clean = [0, 1, 2]
    else:
        keys = torch.randn(n, 10, d, generator=g, dtype=torch.float64)
        keys[torch.arange(n - 1), 9, 0] = bad  # invalid for queries 0..4
        clean = [0, 1, 2, 3, 4]
    out = sink_attention(q, keys, valid, sink, d**-0.5)
    want = _sink_per_query(q, keys, valid, sink, d**-0.5)
    _close_where_finite(out, want, clean)
