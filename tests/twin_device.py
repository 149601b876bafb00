"""A stand-in for a GPU on a machine without one: tensors on the "meta" device (shapes and
dtypes, no memory), each shadowed by a CPU twin that holds the values a GPU would.

kvpool's device-only code (attention/backends/step_buffers.py's sends, engine/cuda_graph.py's
token ids, engine/batch_sampler.py's uniforms) runs only where the device is not the CPU: its
host buffers are then twins of device tensors, and a copy from one to the other is the only
way a value reaches the device. On the CPU those branches never run, so a dropped copy or
one to the wrong place fails no test. Under `TwinDevice`, code made for device="meta" takes
those branches, and every aten op that touches a meta tensor is also run on the twins (the
same op, the meta tensors replaced by their twins, device="meta" by the CPU): a copy from a
host buffer writes the twin, a view of a meta tensor is the same view of its twin (in-place
ops on it write the twin's memory), and reading a meta tensor's values (`.tolist()`,
`.item()`, `.cpu()`) gives the twin's. `values(t)` is what the "device" holds. A copy left
out leaves the twin as it was, a copy to the wrong place writes other entries: the twin then
differs from the host, which a test compares.

torch.cuda.Event and pin_memory are the CUDA parts the code calls besides: `patch_cuda`
replaces them with stand-ins (the Event counts host waits on events not yet passed: a step
marks where the device caught up, `TwinDevice.caught_up`). `patch_graphs` stands in for
torch.cuda's graph capture: a capture records the ops on device tensors (refusing host reads
and host memory, as a capture must), a replay runs them again on the same tensors, reading
their values then: what a graph baked in at capture shows as a wrong replay."""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

_META = torch.device("meta")


# The ops that read a device value on the host: `.item()` and `float(t)` reach the mode as aten.item
# (torch 2.13) or as its lowering, _local_scalar_dense (`int(t)`, `.tolist()`)
_HOST_READS = (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.item.default)


def _is_meta(x: object) -> bool:
    return isinstance(x, torch.Tensor) and x.device.type == "meta"


# The ops that take host (CPU) tensors beside device ones on CUDA: the copies between the two,
# and indexing, whose index tensors may be on the host (torch moves them). Every other op on a
# device tensor refuses a host tensor of one dimension or more (0-dimensional ones are scalars).
_TAKES_HOST_TENSORS = {
    torch.ops.aten.copy_.default,
    torch.ops.aten._to_copy.default,
    torch.ops.aten.index.Tensor,
    torch.ops.aten.index_put_.default,
    torch.ops.aten.index_put.default,
    torch.ops.aten._index_put_impl_.default,
}


