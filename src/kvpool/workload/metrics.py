"""The performance report's figures (ARCHITECTURE.md, "Performance report"), computed one
way for `kvpool run`, `kvpool simulate` and the load generator of `kvpool bench serve`:

  p50 / p99      `percentile`: linear interpolation between order statistics
  TTFT, TPOT     a request is within the SLOs when its TTFT (ms) <= slo_ttft_ms and its
                 TPOT (ms; none for a one-token answer: 0) <= slo_tpot_ms
  goodput        requests within both SLOs per second of the run's span
  throughput     generated tokens per second of the span (`ratio`)

Each report keeps its own keys and rounding (run's latencies in 0.1 ms, the simulator's
in 0.01 ms): `digits` says how many. No imports: the CLI loads it for every command.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol


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


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between the order statistics (numpy's default); 0 for none."""
    if not values:
        return 0.0
    ordered = sorted(values)
    k = (len(ordered) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def p50_p99(name: str, values: list[float], digits: int) -> dict[str, float]:
    """{name_p50, name_p99} of `values`, rounded to `digits` decimals (0.0 for none)."""
    return {
        f"{name}_p50": round(percentile(values, 0.5), digits),
        f"{name}_p99": round(percentile(values, 0.99), digits),
    }


def latency_report(requests: Iterable[Finished], digits: int) -> dict[str, float]:
    """ttft_ms_p50 / _p99, tpot_ms_p50 / _p99, latency_ms_p50 / _p99: each over the requests
    that measured it, in ms rounded to `digits` decimals (the keys of every report)."""
    requests = list(requests)
    ttfts = [r.ttft_s * 1e3 for r in requests if r.ttft_s is not None]
    tpots = [r.tpot_s * 1e3 for r in requests if r.tpot_s is not None]
    latencies = [r.latency_s * 1e3 for r in requests if r.latency_s is not None]
    return (
        p50_p99("ttft_ms", ttfts, digits) | p50_p99("tpot_ms", tpots, digits) | p50_p99("latency_ms", latencies, digits)
    )


def within_slo(request: Timed, slo_ttft_ms: float, slo_tpot_ms: float) -> bool:
    """TTFT and TPOT within the SLOs (a request with no TTFT never is; none TPOT counts 0)."""
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
