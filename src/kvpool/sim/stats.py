"""Small statistics the reports share (no imports: the CLI loads it for every command)."""

from __future__ import annotations


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between the order statistics (numpy's default); 0 for none."""
    if not values:
        return 0.0
    ordered = sorted(values)
    k = (len(ordered) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)
