"""argparse pieces the commands share: value types that reject nonsense at parse time, and
the help formatter that shows each option's default.

A `type=` function that raises argparse.ArgumentTypeError makes argparse print the usage
and one line naming the option and the value, exit status 2, before any model is loaded.
"""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Callable
from typing import Any, TypeVar

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


def non_negative_int(text: str) -> int:
    """An int >= 0 (seeds, top-k where 0 means off)."""
    return parsed_number(text, int, lambda v: v >= 0, "an integer >= 0")


def positive_float(text: str) -> float:
    """A finite float > 0 (GiB of memory): no nan, no inf."""
    return parsed_number(
        text, float, lambda v: math.isfinite(v) and v > 0, "a positive number", "a finite positive number"
    )


def rate(text: str) -> float:
    """A float > 0, or inf (a rate of arrivals: inf puts them all at time 0)."""
    return parsed_number(text, float, lambda v: v > 0, "a positive number or inf")  # nan fails too


def parse_bytes(text: str, flag: str = "--kv-memory") -> int:
    """'256MiB', '1GiB', '64mb', '1000000' -> bytes. ValueError naming the flag and the text otherwise."""
    units = {"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "kb": 10**3, "mb": 10**6, "gb": 10**9, "b": 1}
    lower = text.strip().lower()
    for unit, factor in units.items():
        if lower.endswith(unit):
            number, scale = lower[: -len(unit)].strip(), factor
            break
    else:
        number, scale = lower, 1
    try:
        value = float(number) * scale
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{flag} must be a positive size such as 256MiB, 1GiB or 64000000, got {text!r}")
    return int(value)


def byte_size(text: str) -> int:
    """An argparse type for a size in bytes ("256MiB", "1GiB", "64000000")."""
    try:
        return parse_bytes(text, "the size")
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


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


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """ArgumentDefaultsHelpFormatter that leaves out "(default: None)" and the False of a
    flag: a None default means "see the help text" (which says what happens), and a flag
    is off unless given."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default is False:
            return action.help
        return super()._get_help_string(action)


def add_host_cache_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--host-cache-gib",
        type=positive_float,
        default=None,
        help="a host-memory tier of this many GiB below the KV pool: evicted prefix blocks are kept there "
        "and loaded back on a hit (tiny-dsv4: its classical blocks)",
    )


# the storage formats of spec/kv_formats.py (a torch-free module: the parser loads no torch)
KV_DTYPES: tuple[str, ...] = tuple(KV_SCHEMAS)


def kv_dtype(value: str) -> str:
    """A --kv-dtype value: a format name, KIVI's with its G and R if given ("kivi2-g16-r64"),
    or "fp8", DeepSeek-V4's serving layout (tiny-dsv4; checked against the model later)."""
    if value == "fp8":
        return value
    try:
        kv_schema(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return value


def planner_kv_dtype(value: str) -> str:
    """A --kv-dtype of kvpool plan / simulate: auto, the model-specific fp8, or a storage
    format of spec/kv_formats.py (KIVI's with its G and R)."""
    if value in ("auto", "fp8"):
        return value
    return kv_dtype(value)


PLANNER_KV_DTYPE_HELP = (
    "auto (the model's serving dtype), bf16, fp16, fp32, fp8 (vLLM's per-tensor scales for GQA; FlashMLA's and "
    "DeepSeek-V4's layouts for MLA / V4), or kvpool's own GQA / MHA formats: "
    + ", ".join(n for n in KV_SCHEMAS if n not in ("fp32", "bf16", "fp16"))
    + " (KIVI's G and R may follow: kivi2-g16-r64)"
)


def add_kv_dtype_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--kv-dtype",
        type=kv_dtype,
        default=None,
        metavar="FORMAT",
        help=f"the KV cache's storage format. SmolLM2: one of {', '.join(KV_DTYPES)}; KIVI's group size and "
        "residual may follow, kivi2-g16-r64 (see kvpool.spec.kv_formats). tiny-dsv4: fp32 (exact) or fp8, "
        "DeepSeek-V4's layout for the classical pool (FP8 with a scale per 64 dims, BF16 RoPE dims; indexer keys "
        "by --indexer-format). Lossy formats; default: the model's dtype, unquantized",
    )
    parser.add_argument(
        "--indexer-format",
        choices=("fp8", "mxfp4"),
        default=None,
        help="tiny-dsv4 with --kv-dtype fp8: the CSA indexer keys' format (default fp8)",
    )


def check_kv_dtype(args: argparse.Namespace) -> str | None:
    """--kv-dtype (and --indexer-format), checked against the model and the tiers;
    ValueError otherwise."""
    name = getattr(args, "kv_dtype", None)
    indexer = getattr(args, "indexer_format", None)
    if indexer is not None and (name != "fp8" or getattr(args, "model", None) != "tiny-dsv4"):
        raise ValueError("--indexer-format is for tiny-dsv4 with --kv-dtype fp8 (its indexer keys)")
    if getattr(args, "hisparse", None) is not None and name == "fp8":
        raise ValueError("--kv-dtype fp8 with --hisparse: HiSparse keeps exact classical entries")
    if name is None:
        return None
    v4 = getattr(args, "model", None) == "tiny-dsv4"
    if v4 and name not in ("fp32", "fp8"):
        raise ValueError(f"--kv-dtype {name}: tiny-dsv4 takes fp32 (exact) or fp8 (DeepSeek-V4's serving layout)")
    if not v4 and name == "fp8":
        raise ValueError(
            "--kv-dtype fp8 is DeepSeek-V4's layout (tiny-dsv4); for SmolLM2 name the format: fp8_e4m3 (a scale "
            "per block and KV head), fp8_e4m3_token, fp8_e5m2, ..."
        )
    tiers = [f for f in ("host_cache_gib", "disk_cache", "redis") if getattr(args, f, None) is not None]
    if tiers and name != "fp32":
        flag = "--" + tiers[0].replace("_", "-")
        raise ValueError(f"--kv-dtype {name} with {flag}: the tiers keep unquantized blocks only")
    return name


def v4_kv_format(args: argparse.Namespace) -> dict[str, str]:
    """tiny-dsv4's classical-pool layout from --kv-dtype / --indexer-format (checked by
    check_kv_dtype): DSV4Runner's kv_format and indexer_format."""
    fp8 = getattr(args, "kv_dtype", None) == "fp8"
    return {"kv_format": "fp8" if fp8 else "exact", "indexer_format": getattr(args, "indexer_format", None) or "fp8"}


def add_persistent_cache_arguments(parser: argparse.ArgumentParser, *, swa: bool = True) -> None:
    """--disk-cache, --disk-cache-gib, --redis; with `swa` also tiny-dsv4's --swa-strategy
    and --swa-period (kvpool serve runs SmolLM2 only)."""
    parser.add_argument(
        "--disk-cache",
        default=None,
        metavar="DIR",
        help="a crash-safe disk prefix cache in DIR, below the host tier: every full block is written there in "
        "the background, and a later process on the same DIR hits it (inspect with `kvpool cache`)",
    )
    parser.add_argument(
        "--disk-cache-gib",
        type=positive_float,
        default=None,
        help="the disk cache's byte limit, least recently used entries go first (default 16 GiB)",
    )
    parser.add_argument(
        "--redis",
        default=None,
        metavar="URL",
        help="a Redis tier shared by processes (redis://HOST:PORT[/DB]), below the disk cache: an outage "
        "degrades to misses with one warning line",
    )
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
        help="--swa-strategy periodic: tokens between window snapshots, a multiple of the classical block span",
    )


