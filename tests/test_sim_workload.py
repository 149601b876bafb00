"""Workload generators and the JSONL trace reader (kvpool.workload) the simulator replays.

The prompts are checked against an independent reference built from workload/tokens.py alone
(text_ids / answer_ids, the pure-Python definitions), which also holds the batched twins
(batch_text_ids / batch_answer_ids) to the naive ones.
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.workload import tokens as tokens_module
from kvpool.workload.arrivals import poisson_arrivals
from kvpool.workload.sessions import (
    CHAT_OUTPUT_LEN,
    CHAT_SYSTEM_LEN,
    CHAT_THINK_S,
    CHAT_USER_LEN,
    LogNormal,
    Session,
    Turn,
    Workload,
    agentic_workload,
    chat_workload,
    uniform_workload,
)
from kvpool.workload.tokens import (
    answer_ids,
    batch_answer_ids,
    batch_text_ids,
    stream_key,
    stream_tokens,
    text_ids,
    token_at,
)
from kvpool.workload.trace import load_trace, sample_trace_path

VOCAB = 32_000


def reference_prompt(session: Session, turn: int, vocab_size: int) -> list[int]:
    """Turn `turn`'s prompt from the definition, with the naive answer_ids."""
    ids = list(session.prefix_ids)
    for j in range(turn):
        ids += session.turns[j].user_ids
        ids += answer_ids(session.request_id(j), session.turns[j].output_len, vocab_size)
    return ids + list(session.turns[turn].user_ids)


# --- the batched twins ------------------------------------------------------------------------


@settings(max_examples=40, deadline=None)
@given(
    names=st.lists(st.text(max_size=8), min_size=1, max_size=6),
    lens=st.lists(st.integers(0, 40), min_size=6, max_size=6),
    vocab=st.sampled_from([1, 2, 7, 1000, 151_936]),
)
def test_batched_twins_equal_the_naive_token_streams(names, lens, vocab):
    pairs = list(zip(names, lens[: len(names)], strict=True))
    lens = [k for _, k in pairs]
    assert batch_text_ids(names, lens, vocab) == [tuple(text_ids(n, k, vocab)) for n, k in pairs]
    assert batch_answer_ids(names, lens, vocab) == [answer_ids(n, k, vocab) for n, k in pairs]


@settings(max_examples=40, deadline=None)
@given(
    keys=st.lists(st.integers(0, (1 << 64) - 1), min_size=1, max_size=70),
    lens=st.lists(st.integers(0, 30), min_size=70, max_size=70),
    vocab=st.sampled_from([1, 7, 129_280]),
)
def test_stream_tokens_from_the_step_table_equal_token_at(keys, lens, vocab):
    """stream_tokens' few-stream path (the positions' terms read from tokens._STEPS: up to 64
    streams) and its general path (past 64 streams) give token_at's streams end to end."""
    lens = lens[: len(keys)]
    # (the few-stream path is taken where it says: up to 64 streams, every length in the table)
    assert (tokens_module._few_streams(keys, lens) is not None) == (len(keys) <= 64)
    expected = [token_at(key, p, vocab) for key, n in zip(keys, lens, strict=True) for p in range(n)]
    assert stream_tokens(keys, lens, vocab).tolist() == expected
    assert stream_tokens(keys[:1], lens[:1], vocab).tolist() == expected[: lens[0]]


def test_stream_tokens_past_the_step_table():
    """A stream longer than the table (tokens._STEP_ROWS) takes the general path, alone or
    beside a short one: token_at's tokens, at the table's edge and past it."""
    rows = tokens_module._STEP_ROWS
    for lens in ([rows], [rows + 3], [2, rows + 1], [rows, 1]):
        keys = [stream_key(f"k{i}") for i in range(len(lens))]
        got = stream_tokens(keys, lens, VOCAB)
        starts = [sum(lens[:i]) for i in range(len(lens))]
        for key, n, start in zip(keys, lens, starts, strict=True):
            for p in (0, 1, rows - 1, n - 1):
                if p < n:
                    assert got[start + p] == token_at(key, p, VOCAB), (lens, p)
    with pytest.raises(ValueError):  # a negative length, as np.repeat names it
        stream_tokens([1, 2], [3, -1], VOCAB)
    assert stream_tokens([5], [-2], VOCAB).tolist() == []  # (one stream: an empty range, as before)


