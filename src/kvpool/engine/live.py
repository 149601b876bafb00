"""A live workload served by an engine on the wall clock: what `kvpool run` measures.

    run = serve_live(engine, workload, params, turns=2, request_rate=2.0, rng=rng)
    report = run_report(engine, model_name="tiny", wall_s=run.wall_s, ...)  # workload/metrics.py

First turns and long prompts arrive as a Poisson process of `request_rate` per second
(workload/live.py `first_requests`; inf: all at time 0) and join the engine once the clock
passes their arrival; a follow-up turn joins when the previous turn of its conversation
finishes, its prompt made from that turn's completion (`workload.follow_up`); one that
no longer fits the context (max_model_len) is not sent, and its conversation ends there
(`context_ended`). TTFT counts from a request's arrival. Between steps with nothing to run
the loop sleeps until the next arrival.

Seeds: with `params.seed` None each request samples with its own seed, `derived_seed(
engine.seed, k)` for the k-th of `workload.request_ids(turns)` (`workload.request_index`) (the seed an engine gives its
k-th unseeded request, `Engine.seed_for`), numbered by its place in the workload rather than
by when it joins: the clock decides the order in which arrivals and follow-ups join, so a
number taken at joining would move from run to run. A given seed is every request's.

Each step is timed on its own (`step_s`: the steps' time, not the sleeps), the runner's
fragmentation is sampled after it, and the whole context of every sequence it ran is counted
as read (`kv_read_bytes`: prefills included, and the steps in which requests finished).
Ctrl-C (KeyboardInterrupt, or a subclass a SIGTERM handler raises) stops the loop: every
unfinished request is aborted, and `stopped` holds the exception, so the report covers the
requests that finished.

Tensor parallelism: every rank's engine must see the same requests at the same steps, so
rank 0's clock decides which arrivals are due and the others follow (one broadcast a step);
pass the rank's model as `tp_model`.
"""

from __future__ import annotations

import dataclasses
import random
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

from kvpool.engine.sampling import derived_seed
from kvpool.workload.live import LiveWorkload, request_id

if TYPE_CHECKING:
    from kvpool.engine.engine import Engine
    from kvpool.engine.sampling import SamplingParams


# the longest sleep before the loop looks at the clock again (time.sleep refuses more than
# about 9.2e9 s; the loop wakes, finds nothing due and sleeps the next slice)
MAX_SLEEP_S = 60.0


class LiveRun(NamedTuple):
    """What the loop measured."""

    wall_s: float  # first arrival's clock start to the last step (or the stop)
    step_s: float  # the engine's steps only
    fragmentation: list[float]  # runner.usage().fragmentation after each step
    kv_read_bytes: int  # KV bytes attention read over all steps
    stopped: KeyboardInterrupt | None  # what stopped the run early (None: every request finished)
    # the turns not sent because their prompt (the conversation so far) outgrew the context:
    # their conversations ended there, the run went on
    context_ended: tuple[str, ...] = ()


def num_live_requests(workload: LiveWorkload, turns: int) -> int:
    """The requests a run serves: every conversation's `turns` turns and the long prompts."""
    return len(workload.first_prompts) * turns + len(workload.long_prompts)


