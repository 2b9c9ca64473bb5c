"""The fixture envelope at the run's edge: a handoff's envelope series as the judge reads them, and
a basis receipt's envelope read back from its files and held to the seal its identity carries.

A producer declared non-deterministic has no anchor to recheck; its calibration hands the fixture
off repeatedly over several producer starts and records each handoff's four series
(``series/envelope-<n>.safetensors``, :mod:`qualify.evidence.series`). Every load re-derives the
envelope from those files by :data:`~qualify.contract.rules.FIXTURE_ENVELOPE_RULE` and refuses
(exit 2, one line) an identity whose sealed rule, counts, multipliers or ceilings digest differ
(:func:`qualify.judge.envelope.seal_problems`). The judging itself stays in the judge.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from qualify.contract.identity import Identity
from qualify.core.errors import Refused, one_line
from qualify.evidence.series import envelope_file_name, read_envelope_series
from qualify.judge.calibration import declares_envelope, envelope_handoffs
from qualify.judge.envelope import SERIES_NAMES, EnvelopeSeal, FixtureEnvelope, HandoffSeries, seal_problems


def handoff_series(arrays: Mapping[str, np.ndarray]) -> HandoffSeries:
    """The judge's form of one handoff's envelope series (checked arrays of
    :func:`qualify.evidence.series.envelope_series`): plain floats, the per-tensor series
    flattened layer by layer, K before V."""
    return HandoffSeries(*(tuple(np.asarray(arrays[name], dtype=np.float64).ravel().tolist())
                           for name, _ in SERIES_NAMES))


NO_TENSOR_SERIES = ("no per-tensor KV series to hold to the fixture envelope (its comparer computed none, as the "
                    "device comparer does; compare on the host)")
"""Why a compared handoff has no envelope series (absent evidence, which the envelope fails)."""
NO_COMPARISON = "no envelope series (the sample failed before its comparison)"
"""Why a failed handoff has none."""


def missing_series(repetition: object, why: str) -> str:
    """How the envelope check names a handoff it has no series of."""
    return f"handoff {repetition}: {why}"


def identity_seal(identity: Identity) -> EnvelopeSeal | None:
    """What the identity seals of its fixture envelope (None: its producer is declared deterministic)."""
    sealed = identity.onboarding_qualification.fixture_envelope
    if sealed is None:
        return None
    return EnvelopeSeal(sealed.rule.name, sealed.handoffs, sealed.producer_starts,
                        tuple(getattr(sealed.multipliers, name) for name, _ in SERIES_NAMES), sealed.ceilings_sha256)


def basis_envelope_series(receipt_dir: Path, evidence: Mapping[str, Any]) -> tuple[list[HandoffSeries], int]:
    """The honest envelope handoffs' series of a calibration receipt, in their order, and the
    producer starts they ran on; refused (one line naming the receipt and the file) when the
    calibration declared no envelope or a series file is missing or off its form."""
    where = f"basis receipt {receipt_dir.name}"
    if not declares_envelope(evidence):
        raise Refused(f"{where}: evidence/calibration.json declares no fixture envelope: its producer was calibrated "
                      f"as deterministic (calibrate a non-deterministic producer with qualify calibrate "
                      f"--non-deterministic)")
    entries, problems = envelope_handoffs(evidence)
    if problems:
        raise Refused(f"{where}: {problems[0]}")
    series = []
    for repetition, _ in entries:
        path = receipt_dir / "series" / envelope_file_name(repetition)
        if not path.is_file() or path.is_symlink():
            raise Refused(f"{where}: series/{envelope_file_name(repetition)} missing: envelope handoff {repetition} "
                          f"recorded no series (absent evidence is failed evidence)")
        try:
            series.append(handoff_series(read_envelope_series(path)))
        except Refused as exc:
            raise Refused(f"{where}: {one_line(str(exc)).replace(str(receipt_dir) + '/', '')}") from None
    return series, len({start for _, start in entries})


def basis_envelope(identity: Identity, receipt_dir: Path, evidence: Mapping[str, Any], *, where: str) -> FixtureEnvelope:
    """The fixture envelope the identity's basis receipt gives, once its seal is shown to follow
    from it: every sealed field equal to what the basis's series give by the rule; else refused,
    naming the first field that differs."""
    seal = identity_seal(identity)
    if seal is None:
        raise Refused(f"{where}: onboarding_qualification.fixture_envelope: null, the producer is declared deterministic")
    series, starts = basis_envelope_series(receipt_dir, evidence)
    problems, envelope = seal_problems(seal, series, starts=starts)
    if problems or envelope is None:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise Refused(f"{where}: a sealed number does not follow from its basis "
                      f"{identity.onboarding_qualification.basis}: {problems[0]}{more}")
    return envelope


__all__ = ["NO_COMPARISON", "NO_TENSOR_SERIES", "basis_envelope", "basis_envelope_series", "handoff_series",
           "identity_seal", "missing_series"]
