"""The sampler: greedy, temperature, top-k and top-p, each draw's uniform a hash of (seed,
sample index, position).

No test here can flake: the uniforms are a fixed function of the code (integer
arithmetic, the same on every machine), and so are the counts (a machine's fp32 rounding
of the softmax could move a draw only where the uniform lands within ~1e-7 of a
cumulative boundary). The frequency bounds are
still those a correct sampler meets for almost any seed: 5 binomial standard errors
(a correct sampler misses one with probability ~6e-7; the shares drawn here lie within 1),
while a wrong distribution, off by 0.04 or more at n = 3000, fails.
"""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest
import torch

from kvpool.engine.sampling import NUCLEUS_CANDIDATES, SamplingParams, sample_token

N = 3000


def draws(logits: torch.Tensor, params: SamplingParams, n: int = N) -> Counter:
    return Counter(sample_token(logits, params, 0, position) for position in range(n))


def assert_frequency(counts: Counter, token: int, p: float, n: int = N) -> None:
    """The share of `token` in n draws is p to within 5 standard errors, sqrt(p (1 - p) / n)."""
    assert abs(counts[token] / n - p) <= 5 * math.sqrt(p * (1 - p) / n), (token, counts[token] / n, p)


def test_greedy_is_the_argmax():
    logits = torch.tensor([0.1, 3.0, -2.0, 2.9])
    assert sample_token(logits, SamplingParams(), 0, 0) == 1


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_temperature_sampling_follows_the_softmax(temperature):
    probs = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)
    counts = draws(torch.log(probs).float(), SamplingParams(temperature=temperature, seed=0))
    expected = probs ** (1 / temperature) / (probs ** (1 / temperature)).sum()  # 0.5: 0.658, 0.237, 0.105
    for token, p in enumerate(expected.tolist()):
        assert_frequency(counts, token, p)


def test_top_k_keeps_the_k_most_likely_renormalised():
    logits = torch.log(torch.tensor([0.4, 0.05, 0.3, 0.05, 0.2]))
    counts = draws(logits, SamplingParams(temperature=1.0, top_k=2, seed=0))
    assert set(counts) == {0, 2}
    assert_frequency(counts, 0, 0.4 / 0.7)


def test_top_p_keeps_the_smallest_set_reaching_p():
    # 0.5 + 0.3 = 0.8 reaches top_p = 0.79: token 2 (0.15) is dropped, the rest as well
    probs = torch.tensor([0.5, 0.3, 0.15] + [0.05 / 1000] * 1000)
    counts = draws(torch.log(probs), SamplingParams(temperature=1.0, top_p=0.79, seed=0))
    assert set(counts) == {0, 1}
    assert_frequency(counts, 0, 0.5 / 0.8)
    # just above 0.8 the third token joins
    assert 2 in draws(torch.log(probs), SamplingParams(temperature=1.0, top_p=0.81, seed=0))


def test_top_p_beyond_the_candidates_takes_the_full_sort():
    # a flat 49,152-token distribution: the nucleus at top_p 0.5 holds ~24,576 tokens,
    # far more than the first candidates; every one of the lowest half must stay out
    torch.manual_seed(0)
    logits = torch.randn(49_152) * 0.01
    order = torch.argsort(logits, descending=True)
    probs = torch.softmax(logits, -1)[order]
    nucleus_size = int((torch.cumsum(probs, 0) - probs < 0.5).sum())
    assert nucleus_size > 10 * NUCLEUS_CANDIDATES
    allowed = set(order[:nucleus_size].tolist())
    # 100 draws (each sorts all 49,152 probabilities): a sampler ignoring top-p lands in the
    # lowest half with probability 1/2 a draw, one stopping at the candidates never leaves
    # them, and a correct one stays among them with probability ~(256 / 24,576)^100
    counts = draws(logits, SamplingParams(temperature=1.0, top_p=0.5, seed=0), n=100)
    assert set(counts) <= allowed
    assert len(set(counts) - set(order[:NUCLEUS_CANDIDATES].tolist())) > 0  # drawn past the candidates


