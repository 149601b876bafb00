"""`kvpool run --json` and `kvpool bench engine` end to end (small workloads); generate is in
test_generate_cli.py."""

from __future__ import annotations

import json

import pytest
import torch

from kvpool.cli.main import main


def _run_json(capsys, *args: str) -> dict:
    threads = torch.get_num_threads()
    try:
        assert main(["run", "--json", "--threads", "1", *args]) == 0
    finally:
        torch.set_num_threads(threads)
    return json.loads(capsys.readouterr().out)


def test_run_tiny_dsv4_report_follows_its_definitions(capsys):
    # 3 conversations over 3 distinct 300-token system prompts + 20-token questions, all
    # arriving at once and admitted in the first step (960 tokens <= the 1,024 budget):
    # nothing is cached yet, so first turns hit nothing. Each answer is 4 tokens (the tiny
    # model has no EOS); a follow-up is 320 + 4 + 12 = 336 tokens, of which the first turn
    # computed 323: 2 complete 128-token spans, 256 tokens, hit by each of the 3 follow-ups.
    # (--no-v4-turn-ends: hits at span boundaries only; the next test has the kept turn ends)
    report = _run_json(
        capsys,
        *"--model tiny-dsv4 --num-requests 3 --turns 2 --num-long 0 --max-tokens 4 --request-rate inf".split(),
        *"--max-batch-tokens 1024 --slo-ttft-ms 1e9 --slo-tpot-ms 1e9 --no-v4-turn-ends".split(),
    )
    assert (report["num_requests"], report["num_finished"], report["num_generated_tokens"]) == (6, 6, 24)
    assert report["prefix_queried_tokens"] == 3 * 320 + 3 * 336
    assert report["prefix_hit_tokens"] == 3 * 256
    assert report["prefix_hit_rate"] == round(768 / 1968, 4)
    assert report["block_size"] == 128
    assert report["kv_capacity_tokens"] == report["num_blocks"] * 128 + 127  # + the unfinished span in state
    assert report["fragmentation"] == 0.0  # a classical block is whole by construction
    assert report["preemptions"] == 0 and report["interrupted"] is False
    # every admission takes a state block: it allocates
    assert report["num_alloc_calls"] >= 6
    # with SLOs nobody misses, goodput is every request over the wall time
    assert report["goodput_req_s"] == pytest.approx(6 / report["wall_s"], rel=0.01)


TINY_DSV4_RUN = (
    "--model tiny-dsv4 --num-requests 3 --num-long 0 --max-tokens 4 --request-rate inf --max-batch-tokens 1024"
)


def test_run_tiny_dsv4_adopts_turn_end_states_by_default(capsys):
    # The workload of the test above: each first turn computes 320 + 4 - 1 = 323 tokens and,
    # kept at its turn end, its state block is adopted by its follow-up, which then hits all
    # 323 (2 spans + 67 tokens) instead of 256; off, the report above's figures.
    on = _run_json(capsys, *TINY_DSV4_RUN.split(), "--turns", "2")
    off = _run_json(capsys, *TINY_DSV4_RUN.split(), "--turns", "2", "--no-v4-turn-ends")
    assert (on["v4_turn_ends"], on["state_adoptions"]) == (True, 3)
    assert (off["v4_turn_ends"], off["state_adoptions"]) == (False, 0)
    assert on["prefix_hit_tokens"] == 3 * 323 and off["prefix_hit_tokens"] == 3 * 256
    assert on["prefix_queried_tokens"] == off["prefix_queried_tokens"] == 3 * 320 + 3 * 336


