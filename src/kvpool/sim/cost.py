"""The roofline cost model of one engine step: its FLOPs and bytes, and the seconds they take.

A step runs one chunk per scheduled sequence: chunk i computes n_i new tokens after c_i
cached ones, so its context after the step is ctx_i = c_i + n_i (a decode is (1, ctx)).
All figures are per GPU of a tensor-parallel group of `tp`:

    time_s    = gemm_s + prefill_attention_s + decode_attention_s + comm_s + host_s + fixed_s
    gemm_s    = max(linear_flops / (peak(weights) x ce) + moe_s, weight_bytes / (bandwidth x be))
    prefill_attention_s = max(prefill chunks' attention_flops / (peak(attention) x ce),
                              their kv bytes (read, written) / (bandwidth x be))
    decode_attention_s  = the same over the decodes
    host_s    = step_overhead_s + (eager ? num_layers x layer_launch_s : 0)
                + C x seq_overhead_s + (chunks with n_i > 1) x prefill_chunk_overhead_s
    fixed_s   = num_layers x layer_fixed_s        (the GPU's, graph or eager: below)
    compute_s = linear_flops / (peak(weights) x ce) + attention_flops / (peak(attention) x ce)
    memory_s  = (weight_bytes + kv_bytes) / (bandwidth x be)

ce, be: compute_efficiency, bandwidth_efficiency. A step runs its kinds of kernel one
after the other (per layer: the projections' and MLP's GEMMs, the prefill chunks'
attention, the decodes' attention), each bound by its own resource, so the step sums the
phases' rooflines instead of taking one roofline over the step's total FLOPs and bytes: a
chunked prefill's compute-bound GEMMs no longer hide its decodes' memory-bound attention.
For a step of decodes only, or one prefill chunk, the sum is the old single roofline
(each phase bound by the same resource); compute_s and memory_s stay the step's totals.
The decompression of MLA's prefill (below) is a GEMM: it joins the GEMM phase's FLOPs.

peak(weights) is the GPU's figure for the GEMM precision of the weight format (bf16 and
mxfp4 -> bf16: gpt-oss's MXFP4 experts are dequantized into BF16 GEMMs on Hopper; fp8 and
fp4+fp8 -> fp8; fp32 -> fp32); peak(attention) is fp32 for an fp32 cache and bf16 otherwise
(FP8 caches are dequantized into BF16 attention math, as FlashMLA and FlashInfer do).

FLOPs, with N = sum_i n_i tokens and C chunks (one logits row each):

    linear_flops    = 2 x N x P_active + 2 x C x vocab x hidden / tp
    P_active        = (attention + dense MLP + shared experts) / tp + replicated attention
                      + router + moe_layers x top_k x 3 x hidden x expert_intermediate / tp
    attention_flops = sum_i sum_terms num_layers x flops_per_entry x S(c_i, ctx_i)
    S(c, ctx)       = sum_{k=c+1..ctx} min(cap, k // tokens_per_entry)

The query at position k - 1 sees k tokens (causal, itself included), so S is the exact sum
over the chunk's queries of the entries each one attends. The embedding lookup costs no
FLOPs; norms, biases and activations are not counted (a fraction of a percent).

MXFP4 routed experts (gpt-oss) on a GPU add the padding of their grouped GEMM's tiles:

    moe_tile_flops = moe_layers x 2 x 3 x hidden x expert_intermediate / tp
                     x (E x E[ceil(X / block_m) x block_m] - N x top_k)
    X       ~ Binomial(N, top_k / E), the rows one expert gets under uniform routing
              (`expected_padded_rows` sums the expectation over the pmf)
    block_m = moe_block_m(t), t = max(1, N x top_k // E): clamp(next_pow2(2 t), 16, 64)
              for t <= 64, else clamp(next_pow2(t), 16, 128)

On Hopper these experts run in triton_kernels' ragged grouped GEMM (`matmul_ogs`: the MXFP4
weights upcast to BF16 inside it), which TensorRT-LLM's TRITON MoE backend calls (its
perf overview's gpt-oss options: "# Hopper: use TRITON"); the kernel computes each expert's
rows in tiles of block_m, chosen by the rule above from its expected rows an expert
(opt_flags.py: "Ragged and likely memory bound; set the block size higher to minimize
loading weights more than once"), so an expert of 33 rows computes 64. The padding rows are
computed like the others (at the GEMMs' compute efficiency); they cost nothing while the
step's GEMMs are bound by their weight reads, and up to 0.9-2.7x the experts' FLOPs in the
large decode batches of a maximum-throughput run (1,057 and 555 sequences of gpt-oss-120b).
Pricing the expectation over each expert's rows, rather than the tiles of the mean, keeps
the term smooth in N at one block_m (the mean's tiles jumped from none padded at 4,096
gpt-oss tokens to 2x the rows at 4,100; the expectation is 1.48x at both); the kernel's
own switch of block_m, which its rule takes from N, stays a step (544 gpt-oss decodes
compute 8,192 rows a layer in tiles of 64, 543 about 4,097 in tiles of 32).
The term applies on every GPU preset; on Blackwell TensorRT-LLM runs these experts in other
(CUTLASS) kernels whose tiles are not modelled apart.

On Hopper (the H100 and H200 presets) those GEMMs also run at their own fraction of the BF16
peak, 0.278 (`MXFP4_EXPERT_COMPUTE_EFFICIENCY`, below), instead of ce:

    moe_s = moe_flops / (peak(weights) x 0.278) - moe_flops / (peak(weights) x ce)
    moe_flops = moe_layers x 2 x 3 x hidden x expert_intermediate / tp x (N x top_k + padding)

(the rows the grouped GEMM computes, its tiles' padding included), so the GEMM phase prices
the experts at 0.278 and the rest of linear_flops at ce. The figure is the one kernel-level
measurement of an MXFP4 MoE GEMM on Hopper found (2026-12-05), SGLang PR 38884
(https://github.com/sgl-project/sglang/pull/38884), from an nsys capture of a live W4A16
DeepSeek-V4-Flash server on H100s, 16,384-token prefill chunks: "MoE marlin W4A16 GEMM",
"1.237 TFLOP per layer per GPU in 4.863 ms is **254 TFLOPS, 25.7% of H100 BF16 peak**,
while reading 856 MB/layer", "It is issue-bound, not bandwidth-bound: the SASS inner loop
spends 64 of 220 instructions per 32-K step on `HMMA`, the rest on dequant, scale and pack."
Its shape checks out here: 16,384 tokens x top-6 x 2 x 3 x hidden 4,096 x intermediate
2,048 / 4 GPUs is 1.237 TFLOP, and 256 experts of MXFP4 (4.25 bits) over 4 GPUs 856 MB.
It is Marlin's (the kernel vLLM picks on Hopper without triton_kernels installed), at 384
rows an expert on average and a 512-wide expert slice. The 25.7 % is useful FLOPs over
time; Marlin computes each expert's rows in whole blocks (vLLM's fused_marlin_moe: the
first block_size_m of 8, 16, 32, 48, 64 with rows an expert / block < 0.9, else 64: 64
there), 1.081x the useful rows over Binomial(16,384, 6 / 256) rows an expert
(`MXFP4_SGLANG_COMPUTED_ROWS`), so the rate of a computed row is 0.257 x 1.081 = 0.278;
no kernel-level figure for
triton_kernels' matmul_ogs (TensorRT-LLM's TRITON backend on Hopper) or at gpt-oss's
shapes was found, so the one figure stands for every MXFP4 expert GEMM on Hopper. Being
issue-bound (dequantizing each weight tile costs instructions a tile of rows amortizes),
it is taken as the rate of every computed row; the tiles' padding rows are priced by
`moe_block_m` above. Whether a padding row costs a real row's time is not known: the tile
rule's own comment calls its range "likely memory bound", and no figure of a tile's time
against its rows was found. No kernel-level figure of these kernels' bandwidth at small batches
was found, so their weight reads keep be. Other GPUs (B200, custom) price the experts at ce.

Bytes:

    weight_bytes = dense bytes (all weights but the routed experts and, when the head does
                   not reuse it, the embedding table) + N embedding rows
                   + sum_moe_layers experts_touched(N) x bytes of one expert
    kv_bytes     = sum_i read(n_i, ctx_i) + N x write_bytes_per_token
    read(n, ctx) = sum_terms num_layers x entry_bytes x U(n, ctx)
    U(n, ctx)    = every entry:   ctx // tokens_per_entry
                   window w:      min(ctx, w + n - 1)      (the union of n windows)
                   top-k K:       min(ctx // tokens_per_entry, n x K)
    kv_read_bytes(ctx) = read(1, ctx): one decode query's reads.

The batch touches E x (1 - (1 - top_k / E)^N) of a MoE layer's E experts: the expected
number of distinct experts N tokens route to under uniform routing (`experts_touched`
derives it), an assumption the report names ("moe_routing": "uniform").
The KV a chunk reads is the union of what its queries see: all of it for full attention.
KV written is each new token's bytes per token (V4: its classical share plus its SWA entry
in every layer). V4's fp32 compressor state traffic is not counted: at 128k context it is
under 1% of a decode's reads (about 0.7 MB against 112 MB for V4-Flash).

Tensor-parallel communication (`allreduce_s`): a TP layer ends its attention and its MLP
(or MoE) in a row-parallel GEMM whose partial sums all GPUs add up, two all-reduces per
layer of the step's N activations of hidden_size at the activation width a (2 bytes, bf16;
4 with fp32 weights), over NVLink as a ring:

    comm_s       = 2 x num_layers x allreduce_s(N)               (0 at tp 1)
    allreduce_s  = 2 (tp - 1) / tp x bytes / nvlink_bw + 2 (tp - 1) x nvlink_latency
    bytes        = N x hidden_size x a

A ring all-reduce is a reduce-scatter then an all-gather, each tp - 1 steps in which every
GPU sends (and receives) bytes / tp: 2 (tp - 1) steps, each paying the link's latency.
nvlink_bw is the GPU's figure in one direction (`kvpool.spec.gpus`). The all-reduces
serialise with the layers' kernels (the next GEMM needs their result), so comm_s adds to
the roofline rather than overlapping it. TP past one node's GPUs (`gpus_per_node`) is
refused: its all-reduces would cross the inter-node network, which is not modelled.

Expert parallelism (`expert_parallel`, vLLM's --enable-expert-parallel at data parallelism
1: ep = tp GPUs, ep = 1 without it): each GPU holds E / ep whole routed experts instead of a
1/tp slice of every expert; everything else is TP's. Every GPU keeps all N tokens (vLLM runs
its all-to-all kernels only with data (or context) parallelism > 1:
FusedMoEParallelConfig.use_all2all_kernels), a GPU's experts produce partial outputs for the tokens routed to them,
and the MoE's output is all-reduced as under TP, so comm_s is the formula above, unchanged.
The expert weights a step reads on one GPU are its share of the touched experts,
experts_touched(N) / ep whole experts: the same expected bytes as TP's 1/tp slice of each
(ep = tp), and the same FLOPs. So the step's time is TP's: the busiest GPU, which the step
waits for, reads more than this mean under any real routing (not modelled), and the
dispatch / combine all-to-all of attention data parallelism (vLLM --data-parallel-size
with expert parallelism, SGLang --enable-dp-attention; attention and shared experts whole
on each GPU) is not modelled.

Terms (`AttentionTerm`), by attention kind, H query heads, d head dim:
- GQA: one term per window group of `kv_layout`: every token (or a window w), entry = the
  layer's K + V bytes on this GPU, flops_per_entry = 4 x (H / tp) x d (QK^T and PV).
- MLA: the latent (kv_lora_rank r + rope dims). A decode attends it in the absorbed form:
  flops_per_entry = 2 x (H / tp) x (r + rope) for scores + 2 x (H / tp) x r for values.
  A prefill chunk of dense MLA (no indexer: V2, V3) runs as serving engines run it, in the
  decompressed MHA form: kv_b_proj turns each of the chunk's ctx latents into per-head
  K (nope) and V, then MHA attends them: prefill_flops_per_entry = 2 x (H / tp) x
  (nope + rope) + 2 x (H / tp) x v_head_dim; the decompression costs
  decompress_flops_per_token = 2 x r x (H / tp) x (nope + v_head_dim) per context token
  (a GEMM at the weights' peak), counted for the ctx - n cached ones: P_active already
  holds kv_b_proj's 2 x n x r x (H / tp) x (nope + v) for the chunk's own tokens (what the
  absorbed form spends absorbing W_UK into q and W_UV into the output). Its K / V,
  (H / tp) x (nope + rope + v) bf16 values a token, are written then read once
  (decompress_bytes_per_token = 2 x that x 2 bytes).
  For V3 at TP 8 that is 10,240 FLOPs an entry instead of the absorbed form's 34,816.
  DeepSeek-V3.2 attends only the indexer's top-k latents (its prefill too, absorbed, as
  its sparse kernels run it) and adds an indexer term over every key: flops_per_entry =
  2 x index_heads x index_head_dim, on every rank (replicated).
- DeepSeek-V4 (DEEPSEEK_V4.md sections 2-5): the SWA window on every layer; on CSA layers
  the top-k of the visible k // m entries plus the indexer over all of them; on HCA layers
  every visible k // m' entry. Main entries: 4 x (H / tp) x d, one vector is K and V.

A layer's fixed GPU time (`layer_fixed_s`, the GPU preset's: `kvpool.spec.gpus`): a layer
runs its ten or so kernels one after the other, and each boundary costs the GPU a few
microseconds no roofline holds (the next kernel's launch, its prologue and the last one's
tail with SMs idle, the small kernels: norms, rotary, activations). A CUDA graph removes the
host's launches (layer_launch_s), not these. 36.6 us a layer on Hopper, read from issue
31's H200 batch-1 graph decode (the GPU preset's docstring); it is what makes a batch-1
or batch-8 decode of a deep model slower than its weight read (80 layers of Llama-70B:
2.9 ms a step), and a few percent of a large batch's step.

Default efficiencies (`DEVICE_DEFAULTS`, by device kind):
- cuda: compute 0.5 (serving prefill sustains roughly half the dense tensor peak: cuBLAS
  reaches ~70% on large BF16 GEMMs, attention, norms and small GEMMs pull it down),
  bandwidth 0.8 (decode GEMVs and paged-attention kernels stream at 75-90% of HBM peak),
  host overhead (`host_s`) as a CUDA-graph or an eager step: 0.75 ms a step (scheduling,
  input preparation, sampling, a graph replay's launch) and, for a step that does not
  replay a graph, 76 us a layer (its kernels launched one by one from Python). A
  "graph" model (the default, as vLLM and SGLang serve) replays a captured graph for a
  step of decodes only with at most graph_max_batch (512) sequences; any step with a
  prefill chunk, or a bigger batch, runs eagerly; an "eager" model never replays. Both
  figures come from issue 31's H200 measurement of a Llama-3.1-8B decode at batch 1
  (torch 2.11, bf16), not from one taken here: 4.71 ms with a CUDA graph, 7.14 ms eager.
  The eager gap, 2.43 ms over 32 layers, is 76 us a layer. The 0.75 ms a step was first
  read from the same graph decode (4.71 ms less 3.91 ms of weight reads at 0.8 of
  4.8 TB/s), when no other term could hold that gap; that run was a bare forward replayed
  from a graph, whose host does no scheduling or sampling, and the gap is now the GPU's, a
  layer's fixed time (`layer_fixed_s`, above). 0.75 ms stays as a serving engine's host
  step (scheduling, input preparation, sampling, the replay's launch), which the bare
  forward does not have: no measurement of its own backs it (the H200 fit finds 0.05 ms in
  the bare forward); the published low-batch rows (kvpool.sim.validate) are its check.
- cpu: what kvpool's own CPU engine reaches of `cpu_preset()`'s measured peaks, fitted
  by `kvpool bench sim` (sim/calibrate.py `fit_engine`: decodes of 1 and 8 sequences over
  256 tokens of context, fresh prefills of 256 and 64 tokens) on 2026-12-02, each the
  median of three runs (compute 0.71-0.78, bandwidth 0.53-0.58, 6.3-9.5 ms a sequence,
  56-74 ms a prefill chunk): compute 0.76, bandwidth 0.56, no fixed step overhead, 8.7 ms
  a sequence (the engine's per-sequence attention and sampling), 66 ms a prefill chunk
  (a chunk of any length costs that much beyond its FLOPs; a decode does not). A GPU
  engine batches those per-sequence costs into kernels: the cuda defaults leave both at 0.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from dataclasses import field as dataclass_field
from functools import cached_property

import numpy as np

from kvpool.capacity.kv import KVLayout, kv_layout
from kvpool.capacity.weights import WeightBytes, _bytes_per_param, weight_bytes
from kvpool.spec.dsv4 import SERVING, LayerKind
from kvpool.spec.gpus import GPUSpec
from kvpool.spec.gpus import cpu_preset as cpu_preset  # re-exported: the simulator's CPU device
from kvpool.spec.kv_formats import QUANTIZED
from kvpool.spec.models import ModelSpec

HOST_MODES: tuple[str, ...] = ("graph", "eager")
# decode_step_time's table sums: at most 2^11 - 1 entries (the bound of the uint64 sums it
# once made, kept: a step of more decodes takes the loop)
_MAX_TABLE_DECODES = 1 << 11
# the weights of `_decode_sums`' dot product (a sum as one BLAS call); never written
_ONES = np.ones(_MAX_TABLE_DECODES)
_ONES.flags.writeable = False
_EXACT = float(1 << 53)  # the floats below it hold every integer exactly
# the decode table's positions at most (16 bytes each: 32 MiB); a position past it is priced by
# step_time's loop (a context of 2M tokens: past every preset's longest)
_MAX_TABLE_POSITIONS = 1 << 21
# the token counts `_token_terms` keeps (a step's tokens: at most its budget and its replays)
_MAX_TOKEN_MEMO = 1 << 16


def _ints_only(positions: Sequence[int]) -> bool:
    """Whether every position is a Python int (a bool or an int subclass counts: p + 1 is
    then an int, as step_time reads it), in one C-level pass: a sum of ints (and bools) is
    an int, and turns into a float or a numpy integer at the first such one (a str, None...
    raise TypeError: not ints either). Signs are not checked here: `_decode_sums` answers None
    for a negative position (past every table's end as a uint64), and the loop it falls back
    to checks it."""
    try:
        return type(sum(positions)) is int
    except TypeError:
        return False


def expected_padded_rows(num_tokens: int, share: float, block_m: int) -> float:
    """E[ceil(X / block_m) x block_m], X ~ Binomial(num_tokens, share): the rows one expert's
    grouped GEMM computes, in whole tiles of block_m, when each of `num_tokens` tokens routes
    to it with probability `share` (top_k / E under uniform routing). Exact up to fp64
    rounding: the pmf from its log, log C(n, x) summed as log((n - i) / (i + 1)) over i < x."""
    if num_tokens < 0 or block_m < 1 or not 0.0 < share <= 1.0:
        raise ValueError(f"need num_tokens >= 0, block_m >= 1 and 0 < share <= 1, got {num_tokens}, {block_m}, {share}")
    if share == 1.0:  # every token routes to every expert (top_k = E): X = num_tokens
        return float(-(-num_tokens // block_m) * block_m)
    x = np.arange(num_tokens + 1, dtype=np.float64)
    log_ratio = np.log(num_tokens - x[:-1]) - np.log(x[:-1] + 1.0) + math.log(share) - math.log1p(-share)
    log_pmf = num_tokens * math.log1p(-share) + np.concatenate(([0.0], np.cumsum(log_ratio)))
    tiles = np.ceil(x / block_m) * block_m
    return float(np.dot(np.exp(log_pmf), tiles))


# The GEMM precision of each weight format (see the module docstring).
WEIGHT_PRECISION: dict[str, str] = {"bf16": "bf16", "mxfp4": "bf16", "fp8": "fp8", "fp4+fp8": "fp8", "fp32": "fp32"}
# The fraction of the BF16 dense peak MXFP4 routed experts' grouped GEMMs reach on a Hopper
# GPU preset, which has no FP4 tensor cores and upcasts the weights inside the GEMM: 254 of
# 989 TFLOP/s, SGLang PR 38884's kernel-level figure for Marlin's W4A16 MoE GEMM on an H100
# (module docstring). The H200 has the H100's SMs, clocks and peak; its faster HBM does not
# help a GEMM its author finds bound by instruction issue. Other GPUs: compute_efficiency.
# 0.257 is useful FLOPs over time; this model prices the rows a GEMM computes, its tiles'
# padding included, so the rate is 0.257 x the rows SGLang's kernel computed over its useful
# rows (`MXFP4_SGLANG_COMPUTED_ROWS`).
MXFP4_SGLANG_USEFUL_EFFICIENCY = 0.257
# The rows Marlin's MoE GEMM computes over the useful rows at SGLang's shape (16,384 tokens,
# top-6 of 256 experts: 384 rows an expert; Marlin's block_size_m rule, the first of 8, 16,
# 32, 48, 64 where rows an expert / block < 0.9, else 64, takes 64): E x E[ceil(X / 64) x 64]
# / (16,384 x 6), X ~ Binomial(16,384, 6 / 256), about 1.081.
MXFP4_SGLANG_COMPUTED_ROWS = 256 * expected_padded_rows(16384, 6 / 256, 64) / (16384 * 6)
MXFP4_EXPERT_COMPUTE_EFFICIENCY: dict[str, float] = dict.fromkeys(
    ("H100", "H200"), MXFP4_SGLANG_USEFUL_EFFICIENCY * MXFP4_SGLANG_COMPUTED_ROWS
)
# The attention math precision of each KV dtype.
ATTENTION_PRECISION: dict[str, str] = {
    "bf16": "bf16",
    "fp16": "bf16",
    "fp32": "fp32",
    **dict.fromkeys(("fp8", *QUANTIZED), "bf16"),  # dequantized into BF16 math
}
# V4 entry format of each KV dtype: the serving layout for fp8, else the storage dtype.
_V4_ENTRY_DTYPE: dict[str, str] = {"fp8": SERVING, "bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


@dataclass(frozen=True)
class DeviceDefaults:
    compute_efficiency: float
    bandwidth_efficiency: float
    step_overhead_s: float
    seq_overhead_s: float = 0.0
    prefill_chunk_overhead_s: float = 0.0
    layer_launch_s: float = 0.0  # an eager step's launches, per layer


DEVICE_DEFAULTS: dict[str, DeviceDefaults] = {
    "cuda": DeviceDefaults(
        compute_efficiency=0.5, bandwidth_efficiency=0.8, step_overhead_s=0.75e-3, layer_launch_s=76e-6
    ),
    "cpu": DeviceDefaults(
        compute_efficiency=0.76,
        bandwidth_efficiency=0.56,
        step_overhead_s=0.0,
        seq_overhead_s=8.7e-3,
        prefill_chunk_overhead_s=66e-3,
    ),
}


@dataclass(frozen=True)
class AttentionTerm:
    """One kind of cache entry that `num_layers` layers attend, and how many of them.

    A query at position k - 1 attends min(cap, k // tokens_per_entry) of these entries
    (cap None: all); `selection` says what a chunk's queries read together: "all" entries,
    a sliding "window" (the union of consecutive windows), or a per-query "topk" choice.
    """

    name: str
    num_layers: int
    entry_bytes: float  # one entry in one layer, on this GPU
    flops_per_entry: float  # one query attending one entry in one layer
    tokens_per_entry: int = 1
    cap: int | None = None
    selection: str = "all"  # "all" | "window" | "topk"
    # a prefill chunk in another form than a decode (MLA decompressed; None: the same):
    prefill_flops_per_entry: float | None = None
    decompress_flops_per_token: float = 0.0  # per context token per layer, a prefill chunk's
    decompress_bytes_per_token: float = 0.0  # its written and read K / V, per token per layer

    def attended(self, num_cached: int, context_len: int) -> int:
        """Entries attended by the queries at positions [num_cached, context_len), summed."""
        return sum_visible(num_cached, context_len, self.tokens_per_entry, self.cap)

    def read_entries(self, num_new_tokens: int, context_len: int) -> int:
        """Distinct entries the chunk's queries read (their union)."""
        visible = context_len // self.tokens_per_entry
        if self.selection == "window":
            assert self.cap is not None and self.tokens_per_entry == 1
            return min(context_len, self.cap + num_new_tokens - 1)
        if self.selection == "topk":
            assert self.cap is not None
            return min(visible, num_new_tokens * self.cap)
        return visible


def sum_visible(lo: int, hi: int, tokens_per_entry: int = 1, cap: int | None = None) -> int:
    """sum over k in (lo, hi] of min(cap, k // tokens_per_entry), in closed form."""
    if not 0 <= lo <= hi:
        raise ValueError(f"need 0 <= lo <= hi, got lo={lo}, hi={hi}")
    return _prefix_visible(hi, tokens_per_entry, cap) - _prefix_visible(lo, tokens_per_entry, cap)


def _prefix_visible(n: int, m: int, cap: int | None) -> int:
    """sum_{k=1..n} min(cap, k // m). k // m reaches cap at k = cap x m; from there on each k adds cap."""
    if cap is not None and n >= cap * m:
        return _floor_sum(cap * m - 1, m) + (n - cap * m + 1) * cap
    return _floor_sum(n, m)


def _floor_sum(n: int, m: int) -> int:
    """sum_{k=0..n} k // m: q whole runs of m equal values (0 .. q-1), then r + 1 copies of q."""
    q, r = divmod(n, m)
    return m * q * (q - 1) // 2 + q * (r + 1)


@dataclass(frozen=True)
class StepCost:
    """One step's work and time on one GPU."""

    num_tokens: int
    linear_flops: float
    attention_flops: float
    weight_bytes: float
    kv_bytes: float
    compute_s: float
    memory_s: float
    time_s: float  # gemm_s + prefill_attention_s + decode_attention_s + comm_s + host_s + fixed_s
    comm_s: float = 0.0  # the tensor-parallel all-reduces
    host_s: float = 0.0  # the host's overheads: per step, per layer launch (eager), per sequence
    gemm_s: float = 0.0  # the phases (module docstring): the GEMMs at their roofline,
    prefill_attention_s: float = 0.0  # the prefill chunks' attention at theirs,
    decode_attention_s: float = 0.0  # the decodes' attention at theirs
    fixed_s: float = 0.0  # num_layers x layer_fixed_s: the kernels' fixed GPU time

    @property
    def flops(self) -> float:
        return self.linear_flops + self.attention_flops

    @property
    def bytes(self) -> float:
        return self.weight_bytes + self.kv_bytes

    @property
    def bound(self) -> str:
        return "compute" if self.compute_s > self.memory_s else "memory"


@dataclass(frozen=True)
class CostModel:
    """Roofline step times of `model` on one `gpu` of a TP group (formulas: module docstring).

    weight_dtype: a `kvpool.capacity.weights` format ("auto" = the model's own); kv_dtype:
    a `kvpool.capacity.kv` dtype ("auto" = the model's serving format). On a "cpu" device
    "auto" is "fp32" for both: kvpool's CPU engine holds fp32 weights and KV. Efficiencies
    and overheads left None take the device kind's `DEVICE_DEFAULTS`. host_mode: "graph"
    (decode-only steps of at most graph_max_batch sequences replay a CUDA graph) or
    "eager" (every step pays its layers' launches).
    """

    model: ModelSpec
    gpu: GPUSpec
    weight_dtype: str = "auto"
    kv_dtype: str = "auto"
    tp: int = 1
    compute_efficiency: float | None = None
    bandwidth_efficiency: float | None = None
    step_overhead_s: float | None = None
    seq_overhead_s: float | None = None
    prefill_chunk_overhead_s: float | None = None
    layer_launch_s: float | None = None
    layer_fixed_s: float | None = None  # None: the GPU preset's (kvpool.spec.gpus)
    host_mode: str = "graph"
    graph_max_batch: int = 512
    indexer_format: str | None = None  # V3.2 / V4 indexer keys: "fp8" (default), "mxfp4", "bf16"
    expert_parallel: bool = False  # routed experts whole over the TP group (ep = tp), data parallelism 1

    def __post_init__(self) -> None:
        if self.gpu.kind not in DEVICE_DEFAULTS:
            raise ValueError(f"GPU {self.gpu.name} has kind {self.gpu.kind!r}; known: {sorted(DEVICE_DEFAULTS)}")
        defaults = DEVICE_DEFAULTS[self.gpu.kind]
        overheads = ("step_overhead_s", "seq_overhead_s", "prefill_chunk_overhead_s", "layer_launch_s")
        for field in ("compute_efficiency", "bandwidth_efficiency", *overheads):
            if getattr(self, field) is None:
                object.__setattr__(self, field, getattr(defaults, field))
        if self.layer_fixed_s is None:
            object.__setattr__(self, "layer_fixed_s", self.gpu.layer_fixed_s)
        if not self.layer_fixed_s >= 0:
            raise ValueError(f"layer_fixed_s must be >= 0, got {self.layer_fixed_s}")
        for field in ("compute_efficiency", "bandwidth_efficiency"):
            value = getattr(self, field)
            if not 0 < value <= 1:
                raise ValueError(f"{field} must be in (0, 1], got {value}")
        for field in overheads:
            if not getattr(self, field) >= 0:
                raise ValueError(f"{field} must be >= 0, got {getattr(self, field)}")
        if self.host_mode not in HOST_MODES:
            raise ValueError(f"host_mode must be one of {HOST_MODES}, got {self.host_mode!r}")
        if self.graph_max_batch < 0:
            raise ValueError(f"graph_max_batch must be >= 0, got {self.graph_max_batch}")
        if self.tp > 1 and self.tp > self.gpu.gpus_per_node:
            raise ValueError(
                f"tp={self.tp} spans more than one node of {self.gpu.gpus_per_node} {self.gpu.name} GPUs: "
                "the simulator prices NVLink all-reduces within a node only; use tp <= "
                f"{self.gpu.gpus_per_node} (more replicas for more GPUs)"
            )
        if self.expert_parallel and self.model.moe is None:
            raise ValueError(f"expert parallelism spreads routed experts; {self.model.name} has no MoE layers")
        if self.expert_parallel and self.tp == 1:
            raise ValueError("expert parallelism spreads the routed experts over the TP GPUs; tp=1 has one GPU")
        if self.tp > 1 and math.isnan(self.gpu.nvlink_bytes_per_s + self.gpu.nvlink_latency_s):
            raise ValueError(f"GPU {self.gpu.name} has no NVLink figure to price tp={self.tp}'s all-reduces")
        # Resolve the formats now: a bad dtype or tp fails here, naming itself.
        _ = self.weights, self.layout, self.attention_terms

    # ----- derived facts (computed once) -------------------------------------------------

    @cached_property
    def weights(self) -> WeightBytes:
        return weight_bytes(self.model, self.tp, self._on_device(self.weight_dtype))

    @cached_property
    def layout(self) -> KVLayout:
        return kv_layout(self.model, self._on_device(self.kv_dtype), tp=self.tp, indexer_format=self.indexer_format)

    def _on_device(self, dtype: str) -> str:
        return "fp32" if dtype == "auto" and self.gpu.kind == "cpu" else dtype

    @cached_property
    def attention_terms(self) -> tuple[AttentionTerm, ...]:
        return _TERMS[self.model.attention](self.model, self.layout, self.tp)

    @cached_property
    def _bytes_per_param(self) -> dict[str, float]:
        return _bytes_per_param(self.weights.weight_dtype)

    @property
    def ep(self) -> int:
        """GPUs the routed experts are spread over: the TP group under expert parallelism, else 1."""
        return self.tp if self.expert_parallel else 1

    @property
    def expert_bytes(self) -> float:
        """What reading one touched routed expert of one MoE layer costs this GPU, on average
        (0 for a dense model): a 1/tp slice of it under TP; under EP the whole expert on one
        GPU of ep, 1/ep of the time. Both are its bytes / tp (ep = tp)."""
        moe = self.model.moe
        if moe is None:
            return 0.0
        p, b = self.weights.params, self._bytes_per_param
        one_expert = (p.experts * b["experts"] + p.expert_biases * b["expert_biases"]) / (
            len(moe.moe_layers) * moe.num_experts
        )
        return one_expert / self.tp  # (the same whether sliced or placed whole: ep = tp)

    @property
    def embedding_row_bytes(self) -> float:
        return self.model.hidden_size * self._bytes_per_param["embedding"] / self.tp

    @cached_property
    def dense_weight_bytes(self) -> float:
        """Bytes every step reads whatever its tokens: all weights but the routed experts and,
        for an untied head, the embedding table (the lookup reads only its rows)."""
        moe = self.model.moe
        routed = self.expert_bytes * len(moe.moe_layers) * moe.num_experts if moe else 0.0
        table = 0.0
        if not self.model.tie_word_embeddings:
            table = self.weights.params.embedding * self._bytes_per_param["embedding"] / self.tp
        return self.weights.per_gpu_bytes - routed - table

    @cached_property
    def active_params_per_token(self) -> float:
        """Linear weights one token multiplies through on this GPU (the LM head apart)."""
        p, tp = self.weights.params, self.tp
        active = (p.attention + p.mlp) / tp + p.attention_replicated + p.router
        moe = self.model.moe
        if moe is not None:
            per_expert = 3 * self.model.hidden_size * moe.expert_intermediate_size
            active += len(moe.moe_layers) * moe.experts_per_token * per_expert / tp
        return active

    @cached_property
    def kv_write_bytes_per_token(self) -> float:
        """Cache bytes one new token writes on this GPU (V4: its classical share + SWA entries)."""
        swa = sum(t.num_layers * t.entry_bytes for t in self.attention_terms if t.name == "swa-window")
        return self.layout.bytes_per_token + swa

    def experts_touched(self, num_tokens: int) -> float:
        """Distinct experts of one MoE layer that `num_tokens` tokens route to, expected under
        uniform routing: E x (1 - (1 - k / E)^N), E experts, top-k each.

        Derivation. Under uniform routing a token picks k distinct experts of E, every k-subset
        equally likely, so it misses a given expert with probability C(E-1, k) / C(E, k) =
        (E - k) / E = 1 - k / E. The N tokens route independently, so the expert stays
        untouched with probability (1 - k / E)^N. The touched count is a sum of E indicators;
        by linearity of expectation its mean is E x (1 - (1 - k / E)^N). It is N x k at
        N = 1, at most min(E, N x k) (the old upper bound) and tends to E as N grows; for
        DeepSeek-V3 (E 256, k 8) at N 32 it is ~163.3 experts, where min(E, N x k) said 256.
        Real routers are skewed, which touches fewer experts than this at the same N."""
        moe = self.model.moe
        if moe is None:
            return 0.0
        e, k = moe.num_experts, moe.experts_per_token
        return e * (1.0 - (1.0 - k / e) ** num_tokens)

    @cached_property
    def _moe_tiles(self) -> bool:
        """Whether the routed experts run as triton_kernels' ragged grouped GEMM, whose tiles
        of rows this model prices (module docstring): MXFP4 experts on a GPU."""
        return self.model.moe is not None and self.weights.weight_dtype == "mxfp4" and self.gpu.kind == "cuda"

    def _moe_tile_flops(self, num_tokens: int) -> float:
        """FLOPs this GPU spends on the padding rows of a step's routed-expert GEMMs: each of
        the E experts of a MoE layer gets X ~ Binomial(N, k / E) rows under uniform routing
        and computes them in whole tiles of moe_block_m rows, E x E[ceil(X / block_m) x
        block_m] rows in all (`expected_padded_rows`), N x k of them real (module docstring)."""
        moe = self.model.moe
        assert moe is not None
        e, rows = moe.num_experts, num_tokens * moe.experts_per_token
        block_m = moe_block_m(max(1, rows // e))
        padding = e * expected_padded_rows(num_tokens, moe.experts_per_token / e, block_m) - rows
        return self._moe_row_flops * padding

    @cached_property
    def _moe_row_flops(self) -> float:
        """FLOPs one row costs the routed-expert GEMMs of all MoE layers on this GPU: gate, up
        and down projections of one expert slice (2 x 3 x hidden x expert_intermediate / tp)
        a layer."""
        moe = self.model.moe
        assert moe is not None
        per_row = 2 * 3 * self.model.hidden_size * moe.expert_intermediate_size / self.tp
        return len(moe.moe_layers) * per_row

    @cached_property
    def _moe_compute_efficiency(self) -> float | None:
        """The fraction of the BF16 peak this GPU's MXFP4 expert GEMMs reach, where a kernel-level
        figure exists (`MXFP4_EXPERT_COMPUTE_EFFICIENCY`: Hopper); None: compute_efficiency."""
        return MXFP4_EXPERT_COMPUTE_EFFICIENCY.get(self.gpu.name) if self._moe_tiles else None

    def _moe_compute_s(self, num_tokens: int) -> float:
        """Seconds a step's routed-expert GEMMs add beyond their FLOPs at compute_efficiency
        (0 where no figure of their own exists): the rows they compute, padding included
        (N x k real rows + `_moe_tile_flops`'s), at _moe_compute_efficiency of the peak
        instead of compute_efficiency (module docstring)."""
        efficiency = self._moe_compute_efficiency
        if efficiency is None:
            return 0.0
        moe = self.model.moe
        assert moe is not None
        computed = self._moe_row_flops * num_tokens * moe.experts_per_token + self._moe_tile_flops(num_tokens)
        peak = self._peaks[0]
        return computed / (peak * efficiency) - computed / (peak * self.compute_efficiency)

    @property
    def activation_bytes(self) -> int:
        """Bytes of one activation element: 4 with fp32 weights, else 2 (bf16)."""
        return 4 if self.weights.weight_dtype == "fp32" else 2

    def allreduce_s(self, num_tokens: int) -> float:
        """Seconds of one ring all-reduce of `num_tokens` activations over the TP group's NVLink
        (0 at tp 1): 2 (tp - 1) / tp x bytes / bandwidth + 2 (tp - 1) x latency."""
        tp = self.tp
        if tp == 1:
            return 0.0
        num_bytes = num_tokens * self.model.hidden_size * self.activation_bytes
        gpu = self.gpu
        return 2 * (tp - 1) / tp * num_bytes / gpu.nvlink_bytes_per_s + 2 * (tp - 1) * gpu.nvlink_latency_s

    def comm_s(self, num_tokens: int) -> float:
        """A step's communication (module docstring): two all-reduces a layer, with or without
        expert parallelism (at data parallelism 1 the MoE's output is all-reduced either way)."""
        return 2 * self.model.num_layers * self.allreduce_s(num_tokens)

    # ----- the cost of a step ------------------------------------------------------------

    def kv_read_bytes(self, context_len: int) -> int:
        """Cache bytes one query over `context_len` tokens of context reads (the engine's
        `ModelRunner.kv_read_bytes`)."""
        if not isinstance(context_len, int) or context_len < 0:
            raise ValueError(f"context_len must be a non-negative integer, got {context_len!r}")
        if context_len == 0:
            return 0
        return round(self._read_bytes(1, context_len))

    def _read_bytes(self, num_new_tokens: int, context_len: int) -> float:
        return sum(
            t.num_layers * t.entry_bytes * t.read_entries(num_new_tokens, context_len) for t in self.attention_terms
        )

    @cached_property
    def _decode_terms(self) -> tuple[tuple[float, float, int, int | None], ...]:
        """Per term (flops per entry, bytes per entry, over all its layers; tokens per entry;
        cap): the decode fast path of `step_cost`, the same sums as `attended` and
        `read_entries` at one new token."""
        return tuple(
            (t.num_layers * t.flops_per_entry, t.num_layers * t.entry_bytes, t.tokens_per_entry, t.cap)
            for t in self.attention_terms
        )

    @cached_property
    def _decode_scale(self) -> int | None:
        """2^d such that every decode term's FLOPs and bytes per entry and the write bytes per
        token, times 2^d, are integers (d <= 16: V4's write is 28,962.25 bytes, d = 2); None
        when there is none. Then the decode loop of `step_cost` adds only multiples of 2^-d, and
        while its sums stay below 2^53 x 2^-d every partial sum is exact: the float result is
        the exact sum, whatever the order, which `_decode_scan` computes in integers."""
        values = [self.kv_write_bytes_per_token] + [v for t in self._decode_terms for v in t[:2]]
        for d in range(17):
            scale = 1 << d
            if all(float(v * scale).is_integer() for v in values):
                return scale
        return None

    @cached_property
    def _decode_memo(self) -> dict[int, tuple[int, int]]:
        """context length -> one decode's (attention FLOPs, bytes), times `_decode_scale`, as
        integers; filled as contexts come (at most one entry per context length)."""
        return {}

    def _decode_entry(self, ctx: int) -> tuple[int, int]:
        scale = self._decode_scale
        assert scale is not None
        flops, num_bytes = 0, int(self.kv_write_bytes_per_token * scale)
        for flops_w, bytes_w, per_entry, cap in self._decode_terms:
            e = ctx // per_entry
            if cap is not None and e > cap:
                e = cap
            flops += int(flops_w * scale) * e
            num_bytes += int(bytes_w * scale) * e
        entry = self._decode_memo[ctx] = (flops, num_bytes)
        return entry

    def _decode_scan(
        self, chunks: Sequence[tuple[int, int]]
    ) -> tuple[int, tuple[float, float], list[tuple[int, int]]] | None:
        """One pass over a step's chunks, checked as `_check_chunks` checks them (its error
        for a bad one): (the step's tokens, its decodes' (attention FLOPs, bytes) as
        `step_cost`'s loop sums them, the chunks that are not decodes). The decodes' sums are
        integer sums per context (one dict lookup a decode instead of a pass over the
        terms). None where that is not exact (no `_decode_scale`, or sums past 2^53): the
        loop then adds every chunk."""
        scale = self._decode_scale
        if scale is None or not chunks:
            return None
        memo, entry = self._decode_memo, self._decode_entry
        num_tokens = flops = num_bytes = 0
        rest = []
        try:
            for chunk in chunks:
                n, ctx = chunk
                if type(n) is not int or type(ctx) is not int or not 1 <= n <= ctx:
                    raise ValueError
                num_tokens += n
                if n == 1:
                    f, b = memo.get(ctx) or entry(ctx)
                    flops += f
                    num_bytes += b
                else:
                    rest.append(chunk)
        except (TypeError, ValueError):
            _check_chunks(chunks)  # names the bad chunk
            raise
        if flops >= 1 << 53 or num_bytes >= 1 << 53:
            return None
        return num_tokens, (flops / scale, num_bytes / scale), rest

    @cached_property
    def _peaks(self) -> tuple[float, float]:
        """(peak FLOPs for the weights' GEMMs, for attention); ValueError for a GPU without a
        bandwidth figure."""
        gpu = self.gpu
        peak_linear = gpu.peak_flops(WEIGHT_PRECISION[self.weights.weight_dtype])
        peak_attention = gpu.peak_flops(ATTENTION_PRECISION[self.layout.kv_dtype.split("-")[0]])
        if not math.isfinite(gpu.hbm_bandwidth_bytes_per_s):
            raise ValueError(f"GPU {gpu.name} has no bandwidth figure (hbm_bandwidth_bytes_per_s is unknown)")
        return peak_linear, peak_attention

    def step_cost(self, chunks: Sequence[tuple[int, int]]) -> StepCost:
        """The cost of one step over `chunks`: (num_new_tokens, context_len after the chunk)
        per scheduled sequence."""
        return self._step_cost(chunks, self._decode_scan(chunks), len(chunks))  # (the scan checks the chunks)

    def _step_cost(
        self,
        chunks: Sequence[tuple[int, int]],
        scan: tuple[int, tuple[float, float], Sequence[tuple[int, int]]] | None,
        num_chunks: int,
    ) -> StepCost:
        """`step_cost` with the chunks' `_decode_scan` done (step_time has it already);
        `num_chunks`: the step's chunks, decodes included (`split_step_time` passes its scan
        and only the chunks that are not decodes)."""
        if scan is None:
            _check_chunks(chunks)
            num_tokens, rest = sum(n for n, _ in chunks), chunks
        else:  # the decodes' sums, exactly as the loop below adds them; the rest to price
            num_tokens, decode_sums, rest = scan
        model = self.model
        flop_s, attention_flop_s, byte_s = self._rates  # the GEMMs', attention's, the memory's (or ValueError)
        write = self.kv_write_bytes_per_token
        decode_flops = decode_bytes = 0.0  # the decodes' attention and cache bytes
        decode_terms = self._decode_terms
        if scan is not None:
            decode_flops, decode_bytes = decode_sums
        others: list[tuple[int, int]] = []  # the prefill chunks, in their order: `_prefill_sums` prices them
        for chunk in rest:
            n, ctx = chunk
            if n == 1:
                # a decode: its one query attends and reads min(cap, ctx // tokens_per_entry)
                # entries of each term (attended == read_entries at n = 1); `_decode_scan` is
                # this loop's fast twin
                decode_bytes += write
                for flops_w, bytes_w, per_entry, cap in decode_terms:
                    e = ctx // per_entry
                    if cap is not None and e > cap:
                        e = cap
                    decode_flops += flops_w * e
                    decode_bytes += bytes_w * e
                continue
            others.append(chunk)
        # the linear FLOPs (the MoE tiles' apart) and the prefill phase: the decodes feed their
        # own sums, so the prefill chunks' sums are the same floats priced apart
        linear_flops, prefill_flops, prefill_bytes = self._prefill_sums(num_tokens, others, num_chunks)
        num_prefill_chunks = len(others)
        # the MoE tiles' padded rows (module docstring) and the routed experts' GEMMs at their
        # own efficiency (moe_s, beyond linear_flops / flop_s); the weight bytes; comm_s
        tile_flops, moe_s, weight, comm_s = self._token_terms(num_tokens)
        if tile_flops is not None:
            linear_flops += tile_flops
        attention_flops, kv_bytes = prefill_flops + decode_flops, prefill_bytes + decode_bytes
        gemm_compute_s = linear_flops / flop_s + moe_s
        compute_s = gemm_compute_s + attention_flops / attention_flop_s
        memory_s = (weight + kv_bytes) / byte_s
        # the phases run one after the other, each at its own roofline (module docstring)
        gemm_s = max(gemm_compute_s, weight / byte_s)
        prefill_s = max(prefill_flops / attention_flop_s, prefill_bytes / byte_s)
        decode_s = max(decode_flops / attention_flop_s, decode_bytes / byte_s)
        host_s = self.host_s(num_chunks, num_prefill_chunks)
        fixed_s = model.num_layers * self.layer_fixed_s
        return StepCost(
            num_tokens=num_tokens,
            linear_flops=linear_flops,
            attention_flops=attention_flops,
            weight_bytes=weight,
            kv_bytes=kv_bytes,
            compute_s=compute_s,
            memory_s=memory_s,
            time_s=gemm_s + prefill_s + decode_s + comm_s + host_s + fixed_s,
            comm_s=comm_s,
            host_s=host_s,
            gemm_s=gemm_s,
            prefill_attention_s=prefill_s,
            decode_attention_s=decode_s,
            fixed_s=fixed_s,
        )

    def replays_graph(self, num_chunks: int, num_prefill_chunks: int) -> bool:
        """Whether a step of `num_chunks` sequences, `num_prefill_chunks` of them prefill
        chunks, replays a captured CUDA graph: decodes only, at most graph_max_batch."""
        return self.host_mode == "graph" and num_prefill_chunks == 0 and num_chunks <= self.graph_max_batch

    def host_s(self, num_chunks: int, num_prefill_chunks: int) -> float:
        """The host's seconds in a step (module docstring): per step, per sequence, per prefill
        chunk, and each layer's launches unless the step replays a graph."""
        launches = 0.0 if self.replays_graph(num_chunks, num_prefill_chunks) else self.model.num_layers
        return (
            self.step_overhead_s
            + launches * self.layer_launch_s
            + num_chunks * self.seq_overhead_s
            + num_prefill_chunks * self.prefill_chunk_overhead_s
        )

    def step_time(self, chunks: Sequence[tuple[int, int]]) -> float:
        """Seconds one step over `chunks` takes: `step_cost(chunks).time_s`, the same float.
        A step of decodes only (a fleet run's common step) is priced from its decodes' sums
        and the terms that depend on its batch size alone (`_decode_batch_terms`), without
        the rest of `step_cost`."""
        scan = self._decode_scan(chunks)  # (checks the chunks as step_cost does)
        if scan is None or scan[2]:  # a prefill chunk, or sums the loop adds: the whole cost
            return self._step_cost(chunks, scan, len(chunks)).time_s  # (not scanned twice)
        return self._decodes_time(len(chunks), *scan[1])

    def _decodes_time(self, num_decodes: int, decode_flops: float, decode_bytes: float) -> float:
        """`step_cost(...).time_s` of a step of `num_decodes` decodes whose attention sums
        (`_decode_scan`'s) are decode_flops and decode_bytes: the batch's terms kept per size
        and the decodes' phase, added in step_cost's order."""
        gemm_s, comm_s, host_s, fixed_s = self._decode_batch_terms(num_decodes)
        attention_flop_s = self._peaks[1] * self.compute_efficiency  # as step_cost computes them
        byte_s = self.gpu.hbm_bandwidth_bytes_per_s * self.bandwidth_efficiency
        decode_s = max(decode_flops / attention_flop_s, decode_bytes / byte_s)
        # step_cost's sum in its order; its prefill phase is max(0.0, 0.0) = 0.0, and x + 0.0 == x
        return gemm_s + decode_s + comm_s + host_s + fixed_s

    def decode_step_time(self, positions: Sequence[int] | np.ndarray) -> float:
        """Seconds of a step of one decode at each of `positions` (the decoded token's
        position: its context after the step is position + 1): `step_time([(1, p + 1) for p
        in positions])`, the same float, or its ValueError. The simulator's common step,
        priced from its decodes' scaled integer FLOPs and bytes summed in numpy over a table
        by position (`_decode_sums`), without a (tokens, context) tuple per decode; `step_time`
        is its naive twin (tests/test_sim_cost_decode_sums.py). `positions`: ints, or an int64
        array [n] (the cost executor's, kept from step to step: read as it is, no int read),
        priced as its ints (`tolist`)."""
        sums = self._decode_sums(positions) if len(positions) else None
        if sums is None:  # (step_time names a bad position, or adds sums the table cannot)
            if type(positions) is np.ndarray:
                positions = positions.tolist()
            return self.step_time([(1, p + 1) for p in positions])
        scale = self._decode_scale
        assert scale is not None  # (_decode_sums has none without it)
        return self._decodes_time(len(positions), sums[0] / scale, sums[1] / scale)

    def split_step_time(self, positions: Sequence[int], others: Sequence[tuple[int, int]]) -> float | None:
        """Seconds of a step of one decode at each of `positions` and the chunks `others`
        ((num_new_tokens, context_len), more than one token each), in any order that keeps
        `others`' own: `step_time` of that step, the same float, or None where this cannot
        tell it (a bad position or chunk, no `_decode_scale`, sums the table cannot add):
        the caller then prices the step in its order with `step_time`, which names a bad
        chunk. A mixed step (a prefill chunk among a fleet run's decodes) priced from
        `_decode_sums` for its decodes and `step_cost`'s loop over its few other chunks,
        without a (tokens, context) tuple and a pass in Python per decode: with
        `_decode_scale` the decodes' sums are exact integers, whatever their order and
        wherever the other chunks fall among them (`_decode_scale`), so `_step_cost` gets
        the same scan as from the step in its order. Its naive twin: `step_time`
        (tests/test_sim_cost_decode_sums.py)."""
        if not others or self._decode_scale is None:
            return None
        num_tokens = len(positions)
        for chunk in others:  # (`_decode_scan`'s test; a chunk of one token is a decode: not here)
            if type(chunk) is not tuple or len(chunk) != 2:
                return None
            n, ctx = chunk
            if type(n) is not int or type(ctx) is not int or not 2 <= n <= ctx:
                return None
            num_tokens += n
        sums = self._decode_sums(positions) if len(positions) else (0, 0)
        if sums is None:
            return None
        scale = self._decode_scale
        return self._split_time(num_tokens, sums[0] / scale, sums[1] / scale, others, len(positions) + len(others))

    def _split_time(
        self,
        num_tokens: int,
        decode_flops: float,
        decode_bytes: float,
        others: Sequence[tuple[int, int]],
        num_chunks: int,
    ) -> float:
        """`_step_cost(others, (num_tokens, (decode_flops, decode_bytes), others),
        num_chunks).time_s`, the same float, with less Python a step: the prefill chunks'
        sums by `_prefill_sums`, the figures of the step's token count alone kept per count
        (`_token_terms`), no StepCost made. `others`: checked chunks of two tokens or more
        (split_step_time's). Its twin, `_step_cost`, is held to it and to its parts on every
        preset (tests/test_sim_cost_decode_sums.py)."""
        linear_flops, prefill_flops, prefill_bytes = self._prefill_sums(num_tokens, others, num_chunks)
        tile_flops, moe_s, weight, comm_s = self._token_terms(num_tokens)
        if tile_flops is not None:
            linear_flops += tile_flops
        flop_s, attention_flop_s, byte_s = self._rates
        gemm_s = max(linear_flops / flop_s + moe_s, weight / byte_s)
        prefill_s = max(prefill_flops / attention_flop_s, prefill_bytes / byte_s)
        decode_s = max(decode_flops / attention_flop_s, decode_bytes / byte_s)
        host_s = self.host_s(num_chunks, len(others))
        return gemm_s + prefill_s + decode_s + comm_s + host_s + self.model.num_layers * self.layer_fixed_s

    def _prefill_sums(
        self, num_tokens: int, others: Sequence[tuple[int, int]], num_chunks: int
    ) -> tuple[float, float, float]:
        """`_step_cost`'s (linear FLOPs before the MoE tiles', prefill attention FLOPs, prefill
        bytes) of a step of `num_tokens` tokens in `num_chunks` chunks whose chunks of more
        than one token are `others`, each entry from the terms' factors made once
        (`_chunk_terms`). Every float is formed as `_step_cost` forms it, from the same
        operands in the same order (a product of a term's factors made once is the same
        product: Python multiplies left to right; the read bytes summed by `sum`, as
        `_read_bytes` sums them), and its integers (entries attended and read) are the same
        integers, so the sums round alike."""
        model = self.model
        head_flops = 2 * num_chunks * model.vocab_size * model.hidden_size / self.tp
        linear_flops = 2 * num_tokens * self.active_params_per_token + head_flops
        write = self.kv_write_bytes_per_token
        prefill_flops = prefill_bytes = 0.0
        terms = self._chunk_terms
        for n, ctx in others:
            lo = ctx - n  # queries at positions [lo, ctx): `_step_cost`'s prefill chunk
            reads = []  # each term's read bytes (`_read_bytes(n, ctx)`'s, summed by `sum` below)
            decompressed = []  # each decompressing term's bytes, added after them
            for flops_w, bytes_w, m, cap, selection, decompress, decompress_flops_w, decompress_bytes_w in terms:
                # entries attended by queries [lo, ctx): `attended` (sum_visible's closed form,
                # the same integer: sum over k in (lo, hi] of min(cap, k // m))
                if cap is not None and lo >= cap * m:  # every query past the cap: cap entries each
                    attended = n * cap
                else:  # (`_prefix_visible` of ctx less that of lo, in `_floor_sum`'s closed form)
                    if cap is not None and ctx >= cap * m:
                        q, r = divmod(cap * m - 1, m)
                        hi_sum = m * q * (q - 1) // 2 + q * (r + 1) + (ctx - cap * m + 1) * cap
                    else:
                        q, r = divmod(ctx, m)
                        hi_sum = m * q * (q - 1) // 2 + q * (r + 1)
                    q, r = divmod(lo, m)
                    attended = hi_sum - (m * q * (q - 1) // 2 + q * (r + 1))
                prefill_flops += flops_w * attended
                # the distinct entries read: `read_entries`
                if selection == "window":
                    reads.append(bytes_w * min(ctx, cap + n - 1))
                elif selection == "topk":
                    reads.append(bytes_w * min(ctx // m, n * cap))
                else:
                    reads.append(bytes_w * (ctx // m))
                if decompress:  # P_active already counts kv_b_proj on the n new tokens: the rest of ctx
                    linear_flops += decompress_flops_w * lo
                    decompressed.append(decompress_bytes_w * ctx)
            prefill_bytes += n * write + sum(reads)
            for num_bytes in decompressed:
                prefill_bytes += num_bytes
        return linear_flops, prefill_flops, prefill_bytes

    @cached_property
    def _chunk_terms(self) -> tuple[tuple[float, float, int, int | None, str, bool, float, float], ...]:
        """Per attention term, the factors `_step_cost`'s loop multiplies a prefill chunk's
        entries by, formed as it forms them: (num_layers x its prefill FLOPs per entry,
        num_layers x entry bytes, tokens per entry, cap, selection, whether it decompresses,
        num_layers x decompress FLOPs per token, num_layers x decompress bytes per token).
        The selections' premises `read_entries` asserts, checked once here."""
        for t in self.attention_terms:
            if t.selection == "window":
                assert t.cap is not None and t.tokens_per_entry == 1
            elif t.selection == "topk":
                assert t.cap is not None
            else:
                assert t.selection == "all", t.selection
        return tuple(
            (
                t.num_layers * (t.flops_per_entry if t.prefill_flops_per_entry is None else t.prefill_flops_per_entry),
                t.num_layers * t.entry_bytes,
                t.tokens_per_entry,
                t.cap,
                t.selection,
                bool(t.decompress_flops_per_token),
                t.num_layers * t.decompress_flops_per_token,
                t.num_layers * t.decompress_bytes_per_token,
            )
            for t in self.attention_terms
        )

    @cached_property
    def _rates(self) -> tuple[float, float, float]:
        """(the GEMMs' FLOP/s, attention's FLOP/s, bytes/s), as `_step_cost` computes them."""
        peak_linear, peak_attention = self._peaks
        byte_s = self.gpu.hbm_bandwidth_bytes_per_s * self.bandwidth_efficiency
        return peak_linear * self.compute_efficiency, peak_attention * self.compute_efficiency, byte_s

    def _token_terms(self, num_tokens: int) -> tuple[float | None, float, float, float]:
        """The figures of `_step_cost` that depend on the step's token count alone: (the MoE
        tiles' padding FLOPs, None without `_moe_tiles`; moe_s; the weight bytes; comm_s),
        each `_step_cost`'s own float, kept per count (`_token_memo`: a step's tokens are
        at most its budget and its replays)."""
        terms = self._token_memo.get(num_tokens)
        if terms is not None:
            return terms
        moe = self.model.moe
        touched = len(moe.moe_layers) * self.experts_touched(num_tokens) if moe else 0
        tile_flops, moe_s = None, 0.0
        if self._moe_tiles:
            tile_flops, moe_s = self._moe_tile_flops(num_tokens), self._moe_compute_s(num_tokens)
        weight = self.dense_weight_bytes + num_tokens * self.embedding_row_bytes + touched * self.expert_bytes
        terms = (tile_flops, moe_s, weight, self.comm_s(num_tokens))
        if len(self._token_memo) < _MAX_TOKEN_MEMO:
            self._token_memo[num_tokens] = terms
        return terms

    @cached_property
    def _token_memo(self) -> dict[int, tuple[float | None, float, float, float]]:
        """token count -> `_token_terms` (at most `_MAX_TOKEN_MEMO` counts)."""
        return {}

    def _decode_sums(self, positions: Sequence[int] | np.ndarray) -> tuple[int, int] | None:
        """(FLOPs, bytes) x `_decode_scale` of one decode at each of `positions` (one or
        more: ints, or an int64 array [n], read as it is), summed: `_decode_scan`'s integer
        sums of the chunks (1, p + 1), below 2^53 each (so exact as floats). None where this
        cannot tell them: no `_decode_scale`, a position that is not an int or is negative
        (an array of another dtype or shape), past the table's last (its entries past
        2^53 or `_MAX_TABLE_POSITIONS`), 2^11 positions or more, or sums past 2^53.

        One numpy gather of `_decode_table`'s rows (each position's) and one dot product with
        ones (a BLAS call: ~1 us at a fleet run's batch of ~130 decodes, where a uint64
        gather and sum over axis 0 took ~4) instead of a memo lookup and a Python int a
        decode (the memo's entries were a cache miss each at that scale). The float64 sums
        are the exact integer sums: every entry is an integer below 2^53 (exact as a float,
        times 1.0 exact), and while the total is below 2^53 so is every partial sum, in any
        order or grouping the BLAS takes (non-negative terms), so no addition rounds; a total
        of 2^53 or more comes out at 2^53 or more (rounding is monotone and 2^53 a float),
        which is refused."""
        scale = self._decode_scale
        n = len(positions)
        if scale is None or n >= _MAX_TABLE_DECODES:
            return None
        if type(positions) is np.ndarray:  # (int64 [n] only: its items are the ints they hold)
            if positions.dtype != np.int64 or positions.ndim != 1:
                return None
            at = positions
        else:
            if not _ints_only(positions):
                return None
            try:  # (ints only: an int past int64 is the one error left)
                at = np.fromiter(positions, np.int64, n)
            except OverflowError:
                return None
        table = self._decode_table[0]
        # The largest position as a uint64 (a negative one is past every table's end so), by
        # argmax and one item (~0.7 us), not the ufunc reduce `max` (~3.5 us at a fleet run's
        # ~13 rows, its dispatch: 2.6 % of the run's samples); the uint64 view of an array
        # passed again kept (`_decode_view`: the cost executor's, moved on in place step by
        # step; a view reads the array's buffer as it is now)
        kept = self._decode_view
        if kept[0] is positions:
            wide = kept[1]
        else:
            wide = at.view(np.uint64)
            if at is positions:
                kept[:] = positions, wide
        if wide.item(wide.argmax()) >= len(table):
            if int(at.min()) < 0 or not self._grow_decode_table(int(at.max()) + 1):
                return None
            table = self._decode_table[0]
        flops, num_bytes = np.dot(_ONES[:n], table.take(at, axis=0)).tolist()
        if flops >= _EXACT or num_bytes >= _EXACT:  # past exact float sums: the loop's
            return None
        return int(flops), int(num_bytes)

    @cached_property
    def _decode_view(self) -> list[np.ndarray | None]:
        """[the last int64 array `_decode_sums` was given, its uint64 view] ([None, None] till
        one is): the view made once while the same array comes back."""
        return [None, None]

    @cached_property
    def _decode_table(self) -> list[np.ndarray]:
        """[the table]: row p ([num positions, 2] float64) is the decode at position p's
        `_decode_entry(p + 1)` (FLOPs, bytes) x `_decode_scale`, every entry an integer below
        2^53 (exact as a float: `_decode_sums` adds them in a BLAS dot product); grown by
        `_grow_decode_table` (the list holds the latest: the model is frozen)."""
        return [np.zeros((0, 2), dtype=np.float64)]

    def _grow_decode_table(self, num_positions: int) -> bool:
        """Make `_decode_table` hold at least positions [0, num_positions) (twice its rows
        where that is within bounds: a run's contexts grow a little at a time); False where
        it cannot: past `_MAX_TABLE_POSITIONS`, or an entry there of 2^53 or more (entries grow
        with the position: the last one bounds them all)."""
        scale = self._decode_scale
        assert scale is not None
        old = len(self._decode_table[0])
        if num_positions > _MAX_TABLE_POSITIONS or max(self._decode_entry(num_positions)) >= 1 << 53:
            return False
        size = min(max(num_positions, 2 * old, 1024), _MAX_TABLE_POSITIONS)
        if max(self._decode_entry(size)) >= 1 << 53:
            size = num_positions
        # `_decode_entry` over contexts [old + 1, size] at once: the same integers (each term's
        # product is at most the last entry's, below 2^53: no int64 wraps)
        ctx = np.arange(old + 1, size + 1, dtype=np.int64)
        flops = np.zeros(len(ctx), dtype=np.int64)
        num_bytes = np.full(len(ctx), int(self.kv_write_bytes_per_token * scale), dtype=np.int64)
        for flops_w, bytes_w, per_entry, cap in self._decode_terms:
            e = ctx // per_entry
            if cap is not None:
                np.minimum(e, cap, out=e)
            if not e[-1]:  # none of these contexts holds an entry of this term
                continue
            flops += int(flops_w * scale) * e
            num_bytes += int(bytes_w * scale) * e
        grown = np.empty((size, 2), dtype=np.float64)  # (int64 columns below 2^53: exact)
        grown[:old] = self._decode_table[0]
        grown[old:, 0] = flops
        grown[old:, 1] = num_bytes
        self._decode_table[0] = grown
        return True

    def _decode_batch_terms(self, num_decodes: int) -> tuple[float, float, float, float]:
        """(gemm_s, comm_s, host_s, fixed_s) of a step of `num_decodes` decodes: they depend on
        the batch size alone (N = C = num_decodes tokens and chunks, no prefill chunk), not on
        the contexts, so they are `step_cost`'s own figures for any such step, kept per size."""
        terms = self._decode_batch_memo.get(num_decodes)
        if terms is None:
            cost = self.step_cost([(1, 1)] * num_decodes)
            terms = self._decode_batch_memo[num_decodes] = (cost.gemm_s, cost.comm_s, cost.host_s, cost.fixed_s)
        return terms

    @cached_property
    def _decode_batch_memo(self) -> dict[int, tuple[float, float, float, float]]:
        """batch size -> `_decode_batch_terms` (at most one entry per size: max_num_seqs)."""
        return {}


def moe_block_m(tokens_per_expert: int) -> int:
    """The tile height (rows) triton_kernels' ragged grouped GEMM (matmul_ogs, the TRITON MoE
    backend's) picks for an expected `tokens_per_expert` rows an expert (its
    max(1, rows // experts)), by its NVIDIA heuristic (matmul_ogs_details/opt_flags.py,
    make_default_opt_flags_nvidia): next_pow2(2 x tokens) held to [16, 64] at most 64 rows
    ("Ragged and likely memory bound"), else next_pow2(tokens) held to [16, 128]."""
    if tokens_per_expert < 1:
        raise ValueError(f"tokens_per_expert must be >= 1, got {tokens_per_expert}")
    if tokens_per_expert <= 64:
        return max(16, min(_next_pow2(2 * tokens_per_expert), 64))
    return max(16, min(_next_pow2(tokens_per_expert), 128))


def _next_pow2(n: int) -> int:
    """The least power of two >= n (1 for n <= 1), as triton.next_power_of_2."""
    return 1 << max(0, n - 1).bit_length()


def _check_chunks(chunks: Sequence[tuple[int, int]]) -> None:
    if len(chunks) == 0:
        raise ValueError("a step needs at least one chunk, got none")
    try:  # the common case in one pass; the loop below names what is wrong
        if all(type(n) is int and type(ctx) is int and 1 <= n <= ctx for n, ctx in chunks):
            return
    except (TypeError, ValueError):
        pass
    for i, chunk in enumerate(chunks):
        if len(chunk) != 2:
            raise ValueError(f"chunk {i} must be (num_new_tokens, context_len), got {chunk!r}")
        n, ctx = chunk
        for name, value in (("num_new_tokens", n), ("context_len", ctx)):
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"chunk {i}: {name} must be an integer, got {value!r}")
        if n < 1:
            raise ValueError(f"chunk {i}: num_new_tokens must be >= 1, got {n}")
        if ctx < n:
            raise ValueError(f"chunk {i}: context_len={ctx} is shorter than its num_new_tokens={n}")


# ----- attention terms by attention kind ------------------------------------------------


def _gqa_terms(model: ModelSpec, layout: KVLayout, tp: int) -> tuple[AttentionTerm, ...]:
    flops = 4 * (model.num_heads // tp) * model.head_dim
    return tuple(
        AttentionTerm(
            name=g.name,
            num_layers=g.num_layers,
            entry_bytes=g.entry_bytes,
            flops_per_entry=flops,
            cap=g.window,
            selection="all" if g.window is None else "window",
        )
        for g in layout.groups
    )


def _mla_terms(model: ModelSpec, layout: KVLayout, tp: int) -> tuple[AttentionTerm, ...]:
    mla, idx = model.mla, model.indexer
    assert mla is not None
    groups = {g.name: g for g in layout.groups}
    r, heads = mla.kv_lora_rank, model.num_heads // tp
    nope, rope, v = mla.qk_nope_head_dim, mla.qk_rope_head_dim, mla.v_head_dim
    decompressed = idx is None  # V3.2's prefill attends its top-k latents, absorbed, as its decode
    latent = AttentionTerm(
        name="mla-latent",
        num_layers=model.num_layers,
        entry_bytes=groups["mla-latent"].entry_bytes,
        flops_per_entry=2 * heads * (r + rope) + 2 * heads * r,
        cap=None if idx is None else idx.topk,
        selection="all" if idx is None else "topk",
        prefill_flops_per_entry=2 * heads * (nope + rope) + 2 * heads * v if decompressed else None,
        decompress_flops_per_token=2 * r * heads * (nope + v) if decompressed else 0.0,
        decompress_bytes_per_token=2 * heads * (nope + rope + v) * 2 if decompressed else 0.0,
    )
    if idx is None:
        return (latent,)
    indexer = AttentionTerm(
        name="indexer-key",
        num_layers=model.num_layers,
        entry_bytes=groups["indexer-key"].entry_bytes,
        flops_per_entry=2 * idx.num_heads * idx.head_dim,
    )
    return latent, indexer


def _dsv4_terms(model: ModelSpec, layout: KVLayout, tp: int) -> tuple[AttentionTerm, ...]:
    v4 = model.dsv4
    assert v4 is not None
    groups = {g.name: g for g in layout.groups}
    entry = v4.main_entry_bytes(_V4_ENTRY_DTYPE[layout.kv_dtype])
    for name in ("csa-entry", "hca-entry"):
        assert name not in groups or groups[name].entry_bytes == entry, (name, groups[name].entry_bytes, entry)
    main_flops = 4 * (v4.num_heads // tp) * v4.head_dim  # one vector is K and V
    terms = [
        AttentionTerm("swa-window", v4.num_layers, entry, main_flops, cap=v4.window, selection="window"),
    ]
    num_csa, num_hca = v4.num_layers_of(LayerKind.CSA), v4.num_layers_of(LayerKind.HCA)
    if num_csa:
        terms.append(
            AttentionTerm("csa-entry", num_csa, entry, main_flops, v4.csa_ratio, cap=v4.index_topk, selection="topk")
        )
        terms.append(
            AttentionTerm(
                "csa-indexer-key",
                num_csa,
                groups["csa-indexer-key"].entry_bytes,
                2 * v4.index_n_heads * v4.index_head_dim,
                v4.csa_ratio,
            )
        )
    if num_hca:
        assert v4.hca_ratio is not None
        terms.append(AttentionTerm("hca-entry", num_hca, entry, main_flops, v4.hca_ratio))
    return tuple(terms)


# model.attention -> its terms: a plain dict, one entry per attention kind.
_TERMS = {"gqa": _gqa_terms, "mla": _mla_terms, "dsv4": _dsv4_terms}


@dataclass(frozen=True)
class RestoreCostModel:
    """A V4 prefix hit's state restore priced in seconds (cache/dual_pool.py `RestoreCost`),
    as the cost executor (sim/executor.py) prices what it does: a checkpoint copy moves its
    `checkpoint_bytes` twice (read and write) at the effective bandwidth; computing tokens (a
    replay, or the tokens a cut hit computes again as prompt) costs their FLOPs at the
    effective peak, the time they add to a step (the weights are read once for the whole
    step whatever it computes)."""

    cost: CostModel
    checkpoint_bytes: int  # one checkpoint: the state at a span boundary (less than a state block)
    # (num_tokens, context_len) -> compute_cost: every prefix lookup prices its hit's restore
    # (a fleet router looks a prompt up on every replica), always at whole spans of the
    # same few lengths, and a step's cost is a pure function of them
    _computed: dict[tuple[int, int], float] = dataclass_field(
        default_factory=dict, init=False, repr=False, compare=False
    )

    @property
    def version(self) -> int:
        """`RestoreCost.version`: the prices are a pure function of the frozen cost model."""
        return 0

    def checkpoint_cost(self) -> float:
        gpu = self.cost.gpu
        return 2 * self.checkpoint_bytes / (gpu.hbm_bandwidth_bytes_per_s * self.cost.bandwidth_efficiency)

    def compute_cost(self, num_tokens: int, context_len: int) -> float:
        key = (num_tokens, context_len)
        if type(num_tokens) is not int or type(context_len) is not int:  # True == 1 as a key: step_cost refuses it
            return self.cost.step_cost([key]).compute_s
        seconds = self._computed.get(key)
        if seconds is None:
            seconds = self._computed[key] = self.cost.step_cost([key]).compute_s
        return seconds
