"""Predicted against published: the simulator on serving figures others measured and published.

    python3 -m kvpool.sim.validate [--json] [--calibration NAME|FILE]

`src/kvpool/sim/data/published.json` holds each figure with the page it was read on, the
rows or sentences it came from (verbatim) and its configuration: model, GPU, TP, weight and
KV formats, input and output lengths, the concurrency or "all at once", the metric, and
what the simulation assumes where the source is silent. A setting the figure's own page
does not state but another page of its source does (the KV format TensorRT-LLM's benchmark
picks, say) cites that page too: `setting_sources`, each the setting it settles, its URL
and the sentences or table rows read there (verbatim). Each is run through the simulator
itself (`kvpool.sim.simulator.simulate`, the engine's scheduler and cache over the cost
model), as the source ran it, with fixed lengths:

- a fixed concurrency C (a latency benchmark's batch, a client keeping C requests in flight):
  C requests arriving together with at most C running. With every prompt and answer the
  same length, a closed loop runs wave after wave of this one, so one wave's TTFT, TPOT and
  end-to-end latency are the steady state's (and its TTFT has no queueing in it);
- "all at once" (an offline maximum-throughput run, every request queued): a wave of B
  requests, B the most requests of input + output tokens the replica's KV pool holds (the
  planner's `max_concurrent_per_replica` at that context, its ledger under the engine limits
  the wave runs with: `max_wave`), at most `MAX_BATCH`; the output
  tokens per second over the wave (a queue of identical requests is served as such waves,
  each costing the same);
- N requests at once (`num_requests`: a serving benchmark that sends its N requests at an
  infinite request rate, vLLM's `bench serve` default): the N requests arriving together,
  the engine's scheduler admitting what its limits and KV pool hold, over the whole run
  (the span runs from their arrival to the last one's end, as the benchmark's duration);
- a concurrency C over N requests of varying length (`staggered_requests`: a client keeping
  C in flight over a dataset such as ShareGPT, whose prompts and answers differ): the
  requests do not start and end together as equal ones would, so each request's decodes
  share steps with the prefills of the requests that replace its neighbours. Simulated as N
  requests of the row's mean lengths, at most C running, the first C - 1 answering k / C of
  the output length (k = 1 .. C - 1): the C slots then turn over evenly spread, and every
  later request decodes beside C - 1 other prefills, one per neighbouring slot, the count a
  loop of varying lengths with these means gives a request on average (C slots, each turning
  over once per mean answer). Equal waves would give it none. Dense models barely notice (a
  prefill chunk reads the weights a decode step reads anyway); a MoE model's prefill of a
  few hundred tokens routes to every expert, and its step reads all of them (gpt-oss-120b:
  64 GB against a batch-4 decode's 10 GB).

The engine's scheduler limits are the row's `max_num_seqs` and `max_num_batched_tokens`
where its source's engine sets them (stated, or its defaults: `setting_sources`); else the
batch above and max(8,192, input length) tokens a step. Its KV pool likewise, where the
engine's code or defaults settle it (`setting_sources`), else the simulator's own:
`kv_layout` (None: the model's default layout, `hybrid` for sliding-window layers, whose
blocks past the window are freed; "paged": every layer holds every token, as an engine
that keeps no per-layer windows in its pool, while attention still reads only the window),
`enable_prefix_caching` (False: random prompts share nothing; True where the engine keeps
its prefix cache, in which a preempted request finds its own freed blocks while they
stand), `gpu_memory_utilization` (1.0: the planner's ledger over the whole GPU; less: the
engine's share of it, the pool what the ledger leaves inside that share). An "all at once"
wave is the most requests the pool holds in the row's layout.

Metrics: latency_ms (p50 of the requests' end-to-end latency), ttft_ms, tpot_ms (p50; the
time per output token after the first, which NIM's ITL and vLLM's TPOT report), output_tok_s
(generated tokens / the wave's span), output_tok_s_per_gpu (that / TP) and total_tok_s
(input + output tokens / the span, vLLM's "Total Token throughput": every request
generates its output length, so it is output_tok_s x (input + output) / output). The ratio is
predicted / published, read with the metric's sense: under 1 a time is predicted too fast,
a throughput too slow (`RowResult.error` says which). The parameters are the GPU defaults
(what `kvpool simulate` runs), or a calibration's (`--calibration`, kvpool.sim.gpufit).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvpool.sim.gpufit import DATA_DIR
from kvpool.sim.routing import LAYOUTS

if TYPE_CHECKING:
    from kvpool.spec.gpus import GPUSpec
    from kvpool.spec.models import ModelSpec
    from kvpool.workload.sessions import Workload

PUBLISHED = os.path.join(DATA_DIR, "published.json")
MAX_BATCH = 2048  # the batch limit of an "all at once" run whose source states none
METRICS: dict[str, tuple[str, str, bool]] = {  # metric -> (report key, unit, higher is faster)
    "latency_ms": ("latency_ms_p50", "ms", False),
    "ttft_ms": ("ttft_ms_p50", "ms", False),
    "tpot_ms": ("tpot_ms_p50", "ms", False),
    "output_tok_s": ("throughput_tok_s", "tok/s", True),
    "output_tok_s_per_gpu": ("throughput_tok_s", "tok/s/GPU", True),
    "total_tok_s": ("throughput_tok_s", "tok/s", True),
}


@dataclass(frozen=True)
class SettingSource:
    """Where a row's setting (`settles`: a PublishedRow field, e.g. "kv_dtype") is read, when
    not on the figure's own page: the page and what it says there, verbatim."""

    settles: str
    url: str
    quote: tuple[str, ...]


