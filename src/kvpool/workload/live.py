"""Live workloads: conversations whose next turn carries the answer the served model really
gave, so only the first turns are known before the run (`kvpool run` serves them through
the engine). sessions.py holds the other kind, known in advance, whose answers are
synthetic token streams (the simulator).

Two renderings of one shape (chat.py's conversations and long prompts):
  live_chat       chat.py's messages through the model's chat template (a tokenizer)
  live_token_ids  the same shape in token ids, for a model without a tokenizer (tiny-dsv4):
                  3 shared 300-token system prompts (over two 128-token classical spans
                  each), 20-token questions, 12-token follow-ups, 700 + 50 i-token long
                  prompts, every id rng.randrange(vocab_size)
Both draw from the caller's seeded `random.Random`, in a fixed order: first turns, then
(token ids only) long prompts, then (`first_requests`) the arrivals of the first turns and
long prompts. A token-id follow-up's 12 ids come from its conversation's own generator,
`follow_up_rng(seed, c)`, not from the shared one: follow-ups are made in the order their
answers finish, which the clock decides, and drawn from the shared stream in that order
(until 2026-12-07) they made a given seed give other prompts from run to run.

Request ids: conversation c's turn k is f"chat{c}-t{k}", long prompt i is f"long{i}".
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

from kvpool.workload import chat
from kvpool.workload.arrivals import poisson_arrivals


def request_id(conversation: int, turn: int) -> str:
    return f"chat{conversation}-t{turn}"


class TimedPrompt(NamedTuple):
    arrival_s: float  # seconds after the start of the run
    request_id: str
    prompt_ids: list[int]


@dataclass
class Conversation:
    """A chat whose turns are prompts of token ids; `history` is what the next turn extends."""

    history: list[chat.Message] | list[int]  # chat messages (live_chat) or token ids (live_token_ids)
    turn: int = 0  # the turn last sent; the caller advances it after each follow-up
    rng: random.Random | None = None  # its follow-ups' own draws (live_token_ids); None: draws none


# (conversation, the answer's token ids, the answer's text) -> the next turn's prompt ids
FollowUp = Callable[[Conversation, list[int], str], list[int]]


@dataclass
class LiveWorkload:
    """First turns and long prompts as token ids; `follow_up` makes a later turn's prompt."""

    first_prompts: list[list[int]]  # conversation c's first turn
    long_prompts: list[list[int]]  # single-turn long prompts
    conversations: list[Conversation]
    follow_up: FollowUp

    def first_requests(self, rate: float, rng: random.Random) -> list[TimedPrompt]:
        """The first turns and the long prompts at Poisson arrivals of `rate` per second (one
        gap drawn per prompt: first turns, then long prompts), sorted by arrival (stable)."""
        num_first = len(self.first_prompts)
        arrivals = poisson_arrivals(num_first + len(self.long_prompts), rate, rng)
        timed = [
            TimedPrompt(t, request_id(c, 0), p)
            for c, (t, p) in enumerate(zip(arrivals[:num_first], self.first_prompts, strict=True))
        ]
        timed += [
            TimedPrompt(t, f"long{i}", p)
            for i, (t, p) in enumerate(zip(arrivals[num_first:], self.long_prompts, strict=True))
        ]
        return sorted(timed, key=lambda item: item.arrival_s)

    def request_ids(self, turns: int) -> list[str]:
        """Every request a run of `turns` turns a conversation may send, in a fixed order:
        conversation by conversation, turn by turn, then the long prompts. A request's place
        here is its number (engine/live.py seeds it by that number, not by when it arrives)."""
        ids = [request_id(c, k) for c in range(len(self.first_prompts)) for k in range(turns)]
        return ids + [f"long{i}" for i in range(len(self.long_prompts))]

    def request_index(self, request_id: str, turns: int) -> int:
        """`request_id`'s place in `request_ids(turns)`, computed without the list (a run of
        a million turns a conversation makes no list of every turn); ValueError for an id
        that is not there."""
        num_first, num_long = len(self.first_prompts), len(self.long_prompts)
        chat_turn = re.fullmatch(r"chat(0|[1-9][0-9]*)-t(0|[1-9][0-9]*)", request_id)
        if chat_turn is not None:
            c, k = int(chat_turn[1]), int(chat_turn[2])
            if c < num_first and k < turns:
                return c * turns + k
        long = re.fullmatch(r"long(0|[1-9][0-9]*)", request_id)
        if long is not None and int(long[1]) < num_long:
            return num_first * turns + int(long[1])
        raise ValueError(f"request id {request_id!r} is not one of this workload's at {turns} turns")


