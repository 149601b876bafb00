"""kvpool's shared options as a serving engineer meets them: vLLM's names with the former
ones still parsed alike, one-line errors, --version, help that shows every default as a
value, and docs/options.md equal to what the parsers say."""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from kvpool.cli.args import HelpFormatter, parse_bytes
from kvpool.cli.main import build_parser, command_parsers, main, subcommands
from kvpool.cli.options import engine_model, options_table

ROOT = Path(__file__).resolve().parents[1]
SRC = str(ROOT / "src")
# a value each shared option's type takes, and what the parser must make of it (by hand)
SAMPLES = {
    "max_num_seqs": ("7", 7),
    "max_num_batched_tokens": ("300", 300),
    "max_model_len": ("4096", 4096),
    "kv_dtype": ("int8", "int8"),
    "tp": ("3", 3),
    "block_size": ("32", 32),
    "gpu_memory_utilization": ("0.5", 0.5),
    "dtype": ("bfloat16", "bf16"),  # vLLM's spelling of kvpool's bf16
    "device": ("cpu", "cpu"),
}
# positionals a command needs before its options parse
POSITIONALS = {"generate": ["hi"]}


def _kvpool(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvpool", *argv],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": SRC},
    )


PARSER = build_parser()  # (argparse parsers parse any number of times)


def _parse(command: str, argv: list[str]) -> argparse.Namespace:
    return PARSER.parse_args([*command.split(), *POSITIONALS.get(command, []), *argv])


def test_every_alias_parses_as_the_vllm_name() -> None:
    checked = 0
    for command, parser in command_parsers(PARSER):
        for action in parser._actions:
            option = getattr(action, "shared", None)  # (an option add_option added)
            if option is None or option.dest not in SAMPLES and option.kind != "switch":
                continue
            if option.kind == "switch":  # --no-enable-prefix-caching and the former --no-prefix-caching: off
                dest = option.dest
                assert getattr(_parse(command, []), dest) is action.default, command
                assert getattr(_parse(command, [option.name]), dest) is True, (command, option.name)
                for flag in (f"--no-{option.name[2:]}", *option.aliases):
                    assert getattr(_parse(command, [flag]), dest) is False, (command, flag)
                checked += 1
                continue
            text, expected = SAMPLES[option.dest]
            for flag in action.option_strings:  # vLLM's name, a short form, the former names
                got = getattr(_parse(command, [flag, text]), option.dest)
                got = got[0] if isinstance(got, tuple) else got  # (simulate's comma lists)
                assert got == expected, (command, flag, got)
                checked += 1
    # run and serve take all four engine names; plan and simulate the planner's
    assert checked >= 46, checked


def test_a_bad_flag_or_value_is_one_line_and_status_2(capsys: pytest.CaptureFixture[str]) -> None:
    positive = "expected a positive integer, got 0"
    for argv, line in (
        (["run", "--max-num-seqs", "0"], f"kvpool run: error: argument --max-num-seqs: {positive}"),
        (["run", "--max-seqs", "0"], f"kvpool run: error: argument --max-seqs: {positive}"),  # the name typed
        (["serve", "-tp", "2"], "kvpool serve: error: unrecognized arguments: -tp 2"),
        (["run", "--max-nun-seqs", "4"], "kvpool run: error: unrecognized arguments: --max-nun-seqs 4; did you mean "),
        # an option typed after "--" (a value there): "did you mean --max-tokens?" named the option typed
        (
            ["generate", "--", "-hi", "--max-tokens", "3"],
            "kvpool generate: error: unrecognized arguments: --max-tokens 3 (--max-tokens comes after '--', where "
            "every word is a value: give the options before '--')\n",
        ),
        (["bench", "engine", "--block-size", "x"], "kvpool bench engine: error: argument --block-size: expected a"),
        (["run", "--kv-memory", "12X"], "kvpool run: error: argument --kv-memory: expected a size such as 256MiB"),
        (["plan", "--gpu-memory-utilization", "1.5"], "kvpool plan: error: argument --gpu-memory-utilization: "),
        (["generate", "hi", "--model", "llama-3.1-8b"], "kvpool generate: error: argument --model: 'llama-3.1-8b' is"),
        (["verify", "pd", "--decode-tp", "0"], f"kvpool verify pd: error: argument --decode-tp: {positive}"),
        # 2**63 was refused after the model loaded, naming no flag ("seed must be a 64-bit signed integer");
        # -1 is a seed like any other, as SamplingParams takes it (test_generate_cli)
        (
            ["generate", "hi", "--seed", str(2**63)],
            "kvpool generate: error: argument --seed: expected a 64-bit signed integer, in [-2**63, 2**63)",
        ),
        # getaddrinfo's "Name or service not known" for ''
        (["serve", "--host", ""], "kvpool serve: error: argument --host: an empty address (''); give 127.0.0.1"),
        (["serve", "--host", " "], "kvpool serve: error: argument --host: an empty address (' '); give 127.0.0.1"),
    ):
        with pytest.raises(SystemExit) as exit_info:
            main(argv)
        err = capsys.readouterr().err
        assert exit_info.value.code == 2, (argv, err)
        assert err.count("\n") == 1 and err.startswith(line), (argv, err)
    # as a process: stderr is that one line (no usage block), stdout empty
    for argv, line in (
        (["simulate", "--max-num-batched-tokens", "-5"], "kvpool simulate: error: argument --max-num-batched-tokens:"),
        ([], "kvpool: error: the following arguments are required: command"),
    ):
        proc = _kvpool(*argv)
        assert proc.returncode == 2, (argv, proc.stderr)
        assert proc.stderr.count("\n") == 1 and proc.stderr.startswith(line), (argv, proc.stderr)
        assert proc.stdout == ""


