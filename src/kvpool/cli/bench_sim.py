"""`kvpool bench sim`: the simulator's `cpu` preset (and a fit made now) against the engine,
on kvpool run's first turns (kvpool/bench/sim.py says what runs and what is compared).
Exits 1, with one line, when the engine's step times fit no cost model (a busy machine)."""

from __future__ import annotations

import argparse
import sys

from kvpool.bench.sim import TIMES, FitFailed, first_turns, measure
from kvpool.cli.args import non_negative_int, positive_float, positive_int
from kvpool.cli.bench import call_with_flags, print_table, printed_json, stderr_progress


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--requests", type=positive_int, default=24, help="first turns (kvpool run's default: 24)")
    # (non-negative as kvpool run's: -3 long prompts ran none, and random.Random(-1) is Random(1))
    parser.add_argument("--num-long", type=non_negative_int, default=2, help="long prompts (kvpool run's default: 2)")
    parser.add_argument("--max-tokens", type=positive_int, default=24, help="new tokens per answer, at most")
    parser.add_argument("--rate", type=positive_float, default=2.0, help="arrivals per second (Poisson)")
    parser.add_argument("--seed", type=non_negative_int, default=0, help="seed of the workload")


def run(args: argparse.Namespace) -> int:
    from kvpool.engine.build import load_model

    progress = stderr_progress("bench sim")
    progress("loading SmolLM2-135M")
    loaded = load_model(device="cpu")
    workload = call_with_flags(first_turns, args, loaded=loaded)
    try:
        result = measure(loaded, workload, args.seed, progress)
    except FitFailed as error:  # a busy machine: one line, no traceback
        print(f"kvpool bench sim: {error}", file=sys.stderr)
        return 1
    report = {"requests": args.requests, "max_tokens": args.max_tokens, "rate": args.rate} | result
    if printed_json(args, report):
        return 0
    from rich.console import Console

    measured, preset, fitted = report["measured"], report["predicted_preset"], report["predicted_fit"]
    console = Console()
    columns = ("metric", "engine (measured)", "preset defaults", "/ measured", "fitted now", "/ measured")
    rows = [
        (
            key,
            str(measured[key]),
            str(preset[key]),
            str(report["preset_over_measured"].get(key, "")),
            str(fitted[key]),
            str(report["fit_over_measured"].get(key, "")),
        )
        for key in measured
    ]
    title = f"kvpool bench sim: {args.requests} chat requests on SmolLM2-135M, engine vs cpu cost model"
    print_table(title, columns, rows, console=console)
    fit = report["fit"]  # the step times and the fitted figures, flat
    ms = {k: f"{fit[k] * 1e3:.1f}" for k in (*TIMES, "step_overhead_s", "seq_overhead_s")}
    console.print(
        f"fitted on the engine's own steps, the mean of before and after the run: decodes of 1 and {fit['batch']} "
        f"sequences {ms['decode_1_s']} and {ms['decode_b_s']} ms, fresh prefills of {fit['prefill_tokens']} and "
        f"{fit['prefill_small_tokens']} tokens {ms['prefill_s']} and {ms['prefill_small_s']} ms -> compute "
        f"{fit['compute_efficiency']:.3f}, bandwidth {fit['bandwidth_efficiency']:.3f}, {ms['step_overhead_s']} ms a "
        f"step + {ms['seq_overhead_s']} ms a sequence + {fit['prefill_chunk_overhead_s'] * 1e3:.1f} ms a prefill chunk"
    )
    return 0
