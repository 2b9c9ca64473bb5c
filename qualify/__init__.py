"""trust-ladder: qualifies KV-cache handoff between inference engines.

A producer lane computes a prompt's KV cache; a consumer decodes from it. The harness checks
the handoff against a cold local recompute on the consumer under a frozen contract and archives
every run as a verifiable receipt.

``__version__`` is the installed distribution's version, which setuptools-scm derives from git at
build time (``0.1.devN+g<commit>``, ``.d<date>`` when the tree was dirty). The engines' own version,
which identities pin, is :data:`qualify.engines.base.ENGINE_VERSION` and does not follow it.
"""

import sys
from importlib.metadata import Distribution
from pathlib import Path

_CHECKOUT = Path(__file__).resolve().parents[1]


def _distribution_version() -> str:
    """The installed trust-ladder version; ``0+unknown`` when the package runs uninstalled
    (a checkout on ``PYTHONPATH``): receipts then name the checkout's commit in host.json.

    The checkout itself is not searched: any setuptools build there leaves a
    ``trust_ladder.egg-info`` of that moment, which Python started in the checkout would find
    before the installed metadata, so the version would depend on the working directory."""
    search = [entry for entry in sys.path if Path(entry or ".").resolve() != _CHECKOUT]
    found = next(iter(Distribution.discover(name="trust-ladder", path=search)), None)
    return found.version if found is not None else "0+unknown"


__version__ = _distribution_version()
