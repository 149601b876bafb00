"""`kvpool` command line: one module per command, dispatched through a plain dict.

Each command module exposes `add_arguments(parser)` and `run(args) -> int`. Modules keep
their heavy imports (torch, models) inside `run`, so `kvpool --help` stays fast.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import importlib
import os
import signal
import sys
import threading
from collections.abc import Iterator

from kvpool.cli.args import HelpFormatter, Parser

# command name -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "bench": ("kvpool.cli.bench", "benchmarks"),
    "cache": ("kvpool.cli.cache", "inspect and clean a disk prefix cache: ls, stats, clear DIR"),
    "eval": ("kvpool.cli.eval", "quality evaluations"),
    "generate": (
        "kvpool.cli.generate",
        "generate text with SmolLM2-135M (or --model GGUF, or token ids with --model tiny-dsv4) on the paged cache",
    ),
    "run": ("kvpool.cli.run", "the main job: a chat workload through the engine, then the performance report"),
    "plan": ("kvpool.cli.plan", "capacity model, memory ledger and planner"),
    "simulate": (
        "kvpool.cli.simulate",
        "serving at GPU scale on the engine's scheduler and cache managers, a cost model for the forward",
    ),
    "serve": (
        "kvpool.cli.serve",
        "an OpenAI-compatible server (completions, chat, streaming) on the engine, with Prometheus metrics",
    ),
    "verify": ("kvpool.cli.verify", "verification programs against an independent reference"),
}

# the shell's status for a process ended by SIGINT (128 + 2)
EXIT_INTERRUPTED = 130
# ... and by SIGPIPE (128 + 13): its output's reader went away
EXIT_BROKEN_PIPE = 141
# ... and by SIGTERM (128 + 15): what `timeout`, systemd and Kubernetes send
EXIT_TERMINATED = 143


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised by a command's handler (`terminate_like_ctrl_c`) so that it stops
    as on Ctrl-C: what catches KeyboardInterrupt catches it; the status is 143."""


def _raise_terminated(signum, frame) -> None:
    raise Terminated


@contextlib.contextmanager
def terminate_like_ctrl_c() -> Iterator[None]:
    """Within the block SIGTERM raises Terminated; the previous handler is restored after.
    (Only the main thread may set handlers: elsewhere the block runs unchanged.)"""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def version() -> str:
    """kvpool's version as installed (pyproject.toml's)."""
    from importlib import metadata

    try:
        return metadata.version("kvpool")
    except metadata.PackageNotFoundError:
        return "unknown (not installed: pip install -e .)"


def build_parser() -> Parser:
    parser = Parser(
        prog="kvpool", description="kvpool: a KV-cache system for LLM inference", formatter_class=HelpFormatter
    )
    parser.add_argument("--version", action="version", version=f"kvpool {version()}")
    add_modules(parser.add_subparsers(dest="command", required=True), COMMANDS, "_run")  # bench sets "bench NAME"
    for name, command_parser in command_parsers(parser):  # (unknown_hint names the commands with an option)
        command_parser._kvpool_root, command_parser._kvpool_name = parser, name
    return parser


def add_modules(sub, modules: dict[str, tuple[str, str]], run_key: str, name_prefix: str = "") -> None:
    """One parser under `sub` per entry of `modules` (name -> (module, one-line help)), filled
    by the module's add_arguments; the parsed args carry the module's run under `run_key`
    and, under `_name`, `name_prefix + name` for the error lines. kvpool's commands and
    kvpool bench's benchmarks are both built this way."""
    for name, (module_name, help_text) in modules.items():
        module = importlib.import_module(module_name)
        command_parser = sub.add_parser(name, help=help_text, description=help_text, formatter_class=HelpFormatter)
        module.add_arguments(command_parser)
        command_parser.set_defaults(**{run_key: module.run, "_name": name_prefix + name})
        names = subcommand_names(command_parser)
        if names:  # the command's own subcommands, named in the list of commands: "benchmarks: pool, engine, ..."
            sub._choices_actions[-1].help = f"{help_text}: {', '.join(names)}"


def subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """`parser`'s subcommands by name (kvpool bench's benchmarks), {} if it has none."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def subcommand_names(parser: argparse.ArgumentParser) -> list[str]:
    return list(subcommands(parser))


def command_parsers(parser: argparse.ArgumentParser, prefix: str = "") -> list[tuple[str, argparse.ArgumentParser]]:
    """Every command's parser under `parser`, by its name ("run", "bench engine"), depth first;
    a command with subcommands is listed by them only."""
    found = []
    for name, sub in subcommands(parser).items():
        full = f"{prefix} {name}".strip()
        found += command_parsers(sub, full) if subcommands(sub) else [(full, sub)]
    return found


def parse(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """`parser`'s reading of `argv`; an argument no parser knows is one line naming the
    command that did not take it, with the closest option it has ("did you mean"), status 2."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args, unknown = parser.parse_known_args(argv)
    args._argv = argv  # what was typed (cli/args.py option_given: a flag given at its default)
    if unknown:
        command = parser
        for word in getattr(args, "_name", "").split():  # "bench engine": kvpool's, then bench's subcommand
            command = subcommands(command).get(word, command)
        command.error(f"unrecognized arguments: {' '.join(unknown)}{unknown_hint(command, unknown[0], argv)}")
    return args


