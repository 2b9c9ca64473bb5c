"""The numeric environment of this process: what lane identities pin and what receipts record.

Pinned (part of an engine's ABI, so part of the identity and the cache identity): only
:func:`cpu_isa_class`, for engines whose kernels dispatch on the instruction set (vLLM's CPU build,
torch on the CPU). The numpy engines are exact by construction (``qualify.core.numerics``): their
numpy, BLAS, kernel, threads and SIMD dispatch are recorded in the host facts, and their bits are
pinned by a known-answer check (``qualify.engines.kat``), not by versions.

:func:`check_ieee_environment` refuses a process whose floating-point environment flushes
subnormals to zero (a library loaded with ``-ffast-math`` can switch that on for everyone).
"""

from __future__ import annotations

import functools
import os
import re
import sys
from pathlib import Path

import numpy as np

from qualify.core.errors import Refused

# The instruction-set extensions that select other kernels in vLLM's CPU build and torch's CPU
# backend (oneDNN / its vectorized ops): a host lacking or adding one runs other arithmetic.
ISA_CLASS_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "avx512_fp16", "amx_bf16", "amx_int8")


@functools.cache
def blas_library() -> str:
    """numpy's BLAS as ``name-version`` (``scipy-openblas-0.3.30`` for the pinned wheel), recorded."""
    blas = np.show_config(mode="dicts")["Build Dependencies"]["blas"]
    return f"{blas.get('name', 'unknown')}-{blas.get('version', 'unknown')}"


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


def numpy_narrower_dispatch() -> str:
    """An ``NPY_DISABLE_CPU_FEATURES`` value that makes numpy run its next-narrower SIMD paths on
    this CPU: the AVX-512 targets it uses, else AVX2 and FMA3 ("" when it uses neither)."""
    # numpy ships no stubs for its private dispatch tables (numpy._core from 2.0, numpy.core before).
    import importlib

    try:
        umath = importlib.import_module("numpy._core._multiarray_umath")
    except ImportError:  # pragma: no cover - numpy 1.26, the bottom of the tested range
        umath = importlib.import_module("numpy.core._multiarray_umath")
    dispatch, features = umath.__cpu_dispatch__, umath.__cpu_features__
    enabled = [name for name in dispatch if features.get(name)]
    avx512 = [name for name in enabled if name.startswith("AVX512")]
    return ",".join(avx512 or [name for name in ("AVX2", "FMA3") if name in enabled])


def check_ieee_environment() -> None:
    """Refuse a process that flushes subnormal float32 results to zero (FTZ/DAZ): the engines'
    bits assume IEEE gradual underflow."""
    tiny = np.array([1e-38], dtype=np.float32)
    if not (tiny * np.float32(1e-3))[0] > 0:
        raise Refused("floating-point environment: subnormals are flushed to zero in this process "
                      "(a library built with -ffast-math?); expected IEEE gradual underflow")


# --------------------------------------------------------------------------------------------
# host facts: what receipts record about each process (recorded, never pinned)

HOST_FACTS_SCHEMA = "trust-ladder.host-facts.v1"
"""The ``schema`` field of :func:`host_facts` documents."""

# /proc/cpuinfo flags that select SIMD kernels (numpy's dispatch, OpenBLAS's core, oneDNN, vLLM):
# these names exactly, plus every flag starting with one of the prefixes.
ISA_FACT_FLAGS = frozenset({
    "sse", "sse2", "pni", "ssse3", "sse4_1", "sse4_2", "sse4a", "popcnt", "avx", "avx2", "fma",
    "fma4", "xop", "f16c", "bmi1", "bmi2", "movbe", "avx_vnni", "avx_vnni_int8", "avx_vnni_int16",
    "avx_ifma", "avx_ne_convert", "vaes", "vpclmulqdq", "gfni",
})
ISA_FACT_PREFIXES = ("avx512", "avx10", "amx")

