"""A Llama model on the paged KV pool: `LlamaExecutor`, the tensor side of the one
ModelRunner (engine/runner.py), and `llama_runner`, which builds that runner.

The executor owns the paged K/V storage (plain or quantized), the attention backend chosen
for it (attention/backends), the CUDA copy stream of the tier moves, and the step's
allocation peaks for the memory ledger. It decides nothing about the cache: the runner
hands it the copy-on-write copies and the blocks to move, and its forward reads the step's
tables from the cache.
"""

from __future__ import annotations

import itertools
import operator
import struct
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from kvpool.attention.backends import PagedStepMetadata, StepMetadata, paged_format, select_backend
from kvpool.attention.backends.step_buffers import StepBuffers
from kvpool.cache import BlockCopy, CacheDescriptor, FullAttentionManager
from kvpool.engine.cuda_graph import DECODE_MODES, DecodeGraphs
from kvpool.engine.memory import StepPeaks, check_fits
from kvpool.engine.runner import ModelRunner, ScheduledChunk, StepChunks
from kvpool.engine.tier_bridge import TierBridge
from kvpool.models.llama import LlamaModel
from kvpool.models.tensor_parallel import check_same_step, step_digest
from kvpool.storage.kv import PagedKVStorage, QuantizedKVStorage
from kvpool.storage.quant import KVSchema, code_dtype, kv_schema
from kvpool.tiers import Tier

_FIRST = operator.itemgetter(0)
_NEEDS_LOGITS = operator.attrgetter("needs_logits")
_TOKEN_IDS = operator.attrgetter("token_ids")


def kv_format_for(model: LlamaModel, name: str | None) -> KVSchema | None:
    """The KV storage format `name` for `model` (spec/kv_formats.py), or None for unquantized
    storage in the model's own dtype (fp32 for an fp32 model, and so on); ValueError for an
    unknown name."""
    if name is None:
        return None
    fmt = kv_schema(name)
    return None if not fmt.scaled and code_dtype(fmt) == model.dtype else fmt


def llama_runner(
    model: LlamaModel,
    num_blocks: int,
    block_size: int,
    descriptor: CacheDescriptor,
    *,
    enable_prefix_caching: bool = True,
    decode_path: str | None = None,
    host_tier: Tier | None = None,
    preemption: str = "recompute",
    persistent_tiers: Sequence[Tier] = (),
    kv_format: str | None = None,
    decode_mode: str = "eager",
    max_num_seqs: int = 64,
    max_num_batched_tokens: int = 512,
) -> ModelRunner:
    """The one runner over a FullAttentionManager and a LlamaExecutor.

    decode_path: the attention backend's implementation, "native" / "bags" / "padded"
    (attention/backends); None picks "native" when the model runs the C kernels, else
    "bags". host_tier, persistent_tiers, preemption: as ModelRunner takes them.
    kv_format: the KV cache's storage format (storage/quant.py: bf16, fp16, fp8_e4m3,
    fp8_e5m2, int8); None or the model's own dtype: unquantized, in the model's dtype.
    decode_mode: how pure-decode steps run (engine/cuda_graph.py DECODE_MODES: "eager",
    "static" buffers without capture, CUDA "graphs"); max_num_seqs,
    max_num_batched_tokens: the engine's, which size the step buffers of the last two
    (a step they cannot hold runs eagerly)."""
    fmt = kv_format_for(model, kv_format)
    if fmt is not None and (host_tier is not None or persistent_tiers):
        raise ValueError(f"--kv-cache-dtype {fmt.name}: the host, disk and Redis tiers keep unquantized blocks only")
    if model.shard is not None and preemption == "auto":
        raise ValueError(
            "preemption 'auto' decides by this process's timings, which the tensor-parallel ranks differ in"
        )
    executor = LlamaExecutor(
        model, num_blocks, block_size, fmt, decode_path, decode_mode, max_num_seqs, max_num_batched_tokens
    )
    bridge = TierBridge(host_tier, persistent_tiers, block_size, enable_prefix_caching=enable_prefix_caching)
    cache = FullAttentionManager(
        num_blocks,
        block_size,
        descriptor,
        enable_prefix_caching=enable_prefix_caching,
        lower_tier=bridge.index,
        record_published=bool(bridge.persistent_tiers),
    )
    capacity = num_blocks * block_size
    return ModelRunner(
        cache,
        executor,
        bridge,
        descriptor=descriptor,
        block_size=block_size,
        capacity_tokens=capacity,
        max_model_len=min(model.config.max_position, capacity),
        preemption=preemption,
    )


