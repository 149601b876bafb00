"""DeepSeek-V4's serving layout for the tiny model's classical pool (storage/dsv4.py
V4EntryPool, storage/quant.py; issue 14): each entry kind's round trip within its theory,
the bytes a block takes equal to the planner's (spec/dsv4.py), byte for byte, and the
engine over fp8 blocks reading exactly what the bytes hold: through one prefill step it
matches the exact pool's run bit for bit and stores the round trip of the exact pool's
entries; the next steps equal the exact engine given those round-tripped entries (fp64)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.engine.dsv4_runner import descriptor_for, dsv4_runner
from kvpool.engine.engine import Engine
from kvpool.engine.sampling import SamplingParams
from kvpool.models.tiny_dsv4 import TinyDSV4
from kvpool.spec.dsv4 import SERVING, DSV4Spec
from kvpool.spec.models import load_preset
from kvpool.storage.dsv4 import DSV4Pools, V4EntryPool

VALUES = st.lists(
    st.floats(-1e4, 1e4, allow_nan=False, width=32).filter(lambda v: v == 0 or abs(v) >= 1e-20),
    min_size=64,
    max_size=64,
)
SLACK = 1 + 2.0**-20


@settings(max_examples=150, deadline=None)
@given(values=VALUES, exponent=st.integers(-20, 20))
def test_a_main_entry_round_trips_within_its_theory(values, exponent) -> None:
    """48 non-RoPE dims in FP8 E4M3 under one power-of-two scale (the smallest keeping the
    amax within 448), 16 RoPE dims in BF16."""
    x = torch.tensor(values, dtype=torch.float32).view(1, 1, 64) * 2.0**exponent
    pool = V4EntryPool("main", 1, 1, 64, 16, torch.float32)
    pool[0] = x[0]
    back = pool[0:1]
    nope, got = x[..., :48], back[..., :48]
    s = 2.0 ** (int(pool.exps[0, 0, 0]) - 127)
    amax = float(nope.abs().max())
    assert amax / s <= 448 and (amax == 0 or amax / (s / 2) > 448)
    err = (got - nope).abs()
    normal = nope.abs() >= 2.0**-6 * s
    assert bool((err[normal] <= 2.0**-4 * nope.abs()[normal] * SLACK).all())
    assert bool((err[~normal] <= 2.0**-10 * s * SLACK).all())
    rope_err = (back[..., 48:] - x[..., 48:]).abs()
    assert bool((rope_err <= 2.0**-8 * x[..., 48:].abs() * SLACK + 1e-38).all())
    assert pool.codes.shape == (1, 1, 48) and pool.exps.shape == (1, 1, 8) and pool.rope.dtype == torch.bfloat16


@settings(max_examples=150, deadline=None)
@given(values=VALUES, exponent=st.integers(-20, 20))
def test_indexer_keys_round_trip_within_their_theory(values, exponent) -> None:
    x = torch.tensor(values, dtype=torch.float32).view(1, 1, 64) * 2.0**exponent
    fp8 = V4EntryPool("index-fp8", 1, 1, 64, 0, torch.float32)
    fp8[0] = x[0]
    s = float(fp8.scales[0, 0, 0])  # one fp32 scale per 128 dims: amax / 448
    err = (fp8[0:1] - x).abs()
    normal = x.abs() >= 2.0**-6 * s
    assert bool((err[normal] <= 2.0**-4 * x.abs()[normal] * SLACK).all())
    assert bool((err[~normal] <= 2.0**-10 * s * SLACK).all())
    mx = V4EntryPool("index-mxfp4", 1, 1, 64, 0, torch.float32)
    mx[0] = x[0]
    assert mx.codes.shape == (1, 1, 32) and mx.exps.shape == (1, 1, 2)  # two codes a byte, a scale per 32
    back = mx[0:1].view(2, 32)
    for g in range(2):
        group = x.view(2, 32)[g]
        s = 2.0 ** (int(mx.exps[0, 0, g]) - 127)
        amax = float(group.abs().max())
        assert amax / s <= 6 and (amax == 0 or amax / (s / 2) > 6)
        y = group.abs() / s
        half_step = torch.where(y <= 2, 0.25, torch.where(y <= 4, 0.5, 1.0)) * s  # E2M1's grid: 0.5, 1, 2 apart
        assert bool(((back[g] - group).abs() <= half_step * SLACK).all())


def test_the_bytes_of_a_classical_block_are_the_planners() -> None:
    """The tiny model and V4-Flash: a classical block of the fp8 layout takes what
    spec.classical_bytes_per_block(SERVING, indexer format) says (584 B main entries for V4)."""
    tiny = TinyDSV4().spec
    flash = load_preset("deepseek-v4-flash").dsv4
    assert isinstance(flash, DSV4Spec)
    for spec in (tiny, flash):
        for fmt in ("fp8", "mxfp4"):
            pools = DSV4Pools(spec, 1, 1, entry_format="fp8", indexer_format=fmt)
            assert pools.classical_block_bytes() == spec.classical_bytes_per_block(SERVING, fmt), (spec.name, fmt)
    # the tiny model: 24 FP8 + 8 BF16 x 2 + 8 scale bytes = 48 B an entry, against fp32's 128
    main = DSV4Pools(tiny, 1, 1, entry_format="fp8").classical[2].main
    assert isinstance(main, V4EntryPool) and main.bytes_per_entry == 48
    with pytest.raises(ValueError, match="unknown indexer key format 'fp4'"):
        DSV4Pools(tiny, 1, 1, entry_format="fp8", indexer_format="fp4")
    with pytest.raises(ValueError, match="HiSparse keeps exact entries"):
        DSV4Pools(tiny, 4, 1, entry_format="fp8", hot_set_entries=8)


def _engine(model: TinyDSV4, kv_format: str, indexer_format: str = "fp8", chunk: int = 1024) -> Engine:
    runner = dsv4_runner(model, 16, 2, kv_format=kv_format, indexer_format=indexer_format)
    return Engine(runner, max_num_batched_tokens=chunk, max_num_seqs=2, record_logits=True)


@pytest.mark.parametrize("indexer_format", ["fp8", "mxfp4"])
def test_the_engine_reads_what_the_fp8_bytes_hold(indexer_format) -> None:
    model = TinyDSV4(seed=3, dtype=torch.float64)
    prompt = [(5 * i + 1) % model.vocab_size for i in range(300)]  # two whole spans of 128, and 44 tokens
    exact, fp8 = _engine(model, "exact"), _engine(model, "fp8", indexer_format)
    for engine in (exact, fp8):
        engine.add_request(prompt, SamplingParams(max_tokens=1, ignore_eos=True), "r")
        while engine.has_unfinished():
            engine.step()
            engine.runner.check_integrity()
    # one prefill step reads its own new entries exact: the same logits, bit for bit
    assert torch.equal(exact.requests["r"].seqs[0].logits[0], fp8.requests["r"].seqs[0].logits[0])
    # ... and the fp8 pool holds the exact pool's entries quantized: the same bytes when the
    # exact entries are quantized here
    pe, pf = exact.runner.executor.pools, fp8.runner.executor.pools
    blocks = fp8.runner.cache.block_ids("r") if "r" in fp8.runner.cache else None
    assert blocks is None  # released: the blocks stay cached, findable by the next request
    written = [b for b in range(16) if bool(pf.classical[2].main.codes[b].any())]
    assert len(written) == 2
    for cl_e, cl_f in zip(pe.classical, pf.classical, strict=True):
        for te, tf in ((cl_e.main, cl_f.main), (cl_e.idx, cl_f.idx)):
            if tf is None:
                continue
            check = V4EntryPool(tf.kind, 16, tf.shape[1], tf.shape[2], tf.rope_dim, torch.float64)
            check[torch.tensor(written)] = te[torch.tensor(written)]
            for a, b in zip(check.tensors(), tf.tensors(), strict=True):
                assert torch.equal(a[written], b[written])
            # the exact engine from here on reads the same values the fp8 bytes hold
            te[torch.tensor(written)] = tf[torch.tensor(written)]
    # a second request hits the two spans: fp8 reads them from the bytes, exact from the
    # round-tripped values put in its pool: the same logits at every step, in fp64
    follow = prompt[:256] + [(3 * i) % model.vocab_size for i in range(70)]
    outs = []
    for engine in (exact, fp8):
        engine.add_request(follow, SamplingParams(max_tokens=12, ignore_eos=True), "f")
        while engine.has_unfinished():
            engine.step()
            engine.runner.check_integrity()
        out = engine.output("f")
        assert out.num_cached_tokens == 256
        outs.append(torch.stack(engine.requests["f"].seqs[0].logits))
    assert outs[0].shape == outs[1].shape == (12, model.vocab_size)
    assert (outs[0] - outs[1]).abs().max().item() <= 1e-12
    # and the layout is lossy: against an exact run that never saw the round trip
    fresh = _engine(model, "exact")
    fresh.add_request(prompt, SamplingParams(max_tokens=1, ignore_eos=True), "r")
    fresh.add_request(follow, SamplingParams(max_tokens=12, ignore_eos=True), "f")
    while fresh.has_unfinished():
        fresh.step()
    lossy = (torch.stack(fresh.requests["f"].seqs[0].logits) - outs[1]).abs().max().item()
    assert lossy > 1e-6


def test_a_prefix_cached_exact_never_serves_fp8() -> None:
    model = TinyDSV4()
    keys = {
        descriptor_for(model).key(),
        descriptor_for(model, "fp8", "fp8").key(),
        descriptor_for(model, "fp8", "mxfp4").key(),
    }
    assert len(keys) == 3


def test_the_cli_takes_the_v4_layout_and_refuses_what_cannot_work() -> None:
    import json

    argv = [sys.executable, "-m", "kvpool", "generate", "--model", "tiny-dsv4", "--no-chat", "1,2,3", "--max-tokens"]
    proc = subprocess.run(
        [*argv, "2", "--kv-dtype", "fp8", "--indexer-format", "mxfp4", "--json"], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    spec = TinyDSV4().spec
    assert report["kv_format"] == "fp8 (V4 layout, mxfp4 indexer keys)"
    assert report["classical_block_bytes"] == spec.classical_bytes_per_block(SERVING, "mxfp4")
    for flags, needle in [
        (["--kv-dtype", "int8"], "tiny-dsv4 takes fp32 (exact) or fp8"),
        (["--kv-dtype", "fp8", "--hisparse", "8"], "--kv-cache-dtype fp8 with --hisparse"),
        (["--kv-dtype", "fp8", "--host-cache-gib", "1"], "the tiers keep unquantized blocks only"),
        (["--indexer-format", "mxfp4"], "--indexer-format is for tiny-dsv4 with --kv-cache-dtype fp8"),
    ]:
        proc = subprocess.run([*argv, "2", *flags], capture_output=True, text=True, timeout=60)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1 and needle in lines[0], proc.stderr


def test_kvpool_eval_kv_quant_on_tiny_dsv4() -> None:
    import json

    argv = [sys.executable, "-m", "kvpool", "eval", "kv-quant", "--model", "tiny-dsv4", "--tokens", "160"]
    proc = subprocess.run([*argv, "--greedy-steps", "3", "--json"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    layouts = {r["name"]: r for r in json.loads(proc.stdout)["layouts"]}
    exact, fp8, mx = layouts["exact"], layouts["fp8 / fp8 keys"], layouts["fp8 / mxfp4 keys"]
    assert exact["kl_mean"] == 0 and exact["top1_agreement"] == 1 and exact["greedy_agreement"] == 1
    spec = TinyDSV4().spec
    assert fp8["classical_block_bytes"] == spec.classical_bytes_per_block(SERVING, "fp8")
    assert mx["classical_block_bytes"] < fp8["classical_block_bytes"] < exact["classical_block_bytes"]
    # the ratio itself (it was rounded to 3 places, then printed to 2: 12,416 / 4,400 read 2.822)
    assert fp8["capacity_gain"] == exact["classical_block_bytes"] / fp8["classical_block_bytes"]
    assert mx["capacity_gain"] == exact["classical_block_bytes"] / mx["classical_block_bytes"]
    assert fp8["kl_mean"] > 0 and mx["kl_mean"] > 0  # the 160-token prompt's first span is read from the bytes
    proc = subprocess.run([*argv, "--plot", "x.png"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "--plot and --text are for SmolLM2" in proc.stderr.strip().splitlines()[-1]
