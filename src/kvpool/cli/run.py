"""`kvpool run`: the main job. A built-in workload of chat requests through the engine
(shared system prompts, multi-turn follow-ups that reuse their own history, a few long
prompts), arriving over time, then the performance report (seed 003) as a table or one
JSON object.

Arrivals: first turns and long prompts arrive as a Poisson process of `--request-rate`
requests per second (seeded; "inf" puts them all at time 0); a follow-up turn arrives when
the previous turn of its conversation finishes. TTFT counts from a request's arrival.

Everything the report needs comes through the engine (its statistics: steps, preemptions,
the latency of the runner's allocating calls) and the runner protocol (`cache_stats`,
`usage`, `kv_read_bytes`), so any model runner serves: `--model tiny-dsv4` runs the same
workload in token ids on DeepSeek-V4's dual pool, `--model tiny-gemma2` / `tiny-recurrent`
on the hybrid cache coordinator (window + full attention; recurrent + full layers). The workload, its arrivals and the
report's figures come from kvpool/workload/ (live.py, arrivals.py, metrics.py `run_report`),
which the simulator and the load generator share; the loop that serves the workload through
the engine (arrivals, follow-ups, step timing, Ctrl-C) is engine/live.py `serve_live`. This
module parses the flags, builds the engine they ask for and prints the report.

Figures:
  fragmentation      1 - committed tokens / slots of the blocks held, each physical block
                     counted once however many requests share it; averaged over steps
  alloc_latency_us   p50 / p99 of the runner's admit / reserve_step calls that took blocks
                     (a decode inside its block takes none: those are counted apart)
  read_bandwidth     KV bytes attention read (every sequence reads its whole context each
                     step) over the whole step time, weights included: the effective KV
                     read rate of serving, not a kernel's peak
  goodput_req_s      requests within both SLOs (TTFT and TPOT) per second of wall time;
                     num_within_slo counts them
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

from kvpool.capacity.engine import EngineConfig
from kvpool.cli.args import (
    add_hisparse_argument,
    add_host_cache_argument,
    add_indexer_format_argument,
    add_persistent_cache_arguments,
    add_preemption_argument,
    check_device_model,
    check_engine_flags,
    check_kv_dtype,
    check_span_block_size,
    host_cache_bytes,
    model_placement,
    non_negative_int,
    parse_bytes,
    persistent_cache_options,
    positive_float,
    positive_int,
    rate,
    seed_int,
    v4_kv_format,
)
from kvpool.cli.generate import _tensor_parallel, agree_across_ranks
from kvpool.cli.main import EXIT_INTERRUPTED, EXIT_TERMINATED, Terminated, terminate_like_ctrl_c
from kvpool.cli.options import (
    BLOCK_SIZE,
    V4_TURN_ENDS,
    add_device_arguments,
    add_engine_batch_options,
    add_engine_model_option,
    add_kv_cache_dtype_option,
    add_kv_memory_option,
    add_option,
    add_threads_option,
    add_tp_option,
    gguf_path,
    set_torch_threads,
    start_torch_threads,
)
from kvpool.workload.live import live_chat, live_token_ids
from kvpool.workload.metrics import cpu_load, report_notes, report_sections, run_report

TINY_MODEL = "tiny-dsv4"
# the tiny hybrid models (models/tiny_hybrid.py) on the hybrid cache coordinator (engine/hybrid_runner.py)
HYBRID_MODELS = ("tiny-gemma2", "tiny-recurrent")
# what the hybrid runner has not: tiers, storage formats other than its float32, CSA layers
HYBRID_REFUSED = (
    ("host_cache_gib", "--host-cache-gib", "the hybrid runner has no cache tiers"),
    ("disk_cache", "--disk-cache", "the hybrid runner has no cache tiers"),
    ("disk_cache_gib", "--disk-cache-gib", "the hybrid runner has no cache tiers"),
    ("redis", "--redis", "the hybrid runner has no cache tiers"),
    ("disk_timeout", "--disk-timeout", "the hybrid runner has no cache tiers"),
    ("disk_write_timeout", "--disk-write-timeout", "the hybrid runner has no cache tiers"),
    ("disk_open_timeout", "--disk-open-timeout", "the hybrid runner has no cache tiers"),
    ("redis_timeout", "--redis-timeout", "the hybrid runner has no cache tiers"),
    ("swa_strategy", "--swa-strategy", "the hybrid runner has no cache tiers"),
    ("swa_period", "--swa-period", "the hybrid runner has no cache tiers"),
    ("hisparse", "--hisparse", "only tiny-dsv4 has CSA layers"),
    ("indexer_format", "--indexer-format", "only tiny-dsv4 has CSA layers"),
    ("v4_turn_ends", "--v4-turn-ends / --no-v4-turn-ends", "only tiny-dsv4 keeps turn-end states"),
)
# the flags that shape what every tensor-parallel rank must do alike (the workload's and the engine's)
AGREED_FLAGS = (
    "num_requests",
    "turns",
    "num_long",
    "max_tokens",
    "request_rate",
    "block_size",
    "num_blocks",
    "kv_memory",
    "kv_dtype",
    "max_num_batched_tokens",
    "max_num_seqs",
    "max_model_len",
    "enable_prefix_caching",
    "preemption",
    "seed",
)
RUN_DEFAULTS = EngineConfig()  # the configuration `kvpool plan --device cpu` predicts the ledger of


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--num-requests", type=positive_int, default=24, help="first-turn conversations")
    parser.add_argument(
        "--turns", type=positive_int, default=2, help="turns per conversation (follow-ups reuse the history)"
    )
    parser.add_argument("--num-long", type=non_negative_int, default=2, help="long single prompts added to the mix")
    parser.add_argument("--max-tokens", type=positive_int, default=24, help="new tokens per answer")
    parser.add_argument(
        "--request-rate",
        type=rate,
        default=2.0,
        help="arrivals per second of first turns and long prompts (Poisson; inf: all at once)",
    )
    add_option(parser, BLOCK_SIZE, default=RUN_DEFAULTS.block_size, note="SmolLM2 and the tiny hybrid models")
    parser.add_argument("--num-blocks", type=positive_int, default=None, help="KV blocks (default: from --kv-memory)")
    add_host_cache_argument(parser)
    add_kv_cache_dtype_option(parser)
    add_indexer_format_argument(parser)
    add_device_arguments(parser)
    add_persistent_cache_arguments(parser)
    add_hisparse_argument(parser)
    add_option(parser, V4_TURN_ENDS, default=None, note="tiny-dsv4 only (default: on, as `kvpool simulate`'s)")
    add_preemption_argument(parser)
    add_kv_memory_option(
        parser,
        default=None,
        note="default: 256MiB for SmolLM2, 16MiB for the tiny hybrid models, 16MiB of classical blocks for "
        "tiny-dsv4 (its state blocks come on top)",
    )
    add_engine_batch_options(
        parser, max_num_batched_tokens=RUN_DEFAULTS.max_num_batched_tokens, max_num_seqs=RUN_DEFAULTS.max_num_seqs
    )
    parser.add_argument(
        "--slo-ttft-ms", type=positive_float, default=1000.0, help="goodput SLO: time to first token, ms"
    )
    parser.add_argument(
        "--slo-tpot-ms", type=positive_float, default=200.0, help="goodput SLO: time per output token, ms"
    )
    parser.add_argument(
        "--seed",
        type=seed_int,
        default=0,
        help="seed of the workload, the arrivals and the requests' sampling seeds (each request its own, derived "
        "from this one)",
    )
    parser.add_argument("--json", action="store_true", help="print the report as one JSON object")
    add_engine_model_option(
        parser,
        note="; or the built-in tiny-dsv4 (the tiny DeepSeek-V4 model on its dual pool, token ids), tiny-gemma2 "
        "(window + full attention) or tiny-recurrent (recurrent + full layers); or an HF config.json of a "
        "Llama-family model (Llama, Mistral, Qwen2, Qwen3: seeded random weights, token ids: real shapes without the "
        "weights), or its directory with its safetensors (its weights; without a tokenizer.json, token ids)",
    )
    add_threads_option(parser, probed=True)
    add_tp_option(parser)


# ---- the run ----------------------------------------------------------------------------


class Progress:
    """A live bar on a terminal; otherwise (piped, CI) a line on stderr every few seconds. The
    total is the requests the run may send; a conversation that outgrows the context takes its
    unsent turns off it (`unsent`), and the line says how many were so."""

    def __init__(self, total: int, quiet: bool) -> None:
        self.total, self.done, self.last = total, 0, time.perf_counter()
        self.num_unsent = 0  # turns taken off the total: their conversations outgrew the context
        self.elapsed_s = 0.0
        self.bar = None
        if not quiet and sys.stdout.isatty():
            from rich.progress import Progress as RichProgress

            self.bar = RichProgress(transient=True)
            self.task = self.bar.add_task("serving", total=total)
            self.bar.start()

    def advance(self, n: int, elapsed_s: float) -> None:
        self.done += n
        self.elapsed_s = elapsed_s
        if self.bar is not None:
            self.bar.advance(self.task, n)
        else:
            self._line()

    def unsent(self, n: int) -> None:
        """n turns counted in the total will not be sent (their conversation outgrew the context)."""
        self.total -= n
        self.num_unsent += n
        if self.bar is not None:
            self.bar.update(
                self.task, total=self.total, description=f"serving ({self.num_unsent} turns past the context)"
            )
        else:
            self._line()

    def _line(self) -> None:
        now = time.perf_counter()
        if now - self.last >= 5.0 or self.done == self.total:
            self.last = now
            why = ""
            if self.num_unsent:
                why = f" ({self.num_unsent} turns not sent: their conversations outgrew the context)"
            print(
                f"kvpool run: {self.done}/{self.total} requests finished, {self.elapsed_s:.1f} s{why}", file=sys.stderr
            )

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()


def check_hybrid(args: argparse.Namespace) -> None:
    """ValueError naming the first flag a tiny hybrid model's runner cannot honour."""
    model = getattr(args, "model", None)
    if model not in HYBRID_MODELS:
        return
    for attr, flag, why in HYBRID_REFUSED:
        if getattr(args, attr, None) is not None:
            raise ValueError(f"{flag} is not supported with --model {model}: {why}")
    if getattr(args, "kv_dtype", None) not in (None, "auto", "fp32"):
        raise ValueError(
            f"--kv-cache-dtype {args.kv_dtype} is not supported with --model {model}: it keeps float32 K/V"
        )
    if getattr(args, "preemption", "recompute") != "recompute":
        raise ValueError(f"--preemption {args.preemption} is not supported with --model {model}: it recomputes")
    if getattr(args, "tp", 1) > 1:
        raise ValueError(
            f"--tensor-parallel-size is not supported with --model {model}: the hybrid runner runs on one process"
        )