@dataclass(frozen=True)
class PublishedRow:
    id: str
    engine: str
    source_url: str
    quote: tuple[str, ...]
    model: str
    gpu: str
    tp: int
    weight_dtype: str
    kv_dtype: str
    input_len: int
    output_len: int
    concurrency: int | None  # None: every request at once (maximum throughput)
    metric: str
    published: float
    assumed: str = ""
    setting_sources: tuple[SettingSource, ...] = ()
    num_requests: int | None = None  # N requests sent at once (concurrency None): the run is all of them
    staggered_requests: int | None = None  # N requests of varying length through the concurrency (docstring)
    max_num_seqs: int | None = None  # the engine's scheduler limits, where its source's engine sets them
    max_num_batched_tokens: int | None = None
    # the engine's KV pool where its source's engine sets it otherwise than the simulator's
    # defaults (module docstring): the layout (None: the model's default, hybrid for sliding
    # windows; "paged": every layer holds every token), the prefix cache, the share of the GPU
    kv_layout: str | None = None
    enable_prefix_caching: bool = False
    gpu_memory_utilization: float = 1.0

    def __post_init__(self) -> None:
        if self.metric not in METRICS:
            raise ValueError(f"row {self.id}: unknown metric {self.metric!r}; known: {', '.join(METRICS)}")
        for name in ("tp", "input_len", "output_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"row {self.id}: {name} must be >= 1, got {getattr(self, name)}")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError(f"row {self.id}: concurrency must be >= 1 or null, got {self.concurrency}")
        for name in ("num_requests", "staggered_requests", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"row {self.id}: {name} must be >= 1 or null, got {getattr(self, name)}")
        if self.kv_layout is not None and self.kv_layout not in LAYOUTS:
            raise ValueError(f"row {self.id}: unknown kv_layout {self.kv_layout!r}; one of {', '.join(LAYOUTS)}")
        if not 0 < self.gpu_memory_utilization <= 1:
            share = self.gpu_memory_utilization
            raise ValueError(f"row {self.id}: gpu_memory_utilization must be in (0, 1], got {share}")
        if self.num_requests is not None and self.concurrency is not None:
            raise ValueError(f"row {self.id}: num_requests (all sent at once) and a concurrency exclude each other")
        if self.staggered_requests is not None:
            if self.concurrency is None or self.staggered_requests <= self.concurrency:
                raise ValueError(
                    f"row {self.id}: staggered_requests ({self.staggered_requests}) runs through a concurrency "
                    f"and needs more requests than it (concurrency {self.concurrency})"
                )
            if self.output_len < self.concurrency:
                raise ValueError(
                    f"row {self.id}: staggered_requests spreads the first answers over k / {self.concurrency} "
                    f"of output_len, which needs output_len >= {self.concurrency}, got {self.output_len}"
                )
            if self.metric in ("ttft_ms", "latency_ms"):
                # the simulated requests all queue from time 0; a client keeping C in flight sends
                # each when a slot frees, so a time that counts from the arrival is not its
                raise ValueError(f"row {self.id}: staggered_requests times no {self.metric} (queued from time 0)")
        if not self.published > 0 or not self.quote or not self.source_url.startswith("https://"):
            raise ValueError(f"row {self.id}: needs a positive published figure, its quote and its https source")
        fields = {f.name for f in dataclasses.fields(self)}
        for src in self.setting_sources:
            if src.settles not in fields or not src.quote or not src.url.startswith("https://"):
                raise ValueError(
                    f"row {self.id}: a setting source needs a row field to settle ({src.settles!r}), "
                    "its quote and its https page"
                )

    @property
    def configuration(self) -> str:
        if self.concurrency and self.staggered_requests:
            load = f"concurrency {self.concurrency}, {self.staggered_requests:,} requests of varying length"
        elif self.concurrency:
            load = f"concurrency {self.concurrency}"
        elif self.num_requests:
            load = f"{self.num_requests:,} requests at once"
        else:
            load = "max throughput"
        dtypes = f"{self.weight_dtype} weights, {self.kv_dtype} KV"
        return (
            f"{self.model}, {self.gpu} TP {self.tp}, {dtypes}, {self.input_len:,} in / {self.output_len:,} out, {load}"
        )


@dataclass(frozen=True)
class RowResult:
    row: PublishedRow
    predicted: float
    batch: int  # requests simulated: the wave, or the row's num_requests or staggered_requests
    preemptions: int

    @property
    def ratio(self) -> float:
        return self.predicted / self.row.published

    @property
    def error(self) -> str:
        """'too fast' or 'too slow' (or 'exact'): which way the prediction errs."""
        if self.ratio == 1:
            return "exact"
        faster = self.ratio > 1 if METRICS[self.row.metric][2] else self.ratio < 1
        return "too fast" if faster else "too slow"


def load_rows(path: str = PUBLISHED) -> list[PublishedRow]:
    """The rows of a published-figures file (the shipped one by default); ValueError naming
    the row and the field at fault."""
    with open(path) as f:
        try:
            data = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"not JSON ({e})") from None
    if not isinstance(data, dict) or not isinstance(data.get("rows"), list):
        raise ValueError("expected an object with a 'rows' list")
    rows = []
    for i, raw in enumerate(data["rows"]):
        try:
            sources = tuple(
                SettingSource(**{**src, "quote": tuple(src["quote"])}) for src in raw.get("setting_sources", ())
            )
            rows.append(PublishedRow(**{**raw, "quote": tuple(raw["quote"]), "setting_sources": sources}))
        except (TypeError, KeyError) as e:
            raise ValueError(f"{path}: row {i}: {e}") from None
    ids = [r.id for r in rows]
    if len(set(ids)) != len(ids):
        raise ValueError(f"{path}: row ids repeat")
    return rows


