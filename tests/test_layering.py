"""Layering rules of ARCHITECTURE.md that a refactor could silently break."""

from __future__ import annotations

import pkgutil
import subprocess
import sys

import kvpool.cache
import kvpool.pool


def _modules(package) -> list[str]:
    return [f"{package.__name__}.{m.name}" for m in pkgutil.iter_modules(package.__path__)]


def test_pool_and_cache_import_no_torch():
    modules = _modules(kvpool.pool) + _modules(kvpool.cache)
    code = f"import sys\nfor m in {modules!r}: __import__(m)\nprint('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", f"one of {modules} imports torch"


def test_cli_help_imports_no_torch():
    code = "import sys\nfrom kvpool.cli.main import build_parser\nbuild_parser()\nprint('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", "a command module imports torch at import time"
