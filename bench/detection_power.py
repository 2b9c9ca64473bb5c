"""Detection power: for each lane and fault class, the smallest injected fault the rule catches.

For each lane the honest producer prefills the fixture's ``prompt[:2047]`` once and the exact
consumer computes its cold reference once (256 greedy tokens). Each probe applies one fault of
:mod:`qualify.engines.faults` (``NAME=VALUE``) to that KV, seals and opens it through the real
wire (:mod:`qualify.handoff.wire`: payload tree and seam digests as a run computes them), decodes
and compares it through :class:`~qualify.evidence.comparers.HostComparer`, builds the run's sample
record (:func:`~qualify.evidence.sample.sample_record`), and judges it two ways:

(a) drift rule: :func:`~qualify.judge.judge_summary` (every sample through
    :func:`~qualify.judge.judge_sample`) under the lane's rung-2 rule, bounds from its identity
    ``contracts/<lane>-identity-v1.json`` or ``--bounds MAX,MEAN``;
(b) drift rule + G3 recheck: (a), and :func:`~qualify.judge.judge_reproduction` of the samples
    against the honest producer's records (the anchor: its payload, seam, logit-block and
    generated-token digests).

A probe's three repetitions are one handoff recorded three times: the in-process producer and
its fault are deterministic (checked: two honest prefills are compared bit for bit), so three
handoffs would hand off the same bytes. Each class's parameter grid (``GRIDS``) is searched by
bisection on the probe's caught/missed outcome, assuming it is monotone in the parameter; the
boundary is then checked one step above and two below, and any disagreement reported.

Prints one table, the commands that reproduce the default lane's V-scale boundary with real runs,
and, as its last line, ``min_detected_v_scale_eps: <eps>`` (the default lane under rule (b)).
Writes JSON to ``--out``.

Usage: python bench/detection_power.py [--lanes LANE,...] [--classes CLASS,...] [--bounds MAX,MEAN] [--out FILE]
       python bench/detection_power.py --non-deterministic [--jitter R] [--starts S] [--envelope-handoffs N]
              [--held-out Q] [--classes CLASS,...] [--out FILE]

``--non-deterministic`` judges the default lane declared non-deterministic: no digest is compared
across repetitions or against an anchor; the fixture envelope (:mod:`qualify.judge.envelope`) is
stated from N honest handoffs over S producer starts, Q more honest qualifications are judged to
count false alarms, and each class of ``ND_CLASSES`` is searched under the exact-token and the
teacher-forced rule, each with the envelope. Every repetition of a probe is its own handoff, with
its own seeded jitter (:func:`jittered`) when R > 0. Last line:
``min_detected_v_scale_eps_non_deterministic: <eps> (exact-token), <eps> (teacher-forced)``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from decimal import Decimal
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

import numpy as np

from qualify.contract.lanes import DEFAULT_NATIVE_TEXT_LANE, lane_spec
from qualify.core import assets
from qualify.core.digests import canonical_sha256
from qualify.core.errors import Refused, one_line
from qualify.core.kv import KVCache
from qualify.engines import faults
from qualify.engines.base import LaneEngine
from qualify.engines.factory import build_consumer, build_producer, lane_kv_dtype
from qualify.evidence.compare import transform_between
from qualify.evidence.comparers import ComparerSetup, HostComparer
from qualify.evidence.records import BoundedDriftRule, record_json
from qualify.evidence.sample import sample_record
from qualify.evidence.series import envelope_series
from qualify.handoff.wire import Handoff, HandoffExpectation, mint_run_key, open_handoff, seal_handoff_parts
from qualify.judge import Verdict, judge_reproduction, judge_summary
from qualify.judge.envelope import FixtureEnvelope, HandoffSeries, derive_fixture_envelope, judge_envelope
from qualify.run.fixture_envelope import handoff_series
from qualify.run.run_contract import identity_path_for_lane

LANES = ("nvfp4-native-w4a4", "nvfp4-native-f16", "nvfp4-native-splitk")
DEFAULT_OUT = REPO_ROOT / "bench" / "results" / "detection-power" / "detection-power.json"
RUN_ID = "detection-power"
PROMPT_NOTE = "each lane's identity prompt (the fixture), prompt[:handoff_positions] handed off, output_tokens decoded"


def one_two_five(first_exponent: int, last_exponent: int, top: float | None = None) -> tuple[str, ...]:
    """1, 2, 5 times each power of ten from ``first_exponent`` to ``last_exponent`` (a near-geometric
    grid, steps of x2, x2.5, x2), as exact decimal texts, none above ``top``."""
    texts = [f"{mantissa}e{exponent}" for exponent in range(first_exponent, last_exponent + 1) for mantissa in (1, 2, 5)]
    return tuple(text for text in texts if top is None or float(text) <= top)


def powers_of_two(last_exponent: int) -> tuple[str, ...]:
    return tuple(str(2**exponent) for exponent in range(last_exponent + 1))


@dataclass(frozen=True)
class ProbeClass:
    """A fault class as the bench searches it: the figure it reports (``parameter``), the grid of
    that figure, and the fault name each figure injects."""

    name: str
    parameter: str
    grid: tuple[str, ...]
    fault: Callable[[str], str]


def _scale(kind: str) -> Callable[[str], str]:
    # F = 1 + eps in exact decimal, so the name's text is the factor a real run parses.
    return lambda eps: f"{kind}={Decimal(1) + Decimal(eps)}"


def _plain(kind: str) -> Callable[[str], str]:
    return lambda value: f"{kind}={faults.value_text(float(value))}"


CLASSES: dict[str, ProbeClass] = {
    probe.name: probe
    for probe in (
        ProbeClass("v-scale", f"eps: layer {faults.FAULT_LAYER} V x (1 + eps)", one_two_five(-7, -1), _scale("v-scale")),
        ProbeClass("k-scale", f"eps: layer {faults.FAULT_LAYER} K x (1 + eps)", one_two_five(-7, -1), _scale("k-scale")),
        ProbeClass("kv-ulp", f"N layer-{faults.FAULT_LAYER} K elements +1 ULP", powers_of_two(16), _plain("kv-ulp")),
        ProbeClass("position-shift", "D: keys' RoPE positions + D", one_two_five(-6, 3, top=4096), _plain("position-shift")),
        ProbeClass("block-swap", f"N: K spans of N positions from {faults.BLOCK_SWAP_START} swapped",
                   powers_of_two(9), _plain("block-swap")),
        ProbeClass("head-swap", f"N: layer-{faults.FAULT_LAYER} KV heads {faults.SWAPPED_HEADS} swapped, last N",
                   powers_of_two(11), _plain("head-swap")),
    )
}


@dataclass
class Probe:
    """One fault's handoff, recorded and judged both ways."""

    figure: str | None
    fault: str | None
    noop: bool
    caught_drift: bool
    caught_g3: bool
    max_abs: float
    mean_abs: float
    token_agreement_rate: float
    drift_verdict: str
    g3_verdict: str
    over_kv_envelope: list[str]
    seconds: float

    def caught(self, rule: str) -> bool:
        return self.caught_drift if rule == "drift" else self.caught_drift or self.caught_g3

    def document(self) -> dict[str, Any]:
        return {
            "value": self.figure, "fault": self.fault, "noop": self.noop,
            "caught_drift_rule": self.caught_drift, "caught_drift_rule_and_g3": self.caught("g3"),
            "max_abs": self.max_abs, "mean_abs": self.mean_abs, "token_agreement_rate": self.token_agreement_rate,
            "drift_verdict": self.drift_verdict, "g3_verdict": self.g3_verdict,
            "over_kv_envelope": self.over_kv_envelope, "seconds": round(self.seconds, 2),
        }


