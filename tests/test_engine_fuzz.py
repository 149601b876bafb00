"""A differential fuzz of the engine under hostile scheduling, on tiny random models in fp64.

Hypothesis draws a workload: prompts sharing a prefix of random length (exactly a block, a
block +- 1 among them), later turns (an earlier request's prompt and output, then more),
max_tokens 1..8, n 1..3, greedy or seeded sampling, EOS honoured or not, logprobs, tenants,
arrival steps, aborts at random steps, forwards that raise (before or after writing the
step's KV), prefix-cache resets, a pool just big enough to force preemption (by recompute,
by swap, or "auto"), a token budget small enough to chunk prefills, max_num_seqs 2 / 3 / 64,
block sizes 1 / 3 / 16, a host tier on or off, eager or step-buffered decodes, the "bags" or
"padded" decode path. Models: a tiny random Llama; the tiny hybrids (window 5 / full, and
recurrent / full, few state slots, checkpoint intervals 1..7: hits inside a block); the small
V4 (state blocks 1..4, restore by recompute / checkpoint / auto, turn-end states, tiers).

Every logit row the engine computes must equal the row of the same token history computed
by the request ALONE on a fresh roomy engine without prefix caching (the reference, itself
checked against the model's contiguous recompute); every request's tokens and finish reason
must be the reference's (an aborted request's tokens a prefix of them); check_integrity()
holds after every step and every block is free at the end. The rows are taken from the
runner's `execute` (keyed by the history they predict from), not from record_logits, which
turns the inline and column decode paths off: those are fuzzed too.

Tolerance (fp64): every row is one forward of the same weights over the same history; only
the summation order differs with the step's shape (batch rows, chunk split, paged vs
contiguous gathers). The logits are O(1) here (|logit| <= 4.7); measured over 300 examples
of each model (60 of V4), rows differ from the reference's by <= 5.6e-15 and the reference
from the contiguous recompute by <= 6.7e-15. TOL = 1e-12 is 150x that and 1e11x below what
one misread slot does (test_the_tolerance_catches_one_misread_slot). A planted fault in the
step buffers' changed-batch path (one opened block's entry left unwritten) was caught at
600 examples (0.33 off), not at the 60 run here: CI runs a modest sample each time."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvpool.attention.reference import reference_logits
from kvpool.cache import CacheDescriptor
from kvpool.engine.dsv4_runner import dsv4_runner
from kvpool.engine.engine import Engine
from kvpool.engine.hybrid_runner import hybrid_runner
from kvpool.engine.llama_runner import llama_runner
from kvpool.engine.sampling import SamplingParams
from kvpool.models.gguf import LlamaConfig
from kvpool.models.tiny_dsv4 import SMALL_DSV4_CONFIG, TinyDSV4
from kvpool.models.tiny_hybrid import TINY_GEMMA2, TINY_RECURRENT, TinyHybrid
from kvpool.tiers import HostTier
from random_llama import random_llama

pytestmark = pytest.mark.usefixtures("one_thread")

TOL = 1e-12
MAX_STEPS = 1000  # (`_run`)
# (hypothesis's deadlines: an example of a budget of 1 token a step takes 2.5 s at load 7 on 2 cores)
EOS = 7  # the engines' end-of-sequence token (a request that does not ignore it may stop early)

CONFIG = LlamaConfig(
    num_layers=2,
    hidden_size=32,
    intermediate_size=64,
    num_heads=2,
    num_kv_heads=1,
    head_dim=16,
    rope_theta=10000.0,
    rms_norm_eps=1e-5,
    vocab_size=64,
    max_position=512,
    tie_embeddings=False,
)
DESCRIPTOR = CacheDescriptor("fuzz-llama", weights_version="seed3")


MODEL = random_llama(seed=3, config=CONFIG)  # (fp64, its head untied)
# the hybrid models, their window cut to 5 tokens so that the prompts here pass it
HYBRIDS = {
    "gemma": TinyHybrid({**TINY_GEMMA2, "window": 5}, seed=1, dtype=torch.float64),
    "recurrent": TinyHybrid(TINY_RECURRENT, seed=1, dtype=torch.float64),
}
# the small V4 (window 16, compression 4 and 16; classical blocks of 16 tokens)
DSV4 = TinyDSV4(SMALL_DSV4_CONFIG, seed=1, dtype=torch.float64)
VOCAB = min(CONFIG.vocab_size, *(m.config["vocab_size"] for m in HYBRIDS.values()))


def _oracle(family: str, token_ids: list[int]) -> torch.Tensor:
    if family == "llama":
        return reference_logits(MODEL, token_ids, fused=False)
    if family == "dsv4":
        return DSV4.reference_logits(token_ids)
    return HYBRIDS[family].reference_logits(token_ids)


class Fault(Exception):
    """An injected fault of one step's forward."""


