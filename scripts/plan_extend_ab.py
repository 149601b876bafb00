#!/usr/bin/env python
"""plan_extend of one tree against another's, paired single calls:
`git show REV:src/kvpool/attention/backends/triton_extend.py > /tmp/old_te.py &&
PYTHONPATH=src python scripts/plan_extend_ab.py /tmp/old_te.py`.

Four plans (the few-sequence path with query rows given, as the step buffers' mixed step;
the numpy path over CSR tables, as TritonPagedBackend's prefill chunks; the numpy path over
dense tables, 48 chunks; the few path without rows, a control the change does not touch),
each called 20,000 times by both versions, one after the other, which goes first
alternating (a loaded machine's drift falls on both); the median of each, 1 thread."""

from __future__ import annotations

import importlib.util
import statistics
import sys
import time

import numpy as np
import torch

from kvpool.attention.backends import triton_extend as new


def main(old_path: str, num_calls: int = 20000) -> None:
    torch.set_num_threads(1)
    spec = importlib.util.spec_from_file_location("kvpool.attention.backends._before", old_path)
    assert spec is not None and spec.loader is not None
    old = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(old)
    flat = torch.zeros(64 * 256, dtype=torch.int32)
    rows48 = list(range(0, 384, 8))
    q4, c4 = [128, 64, 32, 16], [512, 64, 96, 16]
    indptr = np.concatenate([[0], np.cumsum([-(-c // 16) for c in c4])]).tolist()
    cases = [
        ("few path, 2 chunks, q_rows", ([100, 60], [612, 60], [0, 256], flat), {"q_rows": [30, 130], "num_rows": 190}),
        ("numpy CSR, 4 chunks, q_rows", (q4, c4, indptr, list(range(indptr[-1]))), {"q_rows": [8, 136, 200, 232]}),
        ("numpy dense, 48 chunks, q_rows", ([8] * 48, [200] * 48, np.arange(48) * 256, flat), {"q_rows": rows48}),
        ("few path, no q_rows (control)", ([100, 60], [612, 60], [0, 256], flat), {"first_row": 30, "num_rows": 190}),
    ]  # fmt: skip
    clock = time.perf_counter_ns
    for name, tables, kw in cases:
        args = (*tables, 16, 32, 8, "cpu")
        a, b = old.plan_extend, new.plan_extend
        for _ in range(500):  # (warm)
            a(*args, **kw)
            b(*args, **kw)
        before, after = [], []
        for i in range(num_calls):
            first, second, into = (a, b, (before, after)) if i & 1 else (b, a, (after, before))
            t0 = clock()
            first(*args, **kw)
            t1 = clock()
            second(*args, **kw)
            t2 = clock()
            into[0].append(t1 - t0)
            into[1].append(t2 - t1)
        mb, ma = statistics.median(before) / 1e3, statistics.median(after) / 1e3
        print(f"{name:32s} before {mb:6.2f} us  after {ma:6.2f} us  ({(ma / mb - 1) * 100:+.1f} %)")


if __name__ == "__main__":
    main(sys.argv[1])
