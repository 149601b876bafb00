"""kvpool.attention: attention over the cache's tensors, above kernels and storage and below
models and engine.

- reference.py, dsv4_reference.py: the contiguous oracles (full recompute, no cache);
- paged.py, dsv4_paged.py, dsv4_ops.py, hybrid_ops.py: the math of the paged paths (plans,
  decode and prefill attention over the block pool; V4's sparse attention over the dual
  pool; the hybrid models' masked attention and gated delta rule);
- backends/: the attention backends a runner chooses once (by attention kind, storage
  format, device, implementation) through the plain dict `backends.BACKENDS`;
- context_parallel.py: decode attention over blocks spread across ranks.
"""
