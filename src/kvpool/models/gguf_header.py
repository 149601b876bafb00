"""A GGUF's header (its metadata keys and its tensors' descriptions) read with plain file
reads, and every refusal that needs nothing else, so that `load_model` refuses a file before
it hashes it: the digest reads the whole file (~80 s for 40 GB at 500 MB/s), and a model of
an unsupported architecture, RoPE scaling, tokenizer or quantization, or too large for the
machine, was refused only after that.

No gguf library here: its reader parses every token and merge into Python objects (2.4 s
and ~160 MB for SmolLM2), where this walks past the string arrays (their lengths only) and
keeps a count. These are the only checks of the header: load_gguf runs `check_header` too
(or takes its result from load_model, which ran it before hashing the file), and the reader
it then parses the file with reads the tokenizer and the tensors' offsets only. The checks
are models/gguf.py's functions (read_config, check_shapes, check_tensor_types), given a
header that answers as gguf's reader does (`fields[key].contents()`, `tensors`).

Layout (GGUF v2 and v3; every integer in the file's byte order):
  magic "GGUF" | version u32 | tensor count u64 | metadata count u64
  metadata, count times: key (string) | value type u32 | value
  tensors, count times:  name (string) | dims count u32 | dims u64 x count | type u32 | offset u64
  data: from the end of the tensors' descriptions rounded up to general.alignment (32); a
        tensor's offset counts from there
A string is a u64 byte count and UTF-8 bytes; an array an item type u32, an item count u64
and the items.
"""

from __future__ import annotations

import dataclasses
import math
import os
import struct
from dataclasses import dataclass
from typing import Any

from kvpool.models.gguf import (
    PARSE_ERRORS,
    ROPE_FREQS,
    ROPE_FREQS_MAX_ELEMENTS,
    LlamaConfig,
    RopeFreqs,
    check_shapes,
    check_tensor_types,
    read_config,
)

# value types: the scalars' struct codes; a string; an array
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
# the quantization types kvpool reads (gguf.SUPPORTED_QUANT_TYPES): ggml type id -> (name,
# elements a block, bytes a block), as gguf.GGML_QUANT_SIZES has them (a test compares)
QUANT_TYPES = {
    0: ("F32", 1, 4),
    1: ("F16", 1, 2),
    2: ("Q4_0", 32, 18),
    3: ("Q4_1", 32, 20),
    6: ("Q5_0", 32, 22),
    7: ("Q5_1", 32, 24),
    8: ("Q8_0", 32, 34),
    12: ("Q4_K", 256, 144),
    13: ("Q5_K", 256, 176),
    14: ("Q6_K", 256, 210),
    30: ("BF16", 1, 2),
}
# The least bytes one entry of each section takes: a metadata pair (key length, an empty key,
# its type, a one-byte value), a tensor's description (name length, an empty name, its
# dims count, no dims, its type, its offset).
MIN_KV_BYTES = 8 + 4 + 1
MIN_TENSOR_INFO_BYTES = 8 + 4 + 4 + 8
FIRST_READ_BYTES = 4 << 20  # SmolLM2's header is 1.8 MB, Llama 3's ~8 MB: then twice as much, until it ends
MAX_HEADER_BYTES = 256 << 20  # a vocabulary of 256k tokens and its merges take ~10 MB


class _Short(Exception):
    """The bytes read so far end before the header does."""


@dataclass(frozen=True)
class SkippedArray:
    """An array of numbers or strings the header walked past, its length kept (a vocabulary,
    its merges and token types: the tokenizer is read on a cold load, not here)."""

    count: int

    def __len__(self) -> int:
        return self.count


@dataclass(frozen=True)
class HeaderField:
    value: Any

    def contents(self) -> Any:  # as gguf's ReaderField answers
        return self.value


@dataclass(frozen=True)
class HeaderTensor:
    name: str
    shape: tuple[int, ...]  # GGUF dims, in_features first
    type_id: int  # ggml type id
    offset: int  # of its data, from the data section's start

    @property
    def type_name(self) -> str:
        if self.type_id in QUANT_TYPES:
            return QUANT_TYPES[self.type_id][0]
        import gguf  # (only for a type kvpool refuses: 0.15 s to import)

        try:
            return gguf.GGMLQuantizationType(self.type_id).name
        except ValueError:
            return f"#{self.type_id} (not a ggml type)"


@dataclass(frozen=True)
class GGUFHeader:
    fields: dict[str, HeaderField]
    tensors: list[HeaderTensor]
    data_offset: int  # where the data section starts
    file_bytes: int
    bytes_read: int  # of the file, to read the header
    rope_freqs: RopeFreqs | None = None  # tensor rope_freqs.weight, its values read (read_config needs them)


