"""`kvpool verify pd`: prefill / decode disaggregation (engine/disaggregated.py) on SmolLM2
against a single-process run. One process a rank, the prefill side's ranks first:

    torchrun --nproc-per-node 4 -m kvpool verify pd --prefill-tp 1 --decode-tp 3 \\
        --prefill-block-size 16 --decode-block-size 32

For each prompt (a ~500-token one, the same again, another), the decode side asks for the
full blocks it lacks, receives them, installs them, then decodes --max-tokens greedy
tokens; they must equal the tokens of the single-process engine (the decode leader runs
it first, on the whole model). The repeated prompt must transfer nothing. --prefill-tenant
makes the prefill side describe its blocks under another tenant: the decode side must
reject the transfer (and compute the prompt itself). --crash makes the prefill leader die
after sending its first descriptor: the decode side must install nothing, keep its pool
intact (check_integrity), and compute the prompt itself. (torchrun stops every process
when one fails, so --crash runs are started with RANK / WORLD_SIZE / MASTER_ADDR /
MASTER_PORT set by hand; the tests do that.)

The verification passes only when what it verifies happened: each new prompt's blocks were
received (tokens_received > 0), installed, and used (the decode engine's prefix hit covers
them: cached_tokens >= tokens_received); the repeated prompt received nothing yet hit its
blocks; no transfer failed; and every request's tokens equal the single-process run's. A
run where transfers were rejected (--prefill-tenant) or broke off (--crash) shows that the
fault left nothing installed and the tokens right, but it moved no KV, so it does not pass:
`failures` says what did not happen.
"""

from __future__ import annotations

import os
import time

import torch.distributed as dist

PROMPTS = (
    "Summarize, section by section, what the following reference text says about Python's statements: ",
    "List the keywords this reference text mentions, in the order they first appear: ",
)


