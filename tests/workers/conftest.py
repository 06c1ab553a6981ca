"""Fixtures shared by the model and engine tests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from workers.data.models import materialize


@pytest.fixture(scope="module")
def one_torch_thread() -> Iterator[None]:
    """One intra-op thread: the tiny model gains little from two, and two crawl when the cores are busy."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default tiny model (128x2: head size 32, which vLLM's CPU attention also takes)."""
    return materialize("tiny", tmp_path_factory.mktemp("models") / "tiny", seed=0)
