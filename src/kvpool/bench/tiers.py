"""`kvpool bench tiers`'s measurement: a cached prefix served from each tier below the device pool, on
this machine.

SmolLM2-135M (fp32), a `prefix_len`-token prefix of random ids followed by a fresh
`suffix_len`-token question each repeat, answered with one token; TTFT from arrival:
  - device:    the prefix was computed once in a pool large enough to keep it;
  - host:      a pool of about one request with a host tier; a filler prompt as long as the
               pool pushes the prefix out into the host tier before each repeat;
  - disk:      a fresh engine (an empty pool, as a new process) on a disk cache that an earlier
               engine wrote the prefix into; each entry file is dropped from the OS page cache
               before each repeat (posix_fadvise DONTNEED), so the blocks come off the disk;
  - redis:     a fresh engine on a Redis tier that an earlier engine wrote into (`redis`,
               else a private redis-server started on 127.0.0.1 for the run);
  - recompute: no prefix cache: the whole prompt is computed.
Write throughput of the disk and Redis tiers: the bytes the background writers stored over
the time they took (encode, checksum, write, fsync and rename, or the Redis round trips).

DeepSeek-V4 (tiny-dsv4, fp32), a `v4_prefix_len`-token prefix through the disk tier with
each SWA strategy (tiers/swa.py): the bytes written per cached token (compressed entries +
window snapshots), then a fresh engine's TTFT and its state restore (snapshots read, tokens
recomputed, milliseconds), against recomputing the whole prompt.
"""

from __future__ import annotations

import contextlib
import os
import random
import statistics
import tempfile
from pathlib import Path

from kvpool.bench.common import serve_one


def _drop_page_cache(root: Path) -> None:
    """Ask the kernel to forget the cached pages of every entry file (clean pages go)."""
    for path in root.rglob("*.safetensors"):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _case(ttfts: list[float], cached: list[int], **extra) -> dict:
    return {
        "ttft_ms_p50": round(statistics.median(ttfts), 1),
        "ttft_ms": [round(t, 1) for t in ttfts],
        "cached_tokens": cached,
        **extra,
    }


def _throughput(stats) -> float | None:
    return round(stats.num_put_bytes / stats.put_s / 1e6, 1) if stats.put_s > 0 else None


