"""The OpenAI API's request bodies (pydantic) and the response shapes kvpool serve returns.

Requests are validated field by field; a bad one gets OpenAI's error object,
`{"error": {"message", "type": "invalid_request_error", "param", "code"}}`, with the field
in `param` and in the message. So does a body that is not one: empty, not UTF-8, not JSON
(NaN and Infinity included), nested too deeply, not an object, or holding a string UTF-8
cannot encode (a lone surrogate escape such as "\\ud800" in JSON, which no tokenizer or tenant salt
takes) (`parse_body`). Fields OpenAI defines that kvpool does not implement (penalties,
echo, best_of > n, suffix, tools, tool_choice, response_format other than
text) are refused when set to anything but their neutral value, never silently ignored;
unknown fields are ignored, as OpenAI ignores them, except vLLM's sampling extensions that
kvpool does not implement (guided_*, bad_words,
...): a client written for vLLM sends them, and they are refused as OpenAI's are. An optional
field sent as JSON null
takes its default, as OpenAI takes it (`"temperature": null` is 1.0, `"n": null` is 1); a
required one (`prompt`, `messages`) sent as null is refused. Extensions served, as vLLM names
them: `top_k` (0 or vLLM's -1 for all tokens), `ignore_eos`, `stop_token_ids` (ids that end
a sample besides EOS; one outside the vocabulary a 400), `repetition_penalty` (> 0), `min_p`
(in [0, 1]) and `min_tokens` (at most the max_tokens the request comes to), beside
OpenAI's `presence_penalty` / `frequency_penalty` (in [-2, 2]) and `logit_bias` (token id ->
bias in [-100, 100]; an id outside the vocabulary a 400): engine/sampling.py `processed_logits`.
"""

from __future__ import annotations

import codecs
import json
import time
from functools import cache
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, JsonValue, StringConstraints, ValidationError, model_validator

from kvpool.engine.engine import RequestOutput
from kvpool.engine.sampling import MAX_STOP_CHARS, SEED_MAX, SEED_MIN
from kvpool.models.tokenizer import ascii_letter_byte, incomplete_tail, skipped_ids
from kvpool.server.text_stream import TokenBytes, fallback_text

if TYPE_CHECKING:
    from kvpool.models.tokenizer import ChatTokenizer

MAX_N = 16  # samples per request
# choices per completions request: prompts x n (each prompt is one engine request with n
# samples); it bounds what one request can make the engine hold
MAX_CHOICES = 64
MAX_STOP = 4  # stop strings per request (OpenAI's limit)
MAX_COMPLETION_LOGPROBS = 5  # OpenAI's limit for /v1/completions
MAX_TOP_LOGPROBS = 20  # OpenAI's limit for chat

NonEmpty = Annotated[str, StringConstraints(min_length=1)]


