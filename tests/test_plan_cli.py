"""`kvpool plan`: JSON fields, tables, the plot and the error paths."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvpool.cli.main import main
from kvpool.spec.models import load_preset_config

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict:
    assert main(["plan", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_json_has_the_required_fields(capsys: pytest.CaptureFixture[str]) -> None:
    out = _json(capsys, "--model", "llama-3.1-8b", "--gpu", "H100", "--context", "8192")
    for key in (
        "model",
        "kv_bytes_per_token",
        "state_bytes_per_request",
        "kv_bytes_at_context",
        "max_concurrent_requests",
        "ledger",
    ):
        assert key in out
    assert out["model"] == "llama-3.1-8b"
    assert out["kv_bytes_per_token"] == 131_072
    assert out["kv_bytes_at_context"] == 131_072 * 8192
    assert out["state_bytes_per_request"] == 0
    ledger = out["ledger"]
    for term in ("weights", "kv_pool", "workspace", "graph", "allocator", "transient"):
        assert isinstance(ledger[term], float)
    assert ledger["total"] + ledger["free"] == ledger["capacity"] == out["gpu_memory_bytes"]
    assert out["max_concurrent_requests"] == int(out["kv_pool_bytes_per_gpu"] // (131_072 * 8192))


def test_json_for_v4_pro_on_8_h200(capsys: pytest.CaptureFixture[str]) -> None:
    out = _json(
        capsys,
        "--model",
        "deepseek-v4-pro",
        "--gpu",
        "H200",
        "--num-gpus",
        "8",
        "--tp",
        "8",
        "--context",
        "1048576",
        "--concurrency",
        "16",
    )
    assert out["tp"] == 8 and out["replicas"] == 1 and not out["kv_sharded_by_head"]
    assert out["state_bytes_per_request"] > 0
    assert out["kv_bytes_per_token"] == pytest.approx(5511.4, abs=0.1)
    assert out["max_concurrent_requests"] >= 1
    assert 0 < out["max_context_len"] < 1_048_576  # 16 requests of 1M do not fit
    assert out["fragmentation"]["bound_slots"] == 16 * 127


def test_memory_gib_and_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(load_preset_config("qwen3-8b")))
    out = _json(capsys, "--config", str(path), "--memory-gib", "48", "--context", "4096", "--kv-dtype", "fp8")
    assert out["gpu_memory_bytes"] == 48 << 30
    assert out["kv_bytes_per_token"] == 36 * 2 * 8 * 128  # fp8: one byte per element


def test_table_output(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--model", "gemma-2-9b", "--gpu", "B200", "--context", "8192", "--concurrency", "4"]) == 0
    out = capsys.readouterr().out
    assert "peak-memory ledger" in out and "weights" in out and "max concurrent requests" in out


def test_plot_writes_a_png(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    target = tmp_path / "kv.png"
    assert main(["plan", "--plot", str(target), "--plot-models", "llama-3.1-8b,deepseek-v3.2,deepseek-v4-pro"]) == 0
    assert target.read_bytes()[:8] == PNG_MAGIC
    assert "wrote" in capsys.readouterr().out
    with_model = tmp_path / "kv2.png"
    assert main(["plan", "--model", "qwen3-8b", "--context", "4096", "--json", "--plot", str(with_model)]) == 0
    assert json.loads(capsys.readouterr().out)["model"] == "qwen3-8b"
    assert with_model.stat().st_size > 1000


def test_errors_are_clear(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = load_preset_config("llama-3.1-8b")
    del cfg["hidden_size"]
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    assert main(["plan", "--config", str(path)]) == 2
    assert "'hidden_size'" in capsys.readouterr().err
    path.write_text(json.dumps({"model_type": "rwkv", "hidden_size": 2}))
    assert main(["plan", "--config", str(path)]) == 2
    assert "unknown model kind" in capsys.readouterr().err
    assert main(["plan", "--model", "nope"]) == 2
    assert "unknown model preset" in capsys.readouterr().err
    assert main(["plan"]) == 2
    # a model that does not fit exits 1 but still prints its ledger
    assert main(["plan", "--model", "llama-3.1-70b", "--gpu", "H100", "--context", "8192", "--json"]) == 1
    assert json.loads(capsys.readouterr().out)["fits"] is False
