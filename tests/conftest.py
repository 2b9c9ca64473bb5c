"""Fixtures the engine tests share: one torch thread, the numpy reference engine, the main prompt."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from qualify.core import assets
from qualify.engines.reference import ReferenceEngine
from tests.support import fuzz_budget  # noqa: F401  (loads hypothesis's smaller profile in a mutation run)
from tests.support.golden import UPDATE_OPTION, Golden
from tests.support.published import NAME as PUBLISHED_MODEL


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("qualify", "trust-ladder's own tests")
    group.addoption(UPDATE_OPTION, action="store_true", default=False, dest="qualify_update_goldens",
                    help="rewrite the golden files under tests/golden/ from what the tests render now, instead of "
                         "failing on a difference (then review the diff)")


GOLDEN_WRITES = pytest.StashKey[list[str]]()


@pytest.fixture
def golden(request: pytest.FixtureRequest) -> Golden:
    """Compares a rendering with its golden file (tests/support/golden.py); under
    ``--qualify-update-goldens`` rewrites it, and the run's summary lists every file rewritten."""
    written = request.config.stash.setdefault(GOLDEN_WRITES, [])
    return Golden(update=bool(request.config.getoption("qualify_update_goldens", default=False)), written=written)


@pytest.fixture(scope="session", autouse=True)
def own_signing_config(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Every test signs receipts with a key made in a config directory of its own session, never
    the operator's (``XDG_CONFIG_HOME`` is where ``qualify.archive.keys`` keeps key and trust file;
    subprocesses inherit it)."""
    with pytest.MonkeyPatch.context() as patch:
        config = tmp_path_factory.mktemp("config")
        patch.setenv("XDG_CONFIG_HOME", str(config))
        yield config


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


# -- fuzz tallies ------------------------------------------------------------------------------
# A fuzz test records what its examples did with ``fuzz_tally``; the counts ride on the test's
# report (so they survive pytest-xdist and land in the JUnit XML as properties) and are printed
# at the end of the run, one line per test: the record the fuzz counts are quoted from.

FUZZ_PROPERTY = "fuzz_tally"
_FUZZ_LINES: list[str] = []


class FuzzTally:
    """Counts of a fuzz test's outcomes (``examples``, ``refused``, ``accepted``, ...)."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}

    def add(self, outcome: str, count: int = 1) -> None:
        self.counts[outcome] = self.counts.get(outcome, 0) + count


@pytest.fixture
def fuzz_tally(record_property: Callable[[str, object], None]) -> Iterator[FuzzTally]:
    tally = FuzzTally()
    yield tally
    record_property(FUZZ_PROPERTY, " ".join(f"{name}={count}" for name, count in sorted(tally.counts.items())))


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.when != "teardown":
        return
    for name, value in report.user_properties:
        if name == FUZZ_PROPERTY:
            _FUZZ_LINES.append(f"{report.nodeid}: {value}")


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if _FUZZ_LINES:
        terminalreporter.section("fuzz tallies")
        for line in sorted(_FUZZ_LINES):
            terminalreporter.write_line(line)
    if terminalreporter.config.getoption("qualify_update_goldens", default=False):
        written = terminalreporter.config.stash.get(GOLDEN_WRITES, [])
        terminalreporter.section("golden files")
        for name in sorted(written):
            terminalreporter.write_line(f"rewritten: {name} (review its diff)")
        if not written:
            terminalreporter.write_line("every golden file checked already held what the tests render")


# -- an isolated command line ------------------------------------------------------------------


def isolate_cli_environment(monkeypatch: pytest.MonkeyPatch, *, cwd: Path, archive: Path, data: Path) -> None:
    """Run the CLI in-process as a newcomer would, writing nowhere else: ``cwd`` as the working
    directory, ``archive`` as the default receipt archive, ``data`` as the data home, and none of
    the operator's registry, keys or debug switches."""
    monkeypatch.chdir(cwd)
    monkeypatch.setenv("QUALIFY_RECEIPTS", str(archive))
    monkeypatch.setenv("XDG_DATA_HOME", str(data))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(data / "config"))
    for name in ("QUALIFY_REGISTRY", "QUALIFY_KEYS", "QUALIFY_DEBUG"):
        monkeypatch.delenv(name, raising=False)


def small_calibration_set(directory: Path, prompt_lengths: tuple[int, ...] = (256,)) -> tuple[Any, str]:
    """The committed calibration set's documents at shorter prompt lengths, written to
    ``directory`` and loaded (set, digest): a real calibration in seconds, for tests of its path.
    Its digest differs from the committed set's, so no shipped identity can be frozen from it."""
    import json

    from qualify.contract.controls import CALIBRATION_SET_PATH, load_calibration_set

    document = json.loads(CALIBRATION_SET_PATH.read_text(encoding="utf-8"))
    document["prompt_lengths"] = list(prompt_lengths)
    path = directory / "calibration-set-small.json"
    path.write_text(json.dumps(document), encoding="utf-8")
    return load_calibration_set(path)


@pytest.fixture
def published_model() -> Iterator[None]:
    """The model's package present (failed, not skipped, under QUALIFY_REQUIRE_PUBLISHED_MODELS=1),
    and the process back on the shipped model afterwards (the choice is per process)."""
    from qualify.engines.chosen_model import use_model
    from qualify.engines.model_source import PUBLISHED_MODELS

    published = PUBLISHED_MODELS[PUBLISHED_MODEL]
    try:
        metadata.distribution(published.distribution)
    except metadata.PackageNotFoundError:
        message = f"{published.distribution}=={published.version} is not installed (tools/install_vllm.sh installs it)"
        if os.environ.get("QUALIFY_REQUIRE_PUBLISHED_MODELS") == "1":
            pytest.fail(message)
        pytest.skip(message)
    try:
        yield
    finally:
        use_model(None)
