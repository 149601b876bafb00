"""`kvpool verify dsv4` and `kvpool bench dsv4` through the real command-line entry point."""

from __future__ import annotations

import json

import pytest
from torch import Tensor

import kvpool.attention.dsv4_paged as dsv4_paged
from kvpool.attention.dsv4_paged import ChunkPlan
from kvpool.cli.main import main
from kvpool.verify.dsv4_tolerance import FP32_K, FP32_SELECTION_K, FP64_TOLERANCE


def test_verify_lengths_json(capsys: pytest.CaptureFixture[str]) -> None:
    # default: fp64, every case within the fixed bound (fp64 rounding leaves <= 7e-15)
    assert main(["verify", "dsv4", "--lengths", "1,129,300", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["dtype"] == "fp64"
    assert [c["name"] for c in out["cases"]] == ["prompt_len_1", "prompt_len_129", "prompt_len_300"]
    for case in out["cases"]:
        assert case["passed"] is True and case["verdict"] == "pass"
        assert case["tolerance"] == FP64_TOLERANCE and 0 <= case["max_abs_diff"] <= FP64_TOLERANCE


def test_verify_fp32_derives_its_tolerance(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["verify", "dsv4", "--dtype", "fp32", "--lengths", "129", "--json"]) == 0
    (case,) = json.loads(capsys.readouterr().out)["cases"]
    # measured: oracle fp32 error 2.6e-6, paged 1.9e-6 from the oracle, top-k margin 12.5
    assert 0 < case["reference_error"] < 1e-5
    assert case["tolerance"] >= FP32_K * case["reference_error"] and case["tolerance"] < 1e-4
    assert case["max_abs_diff"] <= case["tolerance"] and case["passed"] is True
    assert case["selection_margin"] > FP32_SELECTION_K


def _read_entry_40_from_block_0(monkeypatch: pytest.MonkeyPatch) -> None:
    """Plant one wrong read: CSA main entry 40 comes from block 0, slot 0."""
    original = dsv4_paged._entries_for_chunk

    def faulty(pool: Tensor, tail: Tensor, new_entries: Tensor, ratio: int, span: int, c: ChunkPlan) -> Tensor:
        out = original(pool, tail, new_entries, ratio, span, c)
        if ratio == 4 and out.shape[-1] == pool.shape[-1] == 32 and out.shape[0] > 40:  # main entries, head_dim 32
            out = out.clone()
            out[40] = out[0]
        return out

    monkeypatch.setattr(dsv4_paged, "_entries_for_chunk", faulty)


def test_verify_fails_with_nonzero_exit(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    # one wrong entry: the command must say so, and --tolerance must be what it judges by
    _read_entry_40_from_block_0(monkeypatch)
    assert main(["verify", "dsv4", "--lengths", "129,300"]) == 1
    out = capsys.readouterr().out
    assert "prompt_len_300" in out and "NO" in out and "1/2 passed" in out  # 129 has 32 entries: untouched
    assert main(["verify", "dsv4", "--lengths", "300", "--json"]) == 1
    (case,) = json.loads(capsys.readouterr().out)["cases"]
    diff = case["max_abs_diff"]
    assert case["verdict"] == "fail" and diff > 1e6 * FP64_TOLERANCE  # measured 7.8e-2
    assert main(["verify", "dsv4", "--lengths", "300", "--tolerance", repr(diff)]) == 0  # diff <= tolerance
    assert "1/1 passed" in capsys.readouterr().out
    assert main(["verify", "dsv4", "--lengths", "300", "--tolerance", repr(diff / 2)]) == 1


@pytest.mark.parametrize("length", [100000, 10**13])
def test_verify_refuses_a_length_past_its_pool_not_reports_a_failed_check(
    capsys: pytest.CaptureFixture[str], length: int
) -> None:
    # it read "prompt_len_100000  nan  nan  NO  (assertion failed: )", as if V4 were wrong; and
    # 10**13 drew its ids before the pool's check: a traceback of torch's failed 80 TB allocation
    assert main(["verify", "dsv4", "--lengths", str(length)]) == 2
    err = capsys.readouterr().err
    assert err == (
        f"kvpool verify dsv4: error: --lengths {length}: a prompt of {length:,} tokens does not fit the verifier's KV "
        "pool; give shorter lengths\n"
    )


@pytest.mark.parametrize("command", [["verify", "dsv4"], ["verify", "hybrid"], ["run", "--model", "tiny-dsv4"]])
def test_a_seed_torch_cannot_take_is_refused_by_name(capsys: pytest.CaptureFixture[str], command: list[str]) -> None:
    # it read "kvpool run: error: Overflow when unpacking long long", naming no flag (after
    # loading the model); a negative seed is refused by run as it always was, and taken by
    # verify, whose seed goes to torch's generator alone (as it always was)
    verify = command[0] == "verify"
    for seed in (str(10**23), str(2**63), *(() if verify else ("-1",)), str(-(2**63) - 1)):
        with pytest.raises(SystemExit) as exc:
            main([*command, "--seed", seed])
        assert exc.value.code == 2
        err = capsys.readouterr().err
        bounds = "[-2**63, 2**63)" if verify else "[0, 2**63)"
        assert f"argument --seed: expected an integer in {bounds}, got {seed}" in err, err


@pytest.mark.parametrize("command", [["verify", "dsv4"], ["verify", "hybrid"]])
def test_verify_takes_a_negative_seed(capsys: pytest.CaptureFixture[str], command: list[str]) -> None:
    assert main([*command, "--seed", "-1", "--lengths", "8"]) == 0


def test_verify_rejects_bad_lengths(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["verify", "dsv4", "--lengths", "1,x"])
    assert "--lengths" in capsys.readouterr().err


@pytest.mark.parametrize("bad", ["-1", "-1e-9", "nan", "inf"])
def test_verify_rejects_a_bad_tolerance(capsys: pytest.CaptureFixture[str], bad: str) -> None:
    assert main(["verify", "dsv4", "--lengths", "1", f"--tolerance={bad}"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""  # nothing ran
    assert captured.err == f"kvpool verify dsv4: error: --tolerance must be a finite number >= 0, got {float(bad)!r}\n"


def test_verify_help_shows_the_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        main(["verify", "dsv4", "--help"])
    assert done.value.code == 0
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    assert "(default: fp64)" in text and "(default: 0)" in text
    assert f"fp64 {FP64_TOLERANCE:g}" in text  # the help's figure is the bound in force


def test_bench_dsv4_bytes(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "dsv4", "--no-timing", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    flash, pro = out["bytes"]["deepseek-v4-flash"], out["bytes"]["deepseek-v4-pro"]
    assert flash["classical_bytes_per_token_fp8_indexer"] == 3850.25  # integer / 2**k: exact
    assert flash["classical_bytes_per_token_mxfp4_indexer"] == 3514.25
    assert pro["classical_bytes_per_token_fp8_indexer"] == 5511.4375
    assert flash["state_swa_bytes"] == 128 * 584 * 43
    assert out["tiny_decode_timing"] == []


def test_bench_dsv4_timing_runs(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "dsv4", "--contexts", "130", "--steps", "2", "--repeats", "1", "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)["tiny_decode_timing"]
    assert row["context"] == 130 and row["paged_ms_per_step"] > 0 and row["oracle_ms_per_step"] > 0


def test_bench_dsv4_bad_flags_are_argparse_errors(capsys: pytest.CaptureFixture[str]) -> None:
    """As every other bench's: status 2 and "kvpool bench dsv4: error: argument ..." (they were
    a bare line with status 1, and '64,' passed as [64])."""
    for argv, message in (
        (["--contexts", "1,2x"], "argument --contexts: expected a positive integer, got '2x'"),
        (["--contexts", "0"], "argument --contexts: expected a positive integer, got 0"),
        (["--contexts", "64,"], "argument --contexts: an empty entry in '64,'"),
        (["--steps", "0"], "argument --steps: expected a positive integer, got 0"),
        (["--repeats", "-1"], "argument --repeats: expected a positive integer, got -1"),
    ):
        with pytest.raises(SystemExit) as e:
            main(["bench", "dsv4", *argv, "--json"])
        assert e.value.code == 2
        assert capsys.readouterr().err.strip().splitlines()[-1] == f"kvpool bench dsv4: error: {message}"


def test_bench_dsv4_refuses_a_context_past_the_models_positions_or_the_memory(capsys, monkeypatch) -> None:
    """--contexts 100000000 allocated the pools without a check (an allocator traceback beyond
    RAM) and never compared context + steps with the model's 1,048,576 positions; a context
    whose oracle does not fit (its attention is quadratic) went on until the allocator or the
    OOM killer stopped it. Both are refused by name before anything is allocated."""
    from kvpool.engine import memory

    built: list[int] = []
    monkeypatch.setattr("kvpool.engine.dsv4_runner.DSV4Pools", lambda *a, **k: built.append(1))  # (never reached)
    assert main(["bench", "dsv4", "--contexts", "100000000", "--steps", "1", "--repeats", "1"]) == 2
    assert capsys.readouterr().err == (
        "kvpool bench dsv4: error: --contexts 100000000 with --steps 1 needs 100,000,001 positions; "
        "tiny-dsv4 has 1,048,576 (its max_position_embeddings)\n"
    )
    assert main(["bench", "dsv4", "--contexts", "64,1048575", "--steps", "2"]) == 2
    assert "needs 1,048,577 positions" in capsys.readouterr().err
    monkeypatch.setattr(memory, "available_memory_bytes", lambda device: 2 << 30)
    assert main(["bench", "dsv4", "--contexts", "128,8192", "--steps", "1", "--repeats", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvpool bench dsv4: error: kvpool bench dsv4 --contexts 8192 (the pools and the oracle's")
    assert "needs 11.3 GiB but this machine has 2.0 GiB of memory available; lower --contexts" in err
    assert not built
    from kvpool.bench.dsv4 import timing_bytes
    from kvpool.models.tiny_dsv4 import TinyDSV4

    # quadratic in the context: 4x the tokens, ~16x the bytes (the pools' linear share aside)
    small, large = (timing_bytes(TinyDSV4(seed=0), c, 1) for c in (2048, 8192))
    assert 15.5 < large / small < 16.5
