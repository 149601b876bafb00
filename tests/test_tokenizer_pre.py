"""Llama 3's ('llama-bpe') and Qwen2's ('qwen2') pre-tokenizers, held to two references
built here: the tokenizers library's Split + ByteLevel as their tokenizer.json states them,
and the `regex` module (another regex engine, with \\p{L} / \\p{N}) with this file's own
byte-to-unicode map. Before, such GGUFs were split with GPT-2's regex without a word
(wrong ids), then refused; kvpool now builds their split, and refuses the ones it does not."""

from __future__ import annotations

import unicodedata

import pytest
import regex
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Regex, pre_tokenizers

from kvpool.models.gguf import TokenizerData
from kvpool.models.tokenizer import build_tokenizer, check_tokenizer_kind

# the split regexes as their models' tokenizer.json files spell them (one literal each, not
# the source's composition of them)
PATTERNS = {
    "llama-bpe": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    "qwen2": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
}


def byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> character map: printable bytes stand for themselves, the rest take
    the code points from 256 up, in byte order."""
    kept = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    extra = [b for b in range(256) if b not in kept]
    return {**{b: chr(b) for b in kept}, **{b: chr(256 + i) for i, b in enumerate(extra)}}


BYTES = byte_alphabet()
ALPHABET = [BYTES[b] for b in range(256)]


def tokenizer_for(pre: str, tokens=ALPHABET, merges=()):
    return build_tokenizer(TokenizerData("gpt2", pre, tuple(tokens), tuple(merges), (), None, None, False, None))


def kvpool_pieces(pre: str, text: str) -> list[str]:
    return [piece for piece, _ in tokenizer_for(pre).tokenizer.pre_tokenizer.pre_tokenize_str(text)]


def library_pieces(pre: str, text: str) -> list[str]:
    split = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PATTERNS[pre]), "isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    return [piece for piece, _ in split.pre_tokenize_str(text)]


def regex_module_pieces(pre: str, text: str) -> list[str]:
    return ["".join(BYTES[b] for b in m.encode()) for m in regex.findall(PATTERNS[pre], text)]


def readable(pieces: list[str]) -> list[str]:
    inverse = {c: b for b, c in BYTES.items()}
    return [bytes(inverse[c] for c in piece).decode() for piece in pieces]


HOSTILE = [
    "",
    *("1" * n for n in range(1, 8)),
    *(f"a{'9' * n}b {'0' * n}" for n in range(1, 8)),
    "12,345.678 -9e10 ٠١٢ ١٢٣ ①②③ ²³ 一二三 Ⅻ",
    "I'm you're he's we've they'll she'd it'S I'M YOU'RE WE'VE THEY'LL SHE'D don'T 'sx 'S' ''s",
    "'s 's's ’s l'homme rock'n'roll",
    "中文测试，你好！日本語のテキスト。한국어 텍스트",
    "😀👍🏽 👨‍👩‍👧‍👦 🇫🇷 ❤️ emoji😀word",
    "a\nb\n\nc\r\nd\r\r\n\n e \n\tf",
    "   leading spaces",
    "trailing spaces   ",
    "a  b   c    d\t\te\u00a0f\u3000g\u2028h\u0085i\x0bj\x0ck",
    "\n\n\n",
    " \n \n ",
    "e\u0301 n\u0303o a\u0308\u0308 \u0301\u0301x Z\u0351\u0352\u0353",
    "(hello) [world] {x} <tag> ...!!! ??? --- *** ### $$$ %%% ^^^ &&& |||",
    "hello!!!\n\nworld?! ,,, .x ;y :z",
    "def f(x):\n    return x**2  # comment\n\n\tif x: pass",
    "https://example.com/a?b=c&d=e#frag user@mail.com",
    "Ǆemo ǅemo ǆemo ſ'ſ ﬁ ﬅ K Å",
    "\x00\x01\x7f \ufeffBOM \ue000private",
    "مرحبا بالعالم שלום עולם",
    "नमस्ते दुनिया ภาษาไทย",
]


@pytest.mark.parametrize("pre", sorted(PATTERNS))
@pytest.mark.parametrize("text", HOSTILE)
def test_pieces_are_the_references_on_hostile_texts(pre, text):
    pieces = kvpool_pieces(pre, text)
    assert pieces == library_pieces(pre, text)
    assert pieces == regex_module_pieces(pre, text)
    assert "".join(readable(pieces)) == text  # nothing dropped, nothing added


# (characters unassigned in Python's Unicode tables are left out: each regex engine classes
# code points assigned after its own Unicode version as it will, and the tokenizers
# library's are older than the regex module's)
TEXT = st.text(
    st.one_of(
        st.characters(blacklist_categories=("Cs", "Cn")),
        st.sampled_from(list("0123456789 \n\r\t'sStTdDmMlLrReEvV.,!?([{-_😀中\u0301\u00a0\u3000\x0b")),
    ),
    max_size=40,
)


@pytest.mark.parametrize("pre", sorted(PATTERNS))
@settings(max_examples=300, deadline=None)
@given(text=TEXT)
def test_pieces_are_the_references_on_any_unicode_text(pre, text):
    assert all(unicodedata.category(c) not in ("Cs", "Cn") for c in text)
    pieces = kvpool_pieces(pre, text)
    assert pieces == library_pieces(pre, text)
    assert pieces == regex_module_pieces(pre, text)


@pytest.mark.parametrize(
    ("pre", "text", "expected"),
    [
        ("llama-bpe", "1234567", ["123", "456", "7"]),  # digits in threes
        ("qwen2", "1234567", ["1", "2", "3", "4", "5", "6", "7"]),  # digit by digit
        ("llama-bpe", "(hello", ["(hello"]),  # a letter run takes one symbol before it
        ("qwen2", " (hello", [" (", "hello"]),  # unless a space takes the symbol first
        ("llama-bpe", "I'M HE'LL x's", ["I", "'M", " HE", "'LL", " x", "'s"]),  # contractions in any case
        ("llama-bpe", "a  b", ["a", " ", " b"]),  # the last space goes with the word
        ("llama-bpe", "x\n\n y", ["x", "\n\n", " y"]),
        ("qwen2", "hi!!!\n\nok", ["hi", "!!!\n\n", "ok"]),  # a symbol run takes the newlines after it
        ("llama-bpe", "ab  \n", ["ab", "  \n"]),
    ],
)
def test_the_splits_the_models_are_known_for(pre, text, expected):
    assert readable(kvpool_pieces(pre, text)) == expected


def test_llama3_takes_a_whole_vocabulary_token_before_merging_and_qwen2_does_not():
    """Llama 3's tokenizer (HF's ignore_merges, llama.cpp's for this pre-tokenizer) takes a
    piece that is a token as that token, though no merge makes it; Qwen2 merges."""
    tokens = [*ALPHABET, "ab", "abc"]
    llama3 = tokenizer_for("llama-bpe", tokens, ["a b"])
    qwen2 = tokenizer_for("qwen2", tokens, ["a b"])
    assert llama3.encode("abc") == [tokens.index("abc")]
    assert qwen2.encode("abc") == [tokens.index("ab"), tokens.index("c")]
    assert llama3.encode("abcd") == [tokens.index("ab"), tokens.index("c"), tokens.index("d")]  # not a token: merges


@pytest.mark.parametrize("pre", ["llama-bpe", "qwen2"])
def test_the_implemented_pre_tokenizers_are_accepted_and_versioned_apart(pre):
    data = TokenizerData("gpt2", pre, tuple(ALPHABET), (), (), None, None, False, None)
    check_tokenizer_kind(data.model, data.pre)
    assert pre in tokenizer_for(pre).version  # a cached prefix of another split is never hit


@pytest.mark.parametrize("pre", ["deepseek-llm", "llama3", "stablelm2", "tekken", ""])
def test_a_pre_tokenizer_still_not_implemented_is_refused(pre):
    data = TokenizerData("gpt2", pre, tuple(ALPHABET), (), (), None, None, False, None)
    with pytest.raises(ValueError, match=f"unsupported GGUF pre-tokenizer tokenizer.ggml.pre {pre!r}: kvpool splits"):
        check_tokenizer_kind(data.model, data.pre)