class APIError(Exception):
    """An error the client caused (or a state the server is in), as OpenAI reports it."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        type: str = "invalid_request_error",
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class NullIsDefault(BaseModel):
    """A body whose optional fields read JSON null as "not given": the field's default.

    Strict types, as OpenAI's API checks them: `true` is no count (`max_tokens: true` was 1,
    `prompt: [true]` the token id 1, completions' `logprobs: true` one top logprob), and a
    string is no number or boolean (`"stream": "false"`, `"temperature": "0"`). A JSON
    integer still fills a float field."""

    model_config = ConfigDict(extra="ignore", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _drop_nulls(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data  # not an object: pydantic's own error names it
        fields = cls.model_fields
        return {k: v for k, v in data.items() if v is not None or k not in fields or fields[k].is_required()}


# vLLM's extensions above -> the values that ask for nothing (JSON null takes the first)
_VLLM_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "length_penalty": (1.0,),
    "bad_words": (None, []),
    "allowed_token_ids": (None,),
    "include_stop_str_in_output": (False,),
    "skip_special_tokens": (True,),
    "use_beam_search": (False,),
    "prompt_logprobs": (None,),
    "truncate_prompt_tokens": (None,),
    "guided_json": (None,),
    "guided_regex": (None,),
    "guided_choice": (None,),
    "guided_grammar": (None,),
    # (these change the output's text, not the tokens: still another answer than was asked for)
    "return_tokens_as_token_ids": (False,),
    "spaces_between_special_tokens": (True,),
    "structured_outputs": (None,),  # (vLLM's later name for the guided_ fields)
    "logits_processors": (None, []),
}
# each endpoint's own: completions add the tokenizer's special tokens, chat's template holds
# them; completions' response_format is vLLM's structured output (chat's is checked apart)
_VLLM_COMPLETION_NEUTRAL = {**_VLLM_NEUTRAL, "add_special_tokens": (True,), "response_format": (None, {"type": "text"})}
_VLLM_CHAT_NEUTRAL = {
    **_VLLM_NEUTRAL,
    "add_special_tokens": (False,),
    "chat_template": (None,),  # (chat_template_kwargs is served)
    "echo": (False,),
    "documents": (None, []),
}


class StreamOptions(NullIsDefault):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: usage in every chunk (not served)

    @model_validator(mode="after")
    def _check(self) -> StreamOptions:
        if self.continuous_usage_stats:
            raise ValueError(
                "stream_options.continuous_usage_stats: not supported by kvpool serve (only false is accepted; "
                "include_usage gives the counts in the last chunk)"
            )
        return self


class SamplingRequest(NullIsDefault):
    """What both endpoints share."""

    # vLLM's extensions this endpoint refuses unless neutral: field -> the values that ask for nothing
    vllm_neutral: ClassVar[dict[str, tuple[Any, ...]]] = _VLLM_NEUTRAL

    model: str | None = None  # None: the served model
    # below 1e-5 the sampler is greedy (engine/sampling.py); a top_p that fp32 rounds to 0
    # keeps the most likely token: every finite value in these ranges is served
    temperature: float = Field(1.0, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: float = Field(1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    # extension, as vLLM's: 0 or -1 (vLLM's "all tokens") = off; -1 is read as 0 (_check_common)
    top_k: int = Field(0, ge=-1)
    n: int = Field(1, ge=1, le=MAX_N)
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)  # int64, as OpenAI's; None: a fresh one
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # the tenant (see the server's docs)
    ignore_eos: bool = False  # extension: generate max_tokens tokens whatever is sampled
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0, allow_inf_nan=False)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0, allow_inf_nan=False)
    # token id (a decimal string, as JSON keys are) -> a bias added to its logit
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0, allow_inf_nan=False)]] | None = None
    repetition_penalty: float = Field(1.0, gt=0.0, allow_inf_nan=False)  # vLLM's extension
    min_p: float = Field(0.0, ge=0.0, le=1.0, allow_inf_nan=False)  # vLLM's extension
    min_tokens: int = Field(0, ge=0)  # vLLM's extension: at most the request's max_tokens
    # vLLM's sampling extensions that kvpool does not implement: a client written for vLLM
    # sends them, and would get other tokens than it asked for if they were ignored as unknown
    length_penalty: float = Field(1.0, allow_inf_nan=False)
    # vLLM's sampling extensions that kvpool serves: token ids that end a sample besides EOS
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    bad_words: list[str] | None = None
    allowed_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    use_beam_search: bool = False
    prompt_logprobs: int | None = None
    truncate_prompt_tokens: int | None = None
    guided_json: Any = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    return_tokens_as_token_ids: bool = False
    spaces_between_special_tokens: bool = True
    structured_outputs: Any = None
    logits_processors: list[Any] | None = None

    @model_validator(mode="after")
    def _check_common(self) -> SamplingRequest:
        if self.top_k == -1:
            self.top_k = 0
        stops = self.stop_strings
        if any(not s for s in stops):
            raise ValueError("stop: a stop string is empty")
        if len(stops) > MAX_STOP:
            raise ValueError(f"stop: at most {MAX_STOP} stop strings, got {len(stops)}")
        if stops and (longest := max(len(s) for s in stops)) > MAX_STOP_CHARS:
            # (SamplingParams refuses it too, but its ValueError would be the server's 500)
            raise ValueError(f"stop: a stop string of {longest} characters; at most {MAX_STOP_CHARS} characters")
        for key in self.logit_bias or ():
            if not (key.isascii() and key.isdecimal()):
                raise ValueError(f"logit_bias: keys are token ids (decimal integers >= 0), got {key!r}")
        for name, neutral in self.vllm_neutral.items():
            if getattr(self, name) not in neutral:
                accepted = " or ".join(json.dumps(v) for v in neutral)
                raise ValueError(f"{name}: not supported by kvpool serve (only {accepted} is accepted)")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options: only allowed with stream: true")
        return self

    @property
    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(SamplingRequest):
    # one prompt (text or token ids), or a batch of them (a list of texts, a list of token-id
    # lists): each prompt gets n choices, prompt by prompt (choice index = prompt * n + sample)
    prompt: NonEmpty | list[int] | list[NonEmpty] | list[list[int]]
    max_tokens: int | None = Field(None, ge=1)  # None: OpenAI's 16, fewer where the context ends first
    logprobs: int | None = Field(None, ge=0, le=MAX_COMPLETION_LOGPROBS)
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None
    add_special_tokens: bool = True
    response_format: dict[str, Any] | None = None

    vllm_neutral: ClassVar[dict[str, tuple[Any, ...]]] = _VLLM_COMPLETION_NEUTRAL

    @model_validator(mode="after")
    def _check(self) -> CompletionRequest:
        prompt = self.prompt
        if isinstance(prompt, list):
            if not prompt:
                raise ValueError("prompt: empty")
            if isinstance(prompt[0], str | list):
                for i, one in enumerate(prompt):
                    if not one:
                        raise ValueError(f"prompt: prompt {i} is empty" if len(prompt) > 1 else "prompt: empty")
                if len(prompt) * self.n > MAX_CHOICES:
                    raise ValueError(
                        f"prompt: {len(prompt)} prompts x n={self.n} make {len(prompt) * self.n} choices; "
                        f"at most {MAX_CHOICES} a request"
                    )
        if self.echo:
            raise ValueError("echo: not supported by kvpool serve")
        if self.suffix:
            raise ValueError("suffix: not supported by kvpool serve")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of: not supported by kvpool serve (only best_of == n)")
        return self

    @property
    def prompts(self) -> list[str] | list[list[int]]:
        """The request's prompts: one, or the batch's in order."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if isinstance(prompt[0], str | list):
            return list(prompt)  # type: ignore[arg-type]
        return [prompt]  # type: ignore[list-item]