@dataclass(frozen=True)
class Terms:
    """What the bench takes from a lane's identity file, read as written (any identity version
    carrying these fields; a bench is not a qualification, so it does not seal-check the file)."""

    lane: str
    source: str
    identity_sha256: str
    prompt_name: str
    handoff_positions: int
    output_tokens: int
    repetitions: int
    maximum_absolute: float
    maximum_mean_absolute: float
    deterministic_producer: bool
    basis: str | None
    logit_units: str


def _field(document: Any, path: str, kind: type, where: str) -> Any:
    value = document
    for part in path.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if not isinstance(value, kind) or isinstance(value, bool) != (kind is bool):
        raise Refused(f"{where}: {path}: found {value!r}, expected {kind.__name__}")
    return value


def identity_terms(lane: str) -> Terms:
    """The lane's terms from ``contracts/<lane>-identity-v1.json``; a missing or mistyped field is
    refused naming it."""
    from qualify.core.strict_json import read_strict_json

    path = identity_path_for_lane(lane)
    where = f"identity {path.relative_to(REPO_ROOT)}"
    document = read_strict_json(path, "identity")
    if _field(document, "lane", str, where) != lane:
        raise Refused(f"{where}: lane: found {document['lane']!r}, expected {lane!r}")
    qualification = "onboarding_qualification"
    if _field(document, f"{qualification}.full_logits.mode", str, where) != "bounded-drift":
        raise Refused(f"{where}: {qualification}.full_logits.mode: expected bounded-drift (a rung-2 lane)")
    basis = document.get(qualification, {}).get("basis")
    return Terms(
        lane=lane, source=str(path.relative_to(REPO_ROOT)),
        identity_sha256=hashlib.sha256(path.read_bytes()).hexdigest(),
        prompt_name=_field(document, "prompt.name", str, where),
        handoff_positions=_field(document, "context_policy.handoff_positions", int, where),
        output_tokens=_field(document, f"{qualification}.output_tokens", int, where),
        repetitions=_field(document, f"{qualification}.repetitions", int, where),
        maximum_absolute=_field(document, f"{qualification}.full_logits.maximum_absolute", float, where),
        maximum_mean_absolute=_field(document, f"{qualification}.full_logits.maximum_mean_absolute", float, where),
        deterministic_producer=_field(document, f"{qualification}.require_deterministic_remote_output", bool, where),
        basis=basis if isinstance(basis, str) else None,
        logit_units=_field(document, "logit_units.transform", str, where),
    )


