"""The benchmarks' Python API (kvpool.bench): each measurement is a plain function of keyword
arguments that returns its report, with no argparse in the way. Timings are not asserted;
counts and bytes are, from the benchmarks' definitions."""

from __future__ import annotations

import socket
import time

import pytest

from kvpool.bench import common, dsv4, engine, hisparse, kv_quant, pool, serve, tiers


def test_best_of_times_every_call_after_two_warm_ups_and_keeps_the_fastest() -> None:
    calls = []

    def fn() -> None:
        calls.append(None)
        if len(calls) != 5:  # one quick call among slow ones, after the two warm-ups
            time.sleep(0.02)

    best = common.best_of(fn, repeat=6)
    assert len(calls) == 2 + 6
    assert best < 0.02  # the quick call, not a slow one


def test_pool_measure_counts_follow_the_trace_definitions_under_either_hash() -> None:
    result = pool.measure(repeats=1, hash_algo="sha256")
    # T1: 256 requests x 256 decode steps at 16 tokens a block; 48 full blocks each at the end
    assert result["t1_decode_blocks_taken"] == 256 * 256 // 16
    assert result["t1_blocks_registered"] == 256 * (512 + 256) // 16
    assert result["t2_hit_blocks"] == 64 * 2048 // 16  # 64 requests find 128 blocks each
    assert (result["hash_algo"], result["repeats"], result["gc"]) == ("sha256", 1, "on")
    with pytest.raises(ValueError, match="repeats"):
        pool.measure(repeats=0)


def test_dsv4_measure_without_timing_is_the_byte_report() -> None:
    result = dsv4.measure(timing=False)
    assert result == {"bytes": dsv4.byte_report(), "tiny_decode_timing": []}
    assert result["bytes"]["deepseek-v4-flash"]["state_swa_bytes"] == 128 * 584 * 43
    with pytest.raises(ValueError, match="positive"):
        dsv4.measure(contexts=[0], timing=False)


def test_hisparse_measure_keeps_fewer_device_bytes_and_skips_a_hot_set_larger_than_the_pool() -> None:
    result = hisparse.measure(contexts=(256,), hot_sets=(8, 10**6), steps=2)
    off, hot = result["rows"]  # the hot set of a million entries is larger than the pool: no row
    assert result["steps"] == 2
    assert (off["context"], off["hot_set"], hot["hot_set"]) == (256, None, 8)
    assert "fetched_entries_per_decode_step" not in off
    # the device keeps 8 entries of 128 bytes (32 fp32 values) in each of the tiny model's 2 CSA layers
    assert hot["csa_main_device_bytes"] == 2 * 8 * 128 < off["csa_main_device_bytes"]
    # a decode step's selections (top 8 of each CSA layer's entries) leave the 8 resident ones:
    # some entries are fetched (14.5 a step measured), each one entry's bytes
    assert hot["fetched_entries_per_decode_step"] > 0
    assert hot["fetched_bytes_per_decode_step"] == hot["fetched_entries_per_decode_step"] * 128


def test_kv_quant_measure_reads_the_bytes_of_its_format() -> None:
    report = kv_quant.measure(batch=2, context=64, layers=1, repeats=1, formats=("fp32", "int8"), paths=("torch",))
    by = {row["format"]: row for row in report["formats"]}
    # batch x context tokens x 3 KV heads x (K and V); fp32: 64 floats; int8: 64 codes + one fp32 scale
    assert by["fp32"]["bytes_per_layer_step"] == 2 * 64 * 3 * 2 * 64 * 4
    assert by["int8"]["bytes_per_layer_step"] == 2 * 64 * 3 * 2 * (64 + 4)
    assert by["int8"]["torch_ms"] > 0 and "native_ms" not in by["int8"]
    assert by["fp32"]["torch_speedup_vs_fp32"] == 1.0
    with pytest.raises(ValueError, match="unknown path 'gpu'"):
        kv_quant.measure(paths=("gpu",))


def test_measures_refuse_bad_settings_before_any_work() -> None:
    with pytest.raises(ValueError, match="kvpool bench dsv4"):
        engine.measure(model="tiny-dsv4")
    with pytest.raises(ValueError, match="unknown parts"):
        engine.measure(parts=("decode", "nonsense"))
    with pytest.raises(ValueError, match="must be a multiple of 256"):
        engine.measure(parts=("attention",), attn_context=1000)
    with pytest.raises(ValueError, match="not a multiple of --block-size 16"):
        tiers.measure(prefix_len=100)


def test_serve_wait_ready_gives_up_on_a_port_that_refuses_and_says_it_waited() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}"  # closed again: it refuses connections
    heard: list[str] = []
    with pytest.raises(ValueError, match="cannot connect"):
        serve.wait_ready(url, None, timeout_s=60.0, notice=heard.append)
    assert heard == [f"waiting for {url} to answer"]


def test_call_with_flags_takes_each_parameter_from_given_else_from_its_flag() -> None:
    from argparse import Namespace

    from kvpool.cli.bench import call_with_flags

    def fn(a: int, b_c: int = 1, d: int = 2) -> tuple[int, int, int]:
        return a, b_c, d

    args = Namespace(a=1, b_c=5, d=3, json=True)  # json: a flag fn does not take, left alone
    assert call_with_flags(fn, args, d=9) == (1, 5, 9)
    with pytest.raises(TypeError, match=r"\(e=...\): no flag"):
        call_with_flags(lambda e: e, args)
    with pytest.raises(TypeError, match="takes no"):
        call_with_flags(fn, args, zzz=1)


class _Called(Exception):
    """Raised by a stand-in bench function once it has seen its arguments."""


def test_every_bench_command_hands_its_function_the_function_s_own_defaults(monkeypatch) -> None:
    """`kvpool bench NAME` with no flags calls its function with every parameter; where a
    parameter comes from a flag of its name, the flag's default is the function's default, so
    the Python API and the command measure the same thing by default."""
    import functools
    import importlib
    import inspect

    import kvpool.engine.build
    from kvpool.cli.bench import BENCHES
    from kvpool.cli.main import build_parser, main

    monkeypatch.setattr(kvpool.engine.build, "load_model", lambda *a, **k: None)  # bench sim loads first
    for name, (module_name, _) in BENCHES.items():
        module = importlib.import_module(module_name)
        target = "first_turns" if name == "sim" else "measure"
        real = getattr(module, target)
        seen: dict = {}

        @functools.wraps(real)
        def stand_in(*args, seen=seen, **kwargs):
            seen.update(kwargs)
            raise _Called

        monkeypatch.setattr(module, target, stand_in)
        with pytest.raises(_Called):
            main(["bench", name])
        parameters = inspect.signature(real).parameters
        assert set(seen) == set(parameters), name
        args = build_parser().parse_args(["bench", name])
        for key, parameter in parameters.items():
            if hasattr(args, key) and parameter.default is not inspect.Parameter.empty:
                got, default = seen[key], parameter.default
                if isinstance(got, list | tuple) and isinstance(default, list | tuple):
                    got, default = tuple(got), tuple(default)  # a parsed comma list against a tuple
                assert got == default, (name, key)
