"""The OpenAI-compatible HTTP API over one EngineThread (FastAPI; uvicorn serves it).

  GET  /v1/models              the served model
  POST /v1/completions         text in (or token ids, or a batch of prompts: one engine request
                               each, choices prompt * n + sample), text out; stream: true for SSE
  POST /v1/chat/completions    messages in, rendered with the GGUF's chat template
  GET  /health                 200 while the engine thread runs, 503 otherwise
  GET  /metrics                Prometheus text format (server/metrics.py)
  GET  /debug/cache            the cache's usage, after `check_integrity()` ran between two
                               steps: what a test (or an operator) asks to prove that nothing
                               leaked

  GET  /openapi.json           the API's schema

With API keys, /v1, /debug and /openapi.json need `Authorization: Bearer KEY`, checked before
the body is read (401 otherwise); /health and /metrics stay open for probes and scrapers.

Bodies. One larger than `max_request_bytes` gets a 413 from its Content-Length, before a byte
of it is read (or as soon as a chunked one passes the limit). One that has not all arrived
within `body_timeout_s` gets a 408, and one still arriving when the server stops a 503: a
client that stops sending holds nothing for long, nor the stop for its grace. The body is
parsed, validated and tokenized on a worker thread (the tokenizer releases the GIL), so a big
prompt never stalls the event loop: other streams and /health go on meanwhile.

Tenants. A tenant salts the request's prefix chain (cache/coordinator.py), so one tenant never
hits another's cached prefix, and `usage.prompt_tokens_details.cached_tokens` shows it.
  - a key bound to a tenant (`KEY:TENANT`): the request's tenant is the key's; an
    `X-Tenant-Id` header or `user` naming another tenant is refused (403);
  - otherwise the `X-Tenant-Id` header, only when the operator trusts it (a gateway that
    authenticates tenants sets it: `trust_tenant_header`; else a header is refused, 403),
    else the body's `user` field, else the shared tenant "". A client that picks its own
    `user` reaches only prefixes cached under the same string; one that must not choose
    gets a bound key.

Streaming sends OpenAI's chunk objects as server-sent events and ends with `data: [DONE]`;
with `stream_options.include_usage` the last chunk carries the usage. A client that
disconnects aborts its request before the engine's next step (the stream's generator is
closed, or, for a non-streamed request, the disconnect is read from the connection). When the
server stops, what is in flight is aborted: a stream ends with finish_reason "abort" and
[DONE]; a non-streamed request gets a 503 (server_shutting_down), never its cut text as a 200.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import json
import random
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from kvpool.engine.sampling import SamplingParams
from kvpool.models.tokenizer import ChatTokenizer
from kvpool.server import protocol
from kvpool.server.engine_thread import Delta, EngineThread, Event, Failed, Finished
from kvpool.server.metrics import ServerMetrics
from kvpool.server.protocol import APIError, ChatCompletionRequest, CompletionRequest, TokenBound, TokenText
from kvpool.server.protocol import token_text as protocol_token_text

TENANT_HEADER = "x-tenant-id"
# The longest prompt a 128k-token context holds is about 0.5 MB of text (1.5 MB as JSON
# escapes of CJK characters): 4 MiB admits every prompt that can fit, and bounds what an
# unauthenticated client can make the server hold or tokenize.
DEFAULT_MAX_REQUEST_BYTES = 4 << 20
# The whole body must arrive within this: a client that sends part of it and then nothing
# would hold its handler forever (and a stopping server for its whole grace). 4 MiB in a
# minute is 70 kB/s, far below any client that is still sending.
DEFAULT_BODY_TIMEOUT_S = 60.0
_STOP_POLL_S = 0.25  # how often a handler waiting for a body looks whether the server stops


@dataclass
class ServerState:
    engine: EngineThread
    tokenizer: ChatTokenizer
    metrics: ServerMetrics
    model_name: str
    max_model_len: int
    # API key -> the tenant it is bound to (None: unbound); empty: the server is open
    api_keys: dict[str, str | None] = field(default_factory=dict)
    trust_tenant_header: bool = False  # X-Tenant-Id names the tenant (a gateway sets it)
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S


def _not_running(state: ServerState, error: RuntimeError) -> APIError:
    """The 503 of a call the engine thread no longer takes: `server_shutting_down` (the code
    every "the server stops" answer carries, which OpenAI's clients retry) while it stops,
    `engine_not_running` otherwise."""
    code = "server_shutting_down" if state.engine.stopping else "engine_not_running"
    return APIError(503, str(error), code=code, type="server_error")


def _error_response(error: APIError) -> JSONResponse:
    headers = {"WWW-Authenticate": "Bearer"} if error.status == 401 else None
    return JSONResponse(error.body(), status_code=error.status, headers=headers)


def build_app(state: ServerState, lifespan=None) -> FastAPI:
    """The app over a started EngineThread; `lifespan` (FastAPI's) runs at start and stop."""
    app = FastAPI(title="kvpool", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
    app.state.kvpool = state
    token_text = protocol_token_text(state.tokenizer)
    token_bound = TokenBound(token_text, state.tokenizer.tokenizer.get_vocab_size())

    @app.exception_handler(APIError)
    async def _api_error(_: Request, error: APIError) -> JSONResponse:
        return _error_response(error)

    @app.exception_handler(HTTPException)
    async def _routing_error(request: Request, error: HTTPException) -> JSONResponse:
        # the router's own answers (no such path, a method the path does not take), as OpenAI's
        # error object: a client shows its message, which names what is served instead
        where = f"{request.method} {request.url.path}"
        if error.status_code == 404:
            served = ", ".join(r.path for r in request.app.routes if getattr(r, "include_in_schema", False))
            api = APIError(404, f"{where}: no such endpoint (kvpool serve serves {served})", code="not_found")
        elif error.status_code == 405:
            allowed = (error.headers or {}).get("Allow", "")
            api = APIError(405, f"{where}: method not allowed (use {allowed})", code="method_not_allowed")
        else:
            api = APIError(error.status_code, f"{where}: {error.detail}")
        return JSONResponse(api.body(), status_code=error.status_code, headers=error.headers)

    @app.exception_handler(ClientDisconnect)
    async def _client_gone(_: Request, __: ClientDisconnect) -> Response:
        # the client left while it sent its body: an ordinary event, not our error (starlette
        # would answer 500 and log a traceback); nobody reads the answer
        return Response(status_code=499)

    def authorize(request: Request) -> str | None:
        """The tenant the request's key is bound to (None: an unbound key, or an open
        server); 401 without a served key. Runs before the body is read."""
        if not state.api_keys:
            return None
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        presented = token.strip().encode()
        found: tuple[str | None] | None = None
        for key, tenant in state.api_keys.items():  # every key compared: the time tells nothing
            if hmac.compare_digest(presented, key.encode()):
                found = (tenant,)
        if scheme.lower() != "bearer" or found is None:
            raise APIError(401, "missing or wrong API key: send Authorization: Bearer KEY", code="invalid_api_key")
        return found[0]

    async def read_body(request: Request) -> bytes:
        """The body, refused with a 413 before it is read when it is too large; a 408 when it
        has not all arrived within `body_timeout_s`, a 503 when the server stops meanwhile."""
        limit = state.max_request_bytes
        too_large = APIError(
            413,
            f"the request body exceeds this server's limit of {limit} bytes (kvpool serve --max-request-bytes)",
            code="request_too_large",
        )
        length = request.headers.get("content-length")
        if length is not None:
            if not length.isdigit():
                raise APIError(400, f"Content-Length: not a number of bytes: {length!r}")
            if int(length) > limit:
                raise too_large
        deadline = asyncio.get_running_loop().time() + state.body_timeout_s
        chunks, size = [], 0
        while True:
            message = await next_message(request, deadline)
            if message["type"] == "http.disconnect":
                raise ClientDisconnect
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:  # a chunked body, or one longer than it said
                raise too_large
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    async def next_message(request: Request, deadline: float) -> dict[str, Any]:
        """The connection's next ASGI message (a piece of the body, or the disconnect), waited
        for until `deadline` (408), or until the server stops (503): no wait is unbounded."""
        loop = asyncio.get_running_loop()
        receiving = asyncio.ensure_future(request.receive())
        try:
            while not receiving.done():
                left = deadline - loop.time()
                if left <= 0:
                    raise APIError(
                        408,
                        f"the request body did not arrive within {state.body_timeout_s:g} s",
                        code="request_timeout",
                    )
                if state.engine.stopping:
                    raise APIError(503, "the server is shutting down", code="server_shutting_down", type="server_error")
                await asyncio.wait({receiving}, timeout=min(left, _STOP_POLL_S))
            return receiving.result()
        finally:
            receiving.cancel()  # (a no-op once it is done)

    async def parse(request: Request, model: type[protocol.SamplingRequest]) -> Any:
        raw = await read_body(request)
        return await asyncio.to_thread(protocol.parse_body, raw, model)  # (a big body is no stall)

    @app.get("/openapi.json", include_in_schema=False)
    async def openapi(request: Request) -> Response:
        authorize(request)
        return JSONResponse(_with_request_bodies(app.openapi()))

    def check_model(model: str | None) -> None:
        # 404, as OpenAI and vLLM answer it: a client (openai's NotFoundError) tells "no such
        # model" from a malformed request
        if model is not None and model != state.model_name:
            raise APIError(
                404,
                f"model: {model!r} is not served here; this server serves {state.model_name!r}",
                "model",
                "model_not_found",
            )

    @app.get("/health")
    async def health() -> Response:
        if not state.engine.alive:
            return JSONResponse({"status": "engine stopped"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        authorize(request)
        return JSONResponse(
            {
                "object": "list",
                "data": [
                    {
                        "id": state.model_name,
                        "object": "model",
                        "created": 0,
                        "owned_by": "kvpool",
                        "max_model_len": state.max_model_len,
                    }
                ],
            }
        )

    @app.get("/debug/cache")
    async def debug_cache(request: Request) -> Response:
        authorize(request)

        def check(engine) -> dict[str, Any]:
            engine.runner.check_integrity()
            usage = engine.runner.usage()
            return {
                "integrity": "ok",
                "num_blocks": usage.num_blocks,
                "num_used_blocks": usage.num_held_blocks,
                "num_free_blocks": usage.num_free_blocks,
                "num_cached_free_blocks": int(engine.runner.cache_stats().get("cached_free_blocks", 0)),
                "num_requests": len(engine.requests),
                "num_running": len(engine.running),
                "num_waiting": len(engine.waiting),
            }

        try:
            report = await asyncio.wrap_future(state.engine.call(check))
        except RuntimeError as error:
            raise _not_running(state, error) from None
        except AssertionError as error:
            return JSONResponse({"integrity": "failed", "error": str(error)}, status_code=500)
        return JSONResponse(report)

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache(request: Request) -> Response:
        """vLLM's POST /reset_prefix_cache, SGLang's /flush_cache: the engine forgets every prefix
        cached in the device pool between two steps; refused with SGLang's 400 while requests
        hold blocks. The host, disk and Redis tiers keep their entries (vLLM's default,
        reset_connector=False, keeps its connector's): a later request may still hit them."""
        authorize(request)
        try:
            done = await asyncio.wrap_future(state.engine.call(lambda engine: engine.reset_prefix_cache()))
        except RuntimeError as error:
            raise _not_running(state, error) from None
        if not done:
            raise APIError(
                400,
                "the prefix cache was not reset: requests in flight hold blocks; retry once they finish",
                code="requests_in_flight",
            )
        return JSONResponse({"reset": True})

    def tenant_of(request: Request, body: protocol.SamplingRequest, bound: str | None) -> str:
        header = request.headers.get(TENANT_HEADER)
        if bound is not None:
            for param, claimed in (("X-Tenant-Id", header), ("user", body.user)):
                if claimed is not None and claimed != bound:
                    raise APIError(
                        403,
                        f"{param}: names tenant {claimed!r}, but this API key belongs to tenant {bound!r}",
                        param,
                        "tenant_mismatch",
                        type="permission_error",
                    )
            return bound
        if header is not None and not state.trust_tenant_header:
            raise APIError(
                403,
                "X-Tenant-Id: this server does not take tenants from a header; start it with "
                "--trust-tenant-header behind a gateway that sets it, or bind keys to tenants (--api-key KEY:TENANT)",
                "X-Tenant-Id",
                "tenant_header_not_trusted",
                type="permission_error",
            )
        return header or body.user or ""

    def encode(text: str, field: str, rendered: bool = False, param: str | None = None) -> list[int]:
        """The text's token ids (on a worker thread; `rendered`: a chat template's text, which
        writes its own special tokens). A text so long that even tokens of the
        longest kind would overflow the context gets its 400 without being tokenized (that
        would take seconds a megabyte, and hundreds of MB for the encoding)."""
        limit = state.max_model_len
        num_bytes = token_bound.num_bytes(text)
        least = token_bound.least_tokens(num_bytes)
        if least >= limit:
            raise APIError(
                400,  # (as OpenAI and vLLM: a 400 with code context_length_exceeded, not a 413)
                f"{field}: the prompt's {num_bytes} bytes make at least {least} tokens (none spans more than "
                f"{token_bound.max_token_bytes} bytes), more than this model's context of {limit} tokens holds",
                param or field,
                "context_length_exceeded",
            )
        return state.tokenizer.encode_rendered(text) if rendered else state.tokenizer.encode(text)

    def max_tokens_for(
        num_prompt: int, requested: int | None, chat: bool, param: str = "max_tokens", where: str | None = None
    ) -> int:
        """The request's max_tokens within the context; `param` names the field it came in,
        `where` the prompt (a batch's: "prompt[1]")."""
        limit = state.max_model_len
        if num_prompt >= limit:
            field = "messages" if chat else "prompt"
            raise APIError(
                400,
                f"{where or field}: the prompt's {num_prompt} tokens do not fit this model's context of {limit} tokens "
                f"(at most {limit - 1} prompt tokens, leaving room for one output token)",
                field,
                "context_length_exceeded",
            )
        room = limit - num_prompt
        if requested is None:
            return room if chat else min(16, room)  # chat: up to the context; completions: OpenAI's 16
        if requested > room:
            raise APIError(
                400,
                f"{param}: {requested} new tokens after a prompt of {num_prompt} exceed the context of {limit} "
                f"tokens; at most {room} fit",
                param,
                "context_length_exceeded",
            )
        return requested

    def token_ids_in_vocabulary(body: protocol.SamplingRequest) -> None:
        """The 400 for a sampling field naming a token id outside the model's vocabulary
        (the engine's ValueError would be a 500)."""
        vocab = state.engine.engine.runner.vocab_size
        for name, ids in (
            ("stop_token_ids", body.stop_token_ids or ()),
            ("logit_bias", map(int, body.logit_bias or ())),
        ):
            bad = [t for t in ids if t >= vocab]
            if bad:
                raise APIError(400, f"{name}: token ids {bad[:5]} outside the vocabulary [0, {vocab})", name)

    def sampling(body: protocol.SamplingRequest, max_tokens: int, logprobs: int | None) -> SamplingParams:
        token_ids_in_vocabulary(body)
        if body.min_tokens > max_tokens:  # (max_tokens as given, or its default: OpenAI's 16, or the context's room)
            raise APIError(
                400, f"min_tokens: {body.min_tokens} is more than the request's max_tokens, {max_tokens}", "min_tokens"
            )
        seed = body.seed if body.seed is not None else random.getrandbits(31)
        # the protocol checked every field first: a ValueError here is our bug (a 500), not the client's
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=body.temperature,
            top_p=body.top_p,
            top_k=body.top_k,
            seed=seed,
            n=body.n,
            stop=body.stop_strings,
            ignore_eos=body.ignore_eos,
            logprobs=logprobs,
            stop_token_ids=tuple(body.stop_token_ids or ()),
            presence_penalty=body.presence_penalty,
            frequency_penalty=body.frequency_penalty,
            repetition_penalty=body.repetition_penalty,
            min_p=body.min_p,
            min_tokens=body.min_tokens,
            logit_bias={int(token): bias for token, bias in (body.logit_bias or {}).items()},
        )

    async def accept(request: Request, model: type[protocol.SamplingRequest]) -> tuple[Any, str]:
        """What both generation endpoints do first, in this order: the API key, the body, the
        model name, the tenant. -> (the parsed body, its tenant)."""
        bound = authorize(request)
        body = await parse(request, model)
        check_model(body.model)
        return body, tenant_of(request, body, bound)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body: CompletionRequest
        body, tenant = await accept(request, CompletionRequest)
        prompts = body.prompts
        # every prompt is checked before any is submitted: a bad one anywhere is the 400
        batch = [await asyncio.to_thread(prompt_ids_of, prompts, i) for i in range(len(prompts))]
        where = [f"prompt[{i}]" if len(prompts) > 1 else None for i in range(len(prompts))]
        params = [
            sampling(body, max_tokens_for(len(ids), body.max_tokens, chat=False, where=at), body.logprobs)
            for ids, at in zip(batch, where, strict=True)
        ]
        return await serve(request, body, "cmpl", batch, params, tenant, chat=False)

    def prompt_ids_of(prompts: list[str] | list[list[int]], i: int) -> list[int]:
        """The token ids of the batch's prompt `i`, or the 400 naming it ("prompt[i]" in a batch)."""
        at = f"prompt[{i}]" if len(prompts) > 1 else "prompt"
        prompt = prompts[i]
        if isinstance(prompt, str):
            prompt_ids = encode(prompt, at, param="prompt")
        else:
            vocab = state.engine.engine.runner.vocab_size
            bad = [t for t in prompt if not 0 <= t < vocab]
            if bad:
                raise APIError(400, f"{at}: token ids {bad[:5]} outside the vocabulary [0, {vocab})", "prompt")
            prompt_ids = list(prompt)
        if not prompt_ids:
            raise APIError(400, f"{at}: encodes to no tokens", "prompt")
        return prompt_ids

    def encode_chat(body: ChatCompletionRequest) -> list[int]:
        try:
            text = state.tokenizer.render_chat(
                body.template_messages(),
                add_generation_prompt=body.add_generation_prompt,
                template_kwargs=body.chat_template_kwargs,
            )
        except ValueError as error:  # render_chat's one line (the template's own checks, anything it raises)
            if str(error).startswith("chat_template_kwargs: "):
                raise APIError(400, str(error), "chat_template_kwargs") from None
            raise APIError(400, f"messages: {error}", "messages") from None
        if body.continue_final_message:
            # the prompt ends where the last message's text does: what the template put after
            # it (the end of its turn) goes, and the model continues the message
            final = body.messages[-1].text()
            end = text.rfind(final)
            if end < 0:
                raise APIError(
                    400,
                    "continue_final_message: the chat template does not render the last message's text as sent",
                    "continue_final_message",
                )
            text = text[: end + len(final)]
        return encode(text, "messages", rendered=True)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        body: ChatCompletionRequest
        body, tenant = await accept(request, ChatCompletionRequest)
        prompt_ids = await asyncio.to_thread(encode_chat, body)
        named = "max_tokens" if body.max_completion_tokens is None else "max_completion_tokens"
        max_tokens = max_tokens_for(len(prompt_ids), body.requested_max_tokens, chat=True, param=named)
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        params = sampling(body, max_tokens, logprobs)
        return await serve(request, body, "chatcmpl", [prompt_ids], [params], tenant, chat=True)

    async def serve(
        request: Request,
        body: protocol.SamplingRequest,
        prefix: str,
        batch: list[list[int]],
        params: list[SamplingParams],
        tenant: str,
        chat: bool,
    ) -> Response:
        """Serves one prompt, or a batch: one engine request a prompt (`batch[i]` with
        `params[i]`), their events merged into one response (_Merged)."""
        engine = state.engine
        request_id = engine.new_request_id(prefix)
        # the engine's ids: the response's own for one prompt, "ID-i" for the batch's prompt i
        request_ids = [request_id] if len(batch) == 1 else [f"{request_id}-{i}" for i in range(len(batch))]
        queues: list[asyncio.Queue[Event]] = []
        try:
            for rid, prompt_ids, one in zip(request_ids, batch, params, strict=True):
                queues.append(engine.submit(rid, prompt_ids, one, tenant))
        except RuntimeError as error:
            for rid in request_ids[: len(queues)]:  # (the engine stopped: a no-op where it has)
                try:
                    engine.abort(rid)
                except RuntimeError:
                    pass
            raise _not_running(state, error) from None
        token_bytes = getattr(engine, "token_bytes", None)
        context_of = getattr(token_bytes, "context", None)  # (a TokenBytes: SentencePiece-style, a context)
        contexts = []
        for prompt_ids in batch:
            context, num_cut = context_of(prompt_ids, len(prompt_ids)) if context_of is not None else ([], 0)
            contexts.append(
                (
                    bool(context),
                    b"".join(token_bytes(t) for t in context[num_cut:]) if context_of is not None else b"",
                    token_bytes(context[num_cut - 1])
                    if num_cut and context[num_cut - 1] in token_bytes.byte_tokens
                    else b"",
                )
            )
        n = params[0].n
        shape = _Shape(
            request_id,
            state.model_name,
            chat,
            token_text,
            params[0].logprobs is not None,
            body.include_usage,
            contexts,
            n,
        )
        events: asyncio.Queue[Event] | _Merged = queues[0] if len(queues) == 1 else _Merged(queues, n)
        if body.stream:
            return StreamingResponse(
                _stream(engine, request_ids, events, shape, body.include_usage),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        return await _complete(engine, request, request_ids, events, shape, n)

    return app


def _with_request_bodies(doc: dict[str, Any]) -> dict[str, Any]:
    """The schema with the request bodies the handlers parse themselves (they read the raw
    body after the key check, so FastAPI cannot see them). Idempotent: FastAPI caches `doc`."""
    schemas = doc.setdefault("components", {}).setdefault("schemas", {})
    for path, model in (("/v1/completions", CompletionRequest), ("/v1/chat/completions", ChatCompletionRequest)):
        schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
        schemas.update(schema.pop("$defs", {}))
        schemas[model.__name__] = schema
        ref = {"$ref": f"#/components/schemas/{model.__name__}"}
        doc["paths"][path]["post"]["requestBody"] = {"required": True, "content": {"application/json": {"schema": ref}}}
    return doc


# ---- one request's responses ----------------------------------------------------------------


class _Shape:
    """Builds one request's OpenAI objects: chunks while it streams, the whole response at the end."""

    def __init__(
        self,
        request_id: str,
        model: str,
        chat: bool,
        token_text: TokenText,
        logprobs: bool,
        include_usage: bool = False,
        contexts: list[tuple[bool, bytes, bytes]] | None = None,
        n: int = 1,
    ) -> None:
        self.id, self.model, self.chat, self.tt, self.logprobs = request_id, model, chat, token_text, logprobs
        # prompt i's (after_prompt, carried, cut) for its choices i * n .. i * n + n - 1 (one
        # prompt's, or a batch's): the samples' text is decoded after the prompt's last tokens
        # (TokenBytes.context), so the decoder's first-space strip does not apply to it;
        # `carried`: the bytes of a character the prompt leaves open, the samples' text's
        # first; `cut`: the byte of the cut context token that run starts with (TextOffsets)
        self.contexts, self.n = contexts or [(False, b"", b"")], n
        self.include_usage = include_usage
        self.created = protocol.now()
        self.object = "chat.completion" if chat else "text_completion"
        self.text_offsets: dict[int, protocol.TextOffsets] = {}

    def _logprobs(self, delta: Delta) -> dict[str, Any] | None:
        if not self.logprobs:
            return None
        if self.chat:
            return protocol.chat_logprobs(delta.logprobs, delta.token_ids, self.tt)
        offsets = self.text_offsets.get(delta.index)
        if offsets is None:
            offsets = self.text_offsets[delta.index] = protocol.TextOffsets(
                self.tt, *self.contexts[delta.index // self.n]
            )
        return protocol.completion_logprobs(delta.logprobs, delta.token_ids, self.tt, offsets)

    def chunk(self, delta: Delta, first: bool) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": delta.index}
        if self.chat:
            message: dict[str, Any] = {}
            if first:
                message["role"] = "assistant"
            if delta.text or first:
                message["content"] = delta.text
            choice["delta"] = message
        else:
            choice["text"] = delta.text
        choice["logprobs"] = self._logprobs(delta)
        choice["finish_reason"] = delta.finish_reason
        # with include_usage every chunk but the last carries "usage": null, as OpenAI's do
        return self._envelope([choice], **({"usage": None} if self.include_usage else {}))

    def usage_chunk(self, output) -> dict[str, Any]:
        return self._envelope([], usage=protocol.usage(output))

    def _envelope(self, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        """A streamed chunk: the request's id, object (chat: chat.completion.chunk), created and
        model, then `choices` and `extra`, for the content chunks and the usage chunk alike."""
        return {
            "id": self.id,
            "object": f"{self.object}.chunk" if self.chat else self.object,
            "created": self.created,
            "model": self.model,
            "choices": choices,
            **extra,
        }

    def response(self, output, texts: dict[int, list[str]], deltas: dict[int, list[Delta]]) -> dict[str, Any]:
        choices = []
        for index, completion in enumerate(output.completions):
            text = "".join(texts.get(index, []))
            parts = deltas.get(index, [])
            merged = Delta(
                index,
                text,
                [t for d in parts for t in d.token_ids],
                [lp for d in parts for lp in d.logprobs],
                completion.finish_reason,
            )
            logprobs = self._logprobs(merged)
            if self.chat:
                choice = {"index": index, "message": {"role": "assistant", "content": text}}
            else:
                choice = {"index": index, "text": text}
            choice["logprobs"] = logprobs
            choice["finish_reason"] = completion.finish_reason
            choices.append(choice)
        return {
            "id": self.id,
            "object": self.object,
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": protocol.usage(output),
        }


def _sse(data: dict[str, Any] | str) -> bytes:
    payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return f"data: {payload}\n\n".encode()


async def _stream(
    engine: EngineThread,
    request_ids: list[str],
    events: asyncio.Queue[Event] | _Merged,
    shape: _Shape,
    include_usage: bool,
) -> AsyncIterator[bytes]:
    started: set[int] = set()
    done = False
    try:
        while True:
            event = await events.get()
            if isinstance(event, Delta):
                first = event.index not in started
                started.add(event.index)
                if event.text or event.finish_reason or first or (shape.logprobs and event.token_ids):
                    yield _sse(shape.chunk(event, first))
            elif isinstance(event, Finished):
                done = True
                if include_usage:
                    yield _sse(shape.usage_chunk(event.output))
                yield _sse("[DONE]")
                return
            else:
                assert isinstance(event, Failed)
                done = len(request_ids) == 1  # (a batch's other prompts are aborted below)
                yield _sse(_failure(event).body())
                yield _sse("[DONE]")
                return
    finally:
        if isinstance(events, _Merged):
            events.close()
        if not done:  # the client went away (or the server is stopping): free its cache now
            _abort(engine, request_ids)


async def _complete(
    engine: EngineThread,
    request: Request,
    request_ids: list[str],
    events: asyncio.Queue[Event] | _Merged,
    shape: _Shape,
    n: int,
) -> Response:
    texts: dict[int, list[str]] = {}
    deltas: dict[int, list[Delta]] = {}
    disconnected = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        while True:
            getter = asyncio.ensure_future(events.get())
            finished, _ = await asyncio.wait({getter, disconnected}, return_when=asyncio.FIRST_COMPLETED)
            if getter not in finished:
                getter.cancel()
                _abort(engine, request_ids)
                return Response(status_code=499)  # nobody reads it
            event = getter.result()
            if isinstance(event, Delta):
                texts.setdefault(event.index, []).append(event.text)
                deltas.setdefault(event.index, []).append(event)
            elif isinstance(event, Finished):
                if any(c.finish_reason == "abort" for c in event.output.completions):
                    # the server stopped mid-request (a client's own abort returned above): a
                    # cut text with a 200 would pass for an answer; a 503 is one a client retries
                    raise APIError(
                        503,
                        "the server stopped before the request finished; send it again",
                        code="server_shutting_down",
                        type="server_error",
                    )
                return JSONResponse(shape.response(event.output, texts, deltas))
            else:
                assert isinstance(event, Failed)
                if len(request_ids) > 1:  # a batch's other prompts are not served either
                    _abort(engine, request_ids)
                raise _failure(event)
    finally:
        disconnected.cancel()
        if isinstance(events, _Merged):
            events.close()


def _abort(engine: EngineThread, request_ids: list[str]) -> None:
    """Cancels the requests (each a no-op once it has finished)."""
    for request_id in request_ids:
        try:
            engine.abort(request_id)
        except RuntimeError:
            return  # the engine has stopped and released everything itself


@dataclass
class _BatchOutput:
    """A batch's outputs as one: what the response and its usage read of a RequestOutput.
    The choices prompt by prompt; the prompts' tokens (their sum is the usage's) and cached
    tokens summed."""

    prompt_token_ids: list[int]
    completions: list[Any]
    num_cached_tokens: int


class _Merged:
    """The events of a batch's requests (one a prompt, n samples each) as one request's: a
    Delta's index becomes prompt * n + sample; one Finished when every prompt has finished
    (a _BatchOutput), or the first Failed. `get` as a queue's; `close` ends the forwarding."""

    def __init__(self, queues: list[asyncio.Queue[Event]], n: int) -> None:
        self.n = n
        self.merged: asyncio.Queue[tuple[int, Event]] = asyncio.Queue()
        self.outputs: list[Any] = [None] * len(queues)
        self.tasks = [asyncio.ensure_future(self._forward(i, q)) for i, q in enumerate(queues)]

    async def _forward(self, i: int, queue: asyncio.Queue[Event]) -> None:
        while True:
            event = await queue.get()
            self.merged.put_nowait((i, event))
            if not isinstance(event, Delta):
                return

    async def get(self) -> Event:
        while True:
            i, event = await self.merged.get()
            if isinstance(event, Delta):
                return dataclasses.replace(event, index=i * self.n + event.index)
            if isinstance(event, Failed):
                return event
            assert isinstance(event, Finished)
            self.outputs[i] = event.output
            if all(out is not None for out in self.outputs):
                return Finished(
                    _BatchOutput(  # type: ignore[arg-type]
                        [t for out in self.outputs for t in out.prompt_token_ids],
                        [c for out in self.outputs for c in out.completions],
                        sum(out.num_cached_tokens for out in self.outputs),
                    )
                )

    def close(self) -> None:
        for task in self.tasks:
            task.cancel()


def _failure(event: Failed) -> APIError:
    return APIError(
        event.status, event.message, type="server_error" if event.status >= 500 else "invalid_request_error"
    )


async def _wait_for_disconnect(request: Request) -> None:
    """Returns when the client closes the connection (the body has been read already)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
