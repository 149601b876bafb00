"""Quantized KV storage (spec/kv_formats.py, storage/quant.py, storage/kv.py; issue 14):
each format's round trip within its own theory, the full-precision tail of the chunked
formats (block-scaled FP8, KIVI) and the bytes a chunk ends with whatever the chunking of
its writes, paged attention (torch twin and C kernel) equal to the contiguous reference over
the same bytes through prefix hits, chunked prefill and copy-on-write forks, the bytes each
format stores, by hand, and the descriptor and flags that keep formats apart."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.attention.backends import paged_step as runner_module  # where the backends plan a step
from kvpool.attention.backends.step import function_step
from kvpool.engine.engine import Engine
from kvpool.engine.llama_runner import llama_runner
from kvpool.engine.runner import ModelRunner
from kvpool.engine.sampling import SamplingParams
from kvpool.spec.kv_formats import KV_SCHEMAS, kv_schema
from kvpool.storage.kv import QuantizedKVStorage, SeqSpan
from kvpool.storage.quant import (
    dequantize,
    dequantize_k,
    dequantize_v,
    quantize,
    quantize_k,
    quantize_v,
    round_trip,
    round_trip_kv,
)
from random_llama import CONFIG, DESCRIPTOR, random_ids, random_llama

QUANTIZED = [name for name in KV_SCHEMAS if name != "fp32"]
PER_VECTOR = [n for n in QUANTIZED if KV_SCHEMAS[n].k_scale in ("none", "token")]
# what the engine tests run: KIVI with G and R that fit the random model's 16-token blocks
# and 32-dim heads (the paper's G=32, R=128 need 128-token blocks: tested on the storage)
ENGINE_FORMATS = [n for n in QUANTIZED if not n.startswith("kivi")] + ["kivi4-g8-r16", "kivi2-g8-r8"]


# ----- the round trip, against each format's theory ---------------------------------------

# (relative bound for normal values, smallest normal of the element format, absolute bound
# below it in units of the scale): half an ulp of the significand, half the subnormal step
THEORY = {
    "float8_e4m3fn": (2.0**-4, 2.0**-6, 2.0**-10),
    "float8_e5m2": (2.0**-3, 2.0**-14, 2.0**-17),
}
SLACK = 1 + 2.0**-20  # the fp32 division by the scale before the rounding
MAGNITUDES = st.lists(
    # magnitudes KV holds: the fp32 scale of a vector whose amax is below ~1e-33 is itself subnormal
    st.floats(-1e4, 1e4, allow_nan=False, width=32).filter(lambda v: v == 0 or abs(v) >= 1e-20),
    min_size=1,
    max_size=64,
)


def _check_symmetric(element: str, x: torch.Tensor, back: torch.Tensor, s: float) -> None:
    """One symmetric scale s over x: the element format's theory."""
    err = (back - x).abs()
    if element == "int8":
        assert bool((err <= s / 2 * SLACK + 1e-30).all())
        return
    rel, min_normal, sub = THEORY[element]
    normal = x.abs() / s >= min_normal
    assert bool((err[normal] <= rel * x.abs()[normal] * SLACK).all())
    assert bool((err[~normal] <= sub * s * SLACK).all())
    assert back.abs().max() <= x.abs().max() * SLACK  # nothing saturates past the amax


@settings(max_examples=200, deadline=None)
@given(name=st.sampled_from(PER_VECTOR), values=MAGNITUDES, exponent=st.integers(-20, 20))
def test_each_per_vector_format_round_trips_within_its_theory(name, values, exponent) -> None:
    fmt = kv_schema(name)
    x = (torch.tensor(values, dtype=torch.float32) * 2.0**exponent).view(1, -1)  # one vector: one scale
    q, scale = quantize(fmt, x)
    back = dequantize(fmt, q, scale, torch.float32)
    assert back.shape == x.shape
    if fmt.scaled:
        amax = x.abs().max()
        s = amax / fmt.qmax if amax > 0 else torch.tensor(1.0)
        assert scale.item() == pytest.approx(s.item(), rel=1e-6)
        _check_symmetric(fmt.element, x, back, scale.item())
        assert torch.equal(round_trip(fmt, back), back)  # stored values come back as themselves
    else:  # bf16 / fp16: plain casts, relative error of half an ulp in the normal range
        rel = {"bf16": 2.0**-8, "fp16": 2.0**-11}[name]
        finite = x.abs() < (65504 if name == "fp16" else 3e38)
        normal = finite & (x.abs() >= (2.0**-14 if name == "fp16" else 2.0**-126))
        assert bool(((back - x).abs()[normal] <= rel * x.abs()[normal] * SLACK).all())


@settings(max_examples=100, deadline=None)
@given(
    name=st.sampled_from(["fp8_e4m3", "fp8_e5m2"]),
    data=st.data(),
    exponent=st.integers(-20, 20),
)
def test_block_scaled_fp8_round_trips_within_its_theory(name, data, exponent) -> None:
    """One scale per (block, head): amax over the head's whole block / qmax, for K and for V."""
    fmt = kv_schema(name)
    values = data.draw(st.lists(MAGNITUDES.filter(lambda v: len(v) >= 4).map(lambda v: v[:4]), min_size=8, max_size=8))
    x = torch.tensor(values, dtype=torch.float32).T.reshape(1, 1, 4, 8) * 2.0**exponent  # [1, 1, d=4, slots=8]
    qk = quantize_k(fmt, x)
    assert qk.scale.shape == (1, 1, 1)
    _check_symmetric(fmt.element, x, dequantize_k(fmt, qk, torch.float32), qk.scale.item())
    qv = quantize_v(fmt, x.transpose(-1, -2))
    assert torch.equal(qv.scale, qk.scale)  # the same values, the same amax
    _check_symmetric(fmt.element, x.transpose(-1, -2), dequantize_v(fmt, qv, torch.float32), qv.scale.item())


