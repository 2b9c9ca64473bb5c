"""``qualify selftest``: run the recipes against every fault lane and check each is caught where
it happened.

A fault passes the self-test only when its run is NOT qualified and the failing sample's
localisation points at the fault's site (the layer, tensor or position it corrupted, or the
cache identity for a cache entry from the other producer mode). A fault that qualifies, or fails
for an unrelated reason, fails the self-test.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from qualify import faults
from qualify.qualifier import STEP_LABELS, QualificationRun, RunOptions

RUNG_RECIPES = {2: "native-text", 3: "kquant-target-plus-dflash"}


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


def _kv_layers(record: dict[str, Any]) -> list[dict[str, Any]]:
    return list((record.get("localisation") or {}).get("kv_layer_max_abs") or [])


def _check_kv_ulp(record: dict[str, Any]) -> tuple[bool, str]:
    layers = _kv_layers(record)
    touched = [(item["layer"], tensor) for item in layers for tensor in ("k", "v") if item[tensor] > 0]
    site = next((item for item in layers if item["layer"] == faults.FAULT_LAYER), None)
    position = None if site is None else site.get("k_position")
    ok = touched == [(faults.FAULT_LAYER, "k")] and position == faults.FAULT_POSITION
    return ok, f"KV differs only at {touched}, K max delta at position {position}"


def _check_rope_offset(record: dict[str, Any]) -> tuple[bool, str]:
    layers = _kv_layers(record)
    if not layers:
        return False, "no KV localisation"
    first = layers[0]
    # Every layer's K moves by a rotation while V keeps only the lane's own drift.
    ok = all(item["k"] > 10 * max(item["v"], 1e-6) for item in layers)
    return ok, f"layer 0 K delta {first['k']:.4g} vs V {first['v']:.4g}; K dominates in every layer: {ok}"


def _check_block_order(record: dict[str, Any]) -> tuple[bool, str]:
    low = faults.SWAPPED_BLOCKS[0] * faults.BLOCK_POSITIONS
    high = (faults.SWAPPED_BLOCKS[1] + 1) * faults.BLOCK_POSITIONS
    positions = [item.get("k_position") for item in _kv_layers(record)]
    ok = bool(positions) and all(p is not None and low <= p < high for p in positions)
    return ok, f"K max-delta positions per layer {positions} (swapped range {low}..{high - 1})"


def _check_other_prompt(record: dict[str, Any]) -> tuple[bool, str]:
    where = record.get("localisation") or {}
    layers = _kv_layers(record)
    layer0_v = layers[0]["v"] if layers else 0.0
    ok = where.get("divergence_class") == "decisive" and layer0_v > 0.1
    return ok, (f"first divergence at step {where.get('first_divergence_position')} "
                f"({where.get('divergence_class')}); layer 0 V delta {layer0_v:.4g}")


def _check_v_scale(record: dict[str, Any]) -> tuple[bool, str]:
    layers = _kv_layers(record)
    if not layers:
        return False, "no KV localisation"
    worst = max(layers, key=lambda item: item["v"])
    others = max((item["v"] for item in layers if item["layer"] != worst["layer"]), default=0.0)
    ok = worst["layer"] == faults.FAULT_LAYER and worst["v"] > 10 * others
    return ok, f"largest V delta at layer {worst['layer']} ({worst['v']:.4g}; other layers <= {others:.4g})"


def _check_other_mode(record: dict[str, Any]) -> tuple[bool, str]:
    error = record.get("error") or ""
    return "cache identity" in error, error or "no refusal recorded"


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
    try:
        for label in STEP_LABELS:
            outcome = run.step(label)
            if on_step is not None:
                on_step(f"{fault}: {label}: {'ok' if outcome.passed else outcome.message}")
            if not outcome.passed:
                break
    finally:
        run.close()
    caught = run.verdict is not None and not run.verdict.passed and not run.refused
    record = _failed_record(run)
    if record is None:
        return FaultResult(fault, recipe, caught, False, "no failing sample recorded", run.receipt_path)
    localised, finding = CHECKS[fault](record)
    return FaultResult(fault, recipe, caught, localised, finding, run.receipt_path)


def all_fault_runs() -> list[tuple[str, int]]:
    """Every (fault, rung) pair the self-test runs."""
    return [(name, rung) for name, fault in faults.FAULTS.items() for rung in fault.rungs]
