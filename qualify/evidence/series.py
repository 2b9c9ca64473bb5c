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

A handoff held to a fixture envelope (a producer declared non-deterministic: its calibration's
fixture handoffs and every sample of its qualification) also has ``series/envelope-<repetition>
.safetensors`` (:meth:`qualify.archive.writer.ReceiptWriter.add_envelope_series`), the four series
:mod:`qualify.judge.envelope` bounds, all float64:

============================  ============  =======================================================
name                          shape         what
============================  ============  =======================================================
``row_max_abs``               [P]           per decoded row, max |handoff - cold| logit, the
                                            teacher-forced rows where the tokens parted
``row_mean_abs``              [P]           per decoded row, mean |handoff - cold| logit, likewise
``position_max_abs``          [H]           per handed-off position, max |K or V delta| over every
                                            layer (``kv_position_max_abs_delta``)
``tensor_position_max_abs``   [2 * L, H]    per layer's K, then its V, per handed-off position,
                                            max |delta| over heads and dims
============================  ============  =======================================================

Only the host comparer computes the per-tensor series; where a comparer gives none the file is not
written, and the envelope judges that handoff as failed (absent evidence is failed evidence).
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


ENVELOPE_TENSORS: tuple[str, ...] = ("row_max_abs", "row_mean_abs", "position_max_abs", "tensor_position_max_abs")
"""The four series of an envelope file, in the order :data:`qualify.judge.envelope.SERIES_NAMES` holds them."""

ENVELOPE_DTYPE = np.dtype("<f8")


def envelope_file_name(repetition: int) -> str:
    """``envelope-<repetition>.safetensors``: a handoff's envelope series under ``series/``."""
    return f"envelope-{repetition}.safetensors"


def envelope_series(comparison: BranchComparison) -> dict[str, np.ndarray] | None:
    """The four series a fixture envelope bounds, of one compared handoff (the module docstring),
    checked as :func:`read_envelope_series` checks them; None when the comparer computed no
    per-tensor KV series (the device comparer), which the caller records as missing evidence."""
    kv = comparison.kv
    if kv is None or kv.tensor_position_max_abs is None:
        return None
    rows = comparison.teacher_forced if comparison.teacher_forced is not None else comparison.delta
    tensors = {
        "row_max_abs": rows.row_max_abs,
        "row_mean_abs": rows.row_mean_abs,
        "position_max_abs": kv.position_max_abs,
        "tensor_position_max_abs": kv.tensor_position_max_abs,
    }
    series = {name: np.ascontiguousarray(values, dtype=ENVELOPE_DTYPE) for name, values in tensors.items()}
    return check_envelope_series(series, "envelope series", rows=comparison.output_tokens)


def check_envelope_series(tensors: Mapping[str, np.ndarray], where: str, *, rows: int | None = None,
                          positions: int | None = None) -> dict[str, np.ndarray]:
    """Refuse (one line naming ``where`` and the tensor) anything but the four envelope series:
    exactly those names, float64, the rows' two series of one length (``rows`` when given), the
    per-tensor series two rows per layer over as many positions as ``position_max_abs``
    (``positions`` when given), every value >= 0 or NaN."""
    names = sorted(tensors)
    if names != sorted(ENVELOPE_TENSORS):
        wrong = next(iter(sorted(set(names) ^ set(ENVELOPE_TENSORS))))
        what = "missing" if wrong not in tensors else "unexpected"
        raise Refused(f"{where}: {what} tensor {wrong!r}, expected {', '.join(ENVELOPE_TENSORS)}")
    for name in ENVELOPE_TENSORS:
        array = tensors[name]
        ndim = 2 if name == "tensor_position_max_abs" else 1
        if not isinstance(array, np.ndarray) or array.dtype != ENVELOPE_DTYPE or array.ndim != ndim:
            found = f"{array.dtype}{list(array.shape)}" if isinstance(array, np.ndarray) else type(array).__name__
            raise Refused(f"{where}: tensor {name!r} is {found}, expected {ndim}-D float64")
        if array.size == 0:
            raise Refused(f"{where}: tensor {name!r} is empty")
        if bool(np.any(array < 0)):  # NaN compares false: kept, the envelope judges it outside
            raise Refused(f"{where}: tensor {name!r} holds a negative value, expected abs deltas (>= 0 or NaN)")
    decoded = tensors["row_max_abs"].shape[0]
    if tensors["row_mean_abs"].shape[0] != decoded or (rows is not None and decoded != rows):
        raise Refused(f"{where}: tensors 'row_max_abs' and 'row_mean_abs' have {decoded} and "
                      f"{tensors['row_mean_abs'].shape[0]} rows, expected {rows if rows is not None else decoded} each")
    handed_off = tensors["position_max_abs"].shape[0]
    if positions is not None and handed_off != positions:
        raise Refused(f"{where}: tensor 'position_max_abs' has {handed_off} positions, expected {positions}")
    tensor_rows, tensor_positions = tensors["tensor_position_max_abs"].shape
    if tensor_rows % 2 or tensor_positions != handed_off:
        raise Refused(f"{where}: tensor 'tensor_position_max_abs' is [{tensor_rows}, {tensor_positions}], expected "
                      f"[2 * layers, {handed_off}] (each layer's K then V over the handed-off positions)")
    return dict(tensors)


