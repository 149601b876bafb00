"""One sample's text as a stream shows it, token by token: kvpool serve's deltas and kvpool
generate's printed text (one rule, so the two cannot differ).

The text is the decoded output (EOS excluded) up to what can no longer change: an incomplete
UTF-8 sequence at the end (decoded as U+FFFD) waits for its next byte (an aborted sample's
never comes: its last text leaves the half character out; a U+FFFD the model did write, the
character itself or a byte no UTF-8 character holds, is text and is shown), and the last
`holdback` characters wait while a stop string could still be forming. A sample that
finished on "stop" or "length" shows the engine's final text, all of it: the decode of its
ids, so a character the length limit cut ends it as U+FFFD, as vLLM's and HF's final text do.
"""

from __future__ import annotations

import codecs
from collections.abc import Callable
from dataclasses import dataclass, field


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

    def advance(self, new_ids: list[int], reason: str | None, final_text: str = "") -> str:
        """The text that may be shown now beyond `sent_text`, after the visible (non-EOS) token
        ids `new_ids`. `reason`: the sample's finish reason (None while it runs); on "stop" or
        "length", `final_text` is the engine's final text (cut before a stop string), and all
        of it is shown."""
        if reason in ("stop", "length"):
            text = final_text
            limit = len(text)
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


def ends_inside_a_character(token_ids: list[int], token_bytes: Callable[[int], bytes] | None) -> bool:
    """Whether the bytes of `token_ids` end inside a UTF-8 character: a lead byte still
    waiting for continuation bytes (True when `token_bytes` is None: it cannot be told). Such
    a tail is 1-3 bytes from a lead byte on, so the last 3 bytes tell (a byte before that lead
    is a whole character or an invalid byte)."""
    if token_bytes is None:
        return True
    tail = b""
    for token_id in reversed(token_ids):
        tail = token_bytes(token_id) + tail
        if len(tail) >= 3:
            break
    decoder = codecs.getincrementaldecoder("utf-8")("replace")
    decoder.decode(tail[-3:])
    return bool(decoder.getstate()[0])  # the bytes it holds for the character's rest
