"""Context-parallel decode attention (attention/context_parallel.py; issue 15, first part):
the log-sum-exp merge of per-rank partial attention equals single-rank paged attention in
fp64 for any split, and `kvpool verify cp` under torchrun (gloo, 2 and 4 processes) matches
one rank on scattered blocks and decodes SmolLM2's tokens unchanged."""

from __future__ import annotations

import json
import socket
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.attention.context_parallel import (
    local_block_indices,
    local_num_keys,
    merge_partials,
    partial_decode_attention,
)
from kvpool.attention.paged import decode_attention, plan_step


@settings(max_examples=60, deadline=None)
@given(
    lens=st.lists(st.integers(1, 90), min_size=1, max_size=4),
    world=st.integers(1, 5),
    bs=st.sampled_from([4, 16]),
    seed=st.integers(0, 1000),
)
def test_the_merged_partials_equal_single_rank_attention(lens, world, bs, seed) -> None:
    g = torch.Generator().manual_seed(seed)
    b, h, kvh, d = len(lens), 6, 2, 8
    nbs = [-(-n // bs) for n in lens]
    perm = torch.randperm(sum(nbs), generator=g).tolist()  # scattered block ids
    tables, i = [], 0
    for n in nbs:
        tables.append(perm[i : i + n])
        i += n
    k = torch.randn(sum(nbs), kvh, d, bs, generator=g, dtype=torch.float64)
    v = torch.randn(sum(nbs), kvh, bs, d, generator=g, dtype=torch.float64)
    q = torch.randn(b, h, d, generator=g, dtype=torch.float64)
    indptr = [0]
    for t in tables:
        indptr.append(indptr[-1] + len(t))
    last = [t[(n - 1) // bs] * bs + (n - 1) % bs for t, n in zip(tables, lens, strict=True)]
    plan = plan_step([1] * b, lens, last, indptr, sum(tables, []), bs, h, kvh, d, torch.device("cpu"), torch.float64)
    want = decode_attention(q, k, v, plan.decode, 0.3)
    outs, lses = [], []
    for r in range(world):
        local = [[t[j] for j in local_block_indices(len(t), r, world)] for t in tables]
        keys = [local_num_keys(n, bs, r, world) for n in lens]
        assert sum(local_num_keys(n, bs, x, world) for x in range(world) for n in [lens[0]]) == lens[0]
        out, lse = partial_decode_attention(q, k, v, local, keys, 0.3)
        assert bool(torch.isneginf(lse[torch.tensor(keys) == 0]).all())  # a rank without keys: weight 0
        outs.append(out)
        lses.append(lse)
    got = merge_partials(torch.stack(outs), torch.stack(lses))
    assert (got - want).abs().max().item() <= 1e-12


def test_bad_splits_are_refused() -> None:
    q = torch.zeros(1, 2, 4)
    k, v = torch.zeros(3, 1, 4, 4), torch.zeros(3, 1, 4, 4)
    with pytest.raises(ValueError, match="only its last is partial"):
        partial_decode_attention(q, k, v, [[0, 1]], [3], 1.0)
    with pytest.raises(ValueError, match="no keys on any rank"):
        merge_partials(torch.zeros(2, 1, 2, 4), torch.full((2, 1, 2), float("-inf")))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("world", [2, 4])
def test_kvpool_verify_cp_under_torchrun(world) -> None:
    argv = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        str(world),
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(_free_port()),
        "-m",
        "kvpool",
        "verify",
        "cp",
        "--context",
        "2048",
        "--batch",
        "3",
        "--smollm2-prompt",
        "96",
        "--steps",
        "4",
        "--json",
    ]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    paged, smollm2 = report["checks"]
    assert report["passed"] and paged["world_size"] == world and paged["context"] == 2048
    assert paged["max_abs_error"] <= 8 * paged["single_rank_fp32_error"]
    assert smollm2["tokens_equal"] and smollm2["finite"] and smollm2["steps"] == 4


def test_kvpool_verify_cp_outside_torchrun_says_how_to_run_it() -> None:
    proc = subprocess.run([sys.executable, "-m", "kvpool", "verify", "cp"], capture_output=True, text=True, timeout=60)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and "runs under torchrun" in lines[0], proc.stderr
