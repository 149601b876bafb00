"""`kvpool bench engine`: the engine against transformers, measured side by side in one run:
decode throughput, cached-prefix TTFT, paged against contiguous attention, and what a
batch-1 step is made of (kvpool/bench/engine.py says what each part times and how).
Timings on a shared CPU are noisy: run it on an idle machine for the figures of docs/engine.md.
"""

from __future__ import annotations

import argparse

from kvpool.bench.engine import PARTS, measure
from kvpool.cli.args import comma_choices, positive_int
from kvpool.cli.bench import call_with_flags, print_table, printed_json, stderr_progress
from kvpool.cli.options import BLOCK_SIZE, add_engine_model_option, add_option, add_threads_option, gguf_path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--new-tokens", type=positive_int, default=128, help="new tokens per request in decode")
    add_option(parser, BLOCK_SIZE, default=16, note="the engine's")
    parser.add_argument(
        "--attn-block-size", type=positive_int, default=256, help="block size for the attention comparison"
    )
    parser.add_argument(
        "--attn-context", type=positive_int, default=4096, help="context of each sequence in the attention comparison"
    )
    parser.add_argument("--attn-batch", type=positive_int, default=16, help="sequences in the attention comparison")
    parser.add_argument("--skip-hf", action="store_true", help="skip the transformers side (no ratios for part 1)")
    parser.add_argument(
        "--parts",
        type=comma_choices(PARTS),
        default=",".join(PARTS),
        help=f"comma list of parts to run, from {','.join(PARTS)}",
    )
    add_engine_model_option(parser)
    add_threads_option(parser)


def run(args: argparse.Namespace) -> int:
    report = call_with_flags(measure, args, model=gguf_path(args.model), progress=stderr_progress("bench engine"))
    if printed_json(args, report):
        return 0
    rows = []
    for part in ("decode", "ttft", "attention", "glue"):
        section = report.get(part)
        if not section:
            continue
        flat = {f"{k}.{kk}": vv for k, v in section.items() for kk, vv in v.items()} if part == "decode" else section
        rows += [(part, key, str(value)) for key, value in flat.items()]
    title = f"kvpool bench engine (fp32, {report['threads']} threads, {report['kernels']} kernels)"
    print_table(title, ("part", "metric", "value"), rows, num_left=2)
    return 0
