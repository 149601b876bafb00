"""Full attention on the unquantized paged pool through Triton kernels (triton_decode.py):
the step's K/V written through the slot mapping and its decodes read in place over the CSR
block tables, with the context split across programs when sequences are few and long;
prefill chunks (and any chunk over a cached prefix) through the extend kernel of
triton_extend.py, which reads their keys in place over the same tables (no gathered copy).
The registry's ("full", "paged", "cuda", "triton").

The pool keeps its layout (storage/kv.py; why it suits the GPU: triton_decode.py).

A step's metadata comes from the cache's lists (`begin_step`: CSR tables and slots made
into tensors each step) or from the runner's persistent step buffers (step_buffers.py):
`begin_decode` for a decode a CUDA graph captures, `begin_buffered_step` for any other step
they hold (prefill chunks, mixed steps), the same kernels over dense table rows.

Devices: a CUDA pool; or, for tests on machines without a GPU, a CPU pool when the kernels
were imported in Triton's interpreter (TRITON_INTERPRET=1 set before triton's first
import, as tests/conftest.py does without a GPU): the backend follows its pool's device and refuses
a CPU pool otherwise. Triton is imported when the backend is built, not with the registry,
so a machine without it still lists the key (and select_backend passes it over).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import operator
from collections.abc import Callable, Sequence
from itertools import accumulate
from typing import Any, NamedTuple

import numpy as np
import torch

from kvpool.attention.backends.paged_step import BufferedStep, PagedBackend, PagedStep, PagedStepMetadata, make_step
from kvpool.attention.backends.step_buffers import StepBuffers
from kvpool.attention.paged import StepPlan
from kvpool.storage.kv import PagedKVStorage

CPU_NUM_SMS = 132  # the split rule's SM count for an interpreted (CPU) pool: an H100's / H200's


def triton_importable() -> bool:
    """Whether this process can import triton (the backend needs it)."""
    return importlib.util.find_spec("triton") is not None


@dataclasses.dataclass(frozen=True)
class TritonDecodePlan:
    """One step's decodes for `paged_decode`: B sequences, int32 CSR tables on the pool's device."""

    rows: torch.Tensor  # [B] int32: rows of the flat batch holding decode queries
    indptr: torch.Tensor  # [B + 1] int32: sequence b's blocks are indices[indptr[b]:indptr[b + 1]]
    indices: torch.Tensor  # [nnz] int32
    last_len: torch.Tensor  # [B] int32: tokens in each sequence's last block, 1..block_size
    num_splits: int  # programs per (sequence, KV head): triton_decode.num_splits_for

    @property
    def num_bytes(self) -> int:
        return sum(t.nbytes for t in (self.rows, self.indptr, self.indices, self.last_len))


class TritonPagedBackend(PagedBackend):
    """The Triton backend of the paged pool (module docstring). Same constructor as the
    torch backend; `kernels` (the C CPU kernels) is unused. num_sms: the split rule's SM
    count (None: the CUDA device's, CPU_NUM_SMS for an interpreted CPU pool); num_splits:
    every decode's split, in place of the rule (None: triton_decode.num_splits_for)."""

    default_decode_path = "triton"

    def __init__(
        self,
        storage: PagedKVStorage,
        num_heads: int,
        kernels,
        dtype: torch.dtype,
        before_read: Callable[[], None] | None = None,
        *,
        decode_path: str | None = None,
        num_sms: int | None = None,
        num_splits: int | None = None,
    ) -> None:
        super().__init__(storage, num_heads, kernels, dtype, before_read, decode_path=decode_path)
        if num_splits is not None and num_splits < 1:
            raise ValueError(f"num_splits must be at least 1, got {num_splits}")
        self.num_splits = num_splits
        from kvpool.attention.backends import triton_decode, triton_extend

        self.ops = triton_decode
        self.extend_ops = triton_extend
        device = storage.k.device
        if num_sms is None and device.type == "cuda":
            num_sms = torch.cuda.get_device_properties(device).multi_processor_count
        elif num_sms is None:
            num_sms = CPU_NUM_SMS
        if num_sms <= 0:
            raise ValueError(f"num_sms must be positive, got {num_sms}")
        self.num_sms = num_sms
        self.few_shapes = True  # (a test sets False: every buffered step's shape by `_shape`, the twin)
        # the plans `plan_few_kept` keeps by shape, for the step buffers they were made in
        self._kept_plans: dict[tuple[int, ...], tuple[Any, Any, int]] = {}
        self._kept_for: StepBuffers | None = None

    def _check(self, storage: PagedKVStorage, kernels, decode_path: str) -> None:
        if decode_path != "triton":
            raise ValueError(f"the triton backend decodes by its kernels, not by {decode_path!r}")
        if not isinstance(storage, PagedKVStorage):
            raise ValueError(f"the triton backend reads an unquantized PagedKVStorage, got {type(storage).__name__}")
        if not triton_importable():
            raise ValueError("the triton attention backend needs triton (pip install triton)")
        device = storage.k.device
        if device.type == "cpu":
            from kvpool.attention.backends import triton_decode

            if not triton_decode.interpreted():
                raise ValueError(
                    "the triton backend on a CPU pool needs Triton's interpreter: set TRITON_INTERPRET=1 "
                    "before triton is first imported"
                )
        elif device.type != "cuda":
            raise ValueError(f"the triton backend runs on CUDA (or interpreted on the CPU), not on {device.type!r}")

    def _plan_decodes(self, meta: PagedStepMetadata, seqs: list[int], rows: list[int]) -> TritonDecodePlan:
        st = self.storage
        bs, device = st.block_size, st.k.device
        ptr, ctx_lens = meta.indptr, meta.ctx_lens
        if len(seqs) == len(ctx_lens):  # every sequence decodes: the step's own tables
            indptr, indices = ptr, meta.indices
        else:
            indptr, indices = [0], []
            for i in seqs:
                indices.extend(meta.indices[ptr[i] : ptr[i + 1]])
                indptr.append(len(indices))
        last_len = [ctx_lens[i] - (ptr[i + 1] - ptr[i] - 1) * bs for i in seqs]
        splits = self.num_splits
        if splits is None:
            max_ctx_len = max(ctx_lens[i] for i in seqs)
            splits = self.ops.num_splits_for(len(seqs), st.num_kv_heads, max_ctx_len, self.num_sms)
        return TritonDecodePlan(
            _int32(rows, device), _int32(indptr, device), _int32(indices, device), _int32(last_len, device), splits
        )

    def _plan_extend(self, meta: PagedStepMetadata, seqs: list[int], rows: list[int], num_rows: int):
        """The extend kernel's tables for the step's prefill chunks, sequences `seqs` whose
        queries start at rows `rows` of the step's num_rows."""
        indptr, indices = [0], []
        for i in seqs:
            indices.extend(meta.indices[meta.indptr[i] : meta.indptr[i + 1]])
            indptr.append(len(indices))
        st = self.storage
        return self.extend_ops.plan_extend(
            [meta.q_lens[i] for i in seqs],
            [meta.ctx_lens[i] for i in seqs],
            indptr,
            indices,
            st.block_size,
            self.num_heads,
            st.num_kv_heads,
            st.k.device,
            q_rows=rows,
            num_rows=num_rows,
        )

    def _attend(self, slots: torch.Tensor, attend_decodes: Callable | None, extend: Any) -> Callable:
        """The attend every layer of a step calls: the step's K/V written through `slots`,
        then its decodes by `attend_decodes(q, k_cache, v_cache, out)` (None: no decode)
        and its prefill chunks by the extend kernel over the plan `extend` (None: none)."""
        st, scale, before_read, ops = self.storage, self.scale, self.before_read, self.ops
        extend_attention = self.extend_ops.extend_attention
        k_layers, v_layers = st.k_layers, st.v_layers

        def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            if layer == 0 and before_read is not None:
                before_read()  # the first read of the cache this step
            k_cache, v_cache = k_layers[layer], v_layers[layer]
            ops.write_kv(_rows_contiguous(k), _rows_contiguous(v), slots, k_cache, v_cache)
            q = _rows_contiguous(q)
            out = torch.empty_like(q)
            if attend_decodes is not None:
                attend_decodes(q, k_cache, v_cache, out)
            if extend is not None:  # the prefill chunks' rows; the decodes' are left as they are
                extend_attention(q, k_cache, v_cache, extend, scale, out=out)
            return out

        return attend

    def begin_step(self, meta: PagedStepMetadata) -> PagedStep:
        """The step's plan (built once) and the attend every layer calls."""
        st, scale, ops = self.storage, self.scale, self.ops
        bs, device = st.block_size, st.k.device
        prefill_seqs, prefill_rows, seqs, rows = [], [], [], []
        row = 0
        ptr = meta.indptr
        for i, (q_len, ctx_len) in enumerate(zip(meta.q_lens, meta.ctx_lens, strict=True)):
            num_blocks = ptr[i + 1] - ptr[i]
            if num_blocks != -(-ctx_len // bs) or ctx_len < q_len or q_len < 1:
                raise ValueError(
                    f"sequence {i}: {num_blocks} blocks of {bs} for {ctx_len} tokens with {q_len} new ones"
                )
            if q_len == 1:
                seqs.append(i)
                rows.append(row)
            else:
                prefill_seqs.append(i)
                prefill_rows.append(row)
            row += q_len
        if len(meta.slots) != row:  # (write_kv reads a slot per new token: past the tensor's end, on any)
            raise ValueError(f"the step has {len(meta.slots)} slots for {row} new tokens (the sum of its q_lens)")
        slots = torch.tensor(meta.slots, dtype=torch.long, device=device)
        decode = self._plan_decodes(meta, seqs, rows) if seqs else None
        extend = self._plan_extend(meta, prefill_seqs, prefill_rows, row) if prefill_seqs else None

        def attend_decodes(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor) -> None:
            ops.paged_decode(
                q,
                decode.rows,
                decode.indptr,
                decode.indices,
                decode.last_len,
                k_cache,
                v_cache,
                scale,
                out,
                decode.num_splits,
            )

        attend = self._attend(slots, attend_decodes if decode is not None else None, extend)
        step = make_step(StepPlan(slots, None, []), attend, bs, st.num_kv_heads, st.head_dim, self.dtype)
        extra = 0 if extend is None else extend.num_bytes  # no prefill chunk is gathered
        if decode is None:
            return dataclasses.replace(step, table_bytes=step.table_bytes + extra)
        extra += decode.num_bytes
        if decode.num_splits > 1:  # the partial outputs and log-sum-exps the merge reads
            acc_bytes = 8 if self.dtype == torch.float64 else 4
            extra += len(seqs) * self.num_heads * decode.num_splits * (st.head_dim + 1) * acc_bytes
        return dataclasses.replace(step, decode_path="triton", table_bytes=step.table_bytes + extra)

    def begin_buffered_step(
        self, buffers: StepBuffers, q_lens: Sequence[int] | np.ndarray, ctx_lens: Sequence[int] | np.ndarray
    ) -> PagedStep:
        """`begin_step` for the step the buffers hold (their last `update`, sequences in its
        order: sequence i's q_lens[i] new tokens, its context ctx_lens[i] after them), read
        from the buffers instead of the cache's lists: K/V written through slot_mapping, the
        decodes (q_len 1) by `paged_decode_dense` and the prefill chunks by the extend
        kernel, both over the sequences' rows of block_tables (seq_rows), so neither the
        CSR tables nor the slots are built on the host; it lists only which sequences
        decode and the extend kernel's query tiles. The same kernels over the same blocks,
        lengths and split counts as `begin_step` over the cache's tables: the same outputs
        (tests/test_triton_kernels.py, tests/test_decode_graphs.py).

        The step's shape (which sequences decode, the chunks' lengths and rows) is read
        from the few sequences after the buffers' leading decodes (`StepBuffers.num_lead`:
        the common step's running decodes, then a joining request's chunk) in Python where
        they are at most FEW_OTHERS (`_few_shape`), else over the whole step in numpy
        (`_shape`, its twin: `few_shapes` False)."""
        st, scale, ops = self.storage, self.scale, self.ops
        # (the buffers' device is the pool's: a tensor's .device costs ~1 us on the host)
        bs, device = st.block_size, buffers.device
        n = len(q_lens)
        lead = buffers.num_lead if buffers.num_seqs == n else 0
        if self.few_shapes and n - lead <= FEW_OTHERS:
            shape = _few_shape(buffers, q_lens, ctx_lens, lead)
        else:
            shape = _shape(buffers, q_lens, ctx_lens)
        num_tokens, num_decodes, decode_seqs = shape.num_tokens, shape.num_decodes, shape.decode_seqs
        num_chunks = n - num_decodes
        slots, tables = buffers.leading_slots(num_tokens), buffers.block_tables  # [N] int32, [rows, width] int32
        decode = None
        if num_decodes:  # the decodes' query rows, table rows and lengths: [B] int32 each
            if decode_seqs is None:  # the leading sequences: slices, no index
                picked = buffers.leading(num_decodes)
            else:
                vectors = (buffers.query_start, buffers.seq_rows, buffers.ctx_lens)  # [max_num_seqs (+ 1)] int32
                index = torch.from_numpy(decode_seqs).to(device)
                picked = tuple(t[:n].index_select(0, index) for t in vectors)
            splits = self.num_splits
            if splits is None:
                splits = ops.num_splits_for(num_decodes, st.num_kv_heads, shape.longest, self.num_sms)
            decode = (*picked, splits)
        extend = None
        table_bytes = 0  # the step's own index tensors (the buffers' are allocated once)
        group, uneven = divmod(self.num_heads, st.num_kv_heads)  # (uneven: plan_extend names it)
        if num_chunks and shape.chunk_rows is None and type(shape.chunk_offsets) is list and not uneven:
            # a few chunks after the decodes (`_few_shape`): a shape seen before takes the plan
            # kept for it, its tables rewritten (`plan_few_kept`); kept for these buffers only
            if self._kept_for is not buffers:
                self._kept_for, self._kept_plans = buffers, {}
            extend, table_bytes = self.extend_ops.plan_few_kept(
                self._kept_plans,
                shape.chunk_q_lens,
                shape.chunk_ctx_lens,
                shape.chunk_offsets,
                buffers.block_tables_flat,
                group,
                num_tokens,
                num_decodes,
                buffers.plan_tables,
            )
        elif num_chunks:  # the chunks, their table rows as offsets into the flat table
            # (from the host twin of seq_rows, sent with the plan's tables: no device op)
            extend = self.extend_ops.plan_extend(
                shape.chunk_q_lens,
                shape.chunk_ctx_lens,
                shape.chunk_offsets,
                buffers.block_tables_flat,
                bs,
                self.num_heads,
                st.num_kv_heads,
                device,
                q_rows=shape.chunk_rows,
                num_rows=num_tokens,
                first_row=num_decodes,
                store=buffers.plan_tables,
            )
            # the plan's tables but the flat table (ExtendPlan.num_bytes less kv_indices),
            # counted without a pass over its tensors: [P] q_rows, q_lens, kv_indptr,
            # ctx_lens, [P + 1] part_rows, [T] tile_seq, tile_start, [R] merge_rows, int32
            num_tiles, num_merge = extend.tile_seq.shape[0], extend.merge_rows.shape[0]
            table_bytes = 4 * (5 * num_chunks + 1 + 2 * num_tiles + num_merge)

        def attend_decodes(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor) -> None:
            d_rows, d_seq_rows, d_ctx_lens, d_splits = decode
            ops.paged_decode_dense(q, d_rows, d_seq_rows, tables, d_ctx_lens, k_cache, v_cache, scale, out, d_splits)

        attend = self._attend(slots, attend_decodes if decode is not None else None, extend)
        decode_path = None
        if decode is not None:
            decode_path = "triton"
            if decode[3] > 1:  # the partial outputs and log-sum-exps the merge reads
                acc_bytes = 8 if self.dtype == torch.float64 else 4
                table_bytes += num_decodes * self.num_heads * decode[3] * (st.head_dim + 1) * acc_bytes
        # (make_step's figures without its walk over a plan that has no list-built tables:
        # no prefill chunk is gathered, the extend kernel reads the keys in place)
        return PagedStep(StepPlan(slots, None, []), attend, decode_path, table_bytes, 0)

    def begin_decode(self, buffers: StepBuffers, num_seqs: int) -> BufferedStep:
        """A decode step of the first num_seqs rows of `buffers` (one token each) through
        `write_kv` and `paged_decode_dense`, every step value read from the buffers' tensors
        (rows query_start[:n], table rows seq_rows[:n], ctx_lens[:n], slots): nothing
        planned on the host, so a CUDA graph captures it. The split count is fixed by the
        batch and the buffers' longest possible context (max_blocks_per_seq blocks), not by
        the step's lengths: a graph replays the split it captured (a split past a shorter
        sequence's end weighs nothing). The caller waits for the tier loads in flight first."""
        st, scale, ops, n = self.storage, self.scale, self.ops, num_seqs
        splits = self.num_splits
        if splits is None:
            longest = buffers.max_blocks_per_seq * st.block_size
            splits = ops.num_splits_for(n, st.num_kv_heads, longest, self.num_sms)
        rows, slots = buffers.query_start[:n], buffers.slot_mapping[:n]
        seq_rows, ctx_lens, tables = buffers.seq_rows[:n], buffers.ctx_lens[:n], buffers.block_tables
        k_layers, v_layers = st.k_layers, st.v_layers

        def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            k_cache, v_cache = k_layers[layer], v_layers[layer]
            ops.write_kv(_rows_contiguous(k), _rows_contiguous(v), slots, k_cache, v_cache)
            q = _rows_contiguous(q)
            out = torch.empty_like(q)
            return ops.paged_decode_dense(q, rows, seq_rows, tables, ctx_lens, k_cache, v_cache, scale, out, splits)

        return BufferedStep(attend, n)


# a buffered step whose sequences after the buffers' leading decodes are at most this many
# (the common step: a joining request's chunk, a few) has its shape read in Python
# (`_few_shape`, a Python read an element) instead of numpy passes over the whole step (`_shape`)
FEW_OTHERS = 8


class _StepShape(NamedTuple):
    """What `begin_buffered_step` plans a step from: its num_tokens; its num_decodes, their
    sequences (decode_seqs [B] int64 increasing; None: sequences [0, num_decodes)) and
    their longest context; its chunks' q_lens, ctx_lens and table offsets (row *
    max_blocks_per_seq), each [P] (a list or an array), and each one's first row among
    the step's tokens (chunk_rows; None: one after another from row num_decodes)."""

    num_tokens: int
    num_decodes: int
    decode_seqs: np.ndarray | None
    longest: int
    chunk_q_lens: Sequence[int]
    chunk_ctx_lens: Sequence[int]
    chunk_offsets: Sequence[int]
    chunk_rows: Sequence[int] | None


def _refuse(buffers: StepBuffers, n: int, num_tokens: int, num_ctx: int) -> ValueError:
    return ValueError(
        f"the step buffers hold {buffers.num_seqs} sequences of {buffers.num_tokens} tokens, "
        f"not {n} of {num_tokens} ({num_ctx} context lengths)"
    )


def _shape(
    buffers: StepBuffers, q_lens: Sequence[int] | np.ndarray, ctx_lens: Sequence[int] | np.ndarray
) -> _StepShape:
    """The step's shape in numpy passes over every sequence (the twin of `_few_shape`).
    ValueError where the lengths are not the step the buffers hold or not a step."""
    # (ufuncs' reductions called directly: the array methods add a Python frame, ~1 us each)
    q, c = np.asarray(q_lens, dtype=np.int64), np.asarray(ctx_lens, dtype=np.int64)
    n, num_tokens = len(q), int(np.add.reduce(q))
    if len(c) != n or buffers.num_seqs != n or buffers.num_tokens != num_tokens:
        raise _refuse(buffers, n, num_tokens, len(c))
    if n and (np.minimum.reduce(q) < 1 or np.minimum.reduce(c - q) < 0):  # (the masks only to name one)
        i = int(np.argmax((c < q) | (q < 1)))
        raise ValueError(f"sequence {i}: {c[i]} tokens with {q[i]} new ones")
    # the chunks (more than one token: q >= 1 now) and the decodes, the rest
    chunk_seqs = (q > 1).nonzero()[0]  # [P], increasing
    num_decodes = n - len(chunk_seqs)
    # the engine's order, the decodes first and the chunks after them: slices, no index
    # (the chunks are sequences [num_decodes, n) iff the first of them is num_decodes)
    if not len(chunk_seqs) or chunk_seqs[0] == num_decodes:
        decode_seqs, longest = None, int(np.maximum.reduce(c[:num_decodes])) if num_decodes else 0
        chunks: slice | np.ndarray = slice(num_decodes, n)
        chunk_rows = None
    else:
        decode_seqs = (q == 1).nonzero()[0]  # [B], increasing
        longest = int(c[decode_seqs].max()) if num_decodes else 0
        chunks = chunk_seqs
        chunk_rows = (np.cumsum(q) - q)[chunks]  # each chunk's first row of the step's tokens
    offsets = buffers.host_seq_rows()[chunks] * buffers.max_blocks_per_seq  # [P] int32
    return _StepShape(num_tokens, num_decodes, decode_seqs, longest, q[chunks], c[chunks], offsets, chunk_rows)


def _few_shape(
    buffers: StepBuffers, q_lens: Sequence[int] | np.ndarray, ctx_lens: Sequence[int] | np.ndarray, lead: int
) -> _StepShape:
    """`_shape` where the step's sequences [0, lead) decode (one token each, as the buffers
    wrote them: `StepBuffers.num_lead`) and the rest are few: those few read in Python,
    the leading ones checked and read for their longest context by C-level passes. The
    same shape, values and refusals, for any lead (tests/test_triton_kernels.py holds the
    two equal, wrong steps included)."""
    n = len(q_lens)
    # The leading rows' facts the rest relies on: one token each (so the step's total is
    # lead + the others' tokens, and they are decodes) over a context of at least that
    # token. The lengths are the caller's (the runner's: its chunks' or the step buffers'
    # host copy of the contexts), so `num_lead` cannot vouch for them: checked here, an array's q_lens by their
    # bytes against int64 ones (another dtype never matches) and the contexts by an argmin,
    # inline. A step that breaks them (or has fewer than lead sequences, or another count of
    # context lengths) goes to `_shape`, so its refusal, or its shape, is the twin's own.
    # (The check at 128 rows: `python -m timeit -s "import numpy as np; q = np.ones(128,
    # dtype=np.int64); c = np.arange(1000, 1128); o = q.tobytes()" "q.tobytes() != o or
    # c.item(c.argmin()) < 1"` 0.93 us; 2026-12-06, 2 shared Xeon cores, load ~10.)
    lead_c = np.asarray(ctx_lens[:lead])
    if lead:
        head = q_lens[:lead]
        ones = _ONES.get(lead)
        if ones is None:
            ones = _ONES[lead] = np.ones(lead, dtype=np.int64).tobytes()
        if (
            len(lead_c) != lead
            or (head.tobytes() != ones if type(head) is np.ndarray else list(head).count(1) != lead)
            or lead_c.item(lead_c.argmin()) < 1
        ):
            return _shape(buffers, q_lens, ctx_lens)
    if len(ctx_lens) != n:
        return _shape(buffers, q_lens, ctx_lens)
    # [0, lead): one token each; the others [lead, n) as Python ints
    tail_q = q_lens[lead:].tolist() if isinstance(q_lens, np.ndarray) else list(q_lens[lead:])
    tail_c = ctx_lens[lead:].tolist() if isinstance(ctx_lens, np.ndarray) else list(ctx_lens[lead:])
    num_tokens = lead + sum(tail_q)
    if buffers.num_seqs != n or buffers.num_tokens != num_tokens:
        raise _refuse(buffers, n, num_tokens, n)
    if tail_q and (min(tail_q) < 1 or min(map(operator.sub, tail_c, tail_q)) < 0):  # (the loop only to name one)
        for j, (q_len, ctx_len) in enumerate(zip(tail_q, tail_c, strict=True)):
            if q_len < 1 or ctx_len < q_len:
                raise ValueError(f"sequence {lead + j}: {ctx_len} tokens with {q_len} new ones")
    num_tail = n - lead
    # the leading decodes' longest context, by argmax, not a ufunc's reduce (its own setup):
    # at 128 rows `python -m timeit -s "import numpy as np; a = np.arange(1000, 1128)"
    # "a.item(a.argmax())"` 0.68 us, "a.max()" 2.0 us; 2026-12-06, 2 shared Xeon cores,
    # load ~10
    longest = lead_c.item(lead_c.argmax()) if lead else 0
    seq_rows, width = buffers.host_seq_rows(), buffers.max_blocks_per_seq
    if 1 not in tail_q:  # (the common step: every other a chunk, the lists as they are)
        offsets = [row * width for row in seq_rows[lead:n].tolist()]
        return _StepShape(num_tokens, lead, None, longest, tail_q, tail_c, offsets, None)
    chunks = [j for j, q_len in enumerate(tail_q) if q_len > 1]  # among the others
    num_decodes = n - len(chunks)
    longest = max(longest, max(tail_c[j] for j in range(num_tail) if tail_q[j] == 1))  # (the other decodes')
    offsets = [int(seq_rows[lead + j]) * width for j in chunks]
    chunk_q, chunk_c = [tail_q[j] for j in chunks], [tail_c[j] for j in chunks]
    if not chunks or chunks[0] == num_decodes - lead:  # the decodes first: slices, no index
        return _StepShape(num_tokens, num_decodes, None, longest, chunk_q, chunk_c, offsets, None)
    decode_seqs = np.array([*range(lead), *(lead + j for j in range(num_tail) if tail_q[j] == 1)], dtype=np.int64)
    firsts = list(accumulate(tail_q, initial=lead))  # each other's first row of the step's tokens
    return _StepShape(
        num_tokens, num_decodes, decode_seqs, longest, chunk_q, chunk_c, offsets, [firsts[j] for j in chunks]
    )


_ONES: dict[int, bytes] = {}  # k -> the bytes of k int64 ones (`_few_shape`'s leading rows)


def _int32(values: Sequence[int], device: torch.device) -> torch.Tensor:
    """values as an int32 tensor on `device`, through numpy (torch.tensor of a list of Python
    ints is ~4x slower: 32k block ids, a batch of 128 x 4k tokens, 6.3 ms against 1.4 ms)."""
    host = torch.from_numpy(np.fromiter(values, dtype=np.int32, count=len(values)))
    return host if device.type == "cpu" else host.to(device)


def _rows_contiguous(t: torch.Tensor) -> torch.Tensor:
    """t [N, heads, D] with head_dim contiguous (the kernels' one requirement; rows may be strided)."""
    return t if t.stride(-1) == 1 else t.contiguous()
