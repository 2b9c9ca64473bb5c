"""The report's HTML: one self-contained page (inline CSS and SVG, no script, no network: its
Content-Security-Policy forbids fetching anything) for one receipt, or a comparison of several.

The page is well-formed XML as well as HTML, so a test reads it with ``xml.etree``. Every plot is
``<figure class="plot ..." id="...">`` holding one ``<svg>``; every value read from a receipt is
escaped, since a receipt is untrusted input.

Element ids (stable, the browser test and the docs rely on them): ``verdict`` (the header),
``signature``, ``verdict-status``, ``verdict-headline``, ``verdict-reasons``, ``verdict-scope``,
and when the summary states what the verdict covers ``verdict-scope-line`` and (the lane declaring
controls) ``controls-table``;
per sample ``drift-sample-<n>`` and ``margin-sample-<n>``; ``kv-heatmap``; ``identity``,
``host``, ``samples``. A comparison page: ``verdicts`` (the side-by-side table, one
``verdict-receipt-<i>`` cell each), ``compare-drift`` and ``kv-heatmap-receipt-<i>``.
"""

from __future__ import annotations

import html
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from qualify import __version__
from qualify.archive.predicate import host_summary
from qualify.interfaces.report_data import ReceiptView, SampleView
from qualify.interfaces.report_plots import (
    PALETTE,
    Curve,
    HeatRow,
    compare_drift_svg,
    drift_svg,
    kv_heatmap_svg,
    margin_svg,
)

STATUS_LABELS = {"passed": "QUALIFIED", "failed": "NOT QUALIFIED", "refused": "REFUSED",
                 "incomplete": "INCOMPLETE: NOT QUALIFIED"}
_MAX_PROBLEMS_SHOWN = 20

_CSS = """
body { margin: 0; font: 14px/1.45 system-ui, -apple-system, "Segoe UI", Roboto, sans-serif; color: #1a1a1a;
       background: #fafafa; }
main { max-width: 920px; margin: 0 auto; padding: 16px 20px 40px; background: #fff; }
h1 { font-size: 24px; margin: 8px 0 4px; }
h2 { font-size: 18px; margin: 28px 0 8px; border-bottom: 1px solid #ddd; padding-bottom: 4px; }
.status { padding: 2px 10px; border-radius: 4px; color: #fff; }
.status-passed { background: #2f855a; }
.status-failed, .status-incomplete { background: #c53030; }
.status-refused { background: #975a16; }
.run-id { font: 14px ui-monospace, monospace; color: #555; margin-left: 8px; }
.headline { font-size: 15px; font-weight: 600; margin: 6px 0; }
.scope { background: #f4f6f8; border-left: 4px solid #4a6fa5; padding: 6px 10px; }
.banner { padding: 8px 12px; border-radius: 4px; margin: 8px 0; }
.banner.verified { background: #e6f4ea; border: 1px solid #2f855a; }
.banner.not-verified { background: #c53030; color: #fff; font-weight: 600; }
.banner.not-verified ul { font-weight: 400; margin: 4px 0 0; }
figure.plot { margin: 12px 0; width: 864px; }
figure.plot svg { display: block; width: 864px; height: auto; }
figcaption { font-size: 13px; color: #333; margin-top: 2px; }
table { border-collapse: collapse; font-size: 13px; margin: 6px 0; }
table.side-by-side { table-layout: fixed; width: 100%; }
table.side-by-side th:first-child { width: 120px; }
table.side-by-side .headline { font-size: 13px; }
td { overflow-wrap: anywhere; }
th, td { border: 1px solid #ddd; padding: 3px 8px; text-align: left; vertical-align: top; }
th { background: #f4f6f8; font-weight: 600; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
code, .digest { font: 12px ui-monospace, monospace; word-break: break-all; }
.note { color: #7a4b00; }
.swatch { display: inline-block; width: 12px; height: 12px; border-radius: 2px; margin-right: 4px; }
footer { margin-top: 32px; font-size: 12px; color: #666; }
"""

_CSP = "default-src 'none'; style-src 'unsafe-inline'; img-src data:"


def _e(value: object) -> str:
    return html.escape(str(value), quote=True)


