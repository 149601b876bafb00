"""Tensor parallelism for the Llama path (Megatron-style), over torch.distributed.

Rank r of T keeps query heads [r H/T, (r+1) H/T), KV heads [r KVH/T, (r+1) KVH/T), and
MLP columns [r I/T, (r+1) I/T): the fused wqkv and w_gate_up split by output columns (a
Qwen2's Q / K / V bias bqkv with its heads' columns), wo and w_down by input rows; a Qwen3's
q / k norm weights (one [head_dim] vector for all heads) are whole on every rank. Each
rank's attention reads only its own KV heads, so its KV pool holds 1/T of every block
(storage/kv.py on the sharded config): a block table, and so every cache decision, is the
same on every rank. The partial products of wo and w_down are
summed over the ranks (an all-reduce) before the residual add; embedding, norms and the
LM head are whole on every rank, so every rank computes the same logits and samples the
same token.

Heads are not split across ranks, nor replicated: T must divide both head counts (and the
MLP width). SmolLM2-135M has 9 query and 3 KV heads: TP 1 and TP 3. TP 2 would need a KV
head replicated on both ranks (its bytes stored twice) and 4.5 query heads a rank; it is
refused, naming the counts.

Ranks must never diverge silently: each one computes its own heads of the same tokens, so a
rank fed other tokens (another prompt of the same length, another sampling seed) would mix
its KV heads into the others' text and every rank would exit 0. Before the first step the
ranks agree on each request (its token ids and sampling parameters, `check_same`), and at
every step on its chunks' token ids and the cache's slots (`check_same_step`); a
difference is a RankError naming the ranks that differ. A rank that is lost (killed, or
crashed) makes the others' next collective fail: they stop with a RankError naming it.
"""

from __future__ import annotations

import atexit
import dataclasses
import datetime
import math
import os
import re
import socket
import threading
import time
from collections.abc import Callable, Sequence
from typing import TypeVar

import torch
import torch.distributed as dist
import xxhash

from kvpool.models.llama import QK_NORM_PARTS, LlamaModel

T = TypeVar("T")
LOST_PEER_WAIT_S = 2.0  # how long a failed collective waits to see which peer's process ended
# Every wait of a process group (forming it, each collective and receive) ends after this
# many seconds, not gloo's 30 minutes: a rank that never starts or hangs stops the others
# with one line. 600 s covers the longest a rank waits on purpose (a verify command's rank
# running the single-process reference while the others wait at a barrier); the
# KVPOOL_DIST_TIMEOUT_S environment variable sets another.
GROUP_TIMEOUT_S = 600.0
TIMEOUT_ENV = "KVPOOL_DIST_TIMEOUT_S"
# what KVPOOL_DIST_TIMEOUT_S may be: torch's store counts the wait in milliseconds, and a
# larger one overflowed (1e10 s: every wait over at once, "did not answer within 1e+10 s";
# 1e300: an OverflowError's traceback); under a millisecond, 0 ms (1e-9: the same at once;
# 0.5 s is 500 ms, a valid wait)
TIMEOUT_RANGE_S = (0.001, 86_400.0)


class RankError(RuntimeError):
    """The tensor-parallel ranks diverged, or one of them was lost, or the process group did
    not form in time: the command stops with this one line (cli/main.py), on every rank
    that is left."""


@dataclasses.dataclass(frozen=True)
class Peer:
    """A rank of the group as the others know it: where it runs, to tell that it is gone."""

    rank: int  # in the default (torchrun) world
    host: str
    pid: int


HOST_BYTES = 255  # the longest host name DNS allows (Linux's own: 64)


def gather_peers(group: dist.ProcessGroup | None = None) -> tuple[Peer, ...]:
    """Every rank's (host, pid), gathered once when the model is sharded (a collective) as
    int64 [2 + HOST_BYTES]: pid, the name's length, its UTF-8 bytes. Never all_gather_object:
    it unpickles what each peer sent, and a pickle runs whatever code it names."""
    host = socket.gethostname().encode()[:HOST_BYTES]
    mine = torch.zeros(2 + HOST_BYTES, dtype=torch.int64)
    mine[0], mine[1] = os.getpid(), len(host)
    mine[2 : 2 + len(host)] = torch.tensor(list(host), dtype=torch.int64)
    found = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(found, mine, group=group)
    peers = []
    for i, row in enumerate(found):
        pid, n, *data = row.tolist()
        name = bytes(b & 0xFF for b in data[: min(max(n, 0), HOST_BYTES)]).decode(errors="replace")
        peers.append(Peer(dist.get_global_rank(group, i) if group is not None else i, name, pid))
    return tuple(peers)


