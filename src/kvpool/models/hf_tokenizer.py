"""The tokenizer of a Hugging Face model directory, as transformers' AutoTokenizer reads it.

tokenizer.json (the `tokenizers` library's own format: vocabulary, merges, pre-tokenizer,
post-processor, added tokens) encodes and decodes: byte-level BPE (Llama 3, Qwen2, SmolLM2) or
SentencePiece-style BPE with byte fallback (Llama 2, Mistral 7B v0.1-v0.3, TinyLlama; for a
"llama" model of tokenizer_class LlamaTokenizer with the pipeline transformers' LlamaTokenizer
rebuilds from tokenizer_config.json's legacy / add_prefix_space); tokenizer_config.json names the special
tokens (bos / eos / unk / pad: a string or {"content": ...}), whether decoding cleans up
spaces before punctuation (not for a BPE model, as transformers 5), and the chat template
(a string, or a list of named templates of which "default" is used); a chat_template.jinja
file, which newer transformers writes instead, takes precedence. generation_config.json's
eos_token_id (one id or a list) adds end-of-turn tokens. Raw text is encoded with tokenizer.json's post-processor, as
`tokenizer(text)` does (add_special_tokens=True: a Llama's BOS; tokenizer_config.json's
add_bos_token / add_eos_token change nothing, as in transformers 5); a rendered chat template
without it, as `apply_chat_template` does (the template writes its own special tokens).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import xxhash
from tokenizers import Tokenizer

from kvpool.models.tokenizer import ChatTokenizer, byte_fallback_ids, chat_template_vars

TOKENIZER_JSON, TOKENIZER_CONFIG = "tokenizer.json", "tokenizer_config.json"
CHAT_TEMPLATE_FILE, GENERATION_CONFIG = "chat_template.jinja", "generation_config.json"
_SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token")


def is_hf_directory(path: str | Path) -> bool:
    """Whether `path` is a Hugging Face model directory (it holds a config.json)."""
    return (Path(path) / "config.json").is_file()


def has_hf_tokenizer(directory: str | Path) -> bool:
    """Whether `directory` holds a tokenizer.json (an HF model that takes text)."""
    return (Path(directory) / TOKENIZER_JSON).is_file()


def missing_tokenizer(directory: str | Path) -> str:
    """The one line that refuses text to an HF directory without a tokenizer.json: the file,
    a tokenizer.model beside it that is not read (SentencePiece's own format), and what runs
    without it (`kvpool run`'s token-id workload). load_hf_tokenizer gives it to every text
    entry point (generate, serve, eval, bench engine / start, kvpool.LLM load through it);
    serve asks before it binds its port."""
    d = Path(directory)
    unread = (
        " (its tokenizer.model, SentencePiece's own file, is not read: transformers' save_pretrained of "
        "its fast tokenizer writes a tokenizer.json)"
        if (d / "tokenizer.model").is_file()
        else ""
    )
    return (
        f"{d / TOKENIZER_JSON}: no such file; kvpool reads an HF model's text through its tokenizer.json{unread}; "
        f"without one, `kvpool run --model {d}` runs the model on token ids"
    )


def _json_object(path: Path) -> dict[str, Any]:
    """A JSON object file; {} when it is absent; ValueError naming the file otherwise."""
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_bytes())
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: not a JSON file ({e})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: not a JSON object (a {type(data).__name__})")
    return data


def _token_text(path: Path, key: str, value: Any) -> str | None:
    """A special token's text from its tokenizer_config.json entry (None: not set)."""
    if isinstance(value, dict):
        value = value.get("content")
    if value is None or isinstance(value, str):
        return value
    raise ValueError(f"{path}: {key} is {value!r}, not a token's text")


def _chat_template(directory: Path, config: dict[str, Any]) -> tuple[str | None, str, str | None]:
    """(template, where it came from as "FILE's", why there is none): chat_template.jinja, else
    tokenizer_config.json's chat_template. A list of named templates without "default" loads
    without one (transformers asks for a name only when a template is applied): its reason
    is render_chat's error, so raw text (--no-chat, /v1/completions) still runs."""
    jinja_file = directory / CHAT_TEMPLATE_FILE
    if jinja_file.is_file():
        try:
            return jinja_file.read_text(encoding="utf-8"), f"{jinja_file}'s", None
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"{jinja_file}: not readable UTF-8 text ({e})") from None
    template = config.get("chat_template")
    where = directory / TOKENIZER_CONFIG
    if template is None:
        return None, f"{directory}'s", None
    if isinstance(template, list):  # named templates: transformers uses "default"
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        if "default" not in named:
            return None, f"{where}'s", f"{where}: chat_template lists {sorted(map(str, named))}, none named 'default'"
        template = named["default"]
    if template is not None and not isinstance(template, str):
        raise ValueError(f"{where}: chat_template is a {type(template).__name__}, not a template's text")
    return template, f"{where}'s", None


def _eos_ids(directory: Path) -> tuple[int, ...]:
    path = directory / GENERATION_CONFIG
    eos = _json_object(path).get("eos_token_id")
    if eos is None:
        return ()
    ids = eos if isinstance(eos, list) else [eos]
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise ValueError(f"{path}: eos_token_id is {eos!r}, not a token id or a list of them")
    return tuple(ids)


def _type(part: Any) -> str:
    """A tokenizer.json component's type, a Sequence's with its members': "Sequence[Replace, Fuse]"."""
    if not isinstance(part, dict):
        return "none"
    kind = str(part.get("type"))
    members = next((part[k] for k in ("decoders", "normalizers", "pretokenizers") if k in part), None)
    if kind == "Sequence" and isinstance(members, list):
        return f"Sequence[{', '.join(_type(m) for m in members)}]"
    return kind


def _members(part: Any, key: str) -> list[Any]:
    """A component as a list: none, itself, or a Sequence's members."""
    if part is None:
        return []
    return part.get(key, []) if isinstance(part, dict) and part.get("type") == "Sequence" else [part]


def _kind(path: Path, spec: dict[str, Any]) -> str:
    """ "byte-level" or "sentencepiece": the two kinds of tokenizer.json whose text streams
    (server/text_stream.py) and token bytes (server/protocol.py) kvpool reads. SentencePiece-style
    is Llama 2's and Mistral 7B's: a BPE model with byte fallback, "▁" for a space (a Metaspace
    pre-tokenizer, or a normalizer that prepends "▁" and replaces spaces by it) and the decoder
    Replace "▁" by " ", ByteFallback, Fuse, Strip one leading space (or without the Strip).
    ValueError in one line naming what is another kind."""
    decoder = spec.get("decoder")
    if isinstance(decoder, dict) and decoder.get("type") == "ByteLevel":
        return "byte-level"
    meta = {"String": "\u2581"}
    parts = _members(decoder, "decoders")
    spm = [
        {"type": "Replace", "pattern": meta, "content": " "},
        {"type": "ByteFallback"},
        {"type": "Fuse"},
        {"type": "Strip", "content": " ", "start": 1, "stop": 0},
    ]
    if not (isinstance(decoder, dict) and decoder.get("type") == "Sequence" and parts in (spm, spm[:3])):
        raise ValueError(
            f"{path}: its decoder is {_type(decoder)}; kvpool takes byte-level BPE (a ByteLevel decoder: Llama 3, "
            "Qwen2, SmolLM2) and SentencePiece-style BPE (Sequence[Replace, ByteFallback, Fuse, Strip]: Llama 2, "
            "Mistral 7B, TinyLlama)"
        )
    model = spec.get("model")
    if not isinstance(model, dict) or model.get("type") != "BPE" or model.get("byte_fallback") is not True:
        what = "a BPE model without byte_fallback" if _type(model) == "BPE" else f"a {_type(model)} model"
        raise ValueError(f"{path}: a SentencePiece-style decoder with {what}; kvpool takes BPE with byte fallback")
    norms = _members(spec.get("normalizer"), "normalizers")
    space = {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"}
    if any(n not in ({"type": "Prepend", "prepend": "\u2581"}, space) for n in norms):
        raise ValueError(
            f"{path}: its normalizer is {_type(spec.get('normalizer'))}; a SentencePiece-style tokenizer.json's may "
            "only prepend '\u2581' and replace spaces by it (Prepend, Replace)"
        )
    pres = _members(spec.get("pre_tokenizer"), "pretokenizers")
    if any(not isinstance(q, dict) or (q.get("type"), q.get("replacement")) != ("Metaspace", "\u2581") for q in pres):
        raise ValueError(
            f"{path}: its pre-tokenizer is {_type(spec.get('pre_tokenizer'))}; a SentencePiece-style "
            "tokenizer.json's may only be Metaspace ('\u2581')"
        )
    return "sentencepiece"


def _llama_class(directory: Path, config: dict[str, Any]) -> bool:
    """Whether transformers' AutoTokenizer reads the directory with its LlamaTokenizer class,
    which rebuilds a SentencePiece-style tokenizer.json's pipeline from tokenizer_config.json
    (legacy, add_prefix_space): a "llama" model whose tokenizer_class (tokenizer_config.json's,
    else config.json's) is LlamaTokenizer or LlamaTokenizerFast. Any other (a "mistral" model,
    no class, PreTrainedTokenizerFast) reads tokenizer.json as it is."""
    model = _json_object(directory / "config.json")
    declared = config.get("tokenizer_class") or model.get("tokenizer_class")
    llama = isinstance(declared, str) and declared.removesuffix("Fast") == "LlamaTokenizer"
    return llama and model.get("model_type") == "llama"


def _flag(path: Path, config: dict[str, Any], key: str, default: bool) -> bool:
    value = config.get(key, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ValueError(f"{path}: {key} is {value!r}, not true or false")
    return value


def _as_llama_tokenizer(
    path: Path, config: dict[str, Any], spec: dict[str, Any], tokenizer: Tokenizer
) -> tuple[Tokenizer, bool]:
    """tokenizer.json's vocabulary, merges, added tokens and post-processor with the pipeline
    transformers' LlamaTokenizer builds: no normalizer, a Metaspace pre-tokenizer that turns
    spaces into "▁" and prepends one to the text's start ("first": legacy false, its default)
    or to every piece between special tokens ("always": legacy true), none without
    add_prefix_space (default true); the decoder strips the first space only with it (the bool)."""
    from tokenizers import decoders, models, pre_tokenizers

    legacy = _flag(path, config, "legacy", False)
    prefix = _flag(path, config, "add_prefix_space", True)
    vocab, merges = spec["model"].get("vocab", {}), spec["model"].get("merges", [])
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in merges]
    try:
        rebuilt = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=True, byte_fallback=True, dropout=None))
    except Exception as e:  # (a bare Exception: "Token `x` out of vocabulary")
        raise ValueError(f"{path.parent / TOKENIZER_JSON}: its merges do not fit its vocabulary ({e})") from None
    rebuilt.normalizer = None
    scheme = ("always" if legacy else "first") if prefix else "never"
    rebuilt.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme=scheme, split=False)
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    rebuilt.decoder = decoders.Sequence(steps + ([decoders.Strip(" ", 1, 0)] if prefix else []))
    added = tokenizer.get_added_tokens_decoder()
    rebuilt.add_tokens([added[i] for i in sorted(added)])  # (AddedTokens keep their special flag)
    rebuilt.post_processor = tokenizer.post_processor
    return rebuilt, prefix


