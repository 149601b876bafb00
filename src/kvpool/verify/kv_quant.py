"""What a KV storage format costs in quality (kvpool.storage.quant), measured on a model and
a text: per layer, and end to end in the serving path.

Per layer (isolated): the layer's own fp32 queries, keys and values of a plain forward over
the text; the relative error (Frobenius norm) of K and of V as the storage holds them once
the text is written (`round_trip_kv`: KIVI's unfinished K chunk and last R values exact),
and of the attention output computed over them against the output over the fp32 K and V.
Each layer is measured on exact inputs, so one layer's figure does not carry the others'.

End to end, the serving regime (`evaluate`): the engine's own runner over paged blocks in
the format, as `kvpool generate` runs it: one step prefills the text's first P tokens, then
one step per token decodes the rest, teacher-forced (each step is fed the text's next token,
not the sampled one). Scored: the T - P next-token distributions of the prefill's last
position and of every decode step, against the same steps over exact fp32 blocks: the mean
KL divergence KL(p_fp32 || p_format) (the primary figure: it compares whole distributions
position by position, and it reproduces across CPUs where a perplexity change under ~1 %
does not), the share of positions whose most likely token is fp32's (top-1 agreement), and
the perplexity of the text's tokens with its change against fp32.

Spread: a paired block bootstrap over the scored positions (windows of `BOOTSTRAP_WINDOW`
consecutive positions, drawn with replacement to the same count, `BOOTSTRAP_SAMPLES` times,
seeded): the 2.5th and 97.5th percentiles of the perplexity change and of the mean KL.
Windows keep the correlation of neighbouring positions; the interval is the text's sampling
noise only (the few 1e-3 that fp32 summation orders move a change between CPUs come on top).
Two formats whose intervals overlap are not ranked by these figures.

Greedy decoding (`greedy_agreement`): the engine itself, paged blocks in the format, decodes
a fixed number of tokens greedily after a prompt; the share of steps whose token is the
fp32 engine's token at the same step, and the first step that differs. Once one token
differs the continuations part, so this is the strictest of the figures.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace

import torch
import torch.nn.functional as F

from kvpool.attention.backends.step import function_step
from kvpool.attention.reference import causal_attention
from kvpool.models.llama import LlamaModel
from kvpool.storage.quant import kv_schema, round_trip_kv

BOOTSTRAP_WINDOW = 16  # consecutive scored positions resampled together
BOOTSTRAP_SAMPLES = 2000
FP16_MAX = 65504.0  # the fp16 format saturates K / V here (storage/quant.py)


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
    perplexity_change_ci95: tuple[float, float] = (math.nan, math.nan)  # block bootstrap, percent
    kl_ci95: tuple[float, float] = (math.nan, math.nan)
    greedy_agreement: float | None = None  # share of greedy decode steps whose token is fp32's
    greedy_first_divergence: int | None = None  # the first step that differs (None: none did)

    def as_dict(self) -> dict[str, object]:
        out = asdict(self)
        out["layers"] = [asdict(layer) for layer in self.layers]
        for key in ("perplexity_change_ci95", "kl_ci95"):  # JSON has no NaN: no interval is null
            out[key] = None if any(math.isnan(x) for x in out[key]) else list(out[key])
        return out


@dataclass(frozen=True)
class Evaluation:
    fp32_perplexity: float  # over the scored positions, exact blocks
    regime: dict[str, object]  # what was run and scored (`serving_regime`)
    formats: list[FormatQuality]
    # the largest |K| or |V| of the text's exact forward, any layer: fp16 saturates past 65,504
    kv_max_abs: float = math.nan


def serving_regime(num_tokens: int, prefill: int, block_size: int) -> dict[str, object]:
    """The regime `evaluate` measures, for its report."""
    return {
        "name": "serving",
        "prefill_tokens": prefill,
        "decode_steps": num_tokens - prefill - 1,
        "scored_positions": num_tokens - prefill,
        "block_size": block_size,
        "description": (
            f"the engine's runner over {block_size}-token blocks in the format: one step prefills "
            f"the first {prefill} tokens, then one step per token decodes the rest teacher-forced; "
            f"scored: the next-token distributions of the prefill's last position and of the "
            f"{num_tokens - prefill - 1} decode steps. KIVI as the paper serves it: a step attends to "
            "its own K/V in full precision, the last R values stay exact"
        ),
    }


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def served_log_probs(
    model: LlamaModel, token_ids: Sequence[int], kv_format: str | None, prefill: int, block_size: int
) -> torch.Tensor:
    """The engine's runner over paged blocks in `kv_format` (None: exact, the model's dtype):
    one step prefills token_ids[:prefill], then one step per token decodes the rest,
    teacher-forced. [T - prefill, vocab] log-softmax of the next-token logits of the
    prefill's last position and of each decode step (they predict token_ids[prefill:]), fp32
    (fp64 for an fp64 model)."""
    from kvpool.cache import CacheDescriptor
    from kvpool.engine.llama_runner import llama_runner
    from kvpool.engine.runner import ScheduledChunk

    ids = list(token_ids)
    descriptor = CacheDescriptor("eval-kv-quant", layout_id=f"bs{block_size}:{kv_format}")
    num_blocks = -(-len(ids) // block_size) + 1
    runner = llama_runner(model, num_blocks, block_size, descriptor, kv_format=kv_format, enable_prefix_caching=False)
    seq = "text"
    admitted = runner.admit(seq, ids[:prefill], prefill)
    assert admitted is not None and admitted.num_scheduled_tokens == prefill, "a fresh pool holds the text"
    dtype = torch.float64 if model.dtype == torch.float64 else torch.float32
    out = torch.empty(len(ids) - prefill, model.config.vocab_size, dtype=dtype)
    logits = runner.execute([ScheduledChunk(seq, ids[:prefill], 0, True)])
    out[0] = F.log_softmax(logits[0].to(dtype), dim=-1)
    runner.commit_step([seq], [prefill], [ids[prefill]])
    for pos in range(prefill, len(ids) - 1):
        assert runner.reserve_step([seq], [1])
        logits = runner.execute([ScheduledChunk(seq, [ids[pos]], pos, True)])
        out[pos - prefill + 1] = F.log_softmax(logits[0].to(dtype), dim=-1)
        runner.commit_step([seq], [1], [ids[pos + 1]])
    runner.release(seq, "finish")
    return out


def block_bootstrap(
    values: Sequence[torch.Tensor], statistic: Callable[..., torch.Tensor], seed: int = 0
) -> tuple[float, float]:
    """The 95 % interval of `statistic(*means)` where means are the per-resample means of
    each of `values` ([n] fp64 each, paired by position) over windows of BOOTSTRAP_WINDOW
    positions drawn with replacement (the last, shorter window included). NaNs when the
    positions fill fewer than two windows: one window has no spread to resample."""
    n = values[0].shape[0]
    starts = torch.arange(0, n, BOOTSTRAP_WINDOW)
    if len(starts) < 2:
        return math.nan, math.nan
    g = torch.Generator().manual_seed(seed)
    pick = starts[torch.randint(len(starts), (BOOTSTRAP_SAMPLES, len(starts)), generator=g)]  # [S, W]
    pos = (pick.unsqueeze(-1) + torch.arange(BOOTSTRAP_WINDOW)).reshape(BOOTSTRAP_SAMPLES, -1)
    valid = pos < n
    pos = pos.clamp(max=n - 1)
    count = valid.sum(dim=1).to(torch.float64)
    means = [(v[pos] * valid).sum(dim=1) / count for v in values]
    stat = statistic(*means)
    lo, hi = torch.quantile(stat, torch.tensor([0.025, 0.975], dtype=stat.dtype)).tolist()
    return lo, hi


def evaluate(
    model: LlamaModel,
    token_ids: Sequence[int],
    formats: Sequence[str],
    progress: Callable[[str], None] | None = None,
    block_size: int = 128,
    prefill: int = 128,
) -> Evaluation:
    """Each format's quality in the serving regime (module docstring) with KV blocks of
    `block_size` tokens (the block formats' scale group, KIVI's chunks within it), the
    text's first `prefill` tokens prefilled in one step. ValueError for an unknown format,
    a format the block size does not fit, or a text without a token after the prefill."""
    fmts = [kv_schema(name) for name in formats]
    for fmt in fmts:
        fmt.check(block_size, model.config.head_dim)
    if not 1 <= prefill < len(token_ids):
        raise ValueError(
            f"the prefill of {prefill} tokens must leave a token of the text to decode (the text has {len(token_ids)})"
        )
    ids = torch.tensor(list(token_ids), dtype=torch.long, device=model.device)
    targets = ids[prefill:].cpu()
    cfg = model.config
    captured: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []

    def exact(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        captured.append((q.clone(), k.clone(), v.clone()))
        return causal_attention(q, k, v)

    model.forward(ids, torch.arange(ids.shape[0]), function_step(exact, ids.shape[0], []), fused=False)  # the inputs
    if progress is not None:
        progress("fp32 (exact blocks)")
    lp_ref = served_log_probs(model, token_ids, None, prefill, block_size)
    nll_ref = -lp_ref.gather(1, targets.unsqueeze(1)).squeeze(1).double()  # [n]
    ppl_ref = math.exp(float(nll_ref.mean()))
    fp32_bytes = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 4
    results = []
    for fmt in fmts:
        if progress is not None:
            progress(fmt.name)
        layers = []
        for q, k, v in captured:
            kq, vq = round_trip_kv(fmt, k, v, block_size)
            out_ref = causal_attention(q, k, v)
            layers.append(LayerError(_rel(kq, k), _rel(vq, v), _rel(causal_attention(q, kq, vq), out_ref)))
        lp = served_log_probs(model, token_ids, fmt.name, prefill, block_size)
        nll = -lp.gather(1, targets.unsqueeze(1)).squeeze(1).double()
        kl = (lp_ref.exp() * (lp_ref - lp)).sum(dim=-1).double()  # [n]
        agree = float((lp.argmax(-1) == lp_ref.argmax(-1)).double().mean())
        ppl = math.exp(float(nll.mean()))
        change = 100 * math.expm1(float(nll.mean() - nll_ref.mean()))  # = 100 (ppl / ppl_ref - 1)
        ci = block_bootstrap([nll, nll_ref], lambda a, b: 100 * torch.expm1(a - b))
        kl_ci = block_bootstrap([kl], lambda a: a)
        per_token = cfg.num_layers * cfg.num_kv_heads * fmt.bytes_per_token_head(block_size, cfg.head_dim)
        results.append(
            FormatQuality(
                fmt.name,
                per_token,
                int((1 << 30) // per_token),
                fp32_bytes / per_token,  # unrounded: rounded here and again when printed, 3.7647 read 3.77
                ppl,
                change,
                float(kl.mean()),
                agree,
                layers,
                ci,
                kl_ci,
            )
        )
    kv_max_abs = max(float(t.abs().amax()) for _, k, v in captured for t in (k, v))
    return Evaluation(ppl_ref, serving_regime(len(token_ids), prefill, block_size), results, kv_max_abs)


def greedy_agreement(
    model: LlamaModel, prompt: Sequence[int], formats: Sequence[str], steps: int, block_size: int
) -> dict[str, tuple[float, int | None]]:
    """Per format: (the share of `steps` greedy tokens equal to the fp32 engine's at the same
    step, the first step that differs or None), decoded by the engine over paged blocks."""
    from kvpool.cache import CacheDescriptor
    from kvpool.engine.build import build_engine
    from kvpool.engine.sampling import SamplingParams

    num_blocks = -(-(len(prompt) + steps) // block_size) + 1

    def decode(name: str | None) -> list[int]:
        engine = build_engine(
            model,
            descriptor=CacheDescriptor("eval-kv-quant", layout_id=f"bs{block_size}:{name}"),
            num_blocks=num_blocks,
            block_size=block_size,
            kv_format=name,
            enable_prefix_caching=False,
            max_num_batched_tokens=max(len(prompt), 1),
            max_num_seqs=1,
            enforce_eager=True,  # every format decoded on the eager path, as the fp32 reference
        )
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

    from kvpool.engine.build import build_engine
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
        return build_engine(
            model,
            num_blocks=num_blocks,
            num_state_blocks=2,
            max_num_batched_tokens=256,
            max_num_seqs=1,
            record_logits=True,
            kv_format=kv_format,
            indexer_format=indexer_format,
        )

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
                exact_bytes / block_bytes,  # unrounded: rounded to 3 places, then printed to 2
                kl,
                top1,
                sum(same) / steps,
                next((i for i, s in enumerate(same) if not s), None),
            )
        )
    return results


# ---- the reports of `kvpool eval kv-quant` ------------------------------------------------

TEXT_SOURCE = "pydoc_data.topics (the Python Language Reference topics shipped with CPython; PSF License)"


# 4 Mi characters: 32 a token at 131,072 tokens (a Llama-3 GGUF's context; English runs ~4),
# 512 at SmolLM2's 8,192; the report's "tokens" says how many a shorter text held
MAX_TEXT_CHARS = 4 << 20


def reference_text(path: str | None = None) -> tuple[str, str]:
    """(text, where it comes from): the Python Language Reference's topic pages that CPython
    ships as `pydoc_data.topics` (every installation has them; PSF License), in sorted topic
    order, plain text; or the UTF-8 file at `path`."""
    if path is None:
        from pydoc_data.topics import topics

        return "\n\n".join(topics[k] for k in sorted(topics)), TEXT_SOURCE
    if os.path.isdir(path):
        raise ValueError(f"--text {path!r} is a directory, not a file")
    try:
        with open(path, encoding="utf-8") as f:
            # its first MAX_TEXT_CHARS characters: the evaluation reads at most the model's
            # context of tokens; the whole file was read (a log of gigabytes into memory, and
            # /dev/zero never ended)
            return f.read(MAX_TEXT_CHARS), path
    except UnicodeDecodeError as e:
        raise ValueError(f"--text {path!r} is not UTF-8 text ({e.reason} at byte {e.start})") from None
    except FileNotFoundError:
        raise ValueError(f"--text {path!r}: no such file") from None
    except OSError as e:  # unreadable (a permission, an I/O error): one line, not a traceback
        raise ValueError(f"--text {path!r}: cannot read it ({e.strerror or e})") from None


def quality_report(
    loaded,
    formats: Sequence[str],
    text: str,
    source: str,
    *,
    tokens: int = 512,
    prefill: int = 128,
    block_size: int = 128,
    greedy_steps: int = 64,
    greedy_prompt: int = 200,
    progress: Callable[[str], None] | None = None,
    notice: Callable[[str], None] | None = None,
) -> dict:
    """`kvpool eval kv-quant`'s report on `loaded` (engine.build.load_model's Llama): the
    text's first `tokens` tokens through `evaluate` (`prefill` of them in one step), and,
    unless `greedy_steps` is 0, `greedy_agreement` after its first `greedy_prompt` tokens.
    `progress` hears each format as evaluate starts it, `notice` of the greedy run."""
    if greedy_steps < 0:
        raise ValueError(f"--greedy-steps must be >= 0, got {greedy_steps}")
    encoded = loaded.tokenizer.encode(text)
    ids = encoded[:tokens]
    context = loaded.model.config.max_position
    if len(ids) < 2:
        raise ValueError(f"the text holds {len(ids)} token(s); at least 2 are needed")
    if len(ids) > context:
        # (the count is the text's first --tokens tokens: 10**20 read "--tokens 112955")
        raise ValueError(
            f"--tokens {tokens:,} takes {len(ids):,} tokens of the text, past the model's context of {context:,}"
        )
    if prefill >= len(ids):
        raise ValueError(f"--prefill {prefill} leaves none of the text's {len(ids)} tokens to decode")
    if block_size > context:  # a pool of such blocks was allocated: 10**9 asked torch for 46 TB, a traceback
        raise ValueError(f"--block-size {block_size:,} is larger than the model's context of {context:,} tokens")
    # the greedy run's prompt (the text may hold fewer than --greedy-prompt tokens), checked
    # before the evaluation: a prompt and steps past the context were refused by the engine
    # only after every format had run, or, with the prompt inside it, decoded fewer than
    # --greedy-steps tokens and divided the agreement by the steps (all equal read 0.61)
    prompt = encoded[:greedy_prompt]
    if greedy_steps and len(prompt) + greedy_steps > context:
        raise ValueError(
            f"the greedy run's prompt of {len(prompt):,} tokens (--greedy-prompt {greedy_prompt:,}) and --greedy-steps "
            f"{greedy_steps:,} pass the model's context of {context:,} tokens"
        )
    ev = evaluate(loaded.model, ids, formats, progress, block_size, prefill)
    results = ev.formats
    if greedy_steps:
        if notice is not None:
            notice(f"greedy decoding, {greedy_steps} steps")
        # (by the names evaluate gives its results, kv_schema's: "kivi2-g32-r128", kivi2's defaults
        # spelled out, is "kivi2", and keying by the flag's spelling was a KeyError after every format ran)
        greedy = greedy_agreement(loaded.model, prompt, [r.name for r in results], greedy_steps, block_size)
        results = [
            replace(r, greedy_agreement=greedy[r.name][0], greedy_first_divergence=greedy[r.name][1]) for r in results
        ]
    return {
        "model": os.path.basename(loaded.gguf.path),
        "text": source,
        "tokens": len(ids),
        "block_size": block_size,
        "regime": ev.regime,
        "bootstrap": f"paired block bootstrap over the scored positions, windows of {BOOTSTRAP_WINDOW}, "
        f"{BOOTSTRAP_SAMPLES} resamples: 95 % intervals",
        "greedy_steps": greedy_steps,
        "greedy_prompt_tokens": len(prompt),
        "fp32_perplexity": round(ev.fp32_perplexity, 4),
        # fp16 stores values past 65,504 saturated there (storage/quant.py): this text's headroom
        "kv_max_abs": ev.kv_max_abs,
        "fp16_max": FP16_MAX,
        "formats": [r.as_dict() for r in results],
    }


def quality_report_v4(tokens: int = 512, steps: int = 32, progress: Callable[[str], None] | None = None) -> dict:
    """`kvpool eval kv-quant --model tiny-dsv4`'s report: evaluate_v4 (seed 0) over a
    `tokens`-id prompt and `steps` steps, each layout's figures as a dict."""
    results = evaluate_v4(seed=0, prompt_len=tokens, steps=steps, progress=progress)
    return {"model": "tiny-dsv4", "prompt_tokens": tokens, "steps": steps, "layouts": [asdict(r) for r in results]}