def _alive(pid: int) -> bool:
    """Whether process `pid` on this host still runs (a zombie, dead but not yet reaped by
    its parent, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's: it exists
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return True


def _me(peers: Sequence[Peer]) -> Peer | None:
    host, pid = socket.gethostname(), os.getpid()
    return next((p for p in peers if p.host == host and p.pid == pid), None)


def gloo_reason(text: str) -> tuple[str, bool]:
    """gloo's error text as (its first line without the source location and the advice
    after it, whether the process group's timeout ran out): "[.../pair.cc:537] Read error
    [127.0.0.1]:38297: Connection reset by peer. This is typically caused by ..." -> "Read
    error [127.0.0.1]:38297: Connection reset by peer". A peer that hangs (stopped,
    deadlocked) rather than dies runs the timeout out ("[.../unbound_buffer.cc:78] Timed out
    waiting 600000ms for recv ..."), and every later call on the closed pair says
    "Application timeout caused pair closure"."""
    first = re.sub(r"^\[[^\]]*\]\s*", "", (text.strip().splitlines() or [""])[0]).split(". This is typically")[0]
    return first, "Timed out waiting" in text or "Application timeout" in text


def lost_rank_error(peers: Sequence[Peer], error: BaseException) -> RankError:
    """The one line for a collective that failed because a peer went away: the lost ranks
    by name where they can be told (the only other rank; peers on this host whose process
    is gone), else gloo's own first line."""
    me = _me(peers)
    others = [p for p in peers if p is not me]
    who = f"rank {me.rank}" if me is not None else "this rank"
    first, timed_out = gloo_reason(str(error))
    first = first or type(error).__name__
    if timed_out:  # (a peer that hangs, not one that ended)
        return RankError(
            f"{who}: a peer rank did not answer within the process group's timeout ({first}); it hangs or was "
            f"stopped ({TIMEOUT_ENV} sets the wait), and the tensor-parallel group cannot go on without it"
        )
    lost = others if len(others) == 1 else []
    # a killed process closes its sockets before it is gone: give it a moment to be seen dead
    deadline = time.monotonic() + LOST_PEER_WAIT_S
    while not lost:
        lost = [p for p in others if p.host == socket.gethostname() and not _alive(p.pid)]
        if time.monotonic() >= deadline:
            break
        time.sleep(0.02)
    if lost:
        names = ", ".join(f"rank {p.rank} (pid {p.pid} on {p.host})" for p in lost)
        return RankError(f"{who}: lost {names} mid-step; the tensor-parallel group cannot go on without it")
    return RankError(f"{who}: a peer rank was lost mid-step ({first})")


def collective(peers: Sequence[Peer] | None, call: Callable[[], T]) -> T:
    """call() (a torch.distributed collective); a failure of the transport, which is what a
    lost peer causes, becomes a RankError naming the lost rank."""
    try:
        return call()
    except RuntimeError as error:  # gloo: "Connection closed by peer", "Connection reset", ...
        if isinstance(error, RankError) or peers is None:
            raise
        raise lost_rank_error(peers, error) from error


def check_tp(config, tp: int, flag: str = "--tensor-parallel-size") -> None:
    """ValueError naming the counts when `tp` ranks cannot each hold whole heads; `flag` is
    what the user set `tp` with (`verify pd --decode-tp`, `verify tp`'s torchrun
    --nproc-per-node), so the line names what to change."""
    if tp <= 0:
        raise ValueError(f"{flag} must be positive, got {tp}")
    bad = [
        f"{n} {what}"
        for n, what in (
            (config.num_heads, "query heads"),
            (config.num_kv_heads, "KV heads"),
            (config.intermediate_size, "MLP columns"),
        )
        if n % tp
    ]
    if bad:
        divisors = [t for t in range(1, config.num_kv_heads + 1) if config.num_kv_heads % t == 0]
        divisors = [t for t in divisors if config.num_heads % t == 0 and config.intermediate_size % t == 0]
        raise ValueError(
            f"{flag} {tp} does not divide the model's {', '.join(bad)} (each rank keeps whole "
            f"heads, none replicated); use {flag} {' or '.join(str(t) for t in divisors)}"
        )


def shard_llama(model: LlamaModel, rank: int, world: int, group: dist.ProcessGroup | None = None) -> LlamaModel:
    """Shard `rank` (within the TP group) of `model` (see the module docstring), whose
    forward all-reduces over `group` (None: the default group, all of torchrun's ranks)."""
    cfg = model.config
    check_tp(cfg, world)
    if world == 1:
        return model
    h, kvh, d, inter = cfg.num_heads // world, cfg.num_kv_heads // world, cfg.head_dim, cfg.intermediate_size // world
    q_cols = slice(rank * h * d, (rank + 1) * h * d)
    k0 = cfg.num_heads * d
    k_cols = slice(k0 + rank * kvh * d, k0 + (rank + 1) * kvh * d)
    v0 = k0 + cfg.num_kv_heads * d
    v_cols = slice(v0 + rank * kvh * d, v0 + (rank + 1) * kvh * d)
    layers = []
    for layer in model.layers:
        wqkv = layer["wqkv"]
        gate_up = layer["w_gate_up"]
        gate = slice(rank * inter, (rank + 1) * inter)
        up = slice(cfg.intermediate_size + rank * inter, cfg.intermediate_size + (rank + 1) * inter)
        # Q / K / V biases (Qwen2) go with their heads' columns; wo's and w_down's rows take none
        bias = layer.get("bqkv")
        # Qwen3's q / k norms weigh each head's D values alike: every rank holds them whole
        qk_norms = {p: layer[p] for p in QK_NORM_PARTS if p in layer}
        layers.append(
            ({} if bias is None else {"bqkv": torch.cat([bias[q_cols], bias[k_cols], bias[v_cols]]).contiguous()})
            | qk_norms
            | {
                "attn_norm": layer["attn_norm"],
                "ffn_norm": layer["ffn_norm"],
                "wqkv": torch.cat([wqkv[:, q_cols], wqkv[:, k_cols], wqkv[:, v_cols]], dim=1).contiguous(),
                "wo": layer["wo"][q_cols].contiguous(),
                "w_gate_up": torch.cat([gate_up[:, gate], gate_up[:, up]], dim=1).contiguous(),
                "w_down": layer["w_down"][rank * inter : (rank + 1) * inter].contiguous(),
            }
        )
    config = dataclasses.replace(cfg, num_heads=h, num_kv_heads=kvh, intermediate_size=inter)
    shard = LlamaModel(config, model.embed, model.norm, layers, model.lm_head, model.device, model.kernels)

    peers = gather_peers(group)

    def reduce(t: torch.Tensor) -> None:
        collective(peers, lambda: dist.all_reduce(t, group=group))

    shard.reduce = reduce
    shard.shard = (rank, world)
    shard.tp_group = group
    shard.tp_peers = peers
    return shard


def group_timeout_s() -> float:
    """GROUP_TIMEOUT_S, or KVPOOL_DIST_TIMEOUT_S where set (ValueError naming it unless it is a
    number of seconds within TIMEOUT_RANGE_S)."""
    text = os.environ.get(TIMEOUT_ENV)
    if text is None:
        return GROUP_TIMEOUT_S
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    low, high = TIMEOUT_RANGE_S
    if not (low <= value <= high):  # (nan fails it too)
        raise ValueError(f"{TIMEOUT_ENV} must be a number of seconds from {low:g} to {high:g} (a day), got {text!r}")
    return value


def check_rendezvous_env() -> None:
    """ValueError naming the variable unless RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT
    (env://, set by torchrun or by hand) can form a group: torch said "invalid literal for
    int() with base 10: 'x'" for either count or the port, and RANK 5 of WORLD_SIZE 2 waited
    out the timeout for a rank 0 that could not count it."""
    how = "(torchrun sets RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT; by hand, set each)"
    found = {}
    for name, low, high in (("WORLD_SIZE", 1, None), ("RANK", 0, None), ("MASTER_PORT", 1, 65535)):
        text = os.environ.get(name)
        try:
            found[name] = int(text)  # type: ignore[arg-type]
        except (TypeError, ValueError):
            found[name] = None
        high = found["WORLD_SIZE"] - 1 if name == "RANK" and found["WORLD_SIZE"] is not None else high
        if found[name] is None or found[name] < low or (high is not None and found[name] > high):
            bound = f"from {low} to {high}" if high is not None else f"{low} or more"
            raise ValueError(f"{name} must be an integer {bound}, got {text!r} {how}")
    if not os.environ.get("MASTER_ADDR", "").strip():
        raise ValueError(f"MASTER_ADDR must name rank 0's host, got {os.environ.get('MASTER_ADDR')!r} {how}")


def join_group() -> None:
    """Join torchrun's gloo process group (env://: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT),
    every wait bounded by group_timeout_s(). A group that cannot form is one line: a taken
    MASTER_PORT a ValueError, ranks that did not all arrive in time a RankError."""
    check_rendezvous_env()
    timeout = group_timeout_s()
    # The rendezvous waits in C++, where a signal reaches Python only once it returns: Ctrl-C
    # would wait out the whole timeout. It runs in a daemon thread while this one waits in
    # short, interruptible joins (a KeyboardInterrupt here leaves the thread to the exit).
    failure: list[BaseException] = []

    def form() -> None:
        try:
            dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout))
        except BaseException as error:  # handed to the caller's thread below
            failure.append(error)

    thread = threading.Thread(target=form, name="kvpool-join-group", daemon=True)
    thread.start()
    # torch bounds each of its waits by `timeout`, but not a store that accepts the connection
    # and never answers (MASTER_PORT held by another program: a rank > 0 waited for ever); the
    # rendezvous and then the pairs' connections each take at most `timeout`
    deadline = time.monotonic() + 2 * timeout + 10
    lookout = _Lookout()  # this rank's client of the rendezvous store, to hear who left
    next_look = time.monotonic() + LOOK_EVERY_S
    try:
        while thread.is_alive():
            thread.join(0.05)
            if thread.is_alive() and time.monotonic() >= next_look:
                lookout.look()
                next_look = time.monotonic() + LOOK_EVERY_S
            if time.monotonic() > deadline and thread.is_alive():  # (the thread is left to the exit)
                raise RankError(
                    f"rank {os.environ['RANK']} of {os.environ['WORLD_SIZE']}: the process group at "
                    f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']} did not form within "
                    f"{2 * timeout + 10:g} s, and torch did not give up: is MASTER_PORT served by another program "
                    f"than rank 0? start the ranks on a free port ({TIMEOUT_ENV} sets the wait)"
                )
    except KeyboardInterrupt:  # (Ctrl-C, or SIGTERM where the command turns it into one)
        lookout.say_left("was interrupted")
        raise
    else:
        lookout.say_done()
    finally:
        lookout.close()
    if failure:
        error = failure[0]
        if isinstance(error, dist.DistError):
            raise _group_error(error, timeout) from error
        raise error