@pytest.mark.parametrize(
    "params", [SamplingParams(temperature=0.7, top_p=0.9, top_k=40, seed=0), SamplingParams(temperature=1.3, seed=0)]
)
def test_a_token_depends_only_on_seed_sample_and_position(params):
    logits = torch.randn(49_152, generator=torch.Generator().manual_seed(1))
    a = [sample_token(logits, params, 2, pos) for pos in range(50)]
    assert a == [sample_token(logits.clone(), params, 2, pos) for pos in range(50)]
    other_seed = SamplingParams(**{**params.__dict__, "seed": params.seed + 1})
    assert a != [sample_token(logits, other_seed, 2, pos) for pos in range(50)]


def test_a_top_p_that_fp32_rounds_to_zero_keeps_the_most_likely_token():
    # 1e-50 is 0.0 in fp32: a mask "the tokens before reach top_p" then drops every token,
    # and the draw indexed past an empty nucleus; the most likely token must always stay
    logits = torch.tensor([0.2, 1.5, -0.3, 1.4])
    for top_p in (1e-50, 1e-45, 1e-8):
        assert set(draws(logits, SamplingParams(temperature=1.0, top_p=top_p, seed=0), n=50)) == {1}


def test_the_second_try_at_overflowed_scores_is_made_once(monkeypatch):
    """A row whose scores overflow at the temperature is drawn again from its logits less their
    maximum; the second try called sample_token again with no guard, so a second failure would
    have recursed until RecursionError. Made to fail again (the shift replaced by one that leaves
    the logits as they are), it is tried exactly once more and refused."""
    from kvpool.engine import sampling
    from kvpool.engine.sampling import NonFiniteLogitsError

    calls = []

    def unshifted(logits: torch.Tensor) -> torch.Tensor:
        calls.append(logits.clone())
        return logits

    row = torch.tensor([1e38, 0.5e38, 3.0, -2.0])
    params = SamplingParams(temperature=0.01, seed=4)
    assert sample_token(row, params, 0, 9) == 0  # the real shift: the temperature's limit
    monkeypatch.setattr(sampling, "shifted_logits", unshifted)
    with pytest.raises(NonFiniteLogitsError, match="not finite") as refused:
        sample_token(row, params, 0, 9)
    assert len(calls) == 1 and torch.equal(calls[0], row) and refused.value.rows == [0]


def test_temperatures_below_the_greedy_threshold_are_greedy():
    # logits / 1e-300 overflow fp32 to inf and the softmax of those is NaN: such a
    # temperature means greedy, as in vLLM
    logits = torch.randn(1000, generator=torch.Generator().manual_seed(3))
    for temperature in (1e-300, 1e-6):
        params = SamplingParams(temperature=temperature, seed=5)
        assert params.greedy
        assert set(draws(logits, params, n=20)) == {int(torch.argmax(logits))}
    assert not SamplingParams(temperature=1e-4, seed=0).greedy


@pytest.mark.parametrize(
    "bad",
    [
        {"temperature": math.nan},
        {"temperature": math.inf},
        {"temperature": -0.5},
        {"top_p": math.nan},
        {"top_p": 0.0},
        {"top_p": 1.5},
        {"seed": 1 << 63},
        {"seed": -(1 << 63) - 1},
    ],
)
def test_parameters_out_of_the_samplers_range_are_refused_naming_them(bad):
    (name,) = bad
    with pytest.raises(ValueError, match=name):
        SamplingParams(**bad)


