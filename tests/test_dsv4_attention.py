"""V4 attention math against hand computations, and the visibility rules, targeted.

Numerics: the hand computations run in fp64 (Python floats, or torch fp64), where an op
agrees with its hand twin to ~1e-16 relative whatever the CPU's kernels; the bounds below
(1e-14 .. 1e-12 on O(1) values) sit 100x or more above that and many orders of magnitude
below any real mistake (a wrong row, channel, sign or scale changes values by O(0.01 .. 1)).
The one fp32 bound (RoPE on fp32 input) is a single rounding of O(1) values, said where it
stands. Exact-invariance checks use torch.equal."""

from __future__ import annotations

import math

import pytest
import torch

from kvpool.attention.backends import DSV4SparseBackend, StepMetadata
from kvpool.attention.dsv4_ops import (
    DSV4AttnWeights,
    apply_rope,
    indexer_scores,
    init_attn_state_dict,
    output_projection,
    project_tokens,
    rope_freqs,
    sink_attention,
    stable_topk,
)
from kvpool.attention.dsv4_paged import ChunkPlan, _compress_chunk, paged_attention
from kvpool.attention.dsv4_reference import compress_all_blocks, reference_attention
from kvpool.models.tiny_dsv4 import TINY_DSV4_CONFIG, TinyDSV4
from kvpool.spec.dsv4 import DSV4Spec, YarnScaling
from kvpool.storage.dsv4 import DSV4Pools
from kvpool.verify.dsv4_tolerance import FP64_TOLERANCE

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model() -> TinyDSV4:
    return TinyDSV4(seed=0)


@pytest.fixture(scope="module")
def model64(model: TinyDSV4) -> TinyDSV4:
    return model.to(torch.float64)


def test_rope_is_interleaved_pairs_on_last_dims() -> None:
    freqs = torch.tensor([0.5, 0.25], dtype=torch.float64)
    x = torch.tensor([[7.0, 1.0, 0.0, 0.0, 1.0]], dtype=torch.float64)  # dim 0 not rotated; pairs (1,2), (3,4)
    out = apply_rope(x, torch.tensor([3]), freqs)
    a0, a1 = 3 * 0.5, 3 * 0.25
    expected = [7.0, math.cos(a0), math.sin(a0), -math.sin(a1), math.cos(a1)]
    assert out[0].tolist() == pytest.approx(expected, abs=1e-14)  # fp64 cos / sin of torch and math: ~1 ulp
    back = apply_rope(out, torch.tensor([3]), freqs, inverse=True)
    assert torch.allclose(back, x, atol=1e-14, rtol=0)
    # fp32 input: rotated in fp32 with the fp64 angles' cos / sin rounded once (~6e-8)
    out32 = apply_rope(x.float(), torch.tensor([3]), freqs)
    assert out32.dtype == torch.float32 and out32[0].tolist() == pytest.approx(expected, abs=2e-7)


def test_yarn_frequencies() -> None:
    # rope_dim 64, theta 160000, original 65536: correction dims floor(15.45) = 15 and ceil(24.71) = 25
    yarn = YarnScaling(factor=16, original_max_position_embeddings=65536, beta_fast=32, beta_slow=1)
    plain = rope_freqs(64, 160000, None)
    scaled = rope_freqs(64, 160000, yarn)
    assert plain[3].item() == pytest.approx(160000 ** (-6 / 64), rel=1e-14)  # fp64: 1 / x**y vs x**-y, ~2 ulps
    assert torch.equal(scaled[:16], plain[:16])  # fast pairs keep their frequency
    assert torch.equal(scaled[25:], plain[25:] / 16)  # slow pairs are interpolated by the factor (exact)
    mid = 20  # ramp (20 - 15) / (25 - 15) = 0.5 -> halfway between the two, the same fp64 ops
    assert scaled[mid].item() == plain[mid].item() / 16 * 0.5 + plain[mid].item() * 0.5