@dataclass
class LaneBench:
    """One lane's producer, consumer, honest KV, cold reference and anchor, reused by every probe."""

    terms: Terms
    rule: BoundedDriftRule
    rule_source: str
    prompt: np.ndarray
    producer: LaneEngine
    comparer: HostComparer
    expectation: HandoffExpectation
    honest_kv: KVCache
    prefill_s: float
    deterministic: bool
    key: bytes = field(default_factory=mint_run_key)
    anchor: list[dict[str, Any]] = field(default_factory=list)
    kv_envelope: list[tuple[float, float]] | None = None
    honest: Probe | None = None
    probes: int = 0

    @property
    def lane(self) -> str:
        return self.terms.lane

    @property
    def handed_off(self) -> int:
        return self.terms.handoff_positions

    def records(self, kv: KVCache) -> list[dict[str, Any]]:
        """The sample records of handing off ``kv`` (sealed, opened, decoded, compared), one per
        repetition of the rule."""
        record, _ = self.sample(kv)
        return [{**record, "repetition": repetition} for repetition in range(1, self.rule.repetitions + 1)]

    def sample(self, kv: KVCache, repetition: int = 1) -> tuple[dict[str, Any], HandoffSeries]:
        """One handoff of ``kv`` (sealed, opened, decoded, compared): its sample record, and the
        series a fixture envelope judges (teacher-forced rows where the tokens parted)."""
        self.probes += 1
        request_id = f"probe-{self.probes}"
        sealed = seal_handoff_parts(
            kv, key=self.key, identity_sha256=self.terms.identity_sha256,
            target_cache_identity=self.expectation.cache_identity, producer_mode=self.expectation.producer_mode,
            lane=self.lane, prompt_sha256=self.expectation.prompt_sha256, run_id=RUN_ID,
            request_id=request_id, compute_s=self.prefill_s)
        handoff = Handoff(sealed.manifest_bytes, sealed.mac, bytearray(b"".join(sealed.payload_parts)))
        opened = open_handoff(handoff, key=self.key, expectation=replace(self.expectation, request_id=request_id))
        manifest = opened.manifest
        compared = self.comparer.compare(opened.kv, self.prompt[manifest.handed_off_positions:], meanwhile=lambda: None)
        comparison = compared.result()
        seams = canonical_sha256([[seam.layer, seam.k_sha256, seam.v_sha256] for seam in manifest.seams])
        phases = {
            "producer_compute_s": manifest.compute_s, "serialize_s": manifest.serialize_s + manifest.digest_s,
            "transport_s": 0.0, "verify_s": opened.timings.verify_s, "install_s": opened.timings.install_s,
            "decode_s": compared.seconds["decode"], "recompute_s": 0.0,
        }
        record = record_json(sample_record(
            repetition=repetition, comparison=comparison, payload_sha256=manifest.payload_sha256,
            seams_sha256=seams, payload_bytes=manifest.payload_size, payload_gbit_per_s=0.0,
            handed_off_positions=manifest.handed_off_positions,
            recomputed_positions=len(self.prompt) - manifest.handed_off_positions,
            kv_envelope=self.kv_envelope, phases=phases,
        ))
        # The series a run records for a fixture envelope (qualify.evidence.series), as its judge reads them.
        arrays = envelope_series(comparison)
        assert arrays is not None  # the host comparer keeps each tensor's per-position series
        return record, handoff_series(arrays)

    def judge(self, records: list[dict[str, Any]]) -> tuple[Verdict, Verdict]:
        drift = judge_summary(records, self.rule)
        g3 = judge_reproduction(records, self.anchor, rung=self.rule.rung,
                                deterministic_producer=self.terms.deterministic_producer, draft=False)
        return drift, g3

    def probe(self, figure: str, fault: str) -> Probe:
        """Hand off the honest KV with ``fault`` applied; judge it both ways."""
        started = time.perf_counter()
        transform = faults.kv_transform(fault, self.producer.geometry.rope_theta)
        if transform is None:
            raise Refused(f"fault {fault}: corrupts nothing in the handed-off KV")
        return self.judged(self.records(transform(self.honest_kv)), figure, fault, started)

    def judged(self, records: list[dict[str, Any]], figure: str | None, fault: str | None, started: float) -> Probe:
        drift, g3 = self.judge(records)
        first = records[0]
        over = [f"L{item['layer']}{item['tensor']}" for item in
                ((first.get("localisation") or {}).get("kv_over_envelope") or [])]
        noop = bool(self.anchor) and first["payload_sha256"] == self.anchor[0]["payload_sha256"]
        return Probe(figure, None if fault is None else faults.fault_named(fault).name, noop,
                     not drift.passed, not g3.passed, float(first["max_abs"]), float(first["mean_abs"]),
                     float(first["token_agreement_rate"]), drift.headline, g3.headline, over,
                     time.perf_counter() - started)


def parse_bounds(text: str) -> tuple[float, float]:
    """``--bounds MAX,MEAN``: two positive finite numbers."""
    try:
        maximum, mean = (float(part) for part in text.split(","))
    except ValueError:
        raise Refused(f"--bounds: found {text!r}, expected MAX,MEAN (two positive finite numbers)") from None
    if not all(math.isfinite(x) and x > 0 for x in (maximum, mean)):
        raise Refused(f"--bounds: found {text!r}, expected MAX,MEAN (two positive finite numbers)")
    return maximum, mean


def set_up_lane(lane: str, bounds: str | None) -> LaneBench:
    """The lane's terms, engines, honest KV (prefilled twice: the two must be equal bit for bit to
    call the producer deterministic), cold reference, anchor records and KV envelope."""
    terms = identity_terms(lane)
    maximum, mean = parse_bounds(bounds) if bounds is not None else (terms.maximum_absolute, terms.maximum_mean_absolute)
    rule = BoundedDriftRule(repetitions=terms.repetitions, output_tokens=terms.output_tokens,
                            maximum_absolute=maximum, maximum_mean_absolute=mean, drift_graded=True)
    source = f"--bounds {bounds}" if bounds is not None else terms.source
    spec = lane_spec(lane)
    consumer = build_consumer(lane_spec(lane))
    producer = build_producer(lane, spec.mode)
    prompt = assets.load_prompt(terms.prompt_name)
    prefix = prompt[:terms.handoff_positions]
    started = time.perf_counter()
    honest_kv = producer.prefill(prefix)
    prefill_s = time.perf_counter() - started
    again = producer.prefill(prefix)
    deterministic = all(a.tobytes() == b.tobytes() for a, b in
                        zip(honest_kv.keys + honest_kv.values, again.keys + again.values, strict=True))
    comparer = HostComparer(ComparerSetup(
        consumer=consumer, prompt=prompt, handoff_positions=terms.handoff_positions,
        output_tokens=terms.output_tokens, transform=transform_between(consumer.logit_units, terms.logit_units),
        maximum_absolute=maximum, maximum_mean_absolute=mean, reference_once=True))
    comparer.reference()
    expectation = HandoffExpectation(
        identity_sha256=terms.identity_sha256, cache_identity=producer.target_cache_identity_sha256,
        geometry=consumer.geometry.kv_geometry(terms.handoff_positions, lane_kv_dtype(spec)),
        prompt_sha256=assets.prompt_sha256(prefix), run_id=RUN_ID, request_id="probe",
        lane=lane, producer_mode=spec.mode)
    bench = LaneBench(terms, rule, source, prompt, producer, comparer, expectation, honest_kv, prefill_s, deterministic)
    started = time.perf_counter()
    bench.anchor = bench.records(honest_kv)
    bench.honest = bench.judged(bench.anchor, None, None, started)
    # The honest handoff's per-layer KV deltas: a probe over them moved the KV where a KV-envelope
    # check would see it (reported, not judged).
    layers = (bench.anchor[0].get("localisation") or {}).get("kv_layer_max_abs") or []
    bench.kv_envelope = [(float(item["k"]), float(item["v"])) for item in layers] or None
    if bench.honest.caught_drift or bench.honest.caught_g3:
        raise Refused(f"lane {lane}: the honest handoff fails the rule ({bench.honest.drift_verdict}); "
                      "the bounds must admit the honest producer")
    return bench


