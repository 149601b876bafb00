"""Poisson arrivals: the one arrival process of every workload (the simulator's session
starts, `kvpool run`'s first turns and long prompts, the load generator's conversations).

n arrivals at `rate` per second have exponential gaps of mean 1 / rate, the first one gap
after 0; `math.inf` puts them all at 0. The gaps are drawn from the caller's generator, so
each command keeps its own seeded stream:

  random.Random               n calls of rng.expovariate(rate), in order (kvpool run, the
                              load generator)
  numpy.random.Generator      one rng.exponential(1 / rate, size=n) (the simulator)

and the times are the running sums of the gaps, added left to right (what numpy's cumsum
does too: bit for bit the times each command drew before).
"""

from __future__ import annotations

import itertools
import math
import random
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np


def poisson_arrivals(n: int, rate: float, rng: random.Random | np.random.Generator) -> list[float]:
    """n arrival times, seconds after the start, non-decreasing (see the module docstring)."""
    if type(n) is not int or n < 0:
        raise ValueError(f"n must be an integer >= 0, got {n!r}")
    if isinstance(rate, bool) or not isinstance(rate, int | float) or not rate > 0:
        raise ValueError(f"rate must be a number > 0 (math.inf: all at 0), got {rate!r}")
    if math.isinf(rate):
        return [0.0] * n
    if isinstance(rng, random.Random):
        gaps = [rng.expovariate(rate) for _ in range(n)]
    else:
        gaps = rng.exponential(1.0 / rate, size=n).tolist()
    return list(itertools.accumulate(gaps))
