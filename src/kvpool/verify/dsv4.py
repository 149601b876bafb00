"""The V4 verification matrix: paged dual-pool logits against the contiguous oracle.

Every case runs the tiny V4 model (real m = 4, m' = 128, n_win = 128, fp32) on the
Classical + State pools and compares each computed position's logits with
`TinyDSV4.reference_logits` of the same token history. Structural facts of a case (block
counts, refcounts, restore method, released blocks) are asserted inside it; a failed
assertion fails the case. Used by `kvpool verify dsv4` and by tests/test_dsv4_paged.py.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from kvpool.engine.dsv4_runner import DSV4PagedRunner
from kvpool.models.tiny_dsv4 import SMALL_DSV4_CONFIG, TinyDSV4

TOLERANCE = 1e-5
DEFAULT_LENGTHS: tuple[int, ...] = (1, 3, 4, 5, 127, 128, 129, 130, 300)
CHUNK_SIZES: tuple[int, ...] = (1, 7, 64, 128)


@dataclass(frozen=True)
class CaseResult:
    name: str
    max_abs_diff: float
    passed: bool
    detail: str = ""


class Verifier:
    """Holds the models and caches oracle logits across cases (the oracle is deterministic)."""

    def __init__(self, seed: int = 0) -> None:
        self.model = TinyDSV4(seed=seed)
        self._small: TinyDSV4 | None = None
        self._oracle: dict[tuple[int, tuple[int, ...]], Tensor] = {}

    @property
    def small(self) -> TinyDSV4:
        if self._small is None:
            self._small = TinyDSV4(SMALL_DSV4_CONFIG, seed=1)
        return self._small

    def tokens(self, n: int, seed: int = 0) -> list[int]:
        g = torch.Generator().manual_seed(1000 + seed)
        return torch.randint(0, self.model.vocab_size, (n,), generator=g).tolist()

    def oracle(self, model: TinyDSV4, token_ids: list[int]) -> Tensor:
        key = (id(model), tuple(token_ids))
        if key not in self._oracle:
            self._oracle[key] = model.reference_logits(token_ids)
        return self._oracle[key]

    def runner(self, model: TinyDSV4 | None = None, **kw: object) -> DSV4PagedRunner:
        kw.setdefault("num_classical_blocks", 16)
        kw.setdefault("num_state_blocks", 4)
        return DSV4PagedRunner(model or self.model, **kw)  # type: ignore[arg-type]

    # ----- cases: each returns the max abs logit difference --------------------------------

    def prompt(self, length: int, chunk: int | None = None) -> float:
        """One prompt of `length` tokens prefilled in chunks of `chunk` (None: one chunk)."""
        ids = self.tokens(length)
        runner = self.runner()
        assert runner.add_request("r", ids) is not None
        pieces = []
        pos = 0
        while pos < length:
            n = min(chunk or length, length - pos)
            out = runner.step([("r", n)])
            assert out is not None
            pieces.append(out[0].logits)
            pos += n
        assert len(runner.cache.block_ids("r")) == length // runner.spec.span
        runner.check_integrity()
        return _diff(torch.cat(pieces), self.oracle(self.model, ids))

    def decode(self, prompt_len: int = 100, num_steps: int = 200) -> float:
        """Greedy decode across block boundaries; every step against the oracle. Also checks
        that the Classical pool only ever holds complete, never-rewritten spans."""
        runner = self.runner()
        ids = self.tokens(prompt_len, seed=1)
        runner.add_request("r", ids)
        out = runner.step([("r", prompt_len)])
        assert out is not None
        logits = [out[0].logits]
        watcher = ClassicalPoolWatcher(runner)
        for _ in range(num_steps):
            nxt = int(logits[-1][-1].argmax())
            ids.append(nxt)
            runner.append_tokens("r", [nxt])
            out = runner.step([("r", 1)])
            assert out is not None
            logits.append(out[0].logits)
            watcher.check()
            runner.check_integrity()
        return _diff(torch.cat(logits), self.oracle(self.model, ids))

    def batch_mixed(self, lengths: tuple[int, ...] = (1, 5, 130, 77), num_steps: int = 10) -> float:
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
                runner.append_tokens(rid, [nxt])
            out = runner.step([(rid, 1) for rid in seqs])
            assert out is not None
            for r in out:
                logits[r.request_id].append(r.logits)
        runner.check_integrity()
        return max(_diff(torch.cat(logits[rid]), self.oracle(self.model, ids)) for rid, ids in seqs.items())

    def prefix_hit(self, num_blocks: int, restore: str, small: bool = False) -> float:
        """Request A computes a prompt; B shares its first num_blocks spans (+ a few tokens) and
        must hit exactly num_blocks classical blocks, restore the state, and match the oracle."""
        model = self.small if small else self.model
        span = model.spec.span
        runner = self.runner(
            model,
            restore=restore,
            num_checkpoints=4 if restore == "checkpoint" else 0,
            num_classical_blocks=2 * (num_blocks + 2) + 2,
        )
        a = self.tokens(span * num_blocks + span // 2, seed=20)
        b = a[: span * num_blocks + 3] + self.tokens(40, seed=21)
        runner.add_request("a", a)
        out_a = runner.step([("a", len(a))])
        assert out_a is not None
        adm = runner.add_request("b", b)
        assert adm is not None
        assert adm.num_cached_tokens == span * num_blocks, f"hit {adm.num_cached_tokens} tokens"
        assert adm.restore is not None and adm.restore.method == restore, adm.restore
        if restore == "recompute":
            window_tokens = model.spec.window * model.spec.num_layers
            assert adm.restore.replay_start == max(0, span * num_blocks - window_tokens)
        for block_id in adm.block_ids:
            assert runner.cache.pool.refcount(block_id) == 2
        out_b = runner.step([("b", len(b) - adm.num_cached_tokens)])
        assert out_b is not None
        runner.check_integrity()
        diff_a = _diff(out_a[0].logits, self.oracle(model, a))
        diff_b = _diff(out_b[0].logits, self.oracle(model, b)[adm.num_cached_tokens :])
        return max(diff_a, diff_b)

    def shared_decode(self, num_steps: int = 20) -> float:
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
                runner.append_tokens(rid, [nxt])
            out = runner.step([("a", 1), ("b", 1)])
            assert out is not None
            logits_a.append(out[0].logits)
            logits_b.append(out[1].logits)
        runner.check_integrity()
        assert runner.release("a") and runner.cache.pool.refcount(shared) == 1
        assert runner.release("b") and runner.cache.pool.refcount(shared) == 0
        runner.check_integrity()
        return max(
            _diff(torch.cat(logits_a), self.oracle(self.model, a)),
            _diff(torch.cat(logits_b), self.oracle(self.model, b)[128:]),
        )

    # ----- the matrix ---------------------------------------------------------------------

    def cases(self, lengths: tuple[int, ...] | None = None) -> list[tuple[str, Callable[[], float]]]:
        """(name, case) pairs; with `lengths`, only the prompt-length cases for those lengths."""
        named: list[tuple[str, Callable[[], float]]] = [
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
        return named

    def run(self, lengths: tuple[int, ...] | None = None, tolerance: float = TOLERANCE) -> list[CaseResult]:
        results = []
        for name, case in self.cases(lengths):
            try:
                diff = case()
                results.append(CaseResult(name, diff, diff <= tolerance))
            except AssertionError as exc:
                results.append(CaseResult(name, float("nan"), False, f"assertion failed: {exc}"))
        return results


class ClassicalPoolWatcher:
    """Asserts, after each step, that the Classical pool holds only complete spans: a block's
    tensors are non-zero only while some request holds it, a held block never changes once
    written, and a request holds exactly num_computed // span blocks (check_integrity)."""

    def __init__(self, runner: DSV4PagedRunner) -> None:
        self.runner = runner
        self.seen: dict[int, list[Tensor]] = {}

    def check(self) -> None:
        pool = self.runner.cache.pool
        tensors = [t for cl in self.runner.pools.classical for t in (cl.main, cl.idx) if t is not None]
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
