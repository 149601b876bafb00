"""The router in front of the replicas (`kvpool simulate --replicas N --routing P`).

Policies:
  round-robin    requests in turn;
  least-loaded   the replica with the fewest running + waiting sequences;
  prefix-aware   the replica whose cache holds the longest prefix of the prompt
                 (`lookup_packed`, which changes nothing; the prompt is packed once for
                 all of them, and each block hashed once), among the replicas whose load
                 is at most `load_cap` x the least load + 4; ties to the least loaded, then
                 to the lowest index.

The prefix-aware choice is the max of (hit, -load, -index), but only the winner's hit
matters: the first replica asked (the caller's `hint`, where the session's previous turn
went, else the least loaded) is looked up in full, and each other one only when it may beat
the best so far, which it does only with a hit of at least that best hit (a better tie-break)
or one token more: `HybridCacheManager.may_reach` rules a replica out by a probe of the
prompt's block hashes, without a walk. The choice is the one the full lookups of every
replica give (`_choose_by_lookups`, the naive twin), whatever the hint.
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvpool.cache.types import LookupPrompt
    from kvpool.sim.simulator import Replica

ROUTINGS: tuple[str, ...] = ("round-robin", "least-loaded", "prefix-aware")
_LOAD = operator.attrgetter("load")  # a replica's default load: its running + waiting sequences
_INDEX = operator.attrgetter("index")
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
        self._load = load or _LOAD  # (C-level: the property's getter, no lambda frame a replica)
        # (pack_prompt, LookupPrompt) for prefix-aware choices: imported here, by the router
        # that needs them (not at module load: the CLI's parser imports this module; nor by
        # an import statement each arrival), and held by it, not by a module global
        self._packing: tuple[Callable[..., LookupPrompt], type] | None = None
        if policy == "prefix-aware":
            from kvpool.cache.coordinator import pack_prompt
            from kvpool.cache.types import LookupPrompt

            self._packing = (pack_prompt, LookupPrompt)

    def route(self, prompt: Sequence[int] | LookupPrompt, tenant: str = "", hint: int | None = None) -> Replica:
        """The replica for `prompt`; pass it packed (`pack_prompt`) where the chosen
        replica's engine takes it next: the lookups' hashes then serve its admission.
        hint: the index of the replica likely to hold the longest hit (the one the
        session's previous turn went to), looked up first (prefix-aware): it saves lookups
        when right and changes no choice either way."""
        reps = self.replicas
        if len(reps) == 1:
            return reps[0]
        if self.policy == "round-robin":
            return reps[next(self._next)]
        loads = dict(zip(map(_INDEX, reps), map(self._load, reps), strict=True))
        least = min(loads.values())
        if self.policy == "least-loaded":
            return min(reps, key=lambda r: (loads[r.index], r.num_routed))
        cap = self.load_cap * least + 4
        eligible = [r for r in reps if loads[r.index] <= cap]
        if len(eligible) == 1:  # no lookup to make (a lookup changes nothing)
            return eligible[0]
        pack_prompt, lookup_prompt = self._packing  # type: ignore[misc]
        # checked and packed once for every replica's lookup; its memo of block hashes makes
        # each replica's lookup hash only the blocks no replica before it hashed, and holds
        # the hashes the probes read
        packed = prompt if isinstance(prompt, lookup_prompt) else pack_prompt(prompt)
        return _choose_by_probes(eligible, loads, packed, tenant, hint)


def _choose_by_probes(
    eligible: list[Replica], loads: dict[int, int], packed: LookupPrompt, tenant: str, hint: int | None
) -> Replica:
    """The max of (hit, -load, -index) over `eligible` (two or more), each replica after the
    first looked up only when `may_reach` says its hit may be enough to win."""
    # the best tie-break first, so that a replica after it needs a hit one token longer
    # (the probe's rule-out works only past 0); the hint before it. Each replica's
    # tie-break key made once: (load, index), the lower the better (its position after
    # them, so that the sort never compares two replicas)
    indexes = list(map(_INDEX, eligible))
    order = sorted(zip(map(loads.__getitem__, indexes), indexes, range(len(eligible)), eligible, strict=True))
    if hint is not None:
        # (by position: list.remove would compare replicas with their dataclass __eq__, a
        # tuple of every field each)
        at = next((i for i, k in enumerate(order) if k[1] == hint), None)
        if at:
            order.insert(0, order.pop(at))
    best_load, best_index, _, best = order[0]
    best_hit = best.runner.cache.lookup_packed(packed, tenant_salt=tenant)
    # `may_reach` says False without a walk at len(prompt) and past (a hit leaves a token to
    # compute; len >= 1, pack_prompt refuses an empty prompt): a replica that needs that
    # much is not asked at all
    top = len(packed.token_ids)
    for load, index, _, r in order[1:]:
        # r wins with an equal hit when its (load, index) is lower, else only with a longer one
        wins_tie = load < best_load or (load == best_load and index < best_index)
        need = best_hit if wins_tie else best_hit + 1
        if need >= top:
            continue
        cache = r.runner.cache
        if not cache.may_reach(packed, need, tenant_salt=tenant):
            continue
        hit = cache.lookup_packed(packed, tenant_salt=tenant)
        if hit > best_hit or (hit == best_hit and wins_tie):
            best, best_hit, best_load, best_index = r, hit, load, index
    return best


def _choose_by_lookups(eligible: list[Replica], loads: dict[int, int], packed: LookupPrompt, tenant: str) -> Replica:
    """`_choose_by_probes`' naive twin: every replica looked up in full."""
    return max(
        eligible,
        key=lambda r: (r.runner.cache.lookup_packed(packed, tenant_salt=tenant), -loads[r.index], -r.index),
    )