def simulate_row(row: PublishedRow, overrides: dict[str, float] | None = None) -> RowResult:
    """Simulate `row` as its source ran it (module docstring); `overrides`: CostModel
    parameters (a calibration's `GPUFit.overrides()`), else the GPU defaults."""
    from kvpool.sim.cost import CostModel
    from kvpool.sim.simulator import SimConfig, simulate
    from kvpool.spec.models import load_preset
    from kvpool.workload.sessions import uniform_workload

    model, gpu = load_preset(row.model), engine_gpu(row)
    total_len = row.input_len + row.output_len
    # the row's deployment, as the planner, the simulator's config and the cost model take it
    deployment = {"tp": row.tp, "kv_dtype": row.kv_dtype, "weight_dtype": row.weight_dtype}
    if row.concurrency is not None:
        batch = row.concurrency
    elif row.num_requests is not None:
        batch = row.num_requests
    else:
        batch = max_wave(row, model, gpu, deployment)
    max_num_seqs = batch if row.num_requests is None else MAX_BATCH
    if row.max_num_seqs is not None:  # the engine's own limit, which a larger wave queues behind
        # (under a client's concurrency the engine never runs more than the client keeps in
        # flight: a staggered row's requests all arrive at 0, and this limit is the client's)
        max_num_seqs = row.max_num_seqs if row.concurrency is None else min(batch, row.max_num_seqs)
    config = SimConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_step_tokens(row),
        max_model_len=total_len,
        # random prompts: nothing to hit across requests; a preempted request's own blocks
        # where the engine keeps a prefix cache (vLLM V1's default)
        enable_prefix_caching=row.enable_prefix_caching,
        layout=row.kv_layout,
        **deployment,
    )
    cost = CostModel(model, gpu, **deployment, **(overrides or {}))
    if row.staggered_requests is None:
        workload = uniform_workload(
            batch, math.inf, model.vocab_size, 0, prompt_len=(row.input_len,) * 2, output_len=(row.output_len,) * 2
        )
    else:
        workload = staggered_workload(row, model.vocab_size)
    report = simulate(model, gpu, workload, config, cost)
    figure = report[METRICS[row.metric][0]]
    if figure is None:  # (tpot_ms of one-token answers: no second token, no figure)
        raise ValueError(f"row {row.id}: the simulation has no {row.metric}: no answer had a second token")
    value = float(figure)
    if row.metric == "output_tok_s_per_gpu":
        value /= row.tp
    elif row.metric == "total_tok_s" and row.staggered_requests is not None:
        generated = report["num_generated_tokens"]  # the first C - 1 answer less: count what ran
        value *= (row.staggered_requests * row.input_len + generated) / generated
    elif row.metric == "total_tok_s":
        if report["num_generated_tokens"] != batch * row.output_len:  # every request its whole answer
            raise ValueError(
                f"row {row.id}: {report['num_generated_tokens']:,} tokens generated, not {batch:,} x {row.output_len:,}"
            )
        value *= total_len / row.output_len
    return RowResult(row, value, row.staggered_requests or batch, int(report["preemptions"]))


