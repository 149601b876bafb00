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
marks where the device caught up, `TwinDevice.caught_up`)."""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

_META = torch.device("meta")


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
        twin_args = tree_map(self._twin_of, args)
        twin_kwargs = {
            k: (torch.device("cpu") if k == "device" and v is not None else self._twin_of(v)) for k, v in kwargs.items()
        }
        twin_out = func(*twin_args, **twin_kwargs)
        meta_out_device = torch.device(device_kw) if device_kw is not None else None
        if meta_out_device is not None and meta_out_device.type == "cpu":
            return twin_out  # (a read of the device's values into host memory: the twin's)
        if func is torch.ops.aten._local_scalar_dense.default:
            return twin_out  # (.item(), .tolist(): the twin's values)
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
        return out


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
