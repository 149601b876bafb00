"""Prefill / decode disaggregation over torch.distributed: a prefill worker computes a
prompt's KV and sends its blocks; a decode worker validates them, converts their layout,
installs them, and only then runs the request.

Ranks: the prefill side's TP group, then the decode side's (each a Llama engine on its own
shard: models/tensor_parallel.py). Per request, the decode leader asks for a token range
[start, end) of the prompt: the full decode blocks that neither its pool nor its landing
tier already holds (a prompt seen before transfers nothing). The prefill side computes the
prompt through its engine (its own prefix cache included) and reads the range from its
cached blocks. Every pair of a prefill and a decode rank whose KV heads overlap then
exchanges, over point-to-point sends:

  1. a TransferDescriptor: the cache descriptor's identity fields (model, weights,
     tokenizer, template, RoPE), the dtype and storage format, the tenant, the sender's
     block size, head range and layer and head counts, the token range and its ids' hash,
     the byte order, the wire layout, and the KV heads and bytes this message's K and V
     carry (the receiver sizes its buffers by them, then checks them against its own);
     as data, never a pickle (engine/wire.py: an int64 preamble with the bytes of K and V,
     then a JSON header whose field names and types the receiver checks, one line naming
     a field it refuses);
  2. K and V of the overlapping heads, token-major [layers, tokens, heads, head_dim]:
     independent of either side's block size.

The receiver checks the descriptor field by field against its own (`check_transfer`): a
difference it cannot convert (another model, weights, dtype or format, tenant, RoPE, byte
order, the wrong tokens) is a TransferError naming the fields; nothing is reinterpreted.
What it converts: the block size (the token-major wire is cut into its own blocks) and the
TP degree (each decode rank takes the heads it owns from the prefill ranks that hold
them). Once every part has arrived, the blocks go into the decode worker's landing tier (a
HostTier) under its own content keys; the request is then admitted as usual, and the
admission loads them into the pool and publishes them (the tier path: validated again,
visible only once installed). The prompt's unfinished last block is computed by the
decode worker (fewer than a block of tokens). A transfer that fails half way (a prefill
worker gone) installs nothing: the decode worker computes the prompt itself. Blocks go
into the landing tier whole, one by one, only after every part has arrived; a landing
tier too small for all of them keeps the prefix it holds for the prompt and the leading
blocks that fit beside it (valid prefix blocks); the rest is computed.
"""

from __future__ import annotations

import dataclasses
import math
import sys
import time
import typing
from dataclasses import asdict, dataclass, field

import torch
import torch.distributed as dist
import xxhash

from kvpool.engine import tier_bridge, wire
from kvpool.engine.engine import Engine
from kvpool.tiers import HostTier

WIRE_LAYOUT = "token-major [layers, tokens, kv_heads, head_dim]; K then V"


class TransferError(ValueError):
    """A transfer the receiver cannot accept (the message names the mismatched fields)."""


@dataclass(frozen=True)
class TransferDescriptor:
    model_id: str
    weights_version: str
    tokenizer_version: str
    template_version: str
    rope_id: str
    dtype: str
    kv_format: str
    tenant: str
    num_layers: int
    num_kv_heads: int  # the model's, over all ranks
    head_dim: int
    head_range: tuple[int, int]  # the sender's KV heads [first, last)
    block_size: int  # the sender's
    start: int  # the tokens [start, end) of the prompt
    end: int
    tokens_hash: str  # xxh3-64 of the prompt's ids up to `end`
    byte_order: str = sys.byteorder
    layout: str = WIRE_LAYOUT
    # what this message's K and V carry: the global KV heads [first, last) and each one's
    # bytes. The receiver sizes its buffers by them, not by its own idea of the heads: gloo
    # fills a larger buffer in part without a word, and aborts the process on a smaller one
    part_heads: tuple[int, int] = (0, 0)
    part_bytes: int = 0

    # fields two sides must share exactly; the others describe what is converted
    MUST_MATCH = (
        "model_id",
        "weights_version",
        "tokenizer_version",
        "template_version",
        "rope_id",
        "dtype",
        "kv_format",
        "tenant",
        "num_layers",
        "num_kv_heads",
        "head_dim",
        "tokens_hash",
        "byte_order",
        "layout",
    )


