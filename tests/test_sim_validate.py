"""Predicted against published (kvpool.sim.validate): every row carries its source and the
figure as the source printed it, the docs table is what the validation computes today, and
one row's prediction is computed here by hand from the model's shapes and the GPU's data."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest

from kvpool.sim.gpufit import load_fit
from kvpool.sim.validate import (
    PublishedRow,
    RowResult,
    SettingSource,
    as_json,
    load_rows,
    main,
    markdown_table,
    simulate_row,
    validate,
)

DOCS = Path(__file__).parent.parent / "docs" / "simulator.md"


def test_every_row_names_its_source_and_quotes_the_figure_it_reports() -> None:
    rows = load_rows()
    assert len(rows) >= 8
    for row in rows:
        quoted = " ".join(q.replace(",", "") for q in row.quote)
        assert repr(row.published).removesuffix(".0") in quoted, row.id  # the figure is read off its quote
        assert row.source_url.startswith("https://") and row.assumed, row.id
    # the mix the issue asks for: low batch and saturation, dense and MoE, TP 1 and more, H100 and H200
    assert {r.concurrency is None for r in rows} == {True, False}
    assert {r.model for r in rows} >= {"llama-3.1-8b", "gpt-oss-120b"}
    assert {r.tp for r in rows} >= {1, 2, 4} and {r.gpu for r in rows} == {"H100", "H200"}
    assert {r.metric for r in rows} >= {
        "latency_ms",
        "ttft_ms",
        "tpot_ms",
        "output_tok_s",
        "output_tok_s_per_gpu",
        "total_tok_s",
    }


def test_a_run_of_n_requests_at_once_is_the_run_its_quote_reports_under_its_engines_limits() -> None:
    """GPUStack's vLLM runs: each row's request count is the benchmark's "Successful requests",
    its figure the run's own line, and the scheduler limits it sets are read off a cited page."""
    runs = [r for r in load_rows() if r.num_requests is not None]
    assert len(runs) >= 6
    for row in runs:
        assert any(re.fullmatch(rf"Successful requests: +{row.num_requests}", q) for q in row.quote), row.id
        assert row.metric == "total_tok_s" and row.concurrency is None, row.id
        cited = {s.settles for s in row.setting_sources}
        assert {"max_num_seqs", "max_num_batched_tokens"} <= cited, row.id
        for source in row.setting_sources:  # the limit, as the cited code sets it for an API server
            if source.settles not in ("max_num_seqs", "max_num_batched_tokens"):
                continue
            limit = getattr(row, source.settles)
            assert any(q.strip() == f"UsageContext.OPENAI_API_SERVER: {limit}," for q in source.quote), row.id


def test_a_kv_format_read_off_another_page_is_what_that_page_maps_the_checkpoint_to() -> None:
    """TensorRT-LLM's dense rows take their KV format from the benchmarking page their perf
    overview links: its table maps a checkpoint's compute and KV quantization to the cache
    trtllm-bench runs. Every mapping row quoted for the row's weight format (whatever the
    checkpoint's own KV entry) must give the row's KV dtype."""
    cited = [r for r in load_rows() if any(s.settles == "kv_dtype" for s in r.setting_sources)]
    assert {r.id for r in cited} >= {"trtllm-8b-h200-max", "trtllm-70b-h100-tp2-max"}
    for row in cited:
        (source,) = [s for s in row.setting_sources if s.settles == "kv_dtype"]
        assert source.url.startswith("https://github.com/NVIDIA/TensorRT-LLM/blob/"), row.id
        table = [[c.strip(" `") for c in q.strip("| ").split("|")] for q in source.quote if q.startswith("| ")]
        mapped = {kv for compute, _checkpoint_kv, kv, _note in table if compute.lower() == row.weight_dtype}
        assert mapped == {row.kv_dtype.upper()}, row.id  # FP8 checkpoint, FP8 or null KV: an FP8 cache


def test_the_docs_table_is_what_the_validation_computes_now() -> None:
    page = DOCS.read_text()
    shown = re.search(r"<!-- validate:begin -->\n(.*?)\n<!-- validate:end -->", page, re.S)
    assert shown is not None
    assert shown.group(1).strip() == markdown_table(validate(load_rows()))