class LlamaExecutor:
    """A Llama's tensors on `num_blocks` paged blocks of `block_size` tokens, stored in `fmt`
    (None: unquantized, in the model's dtype); the attention backend's implementation
    `decode_path` (None: the best this process runs).

    decode_mode (engine/cuda_graph.py DECODE_MODES): "static" or "graphs" keep the step's
    metadata in persistent buffers (`step_buffers`, which the runner updates every step)
    for max_num_seqs sequences and max_num_tokens tokens, and one more block in the pool
    than the cache hands out, block num_blocks, the dummy block that padded rows write;
    pure-decode steps then run through `DecodeGraphs`, and a backend with
    `begin_buffered_step` (Triton's) plans the other steps the buffers hold from them
    (eagerly: no graph), not from the cache's step tables. They fall back to "eager" where
    the attention backend cannot read the buffers (no `begin_decode`: the C kernels, a
    quantized pool; for "graphs", any backend but Triton's) or the model is sharded
    (tensor parallel)."""

    has_state = False

    def __init__(
        self,
        model: LlamaModel,
        num_blocks: int,
        block_size: int,
        fmt: KVSchema | None,
        decode_path: str | None,
        decode_mode: str = "eager",
        max_num_seqs: int = 64,
        max_num_tokens: int = 512,
    ) -> None:
        if decode_mode not in DECODE_MODES:
            raise ValueError(f"unknown decode mode {decode_mode!r}; one of {', '.join(DECODE_MODES)}")
        if decode_mode == "graphs" and model.device.type != "cuda":
            raise ValueError(f"decode mode 'graphs' captures CUDA graphs: the model is on {model.device.type}")
        cfg = model.config
        # Buffered decodes need a backend that reads the step buffers (`begin_decode`: the
        # torch paged backend, and Triton's; graphs only Triton's: the torch one's buffered
        # decode gathers every row's whole table width, fine for the CPU tests' small pools,
        # not a GPU's), an unquantized pool and no tensor parallelism. Decided before the
        # pool is allocated, so that only then does it hold the dummy block.
        buffered = False
        if decode_mode != "eager" and fmt is None and model.shard is None:
            key, backend = select_backend(
                "full", "paged", model.device.type, decode_path, has_kernels=model.kernels is not None
            )
            buffered = hasattr(backend, "begin_decode") and (decode_mode == "static" or key.impl == "triton")
        num_blocks += buffered  # the dummy block, past the cache's
        self.model = model
        self.vocab_size = cfg.vocab_size
        self.kv_format = fmt.name if fmt is not None else str(model.dtype).removeprefix("torch.")
        self.storage: PagedKVStorage | QuantizedKVStorage
        if fmt is None:
            self.storage = PagedKVStorage(
                cfg.num_layers,
                num_blocks,
                block_size,
                cfg.num_kv_heads,
                cfg.head_dim,
                model.dtype,
                model.device,
                model.kernels,
            )
        else:
            self.storage = QuantizedKVStorage(
                cfg.num_layers,
                num_blocks,
                block_size,
                cfg.num_kv_heads,
                cfg.head_dim,
                fmt,
                model.dtype,
                model.device,
                max_seqs=max_num_seqs,
            )
        k, v = self.storage.k, self.storage.v
        # a tier's entry of one block: every layer's K and V
        self.block_layout = {"k": (k.dtype, (k.shape[0], *k.shape[2:])), "v": (v.dtype, (v.shape[0], *v.shape[2:]))}
        self.block_bytes = k[:, 0].nbytes + v[:, 0].nbytes
        # On CUDA the tier copies run on a stream of their own, ordered against the compute
        # stream by events (`to_host`, `to_device`); loads not yet waited for by compute:
        self._copy_stream = torch.cuda.Stream(model.device) if model.device.type == "cuda" else None
        # (asked at every step: a torch.device's `type` is a new string each read, ~0.4 us)
        self._host_model = model.device.type == "cpu"
        self._loads_in_flight: list[torch.cuda.Event] = []
        # The attention backend (attention/backends), chosen once for this storage by the
        # `decode_path` setter: its `begin_step` plans each step, and the PagedStep it
        # returns is the attention of the model's forward (its StepMetadata).
        self.decode_path = decode_path
        self.last_decode_path: str | None = None  # the path the last step's decodes took
        self.peaks = StepPeaks()  # the largest step's allocations, for the memory ledger
        # pure-decode steps over persistent buffers (engine/cuda_graph.py); None: eager
        self.step_buffers: StepBuffers | None = None
        self._graphs: DecodeGraphs | None = None
        self._decode_max_position = 0  # the step's largest position, for the forward a graph captures
        self.num_buffered_steps = 0  # other steps planned from the buffers (`begin_buffered_step`)
        if buffered:
            assert hasattr(self.attention, "begin_decode"), "the backend chosen is not the one predicted"
            max_blocks = -(-min(cfg.max_position, (num_blocks - 1) * block_size) // block_size)
            # (sized by the engine's limits: a huge --max-num-seqs or --max-num-batched-tokens
            # was a TypeError past int64 from torch.zeros, or the allocator's RuntimeError)
            host_bytes, device_bytes = StepBuffers.num_bytes(
                max_num_seqs, max_num_tokens, max_blocks, model.device.type == "cpu"
            )
            what = (
                f"the decode steps' persistent metadata for --max-num-seqs {max_num_seqs} and "
                f"--max-num-batched-tokens {max_num_tokens}"
            )
            advice = "lower --max-num-seqs or --max-num-batched-tokens, or give --enforce-eager"
            check_fits(host_bytes, "cpu", what, advice)
            if device_bytes:
                check_fits(device_bytes, model.device, what, advice)
            self.step_buffers = StepBuffers(
                max_num_seqs, max_num_tokens, max_blocks, block_size, model.device, dummy_block=num_blocks - 1
            )
            self._graphs = DecodeGraphs(self._decode_forward, self.step_buffers, capture=decode_mode == "graphs")
        self.decode_mode = decode_mode if self._graphs is not None else "eager"
        if self.decode_mode == "graphs":
            self._capture_graphs()

    @property
    def decode_path(self) -> str:
        """The attention backend's implementation ("native", "bags", "padded")."""
        return self.attention.name

    @decode_path.setter
    def decode_path(self, path: str | None) -> None:
        """Choose the attention backend for this runner's storage and device: `path`, or
        None for the best this process runs (attention/backends PREFERRED)."""
        model = self.model
        fmt = paged_format(self.storage)
        key, backend = select_backend("full", fmt, model.device.type, path, has_kernels=model.kernels is not None)
        self.attention = backend(
            self.storage, model.config.num_heads, model.kernels, model.dtype, self.wait_for_loads, decode_path=key.impl
        )

    # ---- the tiers' block moves -----------------------------------------------------

    def to_host(self, block_ids: Sequence[int]) -> list[dict[str, torch.Tensor]]:
        """Each block's {"k", "v"}: [layers, block_size, ...] in host memory, one gather."""
        k, v = self._gather(block_ids)
        return [{"k": k[:, j], "v": v[:, j]} for j in range(len(block_ids))]

    @property
    def keeps_block_state(self) -> bool:
        """True while a quantized pool keeps full-precision tails of partly written blocks
        (`drop_blocks` must hear of the blocks nobody holds any more)."""
        storage = self.storage
        return isinstance(storage, QuantizedKVStorage) and storage.num_tails > 0

    def _gather(self, block_ids: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of device blocks `block_ids`, every layer, in host memory: two
        [layers, n, block_size, kv_heads, head_dim] tensors (pinned on CUDA), one gather.

        On CUDA the gather and the copy run on the copy stream, after all the compute
        stream has queued so far (the blocks' last writes) and after any load still in
        flight (same stream); the host waits for the bytes, which it hands to a tier, so
        nothing the compute stream queues later can overwrite the blocks first."""
        storage = self.storage
        ids = torch.tensor(block_ids, dtype=torch.long, device=storage.k.device)
        stream = self._copy_stream
        if stream is None:
            return storage.k[:, ids], storage.v[:, ids]  # (new tensors: the gather copies)
        stream.wait_stream(torch.cuda.current_stream(storage.k.device))
        with torch.cuda.stream(stream):
            out = []
            for pool in (storage.k, storage.v):
                gathered = pool[:, ids]
                host = torch.empty(gathered.shape, dtype=gathered.dtype, pin_memory=True)
                host.copy_(gathered, non_blocking=True)
                out.append(host)
            done = torch.cuda.Event()
            done.record(stream)
        done.synchronize()
        return out[0], out[1]

    def to_device(self, block_ids: Sequence[int], blocks: Sequence[dict[str, torch.Tensor]]) -> None:
        """Write the tier's tensors of each block ({"k", "v"}: [layers, block_size, kv_heads,
        head_dim]) into device blocks `block_ids`, in one copy per pool.

        On CUDA the copy runs on the copy stream from pinned staging, after the compute
        stream's work so far (earlier readers of these reused blocks), and neither the host
        nor the compute stream waits for it here: the next step waits on its event just
        before the first thing that reads the cache (a copy-on-write copy, or layer 0's
        attention: the embedding and layer 0's projections run meanwhile). A loaded block is
        only ever read after its copy has completed."""
        for t in blocks:
            if any(t[name].shape != shape for name, (_, shape) in self.block_layout.items()):
                raise AssertionError(f"a tier block of shapes {t['k'].shape}, {t['v'].shape} passed the layout check")
        storage = self.storage
        device = storage.k.device
        ids = torch.tensor(block_ids, dtype=torch.long, device=device)
        stream = self._copy_stream
        if stream is None:
            storage.k[:, ids] = torch.stack([t["k"] for t in blocks], dim=1)
            storage.v[:, ids] = torch.stack([t["v"] for t in blocks], dim=1)
            return
        staged = []
        for name, pool in (("k", storage.k), ("v", storage.v)):
            host = torch.empty((pool.shape[0], len(blocks), *pool.shape[2:]), dtype=pool.dtype, pin_memory=True)
            torch.stack([t[name] for t in blocks], dim=1, out=host)
            staged.append((pool, host))
        stream.wait_stream(torch.cuda.current_stream(device))
        # `ids` was made on the compute stream: the allocator must not hand its memory to
        # the compute stream's next tensors while the copy stream may still read it
        ids.record_stream(stream)
        with torch.cuda.stream(stream):
            for pool, host in staged:
                pool[:, ids] = host.to(device, non_blocking=True)  # (the host allocator keeps `host` until done)
            done = torch.cuda.Event()
            done.record(stream)
        self._loads_in_flight.append(done)

    def wait_for_loads(self) -> None:
        """The compute stream waits for the loads in flight (before it reads the cache)."""
        if self._loads_in_flight:
            compute = torch.cuda.current_stream(self.storage.k.device)
            for done in self._loads_in_flight:
                compute.wait_event(done)
            self._loads_in_flight.clear()

    # ---- state, figures --------------------------------------------------------------

    def reset_state(self, slot: int) -> None:
        raise AssertionError("a Llama request holds no state slot")

    def copy_state(self, src: int, dst: int) -> None:
        raise AssertionError("a Llama request holds no state slot")

    def copy_whole_state(self, src: int, dst: int) -> None:
        raise AssertionError("a Llama request holds no state slot")

    def replay(
        self, token_ids: Sequence[int], start: int, block_ids: Sequence[int], state_slot: int, valid_from: int
    ) -> None:
        raise AssertionError("a Llama cache never restores a state by replay")

    def drop_blocks(self, block_ids: Sequence[int]) -> None:
        """Blocks nobody holds any more: a quantized pool's full-precision tails go with them."""
        if isinstance(self.storage, QuantizedKVStorage) and self.storage.num_tails:
            self.storage.drop_tails(block_ids)

    def kv_read_bytes(self, num_context_tokens: int) -> int:
        return num_context_tokens * self.storage.bytes_per_token

    def check_integrity(self) -> None:
        if self.step_buffers is not None:
            self.step_buffers.check_integrity()

    def cache_stats(self, cache: Any) -> dict[str, float]:
        return {
            "kv_capacity_bytes": self.storage.num_bytes,
            "bytes_per_token": self.storage.bytes_per_token,
            "lower_tier_hit_tokens": cache.stats.num_lower_tier_hit_tokens,
            "cached_free_blocks": cache.pool.num_free_cached,
        }

    # ---- the forward ---------------------------------------------------------------

    def _note_forward(self, num_tokens: int, attend, logits: torch.Tensor) -> None:
        """What the forward allocated: its step buffers, the attention output (the native
        attend's one buffer; the plain path's `empty_like(q)`, the same shape), the logits."""
        out_bytes = getattr(attend, "out_bytes", None)
        cfg = self.model.config
        if out_bytes is None:
            out_bytes = num_tokens * cfg.num_heads * cfg.head_dim * self.model.dtype.itemsize
        self.peaks.note("activations", self.model.step_buffer_bytes + out_bytes)
        self.peaks.note("logits", logits.nbytes)

    def copy_blocks(self, copies: Mapping[str, Sequence[BlockCopy]]) -> None:
        """The one group's copy-on-write copies, before anything writes."""
        full = copies.get("full", [])
        # apply_copies gathers the source blocks' K of every layer, then their V: half a block each
        self.peaks.note("cow_staging", len(full) * self.storage.bytes_per_block // 2)
        if full:
            self.wait_for_loads()  # a copy may read a block just loaded
            self.storage.apply_copies(full)

    def _decode_forward(self, num_seqs: int) -> torch.Tensor:
        """The `DecodeForward` of `DecodeGraphs`: a decode step of the first num_seqs rows of
        the step buffers and the graphs' static token ids, nothing read from the host but the
        position bound (`_decode_forward`'s caller checked it) -> logits [num_seqs, vocab]."""
        buffers, graphs = self.step_buffers, self._graphs
        assert buffers is not None and graphs is not None
        step = self.attention.begin_decode(buffers, num_seqs)
        meta = StepMetadata(step, None, self._decode_max_position)
        return self.model.forward(graphs.input_ids[:num_seqs], buffers.positions[:num_seqs], meta)

    def _capture_graphs(self) -> None:
        """Every bucket's CUDA graph, now, at build: a capture compiles, warms up and records
        the step, which inside a live request would stall it (captured over padding only:
        position 0 of the dummy block). The memory ledger gets the graphs' shared pool: its
        segments, the buckets' output logits [bucket, vocab] among them, which no eager
        step can use (engine/memory.py, workspace)."""
        graphs = self._graphs
        assert graphs is not None and graphs.capturing
        self._decode_max_position = 0
        graphs.capture()
        logits = sum(t.nbytes for t in graphs.outputs.values())
        # The pool's segments are found by their pool id in torch's allocator snapshot; a
        # torch that labels them otherwise reads 0 here: the ledger then counts the outputs
        # only (never run on a GPU yet: a count to check there, not a reason to refuse to start)
        pool = graphs.pool_bytes()
        self.peaks.note("graph_logits", logits)
        self.peaks.note("graph_pool", max(pool - logits, 0))

    def _takes_decode(self, chunks: Sequence[ScheduledChunk]) -> tuple[Sequence[int], Sequence[int]] | None:
        """The step's tokens (each chunk's one) and starts when it goes through the graphs: a
        pure decode (one token a chunk, each sampled) that the runner put in the step
        buffers, with a backend that reads them; else None."""
        buffers = self.step_buffers
        n = len(chunks)
        # (n chunks of n tokens in the buffers: one token each)
        if buffers is None or not buffers.num_seqs == buffers.num_tokens == n > 0:
            return None
        if not hasattr(self.attention, "begin_decode"):
            return None
        if type(chunks) is StepChunks:
            rest = chunks.rest
            if not rest:
                # the engine's decode columns alone (each a sampled token): their own columns,
                # no chunk tuple made (engine/runner.py StepChunks)
                return chunks.lead_tokens, chunks.lead_starts
            if chunks.columns is not None:  # the columns, then other chunks of one token each
                if not all(map(_NEEDS_LOGITS, rest)):
                    return None
                return [*chunks.lead_tokens, *map(_FIRST, map(_TOKEN_IDS, rest))], chunks.columns[1]
        _, token_ids, starts, needs_logits = zip(*chunks, strict=True)  # the chunks' columns
        return (list(map(_FIRST, token_ids)), starts) if all(needs_logits) else None

    def forward(self, chunks: Sequence[ScheduledChunk], cache: Any, all_logits: bool = False) -> torch.Tensor:
        """Run one step; logits [num chunks with needs_logits, vocab] (or every token's, [N, vocab])."""
        buffers = self.step_buffers
        held = False  # the step is in the buffers, for a backend that plans from them
        if self._graphs is not None:
            decode = self._takes_decode(chunks)
            if decode is not None:
                return self._forward_decode(*decode)
            held = buffers.num_seqs == len(chunks) > 0 and hasattr(self.attention, "begin_buffered_step")
        device = self.model.device
        # the chunks' columns, and what the step computes from them in numpy (no Python loop a
        # chunk or a token): [n] int64 q_lens, ctx_lens; the flat tokens' ids [N]
        n = len(chunks)
        columns = chunks.columns if type(chunks) is StepChunks else None
        if columns is not None:
            # the engine's decode columns (a token each, sampled) then the other chunks: read
            # from the columns and `rest`, the leading chunks not made (engine/runner.py StepChunks)
            rest = chunks.rest
            k = n - len(rest)
            request_ids, starts, chunk_ends = columns
            rest_tokens = [c.token_ids for c in rest]
            token_lists: Sequence[Sequence[int]] | None = None  # (made only where read: below)
            rest_lens = list(map(len, rest_tokens))
            ends: np.ndarray | None = None  # [n] each chunk's end among the step's N tokens: not made here
            # (the leading decodes' one token each; empty and fill: np.ones is a Python
            # function around them, twice their time)
            q_lens = np.empty(n, np.int64)
            q_lens.fill(1)
            q_lens[k:] = rest_lens
            # (made below: where the buffers hold the step, their own host twin of its
            # contexts, which their update or advance wrote from these ends; a conversion of
            # every row's end, ~0.25 us a row, only where they do not)
            ctx_lens: np.ndarray | None = None
            tokens = itertools.chain(chunks.lead_tokens, itertools.chain.from_iterable(rest_tokens))
            # the sampled chunks' last tokens: decode i's is row i, then each of the rest's that
            # samples its end - 1 (its end: k + its tokens and those before it; the rest are a
            # step's few joiners, a plain loop)
            logit_rows = list(range(k))
            num_tokens = k
            for c, m in zip(rest, rest_lens, strict=True):
                num_tokens += m
                if c.needs_logits:
                    logit_rows.append(num_tokens - 1)
        else:
            request_ids, token_lists, starts, needs = zip(*chunks, strict=True) if n else ((), (), (), ())
            q_lens = np.fromiter(map(len, token_lists), np.int64, n)
            ctx_lens = np.fromiter(starts, np.int64, n) + q_lens
            tokens = itertools.chain.from_iterable(token_lists)
            # [n]: each chunk's end among the step's N tokens (the ufunc itself: np.cumsum adds ~2 us)
            ends = np.add.accumulate(q_lens)
            num_tokens = int(ends[-1]) if n else 0
            # each sampled chunk's last token (every chunk's in the common step: no mask made then)
            last_rows = ends - 1
            logit_rows = (last_rows if all(needs) else last_rows[np.fromiter(needs, bool, n)]).tolist()
        # (struct's conversion of the ids in one C call: ~half np.fromiter's, which packs an
        # element at a time through numpy's generic path, ~270 instructions an id)
        flat_ids = np.empty(num_tokens, np.int64)
        struct.pack_into(f"{num_tokens}q", flat_ids, 0, *tokens)
        held = held and buffers.num_tokens == num_tokens
        if ctx_lens is None:  # (the columns' step: `chunk_ends`, the buffers' [n] int32 where they hold it)
            ctx_lens = buffers.host_ctx_lens(n) if held else np.fromiter(chunk_ends, np.int64, n)
        if held:  # the runner's update wrote the step's tables, slots and positions: plan from them
            # (the runner checked the step as cache.step_tables checks it, before writing it)
            step = self.attention.begin_buffered_step(buffers, q_lens, ctx_lens)
            pos_t = buffers.leading_positions(num_tokens)  # (a view made once a length)
            self.num_buffered_steps += 1
        else:
            q_list, ctx_list = q_lens.tolist(), ctx_lens.tolist()
            # Validates that each chunk continues its computed prefix within its reservation.
            tables = cache.step_tables(request_ids, starts, ctx_list)
            if self.model.shard is not None:  # tensor parallel: every rank must run the same tokens alike
                if token_lists is None:
                    token_lists = [c.token_ids for c in chunks]
                digest = step_digest(list(request_ids), list(starts), list(token_lists), tables.slots)
                check_same_step(digest, self.model)
            step = self.attention.begin_step(
                PagedStepMetadata(q_list, ctx_list, tables.slots, tables.csr.indptr, tables.csr.indices)
            )
            # flat token j of chunk i sits at position starts[i] + (j - its first row)
            if ends is None:  # (the columns' path did not need them)
                ends = np.add.accumulate(q_lens)
            positions = np.arange(num_tokens) + np.repeat(ctx_lens - ends, q_lens)
            pos_t = torch.from_numpy(positions).to(device)
        if buffers is not None:
            # the buffers hold a step only between the runner's update and this forward, so
            # a step the runner did not put there (a caller's own forward) is never taken
            buffers.clear()
        if step.decode_path is not None:
            self.last_decode_path = step.decode_path
        self.peaks.note("step_tables", step.table_bytes)  # the plan's tensors (for the memory ledger)
        self.peaks.note("chunked_prefill", step.prefill_bytes)
        ids_t = torch.from_numpy(flat_ids)
        if not self._host_model:  # (a CPU tensor's .to(cpu) is itself, after ~2 us of dispatch)
            ids_t = ids_t.to(device)
        top = int(np.maximum.reduce(ctx_lens)) - 1 if n else 0  # (the ufunc: no Python frame)
        logits = self.model.forward(ids_t, pos_t, StepMetadata(step, None if all_logits else logit_rows, top))
        self._note_forward(num_tokens, step.attend, logits)
        return logits

    def _forward_decode(self, tokens: Sequence[int], starts: Sequence[int]) -> torch.Tensor:
        """A pure-decode step through `DecodeGraphs` (the runner has put it in the step
        buffers), its chunks' columns: tokens[i] the i-th sequence's one token, starts[i]
        its position -> logits [len(starts), vocab], every row sampled."""
        graphs, buffers = self._graphs, self.step_buffers
        assert graphs is not None and buffers is not None
        top = max(starts)
        max_position = self.model.config.max_position
        if top >= max_position:
            raise ValueError(f"position {top} exceeds the model's context {max_position}")
        self._decode_max_position = top
        self.wait_for_loads()  # outside the graph: a replay must not wait on this step's events
        graphs.set_input_ids(tokens)
        logits = graphs.run(len(starts))
        buffers.clear()  # a step is taken once: see forward
        self.last_decode_path = self.attention.name
        self._note_forward(len(starts), None, logits)
        return logits
