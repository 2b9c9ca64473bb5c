"""``qualify selftest``: run the recipes against every fault lane and check each is caught where
it happened.

A fault passes the self-test only when its run is NOT qualified and the failing sample's
localisation points at the fault's site (the layer, tensor or position it corrupted, or the
cache identity for a cache entry from the other producer mode). A fault that qualifies, or fails
for an unrelated reason, fails the self-test.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qualify.contract.lanes import Recipe
from qualify.core.errors import Refused
from qualify.engines import faults
from qualify.run.qualification import STEP_LABELS, QualificationRun, RunOptions, driven

RUNG_RECIPES = {recipe.rung: recipe.value for recipe in Recipe}


@dataclass(frozen=True)
class FaultResult:
    """One fault lane's self-test outcome."""

    fault: str
    recipe: str
    caught: bool
    localised: bool
    finding: str
    receipt: Path | None

    @property
    def passed(self) -> bool:
        return self.caught and self.localised


def _failed_record(run: QualificationRun) -> dict[str, Any] | None:
    for record in run.records:
        if record.get("error") or record.get("localisation"):
            return record
    return None


def _over_envelope(record: dict[str, Any]) -> list[tuple[int, str, int | None]]:
    """(layer, tensor, position) of every handed-off tensor above the lane's calibrated envelope."""
    items = (record.get("localisation") or {}).get("kv_over_envelope") or []
    return [(item["layer"], item["tensor"], item.get("position")) for item in items]


def _sites(over: list[tuple[int, str, int | None]]) -> str:
    return ", ".join(f"layer {layer} {tensor}" for layer, tensor, _ in over) or "none"


def _check_kv_ulp(record: dict[str, Any]) -> tuple[bool, str]:
    over = _over_envelope(record)
    ok = [(layer, tensor) for layer, tensor, _ in over] == [(faults.FAULT_LAYER, "K")] \
        and over[0][2] == faults.FAULT_POSITION
    position = over[0][2] if over else None
    return ok, f"KV differs from the consumer's prefill at: {_sites(over)} (position {position})"


def _check_rope_offset(record: dict[str, Any]) -> tuple[bool, str]:
    over = _over_envelope(record)
    tensors = {tensor for _, tensor, _ in over}
    ok = tensors == {"K"} and (0, "K") in {(layer, tensor) for layer, tensor, _ in over}
    return ok, f"over the calibrated KV envelope: {_sites(over)} (keys only, from layer 0)"


def _check_block_order(record: dict[str, Any]) -> tuple[bool, str]:
    low = faults.SWAPPED_BLOCKS[0] * faults.BLOCK_POSITIONS
    high = (faults.SWAPPED_BLOCKS[1] + 1) * faults.BLOCK_POSITIONS
    over = _over_envelope(record)
    positions = [position for _, _, position in over]
    ok = bool(over) and {tensor for _, tensor, _ in over} == {"K"} \
        and all(p is not None and low <= p < high for p in positions)
    return ok, f"over the envelope: {_sites(over)} at positions {positions} (swapped {low}..{high - 1})"


def _check_other_prompt(record: dict[str, Any]) -> tuple[bool, str]:
    where = record.get("localisation") or {}
    over = _over_envelope(record)
    ok = {(0, "K"), (0, "V")} <= {(layer, tensor) for layer, tensor, _ in over}
    return ok, (f"first token divergence at step {where.get('first_divergence_position')}; over the "
                f"envelope: {_sites(over)}")


def _check_v_scale(record: dict[str, Any]) -> tuple[bool, str]:
    over = _over_envelope(record)
    ok = [(layer, tensor) for layer, tensor, _ in over] == [(faults.FAULT_LAYER, "V")]
    return ok, f"over the calibrated KV envelope: {_sites(over)}; max abs {record.get('max_abs')}"


def _check_other_mode(record: dict[str, Any]) -> tuple[bool, str]:
    error = record.get("error") or ""
    return "target_cache_identity" in error, error or "no refusal recorded"


CHECKS: dict[str, Callable[[dict[str, Any]], tuple[bool, str]]] = {
    "kv-ulp": _check_kv_ulp,
    "rope-offset": _check_rope_offset,
    "block-order": _check_block_order,
    "other-prompt": _check_other_prompt,
    "v-scale": _check_v_scale,
    "other-mode": _check_other_mode,
}


def run_fault(fault: str, rung: int, receipts: Path | None,
              on_step: Callable[[str], None] | None = None) -> FaultResult:
    """Run ``fault``'s rung recipe against the fault lane and check what it reports."""
    recipe = RUNG_RECIPES[rung]
    run = QualificationRun(RunOptions(recipe=recipe, fault=fault, receipts=receipts, reference_once=True,
                                      command_line=["qualify", "selftest", "--fault", fault]))
    with driven(run):  # SIGINT, SIGTERM, SIGHUP stop it cleanly; closed however it ends
        for label in STEP_LABELS:
            outcome = run.step(label)
            if on_step is not None:
                on_step(f"{fault}: {label}: {'ok' if outcome.passed else outcome.message}")
            if not outcome.passed:
                break
    refusal = next((outcome for outcome in run.outcomes.values() if outcome.refused), None)
    if refusal is not None:  # the lane could not run here (a missing asset, say): exit 2, not "not caught"
        raise Refused(f"selftest fault {fault}: {refusal.label}: {refusal.message}")
    caught = run.verdict is not None and not run.verdict.passed and not run.refused
    record = _failed_record(run)
    if record is None:
        return FaultResult(fault, recipe, caught, False, "no failing sample recorded", run.receipt_path)
    localised, finding = CHECKS[fault](record)
    return FaultResult(fault, recipe, caught, localised, finding, run.receipt_path)


def all_fault_runs() -> list[tuple[str, int]]:
    """Every (fault, rung) pair the self-test runs."""
    return [(name, rung) for name, fault in faults.FAULTS.items() for rung in fault.rungs]
