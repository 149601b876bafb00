"""`kvpool bench hisparse`'s measurement: DeepSeek-V4 HiSparse on the tiny V4 model: device
bytes of the CSA main entries against keeping them resident, and what a decode step fetches.

For each context (`--context`): one request's prompt of that many random tokens is
prefilled, then `steps` decode steps run, with every hot-set size (`--hot-set`) and with
HiSparse off. Reported per context and hot set: the CSA main bytes the device keeps (the hot set, against the whole
pool when resident), the entries and bytes a decode step fetched from the host copy on
average, and the mean decode step time. The outputs are compared with HiSparse off: they
must be equal bit for bit (the command fails otherwise).
"""

from __future__ import annotations

import random
import time
from collections.abc import Sequence

from kvpool.bench.common import run_to_completion


class OutputsChanged(RuntimeError):
    """HiSparse changed a request's outputs: the check failed (the CLI: one line, status 1)."""


def _run(model, prompt: list[int], steps: int, hot: int | None):
    """One request of `prompt` decoding `steps` tokens on tiny-dsv4 with a hot set of `hot`
    CSA entries (None: HiSparse off): its row of figures and its logits."""
    from kvpool.engine.build import build_engine
    from kvpool.engine.sampling import SamplingParams

    span = model.spec.span
    num_blocks = -(-(len(prompt) + steps + 1) // span) + 1
    engine = build_engine(
        model,
        num_blocks=num_blocks,
        num_state_blocks=1,
        max_num_batched_tokens=2048,
        max_num_seqs=1,
        record_logits=True,
        hot_set_entries=hot,
    )
    runner = engine.runner
    rid = engine.add_request(prompt, SamplingParams(max_tokens=steps + 1, ignore_eos=True))
    while engine.requests[rid].first_token_time is None:
        engine.step()  # the prefill
    before = (runner.tier_reports().get("hisparse") or {}).get("entries_fetched", 0), _bytes(runner)
    start = time.perf_counter()
    run_to_completion(engine)
    step_ms = (time.perf_counter() - start) * 1e3 / steps
    report = runner.tier_reports().get("hisparse")
    logits = engine.requests[rid].seqs[0].logits
    out = {"decode_step_ms": round(step_ms, 2)}
    csa = [cl for cl in runner.executor.pools.classical if cl.main is not None and cl.idx is not None]
    resident = sum(cl.main.numel() * cl.main.element_size() for cl in csa)
    if report is None:
        out["csa_main_device_bytes"] = resident
    else:
        out |= {
            "csa_main_device_bytes": report["hot_set_bytes"],
            "csa_main_host_bytes": report["csa_main_bytes_on_host"],
            "fetched_entries_per_decode_step": round((report["entries_fetched"] - before[0]) / steps, 2),
            "fetched_bytes_per_decode_step": round((_bytes(runner) - before[1]) / steps, 1),
        }
    return out, logits


def _bytes(runner) -> int:
    report = runner.tier_reports().get("hisparse")
    return 0 if report is None else int(report["bytes_fetched"])


def _check_contexts(model, contexts: Sequence[int], steps: int) -> None:
    """ValueError naming --context before any prompt is drawn where a context and its steps
    pass the model's positions (--context 10000000000 spent minutes drawing 10^10 random
    tokens in Python, silent, before anything failed), or where the pools and the prompt do
    not fit the memory available."""
    from kvpool.engine.memory import check_fits
    from kvpool.storage.dsv4 import DSV4Pools

    limit = model.spec.max_position_embeddings
    for context in contexts:
        if context + steps + 1 > limit:  # (the prompt, then steps + 1 tokens sampled)
            raise ValueError(
                f"--context {context} with --steps {steps} needs {context + steps + 1:,} positions; tiny-dsv4 "
                f"has {limit:,} (its max_position_embeddings)"
            )
    largest = max(contexts)
    pools = DSV4Pools(model.spec, 1, 1)  # (one block of each: their sizes)
    num_blocks = -(-(largest + steps + 1) // model.spec.span) + 1  # `_run`'s
    need = num_blocks * pools.classical_block_bytes() + pools.state_block_bytes() + 8 * largest  # (the prompt list)
    check_fits(need, "cpu", f"kvpool bench hisparse --context {largest}", "lower --context")


def measure(
    contexts: Sequence[int] = (4096, 32768), hot_sets: Sequence[int] = (8, 64, 512), steps: int = 32, seed: int = 0
) -> dict:
    """{"steps", "rows"}: per context, a row with HiSparse off, then one per hot set that is
    smaller than the pool. ValueError first for a context the model or the memory cannot
    take (`_check_contexts`); OutputsChanged if a hot set changed the outputs."""
    import torch

    from kvpool.models.tiny_dsv4 import TinyDSV4

    if not contexts or min(contexts) <= 0 or min(hot_sets, default=1) <= 0 or steps <= 0:
        raise ValueError("contexts, hot_sets and steps must be positive")
    model = TinyDSV4(seed=seed)
    _check_contexts(model, contexts, steps)
    rng = random.Random(seed)
    rows = []
    for context in contexts:
        prompt = [rng.randrange(model.vocab_size) for _ in range(context)]
        off, want = _run(model, prompt, steps, None)
        rows.append({"context": context, "hot_set": None, **off})
        for hot in hot_sets:
            num_entries = (-(-(context + steps + 1) // model.spec.span) + 1) * model.spec.span // 4
            if hot > num_entries:
                continue  # larger than the pool: nothing to offload
            got, logits = _run(model, prompt, steps, hot)
            if len(logits) != len(want) or not all(torch.equal(a, b) for a, b in zip(logits, want, strict=True)):
                raise OutputsChanged(f"HiSparse with a hot set of {hot} changed the outputs at context {context}")
            rows.append({"context": context, "hot_set": hot, **got})
    return {"steps": steps, "rows": rows}
