#!/usr/bin/env python
"""The text stream's CPU per token (TextStream.advance, thread CPU time, best of 5):
SmolLM2's byte-level tokenizer over README.md's text with CJK and emoji, a SentencePiece
tokenizer (the tests' Llama-2-style tokenizer.json) over the same text and over runs of byte-fallback tokens ("你"
as <0xE4><0xBD><0xA0>, again and again) of 500 to 4,000 tokens, which show nothing until the
run ends.

PYTHONPATH=src:tests python scripts/text_stream_cost.py"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

from hf_tiny import save_spm_tokenizer
from kvpool.engine.build import load_model
from kvpool.models.hf_tokenizer import load_hf_tokenizer
from kvpool.server.protocol import decoded_bytes
from kvpool.server.text_stream import TextStream


def per_token_us(tok, ids: list[int], holdback: int = 0) -> tuple[float, str]:
    """The best of 5 rounds' thread CPU per token, and the text the last round showed."""
    tb, best, shown = decoded_bytes(tok), [], ""
    for _ in range(5):
        stream = TextStream(tok.decode, tb, holdback=holdback)
        start = time.thread_time_ns()
        shown = "".join(stream.advance([t], None) for t in ids)
        best.append((time.thread_time_ns() - start) / len(ids) / 1e3)
    return min(best), shown


def main() -> None:
    smollm2 = load_model(None).tokenizer
    readme = Path(__file__).parents[1] / "README.md"
    text = readme.read_text()[:60000] + " 日本語のテキスト 🙂🚀 Café crème " * 50
    ids = smollm2.tokenizer.encode(text, add_special_tokens=False).ids
    us, shown = per_token_us(smollm2, ids, holdback=4)
    assert smollm2.decode(ids).startswith(shown)
    print(f"byte-level (SmolLM2), {len(ids):,} tokens: {us:.2f} us a token")
    directory = Path(tempfile.mkdtemp()) / "llama2"
    save_spm_tokenizer(directory)
    spm = load_hf_tokenizer(directory)
    spm_ids = spm.tokenizer.encode(text, add_special_tokens=False).ids
    us, shown = per_token_us(spm, spm_ids, holdback=4)
    assert spm.decode(spm_ids).startswith(shown)
    print(f"SentencePiece (the tests' Llama-2 style), the same text, {len(spm_ids):,} tokens: {us:.2f} us a token")
    ni = [spm.tokenizer.token_to_id(f"<0x{b:02X}>") for b in "你".encode()]
    for n in (500, 1000, 2000, 4000):
        us, shown = per_token_us(spm, ni * (n // 3))
        print(f"SentencePiece byte run of {n // 3 * 3:,} tokens: {us:.2f} us a token, {len(shown)} characters shown")


if __name__ == "__main__":
    main()
