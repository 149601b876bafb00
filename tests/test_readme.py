"""Every command of the README, run as a user runs it (this checkout's src/ first on the
path): the quick start's commands and Python example, whose shown output (or excerpt) must
appear in what they print; the main job; the venv line in a temporary directory; the test
command, whose parts must be what .ci/run runs. The headline table links each figure to the
docs section with its command (the benchmarks take minutes each); those commands are
parsed by the CLI's own parser, so a renamed flag fails here.
The main job (its arrivals span ~13 s) runs beside the others."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys

import pytest

from doc_blocks import ROOT, as_run_here, assert_excerpt, env, fenced_blocks

README = (ROOT / "README.md").read_text()


BASH = [(body.strip(), out) for lang, body, out in fenced_blocks(README) if lang == "bash"]
PYTHON = [(body, out) for lang, body, out in fenced_blocks(README) if lang == "python"]
MAIN_JOB = "bash setup.sh && python3 -m kvpool run"
TEST_COMMAND = (
    "bash setup.sh test && python3 -m ruff check . && python3 -m ruff format --check . "
    "&& python3 -m pytest -q -n 2 --dist loadfile"
)
VENV = "python3 -m venv .venv && . .venv/bin/activate"
QUICK_START = [(cmd, out) for cmd, out in BASH if cmd not in (MAIN_JOB, TEST_COMMAND, VENV)]


@pytest.fixture(scope="module")
def main_job():
    """`python3 -m kvpool run` (setup.sh has run: CI's `bash setup.sh test` is a superset),
    started first so that its arrivals run beside the other commands."""
    # no shell between: a kill at teardown (a test failed first) reaches the run itself
    argv = shlex.split(as_run_here(MAIN_JOB.removeprefix("bash setup.sh && ")))
    proc = subprocess.Popen(argv, cwd=ROOT, env=env(), text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    yield proc
    if proc.poll() is None:
        proc.kill()
        proc.communicate()


def test_the_readme_has_what_this_test_runs():
    commands = [cmd for cmd, _ in BASH]
    assert MAIN_JOB in commands and TEST_COMMAND in commands and VENV in commands
    assert len(QUICK_START) == 4 and all(out for _, out in QUICK_START)  # four commands, each with its output
    assert len(PYTHON) == 1 and PYTHON[0][1]
    assert len(README.splitlines()) < 250


def test_the_test_command_is_what_ci_runs():
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    for part in TEST_COMMAND.split(" && "):
        assert part in ci, f"the README's test command runs {part!r}; .ci/run does not"


@pytest.mark.parametrize("command,expected", QUICK_START, ids=[c.split()[3] for c, _ in QUICK_START])
def test_quick_start_command(main_job, command, expected):
    done = subprocess.run(as_run_here(command), shell=True, cwd=ROOT, env=env(), capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert_excerpt(expected, done.stdout)


def test_python_quick_start(main_job):
    code, expected = PYTHON[0]
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env(), capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout == expected


def test_the_venv_line(tmp_path):
    done = subprocess.run(
        ["bash", "-c", f"{as_run_here(VENV)} && python3 -c 'import sys; print(sys.prefix)'"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(tmp_path / ".venv")


def test_the_headline_tables_links_and_commands():
    """The headline table links each figure to the docs section that holds its command and
    output (the benchmarks take minutes each: they are not run here); every link lands on a
    heading that exists, and every command of docs/benchmarks.md's table parses with the
    CLI's own parser, so a renamed flag fails here."""
    from markdown.extensions.toc import slugify

    from kvpool.cli.main import build_parser

    table = README[README.index("## Headline figures") : README.index("## Documentation")]
    assert "python3 -m kvpool" not in table  # every README command is one this file runs
    links = re.findall(r"\]\((docs/[^)#]+)(?:#([^)]+))?\)", table)
    assert len(links) >= 8
    for page, anchor in links:
        text = (ROOT / page).read_text()
        assert text, page
        if anchor:
            slugs = {slugify(h, "-") for h in re.findall(r"^#+ (.+)$", text, re.M)}
            assert anchor in slugs, f"{page}#{anchor}: no such heading"
    bench = (ROOT / "docs" / "benchmarks.md").read_text()
    where = bench[bench.index("## Where each benchmark's figures are") :]
    where = where[: where.index("\n## ")]
    commands = [c for c in re.findall(r"`kvpool ([^`]+)`", where)]
    assert len(commands) >= 10
    parser = build_parser()
    for command in commands:
        parser.parse_args(shlex.split(command))  # argparse exits (SystemExit) on an unknown flag


def test_the_main_job(main_job):
    out, err = main_job.communicate(timeout=600)
    assert main_job.returncode == 0, err
    report = out.lower()  # the performance report, as a table of any format
    assert "goodput" in report and "ttft" in report