def _batch_of_8_ms_by_hand() -> float:
    """vLLM's latency benchmark row: 8 prompts of 32 tokens, 128 tokens each, Llama-3.1-8B in
    bf16 on one H200 with the cuda defaults (compute 0.5, bandwidth 0.8, 0.75 ms a step, 76 us
    a layer when a step does not replay a CUDA graph) and the H200's 36.6 us of fixed GPU
    time a layer, every step. One prefill step of the 8 prompts (it
    gives each its first token), then 127 decode steps of 8 sequences at 33 .. 159 tokens of
    context; every phase at its own roofline."""
    h, layers, heads, kv_heads, d, inter, vocab = 4096, 32, 32, 8, 128, 14336, 128_256
    linear = layers * (h * h + 2 * h * kv_heads * d + h * h + 3 * h * inter)  # per token, the head apart
    norms = layers * 2 * h + h
    dense_bytes = 2 * (linear + norms + vocab * h)  # bf16; the untied embedding table is not read whole
    kv_per_token = layers * 2 * kv_heads * d * 2  # K and V, bf16
    flop_s, byte_s = 989e12 * 0.5, 4.8e12 * 0.8
    attention_per_entry = layers * 4 * heads * d  # QK^T and PV, one query and one key

    def gemm_s(num_tokens: int, num_seqs: int) -> float:
        flops = 2 * num_tokens * linear + 2 * num_seqs * vocab * h  # one logits row per sequence
        return max(flops / flop_s, (dense_bytes + num_tokens * h * 2) / byte_s)

    causal = sum(range(1, 33))  # the prompt's queries see 1 .. 32 tokens
    prefill = (
        gemm_s(8 * 32, 8)
        + max(8 * attention_per_entry * causal / flop_s, 8 * 2 * 32 * kv_per_token / byte_s)  # read + write
        + 0.75e-3
        + 32 * 76e-6
        + 32 * 36.6e-6
    )
    decodes = sum(
        gemm_s(8, 8)
        + max(8 * attention_per_entry * ctx / flop_s, 8 * (ctx + 1) * kv_per_token / byte_s)
        + 0.75e-3
        + 32 * 36.6e-6
        for ctx in range(33, 160)
    )
    return (prefill + decodes) * 1e3


def test_a_batch_of_8_decodes_latency_by_hand() -> None:
    row = next(r for r in load_rows() if r.id == "vllm-8b-h200-b8")
    hand_ms = _batch_of_8_ms_by_hand()
    assert hand_ms == pytest.approx(755.40, abs=0.01)  # and the validation's figure, by the simulator:
    assert simulate_row(row).predicted == pytest.approx(hand_ms, abs=0.005)


def test_total_and_output_tokens_per_second_of_the_batch_of_8_by_hand() -> None:
    """The same wave read as throughput: its 8 requests end together, so the span is the
    latency by hand; output counts the 8 x 128 generated tokens, total adds the 8 x 32 of
    the prompts (vLLM's "Total Token throughput")."""
    row = next(r for r in load_rows() if r.id == "vllm-8b-h200-b8")
    span_s = _batch_of_8_ms_by_hand() / 1e3
    output = simulate_row(dataclasses.replace(row, metric="output_tok_s")).predicted
    total = simulate_row(dataclasses.replace(row, metric="total_tok_s")).predicted
    assert output == pytest.approx(8 * 128 / span_s, rel=1e-5)  # 1,355.6 tok/s
    assert total == pytest.approx(8 * (32 + 128) / span_s, rel=1e-5)  # 1,694.5 tok/s


def test_n_requests_at_once_past_the_engines_batch_run_as_waves_of_that_batch() -> None:
    """16 equal requests sent at once to an engine of at most 4 sequences: four waves, each
    the one a client keeping 4 in flight runs (the concurrency path, an independent twin),
    back to back: the same tokens per second, and the same per wave."""
    row = next(r for r in load_rows() if r.id == "vllm-8b-h200-b8")
    closed = dataclasses.replace(row, concurrency=4, metric="total_tok_s")
    at_once = dataclasses.replace(closed, concurrency=None, num_requests=16, max_num_seqs=4)
    assert "16 requests at once" in at_once.configuration
    twin, run = simulate_row(closed), simulate_row(at_once)
    assert (run.batch, twin.batch) == (16, 4) and run.preemptions == 0
    assert run.predicted == pytest.approx(twin.predicted, rel=1e-4)
    # without the engine's limit all 16 run as one wave, a different (faster) run
    assert simulate_row(dataclasses.replace(at_once, max_num_seqs=None)).predicted > 1.5 * run.predicted


