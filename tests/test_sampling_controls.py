"""The sampling controls beside temperature / top-k / top-p: stop_token_ids, the presence,
frequency and repetition penalties, logit_bias, min_p and min_tokens, from SamplingParams
through the engine (SmolLM2-135M) against independent references."""

from __future__ import annotations

import pytest
import torch

from kvpool.attention.reference import reference_logits
from kvpool.engine.batch_sampler import sample_batch
from kvpool.engine.build import build_engine, load_model
from kvpool.engine.sampling import SamplingParams, min_p_filtered, processed_logits, sample_token


@pytest.fixture(scope="module")
def model(one_thread):
    return load_model(device="cpu")


@pytest.fixture(scope="module")
def fp64(fp64_model):
    """The same weights in fp64 (conftest's): the engine's logits equal a full recompute's to
    ~1e-12, so its tokens are the reference loop's wherever no two candidates lie that close."""
    return fp64_model


def chat_prompt(model, text: str) -> list[int]:
    return model.tokenizer.encode_chat([{"role": "user", "content": text}])


# ---- stop_token_ids -------------------------------------------------------------------


def test_stop_token_ids_are_checked():
    assert SamplingParams(stop_token_ids=[5, 7]).stop_token_ids == (5, 7)  # a list kept as a tuple
    with pytest.raises(ValueError, match="stop_token_ids: token ids are >= 0, got -1"):
        SamplingParams(stop_token_ids=[3, -1])
    with pytest.raises(TypeError, match="stop_token_ids must be a list of token ids"):
        SamplingParams(stop_token_ids=5)
    with pytest.raises(TypeError, match="stop_token_ids: a token id must be an integer"):
        SamplingParams(stop_token_ids=[1.5])


@pytest.mark.parametrize("batched", [False, True])
def test_a_stop_token_id_ends_the_sample_as_eos_does(model, batched):
    """Greedy: the answer cut at the first occurrence of a token of its own, finish reason
    "stop", that token the last id and no part of the text (as EOS); ignore_eos leaves
    stop_token_ids on; an id outside the vocabulary is refused, nothing queued."""
    prompt = chat_prompt(model, "What is the capital of France?")
    engine = build_engine(model, num_blocks=16, block_size=16)
    engine.batched_sampling = batched
    whole = engine.generate([prompt], SamplingParams(max_tokens=30, ignore_eos=True))[0].completions[0]
    ids = whole.token_ids
    stop = ids[3]
    first = ids.index(stop)
    for ignore_eos in (False, True):
        params = SamplingParams(max_tokens=30, stop_token_ids=[stop, 0], ignore_eos=ignore_eos)
        cut = engine.generate([prompt], params)[0].completions[0]
        assert cut.finish_reason == "stop" and cut.token_ids == ids[: first + 1]
        assert cut.text == model.tokenizer.decode(ids[:first])
    vocab = engine.runner.vocab_size
    for name, params in (
        ("stop_token_ids", SamplingParams(stop_token_ids=[1, vocab])),
        ("logit_bias", SamplingParams(logit_bias={vocab: 1.0, 2: 0.0})),
    ):
        with pytest.raises(ValueError, match=rf"{name}: token ids \[{vocab}\] outside the vocabulary \[0, {vocab}\)"):
            engine.add_request(prompt, params)
    assert engine.requests == {} and engine._num_controlled == 0


# ---- penalties and logit_bias ---------------------------------------------------------


def test_penalty_and_bias_parameters_are_checked():
    for name, bad in (("presence_penalty", 2.5), ("frequency_penalty", -2.01), ("presence_penalty", float("nan"))):
        with pytest.raises(ValueError, match=rf"{name} must be in \[-2, 2\]"):
            SamplingParams(**{name: bad})
    for bad in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="repetition_penalty must be a finite number > 0"):
            SamplingParams(repetition_penalty=bad)
    with pytest.raises(TypeError, match="repetition_penalty must be a number"):
        SamplingParams(repetition_penalty="1.2")
    assert SamplingParams(logit_bias={"7": 1, 3: -2.5}).logit_bias == ((3, -2.5), (7, 1.0))
    with pytest.raises(ValueError, match=r"logit_bias: the bias of token 3 must be in \[-100, 100\], got 101"):
        SamplingParams(logit_bias={3: 101})
    with pytest.raises(ValueError, match="logit_bias: token ids are >= 0, got -1"):
        SamplingParams(logit_bias={"-1": 1})
    with pytest.raises(TypeError, match="logit_bias: a token id must be an integer"):
        SamplingParams(logit_bias={"x": 1})
    with pytest.raises(TypeError, match="logit_bias: the bias of token 3 must be a number"):
        SamplingParams(logit_bias={3: "1"})
    with pytest.raises(ValueError, match="logit_bias: token 3 is given twice"):
        SamplingParams(logit_bias=[(3, 1.0), ("3", 2.0)])
    assert not SamplingParams(presence_penalty=0, frequency_penalty=0.0, repetition_penalty=1).transforms_logits
    for controls in ({"presence_penalty": -0.1}, {"repetition_penalty": 1.1}, {"logit_bias": {1: 0.0}}):
        assert SamplingParams(**controls).transforms_logits


