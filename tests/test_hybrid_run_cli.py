"""`kvpool run --model tiny-gemma2 / tiny-recurrent`: the built-in workload on the hybrid cache
coordinator, the same report as the other models, and the flags its runner cannot honour
refused in one line."""

from __future__ import annotations

import json

import pytest
import torch

from kvpool.cli.main import main

NUM_REQUESTS, MAX_TOKENS = 4, 4
# live_token_ids: a first turn is a 300-token system prompt + a 20-token question; its
# follow-up is the history + the 4-token answer + a 12-token question
FIRST, FOLLOW_UP = 300 + 20, 300 + 20 + MAX_TOKENS + 12


def _run_json(capsys, *args: str) -> dict:
    threads = torch.get_num_threads()
    try:
        assert main(["run", "--json", "--threads", "1", *args]) == 0
    finally:
        torch.set_num_threads(threads)
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize(
    ("model", "state_bytes"),
    [
        ("tiny-gemma2", 0),  # window + full attention layers: no recurrent state
        # 2 recurrent layers x 4 heads x an 8 x 8 fp32 state, 4 slots per sequence of a step (16)
        ("tiny-recurrent", 4 * 16 * 2 * 4 * 8 * 8 * 4),
    ],
)
def test_run_on_a_tiny_hybrid_model_reports_real_figures(capsys, model, state_bytes):
    report = _run_json(
        capsys,
        *f"--model {model} --num-requests {NUM_REQUESTS} --max-tokens {MAX_TOKENS} --turns 2 --num-long 0".split(),
        *"--request-rate inf --max-batch-tokens 2048 --slo-ttft-ms 1e9 --slo-tpot-ms 1e9".split(),
    )
    num = 2 * NUM_REQUESTS  # every conversation's two turns
    assert report["model"] == model
    assert (report["num_requests"], report["num_finished"]) == (num, num)
    assert report["num_generated_tokens"] == num * MAX_TOKENS  # the tiny model has no EOS
    assert report["prefix_queried_tokens"] == NUM_REQUESTS * (FIRST + FOLLOW_UP)
    # the follow-ups hit their own first turns (and shared system prompts), in whole blocks
    assert report["prefix_hit_tokens"] > 0 and report["prefix_hit_tokens"] % 16 == 0
    assert report["prefix_hit_rate"] == round(report["prefix_hit_tokens"] / report["prefix_queried_tokens"], 4)
    # the default 16 MiB of K/V: blocks of every attention layer (2 x 2 KV heads x 8 dims x 4 bytes
    # a layer and token, 16 tokens a block), the recurrent slots on top
    num_attention = 4 if model == "tiny-gemma2" else 2
    per_group = (16 << 20) // (num_attention * 2 * 2 * 8 * 4 * 16)
    num_groups = 2 if model == "tiny-gemma2" else 1
    assert report["block_size"] == 16 and report["num_blocks"] == num_groups * per_group
    assert report["kv_capacity_bytes"] == (16 << 20) + state_bytes
    assert report["kv_capacity_tokens"] == per_group * 16  # one sequence can fill a full-attention pool
    assert 0 <= report["fragmentation"] < 1
    assert report["preemptions"] == 0 and report["interrupted"] is False
    assert report["goodput_req_s"] == pytest.approx(num / report["wall_s"], rel=0.01)
    assert report["load_source"] == "built in" and report["memory"] is None


@pytest.mark.parametrize(
    ("flags", "line"),
    [
        ("--tp 2", "--tensor-parallel-size is not supported with --model tiny-gemma2"),
        ("--kv-dtype fp8_e4m3", "--kv-cache-dtype fp8_e4m3 is not supported with --model tiny-gemma2"),
        ("--host-cache-gib 1", "--host-cache-gib is not supported with --model tiny-gemma2"),
        ("--hisparse 64", "--hisparse is not supported with --model tiny-gemma2"),
        ("--preemption swap --host-cache-gib 1", "--host-cache-gib is not supported with --model tiny-gemma2"),
    ],
)
def test_run_on_a_tiny_hybrid_model_refuses_flags_it_cannot_honour(capsys, flags, line):
    assert main(["run", "--model", "tiny-gemma2", *flags.split()]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"kvpool run: error: {line}")


@pytest.mark.parametrize(
    ("flags", "line"),
    [
        # (the default --kv-memory was named "None")
        (
            "--block-size 99999999999999999999",
            "--kv-memory 16MiB (the default) holds no block of 99999999999999999999 tokens "
            "(51199999999999999999488 bytes): raise --kv-memory or lower --block-size",
        ),
        (
            "--kv-memory 1",
            "--kv-memory 1 holds no block of 16 tokens (8192 bytes): raise --kv-memory or lower --block-size",
        ),
    ],
)
def test_run_on_a_tiny_hybrid_model_names_the_kv_memory_that_holds_no_block(capsys, flags, line):
    assert main(["run", "--model", "tiny-gemma2", *flags.split()]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["kvpool run: loading the model", f"kvpool run: error: {line}"]


def test_run_help_names_the_tiny_hybrid_models(capsys):
    with pytest.raises(SystemExit):
        main(["run", "--help"])
    text = "".join(capsys.readouterr().out.split())  # argparse may wrap at a hyphen
    assert "tiny-gemma2" in text and "tiny-recurrent" in text
