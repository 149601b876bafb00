"""What a KV storage format costs in quality (kvpool.storage.quant), measured on a model and
a text: per layer, and end to end.

Per layer (isolated): the layer's own fp32 queries, keys and values of the reference run;
the relative error (Frobenius norm) of K and of V after the format's round trip, and of the
attention output computed over them against the output over the fp32 K and V. Each layer
is measured on exact inputs, so one layer's figure does not carry the others' errors.

End to end: the whole text through the model with every layer reading its K and V through
the round trip (what the paged path reads from the stored bytes, tests/test_kv_quant.py),
teacher-forced: the perplexity of the text, the mean KL divergence KL(p_fp32 || p_format)
of the next-token distributions, and the share of positions whose most likely next token is
the fp32 run's (top-1 agreement). Plus each format's bytes per token and the tokens a GiB
of KV holds against fp32.

Greedy decoding (`greedy_agreement`): the engine itself, paged blocks in the format, decodes
a fixed number of tokens greedily after a prompt; the share of steps whose token is the
fp32 engine's token at the same step, and the first step that differs. Once one token
differs the continuations part, so this is the strictest of the figures.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from kvpool.attention.reference import causal_attention
from kvpool.models.llama import LlamaModel
from kvpool.storage.quant import KVSchema, kv_schema, round_trip_kv

_CHUNK = 128  # positions whose logits are held at once (vocab-wide rows)


@dataclass(frozen=True)
class LayerError:
    k_rel: float
    v_rel: float
    out_rel: float


@dataclass(frozen=True)
class FormatQuality:
    name: str
    bytes_per_token: float  # scales amortized over the block
    tokens_per_gib: int
    capacity_gain: float  # tokens per GiB against fp32
    perplexity: float
    perplexity_change_pct: float
    kl_mean: float
    top1_agreement: float
    layers: list[LayerError]
    greedy_agreement: float | None = None  # share of greedy decode steps whose token is fp32's
    greedy_first_divergence: int | None = None  # the first step that differs (None: none did)

    def as_dict(self) -> dict[str, object]:
        out = asdict(self)
        out["layers"] = [asdict(layer) for layer in self.layers]
        return out


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _run(model: LlamaModel, ids: torch.Tensor, attend) -> torch.Tensor:
    return model.forward(ids, torch.arange(ids.shape[0]), attend, fused=False)


def _log_probs(model: LlamaModel, hidden: torch.Tensor, start: int) -> torch.Tensor:
    """log-softmax of the next-token logits at positions [start, start + _CHUNK): [n, vocab]."""
    return F.log_softmax(model.logits(hidden[start : start + _CHUNK]), dim=-1)


def _through(fmt: KVSchema, block_size: int):
    """An attend that reads K and V as the paged storage holds them after one step."""
    return lambda layer, q, k, v: causal_attention(q, *round_trip_kv(fmt, k, v, block_size))


def evaluate(
    model: LlamaModel,
    token_ids: Sequence[int],
    formats: Sequence[str],
    progress: Callable[[str], None] | None = None,
    block_size: int = 128,
) -> tuple[float, list[FormatQuality]]:
    """(the fp32 perplexity of the text, each format's quality) with KV blocks of
    `block_size` tokens (the block formats' scale group, KIVI's chunks within it).
    ValueError for an unknown format, a format the block size does not fit, or a text of
    fewer than two tokens."""
    if len(token_ids) < 2:
        raise ValueError(f"the text must have at least 2 tokens, got {len(token_ids)}")
    fmts = [kv_schema(name) for name in formats]
    for fmt in fmts:
        fmt.check(block_size, model.config.head_dim)
    ids = torch.tensor(list(token_ids), dtype=torch.long, device=model.device)
    targets = ids[1:]
    cfg = model.config
    captured: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []

    def exact(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        captured.append((q.clone(), k.clone(), v.clone()))
        return causal_attention(q, k, v)

    hidden_ref = _run(model, ids, exact)
    n = ids.shape[0] - 1  # positions with a next token
    fp32_bytes = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 4
    nll_ref = 0.0
    for start in range(0, n, _CHUNK):
        lp = _log_probs(model, hidden_ref, start)[: n - start]
        nll_ref -= float(lp.gather(1, targets[start : start + lp.shape[0]].unsqueeze(1)).sum())
    ppl_ref = math.exp(nll_ref / n)
    results = []
    for fmt in fmts:
        if progress is not None:
            progress(fmt.name)
        layers = []
        for q, k, v in captured:
            kq, vq = round_trip_kv(fmt, k, v, block_size)
            out_ref = causal_attention(q, k, v)
            layers.append(LayerError(_rel(kq, k), _rel(vq, v), _rel(causal_attention(q, kq, vq), out_ref)))
        hidden = _run(model, ids, _through(fmt, block_size))
        nll = kl = 0.0
        agree = 0
        for start in range(0, n, _CHUNK):
            lp_ref = _log_probs(model, hidden_ref, start)[: n - start]
            lp = _log_probs(model, hidden, start)[: n - start]
            nll -= float(lp.gather(1, targets[start : start + lp.shape[0]].unsqueeze(1)).sum())
            kl += float((lp_ref.exp() * (lp_ref - lp)).sum())
            agree += int((lp.argmax(-1) == lp_ref.argmax(-1)).sum())
        ppl = math.exp(nll / n)
        per_token = cfg.num_layers * cfg.num_kv_heads * fmt.bytes_per_token_head(block_size, cfg.head_dim)
        results.append(
            FormatQuality(
                fmt.name,
                per_token,
                int((1 << 30) // per_token),
                round(fp32_bytes / per_token, 3),
                ppl,
                100 * (ppl / ppl_ref - 1),
                kl / n,
                agree / n,
                layers,
            )
        )
    return ppl_ref, results


def greedy_agreement(
    model: LlamaModel, prompt: Sequence[int], formats: Sequence[str], steps: int, block_size: int
) -> dict[str, tuple[float, int | None]]:
    """Per format: (the share of `steps` greedy tokens equal to the fp32 engine's at the same
    step, the first step that differs or None), decoded by the engine over paged blocks."""
    from kvpool.cache import CacheDescriptor
    from kvpool.engine.engine import Engine
    from kvpool.engine.llama_runner import LlamaRunner
    from kvpool.engine.sampling import SamplingParams

    num_blocks = -(-(len(prompt) + steps) // block_size) + 1

    def decode(name: str | None) -> list[int]:
        descriptor = CacheDescriptor("eval-kv-quant", layout_id=f"bs{block_size}:{name}")
        runner = LlamaRunner(model, num_blocks, block_size, descriptor, kv_format=name, enable_prefix_caching=False)
        engine = Engine(runner, max_num_batched_tokens=max(len(prompt), 1), max_num_seqs=1)
        rid = engine.add_request(list(prompt), SamplingParams(max_tokens=steps, ignore_eos=True))
        while engine.has_unfinished():
            engine.step()
        return list(engine.pop_output(rid).completions[0].token_ids)

    reference = decode(None)
    out: dict[str, tuple[float, int | None]] = {}
    for name in formats:
        got = decode(name)
        same = [a == b for a, b in zip(got, reference, strict=True)]
        out[name] = (sum(same) / steps, next((i for i, s in enumerate(same) if not s), None))
    return out


@dataclass(frozen=True)
class V4LayoutQuality:
    name: str  # "exact", "fp8 / fp8 keys", "fp8 / mxfp4 keys"
    classical_block_bytes: int
    classical_bytes_per_token: float
    capacity_gain: float  # classical tokens per byte against the exact layout
    kl_mean: float
    top1_agreement: float
    greedy_agreement: float
    greedy_first_divergence: int | None


def evaluate_v4(
    seed: int = 0, prompt_len: int = 512, steps: int = 32, progress: Callable[[str], None] | None = None
) -> list[V4LayoutQuality]:
    """tiny-dsv4 (fp32, weights of `seed`) with its classical pool exact and in V4's fp8
    layout (FP8 / MXFP4 indexer keys). A random prompt of `prompt_len` ids; the exact
    engine's greedy continuation of `steps` tokens is the path. Teacher-forced: for each
    step i, the next-token distribution after prompt + path[:i], from a request that hits
    the cached prefix (its spans read from the classical pool in the layout, its state
    recomputed over them); KL(exact || layout) and top-1 agreement over the steps. Greedy:
    each layout's own continuation against the path."""
    import random

    from kvpool.engine.dsv4_runner import DSV4EngineRunner
    from kvpool.engine.engine import Engine
    from kvpool.engine.sampling import SamplingParams
    from kvpool.models.tiny_dsv4 import TinyDSV4

    if prompt_len < 1 or steps < 1:
        raise ValueError(f"need a prompt and steps, got {prompt_len}, {steps}")
    model = TinyDSV4(seed=seed)
    rng = random.Random(seed)
    prompt = [rng.randrange(model.vocab_size) for _ in range(prompt_len)]
    span = model.spec.span
    num_blocks = (prompt_len + steps) // span + 4
    layouts = [("exact", "exact", "fp8"), ("fp8 / fp8 keys", "fp8", "fp8"), ("fp8 / mxfp4 keys", "fp8", "mxfp4")]

    def engine(kv_format: str, indexer_format: str) -> Engine:
        runner = DSV4EngineRunner(model, num_blocks, 2, kv_format=kv_format, indexer_format=indexer_format)
        return Engine(runner, max_num_batched_tokens=256, max_num_seqs=1, record_logits=True)

    def greedy(e: Engine) -> list[int]:
        rid = e.add_request(prompt, SamplingParams(max_tokens=steps, ignore_eos=True))
        while e.has_unfinished():
            e.step()
        return list(e.pop_output(rid).completions[0].token_ids)

    path = greedy(engine("exact", "fp8"))
    results: list[V4LayoutQuality] = []
    reference: list[torch.Tensor] = []
    exact_bytes = 0
    for name, kv_format, indexer_format in layouts:
        if progress is not None:
            progress(name)
        e = engine(kv_format, indexer_format)
        own = greedy(e)  # also leaves the prompt's spans cached
        log_probs = []
        for i in range(steps):
            rid = e.add_request(prompt + path[:i], SamplingParams(max_tokens=1, ignore_eos=True))
            while e.has_unfinished():
                e.step()
            log_probs.append(F.log_softmax(e.requests[rid].seqs[0].logits[0].double(), dim=-1))
            e.pop_output(rid)
        if not reference:
            reference = log_probs
        kl = sum(float((r.exp() * (r - lp)).sum()) for r, lp in zip(reference, log_probs, strict=True)) / steps
        top1 = sum(int(r.argmax() == lp.argmax()) for r, lp in zip(reference, log_probs, strict=True)) / steps
        same = [a == b for a, b in zip(own, path, strict=True)]
        block_bytes = e.runner.cache_stats()["classical_block_bytes"]
        exact_bytes = exact_bytes or block_bytes
        results.append(
            V4LayoutQuality(
                name,
                int(block_bytes),
                block_bytes / span,
                round(exact_bytes / block_bytes, 3),
                kl,
                top1,
                sum(same) / steps,
                next((i for i, s in enumerate(same) if not s), None),
            )
        )
    return results