def test_batch_text_ids_across_chunks():
    # three streams of 600k tokens: each its own vectorised pass (_CHUNK = 2**20)
    names, lens = ["a", "b", "c"], [600_000, 600_000, 5]
    got = batch_text_ids(names, lens, VOCAB)
    assert [len(t) for t in got] == lens
    for name, ids in zip(names, got, strict=True):
        assert list(ids[:1000]) == text_ids(name, min(1000, len(ids)), VOCAB)
    assert list(got[1][-3:]) == text_ids("b", 600_000, VOCAB)[-3:]


# --- the data model ---------------------------------------------------------------------------


def test_hand_built_session_prompts_and_lengths():
    s = Session("s", 1.5, (Turn((1, 2, 3), 2), Turn((4,), 3, think_s=0.5), Turn((5, 6), 1)))
    a0, a1 = answer_ids("s-t0", 2, 10), answer_ids("s-t1", 3, 10)
    assert s.request_id(2) == "s-t2"
    assert s.prompt_ids(0, 10) == [1, 2, 3]
    assert s.prompt_ids(1, 10) == [1, 2, 3, *a0, 4]
    assert s.prompt_ids(2, 10) == [1, 2, 3, *a0, 4, *a1, 5, 6]
    assert [s.prompt_len(k) for k in range(3)] == [3, 6, 11]
    w = Workload("w", (s, Session("t", 0.0, (Turn((7,) * 20, 1),), prefix_ids=(9,) * 4)), 10)
    assert w.num_requests == 4
    assert w.max_request_len() == 25  # t: 4 + 20 prompt + 1 output (s's longest: 11 + 1)
    with pytest.raises(ValueError, match="turn"):
        s.prompt_ids(3, 10)
    # A caller that kept the previous turn's prompt gets the same list, made from it
    first = s.prompt_ids(0, 10)
    assert s.prompt_ids(1, 10, previous=first) == [1, 2, 3, *a0, 4] and first == [1, 2, 3]
    assert s.prompt_ids(2, 10, previous=s.prompt_ids(1, 10)) == s.prompt_ids(2, 10)
    with pytest.raises(ValueError, match=r"previous holds 3 tokens; prompt_ids\(1\) of session 's' holds 6"):
        s.prompt_ids(2, 10, previous=first)
    with pytest.raises(ValueError, match="no turn -1"):
        s.prompt_ids(0, 10, previous=[])
    with pytest.raises(ValueError, match="output_len"):
        Turn((1,), 0)
    with pytest.raises(ValueError, match="no turns"):
        Session("x", 0.0, ())
    with pytest.raises(ValueError, match="not unique"):
        Workload("w", (s, s), 10)


# --- chat -------------------------------------------------------------------------------------


def test_chat_same_seed_same_workload_other_seed_differs():
    a = chat_workload(30, 3, 2.0, VOCAB, seed=1)
    assert a == chat_workload(30, 3, 2.0, VOCAB, seed=1)
    b = chat_workload(30, 3, 2.0, VOCAB, seed=2)
    assert [s.start_s for s in a.sessions] != [s.start_s for s in b.sessions]
    assert [t.user_ids for s in a.sessions for t in s.turns] != [t.user_ids for s in b.sessions for t in s.turns]