# The runner's calls a fault is injected into (before the call runs; the step raises, and the
# engine steps on). `_complete_admission` raises after the cache admitted the request (where a
# tier's save, load or swap-in, or a state restore, raises): the runner releases it again.
# `release` raises where a sequence finishes, is preempted or aborted, or is recomputed after a
# fault (the engine's bookkeeping done: the release is done again at the next step), or in the
# runner's own release of an admission that raised.
CALL_FAULTS = ("admit", "_complete_admission", "reserve_step", "commit_step", "fork", "release")


class Rows:
    """Every logit row a runner computes, keyed by the token history it predicts from."""

    def __init__(self, engine: Engine) -> None:
        self.rows: dict[tuple[int, ...], list[torch.Tensor]] = {}
        runner, execute = engine.runner, engine.runner.execute
        self.engine = engine
        self.fault: str | None = None  # the next forward raises: "before" it runs, or "after" (its KV written)

        def recording(chunks, all_logits: bool = False):
            # the histories before the forward: the chunks' sequences as the cache holds them
            histories = []
            for c in chunks:
                if c.needs_logits:
                    prefix = runner.cache.token_ids(c.request_id)[: c.start]
                    histories.append((*prefix, *c.token_ids))
            fault, self.fault = self.fault, None
            if fault == "before":
                raise Fault
            out = execute(chunks, all_logits)
            if fault == "after":
                raise Fault
            if not all_logits:
                assert out.shape[0] == len(histories)
                for history, row in zip(histories, out, strict=True):
                    self.rows.setdefault(history, []).append(row.detach().clone())
            return out

        runner.execute = recording
        # runner calls that raise before they run: method -> the calls of it (from 0) that raise
        self.call_faults: dict[str, frozenset[int]] = {}
        self.calls: dict[str, int] = {}
        for name in CALL_FAULTS:
            setattr(runner, name, self._faulty(name, getattr(runner, name)))

    def _faulty(self, name: str, real):
        def call(*args, **kwargs):
            k = self.calls.get(name, 0)
            self.calls[name] = k + 1
            if k in self.call_faults.get(name, ()):
                raise Fault(name)
            return real(*args, **kwargs)

        return call


def _engine(
    family: str,
    num_blocks: int,
    block_size: int,
    budget: int,
    *,
    prefix: bool,
    host: bool = False,
    swap: bool | str = False,
    static: bool = False,
    max_num_seqs: int = 64,
    decode_path: str | None = None,
    num_slots: int = 64,
    interval: int = 4,
    restore: str = "recompute",
    turn_ends: bool = False,
) -> Engine:
    if family == "dsv4":  # block_size: 16, the model's
        runner = dsv4_runner(
            DSV4,
            num_blocks,
            num_slots,
            restore=restore,
            num_checkpoints=0 if restore == "recompute" else 4,
            enable_prefix_caching=prefix,
            host_tier=HostTier(1 << 24, pin_memory=False) if host else None,
            turn_end_checkpoints=turn_ends,
            preemption="swap" if swap else "recompute",
        )
        return Engine(runner, max_num_batched_tokens=budget, max_num_seqs=max_num_seqs, eos_token_ids=(EOS,))
    if family != "llama":
        runner = hybrid_runner(
            HYBRIDS[family],
            num_blocks,
            num_slots,
            block_size=block_size,
            checkpoint_interval=interval,
            enable_prefix_caching=prefix,
        )
        return Engine(runner, max_num_batched_tokens=budget, max_num_seqs=max_num_seqs, eos_token_ids=(EOS,))
    block_bytes = 2 * CONFIG.num_layers * CONFIG.num_kv_heads * CONFIG.head_dim * block_size * 8
    runner = llama_runner(
        MODEL,
        num_blocks,
        block_size,
        DESCRIPTOR,
        enable_prefix_caching=prefix,
        host_tier=HostTier(64 * block_bytes, pin_memory=False) if host else None,
        preemption=swap or "recompute",
        decode_path=decode_path,
        decode_mode="static" if static else "eager",
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget,
    )
    return Engine(runner, max_num_batched_tokens=budget, max_num_seqs=max_num_seqs, eos_token_ids=(EOS,))


