"""The layer map of ARCHITECTURE.md, enforced over every import of every module.

Lower layers never import higher ones. Every `import` / `from ... import` statement counts,
wherever it stands: at module level, inside a function (a lazy import), or under
`if TYPE_CHECKING:`. A package not in LAYERS fails the test until it is given its place.
"""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import kvpool

# Lowest first. `kernels` (the C kernels and their ctypes bindings) sits below the tensor
# layers that call it; `llm` (kvpool.LLM) generates through the engine; `sim` (the simulator)
# drives the engine; `server` (kvpool serve and its load generator, which replays workload's
# chat) serves the engine over HTTP;
# `verify` (verification programs) above the engine it drives; `bench` (the benchmarks'
# measurements) drives the engine, the simulator, the tiers and the server, below the CLI that
# parses their flags and prints their results.
LAYERS = (
    "spec",
    "workload",  # what runs send and measure (pure Python over numpy): sim, server and cli share it
    "capacity",
    "pool",
    "cache",
    "kernels",
    "storage",
    "tiers",
    "attention",
    "models",
    "engine",
    "llm",  # kvpool.LLM, the high-level Python API over the engine (kvpool/llm.py)
    "sim",
    "server",
    "verify",
    "bench",
    "cli",
)
RANK = {name: i for i, name in enumerate(LAYERS)}
NO_TORCH = ("pool", "cache")  # pure-Python bookkeeping: it also runs inside the simulator
SRC = Path(kvpool.__file__).parent


def _imported_modules(tree: ast.AST, module: str, is_package: bool) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in `tree`, relative ones resolved."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = module.split(".")
                base = parts if is_package else parts[:-1]
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            found.append((node.lineno, target))
            # `from kvpool import cache` names a subpackage, not the root facade
            found += [(node.lineno, f"{target}.{alias.name}") for alias in node.names if target == "kvpool"]
    return found


def _layer(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[0] == "kvpool" else None


def layering_violations(src: Path) -> list[str]:
    """Every import in the package under `src` that breaks the layer map, as readable lines."""
    problems: list[str] = []
    root_rank = -1  # the root facade (kvpool/__init__.py) ranks as the highest layer it imports
    modules: list[tuple[Path, str, bool]] = []
    for path in sorted(src.rglob("*.py")):
        rel = path.relative_to(src.parent).with_suffix("")
        is_package = rel.name == "__init__"
        name = ".".join(rel.parts[:-1] if is_package else rel.parts)
        modules.append((path, name, is_package))
    trees = {name: ast.parse(path.read_text(), str(path)) for path, name, _ in modules}
    for _line, target in _imported_modules(trees["kvpool"], "kvpool", True):
        layer = _layer(target)
        if layer is not None and layer in RANK:
            root_rank = max(root_rank, RANK[layer])
    for path, name, is_package in modules:
        layer = _layer(name)
        if layer is None or layer == "__main__":
            continue  # the root facade and `python -m kvpool` (which starts the CLI)
        if layer not in RANK:
            problems.append(f"{path}: package kvpool.{layer} has no place in LAYERS")
            continue
        for line, target in _imported_modules(trees[name], name, is_package):
            top = target.split(".")[0]
            if layer in NO_TORCH and top == "torch":
                problems.append(f"{path}:{line}: {name} imports torch ({layer} is pure Python)")
            if top != "kvpool":
                continue
            target_layer = _layer(target)
            target_rank = root_rank if target_layer is None else RANK.get(target_layer)
            if target_rank is None:
                problems.append(f"{path}:{line}: {name} imports {target}, which has no place in LAYERS")
            elif target_rank > RANK[layer]:
                problems.append(f"{path}:{line}: {name} ({layer}) imports {target} from a higher layer")
    return problems


def test_no_module_imports_a_higher_layer():
    assert layering_violations(SRC) == []


def test_the_check_catches_a_planted_upward_import(tmp_path):
    # A lazy import of the CLI inside pool/hashing.py, and a torch import in the cache layer.
    tree = tmp_path / "kvpool"
    shutil.copytree(SRC, tree, ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    hashing = tree / "pool" / "hashing.py"
    hashing.write_text(hashing.read_text() + "\n\ndef _planted():\n    import kvpool.cli.main  # noqa\n")
    types = tree / "cache" / "types.py"
    types.write_text(types.read_text() + "\nif False:\n    from torch import Tensor  # noqa\n")
    problems = layering_violations(tree)
    assert len(problems) == 2, problems
    assert "kvpool.pool.hashing (pool) imports kvpool.cli.main from a higher layer" in problems[0] + problems[1]
    assert any("kvpool.cache.types imports torch" in p for p in problems)


def test_pool_and_cache_import_no_torch_at_run_time():
    pkgs = [SRC / "pool", SRC / "cache"]
    modules = [f"kvpool.{p.name}.{m.stem}" for p in pkgs for m in sorted(p.glob("*.py")) if m.stem != "__init__"]
    code = f"import sys\nfor m in {modules!r}: __import__(m)\nprint('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", f"one of {modules} imports torch"


def test_cli_help_imports_no_torch():
    code = "import sys\nfrom kvpool.cli.main import build_parser\nbuild_parser()\nprint('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", "a command module imports torch at import time"
