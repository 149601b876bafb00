"""The peak ledger and the planner against hand-computed examples."""

from __future__ import annotations

import pytest

from kvpool.capacity.kv import kv_layout
from kvpool.capacity.ledger import TERMS, LedgerAssumptions, build_ledger
from kvpool.capacity.planner import max_concurrent, max_context, plan
from kvpool.spec.gpus import GPUSpec, get_gpu
from kvpool.spec.models import count_parameters, from_hf_config, load_preset

# A toy Llama: 2 layers, hidden 64, 4 query / 2 KV heads of 16 dims, MLP 128, vocab 100.
TOY = {
    "model_type": "llama",
    "num_hidden_layers": 2,
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "intermediate_size": 128,
    "vocab_size": 100,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
}
# Round assumptions so every line can be checked by hand.
SMALL = LedgerAssumptions(
    max_num_batched_tokens=16,
    max_num_seqs=2,
    cuda_graphs=False,
    cuda_context_bytes=1 << 20,
    fragmentation_fraction=0.0,
    segment_bytes=0,
)
TWO_MIB = GPUSpec("toy", 2 << 20, 1e12)


def test_toy_parameters_and_kv_by_hand() -> None:
    model = from_hf_config(TOY, name="toy")
    p = count_parameters(model)
    assert p.embedding == p.lm_head == 100 * 64
    assert p.attention == 2 * (64 * 64 + 2 * 64 * 32 + 64 * 64)  # q, k, v, o
    assert p.mlp == 2 * 3 * 64 * 128
    assert p.norms == 2 * 2 * 64 + 64
    assert p.total == 86_848
    layout = kv_layout(model, "bf16", block_size=16)
    assert layout.bytes_per_token == 2 * 2 * 2 * 16 * 2 == 256  # K,V x layers x heads x dim x bf16
    assert layout.bytes_per_block_all_groups == 16 * 256 == 4096


def test_toy_ledger_by_hand() -> None:
    p = plan(from_hf_config(TOY, name="toy"), TWO_MIB, context_len=64, concurrency=10, block_size=16, assumptions=SMALL)
    weights = 2 * 86_848
    # activations: 16 tokens x 2 B x (3 x 64 + widest 3 x 128 of the MLP); logits: 2 x 2 seqs x 100 x 4 B
    workspace = 16 * 2 * (3 * 64 + 384) + 2 * 2 * 100 * 4
    transient = 2 * 4096  # copy-on-write reserve: one block per running request
    allocator = 1 << 20  # the CUDA context alone (no fragmentation, no segment rounding here)
    block_tables = 2 * 4 * 4 + 16 * 8  # 2 seqs x 4 blocks (64 tokens) x int32 + slot mapping
    remaining = (2 << 20) - weights - workspace - transient - allocator - block_tables
    pool = remaining // 256 * 256
    assert (weights, workspace, remaining, pool) == (173_696, 20_032, 846_496, 846_336)

    ledger = p.ledger
    assert set(ledger.terms) == set(TERMS)
    assert ledger.terms == {
        "weights": weights,
        "kv_pool": pool + block_tables,
        "workspace": workspace,
        "graph": 0,
        "allocator": allocator,
        "transient": transient,
    }
    assert ledger.free == remaining - pool < 256
    assert ledger.total + ledger.free == ledger.capacity

    # 64 tokens = 4 blocks of 4096 B; 846,336 // 16,384 = 51 requests
    assert p.max_concurrent_requests == 51
    # 10 requests: at most 846,336 // (10 x 4096) = 20 blocks each -> 320 tokens
    assert p.max_context_len == p.max_context_memory_len == 320
    occ = p.occupancy
    assert occ["data"] == 51 * 64 * 256 and occ["tail_waste"] == 0
    assert sum(occ.values()) == pytest.approx(pool)


def test_planner_searches_are_exact_at_the_edges() -> None:
    layout = kv_layout(from_hf_config(TOY, name="toy"), "bf16", block_size=16)
    pool = 20 * 4096
    assert max_concurrent(layout, pool, 16) == 20
    assert max_concurrent(layout, pool, 17) == 10
    assert max_context(layout, pool, 1) == 320
    assert max_context(layout, pool, 3) == 96  # 6 blocks each
    assert max_context(layout, pool, 21) == 0  # not even one block each
    assert max_context(layout, pool - 1, 1) == 304  # one byte less: 19 blocks
    with pytest.raises(ValueError):
        max_concurrent(layout, pool, 0)


def test_window_only_context_is_limited_by_the_model() -> None:
    cfg = dict(TOY, model_type="mistral", sliding_window=64)
    p = plan(from_hf_config(cfg, name="swa"), TWO_MIB, context_len=64, concurrency=2, block_size=16, assumptions=SMALL)
    assert p.max_context_memory_len is not None and p.max_context_memory_len > 10**9
    assert p.max_context_len == 4096


