"""The byte format of a stored block, shared by the disk and Redis tiers.

An entry is one safetensors file: the block's tensors, and in the file's metadata its
manifest and the manifest's checksum.

    manifest = {"format": 1, "key": content key (hex), "descriptor": the BlockDescriptor,
                "tensors": {name: {"dtype": ..., "shape": [...], "xxh3": xxh3_128 of its bytes}}}
    metadata = {"kvpool.manifest": manifest as JSON, "kvpool.manifest_xxh3": xxh3_128 of it}

`read_header` parses only the safetensors header (the first 8 + n bytes), enough to check
a descriptor without reading the tensors; `decode` checks everything: the header, the
manifest's checksum, that the file's tensors are exactly the manifest's, and every
tensor's checksum. Anything wrong raises `CorruptEntry`, which the tiers turn into a miss
(and, on disk, a quarantined file). A descriptor that does not match the caller's is not
corruption: the tier reports it field by field. Nor is an entry of another format version
(`OtherVersion`: its "kvpool.manifest" names another "format", with our checksum valid or
with no checksum of ours): two kvpool versions may share a directory, so it is skipped,
left to its writer, and aged out by the byte limit. Every later format keeps that manifest
key and its format number. A single flipped bit never makes an entry look like another
version (a flip in the format number fails the checksum; in the checksum's key, the
manifest still says format 1): corruption stays corruption.
"""

from __future__ import annotations

import json
import struct

import torch
import xxhash
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save
from torch import Tensor

from kvpool.tiers.descriptor import BlockDescriptor

FORMAT = 1
MAX_HEADER_BYTES = 1 << 20  # a block's header is a few KiB; anything larger is corrupt
_MANIFEST = "kvpool.manifest"
_MANIFEST_SUM = "kvpool.manifest_xxh3"


class CorruptEntry(ValueError):
    """A stored entry whose bytes do not check out (torn, truncated, flipped or foreign)."""


class OtherVersion(ValueError):
    """An entry written by a kvpool of another entry format: not ours to read or to move."""


def namespace(descriptor: BlockDescriptor) -> str:
    """What makes two blocks' bytes comparable at all: the model, its weights and the layout
    (shape, block size, dtype). Entries of another tokenizer, template, adapter or RoPE
    share a namespace so that they are found, refused field by field and reclaimed. The
    weights are in it (`weights_version`: the GGUF's xxh3_128, a tiny model's seed), so two
    engines of one model name and other weights on one tier keep their entries apart: they
    deleted each other's, each reclaiming the other's block of the same content key. A
    superseded version's entries are then not found again; the LRU (disk) or Redis's
    eviction ages them out, and `kvpool cache stats` lists them by weights."""
    return namespace_of(descriptor.model_id, descriptor.weights_version, descriptor.layout_id)


def namespace_of(model_id: str, weights_version: str, layout_id: str) -> str:
    return xxhash.xxh3_64_hexdigest(f"{model_id}\x00{weights_version}\x00{layout_id}".encode())


def _tensor_sum(tensor: Tensor) -> str:
    return xxhash.xxh3_128_hexdigest(tensor.contiguous().view(torch.uint8).numpy().tobytes())


def encode(key: bytes, descriptor: BlockDescriptor, tensors: dict[str, Tensor]) -> bytes:
    """The entry's bytes (tensors on CPU, contiguous)."""
    cpu = {name: t.detach().to("cpu").contiguous() for name, t in tensors.items()}
    manifest = json.dumps(
        {
            "format": FORMAT,
            "key": key.hex(),
            "descriptor": json.loads(descriptor.to_json()),
            "tensors": {
                name: {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape), "xxh3": _tensor_sum(t)}
                for name, t in sorted(cpu.items())
            },
        },
        sort_keys=True,
        separators=(",", ":"),
    )
    metadata = {_MANIFEST: manifest, _MANIFEST_SUM: xxhash.xxh3_128_hexdigest(manifest.encode())}
    return st_save(cpu, metadata=metadata)


def header_length(prefix: bytes) -> int:
    """The safetensors header's length from an entry's first 8 bytes."""
    if len(prefix) < 8:
        raise CorruptEntry(f"entry of {len(prefix)} bytes has no header")
    (n,) = struct.unpack("<Q", prefix[:8])
    if not 2 <= n <= MAX_HEADER_BYTES:
        raise CorruptEntry(f"entry header claims {n} bytes")
    return n