def test_chat_turn_prompt_extends_the_previous_prompt_and_its_answer():
    w = chat_workload(8, 4, math.inf, VOCAB, seed=3)
    assert w.num_requests == 32
    assert all(s.start_s == 0.0 for s in w.sessions)
    for s in w.sessions:
        assert [t.think_s for t in s.turns][0] == 0.0 and all(t.think_s > 0 for t in s.turns[1:])
        for k in range(4):
            prompt = s.prompt_ids(k, VOCAB)
            assert prompt == reference_prompt(s, k, VOCAB)
            assert len(prompt) == s.prompt_len(k)
            if k:
                before = s.prompt_ids(k - 1, VOCAB) + answer_ids(s.request_id(k - 1), s.turns[k - 1].output_len, VOCAB)
                assert prompt[: len(before)] == before
                assert s.prompt_ids(k, VOCAB, previous=s.prompt_ids(k - 1, VOCAB)) == prompt  # the simulator's way
            # the user message is the session's own named text
            user = s.turns[k].user_ids
            assert list(user) == text_ids(f"{s.session_id}-u{k}", len(user), VOCAB)
    assert w.max_request_len() == max(
        s.prompt_len(k) + s.turns[k].output_len for s in w.sessions for k in range(len(s.turns))
    )


def test_chat_sessions_of_one_system_prompt_share_it():
    w = chat_workload(40, 1, 1.0, VOCAB, seed=4, num_system_prompts=3)
    system = [tuple(text_ids(f"system{k}", n, VOCAB)) for k, n in enumerate(w.params["system_lens"])]
    by_prompt: dict[int, list[Session]] = {}
    for s in w.sessions:
        by_prompt.setdefault(system.index(s.prefix_ids), []).append(s)
    assert sorted(by_prompt) == [0, 1, 2]
    for k, group in by_prompt.items():
        assert all(s.prefix_ids is group[0].prefix_ids for s in group)  # one tuple, not copies
        assert all(s.prompt_ids(0, VOCAB)[: len(system[k])] == list(system[k]) for s in group)
    # different system prompts differ from their first tokens on
    assert len({p[:8] for p in system}) == 3


def test_chat_lengths_follow_the_documented_log_normals():
    assert (CHAT_SYSTEM_LEN, CHAT_USER_LEN, CHAT_OUTPUT_LEN) == (
        LogNormal(1000, 0.5, 128, 4096),
        LogNormal(120, 1.0, 4, 4096),
        LogNormal(250, 0.8, 8, 2048),
    )
    w = chat_workload(3000, 2, 10.0, 1000, seed=5)
    turns = [t for s in w.sessions for t in s.turns]
    assert statistics.median(len(t.user_ids) for t in turns) == pytest.approx(120, rel=0.08)
    assert statistics.median(t.output_len for t in turns) == pytest.approx(250, rel=0.08)
    assert statistics.mean(t.think_s for s in w.sessions for t in s.turns[1:]) == pytest.approx(CHAT_THINK_S, rel=0.08)
    assert all(4 <= len(t.user_ids) <= 4096 and 8 <= t.output_len <= 2048 for t in turns)
    # the system prompts: four a workload, so their length law is checked on its own
    system = CHAT_SYSTEM_LEN.sample(np.random.default_rng(0), 20_000)
    assert float(np.median(system)) == pytest.approx(1000, rel=0.05)
    assert system.min() >= 128 and system.max() <= 4096
    assert w.params["user_len"] == {"median": 120, "sigma": 1.0, "lo": 4, "hi": 4096}


def test_poisson_arrivals_mean_gap_is_one_over_rate():
    starts = poisson_arrivals(20_000, 4.0, np.random.default_rng(0))
    gaps = np.diff([0.0, *starts])
    assert (gaps > 0).all()
    assert gaps.mean() == pytest.approx(0.25, rel=0.03)
    assert gaps.std() == pytest.approx(0.25, rel=0.05)  # exponential: std = mean
    assert poisson_arrivals(3, math.inf, np.random.default_rng(0)) == [0.0, 0.0, 0.0]
    assert poisson_arrivals(0, 1.0, np.random.default_rng(0)) == []
    for bad in (0, -1.0, math.nan, "2"):
        with pytest.raises(ValueError, match="rate"):
            poisson_arrivals(3, bad, np.random.default_rng(0))


# --- agentic and uniform ----------------------------------------------------------------------


