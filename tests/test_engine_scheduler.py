"""The scheduler's paths on a model-free runner: the real FullAttentionManager behind the
ModelRunner protocol, and a "model" whose next token is a function of the whole prefix, so
a sequence that was preempted and recomputed, or scheduled with other neighbours, must
produce exactly the tokens it produces alone. Fast: no tensors beyond the logits rows."""

from __future__ import annotations

import functools
import gc
import operator
import random
import signal
from collections.abc import Sequence

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from kvpool.cache import CacheDescriptor, FullAttentionManager
from kvpool.engine.batch_sampler import BatchSampler
from kvpool.engine.engine import Engine, EngineStats, RequestState, SequenceState, _DecodeColumns, _leads
from kvpool.engine.runner import ScheduledChunk, StepChunks, step_columns
from kvpool.engine.sampling import NonFiniteLogitsError, SamplingParams

VOCAB = 97


class PrefixModelRunner:
    """Greedy next token = (sum of the prefix's token ids * 31 + length) % VOCAB, computed
    from what the cache says the sequence holds (so a wrong prefix shows as a wrong token)."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.cache = FullAttentionManager(num_blocks, block_size, CacheDescriptor("prefix-model"))
        self.vocab_size = VOCAB
        self.capacity_tokens = num_blocks * block_size
        self.max_model_len = self.capacity_tokens
        self.num_planned = 0  # steps whose chunks came with the engine's columns (StepChunks)

    def admit(
        self, request_id, token_ids, max_new_tokens, *, tenant_salt="", prompt=None, check_packing=True, share_ids=False
    ):
        return self.cache.admit(
            request_id,
            token_ids,
            max_new_tokens,
            tenant_salt=tenant_salt,
            prompt=prompt,
            check_packing=check_packing,
            share_ids=share_ids,
        )

    def reserve_step(self, request_ids, num_new_tokens):
        return self.cache.reserve_step(request_ids, num_new_tokens)

    def append_token_ids(self, request_id, token_ids):
        self.cache.append_token_ids(request_id, token_ids)

    def execute(self, chunks: Sequence[ScheduledChunk]) -> torch.Tensor:
        if type(chunks) is StepChunks:
            # the columns the engine gave are the chunks' own: step_columns reads them, and
            # its twin (the chunks transposed) gives the same ids, starts and ends
            self.num_planned += 1
            columns = [list(column) for column in step_columns(chunks)]
            assert columns == [list(column) for column in step_columns(list(chunks))]
            assert columns == [
                [c.request_id for c in chunks],
                [c.start for c in chunks],
                [c.start + len(c.token_ids) for c in chunks],
            ]
        self.cache.take_copies()
        tables = self.cache.step_tables(
            [c.request_id for c in chunks], [c.start for c in chunks], [c.start + len(c.token_ids) for c in chunks]
        )
        assert len(tables.slots) == sum(len(c.token_ids) for c in chunks)
        rows = []
        for c in chunks:
            if c.needs_logits:
                prefix = self.cache.token_ids(c.request_id)[: c.start] + c.token_ids
                row = torch.zeros(VOCAB)
                row[(sum(prefix) * 31 + len(prefix)) % VOCAB] = 1.0
                rows.append(row)
        return torch.stack(rows) if rows else torch.zeros(0, VOCAB)

    def commit_step(self, request_ids, num_tokens, next_token_ids):
        self.cache.commit_step(request_ids, num_tokens, next_token_ids)

    def fork(self, parent_id, child_id):
        return self.cache.fork(parent_id, child_id)

    def release(self, request_id, reason):
        return self.cache.release(request_id, reason)

    def num_computed_tokens(self, request_id):
        return self.cache.num_computed_tokens(request_id)

    def num_allocations(self):
        return self.cache.pool.num_allocated

    def kv_read_bytes(self, num_context_tokens):
        return num_context_tokens

    def usage(self):
        return self.cache.usage()

    def check_integrity(self):
        self.cache.check_integrity()

    def cache_stats(self):
        return {}


def expected(prompt: list[int], n: int) -> list[int]:
    out, seq = [], list(prompt)
    for _ in range(n):
        token = (sum(seq) * 31 + len(seq)) % VOCAB
        out.append(token)
        seq.append(token)
    return out


def run(engine: Engine) -> None:
    while engine.has_unfinished():
        engine.step()
        engine.runner.check_integrity()


def test_a_sequence_that_preempts_itself_resumes_with_the_same_tokens():
    # 4 blocks of 4: a and b (5-token prompts, 2 blocks each) both run, then cannot both
    # grow; b, the later one, is the victim of its own reservation and recomputes later.
    runner = PrefixModelRunner(4, 4)
    engine = Engine(runner, max_num_batched_tokens=32)
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    prompts = [[1, 2, 3, 4, 5], [9, 8, 7, 6, 5]]
    ids = [engine.add_request(p, params) for p in prompts]
    engine.step()
    assert len(engine.running) == 2
    run(engine)
    assert engine.num_preemptions > 0
    for rid, prompt in zip(ids, prompts, strict=True):
        assert engine.output(rid).completions[0].token_ids == expected(prompt, 8)
    assert runner.cache.num_free_blocks == 4 and not runner.cache._preempted


def test_an_aborted_sequence_that_waits_after_preemption_leaves_nothing_behind():
    runner = PrefixModelRunner(4, 4)
    engine = Engine(runner, max_num_batched_tokens=32)
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    a = engine.add_request([1, 2, 3, 4, 5], params)
    b = engine.add_request([9, 8, 7, 6, 5], params)
    for _ in range(20):
        if engine.num_preemptions:
            break
        engine.step()
    assert engine.num_preemptions == 1
    (victim,) = [s for s in engine.waiting]
    assert victim.request.request_id == b and victim.seq_id in runner.cache._preempted
    assert engine.abort(b)
    assert not runner.cache._preempted and b + "/0" not in runner.cache
    run(engine)
    assert engine.output(a).completions[0].token_ids == expected([1, 2, 3, 4, 5], 8)
    assert engine.output(b).completions[0].finish_reason == "abort"
    assert runner.cache.num_free_blocks == 4


def test_a_popped_request_is_freed_without_the_cyclic_collector():
    # A request and its sequences refer to each other; once popped, refcounting alone must
    # free them (the collector is off here), forks included: nothing of them stays tracked.
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    try:
        engine = Engine(PrefixModelRunner(16, 4), max_num_batched_tokens=64)
        a = engine.add_request([1, 2, 3, 4, 5], SamplingParams(max_tokens=3, ignore_eos=True), "popped-a")
        b = engine.add_request(list(range(1, 11)), SamplingParams(max_tokens=4, n=3, ignore_eos=True), "popped-b")
        run(engine)
        engine.step()  # an idle step: the engine lets go of the last step's sequences
        out_a, out_b = engine.pop_output(a), engine.pop_output(b)
        left = [
            o
            for o in gc.get_objects()
            # (type(), not isinstance(): isinstance reads `__class__`, which a deprecated torch object
            # answers with a FutureWarning)
            if (type(o) is RequestState and o.request_id in (a, b))
            or (type(o) is SequenceState and o.seq_id.split("/")[0] in (a, b))
        ]
        assert left == []
    finally:
        if enabled:
            gc.enable()
    assert out_a.completions[0].token_ids == expected([1, 2, 3, 4, 5], 3)
    assert [c.token_ids for c in out_b.completions] == [expected(list(range(1, 11)), 4)] * 3
    assert a not in engine.requests and b not in engine.requests


def test_parallel_samples_share_the_prompt_and_match_their_solo_runs():
    # Greedy: all three samples are the same sequence; the prompt is computed once (forks).
    runner = PrefixModelRunner(16, 4)
    engine = Engine(runner, max_num_batched_tokens=64)
    rid = engine.add_request(list(range(1, 11)), SamplingParams(max_tokens=5, n=3, ignore_eos=True))
    run(engine)
    out = engine.output(rid)
    assert [c.token_ids for c in out.completions] == [expected(list(range(1, 11)), 5)] * 3
    assert runner.cache.stats.num_requests == 1  # the children never went through admission
    assert runner.cache.num_free_blocks == 16


def _decode_text(ids: list[int]) -> str:
    return "".join(chr(97 + t % 26) for t in ids)


def test_a_request_failed_by_one_sample_takes_no_token_for_its_others_in_a_decode_step():
    # n = 2: both samples decode in one step; the first one's acceptance raises. With
    # contain_request_faults the request fails alone, with that first error, and its other
    # sample is not accepted after it (as in step's general loop)
    runner = PrefixModelRunner(12, 4)
    engine = Engine(runner, max_num_batched_tokens=24, max_num_seqs=6, batched_sampling=True)
    engine.contain_request_faults = True
    bad = engine.add_request([1, 2, 3], SamplingParams(max_tokens=8, ignore_eos=True, n=2))
    good = engine.add_request([4, 5, 6], SamplingParams(max_tokens=8, ignore_eos=True))
    while len(engine.requests[bad].seqs) < 2 or engine.requests[bad].seqs[0].request.first_token_time is None:
        engine.step()
    calls: list[int] = []
    accept = engine._accept_token

    def failing(seq, *args):
        if seq.request.request_id == bad:
            calls.append(seq.seq_id)
            raise RuntimeError(f"sample {len(calls)} broke")
        return accept(seq, *args)

    engine._accept_token = failing
    finished = engine.step()
    assert bad in finished and len(calls) == 1
    assert engine.output(bad).error.startswith("RuntimeError: sample 1 broke")
    run(engine)
    assert len(engine.output(good).completions[0].token_ids) == 8


def _twin_engine(runner, max_model_len: int, max_num_batched_tokens: int, batched: bool, inline: bool) -> Engine:
    """An engine of the twin tests below: EOS ids 3, 5 and 40, text by `_decode_text`, 6
    sequences at most; `inline` False takes every token through `_accept_token` (the twin)."""
    runner.max_model_len = max_model_len
    engine = Engine(
        runner,
        max_num_batched_tokens=max_num_batched_tokens,
        max_num_seqs=6,
        eos_token_ids=(3, 5, 40),
        decode_text=_decode_text,
        batched_sampling=batched,
    )
    engine.inline_decode = inline
    return engine


def test_the_inline_decode_path_equals_accept_token():
    # Engine.step takes a plain request's decode tokens inline; `inline_decode = False` sends
    # every token through `_accept_token` and `_stop_reason`'s checks in full (neither
    # shortcut for a token that ends nothing). Both must give the same outputs on random requests:
    # EOS (ignored or not), stop strings over decoded text, max_tokens, max_model_len, n > 1,
    # logprobs, seeded temperature sampling, batched sampling or not, a small pool (preemption).
    # Cases 12 on are plain requests only (one sample, no logprobs, no stop strings): their
    # batched decode steps, and a mixed step's leading decode rows, take `_take_inline_tokens`,
    # rows ending by EOS and by length among them.
    rng = random.Random(7)
    for case in range(18):
        batched = case % 2 == 1
        plain = case >= 12
        requests = []
        for _ in range(10):
            params = SamplingParams(
                max_tokens=rng.randint(1, 14),
                temperature=rng.choice([0.0, 0.9]),
                seed=rng.randrange(1000),
                ignore_eos=rng.random() < 0.3,
                stop=() if plain else tuple(rng.sample(["ab", "k", "zq", "e"], rng.randint(0, 2))),
                n=1 if plain else rng.choice([1, 1, 1, 2]),
                logprobs=None if plain else rng.choice([None, None, 2]),
            )
            requests.append(([rng.randrange(VOCAB) for _ in range(rng.randint(1, 9))], params))
        outputs = []
        for inline in (True, False):
            runner = PrefixModelRunner(12, 4)
            engine = _twin_engine(runner, 16, 24, batched, inline)
            taken = []  # the decode steps `step` took through `_take_decode_tokens`
            take = engine._take_decode_tokens
            engine._take_decode_tokens = lambda *args, take=take, taken=taken: taken.append(1) or take(*args)
            passes = []  # whether each call took some rows inline (a decode step's or a mixed step's leading rows)
            take_inline = engine._take_inline_tokens

            def take_inline_rows(*args, take=take_inline, passes=passes):
                taken = take(*args)
                passes.append(bool(taken))
                return taken

            engine._take_inline_tokens = take_inline_rows
            ids = [engine.add_request(prompt, params) for prompt, params in requests]
            run(engine)
            assert bool(taken) == (inline and batched), case  # the decode step's loop ran where it holds
            assert any(passes) == (inline and batched) or not plain, case
            outs = [engine.output(rid) for rid in ids]
            outputs.append([[(c.token_ids, c.text, c.finish_reason) for c in o.completions] for o in outs])
            outputs[-1].append([s.logprobs for rid in ids for s in engine.requests[rid].seqs])
            outputs[-1].append([engine.stats.num_decode_tokens, engine.stats.num_prefill_tokens])
        assert outputs[0] == outputs[1], case
        assert any(len(c[0]) > 3 for out in outputs[0][:-2] for c in out)  # decodes happened


def test_a_step_sampler_samples_batched_steps_only():
    # a step sampler without batched sampling would never be called: the engine says so
    with pytest.raises(ValueError, match="step_sampler samples batched steps: pass batched_sampling=True"):
        Engine(PrefixModelRunner(12, 4), step_sampler=BatchSampler())


def test_a_decode_steps_chunks_are_each_sequences_chunk():
    # _plan_running builds a decode step's chunks, ids and counts in list comprehensions (and
    # the leading rows' from the columns the engine keeps); `_chunk`, one sequence at a time,
    # is its twin: the same tuples, at every step of random requests (prompts prefilled in
    # pieces, decodes, finishes, preemption); and over a small budget, the same plan as the
    # sequences one by one in order, each its rest or what the budget leaves
    rng = random.Random(3)
    runner = PrefixModelRunner(12, 4)
    engine = Engine(runner, max_num_batched_tokens=10, max_num_seqs=5, batched_sampling=True)
    for _ in range(12):
        prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 12))]
        engine.add_request(prompt, SamplingParams(max_tokens=rng.randint(1, 10), ignore_eos=True))
    num_whole = num_columns = num_cut = 0
    while engine.has_unfinished():
        running = list(engine.running)
        rests = [len(seq.token_ids) - seq.num_computed for seq in running]
        seqs, ids, counts, chunks = engine._plan_running(10**6)
        assert seqs == running and ids == [seq.seq_id for seq in running] and counts == rests
        assert chunks == [Engine._chunk(seq, n) for seq, n in zip(running, rests, strict=True)]
        assert all(type(c) is ScheduledChunk for c in chunks)
        if engine._plan_columns is not None:  # the leading rows planned from the last step's columns
            lead = running[: len(engine._plan_columns.seqs)]
            assert engine._plan_ends == [seq.num_computed + 1 for seq in lead] == [len(s.token_ids) for s in lead]
            num_columns += 1
        for budget in (3, 6):  # over budget: each sequence in order its rest or what is left, then none
            plan, left = [], budget
            for seq, rest in zip(running, rests, strict=True):
                if left > 0:
                    plan.append((seq, min(rest, left)))
                    left -= min(rest, left)
            seqs, ids, counts, chunks = engine._plan_running(budget)
            assert seqs == [seq for seq, _ in plan] and ids == [seq.seq_id for seq in seqs]
            assert counts == [n for _, n in plan] and chunks == [Engine._chunk(seq, n) for seq, n in plan]
            num_cut += engine._plan_columns is not None and sum(rests) > budget
        num_whole += bool(running)
        engine.step()
        runner.check_integrity()
    assert num_whole > 20 and engine.stats.num_decode_tokens > 30 and num_columns > 5 and num_cut > 5


def _check_columns(engine: Engine, read: bool = False) -> None:
    """The engine's decode columns (if any) describe the leading running sequences as they
    are, and hold the computed counts of their rows alone (each row's `owner` the engine;
    no other sequence's). Without reading the sequences' `num_computed` (a read writes the
    columns' counts back into the rows, so a run checked here takes the engine's own
    write-backs), unless `read`: then each sequence's count as read is the true one."""
    cols = engine._columns
    assert engine._owned is cols
    owned = set() if cols is None else set(map(id, cols.seqs))
    seqs = [seq for req in engine.requests.values() for seq in req.seqs] + list(engine.waiting)
    assert all((seq.owner is engine) == (id(seq) in owned) for seq in seqs + list(engine.running))
    if read:
        # (a running row of the columns, or taken in a decode: its last token not computed)
        counts = [seq.num_computed for seq in seqs]
        assert all(n == len(seq.token_ids) - 1 for n, seq in zip(counts, seqs, strict=True) if id(seq) in owned)
        assert not (owned and engine._columns_moved)
        if cols is not None:  # (the counts read are the columns' own, each row's)
            by_id = {id(seq): n for seq, n in zip(seqs, counts, strict=True)}
            assert [by_id.get(id(seq), seq._num_computed) for seq in cols.seqs] == cols.computed
    if cols is None:
        return
    seqs = cols.seqs
    assert seqs and engine.running[: len(seqs)] == seqs
    assert cols.ids == [seq.seq_id for seq in seqs]
    assert all(a is seq.token_ids for a, seq in zip(cols.token_lists, seqs, strict=True))
    assert cols.computed == [len(seq.token_ids) - 1 for seq in seqs]
    assert cols.last_tokens == [seq.token_ids[-1] for seq in seqs]
    assert cols.row_stop_ids == [seq.request.stop_ids for seq in seqs]
    # the step whose token brings each row to its end length: the next step or later
    step_no = engine._step_no
    assert cols.end_steps == [step_no + seq.request.end_len - len(seq.token_ids) for seq in seqs]
    assert cols.stop_ids is None or all(ids == cols.stop_ids for ids in cols.row_stop_ids)
    assert cols.first_end <= min(cols.end_steps) > step_no
    assert all(seq.request.inline for seq in seqs)


def test_a_batch_taken_as_columns_ends_its_rows_as_accept_token_does():
    # The leading running sequences that the last step took as plain requests' inline decode
    # tokens are planned and taken from the columns the engine keeps (`_take_column_tokens`:
    # appends in C, the end checks on the steps at which the rows reach their end lengths and
    # on their stop ids, one set for every row or a set a row); rows that end leave the columns, rows
    # that join behind them join them. Its twin: `inline_decode = False`, every token through
    # `_accept_token` and `_stop_reason` in full. Long decodes keep batches for many steps;
    # rows end by EOS (all rows stopped by the engine's EOS ids, none, or some) and by length
    # (max_tokens, or max_model_len where it is shorter); admissions make mixed steps; from
    # case 6 on some requests are not plain (stop strings, logprobs, two samples), so rows
    # outside the columns take the step's other paths behind them. The columns are checked
    # against the sequences after every step.
    rng = random.Random(11)
    reasons = set()
    num_behind = 0  # steps with rows of requests not plain behind the columns' rows
    for case in range(12):
        eos = ("all", "none", "some")[case % 3]
        requests = []
        for _ in range(rng.randint(2, 9)):
            ignore = {"all": False, "none": True, "some": rng.random() < 0.5}[eos]
            odd = case >= 6 and rng.random() < 0.3
            params = SamplingParams(
                max_tokens=rng.randint(1, 40),
                temperature=rng.choice([0.0, 0.9]),
                seed=rng.randrange(1000),
                ignore_eos=ignore,
                stop=("zq",) if odd and rng.random() < 0.5 else (),
                n=rng.choice([1, 2]) if odd else 1,
                logprobs=rng.choice([None, 2]) if odd else None,
            )
            requests.append(([rng.randrange(VOCAB) for _ in range(rng.randint(1, 7))], params))
        outputs = []
        for inline in (True, False):
            runner = PrefixModelRunner(64, 4)
            engine = _twin_engine(runner, 30 if case % 2 else 256, 16, True, inline)
            taken = []  # the steps that took rows through the columns
            take = engine._take_column_tokens
            engine._take_column_tokens = lambda *args, take=take, taken=taken: taken.append(1) or take(*args)
            ids = [engine.add_request(prompt, params) for prompt, params in requests]
            while engine.has_unfinished():
                engine.step()
                runner.check_integrity()
                _check_columns(engine, read=engine._step_no % 3 == 0)
                cols = engine._step_columns  # (the step's columns, its leading rows)
                if cols is not None and inline:
                    num_behind += any(not seq.request.plain for seq in engine._scheduled[len(cols.seqs) :])
            # (from case 6 on, columns form only where the leading rows are plain)
            assert (len(taken) > 3) == inline or case >= 6, case
            assert (runner.num_planned == len(taken)) or not inline  # each such step's chunks came with columns
            assert inline or not taken
            outs = [engine.output(rid) for rid in ids]
            outputs.append([[(c.token_ids, c.text, c.finish_reason) for c in o.completions] for o in outs])
            outputs[-1].append([s.logprobs for rid in ids for s in engine.requests[rid].seqs])
            outputs[-1].append([engine.stats.num_decode_tokens, engine.stats.num_prefill_tokens])
            # (each sequence's computed count, the rows that left the columns' included: each
            # took its count with it)
            outputs[-1].append([s.num_computed for rid in ids for s in engine.requests[rid].seqs])
        assert outputs[0] == outputs[1], case
        reasons.update(c[2] for out in outputs[0][:-3] for c in out)
    assert reasons == {"stop", "length"} and num_behind > 10


def _columns_run(num_blocks: int, event, contain: bool = False) -> tuple[Engine, list[str]]:
    """Five plain greedy requests of 12 tokens decoding on a batched engine of the columns'
    twin tests, `event(engine)` called before each step (`engine._step_no` steps done); each
    step checked without reading a sequence's count (`_check_columns`). contain: the
    engine's contain_request_faults."""
    runner = PrefixModelRunner(num_blocks, 4)
    engine = _twin_engine(runner, 256, 16, True, True)
    engine.contain_request_faults = contain
    ids = [engine.add_request([1, 2, 3 + i], SamplingParams(max_tokens=12, ignore_eos=True)) for i in range(5)]
    while engine.has_unfinished():
        event(engine)
        engine.step()
        runner.check_integrity()
        _check_columns(engine)
    return engine, ids


def test_the_columns_counts_go_back_to_their_rows_where_a_step_plans_without_them():
    # The decode columns hold their rows' computed counts (a take moves them on there alone,
    # `_DecodeColumns.computed`). Where a step is planned without them, each row's count must
    # be its own again first: a row aborted between steps (the running list no longer begins
    # with the columns' rows), a step the cache cannot hold (reserved again row by row,
    # preempting), a step whose batch sampler refused a row (the loop over every chunk).
    # Nothing here reads a sequence's count between steps (a read writes them back): every
    # request must still end as it does alone.
    def abort_at(step_no: int):
        def event(engine: Engine) -> None:
            if engine._step_no == step_no:
                assert engine._columns is not None and len(engine._columns.seqs) == 5
                assert engine.abort(engine.running[1].request.request_id)  # (a row in the middle)

        return event

    engine, ids = _columns_run(64, abort_at(5))
    outs = [engine.output(rid).completions[0] for rid in ids]
    assert [o.finish_reason for o in outs] == ["length", "abort", "length", "length", "length"]
    assert [o.token_ids for o in outs[::2]] == [expected([1, 2, 3 + i], 12) for i in (0, 2, 4)]
    assert outs[3].token_ids == expected([1, 2, 6], 12)

    # a pool of 11 blocks of 4 holds the five prompts but not their 15 tokens each: the
    # columns' step is refused, and the rows reserved one by one preempt the latest
    planned = []
    reserve = Engine._reserve_with_preemption

    def watched(engine: Engine):
        planned.append(engine._plan_columns is not None)
        return reserve(engine)

    Engine._reserve_with_preemption = watched
    try:
        engine, ids = _columns_run(11, lambda engine: None)
    finally:
        Engine._reserve_with_preemption = reserve
    assert engine.num_preemptions > 0 and any(planned)
    assert [engine.output(rid).completions[0].token_ids for rid in ids] == [
        expected([1, 2, 3 + i], 12) for i in range(5)
    ]

    # a batch sampler that refuses row 2 of a step of the columns' rows (its logits not finite)
    def refuse_at(step_no: int):
        def event(engine: Engine) -> None:
            if engine._step_no != step_no - 1:
                return
            assert engine._columns is not None and len(engine._columns.seqs) == 5
            sampler = engine._batch_sampler
            sample = sampler.sample

            def refusing(*args):
                del sampler.sample  # (once)
                tokens = sample(*args)
                tokens[2] = -1
                raise NonFiniteLogitsError([2], tokens=tokens)

            sampler.sample = refusing

        return event

    engine, ids = _columns_run(64, refuse_at(6), contain=True)
    outs = [engine.output(rid) for rid in ids]
    assert outs[2].error is not None and outs[2].error.startswith("NonFiniteLogitsError")
    assert [outs[i].completions[0].token_ids for i in (0, 1, 3, 4)] == [
        expected([1, 2, 3 + i], 12) for i in (0, 1, 3, 4)
    ]


def _faulty_step_runner(kind: str):
    """The runner of `_run_with_a_faulty_step`'s engine: "paged" (PrefixModelRunner, a cache
    that takes a repeated reservation; no may_reserve_again: the engine reserves the step
    again), "v4" (TinyDSV4's dual pool, exact steps, an executor with per-request state: its
    sequences are recomputed) or "hybrid" (TinyHybrid's window and full attention groups,
    exact steps: its sequences are recomputed). The tiny models run
    in fp64: a recomputed sequence's prefill and the fault-free run's decodes must give the
    same tokens exactly, which fp32's other roundings on another CPU need not."""
    if kind == "paged":
        return PrefixModelRunner(64, 4)
    from kvpool.engine.build import build_engine

    if kind == "v4":
        from kvpool.models.tiny_dsv4 import TinyDSV4

        return build_engine(TinyDSV4(dtype=torch.float64)).runner
    from kvpool.models.tiny_hybrid import TinyHybrid

    return build_engine(TinyHybrid(dtype=torch.float64), num_blocks=64, block_size=4).runner


def _run_with_a_faulty_step(
    requests, where: str, fault_step: int | None, kind: str
) -> tuple[list, bool, EngineStats | None]:
    """Runs `requests` to their ends on an engine of the columns' twin tests (over the runner
    `_faulty_step_runner(kind)`); step number
    `fault_step` (None: none) raises once, from the forward (`where` "forward"), the batch
    sampler ("sampler": before it samples; "sampled": after it sampled, its own state moved
    on) or the engine's clock read after the forward ("clock"), and the run goes on with the
    next step, as a caller that catches a step's fault does.
    The outputs, whether the faulty step had decode columns from the step before, and the
    engine's stats where the faulty step came (None where the run ended before it)."""
    runner = _faulty_step_runner(kind)
    engine = _twin_engine(runner, 256, 16, True, True)
    ids = [engine.add_request(prompt, params) for prompt, params in requests]
    execute, sample, clock = runner.execute, engine._batch_sampler.sample, engine.clock
    had_columns = False
    faulted = False
    step_no = 0
    while engine.has_unfinished():
        step_no += 1
        if step_no != fault_step:
            engine.step()
        else:
            had_columns = engine._columns is not None

            def faulty_execute(chunks):
                raise RuntimeError("injected forward fault")

            def faulty_sample(*args):
                if where == "sampled":
                    sample(*args)
                raise RuntimeError("injected sampler fault")

            def faulty_clock():
                raise RuntimeError("injected clock fault")

            if where == "forward":
                runner.execute = faulty_execute
            elif where == "clock":  # (a step reads the clock first after its forward)
                engine.clock = faulty_clock
            else:
                engine._batch_sampler.sample = faulty_sample
            with pytest.raises(RuntimeError, match="injected"):
                engine.step()
            faulted = True
            runner.execute, engine._batch_sampler.sample, engine.clock = execute, sample, clock
        runner.check_integrity()
        _check_columns(engine)
    outs = [engine.output(rid).completions[0] for rid in ids]
    return [(c.token_ids, c.finish_reason) for c in outs], had_columns, engine.stats if faulted else None


def _fault_requests() -> list[tuple[list[int], SamplingParams]]:
    """The fault tests' requests: 3 that run to max_tokens, 5 random (greedy or seeded
    temperature, EOS ignored or not), ids below 96 (the tiny hybrid's vocabulary)."""
    rng = random.Random(11)  # (two of its requests stop at an EOS id)
    requests = [([1, 2, 3 + i], SamplingParams(max_tokens=6 + i, ignore_eos=True)) for i in range(3)]
    for _ in range(5):
        params = SamplingParams(
            max_tokens=rng.randint(1, 12),
            temperature=rng.choice([0.0, 0.9]),
            seed=rng.randrange(1000),
            ignore_eos=rng.random() < 0.5,
        )
        requests.append(([rng.randrange(96) for _ in range(rng.randint(1, 7))], params))
    return requests


@functools.cache
def _fault_twin(kind: str) -> list[tuple[list[int], str]]:
    """The fault tests' run without a fault, once per kind (the tiny V4's takes seconds)."""
    return _run_with_a_faulty_step(_fault_requests(), "forward", None, kind)[0]


@pytest.mark.parametrize("kind", ["paged", "v4", "hybrid"])
@pytest.mark.parametrize("where", ["forward", "sampler", "sampled"])
def test_after_a_step_that_raised_every_request_ends_at_its_max_tokens_or_stop(where, kind):
    # A step that raises in its forward or its sampler takes no token; the caller (the
    # server, a loop that catches it) goes on stepping. The next steps must end every request
    # exactly where a run without the fault does (its twin): at its max_tokens, or at its
    # stop id, nothing lost and nothing past them. The fault is planted at every step of the
    # run in turn: in decode steps of the columns' rows (a row's end step the faulty one, or
    # the one after), and in mixed steps (admissions behind them). Once, the columns kept
    # across the faulty step counted its number as a step that took a token: rows whose end
    # step went by never ended by length. On every cache kind: a cache of exact steps refused
    # the next step's reservation of the same tokens ("already has an uncommitted
    # reservation") until the engine undid or released the faulty step's (V4, hybrid: recomputed).
    # Those releases were counted as preemptions: they count apart (num_fault_recomputes).
    requests = _fault_requests()
    twin = _fault_twin(kind)
    # (the twin's lengths: max_tokens where a request ended by length, fewer at a stop id)
    assert all(
        len(tokens) == params.max_tokens if reason == "length" else len(tokens) < params.max_tokens
        for (tokens, reason), (_, params) in zip(twin, requests, strict=True)
    )
    # (the paged model's tokens hit its EOS ids; the tiny models' end every request by length)
    assert {reason for _, reason in twin} == ({"length", "stop"} if kind == "paged" else {"length"})
    num_with_columns = 0
    for fault_step in range(1, 16):
        outputs, had_columns, stats = _run_with_a_faulty_step(requests, where, fault_step, kind)
        assert outputs == twin, fault_step
        num_with_columns += had_columns
        if stats is not None:  # the sequences released after the fault (V4, hybrid) are no preemptions
            assert stats.num_preemptions == 0, fault_step
            assert (stats.num_fault_recomputes > 0) == (kind != "paged"), fault_step
    assert num_with_columns > 5


@pytest.mark.parametrize("kind", ["v4", "hybrid"])
def test_a_clock_that_raises_after_the_forward_is_a_step_fault_like_the_forwards(kind):
    # The clock read after the forward (the simulator's prices the step there) raises, before
    # any token is taken: the engine undoes the step as it does a forward's or a sampler's
    # fault. Once it was read outside their handler: the faulty step's reservation stayed,
    # and a cache of exact steps (V4, hybrid) refused the next step's ("already has an
    # uncommitted reservation"). A mixed step (2: admissions behind decodes) and a decode
    # step of the columns' rows (9); the other fault points run at every step above.
    requests = _fault_requests()
    twin = _fault_twin(kind)
    for fault_step, columns in ((2, False), (9, True)):
        outputs, had_columns, stats = _run_with_a_faulty_step(requests, "clock", fault_step, kind)
        assert outputs == twin and had_columns == columns, fault_step
        assert stats is not None and stats.num_preemptions == 0 and stats.num_fault_recomputes > 0


# The points of a step's take (and commit) where `_plant_take_fault` plants a fault: each
# raises after some rows took their token (appended it, moved their computed count)
TAKE_POINTS = {
    "columns": "_take_column_tokens",  # (engine methods: raise after their own work)
    "inline": "_take_inline_tokens",
    "accept": "_accept_token",
    "stop": "_stop_reason",  # (raise instead: a row that ends, its token appended)
    "sampler": "sampler",  # (the per-token sampler, not batched: raise instead)
    "commit": "commit_step",  # (the runner's: raise instead, the cache unchanged)
    "committed": "commit_step",  # (raise after it: the cache committed the step)
}


def _plant_take_fault(engine: Engine, where: str, fired: list[str]):
    """Plants the fault `where` (TAKE_POINTS) on the engine's (or its runner's) instance;
    `fired` gets `where` when it raises. Returns the call that lifts it."""
    obj = engine.runner if where.startswith("commit") else engine
    name = TAKE_POINTS[where]
    call = getattr(obj, name)
    had = name in vars(obj)  # (an instance attribute: put back; else the class's method shows again)

    def faulty(*args, **kwargs):
        if where not in ("stop", "sampler", "commit"):
            call(*args, **kwargs)
        fired.append(where)
        raise RuntimeError(f"injected {where} fault")

    setattr(obj, name, faulty)
    return lambda: setattr(obj, name, call) if had else delattr(obj, name)


def _taken_with_a_token(seq) -> tuple:
    """What a sequence's taken token sets besides its ids, for the take-fault tests."""
    req = seq.request
    return req.first_token_time, req.inline, len(seq.logprobs), len(seq.logits), seq.text


def _run_with_take_faults(requests, kind: str, faults: dict[int, str], batched: bool = True):
    """`_run_with_a_faulty_step` with faults of the take planted (`faults`: step number ->
    a TAKE_POINTS key; a step that does not reach its point runs as any other). After each
    fault every sequence holds the tokens it held before the step, and one still admitted
    its computed count (the others released to be recomputed). The outputs, the faults that
    fired, the engine's stats."""
    runner = _faulty_step_runner(kind)
    engine = _twin_engine(runner, 256, 16, batched, True)
    ids = [engine.add_request(prompt, params) for prompt, params in requests]
    fired: list[str] = []
    step_no = 0
    while engine.has_unfinished():
        step_no += 1
        if step_no not in faults:
            engine.step()
        else:
            seqs = [seq for req in engine.requests.values() for seq in req.seqs]
            before = [(list(seq.token_ids), seq.num_computed, seq.in_runner) for seq in seqs]
            kept = [_taken_with_a_token(seq) for seq in seqs]
            lift = _plant_take_fault(engine, faults[step_no], fired)
            try:
                num_fired = len(fired)
                engine.step()
                assert len(fired) == num_fired  # (its point not reached: a step as any other)
            except RuntimeError as error:
                assert str(error) == f"injected {faults[step_no]} fault" and len(fired) == num_fired + 1
                # (what a taken token sets besides the ids: no first-token time of a step that
                # took none, nor its logprobs, logits or text)
                assert [_taken_with_a_token(seq) for seq in seqs] == kept, step_no
                for seq, (token_ids, num_computed, in_runner) in zip(seqs, before, strict=True):
                    assert seq.token_ids == token_ids, (step_no, seq.seq_id)
                    assert seq.finish_reason is None or not in_runner, (step_no, seq.seq_id)  # (none ended)
                    released = in_runner and not seq.in_runner  # (to be recomputed: it waits)
                    assert seq.num_computed == (0 if released else num_computed), (step_no, seq.seq_id)
                    assert not released or seq in engine.waiting
            finally:
                lift()
        runner.check_integrity()
        _check_columns(engine)
    outs = [engine.output(rid).completions[0] for rid in ids]
    return [(c.token_ids, c.finish_reason) for c in outs], fired, engine.stats


@pytest.mark.parametrize("batched", [True, False])
def test_a_fault_in_the_steps_take_or_commit_leaves_the_engine_as_before_the_step(batched):
    # A fault after some rows took their token (the columns' take, the inline take, a row's
    # `_accept_token`, a stop check, the per-token sampler) or in the commit: the step's
    # sequences as before it (else the caller that steps on saw some requests with the
    # step's token and some without, and the next reservation of a taken row's token was
    # refused or skipped a token), the cache's reservation undone, or (the commit raised:
    # the cache may have committed) the sequences released and recomputed. Planted at
    # every step in turn, every point; then the run equals the run without the fault.
    requests = _fault_requests()
    twin = _fault_twin("paged")
    assert _run_with_take_faults(requests, "paged", {}, batched)[0] == twin  # (batched or not: the same tokens)
    # (the columns' and the inline takes are batched steps'; the per-token sampler the others')
    points = [p for p in TAKE_POINTS if p not in (("sampler",) if batched else ("columns", "inline"))]
    counts = dict.fromkeys(points, 0)
    for where in points:
        for fault_step in range(1, 16):
            outputs, fired, stats = _run_with_take_faults(requests, "paged", {fault_step: where}, batched)
            assert outputs == twin, (where, fault_step)
            counts[where] += len(fired)
            # a release after a fault is no preemption (commit faults release; the others undo)
            assert stats.num_preemptions == 0
            assert (stats.num_fault_recomputes > 0) == (bool(fired) and where.startswith("commit")), (where, fault_step)
    assert min(counts.values()) >= 2, counts


@pytest.mark.parametrize("kind", ["v4", "hybrid"])
def test_faults_in_the_take_recompute_v4_and_hybrid_sequences_exactly(kind):
    # On the caches whose step cannot be undone (hybrid) or whose executor's per-request
    # state the forward moved (V4): the take's faults, undone on the engine's side, release
    # the step's sequences to be recomputed (fp64: exact), counted apart from preemptions.
    # Several faults in one run (a run a fault, as the test above, costs too much here)
    # (the engine's side of every point is the test's above: here the recompute, after a
    # prompt's first token, after the columns' take, after a commit)
    faults = {2: "accept", 5: "columns", 9: "committed"}
    outputs, fired, stats = _run_with_take_faults(_fault_requests(), kind, faults)
    assert outputs == _fault_twin(kind)
    assert fired == ["accept", "columns", "committed"]
    assert stats.num_preemptions == 0 and stats.num_fault_recomputes >= len(fired)


# The points of a forked request's step where `_run_with_a_fork_fault` plants a fault, each on
# its second child ("/2"), after the call's own work: its first token (`_accept_token`, taken
# before the commit), the runner's fork of it and its first token's hand-over (after the commit)
FORK_POINTS = {"accept": "_accept_token", "fork": "fork", "append": "append_token_ids"}


def _run_with_a_fork_fault(where: str | None, batched: bool):
    """Requests of n = 3 (two children forked off the prompt), n = 2 ending at its first token
    (a child that finishes as it forks) and n = 1, run to their ends on the paged twin engine;
    the fault `where` (FORK_POINTS; None: none) raises once, on child "/2", and the caller
    steps on. After the fault the engine holds no child and every sequence its tokens from
    before the step. Every completion's tokens and reason, the faults that fired, the stats."""
    runner = _faulty_step_runner("paged")
    engine = _twin_engine(runner, 256, 16, batched, True)
    requests = [
        ([7, 8, 9, 10, 11], SamplingParams(max_tokens=6, n=3, temperature=0.9, seed=4, ignore_eos=True)),
        ([20, 21], SamplingParams(max_tokens=1, n=2, ignore_eos=True)),
        ([30, 31, 32], SamplingParams(max_tokens=5, ignore_eos=True)),
    ]
    ids = [engine.add_request(prompt, params) for prompt, params in requests]
    fired: list[str] = []
    if where is not None:
        obj = engine if where == "accept" else runner
        call = getattr(obj, FORK_POINTS[where])

        def faulty(*args, **kwargs):
            result = call(*args, **kwargs)
            child_id = args[0].seq_id if where == "accept" else args[1] if where == "fork" else args[0]
            if not fired and child_id.endswith("/2"):
                fired.append(where)
                raise RuntimeError(f"injected {where} fault")
            return result

        setattr(obj, FORK_POINTS[where], faulty)
    while engine.has_unfinished():
        seqs = [seq for req in engine.requests.values() for seq in req.seqs]
        before = [(list(seq.token_ids), seq.in_runner) for seq in seqs]
        try:
            engine.step()
        except RuntimeError as error:
            assert str(error) == f"injected {where} fault"
            assert [seq for req in engine.requests.values() for seq in req.seqs] == seqs  # (no child)
            assert not any(req.forked for req in engine.requests.values())
            assert all(seq in seqs for seq in engine.running) and all(seq in seqs for seq in engine.waiting)
            for seq, (token_ids, in_runner) in zip(seqs, before, strict=True):
                assert seq.token_ids == token_ids, seq.seq_id
                assert seq.in_runner or not in_runner or seq in engine.waiting, seq.seq_id
        runner.check_integrity()
        _check_columns(engine)
    outs = [[(c.token_ids, c.finish_reason) for c in engine.output(rid).completions] for rid in ids]
    return outs, fired, engine.stats


@pytest.mark.parametrize("batched", [True, False])
@pytest.mark.parametrize("where", list(FORK_POINTS))
def test_a_fault_while_a_request_forks_its_samples_leaves_the_engine_to_step_on(where, batched):
    # A fault in a forked child's first token (its sampler, logprobs, stop check) came after
    # the step's commit, outside its undo: the child stayed running with no token to compute
    # and every later step failed ("a running sequence always has a token to compute") for
    # every request. Now the children's first tokens are taken before the commit (a fault
    # there undone with the step), and a fault of the runner while it forks them drops the
    # children forked so far, the step's sequences then recomputed (the commit happened):
    # stepping on gives the run without the fault, every sample of it.
    twin, _, _ = _run_with_a_fork_fault(None, batched)
    assert [len(completions) for completions in twin] == [3, 2, 1]
    assert [len(tokens) for completions in twin for tokens, _ in completions] == [6, 6, 6, 1, 1, 5]
    outputs, fired, stats = _run_with_a_fork_fault(where, batched)
    assert fired == [where]
    assert outputs == twin
    assert stats.num_preemptions == 0
    assert (stats.num_fault_recomputes > 0) == (where != "accept")  # (after the commit: recomputed)


@settings(max_examples=80, deadline=None)
@given(
    st.lists(st.integers(-3, VOCAB + 3), min_size=0, max_size=40),
    st.sampled_from(["list", "numpy", "lookup"]),
    st.sampled_from([None, None, None, 2**32 - 2, 2**32 - 1, 2**32, 2**32 + 1]),
    st.integers(0, 39),
)
@example(ids=[1, VOCAB], kind="list", big=None, at=0)  # (the vocabulary's edge: drawn rarely)
@example(ids=[VOCAB - 1, 3], kind="numpy", big=None, at=0)
@example(ids=[1, 2], kind="numpy", big=2**32 - 1, at=0)
@example(ids=[1, 2], kind="list", big=2**32, at=1)
@example(ids=[], kind="lookup", big=None, at=0)
def test_a_checked_packing_is_taken_as_the_checked_path_takes_its_ids(ids, kind, big, at):
    # Twins: add_request of pack_prompt's packing (taken without its ids read again; packed
    # from the same kind of ids) and of the same ids checked (a list, a numpy array, a
    # hand-built LookupPrompt): the same request (ids, packing, memo kept) or the same
    # error, and nothing queued on an error. Where pack_prompt itself refuses (an empty
    # prompt, an id outside [0, 2**32)), the checked path refuses the same ids too
    import numpy as np

    from kvpool.cache.coordinator import pack_prompt
    from kvpool.cache.types import LookupPrompt
    from kvpool.pool.hashing import token_bytes

    if big is not None and ids:  # (one id near 2**32, in or just past uint32, at times)
        ids[at % len(ids)] = big
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    drawn = np.array(ids, dtype=np.int64) if kind == "numpy" else list(ids)
    results = []
    for fast in (True, False):
        runner = PrefixModelRunner(8, 4)
        runner.max_model_len = 32
        engine = Engine(runner, max_num_batched_tokens=32)
        try:
            if fast:
                prompt = pack_prompt(drawn)
            elif kind == "lookup":
                prompt = LookupPrompt(list(ids), (), token_bytes(ids), {})
            else:
                prompt = drawn
        except ValueError as error:  # packing's own refusals
            assert (fast or kind == "lookup") and (not ids or min(ids) < 0 or max(ids) >= 2**32), error
            results.append(("refused", "empty prompt" if not ids else "outside [0, 2**32)"))
            continue
        try:
            rid = engine.add_request(prompt, params, "r")
        except ValueError as error:
            assert not engine.requests and not engine.waiting
            results.append(str(error))
            continue
        seq = engine.requests[rid].seqs[0]
        # the engine's own list, not the caller's: the sequence's, which the packing is over
        assert type(seq.token_ids) is list and seq.token_ids is not getattr(prompt, "token_ids", prompt)
        assert seq.prompt is not None and seq.prompt.token_ids is seq.token_ids
        assert [type(t) for t in seq.token_ids] == [int] * len(ids)
        if fast or kind == "lookup":
            assert seq.prompt.hashes is prompt.hashes  # (the lookups' memo kept)
        results.append((engine.requests[rid].prompt_ids, seq.token_ids, seq.prompt.packed, seq.prompt.mm_items))
    if results[0][0] == "refused":
        # pack_prompt refused: the checked path refuses these ids too, naming the problem
        # (its own words: the engine's vocabulary is narrower than [0, 2**32))
        named = "the prompt is empty" if not ids else "outside the vocabulary"
        engine = Engine(PrefixModelRunner(8, 4), max_num_batched_tokens=32)
        with pytest.raises(ValueError, match=named):
            engine.add_request(drawn, params, "r")
        assert not engine.requests and not engine.waiting
        if isinstance(results[1], str):  # (the checked twin's own refusal, the same problem)
            assert named in results[1]
        else:  # (a hand-built LookupPrompt of such ids cannot be packed either)
            assert kind == "lookup" and results[1] == results[0]
    else:
        assert results[0] == results[1]
    if ids and 0 <= min(ids) and max(ids) < VOCAB and len(ids) < 32:
        assert results[0] == (ids, ids, token_bytes(ids), ())
    elif ids and 0 <= min(ids) and max(ids) < 2**32 and len(ids) < 32:
        assert (
            results[0]
            == f"request 'r': token ids {[t for t in ids if t >= VOCAB][:5]} outside the vocabulary [0, {VOCAB})"
        )


def test_a_prompt_is_checked_packed_once_and_its_packing_serves_the_first_admission_only():
    import numpy as np

    from kvpool.cache import coordinator
    from kvpool.cache.coordinator import pack_prompt
    from kvpool.cache.types import LookupPrompt
    from kvpool.pool.hashing import token_bytes

    runner = PrefixModelRunner(8, 4)
    engine = Engine(runner, max_num_batched_tokens=32)
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    # Ids that are no Python ints are converted (numpy's, torch's); a bad id is named
    a = engine.add_request(np.array([1, 2, 3, 4, 5]), params)
    b = engine.add_request(torch.tensor([1, 2, 3, 4, 6]), params)
    assert [type(t) for t in engine.requests[a].prompt_ids + engine.requests[b].prompt_ids] == [int] * 10
    # and pack_prompt converts them as add_request does: the packing add_request trusts holds ints
    for ids in (np.array([1, 2, 3]), torch.tensor([1, 2, 3]), [np.int64(1), 2, np.int32(3)]):
        assert [type(t) for t in pack_prompt(ids).token_ids] == [int] * 3
    for bad, named in (([1, VOCAB], f"[{VOCAB}]"), ([1, -2], "[-2]"), ([2**40], f"[{2**40}]")):
        with pytest.raises(ValueError, match=rf"token ids \{named}\ outside the vocabulary \[0, {VOCAB}\)"):
            engine.add_request(bad, params)
    with pytest.raises(ValueError, match="no multimodal items"):
        engine.add_request(pack_prompt([1, 2], [(0, 1, "img")]), params)
    with pytest.raises(ValueError, match=r"token ids must be integers, got 'x'"):
        engine.add_request([1, "x", 3], params)
    # pack_prompt's packing is safe by construction: its ids are a tuple of its own (no
    # change to the caller's list reaches it, and it takes none), so add_request trusts it
    ids = [1, 2, 3, 4, 5]
    kept = pack_prompt(ids)
    ids[:4] = [5, 6, 7, 8]
    assert kept.token_ids == (1, 2, 3, 4, 5) and kept.packed == token_bytes([1, 2, 3, 4, 5])
    with pytest.raises(TypeError):
        kept.token_ids[:4] = [5, 6, 7, 8]  # type: ignore[index]
    # A LookupPrompt built otherwise (by hand, or `_replace`) whose list is not its bytes'
    # ids: refused (its lookup would compare the old bytes), an id past the vocabulary included
    stale = kept._replace(token_ids=[1, 2, 3, 4, 5])
    assert type(stale) is LookupPrompt
    stale.token_ids[:4] = [5, 6, 7, 8]
    with pytest.raises(ValueError, match="the packed prompt is not the packing of its token ids"):
        engine.add_request(stale, params)
    with pytest.raises(ValueError, match="the packed prompt is not the packing of its token ids"):
        engine.add_request(LookupPrompt([1, 2, 3], (), token_bytes([1, 2, 4])), params)
    with pytest.raises(ValueError, match=rf"token ids \[{VOCAB + 5}\] outside the vocabulary"):
        engine.add_request(pack_prompt([1, VOCAB + 5]), params)  # a true packing: its ids checked
    with pytest.raises(ValueError, match=rf"token ids \[{VOCAB + 5}\] outside the vocabulary"):
        engine.add_request(LookupPrompt([1, VOCAB + 5], (), token_bytes([1, VOCAB + 5])), params)
    long = engine.runner.max_model_len
    for too_long in (pack_prompt([1] * long), [1] * long):  # (both paths: the same error)
        with pytest.raises(ValueError, match=f"prompt of {long} tokens is too long"):
            engine.add_request(too_long, params)
    assert len(engine.requests) == 2  # nothing refused was added
    run(engine)
    # A packed prompt (the router's) is the prompt; its admission hashes no block the
    # lookup hashed (the prompt's memo holds them), and the packing is dropped once admitted
    packed = pack_prompt([1, 2, 3, 4, 5, 7])
    assert runner.cache.lookup_packed(packed) == 4  # a's first block
    calls: list[int] = []
    digest = runner.cache.pool.hasher.digest
    runner.cache.pool.hasher.digest = lambda data: calls.append(1) or digest(data)
    c = engine.add_request(packed, params)
    seq = engine.requests[c].seqs[0]
    # its bytes and memo of hashes, over the engine's own list (the caller's may change)
    assert seq.prompt.packed is packed.packed and seq.prompt.hashes is packed.hashes
    assert seq.prompt.token_ids is seq.token_ids and seq.token_ids == [1, 2, 3, 4, 5, 7]
    assert type(seq.token_ids) is list and type(seq.prompt.token_ids) is list
    packings: list[int] = []
    to_bytes = coordinator.token_bytes
    coordinator.token_bytes = lambda ids: packings.append(len(ids)) or to_bytes(ids)
    try:
        engine.step()  # admitted (4 tokens cached), its 2 computed: no block filled, none hashed
    finally:
        coordinator.token_bytes = to_bytes
    # and the admission packed nothing again: add_request checked the packing
    assert seq.prompt is None and seq.num_computed == 6 and calls == [] and packings == []
    run(engine)
    for rid, prompt in ((a, [1, 2, 3, 4, 5]), (b, [1, 2, 3, 4, 6]), (c, [1, 2, 3, 4, 5, 7])):
        assert engine.output(rid).completions[0].token_ids == expected(prompt, 3)


def test_a_checked_prompt_cannot_be_forged_and_every_other_route_is_checked():
    # The engine takes a CheckedPrompt without reading its ids: only pack_prompt (and the
    # simulator's turn_prompt) make one. Each route a reviewer forged one by is refused
    # (TypeError) or gives a plain LookupPrompt, which the engine checks (its old errors)
    import copy
    import pickle

    import numpy as np

    from kvpool.cache.coordinator import pack_prompt
    from kvpool.cache.types import CheckedPrompt, LookupPrompt
    from kvpool.pool.hashing import token_bytes

    params = SamplingParams(max_tokens=2, ignore_eos=True)
    rule = "a CheckedPrompt is made only by pack_prompt"
    for fields in (
        ((1, 2, 3), (), token_bytes([1, 2, 4]), {}),  # bytes not its ids': wrong prefix hits
        ((1, 2, 3), (), token_bytes([1, 2]), {}),  # a shorter packing
        ((-1, 2), (), token_bytes([1, 2]), {}),  # an id the vocabulary check (of the bytes) misses
        ([np.int64(1), np.int64(2)], (), token_bytes([1, 2]), {}),  # no tuple of Python ints
        ((), (), b"", {}),
    ):
        with pytest.raises(TypeError, match=rule):
            CheckedPrompt(*fields)
        with pytest.raises(TypeError, match=rule):
            CheckedPrompt(*fields, key=object())
    checked = pack_prompt([1, 2, 3])
    made = checked._make([(5, 6, 7), (), token_bytes([1, 2, 3]), {}])
    assert type(made) is LookupPrompt and type(CheckedPrompt._make(list(checked))) is LookupPrompt
    replaced = checked._replace(token_ids=(5, 6, 7))
    assert type(replaced) is LookupPrompt
    for forged in (made, replaced):
        engine = Engine(PrefixModelRunner(8, 4), max_num_batched_tokens=32)
        with pytest.raises(ValueError, match="the packed prompt is not the packing of its token ids"):
            engine.add_request(forged, params)
        assert not engine.requests and not engine.waiting
    # copy and pickle give a plain LookupPrompt of the same fields, checked and then taken
    for twin in (copy.copy(checked), copy.deepcopy(checked), pickle.loads(pickle.dumps(checked))):
        assert type(twin) is LookupPrompt and tuple(twin) == tuple(checked)
        engine = Engine(PrefixModelRunner(8, 4), max_num_batched_tokens=32)
        rid = engine.add_request(twin, params, "r")
        seq = engine.requests[rid].seqs[0]
        assert seq.token_ids == [1, 2, 3] and seq.prompt.packed == token_bytes([1, 2, 3])
    # a true packing's errors name the problem: the prompt is empty (pack_prompt's and a
    # hand-built LookupPrompt's), the ids outside the vocabulary (those its bytes hold)
    engine = Engine(PrefixModelRunner(8, 4), max_num_batched_tokens=32)
    with pytest.raises(ValueError, match="'e' has an empty prompt"):
        pack_prompt([], request_id="e")
    for empty in (LookupPrompt([], (), b"", {}), LookupPrompt((), (), b""), []):
        with pytest.raises(ValueError, match=r"request 'e': the prompt is empty"):
            engine.add_request(empty, params, "e")
    # (the engine's check of a CheckedPrompt, reached by one pack_prompt itself would refuse)
    from kvpool.cache.types import _CHECKED_KEY

    with pytest.raises(ValueError, match=r"request 'e': the prompt is empty"):
        engine.add_request(CheckedPrompt((), (), b"", {}, key=_CHECKED_KEY), params, "e")
    for bad in ([1, VOCAB, 3, VOCAB + 7], [VOCAB + 1, 2**32 - 1]):
        named = ", ".join(str(t) for t in bad if t >= VOCAB)
        with pytest.raises(ValueError, match=rf"request 'v': token ids \[{named}\] outside the vocabulary"):
            engine.add_request(pack_prompt(bad), params, "v")
    assert not engine.requests and not engine.waiting


def test_a_checked_prompts_handed_over_list_is_the_requests_own_and_runs_as_a_copied_one():
    # turn_prompt's CheckedPrompt holds a list handed over: the engine keeps that list as the
    # request's sequence's (no copy; its tokens are appended to it), and pop_output gives it
    # back cut to the prompt; a tuple (pack_prompt's) and a plain list are copied into a list
    # of the engine's, given back the same way (`output` gives a copy). All three run as the
    # plain list's twin does, and refuse the same bad prompts with the checked path's words;
    # a handed-over list taken again after it grew is refused
    from kvpool.cache.coordinator import pack_prompt
    from kvpool.cache.types import _CHECKED_KEY, CheckedPrompt
    from kvpool.pool.hashing import token_bytes

    params = SamplingParams(max_tokens=3, ignore_eos=True)
    prompts = [[1, 2, 3, 4, 5], [1, 2, 3, 4, 6], [7, 8, 9]]
    outputs = []
    for kind in ("list", "tuple", "plain"):
        engine = Engine(PrefixModelRunner(8, 4), max_num_batched_tokens=32)
        handed = []
        for ids in prompts:
            if kind == "list":
                prompt = CheckedPrompt(list(ids), (), token_bytes(ids), {}, key=_CHECKED_KEY)
            else:
                prompt = pack_prompt(ids) if kind == "tuple" else list(ids)
            rid = engine.add_request(prompt, params)
            req = engine.requests[rid]
            tokens = req.seqs[0].token_ids  # (the engine's list of the prompt: the request keeps no other)
            assert (
                type(tokens) is list and tokens == ids and req.prompt_ids == ids and req.num_prompt_tokens == len(ids)
            )
            given = prompt if kind == "plain" else prompt.token_ids
            assert (tokens is given) == (kind == "list")  # handed over: kept, not copied
            handed.append((rid, tokens))
        run(engine)
        done = []
        for (rid, kept), ids in zip(handed, prompts, strict=True):
            assert kept == ids + expected(ids, 3)  # (the outputs appended to the list)
            copied = engine.output(rid).prompt_token_ids
            assert copied == ids and copied is not kept
            out = engine.pop_output(rid)
            assert out.prompt_token_ids is kept and kept == ids  # (cut to the prompt)
            done.append((list(kept), out.completions[0].token_ids))
        outputs.append(done)
        if kind == "list":  # (its list grew in the run before pop_output cut it: grown again here)
            prompt.token_ids.append(5)
            with pytest.raises(ValueError, match="the packed prompt is not the packing of its token ids"):
                engine.add_request(prompt, params, "again")
    assert outputs[0] == outputs[1] == outputs[2] == [(p, expected(p, 3)) for p in prompts]
    engine = Engine(PrefixModelRunner(8, 4), max_num_batched_tokens=32)
    for bad, named in (
        ([], "the prompt is empty"),
        ([1, VOCAB, 3], rf"token ids \[{VOCAB}\] outside the vocabulary \[0, {VOCAB}\)"),
        (list(range(40)), "prompt of 40 tokens is too long"),
    ):
        for prompt in (CheckedPrompt(bad, (), token_bytes(bad), {}, key=_CHECKED_KEY), bad):
            with pytest.raises(ValueError, match=rf"request 'b': {named}"):
                engine.add_request(prompt, params, "b")
    assert not engine.requests and not engine.waiting


@settings(max_examples=300, deadline=None)
@given(
    rows=st.lists(
        st.tuples(
            st.integers(0, 6), st.integers(1, 4), st.sampled_from([frozenset(), frozenset({3}), frozenset({3, 5})])
        ),
        min_size=1,
        max_size=12,
    ),
    shared=st.booleans(),
)
def test_the_columns_rows_that_may_end_are_those_end_rows_ends(rows, shared):
    # `_take_column_tokens` hands `_end_rows` only the rows `_column_end_rows` finds in C
    # (a token among the row's stop ids; the rows `_rows_at_end` finds due: its length at its
    # end length: its end step is the step's own); its twin
    # is `_end_rows` over every row, whose own check is: the token is a stop id, or
    # len(token_ids) >= end_len. Each row: its token, its end length's distance from the
    # chunk's end + 1 (left[i] = end_len - end: 1 or less is reached), its stop ids (the
    # columns' one set where shared, else a set a row); the take is step 50's, so a row's
    # end step is 50 + left[i] - 1
    if shared:
        rows = [(token, left, rows[0][2]) for token, left, _ in rows]
    ends = [100 + 7 * i for i in range(len(rows))]  # each row's chunk end: len(token_ids) - 1
    sampled = [token for token, _, _ in rows]
    end_lens = [end + left for end, (_, left, _) in zip(ends, rows, strict=True)]
    row_stop_ids = [stop_ids for _, _, stop_ids in rows]
    end_steps = [50 + left - 1 for _, left, _ in rows]
    cols = _DecodeColumns(
        [],
        [],
        [],
        ends,
        sampled,
        row_stop_ids,
        end_steps,
        row_stop_ids[0] if shared else None,
        min(end_steps),
    )
    twin = [
        i
        for i, (token, stop_ids, end, end_len) in enumerate(zip(sampled, row_stop_ids, ends, end_lens, strict=True))
        if token in stop_ids or end + 1 >= end_len
    ]
    left = [end_len - end for end_len, end in zip(end_lens, ends, strict=True)]
    # the rows due: those whose length reaches their end length (left is at least 1)
    due = Engine._rows_at_end(end_steps, 50)
    assert due == [i for i, n in enumerate(left) if n <= 1]
    # the take passes the rows due where the bound said some may be, else None: then the
    # rows are those whose token is a stop id alone, whatever their lengths
    assert Engine._column_end_rows(cols, sampled, due) == twin
    stops = [i for i, (token, stop_ids) in enumerate(zip(sampled, row_stop_ids, strict=True)) if token in stop_ids]
    assert Engine._column_end_rows(cols, sampled, None) == stops


@pytest.mark.parametrize(
    "left, due",
    [
        ([3, 2, 4], []),  # no row one token from its end
        ([1], [0]),
        ([1, 2, 3, 1], [0, 3]),  # the first row and the last
        ([2, 1, 1, 5, 1], [1, 2, 4]),  # several, side by side and apart
        ([1, 1, 1], [0, 1, 2]),
    ],
)
def test_the_rows_at_their_end_are_those_one_token_from_it(left, due):
    # `_rows_at_end` finds the rows whose end step is the take's step by count and index
    # (C-level calls), a plain filter's rows: in step 20, a row left[i] tokens from its end
    # length (its token then brings it left[i] - 1 closer) has end step 20 + left[i] - 1
    end_steps = [20 + n - 1 for n in left]
    assert Engine._rows_at_end(end_steps, 20) == due == [i for i, n in enumerate(left) if n == 1]


@settings(max_examples=200, deadline=None)
@given(
    num_running=st.integers(0, 8),
    prefix=st.integers(0, 8),
    picks=st.lists(st.integers(0, 9), max_size=3),
)
def test_the_running_sequences_lead_with_the_columns_rows_by_identity_alone(num_running, prefix, picks):
    # `_plan_running` plans from the columns where the running sequences begin with the
    # columns' rows, the same objects in order (`_leads`: lists compared with ==, identity
    # since SequenceState compares by identity). Its twin: all(map(operator.is_, ...)).
    # Every sequence here has the same fields (a twin of equal values is still another row);
    # seqs: the first `prefix` running sequences, then `picks` (an index past the running
    # ones picks such a twin)
    req = RequestState("r", 2, SamplingParams(), 0.0)
    running = [SequenceState("r/0", req, 0, [1, 2]) for _ in range(num_running)]
    stranger = SequenceState("r/0", req, 0, [1, 2])
    seqs = running[:prefix] + [running[i] if i < num_running else stranger for i in picks]
    twin = len(seqs) <= len(running) and all(map(operator.is_, running, seqs))
    assert _leads(running, seqs) == twin
    if seqs and len(seqs) <= len(running):
        assert not _leads(running, [*seqs[:-1], stranger])  # equal fields, another object


def test_a_columns_step_shares_the_columns_ids_and_an_admission_appends_to_its_own_copy():
    # A step of the decode columns' rows alone plans with the columns' ids list itself (a
    # copy would touch every id's string a step); the columns' lists are never changed, so
    # a step that admits a request appends its id to a copy, and the columns keep theirs.
    runner = PrefixModelRunner(64, 4)
    engine = _twin_engine(runner, 256, 16, True, True)
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    first = [engine.add_request([1 + i, 2, 3], params) for i in range(3)]
    for _ in range(3):
        engine.step()
    cols = engine._columns
    assert cols is not None and len(cols.seqs) == 3
    ids = cols.ids
    assert ids == [engine.requests[rid].seqs[0].seq_id for rid in first]
    engine.step()  # the same rows: their ids are the columns' list
    assert engine._step_ids is ids and engine._columns.ids is ids
    late = engine.add_request([5, 6], params)
    engine.step()  # the columns' rows, then the admitted prompt's chunk
    late_id = engine.requests[late].seqs[0].seq_id
    assert ids == [engine.requests[rid].seqs[0].seq_id for rid in first]
    assert engine._step_ids == [*ids, late_id] and engine._step_ids is not ids
    run(engine)
    assert [engine.output(rid).completions[0].token_ids for rid in first] == [
        expected([1 + i, 2, 3], 30) for i in range(3)
    ]


def _run_capped(kind: str, max_num_seqs: int):
    """The cap tests' requests run to their ends on `_faulty_step_runner(kind)` (fp64 tiny
    models: exact), `max_num_seqs` the cap: n = 7 seeded samples (above a cap of 4), a short
    plain request, then n = 3 greedy ones arriving while the first's samples fill the batch.
    Each step's number of rows (the runner's chunks) and the completions."""
    runner = _faulty_step_runner(kind)
    engine = Engine(runner, max_num_batched_tokens=16, max_num_seqs=max_num_seqs, eos_token_ids=(3, 5, 40))
    rows = []
    execute = runner.execute
    runner.execute = lambda chunks: rows.append(len(chunks)) or execute(chunks)
    requests = [
        ([7, 8, 9, 10, 11], SamplingParams(max_tokens=5, n=7, temperature=0.9, seed=4, ignore_eos=True)),
        ([30, 31], SamplingParams(max_tokens=2, ignore_eos=True)),
    ]
    ids = [engine.add_request(prompt, params) for prompt, params in requests]
    steps = 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
        if steps == 1:  # (the first request's samples forked: the batch at or near the cap)
            ids.append(engine.add_request([20, 21, 22], SamplingParams(max_tokens=4, n=3, ignore_eos=True)))
        assert len(engine.running) <= max_num_seqs
        runner.check_integrity()
    outs = [[(c.token_ids, c.finish_reason) for c in engine.output(rid).completions] for rid in ids]
    return outs, rows


@pytest.mark.parametrize("kind", ["paged", "v4", "hybrid"])
def test_a_requests_samples_count_against_max_num_seqs(kind):
    # The children forked off a request's prompt joined the running batch whatever
    # max_num_seqs said (n = 1000 ran steps of up to 364 rows at the default 64). A child past the cap
    # now waits as a preempted one would and is admitted through the prefix cache later:
    # no step above the cap, and the same tokens as the run with room for every sample.
    twin, twin_rows = _run_capped(kind, 64)
    assert max(twin_rows) > 4  # (the twin's batch does exceed the cap below)
    assert [len(completions) for completions in twin] == [7, 1, 3]
    outs, rows = _run_capped(kind, 4)
    assert max(rows) == 4  # (at the cap, never past it)
    assert outs == twin


def _recompute_release_run(kind: str, fault: str | None, aborted: bool) -> tuple[dict, list]:
    """A request "a" (5 prompt tokens) steps once on the tiny `kind` engine; then either a step
    whose forward raises (`fault` "raise": the release of "a" to recompute it raises in its
    cache's first group; "interrupt": Ctrl-C lands in that release, which completes) or, fault
    None, nothing; then "a" is aborted (`aborted`) and a new request reuses its id, or "a" runs
    on. Every request runs to its end. The cache's stats and the completions' tokens."""
    runner = _faulty_step_runner(kind)
    engine = _twin_engine(runner, 256, 16, True, True)
    cache, params = runner.cache, SamplingParams(max_tokens=4, ignore_eos=True)
    engine.add_request([1, 2, 3, 4, 5], params, request_id="a")
    engine.step()
    if fault is not None:
        execute, group = runner.execute, cache._group_list[0]
        release = group.release

        def faulty_execute(chunks):
            raise RuntimeError("injected forward fault")

        def faulty_release(state):
            if fault == "interrupt":
                signal.raise_signal(signal.SIGINT)
                release(state)
            else:
                raise RuntimeError("injected release fault")

        runner.execute, group.release = faulty_execute, faulty_release
        with pytest.raises((RuntimeError, KeyboardInterrupt)):
            engine.step()
        runner.execute = execute
        del group.release
        runner.check_integrity()
    tokens = []
    if aborted:
        engine.abort("a")
        tokens.append(engine.pop_output("a").completions[0].token_ids)
        engine.add_request([1, 2, 3, 4, 5], params, request_id="a")
    while engine.has_unfinished():
        engine.step()
        runner.check_integrity()
    tokens.append(engine.output("a").completions[0].token_ids)
    assert not cache._recomputing
    return dict(vars(cache.stats)), tokens


@pytest.mark.parametrize("kind", ["hybrid", "v4"])
@pytest.mark.parametrize("aborted", [False, True], ids=["runs_on", "aborted"])
@pytest.mark.parametrize("fault", ["raise", "interrupt"])
def test_a_recompute_release_that_raised_then_an_abort_leaves_exact_prefix_stats(kind, aborted, fault):
    # A step's fault releases "a" to recompute it (exact steps: the hybrid's, V4's), and that
    # release raises (or Ctrl-C lands in it). Run on, "a" counts once, as without the fault.
    # Aborted instead, its pending release was repeated as the abort's one call: the cache
    # kept "a/0" marked to recompute, and a new request reusing the id counted nothing
    # (1 request, 5 tokens; without the fault 2, 10). The abort's release now follows the
    # repeat, as it follows a completed one, and the stats are the fault-free run's.
    stats, tokens = _recompute_release_run(kind, fault, aborted)
    twin_stats, twin_tokens = _recompute_release_run(kind, None, aborted)
    assert stats == twin_stats
    assert (stats["num_requests"], stats["num_queried_tokens"]) == ((2, 10) if aborted else (1, 5))
    assert tokens[-1] == twin_tokens[-1]
