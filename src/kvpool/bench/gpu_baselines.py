"""What `kvpool bench gpu` sets beside the engine, on the same random weights
(models/hf_config.py `random_tensors`):

- transformers' LlamaForCausalLM (`transformers_llama`), decoding with its own KV cache
  (`transformers_tpot`: its forward, one token a sequence, over its DynamicCache);
- a plain torch forward over a contiguous KV cache (`ContiguousLlama`: transformers' own
  parameters, no paging, no scheduler), its decode step replayed as a CUDA graph on CUDA
  and run eagerly on the CPU (`plain_tpot`), and its prefill (`plain_prefill_s`).

Both are references for the engine's speed and numerics, not for its cache: the plain
forward is what a decode step costs with nothing around it (the issue's "plain torch
forward replayed as a CUDA graph").
"""

from __future__ import annotations

import statistics
import time
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from kvpool.models.gguf import LlamaConfig
from kvpool.models.hf_config import hf_tensor_name, random_tensors
from kvpool.models.rope import inv_freq

if TYPE_CHECKING:
    from transformers import LlamaForCausalLM


def transformers_llama(config: LlamaConfig, seed: int, dtype: torch.dtype, device: str) -> LlamaForCausalLM:
    """transformers' LlamaForCausalLM (Qwen2ForCausalLM for a config with Q / K / V biases,
    Qwen3ForCausalLM for one with q / k norms) of
    `config` holding `random_tensors(config, seed)`: the weights `random_llama(config, seed)`
    holds, in transformers' names, and the engine's RoPE: rotate-half with rope_theta, its
    frequencies divided by the config's rope_freq_divisors (a Llama 3.1 config's llama3
    scaling, models/rope.py)."""
    import transformers

    c = config
    config_class, model_class = (
        (transformers.Qwen2Config, transformers.Qwen2ForCausalLM)
        if c.qkv_bias
        else (transformers.Qwen3Config, transformers.Qwen3ForCausalLM)
        if c.qk_norm
        else (transformers.LlamaConfig, transformers.LlamaForCausalLM)
    )
    hf_config = config_class(
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_layers,
        num_attention_heads=c.num_heads,
        num_key_value_heads=c.num_kv_heads,
        head_dim=c.head_dim,
        vocab_size=c.vocab_size,
        max_position_embeddings=c.max_position,
        rms_norm_eps=c.rms_norm_eps,
        rope_theta=c.rope_theta,
        tie_word_embeddings=c.tie_embeddings,
    )
    with torch.device("meta"):  # no random init of tensors that are loaded next
        model = model_class(hf_config)
    state = {hf_tensor_name(n): t for n, t in random_tensors(c, seed, dtype, device)}
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    if unexpected or set(missing) - {"lm_head.weight"}:
        raise ValueError(f"transformers' Llama did not take the random weights: {unexpected} {missing}")
    if c.tie_embeddings:
        model.tie_weights()
    # buffers made on the meta device (the RoPE frequencies) are made again on the real one
    model.model.rotary_emb = type(model.model.rotary_emb)(model.config).to(device)
    if c.rope_freq_divisors is not None:  # (transformers' fp32 frequencies, as its own for plain RoPE)
        model.model.rotary_emb.inv_freq = inv_freq(c.head_dim, c.rope_theta, c.rope_freq_divisors).float().to(device)
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise ValueError(f"transformers' Llama has tensors with no values: {left}")
    return model.eval()


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


@torch.inference_mode()
def transformers_tpot(model: LlamaForCausalLM, prompts: torch.Tensor, new_tokens: int) -> dict:
    """Greedy decoding of `prompts` [B, P] int64 by `model` with its own KV cache: the
    prompt's forward, then new_tokens - 1 forwards of one token a sequence over the cache,
    each timed (the greedy token's argmax and the device's synchronisation included, as the
    engine's step samples and synchronises). Median seconds per output token."""
    import inspect

    device = prompts.device.type
    # the cache's argument and output: `cache` from transformers 5.2x, `past_key_values` before
    name = "cache" if "cache" in inspect.signature(type(model).forward).parameters else "past_key_values"
    out = model(prompts, use_cache=True, logits_to_keep=1)
    past, ids = getattr(out, name), out.logits[:, -1].argmax(-1, keepdim=True)
    times = []
    for _ in range(new_tokens - 1):
        _sync(device)
        began = time.perf_counter()
        out = model(ids, use_cache=True, **{name: past})
        past, ids = getattr(out, name), out.logits[:, -1].argmax(-1, keepdim=True)
        _sync(device)
        times.append(time.perf_counter() - began)
    return {"tpot_s": statistics.median(times), "decode_steps": len(times)}


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm: the statistics in fp32, the product in the input's dtype."""
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