def test_sink_is_in_the_denominator_only() -> None:
    f64 = torch.float64
    q = torch.tensor([[[1.0, 0.0]]], dtype=f64)  # [n=1, H=1, d=2]
    keys = torch.tensor([[1.0, 0.0], [2.0, 1.0]], dtype=f64)  # z = [1, 2] at scale 1
    sink = torch.tensor([0.5], dtype=f64)
    out = sink_attention(q, keys, torch.tensor([[True, True]]), sink, 1.0)
    denom = math.exp(1) + math.exp(2) + math.exp(0.5)
    p = [math.exp(1) / denom, math.exp(2) / denom]
    # fp64, values <= 2, a handful of exp / sums (torch subtracts the max first): ~1e-16
    assert out[0, 0].tolist() == pytest.approx([p[0] * 1 + p[1] * 2, p[1] * 1], abs=1e-14)
    masked = sink_attention(q, keys, torch.tensor([[True, False]]), sink, 1.0)
    assert masked[0, 0, 0].item() == pytest.approx(math.exp(1) / (math.exp(1) + math.exp(0.5)), abs=1e-14)
    # without the sink the weights would sum to 1; out = p0 * [1, 0] + p1 * [2, 1], so
    # p0 + p1 = out[0] - out[1] = 1 - exp(0.5) / denom
    assert (out[0, 0, 0] - out[0, 0, 1]).item() == pytest.approx(1 - math.exp(0.5) / denom, abs=1e-14)


def test_stable_topk_breaks_ties_by_lower_index() -> None:
    scores = torch.tensor([[0.0, 3.0, 0.0, 3.0, 0.0], [0.0, 3.0, 0.0, 3.0, 0.0]])
    idx, valid = stable_topk(scores, torch.tensor([5, 3]), 3)
    assert idx[0].tolist() == [1, 3, 0]
    assert idx[1].tolist() == [1, 0, 2]  # entries 3, 4 are not visible to row 1
    assert valid.tolist() == [[True, True, True], [True, True, True]]
    idx, valid = stable_topk(scores, torch.tensor([2, 0]), 3)
    assert idx[0, :2].tolist() == [1, 0] and valid.tolist() == [[True, True, False], [False, False, False]]
    # many exact zeros (all heads negative): the lowest indices win, whatever the width
    wide = torch.zeros(1, 1000)
    wide[0, 700] = -1.0
    assert stable_topk(wide, torch.tensor([1000]), 4)[0].tolist() == [[0, 1, 2, 3]]


def test_indexer_scores_by_hand() -> None:
    # I[t, s] = sum_h w[t, h] * relu(q[t, h] . k[s]) (DEEPSEEK_V4.md §4). Dyadic values:
    # every product and sum is exact, so the result must be bit-exact.
    q = torch.tensor([[[1.0, 2.0], [-1.0, 0.5]], [[0.5, -1.0], [2.0, 1.0]]])  # [n=2, H=2, di=2]
    keys = torch.tensor([[1.0, 0.0], [0.0, 1.0], [-1.0, -1.0]])  # [E=3, di=2]
    w = torch.tensor([[0.5, 2.0], [-1.0, 0.25]])  # [n, H]: a head weight may be negative
    expected = [
        # query 0, heads' dots per entry: (1, -1), (2, 0.5), (-3, 0.5)
        [0.5 * 1 + 2 * 0, 0.5 * 2 + 2 * 0.5, 0.5 * 0 + 2 * 0.5],
        # query 1: (0.5, 2), (-1, 1), (0.5, -3): entry 0 scores exactly 0 by cancellation
        [-1 * 0.5 + 0.25 * 2, -1 * 0 + 0.25 * 1, -1 * 0.5 + 0.25 * 0],
    ]
    assert indexer_scores(q, w, keys).tolist() == expected == [[0.5, 2.0, 1.0], [0.0, 0.25, -0.5]]
    # random fp64 values against explicit loops; only the summation order differs (~1e-16)
    g = torch.Generator().manual_seed(11)
    n, heads, di, num_entries = 3, 4, 5, 6
    q = torch.randn(n, heads, di, generator=g, dtype=torch.float64)
    keys = torch.randn(num_entries, di, generator=g, dtype=torch.float64)
    w = torch.randn(n, heads, generator=g, dtype=torch.float64)
    got = indexer_scores(q, w, keys)
    assert got.dtype == torch.float64 and got.shape == (n, num_entries)
    num_zero_heads = 0
    for t in range(n):
        for e in range(num_entries):
            total = 0.0
            for h in range(heads):
                dot = sum(float(q[t, h, i]) * float(keys[e, i]) for i in range(di))
                num_zero_heads += dot <= 0
                total += float(w[t, h]) * max(dot, 0.0)
            assert abs(float(got[t, e]) - total) <= 1e-12
    assert 0 < num_zero_heads < n * heads * num_entries  # the relu both clips and passes here


