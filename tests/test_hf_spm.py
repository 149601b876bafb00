"""SentencePiece-style tokenizer.json (Llama 2, Mistral 7B v0.1-v0.3, TinyLlama): a BPE with
byte fallback, "▁" for a space, the decoder Replace + ByteFallback + Fuse + Strip. Built here
by the tokenizers library (hf_tiny.spm_tokenizer), read by models/hf_tokenizer.py and compared
with transformers' AutoTokenizer (LlamaTokenizer for a "llama" model: it rebuilds the pipeline
from tokenizer_config.json's legacy / add_prefix_space; tokenizer.json as it is otherwise);
its text streams (server/text_stream.py) against the decode of the whole output; a tiny random
Llama directory with it through `kvpool generate` and `kvpool serve`."""

from __future__ import annotations

import dataclasses
import functools
import json
import random
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

from hf_tiny import SPM_CORPUS, save_spm_tokenizer, spm_tokenizer
from kvpool.cli.main import main
from kvpool.models.hf_tokenizer import load_hf_tokenizer
from kvpool.server.protocol import TextOffsets, TokenBound, decoded_bytes, token_text
from kvpool.server.text_stream import TextStream, ends_inside_a_character
from served import served
from test_hf_dir import _hf_greedy

transformers = pytest.importorskip("transformers")

TEXTS = [
    "Hello world",
    " Hello  world ",
    "Hello</s>world <s> again",
    "<s>[INST] Hi [/INST]",
    "a  b\n c\t d\n\n",
    "你好，世界！ 🙂🚀 Café crème ¿qué?",
    "digits 0123456789 3.14159",
    "x\u2581y \u2581\u2581z",
    " ",
    "",
    "\U0001f9ea rare 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 ǅ",
]
MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi there, 你好"},
    {"role": "assistant", "content": "Hello! 🙂"},
    {"role": "user", "content": "Ça va?"},
]


def _reference(path: Path):
    import transformers.utils.logging as hf_logging

    hf_logging.set_verbosity_error()  # (its warnings about the tiny vocabulary)
    return transformers.AutoTokenizer.from_pretrained(path)


@pytest.fixture(scope="module")
def spm_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("spm") / "llama2"
    save_spm_tokenizer(path)
    return path


@pytest.mark.parametrize(
    "model_type, config, reference_class",
    [
        ("llama", {}, "LlamaTokenizer"),  # Llama 2 / TinyLlama: legacy false, add_bos_token
        ("llama", {"legacy": True}, "LlamaTokenizer"),  # "▁" before every piece between special tokens
        ("llama", {"legacy": None}, "LlamaTokenizer"),  # (LlamaTokenizer's default: false)
        ("llama", {"add_prefix_space": False}, "LlamaTokenizer"),  # no "▁" prepended, none stripped
        # add_bos_token / add_eos_token are not read (transformers 5): tokenizer.json's post-processor adds <s>
        ("llama", {"tokenizer_class": "LlamaTokenizerFast", "add_eos_token": True}, "LlamaTokenizer"),
        ("llama", {"add_bos_token": False}, "LlamaTokenizer"),
        ("llama", {"tokenizer_class": None}, "TokenizersBackend"),  # tokenizer.json as it is
        ("llama", {"tokenizer_class": "PreTrainedTokenizerFast", "legacy": True}, "TokenizersBackend"),
        ("mistral", {"legacy": True}, "TokenizersBackend"),  # Mistral 7B: tokenizer.json as it is
        ("mistral", {"add_bos_token": False}, "TokenizersBackend"),
    ],
)
def test_the_directory_tokenizer_equals_transformers_autotokenizer(tmp_path, model_type, config, reference_class):
    path = tmp_path / "tok"
    save_spm_tokenizer(path, model_type, **config)
    ours, ref = load_hf_tokenizer(path), _reference(path)
    assert type(ref).__name__ == reference_class
    for text in TEXTS + SPM_CORPUS[:4]:
        ids = ref(text).input_ids
        assert ours.encode(text) == ids, text
        assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=True), text
        assert ours.decode(ids, skip_special_tokens=False) == ref.decode(ids), text
    for messages in (MESSAGES, MESSAGES[1:2]):
        text = ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert ours.render_chat(messages) == text
        assert ours.encode_chat(messages) == ref.apply_chat_template(messages, add_generation_prompt=True)["input_ids"]
    assert (ours.bos_token_id, ours.eos_token_id) == (ref.bos_token_id, ref.eos_token_id)


def test_the_text_after_a_special_token_takes_no_space_unless_legacy(tmp_path):
    """The premise of the legacy flag, as transformers' LlamaTokenizer has it: "▁" is prepended
    to the text's start only (legacy false), or to every piece between special tokens."""
    ids = {}
    for legacy in (False, True):
        save_spm_tokenizer(tmp_path / str(legacy), legacy=legacy)
        tok = load_hf_tokenizer(tmp_path / str(legacy))
        ids[legacy] = tok.tokenizer.encode("</s>The", add_special_tokens=False).tokens
    assert ids[False] == ["</s>", "The"] and ids[True] == ["</s>", "\u2581The"], ids


def test_token_bytes_are_each_tokens_utf8_bytes(spm_dir):
    """decoded_bytes / TokenText: a byte-fallback token's byte, a piece's text with "▁" a space,
    a special token's none (decode skips it) or its spelling (logprobs); checked against the
    decoder: a token's text after a context token is the difference of the two decodes."""
    tok = load_hf_tokenizer(spm_dir)
    tb, tt = decoded_bytes(tok), token_text(tok)
    size = tok.tokenizer.get_vocab_size()
    assert tb.byte_tokens == {3 + b: b for b in range(256)} and tt.byte_tokens == tb.byte_tokens.keys()
    a = tok.tokenizer.token_to_id("a")
    for t in range(size):
        piece = tok.tokenizer.id_to_token(t)
        if t in (0, 1, 2):
            assert tb(t) == b"" and bytes(tt.bytes(t)) == piece.encode()
        elif t in tb.byte_tokens:
            assert tb(t) == bytes([t - 3]) and tt.text(t) == bytes([t - 3]).decode(errors="replace")
        else:
            context = tok.decode([a])
            assert tb(t).decode() == tok.decode([a, t])[len(context) :], piece
    assert tb(tok.tokenizer.token_to_id("\u2581the")) == b" the"
    # random runs join to the decode (a run of byte tokens: its UTF-8 text or a U+FFFD a byte)
    rng = random.Random(0)
    for _ in range(2000):
        ids = [rng.randrange(size) for _ in range(rng.randint(1, 6))]
        data = b"".join(map(tb, ids))
        text = tok.decode(ids)
        if all(t not in tb.byte_tokens for t in ids):
            assert text == data.decode().removeprefix(" "), ids


def test_no_token_spans_more_bytes_than_the_bound_the_server_refuses_by(spm_dir):
    tok = load_hf_tokenizer(spm_dir)
    tt = token_text(tok)
    bound = TokenBound(tt, tok.tokenizer.get_vocab_size())
    assert bound.untokenized == b""  # (byte fallback: every byte has a token)
    pieces = st.sampled_from(["word ", " ", "    ", "\u2581\u2581\u2581", "1234", "日本語", "é", "</s>", "🙂", "\n"])
    texts = st.lists(st.one_of(pieces, st.text(max_size=20)), max_size=60).map("".join)

    @settings(max_examples=200, deadline=None)
    @given(texts)
    def check(text: str) -> None:
        try:
            num_bytes = bound.num_bytes(text)
        except UnicodeEncodeError:
            return
        assert len(tok.encode(text)) >= bound.least_tokens(num_bytes)

    check()


