"""A chat template that uses what Qwen3's and Llama 3's templates use (namespace(),
loop.index0 / loop.first / loop.last, `is string`, `.split('</think>')`, `.strip` /
`.lstrip('\\n')`, `|tojson`, tools, raise_exception, add_generation_prompt and enable_thinking
passed as a template variable), written here: kvpool's render_chat against transformers'
apply_chat_template on the same directory, and chat_template_kwargs (vLLM's name) through
LLM.chat and kvpool serve's /v1/chat/completions (the openai client's extra_body)."""

from __future__ import annotations

from pathlib import Path

import pytest

import kvpool
from hf_tiny import save_tokenizer
from kvpool.models.hf_tokenizer import load_hf_tokenizer
from served import served

transformers = pytest.importorskip("transformers")

TEMPLATE = r"""{%- set state = namespace(last_user=-1, sys_text='') -%}
{%- for m in messages -%}
  {%- if m.role == 'user' -%}{%- set state.last_user = loop.index0 -%}{%- endif -%}
{%- endfor -%}
{%- if tools -%}
<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}Callable functions:
{% for t in tools %}{{ t | tojson }}
{% endfor %}<|im_end|>
{% elif messages[0].role == 'system' -%}
<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif -%}
{%- for m in messages -%}
  {%- if m.content is string -%}{%- set body = m.content -%}
  {%- else -%}{%- set body = m.content | tojson -%}{%- endif -%}
  {%- if m.role == 'system' and loop.first -%}
  {%- elif m.role == 'user' -%}
<|im_start|>user
{{ body }}<|im_end|>
{% elif m.role == 'assistant' -%}
    {%- set thought = '' -%}
    {%- if '</think>' in body -%}
      {%- set thought = body.split('</think>')[0].split('<think>')[-1].strip('\n') -%}
      {%- set body = body.split('</think>')[-1].lstrip('\n') -%}
    {%- endif -%}
<|im_start|>assistant
{% if loop.index0 > state.last_user and thought %}<think>
{{ thought }}
</think>

{% endif %}{{ body }}{% if m.tool_calls is defined %}{% for c in m.tool_calls %}
<call>{{ c | tojson }}</call>{% endfor %}{% endif %}<|im_end|>
{% elif m.role == 'tool' -%}
<|im_start|>tool
{{ body }}<|im_end|>
{% else -%}
{{ raise_exception('no role ' + m.role + ' at message ' + loop.index0|string) }}
{%- endif -%}
  {%- if loop.last and m.role == 'assistant' and add_generation_prompt -%}
{{ raise_exception('the last message is the assistant\'s') }}
  {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
<|im_start|>assistant
{% if enable_thinking is defined and enable_thinking is false %}<think>

</think>

{% endif -%}
{%- endif -%}
"""

MESSAGES = [
    {"role": "system", "content": "Be <brief> & kind, café"},
    {"role": "user", "content": "Hi 你好"},
    {"role": "assistant", "content": "<think>\nfirst thought\n</think>\n\nHello!"},
    {"role": "user", "content": [{"type": "text", "text": "a <b> é & 'q'"}]},
]
LATER = [
    {"role": "user", "content": "2 + 2?"},
    {
        "role": "assistant",
        "content": "<think>\nadd them\n</think>\n\n4",
        "tool_calls": [{"name": "f", "args": {"x": 1}}],
    },
    {"role": "tool", "content": '{"y": "é<>"}'},
]
TOOLS = [{"type": "function", "function": {"name": "f<x>", "description": "é & b", "parameters": {"z": 1, "a": 2}}}]


def _directory(path: Path) -> Path:
    save_tokenizer(path)
    (path / "chat_template.jinja").write_text(TEMPLATE)
    return path


def _reference(path: Path):
    import transformers.utils.logging as hf_logging

    hf_logging.set_verbosity_error()
    return transformers.AutoTokenizer.from_pretrained(path)


