"""`kvpool bench hisparse`: DeepSeek-V4 HiSparse on the tiny V4 model: device bytes of the
CSA main entries against keeping them resident, and what a decode step fetches.

For each --context: one request's prompt of that many random tokens is prefilled, then
--steps decode steps run, with every --hot-set size and with HiSparse off. Printed per
context and hot set: the CSA main bytes the device keeps (the hot set, against the whole
pool when resident), the entries and bytes a decode step fetched from the host copy on
average, and the mean decode step time. The outputs are compared with HiSparse off: they
must be equal bit for bit (the command fails otherwise).
"""

from __future__ import annotations

import argparse
import json
import random
import time

from kvpool.cli.args import positive_int


def _sizes(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers, got {text!r}") from None
    if not values or min(values) <= 0:
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers, got {text!r}")
    return values


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--context", type=_sizes, default=(4096, 32768), help="prompt lengths (comma list)")
    parser.add_argument("--hot-set", type=_sizes, default=(8, 64, 512), help="hot-set sizes in CSA entries")
    parser.add_argument("--steps", type=positive_int, default=32, help="decode steps timed per run")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")


def _run(model, prompt: list[int], steps: int, hot: int | None):
    from kvpool.engine.dsv4_runner import DSV4EngineRunner
    from kvpool.engine.engine import Engine
    from kvpool.engine.sampling import SamplingParams

    span = model.spec.span
    num_blocks = -(-(len(prompt) + steps + 1) // span) + 1
    runner = DSV4EngineRunner(model, num_blocks, 1, hot_set_entries=hot)
    engine = Engine(runner, max_num_batched_tokens=2048, max_num_seqs=1, record_logits=True)
    rid = engine.add_request(prompt, SamplingParams(max_tokens=steps + 1, ignore_eos=True))
    while engine.requests[rid].first_token_time is None:
        engine.step()  # the prefill
    before = (runner.tier_reports().get("hisparse") or {}).get("entries_fetched", 0), _bytes(runner)
    start = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    step_ms = (time.perf_counter() - start) * 1e3 / steps
    report = runner.tier_reports().get("hisparse")
    logits = engine.requests[rid].seqs[0].logits
    out = {"decode_step_ms": round(step_ms, 2)}
    csa = [cl for cl in runner.runner.pools.classical if cl.main is not None and cl.idx is not None]
    resident = sum(cl.main.numel() * cl.main.element_size() for cl in csa)
    if report is None:
        out["csa_main_device_bytes"] = resident
    else:
        out |= {
            "csa_main_device_bytes": report["hot_set_bytes"],
            "csa_main_host_bytes": report["csa_main_bytes_on_host"],
            "fetched_entries_per_decode_step": round((report["entries_fetched"] - before[0]) / steps, 2),
            "fetched_bytes_per_decode_step": round((_bytes(runner) - before[1]) / steps, 1),
        }
    return out, logits


def _bytes(runner) -> int:
    report = runner.tier_reports().get("hisparse")
    return 0 if report is None else int(report["bytes_fetched"])


def run(args: argparse.Namespace) -> int:
    import torch

    from kvpool.models.tiny_dsv4 import TinyDSV4

    model = TinyDSV4(seed=args.seed)
    rng = random.Random(args.seed)
    rows = []
    for context in args.context:
        prompt = [rng.randrange(model.vocab_size) for _ in range(context)]
        off, want = _run(model, prompt, args.steps, None)
        rows.append({"context": context, "hot_set": None, **off})
        for hot in args.hot_set:
            num_entries = (-(-(context + args.steps + 1) // model.spec.span) + 1) * model.spec.span // 4
            if hot > num_entries:
                continue  # larger than the pool: nothing to offload
            got, logits = _run(model, prompt, args.steps, hot)
            if len(logits) != len(want) or not all(torch.equal(a, b) for a, b in zip(logits, want, strict=True)):
                raise RuntimeError(f"HiSparse with a hot set of {hot} changed the outputs at context {context}")
            rows.append({"context": context, "hot_set": hot, **got})
    if args.json:
        print(json.dumps({"steps": args.steps, "rows": rows}))
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"kvpool bench hisparse: tiny-dsv4, {args.steps} decode steps after the prompt")
    columns = ("context", "hot set", "CSA main on device", "fetched / step", "bytes / step", "step (ms)")
    for column in columns:
        table.add_column(column, justify="right")
    for row in rows:
        table.add_row(
            f"{row['context']:,}",
            "off (resident)" if row["hot_set"] is None else f"{row['hot_set']:,}",
            f"{row['csa_main_device_bytes'] / 2**10:,.1f} KiB",
            str(row.get("fetched_entries_per_decode_step", "")),
            str(row.get("fetched_bytes_per_decode_step", "")),
            str(row["decode_step_ms"]),
        )
    Console().print(table)
    return 0
