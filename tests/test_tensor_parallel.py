"""Tensor parallelism for the Llama path (models/tensor_parallel.py; issue 15): under
torchrun (gloo, 3 processes) the sharded engine decodes SmolLM2's greedy tokens unchanged,
logits within the single-process engine's own fp32 error, across a prefix hit and a
preemption, each rank holding a third of every KV block, as `kvpool plan --tp 3` says; and
a TP degree the heads cannot take is refused naming them."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

from kvpool.models.gguf import LlamaConfig
from kvpool.models.tensor_parallel import check_tp

TESTS = os.path.dirname(os.path.abspath(__file__))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun(world: int, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(world)]
    argv += ["--master-addr", "127.0.0.1", "--master-port", str(_free_port()), "-m", "kvpool", *args]
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout)


def test_kvpool_verify_tp_3_matches_one_process() -> None:
    proc = _torchrun(3, "verify", "tp", "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["passed"] and report["tp"] == 3
    assert report["b_cached_tokens"] == 48 and report["preemptions"] >= 1
    for r in report["requests"].values():
        assert r["tokens_equal"] and r["max_logit_difference"] <= 8 * r["single_process_fp32_error"]
    # each rank: one of SmolLM2's three KV heads of every block, as the planner says per GPU
    assert report["kv_bytes_per_token_per_rank"] * 3 == report["kv_bytes_per_token_single"] == 46_080
    assert report["planner_kv_bytes_per_token_per_gpu"] == report["kv_bytes_per_token_per_rank"]


def test_a_tp_degree_the_heads_cannot_take_is_refused() -> None:
    smollm2 = LlamaConfig(30, 576, 1536, 9, 3, 64, 1e5, 1e-5, 49152, 8192, True)
    check_tp(smollm2, 3)
    with pytest.raises(
        ValueError,
        match="--tensor-parallel-size 2 does not divide the model's 9 query heads, 3 KV heads "
        ".* use --tensor-parallel-size 1 or 3",
    ):
        check_tp(smollm2, 2)
    proc = subprocess.run(
        [sys.executable, "-m", "kvpool", "generate", "hi", "--max-tokens", "2", "--tp", "3"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and "runs under torchrun" in lines[0], proc.stderr
    proc = _torchrun(2, "generate", "hi", "--max-tokens", "2", "--tp", "2", timeout=120)
    assert proc.returncode != 0 and "--tensor-parallel-size 2 does not divide the model's 9 query heads" in proc.stderr


@pytest.mark.parametrize("command", [["generate", "--no-chat", "1,2"], ["run"]])
def test_what_tp_cannot_go_with_is_refused_alike_by_generate_and_run(command, capsys) -> None:
    """One check (cli/args.py check_engine_flags) for both commands, before any model loads."""
    from kvpool.cli.main import main

    name = command[0]
    tiny = "--tensor-parallel-size is for the Llama path (SmolLM2); tiny-dsv4 runs on one process"
    auto = "--preemption auto decides by each process's timings; with --tensor-parallel-size use recompute or swap"
    for flags, message in ((["--model", "tiny-dsv4"], tiny), (["--preemption", "auto", "--host-cache-gib", "1"], auto)):
        assert main([*command, *flags, "--tp", "3"]) == 2
        assert capsys.readouterr().err == f"kvpool {name}: error: {message}\n"


def test_generate_tp_3_prints_one_report() -> None:
    proc = _torchrun(3, "generate", "What is the capital of France?", "--max-tokens", "6", "--tp", "3", "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(lines) == 1  # rank 0 reports; the other ranks print nothing
    report = json.loads(lines[0])
    single = subprocess.run(
        [sys.executable, "-m", "kvpool", "generate", "What is the capital of France?", "--max-tokens", "6", "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert report["tp"] == 3 and report["token_ids"] == json.loads(single.stdout)["token_ids"]
    assert report["kv_bytes_per_token_per_rank"] == 15_360


def test_kvpool_run_tp_3_reports_once_with_per_rank_kv() -> None:
    args = ["run", "--num-requests", "3", "--turns", "2", "--num-long", "0", "--max-tokens", "8", "--json"]
    proc = _torchrun(3, *args, "--tp", "3")
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(lines) == 1
    report = json.loads(lines[0])
    single = subprocess.run([sys.executable, "-m", "kvpool", *args], capture_output=True, text=True, timeout=300)
    one = json.loads(single.stdout)
    assert report["tp"] == 3 and report["num_finished"] == one["num_finished"] == 6
    assert report["kv_bytes_per_token_per_rank"] * 3 == one["kv_bytes_per_token_per_rank"]
    # the same default KV budget per rank holds three times the tokens
    assert report["kv_capacity_tokens"] == 3 * one["kv_capacity_tokens"]
    assert report["prefix_hit_tokens"] == one["prefix_hit_tokens"] > 0  # the follow-up turns hit alike


def test_generate_tp_3_says_its_note_once() -> None:
    # the text and the note that it stopped at --max-tokens come from rank 0 only
    proc = _torchrun(3, "generate", "hi", "--max-tokens", "2", "--tp", "3", timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stderr.count("stopped at --max-tokens 2") == 1, proc.stderr
    assert len(proc.stdout.strip().splitlines()) == 1, proc.stdout


# One rank of a Qwen2 GGUF (Q / K / V biases) or a Qwen3 GGUF (q / k norms, head dim 24) sharded
# over a gloo group of 2: its logits of the same tokens, fp64 on the plain path and fp32 on the C
# kernels' fused path; rank 0 prints them beside the whole model's in one process.
_QWEN_RANK = """
import datetime, json, sys
import torch
import torch.distributed as dist
from kvpool.attention.reference import reference_logits
from kvpool.kernels import cpu_kernels
from kvpool.models.gguf import load_gguf
from kvpool.models.llama import LlamaModel
from kvpool.models.tensor_parallel import shard_llama