@pytest.mark.parametrize("messages", [MESSAGES, MESSAGES[1:2], MESSAGES[:2] + LATER, LATER[:1]])
@pytest.mark.parametrize(
    "kwargs",
    [
        {},
        {"enable_thinking": False},
        {"enable_thinking": True},
        {"tools": TOOLS},
        {"tools": TOOLS, "enable_thinking": False},
    ],
)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_render_chat_is_transformers_apply_chat_template(tmp_path, messages, kwargs, add_generation_prompt):
    """The same text as transformers 5.25: with enable_thinking false the empty think block
    (kvpool could not pass the variable); tojson plain JSON with keys in order and "é<>&"
    kept (jinja2's own tojson sorted the keys and escaped them: "\\u00e9\\u003c...")."""
    path = _directory(tmp_path / "t")
    ref, tok = _reference(path), load_hf_tokenizer(path)
    if add_generation_prompt and messages[-1]["role"] == "assistant":
        pytest.skip("the template refuses it (the raise_exception test)")
    want = ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs)
    got = tok.render_chat(messages, add_generation_prompt=add_generation_prompt, template_kwargs=kwargs)
    assert got == want
    if kwargs.get("enable_thinking") is False and add_generation_prompt:
        assert got.endswith("<think>\n\n</think>\n\n")  # (the premise)
    assert (
        tok.encode_rendered(got)
        == ref.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, **kwargs)["input_ids"]
    )


def test_the_templates_raise_exception_is_one_line_as_transformers_refuses(tmp_path):
    path = _directory(tmp_path / "t")
    ref, tok = _reference(path), load_hf_tokenizer(path)
    for messages, words in (
        ([{"role": "robot", "content": "x"}], "no role robot at message 0"),
        (MESSAGES[1:3], "the last message is the assistant's"),
    ):
        with pytest.raises(Exception, match=words):
            ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        with pytest.raises(ValueError, match=f"^the chat template refused the messages: {words}$"):
            tok.render_chat(messages)
    with pytest.raises(ValueError, match="chat_template_kwargs: 'messages' is the request's own"):
        tok.render_chat(MESSAGES[1:2], template_kwargs={"messages": []})


def test_llm_chat_passes_chat_template_kwargs(tmp_path):
    from test_hf_spm import _llama_weights

    path = _directory(tmp_path / "m")
    _llama_weights(path)
    save_tokenizer(path)  # (the tiny byte-level vocabulary: a smaller one than the weights' is fine)
    (path / "chat_template.jinja").write_text(TEMPLATE)
    ref = _reference(path)
    llm = kvpool.LLM(str(path))
    params = kvpool.SamplingParams(max_tokens=1)
    for kwargs in ({}, {"enable_thinking": False}):
        out = llm.chat(MESSAGES[1:2], params, chat_template_kwargs=kwargs)[0]
        want = ref.apply_chat_template(MESSAGES[1:2], add_generation_prompt=True, **kwargs)["input_ids"]
        assert out.prompt_token_ids == want
    with pytest.raises(TypeError, match="chat_template_kwargs is a list; give a dict of name: value"):
        llm.chat(MESSAGES[1:2], params, chat_template_kwargs=[("enable_thinking", False)])


def test_llm_chat_leaves_out_the_keys_set_to_none_as_transformers(tmp_path):
    """transformers 5.25's apply_chat_template drops a message's keys whose value is None (an
    OpenAI message's tool_calls=None): LLM.chat passed them, and `is defined` saw them set."""
    path = tmp_path / "m"
    save_tokenizer(path)
    template = (
        "{% for m in messages %}{{ m.role }}{% if m.tool_calls is defined %}[calls]{% endif %}"
        "{% if m.name is defined %}[{{ m.name }}]{% endif %}: {{ m.content }}\n{% endfor %}"
    )
    (path / "chat_template.jinja").write_text(template)
    messages = [
        {"role": "system", "content": "s", "name": "x"},
        {"role": "user", "content": "hi", "name": None},
        {"role": "assistant", "content": "ok", "tool_calls": None},
        {"role": "user", "content": "and?"},
    ]
    want = _reference(path).apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert want == "system[x]: s\nuser: hi\nassistant: ok\nuser: and?\n"  # (the premise)
    llm = kvpool.LLM.__new__(kvpool.LLM)  # (its tokenizer alone: the prompts it would run are returned)
    llm.tokenizer = load_hf_tokenizer(path)
    llm._run = lambda encoded, params: encoded
    ((text, ids),) = llm.chat(messages)
    assert text == want and ids == llm.tokenizer.encode_rendered(want)
    assert messages[1]["name"] is None  # (the caller's messages as they were)