def test_agentic_shares_long_documents_with_short_follow_ups():
    w = agentic_workload(12, 3, 5.0, VOCAB, seed=6, context_len=(30_000, 60_000))
    assert w == agentic_workload(12, 3, 5.0, VOCAB, seed=6, context_len=(30_000, 60_000))
    lens = w.params["context_lens"]
    assert len(lens) == 4 and all(30_000 <= n <= 60_000 for n in lens)
    docs = {len(s.prefix_ids): s.prefix_ids for s in w.sessions}
    for s in w.sessions:
        assert s.prefix_ids is docs[len(s.prefix_ids)]  # one document object per context
        k = lens.index(len(s.prefix_ids))
        assert list(s.prefix_ids[-50:]) == text_ids(f"doc{k}", lens[k], VOCAB)[-50:]
        assert all(20 <= len(t.user_ids) <= 300 and 20 <= t.output_len <= 400 for t in s.turns)
    s = w.sessions[0]
    assert s.prompt_ids(2, VOCAB) == reference_prompt(s, 2, VOCAB)
    assert w.max_request_len() == max(s.prompt_len(2) + s.turns[2].output_len for s in w.sessions)


def test_agentic_default_contexts_within_30k_200k():
    w = agentic_workload(2, 1, math.inf, 1000, seed=7)
    assert all(30_000 <= n <= 200_000 for n in w.params["context_lens"])
    assert agentic_workload(2, 1, math.inf, 1000, seed=8).params["context_lens"] != w.params["context_lens"]


def test_uniform_lengths_within_ranges_and_prompts_unrelated():
    w = uniform_workload(500, 20.0, VOCAB, seed=9, prompt_len=(10, 50), output_len=(1, 5))
    assert w == uniform_workload(500, 20.0, VOCAB, seed=9, prompt_len=(10, 50), output_len=(1, 5))
    assert w != uniform_workload(500, 20.0, VOCAB, seed=10, prompt_len=(10, 50), output_len=(1, 5))
    prompt_lens = [len(s.turns[0].user_ids) for s in w.sessions]
    output_lens = [s.turns[0].output_len for s in w.sessions]
    assert min(prompt_lens) >= 10 and max(prompt_lens) <= 50 and {min(output_lens), max(output_lens)} == {1, 5}
    assert all(len(s.turns) == 1 and s.prefix_ids == () for s in w.sessions)
    assert len({s.turns[0].user_ids[:4] for s in w.sessions}) == 500
    assert w.max_request_len() == max(p + o for p, o in zip(prompt_lens, output_lens, strict=True))


@pytest.mark.parametrize(
    ("call", "name"),
    [
        (lambda: chat_workload(0, 2, 1.0, VOCAB, 0), "num_sessions"),
        (lambda: chat_workload(2, 0, 1.0, VOCAB, 0), "turns"),
        (lambda: chat_workload(2, 2, 0.0, VOCAB, 0), "rate"),
        (lambda: chat_workload(2, 2, 1.0, 0, 0), "vocab_size"),
        (lambda: chat_workload(2, 2, 1.0, VOCAB, 0, num_system_prompts=0), "num_system_prompts"),
        (lambda: chat_workload(2, 2, 1.0, VOCAB, 0, think_s=-1.0), "think_s"),
        (lambda: agentic_workload(2, 2, 1.0, VOCAB, 0, num_contexts=0), "num_contexts"),
        (lambda: agentic_workload(2, 2, 1.0, VOCAB, 0, context_len=(200, 100)), "context_len"),
        (lambda: agentic_workload(2, 2, 1.0, VOCAB, 0, question_len=(0, 10)), "question_len"),
        (lambda: agentic_workload(2, 2, 1.0, VOCAB, 0, answer_len=(5,)), "answer_len"),
        (lambda: uniform_workload(2.5, 1.0, VOCAB, 0), "num_requests"),
        (lambda: uniform_workload(2, -3.0, VOCAB, 0), "rate"),
        (lambda: uniform_workload(2, 1.0, VOCAB, 0, prompt_len=(1.0, 5)), "prompt_len"),
        (lambda: uniform_workload(2, 1.0, VOCAB, 0, output_len=(0, 5)), "output_len"),
    ],
)
def test_bad_arguments_name_the_parameter(call, name):
    with pytest.raises(ValueError, match=name):
        call()


