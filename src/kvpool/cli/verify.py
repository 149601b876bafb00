"""`kvpool verify dsv4`: the V4 dual-pool verification matrix (paged vs contiguous oracle).
`kvpool verify hybrid`: the hybrid-cache matrix (kvpool.verify.hybrid), the same rules.

Prints one row per case and exits 1 if any case fails (0 otherwise; 2 on a bad argument).

`--dtype fp64` (the default) runs the tiny model in fp64 and holds every case to a fixed
1e-12: fp64 rounding leaves <= 7e-15 and one value read from a wrong slot ~1e-2, so the
verdict is decisive and the same on every CPU. It is the default because that is what a
verification run is for; fp64 costs about as much as fp32 on these tiny matrices (fp32
mode runs an fp64 oracle as well, to measure its tolerance).

`--dtype fp32` runs the model's own precision. Each case's tolerance is derived on this
machine from the oracle's own fp32 error: 8 x max |oracle_fp32 - oracle_fp64| (the same
fp32 weights run in fp64), at least 2 fp32 ulps of the largest |logit|. Rows also show
that error and the top-k selection margin: how far the indexer's k-th / (k+1)-th scores
are from a tie, in fp32 score errors (inf: no query has more than k entries). A case
whose logits disagree at a margin below 4 is "undecided": paged and oracle may rightly
keep different entries there, so fp32 cannot tell; it does not fail the run (rerun with
fp64). The rules and figures: kvpool.verify.dsv4_tolerance.

`--tolerance X` overrides the bound in either mode (a finite number >= 0).
`--lengths 1,129,300` runs only the prompt-length cases for those lengths.
`--json` prints {"dtype": "fp64" | "fp32", "cases": [{"name", "max_abs_diff", "tolerance",
"passed", "verdict" ("pass" | "fail" | "undecided"), and in fp32 "reference_error" and
"selection_margin" (null for inf)}, ...]}; a case that raised an assertion has
max_abs_diff null and a "detail".
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

from kvpool.cli.args import HelpFormatter, parsed_number, positive_int, torch_seed_int
from kvpool.cli.bench import printed_json
from kvpool.cli.options import BLOCK_SIZE, add_option

DTYPES = ("fp64", "fp32")


def _lengths(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"--lengths must be comma-separated integers, got {text!r}") from None
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"--lengths must be positive integers, got {text!r}")
    return values


def _add_matrix_arguments(parser: argparse.ArgumentParser, seed_help: str) -> None:
    """The options a verification matrix takes (verify dsv4, verify hybrid)."""
    parser.add_argument(
        "--lengths",
        type=_lengths,
        default=None,
        help="comma-separated prompt lengths: run only those length cases (default: the whole matrix)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--seed", type=torch_seed_int, default=0, help=seed_help)
    parser.add_argument(
        "--dtype",
        choices=DTYPES,
        default="fp64",
        help="fp64: fixed 1e-12 bound, decisive on any CPU; fp32: per-case bound from the oracle's own fp32 error",
    )
    parser.add_argument(
        "--tolerance",
        type=float,
        default=None,
        help="max abs logit difference to pass; overrides the dtype's (default: fp64 1e-12, fp32 derived per case)",
    )


def _cp_seed(text: str) -> int:
    """verify cp's --seed: an int in [-2**32, 2**32). Its K / V draws seed torch with
    seed * 1,000,003 + more (verify/context_parallel.py), which must stay a 64-bit seed: a
    larger one was "Overflow when unpacking long long" on every rank, naming no flag."""
    return parsed_number(text, int, lambda v: -(2**32) <= v < 2**32, "an integer in [-2**32, 2**32)")


def _add_cp_arguments(cp: argparse.ArgumentParser) -> None:
    cp.add_argument("--context", type=positive_int, default=32768, help="tokens of each random sequence")
    cp.add_argument("--batch", type=positive_int, default=4, help="random decode sequences")
    add_option(cp, BLOCK_SIZE, default=16)
    cp.add_argument("--smollm2-prompt", type=int, default=1024, help="prompt tokens of the SmolLM2 check (0: skip it)")
    cp.add_argument(
        "--steps", type=positive_int, default=16, help="greedy tokens of the SmolLM2 check (the first is the prefill's)"
    )
    cp.add_argument("--seed", type=_cp_seed, default=0, help="seed of the random sequences")
    cp.add_argument("--json", action="store_true", help="print one JSON object")


def _add_tp_arguments(tp: argparse.ArgumentParser) -> None:
    tp.add_argument("--max-tokens", type=positive_int, default=8, help="greedy tokens of the short requests")
    tp.add_argument("--json", action="store_true", help="print one JSON object")


def run_tp(args: argparse.Namespace) -> int:
    """`kvpool verify tp` (every rank runs it; rank 0 prints): 1 if it fails."""
    from kvpool.verify.tensor_parallel import run_tp as run_all

    result = run_all(args.max_tokens)
    if result is None:
        return 0
    if args.json:
        printed_json(args, result)
    else:
        for rid, r in result["requests"].items():
            mark = "ok  " if r["passed"] else "FAIL"
            print(
                f"{mark} request {rid}: tokens equal {r['tokens_equal']}, max logit difference "
                f"{r['max_logit_difference']:.2e} (single-process fp32 error {r['single_process_fp32_error']:.2e})"
            )
        print(
            f"TP {result['tp']}: prefix hit {result['b_cached_tokens']} tokens, {result['preemptions']} preemption(s), "
            f"KV {result['kv_bytes_per_token_per_rank']:,} B a token per rank against "
            f"{result['kv_bytes_per_token_single']:,} on one; "
            f"{result['single_process_s']} s single, {result['tp_s']} s TP"
        )
        for failure in result["failures"]:
            print(f"FAIL {failure}")
        print("passed" if result["passed"] else "failed")
    return 0 if result["passed"] else 1


def _add_pd_arguments(pd: argparse.ArgumentParser) -> None:
    pd.add_argument("--prefill-tp", type=positive_int, default=1, help="tensor-parallel size of the prefill side")
    pd.add_argument("--decode-tp", type=positive_int, default=1, help="tensor-parallel size of the decode side")
    pd.add_argument("--prefill-block-size", type=positive_int, default=16, help="the prefill side's KV block size")
    pd.add_argument("--decode-block-size", type=positive_int, default=16, help="the decode side's KV block size")
    pd.add_argument("--max-tokens", type=positive_int, default=8, help="greedy tokens a request decodes")
    pd.add_argument("--prompt-len", type=positive_int, default=480, help="tokens of the reference text a prompt takes")
    pd.add_argument("--prefill-tenant", default="", help="the tenant the prefill side describes its blocks under")
    pd.add_argument("--crash", action="store_true", help="the prefill leader dies after its first descriptor")
    pd.add_argument("--json", action="store_true", help="print one JSON object")


def run_pd(args: argparse.Namespace) -> int:
    """`kvpool verify pd`: 1 unless the KV moved, was used, and every request's tokens equal
    the single-process run's (a run where nothing was transferred does not pass)."""
    from kvpool.verify.disaggregated import run_pd as run_all

    report = run_all(
        args.prefill_tp,
        args.decode_tp,
        args.prefill_block_size,
        args.decode_block_size,
        args.max_tokens,
        args.prompt_len,
        args.prefill_tenant,
        args.crash,
    )
    if report is None:
        return 0
    ok = report["passed"]  # the KV moved, was used, and the tokens are right (verify/disaggregated.py)
    if args.json:
        printed_json(args, report)
    else:
        for r in report["requests"]:
            mark = "ok  " if r["tokens_equal"] else "FAIL"
            print(
                f"{mark} {r['prompt_tokens']}-token prompt: {r['outcome']}, {r['tokens_received']} tokens "
                f"({r['bytes_received']:,} B) received, {r['cached_tokens']} tokens cached, {r['seconds']} s"
            )
        t = report["transfer"]
        print(
            f"P/D {report['prefill_tp']} -> {report['decode_tp']} ranks, blocks {report['prefill_block_size']} -> "
            f"{report['decode_block_size']}: {t['num_bytes']:,} B in {t['transfer_ms']} ms "
            f"({t['transfer_gb_s']} GB/s), conversion {t['convert_ms']} ms"
        )
        for failure in report["failures"]:
            print(f"FAIL {failure}")
        print("passed" if ok else "failed")
    return 0 if ok else 1


