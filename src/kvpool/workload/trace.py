"""Replay a JSONL request trace as a workload (the format: docs/SIM_TRACE.md).

One request a line: its arrival (`timestamp` in seconds or `timestamp_ms`), its prompt
(`prompt_ids`, or `hash_ids` + `input_length` as public prefix-cache traces such as
Mooncake's write it: one id per block of `block_size` tokens, equal ids at the same position
= shared content) and its `output_length`; optionally `session` and `tenant`. Each line
becomes a single-turn session. Loading is all or nothing: the first bad line raises a
ValueError naming the file, the line and the field, and no workload comes back.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from importlib.resources import files
from pathlib import Path

from kvpool.workload.sessions import Session, Turn, Workload
from kvpool.workload.tokens import batch_text_ids

FIELDS = frozenset(
    {"timestamp", "timestamp_ms", "prompt_ids", "hash_ids", "input_length", "output_length", "session", "tenant"}
)

# The latest arrival a trace may give, seconds: below 2^33 s a float second's step (ulp) is
# under a microsecond (2^-20 s), so a step of a few ms is timed to 0.1 % or better. Unix epoch
# seconds (~1.8e9) pass; epoch ms or ns read as seconds (~1.8e12, 1.8e18) do not.
MAX_START_S = float(2**33)


def sample_trace_path() -> Path:
    """The small trace that ships with kvpool (workload/data/sample_trace.jsonl)."""
    return Path(str(files("kvpool").joinpath("workload/data/sample_trace.jsonl")))


@dataclass(frozen=True, slots=True)
class _Line:
    """One checked trace line; exactly one of prompt_ids / hash_ids is set."""

    line_no: int
    start_s: float
    prompt_ids: tuple[int, ...] | None
    hash_ids: tuple[int, ...] | None
    input_len: int
    output_len: int
    session: str | None
    tenant: str


def load_trace(path: str | os.PathLike[str], vocab_size: int, *, block_size: int = 512) -> Workload:
    """The trace at `path` as a workload of single-turn sessions, sorted by arrival (stable:
    equal arrivals keep file order). Hash id h stands for text_ids(f"hash{h}", block_size)."""
    if type(vocab_size) is not int or vocab_size < 1:
        raise ValueError(f"vocab_size must be an integer >= 1, got {vocab_size!r}")
    if type(block_size) is not int or block_size < 1:
        raise ValueError(f"block_size must be an integer >= 1, got {block_size!r}")
    try:
        # (utf-8-sig: a leading byte-order mark, which Windows editors write and JSON readers
        # may ignore (RFC 8259 section 8.1), is dropped; it made line 1 "not JSON")
        raw = Path(path).read_bytes()
        text = raw.decode("utf-8-sig")
    except FileNotFoundError:
        raise ValueError(f"{path}: no such trace file") from None
    except UnicodeDecodeError as e:  # (it said Python's "'utf-8' codec can't decode byte 0xff in position 14")
        start = e.start + 3 * raw.startswith(b"\xef\xbb\xbf")  # (utf-8-sig counts past its mark)
        line = raw.count(b"\n", 0, start) + 1
        raise ValueError(f"{path}: the trace is not UTF-8 text ({e.reason} at byte {start}, line {line})") from None
    except OSError as e:
        raise ValueError(f"{path}: cannot read the trace ({e.strerror or e})") from None

    lines: list[_Line] = []
    # (split at "\n" only: str.splitlines also cuts at U+2028, U+0085, \x0b, \x0c..., which
    # JSON allows raw inside a string, so a valid line was "not JSON" and the lines after it
    # were counted off their physical numbers; a trailing "\r" is JSON whitespace)
    for line_no, raw in enumerate(text.split("\n"), start=1):
        if not raw.strip():
            continue
        try:
            lines.append(_parse(raw, line_no, vocab_size, block_size))
        except ValueError as e:
            raise ValueError(f"{path} line {line_no}: {e}") from None
    if not lines:
        raise ValueError(f"{path}: the trace has no requests")

    # every distinct block once: hash id h -> its first need[h] tokens, block_size where some
    # line has it before its last block, else the longest last-block head (a stream's prefix is
    # the shorter stream: --trace-block-size 20000000 made 20M tokens for a 5-token prompt, 37 s)
    need: dict[int, int] = {}
    for line in lines:
        if line.hash_ids is not None:
            last = len(line.hash_ids) - 1
            for i, h in enumerate(line.hash_ids):
                used = block_size if i < last else line.input_len - last * block_size
                need[h] = max(need.get(h, 0), used)
    unique = sorted(need)
    texts = batch_text_ids([f"hash{h}" for h in unique], [need[h] for h in unique], vocab_size)
    blocks = dict(zip(unique, texts, strict=True))

    sessions = []
    for line in sorted(lines, key=lambda x: x.start_s):
        if line.hash_ids is not None:
            ids: list[int] = []
            for h in line.hash_ids:
                ids += blocks[h]
            del ids[line.input_len :]  # the last block may be partial (its block, longer elsewhere)
            prompt = tuple(ids)
        else:
            assert line.prompt_ids is not None
            prompt = line.prompt_ids
        session_id = f"line{line.line_no}" if line.session is None else f"{line.session}#{line.line_no}"
        turns = (Turn(prompt, line.output_len),)
        sessions.append(Session(session_id, line.start_s, turns, tenant=line.tenant, trace_line=line.line_no))
    params = {"path": str(path), "block_size": block_size, "num_lines": len(lines)}
    return Workload(f"trace:{Path(path).name}", tuple(sessions), vocab_size, params)


def _parse(raw: str, line_no: int, vocab_size: int, block_size: int) -> _Line:
    """One line, checked; a ValueError whose message names the field (the caller adds where)."""
    try:
        record = json.loads(raw, object_pairs_hook=_no_repeats)
    except json.JSONDecodeError as e:
        raise ValueError(f"not JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(record, dict):
        raise ValueError(f"expected a JSON object, got {_show(record)}")
    for name in record:
        if name not in FIELDS:
            raise ValueError(f"unknown field {name!r} (fields: {', '.join(sorted(FIELDS))})")

    if ("timestamp" in record) == ("timestamp_ms" in record):
        raise ValueError("exactly one of timestamp (seconds), timestamp_ms (milliseconds) is required")
    start_s = _time(record, "timestamp" if "timestamp" in record else "timestamp_ms")

    if ("prompt_ids" in record) == ("hash_ids" in record):
        raise ValueError("exactly one of prompt_ids, hash_ids is required")
    prompt_ids = hash_ids = None
    if "prompt_ids" in record:
        prompt_ids = _int_list(record, "prompt_ids")
        bad = next((i for i, t in enumerate(prompt_ids) if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise ValueError(f"prompt_ids[{bad}] = {prompt_ids[bad]} is outside the vocabulary [0, {vocab_size})")
        input_len = len(prompt_ids)
        given = record.get("input_length", input_len)
        if type(given) is not int or given != input_len:
            raise ValueError(f"input_length {_show(record['input_length'])} differs from len(prompt_ids) = {input_len}")
    else:
        hash_ids = _int_list(record, "hash_ids")
        bad = next((i for i, h in enumerate(hash_ids) if h < 0), None)
        if bad is not None:
            raise ValueError(f"hash_ids[{bad}] = {hash_ids[bad]} is negative")
        if "input_length" not in record:
            raise ValueError("input_length is required with hash_ids")
        input_len = record["input_length"]
        # [0, (n-1) * block_size) full blocks | the last block: 1 .. block_size tokens
        lo, hi = (len(hash_ids) - 1) * block_size, len(hash_ids) * block_size
        if type(input_len) is not int or not lo < input_len <= hi:
            raise ValueError(
                f"input_length must be an integer in ({lo}, {hi}] for {len(hash_ids)} hash_ids "
                f"of block_size {block_size}, got {_show(input_len)}"
            )

    if "output_length" not in record:
        raise ValueError("output_length is required")
    output_len = record["output_length"]
    if type(output_len) is not int or output_len < 1:
        raise ValueError(f"output_length must be a positive integer, got {_show(output_len)}")

    for name in ("session", "tenant"):
        if name in record and not isinstance(record[name], str):
            raise ValueError(f"{name} must be a string, got {_show(record[name])}")
    return _Line(
        line_no, start_s, prompt_ids, hash_ids, input_len, output_len, record.get("session"), record.get("tenant", "")
    )


def _no_repeats(pairs: list[tuple[str, object]]) -> dict:
    """A JSON object's dict; ValueError for a field given twice (json keeps the last
    silently: {"timestamp": 0, "timestamp": 5} arrived at 5)."""
    seen: set[str] = set()
    for name, _ in pairs:
        if name in seen:
            raise ValueError(f"field {name!r} is given twice")
        seen.add(name)
    return dict(pairs)


def _time(record: dict, name: str) -> float:
    """The arrival in seconds (timestamp_ms / 1000); ValueError past MAX_START_S."""
    value = record[name]
    if type(value) not in (int, float) or not 0 <= value < math.inf:
        raise ValueError(f"{name} must be a finite number >= 0, got {_show(value)}")
    start_s = float(value) / (1000.0 if name == "timestamp_ms" else 1.0)
    if start_s >= MAX_START_S:
        raise ValueError(
            f"{name} {_show(value)} is {start_s:.3g} s, past 2^33 s (272 years), where the virtual clock's "
            "float seconds lose the microseconds a step is timed in; epoch milliseconds or nanoseconds? "
            "(timestamp: seconds, timestamp_ms: milliseconds)"
        )
    return start_s


def _int_list(record: dict, name: str) -> tuple[int, ...]:
    value = record[name]
    if not isinstance(value, list) or not value:
        raise ValueError(f"{name} must be a non-empty list of integers, got {_show(value)}")
    bad = next((i for i, t in enumerate(value) if type(t) is not int), None)
    if bad is not None:
        raise ValueError(f"{name}[{bad}] must be an integer, got {_show(value[bad])}")
    return tuple(value)


def _show(value: object) -> str:
    """A JSON value as the message shows it: at most 40 characters."""
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."