def test_a_loop_over_answers_of_varying_length_decodes_beside_the_prefills_that_replace_its_neighbours() -> None:
    """GPUStack's ShareGPT run: 100 requests, 4 in flight, lengths varying. Spread as
    varying lengths spread them, each request's 216 decode intervals are 213 steps of 4
    decodes and 3 steps where a neighbour's replacement prefills its 229 tokens beside 3
    decodes, priced here by the cost model alone at the decodes' mean context (the steps'
    attention is linear in it). Equal waves (the row without the spread) have no such step."""
    from kvpool.sim.cost import CostModel
    from kvpool.spec.gpus import get_gpu
    from kvpool.spec.models import load_preset

    row = next(r for r in load_rows() if r.id == "gpustack-gptoss120b-h100-tp1-sharegpt-c4")
    assert (row.staggered_requests, row.concurrency, row.input_len, row.output_len) == (100, 4, 229, 217)
    cost = CostModel(load_preset("gpt-oss-120b"), get_gpu("H100"), tp=1, kv_dtype="bf16")
    ctx = 229 + 1 + 108  # the mean context after a step, over one request's decodes and its neighbours'
    decode = cost.step_cost([(1, ctx)] * 4).time_s
    mixed = cost.step_cost([(1, ctx)] * 3 + [(229, 229)]).time_s  # a 229-token prefill reads all 128 experts
    assert mixed > 4 * decode
    spread = simulate_row(row)
    assert spread.batch == 100 and spread.preemptions == 0
    assert spread.predicted == pytest.approx((213 * decode + 3 * mixed) / 216 * 1e3, rel=2e-3)  # 6.28 ms
    waves = simulate_row(dataclasses.replace(row, staggered_requests=None))
    assert waves.batch == 4 and waves.predicted == pytest.approx(decode * 1e3, rel=2e-3)  # 5.96 ms
    # the engine's own limit (vLLM's default 256) never lifts the client's 4 in flight
    limited = simulate_row(dataclasses.replace(row, max_num_seqs=256))
    assert limited.predicted == spread.predicted


def test_a_row_without_its_source_or_with_an_unknown_metric_is_refused() -> None:
    row = load_rows()[0]
    with pytest.raises(ValueError, match=r"^row vllm-8b-h200-b8: unknown metric 'tokens'; known: latency_ms, "):
        dataclasses.replace(row, metric="tokens")
    with pytest.raises(ValueError, match=r"needs a positive published figure, its quote and its https source$"):
        PublishedRow(**{**dataclasses.asdict(row), "quote": ()})
    with pytest.raises(ValueError, match=r"^row vllm-8b-h200-b8: num_requests \(all sent at once\) and a concurrency"):
        dataclasses.replace(row, num_requests=100)
    with pytest.raises(ValueError, match=r"^row vllm-8b-h200-b8: max_num_seqs must be >= 1 or null, got 0$"):
        dataclasses.replace(row, max_num_seqs=0)
    stagger = r"^row vllm-8b-h200-b8: staggered_requests \({}\) runs through a concurrency and needs more requests "
    with pytest.raises(ValueError, match=stagger.format(8) + r"than it \(concurrency 8\)$"):
        dataclasses.replace(row, staggered_requests=8, metric="tpot_ms")
    with pytest.raises(ValueError, match=stagger.format(100) + r"than it \(concurrency None\)$"):
        dataclasses.replace(row, concurrency=None, staggered_requests=100, metric="tpot_ms")
    with pytest.raises(ValueError, match=r"^row vllm-8b-h200-b8: staggered_requests times no latency_ms \(queued"):
        dataclasses.replace(row, staggered_requests=100)
    with pytest.raises(ValueError, match=r"of output_len, which needs output_len >= 8, got 4$"):
        dataclasses.replace(row, staggered_requests=100, metric="tpot_ms", output_len=4)
    for bad in (SettingSource("kv_format", "https://x.org/p", ("FP8",)), SettingSource("kv_dtype", "x.org", ("FP8",))):
        with pytest.raises(ValueError, match=r"^row vllm-8b-h200-b8: a setting source needs a row field to settle"):
            dataclasses.replace(row, setting_sources=(bad,))
    cited = next(r for r in load_rows() if r.setting_sources)
    (shown,) = as_json([RowResult(cited, predicted=1.0, batch=1, preemptions=0)])
    assert shown["setting_sources"] == [
        {"settles": s.settles, "url": s.url, "quote": list(s.quote)} for s in cited.setting_sources
    ]


