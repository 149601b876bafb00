"""`kvpool bench sim`'s measurement: the simulator's `cpu` preset against the engine, on one workload.

The same requests, at the same arrival times, run twice in this process: through the
engine on SmolLM2-135M (the model computes every token, on the wall clock) and through
`kvpool simulate`'s replica (the same scheduler and cache manager, the cost model on the
`cpu` preset for the forward, a virtual clock). The workload is kvpool run's: its first
turns (chat prompts over three shared system prompts) and its long prompts, at its Poisson
arrivals, each answer exactly `max_tokens` long (its second turns, which carry the model's
own answers, are left out); the engine configuration of `kvpool run` (256 MiB of blocks
of 16, 256 tokens and 16 sequences a step). Printed: TPOT, TTFT and throughput, measured
and predicted, and their ratio, for two cost models: the `cpu` preset's defaults
(DEVICE_DEFAULTS in sim/cost.py, fitted once on a quiet day) and a fit made in this
process (sim/calibrate.py `fit_engine`: decodes of 1 and 8 sequences and fresh prefills
of 256 and 64 tokens, timed just before and just after the engine's run, since this VM's
speed drifts by tens of percent within minutes). Both simulations hold the same 364
blocks. Neither model sees the workload's own steps: chunks over cached prefixes, decodes
of other batch sizes and contexts.
"""

from __future__ import annotations

import random
import time

from kvpool.bench.common import Progress, no_progress

ENGINE = {"num_blocks": 364, "block_size": 16, "max_num_batched_tokens": 256, "max_num_seqs": 16}


class FitFailed(RuntimeError):
    """The engine's step times fit no cost model (another process using the CPUs, say)."""


def first_turns(loaded, requests: int = 24, num_long: int = 2, max_tokens: int = 24, rate: float = 2.0, seed: int = 0):
    """kvpool run's first turns and long prompts on `loaded`'s chat template, at its Poisson
    arrivals (its seeded generator, consumed in its order): one turn each that answers
    exactly `max_tokens` tokens (the second turns carry the model's own answers and are left
    out). A workload.sessions.Workload."""
    from kvpool.workload.arrivals import poisson_arrivals
    from kvpool.workload.live import live_chat
    from kvpool.workload.sessions import Session, Turn, Workload

    rng = random.Random(seed)
    made = live_chat(loaded.tokenizer.encode_chat, requests, num_long, rng)
    prompts = made.first_prompts + made.long_prompts
    arrivals = poisson_arrivals(len(prompts), rate, rng)
    sessions = tuple(
        Session(f"req{i}", t, (Turn(tuple(p), max_tokens),))
        for i, (t, p) in enumerate(zip(arrivals, prompts, strict=True))
    )
    params = {"requests": requests, "num_long": num_long, "max_tokens": max_tokens, "rate": rate}
    return Workload("kvpool-run-first-turns", sessions, loaded.model.config.vocab_size, params)


def _run_engine(loaded, workload) -> dict:
    """The real engine on the wall clock: each request added when its arrival time comes."""
    from kvpool.engine.build import build_engine
    from kvpool.engine.sampling import SamplingParams
    from kvpool.workload.metrics import percentile

    engine = build_engine(loaded, **ENGINE)
    vocab = workload.vocab_size
    pending = sorted(workload.sessions, key=lambda s: s.start_s)
    start = time.perf_counter()
    ids = []
    while pending or engine.has_unfinished():
        now = time.perf_counter() - start
        while pending and pending[0].start_s <= now:
            s = pending.pop(0)
            params = SamplingParams(max_tokens=s.turns[0].output_len, ignore_eos=True, seed=len(ids))
            ids.append(engine.add_request(s.prompt_ids(0, vocab), params, s.request_id(0), start + s.start_s))
        if not engine.has_unfinished():
            time.sleep(max(0.0, pending[0].start_s - (time.perf_counter() - start)))
            continue
        engine.step()
    span = time.perf_counter() - start
    outs = [engine.output(i) for i in ids]
    tpots = [o.tpot_s * 1e3 for o in outs if o.tpot_s is not None]
    ttfts = [o.ttft_s * 1e3 for o in outs if o.ttft_s is not None]
    generated = sum(len(o.completions[0].token_ids) for o in outs)
    return {
        "tpot_ms_p50": round(percentile(tpots, 0.5), 2),
        "tpot_ms_mean": round(sum(tpots) / len(tpots), 2) if tpots else 0.0,
        "ttft_ms_p50": round(percentile(ttfts, 0.5), 2),
        "throughput_tok_s": round(generated / span, 2),
        "num_steps": engine.num_steps,
        "prefix_hit_tokens": int(engine.runner.cache_stats()["prefix_hit_tokens"]),
    }


