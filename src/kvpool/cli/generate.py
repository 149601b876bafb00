"""`kvpool generate "prompt"`: chat (or raw) generation with streaming output."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from kvpool.cli.args import (
    add_hisparse_argument,
    add_host_cache_argument,
    add_indexer_format_argument,
    add_persistent_cache_arguments,
    add_preemption_argument,
    check_device_model,
    check_engine_flags,
    host_cache_bytes,
    model_placement,
    non_negative_int,
    penalty,
    positive_float,
    positive_int,
    request_seed_int,
    token_id_list,
    unit_interval,
)
from kvpool.cli.options import (
    BLOCK_SIZE,
    PREFIX_CACHING,
    add_device_arguments,
    add_engine_model_option,
    add_kv_cache_dtype_option,
    add_option,
    add_threads_option,
    add_tp_option,
    gguf_path,
    set_torch_threads,
    start_torch_threads,
)

DSV4_DEFAULT_BLOCKS = 512  # tiny-dsv4's classical blocks when --num-blocks is not given
GENERATE_BLOCK_SIZE = 16  # --block-size's default (tiny-dsv4 takes only it or its span)


def _prompt(text: str) -> str:
    if not text.strip():
        raise argparse.ArgumentTypeError("the prompt is empty")
    try:  # argv carries bytes that are not UTF-8 as lone surrogates: the tokenizer raised a TypeError on them
        text.encode()
    except UnicodeEncodeError as error:
        char = ord(text[error.start])
        what = f"byte 0x{char - 0xDC00:02x}" if 0xDC80 <= char <= 0xDCFF else f"U+{char:04X}, a lone surrogate,"
        raise argparse.ArgumentTypeError(
            f"the prompt is not valid UTF-8 text ({what} at character {error.start}); give it in UTF-8"
        ) from None
    return text


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompt", type=_prompt, help="the user message (or raw text with --no-chat)")
    parser.add_argument("--no-chat", action="store_true", help="feed the prompt as raw text, without the chat template")
    parser.add_argument(
        "--max-tokens", type=positive_int, default=128, help="most new tokens; prompt + these must fit the context"
    )
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus mass, in (0, 1]")
    parser.add_argument("--top-k", type=non_negative_int, default=0, help="keep the k most likely tokens; 0 = off")
    # the sampling controls beside them (engine/sampling.py SamplingParams; docs/engine.md)
    parser.add_argument(
        "--presence-penalty",
        type=penalty,
        default=0.0,
        help="subtracted from the logit of each token the output holds, in [-2, 2]",
    )
    parser.add_argument(
        "--frequency-penalty",
        type=penalty,
        default=0.0,
        help="subtracted from each token's logit times its count in the output, in [-2, 2]",
    )
    parser.add_argument(
        "--repetition-penalty",
        type=positive_float,
        default=1.0,
        help="> 0: the logit of each token of the prompt or the output divided by it where > 0, else "
        "multiplied; 1 = off",
    )
    parser.add_argument(
        "--min-p",
        type=unit_interval,
        default=0.0,
        help="keep the tokens at least this times as likely as the most likely one, in [0, 1]; 0 = off",
    )
    parser.add_argument(
        "--min-tokens",
        type=non_negative_int,
        default=0,
        help="no EOS, stop token or stop string before this many new tokens (at most --max-tokens)",
    )
    parser.add_argument(
        "--stop-token-ids",
        type=token_id_list,
        default=(),
        metavar="ID[,ID...]",
        help="token ids that end the answer besides EOS (default: none)",
    )
    # a 64-bit signed integer, as SamplingParams, serve's seed and LLM take it (-1 was refused here
    # alone); 2**63 was refused after the model loaded in words that named no flag
    parser.add_argument(
        "--seed",
        type=request_seed_int,
        default=0,
        help="the request's sampling seed, a 64-bit signed integer: the same seed draws the same tokens "
        "(-1 too: a seed like any other, not 'random')",
    )
    add_option(parser, BLOCK_SIZE, default=GENERATE_BLOCK_SIZE)
    parser.add_argument(
        "--num-blocks",
        type=positive_int,
        default=None,
        help="KV blocks in the pool (default: what the prompt and --max-tokens need; tiny-dsv4: "
        f"{DSV4_DEFAULT_BLOCKS} classical blocks)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    add_host_cache_argument(parser)
    add_kv_cache_dtype_option(parser)
    add_indexer_format_argument(parser)
    add_option(
        parser,
        PREFIX_CACHING,
        default=True,
        note="one prompt hits only a prefix an earlier process left in --disk-cache or --redis",
    )
    add_persistent_cache_arguments(parser)
    add_preemption_argument(parser)
    add_hisparse_argument(parser)
    add_engine_model_option(
        parser,
        note="; or tiny-dsv4, the tiny DeepSeek-V4 model on its dual pool (token ids in and out: give --no-chat)",
    )
    add_threads_option(parser, probed=True)
    add_tp_option(parser)
    add_device_arguments(parser)


def check_context(
    num_prompt_tokens: int, max_tokens: int, context_len: int, max_position: int, cache_bound: str
) -> None:
    """Refuse a request that cannot get its --max-tokens (as vLLM and OpenAI do) instead of
    cutting it short at the context. The message names what sets `context_len`: the KV
    cache (`cache_bound`, the flags that size it) when it holds fewer tokens than the
    model's `max_position`, else the model's maximum."""
    if num_prompt_tokens + max_tokens <= context_len:
        return
    bound = cache_bound if context_len < max_position else "the model's maximum"
    room = context_len - num_prompt_tokens
    fit = f"at most {room} new tokens fit" if room > 0 else "the prompt alone fills it"
    raise ValueError(
        f"the prompt has {num_prompt_tokens} tokens and --max-tokens {max_tokens}; "
        f"the context holds {context_len} tokens ({bound}), so {fit}"
    )


def timings(out: Any) -> dict[str, float | None]:
    """JSON timing fields of a RequestOutput; None where the engine has no figure (no
    decode rate for a single token)."""
    return {
        "ttft_ms": None if out.ttft_s is None else round(out.ttft_s * 1e3, 2),
        "tokens_per_s": round(1 / out.tpot_s, 2) if out.tpot_s else None,  # decode rate, after the first token
        "latency_ms": None if out.latency_s is None else round(out.latency_s * 1e3, 2),
    }


def length_note(max_tokens: int) -> str:
    """The stderr line for an output cut by the length limit. check_context has made sure
    that the prompt plus --max-tokens fit the context, so --max-tokens is the limit hit."""
    return f"kvpool generate: note: the output stopped at --max-tokens {max_tokens}, not at a natural end"


def sampling_options(args: argparse.Namespace) -> dict[str, object]:
    """SamplingParams' fields from generate's flags; ValueError naming the flags where
    --min-tokens exceeds --max-tokens (SamplingParams' own error names its fields)."""
    if args.min_tokens > args.max_tokens:
        raise ValueError(f"--min-tokens {args.min_tokens} is more than --max-tokens {args.max_tokens}")
    return {
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "top_k": args.top_k,
        "seed": args.seed,
        "presence_penalty": args.presence_penalty,
        "frequency_penalty": args.frequency_penalty,
        "repetition_penalty": args.repetition_penalty,
        "min_p": args.min_p,
        "min_tokens": args.min_tokens,
        "stop_token_ids": args.stop_token_ids,
    }


def run(args: argparse.Namespace) -> int:

    from kvpool.engine import memory
    from kvpool.engine.build import build_engine, load_model
    from kvpool.engine.sampling import SamplingParams

    runtime_bytes = memory.runtime_baseline()
    preemption, kv_format, tiers = check_engine_flags(args)
    check_device_model(args, ("tiny-dsv4",))
    dtype, device = model_placement(args)
    if args.model == "tiny-dsv4":  # DeepSeek-V4 dual pool: token ids in, token ids out
        from kvpool.cli import generate_dsv4

        return generate_dsv4.run(args, tiers)
    params = SamplingParams(**sampling_options(args))
    probe = start_torch_threads(args)
    loaded = load_model(gguf_path(args.model), dtype=dtype, device=device)
    set_torch_threads(args, probe)
    rank = _tensor_parallel(args, loaded)
    if rank != 0:  # rank 0 reports; the others compute their shards alongside
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 (for the rest of the process)
    tok = loaded.tokenizer
    prompt_ids = (
        tok.encode(args.prompt) if args.no_chat else tok.encode_chat([{"role": "user", "content": args.prompt}])
    )
    num_blocks = args.num_blocks
    if num_blocks is None:  # this one request's need, within the model's positions: no idle pool to zero
        need = min(len(prompt_ids) + args.max_tokens, loaded.model.config.max_position)
        num_blocks = -(-need // args.block_size)
    # tensor parallel: the ranks agree on the request before its first step (each computes
    # its heads of the same tokens; another prompt or seed on one rank would garble the text)
    agree_across_ranks(
        loaded, "the request (its token ids and sampling parameters)", prompt_ids, params, num_blocks, args.block_size
    )
    engine = build_engine(
        loaded,
        num_blocks=num_blocks,
        block_size=args.block_size,
        host_cache_bytes=host_cache_bytes(args),
        preemption=preemption,
        kv_format=kv_format,
        enable_prefix_caching=args.enable_prefix_caching,
        enforce_eager=args.enforce_eager,
        **tiers,
    )
    try:
        return _generate(args, engine, loaded, prompt_ids, params, num_blocks, runtime_bytes)
    finally:
        engine.runner.close()  # the disk and Redis tiers' background writes land before the process ends


def _reports() -> bool:
    """Whether this process reports: the only one, or rank 0 of a --tensor-parallel-size run
    (the other ranks compute their shards of the same tokens and say nothing)."""
    import torch.distributed as dist

    return not dist.is_initialized() or dist.get_rank() == 0


def _tensor_parallel(args: argparse.Namespace, loaded) -> int:
    """--tensor-parallel-size: this process's rank, its model shard in `loaded` (ValueError
    for a size the model's heads or the torchrun world do not fit)."""
    from kvpool.models.tensor_parallel import check_tp, init_tp, shard_llama

    tp = getattr(args, "tp", 1)
    check_tp(loaded.model.config, tp)
    rank, world = init_tp(tp)
    if world > 1:
        loaded.model = shard_llama(loaded.model, rank, world)
    return rank


def agree_across_ranks(loaded, what: str, *parts: object) -> None:
    """Under --tensor-parallel-size: every rank holds the same `parts` (RankError naming the
    ranks that differ); nothing to check on one process."""
    if loaded.model.shard is None:
        return
    from kvpool.models.tensor_parallel import check_same, digest

    check_same(what, digest(*parts), loaded.model.tp_group, loaded.model.tp_peers)


def _generate(args, engine, loaded, prompt_ids, params, num_blocks, runtime_bytes) -> int:
    from kvpool.engine import memory

    tok = loaded.tokenizer
    check_context(
        len(prompt_ids),
        args.max_tokens,
        engine.runner.max_model_len,
        loaded.model.config.max_position,
        f"--num-blocks {num_blocks} x --block-size {args.block_size}",
    )
    from kvpool.server.protocol import decoded_bytes
    from kvpool.server.text_stream import TextStream

    rid = engine.add_request(prompt_ids, params)
    seq = engine.requests[rid].seqs[0]
    # the server's streaming rule: an incomplete UTF-8 sequence waits for its next byte, and
    # the end shows the final text whole (a character the length limit cut as U+FFFD, as --json's
    # "text" holds it: the stream held it back for good)
    token_bytes = decoded_bytes(tok)
    stream = TextStream(tok.decode, token_bytes).start_after(*token_bytes.context(prompt_ids, len(prompt_ids)))
    num_seen = 0
    try:
        while engine.has_unfinished():
            engine.step()
            engine.runner.note_bookkeeping()  # while the request holds its blocks, for the ledger
            if args.json:
                continue
            new_ids = [t for t in seq.output_ids[num_seen:] if t not in engine.eos_token_ids]
            num_seen = len(seq.output_ids)
            text = stream.advance(new_ids, seq.finish_reason, seq.text)
            if text:
                sys.stdout.write(text)
                sys.stdout.flush()
    except KeyboardInterrupt:
        if stream.sent_text:
            sys.stdout.write("\n")  # end the streamed line before main's "interrupted" line
        raise
    out = engine.output(rid)
    completion = out.completions[0]
    if args.json:
        engine.runner.flush_tiers(60)  # the background writes land before the report counts them
        report = {
            "token_ids": completion.token_ids,
            "text": completion.text,
            "prompt_tokens": len(prompt_ids),
            "cached_tokens": out.num_cached_tokens,
            "finish_reason": completion.finish_reason,
            "kv_format": engine.runner.kv_format,
            "tp": getattr(args, "tp", 1),
            "kv_bytes_per_token_per_rank": engine.runner.executor.storage.bytes_per_token,
            "kv_pool_bytes_per_rank": engine.runner.executor.storage.num_bytes,
            **timings(out),
            "load_s": round(loaded.load_s, 3),
            "load_source": loaded.load_source,
            "memory": memory.measure(engine.runner, runtime_bytes, loaded.tokenizer_bytes).as_dict(),
            **engine.runner.tier_reports(),
        }
        print(json.dumps(report))
    else:
        sys.stdout.write("\n")
        if completion.finish_reason == "length" and _reports():
            sys.stdout.flush()  # the text first, then the note, also through one pipe
            print(length_note(args.max_tokens), file=sys.stderr)
    return 0
