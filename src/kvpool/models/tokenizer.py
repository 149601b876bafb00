"""Tokenizer and chat template rebuilt from GGUF metadata (no tokenizer.json needed).

GGUF's `gpt2` tokenizer model is a byte-level BPE: `tokenizer.ggml.tokens` are already
spelled in the byte-to-unicode alphabet and `tokenizer.ggml.merges` are "a b" pairs.
Control tokens (token_type 3, e.g. `<|im_start|>`) become special added tokens so that
they are matched whole. The pre-tokenizer follows `tokenizer.ggml.pre`: SmolLM splits
every digit on its own before the GPT-2 regex (as its original tokenizer.json and
llama.cpp do); Llama 3 ('llama-bpe') and Qwen2 ('qwen2') split with their own regex (the
one in their tokenizer.json, which llama.cpp also runs), and Llama 3 takes a piece that is
a whole vocabulary token as that token before any merge (HF's `ignore_merges`, llama.cpp's
too for that pre-tokenizer).

GGUF's `llama` tokenizer model is SentencePiece BPE (Llama 2, Mistral 7B, TinyLlama): tokens with
scores and no merges; the merges are recovered from the scores (spm_merges), characters the
vocabulary lacks are written as byte-fallback tokens (token_type 6), and text is read as
llama.cpp reads it (_build_spm).
"""

from __future__ import annotations

import codecs
import functools
import itertools
import json
from collections.abc import Container, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, NoReturn

import xxhash
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

from kvpool.models.gguf import TokenizerData

NORMAL_TOKEN_TYPE, UNKNOWN_TOKEN_TYPE, CONTROL_TOKEN_TYPE, USER_DEFINED_TOKEN_TYPE, BYTE_TOKEN_TYPE = 1, 2, 3, 4, 6
# pre-tokenizer kinds that split digits one by one before the GPT-2 byte-level regex
_INDIVIDUAL_DIGIT_PRES = frozenset({"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b"})
# pre-tokenizer kinds that are the GPT-2 byte-level regex alone ("default": a GGUF without the key)
_GPT2_PRES = frozenset({"default", "gpt-2"})


def _split_regex(digits: str) -> str:
    """The split regex Llama 3 and Qwen2 share (each match one piece), `digits` the one
    alternative they differ in. Oniguruma syntax, as the tokenizers library runs it (Python's
    re has no \\p{L} / \\p{N})."""
    return "|".join(
        (
            r"(?i:'s|'t|'re|'ve|'m|'ll|'d)",  # a contraction, in any case
            r"[^\r\n\p{L}\p{N}]?\p{L}+",  # a letter run, with one non-letter non-digit before it
            digits,
            r" ?[^\s\p{L}\p{N}]+[\r\n]*",  # a symbol run, the space before it, the newlines after
            r"\s*[\r\n]+",  # whitespace through the last newline of a run
            r"\s+(?!\S)",  # whitespace, less the space a following word takes
            r"\s+",
        )
    )


# pre-tokenizer kinds with their own split regex: tokenizer.ggml.pre -> (regex, ignore_merges)
_REGEX_PRES = {
    "llama-bpe": (_split_regex(r"\p{N}{1,3}"), True),  # Llama 3: digits in runs of at most three
    "qwen2": (_split_regex(r"\p{N}"), False),  # Qwen2: every digit on its own
}
# what clean_up_tokenization_spaces removes from decoded text: the space before punctuation and contractions
# (in transformers' order: " ' " before " 's")
_CLEAN_UP = (
    tuple((f" {p}", p) for p in (".", "?", "!", ","))
    + ((" ' ", "'"),)
    + tuple((f" {p}", p) for p in ("n't", "'m", "'s", "'ve", "'re"))
)
SUPPORTED_PRES = _GPT2_PRES | _INDIVIDUAL_DIGIT_PRES | frozenset(_REGEX_PRES)


def _check_text(text: str) -> None:
    try:  # (tokenizers raised "TypeError: TextEncodeInput must be Union[...]" on a lone surrogate)
        text.encode()
    except UnicodeEncodeError as error:
        raise ValueError(
            f"the text holds a lone surrogate ({text[error.start]!r} at character {error.start}), "
            "which is not Unicode text"
        ) from None


