"""The roofline cost model (kvpool.sim.cost) against hand computations from the configs."""

from __future__ import annotations

import dataclasses
import itertools
import math
from fractions import Fraction

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvpool.sim.calibrate import EngineStepTimes, fit_engine
from kvpool.sim.cost import (
    DEVICE_DEFAULTS,
    MXFP4_EXPERT_COMPUTE_EFFICIENCY,
    CostModel,
    expected_padded_rows,
    moe_block_m,
    sum_visible,
)
from kvpool.spec.dsv4 import SERVING
from kvpool.spec.gpus import GIB, GPUS, GPUSpec, cpu_preset, custom_gpu, get_gpu
from kvpool.spec.models import load_preset

H200 = get_gpu("H200")
H100, B200 = get_gpu("H100"), get_gpu("B200")
H200_EFFECTIVE_BW = 4.8e12 * 0.8  # the cuda default bandwidth efficiency
GRAPH_STEP = 0.75e-3  # a decode-only step replaying a CUDA graph: the host's per-step time
LAYER_FIXED = 36.6e-6  # the GPU's fixed time per layer per step (H100 / H200 / B200 presets)


def eager_step(num_layers: int) -> float:
    """A step that does not replay a graph: 0.75 ms + 76 us a layer's launches."""
    return 0.75e-3 + num_layers * 76e-6


# ----- dense models -----------------------------------------------------------------------


def test_dense_decode_at_short_context_sits_on_the_weight_bytes_floor() -> None:
    cm = CostModel(load_preset("llama-3.1-8b"), H200, weight_dtype="bf16", kv_dtype="bf16")
    cost = cm.step_cost([(1, 128)])
    assert cost.bound == "memory"
    # what the step reads: every weight but the untied embedding table, whose lookup reads one row
    table = 128_256 * 4096 * 2
    kv = 128 * 32 * 2 * 8 * 128 * 2 + 32 * 2 * 8 * 128 * 2  # read 128 tokens, write 1
    exact = (cm.weights.per_gpu_bytes - table + 4096 * 2 + kv) / H200_EFFECTIVE_BW + GRAPH_STEP + 32 * LAYER_FIXED
    assert cost.time_s == pytest.approx(exact, rel=1e-12)
    floor = (cm.weights.per_gpu_bytes - table) / H200_EFFECTIVE_BW  # 15 GB: all weights but the table
    assert cost.memory_s == pytest.approx(floor, rel=0.005)  # the KV, 17 MB, is 0.1 % of it


def test_decode_time_grows_with_context_exactly_as_the_kv_bytes_say() -> None:
    cm = CostModel(load_preset("llama-3.1-8b"), H200, weight_dtype="bf16", kv_dtype="bf16")
    bytes_per_token = 32 * 2 * 8 * 128 * 2  # layers x (K, V) x kv heads x head dim x bf16
    assert cm.kv_read_bytes(1000) == 1000 * bytes_per_token == 131_072_000
    delta = cm.step_time([(1, 33_000)]) - cm.step_time([(1, 1000)])
    assert delta == pytest.approx(32_000 * bytes_per_token / H200_EFFECTIVE_BW, rel=1e-9)