# Environment variables that change which kernels run, on how many threads, or on which GPU.
HOST_ENV_VARS = (
    "OPENBLAS_CORETYPE", "OPENBLAS_NUM_THREADS", "GOTO_NUM_THREADS", "OMP_NUM_THREADS",
    "MKL_NUM_THREADS", "MKL_CBWR", "NPY_DISABLE_CPU_FEATURES", "NPY_ENABLE_CPU_FEATURES",
    "CUDA_VISIBLE_DEVICES", "NVIDIA_TF32_OVERRIDE", "CUBLAS_WORKSPACE_CONFIG",
)
HOST_FACTS_KEYS = frozenset({
    "schema", "pid", "python", "machine", "platform", "cpu", "env", "blas", "numpy", "torch", "gpu",
    "harness",
})
"""The top-level keys of a :func:`host_facts` document, exactly."""
HOST_FACTS_MAX_BYTES = 64 << 10
_MAX_TEXT = 512
_MAX_ITEMS = 256
_MAX_DEPTH = 6
_GIT_TIMEOUT_S = 5.0


_UNPRINTABLE = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029\ud800-\udfff]")


def _text(value: object, limit: int = _MAX_TEXT) -> str | None:
    """``value`` as a bounded, single-line, printable string (None stays None): control
    characters become ``?``, since a receipt's strict reader refuses them."""
    if value is None:
        return None
    text = _UNPRINTABLE.sub("?", " ".join(str(value).split()))
    return text if len(text) <= limit else text[: limit - 3] + "..."


def isa_fact_flags() -> list[str]:
    """The SIMD-relevant subset of :func:`cpu_flags`, sorted."""
    return sorted(flag for flag in cpu_flags()
                  if flag in ISA_FACT_FLAGS or flag.startswith(ISA_FACT_PREFIXES))


@functools.cache
def _numpy_simd() -> dict[str, object]:
    """numpy's SIMD baseline, the dispatch targets built in and those this CPU enables (after
    ``NPY_DISABLE_CPU_FEATURES``); fixed at import, so computed once."""
    try:
        import importlib

        try:
            umath = importlib.import_module("numpy._core._multiarray_umath")  # numpy >= 2
        except ImportError:  # pragma: no cover - numpy 1.x
            umath = importlib.import_module("numpy.core._multiarray_umath")
        features = dict(getattr(umath, "__cpu_features__", {}))
        baseline = [str(f) for f in getattr(umath, "__cpu_baseline__", [])]
        dispatch = [str(f) for f in getattr(umath, "__cpu_dispatch__", [])]
    except Exception as exc:  # never fail a run over a fact
        return {"version": np.__version__, "simd_baseline": None, "simd_dispatch_built": None,
                "simd_dispatch_enabled": None, "error": _text(f"{type(exc).__name__}: {exc}")}
    return {
        "version": np.__version__,
        "simd_baseline": baseline,
        "simd_dispatch_built": dispatch,
        "simd_dispatch_enabled": [f for f in dispatch if features.get(f) is True],
    }


def blas_facts() -> dict[str, object]:
    """numpy's BLAS as built (name-version) and, through threadpoolctl, as loaded: the kernel
    (OpenBLAS core) and thread count in use now, plus every native thread pool in the process."""
    facts: dict[str, object] = {"library": blas_library(), "kernel": None, "num_threads": None,
                                "threading_layer": None, "pools": None}
    try:
        from threadpoolctl import threadpool_info

        pools = threadpool_info()
    except Exception as exc:  # threadpoolctl missing or a library it cannot query
        facts["error"] = _text(f"threadpoolctl: {type(exc).__name__}: {exc}")
        return facts
    described = []
    for pool in pools[:16]:
        path = str(pool.get("filepath") or "")
        described.append({
            "user_api": _text(pool.get("user_api"), 64),
            "internal_api": _text(pool.get("internal_api"), 64),
            "library": _text(os.path.basename(path), 128),  # no directories: they name users
            "version": _text(pool.get("version"), 64),
            "num_threads": pool.get("num_threads") if type(pool.get("num_threads")) is int else None,
            "threading_layer": _text(pool.get("threading_layer"), 64),
            "architecture": _text(pool.get("architecture"), 64),
            "numpy": "numpy" in path,
        })
    facts["pools"] = described
    blas = [p for p in described if p["user_api"] == "blas"]
    chosen = next((p for p in blas if p["numpy"]), blas[0] if blas else None)
    if chosen is not None:
        facts.update(kernel=chosen["architecture"], num_threads=chosen["num_threads"],
                     threading_layer=chosen["threading_layer"])
    return facts