class ContentPart(BaseModel):
    model_config = ConfigDict(strict=True)

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[ContentPart] | None = None
    name: str | None = None  # the participant's name: the template gets it, as vLLM hands it on

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        # One line a part, as vLLM renders a message's text parts ("\n".join in its chat_utils):
        # the same messages give the same prompt on either server.
        return "\n".join(part.text for part in self.content)


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)  # OpenAI's newer name for max_tokens
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[Any] | None = None
    tool_choice: Any = None
    functions: list[Any] | None = None  # OpenAI's deprecated names for tools and tool_choice
    function_call: Any = None
    response_format: dict[str, Any] | None = None
    # variables the chat template gets besides the messages (vLLM's name; Qwen3's enable_thinking)
    chat_template_kwargs: dict[str, JsonValue] | None = None
    # vLLM's: false renders the messages without the template's opening of the answer;
    # continue_final_message (with it false) ends the prompt at the last message's text
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    # vLLM's chat extensions that change the prompt (refused unless neutral: _VLLM_CHAT_NEUTRAL)
    chat_template: str | None = None
    echo: bool = False
    documents: list[Any] | None = None
    add_special_tokens: bool = False

    vllm_neutral: ClassVar[dict[str, tuple[Any, ...]]] = _VLLM_CHAT_NEUTRAL

    @model_validator(mode="before")
    @classmethod
    def _text_parts_only(cls, data: Any) -> Any:
        """An image or audio part is named as such; pydantic's own error for it is the union's
        first member's ("content: Input should be a valid string"), which hides the cause."""
        messages = data.get("messages") if isinstance(data, dict) else None
        for i, message in enumerate(messages if isinstance(messages, list) else []):
            content = message.get("content") if isinstance(message, dict) else None
            for j, part in enumerate(content if isinstance(content, list) else []):
                kind = part.get("type") if isinstance(part, dict) else None
                if isinstance(kind, str) and kind != "text":
                    raise ValueError(
                        f"messages[{i}].content[{j}].type: {kind!r} parts are not supported by kvpool serve "
                        '(a text model: only "text" parts)'
                    )
        return data

    @model_validator(mode="after")
    def _check(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs: needs logprobs: true")
        if self.tools:
            raise ValueError("tools: not supported by kvpool serve")
        if self.functions:
            raise ValueError("functions: not supported by kvpool serve")
        for name in ("tool_choice", "function_call"):
            if getattr(self, name) not in (None, "none"):
                raise ValueError(f'{name}: not supported by kvpool serve (no tools; only "none" is accepted)')
        if self.response_format is not None and self.response_format != {"type": "text"}:
            raise ValueError('response_format: not supported by kvpool serve (only {"type": "text"} is accepted)')
        if self.continue_final_message:
            if self.add_generation_prompt:
                raise ValueError("continue_final_message: needs add_generation_prompt: false (it opens a new answer)")
            if not self.messages[-1].text():
                raise ValueError("continue_final_message: the last message has no text to continue")
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            if self.max_tokens != self.max_completion_tokens:
                raise ValueError("max_completion_tokens: differs from max_tokens; give one")
        return self

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def template_messages(self) -> list[dict[str, str]]:
        """The messages as the chat template takes them (developer is the system role; a
        `name` key only where the message has one)."""
        messages = []
        for m in self.messages:
            message = {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
            if m.name is not None:
                message["name"] = m.name
            messages.append(message)
        return messages


_Body = TypeVar("_Body", bound=BaseModel)


def parse_body(raw: bytes, model: type[_Body]) -> _Body:
    """A request body as `model`, or the APIError (400) that names what is wrong with it."""
    if not raw.strip():
        raise APIError(400, "the body is empty: send a JSON object")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise APIError(400, f"the body is not valid UTF-8: {error.reason} at byte {error.start}") from None
    try:
        data = json.loads(text, parse_constant=_refuse_constant)
    except RecursionError:
        raise APIError(400, "the body is not valid JSON: nested too deeply") from None
    except ValueError as error:  # (json.JSONDecodeError is one)
        raise APIError(400, f"the body is not valid JSON: {error}") from None
    if not isinstance(data, dict):
        raise APIError(400, f"the body must be a JSON object, got {_json_kind(data)}")
    bad = _unencodable_string(data)
    if bad is not None:
        field, error = bad
        raise APIError(
            400,
            f"{field}: holds a lone surrogate ({error.object[error.start : error.end]!r} at character "
            f"{error.start}), which is not Unicode text",
            field.split("[", 1)[0].split(".", 1)[0],
        )
    try:
        return model.model_validate(data)
    except ValidationError as error:
        raise validation_error(list(error.errors())) from None
    except RecursionError:  # a deeply nested value in a field pydantic walks
        raise APIError(400, "the body is not valid JSON: nested too deeply") from None


def _json_kind(value: Any) -> str:
    """What a decoded JSON value is, in JSON's words (not Python's `NoneType`, `int`, `list`)."""
    if value is None:
        return "null"
    if isinstance(value, bool):  # (before int: a bool is one)
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    return "a string" if isinstance(value, str) else "an array"


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON value")


def _unencodable_string(data: Any) -> tuple[str, UnicodeEncodeError] | None:
    """The first string (key or value) UTF-8 cannot encode, with its path, if any.
    Iterative: the JSON decoder's own depth limit bounds the stack, not this walk."""
    stack: list[tuple[str, Any]] = [("", data)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, dict):
            for key, item in value.items():
                child = f"{path}.{key}" if path else str(key)
                try:
                    key.encode()
                except UnicodeEncodeError as error:
                    return (path or "body", error)
                stack.append((child, item))
        elif isinstance(value, list):
            stack.extend((f"{path}[{i}]", item) for i, item in enumerate(value))
        elif isinstance(value, str):
            try:
                value.encode()
            except UnicodeEncodeError as error:
                return (path, error)
    return None


# pydantic's names for the members of a union, in an error's location: not fields
_UNION_TAGS = frozenset({"str", "int", "float", "bool", "dict", "list", "none"})


def validation_error(errors: list[dict[str, Any]]) -> APIError:
    """pydantic's first error, as an OpenAI error naming the field."""
    first = errors[0]
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    # union members and validators add their own names to the location: keep the fields
    fields: list[str] = []
    for part in loc:
        if part.isdigit() and fields:
            fields[-1] += f"[{part}]"
        elif part in _UNION_TAGS or part.startswith(("constrained-", "function-")) or "[" in part:
            continue  # (exact names: a field may start with one, as `stream` does with "str")
        else:
            fields.append(part)
    message = str(first.get("msg", "invalid value"))
    if message.startswith("Value error, "):
        message = message.removeprefix("Value error, ")  # our own validators name the field first
        param = message.split(":", 1)[0] if ":" in message else (".".join(fields) or None)
        return APIError(400, message, param)
    param = ".".join(fields) or None
    if first.get("type") == "missing":
        return APIError(400, f"{param}: required", param)
    return APIError(400, f"{param}: {message}" if param else message, param)


# ---- responses -------------------------------------------------------------------------


def usage(out: RequestOutput) -> dict[str, Any]:
    completion = sum(len(c.token_ids) for c in out.completions)
    prompt = len(out.prompt_token_ids)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": out.num_cached_tokens},
    }


@cache
def _byte_decoder() -> dict[str, int]:
    """Byte-level BPE's alphabet back to bytes (GPT-2's printable mapping of 0..255)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


class TokenText:
    """A token id's bytes and text, as the logprobs fields show them. `byte_tokens`: None for
    byte-level BPE (each piece spelled in GPT-2's byte alphabet); for a SentencePiece-style
    tokenizer (models/hf_tokenizer.py), its byte-fallback tokens ("<0xNN>": that byte), every
    other piece being UTF-8 text with "▁" for a space."""

    def __init__(
        self,
        id_to_token,
        byte_tokens: frozenset[int] | None = None,
        skipped: frozenset[int] = frozenset(),
        strips_first_space: bool = False,
    ) -> None:
        self._id_to_token = id_to_token
        self.byte_tokens = byte_tokens
        self.skipped = skipped  # special tokens: the text (skip_special_tokens) leaves them out
        self.strips_first_space = strips_first_space  # a SentencePiece decoder's Strip: the text's first space

    def bytes(self, token_id: int) -> list[int]:
        piece = self._id_to_token(token_id) or ""
        if self.byte_tokens is not None:
            if token_id in self.byte_tokens:
                return [int(piece[3:5], 16)]
            return list(piece.replace("\u2581", " ").encode())
        table = _byte_decoder()
        if all(ch in table for ch in piece):
            return [table[ch] for ch in piece]
        return list(piece.encode())  # a special token spelled outside the byte alphabet

    def text(self, token_id: int) -> str:
        return bytes(self.bytes(token_id)).decode("utf-8", errors="replace")

    def span(self, token_id: int) -> int:
        """The most bytes of a prompt's text that this token can stand for: its bytes; for a
        SentencePiece piece, its spelling's where longer ("▁", 3 bytes, may be a "▁" of the text)."""
        num = len(self.bytes(token_id))
        if self.byte_tokens is not None and token_id not in self.byte_tokens:
            num = max(num, len((self._id_to_token(token_id) or "").encode()))
        return num


def token_text(tok: ChatTokenizer) -> TokenText:
    """The TokenText of a loaded tokenizer: byte-level BPE or SentencePiece-style, and whether
    its decoder strips the text's first space, as its loader decided them (ChatTokenizer's
    byte_fallback, strips_first_space: models/tokenizer.py, models/hf_tokenizer.py)."""
    tokenizer = tok.tokenizer
    skipped = skipped_ids(tokenizer)
    if tok.byte_fallback is None:
        return TokenText(tokenizer.id_to_token, skipped=skipped)
    return TokenText(tokenizer.id_to_token, frozenset(tok.byte_fallback), skipped, tok.strips_first_space)


def decoded_bytes(tok: ChatTokenizer) -> TokenBytes:
    """A token id's bytes as the text's decode (`skip_special_tokens`) joins them: a special
    token's are none; and the decoder's kind (byte-level BPE or SentencePiece-style: the
    TokenBytes says which, and so how TextStream decodes)."""
    tt = token_text(tok)
    skipped = tt.skipped

    def token_bytes(token_id: int) -> bytes:
        return b"" if token_id in skipped else bytes(tt.bytes(token_id))

    return TokenBytes(token_bytes, tok.byte_fallback, skipped, ascii_letter_byte(tok.byte_fallback))


class TokenBound:
    """The fewest tokens a text can make, without tokenizing it. Byte-level BPE: each byte
    of the text lies in exactly one token, but for the bytes the vocabulary has no token of
    (dropped: in SmolLM2 the lead bytes of planes 4-16 and those UTF-8 never uses), and no
    token stands for more bytes than the longest one. SentencePiece-style (byte fallback:
    every byte has a token; the normalizer only turns a space into "▁" and may prepend one):
    the same, a token standing for at most its piece's bytes or its decoded bytes (TokenText.span)."""

    def __init__(self, tt: TokenText, vocab_size: int) -> None:
        vocab = [tt.bytes(t) for t in range(vocab_size)]
        self.max_token_bytes = max(tt.span(t) for t in range(vocab_size))
        self.untokenized = bytes(set(range(256)) - {b[0] for b in vocab if len(b) == 1})

    def num_bytes(self, text: str) -> int:
        """The bytes of `text` that its tokens hold (UnicodeEncodeError for a lone surrogate)."""
        return len(text.encode().translate(None, self.untokenized))

    def least_tokens(self, num_bytes: int) -> int:
        """No tokenization of a text whose tokens hold `num_bytes` bytes has fewer tokens."""
        return -(-num_bytes // self.max_token_bytes)


class TextOffsets:
    """Where each token of one sample starts in its text (the decode of its tokens, special
    ones skipped), in characters, token by token: `text[offset:]` starts with the token's text
    as the text shows it. A SentencePiece decoder strips the text's first space (" Hello"
    shows "Hello"); a token holding only part of a character (the rest in the next tokens)
    starts where the character does; a skipped special token where the next text will. A run of
    byte-fallback tokens that is no valid UTF-8 as a whole is one U+FFFD a byte (the
    ByteFallback decoder's rule), so a later byte may still change the run's text: the offsets
    given are those of the text so far, as a stream can know them."""

    def __init__(self, tt: TokenText, after_prompt: bool = False, carried: bytes = b"", cut: bytes = b"") -> None:
        self.tt = tt
        # the first space is stripped where the decoder strips it and the text was decoded
        # alone, not after the prompt's last tokens (models/tokenizer.py decode_context)
        self.strips = tt.strips_first_space and not after_prompt
        # characters of the text before `pending` (the first space not yet stripped); `cut`: the
        # byte of a cut context token the run starts with (decode_context's ASCII letter or
        # never-valid byte: one character, valid run or not), not the text's
        self.chars = -len(cut)
        self.first = ""  # the text's first character, once there is one
        # byte-level: an incomplete character's bytes; SentencePiece: the byte-fallback run, from
        # `cut` and `carried` on (a character the prompt leaves open: the text's first, decode_context)
        self.pending = cut + carried
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")

    def _run_text(self, run: bytes) -> str:
        """A byte-fallback run's text so far, less an incomplete character at its end."""
        try:
            return run[: len(run) - incomplete_tail(run)].decode()
        except UnicodeDecodeError:  # no valid UTF-8, whatever bytes follow: a U+FFFD a byte
            return "\ufffd" * len(run)

    def _add_text(self, text: str) -> None:
        if text and not self.first:
            self.first = text[0]
        self.chars += len(text)

    def _start(self, token_id: int, data: bytes) -> int:
        """Where the token starts in the text so far (its first space not yet stripped), its
        bytes `data` ending or continuing what is pending; a piece's ends a byte run."""
        if not self.pending or token_id in self.tt.skipped:
            return self.chars + len(self._run_text(self.pending) if self.tt.byte_tokens is not None else "")
        if self.tt.byte_tokens is None:
            # an incomplete character: the token continues it (starts where it does) or ends it
            # (its bytes are one U+FFFD, as the decoder replaces them)
            out = codecs.getincrementaldecoder("utf-8")("replace").decode(self.pending + data[:1])
            continued = "\ufffd" not in out
            return self.chars + (0 if continued else len(self.pending.decode("utf-8", errors="replace")))
        if token_id not in self.tt.byte_tokens:
            self._add_text(fallback_text(self.pending))
            self.pending = b""
            return self.chars
        run = self.pending + data
        try:
            run[: len(run) - incomplete_tail(run)].decode()
        except UnicodeDecodeError:
            return self.chars + len(self.pending)
        return self.chars + len(self._run_text(self.pending))

    def add(self, token_id: int) -> int:
        """The offset of `token_id`, the sample's next token."""
        data = b"" if token_id in self.tt.skipped else bytes(self.tt.bytes(token_id))
        raw = self._start(token_id, data)
        first = self.first or (self._run_text(self.pending)[:1] if self.tt.byte_tokens is not None else "")
        offset = raw - 1 if self.strips and first == " " and raw > 0 else raw
        if token_id in self.tt.skipped:
            return offset
        if self.tt.byte_tokens is None:
            self._add_text(self._utf8.decode(data))
            self.pending = self._utf8.getstate()[0]  # (the bytes it holds)
        elif token_id in self.tt.byte_tokens:
            self.pending += data
        else:
            self._add_text(data.decode("utf-8", errors="replace"))
        return offset


def completion_logprobs(
    entries: list[tuple[float, list[tuple[int, float]]]], token_ids: list[int], tt: TokenText, offsets: TextOffsets
) -> dict[str, Any]:
    """/v1/completions' logprobs object for these tokens, the next ones of the sample whose
    text `offsets` follows. Each position's `top_logprobs` holds the k most likely tokens and
    the sampled one where it is not among them (up to k + 1, as OpenAI documents it and vLLM
    answers; `logprobs: 0` is the sampled token alone). Chat's `top_logprobs` is the k most
    likely only, as in both."""
    tokens = [tt.text(t) for t in token_ids]
    text_offsets = [offsets.add(t) for t in token_ids]
    top_logprobs = []
    for token_id, (lp, top) in zip(token_ids, entries, strict=True):
        shown = {tt.text(t): v for t, v in top}
        if all(t != token_id for t, _ in top):
            shown[tt.text(token_id)] = lp
        top_logprobs.append(shown)
    return {
        "tokens": tokens,
        "token_logprobs": [lp for lp, _ in entries],
        "top_logprobs": top_logprobs,
        "text_offset": text_offsets,
    }


def chat_logprobs(
    entries: list[tuple[float, list[tuple[int, float]]]], token_ids: list[int], tt: TokenText
) -> dict[str, Any]:
    return {
        "content": [
            {
                "token": tt.text(t),
                "logprob": lp,
                "bytes": tt.bytes(t),
                "top_logprobs": [{"token": tt.text(a), "logprob": v, "bytes": tt.bytes(a)} for a, v in top],
            }
            for t, (lp, top) in zip(token_ids, entries, strict=True)
        ]
    }


def now() -> int:
    return int(time.time())