def read_envelope_series(source: Path | str | bytes | bytearray | memoryview, *, rows: int | None = None,
                         positions: int | None = None) -> dict[str, np.ndarray]:
    """Load one envelope series file (a path, or its bytes) and check it as
    :func:`check_envelope_series` does; anything else is refused in one line. Untrusted input:
    its size is bounded before parsing."""
    where, tensors = _load(source, "envelope series")
    return check_envelope_series(tensors, where, rows=rows, positions=positions)


def _read_bounded(path: Path, where: str) -> bytes:
    """A regular file's bytes, at most :data:`MAX_SERIES_BYTES` (never blocks on a FIFO)."""
    try:
        descriptor = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except OSError as exc:
        raise Refused(f"{where}: cannot open: {exc.strerror or type(exc).__name__}") from None
    try:
        if not stat.S_ISREG(os.fstat(descriptor).st_mode):
            raise Refused(f"{where}: not a regular file")
        with os.fdopen(descriptor, "rb", closefd=False) as handle:
            data = handle.read(MAX_SERIES_BYTES + 1)
    except OSError as exc:
        raise Refused(f"{where}: cannot read: {exc.strerror or type(exc).__name__}") from None
    finally:
        os.close(descriptor)
    if len(data) > MAX_SERIES_BYTES:
        raise Refused(f"{where}: larger than {MAX_SERIES_BYTES} bytes")
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
    where, tensors = _load(source, "series")
    return check_series(tensors, where, positions=positions, layers=layers, handed_off=handed_off)


def _load(source: Path | str | bytes | bytearray | memoryview, what: str) -> tuple[str, dict[str, np.ndarray]]:
    """(where, tensors) of a safetensors file given by path or bytes, its size bounded before
    parsing; refused in one line naming ``what`` (and the path) when it is not well formed."""
    from safetensors import SafetensorError
    from safetensors.numpy import load

    if isinstance(source, (bytes, bytearray, memoryview)):
        where = what
        data = bytes(source)
        if len(data) > MAX_SERIES_BYTES:
            raise Refused(f"{where}: {len(data)} bytes, expected at most {MAX_SERIES_BYTES}")
    else:
        where = f"{what} {source}"
        data = _read_bounded(Path(source), where)
    try:
        tensors = load(data)
    except KeyError as exc:  # a dtype safetensors knows and numpy does not (BF16, F8_*)
        raise Refused(f"{where}: tensor dtype {exc.args[0]!r} is not one numpy reads, expected F64 or I64") from None
    except (SafetensorError, ValueError, TypeError, OverflowError) as exc:
        reason = " ".join(str(exc).split()) or type(exc).__name__
        raise Refused(f"{where}: not a well-formed safetensors file: {reason[:200]}") from None
    return where, tensors