class ContiguousLlama:
    """transformers' Llama (`model`'s parameters, not copied) in plain torch ops over a
    contiguous KV cache k / v [layers, B, KVH, max_len, D] of `batch` sequences: `prefill`
    fills positions [0, T) of every sequence, `decode` appends one token a sequence at
    position `pos` reading its inputs from static tensors (`ids` [B] int64, `pos` [] int64),
    so the step has stable addresses and no host read, and can be captured as a CUDA graph.
    A decode attends over the whole cache width (max_len) with a mask of the positions
    beyond `pos`: one shape for every step, which a graph needs; the cache holds exactly the
    prompt and the new tokens, so it reads at most that."""

    def __init__(self, model: LlamaForCausalLM, batch: int, max_len: int) -> None:
        c = model.config
        p = model.model
        self.eps = c.rms_norm_eps
        self.num_heads, self.num_kv_heads = c.num_attention_heads, c.num_key_value_heads
        self.head_dim = c.head_dim
        self.embed, self.norm, self.lm_head = p.embed_tokens.weight, p.norm.weight, model.lm_head.weight
        # a Qwen2's Q / K / V biases (None on a Llama: nothing added)
        self.biases = [tuple(getattr(layer.self_attn, f"{x}_proj").bias for x in "qkv") for layer in p.layers]
        # a Qwen3's q / k norm weights [D] (None elsewhere: nothing normed)
        self.qk_norms = [
            (a.q_norm.weight, a.k_norm.weight) if hasattr(a, "q_norm") else None
            for a in (layer.self_attn for layer in p.layers)
        ]
        self.layers = [
            {
                "q": layer.self_attn.q_proj.weight,
                "k": layer.self_attn.k_proj.weight,
                "v": layer.self_attn.v_proj.weight,
                "o": layer.self_attn.o_proj.weight,
                "gate": layer.mlp.gate_proj.weight,
                "up": layer.mlp.up_proj.weight,
                "down": layer.mlp.down_proj.weight,
                "attn_norm": layer.input_layernorm.weight,
                "ffn_norm": layer.post_attention_layernorm.weight,
            }
            for layer in p.layers
        ]
        dtype, device = self.embed.dtype, self.embed.device
        shape = (len(self.layers), batch, self.num_kv_heads, max_len, self.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        # transformers' RoPE tables (fp32 math), positions [0, max_len): [max_len, D]
        positions = torch.arange(max_len, device=device)[None]
        cos, sin = p.rotary_emb(torch.zeros(1, dtype=dtype, device=device), positions)
        self.cos, self.sin = cos[0], sin[0]
        self.slots = torch.arange(max_len, device=device)  # [max_len]: the decode's mask
        self.ids = torch.zeros(batch, dtype=torch.long, device=device)
        self.pos = torch.zeros((), dtype=torch.long, device=device)

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [B, heads, T, D]; cos / sin [T, D]: x * cos + rotate_half(x) * sin."""
        x1, x2 = x.chunk(2, dim=-1)
        return x * cos + torch.cat((-x2, x1), dim=-1) * sin

    def _layers(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend) -> torch.Tensor:
        """x [B, T, hidden] through every layer; attend(i, q [B, H, T, D], k / v [B, KVH, T, D])."""
        b, t, _ = x.shape
        h, kvh, d = self.num_heads, self.num_kv_heads, self.head_dim
        for i, w in enumerate(self.layers):
            hs = _rms_norm(x, w["attn_norm"], self.eps)
            q, k, v = (hs @ w[x].t() for x in "qkv")
            if self.biases[i][0] is not None:
                q, k, v = (y + bias for y, bias in zip((q, k, v), self.biases[i], strict=True))
            q, k = q.view(b, t, h, d), k.view(b, t, kvh, d)
            if self.qk_norms[i] is not None:
                q, k = (_rms_norm(y, weight, self.eps) for y, weight in zip((q, k), self.qk_norms[i], strict=True))
            q = self._rope(q.transpose(1, 2), cos, sin)
            k = self._rope(k.transpose(1, 2), cos, sin)
            v = v.view(b, t, kvh, d).transpose(1, 2)
            attn = attend(i, q, k, v)  # [B, H, T, D]
            x = x + attn.transpose(1, 2).reshape(b, t, h * d) @ w["o"].t()
            hs = _rms_norm(x, w["ffn_norm"], self.eps)
            x = x + (F.silu(hs @ w["gate"].t()) * (hs @ w["up"].t())) @ w["down"].t()
        return _rms_norm(x, self.norm, self.eps)

    @torch.inference_mode()
    def prefill(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [B, T] int64 at positions [0, T) -> the last position's logits [B, vocab] fp32."""
        t = ids.shape[1]

        group = self.num_heads // self.num_kv_heads

        def attend(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            self.k[i, :, :, :t] = k
            self.v[i, :, :, :t] = v
            # K / V repeated to the query heads (transformers' repeat_kv): causal SDPA with no
            # mask and equal heads runs a flash kernel on any torch, where enable_gqa may not
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

        x = self._layers(self.embed[ids], self.cos[:t], self.sin[:t], attend)
        return (x[:, -1] @ self.lm_head.t()).float()

    @torch.inference_mode()
    def decode(self) -> torch.Tensor:
        """One token a sequence, `ids` at position `pos` -> logits [B, vocab] fp32."""
        pos = self.pos.view(1)
        cos, sin = self.cos.index_select(0, pos), self.sin.index_select(0, pos)
        visible = (self.slots <= self.pos).view(1, 1, 1, -1)  # [1, 1, 1, max_len]

        b, h, kvh, d = self.ids.shape[0], self.num_heads, self.num_kv_heads, self.head_dim

        def attend(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            k_cache, v_cache = self.k[i], self.v[i]
            k_cache.index_copy_(2, pos, k)
            v_cache.index_copy_(2, pos, v)
            # a KV head's query group as its rows: q [B, KVH, G, D] over its K / V, the mask
            # broadcast over the rows (query head j reads KV head j // G, as repeat_kv has it);
            # no enable_gqa, which with a mask may fall back to the math kernel
            grouped = q.reshape(b, kvh, h // kvh, d)
            out = F.scaled_dot_product_attention(grouped, k_cache, v_cache, attn_mask=visible)
            return out.view(b, h, 1, d)

        x = self._layers(self.embed[self.ids].unsqueeze(1), cos, sin, attend)
        return (x[:, 0] @ self.lm_head.t()).float()


@torch.inference_mode()
def plain_tpot(model: LlamaForCausalLM, prompts: torch.Tensor, new_tokens: int) -> dict:
    """Greedy decoding of `prompts` [B, P] by `ContiguousLlama` over `model`'s parameters:
    the prefill, then new_tokens - 1 decode steps, each timed (the greedy argmax into the
    static input and the device's synchronisation included). On CUDA the decode step is
    captured once as a CUDA graph (after two eager warm-ups on a side stream) and replayed;
    on the CPU it runs eagerly (`decode`: "eager (CPU)"). Median seconds per output token."""
    device = prompts.device.type
    b, p = prompts.shape
    plain = ContiguousLlama(model, b, p + new_tokens)
    plain.ids.copy_(plain.prefill(prompts).argmax(-1))
    plain.pos.fill_(p)
    step = plain.decode
    if device == "cuda":
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):  # warm-ups rewrite position p only, which the first replay writes again
                plain.decode()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            logits = plain.decode()

        def step() -> torch.Tensor:
            graph.replay()
            return logits

    times = []
    for i in range(new_tokens - 1):
        _sync(device)
        began = time.perf_counter()
        plain.ids.copy_(step().argmax(-1))
        plain.pos.fill_(p + 1 + i)
        _sync(device)
        times.append(time.perf_counter() - began)
    return {
        "tpot_s": statistics.median(times),
        "decode_steps": len(times),
        "decode": "cuda graph" if device == "cuda" else "eager (CPU)",
    }


@torch.inference_mode()
def plain_prefill_s(model: LlamaForCausalLM, prompt_len: int, runs: int = 3, seed: int = 0) -> float:
    """Median seconds of `ContiguousLlama`'s prefill of one `prompt_len`-token prompt (a new
    random prompt each run, after one warm-up), its last position's logits included."""
    device = model.model.embed_tokens.weight.device
    plain = ContiguousLlama(model, 1, prompt_len)
    g = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    times = []
    for i in range(runs + 1):
        ids = torch.randint(0, vocab, (1, prompt_len), generator=g).to(device)
        _sync(device.type)
        began = time.perf_counter()
        plain.prefill(ids)
        _sync(device.type)
        if i:
            times.append(time.perf_counter() - began)
    return statistics.median(times)