def run_cp(args: argparse.Namespace) -> int:
    """`kvpool verify cp` (every rank runs it; rank 0 prints): 1 if a check fails."""

    from kvpool.engine.memory import check_fits
    from kvpool.verify.context_parallel import paged_check_bytes, paged_lengths, run_all

    if args.smollm2_prompt < 0:
        raise ValueError(f"--smollm2-prompt must be >= 0, got {args.smollm2_prompt}")
    # the paged check's sequences are --context, --context - 7, --context - 14, ... tokens: the
    # shortest must hold a token
    shortest = paged_lengths(args.context, args.batch)[-1]
    if shortest < 1:
        raise ValueError(
            f"--context {args.context} is too short for --batch {args.batch}: the paged check's sequences are "
            f"--context, --context - 7, ... tokens (the last {shortest}); give --context {args.context - shortest + 1} "
            "or more, or a smaller --batch"
        )
    # every rank, before the group forms (a rank that refused alone left the others waiting):
    # the largest share, rank 0's
    check_fits(
        paged_check_bytes(args.context, args.batch, args.block_size),
        "cpu",
        f"the paged check's --batch {args.batch} x --context {args.context} in blocks of "
        f"--block-size {args.block_size}",
        "lower --context, --batch or --block-size",
    )
    if args.smollm2_prompt and args.steps < 2:  # the first token is the prefill's: nothing decoded to check
        raise ValueError(f"--steps {args.steps} decodes nothing after the prefill's token: give --steps 2 or more")
    # the last decode step feeds the token at position prompt + steps - 2; past SmolLM2's
    # positions every rank stopped there, after the paged check and the prefill, on the
    # model's "position 8192 exceeds the model's context 8192", naming no flag
    from kvpool.spec.models import load_preset

    positions = load_preset("smollm2-135m").max_position_embeddings
    if args.smollm2_prompt and args.smollm2_prompt + args.steps - 2 >= positions:
        raise ValueError(
            f"--smollm2-prompt {args.smollm2_prompt} and --steps {args.steps} reach position "
            f"{args.smollm2_prompt + args.steps - 2:,}, past SmolLM2's last ({positions - 1:,}): "
            f"--smollm2-prompt + --steps may be at most {positions + 1:,}"
        )
    results = run_all(args.context, args.batch, args.block_size, args.smollm2_prompt, args.steps, args.seed)
    if results is None:
        return 0  # not rank 0: rank 0 reports
    ok = all(r["passed"] for r in results)
    if args.json:
        printed_json(args, {"passed": ok, "checks": results})
    else:
        for r in results:
            mark = "ok  " if r["passed"] else "FAIL"
            figures = ", ".join(f"{k} {v}" for k, v in r.items() if k not in ("check", "passed"))
            print(f"{mark} {r['check']}: {figures}")
    return 0 if ok else 1


