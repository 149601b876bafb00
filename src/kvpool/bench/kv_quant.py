"""`kvpool bench kv-quant`'s measurement: decode attention over quantized KV blocks against fp32, on the same
path, at serving scale (issue 14).

SmolLM2-135M's attention geometry (9 query heads, 3 KV heads of 64), --batch sequences of
--context tokens each, --block-size-token blocks scattered over the pool in a random order
(as a long-running pool leaves them), random K / V. For each format, one decode step of one
layer's attention, timed over --repeats calls that cycle through --layers layers (each layer
its own pool, so no call finds the last one's bytes in cache):
  - native: the C kernels, fp32 (kv_decode_attention) or 8-bit codes and scales read in
    place (kv_decode_attention_q8: each block decoded once per KV head into an L1 buffer);
  - torch: the torch twin, the step's blocks dequantized into a scratch, then the
    embedding_bag decode (what runs without the C kernels, and for bf16 / fp16 / KIVI).
Printed: milliseconds per layer-step (median), the pool bytes read per layer-step, and the
effective read bandwidth; and the speed-up against fp32 on the same path.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence

DEFAULT_FORMATS = ("fp32", "int8", "fp8_e4m3", "fp8_e4m3_token", "bf16")


def measure(
    batch: int = 16,
    context: int = 4096,
    block_size: int = 16,
    layers: int = 3,
    repeats: int = 15,
    formats: Sequence[str] = DEFAULT_FORMATS,
    paths: Sequence[str] = ("native", "torch"),
    threads: int | None = None,
    seed: int = 0,
) -> dict:
    """The geometry, the thread count, and per format a row: bytes read per layer-step and,
    per path, the median ms, GB/s and the speed-up against fp32 on that path. A format the
    path cannot read in place (native) has no figures for it."""
    import torch

    from kvpool.attention.paged import plan_step
    from kvpool.engine.memory import check_fits
    from kvpool.kernels import cpu_kernels
    from kvpool.storage.kv import QuantizedKVStorage, SeqSpan
    from kvpool.storage.quant import kv_schema

    if min(batch, context, block_size, layers, repeats) <= 0:
        raise ValueError("batch, context, block_size, layers and repeats must be positive")
    for p in paths:
        if p not in ("native", "torch"):
            raise ValueError(f"--paths: unknown path {p!r}; native or torch")
    if threads:
        torch.set_num_threads(threads)
    kernels = cpu_kernels() if "native" in paths else None
    if "native" in paths and kernels is None:
        raise ValueError("--paths native: the C kernels are not available on this machine (KVPOOL_NATIVE=0?)")
    heads, kvh, d, bs = 9, 3, 64, block_size
    nb_seq = -(-context // bs)
    num_blocks = batch * nb_seq
    for name in formats:
        kv_schema(name).check(bs, d)  # a KIVI residual that does not divide the block: named first
    check_fits(
        pool_bytes_needed(formats, layers, num_blocks, bs, kvh, d),
        "cpu",
        f"--batch {batch} x --context {context} over --layers {layers}",
        "lower --batch, --context or --layers",
    )
    g = torch.Generator().manual_seed(seed)
    order = torch.randperm(num_blocks, generator=g).tolist()
    tables = [order[i * nb_seq : (i + 1) * nb_seq] for i in range(batch)]
    indptr = [i * nb_seq for i in range(batch + 1)]
    indices = [b for t in tables for b in t]
    ctx = [context] * batch
    slots_last = [t[(context - 1) // bs] * bs + (context - 1) % bs for t in tables]
    q = torch.randn(batch, heads, d, generator=g)
    scale = d**-0.5
    all_slots = torch.tensor([b * bs + o for b in indices for o in range(bs)])[: num_blocks * bs]
    results = []
    for name in formats:
        fmt = kv_schema(name)
        storage = QuantizedKVStorage(layers, num_blocks, bs, kvh, d, fmt) if fmt.scaled or name != "fp32" else None
        k_pools: list = []
        v_pools: list = []
        if name == "fp32":
            k_pools = [torch.randn(num_blocks, kvh, d, bs, generator=g) for _ in range(layers)]
            v_pools = [torch.randn(num_blocks, kvh, bs, d, generator=g) for _ in range(layers)]
            pool_bytes = k_pools[0].nbytes + v_pools[0].nbytes
        else:
            assert storage is not None
            # every block written whole, each sequence's span (KIVI keeps each one's last R values exact)
            spans = [SeqSpan(t, 0, nb_seq * bs) for t in tables]
            index = storage.write_index(all_slots, spans)
            for layer in range(layers):
                k = torch.randn(all_slots.shape[0], kvh, d, generator=g)
                storage.write(layer, index, k, torch.randn(all_slots.shape[0], kvh, d, generator=g))
            storage.write_index(torch.zeros(0, dtype=torch.long), [])  # the filled blocks' tails go
            pool_bytes = storage.num_bytes // layers
        row = {"format": name, "bytes_per_layer_step": pool_bytes}
        for path in paths:
            if path == "native" and name != "fp32" and not (storage is not None and storage.reads_natively):
                continue
            decode_path = "native" if path == "native" else "bags"
            plan = plan_step(
                [1] * batch,
                ctx,
                slots_last,
                indptr,
                indices,
                bs,
                heads,
                kvh,
                d,
                torch.device("cpu"),
                decode_path=decode_path,
                kernels=kernels,
            ).decode
            assert plan is not None
            blocks = torch.tensor(indices)
            read = storage.read_index(torch.unique(blocks)) if storage is not None else None

            call = _caller(name, path, storage, k_pools, v_pools, plan, read, q, scale, kernels)
            for layer in range(layers):  # warm-up
                call(layer)
            times = []
            for i in range(repeats):
                start = time.perf_counter()
                call(i % layers)
                times.append(time.perf_counter() - start)
            ms = statistics.median(times) * 1e3
            row[f"{path}_ms"] = round(ms, 3)
            row[f"{path}_gb_s"] = round(pool_bytes / (ms * 1e-3) / 1e9, 2)
        results.append(row)
    for path in paths:
        base = next((r.get(f"{path}_ms") for r in results if r["format"] == "fp32"), None)
        for r in results:
            if base and r.get(f"{path}_ms"):
                r[f"{path}_speedup_vs_fp32"] = round(base / r[f"{path}_ms"], 2)
    report = {
        "batch": batch,
        "context": context,
        "block_size": bs,
        "heads": heads,
        "kv_heads": kvh,
        "head_dim": d,
        "threads": torch.get_num_threads(),
        "formats": results,
    }
    return report


def pool_bytes_needed(
    formats: Sequence[str], layers: int, num_blocks: int, block_size: int, kv_heads: int, head_dim: int
) -> int:
    """The memory `measure` holds at its peak: the largest format's pools (fp32: K and V of
    every layer; a quantized format: its codes and scales, and its dequantization scratch,
    one fp32 layer), one fp32 layer of random K and V written into them, and the slot ids
    (int64). A pool past the machine's memory was the allocator's traceback, after minutes
    spent listing 10^10 slot ids in Python."""
    from kvpool.storage.kv import QuantizedKVStorage
    from kvpool.storage.quant import kv_schema

    layer_fp32 = 2 * block_size * kv_heads * head_dim * 4  # a block's K and V of one layer, fp32
    largest = 0
    for name in formats:
        if name == "fp32":
            pool = layers * layer_fp32
        else:
            fmt = kv_schema(name)
            pool = QuantizedKVStorage.block_bytes(layers, block_size, kv_heads, head_dim, fmt) + layer_fp32
        largest = max(largest, pool)
    return num_blocks * (largest + layer_fp32 + block_size * 8)


def _caller(name, path, storage, k_pools, v_pools, plan, read, q, scale, kernels):
    """One layer's decode attention for the format and path: call(layer)."""
    import torch

    from kvpool.attention.paged import decode_attention

    out = torch.empty_like(q)
    rows = torch.arange(q.shape[0])
    no_tails = torch.full((q.shape[0],), -1)

    def call(layer: int) -> None:
        if name == "fp32":
            decode_attention(q, k_pools[layer], v_pools[layer], plan, scale)
        elif path == "native":
            n = plan.native
            kernels.decode_attention_q8(
                q,
                rows,
                n.indptr,
                n.blocks,
                n.ctx_lens,
                storage.k_layers[layer],
                storage.v_layers[layer],
                storage.k_scale[layer],
                storage.v_scale[layer],
                no_tails,
                storage.tail_k[layer],
                storage.tail_v[layer],
                scale,
                out,
            )
        else:
            kc, vc = storage.dequantized(layer, read)
            decode_attention(q, kc, vc, plan, scale)

    return call
