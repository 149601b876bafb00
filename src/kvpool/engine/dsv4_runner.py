"""Runs a V4-architecture model on the dual pool: cache manager (ids) + pools (tensors).

`DSV4PagedRunner` is the glue the tests, `kvpool verify dsv4`, the benchmark and the engine
use: admit a request (restoring its state after a prefix hit), run a batch of chunks of
any sizes (prefill, chunked prefill, decode), append sampled tokens, release.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from kvpool.attention.dsv4_paged import ChunkPlan
from kvpool.cache.dsv4 import DSV4Admission, DSV4CacheManager, DSV4Reservation, RestoreMethod
from kvpool.engine.engine import Engine
from kvpool.engine.runner import Admitted, ScheduledChunk
from kvpool.models.tiny_dsv4 import TinyDSV4
from kvpool.storage.dsv4 import DSV4Pools


@dataclass(frozen=True)
class StepResult:
    """Logits of every token a request computed in the step: [num_tokens, vocab] fp32."""

    request_id: str
    start: int
    logits: Tensor


class DSV4PagedRunner:
    def __init__(
        self,
        model: TinyDSV4,
        num_classical_blocks: int,
        num_state_blocks: int,
        *,
        restore: RestoreMethod = "recompute",
        num_checkpoints: int = 0,
        enable_prefix_caching: bool = True,
        replay_chunk: int = 256,
    ) -> None:
        self.model = model
        self.spec = model.spec
        self.pools = DSV4Pools(model.spec, num_classical_blocks, num_state_blocks, num_checkpoints, dtype=model.dtype)
        descriptor = f"{model.spec.name}|seed={model.seed}|span={model.spec.span}|fp32".encode()
        self.cache = DSV4CacheManager(
            model.spec,
            num_classical_blocks,
            num_state_blocks,
            descriptor_key=descriptor,
            enable_prefix_caching=enable_prefix_caching,
            restore=restore,
            num_checkpoints=num_checkpoints,
        )
        self.replay_chunk = replay_chunk
        self.num_replayed_tokens = 0  # tokens recomputed by prefix-hit restores (for reports)

    # ----- requests -------------------------------------------------------------------

    def add_request(self, request_id: str, token_ids: Sequence[int], *, tenant_salt: str = "") -> DSV4Admission | None:
        """Admit and restore the state of any prefix hit; None when no state block is free."""
        adm = self.cache.admit(request_id, token_ids, tenant_salt=tenant_salt)
        if adm is None:
            return None
        self.pools.reset_state(adm.state_slot)
        if adm.restore == "checkpoint":
            assert adm.checkpoint_slot is not None
            self.pools.copy_state(adm.checkpoint_slot, adm.state_slot)
        elif adm.restore == "recompute":
            self._replay(adm, list(token_ids))
        return adm

    def _replay(self, adm: DSV4Admission, token_ids: list[int]) -> None:
        """Recompute tokens [replay_start, P) on top of the hit's cached entries (§6)."""
        table = adm.block_ids
        pos = adm.replay_start
        while pos < adm.num_cached_tokens:
            n = min(self.replay_chunk, adm.num_cached_tokens - pos)
            plan = ChunkPlan(pos, n, adm.state_slot, table, (), replay=True, valid_from=adm.replay_start)
            self.model.forward_paged(token_ids[pos : pos + n], [plan], self.pools)
            pos += n
        self.num_replayed_tokens += adm.num_cached_tokens - adm.replay_start

    def append_tokens(self, request_id: str, token_ids: Sequence[int]) -> None:
        self.cache.append_token_ids(request_id, token_ids)

    def release(self, request_id: str) -> bool:
        return self.cache.release(request_id)

    def num_computed_tokens(self, request_id: str) -> int:
        return self.cache.num_computed_tokens(request_id)

    # ----- steps ----------------------------------------------------------------------

    def step(self, work: Sequence[tuple[str, int]]) -> list[StepResult] | None:
        """Compute `num_tokens` more tokens for each (request_id, num_tokens); the tokens must
        already be in the request (prompt or appended). None when the classical pool cannot
        hold the step (nothing changes)."""
        reservations: list[DSV4Reservation] = []
        for request_id, num_tokens in work:
            res = self.cache.reserve(request_id, num_tokens)
            if res is None:
                for done in reservations:
                    self.cache.unreserve(done.request_id)
                return None
            reservations.append(res)
        logits = self.run_reservations(reservations)
        for res in reservations:
            self.cache.commit(res.request_id)
        return [StepResult(r.request_id, r.start, lg) for r, lg in zip(reservations, logits, strict=True)]

    def run_reservations(self, reservations: list[DSV4Reservation]) -> list[Tensor]:
        """Forward passes for the reservations. A chunk is cut at its checkpoint positions
        (the state must be snapshot exactly there); any cut gives the same state."""
        span = self.spec.span
        cursor = {r.request_id: r.start for r in reservations}
        pieces: dict[str, list[Tensor]] = {r.request_id: [] for r in reservations}
        while True:
            plans, ids, owners = [], [], []
            for r in reservations:
                pos, end = cursor[r.request_id], r.start + r.num_tokens
                if pos >= end:
                    continue
                stop = min([end] + [p for p, _ in r.checkpoints if p > pos])
                token_ids = self.cache.token_ids(r.request_id)
                plans.append(
                    ChunkPlan(
                        pos,
                        stop - pos,
                        r.state_slot,
                        r.block_ids[: pos // span],
                        r.block_ids[pos // span : stop // span],
                    )
                )
                ids.extend(token_ids[pos:stop])
                owners.append(r)
            if not plans:
                break
            out = self.model.forward_paged(ids, plans, self.pools)
            offset = 0
            for r, plan in zip(owners, plans, strict=True):
                pieces[r.request_id].append(out[offset : offset + plan.num_tokens])
                offset += plan.num_tokens
                stop = plan.start + plan.num_tokens
                cursor[r.request_id] = stop
                for position, slot in r.checkpoints:
                    if position == stop:
                        self.pools.copy_state(r.state_slot, slot)
        return [torch.cat(pieces[r.request_id]) for r in reservations]

    def check_integrity(self) -> None:
        self.cache.check_integrity()


class DSV4EngineRunner:
    """The engine's ModelRunner protocol (kvpool.engine.runner) for a V4-architecture model on
    the dual pool, so the same scheduler runs it: admit (with prefix hit + state restore),
    reserve, execute, commit, fork, release. Chunks are duck-typed ScheduledChunk objects
    `fork` returns False when no state block is
    free (a V4 child needs its own): the engine then queues the child, which is admitted
    later through the prefix cache like a preempted sequence."""

    def __init__(
        self,
        model: TinyDSV4,
        num_classical_blocks: int = 64,
        num_state_blocks: int = 16,
        *,
        restore: RestoreMethod = "recompute",
        num_checkpoints: int = 0,
        enable_prefix_caching: bool = True,
    ) -> None:
        self.runner = DSV4PagedRunner(
            model,
            num_classical_blocks,
            num_state_blocks,
            restore=restore,
            num_checkpoints=num_checkpoints,
            enable_prefix_caching=enable_prefix_caching,
        )
        self.cache = self.runner.cache
        span = model.spec.span
        self.vocab_size = model.vocab_size
        # The unfinished span lives in the state block, so one sequence holds up to
        # num_classical_blocks full spans plus span - 1 tokens.
        self.capacity_tokens = num_classical_blocks * span + span - 1
        self.max_model_len = min(model.spec.max_position_embeddings, self.capacity_tokens)

    def admit(self, seq_id: str, token_ids: Sequence[int], max_new_tokens: int) -> Admitted | None:
        if max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens must be positive, got {max_new_tokens}")
        adm = self.runner.add_request(seq_id, token_ids)
        if adm is None:
            return None
        n = min(max_new_tokens, len(token_ids) - adm.num_cached_tokens)
        if self.cache.reserve(seq_id, n) is None:
            self.cache.release(seq_id)  # all or nothing
            return None
        return Admitted(adm.num_cached_tokens, n)

    def reserve(self, seq_id: str, num_new_tokens: int) -> bool:
        return self.cache.reserve(seq_id, num_new_tokens) is not None

    def append_tokens(self, seq_id: str, token_ids: Sequence[int]) -> None:
        self.cache.append_token_ids(seq_id, token_ids)

    def execute(self, chunks: Sequence[ScheduledChunk]) -> Tensor:
        """Logits [num chunks with needs_logits, vocab] fp32, in chunk order."""
        reservations = []
        for c in chunks:
            res = self.cache.pending_reservation(c.seq_id)
            assert res is not None, f"sequence {c.seq_id!r} has no reservation"
            assert res.start == c.start and res.num_tokens == len(c.token_ids), "chunk != reservation"
            reservations.append(res)
        logits = self.runner.run_reservations(reservations)
        rows = [lg[-1] for c, lg in zip(chunks, logits, strict=True) if c.needs_logits]
        if not rows:
            return torch.zeros(0, self.vocab_size)
        return torch.stack(rows)

    def commit(self, seq_id: str, num_tokens: int) -> None:
        res = self.cache.pending_reservation(seq_id)
        if res is None or res.num_tokens != num_tokens:
            raise ValueError(f"commit of {num_tokens} tokens for {seq_id!r} does not match its reservation")
        self.cache.commit(seq_id)

    def fork(self, parent_id: str, child_id: str) -> bool:
        slot = self.cache.fork(parent_id, child_id)
        if slot is None:
            return False
        self.runner.pools.copy_state(self.cache.state_slot(parent_id), slot)
        return True

    def release(self, seq_id: str, reason: str) -> None:
        if reason not in ("finish", "cancel", "preempt"):
            raise ValueError(f"unknown release reason {reason!r}")
        self.cache.release(seq_id)

    def num_computed_tokens(self, seq_id: str) -> int:
        return self.cache.num_computed_tokens(seq_id)

    def check_integrity(self) -> None:
        self.cache.check_integrity()

    def cache_stats(self) -> dict[str, float]:
        pools, cache = self.runner.pools, self.cache
        return {
            "kv_capacity_tokens": self.capacity_tokens,
            "classical_blocks": cache.pool.num_blocks,
            "classical_blocks_used": cache.pool.num_blocks - cache.num_free_blocks,
            "classical_block_span": self.runner.spec.span,
            "classical_block_bytes": pools.classical_block_bytes(),
            "state_blocks": cache.num_state_blocks,
            "state_blocks_used": cache.num_state_blocks - cache.num_free_state_blocks,
            "state_block_bytes": pools.state_block_bytes(),
            "replayed_tokens": self.runner.num_replayed_tokens,
        }


def build_tiny_dsv4_engine(
    *,
    seed: int = 0,
    num_classical_blocks: int = 64,
    num_state_blocks: int = 16,
    max_num_batched_tokens: int = 512,
    max_num_seqs: int = 16,
    restore: RestoreMethod = "recompute",
    enable_prefix_caching: bool = True,
    record_logits: bool = False,
) -> Engine:
    """An Engine running the tiny V4 model (token ids in, token ids out; no tokenizer, no EOS)."""
    runner = DSV4EngineRunner(
        TinyDSV4(seed=seed),
        num_classical_blocks,
        max(num_state_blocks, max_num_seqs),
        restore=restore,
        num_checkpoints=8 if restore == "checkpoint" else 0,
        enable_prefix_caching=enable_prefix_caching,
    )
    return Engine(
        runner, max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs, record_logits=record_logits
    )
