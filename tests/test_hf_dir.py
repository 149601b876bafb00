"""An HF model directory through every text command: its tokenizer (models/hf_tokenizer.py)
against transformers' AutoTokenizer on a tiny BPE that transformers' save_pretrained wrote
(ids with special tokens, decode, the rendered chat template and its ids); `kvpool generate`
on a tiny random Qwen2 saved with save_pretrained against transformers' greedy generate on
the same weights; `kvpool serve` answering a chat completion through the official openai
client; `kvpool run --model DIR --disk-cache` hitting what an earlier run stored, and
missing it once the weights are other. Missing or malformed files: one line naming the file."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

import kvpool
from hf_tiny import save_tokenizer
from kvpool.cli.main import main
from kvpool.engine.build import build_engine, load_model
from kvpool.engine.sampling import SamplingParams
from kvpool.models.hf_tokenizer import load_hf_tokenizer
from served import served
from test_qwen2 import hf_model, hf_weights

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.usefixtures("one_thread")

TEXTS = [
    "Hello world!",
    "The quick brown fox isn't lazy , is it ?",
    "<|im_start|>user\nkeys<|im_end|> and <s> inside text",
    "digits 1234567 and émoji 🙂 bytes",
    "",
]
CHAT = [
    {"role": "user", "content": "Hello there, fox."},
    {"role": "assistant", "content": "The lazy dog isn't here!"},
]


@pytest.mark.parametrize("bos", [False, True], ids=["qwen2-like", "bos"])
def test_the_directory_tokenizer_equals_transformers_autotokenizer(tmp_path, bos):
    save_tokenizer(tmp_path, bos=bos)
    ref = transformers.AutoTokenizer.from_pretrained(tmp_path)
    tok = load_hf_tokenizer(tmp_path)
    for text in TEXTS:
        ids = ref(text).input_ids
        assert tok.encode(text) == ids, text
        assert (ids[:1] == [ref.bos_token_id]) == (bos and True), text  # the post-processor's BOS, or none
        for skip in (False, True):
            assert tok.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip), text
    specials = [ref.convert_tokens_to_ids(t) for t in ("<|im_start|>", "<s>", "<|im_end|>")]
    mixed = [*specials, *ref("fox")["input_ids"], specials[2]]
    assert tok.decode(mixed, skip_special_tokens=False) == ref.decode(mixed)
    assert tok.decode(mixed) == ref.decode(mixed, skip_special_tokens=True) == "fox"
    for messages in (CHAT, CHAT[:1]):
        rendered = ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert tok.render_chat(messages) == rendered
        assert rendered.startswith("<s><|im_start|>user\n")  # (bos_token reached the template)
        ids = ref.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
        ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
        assert tok.encode_chat(messages) == ids
        assert ids.count(ref.bos_token_id) == 1  # the template's BOS alone: no second one
    assert (tok.bos_token_id, tok.eos_token_id) == (ref.bos_token_id, ref.eos_token_id)


def test_clean_up_tokenization_spaces_leaves_a_bpe_decode_as_transformers_does(tmp_path):
    save_tokenizer(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, "clean_up_tokenization_spaces": True}))
    ref = transformers.AutoTokenizer.from_pretrained(tmp_path)
    tok = load_hf_tokenizer(tmp_path)
    ids = ref(TEXTS[1]).input_ids
    # transformers 5 ignores the flag for BPE (the clean-up would drop spaces the text had)
    assert tok.decode(ids) == ref.decode(ids, skip_special_tokens=True) == TEXTS[1]


def test_a_template_sees_what_transformers_gives_it(tmp_path):
    save_tokenizer(tmp_path)
    template = (
        "{% if tools %}tools{% endif %}{{ eos_token }}|{{ pad_token }}|{{ strftime_now('%Y-%m') }}|"
        "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{{ m['content'] }}{% endfor %}"
    )
    (tmp_path / "chat_template.jinja").write_text(template)
    ref = transformers.AutoTokenizer.from_pretrained(tmp_path)
    rendered = ref.apply_chat_template(CHAT, tokenize=False)
    assert load_hf_tokenizer(tmp_path).render_chat(CHAT, add_generation_prompt=False) == rendered
    assert rendered.startswith("<|im_end|>|<|endoftext|>|20") and rendered.endswith("|Hello there, fox.")


def test_a_tokenizer_larger_than_the_model_is_refused(tmp_path, capsys):
    path = _qwen2_dir(tmp_path / "m")
    raw = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**raw, "vocab_size": 200}))
    err = _file_error(tmp_path, capsys, ["generate", "hi", "--model", str(path)])
    assert "tokenizer.json has 290 tokens, past config.json's vocab_size 200" in err, err


def _file_error(tmp_path, capsys, argv) -> str:
    capsys.readouterr()  # (save_pretrained's progress bar)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    return err


@pytest.mark.parametrize(
    "name, text, match",
    [
        ("tokenizer.json", None, "tokenizer.json: no such file"),
        ("tokenizer.json", "{not json", "tokenizer.json: not a tokenizers tokenizer.json"),
        ("tokenizer.json", "[]", "tokenizer.json: not a tokenizers tokenizer.json"),
        ("tokenizer_config.json", "{", "tokenizer_config.json: not a JSON file"),
        ("tokenizer_config.json", '{"eos_token": "<nope>"}', "eos_token '<nope>' is not in tokenizer.json's"),
        ("tokenizer_config.json", '{"eos_token": 7}', "tokenizer_config.json: eos_token is 7, not a token's text"),
        ("generation_config.json", '{"eos_token_id": "x"}', "generation_config.json: eos_token_id is 'x'"),
        ("chat_template.jinja", "{% for %}", "chat_template.jinja's chat template is not valid jinja (line 1)"),
    ],
)
def test_a_missing_or_malformed_tokenizer_file_is_one_line_naming_it(tmp_path, capsys, name, text, match):
    path = _qwen2_dir(tmp_path / "m")
    if text is None:
        (path / name).unlink()
    else:
        (path / name).write_text(text)
    err = _file_error(tmp_path, capsys, ["generate", "hi", "--model", str(path), "--max-tokens", "2"])
    assert match in err and name in err, err


@pytest.mark.parametrize("spm", [False, True], ids=["none", "tokenizer_model"])
def test_a_directory_without_tokenizer_json_is_refused_text_in_one_line_naming_what_runs(tmp_path, capsys, spm):
    """An HF directory with no tokenizer.json (none at all, or SentencePiece's tokenizer.model
    alone): every text entry point refuses it in one line naming the missing file, the
    tokenizer.model it does not read, and what runs without it (`kvpool run` on token ids:
    test_hf_qwen2's test_kvpool_run_serves_an_hf_directory_with_its_weights). The line named
    the file alone; serve refused it after binding its port."""
    path = _qwen2_dir(tmp_path / "m")
    (path / "tokenizer.json").unlink()
    if spm:
        (path / "tokenizer.model").write_bytes(b"\n\x00")  # (its bytes are never read)
    want = f"{path}/tokenizer.json: no such file; kvpool reads an HF model's text through its tokenizer.json"
    runs = f"; without one, `kvpool run --model {path}` runs the model on token ids"
    unread = " (its tokenizer.model, SentencePiece's own file, is not read: transformers' save_pretrained of"
    for argv in (
        ["generate", "hi", "--model", str(path), "--max-tokens", "2"],
        ["serve", "--model", str(path) + "/", "--port", "0"],
        ["eval", "kv-quant", "--model", str(path)],
        ["bench", "engine", "--model", str(path)],
    ):
        capsys.readouterr()
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert "Traceback" not in err, err
        line = err.splitlines()[-1]  # (bench engine says it loads first; serve no longer does)
        assert line.startswith(f"kvpool {' '.join(argv[:2]) if argv[0] in ('eval', 'bench') else argv[0]}: error: ")
        assert want in line and line.endswith(runs) and (unread in line) == spm, line
        assert argv[0] != "serve" or len(err.splitlines()) == 1, err
    # one message, from one place: the tokenizer's loader said "no such file (kvpool reads an HF
    # model's text through its tokenizer.json)", engine/build.py the line above, before it
    with pytest.raises(ValueError) as refused:
        load_hf_tokenizer(path)
    assert want in str(refused.value) and str(refused.value).endswith(runs) and (unread in str(refused.value)) == spm
    with pytest.raises(ValueError) as e:
        kvpool.LLM(str(path))
    assert want in str(e.value) and str(e.value).endswith(runs) and (unread in str(e.value)) == spm


def test_a_template_error_names_the_file_that_held_the_template(tmp_path):
    path = _qwen2_dir(tmp_path / "m")
    (path / "chat_template.jinja").unlink()
    config = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": "{% for %}"}))
    with pytest.raises(ValueError, match=r"m/tokenizer_config\.json's chat template is not valid jinja \(line 1\)"):
        load_hf_tokenizer(path).render_chat(CHAT)


def test_named_templates_without_a_default_refuse_only_a_chat(tmp_path, capsys):
    """transformers loads such a tokenizer and asks for a name only when a template is applied:
    raw text still runs; a chat is refused in one line naming the file and the names."""
    path = _qwen2_dir(tmp_path / "m")
    (path / "chat_template.jinja").unlink()
    config = json.loads((path / "tokenizer_config.json").read_text())
    named = [{"name": "tool_use", "template": "{{ messages[0]['content'] }}"}]
    (path / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": named}))
    tok = load_hf_tokenizer(path)
    assert tok.encode("Hello world") == transformers.AutoTokenizer.from_pretrained(path)("Hello world")["input_ids"]
    why = "tokenizer_config.json: chat_template lists ['tool_use'], none named 'default'; use raw text (--no-chat)"
    with pytest.raises(ValueError, match=re.escape(why)):
        tok.render_chat(CHAT)
    capsys.readouterr()
    assert main(["generate", "Hello world", "--no-chat", "--model", str(path), "--max-tokens", "2"]) == 0
    assert why in _file_error(tmp_path, capsys, ["generate", "Hello world", "--model", str(path), "--max-tokens", "2"])


def _sentencepiece_tokenizer(directory: Path) -> None:
    """A Llama-2-style tokenizer.json (Metaspace '▁', byte fallback, decoder Replace +
    ByteFallback + Fuse + Strip), whose tokens decoded one by one lose their spaces."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{i:02X}>": 3 + i for i in range(256)}}
    for w in ["▁", "▁Hello", "▁world", "H", "e", "l", "o"]:
        vocab.setdefault(w, len(vocab))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True, unk_token="<unk>", fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    tok.add_special_tokens([AddedToken(t, special=True) for t in ("<unk>", "<s>", "</s>")])
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    # (the premise: decoded alone, its tokens drop the space a whole decode keeps)
    ids = [vocab["▁Hello"], vocab["▁world"]]
    assert tok.decode(ids) == "Hello world" and "".join(tok.decode([i]) for i in ids) == "Helloworld"


