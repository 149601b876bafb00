"""A cache of a GGUF's weights in the layout LlamaModel holds them, so a start skips the
GGUF reader (metadata parse, dequantization, fusing): safetensors, memory-mapped on load.

An entry lives under `$KVPOOL_CACHE_DIR/weights` (default ~/.cache/kvpool/weights), named
by a key of everything its bytes depend on: the GGUF's digest (xxh3_128 of the whole file),
LAYOUT_VERSION (bump it when LlamaModel's stored layout changes) and the dtype. Files:

  weights.safetensors   every tensor of the model, as LlamaModel stores it
  meta.json             the GGUF's path, config, tokenizer data and file type
  entry.json            written last (its presence commits the entry): the layout version,
                        and the size and xxh3_128 of each of the two files above

Writes are atomic: the entry is built in a private directory, fsynced, then renamed into
place; a crash leaves no entry that is used. A load checks sizes and digests (~40 ms for
SmolLM2's 538 MB in the page cache): an entry that does not match (corrupt, truncated,
half-written, of another layout) is deleted and rebuilt from the GGUF, never used. Entries
of other layout versions of the same model are reclaimed when a new one is stored.
KVPOOL_WEIGHT_CACHE=0 turns the cache off.
"""

from __future__ import annotations

import contextlib
import json
import math
import mmap
import os
import shutil
import struct
import tempfile
from dataclasses import asdict
from pathlib import Path

import torch
import xxhash

from kvpool.models.gguf import GGUFModel, LlamaConfig, TokenizerData, file_digest

LAYOUT_VERSION = 2  # 2: the tied embedding is the LM head (no transposed copy); layers fused [in, out]
WEIGHTS, META, ENTRY = "weights.safetensors", "meta.json", "entry.json"


def enabled() -> bool:
    return os.environ.get("KVPOOL_WEIGHT_CACHE", "1") != "0"


def default_root() -> Path:
    return Path(os.environ.get("KVPOOL_CACHE_DIR") or Path.home() / ".cache" / "kvpool") / "weights"


def entry_key(gguf_digest: str, dtype: torch.dtype, layout_version: int | None = None) -> str:
    """The entry's name: a hash of everything its bytes depend on (the layout version: the
    one this code writes unless another is named)."""
    layout_version = LAYOUT_VERSION if layout_version is None else layout_version
    return xxhash.xxh3_64_hexdigest(f"{gguf_digest}|layout{layout_version}|{dtype}".encode())