SOAK_STATUS_LABELS = {"passed": "SOAK PASSED", "failed": "SOAK FAILED"}
"""A soak qualifies no fixture: its verdict's words (qualify.judge.soak)."""


def status_label(status: str, *, soak: bool = False) -> str:
    """The verdict's word: QUALIFIED, NOT QUALIFIED, REFUSED or INCOMPLETE; for a soak's receipt
    SOAK PASSED or SOAK FAILED."""
    if soak and status in SOAK_STATUS_LABELS:
        return SOAK_STATUS_LABELS[status]
    return STATUS_LABELS.get(status, status.upper())


def number(value: object) -> str:
    """A record's number as the page shows it: integers whole, floats to 6 significant digits,
    the strings a record stores for non-finite values as they are, absence as a dash."""
    if value is None:
        return "—"
    if type(value) is int:
        return str(value)
    if isinstance(value, (float, np.floating)):
        return f"{float(value):.6g}"
    return str(value)


def _mapping(value: object) -> Mapping[str, Any]:
    """A receipt's JSON object, or an empty one for anything else (every field then shows a dash)."""
    return value if isinstance(value, Mapping) else {}


def _rows(pairs: Iterable[tuple[str, str]], table_id: str | None = None) -> str:
    """A two-column table of (label, already escaped HTML)."""
    attribute = f' id="{table_id}"' if table_id else ""
    body = "".join(f"<tr><th>{_e(label)}</th><td>{value}</td></tr>" for label, value in pairs)
    return f"<table{attribute}>{body}</table>"


def _figure(element_id: str, kind: str, svg: str, caption: str) -> str:
    return (f'<figure class="plot {kind}" id="{element_id}">{svg}'
            f"<figcaption>{caption}</figcaption></figure>")


def _page(title: str, body: str, page_class: str) -> str:
    return ("<!DOCTYPE html>\n"
            '<html lang="en"><head><meta charset="utf-8"/>'
            f'<meta http-equiv="Content-Security-Policy" content="{_CSP}"/>'
            '<meta name="viewport" content="width=device-width, initial-scale=1"/>'
            f"<title>{_e(title)}</title><style>{_CSS}</style></head>"
            f'<body><main class="report {page_class}">{body}'
            f"<footer>Written by qualify {_e(__version__)} (qualify report). Self-contained: "
            f"no scripts, nothing fetched.</footer></main></body></html>\n")


# --------------------------------------------------------------------------- shared pieces


def signature_banner(view: ReceiptView, element_id: str = "signature") -> str:
    """Verified: who signed, under which trust file. Anything else: a red NOT VERIFIED banner
    naming the state and its problems, saying the verdict shown is not authenticated."""
    if view.verified:
        signer = f"{view.signer[:16]}…" if view.signer else "an unnamed key"
        return (f'<div class="banner verified" id="{element_id}">Signature verified: signed by key '
                f'<code>{_e(signer)}</code>, trusted in {_e(view.trust_source)}; every file matches the signed '
                f"statement, and the verdict below is the signed one.</div>")
    why = {"unsigned": "a legacy receipt with no signed statement; its manifest can be recomputed by anyone",
           "legacy": "a legacy receipt with no signed statement, intact and pinned by its manifest's digest in the trust file",
           "untrusted": "signed by a key the trust file does not trust (or no trust file was given)",
           "tampered": "its files, signature or statement do not check out",
           "partial": "a run that stopped before it finalized its receipt"}.get(view.state, view.state)
    shown = view.problems[:_MAX_PROBLEMS_SHOWN]
    more = len(view.problems) - len(shown)
    items = "".join(f"<li>{_e(problem)}</li>" for problem in shown)
    if more:
        items += f"<li>and {more} more (qualify receipts verify lists them all)</li>"
    return (f'<div class="banner not-verified" id="{element_id}">NOT VERIFIED: {_e(view.state)}: {_e(why)}. '
            f"The verdict below is read from the receipt's unauthenticated files.{f'<ul>{items}</ul>' if items else ''}"
            f"</div>")