def _strftime_now(spec: str) -> str:
    """Today's date or time in `spec`'s format: what transformers gives a template as strftime_now."""
    return datetime.now().strftime(spec)


def chat_template_vars(special_tokens: dict[str, str | None]) -> dict[str, Any]:
    """What a chat template gets besides the messages and add_generation_prompt, for a GGUF
    and an HF directory alike, as transformers passes them: no tools or documents, strftime_now
    (Llama 3.2's template dates its system prompt with it) and the special tokens' texts
    (bos_token, eos_token, ...; one that is None is left undefined)."""
    return {
        "tools": None,
        "documents": None,
        "strftime_now": _strftime_now,
        **{name: text for name, text in special_tokens.items() if text is not None},
    }


def _tojson(
    value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None, sort_keys: bool = False
) -> str:
    """A chat template's `tojson`, as transformers defines it: plain JSON, its keys in their
    order and non-ASCII text kept (jinja2's own sorts the keys and escapes <, >, &, ' and
    every non-ASCII character for HTML: a tool's "é & b" came out "\\u00e9 \\u0026 b")."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@functools.cache
def _generation_tag() -> type:
    """The jinja extension for `{% generation %}...{% endgeneration %}`, a tag transformers'
    apply_chat_template knows (templates trained with assistant-token masks wrap the
    assistant's turns in it): the body renders as written, in a scope of its own as in
    transformers (a `{% set %}` inside stays inside); the mask it marks for
    return_assistant_tokens_mask is not kvpool's. jinja2 stock refuses the unknown tag."""
    import jinja2.ext
    import jinja2.nodes

    class GenerationTag(jinja2.ext.Extension):
        tags = {"generation"}

        def parse(self, parser: Any) -> jinja2.nodes.Node:
            lineno = next(parser.stream).lineno  # (the tag's name; it takes no arguments)
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_render_body"), [], [], body).set_lineno(lineno)

        def _render_body(self, caller: Any) -> str:
            return caller()

    return GenerationTag


@dataclass
class ChatTokenizer:
    """Encode / decode text and render chat messages with the model's own template."""

    tokenizer: Tokenizer
    chat_template: str | None
    bos_token_id: int | None
    eos_token_id: int | None
    add_bos_token: bool
    version: str  # part of the cache descriptor: a different tokenizer must never hit the cache
    # an HF directory's (models/hf_tokenizer.py); a GGUF's keep these defaults
    template_source: str = "the GGUF's"  # names where the chat template came from, in its errors
    template_absent: str | None = None  # why there is none (render_chat's error): a named list without "default"
    template_vars: dict[str, Any] = field(default_factory=dict)  # chat_template_vars: bos_token, eos_token, tools, ...
    stop_token_ids: tuple[int, ...] = ()  # generation_config.json's eos ids, besides eos_token_id
    post_process: bool = False  # encode runs tokenizer.json's post-processor (transformers' add_special_tokens)
    add_eos_token: bool = False  # a GGUF's: encode puts the EOS after raw text (tokenizer.ggml.add_eos_token)
    clean_up_spaces: bool = False  # decode drops the space before punctuation (clean_up_tokenization_spaces)
    # the decoder's kind, decided where it is built: None for byte-level BPE, else a SentencePiece-style
    # decoder's byte-fallback tokens, id -> byte (byte_fallback_ids); whether it strips the text's first space
    byte_fallback: dict[int, int] | None = None
    strips_first_space: bool = False

    def _ids(self, text: str, specials: bool) -> list[int]:
        return self.tokenizer.encode_batch([text], add_special_tokens=specials)[0].ids

    def encode(self, text: str) -> list[int]:
        _check_text(text)
        # encode_batch releases the GIL (encode holds it): a server tokenizing a long prompt
        # on a worker thread keeps its event loop and engine thread running meanwhile
        ids = self._ids(text, self.post_process)
        if self.add_bos_token and self.bos_token_id is not None:
            ids = [self.bos_token_id, *ids]
        if self.add_eos_token and self.eos_token_id is not None:
            ids = [*ids, self.eos_token_id]
        return ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        text = self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)
        if self.clean_up_spaces:
            for spaced, clean in _CLEAN_UP:
                text = text.replace(spaced, clean)
        return text

    def render_chat(
        self,
        messages: list[dict[str, str]],
        add_generation_prompt: bool = True,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> str:
        """The chat template (jinja2, as shipped in the GGUF or the HF directory) applied to
        `messages`, with `template_vars` (the special tokens' texts, tools=None, strftime_now)
        and `template_kwargs` over them (what transformers' apply_chat_template passes on from
        its keyword arguments: Qwen3's enable_thinking)."""
        extra = dict(template_kwargs or {})
        for name in ("messages", "add_generation_prompt"):
            if name in extra:
                raise ValueError(f"chat_template_kwargs: {name!r} is the request's own, not a template variable")
        if not self.chat_template:
            if self.template_absent is not None:
                raise ValueError(f"{self.template_absent}; use raw text (--no-chat)")
            if self.template_source == "the GGUF's":
                raise ValueError("this GGUF has no tokenizer.chat_template; use raw text (--no-chat)")
            raise ValueError(f"{self.template_source} chat template is absent; use raw text (--no-chat)")
        import jinja2
        import jinja2.ext
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> NoReturn:  # what HF templates call to refuse messages
            raise jinja2.TemplateError(message)

        # jinja2's default Undefined, as transformers' apply_chat_template and llama.cpp render:
        # an unset name prints as '' and tests false (`{% if documents %}`, `{{ pad_token }}`);
        # reading an attribute of one, or calling it, still refuses the messages
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True,
            lstrip_blocks=True,
            # {% break %} / {% continue %}, which HF templates may use; transformers' {% generation %}
            extensions=[jinja2.ext.loopcontrols, _generation_tag()],
        )
        env.globals["raise_exception"] = raise_exception
        env.filters["tojson"] = _tojson
        # ValueError, one line: a template that is not jinja, or one that refuses the messages
        # (its raise_exception, an undefined name, any exception its rendering raises), was a
        # traceback from the CLI and LLM.chat; every caller (generate, LLM.chat, serve's 400) says it
        try:
            template = env.from_string(self.chat_template)
        except jinja2.TemplateSyntaxError as e:
            raise ValueError(
                f"{self.template_source} chat template is not valid jinja (line {e.lineno}): {e.message}"
            ) from None
        except SyntaxError as e:  # the Python jinja compiles it to refused it ({% break %} in a macro in a loop)
            raise ValueError(f"{self.template_source} chat template is not valid jinja: {e.msg}") from None
        # a message's key whose value is None is left out, as transformers 5.25's apply_chat_template
        # leaves it (an OpenAI message's tool_calls=None, name=None): a template's `is defined` saw it
        # set and `{{ m.name }}` printed 'None'; the caller's messages are not changed
        messages = [{k: v for k, v in m.items() if v is not None} if isinstance(m, Mapping) else m for m in messages]
        try:
            return template.render(
                **{**self.template_vars, **extra}, messages=messages, add_generation_prompt=add_generation_prompt
            )
        except (jinja2.TemplateError, TypeError) as e:  # (its own words, an undefined name, a bad operand)
            raise ValueError(f"the chat template refused the messages: {e}") from None
        except Exception as e:  # anything else it raises ({{ 1/0 }}, the sandbox's range limit): named by its class
            raise ValueError(f"the chat template refused the messages: {type(e).__name__}: {e}") from None

    def encode_rendered(self, text: str) -> list[int]:
        """The ids of a rendered chat template (render_chat's text). An HF directory's: without
        the post-processor, as apply_chat_template (the template writes its own special tokens).
        A GGUF's: with add_bos_token's BOS unless the text already starts with it (Llama 3's
        template writes `{{ bos_token }}`; llama.cpp does not double it either), and without
        add_eos_token's EOS (transformers' apply_chat_template adds none: the model continues
        the generation prompt, which an EOS would close)."""
        _check_text(text)
        ids = self._ids(text, False)
        if self.post_process:
            return ids
        if self.add_bos_token and self.bos_token_id is not None and ids[:1] != [self.bos_token_id]:
            ids = [self.bos_token_id, *ids]
        return ids

    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        return self.encode_rendered(self.render_chat(messages))


