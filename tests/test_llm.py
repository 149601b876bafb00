"""kvpool.LLM, the Python quick start: the same greedy tokens as `kvpool generate` on the same
prompt (chat-templated and raw), prefix hits across calls, n samples, and bad input
refused in one line with the engine left as it was."""

from __future__ import annotations

import json
import re

import pytest

import kvpool
from kvpool.cli.main import main
from kvpool.engine.sampling import derived_seed

PROMPT = "What is the capital of France?"


@pytest.fixture(scope="module")
def llm(one_thread):
    return kvpool.LLM(kv_cache_bytes=32 << 20)  # 44 blocks of 16 tokens: plenty for these prompts


def _cli_tokens(args: list[str], capsys) -> dict:
    assert main(["generate", *args, "--json", "--threads", "1"]) == 0
    return json.loads(capsys.readouterr().out)


def test_chat_and_generate_give_kvpool_generates_tokens(llm, capsys):
    params = kvpool.SamplingParams(max_tokens=12)  # greedy, as kvpool generate's default
    chat = llm.chat(PROMPT, params)[0]
    cli = _cli_tokens([PROMPT, "--max-tokens", "12"], capsys)
    assert chat.token_ids == cli["token_ids"] and chat.text == cli["text"]
    assert len(chat.prompt_token_ids) == cli["prompt_tokens"] and chat.finish_reason == cli["finish_reason"]
    assert "Paris" in chat.text
    raw = llm.generate(["The capital of France is"], params)[0]
    cli = _cli_tokens(["The capital of France is", "--no-chat", "--max-tokens", "12"], capsys)
    assert raw.token_ids == cli["token_ids"] and raw.text == cli["text"] and raw.finish_reason == "length"
    assert raw.prompt == "The capital of France is" and raw.prompt_token_ids == llm.tokenizer.encode(raw.prompt)


def test_a_later_call_hits_the_prefix_an_earlier_one_left(llm):
    params = kvpool.SamplingParams(max_tokens=4)
    first, second = llm.generate([[1, 2, 3, 4, 5] * 8] * 2, params)  # one batch: the twin computes it too
    again = llm.generate([[1, 2, 3, 4, 5] * 8], params)[0]
    # 40 tokens in blocks of 16: the two full blocks hit (the last prompt token is always computed)
    assert again.num_cached_tokens == 32 and again.prompt is None
    assert again.token_ids == first.token_ids == second.token_ids
    assert llm.engine.requests == {}  # finished requests are forgotten, their blocks only cached
    llm.engine.runner.check_integrity()


def test_reset_prefix_cache_forgets_the_hits_of_earlier_calls(llm):
    """vLLM's LLM.reset_prefix_cache: the next call finds no hit (the same tokens, computed
    again), the one after hits again; refused (False, the hits kept) while a request holds
    blocks or another thread's call is running."""
    params = kvpool.SamplingParams(max_tokens=4)
    prompt = [7, 8, 9, 10] * 10
    first = llm.generate([prompt], params)[0]
    assert llm.generate([prompt], params)[0].num_cached_tokens == 32
    assert llm.reset_prefix_cache() is True
    again = llm.generate([prompt], params)[0]
    assert again.num_cached_tokens == 0 and again.token_ids == first.token_ids
    assert llm.generate([prompt], params)[0].num_cached_tokens == 32
    engine = llm.engine
    rid = engine.add_request(prompt, params)
    engine.step()  # admitted: its blocks (the hit among them) are in use
    assert engine.reset_prefix_cache() is False
    assert engine.runner.cache.lookup_prefix(prompt) == 32
    while engine.has_unfinished():
        engine.step()
    assert engine.pop_output(rid).num_cached_tokens == 32
    with llm._lock:  # (another thread's generate holds it while it steps the engine)
        assert llm.reset_prefix_cache() is False
    assert llm.reset_prefix_cache() is True and engine.runner.cache.lookup_prefix(prompt) == 0
    engine.runner.check_integrity()