def read_header(path: str) -> GGUFHeader:
    """The header of the GGUF at `path` (check_gguf_file has checked its magic), read in
    doubling chunks from FIRST_READ_BYTES (4 MiB), and the values of its rope_freqs tensor.
    ValueError naming the path for a header that is corrupt or truncated (whatever the parse
    raised: PARSE_ERRORS, struct.error), of a GGUF version other than 2 or 3, or longer than
    MAX_HEADER_BYTES."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        buffer = f.read(min(size, FIRST_READ_BYTES))
        while True:
            try:
                header, order = _parse(buffer, size)
                break
            except _Short:
                if len(buffer) >= size:
                    raise ValueError(
                        f"GGUF file {path} is corrupt or truncated: its header runs past the end of the file "
                        f"({size} bytes)"
                    ) from None
                if len(buffer) >= MAX_HEADER_BYTES:
                    raise ValueError(
                        f"GGUF file {path} is corrupt: its header runs past {MAX_HEADER_BYTES >> 20} MiB"
                    ) from None
                more = f.read(min(len(buffer), size - len(buffer), MAX_HEADER_BYTES - len(buffer)))
                if not more:  # the file shrank under us
                    raise ValueError(f"GGUF file {path} is truncated: it ended while its header was read") from None
                buffer += more
            except (*PARSE_ERRORS, struct.error) as e:
                raise ValueError(f"GGUF file {path} is corrupt or truncated: {e}") from None
        return _with_rope_freqs(header, order, f, path)


def _with_rope_freqs(header: GGUFHeader, order: str, f: Any, path: str) -> GGUFHeader:
    """The header with its rope_freqs tensor (Llama 3.1+'s RoPE factors), whose values an F32
    one of at most ROPE_FREQS_MAX_ELEMENTS has read from the file (a few hundred bytes).
    ValueError naming the tensor when they lie past the end of the file."""
    t = next((t for t in header.tensors if t.name == ROPE_FREQS), None)
    if t is None:
        return header
    name, count = t.type_name, math.prod(t.shape)
    values = None
    if name == "F32" and count <= ROPE_FREQS_MAX_ELEMENTS:
        start = header.data_offset + t.offset
        data = b""
        if start + 4 * count <= header.file_bytes:  # (an offset near 2^64 is past any seek)
            f.seek(start)
            data = f.read(4 * count)
        if len(data) != 4 * count:
            raise ValueError(
                f"GGUF file {path} is corrupt or truncated: tensor {ROPE_FREQS!r}: {4 * count} bytes at offset "
                f"{t.offset} of the data section run past the end of the file ({header.file_bytes} bytes)"
            )
        values = struct.unpack(f"{order}{count}f", data)
    return dataclasses.replace(header, rope_freqs=RopeFreqs(name, t.shape, values))


def _parse(buf: bytes, size: int) -> tuple[GGUFHeader, str]:
    """The header in `buf` (the file's first bytes; `size` the whole file's) and the file's
    byte order (struct's "<" or ">"); _Short when it runs past `buf`, ValueError for what no
    GGUF holds."""
    if len(buf) < 24:
        if size < 24:
            raise ValueError(f"its header needs 24 bytes, the file has {size}")
        raise _Short
    # a file written on a big-endian machine holds its version (2 or 3) in the high half of a little-endian read
    order = ">" if struct.unpack_from("<I", buf, 4)[0] & 0xFFFF == 0 else "<"
    version, num_tensors, num_kv = struct.unpack_from(f"{order}IQQ", buf, 4)
    if version not in (2, 3):
        raise ValueError(f"GGUF version {version}; kvpool reads versions 2 and 3")
    if num_tensors * MIN_TENSOR_INFO_BYTES + num_kv * MIN_KV_BYTES > size - 24:
        raise ValueError(
            f"its header claims {num_tensors} tensors and {num_kv} metadata keys, more than its {size} bytes can hold"
        )
    reader = _Reader(buf, size, order, 24)
    fields: dict[str, HeaderField] = {}
    for _ in range(num_kv):
        key = reader.string()
        value = reader.value(reader.u32())
        if key in fields:
            raise ValueError(f"metadata key {key!r} appears twice")
        fields[key] = HeaderField(value)
    tensors = []
    for _ in range(num_tensors):
        name = reader.string()
        num_dims = reader.u32()
        dims = reader.unpack(f"{num_dims}Q", 8 * num_dims)
        tensors.append(HeaderTensor(name, tuple(dims), reader.u32(), reader.unpack("Q", 8)[0]))
    alignment = fields["general.alignment"].value if "general.alignment" in fields else 32
    if isinstance(alignment, bool) or not isinstance(alignment, int) or alignment <= 0:
        raise ValueError(f"general.alignment must be a positive integer, got {alignment!r}")
    data_offset = reader.pos + (-reader.pos % alignment)
    return GGUFHeader(fields, tensors, data_offset, size, len(buf)), order


class _Reader:
    """Values at a position in the header's bytes."""

    def __init__(self, buf: bytes, size: int, order: str, pos: int) -> None:
        self.buf, self.size, self.order, self.pos = buf, size, order, pos

    def unpack(self, fmt: str, num_bytes: int) -> tuple:
        end = self.pos + num_bytes
        if end > self.size:
            raise ValueError(f"{num_bytes} bytes at offset {self.pos} run past the end of the file ({self.size} bytes)")
        if end > len(self.buf):
            raise _Short
        values = struct.unpack_from(self.order + fmt, self.buf, self.pos)
        self.pos = end
        return values

    def u32(self) -> int:
        return self.unpack("I", 4)[0]

    def string(self) -> str:
        (length,) = self.unpack("Q", 8)
        end = self.pos + length
        if end > self.size:
            raise ValueError(f"a string of {length} bytes at offset {self.pos} runs past the end of the file")
        if end > len(self.buf):
            raise _Short
        text = self.buf[self.pos : end].decode("utf-8")  # (UnicodeDecodeError is a ValueError)
        self.pos = end
        return text

    def value(self, value_type: int) -> Any:
        if value_type in _SCALARS:
            code = _SCALARS[value_type]
            return self.unpack(code, struct.calcsize(code))[0]
        if value_type == _STRING:
            return self.string()
        if value_type != _ARRAY:
            raise ValueError(f"unknown metadata value type {value_type} at offset {self.pos - 4}")
        item_type, count = self.unpack("IQ", 12)
        least = struct.calcsize(_SCALARS[item_type]) if item_type in _SCALARS else (8 if item_type == _STRING else 12)
        if count * least > self.size - self.pos:
            raise ValueError(
                f"the array at offset {self.pos - 12} claims {count} items, more than the file's {self.size} bytes hold"
            )
        if item_type in _SCALARS:
            self.unpack(f"{count * least}x", count * least)
            return SkippedArray(count)
        if item_type == _STRING:
            self._skip_strings(count)
            return SkippedArray(count)
        return tuple(self.value(item_type) for _ in range(count))  # an array of arrays

    def _skip_strings(self, count: int) -> None:
        """Walk past `count` strings: ~0.2 us each (SmolLM2's 49,152 tokens and 48,900 merges)."""
        unpack, buf, pos = struct.Struct(self.order + "Q").unpack_from, self.buf, self.pos
        walked = True
        try:
            for _ in range(count):
                pos += 8 + unpack(buf, pos)[0]
        except (struct.error, OverflowError):  # a length at `pos` lies past the bytes read, or `pos` past 2^63
            walked = False
        if pos + (0 if walked else 8) > self.size:
            raise ValueError(f"the strings of the array at offset {self.pos} run past the end of the file")
        if not walked or pos > len(buf):
            raise _Short
        self.pos = pos


@dataclass(frozen=True)
class HeaderFacts:
    """What load_model decides on before it reads the weights."""

    config: LlamaConfig
    tokenizer_model: str
    tokenizer_pre: str


def check_header(header: GGUFHeader, path: str) -> HeaderFacts:
    """The refusals load_gguf makes that need only the header, with its words: the
    architecture and its shapes (read_config, check_shapes), the quantization types and the
    tensors the model needs (check_tensor_types), and every tensor's data inside the file.
    ValueError naming the path for each, and for whatever else a malformed header makes them
    raise (PARSE_ERRORS, as load_gguf catches: a tokens key that is not an array, ...)."""
    try:
        config = read_config(header, header.rope_freqs)
        tokens = header.fields.get("tokenizer.ggml.tokens")
        if tokens is None:
            raise ValueError("GGUF metadata lacks 'tokenizer.ggml.tokens'")
        if not isinstance(tokens.value, SkippedArray):
            raise ValueError("GGUF metadata tokenizer.ggml.tokens must be an array of strings")
        check_shapes(header, config, len(tokens.value))
        check_tensor_types({t.name: t.type_name for t in header.tensors}, config)
        model = header.fields.get("tokenizer.ggml.model")
        if model is None:
            raise ValueError("GGUF metadata lacks 'tokenizer.ggml.model'")
        pre = header.fields.get("tokenizer.ggml.pre")
        facts = HeaderFacts(config, str(model.value), str(pre.value) if pre is not None else "default")
    except PARSE_ERRORS as e:
        raise ValueError(f"GGUF file {path}: {e}") from None
    for t in header.tensors:
        _, block, block_bytes = QUANT_TYPES[t.type_id]
        elements = math.prod(t.shape)
        if header.data_offset + t.offset + elements // block * block_bytes > header.file_bytes:
            raise ValueError(
                f"GGUF file {path} is corrupt or truncated: tensor {t.name!r}: {elements // block * block_bytes} "
                f"bytes at offset {t.offset} of the data section run past the end of the file "
                f"({header.file_bytes} bytes, data from {header.data_offset})"
            )
    return facts
