"""`kvpool cache ls|stats|clear DIR`: inspect and clean a disk prefix cache (--disk-cache).

ls and stats only read (each entry's header, checked like a lookup checks it); clear
removes entries (all, or only the quarantined and the temp files with --quarantine).
Safe while engines use the directory: they treat a removed entry as a miss.
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from collections import Counter


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", choices=("ls", "stats", "clear"), help="list entries, summarize, or remove them")
    parser.add_argument("directory", metavar="DIR", help="the --disk-cache directory")
    parser.add_argument("--json", action="store_true", help="ls / stats: one JSON object")
    parser.add_argument(
        "--quarantine", action="store_true", help="clear: only the quarantined entries and stale temp files"
    )


def _summary(root, infos) -> dict[str, object]:
    by_model: Counter[str] = Counter()
    bytes_by_model: Counter[str] = Counter()
    tenants = set()
    for info in infos:
        d = info.descriptor
        name = f"{d.model_id} ({d.weights_version[:12]}, {d.layout_id})" if d is not None else "unreadable"
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
        "unreadable": sum(i.descriptor is None for i in infos),
        "tenants": len(tenants),
        "models": {name: {"entries": n, "bytes": bytes_by_model[name]} for name, n in sorted(by_model.items())},
        "quarantined": len(quarantined),
        "quarantined_bytes": sum(p.stat().st_size for p in quarantined),
        "temp_files": len(temps),
    }


def run(args: argparse.Namespace) -> int:
    from kvpool.tiers.disk import existing_cache, inspect_cache

    root = existing_cache(args.directory)
    if args.action == "clear":
        removed = 0
        targets = ["quarantine", "tmp"] if args.quarantine else ["entries", "quarantine", "tmp"]
        for sub in targets:
            for path in (root / sub).iterdir() if (root / sub).exists() else []:
                if path.is_dir():
                    removed += sum(1 for p in path.rglob("*") if p.is_file())
                    shutil.rmtree(path, ignore_errors=True)
                else:
                    path.unlink(missing_ok=True)
                    removed += 1
        what = " (quarantine and temp files)" if args.quarantine else ""
        print(f"kvpool cache: removed {removed} files from {root}{what}")
        return 0
    infos = inspect_cache(root)
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
        }
        for i in infos
    ]
    if args.json:
        print(json.dumps({"directory": str(root), "entries": rows}))
        return 0
    print(f"{'key':32}  {'bytes':>9}  {'last used':19}  {'ends at':>7}  model")
    for r in rows:
        end = r["tokens"] if r["tokens"] is not None else "?"
        model = r["model"] or f"unreadable: {r['problem']}"
        print(f"{r['key']:32}  {r['bytes']:>9}  {r['last_used']:19}  {end:>7}  {model}")
    return 0
