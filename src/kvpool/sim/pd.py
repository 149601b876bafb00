"""Prefill / decode disaggregation in the simulator (`kvpool simulate --prefill-replicas P`).

P prefill replicas compute prompts; `--replicas` D decode replicas decode them; each is the
engine over the layout's cache and the cost executor, as in sim/simulator.py. A request
goes:

    arrival -> a prefill replica (router): its prompt computed, its first token sampled
            -> its KV over the prefill replica's link to a decode replica (router)
            -> the decode replica: installs the blocks, computes the prompt's unfinished
               last block (fewer than a block of tokens), then decodes every output token

as kvpool's own P/D does (engine/disaggregated.py: the decode side asks for the full blocks
it does not hold, installs them as cached blocks and admits the request, which hits them;
the tail block is computed there). TTFT counts from the arrival to the decode replica's
first token: the prefill, the wait for the link, the transfer and the tail's step.

The transfer: the prompt's full blocks after the decode replica's own prefix hit (a turn
whose history that replica holds sends only what is new), block_size x the planner's KV
bytes per token of the whole model (every layer and KV head: capacity/pd.py's
transfer_bytes_per_request), over the prefill replica's link:

    transfer_s = latency + num_bytes / bandwidth

One link per prefill replica (its NICs to the decode side together), first come first
served: a transfer starts when the prefill finishes or when the link is free, whichever
is later, so transfers queue behind each other. A block evicted from the decode replica
between the transfer and the request's admission is computed there again (as a landing
tier too small does in the engine). Both sides run the same model, GPU, TP and layout,
which must be `paged`: the install admits the blocks' tokens into the decode replica's
cache and commits them (`_install`), which publishes full-attention blocks by their
content; a window, a contiguous reservation or V4's state would need more than that.
The router's policy (`--routing`) picks a replica on each side.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass

from kvpool.engine.sampling import SamplingParams
from kvpool.sim.cost import CostModel
from kvpool.sim.executor import answer_seed
from kvpool.sim.routing import Router
from kvpool.sim.simulator import (
    Replica,
    RequestRecord,
    SimConfig,
    _make_replica,
    _quarters,
    check_request_lens,
    plan_replica,
)
from kvpool.spec.gpus import GPUSpec
from kvpool.spec.models import ModelSpec
from kvpool.workload.metrics import p50_p99
from kvpool.workload.sessions import Workload


@dataclass(frozen=True)
class KVLink:
    """A prefill replica's link to the decode replicas."""

    bandwidth_bytes_per_s: float
    latency_s: float

    def __post_init__(self) -> None:
        if not self.bandwidth_bytes_per_s > 0:
            raise ValueError(f"KV transfer bandwidth must be > 0 bytes/s, got {self.bandwidth_bytes_per_s}")
        if not self.latency_s >= 0:
            raise ValueError(f"KV transfer latency must be >= 0 s, got {self.latency_s}")

    def transfer_s(self, num_bytes: float) -> float:
        return self.latency_s + num_bytes / self.bandwidth_bytes_per_s


@dataclass
class _Transfer:
    """One request's KV on its way: from prefill replica `src` to decode replica `dst`."""

    request_id: str
    prompt: list[int]
    tenant: str
    arrival_s: float
    dst: Replica
    first_block: int  # the decode replica's hit when the transfer started, in blocks
    num_blocks: int  # blocks sent: [first_block, first_block + num_blocks) of the prompt