def check_tokenizer_kind(model: str, pre: str) -> None:
    """ValueError naming the tokenizer model or pre-tokenizer kvpool does not build, from the
    two header keys (tokenizer.ggml.model and .pre) alone: the loader asks before it hashes
    or reads the weights, and build_tokenizer again (a TokenizerData built by hand)."""
    if model == "llama":  # SentencePiece BPE: no pre-tokenizer to choose
        return
    if model != "gpt2":
        raise ValueError(
            f"unsupported GGUF tokenizer model {model!r}; kvpool builds byte-level BPE ('gpt2') and "
            "SentencePiece BPE ('llama')"
        )
    if pre not in SUPPORTED_PRES:
        # another split of the text (DeepSeek's "deepseek-llm", ...) fell back to GPT-2's
        # regex without a word, and the model was fed token ids its own tokenizer never makes
        known = ", ".join(sorted(SUPPORTED_PRES))
        raise ValueError(
            f"unsupported GGUF pre-tokenizer tokenizer.ggml.pre {pre!r}: kvpool splits text as {known}, "
            "and another split would give token ids the model was not trained on"
        )


def spm_merges(tokens: tuple[str, ...], scores: tuple[float, ...], pieces: set[int]) -> list[tuple[str, str]]:
    """The BPE merges that encode as SentencePiece's BPE does, from the token scores: it joins,
    again and again, the two neighbours whose joined text is the piece of highest score. So a
    merge is any split of a piece into two pieces, ranked by the joined piece's score (highest
    first; one piece's splits: the split further left first). `pieces`: the ids that take part
    (normal tokens: not control, byte or unused ones).

    ValueError where two pieces that merges make share a score: llama.cpp (as SentencePiece)
    then joins the leftmost of the tied neighbours in the text first, an order that ranked
    merges cannot express (the lower id first would encode other tokens than llama.cpp does).
    gguf-py writes such scores (-1000 for every token) for a checkpoint with a tokenizer.json
    and no tokenizer.model; a tokenizer.model's pieces have distinct scores."""
    known = {tokens[i]: i for i in pieces}
    ranked = []
    for i in pieces:
        text = tokens[i]
        for cut in range(1, len(text)):
            if text[:cut] in known and text[cut:] in known:
                ranked.append((-scores[i], i, cut))
    ranked.sort()
    for (score, i, _), (next_score, j, _) in itertools.pairwise(ranked):
        if score == next_score and i != j:
            raise ValueError(
                f"the GGUF's 'llama' tokenizer gives the pieces {tokens[i]!r} and {tokens[j]!r} the same score "
                f"({-score:g}): llama.cpp joins equal-score pieces leftmost in the text first, which kvpool's "
                "ranked merges cannot do (its tokenizer.ggml.scores are not a tokenizer.model's)"
            )
    return [(tokens[i][:cut], tokens[i][cut:]) for _, i, cut in ranked]


