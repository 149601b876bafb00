"""`kvpool bench pool` runs its traces to completion with their own correctness checks
(every T2 request finds exactly 128 cached blocks, T1 frees every block) and prints one
JSON object with the figures the README quotes. Timings are not asserted."""

from __future__ import annotations

import json

from kvpool.cli.main import main


def test_bench_pool_json(capsys):
    assert main(["bench", "pool", "--json", "--repeats", "1"]) == 0
    result = json.loads(capsys.readouterr().out)
    for key in ("decode_step_us_per_request", "block_op_ns", "hash_ns", "hash_plus_lookup_ns"):
        assert result[key] > 0, key
    assert 0 <= result["prefix_lookup_ns"] <= result["hash_plus_lookup_ns"]
    assert result["hash_algo"] == "xxh3_128"


def test_bench_pool_sha256_table(capsys):
    assert main(["bench", "pool", "--repeats", "1", "--hash", "sha256"]) == 0
    out = capsys.readouterr().out
    assert "decode_step_us_per_request" in out and "sha256" in out
