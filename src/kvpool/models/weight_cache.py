"""A cache of a GGUF's weights in the layout LlamaModel holds them, so a start skips the
GGUF reader (metadata parse, dequantization, fusing): safetensors, memory-mapped on load.

An entry lives under `$KVPOOL_CACHE_DIR/weights` (default ~/.cache/kvpool/weights), named
by a key of everything its bytes depend on: the GGUF's digest (xxh3_128 of the whole file),
the dtype, LAYOUT_VERSION (bump it when LlamaModel's stored layout changes) and a digest of
the code that computes the values (`code_version`: the reader, the model's layout, this
module, the gguf library's version). Files:

  weights.safetensors   every tensor of the model, as LlamaModel stores it
  meta.json             the GGUF's path, config, tokenizer data and file type
  entry.json            written last (its presence commits the entry): the layout version,
                        and the size and xxh3_128 of each of the two files above

Writes are atomic: the entry is built in a private directory, fsynced, then renamed into
place; a crash leaves no entry that is used. A load checks sizes and digests (~40 ms for
SmolLM2's 538 MB in the page cache): an entry that does not match (corrupt, truncated,
half-written, of another layout) is deleted and rebuilt from the GGUF, never used. Entries
of other versions of the same GGUF that have not been used for a day are reclaimed when a
new one is stored (two kvpool versions sharing the cache do not evict each other).
KVPOOL_WEIGHT_CACHE=0 turns the cache off.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import math
import mmap
import os
import shutil
import struct
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import torch
import xxhash

from kvpool.models.gguf import GGUFModel, LlamaConfig, TokenizerData, file_digest
from kvpool.tiers.disk import fsync_path

LAYOUT_VERSION = 2  # 2: the tied embedding is the LM head (no transposed copy); layers fused [in, out]
WEIGHTS, META, ENTRY = "weights.safetensors", "meta.json", "entry.json"


def enabled() -> bool:
    return os.environ.get("KVPOOL_WEIGHT_CACHE", "1") != "0"


def default_root() -> Path:
    return Path(os.environ.get("KVPOOL_CACHE_DIR") or Path.home() / ".cache" / "kvpool") / "weights"


@functools.cache
def code_version() -> str:
    """A digest of the code that makes an entry's values, so that a change to it can never
    be served the values of the code before: the GGUF reader (dequantization, the Q / K
    un-permutation, the names), the model's layout (fusing), this module's format, and the
    gguf library's version. Any edit of those files starts cold once (~7 s on SmolLM2)."""
    import importlib.metadata
    import importlib.util

    h = xxhash.xxh3_64()
    for module in ("kvpool.models.gguf", "kvpool.models.llama", "kvpool.models.weight_cache"):
        spec = importlib.util.find_spec(module)
        h.update(Path(spec.origin).read_bytes() if spec is not None and spec.origin else module.encode())
    try:
        h.update(importlib.metadata.version("gguf").encode())
    except importlib.metadata.PackageNotFoundError:
        h.update(b"gguf ?")
    return h.hexdigest()


def entry_key(gguf_digest: str, dtype: torch.dtype, layout_version: int | None = None) -> str:
    """The entry's name: a hash of everything its bytes depend on: the GGUF's bytes, the
    dtype, the layout version (the one this code writes unless another is named) and the
    code that made them (`code_version`)."""
    layout_version = LAYOUT_VERSION if layout_version is None else layout_version
    return xxhash.xxh3_64_hexdigest(f"{gguf_digest}|layout{layout_version}|{dtype}|{code_version()}".encode())


RECLAIM_AFTER_S = 86_400  # an entry of another version of the same GGUF, unused this long, is deleted
STALE_WORK_S = 3_600  # a write in progress this old was killed (an entry takes seconds to write)
_LOAD_ERRORS = (OSError, ValueError, KeyError, TypeError, AttributeError)