def unknown_hint(command: argparse.ArgumentParser, word: str, argv: list[str]) -> str:
    """What to say after "unrecognized arguments: WORD ...": the option of `command` meant
    ("; did you mean --max-tokens?"), or the commands that have WORD (vLLM's `serve -tp 2`
    read "did you mean --dtype?": serve shards nothing)."""
    name = word.split("=")[0]
    # a former name (an alias) is suggested by the name that replaced it
    known = {s: a.option_strings[0] for a in command._actions for s in a.option_strings}
    # an option after "--" is a value there (`kvpool generate -- "-hi" --max-tokens 3` read
    # "did you mean --max-tokens?", the very option typed)
    after = argv[argv.index("--") + 1 :] if "--" in argv else []
    if name in known and word in after:
        return f" ({word} comes after '--', where every word is a value: give the options before '--')"
    if not word.startswith("-"):
        return ""
    # the same last word (run's --request-rate is simulate's --rate: spelling alone guessed
    # --requests), or close in spelling (--max-nun-seqs); a looser match guessed wrong (-tp:
    # --dtype, --trust-remote-code: --trust-tenant-header)
    close = [k for k in known if k.startswith("--") and k[2:] == name.rsplit("-", 1)[-1] and k != name][:1]
    close = close or difflib.get_close_matches(name, list(known), n=1, cutoff=0.7)
    hint = f"; did you mean {known[close[0]]}?" if close else ""
    root = getattr(command, "_kvpool_root", None)
    if root is not None and not close:
        has = [full for full, sub in command_parsers(root) if name in sub._option_string_actions]
        if has:
            own = getattr(command, "_kvpool_name", "this command")
            hint = f" ({name} is an option of {_listed(has)}, not of {own})"
        if name == "--gpu-memory-utilization" and "--kv-memory" in known:  # vLLM's way to size the pool
            hint += "; the KV pool's size is --kv-memory SIZE"
    return hint


def _listed(names: list[str]) -> str:
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"


def lost_peer_line(error: RuntimeError) -> str | None:
    """The one line for a torch.distributed collective that failed because a peer process
    went away (gloo's transport error), in a command that joined a process group; None for
    any other error. With two ranks the lost one is the other; with more, gloo cannot tell
    which (a tensor-parallel engine names it itself: models/tensor_parallel.py)."""
    dist = sys.modules.get("torch.distributed")  # (loaded only by a command that uses it)
    if dist is None or not dist.is_available():
        return None
    if dist.is_initialized():
        rank, world = dist.get_rank(), dist.get_world_size()
    else:  # a verifier destroys its group on the way out (verify tp / cp: their `finally`)
        try:
            rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        except (KeyError, ValueError):  # no group was ever formed
            return None
    from kvpool.models.tensor_parallel import TIMEOUT_ENV, gloo_reason  # (torch is loaded: dist is)

    text = str(error)
    reason, timed_out = gloo_reason(text)
    if not ("gloo" in text or timed_out):
        return None
    peer = f"rank {1 - rank}" if world == 2 else "a peer rank"
    if timed_out:
        return (
            f"rank {rank} of {world}: {peer} did not answer within the process group's timeout ({reason}); it "
            f"hangs or was stopped ({TIMEOUT_ENV} sets the wait), and the group cannot go on without it"
        )
    return f"rank {rank} of {world}: lost {peer} ({reason}); the process group cannot go on without it"


@contextlib.contextmanager
def _kvpool_warnings_as_lines(name: str) -> Iterator[None]:
    """A warning kvpool's own code raises (the C kernels that cannot be built) as one line,
    `kvpool NAME: warning: ...`, like the commands' other warnings: Python's format showed a
    file path and a line of kvpool's source to the user. Other libraries' warnings keep the
    handler they had."""
    import warnings

    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
    before = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):
        if os.path.abspath(filename).startswith(package):
            print(f"kvpool {name}: warning: {message}", file=sys.stderr if file is None else file)
        else:
            before(message, category, filename, lineno, file, line)

    warnings.showwarning = show
    try:
        yield
    finally:
        warnings.showwarning = before


