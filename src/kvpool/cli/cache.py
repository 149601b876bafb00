"""`kvpool cache ls|stats|clear DIR`: inspect and clean a disk prefix cache (--disk-cache);
the work is kvpool/tiers/disk_admin.py's, this parses and prints.

ls and stats only read: each entry whole, every checksum verified (--headers-only: the
header alone, as a lookup checks it; fast, but blind to a corrupted payload). Entries of
another kvpool's entry format are counted apart ("other_version"), not as unreadable.
clear removes entries (all, or only the quarantined and the temp files with
--quarantine); a temp file whose writer is alive is kept (removing it would only fail
that write). Safe while engines use the directory: they treat a removed entry as a miss.
Every file operation answers within --timeout of the last (10 s, the disk tier's open
deadline), or the command ends in one line naming the directory and the entry or directory
it waited on (a hung mount: it hung for ever), status 2.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import NamedTuple

from kvpool.cli.args import deadline_seconds


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
    parser.add_argument(
        "--timeout",
        type=deadline_seconds,
        default=10.0,
        metavar="S",
        help="seconds to wait for each answer of the directory's file system (a hung mount ends the command in "
        "one line naming what it waited on; a large directory on a slow disk is waited for whole)",
    )


def _shown(value: object) -> str:
    """`value` as text for the terminal, its unprintable characters escaped as Python writes them
    (\\x1b, \\n, \\u202e): a descriptor's strings and the file names come from whoever wrote
    the shared directory, and printed raw, an escape sequence reached the terminal and a
    newline forged a line of the listing (audit5 #3). --json escapes them already."""
    text = str(value)
    return text if text.isprintable() else "".join(c if c.isprintable() else ascii(c)[1:-1] for c in text)


class _Read(NamedTuple):
    """What the command found in the directory (`_read`), printed after."""

    root: Path
    infos: list  # ls / stats: disk_admin.EntryInfo, least recently used first
    summary: dict | None  # stats'
    unlisted: list  # ls / stats: the directories that could not be listed
    cleared: object  # clear's disk_admin.Cleared


def _read(args: argparse.Namespace, progress) -> _Read:
    """The command's file work, on a worker under `bounded` (each answer told to `progress`)."""
    from kvpool.tiers.disk_admin import clear_cache, existing_cache, inspect_cache, summarize_cache, unlisted_dirs

    root = existing_cache(args.directory, progress)
    if args.action == "clear":
        return _Read(root, [], None, [], clear_cache(root, args.quarantine, progress))
    infos = inspect_cache(root, verify=not args.headers_only, progress=progress)
    if args.action == "stats":
        summary = summarize_cache(root, infos, progress)
        return _Read(root, infos, summary, summary["unlisted_dirs"], None)
    return _Read(root, infos, None, unlisted_dirs(root, progress), None)


def _clear(root: Path, quarantine_only: bool, cleared) -> int:
    kept = cleared.num_kept
    what = " (quarantine and temp files)" if quarantine_only else ""
    alive = f"; {kept} temp file of a live writer kept" if kept == 1 else ""
    alive = alive or (f"; {kept} temp files of live writers kept" if kept else "")
    print(f"kvpool cache: removed {cleared.num_removed} files from {root}{what}{alive}")
    if cleared.errors:
        print(
            f"kvpool cache: {len(cleared.errors)} could not be removed, the first: {_shown(cleared.errors[0])}",
            file=sys.stderr,
        )
        return 1
    return 0


def _unlisted(unlisted: list) -> int:
    """A line on stderr naming the directories `kvpool cache ls / stats` could not list (their
    entries are missing from its output; Path.glob skipped them silently); the exit status:
    1 when there are any. (stats': those of its summary, so that the line and it agree.)"""
    if not unlisted:
        return 0
    what = "1 directory" if len(unlisted) == 1 else f"{len(unlisted)} directories"
    shown = ", ".join(map(_shown, unlisted[:3])) + (", ..." if len(unlisted) > 3 else "")
    print(
        f"kvpool cache: {what} could not be listed (permission denied): {shown}; their entries are not shown",
        file=sys.stderr,
    )
    return 1


def run(args: argparse.Namespace) -> int:
    from kvpool.tiers.disk import bounded, cache_path
    from kvpool.tiers.disk_admin import STRANDED

    # A flag of the other actions was dropped without a word: `ls --quarantine` listed every
    # entry, and `clear --json` / `clear --headers-only` removed every entry (a user who meant
    # a look first lost the cache). Refused before the directory is touched.
    other = {"clear": ("--json", "--headers-only"), "ls": ("--quarantine",), "stats": ("--quarantine",)}[args.action]
    given = [flag for flag in other if getattr(args, flag.lstrip("-").replace("-", "_"))]
    if given:
        owner = "clear" if args.action != "clear" else "ls / stats"
        raise ValueError(f"{given[0]} is an option of {owner}, not of {args.action}; nothing was done")
    # (a hung mount hung the command for ever: every answer within --timeout of the last)
    doing = f"as `kvpool cache {args.action}` read it (--timeout {args.timeout:g})"
    found = bounded(cache_path(args.directory), doing, args.timeout, _read, args)
    root, infos, summary = found.root, found.infos, found.summary
    if args.action == "clear":
        return _clear(root, args.quarantine, found.cleared)
    if summary is not None:
        if args.json:
            print(json.dumps(summary))
        else:
            for key, value in summary.items():
                if key == "models":
                    print("models:")
                    for name, v in value.items():
                        print(f"  {_shown(name)}: {v['entries']} entries, {v['bytes'] / 2**20:.1f} MiB")
                else:
                    print(f"{key}: {_shown(value)}")
        return _unlisted(found.unlisted)
    rows = [
        {
            "key": i.path.name.split(".")[0],
            "bytes": i.num_bytes,
            "last_used": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(i.mtime_ns / 1e9)),
            "tokens": i.descriptor.num_computed_tokens if i.descriptor else None,
            "model": i.descriptor.model_id if i.descriptor else None,
            "weights_version": i.descriptor.weights_version if i.descriptor else None,
            "stranded": i.stranded,
            "tenant": i.descriptor.tenant if i.descriptor else None,
            "problem": i.problem,
            "other_version": i.other_version,
        }
        for i in infos
    ]
    if args.json:
        print(json.dumps({"directory": str(root), "entries": rows}))
        return _unlisted(found.unlisted)
    print(f"{'key':32}  {'bytes':>9}  {'last used':19}  {'ends at':>7}  model")
    for r in rows:
        end = r["tokens"] if r["tokens"] is not None else "?"
        model = r["model"] or f"{'other version' if r['other_version'] else 'unreadable'}: {r['problem']}"
        model += f" ({STRANDED})" if r["stranded"] else ""
        print(f"{_shown(r['key']):32}  {r['bytes']:>9}  {r['last_used']:19}  {end:>7}  {_shown(model)}")
    return _unlisted(found.unlisted)
