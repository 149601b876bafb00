"""Issue 28, section 3: the quantized KV formats in serving. KIVI as the paper runs it in the
engine (a step attends to the K/V it computes in full precision, then stores the quantized
copy; V's residual is the last R tokens, a sliding window), and `kvpool eval kv-quant`
measuring the engine's own prefill-then-decode steps, with KL first and the perplexity
change with its bootstrap spread."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvpool.attention.backends.step import function_step
from kvpool.engine.engine import Engine
from kvpool.engine.llama_runner import llama_runner
from kvpool.engine.runner import ModelRunner
from kvpool.engine.sampling import SamplingParams
from kvpool.spec.kv_formats import kv_schema
from kvpool.storage.dsv4 import V4EntryPool
from kvpool.storage.quant import dequantize_k, dequantize_v, quantize, quantize_k, quantize_v, round_trip, round_trip_kv
from random_llama import CONFIG, DESCRIPTOR, random_ids, random_llama
from test_kv_quant import _reference_attention


@pytest.fixture(scope="module")
def model():
    return random_llama("cpu", torch.float64)


def _stored(fmt, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """k, v [n, KVH, D] exact -> what KIVI's codes hold for them: K per channel over each
    R-chunk (n a multiple of R), V per token; computed here from the round trip alone."""
    n, kvh, d = k.shape
    r = fmt.residual
    kt = k.reshape(n // r, r, kvh, d).permute(0, 2, 3, 1)  # [chunks, KVH, D, R]
    kq = dequantize_k(fmt, quantize_k(fmt, kt), k.dtype).permute(0, 3, 1, 2).reshape(n, kvh, d)
    vq = dequantize_v(fmt, quantize_v(fmt, v.transpose(0, 1)), v.dtype).transpose(0, 1)
    return kq, vq


class Steps:
    """Records, per engine step and layer, the step's q / k / v (exact: the model computed
    them) and the attention output the runner returned."""

    def __init__(self, runner: ModelRunner, monkeypatch: pytest.MonkeyPatch):
        self.calls: list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]] = []
        real = runner.model.forward

        def forward(ids, pos, metadata, *args, **kwargs):
            attend = metadata.attention.attend

            def audited(layer, q, k, v):
                out = attend(layer, q, k, v)
                self.calls.append((layer, q.clone(), k.clone(), v.clone(), out.clone()))
                return out

            step = function_step(audited, metadata.attention.num_tokens, metadata.logit_rows)
            return real(ids, pos, step, *args, **kwargs)

        monkeypatch.setattr(runner.model, "forward", forward)

    def take(self) -> list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]:
        out, self.calls = self.calls, []
        return out


def _state(runner: ModelRunner, rid: str, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """What the storage holds for the request's computed tokens: K, V [n, KVH, D]."""
    seq = f"{rid}/0"
    n = runner.num_computed_tokens(seq)
    k, v = runner.executor.storage.contiguous(layer, runner.cache.block_ids(seq), n)
    return k.transpose(0, 1), v.transpose(0, 1)


