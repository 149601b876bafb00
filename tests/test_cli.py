"""The `kvpool` command line as a user meets it."""

from __future__ import annotations


def test_cli_reports_a_callers_mistake_in_one_line(capsys):
    from kvpool.cli.main import main

    assert main(["generate", "hi", "--model", "/nonexistent/model.gguf"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvpool generate: error: ") and "/nonexistent/model.gguf" in err
    assert "Traceback" not in err
