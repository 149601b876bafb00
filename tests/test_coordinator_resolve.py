"""The coordinator's memo of a step's requests (`HybridCacheManager._resolve`): the decode
passes (reserve_step, step_reservations, commit_step) reuse the last step's `_Request` list
while the ids are equal and no request joined or left. Held to the naive twins
(`_reserve_each`, `_each_reservation`, `_commit_each`, which look every id up) through
lifecycles that change the requests between steps under the SAME ids list object."""

from __future__ import annotations

import ast
import inspect

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from kvpool.cache import CacheDescriptor, DSV4CacheManager, FullAttentionManager, coordinator
from kvpool.cache.coordinator import HybridCacheManager
from kvpool.models.tiny_dsv4 import SMALL_DSV4_CONFIG
from kvpool.spec.dsv4 import DSV4Spec

SPEC = DSV4Spec.from_config(SMALL_DSV4_CONFIG)  # span 16
DESC = CacheDescriptor("small-dsv4", layout_id="span16:fp32")
MUTATORS = {"pop", "popitem", "clear", "update", "setdefault", "__setitem__", "__delitem__"}


def _ids(n: int, offset: int = 0) -> list[int]:
    return [(offset + 7 * i) % 251 for i in range(n)]


def test_requests_change_only_where_the_memo_goes_stale() -> None:
    # Every change of `_requests` must bump the version `_resolve` checks: the source holds
    # its assignments, deletions and mutating calls (through `self._requests` or a local
    # alias of it) to `_add_request` and `_pop_request` (and the empty dict of __init__)
    tree = ast.parse(inspect.getsource(coordinator))
    found = []
    for func in ast.walk(tree):
        if not isinstance(func, ast.FunctionDef):
            continue
        aliases = set()
        for node in ast.walk(func):  # `requests = self._requests`, `requests, x = self._requests, ...`
            if isinstance(node, ast.Assign):
                pairs = []
                for target in node.targets:
                    if isinstance(target, ast.Tuple) and isinstance(node.value, ast.Tuple):
                        pairs += zip(target.elts, node.value.elts, strict=False)
                    else:
                        pairs.append((target, node.value))
                for target, value in pairs:
                    if isinstance(target, ast.Name) and ast.unparse(value) == "self._requests":
                        aliases.add(target.id)
        names = {"self._requests", *aliases}

        def is_requests(node: ast.AST, names: set[str] = names) -> bool:
            return ast.unparse(node) in names

        for node in ast.walk(func):
            targets = []
            if isinstance(node, ast.Assign | ast.AugAssign | ast.AnnAssign):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            elif isinstance(node, ast.Delete):
                targets = node.targets
            for target in targets:
                if isinstance(target, ast.Subscript) and is_requests(target.value):
                    found.append((func.name, ast.unparse(node)))
                if ast.unparse(target) == "self._requests" and func.name != "__init__":
                    found.append((func.name, ast.unparse(node)))
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                if node.func.attr in MUTATORS and is_requests(node.func.value):
                    found.append((func.name, ast.unparse(node)))
    assert sorted({name for name, _ in found}) == ["_add_request", "_pop_request"], found


def test_a_request_released_and_admitted_again_under_the_same_ids_is_the_new_one() -> None:
    # The engine's ids list of an unchanged batch, the same object step after step: r1 is
    # released and admitted again between two steps (a preemption that recomputes), the
    # list unchanged. The next step must see the new r1 (computed 4 + 1), not the one gone
    m = DSV4CacheManager(SPEC, 12, 4, DESC)
    for rid, n in (("r0", 10), ("r1", 6)):
        assert m.admit(rid, _ids(n)) is not None
        m.commit_step([rid], [n], [1])
    ids = ["r0", "r1"]
    assert m.reserve_step(ids, [1, 1])
    assert m.step_reservations(tuple(ids), (10, 6), (11, 7)) == {}
    m.commit_step(ids, [1, 1], [2, 2])
    assert [m.num_computed_tokens(r) for r in ids] == [11, 7]
    m.release("r1", "preempt")
    assert m.admit("r1", _ids(4)) is not None  # a shorter prompt: another request under the id
    m.commit_step(["r1"], [4], [3])
    assert m.reserve_step(ids, [1, 1])
    assert m.step_reservations(tuple(ids), (11, 4), (12, 5)) == {}
    m.commit_step(ids, [1, 1], [4, 4])
    assert [m.num_computed_tokens(r) for r in ids] == [12, 5]
    assert m.token_ids("r1") == [*_ids(4), 3, 4]
    m.check_integrity()
    # the list changed in place (the batch reordered): equal to nothing kept, looked up again
    ids.reverse()
    assert m.reserve_step(ids, [1, 1])
    m.commit_step(ids, [1, 1], [5, 6])
    assert (m.token_ids("r0")[-1], m.token_ids("r1")[-1]) == (6, 5)
    m.check_integrity()


