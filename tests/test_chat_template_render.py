"""How render_chat treats what a chat template does beyond plain jinja: an exception its
rendering raises is one ValueError line for every caller (kvpool generate, LLM.chat, serve's
400); transformers' {% generation %} tag renders as transformers renders it."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace

import pytest

import kvpool
from hf_tiny import save_tokenizer
from kvpool.cli.main import main
from kvpool.models.hf_tokenizer import load_hf_tokenizer

HI = [{"role": "user", "content": "hi"}]

# templates whose rendering raises what is neither jinja's TemplateError nor a TypeError (a
# ValueError from a bad format spec passed through without saying it was the template's)
RAISING = [
    ("{{ 1 / 0 }}", "ZeroDivisionError: division by zero"),
    ("{% for i in range(10**9) %}x{% endfor %}", "OverflowError: Range too big"),
    ("{{ '{:q}'.format(1) }}", "ValueError: Unknown format code 'q'"),
]


def _directory(path: Path, template: str) -> Path:
    save_tokenizer(path)
    (path / "chat_template.jinja").write_text(template)
    return path


@pytest.mark.parametrize(("template", "words"), RAISING)
def test_an_exception_the_template_raises_is_one_value_error_line(tmp_path, template, words):
    """{{ 1/0 }} (ZeroDivisionError) and the sandbox's range limit (OverflowError) escaped
    render_chat, which caught jinja's TemplateError and TypeError alone: a traceback from
    kvpool generate and LLM.chat."""
    tok = load_hf_tokenizer(_directory(tmp_path / "t", template))
    with pytest.raises(ValueError) as info:
        tok.render_chat(HI)
    line = str(info.value)
    assert line.startswith(f"the chat template refused the messages: {words}") and "\n" not in line, line


def test_each_caller_says_the_same_line(tmp_path, capsys):
    """kvpool generate (exit 2, one line, no traceback), LLM.chat (the ValueError) and serve
    (a 400 naming messages) all report the template's ZeroDivisionError in render_chat's words."""
    from kvpool.server.app import ServerState, build_app
    from kvpool.server.metrics import ServerMetrics
    from test_hf_spm import _llama_weights

    path = tmp_path / "m"
    _llama_weights(path)
    _directory(path, "{{ 1 / 0 }}")  # (the tiny byte-level vocabulary: a smaller one than the weights' is fine)
    want = "the chat template refused the messages: ZeroDivisionError: division by zero"
    capsys.readouterr()
    assert main(["generate", "hi", "--model", str(path), "--max-tokens", "1"]) == 2
    err = capsys.readouterr().err
    assert err == f"kvpool generate: error: {want}\n", err
    llm = kvpool.LLM.__new__(kvpool.LLM)  # (its tokenizer alone: the chat fails before it would run)
    llm.tokenizer = load_hf_tokenizer(path)
    with pytest.raises(ValueError) as info:
        llm.chat(HI)
    assert str(info.value) == want
    # serve: the chat is rendered before the engine is asked for anything (none is given)
    engine = SimpleNamespace(stopping=False)  # (what reading the body asks of it)
    state = ServerState(engine, llm.tokenizer, ServerMetrics("m"), "m", 2048)  # type: ignore[arg-type]

    async def post():
        import httpx

        transport = httpx.ASGITransport(app=build_app(state))
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=30) as client:
            return await client.post("/v1/chat/completions", json={"model": "m", "messages": HI, "max_tokens": 1})

    reply = asyncio.run(post())
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["message"] == f"messages: {want}" and error["param"] == "messages", error


# a template trained with assistant-token masks: the assistant's turns inside {% generation %}
GENERATION = """{%- for m in messages -%}
<|im_start|>{{ m.role }}
{% if m.role == 'assistant' -%}
  {%- generation -%}
{{ m.content }}<|im_end|>
  {%- endgeneration %}

