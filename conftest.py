"""Root conftest: loads the qualify pytest plugin and skips optional-dependency tests with a reason.

Markers (declared in pyproject.toml): ``torch``, ``vllm`` and ``cuda`` tests run only where their
dependency is importable (or a GPU is present) and are skipped with a stated reason otherwise;
``slow`` tests run in CI (.ci/run) like the rest.
"""

from __future__ import annotations

import importlib.util

import pytest

pytest_plugins = ["qualify.interfaces.plugin"]


def _cuda_available() -> bool:
    if importlib.util.find_spec("torch") is None:
        return False
    import torch

    return bool(torch.cuda.is_available())


_REQUIREMENTS = {
    "torch": (lambda: importlib.util.find_spec("torch") is not None
              and importlib.util.find_spec("transformers") is not None,
              "needs the torch extra: pip install -e '.[torch]'"),
    "vllm": (lambda: importlib.util.find_spec("vllm") is not None,
             "needs the vllm extra: tools/install_vllm.sh"),
    "cuda": (_cuda_available, "needs an NVIDIA GPU with CUDA; none is present here"),
}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    available: dict[str, bool] = {}
    for item in items:
        for marker_name, (probe, reason) in _REQUIREMENTS.items():
            if item.get_closest_marker(marker_name) is None:
                continue
            if marker_name not in available:
                available[marker_name] = probe()
            if not available[marker_name]:
                item.add_marker(pytest.mark.skip(reason=reason))
