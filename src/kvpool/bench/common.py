"""What more than one benchmark uses: a best-of timer, serving one request to the end, and
the progress callback a long benchmark reports its phases through."""

from __future__ import annotations

from collections.abc import Callable

# A benchmark says which phase it enters through this (the CLI prints it on stderr); the
# default says nothing.
Progress = Callable[[str], None]


def no_progress(phase: str) -> None:
    """The silent Progress."""


def best_of(fn: Callable[[], object], repeat: int = 40) -> float:
    """Seconds of the fastest of `repeat` calls of `fn`, after two untimed ones: on a shared
    machine, other work only adds time."""
    from kvpool.sim.calibrate import best_seconds

    fn()  # the second warm-up: best_seconds makes one
    return best_seconds(fn, repeat)


def run_to_completion(engine) -> None:
    """Step `engine` (engine.Engine) until no request is left."""
    while engine.has_unfinished():
        engine.step()


def serve_one(engine, prompt: list[int]):
    """Run one request of `prompt` that answers one token through `engine` (with nothing else
    in flight) and return its RequestOutput (ttft_s, num_cached_tokens)."""
    from kvpool.engine.sampling import SamplingParams

    request_id = engine.add_request(prompt, SamplingParams(max_tokens=1, ignore_eos=True))
    run_to_completion(engine)
    return engine.pop_output(request_id)