def test_n_samples_share_the_prompt(llm):
    params = kvpool.SamplingParams(max_tokens=5, temperature=1.0, seed=7, n=3, ignore_eos=True)
    out = llm.generate("Once upon a time", params)[0]
    assert len(out.outputs) == 3 and all(len(c.token_ids) == 5 for c in out.outputs)
    assert out.token_ids == out.outputs[0].token_ids
    assert llm.generate("Once upon a time", params)[0].outputs == out.outputs  # seeded: the same samples


def test_unseeded_requests_draw_their_own_samples_and_a_run_draws_them_again(llm):
    """Requests without a seed take the engine's next seeds (`derived_seed(engine seed, k)`):
    two of one call sample differently (they all sampled with seed 0, the same tokens), the
    same calls from the same engine seed sample the same again, and a given seed still wins."""
    params = kvpool.SamplingParams(max_tokens=8, temperature=1.0, ignore_eos=True)
    llm.engine.reseed(0)
    first, second = llm.generate(["Once upon a time"] * 2, params)
    assert first.token_ids != second.token_ids
    third = llm.generate("Once upon a time", params)[0]  # a later call goes on with the stream
    assert third.token_ids not in (first.token_ids, second.token_ids)
    llm.engine.reseed(0)
    again = llm.generate(["Once upon a time"] * 2, params)
    assert [o.token_ids for o in again] == [first.token_ids, second.token_ids]
    for k, out in enumerate((first, second)):  # the documented rule, seed by seed
        seeded = kvpool.SamplingParams(max_tokens=8, temperature=1.0, ignore_eos=True, seed=derived_seed(0, k))
        assert llm.generate("Once upon a time", seeded)[0].token_ids == out.token_ids
    fixed = kvpool.SamplingParams(max_tokens=8, temperature=1.0, ignore_eos=True, seed=0)
    a, b = llm.generate(["Once upon a time"] * 2, fixed)
    assert a.token_ids == b.token_ids  # a given seed: the same stream
    with pytest.raises(TypeError, match="seed must be an integer"):
        kvpool.LLM(seed=1.5)
    with pytest.raises(ValueError, match="seed must be a 64-bit signed integer"):
        kvpool.LLM(seed=1 << 63)


def test_model_names_resolve_as_the_commands_do(tmp_path):
    from kvpool.llm import gguf_path

    assert gguf_path(None) is None and gguf_path("smollm2-135m") is None and gguf_path("SmolLM2-135M") is None
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF")
    assert gguf_path(str(model)) == str(model)
    with pytest.raises(ValueError, match="neither 'smollm2-135m' nor a GGUF file"):
        gguf_path(str(tmp_path / "missing.gguf"))
    with pytest.raises(TypeError, match="model must be a name, a GGUF path or an HF model directory, got int"):
        gguf_path(3)


def test_bad_input_is_one_error_and_leaves_nothing(llm):
    with pytest.raises(ValueError, match="neither 'smollm2-135m' nor a GGUF file"):
        kvpool.LLM("no-such-model")
    with pytest.raises(ValueError, match="prompts is empty"):
        llm.generate([])
    with pytest.raises(TypeError, match=r"prompts\[1\] is a float"):
        llm.generate(["fine", 1.5])
    with pytest.raises(TypeError, match=r"conversations\[0\] is not a string"):
        llm.chat([[{"role": "user"}]])
    for bad, words in (
        ({"block_size": 2.5}, "block_size must be an integer, got 2.5"),  # was torch's "zeros(): argument 'size'"
        ({"max_num_seqs": "8"}, "max_num_seqs must be an integer, got '8'"),
        ({"kv_cache_bytes": "256MiB"}, "kv_cache_bytes must be a number of bytes, got '256MiB'"),
        ({"enable_prefix_caching": "no"}, "enable_prefix_caching must be True or False, got 'no'"),  # was on
    ):
        with pytest.raises(TypeError, match=re.escape(words)):
            kvpool.LLM(**bad)
    with pytest.raises(ValueError, match="kv_cache_bytes must be positive, got nan"):
        kvpool.LLM(kv_cache_bytes=float("nan"))
    with pytest.raises(TypeError, match="prompts is a NoneType"):
        llm.generate(None)
    with pytest.raises(TypeError, match="prompts is a bytes"):
        llm.generate(b"hi")
    with pytest.raises(TypeError, match="params is a dict; give kvpool.SamplingParams"):
        llm.generate("hi", {"max_tokens": 2})
    with pytest.raises(TypeError, match=r"conversations\[0\]\[1\]\['content'\] is a NoneType, not a string"):
        llm.chat([{"role": "system", "content": "be brief"}, {"role": "user", "content": None}])
    too_long = [7] * 10_000
    with pytest.raises(ValueError, match="too long"):
        llm.generate([[1, 2, 3], too_long])  # the first was queued: it is taken back
    assert llm.engine.requests == {} and not llm.engine.has_unfinished()
    assert llm.engine.runner.usage().num_held_blocks == 0
    llm.engine.runner.check_integrity()


