"""The units an identity's logit bounds are in (seed §32.6), and their engine-side spelling.

Both engines' logits are compared in these units; a bound stated in other units would be
meaningless. Engines name their units as a string (``raw`` or ``tanh-softcap:<cap>``,
``qualify.engines.base.Engine.logit_units``); the identity states them as a small tagged object.
"""

from __future__ import annotations

import math
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from qualify.core.errors import Refused

SOFTCAP_PREFIX = "tanh-softcap:"


class RawLogitUnits(BaseModel):
    """Bounds are in raw logits."""

    model_config = ConfigDict(frozen=True, strict=True, extra="forbid")

    transform: Literal["raw"]


class SoftcapLogitUnits(BaseModel):
    """Bounds are in ``cap * tanh(logit / cap)`` units, applied by both engines (seed §32.6)."""

    model_config = ConfigDict(frozen=True, strict=True, extra="forbid")

    transform: Literal["tanh-softcap"]
    cap: Annotated[float, Field(gt=0, allow_inf_nan=False)]


LogitUnits = Annotated[RawLogitUnits | SoftcapLogitUnits, Field(discriminator="transform")]
"""An identity's ``logit_units``: tagged by ``transform``."""


def logit_units_label(units: RawLogitUnits | SoftcapLogitUnits) -> str:
    """The engine-side spelling of logit units: ``raw`` or ``tanh-softcap:<cap>``."""
    if isinstance(units, SoftcapLogitUnits):
        return f"{SOFTCAP_PREFIX}{units.cap!r}"
    return "raw"


def parse_logit_units(label: str) -> RawLogitUnits | SoftcapLogitUnits:
    """The identity's units for an engine-side label; anything but ``raw`` or
    ``tanh-softcap:<finite positive cap>`` is refused."""
    if label == "raw":
        return RawLogitUnits(transform="raw")
    if label.startswith(SOFTCAP_PREFIX):
        try:
            cap = float(label[len(SOFTCAP_PREFIX):])
        except ValueError:
            cap = math.nan
        if math.isfinite(cap) and cap > 0:
            return SoftcapLogitUnits(transform="tanh-softcap", cap=cap)
    raise Refused(f"logit units: found {label!r}, expected raw or {SOFTCAP_PREFIX}<finite positive cap>")


__all__ = ["LogitUnits", "RawLogitUnits", "SoftcapLogitUnits", "logit_units_label", "parse_logit_units"]
