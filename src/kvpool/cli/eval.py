"""`kvpool eval kv-quant`: what each KV storage format costs in quality on SmolLM2-135M
(kvpool.verify.kv_quant) in the serving path: the engine prefills the text's first
--prefill tokens in one step, then decodes the rest one token a step, teacher-forced, over
paged blocks in the format. Reported: the mean KL divergence against the same steps over
fp32 blocks (the primary figure), the top-1 agreement, the perplexity change with its 95 %
interval (a block bootstrap over the scored positions: formats whose intervals overlap
are not ranked by it), greedy agreement, per-layer K, V and attention-output error, and
each format's bytes per token and capacity gain.

The text: the Python Language Reference's topic pages that CPython ships as
`pydoc_data.topics` (every installation has them; PSF License), in sorted topic order,
plain text, the first --tokens tokens; or --text FILE.
"""

from __future__ import annotations

import argparse
import math
import os
import sys

from kvpool.cli.args import (
    KV_DTYPES,
    HelpFormatter,
    add_plot_file_argument,
    check_plot_path,
    comma_list,
    kv_dtype,
    positive_int,
)
from kvpool.cli.bench import call_with_flags, print_table, printed_json
from kvpool.cli.options import (
    BLOCK_SIZE,
    add_engine_model_option,
    add_option,
    add_threads_option,
    gguf_path,
    set_torch_threads,
    start_torch_threads,
)

_FORMATS = tuple(f for f in KV_DTYPES if f != "fp32")
# the flags of the SmolLM2 evaluation alone, at their defaults (tiny-dsv4 evaluates its own
# layouts on random ids): given with --model tiny-dsv4, each was dropped without a word
_SMOLLM_ONLY: dict[str, object] = {"formats": _FORMATS, "block_size": 128, "prefill": 128, "greedy_prompt": 200}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="eval", required=True)
    p = sub.add_parser(
        "kv-quant",
        help="quality of each KV storage format on SmolLM2: per-layer error, perplexity, KL, top-1 agreement",
        description=__doc__,
        formatter_class=HelpFormatter,
    )
    p.add_argument(
        "--formats",
        type=comma_list(kv_dtype),
        default=",".join(_FORMATS),
        help="comma list of formats (KIVI's may name G and R: kivi2-g16-r64)",
    )
    add_option(p, BLOCK_SIZE, default=_SMOLLM_ONLY["block_size"], note="KIVI's R=128 must divide it")
    p.add_argument("--tokens", type=positive_int, default=512, help="tokens of the text (prefill + decoded)")
    p.add_argument(
        "--prefill",
        type=positive_int,
        default=_SMOLLM_ONLY["prefill"],
        help="tokens prefilled in one step; the rest are decoded, scored",
    )
    p.add_argument(
        "--greedy-steps", type=int, default=64, help="tokens each format decodes greedily through the engine (0: skip)"
    )
    p.add_argument(
        "--greedy-prompt",
        type=positive_int,
        default=_SMOLLM_ONLY["greedy_prompt"],
        help="the prompt of the greedy run: the text's first tokens",
    )
    p.add_argument("--text", default=None, metavar="FILE", help="a UTF-8 text file (default: the built-in text)")
    add_engine_model_option(p, note="; or tiny-dsv4 (its fp8 layout against fp32)")
    add_threads_option(p, probed=True)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    add_plot_file_argument(p, "per-layer error and the quality-vs-bytes frontier (default: no plot)")
    p.set_defaults(_name="eval kv-quant")


def _check_distinct_formats(formats: tuple[str, ...]) -> None:
    """One name a format: bf16,bf16 (or kivi2 and kivi2-g32-r128, its defaults spelled out)
    evaluated the format twice and printed two rows of it."""
    from kvpool.spec.kv_formats import kv_schema

    seen: dict[str, str] = {}
    for name in formats:
        schema_id = kv_schema(name).schema_id
        if schema_id in seen:
            both = repr(name) if seen[schema_id] == name else f"{seen[schema_id]!r} and {name!r}"
            raise ValueError(f"--formats names one format twice: {both}")
        seen[schema_id] = name


def run(args: argparse.Namespace) -> int:

    from kvpool.engine.build import load_model
    from kvpool.verify.kv_quant import quality_report, reference_text

    if args.plot is not None:
        check_plot_path(args.plot)
    if args.greedy_steps < 0:
        raise ValueError(f"--greedy-steps must be >= 0, got {args.greedy_steps}")
    _check_distinct_formats(args.formats)
    probe = start_torch_threads(args)
    if args.model == "tiny-dsv4":
        set_torch_threads(args, probe)
        return _run_v4(args)
    text, source = reference_text(args.text)
    loaded = load_model(gguf_path(args.model), device="cpu")
    set_torch_threads(args, probe)
    done = 0

    def progress(name: str) -> None:
        nonlocal done
        done += 1
        print(f"kvpool eval kv-quant: {name} ({done}/{len(args.formats) + 1})", file=sys.stderr, flush=True)

    def notice(text: str) -> None:
        print(f"kvpool eval kv-quant: {text}", file=sys.stderr, flush=True)

    # formats, tokens, prefill, block_size, greedy_steps, greedy_prompt: the flags of those names
    given = {"text": text, "source": source, "progress": progress, "notice": notice}
    report = call_with_flags(quality_report, args, loaded=loaded, **given)
    if args.plot:
        _plot(report, args.plot)
    if not printed_json(args, report):
        _print(report)
    return 0