def test_a_dict_or_a_set_is_refused_not_iterated(llm):
    """chat({"role": "user", "content": "hi"}), one message outside its list, answered the
    dict's keys "role" and "content" as two user messages; generate({...}) completed the
    keys; a set answered in its hash order. Each is a TypeError naming it, nothing queued."""
    for call, bad, words in (
        (llm.chat, {"role": "user", "content": "hi"}, "conversations is a dict (one message?); give [message]"),
        (llm.chat, {"hi", "there"}, "conversations is a set; give a string, a list of messages or a list of those"),
        (llm.generate, {"prompt": "The capital of France is"}, "prompts is a dict; give a string, a list of strings"),
        (llm.generate, {"hi", "there"}, "prompts is a set; give a string, a list of strings"),
    ):
        with pytest.raises(TypeError, match=re.escape(words)):
            call(bad, kvpool.SamplingParams(max_tokens=2))
    assert llm.engine.requests == {} and not llm.engine.has_unfinished()
    assert llm.engine.runner.usage().num_held_blocks == 0
    # A dict's keys() view is ordered (a Set, yet no set): taken, in its order
    ordered = {"The capital of France is": 0, "Hi": 1}
    params = kvpool.SamplingParams(max_tokens=2)
    assert [o.text for o in llm.generate(ordered.keys(), params)] == [
        o.text for o in llm.generate(list(ordered), params)
    ]


def test_calls_from_several_threads_take_turns(llm, monkeypatch):
    """Four threads calling generate at once stepped one engine together and failed inside
    its step ("zip() argument 2 is shorter than argument 1"); each call now waits for the
    one before it, and every thread gets the tokens it gets alone. The forward is slowed so
    that the threads' steps would overlap."""
    import threading
    import time

    prompts = ["Once upon a time", "The capital of France is", "def fib(n):", "The sea is"]
    params = kvpool.SamplingParams(max_tokens=4, ignore_eos=True)
    alone = [llm.generate(p, params)[0].token_ids for p in prompts]
    runner = llm.engine.runner
    execute = runner.execute

    def slow_execute(*args, **kwargs):
        time.sleep(0.02)  # (the GIL released: another thread runs meanwhile)
        return execute(*args, **kwargs)

    monkeypatch.setattr(runner, "execute", slow_execute)
    results: dict[int, object] = {}

    def work(i: int) -> None:
        try:
            results[i] = llm.generate(prompts[i], params)[0].token_ids
        except Exception as error:  # (reported below, not lost in the thread)
            results[i] = error

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [results[i] for i in range(len(prompts))] == alone
    assert llm.engine.requests == {} and not llm.engine.has_unfinished()
    runner.check_integrity()