_ADDED_TOKEN_FLAGS = ("single_word", "lstrip", "rstrip", "normalized", "special")


def _added_tokens(path: Path, config: dict[str, Any], tokenizer: Tokenizer) -> None:
    """tokenizer_config.json's added_tokens_decoder on tokenizer.json's tokens, as transformers
    (AutoTokenizer) takes it, entry by entry in the order of their ids: an entry of an added
    token's text sets its flags (single_word, lstrip, rstrip, normalized, special: an added token
    with lstrip there takes the spaces before it); one of a piece of the vocabulary makes that
    piece an added token with its flags (a special one: decode skips it); one of a text the
    vocabulary lacks adds it at the next id, whatever id the entry names (transformers 5.25:
    it was left out, and the text encoded as its characters' pieces)."""
    from tokenizers import AddedToken

    entries = config.get("added_tokens_decoder")
    if entries is None:
        return
    if not isinstance(entries, dict):
        raise ValueError(f"{path}: added_tokens_decoder is {json.dumps(entries)[:40]}, not an object of id: token")
    ordered = []
    for key, entry in entries.items():
        try:  # (transformers takes int(key): " 7", "+7", "-1" too; the id of a text new to the vocabulary is not used)
            number = int(key)
        except ValueError:  # (transformers: "invalid literal for int()", naming no file)
            raise ValueError(f"{path}: added_tokens_decoder key {key!r} is not a token id") from None
        if not isinstance(entry, dict) or not isinstance(entry.get("content"), str):
            raise ValueError(f"{path}: added_tokens_decoder[{key!r}] is no object with a text 'content'")
        for flag in _ADDED_TOKEN_FLAGS:
            if flag in entry and not isinstance(entry[flag], bool):
                raise ValueError(f"{path}: added_tokens_decoder[{key!r}].{flag} is {entry[flag]!r}, not true or false")
        ordered.append((number, entry))
    for _, entry in sorted(ordered, key=lambda item: item[0]):
        token = next((t for t in tokenizer.get_added_tokens_decoder().values() if t.content == entry["content"]), None)
        if token is None:  # (the library's defaults for the flags it leaves out, as transformers)
            flags = {flag: entry[flag] for flag in _ADDED_TOKEN_FLAGS if flag in entry}
        else:
            flags = {flag: entry.get(flag, getattr(token, flag)) for flag in _ADDED_TOKEN_FLAGS}
            if all(flags[flag] == getattr(token, flag) for flag in _ADDED_TOKEN_FLAGS):
                continue
        tokenizer.add_tokens([AddedToken(entry["content"], **flags)])


