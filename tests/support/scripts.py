"""Loading the repository's scripts (tools/, bench/) as modules, so tests call their functions."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType


def load_script(path: Path) -> ModuleType:
    """The script at ``path`` imported under its file stem (not run as ``__main__``)."""
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # a dataclass with string annotations looks its module up there
    spec.loader.exec_module(module)
    return module
