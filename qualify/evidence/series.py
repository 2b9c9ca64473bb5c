"""The series an auditor plots, per handoff sample: what the receipt's digests and totals summarise.

One file per sample, ``series/sample-<repetition>.safetensors`` in the receipt (written by
:meth:`qualify.archive.writer.ReceiptWriter.add_series`), holds exactly these tensors, all 1-D
and little-endian; ``P`` is the number of decoded positions (the contract's ``output_tokens``,
256), ``L`` the number of layers, ``H`` the number of handed-off positions:

=============================  ============  ======================================================
name                           dtype[shape]  what
=============================  ============  ======================================================
``logit_max_abs_delta``        float64[P]    per position, max |handoff - cold| logit, contract
                                             units (the sample's ``max_abs`` is its maximum)
``logit_mean_abs_delta``       float64[P]    per position, mean |handoff - cold| logit over the
                                             vocabulary, contract units
``cold_top1_top2_margin``      float64[P]    per position, the cold branch's top-1 minus top-2
                                             logit, contract units
``handoff_tokens``             int64[P]      the handoff branch's generated token ids (their
                                             uint32 SHA-256 is the record's
                                             ``handoff_generated_token_sha256``)
``cold_tokens``                int64[P]      the cold branch's generated token ids
``kv_k_max_abs_delta``         float64[L]    per layer, max |handed-off K - consumer's own K|
``kv_v_max_abs_delta``         float64[L]    per layer, max |handed-off V - consumer's own V|
``kv_position_max_abs_delta``  float64[H]    per handed-off position, max |K or V delta| over
                                             every layer, head and dim
=============================  ============  ======================================================

Deltas and margins are non-negative or NaN (a NaN is evidence: a non-finite row or KV value is
never hidden); token ids fit uint32. The KV tensors are always present: both comparers compare
the handed-off KV with the consumer's own prefill on every sample. Logit deltas are per position,
never per logit, so a sample's series is a few kilobytes plus 8 bytes per handed-off position.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from qualify.core.errors import Refused
from qualify.evidence.compare import BranchComparison

MAX_SERIES_BYTES = 1 << 24
"""The largest series file :func:`read_series` reads (a real one is far smaller)."""

POSITION_TENSORS: tuple[str, ...] = (
    "logit_max_abs_delta", "logit_mean_abs_delta", "cold_top1_top2_margin", "handoff_tokens", "cold_tokens")
LAYER_TENSORS: tuple[str, ...] = ("kv_k_max_abs_delta", "kv_v_max_abs_delta")
HANDED_OFF_TENSORS: tuple[str, ...] = ("kv_position_max_abs_delta",)
TOKEN_TENSORS: frozenset[str] = frozenset({"handoff_tokens", "cold_tokens"})

SERIES_DTYPES: dict[str, np.dtype[np.generic]] = {
    name: np.dtype("<i8") if name in TOKEN_TENSORS else np.dtype("<f8")
    for name in (*POSITION_TENSORS, *LAYER_TENSORS, *HANDED_OFF_TENSORS)
}
"""Every tensor of a series and its dtype; nothing else belongs in the file."""

_UINT32_MAX = 0xFFFFFFFF


def sample_series(comparison: BranchComparison) -> dict[str, np.ndarray]:
    """The named arrays of one handoff sample's series (see the module docstring), checked as
    :func:`read_series` checks them, so the writer never stores what the reader refuses."""
    kv = comparison.kv
    if kv is None:
        raise Refused("series: the comparison has no KV deltas, expected the per-layer and "
                      "per-position KV comparison every comparer computes")
    tensors = {
        "logit_max_abs_delta": comparison.delta.row_max_abs,
        "logit_mean_abs_delta": comparison.delta.row_mean_abs,
        "cold_top1_top2_margin": comparison.cold_margins,
        "handoff_tokens": comparison.handoff_tokens,
        "cold_tokens": comparison.cold_tokens,
        "kv_k_max_abs_delta": [layer.k for layer in kv.layers],
        "kv_v_max_abs_delta": [layer.v for layer in kv.layers],
        "kv_position_max_abs_delta": kv.position_max_abs,
    }
    series = {name: np.ascontiguousarray(values, dtype=SERIES_DTYPES[name]) for name, values in tensors.items()}
    return check_series(series, "series", positions=comparison.output_tokens)


def check_series(
    tensors: Mapping[str, np.ndarray],
    where: str,
    *,
    positions: int | None = None,
    layers: int | None = None,
    handed_off: int | None = None,
) -> dict[str, np.ndarray]:
    """Refuse (one line naming ``where`` and the tensor) anything but the series' exact names,
    dtypes, consistent 1-D shapes (and the given lengths) and value ranges; returns the tensors."""
    missing = [name for name in SERIES_DTYPES if name not in tensors]
    if missing:
        raise Refused(f"{where}: missing tensor {missing[0]!r}, expected {', '.join(SERIES_DTYPES)}")
    extra = sorted(set(tensors) - set(SERIES_DTYPES))
    if extra:
        raise Refused(f"{where}: unexpected tensor {extra[0]!r}, expected only {', '.join(SERIES_DTYPES)}")
    for name, expected_dtype in SERIES_DTYPES.items():
        array = tensors[name]
        if not isinstance(array, np.ndarray) or array.dtype != expected_dtype or array.ndim != 1:
            found = f"{array.dtype}{list(array.shape)}" if isinstance(array, np.ndarray) else type(array).__name__
            raise Refused(f"{where}: tensor {name!r} is {found}, expected 1-D {expected_dtype.name}")
    _same_length(tensors, POSITION_TENSORS, "positions", positions, where)
    _same_length(tensors, LAYER_TENSORS, "layers", layers, where)
    _same_length(tensors, HANDED_OFF_TENSORS, "handed-off positions", handed_off, where)
    for name in SERIES_DTYPES:
        array = tensors[name]
        if name in TOKEN_TENSORS:
            if int(array.min()) < 0 or int(array.max()) > _UINT32_MAX:
                raise Refused(f"{where}: tensor {name!r} holds token ids outside 0..{_UINT32_MAX}")
        elif bool(np.any(array < 0)):  # NaN compares false: kept, it is evidence
            raise Refused(f"{where}: tensor {name!r} holds a negative value, expected abs deltas and "
                          f"margins (>= 0 or NaN)")
    return dict(tensors)


def _same_length(tensors: Mapping[str, np.ndarray], names: tuple[str, ...], what: str,
                 expected: int | None, where: str) -> None:
    """Every tensor of one group has the same non-zero length (``expected`` when given)."""
    first = names[0]
    length = tensors[first].shape[0]
    if length == 0:
        raise Refused(f"{where}: tensor {first!r} is empty, expected one value per {what[:-1]}")
    if expected is not None and length != expected:
        raise Refused(f"{where}: tensor {first!r} has {length} {what}, expected {expected}")
    for name in names[1:]:
        if tensors[name].shape[0] != length:
            raise Refused(f"{where}: tensor {name!r} has {tensors[name].shape[0]} {what}, "
                          f"{first!r} has {length}")


def _read_bounded(path: Path) -> bytes:
    """A regular file's bytes, at most :data:`MAX_SERIES_BYTES` (never blocks on a FIFO)."""
    try:
        descriptor = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except OSError as exc:
        raise Refused(f"series {path}: cannot open: {exc.strerror or type(exc).__name__}") from None
    try:
        if not stat.S_ISREG(os.fstat(descriptor).st_mode):
            raise Refused(f"series {path}: not a regular file")
        with os.fdopen(descriptor, "rb", closefd=False) as handle:
            data = handle.read(MAX_SERIES_BYTES + 1)
    except OSError as exc:
        raise Refused(f"series {path}: cannot read: {exc.strerror or type(exc).__name__}") from None
    finally:
        os.close(descriptor)
    if len(data) > MAX_SERIES_BYTES:
        raise Refused(f"series {path}: larger than {MAX_SERIES_BYTES} bytes")
    return data


