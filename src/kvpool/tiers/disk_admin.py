"""What `kvpool cache` does to a disk cache directory, apart from the tier that serves it
(disk.py): check a directory is one, list its entries with what each holds (every checksum
verified, or the headers alone), summarize them, and clear them.

Each only reads, or removes whole files: safe while engines use the directory, which treat
a removed entry as a miss. A temp file whose writer is alive is never removed (that would
only fail its write).

Each tells a `Progress` of every answer from the file system, naming what it asks next:
`kvpool cache` runs them on a worker under disk.py's `bounded`, which waits while the
answers come and, on a hung mount, ends the command with one line naming the directory, the
entry or directory it waited on, and the deadline (it hung for ever).
"""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from kvpool.tiers import entry
from kvpool.tiers.deadline import Progress
from kvpool.tiers.descriptor import BlockDescriptor
from kvpool.tiers.disk import MARKER, SUFFIX, _open_entry, cache_path, scan_entries, temp_file_owner_alive


@dataclass(frozen=True)
class EntryInfo:
    path: Path
    num_bytes: int
    mtime_ns: int
    descriptor: BlockDescriptor | None  # None: the entry does not check out
    problem: str  # "" or why not
    other_version: bool = False  # written by a kvpool of another entry format (not ours to judge)
    # under a namespace directory that is not its descriptor's: no engine looks there (an
    # entry written before the namespace held the weights version, b8b77ad; review 9)
    stranded: bool = False


# how `kvpool cache stats` and `ls` name an entry under a namespace not its own
STRANDED = "stranded: under a namespace not its own (written before it held the weights version), never found"


def existing_cache(directory: str | os.PathLike, progress: Progress | None = None) -> Path:
    """A directory that holds a kvpool disk cache (nothing is created); ValueError otherwise."""
    root = cache_path(directory)
    progress = progress or Progress()
    try:
        progress.step(root)
        if not root.exists():
            raise ValueError(f"disk cache {str(root)!r} does not exist")
        if not root.is_dir():
            raise ValueError(f"disk cache {str(root)!r} is a file, not a directory")
        progress.step(root / MARKER)
        if not (root / MARKER).exists():
            raise ValueError(f"{str(root)!r} is not a kvpool disk cache (no {MARKER} marker)")
    except OSError as error:  # a parent the user may not enter (Path.exists raises all but ENOENT-like errors)
        raise ValueError(f"disk cache {str(root)!r} cannot be reached: {error.strerror or error}") from None
    return root


def unlisted_dirs(root: Path, progress: Progress | None = None) -> list[Path]:
    """The directories of root/entries (itself, a namespace's, a key prefix's) this user may
    not list, in name order: Path.glob, which finds the entries, skips them without a word,
    so their entries are missing from what `inspect_cache` returns. Their own directories
    are not looked into."""
    progress = progress or Progress()
    out: list[Path] = []
    level = [root / "entries"]
    for depth in range(3):  # entries/ | <namespace>/ | <key prefix>/ <key>.kvb
        below: list[Path] = []
        for directory in level:
            progress.step(directory)
            try:
                if not os.access(directory, os.R_OK | os.X_OK):  # (False for a path gone too)
                    if not os.path.lexists(directory):
                        continue  # removed meanwhile, or no entries/ yet
                    raise PermissionError
                if depth < 2:
                    below += sorted(p for p in directory.iterdir() if p.is_dir() and not p.is_symlink())
            except FileNotFoundError:  # removed meanwhile (a clear)
                continue
            except PermissionError:
                out.append(directory)
        level = below
    return out


def inspect_cache(root: Path, *, verify: bool = True, progress: Progress | None = None) -> list[EntryInfo]:
    """Every entry, checked without changing anything, least recently used first: read
    whole and every checksum verified (a corrupted payload found), or with verify=False
    its header only, as a lookup checks it."""
    progress = progress or Progress()
    out = []
    for path, st in scan_entries(root, progress):
        progress.step(path)
        descriptor, problem, other_version = None, "", False
        try:
            key = _entry_key(path)
            with _open_entry(path) as f:
                if verify:
                    descriptor = entry.decode(f.read(), key)[0]
                else:
                    n = entry.header_length(f.read(8))
                    descriptor = entry.read_header(f.read(n), key)[0]
        except entry.OtherVersion as error:
            problem, other_version = str(error), True
        except (ValueError, OSError) as error:  # CorruptEntry is a ValueError
            problem = str(error)
        stranded = descriptor is not None and path.parent.parent.name != entry.namespace(descriptor)
        out.append(EntryInfo(path, st.st_size, st.st_mtime_ns, descriptor, problem, other_version, stranded))
    return out


def _entry_key(path: Path) -> bytes:
    """The content key an entry's file name holds; ValueError for a name that is no entry's
    (the tier indexes `<key in lower-case hex>.safetensors` only: bytes.fromhex also took
    upper case and spaces, and `kvpool cache ls / stats` listed and counted as an entry a copy
    the tier never reads; audit5 #6)."""
    try:
        key = bytes.fromhex(path.name.removesuffix(SUFFIX))
    except ValueError:
        key = None
    if key is None or path.name != f"{key.hex()}{SUFFIX}":
        raise ValueError(f"not an entry's name (a key in lower-case hex, then {SUFFIX}): the tier never reads it")
    return key