@pytest.mark.parametrize("name", ["kivi2-g8-r16", "kivi4-g8-r8"])
def test_a_step_attends_to_its_own_kv_in_full_precision_and_stores_the_codes(model, name, monkeypatch) -> None:
    """A 40-token prompt in two prefill chunks (24 and 16 tokens), then decodes. Each step's
    attention output equals plain attention over the K/V the storage held before the step
    followed by the step's own K/V in full precision (KIVI: prefill attends in full
    precision; a decode step reads its token before it is quantized), in fp64 to 1e-12;
    the stored blocks then hold the quantized codes of those K/V."""
    fmt = kv_schema(name)
    runner = llama_runner(model, 16, 16, DESCRIPTOR, kv_format=name, enable_prefix_caching=False)
    steps = Steps(runner, monkeypatch)
    engine = Engine(runner, max_num_batched_tokens=24, max_num_seqs=1)
    engine.add_request(random_ids(40, 1), SamplingParams(max_tokens=4, ignore_eos=True), "a")
    exact_k: list[list[torch.Tensor]] = [[] for _ in range(CONFIG.num_layers)]
    exact_v: list[list[torch.Tensor]] = [[] for _ in range(CONFIG.num_layers)]
    checked = 0
    stored = False
    while engine.has_unfinished():
        before = [_state(runner, "a", layer) for layer in range(CONFIG.num_layers)] if "a/0" in runner.cache else []
        engine.step()
        for layer, q, k, v, out in steps.take():
            start = sum(t.shape[0] for t in exact_k[layer])
            held_k, held_v = before[layer] if before else (k[:0], v[:0])
            assert held_k.shape[0] == start
            kk, vv = torch.cat([held_k, k]).transpose(0, 1), torch.cat([held_v, v]).transpose(0, 1)
            ref = _reference_attention(q, kk, vv, start)  # k / v [KVH, ctx, D]
            assert (out - ref).abs().max().item() <= 1e-12, (layer, start)
            exact_k[layer].append(k)
            exact_v[layer].append(v)
            checked += 1
        if "a/0" in runner.cache and runner.num_computed_tokens("a/0") == 40:  # the prompt is in
            # the whole chunks of K and the V before the window are stored as codes, not exact
            k, v = torch.cat(exact_k[0]), torch.cat(exact_v[0])
            held_k, held_v = _state(runner, "a", 0)
            kq, vq = _stored(fmt, k[:32], v[: 40 - fmt.residual])
            assert torch.equal(held_k[:32], kq) and not torch.equal(kq, k[:32])
            assert torch.equal(held_v[: 40 - fmt.residual], vq) and not torch.equal(vq, v[: 40 - fmt.residual])
            stored = True
    assert stored and checked == 5 * CONFIG.num_layers  # 2 prefill chunks, 3 decodes (the 4th token: sampled only)


