"""`kvpool plan`: JSON fields, tables, the plot and the error paths."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvpool.capacity.fragmentation import sample_lengths
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


def test_plot_path_problems_are_one_line_errors(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "a_file").write_text("")
    for target, message in (
        (tmp_path, f"--plot {tmp_path} is a directory; give a file name, e.g. {tmp_path / 'kv.png'}"),
        (tmp_path / "missing" / "kv.png", f"the directory {tmp_path / 'missing'} does not exist"),
        (tmp_path / "a_file" / "kv.png", f"{tmp_path / 'a_file'} is not a directory"),
    ):
        assert main(["plan", "--model", "llama-3.1-8b", "--plot", str(target)]) == 2
        captured = capsys.readouterr()
        assert captured.err.startswith("kvpool plan: error: --plot ") and message in captured.err
        assert captured.err.count("\n") == 1 and captured.out == ""  # refused before the plan printed
    # an unwritable directory (root may write anywhere, so the check is what is simulated)
    monkeypatch.setattr("kvpool.cli.args.os.access", lambda path, mode: False)
    target = tmp_path / "kv.png"
    assert main(["plan", "--plot", str(target)]) == 2
    assert capsys.readouterr().err == f"kvpool plan: error: --plot {target}: no permission to write there\n"
    assert not target.exists()


def test_a_bad_plot_path_is_named_before_the_model_is_read(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """review16 #10 (c3a255f): the --plot path is checked before the model's config is read, so
    one run names the path the figure cannot be written to, not only the model that was missing
    (it read "config file '/nonexistent.json' does not exist" first, then failed on --plot)."""
    missing = tmp_path / "nonexistent.json"
    target = tmp_path / "nope" / "x.png"
    assert main(["plan", "--config", str(missing), "--plot", str(target)]) == 2
    captured = capsys.readouterr()
    assert captured.err == f"kvpool plan: error: --plot {target}: the directory {target.parent} does not exist\n"
    assert main(["plan", "--config", str(missing)]) == 2  # (the premise: the config alone is refused)
    assert "nonexistent.json" in capsys.readouterr().err


@pytest.mark.parametrize("value", ["", " "])
def test_an_empty_plot_path_is_refused_not_dropped(capsys: pytest.CaptureFixture[str], value: str) -> None:
    """`--plot "$OUT"` with OUT unset: plan read "" as no --plot and printed the plan without
    the figure or a word (simulate refuses it); eval kv-quant said "--plot : no file extension"."""
    for argv in (["plan", "--model", "llama-3.1-8b"], ["plan"], ["eval", "kv-quant"]):
        assert main([*argv, "--plot", value]) == 2, argv
        captured = capsys.readouterr()
        name = " ".join(argv[:2]) if argv[0] == "eval" else "plan"
        assert captured.err == f"kvpool {name}: error: --plot: an empty path ({value!r})\n", argv
        assert captured.out == ""


def test_a_kv_format_a_plotted_preset_cannot_take_names_the_flags(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # the default presets include MLA and V4, which int8 is not for: the error named
    # deepseek-v3, which the user never picked, and no flag
    target = tmp_path / "kv.png"
    assert main(["plan", "--plot", str(target), "--kv-cache-dtype", "int8"]) == 2
    assert capsys.readouterr().err == (
        "kvpool plan: error: --plot: deepseek-v3 takes no --kv-cache-dtype int8 (kv dtype 'int8' is for GQA / MHA "
        "layers; deepseek-v3 is mla); pick the presets with --plot-models\n"
    )
    assert not target.exists()
    # review 9: one the user picked with --plot-models was told to pick with --plot-models,
    # and only as its line of the figure was drawn, after the plan: now before any work
    argv = ["plan", "--model", "llama-3.1-8b", "--kv-cache-dtype", "int8", "--plot", str(target)]
    assert main([*argv, "--plot-models", "deepseek-v3,llama-3.1-8b"]) == 2
    assert capsys.readouterr() == (
        "",
        "kvpool plan: error: --plot-models names deepseek-v3, which takes no --kv-cache-dtype int8 (kv dtype "
        "'int8' is for GQA / MHA layers; deepseek-v3 is mla)\n",
    )
    assert not target.exists()
    assert main(["plan", "--plot", str(target), "--kv-cache-dtype", "int8", "--plot-models", "llama-3.1-8b"]) == 0
    assert target.read_bytes().startswith(PNG_MAGIC)


def test_plot_models_must_name_a_preset(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--plot", str(tmp_path / "kv.png"), "--plot-models", " , ,"]) == 2
    assert capsys.readouterr().err == "kvpool plan: error: --plot-models ' , ,' names no preset\n"


def test_context_beyond_the_models_positions_warns_and_still_plans(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--model", "llama-3.1-8b", "--context", "262144", "--memory-gib", "1000", "--json"]) == 0
    captured = capsys.readouterr()
    out = json.loads(captured.out)
    assert out["context_len"] == 262_144 and out["max_position_embeddings"] == 131_072
    assert captured.err == (
        "kvpool plan: warning: --max-model-len 262,144 is beyond llama-3.1-8b's maximum position 131,072 "
        "(max_position_embeddings); the figures extrapolate\n"
    )
    assert main(["plan", "--model", "llama-3.1-8b", "--context", "131072", "--memory-gib", "1000", "--json"]) == 0
    assert capsys.readouterr().err == ""  # at the maximum: no warning


@pytest.mark.parametrize(
    ("flag", "value", "message"),
    [
        ("--num-gpus", "0", "expected a positive integer, got 0"),
        ("--tp", "-2", "expected a positive integer, got -2"),
        ("--context", "0", "expected a positive integer, got 0"),
        ("--concurrency", "-1", "expected a positive integer, got -1"),
        ("--block-size", "0", "expected a positive integer, got 0"),
        ("--max-num-seqs", "0", "expected a positive integer, got 0"),
        ("--max-batched-tokens", "x", "expected a positive integer, got 'x'"),
        ("--memory-gib", "inf", "expected a finite positive number, got 'inf'"),
        ("--memory-gib", "nan", "expected a finite positive number, got 'nan'"),
        ("--memory-gib", "0", "expected a finite positive number, got '0'"),
        ("--seed", "-1", "expected an integer >= 0, got -1"),
    ],
)
def test_nonsense_counts_are_refused_at_parse_time(
    flag: str, value: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["plan", "--model", "llama-3.1-8b", flag, value])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.endswith(f"kvpool plan: error: argument {flag}: {message}\n")


@pytest.mark.parametrize(
    ("value", "message"),
    [
        # 1e300 GiB overflowed to inf bytes: int(inf) raised OverflowError, a traceback
        ("1e300", "--memory-gib: 1e+300 GiB is more bytes than a number can count"),
        # 1e-12 GiB is 0 bytes: the error named memory_bytes, no flag the user gave
        ("1e-12", "--memory-gib: 1e-12 GiB is less than one byte"),
    ],
)
def test_a_memory_size_past_what_bytes_hold_is_named(
    value: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["plan", "--model", "llama-3.1-8b", "--memory-gib", value]) == 2
    assert capsys.readouterr().err == f"kvpool plan: error: {message}\n"
    # one byte, of which a share rounds down to none
    assert main(["plan", "--model", "llama-3.1-8b", "--memory-gib", "1e-9", "--gpu-memory-utilization", "0.5"]) == 2
    expected = "--gpu-memory-utilization 0.5 of 1 bytes is less than one byte"
    assert capsys.readouterr().err == f"kvpool plan: error: {expected}\n"


@pytest.mark.parametrize("name", ["[/]oops", "Llama [fp8] [bold]x[/bold]"])
def test_a_model_name_is_printed_as_written(name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # the name (config.json's _name_or_path, or its folder) went into rich markup: "[/]" raised
    # MarkupError, a traceback, and "[bold]x[/bold]" lost its brackets
    path = tmp_path / "config.json"
    path.write_text(json.dumps(load_preset_config("llama-3.1-8b") | {"_name_or_path": name}))
    assert main(["plan", "--config", str(path), "--context", "8192"]) == 0
    assert f"kvpool plan: {name} on 1 x H100" in capsys.readouterr().out
    # simulate's titles too: one run, and runs compared
    argv = ["simulate", "--model", str(path), "--requests", "4"]
    assert main(argv) == 0
    assert f", {name} on 1 H200, layout paged" in " ".join(capsys.readouterr().out.split())  # (a title may wrap)
    assert main([*argv, "--layout", "paged,contiguous"]) == 0
    assert f"kvpool simulate: {name} on H200, compared" in " ".join(capsys.readouterr().out.split())


def test_a_pd_instance_that_does_not_fit_says_so_and_exits_1(capsys: pytest.CaptureFixture[str]) -> None:
    # Llama-3.1-70B's 131 GiB of weights on one H100 leave the prefill instance no pool: the
    # table showed 0 requests and the command exited 0, as for a plan that fits
    argv = ["plan", "--model", "llama-3.1-70b", "-tp", "8", "--context", "8192", "--pd", "1,8"]
    assert main(argv) == 1
    out = capsys.readouterr().out
    assert "does not fit: the prefill instance (1 GPU) has no room for a KV pool" in out
    assert "decode instance" not in out
    assert main([*argv, "--json"]) == 1
    pd = json.loads(capsys.readouterr().out)["pd"]
    assert (pd["prefill"]["fits"], pd["decode"]["fits"]) == (False, True)
    # both sides fit: 0, as before
    assert main(["plan", "--model", "llama-3.1-70b", "-tp", "8", "--context", "8192", "--pd", "4,8"]) == 0
    assert "does not fit" not in capsys.readouterr().out


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        # each was dropped without a word: the plan printed as if it had not been given
        (["--prompt-len", "1000"], "--prompt-len sizes the prefill side of --pd P,D; give --pd too"),
        (["--plot-models", "gemma-2-9b"], "--plot-models picks the presets of --plot FILE; give --plot too"),
        # the CPU ledger has no graph term, and the P/D sides no expert parallelism: each flag
        # printed the same plan as without it
        (
            ["--device", "cpu", "--no-cuda-graphs"],
            "--no-cuda-graphs sizes a GPU's ledger; kvpool's CPU engine captures no CUDA graphs",
        ),
        (["--ep", "--pd", "1,1"], "--pd plans each side as one tensor-parallel group; --ep does not apply to them"),
    ],
)
def test_a_flag_that_needs_another_is_refused_alone(
    flags: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["plan", "--model", "llama-3.1-8b", "--context", "8192", *flags]) == 2
    assert capsys.readouterr().err == f"kvpool plan: error: {message}\n"


def test_pd_is_refused_on_the_cpu_device(capsys: pytest.CaptureFixture[str]) -> None:
    # the split planned two GPU instances (bf16 KV, a CUDA ledger) in this machine's RAM next to
    # the CPU engine's fp32 plan: a 22 GiB "GPU" pool per side beside the engine's 256 MiB
    assert main(["plan", "--model", "smollm2-135m", "--device", "cpu", "--pd", "1,1"]) == 2
    assert capsys.readouterr().err == (
        "kvpool plan: error: --pd sizes GPU instances; --device cpu plans kvpool's engine in one process\n"
    )


@pytest.mark.parametrize("model", ["llama-3.1-8b", "deepseek-v3"])
def test_an_indexer_format_for_a_model_without_an_indexer_is_refused(
    model: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # the flag was dropped without a word: the plan printed as if it had not been given
    assert main(["plan", "--model", model, "--context", "8192", "--indexer-format", "mxfp4"]) == 2
    assert capsys.readouterr().err == (
        f"kvpool plan: error: --indexer-format: {model} has no indexer keys (DeepSeek-V3.2 and V4 have)\n"
    )
    # V3.2's keys take it: 0.5 B a value + a scale byte per 32 values (128 dims: 68 B, not FP8's 132)
    out = _json(
        capsys,
        "--model",
        "deepseek-v3.2",
        "--gpu",
        "h200",
        "-tp",
        "8",
        "--context",
        "8192",
        "--indexer-format",
        "mxfp4",
    )
    assert out["kv_bytes_per_token"] == (656 + 68) * 61


def test_a_context_past_int64_is_named_by_its_flag(capsys: pytest.CaptureFixture[str]) -> None:
    # the default --lengths uniform:1:N refused it as "uniform HI must be below 2**63 - 1",
    # a flag the user never gave
    assert main(["plan", "--model", "llama-3.1-8b", "--max-model-len", str(10**23)]) == 2
    assert capsys.readouterr().err == (
        "kvpool plan: error: --max-model-len 100,000,000,000,000,000,000,000 is beyond any context: "
        "at most 9,223,372,036,854,775,806 tokens\n"
    )
    # the largest still plans (it does not fit, exit 1)
    assert main(["plan", "--model", "llama-3.1-8b", "--max-model-len", str(2**63 - 2), "--json"]) == 1
    assert json.loads(capsys.readouterr().out)["context_len"] == 2**63 - 2


@pytest.mark.parametrize(
    ("lengths", "message"),
    [
        ("fixed:-1", "fixed length must be >= 0, got -1"),
        ("uniform:1:1" + "0" * 30, "uniform HI must be below 2**63 - 1, got 1" + "0" * 30),
        ("zipf:1", "unknown length distribution 'zipf:1'"),
        ("lognormal:1e307:10", "lognormal:1e+307:10 draws lengths beyond a float"),
    ],
)
def test_a_bad_length_distribution_is_named_by_its_flag(
    lengths: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # the sampler's words came without the flag ("kvpool plan: error: fixed length must be >= 0")
    assert main(["plan", "--model", "llama-3.1-8b", "--context", "8192", "--lengths", lengths]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"kvpool plan: error: --lengths: {message}") and err.count("\n") == 1


def test_the_kv_line_says_how_tp_splits_the_heads(capsys: pytest.CaptureFixture[str]) -> None:
    # TP 16 on 8 KV heads said "replicated over TP" beside a rank's 40,960 B, 1/8 of the model's
    def text() -> str:
        return " ".join(capsys.readouterr().out.split())

    argv = ["plan", "--model", "llama-3.1-70b", "--gpu", "b200", "--context", "8192"]
    assert main([*argv, "--num-gpus", "16", "-tp", "16"]) == 0
    out = text()
    assert "│ bf16, 16 tokens (each of 8 KV heads on 2 of 16 ranks) │" in out and "replicated" not in out
    assert "│ KV bytes / token (per GPU) │ 40,960.0 B │" in out
    assert main([*argv, "--num-gpus", "8", "-tp", "8"]) == 0  # one head a rank: nothing to say
    assert "│ KV format, block size │ bf16, 16 tokens │" in text()
    # a latent is on every rank
    assert main(["plan", "--model", "deepseek-v3", "--gpu", "h200", "-tp", "8", "--context", "8192"]) == 0
    assert "│ bf16, 64 tokens (replicated over TP) │" in text()


@pytest.mark.parametrize("kv_dtype", ["bf16", "fp32"])
def test_an_indexer_format_a_plain_v4_cache_does_not_take_is_refused(
    kv_dtype: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # a bf16 / fp32 V4 cache keeps its keys in its dtype: --indexer-format mxfp4 was dropped
    # without a word (6,880 B a token with bf16, mxfp4 or fp8 keys alike)
    argv = ["plan", "--model", "deepseek-v4-flash", "--gpu", "h200", "-tp", "4", "--context", "65536"]
    assert main([*argv, "--kv-cache-dtype", kv_dtype, "--indexer-format", "mxfp4"]) == 2
    assert capsys.readouterr().err == (
        f"kvpool plan: error: --indexer-format mxfp4: a {kv_dtype} DeepSeek-V4 cache (--kv-cache-dtype {kv_dtype}) "
        f"keeps its indexer keys in {kv_dtype}; the key formats are its fp8 layout's\n"
    )
    from kvpool.capacity.kv import kv_layout
    from kvpool.spec.models import load_preset

    with pytest.raises(ValueError, match="indexer format 'mxfp4': a bf16 DeepSeek-V4 cache keeps its indexer keys"):
        kv_layout(load_preset("deepseek-v4-flash"), "bf16", indexer_format="mxfp4")
    # the fp8 layout takes it: 21 CSA layers of (584 + 68) B entries and keys a 4 tokens, 20 HCA of 584 a 128
    assert _json(capsys, *argv[1:], "--indexer-format", "mxfp4")["kv_bytes_per_token"] == 3514.25
    assert (
        _json(capsys, *argv[1:], "--kv-cache-dtype", kv_dtype)["kv_bytes_per_token"]
        == {"bf16": 6880, "fp32": 13760}[kv_dtype]
    )


def test_an_indexer_format_that_is_the_v4_caches_own_dtype_is_taken(capsys: pytest.CaptureFixture[str]) -> None:
    # review 9: bf16 keys in a bf16 cache is what that layout does anyway; it was refused
    # in words telling the user the keys are in bf16
    argv = ["--model", "deepseek-v4-flash", "--gpu", "h200", "-tp", "4", "--context", "65536"]
    plain = _json(capsys, *argv, "--kv-cache-dtype", "bf16")
    assert _json(capsys, *argv, "--kv-cache-dtype", "bf16", "--indexer-format", "bf16") == plain
    assert plain["kv_bytes_per_token"] == 6880
    from kvpool.capacity.kv import kv_layout
    from kvpool.spec.models import load_preset

    model = load_preset("deepseek-v4-flash")
    assert kv_layout(model, "bf16", indexer_format="bf16") == kv_layout(model, "bf16")
    with pytest.raises(ValueError, match="indexer format 'bf16': a fp32 DeepSeek-V4 cache keeps its indexer keys"):
        kv_layout(model, "fp32", indexer_format="bf16")  # (fp32 keys: bf16 disagrees)


def test_a_configs_positions_past_int64_ask_for_a_context(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # the default context (max_position_embeddings) fed the default --lengths uniform:1:N:
    # "uniform HI must be below 2**63 - 1", naming neither the key nor a flag
    path = tmp_path / "config.json"
    path.write_text(json.dumps(load_preset_config("llama-3.1-8b") | {"max_position_embeddings": 10**19}))
    assert main(["plan", "--config", str(path)]) == 2
    assert capsys.readouterr().err == (
        "kvpool plan: error: "
        f"{tmp_path.name}'s max_position_embeddings 10,000,000,000,000,000,000 is beyond any context "
        "(at most 9,223,372,036,854,775,806 tokens); give --max-model-len\n"
    )
    assert main(["plan", "--config", str(path), "--max-model-len", "8192"]) == 0


def test_lengths_are_checked_up_front_without_building_the_planners_sample(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # review 9 #5: the check drew 100,000 lengths as a list (0.5 s for a lognormal's) only to
    # check them; the plan then drew its own. Now check_lengths checks the same draws in numpy
    from kvpool.capacity import fragmentation, planner

    built: list[int] = []

    def recorded(distribution: str, num_seqs: int, seed: int = 0) -> list[int]:
        built.append(num_seqs)
        return real(distribution, num_seqs, seed)

    real = fragmentation.sample_lengths
    monkeypatch.setattr(fragmentation, "sample_lengths", recorded)
    monkeypatch.setattr(planner, "sample_lengths", recorded)
    argv = ["--model", "llama-3.1-8b", "--context", "8192", "--concurrency", "8", "--lengths", "lognormal:2000:1"]
    assert _json(capsys, *argv)["fragmentation"]["num_seqs"] == 8
    assert built == [8]  # the plan's own draw, alone


def test_lengths_past_the_context_are_refused_or_left_out_not_measured(capsys: pytest.CaptureFixture[str]) -> None:
    # `--lengths fixed:100000` at --context 4096 printed "measured 0 slots" for requests an
    # engine refuses. A bounded distribution past the context is refused; a lognormal's tail
    # (no bound) has its draws past it left out and counted, the plan measured on the rest
    base = ["--model", "llama-3.1-8b", "--gpu", "h100", "--context", "4096"]
    for lengths in ("fixed:100000", "uniform:1:8192"):
        drawn = sample_lengths(lengths, 124, 0)  # the plan's draws (124: the pool's requests at 4,096)
        past = sum(n > 4096 for n in drawn)
        assert past > 0
        assert main(["plan", *base, "--lengths", lengths]) == 2
        assert capsys.readouterr().err == (
            f"kvpool plan: error: length distribution (--lengths) {lengths} draws requests past the context of "
            f"4,096 tokens ({past} of the 124 drawn, the longest {max(drawn):,}); draw lengths within it\n"
        )
    frag = _json(capsys, *base, "--lengths", "lognormal:500:1.2")["fragmentation"]
    drawn = sample_lengths("lognormal:500:1.2", 124, 0)
    kept = [n for n in drawn if n <= 4096]
    assert frag["lengths_past_context"] == 124 - len(kept) == 4 and frag["num_seqs"] == len(kept)
    assert frag["measured_slots"] == sum(-n % 16 for n in kept)  # each kept request's tail, by hand
    assert main(["plan", *base, "--lengths", "lognormal:500:1.2"]) == 0
    row = [line.split("│")[1:3] for line in capsys.readouterr().out.splitlines() if "left out" in line]
    assert [[cell.strip() for cell in cells] for cells in row] == [["draws past the context, left out", "4"]]
    assert main(["plan", *base, "--lengths", "lognormal:1000000:0.1"]) == 2  # every draw past it
    assert "(124 of the 124 drawn" in capsys.readouterr().err
    for lengths in ("uniform:1:4096", "fixed:4096"):  # exactly the context: measured, nothing left out
        frag = _json(capsys, *base, "--lengths", lengths)["fragmentation"]
        assert frag["num_seqs"] == 124 and frag["lengths_past_context"] == 0


@pytest.mark.parametrize("num_gpus", [1, 2])
def test_more_requests_than_the_pool_holds_at_one_token_are_refused(capsys, num_gpus) -> None:
    """--concurrency past the requests a pool holds at --max-model-len asks the context they
    can each hold (docs/planner.md's first plan: 16 requests of 1M do not fit, of 429,823 tokens
    do); past what it holds at one token each, there is none: that printed "max context at N
    requests: 0 tokens" with status 0. It is refused, naming the most the pool holds."""
    argv = ["--model", "llama-3.1-8b", "--gpu", "H100", "--num-gpus", str(num_gpus), "--tp", "1", "--context", "32768"]
    out = _json(capsys, *argv)
    one_block = out["block_size"] * out["kv_bytes_per_token_per_gpu"]  # a request of one token: a block
    per_gpu = int(out["kv_pool_bytes_per_gpu"] // one_block)
    most = per_gpu * num_gpus  # TP 1: a replica a GPU
    assert _json(capsys, *argv, "--concurrency", str(most))["max_context_len"] == out["block_size"]
    assert main(["plan", *argv, "--concurrency", str(most + 1)]) == 2
    replicas = "1 replica" if num_gpus == 1 else f"{num_gpus} replicas"
    assert capsys.readouterr().err == (
        f"kvpool plan: error: --concurrency {most + 1:,} does not fit the KV pool at any context: its "
        f"{out['kv_pool_bytes_per_gpu'] / 2**30:,.2f} GiB per GPU hold at most {per_gpu:,} requests of one token "
        f"({int(one_block):,} B each: a block of every group), {most:,} over {replicas}; ask for {most:,} or fewer\n"
    )


def test_a_model_whose_weights_leave_no_pool_is_told_so(capsys: pytest.CaptureFixture[str]) -> None:
    # Llama-3.1-70B's weights alone, 70,553,706,496 x 2 B = 131.42 GiB, pass one H100's 81,559 MiB
    # (79.65 GiB): the plan said "the KV pool cannot hold one request at this context", and a
    # shorter context cannot help. The ledger's other terms: weights 131.42 GiB + workspace,
    # graph, allocator and transient lines + block tables (no pool) = the total it prints.
    assert main(["plan", "--model", "llama-3.1-70b", "--gpu", "h100", "--context", "8192"]) == 1
    out = capsys.readouterr().out
    assert "cannot hold one request" not in out
    assert (
        "does not fit: the ledger without a KV pool is 135.69 GiB, more than its capacity, 79.65 GiB "
        "(its largest term: weights, 131.42 GiB): no context fits"
    ) in " ".join(out.split())
    # a ledger filled by another term names that one: 10**6 running requests' copy-on-write
    # reserve, a block each of 16 x 131,072 B, is 2,097,152,000,000 B = 1,953.12 GiB of transient
    # (beside 955.58 GiB of fp32 sampler rows, 2 x 10**6 x 128,256 x 4 B, in the workspace)
    argv = ["plan", "--model", "llama-3.1-8b", "--gpu", "h100", "--context", "8192", "--max-num-seqs", "1000000"]
    assert main(argv) == 1
    assert "(its largest term: transient, 1,953.12 GiB)" in " ".join(capsys.readouterr().out.split())
    # the same for a P/D side whose GPUs the weights fill
    argv = ["plan", "--model", "llama-3.1-70b", "-tp", "8", "--context", "8192", "--pd", "1,8"]
    assert main(argv) == 1
    out = " ".join(capsys.readouterr().out.split())
    assert "does not fit: the prefill instance (1 GPU) has no room for a KV pool: the rest of its ledger" in out


def test_the_title_names_the_gpus_size_and_the_planned_share(capsys: pytest.CaptureFixture[str]) -> None:
    # An H100 is 81,559 MiB = 79.65 GiB; at --gpu-memory-utilization 0.9 the plan has
    # int(85,520,809,984 x 0.9) = 76,968,728,985 B = 71.68 GiB, which the title called the H100's size
    argv = ["plan", "--model", "llama-3.1-8b", "--gpu", "h100", "--context", "8192"]
    assert main([*argv, "--gpu-memory-utilization", "0.9"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "llama-3.1-8b on 1 x H100 (79.6 GiB, 90 % planned: 71.7 GiB), TP 1" in out
    assert main(argv) == 0  # the whole GPU: as before
    assert "llama-3.1-8b on 1 x H100 (79.6 GiB), TP 1" in " ".join(capsys.readouterr().out.split())