def _bounds_text(view: ReceiptView) -> str:
    bounds = view.bounds
    if bounds.maximum_absolute is None:
        return _e(bounds.source)
    mean = number(bounds.maximum_mean_absolute)
    return (f"max |Δlogit| ≤ <span class=\"bound-max\">{_e(number(bounds.maximum_absolute))}</span>, "
            f"mean ≤ <span class=\"bound-mean\">{_e(mean)}</span> ({_e(bounds.source)})")


def _identity_section(view: ReceiptView) -> str:
    identity = view.identity or {}
    qualification, prompt, units = (_mapping(identity.get(name))
                                    for name in ("onboarding_qualification", "prompt", "logit_units"))
    pairs: list[tuple[str, str]] = [
        ("lane", _e(number(view.lane))),
        ("lane kind", _e(number(identity.get("lane_kind")))),
        ("recipe", _e(number(view.recipe))),
        ("rung", _e(number(view.rung))),
        ("producer mode", _e(number(identity.get("producer_mode")))),
        ("identity sha256", f'<span class="digest">{_e(number(view.identity_sha256))}</span>'),
        ("full-logit bounds", _bounds_text(view)),
        ("logit units", _e(number(units.get("transform")))),
        ("prompt", _e(f"{number(prompt.get('name'))} ({number(prompt.get('tokens'))} tokens)")),
        ("output tokens × repetitions",
         _e(f"{number(qualification.get('output_tokens'))} × {number(qualification.get('repetitions'))}")),
        ("basis receipt", f"<code>{_e(number(qualification.get('basis')))}</code>"),
    ]
    for side in ("producer_engine", "consumer_engine"):
        engine = identity.get(side)
        if isinstance(engine, Mapping):
            pairs.append((side.replace("_", " "), f"{_e(number(engine.get('name')))} "
                                                  f"<code>{_e(number(engine.get('version')))}</code>"))
    return f'<section id="identity"><h2>Identity</h2>{_rows(pairs, "identity-table")}</section>'


def _host_pairs(facts: Mapping[str, Any] | None) -> list[tuple[str, str]]:
    summary = host_summary(facts)
    if summary is None:
        return [("facts", "not recorded")]
    gpus = ", ".join(summary["gpus"]) or "none"
    return [("machine", _e(number(summary["machine"]))), ("CPU", _e(number(summary["cpu_model"]))),
            ("ISA class", f"<code>{_e(number(summary['isa_class']))}</code>"),
            ("BLAS", _e(f"{number(summary['blas_library'])} {number(summary['blas_kernel'])}, "
                        f"{number(summary['blas_threads'])} threads")),
            ("GPUs", _e(gpus)), ("harness commit", f"<code>{_e(number(summary['harness_commit']))}</code>")]


def _host_section(view: ReceiptView) -> str:
    if view.host is None:
        return '<section id="host"><h2>Host</h2><p class="note">No host facts (see the notes).</p></section>'
    consumer = view.host.get("consumer")
    parts = [f"<h3>Consumer</h3>{_rows(_host_pairs(consumer if isinstance(consumer, Mapping) else None))}"]
    producers = view.host.get("producers")
    starts = producers if isinstance(producers, list) else []
    # A calibration restarts its producer per handoff: identical starts are shown once, counted.
    groups: dict[str, list[int]] = {}
    for index, start in enumerate(starts, 1):
        facts = start.get("facts") if isinstance(start, Mapping) else None
        if isinstance(facts, Mapping):
            key = _rows(_host_pairs(facts))
        else:
            note = start.get("note") if isinstance(start, Mapping) else None
            key = f'<p class="note">no facts: {_e(number(note))}</p>'
        groups.setdefault(key, []).append(index)
    for rendered, indices in groups.items():
        which = f"start {indices[0]}" if len(indices) == 1 else f"starts {', '.join(map(str, indices))}"
        parts.append(f"<h3>Producer ({_e(which)})</h3>{rendered}")
    if not starts:
        parts.append('<p class="note">No producer reached readiness: no producer facts.</p>')
    return f'<section id="host"><h2>Host</h2>{"".join(parts)}</section>'


def _record_value(record: Mapping[str, Any] | None, name: str) -> object:
    return record.get(name) if record is not None else None


def _localisation(record: Mapping[str, Any] | None, name: str) -> object:
    found = _record_value(record, "localisation")
    return found.get(name) if isinstance(found, Mapping) else None


