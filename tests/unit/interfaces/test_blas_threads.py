"""The ``qualify`` executable's BLAS thread default (``qualify.interfaces.cli.default_blas_threads``)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from qualify.interfaces.cli import BLAS_THREAD_VARIABLES, default_blas_threads


def test_with_no_thread_count_set_openblas_gets_half_the_cpus_at_least_one() -> None:
    environ = {"PATH": "/usr/bin"}
    expected = str(max(1, len(os.sched_getaffinity(0)) // 2))
    assert default_blas_threads(environ) == expected
    assert environ == {"PATH": "/usr/bin", "OPENBLAS_NUM_THREADS": expected}


@pytest.mark.parametrize("variable", BLAS_THREAD_VARIABLES)
def test_an_operators_thread_count_stands(variable: str) -> None:
    environ = {variable: "3"}
    assert default_blas_threads(environ) is None
    assert environ == {variable: "3"}


def test_the_executable_sets_it_before_numpy_loads() -> None:
    """``qualify --version`` through the console entry point: numpy's OpenBLAS, loaded after it
    returns (at exit), runs the default's thread count; the variable is there for its children."""
    environ = {name: value for name, value in os.environ.items() if name not in BLAS_THREAD_VARIABLES}
    probe = ("import atexit, os, sys\n"
             "def report():\n"
             "    import numpy\n"
             "    from threadpoolctl import threadpool_info\n"
             "    pools = [p['num_threads'] for p in threadpool_info() if p['user_api'] == 'blas' and 'numpy' in p['filepath']]\n"
             "    print(os.environ['OPENBLAS_NUM_THREADS'], pools)\n"
             "atexit.register(report)\n"
             "sys.argv = ['qualify', '--version']\n"
             "from qualify.interfaces.cli import console\n"
             "console()\n")
    done = subprocess.run([sys.executable, "-c", probe], env=environ, capture_output=True, text=True, check=True)
    expected = max(1, len(os.sched_getaffinity(0)) // 2)
    assert done.stdout.splitlines()[-1] == f"{expected} [{expected}]"
