"""`kvpool run --json` and `kvpool bench engine` end to end (small workloads); generate is in
test_generate_cli.py."""

from __future__ import annotations

import json

import pytest
import torch

from kvpool.cli.main import main

RUN_KEYS = {
    "kv_capacity_tokens",
    "kv_capacity_bytes",
    "block_size",
    "fragmentation",
    "prefix_hit_rate",
    "alloc_latency_us",
    "read_bandwidth_gbps",
    "ttft_ms_p50",
    "ttft_ms_p99",
    "tpot_ms_p50",
    "tpot_ms_p99",
    "throughput_tok_s",
    "goodput_req_s",
    "preemptions",
    "num_requests",
}


def test_run_json_report(capsys):
    threads = torch.get_num_threads()
    try:
        args = ["run", "--json", "--num-requests", "4", "--num-long", "1", "--max-tokens", "4", "--threads", "1"]
        assert main(args) == 0
    finally:
        torch.set_num_threads(threads)
    report = json.loads(capsys.readouterr().out)
    assert RUN_KEYS <= set(report)
    assert report["num_requests"] == 4 * 2 + 1  # two turns per conversation + the long prompt
    assert report["prefix_hit_rate"] > 0  # shared system prompts and follow-up turns hit the cache
    assert report["kv_capacity_tokens"] == report["num_blocks"] * report["block_size"]
    assert 0 <= report["fragmentation"] < 1


def test_bench_attention_times_every_path_after_checking_it():
    # bench_attention asserts each paged path equals contiguous SDPA before timing it
    from kvpool.cli.bench_engine import bench_attention
    from kvpool.kernels import cpu_kernels

    report = bench_attention(2, 64, 16, 9, 3, 64)
    paths = {"paged_bags_ms", "paged_padded_ms", "contiguous_sdpa_ms"}
    if cpu_kernels() is not None:
        paths.add("paged_native_ms")
    assert paths <= set(report) and all(report[p] > 0 for p in paths)


def test_bench_engine_glue_json(capsys):
    threads = torch.get_num_threads()
    try:
        assert main(["bench", "engine", "--parts", "glue", "--json", "--threads", "1"]) == 0
    finally:
        torch.set_num_threads(threads)
    captured = capsys.readouterr()
    glue = json.loads(captured.out)["glue"]
    # stdout is not a terminal here: one progress line per phase on stderr, none on stdout
    assert captured.err == "bench engine: loading the model ...\nbench engine: glue ...\n"
    assert 500 < glue["weight_mb"] < 600  # SmolLM2-135M's layers + lm_head in fp32
    timed = ["matmuls_ms", "torch_rms_norm_us", "torch_silu_mul_us", "sample_top_p_ms", "sample_top_p_full_sort_ms"]
    assert all(glue[k] > 0 for k in timed)


def test_bench_engine_refuses_unknown_parts_and_bad_shapes(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "engine", "--parts", "decode,nonsense"])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.endswith(
        "kvpool bench engine: error: argument --parts: unknown 'nonsense' in 'decode,nonsense'; "
        "choose from decode,ttft,attention,glue\n"
    )
    # checked before the model loads
    assert main(["bench", "engine", "--parts", "attention", "--attn-context", "1000"]) == 2
    assert "--attn-context 1000 must be a multiple of 256" in capsys.readouterr().err
    assert main(["bench", "engine", "--model", "tiny-dsv4"]) == 2
    assert "kvpool bench dsv4" in capsys.readouterr().err