def _samples_table(view: ReceiptView, table_id: str) -> str:
    if not view.samples:
        return '<p class="note">No sample records.</p>'
    head = ("sample", "tokens agreed", "max |Δlogit|", "mean |Δlogit|", "first divergence",
            "first row over a bound", "min cold margin", "KV over envelope", "payload MB", "error / notes")
    rows = []
    for sample in view.samples:
        record = sample.record
        agreement, tokens = _record_value(record, "token_agreement_rate"), _record_value(record, "output_tokens")
        agreed = number(agreement)
        if isinstance(agreement, (int, float)) and not isinstance(agreement, bool) and type(tokens) is int:
            agreed = f"{round(agreement * tokens)}/{tokens}"
        over = _localisation(record, "kv_over_envelope")
        payload = _record_value(record, "payload_bytes")
        notes = [str(found)] if isinstance(found := _record_value(record, "error"), str) else []
        notes.extend(sample.notes)
        cells = [str(sample.repetition), agreed, number(_record_value(record, "max_abs")),
                 number(_record_value(record, "mean_abs")), number(sample.first_divergence()),
                 number(_localisation(record, "first_rule_breaking_row")),
                 number(_localisation(record, "min_cold_margin")),
                 str(len(over)) if isinstance(over, list) else "—",
                 f"{payload / 1e6:.2f}" if type(payload) is int else "—"]
        rows.append("<tr>" + "".join(f'<td class="num">{_e(cell)}</td>' for cell in cells)
                    + f"<td>{'<br/>'.join(_e(note) for note in notes) or '—'}</td></tr>")
    header = "".join(f"<th>{_e(name)}</th>" for name in head)
    return f'<table id="{table_id}"><tr>{header}</tr>{"".join(rows)}</table>'


def _heat_rows(view: ReceiptView) -> list[HeatRow]:
    rows: list[HeatRow] = []
    for sample in view.samples:
        layers = sample.kv_layers()
        if layers is None:
            continue
        rows.append(HeatRow(f"sample {sample.repetition} K", layers[0], 0))
        rows.append(HeatRow(f"sample {sample.repetition} V", layers[1], 1))
    return rows


def _cells_over(rows: Sequence[HeatRow], envelope: Sequence[tuple[float, float]] | None) -> int | None:
    """How many (sample, K or V, layer) cells exceed the envelope; None without a usable one."""
    if envelope is None or len(envelope) < max(row.deltas.shape[0] for row in rows):
        return None
    count = 0
    for row in rows:
        bounds = np.array([bound[row.tensor] for bound in envelope[: row.deltas.shape[0]]])
        count += int(np.sum(np.isfinite(row.deltas) & (row.deltas > bounds)))
    return count


def _kv_figure(view: ReceiptView, element_id: str) -> str:
    """The per-layer K/V heat map against the envelope, or a note saying why there is none."""
    rows = _heat_rows(view)
    if not rows:
        return '<p class="note">No per-layer KV deltas in this receipt: no heat map.</p>'
    envelope = view.envelope.layers
    over = _cells_over(rows, envelope)
    verdict = ("" if over is None else
               f" {over} layer cell{'s' if over != 1 else ''} over the envelope." if over else
               " Every layer within the envelope.")
    source = "series" if any(sample.series is not None for sample in view.samples) else "sample records"
    caption = (f"Per-layer max |handed-off − consumer's own| K and V (from the {source}). "
               f"<span class=\"envelope-note\">{_e(view.envelope.note)}</span>.{_e(verdict)}")
    return _figure(element_id, "kv-heatmap", kv_heatmap_svg(element_id, rows, envelope), caption)


def _drift_caption(sample: SampleView, view: ReceiptView) -> str:
    assert sample.series is not None
    maximum, mean = sample.series["logit_max_abs_delta"], sample.series["logit_mean_abs_delta"]
    top = float(np.max(maximum))  # NaN propagates: a non-finite row is never hidden
    average = float(np.mean(mean))
    parts = []
    for name, value, bound in (("max", top, view.bounds.maximum_absolute),
                               ("mean", average, view.bounds.maximum_mean_absolute)):
        judged = "" if bound is None else (" within its bound" if value <= bound else " OVER its bound")
        parts.append(f"{name} |Δlogit| {value:.6g}" + (f" (bound {bound:.6g}){judged}" if bound is not None else ""))
    return f"Sample {sample.repetition}: per-position |Δlogit|, handoff against cold recompute; " + "; ".join(parts) + "."