def test_kv_pool_takes_what_the_other_terms_leave() -> None:
    model = load_preset("llama-3.1-8b")
    a = plan(model, get_gpu("H100"), context_len=8192)
    b = plan(model, get_gpu("H200"), context_len=8192)
    extra = get_gpu("H200").memory_bytes - get_gpu("H100").memory_bytes
    assert b.ledger.pool_bytes - a.ledger.pool_bytes == pytest.approx(extra, abs=256)
    for term in ("weights", "workspace", "graph", "allocator", "transient"):
        assert a.ledger.terms[term] == b.ledger.terms[term]
    # at 8192 tokens a request holds 8192 x 131,072 B = 1 GiB of KV
    assert a.max_concurrent_requests == int(a.ledger.pool_bytes // (1 << 30))


def test_tp_and_replicas() -> None:
    llama70 = load_preset("llama-3.1-70b")
    h100 = get_gpu("H100")
    one_group = plan(llama70, h100, num_gpus=8, tp=8, context_len=32768)
    two_groups = plan(llama70, h100, num_gpus=8, tp=4, context_len=32768)
    assert one_group.replicas == 1 and two_groups.replicas == 2
    assert two_groups.max_concurrent_requests == 2 * two_groups.max_concurrent_per_replica
    # a replicated MLA latent does not shrink with TP: the pool per GPU must hold whole requests
    v3 = load_preset("deepseek-v3")
    h200 = get_gpu("H200")
    p = plan(v3, h200, num_gpus=8, tp=8, context_len=65536)
    assert p.layout.request_bytes(65536) == 1024 * 64 * 61 * 1152
    with pytest.raises(ValueError, match="multiple of tp"):
        plan(llama70, h100, num_gpus=6, tp=4)


def test_a_model_that_does_not_fit() -> None:
    p = plan(load_preset("llama-3.1-70b"), get_gpu("H100"), context_len=8192)  # 141 GB of weights, one GPU
    assert not p.fits
    assert p.ledger.pool_bytes == 0 and p.max_concurrent_requests == 0
    assert p.ledger.total > p.ledger.capacity


def test_ledger_counts_scales_padding_and_graphs() -> None:
    v4 = load_preset("deepseek-v4-pro")
    p = plan(v4, get_gpu("H200"), num_gpus=8, tp=8, context_len=1 << 20)
    occ = p.occupancy
    assert occ["quant_scales"] > 0 and occ["alignment_padding"] > 0 and occ["state"] > 0
    assert occ["tail_waste"] == 0  # 1M is a multiple of 128: no partial block
    assert p.ledger.details["transient"]["comm_staging"] > 0  # TP 8
    no_graphs = plan(
        v4, get_gpu("H200"), num_gpus=8, tp=8, context_len=1 << 20, assumptions=LedgerAssumptions(cuda_graphs=False)
    )
    assert no_graphs.ledger.terms["graph"] == 0
    assert no_graphs.ledger.pool_bytes > p.ledger.pool_bytes
    layout = kv_layout(v4, tp=8)
    ledger = build_ledger(v4, layout, 0.0, 1 << 40, 1 << 20)
    assert ledger.details["kv_pool"]["block_tables"] == 256 * 3 * 8192 * 4 + 8192 * 8


def test_expert_parallel_with_data_parallel_attention() -> None:
    v4 = load_preset("deepseek-v4-pro")
    h200 = get_gpu("H200")
    tp8 = plan(v4, h200, num_gpus=8, tp=8, context_len=1 << 20)
    dp_ep = plan(v4, h200, num_gpus=8, tp=1, context_len=1 << 20, expert_parallel=True)
    # experts split 8 ways, everything else whole on each GPU. V4-Pro's routed experts: 61
    # layers x 384 experts x gate, up, down of 7168 x 3072, in MXFP4 (0.5 + 1/32 B a value)
    w = dp_ep.weights
    assert w.params.experts == 61 * 384 * 3 * 7168 * 3072 == 1_547_396_186_112
    expert_bytes = 1_547_396_186_112 * (0.5 + 1 / 32)
    assert w.per_gpu_bytes == pytest.approx(w.total_bytes - expert_bytes + expert_bytes / 8)
    assert dp_ep.replicas == 8
    assert dp_ep.max_concurrent_requests == 8 * dp_ep.max_concurrent_per_replica
    # the latent is replicated under TP, so 8 separate pools hold more requests than one TP-8 group
    assert dp_ep.max_concurrent_requests > tp8.max_concurrent_requests
    assert dp_ep.ledger.details["transient"]["ep_all_to_all"] > 0
    with pytest.raises(ValueError, match="MoE"):
        plan(load_preset("llama-3.1-8b"), h200, num_gpus=8, tp=1, expert_parallel=True)
