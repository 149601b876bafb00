"""The signatures a docs page writes inline (`Name(a, b=1, *, c)`), parsed and compared with
`inspect.signature` of what they name, so a page cannot document an argument that is not
there or leave one out (a `...` in the list says: more arguments follow, not listed)."""

from __future__ import annotations

import ast
import importlib
import inspect
import re
from dataclasses import dataclass
from typing import Any

# the modules whose public names a page may write bare
MODULES = [
    "kvpool",
    "kvpool.llm",
    "kvpool.pool",
    "kvpool.cache",
    "kvpool.cache.coordinator",
    "kvpool.cache.group",
    "kvpool.cache.dual_pool",
    "kvpool.engine.runner",
    "kvpool.engine.build",
    "kvpool.engine.live",
    "kvpool.engine.llama_runner",
    "kvpool.engine.hybrid_runner",
    "kvpool.engine.dsv4_runner",
    "kvpool.engine.tier_bridge",
    "kvpool.attention.backends",
    "kvpool.attention.backends.step",
    "kvpool.attention.backends.paged_step",
    "kvpool.storage.dsv4",
    "kvpool.tiers",
    "kvpool.tiers.swa",
    "kvpool.sim.runner",
    "kvpool.sim.deployment",
    "kvpool.sim.sweep",
    "kvpool.workload.metrics",
]
# a dotted prefix a page writes for a module: `tier_bridge.take_evicted(cache)`
MODULE_ALIASES = {"tier_bridge": "kvpool.engine.tier_bridge", "kvpool.sim.runner": "kvpool.sim.runner"}


@dataclass(frozen=True)
class Param:
    name: str | None  # None: an argument written as an example value, not a name
    default: str | None  # the written default, "" for `name=` (a keyword, default not given)
    keyword_only: bool


@dataclass(frozen=True)
class Written:
    name: str
    params: tuple[Param, ...]
    complete: bool  # no `...`: every argument is listed
    text: str
    line: int


def _split_top(text: str) -> list[str]:
    parts, depth, quote, cur = [], 0, "", []
    for ch in text:
        if quote:
            cur.append(ch)
            if ch == quote:
                quote = ""
            continue
        if ch in "\"'":
            quote = ch
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append("".join(cur).strip())
            cur = []
            continue
        cur.append(ch)
    if "".join(cur).strip():
        parts.append("".join(cur).strip())
    return parts


def _closing(text: str, start: int) -> int:
    """The index of the parenthesis closing the one at `start`, or -1."""
    depth, quote = 0, ""
    for i in range(start, len(text)):
        ch = text[i]
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "\"'":
            quote = ch
        elif ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
            if depth == 0:
                return i
    return -1


def _written(name: str, args: str, text: str, line: int) -> Written:
    params, complete, keyword_only = [], True, False
    for part in _split_top(args):
        if part == "...":
            complete = False
        elif part == "*":
            keyword_only = True
        elif part.startswith("**"):
            complete = False
        else:
            param, eq, default = part.partition("=")
            param = param.strip()
            if re.fullmatch(r"[A-Za-z_]\w*", param):
                params.append(Param(param, default.strip() if eq else None, keyword_only))
            else:
                params.append(Param(None, None, keyword_only))
    return Written(name, tuple(params), complete, text, line)


def written_signatures(page: str) -> list[Written]:
    """Every inline code span of the page (fenced blocks left out) that is a call with its
    argument list: `name(args)` optionally followed by `-> X`; a returned `-> Name(fields)`
    is checked as a constructor too."""
    prose = re.sub(r"^```.*?^```\n", lambda m: "\n" * m.group(0).count("\n"), page, flags=re.S | re.M)
    found = []
    for m in re.finditer(r"`([^`]+)`", prose):
        span = " ".join(m.group(1).split())
        head = re.match(r"([A-Za-z_][\w.]*)\(", span)
        if not head:
            continue
        close = _closing(span, head.end() - 1)
        rest = span[close + 1 :].strip() if close >= 0 else None
        if rest is None or (rest and not rest.startswith("->")):
            continue
        line = prose.count("\n", 0, m.start()) + 1
        found.append(_written(head.group(1), span[head.end() : close], span, line))
        returned = re.fullmatch(r"->\s*([A-Z]\w*)\((.*)\)", rest)
        if returned:
            found.append(_written(returned.group(1), returned.group(2), rest, line))
    return found


def namespace() -> dict[str, Any]:
    names: dict[str, Any] = {}
    for module in MODULES:
        mod = importlib.import_module(module)
        for key, value in vars(mod).items():
            if not key.startswith("_") and (inspect.isclass(value) or inspect.isfunction(value)):
                names.setdefault(key, value)
    return names


def resolve(name: str, owners: list[Any], names: dict[str, Any]) -> Any:
    """What a written name calls: `Class.method`, `module.function` (a full path or an alias),
    a method of the classes in scope (latest first), else a public class or function."""
    if "." in name:
        prefix, _, attr = name.rpartition(".")
        if inspect.isclass(names.get(prefix)):
            return getattr(names[prefix], attr, None)
        module = MODULE_ALIASES.get(prefix, prefix)
        try:
            return getattr(importlib.import_module(module), attr, None)
        except ImportError:
            return None
    for owner in owners:
        value = inspect.getattr_static(owner, name, None)
        if value is not None and (inspect.isfunction(value) or isinstance(value, (staticmethod, classmethod))):
            return getattr(owner, name)
    return names.get(name)