class WeightCache:
    def __init__(self, root: str | Path | None = None) -> None:
        self.root = Path(root) if root is not None else default_root()
        self.last_miss: str | None = None  # why the last load found nothing usable

    def load(self, key: str) -> tuple[GGUFModel, dict[str, torch.Tensor]] | None:
        """The entry's metadata and tensors (memory-mapped), or None when there is no usable
        entry; a broken one is deleted first (`last_miss` says why). Never raises for what
        it finds on disk: an unreadable or vanishing entry is a miss."""
        entry = self.root / key
        try:
            if not entry.is_dir():
                self.last_miss = "no entry"
                return None
            problem, loaded = self._check(entry)
        except _LOAD_ERRORS as e:
            problem, loaded = f"unreadable entry ({type(e).__name__}: {e})", None
        if problem is not None or loaded is None:
            self.last_miss = problem
            self._delete(entry)
            return None
        with contextlib.suppress(OSError):
            os.utime(entry / ENTRY)  # in use: not reclaimed by another version's store
        self.last_miss = None
        return loaded

    def _check(self, entry: Path) -> tuple[str | None, tuple[GGUFModel, dict[str, torch.Tensor]] | None]:
        """(what is wrong with the entry or None, its metadata and tensors). The weights are
        hashed through the very mapping the tensors are views of, so checking them costs one
        pass over pages the first forward would fault in anyway."""
        try:
            info = json.loads((entry / ENTRY).read_text())
        except (OSError, ValueError) as e:
            return f"no valid {ENTRY} ({e})", None
        if not isinstance(info, dict):
            return f"no valid {ENTRY} (not an object)", None
        if info.get("layout_version") != LAYOUT_VERSION:
            return f"layout version {info.get('layout_version')}, not {LAYOUT_VERSION}", None
        for name in (WEIGHTS, META):
            path = entry / name
            expected = info.get(name, {}).get("bytes") if isinstance(info.get(name), dict) else None
            if not path.is_file() or path.stat().st_size != expected:
                return f"{name} is missing or not {expected} bytes", None
        if file_digest(entry / META) != info[META].get("xxh3_128"):
            return f"{META} does not match its digest (corrupt)", None
        with open(entry / WEIGHTS, "rb") as f:
            # private: the model may write its tensors, the file keeps its bytes; the tensors
            # are views of the mapping and keep it alive (it is never closed while they live)
            mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        if xxhash.xxh3_128_hexdigest(mapped) != info[WEIGHTS].get("xxh3_128"):
            return f"{WEIGHTS} does not match its digest (corrupt)", None
        try:
            tensors = safetensors_views(mapped)
            meta = json.loads((entry / META).read_text())
            # every field of the config is required: an entry without one (written before
            # RoPE scaling or Qwen2's biases were read) is a miss, never a model with its
            # scaling or biases left out by a default
            absent = [f.name for f in dataclasses.fields(LlamaConfig) if f.name not in meta["config"]]
            if absent:
                raise KeyError(f"config lacks {absent}")
            divisors = meta["config"]["rope_freq_divisors"]
            divisors = None if divisors is None else tuple(divisors)
            config = LlamaConfig(**{**meta["config"], "rope_freq_divisors": divisors})
            tok = meta["tokenizer"]
            arrays = ("tokens", "merges", "token_types", "scores")
            tokenizer = TokenizerData(**{**tok, **{k: tuple(tok[k]) for k in arrays if k in tok}})
            model = GGUFModel(meta["path"], config, tokenizer, meta["file_type"], meta["digest"])
        except (ValueError, KeyError, TypeError) as e:
            return f"{WEIGHTS} or {META} cannot be read ({type(e).__name__}: {e})", None
        return None, (model, tensors)

    def _delete(self, entry: Path) -> None:
        """Remove an entry: renamed out of the way first (atomic: no other process sees it
        half deleted), then its files."""
        tomb = entry.with_name(f".dead-{entry.name}-{os.getpid()}")
        try:
            os.rename(entry, tomb)
        except OSError:
            tomb = entry  # gone already, or not ours to rename: remove what is there
        shutil.rmtree(tomb, ignore_errors=True)

    def store(self, key: str, meta: GGUFModel, tensors: dict[str, torch.Tensor]) -> Path:
        """Write an entry atomically (another process storing the same key first wins), and
        reclaim what is no longer used: entries of other versions of the same GGUF unused
        for RECLAIM_AFTER_S, and work directories of writes that were killed."""
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
            info = {"layout_version": LAYOUT_VERSION, "code_version": code_version(), "gguf_digest": meta.digest}
            digests = {WEIGHTS: weights_digest, META: file_digest(work / META)}
            for name in (WEIGHTS, META):
                info[name] = {"bytes": (work / name).stat().st_size, "xxh3_128": digests[name]}
            (work / ENTRY).write_text(json.dumps(info))
            for name in (WEIGHTS, META, ENTRY):
                fsync_path(work / name)
            fsync_path(work)
            target = self.root / key
            try:
                os.rename(work, target)
            except OSError:  # an entry appeared meanwhile (another process): keep it
                shutil.rmtree(work, ignore_errors=True)
                return target
            fsync_path(self.root)
        except BaseException:
            shutil.rmtree(work, ignore_errors=True)
            raise
        self._reclaim(key, meta.digest)
        return target

    def _reclaim(self, key: str, gguf_digest: str) -> None:
        now = time.time()
        for other in self.root.iterdir():
            with contextlib.suppress(OSError, ValueError, AttributeError):
                if other.name.startswith("."):  # a killed write, or a deletion cut short
                    if now - other.stat().st_mtime > STALE_WORK_S or other.name.startswith(".dead-"):
                        shutil.rmtree(other, ignore_errors=True)
                    continue
                if other.name == key:
                    continue
                info = json.loads((other / ENTRY).read_text())
                unused = now - (other / ENTRY).stat().st_mtime > RECLAIM_AFTER_S
                if info.get("gguf_digest") == gguf_digest and unused:
                    self._delete(other)


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
