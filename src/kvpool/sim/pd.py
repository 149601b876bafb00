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
bytes per token of the whole model (every layer and KV head, as the paged layout holds
them: for a full-attention model, capacity/pd.py's transfer_bytes_per_request, which counts
a sliding-window layer's window alone), over the prefill replica's link:

    transfer_s = latency + num_bytes / bandwidth

One link per prefill replica (its NICs to the decode side together), first come first
served: a transfer starts when the prefill finishes or when the link is free, whichever
is later, so transfers queue behind each other. A block evicted from the decode replica
between the transfer and the request's admission is computed there again (as a landing
tier too small does in the engine). Both sides run the same model, GPU, TP and layout,
which must be `paged` (`check_pd`): the install admits the blocks' tokens into the decode
replica's cache and commits them (`_install`), which publishes the blocks by their
content; the hybrid, contiguous and dual layouts are refused. A model with sliding-window
layers (gemma-2, gpt-oss) on `--layout paged` keeps every layer's whole context, so its
window layers' full context is sent too, as a paged cache holds it.

The router's policy (`--routing`) picks a replica on each side; the prefill side's load is
its queued and running prompt tokens still to compute (its requests leave after one step,
so a count of sequences would read ~0 and prefix-aware routing would send every prompt to
one replica).

Prefix-cache figures: a decode replica's own admission of a request finds the transferred
blocks in its cache; those tokens came over the link, so they are left out of its hit
tokens (its hits are what it held of the prompt before the request's KV landed), and an
install is not a request. The report's `prefix_by_role` gives each side's figures.

Requests stream in and out as in sim/simulator.py: sessions are read in arrival order, a
finished request is tallied (sim/report.py FinishedRequests) and dropped, and the transfer
times are kept as array('d').
"""

from __future__ import annotations

import itertools
import time
from array import array
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import NamedTuple

from kvpool.engine.sampling import SamplingParams
from kvpool.sim.cost import CostModel
from kvpool.sim.executor import answer_seed
from kvpool.sim.layouts import default_layout
from kvpool.sim.report import FinishedRequests, RequestRecord, build_report
from kvpool.sim.routing import Router
from kvpool.sim.simulator import (
    Arrivals,
    Replica,
    SimConfig,
    StepTimeline,
    check_request_lens,
    make_replicas,
    plan_replica,
    spaced_collections,
)
from kvpool.spec.gpus import GPUSpec
from kvpool.spec.models import ModelSpec
from kvpool.workload.metrics import p50_p99, ratio
from kvpool.workload.sessions import Session, Workload


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
    dst: Replica
    first_block: int  # the decode replica's hit when the transfer started, in blocks
    num_blocks: int  # blocks sent: [first_block, first_block + num_blocks) of the prompt


class Landing(NamedTuple):
    """What an install did: blocks put into the decode replica's cache, and the prompt's
    tokens that replica held before them (the request's hits past these came over the link;
    the whole prompt when nothing was installed)."""

    num_blocks: int
    held_tokens: int


def check_pd(model: ModelSpec, layout: str, enable_prefix_caching: bool) -> None:
    """ValueError naming what P/D cannot move: a layout other than paged, no prefix caching."""
    if not enable_prefix_caching:
        raise ValueError("P/D: the decode side finds the transferred blocks by their content; it needs prefix caching")
    if layout != "paged":
        raise ValueError(f"P/D moves the blocks of a paged cache (--layout paged); {model.name} runs layout {layout}")


def prefill_load(rep: Replica) -> int:
    """A prefill replica's load for the router: the prompt tokens its queued and running
    requests have still to compute."""
    engine = rep.engine
    return sum(s.request.num_prompt_tokens - s.num_computed for s in itertools.chain(engine.waiting, engine.running))


def _install(rep: Replica, t: _Transfer, block_size: int) -> Landing:
    """Put the transferred blocks into the decode replica's cache as cached blocks nobody
    holds (what the engine's landing tier and admission do): admitted under an id of their
    own, reserved, committed (each full block published), released. Nothing is priced: the
    link carried the bytes. When the replica's hit has shrunk since the transfer started,
    the blocks before the transferred ones are gone and nothing is installed (the decode
    replica computes the prompt from its hit); so it is when the pool cannot take them now,
    and when it holds them all already.
    An install is not a request: the replica's prefix-cache counters are left as they were."""
    nothing = Landing(0, len(t.prompt))
    if t.num_blocks == 0:
        return nothing
    cache = rep.runner.cache
    end = (t.first_block + t.num_blocks) * block_size
    tokens = t.prompt[:end]
    # [0, held) the replica holds now | [held, end) to install; an admission would leave the
    # last block to compute, so a span held whole (another request of the same prefix landed
    # it meanwhile) is not admitted: nothing to install
    held = min(cache.lookup_prefix(t.prompt, tenant_salt=t.tenant), end)  # (a lookup of `tokens` stops a block short)
    if held < t.first_block * block_size:  # a gap before the transferred blocks
        return nothing
    if held == end:
        return Landing(0, held)
    stats = cache.stats
    counted = [getattr(stats, f.name) for f in fields(stats)]
    install_id = f"{t.request_id} (P/D install)"
    admission = cache.admit(install_id, tokens, tenant_salt=t.tenant)
    for f, value in zip(fields(stats), counted, strict=True):
        setattr(stats, f.name, value)
    if admission is None:
        return nothing
    hit = cache.num_computed_tokens(install_id)
    assert hit == held, (hit, held)  # nothing changed the cache since the lookup
    cache.commit(install_id, end - hit)
    cache.release(install_id, "finish")
    return Landing((end - hit) // block_size, hit)


@spaced_collections()
def simulate_pd(
    model: ModelSpec,
    gpu: GPUSpec,
    workload: Workload,
    config: SimConfig,
    cost: CostModel,
    num_prefill_replicas: int,
    link: KVLink,
    progress: Callable[[int, int], None] | None = None,
    on_finish: Callable[[RequestRecord], None] | None = None,
) -> dict:
    """Run `workload` on `num_prefill_replicas` prefill and `config.replicas` decode replicas;
    the simulator's report (sim/report.py) over all of them, with "prefill_replicas",
    "prefix_by_role" and "kv_transfer". `on_finish(record)` as each request finishes (its
    cached_tokens: the decode replica's own hit)."""
    if num_prefill_replicas < 1:
        raise ValueError(f"prefill replicas must be >= 1, got {num_prefill_replicas}")
    started = time.perf_counter()
    check_request_lens(model, workload, config.max_model_len)
    p = plan_replica(model, gpu, config, cost.host_mode)
    check_pd(model, config.layout or default_layout(p), config.enable_prefix_caching)
    num_p = num_prefill_replicas
    replicas, table = make_replicas(model, p, workload, config, cost, num_p + config.replicas)
    prefill, decode = replicas[:num_p], replicas[num_p:]
    block_size = replicas[0].layout.block_size
    kv_bytes_per_token = p.as_dict()["kv_bytes_per_token"]  # the planner's, whole model
    prefill_router = Router(config.routing, prefill, config.load_cap, load=prefill_load)
    decode_router = Router(config.routing, decode, config.load_cap)
    link_free = [0.0] * num_p  # when each prefill replica's link is next free
    total = workload.num_requests
    finished = FinishedRequests(config.slo_ttft_ms, config.slo_tpot_ms)
    # Requests stream in as in simulate() (Arrivals): "arrive" (session, turn) at a prefill
    # replica, and "land" (a _Transfer) at its decode replica when its KV has crossed the link
    arrivals = Arrivals(workload)
    in_flight: dict[str, tuple[Session, int, float]] = {}  # request id -> (session, turn, first arrival)
    held: dict[str, int] = {}  # request id -> prompt tokens its decode replica held before its KV landed
    sent_bytes, sent_blocks, installed_blocks, transferred_hit_tokens = 0.0, 0, 0, 0
    transfer_ms, wait_ms = array("d"), array("d")
    timeline = StepTimeline()
    while arrivals or any(r.engine.has_unfinished() for r in replicas):
        busy = [r for r in replicas if r.engine.has_unfinished()]
        next_step = min(busy, key=lambda r: (r.clock(), r.index)) if busy else None
        t = arrivals.next_time()
        if t is not None and (next_step is None or t <= next_step.clock()):
            kind, payload = arrivals.pop()
            if kind == "arrive":
                session, turn = payload  # type: ignore[misc]
                prompt = session.prompt_ids(turn, model.vocab_size, table)
                rep = prefill_router.route(prompt, session.tenant)
                rid, arrival = session.request_id(turn), t
                params = SamplingParams(max_tokens=1, ignore_eos=True, seed=answer_seed(rid))
                in_flight[rid] = (session, turn, t)
            else:
                tr: _Transfer = payload  # type: ignore[assignment]
                rep, rid, prompt = tr.dst, tr.request_id, tr.prompt
                landing = _install(rep, tr, block_size)
                installed_blocks += landing.num_blocks
                held[rid] = landing.held_tokens
                session, turn, arrival = in_flight[rid]  # TTFT counts from the first arrival
                out_len = session.turns[turn].output_len
                params = SamplingParams(max_tokens=out_len, ignore_eos=True, seed=answer_seed(rid))
            rep.num_routed += 1
            if not rep.engine.has_unfinished():
                rep.clock.now = max(rep.clock(), t)  # an idle replica waits for the request
            rep.engine.add_request(prompt, params, rid, arrival_time=arrival, tenant=session.tenant)
            continue
        assert next_step is not None
        done = next_step.engine.step()
        timeline.tick()
        next_step.sample()
        is_prefill = next_step.index < num_p
        if is_prefill:  # its requests finish in the step that ran them: count them there
            next_step.peak_running = max(next_step.peak_running, len(next_step.engine.running) + len(done))
        for rid in done:
            out = next_step.engine.pop_output(rid)
            session, turn, arrival = in_flight[rid]
            if is_prefill:  # prefilled: its KV leaves over this replica's link
                now = next_step.clock()
                prompt = list(out.prompt_token_ids)
                dst = decode_router.route(prompt, session.tenant)
                # the prompt's full blocks past what the decode replica holds (a prompt of
                # whole blocks keeps its last one to compute, as an admission does)
                first = dst.runner.cache.lookup_prefix(prompt, tenant_salt=session.tenant) // block_size
                num_blocks = max(0, (len(prompt) - 1) // block_size - first)
                num_bytes = num_blocks * block_size * kv_bytes_per_token
                start = max(now, link_free[next_step.index])
                seconds = link.transfer_s(num_bytes)
                link_free[next_step.index] = start + seconds
                sent_bytes += num_bytes
                sent_blocks += num_blocks
                transfer_ms.append(seconds * 1e3)
                wait_ms.append((start - now) * 1e3)
                arrivals.push(start + seconds, "land", _Transfer(rid, prompt, session.tenant, dst, first, num_blocks))
                continue
            del in_flight[rid]
            # the hits past what this replica held when the KV landed came over the link
            own = min(out.num_cached_tokens, held.pop(rid))
            next_step.runner.cache.stats.num_hit_tokens -= out.num_cached_tokens - own
            transferred_hit_tokens += out.num_cached_tokens - own
            record = RequestRecord.of(out, next_step.index, arrival, own)
            finished.add(record)
            if on_finish is not None:
                on_finish(record)
            arrivals.next_turn(session, turn, next_step.clock())
        if progress is not None:
            progress(finished.num_finished, total)
    report = build_report(model, gpu, p, config, replicas, finished, total, time.perf_counter() - started, cost)
    report["sim_us_per_step_by_quarter"] = timeline.quarters()
    report["prefill_replicas"] = num_p
    for row in report["per_replica"]:
        row["role"] = "prefill" if row["replica"] < num_p else "decode"
    report["prefix_by_role"] = _prefix_figures("prefill", prefill) | _prefix_figures("decode", decode)
    report["kv_transfer"] = {
        "bandwidth_bytes_per_s": link.bandwidth_bytes_per_s,
        "latency_s": link.latency_s,
        "kv_bytes_per_token": kv_bytes_per_token,
        "num_transfers": len(transfer_ms),
        "sent_blocks": sent_blocks,
        "sent_bytes": int(sent_bytes),
        # fewer than sent where the decode replica got some meanwhile (another request of the
        # same prefix landed first), lost its hit before them, or had no room
        "installed_blocks": installed_blocks,
        # transferred tokens the decode side's admissions found (left out of its hits)
        "transferred_hit_tokens": transferred_hit_tokens,
        **p50_p99("transfer_ms", transfer_ms, 3),
        **p50_p99("link_wait_ms", wait_ms, 3),
    }
    return report


def _prefix_figures(role: str, replicas: list[Replica]) -> dict:
    """One side's prefix-cache figures (flat keys, as the report's table shows them): the
    prompt tokens its admissions looked up and found."""
    stats = [r.runner.cache.stats for r in replicas]
    queried, hit = sum(s.num_queried_tokens for s in stats), sum(s.num_hit_tokens for s in stats)
    return {f"{role}_queried_tokens": queried, f"{role}_hit_tokens": hit, f"{role}_hit_rate": ratio(hit, queried, 4)}