def test_seeds_a_multiple_of_2_to_the_63_apart_sample_differently():
    # the generator's seed is taken mod 2^64: -1 and 2^63 - 1 (both valid int64 seeds) were
    # one seed when it was taken mod 2^63
    logits = torch.randn(49_152, generator=torch.Generator().manual_seed(1))
    a = [sample_token(logits, SamplingParams(temperature=1.0, seed=-1), 0, pos) for pos in range(30)]
    b = [sample_token(logits, SamplingParams(temperature=1.0, seed=(1 << 63) - 1), 0, pos) for pos in range(30)]
    assert a != b


def test_never_draws_a_token_of_zero_probability():
    logits = torch.full((10,), -math.inf)
    logits[7] = 0.0
    assert set(draws(logits, SamplingParams(temperature=1.0, seed=0), n=200)) == {7}


def test_stop_strings_are_found_where_a_full_decode_finds_them() -> None:
    """The engine checks a window of the newest tokens for stop strings: it must stop at the
    same token, with the same text, as decoding the whole output every step would."""
    import random

    from kvpool.engine.engine import Engine
    from kvpool.engine.llama_runner import llama_runner
    from random_llama import DESCRIPTOR, random_ids, random_llama

    model = random_llama()
    pieces = {t: ["a", "b", "ab", "ba", "é", "ü", "ca", "aab"][t % 8] for t in range(512)}

    def decode(ids: list[int]) -> str:  # 1 to 3 characters a token, some of two bytes
        return "".join(pieces[t] for t in ids)

    def naive(ids: list[int], stops: list[str]) -> tuple[int, str]:
        """The tokens and text where decoding the whole output after every token stops."""
        for n in range(1, len(ids) + 1):
            text = decode(ids[:n])
            hits = [text.find(s) for s in stops if s in text]
            if hits:
                return n, text[: min(hits)]
        raise AssertionError("the first stop string is cut from this text: it must be found")

    rng = random.Random(3)
    runner = llama_runner(model, 64, 16, DESCRIPTOR)
    engine = Engine(runner, max_num_batched_tokens=64, max_num_seqs=4, decode_text=decode)
    free = Engine(llama_runner(model, 64, 16, DESCRIPTOR), max_num_batched_tokens=64, max_num_seqs=4)
    for case in range(12):
        params = SamplingParams(max_tokens=40, temperature=1.5, seed=case, ignore_eos=True)
        rid = free.add_request(random_ids(12, case), params, f"f{case}")  # the same samples, never stopped
        while free.has_unfinished():
            free.step()
        unstopped = free.requests[rid].seqs[0].output_ids
        text = decode(unstopped)
        at = rng.randrange(len(text) - 6)
        # one stop string cut from the text itself (over token boundaries), one made up
        stops = [text[at : at + rng.randint(3, 6)], "".join(rng.choice("abé") for _ in range(4))]
        expected = naive(unstopped, stops)
        stopped = SamplingParams(max_tokens=40, temperature=1.5, seed=case, ignore_eos=True, stop=tuple(stops))
        rid = engine.add_request(random_ids(12, case), stopped, f"s{case}")
        while engine.has_unfinished():
            engine.step()
        seq = engine.requests[rid].seqs[0]
        assert (len(seq.output_ids), seq.text, seq.finish_reason) == (*expected, "stop")


def test_a_stop_string_given_alone_is_one_stop_string_not_its_characters() -> None:
    """stop="ab" (vLLM's and OpenAI's spelling of one stop string) stops where "ab" first
    appears; iterated as given it was the stop strings "a" and "b"."""
    from kvpool.engine.engine import Engine
    from kvpool.engine.llama_runner import llama_runner
    from random_llama import DESCRIPTOR, random_ids, random_llama

    assert SamplingParams(stop="ab").stop == ("ab",)
    assert SamplingParams(stop=["ab", "ba"]).stop == ("ab", "ba")  # a list: a tuple, hashable like the rest
    engine = Engine(
        llama_runner(random_llama(), 64, 16, DESCRIPTOR),
        max_num_batched_tokens=64,
        max_num_seqs=4,
        decode_text=lambda ids: "ba" * len(ids),  # every token reads "ba": "baba..."
    )
    params = SamplingParams(max_tokens=10, ignore_eos=True, stop="ab")
    rid = engine.add_request(random_ids(12, 4), params)
    while engine.has_unfinished():
        engine.step()
    seq = engine.requests[rid].seqs[0]
    # "ab" first at 1 of "baba", the second token's text; "b" alone would stop at once with ""
    assert (len(seq.output_ids), seq.text, seq.finish_reason) == (2, "b", "stop")