def main(argv: list[str] | None = None) -> int:
    """Run one command. A caller's mistake (a bad value, a missing file) is reported as one
    line naming the problem, exit status 2; Ctrl-C as one line, status 130.
    KVPOOL_TRACEBACK=1 shows the traceback instead."""
    try:
        # (building the parser imports every command module, numpy's load included: the first
        # half second of any command, where a quick Ctrl-C lands)
        args = parse(build_parser(), argv)
    except KeyboardInterrupt:
        # (SIGTERM kills the process here as usual: `terminate_like_ctrl_c` is a command's,
        # set after the parse)
        if os.environ.get("KVPOOL_TRACEBACK"):
            raise
        print("kvpool: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    try:
        with _kvpool_warnings_as_lines(args._name):
            return int(args._run(args) or 0)
    except (ValueError, FileNotFoundError) as error:
        if os.environ.get("KVPOOL_TRACEBACK"):
            raise
        print(f"kvpool {args._name}: error: {error}", file=sys.stderr)
        return 2
    except RuntimeError as error:
        # tensor parallel: ranks that diverged, or a lost rank, end each rank left in one line;
        # so does a lost peer in any other multi-process command (verify tp / cp / pd)
        tp = sys.modules.get("kvpool.models.tensor_parallel")  # (loaded when a command shards)
        kernels = sys.modules.get("kvpool.kernels")  # KVPOOL_NATIVE=1 where they cannot be built: was a traceback
        if kernels is not None and isinstance(error, kernels.KernelBuildError):
            line: str | None = f"KVPOOL_NATIVE=1, but the C kernels cannot be used: {error}"
        else:
            line = str(error) if tp is not None and isinstance(error, tp.RankError) else lost_peer_line(error)
        if line is None or os.environ.get("KVPOOL_TRACEBACK"):
            raise
        print(f"kvpool {args._name}: error: {line}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as stop:
        if os.environ.get("KVPOOL_TRACEBACK"):
            raise
        terminated = isinstance(stop, Terminated)
        print(f"kvpool {args._name}: {'terminated' if terminated else 'interrupted'}", file=sys.stderr)
        return EXIT_TERMINATED if terminated else EXIT_INTERRUPTED
    except BrokenPipeError:
        # the reader of our output left (`kvpool ... | head`): stop quietly, as a shell
        # command does on SIGPIPE; stdout goes to /dev/null so the exit's flush is silent
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_BROKEN_PIPE
    except SystemExit as stop:
        # rich's Console meets the same BrokenPipeError in its print, points stdout at
        # /dev/null and raises SystemExit(1) while handling it (Console.on_broken_pipe): the
        # status of a closed pipe is the same whichever way the command printed
        if isinstance(stop.__context__, BrokenPipeError):
            return EXIT_BROKEN_PIPE
        raise
    except OSError as error:
        # a file the user named that cannot be read or written (a permission, a directory where
        # a file was meant): one line naming it, as a missing file is. An OSError that names no
        # file (a socket, a lost peer, a write to a full disk: ENOSPC carries no file name) is
        # not shown as the caller's mistake: it propagates
        if error.filename is None or os.environ.get("KVPOOL_TRACEBACK"):
            raise
        print(f"kvpool {args._name}: error: {error}", file=sys.stderr)
        return 2


def entry(argv: list[str] | None = None) -> None:
    """The `kvpool` command as a process: exits with main()'s status. A process left in a
    torch.distributed group that failed (status 1: a lost peer, ranks that diverged) ends at
    once: gloo's threads, torn down by the interpreter's exit, can abort it ("terminate called
    without an active exception", status 134) after the one line was printed.

    A rank of a multi-process run (RANK set, by torchrun or by hand) keeps torch's C++ logger
    quiet: when rank 0's store closed or never answered while the group formed, it printed a
    warning or an error with a whole C++ backtrace (23 lines of "frame #N: c10d::...") before
    the command's own line, which says the same (torch's errors reach Python as exceptions).
    torch reads TORCH_CPP_LOG_LEVEL once, as it loads; a value the user set is kept."""
    if "RANK" in os.environ and "torch" not in sys.modules:
        os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "FATAL")
    code = main(argv)
    dist = sys.modules.get("torch.distributed")
    lost = code == 1 and dist is not None and dist.is_available() and dist.is_initialized()
    # ... and so does a rank that stops otherwise (Ctrl-C, a peer that left while the group
    # formed: models/tensor_parallel.py join_group): the half-formed group's C++ objects, torn
    # down by the exit as rank 0's store closed, aborted it ("terminate called without an
    # active exception", status 134 for 130)
    rank_stops = code != 0 and dist is not None and "RANK" in os.environ
    if lost or rank_stops:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    entry()