def _hand_rms(v: list[float], weight: list[float] | None, eps: float) -> list[float]:
    r = 1.0 / math.sqrt(sum(x * x for x in v) / len(v) + eps)
    return [x * r * (1.0 if weight is None else weight[i]) for i, x in enumerate(v)]


def _hand_rope(v: list[float], pos: int, freqs: list[float]) -> list[float]:
    """GPT-J pairs (2i, 2i+1) of the LAST 2 * len(freqs) dims rotated by pos * freqs[i]."""
    out = list(v)
    base = len(v) - 2 * len(freqs)
    for i, f in enumerate(freqs):
        a, b = v[base + 2 * i], v[base + 2 * i + 1]
        c, s = math.cos(pos * f), math.sin(pos * f)
        out[base + 2 * i], out[base + 2 * i + 1] = a * c - b * s, a * s + b * c
    return out


def _hand_linear(weight: torch.Tensor, v: list[float]) -> list[float]:
    """weight [out, in] (nn.Linear layout) times v, by loops."""
    return [sum(float(weight[o, i]) * v[i] for i in range(len(v))) for o in range(weight.shape[0])]


def _tiny_spec() -> DSV4Spec:
    cfg = {
        **TINY_DSV4_CONFIG,
        "hidden_size": 6,
        "num_attention_heads": 2,
        "head_dim": 6,
        "qk_rope_head_dim": 4,
        "q_lora_rank": 3,
        "o_groups": 2,
        "o_lora_rank": 2,
        "index_n_heads": 2,
        "index_head_dim": 6,
    }
    return DSV4Spec.from_config(cfg, name="hand")


