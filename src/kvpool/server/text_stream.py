"""One sample's text as a stream shows it, token by token: kvpool serve's deltas and kvpool
generate's printed text (one rule, so the two cannot differ).

The text is the decoded output (EOS excluded) up to what can no longer change: an incomplete
UTF-8 sequence at the end (decoded as U+FFFD) waits for its next byte (an aborted sample's
never comes: its last text leaves the half character out; a U+FFFD the model did write, the
character itself or a byte no UTF-8 character holds, is text and is shown), and the last
`holdback` characters wait while a stop string could still be forming. A sample that
finished on "stop" or "length" shows the engine's final text, all of it: the decode of its
ids, so a character the length limit cut ends it as U+FFFD, as vLLM's and HF's final text do.

Two kinds of decoder, told by the TokenBytes (server/protocol.py decoded_bytes): byte-level BPE
decodes a sequence split at a character boundary as the concatenation of its parts, so only
the tokens after the stable ones are decoded. A SentencePiece-style decoder (Replace "▁" by a
space, ByteFallback, Fuse, Strip the text's first space) does not: "▁world" decoded alone
loses its space, and a run of byte-fallback tokens "<0xNN>" decodes as its UTF-8 text only
when the whole run is valid UTF-8, else as one U+FFFD a byte. Its new tokens are decoded after
a few earlier ones (the context) and the context's own decode is cut off the front; the text
of a trailing byte-fallback run waits until a token that is no byte ends the run (a later
byte could still turn all of it into U+FFFD), or the sample ends; the tokens that go on with
the run are not decoded (nothing of it shows), the run is decoded once it ends, so a token
costs the same however long the run.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from kvpool.models.tokenizer import decode_context, incomplete_tail


@dataclass(frozen=True, slots=True)
class TokenBytes:
    """A token id's bytes as the text's decode joins them (a skipped special token's: none),
    and the decoder's kind: `byte_tokens` None for byte-level BPE, else a SentencePiece-style
    decoder's byte-fallback tokens, id -> byte."""

    of: Callable[[int], bytes]
    byte_tokens: Mapping[int, int] | None = None
    skipped: frozenset[int] = frozenset()  # the special tokens the decode skips (bytes: none)
    # a byte-fallback token of an ASCII letter (models/tokenizer.py ascii_letter_byte)
    letter: int | None = None

    def __call__(self, token_id: int) -> bytes:
        return self.of(token_id)

    def context(self, token_ids: list[int], num_prompt: int) -> tuple[list[int], int]:
        """The prompt tokens a sample's text is decoded after, and how many of them have their
        text cut off (models/tokenizer.py decode_context: none for byte-level BPE)."""
        return decode_context(token_ids, num_prompt, self.byte_tokens, self.skipped, self.letter)


# a SentencePiece-style stream's context is moved up to its newest token once it spans more tokens
_CONTEXT_TOKENS = 8


@dataclass(slots=True)
class TextStream:
    decode: Callable[[list[int]], str]
    # a token id's bytes: they tell half a character (its U+FFFD waits) from a U+FFFD the
    # model wrote; without them every trailing U+FFFD is taken for half a character
    token_bytes: Callable[[int], bytes] | None = None
    holdback: int = 0  # characters held back while a stop string may be forming
    sent_text: str = ""  # what was shown so far
    # Incremental detokenization: the visible (non-EOS) output tokens, and how many of them
    # decode to `stable_text` for good: their text ends on a whole character, and byte-level
    # BPE decodes a sequence split at a character boundary as the concatenation of its parts.
    # Each step then decodes only the tokens after them, not the whole output again.
    visible: list[int] = field(default_factory=list)
    num_stable_tokens: int = 0
    stable_text: str = ""
    # SentencePiece-style: the context's first token and its decode (visible[context_start:
    # num_stable_tokens]); each step decodes visible[context_start:] and cuts context_text off
    context_start: int = 0
    context_text: str = ""
    # SentencePiece-style, while the visible tokens end in a byte-fallback run: the text before
    # the run (None: no run open). The run's text waits whole, so a token that goes on with the
    # run (a byte, or a special one decode skips) needs no decode: it is decoded once, ended
    run_before: str | None = None

    def start_after(self, context: list[int], num_cut: int | None = None) -> TextStream:
        """Decode the output after these prompt tokens (TokenBytes.context), the text of the
        first `num_cut` (None: all) cut off; the rest, a character the prompt leaves open, is
        the output's (its bytes wait in the output's byte run)."""
        if context:
            cut = len(context) if num_cut is None else num_cut
            self.visible = list(context)
            self.num_stable_tokens = cut
            self.context_start, self.context_text = 0, self.decode(self.visible[:cut])
        return self

    def advance(self, new_ids: list[int], reason: str | None, final_text: str = "") -> str:
        """The text that may be shown now beyond `sent_text`, after the visible (non-EOS) token
        ids `new_ids`. `reason`: the sample's finish reason (None while it runs); on "stop" or
        "length", `final_text` is the engine's final text (cut before a stop string), and all
        of it is shown."""
        if reason in ("stop", "length"):
            text = final_text
            limit = len(text)
        elif (byte_tokens := getattr(self.token_bytes, "byte_tokens", None)) is not None:
            self.visible.extend(new_ids)
            if (
                self.run_before is not None
                and reason is None
                and all(t in byte_tokens or not self.token_bytes(t) for t in new_ids)
            ):
                text, held = self.run_before, 0  # the run goes on: its text still waits whole
            else:
                text, held = self._context_text(byte_tokens, reason is not None)
            limit = len(text) - held - (0 if reason is not None else self.holdback)
        else:
            self.visible.extend(new_ids)
            text = self.stable_text + self.decode(self.visible[self.num_stable_tokens :])
            half = text.endswith("\ufffd") and ends_inside_a_character(self.visible, self.token_bytes)
            if not half:
                self.stable_text, self.num_stable_tokens = text, len(self.visible)
            limit = len(text) if reason is not None else len(text) - self.holdback
            if half:
                # an incomplete character: wait for its next byte; an aborted sample (the server
                # stopping) gets none, and its last text does not end in U+FFFD for the half
                limit = min(limit, len(text) - 1)
        if limit <= len(self.sent_text) or not text.startswith(self.sent_text):
            return ""
        new_text = text[len(self.sent_text) : limit]
        self.sent_text += new_text
        return new_text

    def _context_text(self, byte_tokens: frozenset[int], ended: bool) -> tuple[str, int]:
        """A SentencePiece-style decoder's text of the visible tokens, and how many of its last
        characters wait: those of a trailing byte-fallback run (`ended`, an aborted sample:
        none but an incomplete character's bytes)."""
        self.run_before = None
        window = self.decode(self.visible[self.context_start :])
        # the context's text is the window's start, or as many characters of it: an ASCII letter
        # the context ends in (decode_context) is one U+FFFD where the output's bytes turn its run
        # invalid (the stream showed nothing more until the sample's end)
        text = self.stable_text + window[len(self.context_text) :]
        # the trailing byte-fallback run: byte tokens, and the special tokens among them that
        # decode skips (their neighbours join: one run)
        start, run = len(self.visible), False
        while start > self.num_stable_tokens:
            token_id = self.visible[start - 1]
            if token_id in byte_tokens:
                run = True
            elif self.token_bytes(token_id):
                break
            start -= 1
        if not run:
            # stable for good: the next token cannot join a byte run with these ones
            self.stable_text, self.num_stable_tokens = text, len(self.visible)
            last = self.visible[-1] if self.visible else None
            if len(self.visible) - self.context_start > _CONTEXT_TOKENS and last is not None and self.token_bytes(last):
                # a new context: the newest token alone (its decode keeps a character, so the
                # decoder's first-space strip takes the same space off both decodes)
                self.context_start, self.context_text = len(self.visible) - 1, self.decode([last])
            else:
                self.context_text = window
            return text, 0
        data = b"".join(self.token_bytes(t) for t in self.visible[start:])
        held = len(fallback_text(data))
        self.run_before = text[: len(text) - min(held, len(text) - len(self.stable_text))]
        if ended:  # no byte comes: the run's text less an incomplete character's bytes shows
            cut = incomplete_tail(data)
            if not cut:
                return text, 0
            kept = fallback_text(data[:-cut])
            text = text[: max(len(text) - held, len(self.stable_text))] + kept
            return text, 0
        return text, min(held, len(text) - len(self.stable_text))


def fallback_text(data: bytes) -> str:
    """A byte-fallback run's text as the ByteFallback decoder gives it: the UTF-8 text when
    all of it is valid, else one U+FFFD a byte."""
    try:
        return data.decode()
    except UnicodeDecodeError:
        return "\ufffd" * len(data)


def ends_inside_a_character(token_ids: list[int], token_bytes: Callable[[int], bytes] | None) -> bool:
    """Whether the bytes of `token_ids` end inside a UTF-8 character: a lead byte still
    waiting for continuation bytes (True when `token_bytes` is None: it cannot be told)."""
    if token_bytes is None:
        return True
    tail = b""
    for token_id in reversed(token_ids):
        tail = token_bytes(token_id) + tail
        if len(tail) >= 3:
            break
    return incomplete_tail(tail) > 0
