"""`kvpool serve`: the OpenAI-compatible server (kvpool/server/app.py) on the engine.

It binds its socket before the model loads (a port in use is one line, not a traceback),
prints `kvpool serve: ready on http://HOST:PORT` once it accepts requests (with the port
the system chose for --port 0), and on Ctrl-C or SIGTERM lets the streams in flight end for
a few seconds, aborts what is left, checks the cache (every block released, the lifecycle
invariants hold) and says so. A second Ctrl-C meanwhile is noted, not a force-quit: the
stop is bounded, and its cleanup (the tiers' writes landing) must run to its end.

API keys: `--api-key KEY` (repeatable) or `--api-key-file FILE` (one key a line, `#`
comments); `KEY:TENANT` binds a key to a tenant (server/app.py says what that means). A key
holds no colon; a tenant may.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import sys

from kvpool.cli.args import (
    add_host_cache_argument,
    add_persistent_cache_arguments,
    add_preemption_argument,
    check_engine_flags,
    model_placement,
    parse_bytes,
    parsed_number,
    positive_int,
    size_text,
)
from kvpool.cli.options import (
    BLOCK_SIZE,
    DEFAULT_MODEL,
    ENGINE_MODELS,
    add_device_arguments,
    add_engine_batch_options,
    add_engine_model_option,
    add_kv_cache_dtype_option,
    add_kv_memory_option,
    add_option,
    add_threads_option,
    gguf_path,
    set_torch_threads,
    start_torch_threads,
)

DEFAULT_KV_MEMORY = "256MiB"
GRACEFUL_S = 5  # seconds the streams in flight get to end at shutdown


def port(text: str) -> int:
    return parsed_number(text, int, lambda v: 0 <= v <= 65535, "a port number", "a port in [0, 65535]")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--host", type=_host, default="127.0.0.1", help="address to bind (0.0.0.0 exposes it to the network)"
    )
    parser.add_argument("--port", type=port, default=8000, help="TCP port; 0 lets the system pick a free one")
    add_engine_model_option(parser, runs=(DEFAULT_MODEL,))  # (the tiny models have no tokenizer)
    parser.add_argument(
        "--served-model-name", default=None, help="the name clients send as `model` (default: --model's name)"
    )
    parser.add_argument(
        "--api-key",
        action="append",
        default=None,
        metavar="KEY[:TENANT]",
        help="require `Authorization: Bearer KEY` on /v1, /debug and /openapi.json; repeatable; KEY:TENANT binds "
        "the key to a tenant, whose requests then use no other (default: $KVPOOL_API_KEY; none: open)",
    )
    parser.add_argument(
        "--api-key-file",
        default=None,
        metavar="FILE",
        help="API keys, one KEY or KEY:TENANT a line (# comments), besides any --api-key (default: none)",
    )
    parser.add_argument(
        "--trust-tenant-header",
        action="store_true",
        help="take a request's tenant from its X-Tenant-Id header (for a gateway that authenticates tenants and "
        "sets it; keys bound to a tenant still allow only theirs). Without it the header is refused",
    )
    parser.add_argument(
        "--max-request-bytes",
        default="4MiB",
        type=size_text,
        metavar="SIZE",
        help="the largest request body; a larger one gets a 413 before it is read",
    )
    add_kv_memory_option(parser, default=DEFAULT_KV_MEMORY)
    parser.add_argument("--num-blocks", type=positive_int, default=None, help="KV blocks (default: from --kv-memory)")
    add_option(parser, BLOCK_SIZE, default=16)
    add_engine_batch_options(parser, max_num_batched_tokens=512, max_num_seqs=64)
    add_kv_cache_dtype_option(parser, dsv4=False)
    add_host_cache_argument(parser, dsv4=False)
    add_persistent_cache_arguments(parser, swa=False)
    add_preemption_argument(parser, dsv4=False)
    add_device_arguments(parser)
    add_threads_option(parser, probed=True)
    parser.add_argument(
        "--log-level",
        choices=("critical", "error", "warning", "info", "debug"),
        default="warning",
        help="uvicorn's log level (info logs every request)",
    )


def _host(text: str) -> str:
    """--host: an address, not blank (getaddrinfo's "Name or service not known" for '' named
    nothing the user could act on; Python's bind reads '' as every interface, which must be asked for)."""
    if not text.strip():
        raise argparse.ArgumentTypeError(
            f"an empty address ({text!r}); give 127.0.0.1 (this machine) or 0.0.0.0 (every interface)"
        )
    return text


def _bind(host: str, port_number: int) -> socket.socket:
    try:
        infos = socket.getaddrinfo(host, port_number, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as error:
        raise ValueError(f"--host {host!r}: {error.strerror}") from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as error:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port_number}: {error.strerror or error}") from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def served_name(gguf: str | None) -> str:
    """The name /v1/models gives a --model path: its file's or directory's own name without
    ".gguf" (of the absolute path: `--model .` and `--model q/` are the directory's name)."""
    return DEFAULT_MODEL if gguf is None else os.path.basename(os.path.abspath(gguf)).removesuffix(".gguf")


def run(args: argparse.Namespace) -> int:

    if args.model in ENGINE_MODELS and args.model != DEFAULT_MODEL:
        raise ValueError(
            f"--model {args.model} has no tokenizer or chat template; kvpool serve runs {DEFAULT_MODEL}, a "
            "Llama-, Qwen2- or Qwen3-architecture GGUF file or an HF model directory with a tokenizer.json"
        )
    model_placement(args)  # --device cuda without a GPU: refused before the socket is bound
    if args.served_model_name is not None and not args.served_model_name.strip():
        raise ValueError("--served-model-name is empty")
    api_keys = api_keys_from(args)
    max_request_bytes = parse_bytes(args.max_request_bytes, "--max-request-bytes")
    kv_bytes = parse_bytes(args.kv_memory)
    check_engine_flags(args)  # (llama_engine reads --preemption, --kv-cache-dtype and the tier flags)
    from kvpool.models.hf_tokenizer import has_hf_tokenizer, is_hf_directory, missing_tokenizer

    gguf = gguf_path(args.model)
    if gguf is not None and not os.path.isfile(gguf) and not is_hf_directory(gguf):
        raise FileNotFoundError(
            f"--model {gguf!r}: no such GGUF file nor HF model directory (with a config.json) (or give {DEFAULT_MODEL})"
        )
    if gguf is not None and is_hf_directory(gguf) and not has_hf_tokenizer(gguf):  # (before the port is bound)
        raise ValueError(missing_tokenizer(os.path.normpath(gguf)))
    name = args.served_model_name or served_name(gguf)
    sock = _bind(args.host, args.port)
    try:
        return _serve(args, sock, gguf, name, kv_bytes, api_keys, max_request_bytes)
    finally:
        sock.close()


def api_keys_from(args: argparse.Namespace) -> dict[str, str | None]:
    """Every served key -> the tenant it is bound to (None: unbound). ValueError naming the
    flag, or the file and line, for an empty key or tenant, one that is not UTF-8 text (a
    request would fail its comparison) and for a key given twice."""
    entries: list[tuple[str, str]] = []  # (where, "KEY[:TENANT]")
    given = args.api_key if args.api_key is not None else []
    if args.api_key is None and args.api_key_file is None and os.environ.get("KVPOOL_API_KEY") is not None:
        given = [os.environ["KVPOOL_API_KEY"]]
    entries += [("--api-key", text) for text in given]
    if args.api_key_file is not None:
        try:
            with open(args.api_key_file, "rb") as f:
                raw = f.read()
            # (utf-8-sig: the byte-order mark Windows editors write is no part of the first key; it
            # served '\ufeffKEY', and a file of the mark alone the key '\ufeff')
            lines = raw.decode("utf-8-sig").splitlines()
        except UnicodeDecodeError as e:  # (it read "'utf-8' codec can't decode byte 0xff in position 0: ...")
            start = e.start + 3 * raw.startswith(b"\xef\xbb\xbf")  # (utf-8-sig counts past its mark)
            raise ValueError(
                f"--api-key-file {args.api_key_file!r} is not UTF-8 text ({e.reason} at byte {start})"
            ) from None
        except OSError as error:
            raise ValueError(f"--api-key-file {args.api_key_file!r}: {error.strerror or error}") from None
        for number, line in enumerate(lines, 1):
            line = line.strip()
            if line and not line.startswith("#"):
                entries.append((f"{args.api_key_file}:{number}", line))
        if not any(where != "--api-key" for where, _ in entries):
            raise ValueError(f"--api-key-file {args.api_key_file!r}: holds no key")
    keys: dict[str, str | None] = {}
    for where, text in entries:
        key, colon, tenant = text.strip().partition(":")
        key, tenant = key.strip(), tenant.strip()
        if not key:
            raise ValueError(f"{where}: the key is empty (give KEY or KEY:TENANT; unset an empty KVPOOL_API_KEY)")
        if colon and not tenant:
            raise ValueError(f"{where}: the tenant after {key[:4]}...: is empty")
        try:  # argv and the environment carry undecodable bytes as lone surrogates
            key.encode()
            tenant.encode()
        except UnicodeEncodeError:
            raise ValueError(f"{where}: the key or tenant is not valid UTF-8 text") from None
        if key in keys:
            raise ValueError(f"{where}: the key {key[:4]}... is given twice")
        keys[key] = tenant if colon else None
    return keys


def _serve(
    args: argparse.Namespace,
    sock: socket.socket,
    gguf: str | None,
    name: str,
    kv_bytes: int,
    api_keys: dict[str, str | None],
    max_request_bytes: int,
) -> int:
    import torch
    import uvicorn

    from kvpool.cli.run import llama_engine
    from kvpool.engine.build import limit_model_len, load_model
    from kvpool.server.app import ServerState, build_app
    from kvpool.server.engine_thread import EngineThread
    from kvpool.server.metrics import ServerMetrics
    from kvpool.server.protocol import decoded_bytes

    print(f"kvpool serve: loading {name}", file=sys.stderr)
    dtype, device = model_placement(args)
    probe = start_torch_threads(args)
    loaded = load_model(gguf, dtype=dtype, device=device)
    threads = torch.get_num_threads()
    if set_torch_threads(args, probe) < threads:  # (a server runs for hours on this choice: said)
        print(
            f"kvpool serve: {torch.get_num_threads()} torch thread(s), not {threads}: other processes kept CPUs busy "
            "while the model loaded (--threads N to choose)",
            file=sys.stderr,
        )
    engine = llama_engine(loaded, args, kv_bytes)
    limit_model_len(engine, args.max_model_len)  # (a context below 2 tokens refused: every request a 400)
    num_blocks = engine.runner.usage().num_blocks
    metrics = ServerMetrics(name)
    token_bytes = decoded_bytes(loaded.tokenizer)
    thread = EngineThread(engine, loaded.tokenizer.decode, token_bytes=token_bytes, on_step=metrics.update)
    metrics.update(engine, [], 0)
    state = ServerState(
        thread,
        loaded.tokenizer,
        metrics,
        name,
        engine.runner.max_model_len,
        api_keys,
        args.trust_tenant_header,
        max_request_bytes,
    )
    host, bound_port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host

    reader_left: list[BrokenPipeError] = []

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        thread.start()
        try:
            print(
                f"kvpool serve: ready on http://{shown}:{bound_port} (model {name}, {num_blocks} KV blocks of "
                f"{args.block_size} tokens, context {engine.runner.max_model_len}"
                f"{', API key required' if api_keys else ''})",
                flush=True,
            )
        except BrokenPipeError as error:
            # the reader of our output left before we were ready (`kvpool serve | head -0`):
            # stop as every command does then (kvpool/cli/main.py: quietly, status 141), not
            # as uvicorn does with a failed startup (a traceback, status 3)
            reader_left.append(error)
            server.should_exit = True
        yield

    app = build_app(state, lifespan)
    config = uvicorn.Config(
        app,
        log_level=args.log_level,
        access_log=args.log_level in ("info", "debug"),
        timeout_graceful_shutdown=GRACEFUL_S,
        lifespan="on",
    )

    class Server(uvicorn.Server):
        async def shutdown(self, sockets=None) -> None:
            # Abort what is in flight first: every stream then ends with its last chunk and
            # [DONE], and uvicorn's graceful wait has nothing left to cancel.
            thread.stop()
            await super().shutdown(sockets)

        @contextlib.contextmanager
        def capture_signals(self):
            # Not uvicorn's: it takes a second Ctrl-C as "force quit" (the lifespan task is then
            # cancelled, and logged as a traceback) and raises the signals again at its end,
            # into whatever runs then. Ours (below) stay installed until the report is printed.
            yield

    server = Server(config)
    # SIGINT / SIGTERM stop the server gracefully (uvicorn's should_exit); the first one sets
    # the status. A later one, while it stops, is only noted: the stop is bounded (the engine
    # aborts what is in flight, then at most GRACEFUL_S of grace), and its cleanup (the tiers'
    # writes landing, the integrity check) must not be cut by a KeyboardInterrupt. (Installed
    # even over an ignored SIGINT, as a shell's background job inherits it.)
    received: list[int] = []

    def stop(signum, frame) -> None:
        received.append(signum)
        server.should_exit = True

    previous = {signum: signal.signal(signum, stop) for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        try:
            server.run(sockets=[sock])
        finally:
            thread.stop()
            engine.runner.close()  # the disk and Redis tiers' background writes land
            _report_shutdown(thread)
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    if reader_left:
        raise reader_left[0]  # (after the cleanup and its report, on stderr)
    status = {signal.SIGINT: 130, signal.SIGTERM: 143}[received[0]] if received else 0
    return 1 if thread.error is not None else status


def _report_shutdown(thread) -> None:
    runner = thread.engine.runner
    try:
        runner.check_integrity()
        usage = runner.usage()
        state = f"cache integrity ok, {usage.num_held_blocks} blocks held"
    except AssertionError as error:
        state = f"cache integrity FAILED: {error}"
    num = thread.num_aborted_at_stop
    print(f"kvpool serve: stopped ({num} request{'' if num == 1 else 's'} aborted in flight; {state})", file=sys.stderr)