def _greedy_turns(flags: list[str], turns: int) -> tuple[dict[str, list[int]], int]:
    """`kvpool run`'s engine and workload for `flags` (cli/run.py build), served turn by turn
    with greedy sampling: ({request id: its tokens}, the admissions that adopted a kept state)."""
    import argparse
    import random

    from kvpool.cache.dual_pool import DualPoolGroup
    from kvpool.cli import run
    from kvpool.engine.sampling import SamplingParams
    from kvpool.workload.live import request_id

    parser = argparse.ArgumentParser()
    run.add_arguments(parser)
    args = parser.parse_args([*flags, "--turns", str(turns)])
    engine, make_workload, _, _ = run.build(args)
    workload = make_workload(random.Random(args.seed))
    params = SamplingParams(max_tokens=args.max_tokens)  # greedy
    tokens: dict[str, list[int]] = {}
    prompts = {request_id(c, 0): p for c, p in enumerate(workload.first_prompts)}
    for turn in range(turns):
        for rid, prompt in prompts.items():
            engine.add_request(prompt, params, rid)
        while engine.has_unfinished():
            engine.step()
        tokens.update((rid, engine.output(rid).completions[0].token_ids) for rid in prompts)
        prompts = {
            request_id(c, turn + 1): workload.follow_up(conv, tokens[request_id(c, turn)], "")
            for c, conv in enumerate(workload.conversations)
        }
    adopted = sum(g.num_adoptions for g in engine.runner.cache.groups.values() if isinstance(g, DualPoolGroup))
    return tokens, adopted


def test_run_tiny_dsv4_turn_ends_change_no_token():
    # An adopted state is the one recomputing the turn's tail gives: every request of three
    # turns draws the same greedy tokens with the kept turn ends as without them.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # (as `kvpool run --threads 1` above: tiny steps on shared cores)
    try:
        with_turn_ends, adopted = _greedy_turns(TINY_DSV4_RUN.split(), turns=3)
        without, none = _greedy_turns([*TINY_DSV4_RUN.split(), "--no-v4-turn-ends"], turns=3)
    finally:
        torch.set_num_threads(threads)
    assert (adopted, none) == (6, 0)  # each follow-up of turns 2 and 3 adopted its predecessor's state
    assert len(with_turn_ends) == 9 and all(len(t) == 4 for t in with_turn_ends.values())
    assert with_turn_ends == without


@pytest.mark.parametrize("model", ["smollm2-135m", "tiny-gemma2"])
def test_v4_turn_ends_is_refused_for_a_model_without_them(capsys, model):
    for flag in ("--v4-turn-ends", "--no-v4-turn-ends"):
        assert main(["run", "--model", model, flag]) == 2
        err = capsys.readouterr().err.strip()
        assert "\n" not in err and "--v4-turn-ends / --no-v4-turn-ends" in err and "only tiny-dsv4" in err, err


@pytest.mark.parametrize("size", ["64", "16", "--block-size=16", "--block=16"])
@pytest.mark.parametrize("command", [["run"], ["generate", "5,17,42", "--no-chat", "--max-tokens", "1"]])
def test_a_block_size_tiny_dsv4_cannot_take_is_refused_by_name(capsys, command, size):
    """tiny-dsv4's classical blocks are its spans of m' = 128 tokens: `--block-size 64` ran
    with blocks of 128 and said nothing (the report's block_size read 128); so did an explicit
    `--block-size 16`, the parsers' default, in any spelling argparse takes."""
    flag = [size] if size.startswith("--") else ["--block-size", size]
    assert main([*command, "--model", "tiny-dsv4", *flag]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    prog = command[0]
    assert err == (
        f"kvpool {prog}: error: --block-size {size.split('=')[-1]} is not supported with --model tiny-dsv4: its "
        "classical blocks are spans of 128 tokens (m')"
    )


def test_v4_turn_ends_are_off_without_prefix_caching(capsys):
    """A kept turn-end state is found as a prefix hit: without prefix caching none is kept,
    yet the report said "v4_turn_ends": true; given explicitly, the pair is refused."""
    assert main(["run", "--model", "tiny-dsv4", "--no-enable-prefix-caching", "--v4-turn-ends"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        "kvpool run: error: --v4-turn-ends with --no-enable-prefix-caching: a turn-end state is found as a prefix hit"
    )
    small = ("--num-requests", "1", "--max-tokens", "1", "--num-long", "0", "--request-rate", "inf")
    report = _run_json(capsys, "--model", "tiny-dsv4", *small, "--no-enable-prefix-caching")
    assert (report["v4_turn_ends"], report["state_adoptions"], report["prefix_hit_tokens"]) == (False, 0, 0)


@pytest.mark.parametrize("command", ["run", "generate"])
@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--host-cache-gib", "0.01"], "--host-cache-gib"),
        (["--host-cache-gib", "0.01", "--preemption", "swap"], "--host-cache-gib"),
        (["--disk-cache", "DIR"], "--disk-cache"),
        (["--host-cache-gib", "0.01", "--disk-cache", "DIR"], "--host-cache-gib / --disk-cache"),
    ],
)
def test_a_tier_without_prefix_caching_is_refused(capsys, tmp_path, command, flags, named):
    """The runner drops every tier where prefix caching is off (tier_bridge.py): a tier
    flag with --no-enable-prefix-caching was taken, the run went on, and nothing was ever
    stored in the tier (no word of it in the report). The pair is refused in one line."""
    flags = [str(tmp_path / "d") if f == "DIR" else f for f in flags]
    tail = ["--", "1,2,3"] if command == "generate" else []
    assert main([command, "--model", "tiny-dsv4", "--no-enable-prefix-caching", *flags, *tail]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        f"kvpool {command}: error: {named} with --no-enable-prefix-caching: a tier keeps and serves cached prefix "
        "blocks, and without prefix caching nothing is stored in it (drop one of the two)"
    )
    assert not (tmp_path / "d").exists()