def _build_spm(data: TokenizerData) -> ChatTokenizer:
    """A GGUF's SentencePiece tokenizer (tokenizer.ggml.model "llama": Llama 2, Mistral 7B,
    TinyLlama) as llama.cpp runs it: BPE merges from the scores (spm_merges), the byte-fallback
    tokens (token_type 6, "<0xNN>") for characters the vocabulary lacks, a "▁" for each space
    and, with add_space_prefix (default true), before the text and after each special token
    (as Llama 2's own tokenizer.json normalizer: transformers' LlamaTokenizer with legacy true);
    the decoder Replace "▁", ByteFallback, Fuse, Strip the first space (server/text_stream.py
    streams it). Control and unknown tokens are special, user-defined ones added tokens."""
    from tokenizers import normalizers

    if not data.scores:
        raise ValueError(
            "GGUF metadata lacks tokenizer.ggml.scores, which a 'llama' (SentencePiece) tokenizer ranks its merges by"
        )
    types = data.token_types or (NORMAL_TOKEN_TYPE,) * len(data.tokens)
    if BYTE_TOKEN_TYPE not in types:
        raise ValueError(
            "the GGUF's 'llama' tokenizer has no byte tokens (tokenizer.ggml.token_type 6); kvpool takes "
            "SentencePiece BPE with byte fallback"
        )
    pieces = {i for i, k in enumerate(types) if k == NORMAL_TOKEN_TYPE}
    merges = spm_merges(data.tokens, data.scores, pieces)
    vocab = {token: index for index, token in enumerate(data.tokens)}
    unknown = next((t for t, k in zip(data.tokens, types, strict=True) if k == UNKNOWN_TOKEN_TYPE), None)
    try:
        bpe = models.BPE(vocab=vocab, merges=merges, byte_fallback=True, unk_token=unknown, fuse_unk=True)
    except Exception as e:  # (a bare Exception)
        raise ValueError(f"the GGUF's 'llama' tokenizer cannot be built: {e}") from None
    tok = Tokenizer(bpe)
    meta = "\u2581"
    steps = [normalizers.Replace(" ", meta)]
    tok.normalizer = normalizers.Sequence(([normalizers.Prepend(meta)] if data.add_space_prefix else []) + steps)
    parts = [decoders.Replace(meta, " "), decoders.ByteFallback(), decoders.Fuse()]
    tok.decoder = decoders.Sequence(parts + ([decoders.Strip(" ", 1, 0)] if data.add_space_prefix else []))
    special = {CONTROL_TOKEN_TYPE, UNKNOWN_TOKEN_TYPE}
    tok.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t, k in zip(data.tokens, types, strict=True) if k in special]
    )
    user = [
        AddedToken(t, special=False, normalized=False)
        for t, k in zip(data.tokens, types, strict=True)
        if k == USER_DEFINED_TOKEN_TYPE
    ]
    if user:
        tok.add_tokens(user)

    def text_of(token_id: int | None) -> str | None:
        return data.tokens[token_id] if token_id is not None and 0 <= token_id < len(data.tokens) else None

    bos, eos = text_of(data.bos_token_id), text_of(data.eos_token_id)
    version = (
        f"gguf-spm:{len(data.tokens)}:{xxhash.xxh3_64_hexdigest(repr((data.tokens, data.scores, types)).encode())}"
    )
    return ChatTokenizer(
        tok,
        data.chat_template,
        data.bos_token_id,
        data.eos_token_id,
        add_bos_token=data.add_bos_token,
        version=version + f":{int(data.add_bos_token)}{int(data.add_eos_token)}{int(data.add_space_prefix)}",
        template_vars=chat_template_vars({"bos_token": bos, "eos_token": eos}),
        add_eos_token=data.add_eos_token,
        byte_fallback=byte_fallback_ids(tok),
        strips_first_space=data.add_space_prefix,
    )


