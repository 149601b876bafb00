"""Fenced blocks of the README and docs pages, and how their commands run in the tests."""

from __future__ import annotations

import os
import re
import shlex
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BOX = re.compile(r"[│┃┌┐└┘├┤┬┴┼─━┏┓┗┛┡┩╇]")


def fenced_blocks(text: str) -> list[tuple[str, str, str | None]]:
    """(language, body, the plain block right after it or None) of every fenced block with a
    language; a plain block (no language) that follows one is its output."""
    blocks = re.findall(r"^```(\w*)\n(.*?)^```\n", text, re.S | re.M)
    found = []
    for i, (lang, body) in enumerate(blocks):
        if not lang:
            continue
        after = blocks[i + 1] if i + 1 < len(blocks) else None
        found.append((lang, body, after[1] if after is not None and not after[0] else None))
    return found


def normalized(line: str) -> str:
    """A line of a table without its box drawing and padding: an excerpt matches however
    wide the table was drawn."""
    return " ".join(BOX.sub(" ", line).split())


def assert_excerpt(expected: str, printed: str) -> None:
    lines = {normalized(line) for line in printed.splitlines()}
    for line in expected.splitlines():
        if line.strip():
            assert normalized(line) in lines, f"the README shows {line.strip()!r}; the command printed:\n{printed}"


def env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}


def as_run_here(command: str) -> str:
    """The README's `python3` is this interpreter (the environment the tests run in)."""
    return re.sub(r"(^|&& )python3 ", lambda m: m.group(1) + shlex.quote(sys.executable) + " ", command)
