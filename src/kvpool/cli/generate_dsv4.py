"""`kvpool generate --model tiny-dsv4 --no-chat`: the tiny V4 model through the engine.

The tiny model has no tokenizer: the prompt is token ids ("5,17,42" or "5 17 42"), and the
output is token ids. It runs on the Classical + State dual pool under the same scheduler
and the same ModelRunner as the Llama path (`kvpool.engine.dsv4_runner.dsv4_runner` builds
it). `kvpool.cli.generate` hands over to `run` here when `--model tiny-dsv4`.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time

from kvpool.cli.args import check_span_block_size, host_cache_bytes, v4_kv_format
from kvpool.cli.generate import DSV4_DEFAULT_BLOCKS, GENERATE_BLOCK_SIZE, check_context, length_note, timings
from kvpool.cli.options import set_torch_threads, start_torch_threads

MODEL_NAME = "tiny-dsv4"


def parse_token_ids(text: str, vocab_size: int) -> list[int]:
    """The ids of a prompt such as "5,17,42" or "5 17 42": ASCII decimal integers (int() alone
    took "٣,٤" as 3,4 and "1_0" as 10, a prompt other than the one typed)."""
    parts = [p for p in re.split(r"[,\s]+", text.strip()) if p]
    if not all(re.fullmatch(r"[+-]?[0-9]+", p) for p in parts):
        raise ValueError(f'{MODEL_NAME} takes token ids (e.g. "5,17,42"), got {text!r}')
    ids = [int(p) for p in parts]
    if not ids:
        raise ValueError(f"{MODEL_NAME}: the prompt has no token ids")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"{MODEL_NAME}: token ids must lie in [0, {vocab_size}), got {bad}")
    return ids


def run(args: argparse.Namespace, tiers: dict[str, object] | None = None) -> int:
    """ValueError (one line from `kvpool generate`) for a caller's mistake: no --no-chat,
    a prompt that is not token ids, or a prompt + --max-tokens beyond the context.
    tiers: the persistent tiers' options (cli.args.persistent_cache_options)."""
    from kvpool.engine.build import build_engine
    from kvpool.engine.sampling import SamplingParams
    from kvpool.models.tiny_dsv4 import TINY_DSV4_CONFIG, TinyDSV4

    if not args.no_chat:
        raise ValueError(f"{MODEL_NAME} has no tokenizer or chat template: pass --no-chat and token ids")
    prompt_ids = parse_token_ids(args.prompt, TINY_DSV4_CONFIG["vocab_size"])
    from kvpool.cli.generate import sampling_options

    params = SamplingParams(**sampling_options(args))
    start = time.perf_counter()
    probe = start_torch_threads(args)
    model = TinyDSV4()
    check_span_block_size(args, model.spec.span, GENERATE_BLOCK_SIZE)
    num_blocks = args.num_blocks or DSV4_DEFAULT_BLOCKS
    engine = build_engine(
        model,
        num_blocks=num_blocks,
        hot_set_entries=getattr(args, "hisparse", None),
        host_cache_bytes=host_cache_bytes(args),
        preemption=getattr(args, "preemption", "recompute"),
        enable_prefix_caching=getattr(args, "enable_prefix_caching", True),
        **(tiers or {}),
        **v4_kv_format(args),
    )
    set_torch_threads(args, probe)
    try:
        return _generate(args, engine, prompt_ids, params, num_blocks, time.perf_counter() - start)
    finally:
        engine.runner.close()  # the disk and Redis tiers' background writes land before the process ends


def _generate(args, engine, prompt_ids, params, num_blocks: int, load_s: float) -> int:
    from kvpool.models.tiny_dsv4 import TINY_DSV4_CONFIG

    check_context(
        len(prompt_ids),
        args.max_tokens,
        engine.runner.max_model_len,
        TINY_DSV4_CONFIG["max_position_embeddings"],
        f"the KV cache of --num-blocks {num_blocks}",
    )
    rid = engine.add_request(prompt_ids, params)
    while engine.has_unfinished():
        engine.step()
    out = engine.output(rid)
    completion = out.completions[0]
    if args.json:
        engine.runner.flush_tiers(60)  # the background writes land before the report counts them
        report = {
            "model": MODEL_NAME,
            "token_ids": completion.token_ids,
            "text": "",
            "prompt_tokens": len(prompt_ids),
            "cached_tokens": out.num_cached_tokens,
            "finish_reason": completion.finish_reason,
            "kv_format": engine.runner.kv_format,
            "classical_block_bytes": engine.runner.cache_stats()["classical_block_bytes"],
            **timings(out),
            "load_s": round(load_s, 3),
            "load_source": "built in",  # random weights of a fixed seed, made in the process
            "memory": None,  # the ledger is measured for the Llama engine
            **engine.runner.tier_reports(),
        }
        print(json.dumps(report))
    else:
        print(" ".join(str(t) for t in completion.token_ids))
        if completion.finish_reason == "length":
            print(length_note(args.max_tokens), file=sys.stderr)
    return 0
