"""DeepSeek-V4 on the persistent tiers: compressed entries up to the last complete block,
and the three SWA strategies (full, periodic, zero) that bring a hit's sliding window
back, each exact against the contiguous oracle through the disk tier and through Redis,
in this process and in a second one; what each stores and recomputes, checked by hand;
descriptors, tenants and a damaged snapshot."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvpool.engine.dsv4_runner import dsv4_runner
from kvpool.engine.engine import Engine
from kvpool.engine.sampling import SamplingParams
from kvpool.models.tiny_dsv4 import TinyDSV4
from kvpool.spec.dsv4 import CSA_RATIO
from kvpool.tiers import DiskTier
from kvpool.tiers.redis_tier import RedisTier
from kvpool.tiers.swa import SWAStrategy, snapshot_key

STRATEGIES = {"full": SWAStrategy("full"), "periodic": SWAStrategy("periodic", 256), "zero": SWAStrategy("zero")}


@pytest.fixture(scope="module")
def model(one_thread) -> TinyDSV4:
    return TinyDSV4(dtype=torch.float64)


def _ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(256) for _ in range(n)]


# ----- the strategies, by hand -------------------------------------------------------------


def test_what_each_strategy_stores_and_restores_from() -> None:
    span, window, layers = 128, 128, 5  # the tiny model: recomputing from scratch costs 640 tokens
    full, periodic, zero = STRATEGIES["full"], STRATEGIES["periodic"], STRATEGIES["zero"]
    assert full.snapshot_positions(0, 400, span) == [128, 256, 384]
    assert full.snapshot_positions(128, 256, span) == [256] and full.snapshot_positions(129, 255, span) == []
    assert periodic.snapshot_positions(0, 800, span) == [256, 512, 768]
    assert zero.snapshot_positions(0, 800, span) == []
    # a hit of 640: full reads the snapshot at 640, or one further back; periodic 512 (recompute
    # 128 tokens) or 256 (384); 0 would be the zero strategy's 640 and is not a snapshot
    assert full.restore_points(640, span, window, layers) == [(b, [b]) for b in (640, 512, 384, 256, 128)]
    assert periodic.restore_points(640, span, window, layers) == [(512, [512]), (256, [256])]
    assert periodic.restore_points(128, span, window, layers) == []  # no snapshot below: recompute
    assert zero.restore_points(640, span, window, layers) == []
    # a snapshot further back than the zero strategy's recompute is not worth reading
    assert SWAStrategy("periodic", 1024).restore_points(1792, span, window, layers) == []
    assert SWAStrategy("periodic", 1024).restore_points(1536, span, window, layers) == [(1024, [1024])]
    # a window of two spans: full mode reads the two snapshots that hold it
    assert full.restore_points(512, span, 256, 2)[0] == (512, [512, 384])
    assert full.window_rows(span, 256) == 128 and periodic.window_rows(span, 256) == 256
    assert snapshot_key(b"k" * 16, 128) != snapshot_key(b"k" * 16, 256) != snapshot_key(b"j" * 16, 128)
    with pytest.raises(ValueError, match="multiple of the classical block span 128"):
        SWAStrategy("periodic", 100).check(span)
    with pytest.raises(ValueError, match="unknown SWA strategy 'half'"):
        SWAStrategy("half")
    with pytest.raises(ValueError, match="needs --swa-period"):
        SWAStrategy("periodic")


def test_a_window_snapshot_restores_the_state_it_was_taken_from(model) -> None:
    runner = dsv4_runner(model, 8, 3)
    prompt = _ids(3 * 128 + 1, 1)
    runner.add_request("a", prompt)
    runner.step([("a", 3 * 128)])  # the state now stands at the boundary 384
    slot = runner.cache.part("a").state_slot
    pools = runner.executor.pools
    snapshot = {k: v.clone() for k, v in pools.window_snapshot(slot, 384, 128).items()}
    pools.restore_window(2, 384, [(384, snapshot)])
    for mine, restored in zip(pools.live_state(slot, 384), pools.live_state(2, 384), strict=True):
        assert mine.keys() == restored.keys()
        assert all(torch.equal(mine[name], restored[name]) for name in mine)
    assert sum(t.numel() * t.element_size() for t in snapshot.values()) == _snapshot_bytes(model.spec, 128)
    with pytest.raises(ValueError, match="block boundary"):
        pools.window_snapshot(slot, 300, 128)


def _snapshot_bytes(spec, rows: int) -> int:
    """By hand, in fp64: every layer's window rows, and each CSA layer's 4 previous-block rows
    (kv and score) of its main (2 x head_dim wide) and indexer (2 x index_head_dim) compressors."""
    csa = sum(r == CSA_RATIO for r in spec.layer_ratios)
    return (spec.num_layers * rows * spec.head_dim + csa * 2 * 4 * 2 * (spec.head_dim + spec.index_head_dim)) * 8


# ----- the engine through a persistent tier ---------------------------------------------------


def _serve(model, tiers, strategy, prompt, rid="r", tenant="", seed_model=None):
    runner = dsv4_runner(seed_model or model, 16, 2, persistent_tiers=tiers, swa=strategy)
    engine = Engine(runner, max_num_batched_tokens=512, max_num_seqs=2, record_logits=True)
    engine.add_request(prompt, SamplingParams(max_tokens=4, ignore_eos=True), rid, tenant=tenant)
    while engine.has_unfinished():
        engine.step()
        runner.check_integrity()
    runner.close()
    seq = engine.requests[rid].seqs[0]
    return engine.output(rid), torch.stack(seq.logits), seq.token_ids, runner.tier_reports()


def runner_block_bytes(model) -> int:
    """One classical block, every compressed layer, in fp64: CSA main and indexer entries, HCA."""
    spec = model.spec
    per = [
        (128 // r) * (spec.head_dim + (spec.index_head_dim if r == CSA_RATIO else 0)) for r in spec.layer_ratios if r
    ]
    return sum(per) * 8


def _tiers(kind: str, tmp_path: Path, request) -> list:
    if kind == "disk":
        return [DiskTier(tmp_path / "cache", 1 << 30)]
    server = request.getfixturevalue("redis_server")
    return [RedisTier(server.url)]


@pytest.mark.parametrize("tier_kind", ["disk", "redis"])
@pytest.mark.parametrize("name", list(STRATEGIES))
def test_each_swa_strategy_restores_a_hit_exactly(model, tmp_path, request, tier_kind, name) -> None:
    strategy = STRATEGIES[name]
    p = _ids(5 * 128 + 5, 2)
    _, _, _, first = _serve(model, _tiers(tier_kind, tmp_path, request), strategy, p)
    follow = p[: 5 * 128] + _ids(20, 3)  # a hit of 640 tokens: between two periodic snapshots
    out, logits, history, report = _serve(model, _tiers(tier_kind, tmp_path, request), strategy, follow)
    assert out.num_cached_tokens == 640 and report["tiers"]["blocks_loaded"] == 5  # a fresh pool: all from the tier
    ref = model.reference_logits(history[:-1])[len(follow) - 1 :]
    assert (logits - ref).abs().max().item() <= 1e-9  # fp64: exact up to rounding
    swa = report["swa"]
    stored = {"full": 5, "periodic": 2, "zero": 0}[name]  # boundaries 128..640; 256 and 512; none
    assert first["swa"]["snapshots_persisted"] == stored and first["swa"]["blocks_persisted"] == 5
    assert first["swa"]["snapshot_bytes_persisted"] == stored * _snapshot_bytes(model.spec, 128)
    assert first["swa"]["block_bytes_persisted"] == 5 * runner_block_bytes(model)
    assert swa["replayed_tokens"] == {"full": 0, "periodic": 128, "zero": 640}[name]
    assert swa["restores_from_snapshots"] == (name != "zero") and swa["snapshot_misses"] == 0


def test_a_damaged_snapshot_is_a_miss_and_the_hit_is_recomputed_exactly(model, tmp_path) -> None:
    p = _ids(3 * 128 + 5, 4)
    _serve(model, [DiskTier(tmp_path, 1 << 30)], STRATEGIES["full"], p)
    snapshots = [f for f in (tmp_path / "entries").rglob("*.safetensors") if f.stat().st_size > 100_000]
    assert len(snapshots) == 3  # the three window snapshots are the large entries
    for path in snapshots:
        raw = bytearray(path.read_bytes())
        raw[-9] ^= 0x40
        path.write_bytes(bytes(raw))
    follow = p[:384] + _ids(10, 5)
    out, logits, history, report = _serve(model, [DiskTier(tmp_path, 1 << 30)], STRATEGIES["full"], follow)
    # each of the three boundaries is tried, latest first, and found damaged: recompute all 384
    assert out.num_cached_tokens == 384 and report["swa"]["snapshot_misses"] == 3
    assert report["swa"]["replayed_tokens"] == 384 and report["disk_tier"]["num_corrupt"] == 3
    ref = model.reference_logits(history[:-1])[len(follow) - 1 :]
    assert (logits - ref).abs().max().item() <= 1e-9


def test_other_weights_and_other_tenants_never_hit(model, tmp_path) -> None:
    p = _ids(2 * 128 + 5, 6)
    _serve(model, [DiskTier(tmp_path, 1 << 30)], STRATEGIES["full"], p, tenant="alice")
    out, _, _, report = _serve(model, [DiskTier(tmp_path, 1 << 30)], STRATEGIES["full"], p, tenant="bob")
    assert out.num_cached_tokens == 0 and report["disk_tier"]["num_gets"] == 0
    other = TinyDSV4(seed=1, dtype=torch.float64)  # another weights version, the same layout
    out, _, _, report = _serve(model, [DiskTier(tmp_path, 1 << 30)], STRATEGIES["full"], p, "x", "alice", other)
    assert out.num_cached_tokens == 0
    # filed under its own weights: alice's blocks are not found, nor refused and deleted
    assert report["disk_tier"]["mismatches"] == {} and report["disk_tier"]["num_reclaimed"] == 0
    out, _, _, report = _serve(model, [DiskTier(tmp_path, 1 << 30)], STRATEGIES["full"], p, tenant="alice")
    assert out.num_cached_tokens == 256  # (the other weights deleted her first block: 0 cached)


def _generate(prompt: str, *flags: str) -> dict:
    argv = [sys.executable, "-m", "kvpool", "generate", "--model", "tiny-dsv4", "--no-chat", prompt]
    proc = subprocess.run([*argv, "--max-tokens", "6", *flags, "--json"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


@pytest.mark.parametrize("flags", [["full"], ["periodic", "--swa-period", "256"], ["zero"]])
def test_a_second_process_restores_the_prefix_with_each_strategy(tmp_path, flags) -> None:
    prompt = ",".join(map(str, _ids(3 * 128 + 40, 7)))
    tier = ["--disk-cache", str(tmp_path / "c"), "--swa-strategy", *flags]
    first = _generate(prompt, *tier)
    second = _generate(prompt, *tier)
    assert first["cached_tokens"] == 0 and second["cached_tokens"] == 384
    assert second["token_ids"] == first["token_ids"] == _generate(prompt)["token_ids"]  # = no tier at all
    swa = second["swa"]
    assert swa["strategy"] == flags[0] and second["disk_tier"]["num_gets"] >= 3
    assert swa["replayed_tokens"] == {"full": 0, "periodic": 128, "zero": 384}[flags[0]]
