"""Root conftest: skips optional-dependency tests with a reason.

Markers (declared in pyproject.toml): ``torch``, ``vllm`` and ``cuda`` tests run only where their
dependency is importable (or a GPU is present) and are skipped with a stated reason otherwise;
``slow`` tests run in CI (.ci/run) like the rest. ``browser`` tests need headless Chromium and are
skipped with a reason where it is absent, unless ``QUALIFY_REQUIRE_BROWSER=1`` (CI sets it): then
they fail, so a CI host without Chromium cannot pass them silently.
"""

from __future__ import annotations

import functools
import importlib.util
import os

import pytest


def _cuda_available() -> bool:
    if importlib.util.find_spec("torch") is None:
        return False
    import torch

    return bool(torch.cuda.is_available())


def _chromium_available() -> bool:
    from qualify.interfaces.report_browser import find_chromium

    return find_chromium() is not None


_REQUIREMENTS = {
    "torch": (lambda: importlib.util.find_spec("torch") is not None
              and importlib.util.find_spec("transformers") is not None,
              "needs the torch extra: pip install -e '.[torch]'"),
    "vllm": (lambda: importlib.util.find_spec("vllm") is not None,
             "needs the vllm extra: tools/install_vllm.sh"),
    "cuda": (_cuda_available, "needs an NVIDIA GPU with CUDA; none is present here"),
    "browser": (_chromium_available, "needs headless Chromium (Debian: apt-get install chromium)"),
}

_REQUIRED_BY = {"browser": "QUALIFY_REQUIRE_BROWSER"}
"""Requirements an environment variable set to 1 makes mandatory: absent, the test fails."""


@functools.cache
def _available(marker_name: str) -> bool:
    """Whether ``marker_name``'s requirement is met, probed once per session."""
    probe, _ = _REQUIREMENTS[marker_name]
    return probe()


def _required(marker_name: str) -> bool:
    return os.environ.get(_REQUIRED_BY.get(marker_name, ""), "") == "1"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        for marker_name, (_, reason) in _REQUIREMENTS.items():
            if item.get_closest_marker(marker_name) is None:
                continue
            if not _available(marker_name) and not _required(marker_name):
                item.add_marker(pytest.mark.skip(reason=reason))


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_call(item: pytest.Item) -> None:
    # In the call phase, before the test body: the test is reported failed, not a setup error.
    for marker_name, variable in _REQUIRED_BY.items():
        if item.get_closest_marker(marker_name) is not None and _required(marker_name) and not _available(marker_name):
            _, reason = _REQUIREMENTS[marker_name]
            pytest.fail(f"{variable}=1 and this test {reason}", pytrace=False)