# --- the trace --------------------------------------------------------------------------------


def write_trace(tmp_path: Path, *lines: object) -> Path:
    path = tmp_path / "trace.jsonl"
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines))
    return path


def test_sample_trace_loads_with_shared_hash_prefixes():
    path = sample_trace_path()
    w = load_trace(path, VOCAB)
    raw = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    assert 30 <= w.num_requests == len(raw) <= 50
    starts = [s.start_s for s in w.sessions]
    assert starts == sorted(starts) and 15 <= starts[-1] <= 30
    assert {s.tenant for s in w.sessions} >= {"acme", "globex", ""}
    assert any("prompt_ids" in r for r in raw) and any("timestamp_ms" in r for r in raw)
    # every hash-id line: len = input_length, each block = its hash id's text
    for s in w.sessions:
        record = raw[int(s.session_id.rsplit("#", 1)[-1].removeprefix("line")) - 1]  # no blank lines
        ids = s.prompt_ids(0, VOCAB)
        if "hash_ids" in record:
            assert len(ids) == record["input_length"]
            for i, h in enumerate(record["hash_ids"]):
                block = ids[i * 512 : (i + 1) * 512]
                assert block == text_ids(f"hash{h}", 512, VOCAB)[: len(block)]
        else:
            assert ids == record["prompt_ids"]
    assert w.max_request_len() == max(
        r.get("input_length", len(r.get("prompt_ids", []))) + r["output_length"] for r in raw
    )


def test_shared_hash_ids_share_tokens_and_different_ids_differ(tmp_path):
    path = write_trace(
        tmp_path,
        {"timestamp": 0.0, "hash_ids": [7, 8, 9], "input_length": 20, "output_length": 4},
        {"timestamp": 1.0, "hash_ids": [7, 8, 5], "input_length": 22, "output_length": 4},
        {"timestamp": 2.0, "hash_ids": [6, 8], "input_length": 16, "output_length": 4},
    )
    a, b, c = (s.prompt_ids(0, VOCAB) for s in load_trace(path, VOCAB, block_size=8).sessions)
    assert (len(a), len(b), len(c)) == (20, 22, 16)
    assert a[:16] == b[:16]  # blocks 7, 8 at positions 0, 1
    assert a[16:20] != b[16:20]  # 9 vs 5
    assert a[:8] != c[:8] and a[8:16] == c[8:16]  # the same id at the same position: same tokens
    assert a[:8] == text_ids("hash7", 8, VOCAB) and b[16:] == text_ids("hash5", 8, VOCAB)[:6]  # the last block cut


def test_a_hash_id_is_made_only_as_long_as_a_line_uses_it(tmp_path, monkeypatch):
    """A block used only as a line's last is made to its longest head, not block_size tokens:
    --trace-block-size 20000000 made 20M tokens (37 s, 0.7 GB) for a 5-token prompt."""
    from kvpool.workload import trace as trace_module

    made: list[list[int]] = []

    def recorded(names, lens, vocab_size):
        made.append(list(lens))
        assert sum(lens) <= 10**6, lens  # (not 10**9 tokens made to find out)
        return batch_text_ids(names, lens, vocab_size)

    monkeypatch.setattr(trace_module, "batch_text_ids", recorded)
    path = write_trace(
        tmp_path,
        {"timestamp": 0.0, "hash_ids": [3], "input_length": 5, "output_length": 1},
        {"timestamp": 1.0, "hash_ids": [3, 4], "input_length": 1002, "output_length": 1},
        {"timestamp": 2.0, "hash_ids": [4], "input_length": 7, "output_length": 1},
    )
    a, b, c = (s.prompt_ids(0, VOCAB) for s in load_trace(path, VOCAB, block_size=1000).sessions)
    assert made == [[1000, 7]]  # 3: a full block in line 2; 4: at most 7 tokens of it
    assert a == text_ids("hash3", 5, VOCAB) and c == text_ids("hash4", 7, VOCAB)
    assert b == text_ids("hash3", 1000, VOCAB) + text_ids("hash4", 2, VOCAB)
    path = write_trace(tmp_path, {**GOOD, "hash_ids": [9], "input_length": 5})
    (one,) = load_trace(path, VOCAB, block_size=10**9).sessions
    assert one.prompt_ids(0, VOCAB) == text_ids("hash9", 5, VOCAB) and made[-1] == [5]


