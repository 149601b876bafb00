"""The engine's pure-decode steps over the persistent step buffers (engine/cuda_graph.py
DecodeGraphs, driven by engine/llama_runner.py's executor): on the CPU the "static" mode
runs the graph path's padded static-buffer step without capture, against the ordinary
("eager") path of the same engine: the same tokens, logits equal to fp64 rounding, padded
rows that write only the dummy block. On CUDA (skipped without one) the captured graphs'
replays against eager."""

from __future__ import annotations

import pytest
import torch

from kvpool.attention.backends.step_buffers import StepBuffers
from kvpool.engine.engine import Engine
from kvpool.engine.llama_runner import llama_runner
from kvpool.engine.sampling import SamplingParams
from random_llama import DESCRIPTOR, random_ids, random_llama

TOL64 = 1e-12  # relative to the largest logit: fp64 sums in another order


@pytest.fixture(scope="module")
def model64():
    return random_llama("cpu", torch.float64)


def _serve(model, mode: str, *, runner_seqs: int, decode_path: str = "padded"):
    """Requests joining and leaving: 2 at first, 4 more after 3 steps, each its own output
    length, so the decode batch runs 1..6 sequences (buckets 1, 2, 4, 8, and past the
    runner's buffers when runner_seqs < 6). Returns the engine, its runner, the request ids."""
    runner = llama_runner(
        model,
        48,
        4,
        DESCRIPTOR,
        decode_path=decode_path,
        decode_mode=mode,
        max_num_seqs=runner_seqs,
        max_num_batched_tokens=32,
    )
    engine = Engine(runner, max_num_batched_tokens=32, max_num_seqs=6, record_logits=True)
    ids = [
        engine.add_request(random_ids(5 + 3 * i, i), SamplingParams(max_tokens=4 + 2 * i, ignore_eos=True))
        for i in range(2)
    ]
    for step in range(200):
        if step == 3:
            ids += [
                engine.add_request(random_ids(3 + i, 10 + i), SamplingParams(max_tokens=9 - i, ignore_eos=True))
                for i in range(4)
            ]
        if not engine.has_unfinished():
            break
        engine.step()
        runner.check_integrity()
    return engine, runner, ids


def _assert_same_outputs(a: Engine, ids_a: list[str], b: Engine, ids_b: list[str]) -> None:
    for x, y in zip(ids_a, ids_b, strict=True):
        sa, sb = a.requests[x].seqs[0], b.requests[y].seqs[0]
        assert sa.token_ids == sb.token_ids
        la, lb = torch.stack(sa.logits).cpu(), torch.stack(sb.logits).cpu()
        assert (la - lb).abs().max() <= TOL64 * lb.abs().max().clamp(min=1)


@pytest.mark.parametrize("runner_seqs", [8, 4], ids=["every-decode-buffered", "larger-steps-eager"])
def test_static_buffer_decodes_equal_the_ordinary_path_as_requests_join_and_leave(model64, runner_seqs):
    eager, eager_runner, eager_ids = _serve(model64, "eager", runner_seqs=runner_seqs)
    static, runner, ids = _serve(model64, "static", runner_seqs=runner_seqs)
    assert eager_runner.executor.decode_mode == "eager" and eager_runner.step_buffers is None
    _assert_same_outputs(eager, eager_ids, static, ids)
    graphs = runner.executor._graphs
    if runner_seqs == 8:  # decodes of 1 to 6 sequences, each in its bucket
        assert set(graphs.steps_by_bucket) == {1, 2, 4, 8} and graphs.num_eager == 0
    else:  # steps of 5 or 6 sequences do not fit 4 rows: skipped by the buffers, run eagerly
        assert set(graphs.steps_by_bucket) == {1, 2, 4}
    # the pools alike outside the dummy block (block 48, past the cache's 48)
    keep = slice(0, 48)
    for pool in ("k", "v"):
        got, want = getattr(runner.executor.storage, pool), getattr(eager_runner.executor.storage, pool)
        assert got.shape[1] == want.shape[1] + 1 == 49
        assert (got[:, keep] - want).abs().max() <= TOL64 * want.abs().max()