class _Twins:
    """Two caches driven alike: `fast` through reserve_step / step_reservations /
    commit_step (the memo), `twin` through their naive twins. shared: the requests are
    admitted with share_ids (each cache its own lists, grown here as the engine grows its
    sequences: a sampled id appended before the commit that names it); a fork's child has
    ids of its own."""

    def __init__(self, paged: bool, shared: bool = False) -> None:
        def build() -> HybridCacheManager:
            if paged:
                return FullAttentionManager(24, 4, DESC)
            # (shared: a finish keeps its turn end, at the computed count of the row that leaves)
            return DSV4CacheManager(SPEC, 12, 4, DESC, turn_end_checkpoints=shared)

        self.fast, self.twin = build(), build()
        self.twin._decode_period = None  # reserve_step -> _reserve_each, step_reservations -> _each_reservation
        # the twin looks every id up, every call: no memo, carried or not (`_resolve_changed`)
        twin = self.twin
        twin._resolve = lambda ids: list(map(twin._requests.__getitem__, ids))  # type: ignore[method-assign]
        self.both = (self.fast, self.twin)
        self.shared = shared
        self.lists: dict[tuple[int, str], list[int]] = {}  # (cache, request) -> its shared ids

    def admit(self, m: HybridCacheManager, rid: str, tokens: list[int], budget: int | None = None) -> object:
        if not self.shared:
            return m.admit(rid, tokens, budget)
        self.lists[id(m), rid] = ids = list(tokens)
        return m.admit(rid, ids, budget, share_ids=True)

    def computed(self, rid: str) -> int:
        """The request's computed count, read from the twin (the cache without a memo)."""
        return self.twin.num_computed_tokens(rid)

    def known(self, m: HybridCacheManager, rid: str) -> int:
        ids = self.lists.get((id(m), rid))
        return self.twin.num_tokens(rid) if ids is None else len(ids)

    def append(self, m: HybridCacheManager, rid: str, token: int) -> None:
        ids = self.lists.get((id(m), rid))
        if ids is None:
            m.append_token_ids(rid, [token])
        else:
            ids.append(token)

    def commit_both(self, ids: list[str], counts: list[int], nexts: list[int | None]) -> list[object]:
        """Each cache's commit of the step (its answer: None, or its error); a shared
        request's named next id joins its lists first, at its position (as the engine's)."""
        if self.shared:  # (a row inside its prompt names the prompt's next id, as the engine's)
            nexts = list(nexts)
            for i, (rid, n, token) in enumerate(zip(ids, counts, nexts, strict=True)):
                if token is not None and rid in self.twin and (id(self.fast), rid) in self.lists:
                    at = self.computed(rid) + n
                    for m in self.both:
                        held = self.lists[id(m), rid]
                        if len(held) == at:
                            held.append(token)
                        elif len(held) > at:
                            nexts[i] = held[at]
        return [_answer(self.commit, m, ids, counts, nexts) for m in self.both]

    def commit(self, m: HybridCacheManager, ids: list[str], counts: list[int], nexts: list[int | None]) -> None:
        (m.commit_step if m is self.fast else m._commit_each)(ids, counts, nexts)

    def check(self) -> None:
        """Both caches' integrity, and their counts, ids, free queues and usage equal."""
        views = []
        for m in self.both:
            m.check_integrity()
            views.append(
                (
                    [(r, m.num_computed_tokens(r), m.num_reserved_tokens(r), m.token_ids(r)) for r in m.request_ids],
                    m.pool.free_queue(),
                    m.usage(),
                )
            )
        assert views[0] == views[1]


OPS = st.lists(
    st.tuples(
        st.sampled_from(
            ["step", "admit", "mixed", "finish", "finish2", "preempt", "readmit", "fork", "reverse", "rollback"]
        ),
        st.integers(0, 7),
        st.integers(1, 40),
    ),
    max_size=40,
)


@pytest.mark.parametrize("shared", [False, True])  # (shared: admitted with share_ids)
@settings(max_examples=60, deadline=None)
@given(paged=st.booleans(), ops=OPS)
# (V4 steps whose reserved step is undone, named one off, or committed before the query)
@example(paged=False, ops=[("admit", 0, 20), ("admit", 0, 30), ("step", 1, 1), ("step", 0, 2), ("step", 1, 3)])
# (V4: a committed memo carried through a finish, after a decode step and after a mixed step)
@example(
    paged=False,
    ops=[("admit", 0, 20), ("admit", 0, 30), ("admit", 0, 12), ("step", 1, 4), ("finish", 1, 1), ("step", 0, 4)]
    + [("mixed", 0, 10), ("finish", 0, 3), ("step", 1, 8)],
)
# (V4: a row committed without its next token id stays while another leaves, and the next
# step does not give it: the carried reserve refuses it as the twin does)
@example(
    paged=False,
    ops=[("admit", 0, 20), ("admit", 0, 30), ("admit", 0, 12), ("step", 0, 3), ("finish", 2, 1), ("step", 1, 5)],
)
# (V4: two rows leave, then a carried reserve)
@example(
    paged=False,
    ops=[("admit", 0, 20), ("admit", 0, 30), ("admit", 0, 12), ("admit", 0, 9), ("step", 0, 4)]
    + [("finish2", 0, 1), ("step", 0, 4)],
)
# (paged: a step whose rows lack their next token ids is reserved inside the blocks, and
# refused at the commit by both)
@example(paged=True, ops=[("admit", 0, 1), ("mixed", 0, 1), ("step", 0, 5)])
# (V4: a mixed step's joiner admits its whole prompt without its next token id, or a part)
@example(
    paged=False,
    ops=[("admit", 0, 20), ("admit", 0, 30), ("step", 0, 4), ("mixed", 0, 11), ("step", 2, 5), ("step", 0, 4)]
    + [("mixed", 0, 12), ("step", 0, 4)],
)
def test_the_memo_agrees_with_the_naive_twins_through_lifecycles(paged: bool, ops: list, shared: bool) -> None:
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(coordinator, "MIN_ROWS_CARRIED", 1)  # (these small batches carry the memo too)
        _lifecycle(paged, ops, shared)