def _margin_caption(sample: SampleView) -> str:
    assert sample.series is not None
    first = sample.first_divergence()
    positions = sample.series["cold_tokens"].shape[0]
    if first is None:
        return (f"Sample {sample.repetition}: cold top-1 − top-2 margin per position; no divergence: "
                f"handoff and cold tokens agree at all {positions} positions.")
    margin = float(sample.series["cold_top1_top2_margin"][first])
    return (f"Sample {sample.repetition}: cold top-1 − top-2 margin per position; "
            f'<span class="first-divergence">first divergence at position {first}</span> '
            f"(cold margin there {margin:.6g}).")


def _controls_table(controls: Mapping[str, Any]) -> str:
    """The lane's controls as the summary's scope states them: one row per document, within its
    E1 gates or the lengths at which it exceeds them (published, never dropped)."""
    rows = "".join(
        f"<tr><td>{_e(document['document'])}</td><td>{'yes' if document['within'] else 'no'}</td>"
        f"<td class=\"num\">{_e(', '.join(map(str, document['exceeding_lengths'])) or '—')}</td></tr>"
        for document in controls["documents"])
    caption = (f"Controls {controls['criteria']}: {controls['documents_within']} of {controls['documents_total']} "
               f"documents within their E1 gates, at lengths {', '.join(map(str, controls['lengths']))}; measured "
               f"in {controls['source']}.")
    return (f'<table id="controls-table"><caption>{_e(caption)}</caption>'
            f"<tr><th>control document</th><th>within E1 gates</th><th>exceeds at lengths</th></tr>{rows}</table>")


def _scope_part(view: ReceiptView) -> str:
    """The summary's scope line (fixture and controls) and its controls table; nothing when the
    summary states no scope (a verdict without one, or a v1/v2 summary)."""
    scope = view.verdict_scope
    if scope is None:
        return ""
    controls = scope["controls"]
    return (f'<p id="verdict-scope-line" class="scope"><strong>Covers:</strong> {_e(scope["line"])}</p>'
            + (_controls_table(controls) if controls is not None else ""))


def _verdict_header(view: ReceiptView) -> str:
    reasons = "".join(f"<li>{_e(reason)}</li>" for reason in view.reasons)
    return (f'<header id="verdict" class="verdict">{signature_banner(view)}'
            f'<h1><span id="verdict-status" class="status status-{_e(view.status)}">'
            f'{_e(status_label(view.status, soak=view.soak))}'
            f'</span><span class="run-id">{_e(view.run_id)}</span></h1>'
            f'<p id="verdict-headline" class="headline">{_e(view.verdict)}</p>'
            f'<ul id="verdict-reasons">{reasons}</ul>{_scope_part(view)}'
            f'<p id="verdict-scope" class="scope"><strong>Scope:</strong> {_e(view.scope)}</p></header>')


def _notes(notes: Sequence[str], element_id: str = "notes") -> str:
    if not notes:
        return ""
    items = "".join(f"<li>{_e(note)}</li>" for note in notes)
    return f'<section id="{element_id}"><h2>Notes</h2><ul class="note">{items}</ul></section>'


# --------------------------------------------------------------------------- one receipt