def read_series(
    source: Path | str | bytes | bytearray | memoryview,
    *,
    positions: int | None = None,
    layers: int | None = None,
    handed_off: int | None = None,
) -> dict[str, np.ndarray]:
    """Load one series file (a path, or its bytes) with safetensors' own loader and check it as
    :func:`check_series` does (``positions``/``layers``/``handed_off``: the lengths a record
    expects); anything else is refused in one line. The input is untrusted: its size is bounded
    before parsing."""
    from safetensors import SafetensorError
    from safetensors.numpy import load

    if isinstance(source, (bytes, bytearray, memoryview)):
        where = "series"
        data = bytes(source)
        if len(data) > MAX_SERIES_BYTES:
            raise Refused(f"{where}: {len(data)} bytes, expected at most {MAX_SERIES_BYTES}")
    else:
        where = f"series {source}"
        data = _read_bounded(Path(source))
    try:
        tensors = load(data)
    except KeyError as exc:  # a dtype safetensors knows and numpy does not (BF16, F8_*)
        raise Refused(f"{where}: tensor dtype {exc.args[0]!r} is not one numpy reads, expected F64 or I64") from None
    except (SafetensorError, ValueError, TypeError, OverflowError) as exc:
        reason = " ".join(str(exc).split()) or type(exc).__name__
        raise Refused(f"{where}: not a well-formed safetensors file: {reason[:200]}") from None
    return check_series(tensors, where, positions=positions, layers=layers, handed_off=handed_off)
