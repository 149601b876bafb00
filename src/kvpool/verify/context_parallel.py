"""`kvpool verify cp`: context-parallel decode attention (attention/context_parallel.py) over
torch.distributed, against single-rank attention. Run under torchrun, one process a rank:

    torchrun --nproc-per-node 4 -m kvpool verify cp [--context 32768] [--json]

Two checks, every rank taking part, rank 0 reporting:

paged: --batch sequences of --context tokens in SmolLM2-135M's attention geometry (9 query
  heads, 3 KV heads of 64), random K / V and queries of a fixed seed. Each rank builds only
  its blocks (block j of a sequence on rank j mod R), at scattered ids of a pool of its
  own, and the ranks attend together (cp_decode_attention). Rank 0 also builds every block
  into one pool and runs the engine's single-rank decode attention (attention/paged.py) in
  fp32 and in fp64. Passes when the context-parallel output is within 8 times the
  single-rank fp32 path's own error against fp64 (both round in fp32, in another order).

smollm2: the real model. A --smollm2-prompt-token prompt of the Python Language Reference
  topics is prefilled on every rank (the same computation), then each rank overwrites the
  blocks it does not own with NaN, and --steps greedy tokens are decoded with every layer's
  attention context-parallel (a new token's K / V is written by the rank that owns its
  block only). The same decode on one rank over the intact pool is the reference: the
  tokens must be equal, and every decode step's logits within 8 times the single-rank fp32
  path's own error against the fp64 model (teacher-forced over the same tokens: the ranks'
  partial softmaxes may only round in another order), as `kvpool verify tp` bounds them. A
  NaN read anywhere would reach the logits, so this also shows no rank reads another's
  blocks. It needs --steps >= 2: the first token comes from the prefill, the decode steps
  after it are what is checked.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence

import torch
import torch.distributed as dist

from kvpool.attention.backends.step import function_step
from kvpool.attention.context_parallel import cp_decode_attention, local_block_indices, local_num_keys, owner_of
from kvpool.attention.paged import decode_attention, paged_attention, plan_step
from kvpool.models.tensor_parallel import check_rendezvous_env, check_same_arguments, join_group
from kvpool.storage.kv import PagedKVStorage

HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64  # SmolLM2-135M


def _block_values(seed: int, seq: int, block: int, bs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Block `block` of sequence `seq`: K^T [KVH, D, bs] and V [KVH, bs, D], fp64, the same on every rank."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + seq * 65_537 + block)
    return (
        torch.randn(KV_HEADS, HEAD_DIM, bs, generator=g, dtype=torch.float64),
        torch.randn(KV_HEADS, bs, HEAD_DIM, generator=g, dtype=torch.float64),
    )


def paged_lengths(context: int, batch: int) -> list[int]:
    """The paged check's sequence lengths: context, context - 7, context - 14, ... (a
    partial last block but for the first); the CLI refuses flags whose last is below 1."""
    return [context - 7 * i for i in range(batch)]


def paged_check_bytes(context: int, batch: int, bs: int) -> int:
    """The memory check_paged's rank 0 holds at the least: the single-rank reference's pool of
    every sequence's blocks, K and V in fp64 and again in fp32. (--context 1000000000 --batch
    100 was a MemoryError's traceback on every rank, after a minute of listing block ids.)"""
    return batch * -(-context // bs) * bs * KV_HEADS * HEAD_DIM * 2 * (8 + 4)


def check_paged(rank: int, world: int, batch: int, context: int, bs: int, seed: int) -> dict[str, object] | None:
    """The paged check; rank 0 returns its figures, the others None."""
    num_blocks = -(-context // bs)
    lens = paged_lengths(context, batch)
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, HEADS, HEAD_DIM, generator=g, dtype=torch.float64)
    scale = HEAD_DIM**-0.5
    # this rank's blocks, at scattered ids of its own pool
    mine = [local_block_indices(-(-n // bs), rank, world) for n in lens]
    count = sum(len(m) for m in mine)
    order = torch.randperm(max(count, 1), generator=torch.Generator().manual_seed(seed + 1 + rank)).tolist()
    k_local = torch.zeros(max(count, 1), KV_HEADS, HEAD_DIM, bs)
    v_local = torch.zeros(max(count, 1), KV_HEADS, bs, HEAD_DIM)
    tables: list[list[int]] = []
    slot = 0
    for s, blocks in enumerate(mine):
        table = []
        for j in blocks:
            k, v = _block_values(seed, s, j, bs)
            k_local[order[slot]], v_local[order[slot]] = k, v
            table.append(order[slot])
            slot += 1
        tables.append(table)
    dist.barrier()
    start = time.perf_counter()
    out = cp_decode_attention(
        q.float(), k_local, v_local, tables, [local_num_keys(n, bs, rank, world) for n in lens], scale
    )
    cp_s = time.perf_counter() - start
    if rank != 0:
        return None
    # the single-rank reference: every block in one pool, scattered
    total = batch * num_blocks
    perm = torch.randperm(total, generator=torch.Generator().manual_seed(seed + 99)).tolist()
    k_all = torch.zeros(total, KV_HEADS, HEAD_DIM, bs, dtype=torch.float64)
    v_all = torch.zeros(total, KV_HEADS, bs, HEAD_DIM, dtype=torch.float64)
    full_tables = []
    for s, n in enumerate(lens):
        table = perm[s * num_blocks : s * num_blocks + -(-n // bs)]
        for j, b in enumerate(table):
            k_all[b], v_all[b] = _block_values(seed, s, j, bs)
        full_tables.append(table)
    indptr = [0]
    for t in full_tables:
        indptr.append(indptr[-1] + len(t))
    last = [t[(n - 1) // bs] * bs + (n - 1) % bs for t, n in zip(full_tables, lens, strict=True)]
    refs = {}
    for dtype in (torch.float32, torch.float64):
        plan = plan_step(
            [1] * batch,
            lens,
            last,
            indptr,
            [b for t in full_tables for b in t],
            bs,
            HEADS,
            KV_HEADS,
            HEAD_DIM,
            torch.device("cpu"),
            dtype,
            "padded",
        ).decode
        assert plan is not None
        start = time.perf_counter()
        refs[dtype] = decode_attention(q.to(dtype), k_all.to(dtype), v_all.to(dtype), plan, scale).double()
        if dtype == torch.float32:
            single_s = time.perf_counter() - start
    ref64 = refs[torch.float64]
    own = max((refs[torch.float32] - ref64).abs().max().item(), 2.0**-24 * ref64.abs().max().item())
    err = (out.double() - ref64).abs().max().item()
    return {
        "check": "paged",
        "world_size": world,
        "batch": batch,
        "context": context,
        "block_size": bs,
        "max_abs_error": err,
        "single_rank_fp32_error": own,
        "error_ratio": err / own,
        "passed": err <= 8 * own,
        "cp_ms": round(cp_s * 1e3, 2),
        "single_rank_ms": round(single_s * 1e3, 2),
    }


def check_smollm2(rank: int, world: int, prompt_len: int, steps: int, bs: int) -> dict[str, object] | None:
    if steps < 2:  # the first token is the prefill's: no decode step's logits to bound
        raise ValueError(f"--steps {steps} decodes nothing after the prefill's token: give --steps 2 or more")
    from pydoc_data.topics import topics

    from kvpool.engine.build import load_model

    loaded = load_model(device="cpu")
    model, cfg = loaded.model, loaded.model.config
    text = "\n\n".join(topics[k] for k in sorted(topics))
    prompt = loaded.tokenizer.encode(text)[:prompt_len]
    n_total = len(prompt) + steps
    num_blocks = -(-n_total // bs)
    table = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(7)).tolist()  # scattered
    storage = PagedKVStorage(cfg.num_layers, num_blocks, bs, cfg.num_kv_heads, cfg.head_dim)
    scale = cfg.head_dim**-0.5
    dev = torch.device("cpu")

    def slot(p: int) -> int:
        return table[p // bs] * bs + p % bs

    def step(ids: Sequence[int], start: int, attend_with) -> torch.Tensor:
        end = start + len(ids)
        nb = -(-end // bs)
        plan = plan_step(
            [len(ids)],
            [end],
            [slot(p) for p in range(start, end)],
            [0, nb],
            table[:nb],
            bs,
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
            dev,
            decode_path="padded",
        )
        metadata = function_step(lambda layer, q, k, v: attend_with(layer, q, k, v, plan), len(ids), [len(ids) - 1])
        return model.forward(torch.tensor(list(ids)), torch.arange(start, end), metadata)[0]

    def single(st: PagedKVStorage):
        def attend(layer, q, k, v, plan):
            st.write(layer, st.write_index(plan.slots), k, v)
            return paged_attention(q, st.k_layers[layer], st.v_layers[layer], plan, scale)

        return attend

    logits = step(prompt, 0, single(storage))
    first = int(logits.argmax())
    reference = PagedKVStorage(cfg.num_layers, num_blocks, bs, cfg.num_kv_heads, cfg.head_dim)
    reference.k.copy_(storage.k)
    reference.v.copy_(storage.v)
    for j, b in enumerate(table):  # the blocks another rank owns: NaN here
        if owner_of(j, world) != rank:
            storage.k[:, b] = float("nan")
            storage.v[:, b] = float("nan")
    mine = [table[j] for j in local_block_indices(num_blocks, rank, world)]

    now = {"pos": len(prompt)}  # the position of the token being decoded

    def cp_attend(layer, q, k, v, plan):
        pos = now["pos"]
        if owner_of(pos // bs, world) == rank:
            storage.write(layer, storage.write_index(plan.slots), k, v)
        n = local_num_keys(pos + 1, bs, rank, world)
        local = mine[: -(-n // bs)] if n else []
        return cp_decode_attention(q, storage.k_layers[layer], storage.v_layers[layer], [local], [n], scale)

    tokens = {"cp": [first], "single": [first]}
    ref_rows: list[torch.Tensor] = []  # the single-rank fp32 logits of each decode step
    worst = 0.0
    finite = True
    start_s = time.perf_counter()
    for done in range(steps - 1):
        now["pos"] = pos = len(prompt) + done
        cp_logits = step([tokens["cp"][-1]], pos, cp_attend)
        ref_logits = step([tokens["single"][-1]], pos, single(reference))
        finite = finite and bool(torch.isfinite(cp_logits).all())
        worst = max(worst, (cp_logits - ref_logits).abs().max().item())
        ref_rows.append(ref_logits)
        tokens["cp"].append(int(cp_logits.argmax()))
        tokens["single"].append(int(ref_logits.argmax()))
    elapsed = time.perf_counter() - start_s
    if rank != 0:
        return None
    # the single-rank path's own fp32 error: its logits against the fp64 model's over the
    # same tokens (rows [len(prompt), len(prompt) + steps - 1): the decode steps)
    from kvpool.attention.reference import reference_logits

    fed = prompt + tokens["single"][:-1]
    exact = reference_logits(model.astype(torch.float64), fed, fused=False)[len(prompt) :]
    single_fp32 = torch.stack(ref_rows).double()
    own = max((single_fp32 - exact).abs().max().item(), 2.0**-24 * exact.abs().max().item())
    tokens_equal = tokens["cp"] == tokens["single"]
    return {
        "check": "smollm2",
        "world_size": world,
        "prompt_tokens": len(prompt),
        "steps": steps,
        "block_size": bs,
        "tokens_equal": tokens_equal,
        "max_logit_difference": worst,
        "single_rank_fp32_error": own,
        "finite": finite,
        "passed": tokens_equal and finite and worst <= 8 * own,
        "seconds": round(elapsed, 2),
    }


def run_all(context: int, batch: int, block_size: int, prompt_len: int, steps: int, seed: int) -> list[dict] | None:
    """Every check on this rank (under torchrun); rank 0 returns the results."""
    if "WORLD_SIZE" not in os.environ or "RANK" not in os.environ:
        raise ValueError("kvpool verify cp runs under torchrun: torchrun --nproc-per-node R -m kvpool verify cp")
    check_rendezvous_env()
    if int(os.environ["WORLD_SIZE"]) < 2:  # every block on the one rank: nothing split, nothing merged
        raise ValueError(
            "kvpool verify cp under 1 process splits no sequence over ranks and verifies nothing of context "
            "parallelism: torchrun --nproc-per-node 4 -m kvpool verify cp"
        )
    join_group()  # every wait bounded (GROUP_TIMEOUT_S); a group that cannot form: one line
    try:
        check_same_arguments("context-parallel", context, batch, block_size, prompt_len, steps, seed)
        rank, world = dist.get_rank(), dist.get_world_size()
        torch.set_num_threads(1)
        results = [check_paged(rank, world, batch, context, block_size, seed)]
        if prompt_len:
            results.append(check_smollm2(rank, world, prompt_len, steps, block_size))
        dist.barrier()
        return [r for r in results if r is not None] if rank == 0 else None
    finally:
        dist.destroy_process_group()
