"""`kvpool bench serve`'s measurement: real streaming clients against `kvpool serve` (or any
OpenAI-compatible server) replaying the chat workload of `kvpool run`; TTFT / TPOT / ITL
p50 and p99, throughput, goodput under the SLOs and the prefix-cache hit rate, one row per
concurrency (or request rate). The figures and how they are measured: kvpool/server/loadgen.py
(run_load drives the clients, summarize makes a row); the server's /metrics counters are
read before and after each row, for the server's hit rate.

Without a URL it starts `kvpool serve --port 0` itself (the embedded SmolLM2-135M) and
stops it at the end. With one it waits for the server's /v1/models to answer, up to
`ready_timeout_s` (a server still loading its model: `kvpool serve` accepts connections
before it answers them), saying so through `notice` after a second; a port that refuses
connections for REFUSED_TIMEOUT_S has nothing listening on it and is an error at once.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Sequence

from kvpool.bench.common import Progress, no_progress

READY_TIMEOUT_S = 300.0  # --ready-timeout's default: a server that accepts connections, loading
REFUSED_TIMEOUT_S = 3.0  # retries while connecting fails (refused, no such host): nothing listens
WAITING_NOTICE_S = 1.0  # say that we wait once we have waited this long


def start_server(
    kv_memory: str | None = None, api_key: str | None = None, notice: Progress = no_progress
) -> tuple[subprocess.Popen, str]:
    """`kvpool serve --port 0` (the embedded SmolLM2-135M) in a new process, and its URL once
    it says it is ready; ValueError with its last line if it does not start."""
    command = [sys.executable, "-m", "kvpool", "serve", "--port", "0"]
    if kv_memory:
        command += ["--kv-memory", kv_memory]
    if api_key:
        command += ["--api-key", api_key]
    notice("starting kvpool serve")
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    try:
        line = proc.stdout.readline()  # the ready line, or EOF if it failed
    except BaseException:
        # Ctrl-C (or SIGTERM) while the server loads: the caller has no handle on it yet to
        # stop, and a signal sent to this process alone left it serving, orphaned
        proc.kill()
        proc.wait()
        raise
    if "ready on " not in line:
        proc.kill()
        err = proc.stderr.read() if proc.stderr else ""
        raise ValueError(f"kvpool serve did not start: {(err or line).strip().splitlines()[-1:]}")
    url = line.split("ready on ", 1)[1].split()[0]
    return proc, url


def stop_server(proc: subprocess.Popen) -> None:
    """Ctrl-C to a server start_server started; killed if it has not ended 30 s later."""
    import signal

    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()


def wait_ready(url: str, api_key: str | None, timeout_s: float, notice: Progress = no_progress) -> str:
    """The server's model name, once /v1/models answers. A refused connection is retried for
    REFUSED_TIMEOUT_S at most, anything else that is not an answer yet (a connection that
    waits, a 5xx) until `timeout_s`; a 4xx is an answer, and an error."""
    import httpx

    try:
        parsed = httpx.URL(url)
    except httpx.InvalidURL as error:
        raise ValueError(f"--url {url!r}: {error}") from None
    if parsed.scheme not in ("http", "https") or not parsed.host:
        raise ValueError(f"--url {url!r}: expected http://HOST:PORT")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    start = time.monotonic()
    refused_since: float | None = None
    noticed = False
    while True:
        waited = time.monotonic() - start
        # short tries until the notice is out, so that a server that accepts and says nothing
        # does not keep us silent
        attempt_s = min(10.0 if noticed else WAITING_NOTICE_S, max(0.1, timeout_s - waited))
        try:
            r = httpx.get(f"{url}/v1/models", headers=headers, timeout=attempt_s)
            refused_since = None
            if r.status_code == 401:
                raise ValueError(f"{url} wants an API key: give --api-key")
            if 400 <= r.status_code < 500:
                raise ValueError(f"{url} is no OpenAI-compatible server: GET /v1/models answered {r.status_code}")
            r.raise_for_status()
            try:
                return r.json()["data"][0]["id"]
            except (ValueError, KeyError, IndexError, TypeError):
                raise ValueError(f"{url}: GET /v1/models answered no model list: {r.text[:200]!r}") from None
        except httpx.HTTPError as error:
            now = time.monotonic()
            if isinstance(error, httpx.ConnectError):
                refused_since = now if refused_since is None else refused_since
                if now - refused_since >= REFUSED_TIMEOUT_S:
                    raise ValueError(
                        f"cannot connect to {url} ({error}; retried for {REFUSED_TIMEOUT_S:g} s): start "
                        "`kvpool serve` there, or leave out --url to let the bench start one"
                    ) from None
            if now - start >= timeout_s:
                raise ValueError(
                    f"no OpenAI-compatible server answered at {url} within --ready-timeout {timeout_s:g} s: {error}"
                ) from None
            if not noticed and now - start >= WAITING_NOTICE_S:
                notice(f"waiting for {url} to answer")
                noticed = True
            time.sleep(0.25)


def _scrape(url: str) -> dict[str, float]:
    """The server's /metrics counters; an HTTP failure as a ValueError naming the URL."""
    import httpx

    from kvpool.server.loadgen import scrape

    try:
        return scrape(url)
    except httpx.HTTPError as error:
        raise ValueError(f"{url}/metrics: {type(error).__name__}: {error}") from None


