"""The torch tensors behind the V4 Classical and State pools (ids live in cache/dual_pool.py).

Classical pool, per compressed layer (SWA-only layers have none), indexed by the block id
the core BlockPool hands out:
  main [num_blocks, span // ratio, head_dim]          complete CSA / HCA entries
  idx  [num_blocks, span // 4, index_head_dim]         CSA indexer keys (CSA layers only)
A block is written once, whole, when its span completes; afterwards it is read-only.

State pool, per layer, indexed by a state slot. Slots [0, num_state_blocks) are request
state blocks; slots [num_state_blocks, num_state_blocks + num_checkpoints) hold state
checkpoints taken at classical block boundaries (a checkpoint is a slot-to-slot copy).
Pooled checkpoints (cache/dual_pool.py `checkpoint_blocks`: a snapshot is a few classical
blocks, named by its first) take slots [num_state_blocks, + num_classical_blocks) instead:
the snapshot whose first block is b is slot `checkpoint_base + b`. The cache counts the
snapshot's blocks against the classical pool; its state is kept here, in a row of its own
(so these rows are extra memory, not the classical blocks' bytes reused). A findable
snapshot holds its first block, so no two live snapshots share a row.
  ring       [slots, n_win, head_dim]      SWA window; token p in row p % n_win
  comp_kv    [slots, coff*ratio, coff*d]   compressor tail, fp32 (DEEPSEEK_V4.md §3; fp64 pools: fp64)
  comp_score [slots, coff*ratio, coff*d]
  idx_kv / idx_score [slots, 2*4, 2*index_head_dim]   indexer compressor tail (CSA)
  tail_main  [slots, span // ratio, d]     complete entries of the unfinished span
  tail_idx   [slots, span // 4, index_head_dim]
The tail entries are the request's own: an entry of an unfinished classical block never
enters the Classical pool (the block would not be immutable yet).

dtype: the storage dtype of the ring, the entries and the tail entries. The compressor
tails are fp32 for fp32 / bf16 / fp16 storage (as the real model keeps them), and fp64 for
fp64 storage: an fp64 verification run must not round its pending rows to fp32.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch
from torch import Tensor

from kvpool.spec.dsv4 import CSA_RATIO, DSV4Spec
from kvpool.storage.quant import (
    dequantize_fp8_ue8m0,
    dequantize_mxfp4,
    quantize_fp8_ue8m0,
    quantize_mxfp4,
    symmetric_scale,
)


@dataclass
class LayerState:
    ring: Tensor
    comp_kv: Tensor | None = None
    comp_score: Tensor | None = None
    idx_kv: Tensor | None = None
    idx_score: Tensor | None = None
    tail_main: Tensor | None = None
    tail_idx: Tensor | None = None

    def tensors(self) -> list[Tensor]:
        return [
            t
            for t in (
                self.ring,
                self.comp_kv,
                self.comp_score,
                self.idx_kv,
                self.idx_score,
                self.tail_main,
                self.tail_idx,
            )
            if t is not None
        ]


class HotSet:
    """HiSparse: the device-resident CSA main entries of one layer, the rest in host memory.

    The layer's classical `main` pool is the host copy of every entry; the hot set holds
    `capacity` of them on the device, by global entry id (block id x entries per block +
    offset), least recently selected first out. `gather` returns the rows the indexer
    selected: resident ones from the hot set, the others fetched from the host copy (and
    then kept, pushing out the least recently selected). A step that selects more entries
    than the hot set holds still gets every one of them (they are fetched; the last
    `capacity` stay). Rows are copies of the same values, so attention is exact either way.
    A classical block written again (reused for another prefix) drops its stale entries.
    """

    def __init__(self, capacity: int, width: int, per_block: int, dtype: torch.dtype, device) -> None:
        if capacity <= 0:
            raise ValueError(f"the HiSparse hot set needs at least one entry, got {capacity}")
        self.capacity = capacity
        self.per_block = per_block
        self.rows = torch.zeros(capacity, width, dtype=dtype, device=device)  # on the device
        self._slot_of: OrderedDict[int, int] = OrderedDict()  # entry id -> row, least recently selected first
        self._free = list(range(capacity - 1, -1, -1))
        self.num_selected = 0  # selected entries served, resident or fetched
        self.num_fetched = 0  # of those, fetched from the host copy
        self.num_fetched_bytes = 0
        self.num_gathers = 0

    @property
    def num_bytes(self) -> int:
        return self.rows.numel() * self.rows.element_size()

    def invalidate_block(self, block_id: int) -> None:
        """The block's entries are about to be rewritten: forget any resident copy."""
        for entry in range(block_id * self.per_block, (block_id + 1) * self.per_block):
            slot = self._slot_of.pop(entry, None)
            if slot is not None:
                self._free.append(slot)

    def gather(self, host: Tensor, ids: Tensor) -> Tensor:
        """Rows of entries `ids` ([m] int64 global ids) of `host` ([num_blocks, per_block, width],
        the host copy): [m, width] on the hot set's device."""
        self.num_gathers += 1
        if ids.numel() == 0:
            return self.rows[:0]
        unique, inverse = torch.unique(ids, return_inverse=True)
        wanted = unique.tolist()
        slot_of = self._slot_of
        missing = [i for i in wanted if i not in slot_of]
        out = torch.empty(len(wanted), self.rows.shape[1], dtype=self.rows.dtype, device=self.rows.device)
        resident_pos = [k for k, i in enumerate(wanted) if i in slot_of]
        if resident_pos:
            slots = torch.tensor([slot_of[wanted[k]] for k in resident_pos], dtype=torch.long, device=self.rows.device)
            out[torch.tensor(resident_pos, dtype=torch.long, device=self.rows.device)] = self.rows[slots]
            for k in resident_pos:
                slot_of.move_to_end(wanted[k])
        if missing:
            flat = host.reshape(-1, host.shape[-1])
            fetched = flat[torch.tensor(missing, dtype=torch.long, device=flat.device)].to(self.rows.device)
            missing_pos = [k for k, i in enumerate(wanted) if i not in slot_of]
            out[torch.tensor(missing_pos, dtype=torch.long, device=self.rows.device)] = fetched
            self.num_fetched += len(missing)
            self.num_fetched_bytes += fetched.numel() * fetched.element_size()
            # keep the fetched entries (the last `capacity` if a step needs more than fit)
            keep = list(range(len(missing)))[-self.capacity :]
            step_ids = set(wanted)
            for j in keep:
                if not self._free:
                    victim = next((e for e in slot_of if e not in step_ids), None)
                    if victim is None:  # every resident entry is selected in this step
                        victim = next(iter(slot_of))
                    self._free.append(slot_of.pop(victim))
                slot = self._free.pop()
                self.rows[slot] = fetched[j]
                slot_of[missing[j]] = slot
        self.num_selected += len(wanted)
        return out[inverse]

    def check_integrity(self) -> None:
        slots = list(self._slot_of.values())
        if (
            len(set(slots)) != len(slots)
            or set(slots) & set(self._free)
            or len(slots) + len(self._free) != self.capacity
        ):
            raise AssertionError("HiSparse hot set: a row is free and resident, or lost")