@pytest.mark.parametrize(("name", "chunk"), [("kivi4-g8-r16", 5), ("kivi2-g8-r8", 3), ("kivi2-g8-r16", 16)])
def test_the_value_residual_is_the_last_r_tokens_whatever_n_mod_r(model, name, chunk, monkeypatch) -> None:
    """After every step (prefill chunks of `chunk` tokens, then decodes), the request's N
    computed tokens are held as: V of the last R tokens exactly, V before them as the
    codes' values; K exact in the unfinished R-chunk, codes before it. N runs through
    every residue mod R and across blocks; the full-precision tails stay at most two a
    request (the window spans at most two blocks) plus one retired at the next step."""
    fmt = kv_schema(name)
    r = fmt.residual
    runner = llama_runner(model, 16, 16, DESCRIPTOR, kv_format=name, enable_prefix_caching=False)
    steps = Steps(runner, monkeypatch)
    engine = Engine(runner, max_num_batched_tokens=chunk, max_num_seqs=1)
    engine.add_request(random_ids(2 * chunk + 1, 2), SamplingParams(max_tokens=48, ignore_eos=True), "a")
    exact_k: list[torch.Tensor] = []
    exact_v: list[torch.Tensor] = []
    residues = set()
    while engine.has_unfinished():
        engine.step()
        for layer, _q, k, v, _out in steps.take():
            if layer == 0:
                exact_k.append(k)
                exact_v.append(v)
        if "a/0" not in runner.cache:
            break
        k, v = torch.cat(exact_k), torch.cat(exact_v)
        n = k.shape[0]
        held_k, held_v = _state(runner, "a", 0)
        assert held_k.shape[0] == n
        start = max(0, n - r)
        whole = (n // r) * r
        assert torch.equal(held_v[start:], v[start:]), n  # the window: exact
        assert torch.equal(held_k[whole:], k[whole:]), n  # the unfinished chunk: exact
        kq, vq = _stored(fmt, k[:whole], v[:start])
        assert torch.equal(held_v[:start], vq) and torch.equal(held_k[:whole], kq), n
        if start:
            assert not torch.equal(vq, v[:start])
        assert runner.executor.storage.num_tails <= 3
        residues.add(n % r)
    assert residues == set(range(r)) and n > 2 * 16


# ----- kvpool eval kv-quant: the serving path ---------------------------------------------


def test_the_eval_drives_the_engines_prefill_then_decode_steps_and_names_the_regime(model, monkeypatch) -> None:
    """Each format (and the exact reference) runs through the engine's runner: one step
    prefills the first P tokens, then one step per token decodes the rest teacher-forced;
    the scored distributions are the prefill's last and each decode step's. The exact
    run's equal the plain forward's (fp64); the perplexity change comes with a bootstrap
    interval around it, and the report names the regime it measured."""
    import math

    from kvpool.attention.reference import contiguous_step
    from kvpool.verify.kv_quant import evaluate

    steps: list[tuple[str, list[tuple[int, int]]]] = []
    real = ModelRunner.execute

    def execute(self, chunks, all_logits=False):
        fmt = getattr(self.executor.storage, "fmt", None)
        steps.append((fmt.name if fmt is not None else "exact", [(c.start, len(c.token_ids)) for c in chunks]))
        return real(self, chunks, all_logits)

    monkeypatch.setattr(ModelRunner, "execute", execute)
    ids = random_ids(56, 7)
    ev = evaluate(model, ids, ["fp16", "kivi2-g8-r16"], block_size=16, prefill=24)
    for name in ("exact", "fp16", "kivi2-g8-r16"):
        assert [s for f, s in steps if f == name] == [[(0, 24)]] + [[(p, 1)] for p in range(24, 55)], name
    assert ev.regime["prefill_tokens"] == 24 and ev.regime["decode_steps"] == 31
    assert ev.regime["scored_positions"] == 32 and "decode" in ev.regime["description"]
    # the exact run scores what the plain forward computes
    logits = model.forward(torch.tensor(ids), torch.arange(56), contiguous_step(56))
    nll = F.cross_entropy(logits[23:55], torch.tensor(ids[24:]), reduction="mean").item()
    assert ev.fp32_perplexity == pytest.approx(math.exp(nll), rel=1e-9)
    by = {r.name: r for r in ev.formats}
    assert 0 <= by["fp16"].kl_mean < by["kivi2-g8-r16"].kl_mean
    for r in ev.formats:
        lo, hi = r.perplexity_change_ci95
        assert lo <= r.perplexity_change_pct <= hi and lo < hi
        assert r.kl_ci95[0] <= r.kl_mean <= r.kl_ci95[1]


# ----- a NaN or an inf in K/V: never back as finite numbers --------------------------------

POISONS = {"nan": float("nan"), "inf": float("inf"), "-inf": float("-inf")}


@pytest.mark.parametrize("poison", POISONS)
@pytest.mark.parametrize("name", ["int8", "fp8_e4m3", "fp8_e5m2", "fp8_e4m3_token", "fp8_e5m2_token"])
def test_a_scale_group_holding_a_nan_or_an_inf_comes_back_nan_and_the_others_as_before(name, poison) -> None:
    """4 tokens x 2 KV heads x 8 dims (one block of 4) with one K value non-finite: the values
    sharing its scale (its token and head; block-scaled: its head's whole block) come back
    NaN, not finite (with a scale of 1 int8 gave zeros, and fp8 a NaN among values
    saturated at 448); every other value, and V, is exactly the clean round trip."""
    fmt = kv_schema(name)
    k = torch.linspace(-600.0, 900.0, 64).view(4, 2, 8)  # |values| past fp8's 448: scales matter
    v = torch.linspace(0.5, -0.3, 64).view(4, 2, 8)
    clean_k, clean_v = round_trip_kv(fmt, k, v, 4)
    bad = k.clone()
    bad[1, 0, 3] = POISONS[poison]
    got_k, got_v = round_trip_kv(fmt, bad, v, 4)
    group = torch.zeros(4, 2, 8, dtype=torch.bool)
    if fmt.k_scale == "block":
        group[:, 0] = True
    else:
        group[1, 0] = True
    assert bool(got_k[group].isnan().all())
    assert torch.equal(got_k[~group], clean_k[~group]) and torch.equal(got_v, clean_v)


@pytest.mark.parametrize("poison", POISONS)
@pytest.mark.parametrize("kind", ["main", "index-fp8", "index-mxfp4"])
def test_a_v4_entry_group_holding_a_nan_or_an_inf_comes_back_nan(kind, poison) -> None:
    """DeepSeek-V4's layout, a 128-dim entry (main: 64 of them RoPE dims in BF16): the group
    of the non-finite value (main: 64 dims, index-fp8: 128, MXFP4: 32) comes back NaN (an
    inf gave +-2^-118 everywhere under the clamped UE8M0 exponent; MXFP4 made a NaN 6.0),
    and an entry without one exactly as before."""
    x = torch.linspace(-3.0, 5.0, 2 * 128).view(1, 2, 128)
    pool = V4EntryPool(kind, 1, 2, 128, 64 if kind == "main" else 0, torch.float32)
    pool[0] = x[0]
    clean = pool[0:1].clone()
    bad = x.clone()
    bad[0, 0, 40] = POISONS[poison]
    pool[0] = bad[0]
    got = pool[0:1]
    width = {"main": 64, "index-fp8": 128, "index-mxfp4": 32}[kind]
    group = torch.zeros(1, 2, 128, dtype=torch.bool)
    group[0, 0, 40 // width * width : (40 // width + 1) * width] = True
    assert bool(got[group].isnan().all())
    assert torch.equal(got[~group], clean[~group])


@pytest.mark.parametrize("name", ["int8", "fp8_e4m3_token", "fp8_e5m2_token"])
def test_a_vector_of_subnormals_whose_scale_underflows_comes_back_finite(name) -> None:
    """amax / qmax underflows to 0 below qmax x the smallest fp32 subnormal: the scale was
    0 and every 0 / 0 a NaN code (fp8; int8 rounded it to 0). Finite in, finite out: the
    error is within the vector's amax."""
    x = torch.tensor([[1e-45, 0.0, -1e-45, 0.0], [3e-43, 0.0, 1e-44, -2e-43]])
    back = round_trip(kv_schema(name), x)
    assert bool(back.isfinite().all())
    assert bool(((back - x).abs() <= x.abs().amax(dim=-1, keepdim=True)).all())


def test_a_text_file_that_cannot_be_read_is_one_line_naming_text(tmp_path, monkeypatch) -> None:
    """`kvpool eval kv-quant --text PATH`: a missing file said "[Errno 2] ..." without the flag,
    and an unreadable one (a PermissionError: no ValueError) reached the user as a traceback."""
    import kvpool.verify.kv_quant as kv_quant

    missing = str(tmp_path / "missing.txt")
    with pytest.raises(ValueError, match=f"^--text '{missing}': no such file$"):
        kv_quant.reference_text(missing)

    def unreadable(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    (tmp_path / "locked.txt").write_text("text")
    locked = str(tmp_path / "locked.txt")
    monkeypatch.setattr(kv_quant, "open", unreadable, raising=False)  # (root reads any file: the call says no)
    with pytest.raises(ValueError, match=f"^--text '{locked}': cannot read it \\(Permission denied\\)$"):
        kv_quant.reference_text(locked)


def test_fp16_saturates_a_finite_value_past_its_range_and_keeps_a_nan_or_an_inf() -> None:
    """fp16 stored a finite 70,000 as inf (its largest is 65,504), and attention over that V
    came out NaN. Now a finite value saturates at +-65,504, as KIVI's codes do (the error is
    the overshoot, no more); an inf or a NaN stays one (never stored as finite numbers, as
    the 8-bit formats keep it). Attention over the stored K / V is finite, and its error is
    the saturated value's weight times the overshoot."""
    fmt = kv_schema("fp16")
    x = torch.tensor([[7e4, -1e5, 1.5, 65504.0], [float("nan"), float("inf"), float("-inf"), -7e4]])
    back = round_trip(fmt, x)
    assert back[0].tolist() == [65504.0, -65504.0, 1.5, 65504.0]
    assert back[1, 0].isnan() and back[1, 1:3].tolist() == [float("inf"), float("-inf")] and back[1, 3] == -65504.0
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 1, 64, generator=gen, dtype=torch.float64) for _ in range(3))
    k, v = k.expand(32, 1, 64).clone(), torch.randn(32, 1, 64, generator=gen, dtype=torch.float64)
    v[10, 0, 3] = 7e4
    exact = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1))
    kq, vq = (round_trip(fmt, t.float()).double() for t in (k, v))
    stored = F.scaled_dot_product_attention(q.transpose(0, 1), kq.transpose(0, 1), vq.transpose(0, 1))
    assert bool(stored.isfinite().all())
    weight = torch.softmax((q[0] @ k[:, 0].T) / 8, dim=-1)[0, 10]  # token 10's attention weight
    err = (stored - exact).abs().max()
    # the overshoot 4,496 x its weight, plus fp16's rounding of the other values (<= 2^-11 relative)
    assert float(err) <= float(weight) * (7e4 - 65504) * (1 + 1e-3) + 2e-3
    assert float(err) >= float(weight) * (7e4 - 65504) * (1 - 1e-3) - 2e-3