class WeightCache:
    def __init__(self, root: str | Path | None = None) -> None:
        self.root = Path(root) if root is not None else default_root()
        self.last_miss: str | None = None  # why the last load found nothing usable

    def load(self, key: str) -> tuple[GGUFModel, dict[str, torch.Tensor]] | None:
        """The entry's metadata and tensors (memory-mapped), or None when there is no usable
        entry; a broken one is deleted first (`last_miss` says why)."""
        entry = self.root / key
        if not entry.exists():
            self.last_miss = "no entry"
            return None
        problem, tensors = self._check(entry)
        if problem is not None:
            self.last_miss = problem
            shutil.rmtree(entry, ignore_errors=True)
            return None
        meta = json.loads((entry / META).read_text())
        config = LlamaConfig(**meta["config"])
        tok = meta["tokenizer"]
        tokenizer = TokenizerData(**{**tok, **{k: tuple(tok[k]) for k in ("tokens", "merges", "token_types")}})
        self.last_miss = None
        return GGUFModel(meta["path"], config, tokenizer, meta["file_type"], meta["digest"]), tensors

    def _check(self, entry: Path) -> tuple[str | None, dict[str, torch.Tensor]]:
        """(what is wrong with the entry or None, its tensors). The weights are hashed through
        the very mapping the tensors are views of, so checking them costs one pass over
        pages the first forward would fault in anyway."""
        try:
            info = json.loads((entry / ENTRY).read_text())
        except (OSError, ValueError) as e:
            return f"no valid {ENTRY} ({e})", {}
        if info.get("layout_version") != LAYOUT_VERSION:
            return f"layout version {info.get('layout_version')}, not {LAYOUT_VERSION}", {}
        for name in (WEIGHTS, META):
            path = entry / name
            if not path.is_file() or path.stat().st_size != info.get(name, {}).get("bytes"):
                return f"{name} is missing or not {info.get(name, {}).get('bytes')} bytes", {}
        if file_digest(entry / META) != info[META].get("xxh3_128"):
            return f"{META} does not match its digest (corrupt)", {}
        with open(entry / WEIGHTS, "rb") as f:
            mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)  # private: the tensors may be written
        if xxhash.xxh3_128_hexdigest(mapped) != info[WEIGHTS].get("xxh3_128"):
            return f"{WEIGHTS} does not match its digest (corrupt)", {}
        try:
            return None, safetensors_views(mapped)
        except (ValueError, KeyError, TypeError) as e:
            return f"{WEIGHTS} cannot be read ({e})", {}

    def store(self, key: str, meta: GGUFModel, tensors: dict[str, torch.Tensor]) -> Path:
        """Write an entry atomically (another process storing the same key first wins), and
        reclaim entries of other layout versions of the same GGUF."""
        self.root.mkdir(parents=True, exist_ok=True)
        work = Path(tempfile.mkdtemp(prefix=f".{key}.", dir=self.root))
        try:
            weights_digest = write_safetensors(work / WEIGHTS, tensors)
            meta_json = {
                "path": meta.path,
                "config": asdict(meta.config),
                "tokenizer": asdict(meta.tokenizer),
                "file_type": meta.file_type,
                "digest": meta.digest,
            }
            (work / META).write_text(json.dumps(meta_json))
            info = {"layout_version": LAYOUT_VERSION, "gguf_digest": meta.digest}
            digests = {WEIGHTS: weights_digest, META: file_digest(work / META)}
            for name in (WEIGHTS, META):
                info[name] = {"bytes": (work / name).stat().st_size, "xxh3_128": digests[name]}
            (work / ENTRY).write_text(json.dumps(info))
            for name in (WEIGHTS, META, ENTRY):
                _fsync(work / name)
            _fsync(work)
            target = self.root / key
            try:
                os.rename(work, target)
            except OSError:  # an entry appeared meanwhile (another process): keep it
                shutil.rmtree(work, ignore_errors=True)
                return target
            _fsync(self.root)
        except BaseException:
            shutil.rmtree(work, ignore_errors=True)
            raise
        self._reclaim(key, meta.digest)
        return target

    def _reclaim(self, key: str, gguf_digest: str) -> None:
        for other in self.root.iterdir():
            if other.name == key or other.name.startswith("."):
                continue
            with contextlib.suppress(OSError, ValueError):
                info = json.loads((other / ENTRY).read_text())
                if info.get("gguf_digest") == gguf_digest and info.get("layout_version") != LAYOUT_VERSION:
                    shutil.rmtree(other, ignore_errors=True)


_DTYPES = {"F64": torch.float64, "F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
_DTYPE_NAMES = {dtype: name for name, dtype in _DTYPES.items()}


def write_safetensors(path: Path, tensors: dict[str, torch.Tensor]) -> str:
    """Write `tensors` as a safetensors file, streaming each tensor's bytes from its own
    memory, and return the file's xxh3_128, hashed as it is written. safetensors' own
    `save_file` (0.8) assembles the whole file in memory first: for SmolLM2 that is 513 MiB
    on top of the model, at the peak of a cold start. The format: an 8-byte little-endian
    header length, a JSON header (dtype, shape and byte range of each tensor), padded with
    spaces to 8 bytes, then the data in header order. tests/test_weight_cache.py reads what
    this writes with the safetensors library."""
    header, offset = {}, 0
    for name, tensor in tensors.items():
        if tensor.dtype not in _DTYPE_NAMES:
            raise ValueError(f"tensor {name!r}: no safetensors dtype for {tensor.dtype}")
        header[name] = {
            "dtype": _DTYPE_NAMES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + tensor.nbytes],
        }
        offset += tensor.nbytes
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    digest = xxhash.xxh3_128()
    with open(path, "wb") as f:
        for chunk in (struct.pack("<Q", len(head)), head):
            f.write(chunk)
            digest.update(chunk)
        for tensor in tensors.values():
            data = memoryview(tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy())
            f.write(data)
            digest.update(data)
    return digest.hexdigest()


def safetensors_views(buffer: mmap.mmap) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file as views of `buffer` (no copy): the format is an
    8-byte little-endian header length, a JSON header of dtype / shape / byte range per
    tensor, then the data."""
    (header_len,) = struct.unpack("<Q", buffer[:8])
    header = json.loads(buffer[8 : 8 + header_len])
    base = 8 + header_len
    tensors = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        dtype = _DTYPES[entry["dtype"]]
        begin, end = entry["data_offsets"]
        count = (end - begin) // dtype.itemsize
        shape = entry["shape"]
        if count != math.prod(shape) or base + end > len(buffer):
            raise ValueError(f"tensor {name!r}: {end - begin} bytes for shape {shape}")
        if count == 0:  # torch.frombuffer takes no empty range
            tensors[name] = torch.empty(shape, dtype=dtype)
            continue
        tensors[name] = torch.frombuffer(buffer, dtype=dtype, count=count, offset=base + begin).view(shape)
    return tensors


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
