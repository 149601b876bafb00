"""The chat workload in messages: what `kvpool run` serves through the engine (live.py
renders it) and what `kvpool bench serve` sends to a server, so both measure the same
traffic.

Conversation i opens with system prompt i mod 3 (a role and eight rules; with the question
and the chat template about 245 SmolLM2 tokens; each shared by a third of the conversations,
which is what the prefix cache hits) and one of eight short questions, drawn from a seeded
`random.Random`. Turn k >= 1 appends the model's answer and follow-up k-1 (mod 3), so a later turn re-sends its own
history. Long prompts are one user message of a repeated sentence (40 + 5 i copies) ending
in "Summarize this.".
"""

from __future__ import annotations

import random

SYSTEM_TOPICS = (
    "a patient support agent for a company that sells bicycles, spare parts and repair services",
    "a travel planner who knows trains, ferries, museums and local food in European cities",
    "a cooking assistant that adapts recipes to what is in the fridge and to dietary needs",
)
QUESTIONS = (
    "What should I check first?",
    "Can you give me three options?",
    "Explain it simply.",
    "What does it cost?",
    "How long does it take?",
    "What is the most common mistake?",
    "Give me a short plan for tomorrow.",
    "Which one would you pick and why?",
)
FOLLOW_UPS = ("Tell me more about the second point.", "Can you make that shorter?", "Thanks! Anything else?")
_FILLER = "The history of tools is the history of people who wanted to do more with less effort. "

Message = dict[str, str]


def system_prompt(topic: str) -> str:
    rules = " ".join(
        f"Rule {i + 1}: be accurate, be kind and never invent facts about {topic.split(',')[0]}." for i in range(8)
    )
    return f"You are {topic}. Answer briefly and concretely. {rules}"


def first_turns(num_conversations: int, rng: random.Random) -> list[list[Message]]:
    """Each conversation's opening messages: a shared system prompt and a question."""
    systems = [system_prompt(topic) for topic in SYSTEM_TOPICS]
    return [
        [
            {"role": "system", "content": systems[i % len(systems)]},
            {"role": "user", "content": rng.choice(QUESTIONS)},
        ]
        for i in range(num_conversations)
    ]


def next_turn(history: list[Message], answer: str, turn: int) -> list[Message]:
    """The messages of turn `turn` (>= 1): the history, the answer to it, a follow-up."""
    return [*history, {"role": "assistant", "content": answer}, {"role": "user", "content": follow_up(turn)}]


def follow_up(turn: int) -> str:
    return FOLLOW_UPS[(turn - 1) % len(FOLLOW_UPS)]


def long_prompt(i: int) -> list[Message]:
    """Long prompt i: 40 + 5 i copies of the filler sentence, then "Summarize this."."""
    return [{"role": "user", "content": _FILLER * (40 + 5 * i) + "Summarize this."}]


def long_prompts(num_long: int) -> list[list[Message]]:
    return [long_prompt(i) for i in range(num_long)]
