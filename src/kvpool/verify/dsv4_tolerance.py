"""How close is close enough for the V4 matrix (kvpool.verify.dsv4): the bounds and the
top-k selection margin.

The verdict must not depend on the CPU (MKL picks other kernels on other machines, so fp32
results differ by rounding between them), hence two modes:

- fp64, the decisive check: paged and oracle agree to FP64_TOLERANCE, a fixed bound
  ~100x above fp64 rounding and ~10 orders of magnitude below what one value read from a
  wrong slot, entry or state row does to the logits. The indexer's top-k cannot flip on
  rounding there (FP64_TOLERANCE's comment has the figures).
- fp32 (the model's own mode): each case's tolerance is derived from the oracle's own fp32
  error on that case, on this machine (`derived_fp32_tolerance`). In fp32 the indexer's
  top-k CAN flip: where the k-th and (k+1)-th scores are closer than the rounding of the
  scores, the paged path and the oracle may keep different entries (both correct; the
  logits then differ by ~1e-2). `selection_margin` measures how far a case is from that.

Figures below: AMD EPYC, torch 2.13 CPU, one thread, over the 21 cases of
`Verifier.cases()` (`kvpool verify dsv4 --dtype fp64 --json` and `--dtype fp32 --json`
print them case by case).
"""

from __future__ import annotations

import math

import torch

from kvpool.attention.dsv4_reference import IndexerTrace

# fp64 paged vs oracle: max abs logit difference 0 .. 7.1e-15 (|logits| <= 5.1); 1e-12 is
# 140x the largest. Planted faults (tests/test_dsv4_paged.py): one main entry read from a
# wrong classical slot moves the logits by 7.8e-2, one SWA ring row scaled by 0.999 by
# 7.0e-2: ~10 orders above the bound. Top-k: the closest boundary of any case is 3.2e-6
# apart (fp64 scores, small config, 8-block hit), while fp64 paged and oracle scores differ
# by <= 8.9e-15 (single-chunk prefill of 300 and 600 tokens): 3e8x apart.
FP64_TOLERANCE = 1e-12

# fp32: |oracle_fp32 - oracle_fp64| = 0.93e-6 .. 3.5e-6 per case, and paged vs oracle in
# fp32 lands at 0.61x .. 1.43x of that. K = 8 leaves 5.6x for other kernels; a planted
# wrong slot (7.8e-2) stays ~3000x above the largest derived tolerance (2.8e-5).
FP32_K = 8.0

# Two fp32 computations of one logit, each correctly rounded, can differ by 1 ulp. The
# floor (2 ulps of the largest |logit|) only matters should a case's oracle error be
# unusually small; on the 21 cases it never binds (2 ulps of 5.1 = 1.2e-6 < 7.4e-6).
FP32_FLOOR_ULPS = 2.0

# A top-k flip needs the gap between the k-th and (k+1)-th scores to close. Paged scores
# sit within 1.33x the fp32 oracle's own score error e of the oracle's (measured: single-
# chunk prefill of 300 / 600 tokens), so the gap moves by at most ~2.7 e; a margin of 4 e
# cannot flip. Measured margins: 1.2 on the small config's 8-block hit (a real fp32 near
# tie), 5.6 on the 300-token prompts, 10.8 .. 51 elsewhere, inf below 16 visible entries.
FP32_SELECTION_K = 4.0


def check_tolerance(tolerance: float | None, name: str = "tolerance") -> None:
    """A tolerance override must be a finite number >= 0 (with NaN every comparison is
    false, with inf every one passes). ValueError names `name` and the bad value."""
    if tolerance is not None and not (math.isfinite(tolerance) and tolerance >= 0):
        raise ValueError(f"{name} must be a finite number >= 0, got {tolerance!r}")


def derived_fp32_tolerance(reference_error: float, max_abs_logit: float) -> float:
    """reference_error: max |oracle_fp32 - oracle_fp64| over a case's positions (the oracle
    in fp64 on the same fp32 weights); max_abs_logit: the largest |logit| there."""
    return max(FP32_K * reference_error, FP32_FLOOR_ULPS * torch.finfo(torch.float32).eps * max_abs_logit)


def topk_gaps(trace: IndexerTrace, k: int) -> tuple[float, float]:
    """How close the top-k selections of one CSA layer are to a tie, in the trace's units.

    For each query with more than k visible entries, the k-th and (k+1)-th scores (stable
    descending order) either differ, by a gap, or tie. A tie happens only at exactly 0 (all
    heads' dots <= 0) and stays exact until some tied entry's highest head dot crosses 0.
    Returns (smallest gap, smallest distance below 0 of a tied entry's highest head dot);
    inf where there is none, and (0, 0) for an exact tie away from 0 (nothing bounds it).
    """
    num_entries = trace.scores.shape[1]
    visible = torch.arange(num_entries)[None, :] < trace.num_visible[:, None]  # [T, E]
    rows = trace.num_visible > k
    if not bool(rows.any()):
        return math.inf, math.inf
    scores = trace.scores[rows]  # [R, E]
    ranked = torch.sort(scores.masked_fill(~visible[rows], -math.inf), dim=-1, descending=True).values
    kth, gap = ranked[:, k - 1], ranked[:, k - 1] - ranked[:, k]
    min_gap = float(gap[gap > 0].min()) if bool((gap > 0).any()) else math.inf
    tie = gap == 0
    if not bool(tie.any()):
        return min_gap, math.inf
    if bool((kth[tie] != 0).any()):
        return 0.0, 0.0
    tied = (scores == 0) & visible[rows] & tie[:, None]  # [R, E]: the entries of each tie
    below_zero = -trace.dots[rows].amax(dim=1)  # [R, E]: highest head dot's distance below 0
    return min_gap, float(below_zero[tied].min())


def selection_margin(traces: list[IndexerTrace], exact: list[IndexerTrace], k: int) -> float:
    """The smallest top-k margin of a history, in units of the fp32 oracle's own error.

    traces: the fp32 oracle's indexer at each CSA layer; exact: the same history in fp64
    (same weights). Per layer, e = max |score_fp32 - score_fp64| and e_dot = max |dot_fp32 -
    dot_fp64| over visible entries (each at least 1 ulp of the largest value); the margin
    is min(gap / e, below_zero / e_dot) from `topk_gaps` of the fp64 trace. Minimum over
    layers; inf when no query has more than k visible entries.
    """
    eps = torch.finfo(torch.float32).eps
    margin = math.inf
    for t32, t64 in zip(traces, exact, strict=True):
        gap, below_zero = topk_gaps(t64, k)
        if math.isinf(gap) and math.isinf(below_zero):
            continue
        visible = torch.arange(t64.scores.shape[1])[None, :] < t64.num_visible[:, None]  # [T, E]
        vis_dots = visible[:, None, :].expand_as(t64.dots)
        s64, d64 = t64.scores[visible], t64.dots[vis_dots]
        err = max(float((t32.scores.double()[visible] - s64).abs().max()), eps * float(s64.abs().max()))
        err_dot = max(float((t32.dots.double()[vis_dots] - d64).abs().max()), eps * float(d64.abs().max()))
        margin = min(margin, gap / err, below_zero / err_dot)
    return margin
