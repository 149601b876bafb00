"""Seed 003's peak-memory ledger, one GPU of a tensor-parallel group:

    M_peak = M_weights + M_kv_pool + M_workspace + M_graph + M_allocator + M_transient

Each term is computed on its own line from a model, a KV layout and the serving limits in
`LedgerAssumptions`; the planner gives the KV pool whatever the other terms leave. The
non-KV terms are estimates of what an engine like vLLM / SGLang allocates, with every
assumption a named field (defaults below) that the CLI can change:

- workspace: activations of the largest forward pass, `max_num_batched_tokens` tokens:
  residual + normed input + attention output (3 x hidden) plus the widest per-rank
  intermediate (q/k/v, MLA up-projection, or gate+up+act of the MLP), in the activation
  dtype; for MoE also the fused-MoE caches, tokens x top-k x (3 x moe_intermediate / tp +
  hidden); and the sampler's fp32 logits and probabilities for `max_num_seqs` rows of the
  full vocabulary.
- graph: CUDA graphs captured for decode batches up to `max_num_seqs`: the graph pool keeps
  the activations of the largest captured batch, plus `graph_bytes_per_capture` of
  bookkeeping for each of `num_graph_captures` graphs.
- allocator: the CUDA context with cuBLAS / cuBLASLt handles (`cuda_context_bytes`; a
  PyTorch process shows ~0.5 GiB before it allocates anything), plus the caching
  allocator's fragmentation: a `fragmentation_fraction` of the dynamic allocations
  (workspace + transient), whose sizes vary step to step and split cached segments; plus
  one 2 MiB segment round-up per KV tensor (one tensor per layer and page group).
- transient: copy-on-write reserve (one block of every group per running request: a fork
  must copy its shared tail before either side appends) and communication staging for
  TP > 1: an out-of-place all-reduce buffer of the largest activation (tokens x hidden)
  plus `nccl_buffer_bytes` of NCCL channel buffers; with expert parallelism, all-to-all
  dispatch / combine buffers (2 x tokens x top-k x hidden).
- kv_pool: the blocks themselves (data, quantization scales, alignment padding, V4 state,
  the chunked formats' full-precision tails per running request)
  and the block tables (int32, `max_num_seqs` x blocks of the longest request, per group)
  plus per-step slot mappings (int64 per batched token). Block tables are counted before the
  pool is sized, so they are never given to blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvpool.capacity.kv import KVLayout
from kvpool.spec.models import ModelSpec

MIB = 1 << 20
GIB = 1 << 30

TERMS: tuple[str, ...] = ("weights", "kv_pool", "workspace", "graph", "allocator", "transient")


@dataclass(frozen=True)
class LedgerAssumptions:
    """Serving limits and runtime overheads the non-KV ledger terms are computed from."""

    max_num_batched_tokens: int = 8192  # tokens in one forward step (chunked prefill + decodes)
    max_num_seqs: int = 256  # running requests (scheduler limit; CUDA graphs up to this batch)
    activation_bytes: int = 2  # BF16 activations
    cuda_graphs: bool = True
    num_graph_captures: int = 35  # batch sizes 1, 2, 4, then 8..256 in steps of 8
    graph_bytes_per_capture: int = 2 * MIB
    cuda_context_bytes: int = 512 * MIB
    fragmentation_fraction: float = 0.10
    segment_bytes: int = 2 * MIB  # caching-allocator rounding of a large tensor
    nccl_buffer_bytes: int = 512 * MIB  # TP > 1 only
    cow_blocks_per_seq: int = 1

    def __post_init__(self) -> None:
        for field in ("max_num_batched_tokens", "max_num_seqs", "activation_bytes"):
            if getattr(self, field) <= 0:
                raise ValueError(f"{field} must be positive, got {getattr(self, field)}")
        if not 0 <= self.fragmentation_fraction < 1:
            raise ValueError(f"fragmentation_fraction must be in [0, 1), got {self.fragmentation_fraction}")


@dataclass(frozen=True)
class Ledger:
    """One GPU's peak memory, term by term (bytes), with the sub-lines of each term."""

    capacity: int  # what the GPU (or --memory-gib) offers
    terms: dict[str, float]  # TERMS -> bytes
    details: dict[str, dict[str, float]]  # term -> sub-line -> bytes
    pool_key: str = "pool"  # the kv_pool line of the blocks themselves

    @property
    def total(self) -> float:
        return sum(self.terms.values())

    @property
    def pool_bytes(self) -> float:
        """The bytes given to KV blocks and state blocks (kv_pool less its metadata)."""
        return self.details["kv_pool"][self.pool_key]

    @property
    def free(self) -> float:
        """Capacity no term uses (below the page alignment), or negative when nothing fits."""
        return self.capacity - self.total

    def as_dict(self) -> dict[str, float]:
        return {**self.terms, "total": self.total, "capacity": float(self.capacity), "free": self.free}


