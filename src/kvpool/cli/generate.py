"""`kvpool generate "prompt"`: chat (or raw) generation with streaming output."""

from __future__ import annotations

import argparse
import json
import sys


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="a Llama-architecture GGUF (default: the embedded SmolLM2-135M)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompt", help="the user message (or raw text with --no-chat)")
    parser.add_argument("--no-chat", action="store_true", help="feed the prompt as raw text, without the chat template")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--num-blocks", type=int, default=512)
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    add_model_arguments(parser)


def run(args: argparse.Namespace) -> int:
    import torch

    from kvpool.engine.build import build_engine, load_model
    from kvpool.engine.sampling import SamplingParams

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.model == "tiny-dsv4":  # DeepSeek-V4 dual pool: token ids in, token ids out
        from kvpool.cli import generate_dsv4

        return generate_dsv4.run(args)
    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed
    )
    loaded = load_model(args.model)
    tok = loaded.tokenizer
    prompt_ids = (
        tok.encode(args.prompt) if args.no_chat else tok.encode_chat([{"role": "user", "content": args.prompt}])
    )
    engine = build_engine(loaded, num_blocks=args.num_blocks, block_size=args.block_size)
    rid = engine.add_request(prompt_ids, params)
    seq = engine.requests[rid].seqs[0]
    printed = ""
    while engine.has_unfinished():
        engine.step()
        if args.json:
            continue
        ids = [t for t in seq.output_ids if t not in engine.eos_token_ids]
        text = tok.decode(ids)
        if seq.finish_reason is not None:
            text = seq.text
        # hold back an incomplete UTF-8 sequence (shown as U+FFFD) until its next byte arrives
        if text.startswith(printed) and not text.endswith("\ufffd"):
            sys.stdout.write(text[len(printed) :])
            sys.stdout.flush()
            printed = text
    out = engine.output(rid)
    completion = out.completions[0]
    if args.json:
        print(
            json.dumps(
                {
                    "token_ids": completion.token_ids,
                    "text": completion.text,
                    "prompt_tokens": len(prompt_ids),
                    "cached_tokens": out.num_cached_tokens,
                }
            )
        )
    else:
        sys.stdout.write("\n")
    return 0