def hybrid_engine(args: argparse.Namespace):
    """(engine, model) for a tiny hybrid model: --num-blocks blocks per attention group, else
    what --kv-memory (default 16MiB) holds of blocks of every attention layer; the recurrent
    state slots (live states and checkpoints, 4 per sequence of a step) come on top."""
    from kvpool.engine.build import build_engine
    from kvpool.models.tiny_hybrid import TINY_GEMMA2, TINY_RECURRENT, TinyHybrid

    model = TinyHybrid(TINY_GEMMA2 if args.model == "tiny-gemma2" else TINY_RECURRENT, seed=args.seed)
    num_blocks = args.num_blocks
    if num_blocks is None:
        cfg = model.config
        num_attention = len(cfg["layers"]) - len(model.recurrent_layers())
        token_bytes = num_attention * 2 * cfg["num_kv_heads"] * cfg["head_dim"] * model.dtype.itemsize
        kv_bytes = parse_bytes(args.kv_memory or "16MiB")
        num_blocks = kv_bytes // (token_bytes * args.block_size)
        if num_blocks <= 0:
            given = args.kv_memory or "16MiB (the default)"  # (the default was named "None")
            raise ValueError(
                f"--kv-memory {given} holds no block of {args.block_size} tokens "
                f"({token_bytes * args.block_size} bytes): raise --kv-memory or lower --block-size"
            )
    engine = build_engine(
        model,
        num_blocks=num_blocks,
        num_slots=4 * args.max_num_seqs,
        block_size=args.block_size,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
        enable_prefix_caching=args.enable_prefix_caching,
    )
    return engine, model


