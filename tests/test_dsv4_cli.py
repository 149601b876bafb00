"""`kvpool verify dsv4` and `kvpool bench dsv4` through the real command-line entry point."""

from __future__ import annotations

import json

import pytest

from kvpool.cli.main import main


def test_verify_lengths_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["verify", "dsv4", "--lengths", "1,129,300", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [c["name"] for c in out["cases"]] == ["prompt_len_1", "prompt_len_129", "prompt_len_300"]
    for case in out["cases"]:
        assert case["passed"] is True and 0 <= case["max_abs_diff"] <= 1e-5


def test_verify_fails_with_nonzero_exit(capsys: pytest.CaptureFixture[str]) -> None:
    # a tolerance below fp32 rounding makes the 129-token case fail: the command must say so
    assert main(["verify", "dsv4", "--lengths", "129", "--tolerance", "0"]) == 1
    out = capsys.readouterr().out
    assert "prompt_len_129" in out and "NO" in out and "0/1 passed" in out


def test_verify_rejects_bad_lengths(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["verify", "dsv4", "--lengths", "1,x"])
    assert "--lengths" in capsys.readouterr().err


def test_bench_dsv4_bytes(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "dsv4", "--no-timing", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    flash, pro = out["bytes"]["deepseek-v4-flash"], out["bytes"]["deepseek-v4-pro"]
    assert flash["classical_bytes_per_token_fp8_indexer"] == pytest.approx(3850.25)
    assert flash["classical_bytes_per_token_mxfp4_indexer"] == pytest.approx(3514.25)
    assert pro["classical_bytes_per_token_fp8_indexer"] == pytest.approx(5511.4375)
    assert flash["state_swa_bytes"] == 128 * 584 * 43
    assert out["tiny_decode_timing"] == []


def test_bench_dsv4_timing_runs(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "dsv4", "--contexts", "130", "--steps", "2", "--repeats", "1", "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)["tiny_decode_timing"]
    assert row["context"] == 130 and row["paged_ms_per_step"] > 0 and row["oracle_ms_per_step"] > 0
