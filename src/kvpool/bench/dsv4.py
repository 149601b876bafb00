"""`kvpool bench dsv4`'s measurement: V4 dual-pool bytes (Flash / Pro presets) and paged vs
oracle decode time.

Bytes come from DSV4Spec (DEEPSEEK_V4.md §5): classical bytes per token in the serving
formats (584 B main entry; indexer key 132 B FP8 or 68 B MXFP4) and in bf16 / fp32
storage, and state bytes per request (SWA window of the 43 / 61 main layers in the serving
format + fp32 compressor tails; the SWA-only MTP layer adds one more window, shown apart).

Time: the tiny V4 model (m = 4, m' = 128, n_win = 128, fp32, CPU, one thread). For each
context length C, a request is prefilled to C tokens, then `steps` decode steps are timed
on the dual pool (paged_ms_per_step); the oracle's cost for the same step is one contiguous
forward over the whole C + 1 token history (oracle_ms_per_step). Median of `repeats`.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence

V32_BYTES_PER_TOKEN = (656 + 132) * 61  # DeepSeek-V3.2: MLA latent + indexer key, 61 layers


def byte_report() -> dict[str, dict[str, float]]:
    """Preset name -> the bytes above (layer counts, per token, per block, per request)."""
    from kvpool.spec.dsv4 import LayerKind, load_preset

    report: dict[str, dict[str, float]] = {}
    for name in ("deepseek-v4-flash", "deepseek-v4-pro"):
        spec = load_preset(name)
        report[name] = {
            "num_csa_layers": spec.num_layers_of(LayerKind.CSA),
            "num_hca_layers": spec.num_layers_of(LayerKind.HCA),
            "num_swa_only_layers": spec.num_layers_of(LayerKind.SWA),
            "classical_bytes_per_token_fp8_indexer": spec.classical_bytes_per_token(indexer_format="fp8"),
            "classical_bytes_per_token_mxfp4_indexer": spec.classical_bytes_per_token(indexer_format="mxfp4"),
            "classical_bytes_per_token_bf16": spec.classical_bytes_per_token("bfloat16"),
            "classical_bytes_per_token_fp32": spec.classical_bytes_per_token("float32"),
            "classical_bytes_per_block_fp8_indexer": spec.classical_bytes_per_block(),
            "classical_vs_v32": spec.classical_bytes_per_token(indexer_format="fp8") / V32_BYTES_PER_TOKEN,
            "state_swa_bytes": spec.swa_state_bytes(),
            "state_compressor_bytes_fp32": spec.compressor_state_bytes(),
            "state_bytes_per_request": spec.state_bytes_per_request(),
            "state_bytes_per_request_with_mtp": spec.state_bytes_per_request(include_mtp=True),
            "state_bytes_per_request_bf16_swa": spec.state_bytes_per_request("bfloat16"),
            "state_bytes_kvpool_fp32_storage": spec.storage_state_bytes_per_request("float32"),
            "classical_gib_at_1m_tokens": spec.classical_bytes_per_token(indexer_format="fp8") * 2**20 / 2**30,
        }
    return report


def timing_bytes(model, context: int, steps: int) -> int:
    """The bytes one context's timing holds at its peak: the runner's pools (its classical
    blocks for context + steps tokens, one state block) and the oracle's attention over the
    context + 1 tokens, quadratic in the context: fp32 tensors of [tokens, heads, keys]
    (keys: the tokens plus a compressed entry per `ratio` of them, the smallest ratio's;
    dsv4_ops.sink_attention holds three at once, the layer's masks and indexer more), counted
    as nine of them, what the measured peaks take: peak RSS 1.07 / 3.36 GB at contexts 2,048
    / 4,096 (`--steps 1 --repeats 1`), less 0.23 GB for torch, against 0.76 / 3.04 GB here."""
    from kvpool.storage.dsv4 import DSV4Pools

    spec = model.spec
    pools = DSV4Pools(spec, 1, 1)  # (one block of each: their sizes)
    num_blocks = context // spec.span + steps // spec.span + 2
    pool_bytes = num_blocks * pools.classical_block_bytes() + pools.state_block_bytes()
    tokens = context + 1
    keys = tokens + tokens // min((r for r in spec.layer_ratios if r), default=tokens)
    oracle_bytes = 9 * 4 * tokens * spec.num_heads * keys + tokens * keys  # the scores, and the bool mask
    return pool_bytes + oracle_bytes


def check_timing(model, contexts: Sequence[int], steps: int) -> None:
    """ValueError before anything is allocated for a context the model has no positions for
    (context + steps past its max_position_embeddings), or whose timing does not fit the
    memory available (`timing_bytes`; an allocator traceback, or the OOM killer, before)."""
    from kvpool.engine.memory import check_fits

    limit = model.spec.max_position_embeddings
    for context in contexts:
        if context + steps > limit:
            raise ValueError(
                f"--contexts {context} with --steps {steps} needs {context + steps:,} positions; tiny-dsv4 has "
                f"{limit:,} (its max_position_embeddings)"
            )
    largest = max(contexts)
    check_fits(
        timing_bytes(model, largest, steps),
        "cpu",
        f"kvpool bench dsv4 --contexts {largest} (the pools and the oracle's attention scores, "
        "quadratic in the context)",
        "lower --contexts, or pass --no-timing for the byte accounting alone",
    )


def timing_report(contexts: list[int], steps: int, repeats: int) -> list[dict[str, float]]:
    """One row per context: paged and oracle milliseconds per decode step, and their ratio.
    ValueError first for a context the model or the memory cannot take (`check_timing`)."""
    import torch

    from kvpool.engine.dsv4_runner import dsv4_runner
    from kvpool.models.tiny_dsv4 import TinyDSV4

    torch.set_num_threads(1)
    model = TinyDSV4(seed=0)
    check_timing(model, contexts, steps)
    rows = []
    for context in contexts:
        ids = torch.randint(
            0, model.vocab_size, (context + steps,), generator=torch.Generator().manual_seed(context)
        ).tolist()
        paged, oracle = [], []
        for _ in range(repeats):
            runner = dsv4_runner(model, context // model.spec.span + steps // model.spec.span + 2, 1)
            runner.add_request("r", ids)
            assert runner.step([("r", context)]) is not None
            start = time.perf_counter()
            for _ in range(steps):
                assert runner.step([("r", 1)]) is not None
            paged.append((time.perf_counter() - start) / steps)
            start = time.perf_counter()
            model.reference_logits(ids[: context + 1])
            oracle.append(time.perf_counter() - start)
        p, o = statistics.median(paged), statistics.median(oracle)
        rows.append({"context": context, "paged_ms_per_step": p * 1e3, "oracle_ms_per_step": o * 1e3, "speedup": o / p})
    return rows


def measure(contexts: Sequence[int] = (128, 512, 1024), steps: int = 16, repeats: int = 3, timing: bool = True) -> dict:
    """{"bytes": byte_report(), "tiny_decode_timing": timing_report(...) or [] without
    `timing`}: the object `kvpool bench dsv4 --json` prints."""
    contexts = list(contexts)
    if any(c <= 0 for c in contexts) or steps <= 0 or repeats <= 0:
        raise ValueError("contexts, steps and repeats must be positive")
    return {"bytes": byte_report(), "tiny_decode_timing": timing_report(contexts, steps, repeats) if timing else []}
