"""CUDA graphs for decode steps, one per batch-size bucket, over the persistent step buffers.

A decode step launches the same kernels every time; on a GPU their launch cost exceeds the
work at small batches. A CUDA graph records one step's launches once and replays them with
one call, but it replays the *addresses* it recorded: every input must sit in a tensor that
never moves, rewritten in place before each replay. `StepBuffers` (attention/backends/
step_buffers.py) are such tensors for the step's metadata; `DecodeGraphs` adds the token
ids and keeps the output.

A graph is captured per bucket of batch sizes (`BATCH_BUCKETS`: 1, 2, 4, ..., 256); a step
of n sequences replays the smallest bucket b >= n, its rows [n, b) padded by
`StepBuffers.pad`: one token at position 0 in the padding row, whose only block is the
reserved dummy block, so a padded row writes its K/V only into the dummy block and reads
only it. A step larger than the largest bucket, or not a pure decode, runs eagerly.
The graphs share one memory pool (captured largest first, as each smaller graph's
intermediates fit in what the larger one reserved).

The attention a captured forward can run is attention/backends/buffered.py
`buffered_decode_attend` (every step value read from the buffers). The engine does not
capture its Llama decode yet: models/llama.py's forward checks `int(positions.max())` on
the host, a synchronisation a capture refuses, and the executor plans each step's attention
from host lists; a forward reading only the buffers is what `DecodeGraphs` takes.
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


class DecodeGraphs:
    """Decode steps replayed from CUDA graphs captured per bucket.

    forward: one decode step over the static inputs (`DecodeForward`); buffers: the step
    buffers it reads (with a dummy block to pad with); input_ids [max_num_seqs] int64: the
    step's token ids, static too (the caller writes them, `set_input_ids`)."""

    def __init__(
        self,
        forward: DecodeForward,
        buffers: StepBuffers,
        *,
        buckets: Sequence[int] = BATCH_BUCKETS,
    ) -> None:
        if buffers.device.type != "cuda":
            raise ValueError(f"CUDA graphs need step buffers on a CUDA device, got {buffers.device}")
        if buffers.dummy_block is None:
            raise ValueError("CUDA graphs need step buffers with a dummy block for the padded rows")
        self.forward, self.buffers = forward, buffers
        self.buckets = buckets_up_to(buffers.max_num_seqs, buckets)
        self.input_ids = torch.zeros(buffers.max_num_seqs, dtype=torch.int64, device=buffers.device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}  # bucket -> the graph's logits [bucket, vocab]
        self.num_replays = self.num_eager = 0

    def set_input_ids(self, token_ids: Sequence[int]) -> None:
        """The step's token ids into the static input (rows [len, ...) keep whatever; the
        padded rows' tokens only reach the dummy block)."""
        self.input_ids[: len(token_ids)].copy_(torch.tensor(token_ids, dtype=torch.int64), non_blocking=True)

    def capture(self) -> None:
        """Capture every bucket's graph, largest first, into one memory pool, each over a
        step of padding only (it writes and reads only the dummy block). Leaves the buffers
        holding an empty step: the next `update` fills them."""
        buffers, device = self.buffers, self.buffers.device
        pool = None
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            for bucket in sorted(self.buckets, reverse=True):
                buffers.clear()
                buffers.pad(bucket)
                for _ in range(2):  # warm up: lazy initialisation and autotuning outside the capture
                    self.forward(bucket)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    self.outputs[bucket] = self.forward(bucket)
                pool = graph.pool()
                self.graphs[bucket] = graph
        torch.cuda.current_stream(device).wait_stream(stream)
        torch.cuda.synchronize(device)
        buffers.clear()

    def run(self, num_seqs: int) -> torch.Tensor:
        """logits [num_seqs, vocab] of the decode step in the buffers (num_seqs sequences,
        one token each): a graph's replay when a bucket holds it, else the eager forward."""
        bucket = bucket_for(num_seqs, self.buckets)
        if bucket is None or bucket not in self.graphs or self.buffers.num_tokens != num_seqs:
            self.num_eager += 1
            return self.forward(num_seqs)
        self.buffers.pad(bucket)
        self.graphs[bucket].replay()
        self.num_replays += 1
        return self.outputs[bucket][:num_seqs]
