"""The serving simulator: the engine's own scheduler and cache managers on a virtual clock,
with a roofline cost model in place of the forward pass (see simulator.py)."""
