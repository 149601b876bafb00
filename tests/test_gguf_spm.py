"""A GGUF's SentencePiece tokenizer (tokenizer.ggml.model "llama": Llama 2, Mistral 7B, TinyLlama):
tokens, scores and token types as llama.cpp's converter writes them, the BPE merges recovered
from the scores (models/tokenizer.py spm_merges). Checked on GGUFs written here (tokenizer
metadata only) from tests/hf_tiny.py's Llama-2-style tokenizer.json (scores: the merge that made
each piece, earliest highest, as SentencePiece's BPE scores its pieces) against transformers'
AutoTokenizer over that tokenizer.json as it is (a "mistral" directory: "▁" before the text and
after each special token, as llama.cpp's add_space_prefix)."""

from __future__ import annotations

import json
import random

import gguf
import pytest

from hf_tiny import LLAMA2_TEMPLATE, SPM_CORPUS, save_spm_tokenizer, spm_tokenizer
from kvpool.models.gguf import read_tokenizer
from kvpool.models.tokenizer import build_tokenizer, check_tokenizer_kind, spm_merges
from kvpool.server.protocol import decoded_bytes
from kvpool.server.text_stream import TextStream
from test_gguf_chat_template import gguf_tokenizer
from test_hf_spm import MESSAGES, TEXTS, _reference

transformers = pytest.importorskip("transformers")


