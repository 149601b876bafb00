"""`kvpool cache ls|stats|clear DIR`: inspect and clean a disk prefix cache (--disk-cache).

ls and stats only read: each entry whole, every checksum verified (--headers-only: the
header alone, as a lookup checks it; fast, but blind to a corrupted payload). Entries of
another kvpool's entry format are counted apart ("other_version"), not as unreadable.
clear removes entries (all, or only the quarantined and the temp files with
--quarantine); a temp file whose writer is alive is kept (removing it would only fail
that write). Safe while engines use the directory: they treat a removed entry as a miss.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from collections import Counter
from pathlib import Path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", choices=("ls", "stats", "clear"), help="list entries, summarize, or remove them")
    parser.add_argument("directory", metavar="DIR", help="the --disk-cache directory")
    parser.add_argument("--json", action="store_true", help="ls / stats: one JSON object")
    parser.add_argument(
        "--quarantine", action="store_true", help="clear: only the quarantined entries and stale temp files"
    )
    parser.add_argument(
        "--headers-only",
        action="store_true",
        help="ls / stats: check each entry's header only (fast; a corrupted payload goes unseen)",
    )


def _summary(root, infos) -> dict[str, object]:
    by_model: Counter[str] = Counter()
    bytes_by_model: Counter[str] = Counter()
    tenants = set()
    for info in infos:
        d = info.descriptor
        if d is not None:
            name = f"{d.model_id} ({d.weights_version[:12]}, {d.layout_id})"
        else:
            name = "other version" if info.other_version else "unreadable"
        by_model[name] += 1
        bytes_by_model[name] += info.num_bytes
        if d is not None:
            tenants.add(d.tenant)
    quarantined = list((root / "quarantine").glob("*"))
    temps = list((root / "tmp").glob("*.tmp"))
    return {
        "directory": str(root),
        "entries": len(infos),
        "bytes": sum(i.num_bytes for i in infos),
        "unreadable": sum(i.descriptor is None and not i.other_version for i in infos),
        "other_version": sum(i.other_version for i in infos),
        "tenants": len(tenants),
        "models": {name: {"entries": n, "bytes": bytes_by_model[name]} for name, n in sorted(by_model.items())},
        "quarantined": len(quarantined),
        "quarantined_bytes": sum(_size(p) for p in quarantined),
        "temp_files": len(temps),
    }


def _size(path: Path) -> int:
    try:
        return path.lstat().st_size
    except FileNotFoundError:  # removed meanwhile
        return 0


def _clear(root: Path, quarantine_only: bool) -> int:
    from kvpool.tiers.disk import temp_file_owner_alive

    removed, kept, failed = 0, 0, []
    targets = ["quarantine", "tmp"] if quarantine_only else ["entries", "quarantine", "tmp"]
    for sub in targets:
        for path in sorted((root / sub).iterdir()) if (root / sub).is_dir() else []:
            if sub == "tmp" and path.suffix == ".tmp" and temp_file_owner_alive(path):
                kept += 1  # a write in progress: removing it would only make that write fail
                continue
            try:
                if path.is_dir() and not path.is_symlink():
                    removed += sum(1 for p in path.rglob("*") if not p.is_dir())
                    shutil.rmtree(path)
                else:
                    path.unlink(missing_ok=True)
                    removed += 1
            except OSError as error:
                failed.append(error)
    what = " (quarantine and temp files)" if quarantine_only else ""
    alive = f"; {kept} temp file of a live writer kept" if kept == 1 else ""
    alive = alive or (f"; {kept} temp files of live writers kept" if kept else "")
    print(f"kvpool cache: removed {removed} files from {root}{what}{alive}")
    if failed:
        print(f"kvpool cache: {len(failed)} could not be removed, the first: {failed[0]}", file=sys.stderr)
        return 1
    return 0


def run(args: argparse.Namespace) -> int:
    from kvpool.tiers.disk import existing_cache, inspect_cache

    root = existing_cache(args.directory)
    if args.action == "clear":
        return _clear(root, args.quarantine)
    infos = inspect_cache(root, verify=not args.headers_only)
    if args.action == "stats":
        summary = _summary(root, infos)
        if args.json:
            print(json.dumps(summary))
        else:
            for key, value in summary.items():
                if key == "models":
                    print("models:")
                    for name, v in value.items():
                        print(f"  {name}: {v['entries']} entries, {v['bytes'] / 2**20:.1f} MiB")
                else:
                    print(f"{key}: {value}")
        return 0
    rows = [
        {
            "key": i.path.name.split(".")[0],
            "bytes": i.num_bytes,
            "last_used": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(i.mtime_ns / 1e9)),
            "tokens": i.descriptor.num_computed_tokens if i.descriptor else None,
            "model": i.descriptor.model_id if i.descriptor else None,
            "tenant": i.descriptor.tenant if i.descriptor else None,
            "problem": i.problem,
            "other_version": i.other_version,
        }
        for i in infos
    ]
    if args.json:
        print(json.dumps({"directory": str(root), "entries": rows}))
        return 0
    print(f"{'key':32}  {'bytes':>9}  {'last used':19}  {'ends at':>7}  model")
    for r in rows:
        end = r["tokens"] if r["tokens"] is not None else "?"
        model = r["model"] or f"{'other version' if r['other_version'] else 'unreadable'}: {r['problem']}"
        print(f"{r['key']:32}  {r['bytes']:>9}  {r['last_used']:19}  {end:>7}  {model}")
    return 0
