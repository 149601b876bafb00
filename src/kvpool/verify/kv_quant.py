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
