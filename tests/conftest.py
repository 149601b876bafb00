"""Shared fixtures."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op torch thread for a test module: with two cores shared by the test run,
    oversubscribed OpenMP threads make tiny matrix ops far slower, not faster."""
    import torch

    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)