def test_a_sentencepiece_tokenizer_json_streams_the_spaces_its_tokens_alone_lose(tmp_path):
    """Its stream (server/text_stream.py) decodes new tokens after earlier ones: "Hello world",
    not the "Helloworld" of its tokens decoded one by one (tests/test_hf_spm.py: the rest)."""
    from kvpool.server.protocol import decoded_bytes
    from kvpool.server.text_stream import TextStream

    _sentencepiece_tokenizer(tmp_path / "sp")
    tok = load_hf_tokenizer(tmp_path / "sp")
    ids = [tok.tokenizer.token_to_id(p) for p in ("\u2581Hello", "\u2581world")]
    stream = TextStream(tok.decode, decoded_bytes(tok))
    assert [stream.advance([t], None) for t in ids] == ["Hello", " world"]


def _qwen2_dir(path: Path, dtype: torch.dtype = torch.float64, seed: int = 7):
    """A tiny random Qwen2 (test_qwen2's weights) and the tiny tokenizer, saved by transformers."""
    model = hf_model(hf_weights(False, seed), False, dtype)
    model.save_pretrained(path)
    save_tokenizer(path)
    raw = json.loads((path / "config.json").read_text())  # (room for run's workload)
    (path / "config.json").write_text(json.dumps({**raw, "max_position_embeddings": 2048}))
    return path


