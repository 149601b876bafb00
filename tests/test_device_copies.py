"""The copies that exist only on a GPU, checked on the twin device (tests/twin_device.py:
meta tensors shadowed by CPU twins, so the device branches run without a GPU and what they
leave on the "device" can be read).

Four copies are a GPU's only way to see a step's values, and on the CPU (where the host
buffers are the device's) they never run: `StepBuffers.pad`'s padded rows (a CUDA graph's
padded rows then reach only the dummy block), `StepBuffers.plan_tables`' plan area (a mixed
step's extend kernel reads it), `DecodeGraphs.set_input_ids`' token ids (the graph's static
input), and the batched sampler's uniforms. Each test reads what the device holds after the
code ran and compares it with exact values and with the CPU's buffers (the independent
twin: the same calls on device="cpu"). Dropping any of the four copies, or sending it to
other entries, fails its test (audit13's planted faults P2, P4, P8, P9)."""

from __future__ import annotations

import random

import pytest
import torch

from kvpool.attention.backends.step_buffers import StepBuffers
from kvpool.attention.backends.triton_extend import plan_extend
from kvpool.engine.batch_sampler import BatchSampler, sample_batch
from kvpool.engine.cuda_graph import DecodeGraphs, bucket_for, buckets_up_to
from kvpool.engine.sampling import NonFiniteLogitsError, SamplingParams
from twin_device import TwinDevice, patch_cuda


@pytest.fixture
def device(monkeypatch):
    twin = TwinDevice()
    patch_cuda(monkeypatch, twin)
    with twin:
        yield twin


def on_device(device: TwinDevice, tensor: torch.Tensor) -> list:
    return device.values(tensor).tolist()


def step_vectors(device: TwinDevice | None, view) -> tuple[list, ...]:
    """A step's vectors as a kernel reads them: from the device (twins) or the CPU buffers."""
    tensors = (view.seq_rows, view.ctx_lens, view.query_start, view.slot_mapping, view.positions)
    return tuple(t.tolist() if device is None else on_device(device, t) for t in tensors)


def test_a_padded_decode_step_reaches_the_device(device) -> None:
    """pad's rows on the device: the step's sequences, then padding rows of one token at
    position 0 in the padding row (4), its slot the dummy block's first (9 * 4 = 36). The
    second step shrinks to one sequence: its padded row 1 must overwrite what the first
    step left there on the device (pad's copy dropped leaves seq_rows [1, 1])."""
    b = StepBuffers(max_num_seqs=4, max_num_tokens=8, max_blocks_per_seq=3, block_size=4, device="meta", dummy_block=9)
    b.update(["a", "b"], [0, 0], [5, 3], [[7, 2], [5]])  # prefills
    b.update(["a", "b"], [5, 3], [6, 4], [[7, 2], [5]])  # decodes: a at position 5 (block 2), b at 3 (block 5)
    view = b.pad(4)
    assert step_vectors(device, view) == ([0, 1, 4, 4], [6, 4, 1, 1], [0, 1, 2, 3, 4], [9, 23, 36, 36], [5, 3, 0, 0])
    device.caught_up()
    b.forget("a")
    b.update(["b"], [4], [5], [[5, 8]])  # b opens block 8
    view = b.pad(2)
    assert step_vectors(device, view) == ([1, 4], [5, 1], [0, 1, 2], [32, 36], [4, 0])
    assert on_device(device, b.block_tables[1]) == [5, 8, 0] and on_device(device, b.block_tables[4]) == [9, 9, 9]


