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
