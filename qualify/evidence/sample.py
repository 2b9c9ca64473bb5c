"""A handoff sample's record built from its comparison: the one bridge from numpy-side evidence
(:class:`qualify.evidence.compare.BranchComparison`) to the pure records the judge reads."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Literal

from qualify.core.errors import Refused
from qualify.evidence.compare import BranchComparison, KVComparison, largest
from qualify.evidence.records import (
    PHASE_FIELDS,
    KVLayerMaxAbs,
    KVOverEnvelope,
    Localisation,
    Parting,
    SampleRecord,
    TeacherForcedSummary,
)


def sample_record(
    *,
    repetition: int,
    comparison: BranchComparison,
    payload_sha256: str,
    payload_bytes: int,
    payload_gbit_per_s: float,
    handed_off_positions: int,
    recomputed_positions: int,
    phases: Mapping[str, float],
    seams_sha256: str | None = None,
    kv_threshold: float | None = None,
    kv_envelope: Sequence[tuple[float, float]] | None = None,
    include_localisation: bool | None = None,
    include_row_digests: bool = True,
    producer_stall_s: float | None = None,
) -> SampleRecord:
    """Build a complete record from a :class:`BranchComparison` and the handoff's own facts.

    ``phases`` must name every field of :data:`PHASE_FIELDS` and nothing else. Localisation is
    included when the sample disagrees (tokens, a rule-breaking row, a digest mismatch) or when
    teacher-forced/KV localisation was computed, unless ``include_localisation`` says otherwise.
    """
    missing = [name for name in PHASE_FIELDS if name not in phases]
    if missing:
        raise Refused(f"sample phases: omits {missing[0]}")
    extra = sorted(set(phases) - set(PHASE_FIELDS))
    if extra:
        raise Refused(f"sample phases: unknown phase {extra[0]!r}, expected only {', '.join(PHASE_FIELDS)}")
    disagrees = (
        comparison.first_divergence is not None
        or comparison.delta.first_row_over_rule is not None
        or comparison.first_logit_digest_mismatch is not None
    )
    if include_localisation is None:
        include_localisation = disagrees or comparison.teacher_forced is not None or comparison.kv is not None
    localisation = _localisation(comparison, kv_threshold, kv_envelope) if include_localisation else None
    return SampleRecord(
        repetition=repetition,
        output_tokens=comparison.output_tokens,
        token_agreement_rate=comparison.token_agreement_rate,
        max_abs=comparison.max_abs,
        mean_abs=comparison.mean_abs,
        max_row_mean_abs=largest(comparison.delta.row_mean_abs),
        handoff_generated_token_sha256=comparison.handoff_generated_token_sha256,
        cold_generated_token_sha256=comparison.cold_generated_token_sha256,
        handoff_logit_block_sha256=comparison.handoff_digests.block_sha256,
        cold_logit_block_sha256=comparison.cold_digests.block_sha256,
        logit_row_digests_equal=comparison.logit_row_digests_equal,
        first_logit_digest_mismatch_row=comparison.first_logit_digest_mismatch,
        handoff_logit_row_sha256=comparison.handoff_digests.row_sha256 if include_row_digests else None,
        cold_logit_row_sha256=comparison.cold_digests.row_sha256 if include_row_digests else None,
        payload_sha256=payload_sha256,
        seams_sha256=seams_sha256,
        payload_bytes=payload_bytes,
        payload_gbit_per_s=float(payload_gbit_per_s),
        handed_off_positions=handed_off_positions,
        recomputed_positions=recomputed_positions,
        producer_compute_s=float(phases["producer_compute_s"]),
        serialize_s=float(phases["serialize_s"]),
        transport_s=float(phases["transport_s"]),
        verify_s=float(phases["verify_s"]),
        install_s=float(phases["install_s"]),
        decode_s=float(phases["decode_s"]),
        recompute_s=float(phases["recompute_s"]),
        handoff_draft_tokens_sha256=comparison.handoff_draft_tokens_sha256,
        cold_draft_tokens_sha256=comparison.cold_draft_tokens_sha256,
        handoff_draft_trace_sha256=comparison.handoff_draft_trace_sha256,
        cold_draft_trace_sha256=comparison.cold_draft_trace_sha256,
        draft_acceptance_rate=comparison.draft_acceptance_rate,
        localisation=localisation,
        producer_stall_s=producer_stall_s,
    )


def _localisation(
    comparison: BranchComparison, kv_threshold: float | None, kv_envelope: Sequence[tuple[float, float]] | None
) -> Localisation:
    """Where and why the sample disagrees, from the comparison's localisation fields."""
    teacher = comparison.teacher_forced
    kv = comparison.kv
    margins = comparison.cold_margins
    return Localisation(
        first_divergence_position=comparison.first_divergence,
        cold_margin_at_divergence=comparison.cold_margin_at_divergence,
        drift_at_divergence=comparison.drift_at_divergence,
        divergence_class=comparison.divergence_class,
        first_rule_breaking_row=comparison.delta.first_row_over_rule,
        min_cold_margin=float(margins.min()) if margins.size else None,
        teacher_forced=None if teacher is None else TeacherForcedSummary(
            max_abs=teacher.max_abs,
            mean_abs=teacher.mean_abs,
            first_row_over_rule=teacher.first_row_over_rule,
            top1_flips=teacher.top1_flips,
            max_row_mean_abs=teacher.max_row_mean_abs,
            partings=tuple(Parting(row=row, cold_margin=margin) for row, margin in teacher.partings),
        ),
        kv_layer_max_abs=None if kv is None else tuple(
            KVLayerMaxAbs(layer=item.layer, k=item.k, v=item.v, k_position=item.k_position, v_position=item.v_position)
            for item in kv.layers
        ),
        kv_first_position_over_threshold=(
            kv.first_position_over(kv_threshold) if kv is not None and kv_threshold is not None else None
        ),
        kv_threshold=kv_threshold if kv is not None else None,
        kv_over_envelope=None if kv is None or kv_envelope is None else kv_over_envelope(kv, kv_envelope),
    )


def kv_over_envelope(kv: KVComparison, envelope: Sequence[tuple[float, float]]) -> tuple[KVOverEnvelope, ...]:
    """The layers and tensors whose max abs delta exceeds the calibrated (K, V) envelope per layer;
    a layer the envelope does not cover has an envelope of 0 (any delta there is over)."""
    over = []
    for item in kv.layers:
        k_envelope, v_envelope = envelope[item.layer] if item.layer < len(envelope) else (0.0, 0.0)
        tensors: tuple[tuple[Literal["K", "V"], float, float, int], ...] = (
            ("K", item.k, k_envelope, item.k_position),
            ("V", item.v, v_envelope, item.v_position),
        )
        for tensor, delta, bound, position in tensors:
            if not (delta <= bound):  # NaN counts as over (fail closed)
                over.append(KVOverEnvelope(layer=item.layer, tensor=tensor, delta=float(delta),
                                           envelope=float(bound), position=position))
    return tuple(over)
