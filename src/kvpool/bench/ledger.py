"""`kvpool bench ledger`'s measurement: the engine's measured memory ledger next to the planner's
prediction, line by line, with the rule each line is held to.

A fresh `python -m kvpool run --json` process runs a workload that fills the default
configuration (16 prompts at once: 256-token prefill steps, 15 or 16 rows of logits), so
its peak is its own. The prediction is `kvpool plan --model smollm2-135m --device cpu`'s
engine ledger for the same configuration. The engine runs where `kvpool run` runs: on CUDA
when torch sees a GPU (`--device cpu` hides it). On CUDA the peak is
`torch.cuda.max_memory_allocated`, the host-memory lines (bookkeeping, the sampler's
scratch, the runtime) are reported apart and not compared, and the CPU's assumed runtime
does not apply. `ok` is False when a line breaks its rule (the command then exits 1).

The rules (what tests/test_memory_ledger.py asserts on CPU):
  exact     weights, the pool's data and scales, the step buffers: equal to the byte
  bound     block tables, bookkeeping, the sampler, COW staging, chunked prefill:
            0 <= measured <= predicted
  rows      logits: at least 15 of the 16 predicted rows
  assumed   the runtime: within 25 % of its assumption (CPU only)
  peak      unaccounted under 15 % of the peak
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

# the workload: every prompt at once fills the step and the batch
RUN_WORKLOAD = "--json --num-requests 16 --turns 1 --num-long 0 --max-tokens 4 --request-rate inf".split()
EXACT = {("weights", "model"), ("kv_pool", "data"), ("kv_pool", "quant_scales"), ("workspace", "activations")}
BOUND = {
    ("kv_pool", "block_tables"),
    ("kv_pool", "bookkeeping"),
    ("workspace", "sampler"),
    ("transient", "cow_staging"),
    ("transient", "chunked_prefill"),
}
HOST_LINES = {("kv_pool", "bookkeeping"), ("workspace", "sampler"), ("runtime", "interpreter_and_libraries")}
HOST_LINES |= {("runtime", "tokenizer")}
RUNTIME_MARGIN = 0.25
UNACCOUNTED_LIMIT = 0.15
LOGIT_ROWS = 15 / 16


def compare(memory: dict, predicted_details: dict) -> list[dict]:
    """One row per ledger line (and one for the runtime, one for the peak): predicted,
    measured, the rule and whether it holds. `memory` is `kvpool run --json`'s memory
    section; `predicted_details` the engine ledger's details (term -> line -> bytes)."""
    measured = memory["details"]
    cuda = "host" in memory
    rows = []
    for term, lines in predicted_details.items():
        for line, pred in lines.items():
            got = measured[term][line]
            key = (term, line)
            if cuda and key in HOST_LINES:
                rule, ok = "host memory (not compared)", True
                got = memory["host"].get(line, 0)
            elif key in EXACT:
                rule, ok = "exact", got == pred
            elif key in BOUND:
                rule, ok = "bound", 0 <= got <= pred
            elif key == ("workspace", "logits"):
                rule, ok = "rows", LOGIT_ROWS * pred <= got <= pred
            else:
                rule, ok = "assumed", True  # the runtime, compared as a whole below
            rows.append(
                {"term": term, "line": line, "predicted": int(pred), "measured": int(got), "rule": rule, "ok": ok}
            )
    if not cuda:
        pred = sum(predicted_details["runtime"].values())
        got = sum(measured["runtime"].values())
        ok = abs(got - pred) <= RUNTIME_MARGIN * pred
        rows.append(
            {"term": "runtime", "line": "(sum)", "predicted": int(pred), "measured": got, "rule": "±25 %", "ok": ok}
        )
    share = memory["unaccounted"] / memory["peak"] if memory["peak"] else 1.0
    rows.append(
        {
            "term": "peak",
            "line": memory["peak_source"],
            "predicted": int(sum(sum(lines.values()) for lines in predicted_details.values())),
            "measured": memory["peak"],
            "rule": f"unaccounted {share:.1%} < {UNACCOUNTED_LIMIT:.0%}",
            "ok": 0 <= memory["unaccounted"] < UNACCOUNTED_LIMIT * memory["peak"],
        }
    )
    return rows


def measure(device: str = "auto") -> dict:
    """Run the workload in a fresh `kvpool run` process (device "auto": where torch sees a
    GPU, "cpu": with CUDA hidden) and compare its ledger with the planner's: {"ok": every
    rule holds, "load_source": how the run loaded its weights, "rows": compare()'s rows}."""
    from kvpool.capacity.engine import EngineConfig
    from kvpool.capacity.planner import plan
    from kvpool.spec.gpus import cpu_device
    from kvpool.spec.models import load_preset

    if device not in ("auto", "cpu"):
        raise ValueError(f"device must be 'auto' or 'cpu', got {device!r}")
    env = dict(os.environ)
    if device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    proc = subprocess.run(
        [sys.executable, "-m", "kvpool", "run", *RUN_WORKLOAD], capture_output=True, text=True, env=env
    )
    if proc.returncode != 0:
        raise ValueError(f"kvpool run exited {proc.returncode}: {proc.stderr[-500:]}")
    report = json.loads(proc.stdout)
    predicted = plan(load_preset("smollm2-135m"), cpu_device(), engine=EngineConfig()).ledger
    rows = compare(report["memory"], predicted.details)
    return {"ok": all(row["ok"] for row in rows), "load_source": report["load_source"], "rows": rows}