{% else -%}
{{ m.content }}<|im_end|>
{% endif -%}
{%- endfor -%}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif -%}
{% generation %}{% set inside = 'set within' %}{{ inside }}{% endgeneration %}[{{ inside }}]
{%- for m in messages %}{% generation %}{% if loop.last %}({{ loop.length }}){% endif %}{% endgeneration %}
{%- endfor %}"""

CHAT = [
    {"role": "system", "content": "Be brief"},
    {"role": "user", "content": "Hi 你好"},
    {"role": "assistant", "content": "Hello <b> & 'q'"},
    {"role": "user", "content": "and?"},
]


@pytest.mark.parametrize("messages", [CHAT, CHAT[:3], CHAT[1:2]])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_the_generation_tag_renders_its_body_as_transformers(tmp_path, messages, add_generation_prompt):
    """transformers' apply_chat_template knows {% generation %}...{% endgeneration %} (it marks
    the assistant's tokens for return_assistant_tokens_mask): kvpool refused it, 'Encountered
    unknown tag'. Its body renders unchanged, whitespace control and trim_blocks as any tag's,
    a {% set %} within it unseen after it, loop variables seen within it."""
    from test_chat_template_features import _reference

    path = _directory(tmp_path / "t", GENERATION)
    ref, tok = _reference(path), load_hf_tokenizer(path)
    want = ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert tok.render_chat(messages, add_generation_prompt=add_generation_prompt) == want
    assert f"set within[]({len(messages)})" in want  # (the premises: the scope, the loop)
    if messages is CHAT:
        assert "assistant\nHello <b> & 'q'<|im_end|>\n<|im_start|>user" in want
        marked = ref.apply_chat_template(messages, return_dict=True, return_assistant_tokens_mask=True)
        assert any(marked["assistant_masks"])  # (the premise: transformers reads the tag)


def test_a_generation_tag_misused_is_one_line(tmp_path):
    """An argument, a missing end: jinja's syntax error; a {% break %} in the body (transformers:
    Python's SyntaxError from the compiled template, its body being a macro) was a traceback."""
    for template, words in (
        ("{% generation x %}a{% endgeneration %}", r"\(line 1\): expected token 'end of statement"),
        ("{% generation %}a", r"\(line 1\): Unexpected end of template"),
        ("{% for m in messages %}{% generation %}{% break %}{% endgeneration %}{% endfor %}", "'break' outside loop"),
        ("{% for m in messages %}{% macro f() %}{% continue %}{% endmacro %}{% endfor %}", "'continue' not properly"),
    ):
        tok = load_hf_tokenizer(_directory(tmp_path / "t", template))
        with pytest.raises(ValueError, match=f"chat_template.jinja's chat template is not valid jinja.*{words}") as e:
            tok.render_chat(HI)
        assert "\n" not in str(e.value)


NAMED = (
    "{% for m in messages %}{{ m.role }}{% if m.tool_calls is defined %}[calls]{% endif %}"
    "{% if m.name is defined %}[{{ m.name }}]{% endif %}<{{ m.name }}>: {{ m.content }}\n{% endfor %}"
)


def test_render_chat_leaves_out_the_keys_set_to_none_as_transformers(tmp_path):
    """transformers 5.25's apply_chat_template drops a message's keys whose value is None (an
    OpenAI message's name=None, tool_calls=None): LLM.chat alone dropped them, render_chat's
    other callers passed them on ('user[None]<None>: hi'). The caller's messages are unchanged."""
    from test_chat_template_features import _reference

    path = _directory(tmp_path / "t", NAMED)
    messages = [
        {"role": "system", "content": "s", "name": "x"},
        {"role": "user", "content": "hi", "name": None},
        {"role": "assistant", "content": "ok", "tool_calls": None},
    ]
    want = _reference(path).apply_chat_template(messages, tokenize=False)
    assert want == "system[x]<x>: s\nuser<>: hi\nassistant<>: ok\n"  # (the premise)
    tok = load_hf_tokenizer(path)
    assert tok.render_chat(messages) == want
    assert messages[1] == {"role": "user", "content": "hi", "name": None}  # (as they were)
    llm = kvpool.LLM.__new__(kvpool.LLM)  # (its tokenizer alone: the prompts it would run are returned)
    llm.tokenizer = tok
    llm._run = lambda encoded, params: encoded
    assert llm.chat(messages) == [(want, tok.encode_rendered(want))]
