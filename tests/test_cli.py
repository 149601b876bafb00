"""The `kvpool` command line as a user meets it."""

from __future__ import annotations

import pytest

from kvpool.cli.main import main


def test_cli_reports_a_callers_mistake_in_one_line(capsys):
    assert main(["generate", "hi", "--model", "/nonexistent/model.gguf"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvpool generate: error: ") and "/nonexistent/model.gguf" in err
    assert "Traceback" not in err
    # a bench's errors name the bench
    assert main(["bench", "engine", "--model", "tiny-dsv4"]) == 2
    assert capsys.readouterr().err.startswith(
        "kvpool bench engine: error: bench engine runs smollm2-135m, a Llama-, Qwen2- or Qwen3-architecture GGUF or "
        "an HF model directory; "
    )


def test_kvpools_own_warning_is_one_line_naming_the_command(monkeypatch, capsys):
    """Without a C compiler the kernels' warning was Python's format: a file path, then a line
    of kvpool's source (`kernels = cpu_kernels() if ...`). A warning another library raises
    keeps Python's format, and the handler is gone once main returns."""
    import warnings

    import kvpool.cli.plan
    from kvpool.kernels import _warn_once

    def run(args):
        _warn_once.__wrapped__("no C compiler found (set CC, or install gcc)")  # (not the cached one)
        warnings.warn_explicit("a library's own", UserWarning, "/elsewhere/lib.py", 7)
        return 0

    monkeypatch.setattr(kvpool.cli.plan, "run", run)
    with warnings.catch_warnings(record=True) as shown:  # (Python's own handler records)
        warnings.simplefilter("always")
        before = warnings.showwarning
        assert main(["plan"]) == 0
        assert warnings.showwarning is before
    assert capsys.readouterr().err.splitlines() == [
        "kvpool plan: warning: kvpool runs the torch path: no C compiler found (set CC, or install gcc)"
    ]
    assert [(str(w.message), w.filename) for w in shown] == [("a library's own", "/elsewhere/lib.py")]


def test_a_tiny_model_a_command_does_not_run_is_named(capsys):
    """tiny-gemma2 and tiny-recurrent (options.md's engine models) run under kvpool run only;
    generate, bench engine and eval kv-quant said "GGUF file not found: tiny-gemma2"."""
    for command in (["generate", "hi"], ["bench", "engine"], ["eval", "kv-quant"]):
        for model in ("tiny-gemma2", "tiny-recurrent"):
            assert main([*command, "--model", model]) == 2
            name = " ".join(command[:2]) if command[0] != "generate" else "generate"
            assert capsys.readouterr().err == (
                f"kvpool {name}: error: --model {model} is a built-in tiny hybrid model with no tokenizer; this "
                "command runs smollm2-135m, a Llama-, Qwen2- or Qwen3-architecture GGUF file or an HF model directory "
                "(a folder with "
                "a config.json) (kvpool run runs tiny-gemma2 and tiny-recurrent)\n"
            )


def test_ctrl_c_is_one_line_and_status_130(monkeypatch, capsys):
    import kvpool.cli.plan

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(kvpool.cli.plan, "run", interrupted)
    assert main(["plan", "--model", "llama-3.1-8b"]) == 130
    assert capsys.readouterr().err == "kvpool plan: interrupted\n"


def test_a_file_that_cannot_be_read_is_one_line_naming_it(monkeypatch, capsys, tmp_path):
    """A PermissionError (or IsADirectoryError) on a file the user named was a
    traceback; only FileNotFoundError was one line. An OSError naming no file still propagates."""
    import kvpool.cli.plan

    config = tmp_path / "config.json"
    config.write_text("{}")
    original = type(config).open

    def locked(path, *args, **kwargs):  # (root reads any file: the call says no, for this one)
        if str(path) == str(config):
            raise PermissionError(13, "Permission denied", str(path))
        return original(path, *args, **kwargs)

    monkeypatch.setattr(type(config), "open", locked)
    assert main(["plan", "--model", str(config)]) == 2
    assert capsys.readouterr().err == f"kvpool plan: error: config file '{config}' cannot be read: Permission denied\n"

    def denied(args):  # a file error no command catches itself: cli/main's one line
        raise PermissionError(13, "Permission denied", str(config))

    monkeypatch.setattr(kvpool.cli.plan, "run", denied)
    assert main(["plan", "--model", "llama-3.1-8b"]) == 2
    assert capsys.readouterr().err == f"kvpool plan: error: [Errno 13] Permission denied: '{config}'\n"

    def no_file(args):
        raise ConnectionResetError(104, "Connection reset by peer")

    monkeypatch.setattr(kvpool.cli.plan, "run", no_file)
    with pytest.raises(ConnectionResetError):
        main(["plan", "--model", "llama-3.1-8b"])


def test_ctrl_c_while_the_commands_load_is_one_line(monkeypatch, capsys):
    """A Ctrl-C in the first half second, while the parser imports the command modules, is
    the same one line as later, not a KeyboardInterrupt traceback."""
    import kvpool.cli.main as cli

    def interrupted():
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "build_parser", interrupted)
    assert main(["simulate"]) == 130
    assert capsys.readouterr().err == "kvpool: interrupted\n"


def test_help_shows_defaults_and_the_models_generate_takes(monkeypatch, capsys):
    monkeypatch.setenv("COLUMNS", "250")  # one line per option: no phrase split by the wrapping
    for argv, shown in (
        (["generate"], ["(default: 128)", "tiny-dsv4", "(default: smollm2-135m)"]),
        (["run"], ["(default: 2.0)", "256MiB for SmolLM2", "tiny-dsv4"]),
        (["plan"], ["(default: 256; cpu: 16)", "(default: h100)", "cpu: kvpool's own engine"]),
        (["bench", "engine"], ["(default: decode,ttft,attention,glue)", "glue"]),
        (["bench", "pool"], ["(default: "]),
    ):
        with pytest.raises(SystemExit) as exit_info:
            main([*argv, "--help"])
        assert exit_info.value.code == 0
        out = capsys.readouterr().out
        assert all(s in out for s in shown), (argv, out)
        assert "(default: None)" not in out and "(default: False)" not in out


def test_a_real_sigint_exits_130_in_one_line():
    # the command sends itself SIGINT, as Ctrl-C would; Python's own handler is set again in
    # case this test runs where SIGINT is ignored (a background job of a script)
    import os
    import subprocess
    import sys
    from pathlib import Path

    import kvpool

    code = (
        "import os, signal, sys, time\n"
        "signal.signal(signal.SIGINT, signal.default_int_handler)\n"
        "import kvpool.cli.plan as plan\n"
        "def run(args):\n"
        "    os.kill(os.getpid(), signal.SIGINT)\n"
        "    time.sleep(30)\n"
        "plan.run = run\n"
        "from kvpool.cli.main import main\n"
        "sys.exit(main(['plan']))\n"
    )
    src = str(Path(kvpool.__file__).resolve().parents[1])
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=25, env={**os.environ, "PYTHONPATH": src}
    )
    assert (proc.returncode, proc.stderr, proc.stdout) == (130, "kvpool plan: interrupted\n", "")


