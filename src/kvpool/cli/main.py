"""`kvpool` command line: one module per command, dispatched through a plain dict.

Each command module exposes `add_arguments(parser)` and `run(args) -> int`. Modules keep
their heavy imports (torch, models) inside `run`, so `kvpool --help` stays fast.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import re
import signal
import sys
import threading
from collections.abc import Iterator

from kvpool.cli.args import HelpFormatter

# command name -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "bench": ("kvpool.cli.bench", "benchmarks: pool, engine, dsv4"),
    "cache": ("kvpool.cli.cache", "inspect and clean a disk prefix cache: ls, stats, clear DIR"),
    "eval": ("kvpool.cli.eval", "quality evaluations: kv-quant (each KV storage format on SmolLM2)"),
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
    "verify": (
        "kvpool.cli.verify",
        "verification matrices: dsv4 (V4 dual pool vs contiguous oracle), hybrid (window / recurrent vs recompute)",
    ),
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvpool", description="kvpool: a KV-cache system for LLM inference", formatter_class=HelpFormatter
    )
    add_modules(parser.add_subparsers(dest="command", required=True), COMMANDS, "_run")  # bench sets "bench NAME"
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


def lost_peer_line(error: RuntimeError) -> str | None:
    """The one line for a torch.distributed collective that failed because a peer process
    went away (gloo's transport error), in a command that joined a process group; None for
    any other error. With two ranks the lost one is the other; with more, gloo cannot tell
    which (a tensor-parallel engine names it itself: models/tensor_parallel.py)."""
    dist = sys.modules.get("torch.distributed")  # (loaded only by a command that uses it)
    text = str(error)
    if dist is None or not dist.is_available() or not dist.is_initialized() or "gloo" not in text:
        return None
    # "[.../gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:38297: Connection reset by
    # peer. This is typically caused by ..." -> "Read error [127.0.0.1]:38297: Connection reset by peer"
    reason = re.sub(r"^\[[^\]]*\]\s*", "", text.strip().splitlines()[0]).split(". This is typically")[0]
    rank, world = dist.get_rank(), dist.get_world_size()
    lost = f"rank {1 - rank}" if world == 2 else "a peer rank"
    return f"rank {rank} of {world}: lost {lost} ({reason}); the process group cannot go on without it"


def main(argv: list[str] | None = None) -> int:
    """Run one command. A caller's mistake (a bad value, a missing file) is reported as one
    line naming the problem, exit status 2; Ctrl-C as one line, status 130.
    KVPOOL_TRACEBACK=1 shows the traceback instead."""
    args = build_parser().parse_args(argv)
    try:
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


def entry(argv: list[str] | None = None) -> None:
    """The `kvpool` command as a process: exits with main()'s status. A process left in a
    torch.distributed group that failed (status 1: a lost peer, ranks that diverged) ends at
    once: gloo's threads, torn down by the interpreter's exit, can abort it ("terminate called
    without an active exception", status 134) after the one line was printed."""
    code = main(argv)
    dist = sys.modules.get("torch.distributed")
    if code == 1 and dist is not None and dist.is_available() and dist.is_initialized():
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    entry()
