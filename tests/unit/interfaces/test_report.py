"""``qualify report``: the page of one receipt and the comparison of several, read as a reader
would (the verdict, its scope, every plot, the bounds), and its refusals (one line, exit 2,
nothing written).

Fast tests use receipts written here with the harness's own writer (the default lane's real
identity, so the envelope comes from its committed basis receipt); the slow ones use receipts of
real runs (``qualify --recipe native-text``, passing and with the v-scale fault), made once per
test session and shared by the xdist workers (:func:`real_receipts_in`).
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from qualify.archive.keys import default_trust_path, ensure_signing_key
from qualify.archive.writer import ReceiptWriter
from qualify.contract.identity import DEFAULT_ARCHIVE_DIR, BoundedDriftLogits, Identity, load_identity
from qualify.core.assets import REPO_ROOT
from qualify.evidence.records import rule_from_identity
from qualify.interfaces.report import MAX_RECEIPTS, report_cli
from qualify.interfaces.report_check import outline_problems, page_outline
from qualify.judge import judge_summary
from qualify.judge.calibration import anchor_records
from qualify.judge.scope import Scope, scope_document
from qualify.run.run_contract import (
    identity_path_for_lane,
    kv_envelope_from_records,
    receipt_evidence,
    receipt_sample_records,
)
from tests.support.receipt_forgery import make_writable
from tests.unit.archive.test_receipts import as_v2_receipt
from tests.unit.judge.test_judge import rung2_record
from tests.unit.judge.test_scope import SCOPE, scoped

LANE = "nvfp4-native-w4a4"
"""The default lane of ``qualify --recipe native-text`` (rung 2; its basis receipt is committed)."""
LEGACY_RECEIPT = DEFAULT_ARCHIVE_DIR / "20261130T194322Z-608a7572d480ad15"
"""A committed receipt from before signing and series: three records, the third a producer stall."""
POSITIONS, LAYERS, HANDED_OFF = 48, 4, 24
XHTML = "{http://www.w3.org/1999/xhtml}"


# --------------------------------------------------------------------------- receipts made here


@pytest.fixture(scope="module")
def identity() -> Identity:
    return load_identity(identity_path_for_lane(LANE))


def basis_run_id(identity: Identity) -> str:
    return identity.onboarding_qualification.basis.removeprefix("receipt://").split("/")[0]


def lane_envelope(identity: Identity) -> list[tuple[float, float]]:
    """The lane's calibrated per-layer KV envelope, read the way the qualifier reads it: over the
    basis's fixture anchors only (its calibration cells hand off other documents)."""
    basis = DEFAULT_ARCHIVE_DIR / basis_run_id(identity)
    anchors = anchor_records(receipt_evidence(basis, "calibration"), receipt_sample_records(basis))
    assert len(anchors) >= 2
    found = kv_envelope_from_records([dict(record) for record in anchors], LAYERS)
    assert found is not None
    return found


@pytest.fixture(scope="module")
def envelope(identity: Identity) -> list[tuple[float, float]]:
    return lane_envelope(identity)


def make_series(envelope: list[tuple[float, float]], *, seed: int = 0, diverge_at: int | None = None,
                kv_scale: float = 0.5, over: tuple[int, int] | None = None,
                max_scale: float = 0.8) -> dict[str, np.ndarray]:
    """A sample's series: max-abs drift up to ``max_scale`` (logit units), KV deltas at
    ``kv_scale`` of the envelope (``over``: (layer, 0 K or 1 V) pushed 10% over it), tokens that
    differ from ``diverge_at`` on."""
    rng = np.random.default_rng(seed)
    maximum = rng.uniform(0.1, max_scale, POSITIONS)
    cold = rng.integers(0, 4000, POSITIONS)
    handoff = cold.copy()
    if diverge_at is not None:
        handoff[diverge_at:] = (cold[diverge_at:] + 1) % 4000
    k = np.array([bound[0] for bound in envelope]) * kv_scale
    v = np.array([bound[1] for bound in envelope]) * kv_scale
    if over is not None:
        layer, tensor = over
        (k, v)[tensor][layer] = envelope[layer][tensor] * 1.1
    return {
        "logit_max_abs_delta": maximum,
        "logit_mean_abs_delta": maximum / 16,
        "cold_top1_top2_margin": rng.uniform(0.2, 4.0, POSITIONS),
        "handoff_tokens": handoff.astype(np.int64),
        "cold_tokens": cold.astype(np.int64),
        "kv_k_max_abs_delta": k,
        "kv_v_max_abs_delta": v,
        "kv_position_max_abs_delta": rng.uniform(0.0, 1.0, HANDED_OFF),
    }


