"""The performance report's figures (ARCHITECTURE.md, "Performance report"), computed one
way for `kvpool run`, `kvpool simulate` and the load generator of `kvpool bench serve`:

  p50 / p99      `percentile`: linear interpolation between order statistics
  TTFT, TPOT     a request is within the SLOs when its TTFT (ms) <= slo_ttft_ms and its
                 TPOT (ms) <= slo_tpot_ms; a one-token answer has no TPOT, so no TPOT to
                 miss. A run where every answer is one token has no TPOT figure: its
                 tpot_ms_p50 / _p99 are None (null in JSON, "n/a" in text), and its SLO
                 verdict judges TTFT alone, saying so. No sample, no figure: a run where
                 no request finished has no TTFT and no latency either (None, not 0 ms),
                 and its verdict judges nothing
  goodput        requests within both SLOs per second of the run's span
  throughput     generated tokens per second of the span (`ratio`)

Each report keeps its own keys and rounding (run's latencies in 0.1 ms, the simulator's
in 0.01 ms): `digits` says how many. `run_report` is `kvpool run`'s report of an engine that served a
live workload (engine/live.py); `report_sections` and `report_notes` turn a report into
what a person reads (units, headings, the SLO verdict, warnings); `--json` prints the raw keys.
No imports but `os` and `math`: the CLI loads it for every command.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol


class Timed(Protocol):
    """What a finished request reports: seconds from its arrival to its first token, and
    per output token after it (None: not measured, or a one-token answer)."""

    @property
    def ttft_s(self) -> float | None: ...

    @property
    def tpot_s(self) -> float | None: ...


class Finished(Timed, Protocol):
    """... and seconds from its arrival to its last token."""

    @property
    def latency_s(self) -> float | None: ...


def percentile(values: Sequence[float], q: float) -> float:
    """Linear interpolation between the order statistics (numpy's default); 0 for none."""
    if not values:
        return 0.0
    ordered = sorted(values)
    k = (len(ordered) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def p50_p99(name: str, values: Sequence[float], digits: int, empty: float | None = 0.0) -> dict[str, float | None]:
    """{name_p50, name_p99} of `values`, rounded to `digits` decimals; both `empty` for none
    (None where no sample means no figure: the TPOT of one-token answers, not 0 ms)."""
    if not values:
        return {f"{name}_p50": empty, f"{name}_p99": empty}
    return {
        f"{name}_p50": round(percentile(values, 0.5), digits),
        f"{name}_p99": round(percentile(values, 0.99), digits),
    }


def latency_report(requests: Iterable[Finished], digits: int) -> dict[str, float | None]:
    """ttft_ms_p50 / _p99, tpot_ms_p50 / _p99, latency_ms_p50 / _p99: each over the requests
    that measured it, in ms rounded to `digits` decimals (the keys of every report); a figure
    no request measured is None (the TPOTs when no answer had a second token, all six when
    no request finished), not 0 ms."""
    requests = list(requests)
    ttfts = [r.ttft_s * 1e3 for r in requests if r.ttft_s is not None]
    tpots = [r.tpot_s * 1e3 for r in requests if r.tpot_s is not None]
    latencies = [r.latency_s * 1e3 for r in requests if r.latency_s is not None]
    return (
        p50_p99("ttft_ms", ttfts, digits, empty=None)
        | p50_p99("tpot_ms", tpots, digits, empty=None)
        | p50_p99("latency_ms", latencies, digits, empty=None)
    )


def within_slo(request: Timed, slo_ttft_ms: float, slo_tpot_ms: float) -> bool:
    """TTFT and TPOT within the SLOs (a request with no TTFT never is; a one-token answer has
    no TPOT to miss)."""
    ttft_s = request.ttft_s
    return ttft_s is not None and ttft_s * 1e3 <= slo_ttft_ms and (request.tpot_s or 0.0) * 1e3 <= slo_tpot_ms


def num_within_slo(requests: Iterable[Timed], slo_ttft_ms: float, slo_tpot_ms: float) -> int:
    return sum(1 for r in requests if within_slo(r, slo_ttft_ms, slo_tpot_ms))


def ratio(numerator: float, denominator: float, digits: int) -> float:
    """numerator / denominator rounded to `digits` decimals; 0.0 over a zero denominator (a
    rate over an empty span, a hit rate over no queried token)."""
    return round(numerator / denominator, digits) if denominator else 0.0


def mean(values: list[float], digits: int) -> float:
    """The mean rounded to `digits` decimals; 0.0 for none."""
    return round(sum(values) / len(values), digits) if values else 0.0


# --- the report as a person reads it ------------------------------------------------------------


def format_bytes(num_bytes: float) -> str:
    """Binary units: 512 B, 1.5 KiB, 20.0 MiB, 3.25 GiB."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(num_bytes) >= scale:
            return f"{num_bytes / scale:,.{2 if unit == 'GiB' else 1}f} {unit}"
    return f"{num_bytes:,.0f} B"


def format_ms(ms: float | None) -> str:
    """A duration given in ms: 0.42 ms, 12.3 ms, 1.25 s (seconds from 1000 ms on); "n/a" for
    None (no sample: the TPOT of one-token answers, the TTFT of a run where none finished)."""
    if ms is None:
        return "n/a"
    if abs(ms) >= 1000:
        return f"{ms / 1e3:,.2f} s"
    return f"{ms:.2f} ms" if abs(ms) < 10 else f"{ms:.1f} ms"


def format_share(share: float) -> str:
    """A fraction as a percentage: 0.1534 -> 15.3 %."""
    return f"{100 * share:.1f} %"


def _count(value: float) -> str:
    return f"{value:,}" if isinstance(value, int) and not isinstance(value, bool) else str(value)


def _per_s(unit: str) -> Callable[[float], str]:
    return lambda value: f"{value:,.1f} {unit}/s" if value >= 10 else f"{value:.2f} {unit}/s"


# figures that are None where the run had no sample of them (shown as "n/a", not left out):
# the TPOTs of one-token answers, and every latency of a run where no request finished
NO_SAMPLE_KEYS = frozenset(f"{name}_ms_{p}" for name in ("ttft", "tpot", "latency") for p in ("p50", "p99"))

# (heading, [(key, label, formatter)]): the seed's figures, grouped as a reader looks for them
REPORT_SECTIONS: tuple[tuple[str, tuple[tuple[str, str, Callable[[float], str]], ...]], ...] = (
    (
        "capacity",
        (
            ("kv_capacity_tokens", "KV capacity (tokens)", _count),
            ("kv_capacity_bytes", "KV capacity", format_bytes),
            ("kv_pool_bytes", "KV pool", format_bytes),
            ("kv_format", "KV format", str),
            ("block_size", "block size (tokens)", _count),
            ("num_blocks", "blocks", _count),
            ("fragmentation", "fragmentation (held block slots holding no token)", format_share),
            ("peak_running", "peak running requests", _count),
            ("preemptions", "preemptions", _count),
        ),
    ),
    (
        "latency",
        (
            ("ttft_ms_p50", "TTFT p50", format_ms),
            ("ttft_ms_p99", "TTFT p99", format_ms),
            ("tpot_ms_p50", "TPOT p50", format_ms),
            ("tpot_ms_p99", "TPOT p99", format_ms),
            ("latency_ms_p50", "request latency p50", format_ms),
            ("latency_ms_p99", "request latency p99", format_ms),
            ("slo_ttft_ms", "SLO: TTFT at most", format_ms),
            ("slo_tpot_ms", "SLO: TPOT at most", format_ms),
            ("alloc_latency_us_p50", "block allocation p50", lambda us: format_ms(us / 1e3)),
            ("alloc_latency_us_p99", "block allocation p99", lambda us: format_ms(us / 1e3)),
        ),
    ),
    (
        "throughput",
        (
            ("throughput_tok_s", "throughput", _per_s("tok")),
            ("goodput_req_s", "goodput (requests within both SLOs)", _per_s("req")),
            ("slo_attainment", "requests within both SLOs", format_share),
            ("num_within_slo", "requests within both SLOs", _count),
            ("read_bandwidth_gbps", "KV read bandwidth", _per_s("GB")),
            ("request_rate", "arrival rate (req/s)", str),
            ("num_requests", "requests", _count),
            ("num_finished", "requests finished", _count),
            ("num_context_ended", "conversations ended at the context", _count),
            ("num_generated_tokens", "tokens generated", _count),
            ("num_steps", "engine steps", _count),
            ("wall_s", "wall time", lambda s: format_ms(s * 1e3)),
        ),
    ),
    (
        "cache",
        (
            ("prefix_hit_rate", "prefix hit rate", format_share),
            ("prefix_queried_tokens", "prefix tokens looked up", _count),
            ("prefix_hit_tokens", "prefix tokens found cached", _count),
            ("num_alloc_calls", "allocating calls", _count),
            ("num_noop_alloc_calls", "calls that took no block", _count),
        ),
    ),
)


def report_sections(report: dict, skip: Iterable[str] = ()) -> list[tuple[str, list[tuple[str, str]]]]:
    """[(heading, [(label, value as text)])]: the figures of REPORT_SECTIONS that `report`
    holds, with their units, then under "other" every remaining key (but those in `skip`,
    and the private ones starting with "_") as it stands."""
    shown = set(skip)
    sections = []
    for heading, figures in REPORT_SECTIONS:
        rows = [
            (label, fmt(report[key]))
            for key, label, fmt in figures
            if report.get(key) is not None or (key in NO_SAMPLE_KEYS and key in report)
        ]
        shown.update(key for key, _, _ in figures)
        if rows:
            sections.append((heading, rows))
    rest = []
    for key, value in report.items():
        if key in shown or key.startswith("_"):
            continue
        for name, item in value.items() if isinstance(value, dict) else [("", value)]:
            # (None: a setting the run does not have, as V4's on a model without its pool)
            rest.append((f"{key}.{name}" if name else key, "n/a" if item is None else _count(item)))
    if rest:
        sections.append(("other", rest))
    return sections


def slo_verdict(report: dict) -> str:
    """One line: the SLOs met or missed, judged on the p99s (99 % of the finished requests
    within the TTFT and the TPOT bounds), naming each figure that missed. A run with no TPOT
    (every answer one token) is judged on TTFT alone, and the line says TPOT was not."""
    if not report.get("num_finished"):
        return "SLO: no request finished, nothing to judge"
    checks = [("TTFT p99", report["ttft_ms_p99"], report["slo_ttft_ms"])]
    no_tpot = report["tpot_ms_p99"] is None
    if not no_tpot:
        checks.append(("TPOT p99", report["tpot_ms_p99"], report["slo_tpot_ms"]))
    unjudged = "; TPOT n/a: no answer had a second token" if no_tpot else ""
    missed = [f"{name} {format_ms(value)} > {format_ms(bound)}" for name, value, bound in checks if value > bound]
    if missed:
        return "SLO missed: " + ", ".join(missed) + unjudged + _attainment(report)
    within = ", ".join(f"{name} {format_ms(value)} <= {format_ms(bound)}" for name, value, bound in checks)
    return f"SLO met: {within}" + unjudged + _attainment(report)


def _attainment(report: dict) -> str:
    """How many requests met both bounds, where the report counts them: a p99 verdict alone
    reads the same whether one request or half of them missed."""
    if "num_within_slo" in report:
        return f" ({report['num_within_slo']:,} of {report['num_finished']:,} finished requests within both)"
    if "slo_attainment" in report:
        return f" ({format_share(report['slo_attainment'])} of the requests within both)"
    return ""


def run_report(
    engine: Any,
    *,
    model_name: str,
    wall_s: float,
    step_s: float,
    fragmentation: list[float],
    kv_read_bytes: int,
    interrupted: bool,
    slo_ttft_ms: float,
    slo_tpot_ms: float,
    request_rate: float,
    context_ended: Sequence[str] = (),
) -> dict[str, Any]:
    """`kvpool run`'s report (its --json object, before the memory ledger and the load keys)
    of an `engine` (engine/engine.py `Engine`: its outputs, statistics and runner; untyped
    here, as workload/ sits below the engine) that served for `wall_s` seconds, `step_s` of
    them in its steps, with the fragmentation sampled after each step and `kv_read_bytes`
    read (engine/live.py `LiveRun`). A request counts as finished when every completion
    stopped or reached its length; the rest (aborted) count only in num_requests.
    `context_ended`: the turns not sent, their conversation having outgrown the context
    (`LiveRun.context_ended`)."""
    outputs = [engine.output(r) for r in engine.requests]
    done = [o for o in outputs if o.completions and all(c.finish_reason in ("stop", "length") for c in o.completions)]
    num_generated = sum(len(c.token_ids) for o in done for c in o.completions)
    good = num_within_slo(done, slo_ttft_ms, slo_tpot_ms)
    stats = engine.runner.cache_stats()
    alloc_us = [s * 1e6 for s in engine.stats.alloc_call_s]
    return {
        "model": model_name,
        "kv_capacity_tokens": int(stats["kv_capacity_tokens"]),
        "kv_capacity_bytes": int(stats["kv_capacity_bytes"]),
        "kv_format": getattr(engine.runner, "kv_format", "float32"),
        "block_size": int(stats["block_size"]),
        "num_blocks": int(stats["num_blocks"]),
        "fragmentation": mean(fragmentation, 4),
        "prefix_hit_rate": round(stats["prefix_hit_rate"], 4),
        "prefix_queried_tokens": int(stats["prefix_queried_tokens"]),
        "prefix_hit_tokens": int(stats["prefix_hit_tokens"]),
        **p50_p99("alloc_latency_us", alloc_us, 2),
        "num_alloc_calls": engine.stats.num_alloc_calls,
        "num_noop_alloc_calls": engine.stats.num_noop_calls,
        "read_bandwidth_gbps": round(kv_read_bytes / step_s / 1e9, 3) if step_s else 0.0,
        **latency_report(done, 1),
        "throughput_tok_s": ratio(num_generated, wall_s, 2),
        "goodput_req_s": ratio(good, wall_s, 3),
        "num_within_slo": good,
        "slo_ttft_ms": slo_ttft_ms,
        "slo_tpot_ms": slo_tpot_ms,
        "request_rate": request_rate if math.isfinite(request_rate) else "inf",
        "preemptions": engine.num_preemptions,
        "num_requests": len(outputs),
        "num_finished": len(done),
        "num_generated_tokens": num_generated,
        "num_steps": engine.num_steps,
        "wall_s": round(wall_s, 3),
        "interrupted": interrupted,
        "max_model_len": int(engine.runner.max_model_len),
        "num_context_ended": len(context_ended),
        "context_ended": list(context_ended),
        **v4_turn_end_report(engine.runner.cache),
        **engine.runner.tier_reports(),
    }


def v4_turn_end_report(cache: Any) -> dict[str, object]:
    """V4's dual pool (tiny-dsv4): whether finished turns keep their state blocks
    (v4_turn_ends) and how many admissions adopted one (state_adoptions), the keys
    `kvpool simulate` reports; {} for a cache without a dual-pool group (the groups that
    count adoptions: the coordinator's `dual_groups`, cache/dual_pool.py). Without prefix
    caching no state is kept (a kept state is found as a prefix hit): off."""
    duals = cache.dual_groups
    if not duals:
        return {}
    kept = cache.turn_end_checkpoints and cache.enable_prefix_caching
    return {"v4_turn_ends": kept, "state_adoptions": sum(g.num_adoptions for g in duals)}


def cpu_load() -> float | None:
    """The 1-minute load average (None where the platform has none)."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def report_notes(report: dict, loads: Iterable[float | None] = (), num_cpus: int | None = None) -> list[str]:
    """The SLO verdict, then a warning when the run was cut short, and one when the CPU was
    oversubscribed (a load average sampled during the run, `loads`, above `num_cpus`): the
    timings then include waiting for a CPU, not only the work."""
    notes = [slo_verdict(report)]
    if report.get("interrupted"):
        finished, total = report.get("num_finished", 0), report.get("num_requests", 0)
        notes.append(
            f"warning: the run was cut short; the figures cover the {finished} of {total} requests that finished"
        )
    ended = report.get("context_ended") or []
    if ended:
        shown = ", ".join(ended[:5]) + (", ..." if len(ended) > 5 else "")
        notes.append(
            f"note: {len(ended)} conversation(s) outgrew the context of {report.get('max_model_len')} tokens and "
            f"ended there, their next turn not sent ({shown})"
        )
    loads = [load for load in loads if load is not None]
    num_cpus = num_cpus if num_cpus is not None else os.cpu_count()
    if num_cpus and loads and max(loads) > num_cpus:
        sampled = ", ".join(f"{load:.1f}" for load in loads)
        notes.append(
            f"warning: the CPU was oversubscribed (load average {sampled} on {num_cpus} CPUs): "
            "the timings include waiting for a CPU"
        )
    return notes