def test_fp16_kv_writes_of_an_fp16_input_skip_the_saturation() -> None:
    """An fp16 K / V is within fp16's range already (its infs and NaNs are its own): quantize
    hands it back as it is, no op run (the saturation's isinf / clamp / where, every layer's K
    and V, every step), and its inf, NaN and largest values come back unchanged."""
    fmt = kv_schema("fp16")
    x = torch.tensor([[65504.0, -65504.0, 1.5], [float("nan"), float("inf"), float("-inf")]], dtype=torch.float16)
    codes, scale = quantize(fmt, x)
    assert codes is x and scale is None
    back = round_trip(fmt, x)
    assert back[0].tolist() == [65504.0, -65504.0, 1.5] and back[1, 0].isnan()
    assert back[1, 1:].tolist() == [float("inf"), float("-inf")]


def test_a_greedy_run_past_the_context_is_refused_before_the_evaluation(monkeypatch) -> None:
    """`kvpool eval kv-quant --greedy-prompt 8100 --greedy-steps 150`: the engine decoded the
    92 tokens the context left and the agreement divided by 150 (bf16, every token equal: 0.61);
    --greedy-prompt 100000 was refused by the engine as "request 'req-0': prompt of 100000
    tokens is too long" after every format had run. A text shorter than --greedy-prompt
    reported the flag's count, not the prompt's."""
    from types import SimpleNamespace

    import kvpool.verify.kv_quant as kv_quant

    loaded = SimpleNamespace(
        tokenizer=SimpleNamespace(encode=lambda text: list(range(len(text.split())))),
        model=SimpleNamespace(config=SimpleNamespace(max_position=100)),
        gguf=SimpleNamespace(path="/m/tiny.gguf"),
    )
    ran: list[str] = []

    def evaluate(*args, **kwargs):
        ran.append("evaluate")
        return SimpleNamespace(formats=[], regime={}, fp32_perplexity=1.0, kv_max_abs=0.0)

    monkeypatch.setattr(kv_quant, "evaluate", evaluate)
    monkeypatch.setattr(kv_quant, "greedy_agreement", lambda model, prompt, *a: ran.append(len(prompt)) or {})
    text = " ".join(["w"] * 500)
    flags = {"tokens": 50, "prefill": 10, "block_size": 16}
    for prompt, steps, said in (
        (90, 11, "of 90 tokens \\(--greedy-prompt 90\\) and --greedy-steps 11"),
        (1000, 1, "of 500 tokens \\(--greedy-prompt 1,000\\) and --greedy-steps 1"),
    ):
        with pytest.raises(
            ValueError, match=f"^the greedy run's prompt {said} pass the model's context of 100 tokens$"
        ):
            kv_quant.quality_report(loaded, ["bf16"], text, "t", greedy_prompt=prompt, greedy_steps=steps, **flags)
    assert ran == []  # refused before anything ran
    # the limit itself runs; a 30-token text reports its 30-token prompt
    kv_quant.quality_report(loaded, ["bf16"], text, "t", greedy_prompt=90, greedy_steps=10, **flags)
    report = kv_quant.quality_report(loaded, ["bf16"], " ".join(["w"] * 30), "t", greedy_prompt=200, **flags)
    assert ran == ["evaluate", 90, "evaluate", 30] and report["greedy_prompt_tokens"] == 30
    # --tokens past the context names the flag's value and the text's tokens it took
    with pytest.raises(ValueError, match=r"^--tokens 10,000 takes 500 tokens of the text, past the model's context"):
        kv_quant.quality_report(loaded, ["bf16"], text, "t", tokens=10_000, prefill=10)