def write_lane_receipt(archive: Path, identity: Identity | Mapping[str, Any],
                       series: list[dict[str, np.ndarray] | None], *, max_abs: float = 0.5,
                       scope: Scope | None = None) -> Path:
    """A signed receipt of the default lane as the qualifier writes one: a record per series
    (``None``: a sample that failed before its comparison, so it has no series file); with
    ``scope``, its verdict states it, as a qualification's does."""
    ensure_signing_key(announce=lambda line: None)
    loaded = identity if isinstance(identity, Identity) else load_identity(identity_path_for_lane(LANE))
    rule = rule_from_identity(loaded, drift_graded=True)
    records = [rung2_record(index, max_abs=max_abs, mean_abs=0.05) for index in range(1, len(series) + 1)]
    writer = ReceiptWriter(archive, command_line=["qualify", "--recipe", "native-text"],
                           identity=identity if isinstance(identity, Mapping) else loaded,
                           recipe="native-text", lane=LANE, rule=rule, versions={"consumer": "reference 0.1"})
    try:
        for index, (record, tensors) in enumerate(zip(records, series, strict=True), 1):
            writer.add_sample(record)
            if tensors is not None:
                writer.add_series(index, tensors)
        verdict = judge_summary(records, rule)
        verdict = scoped(verdict, scope) if scope is not None else verdict
    finally:
        path = writer.finalize(verdict)
    make_writable(path)  # tests that tamper with a copy need it writable; the original stays intact
    return path


@pytest.fixture(scope="module")
def passing(tmp_path_factory: pytest.TempPathFactory, identity: Identity,
            envelope: list[tuple[float, float]]) -> Path:
    archive = tmp_path_factory.mktemp("passing")
    return write_lane_receipt(archive, identity, [make_series(envelope, seed=seed) for seed in (1, 2, 3)])


@pytest.fixture(scope="module")
def faulty(tmp_path_factory: pytest.TempPathFactory, identity: Identity,
           envelope: list[tuple[float, float]]) -> Path:
    """One sample over the max bound (drift up to 1.6 times it), its tokens diverging at position 7,
    V of layer 2 over the envelope."""
    archive = tmp_path_factory.mktemp("faulty")
    over_bound = 1.6 * identity_bounds(identity)[0]
    return write_lane_receipt(archive, identity, [
        make_series(envelope, seed=4, diverge_at=7, over=(2, 1), max_scale=over_bound)], max_abs=over_bound)


def identity_bounds(identity: Identity) -> tuple[float, float]:
    """The lane's sealed (max, mean) full-logit bounds (rung 2: bounded drift)."""
    full_logits = identity.onboarding_qualification.full_logits
    assert isinstance(full_logits, BoundedDriftLogits), full_logits
    return full_logits.maximum_absolute, full_logits.maximum_mean_absolute


def report(receipts: list[Path], output: Path, *extra: str,
           capsys: pytest.CaptureFixture[str]) -> tuple[int, list[str], list[str]]:
    """``qualify report RECEIPTS --output OUTPUT`` in-process: exit code, stdout and stderr lines."""
    code = report_cli([*map(str, receipts), "--output", str(output), *extra])
    captured = capsys.readouterr()
    return code, captured.out.splitlines(), captured.err.splitlines()


def summary_of(receipt: Path) -> dict[str, Any]:
    document: dict[str, Any] = json.loads((receipt / "validation-summary.json").read_text(encoding="utf-8"))
    return document


def element(page: Path, element_id: str) -> ET.Element:
    """The element with ``element_id`` of a page parsed as XML (the page is well-formed XML)."""
    root = ET.parse(page).getroot()
    for found in root.iter():
        if found.get("id") == element_id:
            return found
    raise AssertionError(f"{page.name}: no element with id {element_id!r}")


def text_of(page: Path, element_id: str) -> str:
    return " ".join("".join(element(page, element_id).itertext()).split())


def figure_ids(page: Path) -> list[str]:
    root = ET.parse(page).getroot()
    return [found.get("id", "") for found in root.iter() if found.tag in ("figure", f"{XHTML}figure")
            and "plot" in (found.get("class") or "").split()]


def assert_each_figure_holds_an_svg(page: Path) -> None:
    root = ET.parse(page).getroot()
    for found in root.iter():
        if found.tag == "figure" and "plot" in (found.get("class") or "").split():
            svgs = [child for child in found if child.tag.endswith("svg")]
            assert len(svgs) == 1, f"figure {found.get('id')} holds {len(svgs)} svg elements"


# --------------------------------------------------------------------------- one receipt