def run_hybrid(args: argparse.Namespace) -> int:
    """`kvpool verify hybrid`: one row per case; 1 if any case fails."""
    from kvpool.verify.hybrid import Verifier as HybridVerifier

    results = _run_matrix(HybridVerifier, args)
    if args.json:
        cases = [
            _case_json(r, **({} if r.reference_error is None else {"reference_error": r.reference_error}))
            for r in results
        ]
        printed_json(args, {"dtype": args.dtype, "cases": cases})
    else:
        width = max(len(r.name) for r in results)
        print(f"{'case':<{width}}  {'max abs diff':>12}  {'tolerance':>9}  pass")
        for r in results:
            detail = f"  ({r.detail})" if r.detail else ""
            mark = "yes" if r.passed else "NO"
            print(f"{r.name:<{width}}  {r.max_abs_diff:>12.3e}  {r.tolerance:>9.2e}  {mark}{detail}")
        print(f"{sum(r.passed for r in results)}/{len(results)} passed ({args.dtype})")
    return 0 if all(r.passed for r in results) else 1


def _number(x: float | None) -> float | None:
    return None if x is None or math.isnan(x) or math.isinf(x) else x


def _run_matrix(verifier_class, args: argparse.Namespace) -> list:
    """What `verify dsv4` and `verify hybrid` share: check --tolerance, one torch thread (tiny
    matrices: one thread is the fastest and plays well on shared CPUs), the --dtype, and every
    case of `verifier_class` (verify/dsv4.py or verify/hybrid.py's Verifier) run."""
    import torch

    from kvpool.verify.dsv4_tolerance import check_tolerance

    check_tolerance(args.tolerance, "--tolerance")
    torch.set_num_threads(1)
    dtype = torch.float64 if args.dtype == "fp64" else torch.float32
    return verifier_class(seed=args.seed, dtype=dtype).run(args.lengths, tolerance=args.tolerance)


def _case_json(r, **extra: object) -> dict[str, object]:
    """One case of a matrix's --json: name, figures and pass, then `extra`, then the detail if any."""
    case: dict[str, object] = {
        "name": r.name,
        "max_abs_diff": _number(r.max_abs_diff),
        "tolerance": _number(r.tolerance),
        "passed": r.passed,
        **extra,
    }
    if r.detail:
        case["detail"] = r.detail
    return case