def config_engine(args: argparse.Namespace):
    """(engine, model name, vocabulary size) for --model CONFIG.json: a Llama-family model of
    that HF config with weights drawn from --seed (models/hf_config.py), or for --model DIR
    (an HF model directory: config.json and safetensors) with its weights, on --device in
    --dtype, over --num-blocks blocks or what --kv-memory holds; token ids in and out (no
    tokenizer), no tiers."""
    from kvpool.cache import CacheDescriptor
    from kvpool.engine.build import build_engine, hf_weights_version
    from kvpool.engine.memory import check_fits
    from kvpool.models.hf_config import hf_tensors, llama_config, model_bytes, random_llama
    from kvpool.models.llama import LlamaModel

    directory = os.path.isdir(args.model)
    if host_cache_bytes(args) is not None or any(persistent_cache_options(args).values()):
        what = "an HF directory without a tokenizer.json" if directory else "random weights"
        verb = "serves" if directory else "serve"
        raise ValueError(f"--model {args.model}: {what} {verb} no tiers (no --host-cache-gib, --disk-cache, --redis)")
    if getattr(args, "preemption", "recompute") != "recompute":
        raise ValueError(f"--model {args.model}: preemption swap and auto need the host tier; use recompute")
    if getattr(args, "tp", 1) > 1:  # (it was ignored: the whole model ran in one process)
        what = "an HF directory without a tokenizer.json" if directory else "a config.json's random model"
        raise ValueError(f"--model {args.model}: {what} runs on one process (no --tensor-parallel-size {args.tp})")
    hf = llama_config(args.model)
    dtype, device = model_placement(args)
    weights = "its safetensors" if directory else "random weights"
    smaller = "a smaller model" if directory else "a smaller config.json"
    check_fits(model_bytes(hf.config, dtype), device, f"--model {args.model} with {weights}", smaller)
    if directory:  # an HF model directory: its own weights, named by their files' digest
        version = hf_weights_version(args.model)  # (load_model's: the tiers' blocks agree)
        model = LlamaModel.from_tensors(hf.config, hf_tensors(args.model, hf.config, dtype), device)
    else:
        version = f"random-seed{args.seed}"
        model = random_llama(hf.config, seed=args.seed, dtype=dtype, device=device)
    engine = build_engine(
        model,
        descriptor=CacheDescriptor(hf.name, weights_version=version),
        num_blocks=args.num_blocks,
        kv_memory_bytes=parse_bytes(args.kv_memory) if args.kv_memory else RUN_DEFAULTS.kv_memory_bytes,
        block_size=args.block_size,
        kv_format=check_kv_dtype(args),
        enable_prefix_caching=getattr(args, "enable_prefix_caching", True),
        enforce_eager=getattr(args, "enforce_eager", False),
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
    )
    return engine, hf.name, hf.config.vocab_size