class TwinDevice(TorchDispatchMode):
    """Every op on meta tensors mirrored on CPU twins (the module docstring). Meta tensors
    made while the mode is active get twins; one made before has none (an error names it)."""

    def __init__(self) -> None:
        super().__init__()
        self._twins: dict[int, torch.Tensor] = {}  # id(meta tensor) -> its CPU twin
        self.events: list[_Event] = []  # every Event recorded, in order (`patch_cuda`)
        self.host_waits = 0  # Event.synchronize() calls on an event the device had not passed
        self._captured: list | None = None  # the ops of the CUDA graph being captured (`patch_graphs`)

    # torch.tensor and torch.as_tensor from Python data (not a tensor) move what they made to
    # the device below the dispatch modes: a meta tensor made so would have no twin
    _FROM_DATA = ("tensor", "as_tensor")

    # and an index of a meta tensor by a Python list is made likewise (as a meta tensor):
    # the list is made a CPU tensor first, which indexes the twin as it would the list
    _INDEXING = ("__getitem__", "__setitem__")

    def __enter__(self):
        self._saved = {name: getattr(torch, name) for name in self._FROM_DATA}
        for name, make in self._saved.items():
            setattr(torch, name, _made_on_the_cpu_first(make))
        self._saved_indexing = {name: getattr(torch.Tensor, name) for name in self._INDEXING}
        for name, index in self._saved_indexing.items():
            setattr(torch.Tensor, name, _lists_as_cpu_tensors(index))
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            for name, make in self._saved.items():
                setattr(torch, name, make)
            for name, index in self._saved_indexing.items():
                setattr(torch.Tensor, name, index)

    def values(self, tensor: torch.Tensor) -> torch.Tensor:
        """The values a meta tensor holds on the stand-in device: its twin (a CPU tensor of
        the same shape and dtype, sharing memory with its base's twin as the views do)."""
        twin = self._twins.get(id(tensor))
        if twin is None:
            raise KeyError(f"TwinDevice: a meta tensor {tuple(tensor.shape)} {tensor.dtype} made outside the mode")
        return twin

    def caught_up(self) -> None:
        """The device finished every queued copy and kernel (a host synchronisation, as the
        step's read of its sampled tokens): every event recorded so far has passed."""
        for event in self.events:
            event.passed = True

    def _register(self, meta: torch.Tensor, twin: torch.Tensor) -> None:
        assert meta.shape == twin.shape and meta.dtype == twin.dtype, (meta.shape, twin.shape, meta.dtype, twin.dtype)
        key = id(meta)
        self._twins[key] = twin
        weakref.finalize(meta, self._twins.pop, key, None)

    def _twin_of(self, x: object) -> object:
        return self.values(x) if _is_meta(x) else x

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        flat, _ = tree_flatten((args, kwargs))
        device_kw = kwargs.get("device")
        touches_meta = any(map(_is_meta, flat)) or (device_kw is not None and torch.device(device_kw) == _META)
        if not touches_meta:
            return func(*args, **kwargs)
        if func not in _TAKES_HOST_TENSORS and any(map(_is_meta, flat)):  # (a factory like a host tensor: none)
            on_host = [x for x in flat if isinstance(x, torch.Tensor) and x.device.type == "cpu" and x.dim() > 0]
            if on_host:  # (as CUDA refuses it: only a copy moves a host tensor's values to the device)
                raise RuntimeError(
                    f"TwinDevice: {func} reads a host tensor {tuple(on_host[0].shape)} {on_host[0].dtype} on the device"
                )
        if self._captured is not None:
            self._check_capturable(func, flat)
        twin_args = tree_map(self._twin_of, args)
        twin_kwargs = {
            k: (torch.device("cpu") if k == "device" and v is not None else self._twin_of(v)) for k, v in kwargs.items()
        }
        twin_out = func(*twin_args, **twin_kwargs)
        meta_out_device = torch.device(device_kw) if device_kw is not None else None
        if meta_out_device is not None and meta_out_device.type == "cpu":
            return twin_out  # (a read of the device's values into host memory: the twin's)
        if func in _HOST_READS:
            return twin_out  # (.item(), .tolist(), float(): the twin's values)
        if func is torch.ops.aten.copy_.default and not _is_meta(args[0]):
            return twin_out  # (a copy into host memory: the twin's values written there)
        out = func(*args, **kwargs)
        outs, _ = tree_flatten(out)
        twins, _ = tree_flatten(twin_out)
        for o, t in zip(outs, twins, strict=True):
            # (an op's scratch outputs may be shaped by each kernel its own way: embedding_bag's
            # offset2bag is empty on meta; such an output gets no twin, and a read of it raises)
            if _is_meta(o) and id(o) not in self._twins and (o.shape, o.dtype) == (t.shape, t.dtype):
                self._register(o, t)
        if self._captured is not None:
            self._captured.append((func, args, kwargs, out))
        return out

    # ---- CUDA graphs (`patch_graphs`) ------------------------------------------------

    def _check_capturable(self, func, flat: list) -> None:
        """What CUDA refuses inside a capture (or what a replay would not redo): a read of
        the device's values on the host, and an op reading host memory (a copy from it is
        captured as a copy of the bytes there then, not of what they hold at replay)."""
        if func in _HOST_READS:
            raise RuntimeError("TwinDevice: a host read of a device value (.item(), .tolist()) inside a graph capture")
        on_host = [x for x in flat if isinstance(x, torch.Tensor) and x.device.type == "cpu" and x.dim() > 0]
        if on_host:
            raise RuntimeError(f"TwinDevice: {func} reads host memory inside a graph capture")

    def capture(self) -> list:
        """Start recording the ops on device tensors (a graph's kernels); the list fills
        until `end_capture`."""
        if self._captured is not None:
            raise RuntimeError("TwinDevice: a graph capture inside another")
        self._captured = []
        return self._captured

    def end_capture(self) -> None:
        self._captured = None

    def replay(self, ops: list) -> None:
        """Run a captured graph's ops again on the same device tensors, as a replay runs its
        kernels on the same memory: each op reads its inputs' values now, and its output is
        written where the capture's was (a view's is that memory already). (Inference mode:
        the captured forward's tensors were made in it, and are written here.)"""
        with torch.inference_mode():
            self._replay(ops)

    def _replay(self, ops: list) -> None:
        for func, args, kwargs, out in ops:
            twin_args = tree_map(self._twin_of, args)
            twin_kwargs = {
                k: (torch.device("cpu") if k == "device" and v is not None else self._twin_of(v))
                for k, v in kwargs.items()
            }
            twin_out = func(*twin_args, **twin_kwargs)
            outs, _ = tree_flatten(out)
            twins, _ = tree_flatten(twin_out)
            for o, t in zip(outs, twins, strict=True):
                captured = self._twins.get(id(o)) if _is_meta(o) else None
                # (a view or an in-place op's output is the captured memory itself; an op that
                # may alias, as .to(dtype), made new memory only when it did not)
                if captured is not None and t.untyped_storage().data_ptr() != captured.untyped_storage().data_ptr():
                    captured.copy_(t)


