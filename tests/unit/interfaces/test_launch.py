"""The ``qualify`` executable's entry point (``qualify.interfaces.launch``): an interrupt while the
command line interface loads is one line and exit 130, never a traceback."""

from __future__ import annotations

import subprocess
import sys

import pytest

# An interrupt arriving while the named module is imported, as SIGINT would land there, then the
# executable's own entry point, as its console script calls it.
INTERRUPTED_IMPORT = """
import builtins, sys
real_import = builtins.__import__
module = sys.argv[1]
def interrupting_import(name, globals=None, locals=None, fromlist=(), level=0):
    if name == module or (fromlist and f"{name}.{fromlist[0]}" == module):
        raise KeyboardInterrupt
    return real_import(name, globals, locals, fromlist, level)
builtins.__import__ = interrupting_import
sys.argv = ["qualify", "--version"]
from qualify.interfaces.launch import console
console()
"""


@pytest.mark.parametrize("module", ["qualify.interfaces.cli", "qualify.run.signals"])
def test_an_interrupt_while_the_cli_loads_is_one_line_and_exit_130(module: str) -> None:
    done = subprocess.run([sys.executable, "-c", INTERRUPTED_IMPORT, module], capture_output=True, text=True,
                          timeout=120)
    assert (done.returncode, done.stdout, done.stderr.count("\n")) == (130, "", 1), done.stderr
    assert "Traceback" not in done.stderr


def test_without_an_interrupt_the_executable_runs_its_command() -> None:
    done = subprocess.run([sys.executable, "-c", INTERRUPTED_IMPORT, "no.such.module"], capture_output=True,
                          text=True, timeout=120)
    assert (done.returncode, done.stderr) == (0, "") and done.stdout.startswith("qualify "), done
