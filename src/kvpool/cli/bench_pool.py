"""`kvpool bench pool`: block-pool and prefix-cache bookkeeping on two fixed traces.

T1 (decode bookkeeping): 16,384 blocks of 16 tokens; 256 requests with distinct 512-token
prompts are admitted and prefilled; 256 decode steps give every request one more token
(a new block every 16 tokens; each completed block is hashed and registered); then all are
freed. decode_step_us_per_request = decode-phase time / (256 * 256). block_op_ns =
allocate + free of 12,288 blocks, per block.

T2 (prefix hits): a resident request holds a 2,048-token prefix (128 full blocks); 64
requests arrive with that prefix plus 64 unique tokens each. hash_ns = time to hash the
prefix blocks, per block; prefix_lookup_ns = time to find the longest cached prefix (hash
hits plus the token comparison), per block. Every request must find exactly 128 blocks.

Each figure is the median of `--repeats` runs. As in `timeit`, the garbage collector is
paused inside the timed sections (serving engines freeze or tune it the same way), so
that a collection triggered by the benchmark's own setup objects is not billed to the pool.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import statistics
import time

from kvpool.cache import CacheDescriptor, KVCacheManager
from kvpool.pool.block_pool import BlockPool
from kvpool.pool.hashing import TOKEN_BYTES, token_bytes

T1_BLOCKS, BLOCK_SIZE, T1_REQUESTS, T1_PROMPT, T1_STEPS, BLOCK_OPS = 16_384, 16, 256, 512, 256, 12_288
T2_BLOCKS, T2_PREFIX, T2_REQUESTS, T2_UNIQUE = 4_096, 2_048, 64, 64
VOCAB = 49_152


@contextlib.contextmanager
def _timed_section():
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def _prompt(seed: int, length: int) -> list[int]:
    return [(seed * 1_000_003 + i * 7_919) % VOCAB for i in range(length)]


def trace_t1(hash_algo: str) -> dict[str, float]:
    manager = KVCacheManager(T1_BLOCKS, BLOCK_SIZE, CacheDescriptor("bench-t1"), hash_algo=hash_algo)
    request_ids = [f"t1-{i}" for i in range(T1_REQUESTS)]
    for i, request_id in enumerate(request_ids):
        assert manager.admit(request_id, _prompt(i, T1_PROMPT)) is not None
        manager.commit(request_id, T1_PROMPT)
        manager.append_token_ids(request_id, [i % VOCAB])  # the first sampled token
    next_tokens = [[(step * 31 + i) % VOCAB for i in range(T1_REQUESTS)] for step in range(T1_STEPS)]
    with _timed_section():
        start = time.perf_counter()
        for step in range(T1_STEPS):
            copies = manager.reserve_decode(request_ids)
            assert copies is not None and not copies
            manager.commit_decode(request_ids, next_tokens[step])
        decode_s = time.perf_counter() - start
    for request_id in request_ids:
        assert manager.num_computed_tokens(request_id) == T1_PROMPT + T1_STEPS
        manager.finish(request_id)
    manager.check_integrity()
    assert manager.num_free_blocks == T1_BLOCKS

    pool = BlockPool(T1_BLOCKS)
    with _timed_section():
        start = time.perf_counter()
        block_ids = pool.allocate(BLOCK_OPS)
        assert block_ids is not None
        pool.decref(reversed(block_ids))
        block_op_s = time.perf_counter() - start
    pool.check_integrity()
    return {
        "decode_step_us_per_request": decode_s / (T1_STEPS * T1_REQUESTS) * 1e6,
        "block_op_ns": block_op_s / BLOCK_OPS * 1e9,
    }


def trace_t2(hash_algo: str) -> dict[str, float]:
    manager = KVCacheManager(T2_BLOCKS, BLOCK_SIZE, CacheDescriptor("bench-t2"), hash_algo=hash_algo)
    prefix = _prompt(10_000, T2_PREFIX)
    manager.admit("resident", prefix + [1])
    manager.commit("resident", T2_PREFIX + 1)
    prompts = [prefix + _prompt(20_000 + i, T2_UNIQUE) for i in range(T2_REQUESTS)]
    num_prefix_blocks = T2_PREFIX // BLOCK_SIZE

    # Hashing alone, as admission does it: the prompt's token bytes once, then the chained
    # hash of each prefix block.
    # (The same inlined digest(parent || tokens) as KVCacheManager._lookup.)
    digest = manager.hasher.digest
    root = manager.hasher.root(manager.descriptor.key())
    width = BLOCK_SIZE * TOKEN_BYTES
    with _timed_section():
        start = time.perf_counter()
        for prompt in prompts:
            prompt_bytes = token_bytes(prompt)
            parent = root
            for i in range(num_prefix_blocks):
                parent = digest(parent + prompt_bytes[i * width : (i + 1) * width])
        hash_s = time.perf_counter() - start

    # The whole lookup (what admission does): hash, find, compare the stored tokens.
    with _timed_section():
        start = time.perf_counter()
        for prompt in prompts:
            num_hit = manager.lookup_prefix(prompt)
            assert num_hit == T2_PREFIX, f"expected {T2_PREFIX} cached tokens, found {num_hit}"
        lookup_s = time.perf_counter() - start
    num_blocks = T2_REQUESTS * num_prefix_blocks
    hash_ns = hash_s / num_blocks * 1e9
    total_ns = lookup_s / num_blocks * 1e9
    return {"hash_ns": hash_ns, "prefix_lookup_ns": max(total_ns - hash_ns, 0.0), "hash_plus_lookup_ns": total_ns}


def measure(repeats: int, hash_algo: str) -> dict[str, float | str | int]:
    runs = [trace_t1(hash_algo) | trace_t2(hash_algo) for _ in range(repeats)]
    result: dict[str, float | str | int] = {
        key: round(statistics.median(run[key] for run in runs), 3 if key.endswith("_us_per_request") else 1)
        for key in runs[0]
    }
    result["hash_algo"] = hash_algo
    result["repeats"] = repeats
    return result


TARGETS = {
    "decode_step_us_per_request": 0.5,
    "block_op_ns": 300.0,
    "hash_plus_lookup_ns": 600.0,
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--repeats", type=int, default=5, help="runs per figure (median)")
    parser.add_argument("--hash", dest="hash_algo", default="xxh3_128", choices=["xxh3_128", "sha256"])


def run(args: argparse.Namespace) -> int:
    if args.repeats <= 0:
        raise ValueError(f"--repeats must be positive, got {args.repeats}")
    result = measure(args.repeats, args.hash_algo)
    if args.json:
        print(json.dumps(result))
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"kvpool bench pool ({args.hash_algo}, median of {args.repeats})")
    table.add_column("figure")
    table.add_column("value", justify="right")
    table.add_column("target", justify="right")
    for key, value in result.items():
        if key in ("hash_algo", "repeats"):
            continue
        target = TARGETS.get(key)
        table.add_row(key, f"{value:,.3g}" if value < 10 else f"{value:,.1f}", f"<= {target:g}" if target else "")
    Console().print(table)
    return 0