def single_page(view: ReceiptView) -> str:
    """The page of one receipt: verdict and scope, drift and margins per sample, the KV heat map,
    identity, samples and host."""
    drift, margins = [], []
    for sample in view.samples:
        if sample.series is None:
            continue
        series = sample.series
        drift_id, margin_id = f"drift-sample-{sample.repetition}", f"margin-sample-{sample.repetition}"
        drift.append(_figure(drift_id, "drift", drift_svg(
            drift_id, series["logit_max_abs_delta"], series["logit_mean_abs_delta"],
            view.bounds.maximum_absolute, view.bounds.maximum_mean_absolute), _drift_caption(sample, view)))
        margins.append(_figure(margin_id, "margin", margin_svg(
            margin_id, series["cold_top1_top2_margin"], series["handoff_tokens"], series["cold_tokens"],
            series["logit_max_abs_delta"]), _margin_caption(sample)))
    if not drift:
        why = ("the receipt predates per-position series (a legacy receipt): the sample records are tabled below"
               if view.legacy else "no sample has a readable series (see the samples table)")
        drift = [f'<p class="note" id="no-series">No per-position plots: {_e(why)}.</p>']
    body = (_verdict_header(view) + _identity_section(view)
            + f'<section id="drift"><h2>Per-position drift against the bounds</h2>{"".join(drift)}</section>'
            + (f'<section id="margins"><h2>Cold margins and the first divergence</h2>{"".join(margins)}</section>'
               if margins else "")
            + f'<section id="kv"><h2>KV cache: per-layer delta against the calibrated envelope</h2>'
              f'{_kv_figure(view, "kv-heatmap")}</section>'
            + f'<section id="samples"><h2>Sample records</h2>{_samples_table(view, "samples-table")}</section>'
            + _host_section(view) + _notes(view.notes))
    return _page(f"qualify report: {view.run_id}: {status_label(view.status, soak=view.soak)}", body, "single")


# --------------------------------------------------------------------------- several receipts


def _receipt_curve(index: int, view: ReceiptView) -> Curve | None:
    """A receipt's per-position drift: each position's largest over its samples."""
    series = [sample.series for sample in view.samples if sample.series is not None]
    if not series:
        return None
    length = min(found["logit_max_abs_delta"].shape[0] for found in series)
    maximum = np.max(np.stack([found["logit_max_abs_delta"][:length] for found in series]), axis=0)
    mean = np.max(np.stack([found["logit_mean_abs_delta"][:length] for found in series]), axis=0)
    return Curve(f"{index}: {view.run_id} ({status_label(view.status, soak=view.soak)})", maximum, mean,
                 view.bounds.maximum_absolute, view.bounds.maximum_mean_absolute)


def _largest(view: ReceiptView, name: str) -> str:
    """The largest of a record field over the samples (a non-finite one, stored as a string, wins)."""
    values = [sample.record.get(name) for sample in view.samples if sample.record is not None]
    finite = [float(value) for value in values if isinstance(value, (int, float)) and not isinstance(value, bool)]
    nonfinite = [value for value in values if isinstance(value, str)]
    if nonfinite:
        return str(nonfinite[0])
    return f"{max(finite):.6g}" if finite else "—"


def _divergences(view: ReceiptView) -> str:
    found = [(sample.repetition, sample.first_divergence()) for sample in view.samples]
    diverged = [f"sample {repetition}: position {position}" for repetition, position in found if position is not None]
    return "; ".join(diverged) if diverged else ("none" if found else "—")


def _side_by_side(views: Sequence[ReceiptView]) -> str:
    columns = range(1, len(views) + 1)
    header = "".join(f'<th><span class="swatch" style="background:{PALETTE[(i - 1) % len(PALETTE)]}"></span>'
                     f"receipt {i}<br/><code>{_e(view.run_id)}</code></th>" for i, view in zip(columns, views, strict=True))
    rows: list[tuple[str, list[str]]] = [
        ("signature", [("verified" if view.verified else f"NOT VERIFIED: {view.state}") for view in views]),
        ("lane", [number(view.lane) for view in views]),
        ("recipe", [number(view.recipe) for view in views]),
        ("rung", [number(view.rung) for view in views]),
        ("identity sha256", [number(view.identity_sha256) for view in views]),
        ("samples", [str(len(view.samples)) for view in views]),
        ("largest max |Δlogit|", [_largest(view, "max_abs") for view in views]),
        ("largest mean |Δlogit|", [_largest(view, "mean_abs") for view in views]),
        ("first divergence", [_divergences(view) for view in views]),
    ]
    body = [f"<tr><th>verdict</th>{''.join(_verdict_cell(i, view) for i, view in zip(columns, views, strict=True))}</tr>",
            f"<tr><th>bounds</th>{''.join(f'<td>{_bounds_text(view)}</td>' for view in views)}</tr>"]
    body.extend(f"<tr><th>{_e(label)}</th>{''.join(f'<td>{_e(cell)}</td>' for cell in cells)}</tr>"
                for label, cells in rows)
    covers = [view.verdict_scope["line"] if view.verdict_scope is not None else "—" for view in views]
    body.append(f"<tr><th>covers</th>{''.join(f'<td>{_e(line)}</td>' for line in covers)}</tr>")
    body.append(f"<tr><th>scope</th>{''.join(f'<td>{_e(view.scope)}</td>' for view in views)}</tr>")
    consumers = []
    for view in views:
        consumer = view.host.get("consumer") if view.host is not None else None
        pairs = _host_pairs(consumer if isinstance(consumer, Mapping) else None)
        consumers.append("<td>" + "<br/>".join(f"{_e(label)}: {value}" for label, value in pairs) + "</td>")
    body.append(f"<tr><th>consumer host</th>{''.join(consumers)}</tr>")
    return f'<table id="verdicts" class="side-by-side"><tr><th></th>{header}</tr>{"".join(body)}</table>'


