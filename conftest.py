"""Root conftest: a test's optional dependency follows from its folder.

``tests/unit/<layer>/`` mirrors ``qualify/<layer>/`` and needs only the base install;
``tests/system/`` runs the harness end to end; ``tests/tools/`` checks the repo's own tools. Each
optional dependency has one folder, and a test needs it exactly when it lives there:

- ``tests/torch/`` (torch and transformers), ``tests/cuda/`` (an NVIDIA GPU under torch),
  ``tests/vllm/`` (vLLM, in ``.venv-vllm``), ``tests/browser/`` (headless Chromium), and
  ``tests/netns/`` (root and ``ip netns``; that folder's tests probe it themselves).

Every item collected there gets the folder's marker, so ``-m "not torch"`` selects by folder. A
module whose dependency is missing is not imported: it is reported skipped, naming what it needs.
A ``QUALIFY_REQUIRE_<NAME>=1`` variable (CI sets the ones its host must have) makes it a failure
instead, so a host without the dependency cannot pass those tests silently. Writing one of these
markers by hand outside its folder is a collection error: the folder is the one place that says it.
"""

from __future__ import annotations

import functools
import importlib.util
import itertools
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent / "tests"


def _importable(*modules: str) -> Callable[[], bool]:
    return lambda: all(importlib.util.find_spec(module) is not None for module in modules)


def _cuda_available() -> bool:
    if not _importable("torch")():
        return False
    import torch

    return bool(torch.cuda.is_available())


def _chromium_available() -> bool:
    from qualify.interfaces.report_browser import find_chromium

    return find_chromium() is not None


# folder (= marker) -> (probe, what it needs). netns has no probe here: its tests check root and
# `ip netns` themselves (QUALIFY_REQUIRE_NETNS turns their skip into a failure).
FOLDER_REQUIREMENTS: dict[str, tuple[Callable[[], bool] | None, str]] = {
    "torch": (_importable("torch", "transformers"), "needs the torch extra: pip install -e '.[torch]'"),
    "cuda": (_cuda_available, "needs an NVIDIA GPU with CUDA under torch; none is present here"),
    "vllm": (_importable("vllm"), "needs the vllm extra: bash tools/install_vllm.sh, then run it with .venv-vllm/bin/python"),
    "browser": (_chromium_available, "needs headless Chromium (Debian: apt-get install chromium)"),
    "netns": (None, "needs root and ip netns"),
}


def _folder_of(path: Path) -> str | None:
    """The optional-dependency folder ``path`` lies in, if any."""
    try:
        first = path.resolve().relative_to(TESTS).parts[0]
    except (ValueError, IndexError):
        return None
    return first if first in FOLDER_REQUIREMENTS else None


@functools.cache
def _available(folder: str) -> bool:
    probe, _ = FOLDER_REQUIREMENTS[folder]
    return probe is None or probe()


def _required(folder: str) -> bool:
    return os.environ.get(f"QUALIFY_REQUIRE_{folder.upper()}", "") == "1"


class MissingDependencyItem(pytest.Item):
    """Stands for a module whose folder's dependency is absent (the module is never imported): it
    skips naming the dependency, or fails where the dependency is required
    (QUALIFY_REQUIRE_<NAME>=1). An item, not a collection skip, so the run reports it, a JUnit file
    counts it, and a tier of such modules still ran something."""

    reason: str = ""
    required: bool = False

    def runtest(self) -> None:
        if self.required:
            raise pytest.fail.Exception(self.reason, pytrace=False)
        raise pytest.skip.Exception(self.reason)

    def reportinfo(self) -> tuple[Path, int, str]:
        return self.path, 0, self.name


class MissingDependencyModule(pytest.File):
    reason: str = ""
    required: bool = False

    def collect(self) -> Iterator[pytest.Item]:
        item = MissingDependencyItem.from_parent(self, name="dependency")
        item.reason, item.required = self.reason, self.required
        yield item


@pytest.hookimpl(tryfirst=True)
def pytest_pycollect_makemodule(module_path: Path, parent: pytest.Collector) -> pytest.File | None:
    folder = _folder_of(module_path)
    if folder is None or _available(folder):
        return None
    _, needs = FOLDER_REQUIREMENTS[folder]
    module = MissingDependencyModule.from_parent(parent, path=module_path)
    module.required = _required(folder)
    module.reason = (f"QUALIFY_REQUIRE_{folder.upper()}=1 and " if module.required else "") + f"tests/{folder}/ {needs}"
    return module