def test_greedy_agreement_joins_the_formats_by_their_names_however_spelled(monkeypatch) -> None:
    """`eval kv-quant --formats kivi2-g32-r128` (kivi2's defaults spelled out): evaluate names
    its results as kv_schema does ("kivi2"), greedy_agreement keyed them by the flag's spelling,
    and the report was a KeyError traceback after every format had run."""
    from dataclasses import replace
    from types import SimpleNamespace

    import kvpool.verify.kv_quant as kv_quant

    loaded = SimpleNamespace(
        tokenizer=SimpleNamespace(encode=lambda text: list(range(len(text.split())))),
        model=SimpleNamespace(config=SimpleNamespace(max_position=1000)),
        gguf=SimpleNamespace(path="/m/tiny.gguf"),
    )
    blank = kv_quant.FormatQuality("", 1.0, 1, 1.0, 1.0, 0.0, 0.0, 1.0, [], (0.0, 0.0), (0.0, 0.0))

    def evaluate(model, ids, formats, *args):  # (its results named as evaluate names them: kv_schema's)
        named = [replace(blank, name=kv_schema(f).name) for f in formats]
        return SimpleNamespace(formats=named, regime={}, fp32_perplexity=1.0, kv_max_abs=0.0)

    def greedy(model, prompt, formats, steps, block_size):  # (keyed by the names it is given, as it is)
        return {f: (0.5 + i / 10, i) for i, f in enumerate(formats)}

    monkeypatch.setattr(kv_quant, "evaluate", evaluate)
    monkeypatch.setattr(kv_quant, "greedy_agreement", greedy)
    formats = ["kivi2-g32-r128", "int8"]
    assert [kv_schema(f).name for f in formats] == ["kivi2", "int8"]  # (the premise)
    text = " ".join(["w"] * 300)
    report = kv_quant.quality_report(loaded, formats, text, "t", tokens=200, prefill=128, greedy_steps=4)
    got = [(f["name"], f["greedy_agreement"], f["greedy_first_divergence"]) for f in report["formats"]]
    assert got == [("kivi2", 0.5, 0), ("int8", 0.6, 1)]