def persistent_cache_options(args: argparse.Namespace) -> dict[str, object]:
    """build_engine's disk_cache / disk_cache_bytes / redis_url from the flags; ValueError
    naming a flag that cannot work."""
    disk, gib, url = (getattr(args, n, None) for n in ("disk_cache", "disk_cache_gib", "redis"))
    strategy, period = getattr(args, "swa_strategy", None), getattr(args, "swa_period", None)
    if gib is not None and disk is None:
        raise ValueError("--disk-cache-gib needs --disk-cache DIR")
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

        open_directory(disk)  # a file, an unwritable directory or a foreign one: said now, before the model loads
    if url is not None:
        from kvpool.tiers.redis_tier import check_url

        check_url(url)
    options: dict[str, object] = {"disk_cache": disk, "redis_url": url}
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
        "layer (the indexer's picks are fetched when not resident)",
    )


def add_preemption_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--preemption",
        choices=("recompute", "swap", "auto"),
        default="recompute",
        help="a preempted request's cache: recomputed (its full blocks stay findable), swapped to the host tier "
        "and back (needs --host-cache-gib), or auto (swap when moving the bytes costs less than recomputing)",
    )


def check_preemption(args: argparse.Namespace) -> str:
    """--preemption, checked against --host-cache-gib and the model; ValueError otherwise."""
    preemption = getattr(args, "preemption", "recompute")
    if preemption != "recompute" and getattr(args, "host_cache_gib", None) is None:
        raise ValueError(f"--preemption {preemption} swaps to the host tier: give --host-cache-gib too")
    if preemption != "recompute" and getattr(args, "model", None) == "tiny-dsv4":
        raise ValueError(f"--preemption {preemption}: tiny-dsv4 preempts by recompute (its spans come back as hits)")
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


# --device / --dtype of run, generate and serve: where the Llama (GGUF) model runs, in what dtype
MODEL_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}  # flag value -> torch's name


def add_device_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--device",
        choices=("auto", "cpu", "cuda"),
        default="auto",
        help="where the model runs (auto: cuda when torch sees a GPU, else cpu)",
    )
    parser.add_argument(
        "--dtype",
        choices=tuple(MODEL_DTYPES),
        default="fp32",
        help="the model's weights and activations (the KV cache's too, unless --kv-dtype)",
    )


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


def check_device_model(args: argparse.Namespace, tiny_models: tuple[str, ...]) -> None:
    """--device / --dtype move only the Llama (GGUF) model: the tiny models run fp32 on the CPU."""
    if args.model in tiny_models and (
        getattr(args, "device", "auto") == "cuda" or getattr(args, "dtype", "fp32") != "fp32"
    ):
        raise ValueError(f"--device / --dtype: --model {args.model} runs in fp32 on the CPU only")
