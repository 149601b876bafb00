"""`kvpool bench kv-quant`: decode attention over quantized KV blocks against fp32, on the same
path, at serving scale (kvpool/bench/kv_quant.py says what is timed and how)."""

from __future__ import annotations

import argparse

from kvpool.bench.kv_quant import DEFAULT_FORMATS, measure
from kvpool.cli.args import comma_list, kv_dtype, positive_int, torch_seed_int
from kvpool.cli.bench import call_with_flags, print_table, printed_json
from kvpool.cli.options import BLOCK_SIZE, add_option, add_threads_option


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batch", type=positive_int, default=16, help="decode sequences")
    parser.add_argument("--context", type=positive_int, default=4096, help="tokens of each sequence")
    add_option(parser, BLOCK_SIZE, default=16)
    parser.add_argument("--layers", type=positive_int, default=3, help="pools to cycle through")
    parser.add_argument("--repeats", type=positive_int, default=15, help="timed calls per format and path")
    parser.add_argument("--formats", type=comma_list(kv_dtype), default=DEFAULT_FORMATS, help="comma list")
    parser.add_argument("--paths", type=comma_list(str), default=("native", "torch"), help="native,torch")
    add_threads_option(parser)
    parser.add_argument("--seed", type=torch_seed_int, default=0, help="seed of the random K, V and queries")


def run(args: argparse.Namespace) -> int:
    report = call_with_flags(measure, args)
    if printed_json(args, report):
        return 0
    from rich.console import Console

    heads, kvh, d, bs = report["heads"], report["kv_heads"], report["head_dim"], report["block_size"]
    title = (
        f"decode attention, one layer-step: batch {args.batch} x {args.context} tokens, "
        f"{heads} heads / {kvh} KV heads of {d}, blocks of {bs}, {report['threads']} threads"
    )
    columns = ["format", "MB read"]
    for path in args.paths:
        columns += (f"{path} ms", f"{path} GB/s", f"{path} vs fp32")
    rows = []
    for r in report["formats"]:
        cells = [r["format"], f"{r['bytes_per_layer_step'] / 1e6:,.1f}"]
        for path in args.paths:
            ms, speedup = r.get(f"{path}_ms"), r.get(f"{path}_speedup_vs_fp32")
            # no speed-up without fp32 measured on the path (--formats without fp32): "-", not 1.00x
            cells += (
                [f"{ms:.2f}", f"{r[f'{path}_gb_s']:.1f}", "-" if speedup is None else f"{speedup:.2f}x"]
                if ms is not None
                else ["-", "-", "-"]
            )
        rows.append(cells)
    print_table(title, columns, rows, num_left=1, console=Console(width=max(120, Console().width)))
    return 0