def _built_source(args: argparse.Namespace) -> str:
    """The report's load_source of a model without a GGUF: an HF directory's safetensors, a
    config.json's seeded random weights, else "built in" (the tiny models)."""
    if args.model is not None and os.path.isdir(args.model):
        return "safetensors"  # (as load_model's of a directory with its tokenizer)
    if args.model is not None and args.model.endswith(".json"):
        return f"random weights (--seed {args.seed})"
    return "built in"


def token_id_prompts(args: argparse.Namespace, engine, vocab_size: int):
    """The workload-making function of a model served by token ids (a config.json model, the
    hybrid and tiny V4 models): random prompts of its vocabulary, each checked against the
    engine's context as it is made."""
    return lambda rng: live_token_ids(
        vocab_size, args.num_requests, args.num_long, rng, seed=args.seed, check_length=engine.check_length
    )


def build(args: argparse.Namespace):
    """(engine, workload-making function, model name) for --model."""
    from kvpool.engine.build import limit_model_len

    check_hybrid(args)
    check_device_model(args, (TINY_MODEL, *HYBRID_MODELS))
    from kvpool.models.hf_tokenizer import has_hf_tokenizer, is_hf_directory

    # a config.json, or an HF directory without a tokenizer.json: token ids (with one: text, below)
    if args.model is not None and (
        args.model.endswith(".json") or (is_hf_directory(args.model) and not has_hf_tokenizer(args.model))
    ):
        engine, name, vocab_size = config_engine(args)
        limit_model_len(engine, args.max_model_len)
        return (
            engine,
            token_id_prompts(args, engine, vocab_size),
            name,
            None,
        )
    if args.model in HYBRID_MODELS:
        engine, model = hybrid_engine(args)
        limit_model_len(engine, args.max_model_len)
        return (
            engine,
            token_id_prompts(args, engine, model.vocab_size),
            args.model,
            None,
        )
    if args.model == TINY_MODEL:
        from kvpool.engine.build import build_engine
        from kvpool.models.tiny_dsv4 import TinyDSV4

        model = TinyDSV4(seed=args.seed)
        check_span_block_size(args, model.spec.span, RUN_DEFAULTS.block_size)
        engine = build_engine(
            model,
            num_blocks=args.num_blocks,
            kv_memory_bytes=parse_bytes(args.kv_memory or "16MiB"),  # classical blocks: the state blocks on top
            num_state_blocks=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_num_seqs=args.max_num_seqs,
            enable_prefix_caching=args.enable_prefix_caching,
            hot_set_entries=getattr(args, "hisparse", None),
            host_cache_bytes=host_cache_bytes(args),
            **persistent_cache_options(args),
            **v4_kv_format(args),
            turn_end_checkpoints=args.v4_turn_ends is not False,  # (None: not given, on)
            preemption=getattr(args, "preemption", "recompute"),
        )
        limit_model_len(engine, args.max_model_len)
        return (
            engine,
            token_id_prompts(args, engine, model.vocab_size),
            TINY_MODEL,
            None,
        )

    from kvpool.engine.build import load_model

    dtype, device = model_placement(args)
    loaded = load_model(gguf_path(args.model), dtype=dtype, device=device)
    if _tensor_parallel(args, loaded) != 0:  # rank 0 reports; the other ranks compute their shards alongside
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 (for the rest of the process)
        args.json = True  # and no progress bar
    kv_bytes = parse_bytes(args.kv_memory) if args.kv_memory else RUN_DEFAULTS.kv_memory_bytes
    engine = llama_engine(loaded, args, kv_bytes)
    limit_model_len(engine, args.max_model_len)
    return (
        engine,
        lambda rng: live_chat(
            loaded.tokenizer.encode_chat, args.num_requests, args.num_long, rng, check_length=engine.check_length
        ),
        os.path.basename(loaded.gguf.path),
        loaded,
    )


