"""The report's plots, drawn with matplotlib's object API onto its SVG canvas (no pyplot, no global
backend): each function returns one ``<svg>`` element's text, ready to inline in the page.

Every figure has a fixed size, so the page's layout is the same on every machine; SVG ids are
salted with the figure's element id, so several inline SVGs never share a clip-path id.
"""

from __future__ import annotations

import functools
import io
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ParamSpec

import numpy as np

WIDTH_IN = 9.0
"""Every plot's width in inches (72 pt each: 648 pt, 864 CSS pixels)."""
LINE_HEIGHT_IN = 3.0
_RC: dict[Any, Any] = {
    "font.size": 9.0,
    "axes.grid": True,
    "grid.alpha": 0.3,
    "axes.spines.top": False,
    "axes.spines.right": False,
    "svg.fonttype": "none",  # text stays text: smaller, searchable, drawn in the page's font
    "text.parse_math": False,  # labels carry receipt names: a '$' is a dollar sign, never TeX
}
_MAX_ANNOTATED_CELLS = 24 * 12
OVER_COLOUR = "#cb181d"
MAX_COLOUR = "#1f4e9c"
MEAN_COLOUR = "#6aa84f"
MARGIN_COLOUR = "#7a5195"
P = ParamSpec("P")
PALETTE = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
           "#bcbd22", "#17becf", "#393b79", "#637939")
"""One colour per receipt on a comparison page (at most as many receipts as colours)."""


def _figure(height_in: float) -> Any:
    from matplotlib.figure import Figure

    return Figure(figsize=(WIDTH_IN, height_in), layout="constrained")


def _svg_text(figure: Any, salt: str) -> str:
    """The figure as an ``<svg>`` element (the XML declaration and DOCTYPE dropped), with ids
    salted by ``salt`` and no creation date, so the same receipt gives the same bytes."""
    import matplotlib

    buffer = io.StringIO()
    with matplotlib.rc_context({**_RC, "svg.hashsalt": salt}), warnings.catch_warnings():
        # Extreme values (1e300 next to 0) can leave no room for the layout engine: the plot is
        # still drawn, with matplotlib's default margins instead.
        warnings.filterwarnings("ignore", message="constrained_layout not applied", category=UserWarning)
        figure.savefig(buffer, format="svg", metadata={"Date": None, "Creator": None})
    text = buffer.getvalue()
    return text[text.index("<svg"):].strip()


def _styled(function: Callable[P, str]) -> Callable[P, str]:
    """Draw inside the report's rc settings (fonts and grid are read when artists are made)."""

    @functools.wraps(function)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> str:
        import matplotlib

        with matplotlib.rc_context(_RC):
            return function(*args, **kwargs)

    return wrapper


def _mark_nonfinite(axes: Any, values: np.ndarray, label: str) -> None:
    """NaN is evidence: mark its positions along the top of the axes instead of dropping them."""
    positions = np.flatnonzero(~np.isfinite(values))
    if positions.size:
        axes.plot(positions, np.full(positions.size, 1.0), "x", color=OVER_COLOUR,
                  transform=axes.get_xaxis_transform(), clip_on=False, label=f"{label}: non-finite")


def _over_bound(axes: Any, values: np.ndarray, bound: float | None, colour: str, label: str) -> None:
    """Mark the positions whose max |Δlogit| exceeds the bound (each one alone breaks the rule)."""
    if bound is None:
        return
    over = np.flatnonzero(np.isfinite(values) & (values > bound))
    if over.size:
        axes.plot(over, values[over], "o", markersize=4, color=colour, markeredgecolor=OVER_COLOUR,
                  label=f"{label}{over.size} position{'s' if over.size != 1 else ''} over the bound")


@_styled
def drift_svg(element_id: str, maximum: np.ndarray, mean: np.ndarray,
              bound_maximum: float | None, bound_mean: float | None) -> str:
    """Per-position max and mean |Δlogit| against the identity's bounds (dashed). The max bound
    holds at every position (positions over it are marked red); the mean bound holds for the
    mean over all positions, drawn dotted beside it."""
    figure = _figure(LINE_HEIGHT_IN)
    axes = figure.add_subplot()
    positions = np.arange(maximum.shape[0])
    axes.plot(positions, maximum, color=MAX_COLOUR, linewidth=1.1, label="max |Δlogit|")
    axes.plot(positions, mean, color=MEAN_COLOUR, linewidth=1.1, label="mean |Δlogit|")
    axes.axhline(float(np.mean(mean)), color=MEAN_COLOUR, linestyle=":", linewidth=1.4,
                 label=f"mean over positions {float(np.mean(mean)):.6g}")
    if bound_maximum is not None:
        axes.axhline(bound_maximum, color=MAX_COLOUR, linestyle="--", linewidth=1.0,
                     label=f"bound: max {bound_maximum:.6g}")
    if bound_mean is not None:
        axes.axhline(bound_mean, color=MEAN_COLOUR, linestyle="--", linewidth=1.0,
                     label=f"bound: mean over positions {bound_mean:.6g}")
    _over_bound(axes, maximum, bound_maximum, OVER_COLOUR, "")
    _mark_nonfinite(axes, maximum, "max")
    axes.set_xlim(0, max(1, maximum.shape[0] - 1))
    axes.set_ylim(bottom=0)
    axes.set_xlabel("decoded position")
    axes.set_ylabel("|handoff − cold| logit")
    axes.legend(loc="upper right", fontsize=8, ncols=2, framealpha=0.9)
    return _svg_text(figure, element_id)


