"""`kvpool simulate` from the command line: output paths checked before simulating, error
messages that name the flag and the request, routing, prefix caching off, block-size lists
(contiguous once), and a piped comparison table that is not cut to 80 columns."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from kvpool.cli.main import main

LLAMA = ["--model", "llama-3.1-8b", "--gpu", "h200"]


@pytest.fixture
def no_simulating(monkeypatch):
    """Any call of the simulator fails the test: the checks must come first."""
    import kvpool.sim.simulator

    def refuse(*args, **kwargs):
        raise AssertionError("simulated before the output paths were checked")

    monkeypatch.setattr(kvpool.sim.simulator, "simulate", refuse)


def _one_error_line(capsys) -> str:
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in captured.err, captured.err
    return lines[0]


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        (["--plot", "{file}"], ["--plot '{file}'", "is a file, not a directory"]),
        (["--plot", "{file}/sub"], ["--plot '{file}/sub'", "is a file, not a directory"]),
        (["sweep", "--plot", "{file}"], ["--plot '{file}'", "is a file"]),
        (["sweep", "--out", "{file}/runs.jsonl"], ["--out '{file}/runs.jsonl'", "is a file"]),
        (["sweep", "--out", "{dir}"], ["--out '{dir}'", "a directory"]),
        # one run writes no file: an --out taken silently left the user believing it saved
        (["--out", "{dir}/run.json"], ["--out '{dir}/run.json'", "kvpool simulate sweep", "--json > FILE"]),
    ],
)
def test_a_bad_output_path_is_one_line_before_simulating(tmp_path, capsys, no_simulating, flags, words):
    file = tmp_path / "f"
    file.touch()
    fill = {"file": str(file), "dir": str(tmp_path)}
    jobs = ["--jobs", "1"] if flags[0] == "sweep" else []  # (a sweep-only flag: one run refuses it)
    argv = ["simulate", *[f.format(**fill) for f in flags], *LLAMA, "--requests", "8", *jobs]
    assert main(argv) == 2
    line = _one_error_line(capsys)
    assert all(w.format(**fill) in line for w in words), line
    assert sorted(os.listdir(tmp_path)) == ["f"]  # nothing created


@pytest.mark.parametrize(
    "flags", [["--jobs", "2"], ["--executor", "processes"], ["--ray-address", "x:1"], ["--slo-attainment", "0.5"]]
)
def test_a_sweep_only_flag_in_one_run_is_one_line_naming_it(capsys, no_simulating, flags):
    """One run has no pool, executor or attainment to apply them to: taken silently, they
    left the user believing they did something (--executor processes too: the default, said)."""
    assert main(["simulate", *LLAMA, "--requests", "8", *flags]) == 2
    line = _one_error_line(capsys)
    assert line.startswith(f"kvpool simulate: error: {flags[0]} is a flag of `kvpool simulate sweep`"), line


@pytest.mark.parametrize("flags", [["--requests", "5"], ["--sessions", "2"], ["--requests", "5", "--turns", "2"]])
def test_a_trace_with_a_generated_workloads_count_is_one_line(capsys, no_simulating, flags):
    """A trace replays all its lines: --requests 5 taken silently ran every line of it."""
    from kvpool.workload.trace import sample_trace_path

    trace = str(sample_trace_path())
    assert main(["simulate", *LLAMA, "--trace", trace, *flags]) == 2
    line = _one_error_line(capsys)
    named = " / ".join(f for f in flags if f.startswith("--"))
    assert line.startswith(f"kvpool simulate: error: {named} with --trace: a trace replays every line"), line
    assert f"head -n N {trace}" in line


@pytest.mark.parametrize("flag", ["--trace", "--calibration"])
def test_a_sweep_out_file_that_is_its_input_is_one_line_and_the_input_stays(tmp_path, capsys, no_simulating, flag):
    """--out naming the trace truncated it as the workers began to read it: the trace was lost."""
    from kvpool.sim.gpufit import DATA_DIR, SHIPPED
    from kvpool.workload.trace import sample_trace_path

    source = sample_trace_path() if flag == "--trace" else os.path.join(DATA_DIR, SHIPPED["h200-issue31"])
    given = tmp_path / "input.jsonl"
    given.write_bytes(Path(source).read_bytes())
    before = given.read_bytes()
    out = str(tmp_path / "." / "input.jsonl")  # the same file by another spelling
    assert main(["simulate", "sweep", *LLAMA, flag, str(given), "--jobs", "1", "--out", out]) == 2
    assert _one_error_line(capsys) == (
        f"kvpool simulate: error: --out {out!r} is the {flag} file: the sweep would overwrite its input"
    )
    assert given.read_bytes() == before


def test_a_sweep_of_a_trace_writes_a_new_out_file(tmp_path, capsys):
    """The check above must not stop the common case: --out a file that does not exist yet
    (os.path.samefile of a missing file raised FileNotFoundError, shown as the error)."""
    from kvpool.workload.trace import sample_trace_path

    out = tmp_path / "runs.jsonl"
    argv = ["simulate", "sweep", *LLAMA, "--trace", str(sample_trace_path()), "--jobs", "1", "--out", str(out)]
    assert main(argv) == 0
    (row,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert (row["workload"], row["request_rate"], row["num_requests"]) == ("trace", "trace", 39)


def test_a_trace_with_rates_is_one_line(capsys, no_simulating):
    """Taken silently, --rate 1,2,4 ran the trace once, at its own times."""
    from kvpool.workload.trace import sample_trace_path

    assert main(["simulate", *LLAMA, "--trace", str(sample_trace_path()), "--rate", "1,2,4"]) == 2
    line = _one_error_line(capsys)
    assert line == "kvpool simulate: error: --rate with --trace: a trace replays its own arrival times, once"


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        (
            ["--prompt-len", "4096:8192"],
            "--prompt-len shapes --workload uniform; --workload chat draws its own lengths",
        ),
        (
            ["--workload", "agentic", "--output-len", "1:2"],
            "--output-len shapes --workload uniform; --workload agentic",
        ),
        (["--trace", "{trace}", "--prompt-len", "1:2", "--output-len", "1:2"], "--prompt-len / --output-len shape"),
    ],
)
def test_uniform_lengths_for_another_workload_are_one_line(capsys, no_simulating, flags, words):
    """Taken silently, --prompt-len 4096:8192 left a chat run's lengths as chat draws them."""
    from kvpool.workload.trace import sample_trace_path

    argv = ["simulate", *LLAMA, *[f.format(trace=sample_trace_path()) for f in flags]]
    assert main(argv) == 2
    assert _one_error_line(capsys).startswith(f"kvpool simulate: error: {words}")