def _stream_pieces(tok, token_bytes, ids: list[int], cuts: list[int], end: str) -> tuple[list[str], list[str]]:
    """The texts a stream shows as `ids` arrive in chunks cut at `cuts`, ending with `end` (a
    finish reason: "length" shows the final text, the decode of all ids); and, after each
    chunk, the text shown so far."""
    stream = TextStream(tok.decode, token_bytes)
    shown, so_far = [], []
    bounds = sorted(set(c for c in cuts if 0 < c < len(ids))) + [len(ids)]
    start = 0
    for i, stop in enumerate(bounds):
        last = i == len(bounds) - 1
        reason = end if last else None
        shown.append(stream.advance(ids[start:stop], reason, tok.decode(ids) if reason == "length" else ""))
        so_far.append(stream.sent_text)
        start = stop
    return shown, so_far


def _id_lists(size: int, byte_ids: list[int], special_ids: list[int]):
    ordinary = st.integers(0, size - 1)
    return st.lists(st.one_of(ordinary, ordinary, st.sampled_from(byte_ids), st.sampled_from(special_ids)), max_size=40)


def test_every_streaming_joins_to_the_decode_and_never_shows_what_a_later_token_changes(spm_dir):
    """Random id sequences (byte-fallback tokens, the lead bytes of 2-4-byte characters and
    their continuation bytes, special tokens among them) in random chunks: the shown pieces
    join to the decode of all ids on "length"; what was shown after any chunk is a prefix of
    the final decode (no later token changes it), and equals the decode so far whenever the
    last token that decode does not skip is no byte token (nothing waits then); an aborted
    stream shows all of it unless it ends inside a character."""
    tok = load_hf_tokenizer(spm_dir)
    tb = decoded_bytes(tok)
    size = tok.tokenizer.get_vocab_size()
    byte_ids = [3 + b for b in [0x41, 0x20, 0xC3, 0xA9, 0xE4, 0xBD, 0xA0, 0xF0, 0x9F, 0x99, 0x82, 0xFF, 0x80]]

    @settings(max_examples=300, deadline=None)
    @given(_id_lists(size, byte_ids, [0, 1, 2]), st.lists(st.integers(0, 40), max_size=12))
    def check(ids: list[int], cuts: list[int]) -> None:
        full = tok.decode(ids)
        shown, so_far = _stream_pieces(tok, tb, ids, cuts, "length")
        assert "".join(shown) == full
        bounds = sorted(set(c for c in cuts if 0 < c < len(ids))) + [len(ids)]
        for stop, text in zip(bounds[:-1], so_far[:-1], strict=True):
            assert full.startswith(text), (ids, stop, text)
            kept = [t for t in ids[:stop] if t not in (0, 1, 2)]  # (decode skips the special tokens)
            if not kept or kept[-1] not in tb.byte_tokens:
                assert text == tok.decode(ids[:stop]), (ids, stop)
        # one token a step (as decode steps give them), each step's text checked the same way
        shown, so_far = _stream_pieces(tok, tb, ids, list(range(1, len(ids))), "length")
        assert "".join(shown) == full
        for stop, text in zip(range(1, len(ids)), so_far[:-1], strict=True):
            assert full.startswith(text), (ids, stop, text)
            kept = [t for t in ids[:stop] if t not in (0, 1, 2)]
            if not kept or kept[-1] not in tb.byte_tokens:
                assert text == tok.decode(ids[:stop]), (ids, stop)
        # an abort after every prefix: what shows is a prefix of every continuation's decode
        # up to the half character left out
        aborted = "".join(_stream_pieces(tok, tb, ids, cuts, "abort")[0])
        cut = _half_tail(b"".join(map(tb, ids)), ids, tb.byte_tokens)
        assert full.startswith(aborted) or cut, (ids, aborted)
        if not cut:
            assert aborted == full

    check()


def _half_tail(data: bytes, ids: list[int], byte_tokens) -> bool:
    """Whether `ids` (decode skips the special tokens 0-2) end in a byte-fallback run whose
    bytes end inside a character."""
    import codecs

    ids = [t for t in ids if t not in (0, 1, 2)]
    if not ids or ids[-1] not in byte_tokens:
        return False
    decoder = codecs.getincrementaldecoder("utf-8")("replace")
    decoder.decode(data[-3:])
    return bool(decoder.getstate()[0])


def test_a_character_in_byte_fallback_tokens_shows_whole_and_once(spm_dir):
    """ "你" (E4 BD A0) in three byte tokens after "▁Hello": nothing of it shows until the
    token after it ends the run (a byte that follows could still turn the run into U+FFFDs);
    "▁world" after it keeps its space."""
    tok = load_hf_tokenizer(spm_dir)
    tb = decoded_bytes(tok)
    hello, world = (tok.tokenizer.token_to_id(p) for p in ("\u2581The", "\u2581the"))
    stream = TextStream(tok.decode, tb)
    steps = [[hello], [3 + 0xE4], [3 + 0xBD], [3 + 0xA0], [world]]
    assert [stream.advance(s, None) for s in steps] == ["The", "", "", "", "你 the"]
    # an invalid byte after a whole character turns the run into U+FFFDs: nothing was shown of it
    stream = TextStream(tok.decode, tb)
    steps = [[hello], [3 + 0xC3, 3 + 0xA9], [3 + 0xFF], [world]]
    assert [stream.advance(s, None) for s in steps] == ["The", "", "", "\ufffd\ufffd\ufffd the"]
    assert tok.decode([hello, 3 + 0xC3, 3 + 0xA9, 3 + 0xFF, world]) == "The\ufffd\ufffd\ufffd the"
    # an aborted sample shows a whole run, and a cut one less its half character
    stream = TextStream(tok.decode, tb)
    assert stream.advance([hello, 3 + 0xC3, 3 + 0xA9], None) == "The"
    assert stream.advance([3 + 0xE4, 3 + 0xBD], "abort") == "é"
    stream = TextStream(tok.decode, tb)
    assert stream.advance([hello, 3 + 0xC3, 3 + 0xA9], "abort") == "Theé"


def test_a_long_byte_fallback_run_streams_at_a_bounded_cost_a_token(spm_dir):
    """review15 #3: while the output ended in a byte-fallback run, each token decoded the whole
    run again (1,000 tokens of "你" as bytes: ~500,000 tokens decoded). Now a token that goes on
    with the run decodes nothing, the run is decoded once when a piece ends it, and the text
    shown is the same: nothing of the run before it ends, then all of it."""
    tok = load_hf_tokenizer(spm_dir)
    tb = decoded_bytes(tok)
    decoded: list[int] = []
    stream = TextStream(lambda ids: decoded.append(len(ids)) or tok.decode(ids), tb, holdback=2)
    hello, the = (tok.tokenizer.token_to_id(p) for p in ("\u2581Hello", "\u2581the"))
    ids = [hello] + [3 + b for b in "你".encode()] * 333 + [1] + [3 + b for b in "é".encode()] + [the, the]
    shown = [stream.advance([t], None) for t in ids]
    assert "".join(shown[: 1 + 999 + 3]) == "Hel"  # (holdback 2) nothing of the run while it is open
    assert "".join(shown) == tok.decode(ids)[:-2]
    assert len(decoded) <= 3 + 2 and sum(decoded) <= 2 * len(ids)
    assert "".join(shown) + stream.advance([], "length", tok.decode(ids)) == tok.decode(ids)