def _hf_greedy(path: Path, dtype: torch.dtype, ids: list[int], n: int) -> tuple[list[int], float]:
    """transformers' greedy continuation of `ids` and the smallest top-1 / top-2 logit gap on the way."""
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    with torch.no_grad():
        out = model.generate(
            torch.tensor([ids]),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            output_scores=True,
            return_dict_in_generate=True,
            pad_token_id=0,
            eos_token_id=None,
        )
    top2 = [s[0].double().topk(2).values for s in out.scores]
    return out.sequences[0, len(ids) :].tolist(), min(float(a - b) for a, b in top2)


def test_generate_on_an_hf_directory_gives_transformers_greedy_tokens(tmp_path, capsys):
    path = _qwen2_dir(tmp_path / "qwen2")
    n = 12
    loaded = load_model(str(path), dtype=torch.float64, device="cpu")
    prompt = loaded.tokenizer.encode_chat([{"role": "user", "content": "Hello world"}])
    engine = build_engine(loaded, num_blocks=16, block_size=16)
    rid = engine.add_request(prompt, SamplingParams(max_tokens=n, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    ours = engine.output(rid).completions[0].token_ids
    ref64, _ = _hf_greedy(path, torch.float64, prompt, n)
    assert ours == ref64  # fp64: the same argmax throughout
    # the CLI in fp32 (its default): the same tokens where transformers' fp32 margins leave no doubt
    ref32, gap = _hf_greedy(path, torch.float32, prompt, n)
    assert ref32 == ref64 and gap > 1e-3, gap
    argv = ["generate", "Hello world", "--model", str(path), "--max-tokens", str(n), "--json"]
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["prompt_tokens"] == len(prompt) and report["load_source"] == "safetensors"
    stop = set(loaded.tokenizer.stop_token_ids) | {loaded.tokenizer.eos_token_id}
    end = next((i + 1 for i, t in enumerate(ref64) if t in stop), n)  # the CLI stops at an end of turn
    assert report["token_ids"] == ref64[:end]
    assert report["text"] == loaded.tokenizer.decode(ref64[:end])


def _llama_dir(path: Path) -> object:
    """A tiny random LlamaForCausalLM saved with a tokenizer whose post-processor adds <s>
    and whose template writes `{{ bos_token }}`; the transformers tokenizer."""
    from random_llama import TINY_HF_LLAMA

    config = transformers.LlamaConfig(**{**TINY_HF_LLAMA, "max_position_embeddings": 2048})
    torch.manual_seed(3)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():  # (transformers' init draws small weights: spread the logits apart)
        model.lm_head.weight.mul_(40)
    model.save_pretrained(path)
    return save_tokenizer(path, bos=True)


def test_generate_no_chat_on_an_hf_llama_directory_takes_the_bos_and_transformers_tokens(tmp_path, capsys):
    path = tmp_path / "llama"
    ref_tok = _llama_dir(path)
    prompt = ref_tok("The quick brown fox").input_ids
    assert prompt[0] == ref_tok.bos_token_id
    ref, gap = _hf_greedy(path, torch.float32, prompt, 8)
    assert gap > 1e-3, gap
    capsys.readouterr()
    argv = ["generate", "The quick brown fox", "--no-chat", "--model", str(path), "--max-tokens", "8", "--json"]
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["prompt_tokens"] == len(prompt)
    end = next((i + 1 for i, t in enumerate(ref) if t == ref_tok.eos_token_id), 8)
    assert report["token_ids"] == ref[:end]


def test_the_llm_class_chats_with_an_hf_directory(tmp_path):
    from kvpool import LLM

    path = _qwen2_dir(tmp_path / "qwen2", torch.float32)
    llm = LLM(str(path) + "/", kv_cache_bytes=1 << 20)
    assert llm.model_name == "qwen2"  # (not "qwen2/")
    out = llm.chat("Hello world", SamplingParams(max_tokens=5, ignore_eos=True))[0]
    prompt = llm.tokenizer.encode_chat([{"role": "user", "content": "Hello world"}])
    ref, gap = _hf_greedy(path, torch.float32, prompt, 5)
    assert gap > 1e-3 and out.token_ids == ref and out.prompt_token_ids == prompt


def test_a_served_directory_is_named_by_its_own_name(tmp_path, monkeypatch):
    from kvpool.cli.serve import served_name

    (tmp_path / "q").mkdir()
    monkeypatch.chdir(tmp_path / "q")
    assert served_name(".") == "q" and served_name("../q/") == "q" and served_name("sub/..") == "q"
    assert served_name("m.gguf") == "m" and served_name(None) == "smollm2-135m"


def test_llm_chat_and_a_served_chat_take_the_templates_bos_alone(tmp_path):
    """LLM.chat and /v1/chat/completions render the template, then encode its text: that text
    holds the template's <s>, and the post-processor's would be a second one (they encoded
    it as raw text: [<s>, <s>, ...])."""
    import asyncio

    import httpx

    from kvpool import LLM
    from kvpool.server.app import ServerState, build_app
    from kvpool.server.engine_thread import EngineThread
    from kvpool.server.metrics import ServerMetrics

    path = tmp_path / "llama"
    ref_tok = _llama_dir(path)
    messages = [{"role": "user", "content": "Hello world"}]
    ids = ref_tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    assert ids.count(ref_tok.bos_token_id) == 1 and ids[0] == ref_tok.bos_token_id
    llm = LLM(str(path), kv_cache_bytes=1 << 20)
    assert llm.chat(messages, SamplingParams(max_tokens=1))[0].prompt_token_ids == ids
    engine = build_engine(llm.loaded, num_blocks=16, block_size=16)
    thread = EngineThread(engine, llm.tokenizer.decode)
    state = ServerState(thread, llm.tokenizer, ServerMetrics("llama"), "llama", engine.runner.max_model_len)
    app = build_app(state)
    thread.start()

    async def post() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=60) as client:
            body = {"model": "llama", "messages": messages, "max_tokens": 1}
            return await client.post("/v1/chat/completions", json=body)

    try:
        reply = asyncio.run(post())
    finally:
        thread.stop()
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["prompt_tokens"] == len(ids)


def test_serve_answers_a_chat_completion_from_an_hf_directory(tmp_path):
    openai = pytest.importorskip("openai")
    path = _qwen2_dir(tmp_path / "qwen2")
    with served("--model", str(path), "--kv-memory", "4MiB") as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", timeout=60)
        assert [m.id for m in client.models.list()] == ["qwen2"]
        reply = client.chat.completions.create(
            model="qwen2", messages=[{"role": "user", "content": "Hello world"}], max_tokens=6, temperature=0
        )
        loaded = load_model(str(path), dtype=torch.float32, device="cpu")
        prompt = loaded.tokenizer.encode_chat([{"role": "user", "content": "Hello world"}])
        ref, gap = _hf_greedy(path, torch.float32, prompt, 6)
        assert gap > 1e-3, gap  # (fp32 greedy tokens compared: margins no CPU's rounding can cross)
        stop = set(loaded.tokenizer.stop_token_ids) | {loaded.tokenizer.eos_token_id}
        end = next((i for i, t in enumerate(ref) if t in stop), 6)
        assert reply.choices[0].message.content == loaded.tokenizer.decode(ref[:end])
        assert reply.usage.prompt_tokens == len(prompt)


def test_run_on_an_hf_directory_uses_the_disk_tier_by_its_weights_digest(tmp_path, capsys):
    path = _qwen2_dir(tmp_path / "qwen2", torch.float32)
    disk = tmp_path / "disk"
    argv = ["run", "--model", str(path), "--num-requests", "3", "--turns", "1", "--num-long", "0", "--seed", "1"]
    argv += ["--request-rate", "inf", "--max-tokens", "2", "--kv-memory", "2MiB", "--json", "--disk-cache", str(disk)]

    def run() -> dict:
        assert main(argv) == 0
        return json.loads(capsys.readouterr().out)

    first = run()
    assert first["num_finished"] == 3 and _disk_hits(first) == 0 and first["disk_tier"]["num_puts"] > 0
    again = run()  # a new process's engine: only the disk tier holds the prompts' blocks
    assert _disk_hits(again) > 0, again
    _qwen2_dir(path, torch.float32, seed=8)  # other weights in the same directory, same tokenizer
    other = run()
    assert _disk_hits(other) == 0 and other["disk_tier"]["num_puts"] > 0, other["disk_tier"]
    assert _disk_hits(run()) > 0  # the other weights' own blocks: they hit in turn


def _disk_hits(report: dict) -> int:
    return report["disk_tier"]["hit_tokens"]
