"""Deterministic token ids for simulated text: the answers a simulated model "samples" and
the synthetic prompts of the workloads. The same request id gives the same answer, so a
later turn of a session (whose prompt carries the earlier answers) hits its own history."""

from __future__ import annotations

import hashlib

_MULT = 0x9E3779B97F4A7C15  # odd 64-bit constant: position -> a well-spread stream
_MASK = (1 << 64) - 1


def stream_key(name: str) -> int:
    """A stable 64-bit key for a name (not Python's hash: that changes per process)."""
    return int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little")


def token_at(key: int, position: int, vocab_size: int) -> int:
    """Token `position` of the stream `key`, in [0, vocab_size)."""
    x = (key + (position + 1) * _MULT) & _MASK
    x ^= x >> 31
    x = (x * 0xBF58476D1CE4E5B9) & _MASK
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
