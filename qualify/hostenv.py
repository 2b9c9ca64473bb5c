"""The numeric environment of this process: what lane identities pin and what receipts record.

Pinned (part of an engine's ABI, so part of the identity and the cache identity):
* :func:`numeric_environment` for the numpy engines: the numpy version and the BLAS library and
  version it was built with. Their arithmetic is exact by construction (``qualify.numerics``), so
  the BLAS *kernel*, the thread count and numpy's SIMD dispatch are recorded, not pinned.
* :func:`cpu_isa_class` for engines whose kernels dispatch on the instruction set (vLLM's CPU
  build, torch on the CPU).

:func:`check_ieee_environment` refuses a process whose floating-point environment flushes
subnormals to zero (a library loaded with ``-ffast-math`` can switch that on for everyone).
"""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np

from qualify.errors import Refused

# The instruction-set extensions that select other kernels in vLLM's CPU build and torch's CPU
# backend (oneDNN / its vectorized ops): a host lacking or adding one runs other arithmetic.
ISA_CLASS_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "avx512_fp16", "amx_bf16", "amx_int8")


@functools.cache
def blas_library() -> str:
    """numpy's BLAS as ``name-version`` (``scipy-openblas-0.3.30`` for the pinned wheel)."""
    blas = np.show_config(mode="dicts")["Build Dependencies"]["blas"]  # type: ignore[index]
    return f"{blas.get('name', 'unknown')}-{blas.get('version', 'unknown')}"


def numeric_environment() -> str:
    """What the numpy engines' bits may depend on besides their own code: numpy and its BLAS."""
    return f"numpy-{np.__version__}+{blas_library()}"


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU feature flags the kernel reports (``/proc/cpuinfo``; empty where there is none)."""
    try:
        text = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.partition(":")[2].split())
    return frozenset()


@functools.cache
def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``), or ``unknown``."""
    try:
        text = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return "unknown"
    for line in text.splitlines():
        if line.startswith("model name"):
            return line.partition(":")[2].strip() or "unknown"
    return "unknown"


def cpu_isa_class() -> str:
    """This CPU's ISA class for kernel-dispatching engines, e.g. ``x86_64+avx2+avx512f+avx512_bf16``:
    the architecture and which of :data:`ISA_CLASS_FLAGS` it has."""
    import platform

    present = [flag for flag in ISA_CLASS_FLAGS if flag in cpu_flags()]
    return "+".join([platform.machine() or "unknown", *present])


def check_ieee_environment() -> None:
    """Refuse a process that flushes subnormal float32 results to zero (FTZ/DAZ): the engines'
    bits assume IEEE gradual underflow."""
    tiny = np.array([1e-38], dtype=np.float32)
    if not (tiny * np.float32(1e-3))[0] > 0:
        raise Refused("floating-point environment: subnormals are flushed to zero in this process "
                      "(a library built with -ffast-math?); expected IEEE gradual underflow")
