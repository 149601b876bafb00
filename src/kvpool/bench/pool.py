"""`kvpool bench pool`'s measurement: block-pool and prefix-cache bookkeeping on two fixed traces, timed on
the calls the engine makes.

T1 (decode bookkeeping): 16,384 blocks of 16 tokens; 256 requests with distinct 512-token
prompts are admitted and prefilled; 256 decode steps give every request one more token
(a new block every 16 tokens; each completed block is hashed and registered); then all are
freed. Each decode step is what the engine runs for its cache, with the same arguments:
`runner.reserve_step(ids, counts)` and `runner.commit_step(ids, counts, sampled)`
(engine/runner.py `ModelRunner`; the engine calls each once per step) are
`FullAttentionManager.reserve_step` and `commit_step`. decode_step_us_per_request
= their time / (256 * 256). decode_tables_us_per_request: the block tables the runner then
exports for attention in the same step (each chunk's slot mapping and the batch's CSR).
block_op_ns = allocate + free of 12,288 blocks, per block.

T2 (prefix hits): a resident request holds a 2,048-token prefix (128 full blocks); 64
requests arrive with that prefix plus 64 unique tokens each. hash_ns = time to hash the
prefix blocks, per block; prefix_lookup_ns = time to find the longest cached prefix (hash
hits plus the collision guard), per block. Every request must find exactly 128 blocks.

T3 (V4 decode bookkeeping): DeepSeek-V4-Flash's dual pool as `kvpool simulate` builds it
on an H200 (128-token spans, "auto" restore, pooled checkpoints of 9 classical blocks, turn
ends kept) with 16,384 classical blocks and 256 state blocks; 128 requests with distinct
prompts of 900 + 37 i tokens (their span ends spread over the steps) are admitted and
prefilled; 1,024 decode steps (8 spans each) make the three calls the V4 runner makes per
step: `reserve_step`, `step_reservations` (engine/runner.py `_forward_in_pieces`) and
`commit_step`. v4_decode_step_us_per_request = their time / (1,024 * 128): a decode inside
its span, and the amortized work of the one in 128 that completes a span (a block, its
hash, a checkpoint of 9 blocks, published at commit).

Each figure is the median of `repeats` runs (`--repeats`), with the garbage collector on, as a serving
process runs (the collections the traces' own allocations trigger are billed to them).
The counts (requests, steps, blocks taken and registered, hits, spans, checkpoints) are part of the output:
each follows from the trace definitions above.
"""

from __future__ import annotations

import statistics
import time

from kvpool.cache import CacheDescriptor, DSV4CacheManager, FullAttentionManager
from kvpool.pool.block_pool import BlockPool
from kvpool.pool.hashing import TOKEN_BYTES, token_bytes
from kvpool.spec.dsv4 import load_preset

T1_BLOCKS, BLOCK_SIZE, T1_REQUESTS, T1_PROMPT, T1_STEPS, BLOCK_OPS = 16_384, 16, 256, 512, 256, 12_288
T2_BLOCKS, T2_PREFIX, T2_REQUESTS, T2_UNIQUE = 4_096, 2_048, 64, 64
T3_BLOCKS, T3_STATES, T3_REQUESTS, T3_STEPS, T3_SPAN, T3_CHECKPOINT_BLOCKS = 16_384, 256, 128, 1_024, 128, 9
VOCAB = 49_152


def _prompt(seed: int, length: int) -> list[int]:
    return [(seed * 1_000_003 + i * 7_919) % VOCAB for i in range(length)]


