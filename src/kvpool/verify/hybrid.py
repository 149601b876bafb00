"""The hybrid verification matrix: tiny hybrid models on the coordinator against a full recompute.

Two models (models/tiny_hybrid.py): "gemma" (window 32 / full layers alternating) and
"recurrent" (gated-delta-rule / full layers), on blocks of 8 tokens with a recurrent
checkpoint every 12 (not a multiple of 8: some hits fall inside a block and are copied on
write). Every case compares the logits the paged path computed, position by position,
with `TinyHybrid.reference_logits` of the same history (no cache at all). Structural facts
(hit points, preemptions, forks) are asserted inside a case; a failed assertion fails it.

Cases: prompt lengths across block, window and checkpoint boundaries (one chunk), chunked
prefill, greedy decode across boundaries, a prefix hit at every kind of point (the hit is
checked against an independent rule: the largest point that is a block end of the shared
part, in every group, and a checkpoint boundary), a hit that the attention groups could
serve further than the recurrent group (the fall-back point), preemption and fork under
the engine's scheduler.

Tolerances, as for `verify dsv4`: fp64 (the default) holds every case to 1e-12; fp32 to
max(8 x max |oracle_fp32 - oracle_fp64|, 2 fp32 ulps of the largest |logit|), the fp64
oracle running the same fp32 weights.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from kvpool.engine.build import build_engine
from kvpool.engine.engine import Engine
from kvpool.engine.hybrid_runner import hybrid_runner
from kvpool.engine.runner import ModelRunner
from kvpool.engine.sampling import SamplingParams
from kvpool.models.tiny_hybrid import TINY_GEMMA2, TINY_RECURRENT, TinyHybrid
from kvpool.verify.dsv4_tolerance import FP64_TOLERANCE, check_tolerance, derived_fp32_tolerance

BLOCK_SIZE = 8
CHECKPOINT_INTERVAL = 12
MODELS = ("gemma", "recurrent")
DEFAULT_LENGTHS: tuple[int, ...] = (1, 7, 8, 9, 12, 13, 31, 32, 33, 40, 65, 100)
CHUNK_SIZES: tuple[int, ...] = (1, 5, 8, 12, 33)
SHARED_LENGTHS: tuple[int, ...] = (8, 12, 16, 24, 33, 36, 40, 64, 85)


def _too_long(length: int) -> str:
    """A --lengths value past the verifier's pool: the caller's mistake, not a failed check."""
    return (
        f"--lengths {length}: a prompt of {length:,} tokens does not fit the verifier's KV pool; give shorter lengths"
    )


@dataclass(frozen=True)
class Segment:
    """Logits a paged run produced for positions [start, start + len(logits)) of a history."""

    model: TinyHybrid
    token_ids: tuple[int, ...]
    start: int
    logits: Tensor  # [num_positions, vocab]


@dataclass(frozen=True)
class CaseResult:
    name: str
    max_abs_diff: float
    tolerance: float
    passed: bool
    reference_error: float | None = None
    detail: str = ""


def expected_hit(shared_len: int, prompt_len: int, has_recurrent: bool) -> int:
    """The hit the coordinator must find for a prompt sharing its first `shared_len` tokens
    with a fully cached history: a point every group serves, leaving one token to compute.
    Attention: blocks wholly inside the shared part; recurrent: a checkpoint boundary."""
    limit = min(shared_len // BLOCK_SIZE * BLOCK_SIZE, prompt_len - 1)
    step = CHECKPOINT_INTERVAL if has_recurrent else BLOCK_SIZE
    return limit // step * step


class Verifier:
    def __init__(self, seed: int = 0, dtype: torch.dtype = torch.float64) -> None:
        if dtype not in (torch.float32, torch.float64):
            raise ValueError(f"dtype must be torch.float32 or torch.float64, got {dtype}")
        self.dtype = dtype
        self.models = {
            "gemma": TinyHybrid(TINY_GEMMA2, seed=seed, dtype=dtype),
            "recurrent": TinyHybrid(TINY_RECURRENT, seed=seed + 1, dtype=dtype),
        }
        self._twins: dict[int, TinyHybrid] = {}
        self._oracle: dict[tuple[int, tuple[int, ...]], Tensor] = {}

    def tokens(self, n: int, seed: int = 0) -> list[int]:
        g = torch.Generator().manual_seed(2000 + seed)
        return torch.randint(0, self.models["gemma"].vocab_size, (n,), generator=g).tolist()

    def oracle(self, model: TinyHybrid, token_ids: tuple[int, ...]) -> Tensor:
        key = (id(model), token_ids)
        if key not in self._oracle:
            self._oracle[key] = model.reference_logits(list(token_ids))
        return self._oracle[key]

    def twin(self, model: TinyHybrid) -> TinyHybrid:
        if id(model) not in self._twins:
            self._twins[id(model)] = model.to(torch.float64)
        return self._twins[id(model)]

    def runner(self, model: TinyHybrid, num_blocks: int = 64, num_slots: int = 16) -> ModelRunner:
        return hybrid_runner(
            model, num_blocks, num_slots, block_size=BLOCK_SIZE, checkpoint_interval=CHECKPOINT_INTERVAL
        )

    def engine(
        self, model: TinyHybrid, num_blocks: int = 64, num_slots: int = 16, *, max_num_batched_tokens: int
    ) -> Engine:
        """The engine the builder makes (engine/build.py) over `runner`'s cache shape."""
        return build_engine(
            model,
            num_blocks=num_blocks,
            num_slots=num_slots,
            block_size=BLOCK_SIZE,
            checkpoint_interval=CHECKPOINT_INTERVAL,
            max_num_batched_tokens=max_num_batched_tokens,
            max_num_seqs=64,  # the Engine's own default, as before
            record_logits=True,
        )

    def evaluate(self, name: str, segments: list[Segment], tolerance: float | None = None) -> CaseResult:
        check_tolerance(tolerance)
        diff = ref_err = max_abs = 0.0
        for seg in segments:
            rows = slice(seg.start, seg.start + seg.logits.shape[0])
            ref = self.oracle(seg.model, seg.token_ids)[rows]
            diff = max(diff, float((seg.logits.double() - ref.double()).abs().max()))
            if self.dtype == torch.float32:
                exact = self.oracle(self.twin(seg.model), seg.token_ids)[rows]
                ref_err = max(ref_err, float((ref.double() - exact).abs().max()))
                max_abs = max(max_abs, float(exact.abs().max()))
        if tolerance is not None:
            tol = tolerance
        elif self.dtype == torch.float64:
            tol = FP64_TOLERANCE
        else:
            tol = derived_fp32_tolerance(ref_err, max_abs)
        return CaseResult(name, diff, tol, diff <= tol, ref_err if self.dtype == torch.float32 else None)

    # ---- direct runs (the runner, no scheduler) ----------------------------------------

    def _prefill(self, runner: ModelRunner, rid: str, ids: list[int], chunk: int | None) -> tuple[int, Tensor]:
        """Admit `ids` and compute the rest in chunks; (hit point, logits of [hit, len))."""
        adm = runner.admit(rid, ids, chunk)
        if adm is None:
            # a length past the pool (--lengths 100000) is the caller's mistake, not a failed check:
            # as an assert it read "NO (assertion: the pool holds the prompt)", 0/2 passed
            raise ValueError(_too_long(len(ids)))
        pieces, pos = [], adm.num_cached_tokens
        n = adm.num_scheduled_tokens
        while True:
            pieces.append(runner.run([(rid, ids[pos : pos + n], pos)])[0])
            runner.commit_step([rid], [n], [None])
            runner.check_integrity()
            pos += n
            if pos == len(ids):
                return adm.num_cached_tokens, torch.cat(pieces)
            n = min(chunk or len(ids), len(ids) - pos)
            assert runner.reserve_step([rid], [n])

    def prompt(self, model_name: str, length: int, chunk: int | None = None) -> list[Segment]:
        model = self.models[model_name]
        runner = self.runner(model)
        if length // runner.cache.block_size > runner.cache.num_blocks:  # (no group could hold it)
            # before its ids are drawn: --lengths 99999999999 asked torch for 800 GB
            raise ValueError(_too_long(length))
        ids = self.tokens(length, seed=length)
        point, logits = self._prefill(runner, "r", ids, chunk)
        assert point == 0
        return [Segment(model, tuple(ids), 0, logits)]

    def decode(self, model_name: str, prompt_len: int = 20, num_steps: int = 60) -> list[Segment]:
        """Greedy decode across block, window and checkpoint boundaries."""
        model = self.models[model_name]
        ids = self.tokens(prompt_len, seed=7)
        runner = self.runner(model)
        _, logits = self._prefill(runner, "r", ids, None)
        rows = [logits]
        for _ in range(num_steps):
            ids.append(int(rows[-1][-1].argmax()))
            runner.append_token_ids("r", [ids[-1]])
            assert runner.reserve_step(["r"], [1])
            rows.append(runner.run([("r", [ids[-1]], len(ids) - 1)])[0])
            runner.commit_step(["r"], [1], [None])
            runner.check_integrity()
        return [Segment(model, tuple(ids), 0, torch.cat(rows))]

    def hit(self, model_name: str, shared_len: int) -> list[Segment]:
        """A cached 90-token history, then a prompt sharing its first `shared_len` tokens:
        the hit point is the independent rule's, and the rest computes exactly."""
        model = self.models[model_name]
        runner = self.runner(model)
        a = self.tokens(90, seed=11)
        self._prefill(runner, "a", a, None)
        b = a[:shared_len] + [(a[shared_len] + 1) % model.vocab_size] + self.tokens(9, seed=12)
        want = expected_hit(shared_len, len(b), bool(model.recurrent_layers()))
        assert runner.cache.lookup_prefix(b) == want, (runner.cache.group_hit_points(b), want)
        point, logits = self._prefill(runner, "b", b, None)
        assert point == want
        return [Segment(model, tuple(b), point, logits)]

    def fallback_hit(self) -> list[Segment]:
        """The recurrent model: the attention groups could serve 40 tokens, the recurrent
        group has checkpoints at 12, 24, 36 only: the hit falls back to 36, inside block 4."""
        model = self.models["recurrent"]
        runner = self.runner(model)
        a = self.tokens(41, seed=21)
        self._prefill(runner, "a", a, None)
        b = a[:40] + [1, 2, 3]
        points = runner.cache.group_hit_points(b)
        assert points["full"][-1] == 40 and points["recurrent"][-1] == 36, points
        point, logits = self._prefill(runner, "b", b, None)
        assert point == 36
        return [Segment(model, tuple(b), point, logits)]

    # ---- under the engine's scheduler --------------------------------------------------

    def _engine_segments(self, model: TinyHybrid, engine: Engine, ids: list[str]) -> list[Segment]:
        segments = []
        for rid in ids:
            req = engine.requests[rid]
            for seq in req.seqs:
                start = req.num_prompt_tokens - 1
                segments.append(Segment(model, tuple(seq.token_ids), start, torch.stack(seq.logits)))
        return segments

    def preemption(self, model_name: str) -> list[Segment]:
        model = self.models[model_name]
        engine = self.engine(model, num_blocks=20, num_slots=8, max_num_batched_tokens=48)
        runner = engine.runner
        ids = [
            engine.add_request(self.tokens(50, seed=30 + i), SamplingParams(max_tokens=30, ignore_eos=True))
            for i in range(4)
        ]
        while engine.has_unfinished():
            engine.step()
            runner.check_integrity()
        assert engine.num_preemptions > 0, "the case must preempt"
        return self._engine_segments(model, engine, ids)

    def fork(self, model_name: str) -> list[Segment]:
        model = self.models[model_name]
        engine = self.engine(model, max_num_batched_tokens=64)
        runner = engine.runner
        params = SamplingParams(max_tokens=24, temperature=1.0, seed=3, n=3, ignore_eos=True)
        ids = [engine.add_request(self.tokens(37, seed=40), params)]
        while engine.has_unfinished():
            engine.step()
            runner.check_integrity()
        outputs = {tuple(c.token_ids) for c in engine.output(ids[0]).completions}
        assert len(engine.requests[ids[0]].seqs) == 3 and len(outputs) > 1, "three samples, not all equal"
        return self._engine_segments(model, engine, ids)

    # ---- the matrix --------------------------------------------------------------------

    def cases(self, lengths: tuple[int, ...] | None = None) -> list[tuple[str, object]]:
        out: list[tuple[str, object]] = []
        for name in MODELS:
            for n in lengths or DEFAULT_LENGTHS:
                out.append((f"{name}: prompt {n}", lambda name=name, n=n: self.prompt(name, n)))
            if lengths is not None:
                continue
            for c in CHUNK_SIZES:
                out.append((f"{name}: prompt 70 in chunks of {c}", lambda name=name, c=c: self.prompt(name, 70, c)))
            out.append((f"{name}: decode 20 + 60 steps", lambda name=name: self.decode(name)))
            for s in SHARED_LENGTHS:
                out.append((f"{name}: hit after {s} shared tokens", lambda name=name, s=s: self.hit(name, s)))
            out.append((f"{name}: preemption under the scheduler", lambda name=name: self.preemption(name)))
            out.append((f"{name}: fork of 3 samples", lambda name=name: self.fork(name)))
        if lengths is None:
            out.append(("recurrent: hit the attention side could extend (fall back to 36)", self.fallback_hit))
        return out

    def run(self, lengths: tuple[int, ...] | None = None, tolerance: float | None = None) -> list[CaseResult]:
        check_tolerance(tolerance)
        results = []
        for name, case in self.cases(lengths):
            try:
                segments = case()  # type: ignore[operator]
            except AssertionError as e:
                results.append(CaseResult(name, math.nan, math.nan, False, None, f"assertion: {e}"))
                continue
            results.append(self.evaluate(name, segments, tolerance))
        return results