@pytest.mark.parametrize(
    ("formats", "named"),
    [("bf16,int8,bf16", "'bf16'"), ("kivi2,kivi2-g32-r128", "'kivi2' and 'kivi2-g32-r128'")],
)
def test_eval_refuses_a_format_named_twice_before_the_model_loads(formats, named, capsys, monkeypatch) -> None:
    """`kvpool eval kv-quant --formats bf16,bf16` evaluated bf16 twice (two rows of it), and
    kivi2 with its defaults spelled out likewise."""
    import kvpool.engine.build as build
    from kvpool.cli.main import main

    monkeypatch.setattr(build, "load_model", lambda *a, **k: pytest.fail("the model loaded"))
    assert main(["eval", "kv-quant", "--formats", formats]) == 2
    assert capsys.readouterr().err == f"kvpool eval kv-quant: error: --formats names one format twice: {named}\n"


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        # each was dropped without a word: tiny-dsv4 evaluates its own layouts on random ids
        (["--formats", "int8"], "--model tiny-dsv4 evaluates its own fp8 layouts: --formats is for SmolLM2"),
        (["--block-size", "64"], "--model tiny-dsv4 evaluates its own fp8 layouts: --block-size is for SmolLM2"),
        (["--prefill", "10"], "--model tiny-dsv4 evaluates its own fp8 layouts: --prefill is for SmolLM2"),
        (["--greedy-prompt", "5"], "--model tiny-dsv4 evaluates its own fp8 layouts: --greedy-prompt is for SmolLM2"),
        # "0: skip" ran 32 steps
        (["--greedy-steps", "0"], "--model tiny-dsv4 measures every figure over --greedy-steps tokens: give 1 or more"),
    ],
)
def test_eval_on_tiny_dsv4_refuses_the_smollm2_flags(flags, message, capsys, monkeypatch) -> None:
    import kvpool.verify.kv_quant as kv_quant
    from kvpool.cli.main import main

    monkeypatch.setattr(kv_quant, "quality_report_v4", lambda *a, **k: pytest.fail("the evaluation ran"))
    assert main(["eval", "kv-quant", "--model", "tiny-dsv4", *flags]) == 2
    assert capsys.readouterr().err == f"kvpool eval kv-quant: error: {message}\n"


