"""`kvpool bench pool` runs its traces to completion with their own correctness checks and
prints one JSON object with the figures docs/benchmarks.md quotes. Timings are not asserted; the
counts are, from the trace definitions (src/kvpool/bench/pool.py)."""

from __future__ import annotations

import json

import pytest

from kvpool.cli.main import main


def test_bench_pool_json_counts_follow_the_trace_definitions(capsys):
    assert main(["bench", "pool", "--json", "--repeats", "1"]) == 0
    result = json.loads(capsys.readouterr().out)
    # T1: 256 requests x 256 decode steps at 16 tokens a block: 16 fresh blocks each
    assert result["t1_decode_blocks_taken"] == 256 * 256 // 16
    # every full block is published: (512 prompt + 256 decoded) / 16 = 48 per request
    assert result["t1_blocks_registered"] == 256 * (512 + 256) // 16
    # T2: 64 requests each find the 2,048-token prefix, 128 blocks
    assert result["t2_hit_blocks"] == 64 * 2048 // 16
    # T3: 128 requests x 1,024 decode steps complete 8 spans of 128 tokens each, every one
    # checkpointed (the pool's free memory always holds a checkpoint's 9 blocks)
    assert result["t3_spans_completed"] == result["t3_checkpoints_taken"] == 128 * 1024 // 128
    # the lookup figure is the whole lookup minus the hashing alone (rounded to 0.1 ns)
    assert result["prefix_lookup_ns"] == pytest.approx(
        max(result["hash_plus_lookup_ns"] - result["hash_ns"], 0.0), abs=0.11
    )
    assert (result["hash_algo"], result["repeats"], result["gc"]) == ("xxh3_128", 1, "on")


def test_bench_pool_sha256_table(capsys):
    assert main(["bench", "pool", "--repeats", "1", "--hash", "sha256"]) == 0
    out = capsys.readouterr().out
    assert "decode_step_us_per_request" in out and "sha256" in out and "GC on" in out


def test_bench_pool_refuses_a_bad_repeat_count(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "pool", "--repeats", "0"])
    assert exit_info.value.code == 2
    assert "--repeats" in capsys.readouterr().err