ENTRY_FORMATS = ("exact", "fp8")  # the classical pool: the storage dtype, or V4's serving layout
INDEXER_KEY_FORMATS = ("fp8", "mxfp4")


class V4EntryPool:
    """A classical pool's entries in DeepSeek-V4's serving layout (storage/quant.py), for a
    pool [num_blocks, per_block, width] that reads and writes like the tensor it replaces:
    indexing returns entries dequantized in the compute dtype, assigning quantizes them.

      "main":        codes [.., width - rope] E4M3 bytes, exps [.., 8-aligned ceil(nope / 64)]
                     UE8M0, rope [.., rope] BF16: 584 B for V4's 512-dim entries
      "index-fp8":   codes [.., width] E4M3 bytes, scales [.., ceil(width / 128)] fp32
      "index-mxfp4": codes [.., width / 2] packed E2M1, exps [.., ceil(width / 32)] UE8M0
    The classical pool is written once per block, whole, so every entry is quantized once,
    from the compute-dtype entry the compressor produced."""

    def __init__(
        self,
        kind: str,
        num_blocks: int,
        per_block: int,
        width: int,
        rope_dim: int,
        dtype: torch.dtype,
        device: str | torch.device = "cpu",
    ) -> None:
        if kind not in ("main", "index-fp8", "index-mxfp4"):
            raise ValueError(f"unknown V4 entry kind {kind!r}")
        self.kind, self.width, self.rope_dim, self.dtype = kind, width, rope_dim, dtype
        self.shape = torch.Size((num_blocks, per_block, width))
        lead = (num_blocks, per_block)
        u8 = {"dtype": torch.uint8, "device": device}
        self.rope: Tensor | None = None
        self.scales: Tensor | None = None
        self.exps: Tensor | None = None
        if kind == "main":
            nope = width - rope_dim
            self.codes = torch.zeros(*lead, nope, **u8)
            num_scales = -(-nope // 64)
            self.exps = torch.zeros(*lead, -(-num_scales // 8) * 8, **u8)  # 8-aligned
            self.rope = torch.zeros(*lead, rope_dim, dtype=torch.bfloat16, device=device)
        elif kind == "index-fp8":
            self.codes = torch.zeros(*lead, width, **u8)
            self.scales = torch.zeros(*lead, -(-width // 128), dtype=torch.float32, device=device)
        else:
            if width % 2:
                raise ValueError(f"MXFP4 keys pack two values a byte: an even width, got {width}")
            self.codes = torch.zeros(*lead, width // 2, **u8)
            self.exps = torch.zeros(*lead, -(-width // 32), **u8)

    @property
    def device(self) -> torch.device:
        return self.codes.device

    def tensors(self) -> list[Tensor]:
        return [t for t in (self.codes, self.exps, self.scales, self.rope) if t is not None]

    @property
    def bytes_per_block(self) -> int:
        return sum(t[0].numel() * t.element_size() for t in self.tensors())

    @property
    def bytes_per_entry(self) -> int:
        return self.bytes_per_block // self.shape[1]

    def __getitem__(self, index) -> Tensor:
        codes = self.codes[index]
        if self.kind == "main":
            assert self.exps is not None and self.rope is not None
            nope = dequantize_fp8_ue8m0(codes, self.exps[index], self.dtype)
            return torch.cat((nope, self.rope[index].to(self.dtype)), dim=-1)
        if self.kind == "index-fp8":
            assert self.scales is not None
            padded = torch.nn.functional.pad(codes, (0, -self.width % 128))
            groups = padded.view(*codes.shape[:-1], padded.shape[-1] // 128, 128)
            x = groups.view(torch.float8_e4m3fn).to(self.dtype) * self.scales[index].to(self.dtype).unsqueeze(-1)
            return x.reshape(padded.shape)[..., : self.width]
        assert self.exps is not None
        return dequantize_mxfp4(codes, self.exps[index], self.dtype)

    def __setitem__(self, index, value: Tensor) -> None:
        value = value.to(self.codes.device)
        if self.kind == "main":
            assert self.exps is not None and self.rope is not None
            codes, exps = quantize_fp8_ue8m0(value[..., : self.width - self.rope_dim])
            self.codes[index] = codes
            self.exps[index] = torch.nn.functional.pad(exps, (0, self.exps.shape[-1] - exps.shape[-1]))
            self.rope[index] = value[..., self.width - self.rope_dim :].to(torch.bfloat16)
        elif self.kind == "index-fp8":
            assert self.scales is not None
            padded = torch.nn.functional.pad(value.to(torch.float32), (0, -self.width % 128))
            groups = padded.view(*value.shape[:-1], padded.shape[-1] // 128, 128)
            scale = symmetric_scale(groups.abs().amax(dim=-1), 448.0)  # NaN under a NaN or an inf
            q = (groups / scale.unsqueeze(-1)).clamp_(-448.0, 448.0).to(torch.float8_e4m3fn).view(torch.uint8)
            self.codes[index] = q.reshape(padded.shape)[..., : self.width]
            self.scales[index] = scale
        else:
            assert self.exps is not None
            codes, exps = quantize_mxfp4(value)
            self.codes[index] = codes
            self.exps[index] = exps


@dataclass
class LayerClassical:
    main: Tensor | V4EntryPool | None = None
    idx: Tensor | V4EntryPool | None = None
    hot: HotSet | None = None  # HiSparse: main lives on the host, this many entries on the device


class DSV4Pools:
    """Classical and State tensors for every layer of one model, fp32 by default (a model's
    pools take its dtype: `DSV4Pools(model.spec, ..., dtype=model.dtype)`)."""

    def __init__(
        self,
        spec: DSV4Spec,
        num_classical_blocks: int,
        num_state_blocks: int,
        num_checkpoints: int = 0,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        hot_set_entries: int | None = None,
        entry_format: str = "exact",
        indexer_format: str = "fp8",
        pooled_checkpoints: bool = False,
    ) -> None:
        """hot_set_entries: HiSparse, the CSA main entries each CSA layer keeps on the
        device (HotSet); the layer's main pool moves to host memory (pinned, on CUDA).
        entry_format: the classical pool's entries in `dtype` ("exact") or in V4's serving
        layout ("fp8": V4EntryPool, indexer keys in `indexer_format`, "fp8" or "mxfp4");
        the state pool (window, compressor tails, unfinished span) stays in `dtype`.
        pooled_checkpoints: a state row per classical block for the pooled snapshots (the
        module docstring), in place of `num_checkpoints` slots."""
        if pooled_checkpoints and num_checkpoints:
            raise ValueError(
                f"checkpoints in slots (num_checkpoints={num_checkpoints}) or pooled (pooled_checkpoints), not both"
            )
        if entry_format not in ENTRY_FORMATS:
            raise ValueError(f"unknown V4 entry format {entry_format!r}; one of {', '.join(ENTRY_FORMATS)}")
        if indexer_format not in INDEXER_KEY_FORMATS:
            raise ValueError(f"unknown indexer key format {indexer_format!r}; one of {', '.join(INDEXER_KEY_FORMATS)}")
        if entry_format == "fp8" and hot_set_entries is not None:
            raise ValueError("HiSparse keeps exact entries: the fp8 classical layout is not built for it")
        if num_classical_blocks <= 0 or num_state_blocks <= 0 or num_checkpoints < 0:
            raise ValueError(
                f"need positive block counts, got classical={num_classical_blocks}, "
                f"state={num_state_blocks}, checkpoints={num_checkpoints}"
            )
        self.spec = spec
        self.num_classical_blocks = num_classical_blocks
        self.num_state_blocks = num_state_blocks
        self.num_checkpoints = num_checkpoints
        # the state slot of the cache's checkpoint slot s: checkpoint_base + s (slots: the
        # cache numbers them after the state blocks already; pooled: s is a classical block)
        self.checkpoint_base = num_state_blocks if pooled_checkpoints else 0
        self.num_slots = num_state_blocks + (num_classical_blocks if pooled_checkpoints else num_checkpoints)
        self.dtype = dtype
        self.entry_format = entry_format
        self.indexer_format = indexer_format
        d, di, span, slots = spec.head_dim, spec.index_head_dim, spec.span, self.num_slots
        kw = {"dtype": dtype, "device": device}
        # compressor state: fp32, except in fp64 pools (never below the storage precision)
        comp_dtype = torch.float64 if dtype == torch.float64 else torch.float32
        self.compressor_dtype = comp_dtype
        comp = {"dtype": comp_dtype, "device": device}
        self.state: list[LayerState] = []
        self.classical: list[LayerClassical] = []
        for ratio in spec.layer_ratios:
            st = LayerState(ring=torch.zeros(slots, spec.window, d, **kw))
            cl = LayerClassical()
            if ratio:
                coff = spec.coff(ratio)
                st.comp_kv = torch.zeros(slots, coff * ratio, coff * d, **comp)
                st.comp_score = torch.zeros(slots, coff * ratio, coff * d, **comp)
                st.tail_main = torch.zeros(slots, span // ratio, d, **kw)
                cl.main = torch.zeros(num_classical_blocks, span // ratio, d, **kw)
                if entry_format == "fp8":
                    cl.main = V4EntryPool(
                        "main", num_classical_blocks, span // ratio, d, spec.rope_head_dim, dtype, device
                    )
            if ratio == CSA_RATIO and hot_set_entries is not None:
                num_entries = num_classical_blocks * (span // ratio)
                if not 0 < hot_set_entries <= num_entries:
                    raise ValueError(
                        f"the HiSparse hot set must hold 1 to {num_entries} CSA entries (the classical pool's), "
                        f"got {hot_set_entries}"
                    )
                on_gpu = torch.device(device).type == "cuda"
                host = {"dtype": dtype, "device": "cpu", "pin_memory": on_gpu}
                cl.main = torch.zeros(num_classical_blocks, span // ratio, d, **host)
                cl.hot = HotSet(hot_set_entries, d, span // ratio, dtype, device)
            if ratio == CSA_RATIO:
                st.idx_kv = torch.zeros(slots, 2 * CSA_RATIO, 2 * di, **comp)
                st.idx_score = torch.zeros(slots, 2 * CSA_RATIO, 2 * di, **comp)
                st.tail_idx = torch.zeros(slots, span // CSA_RATIO, di, **kw)
                cl.idx = torch.zeros(num_classical_blocks, span // CSA_RATIO, di, **kw)
                if entry_format == "fp8":
                    kind = f"index-{indexer_format}"
                    cl.idx = V4EntryPool(kind, num_classical_blocks, span // CSA_RATIO, di, 0, dtype, device)
            self.state.append(st)
            self.classical.append(cl)

    def reset_state(self, slot: int) -> None:
        """A fresh state block: empty ring, and compressor rows at score -inf / value 0, which
        is exactly block 0's missing "previous block" in the overlapping compressor."""
        for st in self.state:
            st.ring[slot].zero_()
            for kv, score in ((st.comp_kv, st.comp_score), (st.idx_kv, st.idx_score)):
                if kv is not None and score is not None:
                    kv[slot].zero_()
                    score[slot].fill_(float("-inf"))
            for t in (st.tail_main, st.tail_idx):
                if t is not None:
                    t[slot].zero_()

    def copy_state(self, src_slot: int, dst_slot: int) -> None:
        """Checkpoint (request slot -> checkpoint slot) or restore (the other way)."""
        for st in self.state:
            for t in st.tensors():
                t[dst_slot].copy_(t[src_slot])

    def live_state(self, slot: int, num_tokens: int) -> list[dict[str, Tensor]]:
        """Per layer, the parts of a state block that a history of `num_tokens` tokens defines
        (other rows are stale and never read): the ring rows of the last min(L, n_win) tokens
        in position order, the compressor rows still pending, the unfinished span's entries."""
        spec, n_win, span = self.spec, self.spec.window, self.spec.span
        out: list[dict[str, Tensor]] = []
        ring_rows = torch.arange(max(0, num_tokens - n_win), num_tokens) % n_win
        for ratio, st in zip(spec.layer_ratios, self.state, strict=True):
            live: dict[str, Tensor] = {"ring": st.ring[slot, ring_rows]}
            if ratio:
                # overlap: [0, ratio) previous block (placeholder before block 0) + partial rows
                num_rows = (ratio if ratio == CSA_RATIO else 0) + num_tokens % ratio
                num_tail = num_tokens // ratio - (num_tokens // span) * (span // ratio)
                assert st.comp_kv is not None and st.comp_score is not None and st.tail_main is not None
                live.update(
                    comp_kv=st.comp_kv[slot, :num_rows],
                    comp_score=st.comp_score[slot, :num_rows],
                    tail_main=st.tail_main[slot, :num_tail],
                )
                if ratio == CSA_RATIO:
                    assert st.idx_kv is not None and st.idx_score is not None and st.tail_idx is not None
                    live.update(
                        idx_kv=st.idx_kv[slot, :num_rows],
                        idx_score=st.idx_score[slot, :num_rows],
                        tail_idx=st.tail_idx[slot, :num_tail],
                    )
            out.append(live)
        return out

    def window_snapshot(
        self, slot: int, boundary: int, num_rows: int, *, unfinished_span: bool = False
    ) -> dict[str, Tensor]:
        """The state of `slot` at a classical block boundary as a tier entry's tensors (views;
        the tier copies them): per layer l, `ring{l}` the SWA KV of tokens
        [boundary - num_rows, boundary) in position order (fewer at the start), and the
        compressor rows pending there (`comp_kv{l}`, `comp_score{l}`, `idx_kv{l}`,
        `idx_score{l}`: the overlapping compressors' previous block). A boundary has no
        unfinished span, so no tail entries. unfinished_span: `boundary` may be any position
        after the first token (a swapped-out request's state, engine/tier_bridge.py): inside a
        span the entry also holds the compressor rows pending there and the unfinished span's
        complete entries (`tail_main{l}`, `tail_idx{l}`), all a resume needs."""
        if boundary <= 0 or (boundary % self.spec.span and not unfinished_span):
            raise ValueError(f"a window snapshot is taken at a block boundary, got position {boundary}")
        out: dict[str, Tensor] = {}
        for layer, live in enumerate(self.live_state(slot, boundary)):
            for name, t in live.items():
                if name == "ring":
                    t = t[max(0, t.shape[0] - num_rows) :]
                elif name.startswith("tail") and not boundary % self.spec.span:
                    assert t.shape[0] == 0, "an unfinished span at a block boundary"
                if t.shape[0]:
                    out[f"{name}{layer}"] = t
        return out

    def restore_window(self, slot: int, boundary: int, snapshots: list[tuple[int, dict[str, Tensor]]]) -> None:
        """Set `slot` to the state at `boundary` from window snapshots: (their boundary, their
        tensors), the one at `boundary` first (its compressor rows are the state's), then
        earlier ones for older window rows when one snapshot holds less than the window.
        `boundary` inside a span: the one snapshot taken there with `unfinished_span` (its
        tail entries are the state's too). What the state needs and the snapshots lack is an
        AssertionError (their layout passed the descriptor check)."""
        n_win = self.spec.window
        if not snapshots or snapshots[0][0] != boundary:
            raise ValueError(f"the snapshots must start with the one at {boundary}")
        self.reset_state(slot)
        needed = torch.arange(max(0, boundary - n_win), boundary)
        for layer, st in enumerate(self.state):
            covered = torch.zeros(boundary, dtype=torch.bool)
            for end, tensors in snapshots:
                ring = tensors[f"ring{layer}"]
                positions = torch.arange(end - ring.shape[0], end)
                keep = positions >= boundary - n_win
                st.ring[slot, positions[keep] % n_win] = ring[keep].to(st.ring.device, st.ring.dtype)
                covered[positions[keep]] = True
            if not bool(covered[needed].all()):
                raise AssertionError(f"window snapshots at {[b for b, _ in snapshots]} miss rows of layer {layer}")
        # the compressor rows pending at the boundary and (inside a span) the unfinished
        # span's entries: live_state's views of them (the one place that says how many
        # there are), from the snapshot at the boundary
        top = snapshots[0][1]
        for layer, live in enumerate(self.live_state(slot, boundary)):
            for name in ("comp_kv", "comp_score", "idx_kv", "idx_score", "tail_main", "tail_idx"):
                dst = live.get(name)
                if dst is None or dst.shape[0] == 0:
                    continue
                src = top.get(f"{name}{layer}")
                if src is None or src.shape != dst.shape:
                    got = None if src is None else tuple(src.shape)
                    raise AssertionError(f"snapshot {name}{layer}: {got}, the state {tuple(dst.shape)}")
                dst.copy_(src)

    def classical_block_bytes(self) -> int:
        """Actual bytes of one classical block over all layers."""
        total = 0
        for cl in self.classical:
            for t in (cl.main, cl.idx):
                if isinstance(t, V4EntryPool):
                    total += t.bytes_per_block
                elif t is not None:
                    total += t[0].numel() * t.element_size()
        return total

    def state_block_bytes(self) -> int:
        """Actual bytes of one state block over all layers (tail entries included)."""
        return sum(t[0].numel() * t.element_size() for st in self.state for t in st.tensors())