# V4 steady serving: a few rows decoding, some leaving (one or two at once), joiners (whole
# prompts or parts, with or without their next token id), steps that leave a row without its
# next token id: the carried memo's paths, which the wide lifecycle above draws rarely
SERVING = st.lists(
    st.tuples(
        st.sampled_from(["step", "step", "admit", "mixed", "finish", "finish2"]), st.integers(0, 7), st.integers(1, 40)
    ),
    min_size=4,
    max_size=30,
)


@pytest.mark.parametrize("shared", [False, True])
@settings(max_examples=60, deadline=None)
@given(prompts=st.lists(st.integers(1, 40), min_size=3, max_size=6), ops=SERVING)
def test_the_carried_memo_agrees_with_the_naive_twins_in_steady_serving(
    prompts: list[int], ops: list, shared: bool
) -> None:
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(coordinator, "MIN_ROWS_CARRIED", 1)  # (these small batches carry the memo too)
        _lifecycle(False, [("admit", 0, n) for n in prompts] + [("step", 0, 4), *ops], shared)


def _lifecycle(paged: bool, ops: list, shared: bool = False) -> None:
    t = _Twins(paged, shared)
    ids: list[str] = []  # the engine's list: one object all along, changed in place
    num_new = 0
    for op, who, n in ops:
        rid = ids[who % len(ids)] if ids else None
        if op == "admit" or (op == "readmit" and rid is not None):
            if op == "admit":
                num_new += 1
                rid = f"r{num_new}"
            else:  # released and admitted again under the same id, the list unchanged
                for m in t.both:
                    assert m.release(rid, "preempt") is True
            tokens = _ids(n, offset=num_new)
            admitted = [t.admit(m, rid, tokens) for m in t.both]
            assert admitted[0] == admitted[1]
            if admitted[0] is None:
                if op == "readmit":
                    ids.remove(rid)
            else:
                assert t.commit_both([rid], [admitted[0].num_scheduled_tokens], [n % 251]) == [None, None]
                if op == "admit":
                    ids.append(rid)
        elif op == "finish2" and len(ids) >= 2:
            # two rows leave between steps (the carried memo deletes both, in the order they left)
            other = ids[(who + 1) % len(ids)]
            for r in (other, rid) if n % 2 else (rid, other):
                for m in t.both:
                    assert m.release(r, "finish") is True
                ids.remove(r)
        elif op in ("finish", "preempt") and rid is not None:
            for m in t.both:
                assert m.release(rid, op) is True
            if n % 2:
                ids.remove(rid)
            else:  # the list still names it for a moment: the next step refuses it, nothing changed
                for m in t.both:
                    try:
                        m.reserve_step(ids, [1] * len(ids))
                    except KeyError as error:
                        assert repr(rid) in str(error)
                    else:
                        raise AssertionError("a released request's step was reserved")
                ids.remove(rid)
        elif op == "fork" and rid is not None:
            child = f"{rid}.{n}"
            if child not in t.fast:
                forked = [m.fork(rid, child) for m in t.both]
                assert forked[0] == forked[1]
                if forked[0]:
                    ids.append(child)
        elif op == "mixed" and ids:
            # the decodes reserved, a newcomer admitted, one commit of both (its memo: every row)
            num_new += 1
            rid = f"r{num_new}"
            for m in t.both:
                for r in ids:
                    if t.known(m, r) == t.computed(r):
                        t.append(m, r, n)
            fits = [m.reserve_step(ids, [1] * len(ids)) for m in t.both]
            assert fits[0] == fits[1]
            if fits[0]:
                # n % 3 == 0: a part of the prompt (its next id the prompt's); else all of it,
                # n odd: its sampled token id not given (a hole among the memo's rows)
                budget = n // 2 if n % 3 == 0 else None
                admitted = [t.admit(m, rid, _ids(n, offset=num_new), budget) for m in t.both]
                assert admitted[0] == admitted[1]
                step_ids = [*ids, rid] if admitted[0] is not None else list(ids)
                counts = [1] * len(ids) + ([admitted[0].num_scheduled_tokens] if admitted[0] is not None else [])
                joiner: list[int | None] = []
                if admitted[0] is not None:
                    whole = t.computed(rid) + admitted[0].num_scheduled_tokens == n
                    joiner = [None if not whole or n % 2 else n % 251]
                assert t.commit_both(step_ids, counts, [n % 251] * len(ids) + joiner) == [None, None]
                if admitted[0] is not None:
                    ids.append(rid)
        elif op == "reverse":
            ids.reverse()
        elif op == "rollback" and rid is not None and paged and (id(t.fast), rid) not in t.lists:
            to = t.fast.num_computed_tokens(rid) - n % 5
            if to >= 0:
                for m in t.both:
                    m.rollback(rid, to)
        elif op == "step" and ids:
            for repeat in range(1 + n % 3):  # unchanged batches: the memo's hits
                for m in t.both:
                    for r in ids:
                        # n % 5 == 0: the first step gives no row without its next token id
                        # one (the holes stay): both refuse the step, nothing changed
                        if t.known(m, r) == t.computed(r) and (n % 5 or repeat):
                            t.append(m, r, n)
                fits = [_answer(m.reserve_step, ids, [1] * len(ids)) for m in t.both]
                assert fits[0] == fits[1]
                t.check()
                if fits[0] is not True:
                    break
                starts = [t.computed(r) for r in ids]
                ends = [s + 1 for s in starts]
                if n % 4 == 1 and not paged:  # a row's reserved step undone (V4 can) before the query: refused
                    for m in t.both:
                        m.unreserve(rid)
                    t.check()
                    _same_answer(t, tuple(ids), starts, ends)
                    for m in t.both:  # reserved again: the same step as before
                        assert m.reserve_step([rid], [1])
                    t.check()
                if n % 4 == 2:  # a row's start named one off: both refuse it
                    off = list(starts)
                    off[who % len(ids)] -= 1
                    _same_answer(t, tuple(ids), off, ends)
                # the runner passes a tuple of the same ids
                assert t.fast.step_reservations(tuple(ids), starts, ends) == t.twin.step_reservations(
                    tuple(ids), starts, ends
                )
                # (a step with no None: the next step's reserve reads the committed memo)
                nexts = [None if n % 2 and (i + n) % 4 == 0 else n for i in range(len(ids))]
                # Paged, n % 5 == 0: a decode inside its block is reserved without its token id
                # (reserve_step checks ids only where blocks are taken): the commit refuses the
                # row without one, in both, nothing changed
                done = t.commit_both(ids, [1] * len(ids), nexts)
                assert done[0] == done[1]
                t.check()
                if done[0] is not None:
                    assert paged and not n % 5 and not repeat
                    break
                if n % 4 == 3:  # the committed step asked about again: its rows are not reserved now
                    _same_answer(t, tuple(ids), starts, ends)
        t.check()