def serve_live(
    engine: Engine,
    workload: LiveWorkload,
    params: SamplingParams,
    *,
    turns: int,
    request_rate: float,
    rng: random.Random,
    on_progress: Callable[[int, float], None] | None = None,
    note_bookkeeping: bool = False,
    tp_model: Any = None,
    on_start: Callable[[], None] | None = None,
    on_unsent: Callable[[int], None] | None = None,
) -> LiveRun:
    """Serve `workload` (`turns` turns a conversation) through `engine` until every request
    finished or Ctrl-C. `on_progress(num_finished, elapsed_s)` after each step (the requests
    that step finished, the seconds since the start); `note_bookkeeping`: the runner notes its Python structures
    at their largest after each step (the memory ledger's); `tp_model`: this rank's model
    under tensor parallelism (None: one process); `on_start()` once every prompt known before
    the first arrival passed the length check (kvpool run's "serving" line); `on_unsent(n)` when
    a conversation outgrows the context: n of the turns counted (`num_live_requests`) will
    never be sent, that turn and its later ones (kvpool run's progress total shrinks by them).
    The run moves the workload's conversations on (their turns and histories): a workload
    served with follow-ups is spent, and serving it again is refused."""
    if turns <= 0:
        raise ValueError(f"turns must be positive, got {turns}")
    if any(conv.turn for conv in workload.conversations):
        raise ValueError("this workload's conversations were served already (follow-ups spent): make a new one")
    pending = workload.first_requests(request_rate, rng)
    # Every prompt known now is checked now: one too long for the context failed at its
    # arrival, after the run had served the others until then (`kvpool run --kv-memory 32MiB`:
    # 10 s, and minutes at a low --request-rate), and the run ended with no report
    for item in pending:
        engine.check_length(len(item.prompt_ids), item.request_id)
    if on_start is not None:
        on_start()
    conversation_of = {request_id(c, 0): c for c in range(len(workload.conversations))}

    # each request's parameters: its own seed where params give none (equal prompts drew
    # equal tokens when every request took one seed), `params` itself where they give one;
    # made as each request is sent (a dict of every turn the run might send, made up front,
    # was 24 million entries for `kvpool run --turns 1000000`: 6.6 GB, minutes, and the
    # conversations end at the context after a few turns)
    def params_of(rid: str) -> SamplingParams:
        if params.seed is not None:
            return params
        return dataclasses.replace(params, seed=derived_seed(engine.seed, workload.request_index(rid, turns)))

    runner = engine.runner
    fragmentation: list[float] = []
    kv_read_bytes = 0
    step_s = 0.0
    stopped: KeyboardInterrupt | None = None
    context_ended: list[str] = []
    tp_sync = tp_model is not None and tp_model.shard is not None
    start = time.perf_counter()
    try:
        while pending or engine.has_unfinished():
            now = time.perf_counter()
            due = sum(1 for item in pending if start + item.arrival_s <= now)
            if tp_sync:
                due = _rank0_count(tp_model, due)
            for _ in range(due):
                t, rid, prompt = pending.pop(0)
                engine.add_request(prompt, params_of(rid), rid, arrival_time=start + t)
            if not engine.has_unfinished():
                if not tp_sync:  # (in slices: an arrival 1e300 s away, a --request-rate of 1e-300,
                    # overflowed time.sleep, "timestamp out of range for platform time_t")
                    time.sleep(min(MAX_SLEEP_S, max(0.0, start + pending[0].arrival_s - time.perf_counter())))
                else:  # rank 0 sleeps; the others wait for its broadcast
                    time.sleep(max(0.0, min(0.01, start + pending[0].arrival_s - time.perf_counter())))
                continue
            t0 = time.perf_counter()
            finished = engine.step()
            step_s += time.perf_counter() - t0
            fragmentation.append(runner.usage().fragmentation)
            if note_bookkeeping:  # the manager's Python structures at their largest, for the ledger
                runner.note_bookkeeping()
            # Every sequence the step ran read its whole context (prefills included), those
            # that finished in it too: counted over `running` after the step, a request's
            # last step was left out (--max-tokens 1: two thirds of the reads)
            kv_read_bytes += sum(runner.kv_read_bytes(s.num_computed) for s in engine.last_step_sequences)
            if on_progress is not None:
                on_progress(len(finished), time.perf_counter() - start)
            for rid in finished:
                c = conversation_of.get(rid)
                if c is None:
                    continue
                conv = workload.conversations[c]
                if conv.turn + 1 < turns:
                    completion = engine.output(rid).completions[0]
                    prompt = workload.follow_up(conv, completion.token_ids, completion.text)
                    conv.turn += 1
                    nid = request_id(c, conv.turn)
                    if len(prompt) >= engine.runner.max_model_len:
                        # the conversation outgrew the context (a long answer, a small
                        # --max-model-len): it ends here, as a chat client's would be refused;
                        # add_request's ValueError stopped the whole run, with no report
                        context_ended.append(nid)
                        if on_unsent is not None:
                            on_unsent(turns - conv.turn)  # (turns conv.turn .. turns - 1)
                        continue
                    engine.add_request(prompt, params_of(nid), nid)
                    conversation_of[nid] = c
    except KeyboardInterrupt as stop:
        stopped = stop
        for rid in list(engine.requests):
            engine.abort(rid)
    return LiveRun(time.perf_counter() - start, step_s, fragmentation, kv_read_bytes, stopped, tuple(context_ended))


def _rank0_count(tp_model: Any, due: int) -> int:
    """Rank 0's count of due arrivals, broadcast to every rank."""
    import torch
    import torch.distributed as dist

    from kvpool.models.tensor_parallel import collective

    count = torch.tensor([due], dtype=torch.int64)
    collective(tp_model.tp_peers, lambda c=count: dist.broadcast(c, src=0, group=tp_model.tp_group))
    return int(count)
