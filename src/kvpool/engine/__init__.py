"""kvpool.engine: the scheduler (engine.py), the one model runner (runner.py) and, beside
it, each model's executor and the function that builds its runner (llama_runner.py,
dsv4_runner.py, hybrid_runner.py), the tier bridge (tier_bridge.py), the engine builder
(build.py), sampling, the memory ledger (memory.py), CUDA decode graphs (cuda_graph.py),
prefill / decode disaggregation (disaggregated.py) and a live workload served on the wall
clock, as `kvpool run` measures it (live.py)."""