@pytest.mark.parametrize("stop", [[1], ["a", None], 3])
def test_a_stop_that_is_not_strings_is_refused_naming_stop(stop) -> None:
    with pytest.raises(TypeError, match=r"^stop (strings must be strings|must be a string or a list of strings)"):
        SamplingParams(stop=stop)


@pytest.mark.parametrize(
    "bad",
    [
        {"max_tokens": 2.5},
        {"max_tokens": "10"},
        {"max_tokens": True},
        {"n": 2.0},
        {"top_k": 1.5},
        {"seed": 1.5},
        {"seed": "1"},
        {"logprobs": 1.5},
        {"temperature": "1"},
        {"top_p": None},
        {"ignore_eos": "no"},
    ],
)
def test_parameters_of_the_wrong_type_are_refused_naming_them(bad):
    (name,) = bad
    with pytest.raises(TypeError, match=rf"^{name} must be "):  # (named first: "n" alone matches any message)
        SamplingParams(**bad)


def test_integral_numbers_of_any_kind_are_taken_as_ints():
    import numpy as np

    params = SamplingParams(max_tokens=np.int64(5), n=np.int32(2), seed=np.uint8(7), top_k=3, temperature=1)
    assert (params.max_tokens, params.n, params.seed, params.top_k) == (5, 2, 7, 3)
    assert {type(params.max_tokens), type(params.n), type(params.seed)} == {int}


def test_n_and_stop_strings_beyond_their_bounds_are_refused_naming_them():
    """n above vLLM's default bound (VLLM_MAX_N_SEQUENCES, 16384) and stop strings beyond
    what a stream can hold back (a 100 KB one held every character back to the end) are
    refused by name; the bounds themselves are taken."""
    from kvpool.engine.sampling import MAX_N, MAX_STOP_CHARS, MAX_STOP_STRINGS

    assert SamplingParams(n=MAX_N).n == MAX_N
    assert SamplingParams(stop=["x" * MAX_STOP_CHARS] * MAX_STOP_STRINGS).stop[0] == "x" * MAX_STOP_CHARS
    with pytest.raises(ValueError, match=rf"^n must be at most {MAX_N}, got {MAX_N + 1}"):
        SamplingParams(n=MAX_N + 1)
    with pytest.raises(
        ValueError, match=rf"^stop: at most {MAX_STOP_STRINGS} stop strings, got {MAX_STOP_STRINGS + 1}"
    ):
        SamplingParams(stop=["a"] * (MAX_STOP_STRINGS + 1))
    with pytest.raises(ValueError, match=rf"^stop: a stop string of 100000 characters; at most {MAX_STOP_CHARS}"):
        SamplingParams(stop=["ok", "y" * 100_000])


