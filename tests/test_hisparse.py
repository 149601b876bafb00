"""HiSparse on the tiny V4 model: CSA main entries in host memory, a hot set on the device.
Outputs equal HiSparse off bit for bit (a pick is a copy of the same entry), whatever the
hot set's size, and the bytes fetched shrink as it grows."""

from __future__ import annotations

import random
import subprocess
import sys

import pytest
import torch

from kvpool.engine.dsv4_runner import dsv4_runner
from kvpool.engine.engine import Engine
from kvpool.engine.sampling import SamplingParams
from kvpool.models.tiny_dsv4 import TinyDSV4
from kvpool.storage.dsv4 import DSV4Pools, HotSet


def _serve(model: TinyDSV4, hot: int | None, prompt_len: int = 700):
    runner = dsv4_runner(model, 64, 4, hot_set_entries=hot)
    engine = Engine(runner, max_num_batched_tokens=256, max_num_seqs=4, record_logits=True)
    rng = random.Random(0)
    ids = [
        engine.add_request(
            [rng.randrange(256) for _ in range(prompt_len)], SamplingParams(max_tokens=8, ignore_eos=True)
        )
        for _ in range(2)
    ]
    while engine.has_unfinished():
        engine.step()
        runner.check_integrity()
        for cl in runner.executor.pools.classical:
            if cl.hot is not None:
                cl.hot.check_integrity()
    return [torch.stack(engine.requests[i].seqs[0].logits) for i in ids], runner.tier_reports().get("hisparse")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_outputs_equal_hisparse_off_even_with_a_hot_set_below_top_k(dtype) -> None:
    model = TinyDSV4(dtype=dtype)
    assert model.spec.index_topk == 8
    want, off = _serve(model, None)
    assert off is None
    fetched = []
    for hot in (4, 64, 1024):  # 4 < top-k: every step fetches
        got, report = _serve(model, hot)
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True)), f"hot set {hot}"
        assert report["entries_fetched"] > 0 and report["device_bytes_saved"] > 0
        assert report["device_bytes_saved"] == report["csa_main_bytes_on_host"] - report["hot_set_bytes"]
        fetched.append(report["bytes_fetched"])
    assert fetched[0] >= fetched[1] >= fetched[2] and fetched[2] < fetched[0]


def test_reused_classical_blocks_never_serve_a_stale_hot_entry() -> None:
    """Waves of new prompts on a 16-block pool: every wave's spans land in blocks an
    earlier wave's entries were hot in."""
    model = TinyDSV4(dtype=torch.float64)

    def waves(hot: int | None):
        runner = dsv4_runner(model, 16, 2, hot_set_entries=hot)
        engine = Engine(runner, max_num_batched_tokens=256, max_num_seqs=2, record_logits=True)
        rng = random.Random(1)
        logits = []
        for _ in range(3):
            ids = [
                engine.add_request(
                    [rng.randrange(256) for _ in range(700)], SamplingParams(max_tokens=4, ignore_eos=True)
                )
                for _ in range(2)
            ]
            while engine.has_unfinished():
                engine.step()
            logits += [torch.stack(engine.requests[i].seqs[0].logits) for i in ids]
        return logits, runner

    want, _ = waves(None)
    got, runner = waves(512)  # large enough that nothing is pushed out: only rewrites drop entries
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    assert runner.cache.pool.num_allocated > 16  # blocks were handed out again


def test_the_hot_set_serves_every_pick_and_keeps_the_latest() -> None:
    host = torch.arange(4 * 2 * 3, dtype=torch.float32).view(4, 2, 3)  # 4 blocks of 2 entries, width 3
    hot = HotSet(2, 3, 2, torch.float32, "cpu")
    ids = torch.tensor([5, 1, 5, 7])  # more distinct entries than the hot set holds
    assert torch.equal(hot.gather(host, ids), host.view(-1, 3)[ids])
    assert (hot.num_fetched, hot.num_selected) == (3, 3)
    hot.check_integrity()
    again = hot.gather(host, torch.tensor([7, 5]))  # the last two fetched stayed
    assert torch.equal(again, host.view(-1, 3)[[7, 5]]) and hot.num_fetched == 3
    hot.invalidate_block(2)  # entries 4 and 5: block 2 is about to be rewritten
    host[2] = -1.0
    assert torch.equal(hot.gather(host, torch.tensor([5])), torch.full((1, 3), -1.0)) and hot.num_fetched == 4
    hot.check_integrity()


def test_bad_hot_set_sizes_are_refused() -> None:
    spec = TinyDSV4().spec
    with pytest.raises(ValueError, match="must hold 1 to 128 CSA entries"):
        DSV4Pools(spec, 4, 2, hot_set_entries=129)  # 4 blocks of 32 CSA entries
    with pytest.raises(ValueError, match="must hold 1 to 128 CSA entries"):
        DSV4Pools(spec, 4, 2, hot_set_entries=0)
    with pytest.raises(ValueError, match="at least one entry"):
        HotSet(0, 3, 2, torch.float32, "cpu")