def test_the_command_prints_each_row_with_its_source_and_both_predictions(tmp_path, capsys) -> None:
    row = next(r for r in load_rows() if r.id == "nim-70b-h100-tp2-c1-500-itl")  # one request: cheap
    raw = {**dataclasses.asdict(row), "quote": list(row.quote)}
    path = tmp_path / "one.json"
    path.write_text(json.dumps({"rows": [raw]}))
    main(["--data", str(path), "--json", "--calibration", "h200-issue31"])
    (printed,) = json.loads(capsys.readouterr().out)
    assert printed["source_url"] == row.source_url and printed["quote"] == list(row.quote)
    assert printed["ratio"] == pytest.approx(printed["predicted"] / 18.91, rel=1e-12)
    assert printed["error"] == ("too fast" if printed["ratio"] < 1 else "too slow")
    fitted = simulate_row(row, load_fit("h200-issue31").overrides()).predicted
    assert printed["predicted_calibrated"] == fitted != printed["predicted"]
    path.write_text(json.dumps({"rows": [{**raw, "metric": "tokens"}]}))
    with pytest.raises(SystemExit):
        main(["--data", str(path)])
    assert "row nim-70b-h100-tp2-c1-500-itl: unknown metric 'tokens'" in capsys.readouterr().err


def _pool_holds(row: PublishedRow, max_num_seqs: int) -> int:
    """Requests of the row's length the planner's pool holds under max_num_seqs, in the row's
    layout: the planner's count (windows freed past the window), or for "paged" the pool
    over whole requests of every layer's blocks, by hand: 16-token blocks of gpt-oss-120b's
    36 layers x K and V x 8 heads x 64 x 2 bytes (bf16), 73,728 bytes a token."""
    from kvpool.capacity.planner import plan
    from kvpool.sim.simulator import engine_assumptions
    from kvpool.sim.validate import engine_gpu, max_step_tokens
    from kvpool.spec.models import load_preset

    limits = engine_assumptions(max_num_seqs, max_step_tokens(row), "graph")
    deployment = {"tp": row.tp, "kv_dtype": row.kv_dtype, "weight_dtype": row.weight_dtype}
    ctx = row.input_len + row.output_len
    p = plan(
        load_preset(row.model), engine_gpu(row), num_gpus=row.tp, context_len=ctx, assumptions=limits, **deployment
    )
    if row.kv_layout == "paged":
        assert row.model == "gpt-oss-120b" and row.kv_dtype == "bf16" and row.tp == 1
        block = 16 * 36 * 2 * 8 * 64 * 2
        return int(p.ledger.pool_bytes) // (-(-ctx // 16) * block)
    return p.max_concurrent_per_replica


def test_a_max_throughput_wave_is_the_most_its_own_pool_holds() -> None:
    """An "all at once" wave runs on the pool the ledger leaves under the wave's own limits
    (max_num_seqs the wave): sized under the default 256 it no longer fit once the simulated
    pool followed the limits (gpt-oss-120b H200 1,000 / 1,000: 11 preemptions, 32,768 /
    1,024: 1, 65 of its 66 running). Each max row's wave fits that pool and one more would not."""
    from kvpool.sim.validate import MAX_BATCH, max_wave
    from kvpool.spec.gpus import get_gpu
    from kvpool.spec.models import load_preset

    rows = [r for r in load_rows() if r.concurrency is None and r.num_requests is None]
    assert len(rows) == 8 and all(r.max_num_seqs is None for r in rows)
    for row in rows:
        deployment = {"tp": row.tp, "kv_dtype": row.kv_dtype, "weight_dtype": row.weight_dtype}
        batch = max_wave(row, load_preset(row.model), get_gpu(row.gpu), deployment)
        assert _pool_holds(row, batch) >= batch, row.id
        assert batch == MAX_BATCH or _pool_holds(row, batch + 1) < batch + 1, row.id
    row = next(r for r in rows if r.id == "trtllm-gptoss120b-h200-32k1k-max")
    assert simulate_row(row).preemptions == 0
    # every layer holding every token, gpt-oss's pool holds about half the requests it holds
    # with its 18 sliding layers' blocks freed past their 128-token window
    gptoss = next(r for r in rows if r.id == "trtllm-gptoss120b-h200-1k8k-max")
    assert gptoss.kv_layout == "paged"
    deployment = {"tp": 1, "kv_dtype": "bf16", "weight_dtype": "auto"}
    paged = max_wave(gptoss, load_preset(gptoss.model), get_gpu("H200"), deployment)
    hybrid = dataclasses.replace(gptoss, kv_layout=None)
    windowed = max_wave(hybrid, load_preset(gptoss.model), get_gpu("H200"), deployment)
    assert (paged, windowed) == (122, 240)
    assert simulate_row(gptoss).preemptions == 0


