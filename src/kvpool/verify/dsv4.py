"""The V4 verification matrix: paged dual-pool logits against the contiguous oracle.

Every case runs the tiny V4 model (real m = 4, m' = 128, n_win = 128) on the Classical +
State pools and compares each computed position's logits with `TinyDSV4.reference_logits`
of the same token history. Structural facts of a case (block counts, refcounts, restore
method, released blocks) are asserted inside it; a failed assertion fails the case. Used
by `kvpool verify dsv4` and by tests/test_dsv4_paged.py.

Tolerances (kvpool.verify.dsv4_tolerance has the rules and the measured figures):
- fp64 (`dtype=torch.float64`, the default), the decisive check: every case within
  FP64_TOLERANCE (1e-12; fp64 rounding gives <= 7e-15, one wrong slot ~1e-2).
- fp32: per case, tol = max(FP32_K * max |oracle_fp32 - oracle_fp64|, FP32_FLOOR_ULPS
  ulps of the largest |logit|), the fp64 oracle running the same fp32 weights
  (`TinyDSV4.to`). A case whose logits disagree while its indexer's top-k lies within
  FP32_SELECTION_K fp32 errors of a tie (`selection_margin`) is "undecided": the two
  paths may rightly keep different entries there, and only fp64 can tell.
- An explicit `tolerance` (a finite number >= 0) overrides the bound in either mode.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from kvpool.attention.dsv4_reference import IndexerTrace
from kvpool.engine.dsv4_runner import dsv4_runner
from kvpool.engine.runner import ModelRunner
from kvpool.models.tiny_dsv4 import SMALL_DSV4_CONFIG, TinyDSV4
from kvpool.verify.dsv4_tolerance import (
    FP32_SELECTION_K,
    FP64_TOLERANCE,
    check_tolerance,
    derived_fp32_tolerance,
    selection_margin,
)

DEFAULT_LENGTHS: tuple[int, ...] = (1, 3, 4, 5, 127, 128, 129, 130, 300)
CHUNK_SIZES: tuple[int, ...] = (1, 7, 64, 128)

Verdict = Literal["pass", "fail", "undecided"]


@dataclass(frozen=True)
class Segment:
    """Logits a paged run produced for positions [start, start + len(logits)) of a history.

    model: the model that ran (its oracle is the reference); token_ids: the whole history;
    logits: [num_positions, vocab] in the model's dtype.
    """

    model: TinyDSV4
    token_ids: tuple[int, ...]
    start: int
    logits: Tensor


@dataclass(frozen=True)
class CaseResult:
    """One case's outcome. max_abs_diff: paged vs oracle over every segment; tolerance: the
    bound it was held to. fp32 runs only: reference_error = max |oracle_fp32 - oracle_fp64|
    over the same positions, selection_margin = the top-k margin (module docstring)."""

    name: str
    max_abs_diff: float
    tolerance: float
    verdict: Verdict
    reference_error: float | None = None
    selection_margin: float | None = None
    detail: str = ""

    @property
    def passed(self) -> bool:
        return self.verdict == "pass"


class Verifier:
    """Holds the models and caches oracle results across cases (the oracle is deterministic).

    dtype: torch.float64 (the exactness check) or torch.float32 (the model's mode; the
    tolerances come from each model's fp64 twin, `model.to(torch.float64)`)."""

    def __init__(self, seed: int = 0, dtype: torch.dtype = torch.float64) -> None:
        if dtype not in (torch.float32, torch.float64):
            raise ValueError(f"dtype must be torch.float32 or torch.float64, got {dtype}")
        self.dtype = dtype
        self.model = TinyDSV4(seed=seed, dtype=dtype)
        self._small: TinyDSV4 | None = None
        self._twins: dict[int, TinyDSV4] = {}
        self._oracle: dict[tuple[int, tuple[int, ...]], Tensor] = {}
        self._indexer: dict[tuple[int, tuple[int, ...]], list[IndexerTrace]] = {}

    @property
    def small(self) -> TinyDSV4:
        if self._small is None:
            self._small = TinyDSV4(SMALL_DSV4_CONFIG, seed=1, dtype=self.dtype)
        return self._small

    def tokens(self, n: int, seed: int = 0) -> list[int]:
        g = torch.Generator().manual_seed(1000 + seed)
        return torch.randint(0, self.model.vocab_size, (n,), generator=g).tolist()

    def oracle(self, model: TinyDSV4, token_ids: list[int] | tuple[int, ...]) -> Tensor:
        """The oracle's logits [T, vocab] of `token_ids` (cached)."""
        key = (id(model), tuple(token_ids))
        if key not in self._oracle:
            self._oracle[key] = model.reference_logits(list(token_ids))
        return self._oracle[key]

    def oracle_indexer(self, model: TinyDSV4, token_ids: list[int] | tuple[int, ...]) -> list[IndexerTrace]:
        """The oracle's indexer traces of `token_ids`, one per CSA layer (cached; the same
        forward fills the logits cache)."""
        key = (id(model), tuple(token_ids))
        if key not in self._indexer:
            out = model.reference_with_indexer(list(token_ids))
            self._oracle.setdefault(key, out.logits)
            self._indexer[key] = out.indexer
        return self._indexer[key]

    def twin(self, model: TinyDSV4) -> TinyDSV4:
        """The fp64 model holding `model`'s weights exactly (fp32 -> fp64 is exact)."""
        if id(model) not in self._twins:
            self._twins[id(model)] = model.to(torch.float64)
        return self._twins[id(model)]

    def runner(self, model: TinyDSV4 | None = None, **kw: object) -> ModelRunner:
        kw.setdefault("num_classical_blocks", 16)
        kw.setdefault("num_state_blocks", 4)
        return dsv4_runner(model or self.model, **kw)  # type: ignore[arg-type]

    def evaluate(self, name: str, segments: list[Segment], tolerance: float | None = None) -> CaseResult:
        """Compare every segment with its oracle under the module docstring's rules."""
        check_tolerance(tolerance)
        if self.dtype == torch.float64:
            diff = max(_diff(seg.logits, self._oracle_rows(seg.model, seg)) for seg in segments)
            tol = FP64_TOLERANCE if tolerance is None else tolerance
            return CaseResult(name, diff, tol, "pass" if diff <= tol else "fail")
        diff = ref_err = max_abs_logit = 0.0
        margin = math.inf
        for seg in segments:
            twin, k = self.twin(seg.model), seg.model.spec.index_topk
            margin = min(
                margin,
                selection_margin(
                    self.oracle_indexer(seg.model, seg.token_ids), self.oracle_indexer(twin, seg.token_ids), k
                ),
            )
            ref, exact = self._oracle_rows(seg.model, seg), self._oracle_rows(twin, seg)
            diff = max(diff, _diff(seg.logits, ref))
            ref_err = max(ref_err, _diff(ref.double(), exact))
            max_abs_logit = max(max_abs_logit, float(exact.abs().max()))
        tol = derived_fp32_tolerance(ref_err, max_abs_logit) if tolerance is None else tolerance
        verdict: Verdict = "pass" if diff <= tol else ("fail" if margin >= FP32_SELECTION_K else "undecided")
        return CaseResult(name, diff, tol, verdict, ref_err, margin)

    def _oracle_rows(self, model: TinyDSV4, seg: Segment) -> Tensor:
        return self.oracle(model, seg.token_ids)[seg.start : seg.start + seg.logits.shape[0]]

    # ----- cases: each returns the segments of logits it computed ---------------------------

    def prompt(self, length: int, chunk: int | None = None, hot: int | None = None) -> list[Segment]:
        """One prompt of `length` tokens prefilled in chunks of `chunk` (None: one chunk).
        hot: HiSparse with a hot set of that many CSA entries (None: off)."""
        runner = self.runner(hot_set_entries=hot)
        # A length past the verifier's pool (--lengths 4000) is the caller's mistake, not a failed
        # check: the bare asserts here read "NO (assertion failed: )", as if V4 were wrong. (The
        # matrix's own lengths, 300 at most, fit the pool many times over.)
        too_long = ValueError(
            f"--lengths {length}: a prompt of {length:,} tokens does not fit the verifier's KV pool; "
            "give shorter lengths"
        )
        if length // runner.cache.block_size > runner.cache.num_blocks:
            raise too_long  # (before its ids are drawn: --lengths 99999999999 asked torch for 800 GB)
        ids = self.tokens(length)
        if runner.add_request("r", ids) is None:
            raise too_long
        pieces = []
        pos = 0
        while pos < length:
            n = min(chunk or length, length - pos)
            out = runner.step([("r", n)])
            if out is None:
                raise too_long
            pieces.append(out[0].logits)
            pos += n
        assert len(runner.cache.block_ids("r")) == length // runner.executor.spec.span
        runner.check_integrity()
        return [Segment(self.model, tuple(ids), 0, torch.cat(pieces))]

    def decode(self, prompt_len: int = 100, num_steps: int = 200, hot: int | None = None) -> list[Segment]:
        """Greedy decode across block boundaries; every step against the oracle. Also checks
        that the Classical pool only ever holds complete, never-rewritten spans."""
        runner = self.runner(hot_set_entries=hot)
        ids = self.tokens(prompt_len, seed=1)
        runner.add_request("r", ids)
        out = runner.step([("r", prompt_len)])
        assert out is not None
        logits = [out[0].logits]
        watcher = ClassicalPoolWatcher(runner)
        for _ in range(num_steps):
            nxt = int(logits[-1][-1].argmax())
            ids.append(nxt)
            runner.append_token_ids("r", [nxt])
            out = runner.step([("r", 1)])
            assert out is not None
            logits.append(out[0].logits)
            watcher.check()
            runner.check_integrity()
        return [Segment(self.model, tuple(ids), 0, torch.cat(logits))]

    def batch_mixed(self, lengths: tuple[int, ...] = (1, 5, 130, 77), num_steps: int = 10) -> list[Segment]:
        """Mixed-length prompts prefilled in one step, then decoded together."""
        runner = self.runner(num_state_blocks=len(lengths))
        seqs = {f"r{i}": self.tokens(n, seed=10 + i) for i, n in enumerate(lengths)}
        for rid, ids in seqs.items():
            assert runner.add_request(rid, ids) is not None
        out = runner.step([(rid, len(ids)) for rid, ids in seqs.items()])
        assert out is not None
        logits = {r.request_id: [r.logits] for r in out}
        for _ in range(num_steps):
            for rid, ids in seqs.items():
                nxt = int(logits[rid][-1][-1].argmax())
                ids.append(nxt)
                runner.append_token_ids(rid, [nxt])
            out = runner.step([(rid, 1) for rid in seqs])
            assert out is not None
            for r in out:
                logits[r.request_id].append(r.logits)
        runner.check_integrity()
        return [Segment(self.model, tuple(ids), 0, torch.cat(logits[rid])) for rid, ids in seqs.items()]

    def prefix_hit(self, num_blocks: int, restore: str, small: bool = False, hot: int | None = None) -> list[Segment]:
        """Request A computes a prompt; B shares its first num_blocks spans (+ a few tokens) and
        must hit exactly num_blocks classical blocks, restore the state, and match the oracle."""
        model = self.small if small else self.model
        span = model.spec.span
        runner = self.runner(
            model,
            restore=restore,
            num_checkpoints=4 if restore == "checkpoint" else 0,
            num_classical_blocks=2 * (num_blocks + 2) + 2,
            hot_set_entries=hot,
        )
        a = self.tokens(span * num_blocks + span // 2, seed=20)
        b = a[: span * num_blocks + 3] + self.tokens(40, seed=21)
        runner.add_request("a", a)
        out_a = runner.step([("a", len(a))])
        assert out_a is not None
        adm = runner.add_request("b", b)
        assert adm is not None
        assert adm.num_cached_tokens == span * num_blocks, f"hit {adm.num_cached_tokens} tokens"
        (part,) = adm.groups.values()  # the one dual-pool group's
        assert part.restore is not None and part.restore.method == restore, part.restore
        if restore == "recompute":
            window_tokens = model.spec.window * model.spec.num_layers
            assert part.restore.replay_start == max(0, span * num_blocks - window_tokens)
        for block_id in part.block_ids:
            assert runner.cache.pool.refcount(block_id) == 2
        out_b = runner.step([("b", len(b) - adm.num_cached_tokens)])
        assert out_b is not None
        runner.check_integrity()
        return [
            Segment(model, tuple(a), 0, out_a[0].logits),
            Segment(model, tuple(b), adm.num_cached_tokens, out_b[0].logits),
        ]

    def shared_decode(self, num_steps: int = 20) -> list[Segment]:
        """Two requests hold the same classical block (refcount 2) while both decode."""
        runner = self.runner()
        a = self.tokens(140, seed=30)
        b = a[:130] + self.tokens(5, seed=31)
        runner.add_request("a", a)
        out = runner.step([("a", len(a))])
        assert out is not None
        logits_a = [out[0].logits]
        adm = runner.add_request("b", b)
        assert adm is not None and adm.num_cached_tokens == 128
        out = runner.step([("b", len(b) - 128)])
        assert out is not None
        logits_b = [out[0].logits]
        shared = runner.cache.block_ids("a")[0]
        assert runner.cache.block_ids("b")[0] == shared
        for _ in range(num_steps):
            assert runner.cache.pool.refcount(shared) == 2
            for ids, lg, rid in ((a, logits_a, "a"), (b, logits_b, "b")):
                nxt = int(lg[-1][-1].argmax())
                ids.append(nxt)
                runner.append_token_ids(rid, [nxt])
            out = runner.step([("a", 1), ("b", 1)])
            assert out is not None
            logits_a.append(out[0].logits)
            logits_b.append(out[1].logits)
        runner.check_integrity()
        assert runner.release("a") and runner.cache.pool.refcount(shared) == 1
        assert runner.release("b") and runner.cache.pool.refcount(shared) == 0
        runner.check_integrity()
        return [
            Segment(self.model, tuple(a), 0, torch.cat(logits_a)),
            Segment(self.model, tuple(b), 128, torch.cat(logits_b)),
        ]

    # ----- the matrix ---------------------------------------------------------------------

    def cases(self, lengths: tuple[int, ...] | None = None) -> list[tuple[str, Callable[[], list[Segment]]]]:
        """(name, case) pairs; with `lengths`, only the prompt-length cases for those lengths."""
        named: list[tuple[str, Callable[[], list[Segment]]]] = [
            (f"prompt_len_{n}", lambda n=n: self.prompt(n)) for n in (lengths or DEFAULT_LENGTHS)
        ]
        if lengths:
            return named
        named += [(f"chunked_prefill_300_chunk_{c}", lambda c=c: self.prompt(300, c)) for c in CHUNK_SIZES]
        named += [
            ("decode_200_steps_from_100", self.decode),
            ("batch_mixed_lengths_1_5_130_77", self.batch_mixed),
        ]
        named += [
            (f"prefix_hit_{q}_blocks_{method}", lambda q=q, method=method: self.prefix_hit(q, method))
            for q in (1, 2)
            for method in ("checkpoint", "recompute")
        ]
        named += [
            ("small_cfg_prefix_hit_8_blocks_recompute", lambda: self.prefix_hit(8, "recompute", small=True)),
            ("shared_block_refcount_2_decode", self.shared_decode),
        ]
        # HiSparse: CSA main entries on the host, a hot set on the device (smaller than the
        # indexer's top-k of 8 in the first: every step fetches)
        named += [
            ("hisparse_hot_4_decode_200_steps_from_100", lambda: self.decode(hot=4)),
            ("hisparse_hot_16_chunked_prefill_300_chunk_64", lambda: self.prompt(300, 64, hot=16)),
            ("hisparse_hot_8_prefix_hit_2_blocks_recompute", lambda: self.prefix_hit(2, "recompute", hot=8)),
        ]
        return named

    def run(self, lengths: tuple[int, ...] | None = None, tolerance: float | None = None) -> list[CaseResult]:
        """Every case, judged by `evaluate`; `tolerance` (None: the derived rule) overrides."""
        check_tolerance(tolerance)
        results = []
        for name, case in self.cases(lengths):
            try:
                results.append(self.evaluate(name, case(), tolerance))
            except AssertionError as exc:
                nan = float("nan")
                results.append(CaseResult(name, nan, nan, "fail", detail=f"assertion failed: {exc}"))
        return results


class ClassicalPoolWatcher:
    """Asserts, after each step, that the Classical pool holds only complete spans: a block's
    tensors are non-zero only while some request holds it, a held block never changes once
    written, and a request holds exactly num_computed // span blocks (check_integrity)."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.seen: dict[int, list[Tensor]] = {}

    def check(self) -> None:
        pool = self.runner.cache.pool
        tensors = [t for cl in self.runner.executor.pools.classical for t in (cl.main, cl.idx) if t is not None]
        for block_id in range(pool.num_blocks):
            written = any(bool(t[block_id].any()) for t in tensors)
            held = pool.refcount(block_id) > 0 or pool.block_hash(block_id) is not None
            if written and not held:
                raise AssertionError(f"classical block {block_id} holds entries but belongs to no complete span")
            if held and written:
                snapshot = [t[block_id].clone() for t in tensors]
                if block_id in self.seen:
                    if any(not torch.equal(a, b) for a, b in zip(self.seen[block_id], snapshot, strict=True)):
                        raise AssertionError(f"classical block {block_id} changed after it was written")
                else:
                    self.seen[block_id] = snapshot


def _diff(a: Tensor, b: Tensor) -> float:
    if a.shape != b.shape:
        raise AssertionError(f"logit shapes differ: {tuple(a.shape)} vs {tuple(b.shape)}")
    return float((a - b).abs().max())
