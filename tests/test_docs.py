"""The docs say what the code does: every Python example in docs/core_api.md runs and prints
the output shown under it; every signature it writes inline is the code's (tests/doc_signatures.py);
the planner page's `kvpool plan` tables are what the command
prints today; and the site builds with `mkdocs build --strict` (no dangling link or anchor)."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys

import pytest

from doc_blocks import ROOT, env, fenced_blocks
from doc_signatures import page_mismatches

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


def _core_api_owners() -> dict[str, list]:
    """The classes whose methods each section of core_api.md writes bare (`admit(...)`)."""
    from kvpool.cache import HybridCacheManager
    from kvpool.cache.coordinator import RequestPart
    from kvpool.engine.runner import ModelRunner
    from kvpool.models.llama import LlamaModel
    from kvpool.pool import BlockPool

    return {
        "The pool": [BlockPool],
        "The cache-manager contract (`CacheManager`, cache/coordinator.py)": [HybridCacheManager],
        "The managers": [HybridCacheManager],
        "The coordinator and its groups (cache/coordinator.py, cache/group.py)": [HybridCacheManager, RequestPart],
        "The model runner (kvpool.engine.runner)": [ModelRunner],
        "Attention backends and the engine builder (kvpool.attention.backends, kvpool.engine.build)": [LlamaModel],
    }


# calls the page writes that are prose, not kvpool's API: `min(max_new_tokens, ...)`, a
# backend class called as `backend(...)`, a step's `attend(layer, q, k, v)` closure, a spec's
# `build` (three classes)
NOT_API = {"min", "backend", "attend", "spec.build"}


def test_every_signature_core_api_writes_is_the_codes():
    page = (DOCS / "core_api.md").read_text()
    problems, checked = page_mismatches(page, _core_api_owners(), NOT_API)
    assert not problems, "docs/core_api.md:\n" + "\n".join(problems)
    # the page's constructors and the coordinator's and runner's calls were all looked at
    for name in ["ModelRunner", "HybridCacheManager", "FullAttentionManager", "DSV4CacheManager", "dsv4_runner"]:
        assert name in checked, name
    assert {"admit", "reserve_step", "commit_step", "release", "build_engine", "select_backend"} <= set(checked)


@pytest.mark.parametrize(
    "written,planted,found",
    [
        # an argument the code does not take (the page said this of ModelRunner until 2026-12-05)
        ("restore_cost=None, swa=None)`", "dual=False, restore_cost=None, swa=None)`", "no parameter 'dual'"),
        # a constructor's argument left out without `...`
        ("restore_cost=None, swa=None)`", "restore_cost=None)`", "leaves out ['swa']"),
        # a default that is not the code's
        ('preemption="recompute"', 'preemption="swap"', "'preemption' defaults to 'recompute', not \"swap\""),
        # a field of a returned named tuple that it does not have
        ("-> StepTables(slots, csr)", "-> StepTables(slots, table)", "no parameter 'table'"),
        # a method its class does not have
        ("`num_reserved_tokens(id)`", "`num_reservd_tokens(id)`", "names nothing in kvpool"),
    ],
)
def test_the_signature_check_catches_a_wrong_signature(written, planted, found):
    page = (DOCS / "core_api.md").read_text()
    assert page.count(written) == 1
    problems, _ = page_mismatches(page.replace(written, planted), _core_api_owners(), NOT_API)
    assert problems and found in problems[0], problems
    assert len({problem.split(":")[0] for problem in problems}) == 1, problems  # the planted line alone


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