def test_run_smollm2_report_follows_its_definitions(capsys):
    report = _run_json(
        capsys,
        *"--num-requests 2 --turns 2 --num-long 0 --max-tokens 4 --request-rate inf --slo-ttft-ms 1e-6".split(),
    )
    # 256 MiB of fp32 K/V blocks: 2 (K, V) x 30 layers x 3 KV heads x 64 dims x 4 bytes x 16 slots
    assert report["num_blocks"] == (256 << 20) // 737_280 == 364
    assert report["kv_capacity_bytes"] == 364 * 737_280 and report["kv_capacity_tokens"] == 364 * 16
    assert report["num_requests"] == 4 and report["num_finished"] == 4
    # the follow-ups hit their own first turns, in whole blocks
    assert report["prefix_hit_tokens"] > 0 and report["prefix_hit_tokens"] % 16 == 0
    assert report["prefix_hit_rate"] == round(report["prefix_hit_tokens"] / report["prefix_queried_tokens"], 4)
    assert 0 <= report["fragmentation"] < 1
    assert report["goodput_req_s"] == 0.0  # nobody meets a TTFT of a nanosecond


def test_bench_attention_times_every_path_after_checking_it(kernels):
    # bench_attention asserts each paged path equals contiguous SDPA before timing it; the
    # native path is the engine's (the kernels fixture fails when the C kernels do not load)
    from kvpool.bench.engine import bench_attention

    report = bench_attention(2, 64, 16, 9, 3, 64)
    paths = {"paged_native_ms", "paged_bags_ms", "paged_padded_ms", "contiguous_sdpa_ms"}
    assert paths <= set(report) and all(report[p] > 0 for p in paths)
    assert report["engine_path"] == "native"


def test_bench_engine_glue_json(capsys):
    threads = torch.get_num_threads()
    try:
        assert main(["bench", "engine", "--parts", "glue", "--json", "--threads", "1"]) == 0
    finally:
        torch.set_num_threads(threads)
    captured = capsys.readouterr()
    glue = json.loads(captured.out)["glue"]
    # stdout is not a terminal here: one progress line per phase on stderr, none on stdout
    assert captured.err == "bench engine: loading the model ...\nbench engine: glue ...\n"
    assert 500 < glue["weight_mb"] < 600  # SmolLM2-135M's layers + the tied LM head, fp32
    timed = ["matmuls_ms", "torch_rms_norm_us", "torch_silu_mul_us", "sample_top_p_ms", "sample_top_p_full_sort_ms"]
    assert all(glue[k] > 0 for k in timed)