def _answer(call: object, *args: object) -> object:
    """The call's result, or its error's type and message."""
    try:
        return call(*args)  # type: ignore[operator]
    except (KeyError, ValueError) as error:
        return f"{type(error).__name__}: {error}"


def _same_answer(t: _Twins, ids: tuple[str, ...], starts: list[int], ends: list[int]) -> None:
    """step_reservations of both caches: the same reservations, or the same error."""
    answers = []
    for m in t.both:
        try:
            answers.append(m.step_reservations(ids, starts, ends))
        except (KeyError, ValueError) as error:
            answers.append((type(error), str(error)))
    assert answers[0] == answers[1]


def test_the_reserved_step_memo_is_dropped_wherever_counts_move() -> None:
    # `step_reservations` answers the step `_reserve_decodes` reserved from its memo, which
    # holds while no request's `end` or `num_computed` moved: every function of the
    # coordinator that writes either drops the memo before its first write
    tree = ast.parse(inspect.getsource(coordinator))
    writers = {}
    for func in ast.walk(tree):
        if not isinstance(func, ast.FunctionDef):
            continue
        first_write = first_drop = None
        for node in ast.walk(func):
            pairs: list[tuple[ast.expr, ast.expr | None]] = []  # (target, its value where known)
            if isinstance(node, ast.Assign):
                for target in node.targets:
                    if isinstance(target, ast.Tuple) and isinstance(node.value, ast.Tuple):
                        pairs += zip(target.elts, node.value.elts, strict=False)
                    else:
                        pairs += [(t, node.value) for t in (target.elts if isinstance(target, ast.Tuple) else [target])]
            elif isinstance(node, ast.AugAssign):
                pairs = [(node.target, None)]
            for t, value in pairs:
                if isinstance(t, ast.Attribute) and t.attr in ("end", "num_computed"):
                    first_write = min(first_write or node.lineno, node.lineno)
                if ast.unparse(t) == "self._decode_step" and isinstance(value, ast.Constant) and value.value is None:
                    first_drop = min(first_drop or node.lineno, node.lineno)
        if first_write is not None:
            writers[func.name] = first_drop is not None and first_drop < first_write
    assert len(writers) >= 11 and "_reserve_decodes" in writers, sorted(writers)
    assert [name for name, dropped in writers.items() if not dropped] == []


