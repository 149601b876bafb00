"""The router in front of the replicas (`kvpool simulate --replicas N --routing P`).

Policies:
  round-robin    requests in turn;
  least-loaded   the replica with the fewest running + waiting sequences;
  prefix-aware   the replica whose cache holds the longest prefix of the prompt
                 (`lookup_packed`, which changes nothing; the prompt is packed once for
                 all of them, and each block hashed once), among the replicas whose load is at most `load_cap` x the
                 least load + 4; ties to the least loaded.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvpool.cache.types import LookupPrompt
    from kvpool.sim.simulator import Replica

ROUTINGS: tuple[str, ...] = ("round-robin", "least-loaded", "prefix-aware")
# the layouts a replica can hold (sim/layouts.py builds them); named here, where nothing is
# imported, so that the CLI's parser does not load the cache managers
LAYOUTS: tuple[str, ...] = ("paged", "contiguous", "dual", "hybrid")


class Router:
    """`load(replica)`: what least-loaded and prefix-aware compare (default: its running +
    waiting sequences; P/D's prefill side passes its prompt tokens still to compute)."""

    def __init__(
        self, policy: str, replicas: list[Replica], load_cap: float, load: Callable[[Replica], int] | None = None
    ) -> None:
        self.policy, self.replicas, self.load_cap = policy, replicas, load_cap
        self._next = itertools.cycle(range(len(replicas)))
        self._load = load or (lambda r: r.load)

    def route(self, prompt: Sequence[int] | LookupPrompt, tenant: str = "") -> Replica:
        """The replica for `prompt`; pass it packed (`pack_prompt`) where the chosen
        replica's engine takes it next: the lookups' hashes then serve its admission."""
        reps = self.replicas
        if len(reps) == 1:
            return reps[0]
        if self.policy == "round-robin":
            return reps[next(self._next)]
        loads = {r.index: self._load(r) for r in reps}
        least = min(loads.values())
        if self.policy == "least-loaded":
            return min(reps, key=lambda r: (loads[r.index], r.num_routed))
        eligible = [r for r in reps if loads[r.index] <= self.load_cap * least + 4]
        if len(eligible) == 1:  # no lookup to make (a lookup changes nothing)
            return eligible[0]
        from kvpool.cache.coordinator import pack_prompt  # here: the CLI's parser imports this module
        from kvpool.cache.types import LookupPrompt

        # checked and packed once for every replica's lookup; its memo of block hashes makes
        # each replica's lookup hash only the blocks no replica before it hashed
        packed = prompt if isinstance(prompt, LookupPrompt) else pack_prompt(prompt)
        return max(
            eligible,
            key=lambda r: (r.runner.cache.lookup_packed(packed, tenant_salt=tenant), -loads[r.index], -r.index),
        )
