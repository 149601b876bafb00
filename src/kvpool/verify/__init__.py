"""kvpool.verify: verification programs (paged paths against their contiguous oracles), above the engine."""