def _install(rep: Replica, t: _Transfer, block_size: int) -> int:
    """Put the transferred blocks into the decode replica's cache as cached blocks nobody
    holds (what the engine's landing tier and admission do): admitted under an id of their
    own, reserved, committed (each full block published), released; the number of blocks
    installed. Nothing is priced: the link carried the bytes. When the replica's hit has
    shrunk since the transfer started, the blocks before the transferred ones are gone and
    nothing is installed (the decode replica computes the prompt from its hit); so it is
    when the pool cannot take them now. An install is not a request: it is left out of the
    replica's prefix-cache figures."""
    if t.num_blocks == 0:
        return 0
    cache = rep.runner.cache
    end = (t.first_block + t.num_blocks) * block_size
    tokens = t.prompt[:end]
    stats = cache.stats
    counted = stats.num_queried_tokens, stats.num_hit_tokens
    install_id = f"{t.request_id} (P/D install)"
    admission = cache.admit(install_id, tokens, tenant_salt=t.tenant)
    stats.num_queried_tokens, stats.num_hit_tokens = counted
    if admission is None:
        return 0
    hit = cache.num_computed_tokens(install_id)
    if hit < t.first_block * block_size:  # a gap before the transferred blocks
        cache.release(install_id, "cancel")
        return 0
    cache.commit(install_id, end - hit)
    cache.release(install_id, "finish")
    return (end - hit) // block_size