@_styled
def margin_svg(element_id: str, margins: np.ndarray, handoff_tokens: np.ndarray, cold_tokens: np.ndarray,
               maximum: np.ndarray) -> str:
    """The cold branch's top-1 minus top-2 logit per position (how far a token was from flipping)
    beside max |Δlogit|; positions whose tokens differ are marked, the first one with a line."""
    figure = _figure(LINE_HEIGHT_IN)
    axes = figure.add_subplot()
    positions = np.arange(margins.shape[0])
    axes.plot(positions, margins, color=MARGIN_COLOUR, linewidth=1.1, label="cold top-1 − top-2 margin")
    axes.plot(positions, maximum, color=MAX_COLOUR, linewidth=0.8, alpha=0.6, label="max |Δlogit|")
    differs = np.flatnonzero(handoff_tokens != cold_tokens)
    if differs.size:
        first = int(differs[0])
        axes.axvline(first, color=OVER_COLOUR, linewidth=1.4, label=f"first divergence: position {first}")
        axes.plot(differs, np.zeros(differs.size), "|", markersize=10, color=OVER_COLOUR,
                  label=f"tokens differ: {differs.size} positions")
    _mark_nonfinite(axes, margins, "margin")
    axes.set_xlim(0, max(1, margins.shape[0] - 1))
    axes.set_ylim(bottom=0)
    axes.set_xlabel("decoded position")
    axes.set_ylabel("logit")
    axes.legend(loc="upper right", fontsize=8, ncols=2, framealpha=0.9)
    return _svg_text(figure, element_id)


@dataclass(frozen=True)
class HeatRow:
    """One heat-map row: its label and the per-layer deltas (K or V of one sample)."""

    label: str
    deltas: np.ndarray
    tensor: int  # 0 for K, 1 for V: which column of the envelope bounds it


def _ratios(rows: Sequence[HeatRow], layers: int, envelope: Sequence[tuple[float, float]]) -> np.ndarray:
    """Each delta over its layer's envelope (0 for a zero delta on a zero envelope, inf over one)."""
    ratios = np.full((len(rows), layers), np.nan)
    for index, row in enumerate(rows):
        for layer in range(min(layers, row.deltas.shape[0])):
            delta, bound = float(row.deltas[layer]), envelope[layer][row.tensor]
            if not np.isfinite(delta):
                continue
            ratios[index, layer] = delta / bound if bound > 0 else (0.0 if delta == 0 else np.inf)
    return ratios


def _text_colour(value: float, ratio_mode: bool, deltas: np.ndarray) -> str:
    """White on the dark cells (deep blue near the envelope, viridis' low end), black elsewhere."""
    if not np.isfinite(value):
        return "black"
    if ratio_mode:
        return "white" if 0.6 <= value <= 1.0 else "black"
    finite = deltas[np.isfinite(deltas)]
    top = float(finite.max()) if finite.size else 0.0
    return "white" if top == 0 or value < 0.55 * top else "black"


