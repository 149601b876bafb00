"""Deterministic token ids for simulated text: the answers a simulated model "samples" and
the synthetic prompts of the workloads. The same request id gives the same answer, so a
later turn of a session (whose prompt carries the earlier answers) hits its own history."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

# token_at's constants (sim/executor.py AnswerSampler inlines it)
STREAM_MULT = 0x9E3779B97F4A7C15  # odd 64-bit constant: position -> a well-spread stream
STREAM_MIX = 0xBF58476D1CE4E5B9
MASK64 = (1 << 64) - 1


def stream_key(name: str) -> int:
    """A stable 64-bit key for a name (not Python's hash: that changes per process)."""
    return int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little")


def token_at(key: int, position: int, vocab_size: int) -> int:
    """Token `position` of the stream `key`, in [0, vocab_size)."""
    x = (key + (position + 1) * STREAM_MULT) & MASK64
    x ^= x >> 31
    x = (x * STREAM_MIX) & MASK64
    x ^= x >> 29
    return x % vocab_size


def answer_ids(request_id: str, num_tokens: int, vocab_size: int) -> list[int]:
    """The answer of `request_id`: what the simulated model samples, token by token."""
    key = stream_key(request_id)
    return [token_at(key, i, vocab_size) for i in range(num_tokens)]


def text_ids(name: str, num_tokens: int, vocab_size: int) -> list[int]:
    """Synthetic prompt text named `name` (a system prompt, a user message, a shared document):
    the same name gives the same tokens, different names share no prefix (almost surely)."""
    return answer_ids(f"text:{name}", num_tokens, vocab_size)


# token_at's constants in uint64 (wrapping) arithmetic: the vectorised twins below
_MULT_U64 = np.uint64(STREAM_MULT)
_MIX_U64 = np.uint64(STREAM_MIX)
_SHIFT_31, _SHIFT_29 = np.uint64(31), np.uint64(29)
_CHUNK = 1 << 20  # tokens per vectorised pass in batch_text_ids
# (p + 1) x STREAM_MULT for p in [0, _STEP_ROWS), wrapping: token_at's first term, read for a
# stream's positions instead of made (an arange and a product); 512 KiB, never written
_STEP_ROWS = 1 << 16
_STEPS = np.arange(1, _STEP_ROWS + 1, dtype=np.uint64) * _MULT_U64
_STEPS.flags.writeable = False
_FEW_STREAMS = 64  # streams at most that take the slices of _STEPS (a slice each, in Python)


def stream_tokens(keys: Sequence[int], lens: Sequence[int], vocab_size: int) -> np.ndarray:
    """token_at(keys[i], p, vocab_size) for p in range(lens[i]), the streams end to end:
    [sum(lens)] uint64. A few streams (a request's answer, a session's messages, the rows
    that join a step: called once for each) within _STEP_ROWS tokens each start from the
    slices of `_STEPS` (`_few_streams`); the general path makes the positions' terms."""
    if len(keys) <= _FEW_STREAMS:
        x = _few_streams(keys, lens)
        if x is not None:
            return mix_tokens(x, vocab_size)
    if len(keys) == 1:  # one stream (a turn's answer): positions 1.. n at once, no repeat of keys
        x = np.arange(1, int(lens[0]) + 1, dtype=np.uint64)
        x *= _MULT_U64
        x += np.uint64(keys[0])  # (wrapping uint64: the same sum in the other order)
        return mix_tokens(x, vocab_size)
    lens_arr = np.asarray(lens, dtype=np.int64)
    firsts = np.cumsum(lens_arr) - lens_arr  # flat index of each stream's token 0
    positions = np.arange(int(lens_arr.sum()), dtype=np.int64) - np.repeat(firsts, lens_arr)
    x = np.repeat(np.asarray(keys, dtype=np.uint64), lens_arr)
    x += (positions.astype(np.uint64) + np.uint64(1)) * _MULT_U64
    return mix_tokens(x, vocab_size)


def mix_tokens(x: np.ndarray, vocab_size: int) -> np.ndarray:
    """token_at's rounds after its first term, in place: x [n] uint64 holds key + (p + 1) x
    STREAM_MULT (wrapping) of each token wanted; returns x, each now token_at(key, p,
    vocab_size). The one copy of the streams' finish (`stream_tokens`' paths, the simulator's
    batch sampler)."""
    x ^= x >> _SHIFT_31
    x *= _MIX_U64
    x ^= x >> _SHIFT_29
    x %= np.uint64(vocab_size)
    return x


def _few_streams(keys: Sequence[int], lens: Sequence[int]) -> np.ndarray | None:
    """key + (p + 1) x STREAM_MULT (wrapping) of every stream's positions, end to end: the
    `_STEPS` slices of their lengths (one for one stream) with each stream's key added, a
    new array; None where a length is past _STEP_ROWS or negative (the general path then
    makes them, or raises)."""
    if len(keys) != len(lens):
        return None  # (the general path's error)
    if len(keys) == 1:
        n = int(lens[0])
        return _STEPS[:n] + np.uint64(keys[0]) if 0 <= n <= _STEP_ROWS else None
    ns = [int(n) for n in lens]
    if not ns or min(ns) < 0 or max(ns) > _STEP_ROWS:
        return None
    x = np.repeat(np.asarray(keys, dtype=np.uint64), ns)
    x += np.concatenate([_STEPS[:n] for n in ns])
    return x


def int_table(vocab_size: int) -> np.ndarray:
    """[vocab_size] object: the Python ints 0 .. vocab_size - 1, one object each, for
    batch_text_ids to share (building it costs about 2 ms at a 128k vocabulary: a caller
    that makes prompts one session at a time builds it once)."""
    return np.arange(vocab_size).astype(object)


def batch_text_ids(
    names: Sequence[str], lens: Sequence[int], vocab_size: int, table: np.ndarray | None = None
) -> list[tuple[int, ...]]:
    """[tuple(text_ids(name, n, vocab_size)) for name, n in zip(names, lens)], vectorised.
    The ints are shared objects from one table of the vocabulary (`table`: int_table(
    vocab_size), made here when None): a workload of 20M prompt tokens then holds 20M
    pointers (8 bytes each), not 20M int objects (28 bytes more each)."""
    if len(names) != len(lens):
        raise ValueError(f"names and lens differ in length: {len(names)} != {len(lens)}")
    if table is None:
        table = int_table(vocab_size)
    elif len(table) != vocab_size:
        raise ValueError(f"table holds {len(table)} ints, not the vocabulary's {vocab_size}")
    out: list[tuple[int, ...]] = []
    first = 0
    while first < len(names):
        # streams [first, last) hold about _CHUNK tokens: the uint64 temporaries stay small
        last, total = first + 1, lens[first]
        while last < len(names) and total + lens[last] <= _CHUNK:
            total += lens[last]
            last += 1
        keys = [stream_key(f"text:{name}") for name in names[first:last]]
        shared = table[stream_tokens(keys, lens[first:last], vocab_size).astype(np.intp)].tolist()
        start = 0
        for n in lens[first:last]:
            out.append(tuple(shared[start : start + n]))
            start += n
        first = last
    return out


def batch_answer_ids(request_ids: Sequence[str], lens: Sequence[int], vocab_size: int) -> list[list[int]]:
    """[answer_ids(rid, n, vocab_size) for rid, n in zip(request_ids, lens)], vectorised."""
    if len(request_ids) != len(lens):
        raise ValueError(f"request_ids and lens differ in length: {len(request_ids)} != {len(lens)}")
    flat = stream_tokens([stream_key(rid) for rid in request_ids], lens, vocab_size).tolist()
    out = []
    start = 0
    for n in lens:
        out.append(flat[start : start + n])
        start += n
    return out