# A rank interrupted while the group forms would leave the others waiting out the whole
# timeout: torch's rendezvous only counts who arrived, and gloo's pairs wait for peers
# that never connect. So each rank keeps a client of its own on the rendezvous store
# (rank 0's, or torchrun's; the forming thread's client is busy in its waits), not counted
# among the ranks; an interrupted rank writes LEFT_KEY there, and the others, looking every
# LOOK_EVERY_S, stop with one line. A store that closes under a look (rank 0, which serves
# it by hand, left) is the same news. A rank killed outright (SIGKILL, the OOM killer)
# writes nothing: so each rank also counts up a key of its own at every look (BEAT_KEY),
# "done" once its group formed, and a rank whose count has not moved for SILENT_S is gone.
# (A rank killed before its lookout connected is never heard of: the timeout, whose line
# says that a missing rank may have been killed.)
LEFT_KEY = "kvpool/left-while-forming"
BEAT_KEY = "kvpool/forming-beat"
LOOK_EVERY_S = 0.5
SILENT_S = 10.0  # 20 looks missed: a process stalled that long on a loaded machine is not seen


def _store_client() -> dist.Store | None:
    """A client of the rendezvous store that does not count as a rank; None while none answers
    (not started yet: this call waits up to a second for it)."""
    try:
        return dist.TCPStore(
            os.environ["MASTER_ADDR"],
            int(os.environ["MASTER_PORT"]),
            None,
            False,
            datetime.timedelta(seconds=1),
            wait_for_workers=False,
        )
    except (dist.DistError, RuntimeError):
        return None