def test_an_unwritable_plot_directory_is_one_line(tmp_path, capsys, no_simulating, monkeypatch):
    # (the tests may run as root, whom no mode bit stops: the check's own call says no)
    monkeypatch.setattr(os, "access", lambda path, mode: False)
    assert main(["simulate", *LLAMA, "--requests", "8", "--plot", str(tmp_path / "new" / "plots")]) == 2
    line = _one_error_line(capsys)
    assert f"--plot '{tmp_path / 'new' / 'plots'}'" in line and f"directory '{tmp_path}' is not writable" in line


def test_a_sweep_out_file_that_is_not_writable_is_one_line(tmp_path, capsys, no_simulating, monkeypatch):
    out = tmp_path / "runs.jsonl"
    out.write_text('{"point": 0}\n')
    real_access = os.access
    # (root writes any file: the check's own call says no, for this file only)
    monkeypatch.setattr(os, "access", lambda path, mode: path != str(out) and real_access(path, mode))
    assert main(["simulate", "sweep", *LLAMA, "--requests", "8", "--jobs", "1", "--out", str(out)]) == 2
    assert _one_error_line(capsys) == f"kvpool simulate: error: --out '{out}': the file exists and is not writable"
    assert out.read_text() == '{"point": 0}\n'


def test_a_plot_directory_is_made_only_when_the_run_succeeds(tmp_path, capsys):
    plots = tmp_path / "a" / "plots"
    assert main(["simulate", "--model", "no-such-model", "--plot", str(plots)]) == 2
    assert not (tmp_path / "a").exists()
    assert main(["simulate", *LLAMA, "--requests", "8", "--plot", str(plots), "--json"]) == 0
    capsys.readouterr()
    assert sorted(os.listdir(plots)) == ["kv_occupancy.png", "latency_cdf.png"]  # no temporary left


def _write_trace(path, output_lens: list[int], gap_s: float = 0.0) -> None:
    lines = [
        {"timestamp": i * gap_s, "prompt_ids": [1 + i, 2, 3, 4], "output_length": n} for i, n in enumerate(output_lens)
    ]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))