def test_serve_takes_chat_template_kwargs_through_extra_body(tmp_path):
    """/v1/chat/completions' chat_template_kwargs (vLLM's name): it was ignored (the request
    model drops unknown fields), so enable_thinking false rendered the thinking prompt. A dict
    of JSON values; anything else, or a variable the request sets itself, a 400 naming it."""
    openai = pytest.importorskip("openai")
    from test_hf_spm import _llama_weights

    path = tmp_path / "m"
    _llama_weights(path)
    _directory(path)
    ref = _reference(path)
    with served("--model", str(path), "--kv-memory", "4MiB") as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", timeout=60, max_retries=0)
        messages = MESSAGES[1:2]
        for kwargs in ({}, {"enable_thinking": False}, {"enable_thinking": True, "unused": [1, {"a": None}]}):
            body = {"chat_template_kwargs": kwargs} if kwargs else {}
            reply = client.chat.completions.create(model="m", messages=messages, max_tokens=1, extra_body=body)
            want = ref.apply_chat_template(messages, add_generation_prompt=True, **kwargs)["input_ids"]
            assert reply.usage.prompt_tokens == len(want), kwargs
        thinking_off = ref.apply_chat_template(messages, add_generation_prompt=True, enable_thinking=False)
        assert len(thinking_off["input_ids"]) > len(
            ref.apply_chat_template(messages, add_generation_prompt=True)["input_ids"]
        )
        for bad, words in (
            ([1], "chat_template_kwargs"),
            ("enable_thinking", "chat_template_kwargs"),
            ({"messages": []}, "chat_template_kwargs: 'messages' is the request's own"),
            ({"add_generation_prompt": False}, "chat_template_kwargs: 'add_generation_prompt' is the request's own"),
        ):
            with pytest.raises(openai.BadRequestError) as info:
                client.chat.completions.create(
                    model="m", messages=messages, max_tokens=1, extra_body={"chat_template_kwargs": bad}
                )
            assert words in str(info.value) and "\n" not in info.value.body["message"], info.value.body


UNSET = (
    "{{ bos_token }}[{{ no_such_name }}|{{ date_string }}]{% if documents %}docs{% endif %}"
    "{% if not custom_tools %}no tools{% endif %}{% for m in messages %}{{ m.content }}{{ m.name }}{% endfor %}"
)


def test_an_unset_name_renders_as_transformers_renders_it(tmp_path):
    """A template naming a variable nobody passes (a Command-R-style `documents`, a message's
    `name`) renders it as jinja's Undefined, '' and false, as transformers does: kvpool's strict
    undefined refused such a chat that transformers and llama.cpp render."""
    path = tmp_path / "u"
    save_tokenizer(path)
    (path / "chat_template.jinja").write_text(UNSET)
    ref, tok = _reference(path), load_hf_tokenizer(path)
    messages = MESSAGES[1:2]
    want = ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert tok.render_chat(messages) == want
    assert want.endswith("[|]no toolsHi 你好")  # (the premise: every unset name printed nothing)
    # an attribute of an unset name is an error in both
    (path / "chat_template.jinja").write_text("{{ no_such_name.first }}")
    ref, tok = _reference(path), load_hf_tokenizer(path)
    with pytest.raises(Exception, match="'no_such_name' is undefined"):
        ref.apply_chat_template(messages, tokenize=False)
    with pytest.raises(ValueError, match="^the chat template refused the messages: 'no_such_name' is undefined$"):
        tok.render_chat(messages)