def _run_sim(model, workload, cost) -> dict:
    from kvpool.sim.simulator import SimConfig, simulate

    config = SimConfig(
        layout="paged",
        block_size=ENGINE["block_size"],
        max_num_seqs=ENGINE["max_num_seqs"],
        max_num_batched_tokens=ENGINE["max_num_batched_tokens"],
        max_model_len=ENGINE["num_blocks"] * ENGINE["block_size"],
        num_blocks=ENGINE["num_blocks"],  # the engine's pool, not the planner's for the whole machine
        kv_dtype="fp32",
    )
    report = simulate(model, cost.gpu, workload, config, cost)
    tpots = report["_series"]["tpot_ms"]
    return {
        "tpot_ms_p50": report["tpot_ms_p50"],
        "tpot_ms_mean": round(sum(tpots) / len(tpots), 2) if tpots else 0.0,
        "ttft_ms_p50": report["ttft_ms_p50"],
        "throughput_tok_s": report["throughput_tok_s"],
        "num_steps": report["num_steps"],
        "prefix_hit_tokens": report["prefix_hit_tokens"],
    }


TIMES = ("decode_1_s", "decode_b_s", "prefill_s", "prefill_small_s")


def _ratios(predicted: dict, measured: dict) -> dict:
    return {k: round(predicted[k] / measured[k], 3) for k in measured if measured[k]}


def measure(loaded, workload, seed: int = 0, progress: Progress = no_progress) -> dict:
    """Run `workload` (first_turns()) through the engine on `loaded` (engine.build.load_model)
    and through the simulator under the cpu preset and under a fit made now: {"fit",
    "fit_times_before_after_s", "measured", "predicted_preset", "predicted_fit",
    "preset_over_measured", "fit_over_measured"}. FitFailed when the step times fit no
    model (a busy machine)."""
    from dataclasses import asdict

    from kvpool.sim.calibrate import EngineStepTimes, fit_engine, time_engine_steps
    from kvpool.sim.cost import CostModel, cpu_preset
    from kvpool.spec.models import load_preset

    model, gpu = load_preset("smollm2-135m"), cpu_preset()
    # The fit's steps are timed now, before and after the run (the VM's speed drifts), on
    # other steps than the workload's; the model is fitted to their mean.
    progress("the engine's step times for the fit, before the run (1 of 4)")
    before = time_engine_steps(loaded, ENGINE, seed=seed)
    progress(f"the engine on the workload's {len(workload.sessions)} requests (2 of 4)")
    measured = _run_engine(loaded, workload)
    progress("the engine's step times for the fit, after the run (3 of 4)")
    after = time_engine_steps(loaded, ENGINE, seed=seed + 1)
    try:
        fit = fit_engine(EngineStepTimes.mean(before, after))
    except RuntimeError as error:
        raise FitFailed(str(error)) from error
    progress("the simulator under the cpu preset and under the fit (4 of 4)")
    preset = _run_sim(model, workload, CostModel(model, gpu))
    fitted = _run_sim(model, workload, fit.cost_model(model, gpu))
    return {
        "fit": {
            k: round(v, 6) if isinstance(v, float) else v
            for k, v in (asdict(fit.times) | {k: v for k, v in asdict(fit).items() if k != "times"}).items()
        },
        "fit_times_before_after_s": {k: [round(getattr(t, k), 6) for t in (before, after)] for k in TIMES},
        "measured": measured,
        "predicted_preset": preset,
        "predicted_fit": fitted,
        "preset_over_measured": _ratios(preset, measured),
        "fit_over_measured": _ratios(fitted, measured),
    }