def simulate_pd(
    model: ModelSpec,
    gpu: GPUSpec,
    workload: Workload,
    config: SimConfig,
    cost: CostModel,
    num_prefill_replicas: int,
    link: KVLink,
    progress: Callable[[int, int], None] | None = None,
) -> dict:
    """Run `workload` on `num_prefill_replicas` prefill and `config.replicas` decode replicas;
    the simulator's report (sim/report.py) over all of them, with "prefill_replicas" and
    "kv_transfer"."""
    if num_prefill_replicas < 1:
        raise ValueError(f"prefill replicas must be >= 1, got {num_prefill_replicas}")
    if not config.enable_prefix_caching:
        raise ValueError("P/D: the decode side finds the transferred blocks by their content; it needs prefix caching")
    started = time.perf_counter()
    check_request_lens(model, workload, config.max_model_len)
    longest = workload.max_request_len()
    max_len = config.max_model_len or longest
    p = plan_replica(model, gpu, config)
    num_p = num_prefill_replicas
    replicas = [_make_replica(i, model, p, config, cost, max_len) for i in range(num_p + config.replicas)]
    prefill, decode = replicas[:num_p], replicas[num_p:]
    if replicas[0].layout.name != "paged":
        raise ValueError(
            f"P/D moves the blocks of a paged cache (--layout paged); {model.name} runs layout "
            f"{replicas[0].layout.name}"
        )
    for r in replicas:
        if r.runner.max_model_len < longest:
            raise ValueError(
                f"the workload's longest request ({longest:,} tokens) does not fit one replica's cache "
                f"({r.runner.capacity_tokens:,} tokens, layout {r.layout.name})"
            )
    block_size = replicas[0].layout.block_size
    kv_bytes_per_token = p.as_dict()["kv_bytes_per_token"]  # the planner's, whole model
    prefill_router = Router(config.routing, prefill, config.load_cap)
    decode_router = Router(config.routing, decode, config.load_cap)
    link_free = [0.0] * num_p  # when each prefill replica's link is next free
    sessions = {s.session_id: s for s in workload.sessions}
    total = workload.num_requests
    order = itertools.count()
    # timed events: (time, order, kind, payload): "arrive" (session id, turn) at a prefill
    # replica, "land" (a _Transfer) at its decode replica
    events: list[tuple[float, int, str, object]] = [
        (s.start_s, next(order), "arrive", (s.session_id, 0)) for s in workload.sessions
    ]
    heapq.heapify(events)
    turn_of: dict[str, tuple[str, int, float]] = {}  # request id -> (session, turn, arrival)
    records: list[RequestRecord] = []
    sent_bytes, sent_blocks, installed_blocks = 0.0, 0, 0
    transfer_s: list[float] = []
    wait_s: list[float] = []
    steps = 0
    timeline = [(0, time.perf_counter())]
    while events or any(r.engine.has_unfinished() for r in replicas):
        busy = [r for r in replicas if r.engine.has_unfinished()]
        next_step = min(busy, key=lambda r: (r.clock(), r.index)) if busy else None
        if events and (next_step is None or events[0][0] <= next_step.clock()):
            t, _, kind, payload = heapq.heappop(events)
            if kind == "arrive":
                sid, turn = payload  # type: ignore[misc]
                session = sessions[sid]
                prompt = session.prompt_ids(turn, model.vocab_size)
                rep = prefill_router.route(prompt, session.tenant)
                rid = session.request_id(turn)
                params = SamplingParams(max_tokens=1, ignore_eos=True, seed=answer_seed(rid))
            else:
                tr: _Transfer = payload  # type: ignore[assignment]
                rep = tr.dst
                installed_blocks += _install(rep, tr, block_size)
                rid, prompt, sid = tr.request_id, tr.prompt, turn_of[tr.request_id][0]
                session = sessions[sid]
                out_len = session.turns[turn_of[rid][1]].output_len
                params = SamplingParams(max_tokens=out_len, ignore_eos=True, seed=answer_seed(rid))
            rep.num_routed += 1
            if not rep.engine.has_unfinished():
                rep.clock.now = max(rep.clock(), t)  # an idle replica waits for the request
            arrival = t if kind == "arrive" else tr.arrival_s  # TTFT counts from the first arrival
            rep.engine.add_request(prompt, params, rid, arrival_time=arrival, tenant=session.tenant)
            if kind == "arrive":
                turn_of[rid] = (sid, turn, t)
            continue
        assert next_step is not None
        finished = next_step.engine.step()
        steps += 1
        if steps % 1024 == 0:
            timeline.append((steps, time.perf_counter()))
        next_step.sample()
        for rid in finished:
            out = next_step.engine.pop_output(rid)
            sid, turn, arrival = turn_of[rid]
            session = sessions[sid]
            if next_step.index < num_p:  # prefilled: its KV leaves over this replica's link
                done = next_step.clock()
                prompt = list(out.prompt_token_ids)
                dst = decode_router.route(prompt, session.tenant)
                # the prompt's full blocks past what the decode replica holds (a prompt of
                # whole blocks keeps its last one to compute, as an admission does)
                first = dst.runner.cache.lookup_prefix(prompt, tenant_salt=session.tenant) // block_size
                num_blocks = max(0, (len(prompt) - 1) // block_size - first)
                num_bytes = num_blocks * block_size * kv_bytes_per_token
                start = max(done, link_free[next_step.index])
                seconds = link.transfer_s(num_bytes)
                link_free[next_step.index] = start + seconds
                sent_bytes += num_bytes
                sent_blocks += num_blocks
                transfer_s.append(seconds)
                wait_s.append(start - done)
                tr = _Transfer(rid, prompt, session.tenant, arrival, dst, first, num_blocks)
                heapq.heappush(events, (start + seconds, next(order), "land", tr))
                continue
            del turn_of[rid]
            records.append(
                RequestRecord(
                    rid,
                    next_step.index,
                    arrival,
                    len(out.prompt_token_ids),
                    len(out.completions[0].token_ids),
                    out.num_cached_tokens,
                    out.ttft_s,
                    out.tpot_s,
                    out.latency_s,
                )
            )
            if turn + 1 < len(session.turns):
                t_next = next_step.clock() + session.turns[turn + 1].think_s
                heapq.heappush(events, (t_next, next(order), "arrive", (sid, turn + 1)))
        if progress is not None:
            progress(len(records), total)
    from kvpool.sim.report import build_report

    report = build_report(model, gpu, p, config, replicas, records, total, time.perf_counter() - started, cost)
    report["sim_us_per_step_by_quarter"] = _quarters(timeline)
    report["prefill_replicas"] = num_p
    for row in report["per_replica"]:
        row["role"] = "prefill" if row["replica"] < num_p else "decode"
    report["kv_transfer"] = {
        "bandwidth_bytes_per_s": link.bandwidth_bytes_per_s,
        "latency_s": link.latency_s,
        "kv_bytes_per_token": kv_bytes_per_token,
        "num_transfers": len(transfer_s),
        "sent_blocks": sent_blocks,
        "sent_bytes": int(sent_bytes),
        # fewer than sent where the decode replica got some meanwhile (another request of the
        # same prefix landed first), lost its hit before them, or had no room
        "installed_blocks": installed_blocks,
        **p50_p99("transfer_ms", [s * 1e3 for s in transfer_s], 3),
        **p50_p99("link_wait_ms", [s * 1e3 for s in wait_s], 3),
    }
    return report