def _torch_and_gpu_facts() -> tuple[dict[str, object] | None, dict[str, object] | None]:
    """torch's threads and the CUDA devices, only when this process already imported torch (it
    is never imported here). Device names are read only once CUDA is initialized: reading them
    would otherwise create a CUDA context on every GPU."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None, None
    try:
        torch_facts: dict[str, object] = {"version": _text(getattr(torch, "__version__", None), 64),
                                          "num_threads": int(torch.get_num_threads())}
    except Exception as exc:  # a torch still importing, or a broken one
        return {"version": None, "num_threads": None,
                "error": _text(f"{type(exc).__name__}: {exc}")}, None
    try:
        cuda = torch.cuda
        if not cuda.is_available():
            return torch_facts, None
        initialized = bool(cuda.is_initialized())
        devices = None
        if initialized:
            devices = []
            for index in range(min(cuda.device_count(), 64)):
                major, minor = cuda.get_device_capability(index)
                devices.append({"name": _text(cuda.get_device_name(index), 128),
                                "capability": f"{major}.{minor}"})
        gpu: dict[str, object] = {
            "cuda": _text(getattr(torch.version, "cuda", None), 32),
            "device_count": int(cuda.device_count()),
            "initialized": initialized,
            "current_device": int(cuda.current_device()) if initialized else None,
            "devices": devices,
            "tf32_matmul": bool(torch.backends.cuda.matmul.allow_tf32),
            "tf32_cudnn": bool(torch.backends.cudnn.allow_tf32),
        }
    except Exception as exc:
        gpu = {"error": _text(f"{type(exc).__name__}: {exc}")}
    return torch_facts, gpu


def _git(root: Path, *args: str) -> str | None:
    """``git -C root ARGS`` stdout, or None on any failure or after a timeout; takes no locks."""
    import subprocess

    env = dict(os.environ, GIT_OPTIONAL_LOCKS="0", GIT_TERMINAL_PROMPT="0", LC_ALL="C")
    try:
        done = subprocess.run(["git", "-C", str(root), *args], stdin=subprocess.DEVNULL,
                              capture_output=True, timeout=_GIT_TIMEOUT_S, env=env, check=False)
    except (OSError, subprocess.SubprocessError, ValueError):
        return None
    if done.returncode != 0:
        return None
    return done.stdout.decode("utf-8", "replace")


@functools.cache
def harness_checkout() -> dict[str, object]:
    """The harness's git commit and whether its tree is dirty, when the package is imported
    from a git checkout (its parent directory has ``.git``); nulls otherwise (an installed
    wheel). Computed once per process."""
    root = Path(__file__).resolve().parents[2]
    facts: dict[str, object] = {"commit": None, "dirty": None}
    if not (root / ".git").exists():
        return facts
    head = (_git(root, "rev-parse", "--verify", "HEAD") or "").strip()
    if len(head) in (40, 64) and all(c in "0123456789abcdef" for c in head):
        facts["commit"] = head
        status = _git(root, "status", "--porcelain")
        facts["dirty"] = None if status is None else bool(status.strip())
    return facts


@functools.cache
def _static_facts() -> dict[str, object]:
    """The parts of :func:`host_facts` that cannot change while the process lives."""
    import platform

    return {
        "python": f"{platform.python_implementation()}-{platform.python_version()}",
        "machine": platform.machine() or "unknown",
        "platform": _text(platform.platform(), 256),
        "cpu_model": _text(cpu_model(), 256),
        "isa_class": cpu_isa_class(),
        "isa_flags": isa_fact_flags(),
        "logical_cpus": os.cpu_count(),
    }


def host_facts() -> dict[str, object]:
    """JSON-ready facts about this process's host and numeric runtime, for receipts.

    CPU model and SIMD flags, numpy's BLAS (library, the OpenBLAS kernel actually selected and
    its thread count), the kernel-selecting environment variables as set, numpy's SIMD dispatch,
    torch's threads and the CUDA devices (only when torch is already imported), and the harness's
    git commit. No hostname, user or path. Never raises, never prints; the static parts are
    computed once per process, the thread counts, environment and GPU each call.
    """
    static = _static_facts()
    try:
        affinity: int | None = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        affinity = None
    try:
        blas = blas_facts()
    except Exception as exc:  # pragma: no cover - _blas_facts catches what it calls
        blas = {"library": None, "error": _text(f"{type(exc).__name__}: {exc}")}
    torch_facts, gpu = _torch_and_gpu_facts()
    return {
        "schema": HOST_FACTS_SCHEMA,
        "pid": os.getpid(),
        "python": static["python"],
        "machine": static["machine"],
        "platform": static["platform"],
        "cpu": {
            "model": static["cpu_model"],
            "isa_class": static["isa_class"],
            # The static facts are one dict of mixed values; this one is the flag list.
            "isa_flags": list(static["isa_flags"]),  # type: ignore[call-overload]
            "logical_cpus": static["logical_cpus"],
            "usable_cpus": affinity,
        },
        "env": {name: _text(os.environ.get(name), 256) for name in HOST_ENV_VARS},
        "blas": blas,
        "numpy": dict(_numpy_simd()),
        "torch": torch_facts,
        "gpu": gpu,
        "harness": dict(harness_checkout()),
    }


def host_facts_problem(document: object) -> str | None:
    """Why ``document`` (another process's report) is not a host-facts document, or None.

    Strict where it matters: the exact top-level keys, their types, the schema; bounded
    everywhere (size, depth, strings, lists); plain JSON values only (no NaN, no Infinity).
    """
    if not isinstance(document, dict):
        return f"found {type(document).__name__}, expected a JSON object"
    if set(document) != HOST_FACTS_KEYS:
        extra, missing = sorted(set(document) - HOST_FACTS_KEYS), sorted(HOST_FACTS_KEYS - set(document))
        return _text(f"keys differ (unexpected {extra[:8]}, missing {missing})", 300)
    if document["schema"] != HOST_FACTS_SCHEMA:
        return _text(f"schema {document['schema']!r}, expected {HOST_FACTS_SCHEMA}", 300)
    if type(document["pid"]) is not int or document["pid"] <= 0:
        return "pid is not a positive integer"
    for name in ("python", "machine", "platform"):
        if not isinstance(document[name], str):
            return f"{name} is not a string"
    for name in ("cpu", "env", "blas", "numpy", "harness"):
        if not isinstance(document[name], dict):
            return f"{name} is not an object"
    for name in ("torch", "gpu"):
        if document[name] is not None and not isinstance(document[name], dict):
            return f"{name} is neither an object nor null"

    def problem(value: object, where: str, depth: int) -> str | None:
        if depth > _MAX_DEPTH:
            return f"{where}: nested deeper than {_MAX_DEPTH}"
        if value is None or type(value) in (bool, int):
            return None
        if type(value) is float:
            return None if value == value and abs(value) != float("inf") else f"{where}: not finite"
        if isinstance(value, str):
            return None if len(value) <= _MAX_TEXT else f"{where}: string longer than {_MAX_TEXT}"
        if isinstance(value, list):
            if len(value) > _MAX_ITEMS:
                return f"{where}: more than {_MAX_ITEMS} items"
            return next((p for i, v in enumerate(value) if (p := problem(v, f"{where}[{i}]", depth + 1))), None)
        if isinstance(value, dict):
            if len(value) > _MAX_ITEMS:
                return f"{where}: more than {_MAX_ITEMS} keys"
            for key, item in value.items():
                if not isinstance(key, str) or not 0 < len(key) <= 64:
                    return f"{where}: a key is not a short string"
                if (found := problem(item, f"{where}.{key}", depth + 1)) is not None:
                    return found
            return None
        return f"{where}: {type(value).__name__} is not a JSON value"

    found = problem(document, "host", 0)
    if found is not None:
        return _text(found, 300)
    import json

    if len(json.dumps(document, ensure_ascii=False, allow_nan=False).encode("utf-8")) > HOST_FACTS_MAX_BYTES:
        return f"larger than {HOST_FACTS_MAX_BYTES} bytes"
    return None