def build_tokenizer(data: TokenizerData) -> ChatTokenizer:
    check_tokenizer_kind(data.model, data.pre)
    if data.model == "llama":
        return _build_spm(data)
    vocab = {token: index for index, token in enumerate(data.tokens)}
    merges = [tuple(m.split(" ", 1)) for m in data.merges]
    split, ignore_merges = _REGEX_PRES.get(data.pre, (None, False))
    try:
        bpe = models.BPE(
            vocab=vocab,
            merges=merges,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
            ignore_merges=ignore_merges,
        )
    except Exception as e:  # (the library raises a bare Exception, e.g. "Token `x` out of vocabulary")
        raise ValueError(f"the GGUF's tokenizer.ggml.merges do not fit its tokens: {e}") from None
    tok = Tokenizer(bpe)
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if split is not None:  # the regex splits; the byte-level step only maps bytes to its alphabet
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    elif data.pre in _INDIVIDUAL_DIGIT_PRES:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(r"\p{N}"), behavior="isolated"), byte_level]
        )
    else:
        tok.pre_tokenizer = byte_level
    tok.decoder = decoders.ByteLevel()
    types = data.token_types or (0,) * len(data.tokens)
    specials = [
        AddedToken(t, special=True, normalized=False)
        for t, k in zip(data.tokens, types, strict=True)
        if k == CONTROL_TOKEN_TYPE
    ]
    user = [
        AddedToken(t, special=False, normalized=False)
        for t, k in zip(data.tokens, types, strict=True)
        if k == USER_DEFINED_TOKEN_TYPE
    ]
    tok.add_special_tokens(specials)
    if user:
        tok.add_tokens(user)
    version = f"gguf-bpe:{data.pre}:{len(data.tokens)}:{len(data.merges)}"

    def text_of(token_id: int | None) -> str | None:  # (an id past the vocabulary: the name is left undefined)
        return data.tokens[token_id] if token_id is not None and 0 <= token_id < len(data.tokens) else None

    return ChatTokenizer(
        tok,
        data.chat_template,
        data.bos_token_id,
        data.eos_token_id,
        data.add_bos_token,
        version,
        # tokenizer.ggml.bos_token_id / eos_token_id's texts, as llama.cpp gives its templates
        template_vars=chat_template_vars(
            {"bos_token": text_of(data.bos_token_id), "eos_token": text_of(data.eos_token_id)}
        ),
        add_eos_token=data.add_eos_token,
    )