def basis_check(terms: Terms, anchor: list[dict[str, Any]]) -> tuple[bool | None, str]:
    """Does the in-process anchor equal a retained fixture handoff of the lane's basis receipt (every
    G3 digest)? None when the basis receipt cannot be read here."""
    from qualify.archive.reader import resolve_receipt_uri
    from qualify.judge import REPRODUCTION_FIELDS
    from qualify.run.run_contract import receipt_sample_records

    if terms.basis is None:
        return None, "the identity names no basis receipt"
    try:
        records = receipt_sample_records(resolve_receipt_uri(terms.basis, assets.RECEIPTS_DIR).parent)
    except Refused as refusal:
        return None, f"basis receipt unreadable: {one_line(str(refusal))}"
    wanted = {name: anchor[0].get(name) for name, _ in REPRODUCTION_FIELDS}
    equal = [r.get("repetition") for r in records if all(r.get(name) == value for name, value in wanted.items())]
    if equal:
        return True, f"{terms.basis}: sample {equal[0]} has every G3 digest of the in-process anchor"
    return False, f"{terms.basis}: no sample has every G3 digest of the in-process anchor"


@dataclass
class Search:
    """Where a class's grid turns from missed to caught under one rule."""

    boundary: int | None  # grid index of the smallest caught value (monotone reading); None: never caught
    seen: dict[int, bool]
    non_monotone: list[int]

    def document(self, grid: Sequence[str], probes: dict[int, Probe]) -> dict[str, Any]:
        boundary = self.boundary
        caught = None if boundary is None else grid[boundary]
        missed = grid[-1] if boundary is None else (grid[boundary - 1] if boundary > 0 else None)
        return {
            "smallest_caught": caught,
            "caught_at_grid_minimum": boundary == 0,
            "largest_missed": missed,
            "drift_at_smallest_caught": None if boundary is None else _drift(probes[boundary]),
            "drift_at_largest_missed": None if missed is None else _drift(probes[grid.index(missed)]),
            "probed": {grid[i]: self.seen[i] for i in sorted(self.seen)},
            "monotone_at_boundary": not self.non_monotone,
            "non_monotone": [grid[i] for i in self.non_monotone],
        }


def _drift(probe: Probe) -> dict[str, float]:
    return {"max_abs": probe.max_abs, "mean_abs": probe.mean_abs, "token_agreement_rate": probe.token_agreement_rate}


def bisect(size: int, caught: Callable[[int], bool]) -> Search:
    """The smallest index whose probe is caught, reading the grid as monotone (missed below it,
    caught from it on): the grid's first value, then bisection over the rest with a caught value
    assumed just past the grid's end; then checked one step above and two below the boundary."""
    seen: dict[int, bool] = {}

    def at(index: int) -> bool:
        if index not in seen:
            seen[index] = caught(index)
        return seen[index]

    if at(0):
        high = 0
    else:
        low, high = 0, size  # low missed; high caught (size: past the grid, never probed)
        while high - low > 1:
            middle = (low + high) // 2
            if at(middle):
                high = middle
            else:
                low = middle
    boundary = high if high < size else None
    edge = size if boundary is None else boundary
    for index in (edge + 1, edge - 2):
        if 0 <= index < size:
            at(index)
    non_monotone = sorted(i for i, hit in seen.items() if hit != (i >= edge))
    return Search(boundary, seen, non_monotone)


def measure_class(bench: LaneBench, probe_class: ProbeClass, log: Callable[[str], None]) -> dict[str, Any]:
    grid = probe_class.grid
    probes: dict[int, Probe] = {}

    def probe_at(index: int) -> Probe:
        if index not in probes:
            probe = bench.probe(grid[index], probe_class.fault(grid[index]))
            probes[index] = probe
            log(f"  {bench.lane} {probe.fault}: drift rule {'caught' if probe.caught_drift else 'missed'}, "
                f"+G3 {'caught' if probe.caught('g3') else 'missed'}; max {probe.max_abs:.6g} mean {probe.mean_abs:.6g}"
                f" tokens {probe.token_agreement_rate:.4g}{' (no-op: bytes unchanged)' if probe.noop else ''}"
                f" [{probe.seconds:.1f} s]")
        return probes[index]

    drift = bisect(len(grid), lambda i: probe_at(i).caught("drift"))
    g3 = bisect(len(grid), lambda i: probe_at(i).caught("g3"))
    return {
        "class": probe_class.name,
        "parameter": probe_class.parameter,
        "grid": list(grid),
        "drift_rule": drift.document(grid, probes),
        "drift_rule_and_g3": g3.document(grid, probes),
        "noops": [grid[i] for i, probe in sorted(probes.items()) if probe.noop],
        "probes": [probes[i].document() for i in sorted(probes)],
    }


# --------------------------------------------------------------------------- output


def _caught_text(result: dict[str, Any], grid_top: str) -> str:
    caught = result["smallest_caught"]
    if caught is None:
        return f"none <= {grid_top}"
    return f"<= {caught}" if result["caught_at_grid_minimum"] else caught


def _drift_text(drift: dict[str, float] | None) -> str:
    if drift is None:
        return "-"
    tokens = round(drift["token_agreement_rate"] * 256)
    return f"{drift['max_abs']:.4f}/{drift['mean_abs']:.5f} {tokens}/256"