def test_the_reserved_step_memo_answers_as_the_loop() -> None:
    # A decode step on the V4 cache (span 16): r0's step ends on the span (a block, asked
    # about), r1's does not. The memo's answer equals the loop's (the memo dropped by hand);
    # any other starts or ends, or the step committed, go to the loop, which names the row
    m = DSV4CacheManager(SPEC, 12, 4, DESC)
    for rid, n in (("r0", 15), ("r1", 6)):
        assert m.admit(rid, _ids(n)) is not None
        m.commit_step([rid], [n], [1])
    ids = ["r0", "r1"]
    assert m.reserve_step(ids, [1, 1])
    assert m._decode_step is not None and [r.request_id for r in m._decode_step[2]] == ["r0"]
    m.check_integrity()
    fast = m.step_reservations(tuple(ids), [15, 6], [16, 7])
    assert list(fast) == ["r0"] and (fast["r0"].start, fast["r0"].num_tokens) == (15, 1)
    assert fast["r0"].groups["v4"].new_block_ids  # r0's step took its span's next block
    memo, m._decode_step = m._decode_step, None
    assert m.step_reservations(tuple(ids), [15, 6], [16, 7]) == fast
    m._decode_step = memo
    for starts, ends, bad in (([15, 5], [16, 7], "'r1': positions \\[5, 7\\)"), ([15, 6], [16, 8], "'r1'")):
        with pytest.raises(ValueError, match=bad):
            m.step_reservations(tuple(ids), starts, ends)
    m.commit_step(ids, [1, 1], [2, 2])
    assert m._decode_step is not None and m._decode_step[3] is False  # committed: no step to ask about
    with pytest.raises(ValueError, match="'r0': positions \\[15, 16\\) are not its reserved step \\[16, 16\\)"):
        m.step_reservations(tuple(ids), [15, 6], [16, 7])
    m.check_integrity()
    # the next step's reserve from the committed memo: the same ends and blocks as the loop's
    assert m.reserve_step(ids, [1, 1])
    # (its starts: the committed memo's ends)
    assert m._decode_step is not None and m._decode_step[1:5] == ([17, 8], [], True, [16, 7])
    assert [m.num_reserved_tokens(r) for r in ids] == [17, 8]
    m.check_integrity()
    # its starts are compared as a list (no subtraction a row): a wrong one still goes to the loop
    memo, m._decode_step = m._decode_step, None
    loop = m.step_reservations(tuple(ids), [16, 7], [17, 8])
    m._decode_step = memo
    assert m.step_reservations(tuple(ids), [16, 7], [17, 8]) == loop
    with pytest.raises(ValueError, match="'r1': positions \\[6, 8\\)"):
        m.step_reservations(tuple(ids), [16, 6], [17, 8])
    m.commit_step(ids, [1, 1], [3, None])  # r1's next token id not given: the memo vouches for r0 only
    assert m._decode_step is not None and m._decode_step[5] == ["r1"]
    m.check_integrity()
    with pytest.raises(ValueError, match="'r1'.* token ids are known"):  # (r0 moved from the memo, undone)
        m.reserve_step(ids, [1, 1])
    assert [m.num_reserved_tokens(r) for r in ids] == [17, 8]
    m.check_integrity()


def _fresh_lookup(m: HybridCacheManager, ids: list[str]) -> list[object]:
    return [m._requests[r] for r in ids]