def max_step_tokens(row: PublishedRow) -> int:
    """The engine's token budget a step: the row's, else max(8,192, its input length)."""
    return row.max_num_batched_tokens or max(8192, row.input_len)


def max_wave(row: PublishedRow, model: ModelSpec, gpu: GPUSpec, deployment: dict) -> int:
    """An "all at once" row's wave: the most requests of its length the replica's KV pool
    holds, at most MAX_BATCH, the pool sized as the simulation sizes it (plan_replica: the
    ledger under the engine's limits). With no `max_num_seqs` of the row's the limit is the
    wave itself, and a larger limit leaves a smaller pool (more sampler rows, CUDA graphs),
    so the wave is the largest B <= MAX_BATCH whose own limit's pool holds B (bisection: the
    pool shrinks as B grows)."""
    from kvpool.capacity.planner import plan
    from kvpool.sim.simulator import engine_assumptions

    total_len = row.input_len + row.output_len

    def holds(max_num_seqs: int) -> int:  # requests of total_len the pool under this limit holds
        limits = engine_assumptions(max_num_seqs, max_step_tokens(row), "graph")
        p = plan(model, gpu, num_gpus=row.tp, context_len=total_len, assumptions=limits, **deployment)
        if row.kv_layout == "paged":  # every layer holds every token: a block of every group a block
            blocks = -(-total_len // p.layout.block_size)
            return int(p.ledger.pool_bytes) // p.layout.bytes_per_block_all_groups // blocks
        return p.max_concurrent_per_replica

    if row.max_num_seqs is not None:  # the engine's own limit: the wave may queue behind it
        batch = min(MAX_BATCH, holds(row.max_num_seqs))
    else:
        lo, hi = 0, MAX_BATCH  # holds(B) >= B for B <= lo; fails for B > hi
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if holds(mid) >= mid else (lo, mid - 1)
        batch = lo
    if batch < 1:
        raise ValueError(f"row {row.id}: one request of {total_len:,} tokens does not fit the KV pool")
    return batch


def engine_gpu(row: PublishedRow) -> GPUSpec:
    """The row's GPU preset as its engine sizes its memory: `gpu_memory_utilization` of it
    (the planner's pool is what the ledger leaves inside that share)."""
    from kvpool.spec.gpus import get_gpu

    gpu = get_gpu(row.gpu)
    if row.gpu_memory_utilization == 1.0:
        return gpu
    return dataclasses.replace(gpu, memory_bytes=int(gpu.memory_bytes * row.gpu_memory_utilization))


def staggered_workload(row: PublishedRow, vocab_size: int) -> Workload:
    """The row's `staggered_requests` requests of its input length, all arriving at time 0
    (the engine's limit of `concurrency` running keeps the loop): the first C - 1 answer
    output_len x k // C tokens (k = 1 .. C - 1), every other one output_len, so the C slots
    turn over evenly spread (module docstring)."""
    from kvpool.workload.sessions import GeneratedSessions, Workload

    n, c = row.staggered_requests, row.concurrency
    assert n is not None and c is not None  # (PublishedRow checks both)
    outputs = [row.output_len * k // c for k in range(1, c)] + [row.output_len] * (n - c + 1)
    sessions = GeneratedSessions("req", [0.0] * n, [()], [0] * n, 1, [row.input_len] * n, outputs, None, vocab_size)
    params = {"num_requests": n, "concurrency": c, "prompt_len": row.input_len, "output_len": row.output_len}
    return Workload("staggered", sessions, vocab_size, params)


def validate(rows: list[PublishedRow], overrides: dict[str, float] | None = None) -> list[RowResult]:
    return [simulate_row(r, overrides) for r in rows]


def _figure(value: float) -> str:
    return f"{value:,.0f}" if value >= 1000 else f"{value:,.1f}" if value >= 100 else f"{value:.2f}"


def markdown_table(results: list[RowResult], calibrated: list[RowResult] | None = None) -> str:
    """The comparison as a Markdown table (what docs/simulator.md shows)."""
    head = "| configuration | source | metric | published | predicted | ratio |"
    rule = "|---|---|---|---|---|---|"
    if calibrated is not None:
        head += " calibrated | ratio |"
        rule += "---|---|"
    lines = [head, rule]
    for i, res in enumerate(results):
        row = res.row
        unit = METRICS[row.metric][1]
        # a time by its name (ttft, tpot, latency), a throughput by what it counts (total, output)
        kind = row.metric.split("_")[0] if row.metric.endswith("_ms") or row.metric.startswith("total") else "output"
        cells = [
            row.configuration,
            f"[{row.engine}]({row.source_url})",
            f"{kind} ({unit})",
            _figure(row.published),
            _figure(res.predicted),
            f"{res.ratio:.2f}",
        ]
        if calibrated is not None:
            cells += [_figure(calibrated[i].predicted), f"{calibrated[i].ratio:.2f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def as_json(results: list[RowResult], calibrated: list[RowResult] | None = None) -> list[dict]:
    out = []
    for i, res in enumerate(results):
        row = res.row
        item = {
            "id": row.id,
            "configuration": row.configuration,
            "engine": row.engine,
            "source_url": row.source_url,
            "quote": list(row.quote),
            "metric": row.metric,
            "published": row.published,
            "predicted": res.predicted,
            "ratio": res.ratio,
            "error": res.error,
            "simulated_batch": res.batch,
            "preemptions": res.preemptions,
            "num_requests": row.num_requests,
            "staggered_requests": row.staggered_requests,
            "max_num_seqs": row.max_num_seqs,
            "max_num_batched_tokens": row.max_num_batched_tokens,
            "kv_layout": row.kv_layout,
            "enable_prefix_caching": row.enable_prefix_caching,
            "gpu_memory_utilization": row.gpu_memory_utilization,
            "assumed": row.assumed,
            "setting_sources": [
                {"settles": s.settles, "url": s.url, "quote": list(s.quote)} for s in row.setting_sources
            ],
        }
        if calibrated is not None:
            item |= {"predicted_calibrated": calibrated[i].predicted, "ratio_calibrated": calibrated[i].ratio}
        out.append(item)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python3 -m kvpool.sim.validate", description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="one JSON object per row, in a list")
    parser.add_argument(
        "--calibration",
        default=None,
        metavar="NAME|FILE",
        help="also predict with this GPU calibration (kvpool.sim.gpufit; shipped: h200-issue31)",
    )
    parser.add_argument("--data", default=PUBLISHED, help="the published figures (default: the shipped file)")
    args = parser.parse_args(argv)
    from kvpool.sim.gpufit import load_fit

    try:
        rows = load_rows(args.data)
    except (OSError, ValueError, KeyError) as e:
        parser.error(f"--data {args.data}: {e}")
    results = validate(rows)
    calibrated = None
    if args.calibration is not None:
        try:
            overrides = load_fit(args.calibration).overrides()
        except ValueError as e:
            parser.error(str(e))
        calibrated = validate(rows, overrides)
    if args.json:
        print(json.dumps(as_json(results, calibrated), indent=2))
    else:
        print(markdown_table(results, calibrated))


if __name__ == "__main__":
    main()