def load_hf_tokenizer(directory: str | Path) -> ChatTokenizer:
    """The ChatTokenizer of an HF model directory. ValueError in one line naming the file for
    a missing or malformed tokenizer.json, one of a kind whose text kvpool does not stream
    (neither byte-level BPE nor SentencePiece-style BPE: _kind), a malformed tokenizer_config.json /
    generation_config.json / chat_template.jinja, or a special token the vocabulary lacks."""
    d = Path(directory)
    path = d / TOKENIZER_JSON
    if not path.is_file():
        raise ValueError(missing_tokenizer(d))
    try:
        raw = path.read_bytes()
        tokenizer = Tokenizer.from_str(raw.decode("utf-8"))
    except Exception as e:  # (the library raises a bare Exception: "expected value at line 1 column 1")
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ValueError(f"{path}: not a tokenizers tokenizer.json ({reason})") from None
    config_path = d / TOKENIZER_CONFIG
    config = _json_object(config_path)
    spec = json.loads(raw)
    spm = _kind(path, spec) == "sentencepiece"
    # (the decoder's Strip of the text's first space: tokenizer.json's, or LlamaTokenizer's add_prefix_space)
    strips = spm and len(_members(spec.get("decoder"), "decoders")) == 4
    if spm and _llama_class(d, config):
        tokenizer, strips = _as_llama_tokenizer(config_path, config, spec, tokenizer)
    _added_tokens(config_path, config, tokenizer)
    names = {key: _token_text(config_path, key, config.get(key)) for key in _SPECIAL_NAMES}
    ids: dict[str, int | None] = {}
    for key, text in names.items():
        ids[key] = None if text is None else tokenizer.token_to_id(text)
        if text is not None and ids[key] is None and key in ("bos_token", "eos_token"):
            raise ValueError(f"{config_path}: {key} {text!r} is not in {path.name}'s vocabulary")
    stops = tuple(i for i in _eos_ids(d) if i != ids["eos_token"])
    vocab = tokenizer.get_vocab_size(with_added_tokens=True)
    if any(i >= vocab for i in stops):
        raise ValueError(f"{d / GENERATION_CONFIG}: eos_token_id {list(stops)} is past the vocabulary ({vocab})")
    template, template_source, template_absent = _chat_template(d, config)
    version = "hf-tokenizer:" + xxhash.xxh3_64_hexdigest(raw + b"\0" + json.dumps(config, sort_keys=True).encode())
    return ChatTokenizer(
        tokenizer,
        template,
        ids["bos_token"],
        ids["eos_token"],
        add_bos_token=False,  # (the post-processor adds a BOS where the model takes one)
        version=version,
        template_source=template_source,
        template_absent=template_absent,
        template_vars=chat_template_vars(names),  # (its special tokens' texts, tools=None, strftime_now)
        stop_token_ids=stops,
        post_process=True,
        # (transformers 5 ignores the flag for a BPE model: the clean-up would drop spaces BPE kept)
        clean_up_spaces=config.get("clean_up_tokenization_spaces") is True and type(tokenizer.model).__name__ != "BPE",
        byte_fallback=byte_fallback_ids(tokenizer) if spm else None,
        strips_first_space=strips,
    )