def test_logprobs_come_back_in_the_output_equal_to_a_full_recompute() -> None:
    """SamplingParams(logprobs=k) was computed per token and never given back: `Completion`
    had no field for it (kvpool.LLM's outputs dropped it). Each sample's entries are the fp64
    log-softmax of a full recompute's logits at its tokens (to 1e-9), its top-k that
    recompute's k most likely tokens; without logprobs the field is None."""
    from kvpool.attention.reference import reference_logits
    from kvpool.engine.engine import Engine
    from kvpool.engine.llama_runner import llama_runner
    from random_llama import DESCRIPTOR, random_ids, random_llama

    model = random_llama()
    engine = Engine(llama_runner(model, 64, 16, DESCRIPTOR), max_num_batched_tokens=64, max_num_seqs=4)
    prompt = random_ids(20, 5)
    asked = SamplingParams(max_tokens=6, temperature=8.0, seed=9, n=2, ignore_eos=True, logprobs=3)
    rid = engine.add_request(prompt, asked)
    plain = engine.add_request(prompt, SamplingParams(max_tokens=3, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    assert [c.logprobs for c in engine.pop_output(plain).completions] == [None]
    completions = engine.pop_output(rid).completions
    assert len(completions) == 2 and completions[0].token_ids != completions[1].token_ids
    for c in completions:
        assert c.logprobs is not None and len(c.logprobs) == len(c.token_ids) == 6
        ref = torch.log_softmax(reference_logits(model, prompt + c.token_ids[:-1]), dim=-1)[len(prompt) - 1 :]
        for i, (token, (logprob, top)) in enumerate(zip(c.token_ids, c.logprobs, strict=True)):
            assert abs(logprob - float(ref[i, token])) <= 1e-9
            values, ids = torch.topk(ref[i], 3)
            assert [t for t, _ in top] == ids.tolist()
            assert max(abs(v - float(r)) for (_, v), r in zip(top, values, strict=True)) <= 1e-9


def test_a_fraction_or_numpy_temperature_and_top_p_are_taken_as_floats() -> None:
    """Any real number is taken, as a float: Fraction(1, 2) passed the type check and then
    failed in torch ("unsupported operand type(s) for /: 'Tensor' and 'Fraction"), top_p in
    a comparison with a tensor. The draw is the float's."""
    from fractions import Fraction

    logits = torch.linspace(-2.0, 2.0, 300)
    for temperature, top_p in ((Fraction(1, 2), Fraction(9, 10)), (np.float64(0.5), np.float32(0.9))):
        params = SamplingParams(temperature=temperature, top_p=top_p, seed=4)
        assert type(params.temperature) is float and type(params.top_p) is float
        same = SamplingParams(temperature=0.5, top_p=float(top_p), seed=4)
        assert [sample_token(logits, params, 0, i) for i in range(20)] == [
            sample_token(logits, same, 0, i) for i in range(20)
        ]


def test_an_aborted_request_gives_back_the_text_of_its_tokens() -> None:
    """An aborted request's completions held their token ids and the text "" (text was set
    only where a sequence stopped or reached its length): each sample's text is now its
    tokens' text, every sample of n = 2 and one aborted before it ran alike."""
    from kvpool.engine.engine import Engine
    from kvpool.engine.llama_runner import llama_runner
    from random_llama import DESCRIPTOR, random_ids, random_llama

    def decode(ids: list[int]) -> str:
        return "".join(chr(0x61 + t % 26) for t in ids)

    engine = Engine(
        llama_runner(random_llama(), 64, 16, DESCRIPTOR), max_num_batched_tokens=64, max_num_seqs=4, decode_text=decode
    )
    params = SamplingParams(max_tokens=20, temperature=8.0, seed=2, n=2, ignore_eos=True)
    running = engine.add_request(random_ids(10, 1), params)
    for _ in range(4):
        engine.step()
    waiting = engine.add_request(random_ids(10, 2), params)
    assert engine.abort(running) and engine.abort(waiting)
    completions = engine.pop_output(running).completions
    assert len(completions) == 2 and all(len(c.token_ids) == 4 for c in completions)
    assert [(c.text, c.finish_reason) for c in completions] == [(decode(c.token_ids), "abort") for c in completions]
    assert [(c.token_ids, c.text) for c in engine.pop_output(waiting).completions] == [([], "")]
    engine.runner.check_integrity()


def test_the_stop_string_window_over_tokens_of_no_text_is_linear_work() -> None:
    """An output of nearly all special tokens (no text) with a stop string: each token's
    check reached back past every one of them and decoded them all, work quadratic in the
    output (1,000 tokens: ~500,000 tokens decoded). Now the window holds only tokens of
    text (4 * len + 2 of them), kept from token to token: at most that many decoded a token,
    and the stop string found as before, at the same token with the same text."""
    from kvpool.engine.engine import Engine
    from kvpool.engine.llama_runner import llama_runner
    from random_llama import DESCRIPTOR, random_ids, random_llama

    pieces = {0: "", 1: "", 2: "a", 3: "b"}
    decoded: list[int] = []

    def decode(ids: list[int]) -> str:
        decoded.append(len(ids))
        return "".join(pieces[t] for t in ids)

    n = 1000
    script = [2 if i % 97 == 0 else i % 2 for i in range(n - 1)] + [3]  # an "a" every 97 tokens, "ab" at the end
    engine = Engine(
        llama_runner(random_llama(), 72, 16, DESCRIPTOR),
        max_num_batched_tokens=64,
        max_num_seqs=4,
        decode_text=decode,
        textless_ids=[0, 1],
        sampler=lambda logits, params, index, position: script[position],
    )
    rid = engine.add_request(random_ids(8, 0), SamplingParams(max_tokens=n, ignore_eos=True, stop="ab"))
    while engine.has_unfinished():
        engine.step()
    out = engine.pop_output(rid).completions[0]
    assert (len(out.token_ids), out.text, out.finish_reason) == (n, "a" * 10, "stop")
    window = 4 * len("ab") + 2
    assert len(decoded) == n + 1 and max(decoded[:-1]) <= window  # a window a token, then the whole text once
    assert sum(decoded) <= n * window + n


def test_a_stop_string_is_found_across_tokens_of_no_text() -> None:
    """Special tokens decode to no text (skipped), so a window of 4 * len + 2 tokens could hold
    too few characters: "a", 12 of them, "b" ran on past stop="ab" to its length. Scripted
    outputs with runs of textless tokens stop where decoding the whole output every token
    stops, at the same token with the same text."""
    import random

    from kvpool.engine.engine import Engine
    from kvpool.engine.llama_runner import llama_runner
    from random_llama import DESCRIPTOR, random_ids, random_llama

    pieces = {0: "", 1: "", 2: "a", 3: "b", 4: "é", 5: "ab", 6: "c"}

    def decode(ids: list[int]) -> str:
        return "".join(pieces[t] for t in ids)

    rng = random.Random(5)
    model = random_llama()
    for case in range(12):
        script = []
        while len(script) < 60:  # a token of text, then a run of 0 to 15 of no text
            script += [rng.choice([2, 3, 4, 5, 6])] + [rng.choice([0, 1]) for _ in range(rng.randint(0, 15))]
        script = script[:60]
        text = decode(script)
        at = rng.randrange(len(text) - 4)
        stop = text[at : at + rng.randint(2, 4)]
        if case == 0:  # the repro: "a", 12 specials, "b"
            script, stop = [2] + [0] * 12 + [3] + [6] * 46, "ab"
        for n in range(1, len(script) + 1):  # the naive check: the whole output's text, every token
            if stop in decode(script[:n]):
                expected = (n, decode(script[:n])[: decode(script[:n]).find(stop)])
                break
        engine = Engine(
            llama_runner(model, 64, 16, DESCRIPTOR),
            max_num_batched_tokens=64,
            max_num_seqs=4,
            decode_text=decode,
            textless_ids=[0, 1],
            sampler=lambda logits, params, index, position, script=script: script[position],
        )
        rid = engine.add_request(random_ids(8, case), SamplingParams(max_tokens=60, ignore_eos=True, stop=stop))
        while engine.has_unfinished():
            engine.step()
        out = engine.pop_output(rid).completions[0]
        assert (len(out.token_ids), out.text, out.finish_reason) == (*expected, "stop"), (case, stop)