def _default_matches(written: str, actual: Any) -> bool:
    # `"a" | "b"`: the choices, the first the default
    first = written.split("|")[0].strip()
    try:
        value = ast.literal_eval(first)
    except (ValueError, SyntaxError):
        return True  # a description (`256 MiB`), not a literal: not compared
    return value == actual and type(value) is type(actual)


def _names(written: str, actual: str) -> bool:
    """A written parameter name names the actual one: the same, or one of the page's two
    abbreviations, `id` / `ids` for a `*_id` / `*_ids` and `n` for a `num_*`."""
    return (
        written == actual
        or (written == "id" and actual.endswith("_id"))
        or (written == "ids" and actual.endswith("_ids"))
        or (written == "n" and actual.startswith("num_"))
    )


def mismatches(written: Written, target: Any) -> list[str]:
    """What the written signature gets wrong about `target`'s, each a line; [] when none.
    A class's (its constructor's) must list every parameter or say `...`; a function's or a
    method's may leave out parameters that have a default."""
    try:
        sig = inspect.signature(target)
    except (TypeError, ValueError):
        return []
    actual = [p for p in sig.parameters.values() if p.name not in ("self", "cls")]
    where = f"line {written.line}: `{written.text[:100]}`"
    problems = []
    params = list(written.params)
    for i, p in enumerate(params):
        if p.name is None:  # an example value: it stands for the parameter at its place
            if i >= len(actual) or actual[i].kind is actual[i].KEYWORD_ONLY:
                problems.append(f"{where}: argument {i + 1} is not a positional parameter")
                continue
            params[i] = Param(actual[i].name, None, False)
    matched = []
    for p in params:
        real = next((q for q in actual if q not in matched and _names(p.name, q.name)), None)
        if real is None:
            if not any(q.kind is q.VAR_KEYWORD for q in actual):
                problems.append(f"{where}: no parameter {p.name!r} (the code's: {[q.name for q in actual]})")
            continue
        matched.append(real)
        if written.complete and p.keyword_only != (real.kind is real.KEYWORD_ONLY):
            problems.append(f"{where}: {real.name!r} is {'' if real.kind is real.KEYWORD_ONLY else 'not '}keyword-only")
        if p.default:
            if real.default is real.empty:
                problems.append(f"{where}: {real.name!r} has no default")
            elif not _default_matches(p.default, real.default):
                problems.append(f"{where}: {real.name!r} defaults to {real.default!r}, not {p.default}")
    if matched != [q for q in actual if q in matched]:
        problems.append(f"{where}: parameters out of order (the code's: {[q.name for q in actual]})")
    variadic = (inspect.Parameter.VAR_KEYWORD, inspect.Parameter.VAR_POSITIONAL)
    left_out = [q for q in actual if q not in matched and q.kind not in variadic]
    if not written.complete:  # `...`: the rest, whatever it is
        left_out = []
    elif not inspect.isclass(target):
        left_out = [q for q in left_out if q.default is q.empty]
    if left_out:
        problems.append(f"{where}: leaves out {[q.name for q in left_out]} (write them, or `...`)")
    return problems


def page_mismatches(
    page: str, owners_by_section: dict[str, list[Any]], not_api: set[str] = frozenset()
) -> tuple[list[str], list[str]]:
    """(the problems, the written names that were checked) of a page. A bare method name is
    looked up on the classes named earlier in its bullet (latest first), then on its
    section's owners (`owners_by_section`, keyed by the heading's text); a call that names
    nothing is a problem unless `not_api` lists it (prose like `min(a, b)`)."""
    names = namespace()
    lines = page.splitlines()
    section_at, bullet_at = [], []
    section, bullet = "", 0
    for i, line in enumerate(lines, 1):
        if line.startswith("#"):
            section = line.lstrip("#").strip()
        if line.startswith("- ") or line.startswith("#") or not line.strip():
            bullet = i
        section_at.append(section)
        bullet_at.append(bullet)
    spans = written_signatures(page)
    classes_at: list[tuple[int, Any]] = []  # (line, class) of every class a span names
    prose = re.sub(r"^```.*?^```\n", lambda m: "\n" * m.group(0).count("\n"), page, flags=re.S | re.M)
    for m in re.finditer(r"`([A-Z]\w*)[(`.]", prose):
        if inspect.isclass(names.get(m.group(1))):
            classes_at.append((prose.count("\n", 0, m.start()) + 1, names[m.group(1)]))
    problems, checked = [], []
    for w in spans:
        start = bullet_at[w.line - 1]
        owners = [c for line, c in reversed(classes_at) if start <= line <= w.line]
        owners += owners_by_section.get(section_at[w.line - 1], [])
        target = resolve(w.name, owners, names)
        if target is None:
            if w.name not in not_api:
                problems.append(f"line {w.line}: `{w.text[:100]}`: names nothing in kvpool")
            continue
        checked.append(w.name)
        problems += mismatches(w, target)
    return problems, checked
