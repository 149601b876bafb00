"""The docs say what the code does: every Python example in docs/core_api.md runs and prints
the output shown under it; every signature it writes inline is the code's (tests/doc_signatures.py);
the planner page's `kvpool plan` tables are what the command
prints today; and the site builds with `mkdocs build --strict` (no dangling link or anchor)."""

from __future__ import annotations

import json
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


# Figures the pages' prose quotes from `kvpool plan` (deterministic: no machine in them): the
# page, the plan's flags, and the sentence as it must read, formatted from the plan's --json.
PLAN_FIGURES = [
    (
        "hybrid.md",
        "--model gemma-2-9b --max-model-len 32768",
        "`kvpool plan --model gemma-2-9b --max-model-len 32768 --json` gives {kv_bytes_at_context:,.0f} B =",
    ),
    (
        "distributed.md",
        "--model smollm2-135m --tensor-parallel-size 3 --kv-cache-dtype fp32",
        "({kv_bytes_per_token_per_gpu:,.0f} B a token against {kv_bytes_per_token:,.0f} on one process",
    ),
    (
        "deepseek_v4.md",
        "--model deepseek-v4-flash --gpu H200 --num-gpus 2 --tensor-parallel-size 2 --max-model-len 131072 "
        "--hisparse-fraction 0.1",
        "a token takes {hisparse[kv_bytes_per_token_hisparse]:,.1f} B of device memory instead of "
        "{hisparse[kv_bytes_per_token_resident]:,.1f} ({hisparse[host_bytes_per_token]:,.1f} B in host memory), and "
        "each TP-2 replica's pool holds {hisparse[pool_tokens_hisparse]:,} tokens instead of "
        "{hisparse[pool_tokens_resident]:,} ({hisparse[token_gain]:.2f}x)",
    ),
    (
        "deepseek_v4.md",
        "--model deepseek-v4-flash --gpu H200 --num-gpus 8 --tensor-parallel-size 2 --max-model-len 131072 "
        "--hisparse-fraction 0.1",
        "four replicas) {hisparse[deployment_tokens_hisparse]:,} instead of {hisparse[deployment_tokens_resident]:,}.",
    ),
    (
        "engine.md",  # the ledger table's predicted column
        "--model smollm2-135m --device cpu",
        "| weights | {ledger_details[weights][model]:,.0f} | "
        "| kv_pool: data | {ledger_details[kv_pool][data]:,.0f} | "
        "| kv_pool: quant_scales | {ledger_details[kv_pool][quant_scales]:,.0f} | "
        "| kv_pool: block_tables | {ledger_details[kv_pool][block_tables]:,.0f} (bound) | "
        "| kv_pool: bookkeeping | {ledger_details[kv_pool][bookkeeping]:,.0f} (bound) | "
        "| workspace: activations | {ledger_details[workspace][activations]:,.0f} | "
        "| workspace: logits | {ledger_details[workspace][logits]:,.0f} | "
        "| workspace: sampler | {ledger_details[workspace][sampler]:,.0f} (bound) | "
        "| transient: cow_staging | {ledger_details[transient][cow_staging]:,.0f} (bound) | "
        "| transient: chunked_prefill | {ledger_details[transient][chunked_prefill]:,.0f} (bound) | "
        "| runtime: interpreter and libraries | {ledger_details[runtime][interpreter_and_libraries]:,.0f} (assumed) | "
        "| runtime: tokenizer | {ledger_details[runtime][tokenizer]:,.0f} (assumed) | "
        "| **sum of the terms** | **{ledger[total]:,.0f}** |",
    ),
]


def _rows_and_prose(text: str) -> str:
    """The page with its lines joined by spaces and a table row cut after its first two cells,
    so that a sentence wrapped over lines, or a table's first columns, read as one string."""
    lines = []
    for line in text.splitlines():
        if line.startswith("|"):
            line = "|".join(line.split("|")[:3]) + "|"
        lines.append(line)
    return " ".join(" ".join(lines).split())


@pytest.mark.parametrize("page,flags,sentence", PLAN_FIGURES, ids=[f"{p}:{f.split()[1]}" for p, f, _ in PLAN_FIGURES])
def test_the_plan_figures_the_pages_quote_are_what_it_prints(page, flags, sentence, capsys):
    from kvpool.cli.main import main

    assert main(["plan", *shlex.split(flags), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    expected = " ".join(sentence.format(**report).split())
    assert expected in _rows_and_prose((DOCS / page).read_text()), f"docs/{page} should say: {expected}"


# the `kvpool run --json` samples the pages show: (page, the sample's model, the flags of a run of it)
RUN_SAMPLES = [
    ("engine.md", "SmolLM2-135M-Instruct.Q4_1.gguf", []),
    ("deepseek_v4.md", "tiny-dsv4", ["--model", "tiny-dsv4"]),
]


@pytest.mark.parametrize("page, model, flags", RUN_SAMPLES, ids=["smollm2", "tiny-dsv4"])
def test_the_run_json_samples_have_the_keys_a_run_prints(page, model, flags, capsys):
    """The pages' `kvpool run --json` samples lacked keys the report had gained (max_model_len,
    num_context_ended, context_ended, and older ones): each sample has a short run's keys, in
    its order (the SmolLM2 page leaves out the memory ledger, saying so)."""
    import torch

    from kvpool.cli.main import main

    blocks = fenced_blocks((DOCS / page).read_text())
    samples = [json.loads(body) for lang, body, _ in blocks if lang == "json" and body.startswith('{"model": ')]
    (sample,) = [s for s in samples if s["model"] == model]
    short = "--num-requests 1 --turns 1 --num-long 0 --max-tokens 1 --request-rate inf --threads 1 --json".split()
    threads = torch.get_num_threads()
    try:
        assert main(["run", *flags, *short]) == 0
    finally:
        torch.set_num_threads(threads)
    report = json.loads(capsys.readouterr().out)
    assert report["model"] == model
    assert list(sample) == [key for key in report if key != "memory" or "memory" in sample]