def test_token_ids_of_any_integer_type_are_taken_and_others_named(llm):
    """numpy's integers were refused as "prompts[0] is a list" (a list of token ids is what
    it was); a bool and the bytes of b"hi" passed as token ids (1, and 104 105). Now any
    integral id is taken as an int, and a bad one named by its place; nothing is queued."""
    import numpy as np

    params = kvpool.SamplingParams(max_tokens=2)
    ids = llm.tokenizer.encode("The capital of France is")
    out = llm.generate([list(np.array(ids, dtype=np.int64))], params)[0]
    assert out.prompt_token_ids == ids and all(type(t) is int for t in out.prompt_token_ids)
    assert out.token_ids == llm.generate([ids], params)[0].token_ids
    for bad, words in (
        ([[1, 2, True]], "prompts[0][2] is True (bool); a token id is an integer"),
        ([[1, 2], [3, 4.0]], "prompts[1][1] is 4.0 (float); a token id is an integer"),
        ([b"hi"], "prompts[0] is a bytes; a prompt is a string or a list of token ids"),
    ):
        with pytest.raises(TypeError, match=re.escape(words)):
            llm.generate(bad, params)
    assert llm.engine.requests == {} and not llm.engine.has_unfinished()


def test_integer_arrays_are_prompts_and_other_arrays_are_named(llm):
    """A numpy row of token ids (a list of 1-D arrays, one 1-D array, or a 2-D array's rows)
    was refused as "prompts[0] is a ndarray"; now an integer array of any width is taken, its
    ids as ints, and a float or bool array is refused by its dtype, nothing queued."""
    import numpy as np

    params = kvpool.SamplingParams(max_tokens=2)
    ids = llm.tokenizer.encode("The capital of France is")
    want = llm.generate([ids], params)[0].token_ids
    for prompts, count in (
        ([np.array(ids, dtype=np.int64)], 1),
        (np.array(ids, dtype=np.int32), 1),  # one prompt
        (np.array([ids, ids], dtype=np.uint16), 2),  # two, a row each
    ):
        outs = llm.generate(prompts, params)
        assert [o.token_ids for o in outs] == [want] * count
        assert all(o.prompt_token_ids == ids and all(type(t) is int for t in o.prompt_token_ids) for o in outs)
    for bad, words in (
        (np.array([[1.0, 2.0]]), "prompts is an array of float64; token ids are an integer array"),
        (np.array([True, False]), "prompts is an array of bool; token ids are an integer array"),
        ([[1, 2], np.array([1.0, 2.0])], "prompts[1] is an array of float64; token ids are an integer array"),
        ([np.array([[1, 2]])], "prompts[0] is an array of 2 dimensions; a prompt's token ids are 1-D"),
        (np.zeros((1, 2, 2), dtype=np.int64), "prompts is an array of 3 dimensions"),
    ):
        with pytest.raises(TypeError, match=re.escape(words)):
            llm.generate(bad, params)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate(np.array([[1, -2]]), params)
    assert llm.engine.requests == {} and not llm.engine.has_unfinished()


def test_a_lone_surrogate_in_a_prompt_is_a_value_error_naming_it(llm):
    """ "\\ud800" (what json.loads makes of an escape, or argv of a byte that is not UTF-8)
    reached the tokenizer, whose error named no prompt: "TypeError: TextEncodeInput must be
    Union[...]". generate and chat now refuse it by character, nothing queued."""
    words = "the text holds a lone surrogate ('\\udce9' at character 3), which is not Unicode text"
    with pytest.raises(ValueError, match=re.escape(words)):
        llm.generate(["fine", "caf\udce9"])
    with pytest.raises(ValueError, match="the text holds a lone surrogate"):
        llm.chat([{"role": "user", "content": "hi \ud800"}])
    assert llm.engine.requests == {} and not llm.engine.has_unfinished()


def test_the_engine_knows_the_tokens_that_decode_to_no_text(llm):
    """The stop-string check reaches past the special tokens (tests/test_sampling.py): the
    engine over the GGUF is given exactly the tokens its decode skips."""
    textless = {t for t in range(llm.tokenizer.tokenizer.get_vocab_size()) if llm.tokenizer.decode([t]) == ""}
    assert llm.engine.textless_ids == textless and llm.tokenizer.tokenizer.token_to_id("<|im_end|>") in textless
