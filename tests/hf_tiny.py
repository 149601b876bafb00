"""A tiny byte-level BPE tokenizer saved as an HF model directory's tokenizer files by
transformers' save_pretrained (tokenizer.json, tokenizer_config.json, the chat template),
trained here by the `tokenizers` library on a few sentences (no network), for the tests of
models/hf_tokenizer.py and of HF directories through generate / serve / run."""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<s>"]
# ChatML, with the BOS named through `bos_token` as Llama templates do, and loop controls
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'skip' %}{% continue %}{% endif %}"
    "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CORPUS = [
    "The quick brown fox jumps over the lazy dog. It isn't what you'd think, is it?",
    "Hello world! Key-value caches keep the attention of earlier tokens; 1234 blocks, 56 pages.",
    "Qwen and Llama read text, chat templates and special tokens, then answer in kind.",
] * 20


def tiny_tokenizer(vocab_size: int = 290, bos: bool = False) -> Tokenizer:
    """Byte-level BPE of at most `vocab_size` tokens, SPECIALS among them; `bos`: its
    post-processor puts <s> before a text (a Llama's), else none (a Qwen2's)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(CORPUS, trainer)
    if bos:
        tok.post_processor = processors.TemplateProcessing(
            single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", tok.token_to_id("<s>"))]
        )
    return tok


def save_tokenizer(directory: str | Path, vocab_size: int = 290, bos: bool = False) -> object:
    """tiny_tokenizer saved by transformers into `directory`; the transformers tokenizer."""
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(
        tokenizer_object=tiny_tokenizer(vocab_size, bos),
        bos_token="<s>",
        eos_token="<|im_end|>",
        unk_token=None,
        pad_token="<|endoftext|>",
        chat_template=CHAT_TEMPLATE,
    )
    hf.save_pretrained(directory)
    return hf


# Llama 2's chat template, shortened: the system prompt folded into the first user turn, [INST] turns, EOS after answers
LLAMA2_TEMPLATE = (
    "{% if messages[0]['role'] == 'system' %}"
    "{% set system = '<<SYS>>\\n' + messages[0]['content'] + '\\n<</SYS>>\\n\\n' %}"
    "{% set messages = messages[1:] %}{% else %}{% set system = '' %}{% endif %}"
    "{% for m in messages %}{% if m['role'] == 'user' %}"
    "{{ bos_token + '[INST] ' + (system if loop.first else '') + m['content'].strip() + ' [/INST]' }}"
    "{% else %}{{ ' ' + m['content'].strip() + ' ' + eos_token }}{% endif %}{% endfor %}"
)
SPM_CORPUS = [
    "The quick brown fox jumps over the lazy dog. Hello world, hello again!",
    "Café crème brûlée, naïve façade; ¿qué tal? Über die Straße.",
    "你好，世界！日本語のテキストも少し。",
    "Emoji 🙂 🚀 and digits 0123456789, 3.14159 and 2024-12-07.",
] * 10


# characters left out of the SentencePiece-style vocabulary: written as byte-fallback tokens
SPM_FALLBACK = "你世界少語🙂🚀ßÜ"


def _spm_merges(corpus: list[str], alphabet: set[str], num: int) -> list[tuple[str, str]]:
    """BPE merges learnt from `corpus` as SentencePiece's BPE learns them (words split before
    each "▁", the most frequent pair merged first; ties by the pair's text, so the same
    merges every run: the tokenizers trainer breaks ties differently from run to run)."""
    from collections import Counter

    words: Counter[tuple[str, ...]] = Counter()
    for line in corpus:
        for word in ("\u2581" + line.replace(" ", "\u2581")).split("\u2581")[1:]:
            words[tuple("\u2581" + word)] += 1
    merges = []
    for _ in range(num):
        pairs: Counter[tuple[str, str]] = Counter()
        for word, count in words.items():
            for pair in zip(word, word[1:], strict=False):
                if pair[0] in alphabet or len(pair[0]) > 1:
                    if pair[1] in alphabet or len(pair[1]) > 1:
                        pairs[pair] += count
        if not pairs:
            break
        best = min(pairs, key=lambda pair: (-pairs[pair], pair))
        merges.append(best)
        merged: Counter[tuple[str, ...]] = Counter()
        for word, count in words.items():
            out, i = [], 0
            while i < len(word):
                if word[i : i + 2] == best:
                    out.append(best[0] + best[1])
                    i += 2
                else:
                    out.append(word[i])
                    i += 1
            merged[tuple(out)] += count
        words = merged
    return merges


def spm_tokenizer(num_merges: int = 150) -> Tokenizer:
    """A Llama-2-style tokenizer.json: <unk> <s> </s>, the 256 byte-fallback tokens <0x00>..<0xFF>,
    the characters of SPM_CORPUS but SPM_FALLBACK's (byte fallback writes those), then
    `num_merges` BPE merges learnt on SPM_CORPUS; Llama 2's normalizer (prepend "▁", spaces
    to "▁"), decoder (Replace "▁", ByteFallback, Fuse, Strip) and post-processor (<s> first)."""
    from tokenizers import AddedToken, normalizers

    meta = "\u2581"
    alphabet = {c for line in SPM_CORPUS for c in line.replace(" ", meta)} - set(SPM_FALLBACK) | {meta}
    merges = _spm_merges(SPM_CORPUS, alphabet, num_merges)
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{i:02X}>": 3 + i for i in range(256)}}
    for piece in [*sorted(alphabet), *(a + b for a, b in merges)]:
        vocab.setdefault(piece, len(vocab))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, byte_fallback=True, unk_token="<unk>", fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend(meta), normalizers.Replace(" ", meta)])
    tok.decoder = decoders.Sequence(
        [decoders.Replace(meta, " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in ("<unk>", "<s>", "</s>")])
    tok.post_processor = processors.TemplateProcessing(
        single="<s>:0 $A:0", pair="<s>:0 $A:0 <s>:1 $B:1", special_tokens=[("<s>", 1)]
    )
    return tok


def save_spm_tokenizer(directory: str | Path, model_type: str = "llama", **config) -> Tokenizer:
    """spm_tokenizer's tokenizer.json and a Llama 2 tokenizer_config.json (LlamaTokenizer,
    add_bos_token, legacy false, the chat template; `config` changes or, None, drops keys) and,
    where none is there, a config.json of `model_type` (what AutoTokenizer picks its class by)."""
    import json

    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    tok = spm_tokenizer()
    tok.save(str(d / "tokenizer.json"))
    settings = {
        "add_bos_token": True,
        "add_eos_token": False,
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "pad_token": None,
        "legacy": False,
        "clean_up_tokenization_spaces": False,
        "tokenizer_class": "LlamaTokenizer",
        "chat_template": LLAMA2_TEMPLATE,
        **config,
    }
    (d / "tokenizer_config.json").write_text(json.dumps({k: v for k, v in settings.items() if v is not None}))
    if not (d / "config.json").exists():
        (d / "config.json").write_text(json.dumps({"model_type": model_type}))
    return tok