def test_the_memo_is_carried_through_rows_that_leave_and_join(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(coordinator, "MIN_ROWS_CARRIED", 1)  # (a few rows carry the memo too)
    # Steady serving on the paged cache: between two steps r1 finishes and r4 joins at the
    # end. The step's ids are the memo's less r1 plus r4: its requests come from the memo
    # (r1's row deleted, r4 looked up), the ids known distinct without a count
    m = FullAttentionManager(40, 4, DESC)
    for i in range(4):
        assert m.admit(f"r{i}", _ids(6, i)) is not None
        m.commit_step([f"r{i}"], [6], [1])
    ids = ["r0", "r1", "r2", "r3"]
    assert m.reserve_step(ids, [1] * 4)
    m.commit_step(ids, [1] * 4, [2] * 4)
    assert m._resolved_distinct is True and m._left == []
    m.release("r1")
    assert m._left == ["r1"] and [r.request_id for r in m._resolved] == ids  # (held until the next step)
    assert m.admit("r4", _ids(3)) is not None
    ids = ["r0", "r2", "r3", "r4"]
    assert m._resolve_changed(ids) == (_fresh_lookup(m, ids), True, ids)
    assert m.first_off_step(ids, [7, 7, 7, 0], [8, 8, 8, 3]) is None
    assert m._resolved == _fresh_lookup(m, ids) and m._left == [] and m._resolved_distinct is True
    m.commit_step(ids, [1, 1, 1, 3], [3, 3, 3, 3])
    assert [m.num_computed_tokens(r) for r in ids] == [8, 8, 8, 3]
    m.check_integrity()
    # a step of the rows that stay, none joining: carried alike
    m.release("r0")
    decodes = ["r2", "r3", "r4"]
    assert m.reserve_step(decodes, [1, 1, 1])
    assert m._resolve_changed(decodes) == (_fresh_lookup(m, decodes), True, decodes)
    assert m.first_off_step(decodes, [8, 8, 3], [9, 9, 4]) is None
    assert m._resolved == _fresh_lookup(m, decodes) and m._left == []
    m.commit_step(decodes, [1, 1, 1], [4, 4, 4])
    assert [m.num_computed_tokens(r) for r in decodes] == [9, 9, 4]
    m.check_integrity()


def test_the_committed_decode_memo_is_carried_through_a_changed_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(coordinator, "MIN_ROWS_CARRIED", 1)  # (a few rows carry the memo too)

    # V4 steady serving: a decode step's committed memo stays while r1 finishes (its row is
    # known to have left by `_left`), and the next step's reserve moves the rows that stay
    # from it, unchecked (its starts: the memo's ends); a mixed step (r3's prompt beside the
    # decodes) commits a memo of all its rows, carried alike when r2 then finishes, with
    # r4 joined after it checked. Each reserve equals the naive twin's (the memo dropped:
    # every row checked) in ends, pools and the next query; a row after the carried ones
    # that is at fault (named twice, unknown) changes nothing
    def build() -> HybridCacheManager:
        m = DSV4CacheManager(SPEC, 16, 6, DESC)
        for i, n in enumerate((15, 6, 9)):
            assert m.admit(f"r{i}", _ids(n, i)) is not None
            m.commit_step([f"r{i}"], [n], [1])
        ids = ["r0", "r1", "r2"]
        assert m.reserve_step(ids, [1] * 3)
        m.commit_step(ids, [1] * 3, [2] * 3)
        assert m._decode_step is not None and m._decode_step[1] == [16, 7, 10]  # committed: computed to
        m.release("r1")
        assert m._decode_step is not None and m._left == ["r1"]  # (kept: r1's row is known gone)
        m.check_integrity()
        return m

    def view(m: HybridCacheManager, ids: list[str], reserved: bool = True) -> tuple:
        starts = [m.num_computed_tokens(r) for r in ids]
        return (
            [(r, m.num_computed_tokens(r), m.num_reserved_tokens(r)) for r in m.request_ids],
            m.pool.free_queue(),
            m.step_reservations(ids, starts, [s + 1 for s in starts]) if reserved else None,
        )

    def mixed_then_r2_leaves(m: HybridCacheManager, r4_budget: int | None = 0) -> None:
        ids = ["r0", "r2"]
        assert m.reserve_step(ids, [1, 1])
        assert m.admit("r3", _ids(20, 3)) is not None
        m.commit_step([*ids, "r3"], [1, 1, 20], [3, 3, 3])
        m.check_integrity()
        assert m._decode_step is not None and m._decode_step[1] == [17, 11, 20]
        m.release("r2")
        # r4 joins (0: no step reserved, it decodes its prompt next; None: its prompt's step
        # reserved); an admission keeps the memo
        assert m.admit("r4", _ids(5, 4), r4_budget) is not None
        assert m._decode_step is not None
        m.check_integrity()

    fast, twin = build(), build()
    twin._decode_step = None
    ids = ["r0", "r2"]
    for m in (fast, twin):
        assert m.reserve_step(ids, [1, 1])
        m.check_integrity()
    assert fast._decode_step is not None and fast._decode_step[1:5] == ([17, 11], [], True, [16, 10])
    assert view(fast, ids) == view(twin, ids)
    fast, twin = build(), build()
    for m in (fast, twin):
        mixed_then_r2_leaves(m)
    twin._decode_step = None
    ids = ["r0", "r3", "r4"]
    for m in (fast, twin):
        assert m.reserve_step(ids, [1, 1, 1])  # (r0 and r3 carried, r4 checked)
        m.check_integrity()
    assert fast._decode_step is not None and fast._decode_step[1:5] == ([18, 21, 1], [], True, None)
    assert view(fast, ids) == view(twin, ids)
    cases = [(["r0", "r3", "r0"], 0, "appears twice"), (["r0", "r3", "r9"], 0, "'r9'")]
    cases.append((ids, None, "'r4' already has an uncommitted reservation"))
    for bad, budget, error in cases:
        fast = build()
        mixed_then_r2_leaves(fast, budget)
        before = view(fast, ["r0", "r3"], reserved=False)
        with pytest.raises((KeyError, ValueError), match=error):
            fast.reserve_step(bad, [1] * len(bad))
        assert view(fast, ["r0", "r3"], reserved=False) == before
        fast.check_integrity()
    fast = build()
    mixed_then_r2_leaves(fast)
    # a query of other rows makes them `_resolve`'s: the log of the rows that left goes, the memo with it
    assert fast.first_off_step(["r4"], [0], [1]) == 0  # (r4 has no step reserved)
    assert fast._decode_step is None
    fast.check_integrity()


def _three_reserved() -> tuple[FullAttentionManager, list[str]]:
    """Three requests with 6 tokens computed each, a decode step of theirs reserved."""
    m = FullAttentionManager(40, 4, DESC)
    for i in range(3):
        assert m.admit(f"r{i}", _ids(6, i)) is not None
        m.commit_step([f"r{i}"], [6], [1])
    ids = ["r0", "r1", "r2"]
    assert m.reserve_step(ids, [1] * 3)
    return m, ids


def test_a_carried_memo_refuses_what_the_lookup_refuses(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(coordinator, "MIN_ROWS_CARRIED", 1)  # (a few rows carry the memo too)
    # A new row names a request twice, or one unknown, or a request released and admitted
    # again under its old id in its old place: each is refused as the naive twin refuses
    # it (nothing changed), or looked up anew, never answered from a stale memo
    m, ids = _three_reserved()
    m.commit_step(ids, [1] * 3, [2] * 3)
    assert m.admit("r3", _ids(3)) is not None
    with pytest.raises(ValueError, match="appears twice"):
        m.commit_step([*ids, "r3", "r3"], [1, 1, 1, 3, 3], [2] * 5)
    with pytest.raises(ValueError, match="appears twice"):  # an old row named again at the end
        m.commit_step([*ids, "r0"], [1, 1, 1, 1], [2] * 4)
    with pytest.raises(KeyError, match="'r9'"):
        m.commit_step([*ids, "r9"], [1, 1, 1, 1], [2] * 4)
    assert [m.num_computed_tokens(r) for r in [*ids, "r3"]] == [7, 7, 7, 0]
    m.check_integrity()
    # r1 preempted and admitted again at once, the list unchanged: the new r1 is looked up
    m.release("r1", "preempt")
    assert m.admit("r1", _ids(2)) is not None
    assert m._resolve_changed(ids) is None
    assert m._resolve(ids) == _fresh_lookup(m, ids)
    m.check_integrity()


def test_a_busy_cache_lets_go_of_the_memo_after_many_leave() -> None:
    # The memo holds the requests that left since it was made: at most MAX_LEFT_CARRIED
    m = FullAttentionManager(400, 4, DESC)
    n = coordinator.MAX_LEFT_CARRIED + 2
    ids = [f"r{i}" for i in range(n)]
    for i, rid in enumerate(ids):
        assert m.admit(rid, _ids(4, i)) is not None
        m.commit_step([rid], [4], [1])
    assert m.reserve_step(ids, [1] * n)
    m.commit_step(ids, [1] * n, [2] * n)
    assert len(m._resolved) == n
    for rid in ids[: coordinator.MAX_LEFT_CARRIED]:
        m.release(rid)
    assert len(m._left) == coordinator.MAX_LEFT_CARRIED and len(m._resolved) == n
    m.release(ids[-2])
    assert m._left is None and m._resolved == []
    assert m.reserve_step(ids[-1:], [1]) and m.first_off_step(ids[-1:], [5], [6]) is None
    assert m._resolved == _fresh_lookup(m, ids[-1:])
    m.check_integrity()


def test_a_release_lets_go_of_the_memos_requests() -> None:
    # An idle replica must not keep its last batch's finished requests (their token lists)
    # alive through the memo
    m = DSV4CacheManager(SPEC, 12, 4, DESC)
    assert m.admit("r0", _ids(10)) is not None
    m.commit_step(["r0"], [10], [1])
    ids = ["r0"]
    assert m.reserve_step(ids, [1])
    m.commit_step(ids, [1], [2])
    assert [r.request_id for r in m._resolved] == ["r0"]
    m.release("r0")
    assert m._resolved == []
    m.check_integrity()


def test_a_memo_let_go_forgets_whether_its_ids_were_distinct() -> None:
    # A step that names a request twice is refused and leaves the memo's ids not distinct;
    # when the last request leaves, the memo lets go of its ids, and of that answer with them
    # (check_integrity holds the answer to the ids it describes)
    m = FullAttentionManager(13, 4, DESC)
    for rid, base in (("a", 0), ("b", 20)):
        assert m.admit(rid, list(range(base, base + 6))) is not None
        m.commit(rid, 6)
        m.append_token_ids(rid, [7])
    m.check_integrity()
    with pytest.raises(ValueError, match="appears twice"):
        m.commit_step(["a", "a"], [2, 0], [None, None])
    assert m._resolved_distinct is False
    m.check_integrity()
    m.release("a")
    m.check_integrity()
    m.release("b")
    assert m._resolved_list == [] and m._resolved_distinct is None
    m.check_integrity()


def _build_committed(rows: tuple[int, ...], nexts: list[int | None]) -> HybridCacheManager:
    """A V4 cache whose requests r0.. (prompts of `rows` tokens, computed) ran one decode
    step, committed with `nexts` (None: that row's next token id not given)."""
    m = DSV4CacheManager(SPEC, 16, 8, DESC)
    ids = [f"r{i}" for i in range(len(rows))]
    for i, n in enumerate(rows):
        assert m.admit(ids[i], _ids(n, i)) is not None
        m.commit_step([ids[i]], [n], [1])
    assert m.reserve_step(ids, [1] * len(ids))
    m.commit_step(ids, [1] * len(ids), nexts)
    assert m._decode_step is not None and not m._decode_step[3]  # (the committed memo)
    return m


def _reserve_twins(fast: HybridCacheManager, twin: HybridCacheManager, ids: list[str]) -> object:
    """reserve_step of `ids` on the cache with its committed memo and on its twin without one
    (every row checked): the same result or error, the same state, both intact."""
    twin._decode_step = None
    answers = []
    for m in (fast, twin):
        try:
            answers.append(m.reserve_step(ids, [1] * len(ids)))
        except (KeyError, ValueError) as error:
            answers.append(f"{type(error).__name__}: {error}")
        m.check_integrity()
    assert answers[0] == answers[1]
    views = [
        ([(r, m.num_computed_tokens(r), m.num_reserved_tokens(r), m.token_ids(r)) for r in m.request_ids], m.usage())
        for m in (fast, twin)
    ]
    assert views[0] == views[1]
    return answers[0]


def test_a_row_without_its_next_token_that_stays_is_checked_on_a_carried_reserve(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(coordinator, "MIN_ROWS_CARRIED", 1)  # (a few rows carry the memo too)
    # r1's next token id is not given (a hole) but r1 stays; r2 leaves, so the next reserve
    # carries the memo. Without r1's token its step cannot be reserved: the carried path
    # must check r1 as the twin does, not move it unchecked as a row with its token
    fast, twin = (_build_committed((15, 6, 9), [2, None, 2]) for _ in range(2))
    for m in (fast, twin):
        m.release("r2")
    answer = _reserve_twins(fast, twin, ["r0", "r1"])
    assert (
        answer == "ValueError: request 'r1': cannot compute 1 tokens from 7: only 7 token ids are known "
        "(append_token_ids first)"
    )
    # given its token, r1's step is reserved (checked), r0's carried
    for m in (fast, twin):
        m.append_token_ids("r1", [5])
    assert _reserve_twins(fast, twin, ["r0", "r1"]) is True
    assert [fast.num_reserved_tokens(r) for r in ("r0", "r1")] == [17, 8]


def test_several_rows_that_leave_are_deleted_from_the_carried_memo_in_order(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(coordinator, "MIN_ROWS_CARRIED", 1)  # (a few rows carry the memo too)
    # Five rows of distinct ends; r1 then r3 finish (and, in another order, r3 then r1):
    # the carried memo deletes their rows in the order they left, so each row that stays
    # keeps its own end (deleting in another order moves r2's or r4's end onto another row)
    rows = (15, 6, 9, 20, 3)
    for leaving in (("r1", "r3"), ("r3", "r1"), ("r0", "r1", "r4")):
        fast, twin = (_build_committed(rows, [2] * 5) for _ in range(2))
        for m in (fast, twin):
            for r in leaving:
                m.release(r)
        stay = [f"r{i}" for i in range(5) if f"r{i}" not in leaving]
        assert _reserve_twins(fast, twin, stay) is True
        assert [fast.num_reserved_tokens(r) for r in stay] == [rows[int(r[1:])] + 2 for r in stay]


def test_a_new_rows_hole_in_a_mixed_step_is_checked_by_the_next_reserve(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(coordinator, "MIN_ROWS_CARRIED", 1)  # (a few rows carry the memo too)

    # A mixed step: r0 and r1 decode, r3 joins with a prompt chunk. Its whole prompt (its
    # next token id the sampled one, here not given: a hole) or part of it (budget 12: the
    # prompt's next id is known, no hole)
    def build(budget: int | None) -> HybridCacheManager:
        m = _build_committed((15, 6), [2, 2])
        assert m.reserve_step(["r0", "r1"], [1, 1])
        admitted = m.admit("r3", _ids(20, 3), budget)
        assert admitted is not None
        m.commit_step(["r0", "r1", "r3"], [1, 1, admitted.num_scheduled_tokens], [3, 3, None])
        m.check_integrity()
        return m

    fast, twin = build(None), build(None)
    answer = _reserve_twins(fast, twin, ["r0", "r1", "r3"])
    assert (
        answer == "ValueError: request 'r3': cannot compute 1 tokens from 20: only 20 token ids are known "
        "(append_token_ids first)"
    )
    fast, twin = build(12), build(12)
    assert fast.num_computed_tokens("r3") == 12
    assert _reserve_twins(fast, twin, ["r0", "r1", "r3"]) is True
    assert [fast.num_reserved_tokens(r) for r in ("r0", "r1", "r3")] == [18, 9, 13]


def test_the_memos_tuple_is_made_when_a_tuple_is_first_compared_with_it() -> None:
    # A step's ids are kept as a list of the memo's own; the tuple (the runner's
    # step_reservations of chunks that are not the engine's columns) only once one comes:
    # a copy touches every id's string, and the engine's decode steps pass lists alone
    m, ids = _three_reserved()
    m.commit_step(ids, [1] * 3, [2] * 3)  # (the decode commit resolves the step's ids)
    assert m._resolved_list == ids and m._resolved_list is not ids and m._resolved_tuple is None
    m.check_integrity()
    assert m._resolve(tuple(ids)) is m._resolved and m._resolved_tuple == tuple(ids)
    m.check_integrity()
    assert m._resolve(("r0", "r2")) == _fresh_lookup(m, ["r0", "r2"])  # (another step's: looked up)
    assert m._resolved_list == ["r0", "r2"] and m._resolved_tuple is None
    assert m.reserve_step(ids, [1] * 3)
    m.commit_step(ids, [1] * 3, [3] * 3)
    assert [m.num_computed_tokens(r) for r in ids] == [8, 8, 8] and m._resolved_list == ids
    m.check_integrity()