def _made_on_the_cpu_first(make):
    """torch.tensor / torch.as_tensor for the stand-in: data meant for device="meta" made on
    the CPU, then moved by a copy the mode sees (which gives it its twin)."""

    def made(data, *args, device=None, **kwargs):
        if device is not None and torch.device(device) == _META:
            return make(data, *args, **kwargs).to(_META)
        return make(data, *args, device=device, **kwargs)

    return made


def _lists_as_cpu_tensors(index_op):
    """Tensor.__getitem__ / __setitem__ for the stand-in: on a meta tensor, each list in the
    index as the CPU tensor torch would make of it (a CPU index is read on any device)."""

    def as_tensors(key):
        if isinstance(key, list):
            return torch.as_tensor(key)
        if isinstance(key, tuple):
            return tuple(torch.as_tensor(k) if isinstance(k, list) else k for k in key)
        return key

    def indexed(self, key, *value):
        return index_op(self, as_tensors(key) if _is_meta(self) else key, *value)

    return indexed


class _Event:
    """torch.cuda.Event's part the code uses, on the stand-in: `record` marks the queued work
    so far; `synchronize` on an event the device has not passed is a host wait (counted)."""

    def __init__(self, device: TwinDevice) -> None:
        self.device, self.passed, self.stream = device, False, None

    def record(self, stream: object = None) -> None:
        self.passed, self.stream = False, stream
        self.device.events.append(self)

    def synchronize(self) -> None:
        if not self.passed:
            self.device.host_waits += 1
            self.passed = True  # (the host waited until it passed)

    def query(self) -> bool:
        return self.passed


def patch_cuda(monkeypatch, device: TwinDevice) -> None:
    """torch.cuda.Event as the stand-in's `_Event`, and pin_memory (the method, and torch.empty's
    argument) as a no-op (a machine without CUDA cannot pin: the host buffers are plain CPU
    memory, which the twins copy)."""
    monkeypatch.setattr(torch.cuda, "Event", lambda *a, **k: _Event(device))
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self, *a, **k: self)
    empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, pin_memory=False, **k: empty(*a, **k))


class _Stream:
    """A CUDA stream's part the capture calls (orders nothing: the stand-in runs in order)."""

    def wait_stream(self, other: object) -> None:
        pass


class _Graph:
    """torch.cuda.CUDAGraph on the stand-in: the ops its capture recorded, replayed by
    `TwinDevice.replay`; `pool()` the pool id the capture was given or a new one."""

    _next_pool = 1

    def __init__(self, device: TwinDevice) -> None:
        self.device, self.ops, self.pool_id, self.num_replays = device, None, None, 0

    def replay(self) -> None:
        assert self.ops is not None, "a graph replayed before its capture"
        self.device.replay(self.ops)
        self.num_replays += 1

    def pool(self) -> tuple[int, int]:
        return self.pool_id


def patch_graphs(monkeypatch, device: TwinDevice, segments=lambda: []) -> list[_Graph]:
    """torch.cuda's graph capture on the stand-in (with `patch_cuda`): CUDAGraph, the
    torch.cuda.graph context (recording the ops of its body: `TwinDevice.capture`), Stream,
    current_stream and torch.cuda.stream (no ordering to model), memory_snapshot (the
    allocator segments `segments()` returns). Returns the list every graph made joins."""
    graphs: list[_Graph] = []

    def make_graph() -> _Graph:
        graphs.append(_Graph(device))
        return graphs[-1]

    class _Capture:
        def __init__(self, graph: _Graph, pool=None, stream=None) -> None:
            self.graph, self.given_pool = graph, pool

        def __enter__(self) -> None:
            device.caught_up()  # (torch.cuda.graph synchronises the device as a capture begins)
            if self.given_pool is None:
                self.given_pool, _Graph._next_pool = (_Graph._next_pool, 0), _Graph._next_pool + 1
            self.graph.pool_id = self.given_pool
            self.graph.ops = device.capture()

        def __exit__(self, *exc) -> None:
            device.end_capture()

    class _Within:
        def __init__(self, stream: object) -> None:
            pass

        def __enter__(self) -> None:
            pass

        def __exit__(self, *exc) -> None:
            pass

    monkeypatch.setattr(torch.cuda, "CUDAGraph", make_graph)
    monkeypatch.setattr(torch.cuda, "graph", _Capture)
    monkeypatch.setattr(torch.cuda, "Stream", lambda *a, **k: _Stream())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a, **k: _Stream())
    monkeypatch.setattr(torch.cuda, "stream", _Within)
    monkeypatch.setattr(torch.cuda, "memory_snapshot", lambda: list(segments()))
    return graphs