def test_a_bad_model_file_is_named_with_what_is_wrong(tmp_path, capsys):
    from kvpool.models.gguf import default_gguf_path

    folder = tmp_path / "models"
    folder.mkdir()
    (folder / "a.gguf").write_bytes(b"")
    (tmp_path / "hello.gguf").write_bytes(b"hello")
    with open(default_gguf_path(), "rb") as f:
        (tmp_path / "cut.gguf").write_bytes(f.read(2_000_000))  # the header, then the tensor data cut short
    for name, message in (
        ("models", f"{folder} is a directory, not a GGUF file; it holds a.gguf"),
        ("models/a.gguf", f"{folder / 'a.gguf'} is empty, not a GGUF file"),
        ("hello.gguf", f"{tmp_path / 'hello.gguf'} is not a GGUF file: it starts with b'hell', not b'GGUF'"),
        ("cut.gguf", f"GGUF file {tmp_path / 'cut.gguf'} is corrupt or truncated: "),
        ("missing.gguf", f"GGUF file not found: {tmp_path / 'missing.gguf'}"),
    ):
        assert main(["generate", "hi", "--model", str(tmp_path / name)]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"kvpool generate: error: {message}") and err.count("\n") == 1, err


def test_a_reader_that_leaves_early_gets_no_traceback() -> None:
    """`kvpool ... | head`: the pipe closes before the command writes; it stops quietly, with
    the shell's SIGPIPE status (141), plain output and rich's tables alike (rich's Console raised
    SystemExit(1) on the broken pipe: status 1, with no line)."""
    import subprocess
    import sys

    argv = [sys.executable, "-m", "kvpool", "plan", "--model", "llama-3.1-8b", "--gpu", "h200", "--context", "8192"]
    for extra, status in ((["--json"], 141), ([], 141)):
        proc = subprocess.Popen([*argv, *extra], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        proc.stdout.close()  # the reader is gone before the first line
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == status and "Traceback" not in err and "Error" not in err, err