def _prompts(tokenizer, length: int) -> list[list[int]]:
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[k] for k in sorted(topics))
    body = tokenizer.encode(text)[:length]
    first = tokenizer.encode(PROMPTS[0]) + body
    second = tokenizer.encode(PROMPTS[1]) + body[: length // 2]
    return [first, first, second]


NUM_BLOCKS = 256  # each engine's pool, on either side and in the single-process run


def check_sizes(loaded, prefill_bs: int, decode_bs: int, prompt_len: int) -> None:
    """ValueError naming the flags where a request cannot fit the engines' pools of
    NUM_BLOCKS blocks (or the model's positions), or a pool the machine's memory (counted
    whole, as the single-process run holds it). The engine's words named no flag of verify
    pd ("request 'req-0': prompt of 100020 tokens is too long", "lower --kv-memory or
    --num-blocks"), on one side while the other side waited for it."""
    from kvpool.engine.build import cache_spec_for
    from kvpool.engine.memory import check_fits

    first, _, other = prompts = _prompts(loaded.tokenizer, prompt_len)
    longest = max(len(p) for p in prompts)
    holds = min(NUM_BLOCKS * min(prefill_bs, decode_bs), loaded.model.config.max_position)
    if longest >= holds:  # (the engine's rule: a prompt leaves room for one output token)
        raise ValueError(
            f"--prompt-len {prompt_len} makes prompts of up to {longest:,} tokens; the verifier's pools of "
            f"{NUM_BLOCKS} blocks of {min(prefill_bs, decode_bs)} tokens (and the model's "
            f"{loaded.model.config.max_position:,} positions) hold {holds:,} tokens a request, the output's "
            "included: lower --prompt-len"
            + (", or raise the block sizes" if holds < loaded.model.config.max_position else "")
        )
    bs = max(prefill_bs, decode_bs)
    check_fits(
        NUM_BLOCKS * cache_spec_for(loaded, bs).bytes_per_block,
        "cpu",
        f"the verifier's pool of {NUM_BLOCKS} blocks of {bs} tokens (--prefill-block-size {prefill_bs}, "
        f"--decode-block-size {decode_bs})",
        "lower the block sizes",
    )
    # each new prompt must move KV: the decode side's whole blocks before its last token, as
    # far as the prefill side's whole blocks reach (else the run fails, "no KV was transferred",
    # and its third prompt showed "nothing to receive (held already)", holding nothing)
    short = min(len(first), len(other))
    if transferable(short, prefill_bs, decode_bs):
        return
    # the prompts are a fixed instruction each and --prompt-len (or half of it) body tokens
    c0, c1 = len(first) - prompt_len, len(other) - prompt_len // 2
    enough = next(
        (
            n
            for n in range(prompt_len + 1, holds)
            if c0 + n < holds and transferable(min(c0 + n, c1 + n // 2), prefill_bs, decode_bs)
        ),
        None,
    )
    raise ValueError(
        f"--prompt-len {prompt_len} makes one prompt {short} tokens long, too short to move any KV: it holds no whole "
        f"--decode-block-size {decode_bs} block before its last token within whole --prefill-block-size "
        f"{prefill_bs} blocks; "
        + (f"give --prompt-len {enough} or more, or smaller block sizes" if enough else "lower the block sizes")
    )


def transferable(num_tokens: int, prefill_bs: int, decode_bs: int) -> int:
    """Tokens of a `num_tokens`-token prompt a transfer moves: the decode side's whole blocks
    before the prompt's last token (an admission computes it), as far as the prefill side's
    cached whole blocks reach."""
    return min((num_tokens - 1) // decode_bs, num_tokens // prefill_bs * prefill_bs // decode_bs) * decode_bs


def run_pd(
    prefill_tp: int,
    decode_tp: int,
    prefill_bs: int,
    decode_bs: int,
    max_tokens: int,
    prompt_len: int,
    prefill_tenant: str = "",
    crash: bool = False,
) -> dict[str, object] | None:
    from kvpool.engine.build import build_engine, load_model
    from kvpool.engine.disaggregated import Disaggregation, TransferError
    from kvpool.engine.sampling import SamplingParams
    from kvpool.models.tensor_parallel import (
        check_rendezvous_env,
        check_same_arguments,
        check_tp,
        gloo_reason,
        join_group,
        shard_llama,
    )

    if "WORLD_SIZE" not in os.environ or "RANK" not in os.environ:
        raise ValueError("kvpool verify pd runs under torchrun: torchrun --nproc-per-node P+D -m kvpool verify pd")
    check_rendezvous_env()
    world = int(os.environ["WORLD_SIZE"])
    if world != prefill_tp + decode_tp:
        raise ValueError(f"--prefill-tp {prefill_tp} + --decode-tp {decode_tp} ranks, but {world} processes")
    loaded = load_model(device="cpu")
    check_tp(loaded.model.config, prefill_tp, "--prefill-tp")
    check_tp(loaded.model.config, decode_tp, "--decode-tp")
    check_sizes(loaded, prefill_bs, decode_bs, prompt_len)  # every rank alike, before the group
    join_group()  # every wait bounded (GROUP_TIMEOUT_S); a group that cannot form: one line
    args = (prefill_tp, decode_tp, prefill_bs, decode_bs, max_tokens, prompt_len, prefill_tenant, crash)
    check_same_arguments("P/D", *args)
    rank = dist.get_rank()
    prefill_ranks = list(range(prefill_tp))
    decode_ranks = list(range(prefill_tp, world))
    groups = {"prefill": dist.new_group(prefill_ranks), "decode": dist.new_group(decode_ranks)}
    side = "prefill" if rank in prefill_ranks else "decode"
    ranks = prefill_ranks if side == "prefill" else decode_ranks
    prompts = _prompts(loaded.tokenizer, prompt_len)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    reference: list[list[int]] = []
    if rank == decode_ranks[0]:  # the single-process run: the whole model, the decode block size
        single = build_engine(loaded, num_blocks=NUM_BLOCKS, block_size=decode_bs, enable_prefix_caching=False)
        for p in prompts:
            rid = single.add_request(p, params)
            while single.has_unfinished():
                single.step()
            reference.append(single.pop_output(rid).completions[0].token_ids)
    if len(ranks) > 1:
        loaded.model = shard_llama(loaded.model, ranks.index(rank), len(ranks), groups[side])
    bs = prefill_bs if side == "prefill" else decode_bs
    engine = build_engine(
        loaded, num_blocks=NUM_BLOCKS, block_size=bs, host_cache_bytes=(256 << 20) if side == "decode" else None
    )
    landing = engine.runner.host_tier
    dis = Disaggregation(
        engine,
        prefill_ranks,
        decode_ranks,
        landing=landing,
        tenant=prefill_tenant if side == "prefill" else "",
    )
    results = []
    broken = False
    for i, p in enumerate(prompts):
        if side == "prefill":
            if crash and i > 0:
                break
            dis.serve(p, crash_after_descriptor=crash and rank == prefill_ranks[0])
            continue
        outcome = "installed"
        received = (0, 0)
        began = time.perf_counter()
        if broken:
            outcome = "computed (the prefill side is gone)"
        else:
            try:
                received = dis.receive(p)
            except TransferError as e:
                outcome = f"rejected: {e}"
            except RuntimeError as e:  # a sender broke off: gloo reports the closed connection
                dis.stats.num_failed += 1
                broken = True
                # gloo's first line, without its source path and advice ("Connection closed by peer ...")
                outcome = f"broke off: {gloo_reason(str(e))[0][:120]}"
        if outcome == "installed" and not received[0]:
            outcome = "nothing to receive (held already)"
        installed_entries = landing.num_entries if landing is not None else 0
        engine.runner.check_integrity()
        rid = engine.add_request(p, params)
        while engine.has_unfinished():
            engine.step()
            engine.runner.check_integrity()
        out = engine.pop_output(rid)
        results.append(
            {
                "prompt_tokens": len(p),
                "outcome": outcome,
                "tokens_received": received[0],
                "bytes_received": received[1],
                "landing_entries": installed_entries,
                "cached_tokens": out.num_cached_tokens,
                "tokens": out.completions[0].token_ids,
                "seconds": round(time.perf_counter() - began, 3),
            }
        )
        if crash:
            break
    if not crash:
        dist.barrier()
    if rank != decode_ranks[0]:
        if not crash:
            dist.destroy_process_group()
        return None
    for r, ref in zip(results, reference, strict=False):
        r["tokens_equal"] = r.pop("tokens") == ref
    failures = transfer_failures(results, len(prompts), dis.stats.num_failed)
    report = {
        "passed": not failures,
        "failures": failures,
        "prefill_tp": prefill_tp,
        "decode_tp": decode_tp,
        "prefill_block_size": prefill_bs,
        "decode_block_size": decode_bs,
        "requests": results,
        "transfer": dis.stats.as_dict(),
        "kv_bytes_per_token_per_decode_rank": engine.runner.executor.storage.bytes_per_token,
    }
    if not crash:
        dist.destroy_process_group()
    return report


def transfer_failures(results: list[dict], num_prompts: int, num_failed: int) -> list[str]:
    """What the run should have done and did not (empty: it passes). The prompts are a new
    one, the same again, another new one (`_prompts`)."""
    failures = []
    if len(results) < num_prompts:
        failures.append(f"{len(results)} of {num_prompts} requests ran")
    if num_failed:
        failures.append(f"{num_failed} transfer(s) failed")
    for i, r in enumerate(results):
        name = f"request {i} ({r['outcome']})"
        if not r["tokens_equal"]:
            failures.append(f"{name}: its tokens differ from the single-process run's")
        if i == 1:  # the repeat: nothing to move, the first prompt's blocks hit
            if r["tokens_received"]:
                failures.append(f"{name}: received {r['tokens_received']} tokens it held already")
            if not r["cached_tokens"]:
                failures.append(f"{name}: hit no cached tokens")
        elif not r["outcome"].startswith("installed") or not r["tokens_received"]:
            failures.append(f"{name}: no KV was transferred")
        elif r["cached_tokens"] < r["tokens_received"]:
            failures.append(f"{name}: {r['tokens_received']} tokens received but {r['cached_tokens']} used")
    return failures