def test_a_text_file_is_read_up_to_what_the_evaluation_can_take() -> None:
    """`--text /dev/zero` never ended (the whole file read into memory), as a log of gigabytes
    would have filled it: the first MAX_TEXT_CHARS characters are read."""
    from kvpool.verify.kv_quant import MAX_TEXT_CHARS, reference_text

    text, source = reference_text("/dev/zero")
    assert (len(text), set(text), source) == (MAX_TEXT_CHARS, {"\0"}, "/dev/zero")
    assert MAX_TEXT_CHARS >= 131_072 * 32  # 32 characters a token at a Llama-3 GGUF's context


def test_a_block_past_the_context_is_refused_before_the_evaluation(monkeypatch) -> None:
    """`kvpool eval kv-quant --block-size 1000000000`: the pool of such blocks was allocated,
    and torch's "can't allocate memory: you tried to allocate 46080000000000 bytes" reached
    the user as a traceback."""
    from types import SimpleNamespace

    import kvpool.verify.kv_quant as kv_quant

    loaded = SimpleNamespace(
        tokenizer=SimpleNamespace(encode=lambda text: list(range(len(text.split())))),
        model=SimpleNamespace(config=SimpleNamespace(max_position=100)),
        gguf=SimpleNamespace(path="/m/tiny.gguf"),
    )
    ran: list[int] = []
    monkeypatch.setattr(kv_quant, "evaluate", lambda *a, **k: ran.append(a[4]) or pytest.fail("evaluated"))
    text = " ".join(["w"] * 50)
    with pytest.raises(ValueError, match="^--block-size 101 is larger than the model's context of 100 tokens$"):
        kv_quant.quality_report(loaded, ["bf16"], text, "t", tokens=20, prefill=10, block_size=101, greedy_steps=0)
    assert ran == []