def _verdict_cell(index: int, view: ReceiptView) -> str:
    reasons = "".join(f"<li>{_e(reason)}</li>" for reason in view.reasons)
    return (f'<td id="verdict-receipt-{index}"><span class="status status-{_e(view.status)}">'
            f'{_e(status_label(view.status, soak=view.soak))}</span><p class="headline">{_e(view.verdict)}</p>'
            f"<ul>{reasons}</ul></td>")


def compare_page(views: Sequence[ReceiptView]) -> str:
    """Several receipts side by side: verdicts, overlaid per-position drift, a KV heat map and the
    sample records of each."""
    banners = "".join(signature_banner(view, f"signature-receipt-{index}")
                      for index, view in enumerate(views, 1) if not view.verified)
    statuses = ", ".join(f"{status_label(view.status, soak=view.soak)}" for view in views)
    header = (f'<header id="verdict" class="verdict compare">{banners}'
              f"<h1>Comparison of {len(views)} receipts</h1>"
              f'<p id="verdict-headline" class="headline">{_e(statuses)}</p></header>')
    curves = [curve for index, view in enumerate(views, 1) if (curve := _receipt_curve(index, view)) is not None]
    missing = [f"{index}: {view.run_id}" for index, view in enumerate(views, 1)
               if not any(sample.series is not None for sample in view.samples)]
    if curves:
        caption = ("Per position, each receipt's largest over its samples, one colour per receipt: max |Δlogit| "
                   "against that receipt's max bound (dashed; a ringed point is over it), mean |Δlogit| (its bound "
                   "holds for the mean over all positions: see the table), and each receipt's max |Δlogit| minus "
                   "receipt 1's.")
        if missing:
            caption += f" No series in receipt {', '.join(missing)}."
        drift = _figure("compare-drift", "drift compare", compare_drift_svg("compare-drift", curves), _e(caption))
    else:
        drift = f'<p class="note" id="no-series">No per-position plots: no receipt holds a series ({_e(", ".join(missing))}).</p>'
    heatmaps = "".join(f"<h3>Receipt {index}: <code>{_e(view.run_id)}</code></h3>"
                       f"{_kv_figure(view, f'kv-heatmap-receipt-{index}')}" for index, view in enumerate(views, 1))
    samples = "".join(f"<h3>Receipt {index}: <code>{_e(view.run_id)}</code></h3>"
                      f"{_samples_table(view, f'samples-table-receipt-{index}')}" for index, view in enumerate(views, 1))
    notes = [f"receipt {index} ({view.run_id}): {note}" for index, view in enumerate(views, 1) for note in view.notes]
    body = (header + f'<section id="verdicts-section"><h2>Verdicts side by side</h2>{_side_by_side(views)}</section>'
            + f'<section id="drift"><h2>Per-position drift, overlaid</h2>{drift}</section>'
            + f'<section id="kv"><h2>KV cache: per-layer delta against each calibrated envelope</h2>{heatmaps}</section>'
            + f'<section id="samples"><h2>Sample records</h2>{samples}</section>' + _notes(notes))
    return _page(f"qualify report: comparison of {len(views)} receipts", body, "compare")
