"""The docs say what the code does: every Python example in docs/core_api.md runs and prints
the output shown under it; the planner page's `kvpool plan` tables are what the command
prints today; and the site builds with `mkdocs build --strict` (no dangling link or anchor)."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys

import pytest

from doc_blocks import ROOT, env, fenced_blocks

DOCS = ROOT / "docs"
CORE_API = fenced_blocks((DOCS / "core_api.md").read_text())
EXAMPLES = [(body, out) for lang, body, out in CORE_API if lang == "python"]


def test_core_api_has_the_two_quick_starts():
    code = "\n".join(body for body, _ in EXAMPLES)
    assert "LLM(" in code and "FullAttentionManager(" in code
    assert sum(out is not None for _, out in EXAMPLES) == 2  # both show what they print


@pytest.mark.parametrize("code,expected", EXAMPLES, ids=[f"example{i}" for i in range(len(EXAMPLES))])
def test_core_api_example_runs_and_prints_what_the_page_shows(code, expected):
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env(), capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    if expected is not None:
        assert done.stdout == expected


def test_the_planner_pages_tables_are_what_kvpool_plan_prints():
    page = (DOCS / "planner.md").read_text()
    shown = re.findall(r"^`(kvpool plan [^`]+)`:\n\n```\n(.*?)```", page, re.S | re.M)
    assert len(shown) == 2
    for command, table in shown:
        argv = [sys.executable, "-m", "kvpool", *shlex.split(command)[1:]]
        done = subprocess.run(argv, cwd=ROOT, env={**env(), "COLUMNS": "200"}, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip() == table.strip(), command


def test_the_site_builds_strict(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet", "--site-dir", str(tmp_path)],
        cwd=ROOT,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "core_api" / "index.html").is_file()