def tokens_hash(token_ids, end: int) -> str:
    return xxhash.xxh3_64_hexdigest(torch.tensor(list(token_ids[:end]), dtype=torch.int64).numpy().tobytes())


def heads_of(model) -> tuple[int, int]:
    """The global KV heads [first, last) this (maybe sharded) model's rank holds."""
    kvh = model.config.num_kv_heads
    rank = model.shard[0] if model.shard is not None else 0
    return rank * kvh, (rank + 1) * kvh


def describe(engine: Engine, tenant: str, token_ids, start: int, end: int) -> TransferDescriptor:
    """This side's descriptor for tokens [start, end) of `token_ids`."""
    runner = engine.runner
    model = runner.model
    d = runner.cache.descriptor
    world = model.shard[1] if model.shard is not None else 1
    return TransferDescriptor(
        model_id=d.model_id,
        weights_version=d.weights_version,
        tokenizer_version=d.tokenizer_version,
        template_version=d.template_version,
        rope_id=d.rope_id,
        dtype=str(model.dtype).removeprefix("torch."),
        kv_format=runner.kv_format,
        tenant=tenant,
        num_layers=model.config.num_layers,
        num_kv_heads=model.config.num_kv_heads * world,
        head_dim=model.config.head_dim,
        head_range=heads_of(model),
        block_size=runner.block_size,
        start=start,
        end=end,
        tokens_hash=tokens_hash(token_ids, end),
    )


def check_transfer(got: TransferDescriptor, expected: TransferDescriptor) -> None:
    """TransferError naming every field that differs and cannot be converted."""
    differ = [f for f in TransferDescriptor.MUST_MATCH if getattr(got, f) != getattr(expected, f)]
    if (got.start, got.end) != (expected.start, expected.end):
        differ.append("token range")
    if differ:
        details = ", ".join(
            f"{f}: {getattr(got, f)!r} != {getattr(expected, f)!r}" for f in differ if f != "token range"
        )
        if "token range" in differ:
            details += (
                f"{', ' if details else ''}token range: {got.start}..{got.end} != {expected.start}..{expected.end}"
            )
        raise TransferError(f"transfer rejected: {details}")


def descriptor_schema() -> wire.Schema:
    """The descriptor's header fields and their types (part_bytes travels in the preamble)."""
    hints = typing.get_type_hints(TransferDescriptor)
    return {f.name: hints[f.name] for f in dataclasses.fields(TransferDescriptor) if f.name != "part_bytes"}


def send_descriptor(desc: TransferDescriptor, dst: int) -> None:
    """`desc` to rank `dst` as the wire's preamble (its part_bytes: what K, and V, will weigh)
    and JSON header (every other field); never a pickle (engine/wire.py)."""
    fields = {name: getattr(desc, name) for name in descriptor_schema()}
    wire.send_header(fields, desc.part_bytes, dst)


def send_part(desc: TransferDescriptor, k: torch.Tensor, v: torch.Tensor, part: tuple[int, int], dst: int) -> None:
    """The prefill side: `desc` for the KV heads `part` (global [first, last)), then K and V of
    those heads (k, v: [layers, tokens, heads of part, head_dim], desc.dtype), to rank `dst`."""
    assert k.shape == v.shape and k.shape[2] == part[1] - part[0], (k.shape, v.shape, part)
    k, v = k.contiguous(), v.contiguous()
    send_descriptor(dataclasses.replace(desc, part_heads=part, part_bytes=k.nbytes), dst)
    dist.send(k, dst=dst)
    dist.send(v, dst=dst)


def recv_descriptor(src: int, max_part_bytes: int) -> TransferDescriptor:
    """The decode side: the descriptor `send_part` sent first from rank `src`. A header this
    rank cannot read (another wire version, not JSON, a field missing, unknown or of another
    type): K and V are taken off the wire all the same, then TransferError naming the field.
    RuntimeError for a preamble that is not one (nothing tells how many bytes follow), or
    one whose unreadable header declares K (and V) of more than `max_part_bytes`, the most
    this rank asked that rank for (`too_large`): not allocated, not taken off the wire."""
    pre, data = wire.recv_header(src)
    try:
        fields = wire.parse_header(pre, data, descriptor_schema())
    except wire.HeaderError as e:
        if pre.payload_bytes > max_part_bytes:
            raise too_large(src, pre.payload_bytes, max_part_bytes, f"its descriptor: {e}") from None
        recv_kv(pre.payload_bytes, src)  # the part leaves the wire whole, as an accepted one
        raise TransferError(f"transfer rejected: rank {src}'s descriptor: {e}") from None
    return TransferDescriptor(**fields, part_bytes=pre.payload_bytes)  # type: ignore[arg-type]