def check_lengths(prefix_len: int, suffix_len: int, block_size: int, max_position: int) -> None:
    """ValueError naming the flags when the longest prompt of the SmolLM2 cases, a request
    (prefix and suffix) or the host case's filler (the request's blocks and one more), does
    not leave the model's context room for its one output token. (The engine's words named
    neither flag: "request 'req-0': prompt of 8208 tokens is too long"; and a prefix past
    the machine's memory was told to "lower --kv-memory or --num-blocks", flags bench tiers
    does not have.)"""
    request_blocks = -(-(prefix_len + suffix_len + 1) // block_size)
    longest = (request_blocks + 1) * block_size  # the filler, longer than the request
    if longest > max_position - 1:
        raise ValueError(
            f"--prefix-len {prefix_len} with --suffix-len {suffix_len} (blocks of {block_size}) makes prompts of up "
            f"to {longest:,} tokens (the host case's filler is the request's {request_blocks:,} blocks and one "
            f"more); SmolLM2's {max_position:,} positions hold {max_position - 1:,} and the output token: lower "
            "--prefix-len or --suffix-len"
        )


def _llama_cases(
    prefix_len: int, suffix_len: int, repeats: int, block_size: int, seed: int, workdir: Path, redis_url: str | None
) -> tuple[dict, dict]:
    """SmolLM2: the five cases' TTFTs, and what the disk and Redis writers stored."""
    from kvpool.engine.build import build_engine, cache_spec_for, load_model

    loaded = load_model(device="cpu")
    check_lengths(prefix_len, suffix_len, block_size, loaded.model.config.max_position)
    rng = random.Random(seed)

    def ids(n: int) -> list[int]:
        return [rng.randrange(100, 49000) for _ in range(n)]

    prefix = ids(prefix_len)
    bs = block_size
    request_blocks = -(-(prefix_len + suffix_len + 1) // bs)
    small = request_blocks + 2
    cases: dict[str, dict] = {}
    writes: dict[str, dict] = {}

    # device, host and recompute: one engine each, repeats on it
    for name in ("device", "host", "recompute"):
        engine = build_engine(
            loaded,
            num_blocks=4 * request_blocks if name == "device" else small,
            block_size=bs,
            enable_prefix_caching=name != "recompute",
            host_cache_bytes=2 * request_blocks * int(cache_spec_for(loaded, bs).bytes_per_block)
            if name == "host"
            else None,
        )
        serve_one(engine, prefix + ids(suffix_len))
        ttfts, cached = [], []
        for _ in range(repeats):
            if name == "host":
                serve_one(engine, ids((small - 1) * bs))  # pushes the prefix out to the host tier
            out = serve_one(engine, prefix + ids(suffix_len))
            ttfts.append(out.ttft_s * 1e3)
            cached.append(out.num_cached_tokens)
        extra = {}
        if name == "host":
            moves = engine.runner.tier_moves
            extra = {
                "blocks_loaded_per_request": moves.num_loaded // repeats,
                "load_ms_per_request": round(moves.load_s * 1e3 / repeats, 2),
            }
        cases[name] = _case(ttfts, cached, **extra)

    # disk and Redis: written by one engine, read by a fresh engine each repeat
    persistent = {"disk": {"disk_cache": workdir / "disk"}}
    if redis_url is not None:
        persistent["redis"] = {"redis_url": redis_url}
    for name, options in persistent.items():
        writer = build_engine(loaded, num_blocks=4 * request_blocks, block_size=bs, **options)
        serve_one(writer, prefix + ids(suffix_len))
        writer.runner.close()
        stats = writer.runner.persistent_tiers[0].stats
        writes[name] = {
            "blocks": stats.num_puts,
            "bytes": stats.num_put_bytes,
            "write_s": round(stats.put_s, 3),
            "write_mb_per_s": _throughput(stats),
        }
        ttfts, cached, load_ms = [], [], []
        for _ in range(repeats):
            if name == "disk":
                _drop_page_cache(workdir / "disk")
            reader = build_engine(loaded, num_blocks=4 * request_blocks, block_size=bs, **options)
            out = serve_one(reader, prefix + ids(suffix_len))
            ttfts.append(out.ttft_s * 1e3)
            cached.append(out.num_cached_tokens)
            load_ms.append(reader.runner.tier_moves.load_s * 1e3)
            reader.runner.close()
        cases[name] = _case(ttfts, cached, load_ms_per_request=round(statistics.median(load_ms), 2))
    return cases, writes


def _v4_cases(v4_prefix_len: int, swa_period: int, repeats: int, seed: int, workdir: Path) -> dict:
    """tiny-dsv4 through the disk tier: one row per SWA strategy (and recompute)."""
    import torch

    from kvpool.engine.build import build_engine
    from kvpool.models.tiny_dsv4 import TINY_DSV4_CONFIG, TinyDSV4
    from kvpool.spec.dsv4 import DSV4Spec
    from kvpool.tiers.swa import SWAStrategy

    rng = random.Random(seed + 1)
    vocab = TINY_DSV4_CONFIG["vocab_size"]
    prefix = [rng.randrange(vocab) for _ in range(v4_prefix_len)]
    span = DSV4Spec.from_config(TINY_DSV4_CONFIG).span
    num_blocks = -(-(v4_prefix_len + 64) // span) + 4
    strategies = {
        "recompute": None,
        "full": SWAStrategy("full"),
        f"periodic {swa_period}": SWAStrategy("periodic", swa_period),
        "zero": SWAStrategy("zero"),
    }
    rows: dict[str, dict] = {}
    for name, strategy in strategies.items():
        directory = workdir / f"v4-{name.split()[0]}"
        options = {} if strategy is None else {"disk_cache": directory, "swa": strategy}
        written = None
        if strategy is not None:
            writer = build_engine(TinyDSV4(), num_blocks=num_blocks, **options)
            serve_one(writer, prefix + [rng.randrange(vocab) for _ in range(16)])
            writer.runner.close()
            written = writer.runner.tier_reports()["swa"]
        ttfts, restore_ms, swa = [], [], {}
        for _ in range(repeats):
            if strategy is not None:
                _drop_page_cache(directory)
            reader = build_engine(TinyDSV4(), num_blocks=num_blocks, **options)
            with torch.inference_mode():
                out = serve_one(reader, prefix + [rng.randrange(vocab) for _ in range(16)])
            ttfts.append(out.ttft_s * 1e3)
            if strategy is not None:
                swa = reader.runner.tier_reports()["swa"]
                restore_ms.append(swa["snapshot_load_ms"] + swa["replay_ms"])
                reader.runner.close()
        row = {"ttft_ms_p50": round(statistics.median(ttfts), 1), "cached_tokens": out.num_cached_tokens}
        if written is not None:
            row |= {
                "bytes_per_cached_token": written["bytes_per_cached_token"],
                "entry_bytes": written["block_bytes_persisted"],
                "snapshot_bytes": written["snapshot_bytes_persisted"],
                "snapshots_read": swa["snapshots_loaded"],
                "tokens_recomputed": swa["replayed_tokens"],
                "restore_ms_p50": round(statistics.median(restore_ms), 1),
            }
        rows[name] = row
    return rows


def measure(
    prefix_len: int = 2048,
    suffix_len: int = 16,
    repeats: int = 3,
    block_size: int = 16,
    v4_prefix_len: int = 2304,
    swa_period: int = 512,
    redis: str | None = None,
    seed: int = 0,
) -> dict:
    """Every case above; `redis`: a Redis server's URL (None: a private redis-server, if one
    is installed, else the Redis case is skipped and "redis" says why). The object `kvpool
    bench tiers --json` prints."""
    if prefix_len % block_size:
        raise ValueError(f"--prefix-len {prefix_len} is not a multiple of --block-size {block_size}")
    from kvpool.models.tiny_dsv4 import TINY_DSV4_CONFIG
    from kvpool.spec.dsv4 import DSV4Spec
    from kvpool.tiers.swa import SWAStrategy

    SWAStrategy("periodic", swa_period).check(DSV4Spec.from_config(TINY_DSV4_CONFIG).span)
    v4_positions = TINY_DSV4_CONFIG["max_position_embeddings"]
    if v4_prefix_len + 16 + 1 > v4_positions:  # (the prefix, 16 new tokens, the output token)
        raise ValueError(
            f"--v4-prefix-len {v4_prefix_len} with its 16 new tokens and the output token needs "
            f"{v4_prefix_len + 17:,} positions; tiny-dsv4 has {v4_positions:,} (its max_position_embeddings)"
        )
    if redis is not None:
        from kvpool.tiers.redis_tier import check_url

        check_url(redis)
    with tempfile.TemporaryDirectory(prefix="kvpool-bench-tiers-") as tmp, contextlib.ExitStack() as stack:
        workdir = Path(tmp)
        redis_url, redis_note = redis, "given"
        if redis_url is None:
            from kvpool.tiers.redis_server import LocalRedisServer

            try:
                redis_url = stack.enter_context(LocalRedisServer(workdir)).url
                redis_note = "a private redis-server on 127.0.0.1"
            except RuntimeError as e:
                redis_note = f"skipped: {e}"
        cases, writes = _llama_cases(prefix_len, suffix_len, repeats, block_size, seed, workdir, redis_url)
        v4 = _v4_cases(v4_prefix_len, swa_period, repeats, seed, workdir)
    return {
        "prefix_len": prefix_len,
        "suffix_len": suffix_len,
        "block_size": block_size,
        "redis": redis_note,
        "cases": cases,
        "writes": writes,
        "v4_prefix_len": v4_prefix_len,
        "v4_swa": v4,
    }