def test_prefill_of_8k_tokens_is_compute_bound_and_its_flops_are_the_hand_count() -> None:
    cm = CostModel(load_preset("smollm2-135m"), H200, weight_dtype="bf16", kv_dtype="bf16")
    cost = cm.step_cost([(8192, 8192)])
    assert cost.bound == "compute"
    h, layers, heads, kv_heads, d, inter, vocab = 576, 30, 9, 3, 64, 1536, 49_152
    params = layers * (h * heads * d + 2 * h * kv_heads * d + heads * d * h + 3 * h * inter)
    assert params == 106_168_320  # the 134.5 M total minus the (tied) embedding
    linear = 2 * params * 8192 + 2 * vocab * h  # the head (tied weights) for one logits row
    attention = layers * 4 * heads * d * (8192 * 8193 // 2)  # query k sees k tokens: sum 1..8192
    assert cost.linear_flops == linear
    assert cost.attention_flops == attention
    exact = (linear + attention) / (989e12 * 0.5) + eager_step(30) + 30 * LAYER_FIXED
    assert cost.time_s == pytest.approx(exact, rel=1e-12)


def test_chunked_prefill_attends_the_exact_causal_sum() -> None:
    cm = CostModel(load_preset("smollm2-135m"), H200, weight_dtype="bf16", kv_dtype="bf16")
    per_entry = 30 * 4 * 9 * 64
    # 100 new tokens after 300 cached: the queries see 301 .. 400 tokens
    assert cm.step_cost([(100, 400)]).attention_flops == per_entry * sum(range(301, 401))
    # two chunks of one step add up
    both = cm.step_cost([(100, 400), (1, 50)]).attention_flops
    assert both == per_entry * (sum(range(301, 401)) + 50)


def test_sliding_window_layers_read_and_attend_at_most_the_window() -> None:
    model = load_preset("gemma-2-9b")  # 42 layers, every other one sliding with window 4096
    cm = CostModel(model, H200, weight_dtype="bf16", kv_dtype="bf16")
    entry = 2 * model.num_kv_heads * model.head_dim * 2
    num_sliding = sum(1 for w in model.layer_windows if w is not None)
    assert (num_sliding, model.num_layers - num_sliding) == (21, 21)
    assert cm.kv_read_bytes(10_000) == 21 * 10_000 * entry + 21 * 4096 * entry
    assert cm.kv_read_bytes(1000) == 42 * 1000 * entry
    # a 100-token chunk reads the union of its windows: positions [10000 - 4096 - 99, 10000)
    read = cm.step_cost([(100, 10_000)]).kv_bytes - 100 * cm.kv_write_bytes_per_token
    assert read == pytest.approx(21 * 10_000 * entry + 21 * (4096 + 99) * entry, rel=1e-12)


# ----- MoE --------------------------------------------------------------------------------


def _enumerated_experts_touched(num_experts: int, top_k: int, num_tokens: int) -> Fraction:
    """The mean number of distinct experts over every equally likely routing of `num_tokens`
    tokens to `top_k` distinct experts each, by enumeration (exact, in rationals)."""
    choices = list(itertools.combinations(range(num_experts), top_k))
    total = sum(len(set().union(*routing)) for routing in itertools.product(choices, repeat=num_tokens))
    return Fraction(total, len(choices) ** num_tokens)


def test_moe_experts_touched_is_the_uniform_routing_expectation_by_enumeration() -> None:
    model = load_preset("gpt-oss-120b")
    for e, k, n in ((6, 2, 1), (6, 2, 3), (5, 3, 4), (8, 1, 5)):
        moe = dataclasses.replace(model.moe, num_experts=e, experts_per_token=k)
        cm = CostModel(dataclasses.replace(model, moe=moe), H200)
        assert cm.experts_touched(n) == pytest.approx(float(_enumerated_experts_touched(e, k, n)), rel=1e-12)


def test_moe_experts_touched_starts_at_top_k_and_stays_below_the_old_bound() -> None:
    model = load_preset("deepseek-v3")  # 256 experts, top-8, 58 MoE layers, FP8 weights
    cm = CostModel(model, H200)
    assert cm.experts_touched(1) == pytest.approx(8, rel=1e-12)
    # the figure: 32 tokens touch ~163 experts on average, not min(256, 32 x 8) = 256
    assert cm.experts_touched(32) == pytest.approx(256 * (1 - (31 / 32) ** 32), rel=1e-12)
    assert 163 < cm.experts_touched(32) < 164
    assert all(cm.experts_touched(n) < min(256, 8 * n) for n in (2, 31, 32, 1000))
    expert = 3 * 7168 * 2048 * (1 + 4 / (128 * 128))  # gate, up, down in block FP8
    assert cm.expert_bytes == pytest.approx(expert, rel=1e-12)
    row = 7168 * 2  # a BF16 embedding row per token

    def weights_read(batch: int) -> float:
        return cm.step_cost([(1, 1000)] * batch).weight_bytes

    # one token more reads its row and the experts it is expected to add: 8 x (1 - 8/256)
    small = weights_read(2) - weights_read(1)
    assert small == pytest.approx(58 * 8 * (1 - 8 / 256) * expert + row, rel=1e-9)
    # at 4096 tokens every expert is read (the expected miss is 256 x (31/32)^4096, ~1e-54)
    everything = cm.weights.per_gpu_bytes - 129_280 * row
    assert weights_read(4096) == pytest.approx(everything + 4096 * row, rel=1e-12)


def test_moe_flops_count_only_the_routed_top_k() -> None:
    model = load_preset("gpt-oss-120b")  # 128 experts, top-4, every layer MoE
    cm = CostModel(model, H200)
    assert cm.experts_touched(1) == pytest.approx(4, rel=1e-12)
    p = cm.weights.params
    per_expert = 3 * model.hidden_size * model.moe.expert_intermediate_size
    active = p.attention + p.attention_replicated + p.mlp + p.router + 36 * 4 * per_expert
    assert cm.active_params_per_token == active
    assert active < 0.06 * p.total  # ~5.1 B of 117 B are active
    # at TP 8 the sharded weights (attention, MLP, the routed experts) split 8 ways; the
    # router stays whole on every rank
    p8 = CostModel(model, H200, tp=8).weights.params
    assert p8 == p
    hand = (p.attention + p.mlp) / 8 + p.attention_replicated + p.router + 36 * 4 * per_expert / 8
    assert CostModel(model, H200, tp=8).active_params_per_token == hand


def test_moe_block_m_is_triton_kernels_tile_rule() -> None:
    """opt_flags.py (NVIDIA): next_pow2(2 t) held to [16, 64] for t <= 64 rows an expert,
    next_pow2(t) held to [16, 128] above."""
    hand = {1: 16, 8: 16, 9: 32, 16: 32, 17: 64, 33: 64, 64: 64, 65: 128, 128: 128, 129: 128, 5000: 128}
    assert {t: moe_block_m(t) for t in hand} == hand
    with pytest.raises(ValueError, match=r"^tokens_per_expert must be >= 1, got 0$"):
        moe_block_m(0)


def _padded_rows_exact(n: int, k: int, e: int, block: int) -> Fraction:
    """E x E[ceil(X / block) x block], X ~ Binomial(n, k / e), in exact rationals: the sum
    over x of C(n, x) a^x (c - a)^(n - x) / c^n x ceil(x / block) x block, times e, where
    a / c = k / e in lowest terms; each integer term from the last (x (c - a) divides it)."""
    share = Fraction(k, e)
    a, c = share.numerator, share.denominator
    total, term = 0, (c - a) ** n  # x = 0: (c - a)^n
    for x in range(n + 1):
        total += term * -(-x // block) * block
        term = term * (n - x) * a // ((x + 1) * (c - a))
    return Fraction(total * e, c**n)


def test_expected_padded_rows_by_hand() -> None:
    """E[ceil(X / b) x b], X ~ Binomial(n, p): by hand on small cases, and against exact
    rationals at gpt-oss-120b's shapes (E 128, top-4): it is smooth in n at one tile, where
    the mean's tiles jumped (4,096 tokens: 256 rows an expert at 2 x 128 -> 4,100: 4)."""
    # n 3, p 1/2, tiles of 2: X = 0, 1, 2, 3 w.p. 1/8, 3/8, 3/8, 1/8 -> 0, 2, 2, 4 rows: 16 / 8
    assert expected_padded_rows(3, 0.5, 2) == pytest.approx(2.0, rel=1e-14)
    assert expected_padded_rows(0, 0.5, 2) == 0.0
    # one token, p 1/4, tiles of 16: a tile w.p. 1/4
    assert expected_padded_rows(1, 0.25, 16) == pytest.approx(4.0, rel=1e-14)
    # two tokens, p 1/32: a tile unless both miss, 1 - (31/32)^2 = 63/1024
    assert expected_padded_rows(2, 1 / 32, 16) == pytest.approx(16 * 63 / 1024, rel=1e-14)
    for n, block in ((543, 32), (544, 64), (1057, 64), (4096, 128), (4100, 128)):
        exact = _padded_rows_exact(n, 4, 128, block)
        assert 128 * expected_padded_rows(n, 4 / 128, block) == pytest.approx(float(exact), rel=1e-9)
    # the mean priced 1.00x the rows at 4,096 and 2.00x at 4,100; the expectation ~1.48x both
    at_4096, at_4100 = (float(_padded_rows_exact(n, 4, 128, 128)) / (4 * n) for n in (4096, 4100))
    assert 1.47 < at_4096 < at_4100 < 1.49
    # every token to every expert (top_k = E): 33 rows in tiles of 16 compute 48
    assert expected_padded_rows(33, 1.0, 16) == 48.0
    for bad in ((-1, 0.5, 2), (3, 0.0, 2), (3, 1.5, 2), (3, 0.5, 0)):
        with pytest.raises(ValueError, match=r"^need num_tokens >= 0, block_m >= 1 and 0 < share <= 1, got "):
            expected_padded_rows(*bad)


def test_mxfp4_experts_compute_whole_tiles_of_rows() -> None:
    """gpt-oss-120b's MXFP4 experts run in a ragged grouped GEMM that computes each expert's
    rows in whole tiles: a decode step of 1,057 sequences routes 4,228 rows, 33 an expert by
    the kernel's estimate (tiles of 64); each of the 128 experts gets Binomial(1,057, 1/32)
    rows and computes them in tiles of 64. FP8 DeepSeek-V3 experts are priced as before."""
    model = load_preset("gpt-oss-120b")
    cm = CostModel(model, H200)
    h, inter, vocab, layers = 2880, 2880, 201_088, 36
    eff = MXFP4_EXPERT_COMPUTE_EFFICIENCY["H200"]
    n = 1057
    padding = float(_padded_rows_exact(n, 4, 128, 64)) - 4 * n  # ~0.94x the rows
    assert 0.93 < padding / (4 * n) < 0.95
    hand = 2 * n * cm.active_params_per_token + 2 * n * vocab * h + layers * 2 * 3 * h * inter * padding
    cost = cm.step_cost([(1, 1500)] * n)
    assert cost.linear_flops == pytest.approx(hand, rel=1e-9)
    # compute-bound: the experts' computed rows (4 n real + padding) at their Hopper rate,
    # the rest at 0.5 (test_mxfp4_experts_run_at_their_hopper_efficiency)
    experts = layers * 2 * 3 * h * inter * (4 * n + padding)
    assert cost.gemm_s == pytest.approx((hand - experts) / (989e12 * 0.5) + experts / (989e12 * eff), rel=1e-9)
    # a prefill chunk of 8,192 tokens: 256 rows an expert on average in tiles of 128, which
    # an expert past 256 rows spills into a third: 24 % more rows than the real ones
    chunk = cm.step_cost([(8192, 8192)])
    padding = float(_padded_rows_exact(8192, 4, 128, 128)) - 4 * 8192
    assert 0.23 < padding / (4 * 8192) < 0.25
    assert chunk.linear_flops == pytest.approx(
        2 * 8192 * cm.active_params_per_token + 2 * vocab * h + layers * 2 * 3 * h * inter * padding, rel=1e-9
    )
    # the kernel's own tile switch stays a step in the cost: 543 decodes (16 rows an expert
    # by its estimate, tiles of 32) compute ~4,097 rows a layer, 544 (17, tiles of 64) 8,192
    rows = {b: 4 * b + cm._moe_tile_flops(b) / cm._moe_row_flops for b in (543, 544)}
    assert rows[543] == pytest.approx(float(_padded_rows_exact(543, 4, 128, 32)), rel=1e-9)
    assert rows[544] == pytest.approx(float(_padded_rows_exact(544, 4, 128, 64)), rel=1e-9)
    assert 4096 < rows[543] < 4098 and 8191 < rows[544] <= 8192
    # 8 decodes: 32 rows, tiles of 16 over ~28.6 experts, padding 14x the rows, but the GEMMs
    # still wait on the weights: the padding costs nothing
    small = cm.step_cost([(1, 1500)] * 8)
    assert small.linear_flops > 10 * 2 * 8 * cm.active_params_per_token
    assert small.gemm_s == small.weight_bytes / H200_EFFECTIVE_BW
    v3 = CostModel(load_preset("deepseek-v3"), H200, tp=8)  # FP8 experts: no tile term
    assert v3.step_cost([(1, 1500)] * n).linear_flops == pytest.approx(
        2 * n * v3.active_params_per_token + 2 * n * 129_280 * 7168 / 8, rel=1e-12
    )


def test_mxfp4_experts_run_at_their_hopper_efficiency() -> None:
    """On H100 and H200 gpt-oss-120b's MXFP4 experts' GEMMs compute their rows (padding
    included) at 0.257 x 1.081 of the BF16 peak: SGLang PR 38884's Marlin figure (254 of 989
    TFLOP/s useful) over the rows Marlin computed at its shape (16,384 tokens, top-6 of 256:
    384 rows an expert on average, Marlin's tiles of 64); the rest of the linear layers run
    at the compute efficiency; B200 and FP8 experts keep the one efficiency; steps bound by
    their weight reads do not change."""
    model = load_preset("gpt-oss-120b")
    h, inter, vocab, layers = 2880, 2880, 201_088, 36
    # Marlin's block_size_m: the first of 8, 16, 32, 48, 64 with rows an expert / block < 0.9, else 64
    block = next((b for b in (8, 16, 32, 48, 64) if 16384 * 6 / 256 / b < 0.9), 64)
    assert block == 64
    ratio = _padded_rows_exact(16384, 6, 256, block) / (16384 * 6)
    assert 1.080 < ratio < 1.082
    assert MXFP4_EXPERT_COMPUTE_EFFICIENCY.keys() == {"H100", "H200"}
    for eff in MXFP4_EXPERT_COMPUTE_EFFICIENCY.values():
        assert eff == pytest.approx(0.257 * float(ratio), rel=1e-11)
    eff = MXFP4_EXPERT_COMPUTE_EFFICIENCY["H100"]
    # a prefill chunk of 8,192 tokens: its expert rows, padding included (tiles of 128)
    computed = float(_padded_rows_exact(8192, 4, 128, 128))
    experts = layers * 2 * 3 * h * inter * computed
    for gpu in (H100, H200):
        cm = CostModel(model, gpu)
        cost = cm.step_cost([(8192, 8192)])
        dense = 2 * 8192 * cm.active_params_per_token + 2 * vocab * h - layers * 2 * 3 * h * inter * 8192 * 4
        assert cost.linear_flops == pytest.approx(dense + experts, rel=1e-9)
        assert cost.gemm_s == pytest.approx(dense / (989e12 * 0.5) + experts / (989e12 * eff), rel=1e-9)
        assert cost.compute_s == pytest.approx(
            cost.gemm_s + cost.attention_flops / (989e12 * 0.5), rel=1e-9
        )  # compute-bound: the GEMM phase is its compute
        # at TP 2 every expert's slice is half as wide: half the FLOPs, the same rate
        cm2 = CostModel(model, gpu, tp=2)
        cost2 = cm2.step_cost([(8192, 8192)])
        dense2 = 2 * 8192 * cm2.active_params_per_token + 2 * vocab * h / 2 - layers * 2 * 3 * h * inter * 8192 * 2
        assert cost2.gemm_s == pytest.approx(dense2 / (989e12 * 0.5) + experts / 2 / (989e12 * eff), rel=1e-9)
    # a compute efficiency set by hand moves the rest, not the experts
    cm = CostModel(model, H200, compute_efficiency=0.4)
    cost = cm.step_cost([(8192, 8192)])
    dense = 2 * 8192 * cm.active_params_per_token + 2 * vocab * h - layers * 2 * 3 * h * inter * 8192 * 4
    assert cost.gemm_s == pytest.approx(dense / (989e12 * 0.4) + experts / (989e12 * eff), rel=1e-9)
    # B200 has FP4 tensor cores and no figure here: its experts run at the one efficiency
    b200 = CostModel(model, B200).step_cost([(8192, 8192)])
    assert b200.gemm_s == pytest.approx(b200.linear_flops / (2.25e15 * 0.5), rel=1e-12)
    # 4 decodes wait on the weights (10.4 GB on an H100): the experts' rate changes nothing
    small = CostModel(model, H100).step_cost([(1, 500)] * 4)
    assert small.gemm_s == small.weight_bytes / (3.35e12 * 0.8)


# ----- DeepSeek-V3.2 and V4 ------------------------------------------------------------------


def test_v4_flash_decode_at_128k_reads_window_topk_indexer_and_hca_entries() -> None:
    model = load_preset("deepseek-v4-flash")
    v4 = model.dsv4
    cm = CostModel(model, H200)  # kv "auto": the 584 B serving entries, FP8 indexer keys
    ctx = 131_072
    entry, key = v4.main_entry_bytes(), v4.indexer_key_bytes("fp8")
    assert (entry, key, v4.window, v4.index_topk) == (584, 132, 128, 512)
    csa_entries, hca_entries = ctx // v4.csa_ratio, ctx // v4.hca_ratio
    expected = (
        v4.num_layers * min(ctx, v4.window) * entry  # 43 SWA windows
        + 21 * (csa_entries * key + min(csa_entries, v4.index_topk) * entry)  # CSA: all keys, top-k entries
        + 20 * hca_entries * entry  # HCA: every entry
    )
    assert expected == 112_286_720
    assert cm.kv_read_bytes(ctx) == expected
    full_attention = ctx * v4.num_layers * entry  # every token's entry in every layer
    assert cm.kv_read_bytes(ctx) < 0.04 * full_attention

    heads, d = v4.num_heads, v4.head_dim
    attention = (
        43 * 4 * heads * d * 128 + 21 * 4 * heads * d * 512 + 20 * 4 * heads * d * 1024
    ) + 21 * 2 * v4.index_n_heads * v4.index_head_dim * csa_entries
    assert cm.step_cost([(1, ctx)]).attention_flops == attention
    # and the decode writes its token: its classical share (a 128-token block's entries and
    # keys / 128) and its SWA entry in every layer
    written = v4.classical_bytes_per_token(SERVING, "fp8") + 43 * 584
    assert written == 3850.25 + 25_112
    assert cm.step_cost([(1, ctx)]).kv_bytes == expected + written


def test_v4_kv_in_fp32_matches_the_engines_own_storage_formula() -> None:
    v4 = load_preset("deepseek-v4-flash").dsv4
    cm = CostModel(load_preset("deepseek-v4-flash"), H200, kv_dtype="fp32")
    ctx = 1000
    # dsv4_runner.kv_read_bytes: fp32 entries of head_dim, fp32 keys of index_head_dim
    expected = 0
    for ratio in v4.layer_ratios:
        expected += min(ctx, 128) * 512 * 4
        if ratio == 4:
            expected += (ctx // 4) * 128 * 4 + min(ctx // 4, 512) * 512 * 4
        elif ratio:
            expected += (ctx // ratio) * 512 * 4
    assert cm.kv_read_bytes(ctx) == expected


def test_v32_attends_the_indexer_top_k_latents_but_scores_every_key() -> None:
    cm = CostModel(load_preset("deepseek-v3.2"), H200, tp=8)
    ctx = 131_072
    assert cm.kv_read_bytes(ctx) == 61 * (ctx * 132 + 2048 * 656)  # FP8 keys, 656 B FlashMLA latents
    assert cm.kv_read_bytes(1000) == 61 * 1000 * (132 + 656)


# ----- devices ----------------------------------------------------------------------------


def test_gpu_presets_carry_data_sheet_flops_and_old_positional_specs_still_build() -> None:
    assert (GPUS["H100"].peak_bf16_flops, GPUS["H100"].peak_fp8_flops) == (989e12, 1979e12)
    assert (GPUS["H200"].peak_bf16_flops, GPUS["H200"].peak_fp8_flops) == (989e12, 1979e12)
    assert (GPUS["B200"].peak_bf16_flops, GPUS["B200"].peak_fp8_flops) == (2.25e15, 4.5e15)
    toy = GPUSpec("toy", 2 << 20, 1e12)
    assert toy.kind == "cuda" and math.isnan(toy.peak_bf16_flops)
    with pytest.raises(ValueError, match="peak_fp8_flops must be positive"):
        GPUSpec("bad", 1 << 30, 1e12, peak_fp8_flops=-1.0)


def test_a_gpu_without_a_flops_figure_gives_a_clear_error() -> None:
    model = load_preset("llama-3.1-8b")
    mystery = GPUSpec("mystery", 80 * GIB, 3e12)
    cm = CostModel(model, mystery)
    assert cm.kv_read_bytes(10) == 10 * 131_072  # bytes need no FLOPs figure
    with pytest.raises(ValueError, match="GPU mystery has no bf16 FLOPs figure"):
        cm.step_time([(1, 10)])
    with pytest.raises(ValueError, match="has no bf16 FLOPs figure"):
        CostModel(model, custom_gpu(80)).step_time([(1, 10)])
    no_bandwidth = GPUSpec("fast", 80 * GIB, math.inf, peak_bf16_flops=1e15)
    with pytest.raises(ValueError, match="GPU fast has no bandwidth figure"):
        CostModel(model, no_bandwidth).step_time([(1, 10)])
    with pytest.raises(ValueError, match="has no bf16 FLOPs figure"):
        CostModel(load_preset("smollm2-135m"), cpu_preset(), "bf16", "fp32").step_time([(1, 10)])


def test_cpu_preset_runs_the_engines_fp32_model_at_the_measured_figures() -> None:
    cpu = cpu_preset()
    assert (cpu.kind, cpu.hbm_bandwidth_bytes_per_s, cpu.peak_fp32_flops) == ("cpu", 33.2e9, 179e9)
    cm = CostModel(load_preset("smollm2-135m"), cpu)  # "auto" on a CPU: the engine's fp32 weights and KV
    assert (cm.weights.weight_dtype, cm.layout.kv_dtype) == ("fp32", "fp32")
    # what the engine reaches of those peaks (sim/cost.py: fitted by kvpool bench sim)
    assert (cm.compute_efficiency, cm.bandwidth_efficiency, cm.step_overhead_s) == (0.76, 0.56, 0.0)
    assert (cm.seq_overhead_s, cm.prefill_chunk_overhead_s) == (8.7e-3, 66e-3)
    assert cm.kv_read_bytes(100) == 100 * 30 * 2 * 3 * 64 * 4  # fp32 K and V, like the engine's pool
    decode = cm.step_cost([(1, 100)])
    weights = 134_515_008 * 4  # every fp32 weight (tied head)
    assert decode.weight_bytes == pytest.approx(weights + 576 * 4, rel=1e-12)
    assert decode.time_s == pytest.approx((weights + 576 * 4 + decode.kv_bytes) / (33.2e9 * 0.56) + 8.7e-3, rel=1e-12)
    # the batch-1 decodes the fit timed: 37.5-39.2 ms (kvpool bench sim, 2026-12-02)
    assert decode.time_s == pytest.approx(38e-3, rel=0.05)


def test_per_sequence_and_per_prefill_chunk_overheads_add_to_the_roofline() -> None:
    model = load_preset("smollm2-135m")
    bare = CostModel(model, H200, step_overhead_s=1e-3)
    cm = CostModel(model, H200, step_overhead_s=1e-3, seq_overhead_s=2e-3, prefill_chunk_overhead_s=5e-3)
    chunks = [(1, 100), (1, 200), (32, 300), (300, 300)]  # two decodes, two prefill chunks
    assert cm.step_time(chunks) == pytest.approx(bare.step_time(chunks) + 4 * 2e-3 + 2 * 5e-3, rel=1e-12)
    assert cm.step_time([(1, 100)]) == pytest.approx(bare.step_time([(1, 100)]) + 2e-3, rel=1e-12)
    with pytest.raises(ValueError, match="prefill_chunk_overhead_s must be >= 0, got -1"):
        CostModel(model, H200, prefill_chunk_overhead_s=-1)


def _times_of(cm: CostModel, batch: int = 8, n_pf: int = 256, n_ps: int = 64) -> EngineStepTimes:
    """The step times `time_engine_steps` would measure if the engine ran exactly as `cm` says."""
    return EngineStepTimes(
        batch,
        n_pf,
        n_ps,
        cm.step_time([(1, n_pf + 4)]),
        cm.step_time([(1, n_pf + 4)] * batch),
        cm.step_time([(n_pf, n_pf)]),
        cm.step_time([(n_ps, n_ps)]),
    )


def _cpu_model(model, compute: float, bandwidth: float, step_overhead_s: float) -> CostModel:
    return CostModel(
        model,
        cpu_preset(),
        compute_efficiency=compute,
        bandwidth_efficiency=bandwidth,
        step_overhead_s=step_overhead_s,
        seq_overhead_s=8e-3,
        prefill_chunk_overhead_s=50e-3,
    )


def test_the_engine_fit_recovers_the_parameters_that_made_the_times() -> None:
    model, cpu = load_preset("smollm2-135m"), cpu_preset()
    bw = DEVICE_DEFAULTS["cpu"].bandwidth_efficiency
    truth = _cpu_model(model, 0.7, bw, 2e-3)
    fit = fit_engine(_times_of(truth))
    got = (fit.compute_efficiency, fit.bandwidth_efficiency, fit.step_overhead_s, fit.seq_overhead_s)
    assert got + (fit.prefill_chunk_overhead_s,) == pytest.approx((0.7, bw, 2e-3, 8e-3, 50e-3), rel=1e-9)
    # weights that stream faster than the default: no step overhead, the bandwidth is fitted
    fast = _cpu_model(model, 0.7, 0.8, 0.0)
    fit = fit_engine(_times_of(fast))
    assert (fit.bandwidth_efficiency, fit.step_overhead_s) == pytest.approx((0.8, 0.0), abs=1e-9)
    # a fit predicts the steps it was fitted on
    assert fit.cost_model(model, cpu).step_time([(64, 64)]) == pytest.approx(fast.step_time([(64, 64)]), rel=1e-9)
    # times no machine of this model gives (a batch of 8 decodes 20x one): refused, named
    busy = EngineStepTimes.mean(_times_of(truth), _times_of(truth))
    busy = dataclasses.replace(busy, decode_b_s=20 * busy.decode_1_s, decode_1_s=busy.decode_1_s / 3)
    with pytest.raises(RuntimeError, match="do not fit the cost model .* another process using the CPUs"):
        fit_engine(busy)
    with pytest.raises(ValueError, match="timed different steps"):
        EngineStepTimes.mean(_times_of(truth), _times_of(truth, batch=4))


# ----- inputs -----------------------------------------------------------------------------


def test_bad_inputs_raise_value_errors_that_name_them() -> None:
    cm = CostModel(load_preset("smollm2-135m"), H200)
    with pytest.raises(ValueError, match="chunk 1: num_new_tokens must be >= 1, got -3"):
        cm.step_time([(1, 5), (-3, 10)])
    with pytest.raises(ValueError, match="chunk 0: context_len=4 is shorter than its num_new_tokens=8"):
        cm.step_time([(8, 4)])
    with pytest.raises(ValueError, match="at least one chunk"):
        cm.step_time([])
    with pytest.raises(ValueError, match="context_len must be a non-negative integer, got -1"):
        cm.kv_read_bytes(-1)
    with pytest.raises(ValueError, match="compute_efficiency must be in"):
        CostModel(load_preset("smollm2-135m"), H200, compute_efficiency=1.5)
    with pytest.raises(ValueError, match="unknown weight dtype 'int3'"):
        CostModel(load_preset("smollm2-135m"), H200, weight_dtype="int3")
    with pytest.raises(ValueError, match="unknown kv dtype 'fp4'"):
        CostModel(load_preset("smollm2-135m"), H200, kv_dtype="fp4")


# ----- the closed form and its naive twin ---------------------------------------------------


@given(
    lo=st.integers(0, 700),
    extra=st.integers(0, 700),
    tokens_per_entry=st.sampled_from([1, 4, 128]),
    cap=st.one_of(st.none(), st.integers(1, 300)),
)
def test_sum_visible_matches_the_loop(lo: int, extra: int, tokens_per_entry: int, cap: int | None) -> None:
    hi = lo + extra
    naive = sum(
        k // tokens_per_entry if cap is None else min(cap, k // tokens_per_entry) for k in range(lo + 1, hi + 1)
    )
    assert sum_visible(lo, hi, tokens_per_entry, cap) == naive


def test_calibrate_measures_positive_figures_in_this_process() -> None:
    from kvpool.sim.calibrate import calibrate

    figures = calibrate(buffer_mib=8, repeats=2)
    assert figures["read_bandwidth_bytes_per_s"] > 0
    assert set(figures["fp32_matmul_flops"]) == {"smollm2_step_256x576x1536", "square_2048"}
    assert all(v > 0 for v in figures["fp32_matmul_flops"].values())


def test_v4_restore_costs_a_copy_by_its_bytes_and_a_replay_by_its_flops() -> None:
    from kvpool.sim.cost import RestoreCostModel

    cm = CostModel(load_preset("deepseek-v4-flash"), H200, tp=2)
    price = RestoreCostModel(cm, 4_074_496)  # a V4-Flash snapshot at a span boundary
    assert price.checkpoint_cost() == pytest.approx(2 * 4_074_496 / H200_EFFECTIVE_BW, rel=1e-12)  # 2.1 us
    # the replay of n_win x layers = 5,504 tokens: at least their 2 x N x active parameters
    # (6.4B active per token on each GPU of V4-Flash at tp 2) at half the FP8 peak: 84 ms
    replay = price.compute_cost(5504, 5504)
    assert replay >= 2 * 5504 * cm.active_params_per_token / (1979e12 * 0.5)
    assert replay > 1000 * price.checkpoint_cost()
    assert price.compute_cost(64, 5504) < price.compute_cost(128, 5504) < replay


def test_v4_restore_compute_cost_kept_per_length_pair_equals_the_step_cost_each_time() -> None:
    from kvpool.sim.cost import RestoreCostModel

    cm = CostModel(load_preset("deepseek-v4-flash"), H200, tp=2)
    price = RestoreCostModel(cm, 4_074_496)
    pairs = [(n, ctx) for ctx in (128, 1024, 5504, 8192) for n in (1, 64, 128, ctx)]
    for _ in range(2):  # the second round reads what the first kept
        for n, ctx in pairs:
            assert price.compute_cost(n, ctx) == cm.step_cost([(n, ctx)]).compute_s, (n, ctx)
    # the 15 pairs cost 15 different times: a value kept under the wrong key would show
    assert len({price.compute_cost(n, ctx) for n, ctx in set(pairs)}) == len(set(pairs)) == 15
    # a bool or a float equal to a kept key is not served from it: step_cost refuses it
    with pytest.raises(ValueError, match="num_new_tokens must be an integer, got True"):
        price.compute_cost(True, 128)
    with pytest.raises(ValueError, match="context_len must be an integer, got 128.0"):
        price.compute_cost(1, 128.0)