def is_byte_fallback_piece(piece: str | None) -> bool:
    """Whether a piece is a byte-fallback token's spelling, "<0xNN>" (as the ByteFallback decoder reads it)."""
    if piece is None or len(piece) != 6 or not piece.startswith("<0x") or not piece.endswith(">"):
        return False
    return all(c in "0123456789abcdefABCDEF" for c in piece[3:5])


def skipped_ids(tokenizer: Any) -> frozenset[int]:
    """The added tokens a `tokenizers.Tokenizer`'s decode skips (skip_special_tokens): those
    flagged special, and those the library skips all the same: a tokenizer_config.json entry
    "special": false on a token tokenizer.json made special leaves the flag false and the
    token skipped, in its decode as in transformers' ("a <|im_start|> b" decodes as "a  b")."""
    added = tokenizer.get_added_tokens_decoder()
    return frozenset(
        i
        for i, token in added.items()
        if token.special
        or tokenizer.decode([i], skip_special_tokens=True) != tokenizer.decode([i], skip_special_tokens=False)
    )


def byte_fallback_ids(tokenizer: Any) -> dict[int, int] | None:
    """A SentencePiece-style `tokenizers.Tokenizer`'s byte-fallback tokens, id -> byte; None
    for byte-level BPE (its decoder is ByteLevel). Every token spelt "<0xNN>" but a special
    added one (decode skips it): the ByteFallback decoder reads each token's text, added or
    not, so a tokenizer_config.json entry naming a byte piece ({"13": {"content": "<0x0A>"}},
    an added token then) still decodes as its byte ('\n'), in transformers as in tokenizers."""
    if type(tokenizer.decoder).__name__ == "ByteLevel":
        return None
    special = skipped_ids(tokenizer)
    size = tokenizer.get_vocab_size(with_added_tokens=True)
    pieces = ((i, tokenizer.id_to_token(i)) for i in range(size) if i not in special)
    return {i: int(piece[3:5], 16) for i, piece in pieces if is_byte_fallback_piece(piece)}


# bytes no valid UTF-8 text starts with (continuation bytes, 0xC0-0xC1, 0xF5-0xFF): a run they begin
# is invalid whatever follows
_NEVER_FIRST = frozenset([*range(0x80, 0xC2), *range(0xF5, 0x100)])

# the prompt's last tokens of text a SentencePiece-style output is decoded after (decode_context)
PROMPT_CONTEXT_TOKENS = 4


def incomplete_tail(data: bytes) -> int:
    """How many of the last bytes of `data` are an incomplete UTF-8 character (0-3): a lead
    byte still waiting for its continuation bytes, with those it has. Such a tail is 1-3 bytes
    from a lead byte on, so the last 3 bytes tell (a byte before that lead is a whole character
    or an invalid byte)."""
    decoder = codecs.getincrementaldecoder("utf-8")("replace")
    decoder.decode(data[-3:])
    return len(decoder.getstate()[0])


def _valid_before_open(run: bytearray, whole: bool) -> bool:
    """Whether a byte run (its bytes last first) is valid UTF-8 before a character its last
    bytes leave open; `whole` False: its part from its first character start on (a byte no
    continuation: in a valid run one starts a character), so False says the whole run is
    invalid, True nothing yet."""
    data = bytes(run[::-1])
    if not whole:
        data = data[next((k for k, b in enumerate(data) if b & 0xC0 != 0x80), len(data)) :]
    try:
        data[: len(data) - incomplete_tail(data)].decode()
    except UnicodeDecodeError:
        return False
    return True