def test_the_cli_reports_hisparse_and_refuses_it_without_csa_layers() -> None:
    import json

    run = [sys.executable, "-m", "kvpool", "generate", "--model", "tiny-dsv4", "--no-chat", "--json"]
    prompt = " ".join(str(i % 256) for i in range(300))
    proc = subprocess.run([*run, prompt, "--max-tokens", "4", "--hisparse", "4"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)["hisparse"]
    assert report["hot_set_entries"] == 4 and report["entries_fetched"] > 0
    proc = subprocess.run(
        [sys.executable, "-m", "kvpool", "generate", "hello", "--hisparse", "4"], capture_output=True, text=True
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.splitlines()[-1] == (
        "kvpool generate: error: --hisparse: only tiny-dsv4 has CSA layers (pass --model tiny-dsv4)"
    )


def test_the_planner_counts_the_tokens_hisparse_buys() -> None:
    from kvpool.capacity.hisparse import hisparse_capacity
    from kvpool.capacity.planner import plan
    from kvpool.spec.gpus import get_gpu
    from kvpool.spec.models import load_preset

    p = plan(load_preset("deepseek-v4-flash"), get_gpu("H200"), num_gpus=2, tp=2, context_len=131072)
    h = hisparse_capacity(p, 0.1)
    # by hand (fp8 serving layout): CSA main 21 layers x 584 B per 4 tokens; the rest stays
    assert h["csa_main_bytes_per_token"] == 21 * 584 / 4 == 3066
    assert h["kv_bytes_per_token_resident"] == 3850.25
    assert h["kv_bytes_per_token_hisparse"] == pytest.approx(3850.25 - 0.9 * 3066, rel=1e-12)
    assert h["pool_tokens_hisparse"] == int(p.ledger.pool_bytes // h["kv_bytes_per_token_hisparse"])
    assert h["token_gain"] == pytest.approx(3850.25 / (3850.25 - 0.9 * 3066), rel=1e-12)
    assert hisparse_capacity(p, 1.0)["pool_tokens_hisparse"] == h["pool_tokens_resident"]
    node = plan(load_preset("deepseek-v4-flash"), get_gpu("H200"), num_gpus=8, tp=2, context_len=131072)
    h8 = hisparse_capacity(node, 0.1)  # four TP-2 replicas, each with its own pool
    assert h8["replicas"] == 4 and h8["deployment_tokens_hisparse"] == 4 * h8["pool_tokens_hisparse"]
    with pytest.raises(ValueError, match="fraction must be in \\(0, 1\\], got 0"):
        hisparse_capacity(p, 0)
    dense = plan(load_preset("smollm2-135m"), get_gpu("H200"))
    with pytest.raises(ValueError, match="smollm2-135m has no CSA layers"):
        hisparse_capacity(dense, 0.5)


def test_the_plan_and_generate_clis_take_hisparse_and_refuse_bad_sizes() -> None:
    import json

    plan = [sys.executable, "-m", "kvpool", "plan", "--model", "deepseek-v4-flash", "--gpu", "h200"]
    proc = subprocess.run(
        [*plan, "--num-gpus", "8", "--tp", "8", "--hisparse-fraction", "0.1", "--json"], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
    h = json.loads(proc.stdout)["hisparse"]
    assert h["pool_tokens_hisparse"] > h["pool_tokens_resident"] > 0 and h["token_gain"] == pytest.approx(3.5296, 1e-4)
    for argv, needle in [
        ([*plan, "--hisparse-fraction", "1.5"], "must be in (0, 1], got 1.5"),
        ([*plan[:-4], "--model", "llama-3.1-8b", "--hisparse-fraction", "0.1"], "llama-3.1-8b has no CSA layers"),
        (
            [
                sys.executable,
                "-m",
                "kvpool",
                "generate",
                "--model",
                "tiny-dsv4",
                "--no-chat",
                "1,2",
                "--hisparse",
                "99999999",
            ],
            "the HiSparse hot set must hold 1 to 16384 CSA entries",
        ),
    ]:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=120)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1 and needle in lines[0], proc.stderr


def test_bench_hisparse_refuses_a_context_past_the_models_positions_before_drawing_it(capsys, monkeypatch):
    """--context 10000000000 ran for minutes without a word: the bench drew the prompt's 10^10
    random tokens in Python first. Now a context whose steps pass tiny-dsv4's 1,048,576
    positions, or whose pools do not fit the memory, is refused by name, nothing drawn."""
    import kvpool.bench.hisparse as bench
    from kvpool.cli.main import main
    from kvpool.engine import memory

    class NoDraws:
        def Random(self, seed):  # noqa: N802 (random.Random's name)
            raise AssertionError("a prompt was drawn")

    monkeypatch.setattr(bench, "random", NoDraws())
    assert main(["bench", "hisparse", "--context", "10000000000", "--steps", "1"]) == 2
    assert capsys.readouterr().err == (
        "kvpool bench hisparse: error: --context 10000000000 with --steps 1 needs 10,000,000,002 positions; "
        "tiny-dsv4 has 1,048,576 (its max_position_embeddings)\n"
    )
    assert main(["bench", "hisparse", "--context", "64,1048575", "--steps", "1"]) == 2
    assert "needs 1,048,577 positions" in capsys.readouterr().err
    monkeypatch.setattr(memory, "available_memory_bytes", lambda device: 1 << 20)
    assert main(["bench", "hisparse", "--context", "100000", "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvpool bench hisparse: error: kvpool bench hisparse --context 100000 needs ")
    assert err.endswith("GiB but this machine has 0.0 GiB of memory available; lower --context\n")