def test_bench_engine_refuses_unknown_parts_and_bad_shapes(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "engine", "--parts", "decode,nonsense"])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.endswith(
        "kvpool bench engine: error: argument --parts: unknown 'nonsense' in 'decode,nonsense'; "
        "choose from decode,ttft,attention,glue\n"
    )
    # checked before the model loads
    assert main(["bench", "engine", "--parts", "attention", "--attn-context", "1000"]) == 2
    assert "--attn-context 1000 must be a multiple of 256" in capsys.readouterr().err
    assert main(["bench", "engine", "--model", "tiny-dsv4"]) == 2
    assert "kvpool bench dsv4" in capsys.readouterr().err


def test_ctrl_c_during_run_stops_cleanly_and_reports_what_finished(capsys, monkeypatch):
    # Ctrl-C arrives during the 30th engine step: the run aborts what is left, prints the
    # report of the requests that finished and exits 130, without a traceback.
    from kvpool.engine.engine import Engine

    step = Engine.step
    calls = []

    def interrupted_step(self):
        calls.append(1)
        if len(calls) == 30:
            raise KeyboardInterrupt
        return step(self)

    monkeypatch.setattr(Engine, "step", interrupted_step)
    args = ["run", "--json", "--threads", "1", "--model", "tiny-dsv4", "--num-requests", "6", "--request-rate", "inf"]
    threads = torch.get_num_threads()
    try:
        assert main(args) == 130
    finally:
        torch.set_num_threads(threads)
    captured = capsys.readouterr()
    report = json.loads(captured.out)
    assert report["interrupted"] is True
    assert 0 < report["num_finished"] < report["num_requests"]
    assert "interrupted" in captured.err and "Traceback" not in captured.err
    # (it read "the report covers the 1 requests that finished")
    finished = f"the {report['num_finished']} of {report['num_requests']} requests that finished"
    assert f"kvpool run: interrupted; the report covers {finished}" in captured.err


def test_bench_engine_draws_its_prompts_within_the_vocabulary():
    """The prompts were ids in [100, 49000) whatever the model: a Llama 2 vocabulary (32,000)
    was refused by the engine after the attention and glue parts had run. SmolLM2's (49,152)
    draws the ids it always drew."""
    import random

    from kvpool.bench.engine import _random_ids

    old = random.Random(0)
    assert _random_ids(random.Random(0), 500, 49152) == [old.randrange(100, 49000) for _ in range(500)]
    for vocab in (32000, 467, 3):
        ids = _random_ids(random.Random(1), 2000, vocab)
        assert 0 <= min(ids) and max(ids) < vocab and len(set(ids)) > min(vocab // 4, 100), vocab


def test_bench_engine_loads_an_hf_directory_into_transformers_as_a_directory(tmp_path, monkeypatch):
    """bench engine's transformers side read every model as a GGUF: an HF directory
    (`from_pretrained(dirname, gguf_file=basename)`) was transformers' OSError traceback."""
    import random
    from types import SimpleNamespace

    from kvpool.bench.engine import bench_decode

    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    calls = []

    def from_pretrained(*args, **kwargs):
        calls.append((args, {k: v for k, v in kwargs.items() if k != "dtype"}))
        raise RuntimeError("loaded")

    # (a stand-in for transformers: its import alone takes seconds)
    fake = SimpleNamespace(AutoModelForCausalLM=SimpleNamespace(from_pretrained=from_pretrained))
    monkeypatch.setitem(__import__("sys").modules, "transformers", fake)
    loaded = SimpleNamespace(model=SimpleNamespace(config=SimpleNamespace(vocab_size=467)))
    for model, want in (
        (str(tmp_path / "m"), ((str(tmp_path / "m"),), {})),
        (str(tmp_path / "x.gguf"), ((str(tmp_path),), {"gguf_file": "x.gguf"})),
    ):
        with pytest.raises(RuntimeError, match="loaded"):
            bench_decode(loaded, model, 2, 16, False, random.Random(0))
        assert calls.pop() == want