def ascii_letter_byte(byte_fallback: Mapping[int, int] | None) -> int | None:
    """The byte-fallback token of the lowest ASCII letter ("<0x41>", 'A'; None: none). Put
    before a byte run it keeps the run's validity (one ASCII byte, one character whether the
    run decodes as UTF-8 or as one U+FFFD a byte) and the decoder's first-space strip off
    what follows it: decode_context's context after a prompt ending in a byte token, and the
    engine's stop-string window cut inside a run."""
    letters = [(b, i) for i, b in (byte_fallback or {}).items() if 0x41 <= b <= 0x5A or 0x61 <= b <= 0x7A]
    return min(letters)[1] if letters else None


def decode_context(
    token_ids: Sequence[int],
    num_prompt: int,
    byte_fallback: Mapping[int, int] | None,
    textless: Container[int],
    letter: int | None,
) -> tuple[list[int], int]:
    """(context, num_cut): the tokens a SentencePiece-style decoder's output is decoded after,
    and how many of the first of them have their text cut off (the engine's text, the server's
    and generate's stream alike: decode(context + output) less the text of context[:num_cut]):
    its decoder strips the first space of the text it decodes, so the output decoded alone lost
    the space of its first piece ("\u2581lazy" after "... over the" gave "lazy").

    The prompt's (`token_ids[:num_prompt]`) last PROMPT_CONTEXT_TOKENS tokens of text, all cut
    (`textless`: tokens the decode skips, special ones), as vLLM's detokenizer starts from the
    prompt's last tokens. None for byte-level BPE (`byte_fallback` None: no strip, its output
    decodes alone). Where the prompt's text ends in a byte-fallback token (`byte_fallback`:
    id -> byte), `letter` (ascii_letter_byte), cut: the prompt's tokens would join the output's
    byte run, and the letter keeps the strip off the output's first space as the prompt's whole
    run does ("\n" is <0x0A> in Llama 2's vocabulary: chat prompts end in it); one ASCII byte
    leaves the run valid or not as it was, and is one character either way. Where the run ends
    inside a character (a raw-id prompt cut after the first byte of 'é'), its bytes follow the
    letter, not cut: the character is the output's, as vLLM's detokenizer (tokenizers'
    DecodeStream primed with the prompt) shows it, completed ('é') or not (U+FFFD). Where the
    run holds an invalid byte (before a character it leaves open or not), all its bytes are
    U+FFFD, and so are the output's bytes that join it (transformers' whole decode and
    DecodeStream alike): a byte token no UTF-8 text starts with (<0x80>), cut, in place of
    the letter (one U+FFFD; the letter where the vocabulary has none)."""
    if byte_fallback is None:
        return [], 0
    context: list[int] = []
    i = num_prompt
    while i > 0 and len(context) < PROMPT_CONTEXT_TOKENS:
        i -= 1
        token = token_ids[i]
        if token in textless:
            continue
        if context or token not in byte_fallback:
            context.append(token)
            continue
        if letter is None:
            return [], 0
        # the run's bytes, last first (a skipped token between two bytes: they join), and where
        # each is; then whether it is valid UTF-8 before a character its last 3 bytes leave open
        # (checked at 64, 256, 1024, ... bytes too: an invalid byte ends the walk within 4 times its
        # distance from the end, where a walk of a 120,001-token run took 38 ms)
        run, at = bytearray(), []
        j, check, valid = i, 64, True
        while j >= 0 and (token_ids[j] in byte_fallback or token_ids[j] in textless) and len(run) < 3:
            if token_ids[j] in byte_fallback:
                run.append(byte_fallback[token_ids[j]])
                at.append(j)
            j -= 1
        while j >= 0 and ((token := token_ids[j]) in byte_fallback or token in textless):
            if token in byte_fallback:
                run.append(byte_fallback[token])
                if len(run) == check:
                    check *= 4
                    if not _valid_before_open(run, whole=False):
                        valid = False
                        break
            j -= 1
        open_bytes = incomplete_tail(bytes(run[2::-1]))
        if not (valid and _valid_before_open(run, whole=True)):
            # all the run's bytes are U+FFFD, the output's joining it too: a byte that is
            # never valid UTF-8 keeps it so (itself one U+FFFD, cut)
            bad = next((t for t, b in byte_fallback.items() if b in _NEVER_FIRST), None)
            return [letter if bad is None else bad], 1
        if not open_bytes:
            return [letter], 1
        return [letter, *token_ids[at[open_bytes - 1] : i + 1]], 1
    return context[::-1], len(context)