def run_dsv4(args: argparse.Namespace) -> int:
    """`kvpool verify dsv4`: one row per case; 1 if any case fails (an undecided one does not)."""
    from kvpool.verify.dsv4 import Verifier
    from kvpool.verify.dsv4_tolerance import FP64_TOLERANCE

    results = _run_matrix(Verifier, args)
    fp32 = args.dtype == "fp32"
    if args.json:
        cases = []
        for r in results:
            figures: dict[str, object] = {"verdict": r.verdict}
            if fp32:
                figures.update(reference_error=_number(r.reference_error), selection_margin=_number(r.selection_margin))
            cases.append(_case_json(r, **figures))
        printed_json(args, {"dtype": args.dtype, "cases": cases})
    else:
        width = max(len(r.name) for r in results)
        extra = f"  {'oracle err':>10}  {'top-k margin':>12}" if fp32 else ""
        print(f"{'case':<{width}}  {'max abs diff':>12}  {'tolerance':>9}{extra}  pass")
        for r in results:
            extra = ""
            if fp32:
                err, margin = (math.nan if v is None else v for v in (r.reference_error, r.selection_margin))
                extra = f"  {err:>10.2e}  {margin:>12.1f}"
            mark = {"pass": "yes", "fail": "NO", "undecided": "undecided (top-k near tie in fp32)"}[r.verdict]
            print(
                f"{r.name:<{width}}  {r.max_abs_diff:>12.3e}  {r.tolerance:>9.2e}{extra}  {mark}"
                + (f"  ({r.detail})" if r.detail else "")
            )
        num_passed = sum(r.passed for r in results)
        num_undecided = sum(r.verdict == "undecided" for r in results)
        if args.tolerance is not None:
            rule = f"tolerance {args.tolerance:g}"
        else:
            rule = (
                "tolerance derived per case from the oracle's fp32 error" if fp32 else f"tolerance {FP64_TOLERANCE:g}"
            )
        print(
            f"{num_passed}/{len(results)} passed ({args.dtype}, {rule})"
            + (f"; {num_undecided} undecided: rerun with --dtype fp64" if num_undecided else "")
        )
    return 1 if any(r.verdict == "fail" for r in results) else 0


# target -> (one-line help, description, its options, its run)
TARGETS: dict[str, tuple[str, str, Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int]]] = {
    "dsv4": (
        "DeepSeek-V4 Classical + State pools against the contiguous oracle",
        "DeepSeek-V4 Classical + State pools against the contiguous oracle, case by case.",
        lambda p: _add_matrix_arguments(p, "seed of the tiny model's weights"),
        run_dsv4,
    ),
    "hybrid": (
        "tiny hybrid models (window / full / recurrent layers) on the cache coordinator against a full recompute",
        "Tiny hybrid models (a Gemma-2-like window / full model and a recurrent / full model) on the hybrid "
        "cache coordinator against a full recompute, case by case (kvpool.verify.hybrid).",
        lambda p: _add_matrix_arguments(p, "seed of the tiny models' weights"),
        run_hybrid,
    ),
    "cp": (
        "context-parallel decode attention over torch.distributed against one rank (under torchrun)",
        "Context-parallel decode attention (kvpool.verify.context_parallel): each rank holds a share of every "
        "sequence's blocks; run under torchrun --nproc-per-node R -m kvpool verify cp. Rank 0 prints the result.",
        _add_cp_arguments,
        run_cp,
    ),
    "tp": (
        "the tensor-parallel engine against the single-process one on SmolLM2 (under torchrun)",
        "The tensor-parallel engine (kvpool.verify.tensor_parallel) against the single-process engine: "
        "run under torchrun --nproc-per-node 3 -m kvpool verify tp. Rank 0 prints the result.",
        _add_tp_arguments,
        run_tp,
    ),
    "pd": (
        "prefill / decode disaggregation on SmolLM2 against one process (under torchrun)",
        "Prefill / decode disaggregation (kvpool.verify.disaggregated): prefill ranks first, then decode ranks; "
        "run under torchrun --nproc-per-node P+D -m kvpool verify pd. The decode leader prints the result.",
        _add_pd_arguments,
        run_pd,
    ),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="target", required=True)
    for name, (help_line, description, add_options, _) in TARGETS.items():
        target = sub.add_parser(name, help=help_line, description=description, formatter_class=HelpFormatter)
        add_options(target)
        target.set_defaults(_name=f"verify {name}")  # its error lines name it: "kvpool verify pd: error: ..."


def run(args: argparse.Namespace) -> int:
    return TARGETS[args.target][3](args)