def _store_closed_line(who: str, where: str) -> str:
    return (
        f"{who}: the rendezvous store at {where} closed while the process group formed: rank 0, which serves it, "
        "left; start the ranks again"
    )


class _Lookout:
    """One rank's watch on the rendezvous store while its group forms (LEFT_KEY above). Its
    client connects in a thread of its own: torch's client waits for ever on a port whose
    program accepts and never answers (join_group's deadline must still run)."""

    def __init__(self) -> None:
        self.store: dist.Store | None = None
        # torchrun's store outlives a restart of its workers: a key of each attempt
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        self.key = f"{LEFT_KEY}/{attempt}"
        self.beat_keys = [f"{BEAT_KEY}/{attempt}/{rank}" for rank in range(int(os.environ["WORLD_SIZE"]))]
        self.num_beats = 0
        self.heard: dict[int, tuple[bytes, float]] = {}  # rank -> (its count, when it last moved)
        self.closed = False
        threading.Thread(target=self._connect, name="kvpool-lookout", daemon=True).start()

    def _connect(self) -> None:
        # a plain socket first, until something listens: each failed try of torch's client
        # logs a C++ error and its frames where TORCH_CPP_LOG_LEVEL lets it (a script of the
        # user's); then one try (a program that accepts and never answers is no store)
        address = (os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))
        while not self.closed:
            try:
                socket.create_connection(address, timeout=0.5).close()
            except OSError:
                time.sleep(0.2)
                continue
            store = _store_client()
            self.store = None if self.closed else store
            return

    def look(self) -> None:
        """RankError when another rank left while the group formed (its key, or the store
        closed under this rank's client)."""
        store = self.store
        if store is None:  # not connected yet
            return
        who = f"rank {os.environ['RANK']} of {os.environ['WORLD_SIZE']}"
        where = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
        try:
            left = store.get(self.key).decode(errors="replace")[:200] if store.check([self.key]) else None
            self.num_beats += 1
            store.set(self.beat_keys[int(os.environ["RANK"])], str(self.num_beats))
            silent = self._silent_rank(store)
            if left is None and silent is not None:  # told to the others as a rank that left
                left = f"rank {silent} went silent (no word from it for {SILENT_S:g} s: killed, by a SIGKILL or "
                left += "the OOM killer?)"
                store.set(self.key, left)
        except dist.DistError:
            raise RankError(_store_closed_line(who, where)) from None
        if left is not None:
            if os.environ["RANK"] == "0":  # it serves the store: the others read why before it closes
                time.sleep(2 * LOOK_EVERY_S)
            raise RankError(f"{who}: {left} while the process group formed at {where}; start the ranks again")

    def _silent_rank(self, store: dist.Store) -> int | None:
        """The first other rank whose beat, once heard, has not moved for SILENT_S."""
        now = time.monotonic()
        for rank, key in enumerate(self.beat_keys):
            if rank == int(os.environ["RANK"]) or not store.check([key]):
                continue
            count = store.get(key)
            if count == b"done":
                continue
            if rank not in self.heard or self.heard[rank][0] != count:
                self.heard[rank] = (count, now)
            elif now - self.heard[rank][1] > SILENT_S:
                return rank
        return None

    def say_done(self) -> None:
        """This rank's group formed: its beat stops without meaning it left."""
        try:
            if self.store is not None:
                self.store.set(self.beat_keys[int(os.environ["RANK"])], "done")
        except dist.DistError:
            pass

    def say_left(self, why: str) -> None:
        """Tell the other ranks that this one leaves (best effort: a client not connected
        within a second says nothing)."""
        give_up = time.monotonic() + 1.0
        while self.store is None and time.monotonic() < give_up:
            time.sleep(0.02)
        try:
            if self.store is not None:
                self.store.set(self.key, f"rank {os.environ['RANK']} {why}")
        except dist.DistError:
            pass

    def close(self) -> None:
        # now, not when the traceback that holds this object goes: a client still open as
        # the interpreter exits, the group's thread in C++, aborted the process ("terminate
        # called without an active exception", status 134 for 130)
        self.closed = True
        self.store = None