def test_max_model_len_shorter_than_a_trace_request_names_the_flag_and_the_line(tmp_path, capsys):
    trace = tmp_path / "t.jsonl"
    _write_trace(trace, [100, 5000, 200])
    assert main(["simulate", *LLAMA, "--trace", str(trace), "--max-model-len", "1024"]) == 2
    line = _one_error_line(capsys)
    assert "--max-model-len 1,024" in line and "trace line 2" in line and "5,004 tokens" in line, line


def test_a_max_model_len_past_the_models_positions_is_warned_as_plan_does(capsys):
    # it ran silent (contiguous reserves max_model_len a request); kvpool plan warned
    argv = ["simulate", *LLAMA, "--requests", "4", "--max-model-len", "200000", "--json"]
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert (
        "kvpool simulate: warning: --max-model-len 200,000 is beyond llama-3.1-8b's maximum position 131,072 "
        "(max_position_embeddings)"
    ) in err


def test_a_generated_request_too_long_for_the_model_does_not_speak_of_a_trace(capsys):
    flags = ["--workload", "uniform", "--prompt-len", "9000:9000", "--output-len", "10:10", "--requests", "4"]
    assert main(["simulate", "--model", "smollm2-135m", *flags]) == 2
    line = _one_error_line(capsys)
    assert "request req0-t0 needs 9,010 tokens" in line and "holds 8,192" in line, line
    assert "trace" not in line


def _replica_tokens(report: dict) -> list[int]:
    return [r["generated_tokens"] for r in report["per_replica"]]


def test_least_loaded_spreads_what_round_robin_piles_on_one_replica(tmp_path, capsys):
    """Long and short requests alternate, 0.1 s apart: round-robin sends every long one to
    replica 0; least-loaded sees replica 1 idle again (its short request done) and sends
    the next long one there."""
    trace = tmp_path / "t.jsonl"
    _write_trace(trace, [2000, 2] * 6, gap_s=0.1)
    reports = {}
    for routing in ("round-robin", "least-loaded"):
        argv = ["simulate", *LLAMA, "--trace", str(trace), "--replicas", "2", "--routing", routing, "--json"]
        assert main(argv) == 0
        reports[routing] = json.loads(capsys.readouterr().out)
    rr, ll = reports["round-robin"], reports["least-loaded"]
    assert (rr["routing"], ll["routing"]) == ("round-robin", "least-loaded")
    assert _replica_tokens(rr) == [12_000, 12]
    assert all(r["num_requests"] > 0 for r in ll["per_replica"])
    assert max(_replica_tokens(ll)) <= 0.75 * sum(_replica_tokens(ll)), _replica_tokens(ll)


def test_no_prefix_caching_hits_nothing(capsys):
    hits = {}
    for flags in ([], ["--no-prefix-caching"]):
        assert main(["simulate", *LLAMA, "--requests", "24", "--json", *flags]) == 0
        report = json.loads(capsys.readouterr().out)
        hits[bool(flags)] = (report["prefix_hit_rate"], report["prefix_hit_tokens"])
    assert hits[True] == (0, 0)
    assert hits[False][0] > 0.3  # chat shares system prompts: the flag is what turned the hits off


def test_v4_without_prefix_caching_reports_no_turn_end_states(capsys):
    turn_ends = {}
    for flags in ([], ["--no-enable-prefix-caching"]):
        v4 = ["--model", "deepseek-v4-flash", "--gpu", "h200", "--requests", "8", "--json"]
        assert main(["simulate", *v4, *flags]) == 0
        report = json.loads(capsys.readouterr().out)
        turn_ends[bool(flags)] = (report["v4_turn_ends"], report["state_adoptions"])
    assert turn_ends[True] == (False, 0)  # no prefix cache: no state kept for a next turn
    assert turn_ends[False][0] is True


