"""Logits with a NaN or +inf (or every one -inf) give no token: the engine refuses to sample
them, naming the request, instead of emitting garbage. A NaN weight in SmolLM2's GGUF made
every logit NaN; argmax took token 0, its end of text, and `kvpool generate` printed
nothing with status 0. Here one prompt token's embedding row is NaN (the LM head an untied
copy of the embedding), so only the request whose prompt holds it has NaN logits."""

from __future__ import annotations

import pytest
import torch

from kvpool.engine.engine import Engine
from kvpool.engine.llama_runner import llama_runner
from kvpool.engine.sampling import NonFiniteLogitsError, SamplingParams
from random_llama import DESCRIPTOR, random_ids, random_llama

POISONED = 7  # the token whose embedding row is NaN


def _engine(batched: bool) -> Engine:
    model = random_llama("cpu", torch.float32)
    model.lm_head = model.embed.clone()  # untied: the NaN row below poisons the input alone
    model.embed[POISONED] = float("nan")
    runner = llama_runner(model, 64, 16, DESCRIPTOR)
    return Engine(runner, max_num_batched_tokens=256, max_num_seqs=8, batched_sampling=batched)


def _prompts() -> tuple[list[int], list[int]]:
    good = [t for t in random_ids(12, seed=1) if t != POISONED]
    bad = [t for t in random_ids(9, seed=2) if t != POISONED] + [POISONED, 3]
    return good, bad


@pytest.mark.parametrize("batched", [False, True], ids=["row_by_row", "batched"])
@pytest.mark.parametrize("temperature", [0.0, 0.8], ids=["greedy", "drawn"])
def test_a_request_with_nan_logits_is_refused_by_name(batched, temperature):
    """Row by row and batched, greedy and drawn: the step raises NonFiniteLogitsError naming
    the request (a token was sampled from NaN without a word before), and the engine is
    left intact (its integrity holds, nothing of the step taken)."""
    engine = _engine(batched)
    good, bad = _prompts()
    params = SamplingParams(max_tokens=4, temperature=temperature, seed=5)
    engine.add_request(good, params, "good")
    engine.add_request(bad, params, "bad")
    with pytest.raises(NonFiniteLogitsError, match="request 'bad'") as refused:
        while engine.has_unfinished():
            engine.step()
    assert refused.value.request_ids == ["bad"]
    assert "not finite" in str(refused.value)
    engine.runner.check_integrity()
    assert engine.requests["bad"].seqs[0].token_ids == bad  # nothing sampled from NaN was kept


@pytest.mark.parametrize("batched", [False, True], ids=["row_by_row", "batched"])
@pytest.mark.parametrize("temperature", [0.0, 0.8], ids=["greedy", "drawn"])
def test_a_contained_request_with_nan_logits_fails_alone_with_the_reason(batched, temperature):
    """Where the engine contains a request's faults (the server's engine thread), the request
    whose logits are NaN fails alone, its error naming them; the other request finishes with
    the tokens it has without the poisoned one beside it. Batched too (every CUDA engine):
    the batch's other rows keep their tokens (the whole step raised, and the server failed
    every request in flight)."""
    good, bad = _prompts()
    params = SamplingParams(max_tokens=4, temperature=temperature, seed=5)
    alone = _engine(batched)
    alone.add_request(good, params, "good")
    while alone.has_unfinished():
        alone.step()
    want = alone.output("good").completions[0].token_ids
    engine = _engine(batched)
    engine.contain_request_faults = True
    engine.add_request(good, params, "good")
    engine.add_request(bad, params, "bad")
    while engine.has_unfinished():
        engine.step()
        engine.runner.check_integrity()
    failed = engine.output("bad")
    assert failed.error is not None and failed.error.startswith("NonFiniteLogitsError: the model's logits for request")
    assert engine.output("good").error is None
    assert engine.output("good").completions[0].token_ids == want


def _injecting(batched: bool, at_step: int, row: int, value: float) -> Engine:
    """A clean model's engine whose forward `at_step` (1-based) gives logits row `row` `value`."""
    model = random_llama("cpu", torch.float32)
    runner = llama_runner(model, 64, 16, DESCRIPTOR)
    execute, calls = runner.execute, [0]

    def poisoned(chunks, *args, **kwargs):
        logits = execute(chunks, *args, **kwargs)
        calls[0] += 1
        if calls[0] == at_step:
            logits = logits.clone()
            logits[row] = value
        return logits

    runner.execute = poisoned
    return Engine(runner, max_num_batched_tokens=256, max_num_seqs=8, batched_sampling=batched)


@pytest.mark.parametrize("value", [float("nan"), float("inf")], ids=["nan", "inf"])
@pytest.mark.parametrize("temperature", [0.0, 0.8], ids=["greedy", "drawn"])
def test_a_decode_step_with_one_poisoned_row_fails_that_request_alone_batched_or_not(temperature, value):
    """A decode step (the batched engine's fast take through its columns) whose row 1 is NaN
    or +inf, contained: that request fails with the row-by-row path's message (request and
    output position), the requests on either side of it finish with a clean run's tokens,
    and the engine's integrity holds after every step; batched and row by row alike."""
    prompts = {"a": random_ids(12, seed=1), "b": random_ids(9, seed=2), "c": random_ids(5, seed=3)}
    params = SamplingParams(max_tokens=6, temperature=temperature, seed=5)
    clean = _engine_of(_injecting(True, 0, 0, 0.0), prompts, params)
    want = {k: clean.output(k).completions[0].token_ids for k in prompts}
    errors = {}
    for batched in (False, True):
        engine = _injecting(batched, 3, 1, value)  # step 1: the prompts; 3: the second decode
        engine.contain_request_faults = True
        engine = _engine_of(engine, prompts, params)
        assert engine.output("a").completions[0].token_ids == want["a"]
        assert engine.output("c").completions[0].token_ids == want["c"]
        errors[batched] = engine.output("b").error
    assert errors[True] == errors[False]
    assert errors[True].startswith("NonFiniteLogitsError: the model's logits for request 'b' at output position 2 ")


def _engine_of(engine: Engine, prompts: dict[str, list[int]], params: SamplingParams) -> Engine:
    for request_id, prompt in prompts.items():
        engine.add_request(prompt, params, request_id)
    while engine.has_unfinished():
        engine.step()
        engine.runner.check_integrity()
    return engine
