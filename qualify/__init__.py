"""trust-ladder: qualifies KV-cache handoff between inference engines.

A producer lane computes a prompt's KV cache; a consumer decodes from it. The harness checks
the handoff against a cold local recompute on the consumer under a frozen contract and archives
every run as a verifiable receipt.

``__version__`` is the harness's version (:func:`harness_version`): setuptools-scm derives it from
git (``0.1.devN+g<commit>``, ``.d<date>`` when the tree was dirty). The engines' own version, which
identities pin, is :data:`qualify.engines.base.ENGINE_VERSION` and does not follow it.
"""

import sys
from collections.abc import Sequence
from pathlib import Path

PACKAGE_PARENT = Path(__file__).resolve().parents[1]
"""The directory holding this ``qualify`` package: a checkout (it has ``pyproject.toml``), or the
``site-packages`` a wheel was installed into (it holds the wheel's ``*.dist-info``)."""

UNKNOWN_VERSION = "0+unknown"
"""The version of a package that runs from no install and no checkout git can describe."""

DISTRIBUTION = "trust-ladder"


def _first_version(path: Sequence[str]) -> str | None:
    from importlib.metadata import Distribution  # imported on use: the package's import stays cheap

    found = next(iter(Distribution.discover(name=DISTRIBUTION, path=list(path))), None)
    return None if found is None else found.version


def _scm_version(checkout: Path) -> str | None:
    """setuptools-scm's version of the checkout (None when it is not installed or git cannot say):
    a build dependency, so a development venv need not have it."""
    try:
        from setuptools_scm import get_version
    except ImportError:
        return None
    try:
        return str(get_version(root=str(checkout), fallback_version=None))
    except Exception:  # no git, not a repository, a shallow clone: the installed metadata says it instead
        return None


def harness_version(package_parent: Path = PACKAGE_PARENT, search_path: Sequence[str] | None = None) -> str:
    """The version of the harness whose ``qualify`` package sits in ``package_parent``.

    Installed from a wheel, it is the metadata installed beside the package (``importlib.metadata``,
    looked up there only: a ``trust_ladder.egg-info`` in the working directory is another build's).
    In a checkout it is setuptools-scm's, else the installed (editable) metadata found on
    ``search_path`` (default ``sys.path``) outside the checkout: any setuptools build there leaves an
    egg-info of that moment, which Python started in the checkout would find first.
    ``0+unknown`` when none says."""
    if not (package_parent / "pyproject.toml").is_file():
        return _first_version([str(package_parent)]) or UNKNOWN_VERSION
    search = [entry for entry in (sys.path if search_path is None else search_path)
              if Path(entry or ".").resolve() != package_parent]
    return _scm_version(package_parent) or _first_version(search) or UNKNOWN_VERSION


_VERSION: list[str] = []


def __getattr__(name: str) -> str:
    """``__version__``, computed on first use (:func:`harness_version`; in a checkout it asks git):
    importing the package stays cheap, so the executable answers an interrupt from its first
    milliseconds (:mod:`qualify.interfaces.launch`)."""
    if name == "__version__":
        if not _VERSION:
            _VERSION.append(harness_version())
        return _VERSION[0]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