def test_single_page_shows_the_signed_verdict_scope_and_every_plot(
        passing: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    page = tmp_path / "page.html"
    code, out, err = report([passing], page, capsys=capsys)
    assert (code, err) == (0, [])
    assert out[-1].startswith(f"report: wrote {page} (") and "signature verified" in out[0]
    summary = summary_of(passing)
    assert text_of(page, "verdict-status") == "QUALIFIED"
    assert text_of(page, "verdict-headline") == " ".join(summary["verdict"].split())
    assert [" ".join(item.itertext()) for item in element(page, "verdict-reasons")] == summary["reasons"]
    scope = text_of(page, "verdict-scope")
    assert scope.startswith("Scope: lane nvfp4-native-w4a4 (native-text) under identity ")
    assert "over 3 ordered handoffs of 256 greedy tokens each" in scope
    assert text_of(page, "signature").startswith("Signature verified: signed by key ")
    assert figure_ids(page) == [*(f"drift-sample-{n}" for n in (1, 2, 3)),
                                *(f"margin-sample-{n}" for n in (1, 2, 3)), "kv-heatmap"]
    assert_each_figure_holds_an_svg(page)


def test_identity_table_shows_the_sealed_bounds(passing: Path, tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    page = tmp_path / "page.html"
    assert report([passing], page, capsys=capsys)[0] == 0
    bounds = json.loads(identity_path_for_lane(LANE).read_text(encoding="utf-8"))["onboarding_qualification"]["full_logits"]
    table = element(page, "identity-table")
    shown = {" ".join("".join(row[0].itertext()).split()): " ".join("".join(row[1].itertext()).split())
             for row in table}
    assert shown["lane"] == LANE and shown["rung"] == "2" and shown["recipe"] == "native-text"
    assert shown["identity sha256"] == summary_of(passing)["identity_sha256"]
    assert shown["full-logit bounds"] == (f"max |Δlogit| ≤ {bounds['maximum_absolute']:.6g}, mean ≤ "
                                          f"{bounds['maximum_mean_absolute']:.6g} (identity full_logits: bounded-drift)")
    assert f"(bound {bounds['maximum_absolute']:.6g}) within its bound" in text_of(page, "drift-sample-1")


def test_kv_heatmap_is_read_against_the_basis_receipts_envelope(passing: Path, identity: Identity, tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    page = tmp_path / "page.html"
    assert report([passing], page, capsys=capsys)[0] == 0
    caption = text_of(page, "kv-heatmap")
    assert f"envelope: per-layer maxima over the fixture anchors of basis receipt {basis_run_id(identity)}" in caption
    assert caption.endswith("Every layer within the envelope.")


def test_fault_page_marks_the_bound_the_first_divergence_and_the_layer_over_its_envelope(
        faulty: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    page = tmp_path / "page.html"
    code, _out, err = report([faulty], page, capsys=capsys)
    assert (code, err) == (0, [])  # a failed run verifies: the exit code speaks of the signature
    assert text_of(page, "verdict-status") == "NOT QUALIFIED"
    assert "OVER its bound" in text_of(page, "drift-sample-1")
    assert re.search(r"\d+ positions? over the bound", text_of(page, "drift-sample-1"))  # the legend: SVG text
    assert "first divergence at position 7" in text_of(page, "margin-sample-1")
    assert "first divergence: position 7" in text_of(page, "margin-sample-1")
    assert text_of(page, "kv-heatmap").endswith("1 layer cell over the envelope.")
    assert "110%" in text_of(page, "kv-heatmap")


def test_envelope_unavailable_is_said_on_the_page_not_a_failure(
        identity: Identity, envelope: list[tuple[float, float]], tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    document = json.loads(identity_path_for_lane(LANE).read_text(encoding="utf-8"))
    document["onboarding_qualification"]["basis"] = "receipt://20990101T000000Z-0000000000000000/command.log"
    receipt = write_lane_receipt(tmp_path / "archive", document, [make_series(envelope)])
    page = tmp_path / "page.html"
    assert report([receipt], page, capsys=capsys)[0] == 0
    caption = text_of(page, "kv-heatmap")
    assert "envelope unavailable: receipt uri receipt://20990101T000000Z-0000000000000000/command.log: no receipt" in caption
    assert "over the envelope" not in caption and "within the envelope" not in caption


def test_sample_without_series_is_tabled_with_why(identity: Identity, envelope: list[tuple[float, float]],
                                                  tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    receipt = write_lane_receipt(tmp_path / "archive", identity, [make_series(envelope), None])
    page = tmp_path / "page.html"
    assert report([receipt], page, capsys=capsys)[0] == 0
    assert figure_ids(page) == ["drift-sample-1", "margin-sample-1", "kv-heatmap"]
    rows = list(element(page, "samples-table"))[1:]
    assert "no series: the sample failed before its comparison" in "".join(rows[1].itertext())


def test_legacy_receipt_says_it_has_no_series_and_tables_its_records(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    page = tmp_path / "legacy.html"
    code, out, err = report([LEGACY_RECEIPT], page, capsys=capsys)
    assert (code, err) == (1, [])  # written, but an unsigned receipt is not verified
    assert "NOT VERIFIED (unsigned)" in out[0]
    assert text_of(page, "signature").startswith("NOT VERIFIED: unsigned: a legacy receipt with no signed statement")
    assert "predates per-position series (a legacy receipt)" in text_of(page, "no-series")
    assert text_of(page, "verdict-status") == "INCOMPLETE: NOT QUALIFIED"
    rows = list(element(page, "samples-table"))[1:]
    assert [row[0].text for row in rows] == ["1", "2", "3"]
    assert "silent for 15.0 s during handoff" in "".join(rows[2].itertext())
    assert figure_ids(page) == ["kv-heatmap"]  # from the records' per-layer KV localisation


def test_tampered_receipt_is_rendered_under_a_red_not_verified_banner(
        passing: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    copy = tmp_path / passing.name
    shutil.copytree(passing, copy)
    series = copy / "series" / "sample-2.safetensors"
    data = bytearray(series.read_bytes())
    data[-1] ^= 0x01  # a flipped bit in a delta: still a well-formed series, no longer the signed one
    series.write_bytes(bytes(data))
    page = tmp_path / "page.html"
    code, out, err = report([copy], page, capsys=capsys)
    assert (code, err) == (1, [])
    assert "NOT VERIFIED (tampered)" in out[0]
    banner = element(page, "signature")
    assert banner.get("class") == "banner not-verified"
    assert text_of(page, "signature").startswith("NOT VERIFIED: tampered")
    assert "altered file series/sample-2.safetensors" in text_of(page, "signature")
    assert text_of(page, "verdict-status") == "QUALIFIED"  # still shown, and said to be unauthenticated
    assert "unauthenticated files" in text_of(page, "signature")


def test_receipt_signed_by_an_untrusted_key_says_untrusted(
        passing: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "another-operator"))  # no trust file there
    page = tmp_path / "page.html"
    code, _out, _err = report([passing], page, capsys=capsys)
    assert code == 1
    assert text_of(page, "signature").startswith("NOT VERIFIED: untrusted")


def test_markup_in_a_receipts_name_is_shown_as_text(passing: Path, tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """A receipt renamed to markup (and TeX dollars, which matplotlib would otherwise parse) is
    shown as text on the page and in the plot legends, under its tampered banner."""
    renamed = tmp_path / "<b>$\\frac{x$ & $y$"
    shutil.copytree(passing, renamed)
    page = tmp_path / "page.html"
    code, _out, err = report([renamed, passing], page, capsys=capsys)
    assert (code, err) == (1, [])
    root = ET.parse(page).getroot()
    assert not [found for found in root.iter() if found.tag.rsplit("}", 1)[-1] == "b"]
    assert renamed.name in text_of(page, "compare-drift")  # the legend, as written
    assert "is not a run id" in text_of(page, "signature-receipt-1")


def test_same_receipt_gives_the_same_page_bytes(passing: Path, tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    first, second = tmp_path / "a.html", tmp_path / "b.html"
    assert report([passing], first, capsys=capsys)[0] == 0
    assert report([passing], second, capsys=capsys)[0] == 0
    assert first.read_bytes() == second.read_bytes()


def test_page_loads_nothing_and_runs_no_script(passing: Path, tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    page = tmp_path / "page.html"
    assert report([passing], page, capsys=capsys)[0] == 0
    root = ET.parse(page).getroot()
    tags = {found.tag.rsplit("}", 1)[-1] for found in root.iter()}
    assert not tags & {"script", "link", "img", "iframe", "object", "embed"}
    for found in root.iter():
        for name, value in found.attrib.items():
            if name.endswith("href") or name == "src":
                assert value.startswith(("#", "data:")), (found.tag, name, value)
    policy = [found.get("content") for found in root.iter() if found.get("http-equiv") == "Content-Security-Policy"]
    assert policy == ["default-src 'none'; style-src 'unsafe-inline'; img-src data:"]


def test_help_never_imports_matplotlib() -> None:
    probe = ("import sys, contextlib, io\n"
             "from qualify.interfaces.cli import main\n"
             "with contextlib.redirect_stdout(io.StringIO()):\n"
             "    codes = [main(['--help']), main(['report', '--help'])]\n"
             "print(codes, 'matplotlib' in sys.modules)\n")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=REPO_ROOT, check=True)
    assert done.stdout.strip() == "[0, 0] False"


def controls_rows(page: Path) -> list[list[str]]:
    """The controls table's body rows, cell texts in order (the header row aside)."""
    rows = [row for row in element(page, "controls-table") if row.tag.endswith("tr")]
    return [[" ".join("".join(cell.itertext()).split()) for cell in row] for row in rows[1:]]


def has_element(page: Path, element_id: str) -> bool:
    return any(found.get("id") == element_id for found in ET.parse(page).getroot().iter())


def test_single_page_states_what_the_verdict_covers_and_its_controls(
        identity: Identity, envelope: list[tuple[float, float]], tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    receipt = write_lane_receipt(tmp_path / "archive", identity, [make_series(envelope, seed=seed) for seed in (1, 2, 3)], scope=SCOPE)
    page = tmp_path / "page.html"
    assert report([receipt], page, capsys=capsys)[0] == 0
    scope = summary_of(receipt)["scope"]
    assert scope == scope_document(SCOPE, True)
    assert text_of(page, "verdict-scope-line") == f"Covers: {scope['line']}"
    assert text_of(page, "verdict-headline").startswith(scope["line"])
    assert controls_rows(page) == [
        [document["document"], "yes" if document["within"] else "no",
         ", ".join(map(str, document["exceeding_lengths"])) or "—"] for document in scope["controls"]["documents"]]
    (caption,) = [" ".join("".join(part.itertext()).split()) for part in element(page, "controls-table")
                  if part.tag.endswith("caption")]
    assert caption == (f"Controls e2-controls-v1: 2 of 3 documents within their E1 gates, at lengths 512, 1024, "
                       f"2048, 4096; measured in {scope['controls']['source']}.")


def test_a_lane_with_no_controls_shows_its_scope_line_and_no_table(
        identity: Identity, envelope: list[tuple[float, float]], tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    bare = Scope("python-textwrap", 3, 2048, 256, None)
    receipt = write_lane_receipt(tmp_path / "archive", identity, [make_series(envelope, seed=seed) for seed in (1, 2, 3)], scope=bare)
    page = tmp_path / "page.html"
    assert report([receipt], page, capsys=capsys)[0] == 0
    assert text_of(page, "verdict-scope-line") == (
        "Covers: QUALIFIED on fixture python-textwrap (3 × 2048/256); controls: none declared for this lane")
    assert not has_element(page, "controls-table")


def test_a_page_without_a_scope_shows_neither_line_nor_table(
        passing: Path, identity: Identity, envelope: list[tuple[float, float]], tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    """A verdict with no scope (a v3 summary's null), and a v2 receipt, signed, from before scopes."""
    v2 = as_v2_receipt(write_lane_receipt(tmp_path / "archive", identity, [make_series(envelope, seed=1)],
                                          scope=SCOPE))
    for receipt in (passing, v2):
        page = tmp_path / f"{receipt.name}.html"
        assert report([receipt], page, capsys=capsys)[0] == 0
        assert text_of(page, "signature").startswith("Signature verified")
        assert not has_element(page, "verdict-scope-line") and not has_element(page, "controls-table")
        assert text_of(page, "verdict-scope").startswith("Scope: lane nvfp4-native-w4a4")


# --------------------------------------------------------------------------- several receipts


def test_comparison_page_puts_verdicts_side_by_side_with_overlaid_drift(
        passing: Path, faulty: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    page = tmp_path / "compare.html"
    code, out, err = report([passing, faulty], page, capsys=capsys)
    assert (code, err) == (0, [])
    assert len(out) == 3
    first, second = element(page, "verdict-receipt-1"), element(page, "verdict-receipt-2")
    assert [first[0].text, second[0].text] == ["QUALIFIED", "NOT QUALIFIED"]
    assert first[1].text == summary_of(passing)["verdict"] and second[1].text == summary_of(faulty)["verdict"]
    assert figure_ids(page) == ["compare-drift", "kv-heatmap-receipt-1", "kv-heatmap-receipt-2"]
    assert_each_figure_holds_an_svg(page)
    assert "1 layer cell over the envelope" in text_of(page, "kv-heatmap-receipt-2")
    assert passing.name in text_of(page, "compare-drift") and faulty.name in text_of(page, "compare-drift")


def test_comparison_page_states_what_each_verdict_covers(
        passing: Path, identity: Identity, envelope: list[tuple[float, float]], tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    receipt = write_lane_receipt(tmp_path / "archive", identity, [make_series(envelope, seed=seed) for seed in (1, 2, 3)], scope=SCOPE)
    page = tmp_path / "compare.html"
    assert report([receipt, passing], page, capsys=capsys)[0] == 0
    (covers,) = [row for row in element(page, "verdicts") if "".join(row[0].itertext()) == "covers"]
    assert [" ".join("".join(cell.itertext()).split()) for cell in covers][1:] == [
        summary_of(receipt)["scope"]["line"], "—"]


def test_comparison_with_a_legacy_receipt_says_which_has_no_series(
        passing: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    page = tmp_path / "compare.html"
    code, _out, _err = report([passing, LEGACY_RECEIPT], page, capsys=capsys)
    assert code == 1
    assert f"No series in receipt 2: {LEGACY_RECEIPT.name}." in text_of(page, "compare-drift")
    assert text_of(page, "signature-receipt-2").startswith("NOT VERIFIED: unsigned")


# --------------------------------------------------------------------------- refusals


def _no_page_left(directory: Path) -> bool:
    """Nothing written: neither a page nor a temporary beside it."""
    return not any(path.suffix in (".html", ".tmp") for path in directory.iterdir())


@pytest.mark.parametrize("case", ["missing", "a file", "no receipt", "archive", "bad summary", "summary schema"])
def test_unusable_receipt_is_refused_in_one_line_and_nothing_written(
        case: str, passing: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    target = tmp_path / "target"
    expected = {
        "missing": "no such directory, expected a receipt directory",
        "a file": "not a directory, expected a receipt directory",
        "no receipt": "not a receipt (no validation-summary.json or manifest.json)",
        "archive": "not a receipt (no validation-summary.json or manifest.json); to report on an archive, name its receipts",
        "bad summary": "validation-summary.json: not JSON",
        "summary schema": "validation-summary.json: ",
    }[case]
    if case == "a file":
        target.write_text("x")
    elif case == "no receipt":
        target.mkdir()
    elif case == "archive":
        shutil.copytree(passing, target / passing.name)
    elif case in ("bad summary", "summary schema"):
        shutil.copytree(passing, target)
        summary = summary_of(target)
        summary["samples"] = "three"
        (target / "validation-summary.json").write_text("{" if case == "bad summary" else json.dumps(summary))
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    code, out, err = report([target], out_dir / "page.html", capsys=capsys)
    assert code == 2 and out == [] and len(err) == 1
    assert err[0].startswith("qualify report: receipt ") and expected in err[0]
    assert "Traceback" not in err[0] and "internal error" not in err[0]
    assert _no_page_left(out_dir)


@pytest.mark.parametrize("case", ["directory", "under a file", "inside the receipt", "unwritable"])
def test_unwritable_output_is_refused_before_any_receipt_is_read(
        case: str, passing: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    blocker = tmp_path / "blocker"
    blocker.write_text("x")
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    output = {"directory": tmp_path, "under a file": blocker / "page.html",
              "inside the receipt": passing / "page.html", "unwritable": locked / "page.html"}[case]
    if case == "unwritable" and os.access(locked, os.W_OK):
        pytest.skip("running as a user who can write anywhere (root): no directory is unwritable")
    code, out, err = report([passing], output, capsys=capsys)
    assert code == 2 and out == [] and len(err) == 1
    assert err[0].startswith(f"qualify report: --output '{output}': ")
    assert not (passing / "page.html").exists() and blocker.read_text() == "x" and not any(locked.iterdir())


def test_failed_write_leaves_neither_page_nor_temporary(
        passing: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    def refuse(source: object, destination: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", refuse)
    code, _out, err = report([passing], tmp_path / "page.html", capsys=capsys)
    assert code == 2
    assert err == [f"qualify report: --output '{tmp_path / 'page.html'}': cannot write (No space left on device)"]
    assert list(tmp_path.iterdir()) == []


def test_existing_page_is_replaced_whole(passing: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    page = tmp_path / "page.html"
    page.write_text("an older page")
    assert report([passing], page, capsys=capsys)[0] == 0
    assert page.read_text(encoding="utf-8").startswith("<!DOCTYPE html>")
    assert [path.name for path in tmp_path.iterdir()] == ["page.html"]


def test_bad_usage_is_one_line_exit_2(passing: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert report_cli([]) == 2
    assert len(capsys.readouterr().err.splitlines()) == 1
    code, _out, err = report([passing] * (MAX_RECEIPTS + 1), tmp_path / "page.html", capsys=capsys)
    assert (code, err) == (2, [f"qualify report: RECEIPT: found {MAX_RECEIPTS + 1} receipts, expected at most "
                                f"{MAX_RECEIPTS} on one page"])
    bad_trust = tmp_path / "trust.json"
    bad_trust.write_text("[]")
    code, _out, err = report([passing], tmp_path / "page.html", "--trust", str(bad_trust), capsys=capsys)
    assert code == 2 and len(err) == 1 and err[0].startswith(f"qualify report: trust file {bad_trust}: ")
    assert _no_page_left(tmp_path)


def test_default_output_is_named_for_the_run(passing: Path, faulty: Path, tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    assert report_cli([str(passing)]) == 0
    assert report_cli([str(passing), str(faulty)]) == 0
    capsys.readouterr()
    assert sorted(path.name for path in tmp_path.iterdir()) == [
        f"report-{passing.name}.html", f"report-compare-{passing.name}-and-1.html"]


# --------------------------------------------------------------------------- hostile receipts


_JSON = st.recursive(st.none() | st.booleans() | st.integers(-(2 ** 63), 2 ** 63 - 1)
                     | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=12),
                     lambda children: st.lists(children, max_size=4)
                     | st.dictionaries(st.text(max_size=8), children, max_size=4), max_leaves=12)
_FIELDS = {
    "validation-summary.json": ["verdict", "reasons", "status", "rung", "rule", "lane", "samples", "identity_sha256"],
    "samples/sample-1.json": ["max_abs", "mean_abs", "localisation", "token_agreement_rate", "output_tokens",
                              "error", "repetition", "payload_bytes"],
    "identity.json": ["onboarding_qualification", "lane", "prompt", "logit_units", "producer_engine"],
    "host.json": ["consumer", "producers"],
}


@st.composite
def mutations(draw: st.DrawFn) -> tuple[str, str, Any]:
    """One change a forger or a damaged disk makes: a JSON field set to any JSON value, a whole
    file replaced, a series file's bytes cut or flipped, or a file removed."""
    kind = draw(st.sampled_from(["field", "document", "series", "remove"]))
    if kind == "field":
        name = draw(st.sampled_from(sorted(_FIELDS)))
        return kind, name, (draw(st.sampled_from(_FIELDS[name])), draw(_JSON))
    if kind == "document":
        return kind, draw(st.sampled_from(sorted(_FIELDS))), draw(_JSON)
    if kind == "series":
        return kind, "series/sample-1.safetensors", (draw(st.integers(0, 4000)), draw(st.integers(0, 255)))
    return kind, draw(st.sampled_from([*sorted(_FIELDS), "series/sample-1.safetensors", "manifest.json"])), None


def _apply(receipt: Path, mutation: tuple[str, str, Any]) -> None:
    kind, name, value = mutation
    path = receipt / name
    if kind == "field":
        document = json.loads(path.read_text(encoding="utf-8"))
        field_name, field_value = value
        document[field_name] = field_value
        path.write_text(json.dumps(document), encoding="utf-8")
    elif kind == "document":
        path.write_text(json.dumps(value), encoding="utf-8")
    elif kind == "series":
        cut, byte = value
        data = path.read_bytes()
        if cut < len(data) // 2:
            data = data[:cut]
        else:  # a changed byte (xor with a non-zero mask), or one appended past the end
            changed = (data[cut] ^ (byte | 1)) if cut < len(data) else byte
            data = data[:cut] + bytes([changed]) + data[cut + 1:]
        path.write_bytes(data)
    else:
        path.unlink()


def _check_hostile(template: Path, scratch: Path, mutation: tuple[str, str, Any],
                   tally: Any, run: Callable[[list[str]], int], read_err: Callable[[], list[str]]) -> None:
    receipt = scratch / template.name
    if receipt.exists():
        shutil.rmtree(receipt)
    shutil.copytree(template, receipt)
    _apply(receipt, mutation)
    page = scratch / "page.html"
    page.unlink(missing_ok=True)
    code = run([str(receipt), "--output", str(page)])
    err = read_err()
    tally.add("examples")
    if code == 2:
        tally.add("refused")
        assert len(err) == 1 and err[0].startswith("qualify report: ") and not page.exists(), err
        return
    tally.add("rendered")
    assert code == 1 and err == [], (code, err)  # every mutation breaks the signature
    outline = page_outline(page.read_text(encoding="utf-8"))
    assert outline.texts["signature"].startswith("NOT VERIFIED: tampered")
    assert "verdict-headline" in outline.texts and all(count == 1 for count in outline.figures.values())
    ET.parse(page)  # still well-formed, whatever the receipt held


@pytest.fixture(scope="module")
def small_receipt(tmp_path_factory: pytest.TempPathFactory, identity: Identity,
                  envelope: list[tuple[float, float]]) -> Path:
    return write_lane_receipt(tmp_path_factory.mktemp("small"), identity, [make_series(envelope, diverge_at=3)])


_STUB_SVG = '<svg xmlns="http://www.w3.org/2000/svg" width="8" height="8"><rect width="8" height="8"/></svg>'


@pytest.fixture
def stub_plots(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fuzz tests read hostile receipts, not draw: every plot becomes a tiny fixed svg (the
    plots get their own property test below), so an example takes a fraction of a second."""
    from qualify.interfaces import report_html

    for name in ("drift_svg", "margin_svg", "kv_heatmap_svg", "compare_drift_svg"):
        monkeypatch.setattr(report_html, name, lambda *args, **kwargs: _STUB_SVG)


_FUZZ = settings(derandomize=True, deadline=None,
                 suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


@settings(_FUZZ, max_examples=80)
@given(mutation=mutations())
def test_fuzz_hostile_receipt_is_rendered_with_a_banner_or_refused(
        mutation: tuple[str, str, Any], small_receipt: Path, stub_plots: None, tmp_path: Path, fuzz_tally: Any,
        capsys: pytest.CaptureFixture[str]) -> None:
    _check_hostile(small_receipt, tmp_path, mutation, fuzz_tally, report_cli,
                   lambda: capsys.readouterr().err.splitlines())


@pytest.mark.slow
@settings(_FUZZ, max_examples=300)
@given(mutation=mutations())
def test_fuzz_hostile_receipt_many_examples(
        mutation: tuple[str, str, Any], small_receipt: Path, stub_plots: None, tmp_path: Path, fuzz_tally: Any,
        capsys: pytest.CaptureFixture[str]) -> None:
    _check_hostile(small_receipt, tmp_path, mutation, fuzz_tally, report_cli,
                   lambda: capsys.readouterr().err.splitlines())


_VALUES = st.one_of(st.just(0.0), st.just(float("nan")), st.just(float("inf")),
                    st.floats(0.0, 1e300), st.floats(0.0, 1e-30))


def _draw_every_plot(values: list[float], layers: list[float], envelope_value: float) -> None:
    """Each plot of ``values`` (per position) and ``layers`` (per layer) is one well-formed svg."""
    from qualify.interfaces.report_plots import Curve, HeatRow, compare_drift_svg, drift_svg, kv_heatmap_svg, margin_svg

    series = np.array(values)
    tokens = np.arange(series.size, dtype=np.int64)
    layer_deltas = np.array(layers)
    envelope = [(envelope_value, envelope_value)] * layer_deltas.size
    drawn = [
        drift_svg("d", series, series, 1.0, 0.1),
        margin_svg("m", series, tokens, tokens[::-1].copy(), series),
        kv_heatmap_svg("k", [HeatRow("K", layer_deltas, 0), HeatRow("V", layer_deltas, 1)], envelope),
        kv_heatmap_svg("r", [HeatRow("K", layer_deltas, 0)], None),
        compare_drift_svg("c", [Curve("a", series, series, 1.0, 0.1), Curve("b", series[::-1].copy(), series, None, None)]),
    ]
    for svg in drawn:
        assert ET.fromstring(svg).tag == "{http://www.w3.org/2000/svg}svg"


def test_plots_draw_nan_infinity_zero_and_extremes() -> None:
    """Everything a series may hold (deltas and margins are >= 0 or NaN; NaN is evidence)."""
    _draw_every_plot([0.0, float("nan"), float("inf"), 1e300, 1e-30, 0.5], [float("nan"), 0.0, 1e300], 0.0)


@pytest.mark.slow
@settings(_FUZZ, max_examples=10)
@given(values=st.lists(_VALUES, min_size=1, max_size=40), layers=st.lists(_VALUES, min_size=1, max_size=6),
       envelope_value=_VALUES)
def test_fuzz_plots_draw_any_series_values(values: list[float], layers: list[float], envelope_value: float,
                                           fuzz_tally: Any) -> None:
    _draw_every_plot(values, layers, envelope_value)
    fuzz_tally.add("examples")
    fuzz_tally.add("finite" if all(np.isfinite(values)) else "non-finite")


# --------------------------------------------------------------------------- real runs


@dataclass(frozen=True)
class RealReceipts:
    """Receipts of real ``qualify --recipe native-text`` runs and the trust file that verifies them."""

    passing: Path
    fault: Path
    trust: Path


def _qualify(archive: Path, *extra: str) -> subprocess.Popen[str]:
    command = [sys.executable, "-m", "qualify.interfaces.cli", "--recipe", "native-text", "--reference-once",
               "--receipts", str(archive), *extra]
    return subprocess.Popen(command, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def real_receipts_in(tmp_path_factory: pytest.TempPathFactory) -> RealReceipts:
    """A passing run and a v-scale fault run of the default lane, made once per test session: the
    first xdist worker to ask runs both (at once), the others wait on a lock and reuse them, with
    the maker's trust file (each worker signs with a key of its own)."""
    base = tmp_path_factory.getbasetemp()
    shared = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "report-real-receipts"
    shared.mkdir(exist_ok=True)
    with open(shared / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (shared / "trust.json").exists():
            ensure_signing_key(announce=lambda line: None)
            runs = {"passing": _qualify(shared / "passing"), "fault": _qualify(shared / "fault", "--fault", "v-scale")}
            for name, process in runs.items():
                output, _ = process.communicate(timeout=600)
                assert process.returncode == (0 if name == "passing" else 1), output[-2000:]
            shutil.copyfile(default_trust_path(), shared / "trust.json")
    (passing,), (fault,) = (sorted((shared / name).iterdir()) for name in ("passing", "fault"))
    return RealReceipts(passing, fault, shared / "trust.json")


@pytest.fixture(scope="session")
def real_receipts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealReceipts]:
    yield real_receipts_in(tmp_path_factory)


@pytest.mark.slow
def test_real_passing_run_page(real_receipts: RealReceipts, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    page = tmp_path / "page.html"
    code, _out, err = report([real_receipts.passing], page, "--trust", str(real_receipts.trust), capsys=capsys)
    assert (code, err) == (0, [])
    summary = summary_of(real_receipts.passing)
    identity = json.loads((real_receipts.passing / "identity.json").read_text(encoding="utf-8"))
    bounds = identity["onboarding_qualification"]["full_logits"]
    assert text_of(page, "verdict-status") == "QUALIFIED"
    assert text_of(page, "verdict-headline") == " ".join(summary["verdict"].split())
    assert figure_ids(page) == [*(f"drift-sample-{n}" for n in (1, 2, 3)),
                                *(f"margin-sample-{n}" for n in (1, 2, 3)), "kv-heatmap"]
    assert_each_figure_holds_an_svg(page)
    assert f"max |Δlogit| ≤ {bounds['maximum_absolute']:.6g}, mean ≤ {bounds['maximum_mean_absolute']:.6g}" \
        in text_of(page, "identity-table")
    assert text_of(page, "kv-heatmap").endswith("Every layer within the envelope.")
    assert "no divergence: handoff and cold tokens agree at all 256 positions" in text_of(page, "margin-sample-1")


@pytest.mark.slow
def test_real_fault_run_page(real_receipts: RealReceipts, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The v-scale fault (layer 2's V scaled by 1.02) runs all three handoffs; the verdict fails it
    for not reproducing the basis's fixture anchor, and the heatmap puts it where it is: layer 2's
    V over the anchors' envelope, in each sample and nowhere else."""
    page = tmp_path / "page.html"
    code, _out, err = report([real_receipts.fault], page, "--trust", str(real_receipts.trust), capsys=capsys)
    assert (code, err) == (0, [])
    assert text_of(page, "verdict-status") == "NOT QUALIFIED"
    headline = text_of(page, "verdict-headline")
    assert headline == " ".join(summary_of(real_receipts.fault)["verdict"].split())
    assert headline.startswith("NOT QUALIFIED on fixture python-textwrap (3 × 2048/256): "
                               "did not reproduce its anchor bit for bit: "), headline
    assert figure_ids(page) == [*(f"drift-sample-{n}" for n in (1, 2, 3)),
                                *(f"margin-sample-{n}" for n in (1, 2, 3)), "kv-heatmap"]
    assert_each_figure_holds_an_svg(page)
    assert text_of(page, "kv-heatmap").endswith("3 layer cells over the envelope.")
    envelope = lane_envelope(load_identity(identity_path_for_lane(LANE)))
    over = [(record["repetition"], item["layer"], tensor) for record in receipt_sample_records(real_receipts.fault)
            for item in record["localisation"]["kv_layer_max_abs"] for tensor, index in (("K", 0), ("V", 1))
            if item[tensor.lower()] > envelope[item["layer"]][index]]
    assert over == [(1, 2, "V"), (2, 2, "V"), (3, 2, "V")]


@pytest.mark.slow
def test_real_fault_run_compared_with_a_passing_run(real_receipts: RealReceipts, tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    page = tmp_path / "compare.html"
    code, _out, err = report([real_receipts.passing, real_receipts.fault], page, "--trust", str(real_receipts.trust),
                             capsys=capsys)
    assert (code, err) == (0, [])
    assert text_of(page, "verdict-receipt-1").startswith("QUALIFIED")
    assert not text_of(page, "verdict-receipt-2").startswith("QUALIFIED")
    assert figure_ids(page) == ["compare-drift", "kv-heatmap-receipt-1", "kv-heatmap-receipt-2"]
    assert_each_figure_holds_an_svg(page)
    verdicts = {"verdict": "Comparison of 2 receipts",
                "verdict-receipt-1": summary_of(real_receipts.passing)["verdict"],
                "verdict-receipt-2": summary_of(real_receipts.fault)["verdict"]}
    assert outline_problems(page.read_text(encoding="utf-8"), verdicts=verdicts, figures=figure_ids(page)) == []