def _group_error(error: Exception, timeout: float) -> Exception:
    """The one line for init_process_group's failure (torch's text is a C++ message)."""
    text = str(error)
    where = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
    who = f"rank {os.environ.get('RANK', '?')} of {os.environ.get('WORLD_SIZE', '?')}"
    if "EADDRINUSE" in text:
        return ValueError(f"MASTER_PORT is taken: {where} is in use by another process; start the ranks on a free port")
    joined = re.search(r"(\d+)/(\d+) clients joined", text)
    if joined:  # rank 0, which serves the rendezvous, counted who came
        return RankError(
            f"{who}: {joined[1]} of {joined[2]} ranks joined the process group at {where} within {timeout:g} s "
            f"({TIMEOUT_ENV} sets the wait); start every rank with the same MASTER_ADDR, MASTER_PORT and WORLD_SIZE "
            "(a rank that was started may have been killed before it joined)"
        )
    if "Connection was likely closed" in text:  # rank 0, whose store this rank waited on, left
        return RankError(_store_closed_line(who, where))
    if "wait timeout" in text:  # a key another rank was to post never came (gloo's addresses)
        return RankError(
            f"{who}: the process group at {where} did not form within {timeout:g} s: not every rank joined it "
            f"(one not started, or killed before it joined; {TIMEOUT_ENV} sets the wait); start the ranks again"
        )
    if "timed out" in text.lower():  # a rank > 0: nobody served the rendezvous
        return RankError(
            f"{who}: rank 0 did not answer at {where} within {timeout:g} s ({TIMEOUT_ENV} sets the wait); "
            "start rank 0 there with the same MASTER_PORT and WORLD_SIZE"
        )
    first = (text.strip().splitlines() or [type(error).__name__])[0]
    return RankError(f"{who}: the process group at {where} did not form ({first})")