torch.set_num_threads(1)
path, family, ids = sys.argv[1], sys.argv[2], list(range(0, 300, 7))
f = load_gguf(path)
whole32 = LlamaModel.from_tensors(f.meta.config, f.tensors(torch.float32), kernels=cpu_kernels())
whole64 = whole32.astype(torch.float64)
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
rank = dist.get_rank()
out = {}
for name, whole in (("fp64", whole64), ("fp32", whole32)):
    shard = shard_llama(whole, rank, 2)
    assert shard.config.num_heads == 2
    if family == "qwen2":  # the heads' bias columns
        assert shard.layers[0]["bqkv"].shape == (64,)
    else:  # the norms whole on each rank
        assert shard.config.head_dim == 24 and torch.equal(shard.layers[1]["k_norm"], whole.layers[1]["k_norm"])
    assert (shard.kernels is not None) == (name == "fp32")
    got = reference_logits(shard, ids).double()
    if rank == 0:
        out[name] = {"tp": got.tolist(), "whole": reference_logits(whole, ids).double().tolist()}
dist.barrier()
dist.destroy_process_group()
if rank == 0:
    print(json.dumps(out))
"""


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_tp_2_shards_qwen2_biases_and_keeps_qwen3_norms_whole(tmp_path, family) -> None:
    """Was refused ("a model with Q / K / V biases (Qwen2) runs on one rank only"): each
    rank now takes its heads' bias columns; a Qwen3's q / k norms (one weight for every
    head) are whole on each rank. fp64: the two ranks' sum equals the whole model
    to rounding (1e-12 of the largest logit); fp32 with the C kernels: within 8 times the
    whole fp32 model's own error against fp64, as verify tp bounds it."""
    import torch

    sys.path.insert(0, TESTS)
    from test_qwen2 import hf_weights, write_gguf

    path = write_gguf(tmp_path / f"{family}.gguf", hf_weights(False, family=family), family=family)
    check_tp(load_config(path), 2)
    port = str(_free_port())
    procs = []
    for rank in range(2):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
        env.update(GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
        cmd = [sys.executable, "-c", _QWEN_RANK, path, family]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    results = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=180)
            assert proc.returncode == 0, err[-3000:]
            results.append(out)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    out = json.loads(results[0].strip().splitlines()[-1])
    tp64, whole64 = torch.tensor(out["fp64"]["tp"]), torch.tensor(out["fp64"]["whole"])
    tp32, whole32 = torch.tensor(out["fp32"]["tp"]), torch.tensor(out["fp32"]["whole"])
    assert whole64.abs().max() > 1.0
    assert (tp64 - whole64).abs().max() <= 1e-12 * whole64.abs().max()
    own = (whole32 - whole64).abs().max()
    assert 0 < own < 1e-3 * whole64.abs().max()
    assert (tp32 - whole64).abs().max() <= 8 * own


def load_config(path: str):
    from kvpool.models.gguf import load_gguf

    return load_gguf(path).meta.config