def llama_engine(loaded, args: argparse.Namespace, kv_memory_bytes: int):
    """The engine over a loaded GGUF (engine/build.py `build_engine`) from the flags `kvpool
    run` and `kvpool serve` share: --num-blocks (else what `kv_memory_bytes` holds),
    --block-size, --max-num-batched-tokens, --max-num-seqs, --enable-prefix-caching,
    --host-cache-gib, --preemption, --kv-cache-dtype, --disk-cache, --disk-cache-gib, --redis."""
    from kvpool.engine.build import build_engine

    return build_engine(
        loaded,
        num_blocks=args.num_blocks,
        kv_memory_bytes=kv_memory_bytes,
        block_size=args.block_size,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
        enable_prefix_caching=getattr(args, "enable_prefix_caching", True),
        host_cache_bytes=host_cache_bytes(args),
        preemption=getattr(args, "preemption", "recompute"),
        kv_format=check_kv_dtype(args),
        enforce_eager=getattr(args, "enforce_eager", False),
        **persistent_cache_options(args),
    )


def run(args: argparse.Namespace) -> int:
    with terminate_like_ctrl_c():  # SIGTERM (timeout, Kubernetes) stops the run as Ctrl-C does
        return _run(args)


def _run(args: argparse.Namespace) -> int:

    from kvpool.engine import memory
    from kvpool.engine.live import num_live_requests, serve_live
    from kvpool.engine.sampling import SamplingParams

    runtime_bytes = memory.runtime_baseline()
    check_device_model(args, (TINY_MODEL, *HYBRID_MODELS))
    _, model_device = model_placement(args)  # --device cuda without a GPU: one line, before anything loads
    if args.kv_memory is not None:  # a bad size, or one the machine cannot hold, before the model loads
        tiny = args.model == TINY_MODEL or args.model in HYBRID_MODELS
        device = "cpu" if tiny else model_device
        memory.check_fits(parse_bytes(args.kv_memory), device, f"--kv-memory {args.kv_memory}")
    check_hybrid(args)  # before the checks below, whose lines speak of the Llama and V4 models
    check_engine_flags(args)  # ... and so are bad engine and tier flags (build counts on it)
    quiet = args.json or not sys.stdout.isatty()
    if quiet:
        print("kvpool run: loading the model", file=sys.stderr)
    probe = start_torch_threads(args)  # (after the checks: the model loads next)
    load_start = time.perf_counter()
    engine, make_workload, model_name, loaded = build(args)
    load_s = time.perf_counter() - load_start
    torch_threads = set_torch_threads(args, probe)  # (after load_s: it may wait out a short load)
    rng = random.Random(args.seed)
    workload = make_workload(rng)
    # no seed here: each request its own, derived from --seed and its place in the workload
    # (serve_live); one seed for all 50 gave requests with equal prompts equal answers
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.7, top_p=0.9)
    engine.reseed(args.seed)
    if loaded is not None:  # tensor parallel: every rank serves the same workload alike
        agree_across_ranks(
            loaded,
            "the workload (its prompts, sampling parameters and flags)",
            workload.first_prompts,
            workload.long_prompts,
            params,
            [getattr(args, name, None) for name in AGREED_FLAGS],
        )
    total = num_live_requests(workload, args.turns)
    progress = Progress(total, args.json)

    def serving() -> None:  # after the prompts' lengths are checked: an error can no longer follow it
        if quiet:
            # a conversation that outgrows the context ends there: its later turns are never
            # sent, which only the answers tell, so with follow-ups the count is at most
            upto = "up to " if args.turns > 1 else ""
            print(f"kvpool run: serving {upto}{total} requests on {model_name}", file=sys.stderr)

    loads = [cpu_load()]  # at the start and the end: an oversubscribed CPU skews every timing
    try:
        live = serve_live(
            engine,
            workload,
            params,
            turns=args.turns,
            request_rate=args.request_rate,
            rng=rng,
            on_progress=progress.advance,
            note_bookkeeping=loaded is not None,
            tp_model=getattr(loaded, "model", None),
            on_start=serving,
            on_unsent=progress.unsent,
        )
    finally:
        progress.close()
    loads.append(cpu_load())
    interrupted = ""  # or how the run was stopped: "interrupted" (Ctrl-C), "terminated" (SIGTERM)
    if live.stopped is not None:
        interrupted = "terminated" if isinstance(live.stopped, Terminated) else "interrupted"
    runner = engine.runner
    if hasattr(runner, "close"):
        runner.close()  # the disk and Redis tiers' background writes land (counted in the report)
    report = run_report(
        engine,
        model_name=model_name,
        wall_s=live.wall_s,
        step_s=live.step_s,
        fragmentation=live.fragmentation,
        kv_read_bytes=live.kv_read_bytes,
        interrupted=bool(interrupted),
        slo_ttft_ms=args.slo_ttft_ms,
        slo_tpot_ms=args.slo_tpot_ms,
        request_rate=args.request_rate,
        context_ended=live.context_ended,
    )
    report["tp"] = getattr(args, "tp", 1)
    if loaded is not None:
        report["kv_bytes_per_token_per_rank"] = engine.runner.executor.storage.bytes_per_token
        report["kv_pool_bytes_per_rank"] = engine.runner.executor.storage.num_bytes
    report["load_s"] = round(load_s, 3)
    report["torch_threads"] = torch_threads
    report["load_source"] = loaded.load_source if loaded is not None else _built_source(args)
    report["memory"] = None
    if loaded is not None:  # the Llama runner's ledger (the tiny V4 model's is not measured)
        report["memory"] = memory.measure(engine.runner, runtime_bytes, loaded.tokenizer_bytes).as_dict()
    if args.json:
        print(json.dumps(report))
    else:
        print_report(report, loads)
    if interrupted:
        print(
            f"kvpool run: {interrupted}; the report covers the {report['num_finished']} of "
            f"{report['num_requests']} requests that finished",
            file=sys.stderr,
        )
        return EXIT_TERMINATED if interrupted == "terminated" else EXIT_INTERRUPTED
    return 0