def test_a_context_that_decodes_to_nothing_does_not_take_the_next_space(spm_dir):
    """The context moves up to the newest token only where that token is text: a special
    token (decode skips it) as the context would let the decoder strip the next token's space."""
    tok = load_hf_tokenizer(spm_dir)
    tb = decoded_bytes(tok)
    the, fox = (tok.tokenizer.token_to_id(p) for p in ("\u2581The", "\u2581fox"))
    for ids in ([the] * 8 + [0, fox, 0, 0, fox], [the] * 7 + [0, 0, fox] + [0] * 9 + [fox]):
        stream = TextStream(tok.decode, tb)
        text = "The" + " The" * (ids.count(the) - 1) + " fox fox"
        assert "".join(stream.advance([t], None) for t in ids) == tok.decode(ids) == text


def test_a_stop_string_holdback_waits_on_the_same_text(spm_dir):
    tok = load_hf_tokenizer(spm_dir)
    tb = decoded_bytes(tok)
    ids = tok.tokenizer.encode("Hello world, hello again!", add_special_tokens=False).ids
    stream = TextStream(tok.decode, tb, holdback=3)
    shown = [stream.advance([t], None) for t in ids]
    assert "".join(shown) == "Hello world, hello agai"[: len("".join(shown))]
    assert "".join(shown) == tok.decode(ids)[:-3]


def test_the_byte_level_stream_is_unchanged(tmp_path):
    """A byte-level tokenizer's stream takes the old path (only the tokens after the stable
    ones decoded): its TokenBytes has no byte tokens."""
    from hf_tiny import save_tokenizer

    save_tokenizer(tmp_path / "bl")
    tok = load_hf_tokenizer(tmp_path / "bl")
    tb = decoded_bytes(tok)
    assert tb.byte_tokens is None and token_text(tok).byte_tokens is None
    calls = []
    stream = TextStream(lambda ids: calls.append(list(ids)) or tok.decode(ids), tb)
    ids = tok.tokenizer.encode("Hello world again", add_special_tokens=False).ids
    assert "".join(stream.advance([t], None) for t in ids) == "Hello world again"
    assert calls == [[t] for t in ids]


