"""Worker tests run torch on one intra-op thread.

The models are tiny, so extra threads buy nothing, and on a shared machine with few cores
OpenMP's spinning threads make small ops ten times slower (an AdaDp run went from ~1 s to ~14 s).
The previous setting is restored afterwards.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest


@pytest.fixture(autouse=True)
def _one_torch_thread() -> Iterator[None]:
    try:
        import torch
    except ImportError:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)
