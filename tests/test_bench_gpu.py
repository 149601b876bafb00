"""`kvpool bench gpu`: without CUDA only the host part runs, any other part is one line;
the host part's figures on a small batch."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from kvpool.bench.gpu import config_path
from kvpool.cli.main import main


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_without_cuda_the_gpu_parts_exit_with_one_line():
    env = {**os.environ, "PYTHONPATH": os.path.join(os.path.dirname(__file__), "..", "src")}
    done = subprocess.run(
        [sys.executable, "-m", "kvpool", "bench", "gpu", "--parts", "host,attention"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert done.returncode == 1 and done.stdout == ""
    lines = done.stderr.strip().splitlines()
    assert lines == [
        "kvpool bench gpu: no CUDA GPU here (torch.cuda.is_available() is False): "
        "--parts attention need one; --parts host runs without"
    ]


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
    for key, prompt_len in (("churn", 40), ("churn_short", 16)):
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


def test_the_attention_figures_time_the_attention_over_a_plan_made_before(monkeypatch):
    from kvpool.bench import gpu

    planned, inside = _counting_plans(monkeypatch)
    heads = (4, 2, 16)
    rows = gpu.decode_attention(torch.float32, ((1, 48), (3, 40)), device="cpu", heads=heads)
    extend = gpu.extend_attention(torch.float32, 2, 48, 16, device="cpu", heads=heads)
    # every timed call (paged and SDPA, warm-ups included) made no plan: the paged calls
    # attend over the step planned before the timing
    assert len(inside) == 3 * 2 * (2 + gpu.CPU_REPEAT) and set(inside) == {0}
    # the plans were made and timed apart: per row, the warm-up, CPU_REPEAT timed, the one attended over
    assert len(planned) == 3 * (1 + gpu.CPU_REPEAT + 1)
    for row in [*rows, extend]:
        assert row["backend"] == "bags"  # the CPU's backend (no C kernels asked for)
        assert row["plan_host_ms"] > 0 and row["paged_ms"] > 0 and row["sdpa_ms"] > 0
        # the paged step's output is SDPA's on the contiguous copy
        assert row["max_abs_diff"] < 1e-5
    assert [(r["batch"], r["context"]) for r in rows] == [(1, 48), (3, 40)]
    assert (extend["batch"], extend["context"], extend["chunk"]) == (2, 48, 16)
