"""StepChunks (engine/runner.py): a step's leading decodes held as columns, the other chunks
as they are. Its twin is the plain list of the same ScheduledChunk tuples: every way a
reader takes chunks (length, iteration, indexing, slices, equality, appends, the columns,
the count needing logits) must give what the list gives."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.engine.runner import ScheduledChunk, StepChunks, num_logits, prefill_step_tokens, step_columns


def _chunks(num_lead: int, rest: list[tuple[int, int, bool]]) -> tuple[StepChunks, list[ScheduledChunk]]:
    """A StepChunks of num_lead decodes then `rest` ((start, number of tokens, needs_logits)
    each), and its twin: the list of the same chunks."""
    ids = [f"r{i}/0" for i in range(num_lead)]
    tokens = [7 * i % 11 for i in range(num_lead)]
    starts = [10 + 3 * i for i in range(num_lead)]
    others = [
        ScheduledChunk(f"s{j}/0", list(range(start, start + n)), start, needs)
        for j, (start, n, needs) in enumerate(rest)
    ]
    twin = [ScheduledChunk(i, [t], s, True) for i, t, s in zip(ids, tokens, starts, strict=True)] + others
    return StepChunks(ids, tokens, starts, others), twin


@settings(max_examples=200, deadline=None)
@given(
    num_lead=st.integers(0, 6),
    rest=st.lists(st.tuples(st.integers(0, 40), st.integers(0, 5), st.booleans()), max_size=5),
    reads=st.lists(
        st.one_of(
            st.tuples(st.just("index"), st.integers(-12, 12)),
            st.tuples(
                st.just("slice"),
                st.one_of(st.none(), st.integers(-12, 12)),
                st.one_of(st.none(), st.integers(-12, 12)),
                st.sampled_from([None, 1, 2, -1]),
            ),
            st.tuples(st.just("append"), st.integers(0, 40)),
            st.tuples(st.just("iter")),
        ),
        max_size=8,
    ),
)
def test_step_chunks_read_as_the_list_of_its_chunks(num_lead, rest, reads):
    chunks, twin = _chunks(num_lead, rest)
    assert num_logits(chunks) == num_logits(twin) == sum(c.needs_logits for c in twin)
    for read in reads:
        assert len(chunks) == len(twin)
        if read[0] == "index":
            i = read[1]
            if -len(twin) <= i < len(twin):
                assert chunks[i] == twin[i] and type(chunks[i]) is ScheduledChunk
            else:
                with pytest.raises(IndexError):
                    chunks[i]
        elif read[0] == "slice":
            cut = slice(*read[1:])
            assert chunks[cut] == twin[cut] and type(chunks[cut]) is list
        elif read[0] == "append":
            chunk = ScheduledChunk("new/0", [1, 2], read[1], False)
            chunks.append(chunk)
            twin.append(chunk)
            assert chunks.columns is None  # (the columns no longer cover every chunk)
        else:
            assert list(chunks) == twin
    assert chunks == twin and chunks == StepChunks([], [], [], twin) and twin == chunks
    assert num_logits(chunks) == sum(c.needs_logits for c in twin)
    # the columns where the planner set them, else the twin's transposition
    columns = [list(c) for c in step_columns(chunks)]
    assert columns == [
        [c.request_id for c in twin],
        [c.start for c in twin],
        [c.start + len(c.token_ids) for c in twin],
    ]
    assert columns == [list(c) for c in step_columns(twin)]
    chunks.columns = (["x"], [0], [1])  # (what the planner sets is what step_columns gives: never checked)
    assert step_columns(chunks) == (["x"], [0], [1])


@settings(max_examples=200, deadline=None)
@given(
    num_lead=st.integers(0, 6),
    rest=st.lists(st.tuples(st.integers(0, 40), st.integers(1, 5), st.booleans()), max_size=5),
)
def test_a_prefill_steps_tokens_are_counted_without_making_the_leading_chunks(num_lead, rest):
    # the auto preemption's prefill rate: a step's tokens where some chunk has more than
    # one, else 0; StepChunks read only their other chunks, the list (the twin) every chunk
    chunks, twin = _chunks(num_lead, rest)
    num_tokens = sum(len(c.token_ids) for c in twin)
    expected = num_tokens if any(len(c.token_ids) > 1 for c in twin) else 0
    assert prefill_step_tokens(chunks) == prefill_step_tokens(twin) == expected
    assert chunks._rows is None


def test_a_step_with_one_row_gone_and_one_joined_counts_its_prefill_tokens():
    # 3 leading decodes, the last joiner's decode, a new joiner's 3-token prompt: 7 tokens;
    # without the prompt chunk, a step of decodes alone: 0
    chunks, _ = _chunks(3, [(7, 1, True), (0, 3, True)])
    assert prefill_step_tokens(chunks) == 7 and chunks._rows is None
    decodes, _ = _chunks(3, [(7, 1, True)])
    assert prefill_step_tokens(decodes) == 0 and prefill_step_tokens([]) == 0


def test_step_chunks_make_their_leading_chunks_only_when_read_as_chunks():
    # a reader of the columns, of the chunks after the leading ones, of the count needing
    # logits makes no leading chunk; iterating or indexing below them makes them, once
    chunks, twin = _chunks(3, [(5, 2, True), (9, 1, False)])
    assert chunks[3:] == twin[3:] and chunks[4] == twin[4] and chunks[-1] == twin[-1] and num_logits(chunks) == 4
    assert chunks._rows is None
    assert chunks[1] == twin[1]
    made = chunks._rows
    assert made == twin and list(chunks) == twin and chunks._rows is made
    with pytest.raises(ValueError, match="StepChunks: 2 ids, 1 tokens, 2 starts"):
        StepChunks(["a", "b"], [1], [0, 1])


def test_every_slice_and_index_of_unmade_step_chunks_is_the_lists():
    # each read on StepChunks whose leading chunks are not made yet (a read of the chunks
    # after them takes `rest` alone, any other makes them first): every index and slice of
    # 3 leading decodes and 3 other chunks against the list's
    rest = [(5, 2, True), (9, 1, False), (20, 3, True)]
    _, twin = _chunks(3, rest)
    bounds = [None, *range(-8, 9)]
    for start in bounds:
        for stop in bounds:
            for step in (None, 1, 2, -1):
                chunks, _ = _chunks(3, rest)
                assert chunks[start:stop:step] == twin[start:stop:step], (start, stop, step)
    for i in range(-8, 8):
        chunks, _ = _chunks(3, rest)
        if -6 <= i < 6:
            assert chunks[i] == twin[i], i
        else:
            with pytest.raises(IndexError):
                chunks[i]


def test_a_static_decode_of_the_columns_alone_takes_their_columns_and_equals_the_eager_engine():
    # an engine with batched sampling plans its plain decodes from its columns (StepChunks);
    # a decode step of the columns alone goes through the static buffers' decode with the
    # columns' tokens and starts as they are (no chunk made), as requests finish and join;
    # a step of the columns and other chunks is computed from the columns and the others.
    # Its twin: the eager engine (no buffers, the chunks' own tokens), the same tokens
    import torch

    from kvpool.engine.engine import Engine
    from kvpool.engine.llama_runner import llama_runner
    from kvpool.engine.sampling import SamplingParams
    from random_llama import DESCRIPTOR, random_ids, random_llama

    model = random_llama(seed=0, dtype=torch.float64)
    outputs, columns_alone, columns_and_chunks = [], [], []
    for mode in ("static", "eager"):
        runner = llama_runner(model, 64, 4, DESCRIPTOR, decode_mode=mode, max_num_seqs=8, max_num_batched_tokens=32)
        engine = Engine(runner, max_num_batched_tokens=32, max_num_seqs=6, batched_sampling=True)
        made = []  # per decode step of the columns alone: it made no chunk
        mixed: list[bool] = []  # per step of the columns and other chunks: its forward made no chunk
        if mode == "static":
            takes = runner.executor._takes_decode

            def taking(chunks, takes=takes, made=made):
                out = takes(chunks)
                if type(chunks) is StepChunks and not chunks.rest and out is not None:
                    made.append(chunks._rows is None)
                return out

            runner.executor._takes_decode = taking
            forward = runner.executor.forward

            def forwarding(chunks, cache, all_logits=False, forward=forward, mixed=mixed):
                out = forward(chunks, cache, all_logits)
                if type(chunks) is StepChunks and chunks.rest and chunks.lead_tokens and chunks.columns is not None:
                    mixed.append(chunks._rows is None)  # (a step of columns and other chunks)
                return out

            runner.executor.forward = forwarding
        ids = [
            engine.add_request(random_ids(5 + 3 * i, i), SamplingParams(max_tokens=6 + 3 * i, ignore_eos=True))
            for i in range(3)
        ]
        for step in range(200):
            if step in (4, 9):
                ids += [engine.add_request(random_ids(4, 20 + step), SamplingParams(max_tokens=5, ignore_eos=True))]
            if not engine.has_unfinished():
                break
            engine.step()
            runner.check_integrity()
        outputs.append([engine.output(i).completions[0].token_ids for i in ids])
        columns_alone.append(made)
        columns_and_chunks.append(mixed)
    assert outputs[0] == outputs[1]
    assert sum(columns_alone[0]) > 5 and all(columns_alone[0])
    # the forward of a step of the columns and other chunks (the joiners' prompts) reads the
    # columns and the other chunks, the leading chunks never made
    assert len(columns_and_chunks[0]) >= 2 and all(columns_and_chunks[0])


def test_a_v4_step_cut_at_checkpoints_forwards_step_chunks_as_the_list_of_its_chunks_does():
    # V4's dual pool cuts a step whose prefill chunk crosses checkpoint positions
    # (`_forward_cut`): the engine's StepChunks go to the first forward as a StepChunks
    # with its columns (the divided chunks' first pieces in its rest), the leading decodes
    # never made as chunks, also where a leading decode reaches a checkpoint in the cut step
    # (it is among the cut requests). Its twin: the same steps with the chunks as a plain
    # list. Every forward gets the same chunks in the same order, the step the same logits,
    # bit for bit
    import torch

    from kvpool.engine.dsv4_runner import dsv4_runner
    from kvpool.engine.engine import Engine
    from kvpool.engine.sampling import SamplingParams
    from kvpool.models.tiny_dsv4 import TinyDSV4

    torch.manual_seed(0)
    model = TinyDSV4(seed=0)
    runs = []
    for as_list in (False, True):
        runner = dsv4_runner(
            model, num_classical_blocks=64, num_state_blocks=8, restore="checkpoint", num_checkpoints=8
        )
        engine = Engine(runner, max_num_batched_tokens=512, max_num_seqs=8, batched_sampling=True)
        forwards: list[list[ScheduledChunk]] = []
        logits: list[torch.Tensor] = []
        cut_firsts: list[bool] = []  # per cut step's first forward: a StepChunks, its leading chunks unmade
        # per cut step: the leading decodes among the cut requests, whether its chunks stayed unmade
        cut_decodes: list[tuple[list[str], bool]] = []
        in_cut = [False]
        executor_forward, cut, execute = runner.executor.forward, runner._forward_cut, runner.execute

        def forward(
            chunks,
            cache,
            all_logits,
            forwards=forwards,
            in_cut=in_cut,
            cut_firsts=cut_firsts,
            executor_forward=executor_forward,
        ):
            if in_cut[0]:
                in_cut[0] = False
                cut_firsts.append(type(chunks) is StepChunks and chunks._rows is None)
            if type(chunks) is StepChunks and chunks.columns is not None:
                # the columns it carries are its chunks' own
                assert tuple(map(list, chunks.columns)) == tuple(map(list, step_columns(list(chunks))))
            forwards.append(list(chunks))
            return executor_forward(chunks, cache, all_logits)

        def forward_cut(chunks, *args, as_list=as_list, in_cut=in_cut, cut=cut, cut_decodes=cut_decodes):
            assert type(chunks) is StepChunks and chunks.lead_tokens  # (the steps cut here: decodes, a joiner)
            decodes = [i for i in args[5] if i in chunks.lead_ids]  # (args[5]: `cuts`)
            in_cut[0] = True
            out = cut(list(chunks) if as_list else chunks, *args)
            # (and the step's own StepChunks still unmade: the cut read the decodes' columns)
            cut_decodes.append((decodes, chunks._rows is None))
            return out

        def executing(chunks, all_logits=False, logits=logits, execute=execute):
            out = execute(chunks, all_logits)
            logits.append(out.clone())
            return out

        runner.executor.forward, runner._forward_cut, runner.execute = forward, forward_cut, executing
        g = torch.Generator().manual_seed(5)
        ids = [
            engine.add_request(torch.randint(0, 256, (n,), generator=g).tolist(), SamplingParams(max_tokens=40))
            for n in (5, 9, 125)  # (the third's decode in step 3 ends at 128, a checkpoint)
        ]
        for step in range(80):
            if step in (3, 6):  # joiners whose prompts cross one and two span boundaries (128, 256)
                prompt = torch.randint(0, 256, (150 if step == 3 else 300,), generator=g).tolist()
                ids.append(engine.add_request(prompt, SamplingParams(max_tokens=5)))
            if not engine.has_unfinished():
                break
            engine.step()
            runner.check_integrity()
        outputs = [engine.output(i).completions[0].token_ids for i in ids]
        runs.append((forwards, logits, outputs, cut_firsts, cut_decodes))
    (forwards, logits, outputs, cut_firsts, cut_decodes), twin = runs
    twin_forwards, twin_logits, twin_outputs, twin_cut_firsts, _ = twin
    # each joiner's prefill came cut beside the decodes' columns; the cut step's first forward
    # took a StepChunks, its leading chunks unmade (the twin's: a list)
    assert cut_firsts == [True, True] and twin_cut_firsts == [False, False]
    assert cut_decodes == [([f"{ids[2]}/0"], True), ([], True)]  # (step 3: the third request's decode)
    assert forwards == twin_forwards
    assert len(logits) == len(twin_logits) and all(torch.equal(a, b) for a, b in zip(logits, twin_logits, strict=True))
    assert outputs == twin_outputs and all(len(o) == 40 for o in outputs[:3])