def test_presence_and_frequency_penalties_by_hand():
    """Over the output tokens alone (the prompt's 1 is not penalised): token 2 twice, 3 once.
    Binary fractions: exact in fp32."""
    logits = torch.tensor([1.0, 2.0, -3.0, 0.5, 4.0])
    tokens = [1, 4, 2, 3, 2]  # prompt [1, 4], output [2, 3, 2]
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    got = processed_logits(logits, params, tokens, num_prompt_tokens=2)
    # token 2: -3 - 0.25 * 2 - 0.5 = -4; token 3: 0.5 - 0.25 - 0.5 = -0.25
    assert got.tolist() == [1.0, 2.0, -4.0, -0.25, 4.0]
    assert logits.tolist() == [1.0, 2.0, -3.0, 0.5, 4.0]  # not written
    negative = processed_logits(logits, SamplingParams(presence_penalty=-2.0), tokens, 2)
    assert negative.tolist() == [1.0, 2.0, -1.0, 2.5, 4.0]  # a negative penalty favours them
    assert processed_logits(logits, params, tokens[:2], 2).tolist() == logits.tolist()  # no output yet
    bias = processed_logits(logits, SamplingParams(logit_bias={0: -100, 4: 0.5}), tokens, 2)
    assert bias.tolist() == [-99.0, 2.0, -3.0, 0.5, 4.5]


def test_repetition_penalty_equals_transformers_processor_in_fp64():
    """transformers' RepetitionPenaltyLogitsProcessor (the CTRL rule, over every token of its
    input ids: prompt and output) on the same fp64 logits: equal exactly, for penalties
    above and below 1, with repeated ids and ids of logits < 0, = 0 and > 0."""
    from transformers import RepetitionPenaltyLogitsProcessor

    gen = torch.Generator().manual_seed(3)
    for penalty in (1.3, 0.7, 2.0):
        logits = torch.randn(1000, generator=gen, dtype=torch.float64) * 4
        logits[17] = 0.0
        tokens = torch.randint(0, 1000, (60,), generator=gen).tolist() + [17, 17]
        want = RepetitionPenaltyLogitsProcessor(penalty)(torch.tensor([tokens]), logits.clone()[None])[0]
        got = processed_logits(logits, SamplingParams(repetition_penalty=penalty), tokens, num_prompt_tokens=40)
        assert got.dtype == torch.float64 and torch.equal(got, want), penalty


_REFERENCE: dict[tuple, list[int]] = {}  # (prompt, params) -> the loop's tokens: once a module


def reference_loop(
    fp64_model, prompt: list[int], params: SamplingParams, eos: frozenset[int], sample: int = 0
) -> list[int]:
    """The tokens a request's sample takes, step by step: each step's logits by a full
    recompute of the sequence (contiguous attention), processed by `processed_logits` over the
    tokens so far, sampled by `sample_token` at (sample, output position); the end at EOS or
    max_tokens."""
    key = (tuple(prompt), params, sample)
    if key not in _REFERENCE:
        _REFERENCE[key] = _reference_loop(fp64_model, prompt, params, eos, sample)
    return _REFERENCE[key]


def _reference_loop(fp64_model, prompt: list[int], params: SamplingParams, eos: frozenset[int], sample: int):
    tokens = list(prompt)
    for position in range(params.max_tokens):
        logits = reference_logits(fp64_model.model, tokens)[-1]
        processed = processed_logits(logits, params, tokens, len(prompt), eos)
        top = torch.topk(processed.float() / max(params.temperature, 1.0), 2).values
        assert top[0] - top[1] > 1e-6, "a near tie: the engine's rounding may pick the other token"
        tokens.append(sample_token(processed, params, sample, position))
        if tokens[-1] in eos and not params.ignore_eos and position >= params.min_tokens:
            break
    return tokens[len(prompt) :]


