"""CUDA graphs for decode steps, one per batch-size bucket, over the persistent step buffers.

A decode step launches the same kernels every time; on a GPU their launch cost exceeds the
work at small batches. A CUDA graph records one step's launches once and replays them with
one call, but it replays the *addresses* it recorded: every input must sit in a tensor that
never moves, rewritten in place before each replay. `StepBuffers` (attention/backends/
step_buffers.py) are such tensors for the step's metadata; `DecodeGraphs` adds the token
ids and keeps the output.

A graph is captured per bucket of batch sizes (`BATCH_BUCKETS`: 1, 2, 4, ..., 256, the last
capped at the most sequences a decode step can hold: the buffers' max_num_seqs, or their
max_num_tokens when smaller, one token a sequence); a step of n sequences replays the
smallest bucket b >= n, its rows [n, b) padded by
`StepBuffers.pad`: one token at position 0 in the padding row, whose only block is the
reserved dummy block, so a padded row writes its K/V only into the dummy block and reads
only it. A step larger than the largest bucket, or not a pure decode, runs eagerly.
`capture` takes every bucket's graph at once, largest first: the engine's executor does so
when it is built in "graphs" mode, so no live request waits for a capture (`run` captures a
bucket not captured yet, for a caller that did not). The graphs share one memory pool: they never replay at once,
and a replay's intermediates are written before they are read; but a replay may overwrite
what another graph left in the pool, its output included, so `run` returns a copy of the
logits (a caller keeps a step's logits: recorded, forked, sampled later).

The attention a captured forward runs is a backend's `begin_decode(buffers, num_seqs)`
(attention/backends: the torch paged backend's `buffered_decode_attend`, the Triton
backend's `paged_decode_dense`), every step value read from the buffers; the model's
forward takes the step's largest position from the host (`StepMetadata.max_position`), so
nothing in it synchronises. The engine's Llama executor (engine/llama_runner.py) runs its
pure-decode steps through `DecodeGraphs` in one of `DECODE_MODES`:

  eager    no step buffers: every step planned from the cache's tables (the CPU default,
           and `--enforce-eager`);
  static   the padded static-buffer step without capture (any device: what the CPU tests
           run to check the graph path's logic, tokens and pool writes);
  graphs   captured per bucket at build and replayed (the CUDA default, on the Triton
           backend: the torch backend's buffered decode gathers every row's whole table
           width, which a GPU's pool makes far too large).

Any other step (a prefill chunk, a mixed step, one larger than the largest bucket, a
backend without `begin_decode`, tensor parallelism) runs eagerly; a backend with
`begin_buffered_step` (Triton's) still plans a prefill or mixed step the buffers hold from
them, not from the cache's lists.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from kvpool.attention.backends.step_buffers import StepBuffers

BATCH_BUCKETS: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256)

# forward(num_seqs) -> logits [num_seqs, vocab]: one decode step of the first num_seqs rows
# of the static inputs (DecodeGraphs.input_ids and the StepBuffers' tensors), reading them
# only through those tensors (no host values of the step: a captured graph replays them)
DecodeForward = Callable[[int], torch.Tensor]


def buckets_up_to(max_num_seqs: int, buckets: Sequence[int] = BATCH_BUCKETS) -> tuple[int, ...]:
    """The buckets a runner of max_num_seqs sequences captures: those below it and the
    first at or above it, capped at max_num_seqs (its largest step fits a graph)."""
    if max_num_seqs <= 0:
        raise ValueError(f"max_num_seqs must be positive, got {max_num_seqs}")
    if list(buckets) != sorted(set(buckets)) or not buckets or buckets[0] <= 0:
        raise ValueError(f"buckets must be positive and increasing, got {tuple(buckets)}")
    kept = [b for b in buckets if b < max_num_seqs]
    return (*kept, max_num_seqs) if max_num_seqs <= buckets[-1] else tuple(kept)


def bucket_for(num_seqs: int, buckets: Sequence[int]) -> int | None:
    """The smallest bucket holding num_seqs sequences; None past the largest (run eagerly)."""
    if num_seqs <= 0:
        raise ValueError(f"num_seqs must be positive, got {num_seqs}")
    return next((b for b in buckets if b >= num_seqs), None)


DECODE_MODES = ("eager", "static", "graphs")


class DecodeGraphs:
    """Decode steps over the static inputs, padded to their bucket, and on CUDA replayed
    from graphs captured per bucket (all at once by `capture`; else a bucket's first step
    captures it).

    forward: one decode step over the static inputs (`DecodeForward`); buffers: the step
    buffers it reads (with a dummy block to pad with); input_ids [max_num_seqs] int64: the
    step's token ids, static too (the caller writes them, `set_input_ids`). capture: False
    runs the same padded static-buffer step without a graph ("static": what the CPU tests
    run; the buffers may then be on any device); True captures (CUDA only)."""

    def __init__(
        self,
        forward: DecodeForward,
        buffers: StepBuffers,
        *,
        buckets: Sequence[int] = BATCH_BUCKETS,
        capture: bool = True,
    ) -> None:
        if capture and buffers.device.type != "cuda":
            raise ValueError(f"CUDA graphs need step buffers on a CUDA device, got {buffers.device}")
        if buffers.dummy_block is None:
            raise ValueError("CUDA graphs need step buffers with a dummy block for the padded rows")
        self.forward, self.buffers, self.capturing = forward, buffers, capture
        # a decode step holds one token a sequence: no more sequences than the buffers'
        # tokens (slot_mapping, positions) either, whichever bound is smaller
        self.buckets = buckets_up_to(min(buffers.max_num_seqs, buffers.max_num_tokens), buckets)
        self.input_ids = torch.zeros(buffers.max_num_seqs, dtype=torch.int64, device=buffers.device)
        # its host twin (pinned on CUDA: the copy is queued, not waited for), written through numpy
        on_cpu = buffers.device.type == "cpu"
        self._ids_host = self.input_ids if on_cpu else torch.zeros_like(self.input_ids, device="cpu").pin_memory()
        self._ids_np = self._ids_host.numpy()
        self._ids_sent: torch.cuda.Event | None = None
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}  # bucket -> the graph's logits [bucket, vocab]
        self._pool = None  # the memory pool every graph shares (they never replay at once)
        self.num_replays = self.num_eager = self.num_static = 0
        self.steps_by_bucket: dict[int, int] = {}  # padded steps run per bucket (replayed or static)

    def set_input_ids(self, token_ids: Sequence[int]) -> None:
        """The step's token ids into the static input (rows [len, ...) keep whatever; the
        padded rows' tokens only reach the dummy block)."""
        n = len(token_ids)
        if self._ids_sent is not None:
            self._ids_sent.synchronize()  # the last copy out of the pinned twin is done (it was long ago)
        self._ids_np[:n] = token_ids
        if self._ids_host is not self.input_ids:
            self.input_ids[:n].copy_(self._ids_host[:n], non_blocking=True)
            self._ids_sent = torch.cuda.Event()
            self._ids_sent.record()

    def capture(self) -> None:
        """Capture every bucket's graph now, largest first (each smaller graph's
        intermediates fit in what the larger one reserved), each over a step of padding
        only (it writes and reads only the dummy block). Leaves the buffers holding an
        empty step: the next `update` fills them."""
        for bucket in sorted(self.buckets, reverse=True):
            if bucket not in self.graphs:
                self.buffers.clear()
                self.buffers.pad(bucket)
                self._capture(bucket)
        self.buffers.clear()

    def pool_bytes(self) -> int:
        """The device memory of the graphs' shared pool (its allocator segments: every
        graph's intermediates and outputs; reserved for the graphs, so no eager step can
        use it); 0 before any capture."""
        if self._pool is None:
            return 0
        pool = tuple(self._pool)
        segments = torch.cuda.memory_snapshot()
        return sum(seg["total_size"] for seg in segments if tuple(seg["segment_pool_id"]) == pool)

    def _capture(self, bucket: int) -> None:
        """Capture `bucket`'s graph over the step the buffers hold now (padded to it): two
        eager warm-up runs first (lazy initialisation and autotuning must not be captured),
        all on a side stream, as torch's capture wants. The warm-ups compute the held step
        itself: they write the same K/V to the same slots as its replay will."""
        device = self.buffers.device
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                self.forward(bucket)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool, stream=stream):
                self.outputs[bucket] = self.forward(bucket)
        torch.cuda.current_stream(device).wait_stream(stream)
        self._pool = graph.pool()
        self.graphs[bucket] = graph

    def run(self, num_seqs: int) -> torch.Tensor:
        """logits [num_seqs, vocab] of the decode step in the buffers (num_seqs sequences,
        one token each): padded to its bucket and replayed (captured first if new), or
        with capture off run padded without a graph; past the largest bucket (or when the
        buffers do not hold a decode of num_seqs) the forward of num_seqs rows, eagerly.
        A new tensor: a replay rewrites the graph's output (and, through the shared pool,
        maybe another bucket's), and a caller may keep the logits of a step."""
        bucket = bucket_for(num_seqs, self.buckets)
        buffers = self.buffers
        if bucket is None or buffers.num_tokens != num_seqs or buffers.num_seqs != num_seqs:
            self.num_eager += 1
            return self.forward(num_seqs)
        buffers.pad(bucket)
        self.steps_by_bucket[bucket] = self.steps_by_bucket.get(bucket, 0) + 1
        if not self.capturing:
            self.num_static += 1
            return self.forward(bucket)[:num_seqs]
        if bucket not in self.graphs:
            self._capture(bucket)
        self.graphs[bucket].replay()
        self.num_replays += 1
        return self.outputs[bucket][:num_seqs].clone()