@pytest.mark.parametrize(
    "edit, match",
    [
        (
            lambda s: s.update(decoder={"type": "WordPiece", "prefix": "##", "cleanup": True}),
            "its decoder is WordPiece;",
        ),
        (
            lambda s: s.update(decoder={"type": "Metaspace", "replacement": "\u2581", "prepend_scheme": "always"}),
            "its decoder is Metaspace;",
        ),
        (
            lambda s: s["decoder"]["decoders"].append(
                {"type": "CTC", "pad_token": "<pad>", "word_delimiter_token": "|", "cleanup": True}
            ),
            r"its decoder is Sequence\[Replace, ByteFallback, Fuse, Strip, CTC\];",
        ),
        (lambda s: s.update(decoder=None), "its decoder is none;"),
        (lambda s: s["model"].update(byte_fallback=False), "a BPE model without byte_fallback"),
        (lambda s: s.update(normalizer={"type": "NFKC"}), "its normalizer is NFKC;"),
        (
            lambda s: s.update(pre_tokenizer={"type": "Whitespace"}),
            "its pre-tokenizer is Whitespace; a SentencePiece-style",
        ),
    ],
)
def test_a_tokenizer_of_another_kind_is_refused_in_one_line_naming_it(tmp_path, capsys, edit, match):
    path = tmp_path / "m"
    save_spm_tokenizer(path, model_type="mistral")
    spec = json.loads((path / "tokenizer.json").read_text())
    edit(spec)
    (path / "tokenizer.json").write_text(json.dumps(spec))
    with pytest.raises(ValueError, match=match):
        load_hf_tokenizer(path)
    _llama_weights(path)
    capsys.readouterr()
    assert main(["generate", "hi", "--model", str(path), "--max-tokens", "2"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert "tokenizer.json: its " in err or "tokenizer.json: a SentencePiece-style" in err, err


def _llama_weights(path: Path, seed: int = 3) -> None:
    """A tiny random LlamaForCausalLM in `path` (config.json replaced), its vocabulary the
    SentencePiece-style tokenizer's."""
    from random_llama import TINY_HF_LLAMA

    sizes = {"vocab_size": spm_tokenizer().get_vocab_size(), "max_position_embeddings": 2048}
    config = transformers.LlamaConfig(**{**TINY_HF_LLAMA, **sizes, "bos_token_id": 1, "eos_token_id": 2})
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():  # (transformers' init draws small weights: spread the logits apart)
        model.lm_head.weight.mul_(40)
        # byte-fallback tokens but those of "你" (E4 BD A0), "é" (C3 A9) and "🙂" (F0 9F 99 82)
        # never win (logit 0): random weights otherwise write mostly bytes no character holds
        kept = [3 + b for b in (0xE4, 0xBD, 0xA0, 0xC3, 0xA9, 0xF0, 0x9F, 0x99, 0x82)]
        model.lm_head.weight[[t for t in range(3, 259) if t not in kept]] = 0
    model.save_pretrained(path)


def _spm_llama_dir(path: Path) -> Path:
    _llama_weights(path)
    save_spm_tokenizer(path)
    return path


def test_generate_streams_the_decode_of_its_tokens(tmp_path, capsys):
    """`kvpool generate` on a tiny random Llama with the SentencePiece-style tokenizer: the
    streamed stdout is the decode of the tokens --json reports (spaces kept: the last
    session's 'Helloworld'), and the prompt is transformers' chat ids."""
    path = _spm_llama_dir(tmp_path / "llama2")
    ref = _reference(path)
    for n, chat in ((40, True), (40, False)):
        base = ["generate", "Hello world, 你好", "--model", str(path), "--max-tokens", str(n)]
        base += [] if chat else ["--no-chat"]
        capsys.readouterr()
        assert main([*base, "--json"]) == 0
        report = json.loads(capsys.readouterr().out)
        assert len(report["token_ids"]) >= 10, report["token_ids"]
        prompt = (
            ref.apply_chat_template([{"role": "user", "content": "Hello world, 你好"}], add_generation_prompt=True)[
                "input_ids"
            ]
            if chat
            else ref("Hello world, 你好").input_ids
        )
        assert report["prompt_tokens"] == len(prompt)
        text = ref.decode(report["token_ids"], skip_special_tokens=True)
        assert report["text"] == text
        assert main(base) == 0
        out = capsys.readouterr().out
        assert out == text + "\n" or out == text, (out, text)
        assert " " in text  # (the premise: spaces to lose)


def test_serve_streams_deltas_that_join_to_the_text_and_transformers_decode(tmp_path):
    openai = pytest.importorskip("openai")
    path = _spm_llama_dir(tmp_path / "llama2")
    ref = _reference(path)
    with served("--model", str(path), "--kv-memory", "4MiB") as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", timeout=60)
        messages = [{"role": "user", "content": "Hello world, 你好"}]
        options = {"model": "llama2", "max_tokens": 40, "temperature": 0, "extra_body": {"ignore_eos": True}}
        whole = client.chat.completions.create(messages=messages, logprobs=True, **options)
        assert whole.usage.completion_tokens == 40
        chunks = client.chat.completions.create(messages=messages, stream=True, **options)
        deltas = [c.choices[0].delta.content or "" for c in chunks if c.choices]
        text = whole.choices[0].message.content
        assert "".join(deltas) == text and " " in text
        # transformers' greedy tokens (fp32, margins no CPU's rounding can cross), decoded by it
        prompt = ref.apply_chat_template(messages, add_generation_prompt=True)["input_ids"]
        ids, gap = _hf_greedy(path, torch.float32, prompt, 40)
        assert gap > 1e-3, gap
        assert text == ref.decode(ids, skip_special_tokens=True)
        # logprobs' bytes: each token's own UTF-8 bytes (a byte-fallback token's byte, " " for "▁")
        tt = token_text(load_hf_tokenizer(path))
        assert [bytes(e.bytes) for e in whole.choices[0].logprobs.content] == [bytes(tt.bytes(t)) for t in ids]
        completion = client.completions.create(prompt="Hello world", **options)
        ids = ref("Hello world").input_ids
        assert completion.usage.prompt_tokens == len(ids)
        streamed = client.completions.create(prompt="Hello world", stream=True, **options)
        assert "".join(c.choices[0].text for c in streamed if c.choices) == completion.choices[0].text
        # text_offset indexes the text; the text is decoded after the prompt's last tokens, so it
        # keeps the space of its first piece (decoded alone, the decoder's strip took it)
        scored = client.completions.create(prompt="Hello world", logprobs=1, **options)
        text, lp = scored.choices[0].text, scored.choices[0].logprobs
        assert text == completion.choices[0].text and lp.text_offset[0] == 0
        assert lp.tokens[0].startswith(" ") and text.startswith(" ")
        pieces = [(o, t) for o, t in zip(lp.text_offset, lp.tokens, strict=True) if "\ufffd" not in t]
        assert all(text[o:].startswith(t) for o, t in pieces) and len(pieces) > 10, (text, lp)
        chunks = client.completions.create(prompt="Hello world", logprobs=1, stream=True, **options)
        assert [
            o for c in chunks if c.choices and c.choices[0].logprobs for o in c.choices[0].logprobs.text_offset
        ] == (lp.text_offset)


def test_a_legacy_flag_that_is_no_boolean_is_refused_naming_the_file(tmp_path):
    save_spm_tokenizer(tmp_path / "t", legacy="yes")
    with pytest.raises(ValueError, match=r"t/tokenizer_config\.json: legacy is 'yes', not true or false"):
        load_hf_tokenizer(tmp_path / "t")


def _check_text_offsets(tokenizer, ids: list[int]) -> int:  # (a ChatTokenizer)
    """TextOffsets on `ids` against the tokenizer's own decode: the offsets never fall and stay
    in the text; where the decode of the tokens before one is a prefix of the text (it ends on
    a whole character), the offset is its length; a piece that is whole UTF-8 text (no special
    token, no byte-fallback token) is found at its offset, its first space stripped where the
    decoder strips the text's. Returns how many offsets the prefix rule checked (not those
    after half a character: a text that ends there ends on its U+FFFD)."""
    tt, tb = token_text(tokenizer), decoded_bytes(tokenizer)
    text = tokenizer.decode(ids, skip_special_tokens=True)
    offsets = TextOffsets(tt)
    got = [offsets.add(t) for t in ids]
    assert got == sorted(got) and all(0 <= o <= len(text) for o in got), (ids, got, text)
    checked = 0
    for i, (token_id, offset) in enumerate(zip(ids, got, strict=True)):
        prefix = tokenizer.decode(ids[:i], skip_special_tokens=True)
        if text.startswith(prefix) and not ends_inside_a_character(ids[:i], tb):
            assert offset == len(prefix), (ids, i, got, text)
            checked += 1
        data = bytes(tt.bytes(token_id))
        if token_id in tt.skipped or (tt.byte_tokens and token_id in tt.byte_tokens):
            continue
        try:
            shown = data.decode()
        except UnicodeDecodeError:
            continue
        # the decoder strips the text's first space: this token's where no byte comes before it
        # (a byte token's space, <0x20>, decoding to '' alone, is the one stripped)
        before = any(tt.bytes(t) for t in ids[:i] if t not in tt.skipped)
        stripped = offset == 0 and tt.strips_first_space and shown.startswith(" ") and not before
        assert text[offset:].startswith(shown[1:] if stripped else shown), (ids, i, got, text)
    return checked


def test_completion_text_offsets_index_the_text(spm_dir):
    """/v1/completions' text_offset (protocol.TextOffsets): the SentencePiece decoder strips the
    text's first space, so " Hello" first shows "Hello" and every offset after it was one past
    the text (offsets added len(token text)). Random id sequences (pieces, byte-fallback runs of
    whole and half characters and invalid bytes, special tokens) against the decoder."""
    tok = load_hf_tokenizer(spm_dir)
    tt = token_text(tok)
    assert tt.strips_first_space and tt.skipped == frozenset({0, 1, 2})
    hello = tok.tokenizer.encode("Hello world", add_special_tokens=False).ids
    assert tt.text(hello[0]).startswith(" ") and tok.decode(hello) == "Hello world"
    offsets = TextOffsets(tt)
    assert [offsets.add(t) for t in hello] == [len(tok.decode(hello[:i])) for i in range(len(hello))]
    size = tok.tokenizer.get_vocab_size()
    byte_ids = [3 + b for b in [0x41, 0x20, 0xC3, 0xA9, 0xE4, 0xBD, 0xA0, 0xF0, 0x9F, 0x99, 0x82, 0xFF, 0x80]]
    checked = []

    @settings(max_examples=300, deadline=None)
    @given(_id_lists(size, byte_ids, [0, 1, 2]))
    def check(ids: list[int]) -> None:
        checked.append(_check_text_offsets(tok, ids))

    check()
    assert sum(checked) > 1000, sum(checked)
    # a tokenizer without the Strip decoder (add_prefix_space false): the first space stays
    save_spm_tokenizer(spm_dir.parent / "nostrip", add_prefix_space=False)
    plain = load_hf_tokenizer(spm_dir.parent / "nostrip")
    assert not token_text(plain).strips_first_space
    _check_text_offsets(plain, hello)


def test_byte_level_completion_text_offsets_index_the_text():
    """SmolLM2 (byte-level BPE: no space stripped): the offsets are the lengths of the text
    before each token, a character split over tokens starting where the character does."""
    from kvpool.engine.build import load_model

    chat = load_model(None).tokenizer
    tokenizer = chat.tokenizer
    tt = token_text(chat)
    assert tt.byte_tokens is None and not tt.strips_first_space
    ids = tokenizer.encode(" Hello world, 你好 🙂🚀 Café", add_special_tokens=False).ids
    text = tokenizer.decode(ids)
    offsets = TextOffsets(tt)
    got = [offsets.add(t) for t in ids]
    assert got[:3] == [0, len(" Hello"), len(" Hello world")] and text.startswith(" Hello")
    assert _check_text_offsets(chat, ids) >= len(ids) - 4  # (the tokens inside a split character)
    size = tokenizer.get_vocab_size()
    specials = sorted(tt.skipped)

    @settings(max_examples=100, deadline=None)
    @given(_id_lists(size, list(range(size)), specials))
    def check(ids: list[int]) -> None:
        _check_text_offsets(chat, ids)

    check()


@pytest.mark.parametrize("kind", ["byte-level", "sentencepiece"])
@pytest.mark.parametrize(
    "flags",
    [
        {"lstrip": True},
        {"rstrip": True},
        {"lstrip": True, "rstrip": True},
        {"single_word": True},
        {"normalized": True},
        {"special": False},
        {},
    ],
)
def test_added_token_flags_of_the_tokenizer_config_are_transformers(tmp_path, kind, flags):
    """transformers 5.25 takes an added token's lstrip / rstrip / single_word / normalized /
    special from tokenizer_config.json's added_tokens_decoder, not tokenizer.json's (all false
    there but special): with lstrip true there "a <|im_start|>" lost its space in transformers'
    ids, not in kvpool's. Ids and decode (special tokens skipped) equal AutoTokenizer's."""
    from hf_tiny import save_tokenizer

    path = tmp_path / "t"
    (save_tokenizer if kind == "byte-level" else save_spm_tokenizer)(path)
    spec = json.loads((path / "tokenizer.json").read_text())
    config = json.loads((path / "tokenizer_config.json").read_text())
    keys = ("content", "lstrip", "rstrip", "normalized", "single_word", "special")
    config["added_tokens_decoder"] = {str(a["id"]): {**{k: a[k] for k in keys}, **flags} for a in spec["added_tokens"]}
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    ref, tok = _reference(path), load_hf_tokenizer(path)
    texts = [*TEXTS, "a <|im_start|> b", "x  <|im_start|>\n\ny", "a<|im_end|> b", "hi</s> there <unk> z", "<s> hi <s>x"]
    for text in texts:
        ids = tok.tokenizer.encode(text, add_special_tokens=False).ids
        assert ids == ref(text, add_special_tokens=False).input_ids, text
        assert tok.decode(ids) == ref.decode(ids, skip_special_tokens=True), text
    if flags.get("lstrip"):  # (the premise: the flag changes the ids)
        assert (
            tok.tokenizer.encode("a <s>", add_special_tokens=False).ids
            == ref("a<s>", add_special_tokens=False).input_ids
        )


@pytest.mark.parametrize("kind", ["byte-level", "sentencepiece"])
def test_an_added_token_tokenizer_json_lacks_is_added_as_transformers_adds_it(tmp_path, kind):
    """tokenizer_config.json's added_tokens_decoder entry of a text tokenizer.json lacks was
    left out ("<extra_a>" encoded as its characters' pieces); transformers 5.25 adds it at the
    next id, whatever id the entry names, entry by entry in the order of their ids, and makes
    an entry of a piece of the vocabulary an added token at the piece's id (a special one:
    decode skips it). Vocabulary size, ids of every entry's text, ids and decode of texts
    holding them: AutoTokenizer's."""
    from hf_tiny import save_tokenizer

    path = tmp_path / "t"
    (save_tokenizer if kind == "byte-level" else save_spm_tokenizer)(path)
    spec = Tokenizer.from_file(str(path / "tokenizer.json"))
    size, added = spec.get_vocab_size(with_added_tokens=True), spec.get_added_tokens_decoder()
    piece = next(spec.id_to_token(i) for i in range(size - 1, 0, -1) if i not in added and len(spec.id_to_token(i)) > 2)
    config = json.loads((path / "tokenizer_config.json").read_text())
    config["added_tokens_decoder"] = {  # (not in the order of their ids)
        str(size + 7): {"content": "<extra_b>", "special": False},
        str(size): {"content": "<extra_a>", "special": True, "lstrip": True},
        "0": {"content": "<other0>", "special": True},  # an added token's id, another text
        str(size + 1): {"content": piece, "special": True},  # a piece of the vocabulary, at another id
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    ref, tok = _reference(path), load_hf_tokenizer(path)
    assert tok.tokenizer.get_vocab_size(with_added_tokens=True) == len(ref) == size + 3
    for text in ("<extra_a>", "<extra_b>", "<other0>", piece):
        assert tok.tokenizer.token_to_id(text) == ref.convert_tokens_to_ids(text), text
    assert ref.convert_tokens_to_ids("<other0>") == size and ref.convert_tokens_to_ids("<extra_b>") == size + 2
    assert ref.convert_tokens_to_ids(piece) < size  # (the piece keeps its id)
    for text in [*TEXTS, f"hi <extra_a> there <extra_b>! x<other0>y <extra_a><extra_b>{piece}", piece]:
        ids = tok.encode(text)
        assert ids == ref(text).input_ids, text
        assert tok.decode(ids) == ref.decode(ids, skip_special_tokens=True), text
    assert size in tok.encode("a <other0> b")  # (the premise: the new token is one id)


@pytest.mark.parametrize("special", [False, None, True])
def test_an_added_tokens_decoder_entry_of_a_byte_piece_keeps_it_a_byte(tmp_path, special):
    """An added_tokens_decoder entry naming a byte piece at its id ({"13": {"content":
    "<0x0A>"}}) makes it an added token, in transformers as here, and the ByteFallback decoder
    still reads it as its byte: AutoTokenizer decodes id 13 as '\n'. It was left out of the byte
    map, so its logprobs token read '<0x0A>' and the text offsets ran past the text (19 in 11
    characters). A special one is skipped, as transformers skips it: no byte."""
    path = tmp_path / "t"
    save_spm_tokenizer(path)
    plain = load_hf_tokenizer(path).byte_fallback
    newline = next(i for i, b in plain.items() if b == 0x0A)
    entry = {"content": f"<0x{0x0A:02X}>", **({} if special is None else {"special": special})}
    save_spm_tokenizer(path, added_tokens_decoder={str(newline): entry})
    ref, tok = _reference(path), load_hf_tokenizer(path)
    assert newline in tok.tokenizer.get_added_tokens_decoder()  # (the premise: an added token now)
    text = "Hi\n\u00e9\nthere"
    ids = tok.tokenizer.encode(text, add_special_tokens=False).ids
    assert newline in ids and ids == ref(text, add_special_tokens=False).input_ids
    assert tok.decode(ids) == ref.decode(ids, skip_special_tokens=True)
    assert tok.decode([newline]) == ref.decode([newline], skip_special_tokens=True)
    tt = token_text(tok)
    if special:
        assert tok.byte_fallback == {i: b for i, b in plain.items() if i != newline}
        assert decoded_bytes(tok)(newline) == b""
        return
    assert tok.byte_fallback == plain
    assert decoded_bytes(tok)(newline) == b"\n"
    from kvpool.server.protocol import completion_logprobs

    lp = completion_logprobs([(0.0, [])] * len(ids), ids, tt, TextOffsets(tt))
    assert "".join(lp["tokens"]).lstrip(" ") == text == tok.decode(ids)
    assert lp["text_offset"][-1] < len(text) and lp["text_offset"] == sorted(lp["text_offset"])


@pytest.mark.parametrize("at_its_id", [True, False])
def test_special_false_on_a_token_the_library_keeps_special_leaves_it_skipped(tmp_path, at_its_id):
    """review16 #5: tokenizer_config.json {"<id>": {"content": "<|im_start|>", "special": false}}
    (at its id or another) leaves tokenizers' flag false while its decode still skips the token
    (transformers' too: "a  b"); kvpool read the flag, so TokenBytes gave it bytes and logprobs
    a text the decode lacks. The skipped set is what the decode skips now; a new non-special
    token (" x", its decode a space) is text still."""
    from hf_tiny import save_tokenizer
    from kvpool.models.tokenizer import skipped_ids

    path = tmp_path / "t"
    save_tokenizer(path)
    spec = json.loads((path / "tokenizer.json").read_text())
    start = next(a["id"] for a in spec["added_tokens"] if a["content"] == "<|im_start|>")
    size = Tokenizer.from_file(str(path / "tokenizer.json")).get_vocab_size(with_added_tokens=True)
    config = json.loads((path / "tokenizer_config.json").read_text())
    config["added_tokens_decoder"] = {
        str(start if at_its_id else 5): {"content": "<|im_start|>", "special": False},
        str(size): {"content": " x", "special": False},
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    ref, tok = _reference(path), load_hf_tokenizer(path)
    ids = tok.tokenizer.encode("a <|im_start|> b x", add_special_tokens=False).ids
    assert start in ids and size in ids and ids == ref("a <|im_start|> b x", add_special_tokens=False).input_ids
    assert tok.tokenizer.get_added_tokens_decoder()[start].special is False  # (the premise: the flag)
    text = ref.decode(ids, skip_special_tokens=True)
    assert tok.decode(ids) == text and "<|im_start|>" not in text
    assert start in skipped_ids(tok.tokenizer) and size not in skipped_ids(tok.tokenizer)
    tb = decoded_bytes(tok)
    assert b"".join(tb(t) for t in ids).decode() == text
    assert start in token_text(tok).skipped


@pytest.mark.parametrize("key", [" 7", "+7", "-1", "7 "])
def test_an_added_tokens_decoder_key_is_read_as_transformers_int_reads_it(tmp_path, key):
    """review16 #8: keys " 7", "+7", "-1" were refused as no token id where transformers 5.25
    takes int(key) of them (an entry of a new text is added at the next id whatever its key)."""
    path = tmp_path / "t"
    save_spm_tokenizer(path, added_tokens_decoder={key: {"content": "<y>", "special": True}})
    ref, tok = _reference(path), load_hf_tokenizer(path)
    assert tok.tokenizer.token_to_id("<y>") == ref.convert_tokens_to_ids("<y>") is not None
    assert tok.encode("a <y> b") == ref("a <y> b").input_ids
    assert tok.decode(tok.encode("a <y> b")) == ref.decode(ref("a <y> b").input_ids, skip_special_tokens=True)


@pytest.mark.parametrize(
    "decoder, match",
    [
        ([], r"added_tokens_decoder is \[\], not an object"),
        ({"1": "<s>"}, r"added_tokens_decoder\['1'\] is no object with a text 'content'"),
        ({"x": {"content": "<s>"}}, r"added_tokens_decoder key 'x' is not a token id"),  # (transformers: int('x'))
        # isdigit() passed it, then int() raised naming no file (transformers: int() refuses it too)
        ({"\u00b2": {"content": "<s>"}}, r"added_tokens_decoder key '\u00b2' is not a token id"),
        (
            {"1": {"content": "<s>", "lstrip": "yes"}},
            r"added_tokens_decoder\['1'\]\.lstrip is 'yes', not true or false",
        ),
    ],
)
def test_a_malformed_added_tokens_decoder_is_refused_naming_the_file(tmp_path, decoder, match):
    save_spm_tokenizer(tmp_path / "t", added_tokens_decoder=decoder)
    with pytest.raises(ValueError, match=r"t/tokenizer_config\.json: " + match):
        load_hf_tokenizer(tmp_path / "t")


@functools.cache
def _random_llama(config):
    from random_llama import random_llama

    return random_llama(config=config)


def _stopping_engine(tok, script: list[int]):
    """An engine over a random Llama that samples `script` (one id a position), stopping on
    the tokenizer's text as the built engine does (decode_text, textless_ids, byte_fallback)."""
    from kvpool.engine.engine import Engine
    from kvpool.engine.llama_runner import llama_runner
    from kvpool.models.tokenizer import byte_fallback_ids
    from random_llama import CONFIG, DESCRIPTOR

    specials = [i for i, added in tok.tokenizer.get_added_tokens_decoder().items() if added.special]
    config = dataclasses.replace(CONFIG, vocab_size=max(CONFIG.vocab_size, tok.tokenizer.get_vocab_size()))
    return Engine(
        llama_runner(_random_llama(config), 16 + len(script) // 16 * 2, 16, DESCRIPTOR),
        max_num_batched_tokens=64,
        max_num_seqs=2,
        decode_text=tok.decode,
        textless_ids=specials,
        byte_fallback=byte_fallback_ids(tok.tokenizer),
        sampler=lambda logits, params, index, position: script[position],
    )


def _in_context(tok, prompt: list[int], ids: list[int]) -> str:
    """The output's text as the whole prompt and output decode it (the prompt's text cut off)."""
    before, text = tok.decode(prompt), tok.decode(prompt + ids)
    assert text.startswith(before)
    return text[len(before) :]


def _whole_decode_stop(tok, ids: list[int], stops: tuple[str, ...], prompt=()) -> tuple[int, str, str]:
    """Where decoding the whole output (after the prompt) after every token stops: (tokens, text, reason)."""
    for n in range(1, len(ids) + 1):
        text = _in_context(tok, list(prompt), ids[:n])
        hits = [text.find(s) for s in stops if s in text]
        if hits:
            return n, text[: min(hits)], "stop"
    return len(ids), _in_context(tok, list(prompt), ids), "length"


def _run_stop(tok, script: list[int], stops: tuple[str, ...], prompt=None) -> tuple[int, str, str]:
    from kvpool.engine.sampling import SamplingParams

    engine = _stopping_engine(tok, script)
    params = SamplingParams(max_tokens=len(script), ignore_eos=True, stop=stops)
    rid = engine.add_request(list(prompt) if prompt is not None else tok.encode("Hi there"), params)
    while engine.has_unfinished():
        engine.step()
    out = engine.pop_output(rid).completions[0]
    return len(out.token_ids), out.text, out.finish_reason


def test_a_stop_string_inside_a_byte_fallback_run_is_found(spm_dir):
    """review15 #1: "你你你你你é你你你你你你你你" as byte-fallback tokens with stop="é": the window
    of the last 4 x len + 2 tokens began inside the run, decoded as U+FFFD a byte, and the
    sample ran to its length with é in its text; a whole decode stops after 17 tokens."""
    tok = load_hf_tokenizer(spm_dir)
    script = [3 + b for b in ("你" * 5 + "é" + "你" * 8).encode()]
    prompt = tok.encode("Hi there")
    assert _run_stop(tok, script, ("é",), prompt) == (17, "你你你你你", "stop")
    assert _whole_decode_stop(tok, script, ("é",), prompt) == (17, "你你你你你", "stop")


@pytest.fixture(scope="module")
def smollm2_tok():
    from kvpool.engine.build import load_model

    return load_model(None).tokenizer


@pytest.mark.parametrize("kind", ["spm", "smollm2"])
def test_stop_strings_stop_where_a_whole_decode_does(spm_dir, smollm2_tok, kind):
    """Random outputs of byte tokens (lead and continuation bytes of 2-4-byte characters,
    invalid bytes, long runs) and normal tokens, specials among them, and stop strings cut
    from the text a whole decode gives at a random token (so U+FFFD too): the engine stops at
    the token, with the text, that decoding the whole output after every token gives; for
    the Llama-2-style tokenizer of hf_tiny (byte fallback) and SmolLM2's (byte-level). (The
    window check of a byte-fallback decoder as byte-level BPE's fails this within 60 examples.)"""
    tok = load_hf_tokenizer(spm_dir) if kind == "spm" else smollm2_tok
    size = tok.tokenizer.get_vocab_size()
    if kind == "spm":
        bytes_ = [0x41, 0x20, 0xC3, 0xA9, 0xE4, 0xBD, 0xA0, 0xF0, 0x9F, 0x99, 0x82, 0xFF, 0x80]
        byte_ids = [3 + b for b in bytes_]
        chars = [[3 + b for b in c.encode()] for c in "你é🙂"]
    else:
        byte_ids = [tok.tokenizer.token_to_id(p) for p in ["Ã", "©", "ä", "½", " ", "ð", "Ł", "A"]]
        chars = [tok.tokenizer.encode(c, add_special_tokens=False).ids for c in "你é🙂"]
        byte_ids = [i for i in byte_ids if i is not None]
    specials = [i for i, added in tok.tokenizer.get_added_tokens_decoder().items() if added.special][:3]
    token = st.one_of(
        st.lists(st.sampled_from(chars), min_size=1, max_size=16).map(lambda cs: [t for c in cs for t in c]),
        st.integers(0, size - 1).map(lambda t: [t]),
        st.sampled_from(byte_ids).map(lambda t: [t]),
        st.sampled_from(specials).map(lambda t: [t]),
    )

    @settings(max_examples=150 if kind == "spm" else 25, deadline=None)
    @given(st.lists(token, min_size=1, max_size=20), st.data())
    def check(parts: list[list[int]], data) -> None:
        script = [t for part in parts for t in part][:80]
        # a stop string from the text a whole decode gives after a random token (U+FFFD where it
        # ends inside a character) or after the last one
        at = data.draw(st.integers(1, len(script)) | st.just(len(script)))
        text = tok.decode(script[:at])
        if not text:
            return
        start = data.draw(st.integers(max(0, len(text) - 3), len(text) - 1) | st.integers(0, len(text) - 1))
        stop = text[start : start + data.draw(st.integers(1, 4))]
        stops = (stop, "\x00never")
        prompt = tok.encode("Hi there")
        assert _run_stop(tok, script, stops, prompt) == _whole_decode_stop(tok, script, stops, prompt)

    check()


def test_a_completion_keeps_the_space_its_first_token_carries(spm_dir):
    """review15 #2: the output was decoded alone, and the decoder's first-space strip took the
    space of its first piece: "... over the" + "▁lazy ▁d o g" gave "lazy dog" (joined to the
    prompt: "...over thelazy dog"), and logprobs' tokens joined to " lazy dog", not the text.
    Now the engine's text, the stream and a stop string hold the output as the prompt and
    output decode it (after the prompt's last tokens, cut off), as vLLM's detokenizer does
    (it starts from the prompt's last tokens); logprobs' tokens join to the text and their
    text_offset index it. A byte-level tokenizer takes no context (its decode has no strip)."""
    from hf_tiny import save_tokenizer
    from kvpool.server.protocol import TextOffsets, completion_logprobs

    tok = load_hf_tokenizer(spm_dir)
    tb = decoded_bytes(tok)
    prompt = tok.encode("The quick brown fox jumps over the")
    out = tok.tokenizer.encode(" lazy dog", add_special_tokens=False).ids
    assert _in_context(tok, prompt, out) == " lazy dog" and tok.decode(out) == "lazy dog"
    assert _run_stop(tok, out, ("\x00",), prompt) == (len(out), " lazy dog", "length")
    assert _run_stop(tok, out, (" lazy",), prompt) == (1, "", "stop")  # a stop string the space begins
    assert _run_stop(tok, out, ("y d",), prompt) == (2, " laz", "stop")
    stream = TextStream(tok.decode, tb).start_after(*tb.context(prompt, len(prompt)))
    assert [stream.advance([t], None) for t in out] == [" lazy", " d", "o", "g"]
    tt = token_text(tok)
    after = bool(tb.context(prompt, len(prompt))[0])
    lp = completion_logprobs([(0.0, [])] * len(out), out, tt, TextOffsets(tt, after))
    assert "".join(lp["tokens"]) == " lazy dog"
    assert all(" lazy dog"[o : o + len(t)] == t for o, t in zip(lp["text_offset"], lp["tokens"], strict=True))
    # a prompt that leaves a character open (a lead byte): its bytes are the output's
    # (test_a_character_the_prompt_leaves_open_is_the_completions)
    assert tb.context([*prompt, 3 + 0xC3], len(prompt) + 1) == ([3 + ord("A"), 3 + 0xC3], 1)
    # final read #1: a prompt whose text ends in a whole byte-run character ("\n" is <0x0A>, as in
    # Llama 2's vocabulary: chat prompts end in it) kept the strip: "lazy dog". An ASCII letter's
    # byte token is the context: the output as prompt + output decode it, in the engine, the
    # stream and the logprobs' offsets
    newline = [*prompt, 3 + 0x0A]
    assert tok.decode(newline).endswith("the\n")  # (the premise: the prompt ends in a byte token)
    whole = tok.decode([*newline, *out])
    assert whole.endswith("\n lazy dog") and _in_context(tok, newline, out) == " lazy dog"
    assert _run_stop(tok, out, ("\x00",), newline) == (len(out), " lazy dog", "length")
    context = tb.context(newline, len(newline))
    assert context == ([3 + ord("A")], 1)
    stream = TextStream(tok.decode, tb).start_after(*context)
    assert [stream.advance([t], None) for t in out] == [" lazy", " d", "o", "g"]
    lp = completion_logprobs([(0.0, [])] * len(out), out, tt, TextOffsets(tt, bool(context[0])))
    assert all(" lazy dog"[o : o + len(t)] == t for o, t in zip(lp["text_offset"], lp["tokens"], strict=True))
    save_tokenizer(spm_dir.parent / "bl")
    bl = load_hf_tokenizer(spm_dir.parent / "bl")
    assert decoded_bytes(bl).context(bl.encode("over the"), 2) == ([], 0)


def _decode_stream(ref, prompt: list[int], ids: list[int]) -> str:
    """vLLM's detokenizer's text of `ids`: tokenizers' DecodeStream (AutoTokenizer's backend)
    primed with the prompt, then the output's pieces joined (as vLLM's FastIncrementalDetokenizer;
    it primes a clean suffix of the prompt, the same here)."""
    from tokenizers.decoders import DecodeStream

    stream = DecodeStream(skip_special_tokens=True)
    for t in prompt:
        stream.step(ref.backend_tokenizer, t)
    return "".join(stream.step(ref.backend_tokenizer, t) or "" for t in ids)


def test_an_output_joining_a_prompts_invalid_byte_run_is_all_u_fffd(spm_dir):
    """review16 #3: a raw-id prompt whose last byte run holds an invalid byte (before a
    character it leaves open or not) has all its bytes U+FFFD, and so are the output's bytes
    that join it, in transformers' whole decode (and DecodeStream): the letter context showed
    them as text ('A lazy dog', '\n lazy dog' where the whole decode gives '\ufffd lazy dog').
    A byte token no UTF-8 text starts with (<0x80>) is the context now: the engine's text and
    the stream give the output's part of the whole decode."""
    from kvpool.server.protocol import completion_logprobs

    tok, ref = load_hf_tokenizer(spm_dir), _reference(spm_dir)
    tb, tt = decoded_bytes(tok), token_text(tok)
    prompt = tok.encode("The quick brown fox jumps over the")
    out = tok.tokenizer.encode(" lazy dog", add_special_tokens=False).ids
    b = [3 + x for x in range(256)]  # (byte n's token)
    assert [tt.text(t) for t in out] == [" lazy", " d", "o", "g"]  # (the premise of the offsets)
    for end in ([b[0xFF], b[0xC3]], [b[0x80], b[0xE2], b[0x82]], [b[0xFF]], [b[0x80]], [b[0xC3], b[0x41]]):
        full = [*prompt, *end]
        assert tb.context(full, len(full)) == ([b[0x80]], 1)
        for first in ([], [b[0x41]], [b[0x0A]], [b[0x20]], [b[0xA9]], [b[0xC3], b[0xA9]]):
            ids = [*first, *out]
            whole = ref.decode([*full, *ids], skip_special_tokens=True)
            before = ref.decode(full, skip_special_tokens=True)
            assert whole.startswith(before), (end, first)
            expected = whole[len(before) :]  # (the output's part of the whole decode)
            assert expected == "\ufffd" * len(first) + " lazy dog" == tok.decode([*full, *ids])[len(before) :]
            if first == [b[0x41]] and end == [b[0xFF]]:  # (the engine: a model's steps, so once)
                assert _run_stop(tok, ids, ("\x00",), full) == (len(ids), expected, "length"), end
            stream = TextStream(tok.decode, tb).start_after(*tb.context(full, len(full)))
            shown = "".join(stream.advance([t], None) for t in ids) + stream.advance([], "abort")
            assert shown == expected, (end, first, shown)
            # logprobs' text_offset (serve passes the cut byte): each piece where the text has it
            lp = completion_logprobs([(0.0, [])] * len(ids), ids, tt, TextOffsets(tt, True, b"", b"\x80"))
            offsets = lp["text_offset"]
            assert offsets[len(first) :] == [expected.index(" lazy"), *(expected.index(" lazy") + o for o in (5, 7, 8))]


def test_decode_context_stops_its_walk_at_an_invalid_byte_near_the_runs_end(spm_dir):
    """review16 #9: decode_context walked a prompt's whole byte run (a 120,001-token run ending
    open: 38 ms a call, up to 3 times a request plus once a sample). An invalid byte now ends
    the walk within twice its distance from the run's end; the context is the same as the
    whole walk's (decided on the whole run, where it is valid)."""
    from kvpool.models.tokenizer import decode_context

    tok = load_hf_tokenizer(spm_dir)
    tb = decoded_bytes(tok)
    b = [3 + x for x in range(256)]

    class Counted(list):
        reads = 0

        def __getitem__(self, index):
            Counted.reads += 1
            return super().__getitem__(index)

    prompt = tok.encode("over the")
    for tail, expected in (
        ([b[0x41]] * 100_000 + [b[0xFF]] + [b[0x41]] * 10 + [b[0xC3]], [b[0x80]]),  # invalid: bounded
        ([b[0x41]] * 50 + [b[0xFF]] + [b[0x41]] * 10, [b[0x80]]),
        ([b[0xFF]] + [b[0x41]] * 3000 + [b[0xC3]], [b[0x80]]),  # (found only at the run's start)
        ([b[0x41]] * 3000 + [b[0xC3]], [b[0x41], b[0xC3]]),  # valid, open
        ([b[0x80]] + [b[0x41]] * 200, [b[0x80]]),  # a continuation byte at the start
    ):
        ids = Counted([*prompt, *tail])
        Counted.reads = 0
        context = decode_context(ids, len(ids), tb.byte_tokens, tb.skipped, tb.letter)
        assert context == (expected, 1), (len(tail), context)
        if len(tail) > 100_000:
            assert Counted.reads < 1_000, Counted.reads


def test_an_open_character_the_output_does_not_complete_is_in_no_logprobs_token(spm_dir):
    """review16 #4, docs/engine.md's example: after a prompt ending <0xC3>, "▁lazy ▁d o g" is the
    text "\ufffd lazy dog" (the prompt's open character, uncompleted, is the output's), and the
    logprobs' tokens join to " lazy dog" (no output token carries the U+FFFD); their
    text_offset index the text all the same."""
    from kvpool.server.protocol import TextOffsets, completion_logprobs

    tok = load_hf_tokenizer(spm_dir)
    tb, tt = decoded_bytes(tok), token_text(tok)
    prompt = [*tok.encode("The quick brown fox jumps over the"), 3 + 0xC3]
    out = tok.tokenizer.encode(" lazy dog", add_special_tokens=False).ids
    context, cut = tb.context(prompt, len(prompt))
    stream = TextStream(tok.decode, tb).start_after(context, cut)
    assert "".join(stream.advance([t], None) for t in out) + stream.advance([], "abort") == "\ufffd lazy dog"
    carried = b"".join(tb(t) for t in context[cut:])
    lp = completion_logprobs([(0.0, [])] * len(out), out, tt, TextOffsets(tt, True, carried))
    assert (lp["tokens"], lp["text_offset"]) == ([" lazy", " d", "o", "g"], [1, 6, 8, 9])


def test_a_character_the_prompt_leaves_open_is_the_completions(spm_dir):
    """A raw-id prompt that ends inside a UTF-8 character (the first byte token of 'é' in a
    byte-fallback vocabulary) got no decode context: its output was decoded alone, "lazy dog"
    after <0xC3> (the whole decode: "the\ufffd lazy dog"), "\ufffd lazy dog" for <0xA9> "▁lazy ..."
    (the whole decode: "theé lazy dog"). Now the character is the output's, as vLLM's
    detokenizer shows it (tokenizers' DecodeStream primed with the prompt): 'é' where the
    output's bytes complete it, U+FFFD where they do not; the engine's text, the stream and
    logprobs' text_offset alike. A prompt whose run holds an invalid byte before the open
    character: test_an_output_joining_a_prompts_invalid_byte_run_is_all_u_fffd."""
    from kvpool.server.protocol import TextOffsets, completion_logprobs

    tok, ref = load_hf_tokenizer(spm_dir), _reference(spm_dir)
    tb, tt = decoded_bytes(tok), token_text(tok)
    prompt = tok.encode("The quick brown fox jumps over the")
    out = tok.tokenizer.encode(" lazy dog", add_special_tokens=False).ids
    b = [3 + x for x in range(256)]  # (byte n's token)
    cases = [  # (the prompt's last tokens, the output's first, vLLM's text)
        ([b[0xC3]], [b[0xA9]], "é lazy dog"),
        ([b[0xC3]], [], "\ufffd lazy dog"),
        ([b[0xE2], b[0x82]], [b[0xAC]], "€ lazy dog"),
        ([b[0xE2]], [b[0x82], b[0xAC]], "€ lazy dog"),
        ([b[0xF0], 0, b[0x9F]], [b[0x98], b[0x80]], "😀 lazy dog"),  # (a special token inside the run: skipped)
        ([b[0xC3]], [b[ord("A")]], "\ufffd\ufffd lazy dog"),  # (the run turns invalid: both bytes U+FFFD)
        ([b[0xC3], b[0xA9], b[0xE2]], [b[0x82], b[0xAC]], "€ lazy dog"),
    ]
    for end, first, expected in cases:
        full, ids = [*prompt, *end], [*first, *out]
        assert _decode_stream(ref, full, ids) == expected, (end, first)
        context = tb.context(full, len(full))
        assert context[1] == 1 and len(context[0]) > 1, context
        assert _run_stop(tok, ids, ("\x00",), full) == (len(ids), expected, "length"), (end, first)
        stream = TextStream(tok.decode, tb).start_after(*context)
        shown = "".join(stream.advance([t], None) for t in ids) + stream.advance([], "abort")
        assert shown == expected, (end, first, shown)
        carried = b"".join(tb(t) for t in context[0][context[1] :])
        lp = completion_logprobs([(0.0, [])] * len(ids), ids, tt, TextOffsets(tt, True, carried))
        offsets = lp["text_offset"]  # (the bytes of 'é' start where it does: 0)
        assert offsets == sorted(offsets) and offsets[len(first)] == expected.index(" lazy"), offsets
        pieces = [(o, t) for o, t, i in zip(offsets, lp["tokens"], ids, strict=True) if i not in tb.byte_tokens]
        assert all(expected[o:].startswith(t) for o, t in pieces), (offsets, lp["tokens"])
        assert all(o == 0 for o in offsets[: len(first)]) or "\ufffd\ufffd" in expected, offsets
    # a prompt ending in a whole character's byte ("\n": the letter is the context) and an output
    # whose first byte turns the letter's run invalid: the stream showed nothing, token after
    # token, until the sample's end (the window no longer began with the letter's text)
    full, ids = [*prompt, b[0x0A]], [b[0xA9], *out]
    stream = TextStream(tok.decode, tb).start_after(*tb.context(full, len(full)))
    assert [stream.advance([t], None) for t in ids] == ["", "\ufffd lazy", " d", "o", "g"]
    assert _run_stop(tok, ids, ("\x00",), full) == (len(ids), "\ufffd lazy dog", "length")
