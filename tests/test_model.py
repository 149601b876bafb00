"""SmolLM2-135M from the GGUF against Hugging Face transformers on the same file.

transformers (+ accelerate) is a test extra: these tests skip without it.
"""

from __future__ import annotations

import os

import pytest
import torch

from kvpool.engine.build import build_engine, load_model
from kvpool.engine.sampling import SamplingParams
from kvpool.models.gguf import default_gguf_path, load_gguf

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

NEW_TOKENS = 36
CHATS = [
    "Write a short story about a robot who learns to paint.",
    "Explain how a bicycle works, step by step.",
    "List some facts about the Moon.",
]


@pytest.fixture(scope="module")
def loaded():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield load_model(device="cpu")
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def hf_model(loaded):
    path = default_gguf_path()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32
    )
    model.eval()
    return model


@pytest.fixture(scope="module")
def hf_tokenizer():
    path = default_gguf_path()
    return transformers.AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))


def test_config_comes_from_metadata(loaded):
    cfg = loaded.model.config
    assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (30, 9, 3, 64)
    assert cfg.rope_theta == 100000.0 and cfg.vocab_size == 49152 and cfg.tie_embeddings


@pytest.mark.parametrize(
    "text",
    [
        "Hello, world!",
        "Ünïcödé 日本語 テスト 🙂 émoji",
        "  spaces\n\nnew lines\ttabs",
        "What is 12345 + 678?",
        "<|im_start|>user\nhi<|im_end|>\n",
        "it's they'll we've",
    ],
)
def test_tokenizer_matches_transformers(loaded, hf_tokenizer, text):
    ids = loaded.tokenizer.encode(text)
    assert ids == hf_tokenizer.encode(text, add_special_tokens=False)
    assert loaded.tokenizer.decode(ids, skip_special_tokens=False) == text


def test_chat_template_matches_transformers(loaded, hf_tokenizer):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    ours = loaded.tokenizer.render_chat(messages)
    assert ours == hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert ours.startswith("<|im_start|>system\n")


@pytest.mark.parametrize("fused", [True, False], ids=["c-kernels", "plain-torch"])
def test_logits_match_transformers(loaded, hf_model, fused):
    from kvpool.attention.reference import reference_logits

    ids = loaded.tokenizer.encode_chat([{"role": "user", "content": CHATS[0]}])
    with torch.no_grad():
        theirs = hf_model(torch.tensor([ids])).logits[0]
    assert (reference_logits(loaded.model, ids, fused=fused) - theirs).abs().max().item() < 1e-3


def test_greedy_generation_equals_transformers(loaded, hf_model):
    prompts = [loaded.tokenizer.encode_chat([{"role": "user", "content": c}]) for c in CHATS]
    engine = build_engine(loaded, num_blocks=64, block_size=16, max_num_batched_tokens=256)
    ours = engine.generate(prompts, SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True))
    for prompt, out in zip(prompts, ours, strict=True):
        with torch.no_grad():
            gen = hf_model.generate(
                torch.tensor([prompt]),
                max_new_tokens=NEW_TOKENS,
                min_new_tokens=NEW_TOKENS,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
        theirs = gen[0, len(prompt) :].tolist()
        assert len(theirs) == NEW_TOKENS
        assert out.completions[0].token_ids == theirs


def test_clear_errors_for_bad_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="not found"):
        load_gguf(str(tmp_path / "missing.gguf"))
    import gguf

    path = tmp_path / "gpt2.gguf"
    writer = gguf.GGUFWriter(str(path), "gpt2")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", torch.zeros(4, 8).numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="unsupported GGUF architecture 'gpt2'"):
        load_gguf(str(path))
