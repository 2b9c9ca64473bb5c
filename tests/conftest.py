"""Fixtures the engine tests share: one torch thread, the numpy reference engine, the main prompt."""

from __future__ import annotations

import numpy as np
import pytest

from qualify.core import assets
from qualify.engines.reference import ReferenceEngine


@pytest.fixture(scope="module")
def one_torch_thread() -> None:
    """A shared 2-core CI machine: torch on one thread (for speed; the numpy engines' bits do not
    depend on thread counts)."""
    import torch

    torch.set_num_threads(1)


@pytest.fixture(scope="module")
def reference() -> ReferenceEngine:
    return ReferenceEngine.from_model_dir()


@pytest.fixture(scope="module")
def prompt() -> np.ndarray:
    """The recipe's fixture prompt (2048 token ids)."""
    return assets.load_prompt()
