"""What the step buffers send to a device (attention/backends/step_buffers.py `_send`): the
step's changed table entries leave their pinned staging buffer as one contiguous tensor of
that buffer's memory, so the copy is the asynchronous pinned one. On a machine without a
GPU the buffers are made for the "meta" device (host twins as on CUDA, device tensors
without memory) and `.to()` is watched; the values sent: tests/test_step_buffers_changed.py."""

from __future__ import annotations

import torch

from kvpool.attention.backends.step_buffers import StepBuffers


class _Event:  # the part of torch.cuda.Event the buffers use, for a machine without CUDA
    def record(self) -> None:
        pass

    def synchronize(self) -> None:
        pass


def test_the_changed_entries_are_sent_from_a_contiguous_slice_of_the_staging_buffer(monkeypatch) -> None:
    """Each step's [2, k] (flat index, block id) staging is contiguous, starts the pinned
    buffer (its own memory: no pageable copy in between), and holds the step's changes: sent
    entries applied to a twin of the device's tables give the host's tables, step by step
    (a strided column slice, the old staging, fails the first check; a [k, 2] view of the
    same memory the last)."""
    b = StepBuffers(max_num_seqs=4, max_num_tokens=16, max_blocks_per_seq=4, block_size=4, device="meta")
    staging = b._changes_host
    sent: list[torch.Tensor] = []
    original = torch.Tensor.to

    def to(self, *args, **kwargs):
        if self.untyped_storage().data_ptr() == staging.untyped_storage().data_ptr():
            assert self.is_contiguous() and self.data_ptr() == staging.data_ptr() and self.shape[0] == 2
            sent.append(self.clone())
        return original(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "to", to)
    monkeypatch.setattr(torch.cuda, "Event", _Event)
    twin = b._tables_host.clone()  # the device's tables, as the sends leave them
    steps = [
        (["a", "b"], [0, 0], [6, 3], [[7, 2], [5]]),  # prefills of 2 blocks and of 1
        (["a", "b"], [6, 3], [7, 5], [[7, 2], [5, 9]]),  # decodes: "b" opens its second block
        (["b", "c"], [5, 0], [6, 9], [[5, 9], [1, 3, 8]]),  # "a" gone, "c" joins with 3 blocks
    ]
    for step in steps:
        before = len(sent)
        b.update(*step)
        assert len(sent) == before + 1
        index, value = sent[-1]
        twin.view(-1)[index] = value.to(torch.int32)
        assert torch.equal(twin, b._tables_host), step