def init_tp(tp: int) -> tuple[int, int]:
    """(rank, world size) for --tensor-parallel-size `tp`: 1 rank without torchrun; under
    torchrun its world, which must be `tp`; the gloo process group set up. ValueError
    otherwise."""
    if "RANK" in os.environ and tp > 1:
        check_rendezvous_env()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if tp == 1 and world == 1:
        return 0, 1
    if "RANK" not in os.environ:
        raise ValueError(
            f"--tensor-parallel-size {tp} runs under torchrun: torchrun --nproc-per-node {tp} -m kvpool ... "
            f"--tensor-parallel-size {tp}"
        )
    if world != tp:
        raise ValueError(
            f"--tensor-parallel-size {tp} under torchrun with {world} processes: start --nproc-per-node {tp}"
        )
    if not dist.is_initialized():
        join_group()
        atexit.register(_leave_process_group)
    return dist.get_rank(), world


def _leave_process_group() -> None:
    """Destroy the process group `init_tp` made before the interpreter exits: left to
    interpreter shutdown, gloo's threads could outlive it and a rank abort at exit
    ("terminate called without an active exception"; seen once in CI on `run --tp 3`)."""
    if dist.is_initialized():
        dist.destroy_process_group()


def digest(*parts: object) -> int:
    """A 63-bit hash of `parts` (their repr: ints, strings, lists and tuples of them)."""
    return xxhash.xxh3_64_intdigest(repr(parts).encode()) >> 1


def check_same(
    what: str,
    value: int,
    group: dist.ProcessGroup | None = None,
    peers: Sequence[Peer] | None = None,
    kind: str = "tensor-parallel",
) -> None:
    """Every rank of `group` holds the same `value` (a digest of `what`): RankError naming
    the ranks whose value differs from the group's first rank otherwise, on every rank
    (`kind`: whose ranks, in the line)."""
    world = dist.get_world_size(group)
    found = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    collective(peers, lambda: dist.all_gather(found, torch.tensor([value], dtype=torch.int64), group=group))
    values = [int(v) for v in found]
    if len(set(values)) == 1:
        return
    ranks = [dist.get_global_rank(group, i) if group is not None else i for i in range(world)]
    odd = [str(r) for r, v in zip(ranks, values, strict=True) if v != values[0]]
    raise RankError(
        f"rank {dist.get_rank()}: {kind} ranks diverged: rank{'s' if len(odd) > 1 else ''} "
        f"{', '.join(odd)} differ{'' if len(odd) > 1 else 's'} from rank {ranks[0]} in {what}; every rank must be "
        "started with the same arguments"
    )


def check_same_arguments(kind: str, *arguments: object) -> None:
    """Every rank of the default group was started with the same `arguments` (a verify
    command's): ranks started by hand with other flags would exchange tensors of other shapes
    (gloo aborts the process) or data (a wrong verdict). RankError naming them otherwise."""
    check_same("the command's arguments", digest(*arguments), kind=kind)


def step_digest(
    request_ids: Sequence[str], starts: Sequence[int], token_ids: Sequence[Sequence[int]], slots: Sequence[int]
) -> int:
    """What the ranks must agree on in a step: which sequences run, from where, on which
    token ids (so another prompt of the same length is caught), and the cache's slots."""
    return digest(list(request_ids), list(starts), [list(t) for t in token_ids], list(slots))


def check_same_step(value: int, model: LlamaModel) -> None:
    """Every rank of `model`'s group runs the same step (`step_digest`): RankError otherwise."""
    check_same("this step's token ids or cache slots", value, model.tp_group, getattr(model, "tp_peers", None))
