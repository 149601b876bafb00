"""The sampling controls beside temperature / top-k / top-p: stop_token_ids, the presence,
frequency and repetition penalties, logit_bias, min_p and min_tokens, from SamplingParams
through the engine (SmolLM2-135M) against independent references."""

from __future__ import annotations

import pytest
import torch

from kvpool.engine.build import build_engine, load_model
from kvpool.engine.sampling import SamplingParams


@pytest.fixture(scope="module")
def model():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield load_model(device="cpu")
    torch.set_num_threads(threads)


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
    with pytest.raises(ValueError, match=rf"stop_token_ids \[{vocab}\] outside the vocabulary \[0, {vocab}\)"):
        engine.add_request(prompt, SamplingParams(stop_token_ids=[1, vocab]))
    assert engine.requests == {}