def test_buckets_stop_at_the_token_budget_when_it_is_below_max_num_seqs(model64):
    """max_num_batched_tokens 5 < max_num_seqs 8: the buffers hold 5 slots and positions,
    so a decode of 5 sequences replays a bucket of 5, not 8 (padding to 8 used to cut
    slot_mapping and positions at 5 and fail the forward); same tokens and logits as eager."""

    def serve(mode: str):
        runner = llama_runner(
            model64, 48, 4, DESCRIPTOR, decode_path="padded", decode_mode=mode, max_num_seqs=8, max_num_batched_tokens=5
        )
        engine = Engine(runner, max_num_batched_tokens=5, max_num_seqs=8, record_logits=True)
        ids = [
            engine.add_request(random_ids(1, i), SamplingParams(max_tokens=3 + i % 2, ignore_eos=True))
            for i in range(5)
        ]
        while engine.has_unfinished():
            engine.step()
            runner.check_integrity()
        return engine, runner, ids

    eager, _, eager_ids = serve("eager")
    static, runner, ids = serve("static")
    _assert_same_outputs(eager, eager_ids, static, ids)
    graphs = runner.executor._graphs
    assert graphs.buckets == (1, 2, 4, 5)
    assert set(graphs.steps_by_bucket) == {2, 5} and graphs.num_eager == 0  # 5 rows, then the 2 with 4 tokens
    with pytest.raises(ValueError, match="cannot pad to 6 sequences of one token, more than max_num_tokens 5"):
        runner.step_buffers.pad(6)


