"""`kvpool bench gpu`: kvpool on a CUDA GPU (kvpool/bench/gpu.py says what each part
measures). Without CUDA every part runs on the CPU at small shapes, in seconds."""

from __future__ import annotations

import argparse

from kvpool.bench.gpu import DTYPES, PARTS, measure
from kvpool.cli.args import comma_choices, positive_int
from kvpool.cli.bench import call_with_flags, print_table, printed_json, stderr_progress
from kvpool.cli.options import ENFORCE_EAGER, add_option, add_planner_model_option

# flag -> (its default, the parts that read it): a flag set away from its default for parts
# that do not read it is refused (`--parts host --model llama-3.1-70b` ran the host part's
# stand-in and printed figures that looked like the 70B's)
READ_BY: dict[str, tuple[object, tuple[str, ...]]] = {
    "model": (None, ("engine", "prefill")),
    "dtype": ("bf16", ("attention", "engine", "prefill")),
    "batch": (128, ("host",)),
    "context": (1024, ("host",)),
    "enforce_eager": (False, ("engine",)),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--parts",
        type=comma_choices(PARTS),
        default=",".join(PARTS),
        help=f"comma list of parts to run, from {','.join(PARTS)} (without CUDA: on the CPU at small shapes)",
    )
    add_planner_model_option(
        parser,
        default=None,
        note=": the engine and prefill parts', with seeded random weights (default: llama-3.1-8b on CUDA, "
        "a 2-layer model on the CPU)",
    )
    parser.add_argument(
        "--dtype",
        choices=tuple(DTYPES),
        default=READ_BY["dtype"][0],
        help="the attention, engine and prefill parts' dtype",
    )
    parser.add_argument("--batch", type=positive_int, default=READ_BY["batch"][0], help="the host part's decode batch")
    parser.add_argument(
        "--context", type=positive_int, default=READ_BY["context"][0], help="the host part's context per request"
    )
    add_option(parser, ENFORCE_EAGER, default=READ_BY["enforce_eager"][0], note="the engine part's decode steps")


def check_flags_are_read(args: argparse.Namespace) -> None:
    """A ValueError naming a flag set for parts that none of `args.parts` runs."""
    for name, (default, readers) in READ_BY.items():
        if getattr(args, name) != default and not set(readers) & set(args.parts):
            flag = "--" + name.replace("_", "-")
            raise ValueError(
                f"{flag} is read by the {' and '.join(readers)} part{'s' if len(readers) > 1 else ''} only, "
                f"and --parts {','.join(args.parts)} runs none of them"
            )


def run(args: argparse.Namespace) -> int:
    check_flags_are_read(args)
    if args.model is not None:  # before the parts run: the host and attention parts went first (seconds
        if not args.model.strip():  # to minutes), and "" ran the default model without a word
            raise ValueError(f"--model: an empty name ({args.model!r}); give a preset or a config.json")
        from kvpool.bench.gpu_engine import model_config

        model_config(args.model, "cpu")  # (read and checked as the engine and prefill parts read it)
    report = call_with_flags(measure, args, progress=stderr_progress("bench gpu"))
    if printed_json(args, report):
        return 0
    rows = []
    for part, section in report.items():
        if isinstance(section, dict):
            rows += [(part, key, str(value)) for key, value in section.items()]
        elif isinstance(section, list):
            for i, entry in enumerate(section):
                rows += [(f"{part}[{i}]", key, str(value)) for key, value in entry.items()]
    print_table(f"kvpool bench gpu ({report['device']}, {report['dtype']})", ("part", "metric", "value"), rows, 2)
    return 0
