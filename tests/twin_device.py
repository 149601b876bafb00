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


class TwinDevice(TorchDispatchMode):
    """Every op on meta tensors mirrored on CPU twins (the module docstring). Meta tensors
    made while the mode is active get twins; one made before has none (an error names it)."""

    def __init__(self) -> None:
        super().__init__()
        self._twins: dict[int, torch.Tensor] = {}  # id(meta tensor) -> its CPU twin
        self.events: list[_Event] = []  # every Event recorded, in order (`patch_cuda`)
        self.host_waits = 0  # Event.synchronize() calls on an event the device had not passed

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
        out = func(*args, **kwargs)
        outs, _ = tree_flatten(out)
        twins, _ = tree_flatten(twin_out)
        for o, t in zip(outs, twins, strict=True):
            if _is_meta(o) and id(o) not in self._twins:
                self._register(o, t)
        return out


class _Event:
    """torch.cuda.Event's part the code uses, on the stand-in: `record` marks the queued work
    so far; `synchronize` on an event the device has not passed is a host wait (counted)."""

    def __init__(self, device: TwinDevice) -> None:
        self.device, self.passed = device, False

    def record(self, stream: object = None) -> None:
        self.passed = False
        self.device.events.append(self)

    def synchronize(self) -> None:
        if not self.passed:
            self.device.host_waits += 1
            self.passed = True  # (the host waited until it passed)

    def query(self) -> bool:
        return self.passed


def patch_cuda(monkeypatch, device: TwinDevice) -> None:
    """torch.cuda.Event as the stand-in's `_Event`, and pin_memory as a no-op (a machine
    without CUDA cannot pin: the host buffers are plain CPU memory, which the twins copy)."""
    monkeypatch.setattr(torch.cuda, "Event", lambda *a, **k: _Event(device))
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self, *a, **k: self)