@pytest.mark.parametrize("layer", [0, 2, 3])  # SWA-only, CSA (ratio 4), HCA (ratio 128)
def test_project_tokens_by_hand(layer: int) -> None:
    """Every per-token projection of DEEPSEEK_V4.md §2-4, by loops over plain floats, fp64."""
    spec = _tiny_spec()
    ratio = spec.layer_ratios[layer]
    sd = init_attn_state_dict(spec, layer, "", torch.Generator().manual_seed(3))
    w = DSV4AttnWeights.from_state_dict(sd, "", ratio, torch.float64)
    x = torch.randn(3, spec.hidden_size, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    positions = torch.tensor([0, 5, 130])  # pos % 4 = 0, 1, 2; pos % 128 = 0, 5, 2
    freqs = [0.7, 0.2]  # two rotated pairs (rope dim 4) at explicit frequencies
    p = project_tokens(spec, ratio, w, x, positions, torch.tensor(freqs, dtype=torch.float64))
    eps, d, heads = spec.rms_norm_eps, spec.head_dim, spec.num_heads
    di, idx_heads = spec.index_head_dim, spec.index_n_heads
    assert p.q.shape == (3, heads, d) and p.kv.shape == (3, d) and p.q.dtype == torch.float64

    def close(got: torch.Tensor, expected: list[float]) -> None:
        # fp64, O(1) values, a few dozen ops each: the loops and torch differ by ~1e-16
        assert got.tolist() == pytest.approx(expected, abs=1e-12)

    for t, pos in enumerate(positions.tolist()):
        xt = x[t].tolist()
        qr = _hand_rms(_hand_linear(w.wq_a, xt), w.q_norm.tolist(), eps)  # rmsnorm(wq_a x), weighted
        q_all = _hand_linear(w.wq_b, qr)
        for h in range(heads):  # per-head RMSNorm without weight, then RoPE on the last dims
            close(p.q[t, h], _hand_rope(_hand_rms(q_all[h * d : (h + 1) * d], None, eps), pos, freqs))
        close(p.kv[t], _hand_rope(_hand_rms(_hand_linear(w.wkv, xt), w.kv_norm.tolist(), eps), pos, freqs))
        if ratio == 0:
            assert p.comp_kv is None and p.comp_score is None and p.idx_q is None and p.idx_w is None
            continue
        c = w.compressor
        assert c is not None and p.comp_kv is not None and p.comp_score is not None
        coff = 2 if ratio == 4 else 1
        assert p.comp_kv.shape == (3, coff * d)
        close(p.comp_kv[t], _hand_linear(c.wkv, xt))  # no norm and no RoPE before pooling
        gate = _hand_linear(c.wgate, xt)
        close(p.comp_score[t], [gate[j] + float(c.ape[pos % ratio, j]) for j in range(coff * d)])
        if ratio != 4:
            assert p.idx_q is None and p.idx_w is None and p.idx_kv is None and p.idx_score is None
            continue
        ix = w.indexer
        assert ix is not None and p.idx_q is not None and p.idx_w is not None
        assert p.idx_kv is not None and p.idx_score is not None
        iq = _hand_linear(ix.wq_b, qr)  # from the same qr, no norm
        for h in range(idx_heads):
            close(p.idx_q[t, h], _hand_rope(iq[h * di : (h + 1) * di], pos, freqs))
        scale = di**-0.5 * idx_heads**-0.5  # 128 ** -0.5 * 64 ** -0.5 in the real model
        close(p.idx_w[t], [v * scale for v in _hand_linear(ix.weights_proj, xt)])
        close(p.idx_kv[t], _hand_linear(ix.compressor.wkv, xt))
        igate = _hand_linear(ix.compressor.wgate, xt)
        close(p.idx_score[t], [igate[j] + float(ix.compressor.ape[pos % 4, j]) for j in range(2 * di)])


def _hand_entry(kv, score, block: int, ratio: int, width: int, overlap: bool) -> torch.Tensor:
    """Entry `block` by explicit loops over channels and rows (before norm and RoPE)."""
    out = torch.zeros(width, dtype=torch.float64)
    for ch in range(width):
        rows = []  # (score, value)
        if overlap and block > 0:
            rows += [(score[p][ch], kv[p][ch]) for p in range((block - 1) * ratio, block * ratio)]
        half = width if overlap else 0
        rows += [(score[p][half + ch], kv[p][half + ch]) for p in range(block * ratio, (block + 1) * ratio)]
        m = max(s for s, _ in rows)
        z = sum(math.exp(s - m) for s, _ in rows)
        out[ch] = sum(math.exp(s - m) / z * v for s, v in rows)
    return out


@pytest.mark.parametrize("ratio,overlap", [(4, True), (8, False)])
def test_compressor_pooling_by_hand(ratio: int, overlap: bool) -> None:
    g = torch.Generator().manual_seed(5)
    width, num_tokens = 6, 3 * ratio + 1
    coff = 2 if overlap else 1
    kv = torch.randn(num_tokens, coff * width, generator=g, dtype=torch.float64)
    score = torch.randn(num_tokens, coff * width, generator=g, dtype=torch.float64)
    ones = torch.ones(width, dtype=torch.float64)
    no_rope = torch.zeros(1, dtype=torch.float64)  # one pair at frequency 0 = identity rotation
    entries = compress_all_blocks(kv, score, ratio, width, ones, 1e-6, no_rope)
    assert entries.shape == (3, width)
    for block in range(3):
        hand = _hand_entry(kv.tolist(), score.tolist(), block, ratio, width, overlap)
        hand = hand * torch.rsqrt(hand.pow(2).mean() + 1e-6)
        assert torch.allclose(entries[block], hand, atol=1e-13, rtol=0)  # fp64, O(1) values
    # The decode-state path (token by token through the state rows) pools the same entries.
    rows = coff * ratio
    kv_state = torch.zeros(rows, coff * width, dtype=torch.float64)
    score_state = torch.full((rows, coff * width), float("-inf"), dtype=torch.float64)
    streamed = [
        _compress_chunk(
            kv_state, score_state, kv[p : p + 1], score[p : p + 1], ratio, width, p, p + 1, ones, 1e-6, no_rope
        )
        for p in range(num_tokens)
    ]
    assert torch.allclose(torch.cat(streamed), entries, atol=1e-13, rtol=0)


def test_grouped_output_projection(model64: TinyDSV4) -> None:
    spec, w = model64.spec, model64.attn[2]
    o = torch.randn(3, spec.num_heads, spec.head_dim, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    pos = torch.tensor([0, 5, 9])
    out = output_projection(spec, w, o, pos, torch.zeros(spec.rope_head_dim // 2, dtype=torch.float64))
    heads_per_group = spec.num_heads // spec.o_groups
    parts = []
    for g in range(spec.o_groups):  # group g: heads [g*hpg, (g+1)*hpg), rows of wo_a [g*R, (g+1)*R)
        og = o[:, g * heads_per_group : (g + 1) * heads_per_group].reshape(3, -1)
        parts.append(og @ w.wo_a[g * spec.o_lora_rank : (g + 1) * spec.o_lora_rank].T)
    assert torch.allclose(out, torch.cat(parts, dim=1) @ w.wo_b.T, atol=1e-12, rtol=0)  # fp64, |out| ~ 1


def test_fp32_and_fp64_models_hold_the_same_weights_rounded(model: TinyDSV4) -> None:
    m64 = TinyDSV4(seed=0, dtype=torch.float64)
    assert model.dtype == torch.float32 and m64.dtype == torch.float64
    assert model.state_dict.keys() == m64.state_dict.keys()
    for name, w64 in m64.state_dict.items():
        w32 = model.state_dict[name]
        assert w32.dtype == torch.float32 and w64.dtype == torch.float64
        assert torch.equal(w32, w64.to(torch.float32)), name  # fp32 = the fp64 draw, rounded
    # ... and the fp64 draws are not fp32 values: they carry bits that fp32 drops
    assert not torch.equal(m64.state_dict["embed.weight"], model.state_dict["embed.weight"].double())
    assert m64.attn[2].indexer is not None and m64.attn[2].indexer.wq_b.dtype == torch.float64
    twin = model.to(torch.float64)  # the same fp32 weights, held exactly in fp64
    assert all(torch.equal(twin.state_dict[n], w.double()) for n, w in model.state_dict.items())
    assert twin.attn[3].compressor is not None and twin.attn[3].compressor.ape.dtype == torch.float64
    assert twin.reference_logits([1, 2, 3]).dtype == torch.float64
    with pytest.raises(ValueError, match="bfloat16"):
        TinyDSV4(dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="float32 model needs pools of its precision"):
        pools = DSV4Pools(model.spec, 1, 1, dtype=torch.float64)
        step = DSV4SparseBackend(pools).begin_step([ChunkPlan(0, 1, 0, ())])
        model.forward(torch.tensor([1]), torch.tensor([0]), StepMetadata(step))


def test_official_parameter_names(model: TinyDSV4) -> None:
    names = {k for k in model.state_dict if k.startswith("layers.2.attn.")}  # a CSA layer
    expected = {
        f"layers.2.attn.{n}"
        for n in (
            "wq_a.weight",
            "q_norm.weight",
            "wq_b.weight",
            "wkv.weight",
            "kv_norm.weight",
            "wo_a.weight",
            "wo_b.weight",
            "attn_sink",
            "compressor.wkv.weight",
            "compressor.wgate.weight",
            "compressor.ape",
            "compressor.norm.weight",
            "indexer.wq_b.weight",
            "indexer.weights_proj.weight",
            "indexer.compressor.wkv.weight",
            "indexer.compressor.wgate.weight",
            "indexer.compressor.ape",
            "indexer.compressor.norm.weight",
        )
    }
    assert names == expected
    assert not any(k.startswith("layers.3.attn.indexer") for k in model.state_dict)  # HCA: no indexer
    assert not any(k.startswith("layers.0.attn.compressor") for k in model.state_dict)  # SWA-only
    with pytest.raises(KeyError, match="layers.2.attn.attn_sink"):
        sd = {k: v for k, v in model.state_dict.items() if k != "layers.2.attn.attn_sink"}
        DSV4AttnWeights.from_state_dict(sd, "layers.2.attn.", 4)


def _layer_outputs(
    model: TinyDSV4, layer: int, w: DSV4AttnWeights, x: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(oracle, paged token-by-token) outputs of one layer for inputs x [T, hidden]."""
    ref = reference_attention(model.spec, layer, w, x)
    pools = DSV4Pools(model.spec, 4, 1, dtype=x.dtype)
    pools.reset_state(0)
    table: list[int] = []
    outs = []
    for t in range(x.shape[0]):
        new = (len(table),) if (t + 1) % model.spec.span == 0 else ()
        outs.append(paged_attention(model.spec, layer, w, x[t : t + 1], [ChunkPlan(t, 1, 0, tuple(table), new)], pools))
        table += list(new)
    return ref, torch.cat(outs)


def _perturbed_compressor(w: DSV4AttnWeights) -> DSV4AttnWeights:
    c = w.compressor
    assert c is not None
    changed = type(c)(c.wkv + 0.5, c.wgate, c.ape, c.norm)
    return DSV4AttnWeights(**{**w.__dict__, "compressor": changed})


@pytest.mark.parametrize("layer,ratio", [(2, 4), (3, 128)])
def test_entry_j_invisible_until_its_block_completes(model64: TinyDSV4, layer: int, ratio: int) -> None:
    """Entry j is visible to query t iff j < (t + 1) // ratio: changing only the compressor's
    values leaves every query before the first block's last token untouched, and changes the
    query at that token (which already sees entry 0), in the oracle and the paged path."""
    num_tokens = ratio + 1
    x = torch.randn(
        num_tokens, model64.spec.hidden_size, generator=torch.Generator().manual_seed(7), dtype=torch.float64
    )
    w = model64.attn[layer]
    base_ref, base_paged = _layer_outputs(model64, layer, w, x)
    new_ref, new_paged = _layer_outputs(model64, layer, _perturbed_compressor(w), x)
    for base, new in ((base_ref, new_ref), (base_paged, new_paged)):
        assert torch.equal(base[: ratio - 1], new[: ratio - 1])  # t <= ratio - 2: (t + 1) // ratio == 0
        # t = ratio - 1 already sees entry 0, and so does t = ratio (measured: 0.016 .. 0.87)
        assert (base[ratio - 1] - new[ratio - 1]).abs().max() > 1e-3
        assert (base[ratio] - new[ratio]).abs().max() > 1e-3
    assert (base_ref - base_paged).abs().max() <= FP64_TOLERANCE  # fp64, |outputs| ~ 1; measured 1.4e-15


def test_window_is_the_last_n_win_tokens(model64: TinyDSV4) -> None:
    """On an SWA-only layer query t reads positions max(0, t - 127) .. t, nothing older."""
    spec, w = model64.spec, model64.attn[0]
    n_win = spec.window
    t = n_win + 5
    x = torch.randn(t + 1, spec.hidden_size, generator=torch.Generator().manual_seed(8), dtype=torch.float64)
    base = reference_attention(spec, 0, w, x)
    old = x.clone()
    old[t - n_win] += 1.0  # just outside query t's window
    assert torch.equal(reference_attention(spec, 0, w, old)[t], base[t])
    edge = x.clone()
    edge[t - n_win + 1] += 1.0  # the oldest position inside it (measured: a change of 5.5e-3)
    assert (reference_attention(spec, 0, w, edge)[t] - base[t]).abs().max() > 1e-4


def test_oracle_is_causal(model: TinyDSV4) -> None:
    ids = torch.randint(0, 256, (140,), generator=torch.Generator().manual_seed(9)).tolist()
    full = model.reference_logits(ids)
    for t in (2, 126, 129):  # inside a CSA block, inside the first HCA block, after it
        changed = ids[: t + 1] + [(i + 1) % 256 for i in ids[t + 1 :]]
        assert torch.equal(model.reference_logits(changed)[: t + 1], full[: t + 1])