def print_report(report: dict, loads: list[float | None] | None = None) -> None:
    """The report under headings with units (workload/metrics.py's report_sections), the SLO
    verdict and the warnings (report_notes: cut short; the CPU oversubscribed at one of
    `loads`, the load averages sampled at the start and the end), then the memory ledger."""
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    table = Table(
        title=f"kvpool run: {report['num_finished']} requests on {report['model']}, "
        f"{report['num_blocks']} blocks of {report['block_size']}"
    )
    table.add_column("metric")
    table.add_column("value", justify="right")
    for heading, rows in report_sections(report, skip=("memory", "context_ended")):  # (those named in a note)
        table.add_row(f"[bold]{heading}[/bold]", "", end_section=False)
        for label, value in rows:
            table.add_row(f"  {escape(label)}", escape(value))
        table.add_section()
    console = Console()
    console.print(table)
    for note in report_notes(report, loads or ()):
        console.print(escape(note), highlight=False, soft_wrap=True)
    mem = report.get("memory")
    if mem:
        ledger = Table(title=f"memory: measured, against the {mem['peak_source']}")
        for column in ("term", "bytes", "share of peak"):
            ledger.add_column(column, justify="left" if column == "term" else "right")
        peak = mem["peak"]
        for term, lines in mem["details"].items():
            ledger.add_row(term, f"{mem[term] / 2**20:,.1f} MiB", f"{100 * mem[term] / peak:.1f} %")
            for line, num_bytes in lines.items():
                ledger.add_row(f"  {line}", f"{num_bytes / 2**20:,.2f} MiB", "")
        ledger.add_row(
            "unaccounted", f"{mem['unaccounted'] / 2**20:,.1f} MiB", f"{100 * mem['unaccounted_share']:.1f} %"
        )
        ledger.add_row("peak", f"{peak / 2**20:,.1f} MiB", "100.0 %")
        console.print(ledger)