def write_spm_gguf(
    path, add_bos: bool | None = True, add_eos: bool | None = None, scores: bool = True, tied: bool = False
) -> str:
    """hf_tiny's SentencePiece-style tokenizer as GGUF tokenizer metadata: <unk> unknown (type 2),
    <s> </s> control (3), the <0xNN> tokens bytes (6), every other piece normal (1) scored by the
    merge that made it (the first merge highest; characters below every merge); `tied`: every
    token scored -1000, as gguf-py's converter of a checkpoint without a tokenizer.model writes."""
    spec = json.loads(spm_tokenizer().to_str())
    vocab = spec["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.get)
    assert [vocab[t] for t in tokens] == list(range(len(tokens)))
    made = {}
    for rank, merge in enumerate(spec["model"]["merges"]):
        made.setdefault("".join(merge if isinstance(merge, list) else merge.split(" ")), rank)
    types = [
        2 if t == "<unk>" else 3 if t in ("<s>", "</s>") else 6 if 3 <= i < 259 else 1 for i, t in enumerate(tokens)
    ]
    values = [0.0 if types[i] != 1 else -float(made.get(t, len(made) + i)) for i, t in enumerate(tokens)]
    if tied:
        values = [-1000.0] * len(tokens)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    if scores:
        w.add_token_scores(values)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    if add_bos is not None:
        w.add_add_bos_token(add_bos)
    if add_eos is not None:
        w.add_add_eos_token(add_eos)
    w.add_chat_template(LLAMA2_TEMPLATE)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    path = tmp_path_factory.mktemp("spm") / "mistral"
    save_spm_tokenizer(path, model_type="mistral")
    ref = _reference(path)
    assert type(ref).__name__ == "TokenizersBackend"  # (tokenizer.json as it is)
    return ref


def test_a_llama_gguf_tokenizer_equals_the_tokenizer_json_it_was_written_from(tmp_path, reference):
    tok = gguf_tokenizer(write_spm_gguf(tmp_path / "t.gguf"))
    assert tok.add_bos_token and tok.bos_token_id == 1 and tok.eos_token_id == 2
    rng = random.Random(0)
    words = " ".join(SPM_CORPUS[:4]).split(" ")
    texts = TEXTS + SPM_CORPUS[:4] + [" ".join(rng.choices(words, k=12)) for _ in range(50)]
    texts += ["".join(rng.choices(" ".join(SPM_CORPUS[:4]), k=40)) for _ in range(100)]  # (any split of any text)
    for text in texts:
        ids = reference(text).input_ids
        assert tok.encode(text) == ids, text
        assert tok.decode(ids) == reference.decode(ids, skip_special_tokens=True), text
    for messages in (MESSAGES, MESSAGES[1:2]):
        rendered = tok.render_chat(messages)
        assert rendered == reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        ids = reference.apply_chat_template(messages, add_generation_prompt=True)["input_ids"]
        assert tok.encode_chat(messages) == ids and ids[:2].count(1) == 1  # (one BOS first: the template's)
    # the stream reads it as SentencePiece-style: "▁the" keeps its space after earlier tokens
    ids = tok.encode("The quick brown fox")[1:]
    stream = TextStream(tok.decode, decoded_bytes(tok))
    assert "".join(stream.advance([t], None) for t in ids) == "The quick brown fox"
    assert decoded_bytes(tok).byte_tokens == {3 + b: b for b in range(256)}


@pytest.mark.parametrize("add_bos, add_eos", [(False, None), (True, True), (False, True)])
def test_add_bos_and_add_eos_come_from_the_header(tmp_path, reference, add_bos, add_eos):
    tok = gguf_tokenizer(write_spm_gguf(tmp_path / "t.gguf", add_bos, add_eos))
    body = reference("Hello world").input_ids[1:]
    assert tok.encode("Hello world") == [1] * add_bos + body + [2] * bool(add_eos)
    assert (
        tok.encode_chat(MESSAGES[1:2])
        == reference.apply_chat_template(MESSAGES[1:2], add_generation_prompt=True)["input_ids"]
    )


def test_a_llama_gguf_without_add_bos_key_takes_the_bos_as_llama_cpp(tmp_path, reference):
    """llama.cpp's default for a SentencePiece vocabulary without tokenizer.ggml.add_bos_token: a BOS."""
    tok = gguf_tokenizer(write_spm_gguf(tmp_path / "t.gguf", add_bos=None))
    assert tok.add_bos_token and not tok.add_eos_token
    assert tok.encode("Hello world") == reference("Hello world").input_ids


def test_a_llama_gguf_without_scores_or_bytes_is_refused_in_one_line(tmp_path):
    with pytest.raises(ValueError, match="lacks tokenizer.ggml.scores"):
        gguf_tokenizer(write_spm_gguf(tmp_path / "t.gguf", scores=False))
    data = read_tokenizer(gguf.GGUFReader(write_spm_gguf(tmp_path / "u.gguf")))
    from dataclasses import replace

    with pytest.raises(ValueError, match="no byte tokens"):
        build_tokenizer(replace(data, token_types=tuple(1 if k == 6 else k for k in data.token_types)))
    with pytest.raises(ValueError, match=r"unsupported GGUF tokenizer model 'bert'.*'gpt2'.*'llama'"):
        check_tokenizer_kind("bert", "default")


def test_a_llama_gguf_whose_merged_pieces_share_a_score_is_refused_in_one_line(tmp_path, reference):
    """llama.cpp breaks a tie of scores by the leftmost pair in the text, which ranked BPE merges
    cannot: with every score -1000 the GGUF is refused; the same vocabulary with distinct scores
    (a tokenizer.model's) encodes as its tokenizer.json."""
    with pytest.raises(ValueError) as refused:
        gguf_tokenizer(write_spm_gguf(tmp_path / "tied.gguf", tied=True))
    message = str(refused.value)
    assert "\n" not in message and "same score (-1000)" in message and "leftmost" in message
    tok = gguf_tokenizer(write_spm_gguf(tmp_path / "distinct.gguf"))
    for text in TEXTS:
        assert tok.encode(text) == reference(text).input_ids


def test_a_tie_of_scores_is_refused_where_the_ranked_merges_would_differ_from_llama_cpp():
    """The review's case: pieces ▁ a b c bc ab of one score; "abc" is [▁, ab, c] by llama.cpp's
    leftmost rule, and [▁, a, bc] by ids ranked in their order: refused. Distinct scores rank."""
    tokens = ("\u2581", "a", "b", "c", "bc", "ab")
    with pytest.raises(ValueError, match="'bc' and 'ab' the same score"):
        spm_merges(tokens, (-1.0,) * 6, set(range(6)))
    assert spm_merges(tokens, (-1.0, -1.0, -1.0, -1.0, -3.0, -2.0), set(range(6))) == [("a", "b"), ("b", "c")]


def test_generate_on_a_llama_gguf_with_a_sentencepiece_tokenizer_streams_its_decode(
    tmp_path, capsys, monkeypatch, reference
):
    """A whole GGUF (test_gguf_metadata's tiny Llama, a random output matrix) with the
    SentencePiece tokenizer: `kvpool generate` takes it (the header's tokenizer model
    checked before the weights), its prompt is the reference's ids, and the streamed stdout
    is the decode of the ids --json reports; twice, the second from the weight cache (the
    scores kept in its entry)."""
    import numpy as np

    from kvpool.cli.main import main
    from test_gguf_metadata import write_gguf

    spec = json.loads(spm_tokenizer().to_str())
    vocab = spec["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.get)
    data = read_tokenizer(gguf.GGUFReader(write_spm_gguf(tmp_path / "t.gguf")))
    rng = np.random.default_rng(0)
    path = write_gguf(
        tmp_path / "m.gguf",
        tokens=tokens,
        tokenizer_model="llama",
        scores=list(data.scores),
        token_types=list(data.token_types),
        bos=1,
        eos=2,
        template=LLAMA2_TEMPLATE,
        extra={"output.weight": (rng.standard_normal((len(tokens), 16)) * 4).astype(np.float32)},
    )
    monkeypatch.setenv("KVPOOL_CACHE_DIR", str(tmp_path / "cache"))
    prompt = reference("Hello world, 你好").input_ids
    for source in ("gguf", "weight cache"):
        base = ["generate", "Hello world, 你好", "--no-chat", "--model", path, "--max-tokens", "24"]
        capsys.readouterr()
        assert main([*base, "--json"]) == 0
        report = json.loads(capsys.readouterr().out)
        assert report["prompt_tokens"] == len(prompt) and len(report["token_ids"]) >= 5
        assert report["load_source"].startswith(source), report["load_source"]
        text = reference.decode(report["token_ids"], skip_special_tokens=True)
        assert report["text"] == text
        assert main(base) == 0
        assert capsys.readouterr().out.rstrip("\n") == text.rstrip("\n")
