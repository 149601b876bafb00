"""argparse pieces the commands share: value types that reject nonsense at parse time, and
the help formatter that shows each option's default.

A `type=` function that raises argparse.ArgumentTypeError makes argparse print the usage
and one line naming the option and the value, exit status 2, before any model is loaded.
"""

from __future__ import annotations

import argparse
import difflib
import math
import os
import re
import shlex
import sys
import textwrap
from collections.abc import Callable
from typing import Any, NamedTuple, TypeVar

from kvpool.spec.kv_formats import KV_SCHEMAS, kv_schema

N = TypeVar("N", int, float)


def parsed_number(
    text: str, convert: Callable[[str], N], ok: Callable[[N], bool], expected: str, refused: str = ""
) -> N:
    """`convert(text)` when it parses and passes `ok`; else argparse.ArgumentTypeError
    "expected {expected}, got 'TEXT'" for text that does not parse, "expected {refused or
    expected}, got VALUE" for a value that fails `ok` (an int as parsed, a float as written:
    'inf', 'nan')."""
    try:
        value = convert(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
    if not ok(value):
        shown = value if isinstance(value, int) else repr(text)
        raise argparse.ArgumentTypeError(f"expected {refused or expected}, got {shown}")
    return value


def positive_int(text: str) -> int:
    """An int >= 1 (threads, token counts, blocks, GPUs)."""
    return parsed_number(text, int, lambda v: v > 0, "a positive integer")


# --threads at most: more than any CPU has (the largest have a few hundred). torch tries to
# start every one it is told: `--threads 100000` ran the machine out of threads ("cannot
# load the CPU kernels: [Errno 11] Resource temporarily unavailable") and then segfaulted
MAX_THREADS = 4096


def thread_count(text: str) -> int:
    """--threads: an int in [1, MAX_THREADS]."""
    value = positive_int(text)
    if value > MAX_THREADS:
        raise argparse.ArgumentTypeError(f"expected at most {MAX_THREADS} (more than any CPU has), got {value}")
    return value


def non_negative_int(text: str) -> int:
    """An int >= 0 (seeds, top-k where 0 means off)."""
    return parsed_number(text, int, lambda v: v >= 0, "an integer >= 0")


def seed_int(text: str) -> int:
    """`kvpool run`'s --seed: an int in [0, 2**63), what its workload and arrivals take (a larger
    one read "Overflow when unpacking long long", naming no flag). A request's own sampling
    seed is request_seed_int."""
    return parsed_number(text, int, lambda v: 0 <= v < 2**63, "an integer in [0, 2**63)")


def request_seed_int(text: str) -> int:
    """A request's sampling seed (`generate --seed`): a 64-bit signed integer, [-2**63, 2**63),
    what `SamplingParams(seed=)`, serve's `seed` and `LLM` take (engine/sampling.py SEED_MIN,
    SEED_MAX: OpenAI's and vLLM's API range), every value a fixed seed, -1 too (not llama.cpp's
    "-1 = random": one rule for every entry point)."""
    return parsed_number(text, int, lambda v: -(2**63) <= v < 2**63, "a 64-bit signed integer, in [-2**63, 2**63)")


def torch_seed_int(text: str) -> int:
    """A seed for torch's generator alone (`torch.manual_seed`): an int in [-2**63, 2**63)."""
    return parsed_number(text, int, lambda v: -(2**63) <= v < 2**63, "an integer in [-2**63, 2**63)")


def positive_float(text: str) -> float:
    """A finite float > 0 (GiB of memory): no nan, no inf."""
    return parsed_number(
        text, float, lambda v: math.isfinite(v) and v > 0, "a positive number", "a finite positive number"
    )


def deadline_seconds(text: str) -> float:
    """A deadline in seconds: a float in (0, tiers/deadline.py's MAX_DEADLINE_S] (`kvpool cache
    --timeout`, --disk-timeout ...; a larger one was an OverflowError traceback from the
    wait: Python's waits overflow past threading.TIMEOUT_MAX; audit5 #1)."""
    from kvpool.tiers.deadline import MAX_DEADLINE_S  # (here: `kvpool --help` imports no torch)

    return parsed_number(text, float, lambda v: 0 < v <= MAX_DEADLINE_S, f"a positive number up to {MAX_DEADLINE_S:g}")


def penalty(text: str) -> float:
    """A presence or frequency penalty: a float in [-2, 2] (OpenAI's range, as SamplingParams')."""
    return parsed_number(text, float, lambda v: -2 <= v <= 2, "a number in [-2, 2]")  # nan fails too


def unit_interval(text: str) -> float:
    """A float in [0, 1] (min-p, where 0 is off)."""
    return parsed_number(text, float, lambda v: 0 <= v <= 1, "a number in [0, 1]")


def token_id_list(text: str) -> tuple[int, ...]:
    """Comma-separated token ids, each an integer >= 0 ("2,50256"); the engine checks them
    against the model's vocabulary."""
    return comma_list(non_negative_int)(text)


def fraction(text: str) -> float:
    """A float in (0, 1] (a share of a GPU's memory)."""
    return parsed_number(text, float, lambda v: 0 < v <= 1, "a number in (0, 1]")


def rate(text: str) -> float:
    """A float > 0, or inf (a rate of arrivals: inf puts them all at time 0)."""
    return parsed_number(text, float, lambda v: v > 0, "a positive number or inf")  # nan fails too


# size suffixes, lower-cased: K/M/G/T alone or with iB are powers of 1024 (as `free -h`, Java's
# -Xmx and Docker read them); with B alone, powers of 1000 (a disk maker's GB)
SIZE_UNITS: dict[str, int] = {
    **{p: 1 << (10 * (i + 1)) for i, p in enumerate("kmgt")},
    **{f"{p}ib": 1 << (10 * (i + 1)) for i, p in enumerate("kmgt")},
    **{f"{p}i": 1 << (10 * (i + 1)) for i, p in enumerate("kmgt")},
    **{f"{p}b": 10 ** (3 * (i + 1)) for i, p in enumerate("kmgt")},
    "b": 1,
    "": 1,
}
SIZE_EXAMPLES = "256MiB, 512M, 1G, 1.5GiB, 1TiB or 64000000 (K/M/G/T and KiB..TiB: powers of 1024; KB..TB: of 1000)"


def parse_bytes(text: str, flag: str = "--kv-memory") -> int:
    """'256MiB', '512M', '1G', '1TiB', '64mb', '1000000' -> bytes (SIZE_UNITS); ValueError
    naming the flag and the text otherwise."""
    match = re.fullmatch(r"\s*([0-9.eE+-]+)\s*([a-zA-Z]*)\s*", text)
    value = math.nan
    if match and match.group(2).lower() in SIZE_UNITS:
        try:
            value = float(match.group(1)) * SIZE_UNITS[match.group(2).lower()]
        except ValueError:
            pass
    if not math.isfinite(value) or value < 1:
        raise ValueError(f"{flag} must be a positive size such as {SIZE_EXAMPLES}, got {text!r}")
    return int(value)


def size_text(text: str) -> str:
    """An argparse type for a size kept as written (parse_bytes reads it later, and messages
    quote it): a size that does not parse is an error at parse time."""
    byte_size(text)
    return text


def byte_size(text: str) -> int:
    """An argparse type for a size in bytes ("256MiB", "1G", "64000000"; SIZE_UNITS)."""
    try:
        return parse_bytes(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a size such as {SIZE_EXAMPLES}, got {text!r}") from None


def comma_choices(choices: tuple[str, ...]):
    """A type for a comma-separated subset of `choices` ("decode,ttft"), kept in the given
    order; an unknown or empty entry is an error that lists the valid ones."""

    def parse(text: str) -> tuple[str, ...]:
        parts = tuple(p.strip() for p in text.split(","))
        unknown = [p for p in parts if p not in choices]
        if unknown:
            raise argparse.ArgumentTypeError(
                f"unknown {', '.join(repr(p) for p in unknown)} in {text!r}; choose from {','.join(choices)}"
            )
        return parts

    return parse


def comma_list(item):
    """A type for a comma-separated list whose entries `item` parses (an argparse type)."""

    def parse(text: str) -> tuple[str, ...]:
        parts = tuple(p.strip() for p in text.split(","))
        if not all(parts):
            raise argparse.ArgumentTypeError(f"an empty entry in {text!r}")
        return tuple(item(p) for p in parts)

    return parse


def check_output_dir(flag: str, given: str, directory: str) -> None:
    """`directory` (where `flag`'s path `given` goes) is a writable directory or can be made:
    its nearest existing ancestor is one. Checked without creating anything (a run that
    fails later leaves no trace)."""
    path = os.path.abspath(directory)
    while not os.path.exists(path):
        path = os.path.dirname(path)  # the root exists: this ends
    if not os.path.isdir(path):
        raise ValueError(f"{flag} {given!r}: {path!r} is a file, not a directory")
    if not os.access(path, os.W_OK | os.X_OK):
        raise ValueError(f"{flag} {given!r}: directory {path!r} is not writable")


def add_plot_file_argument(parser: argparse.ArgumentParser, help: str) -> None:
    """--plot FILE: one figure, its type from the extension (plan, eval kv-quant); the command
    checks the path with check_plot_path before its work starts."""
    parser.add_argument("--plot", default=None, metavar="FILE.png|svg|pdf", help=help)


def check_plot_path(path: str) -> None:
    """ValueError naming the problem if --plot's figure cannot be written at `path` (a type
    matplotlib cannot write included: the extension names it), before minutes of work. The
    directory must exist: save_figure makes none."""
    from kvpool.sim.plots import check_plot_format

    if not path.strip():  # (plan read "" as no --plot and drew nothing; eval said "--plot : no file extension")
        raise ValueError(f"--plot: an empty path ({path!r})")
    if os.path.isdir(path):
        raise ValueError(f"--plot {path} is a directory; give a file name, e.g. {os.path.join(path, 'kv.png')}")
    check_plot_format("--plot", path)
    parent = os.path.dirname(path) or "."
    if not os.path.exists(parent):
        raise ValueError(f"--plot {path}: the directory {parent} does not exist")
    if not os.path.isdir(parent):
        raise ValueError(f"--plot {path}: {parent} is not a directory")
    if not os.access(parent, os.W_OK | os.X_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        raise ValueError(f"--plot {path}: no permission to write there")


def shown_default(value: object) -> str:
    """An option's default as a user would type it: a list or tuple comma-joined, never a
    Python repr. (A comma-list option is best given its default as the text a user would
    type, "4" or "128:2048": argparse parses a string default with the option's type.)"""
    if isinstance(value, list | tuple):
        return ",".join(shown_default(v) for v in value)
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        return f"{value:.1f}"
    return str(value)


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Each option's default as a value, "(default: 16)"; none for a flag that is off
    unless given, or a None default (the help says what happens: "default: from
    --kv-memory"). An option's former names (aliases, SharedOption) are left out of its
    flags column: its help names them. Descriptions keep their line breaks."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        if isinstance(action, argparse.BooleanOptionalAction) and isinstance(default, bool):
            # (Python < 3.13 appends "(default: %(default)s)" itself: True / False)
            text = text.replace(" (default: %(default)s)", "")
            return f"{text} (default: {'on' if default else 'off'})"
        if isinstance(default, list | tuple) and all(v is None for v in default):
            default = None  # (a list option's "not given": its help says what stands in)
        if "%(default)" in text or default is None or default is argparse.SUPPRESS or action.nargs == 0:
            return text  # (nargs 0: a flag, off unless given; a --NAME / --no-NAME switch says its state)
        return f"{text} (default: {shown_default(default).replace('%', '%%')})"

    def _split_lines(self, text: str, width: int) -> list[str]:
        # not at a hyphen: "gpt-oss-120b" and "--no-enable-prefix-caching" stay whole
        return textwrap.wrap(self._whitespace_matcher.sub(" ", text).strip(), width, break_on_hyphens=False)

    def _format_action_invocation(self, action: argparse.Action) -> str:
        aliases = getattr(action, "aliases", ())
        if not aliases:
            return super()._format_action_invocation(action)
        shown = [s for s in action.option_strings if s not in aliases]
        metavar = self._format_args(action, self._get_default_metavar_for_optional(action))
        return ", ".join(f"{s} {metavar}" if action.nargs != 0 else s for s in shown)


# a choice a newcomer types for another (`--device gpu`, whose spelling is closest to cpu)
_MEANT = {"gpu": "cuda"}


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose mistakes are one line on stderr, "kvpool run: error: ...",
    status 2 (the usage is for -h), naming an option with several names by the one the user
    typed ("argument --max-seqs: ...", not all of them). Sub-parsers are of the same class:
    argparse makes them with the parent's."""

    def parse_known_args(self, args=None, namespace=None):  # type: ignore[override]
        self._arg_strings = list(sys.argv[1:] if args is None else args)
        return super().parse_known_args(args, namespace)

    def error(self, message: str) -> None:  # type: ignore[override]
        typed = list(getattr(self, "_arg_strings", ()))
        named = re.match(r"argument ((?:-[\w-]+/)+-[\w-]+): ", message)
        if named:
            names = named.group(1).split("/")
            name = next((n for n in names if n in {a.split("=", 1)[0] for a in typed}), names[0])
            message = f"argument {name}: {message[named.end() :]}"
        if message.startswith("the following arguments are required"):
            message += self._choices_hint(message) + self._dash_value_hint(typed)
        # a value that begins with a short option's letters (`kvpool generate "-hello there"`
        # is -h with "ello there" attached): argparse's line named -h and no prompt
        glued = re.fullmatch(r"argument (-\w): ignored explicit argument .*", message, re.S)
        takes_values = any(not a.option_strings and a.nargs != argparse.PARSER for a in self._actions)
        end = typed.index("--") if "--" in typed else len(typed)
        word = next((w for w in typed[:end] if glued and w.startswith(glued[1]) and w != glued[1]), None)
        if word is not None and takes_values:
            message = f"{word!r} was read as the option {glued[1]}: {self._after_dashes(typed, word)}"
        self.exit(2, f"{self.prog}: error: {message}\n")

    def _check_value(self, action: argparse.Action, value: Any) -> None:
        """A value outside an argument's choices (a command, a benchmark, --device) is named
        with the closest choice when one is close (`kvpool genrate`: "did you mean generate?");
        argparse listed the choices only."""
        if action.choices is None or value in action.choices:
            return
        typed = list(getattr(self, "_arg_strings", ()))
        at = typed.index(value) if value in typed else -1
        before = typed[at - 1].split("=")[0] if at > 0 else ""
        if not action.option_strings and before.startswith("-") and before not in self._option_string_actions:
            # the value of an option this command lacks, taken for a positional choice:
            # `kvpool simulate --request-rate 10` read "argument mode: invalid choice: '10'"
            from kvpool.cli.main import unknown_hint

            raise argparse.ArgumentError(
                None, f"unrecognized arguments: {typed[at - 1]} {value}{unknown_hint(self, typed[at - 1], typed)}"
            )
        choices = [str(c) for c in action.choices]
        meant = _MEANT.get(str(value).lower())
        near = [meant] if meant in choices else difflib.get_close_matches(str(value).lower(), choices, n=1)
        hint = f"; did you mean {near[0]}?" if near else ""
        raise argparse.ArgumentError(action, f"invalid choice: {value!r} (choose from {', '.join(choices)}){hint}")

    def _choices_hint(self, message: str) -> str:
        """For a missing argument that takes one of a few names (`kvpool bench`, `kvpool cache`):
        the names, which argparse's "the following arguments are required: bench" did not give."""
        missing = message.split(": ", 1)[1].split(", ")
        named = {a.metavar or a.dest: a for a in self._actions if not a.option_strings and a.choices}
        lists = [(name, ", ".join(map(str, named[name].choices))) for name in missing if name in named]
        if len(missing) == 1 and lists:
            return f" (one of {lists[0][1]})"
        return "".join(f" ({name}: one of {choices})" for name, choices in lists)

    def _dash_value_hint(self, typed: list[str]) -> str:
        """For a missing positional argument: where a word that begins with "-" and is no
        option of this parser was typed (`kvpool generate "-1,3"`: argparse read it as an
        unknown option, then missed the prompt), how to pass it: after "--"."""
        known = [s for a in self._actions for s in a.option_strings]
        end = typed.index("--") if "--" in typed else len(typed)
        stray = [
            w for w in typed[:end] if w.startswith("-") and not any(k.startswith(w.split("=", 1)[0]) for k in known)
        ]
        if not stray:
            return ""
        return f" ({stray[0]} was read as an option: {self._after_dashes(typed, stray[0])})"

    def _after_dashes(self, typed: list[str], word: str) -> str:
        """How to pass `word`, a value that begins with "-": the command typed, `word` moved after "--"."""
        rest = list(typed)
        rest.remove(word)
        if "--" in rest:
            rest.insert(rest.index("--") + 1, word)
        else:
            rest += ["--", word]
        fixed = " ".join(map(shlex.quote, rest))
        return f"give a value that begins with '-' after '--', as in {self.prog} {fixed}"


def add_host_cache_argument(parser: argparse.ArgumentParser, *, dsv4: bool = True) -> None:
    """--host-cache-gib; `dsv4`: the command takes tiny-dsv4 too (kvpool serve does not)."""
    parser.add_argument(
        "--host-cache-gib",
        type=positive_float,
        default=None,
        help="a host-memory tier of this many GiB below the KV pool: evicted prefix blocks are kept there "
        f"and loaded back on a hit ({'tiny-dsv4: its classical blocks; ' if dsv4 else ''}default: no host tier)",
    )


# the storage formats of spec/kv_formats.py (a torch-free module: the parser loads no torch)
KV_DTYPES: tuple[str, ...] = tuple(KV_SCHEMAS)


def kv_dtype(value: str) -> str:
    """A --kv-cache-dtype of the engine's commands: auto (the model's own dtype), a format
    name, KIVI's with its G and R if given ("kivi2-g16-r64"), or "fp8", DeepSeek-V4's
    serving layout (tiny-dsv4; checked against the model later)."""
    if value in ("auto", "fp8"):
        return value
    try:
        kv_schema(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return value


def planner_kv_dtype(value: str) -> str:
    """A --kv-cache-dtype of kvpool plan / simulate: auto, the model-specific fp8, or a
    storage format of spec/kv_formats.py (KIVI's with its G and R)."""
    return kv_dtype(value)


PLANNER_KV_DTYPE_HELP = (
    "auto (the model's serving dtype), bf16, fp16, fp32, fp8 (vLLM's per-tensor scales for GQA and dense MLA; the "
    "sparse FlashMLA layout for V3.2, DeepSeek-V4's for V4), or kvpool's own GQA / MHA formats: "
    + ", ".join(n for n in KV_SCHEMAS if n not in ("fp32", "bf16", "fp16"))
    + " (KIVI's G and R may follow: kivi2-g16-r64)"
)
_LLAMA_KV_DTYPE_HELP = (
    f"auto (fp32) or one of {', '.join(KV_DTYPES)}; KIVI's group size and residual may follow, "
    "kivi2-g16-r64 (see kvpool.spec.kv_formats). "
)
_DSV4_KV_DTYPE_HELP = (
    "tiny-dsv4: auto or fp32 (exact), or fp8, DeepSeek-V4's layout "
    "for the classical pool (FP8 with a scale per 64 dims, BF16 RoPE dims; indexer keys by --indexer-format). "
)
_LOSSY_KV_DTYPE_HELP = "Formats other than fp32 are lossy; fp16 saturates K / V values past +-65,504"
ENGINE_KV_DTYPE_HELP = "SmolLM2: " + _LLAMA_KV_DTYPE_HELP + _DSV4_KV_DTYPE_HELP + _LOSSY_KV_DTYPE_HELP
# kvpool serve's: it runs SmolLM2 or a Llama-, Qwen2- or Qwen3-architecture GGUF, never tiny-dsv4 (and takes no
# --indexer-format)
SERVE_KV_DTYPE_HELP = _LLAMA_KV_DTYPE_HELP + _LOSSY_KV_DTYPE_HELP


def add_indexer_format_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--indexer-format",
        choices=("fp8", "mxfp4"),
        default=None,
        help="tiny-dsv4 with --kv-cache-dtype fp8: the CSA indexer keys' format (default: fp8)",
    )


def check_kv_dtype(args: argparse.Namespace) -> str | None:
    """--kv-cache-dtype (and --indexer-format), checked against the model and the tiers:
    the storage format, None for auto (the model's dtype); ValueError otherwise."""
    name = getattr(args, "kv_dtype", None)
    name = None if name == "auto" else name
    indexer = getattr(args, "indexer_format", None)
    if indexer is not None and (name != "fp8" or getattr(args, "model", None) != "tiny-dsv4"):
        raise ValueError("--indexer-format is for tiny-dsv4 with --kv-cache-dtype fp8 (its indexer keys)")
    if getattr(args, "hisparse", None) is not None and name == "fp8":
        raise ValueError("--kv-cache-dtype fp8 with --hisparse: HiSparse keeps exact classical entries")
    if name is None:
        return None
    v4 = getattr(args, "model", None) == "tiny-dsv4"
    if v4 and name not in ("fp32", "fp8"):
        raise ValueError(f"--kv-cache-dtype {name}: tiny-dsv4 takes fp32 (exact) or fp8 (DeepSeek-V4's serving layout)")
    if not v4 and name == "fp8":
        raise ValueError(
            "--kv-cache-dtype fp8 is DeepSeek-V4's layout (tiny-dsv4); for SmolLM2 name the format: fp8_e4m3 (a scale "
            "per block and KV head), fp8_e4m3_token, fp8_e5m2, ..."
        )
    tiers = [f for f in ("host_cache_gib", "disk_cache", "redis") if getattr(args, f, None) is not None]
    if tiers and name != "fp32":
        flag = "--" + tiers[0].replace("_", "-")
        raise ValueError(f"--kv-cache-dtype {name} with {flag}: the tiers keep unquantized blocks only")
    return name


def v4_kv_format(args: argparse.Namespace) -> dict[str, str]:
    """tiny-dsv4's classical-pool layout from --kv-cache-dtype / --indexer-format (checked by
    check_kv_dtype): dsv4_runner's kv_format and indexer_format."""
    fp8 = getattr(args, "kv_dtype", None) == "fp8"
    return {"kv_format": "fp8" if fp8 else "exact", "indexer_format": getattr(args, "indexer_format", None) or "fp8"}


# the persistent tiers' deadline flags: (flag, TierDeadlines field, the tier flag it needs, help)
TIER_DEADLINE_FLAGS = (
    (
        "--disk-timeout",
        "disk_s",
        "--disk-cache",
        "seconds a disk cache lookup's or get's read, an unlink or a rename may take; past it a miss (the engine "
        "computes those tokens), and 3 in a row open a breaker that serves without the disk until it answers "
        "(default: 1)",
    ),
    (
        "--disk-write-timeout",
        "disk_write_s",
        "--disk-cache",
        "seconds a whole disk cache write (fsyncs included) or rescan may take; a write past it is dropped and "
        "counted (default: 10)",
    ),
    (
        "--disk-open-timeout",
        "disk_open_s",
        "--disk-cache",
        "seconds the disk cache's open waits for each answer of the directory (its checks, every entry listed); a "
        "mount that stops answering is one error line, and the engine does not start (default: 10)",
    ),
    (
        "--redis-timeout",
        "redis_s",
        "--redis",
        "seconds every Redis call may take; past it the breaker opens and lookups are misses until the server "
        "answers (default: 0.5)",
    ),
)


def add_persistent_cache_arguments(parser: argparse.ArgumentParser, *, swa: bool = True) -> None:
    """--disk-cache, --disk-cache-gib, --redis, their deadlines (TIER_DEADLINE_FLAGS); with
    `swa` also tiny-dsv4's --swa-strategy and --swa-period (kvpool serve runs SmolLM2 only)."""
    parser.add_argument(
        "--disk-cache",
        default=None,
        metavar="DIR",
        help="a crash-safe disk prefix cache in DIR, below the host tier: every full block is written there in "
        "the background, and a later process on the same DIR hits it (inspect with `kvpool cache`; default: none)",
    )
    parser.add_argument(
        "--disk-cache-gib",
        type=positive_float,
        default=None,
        help="the disk cache's byte limit, least recently used entries go first (default: 16 GiB)",
    )
    parser.add_argument(
        "--redis",
        default=None,
        metavar="URL",
        help="a Redis tier shared by processes (redis://HOST:PORT[/DB]), below the disk cache: an outage "
        "degrades to misses with one warning line (default: none)",
    )
    for flag, _, _, text in TIER_DEADLINE_FLAGS:
        parser.add_argument(flag, type=deadline_seconds, default=None, metavar="S", help=text)
    if not swa:
        return
    parser.add_argument(
        "--swa-strategy",
        choices=("full", "periodic", "zero"),
        default=None,
        help="tiny-dsv4 with --disk-cache or --redis: how a prefix hit's sliding window comes back (DeepSeek-V4 "
        "report 3.5.2): full, a window snapshot stored at every classical block, nothing recomputed; periodic, "
        "one every --swa-period tokens, recompute from the nearest; zero, none stored, recompute the last "
        "window x layers tokens (the default)",
    )
    parser.add_argument(
        "--swa-period",
        type=positive_int,
        default=None,
        metavar="P",
        help="--swa-strategy periodic: tokens between window snapshots, a multiple of the classical block span "
        "(default: none; periodic needs it)",
    )


def persistent_cache_options(args: argparse.Namespace) -> dict[str, object]:
    """build_engine's disk_cache / disk_cache_bytes / redis_url from the flags; ValueError
    naming a flag that cannot work."""
    disk, gib, url = (getattr(args, n, None) for n in ("disk_cache", "disk_cache_gib", "redis"))
    strategy, period = getattr(args, "swa_strategy", None), getattr(args, "swa_period", None)
    if gib is not None and disk is None:
        raise ValueError("--disk-cache-gib needs --disk-cache DIR")
    from kvpool.tiers.stack import TierDeadlines

    seconds = {field: getattr(args, flag[2:].replace("-", "_"), None) for flag, field, _, _ in TIER_DEADLINE_FLAGS}
    for flag, field, tier, _ in TIER_DEADLINE_FLAGS:
        if seconds[field] is not None and getattr(args, tier[2:].replace("-", "_"), None) is None:
            raise ValueError(f"{flag} needs {tier}: it is that tier's deadline")
    deadlines = TierDeadlines(**seconds)
    tiny = getattr(args, "model", None) == "tiny-dsv4"
    swa = None
    if strategy is not None or period is not None:
        if not tiny:
            raise ValueError("--swa-strategy / --swa-period: only tiny-dsv4 (DeepSeek-V4) keeps a sliding-window state")
        if disk is None and url is None:
            raise ValueError(
                "--swa-strategy / --swa-period: give --disk-cache or --redis, the tier that stores windows"
            )
        if period is not None and strategy != "periodic":
            raise ValueError("--swa-period P goes with --swa-strategy periodic")
        if strategy == "periodic" and period is None:
            raise ValueError("--swa-strategy periodic needs --swa-period P, the tokens between window snapshots")
    if tiny and (disk is not None or url is not None):
        from kvpool.models.tiny_dsv4 import TINY_DSV4_CONFIG
        from kvpool.spec.dsv4 import DSV4Spec
        from kvpool.tiers.swa import SWAStrategy

        swa = SWAStrategy(strategy or "zero", period or 0).check(DSV4Spec.from_config(TINY_DSV4_CONFIG).span)
    if disk is not None:
        from kvpool.tiers.disk import open_directory

        # a file, an unwritable directory, a foreign one or a hung mount: said now, before the model loads
        open_directory(disk, **{"timeout_s": deadlines.disk_open_s} if deadlines.disk_open_s else {})
    if url is not None:
        from kvpool.tiers.redis_tier import check_url

        check_url(url)
    options: dict[str, object] = {"disk_cache": disk, "redis_url": url}
    if deadlines != TierDeadlines():  # (only when given: a truthy option reads as "a tier asked for")
        options["tier_deadlines"] = deadlines
    if swa is not None:
        options["swa"] = swa
    if gib is not None:
        options["disk_cache_bytes"] = max(1, int(gib * (1 << 30)))
    return options


def add_hisparse_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--hisparse",
        type=positive_int,
        default=None,
        metavar="ENTRIES",
        help="tiny-dsv4: HiSparse, CSA main entries in host memory with a device hot set of ENTRIES per CSA "
        "layer (the indexer's picks are fetched when not resident; default: off, every entry on the device)",
    )


def add_preemption_argument(parser: argparse.ArgumentParser, *, dsv4: bool = True) -> None:
    """--preemption; `dsv4`: the command takes tiny-dsv4 too (kvpool serve does not)."""
    parser.add_argument(
        "--preemption",
        choices=("recompute", "swap", "auto"),
        default="recompute",
        help="a preempted request's cache: recomputed (its full blocks stay findable), swapped to the host tier "
        "and back (needs --host-cache-gib"
        + ("; tiny-dsv4: its spans and its state, so a resume at its span boundary replays nothing" if dsv4 else "")
        + "), "
        "or auto (swap when moving the bytes costs less than recomputing)",
    )


def check_preemption(args: argparse.Namespace) -> str:
    """--preemption, checked against --host-cache-gib and the model; ValueError otherwise."""
    preemption = getattr(args, "preemption", "recompute")
    if preemption != "recompute" and getattr(args, "host_cache_gib", None) is None:
        raise ValueError(f"--preemption {preemption} swaps to the host tier: give --host-cache-gib too")
    return preemption


def check_hisparse(args: argparse.Namespace) -> None:
    """ValueError for --hisparse on a model without CSA layers."""
    if getattr(args, "hisparse", None) is not None and getattr(args, "model", None) != "tiny-dsv4":
        raise ValueError("--hisparse: only tiny-dsv4 has CSA layers (pass --model tiny-dsv4)")


def host_cache_bytes(args: argparse.Namespace) -> int | None:
    """--host-cache-gib in bytes (None when not given)."""
    gib = getattr(args, "host_cache_gib", None)
    if gib is None:
        return None
    return max(1, int(gib * (1 << 30)))


def check_v4_turn_ends(args: argparse.Namespace) -> None:
    """ValueError for --v4-turn-ends / --no-v4-turn-ends on a model without V4's dual pool."""
    if getattr(args, "v4_turn_ends", None) is not None and getattr(args, "model", None) != "tiny-dsv4":
        raise ValueError("--v4-turn-ends / --no-v4-turn-ends: only tiny-dsv4 (DeepSeek-V4) keeps turn-end states")
    if getattr(args, "v4_turn_ends", None) and getattr(args, "enable_prefix_caching", True) is False:
        # (a kept state is found as a prefix hit: without caching none is kept, yet the report said on)
        raise ValueError("--v4-turn-ends with --no-enable-prefix-caching: a turn-end state is found as a prefix hit")


def check_tiers_need_caching(args: argparse.Namespace) -> None:
    """ValueError for a tier flag with --no-enable-prefix-caching: the tiers keep and serve
    cached prefix blocks (and swapped-out requests), so without prefix caching the runner
    drops them; the flag was taken and nothing was ever stored in the tier or read from it."""
    if getattr(args, "enable_prefix_caching", True) is not False:
        return
    given = [
        flag
        for flag, name in (("--host-cache-gib", "host_cache_gib"), ("--disk-cache", "disk_cache"), ("--redis", "redis"))
        if getattr(args, name, None) is not None
    ]
    if given:
        raise ValueError(
            f"{' / '.join(given)} with --no-enable-prefix-caching: a tier keeps and serves cached prefix blocks, "
            "and without prefix caching nothing is stored in it (drop one of the two)"
        )


class EngineFlags(NamedTuple):
    """What `check_engine_flags` read: --preemption, --kv-cache-dtype's storage format (None:
    the model's own) and build_engine's tier options (persistent_cache_options)."""

    preemption: str
    kv_format: str | None
    tiers: dict[str, object]


def check_engine_flags(args: argparse.Namespace) -> EngineFlags:
    """The engine flags run, generate and serve share, checked before any model loads:
    --hisparse, --v4-turn-ends, --preemption, --kv-cache-dtype, the tier flags, and what
    --tensor-parallel-size cannot go with. ValueError naming the first that cannot work."""
    check_hisparse(args)
    check_v4_turn_ends(args)
    check_tiers_need_caching(args)
    preemption = check_preemption(args)
    kv_format = check_kv_dtype(args)
    tiers = persistent_cache_options(args)
    tp = getattr(args, "tp", 1)
    if tp > 1 and getattr(args, "model", None) == "tiny-dsv4":
        raise ValueError("--tensor-parallel-size is for the Llama path (SmolLM2); tiny-dsv4 runs on one process")
    if tp > 1 and preemption == "auto":
        raise ValueError(
            "--preemption auto decides by each process's timings; with --tensor-parallel-size use recompute or swap"
        )
    return EngineFlags(preemption, kv_format, tiers)


# --device / --dtype of run, generate and serve (cli/options.py DEVICE, DTYPE): where the Llama
# (GGUF) model runs, in what dtype
MODEL_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}  # flag value -> torch's name
# vLLM's spellings of the same dtypes
DTYPE_SYNONYMS = {"bfloat16": "bf16", "float16": "fp16", "half": "fp16", "float32": "fp32", "float": "fp32"}


def model_dtype(text: str) -> str:
    """A --dtype: bf16, fp16, fp32, or vLLM's bfloat16, float16 / half, float32 / float."""
    name = DTYPE_SYNONYMS.get(text.lower(), text.lower())
    if name not in MODEL_DTYPES:
        raise argparse.ArgumentTypeError(
            f"expected {', '.join(MODEL_DTYPES)} (or {', '.join(DTYPE_SYNONYMS)}), got {text!r}"
        )
    return name


def model_placement(args: argparse.Namespace) -> tuple[Any, str]:
    """(torch dtype, device) from --dtype and --device; ValueError in one line for --device
    cuda where torch sees no GPU, or a non-Llama --model with either flag set."""
    import torch

    device, dtype = getattr(args, "device", "auto"), getattr(args, "dtype", "fp32")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA GPU here (torch.cuda.is_available() is False)")
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    return getattr(torch, MODEL_DTYPES[dtype]), device


def option_given(args: argparse.Namespace, flag: str) -> bool:
    """Whether `flag` (a long option) was typed on the command line (`kvpool.cli.main.parse`
    keeps the words as args._argv; a caller's Namespace without them: not given), by its
    name, NAME=VALUE, or a prefix argparse took for it (allow_abbrev), before any "--"."""
    for word in getattr(args, "_argv", ()):
        if word == "--":
            break
        name = word.split("=", 1)[0]
        if name.startswith("--") and len(name) > 2 and flag.startswith(name):
            return True
    return False


def check_span_block_size(args: argparse.Namespace, span: int, default: int) -> None:
    """--block-size with tiny-dsv4, whose classical blocks are its spans of m' tokens: not
    given, or the span itself; another size was ignored silently (the parser's default too,
    given explicitly: `--block-size 16` ran with blocks of the span)."""
    block_size = getattr(args, "block_size", default)  # (a caller's Namespace may lack it)
    if block_size != span and (block_size != default or option_given(args, "--block-size")):
        raise ValueError(
            f"--block-size {block_size} is not supported with --model {args.model}: its classical blocks "
            f"are spans of {span} tokens (m')"
        )


def check_device_model(args: argparse.Namespace, tiny_models: tuple[str, ...]) -> None:
    """--device / --dtype move only the Llama (GGUF) model: the tiny models run fp32 on the CPU."""
    if args.model in tiny_models and (
        getattr(args, "device", "auto") == "cuda" or getattr(args, "dtype", "fp32") != "fp32"
    ):
        raise ValueError(f"--device / --dtype: --model {args.model} runs in fp32 on the CPU only")