def test_v4s_settings_are_null_in_a_run_without_the_dual_pool(capsys, monkeypatch):
    # they were "auto" / true from the config on every model (llama, gpt-oss, P/D, V4 paged)
    argv = ["simulate", "--model", "deepseek-v4-flash", "--gpu", "h200", "--requests", "8"]
    assert main([*argv, "--layout", "dual,paged", "--json"]) == 0
    runs = {r["layout"]: r for r in json.loads(capsys.readouterr().out)["runs"]}
    assert (runs["dual"]["v4_restore"], runs["dual"]["v4_turn_ends"]) == ("auto", True)
    assert (runs["paged"]["v4_restore"], runs["paged"]["v4_turn_ends"]) == (None, None)
    assert main(["simulate", *LLAMA, "--requests", "8", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert (report["v4_restore"], report["v4_turn_ends"], report["state_adoptions"]) == (None, None, 0)
    monkeypatch.setenv("COLUMNS", "200")
    assert main(["simulate", *LLAMA, "--requests", "8"]) == 0
    rows = [line.split("│")[1:3] for line in capsys.readouterr().out.splitlines() if "v4_" in line]
    assert [(name.strip(), value.strip()) for name, value in rows] == [("v4_restore", "n/a"), ("v4_turn_ends", "n/a")]


def test_a_block_size_list_runs_each_and_contiguous_once(capsys):
    flags = ["--requests", "24", "--layout", "paged,contiguous", "--block-size", "16,32", "--json"]
    assert main(["simulate", *LLAMA, *flags]) == 0
    runs = json.loads(capsys.readouterr().out)["runs"]
    assert [(r["layout"], r["block_size"]) for r in runs[:2]] == [("paged", 16), ("paged", 32)]
    assert [r["layout"] for r in runs] == ["paged", "paged", "contiguous"]
    assert runs[0]["num_blocks"] == pytest.approx(2 * runs[1]["num_blocks"], rel=0.01)


def test_a_sweep_holds_no_duplicate_contiguous_runs(tmp_path, capsys):
    out = tmp_path / "runs.jsonl"
    flags = ["--layout", "paged,contiguous", "--block-size", "16,32", "--rate", "2,8", "--requests", "12"]
    assert main(["simulate", "sweep", *LLAMA, *flags, "--out", str(out), "--jobs", "1"]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    keys = [(r["layout"], r["block_size"] if r["layout"] == "paged" else "-", r["request_rate"]) for r in rows]
    assert keys == [
        ("paged", 16, 2.0),
        ("paged", 16, 8.0),
        ("paged", 32, 2.0),
        ("paged", 32, 8.0),
        ("contiguous", "-", 2.0),
        ("contiguous", "-", 8.0),
    ]


def test_a_piped_comparison_table_is_not_cut_to_80_columns(capsys, monkeypatch):
    monkeypatch.delenv("COLUMNS", raising=False)
    assert main(["simulate", *LLAMA, "--requests", "12", "--layout", "paged,contiguous"]) == 0
    out = capsys.readouterr().out
    assert "…" not in out and "sim_wall_s" in out and "contiguous" in out, out
    assert max(len(line) for line in out.splitlines()) > 80


def test_the_title_names_the_deployment_in_words():
    from kvpool.sim.deployment import count_words, deployment_words

    assert count_words(1, "request") == "1 request" and count_words(1200, "request") == "1,200 requests"
    assert deployment_words(1, 1, "H200") == "1 H200"
    assert deployment_words(2, 4, "H200") == "8 H200 (2 replicas of TP 4)"
    assert deployment_words(1, 8, "B200") == "8 B200 (1 replica of TP 8)"


def test_no_v4_turn_ends_hits_as_paging_does_and_the_report_says_so(capsys):
    # A V4 chat run: the dual pool's hits beyond paging's (at span boundaries) are the kept
    # turn-end states its follow-up turns adopt; switched off, it hits exactly where paging does.
    runs = {}
    for flags in ([], ["--no-v4-turn-ends"]):
        argv = ["simulate", "--model", "deepseek-v4-flash", "--gpu", "h200", "--requests", "100"]
        assert main([*argv, "--layout", "dual,paged", "--json", *flags]) == 0
        runs[bool(flags)] = {r["layout"]: r for r in json.loads(capsys.readouterr().out)["runs"]}
    off, on = runs[True], runs[False]
    assert off["dual"]["v4_turn_ends"] is False and on["dual"]["v4_turn_ends"] is True
    assert off["dual"]["state_adoptions"] == 0 < on["dual"]["state_adoptions"]
    assert off["dual"]["prefix_hit_tokens"] == off["paged"]["prefix_hit_tokens"] == on["paged"]["prefix_hit_tokens"]
    assert on["dual"]["prefix_hit_tokens"] > on["paged"]["prefix_hit_tokens"]
    assert off["paged"]["state_adoptions"] == 0


@pytest.mark.parametrize(("flag", "value"), [("--num-long", "-3"), ("--seed", "-1")])
def test_bench_sim_refuses_negative_counts_and_seeds_as_kvpool_run_does(flag, value, capsys, monkeypatch):
    # -3 long prompts silently ran none; random.Random(-1) draws what Random(1) draws
    import kvpool.engine.build

    def load_model(*args, **kwargs):
        raise AssertionError(f"{flag} {value} was taken: the bench began")

    monkeypatch.setattr(kvpool.engine.build, "load_model", load_model)
    with pytest.raises(SystemExit) as stop:
        main(["bench", "sim", flag, value])
    assert stop.value.code == 2
    assert f"argument {flag}: expected an integer >= 0, got -" in capsys.readouterr().err


def test_bench_sim_says_on_stderr_which_phase_of_its_minutes_it_is_in(capsys, monkeypatch):
    """It printed nothing for minutes (the engine's step times, twice, and the engine's run):
    each phase is one stderr line when stdout is not a terminal, stdout keeps the report. A
    fit that fails after the phases ends in its one line, status 1 (a busy machine's)."""
    import kvpool.engine.build
    from kvpool.bench import sim as bench_sim
    from kvpool.sim import calibrate

    class Loaded:
        class tokenizer:
            encode_chat = staticmethod(lambda messages: [1, 2, 3])

        class model:
            class config:
                vocab_size = 49152

    monkeypatch.setattr(kvpool.engine.build, "load_model", lambda *a, **k: Loaded)
    monkeypatch.setattr(calibrate, "time_engine_steps", lambda *a, **k: "times")
    monkeypatch.setattr(bench_sim, "_run_engine", lambda loaded, workload: {})

    def fit_engine(times):
        raise RuntimeError("the step times fit no cost model")

    monkeypatch.setattr(calibrate, "fit_engine", fit_engine)
    monkeypatch.setattr(calibrate.EngineStepTimes, "mean", staticmethod(lambda a, b: a))
    assert main(["bench", "sim", "--requests", "3", "--num-long", "1", "--json"]) == 1
    out, err = capsys.readouterr()
    assert out == ""
    assert err.splitlines() == [
        "bench sim: loading SmolLM2-135M ...",
        "bench sim: the engine's step times for the fit, before the run (1 of 4) ...",
        "bench sim: the engine on the workload's 4 requests (2 of 4) ...",
        "bench sim: the engine's step times for the fit, after the run (3 of 4) ...",
        "kvpool bench sim: the step times fit no cost model",
    ]


@pytest.mark.parametrize("mode", ["run", "sweep"])
def test_an_infinite_rate_is_written_as_json_can_read_it(mode, tmp_path, capsys):
    """--rate inf wrote "rate": Infinity into workload_params: no JSON (JSON.parse, Go and a
    strict Python reader refuse it); request_rate was already the string "inf"."""

    def refuse(constant: str):
        raise AssertionError(f"{constant} is no JSON")

    flags = [
        "--workload",
        "uniform",
        "--requests",
        "2",
        "--prompt-len",
        "10:20",
        "--output-len",
        "2:3",
        "--rate",
        "inf",
    ]
    out = tmp_path / "runs.jsonl"
    extra = ["--json"] if mode == "run" else ["--jobs", "1", "--out", str(out)]
    assert main(["simulate", *([mode] if mode == "sweep" else []), *LLAMA, *flags, *extra]) == 0
    text = capsys.readouterr().out if mode == "run" else out.read_text()
    report = json.loads(text.splitlines()[0], parse_constant=refuse)
    assert report["workload_params"]["rate"] == report["request_rate"] == "inf"


@pytest.mark.parametrize("flag", ["--trace", "--plot", "--out"])
def test_an_empty_path_is_one_line(flag, capsys, no_simulating):
    """--trace "$TRACE" with TRACE unset simulated the chat workload, silently; --plot "" drew
    nothing and sweep --out "" printed to stdout."""
    mode = ["sweep", "--jobs", "1"] if flag == "--out" else []
    assert main(["simulate", *mode, *LLAMA, flag, ""]) == 2
    assert _one_error_line(capsys) == f"kvpool simulate: error: {flag}: an empty path ('')"


@pytest.mark.parametrize(
    ("flags", "line"),
    [
        (
            ["--load-cap", "0.5"],
            "kvpool simulate: error: argument --load-cap: expected a finite number >= 1, got '0.5'",
        ),
        (
            ["--model", "deepseek-v4-flash", "--v4-restore", "checkpoint", "--v4-checkpoints", "0"],
            "kvpool simulate: error: --v4-restore checkpoint with --v4-checkpoints 0: no slot to keep a checkpoint in",
        ),
    ],
)
def test_a_bad_value_names_its_flag(flags, line, capsys, no_simulating):
    """These named the simulator's field instead ('load_cap must be >= 1', "restore='checkpoint'
    needs num_checkpoints > 0")."""
    try:
        code = main(["simulate", "--requests", "2", *flags])
    except SystemExit as stop:
        code = stop.code
    assert code == 2
    assert _one_error_line(capsys).startswith(line)


def test_a_block_too_large_for_the_pool_is_named_not_the_tensor_parallelism(capsys, no_simulating):
    """--block-size 4096: 256 running requests x a 512 MiB block of copy-on-write reserve leave
    no pool; the line said 'raise --tensor-parallel-size', which the weights did not need."""
    assert main(["simulate", *LLAMA, "--requests", "2", "--block-size", "4096"]) == 2
    assert _one_error_line(capsys) == (
        "kvpool simulate: error: llama-3.1-8b leaves no KV pool on 1 x H200 (weights 15.0 GiB per device): the "
        "copy-on-write reserve, one block of 4096 tokens for each of the planner's 256 running requests, takes "
        "128.0 GiB: lower --block-size"
    )


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (["--v4-checkpoints", "5"], "--v4-checkpoints needs a DeepSeek-V4 model (the dual layout's state pool); "),
        (["--v4-restore", "auto"], "--v4-restore needs a DeepSeek-V4 model (the dual layout's state pool); "),
        (["--no-v4-turn-ends"], "--no-v4-turn-ends needs a DeepSeek-V4 model (the dual layout's state pool); "),
        (
            ["--v4-restore", "checkpoint", "--v4-turn-ends"],
            "--v4-restore / --v4-turn-ends need a DeepSeek-V4 model (the dual layout's state pool); ",
        ),
    ],
)
def test_v4_flags_on_a_model_without_the_dual_layout_are_one_line(capsys, no_simulating, flags, expected):
    """Taken silently, --v4-checkpoints 5 on llama-3.1-8b changed nothing."""
    assert main(["simulate", *LLAMA, "--requests", "8", *flags]) == 2
    assert _one_error_line(capsys) == f"kvpool simulate: error: {expected}llama-3.1-8b has gqa attention"
    sweep = ["simulate", "sweep", "--model", "llama-3.1-8b,qwen3-8b", "--requests", "8", "--jobs", "1", *flags]
    assert main(sweep) == 2
    assert _one_error_line(capsys) == (
        f"kvpool simulate: error: {expected}llama-3.1-8b has gqa attention; qwen3-8b has gqa attention"
    )


def test_v4_flags_on_v4_with_a_layout_that_keeps_no_state_are_one_line(capsys, no_simulating):
    argv = ["simulate", "--model", "deepseek-v4-flash", "--layout", "paged", "--requests", "8", "--v4-checkpoints", "5"]
    assert main(argv) == 2
    assert _one_error_line(capsys) == (
        "kvpool simulate: error: --v4-checkpoints needs the dual layout (DeepSeek-V4's state pool); --layout paged"
    )


def test_a_sweep_holding_a_v4_model_takes_the_v4_flags(monkeypatch):
    """The grid's V4 points take them; its other models have no state to restore."""
    seen = []
    monkeypatch.setattr("kvpool.cli.sweep.run_sweep", lambda args, options, points: seen.append(options) or 0)
    argv = [
        "simulate",
        "sweep",
        "--model",
        "llama-3.1-8b,deepseek-v4-flash",
        "--requests",
        "8",
        "--v4-checkpoints",
        "5",
    ]
    assert main(argv) == 0
    assert seen[0].v4_checkpoints == 5 and seen[0].v4_restore == "auto" and seen[0].v4_turn_ends is True


def test_jobs_help_says_what_it_counts_under_each_executor(capsys, monkeypatch):
    # it said "parallel processes" only: under Ray it is local mode's CPUs, a cluster's own otherwise
    monkeypatch.setenv("COLUMNS", "400")
    with pytest.raises(SystemExit):
        main(["simulate", "--help"])
    jobs = next(line for line in capsys.readouterr().out.splitlines() if line.strip().startswith("--jobs"))
    assert "1: in this process" in jobs and "Ray's CPUs in local mode" in jobs and "--ray-address cluster" in jobs
