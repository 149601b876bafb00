"""The benchmarks behind `kvpool bench NAME`: one module per benchmark, each a plain function
that takes keyword arguments and returns the report as a dict (the object `--json` prints).

Each module's docstring says what it measures and how; `kvpool.cli.bench_*` only parses the
flags, calls the function and prints its result. Shared pieces (the best-of timer, serving
one request to completion, the progress callback) are in `common`.

  pool      block pool and prefix-cache bookkeeping on two fixed traces (T1, T2)
  engine    the engine against transformers: decode, cached-prefix TTFT, attention, glue
  dsv4      DeepSeek-V4 dual-pool bytes; the tiny model's paged decode against its oracle
  start     `kvpool generate` from a cold process to its first token
  sim       the simulator's cpu preset (and a fit made now) against the engine
  ledger    `kvpool run`'s measured memory ledger against the planner's
  hisparse  DeepSeek-V4 HiSparse: device bytes and fetches per decode step
  serve     streaming clients against an OpenAI-compatible server
  kv_quant  decode attention over quantized KV blocks against fp32
  tiers     TTFT of a prefix from the host, disk and Redis tiers; V4 SWA strategies
"""