def test_trace_times_sessions_and_order(tmp_path):
    path = write_trace(
        tmp_path,
        {"timestamp": 2.5, "prompt_ids": [1, 2], "output_length": 3, "session": "u", "tenant": "t1"},
        "",
        {"timestamp_ms": 2500, "prompt_ids": [3], "output_length": 1},
        {"timestamp_ms": 1250.5, "prompt_ids": [4], "output_length": 2, "session": "u"},
    )
    w = load_trace(path, 10)
    assert [(s.session_id, s.start_s, s.tenant) for s in w.sessions] == [
        ("u#4", 1.2505, ""),
        ("u#1", 2.5, "t1"),  # equal arrivals keep file order
        ("line3", 2.5, ""),
    ]
    assert [s.prompt_ids(0, 10) for s in w.sessions] == [[4], [1, 2], [3]]
    assert [s.turns[0].output_len for s in w.sessions] == [2, 3, 1]


GOOD = {"timestamp": 1.0, "hash_ids": [1, 2], "input_length": 700, "output_length": 5}


@pytest.mark.parametrize(
    ("bad", "words"),
    [
        ('{"timestamp": 1.0 "x": 2}', "not JSON"),
        # json keeps the last of a repeated key silently: this line arrived at 5 s
        ('{"timestamp": 0, "timestamp": 5, "prompt_ids": [1], "output_length": 1}', "field 'timestamp' is given twice"),
        ("[1, 2]", "JSON object"),
        ({**GOOD, "prompt": "hi"}, "unknown field 'prompt'"),
        ({**GOOD, "output_length": -3}, "output_length must be a positive integer, got -3"),
        ({**GOOD, "output_length": 2.0}, "output_length"),
        ({k: v for k, v in GOOD.items() if k != "output_length"}, "output_length is required"),
        ({**GOOD, "timestamp_ms": 5}, "timestamp_ms"),
        ({k: v for k, v in GOOD.items() if k != "timestamp"}, "timestamp"),
        ({**GOOD, "timestamp": -1}, "timestamp must be"),
        ({**GOOD, "timestamp": "now"}, "timestamp must be"),
        # past 2^33 s a float second steps by >= 2 us: epoch ns as ms gave TTFT / TPOT 0.00 ms
        ({**GOOD, "timestamp": 2.0**33}, "timestamp 8589934592.0 is 8.59e+09 s, past 2^33 s"),
        ({"timestamp_ms": 1.7e18, **{k: v for k, v in GOOD.items() if k != "timestamp"}}, "epoch milliseconds"),
        ({**GOOD, "input_length": 1025}, "input_length"),
        ({**GOOD, "input_length": 512}, "input_length"),
        ({k: v for k, v in GOOD.items() if k != "input_length"}, "input_length is required"),
        ({**GOOD, "hash_ids": []}, "hash_ids"),
        ({**GOOD, "hash_ids": [1, -2]}, "hash_ids[1]"),
        ({**GOOD, "prompt_ids": [1]}, "prompt_ids, hash_ids"),
        ({"timestamp": 0, "prompt_ids": [1, 32000], "output_length": 1}, "prompt_ids[1] = 32000"),
        ({"timestamp": 0, "prompt_ids": [1, "a"], "output_length": 1}, "prompt_ids[1]"),
        ({"timestamp": 0, "prompt_ids": [1], "input_length": 2, "output_length": 1}, "input_length"),
        ({**GOOD, "session": 5}, "session must be a string"),
        ({**GOOD, "tenant": None}, "tenant must be a string"),
    ],
)
def test_bad_trace_line_names_file_line_and_field(tmp_path, bad, words):
    path = write_trace(tmp_path, GOOD, "", bad, GOOD)  # the bad one is physical line 3
    with pytest.raises(ValueError) as info:
        load_trace(path, VOCAB)
    message = str(info.value)
    assert message.startswith(f"{path} line 3: ") and words in message
    assert "\n" not in message


