"""How one P/D rank tells another what follows, in data only: nothing a peer sends is code.

torch's object collectives (send_object_list, broadcast_object_list) pickle their objects,
and unpickling what a peer sent runs whatever callable it names. A P/D message here is

  1. a preamble, int64 [4]: (MAGIC, WIRE_VERSION, header bytes, payload bytes). Its layout is
     the same in every version, so a receiver can always take the rest off the wire (and
     refuse it whole) however the header reads;
  2. the header, uint8 [header bytes]: a UTF-8 JSON object, field names and JSON types
     checked against the receiver's schema (`parse_header`): a field missing, unknown, of
     another type, or a header that is not JSON is refused in one line naming it;
  3. the payload, the caller's tensors (P/D: K then V, each of the payload bytes).

The token range a decode leader asks for is three integers, broadcast as an int64 tensor.
(As vLLM's connectors exchange typed msgspec structs with a version check, and LMCache
fixed-layout metadata: the receiver decodes into known fields, never into objects.)
"""

from __future__ import annotations

import json
import types
from typing import NamedTuple

import torch
import torch.distributed as dist

MAGIC = 0x4B56504F4F4C5044  # "KVPOOLPD": a preamble, not some other message's bytes
WIRE_VERSION = 1
MAX_HEADER_BYTES = 1 << 16  # a descriptor is a few hundred bytes; more: the wire is out of step

# a schema: field name -> its type, as the receiver reads it (str, int, or a tuple of ints)
Schema = dict[str, object]


class HeaderError(ValueError):
    """A header the receiver refuses (the message names the field, or why it is not JSON)."""


class Preamble(NamedTuple):
    version: int
    header_bytes: int
    payload_bytes: int


def encode_header(fields: dict[str, object]) -> torch.Tensor:
    """uint8 [n]: `fields` (str, int, tuples of int) as compact UTF-8 JSON."""
    data = json.dumps(fields, separators=(",", ":"), allow_nan=False).encode()
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def send_header(fields: dict[str, object], payload_bytes: int, dst: int) -> None:
    """The preamble and the header of one message to rank `dst` (its payload follows, sent by
    the caller)."""
    header = encode_header(fields)
    assert header.numel() <= MAX_HEADER_BYTES and payload_bytes >= 0, (header.numel(), payload_bytes)
    dist.send(torch.tensor([MAGIC, WIRE_VERSION, header.numel(), payload_bytes], dtype=torch.int64), dst=dst)
    dist.send(header, dst=dst)


def recv_header(src: int) -> tuple[Preamble, bytes]:
    """The preamble and the header's bytes of rank `src`'s next message. RuntimeError when the
    preamble is not one (nothing tells what follows: the wire is out of step)."""
    # zeros: gloo fills a larger buffer than the message in part without a word (torch's
    # send_object_list sends an int64 [1] size first), and what it leaves must not pass
    pre = torch.zeros(4, dtype=torch.int64)
    dist.recv(pre, src=src)
    magic, version, header_bytes, payload_bytes = pre.tolist()
    if magic != MAGIC or not 0 < header_bytes <= MAX_HEADER_BYTES or payload_bytes < 0:
        raise RuntimeError(
            f"rank {src} sent no P/D preamble (magic {magic:#x}, header {header_bytes} B, payload {payload_bytes} B): "
            "the wire is out of step"
        )
    header = torch.empty(header_bytes, dtype=torch.uint8)
    dist.recv(header, src=src)
    return Preamble(version, header_bytes, payload_bytes), header.numpy().tobytes()


def _json_type(value: object) -> str:
    names = {
        str: "a string",
        bool: "a boolean",
        int: "an integer",
        float: "a number",
        list: "a list",
        dict: "an object",
    }
    return "null" if value is None else names.get(type(value), type(value).__name__)


def _check_field(name: str, value: object, kind: object) -> object:
    """`value` as `kind` (str, int, tuple[int, ...] of a fixed length); HeaderError naming `name`."""
    if kind is str or kind is int:
        ok = isinstance(value, kind) and not isinstance(value, bool)
        if not ok:
            raise HeaderError(f"field {name!r} is {_json_type(value)}, expected {_json_type(kind())}")
        return value
    assert isinstance(kind, types.GenericAlias) and kind.__origin__ is tuple, kind
    n = len(kind.__args__)
    if not (isinstance(value, list) and len(value) == n and all(type(x) is int for x in value)):
        raise HeaderError(f"field {name!r} is {json.dumps(value)[:40]}, expected a list of {n} integers")
    return tuple(value)


def _no_duplicates(pairs: list[tuple[str, object]]) -> dict[str, object]:
    seen: dict[str, object] = {}
    for key, value in pairs:
        if key in seen:
            raise HeaderError(f"field {key!r} given twice")
        seen[key] = value
    return seen


def parse_header(pre: Preamble, data: bytes, schema: Schema) -> dict[str, object]:
    """The header's fields, each of its schema type (tuples for lists); HeaderError naming the
    first field that is missing, unknown or of another type, or the version or the JSON."""
    if pre.version != WIRE_VERSION:
        raise HeaderError(f"wire version {pre.version}, this rank reads version {WIRE_VERSION}")
    try:
        fields = json.loads(data.decode("utf-8"), object_pairs_hook=_no_duplicates)
    except HeaderError:
        raise
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise HeaderError(f"not a JSON header ({type(e).__name__}: {str(e)[:80]})") from None
    if not isinstance(fields, dict):
        raise HeaderError(f"the header is {_json_type(fields)}, expected an object")
    for name in fields:
        if name not in schema:
            raise HeaderError(f"unknown field {name[:40]!r}")
    for name in schema:
        if name not in fields:
            raise HeaderError(f"field {name!r} missing")
    return {name: _check_field(name, fields[name], kind) for name, kind in schema.items()}


def broadcast_ints(values: list[int] | None, n: int, src: int) -> list[int]:
    """Rank `src`'s `values` (n ints) on every rank; another rank's own `values`, or None, are
    replaced by them."""
    t = torch.tensor(values, dtype=torch.int64) if values is not None else torch.empty(n, dtype=torch.int64)
    assert t.shape == (n,), (t.shape, n)
    dist.broadcast(t, src=src)
    return t.tolist()
