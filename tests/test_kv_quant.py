"""Quantized KV storage (kvpool.storage.quant; issue 14, first part): each format's round
trip within its own theory, the engine's paged attention over quantized blocks equal to the
contiguous reference over the same bytes (fp64, through prefix hits and copy-on-write
forks), the bytes a format stores, by hand, and the descriptor and flags that keep formats
apart."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.attention.reference import causal_attention
from kvpool.engine.engine import Engine
from kvpool.engine.llama_runner import LlamaRunner
from kvpool.engine.sampling import SamplingParams
from kvpool.storage.kv import QuantizedKVStorage
from kvpool.storage.quant import KV_FORMATS, dequantize, kv_format, quantize, round_trip
from random_llama import CONFIG, DESCRIPTOR, random_ids, random_llama

QUANTIZED = [name for name in KV_FORMATS if name != "fp32"]


# ----- the round trip, against each format's theory ---------------------------------------

# (relative bound for normal values, smallest normal of the element format, absolute bound
# below it in units of the scale): half an ulp of the significand, half the subnormal step
THEORY = {
    "fp8_e4m3": (2.0**-4, 2.0**-6, 2.0**-10),
    "fp8_e5m2": (2.0**-3, 2.0**-14, 2.0**-17),
}


@settings(max_examples=200, deadline=None)
@given(
    name=st.sampled_from(QUANTIZED),
    # magnitudes KV holds: the fp32 scale of a vector whose amax is below ~1e-33 is itself subnormal
    values=st.lists(
        st.floats(-1e4, 1e4, allow_nan=False, width=32).filter(lambda v: v == 0 or abs(v) >= 1e-20),
        min_size=1,
        max_size=64,
    ),
    exponent=st.integers(-20, 20),
)
def test_each_format_round_trips_within_its_theory(name, values, exponent) -> None:
    fmt = kv_format(name)
    x = torch.tensor(values, dtype=torch.float32) * 2.0**exponent
    x = x.view(1, -1)  # one vector: one scale
    q, scale = quantize(fmt, x)
    back = dequantize(fmt, q, scale, torch.float32)
    assert q.dtype == fmt.dtype and back.shape == x.shape
    err = (back - x).abs()
    slack = 1 + 2.0**-20  # the fp32 division by the scale before the rounding
    if name == "int8":
        s = x.abs().max() / 127 if x.abs().max() > 0 else torch.tensor(1.0)
        assert scale.item() == pytest.approx(s.item(), rel=1e-6)
        assert bool((err <= s / 2 * slack + 1e-30).all())
    elif name in THEORY:
        rel, min_normal, sub = THEORY[name]
        s = scale.item()
        normal = x.abs() / s >= min_normal
        assert bool((err[normal] <= rel * x.abs()[normal] * slack).all())
        assert bool((err[~normal] <= sub * s * slack).all())
        assert back.abs().max() <= x.abs().max() * slack  # nothing saturates past the vector's amax
    else:  # bf16 / fp16: plain casts, relative error of half an ulp in the normal range
        rel = {"bf16": 2.0**-8, "fp16": 2.0**-11}[name]
        finite = x.abs() < (65504 if name == "fp16" else 3e38)
        normal = finite & (x.abs() >= (2.0**-14 if name == "fp16" else 2.0**-126))
        assert bool((err[normal] <= rel * x.abs()[normal] * slack).all())
    if name != "bf16" and name != "fp16":
        assert torch.equal(round_trip(fmt, back), back)  # stored values come back as themselves


def test_a_zero_vector_and_the_extremes() -> None:
    for name in ("fp8_e4m3", "fp8_e5m2", "int8"):
        fmt = kv_format(name)
        q, scale = quantize(fmt, torch.zeros(2, 8))
        assert torch.equal(scale, torch.ones(2)) and torch.equal(
            dequantize(fmt, q, scale, torch.float32), torch.zeros(2, 8)
        )
        x = torch.tensor([[-3.0, 0.5, 3.0]])
        back = round_trip(fmt, x)
        assert back[0, 0].item() == -3.0 and back[0, 2].item() == 3.0  # the amax maps to +-qmax exactly
    with pytest.raises(ValueError, match="unknown KV format 'fp4'; one of fp32, bf16"):
        kv_format("fp4")


# ----- the engine over quantized blocks ---------------------------------------------------


@pytest.fixture(scope="module")
def model():
    return random_llama("cpu", torch.float64)


def _quantized_reference(model, fmt, token_ids: list[int]) -> torch.Tensor:
    """Logits [T, vocab] by full recompute, every K and V read through the format's round
    trip: what the stored bytes hold."""
    ids = torch.tensor(token_ids)
    attend = lambda layer, q, k, v: causal_attention(q, round_trip(fmt, k), round_trip(fmt, v))  # noqa: E731
    return model.logits(model.forward(ids, torch.arange(len(ids)), attend, fused=False))


@pytest.mark.parametrize("name", QUANTIZED)
def test_paged_attention_over_quantized_blocks_equals_the_reference_over_the_same_bytes(model, name) -> None:
    fmt = kv_format(name)
    runner = LlamaRunner(model, 24, 16, DESCRIPTOR, kv_format=name)
    engine = Engine(runner, max_num_batched_tokens=40, max_num_seqs=4, record_logits=True)
    copies: list[int] = []
    apply_copies = runner.storage.apply_copies
    runner.storage.apply_copies = lambda c: (copies.append(len(c)), apply_copies(c))  # count, then copy
    shared = random_ids(48, 1)
    prompts = {"a": shared + random_ids(9, 2), "b": shared + random_ids(5, 3)}  # b hits a's 48 tokens
    params = {
        "a": SamplingParams(max_tokens=6, ignore_eos=True),
        "b": SamplingParams(max_tokens=6, n=2, temperature=2.0, seed=1),
    }
    for rid in ("a", "b"):  # b after a: a prefix hit; b's two samples fork its tail block (copy-on-write)
        engine.add_request(prompts[rid], params[rid], rid)
        while engine.has_unfinished():
            engine.step()
            runner.check_integrity()
    assert engine.output("b").num_cached_tokens == 48
    seqs = [engine.requests["a"].seqs[0], *engine.requests["b"].seqs]
    assert len(seqs) == 3 and sum(copies) == 1  # b's second sample wrote into a copy of the shared tail
    lossy = 0.0
    for seq, prompt in zip(seqs, [prompts["a"], prompts["b"], prompts["b"]], strict=True):
        got = torch.stack(seq.logits)
        history = seq.token_ids[:-1]
        ref = _quantized_reference(model, fmt, history)[len(prompt) - 1 :]
        assert (got - ref).abs().max().item() <= 1e-9  # fp64: the same bytes, read the same way
        exact = model.logits(
            model.forward(
                torch.tensor(history), torch.arange(len(history)), lambda layer, q, k, v: causal_attention(q, k, v)
            )
        )[len(prompt) - 1 :]
        lossy = max(lossy, (got - exact).abs().max().item())
    assert lossy > 1e-6  # the format really stored fewer bits: the loss is visible, and measured elsewhere


def test_the_bytes_a_format_stores_by_hand(model) -> None:
    c = CONFIG
    for name, per_head in (("int8", 32 + 4), ("fp8_e4m3", 32 + 4), ("bf16", 64), ("fp16", 64)):
        runner = LlamaRunner(model, 10, 16, DESCRIPTOR, kv_format=name)
        storage = runner.storage
        assert isinstance(storage, QuantizedKVStorage)
        # K and V, every layer and KV head of every slot: elements plus one fp32 scale (int8, fp8)
        assert storage.num_bytes == 10 * 16 * 2 * c.num_layers * c.num_kv_heads * per_head
        assert storage.bytes_per_token == 2 * c.num_layers * c.num_kv_heads * per_head
        assert storage.scale_bytes == (10 * 16 * 2 * c.num_layers * c.num_kv_heads * 4 if per_head == 36 else 0)
        assert runner.cache_stats()["kv_capacity_bytes"] == storage.num_bytes
    fp64 = LlamaRunner(model, 10, 16, DESCRIPTOR)
    assert fp64.storage.bytes_per_token == 2 * c.num_layers * c.num_kv_heads * 32 * 8 and fp64.kv_format == "float64"
    assert LlamaRunner(model, 10, 16, DESCRIPTOR, kv_format="fp32").kv_format == "fp32"  # fp32 of an fp64 model


def test_quantized_blocks_never_meet_the_tiers_or_another_format(model, fp64_model) -> None:
    from kvpool.engine.build import descriptor_for
    from kvpool.tiers import HostTier

    with pytest.raises(ValueError, match="tiers keep unquantized blocks only"):
        LlamaRunner(model, 10, 16, DESCRIPTOR, kv_format="int8", host_tier=HostTier(1 << 20))
    layouts = {name: descriptor_for(fp64_model, 16, name).layout_id for name in KV_FORMATS}
    assert len(set(layouts.values())) == len(KV_FORMATS) and layouts["int8"].endswith(":int8")
    keys = {descriptor_for(fp64_model, 16, name).key() for name in KV_FORMATS}
    assert len(keys) == len(KV_FORMATS)  # the chain's root differs: no hash of one format finds another's


def test_the_cli_takes_kv_dtype_and_refuses_what_cannot_work() -> None:
    import json

    from kvpool.cli.args import KV_DTYPES

    assert KV_DTYPES == tuple(KV_FORMATS)
    generate = [sys.executable, "-m", "kvpool", "generate", "What is the capital of France?", "--max-tokens", "8"]
    proc = subprocess.run([*generate, "--kv-dtype", "int8", "--json"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["kv_format"] == "int8" and report["memory"]["details"]["kv_pool"]["quant_scales"] > 0
    for flags, needle in [
        (["--kv-dtype", "int8", "--host-cache-gib", "1"], "--kv-dtype int8 with --host-cache-gib: the tiers keep"),
        (["--model", "tiny-dsv4", "--no-chat", "--kv-dtype", "fp8_e4m3"], "tiny-dsv4 keeps its exact fp32 pools"),
    ]:
        argv = [sys.executable, "-m", "kvpool", "generate", "1,2,3", "--max-tokens", "2", *flags]
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=120)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1 and needle in lines[0], proc.stderr


# ----- kvpool eval kv-quant -----------------------------------------------------------------


def test_the_evaluation_measures_what_it_says(model) -> None:
    import math

    import torch.nn.functional as F

    from kvpool.verify.kv_quant import evaluate

    ids = random_ids(96, 7)
    ppl_ref, results = evaluate(model, ids, ["fp16", "bf16", "int8", "fp8_e4m3"])
    # the fp32 perplexity, computed here on its own
    logits = model.logits(
        model.forward(
            torch.tensor(ids), torch.arange(96), lambda layer, q, k, v: causal_attention(q, k, v), fused=False
        )
    )
    nll = F.cross_entropy(logits[:-1], torch.tensor(ids[1:]), reduction="mean").item()
    assert ppl_ref == pytest.approx(math.exp(nll), rel=1e-9)
    by = {r.name: r for r in results}
    for r in results:
        assert len(r.layers) == CONFIG.num_layers and r.kl_mean >= 0 and 0 <= r.top1_agreement <= 1
    # per layer, the round trip's own theory, norm-wise
    assert max(layer.k_rel for layer in by["fp16"].layers) <= 2.0**-11
    assert max(layer.k_rel for layer in by["bf16"].layers) <= 2.0**-8
    assert max(layer.v_rel for layer in by["fp8_e4m3"].layers) <= 2.0**-4
    assert by["fp16"].kl_mean < by["bf16"].kl_mean and by["int8"].kl_mean < by["fp8_e4m3"].kl_mean
    per_head = CONFIG.head_dim + 4  # int8: one byte an element, one fp32 scale
    assert by["int8"].bytes_per_token == 2 * CONFIG.num_layers * CONFIG.num_kv_heads * per_head
    assert by["int8"].capacity_gain == pytest.approx(CONFIG.head_dim * 4 / per_head, abs=1e-3)
    with pytest.raises(ValueError, match="at least 2 tokens"):
        evaluate(model, [1], ["int8"])


def test_kvpool_eval_kv_quant_on_smollm2(tmp_path) -> None:
    import json

    argv = [sys.executable, "-m", "kvpool", "eval", "kv-quant", "--tokens", "64", "--formats", "int8,fp16"]
    proc = subprocess.run(
        [*argv, "--json", "--plot", str(tmp_path / "q.png")], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["tokens"] == 64 and report["text"].startswith("pydoc_data.topics")
    assert [f["name"] for f in report["formats"]] == ["int8", "fp16"] and len(report["formats"][0]["layers"]) == 30
    assert (tmp_path / "q.png").stat().st_size > 10_000
    for flags, needle in [
        (["--text", str(tmp_path)], "is a directory, not a file"),
        (["--plot", str(tmp_path / "q.png" / "x.png")], "is a file, not a directory"),
        (["--plot", str(tmp_path / "q.svg")], "expected a .png file name"),
    ]:
        proc = subprocess.run([*argv, *flags], capture_output=True, text=True, timeout=120)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1 and needle in lines[0], proc.stderr


def test_the_c_decode_kernel_reads_the_dequantized_blocks_as_the_torch_path_does(kernels) -> None:
    """fp32 with the C kernels: the same model, the same quantized bytes (the fused forward
    writes identical K/V either way), decode attention by the C kernel or by torch."""
    from kvpool.models.llama import LlamaModel

    base = random_llama("cpu", torch.float32)
    model = LlamaModel(CONFIG, base.embed, base.norm, base.layers, None, "cpu", kernels)
    out = {}
    for path in ("native", "bags"):
        runner = LlamaRunner(model, 24, 16, DESCRIPTOR, kv_format="int8", decode_path=path)
        engine = Engine(runner, max_num_batched_tokens=64, max_num_seqs=4, record_logits=True)
        for i in range(3):
            engine.add_request(random_ids(30 + 7 * i, i), SamplingParams(max_tokens=8, ignore_eos=True), f"r{i}")
        while engine.has_unfinished():
            engine.step()
        assert runner.last_decode_path == path
        seqs = [engine.requests[f"r{i}"].seqs[0] for i in range(3)]
        out[path] = ([s.token_ids for s in seqs], torch.cat([torch.stack(s.logits) for s in seqs]))
    assert out["native"][0] == out["bags"][0]
    # one attention's fp32 rounding, summed in another order: far below a quantization step
    scale = out["bags"][1].abs().max().item()
    assert (out["native"][1] - out["bags"][1]).abs().max().item() <= 1e-5 * scale


@pytest.mark.parametrize("name", ["int8", "fp8_e4m3", "fp8_e5m2"])
def test_the_planner_counts_what_the_quantized_storage_allocates_byte_for_byte(name) -> None:
    from kvpool.capacity.kv import kv_layout
    from kvpool.capacity.planner import occupancy
    from kvpool.spec.models import load_preset

    spec = load_preset("smollm2-135m")
    storage = QuantizedKVStorage(
        spec.num_layers, 40, 16, spec.num_kv_heads, spec.head_dim, kv_format(name), torch.float32
    )
    layout = kv_layout(spec, name, block_size=16, alignment=1)
    lines = occupancy(layout, storage.num_bytes, 40 * 16, 1)  # one request filling the 40 blocks
    assert lines["quant_scales"] == storage.scale_bytes > 0
    assert lines["data"] == storage.k.nbytes + storage.v.nbytes
    assert lines["unused"] == lines["tail_waste"] == lines["alignment_padding"] == 0
    assert layout.bytes_per_token == storage.bytes_per_token  # 11,520 B of elements + 720 B of scales


def test_the_planner_refuses_per_token_formats_where_they_do_not_apply() -> None:
    from kvpool.capacity.kv import kv_layout
    from kvpool.spec.models import load_preset

    with pytest.raises(ValueError, match="kv dtype 'int8' is for GQA / MHA layers; deepseek-v4-flash is dsv4"):
        kv_layout(load_preset("deepseek-v4-flash"), "int8")


def test_the_simulator_takes_the_per_token_formats() -> None:
    import json

    def capacity(dtype: str) -> int:
        argv = [sys.executable, "-m", "kvpool", "simulate", "--model", "llama-3.1-8b", "--gpu", "h200"]
        proc = subprocess.run(
            [*argv, "--kv-dtype", dtype, "--requests", "20", "--json"], capture_output=True, text=True
        )
        assert proc.returncode == 0, proc.stderr
        return json.loads(proc.stdout)["kv_capacity_tokens"]

    # head_dim 128: bf16 is 256 B a head and token for K (and for V), int8 128 B + a 4 B scale
    assert capacity("int8") / capacity("bf16") == pytest.approx(256 / 132, rel=0.01)