LONGEST_FIRST = (
    "tests/system/test_published_model_kquant.py",
    "tests/system/test_published_model_teacher_forced.py",
    "tests/system/test_onboarding_doc.py",
    "tests/system/test_portability.py",
    "tests/system/test_cancellation.py",
    "tests/unit/archive/test_fuzz_signed_receipts.py",
    "tests/unit/archive/test_fuzz_receipts.py",
    "tests/unit/interfaces/test_report.py",
    "tests/system/test_calibration_can_fail.py",
    "tests/unit/engines/test_speculative.py",
    "tests/unit/engines/test_reference_engine.py",
    "tests/vllm/test_vllm_lanes.py",
    "tests/vllm/test_connector_qualify.py",
    "tests/vllm/test_served_pair.py",
)
"""Modules whose tests take longest, longest first (seconds of their tests in one run of each tier
on 2 cores, 2026-12-06, other work beside it: slow tier 288, 264, 166, 128, 123, 117, 110, 99, 92,
79; vLLM tier 346, 345, 328): collected first, so that the two workers start on them (the first
blocks are dealt module by module, :func:`pytest_xdist_make_scheduler`) and the short tests fill
the end, instead of one long test tailing the tier."""


def _longest_first(items: list[pytest.Item]) -> None:
    rank = {path: index for index, path in enumerate(LONGEST_FIRST)}
    root = Path(__file__).parent
    # A stable sort: the other tests keep their collected order.
    items.sort(key=lambda item: rank.get(item.path.relative_to(root).as_posix() if item.path.is_relative_to(root)
                                         else "", len(rank)))


@pytest.hookimpl(optionalhook=True)  # xdist's hook: a run without xdist (-p no:xdist) never calls it
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object | None:
    """xdist's ``load`` scheduling (``-n`` alone) with its first blocks dealt module by module;
    other ``--dist`` modes are xdist's own."""
    if config.getvalue("dist") != "load":
        return None
    from xdist.scheduler import LoadScheduling

    class ModulesDealtScheduling(LoadScheduling):
        """xdist sends each worker a first block of consecutive tests (a quarter of its share), so
        the longest modules, collected first, all went to the first worker, which ran them one
        after another while the other worker ended minutes earlier. Here those first blocks are
        dealt whole module by whole module, round robin, in collected order (longest first); the
        rest is xdist's: more tests to whichever worker runs low."""

        def schedule(self) -> None:
            if self.collection is not None or not self._check_nodes_have_same_collection():
                super().schedule()  # rescheduling, or xdist's own refusal of differing collections
                return
            self.collection = next(iter(self.node2collection.values()))
            if self.maxschedchunk is None:  # as xdist's own schedule() sets it
                self.maxschedchunk = len(self.collection)
            per_node = max(min(len(self.collection) // len(self.nodes) // 4, self.maxschedchunk), 2)
            modules: dict[str, list[int]] = {}
            for index, nodeid in enumerate(self.collection):
                modules.setdefault(nodeid.split("::", 1)[0], []).append(index)
            dealt: dict[object, list[int]] = {node: [] for node in self.nodes}
            turns = itertools.cycle(self.nodes)
            for indexes in modules.values():
                if all(len(block) >= per_node for block in dealt.values()):
                    break
                node = next(node for node in turns if len(dealt[node]) < per_node)
                dealt[node] += indexes[:per_node - len(dealt[node])]  # the module's rest stays pending
            sent = {index for block in dealt.values() for index in block}
            self.pending[:] = [index for index in range(len(self.collection)) if index not in sent]
            for node, block in dealt.items():
                if not block:  # fewer modules than workers: the next tests, as xdist would
                    block += self.pending[:per_node]
                    del self.pending[:per_node]
                if block:
                    self.node2pending[node].extend(block)
                    node.send_runtest_some(block)
            if not self.pending:
                for node in self.nodes:
                    node.shutdown()

    return ModulesDealtScheduling(config, log)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    _longest_first(items)
    misplaced = []
    for item in items:
        folder = _folder_of(item.path)
        misplaced += [f"{item.nodeid} is marked {name} outside tests/{name}/"
                      for name in FOLDER_REQUIREMENTS if name != folder and item.get_closest_marker(name) is not None]
        if folder is not None:
            item.add_marker(getattr(pytest.mark, folder))
            if folder == "cuda":  # a CUDA test needs torch too
                item.add_marker(pytest.mark.torch)
    if misplaced:
        shown = "; ".join(misplaced[:5]) + (f"; and {len(misplaced) - 5} more" if len(misplaced) > 5 else "")
        raise pytest.UsageError(f"optional-dependency markers follow the folder; move these tests: {shown}")