def test_random_decode_steps_padded_to_their_buckets_equal_the_cpu_buffers_on_the_device(device) -> None:
    """120 random decode steps (requests joining with prompts, leaving, decoding through
    block boundaries), each through `advance` where it takes the step and `update` where not,
    then padded to its bucket as DecodeGraphs.run pads it: the device's step vectors and
    block table rows equal those of the same calls on CPU buffers, step by step."""
    rng = random.Random(13)
    bs, width, s = 4, 8, 8
    kwargs = dict(max_num_seqs=s, max_num_tokens=32, max_blocks_per_seq=width, block_size=bs, dummy_block=40)
    on_meta, on_cpu = StepBuffers(device="meta", **kwargs), StepBuffers(device="cpu", **kwargs)
    buckets = buckets_up_to(s)
    free = list(range(40))
    rng.shuffle(free)
    tables: dict[str, list[int]] = {}
    lens: dict[str, int] = {}
    running: list[str] = []
    for step in range(120):
        for rid in [r for r in running if rng.random() < 0.1 or lens[r] >= bs * width - 1]:
            running.remove(rid)
            free += tables.pop(rid)
            on_meta.forget(rid), on_cpu.forget(rid)
        joining = []
        while len(running) + len(joining) < s and rng.random() < 0.3:
            rid, prompt = f"r{step}.{len(joining)}", rng.randint(1, 9)
            tables[rid] = [free.pop() for _ in range(-(-prompt // bs))]
            lens[rid] = prompt
            joining.append(rid)
        if joining:  # their prompts in one step (no decode beside them: pad takes decodes only)
            starts = [0] * len(joining)
            ends = [lens[r] for r in joining]
            for b in (on_meta, on_cpu):
                b.update(joining, starts, ends, [tables[r] for r in joining])
            running += joining
            continue
        if not running:
            continue
        for rid in running:  # one token each, a block opened where it starts one
            if lens[rid] % bs == 0:
                tables[rid].append(free.pop())
        starts = [lens[r] for r in running]
        ends = [n + 1 for n in starts]
        for b in (on_meta, on_cpu):
            if not b.advance(running, starts, ends, lambda ids: [tables[r] for r in ids]):
                b.update(running, starts, ends, [tables[r] for r in running])
        for rid in running:
            lens[rid] += 1
        bucket = bucket_for(len(running), buckets)
        want, got = on_cpu.pad(bucket), on_meta.pad(bucket)
        assert step_vectors(device, got) == step_vectors(None, want), step
        assert on_device(device, on_meta.block_tables) == on_cpu.block_tables.tolist(), step
        on_meta.check_integrity(tables)
        device.caught_up()  # (the step's sampled tokens read: the device is done with it)


def test_the_plan_tables_reach_the_device(device) -> None:
    """plan_tables' views read, on the device, the tables just planned: two plans of other
    shapes one after another, the second's values where the first's were (plan_tables'
    copy dropped leaves zeros; a copy of the first plan's length only, its tail)."""
    b = StepBuffers(max_num_seqs=4, max_num_tokens=16, max_blocks_per_seq=4, block_size=4, device="meta")
    first = b.plan_tables([3, 1, 4, 0, 1, 5, 0, 0], (3, 2))
    assert [on_device(device, t) for t in first] == [[3, 1, 4], [1, 5]]
    device.caught_up()
    second = b.plan_tables([2, 7, 1, 8, 2, 8, 0, 0, 9, 0, 0, 0, 6, 6, 6, 6], (4, 2, 1, 4))
    assert [on_device(device, t) for t in second] == [[2, 7, 1, 8], [2, 8], [9], [6, 6, 6, 6]]


def test_a_mixed_steps_plan_in_the_plan_area_equals_a_new_plan_on_the_device(device) -> None:
    """plan_extend of a mixed step (two decodes and a prompt chunk, over the buffers' dense
    tables with host row offsets) stored in the plan area: every table, read on the device,
    equals the same plan made into new CPU tensors (store=None)."""
    b = StepBuffers(max_num_seqs=4, max_num_tokens=16, max_blocks_per_seq=4, block_size=4, device="meta")
    cpu_tables = torch.zeros(4 * 4, dtype=torch.int32)
    args = dict(block_size=4, num_heads=6, num_kv_heads=2)
    for step, (q_lens, ctx_lens, rows) in enumerate((([1, 1, 9], [7, 3, 9], [0, 1, 2]), ([5, 1], [14, 10], [2, 1]))):
        offsets = [row * 4 for row in rows]
        stored = plan_extend(q_lens, ctx_lens, offsets, b.block_tables_flat, device="meta", store=b.plan_tables, **args)
        want = plan_extend(q_lens, ctx_lens, offsets, cpu_tables, device="cpu", **args)
        for name in ("q_rows", "q_lens", "kv_indptr", "ctx_lens", "tile_seq", "tile_start", "part_rows", "merge_rows"):
            assert on_device(device, getattr(stored, name)) == getattr(want, name).tolist(), (step, name)
        assert (stored.block_m, stored.num_rows, stored.split_len) == (want.block_m, want.num_rows, want.split_len)
        device.caught_up()


def test_the_graphs_token_ids_reach_the_device(device) -> None:
    """DecodeGraphs' forward reads the step's token ids from its static input on the
    device: a step of 3 (padded to 4), then one of 2 (set_input_ids' copy dropped, the
    forward reads zeros; a copy of the last step's length, 3 ids)."""
    b = StepBuffers(max_num_seqs=4, max_num_tokens=8, max_blocks_per_seq=3, block_size=4, device="meta", dummy_block=9)
    seen: list[tuple[list[int], list[int]]] = []

    def forward(num_seqs: int) -> torch.Tensor:  # what a captured forward reads: the static inputs
        seen.append((on_device(device, graphs.input_ids[:num_seqs]), on_device(device, b.slot_mapping[:num_seqs])))
        return torch.zeros(num_seqs, 5, device="meta")

    graphs = DecodeGraphs(forward, b, capture=False)
    b.update(["a", "b", "c"], [0, 0, 0], [2, 3, 1], [[7], [5], [6]])
    b.update(["a", "b", "c"], [2, 3, 1], [3, 4, 2], [[7], [5], [6]])
    graphs.set_input_ids([11, 12, 13])
    assert graphs.run(3).shape == (3, 5)
    device.caught_up()
    b.forget("b")
    b.update(["a", "c"], [3, 2], [4, 3], [[7], [6]])
    graphs.set_input_ids([21, 23])
    graphs.run(2)
    assert seen == [([11, 12, 13, 0], [30, 23, 25, 36]), ([21, 23], [31, 26])]
    assert graphs.num_static == 2


PARAMS = [
    SamplingParams(temperature=0.9, seed=5),
    SamplingParams(),  # greedy
    SamplingParams(temperature=1.3, top_p=0.8, seed=-2),
    SamplingParams(temperature=0.7, top_k=3, seed=9),
    SamplingParams(temperature=1.0, top_k=4, top_p=0.9, seed=1),
    SamplingParams(temperature=1.5, min_p=0.3, seed=4),  # (its min-p column copied to the device)
    SamplingParams(temperature=1.1, top_k=5, top_p=0.95, min_p=0.1, seed=6),
]


@pytest.mark.parametrize(
    "params", [PARAMS, [PARAMS[0], PARAMS[2]] * 2, [PARAMS[5]] * 3], ids=["mixed", "all_draw", "all_min_p"]
)
def test_the_samplers_uniforms_reach_the_device(device, params) -> None:
    """A kept batch sampled over 36 steps at consecutive positions (the table of the coming
    AHEAD steps' uniforms, then its next) from logits on the device: every step the device's
    uniforms are the host's and every token is the CPU sampler's (the uniforms' copy dropped,
    the device keeps uninitialised memory; a copy of the first step only, its stale draws)."""
    rows = len(params)
    generator = torch.Generator().manual_seed(rows)
    on_meta, on_cpu, owners = BatchSampler(), BatchSampler(), list(range(rows))
    origins = [3 * i for i in range(rows)]
    for step in range(36):  # (the table made at step 1 serves steps 1-32; the next, from step 33)
        logits = torch.randn(rows, 6, generator=generator, dtype=torch.float64).float()
        lengths = [o + step for o in origins]
        of = lambda which=None: (params, list(range(rows)), origins)  # noqa: E731
        got = on_meta.sample(logits.to("meta"), owners, of, lambda lengths=lengths: lengths)
        want = on_cpu.sample(logits, owners, of, lambda lengths=lengths: lengths)
        kept = on_meta._rows
        assert kept.u.device.type == "meta" and device.values(kept.u).equal(kept.u_host), step
        assert got == want, step
        positions = [step] * rows
        assert sample_batch(logits.to("meta"), params, list(range(rows)), positions) == sample_batch(
            logits, params, list(range(rows)), positions
        ), step
        device.caught_up()


class _Row:  # an engine sequence as the sampler sees it: an owner compared by identity
    def __init__(self, params: SamplingParams, index: int, origin: int) -> None:
        self.params, self.index, self.origin = params, index, origin


def test_a_changing_batchs_parameters_and_uniforms_reach_the_device(device) -> None:
    """A batch drawing throughout in one group while rows leave and join (the sampler edits
    its rows in place: the parameter columns sent again, the uniforms' buffers kept where
    the size stays): over 30 steps on the device, every token is the CPU sampler's and the
    device's uniforms are the host's; the edit path was taken."""
    generator = torch.Generator().manual_seed(7)
    made = iter(range(1000))

    def row() -> _Row:
        i = next(made)
        return _Row(SamplingParams(temperature=0.5 + 0.1 * (i % 7), top_p=0.9, seed=i), i, 2 * i)

    batch = [row() for _ in range(5)]
    on_meta, on_cpu = BatchSampler(), BatchSampler()
    for step in range(30):
        if step % 4 == 1:  # one leaves, one joins at the end: the same size
            batch = batch[1:] + [row()]
        elif step % 4 == 2 and len(batch) > 2:  # one leaves from the middle
            batch = batch[:1] + batch[2:]
        elif step % 4 == 3:  # two join
            batch = batch + [row(), row()]
        logits = torch.randn(len(batch), 6, generator=generator, dtype=torch.float64).float()

        def of(which=None, batch=batch):
            picked = batch if which is None else [batch[i] for i in which]
            return [r.params for r in picked], [r.index for r in picked], [r.origin for r in picked]

        lengths = [r.origin + step for r in batch]
        got = on_meta.sample(logits.to("meta"), batch, of, lambda lengths=lengths: lengths)
        assert got == on_cpu.sample(logits, batch, of, lambda lengths=lengths: lengths), step
        assert device.values(on_meta._rows.u).equal(on_meta._rows.u_host), step
        device.caught_up()
    assert on_meta.num_edited == on_cpu.num_edited > 5


def test_a_mixed_step_does_not_wait_on_the_host_for_its_own_copies(device) -> None:
    """A mixed step (a prompt chunk beside decodes) writes its vectors (update) and then its
    plan (plan_tables, as the Triton backend's begin_buffered_step stores it) into pinned
    host twins, each copied to the device. The host waits only where a copy still reading a
    twin it rewrites was queued by an earlier step: after a step's one synchronisation (its
    sampled tokens' read, `caught_up`) no Event.synchronize stalls. The plan area waiting on
    the step's own vector copy (audit13 G4: another buffer, just queued) stalled every mixed
    step once. Two plans in one step without a read in between must still wait once (the
    first one's copy may be reading the area)."""
    b = StepBuffers(max_num_seqs=4, max_num_tokens=32, max_blocks_per_seq=4, block_size=4, device="meta")
    tables = {"a": [7, 2], "b": [5, 9], "c": [1, 3, 8]}  # (b opens 9 at its third step)
    steps = [
        (["a", "b"], [0, 0], [6, 3]),  # two prompts
        (["a", "b", "c"], [6, 3, 0], [7, 4, 5]),  # two decodes and c's first chunk
        (["a", "b", "c"], [7, 4, 5], [8, 5, 10]),  # two decodes and c's second chunk
    ]
    for ids, starts, ends in steps:
        b.update(ids, starts, ends, [tables[r] for r in ids])
        q_lens = [e - s for s, e in zip(starts, ends, strict=True)]
        offsets = [int(r) * 4 for r in b.host_seq_rows()[: len(ids)]]
        plan = plan_extend(q_lens, ends, offsets, b.block_tables_flat, 4, 4, 2, device="meta", store=b.plan_tables)
        assert on_device(device, plan.ctx_lens) == ends  # (the plan reached the device)
        assert device.host_waits == 0, (ids, starts)
        device.caught_up()  # the step's sampled tokens read
    b.plan_tables([1, 2, 0, 0], (2,))
    assert device.host_waits == 0
    b.plan_tables([3, 0, 0, 0], (1,))  # a second plan, the first's copy not known to be done
    assert device.host_waits == 1


def test_a_graphs_decode_step_does_not_wait_on_the_host(device) -> None:
    """Decode steps as the runner drives a CUDA graph's (the buffers' update or advance, the
    token ids, the padded run): no Event.synchronize stalls once each step's tokens are
    read, over steps that open a block, shrink the batch and pad to another bucket."""
    b = StepBuffers(max_num_seqs=4, max_num_tokens=8, max_blocks_per_seq=3, block_size=4, device="meta", dummy_block=9)
    graphs = DecodeGraphs(lambda n: torch.zeros(n, 5, device="meta"), b, capture=False)
    tables = {"a": [7, 2], "b": [5, 8], "c": [6]}
    b.update(["a", "b", "c"], [0, 0, 0], [3, 3, 2], [tables[r] for r in "abc"])
    device.caught_up()
    lens = {"a": 3, "b": 3, "c": 2}
    for step, ids in enumerate([["a", "b", "c"], ["a", "b", "c"], ["a", "b"], ["a", "b"]]):
        if step == 2:
            b.forget("c")
        starts = [lens[r] for r in ids]
        ends = [n + 1 for n in starts]
        if not b.advance(ids, starts, ends, lambda want: [tables[r] for r in want]):
            b.update(ids, starts, ends, [tables[r] for r in ids])
        graphs.set_input_ids([10 + i for i in range(len(ids))])
        graphs.run(len(ids))
        assert device.host_waits == 0, step
        device.caught_up()
        for r in ids:
            lens[r] += 1
    assert graphs.steps_by_bucket == {4: 2, 2: 2} and b.num_advanced >= 2


def test_the_samplers_finiteness_check_rides_in_the_one_read_on_the_device(device, monkeypatch):
    """On a device the batch sampler reads the host once a step, its tokens' `.tolist()`,
    with the rows whose logits give no token (a NaN, +inf, all -inf) marked in it: a row of
    NaN among drawing and greedy rows is named, and the others' tokens are the CPU's. A
    drawing row refused is drawn again from its logits less their maximum (finite logits
    whose scores overflowed at the temperature sample there), a second read, on the
    refused step alone; a greedy row refused is not (nothing of it was divided)."""
    params = PARAMS[:4]
    logits = torch.randn(4, 6, generator=torch.Generator().manual_seed(3))
    of = lambda which=None: (params, [0] * 4, [0] * 4)  # noqa: E731
    reads: list[str] = []
    original = torch.Tensor.tolist

    def counted(self, *args, **kwargs):
        reads.append("tolist")
        return original(self, *args, **kwargs)

    want = BatchSampler().sample(logits, list(range(4)), of, lambda: [5] * 4)
    monkeypatch.setattr(torch.Tensor, "tolist", counted)
    assert BatchSampler().sample(logits.to("meta"), list(range(4)), of, lambda: [5] * 4) == want
    assert reads == ["tolist"]
    for bad in (1, 2):  # a greedy row, a drawing one
        poisoned = logits.clone()
        poisoned[bad, 4] = float("nan")
        reads.clear()
        with pytest.raises(NonFiniteLogitsError) as refused:
            BatchSampler().sample(poisoned.to("meta"), list(range(4)), of, lambda: [5] * 4)
        assert refused.value.rows == [bad] and reads == (["tolist"] if bad == 1 else ["tolist", "tolist"])