def trace_t1(hash_algo: str) -> dict[str, float]:
    """One run of T1: its three timed figures and its two counts."""
    cache = FullAttentionManager(T1_BLOCKS, BLOCK_SIZE, CacheDescriptor("bench-t1"), hash_algo=hash_algo)
    request_ids = [f"t1-{i}" for i in range(T1_REQUESTS)]
    for i, request_id in enumerate(request_ids):
        assert cache.admit(request_id, _prompt(i, T1_PROMPT)) is not None
        cache.commit(request_id, T1_PROMPT)
        cache.append_token_ids(request_id, [i % VOCAB])  # the first sampled token
    allocated_before = cache.pool.num_allocated
    next_tokens = [[(step * 31 + i) % VOCAB for i in range(T1_REQUESTS)] for step in range(T1_STEPS)]
    ones = [1] * T1_REQUESTS
    decode_s = tables_s = 0.0
    starts = [cache.num_computed_tokens(r) for r in request_ids]
    for step in range(T1_STEPS):
        start = time.perf_counter()
        assert cache.reserve_step(request_ids, ones)
        reserved = time.perf_counter()
        # What LlamaExecutor.forward takes from the cache for a decode step (`step_tables`).
        ends = [n + 1 for n in starts]
        t0 = time.perf_counter()
        cache.step_tables(request_ids, starts, ends)
        exported = time.perf_counter()
        cache.commit_step(request_ids, ones, next_tokens[step])
        decode_s += (reserved - start) + (time.perf_counter() - exported)
        tables_s += exported - t0
        starts = ends
    num_new_blocks = cache.pool.num_allocated - allocated_before
    num_registered = cache.pool.num_cached
    for request_id in request_ids:
        assert cache.num_computed_tokens(request_id) == T1_PROMPT + T1_STEPS
        cache.release(request_id)
    cache.check_integrity()
    assert cache.num_free_blocks == T1_BLOCKS

    pool = BlockPool(T1_BLOCKS)
    start = time.perf_counter()
    block_ids = pool.allocate(BLOCK_OPS)
    assert block_ids is not None
    pool.decref(reversed(block_ids))
    block_op_s = time.perf_counter() - start
    pool.check_integrity()
    return {
        "decode_step_us_per_request": decode_s / (T1_STEPS * T1_REQUESTS) * 1e6,
        "decode_tables_us_per_request": tables_s / (T1_STEPS * T1_REQUESTS) * 1e6,
        "block_op_ns": block_op_s / BLOCK_OPS * 1e9,
        "t1_decode_blocks_taken": num_new_blocks,
        "t1_blocks_registered": num_registered,
    }


def trace_t2(hash_algo: str) -> dict[str, float]:
    """One run of T2: hash_ns, prefix_lookup_ns, their sum, and the blocks hit."""
    cache = FullAttentionManager(T2_BLOCKS, BLOCK_SIZE, CacheDescriptor("bench-t2"), hash_algo=hash_algo)
    prefix = _prompt(10_000, T2_PREFIX)
    cache.admit("resident", prefix + [1])
    cache.commit("resident", T2_PREFIX + 1)
    prompts = [prefix + _prompt(20_000 + i, T2_UNIQUE) for i in range(T2_REQUESTS)]
    num_prefix_blocks = T2_PREFIX // BLOCK_SIZE

    # Hashing alone, as admission does it: the prompt's token bytes once, then the chained
    # hash of each prefix block (BlockHasher.chain of the parent's hash, as BlockPool.match).
    hasher = cache.pool.hasher
    root = cache.pool.root(cache.descriptor.key())
    width = BLOCK_SIZE * TOKEN_BYTES
    start = time.perf_counter()
    for prompt in prompts:
        prompt_bytes = token_bytes(prompt)
        parent = root.block_hash
        for i in range(num_prefix_blocks):
            parent = hasher.chain(parent, prompt_bytes[i * width : (i + 1) * width])
    hash_s = time.perf_counter() - start

    # The whole lookup (what admission does): hash, find, guard.
    num_hits = 0
    start = time.perf_counter()
    for prompt in prompts:
        num_hit = cache.lookup_prefix(prompt)
        assert num_hit == T2_PREFIX, f"expected {T2_PREFIX} cached tokens, found {num_hit}"
        num_hits += num_hit // BLOCK_SIZE
    lookup_s = time.perf_counter() - start
    num_blocks = T2_REQUESTS * num_prefix_blocks
    hash_ns = hash_s / num_blocks * 1e9
    total_ns = lookup_s / num_blocks * 1e9
    return {
        "hash_ns": hash_ns,
        "prefix_lookup_ns": max(total_ns - hash_ns, 0.0),
        "hash_plus_lookup_ns": total_ns,
        "t2_hit_blocks": num_hits,
    }