def too_large(src: int, part_bytes: int, max_part_bytes: int, why: str) -> RuntimeError:
    """A part of more bytes than the receiver asked for: refused before it is allocated (a
    peer may declare 2**62 bytes), so it stays on the wire, out of step. `why`: what else is
    wrong with it, when known (another model's descriptor)."""
    return RuntimeError(
        f"transfer rejected: rank {src} declared {part_bytes:,} bytes each of K and V, at most {max_part_bytes:,} "
        f"expected ({why}): the wire is out of step"
    )


def max_part_bytes(engine: Engine, start: int, end: int, heads: tuple[int, int]) -> int:
    """The bytes of K (or V) of tokens [start, end) of the KV heads `heads` in this side's
    layout and dtype: the most a sender asked for that range sends (it may send fewer tokens)."""
    model = engine.runner.model
    itemsize = model.dtype.itemsize
    return model.config.num_layers * (end - start) * (heads[1] - heads[0]) * model.config.head_dim * itemsize


def recv_kv(part_bytes: int, src: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The decode side: K and V that follow a descriptor from rank `src`, as the raw bytes it
    declared (uint8 [part_bytes] each; `unpack_part` checks and shapes them)."""
    k = torch.empty(part_bytes, dtype=torch.uint8)
    v = torch.empty_like(k)
    dist.recv(k, src=src)
    dist.recv(v, src=src)
    return k, v


def unpack_part(
    desc: TransferDescriptor, k: torch.Tensor, v: torch.Tensor, expected: TransferDescriptor, heads: tuple[int, int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of `recv_kv` ([layers, tokens, heads, head_dim] in the receiver's dtype) when
    `desc` matches `expected` (check_transfer) and carries the KV heads `heads` this receiver
    takes from its sender, in the bytes that shape needs; TransferError naming what differs."""
    check_transfer(desc, expected)
    if desc.part_heads != heads:
        raise TransferError(f"transfer rejected: KV heads sent {desc.part_heads} != {heads} expected from that rank")
    dtype = getattr(torch, expected.dtype)  # desc.dtype is the same (checked)
    shape = (desc.num_layers, desc.end - desc.start, heads[1] - heads[0], desc.head_dim)
    want = math.prod(shape) * dtype.itemsize
    if desc.part_bytes != want:
        raise TransferError(f"transfer rejected: {desc.part_bytes} bytes sent for K of shape {shape}, not {want}")
    return k.view(dtype).view(shape), v.view(dtype).view(shape)


def extract(engine: Engine, token_ids, start: int, end: int, tenant: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The prefill side: K and V of tokens [start, end) (token-major, this rank's heads)
    from the engine's cached full blocks of `token_ids`. ValueError when they are not cached."""
    runner = engine.runner
    ids, _ = tier_bridge.prefix_blocks(runner.cache, token_ids, tenant)
    bs = runner.block_size
    if len(ids) * bs < end:
        raise ValueError(f"the prefill cache holds {len(ids) * bs} tokens of the prompt, {end} were asked for")
    first, last = start // bs, -(-end // bs)
    blocks = torch.tensor(ids[first:last], dtype=torch.long)
    st = runner.executor.storage
    k = st.k[:, blocks].permute(0, 1, 4, 2, 3)  # [layers, n, bs, kvh, d]
    v = st.v[:, blocks].permute(0, 1, 3, 2, 4)  # [layers, n, bs, kvh, d]
    layers, n, _, kvh, d = k.shape
    k = k.reshape(layers, n * bs, kvh, d)[:, start - first * bs : end - first * bs]
    v = v.reshape(layers, n * bs, kvh, d)[:, start - first * bs : end - first * bs]
    return k.contiguous(), v.contiguous()


@dataclass
class TransferStats:
    num_requests: int = 0
    num_transfers: int = 0  # requests that received blocks
    num_tokens: int = 0  # tokens whose KV arrived
    num_bytes: int = 0
    transfer_s: float = 0.0  # waiting for and receiving the parts
    convert_s: float = 0.0  # cutting into blocks, head selection, installing in the landing tier
    num_failed: int = 0  # transfers that broke off (nothing installed)
    rejected: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, object]:
        out = asdict(self)
        gb_s = self.num_bytes / self.transfer_s / 1e9 if self.transfer_s else 0.0
        out.update(transfer_gb_s=round(gb_s, 3), transfer_ms=round(self.transfer_s * 1e3, 2))
        out.update(convert_ms=round(self.convert_s * 1e3, 2))
        return out


def needed_range(engine: Engine, landing: HostTier, token_ids, tenant: str) -> tuple[int, int]:
    """The decode side: the full blocks of the prompt [start, end) that neither the pool nor
    the landing tier holds (start == end: nothing to send)."""
    runner = engine.runner
    bs = runner.block_size
    end = ((len(token_ids) - 1) // bs) * bs  # an admission computes at least the last token
    have, _ = tier_bridge.prefix_blocks(runner.cache, token_ids, tenant)
    chain = tier_bridge.chain_for(runner.cache, token_ids, tenant)
    n = len(have)
    index = runner.tier_index
    while n < len(chain) and index is not None and landing.holds(*index.describe(chain[n])):
        n += 1
    return min(n * bs, end), end


def install(engine: Engine, landing: HostTier, token_ids, tenant: str, start: int, k: torch.Tensor, v: torch.Tensor):
    """The decode side: K / V of tokens [start, start + T) (token-major, this rank's heads),
    cut into this pool's blocks and put into the landing tier under its content keys."""
    runner = engine.runner
    index = runner.tier_index
    assert index is not None, "the decode engine needs its landing tier"
    bs = runner.block_size
    chain = tier_bridge.chain_for(runner.cache, token_ids, tenant)
    layers, t, kvh, d = k.shape
    first, last = start // bs, (start + t) // bs
    if last <= first:
        return
    # the prompt's blocks before `start` that the tier holds (an earlier transfer's): to the
    # LRU's end, and their room kept, so that no put evicts them (the admission would hit
    # none of them, nor the blocks after them); only the range's leading blocks that fit
    # beside them are installed
    have, _ = tier_bridge.prefix_blocks(runner.cache, token_ids, tenant)
    held = [index.describe(chain[j]) for j in range(len(have), first)]
    held_bytes = sum(landing.touch(key, descriptor) for key, descriptor in reversed(held))
    block_bytes = bs * (k.numel() * k.element_size() + v.numel() * v.element_size()) // t
    fit = (landing.capacity_bytes - held_bytes) // block_bytes
    if fit <= 0:
        beside = f" beside the {len(held)} blocks before it that it holds" if held else ""
        raise TransferError(
            f"the landing tier ({landing.capacity_bytes} B) has no room for block {first} of the prompt{beside}"
        )
    last = min(last, first + fit)
    # last block first: a landing tier too small for them all evicts its oldest entries, so
    # what it keeps is the range's first blocks, a prefix the admission can hit (in order, it
    # kept the last ones, which no admission reaches without those before them)
    for j in reversed(range(first, last)):
        kb = k[:, j * bs - start : (j + 1) * bs - start]  # [layers, bs, kvh, d]
        vb = v[:, j * bs - start : (j + 1) * bs - start]
        tensors = {"k": kb.permute(0, 2, 3, 1).contiguous(), "v": vb.permute(0, 2, 1, 3).contiguous()}
        key, descriptor = index.describe(chain[j])
        if not landing.put(key, descriptor, tensors):
            raise TransferError(f"the landing tier has no room for block {j} of the prompt")
    for key, descriptor in reversed(held):  # the prompt's entries last block first in the LRU
        landing.touch(key, descriptor)


def check_sides(prefill_ranks: list[int], decode_ranks: list[int], rank: int, world: int) -> None:
    """ValueError naming the problem unless the two sides are non-empty, distinct ranks of the
    world, apart, with `rank` on one of them: a rank on both sides, or on neither, would wait
    for messages that never come (or answer itself) until the group's timeout."""
    for name, ranks in (("prefill", prefill_ranks), ("decode", decode_ranks)):
        if not ranks:
            raise ValueError(f"P/D needs {name} ranks; got none")
        bad = [r for r in ranks if not (isinstance(r, int) and 0 <= r < world)]
        if bad or len(set(ranks)) != len(ranks):
            raise ValueError(f"{name} ranks {ranks}: each a distinct rank of the world [0, {world})")
    both = sorted(set(prefill_ranks) & set(decode_ranks))
    if both:
        raise ValueError(
            f"rank{'s' if len(both) > 1 else ''} {', '.join(map(str, both))} on both the prefill and the decode side"
        )
    if rank not in prefill_ranks and rank not in decode_ranks:
        raise ValueError(
            f"this process, rank {rank}, is on neither side (prefill {prefill_ranks}, decode {decode_ranks})"
        )


def overlap(a: tuple[int, int], b: tuple[int, int]) -> tuple[int, int] | None:
    lo, hi = max(a[0], b[0]), min(a[1], b[1])
    return (lo, hi) if lo < hi else None


class Disaggregation:
    """One process's side of P/D: `prefill_ranks` and `decode_ranks` are global ranks (each a
    TP group, in shard order); this process runs `engine` on its shard. The decode side's
    engine has `landing` as its host tier. Every send and receive waits at most the process
    group's timeout (models/tensor_parallel.py GROUP_TIMEOUT_S, set when the group is joined):
    a prefill worker that hangs makes `receive` raise RuntimeError, as one that died does."""

    def __init__(
        self,
        engine: Engine,
        prefill_ranks: list[int],
        decode_ranks: list[int],
        *,
        landing: HostTier | None = None,
        tenant: str = "",
    ) -> None:
        from kvpool.storage.kv import PagedKVStorage

        if not isinstance(engine.runner.executor.storage, PagedKVStorage):
            raise ValueError(
                f"P/D moves unquantized blocks only; this engine stores {engine.runner.kv_format} (its scales would "
                "need sending too)"
            )
        self.engine, self.prefill_ranks, self.decode_ranks = engine, prefill_ranks, decode_ranks
        self.rank = dist.get_rank()
        check_sides(prefill_ranks, decode_ranks, self.rank, dist.get_world_size())
        self.is_prefill = self.rank in prefill_ranks
        if not self.is_prefill and landing is None:
            raise ValueError("a decode worker needs its landing tier (the engine's host tier)")
        self.landing = landing
        self.tenant = tenant
        self.stats = TransferStats()
        p, q = len(prefill_ranks), len(decode_ranks)
        kvh = engine.runner.model.config.num_kv_heads * (engine.runner.model.shard or (0, 1))[1]
        self.heads = {r: (i * kvh // p, (i + 1) * kvh // p) for i, r in enumerate(prefill_ranks)}
        self.heads.update({r: (i * kvh // q, (i + 1) * kvh // q) for i, r in enumerate(decode_ranks)})

    # ---- the prefill side ----------------------------------------------------------------

    def serve(self, token_ids, *, crash_after_descriptor: bool = False) -> None:
        """Prefill `token_ids` and send the range the decode side asks for (its leader's
        message first: (start, end)). crash_after_descriptor: die after sending the
        descriptors (the tests' crashed prefill worker)."""
        from kvpool.engine.sampling import SamplingParams

        # every rank hears the range (int64 [3] on the wire: start, end, the decode block size)
        start, end, decode_bs = wire.broadcast_ints(None, 3, src=self.decode_ranks[0])
        if not 0 <= start <= end or decode_bs < 1:
            raise RuntimeError(f"the decode leader asked for tokens {start}..{end} in blocks of {decode_bs}")
        if start >= end:
            return
        params = SamplingParams(max_tokens=1, ignore_eos=True)
        rid = self.engine.add_request(list(token_ids), params, tenant=self.tenant)
        while self.engine.has_unfinished():
            self.engine.step()
        self.engine.pop_output(rid)
        # what this side's cache holds of the range, in whole decode blocks (its own partial
        # last block is not cached: the decode side computes what is not sent)
        held = len(tier_bridge.prefix_blocks(self.engine.runner.cache, token_ids, self.tenant)[0])
        end = max(start, min(end, (held * self.engine.runner.block_size // decode_bs) * decode_bs))
        k, v = extract(self.engine, token_ids, start, end, self.tenant)
        mine = self.heads[self.rank]
        desc = describe(self.engine, self.tenant, token_ids, start, end)
        for dst in self.decode_ranks:
            part = overlap(mine, self.heads[dst])
            if part is None:
                continue
            lo, hi = part[0] - mine[0], part[1] - mine[0]
            if crash_after_descriptor:
                import os

                # (the descriptor send_part would send, its bytes declared: the peer then waits on
                # them, broken off, not on 0 bytes)
                send_descriptor(dataclasses.replace(desc, part_heads=part, part_bytes=k[:, :, lo:hi].nbytes), dst)
                os._exit(17)
            send_part(desc, k[:, :, lo:hi], v[:, :, lo:hi], part, dst)

    # ---- the decode side -----------------------------------------------------------------

    def receive(self, token_ids) -> tuple[int, int]:
        """Ask for and install what the prompt needs; (tokens received, bytes received).
        TransferError (after every part was received, nothing installed) for a descriptor
        the decode side cannot accept; RuntimeError when a sender broke off."""
        assert self.landing is not None
        self.stats.num_requests += 1
        start, end = needed_range(self.engine, self.landing, token_ids, self.tenant)
        bs = self.engine.runner.block_size
        # the leader's range: every decode rank decided alike (checked per step)
        start, end, _ = wire.broadcast_ints([start, end, bs], 3, src=self.decode_ranks[0])
        if start >= end:
            return 0, 0
        mine = self.heads[self.rank]
        began = None  # the transfer's clock starts at the first descriptor (sent once the prompt is computed)
        parts: list[tuple[tuple[int, int], torch.Tensor, torch.Tensor]] = []
        problems: list[str] = []
        for src in self.prefill_ranks:
            part = overlap(self.heads[src], mine)
            if part is None:
                continue
            # every part is received whole, whatever it holds, before any is judged: the
            # senders' messages all leave their sockets, and nothing is installed half way
            most = max_part_bytes(self.engine, start, end, part)
            try:
                desc = recv_descriptor(src, most)
            except TransferError as e:  # a header it cannot read (its K and V drained)
                problems.append(str(e))
                continue
            # the sender may send less than asked (what its cache held, in whole blocks of ours)
            sent_end = desc.end if start <= desc.end <= end and desc.end % bs == 0 else end
            expected = describe(self.engine, self.tenant, token_ids, start, sent_end)
            if desc.part_bytes > most:  # (named with what else differs: another model's part, say)
                try:
                    check_transfer(desc, expected)
                    why = f"KV heads {desc.part_heads}, expected {part}"
                except TransferError as e:
                    why = str(e).removeprefix("transfer rejected: ")
                raise too_large(src, desc.part_bytes, most, why)
            # (the clock starts before K and V are received: they are what it times)
            began = began or time.perf_counter()
            k_bytes, v_bytes = recv_kv(desc.part_bytes, src)
            try:
                k, v = unpack_part(desc, k_bytes, v_bytes, expected, part)
            except TransferError as e:
                problems.append(str(e))
                continue
            parts.append((part, k, v))
        self.stats.transfer_s += time.perf_counter() - (began or time.perf_counter())
        if problems:
            self.stats.rejected.extend(problems)
            raise TransferError(problems[0])
        began = time.perf_counter()
        parts.sort(key=lambda p: p[0])
        if len({p[1].shape[1] for p in parts}) != 1:
            raise TransferError("transfer rejected: the prefill ranks sent different token ranges")
        end = start + parts[0][1].shape[1]
        if end == start:
            return 0, 0
        k = torch.cat([p[1] for p in parts], dim=2)
        v = torch.cat([p[2] for p in parts], dim=2)
        assert k.shape[2] == mine[1] - mine[0], "the prefill ranks' heads do not cover this rank's"
        install(self.engine, self.landing, token_ids, self.tenant, start, k, v)
        self.stats.convert_s += time.perf_counter() - began
        nbytes = k.nbytes + v.nbytes
        self.stats.num_transfers += 1
        self.stats.num_tokens += end - start
        self.stats.num_bytes += nbytes
        return end - start, nbytes