@pytest.mark.parametrize("batched", [False, True])
def test_the_engine_with_penalties_takes_the_reference_loops_tokens(model, fp64, batched):
    """SmolLM2 in fp64, greedy and seeded, each with a penalty or a bias, beside a plain
    request in the same batch: the engine's tokens are the reference loop's; the plain
    request's tokens are what it takes alone; logprobs are the raw model's."""
    prompt = chat_prompt(model, "Say the word hello five times.")  # greedy: "Hello, hello, hello, ..."
    plain = SamplingParams(max_tokens=12, ignore_eos=True)
    (hello,) = model.tokenizer.encode(" hello")
    cases = [
        SamplingParams(max_tokens=12, temperature=1.5, seed=3, min_p=0.2, ignore_eos=True),  # (plain: fast paths)
        SamplingParams(max_tokens=12, repetition_penalty=1.5, ignore_eos=True),
        SamplingParams(max_tokens=12, frequency_penalty=1.5, presence_penalty=0.5, ignore_eos=True),
        SamplingParams(max_tokens=12, temperature=0.8, seed=5, presence_penalty=-1.0, frequency_penalty=0.7),
        SamplingParams(max_tokens=12, logit_bias={hello: -100.0, 28: -2.5}),
    ]
    engine = build_engine(fp64, num_blocks=64, block_size=16)
    engine.batched_sampling = batched
    alone = engine.generate([prompt], plain)[0].completions[0].token_ids
    ids = [engine.add_request(prompt, params) for params in cases]
    plain_id = engine.add_request(prompt, plain)
    logged = engine.add_request(prompt, SamplingParams(max_tokens=3, repetition_penalty=3.0, logprobs=2))
    # n = 2: the second sample's first token drawn from the parent's row before its fork
    forked = SamplingParams(n=2, max_tokens=5, temperature=1.2, seed=8, frequency_penalty=2.0, ignore_eos=True)
    pair = engine.add_request(prompt, forked)
    while engine.has_unfinished():
        engine.step()
        engine.runner.check_integrity()
    assert engine.pop_output(plain_id).completions[0].token_ids == alone
    for rid, params in zip(ids, cases, strict=True):
        got = engine.pop_output(rid).completions[0].token_ids
        assert got == reference_loop(fp64, prompt, params, engine.eos_token_ids), params
        assert got != alone  # the penalties and the bias change the answer here
    for j, sample in enumerate(engine.pop_output(pair).completions):
        assert sample.token_ids == reference_loop(fp64, prompt, forked, engine.eos_token_ids, j), j
    out = engine.pop_output(logged).completions[0]
    raw = torch.log_softmax(reference_logits(fp64.model, prompt + out.token_ids[:1])[-1], dim=-1)
    assert abs(out.logprobs[1][0] - raw[out.token_ids[1]].item()) < 1e-9
    assert engine._num_controlled == 0


# ---- min_p ----------------------------------------------------------------------------


def test_min_p_is_checked():
    for bad in (-0.1, 1.5, float("nan")):
        with pytest.raises(ValueError, match="min_p must be in \\[0, 1\\]"):
            SamplingParams(min_p=bad)
    with pytest.raises(TypeError, match="min_p must be a number"):
        SamplingParams(min_p=None)


def test_min_p_equals_transformers_warper_in_fp64():
    """transformers' MinPLogitsWarper on the same fp64 scores: the same tokens set to -inf,
    the others unchanged, exactly (rows of 1 to 2,000 tokens, min_p 0 to 1)."""
    from transformers import MinPLogitsWarper

    gen = torch.Generator().manual_seed(9)
    for case in range(200):
        vocab = int(torch.randint(1, 2000, (1,), generator=gen))
        scores = torch.randn(vocab, generator=gen, dtype=torch.float64) * float(torch.rand(1, generator=gen) * 6)
        min_p = (0.0, 1e-3, 0.05, 0.3, 0.9, 1.0)[case % 6]
        want = MinPLogitsWarper(min_p)(torch.zeros(1, 1, dtype=torch.long), scores.clone()[None])[0]
        got = min_p_filtered(scores, torch.tensor(min_p, dtype=torch.float64))
        assert torch.equal(got, want), case


def test_min_p_comes_before_top_p():
    """vLLM's order: min_p, then top-p over what it left, renormalised. Probabilities 0.4, 0.3,
    0.2, 0.1 at min_p 0.3 keep the first three (0.9 of the mass); top_p 0.75 of those drops
    the third (0.7 / 0.9 before it), which top_p first would keep (0.7 before it): 2,000
    draws of each sampler take tokens 0 and 1 alone, at 4 : 3 within 4 sigma."""
    logits = torch.log(torch.tensor([0.4, 0.3, 0.2, 0.1]))
    params = SamplingParams(temperature=1.0, top_p=0.75, min_p=0.3, seed=1)
    n = 2000
    one = [sample_token(logits, params, 0, k) for k in range(n)]
    batched = sample_batch(logits.expand(n, 4), [params] * n, [0] * n, list(range(n)))
    assert one == batched and set(one) == {0, 1}
    p = 4 / 7
    assert abs(one.count(0) / n - p) < 4 * (p * (1 - p) / n) ** 0.5


# ---- min_tokens -----------------------------------------------------------------------