def table(lanes: list[dict[str, Any]]) -> list[str]:
    header = ("lane", "class", "parameter", "(a) caught", "(b) caught", "(a) missed", "at (a) caught",
              "at (a) missed", "at (b) caught", "notes")
    rows = [header]
    for lane in lanes:
        for result in lane["classes"]:
            drift, g3 = result["drift_rule"], result["drift_rule_and_g3"]
            notes = []
            for label, search in (("(a)", drift), ("(b)", g3)):
                if search["non_monotone"]:
                    notes.append(f"{label} non-monotone at {', '.join(search['non_monotone'])}")
            if result["noops"]:
                notes.append(f"no-op at {', '.join(result['noops'])}")
            rows.append((lane["lane"], result["class"], result["parameter"],
                         _caught_text(drift, result["grid"][-1]), _caught_text(g3, result["grid"][-1]),
                         drift["largest_missed"] or "-", _drift_text(drift["drift_at_smallest_caught"]),
                         _drift_text(drift["drift_at_largest_missed"]), _drift_text(g3["drift_at_smallest_caught"]),
                         "; ".join(notes) or "monotone at both boundaries"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = [" | ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip() for row in rows]
    lines.insert(1, "-+-".join("-" * width for width in widths))
    return lines


def v_scale_line(lanes: list[dict[str, Any]]) -> str:
    """The last line: the default lane's smallest caught V eps under rule (b)."""
    default = next((lane for lane in lanes if lane["lane"] == DEFAULT_NATIVE_TEXT_LANE), None)
    result = None if default is None else next((r for r in default["classes"] if r["class"] == "v-scale"), None)
    if result is None:
        return f"min_detected_v_scale_eps: none (v-scale on {DEFAULT_NATIVE_TEXT_LANE} was not measured)"
    caught = result["drift_rule_and_g3"]["smallest_caught"]
    if caught is None:
        return f"min_detected_v_scale_eps: none (not caught up to {result['grid'][-1]})"
    return f"min_detected_v_scale_eps: {faults.value_text(float(caught))}"


def lane_lines(lanes: list[dict[str, Any]]) -> list[str]:
    """Per lane: the rule judged, the honest handoff, and what the anchor was checked against."""
    return [f"{lane['lane']}: rule max <= {lane['rule']['maximum_absolute']!r}, mean <= "
            f"{lane['rule']['maximum_mean_absolute']!r} ({lane['rule']['source']}); honest handoff max "
            f"{lane['honest']['max_abs']!r}, mean {lane['honest']['mean_abs']!r}; two prefills bit-identical: "
            f"{lane['deterministic_in_process']}; anchor vs basis receipt: {lane['anchor_basis_check']}"
            for lane in lanes]


def reproduce_lines(lanes: list[dict[str, Any]], bounds_given: bool) -> list[str]:
    default = next((lane for lane in lanes if lane["lane"] == DEFAULT_NATIVE_TEXT_LANE), None)
    result = None if default is None else next((r for r in default["classes"] if r["class"] == "v-scale"), None)
    if result is None:
        return []
    fault = CLASSES["v-scale"].fault
    lines = [f"real runs reproducing {DEFAULT_NATIVE_TEXT_LANE}'s v-scale boundaries (each run rechecks G3 "
             "against the identity's basis receipt, so each is caught; the drift figures must match the table"
             + ("; a real run judges under the identity's bounds, not --bounds, so its drift verdict may differ):"
                if bounds_given else "):")]
    for label, value, outcome in (
        ("smallest caught under (b)", result["drift_rule_and_g3"]["smallest_caught"],
         "samples pass the drift rule, the verdict fails the basis recheck"),
        ("smallest caught under (a)", result["drift_rule"]["smallest_caught"], "sample 1 fails the drift rule"),
        ("largest missed under (a)", result["drift_rule"]["largest_missed"],
         "samples pass the drift rule, the verdict fails the basis recheck"),
    ):
        if value is not None:
            lines.append(f"  {label} (eps {value}): qualify --recipe native-text --fault {fault(value)}   # {outcome}")
    return lines


# --------------------------------------------------------------------------- non-deterministic producers


ND_RULES = ("exact-token", "teacher-forced")
"""The two rung-2 rules a lane declared non-deterministic is judged under, each with the fixture
envelope and no digest check (:func:`NonDeterministicBench.caught`)."""

ND_CLASSES: dict[str, ProbeClass] = {
    probe.name: probe
    for probe in (
        CLASSES["v-scale"],
        CLASSES["k-scale"],
        ProbeClass("element-scale", f"eps: one layer-{faults.FAULT_LAYER} K element x (1 + eps)",
                   one_two_five(-7, 5), _scale("element-scale")),
        ProbeClass("last-position-scale", "eps: the last handed-off position's K and V x (1 + eps), every layer",
                   one_two_five(-7, -1), _scale("last-position-scale")),
        CLASSES["block-swap"],
    )
}
"""The issue's fault classes: V and K scaled, one element, the last position, and block swaps
(whose grid holds the half block, 64 positions, and the block, 128)."""

NAMED_SWAPS = (("half-block swap", "64"), ("block swap", "128"))
JITTER_SEED = 20261207
ND_DEFAULT_OUT = DEFAULT_OUT.parent / "detection-power-non-deterministic.json"


def jittered(kv: KVCache, rng: np.random.Generator, relative: float) -> KVCache:
    """Every K and V element moved by ``relative`` times its tensor's largest magnitude times a
    uniform draw in [-1, 1] (rounded to float32): an emulated run-to-run variation. A reduction
    order that changes with the batch errs in proportion to the sum it reduces, not to the element
    it yields, so the tensor's scale, not each element's, sets the size (measured on an H100 by
    ``bench/gpu_kv_run_to_run.py``: at most 2.17e-6 of the tensor's largest magnitude)."""
    if relative == 0:
        return kv

    def moved(tensor: np.ndarray) -> np.ndarray:
        if tensor.dtype != np.float32:
            raise Refused(f"--jitter: the KV is {tensor.dtype}, expected float32")
        scale = relative * float(np.abs(tensor).max())
        return (tensor + scale * rng.uniform(-1.0, 1.0, size=tensor.shape)).astype(np.float32)

    return KVCache([moved(k) for k in kv.keys], [moved(v) for v in kv.values], draft=kv.draft, meta=kv.meta)


@dataclass
class NonDeterministicProbe:
    """One fault's qualification (the rule's repetitions, each its own jittered handoff), judged
    under each rule of :data:`ND_RULES`."""

    figure: str | None
    fault: str | None
    caught: dict[str, bool]
    verdicts: dict[str, str]
    max_abs: float
    token_agreement_rate: float
    seconds: float

    def document(self) -> dict[str, Any]:
        return {"value": self.figure, "fault": self.fault, "caught": self.caught, "verdicts": self.verdicts,
                "worst_max_abs": self.max_abs, "worst_token_agreement_rate": self.token_agreement_rate,
                "seconds": round(self.seconds, 2)}


@dataclass
class NonDeterministicBench:
    """The lane declared non-deterministic: its producer started ``len(prefills)`` times, each
    handoff jittered by ``jitter`` (:func:`jittered`), the fixture envelope stated from honest handoffs over those
    starts, and the two rules' clauses derived from the same handoffs."""

    bench: LaneBench
    jitter: float
    prefills: list[KVCache]
    envelope: FixtureEnvelope | None = None
    rules: dict[str, BoundedDriftRule] = field(default_factory=dict)
    qualifications: int = 0

    def handoffs(self, transform: Callable[[KVCache], KVCache] | None,
                 ) -> tuple[list[dict[str, Any]], list[HandoffSeries]]:
        """One qualification: the rule's repetitions, each from the next producer start, jittered
        with its own seeded draw, then ``transform`` (a fault) applied."""
        self.qualifications += 1
        records, series = [], []
        for repetition in range(1, self.bench.rule.repetitions + 1):
            rng = np.random.default_rng([JITTER_SEED, self.qualifications, repetition])
            kv = jittered(self.prefills[(self.qualifications + repetition) % len(self.prefills)], rng, self.jitter)
            record, measured = self.bench.sample(kv if transform is None else transform(kv), repetition)
            records.append(record)
            series.append(measured)
        return records, series

    def caught(self, records: list[dict[str, Any]], series: list[HandoffSeries]) -> dict[str, tuple[bool, str]]:
        """Per rule: (caught, verdict words), the summary with no digest compared across
        repetitions or against an anchor, and the envelope."""
        assert self.envelope is not None
        envelope = judge_envelope(series, self.envelope)
        judged = {}
        for name, rule in self.rules.items():
            summary = judge_summary(records, rule, deterministic_producer=False)
            failing = [verdict.headline for verdict in (summary, envelope) if not verdict.passed]
            judged[name] = (bool(failing), "; ".join(failing) or f"{summary.headline}; {envelope.headline}")
        return judged

    def probe(self, figure: str | None, fault: str | None) -> NonDeterministicProbe:
        started = time.perf_counter()
        transform = None if fault is None else faults.kv_transform(fault, self.bench.producer.geometry.rope_theta)
        records, series = self.handoffs(transform)
        judged = self.caught(records, series)
        return NonDeterministicProbe(
            figure, None if fault is None else faults.fault_named(fault).name,
            {name: hit for name, (hit, _) in judged.items()}, {name: words for name, (_, words) in judged.items()},
            max(float(r["max_abs"]) for r in records), min(float(r["token_agreement_rate"]) for r in records),
            time.perf_counter() - started)


def _teacher_forced_clauses(records: list[dict[str, Any]]) -> tuple[float, float]:
    """(near-tie margin, parted share) by the teacher-forced bound policy over the honest handoffs
    as cells: each handoff's largest cold margin at a parting (0 when none) and its parted share."""
    from qualify.judge.calibration import bound_of

    margins, shares = [], []
    for record in records:
        teacher = (record.get("localisation") or {}).get("teacher_forced") or {}
        partings = teacher.get("partings") or []
        margins.append(max((float(p["cold_margin"]) for p in partings), default=0.0))
        shares.append(len(partings) / int(record["output_tokens"]))
    return bound_of(margins)[0], bound_of(shares)[0]


def set_up_non_deterministic(bench: LaneBench, jitter: float, starts: int, per_start: int, held_out: int,
                             log: Callable[[str], None]) -> tuple[NonDeterministicBench, dict[str, Any]]:
    """Start the producer ``starts`` times (the bench's own start first), state the envelope from
    ``starts * per_start`` honest handoffs, derive both rules, and judge ``held_out`` further
    honest qualifications under each (their false alarms are reported, never hidden)."""
    prefix = bench.prompt[:bench.handed_off]
    prefills = [bench.honest_kv]
    for _ in range(starts - 1):
        again = build_producer(bench.lane, lane_spec(bench.lane).mode).prefill(prefix)
        prefills.append(again)
    nd = NonDeterministicBench(bench, jitter, prefills)
    records, series = [], []
    for start in range(starts):
        for index in range(per_start):
            rng = np.random.default_rng([JITTER_SEED, 0, start, index])
            record, measured = bench.sample(jittered(prefills[start], rng, jitter))
            records.append(record)
            series.append(measured)
    nd.envelope = derive_fixture_envelope(series, starts=starts)
    margin, share = _teacher_forced_clauses(records)
    ceiling_max, ceiling_mean = max(nd.envelope.row_max_abs), max(nd.envelope.row_mean_abs)
    # Both rules' drift bounds are the envelope's largest ceilings, which every row within its own
    # ceiling meets: the envelope judges the rows, these only restate it for judge_summary.
    exact = BoundedDriftRule(repetitions=bench.rule.repetitions, output_tokens=bench.rule.output_tokens,
                             maximum_absolute=ceiling_max, maximum_mean_absolute=ceiling_mean)
    nd.rules = {"exact-token": exact,
                "teacher-forced": exact.model_copy(update={"near_tie_margin": margin,
                                                           "maximum_changed_row_share": share})}
    honest = [nd.probe(None, None) for _ in range(held_out)]
    false_alarms = {name: sum(probe.caught[name] for probe in honest) for name in ND_RULES}
    for name in ND_RULES:
        log(f"{bench.lane} declared non-deterministic, jitter {jitter:g}, {name}: {false_alarms[name]} of "
            f"{held_out} honest held-out qualifications refused")
    state = {
        "jitter_relative": jitter, "producer_starts": starts, "envelope_handoffs": len(series),
        "starts_bit_identical": all(a.tobytes() == b.tobytes() for kv in prefills[1:]
                                    for a, b in zip(prefills[0].keys + prefills[0].values, kv.keys + kv.values,
                                                    strict=True)),
        "envelope": {"rule": nd.envelope.rule, "multipliers": list(nd.envelope.multipliers),
                     "largest_row_max_abs": ceiling_max,
                     "largest_row_mean_abs": ceiling_mean,
                     "largest_position_max_abs": max(nd.envelope.position_max_abs),
                     "tensor_position_ceilings": len(nd.envelope.tensor_position_max_abs),
                     "honest_spread_row_max_abs": max(max(column) - min(column) for column in
                                                      zip(*(m.row_max_abs for m in series), strict=True))},
        "rules": {name: rule.model_dump() for name, rule in nd.rules.items()},
        "held_out": {"qualifications": held_out, "refused": false_alarms,
                     "verdicts": [probe.document() for probe in honest]},
    }
    return nd, state


def measure_non_deterministic(nd: NonDeterministicBench, probe_class: ProbeClass,
                              log: Callable[[str], None]) -> dict[str, Any]:
    grid = probe_class.grid
    probes: dict[int, NonDeterministicProbe] = {}

    def probe_at(index: int) -> NonDeterministicProbe:
        if index not in probes:
            probe = probes[index] = nd.probe(grid[index], probe_class.fault(grid[index]))
            log(f"  {probe.fault}: " + ", ".join(f"{name} {'caught' if probe.caught[name] else 'missed'}"
                                                 for name in ND_RULES)
                + f"; worst max {probe.max_abs:.6g}, tokens {probe.token_agreement_rate:.4g} [{probe.seconds:.1f} s]")
        return probes[index]

    def caught_under(name: str) -> Callable[[int], bool]:
        return lambda index: probe_at(index).caught[name]

    searches = {name: bisect(len(grid), caught_under(name)) for name in ND_RULES}
    if probe_class.name == "block-swap":
        for _, span in NAMED_SWAPS:
            probe_at(grid.index(span))
    return {
        "class": probe_class.name, "parameter": probe_class.parameter, "grid": list(grid),
        "rules": {name: {"smallest_caught": None if search.boundary is None else grid[search.boundary],
                         "caught_at_grid_minimum": search.boundary == 0,
                         "largest_missed": (grid[-1] if search.boundary is None
                                            else grid[search.boundary - 1] if search.boundary > 0 else None),
                         "non_monotone": [grid[i] for i in search.non_monotone]}
                  for name, search in searches.items()},
        "named": {words: {name: probes[grid.index(span)].caught[name] for name in ND_RULES}
                  for words, span in NAMED_SWAPS} if probe_class.name == "block-swap" else {},
        "probes": [probes[i].document() for i in sorted(probes)],
    }


def non_deterministic_table(classes: list[dict[str, Any]]) -> list[str]:
    header = ("class", "parameter", *(f"{name}: smallest caught" for name in ND_RULES),
              *(f"{name}: largest missed" for name in ND_RULES))
    rows = [header]
    for result in classes:
        found = [result["rules"][name] for name in ND_RULES]
        rows.append((result["class"], result["parameter"], *(_caught_text(f, result["grid"][-1]) for f in found),
                     *((f["largest_missed"] or "-") + (" (non-monotone)" if f["non_monotone"] else "")
                       for f in found)))
        for words, caught in result["named"].items():
            rows.append((f"  {words}", "", *("caught" if caught[name] else "missed" for name in ND_RULES), "", ""))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = [" | ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip() for row in rows]
    lines.insert(1, "-+-".join("-" * width for width in widths))
    return lines


def non_deterministic_line(classes: list[dict[str, Any]]) -> str:
    """The last line: the smallest caught V eps under each rule, the producer declared non-deterministic."""
    result = next((r for r in classes if r["class"] == "v-scale"), None)
    if result is None:
        return "min_detected_v_scale_eps_non_deterministic: none (v-scale was not measured)"
    return "min_detected_v_scale_eps_non_deterministic: " + ", ".join(
        f"{_caught_text(result['rules'][name], result['grid'][-1])} ({name})" for name in ND_RULES)


def run_non_deterministic(args: argparse.Namespace, chosen: list[str]) -> int:
    """``--non-deterministic``: the default lane declared non-deterministic (no digest check at
    all), judged by each rule with its fixture envelope; prints the table and its last line."""
    started = time.perf_counter()
    bench = set_up_lane(DEFAULT_NATIVE_TEXT_LANE, None)
    nd, state = set_up_non_deterministic(bench, args.jitter, args.starts, args.envelope_handoffs // args.starts,
                                         args.held_out, log)
    classes = [measure_non_deterministic(nd, ND_CLASSES[name], log) for name in chosen]
    wall_s = time.perf_counter() - started
    last = non_deterministic_line(classes)
    out = args.out if args.out != DEFAULT_OUT else ND_DEFAULT_OUT.with_name(
        f"{ND_DEFAULT_OUT.stem}-jitter-{args.jitter:g}.json")
    document = {"schema": "trust-ladder.detection-power-non-deterministic.v1", "lane": DEFAULT_NATIVE_TEXT_LANE,
                "prompt": PROMPT_NOTE, **state, "classes": classes, "handoffs": bench.probes,
                "wall_s": round(wall_s, 1), "last_line": last}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(document, indent=1) + "\n", encoding="utf-8")
    held = state["held_out"]
    print(f"{DEFAULT_NATIVE_TEXT_LANE} declared non-deterministic: no digest checked across repetitions or "
          f"against an anchor; run-to-run variation emulated by seeded jitter of {args.jitter:g} of each KV "
          f"tensor's largest magnitude; {state['producer_starts']} producer starts (bit-identical: "
          f"{state['starts_bit_identical']})")
    print(f"fixture envelope ({state['envelope']['rule']}, k {state['envelope']['multipliers']} for row max, row "
          f"mean, position, layer tensor position) from {state['envelope_handoffs']} honest handoffs: "
          f"largest row max ceiling {state['envelope']['largest_row_max_abs']!r}, largest honest spread "
          f"{state['envelope']['honest_spread_row_max_abs']!r}")
    print("honest held-out qualifications refused: " + ", ".join(
        f"{held['refused'][name]} of {held['qualifications']} ({name})" for name in ND_RULES))
    print()
    for line in non_deterministic_table(classes):
        print(line)
    print()
    print(f"wall {wall_s:.1f} s, {bench.probes} handoffs; JSON: {out}")
    print(last)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--lanes", default=",".join(LANES), help=f"comma-separated lanes (default {','.join(LANES)})")
    parser.add_argument("--classes", default=",".join(CLASSES),
                        help=f"comma-separated fault classes (default {','.join(CLASSES)})")
    parser.add_argument("--bounds", default=None, metavar="MAX,MEAN",
                        help="judge every lane under these bounds instead of its identity's")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="write the JSON here")
    parser.add_argument("--non-deterministic", action="store_true",
                        help=f"the default lane declared non-deterministic: fixture envelope, no digest check "
                             f"(classes {','.join(ND_CLASSES)})")
    parser.add_argument("--jitter", type=float, default=0.0, metavar="R",
                        help="with --non-deterministic: each KV element moved by up to R times its tensor's largest "
                             "magnitude per handoff (0: the producer as it is)")
    parser.add_argument("--starts", type=int, default=2, help="with --non-deterministic: producer starts")
    parser.add_argument("--envelope-handoffs", type=int, default=8,
                        help="with --non-deterministic: honest handoffs the envelope is stated from")
    parser.add_argument("--held-out", type=int, default=3,
                        help="with --non-deterministic: honest qualifications judged after the envelope")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    try:
        if args.non_deterministic:
            chosen = [name for name in (args.classes if args.classes != ",".join(CLASSES)
                                        else ",".join(ND_CLASSES)).split(",") if name]
            if not chosen or any(name not in ND_CLASSES for name in chosen):
                raise Refused(f"--classes: found {args.classes!r}, expected some of {', '.join(ND_CLASSES)}")
            if not (math.isfinite(args.jitter) and 0 <= args.jitter < 1):
                raise Refused(f"--jitter: found {args.jitter!r}, expected a number from 0 to below 1")
            for option, value, least in (("--starts", args.starts, 2),
                                         ("--held-out", args.held_out, 1),
                                         ("--envelope-handoffs", args.envelope_handoffs, 2 * args.starts)):
                if value < least:
                    raise Refused(f"{option}: found {value}, expected a whole number >= {least}")
            return run_non_deterministic(args, chosen)
        lanes = [lane for lane in args.lanes.split(",") if lane]
        unknown = [lane for lane in lanes if lane not in LANES]
        if unknown or not lanes:
            raise Refused(f"--lanes: found {args.lanes!r}, expected some of {', '.join(LANES)}")
        chosen = [name for name in args.classes.split(",") if name]
        if not chosen or any(name not in CLASSES for name in chosen):
            raise Refused(f"--classes: found {args.classes!r}, expected some of {', '.join(CLASSES)}")
        if args.bounds is not None:
            parse_bounds(args.bounds)
        documents = []
        for lane in lanes:
            lane_started = time.perf_counter()
            bench = set_up_lane(lane, args.bounds)
            honest = bench.honest
            assert honest is not None
            reproduces, basis_words = basis_check(bench.terms, bench.anchor)
            log(f"{lane}: rule max <= {bench.rule.maximum_absolute!r}, mean <= {bench.rule.maximum_mean_absolute!r} "
                f"({bench.rule_source}); honest max {honest.max_abs!r} mean {honest.mean_abs!r}; producer "
                f"deterministic in-process: {bench.deterministic}; anchor vs basis receipt: {basis_words}")
            classes = [measure_class(bench, CLASSES[name], log) for name in chosen]
            documents.append({
                "lane": lane,
                "prompt": bench.terms.prompt_name, "handoff_positions": bench.handed_off,
                "output_tokens": bench.terms.output_tokens,
                "rule": {"maximum_absolute": bench.rule.maximum_absolute,
                         "maximum_mean_absolute": bench.rule.maximum_mean_absolute, "source": bench.rule_source},
                "deterministic_producer_declared": bench.terms.deterministic_producer,
                "deterministic_in_process": bench.deterministic,
                "anchor_reproduces_basis_receipt": reproduces,
                "anchor_basis_check": basis_words,
                "kv_envelope_from_anchor": bench.kv_envelope,
                "honest": honest.document(),
                "probes": bench.probes,
                "seconds": round(time.perf_counter() - lane_started, 1),
                "classes": classes,
            })
    except Refused as refusal:
        print(f"refused: {one_line(str(refusal))}", file=sys.stderr)
        return 2
    wall_s = time.perf_counter() - started
    last = v_scale_line(documents)
    document = {
        "schema": "trust-ladder.detection-power.v1",
        "prompt": PROMPT_NOTE,
        "fault_site": {"layer": faults.FAULT_LAYER, "head": faults.FAULT_HEAD, "position": faults.FAULT_POSITION,
                       "dim": faults.FAULT_DIM, "block_swap_start": faults.BLOCK_SWAP_START,
                       "swapped_heads": list(faults.SWAPPED_HEADS), "kv_ulp_seed": faults.KV_ULP_SEED},
        "grids": {name: {"parameter": CLASSES[name].parameter, "values": list(CLASSES[name].grid)} for name in chosen},
        "rules": {"drift_rule": "judge_summary (each sample through judge_sample) under the lane's rung-2 rule",
                  "drift_rule_and_g3": "drift_rule, and judge_reproduction against the honest producer's records"},
        "lanes": documents,
        "wall_s": round(wall_s, 1),
        "last_line": last,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(document, indent=1) + "\n", encoding="utf-8")
    for line in lane_lines(documents):
        print(line)
    print()
    for line in table(documents):
        print(line)
    print()
    for line in reproduce_lines(documents, args.bounds is not None):
        print(line)
    print(f"wall {wall_s:.1f} s, {sum(lane['probes'] for lane in documents)} handoffs; JSON: {args.out}")
    print(last)
    return 0


def log(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