@_styled
def kv_heatmap_svg(element_id: str, rows: Sequence[HeatRow],
                   envelope: Sequence[tuple[float, float]] | None) -> str:
    """Layers across, K and V per sample down: coloured by delta over the calibrated envelope
    (blue within, red over) when there is one, else by the raw delta."""
    from matplotlib.colors import LinearSegmentedColormap, Normalize

    layers = max(row.deltas.shape[0] for row in rows)
    deltas = np.full((len(rows), layers), np.nan)
    for index, row in enumerate(rows):
        deltas[index, : row.deltas.shape[0]] = row.deltas
    figure = _figure(min(9.0, 1.0 + 0.32 * len(rows)))
    axes = figure.add_subplot()
    ratio_mode = envelope is not None and len(envelope) >= layers
    # pcolormesh masks NaN cells itself: they take the colour map's "bad" grey.
    if envelope is not None and ratio_mode:
        ratios = _ratios(rows, layers, envelope)
        # Ratio 1 sits at 0.8 of the scale: within the envelope shades of blue, over it red.
        colours = LinearSegmentedColormap.from_list(
            "envelope", [(0.0, "#f2f7fd"), (0.8, "#2b6cb0"), (0.8001, "#fc9272"), (1.0, OVER_COLOUR)]
        ).with_extremes(bad="#bdbdbd")
        mesh = axes.pcolormesh(np.minimum(ratios, 1.25), cmap=colours,
                               norm=Normalize(0.0, 1.25), edgecolors="white", linewidth=0.5)
        figure.colorbar(mesh, ax=axes, label="delta / envelope", pad=0.01)
    else:
        ratios = np.full_like(deltas, np.nan)
        import matplotlib

        raw = matplotlib.colormaps["viridis"].with_extremes(bad="#bdbdbd")
        mesh = axes.pcolormesh(deltas, cmap=raw, edgecolors="white", linewidth=0.5)
        figure.colorbar(mesh, ax=axes, label="max |delta|", pad=0.01)
    if len(rows) * layers <= _MAX_ANNOTATED_CELLS:
        for index in range(len(rows)):
            for layer in range(layers):
                delta, ratio = deltas[index, layer], ratios[index, layer]
                text = f"{delta:.4g}" if np.isfinite(delta) else "NaN"
                if ratio_mode and np.isfinite(delta):
                    text += "\nover 0" if np.isinf(ratio) else f"\n{ratio:.0%}"
                axes.text(layer + 0.5, index + 0.5, text, ha="center", va="center", fontsize=7,
                          color=_text_colour(ratio if ratio_mode else delta, ratio_mode, deltas))
    axes.set_xticks(np.arange(layers) + 0.5, [str(layer) for layer in range(layers)])
    axes.set_yticks(np.arange(len(rows)) + 0.5, [row.label for row in rows])
    axes.invert_yaxis()
    axes.grid(False)
    axes.set_xlabel("layer")
    return _svg_text(figure, element_id)


@dataclass(frozen=True)
class Curve:
    """One receipt's per-position drift on a comparison plot."""

    label: str
    maximum: np.ndarray
    mean: np.ndarray
    bound_maximum: float | None
    bound_mean: float | None


@_styled
def compare_drift_svg(element_id: str, curves: Sequence[Curve]) -> str:
    """Per position, one colour per receipt: max |Δlogit| with each receipt's max bound dashed
    (top), mean |Δlogit| (middle) and, with two or more receipts, each one's max |Δlogit| minus
    the first receipt's (bottom: where a fault run departs from a passing one)."""
    figure = _figure(7.2 if len(curves) > 1 else 4.8)
    panels = figure.subplots(3 if len(curves) > 1 else 2, 1, sharex=True)
    top, middle = panels[0], panels[1]
    longest = max(max(curve.maximum.shape[0] for curve in curves), 2)
    reference = curves[0]
    for index, curve in enumerate(curves):
        colour = PALETTE[index % len(PALETTE)]
        positions = np.arange(curve.maximum.shape[0])
        top.plot(positions, curve.maximum, color=colour, linewidth=1.1, label=curve.label)
        middle.plot(positions, curve.mean, color=colour, linewidth=1.1)
        if curve.bound_maximum is not None:
            top.axhline(curve.bound_maximum, color=colour, linestyle="--", linewidth=0.9)
        _over_bound(top, curve.maximum, curve.bound_maximum, colour, f"{index + 1}: ")
        _mark_nonfinite(top, curve.maximum, f"{index + 1}")
        if len(curves) > 1 and index > 0:
            length = min(curve.maximum.shape[0], reference.maximum.shape[0])
            with np.errstate(invalid="ignore"):  # inf - inf is NaN: not drawn, like any NaN
                difference = curve.maximum[:length] - reference.maximum[:length]
            panels[2].plot(np.arange(length), difference, color=colour, linewidth=1.1)
    top.set_ylabel("max |Δlogit|")
    middle.set_ylabel("mean |Δlogit|")
    for axes in (top, middle):
        axes.set_ylim(bottom=0)
    if len(curves) > 1:
        panels[2].axhline(0.0, color="#555555", linewidth=0.8)
        panels[2].set_ylabel("max − receipt 1's")
    panels[-1].set_xlim(0, longest - 1)
    panels[-1].set_xlabel("decoded position (dashed: each receipt's max bound)")
    top.legend(loc="upper right", fontsize=8, framealpha=0.9)
    return _svg_text(figure, element_id)
