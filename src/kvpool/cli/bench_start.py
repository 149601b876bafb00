"""`kvpool bench start`: how long `kvpool generate PROMPT` takes from a cold process to its
first token, with the load phase apart (kvpool/bench/start.py says what is timed and how)."""

from __future__ import annotations

import argparse

from kvpool.bench.start import measure
from kvpool.cli.args import positive_int
from kvpool.cli.bench import call_with_flags, print_table, printed_json, stderr_progress
from kvpool.cli.generate import _prompt as generate_prompt  # (generate's own check, before the first start)
from kvpool.cli.options import add_engine_model_option, gguf_path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--runs", type=positive_int, default=5, help="warm starts to time")
    parser.add_argument("--prompt", type=generate_prompt, default="hi", help="the prompt of each start")
    add_engine_model_option(parser)


def run(args: argparse.Namespace) -> int:
    report = call_with_flags(measure, args, model=gguf_path(args.model), progress=stderr_progress("bench start"))
    if printed_json(args, report):
        return 0
    ft = report["first_token_s"]
    rows = [
        (f"first token, warm weight cache (median of {args.runs})", f"{ft['median']:.3f}"),
        ("  min .. max", f"{ft['min']:.3f} .. {ft['max']:.3f}"),
        ("  load phase (generate --json: load_s)", f"{report['load_s_warm']:.3f}"),
        ("  process exit", f"{report['exit_s_median']:.3f}"),
        ("first token, no weight cache (the GGUF path)", f"{report['no_cache_first_token_s']:.3f}"),
        ("  load phase", f"{report['no_cache_load_s']:.3f}"),
        (f"first run's load ({report['first_run_load_source']})", f"{report['first_run_load_s']:.3f}"),
        ("floor: a process that imports torch", f"{report['import_torch_s_median']:.3f}"),
    ]
    title = f"kvpool generate {args.prompt!r} --max-tokens 1, from a cold process"
    print_table(title, ("measure", "seconds"), rows, num_left=1)
    return 0