def read_header(header: bytes, key: bytes) -> tuple[BlockDescriptor, dict]:
    """(descriptor, manifest) from the header bytes that follow the 8-byte length; the
    manifest's checksum and its key checked."""
    try:
        meta = json.loads(header).get("__metadata__") or {}
        manifest_text = meta.get(_MANIFEST)
        checksum = meta.get(_MANIFEST_SUM)
    except (ValueError, AttributeError, TypeError) as error:
        raise CorruptEntry(f"entry header unreadable: {error!r}") from None
    if not isinstance(manifest_text, str):
        raise CorruptEntry("entry header holds no kvpool manifest")
    if not isinstance(checksum, str):
        # another version may sum its manifest otherwise: its format number tells
        if _format_of(manifest_text) not in (FORMAT, None):
            raise OtherVersion(f"entry format {_format_of(manifest_text)}, this kvpool reads {FORMAT}")
        raise CorruptEntry("entry header holds no manifest checksum")
    if xxhash.xxh3_128_hexdigest(manifest_text.encode()) != checksum:
        raise CorruptEntry("manifest checksum mismatch")
    try:  # (checksum valid: only a crafted manifest fails here)
        manifest = json.loads(manifest_text)
    except ValueError as error:
        raise CorruptEntry(f"entry manifest unreadable: {error}") from None
    if not isinstance(manifest, dict):
        raise CorruptEntry("entry manifest is not an object")
    if manifest.get("format") != FORMAT:
        raise OtherVersion(f"entry format {manifest.get('format')!r}, this kvpool reads {FORMAT}")
    if manifest.get("key") != key.hex():
        raise CorruptEntry(f"entry filed under {key.hex()} holds key {manifest.get('key')}")
    try:
        descriptor = BlockDescriptor.from_json(json.dumps(manifest["descriptor"]))
    except (KeyError, TypeError, ValueError) as error:
        raise CorruptEntry(f"entry descriptor unreadable: {error}") from None
    return descriptor, manifest


def _format_of(manifest_text: str) -> int | None:
    """The "format" number of a manifest that parses; None otherwise."""
    try:
        found = json.loads(manifest_text).get("format")
    except (ValueError, AttributeError):
        return None
    return found if isinstance(found, int) and not isinstance(found, bool) else None


def tensor_layout(manifest: dict) -> dict[str, tuple[str, list[int]]]:
    """{name: (dtype, shape)} of the tensors a (checked) manifest lists."""
    try:
        return {name: (t["dtype"], list(t["shape"])) for name, t in manifest["tensors"].items()}
    except (KeyError, TypeError, AttributeError) as error:
        raise CorruptEntry(f"entry manifest lists no tensors: {error!r}") from None


def expected_layout(tensors: dict[str, tuple[object, tuple[int, ...]]]) -> dict[str, tuple[str, list[int]]]:
    """{name: (dtype, shape)} as a manifest names them, from {name: (torch dtype, shape)}
    (a tier's `expect_tensors`); ValueError for anything else."""
    layout = {}
    for name, spec in tensors.items():
        dtype, shape = spec if isinstance(spec, tuple) and len(spec) == 2 else (None, None)
        if (
            not str(dtype).startswith("torch.")
            or not isinstance(shape, tuple)
            or not all(isinstance(n, int) and n >= 0 for n in shape)
        ):
            raise ValueError(f"expected tensors: {name!r} must be (torch dtype, shape of sizes >= 0), got {spec!r}")
        layout[name] = (str(dtype).removeprefix("torch."), list(shape))
    return layout


def check_layout(layout: dict[str, tuple[str, list[int]]], want: dict[str, tuple[str, list[int]]] | None) -> None:
    """CorruptEntry when an entry's tensors (`layout`) are not those expected (None: any)."""
    if want is not None and layout != want:
        raise CorruptEntry(f"entry holds tensors {layout}, blocks of its namespace are {want}")


def layout_of(tensors: dict[str, Tensor]) -> dict[str, tuple[str, list[int]]]:
    """{name: (dtype, shape)} of tensors, as a manifest names them."""
    return {name: (str(t.dtype).removeprefix("torch."), list(t.shape)) for name, t in tensors.items()}


def peek(data: bytes, key: bytes) -> tuple[BlockDescriptor, dict]:
    """`read_header` of a whole entry's (or its first bytes')."""
    n = header_length(data)
    if len(data) < 8 + n:
        raise CorruptEntry(f"entry of {len(data)} bytes is shorter than its {n}-byte header")
    return read_header(data[8 : 8 + n], key)


def decode(
    data: bytes, key: bytes, peeked: tuple[BlockDescriptor, dict] | None = None
) -> tuple[BlockDescriptor, dict[str, Tensor]]:
    """(descriptor, tensors) of an entry, every checksum verified; CorruptEntry otherwise.
    peeked: `peek(data, key)`'s answer, when the caller has it (its header not parsed twice)."""
    descriptor, manifest = peek(data, key) if peeked is None else peeked
    try:
        tensors = st_load(data)
    except Exception as error:  # safetensors raises its own error type for a torn file
        raise CorruptEntry(f"tensors unreadable: {error}") from None
    expected = manifest.get("tensors")
    if not isinstance(expected, dict) or not all(isinstance(want, dict) for want in expected.values()):
        raise CorruptEntry("entry manifest lists no tensors")
    if set(tensors) != set(expected):
        raise CorruptEntry(f"entry holds tensors {sorted(tensors)}, its manifest names {sorted(expected)}")
    for name, tensor in tensors.items():
        want = expected[name]
        if str(tensor.dtype).removeprefix("torch.") != want.get("dtype") or list(tensor.shape) != want.get("shape"):
            raise CorruptEntry(f"tensor {name}: {tensor.dtype} {list(tensor.shape)}, manifest says {want}")
        if _tensor_sum(tensor) != want.get("xxh3"):
            raise CorruptEntry(f"tensor {name}: checksum mismatch")
    return descriptor, tensors