def test_trace_lines_are_split_at_newlines_only(tmp_path):
    """JSON allows U+2028 / U+0085 raw in a string, and str.splitlines cuts there (and at
    \x0b, \x0c): a valid line was "not JSON" and later lines got the wrong numbers."""
    line1 = json.dumps({**GOOD, "session": "a\u2028b\x85c"}, ensure_ascii=False)
    path = tmp_path / "trace.jsonl"
    path.write_text(f"{line1}\r\n{json.dumps(GOOD)}\n", encoding="utf-8")
    w = load_trace(path, VOCAB)
    assert [s.session_id for s in w.sessions] == ["a\u2028b\x85c#1", "line2"]
    path.write_text(f"{line1}\n\x0c\n{json.dumps({**GOOD, 'x': 1})}\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"trace.jsonl line 3: unknown field 'x'"):  # physical line 3
        load_trace(path, VOCAB)


def test_a_trace_that_starts_with_a_byte_order_mark_loads(tmp_path):
    """A UTF-8 BOM (Windows editors write one; JSON readers may ignore it) made line 1 "not JSON
    (Unexpected UTF-8 BOM ...)": it is dropped, and the file loads as without it. A BOM
    anywhere else is no whitespace of JSON: that line is refused, named."""
    plain = write_trace(tmp_path, GOOD, {**GOOD, "timestamp": 2})
    marked = tmp_path / "bom.jsonl"
    marked.write_bytes(b"\xef\xbb\xbf" + plain.read_bytes())
    assert load_trace(marked, VOCAB).sessions == load_trace(plain, VOCAB).sessions
    marked.write_bytes(plain.read_bytes() + b"\xef\xbb\xbf" + json.dumps(GOOD).encode() + b"\n")
    with pytest.raises(ValueError, match=r"bom.jsonl line 3: not JSON"):
        load_trace(marked, VOCAB)


@pytest.mark.parametrize("bom", [b"", b"\xef\xbb\xbf"], ids=["plain", "bom"])
def test_a_trace_of_other_bytes_names_the_byte_and_line(tmp_path, bom):
    """A trace with a byte that is not UTF-8 said Python's words ("cannot read the trace
    ('utf-8' codec can't decode byte 0xff in position 14: invalid start byte)"), no line; a
    directory "[Errno 21] Is a directory: '...'" after the path again."""
    plain = write_trace(tmp_path, GOOD)
    path = tmp_path / "bytes.jsonl"
    head = bom + plain.read_bytes()
    path.write_bytes(head + b"\xff\n")
    with pytest.raises(ValueError) as e:
        load_trace(path, VOCAB)
    assert str(e.value) == f"{path}: the trace is not UTF-8 text (invalid start byte at byte {len(head)}, line 2)"
    with pytest.raises(ValueError) as e:
        load_trace(tmp_path, VOCAB)
    assert str(e.value) == f"{tmp_path}: cannot read the trace (Is a directory)"


def test_trace_arrivals_up_to_2_to_the_33_seconds(tmp_path):
    """Unix epoch seconds load as they are; the last float below 2^33 s is the latest arrival."""
    below = math.nextafter(2.0**33, 0)
    path = write_trace(tmp_path, {**GOOD, "timestamp": 1.7e9}, {**GOOD, "timestamp": below})
    assert [s.start_s for s in load_trace(path, VOCAB).sessions] == [1.7e9, below]


def test_bad_trace_file_and_arguments(tmp_path):
    with pytest.raises(ValueError, match="no such trace file"):
        load_trace(tmp_path / "missing.jsonl", VOCAB)
    with pytest.raises(ValueError, match="no requests"):
        load_trace(write_trace(tmp_path, "", "  "), VOCAB)
    with pytest.raises(ValueError, match="block_size"):
        load_trace(sample_trace_path(), VOCAB, block_size=0)
    with pytest.raises(ValueError, match="vocab_size"):
        load_trace(sample_trace_path(), 0)