def _widest_intermediate(model: ModelSpec, tp: int) -> int:
    """Per-rank width of the widest activation inside one layer (elements per token)."""
    h = model.hidden_size
    if model.attention == "gqa":
        kv_heads = max(1, model.num_kv_heads // tp)
        attn = (model.num_heads // tp + 2 * kv_heads) * model.head_dim
    elif model.attention == "mla":
        mla = model.mla
        assert mla is not None
        # q for all local heads + the up-projected K (nope + rope) and V of the prefill path
        qk = mla.qk_nope_head_dim + mla.qk_rope_head_dim
        attn = model.num_heads // tp * (2 * qk + mla.v_head_dim)
    else:
        attn = model.num_heads // tp * model.head_dim * 2  # q and the attention output
    mlp = 3 * model.intermediate_size // tp if not model.moe or len(model.moe.moe_layers) < model.num_layers else 0
    if model.moe and model.moe.num_shared_experts:
        mlp = max(mlp, 3 * model.moe.num_shared_experts * model.moe.expert_intermediate_size // tp)
    return max(attn, mlp, h)


def forward_activation_bytes(
    model: ModelSpec, tp: int, num_tokens: int, activation_bytes: int, expert_parallel: bool = False
) -> dict[str, float]:
    """Activations of one forward of `num_tokens` tokens on one rank: dense part and MoE caches.

    Under expert parallelism a rank's experts are whole (not TP-split) and, with balanced
    routing, receive as many token-expert pairs as the rank sent: tokens x top-k.
    """
    h = model.hidden_size
    dense = num_tokens * activation_bytes * (3 * h + _widest_intermediate(model, tp))
    moe = 0.0
    if model.moe is not None:
        n = model.moe.expert_intermediate_size
        expert_split = 1 if expert_parallel else tp
        moe = num_tokens * model.moe.experts_per_token * activation_bytes * (3 * n / expert_split + h)
    return {"activations": float(dense), "moe_buffers": float(moe)}


def build_ledger(
    model: ModelSpec,
    layout: KVLayout,
    weights_per_gpu: float,
    capacity: int,
    max_model_len: int,
    assumptions: LedgerAssumptions = LedgerAssumptions(),
    ep: int | None = None,
) -> Ledger:
    """The ledger with the KV pool sized to what the other terms leave.

    The pool is rounded down to the page alignment; the remainder shows as `free`. A
    negative remainder gives an empty pool (the model does not fit) and a ledger whose
    total exceeds the capacity.
    """
    a = assumptions
    tp = layout.tp
    T, S = a.max_num_batched_tokens, a.max_num_seqs

    expert_parallel = ep is not None and ep > 1 and model.moe is not None
    fwd = forward_activation_bytes(model, tp, T, a.activation_bytes, expert_parallel)
    logits = 2.0 * S * model.vocab_size * 4  # fp32 logits + probabilities, full vocab per row
    workspace = {**fwd, "sampler_logits": logits}

    graph: dict[str, float] = {}
    if a.cuda_graphs:
        graph_fwd = forward_activation_bytes(model, tp, S, a.activation_bytes, expert_parallel)
        graph = {
            "captured_activations": graph_fwd["activations"] + graph_fwd["moe_buffers"],
            "graph_bookkeeping": float(a.num_graph_captures * a.graph_bytes_per_capture),
        }

    transient = {
        "cow_reserve": float(S * a.cow_blocks_per_seq * layout.bytes_per_block_all_groups),
        "comm_staging": float(T * model.hidden_size * a.activation_bytes + a.nccl_buffer_bytes) if tp > 1 else 0.0,
    }
    if expert_parallel:
        assert model.moe is not None
        # all-to-all dispatch and combine buffers: tokens x top-k x hidden, each way, + NCCL
        transient["ep_all_to_all"] = float(
            2 * T * model.moe.experts_per_token * model.hidden_size * a.activation_bytes
            + (a.nccl_buffer_bytes if tp == 1 else 0)
        )

    # + V4's state pool, or the chunked formats' two tail tensors (K and V, storage/kv.py)
    state_tensors = 2 if layout.tail_bytes_per_request else 1 if layout.state_bytes_per_request else 0
    num_kv_tensors = sum(g.num_layers for g in layout.groups) + state_tensors
    allocator = {
        "cuda_context": float(a.cuda_context_bytes),
        "fragmentation": a.fragmentation_fraction * (sum(workspace.values()) + sum(transient.values())),
        "segment_rounding": float(num_kv_tensors * a.segment_bytes),
    }

    max_blocks = sum(g.num_blocks(max_model_len) for g in layout.groups)
    block_tables = float(S * max_blocks * 4 + T * 8)  # int32 tables + int64 slot mapping

    fixed = {
        "weights": float(weights_per_gpu),
        "workspace": sum(workspace.values()),
        "graph": sum(graph.values()),
        "allocator": sum(allocator.values()),
        "transient": sum(transient.values()),
    }
    remaining = capacity - sum(fixed.values()) - block_tables - layout.fixed_scale_bytes
    # The pool takes the rest, rounded down to the page alignment; engines then carve it
    # into blocks (and V4 state blocks) as requests need them.
    pool = float(max(0, int(remaining) // layout.alignment * layout.alignment))
    kv_pool = {
        "pool": pool,
        "quant_scales_fixed": float(layout.fixed_scale_bytes),
        "block_tables": block_tables,
    }
    terms = {
        "weights": fixed["weights"],
        "kv_pool": pool + block_tables + layout.fixed_scale_bytes,
        "workspace": fixed["workspace"],
        "graph": fixed["graph"],
        "allocator": fixed["allocator"],
        "transient": fixed["transient"],
    }
    details = {
        "kv_pool": kv_pool,
        "workspace": workspace,
        "graph": graph,
        "allocator": allocator,
        "transient": transient,
    }
    return Ledger(capacity, terms, details)