def test_a_padded_decode_writes_only_its_slots_and_the_dummy_block(model64):
    runner = llama_runner(model64, 24, 4, DESCRIPTOR, decode_path="padded", decode_mode="static", max_num_seqs=8)
    engine = Engine(runner, max_num_batched_tokens=64, max_num_seqs=8)
    for i in range(3):
        engine.add_request(random_ids(6 + i, i), SamplingParams(max_tokens=5, ignore_eos=True))
    engine.step()  # the three prompts
    storage = runner.executor.storage
    before_k, before_v = storage.k.clone(), storage.v.clone()
    positions = [len(s.token_ids) - 1 for r in engine.requests.values() for s in r.seqs]
    engine.step()  # 3 decodes, padded to the bucket of 4
    assert runner.executor._graphs.steps_by_bucket == {4: 1}
    # the step's slots, from the cache: each sequence's decoded position in its table
    slots = {
        (runner.cache.block_ids(s.seq_id)[p // 4], p % 4)
        for p, s in zip(positions, [s for r in engine.requests.values() for s in r.seqs], strict=True)
    }
    # which (block, offset) slots changed, in any layer, head or dimension
    changed_k = (storage.k != before_k).any(dim=(0, 2, 3)).nonzero().tolist()  # K^T: [L, B, KVH, D, bs]
    changed_v = (storage.v != before_v).any(dim=(0, 2, 4)).nonzero().tolist()  # V: [L, B, KVH, bs, D]
    dummy = 24
    assert {tuple(x) for x in changed_k} == {tuple(x) for x in changed_v} == slots | {(dummy, 0)}


def test_the_triton_backend_reads_the_decode_from_the_buffers(model64, monkeypatch):
    """The Triton backend's buffered decode (paged_decode_dense over the step buffers, in
    Triton's interpreter here) in static mode against the torch backend's ordinary path."""
    pytest.importorskip("triton")
    from kvpool.attention.backends import BACKENDS, BackendKey
    from kvpool.attention.backends.triton_decode import interpreted
    from kvpool.attention.backends.triton_paged import TritonPagedBackend

    if not interpreted():
        pytest.skip("the interpreted Triton backend runs on the CPU only under TRITON_INTERPRET=1")
    monkeypatch.setitem(BACKENDS, BackendKey("full", "paged", "cpu", "triton"), TritonPagedBackend)

    def serve(path: str, mode: str):
        runner = llama_runner(model64, 16, 4, DESCRIPTOR, decode_path=path, decode_mode=mode, max_num_seqs=4)
        engine = Engine(runner, max_num_batched_tokens=32, max_num_seqs=4, record_logits=True)
        ids = [
            engine.add_request(random_ids(4 + 3 * i, i), SamplingParams(max_tokens=2 + i, ignore_eos=True))
            for i in range(3)
        ]
        while engine.has_unfinished():
            engine.step()
            runner.check_integrity()
        return engine, runner, ids

    ref, _, ref_ids = serve("padded", "eager")
    got, runner, ids = serve("triton", "static")
    assert runner.executor._graphs.num_static >= 3 and runner.executor.last_decode_path == "triton"
    _assert_same_outputs(ref, ref_ids, got, ids)


@pytest.mark.parametrize("mode", ["eager", "static"])
def test_a_chunk_that_skips_the_computed_prefix_is_refused_in_either_mode(model64, monkeypatch, mode):
    """runner.run of positions [4, 8) of a request admitted with 8 tokens and none computed:
    eager mode plans from the cache's lists (step_tables checks the chunk), static mode
    from the step buffers (the forward's own check): the same one-line ValueError either
    way, not attention over K/V [0, 4) never written. The whole prompt then runs, its
    logits bit for bit a fresh eager runner's."""
    pytest.importorskip("triton")
    from kvpool.attention.backends import BACKENDS, BackendKey
    from kvpool.attention.backends.triton_decode import interpreted
    from kvpool.attention.backends.triton_paged import TritonPagedBackend

    if not interpreted():
        pytest.skip("the interpreted Triton backend runs on the CPU only under TRITON_INTERPRET=1")
    monkeypatch.setitem(BACKENDS, BackendKey("full", "paged", "cpu", "triton"), TritonPagedBackend)
    ids = random_ids(8, 3)
    runner = llama_runner(model64, 16, 4, DESCRIPTOR, decode_path="triton", decode_mode=mode)
    runner.admit("a", ids, None)
    message = r"request 'a': positions \[4, 8\) do not continue its 0 computed tokens within the reserved \[0, 8\)"
    with pytest.raises(ValueError, match=message):
        runner.run([("a", ids[4:], 4)])
    assert runner.num_computed_tokens("a") == 0
    (logits,) = runner.run([("a", ids, 0)])
    assert runner.executor.num_buffered_steps == (mode == "static")  # the refused step planned nothing
    fresh = llama_runner(model64, 16, 4, DESCRIPTOR, decode_path="triton", decode_mode="eager")
    fresh.admit("a", ids, None)
    assert torch.equal(logits, fresh.run([("a", ids, 0)])[0])  # as if nothing had been refused


@pytest.mark.parametrize("mode", ["eager", "static"])
def test_a_decode_past_its_reservation_is_refused_in_either_mode_and_writes_nothing(model64, mode):
    """Two requests each prefilled and committed ("a" fills its two blocks of 4, so its
    reservation ends at 8), then a decode step in which "b" was reserved its next token and
    "a" was not: the eager path plans from the cache's lists (step_tables refuses "a"),
    static mode from the step buffers (a pure decode the graphs would take: the runner's own
    check; the buffers used to refuse it with a message of their own), and a decode of "b"
    at a position it has computed (static mode used to run it). The same one-line
    ValueError either way, and in static mode the buffers exactly as they were."""
    from kvpool.engine.runner import ScheduledChunk
    from test_step_buffers import assert_same_snapshot, snapshot

    runner = llama_runner(model64, 16, 4, DESCRIPTOR, decode_path="padded", decode_mode=mode, max_num_seqs=4)
    prompts = {"a": random_ids(8, 1), "b": random_ids(5, 2)}
    for rid, ids in prompts.items():
        assert runner.admit(rid, ids, None) is not None
    chunks = [ScheduledChunk(rid, ids, 0, True) for rid, ids in prompts.items()]
    firsts = runner.execute(chunks).argmax(dim=-1).tolist()
    runner.commit_step(list(prompts), [8, 5], firsts)
    assert runner.reserve_step(["b"], [1])
    buffers = runner.step_buffers
    before = snapshot(buffers) if buffers is not None else None
    decode = [ScheduledChunk("a", [firsts[0]], 8, True), ScheduledChunk("b", [firsts[1]], 5, True)]
    message = r"request 'a': positions \[8, 9\) do not continue its 8 computed tokens within the reserved \[0, 8\)"
    with pytest.raises(ValueError, match=message):
        runner.execute(decode)
    # ... and a decode that rewrites a computed position within the reservation
    again = [ScheduledChunk("b", [firsts[1]], 4, True)]
    message = r"request 'b': positions \[4, 5\) do not continue its 5 computed tokens within the reserved \[0, 8\)"
    with pytest.raises(ValueError, match=message):
        runner.execute(again)
    if buffers is not None:
        assert_same_snapshot(before, snapshot(buffers))
        assert runner.executor._graphs.num_static == 0
    runner.check_integrity()
    # reserved, the same step runs, and its logits are the eager runner's
    assert runner.reserve_step(["a"], [1])
    logits = runner.execute(decode)
    fresh = llama_runner(model64, 16, 4, DESCRIPTOR, decode_path="padded")
    for rid, ids in prompts.items():
        fresh.admit(rid, ids, None)
    fresh.execute(chunks)
    fresh.commit_step(list(prompts), [8, 5], firsts)
    assert fresh.reserve_step(["a", "b"], [1, 1])
    expected = fresh.execute(decode)
    scale = expected.abs().max()
    assert ((logits - expected).abs().max() / scale).item() <= TOL64


def test_the_triton_backend_plans_prefill_and_mixed_steps_from_the_buffers(model64, monkeypatch):
    """Static mode on the Triton backend: every step the runner puts in the step buffers
    that is not a pure decode (prefills, chunks over a cached prefix, chunked prefills
    beside decodes) is planned from the buffers (`begin_buffered_step`: the dense table
    rows, slots and positions) instead of the cache's lists. The same kernels over the
    same blocks: tokens and every logit bit for bit the eager engine's on the same
    backend, which plans every step from the lists."""
    pytest.importorskip("triton")
    from kvpool.attention.backends import BACKENDS, BackendKey
    from kvpool.attention.backends.triton_decode import interpreted
    from kvpool.attention.backends.triton_paged import TritonPagedBackend

    if not interpreted():
        pytest.skip("the interpreted Triton backend runs on the CPU only under TRITON_INTERPRET=1")
    monkeypatch.setitem(BACKENDS, BackendKey("full", "paged", "cpu", "triton"), TritonPagedBackend)
    shared = random_ids(9, 50)

    planned: list[list[int]] = []  # the q_lens of each step planned from the buffers

    def serve(mode: str):
        runner = llama_runner(model64, 24, 4, DESCRIPTOR, decode_path="triton", decode_mode=mode, max_num_seqs=4)
        attention = runner.executor.attention
        begin = attention.begin_buffered_step
        attention.begin_buffered_step = lambda buffers, q_lens, ctx_lens: (
            planned.append(list(q_lens)) or begin(buffers, q_lens, ctx_lens)
        )
        # a budget of 12 tokens: prompts are cut into chunks that share steps with decodes
        engine = Engine(runner, max_num_batched_tokens=12, max_num_seqs=4, record_logits=True)
        ids = []
        for i in range(3):  # the later ones hit the first's prompt blocks: chunks over a cached prefix
            prompt = shared + random_ids(2 + 5 * i, i)
            ids.append(engine.add_request(prompt, SamplingParams(max_tokens=2 + i, ignore_eos=True)))
            engine.step()
        while engine.has_unfinished():
            engine.step()
            runner.check_integrity()
        return engine, runner, ids

    ref, ref_runner, ref_ids = serve("eager")
    got, runner, ids = serve("static")
    executor = runner.executor
    assert ref_runner.executor.num_buffered_steps == 0 and ref.runner.cache.stats.num_hit_tokens > 0
    # every step the graphs did not take was planned from the buffers
    assert executor.num_buffered_steps == got.num_steps - executor._graphs.num_static == len(planned) >= 3
    # prefills alone, and chunks beside decodes (both kernels of a mixed step)
    assert any(min(q) > 1 for q in planned) and any(min(q) == 1 < max(q) for q in planned)
    for x, y in zip(ref_ids, ids, strict=True):
        a, b = ref.requests[x].seqs[0], got.requests[y].seqs[0]
        assert a.token_ids == b.token_ids
        assert torch.equal(torch.stack(a.logits), torch.stack(b.logits))


@pytest.mark.parametrize(
    ("seqs", "tokens"), [(10**20, 64), (64, 10**20), (10**13, 64), (64, 10**13)], ids=["seqs", "tokens", "s13", "t13"]
)
def test_step_buffers_too_large_for_the_machine_are_refused_in_one_line(model64, seqs, tokens):
    """`kvpool run --max-num-seqs 99999999999999999999` (or --max-num-batched-tokens) on
    CUDA, whose decode steps keep their metadata in step buffers of that many rows: a
    TypeError from torch.zeros past int64 (or a RuntimeError of the allocator below it), a
    traceback; now the check_fits line the pool's size gets, naming both options."""
    message = (
        r"the decode steps' persistent metadata for --max-num-seqs \d+ and --max-num-batched-tokens \d+ needs "
        r".* GiB but this machine has .*; lower --max-num-seqs or --max-num-batched-tokens, or give --enforce-eager$"
    )
    with pytest.raises(ValueError, match=message):
        llama_runner(model64, 8, 4, DESCRIPTOR, decode_mode="static", max_num_seqs=seqs, max_num_batched_tokens=tokens)


def test_the_step_buffers_bytes_checked_are_those_allocated():
    buffers = StepBuffers(5, 7, 3, 4, "cpu")
    held = (buffers._vec_host, buffers._pos_host, buffers._tables_host, buffers._plan_host)
    assert StepBuffers.num_bytes(5, 7, 3, on_cpu=True) == (sum(t.nbytes for t in held), 0)
    # off the CPU: each on the device too, and the host list of changed table entries
    host, device = StepBuffers.num_bytes(5, 7, 3, on_cpu=False)
    assert device == sum(t.nbytes for t in held) and host == device + 2 * 8 * 6 * 3


def test_bad_decode_modes_are_refused_naming_them(model64):
    with pytest.raises(ValueError, match="unknown decode mode 'fast'; one of eager, static, graphs"):
        llama_runner(model64, 8, 4, DESCRIPTOR, decode_mode="fast")
    with pytest.raises(ValueError, match="decode mode 'graphs' captures CUDA graphs: the model is on cpu"):
        llama_runner(model64, 8, 4, DESCRIPTOR, decode_mode="graphs")
    # a backend that cannot read the buffers (the C kernels: none in fp64, so a quantized
    # pool here) keeps the ordinary path
    runner = llama_runner(model64, 8, 4, DESCRIPTOR, decode_mode="static", kv_format="int8")
    assert runner.executor.decode_mode == "eager" and runner.step_buffers is None
    # ... and so holds no dummy block: the pool and its capacity are the eager runner's
    eager = llama_runner(model64, 8, 4, DESCRIPTOR, kv_format="int8")
    assert runner.executor.storage.k.shape[1] == eager.executor.storage.k.shape[1] == 8
    stats, eager_stats = runner.executor.cache_stats(runner.cache), eager.executor.cache_stats(eager.cache)
    assert stats["kv_capacity_bytes"] == eager_stats["kv_capacity_bytes"]


HOST_READS = ("tolist", "item", "__int__", "__float__", "__bool__", "__index__", "numpy", "cpu")


def test_a_buffered_decode_step_reads_the_device_once_for_its_sampled_tokens(model64, monkeypatch):
    """A decode step through the static buffers with batched sampling reads tensor values on
    the host only for its sampled ids, `.tolist()` (each such read is a device
    synchronisation on CUDA): greedy rows and stochastic ones (temperature, top-k, top-p,
    seeds) alike, in one step. On the CPU the rows' finiteness values are listed too (host
    memory, no wait: `_finite_tokens`); on a device they ride in the ids' one read
    (tests/test_device_copies.py counts it there)."""
    runner = llama_runner(model64, 32, 4, DESCRIPTOR, decode_path="padded", decode_mode="static", max_num_seqs=4)
    engine = Engine(runner, max_num_batched_tokens=64, max_num_seqs=4, batched_sampling=True)
    kinds = [
        {},
        {"temperature": 0.9, "seed": 3},
        {"temperature": 1.2, "top_k": 20, "seed": -4},
        {"temperature": 0.8, "top_p": 0.8},
    ]
    for i, kind in enumerate(kinds):
        engine.add_request(random_ids(5 + i, i), SamplingParams(max_tokens=4, ignore_eos=True, **kind))
    engine.step()  # the prompts
    reads: list[str] = []
    for name in HOST_READS:
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _name=name, _original=original, **kwargs):
            reads.append(_name)
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    for _ in range(2):
        reads.clear()
        engine.step()
        assert reads == ["tolist", "tolist"]
    monkeypatch.undo()
    assert runner.executor._graphs.steps_by_bucket == {4: 2}


def test_the_forward_takes_the_position_bound_from_the_host_when_given(model64):
    """A captured forward cannot read positions.max() (a synchronisation): given the step's
    largest position on the host, the forward checks that one, not the tensor's."""
    from kvpool.attention.backends.step import StepMetadata, function_step

    attend = function_step(lambda layer, q, k, v: q, 1).attention  # (any attention: never reached)
    ids, positions = torch.tensor([1]), torch.tensor([3])
    with pytest.raises(ValueError, match="position 2048 exceeds the model's context 2048"):
        model64.forward(ids, positions, StepMetadata(attend, None, 2048))
    with pytest.raises(ValueError, match="position 4000 exceeds the model's context 2048"):
        model64.forward(ids, torch.tensor([4000]), StepMetadata(attend, None))  # no bound: the tensor's


def test_buffers_refuse_a_step_they_cannot_hold_and_forget_its_requests():
    b = StepBuffers(max_num_seqs=2, max_num_tokens=4, max_blocks_per_seq=2, block_size=4, dummy_block=7)
    b.update(["a", "b"], [0, 0], [2, 2], [[0], [1]])
    assert b.fits(["a", "b"], 2) and not b.fits(["a", "b"], 5) and not b.fits(["a", "c"], 2)
    assert not b.fits(["a", "b", "c"], 3)
    b.skip(["a"])  # "a" is forgotten: its row is free, and the buffers hold no step
    assert (b.num_seqs, b.num_tokens) == (0, 0) and b.fits(["c", "b"], 2)
    v = b.update(["c", "b"], [0, 2], [1, 3], [[3], [1]])
    assert v.seq_rows.tolist() == [0, 1] and v.slot_mapping.tolist() == [12, 6]
    b.check_integrity({"c": [3], "b": [1]})


# ---- on CUDA ------------------------------------------------------------------------------


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_graph_replays_equal_the_eager_engine_on_cuda():
    """fp32 on CUDA: the same greedy tokens; logits within 1e-4 of the largest (the two
    paths sum in other orders: the eager path's decodes through the CSR kernel, the graphs'
    through the dense one, over other batch shapes); every bucket captured when the runner
    is built, none while serving, and the graphs' pool in the memory ledger; the decode
    forward a capture warms up with (run eagerly) never synchronises. The torch backend
    keeps the eager path under "graphs"."""
    pytest.importorskip("triton")
    decode_path = "triton"
    bags = llama_runner(random_llama("cuda", torch.float32), 8, 4, DESCRIPTOR, decode_path="bags", decode_mode="graphs")
    assert bags.executor.decode_mode == "eager" and bags.step_buffers is None
    model = random_llama("cuda", torch.float32)
    built = llama_runner(model, 48, 4, DESCRIPTOR, decode_path=decode_path, decode_mode="graphs", max_num_seqs=8)
    graphs = built.executor._graphs
    assert set(graphs.graphs) == set(graphs.buckets) == {1, 2, 4, 8} and graphs.num_replays == 0
    from kvpool.engine.memory import measure

    workspace = measure(built, 0, 0).details["workspace"]
    assert workspace["graph_logits"] == (1 + 2 + 4 + 8) * model.config.vocab_size * 4  # fp32 rows
    assert workspace["graph_pool"] > 0
    eager, _, eager_ids = _serve(model, "eager", runner_seqs=8, decode_path=decode_path)
    graphed, runner, ids = _serve(model, "graphs", runner_seqs=8, decode_path=decode_path)
    graphs = runner.executor._graphs
    assert graphs.num_replays > 10 and len(graphs.graphs) == 4  # (captured at build: none since)
    for x, y in zip(eager_ids, ids, strict=True):
        sa, sb = eager.requests[x].seqs[0], graphed.requests[y].seqs[0]
        assert sa.token_ids == sb.token_ids
        la, lb = torch.stack(sa.logits), torch.stack(sb.logits)
        assert (la - lb).abs().max() <= 1e-4 * la.abs().max()
    # the decode forward that a capture's warm-ups run eagerly (a replay cannot synchronise,
    # and the capture itself synchronises first) waits on the device nowhere: a step of one
    # sequence at the dummy block's slot 0, padded to bucket 2
    buffers, executor = runner.step_buffers, runner.executor
    buffers.update(["x"], [0], [1], [[buffers.dummy_block]])
    graphs.set_input_ids([1])
    buffers.pad(2)
    executor._decode_max_position = 0
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        executor._decode_forward(2)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    buffers.forget("x")
    buffers.clear()


def test_an_empty_chunk_in_static_mode_is_refused_by_name(model64):
    """The step buffers plan chunks of at least one token: an empty chunk at the computed
    position is refused with a message that says so (it read "positions [5, 5) do not
    continue its 5 computed tokens", which contradicts itself), the buffers untouched."""
    from kvpool.engine.runner import ScheduledChunk
    from test_step_buffers import assert_same_snapshot, snapshot

    runner = llama_runner(model64, 16, 4, DESCRIPTOR, decode_path="padded", decode_mode="static", max_num_seqs=4)
    ids = random_ids(5, 2)
    assert runner.admit("b", ids, None) is not None
    first = runner.execute([ScheduledChunk("b", ids, 0, True)]).argmax(dim=-1).tolist()
    runner.commit_step(["b"], [5], first)
    assert runner.reserve_step(["b"], [1])
    before = snapshot(runner.step_buffers)
    with pytest.raises(ValueError, match=r"request 'b': an empty chunk at position 5: a step planned from"):
        runner.execute([ScheduledChunk("b", [], 5, False)])
    assert_same_snapshot(before, snapshot(runner.step_buffers))
    runner.check_integrity()
