"""The first mistakes of a newcomer who runs vLLM or SGLang: a mistyped command or choice, a
command typed without its subcommand, a Hugging Face id given as --model. Each is one line,
status 2, and names what was meant where that is plain."""

from __future__ import annotations

import pytest

from kvpool.cli.main import build_parser, command_parsers, main, subcommands
from kvpool.spec.models import PRESET_NAMES, model_by_name


def _error(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    """The one error line of `kvpool ARGV` (a parse error: SystemExit 2; a run error: status 2)."""
    try:
        code = main(argv)
    except SystemExit as stop:
        code = stop.code
    err = capsys.readouterr().err
    assert code == 2, (argv, err)
    assert err.count("\n") == 1 and "Traceback" not in err, (argv, err)
    return err.rstrip("\n")


@pytest.mark.parametrize(
    ("argv", "meant"),
    [
        (["genrate", "hi"], "generate"),
        (["bench", "engin"], "engine"),
        (["cache", "lss", "/tmp"], "ls"),
        (["verify", "hybird"], "hybrid"),
        (["simulate", "sweeep"], "sweep"),
        (["simulate", "--workload", "chatt"], "chat"),
        (["generate", "hi", "--device", "CUDA"], "cuda"),
        # closest in spelling is cpu; a newcomer who types gpu means cuda
        (["generate", "hi", "--device", "gpu"], "cuda"),
    ],
)
def test_a_mistyped_choice_names_the_one_meant(capsys, argv, meant):
    line = _error(capsys, argv)
    assert "invalid choice: " in line and line.endswith(f"; did you mean {meant}?"), line


def test_a_choice_near_none_gets_no_guess(capsys):
    line = _error(capsys, ["frobnicate"])
    assert "invalid choice: 'frobnicate' (choose from bench, cache," in line and "did you mean" not in line


@pytest.mark.parametrize("command", ["bench", "eval", "verify"])
def test_a_command_without_its_subcommand_lists_them(capsys, command):
    """`kvpool bench` said "the following arguments are required: bench", naming no benchmark."""
    parser = subcommands(build_parser())[command]
    names = ", ".join(next(a.choices for a in parser._actions if not a.option_strings and a.choices))
    line = _error(capsys, [command])
    assert line.startswith(f"kvpool {command}: error: the following arguments are required: "), line
    assert line.endswith(f" (one of {names})"), line


def test_no_command_lists_the_commands_and_several_missing_are_each_named(capsys):
    commands = ", ".join(subcommands(build_parser()))
    assert _error(capsys, []) == f"kvpool: error: the following arguments are required: command (one of {commands})"
    assert _error(capsys, ["cache"]) == (
        "kvpool cache: error: the following arguments are required: action, DIR (action: one of ls, stats, clear)"
    )


@pytest.mark.parametrize(
    ("name", "meant"),
    [
        ("meta-llama/Llama-3.1-8B-Instruct", "llama-3.1-8b"),  # vLLM's --model
        ("Qwen/Qwen3-8B", "qwen3-8b"),
        ("deepseek-ai/DeepSeek-V3.2-Exp", "deepseek-v3.2"),  # the longest preset it begins with
        ("llama3.1-8b", "llama-3.1-8b"),
        ("gemma2-9b", "gemma-2-9b"),
        ("llama-2-7b", None),  # other numbers: another model, no typo (difflib's pick was llama-3.1-70b)
        ("mistral-7b", None),
    ],
)
def test_a_planner_model_near_a_preset_names_it(name, meant):
    with pytest.raises(ValueError) as raised:
        model_by_name(name)
    message = str(raised.value)
    assert message.startswith(f"--model: unknown model {name!r}"), message
    assert ("did you mean" in message) == (meant is not None), message
    if meant is not None:
        assert meant in PRESET_NAMES and f"(did you mean {meant}?)" in message
    assert "nothing is downloaded" in message


def test_a_missing_config_file_is_named_as_missing(capsys, tmp_path):
    """It read "not a config.json path, and an unknown model preset" for a config.json path."""
    path = tmp_path / "nope" / "config.json"
    line = _error(capsys, ["plan", "--model", str(path), "--gpu", "H100"])
    assert line == f"kvpool plan: error: --model: config file {str(path)!r} does not exist"


def test_plan_on_a_gpu_without_a_preset_says_how(capsys):
    line = _error(capsys, ["plan", "--model", "llama-3.1-8b", "--gpu", "a100"])
    assert line.startswith("kvpool plan: error: --gpu: unknown GPU 'a100'; known: B200, H100, H200; ")
    assert "--memory-gib" in line
    assert main(["plan", "--model", "llama-3.1-8b", "--memory-gib", "80"]) == 0  # the way it names
    capsys.readouterr()


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_an_engine_model_given_as_a_hugging_face_id(capsys, command):
    """vLLM's `--model HuggingFaceTB/SmolLM2-135M-Instruct` read "GGUF file not found"."""
    argv = [command, "--model", "HuggingFaceTB/SmolLM2-135M-Instruct"] + (["hi"] if command == "generate" else [])
    line = _error(capsys, argv)
    assert line.startswith(
        f"kvpool {command}: error: argument --model: unknown model 'HuggingFaceTB/SmolLM2-135M-Instruct' "
        "(did you mean smollm2-135m?)"
    )
    assert line.endswith("; no file or folder of that name, and a Hugging Face id is not downloaded"), line
    # a path is still a path: the loader names the missing file
    assert _error(capsys, ["generate", "hi", "--model", "models/x.gguf"]) == (
        "kvpool generate: error: GGUF file not found: models/x.gguf"
    )


def test_a_missing_config_json_of_run_is_named_by_its_loader(capsys):
    """run takes a config.json as --model: "models/config.json", shaped like a Hugging Face id,
    is a missing file, not a model name."""
    assert main(["run", "--model", "models/config.json"]) == 2
    err = capsys.readouterr().err
    assert err.splitlines()[-1] == "kvpool run: error: models/config.json: no such config.json", err


def test_the_commands_page_quotes_these_hints(capsys):
    """docs/commands.md's two examples of a hint are what the commands print."""
    from doc_blocks import ROOT

    page = " ".join((ROOT / "docs" / "commands.md").read_text().split())
    for argv, hint in (
        (["genrate"], "did you mean generate?"),
        (["plan", "--model", "meta-llama/Llama-3.1-8B-Instruct"], "did you mean llama-3.1-8b?"),
    ):
        assert hint in _error(capsys, argv)
        assert argv[-1] in page and f'"{hint}"' in page, argv


@pytest.mark.parametrize(
    ("argv", "tail"),
    [
        # run's --request-rate is simulate's --rate: its value was read as simulate's mode
        # ("argument mode: invalid choice: '10'"), and spelling alone guessed --requests
        (["simulate", "--request-rate", "10"], "--request-rate 10; did you mean --rate?"),
        (["simulate", "--request-rate=10"], "--request-rate=10; did you mean --rate?"),
        (["generate", "hi", "--max-new-tokens", "5"], "--max-new-tokens 5; did you mean --max-tokens?"),
        # vLLM's flags that serve lacks: "did you mean --dtype?" and "--trust-tenant-header?" were guesses
        (["serve", "--trust-remote-code"], "--trust-remote-code"),
    ],
)
def test_an_unknown_option_is_guessed_only_when_close(capsys, argv, tail):
    line = _error(capsys, argv)
    assert line == f"kvpool {argv[0]}: error: unrecognized arguments: {tail}", line


@pytest.mark.parametrize("flag", ["-tp", "--tensor-parallel-size", "--gpu-memory-utilization"])
def test_an_option_of_other_commands_names_them(capsys, flag):
    has = [name for name, sub in command_parsers(build_parser()) if flag in sub._option_string_actions]
    assert has and "serve" not in has
    line = _error(capsys, ["serve", flag, "2"])
    assert line.startswith(f"kvpool serve: error: unrecognized arguments: {flag} 2 ({flag} is an option of "), line
    assert "did you mean" not in line and all(name in line for name in has) and "not of serve)" in line, line
    # vLLM sizes the pool by a share of the GPU; kvpool serve by a size
    assert line.endswith("; the KV pool's size is --kv-memory SIZE") == (flag == "--gpu-memory-utilization")


@pytest.mark.parametrize(
    ("model", "tail"),
    [
        ("HuggingFaceTB/SmolLM2-135M-Instruct", " (did you mean 'smollm2-135m'?); nothing is downloaded"),
        ("smollm", " (did you mean 'smollm2-135m'?); nothing is downloaded"),
        ("meta-llama/Llama-3.2-1B", "; nothing is downloaded"),
        ("missing.gguf", ""),  # a file meant: it is missing, no more
    ],
)
def test_the_python_apis_model_names_the_embedded_one(model, tail):
    """vLLM's `LLM(model="HuggingFaceTB/SmolLM2-135M-Instruct")` read "is neither
    'smollm2-135m' nor a GGUF file" alone."""
    from kvpool.llm import gguf_path

    with pytest.raises(ValueError) as raised:
        gguf_path(model)
    neither = "neither 'smollm2-135m' nor a GGUF file nor an HF model directory"
    assert str(raised.value) == f"model {model!r} is {neither}{tail}"


def _help(capsys: pytest.CaptureFixture[str], command: str) -> str:
    with pytest.raises(SystemExit) as stop:
        main([command, "--help"])
    assert stop.value.code == 0
    return " ".join(capsys.readouterr().out.split())  # (argparse wraps the help at the terminal's width)


def test_serves_help_names_only_what_serve_takes(capsys):
    """serve's --kv-cache-dtype, --host-cache-gib and --preemption shared generate's help,
    which describes tiny-dsv4 and --indexer-format: serve takes neither."""
    served = _help(capsys, "serve")
    assert "tiny-dsv4" not in served and "--indexer-format" not in served, served
    for told in ("--kv-cache-dtype FORMAT", "kivi2-g16-r64", "fp16 saturates", "needs --host-cache-gib"):
        assert told in served, told
    generated = _help(capsys, "generate")  # the commands that take tiny-dsv4 still say what it does with them
    for told in ("indexer keys by --indexer-format", "tiny-dsv4: its classical blocks", "tiny-dsv4: its spans"):
        assert told in generated, told


def test_serves_unknown_model_lists_only_what_serve_runs(capsys):
    line = _error(capsys, ["serve", "--model", "smollm"])
    assert "did you mean smollm2-135m?" in line and "runs smollm2-135m, a GGUF file" in line, line
    assert "tiny-" not in line, line
    assert "tiny-" not in _error(capsys, ["serve", "--model", "llama-3.1-8b"])  # a planner preset
    # the tiny models are refused by name, and generate, which runs them, lists them
    assert "tiny-gemma2 has no tokenizer" in _error(capsys, ["serve", "--model", "tiny-gemma2"])
    assert "tiny-dsv4, tiny-gemma2, tiny-recurrent" in _error(capsys, ["generate", "hi", "--model", "smollm"])
