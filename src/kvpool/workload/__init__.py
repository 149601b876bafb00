"""What is sent and what is measured: the workloads every serving run replays and the
figures every run reports, one of each for `kvpool run` (the engine on the wall clock),
`kvpool simulate` (the engine's scheduler on a virtual clock) and `kvpool bench serve`'s
load generator (HTTP clients against a server).

  arrivals.py  Poisson arrivals, from a `random.Random` or a numpy `Generator`
  chat.py      the chat conversations in messages (system prompts, questions, follow-ups)
  live.py      workloads whose next turn carries the served model's real answer (run)
  sessions.py  workloads known in advance: sessions of turns, the chat / agentic / uniform
               generators (simulate)
  trace.py     a JSONL request trace replayed as sessions (docs/SIM_TRACE.md)
  tokens.py    deterministic token ids for synthetic text and simulated answers
  metrics.py   percentiles, rates, SLO goodput: the performance report's figures

Why a package of its own, low in the layer map (just above `spec`): its three users sit in
three layers (`sim`, `server`, `cli`), none of which may import another's sideways without
dragging in what it does not need (the load generator would import the simulator, the
simulator the CLI). The code itself needs nothing of kvpool: it is pure Python over
`random` and numpy, no torch, no engine, so it can sit below every layer that uses it and
every layer may use it. One package rather than two: a workload and the report of its run
change together (a new latency is measured per request a workload sends), and metrics.py
alone would be a one-module layer.

Each run keeps its own random stream: `kvpool run` and the load generator draw from a
seeded `random.Random`, the simulator from `numpy.random.default_rng(seed)`; the functions
here take the generator and draw from it in the order they always did, so a seed gives the
same workload it gave before this package existed.
"""
