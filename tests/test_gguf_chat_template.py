"""A GGUF's chat template sees what transformers (and llama.cpp) give a template: bos_token and
eos_token (the texts of tokenizer.ggml.bos_token_id / eos_token_id), tools=None and
strftime_now, through the one function an HF directory's template gets them from
(models/tokenizer.py chat_template_vars); the rendered text is encoded with one BOS, not a
second one before the template's own. Checked on GGUFs written here (tokenizer metadata only)
from tests/hf_tiny.py's byte-level BPE, against transformers' apply_chat_template on the
same tokenizer, with a Llama-3-style template (`{{ bos_token }}`, add_bos_token true) and a
Qwen2.5-style one (`{% if tools %}`, no BOS)."""

from __future__ import annotations

import json
from datetime import datetime

import gguf
import pytest

from hf_tiny import SPECIALS, tiny_tokenizer
from kvpool.models.gguf import read_tokenizer
from kvpool.models.tokenizer import build_tokenizer

transformers = pytest.importorskip("transformers")

BOS, EOS = "<s>", "<|im_end|>"
# Llama 3's shape: the BOS written by the template, a dated system header, eos_token closing each turn
LLAMA3_STYLE = (
    "{{- bos_token }}"
    "{%- if strftime_now is defined %}{%- set date = strftime_now('%d %b %Y') %}{%- else %}"
    "{%- set date = '26 Jul 2024' %}{%- endif %}"
    "{{- '<|im_start|>system\\nToday: ' + date + eos_token }}"
    "{%- for m in messages %}{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] | trim + eos_token }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
# Qwen2.5's shape: a system turn listing the tools when there are any, else a default one
QWEN25_STYLE = (
    "{%- if tools %}{{- '<|im_start|>system\\nYou may call: ' }}"
    "{%- for t in tools %}{{- t | tojson }}{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- elif messages[0]['role'] != 'system' %}{{- '<|im_start|>system\\nYou are helpful.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for m in messages %}{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
CHATS = [
    [{"role": "user", "content": "Hello there, fox."}],
    [
        {"role": "user", "content": "Hello there, fox."},
        {"role": "assistant", "content": "The lazy dog isn't here!"},
        {"role": "user", "content": "Key-value caches, 1234 blocks?"},
    ],
]


def write_tokenizer_gguf(path, template: str, add_bos: bool, pre: str = "default", add_eos: bool | None = None) -> str:
    """A GGUF holding hf_tiny's BPE as tokenizer metadata alone (SPECIALS as control tokens);
    tokenizer.ggml.add_eos_token written when `add_eos` is not None."""
    tok = json.loads(tiny_tokenizer().to_str())
    vocab = tok["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.get)
    assert [vocab[t] for t in tokens] == list(range(len(tokens)))
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_merges(merges)
    w.add_token_types([3 if t in SPECIALS else 1 for t in tokens])
    w.add_bos_token_id(vocab[BOS])
    w.add_eos_token_id(vocab[EOS])
    w.add_add_bos_token(add_bos)
    if add_eos is not None:
        w.add_add_eos_token(add_eos)
    w.add_chat_template(template)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def gguf_tokenizer(path):
    return build_tokenizer(read_tokenizer(gguf.GGUFReader(str(path))))


def reference(template: str):
    """transformers' tokenizer over the same BPE, special tokens and template."""
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tiny_tokenizer(), bos_token=BOS, eos_token=EOS, chat_template=template
    )


def reference_ids(ref, messages) -> list[int]:
    ids = ref.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


@pytest.mark.parametrize("add_bos", [True, False], ids=["add_bos", "no_add_bos"])
def test_a_llama3_style_template_gets_bos_and_eos_tokens_and_one_bos(tmp_path, add_bos):
    tok = gguf_tokenizer(write_tokenizer_gguf(tmp_path / "l.gguf", LLAMA3_STYLE, add_bos))
    ref = reference(LLAMA3_STYLE)
    bos = ref.convert_tokens_to_ids(BOS)
    assert tok.bos_token_id == bos and tok.add_bos_token is add_bos
    today = datetime.now().strftime("%d %b %Y")
    for messages in CHATS:
        rendered = tok.render_chat(messages)
        assert rendered == ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert rendered.startswith(f"{BOS}<|im_start|>system\nToday: {today}{EOS}<|im_start|>user\n")
        ids = tok.encode_chat(messages)
        assert ids == reference_ids(ref, messages)
        assert ids == tok.encode_rendered(rendered)
        assert ids[0] == bos and ids.count(bos) == 1  # the template's BOS; add_bos_token adds none before it
    # raw text (--no-chat) takes add_bos_token's BOS as before, even before a written one
    assert tok.encode(BOS + "fox") == [bos] * (1 + add_bos) + ref.encode("fox", add_special_tokens=False)


def test_a_rendered_text_without_the_bos_still_gets_add_bos_tokens(tmp_path):
    template = LLAMA3_STYLE.removeprefix("{{- bos_token }}")
    tok = gguf_tokenizer(write_tokenizer_gguf(tmp_path / "l.gguf", template, add_bos=True))
    ref = reference(template)
    bos = ref.convert_tokens_to_ids(BOS)
    ids = tok.encode_chat(CHATS[1])
    assert ids == [bos, *reference_ids(ref, CHATS[1])] and ids.count(bos) == 1


def test_a_qwen25_style_template_tests_tools_as_transformers_does(tmp_path):
    tok = gguf_tokenizer(write_tokenizer_gguf(tmp_path / "q.gguf", QWEN25_STYLE, add_bos=False))
    ref = reference(QWEN25_STYLE)
    for messages in CHATS:
        rendered = tok.render_chat(messages)
        assert rendered == ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert rendered.startswith("<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\n")
        ids = tok.encode_chat(messages)
        assert ids == reference_ids(ref, messages)
        assert ref.convert_tokens_to_ids(BOS) not in ids


def test_the_template_variables_are_the_gguf_tokens_texts(tmp_path):
    template = "{{ bos_token }}|{{ eos_token }}|{{ tools }}|{{ documents }}|{{ strftime_now('%Y') }}"
    tok = gguf_tokenizer(write_tokenizer_gguf(tmp_path / "v.gguf", template, add_bos=False))
    assert tok.render_chat([]) == f"{BOS}|{EOS}|None|None|{datetime.now().year}"
    # names the GGUF does not give are jinja's Undefined, as transformers and llama.cpp render
    # them: '' and false; an attribute of one refuses the messages in one line
    tok.chat_template = "[{{ pad_token }}]{% if documents %}d{% endif %}{% if custom is defined %}c{% endif %}"
    assert tok.render_chat([]) == "[]"
    tok.chat_template = "{{ pad_token.content }}"
    with pytest.raises(ValueError, match="^the chat template refused the messages: 'pad_token' is undefined$"):
        tok.render_chat([])


# SmolLM2-135M-Instruct's GGUF (the default model): a 2-turn chat's ids as main rendered them
# before its template was given bos_token / tools (recorded with main at 7b525af)
SMOLLM2_CHAT = [
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "Paris. It isn't Lyon!"},
    {"role": "user", "content": "And of Italy, 1234?"},
]
SMOLLM2_IDS = [
    1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018, 411, 407, 19712, 8182, 2, 198,
    1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47, 2, 198, 1, 520, 9531, 198, 38634, 30, 657, 3247, 982, 38034,
    17, 2, 198, 1, 4093, 198, 3528, 282, 7158, 28, 216, 33, 34, 35, 36, 47, 2, 198, 1, 520, 9531, 198,
]  # fmt: skip


def test_smollm2s_template_renders_as_before_and_as_transformers():
    import os

    from kvpool.models.gguf import default_gguf_path

    path = default_gguf_path()
    tok = gguf_tokenizer(path)
    ids = tok.encode_chat(SMOLLM2_CHAT)
    assert ids == SMOLLM2_IDS
    ref = transformers.AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    assert ids == reference_ids(ref, SMOLLM2_CHAT)


@pytest.mark.parametrize("add_bos", [True, False], ids=["add_bos", "no_add_bos"])
@pytest.mark.parametrize("add_eos", [True, False, None], ids=["add_eos", "no_add_eos", "no_key"])
def test_add_eos_token_ends_a_raw_prompt_as_transformers_gguf_tokenizer_does(tmp_path, add_bos, add_eos):
    """tokenizer.ggml.add_eos_token was not read: a GGUF that says true (embedding models' do)
    had raw prompts encoded without the EOS that llama.cpp and transformers append. The
    reference is transformers' own GGUF loading of the same file: raw text gets [BOS] ids [EOS]
    as the two keys say; a chat gets what apply_chat_template gives (no EOS after the
    generation prompt; add_bos_token's BOS as before)."""
    path = write_tokenizer_gguf(tmp_path / "e.gguf", QWEN25_STYLE, add_bos, add_eos=add_eos)
    tok = gguf_tokenizer(path)
    gguf_ref = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="e.gguf")
    plain = reference(QWEN25_STYLE)
    bos, eos = plain.convert_tokens_to_ids(BOS), plain.convert_tokens_to_ids(EOS)
    assert tok.add_eos_token is bool(add_eos)
    for text in ("Hello there, fox.", "Key-value caches, 1234 blocks?" + EOS, ""):
        ids = tok.encode(text)
        assert ids == gguf_ref.encode(text)
        assert ids == [bos] * add_bos + plain.encode(text, add_special_tokens=False) + [eos] * bool(add_eos)
    for messages in CHATS:
        assert tok.encode_chat(messages) == [bos] * add_bos + reference_ids(plain, messages)
        assert tok.encode_chat(messages)[-1] != eos
