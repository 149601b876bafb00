"""`kvpool bench host`: TTFT of a cached prefix served from the host tier, against a
device hit and against recomputing it, on SmolLM2-135M.

The prefix is --prefix-len random token ids (block-aligned), followed by a fresh
--suffix-len-token question each repeat (so only the prefix can hit), answered with one
token: TTFT is then the time to the first token of the request, from its arrival.
  - device: a pool large enough to keep the prefix; it was computed once before.
  - host: a pool of prefix + suffix + one filler's worth of blocks, with a host tier;
    before each repeat a filler prompt as long as the pool pushes the prefix out of the
    device pool into the host tier, so the request loads every prefix block.
  - recompute: the same small pool without a tier: the filler evicts the prefix for good.
Printed: TTFT p50 of each case over --repeats, the blocks and bytes the host case loaded
and the time the loads took, and the prefix hit each case got.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics

from kvpool.cli.args import positive_int


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prefix-len", type=positive_int, default=2048, help="tokens of the cached prefix")
    parser.add_argument("--suffix-len", type=positive_int, default=16, help="new tokens after it, each repeat")
    parser.add_argument("--repeats", type=positive_int, default=3, help="requests per case (the median counts)")
    parser.add_argument("--block-size", type=positive_int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")


def _ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(100, 49000) for _ in range(n)]


def _serve(engine, prompt: list[int]):
    from kvpool.engine.sampling import SamplingParams

    rid = engine.add_request(prompt, SamplingParams(max_tokens=1, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    return engine.pop_output(rid)


def run(args: argparse.Namespace) -> int:
    from kvpool.engine.build import build_engine, load_model

    if args.prefix_len % args.block_size:
        raise ValueError(f"--prefix-len {args.prefix_len} is not a multiple of --block-size {args.block_size}")
    loaded = load_model(device="cpu")
    rng = random.Random(args.seed)
    prefix = _ids(rng, args.prefix_len)
    bs = args.block_size
    request_blocks = -(-(args.prefix_len + args.suffix_len + 1) // bs)
    small = request_blocks + 2  # the filler must take the prefix's blocks
    cases: dict[str, dict] = {}
    for name in ("device", "host", "recompute"):
        engine = build_engine(
            loaded,
            num_blocks=4 * request_blocks if name == "device" else small,
            block_size=bs,
            host_cache_bytes=(2 * request_blocks * engine_block_bytes(loaded, bs)) if name == "host" else None,
        )
        _serve(engine, prefix + _ids(rng, args.suffix_len))  # the prefix computed once
        ttfts, cached = [], []
        for _ in range(args.repeats):
            if name != "device":
                _serve(engine, _ids(rng, (small - 1) * bs))  # a filler of the whole pool pushes the prefix out
            out = _serve(engine, prefix + _ids(rng, args.suffix_len))
            ttfts.append(out.ttft_s * 1e3)
            cached.append(out.num_cached_tokens)
        case = {"ttft_ms_p50": round(statistics.median(ttfts), 1), "ttft_ms": [round(t, 1) for t in ttfts]}
        case["cached_tokens"] = cached
        tier = engine.runner.tier_reports().get("host_tier")
        if tier is not None:
            moves = engine.runner.tier_moves
            case |= {
                "blocks_loaded_per_request": moves.num_loaded // args.repeats,
                "bytes_loaded_per_request": tier["num_get_bytes"] // args.repeats,
                "load_ms_per_request": round(moves.load_s * 1e3 / args.repeats, 2),
                "blocks_offloaded": moves.num_offloaded,
                "offload_ms": round(moves.offload_s * 1e3, 1),
            }
        cases[name] = case
    report = {"prefix_len": args.prefix_len, "suffix_len": args.suffix_len, "block_size": bs, "cases": cases}
    if args.json:
        print(json.dumps(report))
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"kvpool bench host: TTFT of a {args.prefix_len}-token prefix + {args.suffix_len} new tokens")
    for column in ("case", "TTFT p50 (ms)", "cached tokens", "loaded per request", "load time (ms)"):
        table.add_column(column, justify="right")
    for name, case in cases.items():
        loaded_text = ""
        if "blocks_loaded_per_request" in case:
            mib = case["bytes_loaded_per_request"] / 2**20
            loaded_text = f"{case['blocks_loaded_per_request']} blocks, {mib:.1f} MiB"
        table.add_row(
            name,
            str(case["ttft_ms_p50"]),
            str(case["cached_tokens"][-1]),
            loaded_text,
            str(case.get("load_ms_per_request", "")),
        )
    Console().print(table)
    return 0


def engine_block_bytes(loaded, block_size: int) -> int:
    """One block's K and V over every layer, in the model's dtype (what the host tier stores)."""
    from kvpool.engine.build import cache_spec_for

    return int(cache_spec_for(loaded, block_size).bytes_per_block)