def measure(
    url: str | None = None,
    *,
    ready_timeout_s: float = READY_TIMEOUT_S,
    api_key: str | None = None,
    model: str | None = None,
    concurrency: Sequence[int] | None = None,
    request_rate: Sequence[float] | None = None,
    num_requests: int = 32,
    turns: int = 2,
    max_tokens: int = 32,
    duration_limit_s: float = 300.0,
    slo_ttft_ms: float = 1000.0,
    slo_tpot_ms: float = 200.0,
    seed: int = 0,
    kv_memory: str | None = None,
    notice: Progress = no_progress,
    progress: Progress = no_progress,
) -> dict:
    """One row (loadgen.summarize's figures) per client count in `concurrency` (default 1, 4,
    16) or per rate in `request_rate` (conversations per second, Poisson): {"url", "model",
    "rows"}. `url` None: start `kvpool serve` (with `kv_memory`) and stop it after. `model`:
    the name sent (default: the server's only model). `notice` hears of the server start and
    of a wait; `progress` of each row done."""
    import asyncio

    from kvpool.server.loadgen import LoadConfig, run_load, summarize

    if concurrency is not None and request_rate is not None:
        raise ValueError("give concurrency or request_rate, not both")
    proc = None
    given = url is not None
    url = url.rstrip("/") if url else None
    try:
        if url is None:
            proc, url = start_server(kv_memory, api_key, notice)
        served = wait_ready(url, api_key, ready_timeout_s, notice)  # with a model too: the server must answer
        model = model or served
        if request_rate is not None:
            rows = [("request_rate", r) for r in request_rate]
        else:
            rows = [("concurrency", c) for c in (concurrency or [1, 4, 16])]
        results = []
        for kind, value in rows:
            config = LoadConfig(
                url=url,
                model=model,
                num_requests=num_requests,
                turns=turns,
                max_tokens=max_tokens,
                concurrency=value if kind == "concurrency" else None,
                request_rate=value if kind == "request_rate" else None,
                duration_limit_s=duration_limit_s,
                slo_ttft_ms=slo_ttft_ms,
                slo_tpot_ms=slo_tpot_ms,
                seed=seed,
                api_key=api_key,
            )
            before = _scrape(url)
            records, wall = asyncio.run(run_load(config))
            after = _scrape(url)
            results.append(summarize(config, records, wall, before, after))
            progress(f"{kind} {value}: {len(records)} requests, {wall:.1f} s")
    finally:
        if proc is not None:
            stop_server(proc)
    return {"url": url if given else "started by the bench", "model": model, "rows": results}