# (prompt length, request id) -> None, or a ValueError naming the request whose prompt
# does not fit the context (engine.py `Engine.check_length`)
CheckLength = Callable[[int, str], None]


def live_chat(
    encode_chat: Callable[[list[chat.Message]], list[int]],
    num_conversations: int,
    num_long: int,
    rng: random.Random,
    *,
    check_length: CheckLength | None = None,
) -> LiveWorkload:
    """chat.py's conversations, rendered by `encode_chat` (the tokenizer's chat template);
    `check_length` meets each long prompt as it is made (`_long_prompts`)."""
    conversations = [Conversation(messages) for messages in chat.first_turns(num_conversations, rng)]

    def follow_up(conv: Conversation, answer_ids: list[int], answer_text: str) -> list[int]:
        conv.history = chat.next_turn(conv.history, answer_text, conv.turn + 1)
        return encode_chat(conv.history)

    return LiveWorkload(
        [encode_chat(c.history) for c in conversations],
        _long_prompts(num_long, lambda i: encode_chat(chat.long_prompt(i)), check_length),
        conversations,
        follow_up,
    )


def _long_prompts(num_long: int, make: Callable[[int], list[int]], check_length: CheckLength | None) -> list[list[int]]:
    """Long prompts 0 .. num_long - 1 (`make(i)`), each longer than the one before, so the
    first that does not fit the context stops the making there (`kvpool run --num-long 1000`
    made all 1,000, 4 minutes and 3.1 GB, to refuse the 58th; 100,000 ran out of memory)."""
    prompts = []
    for i in range(num_long):
        prompt = make(i)
        if check_length is not None:
            check_length(len(prompt), f"long{i}")
        prompts.append(prompt)
    return prompts


def follow_up_rng(seed: int, conversation: int) -> random.Random:
    """Conversation `conversation`'s own generator for its follow-ups' ids under `seed` (a
    string seed: hashed whole by SHA-512, so neighbouring seeds and indices give unrelated
    streams, the same on every platform and run)."""
    return random.Random(f"kvpool live follow-ups {seed} {conversation}")


def live_token_ids(
    vocab_size: int,
    num_conversations: int,
    num_long: int,
    rng: random.Random,
    *,
    seed: int,
    check_length: CheckLength | None = None,
) -> LiveWorkload:
    """The same shape in token ids (the module docstring gives the lengths); `seed` seeds
    each conversation's follow-ups (`follow_up_rng`), `rng` everything else; `check_length`
    meets each long prompt as it is made (`_long_prompts`)."""

    def ids(n: int, draw: random.Random = rng) -> list[int]:
        return [draw.randrange(vocab_size) for _ in range(n)]

    systems = [ids(300) for _ in chat.SYSTEM_TOPICS]
    conversations = [
        Conversation(systems[i % len(systems)] + ids(20), rng=follow_up_rng(seed, i)) for i in range(num_conversations)
    ]
    long_prompts = _long_prompts(num_long, lambda i: ids(700 + 50 * i), check_length)

    def follow_up(conv: Conversation, answer_ids: list[int], answer_text: str) -> list[int]:
        assert conv.rng is not None  # (every conversation made here has its own)
        conv.history = list(conv.history) + answer_ids + ids(12, conv.rng)
        return conv.history

    return LiveWorkload([list(c.history) for c in conversations], long_prompts, conversations, follow_up)
