"""`kvpool generate` as a user meets it: JSON fields, the length note, the context check,
and the values refused at parse time. The SmolLM2 weights are loaded once for the module."""

from __future__ import annotations

import json

import pytest

from kvpool.cli.main import main


@pytest.fixture(scope="module")
def smollm2(smollm2_for_commands):
    return smollm2_for_commands


def test_generate_json(smollm2, capsys):
    assert main(["generate", "What is the capital of France?", "--json", "--max-tokens", "16", "--threads", "1"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out) == {
        "token_ids",
        "text",
        "prompt_tokens",
        "cached_tokens",
        "finish_reason",
        "kv_format",
        "tp",
        "kv_bytes_per_token_per_rank",
        "kv_pool_bytes_per_rank",
        "ttft_ms",
        "tokens_per_s",
        "latency_ms",
        "load_s",
        "load_source",
        "memory",
    }
    assert "Paris" in out["text"] and 0 < len(out["token_ids"]) < 16
    assert out["finish_reason"] == "stop"  # the model ended its answer itself, before the limit
    assert out["prompt_tokens"] > 20 and out["cached_tokens"] == 0 and out["kv_format"] == "float32"
    assert 0 < out["ttft_ms"] < out["latency_ms"] and out["tokens_per_s"] > 0
    # the model's load (once, by the fixture) and the ledger of this engine: its weights and
    # pool exactly; the peak is this test process's, so nothing is said of `unaccounted` here
    # (tests/test_memory_ledger.py runs the engine in a process of its own)
    assert out["load_s"] == round(smollm2.load_s, 3) and out["load_source"] == smollm2.load_source
    mem = out["memory"]
    assert mem["details"]["weights"]["model"] == 538_060_032
    # the pool is what the request can need: the prompt and --max-tokens 16, in 16-token blocks
    assert mem["details"]["kv_pool"]["data"] == -(-(out["prompt_tokens"] + 16) // 16) * 737_280
    assert mem["details"]["workspace"]["logits"] == 49152 * 4  # one row of fp32 logits a step


def test_output_cut_by_max_tokens_says_so(smollm2, capsys):
    assert main(["generate", "What is the capital of France?", "--json", "--max-tokens", "3", "--threads", "1"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["finish_reason"] == "length" and len(out["token_ids"]) == 3
    # text mode: the answer on stdout, the note naming the limit on stderr
    assert main(["generate", "What is the capital of France?", "--max-tokens", "3", "--threads", "1"]) == 0
    captured = capsys.readouterr()
    assert captured.out == out["text"] + "\n"
    assert captured.err == "kvpool generate: note: the output stopped at --max-tokens 3, not at a natural end\n"


def test_a_character_the_length_limit_cuts_ends_the_streamed_text_as_it_ends_the_json_text(smollm2, capsys):
    """The stream held back the half emoji --max-tokens cut (waiting for bytes that never
    came), where --json's "text" ends in U+FFFD (the decode of its ids, as HF's and vLLM's
    final text): the two differed by that one character. Now the stream ends with the final
    text whole, as kvpool serve's does (server/text_stream.py)."""
    argv = ["generate", "Répète: 🚀🚀🚀 中文", "--max-tokens", "20", "--threads", "1"]
    assert main([*argv, "--json"]) == 0
    text = json.loads(capsys.readouterr().out)["text"]
    assert text.endswith("\ufffd") and "\ufffd" not in text[:-1]  # the case: the last emoji cut in two
    assert main(argv) == 0
    assert capsys.readouterr().out == text + "\n"


def test_prompt_plus_max_tokens_beyond_the_context_is_refused(smollm2, capsys):
    # an 8,150-token prompt with --max-tokens 200 used to return 42 tokens without a word
    prompt = "word " * 8150
    num_prompt = len(smollm2.tokenizer.encode(prompt))
    assert 8100 < num_prompt < 8192
    assert main(["generate", prompt, "--no-chat", "--max-tokens", "200", "--threads", "1"]) == 2
    assert capsys.readouterr().err == (
        f"kvpool generate: error: the prompt has {num_prompt} tokens and --max-tokens 200; the context holds "
        f"8192 tokens (the model's maximum), so at most {8192 - num_prompt} new tokens fit\n"
    )
    assert main(["generate", "hi", "--no-chat", "--max-tokens", "100000", "--threads", "1"]) == 2
    assert "--max-tokens 100000; the context holds 8192 tokens" in capsys.readouterr().err
    # a small pool bounds the context before the model does, and the message says so
    assert main(["generate", "hi", "--max-tokens", "64", "--num-blocks", "4", "--threads", "1"]) == 2
    assert "the context holds 64 tokens (--num-blocks 4 x --block-size 16)" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["hi", "--threads", "-1"], "argument --threads: expected a positive integer, got -1"),
        (["hi", "--threads", "0"], "argument --threads: expected a positive integer, got 0"),
        (["hi", "--max-tokens", "0"], "argument --max-tokens: expected a positive integer, got 0"),
        (["hi", "--block-size", "two"], "argument --block-size: expected a positive integer, got 'two'"),
        (["hi", "--num-blocks", "-3"], "argument --num-blocks: expected a positive integer, got -3"),
        (["hi", "--top-k", "-1"], "argument --top-k: expected an integer >= 0, got -1"),
        (["hi", "--presence-penalty", "3"], "argument --presence-penalty: expected a number in [-2, 2], got '3'"),
        (["hi", "--frequency-penalty", "nan"], "argument --frequency-penalty: expected a number in [-2, 2], got 'nan'"),
        (
            ["hi", "--repetition-penalty", "0"],
            "argument --repetition-penalty: expected a finite positive number, got '0'",
        ),
        (["hi", "--min-p", "1.5"], "argument --min-p: expected a number in [0, 1], got '1.5'"),
        (["hi", "--min-tokens", "-2"], "argument --min-tokens: expected an integer >= 0, got -2"),
        (["hi", "--stop-token-ids", "2,x"], "argument --stop-token-ids: expected an integer >= 0, got 'x'"),
        ([""], "argument prompt: the prompt is empty"),
        (["  \n"], "argument prompt: the prompt is empty"),
        # (argv's bytes that are not UTF-8, as Python hands them over: a TypeError traceback from the tokenizer)
        (
            ["caf\udce9 au lait"],
            "argument prompt: the prompt is not valid UTF-8 text (byte 0xe9 at character 3); give it in UTF-8",
        ),
        (
            ["x\ud800"],
            "argument prompt: the prompt is not valid UTF-8 text (U+D800, a lone surrogate, at character 1); "
            "give it in UTF-8",
        ),
    ],
)
def test_bad_values_are_refused_at_parse_time(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", *argv])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.endswith(f"kvpool generate: error: {message}\n") and "Traceback" not in err


def test_threads_is_checked_for_every_command_that_takes_it(capsys):
    for argv in (["run", "--threads", "-1"], ["bench", "engine", "--threads", "0"]):
        with pytest.raises(SystemExit) as exit_info:
            main(argv)
        assert exit_info.value.code == 2
        assert "argument --threads: expected a positive integer" in capsys.readouterr().err


def test_tiny_dsv4_prompt_ids_are_ascii_decimal_integers():
    """int() reads other digits and underscores: "٣,٤" (Arabic-Indic) was the prompt 3,4 and
    "1_0" the id 10, run without a word. Only ASCII decimals (and a sign, for the range's
    own message) are ids now."""
    from kvpool.cli.generate_dsv4 import parse_token_ids

    assert parse_token_ids(" 5,17 42,\t0 ", 256) == [5, 17, 42, 0]
    assert parse_token_ids("+7,007", 256) == [7, 7]
    for text in ("\u0663,\u0664", "1_0", "\uff15", "5,1e2", "0x10"):
        with pytest.raises(ValueError, match=r'^tiny-dsv4 takes token ids \(e.g. "5,17,42"\), got '):
            parse_token_ids(text, 256)
    with pytest.raises(ValueError, match=r"^tiny-dsv4: token ids must lie in \[0, 256\), got \[-1, 256\]$"):
        parse_token_ids("3,-1,256", 256)


def test_tiny_dsv4_reports_finish_reason_timings_and_checks_the_context(capsys):
    argv = ["generate", "5,17,42,99", "--model", "tiny-dsv4", "--no-chat", "--max-tokens", "3", "--threads", "1"]
    assert main([*argv, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["finish_reason"] == "length" and len(out["token_ids"]) == 3  # the tiny model has no EOS
    assert 0 < out["ttft_ms"] < out["latency_ms"] and out["tokens_per_s"] > 0
    assert out["load_source"] == "built in" and out["load_s"] > 0 and out["memory"] is None
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert captured.out == " ".join(map(str, out["token_ids"])) + "\n"
    assert "stopped at --max-tokens 3" in captured.err
    # one classical block of 128 tokens + 127 in the state block
    assert main([*argv[:-4], "--max-tokens", "300", "--num-blocks", "1"]) == 2
    assert capsys.readouterr().err == (
        "kvpool generate: error: the prompt has 4 tokens and --max-tokens 300; the context holds 255 tokens "
        "(the KV cache of --num-blocks 1), so at most 251 new tokens fit\n"
    )
    assert main(["generate", "5,17", "--model", "tiny-dsv4"]) == 2
    assert capsys.readouterr().err == (
        "kvpool generate: error: tiny-dsv4 has no tokenizer or chat template: pass --no-chat and token ids\n"
    )


def test_generate_seed_takes_what_sampling_params_takes(capsys):
    """review16 #6: `generate --seed -1` exited 2 while SamplingParams, serve's `seed` and LLM
    take -1 as a fixed seed. One rule now: a 64-bit signed integer, every value a seed (the
    parser's range is SamplingParams' own, at both ends and around 0)."""
    from kvpool.cli.main import build_parser
    from kvpool.engine.sampling import SEED_MAX, SEED_MIN, SamplingParams

    parser = build_parser()
    for seed in (SEED_MIN, -1, 0, SEED_MAX):
        assert parser.parse_args(["generate", "hi", "--seed", str(seed)]).seed == seed
        assert SamplingParams(seed=seed).seed == seed
    for seed in (SEED_MIN - 1, SEED_MAX + 1):
        with pytest.raises(ValueError, match="seed must be a 64-bit signed integer"):
            SamplingParams(seed=seed)
        with pytest.raises(SystemExit) as exit_info:
            parser.parse_args(["generate", "hi", "--seed", str(seed)])
        assert exit_info.value.code == 2
        assert "argument --seed: expected a 64-bit signed integer" in capsys.readouterr().err


def test_the_sampling_controls_reach_the_request(smollm2, capsys):
    """--frequency-penalty and the others are the request's: the answer that repeats "hello"
    greedily does not with the penalty; --stop-token-ids ends it at that id; --min-tokens past
    --max-tokens, or a stop id outside the vocabulary, is one line naming it."""
    argv = ["generate", "Say the word hello five times.", "--json", "--max-tokens", "12", "--threads", "1"]
    assert main(argv) == 0
    plain = json.loads(capsys.readouterr().out)["token_ids"]
    assert main([*argv, "--frequency-penalty", "1.5", "--presence-penalty", "0.5", "--min-tokens", "2"]) == 0
    penalised = json.loads(capsys.readouterr().out)["token_ids"]
    assert penalised != plain and penalised[0] == plain[0]
    assert main([*argv, "--stop-token-ids", f"{plain[2]}"]) == 0
    stopped = json.loads(capsys.readouterr().out)
    assert stopped["finish_reason"] == "stop" and stopped["token_ids"] == plain[: plain.index(plain[2]) + 1]
    assert main([*argv, "--min-tokens", "13"]) == 2
    assert capsys.readouterr().err.endswith("kvpool generate: error: --min-tokens 13 is more than --max-tokens 12\n")
    assert main([*argv, "--stop-token-ids", "49152"]) == 2
    assert "stop_token_ids: token ids [49152] outside the vocabulary [0, 49152)" in capsys.readouterr().err