def summarize_cache(root: Path, infos: list[EntryInfo], progress: Progress | None = None) -> dict[str, object]:
    """`kvpool cache stats`: entries and bytes in all and per model (model id, weights
    version, layout; stranded ones apart), the unreadable and other-version ones, tenants,
    and what waits in quarantine/ and tmp/. `infos`: inspect_cache(root)."""
    by_model: Counter[str] = Counter()
    bytes_by_model: Counter[str] = Counter()
    tenants = set()
    for info in infos:
        d = info.descriptor
        if d is not None:
            name = f"{d.model_id} ({d.weights_version[:12]}, {d.layout_id})"
            name += f", {STRANDED}" if info.stranded else ""
        else:
            name = "other version" if info.other_version else "unreadable"
        by_model[name] += 1
        bytes_by_model[name] += info.num_bytes
        if d is not None:
            tenants.add(d.tenant)
    progress = progress or Progress()
    progress.step(root / "quarantine")
    quarantined = list((root / "quarantine").glob("*"))
    quarantined_bytes = sum(_size(p, progress) for p in quarantined)
    progress.step(root / "tmp")
    temps = list((root / "tmp").glob("*.tmp"))
    return {
        "directory": str(root),
        "entries": len(infos),
        "bytes": sum(i.num_bytes for i in infos),
        "unreadable": sum(i.descriptor is None and not i.other_version for i in infos),
        "other_version": sum(i.other_version for i in infos),
        "stranded": sum(i.stranded for i in infos),  # (listed under models too, said so)
        "tenants": len(tenants),
        "models": {name: {"entries": n, "bytes": bytes_by_model[name]} for name, n in sorted(by_model.items())},
        "quarantined": len(quarantined),
        "quarantined_bytes": quarantined_bytes,
        "temp_files": len(temps),
        "unlisted_dirs": [str(p) for p in unlisted_dirs(root, progress)],  # (their entries are not counted above)
    }


def _size(path: Path, progress: Progress) -> int:
    progress.step(path)
    try:
        return path.lstat().st_size
    except FileNotFoundError:  # removed meanwhile
        return 0


@dataclass(frozen=True)
class Cleared:
    num_removed: int  # files
    num_kept: int  # temp files of live writers
    errors: tuple[OSError, ...]  # what could not be removed


def clear_cache(root: Path, quarantine_only: bool = False, progress: Progress | None = None) -> Cleared:
    """Remove every entry, quarantined entry and dead writer's temp file (quarantine_only:
    the last two only). A failed removal is collected, not raised: the others go on."""
    progress = progress or Progress()
    removed, kept, failed = 0, 0, []
    targets = ["quarantine", "tmp"] if quarantine_only else ["entries", "quarantine", "tmp"]
    for sub in targets:
        progress.step(root / sub)
        try:
            paths = sorted((root / sub).iterdir()) if (root / sub).is_dir() else []
        except OSError as error:  # a directory the user may not read or enter: said, the others go on
            failed.append(error)
            continue
        for path in paths:
            progress.step(path)
            if sub == "tmp" and path.suffix == ".tmp" and temp_file_owner_alive(path):
                kept += 1  # a write in progress: removing it would only make that write fail
                continue
            try:
                if path.is_dir() and not path.is_symlink():
                    removed += _remove_tree(path, progress, failed)
                else:
                    path.unlink(missing_ok=True)
                    removed += 1
            except OSError as error:
                failed.append(error)
    return Cleared(removed, kept, tuple(failed))


def _remove_tree(top: Path, progress: Progress, failed: list[OSError]) -> int:
    """shutil.rmtree, each removal told to `progress` (a namespace of thousands of entries on
    a slow disk takes long, and answers all along): the files removed. A file or directory
    that cannot be removed is appended to `failed` and the others go on (the first stopped
    the whole namespace, counted as one: audit5 #4); a directory left non-empty by one is
    not counted again."""
    removed = 0
    kept: set[str] = set()  # directories that keep something that could not be removed

    def unlisted(error: OSError) -> None:  # (a directory that cannot be listed: kept whole)
        failed.append(error)
        if error.filename is not None:
            kept.add(os.path.dirname(os.fsdecode(error.filename)))
            kept.add(os.fsdecode(error.filename))

    for below, dirs, files in os.walk(top, topdown=False, onerror=unlisted):
        for name in files + [d for d in dirs if os.path.islink(os.path.join(below, d))]:
            progress.step(os.path.join(below, name))
            try:
                os.unlink(os.path.join(below, name))
                removed += 1
            except FileNotFoundError:  # removed meanwhile (an engine's eviction)
                pass
            except OSError as error:
                failed.append(error)
                kept.add(below)
        progress.step(below)
        if below in kept:
            kept.add(os.path.dirname(below))
            continue
        try:
            os.rmdir(below)
        except FileNotFoundError:
            pass
        except OSError as error:
            failed.append(error)
            kept.add(os.path.dirname(below))
    return removed