REFERENCES: dict[tuple, tuple[list[list[int]], dict]] = {}


def _reference(family: str, prompt: list[int], params: SamplingParams) -> tuple[list[list[int]], dict]:
    """The request alone on a fresh, roomy engine without prefix caching: each sample's
    output and every logit row, checked once against the contiguous fp64 recompute."""
    key = (family, tuple(prompt), repr(params))
    if key in REFERENCES:
        return REFERENCES[key]
    engine = _engine(family, 64, 16, 512, prefix=False)
    rows = Rows(engine)
    rid = engine.add_request(list(prompt), params, "ref")
    while engine.has_unfinished():
        engine.step()
    out = engine.pop_output(rid)
    outputs = [(list(c.token_ids), c.finish_reason) for c in out.completions]
    for output, _ in outputs:
        seq = prompt + output
        full = _oracle(family, seq[:-1])
        for pos in range(len(prompt) - 1, len(seq) - 1):
            got = rows.rows[tuple(seq[: pos + 1])][0]
            assert (got - full[pos]).abs().max().item() <= TOL, f"the reference engine at {pos}"
    REFERENCES[key] = (outputs, rows.rows)
    return REFERENCES[key]


@st.composite
def workloads(draw, family: str = "llama"):
    block_size = 16 if family == "dsv4" else draw(st.sampled_from([1, 3, 16]))
    rng = random.Random(draw(st.integers(0, 2**32 - 1)))
    # a shared prefix: exactly a block, a block +- 1, or anything up to ~2 blocks
    base_len = draw(
        st.one_of(st.sampled_from([block_size - 1, block_size, block_size + 1, 2 * block_size]), st.integers(0, 20))
    )
    base_len = max(0, min(base_len, 40))
    base = [rng.randrange(VOCAB) for _ in range(base_len)]
    num_requests = draw(st.integers(1, 5))
    requests: list = []
    lengths: list[int] = []  # each request's prompt length, its earlier turns' included
    for _ in range(num_requests):
        share = draw(st.one_of(st.just(base_len), st.integers(0, base_len)))  # the whole prefix, mostly
        tail = draw(st.integers(0 if share else 1, 8))
        prompt = base[:share] + [rng.randrange(VOCAB) for _ in range(tail)]
        n = draw(st.sampled_from([1, 1, 2, 3]))
        sampled = draw(st.booleans())
        params = SamplingParams(
            max_tokens=draw(st.integers(1, 8)),
            n=n,
            ignore_eos=draw(st.booleans()),
            logprobs=draw(st.sampled_from([None, None, 2])),  # (a request with logprobs takes the checked path)
            temperature=0.8 if sampled else 0.0,
            seed=draw(st.integers(0, 3)) if sampled else None,
        )
        arrival = draw(st.sampled_from([0, 0, 1, 2, 3, 5, 8, 12]))
        abort = draw(st.one_of(st.none(), st.integers(0, 12)))
        # a later turn: an earlier request's prompt and (its first sample's) output, then this one's
        follows = draw(st.one_of(st.none(), st.integers(0, len(requests) - 1))) if requests else None
        length = len(prompt)
        if follows is not None:
            length += lengths[follows] + requests[follows][1].max_tokens
        lengths.append(length)
        tenant = draw(st.sampled_from(["", "", "t1"]))  # a tenant hits its own cache only
        requests.append((prompt, params, arrival, abort, follows, tenant))
    # steps whose forward raises (the engine undoes the step, or releases its sequences to
    # be recomputed, and steps on), before the forward or after it wrote the step's KV
    faults = draw(st.dictionaries(st.integers(0, 15), st.sampled_from(["before", "after"]), max_size=2))
    # steps before which the prefix cache is reset (refused while a request runs)
    faults["reset"] = draw(st.frozensets(st.integers(0, 15), max_size=2))
    faults["calls"] = draw(
        st.dictionaries(
            st.sampled_from(CALL_FAULTS), st.frozensets(st.integers(0, 12), min_size=1, max_size=2), max_size=2
        )
    )
    longest = max(n + r[1].max_tokens for n, r in zip(lengths, requests, strict=True))
    # a pool that holds the longest request alone (one block more: a fork's copy-on-write),
    # and not much else: preemption is forced where several run at once
    least = -(-longest // block_size) + 1
    if family == "dsv4":  # (its capacity: the blocks' spans and the window's 15 tokens)
        least = max(1, -(-(longest - 15) // block_size))
    num_blocks = least + draw(st.integers(0, 1 if family == "dsv4" else 3))
    budget = draw(st.sampled_from([1, 2, 3, 5, 8, 64]))
    max_num_seqs = draw(st.sampled_from([2, 3, 64]))
    if family == "dsv4":
        tiers = draw(st.sampled_from(["none", "prefix", "host", "swap"]))
        options = {
            "prefix": tiers != "none",
            "host": tiers in ("host", "swap"),
            "swap": tiers == "swap",
            "max_num_seqs": max_num_seqs,
            "num_slots": draw(st.sampled_from([1, 2, 3, 4, 4])),  # state blocks: one a running sequence
            "restore": draw(st.sampled_from(["recompute", "checkpoint", "auto"])),
            "turn_ends": draw(st.booleans()),
        }
        return family, block_size, num_blocks, budget, options, requests, faults
    if family != "llama":  # no tier serves a hybrid cache
        options = {
            "prefix": draw(st.booleans()),
            "max_num_seqs": max_num_seqs,
            # state slots: each running sequence's live state and the checkpoints, few of them
            "num_slots": draw(st.integers(2, 6)),
            "interval": draw(st.sampled_from([1, 2, 3, 4, 7])),
        }
        return family, block_size, num_blocks, budget, options, requests, faults
    # no prefix cache / prefix cache / a host tier below it / preemption by swap to that tier
    # (auto: swap or recompute by the rates the runner measures)
    tiers = draw(st.sampled_from(["none", "prefix", "host", "swap", "auto"]))
    options = {
        "prefix": tiers != "none",
        "host": tiers in ("host", "swap", "auto"),
        "swap": {"swap": "swap", "auto": "auto"}.get(tiers, False),
        "static": draw(st.booleans()),  # pure-decode steps through the step buffers
        "decode_path": draw(st.sampled_from(["bags", "padded"])),
        "max_num_seqs": max_num_seqs,
    }
    return family, block_size, num_blocks, budget, options, requests, faults


def _run(family, block_size, num_blocks, budget, options, requests, faults):
    engine = _engine(family, num_blocks, block_size, budget, **options)
    rows = Rows(engine)
    rows.call_faults = faults.get("calls", {})
    ids: list[str | None] = [None] * len(requests)
    aborted: set[int] = set()
    reported: list[str] = []  # the finished requests' ids the steps gave back
    step = 0
    # (a budget of 1 token a step computes one token a step: 5 requests, two of them later
    # turns of ~75 tokens, and a fault's recompute took 409 steps; a wedged engine steps on
    # for nothing, and stops here)
    while step < MAX_STEPS:
        for i, (prompt, params, arrival, _, tenant) in enumerate(requests):
            if arrival == step and ids[i] is None:
                ids[i] = engine.add_request(list(prompt), params, f"r{i}", tenant=tenant)
        for i, (_, _, _, abort, _) in enumerate(requests):
            if abort is not None and ids[i] is not None and abort == step and i not in aborted:
                try:
                    if engine.abort(ids[i]):
                        aborted.add(i)
                except Fault:  # a release raised: the request is aborted all the same
                    assert engine.requests[ids[i]].finished
                    aborted.add(i)
        if not engine.has_unfinished() and all(i is not None for i in ids):
            break
        if step in faults["reset"]:
            try:
                engine.reset_prefix_cache()
            except Fault:  # (a release left over from a fault, done first, raised again)
                pass
            engine.runner.check_integrity()
        rows.fault = faults.get(step)
        try:
            reported += engine.step()
        except Fault:
            pass
        rows.fault = None
        engine.runner.check_integrity()
        step += 1
    assert not engine.has_unfinished(), f"the workload did not finish in {MAX_STEPS} steps"
    engine.runner.check_integrity()
    # every request that was not aborted reported finished by a step, once
    assert sorted(reported) == sorted(rid for i, rid in enumerate(ids) if i not in aborted), reported
    outputs = {}
    for i, rid in enumerate(ids):
        out = engine.pop_output(rid)
        outputs[i] = [(list(c.token_ids), c.finish_reason) for c in out.completions]
    return engine, rows, outputs, aborted


def _check(family, block_size, num_blocks, budget, options, requests, faults) -> Engine:
    resolved, refs = [], []
    for prompt, params, arrival, abort, follows, tenant in requests:
        if follows is not None:
            prompt = resolved[follows][0] + refs[follows][0][0][0] + prompt
        resolved.append((prompt, params, arrival, abort, tenant))
        refs.append(_reference(family, prompt, params))
    requests = resolved
    engine, rows, outputs, aborted = _run(family, block_size, num_blocks, budget, options, requests, faults)
    # every row the engine computed, against the reference's row of the same history
    known: dict[tuple[int, ...], torch.Tensor] = {}
    for _, ref_rows in refs:
        for history, got in ref_rows.items():
            known.setdefault(history, got[0])
    for history, got in rows.rows.items():
        assert history in known, f"a row of a history no reference computed ({len(history)} tokens)"
        for row in got:
            diff = (row - known[history]).abs().max().item()
            assert diff <= TOL, f"logits of a {len(history)}-token history {diff} from the reference"
    for i, (_, params, _, _, _) in enumerate(requests):
        ref_outputs, _ = refs[i]
        if i not in aborted:
            assert len(outputs[i]) == params.n
        for k, (tokens, reason) in enumerate(outputs[i]):
            want, why = ref_outputs[k]
            if i in aborted and reason == "abort":
                assert tokens == want[: len(tokens)], f"r{i}/{k} (aborted): {tokens} vs alone {want}"
            else:
                assert (tokens, reason) == (want, why), f"r{i}/{k}: {tokens} ({reason}) != alone {want} ({why})"
    usage = engine.runner.usage()
    assert usage.num_free_blocks == usage.num_blocks and usage.num_held_blocks == 0, usage
    return engine


@settings(max_examples=60, deadline=10000, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
def test_every_request_computes_what_it_computes_alone(workload) -> None:
    _check(*workload)


@settings(max_examples=30, deadline=10000, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(["gemma", "recurrent"]).flatmap(workloads))
def test_every_hybrid_request_computes_what_it_computes_alone(workload) -> None:
    _check(*workload)


def test_the_tolerance_catches_one_misread_slot() -> None:
    """TOL is far below what one wrong KV slot does to a logit row of this model."""
    prompt = [random.Random(1).randrange(VOCAB) for _ in range(12)]
    full = reference_logits(MODEL, prompt, fused=False)
    wrong = reference_logits(MODEL, prompt[:5] + [(prompt[5] + 1) % CONFIG.vocab_size] + prompt[6:], fused=False)
    assert (full[-1] - wrong[-1]).abs().max().item() > 1e6 * TOL


@settings(max_examples=10, deadline=20000, suppress_health_check=[HealthCheck.too_slow])
@given(workloads("dsv4"))
def test_every_v4_request_computes_what_it_computes_alone(workload) -> None:
    _check(*workload)


@pytest.mark.parametrize("family", ["llama", "gemma", "recurrent", "dsv4"])
def test_an_admission_that_raises_leaves_the_running_sequences_to_step_on(family) -> None:
    """r0 runs; r1's admission raises (a tier's load, say) after r0 reserved its step. The
    hybrid and V4 caches refuse a step reserved twice: r0's reservation stayed, and every
    later step raised "already has an uncommitted reservation". Now the schedule undoes the
    step's reservations as a faulted forward's are (`_after_a_fault`), and both requests
    compute what they compute alone."""
    options = {"prefix": False, "max_num_seqs": 2}
    if family != "llama":
        options["num_slots"] = 2
    requests = [
        ([49], SamplingParams(max_tokens=3), 0, None, None, ""),
        ([53], SamplingParams(max_tokens=3), 1, None, None, ""),
    ]
    faults = {"reset": frozenset(), "calls": {"admit": frozenset([1])}}
    _check(family, 16 if family == "dsv4" else 1, 8, 4, options, requests, faults)


def test_a_reservation_that_raises_while_preempting_leaves_the_others_to_step_on() -> None:
    """A step that does not fit reserves sequence by sequence (`_reserve_with_preemption`);
    one reservation that raised left the ones before it in the cache, and the hybrid cache
    refused them reserved again at every later step. They now go as a faulted forward's do.
    (Found by the fuzz: the first forward raises, then the 8th reserve_step call.)"""
    options = {"prefix": False, "max_num_seqs": 2, "num_slots": 2, "interval": 1}
    requests = [
        ([49], SamplingParams(max_tokens=3, temperature=0.8, seed=0), 5, None, None, ""),
        ([53], SamplingParams(max_tokens=7, temperature=0.8, seed=0), 0, None, None, ""),
    ]
    faults = {0: "before", "reset": frozenset(), "calls": {"reserve_step": frozenset([7])}}
    _check("gemma", 1, 9, 2, options, requests, faults)


@pytest.mark.parametrize("family", ["llama", "gemma", "recurrent", "dsv4"])
@pytest.mark.parametrize("call", [0, 1])
def test_an_admission_that_raises_after_the_cache_admitted_it_is_admitted_again(family, call) -> None:
    """r1's admission raises after the cache admitted it (`_complete_admission`: a tier's save,
    load or swap-in, a state restore), with r0 running (call 1) or alone (call 0). The cache
    kept r1 while the engine kept it waiting, and every later step raised "request 'r1/0' is
    already admitted" until it was aborted. Now the runner releases it as it raises, and both
    requests compute what they compute alone."""
    options = {"prefix": True, "max_num_seqs": 2}
    if family != "llama":
        options["num_slots"] = 2
    requests = [
        ([49, 50, 51], SamplingParams(max_tokens=3), 0, None, None, ""),
        ([53], SamplingParams(max_tokens=3), 1, None, None, ""),
    ]
    faults = {"reset": frozenset(), "calls": {"_complete_admission": frozenset([call])}}
    _check(family, 16 if family == "dsv4" else 1, 8, 4, options, requests, faults)


@pytest.mark.parametrize("family", ["llama", "gemma", "recurrent", "dsv4"])
@pytest.mark.parametrize("lands", ["before", "after"])
def test_a_release_that_raises_after_the_commit_is_done_at_the_next_step(family, lands) -> None:
    """Ctrl-C lands in the release of b's parent (the step's commit done: a finishes on its
    one token at step 0, b's two samples on theirs at step 1), before the runner's release ran
    or after it. It used to leave b's sequences finished but running and in the runner: the
    child, which the cache knew 1 token of, made every later step raise "request 'b/1': cannot
    compute 1 tokens from 1". Now the step raises KeyboardInterrupt with b's sequences gone from
    the running list; the next step does the releases left (a repeat of one that ran is a
    no-op) and reports b, once; every block is free and a later request runs."""
    options = {} if family == "llama" else {"num_slots": 3}
    engine = _engine(family, 4, 16 if family == "dsv4" else 1, 1, prefix=False, max_num_seqs=2, **options)
    real, calls = engine.runner.release, []

    def release(seq_id, reason="finish"):
        if len(calls) == 1 and lands == "before":
            calls.append((seq_id, reason, None))
            raise KeyboardInterrupt
        calls.append((seq_id, reason, real(seq_id, reason)))
        if len(calls) == 2 and lands == "after":
            raise KeyboardInterrupt
        return calls[-1][2]

    engine.runner.release = release
    engine.add_request([49], SamplingParams(max_tokens=1), "a")
    engine.add_request([53], SamplingParams(max_tokens=1, n=2), "b")
    assert engine.step() == ["a"]
    with pytest.raises(KeyboardInterrupt):
        engine.step()
    b = engine.requests["b"]
    assert b.finished and not engine.running and not engine.waiting
    assert [s.finish_reason for s in b.seqs] == ["length", "length"]
    engine.runner.check_integrity()
    assert engine.has_unfinished()  # (the releases and the report left to do)
    assert engine.step() == ["b"]
    # b's parent released again (a no-op where its release had run), then the child
    assert calls[1:] == [
        ("b/0", "finish", None if lands == "before" else True),
        *[("b/0", "finish", lands == "before"), ("b/1", "finish", True)],
    ]
    assert not engine.has_unfinished() and engine.step() == []
    engine.runner.check_integrity()
    usage = engine.runner.usage()
    assert usage.num_free_blocks == usage.num_blocks and usage.num_held_blocks == 0, usage
    assert len(engine.pop_output("b").completions) == 2
    [out] = engine.generate([[1, 2]], SamplingParams(max_tokens=2))
    assert len(out.completions[0].token_ids) == 2
    usage = engine.runner.usage()
    assert usage.num_free_blocks == usage.num_blocks, usage


@pytest.mark.parametrize("family", ["llama", "gemma", "recurrent"])
@pytest.mark.parametrize("lands", ["before", "after"])
def test_a_preemption_whose_release_raises_is_released_before_it_is_admitted_again(family, lands) -> None:
    """The first release is b's preemption (9 blocks of 1 token: a and b, 6 tokens each, do not
    both fit); Ctrl-C lands in it, before the runner's release ran or after. (After: b stayed
    running while the runner held nothing of it, and every later step raised KeyError "unknown
    request 'b/0'"; before: nothing had changed, and the step was tried again.) b is back in
    the queue all the same, the next step releases it before anything is admitted, and both
    requests give the tokens of a run without the fault."""
    options = {} if family == "llama" else {"num_slots": 3}

    def run(fault: bool) -> tuple[list[list[int]], int]:
        engine = _engine(family, 9, 1, 4, prefix=False, max_num_seqs=2, **options)
        real, calls = engine.runner.release, []

        def release(seq_id, reason="finish"):
            calls.append((seq_id, reason))
            if fault and len(calls) == 1 and lands == "before":
                raise KeyboardInterrupt
            released = real(seq_id, reason)
            if fault and len(calls) == 1:
                raise KeyboardInterrupt
            return released

        engine.runner.release = release
        for rid, prompt in (("a", [49]), ("b", [53])):
            engine.add_request(prompt, SamplingParams(max_tokens=6), rid)
        interrupted = 0
        while engine.has_unfinished():
            try:
                engine.step()
            except KeyboardInterrupt:
                interrupted += 1
                # (the hybrids' step is undone too: a, reserved before, recomputed)
                assert calls[0] == ("b/0", "preempt") and "b/0" in [seq.seq_id for seq in engine.waiting]
                assert "b/0" not in [seq.seq_id for seq in engine.running]
            engine.runner.check_integrity()
        usage = engine.runner.usage()
        assert usage.num_free_blocks == usage.num_blocks and usage.num_held_blocks == 0, usage
        tokens = [engine.pop_output(rid).completions[0].token_ids for rid in ("a", "b")]
        return tokens, interrupted

    assert run(fault=True) == (run(fault=False)[0], 1)


@pytest.mark.parametrize("family", ["llama", "gemma", "recurrent", "dsv4"])
@pytest.mark.parametrize("call", [0, 1])
def test_a_retried_admission_counts_its_request_once(family, call) -> None:
    """r1 (r0's 3 tokens, then its own) is admitted, its admission raises after the cache
    admitted it (`_complete_admission`) and it is admitted again: the cache's stats are the
    run's without the fault (they counted r1 twice: num_requests 3, its queried and hit tokens
    twice)."""
    options = {"prefix": True, "max_num_seqs": 2}
    if family != "llama":
        options["num_slots"] = 2
    if family in ("gemma", "recurrent"):  # (a recurrent state kept at every token: r1 hits r0's 3)
        options |= {"num_slots": 4, "interval": 1}
    block_size = 16 if family == "dsv4" else 1
    prefix = list(range(40, 40 + (17 if family == "dsv4" else 3)))  # (V4: a full block to hit)
    requests = [
        (prefix, SamplingParams(max_tokens=2), 0, None, None, ""),
        ([*prefix, 53], SamplingParams(max_tokens=2), 3, None, None, ""),
    ]
    calls = {"_complete_admission": frozenset([call])}
    faulty = _check(family, block_size, 8, 64, options, requests, {"reset": frozenset(), "calls": calls})
    clean = _check(family, block_size, 8, 64, options, requests, {"reset": frozenset(), "calls": {}})
    assert faulty.runner.cache.stats.num_requests == 2
    assert clean.runner.cache.stats.num_hit_tokens > 0
    assert faulty.runner.cache.stats == clean.runner.cache.stats


@pytest.mark.parametrize("family", ["llama", "gemma"])
def test_a_retried_readmission_counts_as_one_readmission(family) -> None:
    """b is preempted (9 blocks of 1 token: a and b, 6 tokens each, do not both fit); its
    readmission raises after the cache admitted it, and the cache's release of it forgot it
    was preempted: admitted again, b counted as a second first admission. Now the stats are
    the run's without the fault."""
    options = {"prefix": True, "max_num_seqs": 2}
    if family != "llama":
        options |= {"num_slots": 3, "interval": 1}
    requests = [
        ([49], SamplingParams(max_tokens=6), 0, None, None, ""),
        ([53], SamplingParams(max_tokens=6), 0, None, None, ""),
    ]
    calls = {"_complete_admission": frozenset([2])}  # (a's admission, b's, b's readmission)
    faulty = _check(family, 1, 9, 4, options, requests, {"reset": frozenset(), "calls": calls})
    clean = _check(family, 1, 9, 4, options, requests, {"reset": frozenset(), "calls": {}})
    assert clean.runner.cache.stats.num_readmissions == 1 and clean.num_preemptions == 1
    assert faulty.runner.cache.stats == clean.runner.cache.stats


@pytest.mark.parametrize("family", ["gemma", "recurrent", "dsv4"])
@pytest.mark.parametrize("step", [0, 2])
def test_a_sequence_recomputed_after_a_fault_counts_its_request_once(family, step) -> None:
    """The forward of step 0 (r0's admission step) or step 2 (r0 computed steps) raises: the
    hybrid / V4 engine releases the step's sequences and admits them again to recompute
    them. Their readmission counted as a new first admission (num_requests 2 for 1 request);
    now the cache's stats are the run's without the fault, as the Llama path's (which
    reserves the step again) are."""
    options = {"prefix": True, "max_num_seqs": 2}
    if family in ("gemma", "recurrent"):
        options |= {"num_slots": 4, "interval": 1}
    else:
        options["num_slots"] = 2
    block_size = 16 if family == "dsv4" else 1
    prompt = list(range(40, 40 + (20 if family == "dsv4" else 5)))
    requests = [(prompt, SamplingParams(max_tokens=5), 0, None, None, "")]
    faulty = _check(family, block_size, 16, 64, options, requests, {step: "after", "reset": frozenset(), "calls": {}})
    clean = _check(family, block_size, 16, 64, options, requests, {"reset": frozenset(), "calls": {}})
    assert faulty.stats.num_fault_recomputes == 1 and clean.stats.num_fault_recomputes == 0
    assert faulty.runner.cache.stats.num_requests == 1
    assert faulty.runner.cache.stats == clean.runner.cache.stats