def test_version_is_the_projects() -> None:
    proc = _kvpool("--version")
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert (proc.returncode, proc.stdout) == (0, f"kvpool {version}\n")


def _all_parsers(parser: argparse.ArgumentParser, name: str = "kvpool"):
    yield name, parser
    for sub_name, sub in subcommands(parser).items():
        yield from _all_parsers(sub, f"{name} {sub_name}")


def test_help_shows_every_default_as_a_value(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every option that takes a value says its default: as a value (never a Python tuple
    or None), or in its own words where the default depends on the model or other flags."""
    monkeypatch.setenv("COLUMNS", "250")
    missing = []
    for name, parser in _all_parsers(build_parser()):
        formatter = HelpFormatter(parser.prog)
        for action in parser._actions:
            if action.help == argparse.SUPPRESS or action.nargs == 0 or action.dest == "help":
                continue
            if isinstance(action, argparse._SubParsersAction) or not action.option_strings and action.required:
                continue
            shown = formatter._expand_help(action) if action.help else ""
            if "default" not in shown.lower():
                missing.append(f"{name} {'/'.join(action.option_strings) or action.dest}")
        text = parser.format_help()
        assert not re.search(r"default: [(\[]|\(default: None\)|\('|,\)", text), (name, text)
    assert missing == []


def test_the_top_level_help_lists_every_command_and_subcommand() -> None:
    parser = build_parser()
    text = parser.format_help()
    names = list(subcommands(parser))
    assert len(names) >= 9
    for name in names:
        assert f"\n    {name} " in text, name
        for sub_name in subcommands(subcommands(parser)[name]):  # bench's, verify's and eval's
            assert re.search(rf"\b{re.escape(sub_name)}\b", text), (name, sub_name)
    assert "tiers" in text and "pd" in text  # the last bench and the last verify program


def test_docs_options_table_is_the_parsers() -> None:
    """docs/options.md is `python -m kvpool.cli.options`'s output; the table's cells are the
    parsers' defaults (spot-checked by hand: serve's 64 sequences, simulate's 8192 tokens)."""
    table = options_table()
    assert (ROOT / "docs" / "options.md").read_text() == table, "regenerate: python -m kvpool.cli.options"
    header = next(line for line in table.splitlines() if line.startswith("| concept"))
    columns = [c.strip(" `") for c in header.strip("|").split("|")]
    row = next(line for line in table.splitlines() if "`--max-num-seqs`" in line)
    cells = dict(zip(columns, (c.strip(" `") for c in row.strip("|").split("|")), strict=True))
    assert (cells["serve"], cells["run"], cells["simulate"], cells["generate"]) == ("64", "16", "256", "·")
    assert _parse("serve", []).max_num_seqs == 64


def test_sizes_take_the_units_people_type() -> None:
    for text, expected in (
        ("1TiB", 1 << 40),
        ("1T", 1 << 40),
        ("1G", 1 << 30),
        ("1Gi", 1 << 30),
        ("512M", 512 << 20),
        ("1.5GiB", 3 << 29),
        ("64mb", 64_000_000),
        ("2 GB", 2_000_000_000),
        ("64k", 65536),
        ("1000000", 1_000_000),
    ):
        assert parse_bytes(text) == expected, text
    for text in ("12X", "", "-1G", "0", "GiB", "1..5G", "nan", "inf"):
        with pytest.raises(ValueError, match=r"^--kv-memory must be a positive size such as 256MiB"):
            parse_bytes(text)


def test_model_names_resolve_alike(capsys: pytest.CaptureFixture[str]) -> None:
    assert [engine_model(n) for n in ("SmolLM2-135M", "smollm2-135m", "TINY-DSV4")] == [
        "smollm2-135m",
        "smollm2-135m",
        "tiny-dsv4",
    ]
    assert engine_model("/some/model.gguf") == "/some/model.gguf"  # a file: the loader names what is wrong
    # a bare word that is no file is a mistyped name (it was "GGUF file not found: smollm2")
    for typo, near in (
        ("smollm2", " (did you mean smollm2-135m?)"),
        ("tiny-dsv5", " (did you mean tiny-dsv4?)"),
        ("x", ""),
    ):
        with pytest.raises(argparse.ArgumentTypeError) as caught:
            engine_model(typo)
        assert str(caught.value) == (
            f"unknown model {typo!r}{near}: the engine runs smollm2-135m, tiny-dsv4, tiny-gemma2, tiny-recurrent, "
            "a GGUF file (a path ending in .gguf) or an HF model directory (a folder with a config.json)"
        )
    assert engine_model("missing.gguf") == "missing.gguf"  # a file name: the loader says it is not found
    for command in ("generate", "run", "serve", "bench engine", "bench start"):
        assert _parse(command, ["--model", "SmolLM2-135M"]).model == "smollm2-135m", command
    for command in ("plan", "simulate", "bench gpu"):  # the planning commands' presets, in any case
        assert _parse(command, ["--model", "Llama-3.1-8B"]).model == "llama-3.1-8b", command
    # plan and simulate: a preset in any case, a GPU preset in any case
    outputs = []
    for model, gpu in (("llama-3.1-8b", "h200"), ("LLAMA-3.1-8B", "H200")):
        assert main(["plan", "--model", model, "--gpu", gpu, "-tp", "1", "--max-model-len", "8192", "--json"]) == 0
        outputs.append(capsys.readouterr().out)
    assert outputs[0] == outputs[1]


def test_a_model_the_engine_cannot_run_is_told_an_hf_directory_runs(capsys: pytest.CaptureFixture[str]) -> None:
    """The engine's commands take an HF model directory beside a GGUF file, but their errors
    for a mistyped name, a planner preset, a built-in model without a tokenizer (serve) named
    GGUF files alone: a user whose directory's name was mistyped was told only a GGUF runs."""
    hf = "an HF model directory (a folder with a config.json)"
    cases = [
        (["generate", "hi", "--model", "qwen2-dir"], f"a GGUF file (a path ending in .gguf) or {hf}"),
        (
            ["run", "--model", "llama-3.1-8b"],
            f"a Llama-, Qwen2- or Qwen3-architecture GGUF file or {hf} (plan and simulate take",
        ),
        (
            ["serve", "--model", "qwen2-dir"],
            f"this command runs smollm2-135m, a GGUF file (a path ending in .gguf) or {hf}",
        ),
        (
            ["serve", "--model", "tiny-gemma2"],
            "a Llama-, Qwen2- or Qwen3-architecture GGUF file or an HF model directory with a tokenizer.json",
        ),
    ]
    for argv, words in cases:
        try:
            status = main(argv)
        except SystemExit as stop:  # (a bad --model is the parser's error)
            status = stop.code
        assert status == 2, argv
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and words in err, (argv, err)


def test_an_api_key_file_that_is_not_utf8_is_named_as_the_other_text_files_are(tmp_path: Path) -> None:
    """serve's --api-key-file of other bytes said Python's words ("'utf-8' codec can't decode
    byte 0xff in position 0: invalid start byte"); --text, a config.json say "is not UTF-8 text"."""
    from kvpool.cli.serve import api_keys_from

    path = tmp_path / "keys"
    path.write_bytes(b"key-1\n\xff\xfekey-2\n")
    args = argparse.Namespace(api_key=None, api_key_file=str(path))
    with pytest.raises(ValueError) as e:
        api_keys_from(args)
    assert str(e.value) == f"--api-key-file {str(path)!r} is not UTF-8 text (invalid start byte at byte 6)"
    args.api_key_file = str(tmp_path)
    with pytest.raises(ValueError) as e:
        api_keys_from(args)
    assert str(e.value) == f"--api-key-file {str(tmp_path)!r}: Is a directory"


def test_an_api_key_file_drops_a_byte_order_mark(tmp_path: Path) -> None:
    """A UTF-8 byte-order mark (Windows editors write one) is no part of the first key: it
    served '\ufeffkey-1' (the client's key-1 refused), and a file of the mark alone the key
    '\ufeff'; a bad byte after the mark is counted from the file's start."""
    from kvpool.cli.serve import api_keys_from

    path = tmp_path / "keys"
    args = argparse.Namespace(api_key=None, api_key_file=str(path))
    path.write_bytes(b"\xef\xbb\xbfkey-1\nkey-2:team\n")
    assert api_keys_from(args) == {"key-1": None, "key-2": "team"}
    path.write_bytes(b"\xef\xbb\xbf\n")
    with pytest.raises(ValueError, match="holds no key"):
        api_keys_from(args)
    path.write_bytes(b"\xef\xbb\xbfkey-1\n\xff")
    with pytest.raises(ValueError) as e:
        api_keys_from(args)
    assert str(e.value) == f"--api-key-file {str(path)!r} is not UTF-8 text (invalid start byte at byte 9)"


def test_gpu_memory_utilization_plans_in_that_share(capsys: pytest.CaptureFixture[str]) -> None:
    """Half of an H200 plans exactly as a GPU of half its memory (--memory-gib), an
    independent route to the same capacity."""
    import json

    from kvpool.spec.gpus import get_gpu

    half_gib = int(get_gpu("h200").memory_bytes * 0.5) / (1 << 30)
    plans = []
    for flags in (["--gpu", "H200", "--gpu-memory-utilization", "0.5"], ["--memory-gib", repr(half_gib)]):
        assert main(["plan", "--model", "llama-3.1-8b", *flags, "--max-model-len", "8192", "--json"]) == 0
        plans.append(json.loads(capsys.readouterr().out))
    whole = main(["plan", "--model", "llama-3.1-8b", "--gpu", "h200", "--max-model-len", "8192", "--json"])
    assert whole == 0
    full = json.loads(capsys.readouterr().out)
    assert plans[0]["kv_pool_bytes_per_gpu"] == plans[1]["kv_pool_bytes_per_gpu"] > 0
    assert plans[0]["kv_pool_bytes_per_gpu"] < full["kv_pool_bytes_per_gpu"] - 60 * (1 << 30)
    assert main(["plan", "--model", "llama-3.1-8b", "--device", "cpu", "--gpu-memory-utilization", "0.5"]) == 2
    assert "--gpu-memory-utilization sizes a GPU" in capsys.readouterr().err


def test_run_takes_the_engine_options_by_their_vllm_names(capsys: pytest.CaptureFixture[str]) -> None:
    """--no-enable-prefix-caching and --max-model-len reach kvpool run's engine (tiny-gemma2:
    a first turn is a 300-token system prompt + a 20-token question, 320 tokens; its
    follow-up 300 + 20 + 4 answered + 12 = 336, and 4 more tokens out: 340)."""
    import json

    import torch

    base = "run --json --threads 1 --model tiny-gemma2 --num-requests 2 --turns 2 --num-long 0 --max-tokens 4"
    base += " --request-rate inf --max-num-batched-tokens 2048 --slo-ttft-ms 1e9 --slo-tpot-ms 1e9"
    threads = torch.get_num_threads()
    try:
        reports = []
        for flag in ("--enable-prefix-caching", "--no-enable-prefix-caching"):
            assert main([*base.split(), flag, "--max-model-len", "340"]) == 0
            reports.append(json.loads(capsys.readouterr().out))
        assert main([*base.split(), "--max-model-len", "320"]) == 2  # the first turn leaves no room to answer
        assert "at most 319 tokens fit (max_model_len 320" in capsys.readouterr().err
        assert main([*base.split(), "--max-model-len", "100000000"]) == 2
        err = capsys.readouterr().err
    finally:
        torch.set_num_threads(threads)
    on, off = reports
    assert on["num_generated_tokens"] == off["num_generated_tokens"] == 2 * 2 * 4
    assert on["prefix_hit_tokens"] > 0 and off["prefix_hit_tokens"] == 0  # the follow-ups hit their history
    # the model's 4,096 positions bound it (its 16 MiB pool holds 16,384 tokens of one sequence)
    from kvpool.models.tiny_hybrid import TINY_GEMMA2

    most = TINY_GEMMA2["max_position_embeddings"]
    assert err.splitlines()[-1].startswith(
        f"kvpool run: error: --max-model-len 100000000: this model and KV pool hold at most {most} tokens a request"
    )