def test_an_engines_pool_settings_are_each_read_off_its_cited_code() -> None:
    """The KV pool settings a row takes from its engine (module docstring): each row that sets
    one otherwise than the simulator's default cites the code that settles it, and the value
    is the one its quote reads; the rows of one engine take the same (a default applies to
    every row of that engine whose command leaves it unset)."""
    rows = load_rows()
    for row in rows:
        cited: dict[str, list[str]] = {}  # settles -> the lines quoted for it, over its sources
        for src in row.setting_sources:
            assert src.url.startswith("https://github.com/"), row.id
            cited.setdefault(src.settles, []).extend(q.strip() for q in src.quote)
        if row.gpu_memory_utilization != 1.0:
            assert row.gpu_memory_utilization == 0.9 and row.engine.startswith("vLLM"), row.id
            assert "gpu_memory_utilization: float = Field(default=0.9, gt=0, le=1)" in cited["gpu_memory_utilization"]
        if row.enable_prefix_caching:
            assert row.engine == "vLLM 0.10.2 (GPUStack)", row.id
            default_on = '"""Whether to enable prefix caching. Enabled by default for V1."""'
            assert default_on in cited["enable_prefix_caching"], row.id
        if row.kv_layout is not None:
            assert row.kv_layout == "paged" and row.engine == "TensorRT-LLM", row.id
            quoted = cited["kv_layout"]
            assert "self.max_attention_window_vec = [max_seq_len]" in quoted  # the manager's default window
            assert "kv_cache_config:" in quoted and not any("max_attention_window:" in q for q in quoted)
    # uniform: every GPUStack row takes vLLM's defaults, every TensorRT-LLM gpt-oss row the paged pool
    gpustack = [r for r in rows if r.engine.startswith("vLLM 0.10.2")]
    assert len(gpustack) == 8 and all(r.enable_prefix_caching and r.gpu_memory_utilization == 0.9 for r in gpustack)
    assert all(r.gpu_memory_utilization == 0.9 for r in rows if r.engine == "vLLM")
    trt_gptoss = [r for r in rows if r.engine == "TensorRT-LLM" and r.model == "gpt-oss-120b"]
    assert len(trt_gptoss) == 4 and all(r.kv_layout == "paged" for r in trt_gptoss)
    assert all(r.kv_layout is None for r in rows if r.model != "gpt-oss-120b")  # no sliding windows: one layout
    bad = dataclasses.replace(rows[0], kv_layout=None)
    with pytest.raises(ValueError, match=r"^row vllm-8b-h200-b8: unknown kv_layout 'pages'; one of "):
        dataclasses.replace(bad, kv_layout="pages")
    with pytest.raises(ValueError, match=r"^row vllm-8b-h200-b8: gpu_memory_utilization must be in \(0, 1\], got 0$"):
        dataclasses.replace(bad, gpu_memory_utilization=0)


def test_a_preempted_request_finds_its_own_blocks_in_the_prefix_cache() -> None:
    """GPUStack's 32,000-token prompts on one H100 (vLLM's defaults: 0.9 of the GPU, the prefix
    cache on): the pool holds a few such requests, so the engine preempts; with the prefix
    cache a preempted request re-admitted finds the blocks it had computed while they stand,
    and computes again only what was evicted. Without the cache it computes its whole prompt
    again: the same run, slower."""
    row = next(r for r in load_rows() if r.id == "gpustack-gptoss120b-h100-tp1-32k")
    row = dataclasses.replace(row, num_requests=30)
    cached = simulate_row(row)
    recomputed = simulate_row(dataclasses.replace(row, enable_prefix_caching=False))
    assert cached.preemptions > 0 and recomputed.preemptions > 0
    assert cached.predicted > 2 * recomputed.predicted  # 19,517 against 8,378 tok/s (8 and 210 preemptions)