@settings(max_examples=100, deadline=None)
@given(
    bits=st.sampled_from([2, 4]),
    group=st.sampled_from([4, 8]),
    seed=st.integers(0, 2**16),
    exponent=st.integers(-12, 12),
)
def test_kivi_round_trips_within_half_a_step_of_its_groups(bits, group, seed, exponent) -> None:
    """Asymmetric b-bit groups: every value within s / 2 of itself, s the stored fp16 scale,
    s no larger than the group's range / (2^b - 1) rounded up once; codes packed 8 / b a byte."""
    fmt = kv_schema(f"kivi{bits}-g{group}-r{2 * group}")
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 3, 8, 2 * group, generator=g) * 2.0**exponent  # K chunk [.., d=8, slots=2G]
    x[0, 0, 0] = 1.5 * 2.0**exponent  # one constant channel group
    qk = quantize_k(fmt, x)
    assert qk.codes.dtype == torch.uint8 and qk.codes.shape[-1] == 2 * group * bits // 8
    assert qk.scale.dtype == torch.float16 and qk.scale.shape == (2, 3, 8, 2)
    back = dequantize_k(fmt, qk, torch.float32)
    groups = x.view(2, 3, 8, 2, group)
    err = (back.view(2, 3, 8, 2, group) - groups).abs()
    s = qk.scale.float().unsqueeze(-1)
    assert bool((err <= s / 2 * (1 + 2.0**-10) + 1e-30).all())
    spread = (groups.amax(-1) - qk.zero.float()) / (2**bits - 1)  # the range from the stored zero point
    flat = spread == 0  # a constant group whose value fp16 holds: scale 1, every code 0
    assert bool((qk.scale.float()[flat] == 1).all())
    assert bool((qk.scale.float()[~flat] <= spread[~flat] * (1 + 2.0**-10) + 2.0**-24).all())
    assert bool((qk.zero.float() <= groups.amin(-1)).all())
    assert float(err[0, 0, 0, 0].max()) <= 2.0**exponent * 2.0**-10  # a constant group: its value, to fp16
    v = x.transpose(-1, -2)  # V chunk [.., slots, d=8], groups of G channels: G must divide d
    if 8 % group == 0:
        qv = quantize_v(fmt, v)
        errv = (dequantize_v(fmt, qv, torch.float32) - v).abs().view(2, 3, 2 * group, 8 // group, group)
        assert bool((errv <= qv.scale.float().unsqueeze(-1) / 2 * (1 + 2.0**-10) + 1e-30).all())


def test_a_zero_vector_the_extremes_and_bad_names() -> None:
    for name in ("fp8_e4m3_token", "fp8_e5m2_token", "int8"):
        fmt = kv_schema(name)
        q, scale = quantize(fmt, torch.zeros(2, 8))
        assert torch.equal(scale, torch.ones(2)) and torch.equal(
            dequantize(fmt, q, scale, torch.float32), torch.zeros(2, 8)
        )
        back = round_trip(fmt, torch.tensor([[-3.0, 0.5, 3.0]]))
        assert back[0, 0].item() == -3.0 and back[0, 2].item() == 3.0  # the amax maps to +-qmax exactly
    with pytest.raises(ValueError, match="unknown KV format 'fp4'; one of fp32, bf16"):
        kv_schema("fp4")
    with pytest.raises(ValueError, match="'x3' is not g<group size> or r<residual>"):
        kv_schema("kivi2-x3")
    with pytest.raises(ValueError, match="apply to the KIVI formats only"):
        kv_schema("int8-g16")
    with pytest.raises(ValueError, match="the residual R=128 .* does not divide the block size 16"):
        kv_schema("kivi2").check(16, 64)
    with pytest.raises(ValueError, match="the group size 32 does not divide the residual 48"):
        kv_schema("kivi4-r48").check(96, 64)
    with pytest.raises(ValueError, match="the group size 32 does not divide the head dim 48"):
        kv_schema("kivi4").check(128, 48)


# ----- the storage: tails, chunks, bytes ------------------------------------------------------


def _write(storage: QuantizedKVStorage, block: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
    """Tokens [start, start + n) of one block, every layer."""
    slots = torch.arange(start, start + k.shape[0]) + block * storage.block_size
    index = storage.write_index(slots, [SeqSpan([block], start, start + k.shape[0])])
    for layer in range(storage.num_layers):
        storage.write(layer, index, k, v)


@settings(max_examples=30, deadline=None)
@given(
    name=st.sampled_from(["fp8_e4m3", "fp8_e5m2", "kivi4-g4-r8", "kivi2-g8-r8", "int8", "bf16"]),
    cuts=st.lists(st.integers(1, 15), max_size=6),
    seed=st.integers(0, 1000),
)
def test_a_chunk_reads_in_full_precision_until_it_fills_and_its_bytes_never_depend_on_the_writes(
    name, cuts, seed
) -> None:
    fmt = kv_schema(name)
    g = torch.Generator().manual_seed(seed)
    k, v = torch.randn(16, 2, 8, generator=g), torch.randn(16, 2, 8, generator=g)
    whole = QuantizedKVStorage(1, 4, 16, 2, 8, fmt)
    _write(whole, 3, 0, k, v)  # the block in one write
    pieces = QuantizedKVStorage(1, 4, 16, 2, 8, fmt)
    flush = fmt.flush(16)
    bounds = [0, *sorted(set(cuts)), 16]
    for a, b in zip(bounds, bounds[1:], strict=False):
        _write(pieces, 3, a, k[a:b], v[a:b])
        kc, vc = pieces.contiguous(0, [3], b)
        ref_k, ref_v = round_trip_kv(fmt, k[:b], v[:b], 16)
        assert torch.equal(kc.transpose(0, 1), ref_k) and torch.equal(vc.transpose(0, 1), ref_v)
        tail = b - (b // flush) * flush  # the tokens of the unfinished chunk: exact
        if tail:
            assert torch.equal(kc.transpose(0, 1)[b - tail :], k[b - tail : b])
    for t in ("k", "v", "k_scale", "v_scale", "k_zero", "v_zero"):
        x, y = getattr(whole, t), getattr(pieces, t)
        assert (x is None) == (y is None) and (x is None or torch.equal(x[:, 3], y[:, 3])), t
    pieces.write_index(torch.tensor([0]), [SeqSpan([0], 0, 1)])  # the next step: the full block's tail is freed
    # block 0's, just taken (KIVI: block 3 keeps its tail, the V window of its last R tokens)
    assert pieces.num_tails == (0 if flush == 1 else 2 if fmt.value_window else 1)
    pieces.drop_tails([0, 3])  # their requests are gone
    assert pieces.num_tails == 0


def test_a_block_filled_last_step_and_taken_as_a_copy_target_reads_its_copied_tail() -> None:
    """Blocks 0 and 5 fill in step 2 (their tails are retired at the next step's start);
    block 0 is then freed and taken as the copy-on-write target of half-written block 2:
    it must read block 2's tokens, not another block's tail (a review found this)."""
    from kvpool.cache import BlockCopy

    st = QuantizedKVStorage(1, 8, 4, 1, 2, kv_schema("fp8_e4m3"))

    def step(slots: list[int], values: list[float]) -> None:
        index = st.write_index(torch.tensor(slots))
        k = torch.tensor(values).view(-1, 1, 1).repeat(1, 1, 2)
        st.write(0, index, k, k)

    step([0, 1, 20, 21, 8, 9], [1, 2, 50, 60, 7, 8])  # blocks 0, 5 and 2 half written
    step([2, 3, 22, 23], [3, 4, 70, 80])  # blocks 0 and 5 full
    st.apply_copies([BlockCopy(src=2, dst=0)])
    step([2], [9])  # the copy's next token
    k, _ = st.contiguous(0, [0], 3)
    assert k[0, :, 0].tolist() == [7.0, 8.0, 9.0]
    assert st.num_tails == 2  # blocks 2 and 0, each its own slot


def test_the_bytes_each_format_stores_by_hand() -> None:
    """One block of one KV head, one layer (K and V), at head dim 64."""
    expected = {
        "fp32": (16, 2 * 16 * 64 * 4, 0),
        "bf16": (16, 2 * 16 * 64 * 2, 0),
        "int8": (16, 2 * 16 * 64, 2 * 16 * 4),  # a fp32 scale per token, K and V
        "fp8_e4m3_token": (16, 2 * 16 * 64, 2 * 16 * 4),
        "fp8_e4m3": (16, 2 * 16 * 64, 2 * 4),  # a fp32 scale per block, K and V
        # 2 bits; K: scale + zero (fp16) per channel and 32 tokens; V: per token and 32 channels
        "kivi2": (128, 2 * 128 * 64 // 4, (64 * 4 + 128 * 2) * 2 * 2),
        "kivi4": (128, 2 * 128 * 64 // 2, (64 * 4 + 128 * 2) * 2 * 2),
    }
    for name, (bs, data, scales) in expected.items():
        fmt = kv_schema(name)
        storage = QuantizedKVStorage(3, 5, bs, 2, 64, fmt)
        assert storage.num_bytes == 3 * 5 * 2 * (data + scales), name
        assert storage.scale_bytes == 3 * 5 * 2 * scales, name
        assert fmt.bytes_per_token_head(bs, 64) == (data + scales) / bs
    assert kv_schema("kivi2").bytes_per_token_head(128, 64) == 48  # 10.7x fewer than fp32's 512


# ----- the engine over quantized blocks: paged attention against the contiguous reference ----


@pytest.fixture(scope="module")
def model():
    return random_llama("cpu", torch.float64)


def _reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int) -> torch.Tensor:
    """q [n, H, D] at positions start.., over k / v [KVH, ctx, D]: the plain offset-causal SDPA."""
    n, h, _ = q.shape
    ctx = k.shape[1]
    mask = torch.arange(ctx)[None, :] <= torch.arange(start, start + n)[:, None]
    group = h // k.shape[0]
    kk, vv = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
    return F.scaled_dot_product_attention(q.transpose(0, 1), kk, vv, attn_mask=mask).transpose(0, 1)


class AttentionAudit:
    """Wraps a runner so that every layer of every step compares the attention it computed
    with the contiguous reference over the same stored bytes (storage.contiguous): each
    sequence's K / V dequantized into one [KVH, ctx, D] tensor, then plain SDPA, in fp64
    (and in fp32, for the fp32 path's tolerance). KIVI (`attends_new_exactly`): a step reads
    the cache as it held the sequence before the step, then the step's own K / V exact."""

    def __init__(self, runner: ModelRunner, monkeypatch: pytest.MonkeyPatch):
        self.runner = runner
        self.worst = 0.0  # |paged - reference| / the reference's own fp32 error (fp32), or the error (fp64)
        self.checked = 0
        self.step = None
        real_plan = runner_module.plan_step

        def plan_step(q_lens, ctx_lens, slots, indptr, indices, *args, **kwargs):
            self.step = (list(q_lens), list(ctx_lens), list(indptr), list(indices))
            self.before = {}  # KIVI: (layer, sequence) -> its K / V as held before the step's writes
            storage = runner.executor.storage
            if isinstance(storage, QuantizedKVStorage) and storage.fmt.attends_new_exactly:
                for i, (n, ctx) in enumerate(zip(q_lens, ctx_lens, strict=True)):
                    for layer in range(storage.num_layers):
                        self.before[layer, i] = storage.contiguous(layer, indices[indptr[i] : indptr[i + 1]], ctx - n)
            return real_plan(q_lens, ctx_lens, slots, indptr, indices, *args, **kwargs)

        monkeypatch.setattr(runner_module, "plan_step", plan_step)
        model = runner.model
        real_forward = model.forward

        def forward(ids, pos, metadata, *args, **kwargs):
            attend = metadata.attention.attend

            def audited(layer, q, k, v):
                out = attend(layer, q, k, v)
                self._check(layer, q, k, v, out)
                return out

            step = function_step(audited, metadata.attention.num_tokens, metadata.logit_rows)
            return real_forward(ids, pos, step, *args, **kwargs)

        monkeypatch.setattr(model, "forward", forward)

    def _check(self, layer: int, q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, out: torch.Tensor):
        q_lens, ctx_lens, indptr, indices = self.step
        storage = self.runner.executor.storage
        row = 0
        for i, (n, ctx) in enumerate(zip(q_lens, ctx_lens, strict=True)):
            rows = slice(row, row + n)
            if (layer, i) in self.before:
                held_k, held_v = self.before[layer, i]
                k = torch.cat([held_k, k_new[rows].transpose(0, 1).to(held_k.dtype)], 1)
                v = torch.cat([held_v, v_new[rows].transpose(0, 1).to(held_v.dtype)], 1)
            else:
                k, v = storage.contiguous(layer, indices[indptr[i] : indptr[i + 1]], ctx)
            ref64 = _reference_attention(q[rows].double(), k.double(), v.double(), ctx - n)
            got = out[rows].double()
            if q.dtype == torch.float64:
                self.worst = max(self.worst, (got - ref64).abs().max().item())
            else:
                ref32 = _reference_attention(q[rows], k, v, ctx - n).double()
                own = max((ref32 - ref64).abs().max().item(), 2.0**-24 * ref64.abs().max().item())
                self.worst = max(self.worst, (got - ref64).abs().max().item() / own)
            self.checked += 1
            row += n


def _shared_prefix_and_fork(runner: ModelRunner) -> Engine:
    """a, then b sharing a's first 48 tokens (a prefix hit) with two samples (a fork: the
    shared partial tail block copied on write); 40-token steps chunk a's prefill."""
    engine = Engine(runner, max_num_batched_tokens=40, max_num_seqs=4, record_logits=True)
    shared = random_ids(48, 1)
    prompts = {"a": shared + random_ids(9, 2), "b": shared + random_ids(5, 3)}
    params = {
        "a": SamplingParams(max_tokens=6, ignore_eos=True),
        "b": SamplingParams(max_tokens=6, n=2, temperature=2.0, seed=1),
    }
    for rid in ("a", "b"):
        engine.add_request(prompts[rid], params[rid], rid)
        while engine.has_unfinished():
            engine.step()
            runner.check_integrity()
    assert engine.output("b").num_cached_tokens == 48
    return engine


@pytest.mark.parametrize("name", ENGINE_FORMATS)
def test_paged_attention_over_quantized_blocks_equals_the_reference_over_the_same_bytes(
    model, name, monkeypatch
) -> None:
    runner = llama_runner(model, 24, 16, DESCRIPTOR, kv_format=name)
    copies: list[int] = []
    apply_copies = runner.executor.storage.apply_copies
    monkeypatch.setattr(runner.executor.storage, "apply_copies", lambda c: (copies.append(len(c)), apply_copies(c)))
    audit = AttentionAudit(runner, monkeypatch)
    engine = _shared_prefix_and_fork(runner)
    assert sum(copies) == 1  # b's second sample wrote into a copy of the shared tail block
    # a: 2 prefill chunks + 5 decodes; b: 1 prefill chunk + 5 decodes of each of 2 samples
    assert audit.checked == 18 * CONFIG.num_layers and audit.worst <= 1e-12  # fp64: the same bytes
    # the format really stored fewer bits: the logits differ from the exact model's
    seq = engine.requests["a"].seqs[0]
    history = seq.token_ids[:-1]
    exact = model.forward(
        torch.tensor(history),
        torch.arange(len(history)),
        function_step(lambda layer, q, k, v: _causal(q, k, v), len(history)),
    )[-len(seq.logits) :]
    assert (torch.stack(seq.logits) - exact).abs().max().item() > 1e-6
    runner.release("a", "finish") if "a" in runner.cache else None
    assert runner.executor.storage.num_tails <= len(runner.cache.request_ids) + 1


def _causal(q, k, v):
    from kvpool.attention.reference import causal_attention

    return causal_attention(q, k, v)


@pytest.mark.parametrize("name", ["int8", "fp8_e4m3", "fp8_e5m2_token"])
def test_the_c_kernel_decodes_from_the_codes_as_the_contiguous_reference_does(kernels, name, monkeypatch) -> None:
    """fp32 with the C kernels: decode attention by kv_decode_attention_q8 from the codes and
    scales (and the fp32 tail of a block-scaled block not yet full), against the reference
    over the same bytes, within a few times the reference's own fp32 error."""
    from kvpool.models.llama import LlamaModel

    base = random_llama("cpu", torch.float32)
    model = LlamaModel(CONFIG, base.embed, base.norm, base.layers, None, "cpu", kernels)
    runner = llama_runner(model, 24, 16, DESCRIPTOR, kv_format=name)
    assert runner.executor.storage.reads_natively and runner.executor.decode_path == "native"
    calls = []
    real = kernels.decode_attention_q8
    monkeypatch.setattr(kernels, "decode_attention_q8", lambda *a: (calls.append(a[9].tolist()), real(*a))[1])
    audit = AttentionAudit(runner, monkeypatch)
    _shared_prefix_and_fork(runner)
    assert calls and audit.worst <= 8, audit.worst
    if name == "fp8_e4m3":  # block scales: some decodes read a partly written block from its tail
        assert any(t >= 0 for tails in calls for t in tails)


def test_the_c_kernel_reads_the_tail_it_is_given(kernels) -> None:
    """The tail is what the kernel reads for a partly written block-scaled block: pointing it
    elsewhere changes the output (the test can fail)."""
    from kvpool.attention.paged import paged_attention, plan_step

    storage = QuantizedKVStorage(1, 8, 16, 2, 32, kv_schema("fp8_e4m3"))
    g = torch.Generator().manual_seed(0)
    slots = torch.tensor([2 * 16 + t for t in range(16)] + [5 * 16 + t for t in range(7)])
    index = storage.write_index(slots)
    storage.write(0, index, torch.randn(23, 2, 32, generator=g), torch.randn(23, 2, 32, generator=g))
    plan = plan_step([1], [23], [5 * 16 + 6], [0, 2], [2, 5], 16, 4, 2, 32, torch.device("cpu"))
    q = torch.randn(1, 4, 32, generator=g)
    k, v = storage.dequantized(0, torch.tensor([2, 5]))
    want = paged_attention(q, k, v, plan, 0.2)
    args = (q, torch.arange(1), torch.tensor([0, 2]), torch.tensor([2, 5]), torch.tensor([23]))
    pools = (storage.k[0], storage.v[0], storage.k_scale[0], storage.v_scale[0])
    tails = storage.tail_slots([5])
    assert tails.tolist() == [storage._tail_of[5]]
    got = kernels.decode_attention_q8(
        *args, *pools, tails, storage.tail_k[0], storage.tail_v[0], 0.2, torch.empty_like(q)
    )
    assert (got - want).abs().max().item() <= 1e-5
    wrong = kernels.decode_attention_q8(
        *args, *pools, torch.tensor([-1]), storage.tail_k[0], storage.tail_v[0], 0.2, torch.empty_like(q)
    )
    assert (wrong - want).abs().max().item() > 1e-3  # block 5's codes were never written: zeros
    with pytest.raises(ValueError, match="a tail slot lies outside"):
        kernels.decode_attention_q8(
            *args, *pools, torch.tensor([99]), storage.tail_k[0], storage.tail_v[0], 0.2, torch.empty_like(q)
        )


@pytest.mark.parametrize("dtype", [torch.int8, torch.float8_e4m3fn, torch.float8_e5m2])
def test_the_c_kernels_decode_every_8_bit_code_as_torch_does(kernels, dtype) -> None:
    """Every code but FP8's NaN / inf ones (the quantizer saturates before them), times one
    scale and times a scale per code: the same fp32 values as torch's conversion, bit for bit
    (the vector path through fp16 and the scalar rest of a row alike: 256 is 32 vectors, 13 is
    one and 5 codes)."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype)
    finite = torch.isfinite(codes.float())
    for scales in (torch.tensor([0.37]), torch.rand(256, generator=torch.Generator().manual_seed(1)) + 0.1):
        got = kernels.decode_codes(codes, scales)
        assert torch.equal(got[finite], (codes.float() * scales)[finite])
    assert torch.equal(kernels.decode_codes(codes[:13], torch.tensor([2.0])), codes[:13].float() * 2.0)


def test_kvpool_bench_kv_quant_prints_what_it_measured() -> None:
    import json

    argv = [sys.executable, "-m", "kvpool", "bench", "kv-quant", "--batch", "2", "--context", "256", "--repeats", "2"]
    proc = subprocess.run([*argv, "--formats", "fp32,int8,kivi4-g8-r16", "--json"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    by = {r["format"]: r for r in report["formats"]}
    assert by["fp32"]["bytes_per_layer_step"] == 2 * 256 * 3 * 64 * 2 * 4
    assert by["int8"]["bytes_per_layer_step"] == 2 * 256 * 3 * (64 + 4) * 2
    assert by["int8"]["native_ms"] > 0 and by["int8"]["torch_ms"] > 0 and "native_ms" not in by["kivi4-g8-r16"]
    proc = subprocess.run([*argv, "--paths", "gpu"], capture_output=True, text=True)
    assert proc.returncode == 2 and "--paths: unknown path 'gpu'" in proc.stderr.strip().splitlines()[-1]


def test_bench_kv_quant_refuses_a_pool_past_the_machine_before_building_it(capsys) -> None:
    """pool_bytes_needed is what measure's storages hold (codes, scales, scratch; fp32 pools),
    plus the fp32 K / V it writes and the slot ids; a pool past the machine's memory is one
    line (it was minutes listing slot ids, then the allocator's traceback)."""
    from kvpool.bench.kv_quant import pool_bytes_needed
    from kvpool.cli.main import main
    from kvpool.storage.kv import QuantizedKVStorage

    layers, blocks, bs, kvh, d = 3, 10, 16, 3, 64
    written = blocks * (2 * bs * kvh * d * 4 + bs * 8)  # one layer's fp32 K and V, and the int64 slot ids
    for name in ("int8", "fp8_e4m3", "kivi4-g8-r16", "bf16"):
        s = QuantizedKVStorage(layers, blocks, bs, kvh, d, kv_schema(name))
        held = s.num_bytes + s.scratch_k.nbytes + s.scratch_v.nbytes
        assert pool_bytes_needed([name], layers, blocks, bs, kvh, d) == held + written
    fp32 = layers * blocks * 2 * bs * kvh * d * 4
    assert pool_bytes_needed(["int8", "fp32"], layers, blocks, bs, kvh, d) == fp32 + written
    assert main(["bench", "kv-quant", "--batch", "100", "--context", "100000000", "--json"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvpool bench kv-quant: error: --batch 100 x --context 100000000 over --layers 3 needs ")
    assert err.endswith("lower --batch, --context or --layers\n") and err.count("\n") == 1, err


def test_quantized_blocks_never_meet_the_tiers_or_another_format(model, fp64_model) -> None:
    from kvpool.engine.build import descriptor_for
    from kvpool.tiers import HostTier

    with pytest.raises(ValueError, match="tiers keep unquantized blocks only"):
        llama_runner(model, 10, 16, DESCRIPTOR, kv_format="int8", host_tier=HostTier(1 << 20))
    names = [*KV_SCHEMAS, "kivi2-g16-r32", "kivi2-g32-r64"]
    layouts = {name: descriptor_for(fp64_model, 128, name).layout_id for name in names}
    assert len(set(layouts.values())) == len(names) and ":int8/" in layouts["int8"]
    keys = {descriptor_for(fp64_model, 128, name).key() for name in names}
    assert len(keys) == len(names)  # the chain's root differs: no hash of one format finds another's


def test_a_prefix_computed_under_one_format_never_serves_another(fp64_model) -> None:
    """One pool, two descriptors: the blocks a request published under int8 are not found by
    a request under fp8_e4m3_token (the same tokens), and are under int8."""
    from kvpool.cache import FullAttentionManager
    from kvpool.engine.build import descriptor_for

    int8, fp8 = descriptor_for(fp64_model, 16, "int8"), descriptor_for(fp64_model, 16, "fp8_e4m3_token")
    manager = FullAttentionManager(16, 16, int8)
    tokens = list(range(40))
    manager.admit("a", tokens)
    manager.commit("a", 40)
    manager.check_integrity()
    assert manager.lookup_prefix(tokens) == 32
    assert manager.lookup_prefix(tokens, descriptor=fp8) == 0


def test_the_cli_takes_kv_dtype_and_refuses_what_cannot_work() -> None:
    import json

    from kvpool.cli.args import KV_DTYPES

    assert KV_DTYPES == tuple(KV_SCHEMAS)
    generate = [sys.executable, "-m", "kvpool", "generate", "What is the capital of France?", "--max-tokens", "8"]
    proc = subprocess.run([*generate, "--kv-dtype", "fp8_e4m3", "--json"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["kv_format"] == "fp8_e4m3" and report["memory"]["details"]["kv_pool"]["quant_scales"] > 0
    for flags, needle in [
        (["--kv-dtype", "int8", "--host-cache-gib", "1"], "--kv-cache-dtype int8 with --host-cache-gib: the tiers"),
        (["--model", "tiny-dsv4", "--no-chat", "--kv-dtype", "fp8_e4m3"], "tiny-dsv4 takes fp32 (exact) or fp8"),
        (["--kv-dtype", "fp4"], "unknown KV format 'fp4'"),
        (["--kv-dtype", "kivi2"], "the residual R=128 (tokens quantized together) does not divide the block size 16"),
        (["--kv-dtype", "kivi2-g48-r96", "--block-size", "96"], "the group size 48 does not divide the head dim 64"),
    ]:
        argv = [sys.executable, "-m", "kvpool", "generate", "1,2,3", "--max-tokens", "2", *flags]
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=120)
        lines = proc.stderr.strip().splitlines()
        # one error line (argparse's own, for a name it rejects, after its usage lines)
        assert proc.returncode == 2 and needle in lines[-1] and "Traceback" not in proc.stderr, proc.stderr
        assert len(lines) == 1 or lines[0].startswith("usage:")


# ----- kvpool eval kv-quant -----------------------------------------------------------------


def test_the_evaluation_measures_what_it_says(model) -> None:
    import math

    import torch.nn.functional as F

    from kvpool.attention.reference import contiguous_step
    from kvpool.verify.kv_quant import evaluate, greedy_agreement

    ids = random_ids(96, 7)
    formats = ["fp16", "bf16", "int8", "fp8_e4m3", "kivi2-g16-r16"]
    ev = evaluate(model, ids, formats, block_size=16, prefill=32)
    # the fp32 perplexity of the scored positions (the prefill's last, then each decode), computed here on its own
    logits = model.forward(torch.tensor(ids), torch.arange(96), contiguous_step(96), fused=False)
    nll = F.cross_entropy(logits[31:-1], torch.tensor(ids[32:]), reduction="mean").item()
    assert ev.fp32_perplexity == pytest.approx(math.exp(nll), rel=1e-9)
    by = {r.name: r for r in ev.formats}
    for r in ev.formats:
        assert len(r.layers) == CONFIG.num_layers and r.kl_mean >= 0 and 0 <= r.top1_agreement <= 1
    # per layer, the round trip's own theory, norm-wise
    assert max(layer.k_rel for layer in by["fp16"].layers) <= 2.0**-11
    assert max(layer.k_rel for layer in by["bf16"].layers) <= 2.0**-8
    assert max(layer.v_rel for layer in by["fp8_e4m3"].layers) <= 2.0**-4
    assert by["fp16"].kl_mean < by["bf16"].kl_mean < by["int8"].kl_mean < by["fp8_e4m3"].kl_mean
    assert by["fp8_e4m3"].kl_mean < by["kivi2-g16-r16"].kl_mean  # 2 bits: clearly worse
    per_head = CONFIG.head_dim + 4  # int8: one byte an element, one fp32 scale
    assert by["int8"].bytes_per_token == 2 * CONFIG.num_layers * CONFIG.num_kv_heads * per_head
    # the ratio itself: it was rounded to 3 places, then printed to 2 (SmolLM2's int8 3.7647 read 3.77x)
    assert by["int8"].capacity_gain == CONFIG.head_dim * 4 / per_head
    # the largest |K| or |V| of the text (what fp16 saturates past 65,504), from a forward of its own
    from kvpool.attention.backends.step import function_step
    from kvpool.attention.reference import causal_attention

    largest = []

    def seen(layer, q, k, v):
        largest.append(max(float(k.abs().max()), float(v.abs().max())))
        return causal_attention(q, k, v)

    model.forward(torch.tensor(ids), torch.arange(96), function_step(seen, 96, []), fused=False)
    assert len(largest) == CONFIG.num_layers and ev.kv_max_abs == max(largest)
    with pytest.raises(ValueError, match="must leave a token of the text to decode"):
        evaluate(model, ids[:32], ["int8"], block_size=16, prefill=32)
    with pytest.raises(ValueError, match="does not divide the block size 16"):
        evaluate(model, ids, ["kivi2"], block_size=16)
    # greedy decoding through the engine: fp32 storage of this fp64 model decodes fp64's tokens
    greedy = greedy_agreement(model, ids[:20], ["fp32", "kivi2-g16-r16"], 12, 16)
    assert greedy["fp32"] == (1.0, None)
    share, first = greedy["kivi2-g16-r16"]
    assert (share * 12).is_integer() and (first is None) == (share == 1.0) and (first is None or first < 12)


def test_kvpool_eval_kv_quant_on_smollm2(tmp_path) -> None:
    import json

    argv = [sys.executable, "-m", "kvpool", "eval", "kv-quant", "--tokens", "64", "--prefill", "32"]
    argv += ["--formats", "int8,fp16"]
    argv += ["--block-size", "16", "--greedy-steps", "4", "--greedy-prompt", "8"]
    proc = subprocess.run(
        [*argv, "--json", "--plot", str(tmp_path / "q.png")], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["tokens"] == 64 and report["text"].startswith("pydoc_data.topics")
    assert [f["name"] for f in report["formats"]] == ["int8", "fp16"] and len(report["formats"][0]["layers"]) == 30
    assert report["block_size"] == 16 and report["greedy_steps"] == 4
    assert report["regime"]["name"] == "serving" and report["regime"]["prefill_tokens"] == 32
    assert report["regime"]["decode_steps"] == 31 and "teacher-forced" in report["regime"]["description"]
    for f in report["formats"]:
        lo, hi = f["perplexity_change_ci95"]
        assert lo <= f["perplexity_change_pct"] <= hi
    assert all(0 <= f["greedy_agreement"] <= 1 for f in report["formats"])
    assert (tmp_path / "q.png").stat().st_size > 10_000
    for flags, needle in [
        (["--text", str(tmp_path)], "is a directory, not a file"),
        (["--plot", str(tmp_path / "q.png" / "x.png")], "q.png is not a directory"),
        (["--plot", str(tmp_path / "missing" / "q.png")], "missing does not exist"),  # savefig makes no directory
        (["--plot", str(tmp_path / "q.txt")], "matplotlib cannot write .txt files"),
        (["--formats", "int8,kivi2"], "kivi2: the residual R=128 (tokens quantized together) does not divide the"),
        (["--greedy-steps", "-1"], "--greedy-steps must be >= 0, got -1"),
        (["--prefill", "64"], "--prefill 64 leaves none of the text's 64 tokens to decode"),
    ]:
        proc = subprocess.run([*argv, *flags], capture_output=True, text=True, timeout=120)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1 and needle in lines[0], proc.stderr


@pytest.mark.parametrize("name", [n for n in QUANTIZED if KV_SCHEMAS[n].scaled])
def test_the_planner_counts_what_the_quantized_storage_allocates_byte_for_byte(name) -> None:
    from kvpool.capacity.kv import kv_layout
    from kvpool.capacity.planner import occupancy
    from kvpool.spec.models import load_preset

    spec = load_preset("smollm2-135m")
    bs = 128 if name.startswith("kivi") else 16
    storage = QuantizedKVStorage(spec.num_layers, 40, bs, spec.num_kv_heads, spec.head_dim, kv_schema(name))
    layout = kv_layout(spec, name, block_size=bs, alignment=1)
    # one request filling the 40 blocks, and the full-precision tails of a chunked format
    lines = occupancy(layout, storage.num_bytes + layout.state_block_bytes, 40 * bs, 1)
    assert lines.get("kv_tails", 0.0) == layout.state_block_bytes == layout.tail_bytes_per_request
    assert (layout.tail_bytes_per_request > 0) == (storage.flush > 1)
    assert lines["quant_scales"] == storage.scale_bytes > 0
    assert lines["data"] == storage.k.nbytes + storage.v.nbytes
    assert lines["unused"] == lines["tail_waste"] == lines["alignment_padding"] == 0
    assert layout.bytes_per_token == storage.bytes_per_block / bs


def test_kvpool_plan_takes_every_format_and_kivi_picks_a_block_that_holds_its_residual() -> None:
    import json

    from kvpool.capacity.kv import kv_layout
    from kvpool.spec.models import load_preset

    spec = load_preset("llama-3.1-8b")  # 32 layers, 8 KV heads of 128
    assert kv_layout(spec, "kivi2").block_size == 128  # lcm(16, R = 128)
    # K: 2-bit codes + fp16 scale and zero per channel and 32 tokens; V: per token and 32 channels
    per_head = (2 * 128 * 128 * 2 / 8 + (128 * 4 + 128 * 4) * 2 * 2) / 128
    assert kv_layout(spec, "kivi2").bytes_per_token == 32 * 8 * per_head == 24_576
    assert kv_layout(spec, "kivi2-g64-r64", block_size=64).block_size == 64
    argv = [sys.executable, "-m", "kvpool", "plan", "--model", "llama-3.1-8b", "--gpu", "h200", "--json"]
    got = {}
    for name in ("bf16", "int8", "fp8_e4m3", "kivi4"):
        proc = subprocess.run([*argv, "--kv-dtype", name], capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stderr
        got[name] = json.loads(proc.stdout)["max_concurrent_requests"]
    assert got["bf16"] < got["int8"] < got["fp8_e4m3"] < got["kivi4"]
    for flags, needle in [
        (["--kv-dtype", "kivi2", "--block-size", "16"], "the residual R=128 (tokens quantized together) does not"),
        (["--kv-dtype", "int3"], "unknown KV format 'int3'"),
    ]:
        proc = subprocess.run([*argv, *flags], capture_output=True, text=True, timeout=60)
        assert proc.returncode == 2 and needle in proc.stderr.strip().splitlines()[-1], proc.stderr


@pytest.mark.parametrize("tp", [1, 2])
def test_the_planner_prices_the_chunked_formats_full_precision_tails_per_request(tp) -> None:
    """llama-3.1-8b (32 layers, 8 KV heads of 128), BF16 tails. A tail slot of
    storage/kv.py is one block of K and one of V, every layer, the rank's heads: kivi2's
    block is 128 tokens and a request holds at most 4 slots (V's window of R = 128 spans two
    blocks; a prefill chunk holds the window it began with and the one it ends with);
    fp8_e4m3's block is 16 tokens, 2 slots (the block a step completes and the one it opens)."""
    from kvpool.capacity.planner import plan
    from kvpool.spec.gpus import get_gpu
    from kvpool.spec.models import load_preset

    spec, heads = load_preset("llama-3.1-8b"), 8 // tp
    kivi = 4 * 2 * 32 * heads * 128 * 128 * 2  # slots x (K, V) x layers x heads x dims x tokens x B
    fp8 = 2 * 2 * 32 * heads * 128 * 16 * 2
    assert kivi == {1: 67_108_864, 2: 33_554_432}[tp] and fp8 == {1: 4_194_304, 2: 2_097_152}[tp]
    # a layer's block, padded to 256 B: kivi2 128 tokens x 768 B / 8 heads (no padding); fp8_e4m3
    # 16 tokens x 256 B codes + 2 fp32 scales a head: 8 heads 32,832 -> 33,024 B, 4 heads 16,640 B
    layer_block = {"kivi2": 128 * 96 * heads, "fp8_e4m3": {1: 33_024, 2: 16_640}[tp]}
    for name, tails, bs in (("kivi2", kivi, 128), ("fp8_e4m3", fp8, 16)):
        p = plan(spec, get_gpu("h100"), num_gpus=tp, tp=tp, context_len=1024, kv_dtype=name)
        assert p.layout.tail_bytes_per_request == p.layout.state_bytes_per_request == tails
        request = 1024 // bs * 32 * layer_block[name] + tails  # 1,024 tokens fill whole blocks
        assert p.layout.request_bytes(1024) == request
        assert p.max_concurrent_per_replica == p.ledger.pool_bytes // request
        d = p.as_dict()
        assert d["kv_tail_bytes_per_request"] == d["state_bytes_per_request"] == tails
        assert p.occupancy["kv_tails"] == tails * p.max_concurrent_per_replica
        assert "state" not in p.occupancy
    # per-token formats keep no tail
    assert plan(spec, get_gpu("h100"), context_len=1024, kv_dtype="int8").layout.tail_bytes_per_request == 0


@settings(max_examples=8, deadline=None)
@given(
    name=st.sampled_from(["fp8_e4m3", "kivi2-g8-r8", "kivi4-g8-r16"]),
    lens=st.lists(st.integers(1, 70), min_size=1, max_size=5),
    budget=st.integers(8, 64),
    seed=st.integers(0, 100),
)
def test_the_planners_tail_bound_holds_what_an_engine_run_allocates(model, name, lens, budget, seed) -> None:
    """The tail slots in use never pass the planner's per-request count (the schema's
    tail_slots) times the requests holding blocks, and the engine's measured ledger line
    kv_tails (storage.tail_bytes, tensors that only grow, by doubling) never passes the
    planner's bound per request times max_num_seqs: what `kvpool plan` prices."""
    from kvpool.capacity.kv import kv_layout
    from kvpool.engine.memory import measure
    from kvpool.spec.models import from_hf_config

    c = CONFIG
    spec = from_hf_config(
        {
            "model_type": "llama",
            "num_hidden_layers": c.num_layers,
            "hidden_size": c.hidden_size,
            "num_attention_heads": c.num_heads,
            "num_key_value_heads": c.num_kv_heads,
            "head_dim": c.head_dim,
            "intermediate_size": c.intermediate_size,
            "vocab_size": c.vocab_size,
            "max_position_embeddings": c.max_position,
        }
    )
    bound = kv_layout(spec, name, block_size=16, compute_bytes=8).tail_bytes_per_request  # fp64 model
    runner = llama_runner(model, 48, 16, DESCRIPTOR, kv_format=name, max_num_seqs=4, max_num_batched_tokens=budget)
    engine = Engine(runner, max_num_batched_tokens=budget, max_num_seqs=4)
    slots = kv_schema(name).tail_slots
    for i, n in enumerate(lens):
        engine.add_request(random_ids(n, seed + i), SamplingParams(max_tokens=1 + (seed + i) % 9, ignore_eos=True))
    most, steps = 0, 0
    storage = runner.executor.storage
    write_index = storage.write_index

    def counted(*args, **kwargs):  # the requests holding blocks while a step writes
        nonlocal most
        most = max(most, len(runner.cache.request_ids))
        return write_index(*args, **kwargs)

    storage.write_index = counted
    while engine.has_unfinished():
        engine.step()
        steps += 1
        assert storage.num_tails <= most * slots, (steps, storage.num_tails, most)
        assert storage.tail_bytes <= 4 * bound, (steps, storage.tail_bytes, bound)
    measured = measure(runner, 0, 0).details["workspace"].get("kv_tails", 0)
    assert measured == storage.tail_bytes <= 4 * bound and measured > 0


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


def test_the_simulator_keeps_the_chunked_formats_tails_out_of_its_blocks() -> None:
    """kivi2 on llama-3.1-8b: 64 MiB of BF16 tails for each of --max-num-seqs 100 requests
    (4 blocks of 128 tokens, K and V, 32 layers, 8 heads of 128), taken from the pool before
    it is cut into 3 MiB blocks (128 tokens x 24,576 B)."""
    import json

    argv = [sys.executable, "-m", "kvpool", "simulate", "--model", "llama-3.1-8b", "--gpu", "h200", "--json"]
    proc = subprocess.run(
        [*argv, "--kv-dtype", "kivi2", "--requests", "5", "--max-num-seqs", "100"], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
    d = json.loads(proc.stdout)
    assert d["kv_tail_bytes"] == 100 * 4 * 2 * 32 * 8 * 128 * 128 * 2 == 100 * 2**26
    assert d["block_bytes"] == 128 * 24_576
    assert d["num_blocks"] == (d["kv_pool_bytes"] - d["kv_tail_bytes"]) // d["block_bytes"]
    proc = subprocess.run([*argv, "--kv-dtype", "int8", "--requests", "5"], capture_output=True, text=True)
    assert "kv_tail_bytes" not in json.loads(proc.stdout)  # a per-token format keeps no tail
    # llama-3.1-70b on H100s: at TP 2 the pool's 10.05 GiB a GPU cannot hold 256 requests'
    # tails of 80 MiB (80 layers, 4 heads of 128, 4 blocks of 128, K and V, BF16): TP 4 is
    # the fewest GPUs that simulate (which took TP 2, then found no pool)
    argv = [sys.executable, "-m", "kvpool", "simulate", "--model", "llama-3.1-70b", "--gpu", "h100", "--json"]
    proc = subprocess.run([*argv, "--kv-dtype", "kivi2", "--requests", "5"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    d = json.loads(proc.stdout)
    assert d["tp"] == 4 and d["kv_tail_bytes"] == 256 * 80 * 2 * 128 * 128 * 2 * 2 * 4 == 10 * 2**30


def test_the_tails_double_up_to_the_sequences_bound_and_past_it_only_by_what_a_step_needs() -> None:
    """Tail slots are allocated as a list grows (1, 2, 4, ...), capped at max_seqs x the
    schema's tail_slots (fp8_e4m3: 2 a sequence), past which a step that needs more gets
    exactly what is missing; without max_seqs they double with no cap."""
    from kvpool.storage.kv import QuantizedKVStorage

    def sizes(max_seqs: int | None, wants: list[int]) -> list[int]:
        storage = QuantizedKVStorage(2, 8, 16, 1, 16, kv_schema("fp8_e4m3"), max_seqs=max_seqs)
        out = []
        for n in wants:  # take n slots more, one reservation each
            storage._reserve_tails(n)
            del storage._free_tails[len(storage._free_tails) - n :]
            out.append(storage.tail_k.shape[1])
        assert storage.tail_k.shape == storage.tail_v.shape[:2] + storage.tail_k.shape[2:]
        return out

    assert sizes(3, [1, 1, 1, 1, 1, 1, 2]) == [1, 2, 4, 4, 6, 6, 8]
    assert sizes(None, [1, 1, 1, 1, 1, 1, 2]) == [1, 2, 4, 4, 8, 8, 8]
    assert sizes(3, [5, 1, 3]) == [5, 6, 9]
