"""Tensor parallelism for the Llama path (Megatron-style), over torch.distributed.

Rank r of T keeps query heads [r H/T, (r+1) H/T), KV heads [r KVH/T, (r+1) KVH/T), and
MLP columns [r I/T, (r+1) I/T): the fused wqkv and w_gate_up split by output columns, wo
and w_down by input rows. Each rank's attention reads only its own KV heads, so its KV
pool holds 1/T of every block (storage/kv.py on the sharded config): a block table, and so
every cache decision, is the same on every rank. The partial products of wo and w_down are
summed over the ranks (an all-reduce) before the residual add; embedding, norms and the
LM head are whole on every rank, so every rank computes the same logits and samples the
same token.

Heads are not split across ranks, nor replicated: T must divide both head counts (and the
MLP width). SmolLM2-135M has 9 query and 3 KV heads: TP 1 and TP 3. TP 2 would need a KV
head replicated on both ranks (its bytes stored twice) and 4.5 query heads a rank; it is
refused, naming the counts.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from kvpool.models.llama import LlamaModel


def check_tp(config, tp: int) -> None:
    """ValueError naming the counts when `tp` ranks cannot each hold whole heads."""
    if tp <= 0:
        raise ValueError(f"--tp must be positive, got {tp}")
    bad = [
        f"{n} {what}"
        for n, what in (
            (config.num_heads, "query heads"),
            (config.num_kv_heads, "KV heads"),
            (config.intermediate_size, "MLP columns"),
        )
        if n % tp
    ]
    if bad:
        divisors = [t for t in range(1, config.num_kv_heads + 1) if config.num_kv_heads % t == 0]
        divisors = [t for t in divisors if config.num_heads % t == 0 and config.intermediate_size % t == 0]
        raise ValueError(
            f"--tp {tp} does not divide the model's {', '.join(bad)} (each rank keeps whole heads, none "
            f"replicated); use --tp {' or '.join(str(t) for t in divisors)}"
        )


def shard_llama(model: LlamaModel, rank: int, world: int, group: dist.ProcessGroup | None = None) -> LlamaModel:
    """Shard `rank` (within the TP group) of `model` (see the module docstring), whose
    forward all-reduces over `group` (None: the default group, all of torchrun's ranks)."""
    cfg = model.config
    check_tp(cfg, world)
    if world == 1:
        return model
    h, kvh, d, inter = cfg.num_heads // world, cfg.num_kv_heads // world, cfg.head_dim, cfg.intermediate_size // world
    q_cols = slice(rank * h * d, (rank + 1) * h * d)
    k0 = cfg.num_heads * d
    k_cols = slice(k0 + rank * kvh * d, k0 + (rank + 1) * kvh * d)
    v0 = k0 + cfg.num_kv_heads * d
    v_cols = slice(v0 + rank * kvh * d, v0 + (rank + 1) * kvh * d)
    layers = []
    for layer in model.layers:
        wqkv = layer["wqkv"]
        gate_up = layer["w_gate_up"]
        gate = slice(rank * inter, (rank + 1) * inter)
        up = slice(cfg.intermediate_size + rank * inter, cfg.intermediate_size + (rank + 1) * inter)
        layers.append(
            {
                "attn_norm": layer["attn_norm"],
                "ffn_norm": layer["ffn_norm"],
                "wqkv": torch.cat([wqkv[:, q_cols], wqkv[:, k_cols], wqkv[:, v_cols]], dim=1).contiguous(),
                "wo": layer["wo"][q_cols].contiguous(),
                "w_gate_up": torch.cat([gate_up[:, gate], gate_up[:, up]], dim=1).contiguous(),
                "w_down": layer["w_down"][rank * inter : (rank + 1) * inter].contiguous(),
            }
        )
    config = dataclasses.replace(cfg, num_heads=h, num_kv_heads=kvh, intermediate_size=inter)
    shard = LlamaModel(config, model.embed, model.norm, layers, model.lm_head, model.device, model.kernels)

    def reduce(t: torch.Tensor) -> None:
        dist.all_reduce(t, group=group)

    shard.reduce = reduce
    shard.shard = (rank, world)
    shard.tp_group = group
    return shard


def init_tp(tp: int) -> tuple[int, int]:
    """(rank, world size) for --tp `tp`: 1 rank without torchrun; under torchrun its world,
    which must be `tp`; the gloo process group set up. ValueError otherwise."""
    import os

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if tp == 1 and world == 1:
        return 0, 1
    if "RANK" not in os.environ:
        raise ValueError(f"--tp {tp} runs under torchrun: torchrun --nproc-per-node {tp} -m kvpool ... --tp {tp}")
    if world != tp:
        raise ValueError(f"--tp {tp} under torchrun with {world} processes: start --nproc-per-node {tp}")
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    return dist.get_rank(), world


def check_same_step(digest: int, group: dist.ProcessGroup | None = None) -> None:
    """Every rank made the same cache decisions this step (the same slots, in the same
    order): RuntimeError naming the ranks otherwise. digest: a 63-bit hash of the step."""
    mine = torch.tensor([digest], dtype=torch.int64)
    lo, hi = mine.clone(), mine.clone()
    dist.all_reduce(lo, op=dist.ReduceOp.MIN, group=group)
    dist.all_reduce(hi, op=dist.ReduceOp.MAX, group=group)
    if int(lo) != int(hi):
        raise RuntimeError(f"rank {dist.get_rank(group)}: the ranks' cache decisions differ this step")