def test_min_tokens_is_checked():
    assert SamplingParams(max_tokens=4, min_tokens=4).transforms_logits
    with pytest.raises(ValueError, match=r"min_tokens must be at most max_tokens \(4\), got 5"):
        SamplingParams(max_tokens=4, min_tokens=5)
    with pytest.raises(ValueError, match="min_tokens must be >= 0, got -1"):
        SamplingParams(min_tokens=-1)
    with pytest.raises(TypeError, match="min_tokens must be an integer"):
        SamplingParams(min_tokens=1.5)


def test_min_tokens_equals_transformers_processor_in_fp64():
    """transformers' MinNewTokensLengthLogitsProcessor (the EOS ids -inf while fewer than
    min_new_tokens tokens follow the prompt) on the same fp64 logits: equal exactly, with
    outputs shorter than, as long as and longer than min_tokens."""
    from transformers import MinNewTokensLengthLogitsProcessor

    gen = torch.Generator().manual_seed(4)
    stop = [2, 11, 40]
    for num_output in range(7):
        logits = torch.randn(50, generator=gen, dtype=torch.float64)
        tokens = torch.randint(0, 50, (9 + num_output,), generator=gen).tolist()
        processor = MinNewTokensLengthLogitsProcessor(9, 4, stop)
        want = processor(torch.tensor([tokens]), logits.clone()[None])[0]
        params = SamplingParams(max_tokens=8, min_tokens=4)
        assert torch.equal(processed_logits(logits, params, tokens, 9, frozenset(stop)), want), num_output


def test_min_tokens_holds_eos_and_stop_strings_off(model, fp64):
    """Greedy "What is the capital of France?" ends with EOS after a few tokens; min_tokens
    past them goes on (the reference loop's tokens, EOS -inf until then), and a stop string
    counts only where it ends after the text of the first min_tokens tokens (vLLM's rule): a
    space stops the answer after its first word, and at min_tokens 5 after those five
    tokens' text."""
    prompt = chat_prompt(model, "What is the capital of France?")
    engine = build_engine(fp64, num_blocks=32, block_size=16)
    short = engine.generate([prompt], SamplingParams(max_tokens=30))[0].completions[0]
    assert short.finish_reason == "stop" and short.token_ids[-1] in engine.eos_token_ids
    n = len(short.token_ids)
    for batched in (False, True):
        engine.batched_sampling = batched
        params = SamplingParams(max_tokens=n + 6, min_tokens=n + 2)
        out = engine.generate([prompt], params)[0].completions[0]
        assert len(out.token_ids) >= n + 2 and not set(out.token_ids[: n + 2]) & engine.eos_token_ids
        assert out.token_ids == reference_loop(fp64, prompt, params, engine.eos_token_ids)
        spaced = engine.generate([prompt], SamplingParams(max_tokens=30, stop=" "))[0].completions[0]
        assert spaced.finish_reason == "stop" and " " not in spaced.text and short.text.startswith(spaced.text)
        held = engine.generate([prompt], SamplingParams(max_tokens=30, stop=" ", min_tokens=5))[0].completions[0]
        five = model.tokenizer.decode(short.token_ids[:5])
        assert held.finish_reason == "stop" and held.text == five and held.token_ids == short.token_ids[:6]
        assert short.text[len(five)] == " "  # (the sixth token begins with the space that stops it)


def test_the_server_reads_the_controls_and_refuses_bad_ones():
    """kvpool serve's protocol takes the fields (OpenAI's ranges), and names the field of a bad one."""
    import json

    from kvpool.server.protocol import APIError, ChatCompletionRequest, CompletionRequest, parse_body

    chat = {"messages": [{"role": "user", "content": "hi"}]}
    for model, body in ((CompletionRequest, {"prompt": "hi"}), (ChatCompletionRequest, chat)):
        asked = {"presence_penalty": -2, "frequency_penalty": 1.5, "repetition_penalty": 1.2}
        asked |= {"logit_bias": {"50256": -100, "7": 3.5}, "stop_token_ids": [2, 0], "min_p": 0.1, "min_tokens": 3}
        parsed = parse_body(json.dumps({**body, **asked}).encode(), model)
        assert parsed.logit_bias == {"50256": -100.0, "7": 3.5} and parsed.repetition_penalty == 1.2
        for name, bad in (
            ("presence_penalty", 2.5),
            ("frequency_penalty", -3),
            ("repetition_penalty", 0),
            ("logit_bias", {"7": 101}),
            ("logit_bias", {"x": 1}),
            ("logit_bias", {"-1": 1}),
            ("stop_token_ids", [-1]),
            ("min_p", 1.5),
            ("min_tokens", -1),
        ):
            with pytest.raises(APIError) as caught:
                parse_body(json.dumps({**body, name: bad}).encode(), model)
            # (the param names the field, with the key or index where pydantic gives it: "logit_bias[7]")
            assert caught.value.status == 400 and caught.value.param.startswith(name), (bad, caught.value.message)