def _print(report: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    regime = report["regime"]
    title = f"KV formats on {report['model']}: {report['tokens']} tokens of {report['text'].split(' (')[0]}"
    title += (
        f"; served: {regime['prefill_tokens']} prefilled in one step, {regime['decode_steps']} decode steps, "
        f"{regime['scored_positions']} positions scored; fp32 perplexity {report['fp32_perplexity']:.3f}"
    )
    caption = f"[...]: {report['bootstrap']}; overlapping intervals rank nothing"
    caption += (
        f"\nlargest |K| or |V| of the text: {report['kv_max_abs']:,.1f}; fp16 saturates values past "
        f"+-{report['fp16_max']:,.0f} (bf16 and the scaled formats keep fp32's range)"
    )
    table = Table(title=title, caption=caption)
    columns = (
        "format",
        "B/token",
        "x tokens/GiB",
        "KL [95 %]",
        "top-1",
        "perplexity",
        "change [95 %]",
        "greedy",
        "worst layer out err",
    )
    for column in columns:
        table.add_column(column, justify="right")
    for r in report["formats"]:
        worst = max(layer["out_rel"] for layer in r["layers"])
        lo, hi = r["perplexity_change_ci95"] or (math.nan, math.nan)
        kl_lo, kl_hi = r["kl_ci95"] or (math.nan, math.nan)
        table.add_row(
            r["name"],
            f"{r['bytes_per_token']:,.1f}",
            f"{r['capacity_gain']:.2f}",
            f"{r['kl_mean']:.2e} [{kl_lo:.1e}, {kl_hi:.1e}]",
            f"{100 * r['top1_agreement']:.1f} %",
            f"{r['perplexity']:.3f}",
            f"{r['perplexity_change_pct']:+.2f} % [{lo:+.2f}, {hi:+.2f}]",
            "-" if r["greedy_agreement"] is None else f"{100 * r['greedy_agreement']:.0f} %",
            f"{worst:.2e}",
        )
    Console(width=max(160, Console().width)).print(table)


def _plot(report: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from kvpool.sim.plots import save_figure

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for r in report["formats"]:
        left.plot([layer["out_rel"] for layer in r["layers"]], marker=".", label=r["name"])
    left.set_yscale("log")
    left.set(xlabel="layer", ylabel="attention output, relative error", title="per layer, on exact inputs")
    left.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0.0)  # covers no line
    left.grid(alpha=0.3)
    for r in report["formats"]:
        right.scatter(r["bytes_per_token"], max(r["kl_mean"], 1e-12))
        right.annotate(r["name"], (r["bytes_per_token"], max(r["kl_mean"], 1e-12)), fontsize=8)
    right.set_yscale("log")
    right.set(xlabel="KV bytes per token", ylabel="mean KL(fp32 || format)", title="quality against bytes")
    right.grid(alpha=0.3)
    fig.suptitle(f"{report['model']}, {report['tokens']} tokens")
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    save_figure(fig, path)


def _run_v4(args: argparse.Namespace) -> int:
    """tiny-dsv4: its classical pool exact and in DeepSeek-V4's fp8 layout (verify/kv_quant.py
    evaluate_v4): bytes, teacher-forced KL and top-1, greedy agreement."""
    from kvpool.verify.kv_quant import quality_report_v4

    if args.plot or args.text:
        raise ValueError("--model tiny-dsv4 takes random token ids: --plot and --text are for SmolLM2")
    given = [name for name, default in _SMOLLM_ONLY.items() if getattr(args, name) != default]
    if given:
        flag = "--" + given[0].replace("_", "-")
        raise ValueError(f"--model tiny-dsv4 evaluates its own fp8 layouts: {flag} is for SmolLM2")
    if args.greedy_steps == 0:  # (it ran 32 steps: every figure of tiny-dsv4's is over its steps)
        raise ValueError("--model tiny-dsv4 measures every figure over --greedy-steps tokens: give 1 or more")
    steps = args.greedy_steps

    def progress(name: str) -> None:
        print(f"kvpool eval kv-quant: tiny-dsv4, {name}", file=sys.stderr, flush=True)

    report = quality_report_v4(args.tokens, steps, progress)
    if printed_json(args, report):
        return 0
    from rich.console import Console

    rows = [
        (
            r["name"],
            f"{r['classical_block_bytes']:,}",
            f"{r['classical_bytes_per_token']:.1f}",
            f"{r['capacity_gain']:.2f}",
            f"{r['kl_mean']:.2e}",
            f"{100 * r['top1_agreement']:.0f} %",
            f"{100 * r['greedy_agreement']:.0f} %",
            "-" if r["greedy_first_divergence"] is None else str(r["greedy_first_divergence"]),
        )
        for r in report["layouts"]
    ]
    print_table(
        f"tiny-dsv4 classical pool layouts: a {args.tokens}-token prompt, {steps} steps",
        ("layout", "B/block", "B/token", "x tokens", "KL", "top-1", "greedy", "first diff"),
        rows,
        console=Console(width=max(120, Console().width)),
    )
    return 0
