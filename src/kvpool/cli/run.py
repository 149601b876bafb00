"""`kvpool run`: the main job. A built-in workload of concurrent chat requests through the
engine (shared system prompts, multi-turn follow-ups that reuse their own history, a few
long prompts), then the performance report (seed 003) as a table or one JSON object."""

from __future__ import annotations

import argparse
import json
import random
import time

from kvpool.cli.generate import add_model_arguments

SYSTEM_TOPICS = [
    "a patient support agent for a company that sells bicycles, spare parts and repair services",
    "a travel planner who knows trains, ferries, museums and local food in European cities",
    "a cooking assistant that adapts recipes to what is in the fridge and to dietary needs",
]
QUESTIONS = [
    "What should I check first?",
    "Can you give me three options?",
    "Explain it simply.",
    "What does it cost?",
    "How long does it take?",
    "What is the most common mistake?",
    "Give me a short plan for tomorrow.",
    "Which one would you pick and why?",
]
FOLLOW_UPS = ["Tell me more about the second point.", "Can you make that shorter?", "Thanks! Anything else?"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--num-requests", type=int, default=24, help="first-turn conversations")
    parser.add_argument("--turns", type=int, default=2, help="turns per conversation (follow-ups reuse the history)")
    parser.add_argument("--num-long", type=int, default=2, help="long single prompts added to the mix")
    parser.add_argument("--max-tokens", type=int, default=24, help="new tokens per answer")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--num-blocks", type=int, default=None, help="KV blocks (default: from --kv-memory)")
    parser.add_argument("--kv-memory", default="256MiB", help="KV cache memory, e.g. 64MiB or 1GiB")
    parser.add_argument("--max-batch-tokens", type=int, default=256, help="token budget per engine step")
    parser.add_argument("--max-seqs", type=int, default=16, help="most sequences in one step")
    parser.add_argument("--slo-ttft-ms", type=float, default=2000.0, help="goodput SLO: time to first token")
    parser.add_argument("--slo-tpot-ms", type=float, default=500.0, help="goodput SLO: time per output token")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true")
    add_model_arguments(parser)


def parse_bytes(text: str) -> int:
    units = {"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "kb": 10**3, "mb": 10**6, "gb": 10**9, "b": 1}
    lower = text.strip().lower()
    for unit, factor in units.items():
        if lower.endswith(unit):
            return int(float(lower[: -len(unit)]) * factor)
    return int(lower)


def percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    k = (len(ordered) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def build_workload(tok, args: argparse.Namespace) -> tuple[list[list[dict]], list[list[int]]]:
    """First-turn conversations (message lists) and long raw prompts."""
    rng = random.Random(args.seed)
    systems = [
        f"You are {topic}. Answer briefly and concretely. "
        + " ".join(
            f"Rule {i + 1}: be accurate, be kind and never invent facts about {topic.split(',')[0]}." for i in range(8)
        )
        for topic in SYSTEM_TOPICS
    ]
    chats = [
        [{"role": "system", "content": systems[i % len(systems)]}, {"role": "user", "content": rng.choice(QUESTIONS)}]
        for i in range(args.num_requests)
    ]
    filler = "The history of tools is the history of people who wanted to do more with less effort. "
    long_prompts = [
        tok.encode_chat([{"role": "user", "content": filler * (40 + 5 * i) + "Summarize this."}])
        for i in range(args.num_long)
    ]
    return chats, long_prompts


def run(args: argparse.Namespace) -> int:
    import torch
    from rich.console import Console
    from rich.progress import Progress
    from rich.table import Table

    from kvpool.engine.build import build_engine, load_model, num_blocks_for_memory
    from kvpool.engine.sampling import SamplingParams

    if args.threads:
        torch.set_num_threads(args.threads)
    loaded = load_model(args.model)
    tok = loaded.tokenizer
    num_blocks = args.num_blocks or num_blocks_for_memory(loaded, args.block_size, parse_bytes(args.kv_memory))
    engine = build_engine(
        loaded,
        num_blocks=num_blocks,
        block_size=args.block_size,
        max_num_batched_tokens=args.max_batch_tokens,
        max_num_seqs=args.max_seqs,
    )
    runner = engine.runner
    # Allocation latency: time spent in the cache's admit / reserve calls.
    alloc_times: list[float] = []
    for name in ("admit", "reserve"):
        method = getattr(runner, name)

        def timed(*a, _method=method, **kw):
            t0 = time.perf_counter()
            try:
                return _method(*a, **kw)
            finally:
                alloc_times.append(time.perf_counter() - t0)

        setattr(runner, name, timed)

    chats, long_prompts = build_workload(tok, args)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.7, top_p=0.9, seed=args.seed)
    conversation_of: dict[str, tuple[int, int]] = {}  # request id -> (conversation, turn)
    for c, messages in enumerate(chats):
        rid = engine.add_request(tok.encode_chat(messages), params, f"chat{c}-t0")
        conversation_of[rid] = (c, 0)
    for i, prompt in enumerate(long_prompts):
        engine.add_request(prompt, params, f"long{i}")
    total = len(chats) * args.turns + len(long_prompts)

    kv_bytes_per_token = runner.storage.bytes_per_block / runner.block_size
    frag_samples: list[float] = []
    bytes_read = 0.0
    step_time = 0.0
    done = 0
    t_start = time.perf_counter()
    with Progress(transient=True, disable=args.json) as progress:
        task = progress.add_task("serving", total=total)
        while engine.has_unfinished():
            t0 = time.perf_counter()
            finished = engine.step()
            step_time += time.perf_counter() - t0
            held, slots = runner.used_tokens()
            if slots:
                frag_samples.append(1 - held / slots)
            # KV bytes attention read this step: every sequence reads its whole context.
            # Divided by the whole step time (weights included) this is the effective KV
            # read rate of serving, not the attention kernel's peak bandwidth.
            bytes_read += sum(s.num_computed for s in engine.running) * kv_bytes_per_token
            for rid in finished:
                done += 1
                progress.advance(task)
                if rid in conversation_of:
                    c, turn = conversation_of[rid]
                    if turn + 1 < args.turns:
                        answer = engine.output(rid).completions[0].text
                        chats[c] += [
                            {"role": "assistant", "content": answer},
                            {"role": "user", "content": FOLLOW_UPS[turn % 3]},
                        ]
                        nid = engine.add_request(tok.encode_chat(chats[c]), params, f"chat{c}-t{turn + 1}")
                        conversation_of[nid] = (c, turn + 1)
    wall = time.perf_counter() - t_start
    outputs = [engine.output(r) for r in engine.requests]
    ttfts = [o.ttft_s * 1e3 for o in outputs if o.ttft_s is not None]
    tpots = [o.tpot_s * 1e3 for o in outputs if o.tpot_s is not None]
    num_generated = sum(len(c.token_ids) for o in outputs for c in o.completions)
    good = sum(
        1
        for o in outputs
        if o.ttft_s is not None and o.ttft_s * 1e3 <= args.slo_ttft_ms and (o.tpot_s or 0) * 1e3 <= args.slo_tpot_ms
    )
    stats = runner.cache_stats()
    report = {
        "kv_capacity_tokens": int(stats["kv_capacity_tokens"]),
        "kv_capacity_bytes": int(stats["kv_capacity_bytes"]),
        "block_size": runner.block_size,
        "num_blocks": num_blocks,
        "fragmentation": round(sum(frag_samples) / len(frag_samples), 4) if frag_samples else 0.0,
        "prefix_hit_rate": round(runner.manager.stats.hit_rate, 4),
        "alloc_latency_us": round(sum(alloc_times) / len(alloc_times) * 1e6, 2) if alloc_times else 0.0,
        "read_bandwidth_gbps": round(bytes_read / step_time / 1e9, 3) if step_time else 0.0,
        "ttft_ms_p50": round(percentile(ttfts, 0.5), 1),
        "ttft_ms_p99": round(percentile(ttfts, 0.99), 1),
        "tpot_ms_p50": round(percentile(tpots, 0.5), 1),
        "tpot_ms_p99": round(percentile(tpots, 0.99), 1),
        "throughput_tok_s": round(num_generated / wall, 2),
        "goodput_req_s": round(good / wall, 3),
        "preemptions": engine.num_preemptions,
        "num_requests": len(outputs),
        "num_generated_tokens": num_generated,
        "wall_s": round(wall, 2),
    }
    if args.json:
        print(json.dumps(report))
        return 0
    table = Table(
        title=f"kvpool run: {len(outputs)} requests on {stats['num_blocks']:.0f} blocks of {runner.block_size}"
    )
    table.add_column("metric")
    table.add_column("value", justify="right")
    for key, value in report.items():
        table.add_row(key, str(value))
    Console().print(table)
    return 0