def trace_t3(hash_algo: str) -> dict[str, float]:
    """One run of T3: its timed figure and its two counts."""
    spec = load_preset("deepseek-v4-flash", block_span=T3_SPAN)
    cache = DSV4CacheManager(
        spec,
        T3_BLOCKS,
        T3_STATES,
        CacheDescriptor("bench-t3"),
        restore="auto",
        checkpoint_blocks=T3_CHECKPOINT_BLOCKS,
        turn_end_checkpoints=True,
        hash_algo=hash_algo,
    )
    request_ids = [f"t3-{i}" for i in range(T3_REQUESTS)]
    for i, request_id in enumerate(request_ids):
        num_prompt = 900 + 37 * i
        assert cache.admit(request_id, _prompt(30_000 + i, num_prompt)) is not None
        cache.commit(request_id, num_prompt)
        cache.append_token_ids(request_id, [i % VOCAB])  # the first sampled token
    held_before = sum(len(cache.block_ids(r)) for r in request_ids)
    next_tokens = [[(step * 31 + i) % VOCAB for i in range(T3_REQUESTS)] for step in range(T3_STEPS)]
    ones = [1] * T3_REQUESTS
    starts = [cache.num_computed_tokens(r) for r in request_ids]
    decode_s = 0.0
    num_checkpoints = 0
    for step in range(T3_STEPS):
        ends = [n + 1 for n in starts]
        start = time.perf_counter()
        assert cache.reserve_step(request_ids, ones)
        taken = cache.step_reservations(request_ids, starts, ends)
        cache.commit_step(request_ids, ones, next_tokens[step])
        decode_s += time.perf_counter() - start
        num_checkpoints += sum(len(res.groups["v4"].checkpoints) for res in taken.values())
        starts = ends
    num_spans = sum(len(cache.block_ids(r)) for r in request_ids) - held_before
    for request_id in request_ids:
        cache.release(request_id)
    cache.check_integrity()
    return {
        "v4_decode_step_us_per_request": decode_s / (T3_STEPS * T3_REQUESTS) * 1e6,
        "t3_spans_completed": num_spans,
        "t3_checkpoints_taken": num_checkpoints,
    }


COUNTS = (
    "t1_decode_blocks_taken",
    "t1_blocks_registered",
    "t2_hit_blocks",
    "t3_spans_completed",
    "t3_checkpoints_taken",
)


def measure(repeats: int = 5, hash_algo: str = "xxh3_128") -> dict[str, float | str | int]:
    """The three traces `repeats` times: each figure's median, the counts (equal in every run), and
    the settings. The dict `kvpool bench pool --json` prints."""
    if repeats < 1:
        raise ValueError(f"repeats must be at least 1, got {repeats}")
    runs = [trace_t1(hash_algo) | trace_t2(hash_algo) | trace_t3(hash_algo) for _ in range(repeats)]
    result: dict[str, float | str | int] = {}
    for key in runs[0]:
        if key in COUNTS:
            values = {run[key] for run in runs}
            assert len(values) == 1, f"{key} differs between runs: {values}"
            result[key] = int(runs[0][key])
        else:
            result[key] = round(
                statistics.median(run[key] for run in runs), 3 if key.endswith("_us_per_request") else 1
            )
    result["hash_algo"] = hash_algo
    result["repeats"] = repeats
    result["gc"] = "on"
    return result


# the targets for the timed figures (docs/benchmarks.md) (shown beside them)
TARGETS = {
    "decode_step_us_per_request": 0.5,
    "block_op_ns": 300.0,
    "hash_plus_lookup_ns": 600.0,
}
