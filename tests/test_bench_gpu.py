"""`kvpool bench gpu`: the host part's figures on a small batch; without CUDA the other parts
on the CPU at small shapes: the attention figures time no plan, the engine's rows beside
transformers and the plain forward, the prefill, and numerics that a perturbed engine fails;
transformers and the plain forward hold the engine's model's weights (their logits equal).
The attention and numerics figures are exact in fp64, and their fp32 figures held to bounds
derived from the reference's own fp32-vs-fp64 error on the same inputs."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from kvpool.attention.reference import reference_logits
from kvpool.bench.gpu import _interpreted_triton, config_path
from kvpool.bench.gpu_engine import TINY
from kvpool.cli.main import main
from kvpool.models.gguf import LlamaConfig
from kvpool.models.hf_config import random_llama
from test_attention_paged import fp32_tolerance

# fp64: the bench's attention outputs (|out| <= 0.62) land 0 .. 1.0e-15 from SDPA's, the
# engine's logits 1.0e-15 (bags) and 1.1e-15 (triton) of the largest from the contiguous
# oracle's (this Intel Xeon): 1000x for rounding, while a key or value read from a wrong slot
# or position moves either by 1e-3 and more (absolute for the attention, relative to the
# largest logit for the numerics)
TOL64 = 1e-12


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU's run is for machines without CUDA")
def test_without_cuda_a_gpu_part_runs_on_the_cpu_at_small_shapes():
    env = {**os.environ, "PYTHONPATH": os.path.join(os.path.dirname(__file__), "..", "src")}
    done = subprocess.run(
        [sys.executable, "-m", "kvpool", "bench", "gpu", "--parts", "attention", "--dtype", "fp32", "--json"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert (report["device"], report["dtype"]) == ("cpu", "fp32")
    rows = report["decode_attention"]
    assert [(r["batch"], r["context"]) for r in rows] == [(1, 512), (4, 512)]  # CPU_DECODE_SHAPES
    extend = report["extend_attention"]
    assert (extend["batch"], extend["context"], extend["chunk"]) == (1, 256, 64)  # CPU_EXTEND
    for row in [*rows, extend]:
        assert row["paged_ms"] > 0 and row["sdpa_ms"] > 0 and row["plan_host_ms"] > 0
    # the same figures in fp64 (the bench's own calls): the paged step is SDPA's to fp64 rounding
    from kvpool.bench import gpu

    exact_rows = gpu.decode_attention(torch.float64, gpu.CPU_DECODE_SHAPES, device="cpu")
    for row in [*exact_rows, gpu.extend_attention(torch.float64, *gpu.CPU_EXTEND, device="cpu")]:
        assert row["max_abs_diff"] <= TOL64
    # and the fp32 figures within a bound derived from SDPA's own fp32 error on the same inputs:
    # |paged32 - sdpa32| <= |paged32 - exact| + |sdpa32 - exact|, the first held to
    # tests/test_attention_paged.py's fp32_tolerance (4x SDPA's error + 16 U max|v|, ~8 ulps
    # of the largest value: every fp32 path meets it there), the second SDPA's error itself.
    # Measured on this Intel Xeon: 2.8e-7 and 3.4e-7 (decodes) and 0 (the extend) against
    # bounds of ~5e-6 (SDPA's errors 1.2e-7 .. 8.5e-7, max|v| 4.8); a value read from a wrong
    # slot moves an output by ~|v| / context, 1e-2 here.
    for row, q_len in [*((r, 1) for r in rows), (extend, extend["chunk"])]:
        sdpa32, exact, values = _sdpa_fp32_and_fp64(row["batch"], row["context"], q_len)
        own = (sdpa32.double() - exact).abs().max().item()
        assert row["max_abs_diff"] <= fp32_tolerance(sdpa32, exact, values).item() + own, row


def _sdpa_fp32_and_fp64(batch: int, context: int, q_len: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """SDPA's output on the bench's attention case (bench/gpu.py _paged_case, Llama-3.1-8B's
    heads, seed 0) in fp32 and in fp64, over the same values (the case draws them in fp32),
    as the bench calls it: decodes (q_len 1) unmasked, a chunk causal at the context's end;
    and the case's V (the fp32 bound's floor scales with max|v|)."""
    from kvpool.bench.gpu import LLAMA_8B_HEADS, _paged_case

    num_heads, _, dim = LLAMA_8B_HEADS
    outs = []
    for dtype in (torch.float32, torch.float64):
        *_, q, _, _, k, v = _paged_case(batch, context, q_len, dtype, "cpu", LLAMA_8B_HEADS)
        qs = q.view(batch, q_len, num_heads, dim).transpose(1, 2)  # [batch, H, q_len, D]
        mask = None if q_len == 1 else torch.ones(q_len, context, dtype=torch.bool).tril(context - q_len)
        outs.append(torch.nn.functional.scaled_dot_product_attention(qs, k, v, attn_mask=mask, enable_gqa=True))
    return outs[0], outs[1], v


def test_the_host_part_times_each_piece_of_a_decode_step(capsys):
    assert main(["bench", "gpu", "--parts", "host", "--batch", "6", "--context", "40", "--json"]) == 0
    host = json.loads(capsys.readouterr().out)["host"]
    assert (host["batch"], host["context"], host["steps"]) == (6, 40, 50)
    parts = ("schedule_ms", "metadata_ms", "sampling_ms", "bookkeeping_ms")
    assert all(host[p] > 0 for p in parts)
    # the printed pieces add up to the printed step (each rounded to 4 decimals, the rest last)
    assert sum(host[p] for p in parts) == pytest.approx(host["step_ms"], abs=1e-9)
    # the first decode after the prefill is moved on from the prefill's vectors (`advance`
    # of a changed batch: the prefill's 40 tokens, each sequence's one now); the 49 after it
    # advance in place; both write an entry only where a token opens a block (16 tokens):
    # positions 40-89 open 48, 64 and 80. 6 * 3 / 50 entries a step
    assert host["steps_advanced_in_place"] == 49
    assert host["table_entries_written_per_step"] == 6 * 3 / 50
    # through the engine's own decode path: its step buffers, in the largest bucket (the batch)
    assert host["decode_path"] == "static step buffers, padded to bucket 6"
    # the fixed logits' columns, and a temperature batch of the same rows timed apart
    assert host["vocab"] == 16
    assert host["temperature_sampling_ms"] > 0
    # the same engine's step with every row at temperature 0.8 / top-p 0.95, its sampling a part of it
    assert 0 < host["temperature_step_sampling_ms"] < host["temperature_step_ms"]
    # churn: max(1, 6 // 32) = 1 request finishes and one joins every step, so every step
    # is a mixed one of the 6 rows (one a prefill of 40 tokens, or of one block's 16 in the
    # short churn): each is moved on from the last step's vectors with the joiner's row
    # written (`advance` of a changed batch), none is a decode-only (graph) step; each is
    # planned by the Triton backend from the step buffers, as on a GPU (here in Triton's
    # interpreter, its kernels never run: the forward is replaced)
    # churn1_short: one finishes and one joins every step whatever the batch (at batch 128,
    # steady serving's changed step: issue 30's 0.3 ms is checked against it)
    for key, prompt_len in (("churn", 40), ("churn_short", 16), ("churn1_short", 16)):
        assert (host[f"{key}_rows_per_step"], host[f"{key}_finished_per_step"]) == (6, 1)
        assert host[f"{key}_prompt_tokens_per_step"] == prompt_len
        assert (host[f"{key}_steps_advanced_in_place"], host[f"{key}_decode_only_steps"]) == (0, 0)
        assert host[f"{key}_steps_advanced_changed"] == 50
        assert host[f"{key}_attention_backend"] == "triton"
        assert host[f"{key}_plan_path"] == "50 from the step buffers (begin_buffered_step)"
        pieces = [f"{key}_{p}_ms" for p in ("schedule", "metadata", "plan", "sampling", "commit")]
        assert all(host[p] > 0 for p in pieces)
        assert sum(host[p] for p in [*pieces, f"{key}_rest_ms"]) == pytest.approx(host[f"{key}_step_ms"], abs=1e-9)


def test_a_model_is_a_config_path_or_a_preset():
    assert config_path("Llama-3.1-8B").name == "llama-3.1-8b.json"
    with pytest.raises(ValueError, match="--model 'nope': no such config.json, nor a preset"):
        config_path("nope")


def _counting_plans(monkeypatch) -> tuple[list[int], list[int]]:
    """Count the backend's `begin_step` calls (plans made) in all, and those made inside each
    timed call of the attention part (`_device_time`'s function)."""
    from kvpool.bench import gpu

    planned: list[int] = []
    inside: list[int] = []
    paged_case, device_time = gpu._paged_case, gpu._device_time

    def counting_case(*args, **kwargs):
        impl, attention, *rest = paged_case(*args, **kwargs)
        begin_step = attention.begin_step

        def counted(meta):
            planned.append(1)
            return begin_step(meta)

        attention.begin_step = counted
        return (impl, attention, *rest)

    def watching(fn, device, *args):
        def watched():
            before = len(planned)
            out = fn()
            inside.append(len(planned) - before)
            return out

        return device_time(watched, device, *args)

    monkeypatch.setattr(gpu, "_paged_case", counting_case)
    monkeypatch.setattr(gpu, "_device_time", watching)
    return planned, inside


def test_a_model_or_host_shape_past_the_machine_is_refused_before_it_is_built(capsys, monkeypatch):
    """One line each, before the first tensor: were the allocator's tracebacks (a 70B model's
    random weights; a host part whose RoPE tables and logits cover 10^12 positions). The
    machine is given 8 GiB, so that one with more memory does not start building 70B."""
    from kvpool.engine import memory

    monkeypatch.setattr(memory, "available_memory_bytes", lambda device: 8 << 30)
    for argv, needle in (
        (["--model", "llama-3.1-70b", "--parts", "engine"], "llama-3.1-70b with random weights needs "),
        (
            ["--context", "999999999999", "--parts", "host"],
            "the host part's --batch 128 x --context 999999999999 needs ",
        ),
    ):
        assert main(["bench", "gpu", *argv]) == 2
        err = capsys.readouterr().err.strip().splitlines()[-1]
        assert err.startswith(f"kvpool bench gpu: error: {needle}") and "has 8.0 GiB of memory available" in err, err


def test_a_flag_for_parts_not_run_is_refused_before_any_part_runs(capsys, monkeypatch):
    """`--parts host --model llama-3.1-70b` ran the host part's stand-in and printed figures
    that looked like the 70B's: each flag set away from its default names the parts that read
    it. A flag some chosen part reads, or one left at its default, goes through."""
    from kvpool.cli import bench_gpu

    ran = []

    def measure(parts, model, dtype, batch, context, progress, enforce_eager):
        ran.append({"parts": parts, "model": model, "batch": batch})
        return {"device": "cpu", "dtype": dtype}

    monkeypatch.setattr(bench_gpu, "measure", measure)
    for argv, needle in (
        (["--parts", "host", "--model", "llama-3.1-8b"], "--model is read by the engine and prefill parts only"),
        (["--parts", "engine,numerics", "--batch", "4"], "--batch is read by the host part only"),
        (["--parts", "attention", "--context", "64"], "--context is read by the host part only"),
        (["--parts", "prefill", "--enforce-eager"], "--enforce-eager is read by the engine part only"),
        (["--parts", "host,numerics", "--dtype", "fp32"], "--dtype is read by the attention and engine and prefill"),
    ):
        assert main(["bench", "gpu", *argv, "--json"]) == 2, argv
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(f"kvpool bench gpu: error: {needle}"), err
    assert ran == []
    for argv in (
        ["--parts", "host,engine", "--model", "llama-3.1-8b", "--batch", "4"],
        ["--parts", "host", "--batch", "128"],
    ):
        assert main(["bench", "gpu", *argv, "--json"]) == 0, argv
    assert [r["parts"] for r in ran] == [("host", "engine"), ("host",)]


def test_a_bad_model_is_refused_before_any_part_runs(capsys, monkeypatch, tmp_path):
    """--model was read by the engine part, after the host and attention parts had run (seconds
    on the CPU, minutes on a GPU) and printed their progress; "" ran the default model."""
    from kvpool.cli import bench_gpu

    ran = []
    monkeypatch.setattr(bench_gpu, "measure", lambda **kwargs: ran.append(kwargs))
    bad = tmp_path / "bad.json"
    bad.write_bytes(b"\xff\xfe")
    for model, needle in (
        ("no-such-preset", "--model 'no-such-preset': no such config.json, nor a preset ("),
        (str(bad), f"{bad}: not JSON (not UTF-8 text: byte 0xff at 0)"),
        (str(tmp_path), f"{tmp_path / 'config.json'}: no such config.json"),
        ("", "--model: an empty name (''); give a preset or a config.json"),
        (" ", "--model: an empty name (' '); give a preset or a config.json"),
    ):
        assert main(["bench", "gpu", "--model", model]) == 2, model
        captured = capsys.readouterr()
        assert captured.err.startswith(f"kvpool bench gpu: error: {needle}"), captured.err
        assert captured.err.count("\n") == 1 and captured.out == ""
    assert ran == []


def test_the_attention_figures_time_the_attention_over_a_plan_made_before(monkeypatch):
    from kvpool.bench import gpu

    planned, inside = _counting_plans(monkeypatch)
    heads = (4, 2, 16)
    rows = gpu.decode_attention(torch.float64, ((1, 48), (3, 40)), device="cpu", heads=heads)
    extend = gpu.extend_attention(torch.float64, 2, 48, 16, device="cpu", heads=heads)
    # every timed call (paged and SDPA, warm-ups included) made no plan: the paged calls
    # attend over the step planned before the timing
    assert len(inside) == 3 * 2 * (2 + gpu.CPU_REPEAT) and set(inside) == {0}
    # the plans were made and timed apart: per row, the warm-up, CPU_REPEAT timed, the one attended over
    assert len(planned) == 3 * (1 + gpu.CPU_REPEAT + 1)
    for row in [*rows, extend]:
        assert row["backend"] == "bags"  # the CPU's backend (no C kernels asked for)
        assert row["plan_host_ms"] > 0 and row["paged_ms"] > 0 and row["sdpa_ms"] > 0
        # the paged step's output is SDPA's on the contiguous copy (fp64: summation order apart)
        assert row["max_abs_diff"] < 1e-12
    assert [(r["batch"], r["context"]) for r in rows] == [(1, 48), (3, 40)]
    assert (extend["batch"], extend["context"], extend["chunk"]) == (2, 48, 16)


SMALL = LlamaConfig(2, 64, 160, 4, 2, 16, 10000.0, 1e-5, 300, 256, False)


@pytest.mark.parametrize(
    ("tied", "scaled", "family"),
    [
        (False, False, "llama"),
        (True, False, "llama"),
        (False, True, "llama"),
        (True, False, "qwen2"),
        (False, False, "qwen3"),
    ],
)
def test_transformers_and_the_plain_forward_hold_the_engines_weights(tied, scaled, family):
    """scaled: Llama 3.1's RoPE scaling (the llama-3.1-8b preset's kind; its original
    context 64 here, so that 20 positions see it), which transformers' copy takes too.
    qwen2: Q / K / V biases (a qwen2 config.json), in transformers' Qwen2ForCausalLM;
    qwen3: q / k norms and a head dim of 24 (not hidden / heads), in Qwen3ForCausalLM."""
    pytest.importorskip("transformers")
    from dataclasses import replace

    from kvpool.bench.gpu_baselines import ContiguousLlama, transformers_llama
    from kvpool.models.rope import llama3_divisors

    divisors = llama3_divisors(16, 10000.0, 8.0, 1.0, 4.0, 64) if scaled else None
    qwen3 = {"qk_norm": True, "head_dim": 24} if family == "qwen3" else {}
    cfg = replace(SMALL, tie_embeddings=tied, rope_freq_divisors=divisors, qkv_bias=family == "qwen2", **qwen3)
    hf = transformers_llama(cfg, 3, torch.float64, "cpu")  # fp64: equal but for summation order
    assert type(hf).__name__ == {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}.get(
        family, "Qwen3ForCausalLM"
    )
    ids = torch.randint(0, cfg.vocab_size, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = hf(ids).logits  # [2, 20, vocab]
    scale = want.abs().max()
    assert scale > 1.0
    for b in range(2):  # the engine's model of the same seed: the same logits (fp64 rounding apart)
        ours = reference_logits(random_llama(cfg, 3, dtype=torch.float64), ids[b].tolist(), fused=False)
        # (transformers makes RoPE's frequencies in fp32 whatever the model's dtype: that
        # rounding, ~2e-7 of the largest logit here, is all that parts the two in fp64)
        assert (ours - want[b]).abs().max() <= 2e-6 * scale
    other = reference_logits(random_llama(cfg, 4, dtype=torch.float64), ids[0].tolist(), fused=False)
    assert (other - want[0]).abs().max() > 0.1 * scale  # another seed is another model
    # the plain forward over its contiguous cache: a 12-token prefill, then 8 decode steps
    # (its logits come out in fp32: each within fp32's rounding of the fp64 ones, 2^-24 of
    # the largest, doubled for the two summation orders)
    plain = ContiguousLlama(hf, 2, 24)
    assert (plain.prefill(ids[:, :12]) - want[:, 11]).abs().max() <= 2**-23 * scale
    for t in range(12, 20):
        plain.ids.copy_(ids[:, t])
        plain.pos.fill_(t)
        assert (plain.decode() - want[:, t]).abs().max() <= 2**-23 * scale


def test_the_engine_part_sets_transformers_and_the_plain_forward_beside_the_engine():
    pytest.importorskip("transformers")
    from kvpool.bench.gpu_engine import engine_tpot

    head, *rows = engine_tpot(None, torch.float32, batches=(1, 3), prompt_len=40, new_tokens=4, device="cpu")
    assert head["model"].startswith("tiny") and head["device"] == "cpu"
    assert (head["prompt_len"], head["new_tokens"]) == (40, 4)
    assert head["weight_bytes"] == random_llama(TINY).weight_bytes()
    assert head["copy_gb_s"] > 0 and head["weight_read_ms"] > 0
    assert [r["batch"] for r in rows] == [1, 3]
    for row in rows:
        # the first token comes from the prefill step; the 3 after it are the timed decodes
        assert (row["decode_steps"], row["decode_mode"], row["graph_replays"]) == (3, "eager", 0)
        assert row["plain_decode"] == "eager (CPU)"
        for key in ("tpot_ms", "transformers_tpot_ms", "plain_tpot_ms"):
            assert row[key] > 0
        assert row["tok_s"] == pytest.approx(row["batch"] / row["tpot_ms"] * 1e3, rel=1e-3, abs=0.05)  # (rounded)
        # (the ratio is printed to 3 decimals: 5e-4 of rounding where it is small, as on the CPU)
        assert row["tpot_over_plain"] == pytest.approx(row["tpot_ms"] / row["plain_tpot_ms"], rel=1e-2, abs=5e-4)


def test_the_prefill_part_times_one_prompt_in_one_step():
    pytest.importorskip("transformers")
    from kvpool.bench.gpu_engine import prefill

    report = prefill(None, torch.float32, prompt_len=64, runs=1, device="cpu")
    assert (report["prompt_len"], report["model"][:4]) == (64, "tiny")
    assert report["engine_ms"] > 0 and report["plain_ms"] > 0
    with pytest.raises(ValueError, match="a 4096-token prefill exceeds"):
        prefill(None, torch.float32, prompt_len=4096, device="cpu")


def test_numerics_go_through_the_engine_and_a_perturbed_engine_fails_them(monkeypatch):
    pytest.importorskip("transformers")
    from kvpool.bench import gpu_engine
    from kvpool.bench.gpu_baselines import transformers_llama
    from kvpool.models.llama import LlamaModel

    runs = []  # each engine run numerics makes: (its arguments, its tokens, logits, backend)
    engine_logits = gpu_engine._engine_logits

    def recorded(*args):
        runs.append((args, *engine_logits(*args)))
        return runs[-1][1:]

    monkeypatch.setattr(gpu_engine, "_engine_logits", recorded)
    rows = gpu_engine.numerics("cpu", triton_on_cpu=True)
    backends = ["bags", "triton"] if _interpreted_triton() else ["bags"]
    assert [(r["dtype"], r["backend"]) for r in rows] == [(d, b) for d in ("fp32", "bf16") for b in backends]
    truth = {dtype: transformers_llama(TINY, 1, dtype, "cpu") for dtype in (torch.float32, torch.float64)}
    oracle = random_llama(TINY, 1, dtype=torch.float64)
    num_prompt = gpu_engine.NUMERICS_PROMPT
    for row, ((dtype, _, prompt, triton), tokens, _, _) in zip(rows, runs, strict=True):
        assert row["within"], row
        assert (dtype, triton) == (
            {"fp32": torch.float32, "bf16": torch.bfloat16}[row["dtype"]],
            row["backend"] == "triton",
        )
        if row["dtype"] == "bf16":  # transformers' own bf16 error is far above fp32's, and the bound is 2x it
            assert row["transformers_rel_diff"] > 1e-3
            assert row["bound"] == 2 * row["transformers_rel_diff"]
            continue
        assert row["bound"] == 1e-3 and row["greedy_equal"]  # (the bound, the report's)
        # The engine's fp32 logits against transformers' fp32 ones (the row's figure), bounded by
        # transformers' own fp32 error on these tokens (against its fp64 forward, relative to
        # the row's scale): |engine32 - hf32| <= |engine32 - hf64| + |hf64 - hf32|. The first
        # measured 0.62x (bags) and 0.60x (triton) transformers' own error on this Intel Xeon,
        # held to 3x as tests/test_model.py holds the engine's on SmolLM2 (C_FP32, 2.3x over the
        # worst it measured there); with the second term, 4x. The row measured 0.97x.
        with torch.no_grad():
            hf32, hf64 = (truth[d](torch.tensor([tokens[:-1]])).logits[0, num_prompt - 1 :] for d in truth)
        own = ((hf32.double() - hf64).abs().max() / hf32.abs().max()).item()
        assert 0 < own < 1e-5  # (fp32 rounding: measured 7.2e-7; a broken fp64 twin would widen the bound)
        assert row["max_rel_diff"] <= 4 * own, (row, own)
        # exact in fp64: the same engine run (the backend, the chunked prefill over a cached
        # prefix, the decodes) in fp64 against the contiguous oracle of the same weights
        tokens64, got64, _ = engine_logits(torch.float64, "cpu", prompt, triton)
        want64 = reference_logits(oracle, tokens64[:-1], fused=False)[num_prompt - 1 :]
        assert got64.dtype == torch.float64 and tokens64[:num_prompt] == prompt
        assert (got64 - want64).abs().max() <= TOL64 * want64.abs().max()
    # the engine's logits 3% of the largest off in one column: both dtypes fail
    logits = LlamaModel.logits

    def perturbed(self, hidden):
        out = logits(self, hidden).clone()
        if out.numel():  # (a prefill chunk that samples nothing has no row)
            out[:, 0] += 0.03 * out.abs().max()
        return out

    monkeypatch.setattr(LlamaModel, "logits", perturbed)
    rows = gpu_engine.numerics("cpu")
    assert [(r["dtype"], r["within"]) for r in rows] == [("fp32", False), ("bf16", False)]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the CUDA paths (graphs, Triton compiled) need a GPU")
def test_on_cuda_the_engine_parts_run_and_the_numerics_hold(tmp_path):
    from kvpool.bench.gpu_engine import engine_tpot, numerics, prefill

    config = tmp_path / "config.json"
    raw = {"model_type": "llama", "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2}
    raw |= {"num_attention_heads": 8, "num_key_value_heads": 2, "vocab_size": 1000, "max_position_embeddings": 2048}
    config.write_text(json.dumps(raw))
    head, *rows = engine_tpot(str(config), torch.bfloat16, batches=(1, 4), prompt_len=32, new_tokens=8, device="cuda")
    assert head["device"] == "cuda" and [r["batch"] for r in rows] == [1, 4]
    for row in rows:
        # the plain forward's decode replayed from its graph; the engine's 7 decode steps timed
        assert (row["plain_decode"], row["decode_steps"]) == ("cuda graph", 7)
        # and the engine's from its graphs (the first decode after a prefill may run eager:
        # its vectors move on from the prefill's, so only "some" is asked)
        assert row["decode_mode"] == "graphs" and row["graph_replays"] > 0
        assert row["tpot_ms"] > 0 and row["transformers_tpot_ms"] > 0 and row["plain_tpot_ms"] > 0
    assert prefill(str(config), torch.bfloat16, prompt_len=512, runs=1, device="cuda")["engine_ms"] > 0
    rows = numerics("cuda")
    assert [r["dtype"] for r in rows] == ["fp32", "bf16"] and all(r["within"] for r in rows), rows


def test_the_one_leave_one_join_churn_is_one_whatever_the_batch():
    # at batch 64 the churn is 64 // 32 = 2 a step; churn1_short stays at one finishing and
    # one joining (a block's prompt of 16 tokens), every step a mixed one of the 64 rows
    from kvpool.bench.gpu import host_step

    host = host_step(batch=64, context=32, num_steps=6)
    assert (host["churn_rows_per_step"], host["churn_finished_per_step"]) == (64, 2)
    assert (host["churn_short_finished_per_step"], host["churn_short_prompt_tokens_per_step"]) == (2, 32)
    assert (host["churn1_short_rows_per_step"], host["churn1_short_finished_per_step"]) == (64, 1)
    assert host["churn1_short_prompt_tokens_per_step"] == 16
    assert host["churn1_short_steps_advanced_changed"] == 6 and host["churn1_short_decode_only_steps"] == 0
